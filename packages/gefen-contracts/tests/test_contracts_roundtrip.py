"""The primitive round trip over a corpus of valid values (spec 40 §7.1, §7.3, §11)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from gefen.contracts import (
    CheckpointSupport,
    CheckpointTransport,
    LogicalRegion,
    LogicalSlice,
    OptimizerCapabilities,
    OptimizerChildContract,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterIdentity,
    ParameterLayout,
    ParameterStateRole,
    PlacementKind,
    Precision,
    ProcessGroupIdentity,
    ProcessGroupScope,
    ShardIdentity,
    ShardingManifest,
    ShardPlacement,
    StateExtent,
    StateField,
    StateGeometry,
    StateKeyMatch,
    StateScope,
    StateVariant,
    TopologyChange,
    TrainingSupport,
    canonical_bytes,
)

REPLICATED = ParameterLayout.REPLICATED
FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD
OWNER = ParameterLayout.WHOLE_PARAMETER_OWNER
DTENSOR = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
GROUP = ProcessGroupIdentity("pipeline:0/dp", ("r2", "r0", "r1"))
MATRIX = ParameterIdentity("block.0.attn.Wq", (6, 4))
SCALAR = ParameterIdentity("scale", ())

# Primitive keys whose list order is normalised: set-valued fields, placements, manifest shards.
NORMALISED_KEYS = {
    "applicable_sharded_modes",
    "layouts",
    "applies_to_layouts",
    "same_topology",
    "topology_changing",
    "topology_change_kinds",
    "required_sharded_modes",
    "precisions",
    "placements",
    "shards",
}


def _grouped(
    layout: ParameterLayout, extent: Any, kind: PlacementKind, member: str, **extra: Any
) -> ShardIdentity:
    coordinate = GROUP.coordinate(member)
    placement = ShardPlacement("mesh", kind, coordinate, GROUP.size, extra.pop("dimension", None))
    return ShardIdentity(MATRIX, layout, extent, [placement], GROUP, member, **extra)


def _flat(member: str, offset: int, length: int) -> ShardIdentity:
    return _grouped(FLAT, LogicalSlice(offset, length), PlacementKind.FLAT_SHARD, member)


def _owner(member: str) -> ShardIdentity:
    extent = LogicalSlice(0, 24) if member == "r1" else LogicalSlice(0, 0)
    return _grouped(OWNER, extent, PlacementKind.WHOLE_PARAMETER_OWNER, member, owner="r1")


def _rows(member: str, offset: int, rows: int) -> ShardIdentity:
    region = LogicalRegion((offset, 0), (rows, 4))
    return _grouped(DTENSOR, region, PlacementKind.DIMENSION_SHARD, member, dimension=0)


def _dtensor_replicated(member: str) -> ShardIdentity:
    return _grouped(DTENSOR, LogicalRegion.full(MATRIX), PlacementKind.REPLICATE, member)


def _full_variant() -> StateVariant:
    return StateVariant(
        name="sharded",
        fields=["m", "v", "idx"],
        layouts={FLAT, REPLICATED, OWNER},
        extent=StateExtent.OWNER_PARAMETER,
        role=ParameterStateRole.OWNER,
        initialized=False,
        parameter_ranks=[2, 1],
        excluded_parameter_ranks=[0],
        sharded_mode="exact",
        applies_to_layouts={OWNER, FLAT},
        inactive_fields=["idx"],
        migration_only=True,
        description="ünïcode ✓",
    )


def _full_checkpoint() -> CheckpointSupport:
    return CheckpointSupport(
        transport=CheckpointTransport.CANONICAL_GLOBAL,
        same_topology={DTENSOR, FLAT, REPLICATED},
        process_group_scope=ProcessGroupScope.INFERRED_DEVICE_MESH,
        topology_changing={FLAT, OWNER},
        topology_change_kinds=set(TopologyChange),
        mesh_dimensions=[2, 1],
        required_sharded_modes={"b", "a"},
        requires_collective=True,
        atomic_load=True,
    )


def _full_layout() -> OptimizerStateLayout:
    parameter = StateScope.PARAMETER
    return OptimizerStateLayout(
        fields=[
            StateField(name="m", scope=parameter, geometry=StateGeometry.BLOCK, checkpointed=True),
            StateField(name="v", scope=parameter, geometry=StateGeometry.ROW, checkpointed=True),
            StateField(
                name="idx",
                scope=parameter,
                geometry=StateGeometry.OPAQUE,
                checkpointed=True,
                key_match=StateKeyMatch.PREFIX,
                applicable_sharded_modes={"z", "exact"},
                optional=True,
                description="indices",
            ),
            StateField(
                name="codebook",
                scope=StateScope.OPTIMIZER_COMMON,
                geometry=StateGeometry.CODEBOOK,
                checkpointed=True,
            ),
            StateField(
                name="cache",
                scope=StateScope.DERIVED,
                geometry=StateGeometry.SCALAR,
                checkpointed=False,
            ),
        ],
        parameter_variants=[_full_variant()],
        composite_namespaces=["inner"],
    )


def _full_capabilities() -> OptimizerCapabilities:
    return OptimizerCapabilities(
        training=[
            TrainingSupport(
                layout=DTENSOR,
                process_group_scope=ProcessGroupScope.ADAPTER_DEFINED,
                mesh_dimensions=[1],
                sharded_mode="exact",
                requires_complete_parameter_storage=True,
                requires_complete_logical_matrix=True,
                requires_post_step_parameter_sync=True,
            ),
            TrainingSupport(layout=REPLICATED, process_group_scope=ProcessGroupScope.NONE),
        ],
        checkpoints=[_full_checkpoint()],
        precisions={Precision.BFLOAT16, Precision.FLOAT32},
        supported_parameter_ranks=[2],
        canonical_parameter_fqns=True,
        stable_shard_identity=True,
        explicit_process_group_codebook_scope=True,
        shard_rebinding=True,
        post_sharding=True,
    )


def _nested_composite(
    adamw: OptimizerContract, composite: OptimizerContract, _: ShardingManifest
) -> OptimizerContract:
    return OptimizerContract(
        implementation="tests.Outer",
        state_layout=_full_layout(),
        capabilities=_full_capabilities(),
        children=[
            OptimizerChildContract(
                role="inner", implementation="tests.Composite", contract=composite
            ),
            OptimizerChildContract(
                role="plain", implementation="torch.optim.AdamW", contract=adamw
            ),
        ],
    )


Builder = Callable[[OptimizerContract, OptimizerContract, ShardingManifest], Any]

CORPUS: dict[str, Builder] = {
    "state_field_defaults": lambda a, c, m: a.state_layout.fields[0],
    "state_field_full": lambda a, c, m: _full_layout().fields[2],
    "state_variant_defaults": lambda a, c, m: a.state_layout.parameter_variants[0],
    "state_variant_full": lambda a, c, m: _full_variant(),
    "state_layout_adamw": lambda a, c, m: a.state_layout,
    "state_layout_full": lambda a, c, m: _full_layout(),
    "training_defaults": lambda a, c, m: a.capabilities.training[0],
    "checkpoint_full": lambda a, c, m: _full_checkpoint(),
    "capabilities_adamw": lambda a, c, m: a.capabilities,
    "capabilities_full": lambda a, c, m: _full_capabilities(),
    "child_without_contract": lambda a, c, m: c.children[1],
    "child_with_contract": lambda a, c, m: c.children[0],
    "contract_adamw": lambda a, c, m: a,
    "contract_composite_with_none_child": lambda a, c, m: c,
    "contract_nested_composite": _nested_composite,
    "parameter_scalar": lambda a, c, m: SCALAR,
    "parameter_matrix": lambda a, c, m: MATRIX,
    "parameter_empty": lambda a, c, m: ParameterIdentity("e", (0, 3)),
    "group": lambda a, c, m: GROUP,
    **{
        f"placement_{kind.value}": (
            lambda a, c, m, kind=kind: ShardPlacement(
                "axis", kind, 1, 3, 0 if kind is PlacementKind.DIMENSION_SHARD else None
            )
        )
        for kind in PlacementKind
    },
    "slice": lambda a, c, m: LogicalSlice(3, 5),
    "region": lambda a, c, m: LogicalRegion((1, 0), (2, 4)),
    "region_scalar": lambda a, c, m: LogicalRegion((), ()),
    "shard_replicated_ungrouped": lambda a, c, m: ShardIdentity(
        SCALAR, REPLICATED, LogicalSlice(0, 1)
    ),
    "shard_replicated_grouped": lambda a, c, m: _grouped(
        REPLICATED, LogicalSlice(0, 24), PlacementKind.REPLICATE, "r0"
    ),
    "shard_flattened": lambda a, c, m: _flat("r1", 8, 8),
    "shard_owner": lambda a, c, m: _owner("r1"),
    "shard_non_owner": lambda a, c, m: _owner("r2"),
    "shard_dtensor_rows": lambda a, c, m: _rows("r0", 2, 3),
    "shard_dtensor_replicate": lambda a, c, m: _dtensor_replicated("r2"),
    "manifest_golden": lambda a, c, m: m,
    "manifest_replicated": lambda a, c, m: ShardingManifest(
        [
            _grouped(REPLICATED, LogicalSlice(0, 24), PlacementKind.REPLICATE, x)
            for x in ("r1", "r0", "r2")
        ]
    ),
    "manifest_flattened": lambda a, c, m: ShardingManifest(
        [_flat("r1", 10, 14), _flat("r2", 24, 0), _flat("r0", 0, 10)]
    ),
    "manifest_whole_owner": lambda a, c, m: ShardingManifest(
        [_owner(x) for x in ("r2", "r1", "r0")]
    ),
    "manifest_dtensor_rows": lambda a, c, m: ShardingManifest(
        [_rows("r1", 6, 0), _rows("r0", 3, 3), _rows("r2", 0, 3)]
    ),
    "manifest_dtensor_replicate": lambda a, c, m: ShardingManifest(
        [_dtensor_replicated(x) for x in ("r0", "r1", "r2")]
    ),
    "manifest_mixed": lambda a, c, m: ShardingManifest(
        [
            *m.shards,
            ShardIdentity(SCALAR, REPLICATED, LogicalSlice(0, 1)),
            _owner("r0"),
            _owner("r1"),
            _owner("r2"),
        ]
    ),
}


@pytest.fixture
def build(
    adamw_contract: OptimizerContract,
    composite_contract: OptimizerContract,
    golden_manifest: ShardingManifest,
) -> Callable[[str], Any]:
    return lambda name: CORPUS[name](adamw_contract, composite_contract, golden_manifest)


def test_corpus_covers_every_type_and_layout(build: Callable[[str], Any]) -> None:
    import gefen.contracts as contracts

    values = [build(name) for name in CORPUS]
    dataclass_types = {
        getattr(contracts, name)
        for name in contracts.__all__
        if dataclasses.is_dataclass(getattr(contracts, name))
    }
    assert {type(value) for value in values} == dataclass_types
    shard_layouts = {value.layout for value in values if type(value) is ShardIdentity}
    assert shard_layouts == set(ParameterLayout)
    manifest_layouts = {
        (shard.layout, shard.placements[0].kind if shard.placements else None)
        for value in values
        if type(value) is ShardingManifest
        for shard in value.shards
    }
    assert {layout for layout, _ in manifest_layouts} == set(ParameterLayout)
    assert (DTENSOR, PlacementKind.REPLICATE) in manifest_layouts
    assert (DTENSOR, PlacementKind.DIMENSION_SHARD) in manifest_layouts


def _assert_strictly_primitive(obj: object) -> None:
    """Only dict (str keys), list, str, int, bool and None: no floats, tuples or sets."""
    if isinstance(obj, dict):
        assert type(obj) is dict
        for key, value in obj.items():
            assert type(key) is str
            _assert_strictly_primitive(value)
    elif isinstance(obj, list):
        assert type(obj) is list
        for item in obj:
            _assert_strictly_primitive(item)
    else:
        assert obj is None or type(obj) in (str, int, bool), obj


def _normalise_order_away(obj: Any) -> Any:
    """Reverse every list whose order the constructors normalise (a valid, scrambled input)."""
    if isinstance(obj, dict):
        return {
            key: _reversed(value) if key in NORMALISED_KEYS else _normalise_order_away(value)
            for key, value in obj.items()
        }
    if isinstance(obj, list):
        return [_normalise_order_away(item) for item in obj]
    return obj


def _reversed(value: Any) -> Any:
    if isinstance(value, list):
        return [_normalise_order_away(item) for item in reversed(value)]
    return _normalise_order_away(value)


def test_normalised_keys_cover_every_frozenset_field() -> None:
    import gefen.contracts as contracts

    set_fields = {
        field.name
        for name in contracts.__all__
        if dataclasses.is_dataclass(getattr(contracts, name))
        for field in dataclasses.fields(getattr(contracts, name))
        if str(field.type).startswith("frozenset")
    }
    assert set_fields == NORMALISED_KEYS - {"placements", "shards"}


@pytest.mark.parametrize("name", list(CORPUS))
def test_primitive_keys_are_the_field_names(name: str, build: Callable[[str], Any]) -> None:
    value = build(name)
    primitive = value.to_primitive()
    expected = [field.name for field in dataclasses.fields(value)]
    if type(value) in (LogicalSlice, LogicalRegion):
        expected = ["kind", *expected]
        assert (
            primitive["kind"]
            == {LogicalSlice: "logical_slice", LogicalRegion: "logical_region"}[type(value)]
        )
    assert list(primitive) == expected
    _assert_strictly_primitive(primitive)


@pytest.mark.parametrize("name", list(CORPUS))
def test_guarantee_1_from_primitive_inverts_to_primitive(
    name: str, build: Callable[[str], Any]
) -> None:
    value = build(name)
    parsed = type(value).from_primitive(value.to_primitive())
    assert parsed == value
    assert hash(parsed) == hash(value)
    assert type(parsed) is type(value)


@pytest.mark.parametrize("name", list(CORPUS))
def test_guarantee_2_json_round_trip(name: str, build: Callable[[str], Any]) -> None:
    primitive = build(name).to_primitive()
    assert json.loads(json.dumps(primitive)) == primitive


@pytest.mark.parametrize("name", list(CORPUS))
def test_guarantee_3_equal_values_encode_identically(
    name: str, build: Callable[[str], Any]
) -> None:
    first, second = build(name), build(name)
    assert first == second
    assert canonical_bytes(first.to_primitive()) == canonical_bytes(second.to_primitive())
    parsed = type(first).from_primitive(json.loads(canonical_bytes(first.to_primitive())))
    assert canonical_bytes(parsed.to_primitive()) == canonical_bytes(first.to_primitive())


@pytest.mark.parametrize("name", list(CORPUS))
def test_guarantee_4_normal_form_is_a_fixed_point(name: str, build: Callable[[str], Any]) -> None:
    value = build(name)
    normal = value.to_primitive()
    scrambled = _normalise_order_away(normal)
    parsed = type(value).from_primitive(scrambled).to_primitive()
    assert parsed == normal
    assert type(value).from_primitive(parsed).to_primitive() == parsed


def test_scrambling_really_changes_some_primitives(build: Callable[[str], Any]) -> None:
    changed = [
        name
        for name in CORPUS
        if _normalise_order_away(build(name).to_primitive()) != build(name).to_primitive()
    ]
    assert {"state_variant_full", "checkpoint_full", "manifest_flattened", "manifest_mixed"} <= set(
        changed
    )


def test_frozensets_are_sorted_and_tuples_keep_order() -> None:
    variant = _full_variant().to_primitive()
    assert variant["layouts"] == ["flattened_element_shard", "replicated", "whole_parameter_owner"]
    assert variant["fields"] == ["m", "v", "idx"]
    assert variant["parameter_ranks"] == [2, 1]
    group = GROUP.to_primitive()
    assert group["ordered_members"] == ["r2", "r0", "r1"]
