"""Capability types and the optimizer contract (spec 40 §5, §12)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gefen.contracts import (
    CheckpointSupport,
    CheckpointTransport,
    ContractTypeError,
    ContractValueError,
    OptimizerCapabilities,
    OptimizerChildContract,
    OptimizerContract,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    TopologyChange,
    TrainingSupport,
    canonical_bytes,
)

REPLICATED = ParameterLayout.REPLICATED
NONE_SCOPE = ProcessGroupScope.NONE
TRAINING_FLAGS = [
    "requires_complete_parameter_storage",
    "requires_complete_logical_matrix",
    "requires_post_step_parameter_sync",
]
CAPABILITY_FLAGS = [
    "canonical_parameter_fqns",
    "stable_shard_identity",
    "explicit_process_group_codebook_scope",
    "shard_rebinding",
    "post_sharding",
]


def training(**overrides: Any) -> TrainingSupport:
    kwargs: dict[str, Any] = {"layout": REPLICATED, "process_group_scope": NONE_SCOPE}
    kwargs.update(overrides)
    return TrainingSupport(**kwargs)


def checkpoint(**overrides: Any) -> CheckpointSupport:
    kwargs: dict[str, Any] = {
        "transport": CheckpointTransport.NATIVE_OPTIMIZER,
        "same_topology": {REPLICATED},
        "process_group_scope": NONE_SCOPE,
    }
    kwargs.update(overrides)
    return CheckpointSupport(**kwargs)


def capabilities(**overrides: Any) -> OptimizerCapabilities:
    kwargs: dict[str, Any] = {"training": [training()], "precisions": {Precision.FLOAT32}}
    kwargs.update(overrides)
    return OptimizerCapabilities(**kwargs)


def contract(adamw: OptimizerContract, **overrides: Any) -> OptimizerContract:
    kwargs: dict[str, Any] = {
        "implementation": "x.Y",
        "state_layout": adamw.state_layout,
        "capabilities": adamw.capabilities,
    }
    kwargs.update(overrides)
    return OptimizerContract(**kwargs)


class TestTrainingSupport:
    @pytest.mark.parametrize("flag", TRAINING_FLAGS)
    @pytest.mark.parametrize("value", [0, 1])
    def test_flags_reject_ints(self, flag: str, value: int) -> None:
        with pytest.raises(ContractTypeError, match=rf"^TrainingSupport\.{flag} must be a bool"):
            training(**{flag: value})

    def test_mesh_dimensions(self) -> None:
        assert training(mesh_dimensions=[1, 2]).mesh_dimensions == (1, 2)
        with pytest.raises(ContractValueError, match=r"mesh_dimensions\[0\]: must be >= 1"):
            training(mesh_dimensions=[0])
        with pytest.raises(ContractValueError, match=r"mesh_dimensions\[1\]: duplicate"):
            training(mesh_dimensions=[1, 1])

    def test_defaults(self) -> None:
        value = training()
        assert value.mesh_dimensions is None
        assert value.sharded_mode is None
        assert not any(getattr(value, flag) for flag in TRAINING_FLAGS)


class TestCheckpointSupport:
    @pytest.mark.parametrize(
        ("flag", "value"), [("requires_collective", "false"), ("atomic_load", 1)]
    )
    def test_flags_reject_look_alikes(self, flag: str, value: object) -> None:
        with pytest.raises(ContractTypeError, match=rf"^CheckpointSupport\.{flag} must be a bool"):
            checkpoint(**{flag: value})

    def test_duplicate_layouts_in_a_list(self) -> None:
        with pytest.raises(ContractValueError, match=r"same_topology: duplicate"):
            checkpoint(same_topology=[REPLICATED, REPLICATED])

    def test_required_sharded_modes_follow_the_name_rule(self) -> None:
        with pytest.raises(ContractValueError, match=r"^CheckpointSupport\.required_sharded_modes"):
            checkpoint(required_sharded_modes={""})

    def test_topology_changing_needs_change_kinds_and_vice_versa(self) -> None:
        with pytest.raises(ContractValueError, match="topology_change_kinds"):
            checkpoint(topology_changing={REPLICATED})
        with pytest.raises(ContractValueError, match="topology_change_kinds"):
            checkpoint(topology_change_kinds={TopologyChange.PLACEMENT_RESHARD})
        both = checkpoint(
            topology_changing={REPLICATED},
            topology_change_kinds={TopologyChange.PLACEMENT_RESHARD},
        )
        assert both.topology_changing == frozenset({REPLICATED})


class TestOptimizerCapabilities:
    def test_post_sharding_rejects_a_string(self) -> None:
        with pytest.raises(ContractTypeError, match=r"post_sharding must be a bool"):
            capabilities(post_sharding="yes")

    @pytest.mark.parametrize("flag", CAPABILITY_FLAGS)
    def test_every_flag_rejects_one(self, flag: str) -> None:
        with pytest.raises(ContractTypeError, match=rf"^OptimizerCapabilities\.{flag} must be"):
            capabilities(**{flag: 1})

    def test_training_must_not_be_empty(self) -> None:
        with pytest.raises(ContractValueError, match=r"training: must not be empty"):
            capabilities(training=[])

    def test_duplicate_training_entries(self) -> None:
        with pytest.raises(ContractValueError, match=r"training\[1\]: duplicate"):
            capabilities(training=[training(), training()])

    def test_duplicate_checkpoint_entries(self) -> None:
        with pytest.raises(ContractValueError, match=r"checkpoints\[1\]: duplicate"):
            capabilities(checkpoints=[checkpoint(), checkpoint()])

    def test_precisions_must_not_be_empty(self) -> None:
        with pytest.raises(ContractValueError, match=r"precisions: must not be empty"):
            capabilities(precisions=set())

    def test_supported_parameter_ranks(self) -> None:
        assert capabilities().supported_parameter_ranks is None
        assert capabilities(supported_parameter_ranks=[0, 2]).supported_parameter_ranks == (0, 2)
        with pytest.raises(ContractValueError, match="duplicate"):
            capabilities(supported_parameter_ranks=[2, 2])

    @pytest.mark.parametrize(
        ("transports", "expected"),
        [
            ((), False),
            ((CheckpointTransport.NATIVE_OPTIMIZER,), False),
            ((CheckpointTransport.PYTORCH_RANK_LOCAL, CheckpointTransport.COMPOSITE_NATIVE), False),
            ((CheckpointTransport.CANONICAL_LOCAL,), True),
            ((CheckpointTransport.NATIVE_OPTIMIZER, CheckpointTransport.CANONICAL_GLOBAL), True),
        ],
    )
    def test_canonical_state_io_is_derived(
        self, transports: tuple[CheckpointTransport, ...], expected: bool
    ) -> None:
        value = capabilities(checkpoints=[checkpoint(transport=t) for t in transports])
        assert value.canonical_state_io is expected

    def test_canonical_state_io_is_not_a_constructor_argument(self) -> None:
        assert "canonical_state_io" not in {
            f.name for f in dataclasses.fields(OptimizerCapabilities)
        }
        with pytest.raises(TypeError):
            capabilities(canonical_state_io=True)

    def test_every_flag_defaults_to_false(self) -> None:
        value = capabilities()
        assert [getattr(value, flag) for flag in CAPABILITY_FLAGS] == [False] * 5
        assert value.checkpoints == ()


class TestContracts:
    @pytest.mark.parametrize("version", [True, 1.0, "1", None])
    def test_schema_version_type(self, adamw_contract: OptimizerContract, version: object) -> None:
        with pytest.raises(ContractTypeError, match=r"^OptimizerContract\.schema_version must"):
            contract(adamw_contract, schema_version=version)

    @pytest.mark.parametrize("version", [2, 0, -1])
    def test_schema_version_value(self, adamw_contract: OptimizerContract, version: int) -> None:
        with pytest.raises(ContractValueError) as caught:
            contract(adamw_contract, schema_version=version)
        assert str(caught.value) == (
            f"OptimizerContract.schema_version: unsupported schema version {version} (supported: 1)"
        )

    def test_schema_version_one_is_the_default(self, adamw_contract: OptimizerContract) -> None:
        assert contract(adamw_contract, schema_version=1) == contract(adamw_contract)
        assert contract(adamw_contract).schema_version == 1

    def test_schema_version_is_checked_after_other_rules(
        self, adamw_contract: OptimizerContract
    ) -> None:
        child = OptimizerChildContract(role="a", implementation="x", contract=None)
        with pytest.raises(ContractValueError, match="duplicate role"):
            contract(adamw_contract, children=[child, child], schema_version=2)

    @pytest.mark.parametrize(
        ("field_name", "value"), [("state_layout", None), ("capabilities", {})]
    )
    def test_nested_parts_must_be_the_exact_types(
        self, adamw_contract: OptimizerContract, field_name: str, value: object
    ) -> None:
        with pytest.raises(ContractTypeError, match=rf"^OptimizerContract\.{field_name} must be"):
            contract(adamw_contract, **{field_name: value})

    def test_child_contract_must_be_a_contract_or_none(
        self, adamw_contract: OptimizerContract
    ) -> None:
        with pytest.raises(ContractTypeError, match=r"^OptimizerChildContract\.contract must be"):
            OptimizerChildContract(role="a", implementation="x", contract="x")
        assert OptimizerChildContract(role="a", implementation="x", contract=None).contract is None
        child = OptimizerChildContract(role="a", implementation="x", contract=adamw_contract)
        assert child.contract is adamw_contract

    def test_duplicate_child_roles(self, adamw_contract: OptimizerContract) -> None:
        children = [
            OptimizerChildContract(role="backup", implementation="x.A", contract=None),
            OptimizerChildContract(role="backup", implementation="x.B", contract=adamw_contract),
        ]
        with pytest.raises(ContractValueError, match=r"children\[1\]: duplicate role"):
            contract(adamw_contract, children=children)

    def test_child_lookup_and_order(self, composite_contract: OptimizerContract) -> None:
        assert [child.role for child in composite_contract.children] == ["main", "backup"]
        main = composite_contract.child("main")
        assert main is not None
        assert main.contract is not None
        assert composite_contract.child("spare") is None

    def test_frozen_and_copied_from_the_callers_list(
        self, adamw_contract: OptimizerContract
    ) -> None:
        entries = [training(), training(layout=ParameterLayout.FLATTENED_ELEMENT_SHARD)]
        value = capabilities(training=entries)
        entries.clear()
        assert len(value.training) == 2
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.post_sharding = True  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            adamw_contract.implementation = "other"  # type: ignore[misc]

    def test_independently_built_equal_contracts(self, adamw_contract: OptimizerContract) -> None:
        import runpy
        from pathlib import Path

        builder = runpy.run_path(str(Path(__file__).with_name("conftest.py")))[
            "build_adamw_contract"
        ]
        other = builder()
        assert other is not adamw_contract
        assert other == adamw_contract
        assert hash(other) == hash(adamw_contract)
        assert canonical_bytes(other.to_primitive()) == canonical_bytes(
            adamw_contract.to_primitive()
        )
        assert other != contract(adamw_contract, implementation="torch.optim.adamw.AdamW2")

    def test_contract_holds_only_immutable_values(
        self, composite_contract: OptimizerContract
    ) -> None:
        def walk(value: object) -> None:
            if dataclasses.is_dataclass(value):
                for field in dataclasses.fields(value):
                    walk(getattr(value, field.name))
            elif isinstance(value, (tuple, frozenset)):
                for item in value:
                    walk(item)
            else:
                assert isinstance(value, (str, int, bool, type(None))), value

        walk(composite_contract)
        hash(composite_contract)
