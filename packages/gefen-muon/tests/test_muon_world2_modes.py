"""GefenMuon's sharded-mode numerics and checkpoints on a 2-rank Gloo world (docs/muon.md §7, §8,
§11 and the matching §12 edge cases).

Every step scenario shards bias-free ``nn.Linear`` layers with FSDP2 ``fully_shard`` on
``init_device_mesh("cpu", (2,))``; gradients are seeded full matrices, identical on every rank,
assigned as ``distribute_tensor(g, mesh, [Shard(0)])``. A one-process oracle (plain tensors, the
same options, the same full gradients) runs inside each scenario on every rank. All scenarios
share one module-scoped spawned world; scenario functions are module-level so the children can
load them by reference, and they return plain data (tensors travel as ``torch.save`` bytes).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from gefen.core.testing import format1_state_dict, gathered
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed
from gefen.muon import testing as mt

MANIFEST = "muon_distributed"

pytestmark = [pytest.mark.multirank, gloo_required()]

WORLD = 2
DEADLINE_S = 10.0  # liveness bound of one failing operation, below the 20 s+ group timeout
SHAPES3 = [(8, 6), (5, 4), (1, 4)]
SHAPES5 = [(8, 6), (1, 8), (5, 4), (1, 4), (6, 8)]  # (1, 8) at index 1: an empty-shard owner


# --- helpers (run inside the ranks and, for the one-process checks, in the parent) ----------


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run a must-fail operation; its elapsed time, error and cause as plain strings."""
    import time

    start = time.perf_counter()
    try:
        fn()
    except Exception as error:
        cause = error.__cause__
        return {
            "elapsed": time.perf_counter() - start,
            "error": f"{type(error).__name__}: {error}",
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
        }
    return {"elapsed": time.perf_counter() - start, "error": None, "cause": None}


# --- scenarios ---------------------------------------------------------------------------------


def scenario_exact_matches_oracle(rank: int, world: int) -> dict[str, Any]:
    mesh = mt.mesh_1d(world)
    results: dict[str, Any] = {}
    for normuon in (False, True):
        fulls = mt.fulls(SHAPES3, 1)
        model = mt.sharded(mesh, fulls)
        optimizer = mt.sharded_muon(model, sharded_mode="exact", normuon=normuon)
        oracle_params, oracle = mt.oracle(fulls, normuon=normuon)
        for step in range(3):
            grads = mt.grads(SHAPES3, 7, step)
            mt.assign_sharded(model, grads)
            mt.assign_plain(oracle_params, grads)
            optimizer.step()
            oracle.step()
        params = list(model.parameters())
        full = mt.full_params(model)
        results[f"normuon={normuon}"] = {
            "diff": mt.max_diff(full, [p.detach() for p in oracle_params]),
            "moved": mt.max_diff(full, fulls) > 1e-3,
            "local_rows": [int(p.to_local().shape[0]) for p in params],
            "state_numel": [int(optimizer.state[p]["momentum_codes"].numel()) for p in params],
            "normuon_v": [
                list(optimizer.state[p]["normuon_v"].shape) if normuon else None for p in params
            ],
            "codebook_equal": mt.same(optimizer.codebook, oracle.codebook),
            "global_step": optimizer.global_step,
        }
    return results


