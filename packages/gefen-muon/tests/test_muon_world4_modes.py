"""GefenMuon's sharded modes on a 4-rank Gloo world (20-muon.md §7, §8, §11 and the matching
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

import hashlib
import io
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed

pytestmark = [pytest.mark.multirank, gloo_required()]

WORLD = 4
DEADLINE_S = 10.0  # liveness bound of one collective checkpoint operation
OPTIONS: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "ns_steps": 1, "fused": False}
SHAPES5 = [(8, 6), (1, 8), (5, 4), (1, 4), (6, 8)]  # (1, 8): only rank 0 holds a row
CODEBOOK8_KEYS = ["momentum_codes", "momentum_scale", "period", "step"]


# --- helpers (run inside the ranks and, for the one-process checks, in the parent) ----------


def _fulls(shapes: Sequence[tuple[int, int]], seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _grads(shapes: Sequence[tuple[int, int]], seed: int, step: int) -> list[Tensor]:
    return _fulls(shapes, 1000 * seed + step)


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _sharded(mesh: Any, fulls: Sequence[Tensor]) -> nn.Module:
    """Bias-free Linear layers holding ``fulls``, each ``fully_shard``-ed on ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    layers = [nn.Linear(full.shape[1], full.shape[0], bias=False) for full in fulls]
    with torch.no_grad():
        for layer, full in zip(layers, fulls, strict=True):
            layer.weight.copy_(full)
    model = nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _muon(model: nn.Module, **overrides: Any) -> Any:
    from gefen.muon import GefenMuon

    return GefenMuon(model.named_parameters(), **{**OPTIONS, **overrides})


def _oracle(fulls: Sequence[Tensor], **overrides: Any) -> tuple[list[nn.Parameter], Any]:
    from gefen.muon import GefenMuon

    params = [nn.Parameter(full.clone()) for full in fulls]
    return params, GefenMuon(params, **{**OPTIONS, **overrides})


