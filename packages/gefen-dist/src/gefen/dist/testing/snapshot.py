"""A deep, read-only optimizer snapshot for fail-before-mutation tests (docs/dist.md §11.2).

Identity is recorded by keeping strong references and compared with ``is``: ``id()`` values
are reused once an object is freed, so comparing them could mistake a replacement for the
original. Every DTensor is converted with ``to_local()`` before any tensor operation, so taking
a snapshot never communicates and may run on one rank alone.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Snapshot", "assert_unchanged", "deep_snapshot", "snapshot_diff"]

_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class _Untracked:
    """Marks a fact whose identity is meaningless (ints, strings, absent attributes)."""

    def __repr__(self) -> str:
        return "<untracked>"


_UNTRACKED = _Untracked()


class _Same:
    """Wraps an object so that tuple comparison uses ``is`` (tensor keys, foreign objects)."""

    __slots__ = ("target",)

    def __init__(self, target: object) -> None:
        self.target = target

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and self.target is other.target

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class _Fact:
    ref: object  # the object itself (strong reference) or _UNTRACKED
    value: object  # a comparable description: tuples of primitives and uint8 tensors


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Facts keyed by path (``"state[0][1]['momentum_scale']"``), in capture order."""

    facts: Mapping[str, _Fact]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self.facts)


# -- capture -------------------------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
        if hasattr(tensor, "wait"):
            tensor = tensor.wait()
    return tensor


def _tensor_bytes(local: torch.Tensor) -> torch.Tensor | None:
    data = local.detach()
    if data.device.type == "meta":
        return None
    if data.layout is not torch.strided:
        data = data.to_dense()
    flat = data.contiguous().cpu().reshape(-1)
    try:
        return flat.view(torch.uint8).clone()
    except RuntimeError:  # dtypes that refuse a byte view; their own bits still compare
        return flat.clone()


def _tensor_value(tensor: torch.Tensor) -> tuple[Any, ...]:
    is_dtensor = hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")
    local = _local(tensor)
    return (
        "tensor",
        "DTensor" if is_dtensor else type(tensor).__name__,
        tensor.dtype,
        tuple(tensor.shape),
        tuple(local.shape),
        local.device,
        # the layout too: set_() or as_strided_() can keep the bytes and change what aliases what
        (local.stride(), local.storage_offset()) if local.layout is torch.strided else None,
        _tensor_bytes(local),
    )


def _key_token(key: object) -> object:
    return key if isinstance(key, _PRIMITIVES) else _Same(key)


def _capture_value(path: str, value: object, facts: dict[str, _Fact], tracked: bool) -> None:
    """Record ``value`` at ``path`` and, for containers, every element below it."""
    if isinstance(value, torch.Tensor):
        facts[path] = _Fact(value if tracked else _UNTRACKED, _tensor_value(value))
    elif isinstance(value, (*_PRIMITIVES, enum.Enum)):
        facts[path] = _Fact(_UNTRACKED, ("value", type(value).__name__, value))
    elif isinstance(value, Mapping):
        keys = tuple(_key_token(key) for key in value)
        facts[path] = _Fact(value if tracked else _UNTRACKED, ("mapping", keys))
        for key, item in value.items():
            _capture_value(f"{path}[{key!r}]", item, facts, True)
    elif isinstance(value, (set, frozenset, bytes, bytearray)):  # by value, copied now
        copied = frozenset(value) if isinstance(value, (set, frozenset)) else bytes(value)
        facts[path] = _Fact(value if tracked else _UNTRACKED, (type(value).__name__, copied))
    elif isinstance(value, (list, tuple)):
        facts[path] = _Fact(value if tracked else _UNTRACKED, (type(value).__name__, len(value)))
        for index, item in enumerate(value):
            _capture_value(f"{path}[{index}]", item, facts, True)
    else:
        facts[path] = _Fact(value, ("object", type(value).__qualname__))


