"""Period (block length) selection, docs/core.md §4.

The period is chosen once per parameter from its first gradient. The search looks for the block
length at which the within-block spread of ``g²`` stops growing fastest; whatever the search says,
the fallback guarantees ``P >= 8`` for every unforced parameter with ``n >= 8``, which is what
keeps the per-block overhead under one byte per eight elements.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "MIN_SEARCHED_PERIOD",
    "candidate_divisors",
    "decide_period",
    "fallback",
    "period_errors",
    "row_period",
    "select_period",
]

MIN_SEARCHED_PERIOD = 8
"""A searched period below this becomes 1 (and then the fallback)."""

_FALLBACK_MAX_DIVISOR = 2048
# The weight given to the first candidate: a tiny positive number, so that any real drop in the
# error beats "no blocking at all".
_FIRST_CANDIDATE_WEIGHT = 1e-12


def _divisors(n: int) -> list[int]:
    """All divisors of ``n >= 1`` in ascending order, ``n`` included."""
    small: list[int] = []
    large: list[int] = []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def candidate_divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, excluding ``n`` itself (§4 step 4).

    ``12 -> [1, 2, 3, 4, 6]``, ``13 -> [1]``, ``16 -> [1, 2, 4, 8]``. ``n = 1`` gives ``[]``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"candidate_divisors needs an int n >= 1, got {n!r}")
    return _divisors(n)[:-1]


def decide_period(errors: Sequence[tuple[int, float]]) -> int:
    """The §4 decision function on ``(p, err(p))`` pairs in ascending ``p`` order.

    ``w(p_1) = 1e-12`` and ``w(p_i) = err(p_i) - err(p_{i-1})``; the result is the ``p`` with the
    lexicographically smallest ``(w(p), p)`` (the largest drop, ties to the smaller ``p``). A
    result below 8 is returned as 1. An empty list raises ValueError.
    """
    if len(errors) == 0:
        raise ValueError("decide_period needs at least one (p, err) pair")
    periods = [p for p, _ in errors]
    if any(later <= earlier for earlier, later in itertools.pairwise(periods)):
        raise ValueError(f"decide_period needs strictly ascending periods, got {periods}")
    best_weight = _FIRST_CANDIDATE_WEIGHT
    best_period = errors[0][0]
    for (_, previous_err), (period, err) in itertools.pairwise(errors):
        weight = float(err) - float(previous_err)
        if (weight, period) < (best_weight, best_period):
            best_weight, best_period = weight, period
    return best_period if best_period >= MIN_SEARCHED_PERIOD else 1


def fallback(n: int, shape: Sequence[int]) -> int:
    """The memory-safe period of §4: never below 8 once ``n >= 8``.

    Candidates: ``shape[-1]`` for ``ndim >= 2`` when it is at least 8, and the largest divisor of
    ``n`` in ``[8, 2048]`` (``n`` itself counts). The largest candidate wins; with none, the
    smallest divisor of ``n`` that is at least 8 (one block for a prime ``n``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"fallback needs an int n >= 0, got {n!r}")
    if n < MIN_SEARCHED_PERIOD:
        return 1
    divisors = _divisors(n)
    candidates: list[int] = []
    if len(shape) >= 2 and shape[-1] >= MIN_SEARCHED_PERIOD:
        candidates.append(int(shape[-1]))
    in_range = [d for d in divisors if MIN_SEARCHED_PERIOD <= d <= _FALLBACK_MAX_DIVISOR]
    if in_range:
        candidates.append(in_range[-1])
    if candidates:
        return max(candidates)
    return next(d for d in divisors if d >= MIN_SEARCHED_PERIOD)


def row_period(shape: Sequence[int]) -> int | None:
    """One block per leading-index slice (docs/core.md §4.1): ``prod(shape[1:])`` for a tensor of
    two or more dimensions whose slices hold at least 8 elements, else None (§4 searches)."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    row = math.prod(shape[1:])
    return row if row >= MIN_SEARCHED_PERIOD else None


def period_errors(squares: Tensor, divisors: Sequence[int]) -> list[tuple[int, float]]:
    """``err(p)`` for each ``p``: the root of the mean within-block population variance.

    ``squares`` holds ``fp32(g)²`` in logical order. The variance is the normative two-pass
    evaluation in float64 (block mean first, then the mean squared deviation from it).
    """
    flat = squares.reshape(-1).to(torch.float64)
    result: list[tuple[int, float]] = []
    for period in divisors:
        blocks = flat.view(-1, period)
        deviation = blocks - blocks.mean(dim=1, keepdim=True)
        within_block_variance = (deviation * deviation).mean(dim=1)
        result.append((period, math.sqrt(float(within_block_variance.mean()))))
    return result


def select_period(g: Tensor, shape: Sequence[int], *, force_one: bool) -> int | None:
    """Choose the period ``P`` of one parameter from its gradient (docs/core.md §4).

    ``g`` is the gradient view the period is learned from (a local shard for a DTensor) and
    ``shape`` its quantized shape; ``prod(shape)`` must equal ``g.numel()``. The caller decides
    ``force_one``. Returns None for ``n = 0`` (the parameter stays pristine), otherwise a divisor
    of ``n``. Pure and deterministic; ``g`` is not modified.

    "Entirely zero" is judged on ``fp32(g)``, the values the search itself would see.
    """
    n = g.numel()
    if math.prod(shape) != n:
        raise ValueError(f"select_period: shape {tuple(shape)} does not hold {n} elements")
    if n == 0:
        return None
    if n == 1 or force_one:
        return 1
    gradient = g.detach().reshape(-1).to(torch.float32)
    if not bool(gradient.any()):
        return fallback(n, shape)
    squares = gradient * gradient
    searched = decide_period(period_errors(squares, candidate_divisors(n)))
    return fallback(n, shape) if searched == 1 else searched
