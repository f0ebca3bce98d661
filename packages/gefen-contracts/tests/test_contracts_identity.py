"""Identity types and ShardIdentity rules (spec 40 §6, §12)."""

from __future__ import annotations

from typing import Any

import pytest

from gefen.contracts import (
    ContractTypeError,
    ContractValueError,
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ParameterLayout,
    PlacementKind,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardingManifest,
    ShardPlacement,
)

REPLICATED = ParameterLayout.REPLICATED
FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD
OWNER = ParameterLayout.WHOLE_PARAMETER_OWNER
DTENSOR = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
GROUP = ProcessGroupIdentity("dp", ("rank:0", "rank:1"))
MATRIX = ParameterIdentity("layer.weight", (4, 6))


def placement(kind: PlacementKind, coordinate: int = 1, **extra: Any) -> ShardPlacement:
    return ShardPlacement("data_parallel", kind, coordinate, 2, **extra)


def shard(
    layout: ParameterLayout, extent: Any, kind: PlacementKind | None, **extra: Any
) -> ShardIdentity:
    member = extra.pop("local_member", "rank:1")
    coordinate = GROUP.coordinate(member)
    placements = [] if kind is None else [placement(kind, coordinate, **extra.pop("p", {}))]
    parameter = extra.pop("parameter", MATRIX)
    return ShardIdentity(parameter, layout, extent, placements, GROUP, member, **extra)


def row_shard(offset: int, rows: int, **extra: Any) -> ShardIdentity:
    region = LogicalRegion((offset, 0), (rows, 6))
    return shard(
        DTENSOR, region, PlacementKind.DIMENSION_SHARD, p={"parameter_dimension": 0}, **extra
    )


class TestParameterIdentity:
    @pytest.mark.parametrize("fqn", ["", " a", "a ", "a.", ".a", "a..b", "a\0b", "\ud800"])
    def test_fqn_value_rules(self, fqn: str) -> None:
        with pytest.raises(ContractValueError, match=r"^ParameterIdentity\.fqn: "):
            ParameterIdentity(fqn, (1,))

    def test_fqn_type(self) -> None:
        with pytest.raises(ContractTypeError, match=r"^ParameterIdentity\.fqn must be a str"):
            ParameterIdentity(7, (1,))  # type: ignore[arg-type]

    def test_fqn_case_is_preserved(self) -> None:
        assert ParameterIdentity("Layer.Weight", (1,)).fqn == "Layer.Weight"
        assert ParameterIdentity("Layer.Weight", (1,)) != ParameterIdentity("layer.weight", (1,))

    @pytest.mark.parametrize(
        ("shape", "error"),
        [
            ((-1,), ContractValueError),
            ((True,), ContractTypeError),
            ((1.5,), ContractTypeError),
            ("8", ContractTypeError),
            (b"8", ContractTypeError),
        ],
    )
    def test_global_shape(self, shape: object, error: type[Exception]) -> None:
        with pytest.raises(error, match=r"^ParameterIdentity\.global_shape"):
            ParameterIdentity("w", shape)  # type: ignore[arg-type]

    @pytest.mark.parametrize(("shape", "numel"), [((), 1), ((0,), 0), ((2, 3), 6), ([4], 4)])
    def test_numel(self, shape: tuple[int, ...], numel: int) -> None:
        assert ParameterIdentity("w", shape).numel == numel


class TestProcessGroupIdentity:
    def test_order_is_kept_and_authoritative(self) -> None:
        group = ProcessGroupIdentity("pipeline:1/dp", ["z", "a", "m"])
        assert group.ordered_members == ("z", "a", "m")
        assert [group.coordinate(m) for m in ("z", "a", "m")] == [0, 1, 2]
        assert group != ProcessGroupIdentity("pipeline:1/dp", ["a", "m", "z"])

    def test_duplicates_and_empty_are_rejected(self) -> None:
        with pytest.raises(ContractValueError, match=r"ordered_members\[2\]: duplicate"):
            ProcessGroupIdentity("dp", ("a", "b", "a"))
        with pytest.raises(ContractValueError, match=r"ordered_members: must not be empty"):
            ProcessGroupIdentity("dp", ())

    def test_coordinate_of_an_absent_member(self) -> None:
        with pytest.raises(ContractValueError, match="not a member"):
            GROUP.coordinate("rank:2")


