"""Torch-free conformance helpers (spec 40 §8, §12), on plain-container state dicts."""

from __future__ import annotations

from typing import Any

import pytest

from gefen.contracts import (
    ConformanceError,
    ContractTypeError,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterLayout,
    ParameterStateRole,
    StateExtent,
    StateField,
    StateGeometry,
    StateKeyMatch,
    StateScope,
    StateVariant,
)
from gefen.contracts.conformance import (
    check_contract_roundtrip,
    check_provider,
    check_state_dict,
    match_state_variant,
)

REPLICATED = ParameterLayout.REPLICATED
FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD
TENSOR = object()  # stands in for a tensor: the helpers never look at values


def field(name: str, scope: StateScope = StateScope.PARAMETER, **extra: Any) -> StateField:
    return StateField(
        name=name, scope=scope, geometry=StateGeometry.OPAQUE, checkpointed=True, **extra
    )


def variant(name: str, fields: tuple[str, ...], **extra: Any) -> StateVariant:
    extra.setdefault("layouts", {REPLICATED, FLAT})
    extra.setdefault("extent", StateExtent.LOCAL_STORAGE)
    return StateVariant(name=name, fields=fields, **extra)


@pytest.fixture
def layout() -> OptimizerStateLayout:
    return OptimizerStateLayout(
        fields=[
            field("step"),
            field("m"),
            field("v"),
            field("idx_", key_match=StateKeyMatch.PREFIX),
            field("codebook", StateScope.OPTIMIZER_COMMON),
            field("extras", StateScope.OPTIMIZER_COMMON, optional=True),
            field("carrier", StateScope.DERIVED),
            StateField(
                name="scratch",
                scope=StateScope.DERIVED,
                geometry=StateGeometry.OPAQUE,
                checkpointed=False,
            ),
        ],
        parameter_variants=[
            variant("matrix", ("step", "m", "v"), parameter_ranks=(2,)),
            variant("vector", ("step", "m", "v"), excluded_parameter_ranks=(2,)),
            variant("owner", ("step", "m", "idx_"), role=ParameterStateRole.OWNER),
            variant(
                "global",
                ("step",),
                applies_to_layouts={REPLICATED},
                extent=StateExtent.GLOBAL_PARAMETER,
            ),
            variant("local", ("step",), applies_to_layouts={FLAT}),
        ],
    )


@pytest.fixture
def contract(layout: OptimizerStateLayout, adamw_contract: OptimizerContract) -> OptimizerContract:
    return OptimizerContract(
        implementation="tests.Quantized",
        state_layout=layout,
        capabilities=adamw_contract.capabilities,
    )


def names(variants: tuple[StateVariant, ...]) -> list[str]:
    return [v.name for v in variants]


