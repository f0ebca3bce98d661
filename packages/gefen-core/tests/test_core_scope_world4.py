"""Two disjoint codebook scopes in one 4-rank Gloo world (docs/dist.md §9, §12, a MAY item).

Ranks 0 and 1 form scope ``"dp0"`` (members ``("rank:0", "rank:1")``, handle
``dist.new_group([0, 1])``), ranks 2 and 3 scope ``"dp1"`` (``("rank:2", "rank:3")``,
``dist.new_group([2, 3])``). Scope dp0 holds a REPLICATED parameter, scope dp1 a parameter
flattened into two 24-element shards; each learns from its own gradients. Each scope must agree
internally, equal its own one-process oracle and differ from the other's, and a failure voted in
one scope must never reach the other.

One spawned world; scenario functions are module-level and return plain data only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.core.testing import finalized_snapshot as _snapshot
from gefen.core.testing import oracle_codebook as _oracle
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed

pytestmark = [pytest.mark.multirank, gloo_required()]

DEADLINE_S = 10.0
SHAPE = (8, 6)
SCOPES = {
    0: ("dp0", ("rank:0", "rank:1"), "replicated", 0),
    1: ("dp1", ("rank:2", "rank:3"), "flat", 5),
}
NAN = "parameter 'w' has a non-finite gradient (NaN or Inf)"


def _grad(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _slice(layout: str, coordinate: int, full: torch.Tensor) -> torch.Tensor:
    if layout == "flat":
        return full.reshape(-1)[24 * coordinate : 24 * coordinate + 24].clone()
    return full.clone()


_GROUPS: list[Any] = []


def _groups() -> list[Any]:
    """Both scopes' handles; every rank creates both, in the same order."""
    import torch.distributed as dist

    if not _GROUPS:
        _GROUPS.extend([dist.new_group([0, 1]), dist.new_group([2, 3])])
    return _GROUPS


class Member:
    """This rank's finalized Gefen in its scope."""

    def __init__(self, rank: int) -> None:
        from gefen.contracts import (
            LogicalSlice,
            ParameterIdentity,
            ParameterLayout,
            PlacementKind,
            ProcessGroupIdentity,
            ShardIdentity,
            ShardingManifest,
            ShardPlacement,
        )
        from gefen.core import Gefen, ParameterRebinding
        from gefen.dist import CodebookProcessGroupBinding

        self.scope = rank // 2
        self.coordinate = rank % 2
        name, members, layout, self.seed = SCOPES[self.scope]
        self.layout = layout
        identity = ProcessGroupIdentity(name, members)
        if layout == "flat":
            kinds = (ParameterLayout.FLATTENED_ELEMENT_SHARD, PlacementKind.FLAT_SHARD)
            extents = [LogicalSlice(0, 24), LogicalSlice(24, 24)]
        else:
            kinds = (ParameterLayout.REPLICATED, PlacementKind.REPLICATE)
            extents = [LogicalSlice(0, 48), LogicalSlice(0, 48)]
        shards = [
            ShardIdentity(
                ParameterIdentity("w", SHAPE),
                kinds[0],
                extents[c],
                (ShardPlacement(name, kinds[1], c, 2),),
                identity,
                members[c],
            )
            for c in range(2)
        ]
        torch.manual_seed(0)
        full = torch.randn(SHAPE)
        original = torch.nn.Parameter(full.clone())
        self.opt = Gefen([original], lr=0.01)
        self.target = torch.nn.Parameter(_slice(layout, self.coordinate, full))
        handle = _groups()[self.scope]
        binding = CodebookProcessGroupBinding(identity, members[self.coordinate], handle, "cpu")
        self.opt.post_sharding(
            [ParameterRebinding(original, self.target, shards[self.coordinate])],
            manifest=ShardingManifest(tuple(shards)),
            codebook_process_group=binding,
        )

    def set_grad(self, seed: int | None = None) -> None:
        full = _grad(self.seed if seed is None else seed)
        self.target.grad = _slice(self.layout, self.coordinate, full)


def scenario_isolated(rank: int, world_size: int) -> dict[str, Any]:
    """A NaN gradient on rank 0 fails initialize in dp0 only; dp1 learns meanwhile."""
    from gefen.dist.testing import snapshot_diff

    member = Member(rank)
    member.set_grad()
    if rank == 0:
        assert member.target.grad is not None
        member.target.grad[0, 0] = float("nan")
    before = _snapshot(member.opt)
    elapsed, error, learned = timed(member.opt.initialize_codebook)
    changes = snapshot_diff(before, _snapshot(member.opt))
    member.set_grad()
    retry = member.opt.initialize_codebook()  # dp0 retries; dp1 already holds its codebook
    codebook = member.opt.codebook
    step_before = member.opt.global_step
    member.set_grad(90 + member.scope)
    member.opt.step()
    return {
        "elapsed": elapsed,
        "error": error,
        "learned": learned,
        "changes": changes,
        "retry": retry,
        "codebook": None if codebook is None else codebook.tolist(),
        "step_before": step_before,
        "global_step": member.opt.global_step,
        "scope_size": len(member.opt.step_failure_scope()),
    }


SCENARIOS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("isolated", scenario_isolated, ()),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 4, rank_deadline_s=600.0, pg_timeout_s=30.0)


def test_two_disjoint_scopes_learn_isolated_codebooks_and_isolate_failures(
    world: ScenarioWorld,
) -> None:
    results = world["isolated"]
    replicated = _oracle([_grad(SCOPES[0][3])])  # coordinate 0 only
    flat = _grad(SCOPES[1][3]).reshape(-1)
    flattened = _oracle([flat[:24], flat[24:]])
    assert replicated != flattened
    for rank, result in enumerate(results):
        assert result["scope_size"] == 1
        assert result["step_before"] == 0
        assert result["global_step"] == 1
        assert result["elapsed"] < DEADLINE_S
        assert result["codebook"] == (replicated if rank < 2 else flattened), f"rank {rank}"
    # dp0 fails together and changes nothing, then its retry learns; dp1 never sees it.
    assert results[0]["error"] == (
        f"DistributedStepError: Gefen initialize preamble failed on local rank 0: {NAN}"
    )
    assert results[1]["error"] == (
        "DistributedStepError: Gefen initialize preamble failed on another process-group member"
    )
    for result in results[:2]:
        assert result["changes"] == []
        assert result["retry"] is True
    for result in results[2:]:
        assert result["error"] is None
        assert result["learned"] is True
        assert result["retry"] is False  # a codebook is present: nothing to learn
