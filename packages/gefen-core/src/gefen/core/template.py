"""Checkpoint format 2, the layout a fresh optimizer can be loaded into (docs/core.md §8.7).

DCP loads a file by filling the tensors of a template, ``get_optimizer_state_dict`` of the live
optimizer, and refuses any tensor whose saved shape differs from the template's. A freshly built
optimizer has no state yet, so format 2 writes every parameter's entry complete whatever its
progress: a pristine entry is all zeros with ``step`` 0, and the codebook is a fixed slot of 256
values (16 for codebook4) with a presence flag. The tensor shapes then depend only on the
parameter and its group:

- a parameter whose period its shape fixes (``template_period``) keeps its (B, P) grid;
- a parameter whose first gradient searches the period stores its codes (and dense momentum) as
  (N, 1) and each per-block tensor in an (N, 1) slot, the B blocks first and zeros after
  (codebook4's B·ceil(P/2) code bytes fill their slot the same way).

``present_*`` turn the live (format 1) forms into these; ``absorb_*`` turn a loaded format 2 dict
back into format 1 before the one entry validator runs, rejecting what does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from gefen.core.kernels.blocks import code_bytes
from gefen.core.options import group_uses_codebook
from gefen.core.resharding import COUNTERS
from gefen.core.state import CODEBOOK_SIZE, EntrySpec, allocate_entry, is_initialized
from gefen.core.validation import is_dtensor, local_tensor, parameter_label

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = [
    "PRESENCE_KEY",
    "TEMPLATE_FORMAT",
    "TemplateLayout",
    "absorb_codebook",
    "absorb_entry",
    "absorb_extras",
    "absorb_state",
    "flattened_dcp_hint",
    "initialized_flags",
    "present_codebook",
    "present_entry",
]

TEMPLATE_FORMAT = 2
PRESENCE_KEY = "codebook_present"


class TemplateLayout:
    """What format 2 asks of an optimizer; ``OptimizerShell`` mixes it in (defaults: format 1)."""

    TEMPLATE_COMPLETE: ClassVar[bool] = False
    """Whether ``state_dict()`` writes format 2."""

    def template_period(self, group: Mapping[str, Any], param: Tensor) -> int | None:
        """The period the shape fixes, or None where the first gradient searches it."""
        return None

    def template_keys(self, group: Mapping[str, Any], param: Tensor) -> tuple[str, ...]:
        """Optional keys (``EntrySpec.extra_pairs``) a not yet updated entry offers as zeros."""
        return ()

    def row_sharded(self) -> bool:
        """Whether the state is row-sharded and saved as DTensors (gefen.core.resharding)."""
        return False

    def presents_rows(self, group: Mapping[str, Any], param: Tensor) -> bool:
        """Whether ``state_dict()`` presents this parameter's full state as this rank's rows,
        DTensors like FSDP2's ``Shard(0)`` (GefenMuon's distributed matrices), though the
        optimizer is not row-sharded."""
        return False

    def assembles_rows(self, group: Mapping[str, Any], param: Tensor) -> bool:
        """Whether a loaded entry's DTensors are gathered to the full state after the load vote
        (gefen.core.deferred) rather than read as this rank's own rows."""
        return False


def present_codebook(codebook: Tensor | None, size: int = CODEBOOK_SIZE) -> dict[str, Any]:
    """The codebook's extras keys: a copy in a ``size``-value slot, and whether it is learned."""
    if codebook is None:
        return {"codebook": torch.zeros(size, dtype=torch.float32), PRESENCE_KEY: 0}
    return {"codebook": codebook.detach().clone(), PRESENCE_KEY: 1}


def initialized_flags(positions: list[int], count: int) -> list[int]:
    """Format 2's ``initialized_params``: one 0/1 flag per listed parameter, so a fresh
    optimizer's list is as long as a trained one's (torch's full-state-dict load matches lists
    item by item)."""
    marked = set(positions)
    return [int(position in marked) for position in range(count)]


def absorb_extras(
    extras: Mapping[str, Any], count: int, codebook_size: int = CODEBOOK_SIZE
) -> dict[str, Any]:
    """Format 2 extras as format 1 (``count`` parameters listed): the codebook slot (below) and
    the initialized flags as positions."""
    absorbed = absorb_codebook(extras, codebook_size)
    flags = extras.get("initialized_params")
    if (
        not isinstance(flags, list)
        or len(flags) != count
        or any(type(flag) is not int or flag not in (0, 1) for flag in flags)
    ):
        held = (
            f"; got {len(flags)}: a file of an optimizer over {len(flags)} parameters (say one "
            "the live optimizer skipped as frozen)"
            if isinstance(flags, list) and len(flags) != count
            else ""
        )
        raise ValueError(f"initialized_params must be {count} flags, each the int 0 or 1{held}")
    absorbed["initialized_params"] = [position for position, flag in enumerate(flags) if flag]
    return absorbed


