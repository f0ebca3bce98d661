"""One 2-rank Gloo world (TCP rendezvous) for transports and real sharding: owner-state
broadcasts and record gathers, the rank-local checkpoint checks, a real ShardedGradScaler
over fully_shard, a one-rank DTensor snapshot, and the ban on object collectives
(docs/dist.md §1, §6, §10, §11.2, §12)."""

from __future__ import annotations

import contextlib
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import gefen.dist.transport
from gefen.contracts import ProcessGroupIdentity
from gefen.dist import (
    PHASE_LOAD_VALIDATION,
    PHASE_STEP_PREFLIGHT,
    CodebookProcessGroupBinding,
    GuardedOperation,
    all_gather_records,
    broadcast_owner_state,
    check_rank_local_header,
    check_rank_local_records,
    collect_failure_scope,
    prepare_synchronized_amp_step,
    rank_local_header,
    synchronize_step_error,
)
from gefen.dist.testing import (
    ScenarioWorld,
    deep_snapshot,
    gloo_only,
    gloo_required,
    mark,
    run_scenarios,
    snapshot_diff,
)

pytestmark = [gloo_required(), gloo_only(), pytest.mark.multirank]

FAIL_FAST_S = 10.0


# -- helpers used inside the ranks -----------------------------------------------------------------


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


def world_channel() -> Any:
    identity = ProcessGroupIdentity("world", ("rank:0", "rank:1"))
    binding = CodebookProcessGroupBinding(
        identity, f"rank:{dist.get_rank()}", dist.group.WORLD, "cpu"
    )
    binding.validate_runtime()
    return binding.channel


def cpu_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def mesh_scope() -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Shard

    local = torch.ones(2, 2)
    param = torch.nn.Parameter(DTensor.from_local(local, cpu_mesh(), [Shard(0)], run_check=False))
    return collect_failure_scope([{"params": [param]}])


def sample_entry() -> dict[str, Any]:
    """Every transportable kind; built identically on every rank to compare against."""
    return {
        "flag": torch.tensor([True, False, True]),
        "half": torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16),
        "index": torch.arange(6, dtype=torch.int64).reshape(3, 2) * 10**12,
        "empty": torch.zeros(2, 0, 3),
        "strided": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "step": 7,
        "name": "layer.weight",
        "nested": {"a": [1, 2.5, None, True]},
    }


def same_entry(received: dict[str, Any], expected: dict[str, Any]) -> bool:
    if list(received) != sorted(expected):
        return False
    for key, value in expected.items():
        got = received[key]
        if isinstance(value, torch.Tensor):
            if got.dtype != value.dtype or got.shape != value.shape or not torch.equal(got, value):
                return False
        elif got != value:
            return False
    return True


