"""GefenMuon's sharded modes on a 4-rank Gloo world (docs/muon.md §7, §8, §11 and the matching
§12 edge cases): ``"distributed"`` equals ``"exact"`` bitwise at world 4, and a distributed
checkpoint saved on a 2-rank process group resumes at world 4.

The world-2 save is made inside this world: ``init_device_mesh("cpu", (2, 2))`` gives two
disjoint 1-D meshes of two ranks each ({0, 1} and {2, 3}); each pair shards the same model with
FSDP2, steps in ``"distributed"`` mode and saves collectively, so its checkpoint is a genuine
consolidated save with ``world_size`` 2. Every rank then builds a 4-rank mesh and resumes from
it. Kept small: four ranks share two cores. Scenario functions are module-level so the spawned
children can load them by reference; they return plain data.
"""

from __future__ import annotations

from typing import Any

import pytest

from gefen.core.testing import format1_state_dict, gathered
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed
from gefen.muon import testing as mt

pytestmark = [pytest.mark.multirank, gloo_required()]

WORLD = 4
DEADLINE_S = 10.0  # liveness bound of one collective checkpoint operation
SHAPES5 = [(8, 6), (1, 8), (5, 4), (1, 4), (6, 8)]  # (1, 8): only rank 0 holds a row


# --- scenarios ---------------------------------------------------------------------------------


def scenario_world2_save_resumes_at_world4(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    pairs = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pair", "member"))
    pair_mesh = pairs["member"]  # ranks {0, 1} or {2, 3}: a 2-rank process group
    fulls = mt.fulls(SHAPES5, 59)
    pair_model = mt.sharded(pair_mesh, fulls)
    pair = mt.sharded_muon(pair_model, sharded_mode="distributed")
    for step in range(2):
        mt.assign_sharded(pair_model, mt.grads(SHAPES5, 61, step))
        pair.step()
    before = mt.snapshot(pair)
    save_s, save_error, presented = timed(pair.state_dict)
    assert save_error is None, save_error
    assert presented is not None
    save_changes = mt.changes(pair, before)
    # A world-2 pair's rows gathered (as DCP's full_state_dict does): a file for any world size.
    sd = gathered(presented)
    digests = {i: mt.digest(entry) for i, entry in sd["state"].items()}
    saved_params = mt.full_params(pair_model)
    _, loaded = mt.round_trip(sd)
    model = mt.sharded(mt.mesh_1d(world), saved_params)
    optimizer = mt.sharded_muon(model, sharded_mode="distributed")
    load_s, load_error, _ = timed(lambda: optimizer.load_state_dict(loaded))
    owned = mt.owned(optimizer, model)
    params = list(model.parameters())
    live_forms = format1_state_dict(optimizer, loaded)["state"]  # format 2 read back
    owner_entries_equal = [mt.same_entry(optimizer.state[params[i]], live_forms[i]) for i in owned]
    non_owner_keys = sorted(
        {key for i, p in enumerate(params) if i not in owned for key in optimizer.state[p]}
    )
    loaded_step = optimizer.global_step
    for step in range(2, 4):
        grads = mt.grads(SHAPES5, 61, step)
        mt.assign_sharded(pair_model, grads)
        mt.assign_sharded(model, grads)
        pair.step()
        optimizer.step()
    final = mt.full_params(model)
    oracle_params, oracle = mt.oracle(fulls)
    for step in range(4):
        mt.assign_plain(oracle_params, mt.grads(SHAPES5, 61, step))
        oracle.step()
    return {
        "pair_ranks": [int(r) for r in pair_mesh.mesh.flatten().tolist()],
        "saved_manifest": sd["gefen"]["muon_distributed"],
        "save": (save_s, save_changes),
        "digests": digests,
        "load": (load_s, load_error),
        "loaded_step": loaded_step,
        "owned": owned,
        "owner_entries_equal": owner_entries_equal,
        "non_owner_keys": non_owner_keys,
        "local_rows": [int(p.to_local().shape[0]) for p in params],
        "oracle_diff": mt.max_diff(final, [p.detach() for p in oracle_params]),
        "pair_diff": mt.max_diff(final, mt.full_params(pair_model)),
        "moved": mt.max_diff(final, saved_params) > 1e-3,
        "manifest": optimizer.state_dict()["gefen"]["muon_distributed"],
        "global_step": optimizer.global_step,
    }


SCENARIOS = [
    ("dist_standard", mt.scenario_distributed_equals_exact, ("standard",)),
    ("dist_tuned4", mt.scenario_distributed_equals_exact, ("tuned4",)),
    ("resume", scenario_world2_save_resumes_at_world4, ()),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, WORLD, rank_deadline_s=560.0, pg_timeout_s=120.0)


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("schedule", ["standard", "tuned4"])
def test_distributed_equals_exact_bitwise_at_world_four(
    world: ScenarioWorld, schedule: str
) -> None:
    results = world[f"dist_{schedule}"]
    assert len(results) == WORLD
    for rank, result in enumerate(results):
        assert result["equal"] == [True, True, True]
        assert result["moved"]
        assert result["oracle_diff"] <= 1e-5
        assert result["ns_steps"] == (1 if schedule == "standard" else 4)
        owned = [i for i in range(len(SHAPES5)) if i % WORLD == rank]
        assert result["owned"] == owned
        assert result["owner_state_equal"] == [True] * len(owned)
        assert result["non_owner_keys"] == ["period"]
        assert result["global_step"] == (3, 3)
    # (1, 8) at index 1 is owned by rank 1, whose shard is empty: it still computes.
    assert results[1]["local_rows"][1] == 0
    assert results[1]["owned_numel"][1] == 8
    assert results[1]["owned_steps"][1] == 3


@pytest.mark.smoke
def test_world_two_distributed_save_resumes_at_world_four(world: ScenarioWorld) -> None:
    results = world["resume"]
    assert [r["pair_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for rank, result in enumerate(results):
        assert result["saved_manifest"] == mt.expected_manifest(SHAPES5, 2)
        save_s, save_changes = result["save"]
        assert save_s < DEADLINE_S
        assert save_changes == []
        load_s, load_error = result["load"]
        assert load_error is None
        assert load_s < DEADLINE_S
        assert result["loaded_step"] == 2
        # Staging keeps exactly the entries this rank owns under the live world size.
        owned = [i for i in range(len(SHAPES5)) if i % WORLD == rank]
        assert result["owned"] == owned
        assert result["owner_entries_equal"] == [True] * len(owned)
        assert result["non_owner_keys"] == ["period"]
        assert result["moved"]
        assert result["oracle_diff"] <= 1e-3
        assert result["pair_diff"] <= 1e-3  # agrees with the world-2 run continued in place
        assert result["manifest"] == mt.expected_manifest(SHAPES5, WORLD)
        assert result["global_step"] == 4
    # Both pairs saved the same consolidated content, and every member holds every entry.
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert sorted(results[0]["digests"]) == list(range(len(SHAPES5)))
