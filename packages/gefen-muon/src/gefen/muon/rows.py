"""Full momentum saved as rows, so that DCP reshards it (docs/muon.md §8.1).

A ``"distributed"`` matrix's state lives in full on its owner, an ``"exact"`` one's on every
rank. ``state_dict()`` presents a distributed matrix the way FSDP2 shards its parameter: the
owner's entry travels to the group one matrix at a time and each rank keeps only its own rows
(``torch.chunk`` of dim 0), which the shell presents as DTensors with the parameter's
``Shard(0)`` placement. A save then holds a 1/world share of that state on each rank (plus the
one matrix in flight), and ``dcp.save`` writes every row once.

At load, an exact or distributed entry whose tensors are DTensors (this rank's rows after
``dcp.load``, at whatever world size) is checked for its layout before the load vote and staged
as ``PendingRows``; after the vote every rank gathers its full tensors, checks them with the one
entry validator and keeps them where it holds that state (the owner, or every rank in exact).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.core.extension import (
    PendingEntry,
    absorb_entry,
    every_rank_has_rows,
    group_uses_codebook,
    is_dtensor,
    local_rows,
    local_tensor,
    row_sharded_mesh,
    stage_entry,
)
from gefen.dist import mesh_key
from gefen.muon.modes import APPROX, DISTRIBUTED, EXACT, parameter_mode, quantized_shape

if TYPE_CHECKING:
    from gefen.core.extension import ShellInterface

__all__ = [
    "PendingRows",
    "approx_row_sharded",
    "assembles_rows",
    "owned_rows",
    "presents_rows",
    "rows_layout_error",
]


def presents_rows(optimizer: ShellInterface, group: Mapping[str, Any], param: Tensor) -> bool:
    """A distributed matrix sharded ``Shard(0)`` with rows on every rank and blocks inside rows
    (one block per row of a codebook8 momentum, or the dense matrix of codec ``"none"``)."""
    from torch.distributed.tensor import Shard

    if parameter_mode(group, param) != DISTRIBUTED:
        return False
    if tuple(param.placements) != (Shard(0),):  # type: ignore[attr-defined]
        return False
    rows, cols = quantized_shape(group, param)
    if not every_rank_has_rows(rows, int(param.device_mesh.size())):  # type: ignore[attr-defined]
        return False
    return optimizer.template_period(group, param) == (cols if group_uses_codebook(group) else 1)


def approx_row_sharded(optimizer: ShellInterface) -> bool:
    """approx state DCP reshards as Gefen's (docs/core.md §9.1): every group approx, every
    matrix row-sharded over one mesh (a rank may hold no row of one), no explicit scope, and one
    block per row (codebook8 matrices of 8 or more columns). Decided from shapes and options
    alone."""
    indexed = optimizer.indexed_params()
    if optimizer.finalized is not None or any(
        group["sharded_mode"] != APPROX for group in optimizer.param_groups
    ):
        return False
    if row_sharded_mesh((param for _, _, param in indexed), rows_everywhere=False) is None:
        return False
    return all(
        optimizer.template_period(group, param)
        == (quantized_shape(group, param)[1] if group_uses_codebook(group) else 1)
        for _, group, param in indexed
    )


def assembles_rows(group: Mapping[str, Any], param: Tensor) -> bool:
    """Exact and distributed state is full: its DTensor rows are gathered at load."""
    return parameter_mode(group, param) in (EXACT, DISTRIBUTED)


def owned_rows(entry: Mapping[str, Any], param: Tensor) -> dict[str, Any]:
    """A full entry cut to this rank's rows (each tensor with the matrix's rows)."""
    return {k: local_rows(v, param) if isinstance(v, Tensor) else v for k, v in entry.items()}


def rows_layout_error(
    entry: Mapping[str, Any], param: Tensor, where: str, dtypes: Mapping[str, torch.dtype]
) -> ValueError | None:
    """Why ``entry``'s DTensors are not the rows of ``param``'s full state, or None. Local and
    read before the vote, so the gathers after it are the same on every rank and never carry a
    dtype the entry cannot hold (``dtypes``: ``EntrySpec.tensor_dtypes``)."""
    from torch.distributed.tensor import Shard

    if not is_dtensor(param):
        return ValueError(f"{where}: DTensor state for a parameter that is not a DTensor")
    rows, held = int(param.shape[0]), int(local_tensor(param).shape[0])
    for key, value in sorted(entry.items()):
        if not is_dtensor(value):
            continue
        if mesh_key(value.device_mesh) != mesh_key(param.device_mesh) or tuple(  # type: ignore[attr-defined]
            value.placements
        ) != (Shard(0),):
            return ValueError(f"{where}: '{key}' must be sharded Shard(0) on its parameter's mesh")
        local = local_tensor(value)
        if key not in dtypes:
            return ValueError(f"{where}: unexpected key '{key}'")
        if local.dtype != dtypes[key]:
            return ValueError(f"{where}: '{key}' must be {dtypes[key]}, got {local.dtype}")
        if value.dim() != 2 or int(value.shape[0]) != rows or int(local.shape[0]) != held:
            return ValueError(
                f"{where}: '{key}' must hold the parameter's {rows} rows ({held} on this rank), "
                f"got {tuple(value.shape)} ({tuple(local.shape)} here)"
            )
    return None


class PendingRows(PendingEntry):
    """One exact or distributed entry saved as DTensor rows, assembled after the load vote.

    ``keep``: this rank holds the state (the owner; every rank in exact). ``format2``: the entry
    is in format 2's slots. ``step_limit``: the most steps its entry can have taken.
    """

    def __init__(
        self,
        optimizer: ShellInterface,
        saved: Mapping[str, Any],
        *,
        place: tuple[Mapping[str, Any], Tensor, str],
        keep: bool,
        format2: bool,
        step_limit: int,
        finisher: Callable[[Any, dict[str, Any], str, Any], dict[str, Any]],
    ) -> None:
        period = saved.get("period")
        super().__init__(period if type(period) is int and period >= 0 else 0)
        self.optimizer, self.saved, self.finisher = optimizer, saved, finisher
        self.group, self.param, self.where = place
        self.keep, self.format2, self.step_limit = keep, format2, step_limit

    def gather(self) -> dict[str, Any]:
        """Collective over the parameter's mesh: the entry with each DTensor in full."""
        return {
            key: value.full_tensor() if is_dtensor(value) else value
            for key, value in sorted(self.saved.items())
        }

    def finish(self, gathered: dict[str, Any]) -> dict[str, Any]:
        """The full entry validated, kept only where this rank holds the state (elsewhere its
        period)."""
        full = gathered
        if self.format2:  # its searched-period slots become format 1's shapes first
            full = absorb_entry(self.optimizer, self.group, self.param, full, self.where)
        entry = stage_entry(self.optimizer, self.group, self.param, full, self.where, self.finisher)
        step = entry.get("step")
        if isinstance(step, int) and step > self.step_limit:
            raise ValueError(
                f"{self.where}: 'step' {step} exceeds {self.step_limit}, global_step times the "
                "places that list the parameter (no run updates it more often)"
            )
        return entry if self.keep else {"period": entry["period"]}
