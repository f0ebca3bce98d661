"""Field kinds and the base every contract value builds on (spec 40 §3, §7).

A field declares its kind once, in its dataclass metadata; the same kind then validates the
field, writes its primitive form and parses it back. Keeping the three together is what makes the
validation uniform and the round trip exact: no type can validate a field one way and parse it
another.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

from gefen.contracts._check import (
    E,
    check_bool,
    check_enum,
    check_fqn,
    check_int,
    check_name,
    check_schema_version,
    check_text,
    check_unique,
    show,
    type_error,
    value_error,
)
from gefen.contracts.errors import ContractError, PrimitiveFormError

V = TypeVar("V", bound="ContractValue")

_SEQUENCES = (list, tuple)
_SET_INPUTS = (set, frozenset, list, tuple)


def form_error(path: str, rule: str) -> PrimitiveFormError:
    return PrimitiveFormError(f"{path}: {rule}")


def _expect(path: str, raw: object, json_type: type, expected: str) -> None:
    if type(raw) is not json_type:
        raise form_error(path, f"must be {expected}, got {show(raw)} ({type(raw).__name__})")


class Kind:
    """How one field is validated, written to and parsed from its primitive form."""

    def check(self, location: str, value: object) -> object:
        raise NotImplementedError

    def to_primitive(self, value: object) -> object:
        return value

    def parse(self, path: str, raw: object) -> object:
        raise NotImplementedError


class BoolKind(Kind):
    def check(self, location: str, value: object) -> object:
        return check_bool(location, value)

    def parse(self, path: str, raw: object) -> object:
        _expect(path, raw, bool, "a bool")
        return raw


class IntKind(Kind):
    def __init__(self, minimum: int | None = None) -> None:
        self.minimum = minimum

    def check(self, location: str, value: object) -> object:
        return check_int(location, value, self.minimum)

    def parse(self, path: str, raw: object) -> object:
        _expect(path, raw, int, "an int")
        return raw


class StrKind(Kind):
    def check(self, location: str, value: object) -> object:
        return check_text(location, value)

    def parse(self, path: str, raw: object) -> object:
        _expect(path, raw, str, "a str")
        return raw


class NameKind(StrKind):
    def check(self, location: str, value: object) -> object:
        return check_name(location, value)


class FqnKind(StrKind):
    def check(self, location: str, value: object) -> object:
        return check_fqn(location, value)


class SchemaVersionKind(IntKind):
    """Checked after every other rule of its type, so it is skipped in the field pass."""

    def __init__(self, supported: int) -> None:
        super().__init__()
        self.supported = supported

    def check(self, location: str, value: object) -> object:
        return check_schema_version(location, value, self.supported)


class EnumKind(Kind, Generic[E]):
    def __init__(self, enum_type: type[E]) -> None:
        self.enum_type = enum_type
        self.by_value = {member.value: member for member in enum_type}

    def check(self, location: str, value: object) -> object:
        return check_enum(location, value, self.enum_type)

    def to_primitive(self, value: object) -> object:
        assert isinstance(value, enum.Enum)
        return value.value

    def parse(self, path: str, raw: object) -> object:
        _expect(path, raw, str, "a str")
        member = self.by_value.get(raw)
        if member is None:
            raise form_error(path, f"unknown {self.enum_type.__name__} value {show(raw)}")
        return member


def _with_article(name: str) -> str:
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


class NestedKind(Kind):
    """A contract value of one of the named types, looked up lazily to allow forward references."""

    def __init__(self, *type_names: str) -> None:
        self.type_names = type_names

    def types(self) -> tuple[type[ContractValue], ...]:
        return tuple(_REGISTRY[name] for name in self.type_names)

    def check(self, location: str, value: object) -> object:
        if type(value) not in self.types():
            raise type_error(location, " or ".join(map(_with_article, self.type_names)), value)
        return value

    def to_primitive(self, value: object) -> object:
        assert isinstance(value, ContractValue)
        return value.to_primitive()

    def parse(self, path: str, raw: object) -> object:
        _expect(path, raw, dict, "a dict")
        candidates = self.types()
        if len(candidates) == 1:
            return candidates[0].from_primitive_at(path, raw)
        assert isinstance(raw, dict)
        tag = raw.get("kind")
        for candidate in candidates:
            if type(tag) is str and tag == candidate.TAG:
                return candidate.from_primitive_at(path, raw)
        tags = ", ".join(repr(candidate.TAG) for candidate in candidates)
        raise form_error(f"{path}.kind", f"wrong kind tag, expected one of {tags}, got {show(tag)}")


class OptionalKind(Kind):
    def __init__(self, inner: Kind) -> None:
        self.inner = inner

    def check(self, location: str, value: object) -> object:
        return None if value is None else self.inner.check(location, value)

    def to_primitive(self, value: object) -> object:
        return None if value is None else self.inner.to_primitive(value)

    def parse(self, path: str, raw: object) -> object:
        return None if raw is None else self.inner.parse(path, raw)


class TupleKind(Kind):
    def __init__(
        self, inner: Kind, *, unique: bool = False, non_empty: bool = False, what: str = "element"
    ) -> None:
        self.inner = inner
        self.unique = unique
        self.non_empty = non_empty
        self.what = what

    def check(self, location: str, value: object) -> object:
        if type(value) not in _SEQUENCES:
            raise type_error(location, "a list or tuple", value)
        assert isinstance(value, (list, tuple))
        items = tuple(self.inner.check(f"{location}[{i}]", item) for i, item in enumerate(value))
        if self.non_empty and not items:
            raise value_error(location, "must not be empty")
        if self.unique:
            check_unique(location, items, self.what)
        return items

    def to_primitive(self, value: object) -> object:
        assert isinstance(value, tuple)
        return [self.inner.to_primitive(item) for item in value]

    def parse(self, path: str, raw: object) -> object:
        _expect(path, raw, list, "a list")
        assert isinstance(raw, list)
        return tuple(self.inner.parse(f"{path}[{i}]", item) for i, item in enumerate(raw))


class FrozenSetKind(Kind):
    def __init__(self, inner: Kind, *, non_empty: bool = False) -> None:
        self.inner = inner
        self.non_empty = non_empty

    def check(self, location: str, value: object) -> object:
        if type(value) not in _SET_INPUTS:
            raise type_error(location, "a set, frozenset, list or tuple", value)
        assert isinstance(value, (set, frozenset, list, tuple))
        # Set iteration order follows hash randomization; sorting by repr makes the first
        # reported element the same in every process.
        for item in sorted(value, key=repr):
            self.inner.check(f"{location}[{show(item)}]", item)
        items = frozenset(value)
        if len(items) != len(value):
            seen: set[object] = set()
            for item in value:
                if item in seen:
                    raise value_error(location, "duplicate element", item)
                seen.add(item)
        if self.non_empty and not items:
            raise value_error(location, "must not be empty")
        return items

    def to_primitive(self, value: object) -> object:
        assert isinstance(value, frozenset)
        # Set elements are names or enum members, so their primitives are all str.
        texts: list[str] = []
        for item in value:
            primitive = self.inner.to_primitive(item)
            assert type(primitive) is str
            texts.append(primitive)
        return sorted(texts)

    def parse(self, path: str, raw: object) -> object:
        _expect(path, raw, list, "a list")
        assert isinstance(raw, list)
        items: list[object] = []
        for index, item in enumerate(raw):
            parsed = self.inner.parse(f"{path}[{index}]", item)
            if parsed in items:
                raise form_error(f"{path}[{index}]", f"duplicate element {show(item)}")
            items.append(parsed)
        return frozenset(items)


def meta(spec: Kind) -> Mapping[str, Any]:
    """Dataclass field metadata declaring ``spec`` as the field's kind."""
    return MappingProxyType({"kind": spec})


