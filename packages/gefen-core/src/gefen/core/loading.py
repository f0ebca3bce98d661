"""Gefen's part of load staging (10-core.md §8.3 entries, §8.4 family migration).

Each saved entry is checked by the one validator ``validate_entry``, copied to its parameter's
device in its saved dtype (torch's base loader would cast floating state to the parameter
dtype), and migrated when its group now selects the other second-moment family.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gefen.core.state import copy_entry, entry_family, migrate_family, validate_entry
from gefen.core.validation import local_tensor, parameter_label

if TYPE_CHECKING:
    from gefen.core.optimizer import Gefen

__all__ = ["stage_gefen_entries"]


def stage_gefen_entries(
    optimizer: Gefen, saved_state: Mapping[int, Any], groups: list[dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Shadow entries by flat position; a missing entry is the pristine placeholder."""
    owner = optimizer.OWNER_NAME
    codec_prefix = "q8" if optimizer.defaults["momentum_codec"] == "codebook8" else "fp32"
    staged: dict[int, dict[str, Any]] = {}
    position = 0
    for group_index, group in enumerate(groups):
        for slot, param in enumerate(group["params"]):
            label = parameter_label(group, group_index, slot)
            staged[position] = _stage_one(
                optimizer,
                group,
                param,
                saved_state.get(position),
                f"{owner} checkpoint: entry {label}",
                codec_prefix,
            )
            position += 1
    return staged


def _stage_one(
    optimizer: Gefen,
    group: Mapping[str, Any],
    param: Any,
    saved: Any,
    where: str,
    codec_prefix: str,
) -> dict[str, Any]:
    if saved is None:
        return {"period": 0}
    spec = optimizer._entry_spec(group, param)
    variant = validate_entry(saved, where=where, **spec.kwargs())
    if variant == "uninitialized":
        return {"period": saved["period"]}
    if not variant.startswith(codec_prefix + "_"):
        raise ValueError(f"{where}: the entry belongs to the other momentum codec ({variant})")
    device = local_tensor(param).device
    entry = copy_entry(saved, device)
    if entry_family(entry) != spec.second_moment:
        warnings.warn(
            f"{where}: migrated to the {spec.second_moment} second-moment family "
            "(factored_v_2d changed); v_step restarts at 0",
            UserWarning,
            stacklevel=6,
        )
        entry = migrate_family(entry, spec, device)
    return entry
