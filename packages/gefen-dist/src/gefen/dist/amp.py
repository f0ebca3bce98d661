"""AMP agreement: the project's one parser of GradScaler's controls (docs/dist.md §6).

GradScaler talks to an optimizer that sets ``_step_supports_amp_scaling`` through two
attributes it sets before ``step`` and deletes afterwards: ``found_inf`` (did the local
gradients overflow) and ``grad_scale`` (the scale still applied to the gradients, or ``None``
once ``scaler.unscale_`` ran). Across a failure scope the members must take the same decision,
so the parsed controls are voted and folded into one range before anything is unscaled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gefen.dist.errors import GroupAgreementError
from gefen.dist.runtime import collective
from gefen.dist.scope import Channel
from gefen.dist.torch_internals import foreach_mul_
from gefen.dist.vote import (
    PHASE_AMP_CONTROL_PREFLIGHT,
    PHASE_AMP_PREPARATION,
    synchronize_step_error,
)

__all__ = ["AmpControls", "parse_amp_controls", "prepare_synchronized_amp_step"]

_RECIPE = "ShardedGradScaler with scaler.unscale_(optimizer) before scaler.step(optimizer)"


class AmpControls(NamedTuple):
    """The parsed controls of one rank: protocol presence, local overflow, pending scale."""

    present: bool
    overflow: bool
    scale: float | None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _one_element_value(value: torch.Tensor) -> Any:
    # A DTensor scalar would communicate on ``item()``; its local value is the rank's own view.
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.reshape(()).item()


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor with {value.numel()} elements"
    return f"{type(value).__name__} {value!r:.80}"


def _parse_found_inf(value: object) -> bool:
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if _is_number(value):
        return bool(value != 0)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return bool(_one_element_value(value) != 0)
    raise RuntimeError(
        "GradScaler supplied an unsupported found_inf (expected None, a bool, a number or a "
        f"one-element tensor): {_describe(value)}"
    )


def _parse_grad_scale(value: object) -> float | None:
    if value is None:
        # GradScaler passes None once ``unscale_`` ran: the gradients are already unscaled.
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        scale = float(_one_element_value(value))
    elif _is_number(value):
        try:
            scale = float(value)  # type: ignore[arg-type]
        except OverflowError:  # an int or Fraction beyond float range: refused below
            scale = math.inf
    else:
        raise RuntimeError(
            "GradScaler supplied an unsupported grad_scale (expected None, a number or a "
            f"one-element tensor): {_describe(value)}"
        )
    if not math.isfinite(scale) or scale <= 0.0:
        raise RuntimeError("GradScaler supplied a non-finite or non-positive grad_scale")
    return scale


def parse_amp_controls(optimizer: object) -> AmpControls:
    """Read GradScaler's controls from ``optimizer`` (the object the scaler decorated).

    Both controls are parsed before any decision, so a malformed ``grad_scale`` is reported
    even when ``found_inf`` says the step would be skipped.
    """
    present = hasattr(optimizer, "found_inf") or hasattr(optimizer, "grad_scale")
    overflow = _parse_found_inf(getattr(optimizer, "found_inf", None))
    scale = _parse_grad_scale(getattr(optimizer, "grad_scale", None))
    return AmpControls(present, overflow, scale)


def _unscale_gradients(optimizer: Any, scale: float) -> None:
    """Multiply every gradient in place by GradScaler's reciprocal, once per (device, dtype)."""
    # GradScaler computes the reciprocal in float64 and rounds it to float32, then multiplies
    # in the gradient's compute precision. A float32 tensor operand reproduces that for half
    # gradients too (a Python scalar would first be rounded to the gradient's dtype), and keeps
    # a power-of-two scaled step bit-identical to one that never saw a scale.
    inverse = torch.tensor(1.0 / scale, dtype=torch.float64).float()
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            buckets.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for (device, _), grads in buckets.items():
            foreach_mul_(grads, inverse.to(device))


@collective
def _fold_amp_range(
    scope: Sequence[Channel], controls: AmpControls
) -> tuple[list[float], list[float]]:
    """All-reduce ``[v, -v]`` with MIN per channel in order: the (min, max) of every rank the
    chain reached, for ``v = [present, overflow, scale_present, scale]``."""
    import torch.distributed as dist

    scale = 0.0 if controls.scale is None else controls.scale
    values = [
        float(controls.present),
        float(controls.overflow),
        float(controls.scale is not None),
        scale,
    ]
    carried = torch.tensor(values + [-v for v in values], dtype=torch.float64)
    for channel in scope:
        on_device = carried.to(channel.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.MIN, group=channel.process_group)
        carried = on_device.cpu()
    folded = carried.tolist()
    return folded[:4], [-v for v in folded[4:]]


def _disagreement(owner_name: str, what: str, advice: str) -> GroupAgreementError:
    return GroupAgreementError(
        f"{owner_name} AMP {what} differs across process-group members; {advice}",
        owner_name=owner_name,
        what=f"AMP {what}",
    )


def _decide(owner_name: str, low: list[float], high: list[float]) -> bool | None:
    """True/False to return at once (step / skip), None to go on and unscale."""
    present, overflow, scale_present, scale = 0, 1, 2, 3
    if low[present] != high[present]:
        advice = "use the same group-aware gradient scaler on every member"
        raise _disagreement(owner_name, "protocol presence", advice)
    if high[present] == 0.0:
        return True
    if low[overflow] != high[overflow]:
        raise _disagreement(
            owner_name, "found_inf", f"use a group-aware gradient scaler ({_RECIPE})"
        )
    if low[scale_present] != high[scale_present]:
        raise _disagreement(owner_name, "grad_scale presence", "use a group-aware gradient scaler")
    if low[scale_present] == 1.0 and low[scale] != high[scale]:
        raise _disagreement(owner_name, "grad_scale", "use a group-aware gradient scaler")
    if low[overflow] == 1.0:
        return False
    return None


def prepare_synchronized_amp_step(
    optimizer: Any, scope: Sequence[Channel], owner_name: str
) -> bool:
    """Agree GradScaler's decision across ``scope``: True = step, False = skip the whole step.

    On True every gradient has been unscaled in place exactly once when a scale was pending.
    On False nothing was touched: the whole group skips. With a non-empty scope this always
    runs its collectives, even without local controls, so nobody skips a collective a peer
    enters.
    """
    if len(scope) == 0:
        if not (hasattr(optimizer, "found_inf") or hasattr(optimizer, "grad_scale")):
            return True  # no GradScaler and nobody to agree with: the step proceeds as is
        controls = parse_amp_controls(optimizer)
        if not controls.present or controls.overflow:
            return not controls.overflow
        if controls.scale is not None:
            _unscale_gradients(optimizer, controls.scale)
        return True
    parsed: AmpControls | None = None
    error: Exception | None = None
    try:
        parsed = parse_amp_controls(optimizer)
    except Exception as exc:
        error = exc
    synchronize_step_error(error, PHASE_AMP_CONTROL_PREFLIGHT, scope, owner_name)
    controls = parsed if parsed is not None else AmpControls(False, False, None)
    low, high = _fold_amp_range(scope, controls)
    decided = _decide(owner_name, low, high)
    if decided is not None:
        return decided
    unscale_error: Exception | None = None
    try:
        if controls.scale is not None:
            _unscale_gradients(optimizer, controls.scale)
    except Exception as exc:
        unscale_error = exc
    synchronize_step_error(unscale_error, PHASE_AMP_PREPARATION, scope, owner_name)
    return True
