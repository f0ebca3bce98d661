"""The step preflight of an AdamW backup: its options and state checked before anything is
written, so a bad option fails the whole hybrid step in its voted phase instead of inside the
backup's commit (after the Muon half has already been written).

The rules are torch's AdamW constructor rules, stricter where torch would silently produce NaN
parameters: the learning rate and weight decay must be finite, ``eps`` finite and positive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gefen.core.extension import local_tensor, real_value

__all__ = [
    "check_adamw_amp_precision",
    "check_adamw_backup",
    "check_adamw_options",
    "check_capturable",
    "fp16_safe",
]

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# torch's AdamW flags: each must be a plain bool (a tensor there fails inside the step's branches).
_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")
_OPTIONAL_FLAGS = ("foreach", "fused")
_CAPTURABLE_DEVICES = ("cuda", "xpu", "hpu", "privateuseone", "xla")  # torch's own list


def _real(value: object, where: str, name: str) -> float | None:
    """The value of a real number or a 1-element real tensor (None for a tensor off the CPU,
    whose value is not read so that the preflight never synchronises a device; the shapes the
    step takes are ``_check_tensor_shapes``'s)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"{where}: {name} must be a real number or a 1-element real tensor, got a "
                f"{value.dtype} tensor of shape {tuple(value.shape)}"
            )
        if value.is_meta:  # it holds no value: the backup's step would fail reading it
            raise ValueError(f"{where}: {name} is a meta tensor, which holds no value")
        if value.device.type != "cpu":
            return None
        return float(value.detach().reshape(()).item())
    number = real_value(value)
    if number is None:
        raise ValueError(f"{where}: {name} must be a real number, got {type(value).__name__}")
    return number


def check_adamw_options(group: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError("{where}: <rule>")`` on the first option of an AdamW group that its
    step would fail on or turn into NaN (used by the preflight and by the backup's load)."""
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key not in group:  # torch's AdamW would fail with a bare KeyError inside its step
            raise ValueError(f"{where}: the option '{key}' is missing")
    lr = _real(group.get("lr"), where, "lr")
    if lr is not None and not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"{where}: lr must be finite and >= 0, got {lr}")
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        value = _real(beta, where, f"betas[{index}]")
        if value is not None and not 0.0 <= value < 1.0:
            raise ValueError(f"{where}: betas[{index}] must be in [0, 1), got {value}")
    eps = _real(group.get("eps"), where, "eps")
    if eps is not None and not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"{where}: eps must be finite and > 0, got {eps}")
    decay = _real(group.get("weight_decay"), where, "weight_decay")
    if decay is not None and not (math.isfinite(decay) and decay >= 0.0):
        raise ValueError(f"{where}: weight_decay must be finite and >= 0, got {decay}")
    for name in _FLAGS:
        value = group.get(name)
        if not (type(value) is bool or (value is None and name in _OPTIONAL_FLAGS)):
            allowed = "a bool or None" if name in _OPTIONAL_FLAGS else "a bool"
            raise ValueError(f"{where}: {name} must be {allowed}, got {value!r}")
    if group["maximize"]:  # the Muon half descends: half the model would climb the loss
        raise ValueError(f"{where}: maximize=True is not supported")
    if group["differentiable"]:  # its step runs with grad on: an in-place write to a leaf
        raise ValueError(f"{where}: differentiable=True is not supported (the step would fail)")
    if group["foreach"] and isinstance(group.get("lr"), Tensor) and not group["capturable"]:
        raise ValueError(f"{where}: a tensor lr with foreach=True needs capturable=True")
    _check_tensor_shapes(group, where)


def _check_tensor_shapes(group: Mapping[str, Any], where: str) -> None:
    """The tensor options torch's AdamW step takes as they are (it squeezes lr alone): the fused
    and for-each steps want 0-d ``eps`` and ``weight_decay`` and (for-each, without capturable)
    no tensor betas; the single-tensor one adds them to each update in place, so they may have
    no more dimensions than the smallest parameter (a zero decay it skips, as for-each does).
    Each would fail inside the backup's commit."""
    params = [p for p in group.get("params", ()) if isinstance(p, Tensor)]
    fused = bool(group["fused"])
    foreach = not fused and (
        group["foreach"]
        or (
            group["foreach"] is None
            and bool(params)
            and all(p.device.type == "cuda" for p in params)
        )
    )
    if foreach and not group["capturable"] and any(isinstance(b, Tensor) for b in group["betas"]):
        raise ValueError(f"{where}: tensor betas with foreach need capturable=True")
    for name in ("eps", "weight_decay"):
        value = group[name]
        if not isinstance(value, Tensor):
            continue
        if name == "weight_decay" and not fused and _real(value, where, name) == 0.0:
            continue  # torch's for-each and single-tensor steps skip a zero decay
        allowed = 0 if fused or foreach else min((p.dim() for p in params), default=value.dim())
        if value.dim() > allowed:
            step = "fused" if fused else "for-each" if foreach else "single-tensor"
            raise ValueError(
                f"{where}: {name} may have at most {allowed} dimensions (torch's {step} AdamW "
                f"step), got shape {tuple(value.shape)}"
            )


