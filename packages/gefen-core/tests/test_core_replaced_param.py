"""A parameter object replaced inside ``param_groups[i]["params"]`` after training started is
handled as torch handles it: the new tensor starts from fresh state at its next step, the other
parameters step exactly as if nothing happened, and nothing is left half-created on the way."""

from __future__ import annotations

import re

import pytest
import torch

from gefen.core import Gefen


def _pair(fused: bool | None) -> tuple[Gefen, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(16))]
    return Gefen(params, lr=1e-2, fused=fused), params


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


@pytest.mark.parametrize("fused", [False, None])
def test_a_replaced_parameter_starts_fresh_and_the_others_are_undisturbed(fused) -> None:
    optimizer, params = _pair(fused)
    twin, twin_params = _pair(fused)
    for seed in range(2):
        _grads(params, seed)
        _grads(twin_params, seed)
        optimizer.step()
        twin.step()
    replacement = torch.nn.Parameter(torch.randn(8, 4))
    optimizer.param_groups[0]["params"][0] = replacement
    live = [replacement, params[1]]
    for seed in range(2, 5):
        _grads(live, seed)
        _grads(twin_params, seed)
        before = replacement.detach().clone()
        optimizer.step()
        twin.step()
        assert not torch.equal(before, replacement)  # the new parameter trains
        assert torch.equal(params[1], twin_params[1])  # bit-identical to the untouched twin
    entry = optimizer.state[replacement]
    assert entry["step"] == 3
    assert entry["period"] > 0
    assert optimizer.global_step == twin.global_step == 5
    restored, _ = _pair(fused)
    twin_replacement = torch.nn.Parameter(replacement.detach().clone())
    restored.param_groups[0]["params"][0] = twin_replacement
    restored.load_state_dict(optimizer.state_dict())  # the checkpoint round-trips
    assert torch.equal(restored.state[twin_replacement]["momentum_codes"], entry["momentum_codes"])


def test_a_rejected_step_leaves_no_entry_for_the_replaced_parameter() -> None:
    optimizer, params = _pair(False)
    _grads(params, 0)
    optimizer.step()
    replacement = torch.nn.Parameter(torch.randn(8, 4))
    optimizer.param_groups[0]["params"][0] = replacement
    _grads([replacement, params[1]], 1)
    params[1].grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite gradient"):
        optimizer.step()
    assert replacement not in optimizer.state


def test_a_replaced_parameter_before_any_step_saves_a_loadable_placeholder() -> None:
    # state_dict() used to emit {} for it (a defaultdict read), which no load accepted.
    first, second = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(8))
    optimizer = Gefen([first, second], lr=0.05)
    replacement = torch.nn.Parameter(torch.randn(8))
    optimizer.param_groups[0]["params"][1] = replacement
    saved = optimizer.state_dict()
    entry = saved["state"][1]  # format 2: the placeholder saved complete, all zeros, step 0
    assert entry["period"] == 0
    assert entry["step"] == 0
    assert all(not bool(v.any()) for v in entry.values() if isinstance(v, torch.Tensor))
    assert replacement not in optimizer.state  # saving created no entry
    optimizer.load_state_dict(saved)
    first.grad, replacement.grad = torch.randn(4, 4), torch.randn(8)
    optimizer.step()
    assert optimizer.state[replacement]["step"] == 1


CHANGES = [
    ("block, transposed", (16, 24), (24, 16), {"factored_v_2d": False}),
    ("block, flattened", (16, 24), (384,), {"factored_v_2d": False}),
    ("factored, vector to matrix", (24,), (4, 6), {}),
]


@pytest.mark.parametrize(("label", "old", "new", "options"), CHANGES, ids=[c[0] for c in CHANGES])
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("call", ["step", "state_dict"])
def test_a_parameter_given_another_shape_of_the_same_size_is_refused_by_name(
    label: str, old: tuple[int, ...], new: tuple[int, ...], options: dict, steps: int, call: str
) -> None:
    """``p.data = x`` of another shape but the same element count, after the state exists: the
    block family stepped on the old shape's blocks unnoticed (and a vector turned matrix was
    migrated with a warning blaming ``factored_v_2d``). docs/core.md §7.2 refuses a shape
    change: by name, at the next step or save, nothing changed; the old shape trains again.
    (A transposed factored matrix was refused already, by its row statistics' length: that
    message stays, since the entry's own tensors tell it.)"""
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import assert_unchanged, deep_snapshot

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(old))
    optimizer = Gefen([param], lr=1e-2, **options)
    for _ in range(steps):
        param.grad = torch.randn(old)
        optimizer.step()
    kept = param.data
    param.data = torch.randn(new)
    param.grad = torch.randn(new)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(RuntimeError, match=rf"parameter param_groups\[0\]\[0\]: state does not "
                       rf"match parameter \(the parameter's shape changed from "
                       rf"{re.escape(str(old))} to {re.escape(str(new))}\)"):  # fmt: skip
        getattr(optimizer, call)()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    param.data, param.grad = kept, torch.randn(old)
    optimizer.step()
    assert optimizer.global_step == steps + 1


def test_a_shape_change_before_the_first_update_lays_the_state_out_for_the_new_shape() -> None:
    """A pristine entry has no layout yet: a parameter resized before its first step is no
    shape change of its state."""
    param = torch.nn.Parameter(torch.randn(16, 24))
    optimizer = Gefen([param], lr=1e-2, factored_v_2d=False)
    optimizer.step()  # no gradient: checked, still pristine
    param.data = torch.randn(24, 16)
    param.grad = torch.randn(24, 16)
    optimizer.step()
    assert optimizer.state[param]["period"] == 16  # one block per row of the new shape
