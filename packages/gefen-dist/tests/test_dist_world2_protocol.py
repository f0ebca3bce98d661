"""One 2-rank Gloo world for the voting protocol: the failure vote and its messages, the
failure scope of a 1-D CPU mesh, AMP agreement, WORLD bindings, the operation header, the
binding-swap check, and the harness's handling of a raising scenario (docs/dist.md §4–§8,
§11.1, §12). The scenario workers run inside spawned ranks (run_ranks loads this module there
from its file) and return plain data that the tests assert on.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import gefen.dist.guarded
from gefen.contracts import ProcessGroupIdentity
from gefen.dist import (
    PHASE_LOAD_VALIDATION,
    PHASE_STEP_PREFLIGHT,
    Channel,
    CheckpointProcessGroupBinding,
    CodebookProcessGroupBinding,
    GuardedOperation,
    ProcessGroupBinding,
    any_true_over,
    collect_failure_scope,
    cuda_graph_capturing,
    differing_positions,
    mesh_key,
    prepare_synchronized_amp_step,
    synchronize_step_error,
)
from gefen.dist.codebook_scope import (
    HEADER_WORD_NAMES,
    OP_REFRESH,
    OP_STEP,
    codebook_header_payload,
)
from gefen.dist.testing import (
    RankFailure,
    ScenarioWorld,
    deep_snapshot,
    gloo_only,
    gloo_required,
    mark,
    run_scenarios,
    snapshot_diff,
)

pytestmark = [gloo_required(), gloo_only(), pytest.mark.multirank]

FAIL_FAST_S = 10.0  # liveness budget of one voted failure (< pg_timeout_s < rank deadline)


# -- helpers used inside the ranks -----------------------------------------------------------------


class DummyOptimizer(torch.optim.Optimizer):
    """Enough of an optimizer for scopes, votes and AMP: groups, state, no update rule."""

    _step_supports_amp_scaling = True

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        raise NotImplementedError


def cpu_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def sharded_parameter(mesh: Any, seed: int) -> torch.nn.Parameter:
    from torch.distributed.tensor import DTensor, Shard

    generator = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    local = torch.randn(2, 3, generator=generator)
    param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    grad = torch.randn(2, 3, generator=generator) * 8
    param.grad = DTensor.from_local(grad, mesh, [Shard(0)], run_check=False)
    return param


def sharded_optimizer(mesh: Any) -> DummyOptimizer:
    return DummyOptimizer([{"params": [sharded_parameter(mesh, 1), sharded_parameter(mesh, 2)]}])


def outcome(fn: Any) -> dict[str, Any]:
    """Run ``fn`` and describe what happened (message, type, cause, timing) as plain data."""
    begin = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:
        cause = exc.__cause__
        return {
            "error": str(exc),
            "type": type(exc).__name__,
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
            "local_failure": getattr(exc, "local_failure", None),
            "rank_attr": getattr(exc, "rank", None),
            "phase": getattr(exc, "phase", None),
            "elapsed": time.perf_counter() - begin,
        }
    return {"error": None, "value": value, "elapsed": time.perf_counter() - begin}


def raising(error: Exception) -> Any:
    def fail() -> None:
        raise error

    return fail


def forbid_cuda() -> Any:
    """Patch torch.cuda so any query from code under test raises."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CPU mesh must never query torch.cuda")

    return mock.patch.multiple(
        torch.cuda,
        is_available=forbidden,
        current_device=forbidden,
        device_count=forbidden,
        is_current_stream_capturing=forbidden,
    )


def world_binding(kind: type[ProcessGroupBinding] = CodebookProcessGroupBinding) -> Any:
    identity = ProcessGroupIdentity("world", ("rank:0", "rank:1"))
    return kind(identity, f"rank:{dist.get_rank()}", dist.group.WORLD, "cpu")


# -- scenarios -----------------------------------------------------------------------------------


def scenario_vote_rank0_failure(rank: int, world_size: int) -> dict[str, Any]:
    optimizer = sharded_optimizer(cpu_mesh())
    scope = collect_failure_scope(optimizer.param_groups)
    before = deep_snapshot(optimizer)
    operation = GuardedOperation("GefenMuon", scope=scope)
    closure = raising(RuntimeError("rank-zero closure failure")) if rank == 0 else (lambda: None)
    mark("voting a rank-zero closure failure")
    result = outcome(lambda: operation.local(PHASE_STEP_PREFLIGHT, closure))
    result["unchanged"] = snapshot_diff(before, deep_snapshot(optimizer))
    result["scope_size"] = len(scope)
    return result


