"""GefenMuon's part of the checkpoint transaction (docs/muon.md §8).

Saving brings the entries of ``"distributed"`` parameters from their owners (a collective),
keeping this rank's rows of each matrix saved as rows (``gefen.muon.rows``), and records the
``"muon_distributed"`` manifest. Loading validates the manifest and every entry fail-closed
(rows gathered after the vote), then keeps on each rank only the entries it owns under the live
world size, so a save at one world size resumes at any other (through DCP, or as a full state
dict in one file) and in a single process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from gefen.core.extension import (
    TEMPLATE_FORMAT,
    is_dtensor,
    is_initialized,
    parameter_label,
    stage_entries,
)
from gefen.dist import BindingError, CheckpointProcessGroupBinding, broadcast_owner_state
from gefen.muon.kernels import stable_owner
from gefen.muon.modes import APPROX, DistributedSlot, distributed_slots
from gefen.muon.rows import PendingRows, assembles_rows, owned_rows, rows_layout_error

if TYPE_CHECKING:
    from gefen.core.extension import ShellInterface

__all__ = ["check_checkpoint_binding", "consolidated_entries", "manifest", "stage_muon_entries"]

MANIFEST_KEY = "muon_distributed"
OWNERSHIP = "stable_index_mod_world"


def _reject(rule: str) -> ValueError:
    return ValueError(f"GefenMuon checkpoint: {rule}")


def _names(groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each parameter's name (or ``param_groups[g][i]``), by flat index."""
    names: list[str] = []
    for group_index, group in enumerate(groups):
        for position in range(len(group["params"])):
            label = parameter_label(group, group_index, position)
            names.append(group["param_names"][position] if "param_names" in group else label)
    return names


# -- checkpoint bindings (§8 "Checkpoint binding") ------------------------------------------------


def check_checkpoint_binding(optimizer: ShellInterface, binding: object) -> None:
    """The binding must match the installed codebook binding, else the one eligible distributed
    process group (same handle object, its collective device, one member per rank)."""
    if binding is None:
        return
    if not isinstance(binding, CheckpointProcessGroupBinding):
        raise TypeError(
            "checkpoint_binding must be a CheckpointProcessGroupBinding, got "
            f"{type(binding).__name__}"
        )
    installed = optimizer.binding
    if installed is not None:
        if binding.process_group is not installed.process_group or (
            binding.identity != installed.identity
            or binding.collective_device != installed.collective_device
        ):
            raise BindingError("checkpoint_binding does not match the installed codebook binding")
        return
    slots = distributed_slots(optimizer.indexed_params())
    if len(slots) != 1:
        raise BindingError(
            "a checkpoint_binding needs exactly one eligible distributed process group, "
            f"found {len(slots)}"
        )
    channel = slots[0][0].channel
    if binding.process_group is not channel.process_group:
        raise BindingError("checkpoint_binding carries another process-group handle object")
    if binding.collective_device != channel.device:
        raise BindingError(
            f"checkpoint_binding collective device {binding.collective_device} differs from "
            f"the group's {channel.device}"
        )
    binding.validate_runtime()


# -- save ---------------------------------------------------------------------------------------


def consolidated_entries(optimizer: ShellInterface) -> dict[int, dict[str, Any]]:
    """Every entry by flat index; a distributed parameter's is its owner's, on every rank (only
    this rank's rows of it where it presents rows, cut as each arrives).

    Collective whenever eligible distributed groups exist: every rank must call it.
    """
    indexed = optimizer.indexed_params()
    entries = {index: dict(optimizer.state.get(param, {})) for index, _, param in indexed}
    for slots in distributed_slots(indexed):
        for slot in slots:
            own = dict(optimizer.state.get(slot.param, {})) if slot.is_owner() else None
            entry = broadcast_owner_state(
                own, owner=slot.owner, channel=slot.channel, owner_name=optimizer.OWNER_NAME
            )
            if optimizer.presents_rows(slot.group, slot.param):  # one matrix in full at a time
                entry = owned_rows(entry, slot.param)
            entries[slot.index] = entry
    return entries


def manifest(
    optimizer: ShellInterface, entries: Mapping[int, Mapping[str, Any]]
) -> dict[str, Any] | None:
    """The consolidation manifest, or None without eligible distributed groups."""
    slots_per_group = distributed_slots(optimizer.indexed_params())
    if not slots_per_group:
        return None
    names = _names(optimizer.param_groups)
    groups = [
        {
            "world_size": slots[0].world,
            "params": [_manifest_param(slot, names, entries[slot.index]) for slot in slots],
        }
        for slots in slots_per_group
    ]
    return {"version": 1, "ownership": OWNERSHIP, "consolidated": True, "groups": groups}


