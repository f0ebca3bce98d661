"""The 4096-bin histogram the codebook is learned from, docs/core.md §5.1."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BIN_COUNT", "bin_centres", "histogram"]

BIN_COUNT = 4096
"""Number of equal-width bins over [-1, 1]."""

# Rows are binned in slices of about this many elements so that the temporaries of a very
# large parameter stay bounded; counts are exact integers, so the slicing cannot change them.
_ELEMENTS_PER_SLICE = 1 << 22


def bin_centres() -> Tensor:
    """``c_j = -1 + (2j + 1)/4096`` in float64 (exact), shape (4096,), on the CPU."""
    return -1.0 + (2.0 * torch.arange(BIN_COUNT, dtype=torch.float64) + 1.0) / BIN_COUNT


def _bin_rows(rows: Tensor) -> Tensor:
    """Counts of one slice of (blocks, P) fp32 rows, skipping all-zero blocks."""
    magnitude = rows.abs().amax(dim=1, keepdim=True)
    contributing = magnitude.reshape(-1) > 0
    if not bool(contributing.any()):
        return torch.zeros(BIN_COUNT, dtype=torch.int64)
    normalised = rows[contributing] / magnitude[contributing]
    # fp32(x + 1) first, then the exact scaling by a power of two: the bin edges are those of
    # the fp32 sum, which is what keeps x = -1, 0 and +1 in bins 0, 2048 and 4095.
    shifted = normalised + 1.0
    bins = torch.floor(shifted * (BIN_COUNT // 2)).clamp(0, BIN_COUNT - 1).to(torch.int64)
    return torch.bincount(bins.reshape(-1).cpu(), minlength=BIN_COUNT)


def histogram(x: Tensor, period: int) -> Tensor:
    """Histogram of one parameter's block-normalised values: int64, shape (4096,), on the CPU.

    ``x`` (any shape, any real dtype) is read as ``fp32(x)`` in logical order and split into
    blocks of ``period`` consecutive elements. Each block whose absolute maximum ``a`` is non-zero
    contributes every element ``fp32(x)/a`` to bin ``clamp(floor(fp32(x/a + 1)·2048), 0, 4095)``.
    All-zero blocks contribute nothing. Histograms of several parameters add up exactly.
    ``x`` is not modified.
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"histogram: period must be an int >= 1, got {period!r}")
    n = x.numel()
    if n % period != 0:
        raise ValueError(f"histogram: period {period} does not divide numel {n}")
    counts = torch.zeros(BIN_COUNT, dtype=torch.int64)
    if n == 0:
        return counts
    blocks = x.detach().reshape(-1, period).to(torch.float32)
    rows_per_slice = max(1, _ELEMENTS_PER_SLICE // period)
    for start in range(0, blocks.shape[0], rows_per_slice):
        counts += _bin_rows(blocks[start : start + rows_per_slice])
    return counts