class TestMatchStateVariant:
    def test_returns_every_matching_variant_in_declaration_order(
        self, layout: OptimizerStateLayout
    ) -> None:
        assert names(match_state_variant(layout, ["step", "m", "v"])) == ["matrix", "vector"]
        assert names(match_state_variant(layout, {"v": 1, "m": 2, "step": 3})) == [
            "matrix",
            "vector",
        ]

    def test_honours_ndim_and_role(self, layout: OptimizerStateLayout) -> None:
        assert names(match_state_variant(layout, ["step", "m", "v"], ndim=2)) == ["matrix"]
        assert names(match_state_variant(layout, ["step", "m", "v"], ndim=1)) == ["vector"]
        keys = ["step", "m", "idx_0", "idx_1"]
        assert names(match_state_variant(layout, keys, role=ParameterStateRole.OWNER)) == ["owner"]
        with pytest.raises(ConformanceError, match="excluded by the filters"):
            match_state_variant(layout, keys, role=ParameterStateRole.NON_OWNER)

    def test_parameter_layout_selects_between_equal_key_sets(
        self, layout: OptimizerStateLayout
    ) -> None:
        assert names(match_state_variant(layout, ["step"])) == ["global", "local"]
        assert names(match_state_variant(layout, ["step"], parameter_layout=REPLICATED)) == [
            "global"
        ]
        assert names(match_state_variant(layout, ["step"], parameter_layout=FLAT)) == ["local"]

    def test_ignores_derived_keys(self, layout: OptimizerStateLayout) -> None:
        assert names(match_state_variant(layout, ["step", "carrier"], parameter_layout=FLAT)) == [
            "local"
        ]

    def test_rejects_an_undeclared_key(self, layout: OptimizerStateLayout) -> None:
        with pytest.raises(ConformanceError, match=r"undeclared state keys \['foo'\]"):
            match_state_variant(layout, ["step", "m", "v", "foo"])
        with pytest.raises(ConformanceError, match=r"undeclared state keys \[3\]"):
            match_state_variant(layout, ["step", 3])

    def test_rejects_a_common_key_in_a_parameter_entry(self, layout: OptimizerStateLayout) -> None:
        with pytest.raises(ConformanceError, match="optimizer_common key 'codebook'"):
            match_state_variant(layout, ["step", "codebook"])

    def test_failure_lists_the_nearest_variants(self, layout: OptimizerStateLayout) -> None:
        with pytest.raises(ConformanceError) as caught:
            match_state_variant(layout, ["step", "m"])
        lines = str(caught.value).splitlines()
        assert lines[0].startswith(
            "match_state_variant: no state variant matches keys ['m', 'step']"
        )
        assert len(lines) == 4
        assert "nearest 'matrix': missing ['v'], extra []" in lines[1]
        assert "nearest 'vector': missing ['v'], extra []" in lines[2]
        assert "nearest 'owner': missing ['idx_'], extra []" in lines[3]

    def test_argument_types(self, layout: OptimizerStateLayout) -> None:
        with pytest.raises(ContractTypeError):
            match_state_variant(layout.to_primitive(), ["step"])  # type: ignore[arg-type]
        with pytest.raises(ContractTypeError):
            match_state_variant(layout, "step")


def entry(*keys: str) -> dict[str, object]:
    return dict.fromkeys(keys, TENSOR)


def plain_state_dict(**top: object) -> dict[str, Any]:
    return {
        "state": {0: entry("step", "m", "v"), 1: entry("step", "m", "idx_0")},
        "param_groups": [{"params": [0, 1], "lr": 0.1}],
        "codebook": TENSOR,
        **top,
    }


