"""Option validation (docs/core.md §2.1–§2.2): the first failing rule raises.

The checks run at construction, in ``add_param_group``, for every group in the step preflight
and on load; they only read the group (a list ``betas`` is accepted and normalised by the
caller where normalising is allowed).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "CODEBOOK_CODECS",
    "CODECS",
    "GEFEN_FLAGS",
    "GEFEN_GROUP_OPTIONS",
    "GEFEN_OPTIMIZER_WIDE",
    "MIN_EPS",
    "TORCH_ONLY_FLAGS",
    "VARIANT_PREFIX",
    "check_betas",
    "check_flag",
    "check_group_codec",
    "check_lr",
    "check_optimizer_wide",
    "check_torch_flags",
    "codebook_size",
    "codes_per_byte",
    "group_codecs",
    "group_uses_codebook",
    "lr_value",
    "owned_option",
    "validate_gefen_options",
    "variant_prefix",
]

CODECS = ("codebook8", "codebook4", "none")
CODEBOOK_CODECS: dict[str, int] = {"codebook8": 256, "codebook4": 16}
"""The codecs that keep codes into the learned codebook, and that codebook's size."""
VARIANT_PREFIX: dict[str, str] = {"codebook8": "q8", "codebook4": "q4", "none": "fp32"}
"""Each codec's prefix in the state-variant names (``q4_factored``, ``fp32_block``, ...)."""
GEFEN_GROUP_OPTIONS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "factored_v_2d",
    "factored_floor",
    "nesterov",
    "force_1d_period_one",
    "force_2d_period_one",
)
# Every other option may differ between groups, as in torch.optim. The refresh schedule belongs
# to the one codebook all of an optimizer's codebook8 groups share.
GEFEN_OPTIMIZER_WIDE = ("codebook_refresh_every",)
_WHY_OPTIMIZER_WIDE = {
    "codebook_refresh_every": "every codebook8 group shares the optimizer's one codebook, "
    "refreshed on one schedule",
}
GEFEN_FLAGS = (
    "factored_v_2d",
    "factored_floor",
    "nesterov",
    "force_1d_period_one",
    "force_2d_period_one",
    "stochastic_round",
    "deterministic",
    "check_finite",
)


def real_value(value: object) -> float | None:
    """A real number's value as a float, or None for anything else.

    Real numbers are what ``numbers.Real`` admits (Python and NumPy ints and floats,
    ``Fraction``), not a bool: a config read through NumPy hands ``np.float32`` to an
    optimizer that torch's own optimizers accept. An int too large for a float reads as ±inf,
    which every finite-range check then refuses by name."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return -math.inf if str(value).startswith("-") else math.inf  # a huge int or Fraction


def check_lr(lr: object) -> float:
    """A float >= 0 (0 allowed), or a 1-element floating tensor holding one; returns it."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got {lr.numel()} elements")
        if not lr.is_floating_point():
            raise ValueError(f"Invalid learning rate: a tensor lr must be floating, got {lr.dtype}")
        value = float(lr.detach().reshape(()).item())
    elif (number := real_value(lr)) is not None:
        value = number
    else:
        raise ValueError(f"Invalid learning rate: {lr!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Invalid learning rate: {lr!r}")
    return value


def check_betas(betas: object) -> tuple[float, float]:
    """A 2-sequence of reals with ``0 <= β < 1``; returns it as a tuple."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid beta parameter at index 0: betas must be a pair, got {betas!r}")
    for index, beta in enumerate(betas):
        number = real_value(beta)
        if number is None or not 0.0 <= number < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta!r}")
    return (betas[0], betas[1])


def check_flag(name: str, value: object) -> None:
    """Option ``name`` must be a bool (not an int, not a tensor)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


MIN_EPS = 1e-30
"""The smallest ``eps``: the step scales by ``1/((sqrt(v)/sqrt(bc2) + eps)·bc1)``, finite in
float32 for any ``v >= 0`` and ``β1 < 1 - 1e-8``."""
MIN_EPS_BC1 = 4e-39
"""The smallest ``eps·(1 − β1)``: where a block's v is 0 the first step scales by
``1/(eps·bc1)`` with ``bc1 = 1 − β1``, which overflows float32 (3.4e38) below about 2.9e-39."""


