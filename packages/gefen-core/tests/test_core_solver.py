"""Codebook learning, docs/core.md §5.2-§5.3 (edge cases §12 #18-#21)."""

from __future__ import annotations

import itertools
import random
import time
from fractions import Fraction

import pytest
import torch

from gefen.core.kernels import histogram, solve_codebook
from gefen.core.state import validate_codebook


def centre(j: int) -> float:
    return -1.0 + (2 * j + 1) / 4096


def counts_from(bins: list[int], weights: list[int]) -> torch.Tensor:
    counts = torch.zeros(4096, dtype=torch.int64)
    counts[torch.tensor(bins)] = torch.tensor(weights)
    return counts


def brute_force_codebook(bins: list[int], weights: list[int], k: int) -> list[float]:
    """The §5.3 DP with every split scanned upward and a strict '<', in Python floats."""
    n = len(bins)
    prefix_w, prefix_s, prefix_q = [0.0], [0.0], [0.0]
    for j, count in zip(bins, weights, strict=True):
        w = float(count)
        c = centre(j)
        prefix_w.append(prefix_w[-1] + w)
        prefix_s.append(prefix_s[-1] + w * c)
        prefix_q.append(prefix_q[-1] + (w * c) * c)

    def segment(s: int, e: int) -> tuple[float, float, float]:
        return (
            prefix_w[e] - prefix_w[s - 1],
            prefix_s[e] - prefix_s[s - 1],
            prefix_q[e] - prefix_q[s - 1],
        )

    def interior(s: int, e: int) -> float:
        w, a, q = segment(s, e)
        return q - a * a / w

    def first(e: int) -> float:
        w, a, q = segment(1, e)
        return q + 2.0 * a + w

    best = {e: first(e) for e in range(1, n - k + 2)}
    choices: list[dict[int, int]] = []
    for layer in range(2, k):
        layer_best: dict[int, float] = {}
        layer_choice: dict[int, int] = {}
        for e in range(layer, n - k + layer + 1):
            for s in range(layer, e + 1):
                value = best[s - 1] + interior(s, e)
                if e not in layer_best or value < layer_best[e]:
                    layer_best[e], layer_choice[e] = value, s
        best = layer_best
        choices.append(layer_choice)
    total, start = None, 0
    for s in range(k, n + 1):
        w, a, q = segment(s, n)
        value = best[s - 1] + (q - 2.0 * a + w)
        if total is None or value < total:
            total, start = value, s
    codebook = [-1.0] * k
    codebook[k - 1] = 1.0
    for layer in range(k - 1, 1, -1):
        end = start - 1
        start = choices[layer - 2][end]
        w, a, _ = segment(start, end)
        codebook[layer - 1] = a / w
    return codebook


def random_instance(rng: random.Random, k: int) -> tuple[list[int], list[int]]:
    """A <= 40 active bins; placement and counts mix runs of equal adjacent counts."""
    size = rng.randint(k, 40)
    if rng.random() < 0.5:
        first = rng.randrange(0, 4096 - size)
        bins = list(range(first, first + size))
    else:
        bins = sorted(rng.sample(range(4096), size))
    weights: list[int] = []
    while len(weights) < size:
        run = rng.randint(1, 8) if rng.random() < 0.6 else 1
        weights += [rng.randint(1, 9) if rng.random() < 0.7 else rng.randint(1, 10**6)] * run
    return bins, weights[:size]


# §12 #19
def test_fast_dp_equals_brute_force_bit_for_bit() -> None:
    rng = random.Random(20261130)
    instances = 0
    for repeat in range(30):
        for k in range(2, 13):
            bins, weights = random_instance(rng, k)
            if repeat == 0:
                weights = [3] * len(weights)  # exact ties everywhere
            expected = torch.tensor(brute_force_codebook(bins, weights, k), dtype=torch.float32)
            got = solve_codebook(counts_from(bins, weights), k)
            assert got.dtype == torch.float32
            assert got.numpy().tobytes() == expected.numpy().tobytes(), (k, bins, weights)
            instances += 1
    assert instances >= 300


def optimal_codebooks(bins: list[int], weights: list[int], k: int) -> list[list[float]]:
    """Every fp32 codebook of a contiguous split with the minimum §5.3 objective, found by
    enumerating all splits in exact rationals."""
    centres = [Fraction(2 * j + 1, 4096) - 1 for j in bins]
    scored: list[tuple[Fraction, list[float]]] = []
    for cuts in itertools.combinations(range(1, len(bins)), k - 1):
        bounds = (0, *cuts, len(bins))
        total = Fraction(0)
        representatives: list[float] = []
        for index, (s, e) in enumerate(itertools.pairwise(bounds)):
            members = list(zip(centres[s:e], weights[s:e], strict=True))
            if index == 0:
                target = Fraction(-1)
            elif index == k - 1:
                target = Fraction(1)
            else:
                target = sum((c * w for c, w in members), Fraction(0)) / sum(w for _, w in members)
            representatives.append(float(torch.tensor(float(target), dtype=torch.float32)))
            total += sum(w * (c - target) ** 2 for c, w in members)
        scored.append((total, representatives))
    best = min(total for total, _ in scored)
    return [codebook for total, codebook in scored if total == best]


