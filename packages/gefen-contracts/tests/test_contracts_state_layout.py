"""StateField, StateVariant and OptimizerStateLayout rules (spec 40 §5, §12)."""

from __future__ import annotations

from typing import Any

import pytest

from gefen.contracts import (
    ContractTypeError,
    ContractValueError,
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

REPLICATED = ParameterLayout.REPLICATED
FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD


def state_field(name: str = "m", **overrides: Any) -> StateField:
    kwargs: dict[str, Any] = {
        "name": name,
        "scope": StateScope.PARAMETER,
        "geometry": StateGeometry.PARAMETER,
        "checkpointed": True,
    }
    kwargs.update(overrides)
    return StateField(**kwargs)


def variant(name: str = "v", **overrides: Any) -> StateVariant:
    kwargs: dict[str, Any] = {
        "name": name,
        "fields": ("m",),
        "layouts": {REPLICATED},
        "extent": StateExtent.GLOBAL_PARAMETER,
    }
    kwargs.update(overrides)
    return StateVariant(**kwargs)


class TestStateField:
    @pytest.mark.parametrize(
        ("field_name", "value"),
        [("checkpointed", "false"), ("checkpointed", 1), ("optional", 0)],
    )
    def test_flags_must_be_real_bools(self, field_name: str, value: object) -> None:
        with pytest.raises(ContractTypeError, match=rf"^StateField\.{field_name} must be a bool"):
            state_field(**{field_name: value})

    def test_message_format_is_location_rule_value(self) -> None:
        with pytest.raises(ContractTypeError) as caught:
            state_field(checkpointed="false")
        assert str(caught.value) == "StateField.checkpointed must be a bool, got 'false' (str)"

    def test_long_values_are_truncated_to_80_characters(self) -> None:
        with pytest.raises(ContractTypeError) as caught:
            state_field(checkpointed="x" * 500)
        shown = str(caught.value).split("got ", 1)[1].rsplit(" (", 1)[0]
        assert len(shown) == 80
        assert shown.endswith("...")

    def test_sharded_mode_names_follow_the_name_rule(self) -> None:
        with pytest.raises(ContractValueError, match=r"^StateField\.applicable_sharded_modes\["):
            state_field(applicable_sharded_modes={" exact"})

    def test_authoritative_is_derived_from_scope(self) -> None:
        assert state_field().authoritative
        assert state_field(scope=StateScope.OPTIMIZER_COMMON).authoritative
        assert not state_field(scope=StateScope.DERIVED).authoritative
        with pytest.raises(TypeError):
            state_field(authoritative=True)

    def test_matches_exact_and_prefix(self) -> None:
        exact = state_field("exp_avg")
        prefix = state_field("exp_avg", key_match=StateKeyMatch.PREFIX)
        assert exact.matches("exp_avg")
        assert not exact.matches("exp_avg_sq")
        assert prefix.matches("exp_avg_sq")
        assert not prefix.matches("exp")
        assert not exact.matches(3)
        assert not prefix.matches(3)
        assert not prefix.matches(b"exp_avg")

    def test_defaults(self) -> None:
        value = state_field()
        assert value.key_match is StateKeyMatch.EXACT
        assert value.applicable_sharded_modes == frozenset()
        assert value.optional is False
        assert value.description == ""


class TestStateVariant:
    @pytest.mark.parametrize("field_name", ["initialized", "migration_only"])
    def test_flags_reject_ints(self, field_name: str) -> None:
        with pytest.raises(ContractTypeError, match=rf"^StateVariant\.{field_name} must be a bool"):
            variant(**{field_name: 1})

    def test_initialized_true_is_accepted(self) -> None:
        assert variant(initialized=True).initialized is True
        assert variant(initialized=False).initialized is False

    def test_raw_layout_string_is_a_type_error_at_the_element(self) -> None:
        with pytest.raises(ContractTypeError) as caught:
            variant(layouts={"replicated"})
        assert str(caught.value).startswith("StateVariant.layouts[")

    def test_mixed_member_and_value_set_collapses_before_validation(self) -> None:
        # A str-mixin member equals its value, so the set keeps whichever was inserted first.
        assert variant(layouts={REPLICATED, "replicated"}).layouts == frozenset({REPLICATED})
        with pytest.raises(ContractTypeError, match=r"^StateVariant\.layouts\["):
            variant(layouts={"replicated", REPLICATED})

    def test_layouts_must_not_be_empty(self) -> None:
        with pytest.raises(ContractValueError, match=r"^StateVariant\.layouts: must not be empty"):
            variant(layouts=set())

    @pytest.mark.parametrize(
        ("ranks", "error"),
        [
            ((True,), ContractTypeError),
            ((1.0,), ContractTypeError),
            ((-1,), ContractValueError),
            ((2, 2), ContractValueError),
        ],
    )
    def test_parameter_ranks(self, ranks: tuple[object, ...], error: type[Exception]) -> None:
        with pytest.raises(error, match=r"^StateVariant\.parameter_ranks\["):
            variant(parameter_ranks=ranks)

    def test_excluded_ranks_must_be_disjoint(self) -> None:
        with pytest.raises(ContractValueError, match="disjoint"):
            variant(parameter_ranks=(2,), excluded_parameter_ranks=(2,))
        assert variant(parameter_ranks=(1,), excluded_parameter_ranks=(2,))

    def test_fields_must_be_unique_and_non_empty(self) -> None:
        with pytest.raises(ContractValueError, match=r"^StateVariant\.fields\[1\]: duplicate"):
            variant(fields=("m", "m"))
        with pytest.raises(ContractValueError, match=r"^StateVariant\.fields: must not be empty"):
            variant(fields=())

    def test_inactive_fields_must_be_a_subset_of_fields(self) -> None:
        with pytest.raises(ContractValueError, match=r"^StateVariant\.inactive_fields\[0\]"):
            variant(fields=("m",), inactive_fields=("n",))
        assert variant(fields=("m", "n"), inactive_fields=("n",)).inactive_fields == ("n",)

    def test_applies_to_layouts_is_a_non_empty_subset(self) -> None:
        with pytest.raises(
            ContractValueError, match=r"^StateVariant\.applies_to_layouts: must not"
        ):
            variant(applies_to_layouts=set())
        with pytest.raises(ContractValueError, match="subset of layouts"):
            variant(layouts={REPLICATED}, applies_to_layouts={FLAT})

    def test_applies_to_filters(self) -> None:
        value = variant(
            parameter_ranks=(1, 2),
            excluded_parameter_ranks=(0,),
            sharded_mode="exact",
            role=ParameterStateRole.OWNER,
        )
        assert value.applies_to()
        assert value.applies_to(ndim=2)
        assert not value.applies_to(ndim=3)
        assert not value.applies_to(ndim=0)
        assert value.applies_to(sharded_mode="exact")
        assert not value.applies_to(sharded_mode="other")
        assert value.applies_to(role=ParameterStateRole.OWNER)
        assert value.applies_to(role=ParameterStateRole.ANY)
        assert not value.applies_to(role=ParameterStateRole.NON_OWNER)
        assert variant().applies_to(role=ParameterStateRole.NON_OWNER)
        assert variant(excluded_parameter_ranks=(0,)).applies_to(ndim=5)
        assert not variant(excluded_parameter_ranks=(0,)).applies_to(ndim=0)
        assert variant().applies_to(sharded_mode="anything")

    def test_applies_to_rejects_look_alike_arguments(self) -> None:
        with pytest.raises(ContractTypeError, match=r"^StateVariant\.applies_to\.ndim"):
            variant().applies_to(ndim=True)
        with pytest.raises(ContractTypeError, match=r"^StateVariant\.applies_to\.layout"):
            variant().applies_to(layout="replicated")  # type: ignore[arg-type]

    def test_layout_selects_between_equal_key_sets_with_different_extents(self) -> None:
        global_variant = variant(
            "global", layouts={REPLICATED, FLAT}, applies_to_layouts={REPLICATED}
        )
        local_variant = variant(
            "local",
            layouts={REPLICATED, FLAT},
            applies_to_layouts={FLAT},
            extent=StateExtent.LOCAL_STORAGE,
        )
        assert global_variant.applies_to(layout=REPLICATED)
        assert not global_variant.applies_to(layout=FLAT)
        assert local_variant.applies_to(layout=FLAT)
        assert not local_variant.applies_to(layout=REPLICATED)
        assert not variant(layouts={REPLICATED}).applies_to(layout=FLAT)


class TestOptimizerStateLayout:
    def layout(self, **overrides: Any) -> OptimizerStateLayout:
        kwargs: dict[str, Any] = {
            "fields": [
                state_field("m"),
                state_field("count", scope=StateScope.OPTIMIZER_COMMON),
                state_field("cache", scope=StateScope.DERIVED, checkpointed=False),
            ],
            "parameter_variants": [variant("v")],
        }
        kwargs.update(overrides)
        return OptimizerStateLayout(**kwargs)

    def test_duplicate_field_names(self) -> None:
        with pytest.raises(ContractValueError, match=r"^OptimizerStateLayout\.fields\[1\]: dup"):
            self.layout(fields=[state_field("m"), state_field("m", geometry=StateGeometry.ROW)])

    def test_duplicate_variant_names(self) -> None:
        with pytest.raises(ContractValueError, match=r"parameter_variants\[1\]: duplicate"):
            self.layout(
                parameter_variants=[variant("v"), variant("v", extent=StateExtent.LOCAL_STORAGE)]
            )

    def test_duplicate_namespaces(self) -> None:
        with pytest.raises(ContractValueError, match=r"composite_namespaces\[1\]: duplicate"):
            self.layout(composite_namespaces=["a", "a"])

    @pytest.mark.parametrize("name", ["cache", "count", "undeclared"])
    def test_variant_must_name_parameter_fields(self, name: str) -> None:
        with pytest.raises(ContractValueError, match=r"parameter_variants\[0\]\.fields\[1\]"):
            self.layout(parameter_variants=[variant(fields=("m", name))])

    def test_a_dict_is_not_a_state_field(self) -> None:
        with pytest.raises(ContractTypeError, match=r"^OptimizerStateLayout\.fields\[0\] must be"):
            self.layout(fields=[{"name": "m"}])

    def test_fields_for_scope_keeps_declaration_order(self) -> None:
        layout = self.layout(
            fields=[state_field("b"), state_field("a"), state_field("m")],
        )
        assert [f.name for f in layout.fields_for_scope(StateScope.PARAMETER)] == ["b", "a", "m"]
        assert layout.fields_for_scope(StateScope.DERIVED) == ()
        with pytest.raises(ContractTypeError):
            layout.fields_for_scope("parameter")  # type: ignore[arg-type]

    def test_field_lookup_exact_before_prefix_and_longest_prefix_first(self) -> None:
        prefix = StateKeyMatch.PREFIX
        layout = self.layout(
            fields=[
                state_field("m"),
                state_field("ex", key_match=prefix),
                state_field("exp_", key_match=prefix),
                state_field("exp_avg"),
            ]
        )
        assert layout.field("exp_avg").name == "exp_avg"
        assert layout.field("exp_avg").key_match is StateKeyMatch.EXACT
        assert layout.field("exp_avg_sq").name == "exp_"
        assert layout.field("extra").name == "ex"
        with pytest.raises(KeyError):
            layout.field("x")
        with pytest.raises(KeyError):
            layout.field(3)

    def test_empty_layout_is_legal(self) -> None:
        layout = OptimizerStateLayout(fields=(), parameter_variants=())
        assert layout.composite_namespaces == ()
