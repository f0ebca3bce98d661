"""The hybrid's checkpoint in torch's flat layout, and its split into the children's own dicts
(docs/hybrid.md §8).

``join`` writes ``{"state", "param_groups", "gefen_hybrid"}``: one index space over both children
(the backup's ids follow the Muon child's, as torch numbers the hybrid's ``param_groups``), the
groups concatenated in order, each with its ``use_muon`` flag, and the children's top-level
extras under ``"gefen_hybrid"``; every group also carries a small copy of the hybrid's own words
(``GROUP_WORDS``: format version, backup backend, which children exist), since DCP's
``get_optimizer_state_dict`` keeps group keys but drops top-level ones, and each child's groups
already carry its own extras. The top-level extras, when present, are what ``split`` reads (the
copies are only checked to be well formed and equal); without them the copies stand in.
``split`` is its inverse over a live hybrid and checks only what the split itself needs (types of
the routing keys, ids that name a group's parameter; parameter names, as DCP passes them, become
those ids by position); each child then validates its own dict as it would a checkpoint of its
own. ``split`` also reads the nested layout of gefen-hybrid 0.1 (``{"muon", "backup",
"backup_optimizer"}``), with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gefen.core.extension import flattened_dcp_hint, torch_indices

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["EXTRAS_KEY", "FORMAT_VERSION", "GROUP_WORDS", "ROLES", "child_view", "join", "split"]

EXTRAS_KEY = "gefen_hybrid"
FORMAT_VERSION = 1
ROLES = (("muon", True), ("backup", False))  # (child, its groups' use_muon flag)
GROUP_WORDS = ("format_version", "backup_optimizer", "muon", "backup")  # the last two: bools
_PREFIX = "GefenMuonHybrid checkpoint: "
_NESTED = ("muon", "backup", "backup_optimizer")
_SCHEMA = (
    _PREFIX + "expects torch's {'state', 'param_groups'} layout with the 'gefen_hybrid' extras "
    "(or the nested {'muon', 'backup', 'backup_optimizer'} layout of gefen-hybrid 0.1)"
)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _extent(groups: Sequence[Mapping[str, Any]]) -> int:
    """How far a child's ids reach: torch's numbering advances by each group's length (a
    repeated parameter keeps one id, so ids may skip)."""
    return sum(len(group["params"]) for group in groups)


def child_view(flat: object, role: str) -> dict[str, Any]:
    """What ``flat`` holds of child ``role`` as its own dict would: its top-level extras and its
    groups (the ``use_muon`` flag picks them). Unchecked, for reads that must never raise."""
    flag = dict(ROLES)[role]
    flat = flat if isinstance(flat, Mapping) else {}
    extras, groups = flat.get(EXTRAS_KEY), flat.get("param_groups")
    part = extras.get(role) if isinstance(extras, Mapping) else None
    view = dict(part) if isinstance(part, Mapping) else {}
    groups = groups if isinstance(groups, list) else []
    view["param_groups"] = [
        g for g in groups if isinstance(g, Mapping) and g.get("use_muon") is flag
    ]
    return view


def join(nested: Mapping[str, Any]) -> dict[str, Any]:
    """The flat checkpoint of the children's dicts ``nested`` (``{"muon", "backup",
    "backup_optimizer"}``, an absent child None). A non-index state key (a user's) keeps its
    key; the children's parameter ids never collide, being shifted apart."""
    state: dict[Any, Any] = {}
    groups: list[dict[str, Any]] = []
    extras: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "backup_optimizer": nested["backup_optimizer"],
    }
    offset = 0
    for role, flag in ROLES:
        child = nested[role]
        if child is None:
            extras[role] = None
            continue
        extras[role] = {k: v for k, v in child.items() if k not in ("state", "param_groups")}
        for key, entry in child["state"].items():
            state[key + offset if _is_index(key) else key] = entry
        for group in child["param_groups"]:
            shifted = [index + offset for index in group["params"]]
            groups.append({**group, "params": shifted, "use_muon": flag})
        offset += _extent(child["param_groups"])
    for group in groups:
        group[EXTRAS_KEY] = _group_words(extras)
    return {"state": state, "param_groups": groups, EXTRAS_KEY: extras}


def _group_words(extras: Mapping[str, Any]) -> dict[str, Any]:
    """The group copy of ``extras``: the hybrid's own words, each child's presence as a bool."""
    words = {key: extras[key] for key in ("format_version", "backup_optimizer")}
    return {**words, **{role: extras[role] is not None for role, _ in ROLES}}


def _reject(rule: str) -> ValueError:
    return ValueError(_PREFIX + rule)


