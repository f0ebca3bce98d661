"""A ``"distributed"`` GefenMuon saves each one-block-per-row matrix as its rows (docs/muon.md
§8.1) and gathers them back after the load vote, on a 2-rank Gloo world with FSDP2.

The state dict holds a 1/world share of that state on each rank; a load of it into a freshly
built optimizer resumes bit-identically; a file whose rows do not fit is refused on every rank
with nothing changed, whether one rank sees it before the vote or all see it after the gather,
and the optimizer trains afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gefen.dist.testing import gloo_required, run_scenarios
from gefen.muon import testing as mt

pytestmark = [pytest.mark.multirank, gloo_required()]

WORLD = 2
SHAPES = [(6, 8), (8, 12), (4, 16)]  # one block per row, rows on both ranks


def _trained(steps: range, seed: int = 3, codec: str = "codebook8") -> tuple[Any, Any]:
    model = mt.sharded(mt.shared_mesh(WORLD), mt.fulls(SHAPES, 1))
    optimizer = mt.sharded_muon(model, sharded_mode="distributed", momentum_codec=codec)
    _train(model, optimizer, steps, seed)
    return model, optimizer


def _train(model: Any, optimizer: Any, steps: range, seed: int = 3) -> None:
    for step in steps:
        mt.assign_sharded(model, mt.grads(SHAPES, seed, step))
        optimizer.step()


def _local_bytes(value: Any) -> int:
    if hasattr(value, "to_local"):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_local_bytes(item) for item in value.values())
    return 0


def scenario_round_trip(rank: int, world: int, codec: str = "codebook8") -> dict[str, Any]:
    from gefen.core.testing import gathered

    model, optimizer = _trained(range(3), codec=codec)
    sd = optimizer.state_dict()
    full = gathered(sd)
    fresh_model = mt.sharded(mt.shared_mesh(world), mt.full_params(model))
    fresh = mt.sharded_muon(fresh_model, sharded_mode="distributed", momentum_codec=codec)
    fresh.load_state_dict(mt.round_trip(sd)[1])
    owned = mt.owned(fresh, fresh_model)
    pairs = list(zip(model.parameters(), fresh_model.parameters(), strict=True))
    kept = [mt.same_entry(fresh.state[b], optimizer.state[a]) for a, b in pairs]
    others = sorted({k for i, (_, b) in enumerate(pairs) if i not in owned for k in fresh.state[b]})
    _train(model, optimizer, range(3, 5))
    _train(fresh_model, fresh, range(3, 5))
    return {
        "bytes": (_local_bytes(sd["state"]), _local_bytes(full["state"])),
        "owned": owned,
        "owner_kept": [kept[i] for i in owned],
        "non_owner_keys": others,
        "bitwise": mt.bits_equal(mt.full_params(model), mt.full_params(fresh_model)),
        "code_shapes": [
            tuple(full["state"][i]["momentum_codes"].shape) for i in range(len(SHAPES))
        ],
    }


def _local_rows(value: Any, local: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _cut_on_rank_one(sd: dict[str, Any], rank: int) -> None:
    codes = sd["state"][0]["momentum_codes"]
    if rank == 1:
        sd["state"][0]["momentum_codes"] = _local_rows(codes, codes.to_local()[:-1].clone())


def _replicated(sd: dict[str, Any], rank: int) -> None:
    from torch.distributed.tensor import Replicate

    codes = sd["state"][0]["momentum_codes"]
    sd["state"][0]["momentum_codes"] = codes.redistribute(placements=[Replicate()])


def _nan_scale_on_rank_one(sd: dict[str, Any], rank: int) -> None:
    scale = sd["state"][1]["momentum_scale"]
    local = scale.to_local().clone()
    if rank == 1:
        local[0, 0] = float("nan")
    sd["state"][1]["momentum_scale"] = _local_rows(scale, local)


def _step_past_global(sd: dict[str, Any], rank: int) -> None:
    sd["state"][2]["step"] = 99


def _int16_codes(sd: dict[str, Any], rank: int) -> None:
    # Gloo cannot gather int16: the dtype must be refused before the rows travel.
    sd["state"][1]["momentum_codes"] = sd["state"][1]["momentum_codes"].to(torch.int16)


def _manifest_items(value: Any) -> list[dict[str, Any]]:
    """Every parameter record of the consolidation manifest, wherever the file keeps it."""
    if isinstance(value, dict):
        found = [value] if "state_keys" in value else []
        return found + [item for child in value.values() for item in _manifest_items(child)]
    if isinstance(value, list):
        return [item for child in value for item in _manifest_items(child)]
    return []


def _extra_rows(sd: dict[str, Any], rank: int) -> None:
    # An extra DTensor key, listed in the manifest too, so the rows check itself must see it.
    sd["state"][1]["momentum_extra"] = sd["state"][1]["momentum_codes"]
    (item,) = [item for item in _manifest_items(sd) if item["saved_id"] == 1]
    item["state_keys"] = sorted([*item["state_keys"], "momentum_extra"])


MISFITS = {
    "cut": _cut_on_rank_one,
    "extra": _extra_rows,
    "dtype": _int16_codes,
    "replicated": _replicated,
    "nan": _nan_scale_on_rank_one,
    "step": _step_past_global,
}


def scenario_misfits(rank: int, world: int) -> dict[str, Any]:
    from gefen.core.testing import attempt

    _, source = _trained(range(3))
    saved = source.state_dict()
    model, target = _trained(range(2), seed=5)
    outcomes: dict[str, Any] = {}
    for name, tamper in MISFITS.items():
        sd = mt.round_trip(saved)[1]
        tamper(sd, rank)
        before = mt.snapshot(target)
        outcome = attempt(lambda sd=sd: target.load_state_dict(sd), value=False)
        outcome["changes"] = mt.changes(target, before)
        outcomes[name] = outcome
    previous = mt.full_params(model)
    _train(model, target, range(2, 3), seed=5)
    moved = mt.max_diff(previous, mt.full_params(model)) > 0
    return {"misfits": outcomes, "trained": (target.global_step, moved)}


@pytest.fixture(scope="module")
def world() -> Any:
    scenarios = [
        ("round_trip", scenario_round_trip, ()),
        ("round_trip_q4", scenario_round_trip, ("codebook4",)),
        ("misfits", scenario_misfits, ()),
    ]
    return run_scenarios(scenarios, WORLD, rank_deadline_s=240.0)


@pytest.mark.parametrize("run", ["round_trip", "round_trip_q4"])
def test_a_save_holds_half_the_state_on_each_rank(world: Any, run: str) -> None:
    for presented, full in (result["bytes"] for result in world[run]):
        assert presented * WORLD == full


def test_codebook4_rows_hold_two_codes_per_byte(world: Any) -> None:
    expected = [(rows, cols // 2) for rows, cols in SHAPES]
    assert [result["code_shapes"] for result in world["round_trip_q4"]] == [expected] * WORLD
    eight = [result["bytes"][1] for result in world["round_trip"]]
    four = [result["bytes"][1] for result in world["round_trip_q4"]]
    assert all(q4 < 0.75 * q8 for q4, q8 in zip(four, eight, strict=True))


@pytest.mark.parametrize("run", ["round_trip", "round_trip_q4"])
def test_the_rows_load_into_a_fresh_optimizer_and_resume_bit_identically(
    world: Any, run: str
) -> None:
    for rank, result in enumerate(world[run]):
        assert result["owned"] == [i for i in range(len(SHAPES)) if i % WORLD == rank]
        assert result["owner_kept"] == [True] * len(result["owned"])
        assert result["non_owner_keys"] == ["period"]
        assert result["bitwise"]


LABEL = "GefenMuon checkpoint: entry "
FAILED_HERE = "DistributedStepError: GefenMuon load validation failed on local rank {rank}: "
FAILED_THERE = (
    "DistributedStepError: GefenMuon load validation failed on another process-group member"
)


@pytest.mark.parametrize(
    ("name", "failing", "rule"),
    [
        ("cut", (1,), "'momentum_codes' must hold the parameter's 6 rows (3 on this rank)"),
        ("replicated", (0, 1), "'momentum_codes' must be sharded Shard(0) on its parameter's"),
        ("nan", (0, 1), "'momentum_scale' must be finite"),
        ("dtype", (0, 1), "'momentum_codes' must be torch.uint8, got torch.int16"),
        ("extra", (0, 1), "unexpected key 'momentum_extra'"),
        ("step", (0, 1), "'step' 99 exceeds 3"),
    ],
)
def test_rows_that_do_not_fit_are_refused_on_every_rank(
    world: Any, name: str, failing: tuple[int, ...], rule: str
) -> None:
    for rank, result in enumerate(world["misfits"]):
        outcome = result["misfits"][name]
        assert outcome["changes"] == [], name
        if rank in failing:
            assert outcome["error"].startswith(FAILED_HERE.format(rank=rank) + LABEL), outcome
            assert rule in outcome["error"]
            assert outcome["cause"].startswith("ValueError: " + LABEL)
        else:
            assert outcome["error"].startswith(FAILED_THERE), outcome
        assert result["trained"] == (3, True)
