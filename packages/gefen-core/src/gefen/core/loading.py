"""Load staging of per-parameter entries (docs/core.md §8.3 entries, §8.4 family migration).

Each saved entry is checked by the one validator ``validate_entry``, copied to its parameter's
device in its saved dtype (torch's base loader would cast floating state to the parameter
dtype), and migrated when its group now selects the other second-moment family.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gefen.core.options import variant_prefix
from gefen.core.state import (
    EntrySpec,
    copy_entry,
    entry_family,
    migrate_family,
    validate_entry,
)
from gefen.core.validation import local_tensor, parameter_label

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = ["EntryFinisher", "stage_entries", "stage_entry", "stage_gefen_entries"]

EntryFinisher = Callable[[EntrySpec, dict[str, Any], str, Any], dict[str, Any]]
"""An optimizer's last step on a validated, copied entry (spec, entry, where, parameter)."""


def stage_entries(
    optimizer: ShellInterface,
    saved_state: Mapping[int, Any],
    groups: list[dict[str, Any]],
    finish: EntryFinisher | None = None,
) -> dict[int, dict[str, Any]]:
    """Shadow entries by flat position: each saved entry is checked by the one validator, the
    other codec is rejected, and the entry is copied (a missing one is the placeholder)."""
    staged: dict[int, dict[str, Any]] = {}
    for group_index, group in enumerate(groups):
        for slot, param in enumerate(group["params"]):
            index = len(staged)
            label = parameter_label(group, group_index, slot)
            where = f"{optimizer.OWNER_NAME} checkpoint: entry {label}"
            staged[index] = stage_entry(
                optimizer, group, param, saved_state.get(index), where, finish
            )
    return staged


def stage_entry(
    optimizer: ShellInterface,
    group: Mapping[str, Any],
    param: Any,
    saved: Any,
    where: str,
    finish: EntryFinisher | None = None,
) -> dict[str, Any]:
    """One saved entry (or None) checked, copied to its parameter's device, and finished."""
    prefix = variant_prefix(group)
    if saved is None:
        return {"period": 0}
    spec = optimizer.entry_spec(group, param)
    variant = validate_entry(saved, where=where, **spec.kwargs())
    if variant == "uninitialized":
        return {"period": saved["period"]}
    if variant.split("_")[0] != prefix:
        raise ValueError(f"{where}: the entry belongs to the other momentum codec ({variant})")
    entry = copy_entry(saved, local_tensor(param).device)
    if prefix != "fp32":
        # An entry saved before its optimizer recorded these: record them now (they matched).
        for key, value in spec.recorded_ints.items():
            entry.setdefault(key, value)
    return entry if finish is None else finish(spec, entry, where, param)


def _migrated(spec: EntrySpec, entry: dict[str, Any], where: str, param: Any) -> dict[str, Any]:
    """Gefen: an entry of the other second-moment family is migrated (§8.4)."""
    if entry_family(entry) == spec.second_moment:
        return entry
    warnings.warn(
        f"{where}: migrated to the {spec.second_moment} second-moment family "
        "(factored_v_2d changed); its second-moment statistics carry over",
        UserWarning,
        stacklevel=6,
    )
    return migrate_family(entry, spec, local_tensor(param).device)


def stage_gefen_entries(
    optimizer: ShellInterface, saved_state: Mapping[int, Any], groups: list[dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Gefen's shadow entries, with family migration."""
    return stage_entries(optimizer, saved_state, groups, _migrated)
