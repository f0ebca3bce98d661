"""The public surface of gefen.contracts: names, homes, enums, errors, namespace packaging."""

from __future__ import annotations

import enum
import pathlib

import pytest

import gefen
import gefen.contracts as contracts
from gefen.contracts import (
    ConformanceError,
    ContractError,
    ContractTypeError,
    ContractValueError,
    OptimizerContractProvider,
    PrimitiveFormError,
)

SPEC_NAMES = {
    "CONTRACT_SCHEMA_VERSION",
    "IDENTITY_SCHEMA_VERSION",
    "StateScope",
    "StateGeometry",
    "StateKeyMatch",
    "StateExtent",
    "ParameterStateRole",
    "ParameterLayout",
    "PlacementKind",
    "ProcessGroupScope",
    "CheckpointTransport",
    "TopologyChange",
    "Precision",
    "StateField",
    "StateVariant",
    "OptimizerStateLayout",
    "TrainingSupport",
    "CheckpointSupport",
    "OptimizerCapabilities",
    "OptimizerChildContract",
    "OptimizerContract",
    "OptimizerContractProvider",
    "ParameterIdentity",
    "ProcessGroupIdentity",
    "ShardPlacement",
    "LogicalSlice",
    "LogicalRegion",
    "ShardIdentity",
    "ShardingManifest",
    "canonical_bytes",
    "fingerprint",
    "ContractError",
    "ContractTypeError",
    "ContractValueError",
    "PrimitiveFormError",
    "ConformanceError",
}

ENUM_MEMBERS = {
    "StateScope": ["OPTIMIZER_COMMON", "PARAMETER", "DERIVED"],
    "StateGeometry": ["SCALAR", "CODEBOOK", "PARAMETER", "BLOCK", "ROW", "COLUMN", "OPAQUE"],
    "StateKeyMatch": ["EXACT", "PREFIX"],
    "StateExtent": ["METADATA_ONLY", "LOCAL_STORAGE", "GLOBAL_PARAMETER", "OWNER_PARAMETER"],
    "ParameterStateRole": ["ANY", "OWNER", "NON_OWNER"],
    "ParameterLayout": [
        "REPLICATED",
        "FLATTENED_ELEMENT_SHARD",
        "WHOLE_PARAMETER_OWNER",
        "DTENSOR_1D_DEFAULT_WORLD",
    ],
    "PlacementKind": ["REPLICATE", "FLAT_SHARD", "DIMENSION_SHARD", "WHOLE_PARAMETER_OWNER"],
    "ProcessGroupScope": ["NONE", "DEFAULT_WORLD", "INFERRED_DEVICE_MESH", "ADAPTER_DEFINED"],
    "CheckpointTransport": [
        "NATIVE_OPTIMIZER",
        "PYTORCH_RANK_LOCAL",
        "COMPOSITE_NATIVE",
        "CANONICAL_LOCAL",
        "CANONICAL_GLOBAL",
    ],
    "TopologyChange": ["WORLD_SIZE_OWNER_REDISTRIBUTION", "PLACEMENT_RESHARD"],
    "Precision": ["FLOAT32", "BFLOAT16", "FLOAT16", "FLOAT64"],
}


def test_all_is_exactly_the_spec_names_and_every_name_resolves() -> None:
    assert len(contracts.__all__) == len(set(contracts.__all__))
    assert set(contracts.__all__) == SPEC_NAMES
    for name in contracts.__all__:
        assert getattr(contracts, name) is not None


def test_conformance_helpers_are_not_reexported() -> None:
    import gefen.contracts.conformance as conformance

    helpers = {
        "match_state_variant",
        "check_state_dict",
        "check_contract_roundtrip",
        "check_provider",
    }
    assert helpers <= set(conformance.__all__)
    assert not helpers & set(contracts.__all__)


def test_every_public_class_lives_in_the_package_namespace() -> None:
    classes = [getattr(contracts, name) for name in contracts.__all__]
    classes = [value for value in classes if isinstance(value, type)]
    assert len(classes) == len(SPEC_NAMES) - 4  # two constants, two functions
    for value in classes:
        assert value.__module__ == "gefen.contracts", value


def test_version_comes_from_the_version_module() -> None:
    from gefen.contracts._version import __version__

    assert contracts.__version__ == __version__
    assert __version__.count(".") == 2


def test_schema_constants() -> None:
    assert contracts.CONTRACT_SCHEMA_VERSION == 1
    assert contracts.IDENTITY_SCHEMA_VERSION == 1
    assert type(contracts.CONTRACT_SCHEMA_VERSION) is int


@pytest.mark.parametrize("name", sorted(ENUM_MEMBERS))
def test_enums_are_str_mixins_with_lower_case_values(name: str) -> None:
    enum_type = getattr(contracts, name)
    assert issubclass(enum_type, str)
    assert issubclass(enum_type, enum.Enum)
    assert [member.name for member in enum_type] == ENUM_MEMBERS[name]
    for member in enum_type:
        assert member.value == member.name.lower()
        assert type(member.value) is str


def test_there_are_eleven_enums() -> None:
    found = [
        name
        for name in contracts.__all__
        if isinstance(getattr(contracts, name), type)
        and issubclass(getattr(contracts, name), enum.Enum)
    ]
    assert sorted(found) == sorted(ENUM_MEMBERS)


@pytest.mark.parametrize(
    ("error", "bases"),
    [
        (ContractError, (Exception,)),
        (ContractTypeError, (ContractError, TypeError)),
        (ContractValueError, (ContractError, ValueError)),
        (PrimitiveFormError, (ContractValueError,)),
        (ConformanceError, (ContractError, AssertionError)),
    ],
)
def test_error_hierarchy(error: type[Exception], bases: tuple[type, ...]) -> None:
    assert error.__bases__ == bases


def test_provider_protocol_is_runtime_checkable() -> None:
    class Provider:
        def optimizer_contract(self) -> None:
            return None

    assert isinstance(Provider(), OptimizerContractProvider)
    assert not isinstance(object(), OptimizerContractProvider)


def test_gefen_is_a_pep420_namespace_package() -> None:
    # A regular gefen/__init__.py (the unrelated PyPI "gefen" / "gefen-x") would break this.
    assert gefen.__file__ is None
    assert not isinstance(gefen.__path__, list)
    assert type(gefen.__path__).__name__ == "_NamespacePath"
    for location in gefen.__path__:
        assert not (pathlib.Path(location) / "__init__.py").exists()


def test_package_ships_py_typed() -> None:
    assert (pathlib.Path(contracts.__file__).parent / "py.typed").is_file()
