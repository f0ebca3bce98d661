"""The param-group form of the hybrid: torch-style group dicts with a ``use_muon`` flag
(docs/hybrid.md §3).

``GefenMuonHybrid([{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False,
"lr": 3e-4}], lr=0.02)`` is the form users of ``MuonWithAuxAdam`` already write. A group with
the flag goes to that child whole; a group without it is split parameter by parameter by the
routing rules (a ``(name, parameter)`` pair by ``is_muon_param``, a bare tensor by being 2-D).
Each part keeps the group's own options, under the child's option names, and records its
``use_muon`` flag; ``add_param_group`` splits a group the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from gefen.hybrid.routing import is_muon_param

__all__ = ["group_params", "is_group_form", "split_groups"]


def is_group_form(first: object) -> bool:
    """True for a non-empty list or tuple of dicts (the param-group form)."""
    return (
        isinstance(first, (list, tuple))
        and len(first) > 0
        and all(isinstance(group, dict) for group in first)
    )


def _items(index: int, group: dict[str, Any]) -> list[Any]:
    if "params" not in group:
        raise ValueError(f"param group {index} has no 'params' key")
    params = group["params"]
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs. Please use a list instead."
        )
    return list(params)


def _to_muon(item: Any, substrings: Sequence[str]) -> bool:
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
        name, param = item
        return isinstance(param, Tensor) and is_muon_param(name, param, substrings)
    return isinstance(item, Tensor) and item.ndim == 2


def split_groups(
    groups: Sequence[dict[str, Any]], substrings: Sequence[str], *, first_index: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each group's Muon part and backup part, in order, with the group's options and its
    ``use_muon`` flag; raises TypeError/ValueError naming the group before building anything."""
    muon: list[dict[str, Any]] = []
    backup: list[dict[str, Any]] = []
    for offset, group in enumerate(groups):
        index = first_index + offset
        flag = group.get("use_muon")
        if flag is not None and type(flag) is not bool:
            raise TypeError(
                f"param group {index}: 'use_muon' must be a bool (or absent, to route each "
                f"parameter by the routing rules), got {type(flag).__name__}"
            )
        items = _items(index, group)
        options = {key: value for key, value in group.items() if key != "params"}
        if flag is None:
            routed = [_to_muon(item, substrings) for item in items]
            parts = (
                [item for item, to_muon in zip(items, routed, strict=True) if to_muon],
                [item for item, to_muon in zip(items, routed, strict=True) if not to_muon],
            )
        else:
            parts = (items, []) if flag else ([], items)
        for target, part, use_muon in ((muon, parts[0], True), (backup, parts[1], False)):
            if part:
                target.append({**options, "params": part, "use_muon": use_muon})
    return muon, backup


def group_params(groups: Sequence[dict[str, Any]]) -> list[Tensor]:
    """Every tensor the groups list (a pair's parameter, or the tensor itself)."""
    tensors = []
    for group in groups:
        for item in group["params"]:
            tensors.append(item[1] if isinstance(item, (tuple, list)) else item)
    return tensors
