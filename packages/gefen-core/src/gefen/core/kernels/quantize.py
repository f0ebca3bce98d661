"""Rounding values to codebook indices, docs/core.md §6.3.

``nearest_index`` is deterministic with ties to the lower index. ``stochastic_index`` picks the
upper of the two surrounding codewords with probability proportional to the distance from the
lower one, so the decoded value is unbiased. Its uniform draws come from a counter-based
splitmix-style hash of ``(global_step, param_index, element index)``: no RNG state exists, and a
resumed run replays the same draws.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

__all__ = ["Seed", "mix64", "nearest_index", "stochastic_index", "stream_seed", "uniform_draws"]

_MASK64 = (1 << 64) - 1
_MIX_MULTIPLIER_1 = 0xBF58476D1CE4E5B9
_MIX_MULTIPLIER_2 = 0x94D049BB133111EB
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_DRAW_SHIFT = 40  # keep the top 24 bits: exactly representable in fp32
_DRAW_SCALE = 2.0**-24
# Draws are produced in slices so the uint64 temporaries of a huge tensor stay bounded.
_DRAWS_PER_SLICE = 1 << 20


def mix64(z: int) -> int:
    """The §6.3 ``mix`` finaliser on one unsigned 64-bit integer."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX_MULTIPLIER_1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_MULTIPLIER_2) & _MASK64
    return z ^ (z >> 31)


def _mix64_array(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """``mix64`` elementwise; numpy uint64 arithmetic wraps modulo 2⁶⁴ as the hash requires."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX_MULTIPLIER_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX_MULTIPLIER_2)
    mixed: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return mixed


Seed = tuple[int, ...]
"""Stochastic rounding's ``(global_step, param_index)``, or ``(global_step, param_index,
first)`` for a shard whose first element is element ``first`` of the whole parameter."""


def stream_seed(seed: Seed) -> int:
    """``mix(mix(global_step) XOR param_index) + γ·first`` (mod 2⁶⁴, ``first`` 0 when absent):
    draw ``k`` of a shard is then draw ``first + k`` of the whole parameter (§6.3)."""
    global_step, param_index, *rest = seed
    first = rest[0] if rest else 0
    named = (("global_step", global_step), ("param_index", param_index), ("first", first))
    for name, value in named:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MASK64:
            raise ValueError(f"stochastic rounding seed: {name} must be an int >= 0, got {value!r}")
    return (mix64(mix64(global_step) ^ param_index) + _GOLDEN_GAMMA * first) & _MASK64


def uniform_draws(seed: Seed, numel: int) -> Tensor:
    """The draws ``u_k`` for ``k = 0 .. numel-1``: fp32 on the CPU, each in ``[0, 1)``.

    ``u_k = (mix(stream + 0x9E3779B97F4A7C15·(k+1)) >> 40) / 2²⁴`` with ``stream =
    stream_seed(seed)``; draw ``k`` depends only on ``seed`` and ``k``.
    """
    stream = np.uint64(stream_seed(seed))
    gamma = np.uint64(_GOLDEN_GAMMA)
    draws = np.empty(numel, dtype=np.float32)
    with np.errstate(over="ignore"):
        for first in range(0, numel, _DRAWS_PER_SLICE):
            last = min(numel, first + _DRAWS_PER_SLICE)
            counters = np.arange(first + 1, last + 1, dtype=np.uint64)
            hashed = _mix64_array(stream + gamma * counters)
            top_bits = (hashed >> np.uint64(_DRAW_SHIFT)).astype(np.float32)
            draws[first:last] = top_bits * np.float32(_DRAW_SCALE)
    return torch.from_numpy(draws)


# The bucketed count below replaces a binary search per element by a table lookup and a few
# exact comparisons; it is used for large finite inputs and falls back to searchsorted otherwise.
_BUCKETS = 8192
_BUCKETED_MIN_NUMEL = 4096
_BUCKETED_MAX_WINDOW = 8


def _count_below_bucketed(codebook: Tensor, values: Tensor) -> Tensor | None:
    """``searchsorted(codebook, values, side="left")`` computed exactly, or None (not applicable).

    The range ``[cb[0], cb[-1]]`` is cut into equal buckets; ``first[b]`` counts the codewords
    below the start of bucket ``b - 1``. The fp32 bucket of a value is off by at most one, so
    every codeword between ``first[b]`` and the value lies below the end of bucket ``b + 1``:
    comparing the value with the next ``window`` codewords (exactly, in fp32) completes the count.
    """
    lo, hi = float(codebook[0]), float(codebook[-1])
    if not hi > lo or not bool(torch.isfinite(values).all()):
        return None
    width = (hi - lo) / _BUCKETS
    steps = torch.arange(-1, _BUCKETS + 2, dtype=torch.float64, device=codebook.device)
    first = torch.searchsorted(codebook.double(), lo + width * steps, side="left")
    window = int((first[3:] - first[:-3]).max())
    if window > _BUCKETED_MAX_WINDOW:
        return None
    padding = torch.full((window + 1,), float("inf"), dtype=codebook.dtype, device=codebook.device)
    padded = torch.cat([codebook, padding])
    buckets = ((values - lo) * (1.0 / width)).floor_().clamp_(0, _BUCKETS - 1).long()
    start = first[buckets]
    count = start.clone()
    for offset in range(window):
        count += padded[start + offset] < values
    return count


def _neighbours(codebook: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Indices (L, R) of the codewords around each value: ``i`` = number of entries ``< x``."""
    last = codebook.numel() - 1
    above = None
    if values.numel() >= _BUCKETED_MIN_NUMEL and codebook.numel() > 1:
        above = _count_below_bucketed(codebook, values)
    if above is None:
        above = torch.searchsorted(codebook, values, side="left")
    return (above - 1).clamp(0, last), above.clamp(0, last)