@pytest.mark.parametrize(
    ("value_type", "args"),
    [
        (ParameterIdentity, ("w", (1,))),
        (ProcessGroupIdentity, ("dp", ("a",))),
        (ShardIdentity, (MATRIX, REPLICATED, LogicalSlice(0, 24))),
        (ShardingManifest, ([ShardIdentity(MATRIX, REPLICATED, LogicalSlice(0, 24))],)),
    ],
)
def test_identity_schema_versions(value_type: type, args: tuple[Any, ...]) -> None:
    assert value_type(*args, schema_version=1) == value_type(*args)
    for version in (True, 1.0):
        with pytest.raises(ContractTypeError, match=rf"^{value_type.__name__}\.schema_version"):
            value_type(*args, schema_version=version)
    for version in (0, 2):
        with pytest.raises(ContractValueError, match="unsupported schema version"):
            value_type(*args, schema_version=version)


class TestShardPlacement:
    def test_coordinate_must_be_within_parts(self) -> None:
        with pytest.raises(
            ContractValueError, match=r"^ShardPlacement\.coordinate: must be within"
        ):
            ShardPlacement("x", PlacementKind.FLAT_SHARD, 2, 2)
        with pytest.raises(ContractValueError, match=r"^ShardPlacement\.parts: must be >= 1"):
            ShardPlacement("x", PlacementKind.FLAT_SHARD, 0, 0)

    def test_dimension_rules(self) -> None:
        with pytest.raises(ContractValueError, match=r"parameter_dimension: a dimension_shard"):
            ShardPlacement("x", PlacementKind.DIMENSION_SHARD, 0, 2)
        for kind in (PlacementKind.REPLICATE, PlacementKind.FLAT_SHARD):
            with pytest.raises(ContractValueError, match=r"parameter_dimension: only"):
                ShardPlacement("x", kind, 0, 2, 0)

    def test_golden_placement_key(self) -> None:
        value = ShardPlacement(
            "data_parallel", PlacementKind.DIMENSION_SHARD, 1, 2, parameter_dimension=0
        )
        assert value.sort_key == ("data_parallel", "dimension_shard", 1, 2, 0)
        flat = ShardPlacement("data_parallel", PlacementKind.FLAT_SHARD, 1, 2)
        assert flat.sort_key == ("data_parallel", "flat_shard", 1, 2, -1)


class TestExtents:
    def test_slice(self) -> None:
        assert LogicalSlice.full(MATRIX) == LogicalSlice(0, 24)
        assert LogicalSlice(4, 2).end == 6
        with pytest.raises(ContractValueError, match=r"^LogicalSlice\.length: must be >= 0"):
            LogicalSlice(0, -1)

    def test_region_types_and_rank(self) -> None:
        with pytest.raises(ContractTypeError, match=r"^LogicalRegion\.offsets\[1\]"):
            LogicalRegion((0, False), (1, 1))
        with pytest.raises(ContractValueError, match="same rank"):
            LogicalRegion((0, 0), (1,))
        region = LogicalRegion([1, 2], [3, 4])
        assert (region.rank, region.numel) == (2, 12)
        assert LogicalRegion((), ()).numel == 1

    def test_region_bounds(self) -> None:
        LogicalRegion((1, 0), (3, 6)).validate_bounds(MATRIX)
        LogicalRegion((4, 0), (0, 6)).validate_bounds(MATRIX)
        with pytest.raises(ContractValueError, match="exceeds"):
            LogicalRegion((2, 0), (3, 6)).validate_bounds(MATRIX)
        with pytest.raises(ContractValueError, match="rank"):
            LogicalRegion((0,), (4,)).validate_bounds(MATRIX)

    def test_full_region(self) -> None:
        assert LogicalRegion.full(MATRIX) == LogicalRegion((0, 0), (4, 6))
        assert LogicalRegion.full(ParameterIdentity("s", ())) == LogicalRegion((), ())

    def test_intersection_and_overlap(self) -> None:
        a = LogicalRegion((0, 0), (2, 6))
        b = LogicalRegion((1, 2), (3, 2))
        touching = LogicalRegion((2, 0), (2, 6))
        assert a.intersection(b) == LogicalRegion((1, 2), (1, 2))
        assert a.overlaps(b)
        assert a.intersection(touching).numel == 0
        assert not a.overlaps(touching)
        far = LogicalRegion((0, 5), (1, 1))
        assert a.intersection(LogicalRegion((3, 0), (1, 1))) == LogicalRegion((3, 0), (0, 1))
        assert a.overlaps(far)
        with pytest.raises(ContractValueError, match="same rank"):
            a.intersection(LogicalRegion((0,), (1,)))

    def test_exact_coverage(self) -> None:
        pieces = [
            LogicalRegion((0, 0), (4, 3)),
            LogicalRegion((0, 3), (2, 3)),
            LogicalRegion((2, 3), (2, 3)),
            LogicalRegion((4, 0), (0, 6)),
        ]
        LogicalRegion.validate_exact_coverage(MATRIX, pieces)
        LogicalRegion.validate_exact_coverage(MATRIX, list(reversed(pieces)))
        overlapping = [*pieces[:3], LogicalRegion((1, 1), (1, 1))]
        with pytest.raises(ContractValueError, match="overlaps"):
            LogicalRegion.validate_exact_coverage(MATRIX, overlapping)
        with pytest.raises(ContractValueError, match="cover 12 of the 24"):
            LogicalRegion.validate_exact_coverage(MATRIX, pieces[1:])
        with pytest.raises(ContractValueError, match="exceeds"):
            LogicalRegion.validate_exact_coverage(MATRIX, [LogicalRegion((0, 0), (5, 6))])


