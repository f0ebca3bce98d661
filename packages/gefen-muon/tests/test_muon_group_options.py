"""GefenMuon's per-group ``momentum_codec``, ``stochastic_round``, ``fused``, ``check_finite``
and ``deterministic`` (torch.optim's convention: every option may be overridden in a group)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from gefen.core import NonFiniteGradientError
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot
from gefen.muon import GefenMuon


def _matrices(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(12, 8, generator=generator)) for _ in range(2)]


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _mixed(params: list[torch.nn.Parameter], **second: Any) -> GefenMuon:
    groups = [{"params": [params[0]]}, {"params": [params[1]], **second}]
    return GefenMuon(groups, lr=0.02, fused=False)


def test_a_plain_momentum_group_beside_a_codebook8_group() -> None:
    """The "none" group steps as a GefenMuon(momentum_codec="none") over it alone; the codebook8
    group as a GefenMuon over it alone (the codebook is learned from its gradients only)."""
    params = _matrices()
    mixed = _mixed(params, momentum_codec="none")
    coded_param, plain_param = _clone(params)
    coded = GefenMuon([coded_param], lr=0.02, fused=False)
    plain = GefenMuon([plain_param], lr=0.02, fused=False, momentum_codec="none")
    for step in range(3):
        _grads(params, step)
        coded_param.grad = params[0].grad.clone()
        plain_param.grad = params[1].grad.clone()
        for optimizer in (mixed, coded, plain):
            optimizer.step()
    assert "momentum_codes" in mixed.state[params[0]]
    assert "momentum_buffer" in mixed.state[params[1]]
    assert torch.equal(params[0], coded_param)
    assert torch.equal(params[1], plain_param)
    assert mixed.codebook is not None
    assert coded.codebook is not None
    assert torch.equal(mixed.codebook, coded.codebook)
    twin_params = _clone(params)
    twin = _mixed(twin_params, momentum_codec="none")
    twin.load_state_dict(copy.deepcopy(mixed.state_dict()))
    _grads(params, 9)
    _grads(twin_params, 9)
    mixed.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))


def test_a_group_codec_cannot_change_once_its_state_exists() -> None:
    params = _matrices()
    optimizer = _mixed(params)
    _grads(params, 0)
    optimizer.step()
    optimizer.param_groups[1]["momentum_codec"] = "none"
    _grads(params, 1)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(RuntimeError, match=re.escape("a group's codec cannot change")):
        optimizer.step()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    optimizer.param_groups[1]["momentum_codec"] = "codebook8"
    optimizer.step()
    assert optimizer.global_step == 2


def test_stochastic_rounding_and_check_finite_are_group_options() -> None:
    params = _matrices()
    stochastic = _mixed(params, stochastic_round=True, check_finite=False)
    twin_params = _clone(params)
    nearest = _mixed(twin_params, check_finite=False)
    for step in range(3):
        _grads(params, step)
        _grads(twin_params, step)
        stochastic.step()
        nearest.step()
    assert torch.equal(params[0], twin_params[0])
    assert not torch.equal(params[1], twin_params[1])
    _grads(params, 5)
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=re.escape("param_groups[0][0]")):
        stochastic.step()
    _grads(params, 6)
    params[1].grad[0, 0] = float("nan")
    stochastic.step()  # that group does not check: its NaN is the caller's, as check_finite=False


def test_fused_is_selected_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group with ``fused=False`` runs the eager momentum beside a fused group."""
    import gefen.core.fused as fused_module
    from gefen.core.extension import eager_advance_momentum_

    calls: list[tuple[int, ...]] = []

    def counting(device_type: str, codebook_size: int = 256) -> Any:
        def advance(grad_blocks: torch.Tensor, *args: Any) -> Any:
            calls.append(tuple(grad_blocks.shape))
            return eager_advance_momentum_(grad_blocks, *args)

        return advance

    monkeypatch.setattr(fused_module, "fused_momentum", counting)
    first = torch.nn.Parameter(torch.randn(12, 8))
    second = torch.nn.Parameter(torch.randn(6, 16))
    optimizer = GefenMuon([{"params": [first]}, {"params": [second], "fused": False}], fused=True)
    for step in range(2):
        _grads([first, second], step)
        optimizer.step()
    counts = {optimizer.state[p]["momentum_codes"].shape for p in (first, second)}
    assert len(calls) == 2
    assert len(counts) == 2
    assert set(calls) == {tuple(optimizer.state[first]["momentum_codes"].shape)}