def _check_codebook(codebook: Tensor) -> Tensor:
    if codebook.dim() != 1 or not 1 <= codebook.numel() <= 256:
        raise ValueError("codebook must be 1-D with at most 256 entries (uint8 indices)")
    if codebook.dtype != torch.float32:
        raise ValueError(f"codebook must be float32, got {codebook.dtype}")
    return codebook.contiguous()


def _nearest_reference(codebook: Tensor, values: Tensor) -> Tensor:
    """The normative rule of ``nearest_index`` on flat fp32 values (int64 indices)."""
    lower, upper = _neighbours(codebook, values)
    keep_lower = (values - codebook[lower]).abs() <= (values - codebook[upper]).abs()
    return torch.where(keep_lower, lower, upper)


# The nearest index is a non-decreasing step function of x (fp32 rounding is monotone), so a
# bucket whose bracketing values map to one index maps every value in it there. A table of
# 2**16 buckets resolves all but the few buckets that hold a decision point; those values take
# the reference path. Tables are cached per codebook (codebooks are frozen or rarely refreshed).
_TABLE_BUCKETS = 1 << 16
_TABLE_CACHE: dict[tuple[str, bytes], tuple[float, float, Tensor]] = {}
_TABLE_CACHE_SIZE = 4
# Optimizers stepping in several threads share the cache: two evicting at once both chose the
# same oldest key, and the second pop raised inside a commit (which latched the optimizer).
_TABLE_LOCK = threading.Lock()


def _rounded(edges: Tensor, *, up: bool) -> Tensor:
    """fp32 values at or beyond float64 ``edges`` in the given direction."""
    single = edges.to(torch.float32)
    beyond = single.double() > edges if not up else single.double() < edges
    toward = torch.full_like(single, float("inf") if up else float("-inf"))
    return torch.where(beyond, torch.nextafter(single, toward), single)