def absorb_codebook(extras: Mapping[str, Any], size: int = CODEBOOK_SIZE) -> dict[str, Any]:
    """Format 2 extras as format 1: the slot becomes the codebook or None (an absent codebook's
    slot must be untouched zeros, so a damaged flag cannot hide a codebook)."""
    absorbed = {key: value for key, value in extras.items() if key != PRESENCE_KEY}
    present, slot = extras.get(PRESENCE_KEY), extras.get("codebook")
    if type(present) is not int or present not in (0, 1):
        raise ValueError(f"'{PRESENCE_KEY}' must be the int 0 or 1, got {present!r}")
    if present == 0:
        if not (
            isinstance(slot, Tensor)
            and slot.layout == torch.strided
            and not slot.is_meta
            and slot.numel() == size
            and not bool(slot.any())
        ):
            raise ValueError(f"'{PRESENCE_KEY}' is 0 but the codebook slot is not {size} zeros")
        absorbed["codebook"] = None
    return absorbed


def _grid_keys(spec: EntrySpec) -> tuple[str, ...]:
    """Tensors shaped like the (B, P) grid (Gefen's dense momentum is; GefenMuon's is not;
    codebook4 codes are not: they fill the first B·ceil(P/2) values of their slot)."""
    keys = () if spec.codes_per_byte == 2 else (spec.codec_keys.codes,)
    return keys + ((spec.codec_keys.dense,) if spec.dense_shape is None else ())


def _block_keys(spec: EntrySpec) -> tuple[str, ...]:
    """Tensors with one row per block."""
    return (spec.codec_keys.scale, "v_block")


def _packed_keys(spec: EntrySpec) -> tuple[str, ...]:
    """codebook4 codes: (B, ceil(P/2)) bytes, a searched period's slot holds them flat."""
    return (spec.codec_keys.codes,) if spec.codes_per_byte == 2 else ()


def present_entry(
    optimizer: ShellInterface, group: Mapping[str, Any], param: Tensor, entry: Mapping[str, Any]
) -> dict[str, Any]:
    """One live entry in format 2: complete, in shapes its parameter alone determines."""
    spec = optimizer.entry_spec(group, param)
    fixed = optimizer.template_period(group, param)
    if is_initialized(entry):
        full = dict(entry)
    else:
        period = int(entry.get("period", 0))
        grid = period or fixed or 1
        full = allocate_entry(
            spec, grid, codebook8=group_uses_codebook(group), device=local_tensor(param).device
        )
        full["period"] = period
        for key in optimizer.template_keys(group, param):  # zeros, dropped again at load
            shape, dtype = spec.extra_pairs[key]
            zeros = torch.zeros(shape, dtype=dtype, device=local_tensor(param).device)
            full[key] = zeros if dtype.is_floating_point else 0
    if fixed is not None:
        return full
    for key in _grid_keys(spec):
        if key in full:
            full[key] = full[key].reshape(spec.numel, 1)
    for key in _block_keys(spec) + _packed_keys(spec):
        if key in full:
            values = full[key].reshape(-1, 1)
            slot = values.new_zeros(spec.numel, 1)
            slot[: values.shape[0]] = values
            full[key] = slot
    return full


def _readable(value: Tensor, key: str, where: str) -> Tensor:
    """The local values, once it is known they can be read (a meta or sparse tensor cannot)."""
    local = local_tensor(value)
    if local.layout != torch.strided or local.is_meta:
        raise ValueError(f"{where}: '{key}' must be a dense strided tensor holding data")
    return local


def _is_zero(value: Any, key: str, where: str) -> bool:
    if isinstance(value, Tensor):
        return not bool(_readable(value, key, where).any())
    return type(value) is int and value == 0


def _reject_unless_zero(entry: Mapping[str, Any], spec: EntrySpec, where: str) -> None:
    for key, value in entry.items():
        # the period and the recorded ints (GefenMuon's matrix_cols) describe, they do not count
        if key not in ("period", "step", *spec.recorded_ints) and not _is_zero(value, key, where):
            raise ValueError(f"{where}: a step-0 entry must hold zeros, '{key}' does not")


def _slot(entry: Mapping[str, Any], key: str, numel: int, where: str) -> Tensor:
    value = entry[key]
    if not isinstance(value, Tensor) or tuple(value.shape) != (numel, 1):
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"{where}: '{key}' must be the ({numel}, 1) slot of a searched period, got {shape}"
        )
    _readable(value, key, where)
    return value


