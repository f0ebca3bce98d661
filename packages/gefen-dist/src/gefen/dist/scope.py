"""Channels, mesh content keys and the failure scope of a step (docs/dist.md §1, §4)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gefen.dist.backends import choose_collective_device
from gefen.dist.runtime import cuda_graph_capturing, distributed_ready

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Channel", "MeshKey", "collect_failure_scope", "mesh_key"]

MeshKey = tuple[str, tuple[int, ...], tuple[int, ...]]


class Channel(NamedTuple):
    """One process group a vote or agreement runs over, and where its control tensors live.

    ``mesh_key``/``mesh_dim`` say which mesh dimension the group came from; both are ``None``
    for a binding's channel.
    """

    process_group: ProcessGroup
    device: torch.device
    mesh_key: MeshKey | None
    mesh_dim: int | None


def mesh_key(mesh: DeviceMesh) -> MeshKey:
    """The content key of a device mesh: device type, shape and flattened ranks.

    Group names are per-process counters that differ across ranks and runs, so they never
    enter the key; equal content on every rank gives equal keys, which is what lets every rank
    sort meshes into one order.
    """
    ranks = mesh.mesh.flatten().tolist()
    return (
        str(mesh.device_type),
        tuple(int(size) for size in mesh.shape),
        tuple(int(rank) for rank in ranks),
    )


def _sharded_candidates(param_groups: Iterable[Mapping[str, Any]]) -> list[Any]:
    """DTensor parameters on meshes of two or more ranks that include this rank, in order."""
    from torch.distributed.tensor import DTensor

    candidates: list[Any] = []
    for group in param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            mesh = param.device_mesh
            if mesh.get_coordinate() is not None and mesh.size() >= 2:
                candidates.append(param)
    return candidates


def collect_failure_scope(param_groups: Iterable[Mapping[str, Any]]) -> tuple[Channel, ...]:
    """The ordered channels a step's failure vote must run over (``()`` = single process).

    Every group counts, with or without ``sharded_mode`` (approx ranks mutate their shards
    without collectives, so a one-sided failure there would silently diverge the ranks).
    Meshes are deduplicated by content and visited in sorted key order, each in mesh-dimension
    order, so every rank builds the same sequence and 2-D meshes cannot deadlock on row/column
    order. A composite folds all of its children's groups through one call.
    """
    if not distributed_ready():
        return ()
    candidates = _sharded_candidates(param_groups)
    if not candidates:
        return ()
    with torch.no_grad():
        local_shards = [param.to_local() for param in candidates]
    # A captured CUDA graph replays its eager warm-up; a vote recorded into it would replay too.
    if cuda_graph_capturing(local_shards):
        return ()
    first_seen: dict[MeshKey, tuple[DeviceMesh, torch.device]] = {}
    for param, shard in zip(candidates, local_shards, strict=True):
        first_seen.setdefault(mesh_key(param.device_mesh), (param.device_mesh, shard.device))
    return tuple(_mesh_channels(first_seen))


def _mesh_channels(
    first_seen: Mapping[MeshKey, tuple[DeviceMesh, torch.device]],
) -> list[Channel]:
    import torch.distributed as dist

    channels: list[Channel] = []
    for key in sorted(first_seen):
        mesh, device = first_seen[key]
        for dim, group in enumerate(mesh.get_all_groups()):
            if dist.get_world_size(group) > 1:
                channel_device = choose_collective_device(group, hint=device)
                channels.append(Channel(group, channel_device, key, dim))
    return channels