def _nearest_table(codebook: Tensor) -> tuple[float, float, Tensor] | None:
    lo, hi = float(codebook[0]), float(codebook[-1])
    if not hi > lo:
        return None
    key = (str(codebook.device), codebook.detach().cpu().numpy().tobytes())
    with _TABLE_LOCK:
        cached = _TABLE_CACHE.get(key)
    if cached is not None:
        return cached
    width = (hi - lo) / _TABLE_BUCKETS
    steps = torch.arange(-1, _TABLE_BUCKETS + 2, dtype=torch.float64, device=codebook.device)
    edges = lo + width * steps  # edges[b] is the start of bucket b - 1
    low = _nearest_reference(codebook, _rounded(edges[:_TABLE_BUCKETS], up=False))
    high = _nearest_reference(codebook, _rounded(edges[3:], up=True))
    # A computed bucket is off by at most one, and the outermost buckets also take every value
    # beyond the range, whose nearest codeword is an endpoint.
    low[0] = 0
    high[-1] = codebook.numel() - 1
    table = torch.where(low == high, low, torch.full_like(low, -1))
    built = (lo, 1.0 / width, table)
    with _TABLE_LOCK:
        while len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
            del _TABLE_CACHE[next(iter(_TABLE_CACHE))]
        _TABLE_CACHE[key] = built
    return built


def _nearest_tabled(codebook: Tensor, values: Tensor) -> Tensor | None:
    """``_nearest_reference`` through the bucket table, or None when not applicable."""
    if values.numel() < _BUCKETED_MIN_NUMEL or not bool(torch.isfinite(values).all()):
        return None
    built = _nearest_table(codebook)
    if built is None:
        return None
    lo, inverse, table = built
    buckets = ((values - lo) * inverse).floor_().clamp_(0, _TABLE_BUCKETS - 1).long()
    nearest = table[buckets]
    unresolved = nearest < 0
    if bool(unresolved.any()):
        nearest[unresolved] = _nearest_reference(codebook, values[unresolved])
    return nearest


def nearest_index(cb: Tensor, x: Tensor) -> Tensor:
    """Index of the nearest codeword to each element of ``fp32(x)``: uint8, ``x``'s shape.

    ``L`` is chosen over ``R`` iff ``|x - cb[L]| <= |x - cb[R]|`` in fp32, so a value halfway
    between two codewords gets the lower index and a value equal to a codeword gets its index.
    ``cb`` is a strictly increasing fp32 codebook on ``x``'s device; neither input is modified.
    """
    codebook = _check_codebook(cb)
    values = x.detach().reshape(-1).to(torch.float32)
    nearest = _nearest_tabled(codebook, values)
    if nearest is None:
        nearest = _nearest_reference(codebook, values)
    return nearest.to(torch.uint8).reshape(x.shape)


def stochastic_index(cb: Tensor, x: Tensor, *, seed: Seed) -> Tensor:
    """Unbiased random rounding of ``fp32(x)`` to one of its two surrounding codewords.

    With ``L``/``R`` as in ``nearest_index``: ``L`` when ``L == R``, otherwise ``R`` iff
    ``u_k < (x - cb[L]) / (cb[R] - cb[L])`` in fp32, where ``u_k`` is ``uniform_draws(seed, n)``
    at ``x``'s flat logical index ``k``. ``seed = (global_step, param_index)``: the global step
    before the committing step and the parameter's flat index across groups. uint8, ``x``'s shape.
    """
    codebook = _check_codebook(cb)
    values = x.detach().reshape(-1).to(torch.float32)
    lower, upper = _neighbours(codebook, values)
    low_value = codebook[lower]
    gap = codebook[upper] - low_value
    draws = uniform_draws(seed, values.numel()).to(values.device)
    # Where L == R the gap is 0 and the quotient is NaN or inf; those lanes must keep L.
    round_up = (draws < (values - low_value) / gap) & (upper != lower)
    return torch.where(round_up, upper, lower).to(torch.uint8).reshape(x.shape)
