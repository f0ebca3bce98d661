"""Small runtime helpers shared by every module: the ``collective`` decorator, the CUDA-graph
capture query and the availability check of ``torch.distributed`` (docs/dist.md §1).

Nothing here imports ``torch.distributed.tensor``, ``DeviceMesh`` or ``ProcessGroup`` at module
level: ``import gefen.dist`` must work on builds where ``torch.distributed`` is unavailable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import torch

from gefen.dist.torch_internals import lazily_disable_dynamo

__all__ = ["collective", "cuda_graph_capturing", "distributed_ready"]

F = TypeVar("F", bound=Callable[..., Any])


def collective(fn: F) -> F:
    """Mark ``fn`` as issuing collectives: it runs under ``no_grad`` and outside ``torch.compile``.

    Control tensors must never join an autograd graph, and a compiled region must never trace a
    vote (the graph would bake in one rank's branch), so every collective-issuing function of the
    project goes through this one decorator. The ``cast`` keeps the signature for mypy.
    """
    return cast(F, lazily_disable_dynamo(torch.no_grad()(fn)))


def distributed_ready() -> bool:
    """True iff ``torch.distributed`` is available and its default group is initialised."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _is_cuda(item: object) -> bool:
    if isinstance(item, torch.Tensor):
        return item.device.type == "cuda"
    if isinstance(item, torch.device):
        return item.type == "cuda"
    if isinstance(item, str):
        try:
            return torch.device(item).type == "cuda"
        except RuntimeError as error:
            raise ValueError(f"cuda_graph_capturing: {item!r} is not a device name") from error
    raise TypeError(f"cuda_graph_capturing expects tensors or devices, got {type(item).__name__}")


def cuda_graph_capturing(tensors_or_devices: Iterable[object]) -> bool:
    """Whether the current CUDA stream is capturing a graph, asked only when it can matter.

    CPU-only builds raise on the raw capture query, and CPU meshes must never touch CUDA, so
    the device types are inspected first and CUDA is consulted only for a CUDA tensor or device.
    """
    if not any(_is_cuda(item) for item in tensors_or_devices):
        return False
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())
