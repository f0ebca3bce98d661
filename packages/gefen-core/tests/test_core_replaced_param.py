"""A parameter object replaced inside ``param_groups[i]["params"]`` after training started is
handled as torch handles it: the new tensor starts from fresh state at its next step, the other
parameters step exactly as if nothing happened, and nothing is left half-created on the way."""

from __future__ import annotations

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
