"""Saving the shell's state (docs/core.md §8.1): torch's layout plus the ``"gefen"`` extras.

``build_state_dict`` numbers the parameters as torch's ``state_dict`` does (``torch_indices``),
keeps ``optimizer.state`` entries under non-parameter keys, and mirrors one fresh copy of the
extras (``live_extras`` and the subclass's ``checkpoint_extras``) into the top level and every
group. Nothing returned is a live object.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from torch import Tensor

from gefen.core.options import codebook_size
from gefen.core.resharding import agree_counters, as_row_dtensors
from gefen.core.state import is_initialized
from gefen.core.template import (
    PRESENCE_KEY,
    TEMPLATE_FORMAT,
    initialized_flags,
    present_codebook,
    present_entry,
)
from gefen.dist import rank_local_header

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = [
    "BASE_EXTRAS",
    "EXTRAS_KEY",
    "FORMAT_VERSION",
    "OWNER_EXTRA",
    "build_state_dict",
    "live_extras",
    "saved_codebooks",
    "scope_extras",
    "torch_indices",
]

EXTRAS_KEY = "gefen"
FORMAT_VERSION = 1
OWNER_EXTRA = "optimizer"
"""The extras key naming the algorithm that wrote the checkpoint (``CHECKPOINT_OWNER``: Gefen's
or GefenMuon's, which a subclass inherits); a file of an earlier build lacks it."""
BASE_EXTRAS = (
    "format_version",
    "global_step",
    "codebook",
    "deterministic",
    "momentum_codec",
    "initialized_params",
)


def live_extras(optimizer: ShellInterface) -> dict[str, Any]:
    """A fresh extras dict (§8.1): never a live object (the codebook is cloned)."""
    codebook = optimizer.codebook
    initialized = [
        index
        for index, _, param in optimizer.indexed_params()
        if is_initialized(optimizer.state.get(param, {}))
    ]
    extras: dict[str, Any] = {
        OWNER_EXTRA: optimizer.CHECKPOINT_OWNER,
        "format_version": FORMAT_VERSION,
        "global_step": optimizer.global_step,
        "codebook": None if codebook is None else codebook.detach().clone(),
        "deterministic": optimizer.defaults["deterministic"],
        "momentum_codec": optimizer.defaults["momentum_codec"],
        "initialized_params": initialized,
    }
    if optimizer.TEMPLATE_COMPLETE:
        extras.update(
            format_version=TEMPLATE_FORMAT,
            **present_codebook(codebook, codebook_size(optimizer.param_groups)),
        )
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        extras["initialized_params"] = initialized_flags(initialized, count)
    scope = scope_extras(optimizer)
    if scope is not None:
        extras["scope"] = scope
    if optimizer.rank_local_checkpoint():
        extras["rank_local"] = rank_local_header(optimizer.step_failure_scope())
    return extras


def saved_codebooks(incoming: object, live: Tensor | None) -> list[tuple[Tensor, Tensor]]:
    """(each learned codebook ``incoming`` holds: its top-level extras' and its groups' copies,
    ``live``); none while no codebook is learned live."""
    if live is None:
        return []
    groups = incoming.get("param_groups") if isinstance(incoming, Mapping) else None
    holders = [incoming, *(groups if isinstance(groups, list) else ())]
    pairs = []
    for holder in holders:
        extras = holder.get(EXTRAS_KEY) if isinstance(holder, Mapping) else None
        if not isinstance(extras, Mapping):
            continue
        saved = extras.get("codebook")
        # format 2 presents a zero slot while none is learned: no codebook, not an older one
        if isinstance(saved, Tensor) and extras.get(PRESENCE_KEY, 1) != 0:
            pairs.append((saved, live))
    return pairs


def scope_extras(optimizer: ShellInterface) -> dict[str, Any] | None:
    """The codebook scope's identity and refresh policy (never a runtime handle), or None."""
    finalized = optimizer.finalized
    if finalized is None or finalized.binding is None:
        return None
    return {
        "identity": finalized.binding.identity.to_primitive(),
        "refresh_every": int(optimizer.defaults.get("codebook_refresh_every", 0)),
    }


def build_state_dict(
    optimizer: ShellInterface, entries: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """torch's layout with ``params`` as flat indices, plus the extras everywhere. Entries of
    ``optimizer.state`` under keys that are not parameters (a ``state_dict`` pre-hook's, say)
    are kept as they are, as torch keeps them; a parameter's index wins over an equal key."""
    indices = torch_indices(optimizer.param_groups)
    flat = [index for group in indices for index in group]
    state: dict[Any, Any] = {flat[position]: entry for position, entry in entries.items()}
    row_sharded = optimizer.row_sharded()
    agreed: dict[str, Any] = {}
    if optimizer.TEMPLATE_COMPLETE:  # format 2: every entry complete (gefen.core.template)
        indexed = optimizer.indexed_params()
        presented = {i: present_entry(optimizer, g, p, entries[i]) for i, g, p in indexed}
        if row_sharded:  # a rank without rows of a parameter learns its counters (§9.1)
            params = [param for _, _, param in indexed]
            agree_counters(presented, params, optimizer.step_failure_scope())
        # The extras DCP keeps once must be every rank's: initialized = stepped on the mesh,
        # read from the presented entries (a distributed GefenMuon's hold every matrix, though
        # each rank's live state holds only the matrices it owns).
        stepped = [i for i, entry in presented.items() if entry["step"] > 0]
        agreed["initialized_params"] = initialized_flags(stepped, len(presented))
        for position, group, param in indexed:
            entry = presented[position]
            rows = row_sharded or optimizer.presents_rows(group, param)
            state[flat[position]] = as_row_dtensors(entry, param) if rows else entry
    # torch types the state by Tensor keys; user code may add others (torch keeps them too).
    everything = cast(Mapping[object, Any], optimizer.state)
    for key, value in everything.items():
        if isinstance(key, Tensor):
            continue
        if key in state:
            warnings.warn(
                f"{optimizer.OWNER_NAME}.state_dict: the non-parameter state key {key!r} equals "
                "a parameter index and is left out",
                stacklevel=4,
            )
            continue
        state[key] = value
    groups = []
    for group, group_indices in zip(optimizer.param_groups, indices, strict=True):
        packed = {key: value for key, value in group.items() if key != "params"}
        packed["params"] = group_indices
        packed[EXTRAS_KEY] = {**_extras_copy(optimizer, entries), **copy.deepcopy(agreed)}
        # top level only: DCP neither saves nor asks for these (a template asking for the writer
        # refused every file of an earlier build)
        for key in (*optimizer.TOP_LEVEL_EXTRAS, OWNER_EXTRA):
            packed[EXTRAS_KEY].pop(key, None)
        if row_sharded:  # DCP keeps only these copies: a rank-independent file (§9.1)
            packed[EXTRAS_KEY].pop("rank_local", None)
        groups.append(packed)
    top = {**_extras_copy(optimizer, entries), **agreed}
    # the live tensors it shares: a load refused after they were written in place latches
    return optimizer.hand_out({"state": state, "param_groups": groups, EXTRAS_KEY: top})


def torch_indices(param_groups: list[dict[str, Any]]) -> list[list[int]]:
    """Each group's ``params`` ids as torch's ``state_dict`` numbers them: the flat position,
    except that a parameter listed more than once gets one index everywhere (torch's: its last
    place in the first group that lists it)."""
    mapping: dict[int, int] = {}
    start, packed = 0, []
    for group in param_groups:
        params = group["params"]
        fresh = {id(p): i for i, p in enumerate(params, start) if id(p) not in mapping}
        mapping.update(fresh)
        packed.append([mapping[id(p)] for p in params])
        start += len(params)
    return packed


def _extras_copy(optimizer: ShellInterface, entries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One independent copy of the extras, with the subclass's optional keys."""
    extras = live_extras(optimizer)
    extras.update(copy.deepcopy(optimizer.checkpoint_extras(entries)))
    return extras