def scenario_vote_messages(rank: int, world_size: int) -> dict[str, Any]:
    scope = collect_failure_scope(sharded_optimizer(cpu_mesh()).param_groups)

    def vote(error: Exception | None, phase: str) -> dict[str, Any]:
        return outcome(lambda: synchronize_step_error(error, phase, scope, "Gefen"))

    return {
        "empty_message": vote(ValueError("") if rank == 1 else None, PHASE_LOAD_VALIDATION),
        "both_fail": vote(RuntimeError(f"cause of rank {rank}"), PHASE_STEP_PREFLIGHT),
        "nobody_fails": vote(None, PHASE_STEP_PREFLIGHT),
    }


def scenario_agreement_misuse(rank: int, world_size: int) -> dict[str, Any]:
    scope = collect_failure_scope(sharded_optimizer(cpu_mesh()).param_groups)
    operation = GuardedOperation("Gefen", scope=scope)

    def agreeing(words: Any) -> dict[str, Any]:
        return outcome(
            lambda: operation.local_agreeing(PHASE_STEP_PREFLIGHT, "presence", lambda: (1, words))
        )

    mark("agreement words of another width, out of int64, a float; a vote with none")
    return {
        "three_words": agreeing((rank, rank, rank)),
        "too_big": agreeing((2**63 + 5, 0) if rank == 0 else (0, 0)),
        "int64_min": agreeing((-(2**63), 0) if rank == 0 else (0, 0)),
        "float": agreeing((0.5, 0) if rank == 0 else (0, 0)),
        "one_without": (
            agreeing((7, 1))
            if rank == 0
            else outcome(lambda: operation.local(PHASE_STEP_PREFLIGHT, lambda: 1))
        ),
        "after": agreeing((3, 1)),  # the group is still usable
        # Not a sequence at all: len() raised outside the vote, the peer waited for the timeout.
        "none": agreeing(None if rank == 1 else (0, 0)),
        "int": agreeing(5 if rank == 1 else (0, 0)),
        "after_malformed": agreeing((3, 1)),
    }


def scenario_one_rank_refusals(rank: int, world_size: int) -> dict[str, Any]:
    """A refusal that depends on one member's data or configuration: every member is told
    at once (the refusing member raised alone, its peer waited in the collective)."""
    from gefen.dist import TransportLimits, all_gather_records

    operation = GuardedOperation("Gefen", binding_getter=world_binding)
    fraction = torch.tensor([2.5 if rank == 1 else 2.0, 1.0])
    limits = TransportLimits(max_metadata_bytes=1000 if rank == 1 else 2000)
    channel = world_binding().channel
    return {
        "fraction": outcome(lambda: operation.sum_int64(fraction)),
        "complex": outcome(
            lambda: operation.sum_int64(fraction.to(torch.complex64) if rank == 1 else fraction)
        ),
        "limits": outcome(
            lambda: all_gather_records({"a": 1}, channel=channel, owner_name="Gefen", limits=limits)
        ),
        "after": outcome(lambda: operation.sum_int64(torch.tensor([rank, 1])).tolist()),
    }


def scenario_any_true_over(rank: int, world_size: int) -> dict[str, Any]:
    scope = collect_failure_scope(sharded_optimizer(cpu_mesh()).param_groups)
    return {
        "only_rank1": any_true_over(scope, rank == 1),
        "nobody": any_true_over(scope, False),
        "everybody": any_true_over(scope, True),
        "empty_scope_keeps_the_local_flag": any_true_over((), rank == 1),
        "scope_size": len(scope),
    }


def scenario_differing_positions(rank: int, world_size: int) -> dict[str, Any]:
    scope = collect_failure_scope(sharded_optimizer(cpu_mesh()).param_groups)
    ones = [True, False, None, True]
    return {
        "same": differing_positions(scope, ones),
        "one_flag": differing_positions(scope, [True, rank == 0, None, True]),
        "none_against_flag": differing_positions(scope, [True, None if rank else False]),
        "longer_on_rank1": differing_positions(scope, ones + [True] * rank),
        "named": differing_positions(scope, [True, rank == 0], ["a", "b"]),
        "other_names": differing_positions(scope, [True, rank == 0], ["a", "b" if rank else "c"]),
        "empty_scope": differing_positions((), [rank == 0]),
    }


