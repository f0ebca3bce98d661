"""Period selection, docs/core.md §4 (edge cases §12 #12-#16)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gefen.core.kernels import (
    candidate_divisors,
    decide_period,
    fallback,
    period_errors,
    select_period,
)

PINNED_FALLBACKS = [
    ((4,), 1),
    ((7,), 1),
    ((13,), 13),
    ((22,), 22),
    ((4096,), 2048),
    ((2**20,), 2048),
    ((100, 64), 1600),
    ((3, 2048), 2048),
    ((1024, 1024), 2048),
    ((50257, 64), 1856),
    ((104729,), 104729),
    ((4106,), 2053),
]


def reference_errors(gradient: torch.Tensor, periods: list[int]) -> list[tuple[int, float]]:
    """err(p) from plain float64 numpy, one block at a time (two-pass variance)."""
    squares = gradient.reshape(-1).to(torch.float32).square().double().numpy()
    result = []
    for period in periods:
        variances = []
        for block in squares.reshape(-1, period):
            mean = sum(block.tolist()) / period
            variances.append(sum((value - mean) ** 2 for value in block.tolist()) / period)
        result.append((period, math.sqrt(sum(variances) / len(variances))))
    return result


def reference_decision(errors: list[tuple[int, float]]) -> int:
    weights = [(1e-12, errors[0][0])]
    weights += [(err - previous, p) for (_, previous), (p, err) in itertools.pairwise(errors)]
    chosen = min(weights)[1]
    return chosen if chosen >= 8 else 1


# §12 #12
def test_candidate_divisors_pinned() -> None:
    assert candidate_divisors(12) == [1, 2, 3, 4, 6]
    assert candidate_divisors(13) == [1]
    assert candidate_divisors(16) == [1, 2, 4, 8]
    assert candidate_divisors(1) == []


def test_candidate_divisors_match_trial_division() -> None:
    for n in range(1, 400):
        assert candidate_divisors(n) == [d for d in range(1, n) if n % d == 0]


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_candidate_divisors_reject_non_positive_ints(bad: object) -> None:
    with pytest.raises(ValueError):
        candidate_divisors(bad)  # type: ignore[arg-type]


# §12 #13
def test_decision_function_pinned_examples() -> None:
    assert decide_period([(1, 10), (8, 4), (16, 1), (32, 0.9)]) == 8
    assert decide_period([(1, 10), (2, 0.5), (4, 0.4)]) == 1


def test_decision_function_empty_list_raises() -> None:
    with pytest.raises(ValueError, match="at least one"):
        decide_period([])


def test_decision_function_ties_go_to_the_smaller_period() -> None:
    assert decide_period([(1, 0.0), (8, -1.0), (16, -2.0)]) == 8
    # The first candidate's weight is 1e-12, so an exact zero drop beats it.
    assert decide_period([(1, 0.0), (16, 0.0)]) == 16
    assert decide_period([(1, 0.0), (16, 1e-12)]) == 1


def test_decision_function_rejects_unsorted_periods() -> None:
    with pytest.raises(ValueError, match="ascending"):
        decide_period([(1, 0.0), (16, 1.0), (8, 0.5)])


# §12 #14
@pytest.mark.parametrize(("shape", "expected"), PINNED_FALLBACKS)
def test_fallback_pinned_values(shape: tuple[int, ...], expected: int) -> None:
    assert fallback(math.prod(shape), shape) == expected


def test_fallback_is_at_least_8_and_divides_n_on_a_sweep() -> None:
    for n in range(8, 6000):
        for shape in ((n,), (1, n), (n, 1)):
            period = fallback(n, shape)
            assert period >= 8
            assert n % period == 0
    assert all(fallback(n, (n,)) == 1 for n in range(8))


@settings(max_examples=150, deadline=None)
@given(
    dims=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=3),
    kind=st.sampled_from(["random", "zero", "constant", "one-hot", "row-scaled"]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_no_unforced_parameter_with_n_at_least_8_gets_period_one(
    dims: list[int], kind: str, seed: int
) -> None:
    shape = tuple(dims)
    n = math.prod(shape)
    generator = torch.Generator().manual_seed(seed)
    if kind == "random":
        g = torch.randn(shape, generator=generator)
    elif kind == "zero":
        g = torch.zeros(shape)
    elif kind == "constant":
        g = torch.full(shape, 0.5)
    elif kind == "one-hot":
        g = torch.zeros(n)
        g[seed % n] = 3.0
        g = g.reshape(shape)
    else:
        g = torch.randn(shape, generator=generator) * torch.arange(1, shape[-1] + 1)
    period = select_period(g, shape, force_one=False)
    assert period is not None
    assert n % period == 0
    if n >= 8:
        assert period >= 8
    else:
        assert period == 1


# §12 #15
def test_force_one_gives_period_one() -> None:
    g = torch.randn(64, 32)
    assert select_period(g, (64, 32), force_one=True) == 1
    assert select_period(g.reshape(-1), (2048,), force_one=True) == 1
    assert select_period(torch.zeros(4096), (4096,), force_one=True) == 1


def test_single_element_gets_one_and_empty_gets_no_period() -> None:
    assert select_period(torch.tensor([2.5]), (1,), force_one=False) == 1
    assert select_period(torch.zeros(1, 1), (1, 1), force_one=False) == 1
    assert select_period(torch.zeros(0), (0,), force_one=False) is None
    assert select_period(torch.zeros(0, 5), (0, 5), force_one=True) is None


# §12 #16
@pytest.mark.parametrize(("shape", "expected"), PINNED_FALLBACKS)
def test_all_zero_gradient_gets_the_fallback(shape: tuple[int, ...], expected: int) -> None:
    g = torch.zeros(shape, dtype=torch.bfloat16)
    assert select_period(g, shape, force_one=False) == expected


def test_period_errors_match_a_block_by_block_reference() -> None:
    generator = torch.Generator().manual_seed(1)
    g = torch.randn(360, generator=generator, dtype=torch.float64) * 3
    periods = candidate_divisors(360)
    squares = g.to(torch.float32).square()
    got = period_errors(squares, periods)
    expected = reference_errors(g, periods)
    assert [p for p, _ in got] == periods
    assert got[0][1] == 0.0
    np.testing.assert_allclose([e for _, e in got], [e for _, e in expected], rtol=1e-12)


@pytest.mark.parametrize(
    "shape", [(4096,), (100, 64), (360,), (1000,), (64, 48), (3, 2048), (12, 10, 6)]
)
@pytest.mark.parametrize("scaled", [False, True])
def test_search_matches_the_reference_pipeline(shape: tuple[int, ...], scaled: bool) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(shape, generator=generator)
    if scaled:
        g = g * torch.linspace(0.1, 10.0, shape[-1])
    n = math.prod(shape)
    searched = reference_decision(reference_errors(g, [d for d in range(1, n) if n % d == 0]))
    expected = fallback(n, shape) if searched == 1 else searched
    assert select_period(g, shape, force_one=False) == expected


def test_search_can_choose_a_period_other_than_the_fallback() -> None:
    g = torch.randn(100, 64, generator=torch.Generator().manual_seed(0))
    period = select_period(g, (100, 64), force_one=False)
    assert period is not None
    assert period != fallback(6400, (100, 64))
    assert period >= 8


def test_a_searched_period_below_8_becomes_the_fallback() -> None:
    # Constant squares: every err is 0, so w(2) = 0 beats w(1) = 1e-12 and 2 < 8 becomes 1.
    g = torch.ones(4096)
    assert decide_period(period_errors(g.square(), candidate_divisors(4096))) == 1
    assert select_period(g, (4096,), force_one=False) == 2048


def test_select_period_is_pure_and_checks_the_shape() -> None:
    g = torch.randn(64, 32, dtype=torch.float16)
    before = g.clone()
    version = g._version
    first = select_period(g, (64, 32), force_one=False)
    assert select_period(g, (64, 32), force_one=False) == first
    assert torch.equal(g, before)
    assert g._version == version
    with pytest.raises(ValueError, match="does not hold"):
        select_period(g, (64, 31), force_one=False)


def test_non_contiguous_gradient_is_read_in_logical_order() -> None:
    base = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    transposed = base.t()
    assert not transposed.is_contiguous()
    assert select_period(transposed, (64, 48), force_one=False) == select_period(
        transposed.contiguous(), (64, 48), force_one=False
    )
