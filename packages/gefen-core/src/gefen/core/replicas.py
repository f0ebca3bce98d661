"""What a load publishes that must be identical on every rank, as the load vote's two words.

GefenMuon's ``exact`` and ``distributed`` state (the full logical momentum of every sharded
matrix, the codebook learned from full gradients, the global step) is a replica: every rank of
the mesh loads the same consolidated file. A stale file on one rank would make the replicas
diverge silently, so the load vote compares a digest of that state in its own all-reduce
(``GuardedOperation.local_agreeing``) and one stale file fails every rank with nothing changed.
Rank-local state (Gefen's shards, ``approx``) is not a replica and is not digested, but under
row sharding the global step, the codebook and every entry's counters are (docs/core.md §9.1),
so a stale file loaded through torch's header-less get/set path fails there too; of a DTensor
(a replica saved as each rank's rows) the digest takes the global layout, not this rank's rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from gefen.core.resharding import COUNTERS, rows_on_every_rank
from gefen.core.validation import is_dtensor

__all__ = ["NO_REPLICA", "load_replica_words", "replica_words"]

NO_REPLICA = (0, 0)
"""The words of a load with no replicated state (every rank agrees on them)."""


def _feed(digest: Any, value: object) -> None:
    if is_dtensor(value):
        # Each rank holds other rows of it: its global layout is what ranks must agree on.
        held: Any = value
        layout = (held.dtype, tuple(held.shape), tuple(held.device_mesh.shape), held.placements)
        digest.update(f"dtensor:{layout}:".encode())
    elif isinstance(value, Tensor):
        local = value.detach().to("cpu").contiguous()
        digest.update(f"tensor:{local.dtype}:{tuple(local.shape)}:".encode())
        digest.update(local.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(value, key=str):
            digest.update(f"{key!s}=".encode())
            _feed(digest, value[key])
        digest.update(b"}")
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def replica_words(
    global_step: int, codebook: Tensor | None, entries: Sequence[Mapping[str, Any] | None]
) -> tuple[int, int]:
    """A 56-bit digest of the replicated state (global step, codebook, the entries in order)
    and the number of entries: equal words on every rank = the same replica."""
    digest = hashlib.blake2b(digest_size=7)
    _feed(digest, global_step)
    _feed(digest, codebook)
    for entry in entries:
        _feed(digest, entry)
    return int.from_bytes(digest.digest(), "big"), len(entries)


def load_replica_words(
    optimizer: Any,
    groups: Sequence[Mapping[str, Any]],
    global_step: int,
    codebook: Tensor | None,
    saved: Mapping[int, Any],
) -> tuple[int, int]:
    """The words of a staged load. Replicated entries are digested whole. A row-sharded
    optimizer has none (its state is each rank's rows); its digest takes instead the counters
    of each parameter every rank holds rows of, plain ints equal on every rank (docs/core.md
    §9.1), so no rank updates its rows with other bias corrections. (A rank without rows keeps
    no counters, so those parameters are left out.)"""
    positions = optimizer.replicated_positions(groups)
    if positions is None:
        return NO_REPLICA
    if not optimizer.row_sharded():
        return replica_words(global_step, codebook, [saved.get(i) for i in positions])
    params = [param for group in groups for param in group["params"]]
    counters = [
        _counters(saved.get(position)) if rows_on_every_rank(param) else None
        for position, param in enumerate(params)
    ]
    return replica_words(global_step, codebook, counters)


def _counters(entry: object) -> dict[str, object]:
    held = entry if isinstance(entry, Mapping) else {}
    return {key: held.get(key) for key in COUNTERS}