def scenario_fluctuating_active_set(rank: int, world: int) -> dict[str, Any]:
    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES5, 5)
    exact_model, dist_model = mt.sharded(mesh, fulls), mt.sharded(mesh, fulls)
    exact = mt.sharded_muon(exact_model, sharded_mode="exact")
    distributed = mt.sharded_muon(dist_model, sharded_mode="distributed")
    oracle_params, oracle = mt.oracle(fulls)
    absent = {1: {0}, 2: {2}}  # step -> items without a gradient
    params = list(dist_model.parameters())
    owners: list[list[tuple[int, int]]] = []
    placements: list[list[int]] = []
    equal: list[bool] = []
    idle_entries_kept: list[bool] = []
    for step in range(4):
        skip = absent.get(step, set())
        grads = mt.grads(SHAPES5, 17, step)
        mt.assign_sharded(exact_model, grads, skip)
        mt.assign_sharded(dist_model, grads, skip)
        mt.assign_plain(oracle_params, grads, skip)
        idle = {
            i: {
                k: v.clone() if isinstance(v, Tensor) else v
                for k, v in distributed.state[p].items()
            }
            for i, p in enumerate(params)
            if i in skip
        }
        exact.step()
        distributed.step()
        oracle.step()
        idle_entries_kept.extend(
            mt.same_entry(distributed.state[params[i]], entry) for i, entry in idle.items()
        )
        manifest = distributed.state_dict()["gefen"]["muon_distributed"]
        owners.append(
            [(item["saved_id"], item["owner"]) for item in manifest["groups"][0]["params"]]
        )
        placements.append(mt.owned(distributed, dist_model))
        equal.append(mt.bits_equal(mt.full_params(exact_model), mt.full_params(dist_model)))
    owned = placements[-1]
    exact_params = list(exact_model.parameters())
    return {
        "owners": owners,
        "placements": placements,
        "equal": equal,
        "idle_entries_kept": idle_entries_kept,
        "oracle_diff": mt.max_diff(mt.full_params(dist_model), [p.detach() for p in oracle_params]),
        "owned_steps": {i: distributed.state[params[i]]["step"] for i in owned},
        "owner_state_equal": [
            mt.same_entry(distributed.state[params[i]], exact.state[exact_params[i]]) for i in owned
        ],
        "global_step": distributed.global_step,
    }


def scenario_approx(rank: int, world: int) -> dict[str, Any]:
    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES3, 21)
    approx_model, exact_model = mt.sharded(mesh, fulls), mt.sharded(mesh, fulls)
    approx = mt.sharded_muon(approx_model, sharded_mode="approx")
    exact = mt.sharded_muon(exact_model, sharded_mode="exact")
    elapsed: list[float] = []
    for step in range(3):
        grads = mt.grads(SHAPES3, 23, step)
        mt.assign_sharded(approx_model, grads)
        mt.assign_sharded(exact_model, grads)
        took, error, _ = timed(approx.step)
        assert error is None, error
        elapsed.append(took)
        exact.step()
    params = list(approx_model.parameters())
    return {
        "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in params),
        "diff_from_exact": mt.max_diff(mt.full_params(approx_model), mt.full_params(exact_model)),
        "moved": mt.max_diff(mt.full_params(approx_model), fulls) > 1e-3,
        "local_numel": [int(p.to_local().numel()) for p in params],
        "codes_numel": [
            int(approx.state[p]["momentum_codes"].numel())
            if "momentum_codes" in approx.state[p]
            else 0
            for p in params
        ],
        "keys": [sorted(approx.state[p]) for p in params],
        "global_step": approx.global_step,
        "elapsed": max(elapsed),
    }


def scenario_approx_stochastic_draws(rank: int, world: int) -> dict[str, Any]:
    """Stochastic rounding in approx mode: the two ranks' row halves get the same gradient."""
    mesh = mt.shared_mesh(world)
    half = mt.fulls([(8, 24)], 31)[0]
    model = mt.sharded(mesh, [torch.cat([half, half])])
    optimizer = mt.sharded_muon(model, sharded_mode="approx", stochastic_round=True)
    gradient = mt.grads([(8, 24)], 33, 0)[0]
    mt.assign_sharded(model, [torch.cat([gradient, gradient])])
    optimizer.step()
    (param,) = model.parameters()
    return {"codes": optimizer.state[param]["momentum_codes"].tolist()}


