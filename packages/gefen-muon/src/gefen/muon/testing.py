"""Test support for GefenMuon's sharded-mode scenarios (docs/muon.md §7, §8, §11).

Helpers shared by the multi-rank test modules: seeded full matrices, FSDP2-sharded bias-free
``nn.Linear`` models on a 1-D CPU mesh, ``Shard(0)`` gradient assignment, a one-process oracle
built with the same options, exact comparisons of tensors and state entries, deep snapshots and
the expected distributed-checkpoint manifest. ``torch.distributed`` is imported lazily inside the
functions that need it, so importing this module never requires a process group.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

__all__ = [
    "CODEBOOK8_KEYS",
    "MIXED_SHAPES",
    "OPTION_KEYS",
    "SCENARIO_OPTIONS",
    "assign_plain",
    "assign_sharded",
    "bits_equal",
    "changes",
    "digest",
    "expected_manifest",
    "full_params",
    "fulls",
    "grads",
    "max_diff",
    "mesh_1d",
    "oracle",
    "owned",
    "round_trip",
    "same",
    "same_entry",
    "scenario_distributed_equals_exact",
    "sharded",
    "sharded_muon",
    "shared_mesh",
    "snapshot",
]

SCENARIO_OPTIONS: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "ns_steps": 1, "fused": False}
"""The GefenMuon options every sharded scenario and its oracle start from."""

MIXED_SHAPES = [(8, 6), (1, 8), (5, 4), (1, 4), (6, 8)]
"""Five matrices; (1, 8) at index 1 leaves some ranks an empty shard."""

OPTION_KEYS: frozenset[str] = frozenset(
    {
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "ns_steps",
        "ns_schedule",
        "eps",
        "adjust_lr_fn",
        "momentum_codec",
        "sharded_mode",
        "normuon",
        "normuon_beta2",
        "normuon_eps",
        "fused",
        "stochastic_round",
        "deterministic",
        "check_finite",
    }
)
"""Every GefenMuon option: the keys of ``defaults`` and of each param group besides ``params``."""

CODEBOOK8_KEYS = ["matrix_cols", "momentum_codes", "momentum_scale", "period", "step"]
"""The state keys of one initialized 8-bit-codebook entry, in manifest order."""


def fulls(shapes: Sequence[tuple[int, int]], seed: int) -> list[Tensor]:
    """Seeded standard-normal matrices of ``shapes``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def grads(shapes: Sequence[tuple[int, int]], seed: int, step: int) -> list[Tensor]:
    """The full gradients of ``step`` (the same on every rank)."""
    return fulls(shapes, 1000 * seed + step)


def mesh_1d(world: int) -> Any:
    """A 1-D CPU device mesh over ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


_SHARED_MESHES: dict[int, Any] = {}


def shared_mesh(world: int = 2) -> Any:
    """One 1-D CPU mesh of ``world`` ranks per process (every new mesh creates new process
    groups), made on first use and reused by every later call."""
    if world not in _SHARED_MESHES:
        _SHARED_MESHES[world] = mesh_1d(world)
    return _SHARED_MESHES[world]


def sharded(mesh: Any, matrices: Sequence[Tensor]) -> nn.Module:
    """Bias-free Linear layers holding ``matrices``, each ``fully_shard``-ed on ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    layers = [nn.Linear(full.shape[1], full.shape[0], bias=False) for full in matrices]
    with torch.no_grad():
        for layer, full in zip(layers, matrices, strict=True):
            layer.weight.copy_(full)
    model = nn.Sequential(*layers)
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sharded_muon(model: nn.Module, **overrides: Any) -> Any:
    """GefenMuon over ``model``'s named parameters with ``SCENARIO_OPTIONS`` and ``overrides``."""
    from gefen.muon import GefenMuon

    return GefenMuon(model.named_parameters(), **{**SCENARIO_OPTIONS, **overrides})


def oracle(matrices: Sequence[Tensor], **overrides: Any) -> tuple[list[nn.Parameter], Any]:
    """One-process plain parameters holding ``matrices`` and a GefenMuon with the same options."""
    from gefen.muon import GefenMuon

    params = [nn.Parameter(full.clone()) for full in matrices]
    return params, GefenMuon(params, **{**SCENARIO_OPTIONS, **overrides})


def assign_sharded(model: nn.Module, gradients: Sequence[Tensor], skip: Iterable[int] = ()) -> None:
    """Gradients placed as their parameters (FSDP2's Shard(0), HSDP's (Replicate(), Shard(0)))
    on every rank; ``skip`` items are then cleared (§11)."""
    from torch.distributed.tensor import distribute_tensor

    absent = set(skip)
    for index, (param, grad) in enumerate(zip(model.parameters(), gradients, strict=True)):
        held: Any = cast(Any, param)  # a DTensor parameter after fully_shard
        param.grad = distribute_tensor(grad.clone(), held.device_mesh, held.placements)
        if index in absent:
            param.grad = None


