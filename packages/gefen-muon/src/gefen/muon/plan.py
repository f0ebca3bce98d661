"""GefenMuon's step plan: what phase 4 hands to the streamed commit (docs/muon.md §6).

One ``PlannedMatrix`` per parameter with a gradient (its mode, period, scalars, LR ratio and
stochastic-rounding seed; never a tensor it does not read live), grouped into ``OwnerBucket``s
for the distributed mode. ``group_hyper`` reads a group's scalars once per step;
``stochastic_seed`` gives a matrix its draws.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gefen.core.extension import first_logical_element, group_uses_codebook, lr_value
from gefen.muon.modes import APPROX, DistributedSlot
from gefen.muon.options import group_schedule
from gefen.muon.update import MuonHyper

__all__ = ["OwnerBucket", "PlannedMatrix", "group_hyper", "stochastic_seed"]


@dataclass(frozen=True)
class PlannedMatrix:
    """One matrix of the plan: what its streamed update needs besides tensors it reads live."""

    index: int
    group: Mapping[str, Any]
    param: Tensor
    mode: str
    period: int
    hyper: MuonHyper
    ratio: float
    seed: tuple[int, ...] | None


@dataclass(frozen=True)
class OwnerBucket:
    """Up to ``world`` active parameters of one distributed process group, in stable order."""

    slots: tuple[tuple[DistributedSlot, PlannedMatrix], ...]


def group_hyper(group: Mapping[str, Any]) -> MuonHyper:
    """A group's update scalars, read once per group per step (a tensor lr included)."""
    return MuonHyper(
        lr=lr_value(group["lr"]),
        weight_decay=float(group["weight_decay"]),
        momentum=float(group["momentum"]),
        nesterov=bool(group["nesterov"]),
        schedule=group_schedule(group),
        eps=float(group["eps"]),
        normuon=bool(group["normuon"]),
        normuon_beta2=float(group["normuon_beta2"]),
        normuon_eps=float(group["normuon_eps"]),
        lr_dtype=group["lr"].dtype if isinstance(group["lr"], Tensor) else None,
    )


def stochastic_seed(
    global_step: int, index: int, group: Mapping[str, Any], param: Tensor, mode: str
) -> tuple[int, ...] | None:
    """The seed of the group's stochastic rounding (docs/core.md §6.3), or None when it rounds
    to nearest. An approx shard quantizes its own rows' momentum, so it draws by its elements'
    place in the whole matrix, as one process draws for them (not by its local index, which
    gave every rank the first rows' draws); the other modes quantize whole matrices."""
    if not (group_uses_codebook(group) and bool(group["stochastic_round"])):
        return None
    return (global_step, index, first_logical_element(param) if mode == APPROX else 0)