def scenario_distributed_checkpoint(rank: int, world: int) -> dict[str, Any]:
    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES5, 9)
    model = mt.sharded(mesh, fulls)
    optimizer = mt.sharded_muon(model, sharded_mode="distributed")
    for step in range(2):
        mt.assign_sharded(model, mt.grads(SHAPES5, 13, step))
        optimizer.step()
    params = list(model.parameters())
    live_owned = mt.owned(optimizer, model)
    before = mt.snapshot(optimizer)
    elapsed, error, presented = timed(optimizer.state_dict)
    assert error is None, error
    assert presented is not None
    unchanged = mt.changes(optimizer, before)
    rows = _presented_rows(presented, params)
    # Gathered as DCP's full_state_dict gathers it: one portable file, equal on every rank.
    sd = gathered(presented)
    manifest = sd["gefen"]["muon_distributed"]
    digests = {i: mt.digest(entry) for i, entry in sd["state"].items()}
    live_forms = format1_state_dict(optimizer, sd)["state"]  # format 2 read back
    saved_owner_equal = [
        mt.same_entry(live_forms[i], optimizer.state[params[i]]) for i in live_owned
    ]
    saved_params = mt.full_params(model)
    payload, _ = mt.round_trip(sd)
    # Resume at world 2 from the presented rows' torch.save / weights_only round trip.
    resumed_model = mt.sharded(mesh, saved_params)
    resumed = mt.sharded_muon(resumed_model, sharded_mode="distributed")
    resumed.load_state_dict(mt.round_trip(presented)[1])
    resumed_owned = mt.owned(resumed, resumed_model)
    resumed_owner_equal = all(
        mt.same_entry(resumed.state[r], optimizer.state[p])
        for i, (p, r) in enumerate(zip(params, resumed_model.parameters(), strict=True))
        if i in resumed_owned
    )
    for step in range(2, 4):
        grads = mt.grads(SHAPES5, 13, step)
        mt.assign_sharded(model, grads)
        mt.assign_sharded(resumed_model, grads)
        optimizer.step()
        resumed.step()
    final = mt.full_params(resumed_model)
    oracle_params, oracle = mt.oracle(fulls)
    for step in range(4):
        mt.assign_plain(oracle_params, mt.grads(SHAPES5, 13, step))
        oracle.step()
    blob = None
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"payload": payload, "saved": saved_params, "final": final}, buffer)
        blob = buffer.getvalue()
    return {
        "elapsed": elapsed,
        "unchanged": unchanged,
        "manifest": manifest,
        # every group copy is the top-level extras but the manifest and the writer (top level
        # only, §8.1)
        "mirrored": all(
            mt.same_entry(
                g["gefen"],
                {k: v for k, v in sd["gefen"].items() if k not in (MANIFEST, "optimizer")},
            )
            for g in sd["param_groups"]
        ),
        "extras_keys": sorted(sd["gefen"]),
        "digests": digests,
        "saved_owner_equal": saved_owner_equal,
        "live_owned": live_owned,
        "resumed_owned": resumed_owned,
        "resumed_owner_equal": resumed_owner_equal,
        "resumed_step": resumed.global_step,
        "bitwise": mt.bits_equal(mt.full_params(model), final),
        "oracle_diff": mt.max_diff(final, [p.detach() for p in oracle_params]),
        "blob": blob,
        "rows": rows,
    }


def _presented_rows(sd: dict[str, Any], params: list[Any]) -> dict[int, Any]:
    """Per saved entry: for each tensor, ("rows", local rows, global rows) when it is a DTensor
    sharded Shard(0) like its parameter, else ("full", rows)."""
    from torch.distributed.tensor import DTensor, Shard

    described: dict[int, Any] = {}
    for index, entry in sd["state"].items():
        local = int(params[index].to_local().shape[0])
        forms = {}
        for key, value in entry.items():
            if isinstance(value, DTensor) and tuple(value.placements) == (Shard(0),):
                forms[key] = ("rows", int(value.to_local().shape[0]), int(value.shape[0]), local)
            elif isinstance(value, Tensor) and value.dim() == 2:
                forms[key] = ("full", int(value.shape[0]))
        described[index] = forms
    return described