def _manifest_param(
    slot: DistributedSlot, names: list[str], entry: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "saved_id": slot.index,
        "name": names[slot.index],
        "shape": [int(size) for size in slot.param.shape],
        "owner": slot.owner,
        "state_keys": sorted(entry),
        "initialized": is_initialized(entry),
    }


# -- load ---------------------------------------------------------------------------------------


class _ManifestCheck:
    """Rules 2–5 of §8 against the live optimizer and the saved entries (by flat index)."""

    def __init__(
        self, optimizer: ShellInterface, saved: Mapping[int, Any], groups: list[dict[str, Any]]
    ) -> None:
        self.optimizer = optimizer
        self.saved = saved
        self.names = _names(groups)
        self.params = [param for group in groups for param in group["params"]]
        self.slots = distributed_slots(list(_indexed(groups)))

    def check(self, extras: Mapping[str, Any]) -> None:
        if MANIFEST_KEY not in extras:
            self.missing(extras)
            return
        built = extras[MANIFEST_KEY]
        if not isinstance(built, dict):
            raise _reject("the muon_distributed manifest must be a dict")
        self.header(built)
        saved_groups = built.get("groups")
        if not isinstance(saved_groups, list):
            raise _reject("manifest 'groups' must be a list")
        if not self.slots:
            self.rebind(saved_groups)
            return
        if len(saved_groups) != len(self.slots):
            raise _reject(
                f"manifest lists {len(saved_groups)} process groups, the live optimizer has "
                f"{len(self.slots)} eligible ones"
            )
        for saved_group, slots in zip(saved_groups, self.slots, strict=True):
            self.group(saved_group, [slot.index for slot in slots])

    def header(self, built: Mapping[str, Any]) -> None:
        if type(built.get("version")) is not int or built["version"] != 1:
            raise _reject("manifest version must be the int 1")
        if built.get("ownership") != OWNERSHIP:
            raise _reject(f"manifest ownership must be {OWNERSHIP!r}")
        if built.get("consolidated") is not True:
            raise _reject("manifest 'consolidated' must be True")

    def missing(self, extras: Mapping[str, Any]) -> None:
        if not self.slots:
            return
        pristine = (
            extras["global_step"] == 0
            and extras["codebook"] is None
            and all(set(entry) <= {"period"} for entry in self.saved.values())
        )
        if pristine or extras.get("format_version") == TEMPLATE_FORMAT:
            # Format 2 is written consolidated by every release that writes it (the manifest
            # came first); DCP keeps no top-level extras, so its files arrive without one.
            return
        eligible = [slot.index for slots in self.slots for slot in slots]
        if all(is_initialized(self.saved.get(i, {})) for i in eligible):
            return
        raise _reject("consolidation marker is missing (a distributed save must be consolidated)")

    def rebind(self, saved_groups: list[Any]) -> None:
        """No live eligible group: each saved id must name exactly one live parameter."""
        seen: set[int] = set()
        for saved_group in saved_groups:
            params = self.group_params(saved_group)
            for item in params:
                ident = item.get("saved_id") if isinstance(item, dict) else None
                if type(ident) is not int or not 0 <= ident < len(self.params) or ident in seen:
                    raise _reject(f"manifest saved_id {ident!r} does not name one live parameter")
                seen.add(ident)
            self.params_match(saved_group, [item["saved_id"] for item in params])

    def group_params(self, saved_group: object) -> list[Any]:
        if not isinstance(saved_group, dict):
            raise _reject("manifest group entries must be dicts")
        world = saved_group.get("world_size")
        if type(world) is not int or world < 1:
            raise _reject(f"manifest world_size must be an int >= 1, got {world!r}")
        params = saved_group.get("params")
        if not isinstance(params, list) or not all(isinstance(p, dict) for p in params):
            raise _reject("manifest group 'params' must be a list of dicts")
        return params

    def group(self, saved_group: object, expected: list[int]) -> None:
        params = self.group_params(saved_group)
        assert isinstance(saved_group, dict)
        ids = [item.get("saved_id") for item in params]
        if len(set(map(repr, ids))) != len(ids) or ids != expected:
            raise _reject(
                f"manifest ids {ids} differ from the ordered eligible parameters {expected}"
            )
        self.params_match(saved_group, expected)

    def params_match(self, saved_group: Mapping[str, Any], ids: list[int]) -> None:
        world = saved_group["world_size"]
        for position, (item, ident) in enumerate(zip(saved_group["params"], ids, strict=True)):
            param = self.params[ident]
            if item.get("name") != self.names[ident]:
                raise _reject(
                    f"manifest name {item.get('name')!r} differs from {self.names[ident]!r}"
                )
            if item.get("shape") != [int(size) for size in param.shape]:
                raise _reject(f"manifest shape of {self.names[ident]!r} differs")
            if item.get("owner") != stable_owner(position, world):
                raise _reject(f"manifest owner of {self.names[ident]!r} is not position mod world")
            entry = self.saved.get(ident, {})
            keys = item.get("state_keys")
            if (
                not isinstance(keys, list)
                or any(type(key) is not str for key in keys)
                or len(set(keys)) != len(keys)
                or keys != sorted(entry)
            ):
                raise _reject(f"manifest state_keys of {self.names[ident]!r} differ from its entry")
            initialized = item.get("initialized")
            if type(initialized) is not bool or initialized != is_initialized(entry):
                raise _reject(f"manifest 'initialized' of {self.names[ident]!r} is wrong")