class TestCheckStateDict:
    def test_maps_every_entry_to_its_variants(self, contract: OptimizerContract) -> None:
        result = check_state_dict(contract, plain_state_dict(carrier=TENSOR, extras={}))
        assert result == {0: ("matrix", "vector"), 1: ("owner",)}

    def test_per_entry_filters(self, contract: OptimizerContract) -> None:
        result = check_state_dict(
            contract, plain_state_dict(), ndims={0: 1}, roles={1: ParameterStateRole.OWNER}
        )
        assert result == {0: ("vector",), 1: ("owner",)}
        state_dict = plain_state_dict()
        state_dict["state"][2] = entry("step")
        state_dict["param_groups"][0]["params"].append(2)
        result = check_state_dict(contract, state_dict, parameter_layouts={2: FLAT})
        assert result[2] == ("local",)
        with pytest.raises(ConformanceError, match=r"\['state'\]\[1\]: no state variant"):
            check_state_dict(contract, plain_state_dict(), roles={1: ParameterStateRole.NON_OWNER})
        # sharded_mode filters only variants that name a mode; these do not.
        assert check_state_dict(contract, plain_state_dict(), sharded_modes={0: "x"})[0] == (
            "matrix",
            "vector",
        )

    @pytest.mark.parametrize("name", ["ndims", "sharded_modes", "roles", "parameter_layouts"])
    def test_a_filter_that_is_not_a_mapping_is_refused_by_name(
        self, contract: OptimizerContract, name: str
    ) -> None:
        """``ndims=[1]`` raised a bare AttributeError from inside the check."""
        with pytest.raises(
            ContractTypeError, match=rf"^check_state_dict\.{name} must be a mapping of state keys"
        ):
            check_state_dict(contract, plain_state_dict(), **{name: [1]})

    @pytest.mark.parametrize(
        ("name", "value", "rule"),
        [
            ("ndims", True, r"ndims\[1\] must be an int"),
            ("sharded_modes", 2, r"sharded_modes\[1\] must be a str"),
            ("roles", "owner", r"roles\[1\] must be a ParameterStateRole member"),
            (
                "parameter_layouts",
                "replicated",
                r"parameter_layouts\[1\] must be a ParameterLayout",
            ),
        ],
    )
    def test_a_bad_filter_value_is_refused_naming_its_argument_and_key(
        self, contract: OptimizerContract, name: str, value: object, rule: str
    ) -> None:
        """It was named at ``StateVariant.applies_to``, and not checked at all for an id a
        group lists without state yet."""
        stateless = plain_state_dict()
        del stateless["state"][1]
        for state_dict in (plain_state_dict(), stateless):
            with pytest.raises(ContractTypeError, match=rf"^check_state_dict\.{rule}"):
                check_state_dict(contract, state_dict, **{name: {1: value}})
        # None is no filter for that entry, as for match_state_variant (filters built per
        # group give None where a group lacks the option)
        assert check_state_dict(contract, plain_state_dict(), **{name: {1: None}})[1] == ("owner",)

    def test_a_type_error_names_the_type_with_its_article(self) -> None:
        with pytest.raises(ContractTypeError, match=r"contract must be an OptimizerContract, got"):
            check_state_dict("not a contract", plain_state_dict())  # type: ignore[arg-type]
        # a nested value's type too (it said "a OptimizerStateLayout")
        with pytest.raises(ContractTypeError, match=r"layout must be an OptimizerStateLayout, got"):
            OptimizerContract(implementation="a.B", state_layout="x", capabilities=None)  # type: ignore[arg-type]

    def test_missing_required_common_field(self, contract: OptimizerContract) -> None:
        state_dict = plain_state_dict()
        del state_dict["codebook"]
        with pytest.raises(ConformanceError, match="missing required common field 'codebook'"):
            check_state_dict(contract, state_dict)

    def test_extra_top_level_key(self, contract: OptimizerContract) -> None:
        with pytest.raises(ConformanceError, match="top-level keys must be"):
            check_state_dict(contract, plain_state_dict(foo=1))
        with pytest.raises(ConformanceError, match="top-level keys must be"):
            check_state_dict(contract, plain_state_dict(m=TENSOR))  # a per-parameter field

    def test_unsaved_keys_anywhere(self, contract: OptimizerContract) -> None:
        with pytest.raises(ConformanceError, match="not checkpointed"):
            check_state_dict(contract, plain_state_dict(scratch=TENSOR))
        state_dict = plain_state_dict()
        state_dict["state"][0]["scratch"] = TENSOR
        with pytest.raises(ConformanceError, match=r"\['state'\]\[0\]: holds 'scratch'"):
            check_state_dict(contract, state_dict)

    def test_structure(self, contract: OptimizerContract) -> None:
        with pytest.raises(ConformanceError, match="must be a dict"):
            check_state_dict(contract, [("state", {})])
        with pytest.raises(ConformanceError, match="missing 'param_groups'"):
            check_state_dict(contract, {"state": {}, "codebook": TENSOR})
        with pytest.raises(ConformanceError, match=r"\['state'\]: must be a dict"):
            check_state_dict(contract, plain_state_dict(state=[]))
        with pytest.raises(ConformanceError, match=r"\['param_groups'\]: must be a list"):
            check_state_dict(contract, plain_state_dict(param_groups={}))
        with pytest.raises(ConformanceError, match=r"\['state'\]\[5\]: must be a dict"):
            check_state_dict(contract, plain_state_dict(state={5: ["step"]}))

    def test_an_entry_no_group_lists_is_refused(self, contract: OptimizerContract) -> None:
        # These passed, and torch's load_state_dict then dropped the entries (or raised a
        # KeyError for the group without 'params').
        shifted = plain_state_dict(state={10: entry("step", "m", "v")})
        with pytest.raises(ConformanceError, match=r"\['state'\]\[10\]: its key is listed in no"):
            check_state_dict(contract, shifted)
        by_tensor = plain_state_dict(state={TENSOR: entry("step", "m", "v")})
        with pytest.raises(ConformanceError, match="listed in no group's 'params'"):
            check_state_dict(contract, by_tensor)
        no_params = plain_state_dict(param_groups=[{"lr": 0.1}])
        with pytest.raises(ConformanceError, match=r"\['param_groups'\]\[0\]\['params'\]: must"):
            check_state_dict(contract, no_params)
        with pytest.raises(ConformanceError, match=r"\['param_groups'\]\[0\]: must be a dict"):
            check_state_dict(contract, plain_state_dict(param_groups=[[0, 1]]))

    def test_undeclared_entry_key(self, contract: OptimizerContract) -> None:
        state_dict = plain_state_dict()
        state_dict["state"][1]["foo"] = TENSOR
        with pytest.raises(ConformanceError, match="undeclared state keys"):
            check_state_dict(contract, state_dict)


