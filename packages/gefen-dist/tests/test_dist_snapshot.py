"""The deep snapshot detects every mutation a failed operation could leave behind
(docs/dist.md §11.2); the DTensor/no-collective case runs in test_dist_world2_transport."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.dist.testing import Snapshot, assert_unchanged, deep_snapshot, snapshot_diff
from gefen.dist.testing import snapshot as snapshot_module

ATTRIBUTES = ("codebook", "global_step", "cache")


class _Toy(torch.optim.Optimizer):
    """A stand-in optimizer carrying what Gefen's snapshots look at."""

    def __init__(self) -> None:
        weight = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
        bias = torch.nn.Parameter(torch.zeros(3))
        super().__init__([{"params": [weight], "lr": 0.1}, {"params": [bias], "lr": 0.01}], {})
        weight.grad = torch.ones_like(weight)
        self.state[weight] = {"momentum_codes": torch.zeros(4, dtype=torch.uint8), "period": 3}
        self.state[bias] = {"momentum_scale": torch.tensor([float("nan"), 1.0])}
        self.codebook = torch.linspace(-1, 1, 8)
        self.global_step = 5
        self.cache = {torch.device("cpu"): self.codebook.clone()}

    def step(self, closure: Any = None) -> None:
        raise NotImplementedError


def _snapshot(optimizer: Any) -> Snapshot:
    return deep_snapshot(optimizer, attributes=ATTRIBUTES)


def _changed(mutate: Callable[[_Toy], None]) -> list[str]:
    optimizer = _Toy()
    before = _snapshot(optimizer)
    mutate(optimizer)
    return snapshot_diff(before, _snapshot(optimizer))


def test_an_untouched_optimizer_is_unchanged_nan_included() -> None:
    optimizer = _Toy()
    before = _snapshot(optimizer)
    assert snapshot_diff(before, _snapshot(optimizer)) == []
    assert_unchanged(before, _snapshot(optimizer))


def _flip_one_bit(optimizer: _Toy) -> None:
    weight = optimizer.param_groups[0]["params"][0]
    with torch.no_grad():
        weight.view(-1).view(torch.int32)[5] ^= 1


def _replace_state_dict(optimizer: _Toy) -> None:
    weight = optimizer.param_groups[0]["params"][0]
    optimizer.state[weight] = dict(optimizer.state[weight])


def _add_state_key(optimizer: _Toy) -> None:
    optimizer.state[optimizer.param_groups[0]["params"][0]]["v_step"] = 1


def _clear_gradient(optimizer: _Toy) -> None:
    optimizer.param_groups[0]["params"][0].grad = None


def _replace_codebook(optimizer: _Toy) -> None:
    optimizer.codebook = optimizer.codebook.clone()


def _count_a_step(optimizer: _Toy) -> None:
    optimizer.global_step += 1


def _clear_cache(optimizer: _Toy) -> None:
    optimizer.cache.clear()


def _change_group_option(optimizer: _Toy) -> None:
    optimizer.param_groups[1]["lr"] = 0.02


def _restride_in_place(optimizer: _Toy) -> None:
    """The same bytes, another layout (a symmetric matrix transposed by its strides)."""
    optimizer.state[optimizer.param_groups[1]["params"][0]]["sym"].as_strided_((2, 2), (1, 2))


def _move_onto_a_foreign_buffer(optimizer: _Toy) -> None:
    """``set_`` onto another storage at an offset, holding equal bytes: it now aliases it."""
    scale = optimizer.state[optimizer.param_groups[1]["params"][0]]["momentum_scale"]
    foreign = torch.cat([torch.zeros(4), scale.detach().clone()])
    scale.set_(foreign.untyped_storage(), 4, (2,), (1,))


def _grow_a_set(optimizer: _Toy) -> None:
    optimizer.state[optimizer.param_groups[1]["params"][0]]["seen"].add(3)


def _poke_a_bytearray(optimizer: _Toy) -> None:
    optimizer.state[optimizer.param_groups[1]["params"][0]]["raw"][0] = 9


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_restride_in_place, "state[1][0]['sym']: values differ"),
        (_move_onto_a_foreign_buffer, "state[1][0]['momentum_scale']: values differ"),
    ],
)
def test_detects_a_layout_change_that_keeps_the_bytes(
    mutate: Callable[[_Toy], None], expected: str
) -> None:
    """Stride and storage offset are compared with the bytes: ``as_strided_`` or ``set_`` onto
    a foreign buffer changed what the tensor is (and aliases) and read as unchanged."""
    optimizer = _Toy()
    optimizer.state[optimizer.param_groups[1]["params"][0]]["sym"] = torch.eye(2)
    before = _snapshot(optimizer)
    mutate(optimizer)
    assert expected in snapshot_diff(before, _snapshot(optimizer))