def scenario_approx_rank_local_rejections(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES3, 31)
    model = mt.sharded(mesh, fulls)
    optimizer = mt.sharded_muon(model, sharded_mode="approx")
    for step in range(2):
        mt.assign_sharded(model, mt.grads(SHAPES3, 37, step))
        optimizer.step()
    at_two, _ = mt.round_trip(optimizer.state_dict())
    mt.assign_sharded(model, mt.grads(SHAPES3, 37, 2))
    optimizer.step()
    at_three, own = mt.round_trip(optimizer.state_dict())
    files: list[Any] = [None] * world
    dist.all_gather_object(files, at_two)
    other = torch.load(io.BytesIO(files[(rank + 1) % world]), weights_only=True)
    before = mt.snapshot(optimizer)
    swapped = _attempt(lambda: optimizer.load_state_dict(other))
    swapped["changes"] = mt.changes(optimizer, before)
    # Rank 0 loads its own step-2 file, every other rank its own step-3 file.
    mixed = torch.load(io.BytesIO(at_two if rank == 0 else at_three), weights_only=True)
    before = mt.snapshot(optimizer)
    steps = _attempt(lambda: optimizer.load_state_dict(mixed))
    steps["changes"] = mt.changes(optimizer, before)
    # Its own file from the same step everywhere loads, and the optimizer still trains.
    optimizer.load_state_dict(own)
    loaded_step = optimizer.global_step
    previous = [p.to_local().clone() for p in model.parameters()]
    mt.assign_sharded(model, mt.grads(SHAPES3, 37, 3))
    optimizer.step()
    moved = any(
        not torch.equal(a, p.to_local())
        for a, p in zip(previous, model.parameters(), strict=True)
        if a.numel() > 0
    )
    return {
        "rank_local": "rank_local" in optimizer.state_dict()["gefen"],
        "swapped": swapped,
        "steps": steps,
        "loaded_step": loaded_step,
        "trained": (optimizer.global_step, moved),
    }


def scenario_checkpoint_binding(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from gefen.contracts import ProcessGroupIdentity
    from gefen.dist import CheckpointProcessGroupBinding

    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES5, 41)
    model = mt.sharded(mesh, fulls)
    optimizer = mt.sharded_muon(model, sharded_mode="distributed")
    mt.assign_sharded(model, mt.grads(SHAPES5, 43, 0))
    optimizer.step()
    identity = ProcessGroupIdentity("muon-fsdp", tuple(f"member{r}" for r in range(world)))
    group = mesh.get_group(0)
    other_handle = dist.new_group(list(range(world)))  # same ranks, another handle object
    wrong = CheckpointProcessGroupBinding(identity, f"member{rank}", other_handle, "cpu")
    right = CheckpointProcessGroupBinding(identity, f"member{rank}", group, "cpu")
    sd = optimizer.state_dict()
    before = mt.snapshot(optimizer)
    save = _attempt(lambda: optimizer.state_dict(checkpoint_binding=wrong))
    save["changes"] = mt.changes(optimizer, before)
    load = _attempt(lambda: optimizer.load_state_dict(sd, checkpoint_binding=wrong))
    load["changes"] = mt.changes(optimizer, before)
    import gefen.dist.guarded as guarded

    voted: list[str] = []
    vote = guarded.synchronize_step_error

    def counting(error: Any, phase: str, *args: Any, **kwargs: Any) -> None:
        voted.append(phase)
        vote(error, phase, *args, **kwargs)

    guarded.synchronize_step_error = counting  # type: ignore[assignment]
    try:
        with_right = optimizer.state_dict(checkpoint_binding=right)
    finally:
        guarded.synchronize_step_error = vote
    same_manifest = with_right["gefen"]["muon_distributed"] == sd["gefen"]["muon_distributed"]
    optimizer.load_state_dict(with_right, checkpoint_binding=right)
    previous = mt.full_params(model)
    mt.assign_sharded(model, mt.grads(SHAPES5, 43, 1))
    optimizer.step()
    return {
        "handles_differ": other_handle is not group,
        "save": save,
        "load": load,
        "same_manifest": same_manifest,
        "save_votes": voted,
        "trained": (optimizer.global_step, mt.max_diff(previous, mt.full_params(model)) > 0),
    }


