"""An AdamW backup's load, staged on a shadow (docs/hybrid.md §8 step 5).

torch's ``Optimizer.load_state_dict`` mutates before it can fail, so the hybrid runs it on a
shadow optimizer built from a copy of the live groups, after validating the checkpoint itself;
the live AdamW is only touched by the final, non-throwing swap.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.core.extension import copy_containers, torch_indices
from gefen.dist import (
    Channel,
    check_rank_local_header,
    check_rank_local_records,
    collect_failure_scope,
    rank_local_header,
)
from gefen.dist.torch_internals import (
    copy_with_load_pre_hooks,
    fresh_hook_registries,
    run_load_post_hooks,
)
from gefen.hybrid.adamw_preflight import check_adamw_options, check_capturable
from gefen.hybrid.adamw_template import drop_unstarted_entries

__all__ = ["RANK_LOCAL_KEY", "PreparedAdamWLoad", "adamw_rank_local_header", "prepare_adamw_load"]

RANK_LOCAL_KEY = "rank_local"
"""The key of a sharded AdamW backup's rank-local header inside its state dict (torch ignores
top-level keys it does not know)."""


def _reject(reason: str) -> ValueError:
    return ValueError(f"GefenMuonHybrid checkpoint: AdamW backup: {reason}")


@dataclass(eq=False)
class PreparedAdamWLoad:
    """The shadow's state and groups; ``commit`` swaps them in by assignment only."""

    backup: torch.optim.Optimizer
    state: Any
    param_groups: list[dict[str, Any]]
    rank_local: tuple[dict[str, Any], int, tuple[Channel, ...]] | None = None
    replica_words: tuple[int, int] = (0, 0)  # rank-local: nothing the load vote compares

    def agree(self, operation: object) -> None:
        """A sharded backup's state is rank-local: every member must load its own rank's file
        of the same step (docs/dist.md §10.3); symmetric, on gathered records."""
        if self.rank_local is not None:
            header, tag, scope = self.rank_local
            check_rank_local_records(header, tag, scope=scope, owner_name="GefenMuonHybrid")

    def commit(self) -> None:
        self.backup.state = self.state
        self.backup.param_groups = self.param_groups

    def run_post_hooks(self) -> None:
        run_load_post_hooks(self.backup)


def _check_step(where: str, step: object) -> None:
    if isinstance(step, Tensor):
        if step.layout != torch.strided or step.is_meta:
            kind = "meta" if step.is_meta else str(step.layout)
            raise _reject(f"{where}: 'step' must be a dense tensor holding data, got {kind}")
        if step.numel() != 1 or step.is_complex() or step.dtype == torch.bool:
            raise _reject(f"{where}: 'step' must be a 1-element real tensor or a number")
        value = float(step.detach().reshape(()).item())
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise _reject(f"{where}: 'step' must be a number, got {type(step).__name__}")
    if not math.isfinite(value) or value < 0:
        raise _reject(f"{where}: 'step' must be finite and >= 0, got {value}")


