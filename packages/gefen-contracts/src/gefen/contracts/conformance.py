"""Torch-free conformance checks for downstream test suites (spec 40 §8).

They look only at keys and Python containers, never at tensor values, so they run on a real
``state_dict()`` without importing torch. Every mismatch raises ``ConformanceError`` (an
``AssertionError``, so pytest reports it as a failed assertion).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gefen.contracts._base import ContractValue, value_types
from gefen.contracts._check import check_enum, check_exact, check_int, check_str, show, type_error
from gefen.contracts.capabilities import (
    OptimizerContract,
    OptimizerContractProvider,
)
from gefen.contracts.enums import ParameterLayout, ParameterStateRole, StateScope
from gefen.contracts.errors import ConformanceError, ContractError
from gefen.contracts.primitive import canonical_bytes
from gefen.contracts.state import OptimizerStateLayout, StateField, StateVariant

__all__ = [
    "check_contract_roundtrip",
    "check_provider",
    "check_state_dict",
    "match_state_variant",
]

_NEAREST = 3


@dataclass(frozen=True)
class _Filters:
    ndim: int | None = None
    sharded_mode: str | None = None
    role: ParameterStateRole | None = None
    layout: ParameterLayout | None = None

    def describe(self) -> str:
        given = {
            "ndim": self.ndim,
            "sharded_mode": self.sharded_mode,
            "role": self.role,
            "parameter_layout": self.layout,
        }
        parts = [f"{name}={show(value)}" for name, value in given.items() if value is not None]
        return ", ".join(parts) or "none"


def match_state_variant(
    layout: OptimizerStateLayout,
    keys: Iterable[object],
    *,
    ndim: int | None = None,
    sharded_mode: str | None = None,
    role: ParameterStateRole | None = None,
    parameter_layout: ParameterLayout | None = None,
) -> tuple[StateVariant, ...]:
    """Every variant (in declaration order) whose key set equals the entry's parameter keys."""
    check_exact("match_state_variant.layout", layout, OptimizerStateLayout)
    filters = _Filters(ndim, sharded_mode, role, parameter_layout)
    return _match(layout, keys, "match_state_variant", filters)


def _lookup(layout: OptimizerStateLayout, key: object) -> StateField | None:
    if type(key) is not str:
        return None
    try:
        return layout.field(key)
    except KeyError:
        return None


def _keys(location: str, keys: Iterable[object]) -> list[object]:
    if isinstance(keys, (str, bytes)):  # iterating a str would check its characters
        raise type_error(f"{location}.keys", "an iterable of state keys", keys)
    return list(keys)


def _match(
    layout: OptimizerStateLayout, keys: Iterable[object], location: str, filters: _Filters
) -> tuple[StateVariant, ...]:
    given = _keys(location, keys)
    unknown = [key for key in given if _lookup(layout, key) is None]
    if unknown:
        raise ConformanceError(f"{location}: undeclared state keys {_listing(unknown)}")
    reached: set[str] = set()
    for key in given:
        declared = _lookup(layout, key)
        assert declared is not None
        if declared.scope is StateScope.OPTIMIZER_COMMON:
            rule = "a per-parameter entry must not hold the optimizer_common key"
            raise ConformanceError(f"{location}: {rule} {show(key)}")
        if declared.scope is StateScope.PARAMETER:
            reached.add(declared.name)
    optional = {declared.name for declared in layout.fields if declared.optional}
    found = tuple(
        variant
        for variant in layout.parameter_variants
        if reached <= set(variant.fields)
        and set(variant.fields) - optional <= reached
        and variant.applies_to(filters.ndim, filters.sharded_mode, filters.role, filters.layout)
        and _fields_apply(layout, variant, filters.sharded_mode)
    )
    if not found:
        raise ConformanceError(_no_match_message(layout, given, reached, location, filters))
    return found


def _fields_apply(
    layout: OptimizerStateLayout, variant: StateVariant, sharded_mode: str | None
) -> bool:
    """Whether each field the variant names applies in the mode (the filter's, else the
    variant's own): a field declared for some sharded modes only exists in those."""
    mode = sharded_mode if sharded_mode is not None else variant.sharded_mode
    if mode is None:
        return True
    modes = (layout.field(name).applicable_sharded_modes for name in variant.fields)
    return all(not applicable or mode in applicable for applicable in modes)