def test_dp_reaches_the_exhaustive_optimum_on_small_instances() -> None:
    rng = random.Random(7)
    for _ in range(60):
        k = rng.randint(2, 4)
        size = rng.randint(k, 8)
        bins = sorted(rng.sample(range(0, 4096, 64), size))
        weights = [rng.choice([1, 2, 20]) for _ in range(size)]
        codebook = solve_codebook(counts_from(bins, weights), k).tolist()
        assert codebook in optimal_codebooks(bins, weights, k)


# §12 #18
def test_learned_codebook_is_256_strictly_increasing_fp32_with_exact_endpoints() -> None:
    gradient = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    counts = histogram(gradient, 64)
    assert int((counts > 0).sum()) >= 256
    codebook = solve_codebook(counts)
    assert codebook.dtype == torch.float32
    assert codebook.shape == (256,)
    assert bool((codebook[1:] > codebook[:-1]).all())
    assert codebook[0].item() == -1.0
    assert codebook[255].item() == 1.0
    validate_codebook(codebook)


# §12 #20 (performance is reported elsewhere; only the liveness bound is asserted)
def test_4096_active_bins_solve_within_the_liveness_bound() -> None:
    counts = torch.randint(1, 10**6, (4096,), generator=torch.Generator().manual_seed(1))
    started = time.perf_counter()
    codebook = solve_codebook(counts)
    assert time.perf_counter() - started < 5.0
    validate_codebook(codebook)


# §12 #21
def test_padding_path_keeps_the_interior_centre_and_pins_the_first_insertions() -> None:
    counts = counts_from([0, 2048, 4095], [5, 9, 2])
    codebook = solve_codebook(counts)
    validate_codebook(codebook)
    assert (codebook == 1 / 4096).any()
    insertions = [-0.4998779296875, 0.5001220703125, -0.74993896484375, -0.24981689453125]
    start = [-1.0, 1 / 4096, 1.0]
    for count in range(1, 5):
        got = solve_codebook(counts, 3 + count).tolist()
        assert got == sorted(start + insertions[:count])


def reference_padding(bins: list[int], k: int) -> list[float]:
    """§5.2 in exact rationals: bisect the widest gap, leftmost on ties."""
    values = sorted(
        {Fraction(-1), Fraction(1)} | {Fraction(2 * j + 1, 4096) - 1 for j in bins if 0 < j < 4095}
    )
    while len(values) < k:
        widths = [b - a for a, b in itertools.pairwise(values)]
        widest = widths.index(max(widths))
        values.insert(widest + 1, (values[widest] + values[widest + 1]) / 2)
    return [float(v) for v in values]


def test_padding_path_matches_an_exact_reference() -> None:
    rng = random.Random(11)
    for size in (1, 2, 3, 17, 100, 254, 255):
        bins = sorted(rng.sample(range(4096), size))
        if 0 not in bins and 4095 not in bins:
            bins[0] = 0  # a real histogram always has an endpoint bin (§5.1)
        codebook = solve_codebook(counts_from(bins, [1] * size))
        expected = torch.tensor(reference_padding(bins, 256), dtype=torch.float32)
        assert torch.equal(codebook, expected)
        validate_codebook(codebook)


def test_padding_path_rejects_more_fixed_values_than_codewords() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        solve_codebook(counts_from([100, 200], [1, 1]), 3)


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        solve_codebook(torch.zeros(4096, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        solve_codebook(torch.ones(4096, dtype=torch.int32))
    with pytest.raises(ValueError, match="int64"):
        solve_codebook(torch.ones(4095, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-negative"):
        solve_codebook(-torch.ones(4096, dtype=torch.int64))
    with pytest.raises(ValueError, match="k must be"):
        solve_codebook(torch.ones(4096, dtype=torch.int64), 1)


def test_counts_are_not_modified() -> None:
    counts = torch.randint(0, 3, (4096,), generator=torch.Generator().manual_seed(2))
    counts[torch.arange(4096) % 8 != 0] = 0  # about 340 active bins: the DP path, solved fast
    assert int((counts > 0).sum()) >= 256
    before = counts.clone()
    version = counts._version
    solve_codebook(counts)
    assert torch.equal(counts, before)
    assert counts._version == version
