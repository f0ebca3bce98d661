"""The 4096-bin histogram, docs/core.md §5.1 (edge case §12 #17)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gefen.core.kernels.binning as binning
from gefen.core.kernels import BIN_COUNT, bin_centres, histogram


def reference_histogram(x: torch.Tensor, period: int) -> list[int]:
    """Element by element with numpy float32 scalars, exactly as §5.1 words it."""
    counts = [0] * 4096
    values = x.reshape(-1).to(torch.float32).numpy()
    for block in values.reshape(-1, period):
        magnitude = max(abs(v) for v in block)
        if magnitude == 0:
            continue
        for value in block:
            shifted = np.float32(np.float32(value / magnitude) + np.float32(1.0))
            counts[min(max(math.floor(float(shifted) * 2048), 0), 4095)] += 1
    return counts


def test_endpoints_and_zero_land_in_their_pinned_bins() -> None:
    counts = histogram(torch.tensor([-1.0, 0.0, 1.0]), 3)
    assert counts.dtype == torch.int64
    assert counts.shape == (BIN_COUNT,)
    assert counts[0] == 1
    assert counts[2048] == 1
    assert counts[4095] == 1
    assert int(counts.sum()) == 3


def test_values_are_normalised_by_their_block_maximum() -> None:
    # Block maxima 4 and 0.5: -4 -> -1 (bin 0), 2 -> 0.5, 0.5 -> +1 (bin 4095), -0.25 -> -0.5.
    counts = histogram(torch.tensor([-4.0, 2.0, 0.5, -0.25]), 2)
    expected = torch.zeros(BIN_COUNT, dtype=torch.int64)
    expected[0] += 1
    expected[math.floor(1.5 * 2048)] += 1
    expected[4095] += 1
    expected[math.floor(0.5 * 2048)] += 1
    assert torch.equal(counts, expected)


def test_the_shift_by_one_is_rounded_to_fp32_before_binning() -> None:
    # fp32(±2⁻³⁰ + 1) is exactly 1, so both land in bin 2048; exact arithmetic would send the
    # negative one to bin 2047.
    tiny = 2.0**-30
    counts = histogram(torch.tensor([1.0, -tiny, 1.0, tiny]), 2)
    assert counts[2048] == 2
    assert counts[2047] == 0


def test_all_zero_blocks_add_nothing() -> None:
    x = torch.zeros(4, 8)
    x[2] = torch.linspace(-2.0, 3.0, 8)
    counts = histogram(x, 8)
    assert int(counts.sum()) == 8
    assert torch.equal(histogram(torch.zeros(64), 8), torch.zeros(BIN_COUNT, dtype=torch.int64))
    assert torch.equal(histogram(torch.zeros(0), 1), torch.zeros(BIN_COUNT, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("period", [1, 7, 64])
def test_matches_the_element_by_element_reference(dtype: torch.dtype, period: int) -> None:
    generator = torch.Generator().manual_seed(period)
    x = (torch.randn(7 * 64, generator=generator) * 5).to(dtype)
    x[:period] = 0  # one all-zero block
    assert histogram(x, period).tolist() == reference_histogram(x, period)


def test_every_non_zero_block_hits_an_endpoint_bin() -> None:
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(2))
    for row in x:
        counts = histogram(row, 16)
        assert counts[0] + counts[4095] >= 1


def test_counts_are_independent_of_chunking_and_order(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(96, 32, generator=torch.Generator().manual_seed(4))
    whole = histogram(x, 32)
    assert torch.equal(whole, histogram(x[:40], 32) + histogram(x[40:], 32))
    permuted = x[torch.randperm(96, generator=torch.Generator().manual_seed(5))]
    assert torch.equal(whole, histogram(permuted, 32))
    monkeypatch.setattr(binning, "_ELEMENTS_PER_SLICE", 100)
    assert torch.equal(whole, histogram(x, 32))


def test_logical_order_defines_the_blocks() -> None:
    base = torch.randn(16, 24, generator=torch.Generator().manual_seed(6))
    transposed = base.t()
    assert torch.equal(histogram(transposed, 16), histogram(transposed.contiguous(), 16))
    assert not torch.equal(histogram(transposed, 16), histogram(base, 16))


def test_input_is_not_modified() -> None:
    x = torch.randn(8, 8)
    before = x.clone()
    version = x._version
    histogram(x, 8)
    assert torch.equal(x, before)
    assert x._version == version


@pytest.mark.parametrize("period", [0, -1, 3, 2.0, True])
def test_invalid_period_is_rejected(period: object) -> None:
    with pytest.raises(ValueError, match="period"):
        histogram(torch.zeros(8), period)  # type: ignore[arg-type]


def test_bin_centres_are_exact() -> None:
    centres = bin_centres()
    assert centres.dtype == torch.float64
    assert centres[0].item() == -1 + 1 / 4096
    assert centres[2048].item() == 1 / 4096
    assert centres[4095].item() == 1 - 1 / 4096
