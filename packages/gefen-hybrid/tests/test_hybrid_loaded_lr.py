"""A loaded group's tensor lr is its own (torch's load deep-copies the saved groups): it used to
be the caller's tensor, so loading one in-memory state dict into two optimizers, or forking a
run from ``state_dict()``, left them on one lr, and either one's scheduler rewrote the other's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from gefen.core import Gefen
from gefen.hybrid import GefenMuonHybrid
from gefen.muon import GefenMuon


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [param for param in model.parameters() if param.ndim == 2]


BUILDERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "gefen": lambda model: Gefen(model.parameters(), lr=torch.tensor(1e-2)),
    "muon": lambda model: GefenMuon(_matrices(model), lr=torch.tensor(1e-2)),
    "hybrid": lambda model: GefenMuonHybrid.from_model(model, lr=torch.tensor(1e-2)),
}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_loaded_tensor_lr_is_not_the_sources(kind: str) -> None:
    source_model, target_model = _model(), _model()
    source = BUILDERS[kind](source_model)
    schedule = StepLR(source, step_size=1, gamma=0.1)
    _train(source_model, source)
    target = BUILDERS[kind](target_model)
    target.load_state_dict(source.state_dict())
    for theirs, ours in zip(source.param_groups, target.param_groups, strict=True):
        assert isinstance(ours["lr"], torch.Tensor)
        assert ours["lr"] is not theirs["lr"]
        assert float(ours["lr"]) == float(theirs["lr"])
    schedule.step()  # the source's schedule moves on
    assert all(float(group["lr"]) == pytest.approx(1e-3) for group in source.param_groups)
    assert all(float(group["lr"]) == pytest.approx(1e-2) for group in target.param_groups)
    _train(target_model, target)  # and the loaded one trains