def _check_entry(where: str, entry: object, param: Tensor, amsgrad: bool) -> None:
    if not isinstance(entry, Mapping):
        raise _reject(f"{where}: the entry must be a dict")
    if not entry:
        return
    required = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    for key in required:
        if key not in entry:
            raise _reject(f"{where}: missing '{key}'")
    _check_step(where, entry["step"])
    for key in required[1:]:
        value = entry[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(param.shape):
            raise _reject(f"{where}: '{key}' must be a tensor of shape {tuple(param.shape)}")
        _check_moment(f"{where}: '{key}'", value, non_negative=key != "exp_avg")


def _check_moment(where: str, value: Tensor, *, non_negative: bool) -> None:
    """Layout and dtype before values, so torch never raises its own error first."""
    if value.layout != torch.strided or value.device.type == "meta":
        raise _reject(f"{where} must be a dense strided tensor holding data")
    if not value.is_floating_point():
        raise _reject(f"{where} must be a floating tensor, got {value.dtype}")
    if not bool(torch.isfinite(value).all()):
        raise _reject(f"{where} must be finite")
    if non_negative and bool((value < 0).any()):
        raise _reject(f"{where} must be >= 0")


def _validate(backup: torch.optim.Optimizer, sd: object) -> None:
    if not isinstance(sd, Mapping):
        raise _reject("the state dict must be a dict")
    state, groups = sd.get("state"), sd.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise _reject("needs 'state' (a dict) and 'param_groups' (a list)")
    live = backup.param_groups
    if len(groups) != len(live):
        raise _reject(f"the group count {len(groups)} differs from the live count {len(live)}")
    for index, (saved, group) in enumerate(zip(groups, live, strict=True)):
        ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            raise _reject(f"group {index} must list {len(group['params'])} parameters")
        names = saved.get("param_names", ids)  # as the Gefen backup's load rules them
        if not isinstance(names, list) or len(names) != len(ids):
            raise _reject(f"group {index}: param_names must be a list of the group's length")
        if "param_names" in saved and any(type(name) is not str for name in names):
            raise _reject(f"group {index}: param_names must hold str")
    _check_identifiers(backup, state, [ident for saved in groups for ident in saved["params"]])
    for index, (saved, group) in enumerate(zip(groups, live, strict=True)):
        ids = saved["params"]
        try:
            check_adamw_options({**group, **saved}, f"group {index}")
            check_capturable({**group, **saved}, group["params"], f"group {index}")
        except ValueError as error:
            raise _reject(str(error)) from None
        amsgrad = bool(saved.get("amsgrad", group.get("amsgrad", False)))
        for ident, param in zip(ids, group["params"], strict=True):
            if ident in state:
                _check_entry(f"group {index} entry {ident!r}", state[ident], param, amsgrad)


def _check_identifiers(
    backup: torch.optim.Optimizer, state: Mapping[Any, Any], ids: list[Any]
) -> None:
    """Parameter ids as torch's ``state_dict`` writes them (``torch_indices``: 0..n-1 in group
    order, a repeated parameter under one index), entries only for those ids; a live entry the
    checkpoint lacks restarts from zero, with a warning."""
    expected = [index for group in torch_indices(backup.param_groups) for index in group]
    if any(type(ident) is not int for ident in ids) or ids != expected:
        wanted = f"0..{len(ids) - 1}" if expected == list(range(len(ids))) else str(expected[:8])
        raise _reject(
            f"parameter ids must be {wanted} in group order, as torch's state_dict "
            f"writes them (got {ids[:8]}{'…' if len(ids) > 8 else ''}): a re-keyed checkpoint"
        )
    listed = set(expected)
    # a key that is no parameter id is the user's (the hybrid's own, kept when the backup is
    # its first child), as torch's load keeps it
    unknown = sorted((key for key in state if type(key) is int and key not in listed), key=repr)
    if unknown:
        raise _reject(f"state holds entries for parameter ids no group lists: {unknown[:8]}")
    live = [param for group in backup.param_groups for param in group["params"]]
    names = [name for group in backup.param_groups for name in group.get("param_names", ())]
    dropped = sorted(
        {
            (names[at] if len(names) == len(live) else ident)
            for at, (ident, param) in enumerate(zip(expected, live, strict=True))
            if backup.state.get(param) and ident not in state
        },
        key=repr,
    )
    if dropped:
        warnings.warn(
            f"GefenMuonHybrid checkpoint: AdamW backup: no entry for parameters {dropped[:8]} "
            "(by name, else by id within the backup's part), which have state now: their "
            "moments restart from zero",
            UserWarning,
            stacklevel=6,
        )


def _shadow(backup: torch.optim.Optimizer) -> torch.optim.Optimizer:
    shadow: torch.optim.Optimizer = object.__new__(type(backup))
    shadow.__dict__.update(backup.__dict__)
    shadow.defaults = dict(backup.defaults)
    shadow.state = defaultdict(dict)
    shadow.param_groups = [dict(group) for group in backup.param_groups]
    fresh_hook_registries(shadow)
    return shadow


def _fill_missing_options(backup: torch.optim.Optimizer, sd: Any) -> None:
    """A saved group without an option gets the constructor's value, with a warning (torch
    would load the group without it and fail at the next step)."""
    groups = sd.get("param_groups") if isinstance(sd, Mapping) else None
    if not isinstance(groups, list) or len(groups) != len(backup.param_groups):
        return  # _validate rejects the structure
    for index, saved in enumerate(groups):
        if not isinstance(saved, dict):
            continue
        missing = [name for name in backup.defaults if name not in saved]
        if missing:
            values = ", ".join(f"{name}={backup.defaults[name]!r}" for name in missing)
            warnings.warn(
                f"GefenMuonHybrid checkpoint: AdamW backup group {index} was saved without "
                f"{', '.join(map(repr, missing))}; the constructor's values are used ({values})",
                UserWarning,
                stacklevel=6,
            )
            saved.update({name: backup.defaults[name] for name in missing})


def adamw_rank_local_header(backup: torch.optim.Optimizer) -> dict[str, Any] | None:
    """This rank's topology for a sharded (DTensor) backup's rank-local file, else None."""
    scope = collect_failure_scope(backup.param_groups)
    return rank_local_header(scope) if scope else None


def _rank_local(
    backup: torch.optim.Optimizer, sd: Mapping[str, Any]
) -> tuple[dict[str, Any], int, tuple[Channel, ...]] | None:
    """A sharded backup's file written whole must be this rank's (its header), tagged by its
    latest step. Without the header it is DCP's (``get_optimizer_state_dict`` drops the
    top-level keys that carry it): torch's AdamW state is DTensors, which DCP reshards to this
    rank's shards, so it loads at any world size (docs/hybrid.md §8)."""
    scope = collect_failure_scope(backup.param_groups)
    header = sd.get(RANK_LOCAL_KEY)
    if not scope or header is None:
        return None
    if not isinstance(header, dict):
        raise _reject(f"a sharded backup's {RANK_LOCAL_KEY!r} header must be a dict")
    try:
        check_rank_local_header(header, scope)
    except ValueError as error:
        raise _reject(str(error)) from None
    steps = [_step_value(entry.get("step")) for entry in sd["state"].values()]
    return header, int(max(steps, default=0)), scope


def _step_value(step: object) -> float:
    if isinstance(step, Tensor):
        return float(step.detach().reshape(()).item())
    return float(step)  # type: ignore[arg-type]  # validated: a number


def prepare_adamw_load(backup: torch.optim.Optimizer, sd: Any) -> PreparedAdamWLoad:
    """Copy, run the backup's load pre-hooks on the copy, validate, load into a shadow."""
    copied = copy_with_load_pre_hooks(backup, copy_containers(sd))
    _fill_missing_options(backup, copied)
    _validate(backup, copied)
    drop_unstarted_entries(copied)
    rank_local = _rank_local(backup, copied)
    for entry in copied["state"].values():  # owned: torch's load would keep the caller's
        if isinstance(entry, dict):  # (a user key's value is kept as it is)
            entry.update({k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)})
    shadow = _shadow(backup)
    torch.optim.Optimizer.load_state_dict(shadow, copied)
    return PreparedAdamWLoad(backup, shadow.state, shadow.param_groups, rank_local)
