"""Rank-local gradient checks shared by every Gefen optimizer (docs/core.md §7.2, §1.1).

``validate_gradient_structure`` holds the structural rows of §7.2 (the union every optimizer
needs, with GefenMuon's 2-D rule behind ``require_2d``); ``check_finite_gradients`` holds the
finiteness row. Both only read: no collective, no mutation.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "OVERLAP_RULE",
    "SUPPORTED_DTYPES",
    "GradientReduction",
    "NonFiniteGradientError",
    "amp_scaling_supported",
    "check_finite_gradients",
    "check_learnable_gradients",
    "check_matrix",
    "iter_parameters",
    "overlaps_itself",
    "parameter_label",
    "validate_gradient_structure",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Parameter dtypes every Gefen optimizer accepts (docs/core.md §2.3)."""
OVERLAP_RULE = (
    "its elements share memory (an expand()ed or as_strided view), which the step cannot write "
    "in place; give the parameter memory of its own (e.g. .clone())"
)


class NonFiniteGradientError(RuntimeError):
    """A gradient holds NaN or ±Inf; raised before anything is mutated (docs/core.md §7.2)."""


def parameter_label(group: Mapping[str, Any], group_index: int, position: int) -> str:
    """The parameter's name when its group is named, else ``param_groups[g][i]``."""
    names = group.get("param_names")
    if isinstance(names, Sequence) and position < len(names):
        return repr(names[position])
    return f"param_groups[{group_index}][{position}]"


def iter_parameters(
    param_groups: Iterable[Mapping[str, Any]], first_group: int = 0
) -> Iterator[tuple[str, Tensor]]:
    """Every parameter with its label, in group order and then parameter order; unnamed groups
    numbered from ``first_group`` (a hybrid's backup follows the Muon child's groups)."""
    for group_index, group in enumerate(param_groups, first_group):
        for position, param in enumerate(group["params"]):
            yield parameter_label(group, group_index, position), param


