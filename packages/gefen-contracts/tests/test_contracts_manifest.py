"""ShardingManifest construction, ordering and coverage rules (spec 40 §6, §12)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def members(count: int) -> ProcessGroupIdentity:
    return ProcessGroupIdentity("dp", tuple(f"rank:{i}" for i in range(count)))


def flat_shards(
    slices: Sequence[tuple[int, int]],
    numel: int = 8,
    fqn: str = "w",
    axis: str = "data_parallel",
    group: ProcessGroupIdentity | None = None,
) -> list[ShardIdentity]:
    """Shard ``i`` holds ``slices[i]`` and belongs to member ``i``."""
    group = group or members(len(slices))
    parameter = ParameterIdentity(fqn, (numel,))
    return [
        ShardIdentity(
            parameter,
            FLAT,
            LogicalSlice(offset, length),
            [ShardPlacement(axis, PlacementKind.FLAT_SHARD, index, group.size)],
            group,
            group.ordered_members[index],
        )
        for index, (offset, length) in enumerate(slices)
    ]


def row_shards(
    rows: Sequence[tuple[int, int]], shape: tuple[int, int] = (5, 3)
) -> list[ShardIdentity]:
    group = members(len(rows))
    parameter = ParameterIdentity("m", shape)
    return [
        ShardIdentity(
            parameter,
            DTENSOR,
            LogicalRegion((offset, 0), (length, shape[1])),
            [ShardPlacement("x", PlacementKind.DIMENSION_SHARD, index, group.size, 0)],
            group,
            group.ordered_members[index],
        )
        for index, (offset, length) in enumerate(rows)
    ]


def owner_shards(
    owner: str, numel: int = 6, owners: Sequence[str] | None = None
) -> list[ShardIdentity]:
    group = members(3)
    parameter = ParameterIdentity("o", (numel,))
    result = []
    for index, member in enumerate(group.ordered_members):
        this_owner = owners[index] if owners else owner
        extent = LogicalSlice(0, numel) if member == this_owner else LogicalSlice(0, 0)
        result.append(
            ShardIdentity(
                parameter,
                OWNER,
                extent,
                [ShardPlacement("x", PlacementKind.WHOLE_PARAMETER_OWNER, index, 3)],
                group,
                member,
                this_owner,
            )
        )
    return result


def rejects(shards: list[ShardIdentity], rule: str) -> str:
    with pytest.raises(ContractValueError, match=rule) as caught:
        ShardingManifest(shards)
    message = str(caught.value)
    assert message.startswith("ShardingManifest.shards")
    return message


class TestConstruction:
    def test_must_be_non_empty_shard_identities(self) -> None:
        with pytest.raises(
            ContractValueError, match=r"^ShardingManifest\.shards: must not be empty"
        ):
            ShardingManifest([])
        with pytest.raises(ContractTypeError, match=r"^ShardingManifest\.shards\[0\]"):
            ShardingManifest([flat_shards([(0, 8)])[0].to_primitive()])

    def test_reversed_input_equals_sorted_input(self) -> None:
        shards = flat_shards([(0, 4), (4, 4), (4, 0)])
        forward = ShardingManifest(shards)
        backward = ShardingManifest(list(reversed(shards)))
        assert forward == backward
        assert hash(forward) == hash(backward)
        # FQN, offset, length, coordinate: the empty slice at 4 precedes (4, 4).
        assert [s.local_member for s in forward.shards] == ["rank:0", "rank:2", "rank:1"]

    def test_order_is_by_fqn_first(self) -> None:
        shards = flat_shards([(0, 8)], fqn="b") + flat_shards([(0, 8)], fqn="a")
        manifest = ShardingManifest(shards)
        assert [s.parameter.fqn for s in manifest.shards] == ["a", "b"]
        assert manifest.fqns == ("a", "b")

    def test_for_parameter(self) -> None:
        shards = flat_shards([(4, 4), (0, 4)], fqn="w") + flat_shards([(0, 8)], fqn="v")
        manifest = ShardingManifest(shards)
        assert manifest.for_parameter("w") == tuple(
            s for s in manifest.shards if s.parameter.fqn == "w"
        )
        assert [s.extent for s in manifest.for_parameter("w")] == [
            LogicalSlice(0, 4),
            LogicalSlice(4, 4),
        ]
        assert manifest.for_parameter("unknown") == ()

    def test_duplicate_shard(self) -> None:
        shards = flat_shards([(0, 4), (4, 4)])
        message = rejects([*shards, shards[0]], "duplicate shard")
        assert message.startswith("ShardingManifest.shards[1]")

    def test_mixes_grouped_and_ungrouped_parameters(self) -> None:
        bias = ShardIdentity(ParameterIdentity("bias", (3,)), REPLICATED, LogicalSlice(0, 3))
        manifest = ShardingManifest([bias, *flat_shards([(0, 8)])])
        assert manifest.fqns == ("bias", "w")

    def test_a_second_ungrouped_shard_is_a_duplicate(self) -> None:
        parameter = ParameterIdentity("bias", (3,))
        first = ShardIdentity(parameter, REPLICATED, LogicalSlice(0, 3))
        second = ShardIdentity(parameter, REPLICATED, LogicalSlice(0, 3), schema_version=1)
        assert first == second
        rejects([first, second], "duplicate shard")

    def test_one_parameter_identity_layout_and_group_per_fqn(self) -> None:
        shards = flat_shards([(0, 4), (4, 4)])
        other_shape = flat_shards([(0, 4), (4, 4)], numel=9)
        rejects([shards[0], other_shape[1]], "one ParameterIdentity")
        renamed = ProcessGroupIdentity("tp", ("rank:0", "rank:1"))
        rejects([shards[0], flat_shards([(0, 4), (4, 4)], group=renamed)[1]], "one process group")
        replicated = ShardIdentity(
            ParameterIdentity("w", (8,)),
            REPLICATED,
            LogicalSlice(0, 8),
            [ShardPlacement("data_parallel", PlacementKind.REPLICATE, 1, 2)],
            members(2),
            "rank:1",
        )
        rejects([shards[0], replicated], "one layout")


class TestFlattened:
    def test_exact_tiling_is_accepted(self) -> None:
        assert ShardingManifest(flat_shards([(0, 3), (3, 5)]))

    def test_gap(self) -> None:
        rejects(flat_shards([(0, 3), (4, 4)]), "gapless and non-overlapping")

    def test_short_of_numel(self) -> None:
        rejects(flat_shards([(0, 3), (3, 4)]), "gapless and non-overlapping")

    def test_overlap(self) -> None:
        rejects(flat_shards([(0, 5), (4, 4)]), "gapless and non-overlapping")

    def test_missing_member(self) -> None:
        shards = flat_shards([(0, 4), (4, 4), (8, 0)])
        rejects(shards[:2], "missing member 'rank:2'")

    def test_member_twice(self) -> None:
        shards = flat_shards([(0, 4), (4, 4)])
        twin = flat_shards([(4, 4), (0, 4)])[0]  # rank:0 again, at another offset
        rejects([*shards, twin], "more than one shard")

    def test_second_topology(self) -> None:
        left = flat_shards([(0, 4), (4, 4)])
        right = flat_shards([(0, 4), (4, 4)], axis="other_axis")
        rejects([left[0], right[1]], "one placement topology")

    @pytest.mark.parametrize(
        "slices",
        [[(0, 4), (4, 0), (4, 4)], [(0, 4), (4, 4), (8, 0)], [(0, 0), (0, 8)], [(0, 8), (0, 0)]],
    )
    def test_empty_slice_on_a_partition_boundary(self, slices: list[tuple[int, int]]) -> None:
        assert ShardingManifest(flat_shards(slices))

    def test_empty_slice_off_a_boundary(self) -> None:
        rejects(flat_shards([(0, 4), (4, 4), (2, 0)]), "partition boundary")

    def test_zero_numel_parameter(self) -> None:
        assert ShardingManifest(flat_shards([(0, 0), (0, 0)], numel=0))


class TestWholeOwner:
    def test_one_owner(self) -> None:
        assert ShardingManifest(owner_shards("rank:1"))
        rejects(owner_shards("", owners=["rank:0", "rank:0", "rank:1"]), "one owner")

    def test_zero_numel_parameter(self) -> None:
        assert ShardingManifest(owner_shards("rank:2", numel=0))


class TestDTensor:
    @pytest.mark.parametrize(
        "rows",
        [
            [(0, 2), (2, 2), (4, 1)],  # uneven, as torch.chunk splits 5 rows over 3
            [(0, 2), (2, 2), (4, 1), (5, 0)],  # an empty trailing shard
            [(0, 5), (5, 0)],
        ],
    )
    def test_uneven_and_empty_row_shards(self, rows: list[tuple[int, int]]) -> None:
        manifest = ShardingManifest(list(reversed(row_shards(rows))))
        assert len(manifest.shards) == len(rows)

    def test_gap(self) -> None:
        rejects(row_shards([(0, 2), (3, 2)]), "gapless")

    def test_out_of_coordinate_order(self) -> None:
        rejects(row_shards([(3, 2), (0, 3)]), "gapless")

    def test_short_of_the_full_axis(self) -> None:
        rejects(row_shards([(0, 2), (2, 2)]), "gapless")

    def test_replicate_regions(self) -> None:
        group = members(2)
        parameter = ParameterIdentity("m", (2, 2))
        shards = [
            ShardIdentity(
                parameter,
                DTENSOR,
                LogicalRegion.full(parameter),
                [ShardPlacement("x", PlacementKind.REPLICATE, index, 2)],
                group,
                member,
            )
            for index, member in enumerate(group.ordered_members)
        ]
        assert ShardingManifest(shards)
        with pytest.raises(ContractValueError, match="full parameter"):
            ShardIdentity(
                parameter,
                DTENSOR,
                LogicalRegion((0, 0), (1, 2)),
                [ShardPlacement("x", PlacementKind.REPLICATE, 0, 2)],
                group,
                "rank:0",
            )


@st.composite
def flat_partitions(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """A valid flat partition: sorted cut points (repeats give empty slices on boundaries)."""
    numel = draw(st.integers(min_value=0, max_value=40))
    count = draw(st.integers(min_value=1, max_value=6))
    cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=count - 1, max_size=count - 1)))
    bounds = [0, *cuts, numel]
    slices = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(count)]
    order = draw(st.permutations(range(count)))
    return numel, [slices[i] for i in order]


@settings(max_examples=60, deadline=None)
@given(flat_partitions(), st.randoms(use_true_random=False))
def test_property_valid_flat_partitions_build_in_any_order(
    partition: tuple[int, list[tuple[int, int]]], rng: random.Random
) -> None:
    numel, slices = partition
    shards = flat_shards(slices, numel=numel)
    manifest = ShardingManifest(shards)
    shuffled = list(shards)
    rng.shuffle(shuffled)
    assert ShardingManifest(shuffled) == manifest
    assert ShardingManifest.from_primitive(manifest.to_primitive()) == manifest
    keys = [shard.sort_key for shard in manifest.shards]
    assert keys == sorted(keys)


@settings(max_examples=60, deadline=None)
@given(flat_partitions(), st.data())
def test_property_moving_one_boundary_is_rejected(
    partition: tuple[int, list[tuple[int, int]]], data: st.DataObject
) -> None:
    numel, slices = partition
    non_empty = [i for i, (_, length) in enumerate(slices) if length]
    if not non_empty:
        return
    index = data.draw(st.sampled_from(non_empty))
    offset, length = slices[index]
    delta = data.draw(st.sampled_from([-1, 1]))
    moved = list(slices)
    moved[index] = (offset, length + delta)
    if offset + length + delta > numel:
        return  # would fail in ShardIdentity already; covered elsewhere
    with pytest.raises(ContractValueError, match=r"^ShardingManifest\.shards"):
        ShardingManifest(flat_shards(moved, numel=numel))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 12), st.integers(1, 5))
def test_property_torch_chunk_row_splits_are_accepted(rows: int, parts: int) -> None:
    chunk = -(-rows // parts) if rows else 0
    splits = []
    for index in range(parts):
        start = min(rows, chunk * index)
        splits.append((start, max(0, min(rows, start + chunk) - start)))
    manifest = ShardingManifest(row_shards(splits, shape=(rows, 2)))
    regions = [shard.extent for shard in manifest.shards]
    assert all(isinstance(region, LogicalRegion) for region in regions)
    LogicalRegion.validate_exact_coverage(manifest.shards[0].parameter, regions)  # type: ignore[arg-type]
