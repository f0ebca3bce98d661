"""Learning the codebook from a histogram, docs/core.md §5.2 and §5.3.

With fewer active bins than codewords the codebook is padded by repeated bisection of the widest
gap (§5.2). Otherwise it is the exact optimal weighted 1-D k-means split of the active bin
centres into K contiguous clusters, the first pinned to -1 and the last to +1 (§5.3), found by
dynamic programming. Each DP layer uses the divide-and-conquer optimisation, which is valid
because the interior cluster cost is Monge (the leftmost optimal split does not decrease with the
segment end). One recursion level of every sub-interval is evaluated as a single batch of numpy
array operations, so the Python overhead grows with the number of levels (about log2 A per
layer), not with the number of sub-intervals; that is what makes K = 256, A = 4096 feasible
without compiled code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from gefen.core.kernels.binning import BIN_COUNT

__all__ = ["pad_codebook", "solve_codebook", "solve_optimal"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Larger than any split position: marks candidates that do not attain their segment's minimum.
_NO_SPLIT = np.iinfo(np.int64).max


def _active_centres(counts: Tensor) -> tuple[IntArray, FloatArray, FloatArray]:
    """(active bin indices, their centres, their weights), all in ascending bin order."""
    values = counts.detach().cpu().numpy().astype(np.int64)
    active = np.flatnonzero(values > 0).astype(np.int64)
    centres = -1.0 + (2.0 * active.astype(np.float64) + 1.0) / BIN_COUNT
    return active, centres, values[active].astype(np.float64)


def pad_codebook(active_bins: IntArray, k: int) -> FloatArray:
    """§5.2: ``{-1, +1}`` plus the interior active centres, padded to ``k`` values by bisection.

    While fewer than ``k`` values exist, the float64 midpoint of the widest gap is inserted (the
    leftmost gap on ties). Returned in float64; the caller rounds once to fp32.
    """
    interior = active_bins[(active_bins != 0) & (active_bins != BIN_COUNT - 1)]
    interior_centres = -1.0 + (2.0 * interior.astype(np.float64) + 1.0) / BIN_COUNT
    values = np.concatenate(([-1.0], np.sort(interior_centres), [1.0]))
    if values.size > k:
        raise ValueError(
            f"solve_codebook: {values.size} fixed values (both endpoints and {interior.size} "
            f"interior active bins) do not fit in k = {k}"
        )
    while values.size < k:
        gaps = np.diff(values)
        widest = int(np.argmax(gaps))  # argmax returns the first maximum: the leftmost gap
        midpoint = (values[widest] + values[widest + 1]) / 2.0
        values = np.insert(values, widest + 1, midpoint)
    return values


@dataclass(frozen=True)
class _PrefixSums:
    """Float64 prefix sums over the active centres; index 0 is the empty prefix."""

    weight: FloatArray  # W_e = sum of w_i for i <= e
    first: FloatArray  # S_e = sum of w_i·c_i
    second: FloatArray  # Q_e = sum of (w_i·c_i)·c_i

    @staticmethod
    def of(centres: FloatArray, weights: FloatArray) -> _PrefixSums:
        weighted = weights * centres
        zero = np.zeros(1)
        return _PrefixSums(
            weight=np.concatenate((zero, np.cumsum(weights))),
            first=np.concatenate((zero, np.cumsum(weighted))),
            second=np.concatenate((zero, np.cumsum(weighted * centres))),
        )

    def segment(self, start: IntArray, end: IntArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        """(w, a, q) of the segments ``start..end`` (1-based, inclusive)."""
        before = start - 1
        return (
            self.weight[end] - self.weight[before],
            self.first[end] - self.first[before],
            self.second[end] - self.second[before],
        )


def _first_cluster_cost(sums: _PrefixSums, start: IntArray, end: IntArray) -> FloatArray:
    w, a, q = sums.segment(start, end)
    return q + 2.0 * a + w  # sum of w·(c + 1)², the cluster represented by -1


def _last_cluster_cost(sums: _PrefixSums, start: IntArray, end: IntArray) -> FloatArray:
    w, a, q = sums.segment(start, end)
    return q - 2.0 * a + w  # sum of w·(c - 1)², the cluster represented by +1


def _interior_cost(sums: _PrefixSums, start: IntArray, end: IntArray) -> FloatArray:
    w, a, q = sums.segment(start, end)
    return q - a * a / w  # weighted squared error around the weighted mean


def _solve_layer(
    sums: _PrefixSums, previous: FloatArray, layer: int, last_end: int
) -> tuple[FloatArray, IntArray]:
    """One interior layer: ``D_k(e) = min_s D_{k-1}(s-1) + cost(s..e)`` for ``e in [k, last_end]``.

    Divide and conquer: the midpoint ``e`` of each pending interval is solved over the split
    range its neighbours allow, then its leftmost optimal ``s`` bounds both halves. All the
    intervals of one recursion level are evaluated together as one flat array of candidates,
    one segment per interval, ``s`` ascending within a segment.
    """
    current = np.full(previous.size, np.inf)
    best_start = np.zeros(previous.size, dtype=np.int64)
    lo = np.array([layer], dtype=np.int64)
    hi = np.array([last_end], dtype=np.int64)
    split_lo = lo.copy()
    split_hi = hi.copy()
    while lo.size:
        mid = (lo + hi) // 2
        lengths = np.minimum(split_hi, mid) - split_lo + 1
        offsets = np.cumsum(lengths)
        segment_starts = offsets - lengths
        start = np.arange(int(offsets[-1])) - np.repeat(segment_starts - split_lo, lengths)
        candidates = previous[start - 1] + _interior_cost(sums, start, np.repeat(mid, lengths))
        minima = np.minimum.reduceat(candidates, segment_starts)
        # ``start`` ascends within a segment, so the smallest start attaining the minimum is the
        # leftmost optimal split.
        attained = np.where(candidates == np.repeat(minima, lengths), start, _NO_SPLIT)
        chosen = np.minimum.reduceat(attained, segment_starts)
        current[mid] = minima
        best_start[mid] = chosen
        has_left = mid > lo
        has_right = mid < hi
        lo = np.concatenate((lo[has_left], mid[has_right] + 1))
        hi = np.concatenate((mid[has_left] - 1, hi[has_right]))
        split_lo, split_hi = (
            np.concatenate((split_lo[has_left], chosen[has_right])),
            np.concatenate((chosen[has_left], split_hi[has_right])),
        )
    return current, best_start


def solve_optimal(centres: FloatArray, weights: FloatArray, k: int) -> FloatArray:
    """§5.3: the optimal K-cluster codebook of ``A >= K`` weighted centres, in float64.

    Cluster 1 is represented by -1, cluster K by +1 and each other cluster by its weighted mean
    ``a/w`` (prefix-sum differences). Every minimum takes the smallest ``s`` attaining it, compared
    exactly in float64.
    """
    count = centres.size
    if count < k:
        raise ValueError(f"solve_optimal needs at least k = {k} active centres, got {count}")
    sums = _PrefixSums.of(centres, weights)
    # Arrays are indexed by the 1-based segment end; index 0 and unreachable ends stay +inf.
    ends = np.arange(1, count - k + 2, dtype=np.int64)
    layer_cost = np.full(count + 1, np.inf)
    layer_cost[ends] = _first_cluster_cost(sums, np.ones_like(ends), ends)
    best_starts: list[IntArray] = []
    for layer in range(2, k):
        layer_cost, best_start = _solve_layer(sums, layer_cost, layer, count - k + layer)
        best_starts.append(best_start)
    last_starts = np.arange(k, count + 1, dtype=np.int64)
    totals = layer_cost[last_starts - 1] + _last_cluster_cost(
        sums, last_starts, np.full_like(last_starts, count)
    )
    start = int(last_starts[int(np.argmin(totals))])  # argmin: the first, i.e. smallest, s
    codebook = np.empty(k)
    codebook[0], codebook[k - 1] = -1.0, 1.0
    for layer in range(k - 1, 1, -1):
        end = start - 1
        start = int(best_starts[layer - 2][end])
        w, a, _ = sums.segment(np.array([start]), np.array([end]))
        codebook[layer - 1] = float(a[0] / w[0])
    return codebook


def solve_codebook(counts: Tensor, k: int = 256) -> Tensor:
    """Learn a K-entry codebook from a 4096-bin int64 histogram (docs/core.md §5.2–§5.3).

    Returns a strictly increasing fp32 tensor of ``k`` values on the CPU with ``cb[0] == -1`` and
    ``cb[k-1] == +1``. With ``A`` active bins (count > 0): ``A < k`` pads (§5.2), ``A >= k`` solves
    the exact DP (§5.3). Raises ValueError for an empty histogram, a malformed ``counts`` or
    ``k < 2``. ``counts`` is not modified.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ValueError(f"solve_codebook: k must be an int >= 2, got {k!r}")
    if counts.dtype != torch.int64 or counts.shape != (BIN_COUNT,):
        raise ValueError(
            f"solve_codebook: counts must be int64 of shape ({BIN_COUNT},), "
            f"got {counts.dtype} {tuple(counts.shape)}"
        )
    if bool((counts < 0).any()):
        raise ValueError("solve_codebook: counts must be non-negative")
    active, centres, weights = _active_centres(counts)
    if active.size == 0:
        raise ValueError("solve_codebook: the histogram is empty (no active bin)")
    if active.size < k:
        values = pad_codebook(active, k)
    else:
        values = solve_optimal(centres, weights, k)
    codebook = torch.from_numpy(values.astype(np.float32))
    if not bool((codebook[1:] > codebook[:-1]).all()):
        # Unreachable for real histograms (adjacent interior means are a bin width apart); kept
        # so that a numerically broken solve can never publish an invalid codebook.
        raise RuntimeError("solve_codebook: the solved codebook is not strictly increasing")
    return codebook
