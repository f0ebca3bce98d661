"""The collective presence/order preflight of GefenMuon's sharded modes (docs/muon.md §7).

Exact and distributed steps gather every DTensor gradient in parameter order, and distributed
steps assign owners by optimizer position, so every rank of a mesh must hold the same parameters,
in the same order, with the same gradient presence before anything is unscaled or gathered. A
rank that disagrees would otherwise hang in, or silently corrupt, a later collective.

The check is symmetric (every covered rank issues the same fixed-size MAX all-reduces, in the same
order) and mutation-free; it never raises between collectives, and its messages are built only
from reduced data and sorted names, so every rank of a mesh raises the identical error.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from gefen.contracts import fingerprint
from gefen.core.extension import parameter_label
from gefen.dist import GroupAgreementError, choose_collective_device, collective, mesh_key
from gefen.muon.modes import DISTRIBUTED, EXACT, parameter_mode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from gefen.dist.scope import MeshKey

__all__ = ["check_presence_and_order", "uncovered_labels", "uncovered_presence"]

_COVERED_MODES = frozenset({"exact", "distributed"})
_FIELDS_PER_ITEM = 6
_FINGERPRINT_MASK = 0x7FFFFFFF
_UNVERIFIABLE_ORDER = (
    "{owner} cannot verify cross-rank parameter order for same-shape, same-dtype DTensor "
    "parameters without names ({labels}); pass named parameters (e.g. "
    "model.named_parameters()) so a divergent registration order is detected"
)

# Once-guard of the unverifiable-order warning, keyed weakly by parameter identity: an optimizer
# steps the same parameter objects every time, so this warns once per optimizer (and once per
# hybrid wrapping it) rather than once per step. Identity keys never compare tensors by value,
# never keep a parameter alive, and cannot alias a freed parameter's recycled id().
_WARNED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Item(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    has_grad: bool
    position: int
    synthesized: bool


@dataclass
class _Mesh:
    mesh: DeviceMesh
    device: torch.device
    items: list[_Item] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Findings:
    counts: list[tuple[int, int]] = field(default_factory=list)
    duplicates: bool = False
    label_positions: set[int] = field(default_factory=set)
    order_names: set[str] = field(default_factory=set)
    presence_names: set[str] = field(default_factory=set)


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _label(item: _Item) -> tuple[str, tuple[int, ...], str]:
    return (item.name, item.shape, item.dtype)


def _member_of(mesh: DeviceMesh) -> bool:
    # A world-1 mesh has nobody to disagree with; a non-member takes part in none of its groups.
    return mesh.get_coordinate() is not None and mesh.size() >= 2


def _collect(param_groups: Sequence[Mapping[str, Any]]) -> dict[MeshKey, _Mesh]:
    """Covered parameters grouped by mesh content key; positions count every parameter."""
    from torch.distributed.tensor import DTensor

    meshes: dict[MeshKey, _Mesh] = {}
    position = 0
    for g, group in enumerate(param_groups):
        params = list(group["params"])
        names: Sequence[Any] | None = group.get("param_names")
        if names is not None and len(names) != len(params):
            names = None
        covered = group.get("sharded_mode", "exact") in _COVERED_MODES
        for i, param in enumerate(params):
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            if covered and mesh is not None and _member_of(mesh):
                key = mesh_key(mesh)
                if key not in meshes:
                    # Local shards live where the mesh's control tensors should; to_local()
                    # communicates nothing, and no_grad keeps it off the autograd graph.
                    with torch.no_grad():
                        meshes[key] = _Mesh(mesh, param.to_local().device)
                name = str(names[i]) if names is not None else f"param_groups[{g}][{i}]"
                item = _Item(
                    name,
                    tuple(int(size) for size in param.shape),
                    str(param.dtype),
                    param.grad is not None,
                    position,
                    names is None,
                )
                meshes[key].items.append(item)
                meshes[key].params.append(param)
            position += 1
    return meshes


def _warn_unverifiable_order(meshes: Mapping[MeshKey, _Mesh], owner: str) -> None:
    # Synthesized names encode the position, so two unnamed parameters with one shape and dtype
    # swapped on one rank produce identical labels and positions: nothing can tell them apart.
    offending: list[torch.Tensor] = []
    labels: list[str] = []
    for key in sorted(meshes):
        entry = meshes[key]
        by_shape: dict[tuple[tuple[int, ...], str], list[int]] = {}
        for index, item in enumerate(entry.items):
            if item.synthesized:
                by_shape.setdefault((item.shape, item.dtype), []).append(index)
        for indices in by_shape.values():
            if len(indices) > 1:
                offending.extend(entry.params[index] for index in indices)
                labels.extend(entry.items[index].name for index in indices)
    if not offending or all(param in _WARNED for param in offending):
        return
    for param in offending:
        _WARNED[param] = True
    message = _UNVERIFIABLE_ORDER.format(owner=owner, labels=", ".join(sorted(set(labels))))
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _label_fingerprint(item: _Item) -> int:
    digest = fingerprint([item.name, list(item.shape), item.dtype])
    return int.from_bytes(digest[:4], "big") & _FINGERPRINT_MASK


def _encode(items: Sequence[_Item]) -> list[int]:
    """The probe ``[dups, per item: has, -has, pos, -pos, fp, -fp]`` of items sorted by label.

    Carrying each value next to its negation lets one MAX all-reduce yield both the maximum and
    (negated) the minimum, so a single fixed-size collective detects any cross-rank difference.
    """
    dups = sum(_label(a) == _label(b) for a, b in pairwise(items))
    probe = [dups]
    for item in items:
        has, fp = int(item.has_grad), _label_fingerprint(item)
        probe.extend((has, -has, item.position, -item.position, fp, -fp))
    return probe


def _absorb(items: Sequence[_Item], reduced: Sequence[int], findings: _Findings) -> None:
    """Record what a reduced probe reveals; never raises (other meshes still have to run)."""
    if reduced[0] > 0:
        findings.duplicates = True
    for index, item in enumerate(items):
        start = 1 + _FIELDS_PER_ITEM * index
        has_hi, has_lo, pos_hi, pos_lo, fp_hi, fp_lo = reduced[start : start + _FIELDS_PER_ITEM]
        if fp_hi != -fp_lo:
            # Different labels sit here on some rank, so comparing their positions or
            # gradient presence would compare different parameters.
            findings.label_positions.add(index)
            continue
        if pos_hi != -pos_lo:
            findings.order_names.add(item.name)
        if has_hi != -has_lo:
            findings.presence_names.add(item.name)


def _channels(entry: _Mesh) -> list[tuple[ProcessGroup, torch.device]]:
    import torch.distributed as dist

    channels: list[tuple[ProcessGroup, torch.device]] = []
    # Dimension order, like the failure scope: the same order on every rank cannot deadlock on
    # the rows and columns of a 2-D mesh, and folding dim by dim reaches the whole mesh.
    for dim in range(entry.mesh.ndim):
        group = entry.mesh.get_group(dim)
        if dist.get_world_size(group) > 1:
            channels.append((group, choose_collective_device(group, hint=entry.device)))
    return channels


def _fold_max(
    values: list[int], channels: Sequence[tuple[ProcessGroup, torch.device]]
) -> list[int]:
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64)
    for group, device in channels:
        tensor = tensor.to(device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(value) for value in tensor.tolist()]


@collective
def _reduce_meshes(meshes: Mapping[MeshKey, _Mesh], findings: _Findings) -> None:
    # Content keys are rank-invariant, so sorting them gives every rank one visiting order.
    for key in sorted(meshes):
        entry = meshes[key]
        channels = _channels(entry)
        items = sorted(entry.items, key=_label)
        count = len(items)
        high, negated_low = _fold_max([count, -count], channels)
        if high != -negated_low:
            # The probe's size depends on the count, so it cannot run on this mesh; skipping
            # is symmetric because every rank sees the same reduced range.
            findings.counts.append((-negated_low, high))
            continue
        _absorb(items, _fold_max(_encode(items), channels), findings)


def _first_error(findings: _Findings, owner: str) -> GroupAgreementError | None:
    def error(message: str, what: str) -> GroupAgreementError:
        return GroupAgreementError(f"{owner} {message}", owner_name=owner, what=what)

    if findings.counts:
        low, high = findings.counts[0]
        return error(
            "requires the same DTensor parameters on every rank of a mesh; parameter count "
            f"differs across ranks (min {low}, max {high})",
            "parameter count",
        )
    if findings.duplicates:
        return error(
            "requires unique parameter names on a DTensor mesh; some rank has parameters "
            "sharing a name, shape, and dtype. Give every parameter a unique name.",
            "unique parameter names",
        )
    if findings.label_positions:
        positions = ", ".join(str(index) for index in sorted(findings.label_positions))
        return error(
            "requires identical parameter names, shapes and dtypes on every rank of a DTensor "
            f"mesh; mismatch at sorted positions {positions}",
            "parameter labels",
        )
    if findings.order_names:
        return error(
            "requires identical parameter-group order on every rank of a DTensor mesh; "
            f"parameters at rank-divergent positions: {', '.join(sorted(findings.order_names))}",
            "parameter order",
        )
    if findings.presence_names:
        return error(
            "requires identical gradient presence on every rank of a DTensor mesh; mismatched "
            f"parameters: {', '.join(sorted(findings.presence_names))}",
            "gradient presence",
        )
    return None


def check_presence_and_order(
    param_groups: Sequence[Mapping[str, Any]], *, owner: str = "GefenMuon"
) -> None:
    """Require identical DTensor parameters, order and gradient presence on every mesh rank.

    Covers the DTensor parameters of ``"exact"`` and ``"distributed"`` groups (a group without
    ``sharded_mode`` counts as the default ``"exact"``) on meshes of two or more ranks that
    contain this rank. Without ``torch.distributed`` initialised, or with nothing covered, it
    issues no collective. Raises ``GroupAgreementError`` (``owner_name=owner``) with the first
    category found, with text identical on every rank; nothing is mutated either way.
    Precondition (FSDP2 guarantees it): every mesh member holds parameters on that mesh.
    """
    if not _distributed_ready():
        return
    meshes = _collect(param_groups)
    if not meshes:
        return
    _warn_unverifiable_order(meshes, owner)
    findings = _Findings()
    _reduce_meshes(meshes, findings)
    error = _first_error(findings, owner)
    if error is not None:
        raise error


def uncovered_presence(param_groups: Sequence[Mapping[str, Any]]) -> list[bool]:
    """Gradient presence of every parameter this check does not cover (plain tensors and
    approx DTensors), in group order: the step vote agrees on it (docs/dist.md §5), so a
    gradient missing on one rank fails every rank there too, in the vote's own all-reduce."""
    return [param.grad is not None for _, param in _uncovered(param_groups)]


def uncovered_labels(param_groups: Sequence[Mapping[str, Any]], first_group: int = 0) -> list[str]:
    """The labels of ``uncovered_presence``'s parameters, in its order (a refusal names them),
    unnamed groups numbered from ``first_group``."""
    return [label for label, _ in _uncovered(param_groups, first_group)]


def _uncovered(
    param_groups: Sequence[Mapping[str, Any]], first_group: int = 0
) -> Iterator[tuple[str, Tensor]]:
    for group_index, group in enumerate(param_groups, first_group):
        for position, param in enumerate(group["params"]):
            if parameter_mode(group, param) not in (EXACT, DISTRIBUTED):
                yield parameter_label(group, group_index, position), param
