"""The one backend/device rule of the project and the channel-device choice (docs/dist.md §3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["backend_allows", "backend_name", "choose_collective_device"]

# Which collective device types each backend row of the table carries. A backend missing here
# ("undefined", "ucc", custom plugins) falls under the last row: CPU or CUDA.
_ALLOWED_DEVICE_TYPES: dict[str, frozenset[str]] = {
    "nccl": frozenset({"cuda"}),
    "gloo": frozenset({"cpu", "cuda"}),
    # CUDA-aware MPI cannot be detected, so a CUDA device would only fail later, inside a
    # collective; refusing it here turns that into an early, explicit error.
    "mpi": frozenset({"cpu"}),
}
_OTHER_BACKEND_DEVICE_TYPES = frozenset({"cpu", "cuda"})


def _entries(backend: str) -> list[tuple[str | None, str]]:
    """``"cpu:gloo,cuda:nccl"`` -> ``[("cpu", "gloo"), ("cuda", "nccl")]``; no prefix -> None."""
    entries: list[tuple[str | None, str]] = []
    for raw in backend.lower().split(","):
        entry = raw.strip()
        if not entry:
            continue
        prefix, sep, name = entry.partition(":")
        entries.append((prefix.strip(), name.strip()) if sep else (None, entry))
    return entries


def backend_allows(backend: str, device_type: str) -> bool:
    """Whether ``backend`` (a ``get_backend`` string) can carry collectives on ``device_type``.

    A device type is allowed iff some comma-separated entry whose device prefix is absent or
    equal to it lists it in its row of the table.
    """
    if type(backend) is not str:
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if type(device_type) is not str:
        raise TypeError(f"device_type must be a str, got {type(device_type).__name__}")
    wanted = device_type.lower()
    for prefix, name in _entries(backend):
        if prefix is not None and prefix != wanted:
            continue
        if wanted in _ALLOWED_DEVICE_TYPES.get(name, _OTHER_BACKEND_DEVICE_TYPES):
            return True
    return False


def backend_name(group: ProcessGroup | None) -> str:
    """The normalised backend string of ``group``: lower case, as ``backend_allows`` reads it."""
    import torch.distributed as dist

    return str(dist.get_backend(group)).lower()


def choose_collective_device(group: ProcessGroup, hint: torch.device | None = None) -> torch.device:
    """Pick where a group's control tensors live on paths without a binding.

    Order: the hint when the backend carries it; the group's bound device; the current CUDA
    device for CUDA-only backends; the current XPU device for ``xccl``; otherwise CPU. The
    ambient CUDA device is consulted only in the CUDA-only case.
    """
    backend = backend_name(group)
    if hint is not None and backend_allows(backend, torch.device(hint).type):
        return torch.device(hint)
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    if backend_allows(backend, "cuda") and not backend_allows(backend, "cpu"):
        return torch.device(f"cuda:{torch.cuda.current_device()}")
    if any(name == "xccl" for _, name in _entries(backend)):
        return torch.device(f"xpu:{torch.xpu.current_device()}")
    return torch.device("cpu")