def _group_copies(flat: Mapping[str, Any]) -> list[Any]:
    """The groups' copies of the hybrid's words: none, or one per group, all equal."""
    groups = flat["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        return []  # _routed_groups rejects the groups by name
    copies = [_checked_copy(group[EXTRAS_KEY]) for group in groups if EXTRAS_KEY in group]
    if copies and len(copies) != len(groups):
        raise _reject(f"'{EXTRAS_KEY}' present in only some parameter groups")
    if any(copy != copies[0] for copy in copies[1:]):
        raise _reject(f"the groups' '{EXTRAS_KEY}' copies differ")
    return copies


def _checked_copy(words: Any) -> dict[str, Any]:
    """One group's copy, checked to hold only plain words (so comparing copies cannot throw)."""
    if not isinstance(words, dict) or set(words) != set(GROUP_WORDS):
        raise _reject(f"a group's '{EXTRAS_KEY}' copy must hold exactly {list(GROUP_WORDS)}")
    plain = (
        type(words["format_version"]) is int
        and (words["backup_optimizer"] is None or type(words["backup_optimizer"]) is str)
        and all(type(words[role]) is bool for role, _ in ROLES)
    )
    if not plain:
        raise _reject(
            f"a group's '{EXTRAS_KEY}' copy holds an int format_version, a str (or None) "
            "backup_optimizer and bools 'muon' and 'backup'"
        )
    return words


def _extras_from_groups(words: dict[str, Any]) -> dict[str, Any]:
    """The extras a checkpoint that kept only group keys (DCP's ``get_optimizer_state_dict``)
    implies: each present child's own extras are in its groups, so its entry is ``{}``."""
    extras = {key: words[key] for key in ("format_version", "backup_optimizer")}
    return {**extras, **{role: {} if words[role] else None for role, _ in ROLES}}


def _checked_extras(
    flat: Mapping[str, Any], copies: list[Any], live_groups: list[dict[str, Any]]
) -> dict[str, Any]:
    if EXTRAS_KEY not in flat and copies:
        return _checked_words(_extras_from_groups(copies[0]))
    if EXTRAS_KEY not in flat:
        hint = flattened_dcp_hint(flat.get("param_groups"), live_groups)
        raise _reject(
            f"torch's {{'state', 'param_groups'}} layout needs the '{EXTRAS_KEY}' extras (a "
            "checkpoint of another optimizer, or one consolidated without them, cannot be "
            f"loaded){hint}"
        )
    return _checked_words(flat[EXTRAS_KEY])


def _checked_words(extras: Any) -> dict[str, Any]:
    if not isinstance(extras, dict):
        raise _reject(f"'{EXTRAS_KEY}' must be a dict, got {type(extras).__name__}")
    expected = {"format_version", "backup_optimizer", "muon", "backup"}
    if set(extras) != expected:
        raise _reject(
            f"'{EXTRAS_KEY}' keys must be {sorted(expected)}, got {sorted(map(str, extras))}"
        )
    if type(extras["format_version"]) is not int or extras["format_version"] != FORMAT_VERSION:
        raise _reject(f"'{EXTRAS_KEY}' format_version must be {FORMAT_VERSION}")
    for role, _ in ROLES:
        child = extras[role]
        if child is not None and (
            not isinstance(child, dict) or {"state", "param_groups"} & set(child)
        ):
            raise _reject(f"'{EXTRAS_KEY}' {role!r} must be None or a dict of its extras")
    return extras


def _routed_groups(flat: Mapping[str, Any], offset: int) -> dict[str, list[dict[str, Any]]]:
    groups = flat["param_groups"]
    if not isinstance(groups, list):
        raise _reject(f"'param_groups' must be a list, got {type(groups).__name__}")
    routed: dict[str, list[dict[str, Any]]] = {"muon": [], "backup": []}
    for position, group in enumerate(groups):
        if not isinstance(group, dict):
            raise _reject(f"param_groups[{position}] must be a dict")
        flag, params = group.get("use_muon"), group.get("params")
        if type(flag) is not bool:
            raise _reject(f"param_groups[{position}]['use_muon'] must be a bool, got {flag!r}")
        if not isinstance(params, list) or not all(map(_is_index, params)):
            raise _reject(f"param_groups[{position}]['params'] must be a list of int ids")
        shift = 0 if flag else offset
        child_group = {k: v for k, v in group.items() if k not in ("use_muon", EXTRAS_KEY)}
        child_group["params"] = [index - shift for index in params]
        routed["muon" if flag else "backup"].append(child_group)
    return routed


def _routed_state(
    flat: Mapping[str, Any], present: Mapping[str, bool], offset: int
) -> dict[str, dict[Any, Any]]:
    """Each state key to its child: an id below ``offset`` is the Muon child's, the rest the
    backup's (shifted back), so a child sees even an id no group lists and rejects it by its
    own rule; a user's key goes to the first child (the one that keeps the hybrid's own)."""
    state = flat["state"]
    if not isinstance(state, dict):
        raise _reject(f"'state' must be a dict, got {type(state).__name__}")
    first = "muon" if present["muon"] else "backup"
    states: dict[str, dict[Any, Any]] = {"muon": {}, "backup": {}}
    for key, entry in state.items():
        if not _is_index(key):
            states[first][key] = entry
            continue
        role = "muon" if key < offset else "backup"
        if not present[role]:
            raise _reject(f"state key {key} names no parameter of any param group")
        states[role][key if role == "muon" else key - offset] = entry
    return states


def _live_ids(hybrid: HybridInterface) -> list[int]:
    """The ids ``join`` gives the live parameters, in group order (Muon child first)."""
    ids: list[int] = []
    offset = 0
    for child in (hybrid.muon, hybrid.backup):
        if child is not None:
            ids += [
                index + offset for group in torch_indices(child.param_groups) for index in group
            ]
            offset += _extent(child.param_groups)
    return ids


def _indexed(hybrid: HybridInterface, flat: Mapping[str, Any]) -> Mapping[str, Any]:
    """``flat`` with parameter names (DCP's ``set_optimizer_state_dict`` passes FQNs) turned into
    the ids ``join`` writes, by position as torch's ``load_state_dict`` matches them; a checkpoint
    with int ids is returned as it is."""
    groups = flat["param_groups"]
    if not isinstance(groups, list) or not all(
        isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups
    ):
        return flat  # _routed_groups names what is wrong
    saved = [ident for group in groups for ident in group["params"]]
    if all(map(_is_index, saved)):
        return flat
    if not all(isinstance(ident, str) for ident in saved):
        return flat  # mixed: _routed_groups rejects the group that is not all ids
    if len(set(saved)) != len(saved):
        raise _reject("param_groups name a parameter more than once")
    live = _live_ids(hybrid)
    if len(saved) != len(live):
        raise _reject(f"param_groups name {len(saved)} parameters, the live hybrid has {len(live)}")
    ids = dict(zip(saved, live, strict=True))
    renamed = [{**group, "params": [ids[name] for name in group["params"]]} for group in groups]
    state = flat["state"]
    if isinstance(state, dict):
        state = {ids.get(key, key) if isinstance(key, str) else key: v for key, v in state.items()}
    return {**flat, "state": state, "param_groups": renamed}


def _split_flat(hybrid: HybridInterface, flat: Mapping[str, Any]) -> dict[str, Any]:
    flat = _indexed(hybrid, flat)
    copies = _group_copies(flat)
    live = [group for child in hybrid.children for group in child.param_groups]
    extras = _checked_extras(flat, copies, live)
    muon = hybrid.muon
    # The backup's ids follow the live Muon child's (torch's numbering runs over its places),
    # when the checkpoint has a Muon half (without one, the halves check names what is missing).
    offset = 0
    if muon is not None and extras["muon"] is not None:
        offset = _extent(muon.param_groups)
    routed = _routed_groups(flat, offset)
    for role, _ in ROLES:
        if extras[role] is None and routed[role]:
            raise _reject(f"param groups route to {role!r} but its extras are None")
    states = _routed_state(flat, {role: extras[role] is not None for role, _ in ROLES}, offset)
    nested: dict[str, Any] = {"backup_optimizer": extras["backup_optimizer"]}
    for role, _ in ROLES:
        child = extras[role]
        nested[role] = None if child is None else {
            "state": states[role], "param_groups": routed[role], **child
        }  # fmt: skip
    return nested


def split(hybrid: HybridInterface, checkpoint: Any) -> dict[str, Any]:
    """The children's dicts ``{"muon", "backup", "backup_optimizer"}`` of a flat checkpoint (or
    of a nested one, returned as it is after one warning). Raises ``ValueError`` naming the
    rule; reads only."""
    if not isinstance(checkpoint, Mapping):
        raise ValueError(_SCHEMA)
    if "state" in checkpoint and "param_groups" in checkpoint:
        return _split_flat(hybrid, checkpoint)
    if "muon" in checkpoint or "backup" in checkpoint:
        warnings.warn(
            _PREFIX + "the nested {'muon', 'backup', 'backup_optimizer'} layout of "
            "gefen-hybrid 0.1 is migrated; state_dict() now writes torch's flat "
            "{'state', 'param_groups'} layout (save again to keep it)",
            FutureWarning,
            stacklevel=5,
        )
        return {key: checkpoint.get(key) for key in _NESTED}
    raise ValueError(_SCHEMA)