def _listing(values: Iterable[object]) -> str:
    return "[" + ", ".join(sorted(show(value) for value in values)) + "]"


def _no_match_message(
    layout: OptimizerStateLayout,
    keys: list[object],
    reached: set[str],
    location: str,
    filters: _Filters,
) -> str:
    ranked = sorted(
        enumerate(layout.parameter_variants),
        key=lambda item: (len(reached.symmetric_difference(item[1].fields)), item[0]),
    )
    lines = [
        f"{location}: no state variant matches keys {_listing(keys)} "
        f"(filters: {filters.describe()})"
    ]
    for _, variant in ranked[:_NEAREST]:
        missing = _listing(set(variant.fields) - reached)
        extra = _listing(reached - set(variant.fields))
        applies = variant.applies_to(
            filters.ndim, filters.sharded_mode, filters.role, filters.layout
        )
        note = "" if applies else "; excluded by the filters"
        lines.append(f"  nearest {variant.name!r}: missing {missing}, extra {extra}{note}")
    if not layout.parameter_variants:
        lines.append("  the layout declares no parameter variants")
    return "\n".join(lines)


@dataclass(frozen=True)
class _EntryFilters:
    ndims: Mapping[Any, int] | None
    sharded_modes: Mapping[Any, str] | None
    roles: Mapping[Any, ParameterStateRole] | None
    layouts: Mapping[Any, ParameterLayout] | None

    def for_entry(self, key: object) -> _Filters:
        def pick(mapping: Mapping[Any, Any] | None) -> Any:
            return None if mapping is None else mapping.get(key)

        return _Filters(
            pick(self.ndims), pick(self.sharded_modes), pick(self.roles), pick(self.layouts)
        )


_FILTER_CHECKS: dict[str, Any] = {
    "ndims": lambda at, value: check_int(at, value, minimum=0),
    "sharded_modes": check_str,
    "roles": lambda at, value: check_enum(at, value, ParameterStateRole),
    "parameter_layouts": lambda at, value: check_enum(at, value, ParameterLayout),
}


def check_state_dict(
    contract: OptimizerContract,
    state_dict: object,
    *,
    ndims: Mapping[Any, int] | None = None,
    sharded_modes: Mapping[Any, str] | None = None,
    roles: Mapping[Any, ParameterStateRole] | None = None,
    parameter_layouts: Mapping[Any, ParameterLayout] | None = None,
) -> dict[object, tuple[str, ...]]:
    """Check ``state_dict`` against ``contract``; map each state key to its variant names.

    Keys of a composite's children come back as ``"<namespace>/<key>"``, and the per-entry filter
    mappings are keyed the same way.
    """
    check_exact("check_state_dict.contract", contract, OptimizerContract)
    named = {"ndims": ndims, "sharded_modes": sharded_modes, "roles": roles}
    named["parameter_layouts"] = parameter_layouts
    for name, mapping in named.items():
        if mapping is not None and not isinstance(mapping, Mapping):
            raise type_error(f"check_state_dict.{name}", "a mapping of state keys", mapping)
        for key, value in (mapping or {}).items():  # every value, state or not, by its key
            if value is not None:  # None: no filter for that entry
                _FILTER_CHECKS[name](f"check_state_dict.{name}[{show(key)}]", value)
    filters = _EntryFilters(ndims, sharded_modes, roles, parameter_layouts)
    result: dict[object, tuple[str, ...]] = {}
    _check_optimizer(contract, state_dict, "state_dict", "", filters, result)
    assert isinstance(state_dict, dict)
    known = _parameter_names(contract, state_dict, "")
    for name, mapping in named.items():
        # a key naming nothing (a parameter's name, a str index) would drop its filter silently
        stray = [key for key in mapping or () if key not in known]
        if stray:
            rule = "keys name no state entry or listed parameter of the state dict"
            raise ConformanceError(f"check_state_dict.{name}: {rule}: {_listing(stray)}")
    return result


