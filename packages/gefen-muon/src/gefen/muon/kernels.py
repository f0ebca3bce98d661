"""Pure math kernels of ``gefen.muon`` (docs/muon.md §4, §7): no optimizer object.

Every function reads tensors and Python scalars and returns new values. The one exception is
``normuon_rescale``, whose contract is to update its running second moment ``v`` in place. The
eager implementations here are normative; a faster variant must match them in a parity test.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "NS_SCHEDULES",
    "STANDARD_TRIPLE",
    "Triple",
    "adjust_lr_ratio",
    "local_slice_of_full",
    "newton_schulz",
    "normuon_rescale",
    "resolve_ns_schedule",
    "stable_owner",
]

Triple = tuple[float, float, float]

STANDARD_TRIPLE: Triple = (3.4445, -4.7750, 2.0315)
"""The quintic coefficients ``torch.optim.Muon`` uses by default."""

NS_SCHEDULES: Mapping[str, tuple[Triple, ...]] = MappingProxyType(
    {
        "tuned3": (
            (5.0067, -14.4125, 10.6001),
            (3.7534, -6.8083, 3.3840),
            (3.2080, -4.3501, 2.0330),
        ),
        "tuned4": (
            (5.4261, -15.5285, 11.2657),
            (3.0766, -4.9701, 2.1297),
            (3.0008, -6.4486, 4.3696),
            (2.8386, -4.1421, 2.5758),
        ),
    }
)
"""The named fixed-length schedules; ``"standard"`` is not here because its length is ns_steps."""

MAX_SCHEDULE_LENGTH = 100
"""Schedules (and ``ns_steps``) must stay below this, as ``torch.optim.Muon`` requires."""


# --------------------------------------------------------------------------------------------
# Newton–Schulz schedules


def _is_finite_real(value: object) -> bool:
    # bool is a numbers.Real subclass, but True as a coefficient is always a caller mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        return False


def _finite_triple(entry: object) -> Triple | None:
    """``entry`` as three floats, or ``None`` if it is not three finite real numbers."""
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 3:
        return None
    if not all(_is_finite_real(x) for x in entry):
        return None
    a, b, c = (float(x) for x in entry)
    return (a, b, c)


def _check_ns_steps(ns_steps: object) -> int:
    if (
        not isinstance(ns_steps, int)
        or isinstance(ns_steps, bool)
        or not 1 <= ns_steps < MAX_SCHEDULE_LENGTH
    ):
        raise ValueError(
            f"ns_steps must be an int with 1 <= ns_steps < {MAX_SCHEDULE_LENGTH}, got {ns_steps!r}"
        )
    return ns_steps


def _explicit_schedule(entries: Sequence[object]) -> tuple[Triple, ...]:
    if not entries:
        raise ValueError("ns_schedule must not be empty")
    if len(entries) >= MAX_SCHEDULE_LENGTH:
        raise ValueError(
            f"ns_schedule must have fewer than {MAX_SCHEDULE_LENGTH} triples, got {len(entries)}"
        )
    triples = []
    for index, entry in enumerate(entries):
        triple = _finite_triple(entry)
        if triple is None:
            raise ValueError(
                f"ns_schedule entry {index} must be a triple of finite real numbers, got {entry!r}"
            )
        triples.append(triple)
    return tuple(triples)


def resolve_ns_schedule(
    ns_schedule: object, ns_coefficients: object, ns_steps: object
) -> tuple[Triple, ...]:
    """The Newton–Schulz triples, in order, for one parameter group (§4); also the validator.

    ``None`` repeats ``ns_coefficients`` and ``"standard"`` repeats ``STANDARD_TRIPLE``, each
    ``ns_steps`` times (the fixed path, where ``ns_steps`` must satisfy 1 <= n < 100). The named
    and explicit schedules fix their own length, so ``ns_steps`` is only required to be an int
    there: the optimizer stores the schedule length in its place. Raises ``ValueError``.
    """
    coefficients = _finite_triple(ns_coefficients)
    if coefficients is None:
        raise ValueError(
            f"ns_coefficients must be three finite real numbers, got {ns_coefficients!r}"
        )
    if ns_schedule is None or (isinstance(ns_schedule, str) and ns_schedule == "standard"):
        triple = coefficients if ns_schedule is None else STANDARD_TRIPLE
        return (triple,) * _check_ns_steps(ns_steps)
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool):
        raise ValueError(f"ns_steps must be an int, got {ns_steps!r}")
    if isinstance(ns_schedule, str):
        if ns_schedule not in NS_SCHEDULES:
            raise ValueError(
                f"Unknown ns_schedule {ns_schedule!r}; expected None, 'standard', "
                f"{', '.join(repr(name) for name in NS_SCHEDULES)} or a sequence of triples"
            )
        return NS_SCHEDULES[ns_schedule]
    if isinstance(ns_schedule, bytes) or not isinstance(ns_schedule, Sequence):
        raise ValueError(
            "ns_schedule must be None, a schedule name or a sequence of (a, b, c) triples, "
            f"got {ns_schedule!r}"
        )
    return _explicit_schedule(ns_schedule)


# --------------------------------------------------------------------------------------------
# Newton–Schulz orthogonalisation


def newton_schulz(G: Tensor, schedule: Sequence[Triple], eps: float) -> Tensor:
    """Approximately orthogonalise the 2-D ``G`` with the quintic iterations of ``schedule``.

    Bit-identical on CPU to ``torch.optim._muon._zeropower_via_newtonschulz`` run with the same
    triples (§4, §9), but ``G`` is never modified, even when it is already bf16. Returns bf16 in
    ``G``'s shape; for a tall ``G`` that is a transposed (non-contiguous) view, as in torch.
    """
    if G.dim() != 2:
        raise ValueError(f"newton_schulz input must be a 2D matrix, got shape {tuple(G.shape)}")
    # copy=True keeps G's strides as .bfloat16() would (so the norm reduces in the same order
    # as torch's) while never aliasing a bf16 G, which the in-place division below would corrupt.
    X = G.to(dtype=torch.bfloat16, copy=True)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.mT
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1].
    X.div_(X.norm().clamp(min=eps))
    for a, b, c in schedule:
        gram = X @ X.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.addmm(X, poly, X, beta=a)
    return X.mT if tall else X


# --------------------------------------------------------------------------------------------
# NorMuon and learning-rate ratios


def normuon_rescale(
    O: Tensor,  # noqa: E741 - the spec's name, kept for keyword callers
    v: Tensor,
    t: int,
    beta2: float,
    eps: float,
) -> tuple[Tensor, int]:
    """Divide each row of ``O`` by its running RMS, preserving ``‖O‖_F`` (§4).

    ``O`` is in the parameter's orientation (R, C); ``v`` is the fp32 (R, 1) second moment of
    the row norms and is updated in place; ``t`` is the number of earlier updates. Returns the
    rescaled ``O`` (a new tensor in ``O``'s dtype) and ``t + 1``.
    """
    if O.dim() != 2:
        raise ValueError(f"normuon_rescale input must be a 2D matrix, got shape {tuple(O.shape)}")
    rows, cols = O.shape
    if v.dtype != torch.float32 or tuple(v.shape) != (rows, 1):
        raise ValueError(
            f"normuon state must be float32 of shape ({rows}, 1), "
            f"got {v.dtype} of shape {tuple(v.shape)}"
        )
    row_norm = torch.linalg.vector_norm(O, dim=1, keepdim=True, dtype=torch.float32)
    row_sq = row_norm.square()
    # An empty row has no mean square; max(cols, 1) keeps its (zero) contribution finite.
    v.mul_(beta2).add_(row_sq / max(cols, 1), alpha=1.0 - beta2)
    t += 1
    denom = (v / (1.0 - beta2**t)).sqrt_().add_(eps)
    # The clamp keeps a zero O at exactly zero (0 / tiny = 0) instead of 0 / 0.
    tiny = torch.finfo(torch.float32).tiny
    scaled_norm = (row_norm / denom).square().sum().sqrt().clamp(min=tiny)
    factor = row_sq.sum().sqrt() / scaled_norm
    return (O.float() * (factor / denom)).to(O.dtype), t


def adjust_lr_ratio(fn: str | None, shape: Sequence[int]) -> float:
    """The factor on the learning rate for a matrix of global ``shape`` (§4)."""
    if len(shape) < 2:
        raise ValueError(f"adjust_lr_ratio needs a 2D shape, got {tuple(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    if fn is None or (isinstance(fn, str) and fn == "original"):
        # An empty matrix gets an empty update; 1.0 avoids dividing by zero columns.
        return math.sqrt(max(1, rows / cols)) if cols else 1.0
    if isinstance(fn, str) and fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Unknown adjust_lr_fn {fn!r}; expected None, 'original' or 'match_rms_adamw'")


# --------------------------------------------------------------------------------------------
# Sharding helpers


def stable_owner(index: int, world: int) -> int:
    """The rank (within its process group) that owns eligible parameter ``index`` (§7)."""
    index, world = operator.index(index), operator.index(world)
    if world <= 0:
        raise ValueError("world must be positive")
    if index < 0:
        raise ValueError("stable_index must be non-negative")
    return index % world


def _dtensor_type() -> type[Any] | None:
    # Builds without torch.distributed cannot hold DTensors, so a plain tensor is all we can see.
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def local_slice_of_full(full: Tensor, param: Tensor) -> Tensor:
    """The part of the global-shaped ``full`` that ``param``'s local shard holds (§7).

    For plain ``Shard``/``Replicate`` placements the result is a view of ``full`` following
    ``torch.chunk`` (uneven tails, empty trailing shards); a rank outside the mesh gets an empty
    slice. Other placements (e.g. strided shards) fall back to a local redistribute from
    ``Replicate`` and need not return a view. A plain tensor ``param`` gets ``full`` itself.
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return full
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(
            f"full has shape {tuple(full.shape)} but the parameter's global shape is "
            f"{tuple(param.shape)}"
        )
    from torch.distributed.tensor import Replicate, Shard

    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return full.narrow(0, 0, 0)
    placements = tuple(param.placements)
    if not all(isinstance(p, (Shard, Replicate)) for p in placements):
        return _redistributed_slice(full, param)
    view = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            view = _chunk_of(
                view, placement.dim % full.dim(), mesh.size(mesh_dim), coordinate[mesh_dim]
            )
    return view


def _chunk_of(tensor: Tensor, dim: int, parts: int, index: int) -> Tensor:
    """Chunk ``index`` of ``torch.chunk(tensor, parts, dim)``, empty past the last chunk."""
    size = tensor.size(dim)
    chunk = -(-size // parts)
    start = chunk * index
    length = max(0, min(size, start + chunk) - start)
    return tensor.narrow(dim, min(start, size), length)


def _redistributed_slice(full: Tensor, param: Any) -> Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    mesh = param.device_mesh
    # Replicate -> any placement is computed locally by torch, so this enters no collective.
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    local: Tensor = replicated.redistribute(mesh, param.placements).to_local()
    return local