def _check_positive_finite(name: str, label: str, value: object, *, allow_zero: bool) -> None:
    number = real_value(value)
    in_range = number is not None and math.isfinite(number) and number >= 0
    if not in_range or (number == 0 and not allow_zero):
        raise ValueError(f"Invalid {label} value: {value!r}")


def _check_refresh(value: object) -> None:
    if type(value) is not int:
        raise TypeError(f"codebook_refresh_every must be an int, got {type(value).__name__}")
    if not 0 <= value < 2**63:  # the scoped header carries it as an int64 (a step never
        # reaches 2**63 anyway: global_step stops below it)
        raise ValueError(f"codebook_refresh_every must satisfy 0 <= n < 2**63, got {value}")


def _check_codec(options: Mapping[str, Any], *, constructor: bool) -> None:
    codec = options["momentum_codec"]
    if type(codec) is not str or codec not in CODECS:  # a str subclass (numpy.str_) would be
        # saved as itself, and torch.load(weights_only=True) refuses it
        raise ValueError(f"momentum_codec must be one of {CODECS}, got {codec!r}")
    if codec == "none" and options["stochastic_round"]:
        raise ValueError("stochastic_round requires momentum_codec='codebook8' or 'codebook4'")
    # A group with fp32 momentum may sit beside codebook groups whose codebook is refreshed;
    # only an optimizer whose default codec is "none" has nothing to refresh.
    if constructor and codec == "none" and options["codebook_refresh_every"] > 0:
        raise ValueError(
            "codebook_refresh_every > 0 requires momentum_codec='codebook8' or 'codebook4'"
        )


def group_uses_codebook(group: Mapping[str, Any]) -> bool:
    """True iff the group's momentum is codes into the learned codebook (codebook8 or
    codebook4, its own ``momentum_codec``)."""
    return group.get("momentum_codec", "codebook8") in CODEBOOK_CODECS


def variant_prefix(group: Mapping[str, Any]) -> str:
    """The prefix of the group's state variants: q8, q4 or fp32."""
    return VARIANT_PREFIX.get(str(group.get("momentum_codec", "codebook8")), "fp32")


def codes_per_byte(group: Mapping[str, Any]) -> int:
    """Codes one byte of the group's momentum holds: 2 for codebook4, else 1."""
    return 2 if group.get("momentum_codec", "codebook8") == "codebook4" else 1


def codebook_size(groups: Sequence[Mapping[str, Any]]) -> int:
    """The size of the one codebook the groups share: 16 when they keep codebook4 codes, else
    256 (``check_group_codec`` keeps codebook8 and codebook4 out of one optimizer)."""
    for group in groups:
        if group.get("momentum_codec", "codebook8") == "codebook4":
            return CODEBOOK_CODECS["codebook4"]
    return CODEBOOK_CODECS["codebook8"]


def check_group_codec(
    group: Mapping[str, Any],
    groups: Sequence[Mapping[str, Any]],
    codebook: torch.Tensor | None,
    owner: str,
) -> None:
    """A group's codec must fit the optimizer's one codebook: codebook8 and codebook4 never
    share an optimizer, and a learned codebook's size is the codec's (256 or 16)."""
    codec = group.get("momentum_codec", "codebook8")
    if codec not in CODEBOOK_CODECS:
        return
    for other in groups:
        other_codec = other.get("momentum_codec", "codebook8")
        if other_codec in CODEBOOK_CODECS and other_codec != codec:
            raise ValueError(
                f"{owner}: momentum_codec {codec!r} cannot join a {other_codec!r} group in one "
                "optimizer (its codebook groups share one codebook); use one of them, or "
                "'none', for every group"
            )
    if codebook is not None and codebook.numel() != CODEBOOK_CODECS[codec]:
        raise ValueError(
            f"{owner}: momentum_codec {codec!r} needs a {CODEBOOK_CODECS[codec]}-value codebook "
            f"but the learned one holds {codebook.numel()}; a codec cannot change once the "
            "codebook is learned"
        )


