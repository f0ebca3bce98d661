"""The hybrid's ``post_sharding`` forwarding and its shared codebook binding (docs/hybrid.md §6).

The rebindings are split per child through the ownership registry, each child gets the manifest
restricted to its FQNs, both children are prepared (Muon first) and only then committed, so one
binding object is installed on both children or on none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from gefen.contracts import ShardingManifest
from gefen.core import ParameterRebinding
from gefen.core.extension import OptimizerShell, PreparedFinalization
from gefen.dist import CodebookProcessGroupBinding, ProcessGroupBinding

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["children_binding", "forward_post_sharding"]


def children_binding(hybrid: HybridInterface) -> ProcessGroupBinding | None:
    """The one binding every Gefen-backed child carries, or None; different ones → error."""
    bindings = {id(child.binding): child.binding for _, child in hybrid.participants}
    if len(bindings) > 1:
        raise RuntimeError("GefenMuonHybrid children carry different codebook bindings")
    return next(iter(bindings.values()), None)


def forward_post_sharding(
    hybrid: HybridInterface,
    rebindings: Iterable[ParameterRebinding],
    manifest: ShardingManifest,
    binding: CodebookProcessGroupBinding | None,
) -> None:
    """Prepare every present child, then commit all of them and rebuild the registry."""
    if hybrid.backup_optimizer == "adamw" and hybrid.backup is not None:
        raise NotImplementedError(
            "GefenMuonHybrid post_sharding needs Gefen-backed children; the AdamW backup has no "
            "codebook scope"
        )
    if type(manifest) is not ShardingManifest:
        raise TypeError(f"manifest must be a ShardingManifest, got {type(manifest).__name__}")
    per_child: dict[int, list[ParameterRebinding]] = {id(c): [] for c in hybrid.children}
    for rebinding in rebindings:
        if type(rebinding) is not ParameterRebinding:
            raise TypeError("rebindings must hold ParameterRebinding records")
        owner = hybrid.owner_of(rebinding.old_parameter)
        if owner is None:
            raise ValueError(
                f"post_sharding: {rebinding.shard.parameter.fqn}: the source is not a parameter "
                "of this GefenMuonHybrid"
            )
        per_child[id(owner)].append(rebinding)
    named = {r.shard.parameter.fqn for mine in per_child.values() for r in mine}
    stray = sorted({s.parameter.fqn for s in manifest.shards} - named)
    if stray:  # each child sees only its own FQNs' shards: the rest would drop unchecked
        raise ValueError(
            f"post_sharding: {stray[0]}: the manifest's FQN set differs from the rebindings' "
            "(the manifest names a parameter no rebinding does)"
        )
    prepared: list[PreparedFinalization] = []
    for child in hybrid.children:
        assert isinstance(child, OptimizerShell)
        mine = per_child[id(child)]
        fqns = {r.shard.parameter.fqn for r in mine}
        shards = tuple(s for s in manifest.shards if s.parameter.fqn in fqns)
        restricted = ShardingManifest(shards) if shards else manifest
        prepared.append(
            child.prepare_post_sharding(mine, manifest=restricted, codebook_process_group=binding)
        )
    for finalization in prepared:
        finalization.commit()
    hybrid.rebuild_registry()
