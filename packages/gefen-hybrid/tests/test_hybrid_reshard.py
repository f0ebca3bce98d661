"""GefenMuonHybrid under FSDP2: ``dcp.save`` at world 2, ``dcp.load`` into a freshly built hybrid
at worlds 1, 2, 3 and 4, and from 4 to 2 (docs/hybrid.md §8), on Gloo with real ``fully_shard``,
with each backup and the Muon child in each sharded mode. After the load the state, gathered,
equals the saved state bit for bit and training continues on every rank; at world 2
bit-identically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gefen.core.testing import gathered_optimizer_state, nested_equal
from gefen.dist.testing import gloo_required, run_scenarios

pytestmark = [pytest.mark.multirank, gloo_required()]

VOCAB, WIDTH, HIDDEN = 16, 8, 12
CASES = [
    ("gefen", "exact"),
    ("gefen", "approx"),
    ("gefen", "distributed"),
    ("adamw", "exact"),
    ("adamw", "approx"),
    ("adamw", "distributed"),
]


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.lm_head(self.norm(x + self.down(torch.tanh(self.up(x)))))


def _build(world: int, backend: str, mode: str) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gefen.hybrid import GefenMuonHybrid

    torch.manual_seed(0)
    model = _LM()
    mesh = init_device_mesh("cpu", (world,))
    for module in (model.embed, model.up, model.down, model.norm, model.lm_head, model):
        fully_shard(module, mesh=mesh)
    hybrid = GefenMuonHybrid(
        model, backup_optimizer=backend, lr=0.01, ns_steps=1, fused=False, sharded_mode=mode
    )
    return model, hybrid


def _train(model: Any, hybrid: Any, rank: int, steps: range) -> None:
    for step in steps:
        tokens = torch.randint(
            VOCAB, (6,), generator=torch.Generator().manual_seed(10 * step + rank)
        )
        hybrid.zero_grad()
        model(tokens).square().mean().backward()
        hybrid.step()


def _state(model: Any, hybrid: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, hybrid)}


def _full_params(model: Any) -> list[torch.Tensor]:
    return [param.full_tensor().detach().clone() for param in model.parameters()]


def scenario_save(rank: int, world_size: int, folder: str, backend: str, mode: str) -> int:
    import torch.distributed.checkpoint as dcp

    model, hybrid = _build(world_size, backend, mode)
    _train(model, hybrid, rank, range(3))
    expected = gathered_optimizer_state(model, hybrid)
    name = f"{backend}-{mode}"
    dcp.save(_state(model, hybrid), checkpoint_id=str(Path(folder) / name))
    _train(model, hybrid, rank, range(3, 5))
    continued = _full_params(model)
    if rank == 0:
        torch.save({"expected": expected, "continued": continued}, Path(folder) / f"{name}.pt")
    return 0


def scenario_resume(
    rank: int, world_size: int, folder: str, backend: str, mode: str
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    name = f"{backend}-{mode}"
    model, hybrid = _build(world_size, backend, mode)
    state = _state(model, hybrid)
    dcp.load(state, checkpoint_id=str(Path(folder) / name))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, hybrid, state["optim"])
    saved = torch.load(Path(folder) / f"{name}.pt", weights_only=True)
    state_equal = nested_equal(
        gathered_optimizer_state(model, hybrid)["state"], saved["expected"]["state"]
    )
    _train(model, hybrid, rank, range(3, 5))
    after = _full_params(model)
    return {
        "state_equal": state_equal,
        "finite": all(bool(p.isfinite().all()) for p in after),
        "bitwise": all(torch.equal(x, y) for x, y in zip(after, saved["continued"], strict=True)),
    }


def _resumes(folder: str, saved_world: int, worlds: tuple[int, ...]) -> dict[int, Any]:
    saves = [(f"{b}-{m}", scenario_save, (folder, b, m)) for b, m in CASES]
    outcomes: dict[int, Any] = {0: run_scenarios(saves, saved_world, rank_deadline_s=300.0)}
    for world in worlds:
        resumes = [(f"{b}-{m}", scenario_resume, (folder, b, m)) for b, m in CASES]
        outcomes[world] = run_scenarios(resumes, world, rank_deadline_s=300.0)
    return outcomes


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return _resumes(str(tmp_path_factory.mktemp("hybrid2")), 2, (1, 2, 3, 4))


@pytest.fixture(scope="module")
def from_four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return _resumes(str(tmp_path_factory.mktemp("hybrid4")), 4, (2,))


@pytest.mark.parametrize("case", [f"{b}-{m}" for b, m in CASES])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_world_two_hybrid_checkpoint_resumes_at(world: int, case: str, resumed: Any) -> None:
    assert resumed[0][case] == [0, 0]
    for result in resumed[world][case]:
        assert result["state_equal"]
        assert result["finite"]
        if world == 2:
            assert result["bitwise"]


@pytest.mark.parametrize("case", [f"{b}-{m}" for b, m in CASES])
def test_a_world_four_hybrid_checkpoint_resumes_at_two(case: str, from_four: Any) -> None:
    assert from_four[0][case] == [0, 0, 0, 0]
    for result in from_four[2][case]:
        assert result["state_equal"]
        assert result["finite"]