@pytest.mark.parametrize(("mutate", "key"), [(_grow_a_set, "seen"), (_poke_a_bytearray, "raw")])
def test_detects_an_in_place_change_of_a_set_or_a_bytearray(
    mutate: Callable[[_Toy], None], key: str
) -> None:
    """Sets and byte arrays are compared by value (they were recorded as opaque objects by
    identity, so an in-place change read as none)."""
    optimizer = _Toy()
    entry = optimizer.state[optimizer.param_groups[1]["params"][0]]
    entry["seen"], entry["raw"] = {1, 2}, bytearray(b"ab")
    before = _snapshot(optimizer)
    mutate(optimizer)
    assert f"state[1][0][{key!r}]: values differ" in snapshot_diff(before, _snapshot(optimizer))
    assert snapshot_diff(_snapshot(optimizer), _snapshot(optimizer)) == []


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_flip_one_bit, "param_groups[0]['params'][0]: values differ"),
        (_clear_gradient, "param_groups[0]['params'][0].grad: identity differs"),
        (_add_state_key, "state[0][0]['v_step']: added"),
        (_replace_state_dict, "state[0][0]: identity differs"),
        (_replace_codebook, "codebook: identity differs"),
        (_count_a_step, "global_step: values differ"),
        (_clear_cache, "cache: values differ"),
        (_change_group_option, "param_groups[1]['lr']: values differ"),
    ],
)
def test_detects(mutate: Callable[[_Toy], None], expected: str) -> None:
    assert expected in _changed(mutate)


def test_detects_a_removed_cache_entry_with_equal_retained_tensors() -> None:
    optimizer = _Toy()
    optimizer.cache[torch.device("meta")] = optimizer.codebook.clone()
    before = _snapshot(optimizer)
    del optimizer.cache[torch.device("meta")]
    differences = snapshot_diff(before, _snapshot(optimizer))
    assert "cache: values differ" in differences
    assert "cache[device(type='meta')]: removed" in differences
    assert not any(line.startswith("cache[device(type='cpu')]") for line in differences)


def test_detects_a_replaced_cache_value_with_equal_content() -> None:
    optimizer = _Toy()
    before = _snapshot(optimizer)
    optimizer.cache[torch.device("cpu")] = optimizer.cache[torch.device("cpu")].clone()
    assert snapshot_diff(before, _snapshot(optimizer)) == [
        "cache[device(type='cpu')]: identity differs"
    ]


def test_a_replacement_reusing_a_freed_address_is_still_detected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    optimizer = _Toy()
    before = _snapshot(optimizer)
    original = weakref.ref(optimizer.codebook)
    optimizer.codebook = optimizer.codebook.clone()
    gc.collect()
    # The snapshot holds the original alive, so no new object can take its address...
    assert original() is not None
    # ...and identity is compared with ``is``: an ``id`` that always collides changes nothing.
    monkeypatch.setattr(snapshot_module, "id", lambda obj: 0, raising=False)
    assert "codebook: identity differs" in snapshot_diff(before, _snapshot(optimizer))


def test_attributes_absent_and_children() -> None:
    parent = _Toy()
    parent.child = _Toy()  # type: ignore[attr-defined]
    parent.missing = None  # type: ignore[attr-defined]
    children = {"child": ("global_step",), "missing": ()}
    before = deep_snapshot(parent, attributes=("not_there",), children=children)
    assert "not_there" in before.paths
    assert "missing" in before.paths
    parent.child.global_step = 6  # type: ignore[attr-defined]
    after = deep_snapshot(parent, attributes=("not_there",), children=children)
    assert snapshot_diff(before, after) == ["child.global_step: values differ"]
    parent.missing = _Toy()  # type: ignore[attr-defined]
    appeared = deep_snapshot(parent, attributes=("not_there",), children=children)
    assert "missing: identity differs" in snapshot_diff(after, appeared)


def test_snapshot_never_calls_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer = _Toy()

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("state_dict must not be called")

    monkeypatch.setattr(optimizer, "state_dict", forbidden)
    deep_snapshot(optimizer, attributes=ATTRIBUTES)


def test_assert_unchanged_lists_every_difference() -> None:
    optimizer = _Toy()
    before = _snapshot(optimizer)
    _count_a_step(optimizer)
    _clear_gradient(optimizer)
    with pytest.raises(AssertionError) as caught:
        assert_unchanged(before, _snapshot(optimizer))
    assert "global_step: values differ" in str(caught.value)
    assert "param_groups[0]['params'][0].grad" in str(caught.value)


def test_sum_int64_refuses_what_int64_would_change() -> None:
    """``sum_int64`` is exact: a fraction, a NaN, an infinity or a value past int64's range was
    truncated silently (``[1.7, -2.9]`` summed as ``[1, -2]``); integral floats still sum."""
    from gefen.dist import GuardedOperation

    operation = GuardedOperation("Toy", binding_getter=lambda: None)
    assert operation.sum_int64(torch.tensor([3.0, -4.0])).tolist() == [3, -4]
    assert operation.sum_int64(torch.tensor([5, 6])).tolist() == [5, 6]
    for bad in ([1.7, -2.9], [float("nan")], [float("inf")], [1e30]):
        with pytest.raises(ValueError, match="sum_int64 sums integers"):
            operation.sum_int64(torch.tensor(bad))


def test_sum_int64_refuses_a_uint64_count_past_int64() -> None:
    # 2**63 + 5 as uint64 became -9223372036854775803, summed silently.
    from gefen.dist import GuardedOperation

    operation = GuardedOperation("Toy", binding_getter=lambda: None)
    fits = torch.tensor([2**63 - 1, 3], dtype=torch.uint64)
    assert operation.sum_int64(fits).tolist() == [2**63 - 1, 3]
    with pytest.raises(ValueError, match="sum_int64 sums integers"):
        operation.sum_int64(torch.tensor([2**63 + 5, 3], dtype=torch.uint64))
