"""The canonical encoding and fingerprint of primitive forms (spec 40 §7.1).

These are the only encoding and hash that fingerprints anywhere in the project use, so two ranks
(or two Python versions) that hold equal values always exchange identical bytes. ``repr`` and
``pickle`` are never used: neither is stable across processes and versions.
"""

from __future__ import annotations

import hashlib
import json
import math

from gefen.contracts._check import show, type_error, value_error
from gefen.contracts.errors import ContractTypeError

_MAX_DEPTH = 64
_ROOT = "canonical_bytes.obj"
_ALLOWED = "a dict, list, str, int, bool, finite float or None"


def canonical_bytes(obj: object) -> bytes:
    """UTF-8 of sorted-key, compact JSON of ``obj``, after checking it is strictly primitive."""
    _check(_ROOT, obj, 1)
    try:
        text = json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as error:  # e.g. an int beyond the interpreter's digit limit
        raise value_error(_ROOT, f"cannot be encoded ({error})") from None
    return text.encode("utf-8")


def fingerprint(obj: object) -> bytes:
    """SHA-256 digest of ``canonical_bytes(obj)``."""
    return hashlib.sha256(canonical_bytes(obj)).digest()


def _check(location: str, value: object, depth: int) -> None:
    # Exact types only: a bool subclass, an enum member or a tuple would encode, but its JSON
    # would silently differ from what the receiving side parses back.
    if value is None or type(value) in (bool, int):
        return
    if type(value) is str:
        _check_text(location, value)
    elif type(value) is float:
        if not math.isfinite(value):
            raise value_error(location, "floats must be finite", value)
    elif type(value) is list or type(value) is dict:
        if depth > _MAX_DEPTH:
            raise value_error(location, f"containers must not nest deeper than {_MAX_DEPTH}")
        if type(value) is list:
            for index, item in enumerate(value):
                _check(f"{location}[{index}]", item, depth + 1)
        else:
            assert isinstance(value, dict)
            for key, item in value.items():
                _check_key(location, key)
                _check(f"{location}[{show(key)}]", item, depth + 1)
    else:
        raise type_error(location, _ALLOWED, value)


def _check_key(location: str, key: object) -> None:
    if type(key) is not str:
        raise ContractTypeError(
            f"{location}: dict keys must be str, got {show(key)} ({type(key).__name__})"
        )
    _check_text(location, key)


def _check_text(location: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise value_error(location, "strings must be encodable as UTF-8", text) from None