def scenario_scope_one_mesh(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = cpu_mesh()
    fresh = DeviceMesh("cpu", torch.arange(world_size))
    first, second, other = (
        sharded_parameter(mesh, 1),
        sharded_parameter(mesh, 2),
        sharded_parameter(fresh, 3),
    )
    plain = torch.nn.Parameter(torch.ones(2))
    group_names = [group.group_name for m in (mesh, fresh) for group in m.get_all_groups()]
    with forbid_cuda():
        one = collect_failure_scope([{"params": [first, second]}])
        dedup = collect_failure_scope([{"params": [first]}, {"params": [other]}])
        approx = collect_failure_scope(
            [{"params": [plain]}, {"params": [first], "sharded_mode": "approx"}]
        )
        mixed = collect_failure_scope(
            [{"params": [plain], "sharded_mode": "exact"}, {"params": [second]}]
        )
        plain_only = collect_failure_scope([{"params": [plain]}, {"params": [torch.zeros(1)]}])
        capturing = cuda_graph_capturing([first.to_local(), torch.device("cpu")])
        voted = outcome(lambda: synchronize_step_error(None, PHASE_STEP_PREFLIGHT, one, "Gefen"))
    channel = one[0]
    return {
        "one": len(one),
        "is_channel": isinstance(channel, Channel),
        "fields": channel._fields,
        "key": channel.mesh_key,
        "dim": channel.mesh_dim,
        "device": str(channel.device),
        "group_is_mesh_group": channel.process_group.group_name == mesh.get_group(0).group_name,
        "distinct_mesh_objects": fresh is not mesh,
        "dedup": len(dedup),
        "dedup_keeps_first_seen": dedup[0].process_group.group_name
        == first.device_mesh.get_group(0).group_name,
        "approx": len(approx),
        "mixed": len(mixed),
        "plain_only": plain_only,
        "keys_equal": mesh_key(mesh) == mesh_key(fresh),
        # Group names are per-process counters ("0", "1", ...): only the device type may be a
        # string in the key, and no group name may appear among its parts.
        "names_in_key": [
            part
            for part in (mesh_key(mesh)[0], *mesh_key(mesh)[1], *mesh_key(mesh)[2])
            if not isinstance(part, int) and (part != "cpu" or part in group_names)
        ],
        "capturing": capturing,
        "voted": voted["error"],
    }


_ABSENT = object()


def amp_case(found_inf: object = _ABSENT, grad_scale: object = _ABSENT) -> dict[str, Any]:
    optimizer = sharded_optimizer(cpu_mesh())
    if found_inf is not _ABSENT:
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    if grad_scale is not _ABSENT:
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    scope = collect_failure_scope(optimizer.param_groups)
    before = deep_snapshot(optimizer)
    grads = [p.grad.to_local().clone() for p in optimizer.param_groups[0]["params"]]
    with forbid_cuda():
        result = outcome(lambda: prepare_synchronized_amp_step(optimizer, scope, "Gefen"))
    result["unchanged"] = snapshot_diff(before, deep_snapshot(optimizer))
    after = [p.grad.to_local() for p in optimizer.param_groups[0]["params"]]
    result["divided_by_8"] = all(
        torch.equal(new, old / 8) for new, old in zip(after, grads, strict=True)
    )
    return result


def scenario_amp_disagreements(rank: int, world_size: int) -> dict[str, Any]:
    zero = torch.tensor([0.0])
    return {
        "found_inf": amp_case(1.0 if rank == 0 else 0.0, None),
        "presence": amp_case(zero, None) if rank == 0 else amp_case(),
        "scale": amp_case(zero, torch.tensor([8.0 if rank == 0 else 4.0])),
        "scale_presence": amp_case(zero, 8.0 if rank == 0 else None),
        "parse_error": amp_case("inf" if rank == 1 else 0.0, None),
        "bad_scale_everywhere": amp_case(1.0, 0.0),
    }


def scenario_amp_agreements(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "overflow": amp_case(torch.tensor([1.0]), torch.tensor([8.0])),
        "scale_8": amp_case(torch.tensor([0.0]), torch.tensor([8.0])),
        "scale_none": amp_case(torch.tensor([0.0]), None),
        "absent": amp_case(),
    }


def scenario_amp_preparation_failure(rank: int, world_size: int) -> dict[str, Any]:
    optimizer = sharded_optimizer(cpu_mesh())
    if rank == 1:
        # An integer gradient cannot be multiplied in place by a float reciprocal.
        counter = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
        counter.grad = torch.ones(2, dtype=torch.int64)
        optimizer.param_groups[0]["params"].append(counter)
    optimizer.found_inf = 0.0  # type: ignore[attr-defined]
    optimizer.grad_scale = 2.0  # type: ignore[attr-defined]
    scope = collect_failure_scope(optimizer.param_groups)
    return outcome(lambda: prepare_synchronized_amp_step(optimizer, scope, "GefenMuonHybrid"))


def scenario_binding_helpers(rank: int, world_size: int) -> dict[str, Any]:
    binding = world_binding()
    checkpoint = world_binding(CheckpointProcessGroupBinding)
    binding.validate_runtime()
    checkpoint.validate_runtime()
    operation = GuardedOperation("Gefen", binding_getter=lambda: binding)
    return {
        "scope": [tuple(channel[2:]) for channel in operation.scope],
        "scope_is_world": operation.scope[0].process_group is dist.group.WORLD,
        "distinct": binding != checkpoint,
        "any_true": [operation.any_true(rank == 1), operation.any_true(False)],
        "gather": operation.gather([rank, 7]),
        "agree": operation.agree("codebook values", [5, 6]),
        "disagree": outcome(lambda: operation.agree("codebook values", [rank]))["error"],
        "sum": operation.sum_int64(torch.tensor([rank + 1, 2], dtype=torch.int32)).tolist(),
        "local": operation.local(PHASE_STEP_PREFLIGHT, lambda: rank * 10),
    }


def header_payload(**overrides: Any) -> tuple[int, ...]:
    words: dict[str, Any] = {
        "global_step": 5,
        "codebook_present": True,
        "deterministic": True,
        "refresh_every": 10,
        "local_shard_count": 2,
        "scope_fingerprint": bytes(range(32)),
        "manifest_fingerprint": bytes(range(32, 64)),
        "codebook_fingerprint": bytes(range(64, 96)),
    }
    words.update(overrides)
    return codebook_header_payload(**words)


def scenario_headers(rank: int, world_size: int) -> dict[str, Any]:
    operation = GuardedOperation("Gefen", binding_getter=world_binding)

    def exchange(op_code: int, payload: tuple[int, ...], names: Any = HEADER_WORD_NAMES) -> Any:
        return outcome(lambda: operation.header(op_code, payload, names))["error"]

    other = rank == 1
    several = header_payload(
        global_step=6,
        deterministic=False,
        refresh_every=0,
        codebook_fingerprint=bytes(range(100, 132)),
    )
    results = {
        "equal": exchange(OP_STEP, header_payload()),
        "operation": exchange(OP_REFRESH if other else OP_STEP, header_payload()),
        "global_step": exchange(OP_STEP, header_payload(global_step=5 + rank)),
        "several": exchange(OP_STEP, several if other else header_payload()),
        "child_presence": exchange(OP_STEP, (3 if other else 1,), ("child_presence",)),
    }
    for constant in ("HEADER_MAGIC", "HEADER_VERSION"):
        value = getattr(gefen.dist.guarded, constant) + (1 if other else 0)
        with mock.patch.object(gefen.dist.guarded, constant, value):
            payload = header_payload(global_step=5 + rank)
            results[constant] = exchange(OP_STEP, payload)
    return results


def scenario_binding_swap(rank: int, world_size: int) -> dict[str, Any]:
    installed = {"binding": world_binding()}

    def getter() -> Any:
        return installed["binding"]

    def clear() -> None:
        if rank == 0:
            installed["binding"] = None

    def replace() -> None:
        if rank == 0:
            installed["binding"] = world_binding()

    cleared = outcome(
        lambda: GuardedOperation("Gefen", binding_getter=getter).local(PHASE_STEP_PREFLIGHT, clear)
    )
    installed["binding"] = world_binding()
    replaced = outcome(
        lambda: GuardedOperation("Gefen", binding_getter=getter).local(
            PHASE_STEP_PREFLIGHT, replace
        )
    )
    # Nobody entered a header after the voted failure, so the group is still in step.
    installed["binding"] = world_binding()
    after = GuardedOperation("Gefen", binding_getter=getter).agree("after the swap", [1])
    return {"cleared": cleared, "replaced": replaced, "after": after}


def scenario_raising(rank: int, world_size: int) -> str:
    if rank == 1:
        raise ValueError("deliberate scenario failure")
    return "fine"


def scenario_after_raising(rank: int, world_size: int) -> int:
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return int(total.item())


SCENARIOS = [
    ("vote_rank0_failure", scenario_vote_rank0_failure, ()),
    ("vote_messages", scenario_vote_messages, ()),
    ("any_true_over", scenario_any_true_over, ()),
    ("differing_positions", scenario_differing_positions, ()),
    ("agreement_misuse", scenario_agreement_misuse, ()),
    ("one_rank_refusals", scenario_one_rank_refusals, ()),
    ("scope_one_mesh", scenario_scope_one_mesh, ()),
    ("amp_disagreements", scenario_amp_disagreements, ()),
    ("amp_agreements", scenario_amp_agreements, ()),
    ("amp_preparation_failure", scenario_amp_preparation_failure, ()),
    ("binding_helpers", scenario_binding_helpers, ()),
    ("headers", scenario_headers, ()),
    ("binding_swap", scenario_binding_swap, ()),
    ("raising", scenario_raising, ()),
    ("after_raising", scenario_after_raising, ()),
]


# -- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rank_deadline_s=180.0, pg_timeout_s=30.0)


@pytest.mark.smoke
def test_rank_zero_closure_failure_fails_both_ranks_fast(world: ScenarioWorld) -> None:
    zero, one = world["vote_rank0_failure"]
    assert zero["scope_size"] == one["scope_size"] == 1
    assert (
        zero["error"]
        == "GefenMuon step preflight failed on local rank 0: rank-zero closure failure"
    )
    assert one["error"] == "GefenMuon step preflight failed on another process-group member"
    assert zero["type"] == one["type"] == "DistributedStepError"
    assert zero["cause"] == "RuntimeError: rank-zero closure failure"
    assert one["cause"] is None
    assert (zero["local_failure"], zero["rank_attr"]) == (True, 0)
    assert (one["local_failure"], one["rank_attr"]) == (False, None)
    assert zero["phase"] == one["phase"] == PHASE_STEP_PREFLIGHT
    for rank in (zero, one):
        assert rank["elapsed"] < FAIL_FAST_S
        assert rank["unchanged"] == []


def test_vote_messages(world: ScenarioWorld) -> None:
    zero, one = world["vote_messages"]
    assert (
        one["empty_message"]["error"] == "Gefen load validation failed on local rank 1: ValueError"
    )
    assert one["empty_message"]["cause"] == "ValueError: "
    assert zero["empty_message"]["error"] == (
        "Gefen load validation failed on another process-group member"
    )
    for rank, result in enumerate((zero, one)):
        assert result["both_fail"]["error"] == (
            f"Gefen step preflight failed on local rank {rank}: cause of rank {rank}"
        )
        assert result["nobody_fails"]["error"] is None


def test_agreement_words_that_break_the_rules_fail_every_member_by_name(
    world: ScenarioWorld,
) -> None:
    """Words of another width were replaced by zeros (every member "agreed"); a word out of
    int64 raised outside the vote on one rank and left the other waiting for the timeout; a
    float was truncated; a vote with words against one without aborted a peer (sizes differ)."""
    rule = "agreement 'presence' needs 2 int words, each strictly between -2**63 and 2**63"
    for rank, result in enumerate(world["agreement_misuse"]):
        assert result["three_words"]["error"] == (
            f"Gefen step preflight failed on local rank {rank}: {rule}, got {(rank,) * 3!r}"
        )
        for case in ("too_big", "int64_min", "float"):
            expected = (
                f"Gefen step preflight failed on local rank 0: {rule}"
                if rank == 0
                else "Gefen step preflight failed on another process-group member"
            )
            assert result[case]["error"].startswith(expected), (case, result[case])
            assert result[case]["elapsed"] < 20.0
        assert result["one_without"]["type"] == "GroupAgreementError"
        # Both members are told: the one with words used to read the other's zeros as a
        # differing subject ("presence differs"), naming the wrong cause.
        assert (
            "another process-group member is in a different operation"
            in (result["one_without"]["error"])
        )
        assert result["after"] == {"error": None, "value": 1, "elapsed": result["after"]["elapsed"]}
        for case in ("none", "int"):
            expected = (
                "Gefen step preflight failed on local rank 1: "
                if rank == 1
                else "Gefen step preflight failed on another process-group member"
            )
            assert result[case]["error"].startswith(expected), (case, result[case])
            assert result[case]["elapsed"] < FAIL_FAST_S
        assert result["after_malformed"]["error"] is None


def test_a_refusal_one_member_meets_fails_every_member_at_once(world: ScenarioWorld) -> None:
    for result in world["one_rank_refusals"]:
        assert result["fraction"]["type"] == "ValueError"
        assert "sum_int64 sums integers" in result["fraction"]["error"]
        assert "on 1 member(s)" in result["fraction"]["error"]
        assert result["limits"]["type"] == "GroupAgreementError"
        assert "different TransportLimits" in result["limits"]["error"]
        assert result["complex"]["type"] == "ValueError"
        assert "on 1 member(s)" in result["complex"]["error"]
        for case in ("fraction", "complex", "limits"):
            assert result[case]["elapsed"] < FAIL_FAST_S, (case, result[case])
        assert result["after"] == {
            "error": None,
            "value": [1, 2],
            "elapsed": result["after"]["elapsed"],
        }


def test_any_true_over_tells_every_member(world: ScenarioWorld) -> None:
    for rank, result in enumerate(world["any_true_over"]):
        assert result["scope_size"] > 0
        assert result["only_rank1"] is True
        assert result["nobody"] is False
        assert result["everybody"] is True
        assert result["empty_scope_keeps_the_local_flag"] is (rank == 1)


def test_differing_positions_name_the_same_places_on_every_member(world: ScenarioWorld) -> None:
    # What a refused presence vote reports by name: positions, or None where the members'
    # lengths or labels differ (a label would then name another parameter on each member).
    for result in world["differing_positions"]:
        assert result == {
            "same": [],
            "one_flag": [1],
            "none_against_flag": [1],
            "longer_on_rank1": None,
            "named": [1],
            "other_names": None,
            "empty_scope": [],
        }


def test_scope_of_one_cpu_mesh(world: ScenarioWorld) -> None:
    for result in world["scope_one_mesh"]:
        assert result["one"] == 1
        assert result["is_channel"] is True
        assert result["fields"] == ("process_group", "device", "mesh_key", "mesh_dim")
        assert result["key"] == ("cpu", (2,), (0, 1))
        assert (result["dim"], result["device"]) == (0, "cpu")
        assert result["group_is_mesh_group"] is True
        assert result["distinct_mesh_objects"] is True
        assert result["keys_equal"] is True
        assert result["dedup"] == 1
        assert result["dedup_keeps_first_seen"] is True
        assert result["approx"] == 1
        assert result["mixed"] == 1
        assert result["plain_only"] == ()
        assert result["names_in_key"] == []
        assert result["capturing"] is False
        assert result["voted"] is None


def _both(world: ScenarioWorld, scenario: str, case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    zero, one = world[scenario]
    return zero[case], one[case]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "found_inf",
            "Gefen AMP found_inf differs across process-group members; use a group-aware "
            "gradient scaler (ShardedGradScaler with scaler.unscale_(optimizer) before "
            "scaler.step(optimizer))",
        ),
        (
            "presence",
            "Gefen AMP protocol presence differs across process-group members; use the same "
            "group-aware gradient scaler on every member",
        ),
        (
            "scale",
            "Gefen AMP grad_scale differs across process-group members; use a group-aware "
            "gradient scaler",
        ),
        (
            "scale_presence",
            "Gefen AMP grad_scale presence differs across process-group members; use a "
            "group-aware gradient scaler",
        ),
    ],
)
def test_amp_disagreement_raises_identically(world: ScenarioWorld, case: str, message: str) -> None:
    for result in _both(world, "amp_disagreements", case):
        assert result["type"] == "GroupAgreementError"
        assert result["error"] == message
        assert result["unchanged"] == []


