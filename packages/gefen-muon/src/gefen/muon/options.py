"""GefenMuon's option rules (docs/muon.md §2–§3): the first failing rule raises.

The checks only read a group (or the constructor's defaults). ``normalise_schedule_steps``
is the one place that writes: it stores ``ns_steps = len(schedule)`` for the tuned and explicit
schedules on a group that is being registered.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from gefen.core.extension import check_flag, check_lr, real_value
from gefen.muon.kernels import STANDARD_TRIPLE, resolve_ns_schedule

__all__ = [
    "ADJUST_LR_FNS",
    "CODECS",
    "MUON_FLAGS",
    "MUON_OPTIMIZER_WIDE",
    "SHARDED_MODES",
    "check_mode_mix",
    "check_schedule_steps",
    "group_schedule",
    "normalise_schedule_steps",
    "validate_muon_options",
]

CODECS = ("codebook8", "codebook4", "none")
SHARDED_MODES = ("exact", "distributed", "approx")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# Every option may differ between groups (GefenMuon's codebook is learned once and never
# refreshed, so nothing in it is scheduled); the one rule across groups is ``check_mode_mix``.
MUON_OPTIMIZER_WIDE: tuple[str, ...] = ()
MUON_FLAGS = ("nesterov", "normuon", "stochastic_round", "deterministic", "check_finite")
_MIX_MESSAGE = (
    "GefenMuon cannot mix sharded_mode 'approx' with 'exact' or 'distributed' in one optimizer"
)


def _check_unit_interval(name: str, value: object) -> None:
    number = real_value(value)
    if number is None or not 0.0 <= number < 1.0:
        raise ValueError(f"Invalid {name} value: {value!r} (must satisfy 0 <= {name} < 1)")


def _check_positive_finite(name: str, value: object) -> None:
    number = real_value(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"Invalid {name} value: {value!r} (must be finite and > 0)")


def _check_weight_decay(value: object) -> None:
    number = real_value(value)
    if number is None or not math.isfinite(number) or number < 0:
        raise ValueError(f"Invalid weight_decay value: {value!r} (must be finite and >= 0)")


def _is_default_coefficients(value: object) -> bool:
    return isinstance(value, (tuple, list)) and tuple(value) == STANDARD_TRIPLE


def _check_schedule(options: Mapping[str, Any]) -> None:
    schedule = options["ns_schedule"]
    if schedule is not None and not _is_default_coefficients(options["ns_coefficients"]):
        raise ValueError("pass either ns_schedule or ns_coefficients, not both")
    resolve_ns_schedule(schedule, options["ns_coefficients"], options["ns_steps"])


def _check_choice(name: str, value: object, choices: tuple[Any, ...]) -> None:
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def validate_muon_options(options: Mapping[str, Any]) -> None:
    """The §2 rules in order over one group (or the constructor's defaults)."""
    check_lr(options["lr"])
    _check_weight_decay(options["weight_decay"])
    _check_unit_interval("momentum", options["momentum"])
    _check_positive_finite("eps", options["eps"])
    _check_schedule(options)
    _check_choice("adjust_lr_fn", options["adjust_lr_fn"], ADJUST_LR_FNS)
    _check_choice("momentum_codec", options["momentum_codec"], CODECS)
    _check_choice("sharded_mode", options["sharded_mode"], SHARDED_MODES)
    _check_unit_interval("normuon_beta2", options["normuon_beta2"])
    _check_positive_finite("normuon_eps", options["normuon_eps"])
    fused = options["fused"]
    if fused is not None and type(fused) is not bool:
        raise TypeError(f"fused must be None, True or False, got {fused!r}")
    for name in MUON_FLAGS:
        check_flag(name, options[name])
    if options["momentum_codec"] == "none" and options["stochastic_round"]:
        raise ValueError("stochastic_round requires momentum_codec='codebook8' or 'codebook4'")


def group_schedule(group: Mapping[str, Any]) -> tuple[tuple[float, float, float], ...]:
    """The Newton–Schulz triples a validated group runs."""
    return resolve_ns_schedule(group["ns_schedule"], group["ns_coefficients"], group["ns_steps"])


def normalise_schedule_steps(group: MutableMapping[str, Any]) -> None:
    """tuned3, tuned4 and explicit schedules store their own length as ``ns_steps`` (§3)."""
    if group["ns_schedule"] not in (None, "standard"):
        group["ns_steps"] = len(group_schedule(group))


def check_schedule_steps(group: Mapping[str, Any]) -> None:
    """A named or explicit schedule's group holds its length as ``ns_steps`` (§3): an edit of
    ``ns_schedule`` alone would leave the group (and its checkpoints) naming another count."""
    if group["ns_schedule"] not in (None, "standard"):
        runs = len(group_schedule(group))
        if group["ns_steps"] != runs:
            raise ValueError(
                f"ns_steps is {group['ns_steps']!r} but ns_schedule {group['ns_schedule']!r} "
                f"runs {runs} steps: set ns_steps to {runs} with it"
            )


def check_mode_mix(groups: Iterable[Mapping[str, Any]]) -> None:
    """One optimizer never mixes approx with exact/distributed (§3): one codebook must be
    learned from rank-identical data."""
    modes = {group["sharded_mode"] for group in groups}
    if "approx" in modes and modes & {"exact", "distributed"}:
        raise ValueError(_MIX_MESSAGE)
