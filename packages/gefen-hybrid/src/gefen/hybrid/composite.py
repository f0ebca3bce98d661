"""The public interface of ``GefenMuonHybrid`` that its helper modules program against.

The checkpoint, contract, post-sharding and state-view modules take the hybrid and use only
these members, and import this protocol rather than the optimizer class, so no module imports
``gefen.hybrid.optimizer`` back (not even for typing).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

from gefen.dist import Channel
from gefen.hybrid.adamw_participant import ChildParticipant, PreparedChildLoad
from gefen.muon import GefenMuon

__all__ = ["HybridInterface", "child_presence_mask", "children_labels"]


class HybridInterface(Protocol):
    """What ``GefenMuonHybrid`` offers its checkpoint, contract and post-sharding modules."""

    OWNER_NAME: ClassVar[str]
    muon: GefenMuon | None
    backup: torch.optim.Optimizer | None
    backup_optimizer: str

    @property
    def children(self) -> tuple[torch.optim.Optimizer, ...]: ...
    @property
    def participants(self) -> tuple[tuple[str, ChildParticipant], ...]: ...
    @property
    def finalized(self) -> bool: ...
    def owner_of(self, key: object) -> torch.optim.Optimizer | None: ...
    def rebuild_registry(self) -> None: ...
    def check_layout(self) -> None: ...
    def step_failure_scope(self) -> tuple[Channel, ...]: ...
    def publish_load(
        self, muon: PreparedChildLoad | None, backup: PreparedChildLoad | None
    ) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...


def child_presence_mask(hybrid: HybridInterface) -> int:
    """The first header's one word (docs/dist.md §9.3): bit 0 a Muon child, bit 1 a backup, so
    members that would exchange different numbers of child headers fail at this one."""
    return (1 if hybrid.muon is not None else 0) | (2 if hybrid.backup is not None else 0)


def children_labels(hybrid: HybridInterface) -> list[str]:
    """Each child's parameter labels in its presence order, Muon first, unnamed groups numbered
    as the hybrid's ``param_groups`` lists them (the backup's after the Muon child's)."""
    labels: list[str] = []
    first = 0
    for (_, participant), child in zip(hybrid.participants, hybrid.children, strict=True):
        labels += participant.gradient_labels(first_group=first)
        first += len(child.param_groups)
    return labels
