"""The per-parameter update of docs/core.md §6.1 (block family) and §6.2 (factored family).

Both kernels are pure: they read the current parameter, gradient and state, and return the
staged new state and the new parameter value without writing anything. The caller (the optimizer
shell) publishes the result in its commit phase, writing the parameter back in place with
``param.copy_(result.param)``, which also covers non-contiguous parameters.

All tensor arithmetic is fp32 except the parameter write of fp64 parameters, which stays in
fp64; scalars (bias corrections, the decay factor) are Python floats. The order of operations is
the normative eager order of §6.1: the re-quantized momentum is what the update uses, eps is added
outside the square root, and the parameter is rounded to its dtype exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import Tensor

from gefen.core.kernels.blocks import code_bytes, is_packed, requantized_lerp

__all__ = [
    "FLT_MIN",
    "BlockUpdate",
    "CodebookMomentum",
    "DenseMomentum",
    "FactoredUpdate",
    "Momentum",
    "factored_second_moment",
    "floored_second_moment",
    "nesterov_momentum",
    "update_block",
    "update_factored",
]

FLT_MIN = 2.0**-126
"""The smallest normal fp32 value: the floor of the factored normaliser ``mean(v_row)``."""


@dataclass(frozen=True)
class CodebookMomentum:
    """Codebook momentum: ``codes`` uint8 (B, P), or (B, ceil(P / 2)) two per byte with a
    16-value codebook (``"codebook4"``), and ``scale`` fp32 (B, 1) (block maxima)."""

    codes: Tensor
    scale: Tensor


@dataclass(frozen=True)
class DenseMomentum:
    """``"none"`` momentum: the full fp32 first moment, shape (B, P)."""

    momentum: Tensor


Momentum: TypeAlias = CodebookMomentum | DenseMomentum
"""The codec is chosen by the type of the momentum passed in, and kept in the result."""


@dataclass(frozen=True)
class BlockUpdate:
    """Staged result of ``update_block``. ``param`` is None when ``lr == 0`` (no write)."""

    momentum: Momentum
    v_block: Tensor
    param: Tensor | None
    step: int
    v_step: int


@dataclass(frozen=True)
class FactoredUpdate:
    """Staged result of ``update_factored``. ``param`` is None when ``lr == 0`` (no write)."""

    momentum: Momentum
    v_row: Tensor
    v_col: Tensor
    param: Tensor | None
    step: int
    v_step: int


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_fp32(tensor: Tensor, shape: tuple[int, ...], name: str) -> None:
    _require(
        tensor.dtype == torch.float32 and tuple(tensor.shape) == shape,
        f"{name} must be float32 of shape {shape}, got {tensor.dtype} {tuple(tensor.shape)}",
    )


def _check_common(
    param: Tensor,
    grad: Tensor,
    momentum: Momentum,
    *,
    period: int,
    step: int,
    v_step: int,
    codebook: Tensor | None,
    seed: tuple[int, ...] | None,
) -> tuple[int, int]:
    """Validate what both families share; returns the block grid (B, P)."""
    n = param.numel()
    _require(n > 0, "the update kernels need a parameter with at least one element")
    _require(grad.shape == param.shape, f"grad shape {tuple(grad.shape)} != {tuple(param.shape)}")
    _require(
        not isinstance(period, bool) and isinstance(period, int) and period > 0 and n % period == 0,
        f"period {period!r} must be an int >= 1 dividing numel {n}",
    )
    _require(0 <= v_step <= step, f"counters need 0 <= v_step <= step, got {v_step}, {step}")
    grid = (n // period, period)
    if isinstance(momentum, CodebookMomentum):
        _require(codebook is not None, "codebook momentum needs the codebook")
        assert codebook is not None
        codes_shape = (grid[0], code_bytes(period, is_packed(codebook)))
        _require(
            momentum.codes.dtype == torch.uint8 and tuple(momentum.codes.shape) == codes_shape,
            f"momentum_codes must be uint8 of shape {codes_shape}",
        )
        _require_fp32(momentum.scale, (grid[0], 1), "momentum_scale")
    else:
        _require(codebook is None and seed is None, "dense momentum takes no codebook or seed")
        _require_fp32(momentum.momentum, grid, "momentum")
    return grid


def _check_scalars(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The hyperparameters arrive as Python numbers; a tensor ``lr`` is the caller's to read."""
    values = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "wd": weight_decay}
    for name, value in values.items():
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool),
            f"{name} must be a Python float, got {type(value).__name__}",
        )