_REGISTRY: dict[str, type[ContractValue]] = {}


def value_types() -> tuple[type[ContractValue], ...]:
    """Every contract value type of this package, in definition order."""
    return tuple(_REGISTRY.values())


class ContractValue:
    """Validation and primitive form shared by every contract dataclass.

    Subclasses are frozen dataclasses whose fields carry a ``Kind`` in their metadata, and add
    their cross-field rules in ``_validate``.
    """

    TAG: ClassVar[str | None] = None
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Only this package's own types are nested by name; a user's subclass of the same name
        # must not replace them (and is rejected by the exact-type checks anyway).
        if cls.__module__.startswith("gefen.contracts.") and cls.__name__ not in _REGISTRY:
            _REGISTRY[cls.__name__] = cls

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for field in dataclasses.fields(self):
            spec = field.metadata["kind"]
            if isinstance(spec, SchemaVersionKind):
                continue
            checked = spec.check(f"{owner}.{field.name}", getattr(self, field.name))
            # Frozen: the normalised copy replaces the caller's container.
            object.__setattr__(self, field.name, checked)
        self._validate()
        self._check_schema_version()

    def _validate(self) -> None:
        """Cross-field rules; run after every field passed its own checks."""

    def _check_schema_version(self) -> None:
        field = self.__dataclass_fields__.get("schema_version")
        if field is not None:
            field.metadata["kind"].check(
                f"{type(self).__name__}.schema_version", getattr(self, field.name)
            )

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def to_primitive(self) -> dict[str, object]:
        """The JSON-compatible form: exactly the field names, plus ``"kind"`` for tagged types."""
        primitive: dict[str, object] = {} if self.TAG is None else {"kind": self.TAG}
        for field in dataclasses.fields(self):
            spec: Kind = field.metadata["kind"]
            primitive[field.name] = spec.to_primitive(getattr(self, field.name))
        return primitive

    @classmethod
    def from_primitive(cls: type[V], obj: object) -> V:
        """Parse a primitive form; any malformation raises ``PrimitiveFormError``."""
        return cls.from_primitive_at(cls.__name__, obj)

    @classmethod
    def from_primitive_at(cls: type[V], path: str, raw: object) -> V:
        _expect(path, raw, dict, "a dict")
        assert isinstance(raw, dict)
        fields = dataclasses.fields(cls)
        expected = [field.name for field in fields]
        if cls.TAG is not None:
            expected.insert(0, "kind")
        for key in expected:
            if key not in raw:
                raise form_error(path, f"missing key {key!r}")
        for key in raw:
            if key not in expected:
                raise form_error(path, f"unexpected key {show(key)}")
        if cls.TAG is not None and (type(raw["kind"]) is not str or raw["kind"] != cls.TAG):
            got = show(raw["kind"])
            raise form_error(f"{path}.kind", f"wrong kind tag, expected {cls.TAG!r}, got {got}")
        arguments = {
            field.name: field.metadata["kind"].parse(f"{path}.{field.name}", raw[field.name])
            for field in fields
        }
        try:
            return cls(**arguments)
        except ContractError as error:
            raise PrimitiveFormError(f"{path}: {error}") from error