# The step asks these questions several times per parameter: answer the plain types at once.
_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter})
_FLOAT32_MAX = torch.finfo(torch.float32).max


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (checked by type name, so torch.distributed need not
    import)."""
    if type(tensor) in _PLAIN_TYPES:
        return False
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    if type(tensor) in _PLAIN_TYPES:
        return tensor
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _check_layout(label: str, param: Tensor, grad: Tensor) -> None:
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError(
            f"parameter {label} has a sparse or non-strided gradient ({grad.layout}); "
            "Gefen optimizers need dense strided gradients"
        )
    if grad.is_complex():
        raise RuntimeError(f"parameter {label} has a complex gradient ({grad.dtype})")
    if is_dtensor(param) != is_dtensor(grad):
        raise RuntimeError(
            f"parameter {label}: the gradient placement differs from the parameter's "
            "(a DTensor gradient iff a DTensor parameter)"
        )
    if is_dtensor(param):
        p_spec, g_spec = param.device_mesh, grad.device_mesh  # type: ignore[attr-defined]
        if p_spec != g_spec or tuple(param.placements) != tuple(grad.placements):  # type: ignore[attr-defined]
            raise RuntimeError(
                f"parameter {label}: the gradient placement (mesh or placements) differs"
            )


def _check_geometry(label: str, param: Tensor, grad: Tensor) -> None:
    if grad.shape != param.shape:
        raise RuntimeError(
            f"parameter {label}: gradient shape {tuple(grad.shape)} differs from the "
            f"parameter shape {tuple(param.shape)}"
        )
    grad_device, param_device = local_tensor(grad).device, local_tensor(param).device
    if grad_device != param_device:
        raise RuntimeError(
            f"parameter {label}: the gradient must be on the same device as the parameter "
            f"({grad_device} vs {param_device})"
        )
    if grad.dtype != param.dtype:
        raise RuntimeError(
            f"parameter {label}: gradient dtype {grad.dtype} differs from the parameter "
            f"dtype {param.dtype}"
        )


def overlaps_itself(tensor: Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory (an ``expand()``ed view: a stride 0
    over a dimension longer than 1, or strides too small for the sizes): the step's in-place
    write to such a parameter fails half-way, after earlier parameters were written."""
    if tensor.layout != torch.strided:
        return False  # no strides to share memory through (other checks name such tensors)
    extent = 1  # the span the dimensions seen so far cover, in elements
    for stride, size in sorted(
        (st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz > 1
    ):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


def check_matrix(label: str, param: Tensor, owner: str, *, when: str = "step") -> None:
    """GefenMuon's rule: every parameter stays 2-D, with or without a gradient, at a step and at
    a save (``when``), since its state is a matrix's."""
    if param.dim() != 2:
        raise ValueError(
            f"{owner} found a {param.dim()}-D parameter {label} at {when} time: a wrapper (e.g. "
            "DeepSpeed ZeRO's 1-D fp32 partitions) replaced the parameters; Muon cannot be "
            "applied to a flat partition; use plain Gefen"
        )


def _check_parameter(label: str, param: Tensor, owner: str, require_2d: bool) -> None:
    if require_2d:
        check_matrix(label, param, owner)
    if param.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(
            f"parameter {label} has an unsupported dtype {param.dtype} "
            "(float16, bfloat16, float32 or float64)"
        )
    if local_tensor(param).device.type == "meta":
        raise RuntimeError(f"parameter {label} must be materialized (it is on the meta device)")
    if overlaps_itself(local_tensor(param)):
        raise RuntimeError(f"parameter {label}: {OVERLAP_RULE}")


def validate_gradient_structure(
    param_groups: Iterable[Mapping[str, Any]], *, owner: str, require_2d: bool
) -> None:
    """The structural checks of §7.2 over every parameter of every group; the first failure
    raises, naming the parameter. Parameters without a gradient get the parameter checks only.
    """
    for label, param in iter_parameters(param_groups):
        _check_parameter(label, param, owner, require_2d)
        grad = param.grad
        if grad is None:
            continue
        _check_layout(label, param, grad)
        _check_geometry(label, param, grad)


GradientReduction = Callable[[Tensor], "tuple[Any, bool] | None"]
"""A read of a whole gradient that also tells whether it is finite (the factored family's row
and column sums, ``gefen.core.native.NativeUpdater.gradient_sums``): its result and True when
that proves the gradient finite, False when the gradient must be checked itself, or None when
it does not apply to this gradient."""


def check_learnable_gradients(param_groups: Sequence[Mapping[str, Any]]) -> None:
    """``check_finite_gradients`` for codebook learning outside a step (``initialize_codebook``,
    ``refresh_codebook``): it bins every gradient in float32, so each must fit float32's range,
    as the step requires of the gradients it computes in float32."""
    every = {id(param): False for group in param_groups for param in group["params"]}
    check_finite_gradients(param_groups, bounded=every)


def check_finite_gradients(
    param_groups: Iterable[Mapping[str, Any]],
    reductions: Mapping[int, GradientReduction] | None = None,
    bounded: Mapping[int, bool] | None = None,
) -> dict[int, Any]:
    """Raise ``NonFiniteGradientError`` naming the first parameter with a NaN/±Inf gradient
    (a group with ``check_finite=False`` is not read), or, for the parameters in ``bounded``
    (by ``id``: the step computes in float32), a finite gradient beyond float32's range, or, where
    ``bounded`` says True (the factored family: its second moment sums g² over rows and columns),
    one whose row or column sum of squares overflows float32: the step would make them NaN for
    good.

    ``reductions`` (by ``id`` of the parameter) names gradients the step's commit reduces
    anyway: their reduction runs here instead, so the check costs no read of its own; the
    results are returned by ``id`` of the parameter for the commit to reuse, and only a gradient
    whose reduction does not prove it finite is read by the check below.

    Contiguous CPU gradients, once the native kernel library is loaded, are read in one native
    pass (``gefen.core.native.first_nonfinite``) unless a bounded one needs its bound (no
    reduction covered it). Otherwise: one fused reduction per gradient
    (its minimum and maximum: NaN propagates through both and ±Inf is an extremum, so no
    per-element temporary is allocated) and one host synchronisation per device for the step.
    """
    # Labels are built only for a failure: formatting one per parameter costs a step real time.
    # Plain loops: this runs every step, and a comprehension is a call per item.
    located: list[tuple[Mapping[str, Any], int, int]] = []
    grads: list[Tensor] = []
    squared: list[int] = []  # positions in ``located`` whose bound is checked
    summed: list[bool] = []  # for each of ``squared``: its sums of squares too (factored)
    reduced: dict[int, Any] = {}
    for group_index, group in enumerate(param_groups):
        if group.get("check_finite", True) is False:
            continue
        for position, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if type(grad) not in _PLAIN_TYPES:
                grad = local_tensor(grad)
            if grad.numel() == 0:
                continue
            # keyed by id: a Tensor's own __hash__ is a Python call, and this runs every step
            reduction = None if reductions is None else reductions.get(id(param))
            outcome = None if reduction is None else reduction(grad)
            if outcome is not None:
                reduced[id(param)] = outcome[0]
                if outcome[1]:
                    continue  # proven finite by the reduction itself, its squares' sums too
            rule = None if bounded is None else bounded.get(id(param))
            if rule is not None:
                squared.append(len(located))
                summed.append(rule)
            located.append((group, group_index, position))
            grads.append(grad)
    if not located:
        return reduced
    # CPU: one native pass, no reduction launches; only once a kernel selection loaded the
    # library (an eager-only run never builds it).
    native = sys.modules.get("gefen.core.native")
    # A bounded gradient no native reduction covered needs its bound as well: the extrema give
    # both in the one read, so then every gradient takes that path.
    first = None if native is None or squared else native.first_nonfinite(grads)
    if first is not None:
        if first >= 0:
            raise NonFiniteGradientError(_non_finite(parameter_label(*located[first])))
        return reduced
    bounds = _checked_bounds(located, grads, squared)
    for i, sums, bound in zip(squared, summed, bounds, strict=True):
        if bound > _FLOAT32_MAX:
            raise NonFiniteGradientError(
                f"parameter {parameter_label(*located[i])} has a finite gradient (|g| up to "
                f"{bound:.3g}) beyond float32's range, which the step computes in; the step "
                "was not taken"
            )
        if sums and _squares_overflow(grads[i], bound):
            raise NonFiniteGradientError(
                f"parameter {parameter_label(*located[i])} has a finite gradient (|g| up to "
                f"{bound:.3g}) whose squares overflow float32 in its factored second moment "
                "(a row or column sum of g² is infinite); the step was not taken"
            )
    return reduced


def _non_finite(label: str) -> str:
    return f"parameter {label} has a non-finite gradient (NaN or Inf)"


def _checked_bounds(
    located: list[tuple[Mapping[str, Any], int, int]], grads: list[Tensor], squared: list[int]
) -> list[float]:
    """The finiteness check by extrema (one fused reduction per gradient, one host
    synchronisation per device); returns max |g| of the gradients at ``squared``."""
    by_device: dict[torch.device, list[int]] = {}
    for position, grad in enumerate(grads):
        by_device.setdefault(grad.device, []).append(position)
    extrema: list[tuple[float, float]] = [(0.0, 0.0)] * len(grads)
    with torch.no_grad():
        for positions in by_device.values():
            stacked = torch.stack([torch.stack(torch.aminmax(grads[i])) for i in positions])
            for position, pair in zip(positions, stacked.double().tolist(), strict=True):
                extrema[position] = (pair[0], pair[1])
    for position, (low, high) in enumerate(extrema):
        if not (math.isfinite(low) and math.isfinite(high)):
            raise NonFiniteGradientError(_non_finite(parameter_label(*located[position])))
    return [max(-extrema[i][0], extrema[i][1]) for i in squared]


def _squares_overflow(grad: Tensor, bound: float) -> bool:
    """Whether a row or column sum of g² in float32 is infinite; exact only when the bound
    says it may be (``bound² · max(R, C)`` beyond float32's range), which no sane gradient
    reaches."""
    if bound * bound * max(grad.shape) < _FLOAT32_MAX:
        return False
    squares = grad.detach().to(torch.float32).square()
    return not bool(squares.sum(dim=1).isfinite().all() and squares.sum(dim=0).isfinite().all())


def amp_scaling_supported(
    param_groups: Iterable[Mapping[str, Any]], scope: tuple[Any, ...]
) -> bool:
    """True iff some gradient is fp16 or the failure scope is non-empty (docs/core.md §7.3): whether
    a GradScaler may drive the step; pure."""
    if len(scope) > 0:
        return True
    return any(
        param.grad is not None and param.grad.dtype == torch.float16
        for group in param_groups
        for param in group["params"]
    )