def _assign(model: nn.Module, grads: Sequence[Tensor], skip: Iterable[int] = ()) -> None:
    """Shard(0) gradients on every rank; ``skip`` items are then cleared (§11)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    absent = set(skip)
    for index, (param, grad) in enumerate(zip(model.parameters(), grads, strict=True)):
        param.grad = distribute_tensor(grad.clone(), param.device_mesh, [Shard(0)])
        if index in absent:
            param.grad = None


def _assign_plain(
    params: Sequence[nn.Parameter], grads: Sequence[Tensor], skip: Iterable[int] = ()
) -> None:
    absent = set(skip)
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        param.grad = None if index in absent else grad.clone()


def _full(model: nn.Module) -> list[Tensor]:
    """The logical parameters (collective: every rank calls it)."""
    return [param.full_tensor().detach().clone() for param in model.parameters()]


def _max_diff(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def _bits_equal(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def _same(a: object, b: object) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


def _same_entry(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(_same(a[key], b[key]) for key in a)


def _digest(entry: dict[str, Any]) -> str:
    """A content digest of one state entry (tensors by dtype, shape and bytes)."""
    sha = hashlib.sha256()
    for key in sorted(entry):
        value = entry[key]
        sha.update(key.encode())
        if isinstance(value, Tensor):
            sha.update(f"{value.dtype}{tuple(value.shape)}".encode())
            sha.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            sha.update(repr(value).encode())
    return sha.hexdigest()


def _owned(optimizer: Any, model: nn.Module) -> list[int]:
    return [i for i, p in enumerate(model.parameters()) if "step" in optimizer.state[p]]


def _snapshot(optimizer: Any) -> Any:
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot

    return deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)


def _changes(optimizer: Any, before: Any) -> list[str]:
    from gefen.dist.testing import snapshot_diff

    return snapshot_diff(before, _snapshot(optimizer))


def _round_trip(sd: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    payload = buffer.getvalue()
    return payload, torch.load(io.BytesIO(payload), weights_only=True)


def _expected_manifest(shapes: Sequence[tuple[int, int]], world: int) -> dict[str, Any]:
    params = [
        {
            "saved_id": index,
            "name": f"{index}.weight",
            "shape": list(shape),
            "owner": index % world,
            "state_keys": CODEBOOK8_KEYS,
            "initialized": True,
        }
        for index, shape in enumerate(shapes)
    ]
    return {
        "version": 1,
        "ownership": "stable_index_mod_world",
        "consolidated": True,
        "groups": [{"world_size": world, "params": params}],
    }


# --- scenarios ---------------------------------------------------------------------------------


def scenario_distributed_equals_exact(rank: int, world: int, schedule: str) -> dict[str, Any]:
    mesh = _mesh(world)
    extra: dict[str, Any] = (
        {"ns_schedule": "standard", "ns_steps": 1}
        if schedule == "standard"
        else {"ns_schedule": schedule}
    )
    fulls = _fulls(SHAPES5, 3)
    exact_model, dist_model = _sharded(mesh, fulls), _sharded(mesh, fulls)
    exact = _muon(exact_model, sharded_mode="exact", **extra)
    distributed = _muon(dist_model, sharded_mode="distributed", **extra)
    oracle_params, oracle = _oracle(fulls, **extra)
    equal: list[bool] = []
    for step in range(3):
        grads = _grads(SHAPES5, 11, step)
        _assign(exact_model, grads)
        _assign(dist_model, grads)
        _assign_plain(oracle_params, grads)
        exact.step()
        distributed.step()
        oracle.step()
        equal.append(_bits_equal(_full(exact_model), _full(dist_model)))
    final = _full(dist_model)
    pairs = list(zip(exact_model.parameters(), dist_model.parameters(), strict=True))
    owned = _owned(distributed, dist_model)
    return {
        "equal": equal,
        "moved": _max_diff(final, fulls) > 1e-3,
        "oracle_diff": _max_diff(final, [p.detach() for p in oracle_params]),
        "owned": owned,
        "owner_state_equal": [
            _same_entry(distributed.state[d], exact.state[e])
            for i, (e, d) in enumerate(pairs)
            if i in owned
        ],
        "non_owner_keys": sorted(
            {
                key
                for i, (_, d) in enumerate(pairs)
                if i not in owned
                for key in distributed.state[d]
            }
        ),
        "local_rows": [int(d.to_local().shape[0]) for _, d in pairs],
        "owned_steps": {
            i: distributed.state[d]["step"] for i, (_, d) in enumerate(pairs) if i in owned
        },
        "owned_numel": {
            i: int(distributed.state[d]["momentum_codes"].numel())
            for i, (_, d) in enumerate(pairs)
            if i in owned
        },
        "ns_steps": distributed.param_groups[0]["ns_steps"],
        "global_step": (exact.global_step, distributed.global_step),
    }


def scenario_world2_save_resumes_at_world4(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    pairs = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pair", "member"))
    pair_mesh = pairs["member"]  # ranks {0, 1} or {2, 3}: a 2-rank process group
    fulls = _fulls(SHAPES5, 59)
    pair_model = _sharded(pair_mesh, fulls)
    pair = _muon(pair_model, sharded_mode="distributed")
    for step in range(2):
        _assign(pair_model, _grads(SHAPES5, 61, step))
        pair.step()
    before = _snapshot(pair)
    save_s, save_error, sd = timed(pair.state_dict)
    assert save_error is None, save_error
    assert sd is not None
    save_changes = _changes(pair, before)
    saved_params = _full(pair_model)
    _, loaded = _round_trip(sd)
    model = _sharded(_mesh(world), saved_params)
    optimizer = _muon(model, sharded_mode="distributed")
    load_s, load_error, _ = timed(lambda: optimizer.load_state_dict(loaded))
    owned = _owned(optimizer, model)
    params = list(model.parameters())
    owner_entries_equal = [
        _same_entry(optimizer.state[params[i]], loaded["state"][i]) for i in owned
    ]
    non_owner_keys = sorted(
        {key for i, p in enumerate(params) if i not in owned for key in optimizer.state[p]}
    )
    loaded_step = optimizer.global_step
    for step in range(2, 4):
        grads = _grads(SHAPES5, 61, step)
        _assign(pair_model, grads)
        _assign(model, grads)
        pair.step()
        optimizer.step()
    final = _full(model)
    oracle_params, oracle = _oracle(fulls)
    for step in range(4):
        _assign_plain(oracle_params, _grads(SHAPES5, 61, step))
        oracle.step()
    return {
        "pair_ranks": [int(r) for r in pair_mesh.mesh.flatten().tolist()],
        "saved_manifest": sd["gefen"]["muon_distributed"],
        "save": (save_s, save_changes),
        "digests": {i: _digest(entry) for i, entry in sd["state"].items()},
        "load": (load_s, load_error),
        "loaded_step": loaded_step,
        "owned": owned,
        "owner_entries_equal": owner_entries_equal,
        "non_owner_keys": non_owner_keys,
        "local_rows": [int(p.to_local().shape[0]) for p in params],
        "oracle_diff": _max_diff(final, [p.detach() for p in oracle_params]),
        "pair_diff": _max_diff(final, _full(pair_model)),
        "moved": _max_diff(final, saved_params) > 1e-3,
        "manifest": optimizer.state_dict()["gefen"]["muon_distributed"],
        "global_step": optimizer.global_step,
    }


SCENARIOS = [
    ("dist_standard", scenario_distributed_equals_exact, ("standard",)),
    ("dist_tuned4", scenario_distributed_equals_exact, ("tuned4",)),
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
        assert result["saved_manifest"] == _expected_manifest(SHAPES5, 2)
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
        assert result["manifest"] == _expected_manifest(SHAPES5, WORLD)
        assert result["global_step"] == 4
    # Both pairs saved the same consolidated content, and every member holds every entry.
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert sorted(results[0]["digests"]) == list(range(len(SHAPES5)))