def flipping_bytes_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    """Corrupts one byte after the digest was computed (a transport defect)."""
    tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    tensor[len(payload) // 2] ^= 0x20
    return tensor


# -- scenarios -----------------------------------------------------------------------------------


def scenario_owner_round_trip(rank: int, world_size: int) -> dict[str, Any]:
    channel = world_channel()
    results: dict[str, Any] = {}
    for owner in (0, 1):
        mark(f"owner {owner} round trip")
        entry = sample_entry() if rank == owner else None
        moved = broadcast_owner_state(entry, owner=owner, channel=channel, owner_name="GefenMuon")
        if entry is not None:
            results[owner] = all(moved[key] is entry[key] for key in entry)
        else:
            results[owner] = same_entry(moved, sample_entry())
    return results


def scenario_owner_failures(rank: int, world_size: int) -> dict[str, Any]:
    channel = world_channel()

    def send(entry_on_owner: Any, entry_elsewhere: Any = None) -> dict[str, Any]:
        entry = entry_on_owner if rank == 0 else entry_elsewhere
        return outcome(
            lambda: broadcast_owner_state(entry, owner=0, channel=channel, owner_name="GefenMuon")
        )

    complex_entry = {"z": torch.zeros(2, dtype=torch.complex64), "ok": 1}
    results = {"complex": send(complex_entry)}
    results["receiver_entry"] = send({"ok": 1}, {"unexpected": 2})
    patch = (
        mock.patch.object(gefen.dist.transport, "_bytes_tensor", flipping_bytes_tensor)
        if rank == 0
        else contextlib.nullcontext()
    )
    with patch:
        results["corrupted"] = send(sample_entry())
    results["after"] = send({"ok": 2})
    return results


def scenario_records(rank: int, world_size: int) -> dict[str, Any]:
    channel = world_channel()
    record = {"rank": rank, "data": list(range(rank * 3)), "name": f"rank:{rank}"}
    results = {"round_trip": all_gather_records(record, channel=channel, owner_name="GefenMuon")}
    bad = {"nan": float("nan")} if rank == 0 else record
    results["preparation"] = outcome(
        lambda: all_gather_records(bad, channel=channel, owner_name="GefenMuon")
    )
    if rank == 1:
        with mock.patch.object(gefen.dist.transport, "_bytes_tensor", flipping_bytes_tensor):
            results["corrupted"] = outcome(
                lambda: all_gather_records(record, channel=channel, owner_name="GefenMuon")
            )
    else:
        results["corrupted"] = outcome(
            lambda: all_gather_records(record, channel=channel, owner_name="GefenMuon")
        )
    return results


def scenario_rank_local(rank: int, world_size: int) -> dict[str, Any]:
    scope = mesh_scope()
    header = rank_local_header(scope)
    other_rank = {**header, "rank": 1 - rank}
    other_rank["channels"] = [{**header["channels"][0], "group_rank": 1 - rank}]
    saved = other_rank if rank == 0 else header  # rank 0 loads the file rank 1 saved
    operation = GuardedOperation("GefenMuon", scope=scope)
    return {
        "header": header,
        "own_file": outcome(lambda: check_rank_local_header(header, scope)),
        "other_file": outcome(
            lambda: operation.local(PHASE_LOAD_VALIDATION, check_rank_local_header, saved, scope)
        ),
        "same_step": outcome(
            lambda: check_rank_local_records(header, 7, scope=scope, owner_name="GefenMuon")
        ),
        "different_steps": outcome(
            lambda: check_rank_local_records(header, 7 + rank, scope=scope, owner_name="GefenMuon")
        ),
        "swapped_files": outcome(
            lambda: check_rank_local_records(other_rank, 7, scope=scope, owner_name="GefenMuon")
        ),
    }


class AgreeingSGD(torch.optim.Optimizer):
    """Plain SGD whose step defers GradScaler's decision to the agreed AMP protocol."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.skipped = 0
        self.stepped = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        scope = collect_failure_scope(self.param_groups)
        if not prepare_synchronized_amp_step(self, scope, "Gefen"):
            self.skipped += 1
            return
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
        self.stepped += 1


def scenario_real_sharded_scaler(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = cpu_mesh()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    optimizer = AgreeingSGD(model.parameters())
    scaler = ShardedGradScaler(device="cpu", init_scale=1024.0, process_group=mesh.get_group(0))
    data = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    def train_step(overflow_here: bool) -> list[torch.Tensor]:
        optimizer.zero_grad()
        scaler.scale(model(data).square().mean()).backward()
        if overflow_here:
            with torch.no_grad():
                next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return [p.to_local().clone() for p in model.parameters()]

    before = [p.to_local().clone() for p in model.parameters()]
    snapshot = deep_snapshot(optimizer)
    after_overflow = train_step(overflow_here=rank == 0)
    changed = [
        line for line in snapshot_diff(snapshot, deep_snapshot(optimizer)) if ".grad" not in line
    ]
    skipped = (optimizer.skipped, optimizer.stepped, float(scaler.get_scale()))
    after_clean = train_step(overflow_here=False)
    return {
        "skipped": skipped,
        "unchanged_after_overflow": all(
            torch.equal(a, b) for a, b in zip(before, after_overflow, strict=True)
        ),
        "non_grad_changes": changed,
        "stepped": (optimizer.skipped, optimizer.stepped),
        "moved_after_clean_step": all(
            not torch.equal(a, b) for a, b in zip(after_overflow, after_clean, strict=True)
        ),
    }


def scenario_dtensor_snapshot_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    mesh = cpu_mesh()
    local = torch.randn(2, 3)
    param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    param.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=False)
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.state[param] = {"exp_avg": torch.zeros_like(param), "step": 3}
    optimizer.cache = {"mesh": torch.zeros_like(param)}  # type: ignore[attr-defined]
    result: dict[str, Any] = {}
    if rank == 0:
        # Rank 1 takes no part: a snapshot that communicated would block until pg_timeout.
        with forbid_collectives() as calls:
            result = outcome(lambda: deep_snapshot(optimizer, attributes=("cache",)).paths)
        result["calls"] = calls
    dist.barrier()
    return result


_OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
_TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter_tensor",
    "barrier",
)


class forbid_collectives:
    """Patch collectives in torch.distributed to record the call and raise."""

    def __init__(self, names: tuple[str, ...] = _OBJECT_COLLECTIVES + _TENSOR_COLLECTIVES) -> None:
        self.names = names
        self.calls: list[str] = []
        self.patches: list[Any] = []

    def __enter__(self) -> list[str]:
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name in self.names:

                def forbidden(*args: object, _name: str = name, **kwargs: object) -> None:
                    self.calls.append(_name)
                    raise AssertionError(f"{_name} must not be called")

                patch = mock.patch.object(module, name, forbidden)
                patch.start()
                self.patches.append(patch)
        return self.calls

    def __exit__(self, *exc: object) -> None:
        for patch in reversed(self.patches):
            patch.stop()


def scenario_no_object_collectives(rank: int, world_size: int) -> dict[str, Any]:
    channel = world_channel()
    scope = mesh_scope()
    with forbid_collectives(_OBJECT_COLLECTIVES) as calls:
        synchronize_step_error(None, PHASE_STEP_PREFLIGHT, scope, "Gefen")
        holder = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        holder.found_inf = 0.0  # type: ignore[attr-defined]
        holder.grad_scale = None  # type: ignore[attr-defined]
        stepped = prepare_synchronized_amp_step(holder, scope, "Gefen")
        operation = GuardedOperation("Gefen", binding_getter=lambda: None)
        operation.local(PHASE_STEP_PREFLIGHT, lambda: None)
        entry = sample_entry() if rank == 0 else None
        moved = broadcast_owner_state(entry, owner=0, channel=channel, owner_name="Gefen")
        gathered = all_gather_records({"rank": rank}, channel=channel, owner_name="Gefen")
        check_rank_local_records(rank_local_header(scope), 1, scope=scope, owner_name="Gefen")
    return {"calls": calls, "stepped": stepped, "moved": sorted(moved), "gathered": gathered}


SCENARIOS = [
    ("owner_round_trip", scenario_owner_round_trip, ()),
    ("owner_failures", scenario_owner_failures, ()),
    ("records", scenario_records, ()),
    ("rank_local", scenario_rank_local, ()),
    ("real_sharded_scaler", scenario_real_sharded_scaler, ()),
    ("dtensor_snapshot_on_one_rank", scenario_dtensor_snapshot_on_one_rank, ()),
    ("no_object_collectives", scenario_no_object_collectives, ()),
]


# -- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rendezvous="tcp", rank_deadline_s=180.0, pg_timeout_s=30.0)


@pytest.mark.smoke
def test_owner_state_round_trips_every_kind(world: ScenarioWorld) -> None:
    for result in world["owner_round_trip"]:
        # Receivers get equal values; the owner gets its own objects back.
        assert result == {0: True, 1: True}


def test_owner_encode_failure_is_voted_from_the_owner(world: ScenarioWorld) -> None:
    zero, one = world["owner_failures"]
    assert zero["complex"]["error"] == (
        "GefenMuon owner state header failed on local rank 0: owner state entry 'z': dtype "
        "torch.complex64 cannot be transported"
    )
    assert one["complex"]["error"] == (
        "GefenMuon owner state header failed on another process-group member"
    )
    assert zero["complex"]["elapsed"] < FAIL_FAST_S
    assert one["complex"]["elapsed"] < FAIL_FAST_S


def test_a_receiver_passing_an_entry_is_voted(world: ScenarioWorld) -> None:
    zero, one = world["owner_failures"]
    assert one["receiver_entry"]["error"] == (
        "GefenMuon owner state header failed on local rank 1: only the owner passes an entry; "
        "receivers pass None"
    )
    assert zero["receiver_entry"]["error"] == (
        "GefenMuon owner state header failed on another process-group member"
    )


def test_corrupted_metadata_fails_every_member(world: ScenarioWorld) -> None:
    zero, one = world["owner_failures"]
    assert one["corrupted"]["error"] == (
        "GefenMuon owner state metadata failed on local rank 1: owner state metadata does not "
        "match the owner's SHA-256 digest"
    )
    assert zero["corrupted"]["error"] == (
        "GefenMuon owner state metadata failed on another process-group member"
    )
    assert zero["after"]["value"] == {"ok": 2}
    assert one["after"]["value"] == {"ok": 2}


def test_records_gather_in_member_order(world: ScenarioWorld) -> None:
    expected = (
        {"data": [], "name": "rank:0", "rank": 0},
        {"data": [0, 1, 2], "name": "rank:1", "rank": 1},
    )
    for result in world["records"]:
        assert result["round_trip"] == expected


def test_record_preparation_failure_is_voted(world: ScenarioWorld) -> None:
    zero, one = world["records"]
    assert zero["preparation"]["error"].startswith(
        "GefenMuon record preparation failed on local rank 0: "
    )
    assert one["preparation"]["error"] == (
        "GefenMuon record preparation failed on another process-group member"
    )


def test_a_corrupted_record_raises_identically(world: ScenarioWorld) -> None:
    zero, one = world["records"]
    assert zero["corrupted"] == {**one["corrupted"], "elapsed": zero["corrupted"]["elapsed"]}
    assert zero["corrupted"]["type"] == "GroupAgreementError"
    assert zero["corrupted"]["error"] == (
        "GefenMuon gathered record of member 1 is corrupt: the bytes do not match their SHA-256 "
        "digest"
    )


def test_rank_local_header_of_a_mesh_scope(world: ScenarioWorld) -> None:
    for rank, result in enumerate(world["rank_local"]):
        assert result["header"] == {
            "version": 1,
            "world_size": 2,
            "rank": rank,
            "channels": [
                {
                    "mesh_key": ["cpu", [2], [0, 1]],
                    "mesh_dim": 0,
                    "group_ranks": [0, 1],
                    "group_rank": rank,
                    "group_size": 2,
                }
            ],
        }
        assert result["own_file"]["error"] is None
        assert result["same_step"]["error"] is None


def test_a_file_of_the_other_rank_is_refused_and_voted(world: ScenarioWorld) -> None:
    zero, one = world["rank_local"]
    assert zero["other_file"]["error"].startswith(
        "GefenMuon load validation failed on local rank 0: rank-local checkpoint topology "
        "differs: rank (rank-local state resumes only on the ranks"
    )
    assert one["other_file"]["error"] == (
        "GefenMuon load validation failed on another process-group member"
    )


@pytest.mark.parametrize(("case", "what"), [("different_steps", "tag"), ("swapped_files", "rank")])
def test_rank_local_records_disagree_identically(
    world: ScenarioWorld, case: str, what: str
) -> None:
    zero, one = world["rank_local"]
    message = f"GefenMuon rank-local checkpoint differs across process-group members: {what}"
    for result in (zero[case], one[case]):
        assert result["type"] == "GroupAgreementError"
        assert result["error"] == message


def test_real_sharded_scaler_skips_consistently_then_steps(world: ScenarioWorld) -> None:
    for result in world["real_sharded_scaler"]:
        # The Inf lived on rank 0 only; ShardedGradScaler agreed found_inf, so both skip.
        assert result["skipped"] == (1, 0, 512.0)
        assert result["unchanged_after_overflow"] is True
        assert result["non_grad_changes"] == []
        assert result["stepped"] == (1, 1)
        assert result["moved_after_clean_step"] is True


def test_a_dtensor_snapshot_on_one_rank_issues_no_collective(world: ScenarioWorld) -> None:
    zero, one = world["dtensor_snapshot_on_one_rank"]
    assert one == {}
    assert zero["error"] is None
    assert zero["calls"] == []
    assert zero["elapsed"] < FAIL_FAST_S
    assert "state[0][0]['exp_avg']" in zero["value"]
    assert "cache['mesh']" in zero["value"]


def test_no_object_collective_is_ever_called(world: ScenarioWorld) -> None:
    for result in world["no_object_collectives"]:
        assert result["calls"] == []
        assert result["stepped"] is True
        assert result["moved"] == sorted(sample_entry())
        assert result["gathered"] == ({"rank": 0}, {"rank": 1})
