"""Declarations that could never match anything are refused when built, and the conformance
helpers do not pass what they were asked to check (docs/contracts.md §5, §8). Each of these was
accepted before: the author learnt of the mistake only from a check that could never pass, or
never at all."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gefen.contracts import (
    ConformanceError,
    ContractValueError,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterLayout,
    StateExtent,
    StateField,
    StateGeometry,
    StateScope,
    StateVariant,
)
from gefen.contracts.conformance import check_state_dict, match_state_variant

REPLICATED = ParameterLayout.REPLICATED
TENSOR = object()  # the helpers never look at values


def field(name: str, scope: StateScope = StateScope.PARAMETER, **extra: Any) -> StateField:
    extra.setdefault("checkpointed", True)
    return StateField(name=name, scope=scope, geometry=StateGeometry.OPAQUE, **extra)


def variant(name: str, fields: tuple[str, ...], **extra: Any) -> StateVariant:
    return StateVariant(
        name=name, fields=fields, layouts={REPLICATED}, extent=StateExtent.GLOBAL_PARAMETER, **extra
    )


def test_a_variant_naming_an_unsaved_field_is_refused() -> None:
    """``check_state_dict`` refuses a ``checkpointed=False`` key wherever it appears, and a
    variant without it misses a key: no entry could ever match."""
    with pytest.raises(ContractValueError, match=r"fields\[1\]: must name a checkpointed field"):
        OptimizerStateLayout(
            fields=[field("step"), field("m", checkpointed=False)],
            parameter_variants=[variant("v", ("step", "m"))],
        )


def test_empty_parameter_ranks_are_refused() -> None:
    """``()`` allowed no dimensionality: dead under every ndim filter, and matched without one."""
    with pytest.raises(ContractValueError, match=r"parameter_ranks: must not be empty"):
        variant("v", ("step",), parameter_ranks=())
    assert variant("v", ("step",), parameter_ranks=(0,)).applies_to(ndim=0)


def test_empty_rank_and_mesh_claims_are_refused() -> None:
    """``()`` claimed no dimensionality (no mesh) at all, where ``None`` means any."""
    from gefen.contracts import OptimizerCapabilities, Precision, ProcessGroupScope, TrainingSupport

    def training(**extra: Any) -> TrainingSupport:
        return TrainingSupport(
            layout=REPLICATED, process_group_scope=ProcessGroupScope.NONE, **extra
        )

    with pytest.raises(ContractValueError, match=r"mesh_dimensions: must not be empty"):
        training(mesh_dimensions=())
    with pytest.raises(ContractValueError, match=r"supported_parameter_ranks: must not be empty"):
        OptimizerCapabilities(
            training=[training()], precisions={Precision.FLOAT32}, supported_parameter_ranks=()
        )
    assert training(mesh_dimensions=(1,)).mesh_dimensions == (1,)


def test_a_description_canonical_bytes_cannot_write_is_refused() -> None:
    """A lone surrogate (text decoded with ``surrogateescape``) was taken, and every
    fingerprint of the contract then failed, ``check_provider`` with a ContractValueError."""
    text = b"momentum \xff".decode("utf-8", "surrogateescape")
    with pytest.raises(ContractValueError, match=r"StateField\.description: text must be"):
        field("m", description=text)
    with pytest.raises(ContractValueError, match=r"StateVariant\.description: text must be"):
        variant("v", ("step",), description=text)


def test_optional_requires_checkpointed() -> None:
    with pytest.raises(ContractValueError, match=r"StateField\.optional: marks a checkpointed"):
        field("extras", StateScope.OPTIMIZER_COMMON, optional=True, checkpointed=False)


@pytest.mark.parametrize("name", ["state", "param_groups"])
def test_a_top_level_field_named_like_the_structure_is_refused(name: str) -> None:
    """Such a required common field was skipped as structure, so always reported missing."""
    with pytest.raises(ContractValueError, match=r"fields\[1\]\.name: a top-level field"):
        OptimizerStateLayout(
            fields=[field("step"), field(name, StateScope.OPTIMIZER_COMMON)],
            parameter_variants=[variant("v", ("step",))],
        )
    with pytest.raises(ContractValueError, match=r"fields\[0\]\.name: a top-level field"):
        OptimizerStateLayout(
            fields=[field("main", StateScope.DERIVED)],
            parameter_variants=[],
            composite_namespaces=("main",),
        )
    # a per-parameter key of that name is an entry key, not a top-level one
    OptimizerStateLayout(fields=[field(name)], parameter_variants=[variant("v", (name,))])


def test_an_optional_parameter_field_may_be_absent() -> None:
    """``optional`` is "a checkpointed field that may be absent"; an entry without it matched
    no variant."""
    layout = OptimizerStateLayout(
        fields=[field("step"), field("m"), field("v", optional=True)],
        parameter_variants=[variant("moments", ("step", "m", "v"))],
    )
    assert [v.name for v in match_state_variant(layout, ["step", "m"])] == ["moments"]
    assert [v.name for v in match_state_variant(layout, ["step", "m", "v"])] == ["moments"]
    with pytest.raises(ConformanceError, match="no state variant matches keys"):
        match_state_variant(layout, ["step", "v"])  # the required ``m`` is missing


@pytest.fixture
def matrix_only(adamw_contract: OptimizerContract) -> OptimizerContract:
    """A contract whose one variant is for matrices (AdamW's capabilities)."""
    layout = OptimizerStateLayout(
        fields=[field("step"), field("m")],
        parameter_variants=[variant("matrix", ("step", "m"), parameter_ranks=(2,))],
    )
    return dataclasses.replace(adamw_contract, state_layout=layout)


def _state_dict() -> dict[str, Any]:
    return {
        "state": {0: {"step": TENSOR, "m": TENSOR}},
        "param_groups": [{"params": [0, 1], "lr": 0.1}],
    }


@pytest.mark.parametrize("key", ["0", "bias", 7])
def test_a_filter_keyed_by_nothing_in_the_state_dict_is_refused(
    matrix_only: OptimizerContract, key: object
) -> None:
    """Keyed by name or by a str index, the filter was dropped and a 1-D parameter's entry
    passed a matrix-only contract."""
    with pytest.raises(ConformanceError, match=r"check_state_dict\.ndims: keys name no state"):
        check_state_dict(matrix_only, _state_dict(), ndims={key: 1})
    with pytest.raises(ConformanceError, match="no state variant matches"):
        check_state_dict(matrix_only, _state_dict(), ndims={0: 1})  # keyed right: it fails


def test_a_filter_may_name_a_listed_parameter_without_state(
    matrix_only: OptimizerContract,
) -> None:
    """Parameter 1 has no entry yet (no step took it): a mapping over every parameter is fine."""
    result = check_state_dict(matrix_only, _state_dict(), ndims={0: 2, 1: 1})
    assert result == {0: ("matrix",)}


def test_a_variant_pinned_to_a_mode_its_field_does_not_apply_in_is_refused() -> None:
    """``applicable_sharded_modes`` was read by nothing: a field for ``exact`` only was
    matched in a variant pinned to ``fast``, and under a ``fast`` filter."""
    exact_only = field("gathered", applicable_sharded_modes={"exact"})
    with pytest.raises(ContractValueError, match=r"fields\[1\]: names a field that does not"):
        OptimizerStateLayout(
            fields=[field("step"), exact_only],
            parameter_variants=[variant("v", ("step", "gathered"), sharded_mode="fast")],
        )
    layout = OptimizerStateLayout(
        fields=[field("step"), exact_only],
        parameter_variants=[variant("v", ("step", "gathered"))],
    )
    assert [v.name for v in match_state_variant(layout, ["step", "gathered"])] == ["v"]
    assert match_state_variant(layout, ["step", "gathered"], sharded_mode="exact")
    with pytest.raises(ConformanceError, match="no state variant matches"):
        match_state_variant(layout, ["step", "gathered"], sharded_mode="fast")


def test_a_variant_for_ranks_the_contract_does_not_support_is_refused(
    matrix_only: OptimizerContract,
) -> None:
    """A matrices-only claim beside a variant for vectors: the variant could never apply."""
    from gefen.contracts import OptimizerCapabilities

    capabilities = dataclasses.replace(matrix_only.capabilities, supported_parameter_ranks=(2,))
    assert isinstance(capabilities, OptimizerCapabilities)
    vectors = OptimizerStateLayout(
        fields=[field("step"), field("m")],
        parameter_variants=[variant("vector", ("step", "m"), parameter_ranks=(1,))],
    )
    with pytest.raises(ContractValueError, match=r"parameter_variants\[0\]\.parameter_ranks"):
        dataclasses.replace(matrix_only, capabilities=capabilities, state_layout=vectors)


def test_state_for_a_rank_the_contract_does_not_support_is_refused(
    matrix_only: OptimizerContract,
) -> None:
    """The contract claims matrices only; an entry for a 1-D parameter passed when no
    variant named its ranks."""
    anyrank = OptimizerStateLayout(
        fields=[field("step"), field("m")], parameter_variants=[variant("any", ("step", "m"))]
    )
    capabilities = dataclasses.replace(matrix_only.capabilities, supported_parameter_ranks=(2,))
    contract = dataclasses.replace(matrix_only, capabilities=capabilities, state_layout=anyrank)
    assert check_state_dict(contract, _state_dict(), ndims={0: 2}) == {0: ("any",)}
    with pytest.raises(ConformanceError, match=r"\['state'\]\[0\]: holds state for a parameter"):
        check_state_dict(contract, _state_dict(), ndims={0: 1})


def test_a_checkpoint_transport_for_no_layout_is_refused() -> None:
    from gefen.contracts import CheckpointSupport, CheckpointTransport, ProcessGroupScope

    with pytest.raises(ContractValueError, match=r"CheckpointSupport\.same_topology: a transport"):
        CheckpointSupport(
            transport=CheckpointTransport.NATIVE_OPTIMIZER,
            same_topology=frozenset(),
            process_group_scope=ProcessGroupScope.NONE,
        )