def _advance_momentum(
    momentum: Momentum,
    gradient: Tensor,
    beta1: float,
    codebook: Tensor | None,
    seed: tuple[int, ...] | None,
) -> tuple[Momentum, Tensor]:
    """§6.1 step 5: the new momentum state and the momentum the update uses, both (B, P)."""
    if isinstance(momentum, DenseMomentum):
        advanced = torch.lerp(momentum.momentum, gradient, 1.0 - beta1)
        return DenseMomentum(advanced), advanced
    assert codebook is not None  # _check_common guarantees it; narrows the type for mypy
    codes, scale, stored = requantized_lerp(
        momentum.codes, momentum.scale, codebook, gradient, 1.0 - beta1, seed
    )
    # The update uses the re-quantized momentum, so what is stored is exactly what was applied.
    return CodebookMomentum(codes, scale), stored


def nesterov_momentum(stored: Tensor, gradient: Tensor, beta1: float) -> Tensor:
    """NAdam's look-ahead: ``lerp(m̂, G, 1 - β1) = β1·m̂ + (1 - β1)·G``, the momentum the
    next step would hold if the gradient repeated, applied in place of ``m̂``. Nothing is
    stored: the codes keep ``m̂`` alone, so the state and its bytes are those without it."""
    return torch.lerp(stored, gradient, 1.0 - beta1)


def _step_size(
    second_moment: Tensor, *, t: int, tau: int, beta1: float, beta2: float, eps: float
) -> Tensor:
    """§6.1 steps 3-4: ``reciprocal(sqrt(V) / sqrt(bc2) + eps) · (1/bc1)``, in that order."""
    bias_correction1 = 1.0 - beta1**t
    bias_correction2 = 1.0 - beta2**tau
    denominator = torch.sqrt(second_moment) / math.sqrt(bias_correction2) + eps
    return torch.reciprocal(denominator) * (1.0 / bias_correction1)


def _new_parameter(
    param: Tensor, update: Tensor, *, lr: float, weight_decay: float
) -> Tensor | None:
    """§6.1 step 7: ``dt(Pc·(1 - lr·wd) - U)`` with one final rounding; None when ``lr == 0``.

    ``Pc`` is a contiguous fp32 copy of the parameter (fp64 for fp64 parameters, with ``U``
    upcast to match); the decay factor is left out when ``lr·wd == 0``.
    """
    if lr == 0:
        return None
    work_dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    current = param.detach().contiguous().to(work_dtype)
    decay = lr * weight_decay
    if decay != 0:
        current = current * (1.0 - decay)
    return (current - update.reshape(param.shape).to(work_dtype)).to(param.dtype)


def _gradient_blocks(grad: Tensor, grid: tuple[int, int]) -> Tensor:
    """§6.1 step 1: ``fp32(grad)`` in logical order as (B, P), contiguous.

    Contiguity matters beyond indexing: the block and row reductions must see the same memory
    order for a transposed gradient as for its contiguous twin, or their sums round differently.
    """
    return grad.detach().reshape(grid).to(torch.float32).contiguous()


def update_block(
    param: Tensor,
    grad: Tensor,
    momentum: Momentum,
    v_block: Tensor,
    *,
    period: int,
    step: int,
    v_step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    codebook: Tensor | None = None,
    seed: tuple[int, ...] | None = None,
    nesterov: bool = False,
) -> BlockUpdate:
    """One §6.1 update of a block-family parameter; returns the staged state and parameter.

    Args:
        param: the parameter (any supported float dtype, any strides); read only.
        grad: its gradient, same shape (after AMP unscaling); read only, widened to fp32.
        momentum: ``CodebookMomentum`` (codebook8/4) or ``DenseMomentum`` (none), on the (B, P)
            grid with ``B = numel / period``.
        v_block: fp32 (B, 1), the EMA of each block's mean of ``g²``.
        period: the parameter's period ``P``.
        step, v_step: the stored counters; the update uses ``t = step + 1``, ``τ = v_step + 1``.
        lr, betas, eps, weight_decay: the group's options as Python floats (``lr`` already read
            from a tensor by the caller).
        codebook: the fp32 codebook, required by (and only by) codebook momentum.
        seed: ``(global_step, param_index)`` for stochastic rounding, or None for nearest.
        nesterov: apply ``lerp(m̂, G, 1 - β1)`` (``nesterov_momentum``) instead of ``m̂``.

    Returns a ``BlockUpdate`` with the new momentum, ``v_block``, counters ``(t, τ)`` and the new
    parameter value (contiguous, parameter dtype and shape), or ``param=None`` when ``lr == 0``.
    No input is modified.
    """
    with torch.no_grad():
        grid = _check_common(
            param,
            grad,
            momentum,
            period=period,
            step=step,
            v_step=v_step,
            codebook=codebook,
            seed=seed,
        )
        _require_fp32(v_block, (grid[0], 1), "v_block")
        _check_scalars(lr, betas, eps, weight_decay)
        beta1, beta2 = betas
        gradient = _gradient_blocks(grad, grid)
        block_mean_square = (gradient * gradient).mean(dim=1, keepdim=True)
        new_v_block = v_block * beta2 + block_mean_square * (1.0 - beta2)
        step_size = _step_size(
            new_v_block, t=step + 1, tau=v_step + 1, beta1=beta1, beta2=beta2, eps=eps
        )
        new_momentum, applied_momentum = _advance_momentum(
            momentum, gradient, beta1, codebook, seed
        )
        if nesterov:
            applied_momentum = nesterov_momentum(applied_momentum, gradient, beta1)
        update = (applied_momentum * step_size) * lr
        new_param = _new_parameter(param, update, lr=lr, weight_decay=weight_decay)
    return BlockUpdate(new_momentum, new_v_block, new_param, step + 1, v_step + 1)


