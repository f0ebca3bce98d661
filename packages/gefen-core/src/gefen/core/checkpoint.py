"""The load transaction of the shell's checkpoints (docs/core.md §8.2–§8.3).

``gefen.core.saving`` writes them (torch's layout plus the ``"gefen"`` extras, mirrored into
every group). ``prepare_load`` copies the caller's containers, runs the load pre-hooks on the copy,
validates everything and stages the complete new state on shadow objects; ``PreparedLoad``
publishes it without any step that can throw. Every rejection is a ValueError
``"{OWNER_NAME} checkpoint: <rule>"``.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.core.deferred import assemble_pending
from gefen.core.options import codebook_size, group_uses_codebook, owned_option
from gefen.core.replicas import NO_REPLICA, load_replica_words
from gefen.core.resharding import check_row_periods
from gefen.core.saving import BASE_EXTRAS, EXTRAS_KEY, FORMAT_VERSION, OWNER_EXTRA, scope_extras
from gefen.core.scoped import load_header_payload
from gefen.core.state import is_initialized, validate_codebook
from gefen.core.template import TEMPLATE_FORMAT, absorb_extras, absorb_state, flattened_dcp_hint
from gefen.core.transaction import copy_containers
from gefen.core.validation import is_dtensor, local_tensor, parameter_label
from gefen.dist import (
    GuardedOperation,
    check_rank_local_header,
    check_rank_local_records,
)
from gefen.dist.codebook_scope import LOAD_HEADER_WORD_NAMES, OP_LOAD
from gefen.dist.torch_internals import copy_with_load_pre_hooks, run_load_post_hooks

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = ["PreparedLoad", "prepare_load"]

# Group options the live optimizer always keeps, whatever the checkpoint says (§8.3).
LIVE_OPTIONS = ("fused", "check_finite", "codebook_refresh_every", "stochastic_round")
FIXED_OPTIONS = ("momentum_codec", "deterministic")  # a saved group must match the live one


# -- load ---------------------------------------------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return False
        if a.layout != torch.strided or b.layout != torch.strided or a.is_meta or b.is_meta:
            return a is b  # nothing to read: the validator of the copy kept rejects it by name
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.cpu(), b.cpu()  # equal NaNs are equal: the copies agree, the validator names NaN
        return bool(torch.equal(a, b)) or (
            a.is_floating_point() and bool(torch.isclose(a, b, 0, 0, equal_nan=True).all())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


@dataclass(eq=False)
class PreparedLoad:
    """A validated, staged load. ``commit()`` cannot fail; ``run_post_hooks()`` runs once."""

    optimizer: ShellInterface
    state: defaultdict[Tensor, Any]
    param_groups: list[dict[str, Any]]
    global_step: int
    codebook: Tensor | None
    rank_local: dict[str, Any] | None
    replica_words: tuple[int, int] = NO_REPLICA  # the load vote compares them (replicas.py)

    def agree(self, operation: GuardedOperation) -> None:
        """Symmetric checks on gathered data: with a codebook scope the load's header (the step,
        codebook, replicated state and options it would publish, docs/dist.md §9.2), the
        rank-local records (§10.3), then the pending entries' assembly (gefen.core.deferred)."""
        if operation.binding is not None:
            published = (self.global_step, self.codebook, self.replica_words, self.param_groups)
            words = load_header_payload(self.optimizer, *published)
            if words is not None:
                operation.header(OP_LOAD, words, LOAD_HEADER_WORD_NAMES)
        if self.rank_local is not None and len(operation.scope) > 0:
            check_rank_local_records(
                self.rank_local,
                self.global_step,
                scope=operation.scope,
                owner_name=self.optimizer.OWNER_NAME,
            )
        assemble_pending(self.state, operation)  # after the vote: every rank reaches the gathers

    def commit(self) -> None:
        """Publish by assignment only; clears the failed-commit latch."""
        self.optimizer.publish_load(self.state, self.param_groups, self.global_step, self.codebook)

    def run_post_hooks(self) -> None:
        run_load_post_hooks(self.optimizer)