def assign_plain(
    params: Sequence[nn.Parameter], gradients: Sequence[Tensor], skip: Iterable[int] = ()
) -> None:
    """Plain gradients (clones); ``skip`` items get none."""
    absent = set(skip)
    for index, (param, grad) in enumerate(zip(params, gradients, strict=True)):
        param.grad = None if index in absent else grad.clone()


def full_params(model: nn.Module) -> list[Tensor]:
    """The logical parameters (collective: every rank calls it)."""
    return [cast(Any, param).full_tensor().detach().clone() for param in model.parameters()]


def max_diff(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """The largest absolute elementwise difference over paired tensors."""
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def bits_equal(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """Whether paired tensors agree in dtype, shape and every element."""
    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def same(a: object, b: object) -> bool:
    """Exact equality: tensors by dtype, shape and values; anything else by type and ``==``."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


def same_entry(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two state entries have the same keys and exactly equal values."""
    return sorted(a) == sorted(b) and all(same(a[key], b[key]) for key in a)


def digest(entry: dict[str, Any]) -> str:
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


def owned(optimizer: Any, model: nn.Module) -> list[int]:
    """Indices of ``model``'s parameters whose state this rank holds."""
    return [i for i, p in enumerate(model.parameters()) if "step" in optimizer.state[p]]


def snapshot(optimizer: Any) -> Any:
    """A deep snapshot covering ``SNAPSHOT_ATTRIBUTES``."""
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot

    return deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)


def changes(optimizer: Any, before: Any) -> list[str]:
    """What differs between ``before`` and a fresh snapshot of ``optimizer``."""
    from gefen.dist.testing import snapshot_diff

    result: list[str] = snapshot_diff(before, snapshot(optimizer))
    return result


def round_trip(sd: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """``torch.save`` bytes of ``sd`` and their weights-only ``torch.load``."""
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    payload = buffer.getvalue()
    return payload, torch.load(io.BytesIO(payload), weights_only=True)


def expected_manifest(shapes: Sequence[tuple[int, int]], world: int) -> dict[str, Any]:
    """The consolidated manifest of initialized 8-bit entries owned by ``index % world``."""
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


def scenario_distributed_equals_exact(rank: int, world: int, schedule: str) -> dict[str, Any]:
    """``"distributed"`` against ``"exact"`` and the oracle over three steps of
    ``MIXED_SHAPES`` with the ``schedule`` Newton-Schulz options (a ``run_scenarios`` scenario)."""
    mesh = mesh_1d(world)
    extra: dict[str, Any] = (
        {"ns_schedule": "standard", "ns_steps": 1}
        if schedule == "standard"
        else {"ns_schedule": schedule}
    )
    start = fulls(MIXED_SHAPES, 3)
    exact_model, dist_model = sharded(mesh, start), sharded(mesh, start)
    exact = sharded_muon(exact_model, sharded_mode="exact", **extra)
    distributed = sharded_muon(dist_model, sharded_mode="distributed", **extra)
    oracle_params, reference = oracle(start, **extra)
    equal: list[bool] = []
    for step in range(3):
        step_grads = grads(MIXED_SHAPES, 11, step)
        assign_sharded(exact_model, step_grads)
        assign_sharded(dist_model, step_grads)
        assign_plain(oracle_params, step_grads)
        exact.step()
        distributed.step()
        reference.step()
        equal.append(bits_equal(full_params(exact_model), full_params(dist_model)))
    final = full_params(dist_model)
    pairs = list(zip(exact_model.parameters(), dist_model.parameters(), strict=True))
    mine = owned(distributed, dist_model)
    return {
        "equal": equal,
        "moved": max_diff(final, start) > 1e-3,
        "oracle_diff": max_diff(final, [p.detach() for p in oracle_params]),
        "owned": mine,
        "owner_state_equal": [
            same_entry(distributed.state[d], exact.state[e])
            for i, (e, d) in enumerate(pairs)
            if i in mine
        ],
        "non_owner_keys": sorted(
            {key for i, (_, d) in enumerate(pairs) if i not in mine for key in distributed.state[d]}
        ),
        "local_rows": [int(cast(Any, d).to_local().shape[0]) for _, d in pairs],
        "owned_steps": {
            i: distributed.state[d]["step"] for i, (_, d) in enumerate(pairs) if i in mine
        },
        "owned_numel": {
            i: int(distributed.state[d]["momentum_codes"].numel())
            for i, (_, d) in enumerate(pairs)
            if i in mine
        },
        "ns_steps": distributed.param_groups[0]["ns_steps"],
        "global_step": (exact.global_step, distributed.global_step),
    }
