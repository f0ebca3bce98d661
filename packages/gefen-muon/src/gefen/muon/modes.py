"""Which path each parameter takes, and the collectives of the sharded modes (docs/muon.md §7).

Plain tensors take the unsharded path. A DTensor takes its group's ``sharded_mode``, except
that a ``"distributed"`` parameter that is not eligible (a 1-D mesh of two or more ranks under
an initialised torch.distributed) falls back to ``"exact"``. Eligibility depends only on the
mesh, so every rank classifies every parameter alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.core.extension import is_dtensor
from gefen.dist import Channel, choose_collective_device, collective, mesh_key
from gefen.muon.kernels import stable_owner

__all__ = [
    "APPROX",
    "DISTRIBUTED",
    "EXACT",
    "PLAIN",
    "DistributedSlot",
    "broadcast_update",
    "distributed_slots",
    "full_gradient",
    "is_eligible",
    "parameter_mode",
    "quantized_shape",
]

PLAIN, APPROX, EXACT, DISTRIBUTED = "plain", "approx", "exact", "distributed"


def is_eligible(param: Tensor) -> bool:
    """A non-empty DTensor on a 1-D mesh of two or more ranks, under an initialised
    torch.distributed.

    An empty matrix is never planned (it stays pristine), so it must not take an owner slot
    either: the step and the checkpoint then count the same owners.
    """
    import torch.distributed as dist

    if not is_dtensor(param) or param.numel() == 0:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    mesh = param.device_mesh  # type: ignore[attr-defined]
    return bool(mesh.ndim == 1 and mesh.size() >= 2)


def parameter_mode(group: Mapping[str, Any], param: Tensor) -> str:
    if not is_dtensor(param):
        return PLAIN
    mode = str(group["sharded_mode"])
    if mode == DISTRIBUTED and not is_eligible(param):
        return EXACT
    return mode


def quantized_shape(group: Mapping[str, Any], param: Tensor) -> tuple[int, int]:
    """The matrix the momentum quantizes: local in approx, global (logical) otherwise."""
    if parameter_mode(group, param) == APPROX:
        local = param.to_local()  # type: ignore[attr-defined]
        return int(local.shape[0]), int(local.shape[1])
    return int(param.shape[0]), int(param.shape[1])


@dataclass(frozen=True)
class DistributedSlot:
    """One eligible parameter of a distributed group: its stable owner on its process group."""

    index: int
    param: Tensor
    group: Mapping[str, Any]
    eligible_index: int
    owner: int
    channel: Channel

    @property
    def world(self) -> int:
        import torch.distributed as dist

        return int(dist.get_world_size(self.channel.process_group))

    def is_owner(self) -> bool:
        import torch.distributed as dist

        return int(dist.get_rank(self.channel.process_group)) == self.owner


def _channel(param: Tensor) -> Channel:
    mesh = param.device_mesh  # type: ignore[attr-defined]
    group = mesh.get_group(0)
    device = choose_collective_device(group, param.to_local().device)  # type: ignore[attr-defined]
    return Channel(group, device, mesh_key(mesh), 0)


def distributed_slots(
    indexed: Sequence[tuple[int, Mapping[str, Any], Tensor]],
) -> list[list[DistributedSlot]]:
    """Eligible distributed parameters per process group, groups in order of first appearance.

    The stable index counts every eligible parameter, with or without a gradient, so owners
    never move when the set of active parameters changes.
    """
    by_mesh: dict[Any, list[DistributedSlot]] = {}
    for index, group, param in indexed:
        if parameter_mode(group, param) != DISTRIBUTED:
            continue
        channel = _channel(param)
        slots = by_mesh.setdefault(channel.mesh_key, [])
        world = int(param.device_mesh.size())  # type: ignore[attr-defined]
        position = len(slots)
        owner = stable_owner(position, world)
        slots.append(DistributedSlot(index, param, group, position, owner, channel))
    return list(by_mesh.values())


@collective
def full_gradient(grad: Tensor) -> Tensor:
    """The logical gradient of a DTensor (an all-gather on every rank of its mesh)."""
    full: Tensor = grad.full_tensor()  # type: ignore[attr-defined]
    return full


@collective
def broadcast_update(update: Tensor | None, slot: DistributedSlot) -> Tensor:
    """The owner's contiguous bf16 update, on every member of the slot's process group."""
    import torch.distributed as dist

    group = slot.channel.process_group
    shape = tuple(slot.param.shape)
    device = slot.param.to_local().device  # type: ignore[attr-defined]
    if update is not None:
        buffer = update.to(device=device, dtype=torch.bfloat16).contiguous()
    else:
        buffer = torch.empty(shape, dtype=torch.bfloat16, device=device)
    dist.broadcast(buffer, src=dist.get_global_rank(group, slot.owner), group=group)
    return buffer
