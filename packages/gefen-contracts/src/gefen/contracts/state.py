"""State-layout declarations: which keys an optimizer's state holds (spec 40 §5).

This module is generic: it never names a concrete optimizer's state key. The declarations live
next to the optimizers whose code makes them true.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gefen.contracts._base import (
    BoolKind,
    ContractValue,
    EnumKind,
    FrozenSetKind,
    IntKind,
    NameKind,
    NestedKind,
    OptionalKind,
    StrKind,
    TupleKind,
    meta,
)
from gefen.contracts._check import check_enum, check_int, check_str, check_unique, value_error
from gefen.contracts.enums import (
    ParameterLayout,
    ParameterStateRole,
    StateExtent,
    StateGeometry,
    StateKeyMatch,
    StateScope,
)

_NAME = meta(NameKind())
_BOOL = meta(BoolKind())
_TEXT = meta(StrKind())
_NAMES = meta(FrozenSetKind(NameKind()))
_RANKS = TupleKind(IntKind(minimum=0), unique=True)
_LAYOUTS = FrozenSetKind(EnumKind(ParameterLayout), non_empty=True)


@dataclass(frozen=True, kw_only=True)
class StateField(ContractValue):
    """One key, or family of keys sharing a prefix, of optimizer state."""

    name: str = field(metadata=_NAME)
    scope: StateScope = field(metadata=meta(EnumKind(StateScope)))
    geometry: StateGeometry = field(metadata=meta(EnumKind(StateGeometry)))
    checkpointed: bool = field(metadata=_BOOL)
    key_match: StateKeyMatch = field(
        default=StateKeyMatch.EXACT, metadata=meta(EnumKind(StateKeyMatch))
    )
    applicable_sharded_modes: frozenset[str] = field(default=frozenset(), metadata=_NAMES)
    optional: bool = field(default=False, metadata=_BOOL)
    description: str = field(default="", metadata=_TEXT)

    def _validate(self) -> None:
        if self.optional and not self.checkpointed:
            rule = "marks a checkpointed field that may be absent; this one is not checkpointed"
            raise value_error("StateField.optional", rule, self.name)

    @property
    def authoritative(self) -> bool:
        """False for a ``DERIVED`` field: a cache or carrier rebuilt from authoritative state."""
        return self.scope is not StateScope.DERIVED

    def matches(self, key: object) -> bool:
        if self.key_match is StateKeyMatch.EXACT:
            return key == self.name
        return type(key) is str and key.startswith(self.name)


@dataclass(frozen=True, kw_only=True)
class StateVariant(ContractValue):
    """One legal key set of a per-parameter state entry, and where it applies."""

    name: str = field(metadata=_NAME)
    fields: tuple[str, ...] = field(
        metadata=meta(TupleKind(NameKind(), unique=True, non_empty=True))
    )
    layouts: frozenset[ParameterLayout] = field(metadata=meta(_LAYOUTS))
    extent: StateExtent = field(metadata=meta(EnumKind(StateExtent)))
    role: ParameterStateRole = field(
        default=ParameterStateRole.ANY, metadata=meta(EnumKind(ParameterStateRole))
    )
    initialized: bool = field(default=True, metadata=_BOOL)
    parameter_ranks: tuple[int, ...] | None = field(
        default=None,
        metadata=meta(OptionalKind(TupleKind(IntKind(minimum=0), unique=True, non_empty=True))),
    )
    excluded_parameter_ranks: tuple[int, ...] = field(default=(), metadata=meta(_RANKS))
    sharded_mode: str | None = field(default=None, metadata=meta(OptionalKind(NameKind())))
    applies_to_layouts: frozenset[ParameterLayout] | None = field(
        default=None, metadata=meta(OptionalKind(_LAYOUTS))
    )
    inactive_fields: tuple[str, ...] = field(
        default=(), metadata=meta(TupleKind(NameKind(), unique=True))
    )
    migration_only: bool = field(default=False, metadata=_BOOL)
    description: str = field(default="", metadata=_TEXT)

    def _validate(self) -> None:
        allowed = self.parameter_ranks or ()
        for index, rank in enumerate(self.excluded_parameter_ranks):
            if rank in allowed:
                raise value_error(
                    f"StateVariant.excluded_parameter_ranks[{index}]",
                    "must be disjoint from parameter_ranks",
                    rank,
                )
        if self.applies_to_layouts is not None and not self.applies_to_layouts <= self.layouts:
            raise value_error(
                "StateVariant.applies_to_layouts",
                "must be a subset of layouts",
                sorted(layout.value for layout in self.applies_to_layouts - self.layouts),
            )
        for index, name in enumerate(self.inactive_fields):
            if name not in self.fields:
                raise value_error(
                    f"StateVariant.inactive_fields[{index}]", "must be one of fields", name
                )

    def applies_to(
        self,
        ndim: int | None = None,
        sharded_mode: str | None = None,
        role: ParameterStateRole | None = None,
        layout: ParameterLayout | None = None,
    ) -> bool:
        """Whether this variant may describe an entry; an argument left ``None`` is not a filter."""
        location = "StateVariant.applies_to"
        if ndim is not None:
            check_int(f"{location}.ndim", ndim, minimum=0)
            if self.parameter_ranks is not None and ndim not in self.parameter_ranks:
                return False
            if ndim in self.excluded_parameter_ranks:
                return False
        if sharded_mode is not None:
            check_str(f"{location}.sharded_mode", sharded_mode)
            if self.sharded_mode is not None and sharded_mode != self.sharded_mode:
                return False
        if role is not None:
            check_enum(f"{location}.role", role, ParameterStateRole)
            any_role = ParameterStateRole.ANY
            if any_role not in (role, self.role) and role is not self.role:
                return False
        if layout is not None:
            check_enum(f"{location}.layout", layout, ParameterLayout)
            scope = self.layouts if self.applies_to_layouts is None else self.applies_to_layouts
            if layout not in scope:
                return False
        return True


@dataclass(frozen=True, kw_only=True)
class OptimizerStateLayout(ContractValue):
    """Every state field of an optimizer and the legal per-parameter key sets."""

    fields: tuple[StateField, ...] = field(metadata=meta(TupleKind(NestedKind("StateField"))))
    parameter_variants: tuple[StateVariant, ...] = field(
        metadata=meta(TupleKind(NestedKind("StateVariant")))
    )
    composite_namespaces: tuple[str, ...] = field(
        default=(), metadata=meta(TupleKind(NameKind(), unique=True, what="namespace"))
    )

    def _validate(self) -> None:
        location = "OptimizerStateLayout"
        check_unique(f"{location}.fields", tuple(f.name for f in self.fields), "field name")
        variant_names = tuple(variant.name for variant in self.parameter_variants)
        check_unique(f"{location}.parameter_variants", variant_names, "variant name")
        declared = {state_field.name: state_field for state_field in self.fields}
        for index, variant in enumerate(self.parameter_variants):
            for position, name in enumerate(variant.fields):
                target = declared.get(name)
                where = f"{location}.parameter_variants[{index}].fields[{position}]"
                if target is None or target.scope is not StateScope.PARAMETER:
                    rule = "must name a declared field of scope 'parameter'"
                    raise value_error(where, rule, name)
                if not target.checkpointed:
                    # check_state_dict refuses the key wherever it appears: never matched
                    raise value_error(where, "must name a checkpointed field", name)
                modes = target.applicable_sharded_modes
                if variant.sharded_mode is not None and modes and variant.sharded_mode not in modes:
                    rule = (
                        f"names a field that does not apply in the variant's sharded_mode "
                        f"{variant.sharded_mode!r} (its applicable_sharded_modes: {sorted(modes)})"
                    )
                    raise value_error(where, rule, name)
        self._check_top_level_names()

    def _check_top_level_names(self) -> None:
        """A top-level field must not take a name the state dict's structure already holds
        (``state``/``param_groups``, or a composite's namespaces): it could never be found."""
        taken = self.composite_namespaces or ("state", "param_groups")
        for index, declared in enumerate(self.fields):
            if declared.scope is not StateScope.PARAMETER and declared.name in taken:
                rule = f"a top-level field must not be named like the structure's keys {taken}"
                raise value_error(f"OptimizerStateLayout.fields[{index}].name", rule, declared.name)

    def fields_for_scope(self, scope: StateScope) -> tuple[StateField, ...]:
        """The fields of ``scope`` in declaration order."""
        check_enum("OptimizerStateLayout.fields_for_scope.scope", scope, StateScope)
        return tuple(declared for declared in self.fields if declared.scope is scope)

    def field(self, key: object) -> StateField:
        """The ``EXACT`` field named ``key``, else the longest matching ``PREFIX`` field."""
        best: StateField | None = None
        for declared in self.fields:
            if not declared.matches(key):
                continue
            if declared.key_match is StateKeyMatch.EXACT:
                return declared
            if best is None or len(declared.name) > len(best.name):
                best = declared
        if best is None:
            raise KeyError(key)
        return best
