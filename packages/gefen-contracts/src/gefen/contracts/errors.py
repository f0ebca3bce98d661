"""The error types every rule of the contracts raises (spec 40 §2).

Each error is also a built-in exception (``TypeError``, ``ValueError``, ``AssertionError``) so
callers that predate these types keep catching what they caught before.
"""

from __future__ import annotations


class ContractError(Exception):
    """Base of every error raised by ``gefen.contracts``; never raised directly."""


class ContractTypeError(ContractError, TypeError):
    """A value has the wrong Python type (``True`` for an int, a raw string for an enum member)."""


class ContractValueError(ContractError, ValueError):
    """The type is right but a rule is broken (range, uniqueness, coverage, schema version)."""


class PrimitiveFormError(ContractValueError):
    """``from_primitive`` input is malformed; the message starts with the primitive path."""


class ConformanceError(ContractError, AssertionError):
    """A conformance helper found a mismatch between a contract and what it describes."""