def composite_state_dict(**overrides: object) -> dict[str, Any]:
    result: dict[str, Any] = {
        "main": {
            "state": {0: entry("step", "exp_avg", "exp_avg_sq")},
            "param_groups": [{"params": [0]}],
        },
        "backup": {"state": {0: {"anything": TENSOR}}, "param_groups": []},
        "composite_meta": {"v": 1},
    }
    result.update(overrides)
    return result


class TestCompositeStateDict:
    def test_accepts_namespaces_and_common_fields_only(
        self, composite_contract: OptimizerContract
    ) -> None:
        assert check_state_dict(composite_contract, composite_state_dict()) == {
            "main/0": ("adamw",)
        }
        assert check_state_dict(composite_contract, composite_state_dict(spare=None)) == {
            "main/0": ("adamw",)
        }

    def test_filters_use_namespaced_keys(self, composite_contract: OptimizerContract) -> None:
        with pytest.raises(ConformanceError, match="no state variant"):
            check_state_dict(
                composite_contract, composite_state_dict(), parameter_layouts={"main/0": FLAT}
            )

    def test_absent_childs_namespace_must_be_absent_or_none(
        self, composite_contract: OptimizerContract
    ) -> None:
        with pytest.raises(ConformanceError, match="absent child"):
            check_state_dict(
                composite_contract, composite_state_dict(spare={"state": {}, "param_groups": []})
            )

    def test_rejects_state_and_param_groups_at_the_top(
        self, composite_contract: OptimizerContract
    ) -> None:
        with pytest.raises(ConformanceError, match="top-level keys must be"):
            check_state_dict(composite_contract, composite_state_dict(state={}))
        with pytest.raises(ConformanceError, match="top-level keys must be"):
            check_state_dict(composite_contract, composite_state_dict(param_groups=[]))

    def test_child_state_is_checked_recursively(
        self, composite_contract: OptimizerContract
    ) -> None:
        state_dict = composite_state_dict()
        del state_dict["main"]["state"][0]["exp_avg_sq"]
        with pytest.raises(
            ConformanceError, match=r"^state_dict\['main'\]\['state'\]\[0\]: no state variant"
        ):
            check_state_dict(composite_contract, state_dict)

    def test_contractless_child_is_checked_for_shape(
        self, composite_contract: OptimizerContract
    ) -> None:
        with pytest.raises(ConformanceError, match=r"\['backup'\]: missing 'state'"):
            check_state_dict(composite_contract, composite_state_dict(backup={"param_groups": []}))
        with pytest.raises(ConformanceError, match=r"\['backup'\]: must be a dict"):
            check_state_dict(composite_contract, composite_state_dict(backup=None))

    def test_present_child_needs_its_namespace(self, composite_contract: OptimizerContract) -> None:
        state_dict = composite_state_dict()
        del state_dict["main"]
        with pytest.raises(ConformanceError, match="missing namespace 'main'"):
            check_state_dict(composite_contract, state_dict)

    def test_missing_common_field(self, composite_contract: OptimizerContract) -> None:
        state_dict = composite_state_dict()
        del state_dict["composite_meta"]
        with pytest.raises(ConformanceError, match="missing required common field"):
            check_state_dict(composite_contract, state_dict)