def scenario_group_copies_without_top_level(rank: int, world: int) -> dict[str, Any]:
    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES5, 47)
    model = mt.sharded(mesh, fulls)
    optimizer = mt.sharded_muon(model, sharded_mode="distributed")
    for step in range(2):
        mt.assign_sharded(model, mt.grads(SHAPES5, 53, step))
        optimizer.step()
    _, saved = mt.round_trip(optimizer.state_dict())
    # A file of an earlier release also had the manifest in every group copy: it still loads.
    legacy = copy.deepcopy(saved)
    for group in legacy["param_groups"]:
        group["gefen"]["muon_distributed"] = copy.deepcopy(legacy["gefen"]["muon_distributed"])
    legacy_model = mt.sharded(mesh, mt.full_params(model))
    legacy_optimizer = mt.sharded_muon(legacy_model, sharded_mode="distributed")
    legacy_error = timed(lambda: legacy_optimizer.load_state_dict(legacy))[1]
    loaded = saved
    del loaded["gefen"]
    in_groups = any("muon_distributed" in g["gefen"] for g in loaded["param_groups"])
    fresh_model = mt.sharded(mesh, mt.full_params(model))
    fresh = mt.sharded_muon(fresh_model, sharded_mode="distributed")
    took, error, _ = timed(lambda: fresh.load_state_dict(loaded))
    restored = (fresh.global_step, mt.same(fresh.codebook, optimizer.codebook))
    equal: list[bool] = []
    for step in range(2, 4):
        grads = mt.grads(SHAPES5, 53, step)
        mt.assign_sharded(model, grads)
        mt.assign_sharded(fresh_model, grads)
        optimizer.step()
        fresh.step()
        equal.append(mt.bits_equal(mt.full_params(model), mt.full_params(fresh_model)))
    return {
        "in_groups": in_groups,
        "legacy_error": legacy_error,
        "error": error,
        "elapsed": took,
        "restored": restored,
        "equal": equal,
        "owned": mt.owned(fresh, fresh_model),
    }


SHAPES_EMPTY = [(0, 4), (6, 4), (4, 6), (8, 6)]  # an empty matrix ahead of the distributed ones


def scenario_empty_matrix_checkpoint(rank: int, world: int) -> dict[str, Any]:
    """An empty matrix takes no owner slot, in the step and in the checkpoint alike."""
    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES_EMPTY, 61)
    results: dict[str, Any] = {}
    for source in ("distributed", "exact"):
        model = mt.sharded(mesh, fulls)
        optimizer = mt.sharded_muon(model, sharded_mode=source)
        for step in range(2):
            mt.assign_sharded(model, mt.grads(SHAPES_EMPTY, 67, step))
            optimizer.step()
        _, saved = mt.round_trip(optimizer.state_dict())
        manifest = saved["gefen"].get(MANIFEST)
        resumed_model = mt.sharded(mesh, mt.full_params(model))
        resumed = mt.sharded_muon(resumed_model, sharded_mode="distributed")
        error = timed(lambda: resumed.load_state_dict(saved))[1]  # noqa: B023 (called at once)
        equal: list[bool] = []
        for step in range(2, 4):
            grads = mt.grads(SHAPES_EMPTY, 67, step)
            mt.assign_sharded(model, grads)
            mt.assign_sharded(resumed_model, grads)
            optimizer.step()
            resumed.step()
            equal.append(mt.bits_equal(mt.full_params(model), mt.full_params(resumed_model)))
        results[source] = {
            "owners": None
            if manifest is None
            else [
                (p["saved_id"], p["owner"], p["initialized"])
                for p in manifest["groups"][0]["params"]
            ],
            "error": error,
            "equal": equal,
        }
    return results


def scenario_mode_edit(rank: int, world: int, start: str, edited: str) -> dict[str, Any]:
    """A group's mode edited once its state exists: refused (distributed state lives on the
    owner alone, exact state on every rank), then switched through a load, which keeps it."""
    mesh = mt.mesh_1d(world)
    fulls = mt.fulls(SHAPES3, 5)
    model = mt.sharded(mesh, fulls)
    optimizer = mt.sharded_muon(model, sharded_mode=start, momentum_codec="none")
    for step in range(2):
        mt.assign_sharded(model, mt.grads(SHAPES3, 17, step))
        optimizer.step()
    saved = mt.round_trip(optimizer.state_dict())[1]
    optimizer.param_groups[0]["sharded_mode"] = edited
    mt.assign_sharded(model, mt.grads(SHAPES3, 17, 2))
    before = mt.snapshot(optimizer)
    refused = _attempt(optimizer.step)
    unchanged = mt.changes(optimizer, before)
    optimizer.load_state_dict(saved)
    for step in range(2, 4):
        mt.assign_sharded(model, mt.grads(SHAPES3, 17, step))
        optimizer.step()
    oracle_params, oracle = mt.oracle(fulls, momentum_codec="none")
    for step in range(4):
        mt.assign_plain(oracle_params, mt.grads(SHAPES3, 17, step))
        oracle.step()
    return {
        "refused": refused["error"],
        "unchanged": unchanged,
        "mode": optimizer.param_groups[0]["sharded_mode"],
        "oracle_diff": mt.max_diff(mt.full_params(model), [p.detach() for p in oracle_params]),
    }