def factored_second_moment(v_row: Tensor, v_col: Tensor) -> Tensor:
    """§6.2: ``v̂_ij = (v_row_i / max(mean(v_row), FLT_MIN)) · v_col_j``, fp32 (R, C). Divided
    first: the ratio is at most R, so v̂ stays finite wherever the squares' sums do (the product
    first overflowed from |g| ≈ 1e12 and stepped by 0)."""
    return torch.outer(v_row / v_row.mean().clamp_min(FLT_MIN), v_col)


def floored_second_moment(estimate: Tensor, square: Tensor, beta2: float) -> Tensor:
    """§6.2's floor: ``max(v̂_ij, (1 - β2)·g²_ij)``, fp32 (R, C).

    The row-column product spreads a row's and a column's mass evenly, so an element whose own
    gradient is far above its row and column sees a step size far too large; this floor is what
    the per-element EMA would hold after this one step from zero, and it costs no state.
    """
    return torch.maximum(estimate, square * (1.0 - beta2))


def update_factored(
    param: Tensor,
    grad: Tensor,
    momentum: Momentum,
    v_row: Tensor,
    v_col: Tensor,
    *,
    period: int,
    step: int,
    v_step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    codebook: Tensor | None = None,
    seed: tuple[int, ...] | None = None,
    factored_floor: bool = False,
    nesterov: bool = False,
) -> FactoredUpdate:
    """One §6.1 update of a 2-D (R, C) parameter with the factored second moment of §6.2.

    Arguments as in ``update_block``, with ``v_row`` fp32 (R,) and ``v_col`` fp32 (C,), the EMAs
    of the row and column means of ``g²``, in place of ``v_block``; ``factored_floor`` floors
    the estimate by ``(1 - β2)·g²`` (``floored_second_moment``). The momentum keeps its block
    partition with ``period``. Returns a ``FactoredUpdate``; no input is modified.
    """
    with torch.no_grad():
        _require(param.dim() == 2, f"update_factored needs a 2-D parameter, got {param.dim()}-D")
        grid = _check_common(
            param,
            grad,
            momentum,
            period=period,
            step=step,
            v_step=v_step,
            codebook=codebook,
            seed=seed,
        )
        rows, cols = param.shape
        _require_fp32(v_row, (rows,), "v_row")
        _require_fp32(v_col, (cols,), "v_col")
        _check_scalars(lr, betas, eps, weight_decay)
        beta1, beta2 = betas
        gradient = _gradient_blocks(grad, grid)
        square = (gradient * gradient).reshape(rows, cols)
        new_v_row = v_row * beta2 + square.mean(dim=1) * (1.0 - beta2)
        new_v_col = v_col * beta2 + square.mean(dim=0) * (1.0 - beta2)
        estimate = factored_second_moment(new_v_row, new_v_col)
        if factored_floor:
            estimate = floored_second_moment(estimate, square, beta2)
        step_size = _step_size(
            estimate,
            t=step + 1,
            tau=v_step + 1,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
        )
        new_momentum, applied_momentum = _advance_momentum(
            momentum, gradient, beta1, codebook, seed
        )
        if nesterov:
            applied_momentum = nesterov_momentum(applied_momentum, gradient, beta1)
        update = (applied_momentum.reshape(rows, cols) * step_size) * lr
        new_param = _new_parameter(param, update, lr=lr, weight_decay=weight_decay)
    return FactoredUpdate(new_momentum, new_v_row, new_v_col, new_param, step + 1, v_step + 1)
