"""The error types of ``gefen.dist`` (docs/dist.md §2).

Wrong argument types raise the builtin ``TypeError`` and needing ``torch.distributed`` before it
is initialised raises the builtin ``RuntimeError``; only the three conditions below get their own
types, because callers and tests branch on them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BindingError", "DistributedStepError", "GroupAgreementError"]


def _rebuild_error(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    # Exceptions with keyword-only constructor arguments do not survive pickle's default
    # ``cls(*args)``; rebuild them without calling ``__init__`` so they can cross processes.
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class DistributedStepError(RuntimeError):
    """A local failure that was voted across a failure scope.

    Every member of the scope raises it: the failing rank with its own cause (also chained as
    ``__cause__``), the others naming "another process-group member".
    """

    def __init__(
        self,
        message: str,
        *,
        owner_name: str,
        phase: str,
        local_failure: bool,
        rank: int | None,
    ) -> None:
        super().__init__(message)
        self.owner_name = owner_name
        self.phase = phase
        self.local_failure = local_failure
        self.rank = rank

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


class GroupAgreementError(RuntimeError):
    """Gathered data differ across the members; raised with identical text on every member."""

    def __init__(self, message: str, *, owner_name: str, what: str) -> None:
        super().__init__(message)
        self.owner_name = owner_name
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


class BindingError(ValueError):
    """A binding is inconsistent with its identity, the runtime group or the backend."""
