"""The AdamW backup's entries as a template DCP can load into (docs/hybrid.md §8).

torch's AdamW creates a parameter's state at its first step, and DCP's
``get_optimizer_state_dict`` materializes it for a plain AdamW with a zero-gradient dummy step.
DCP skips that step for the hybrid (its Muon child's state is never empty), so the backup offers
the entries itself: a parameter with no state yet is saved as torch's own first-step entry, all
zeros with ``step`` 0, and loading drops such an entry again, so the parameter starts exactly as a
fresh AdamW's would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gefen.core.extension import torch_indices

__all__ = ["drop_unstarted_entries", "with_unstarted_entries"]


def _zero_entry(group: Mapping[str, Any], param: Tensor) -> dict[str, Any]:
    """torch's AdamW entry before its first update (``_init_group``'s dtypes and devices)."""
    on_device = bool(group.get("capturable")) or bool(group.get("fused"))
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    device = param.device if on_device else torch.device("cpu")
    entry: dict[str, Any] = {
        "step": torch.zeros((), dtype=dtype, device=device),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        entry["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return entry


def with_unstarted_entries(backup: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (the backup's ``state_dict()``) with an entry for every parameter."""
    for group, indices in zip(backup.param_groups, torch_indices(backup.param_groups), strict=True):
        for index, param in zip(indices, group["params"], strict=True):
            # an empty entry too: a read of a fresh ``state[p]`` (a defaultdict) stores {},
            # and DCP fills only the tensors a template offers
            if not saved["state"].get(index):
                saved["state"][index] = _zero_entry(group, param)
    return saved


def _unstarted(entry: object) -> bool:
    if not isinstance(entry, Mapping) or "step" not in entry:
        return False
    values = list(entry.values())
    if not all(isinstance(value, Tensor) and value.layout == torch.strided for value in values):
        return False
    return not any(value.is_meta or bool(value.any()) for value in values)


def drop_unstarted_entries(sd: dict[str, Any]) -> None:
    """Remove the all-zero, step-0 entries ``with_unstarted_entries`` adds (in place, on the
    load's own copy): torch's AdamW then creates them at the first step, as for a fresh one."""
    state = sd.get("state")
    if isinstance(state, dict):
        for key in [key for key, entry in state.items() if _unstarted(entry)]:
            del state[key]
