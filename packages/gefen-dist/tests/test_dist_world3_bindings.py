"""Bindings on a real 3-rank Gloo world (docs/dist.md §7, §12): the WORLD binding validates,
a rotated member order or a too-small identity fails on every rank, a sub-group binding votes
over non-contiguous global ranks, and a destroyed world is reported as uninitialised."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from gefen.contracts import ProcessGroupIdentity
from gefen.dist import (
    PHASE_INITIALIZE_PREAMBLE,
    CheckpointProcessGroupBinding,
    CodebookProcessGroupBinding,
    GuardedOperation,
)
from gefen.dist.testing import ScenarioWorld, gloo_only, gloo_required, run_scenarios

pytestmark = [gloo_required(), gloo_only(), pytest.mark.multirank]

MEMBERS = ("rank:0", "rank:1", "rank:2")


def outcome(fn: Any) -> dict[str, Any]:
    begin = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:
        return {
            "error": str(exc),
            "type": type(exc).__name__,
            "elapsed": time.perf_counter() - begin,
        }
    return {"error": None, "value": value, "elapsed": time.perf_counter() - begin}


def validate(
    identity: ProcessGroupIdentity, member: str, kind: Any = CodebookProcessGroupBinding
) -> dict[str, Any]:
    return outcome(lambda: kind(identity, member, dist.group.WORLD, "cpu").validate_runtime())


def scenario_world_bindings(rank: int, world_size: int) -> dict[str, Any]:
    natural = f"rank:{rank}"
    rotated = ProcessGroupIdentity("world", ("rank:1", "rank:2", "rank:0"))
    pair = ProcessGroupIdentity("pair", ("rank:0", "rank:1"))
    return {
        "world": validate(ProcessGroupIdentity("world", MEMBERS), natural),
        "world_checkpoint": validate(
            ProcessGroupIdentity("world", MEMBERS), natural, CheckpointProcessGroupBinding
        ),
        "rotated": validate(rotated, natural),
        "too_small": validate(pair, natural if rank < 2 else "rank:0"),
    }


def scenario_subgroup(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.new_group([0, 2])  # every rank takes part in creating it
    identity = ProcessGroupIdentity("ends", ("rank:0", "rank:2"))
    if rank == 1:
        # Outside the group, new_group hands back a sentinel, not a ProcessGroup.
        return {
            "construct": outcome(
                lambda: CodebookProcessGroupBinding(identity, "rank:0", group, "cpu")
            )
        }
    binding = CodebookProcessGroupBinding(identity, f"rank:{rank}", group, "cpu")
    operation = GuardedOperation("Gefen", binding_getter=lambda: binding)

    def preamble() -> None:
        if rank == 2:
            raise RuntimeError("layout changed")

    return {
        "gather": operation.gather([rank]),
        "preamble": outcome(lambda: operation.local(PHASE_INITIALIZE_PREAMBLE, preamble)),
    }


def scenario_destroyed(rank: int, world_size: int) -> dict[str, Any]:
    binding = CodebookProcessGroupBinding(
        ProcessGroupIdentity("world", MEMBERS), f"rank:{rank}", dist.group.WORLD, "cpu"
    )
    dist.barrier()
    dist.destroy_process_group()
    return outcome(binding.validate_runtime)


SCENARIOS = [
    ("world_bindings", scenario_world_bindings, ()),
    ("subgroup", scenario_subgroup, ()),
    ("destroyed", scenario_destroyed, ()),  # last: it ends the process group
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 3, rank_deadline_s=240.0, pg_timeout_s=30.0)


def test_world_binding_validates_on_three_ranks(world: ScenarioWorld) -> None:
    for result in world["world_bindings"]:
        assert result["world"]["error"] is None
        assert result["world_checkpoint"]["error"] is None


def test_rotated_member_order_fails_on_every_rank(world: ScenarioWorld) -> None:
    for result in world["world_bindings"]:
        assert result["rotated"]["type"] == "BindingError"
        assert (
            "runtime group order does not match ordered semantic members"
            in result["rotated"]["error"]
        )


def test_a_two_member_identity_on_three_ranks_fails_on_world_size(world: ScenarioWorld) -> None:
    for result in world["world_bindings"]:
        assert result["too_small"]["type"] == "BindingError"
        assert "world size" in result["too_small"]["error"]


def test_a_subgroup_binding_votes_over_its_members(world: ScenarioWorld) -> None:
    zero, one, two = world["subgroup"]
    assert one["construct"]["type"] == "TypeError"
    assert zero["gather"] == two["gather"] == ((0,), (2,))
    assert two["preamble"]["error"] == (
        "Gefen initialize preamble failed on local rank 2: layout changed"
    )
    assert zero["preamble"]["error"] == (
        "Gefen initialize preamble failed on another process-group member"
    )


def test_a_destroyed_world_is_not_initialized(world: ScenarioWorld) -> None:
    for result in world["destroyed"]:
        assert result["type"] == "RuntimeError"
        assert "requires initialized torch.distributed" in result["error"]
