"""A ``torch.compile``d training step trains exactly like the eager one (issue: compile-safe).

The "compiling the optimizer" recipe wraps ``optimizer.step()`` in a compiled function. Dynamo
would drop the step's writes to Python attributes (global step, codebook) inside its frame, so
every Gefen optimizer runs its step outside the user's graph; these tests pin that the compiled
loop then produces bit-identical parameters and state to the eager loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.core import Gefen
from gefen.hybrid import GefenMuonHybrid
from gefen.muon import GefenMuon


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _gefen(model: torch.nn.Module) -> Any:
    return Gefen(model.parameters(), lr=1e-2, weight_decay=0.1, fused=False)


def _muon(model: torch.nn.Module) -> Any:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    return GefenMuon(matrices, lr=2e-2, fused=False)


def _hybrid(model: torch.nn.Module) -> Any:
    return GefenMuonHybrid(list(model.named_parameters()), lr=2e-2, fused=False)


def _train(build: Callable[[torch.nn.Module], Any], compiled: bool) -> list[torch.Tensor]:
    torch._dynamo.reset()
    model = _model()
    optimizer = build(model)
    step = torch.compile(optimizer.step) if compiled else optimizer.step
    generator = torch.Generator().manual_seed(1)
    history = []
    for _ in range(4):
        x = torch.randn(8, 16, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        step()
        moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
        assert any(moved), "the step did not move any parameter"
        history.extend(p.detach().clone() for p in model.parameters())
    counter = optimizer.muon if isinstance(optimizer, GefenMuonHybrid) else optimizer
    assert counter.global_step == 4
    return history


@pytest.mark.parametrize("build", [_gefen, _muon, _hybrid], ids=["gefen", "muon", "hybrid"])
def test_compiled_step_trains_exactly_like_eager(build: Callable[[torch.nn.Module], Any]) -> None:
    eager = _train(build, compiled=False)
    compiled = _train(build, compiled=True)
    for expected, got in zip(eager, compiled, strict=True):
        assert torch.equal(expected, got)


@pytest.mark.parametrize("build", [_gefen, _hybrid], ids=["gefen", "hybrid"])
def test_a_state_dict_taken_in_a_compiled_function_loads(
    build: Callable[[torch.nn.Module], Any],
) -> None:
    # Traced, the groups held Dynamo's capturable=True, which the optimizer's own load then
    # refused; torch's state_dict and load_state_dict run outside the graph, and so do ours.
    import copy

    torch._dynamo.reset()
    model = _model()
    optimizer = build(model)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    optimizer.step()
    saved = copy.deepcopy(torch.compile(lambda: optimizer.state_dict())())
    assert all(group.get("capturable") is None for group in saved["param_groups"])
    twin = build(_model())
    torch.compile(lambda: twin.load_state_dict(saved))()

    def plain(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:  # plain options
        return [{k: v for k, v in g.items() if isinstance(v, (int, float, str))} for g in groups]

    assert plain(twin.state_dict()["param_groups"]) == plain(saved["param_groups"])


def test_a_compiled_function_writing_an_option_is_refused_with_the_cause() -> None:
    # Dynamo adds capturable=True to the groups a compiled function writes; the refusal sent
    # the user after a key they never set.
    torch._dynamo.reset()
    model = _model()
    optimizer = _gefen(model)

    @torch.compile
    def warm_up_and_step(scale: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * scale
        optimizer.step()

    model(torch.randn(4, 16)).pow(2).mean().backward()
    with pytest.raises(ValueError, match="set options outside the compiled function"):
        warm_up_and_step(0.5)
