"""The read-only phase 4 and the streamed commit (docs/muon.md §6 phases 4–5, docs/core.md §7.1).

Phase 4 (``_prepare_step``) reads: it writes no state and its plan holds no tensor but the
parameters themselves. Phase 5 (``_commit_step``) updates one matrix at a time in place: an
initialized entry keeps its tensor objects and their storage, the parameter keeps its storage,
and the memory a step allocates is bounded by one matrix's working set, never by the model.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gefen.muon.optimizer as optimizer_module
import gefen.muon.plan as plan_module
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot
from gefen.muon import GefenMuon


def _p(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    )


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    for index, p in enumerate(params):
        generator = torch.Generator().manual_seed(seed + index)
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from a plan unit (dataclasses, tuples, lists), but not through
    a param group (a mapping: the optimizer's own, not staged)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


class _Plans:
    """Spy on ``_prepare_step``: records each plan and checks that phase 4 wrote nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plans: list[Any] = []
        original = GefenMuon._prepare_step

        def spy(optimizer: GefenMuon, operation: Any, learning: Any) -> Any:
            before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
            plan = original(optimizer, operation, learning)
            assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
            self.plans.append(plan)
            return plan

        monkeypatch.setattr(GefenMuon, "_prepare_step", spy)


@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("normuon", [False, True], ids=["muon", "normuon"])
def test_phase4_plan_holds_only_the_parameters(
    monkeypatch: pytest.MonkeyPatch, codec: str, normuon: bool
) -> None:
    params = [_p(16, 24), _p(24, 16, seed=1), _p(1, 8, seed=2)]
    optimizer = GefenMuon(
        params, lr=torch.tensor(0.02), momentum_codec=codec, normuon=normuon, ns_steps=1
    )
    spy = _Plans(monkeypatch)
    for step in range(2):  # the first step (new entries) and a later one
        _grads(params, 10 * step)
        optimizer.step()
    assert len(spy.plans) == 2
    for plan in spy.plans:
        assert len(plan) == len(params)  # one unit per matrix, in parameter order
        assert [unit.param for unit in plan] == params
        for unit in plan:
            assert all(any(t is p for p in params) for t in _tensors(unit))


class _Allocations(TorchDispatchMode):
    """Tracks the bytes of new storage the dispatched ops allocate and still hold (views and
    in-place results share an input's storage and are not counted); ``peak`` is the most
    held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs or storage.nbytes() == 0:
                continue
            nbytes = storage.nbytes()
            self.largest = max(self.largest, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, nbytes)
        return out


@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_phase4_allocates_nothing_proportional_to_the_model(
    monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    params = [_p(32, 32, seed=index) for index in range(4)]
    optimizer = GefenMuon(params, lr=torch.tensor(0.02), momentum_codec=codec, ns_steps=1)
    _grads(params, 0)
    optimizer.step()
    allocations = _Allocations()
    original = GefenMuon._prepare_step

    def watched(self: GefenMuon, operation: Any, learning: Any) -> Any:
        with allocations:
            return original(self, operation, learning)

    monkeypatch.setattr(GefenMuon, "_prepare_step", watched)
    _grads(params, 1)
    optimizer.step()
    assert allocations.largest < 32 * 32  # not even one matrix's bytes (scalars only)


def _commit_allocations(
    monkeypatch: pytest.MonkeyPatch, codec: str, count: int, shape: tuple[int, int]
) -> _Allocations:
    params = [_p(*shape, seed=index) for index in range(count)]
    optimizer = GefenMuon(params, momentum_codec=codec, ns_steps=2, normuon=True)
    _grads(params, 0)
    optimizer.step()  # entries exist; the next step only updates them
    allocations = _Allocations()
    original = GefenMuon._commit_step

    def watched(self: GefenMuon, plan: Any) -> None:
        with allocations:
            original(self, plan)

    with monkeypatch.context() as patch:
        patch.setattr(GefenMuon, "_commit_step", watched)
        _grads(params, 1)
        optimizer.step()
    return allocations


@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_commit_memory_is_bounded_by_one_matrix(
    monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """A staged step would hold every matrix's new state and value at once; the streamed
    commit holds one matrix's working set, whatever the number of matrices."""
    shape = (48, 64)
    one = _commit_allocations(monkeypatch, codec, 1, shape)
    twelve = _commit_allocations(monkeypatch, codec, 12, shape)
    assert one.peak > 0
    assert twelve.peak <= 1.25 * one.peak, (twelve.peak, one.peak)
    matrix_fp32 = shape[0] * shape[1] * 4
    assert twelve.live <= matrix_fp32  # nothing model-sized outlives the commit