SCENARIOS = [
    ("edit_to_exact", scenario_mode_edit, ("distributed", "exact")),
    ("edit_to_distributed", scenario_mode_edit, ("exact", "distributed")),
    ("exact_oracle", scenario_exact_matches_oracle, ()),
    ("dist_standard", mt.scenario_distributed_equals_exact, ("standard",)),
    ("dist_tuned4", mt.scenario_distributed_equals_exact, ("tuned4",)),
    ("fluctuating", scenario_fluctuating_active_set, ()),
    ("approx", scenario_approx, ()),
    ("approx_stochastic", scenario_approx_stochastic_draws, ()),
    ("checkpoint", scenario_distributed_checkpoint, ()),
    ("rank_local", scenario_approx_rank_local_rejections, ()),
    ("binding", scenario_checkpoint_binding, ()),
    ("group_copies", scenario_group_copies_without_top_level, ()),
    ("empty_matrix", scenario_empty_matrix_checkpoint, ()),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, WORLD, rank_deadline_s=540.0, pg_timeout_s=120.0)


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_exact_matches_the_one_process_oracle_with_uneven_and_empty_shards(
    world: ScenarioWorld,
) -> None:
    rows = {0: [4, 3, 1], 1: [4, 2, 0]}  # torch.chunk of 8, 5 and 1 rows over 2 ranks
    for rank, result in enumerate(world["exact_oracle"]):
        for normuon in (False, True):
            case = result[f"normuon={normuon}"]
            assert case["diff"] <= 1e-5, (rank, normuon, case["diff"])
            assert case["moved"]
            assert case["local_rows"] == rows[rank]
            assert case["state_numel"] == [r * c for r, c in SHAPES3]  # full-numel state
            expected_v = [[r, 1] for r, _ in SHAPES3] if normuon else [None, None, None]
            assert case["normuon_v"] == expected_v  # NorMuon rows are global rows
            assert case["codebook_equal"]
            assert case["global_step"] == 3


@pytest.mark.parametrize("schedule", ["standard", "tuned4"])
def test_distributed_equals_exact_bitwise(world: ScenarioWorld, schedule: str) -> None:
    for rank, result in enumerate(world[f"dist_{schedule}"]):
        assert result["equal"] == [True, True, True]
        assert result["moved"]
        assert result["oracle_diff"] <= 1e-5
        assert result["ns_steps"] == (1 if schedule == "standard" else 4)
        assert result["owned"] == [i for i in range(len(SHAPES5)) if i % WORLD == rank]
        assert result["owner_state_equal"] == [True] * len(result["owned"])
        assert result["non_owner_keys"] == ["period"]  # a non-owner keeps only {period}
        assert result["global_step"] == (3, 3)


def test_empty_shard_owner_computes_and_matches_exact(world: ScenarioWorld) -> None:
    owner = world["dist_standard"][1]  # (1, 8) is index 1 of 5: owned by rank 1
    assert owner["local_rows"][1] == 0
    assert 1 in owner["owned"]
    assert owner["owned_steps"][1] == 3
    assert owner["owned_numel"][1] == 8  # the full (1, 8) momentum lives on the empty shard
    assert owner["owner_state_equal"] == [True] * len(owner["owned"])
    for result in world["dist_standard"]:
        assert result["equal"] == [True, True, True]


def test_fluctuating_active_set_moves_no_owner_and_resets_no_momentum(
    world: ScenarioWorld,
) -> None:
    expected_owners = [(i, i % WORLD) for i in range(len(SHAPES5))]
    steps = {0: 3, 1: 4, 2: 3, 3: 4, 4: 4}  # item 0 idle at step 1, item 2 at step 2
    for rank, result in enumerate(world["fluctuating"]):
        owned = [i for i in range(len(SHAPES5)) if i % WORLD == rank]
        assert result["owners"] == [expected_owners] * 4
        assert result["placements"] == [owned] * 4
        assert result["idle_entries_kept"] == [True, True]
        assert result["owned_steps"] == {i: steps[i] for i in owned}
        assert result["owner_state_equal"] == [True] * len(owned)
        assert result["equal"] == [True] * 4
        assert result["oracle_diff"] <= 1e-5
        assert result["global_step"] == 4


