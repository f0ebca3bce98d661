"""The hybrid's checkpoint in torch's flat layout, and its split into the children's own dicts
(docs/hybrid.md §8).

``join`` writes ``{"state", "param_groups", "gefen_hybrid"}``: one index space over both children
(the backup's ids follow the Muon child's, as torch numbers the hybrid's ``param_groups``), the
groups concatenated in order, each with its ``use_muon`` flag, and the children's top-level
extras under ``"gefen_hybrid"``. ``split`` is its inverse over a live hybrid and checks only what
the split itself needs (types of the routing keys, ids that name a group's parameter); each
child then validates its own dict as it would a checkpoint of its own. ``split`` also reads the
nested layout of gefen-hybrid 0.1 (``{"muon", "backup", "backup_optimizer"}``), with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["EXTRAS_KEY", "FORMAT_VERSION", "ROLES", "join", "split"]

EXTRAS_KEY = "gefen_hybrid"
FORMAT_VERSION = 1
ROLES = (("muon", True), ("backup", False))  # (child, its groups' use_muon flag)
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
    return {"state": state, "param_groups": groups, EXTRAS_KEY: extras}


def _reject(rule: str) -> ValueError:
    return ValueError(_PREFIX + rule)


def _checked_extras(flat: Mapping[str, Any]) -> dict[str, Any]:
    if EXTRAS_KEY not in flat:
        raise _reject(
            f"torch's {{'state', 'param_groups'}} layout needs the '{EXTRAS_KEY}' extras (a "
            "checkpoint of another optimizer, or one consolidated without them, cannot be loaded)"
        )
    extras = flat[EXTRAS_KEY]
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
        child_group = {k: v for k, v in group.items() if k != "use_muon"}
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


def _split_flat(hybrid: HybridInterface, flat: Mapping[str, Any]) -> dict[str, Any]:
    extras = _checked_extras(flat)
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
