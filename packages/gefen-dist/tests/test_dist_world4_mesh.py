"""A 2x2 CPU mesh on 4 Gloo ranks (docs/dist.md §4, §6, §12): mesh-dimension order, content
dedup of a fresh 2-D mesh, one cross-rank order for two meshes of equal shape, and a one-rank
failure or found_inf difference reaching all four ranks through the two dimensions' votes."""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from gefen.dist import (
    PHASE_STEP_PREFLIGHT,
    GuardedOperation,
    collect_failure_scope,
    mesh_key,
    prepare_synchronized_amp_step,
    synchronize_step_error,
)
from gefen.dist.testing import ScenarioWorld, gloo_only, gloo_required, run_scenarios

pytestmark = [gloo_required(), gloo_only(), pytest.mark.multirank]

FAIL_FAST_S = 10.0
FULL_KEY = ("cpu", (2, 2), (0, 1, 2, 3))


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


def forbid_cuda() -> Any:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CPU mesh must never query torch.cuda")

    return mock.patch.multiple(
        torch.cuda,
        is_available=forbidden,
        current_device=forbidden,
        device_count=forbidden,
        is_current_stream_capturing=forbidden,
    )


def mesh_of(layout: torch.Tensor) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", layout)


def parameter_on(mesh: Any) -> torch.nn.Parameter:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = torch.full((2, 3), float(dist.get_rank()))
    placements = [Shard(0), Replicate()]
    param = torch.nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False))
    param.grad = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
    return param


def describe(scope: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    return [
        (c.mesh_key, c.mesh_dim, tuple(dist.get_process_group_ranks(c.process_group)))
        for c in scope
    ]


def scenario_scope_order(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    fresh = mesh_of(torch.arange(4).reshape(2, 2))
    transposed = mesh_of(torch.arange(4).reshape(2, 2).t().contiguous())
    first, again, other = parameter_on(mesh), parameter_on(fresh), parameter_on(transposed)
    # Parameter order differs between ranks; the sorted content keys must not.
    mixed = [first, other] if rank % 2 == 0 else [other, first]
    with forbid_cuda():
        one = collect_failure_scope([{"params": [first]}])
        dedup = collect_failure_scope([{"params": [again]}, {"params": [first]}])
        two = collect_failure_scope([{"params": mixed}])
        voted = outcome(lambda: synchronize_step_error(None, PHASE_STEP_PREFLIGHT, two, "Gefen"))
    return {
        "one": describe(one),
        "dedup": describe(dedup),
        "dedup_first_seen": dedup[0].process_group.group_name,
        # DTensor may hand an equal-content parameter an earlier mesh object (its sharding
        # cache compares meshes by content), so "first seen" is the first parameter's mesh.
        "first_parameter_group": again.device_mesh.get_group(0).group_name,
        "two": describe(two),
        "voted": voted,
        "keys": (mesh_key(mesh), mesh_key(fresh), mesh_key(transposed)),
    }


def scenario_one_rank_failure(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    scope = collect_failure_scope([{"params": [parameter_on(init_device_mesh("cpu", (2, 2)))]}])
    operation = GuardedOperation("GefenMuon", scope=scope)

    def closure() -> None:
        if rank == 3:
            raise RuntimeError("rank-three closure failure")

    with forbid_cuda():
        return outcome(lambda: operation.local(PHASE_STEP_PREFLIGHT, closure))


class Holder:
    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param_groups = [{"params": [param]}]


def scenario_one_rank_found_inf(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    holder = Holder(parameter_on(init_device_mesh("cpu", (2, 2))))
    holder.found_inf = torch.tensor([1.0 if rank == 3 else 0.0])  # type: ignore[attr-defined]
    holder.grad_scale = None  # type: ignore[attr-defined]
    scope = collect_failure_scope(holder.param_groups)
    with forbid_cuda():
        disagreement = outcome(lambda: prepare_synchronized_amp_step(holder, scope, "Gefen"))
    holder.found_inf = torch.tensor([1.0])  # type: ignore[attr-defined]
    with forbid_cuda():
        everyone = outcome(lambda: prepare_synchronized_amp_step(holder, scope, "Gefen"))
    return {"disagreement": disagreement, "everyone": everyone}


SCENARIOS = [
    ("scope_order", scenario_scope_order, ()),
    ("one_rank_failure", scenario_one_rank_failure, ()),
    ("one_rank_found_inf", scenario_one_rank_found_inf, ()),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 4, rank_deadline_s=240.0, pg_timeout_s=30.0)


def _dimension_groups(rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """On [[0, 1], [2, 3]]: dimension 0 joins a column, dimension 1 a row."""
    column = (rank % 2, rank % 2 + 2)
    row = (rank // 2 * 2, rank // 2 * 2 + 1)
    return column, row


def test_a_2d_mesh_gives_its_groups_in_dimension_order(world: ScenarioWorld) -> None:
    for rank, result in enumerate(world["scope_order"]):
        column, row = _dimension_groups(rank)
        assert result["one"] == [(FULL_KEY, 0, column), (FULL_KEY, 1, row)]
        assert result["keys"][0] == result["keys"][1] == FULL_KEY


def test_a_fresh_equal_2d_mesh_dedups(world: ScenarioWorld) -> None:
    for result in world["scope_order"]:
        assert result["dedup"] == result["one"]
        assert result["dedup_first_seen"] == result["first_parameter_group"]


def test_two_meshes_of_equal_shape_sort_the_same_on_every_rank(world: ScenarioWorld) -> None:
    results = world["scope_order"]
    orders = [[(key, dim) for key, dim, _ in result["two"]] for result in results]
    transposed_key = ("cpu", (2, 2), (0, 2, 1, 3))
    assert all(order == orders[0] for order in orders)
    assert orders[0] == [(FULL_KEY, 0), (FULL_KEY, 1), (transposed_key, 0), (transposed_key, 1)]
    for result in results:
        assert result["voted"]["error"] is None
        assert result["voted"]["elapsed"] < FAIL_FAST_S


def test_a_one_rank_failure_reaches_all_four_ranks(world: ScenarioWorld) -> None:
    results = world["one_rank_failure"]
    assert results[3]["error"] == (
        "GefenMuon step preflight failed on local rank 3: rank-three closure failure"
    )
    for result in results[:3]:
        assert result["error"] == "GefenMuon step preflight failed on another process-group member"
    for result in results:
        assert result["elapsed"] < FAIL_FAST_S


def test_a_one_rank_found_inf_difference_raises_on_all_four(world: ScenarioWorld) -> None:
    for result in world["one_rank_found_inf"]:
        assert result["disagreement"]["type"] == "GroupAgreementError"
        assert result["disagreement"]["error"].startswith(
            "Gefen AMP found_inf differs across process-group members"
        )
        assert result["everyone"] == {**result["everyone"], "error": None, "value": False}