def test_amp_control_errors_are_voted(world: ScenarioWorld) -> None:
    zero, one = _both(world, "amp_disagreements", "parse_error")
    assert one["error"].startswith("Gefen AMP control preflight failed on local rank 1: ")
    assert "found_inf" in one["error"]
    assert zero["error"] == "Gefen AMP control preflight failed on another process-group member"
    for rank, result in enumerate(_both(world, "amp_disagreements", "bad_scale_everywhere")):
        assert result["error"] == (
            f"Gefen AMP control preflight failed on local rank {rank}: GradScaler supplied a "
            "non-finite or non-positive grad_scale"
        )
        assert result["unchanged"] == []


def test_group_wide_overflow_skips_everywhere_without_unscaling(world: ScenarioWorld) -> None:
    for result in _both(world, "amp_agreements", "overflow"):
        assert result["error"] is None
        assert result["value"] is False
        assert result["unchanged"] == []


def test_agreeing_scale_unscales_exactly_once(world: ScenarioWorld) -> None:
    for result in _both(world, "amp_agreements", "scale_8"):
        assert result["error"] is None
        assert result["value"] is True
        assert result["divided_by_8"] is True


@pytest.mark.parametrize("case", ["scale_none", "absent"])
def test_nothing_to_unscale_steps_unchanged(world: ScenarioWorld, case: str) -> None:
    for result in _both(world, "amp_agreements", case):
        assert result["error"] is None
        assert result["value"] is True
        assert result["unchanged"] == []


