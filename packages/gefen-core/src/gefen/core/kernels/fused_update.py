"""The fused, in-place form of the §6.1 update (docs/core.md §7.1 phase 5, §11).

These functions are written for ``torch.compile(fullgraph=True)``: plain torch on tensors, no
host synchronisation, no data-dependent Python branch. Each one updates one chunk of whole
blocks of one parameter **in place** (its codes, scales, second moments and values), so the
step never stages anything proportional to the model. Inductor turns the same source into C++
on the CPU and Triton on CUDA. The eager kernels of ``update.py`` stay the normative reference;
the parity bounds of §11 are tested against them.

Scalars arrive packed in one fp64 tensor ``hp`` (see ``HP_*``) so that an LR scheduler changing
``lr`` every step never recompiles. Only structural facts are Python constants of the graph:
whether stochastic rounding, the weight decay or the parameter write happen, and the scan
``window`` of the encode.

The encode is branch-free and exact. ``count_table`` gives, for each of ``TABLE_BUCKETS``
equal buckets of ``[-1, 1]``, how many codewords fall in an earlier bucket (the bucket of a
value is computed by the same fp32 formula for codewords and for inputs, so the formula's
monotonicity makes the count a lower bound of "entries < x"); ``window`` exact comparisons
then finish the left ``searchsorted``, where ``window`` is the most codewords any one bucket
holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gefen.core.kernels.blocks import pack_codes, unpack_codes

__all__ = [
    "HP_BETA2",
    "HP_DECAY",
    "HP_EPS",
    "HP_INV_BC1",
    "HP_LR",
    "HP_ONE_MINUS_BETA1",
    "HP_ONE_MINUS_BETA2",
    "HP_SIZE",
    "HP_SQRT_BC2",
    "TABLE_BUCKETS",
    "Rounding",
    "advance_momentum_",
    "block_update_",
    "count_table",
    "factored_moments_",
    "factored_update_",
    "factored_whole_update_",
    "scan_window",
]

# Slots of the packed hyperparameter tensor (fp64; each is rounded to fp32 where the eager
# reference would round the same Python float).
HP_LR, HP_ONE_MINUS_BETA1, HP_BETA2, HP_ONE_MINUS_BETA2 = 0, 1, 2, 3
HP_SQRT_BC2, HP_EPS, HP_INV_BC1, HP_DECAY = 4, 5, 6, 7
HP_SIZE = 8

TABLE_BUCKETS = 4096

# §6.3's hash constants as two's-complement int64 (torch has no general uint64 arithmetic);
# multiplication and addition wrap modulo 2⁶⁴ exactly as the unsigned definition requires.
_MASK = 1 << 64
_MIX_1 = 0xBF58476D1CE4E5B9 - _MASK
_MIX_2 = 0x94D049BB133111EB - _MASK
_GAMMA = 0x9E3779B97F4A7C15 - _MASK
_DRAW_SHIFT = 40
_DRAW_SCALE = 2.0**-24


Rounding = tuple[int, bool, Tensor, Tensor, bool]
"""``(window, stochastic, stream seed, flat index of the chunk's first element, packed)``: the
scan window and the two flags are graph constants, the seed and index int64 0-d tensors;
``packed`` says the codes hold two 4-bit indices per byte (a 16-value codebook)."""


def _bucket(x: Tensor) -> Tensor:
    """The bucket of fp32 values in [-1, 1]; a monotone non-decreasing function of x."""
    return ((x + 1.0) * (TABLE_BUCKETS / 2)).floor().clamp(0, TABLE_BUCKETS - 1).to(torch.int64)


def count_table(codebook: Tensor) -> Tensor:
    """``table[b]`` = the number of codewords whose bucket is below ``b`` (int64, on the
    codebook's device). For x in bucket b, ``table[b] <= #{cb < x} <= table[b + 1]``."""
    buckets = _bucket(codebook.to(torch.float32))
    edges = torch.arange(TABLE_BUCKETS, device=codebook.device, dtype=torch.int64)
    return torch.searchsorted(buckets, edges)


def scan_window(codebook: Tensor) -> int:
    """The comparisons the encode needs: the most codewords in one bucket, rounded up to a
    power of two so that a refreshed codebook rarely changes the compiled graph."""
    counts = torch.bincount(_bucket(codebook.to(torch.float32)), minlength=TABLE_BUCKETS)
    most = max(1, int(counts.max()))
    return 1 << (most - 1).bit_length()


def _count_below(x: Tensor, codebook: Tensor, table: Tensor, window: int) -> Tensor:
    """``#{cb < x}`` (left ``searchsorted``) for finite x in [-1, 1]; int64."""
    size = codebook.shape[0]
    count = table[_bucket(x)]
    for _ in range(window):
        probe = codebook[count.clamp(max=size - 1)]
        count = count + ((probe < x) & (count < size)).to(torch.int64)
    return count


def _logical_shift(z: Tensor, bits: int) -> Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: Tensor) -> Tensor:
    z = (z ^ _logical_shift(z, 30)) * _MIX_1
    z = (z ^ _logical_shift(z, 27)) * _MIX_2
    return z ^ _logical_shift(z, 31)


def _draws(stream: Tensor, first: Tensor, shape: tuple[int, int]) -> Tensor:
    """§6.3's ``u_k`` for the flat logical indices ``first + 0 .. first + b·P - 1``."""
    rows, period = shape
    k = first + torch.arange(rows * period, device=first.device, dtype=torch.int64)
    hashed = _mix(stream + _GAMMA * (k + 1))
    return (_logical_shift(hashed, _DRAW_SHIFT).to(torch.float32) * _DRAW_SCALE).view(shape)


def _encode(
    advanced: Tensor,
    codebook: Tensor,
    table: Tensor,
    window: int,
    stochastic: bool,
    stream: Tensor,
    first: Tensor,
) -> tuple[Tensor, Tensor]:
    """Block absmax and the §6.3 index of every element: (scale (b, 1), codes int64 (b, P))."""
    scale = advanced.abs().amax(dim=1, keepdim=True)
    normalised = torch.where(scale > 0, advanced / scale, 0.0)
    # Non-finite values (check_finite=False) must never index out of range.
    safe = torch.where(normalised == normalised, normalised, 0.0).clamp(-1.0, 1.0)
    count = _count_below(safe, codebook, table, window)
    lower = (count - 1).clamp(0, codebook.shape[0] - 1)
    upper = count.clamp(0, codebook.shape[0] - 1)
    low_value, high_value = codebook[lower], codebook[upper]
    if not stochastic:
        take_lower = (safe - low_value).abs() <= (safe - high_value).abs()
        return scale, torch.where(take_lower, lower, upper)
    gap = high_value - low_value
    p_up = (safe - low_value) / torch.where(gap > 0, gap, 1.0)
    up = (_draws(stream, first, (advanced.shape[0], advanced.shape[1])) < p_up) & (gap > 0)
    return scale, torch.where(up, upper, lower)


def _write(param: Tensor, update: Tensor, hp: Tensor, decay: bool) -> None:
    """§6.1 step 7 on one chunk: ``dt(Pc·(1 - lr·wd) - U)``, one final rounding."""
    work = torch.float64 if param.dtype == torch.float64 else torch.float32
    current = param.to(work)
    if decay:
        current = current * hp[HP_DECAY].to(work)
    param.copy_((current - update.to(work)).to(param.dtype))


def _step_size(second_moment: Tensor, hp32: Tensor) -> Tensor:
    denominator = torch.sqrt(second_moment) / hp32[HP_SQRT_BC2] + hp32[HP_EPS]
    return torch.reciprocal(denominator) * hp32[HP_INV_BC1]


def advance_momentum_(
    grad: Tensor,
    state: tuple[Tensor, ...],
    codebooks: tuple[Tensor, ...],
    weight: Tensor,
    rounding: Rounding,
) -> Tensor:
    """§6.1 step 5 in place: ``lerp(M, G, weight)`` stored (re-encoded for a codebook codec);
    returns the momentum the update applies (fp32, (b, P)). Shared with GefenMuon's momentum.

    ``state`` is ``(codes, scale)`` for a codebook codec or ``(momentum,)`` for "none";
    ``codebooks`` is (codebook, count table), empty for "none".
    """
    if len(state) == 1:
        (momentum,) = state
        momentum.copy_(torch.lerp(momentum, grad.to(momentum.dtype), weight.to(momentum.dtype)))
        return momentum
    codes, scale = state
    codebook, table = codebooks
    window, stochastic, stream, first, packed = rounding
    # codebook4: the chunk's bytes hold two indices each (gefen.core.kernels.blocks)
    stored = unpack_codes(codes, grad.shape[1]) if packed else codes.to(torch.int64)
    advanced = torch.lerp(codebook[stored] * scale, grad, weight)
    new_scale, index = _encode(advanced, codebook, table, window, stochastic, stream, first)
    codes.copy_(pack_codes(index) if packed else index.to(torch.uint8))
    scale.copy_(new_scale)
    return codebook[index] * new_scale


def block_update_(
    param: Tensor,
    grad: Tensor,
    state: tuple[Tensor, ...],
    v_block: Tensor,
    codebooks: tuple[Tensor, ...],
    hp: Tensor,
    rounding: Rounding,
    flags: tuple[bool, bool, bool],
) -> None:
    """One chunk of whole blocks of a block-family parameter, in place.

    ``param`` and ``grad`` are (b, P) views in logical order, ``v_block`` (b, 1); ``rounding``
    is a ``Rounding``; ``flags`` is ``(decay, write, nesterov)``.
    """
    hp32 = hp.to(torch.float32)
    gradient = grad.to(torch.float32)
    new_v = (
        v_block * hp32[HP_BETA2]
        + (gradient * gradient).mean(dim=1, keepdim=True) * hp32[HP_ONE_MINUS_BETA2]
    )
    v_block.copy_(new_v)
    applied = advance_momentum_(gradient, state, codebooks, hp32[HP_ONE_MINUS_BETA1], rounding)
    decay, write, nesterov = flags
    if nesterov:  # update.nesterov_momentum
        applied = torch.lerp(applied, gradient, hp32[HP_ONE_MINUS_BETA1])
    if write:
        _write(param, (applied * _step_size(new_v, hp32)) * hp32[HP_LR], hp, decay)


def factored_moments_(grad: Tensor, v_row: Tensor, v_col: Tensor, hp: Tensor) -> Tensor:
    """§6.2's row and column EMAs of a whole (R, C) gradient, in place; returns the 0-d
    normaliser ``max(mean(v_row), FLT_MIN)`` the chunks divide by."""
    hp32 = hp.to(torch.float32)
    gradient = grad.to(torch.float32)
    square = gradient * gradient
    v_row.copy_(v_row * hp32[HP_BETA2] + square.mean(dim=1) * hp32[HP_ONE_MINUS_BETA2])
    # Inductor's CPU code adds a column's rows one after another: in float32 a tall matrix's
    # column mean drifts by about R * 2^-24, past §11's 1e-6, so the CPU sums in float64.
    wide = torch.float64 if grad.device.type == "cpu" else None
    column = square.mean(dim=0, dtype=wide).to(torch.float32)
    v_col.copy_(v_col * hp32[HP_BETA2] + column * hp32[HP_ONE_MINUS_BETA2])
    return v_row.mean().clamp_min(2.0**-126)


def factored_update_(
    param: Tensor,
    grad: Tensor,
    state: tuple[Tensor, ...],
    factors: tuple[Tensor, Tensor, Tensor],
    codebooks: tuple[Tensor, ...],
    hp: Tensor,
    rounding: Rounding,
    flags: tuple[bool, bool, bool, bool],
) -> None:
    """One chunk of whole blocks of a factored (R, C) parameter, in place, after
    ``factored_moments_``. ``factors`` is (v_row, v_col, normaliser), where ``v_row`` is either
    the slice of the rows the chunk covers exactly or the whole vector; ``flags`` is ``(decay,
    write, floor, nesterov)``, ``floor`` the group's ``factored_floor``; arguments otherwise as
    ``block_update_``. Element k of the chunk is logical element ``first + k``: row
    ``(first + k) // C``, column ``(first + k) % C``."""
    hp32 = hp.to(torch.float32)
    gradient = grad.to(torch.float32)
    v_row, v_col, normaliser = factors
    first = rounding[3]
    rows, period = gradient.shape[0], gradient.shape[1]
    columns = v_col.shape[0]
    if v_row.shape[0] * columns == rows * period:
        # The chunk is whole matrix rows (the caller passes their slice of v_row): a broadcast.
        second = ((v_row / normaliser)[:, None] * v_col[None, :]).reshape(rows, period)
    else:
        flat = first + torch.arange(rows * period, device=grad.device, dtype=torch.int64)
        second = ((v_row / normaliser)[flat // columns] * v_col[flat % columns]).view(rows, period)
    decay, write, floor, nesterov = flags
    if floor:  # update.floored_second_moment, in the same fp32 order
        second = torch.maximum(second, (gradient * gradient) * hp32[HP_ONE_MINUS_BETA2])
    applied = advance_momentum_(gradient, state, codebooks, hp32[HP_ONE_MINUS_BETA1], rounding)
    if nesterov:  # update.nesterov_momentum
        applied = torch.lerp(applied, gradient, hp32[HP_ONE_MINUS_BETA1])
    if write:
        _write(param, (applied * _step_size(second, hp32)) * hp32[HP_LR], hp, decay)


def factored_whole_update_(
    param: Tensor,
    grad: Tensor,
    state: tuple[Tensor, ...],
    factors: tuple[Tensor, Tensor],
    codebooks: tuple[Tensor, ...],
    hp: Tensor,
    rounding: Rounding,
    flags: tuple[bool, bool, bool, bool],
) -> None:
    """``factored_moments_`` then ``factored_update_`` over every block of an (R, C)
    parameter in one call, for a parameter that fits one chunk: each call costs the host more
    than a GPU spends on a few million elements, so this halves a matrix's cost there.
    ``factors`` is (v_row, v_col); arguments otherwise as ``factored_update_``."""
    v_row, v_col = factors
    normaliser = factored_moments_(grad.reshape(v_row.shape[0], -1), v_row, v_col, hp)
    factored_update_(param, grad, state, (v_row, v_col, normaliser), codebooks, hp, rounding, flags)