def _indexed(groups: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], Tensor]]:
    flat = ((group, param) for group in groups for param in group["params"])
    return [(index, group, param) for index, (group, param) in enumerate(flat)]


def _structural_modes(optimizer: ShellInterface, groups: list[dict[str, Any]]) -> None:
    """``sharded_mode`` is never overwritten by a load; approx never exchanges with the rest."""
    for index, (staged, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        saved_mode, live_mode = staged["sharded_mode"], live["sharded_mode"]
        if (saved_mode == APPROX) != (live_mode == APPROX):
            raise _reject(
                f"group {index}: sharded_mode {saved_mode!r} cannot load into {live_mode!r} "
                "(approx state is rank-local; exact and distributed state is global)"
            )
        staged["sharded_mode"] = live_mode


def _normuon_pair(spec: Any, entry: dict[str, Any], where: str, param: Any) -> dict[str, Any]:
    """NorMuon's pair: both or neither, its age below 2**63 as every counter (one past int64
    could not travel in a row-sharded ``state_dict()``'s counter all-reduce). Its age is not
    tied to ``step``: NorMuon may be switched on mid-run, and a live edit of ``step`` (a warm
    restart) leaves it as it was, so such a checkpoint still loads."""
    if ("normuon_v" in entry) != ("normuon_step" in entry):
        raise ValueError(f"{where}: 'normuon_v' and 'normuon_step' must appear together")
    if "normuon_step" in entry and not 0 <= entry["normuon_step"] < 2**63:
        raise ValueError(
            f"{where}: 'normuon_step' must be an int with 0 <= normuon_step < 2**63, "
            f"got {entry['normuon_step']!r}"
        )
    return entry


def stage_muon_entries(
    optimizer: ShellInterface,
    saved_state: Mapping[int, Any],
    groups: list[dict[str, Any]],
    extras: Mapping[str, Any],
) -> dict[int, dict[str, Any]]:
    """Shadow entries by flat position, validated; non-owned distributed entries dropped; full
    state saved as DTensor rows staged as ``PendingRows`` (gefen.muon.rows)."""
    _structural_modes(optimizer, groups)
    _ManifestCheck(optimizer, saved_state, groups).check(extras)
    pending = _pending_rows(optimizer, saved_state, groups, extras)
    staged = stage_entries(optimizer, {**saved_state, **pending}, groups, _normuon_pair)
    staged.update(pending)
    for slots in distributed_slots(_indexed(groups)):
        for slot in slots:
            if not slot.is_owner() and slot.index not in pending:
                staged[slot.index] = {"period": staged[slot.index].get("period", 0)}
    return staged


def _pending_rows(
    optimizer: ShellInterface,
    saved_state: Mapping[int, Any],
    groups: list[dict[str, Any]],
    extras: Mapping[str, Any],
) -> dict[int, PendingRows]:
    """The saved entries of full state held as DTensor rows, their layout checked."""
    owners = {slot.index: slot for slots in distributed_slots(_indexed(groups)) for slot in slots}
    names = _names(groups)
    listed = Counter(id(param) for _, _, param in _indexed(groups))
    pending: dict[int, PendingRows] = {}
    for index, group, param in _indexed(groups):
        entry = saved_state.get(index)
        if not isinstance(entry, Mapping) or not assembles_rows(group, param):
            continue
        if not any(is_dtensor(value) for value in entry.values()):
            continue
        where = f"{optimizer.OWNER_NAME} checkpoint: entry {names[index]}"
        error = rows_layout_error(
            entry, param, where, optimizer.entry_spec(group, param).tensor_dtypes()
        )
        if error is not None:
            raise error
        pending[index] = PendingRows(
            optimizer,
            entry,
            place=(group, param, where),
            keep=index not in owners or owners[index].is_owner(),
            format2=extras.get("format_version") == TEMPLATE_FORMAT,
            step_limit=extras["global_step"] * listed[id(param)],
            finisher=_normuon_pair,
        )
    return pending