class Provider:
    def __init__(self, contract: OptimizerContract) -> None:
        self.contract = contract
        self.calls = 0

    def optimizer_contract(self) -> OptimizerContract:
        self.calls += 1
        return self.contract


class TestRoundtripAndProvider:
    def test_roundtrip_passes_on_contracts_and_other_values(
        self,
        adamw_contract: OptimizerContract,
        composite_contract: OptimizerContract,
        golden_manifest: Any,
    ) -> None:
        check_contract_roundtrip(adamw_contract)
        check_contract_roundtrip(composite_contract)
        check_contract_roundtrip(golden_manifest)
        with pytest.raises(ContractTypeError):
            check_contract_roundtrip(adamw_contract.to_primitive())  # type: ignore[arg-type]

    def test_roundtrip_detects_a_broken_primitive_form(
        self, adamw_contract: OptimizerContract, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        original = OptimizerContract.to_primitive

        def drops_children(self: OptimizerContract) -> dict[str, object]:
            primitive = original(self)
            del primitive["children"]
            return primitive

        monkeypatch.setattr(OptimizerContract, "to_primitive", drops_children)
        with pytest.raises(ConformanceError, match="rejected"):
            check_contract_roundtrip(adamw_contract)

    def test_roundtrip_detects_a_lossy_parse(
        self, adamw_contract: OptimizerContract, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def renamed(cls: type, obj: dict[str, Any]) -> OptimizerContract:
            import dataclasses

            return dataclasses.replace(adamw_contract, implementation="other.Name")

        monkeypatch.setattr(OptimizerContract, "from_primitive", classmethod(renamed))
        with pytest.raises(ConformanceError, match="differs"):
            check_contract_roundtrip(adamw_contract)

    def test_provider(self, adamw_contract: OptimizerContract) -> None:
        provider = Provider(adamw_contract)
        assert check_provider(provider) is adamw_contract
        assert provider.calls == 2

    def test_not_a_provider(self) -> None:
        with pytest.raises(ConformanceError, match="no optimizer_contract"):
            check_provider(object())

    def test_unstable_provider(
        self, adamw_contract: OptimizerContract, composite_contract: OptimizerContract
    ) -> None:
        answers = iter([adamw_contract, composite_contract])

        class Flaky:
            def optimizer_contract(self) -> OptimizerContract:
                return next(answers)

        with pytest.raises(ConformanceError, match="different contracts"):
            check_provider(Flaky())

    def test_provider_returning_a_primitive(self, adamw_contract: OptimizerContract) -> None:
        class Wrong:
            def optimizer_contract(self) -> object:
                return adamw_contract.to_primitive()

        with pytest.raises(ConformanceError, match="must return an OptimizerContract"):
            check_provider(Wrong())

    def test_provider_that_raises(self) -> None:
        class Broken:
            def optimizer_contract(self) -> OptimizerContract:
                raise RuntimeError("not ready")

        with pytest.raises(ConformanceError, match="raised RuntimeError") as caught:
            check_provider(Broken())
        assert isinstance(caught.value.__cause__, RuntimeError)
