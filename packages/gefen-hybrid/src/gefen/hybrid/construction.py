"""Building a hybrid: option checks, the three constructor forms, the children
(docs/hybrid.md §3–§4).

Every check runs before any child exists; a child's own constructor error propagates and no
partial hybrid is published.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from gefen.core import Gefen
from gefen.core.extension import parameter_label
from gefen.hybrid.adamw_preflight import check_adamw_options
from gefen.hybrid.group_form import group_params, is_group_form, renumber_groups, split_groups
from gefen.hybrid.routing import (
    DEFAULT_BACKUP_SUBSTRINGS,
    NamedParams,
    route_pairs,
    split_params_for_muon,
    validate_split,
)
from gefen.muon import GefenMuon

__all__ = [
    "HybridConfig",
    "backup_child",
    "build_children",
    "check_disjoint",
    "check_new_backup_group",
    "muon_child",
    "own_tensor_options",
    "resolve_groups",
    "resolve_lists",
]

_SUBSTRINGS_ONLY_FOR_ROUTING = (
    "backup_substrings is only valid when the first argument is a module or a (name, parameter) "
    "iterable"
)
_ZERO3 = (
    "GefenMuonHybrid received only zero-numel backup parameters and no Muon parameters: this is "
    "the DeepSpeed ZeRO stage 3 placeholder signature; use plain Gefen"
)


@dataclass(frozen=True)
class HybridConfig:
    """The constructor's options, with the ``None`` fallbacks of §3 resolved."""

    lr: float
    muon_lr: float
    backup_lr: float
    muon_weight_decay: float
    backup_weight_decay: float
    backup_optimizer: str
    no_decay_substrings: tuple[str, ...]
    betas: tuple[float, float]
    eps: float
    backup_1d_period_one: bool
    backup_2d_period_one: bool
    backup_adamw_kwargs: Mapping[str, Any] | None
    backup_factored_v_2d: bool
    backup_factored_floor: bool
    backup_nesterov: bool
    backup_momentum_codec: str
    momentum: float
    nesterov: bool
    ns_steps: int
    ns_schedule: Any
    adjust_lr_fn: str | None
    muon_eps: float
    momentum_codec: str
    sharded_mode: str
    normuon: bool
    normuon_beta2: float
    normuon_eps: float
    fused: bool | None
    stochastic_round: bool
    deterministic: bool
    check_finite: bool
    muon_lr_given: bool
    backup_substrings: tuple[str, ...] = DEFAULT_BACKUP_SUBSTRINGS

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> HybridConfig:
        """Checks 1–3 of §3, then the fallbacks."""
        for name in ("deterministic", "check_finite"):
            if type(options[name]) is not bool:
                raise TypeError(f"{name} must be a bool, got {type(options[name]).__name__}")
        backend = options["backup_optimizer"]
        if backend not in ("gefen", "adamw"):
            raise ValueError(f"backup_optimizer must be 'gefen' or 'adamw', got {backend!r}")
        _check_backend_options(options, backend)
        resolved = dict(options)
        resolved["muon_lr_given"] = options["muon_lr"] is not None
        for specific, shared in (
            ("muon_lr", "lr"),
            ("backup_lr", "lr"),
            ("muon_weight_decay", "weight_decay"),
            ("backup_weight_decay", "weight_decay"),
        ):
            if resolved[specific] is None:
                resolved[specific] = options[shared]
        for name in ("no_decay_substrings", "backup_substrings"):
            if isinstance(options.get(name), str):
                raise TypeError(f"{name} must be a sequence of strings, not a single str")
        resolved["no_decay_substrings"] = tuple(options["no_decay_substrings"])
        substrings = options.get("backup_substrings")
        resolved["backup_substrings"] = (
            DEFAULT_BACKUP_SUBSTRINGS if substrings is None else tuple(substrings)
        )
        names = {field.name for field in fields(cls)}
        return cls(**{name: resolved[name] for name in names})


def _check_backend_options(options: Mapping[str, Any], backend: str) -> None:
    if backend == "adamw":
        for name, default in (
            ("backup_1d_period_one", False),
            ("backup_2d_period_one", False),
            ("backup_factored_v_2d", True),
            ("backup_factored_floor", True),
            ("backup_nesterov", False),
            ("backup_momentum_codec", "codebook8"),
        ):
            if options[name] != default:
                raise ValueError(f"{name}={options[name]!r} applies to the Gefen backup only, "
                                 "not to backup_optimizer='adamw'")  # fmt: skip
    elif options["backup_adamw_kwargs"] is not None:
        raise ValueError(
            "backup_adamw_kwargs applies to backup_optimizer='adamw' only, not to 'gefen'"
        )