def test_unscale_failure_is_voted(world: ScenarioWorld) -> None:
    zero, one = world["amp_preparation_failure"]
    assert one["error"].startswith("GefenMuonHybrid AMP preparation failed on local rank 1: ")
    assert zero["error"] == "GefenMuonHybrid AMP preparation failed on another process-group member"


def test_world_binding_helpers(world: ScenarioWorld) -> None:
    for rank, result in enumerate(world["binding_helpers"]):
        assert result["scope"] == [(None, None)]
        assert result["scope_is_world"] is True
        assert result["distinct"] is True
        assert result["any_true"] == [True, False]
        assert result["gather"] == ((0, 7), (1, 7))
        assert result["agree"] == (5, 6)
        assert result["disagree"] == "Gefen codebook values differs across process-group members"
        assert result["sum"] == [3, 4]
        assert result["local"] == rank * 10


@pytest.mark.parametrize(
    ("case", "labels"),
    [
        ("equal", None),
        ("operation", "operation"),
        ("global_step", "global_step"),
        ("several", "global_step, deterministic, refresh_every, codebook_fingerprint"),
        ("child_presence", "child_presence"),
        ("HEADER_MAGIC", "operation"),
        ("HEADER_VERSION", "operation"),
    ],
)
def test_header_mismatch_is_identical_on_every_member(
    world: ScenarioWorld, case: str, labels: str | None
) -> None:
    zero, one = _both(world, "headers", case)
    assert zero == one
    expected = (
        None
        if labels is None
        else (f"Gefen operation header differs across process-group members: {labels}")
    )
    assert zero == expected


def test_a_closure_that_swaps_the_binding_fails_symmetrically(world: ScenarioWorld) -> None:
    zero, one = world["binding_swap"]
    for case in ("cleared", "replaced"):
        assert zero[case]["error"] == (
            "Gefen step preflight failed on local rank 0: Gefen process-group binding changed "
            "during the step preflight"
        )
        assert one[case]["error"] == "Gefen step preflight failed on another process-group member"
        assert zero[case]["elapsed"] < FAIL_FAST_S
        assert one[case]["elapsed"] < FAIL_FAST_S
    assert zero["after"] == one["after"] == (1,)


@pytest.mark.smoke
def test_a_raising_scenario_reports_its_traceback_and_later_ones_run(
    world: ScenarioWorld,
) -> None:
    with pytest.raises(RankFailure) as caught:
        world["raising"]
    assert "ValueError: deliberate scenario failure" in str(caught.value)
    assert 'raise ValueError("deliberate scenario failure")' in str(caught.value)
    assert isinstance(world.error, RankFailure)
    assert "deliberate scenario failure" in str(world.error)
    assert world["after_raising"] == [3, 3]
