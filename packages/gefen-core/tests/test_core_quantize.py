"""Nearest and stochastic rounding to codebook indices, docs/core.md §6.3 (§12 #29, #55)."""

from __future__ import annotations

import bisect
import functools

import numpy as np
import pytest
import torch

from gefen.core.kernels import (
    nearest_index,
    solve_codebook,
    stochastic_index,
    stream_seed,
    uniform_draws,
)

MASK = (1 << 64) - 1


def splitmix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)


def reference_draw(global_step: int, param_index: int, k: int) -> float:
    seed = splitmix(splitmix(global_step) ^ param_index)
    return (splitmix((seed + 0x9E3779B97F4A7C15 * (k + 1)) % (1 << 64)) >> 40) / 2**24


def dyadic_codebook() -> torch.Tensor:
    """A padded codebook: every value and every midpoint is exact in fp32."""
    counts = torch.zeros(4096, dtype=torch.int64)
    counts[[0, 2048, 4095]] = 1
    return solve_codebook(counts)


@functools.cache
def learned_codebook() -> torch.Tensor:
    """An optimal-DP codebook from 400 scattered active bins (cheap to solve)."""
    generator = torch.Generator().manual_seed(9)
    counts = torch.zeros(4096, dtype=torch.int64)
    active = torch.randperm(4094, generator=generator)[:398] + 1
    counts[active] = torch.randint(1, 50, (398,), generator=generator)
    counts[[0, 4095]] = 7
    return solve_codebook(counts)


def reference_nearest(codebook: torch.Tensor, values: torch.Tensor) -> list[int]:
    """First index of the minimum fp32 distance over the whole codebook."""
    table = codebook.numpy()
    result = []
    for value in values.numpy():
        distances = np.abs(np.float32(value) - table)
        result.append(int(np.argmin(distances)))
    return result


# §12 #29
def test_halfway_goes_to_the_lower_index_and_codewords_map_to_themselves() -> None:
    codebook = dyadic_codebook()
    midpoints = (codebook[:-1].double() + codebook[1:].double()) / 2
    assert torch.equal(midpoints.float().double(), midpoints)  # exactly representable
    assert nearest_index(codebook, midpoints.float()).tolist() == list(range(255))
    assert nearest_index(codebook, codebook).tolist() == list(range(256))


def test_nearest_matches_a_full_scan() -> None:
    codebook = learned_codebook()
    values = torch.empty(5000).uniform_(-1.5, 1.5, generator=torch.Generator().manual_seed(1))
    got = nearest_index(codebook, values)
    assert got.dtype == torch.uint8
    assert got.tolist() == reference_nearest(codebook, values)


def test_nearest_keeps_the_shape_and_widens_other_dtypes() -> None:
    codebook = learned_codebook()
    values = torch.randn(6, 7, dtype=torch.float64).clamp(-1, 1)
    got = nearest_index(codebook, values)
    assert got.shape == (6, 7)
    assert torch.equal(got, nearest_index(codebook, values.float()))
    assert nearest_index(codebook, torch.tensor([-3.0, 3.0])).tolist() == [0, 255]


def test_the_hash_matches_the_specified_arithmetic() -> None:
    for global_step, param_index in [(0, 0), (1, 0), (0, 1), (123456, 789), (2**40 + 3, 2**33)]:
        draws = uniform_draws((global_step, param_index), 300)
        assert draws.dtype == torch.float32
        expected = [reference_draw(global_step, param_index, k) for k in range(300)]
        assert draws.tolist() == expected
    assert stream_seed((5, 6)) == splitmix(splitmix(5) ^ 6)


def reference_stochastic(
    codebook: torch.Tensor, values: torch.Tensor, seed: tuple[int, int]
) -> list[int]:
    table = codebook.tolist()
    result = []
    for k, value in enumerate(values.tolist()):
        above = bisect.bisect_left(table, value)
        lower, upper = min(max(above - 1, 0), 255), min(max(above, 0), 255)
        if lower == upper:
            result.append(lower)
            continue
        offset = np.float32(value) - np.float32(table[lower])
        p_up = offset / (np.float32(table[upper]) - np.float32(table[lower]))
        result.append(upper if reference_draw(*seed, k) < p_up else lower)
    return result


def test_stochastic_matches_a_per_element_reference() -> None:
    codebook = learned_codebook()
    values = torch.empty(3000).uniform_(-1.2, 1.2, generator=torch.Generator().manual_seed(2))
    seed = (17, 4)
    got = stochastic_index(codebook, values, seed=seed)
    assert got.dtype == torch.uint8
    assert got.tolist() == reference_stochastic(codebook, values, seed)


# §12 #55 at kernel level
def test_stochastic_replays_per_seed_and_element() -> None:
    codebook = learned_codebook()
    values = torch.empty(4000).uniform_(-1, 1, generator=torch.Generator().manual_seed(3))
    first = stochastic_index(codebook, values, seed=(7, 2))
    assert torch.equal(first, stochastic_index(codebook, values, seed=(7, 2)))
    # Draw k depends only on (global_step, param_index, k): a prefix replays the same codes.
    assert torch.equal(first[:1000], stochastic_index(codebook, values[:1000], seed=(7, 2)))
    assert torch.equal(
        first.reshape(40, 100), stochastic_index(codebook, values.reshape(40, 100), seed=(7, 2))
    )
    assert not torch.equal(first, stochastic_index(codebook, values, seed=(7, 3)))
    assert not torch.equal(first, stochastic_index(codebook, values, seed=(8, 2)))


def test_stochastic_picks_a_neighbour_and_is_unbiased() -> None:
    codebook = dyadic_codebook()
    low, high = codebook[40].item(), codebook[41].item()
    target = low + 0.3 * (high - low)
    values = torch.full((100_000,), target)
    decoded = []
    for global_step in range(4):
        codes = stochastic_index(codebook, values, seed=(global_step, 0))
        assert set(codes.tolist()) == {40, 41}
        decoded.append(codebook[codes.long()].double())
    mean = torch.cat(decoded).mean().item()
    sigma = (high - low) * (0.3 * 0.7 / 400_000) ** 0.5
    assert abs(mean - target) < 5 * sigma


def test_stochastic_keeps_exact_codewords_and_endpoints() -> None:
    codebook = learned_codebook()
    for seed in [(0, 0), (3, 9)]:
        assert stochastic_index(codebook, codebook, seed=seed).tolist() == list(range(256))
        assert stochastic_index(codebook, torch.tensor([-2.0, 2.0]), seed=seed).tolist() == [0, 255]


@pytest.mark.parametrize("seed", [(-1, 0), (0, -2), (True, 0), (1.0, 0), (2**64, 0)])
def test_stochastic_rejects_malformed_seeds(seed: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="seed"):
        stochastic_index(learned_codebook(), torch.zeros(3), seed=seed)


def test_quantizers_do_not_modify_their_inputs() -> None:
    codebook = learned_codebook()
    values = torch.randn(64)
    saved = (codebook.clone(), values.clone(), codebook._version, values._version)
    nearest_index(codebook, values)
    stochastic_index(codebook, values, seed=(1, 1))
    assert torch.equal(codebook, saved[0])
    assert torch.equal(values, saved[1])
    assert (codebook._version, values._version) == saved[2:]


def test_codebook_must_be_fp32_1d_and_at_most_256_long() -> None:
    with pytest.raises(ValueError, match="float32"):
        nearest_index(learned_codebook().double(), torch.zeros(2))
    with pytest.raises(ValueError, match="at most 256"):
        nearest_index(torch.linspace(-1, 1, 257), torch.zeros(2))