def test_approx_with_an_empty_shard_is_finite_local_and_differs_from_exact(
    world: ScenarioWorld,
) -> None:
    for result in world["approx"]:
        assert result["finite"]
        assert result["moved"]
        assert result["diff_from_exact"] > 1e-6
        assert result["codes_numel"] == result["local_numel"]  # local state = shard numel
        assert result["elapsed"] < DEADLINE_S
        assert result["global_step"] == 3
    empty = world["approx"][1]
    assert empty["local_numel"][2] == 0
    assert empty["keys"][2] == ["period"]  # an empty shard gets no state


def test_approx_shards_draw_by_their_place_in_the_whole_matrix(world: ScenarioWorld) -> None:
    # Each shard drew by its local element index, so identical halves on the two ranks were
    # rounded by the same draws: stochastic rounding was correlated across ranks.
    first, second = (result["codes"] for result in world["approx_stochastic"])
    assert len(first) == len(second) == 8
    assert first != second


@pytest.mark.smoke
def test_distributed_save_is_collective_consolidated_and_resumes_at_world_two(
    world: ScenarioWorld,
) -> None:
    results = world["checkpoint"]
    for rank, result in enumerate(results):
        assert result["elapsed"] < DEADLINE_S
        assert result["unchanged"] == []  # saving mutates nothing (state stays on owners)
        assert result["manifest"] == mt.expected_manifest(SHAPES5, WORLD)
        assert "muon_distributed" in result["extras_keys"]
        assert result["mirrored"]
        owned = [i for i in range(len(SHAPES5)) if i % WORLD == rank]
        assert result["live_owned"] == owned
        assert result["saved_owner_equal"] == [True] * len(owned)
        assert result["resumed_owned"] == owned
        assert result["resumed_owner_equal"]
        assert result["resumed_step"] == 4
        assert result["bitwise"]
        assert result["oracle_diff"] <= 1e-3
    # Gathered, every rank holds the owner's entries: identical content everywhere.
    assert results[0]["digests"] == results[1]["digests"]
    assert sorted(results[0]["digests"]) == list(range(len(SHAPES5)))


def test_distributed_save_presents_one_block_per_row_matrices_as_rows(
    world: ScenarioWorld,
) -> None:
    """(6, 8) has a row per block and rows on both ranks: each rank saves its 3 rows as DTensor
    rows (half the state); the others (searched periods, a one-row matrix) stay full."""
    for result in world["checkpoint"]:
        rows = result["rows"]
        assert rows[4] == {
            "momentum_codes": ("rows", 3, 6, 3),
            "momentum_scale": ("rows", 3, 6, 3),
        }
        for index in (0, 1, 2, 3):
            assert sorted(rows[index]) == ["momentum_codes", "momentum_scale"]
            assert all(form[0] == "full" for form in rows[index].values())


def test_distributed_save_resumes_in_one_process_without_torch_distributed(
    world: ScenarioWorld,
) -> None:
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    blob = world["checkpoint"][0]["blob"]
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    sd = torch.load(io.BytesIO(saved["payload"]), weights_only=True)
    params, optimizer = mt.oracle(saved["saved"], sharded_mode="distributed")
    optimizer.load_state_dict(sd)
    assert optimizer.global_step == 2
    assert all(optimizer.state[p]["step"] == 2 for p in params)  # every entry kept (no owners)
    for step in range(2, 4):
        mt.assign_plain(params, mt.grads(SHAPES5, 13, step))
        optimizer.step()
    oracle_params, oracle = mt.oracle(mt.fulls(SHAPES5, 9))
    for step in range(4):
        mt.assign_plain(oracle_params, mt.grads(SHAPES5, 13, step))
        oracle.step()
    resumed = [p.detach() for p in params]
    assert mt.max_diff(resumed, [p.detach() for p in oracle_params]) <= 1e-3
    assert mt.max_diff(resumed, saved["final"]) <= 1e-3
    assert mt.max_diff(resumed, saved["saved"]) > 1e-3  # it stepped