def _check_state(
    entry: Mapping[str, Any], param: Tensor, where: str, amsgrad: bool = False
) -> None:
    """An existing entry as torch's AdamW step reads it: ``step``, both moments (and
    ``max_exp_avg_sq`` under amsgrad) present, each moment of the parameter's shape, dtype and
    device (a model moved with ``.to()`` after its first step leaves them behind)."""
    local = local_tensor(param)
    required = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    missing = [key for key in required if key not in entry]
    if missing:
        raise RuntimeError(f"{where}: state lacks {', '.join(missing)} (AdamW's step reads it)")
    for key in _MOMENT_KEYS:
        moment = entry.get(key)
        if moment is None:
            continue
        if not isinstance(moment, Tensor) or local_tensor(moment).shape != local.shape:
            found = tuple(local_tensor(moment).shape) if isinstance(moment, Tensor) else moment
            raise RuntimeError(
                f"{where}: state does not match parameter ({key} has shape {found}, the "
                f"parameter {tuple(local.shape)})"
            )
        held = local_tensor(moment)
        if held.dtype != local.dtype or held.device != local.device:
            raise RuntimeError(
                f"{where}: state does not match parameter ({key} is {held.dtype} on "
                f"{held.device}, the parameter {local.dtype} on {local.device}; load a "
                "checkpoint into the optimizer after moving the model)"
            )


_FP16_TINY = 2.0**-24  # the smallest float16 subnormal: a smaller eps rounds to 0


def fp16_safe(group: Mapping[str, Any]) -> bool:
    """Whether an AdamW group keeps float16 parameters finite under GradScaler: the fused
    implementation does; the for-each one computes in float16, where an ``eps`` below the
    smallest subnormal (the default 1e-8) rounds to 0, so a zero gradient element divides 0 by
    0 and the parameter turns NaN."""
    eps = group.get("eps", 1e-8)
    eps_value = real_value(eps)
    return bool(group.get("fused")) or (eps_value is not None and eps_value >= _FP16_TINY)


def check_adamw_amp_precision(backup: torch.optim.Optimizer, owner: str) -> None:
    """Under GradScaler: refuse a float16 parameter in a non-fused AdamW group, up front."""
    for group_index, group in enumerate(backup.param_groups):
        if fp16_safe(group):
            continue
        for position, param in enumerate(group["params"]):
            if param.dtype == torch.float16:
                raise RuntimeError(
                    f"{owner}: AdamW backup group {group_index} parameter {position} is float16 "
                    f"under GradScaler with eps={group.get('eps')!r}, which rounds to 0 in "
                    "float16 and turns zero-gradient elements into NaN in torch's non-fused "
                    "AdamW; pass backup_adamw_kwargs={'fused': True}, an eps >= 2**-24, or "
                    "keep the backup in float32/bfloat16"
                )


def check_capturable(group: Mapping[str, Any], params: Any, where: str) -> None:
    """``capturable=True`` needs every parameter on a device CUDA graphs can capture."""
    if group.get("capturable") is True:
        for param in params:
            if local_tensor(param).device.type not in _CAPTURABLE_DEVICES:
                raise ValueError(
                    f"{where}: capturable=True needs parameters on one of "
                    f"{', '.join(_CAPTURABLE_DEVICES)}, got {local_tensor(param).device}"
                )


def check_adamw_backup(backup: torch.optim.Optimizer, owner: str) -> None:
    """Raise on the first option or state entry of ``backup`` its step would fail on or turn
    into NaN; reads only."""
    for group_index, group in enumerate(backup.param_groups):
        where = f"{owner}: AdamW backup group {group_index}"
        check_adamw_options(group, where)
        check_capturable(group, group["params"], where)
        for position, param in enumerate(group["params"]):
            entry = backup.state.get(param)
            if entry:
                _check_state(
                    entry, param, f"{where} parameter {position}", bool(group.get("amsgrad"))
                )
