"""``ShardIdentity``: which part of which parameter one rank holds, and how (spec 40 §6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gefen.contracts._base import (
    ContractValue,
    EnumKind,
    NameKind,
    NestedKind,
    OptionalKind,
    SchemaVersionKind,
    TupleKind,
    meta,
)
from gefen.contracts._check import type_error, value_error
from gefen.contracts.enums import IDENTITY_SCHEMA_VERSION, ParameterLayout, PlacementKind
from gefen.contracts.identity import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardPlacement,
)

_LOCATION = "ShardIdentity"
_OPTIONAL_NAME = meta(OptionalKind(NameKind()))


def _row_major_offset(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    linear = 0
    for offset, size in zip(offsets, shape, strict=True):
        linear = linear * size + offset
    return linear


@dataclass(frozen=True)
class ShardIdentity(ContractValue):
    """One rank's shard of one parameter: its extent, placements, group and (optional) owner."""

    parameter: ParameterIdentity = field(metadata=meta(NestedKind("ParameterIdentity")))
    layout: ParameterLayout = field(metadata=meta(EnumKind(ParameterLayout)))
    extent: LogicalSlice | LogicalRegion = field(
        metadata=meta(NestedKind("LogicalSlice", "LogicalRegion"))
    )
    placements: tuple[ShardPlacement, ...] = field(
        default=(), metadata=meta(TupleKind(NestedKind("ShardPlacement")))
    )
    process_group: ProcessGroupIdentity | None = field(
        default=None, metadata=meta(OptionalKind(NestedKind("ProcessGroupIdentity")))
    )
    local_member: str | None = field(default=None, metadata=_OPTIONAL_NAME)
    owner: str | None = field(default=None, metadata=_OPTIONAL_NAME)
    schema_version: int = field(
        default=IDENTITY_SCHEMA_VERSION, metadata=meta(SchemaVersionKind(IDENTITY_SCHEMA_VERSION))
    )

    def _validate(self) -> None:
        # The order is the spec's evaluation order (40 §6, rules 2-6).
        self._check_extent()
        self._normalise_placements()
        self._check_group()
        self._check_owner_and_dimensions()
        self._check_layout_rules()

    def _check_extent(self) -> None:
        location = f"{_LOCATION}.extent"
        extent, parameter = self.extent, self.parameter
        if self.layout is ParameterLayout.DTENSOR_1D_DEFAULT_WORLD:
            if type(extent) is not LogicalRegion:
                raise type_error(location, "a LogicalRegion for a DTensor layout", extent)
            extent.validate_bounds(parameter, location=location)
            return
        if type(extent) is not LogicalSlice:
            raise type_error(location, f"a LogicalSlice for layout {self.layout.value!r}", extent)
        if extent.end > parameter.numel:
            raise value_error(
                location,
                f"slice exceeds the {parameter.numel} elements of {parameter.fqn!r}",
                extent,
            )

    def _normalise_placements(self) -> None:
        ordered = tuple(sorted(self.placements, key=lambda placement: placement.mesh_axis))
        for index in range(1, len(ordered)):
            if ordered[index].mesh_axis == ordered[index - 1].mesh_axis:
                raise value_error(
                    f"{_LOCATION}.placements", "mesh axes must be unique", ordered[index].mesh_axis
                )
        self._set("placements", ordered)

    def _check_group(self) -> None:
        group = self.process_group
        if group is None:
            if self.local_member is not None:
                raise value_error(
                    f"{_LOCATION}.local_member", "an ungrouped shard has none", self.local_member
                )
            if self.owner is not None:
                raise value_error(f"{_LOCATION}.owner", "an ungrouped shard has none", self.owner)
            return
        members = group.ordered_members
        rule = f"must be a member of process group {group.semantic_name!r}"
        if self.local_member is None or self.local_member not in members:
            raise value_error(f"{_LOCATION}.local_member", rule, self.local_member)
        if self.owner is not None and self.owner not in members:
            raise value_error(f"{_LOCATION}.owner", rule, self.owner)
        coordinate = group.coordinate(self.local_member)
        for index, placement in enumerate(self.placements):
            location = f"{_LOCATION}.placements[{index}]"
            if placement.parts != len(members):
                rule = f"must equal the {len(members)} members of {group.semantic_name!r}"
                raise value_error(f"{location}.parts", rule, placement.parts)
            if placement.coordinate != coordinate:
                rule = f"must equal the local member's coordinate {coordinate}"
                raise value_error(f"{location}.coordinate", rule, placement.coordinate)

    def _check_owner_and_dimensions(self) -> None:
        if self.owner is not None and self.layout is not ParameterLayout.WHOLE_PARAMETER_OWNER:
            raise value_error(
                f"{_LOCATION}.owner",
                f"only a whole_parameter_owner shard names an owner, not {self.layout.value!r}",
                self.owner,
            )
        rank = len(self.parameter.global_shape)
        for index, placement in enumerate(self.placements):
            dimension = placement.parameter_dimension
            if dimension is not None and dimension >= rank:
                raise value_error(
                    f"{_LOCATION}.placements[{index}].parameter_dimension",
                    f"must be < the parameter rank {rank}",
                    dimension,
                )

    def _require_group(self) -> None:
        if self.process_group is None:
            raise value_error(
                f"{_LOCATION}.process_group",
                f"a {self.layout.value} shard requires a process group",
                None,
            )

    def _single_placement(self, *allowed: PlacementKind) -> ShardPlacement:
        if len(self.placements) != 1:
            raise value_error(
                f"{_LOCATION}.placements",
                f"a {self.layout.value} shard takes exactly one placement",
                self.placements,
            )
        placement = self.placements[0]
        if placement.kind not in allowed:
            names = " or ".join(kind.value for kind in allowed)
            raise value_error(
                f"{_LOCATION}.placements[0].kind",
                f"a {self.layout.value} shard takes a {names} placement",
                placement.kind,
            )
        return placement

    def _require_full(self, rule: str) -> None:
        full: LogicalSlice | LogicalRegion
        if type(self.extent) is LogicalRegion:
            full = LogicalRegion.full(self.parameter)
        else:
            full = LogicalSlice.full(self.parameter)
        if self.extent != full:
            raise value_error(f"{_LOCATION}.extent", rule, self.extent)

    def _check_layout_rules(self) -> None:
        layout = self.layout
        if layout is ParameterLayout.REPLICATED:
            self._check_replicated()
        elif layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
            self._check_flattened()
        elif layout is ParameterLayout.WHOLE_PARAMETER_OWNER:
            self._check_whole_owner()
        else:
            self._check_dtensor()

    def _check_replicated(self) -> None:
        self._require_full("a replicated shard must cover the full parameter")
        if self.process_group is None:
            if self.placements:
                raise value_error(
                    f"{_LOCATION}.placements",
                    "an ungrouped replicated shard takes no placements",
                    self.placements,
                )
            return
        self._single_placement(PlacementKind.REPLICATE)

    def _check_flattened(self) -> None:
        self._require_group()
        self._single_placement(PlacementKind.FLAT_SHARD)

    def _check_whole_owner(self) -> None:
        self._require_group()
        if self.owner is None:
            raise value_error(f"{_LOCATION}.owner", "a whole_parameter_owner shard needs one", None)
        self._single_placement(PlacementKind.WHOLE_PARAMETER_OWNER)
        if self.owner == self.local_member:
            self._require_full("the owner's shard must cover the full parameter")
        elif self.extent != LogicalSlice(0, 0):
            raise value_error(
                f"{_LOCATION}.extent",
                "a non-owner's shard must be exactly LogicalSlice(0, 0)",
                self.extent,
            )

    def _check_dtensor(self) -> None:
        self._require_group()
        placement = self._single_placement(PlacementKind.DIMENSION_SHARD, PlacementKind.REPLICATE)
        if placement.kind is PlacementKind.REPLICATE:
            self._require_full("a replicate DTensor region must cover the full parameter")
            return
        region = self.extent
        assert isinstance(region, LogicalRegion)
        shape = self.parameter.global_shape
        for axis, size in enumerate(shape):
            if axis == placement.parameter_dimension:
                continue
            if region.offsets[axis] != 0 or region.lengths[axis] != size:
                raise value_error(
                    f"{_LOCATION}.extent",
                    f"a dimension shard must cover unsharded dimension {axis} (size {size})",
                    region,
                )

    @property
    def sort_key(self) -> tuple[Any, ...]:
        """The authoritative manifest order (golden-tested; spec 40 §6)."""
        extent = self.extent
        if type(extent) is LogicalSlice:
            offset, length = extent.flat_offset, extent.length
        else:
            assert isinstance(extent, LogicalRegion)
            offset = _row_major_offset(extent.offsets, self.parameter.global_shape)
            length = extent.numel
        group = self.process_group
        name = "" if group is None else group.semantic_name
        member = (
            -1
            if group is None or self.local_member is None
            else group.coordinate(self.local_member)
        )
        owner = -1 if group is None or self.owner is None else group.coordinate(self.owner)
        placements = tuple(placement.sort_key for placement in self.placements)
        key: tuple[Any, ...] = (self.parameter.fqn, offset, length, self.layout.value, name)
        key += (member, owner, placements)
        if isinstance(extent, LogicalRegion):
            key += (extent.offsets, extent.lengths)
        return key