def resolve_groups(
    config: HybridConfig, first: Any, backup_list: Any, backup_substrings: Sequence[str] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each child's param groups, from any of the four forms (nothing is built yet)."""
    if not is_group_form(first):
        muon, backup = resolve_lists(first, backup_list, backup_substrings)
        muon_groups = [{"params": muon}] if muon else []
        return muon_groups, (_backup_groups(config, backup) if backup else [])
    if backup_list is not None:
        raise TypeError("the param-group form takes no second list: mark groups with use_muon")
    if config.no_decay_substrings:
        raise ValueError(
            "no_decay_substrings applies to the module and list forms; in the param-group form "
            "give the no-decay parameters their own group with weight_decay=0"
        )
    muon_groups, backup_groups = split_groups(first, config.backup_substrings)
    check_disjoint(muon_groups, backup_groups)
    if not muon_groups and not backup_groups:
        raise ValueError("GefenMuonHybrid received no parameters to optimize")
    return muon_groups, backup_groups


def check_disjoint(muon_groups: list[dict[str, Any]], backup_groups: list[dict[str, Any]]) -> None:
    """No parameter in both children (each child's constructor checks its own groups)."""
    muon_ids = {id(param) for param in group_params(muon_groups)}
    if any(id(param) in muon_ids for param in group_params(backup_groups)):
        raise ValueError("some parameters appear in more than one parameter group")


def resolve_lists(
    first: Any, backup_list: Any, backup_substrings: Sequence[str] | None
) -> tuple[NamedParams, NamedParams]:
    """Checks 4–7 of §3: resolve the form, split, reject empty and ZeRO-3 input, validate."""
    substrings = (
        DEFAULT_BACKUP_SUBSTRINGS if backup_substrings is None else tuple(backup_substrings)
    )
    model: nn.Module | None = None
    if backup_list is not None:
        if backup_substrings is not None or isinstance(first, nn.Module):
            raise TypeError(_SUBSTRINGS_ONLY_FOR_ROUTING)
        muon, backup = list(first), list(backup_list)
    elif isinstance(first, nn.Module):
        model = first
        muon, backup = split_params_for_muon(first, substrings)
    elif isinstance(first, Tensor):
        raise TypeError(
            "GefenMuonHybrid cannot route bare tensors: pass model.named_parameters(), a "
            "module, or use GefenMuonHybrid.from_model"
        )
    else:
        muon, backup = route_pairs(first, substrings)
    if not muon and not backup:
        raise ValueError("GefenMuonHybrid received no parameters to optimize")
    if not muon and all(_is_empty_pair(item) for item in backup):
        raise ValueError(_ZERO3)
    return validate_split(muon, backup, model)


def _is_empty_pair(item: object) -> bool:
    return (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[1], Tensor)
        and item[1].numel() == 0
    )


