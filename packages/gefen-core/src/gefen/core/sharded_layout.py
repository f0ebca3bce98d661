"""What ``post_sharding`` records: each slot's rebinding and the finalized layout (§13).

``ParameterRebinding`` is the adapter's input (one per original slot); ``Finalized`` is what the
optimizer keeps once the finalization committed: the live tensors per group, every local shard
with its tensor, and the codebook scope's binding and fingerprints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch import Tensor

from gefen.contracts import LogicalSlice, ParameterLayout, ShardIdentity, ShardingManifest
from gefen.dist import CodebookProcessGroupBinding

__all__ = ["Finalized", "ParameterRebinding"]


@dataclass(frozen=True, eq=False)
class ParameterRebinding:
    """What one original slot has become: ``new_parameter`` (None: this rank is a non-owner of a
    whole-parameter-owner slot, which is pruned locally) and its ``shard`` identity."""

    old_parameter: Tensor
    new_parameter: Tensor | None
    shard: ShardIdentity

    def __post_init__(self) -> None:
        if type(self.shard) is not ShardIdentity:
            raise TypeError(
                f"ParameterRebinding.shard must be a gefen.contracts.ShardIdentity, got "
                f"{type(self.shard).__name__}"
            )


@dataclass(frozen=True)
class Finalized:
    """The finalized layout: per group the live tensors (pruned slots removed), every local
    shard in canonical order with its tensor (None when pruned), and the scope."""

    group_params: tuple[tuple[Tensor, ...], ...]
    group_shards: tuple[tuple[ShardIdentity, ...], ...]
    shards: tuple[tuple[ShardIdentity, Tensor | None], ...]
    manifest: ShardingManifest
    binding: CodebookProcessGroupBinding | None
    scope_fingerprint: bytes | None
    manifest_fingerprint: bytes

    @cached_property
    def presence_compared(self) -> tuple[bool, ...]:
        """Per local shard: whether its gradient presence must agree across members (the rule
        of the contribution records, docs/dist.md §9.6): replicated shards, and flattened ones
        where no member's shard is empty. Read from the global manifest, so equal on members."""
        compared = []
        for shard, _ in self.shards:
            if shard.layout is ParameterLayout.REPLICATED:
                compared.append(True)
            elif shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
                peers = self.manifest.for_parameter(shard.parameter.fqn)
                compared.append(all(_extent_length(peer) > 0 for peer in peers))
            else:
                compared.append(False)
        return tuple(compared)

    def presence_pattern(self) -> list[bool | None]:
        """This member's gradient presence at the compared shards (None elsewhere)."""
        return [
            (tensor is not None and tensor.grad is not None) if compared else None
            for (_, tensor), compared in zip(self.shards, self.presence_compared, strict=True)
        ]

    def replicated_positions(self) -> list[int] | None:
        """Flat positions (group order) of the replicated shards: their state is a replica."""
        layouts = [shard.layout for shards in self.group_shards for shard in shards]
        replicated = [i for i, layout in enumerate(layouts) if layout is ParameterLayout.REPLICATED]
        return replicated or None

    def layout_intact(self, param_groups: Sequence[Any]) -> bool:
        """Each group's live ``params`` still holds the finalized tensors (``is``, in order)."""
        if len(param_groups) != len(self.group_params):
            return False
        for group, expected in zip(param_groups, self.group_params, strict=True):
            params = group["params"]
            if len(params) != len(expected) or any(
                a is not b for a, b in zip(params, expected, strict=True)
            ):
                return False
        return True


def _extent_length(shard: ShardIdentity) -> int:
    """Elements of the shard's extent (a flat slice, or a region's box)."""
    extent = shard.extent
    if isinstance(extent, LogicalSlice):
        return extent.length
    return math.prod(extent.lengths)