class TestShardIdentity:
    def test_golden_sort_key(self) -> None:
        value = ShardIdentity(
            ParameterIdentity("layer.weight", (8,)),
            FLAT,
            LogicalSlice(4, 4),
            [ShardPlacement("data_parallel", PlacementKind.FLAT_SHARD, 1, 2)],
            GROUP,
            "rank:1",
        )
        assert value.sort_key == (
            "layer.weight",
            4,
            4,
            "flattened_element_shard",
            "dp",
            1,
            -1,
            (("data_parallel", "flat_shard", 1, 2, -1),),
        )

    def test_region_sort_key_uses_row_major_offset_and_appends_the_box(self) -> None:
        value = row_shard(2, 2)
        assert value.sort_key == (
            "layer.weight",
            12,
            12,
            "dtensor_1d_default_world",
            "dp",
            1,
            -1,
            (("data_parallel", "dimension_shard", 1, 2, 0),),
            (2, 0),
            (2, 6),
        )

    def test_extent_type_follows_the_layout(self) -> None:
        with pytest.raises(
            ContractTypeError, match=r"^ShardIdentity\.extent must be a LogicalRegion"
        ):
            shard(DTENSOR, LogicalSlice(0, 24), PlacementKind.REPLICATE)
        with pytest.raises(
            ContractTypeError, match=r"^ShardIdentity\.extent must be a LogicalSlice"
        ):
            shard(FLAT, LogicalRegion((0, 0), (4, 6)), PlacementKind.FLAT_SHARD)

    def test_extent_bounds(self) -> None:
        with pytest.raises(ContractValueError, match="exceeds"):
            shard(FLAT, LogicalSlice(20, 5), PlacementKind.FLAT_SHARD)
        with pytest.raises(ContractValueError, match="exceeds"):
            row_shard(3, 2)

    def test_mesh_axes_are_unique_before_layout_rules(self) -> None:
        parameter = ParameterIdentity("w", (4,))
        group = ProcessGroupIdentity("g", ("a",))
        axes = [ShardPlacement(axis, PlacementKind.REPLICATE, 0, 1) for axis in ("z", "b")]
        with pytest.raises(ContractValueError, match="mesh axes must be unique"):
            ShardIdentity(parameter, REPLICATED, LogicalSlice(0, 4), [axes[0], axes[0]], group, "a")
        # Distinct axes pass rule 3; the replicated layout then allows only one placement.
        with pytest.raises(ContractValueError, match="exactly one placement"):
            ShardIdentity(parameter, REPLICATED, LogicalSlice(0, 4), axes, group, "a")

    def test_ungrouped_shard_has_no_member_or_owner(self) -> None:
        parameter = ParameterIdentity("w", (4,))
        with pytest.raises(ContractValueError, match=r"^ShardIdentity\.local_member"):
            ShardIdentity(parameter, REPLICATED, LogicalSlice(0, 4), local_member="a")
        with pytest.raises(ContractValueError, match=r"^ShardIdentity\.owner"):
            ShardIdentity(parameter, REPLICATED, LogicalSlice(0, 4), owner="a")
        assert ShardIdentity(parameter, REPLICATED, LogicalSlice(0, 4)).placements == ()

    def test_grouped_shard_members_and_coordinates(self) -> None:
        first = [placement(PlacementKind.FLAT_SHARD, 0)]
        half = LogicalSlice(0, 12)
        with pytest.raises(ContractValueError, match=r"^ShardIdentity\.local_member: must be a"):
            ShardIdentity(MATRIX, FLAT, half, first, GROUP, "rank:9")
        with pytest.raises(ContractValueError, match=r"^ShardIdentity\.local_member: must be a"):
            ShardIdentity(MATRIX, FLAT, half, first, GROUP)
        with pytest.raises(ContractValueError, match=r"placements\[0\]\.coordinate: must equal"):
            ShardIdentity(MATRIX, FLAT, half, first, GROUP, "rank:1")
        wide = ShardPlacement("data_parallel", PlacementKind.FLAT_SHARD, 1, 3)
        with pytest.raises(ContractValueError, match=r"placements\[0\]\.parts: must equal the 2"):
            ShardIdentity(MATRIX, FLAT, half, [wide], GROUP, "rank:1")
        with pytest.raises(ContractValueError, match=r"^ShardIdentity\.owner: must be a member"):
            shard(OWNER, LogicalSlice(0, 24), PlacementKind.WHOLE_PARAMETER_OWNER, owner="x")

    def test_owner_only_for_whole_parameter_owner(self) -> None:
        with pytest.raises(ContractValueError, match="only a whole_parameter_owner shard"):
            shard(FLAT, LogicalSlice(0, 12), PlacementKind.FLAT_SHARD, owner="rank:0")

    def test_parameter_dimension_below_rank(self) -> None:
        vector = ParameterIdentity("v", (4,))
        with pytest.raises(
            ContractValueError, match=r"parameter_dimension: must be < the parameter rank 1"
        ):
            shard(
                DTENSOR,
                LogicalRegion((0,), (4,)),
                PlacementKind.DIMENSION_SHARD,
                p={"parameter_dimension": 1},
                parameter=vector,
            )

    def test_replicated_rules(self) -> None:
        with pytest.raises(ContractValueError, match="full parameter"):
            shard(REPLICATED, LogicalSlice(0, 12), PlacementKind.REPLICATE)
        with pytest.raises(ContractValueError, match="replicate placement"):
            shard(REPLICATED, LogicalSlice(0, 24), PlacementKind.FLAT_SHARD)
        with pytest.raises(ContractValueError, match="exactly one placement"):
            shard(REPLICATED, LogicalSlice(0, 24), None)
        assert shard(REPLICATED, LogicalSlice(0, 24), PlacementKind.REPLICATE)

    def test_flattened_rules(self) -> None:
        with pytest.raises(ContractValueError, match="requires a process group"):
            ShardIdentity(MATRIX, FLAT, LogicalSlice(0, 24))
        with pytest.raises(ContractValueError, match="flat_shard placement"):
            shard(FLAT, LogicalSlice(0, 12), PlacementKind.REPLICATE)
        assert shard(FLAT, LogicalSlice(12, 12), PlacementKind.FLAT_SHARD)

    def test_whole_owner_rules(self) -> None:
        kind = PlacementKind.WHOLE_PARAMETER_OWNER
        with pytest.raises(
            ContractValueError, match=r"^ShardIdentity\.owner: a whole_parameter_owner"
        ):
            shard(OWNER, LogicalSlice(0, 24), kind)
        with pytest.raises(ContractValueError, match="non-owner"):
            shard(OWNER, LogicalSlice(0, 24), kind, owner="rank:0")
        with pytest.raises(ContractValueError, match="owner's shard must cover"):
            shard(OWNER, LogicalSlice(0, 12), kind, owner="rank:1")
        assert shard(OWNER, LogicalSlice(0, 0), kind, owner="rank:0")
        assert shard(OWNER, LogicalSlice(0, 24), kind, owner="rank:1")
        empty = ParameterIdentity("e", (0, 3))
        for member in GROUP.ordered_members:
            assert shard(
                OWNER,
                LogicalSlice(0, 0),
                kind,
                owner="rank:0",
                local_member=member,
                parameter=empty,
            )

    def test_dtensor_rules(self) -> None:
        with pytest.raises(ContractValueError, match="unsharded"):
            shard(
                DTENSOR,
                LogicalRegion((0, 0), (2, 5)),
                PlacementKind.DIMENSION_SHARD,
                p={"parameter_dimension": 0},
            )
        with pytest.raises(ContractValueError, match="full parameter"):
            shard(DTENSOR, LogicalRegion((0, 0), (2, 6)), PlacementKind.REPLICATE)
        with pytest.raises(ContractValueError, match="dimension_shard or replicate"):
            shard(DTENSOR, LogicalRegion((0, 0), (4, 6)), PlacementKind.FLAT_SHARD)
        with pytest.raises(ContractValueError, match="requires a process group"):
            ShardIdentity(MATRIX, DTENSOR, LogicalRegion((0, 0), (4, 6)))
        assert row_shard(2, 2).extent == LogicalRegion((2, 0), (2, 6))
        assert shard(DTENSOR, LogicalRegion.full(MATRIX), PlacementKind.REPLICATE)