def _no_rows_here(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A rank holding no row of a row-sharded parameter keeps no state for it (docs/core.md
    §9.1): its rows of the saved DTensors must be empty, its counters still well formed."""
    for key, value in entry.items():
        if isinstance(value, Tensor) and value.numel() > 0:
            raise ValueError(f"{where}: '{key}' holds values on a rank without rows")
        if key in COUNTERS and (type(value) is not int or value < 0):
            raise ValueError(f"{where}: '{key}' must be an int >= 0, got {value!r}")
    return {"period": 0}


def absorb_entry(
    optimizer: ShellInterface,
    group: Mapping[str, Any],
    param: Tensor,
    entry: Any,
    where: str,
) -> Any:
    """A saved format 2 entry in format 1 (the validator then checks it): step 0 is the pristine
    entry with its period; a searched-period entry leaves its slots. Anything that is not a
    format 2 entry is returned unchanged for the validator to name."""
    if not isinstance(entry, Mapping) or "step" not in entry:
        return entry
    pristine = type(entry["step"]) is int and entry["step"] == 0
    as_rows = any(map(is_dtensor, entry.values()))
    if as_rows and not pristine and optimizer.assembles_rows(group, param):
        return entry  # rows of full state: the optimizer assembles them after the vote
    # A row-sharded save's DTensors, resharded by DCP to this rank's rows: their local part.
    entry = {k: local_tensor(v) if isinstance(v, Tensor) else v for k, v in entry.items()}
    if as_rows and local_tensor(param).numel() == 0:
        return _no_rows_here(entry, where)
    spec = optimizer.entry_spec(group, param)
    if type(entry["step"]) is int and entry["step"] == 0:
        _reject_unless_zero(entry, spec, where)
        return {"period": entry.get("period")}
    absorbed = dict(entry)
    period = entry.get("period")
    if optimizer.template_period(group, param) is not None or type(period) is not int:
        return absorbed
    if period <= 0 or spec.numel % period != 0:
        return absorbed  # the validator names the period
    if _in_its_grid(entry, spec):  # a fixed-period layout's entry (a row-sharded save's)
        return absorbed
    for key in _grid_keys(spec):
        if key in entry:
            absorbed[key] = _slot(entry, key, spec.numel, where).reshape(-1, period)
    blocks = spec.numel // period
    width = code_bytes(period, packed=True)
    shapes = dict.fromkeys(_block_keys(spec), (blocks, 1))
    shapes.update(dict.fromkeys(_packed_keys(spec), (blocks, width)))
    for key, shape in shapes.items():
        if key in entry:
            slot = _slot(entry, key, spec.numel, where)
            used = shape[0] * shape[1]
            if bool(_readable(slot, key, where)[used:].any()):
                raise ValueError(f"{where}: '{key}' holds values past its {blocks} blocks")
            absorbed[key] = slot[:used].reshape(shape)
    return absorbed


def _in_its_grid(entry: Mapping[str, Any], spec: EntrySpec) -> bool:
    """Whether the momentum is already in its (B, P) grid, as an optimizer whose layout fixes
    the period presents it (a row-sharded one: one block per row), not in the (N, 1) slot of a
    searched period: so torch's full state dict of an FSDP2 run loads into a plain optimizer,
    as it does for AdamW (the validator checks the grid; the period is the file's)."""
    for key in (*_grid_keys(spec), *_packed_keys(spec)):
        value = entry.get(key)
        if isinstance(value, Tensor) and tuple(value.shape) != (spec.numel, 1):
            return True
    return False


def absorb_state(
    optimizer: ShellInterface,
    state: Mapping[Any, Any],
    identifiers: list[list[Any]],
    groups: list[dict[str, Any]],
) -> dict[Any, Any]:
    """The saved entries of a format 2 checkpoint, by identifier, in format 1 (each listed one
    through ``absorb_entry``; the others, a user's keys, as they are)."""
    absorbed = dict(state)
    for group_index, (ids, group) in enumerate(zip(identifiers, groups, strict=True)):
        for slot, (ident, param) in enumerate(zip(ids, group["params"], strict=True)):
            if ident in state:
                label = parameter_label(group, group_index, slot)
                where = f"{optimizer.OWNER_NAME} checkpoint: entry {label}"
                absorbed[ident] = absorb_entry(optimizer, group, param, state[ident], where)
    return absorbed


def flattened_dcp_hint(saved_groups: Any, live_groups: list[dict[str, Any]]) -> str:
    """Why a state dict without extras may have reached a load, when its groups hold exactly
    the live groups' keys: ``set_optimizer_state_dict`` with
    ``StateDictOptions(flatten_optimizer_state_dict=True)`` rebuilds the groups and the entries
    from the keys the live optimizer holds, and a fresh one holds no extras and no momentum yet.
    Empty otherwise (another optimizer's checkpoint has its own keys)."""
    if not isinstance(saved_groups, list) or len(saved_groups) != len(live_groups):
        return ""
    for saved, live in zip(saved_groups, live_groups, strict=True):
        if not isinstance(saved, Mapping) or set(saved) - {"params"} != set(live) - {"params"}:
            return ""
    return (
        "; its groups hold exactly the live groups' keys, as a DCP state dict set with "
        "StateDictOptions(flatten_optimizer_state_dict=True) does: torch rebuilds it from the "
        "keys the live optimizer holds, which leaves out the extras and any state a fresh "
        "optimizer does not hold yet (use flatten_optimizer_state_dict=False)"
    )