class _Loader:
    """One ``prepare_load`` call: the copied dict and the live optimizer it is checked against."""

    def __init__(self, optimizer: ShellInterface, sd: dict[str, Any]) -> None:
        self.optimizer = optimizer
        self.owner = optimizer.OWNER_NAME
        self.sd = sd

    def reject(self, rule: str) -> ValueError:
        """A load rejection in the loader's one format."""
        return ValueError(f"{self.owner} checkpoint: {rule}")

    # structure

    def structure(
        self,
    ) -> tuple[dict[Any, Any], list[dict[str, Any]], list[list[Any]], dict[Any, Any]]:
        """The parameters' saved entries, the groups, each group's ids, and the entries under
        other keys (torch restores those as they are; an int key must be a listed id)."""
        sd = self.sd
        if not isinstance(sd, dict):
            raise self.reject(f"the state dict must be a dict, got {type(sd).__name__}")
        state, groups = sd.get("state"), sd.get("param_groups")
        if not isinstance(state, dict):
            raise self.reject("'state' must be a dict")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise self.reject("'param_groups' must be a list of dicts")
        live_groups = self.optimizer.param_groups
        if len(groups) != len(live_groups):
            raise self.reject(
                f"the group count {len(groups)} differs from the live count {len(live_groups)}"
            )
        identifiers: list[list[Any]] = []
        for index, (saved, live) in enumerate(zip(groups, live_groups, strict=True)):
            params = saved.get("params")
            if not isinstance(params, list) or len(params) != len(live["params"]):
                raise self.reject(f"group {index} 'params' must list {len(live['params'])} ids")
            identifiers.append(params)
        flat = [ident for ids in identifiers for ident in ids]
        if any(not isinstance(i, (int, str)) or isinstance(i, bool) for i in flat):
            raise self.reject("parameter identifiers must be ints or FQN strings")
        live_ids = [id(p) for group in live_groups for p in group["params"]]
        if _first_places(flat) != _first_places(live_ids):
            raise self.reject(
                "parameter identifiers in 'params' must be unique, except where the live groups "
                "list one parameter more than once (then at exactly those places)"
            )
        # A key of the identifiers' own kind (an int; a str where FQNs identify) that no group
        # lists is a damaged or re-keyed entry; any other key is the state's own, as in torch.
        listed, kinds = set(flat), {int} | {type(ident) for ident in flat}
        unknown = [key for key in state if key not in listed and type(key) in kinds]
        if unknown:
            raise self.reject(f"'state' holds an entry for unknown parameter id {unknown[0]!r}")
        others = {key: value for key, value in state.items() if key not in listed}
        entries = {key: value for key, value in state.items() if key in listed}
        return entries, groups, identifiers, others

    # extras

    def extras(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        copies = [g[EXTRAS_KEY] for g in groups if EXTRAS_KEY in g]
        if copies and len(copies) != len(groups):
            raise self.reject("extras 'gefen' present in only some parameter groups")
        if EXTRAS_KEY in self.sd:
            copies.insert(0, self.sd[EXTRAS_KEY])
        if not copies:
            hint = flattened_dcp_hint(self.sd.get("param_groups"), self.optimizer.param_groups)
            raise self.reject(f"extras 'gefen' missing (neither top-level nor in the groups){hint}")
        if any(not _equal(self.comparable(copies[0], other), other) for other in copies[1:]):
            raise self.reject("extras copies differ between the top level and the groups")
        extras = copies[0]
        if not isinstance(extras, dict):
            raise self.reject("extras 'gefen' must be a dict")
        loaded: dict[str, Any] = extras
        self.check_header(loaded)  # the version and codec first: they decide how the rest reads
        if self.optimizer.TEMPLATE_COMPLETE and loaded.get("format_version") == TEMPLATE_FORMAT:
            try:
                count = sum(len(group["params"]) for group in groups)
                loaded = absorb_extras(loaded, count, codebook_size(self.optimizer.param_groups))
            except ValueError as error:
                raise self.reject(str(error)) from None
        self.check_extras(loaded)
        return loaded

    def comparable(self, first: Any, copy: Any) -> Any:
        """``first`` as the group ``copy`` must equal it: without the top-level-only keys (the
        ``TOP_LEVEL_EXTRAS`` and the writer, §8.1, and a row-sharded save's ``rank_local``,
        §9.1) it lacks."""
        if not isinstance(first, dict) or not isinstance(copy, dict) or EXTRAS_KEY not in self.sd:
            return first
        optional = {*self.optimizer.TOP_LEVEL_EXTRAS, OWNER_EXTRA}
        if self.optimizer.row_sharded():
            optional.add("rank_local")
        return {key: value for key, value in first.items() if key in copy or key not in optional}

    def check_extras(self, extras: dict[str, Any]) -> None:
        allowed = {*BASE_EXTRAS, *self.optimizer.OPTIONAL_EXTRAS, OWNER_EXTRA}
        for key in extras:
            if key not in allowed:
                raise self.reject(f"unknown extras key {key!r}")
        for key in BASE_EXTRAS:
            if key not in extras:
                raise self.reject(f"extras key {key!r} is missing")
        step = extras["global_step"]
        if type(step) is not int or step < 0:
            raise self.reject(f"global_step must be an int >= 0, got {step!r}")
        if step >= 2**63:  # the step header's words and the stochastic-rounding seed: 64 bits
            raise self.reject(f"global_step must be below 2**63, got {step}")
        live = self.optimizer.defaults
        if (
            type(extras["deterministic"]) is not bool
            or extras["deterministic"] != live["deterministic"]
        ):
            raise self.reject(
                "deterministic differs from the live flag (changing it requires a fresh optimizer)"
            )
        self.check_codebook(extras["codebook"])
        self.check_topology(extras)
        positions = extras["initialized_params"]
        if not isinstance(positions, list) or any(type(p) is not int for p in positions):
            raise self.reject("initialized_params must be a list of ints")

    def check_header(self, extras: dict[str, Any]) -> None:
        live_owner = self.optimizer.CHECKPOINT_OWNER  # a subclass's is its base's
        owner = extras.get(OWNER_EXTRA, live_owner)
        if owner != live_owner:  # the structure alone tells the classes apart only once stepped
            raise self.reject(
                f"this is a checkpoint of {owner!r} (extras {OWNER_EXTRA!r}), not of a "
                f"{live_owner}: load it into the optimizer that wrote it"
            )
        version, formats = extras.get("format_version"), [FORMAT_VERSION]
        if self.optimizer.TEMPLATE_COMPLETE:  # it writes format 2 and still reads format 1
            formats.append(TEMPLATE_FORMAT)
        if type(version) is not int or version not in formats:
            raise self.reject(f"format_version must be {' or '.join(map(str, formats))}")
        live = self.optimizer.defaults["momentum_codec"]
        if "momentum_codec" in extras and extras["momentum_codec"] != live:
            raise self.reject(
                f"momentum_codec {extras['momentum_codec']!r} differs from the live {live!r}"
            )

    def check_codebook(self, codebook: object) -> None:
        if codebook is None:
            return
        if not self.optimizer.uses_codebook:
            raise self.reject("momentum_codec 'none' holds no codebook")
        try:
            validate_codebook(codebook, codebook_size(self.optimizer.param_groups))
        except ValueError as error:
            raise self.reject(f"invalid codebook: {error}") from None

    def check_topology(self, extras: dict[str, Any]) -> None:
        live_scope = scope_extras(self.optimizer)
        if "scope" in extras or live_scope is not None:
            saved_scope = extras.get("scope")
            if saved_scope is None or live_scope is None or not _equal(saved_scope, live_scope):
                raise self.reject(
                    "codebook scope differs (a scoped checkpoint loads only into an optimizer "
                    "finalized with an equal scope, and a scoped optimizer needs one)"
                )
        scope = self.optimizer.step_failure_scope()
        if "rank_local" not in extras and not self.optimizer.rank_local_checkpoint():
            return
        if "rank_local" not in extras:
            if self.optimizer.row_sharded():
                return  # a DCP file of row-sharded state: any rank, any world size (§9.1)
            raise self.reject("rank-local checkpoint topology differs: 'rank_local' is missing")
        try:
            check_rank_local_header(extras["rank_local"], scope)
        except ValueError as error:
            raise self.reject(str(error)) from None

    # groups

    def group(self, index: int, saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
        staged = {k: owned_option(v) for k, v in saved.items() if k not in ("params", EXTRAS_KEY)}
        defaults = self.optimizer.defaults
        self.fixed_options(index, staged, live)
        kept = (*LIVE_OPTIONS, *FIXED_OPTIONS)
        filled = [name for name in defaults if name not in staged and name not in kept]
        if filled:
            # A group saved without an option (a hand-edited or older checkpoint): say which
            # value it gets, instead of silently training with the constructor's.
            values = ", ".join(f"{name}={defaults[name]!r}" for name in filled)
            warnings.warn(
                f"{self.optimizer.OWNER_NAME} checkpoint: group {index} was saved without "
                f"{', '.join(repr(name) for name in filled)}; the constructor's values are "
                f"used ({values})",
                UserWarning,
                stacklevel=5,
            )
        for name, value in defaults.items():
            staged.setdefault(name, value)
        for name in kept:
            if name in live:
                staged[name] = live[name]
        if isinstance(staged.get("betas"), list):
            staged["betas"] = tuple(staged["betas"])
        staged["params"] = list(live["params"])
        self.names(index, staged, live)
        try:
            self.optimizer.validate_group(staged)
        except (ValueError, TypeError, RuntimeError) as error:
            raise self.reject(f"group {index}: {error}") from None
        return staged

    def fixed_options(self, index: int, saved: dict[str, Any], live: dict[str, Any]) -> None:
        """A saved group's codec and determinism, where given, are the live group's."""
        if "deterministic" in saved and not _equal(saved["deterministic"], live["deterministic"]):
            raise self.reject(
                f"group {index}: deterministic differs from the live flag (changing it "
                "requires a fresh optimizer)"
            )
        if "momentum_codec" in saved and not _equal(
            saved["momentum_codec"], live["momentum_codec"]
        ):
            raise self.reject(
                f"group {index}: momentum_codec {saved['momentum_codec']!r} differs from the "
                f"live {live['momentum_codec']!r}"
            )

    def names(self, index: int, staged: dict[str, Any], live: dict[str, Any]) -> None:
        if "param_names" not in staged:
            if "param_names" in live:
                staged["param_names"] = list(live["param_names"])
            return
        names = staged["param_names"]
        if not isinstance(names, list) or len(names) != len(live["params"]):
            raise self.reject(f"group {index}: param_names must be a list of the group's length")
        if any(type(name) is not str for name in names):
            raise self.reject(f"group {index}: param_names must hold str")
        for saved_name, live_name in zip(names, live.get("param_names", names), strict=True):
            if saved_name != live_name:
                warnings.warn(
                    f"{self.owner} load: parameter name {saved_name!r} replaces {live_name!r}",
                    UserWarning,
                    stacklevel=5,
                )
                break


def _label_at(groups: list[dict[str, Any]], position: int) -> str:
    """The label of the parameter at an in-range flat position."""
    for group_index, group in enumerate(groups):
        size = len(group["params"])
        if position < size:
            return parameter_label(group, group_index, position)
        position -= size
    raise IndexError(position)


def _saved_entries(
    loader: _Loader,
    state: dict[Any, Any],
    identifiers: list[list[Any]],
    extras: dict[str, Any],
    groups: list[dict[str, Any]],
) -> dict[int, Any]:
    """Saved entries by flat position; a frozen parameter listed as initialized keeps its live
    entry (DCP drops frozen parameters' state), with one warning.

    ``groups`` are the staged groups, so the warning names parameters as the entry errors of
    ``stage_entries`` do (with the checkpoint's ``param_names`` when it has them)."""
    optimizer = loader.optimizer
    flat = [ident for ids in identifiers for ident in ids]
    saved = {position: state[ident] for position, ident in enumerate(flat) if ident in state}
    indexed = optimizer.indexed_params()
    for position in extras["initialized_params"]:
        if not 0 <= position < len(flat):
            raise loader.reject(f"initialized_params lists position {position} out of range")
        entry, (_, _, param) = saved.get(position), indexed[position]
        if entry is not None and (not isinstance(entry, Mapping) or "step" in entry):
            continue  # initialized, or malformed and left to the entry validator
        if entry is not None and is_dtensor(param) and local_tensor(param).numel() == 0:
            continue  # this rank holds no row of it, so no state (docs/core.md §9.1)
        if param.requires_grad or not is_initialized(optimizer.state.get(param, {})):
            bare = entry is None or entry == {"period": 0}  # a template's own placeholder
            cause = _FROZEN if not param.requires_grad else _NO_STATE if bare else _NO_STEP
            why = f" ({_label_at(groups, position)}{cause})"
            raise loader.reject(f"initialized_params lists position {position} but its entry "
                                f"is not initialized{why}")  # fmt: skip
        warnings.warn(
            f"{loader.owner} load: kept the live state of frozen parameter "
            f"{_label_at(groups, position)} (position {position}; the checkpoint dropped it)",
            UserWarning,
            stacklevel=4,
        )
        saved[position] = optimizer.state[param]
    return saved


_FROZEN = " is frozen: DCP loads no state of a frozen parameter; make it trainable for the load"
_NO_STATE = " has no state in the file: renamed, or added since the save? (strict=False skips it)"
_NO_STEP = "'s entry in the file holds no 'step'"


def _first_places(keys: list[Any]) -> list[int]:
    """For each place, the first place holding an equal key (the repetition pattern)."""
    first: dict[Any, int] = {}
    return [first.setdefault(key, place) for place, key in enumerate(keys)]


def _needs_codebook(
    optimizer: ShellInterface,
    groups: list[dict[str, Any]],
    entries: Mapping[int, Mapping[str, Any]],
    extras: Mapping[str, Any],
) -> bool:
    """Codes exist without a codebook only in a broken checkpoint: a codebook8 group's entry
    with a period, or (every group codebook8) a step taken, since the first step learns it.
    With fp32-momentum groups beside, steps can precede the first codebook8 group."""
    coded = [group_uses_codebook(group) for group in groups for _ in group["params"]]
    if not any(coded):
        return False
    if all(coded) and extras["global_step"] > 0:
        return True
    return any(coded[position] and entry.get("period", 0) for position, entry in entries.items())


def _check_counters(
    loader: _Loader, entries: Mapping[int, Any], global_step: int, groups: list[Any]
) -> None:
    """No entry is updated more often than the optimizer stepped, times the places listing
    its parameter (torch updates a repeated one once per place); so none under step 0."""
    places = _first_places([id(p) for g in loader.optimizer.param_groups for p in g["params"]])
    listings = Counter(places)
    for position, entry in sorted(entries.items()):
        for key in ("step", "normuon_step"):  # every age (v_step <= step is the entry's rule)
            age = entry.get(key)
            if isinstance(age, int) and age > global_step * listings[places[position]]:
                raise loader.reject(
                    f"entry {position}: '{key}' {age} exceeds global_step {global_step} "
                    f"({_label_at(groups, position)}: no run updates a parameter more often)"
                )


def prepare_load(optimizer: ShellInterface, sd: Mapping[str, Any]) -> PreparedLoad:
    """Copy, run the pre-hooks on the copy, validate, and stage (docs/core.md §8.2 step 1)."""
    copied = copy_with_load_pre_hooks(optimizer, copy_containers(sd))
    loader = _Loader(optimizer, copied)
    state, groups, identifiers, others = loader.structure()
    extras = loader.extras(groups)
    staged_groups = [
        loader.group(index, saved, live)
        for index, (saved, live) in enumerate(zip(groups, optimizer.param_groups, strict=True))
    ]
    if extras["format_version"] == TEMPLATE_FORMAT:
        state = absorb_state(optimizer, state, identifiers, staged_groups)
    saved = _saved_entries(loader, state, identifiers, extras, staged_groups)
    entries = optimizer.stage_entries(saved, staged_groups, extras)
    if optimizer.row_sharded():
        check_row_periods(optimizer, entries, staged_groups)
    codebook = extras["codebook"]
    if codebook is None and _needs_codebook(optimizer, staged_groups, entries, extras):
        raise loader.reject("codes but no codebook (global_step > 0 or a non-pristine entry)")
    _check_counters(loader, entries, extras["global_step"], staged_groups)
    new_state: defaultdict[Tensor, Any] = defaultdict(dict)
    flat_params = [param for group in staged_groups for param in group["params"]]
    for position, param in enumerate(flat_params):
        new_state[param] = entries[position]
    new_state.update(others)
    device = flat_params[0].device if flat_params else torch.device("cpu")
    if codebook is not None:
        codebook = codebook.detach().to(device=device, copy=True)
    words = load_replica_words(optimizer, staged_groups, extras["global_step"], codebook, saved)
    return PreparedLoad(
        optimizer,
        new_state,
        staged_groups,
        extras["global_step"],
        codebook,
        extras.get("rank_local"),
        words,
    )
