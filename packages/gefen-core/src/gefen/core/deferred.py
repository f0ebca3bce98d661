"""Entries a collective completes after the load vote (docs/core.md §9.2).

A load checks each rank's dict alone and votes before any collective may run: a rank whose file
is malformed must not leave the others waiting in a gather. Where a saved entry holds only this
rank's rows of state that a rank keeps in full (GefenMuon's ``"distributed"`` and ``"exact"``
momentum, saved as row-sharded DTensors), the optimizer stages a ``PendingEntry`` instead: a
placeholder holding only the period, which every check before the vote reads as an entry not yet
updated, and which ``assemble()`` replaces after the vote. Every rank gathers the same tensors
and validates the same values there, so a rejection raises on every rank alike, before anything
is published.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from gefen.dist import PHASE_LOAD_VALIDATION, GuardedOperation

__all__ = ["PendingEntry", "assemble_pending"]


class PendingEntry(dict[str, Any]):
    """A staged entry whose content a post-vote collective provides; until then ``{"period"}``.

    Subclasses implement ``gather`` (collective over the parameter's mesh: every rank calls it
    for the same entries in the same order, and it raises only where the collective does) and
    ``finish`` (local: the validated entry to publish from what ``gather`` returned).
    """

    def __init__(self, period: int) -> None:
        super().__init__(period=period)

    def gather(self) -> Any:
        raise NotImplementedError

    def finish(self, gathered: Any) -> dict[str, Any]:
        raise NotImplementedError


def assemble_pending(state: MutableMapping[Any, Any], operation: GuardedOperation) -> None:
    """Replace every pending entry of a staged ``state`` by its assembly, in state order (the
    parameters' order, equal on every rank). Every rank runs every gather, even past a failed
    ``finish``, and the failures are voted as load validation, so all ranks raise together."""
    pending = [(key, entry) for key, entry in state.items() if isinstance(entry, PendingEntry)]
    if not pending:
        return

    def assemble() -> dict[Any, dict[str, Any]]:
        assembled: dict[Any, dict[str, Any]] = {}
        error: Exception | None = None
        for key, entry in pending:
            gathered = entry.gather()
            if error is None:
                try:
                    assembled[key] = entry.finish(gathered)
                except Exception as exc:  # voted below, after the remaining gathers
                    error = exc
        if error is not None:
            raise error
        return assembled

    state.update(operation.local(PHASE_LOAD_VALIDATION, assemble))
