"""The hybrid's checkpoint and its atomic load (docs/hybrid.md §8).

``prepare_hybrid_load`` runs steps 1–5 (pre-hooks on a copy, the split of torch's flat layout
into the children's dicts, half presence, backend tag, staging of both children) and returns a
``PreparedHybridLoad``; the shared load template of ``gefen.core.transaction`` votes it, agrees,
commits and fires the post-hooks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gefen.core.extension import copy_containers
from gefen.dist import GuardedOperation
from gefen.dist.codebook_scope import OP_LOAD
from gefen.dist.torch_internals import copy_with_load_pre_hooks, run_load_post_hooks
from gefen.hybrid.adamw_participant import PreparedChildLoad
from gefen.hybrid.composite import child_presence_mask
from gefen.hybrid.flat_layout import join, split
from gefen.hybrid.group_form import check_scheduled_momentum

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["PreparedHybridLoad", "build_hybrid_state_dict", "prepare_hybrid_load"]

_PREFIX = "GefenMuonHybrid checkpoint: "


def build_hybrid_state_dict(hybrid: HybridInterface) -> dict[str, Any]:
    """torch's flat layout (``gefen.hybrid.flat_layout.join``) of the children's public
    ``state_dict()`` (their hooks fire)."""
    nested: dict[str, Any] = {"muon": None, "backup": None}
    offset = 0
    for (role, participant), child in zip(hybrid.participants, hybrid.children, strict=True):
        try:
            nested[role] = participant.state_dict()
        except Exception as error:
            if offset and error.args and isinstance(error.args[0], str):
                # noted, not rewritten: the text may be a hook's own (as a load notes it)
                where = f" [numbered within the {role}: its group g is the hybrid's "
                error.args = (f"{error.args[0]}{where}param_groups[g + {offset}]]",
                              *error.args[1:])  # fmt: skip
            raise
        offset += len(child.param_groups)
    nested["backup_optimizer"] = hybrid.backup_optimizer
    return join(nested)


@dataclass(eq=False)
class PreparedHybridLoad:
    """Both children's staged loads; ``commit`` cannot fail."""

    hybrid: HybridInterface
    muon: PreparedChildLoad | None
    backup: PreparedChildLoad | None

    @property
    def replica_words(self) -> tuple[int, int]:
        """Both children's replica words, folded (what the load vote compares)."""
        words = [child.replica_words for child in (self.muon, self.backup) if child is not None]
        if all(word == (0, 0) for word in words):
            return (0, 0)
        digest = hashlib.blake2b(repr(words).encode(), digest_size=7).digest()
        return int.from_bytes(digest, "big"), sum(count for _, count in words)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The groups the load would publish, Muon's first (the hybrid's order)."""
        children = (self.muon, self.backup)
        return [group for child in children if child is not None for group in child.param_groups]

    def agree(self, operation: GuardedOperation) -> None:
        """With a codebook scope the child-presence header first (as a step's), then each
        child's agreement (its load header, its rank-local records)."""
        if operation.binding is not None:
            operation.header(OP_LOAD, [child_presence_mask(self.hybrid)], ["child_presence"])
        for prepared in (self.muon, self.backup):
            if prepared is not None:
                prepared.agree(operation)

    def commit(self) -> None:
        self.hybrid.publish_load(self.muon, self.backup)

    def run_post_hooks(self) -> None:
        for prepared in (self.muon, self.backup):
            if prepared is not None:
                prepared.run_post_hooks()
        run_load_post_hooks(self.hybrid)


def _check_halves(hybrid: HybridInterface, sd: Mapping[str, Any]) -> None:
    for half, live in (("muon", hybrid.muon), ("backup", hybrid.backup)):
        saved = sd.get(half)
        if live is None and saved is not None:
            raise ValueError(f"{_PREFIX}carries a '{half}' half but this optimizer has none")
        if live is not None and saved is None:
            raise ValueError(
                f"{_PREFIX}lacks the '{half}' half; loading would silently reset its state"
            )
    if sd.get("backup") is not None:
        saved_tag = sd.get("backup_optimizer")
        if saved_tag != hybrid.backup_optimizer or type(saved_tag) is not str:
            raise ValueError(
                f"{_PREFIX}backup_optimizer={saved_tag!r} does not match "
                f"backup_optimizer={hybrid.backup_optimizer!r}; there is no cross-backend "
                "conversion"
            )


def prepare_hybrid_load(hybrid: HybridInterface, state_dict: Any) -> PreparedHybridLoad:
    """Steps 1–5 of §8: nothing of the hybrid, its children or the caller's dict changes."""
    hybrid.check_layout()
    copied = copy_with_load_pre_hooks(hybrid, copy_containers(state_dict))
    nested = split(hybrid, copied)
    _check_halves(hybrid, nested)
    _check_names(copied)
    groups, ids = _muon_part_size(nested.get("muon"))
    staged = {}
    for role, participant in hybrid.participants:
        try:
            staged[role] = participant.prepare_load_state_dict(nested[role])
        except Exception as error:
            if role == "backup" and (groups or ids):
                _number_as_the_checkpoint(error, groups, ids)
            raise
    if nested.get("backup") is not None:  # the step reads it as beta1: refuse it here, not then
        check_scheduled_momentum(
            nested["backup"]["param_groups"], first_index=groups, where=f"{_PREFIX}param_groups"
        )
    return PreparedHybridLoad(hybrid, staged.get("muon"), staged.get("backup"))


def _check_names(checkpoint: Any) -> None:
    """Refuse ``param_names`` that name two parameters alike, across both children (each child
    checks only its own groups): the constructor and ``add_param_group`` refuse them too."""
    listed = checkpoint.get("param_groups") if isinstance(checkpoint, Mapping) else None
    seen: dict[object, object] = {}
    for index, group in enumerate(listed if isinstance(listed, list) else ()):
        names = group.get("param_names") if isinstance(group, Mapping) else None
        ids = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(names, list) or not isinstance(ids, list):
            continue
        for name, pid in zip(names, ids, strict=False):  # the children check the lengths
            if isinstance(name, str) and seen.setdefault(name, pid) != pid:
                raise ValueError(
                    f"{_PREFIX}param_groups[{index}]: duplicate parameter name {name!r} (two "
                    "parameter ids share it)"
                )


def _muon_part_size(muon: Any) -> tuple[int, int]:
    """How many groups and parameter ids the checkpoint lists before the backup's part."""
    listed = muon.get("param_groups") if isinstance(muon, Mapping) else None
    if not isinstance(listed, list):
        return 0, 0
    params = [group.get("params") if isinstance(group, Mapping) else None for group in listed]
    return len(listed), sum(len(ids) for ids in params if isinstance(ids, list))


def _number_as_the_checkpoint(error: Exception, groups: int, ids: int) -> None:
    """The backup checks its own part of the checkpoint, numbered from its first group and id:
    say how those numbers map to the checkpoint's (appended to the message, type unchanged)."""
    if error.args and isinstance(error.args[0], str):
        where = (
            f" [numbered within the backup's part: its group g is the checkpoint's "
            f"param_groups[g + {groups}], its parameter id i the checkpoint's id i + {ids}]"
        )
        error.args = (error.args[0] + where, *error.args[1:])
