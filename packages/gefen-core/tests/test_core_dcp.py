"""DCP get/set_optimizer_state_dict in one process (docs/core.md §8.5; §12 #47, #48, #59)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gefen.core import Gefen


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train(model, optimizer, seeds) -> None:
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(5, 8, generator=generator)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def test_fresh_optimizer_stays_pristine_under_get() -> None:
    model = _model()
    optimizer = Gefen(model.parameters(), weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    get_optimizer_state_dict(model, optimizer)
    assert optimizer.global_step == 0
    assert optimizer.codebook is None
    assert all(entry == {"period": 0} for entry in optimizer.state.values())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("options", [{}, {"momentum_codec": "none"}, {"stochastic_round": True}])
def test_get_set_round_trip_is_bit_exact(options: dict) -> None:
    model = _model()
    optimizer = Gefen(model.parameters(), lr=0.01, **options)
    _train(model, optimizer, range(3))
    osd = get_optimizer_state_dict(model, optimizer)
    twin_model = _model(1)
    twin_model.load_state_dict(model.state_dict())
    twin = Gefen(twin_model.parameters(), lr=0.01, **options)
    set_optimizer_state_dict(twin_model, twin, osd)
    assert twin.global_step == 3
    assert twin.state_dict()["gefen"]["initialized_params"] == [1, 1, 1, 1]
    _train(model, optimizer, range(10, 14))
    _train(twin_model, twin, range(10, 14))
    for ours, theirs in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_frozen_after_training_round_trip_keeps_live_entry_with_one_warning() -> None:
    model = _model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, range(2))
    model[2].bias.requires_grad_(False)
    osd = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_optimizer_state_dict(model, optimizer, osd)
    ours = [w for w in caught if "frozen parameter" in str(w.message)]
    assert len(ours) == 1
    assert optimizer.state[model[2].bias]["step"] == 2
    model[2].bias.requires_grad_(True)
    _train(model, optimizer, range(3))


def test_flattened_mode_fails_closed() -> None:
    model = _model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, range(2))
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    osd = get_optimizer_state_dict(model, optimizer, options=options)
    fresh_model = _model()
    fresh = Gefen(fresh_model.parameters(), lr=0.01)
    # §8.5: the flattened mode is not a supported transport; it must fail, never drop state.
    with pytest.raises(ValueError, match="Gefen checkpoint"):
        set_optimizer_state_dict(fresh_model, fresh, osd, options=options)
    assert fresh.global_step == 0
    assert fresh.codebook is None
