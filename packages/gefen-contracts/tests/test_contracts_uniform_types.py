"""Uniform validation, generated from a field-kind table (spec 40 §3, §11 "Uniform types").

The table below is written by hand, independently of the library's own field metadata, and is
checked against ``dataclasses.fields`` so a new field cannot escape these tests.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gefen.contracts import (
    CheckpointSupport,
    CheckpointTransport,
    ContractTypeError,
    ContractValueError,
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
)

Kind = tuple[Any, ...]
BOOL: Kind = ("bool",)
INT: Kind = ("int",)
STR: Kind = ("str",)
NAME: Kind = ("name",)
FQN: Kind = ("fqn",)
SCHEMA: Kind = ("schema",)


def enum_of(enum_type: type[enum.Enum]) -> Kind:
    return ("enum", enum_type)


def nested(*types: type) -> Kind:
    return ("nested", *types)


def optional(inner: Kind) -> Kind:
    return ("optional", inner)


def tuple_of(inner: Kind) -> Kind:
    return ("tuple", inner)


def frozenset_of(inner: Kind) -> Kind:
    return ("frozenset", inner)


LAYOUTS = frozenset_of(enum_of(ParameterLayout))
RANKS = tuple_of(INT)

FIELD_KINDS: dict[type, dict[str, Kind]] = {
    StateField: {
        "name": NAME,
        "scope": enum_of(StateScope),
        "geometry": enum_of(StateGeometry),
        "checkpointed": BOOL,
        "key_match": enum_of(StateKeyMatch),
        "applicable_sharded_modes": frozenset_of(NAME),
        "optional": BOOL,
        "description": STR,
    },
    StateVariant: {
        "name": NAME,
        "fields": tuple_of(NAME),
        "layouts": LAYOUTS,
        "extent": enum_of(StateExtent),
        "role": enum_of(ParameterStateRole),
        "initialized": BOOL,
        "parameter_ranks": optional(RANKS),
        "excluded_parameter_ranks": RANKS,
        "sharded_mode": optional(NAME),
        "applies_to_layouts": optional(LAYOUTS),
        "inactive_fields": tuple_of(NAME),
        "migration_only": BOOL,
        "description": STR,
    },
    OptimizerStateLayout: {
        "fields": tuple_of(nested(StateField)),
        "parameter_variants": tuple_of(nested(StateVariant)),
        "composite_namespaces": tuple_of(NAME),
    },
    TrainingSupport: {
        "layout": enum_of(ParameterLayout),
        "process_group_scope": enum_of(ProcessGroupScope),
        "mesh_dimensions": optional(tuple_of(INT)),
        "sharded_mode": optional(NAME),
        "requires_complete_parameter_storage": BOOL,
        "requires_complete_logical_matrix": BOOL,
        "requires_post_step_parameter_sync": BOOL,
    },
    CheckpointSupport: {
        "transport": enum_of(CheckpointTransport),
        "same_topology": LAYOUTS,
        "process_group_scope": enum_of(ProcessGroupScope),
        "topology_changing": LAYOUTS,
        "topology_change_kinds": frozenset_of(enum_of(TopologyChange)),
        "mesh_dimensions": optional(tuple_of(INT)),
        "required_sharded_modes": frozenset_of(NAME),
        "requires_collective": BOOL,
        "atomic_load": BOOL,
    },
    OptimizerCapabilities: {
        "training": tuple_of(nested(TrainingSupport)),
        "checkpoints": tuple_of(nested(CheckpointSupport)),
        "precisions": frozenset_of(enum_of(Precision)),
        "supported_parameter_ranks": optional(RANKS),
        "canonical_parameter_fqns": BOOL,
        "stable_shard_identity": BOOL,
        "explicit_process_group_codebook_scope": BOOL,
        "shard_rebinding": BOOL,
        "post_sharding": BOOL,
    },
    OptimizerChildContract: {
        "role": NAME,
        "implementation": NAME,
        "contract": optional(nested(OptimizerContract)),
    },
    OptimizerContract: {
        "implementation": NAME,
        "state_layout": nested(OptimizerStateLayout),
        "capabilities": nested(OptimizerCapabilities),
        "children": tuple_of(nested(OptimizerChildContract)),
        "schema_version": SCHEMA,
    },
    ParameterIdentity: {"fqn": FQN, "global_shape": tuple_of(INT), "schema_version": SCHEMA},
    ProcessGroupIdentity: {
        "semantic_name": NAME,
        "ordered_members": tuple_of(NAME),
        "schema_version": SCHEMA,
    },
    ShardPlacement: {
        "mesh_axis": NAME,
        "kind": enum_of(PlacementKind),
        "coordinate": INT,
        "parts": INT,
        "parameter_dimension": optional(INT),
    },
    LogicalSlice: {"flat_offset": INT, "length": INT},
    LogicalRegion: {"offsets": tuple_of(INT), "lengths": tuple_of(INT)},
    ShardIdentity: {
        "parameter": nested(ParameterIdentity),
        "layout": enum_of(ParameterLayout),
        "extent": nested(LogicalSlice, LogicalRegion),
        "placements": tuple_of(nested(ShardPlacement)),
        "process_group": optional(nested(ProcessGroupIdentity)),
        "local_member": optional(NAME),
        "owner": optional(NAME),
        "schema_version": SCHEMA,
    },
    ShardingManifest: {"shards": tuple_of(nested(ShardIdentity)), "schema_version": SCHEMA},
}

REPLICATED = ParameterLayout.REPLICATED
_PARAMETER = ParameterIdentity("w", (4,))
_GROUP = ProcessGroupIdentity("dp", ("a", "b"))
_STATE_FIELD = {
    "name": "f",
    "scope": StateScope.PARAMETER,
    "geometry": StateGeometry.PARAMETER,
    "checkpointed": True,
    "key_match": StateKeyMatch.EXACT,
    "applicable_sharded_modes": {"m"},
    "optional": False,
    "description": "d",
}
_VARIANT = {
    "name": "v",
    "fields": ["f", "g"],
    "layouts": {REPLICATED},
    "extent": StateExtent.LOCAL_STORAGE,
    "role": ParameterStateRole.ANY,
    "initialized": True,
    "parameter_ranks": [1],
    "excluded_parameter_ranks": [2],
    "sharded_mode": "m",
    "applies_to_layouts": {REPLICATED},
    "inactive_fields": ["g"],
    "migration_only": False,
    "description": "d",
}
_TRAINING = {
    "layout": REPLICATED,
    "process_group_scope": ProcessGroupScope.NONE,
    "mesh_dimensions": [1],
    "sharded_mode": "m",
    "requires_complete_parameter_storage": False,
    "requires_complete_logical_matrix": False,
    "requires_post_step_parameter_sync": False,
}
_CHECKPOINT = {
    "transport": CheckpointTransport.CANONICAL_GLOBAL,
    "same_topology": {REPLICATED},
    "process_group_scope": ProcessGroupScope.DEFAULT_WORLD,
    "topology_changing": {REPLICATED},
    "topology_change_kinds": {TopologyChange.PLACEMENT_RESHARD},
    "mesh_dimensions": [1],
    "required_sharded_modes": {"m"},
    "requires_collective": True,
    "atomic_load": True,
}


def _layout() -> OptimizerStateLayout:
    second = {**_STATE_FIELD, "name": "g"}
    return OptimizerStateLayout(
        fields=[StateField(**_STATE_FIELD), StateField(**second)],
        parameter_variants=[StateVariant(**_VARIANT)],
        composite_namespaces=["n"],
    )


def _capabilities() -> OptimizerCapabilities:
    return OptimizerCapabilities(**valid_kwargs(OptimizerCapabilities))


def _shard() -> ShardIdentity:
    return ShardIdentity(**valid_kwargs(ShardIdentity))


def _contract() -> OptimizerContract:
    return OptimizerContract(
        implementation="x.Y", state_layout=_layout(), capabilities=_capabilities()
    )


VALID: dict[type, Callable[[], dict[str, Any]]] = {
    StateField: lambda: dict(_STATE_FIELD),
    StateVariant: lambda: dict(_VARIANT),
    OptimizerStateLayout: lambda: {
        "fields": list(_layout().fields),
        "parameter_variants": list(_layout().parameter_variants),
        "composite_namespaces": ["n"],
    },
    TrainingSupport: lambda: dict(_TRAINING),
    CheckpointSupport: lambda: dict(_CHECKPOINT),
    OptimizerCapabilities: lambda: {
        "training": [TrainingSupport(**_TRAINING)],
        "checkpoints": [CheckpointSupport(**_CHECKPOINT)],
        "precisions": {Precision.FLOAT32},
        "supported_parameter_ranks": [1, 2],
        "canonical_parameter_fqns": True,
        "stable_shard_identity": True,
        "explicit_process_group_codebook_scope": True,
        "shard_rebinding": True,
        "post_sharding": True,
    },
    OptimizerChildContract: lambda: {"role": "r", "implementation": "x.Y", "contract": _contract()},
    OptimizerContract: lambda: {
        "implementation": "x.Y",
        "state_layout": _layout(),
        "capabilities": _capabilities(),
        "children": [OptimizerChildContract(role="r", implementation="x.Z", contract=None)],
        "schema_version": 1,
    },
    ParameterIdentity: lambda: {"fqn": "w", "global_shape": [4], "schema_version": 1},
    ProcessGroupIdentity: lambda: {
        "semantic_name": "dp",
        "ordered_members": ["a", "b"],
        "schema_version": 1,
    },
    ShardPlacement: lambda: {
        "mesh_axis": "x",
        "kind": PlacementKind.DIMENSION_SHARD,
        "coordinate": 1,
        "parts": 2,
        "parameter_dimension": 0,
    },
    LogicalSlice: lambda: {"flat_offset": 0, "length": 4},
    LogicalRegion: lambda: {"offsets": [0], "lengths": [4]},
    ShardIdentity: lambda: {
        "parameter": _PARAMETER,
        "layout": ParameterLayout.WHOLE_PARAMETER_OWNER,
        "extent": LogicalSlice(0, 4),
        "placements": [ShardPlacement("x", PlacementKind.WHOLE_PARAMETER_OWNER, 1, 2)],
        "process_group": _GROUP,
        "local_member": "b",
        "owner": "b",
        "schema_version": 1,
    },
    ShardingManifest: lambda: {
        "shards": [
            ShardIdentity(_PARAMETER, REPLICATED, LogicalSlice(0, 4)),
        ],
        "schema_version": 1,
    },
}


def valid_kwargs(value_type: type) -> dict[str, Any]:
    return VALID[value_type]()


class _Text(str):
    """A str subclass: rejected wherever an exact str is required."""


def _instance(value_type: type) -> Any:
    return value_type(**valid_kwargs(value_type))


def lookalikes(kind: Kind) -> Iterator[tuple[str, object]]:
    """The §11 look-alikes of ``kind``: right-looking values of the wrong exact type."""
    tag = kind[0]
    if tag == "bool":
        yield from (("0", 0), ("1", 1), ("'false'", "false"), ("None", None))
    elif tag in ("int", "schema"):
        yield from (("True", True), ("1.0", 1.0), ("'1'", "1"))
    elif tag in ("str", "name", "fqn"):
        yield from (
            ("bytes", b"x"),
            ("str-subclass", _Text("x")),
            ("enum-member", StateScope.DERIVED),
        )
        yield ("int", 7)
    elif tag == "enum":
        enum_type = kind[1]
        yield ("value-string", next(iter(enum_type)).value)
        other = Precision if enum_type is not Precision else StateScope
        yield ("other-enum", next(iter(other)))
    elif tag == "nested":
        yield ("primitive-dict", _instance(kind[1]).to_primitive())
    elif tag == "optional":
        yield from ((label, value) for label, value in lookalikes(kind[1]) if value is not None)
    elif tag in ("tuple", "frozenset"):
        yield ("str", "ab")
        label, bad = next(lookalikes(kind[1]))
        yield (f"list-of-{label}", [bad])
    else:  # pragma: no cover - a new tag must get its look-alikes here
        raise AssertionError(tag)


def _cases() -> Iterator[Any]:
    for value_type, kinds in FIELD_KINDS.items():
        for field_name, kind in kinds.items():
            for label, value in lookalikes(kind):
                yield pytest.param(
                    value_type, field_name, value, id=f"{value_type.__name__}.{field_name}-{label}"
                )


@pytest.mark.parametrize("value_type", list(FIELD_KINDS), ids=lambda t: t.__name__)
def test_table_matches_dataclass_fields(value_type: type) -> None:
    declared = [field.name for field in dataclasses.fields(value_type)]
    assert declared == list(FIELD_KINDS[value_type])


def test_table_covers_every_contract_type() -> None:
    import gefen.contracts as contracts

    dataclass_types = {
        getattr(contracts, name)
        for name in contracts.__all__
        if dataclasses.is_dataclass(getattr(contracts, name))
    }
    assert dataclass_types == set(FIELD_KINDS)


@pytest.mark.parametrize("value_type", list(FIELD_KINDS), ids=lambda t: t.__name__)
def test_valid_kwargs_construct(value_type: type) -> None:
    value = _instance(value_type)
    assert value == _instance(value_type)


@pytest.mark.parametrize(("value_type", "field_name", "value"), list(_cases()))
def test_lookalike_is_a_type_error_naming_the_field(
    value_type: type, field_name: str, value: object
) -> None:
    kwargs = valid_kwargs(value_type)
    kwargs[field_name] = value
    with pytest.raises(ContractTypeError) as caught:
        value_type(**kwargs)
    message = str(caught.value)
    prefix = f"{value_type.__name__}.{field_name}"
    assert message.startswith(prefix), message
    assert message[len(prefix)] in " [", message


def _name_fields() -> Iterator[Any]:
    for value_type, kinds in FIELD_KINDS.items():
        for field_name, kind in kinds.items():
            core = kind[1] if kind[0] == "optional" else kind
            wrap = core[0] if core[0] in ("tuple", "frozenset") else None
            leaf = core[1] if wrap else core
            if leaf in (NAME, FQN):
                yield pytest.param(
                    value_type, field_name, wrap, id=f"{value_type.__name__}.{field_name}"
                )


BAD_NAMES = ["", " a", "a ", "a\tb ", "a\0b", "\ud800"]


@pytest.mark.parametrize(("value_type", "field_name", "wrap"), list(_name_fields()))
@pytest.mark.parametrize("bad", BAD_NAMES, ids=repr)
def test_bad_names_are_value_errors(
    value_type: type, field_name: str, wrap: str | None, bad: str
) -> None:
    kwargs = valid_kwargs(value_type)
    kwargs[field_name] = bad if wrap is None else [bad]
    with pytest.raises(ContractValueError) as caught:
        value_type(**kwargs)
    assert str(caught.value).startswith(f"{value_type.__name__}.{field_name}")


def _container_fields(tag: str) -> Iterator[Any]:
    for value_type, kinds in FIELD_KINDS.items():
        for field_name, kind in kinds.items():
            core = kind[1] if kind[0] == "optional" else kind
            if core[0] == tag:
                yield pytest.param(value_type, field_name, id=f"{value_type.__name__}.{field_name}")


@pytest.mark.parametrize(("value_type", "field_name"), list(_container_fields("tuple")))
def test_tuple_fields_copy_lists_and_tuples(value_type: type, field_name: str) -> None:
    kwargs = valid_kwargs(value_type)
    source = list(kwargs[field_name])
    kwargs[field_name] = source
    from_list = value_type(**kwargs)
    stored = getattr(from_list, field_name)
    assert type(stored) is tuple
    kwargs[field_name] = tuple(source)
    assert value_type(**kwargs) == from_list
    source.clear()
    assert getattr(from_list, field_name) == stored
    for rejected in ({*stored}, (item for item in stored), {0: 1}):
        kwargs[field_name] = rejected
        with pytest.raises(ContractTypeError, match=rf"^{value_type.__name__}\.{field_name} "):
            value_type(**kwargs)


@pytest.mark.parametrize(("value_type", "field_name"), list(_container_fields("frozenset")))
def test_frozenset_fields_accept_four_containers(value_type: type, field_name: str) -> None:
    kwargs = valid_kwargs(value_type)
    items = sorted(kwargs[field_name], key=repr)
    assert items, "the valid example must hold at least one element"
    results = []
    for container in (set, frozenset, list, tuple):
        source = container(items)
        kwargs[field_name] = source
        value = value_type(**kwargs)
        assert type(getattr(value, field_name)) is frozenset
        results.append(value)
        if isinstance(source, (set, list)):
            source.clear()
            assert getattr(value, field_name) == frozenset(items)
    assert all(result == results[0] for result in results)
    kwargs[field_name] = items + items[:1]
    with pytest.raises(ContractValueError, match="duplicate"):
        value_type(**kwargs)
    kwargs[field_name] = iter(items)
    with pytest.raises(ContractTypeError):
        value_type(**kwargs)


@pytest.mark.parametrize("value_type", list(FIELD_KINDS), ids=lambda t: t.__name__)
def test_every_field_is_frozen(value_type: type) -> None:
    value = _instance(value_type)
    for field in dataclasses.fields(value_type):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field.name, getattr(value, field.name))


@pytest.mark.parametrize("value_type", list(FIELD_KINDS), ids=lambda t: t.__name__)
def test_nested_subclass_instances_are_rejected(value_type: type) -> None:
    """A subclass instance is not the type: 'subclasses, look-alikes, dicts' are rejected."""
    subclass = dataclasses.dataclass(frozen=True)(
        type(f"Sub{value_type.__name__}", (value_type,), {})
    )
    for owner, kinds in FIELD_KINDS.items():
        for field_name, kind in kinds.items():
            core = kind[1] if kind[0] == "optional" else kind
            if core == nested(value_type):
                kwargs = valid_kwargs(owner)
                kwargs[field_name] = subclass(**valid_kwargs(value_type))
                with pytest.raises(ContractTypeError, match=rf"^{owner.__name__}\.{field_name} "):
                    owner(**kwargs)


def test_capability_types_are_keyword_only_and_identity_types_positional() -> None:
    for value_type in (StateField, StateVariant, OptimizerStateLayout, TrainingSupport):
        with pytest.raises(TypeError, match="positional"):
            value_type(*valid_kwargs(value_type).values())
    for value_type in (
        CheckpointSupport,
        OptimizerCapabilities,
        OptimizerChildContract,
        OptimizerContract,
    ):
        with pytest.raises(TypeError, match="positional"):
            value_type(*valid_kwargs(value_type).values())
    for value_type in (
        ParameterIdentity,
        ProcessGroupIdentity,
        ShardPlacement,
        LogicalSlice,
        LogicalRegion,
        ShardIdentity,
        ShardingManifest,
    ):
        kwargs = valid_kwargs(value_type)
        assert value_type(*kwargs.values()) == value_type(**kwargs)