def _parameter_names(
    contract: OptimizerContract | None, state_dict: dict[Any, Any], prefix: str
) -> set[object]:
    """The keys a filter mapping may use: each state entry's key and each id a group's
    ``params`` lists, children's as ``"<namespace>/<key>"`` (a checked state dict)."""
    names: set[object] = set()
    if contract is not None and contract.state_layout.composite_namespaces:
        for namespace in contract.state_layout.composite_namespaces:
            child, nested = contract.child(namespace), state_dict.get(namespace)
            if child is not None and isinstance(nested, dict):
                names |= _parameter_names(child.contract, nested, f"{prefix}{namespace}/")
        return names
    keys = list(state_dict["state"])
    for group in state_dict["param_groups"]:
        listed = group.get("params") if isinstance(group, dict) else None
        if isinstance(listed, list):
            keys.extend(key for key in listed if _hashable(key))
    names.update(f"{prefix}{key}" if prefix else key for key in keys)
    return names


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _check_optimizer(
    contract: OptimizerContract,
    state_dict: object,
    location: str,
    prefix: str,
    filters: _EntryFilters,
    result: dict[object, tuple[str, ...]],
) -> None:
    if not isinstance(state_dict, dict):
        raise ConformanceError(f"{location}: must be a dict, got {show(state_dict)}")
    layout = contract.state_layout
    _check_top_level(layout, state_dict, location)
    if layout.composite_namespaces:
        for namespace in layout.composite_namespaces:
            _check_namespace(contract, state_dict, namespace, location, prefix, filters, result)
        return
    state = _container(state_dict, "state", dict, location)
    listed = _listed_parameters(_container(state_dict, "param_groups", list, location), location)
    for entry_key, entry in state.items():
        entry_location = f"{location}['state'][{show(entry_key)}]"
        if not isinstance(entry, dict):
            raise ConformanceError(f"{entry_location}: must be a dict, got {show(entry)}")
        if not _hashable(entry_key) or entry_key not in listed:
            # torch's load_state_dict keys state by the ids the groups list: it drops the rest
            rule = "its key is listed in no group's 'params', so a load would drop the entry"
            raise ConformanceError(f"{entry_location}: {rule}")
        for key in entry:
            _reject_unsaved(layout, key, entry_location)
        name = f"{prefix}{entry_key}" if prefix else entry_key
        entry_filters = filters.for_entry(name)
        _check_supported_rank(contract, entry_filters.ndim, entry_location)
        variants = _match(layout, entry, entry_location, entry_filters)
        result[name] = tuple(variant.name for variant in variants)


def _check_supported_rank(contract: OptimizerContract, ndim: int | None, location: str) -> None:
    supported = contract.capabilities.supported_parameter_ranks
    if ndim is not None and supported is not None and ndim not in supported:
        rule = f"holds state for a parameter of ndim {ndim}, which supported_parameter_ranks"
        raise ConformanceError(f"{location}: {rule} {supported} excludes")


def _listed_parameters(groups: list[Any], location: str) -> set[object]:
    """The keys the groups' ``params`` lists name; each group must be a dict holding one."""
    listed: set[object] = set()
    for index, group in enumerate(groups):
        where = f"{location}['param_groups'][{index}]"
        if not isinstance(group, dict):
            raise ConformanceError(f"{where}: must be a dict, got {show(group)}")
        params = group.get("params")
        if not isinstance(params, list):
            raise ConformanceError(f"{where}['params']: must be a list, got {show(params)}")
        listed.update(key for key in params if _hashable(key))
    return listed


def _check_top_level(
    layout: OptimizerStateLayout, state_dict: dict[Any, Any], location: str
) -> None:
    namespaces = layout.composite_namespaces
    structural = () if namespaces else ("state", "param_groups")
    present: set[str] = set()
    for key in state_dict:
        if key in namespaces or key in structural:
            continue
        _reject_unsaved(layout, key, location)
        declared = _lookup(layout, key)
        if declared is None or declared.scope is StateScope.PARAMETER:
            rule = "top-level keys must be checkpointed optimizer_common or derived fields"
            raise ConformanceError(f"{location}: {rule}, got {show(key)}")
        present.add(declared.name)
    for declared in layout.fields_for_scope(StateScope.OPTIMIZER_COMMON):
        if declared.checkpointed and not declared.optional and declared.name not in present:
            raise ConformanceError(f"{location}: missing required common field {declared.name!r}")


