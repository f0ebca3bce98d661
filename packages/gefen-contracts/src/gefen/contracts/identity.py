"""Identity value types: parameters, process groups, placements and extents (spec 40 §6).

They let every rank derive the same collective schedule without communicating, so they hold no
runtime handle and no global rank: a member is a name, and its coordinate is its position in the
group's ordered member list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gefen.contracts._base import (
    ContractValue,
    EnumKind,
    FqnKind,
    IntKind,
    NameKind,
    NestedKind,
    OptionalKind,
    SchemaVersionKind,
    TupleKind,
    meta,
)
from gefen.contracts._check import check_exact, check_str, value_error
from gefen.contracts.enums import IDENTITY_SCHEMA_VERSION, PlacementKind

_SCHEMA = meta(SchemaVersionKind(IDENTITY_SCHEMA_VERSION))
_NAME = meta(NameKind())
_SIZE = meta(IntKind(minimum=0))
_SIZES = meta(TupleKind(IntKind(minimum=0)))


@dataclass(frozen=True)
class ParameterIdentity(ContractValue):
    """A parameter by fully-qualified name and global (unsharded) shape; ``()`` is a scalar."""

    fqn: str = field(metadata=meta(FqnKind()))
    global_shape: tuple[int, ...] = field(metadata=_SIZES)
    schema_version: int = field(default=IDENTITY_SCHEMA_VERSION, metadata=_SCHEMA)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)


@dataclass(frozen=True)
class ProcessGroupIdentity(ContractValue):
    """A process group by adapter label and ordered member names; member ``i`` has coordinate ``i``.

    The order is authoritative and never sorted: it is what every rank agrees on.
    """

    semantic_name: str = field(metadata=_NAME)
    ordered_members: tuple[str, ...] = field(
        metadata=meta(TupleKind(NameKind(), unique=True, non_empty=True, what="member"))
    )
    schema_version: int = field(default=IDENTITY_SCHEMA_VERSION, metadata=_SCHEMA)

    @property
    def size(self) -> int:
        return len(self.ordered_members)

    def coordinate(self, member: str) -> int:
        """The index of ``member`` in ``ordered_members``."""
        check_str("ProcessGroupIdentity.coordinate.member", member)
        if member not in self.ordered_members:
            raise value_error(
                "ProcessGroupIdentity.coordinate.member",
                f"not a member of process group {self.semantic_name!r}",
                member,
            )
        return self.ordered_members.index(member)


@dataclass(frozen=True)
class ShardPlacement(ContractValue):
    """Placement of one shard on one mesh axis."""

    mesh_axis: str = field(metadata=_NAME)
    kind: PlacementKind = field(metadata=meta(EnumKind(PlacementKind)))
    coordinate: int = field(metadata=_SIZE)
    parts: int = field(metadata=meta(IntKind(minimum=1)))
    parameter_dimension: int | None = field(
        default=None, metadata=meta(OptionalKind(IntKind(minimum=0)))
    )

    def _validate(self) -> None:
        if self.coordinate >= self.parts:
            raise value_error(
                "ShardPlacement.coordinate",
                f"must be within [0, parts) = [0, {self.parts})",
                self.coordinate,
            )
        sharded = self.kind is PlacementKind.DIMENSION_SHARD
        if sharded and self.parameter_dimension is None:
            raise value_error(
                "ShardPlacement.parameter_dimension",
                "a dimension_shard placement requires a parameter dimension",
                None,
            )
        if not sharded and self.parameter_dimension is not None:
            raise value_error(
                "ShardPlacement.parameter_dimension",
                f"only a dimension_shard placement takes one, not {self.kind.value!r}",
                self.parameter_dimension,
            )

    @property
    def sort_key(self) -> tuple[str, str, int, int, int]:
        """``(mesh_axis, kind.value, coordinate, parts, dimension or -1)``; golden-tested."""
        dimension = -1 if self.parameter_dimension is None else self.parameter_dimension
        return (self.mesh_axis, self.kind.value, self.coordinate, self.parts, dimension)

    @property
    def topology_key(self) -> tuple[str, PlacementKind, int, int | None]:
        """What every member of one placement topology shares (everything but the coordinate)."""
        return (self.mesh_axis, self.kind, self.parts, self.parameter_dimension)


@dataclass(frozen=True)
class LogicalSlice(ContractValue):
    """A contiguous row-major range ``[flat_offset, flat_offset + length)`` of a parameter."""

    TAG = "logical_slice"

    flat_offset: int = field(metadata=_SIZE)
    length: int = field(metadata=_SIZE)

    @classmethod
    def full(cls, parameter: ParameterIdentity) -> LogicalSlice:
        check_exact("LogicalSlice.full.parameter", parameter, ParameterIdentity)
        return cls(0, parameter.numel)

    @property
    def end(self) -> int:
        return self.flat_offset + self.length

    @property
    def numel(self) -> int:
        return self.length


@dataclass(frozen=True)
class LogicalRegion(ContractValue):
    """A box of a parameter: per axis an offset and a length (``()``/``()`` is a whole scalar)."""

    TAG = "logical_region"

    offsets: tuple[int, ...] = field(metadata=_SIZES)
    lengths: tuple[int, ...] = field(metadata=_SIZES)

    def _validate(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise value_error(
                "LogicalRegion.lengths",
                f"offsets and lengths must have the same rank ({len(self.offsets)})",
                self.lengths,
            )

    @property
    def rank(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @classmethod
    def full(cls, parameter: ParameterIdentity) -> LogicalRegion:
        check_exact("LogicalRegion.full.parameter", parameter, ParameterIdentity)
        shape = parameter.global_shape
        return cls((0,) * len(shape), shape)

    def validate_bounds(
        self, parameter: ParameterIdentity, *, location: str = "LogicalRegion"
    ) -> None:
        """Raise unless this region lies inside ``parameter`` (same rank, every end <= dim)."""
        check_exact("LogicalRegion.validate_bounds.parameter", parameter, ParameterIdentity)
        shape = parameter.global_shape
        if self.rank != len(shape):
            raise value_error(
                location,
                f"region rank {self.rank} must equal the rank {len(shape)} of {parameter.fqn!r}",
                self,
            )
        for axis, (offset, length, size) in enumerate(
            zip(self.offsets, self.lengths, shape, strict=True)
        ):
            if offset + length > size:
                raise value_error(
                    location,
                    f"region exceeds dimension {axis} (size {size}) of {parameter.fqn!r}",
                    self,
                )

    def intersection(self, other: LogicalRegion) -> LogicalRegion:
        """Per axis the overlap of both ranges, its length clamped at 0."""
        check_exact("LogicalRegion.intersection.other", other, LogicalRegion)
        if other.rank != self.rank:
            raise value_error(
                "LogicalRegion.intersection.other",
                f"regions must have the same rank ({self.rank})",
                other,
            )
        offsets = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        ends = (min(a + m, b + n) for a, m, b, n in self._axes(other))
        lengths = tuple(max(0, end - start) for end, start in zip(ends, offsets, strict=True))
        return LogicalRegion(offsets, lengths)

    def _axes(self, other: LogicalRegion) -> zip[tuple[int, int, int, int]]:
        return zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True)

    def overlaps(self, other: LogicalRegion) -> bool:
        """True when the regions share an element; touching regions do not overlap."""
        return self.intersection(other).numel > 0

    @staticmethod
    def validate_exact_coverage(
        parameter: ParameterIdentity, regions: Sequence[LogicalRegion]
    ) -> None:
        """Raise unless ``regions`` tile ``parameter`` exactly, in any order (empties allowed)."""
        location = "LogicalRegion.validate_exact_coverage.regions"
        check_exact("LogicalRegion.validate_exact_coverage.parameter", parameter, ParameterIdentity)
        checked = TupleKind(NestedKind("LogicalRegion")).check(location, regions)
        assert isinstance(checked, tuple)
        for index, region in enumerate(checked):
            region.validate_bounds(parameter, location=f"{location}[{index}]")
        for later, region in enumerate(checked):
            for earlier in range(later):
                if region.overlaps(checked[earlier]):
                    raise value_error(
                        f"{location}[{later}]", f"region overlaps region {earlier}", region
                    )
        covered = sum(region.numel for region in checked)
        if covered != parameter.numel:
            raise value_error(
                location,
                f"regions cover {covered} of the {parameter.numel} elements of {parameter.fqn!r}",
            )
