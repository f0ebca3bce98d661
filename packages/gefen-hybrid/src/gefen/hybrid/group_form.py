"""The param-group form of the hybrid: torch-style group dicts with a ``use_muon`` flag
(docs/hybrid.md §3).

``GefenMuonHybrid([{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False,
"lr": 3e-4}], lr=0.02)`` is the form users of ``MuonWithAuxAdam`` already write. A group with
the flag goes to that child whole; a group without it is split parameter by parameter by the
routing rules (a ``(name, parameter)`` pair, or a tensor named by torch's ``param_names``, by
``is_muon_param``; a bare tensor by being 2-D). Each part keeps the group's own options, under
the child's option names, and the names of its own parameters, and records its ``use_muon``
flag; ``add_param_group`` splits a group the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from gefen.core.extension import real_value
from gefen.hybrid.routing import check_matrix, is_muon_param
from gefen.muon import STANDARD_TRIPLE

__all__ = [
    "check_momentum",
    "check_scheduled_momentum",
    "follow_scheduled_momentum",
    "group_params",
    "is_group_form",
    "renumber_groups",
    "split_groups",
]

# Keys one child reads and the other would misread: a flagless group's parts keep only their own
# (a backup group's "momentum" is the beta1 a momentum-cycling scheduler writes, see below).
_MUON_ONLY, _BACKUP_ONLY = ("momentum",), ("betas",)


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
    if _is_pair(item):
        name, param = item
        return isinstance(param, Tensor) and is_muon_param(name, param, substrings)
    return isinstance(item, Tensor) and item.ndim == 2


def split_groups(
    groups: Sequence[dict[str, Any]],
    substrings: Sequence[str],
    *,
    first_index: int = 0,
    taken: Mapping[object, object] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each group's Muon part and backup part, in order, with the group's options and its
    ``use_muon`` flag; raises TypeError/ValueError naming the group before building anything
    (an empty group, a backup group's ``momentum`` no beta1 may take, a parameter name given
    twice or already ``taken`` by another of the hybrid's parameters, too)."""
    muon: list[dict[str, Any]] = []
    backup: list[dict[str, Any]] = []
    seen = dict(taken or {})  # name -> the tensor it names
    for offset, group in enumerate(groups):
        index = first_index + offset
        flag = group.get("use_muon")
        if flag is not None and type(flag) is not bool:
            raise TypeError(
                f"param group {index}: 'use_muon' must be a bool (or absent, to route each "
                f"parameter by the routing rules), got {type(flag).__name__}"
            )
        items = _items(index, group)
        if not items:  # torch keeps one, but its DCP load gives an empty group no options
            raise ValueError(
                f"param group {index} has no parameters: the hybrid keeps no empty group "
                "(torch.distributed.checkpoint would load it without its options); add the "
                "group once it has parameters"
            )
        if flag is False and "momentum" in group:  # the backup reads it as beta1
            check_momentum(group["momentum"], f"param group {index}")
        names = _names(index, group, len(items))
        if flag:  # the whole group goes to GefenMuon
            _check_matrices(index, items, names)
        pairs = (zip(names, items, strict=True) if names is not None
                 else ((item[0], item) for item in items if _is_pair(item)))  # fmt: skip
        for name, item in pairs:
            param = item[1] if _is_pair(item) else item
            if seen.setdefault(name, param) is not param:  # a name is a checkpoint key (DCP)
                raise ValueError(f"param group {index}: duplicate parameter name {name!r}")
        options = {k: v for k, v in group.items() if k != "params" and k != "param_names"}
        routed = [flag] * len(items)
        if flag is None:
            # torch's named form (``param_names`` beside the tensors) routes by name, as pairs do
            named = (
                items
                if names is None
                else [_named(n, p) for n, p in zip(names, items, strict=True)]
            )
            routed = [_to_muon(item, substrings) for item in named]
        for target, use_muon in ((muon, True), (backup, False)):
            part = [at for at, to_muon in enumerate(routed) if to_muon is use_muon]
            if not part:
                continue
            foreign = _BACKUP_ONLY if use_muon else _MUON_ONLY
            kept = {k: v for k, v in options.items() if flag is not None or k not in foreign}
            if use_muon and _own_coefficients(kept):  # they replace the default schedule
                kept.setdefault("ns_schedule", None)
            if names is not None:  # each part keeps the names of its own parameters
                kept["param_names"] = [names[at] for at in part]
            target.append({**kept, "params": [items[at] for at in part], "use_muon": use_muon})
    return muon, backup


def _own_coefficients(options: Mapping[str, Any]) -> bool:
    """Whether a Muon group gives coefficients of its own: GefenMuon reads the standard
    triple as none given (it runs beside any schedule)."""
    given = options.get("ns_coefficients", STANDARD_TRIPLE)
    return not (isinstance(given, (tuple, list)) and tuple(given) == STANDARD_TRIPLE)


def _check_matrices(index: int, items: Sequence[Any], names: Sequence[Any] | None) -> None:
    for at, item in enumerate(items):
        param = item[1] if _is_pair(item) else item
        if isinstance(param, Tensor):  # anything else is refused by the child, by name
            label = names[at] if names is not None else item[0] if _is_pair(item) else None
            shown = f"params[{at}]" if label is None else f"params[{at}] ({label!r})"
            check_matrix(
                param,
                f"param group {index}: use_muon=True, but its {shown}",
                "give it a group with use_muon=False",
            )


