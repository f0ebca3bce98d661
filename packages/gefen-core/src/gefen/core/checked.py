"""What a step checks only when it changed (10-core.md §11, "checks at the edges").

The shell re-validates a group's options, or re-matches a state entry against its parameter,
only when the token or signature computed here differs from the one that last passed. Both
are cheap to compute and compare identities (and versions, for tensors), never tensor values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from gefen.core.validation import local_tensor
from gefen.dist.torch_internals import tensor_version

__all__ = ["entry_signature", "options_token"]


def options_token(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies a group's option values: type and value, or a tensor's identity and
    version (an LR scheduler's ``fill_`` bumps it)."""
    return tuple(
        (name, type(value), id(value), tensor_version(value))
        if isinstance(value, Tensor)
        else (name, type(value), value)
        for name, value in group.items()
        if name not in ("params", "param_names")
    )


class _Held:
    """Objects kept alive by a signature; always equal, so they never affect comparison."""

    __slots__ = ("objects",)

    def __init__(self, objects: tuple[Any, ...]) -> None:
        self.objects = objects

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held)

    __hash__ = None  # type: ignore[assignment]


def entry_signature(
    group: Mapping[str, Any], param: Tensor, entry: Mapping[str, Any]
) -> tuple[Any, ...]:
    """What an entry's structural match depends on: the objects involved (by identity) and the
    shapes. The objects themselves ride along (last item) so no id can be reused meanwhile;
    comparison uses the identities only."""
    local = local_tensor(param)
    values: list[tuple[Any, ...]] = []
    held: list[Any] = [param, group, entry, local]
    for key, value in entry.items():  # one pass: this runs for every parameter every step
        if isinstance(value, Tensor):
            held.append(value)
            values.append((key, id(value), value.shape, value.dtype))  # Size compares as tuple
        elif key != "step" and key != "v_step":
            values.append((key, value))
    identity = (id(param), id(group), id(entry), id(local), local.shape, param.dim())
    return (identity, tuple(values), _Held(tuple(held)))
