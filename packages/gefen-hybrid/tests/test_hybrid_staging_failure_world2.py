"""A failure on one rank after the step's votes, while it stages (phase 4), on a 2-rank Gloo
world with FSDP2 (docs/step.md, docs/dist.md §4).

Phase 4 runs after the vote, so a failure there on one rank is that rank's alone: it used to
raise and leave it as it was, unlatched, while its peer committed the step, and the next step
then succeeded on both ranks one step apart (silent divergence). Now, across ranks, the failing
rank latches: the next step fails on every rank (its vote) until each loads a checkpoint, and
then they train together again.

Gefen's FSDP2 commit and GefenMuon's approx mode exchange nothing between ranks, so the peer
commits and returns. (Where the commit itself gathers, GefenMuon's exact and distributed modes,
the peer waits in the commit's collectives: the limit docs/dist.md §4 states.)
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed

pytestmark = [pytest.mark.multirank, gloo_required()]

DEADLINE_S = 30.0  # the liveness bound asserted for each failing operation
FAULT = "simulated out of memory while staging"


def _sharded_model() -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _build(kind: str, model: Any) -> Any:
    if kind == "gefen":
        from gefen.core import Gefen

        return Gefen(model.parameters(), lr=0.01)
    from gefen.hybrid import GefenMuonHybrid

    return GefenMuonHybrid(model, lr=0.01, ns_steps=1, fused=False, sharded_mode="approx")


def _backward(model: Any, rank: int, seed: int) -> None:
    for param in model.parameters():
        param.grad = None
    batch = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed * 10 + rank))
    model(batch).square().mean().backward()


def _first_shell(optimizer: Any) -> Any:
    """The optimizer whose phase 4 fails: Gefen itself, or the hybrid's Muon child."""
    return optimizer.children[0] if hasattr(optimizer, "children") else optimizer


def _local_values(model: Any) -> list[torch.Tensor]:
    return [param.to_local().detach().clone() for param in model.parameters()]


def scenario_one_rank_staging_failure(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    model = _sharded_model()
    optimizer = _build(kind, model)
    for seed in range(2):
        _backward(model, rank, seed)
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    weights = _local_values(model)
    shell_class = type(_first_shell(optimizer))
    real = shell_class._prepare_step

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise MemoryError(FAULT)

    _backward(model, rank, 2)
    if rank == 0:
        shell_class._prepare_step = failing
    try:
        faulted_s, faulted, _ = timed(optimizer.step)
    finally:
        shell_class._prepare_step = real
    latched = optimizer.latched
    _backward(model, rank, 3)
    next_s, next_error, _ = timed(optimizer.step)
    with torch.no_grad():
        for param, value in zip(model.parameters(), weights, strict=True):
            param.to_local().copy_(value)
    optimizer.load_state_dict(saved)
    _backward(model, rank, 2)
    optimizer.step()
    resumed = [value.tolist() for value in _local_values(model)]
    return {
        "faulted": faulted,
        "faulted_s": faulted_s,
        "latched": latched,
        "next": next_error,
        "next_s": next_s,
        "latched_after_load": optimizer.latched,
        "resumed": resumed,
    }


def scenario_uninterrupted(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """The same run without the fault: three steps, the third on the resumed step's batch."""
    model = _sharded_model()
    optimizer = _build(kind, model)
    for seed in range(3):
        _backward(model, rank, seed)
        optimizer.step()
    return {"values": [value.tolist() for value in _local_values(model)]}


KINDS = ("gefen", "hybrid")
SCENARIOS = [
    *((f"fault_{kind}", scenario_one_rank_staging_failure, (kind,)) for kind in KINDS),
    *((f"control_{kind}", scenario_uninterrupted, (kind,)) for kind in KINDS),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rank_deadline_s=400.0, pg_timeout_s=60.0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_staging_failure_on_one_rank_fails_the_next_step_everywhere_until_a_load(
    world: ScenarioWorld, kind: str
) -> None:
    owner = "Gefen" if kind == "gefen" else "GefenMuonHybrid"
    failing, peer = world[f"fault_{kind}"]
    assert failing["faulted"] == f"MemoryError: {FAULT}"
    assert peer["faulted"] is None  # the peer committed the step: the failure was unvoted
    assert failing["latched"] is True
    assert peer["latched"] is False
    assert failing["next"].startswith(f"DistributedStepError: {owner} step preflight failed on")
    assert "a distributed step failed on this rank after its vote" in failing["next"]
    assert peer["next"] == (
        f"DistributedStepError: {owner} step preflight failed on another process-group member"
    )
    controls = world[f"control_{kind}"]
    for result, control in zip((failing, peer), controls, strict=True):
        assert result["faulted_s"] < DEADLINE_S
        assert result["next_s"] < DEADLINE_S
        assert result["latched_after_load"] is False
        assert result["resumed"] == control["values"]  # the load put both ranks back together
