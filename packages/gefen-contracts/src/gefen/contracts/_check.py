"""The one set of exact-type checkers every constructor calls (spec 40 §3).

Each checker takes the dotted location first so every message starts with it, then returns the
value (or its normalised copy). Exactness is deliberate: ``True`` is an ``int`` and a ``str``-mixin
enum member is a ``str`` to ``isinstance``, and either would otherwise slip a false claim into a
contract.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from gefen.contracts.errors import ContractTypeError, ContractValueError

_REPR_LIMIT = 80

E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T")


def show(value: object) -> str:
    """``repr`` of ``value`` cut to 80 characters, spelling enum members by ``.value``."""
    if isinstance(value, enum.Enum):
        # Spelled out by hand: enum reprs and strs have changed between Python versions.
        text = f"<{type(value).__name__}.{value.name}: {value.value!r}>"
    else:
        try:
            text = repr(value)
        except Exception:  # a broken __repr__ must not hide the real error
            text = f"<{type(value).__name__} object>"
    if len(text) > _REPR_LIMIT:
        text = text[: _REPR_LIMIT - 3] + "..."
    return text


def type_error(location: str, expected: str, value: object) -> ContractTypeError:
    return ContractTypeError(
        f"{location} must be {expected}, got {show(value)} ({type(value).__name__})"
    )


def value_error(location: str, rule: str, *value: object) -> ContractValueError:
    """``"<location>: <rule>, got <value>"``; the value part is left out when none is given."""
    suffix = f", got {show(value[0])}" if value else ""
    return ContractValueError(f"{location}: {rule}{suffix}")


def check_bool(location: str, value: object) -> bool:
    if type(value) is not bool:
        raise type_error(location, "a bool", value)
    return value


def check_int(location: str, value: object, minimum: int | None = None) -> int:
    if type(value) is not int:
        raise type_error(location, "an int", value)
    if minimum is not None and value < minimum:
        raise value_error(location, f"must be >= {minimum}", value)
    return value


def check_str(location: str, value: object) -> str:
    if type(value) is not str:
        raise type_error(location, "a str", value)
    return value


def check_text(location: str, value: object) -> str:
    """Free text (a description): a str ``canonical_bytes`` can write (UTF-8)."""
    text = check_str(location, value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise value_error(location, "text must be encodable as UTF-8", text) from None
    return text


def check_name(location: str, value: object) -> str:
    text = check_str(location, value)
    if not text:
        raise value_error(location, "a name must not be empty", text)
    if text != text.strip():
        raise value_error(location, "a name must not have leading or trailing whitespace", text)
    if "\0" in text:
        raise value_error(location, "a name must not contain NUL", text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise value_error(location, "a name must be encodable as UTF-8", text) from None
    return text


def check_fqn(location: str, value: object) -> str:
    text = check_name(location, value)
    if text.startswith(".") or text.endswith("."):
        raise value_error(location, "a fully-qualified name must not start or end with '.'", text)
    if ".." in text:
        raise value_error(location, "a fully-qualified name must not have an empty component", text)
    return text


def check_enum(location: str, value: object, enum_type: type[E]) -> E:
    if type(value) is not enum_type:
        raise type_error(location, f"a {enum_type.__name__} member", value)
    return value


def check_exact(location: str, value: object, value_type: type[T]) -> T:
    if type(value) is not value_type:
        name = value_type.__name__
        raise type_error(location, f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}", value)
    return value


def check_schema_version(location: str, value: object, supported: int) -> int:
    version = check_int(location, value)
    if version != supported:
        raise value_error(
            location, f"unsupported schema version {version} (supported: {supported})"
        )
    return version


def check_unique(location: str, values: tuple[object, ...], what: str = "element") -> None:
    """Reject the second occurrence of any element, located at its index."""
    seen: set[object] = set()
    for index, item in enumerate(values):
        if item in seen:
            raise value_error(f"{location}[{index}]", f"duplicate {what}", item)
        seen.add(item)