def group_codecs(groups: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Which codecs the groups keep, in ``CODECS`` order (a codebook codec first)."""
    used = {str(group.get("momentum_codec", "codebook8")) for group in groups}
    return tuple(codec for codec in CODECS if codec in used)


def validate_gefen_options(options: Mapping[str, Any], *, constructor: bool = False) -> None:
    """Gefen's §2.2 rules in order over one group (or, ``constructor=True``, the constructor's
    defaults)."""
    check_lr(options["lr"])
    check_betas(options["betas"])
    _check_positive_finite("eps", "epsilon", options["eps"], allow_zero=False)
    if (real_value(options["eps"]) or 0.0) < MIN_EPS:  # 1/eps scales a block whose v is 0
        raise ValueError(
            f"Invalid epsilon value: {options['eps']!r} (below {MIN_EPS:g}, 1/eps overflows "
            "float32 where a block's second moment is 0, and 0·inf is NaN)"
        )
    beta1 = real_value(options["betas"][0]) or 0.0
    if (real_value(options["eps"]) or 0.0) * (1.0 - beta1) < MIN_EPS_BC1:
        raise ValueError(
            f"Invalid epsilon value: {options['eps']!r} with betas[0] {options['betas'][0]!r} "
            f"(eps·(1 − betas[0]) below {MIN_EPS_BC1:g}: the first step scales a block whose "
            "second moment is 0 by 1/(eps·(1 − betas[0])), which overflows float32, and 0·inf "
            "is NaN)"
        )
    _check_positive_finite("weight_decay", "weight_decay", options["weight_decay"], allow_zero=True)
    for name in GEFEN_FLAGS:
        check_flag(name, options[name])
    _check_refresh(options["codebook_refresh_every"])
    _check_codec(options, constructor=constructor)
    fused = options["fused"]
    if fused is not None and type(fused) is not bool:
        raise TypeError(f"fused must be None, True or False, got {fused!r}")


TORCH_ONLY_FLAGS = ("maximize", "amsgrad", "capturable", "differentiable")
"""torch.optim flags the Gefen optimizers do not implement: set in a group, it was ignored."""


_CAPTURABLE_HINT = (
    "; torch.compile adds capturable=True to the param groups a compiled function writes, "
    "so set options outside the compiled function"
)


def check_torch_flags(group: Mapping[str, Any]) -> None:
    """A group that sets one of ``TORCH_ONLY_FLAGS`` (anything but absent, None or False) is
    refused by name: the step would silently run without it (``maximize=True`` descends)."""
    for name in TORCH_ONLY_FLAGS:
        value = group.get(name)
        if value is not None and value is not False:
            hint = _CAPTURABLE_HINT if name == "capturable" else ""
            raise ValueError(
                f"{name}={value!r} is not supported: a torch.optim flag this optimizer does not "
                f"implement (remove it from the param group{hint})"
            )


def check_optimizer_wide(
    group: Mapping[str, Any], defaults: Mapping[str, Any], names: tuple[str, ...]
) -> None:
    """An optimizer-scope option given in a group must equal the constructor value."""
    for name in names:
        if name in group and not _same_option(group[name], defaults[name]):
            why = _WHY_OPTIMIZER_WIDE.get(name)
            raise ValueError(
                f"optimizer-wide option '{name}' must equal the constructor value "
                f"{defaults[name]!r} in every parameter group, got {group[name]!r}"
                + ("" if why is None else f" ({why})")
            )


def _same_option(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def lr_value(lr: object) -> float:
    """A group lr as a Python float (a tensor lr costs one host read; read it once per group
    per step). A tensor lr is checked again at this read: a write through ``.data`` or NumPy
    leaves its version, which the preflight's option check watches, as it was."""
    if isinstance(lr, torch.Tensor):
        return check_lr(lr)
    return float(lr)  # type: ignore[arg-type]


def owned_option(value: Any) -> Any:
    """A loaded group option as the group's own: a tensor (lr) is copied, as torch's load
    deep-copies the saved groups; shared with the caller's dict, a scheduler of the optimizer it
    came from would rewrite this one's lr."""
    return value.clone() if isinstance(value, torch.Tensor) else value
