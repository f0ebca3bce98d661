"""``ShardingManifest``: the complete, validated global shard set of one optimizer (spec 40 §6).

Every rank builds the same manifest from the same inputs, in any order, so the sorted shard tuple
is what ranks derive their collective schedule from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from gefen.contracts._base import ContractValue, NestedKind, SchemaVersionKind, TupleKind, meta
from gefen.contracts._check import check_str, value_error
from gefen.contracts.enums import IDENTITY_SCHEMA_VERSION, ParameterLayout, PlacementKind
from gefen.contracts.errors import ContractValueError
from gefen.contracts.identity import LogicalRegion, LogicalSlice
from gefen.contracts.shards import ShardIdentity

_Entries = list[tuple[int, ShardIdentity]]
_GAPLESS = "must be gapless and non-overlapping"


def _error(index: int, rule: str, *value: object) -> ContractValueError:
    return value_error(f"ShardingManifest.shards[{index}]", rule, *value)


@dataclass(frozen=True)
class ShardingManifest(ContractValue):
    """A non-empty set of ``ShardIdentity`` values, sorted by ``sort_key``, covering each FQN."""

    shards: tuple[ShardIdentity, ...] = field(
        metadata=meta(TupleKind(NestedKind("ShardIdentity"), non_empty=True))
    )
    schema_version: int = field(
        default=IDENTITY_SCHEMA_VERSION, metadata=meta(SchemaVersionKind(IDENTITY_SCHEMA_VERSION))
    )

    def _validate(self) -> None:
        ordered = tuple(sorted(self.shards, key=lambda shard: shard.sort_key))
        self._set("shards", ordered)
        seen: set[ShardIdentity] = set()
        for index, shard in enumerate(ordered):
            if shard in seen:
                raise _error(index, "duplicate shard", shard)
            seen.add(shard)
        # The spec checks the version before the per-parameter rules, unlike other types.
        self._check_schema_version()
        for entries in self._entries_by_fqn().values():
            _check_parameter(entries)

    def _entries_by_fqn(self) -> dict[str, _Entries]:
        grouped: dict[str, _Entries] = {}
        for index, shard in enumerate(self.shards):
            grouped.setdefault(shard.parameter.fqn, []).append((index, shard))
        return grouped

    @cached_property
    def _index(self) -> dict[str, tuple[ShardIdentity, ...]]:
        return {
            fqn: tuple(shard for _, shard in entries)
            for fqn, entries in self._entries_by_fqn().items()
        }

    @property
    def fqns(self) -> tuple[str, ...]:
        """Every parameter name in the manifest, sorted."""
        return tuple(sorted(self._index))

    def for_parameter(self, fqn: str) -> tuple[ShardIdentity, ...]:
        """That parameter's shards in manifest order; ``()`` for an unknown name."""
        check_str("ShardingManifest.for_parameter.fqn", fqn)
        return self._index.get(fqn, ())


def _check_parameter(entries: _Entries) -> None:
    _check_uniform(entries)
    first = entries[0][1]
    if first.process_group is None:
        if len(entries) != 1:
            rule = f"an ungrouped parameter {first.parameter.fqn!r} has exactly one shard"
            raise _error(entries[1][0], rule)
    else:
        _check_members(entries)
        _check_topology(entries)
    if first.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        _check_flat_tiling(entries)
    elif first.layout is ParameterLayout.WHOLE_PARAMETER_OWNER:
        for index, shard in entries:
            if shard.owner != first.owner:
                raise _error(index, f"every shard of {shard.parameter.fqn!r} names one owner")
    elif (
        first.layout is ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
        and first.placements[0].kind is PlacementKind.DIMENSION_SHARD
    ):
        _check_dimension_tiling(entries)


def _check_uniform(entries: _Entries) -> None:
    first = entries[0][1]
    fqn = first.parameter.fqn
    for index, shard in entries[1:]:
        if shard.parameter != first.parameter:
            raise _error(index, f"every shard of {fqn!r} carries one ParameterIdentity")
        if shard.layout is not first.layout:
            raise _error(index, f"every shard of {fqn!r} has one layout", shard.layout)
        if shard.process_group != first.process_group:
            raise _error(index, f"every shard of {fqn!r} uses one process group")


def _check_members(entries: _Entries) -> None:
    first = entries[0][1]
    group = first.process_group
    assert group is not None
    held: set[str | None] = set()
    for index, shard in entries:
        if shard.local_member in held:
            fqn = shard.parameter.fqn
            raise _error(
                index, f"member {shard.local_member!r} holds more than one shard of {fqn!r}"
            )
        held.add(shard.local_member)
    for member in group.ordered_members:
        if member not in held:
            rule = f"missing member {member!r} of process group {group.semantic_name!r}"
            raise _error(entries[0][0], f"{rule} for {first.parameter.fqn!r}")


def _check_topology(entries: _Entries) -> None:
    topology = tuple(placement.topology_key for placement in entries[0][1].placements)
    for index, shard in entries[1:]:
        if tuple(placement.topology_key for placement in shard.placements) != topology:
            rule = f"every shard of {shard.parameter.fqn!r} shares one placement topology"
            raise _error(index, rule)


def _slice(shard: ShardIdentity) -> LogicalSlice:
    assert isinstance(shard.extent, LogicalSlice)
    return shard.extent


def _coordinate(shard: ShardIdentity) -> int:
    return shard.placements[0].coordinate


def _check_flat_tiling(entries: _Entries) -> None:
    ordered = sorted(
        entries, key=lambda entry: (_slice(entry[1]).flat_offset, _coordinate(entry[1]))
    )
    parameter = ordered[0][1].parameter
    cursor, boundaries, last = 0, {0}, ordered[0][0]
    for index, shard in ordered:
        extent = _slice(shard)
        if extent.length == 0:
            continue
        if extent.flat_offset != cursor:
            raise _error(index, f"flattened shards {_GAPLESS}", extent)
        cursor, last = extent.end, index
        boundaries.add(cursor)
    if cursor != parameter.numel:
        rule = f"flattened shards {_GAPLESS}; they cover [0, {cursor}) of {parameter.numel}"
        raise _error(last, rule)
    for index, shard in ordered:
        extent = _slice(shard)
        if extent.length == 0 and extent.flat_offset not in boundaries:
            rule = "an empty flattened slice must sit on a partition boundary"
            raise _error(index, rule, extent)


def _check_dimension_tiling(entries: _Entries) -> None:
    ordered = sorted(entries, key=lambda entry: _coordinate(entry[1]))
    first = ordered[0][1]
    axis = first.placements[0].parameter_dimension
    assert axis is not None
    size = first.parameter.global_shape[axis]
    cursor = 0
    for index, shard in ordered:
        region = shard.extent
        assert isinstance(region, LogicalRegion)
        if region.offsets[axis] != cursor:
            rule = f"dimension shards {_GAPLESS} along dimension {axis} in coordinate order"
            raise _error(index, rule, region)
        cursor += region.lengths[axis]
    if cursor != size:
        rule = f"dimension shards {_GAPLESS}; they cover {cursor} of {size} along dimension {axis}"
        raise _error(ordered[-1][0], rule)