def test_approx_rank_local_files_are_refused_on_every_rank(world: ScenarioWorld) -> None:
    for rank, result in enumerate(world["rank_local"]):
        assert result["rank_local"]
        swapped = result["swapped"]  # every rank loads the other rank's file
        assert swapped["error"].startswith(
            f"DistributedStepError: GefenMuon load validation failed on local rank {rank}: "
            "GefenMuon checkpoint: rank-local checkpoint topology differs: rank (rank-local"
        )
        assert swapped["cause"].startswith(
            "ValueError: GefenMuon checkpoint: rank-local checkpoint topology differs: rank ("
        )
        steps = result["steps"]  # own files, saved at different steps
        assert steps["error"] == (
            "GroupAgreementError: GefenMuon rank-local checkpoint differs across "
            "process-group members: tag"
        )
        for attempt in (swapped, steps):
            assert attempt["changes"] == []
            assert attempt["elapsed"] < DEADLINE_S
        assert result["loaded_step"] == 3
        assert result["trained"] == (4, True)


def test_checkpoint_binding_with_another_handle_is_refused_and_the_right_one_accepted(
    world: ScenarioWorld,
) -> None:
    cause = "BindingError: checkpoint_binding carries another process-group handle object"
    for rank, result in enumerate(world["binding"]):
        assert result["handles_differ"]
        for phase, attempt in (
            ("state dict preflight", result["save"]),
            ("load validation", result["load"]),
        ):
            assert attempt["error"] == (
                f"DistributedStepError: GefenMuon {phase} failed on local rank {rank}: "
                + cause.removeprefix("BindingError: ")
            )
            assert attempt["cause"] == cause
            assert attempt["changes"] == []
            assert attempt["elapsed"] < DEADLINE_S
        assert result["same_manifest"]
        assert result["save_votes"] == ["state dict preflight"]  # one vote checks the binding too
        assert result["trained"] == (2, True)


def test_distributed_checkpoint_without_top_level_marker_resumes_from_group_copies(
    world: ScenarioWorld,
) -> None:
    """The manifest is written at the top level only (docs/core.md §8.1: DCP neither saves nor
    asks for it); group copies alone resume, and so does a file with it in the groups too."""
    for rank, result in enumerate(world["group_copies"]):
        assert not result["in_groups"]
        assert result["legacy_error"] is None
        assert result["error"] is None
        assert result["elapsed"] < DEADLINE_S
        assert result["restored"] == (2, True)
        assert result["owned"] == [i for i in range(len(SHAPES5)) if i % WORLD == rank]
        assert result["equal"] == [True, True]


def test_an_empty_matrix_takes_no_owner_slot_so_a_distributed_save_resumes(
    world: ScenarioWorld,
) -> None:
    """The step skips an empty matrix; the checkpoint used to count it, so owners disagreed:
    the save held pristine entries and its own reload was refused."""
    for result in world["empty_matrix"]:
        distributed, exact = result["distributed"], result["exact"]
        assert distributed["owners"] == [(1, 0, True), (2, 1, True), (3, 0, True)]
        assert distributed["error"] is None
        assert distributed["equal"] == [True, True]
        # an exact file resumes into distributed groups too (docs/muon.md §8)
        assert exact["error"] is None
        assert exact["equal"] == [True, True]


@pytest.mark.parametrize("edited", ["exact", "distributed"])
def test_a_mode_edited_once_state_exists_is_refused_and_a_load_switches_it(
    world: ScenarioWorld, edited: str
) -> None:
    # The edit was taken: the other mode stepped from missing or stale momentum (the full
    # parameters drifted from one process by a whole update, 0.0093 then 0.0175), and exact
    # state then differed between the ranks.
    start = "exact" if edited == "distributed" else "distributed"
    for result in world[f"edit_to_{edited}"]:
        assert result["refused"] is not None
        assert f"sharded_mode changed from {start!r} to {edited!r}" in result["refused"]
        assert result["unchanged"] == []
        assert result["mode"] == edited  # the load keeps the live mode (docs/muon.md §8)
        assert result["oracle_diff"] <= 1e-5