def _reject_unsaved(layout: OptimizerStateLayout, key: object, location: str) -> None:
    declared = _lookup(layout, key)
    if declared is not None and not declared.checkpointed:
        rule = f"holds {show(key)} of field {declared.name!r}, which is not checkpointed"
        raise ConformanceError(f"{location}: {rule}")


def _container(state_dict: dict[Any, Any], key: str, kind: type, location: str) -> Any:
    if key not in state_dict:
        raise ConformanceError(f"{location}: missing {key!r}")
    value = state_dict[key]
    if not isinstance(value, kind):
        rule = f"must be a {kind.__name__}, got {show(value)}"
        raise ConformanceError(f"{location}[{key!r}]: {rule}")
    return value


def _check_namespace(
    contract: OptimizerContract,
    state_dict: dict[Any, Any],
    namespace: str,
    location: str,
    prefix: str,
    filters: _EntryFilters,
    result: dict[object, tuple[str, ...]],
) -> None:
    child = contract.child(namespace)
    nested_location = f"{location}[{namespace!r}]"
    if child is None:
        if state_dict.get(namespace) is not None:
            rule = "the namespace of an absent child must be absent or None"
            raise ConformanceError(f"{nested_location}: {rule}")
        return
    if namespace not in state_dict:
        raise ConformanceError(f"{location}: missing namespace {namespace!r} of child")
    nested = state_dict[namespace]
    if child.contract is not None:
        nested_prefix = f"{prefix}{namespace}/"
        _check_optimizer(child.contract, nested, nested_location, nested_prefix, filters, result)
        return
    # A child without a contract is checked for the shape of a torch optimizer state dict only.
    if not isinstance(nested, dict):
        raise ConformanceError(f"{nested_location}: must be a dict, got {show(nested)}")
    _container(nested, "state", dict, nested_location)
    _container(nested, "param_groups", list, nested_location)


def check_contract_roundtrip(contract: ContractValue) -> None:
    """Assert the primitive round trip (spec 40 §7.3, guarantees 1-2, plus byte equality)."""
    if type(contract) not in value_types():
        raise type_error("check_contract_roundtrip.contract", "a contract value", contract)
    name = type(contract).__name__
    primitive = contract.to_primitive()
    try:
        parsed = type(contract).from_primitive(primitive)
    except ContractError as error:
        raise ConformanceError(f"{name}: its own primitive form is rejected: {error}") from error
    if parsed != contract:
        raise ConformanceError(f"{name}: from_primitive(to_primitive()) differs from the value")
    if hash(parsed) != hash(contract):
        raise ConformanceError(f"{name}: the reparsed value hashes differently")
    if json.loads(json.dumps(primitive)) != primitive:
        raise ConformanceError(f"{name}: the primitive form does not survive JSON")
    if canonical_bytes(parsed.to_primitive()) != canonical_bytes(primitive):
        raise ConformanceError(f"{name}: the reparsed value encodes to different canonical bytes")


def check_provider(obj: object) -> OptimizerContract:
    """Check that ``obj`` publishes a stable, round-tripping contract, and return it."""
    if not isinstance(obj, OptimizerContractProvider):
        raise ConformanceError(
            f"check_provider: {type(obj).__name__} has no optimizer_contract() method"
        )
    contracts = []
    for _ in range(2):
        try:
            contract = obj.optimizer_contract()
        except Exception as error:
            raise ConformanceError(
                f"check_provider: optimizer_contract() raised {error!r}"
            ) from error
        if type(contract) is not OptimizerContract:
            rule = "optimizer_contract() must return an OptimizerContract"
            raise ConformanceError(f"check_provider: {rule}, got {show(contract)}")
        contracts.append(contract)
    if contracts[0] != contracts[1]:
        raise ConformanceError("check_provider: two calls returned different contracts")
    check_contract_roundtrip(contracts[0])
    return contracts[0]
