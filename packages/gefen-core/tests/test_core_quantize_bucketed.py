"""The bucketed codeword count inside ``nearest_index`` / ``stochastic_index`` equals
``torch.searchsorted`` exactly (a faster twin of the eager reference, docs/core.md §6.3, §11)."""

from __future__ import annotations

import pytest
import torch

from gefen.core.kernels import nearest_index, solve_codebook, stochastic_index
from gefen.core.kernels import quantize as quantize_module


def _learned(seed: int, active: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4096, dtype=torch.int64)
    bins = torch.randperm(4094, generator=generator)[:active] + 1
    counts[bins] = torch.randint(1, 50, (active,), generator=generator)
    counts[[0, 4095]] = 3
    return solve_codebook(counts)


def _hard_values(codebook: torch.Tensor) -> torch.Tensor:
    """Codewords, their fp32 neighbours, midpoints, bucket edges ± one ulp, out-of-range."""
    lo, hi = float(codebook[0]), float(codebook[-1])
    width = (hi - lo) / quantize_module._BUCKETS
    edges = (lo + width * torch.arange(0, quantize_module._BUCKETS + 1).double()).float()
    midpoints = ((codebook[:-1].double() + codebook[1:].double()) / 2).float()
    parts = [codebook, midpoints, edges]
    for part in list(parts):
        parts.append(torch.nextafter(part, torch.full_like(part, 2.0)))
        parts.append(torch.nextafter(part, torch.full_like(part, -2.0)))
    generator = torch.Generator().manual_seed(3)
    parts.append(torch.empty(20_000).uniform_(-1.2, 1.2, generator=generator))
    parts.append(torch.tensor([-3.0e38, -1.0000001, 1.0000001, 3.0e38, 0.0, -0.0]))
    return torch.cat(parts)


@pytest.mark.parametrize("active", [6, 255, 2000])
def test_bucketed_count_equals_searchsorted(active: int) -> None:
    codebook = _learned(active, active)
    values = _hard_values(codebook)
    expected = torch.searchsorted(codebook, values, side="left")
    got = quantize_module._count_below_bucketed(codebook, values)
    assert got is not None
    assert torch.equal(got, expected)


def test_dense_codebook_clusters_fall_back_to_searchsorted() -> None:
    # 200 codewords squeezed into one bucket-width region: the comparison window would be huge.
    dense = torch.linspace(0.0, 1e-5, 200)
    codebook = torch.cat([torch.tensor([-1.0]), dense, torch.linspace(0.5, 1.0, 55)]).float()
    values = torch.empty(10_000).uniform_(-1, 1, generator=torch.Generator().manual_seed(4))
    assert quantize_module._count_below_bucketed(codebook, values) is None
    expected = torch.searchsorted(codebook, values, side="left")
    lower, upper = quantize_module._neighbours(codebook, values)
    assert torch.equal(upper, expected.clamp(0, 255))
    assert torch.equal(lower, (expected - 1).clamp(0, 255))


def test_non_finite_values_take_the_reference_path() -> None:
    codebook = _learned(1, 255)
    values = torch.empty(10_000).uniform_(-1, 1, generator=torch.Generator().manual_seed(5))
    values[[7, 99]] = torch.tensor([float("nan"), float("inf")])
    assert quantize_module._count_below_bucketed(codebook, values) is None
    expected = torch.searchsorted(codebook, values, side="left")
    _, upper = quantize_module._neighbours(codebook, values)
    assert torch.equal(upper, expected.clamp(0, 255))


def _reference_neighbours(codebook: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    above = torch.searchsorted(codebook, values, side="left")
    return (above - 1).clamp(0, 255), above.clamp(0, 255)


@pytest.mark.parametrize("active", [40, 2000])
def test_quantizers_agree_with_the_searchsorted_reference(
    active: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    codebook = _learned(active + 1, active)
    values = _hard_values(codebook).clamp(-1, 1)
    fast_nearest = nearest_index(codebook, values)
    fast_stochastic = stochastic_index(codebook, values, seed=(3, 1))
    # The reference run: no bucket table and no bucketed count, searchsorted only.
    monkeypatch.setattr(quantize_module, "_nearest_tabled", lambda codebook, values: None)
    monkeypatch.setattr(quantize_module, "_neighbours", _reference_neighbours)
    assert torch.equal(fast_nearest, nearest_index(codebook, values))
    assert torch.equal(fast_stochastic, stochastic_index(codebook, values, seed=(3, 1)))


def test_the_bucket_table_resolves_most_values_and_defers_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table path is taken (and is not the reference in disguise): values in unresolved
    buckets, and only those, reach the reference rule."""
    codebook = _learned(7, 2000)
    values = _hard_values(codebook).clamp(-1, 1)
    deferred: list[int] = []
    real = quantize_module._nearest_reference

    def counting(cb: torch.Tensor, subset: torch.Tensor) -> torch.Tensor:
        deferred.append(subset.numel())
        return real(cb, subset)

    monkeypatch.setattr(quantize_module, "_nearest_reference", counting)
    quantize_module._TABLE_CACHE.clear()
    quantize_module._nearest_table(codebook)  # building the table uses the reference
    deferred.clear()
    got = quantize_module._nearest_tabled(codebook, values)
    assert got is not None
    assert len(deferred) == 1
    assert 0 < deferred[0] < values.numel() // 10
    monkeypatch.setattr(quantize_module, "_nearest_reference", real)
    assert torch.equal(got, real(codebook, values))


class _EvictingTogether(dict):  # type: ignore[type-arg]
    """A full table cache whose iteration waits (up to 1 s) until two threads iterate it at
    once: the interleaving in which both choose the same oldest key to evict."""

    def __init__(self, entries: dict[object, object]) -> None:
        super().__init__(entries)
        import threading

        self.together = threading.Barrier(2)

    def __iter__(self):  # type: ignore[no-untyped-def]
        import contextlib
        import threading

        keys = list(super().__iter__())
        with contextlib.suppress(threading.BrokenBarrierError):  # serialized: nobody to meet
            self.together.wait(timeout=1.0)
        return iter(keys)


def test_two_threads_filling_a_full_table_cache_both_get_their_table(monkeypatch) -> None:
    # Optimizers stepping in two threads evicted the same oldest table; the second raised a
    # KeyError inside the commit, which latched its optimizer.
    import threading

    full = {("cpu", bytes([index])): (0.0, 1.0, torch.zeros(1)) for index in range(4)}
    cache = _EvictingTogether(full)
    monkeypatch.setattr(quantize_module, "_TABLE_CACHE", cache)
    codebooks = [_learned(seed, 40) for seed in (5, 6)]
    values = torch.linspace(-1.0, 1.0, 8192)
    outcomes: dict[int, object] = {}

    def fill(index: int) -> None:
        try:
            outcomes[index] = torch.equal(
                nearest_index(codebooks[index], values),
                quantize_module._nearest_reference(codebooks[index], values),
            )
        except Exception as error:
            outcomes[index] = error

    threads = [threading.Thread(target=fill, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert outcomes == {0: True, 1: True}
    assert len(cache) == 4