@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("normuon", [False, True], ids=["muon", "normuon"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_commit_updates_entries_and_parameters_in_their_own_storage(
    codec: str, normuon: bool, dtype: torch.dtype
) -> None:
    params = [_p(16, 24, dtype=dtype), _p(24, 16, seed=1, dtype=dtype)]
    optimizer = GefenMuon(params, lr=0.02, momentum_codec=codec, normuon=normuon, ns_steps=1)
    _grads(params, 0)
    optimizer.step()
    entries = [optimizer.state[p] for p in params]
    tensors = [{k: v for k, v in e.items() if isinstance(v, torch.Tensor)} for e in entries]
    pointers = [{k: v.data_ptr() for k, v in t.items()} for t in tensors]
    values = [{k: v.clone() for k, v in t.items()} for t in tensors]
    param_pointers = [p.data_ptr() for p in params]
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    optimizer.step()
    for index, p in enumerate(params):
        entry = optimizer.state[p]
        assert entry is entries[index]
        assert entry["step"] == 2
        assert {k for k, v in entry.items() if isinstance(v, torch.Tensor)} == set(tensors[index])
        for key, tensor in tensors[index].items():
            assert entry[key] is tensor, key
            assert entry[key].data_ptr() == pointers[index][key], key
        moved = "momentum_codes" if codec == "codebook8" else "momentum_buffer"
        assert not torch.equal(entry[moved], values[index][moved])
        assert p.data_ptr() == param_pointers[index]
        assert not torch.equal(p.detach(), before[index])


def test_new_entry_is_allocated_just_before_its_first_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entries are created one at a time inside the commit: when the second matrix's update
    starts, the first is fully written and the second is still the placeholder."""
    a, b = _p(16, 24), _p(24, 16, seed=1)
    optimizer = GefenMuon([a, b], ns_steps=1)
    seen: list[tuple[bool, bool, float]] = []
    original = optimizer_module.orthogonal_update_

    def spy(entry: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(
            ("step" in optimizer.state[a], "step" in optimizer.state[b], float(a.detach()[0, 0]))
        )
        return original(entry, *args, **kwargs)

    monkeypatch.setattr(optimizer_module, "orthogonal_update_", spy)
    initial = float(a.detach()[0, 0])
    _grads([a, b], 0)
    optimizer.step()
    assert seen[0][:2] == (True, False)  # a allocated ...
    assert seen[0][2] == initial  # ... not yet written
    assert seen[1][:2] == (True, True)
    assert seen[1][2] != initial  # a written before b starts
    assert optimizer.state[b]["step"] == 1


def test_tensor_lr_is_read_once_per_group_with_work(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = _p(8, 4), _p(4, 8, seed=1), _p(6, 6, seed=2)
    optimizer = GefenMuon(
        [{"params": [a, b], "lr": torch.tensor(0.02)}, {"params": [c], "lr": torch.tensor(0.01)}]
    )
    reads: list[torch.Tensor] = []
    original = plan_module.lr_value

    def counting(lr: Any) -> float:
        reads.append(lr)
        return original(lr)

    monkeypatch.setattr(plan_module, "lr_value", counting)
    _grads([a, b], 0)
    optimizer.step()  # group 1 has no gradient: its lr is never read
    assert len(reads) == 1
    assert reads[0] is optimizer.param_groups[0]["lr"]