def _capture_parameters(
    optimizer: Any, prefix: str, facts: dict[str, _Fact]
) -> dict[torch.Tensor, str]:
    """Parameters, gradients and group keys; returns each parameter's ``[g][i]`` label."""
    labels: dict[torch.Tensor, str] = {}
    groups = optimizer.param_groups
    facts[f"{prefix}param_groups"] = _Fact(_UNTRACKED, ("groups", len(groups)))
    for g, group in enumerate(groups):
        facts[f"{prefix}param_groups[{g}]"] = _Fact(_UNTRACKED, ("group", tuple(group)))
        for key, value in group.items():
            if key != "params":
                _capture_value(f"{prefix}param_groups[{g}][{key!r}]", value, facts, False)
        params = group["params"]
        facts[f"{prefix}param_groups[{g}]['params']"] = _Fact(_UNTRACKED, ("params", len(params)))
        for i, param in enumerate(params):
            path = f"{prefix}param_groups[{g}]['params'][{i}]"
            facts[path] = _Fact(param, _tensor_value(param))
            grad = param.grad
            grad_value = ("absent",) if grad is None else _tensor_value(grad)
            facts[f"{path}.grad"] = _Fact(grad, grad_value)
            labels.setdefault(param, f"[{g}][{i}]")
    return labels


def _capture_state(
    optimizer: Any, prefix: str, labels: dict[torch.Tensor, str], facts: dict[str, _Fact]
) -> None:
    state = optimizer.state
    keys = tuple(_Same(key) for key in state)
    facts[f"{prefix}state"] = _Fact(state, ("state", keys))
    for position, (param, entry) in enumerate(state.items()):
        label = labels.get(param, f"[unlisted {position}]")
        path = f"{prefix}state{label}"
        if isinstance(entry, Mapping):
            facts[path] = _Fact(entry, ("entry", tuple(_key_token(key) for key in entry)))
            for key, value in entry.items():
                _capture_value(f"{path}[{key!r}]", value, facts, True)
        else:
            _capture_value(path, entry, facts, True)


def _capture_optimizer(
    optimizer: Any,
    prefix: str,
    attributes: tuple[str, ...],
    children: Mapping[str, tuple[str, ...]],
    facts: dict[str, _Fact],
) -> None:
    labels = _capture_parameters(optimizer, prefix, facts)
    _capture_state(optimizer, prefix, labels, facts)
    for name in attributes:
        path = f"{prefix}{name}"
        if hasattr(optimizer, name):
            _capture_value(path, getattr(optimizer, name), facts, True)
        else:
            facts[path] = _Fact(_UNTRACKED, ("absent",))
    for name, child_attributes in children.items():
        child = getattr(optimizer, name, None)
        if child is None:
            facts[f"{prefix}{name}"] = _Fact(_UNTRACKED, ("absent",))
            continue
        facts[f"{prefix}{name}"] = _Fact(child, ("child", type(child).__qualname__))
        _capture_optimizer(child, f"{prefix}{name}.", tuple(child_attributes), {}, facts)


def deep_snapshot(
    optimizer: Any,
    *,
    attributes: tuple[str, ...] = (),
    children: Mapping[str, tuple[str, ...]] | None = None,
) -> Snapshot:
    """Capture parameters, gradients, groups, state, named attributes and named children.

    ``children`` maps a child attribute name to that child's attribute tuple (``()`` =
    parameters, gradients and state only); an absent child (``None``) is recorded as absent.
    Never calls ``state_dict()``, hooks or any collective.
    """
    facts: dict[str, _Fact] = {}
    with torch.no_grad():
        _capture_optimizer(optimizer, "", tuple(attributes), dict(children or {}), facts)
    return Snapshot(facts)


# -- comparison ----------------------------------------------------------------------------------


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, complex) and isinstance(b, complex):
        return _same_value((a.real, a.imag), (b.real, b.imag))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def snapshot_diff(a: Snapshot, b: Snapshot) -> list[str]:
    """One line per difference between two snapshots, e.g. ``"codebook: identity differs"``."""
    differences: list[str] = []
    for path, before in a.facts.items():
        after = b.facts.get(path)
        if after is None:
            differences.append(f"{path}: removed")
            continue
        if before.ref is not after.ref:
            differences.append(f"{path}: identity differs")
        if not _same_value(before.value, after.value):
            differences.append(f"{path}: values differ")
    differences.extend(f"{path}: added" for path in b.facts if path not in a.facts)
    return differences


def assert_unchanged(a: Snapshot, b: Snapshot) -> None:
    """Raise ``AssertionError`` listing every difference between ``a`` and ``b``."""
    differences = snapshot_diff(a, b)
    if differences:
        raise AssertionError("optimizer changed:\n  " + "\n  ".join(differences))
