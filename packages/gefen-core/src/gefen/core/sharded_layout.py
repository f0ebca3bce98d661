"""What ``post_sharding`` records: each slot's rebinding and the finalized layout (§13).

``ParameterRebinding`` is the adapter's input (one per original slot); ``Finalized`` is what the
optimizer keeps once the finalization committed: the live tensors per group, every local shard
with its tensor, and the codebook scope's binding and fingerprints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gefen.contracts import ShardIdentity, ShardingManifest
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