def _backup_groups(config: HybridConfig, pairs: NamedParams) -> list[dict[str, Any]]:
    if not config.no_decay_substrings:
        return [{"params": pairs}]
    tokens = [token.lower() for token in config.no_decay_substrings]
    no_decay = [pair for pair in pairs if any(t in pair[0].lower() for t in tokens)]
    decay = [pair for pair in pairs if pair not in no_decay]
    groups = [
        {"params": decay, "weight_decay": config.backup_weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def muon_child(config: HybridConfig, groups: list[dict[str, Any]]) -> GefenMuon:
    """The Muon child over ``groups``, the hybrid's options as its defaults."""
    return GefenMuon(
        groups,
        lr=config.muon_lr,
        weight_decay=config.muon_weight_decay,
        momentum=config.momentum,
        nesterov=config.nesterov,
        eps=config.muon_eps,
        ns_steps=config.ns_steps,
        adjust_lr_fn=config.adjust_lr_fn,
        ns_schedule=config.ns_schedule,
        momentum_codec=config.momentum_codec,
        sharded_mode=config.sharded_mode,
        normuon=config.normuon,
        normuon_beta2=config.normuon_beta2,
        normuon_eps=config.normuon_eps,
        fused=config.fused,
        stochastic_round=config.stochastic_round,
        deterministic=config.deterministic,
        check_finite=config.check_finite,
    )


def check_new_backup_group(config: HybridConfig, backup: torch.optim.Optimizer, index: int) -> None:
    """Refuse a group joining an AdamW backup with options its step would refuse (torch's
    AdamW checks only its defaults; Gefen checks every group itself)."""
    if config.backup_optimizer == "adamw":
        group = backup.param_groups[index]
        check_adamw_options(group, f"GefenMuonHybrid: AdamW backup group {index}")
        for position, param in enumerate(group["params"]):
            if param.is_complex():  # torch's AdamW takes one; the hybrid's step could not
                raise ValueError(
                    f"parameter {parameter_label(group, index, position)}: complex parameters "
                    f"are not supported (got {param.dtype})"
                )


def backup_child(config: HybridConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The backup child (Gefen or AdamW) over ``groups``, the hybrid's options as defaults."""
    if config.backup_optimizer == "adamw":
        betas = config.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:  # torch's AdamW indexes it
            raise ValueError(
                f"Invalid beta parameter at index 0: betas must be a pair, got {betas!r}"
            )
        adamw = torch.optim.AdamW(
            groups,
            lr=config.backup_lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.backup_weight_decay,
            **dict(config.backup_adamw_kwargs or {}),
        )
        for index in range(len(adamw.param_groups)):
            check_new_backup_group(config, adamw, index)
        return adamw
    return Gefen(
        groups,
        lr=config.backup_lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.backup_weight_decay,
        factored_v_2d=config.backup_factored_v_2d,
        factored_floor=config.backup_factored_floor,
        nesterov=config.backup_nesterov,
        momentum_codec=config.backup_momentum_codec,
        force_1d_period_one=config.backup_1d_period_one,
        force_2d_period_one=config.backup_2d_period_one,
        fused=config.fused,
        stochastic_round=config.stochastic_round,
        deterministic=config.deterministic,
        check_finite=config.check_finite,
    )


def build_children(
    config: HybridConfig, muon_groups: list[dict[str, Any]], backup_groups: list[dict[str, Any]]
) -> tuple[GefenMuon | None, torch.optim.Optimizer | None]:
    """Check 8 (the learning-rate warning), then step 9: Muon first, then the backup."""
    if config.adjust_lr_fn in (None, "original") and not config.muon_lr_given:
        warnings.warn(
            f"adjust_lr_fn={config.adjust_lr_fn!r} with a shared lr expects Muon-scale learning "
            "rates; use 'match_rms_adamw' or set muon_lr",
            UserWarning,
            stacklevel=3,
        )
    # A child the hybrid lacks is still built over one empty group and dropped: its own
    # constructor checks its options now (torch checks every option at construction), not
    # first when add_param_group builds it.
    muon = muon_child(config, muon_groups or [{"params": []}])
    try:
        backup = backup_child(config, backup_groups or [{"params": []}])
    except Exception as error:  # numbered as the hybrid's groups: the Muon child's come first
        renumber_groups(error, len(muon_groups), placeholder=not backup_groups)
        raise
    return (muon if muon_groups else None), (backup if backup_groups else None)


def own_tensor_options(
    groups: Sequence[dict[str, Any]], existing: Sequence[dict[str, Any]] = ()
) -> None:
    """Give each group not in ``existing`` its own copy of a tensor option (a tensor ``lr``)
    that another group also holds. The hybrid splits one caller's value over several groups,
    and torch's schedulers write each group's rate in place (``fill_``), one group at a time:
    a shared tensor would take every group's write (``ReduceLROnPlateau`` would reduce once
    per group, per-group lambdas would all end at the last group's rate). A tensor one group
    holds alone stays the caller's object, as in torch."""

    def tensors(group: Mapping[str, Any]) -> list[tuple[str, Tensor]]:
        return [(k, v) for k, v in group.items() if k != "params" and isinstance(v, Tensor)]

    kept = {id(group) for group in existing}
    new = [group for group in groups if id(group) not in kept]
    held = {id(value) for group in existing for _, value in tensors(group)}
    counts = Counter(id(value) for group in new for _, value in tensors(group))
    for group in new:
        for key, value in tensors(group):
            if id(value) in held or counts[id(value)] > 1:
                group[key] = value.detach().clone()