def _is_pair(item: Any) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)


def _named(name: object, item: Any) -> Any:
    return (name, item) if isinstance(name, str) else item


def _names(index: int, group: dict[str, Any], count: int) -> list[Any] | None:
    """The group's ``param_names`` (torch's named form), one per parameter, or None."""
    if "param_names" not in group:
        return None
    names = group["param_names"]
    if not isinstance(names, (list, tuple)) or len(names) != count:
        raise ValueError(
            f"param group {index}: 'param_names' must be a list with one name per parameter "
            f"({count}), got {names!r}"
        )
    return list(names)


def group_params(groups: Sequence[dict[str, Any]]) -> list[Tensor]:
    """Every tensor the groups list (a pair's parameter, or the tensor itself)."""
    tensors = []
    for group in groups:
        for item in group["params"]:
            tensors.append(item[1] if isinstance(item, (tuple, list)) else item)
    return tensors


_GROUP_LABEL = re.compile(r"param_groups\[(\d+)\]")
_ADAMW_LABEL = re.compile(r"AdamW backup group (\d+)")


def renumber_groups(error: BaseException, offset: int, *, placeholder: bool = False) -> None:
    """Rewrite a child's ``param_groups[g]`` labels in ``error``'s message as the hybrid's
    ``param_groups[g + offset]``, and say which of the hybrid's groups an AdamW backup's own
    ``AdamW backup group g`` is (type, cause and traceback stay as they are). A
    ``placeholder`` child (built over one empty group to check its options, the hybrid has no
    such group) names its options instead of a group the hybrid does not have."""
    if placeholder and error.args and isinstance(error.args[0], str):
        text = _ADAMW_LABEL.sub("AdamW backup options", error.args[0])
        error.args = (_GROUP_LABEL.sub("the backup options", text), *error.args[1:])
    elif offset and error.args and isinstance(error.args[0], str):
        text = _GROUP_LABEL.sub(
            lambda m: f"param_groups[{int(m.group(1)) + offset}]", error.args[0]
        )
        own = _ADAMW_LABEL.search(text)
        if own is not None:
            index = int(own.group(1))
            text += f" (AdamW backup group {index} is the hybrid's param_groups[{index + offset}])"
        error.args = (text, *error.args[1:])


def check_scheduled_momentum(
    groups: Iterable[Mapping[str, Any]], *, first_index: int, where: str = "param_groups"
) -> None:
    """Raise ``ValueError`` naming the first backup group (``where[first_index + i]``, the
    hybrid's numbering) whose ``momentum`` no beta1 may take (``follow_scheduled_momentum``
    reads it as beta1): at each step and a load (``split_groups`` checks a new group's)."""
    for index, group in enumerate(groups):
        if "momentum" in group and "betas" in group:
            check_momentum(group["momentum"], f"{where}[{first_index + index}]")


def check_momentum(momentum: object, label: str) -> None:
    """Raise ``ValueError`` under ``label`` when a backup group's ``momentum`` is no beta1."""
    number = real_value(momentum)
    if number is None or not 0.0 <= number < 1.0:
        raise ValueError(
            f"{label}: 'momentum' is read as beta1 (a momentum-cycling scheduler writes it) "
            f"and must be a real in [0, 1), got {momentum!r}"
        )


def follow_scheduled_momentum(
    groups: Iterable[dict[str, Any]], followed: Mapping[int, tuple[float, float]], first_index: int
) -> dict[int, tuple[float, float]]:
    """A backup group reads its beta1 from ``momentum`` when the group has one and a new value
    was written; returns each group's (momentum, beta1) after it, by group id, for ``followed``
    at the next step.

    torch's momentum-cycling schedulers (``OneCycleLR``, ``CyclicLR`` with
    ``cycle_momentum=True``) write one key into every group, chosen from ``defaults``; the
    hybrid's are the Muon child's, so that key is ``momentum``. torch's Muon and AdamW, each
    under its own scheduler, cycle Muon's momentum and AdamW's beta1 alike; here the backup
    groups follow a newly written ``momentum`` into ``betas`` before the step. A beta1 set by
    hand since the last step is kept, even when the scheduler also wrote (the common order:
    its last write, then the user's), as torch's AdamW keeps a hand-set beta1. A value no
    beta1 may take is refused before anything is written; ``first_index`` is the first
    group's index in the hybrid's ``param_groups``, for the message."""
    groups = list(groups)
    check_scheduled_momentum(groups, first_index=first_index)  # every group before any write
    record: dict[int, tuple[float, float]] = {}
    for group in groups:
        if "momentum" not in group or "betas" not in group:
            continue
        momentum = float(group["momentum"])
        beta1, beta2 = group["betas"]
        last = followed.get(id(group))
        newly_written = last is None or (momentum != last[0] and float(beta1) == last[1])
        if newly_written and float(beta1) != momentum:
            group["betas"] = (momentum, beta2)
        record[id(group)] = (momentum, float(group["betas"][0]))
    return record
