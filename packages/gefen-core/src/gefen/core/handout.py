"""The live state ``state_dict()`` hands out, and what a later load can tell about it
(docs/core.md §8.2 item 4).

``state_dict()`` returns the optimizer's live state tensors, not copies (as torch does, and as
DCP needs: ``get_optimizer_state_dict`` gives a template that ``dcp.load`` fills in place). A
load of such a dict can therefore meet two things a copy never shows:

- the dict was **written in place** since it was handed out (``dcp.load`` filled it): the
  optimizer holds the load's input already, so a refusal must latch it, and the staleness rule
  does not apply (the file's counts sit beside the file's values);
- the dict is **stale**: handed out before a step or a codebook refresh, its tensors moved on
  with the optimizer and its counts or codebook did not, so loading it would mix the two.

``HandOutNotes`` keeps the note that tells the first: the in-place version of each handed-out
live tensor. The optimizer's own writes (a step's commit, a load's, a codebook publication)
renote it at the new versions, so only a foreign write reads as one. A composite (the hybrid)
keeps the note for its children: ``hand_out_within`` points a child's notes at it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar, cast

import torch

from gefen.core.validation import local_tensor
from gefen.dist.torch_internals import tensor_version

__all__ = ["STALE_STATE_DICT", "HandOutNotes", "HandOutRecord", "live_tensors"]

_Dict = TypeVar("_Dict")

HandOutRecord = tuple[int, dict[int, tuple["weakref.ref[torch.Tensor]", int]]]
"""The commit count a note is good for, and by storage address each handed-out live tensor
with its in-place version as last noted."""

STALE_STATE_DICT = (
    "this state dict holds the optimizer's live state tensors, handed out by state_dict() before "
    "its last step (or codebook refresh): they have moved on since, its step counts (or codebook) "
    "have not, and loading it would mix the two (copy.deepcopy a state_dict() kept for a "
    "rollback, or save it to a file)"
)


class HandOutNotes:
    """Mixin: the note of what ``state_dict()`` handed out, and the staleness rule."""

    OWNER_NAME: ClassVar[str]
    hand_out_note: HandOutRecord | None = None  # the note (kept by the composite, if any)
    _commits = 0  # the optimizer's own writes of its live state (note_commit)
    _composite: weakref.ref[HandOutNotes] | None = None  # keeps this one's note (hand_out_within)
    writing_children = False  # a composite's own step is writing its children: it renotes after

    @property
    def commit_count(self) -> int:
        """How many times the optimizer has written its live state itself: ``note_commit``'s
        count, plus what a subclass counts anyway (the shell its global step, so a step's
        commit costs nothing here)."""
        return self._commits

    def hand_out_within(self, composite: HandOutNotes) -> None:
        """``composite`` (the hybrid) hands out this optimizer's live state as part of its own:
        it keeps the note, and this optimizer's own writes (a step of its own too) renote it
        there."""
        self._composite = weakref.ref(composite)
        self.hand_out_note = None

    def _note_keeper(self) -> HandOutNotes:
        composite = self._composite() if self._composite is not None else None
        return composite if composite is not None else self

    def current_note(self) -> HandOutRecord | None:
        """The note where it covers the live state as it is (no own write since unnoted); None
        for a child while its composite's step writes it (the composite renotes once, after)."""
        keeper = self._note_keeper()
        record = keeper.hand_out_note
        if keeper is not self and keeper.writing_children:
            return None
        return record if record is not None and record[0] == keeper.commit_count else None

    def note_commit(self) -> HandOutRecord | None:
        """The optimizer itself is about to write its live state (a load's commit, a codebook
        publication): the note is taken off (a load may set the global step back, so its count
        could come round again) and returned where it was current, for ``renote`` after."""
        covered = self.current_note()
        self._commits += 1
        self._note_keeper().hand_out_note = None
        return covered

    def renote(self, record: HandOutRecord | None) -> None:
        """After an own write that ``record`` (``current_note``'s or ``note_commit``'s) covered:
        note its tensors at their versions now, so that write reads as no foreign one. A note
        whose tensors are all gone is dropped. Cheap: one version read per noted tensor."""
        if record is None:
            return
        noted = {}
        for address, (ref, _) in record[1].items():
            tensor = ref()
            if tensor is not None:
                noted[address] = (ref, tensor_version(tensor))
        keeper = self._note_keeper()
        keeper.hand_out_note = (keeper.commit_count, noted) if noted else None

    def hand_out(self, state_dict: _Dict) -> _Dict:
        """Note the in-place version of each live state tensor ``state_dict`` shares, as it was
        when first handed out (a DCP load asks again after it wrote the file into its template);
        ``written_in_place`` compares them at a load."""
        keeper = self._note_keeper()
        record = self.current_note()
        if record is None:
            record = keeper.hand_out_note = (keeper.commit_count, {})
        shared = {tensor.untyped_storage().data_ptr() for tensor in live_tensors(state_dict)}
        for tensor in live_tensors(list(self._live_state())):
            address = tensor.untyped_storage().data_ptr()
            if address in shared and address not in record[1]:
                record[1][address] = (weakref.ref(tensor), tensor_version(tensor))
        return state_dict

    def shares_live_state(self, incoming: object) -> bool:
        """Whether ``incoming`` holds one of the optimizer's live state tensors itself."""
        live = self._live_addresses()
        return any(t.untyped_storage().data_ptr() in live for t in live_tensors(incoming))

    def written_in_place(self, incoming: object) -> bool:
        """Whether a live state tensor that ``incoming`` shares was written after it was handed
        out by ``state_dict()`` (and not by the optimizer): then the load's input is in it."""
        record = self.current_note()
        if record is None:
            return False
        live = self._live_addresses()
        for tensor in live_tensors(incoming):
            address = tensor.untyped_storage().data_ptr()
            noted = record[1].get(address) if address in live else None
            if noted is not None:
                held = noted[0]()
                if held is not None and tensor_version(held) != noted[1]:
                    return True
        return False

    def _live_state(self) -> Iterable[object]:
        state: Mapping[object, object] = cast(Any, self).state  # torch's, or the hybrid's view
        return state.values()

    def _live_addresses(self) -> set[int]:
        """The storage address of every live state tensor."""
        return {t.untyped_storage().data_ptr() for t in live_tensors(list(self._live_state()))}

    def check_not_stale(self, incoming: object) -> None:
        """Raise ``ValueError`` when an entry of ``incoming`` holds a live state tensor but
        another ``step`` count than the live entry, or a learned codebook of ``incoming`` is not
        the live one (``saved_codebooks``; a refresh remaps codes in place): ``state_dict()``
        handed it out before a step or refresh, the tensor has moved on since and the rest has
        not, so loading it would mix the two (a rollback must copy). Read by content, whatever
        was handed out since; ``run_load`` skips it for a dict written in place since its
        hand-out (a DCP template filled with a file holds the file's counts beside its values)."""
        live_entries: dict[int, Mapping[str, Any]] = {}
        for entry in self._live_state():
            if isinstance(entry, Mapping):
                for tensor in live_tensors(entry):
                    live_entries[tensor.untyped_storage().data_ptr()] = entry
        state = incoming.get("state") if isinstance(incoming, Mapping) else None
        aliased = False
        for entry in state.values() if isinstance(state, Mapping) and live_entries else ():
            for tensor in live_tensors(entry):
                live = live_entries.get(tensor.untyped_storage().data_ptr())
                aliased = aliased or live is not None
                if live is not None and not _same_count(entry.get("step"), live.get("step")):
                    raise ValueError(f"{self.OWNER_NAME} checkpoint: {STALE_STATE_DICT}")
        # A refresh remaps the live codes in place and moves no step count: the codebook tells.
        pairs = self.saved_codebooks(incoming) if aliased else ()
        if any(not _same_codebook(saved, live) for saved, live in pairs):
            raise ValueError(f"{self.OWNER_NAME} checkpoint: {STALE_STATE_DICT}")

    def saved_codebooks(self, incoming: object) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """Each learned codebook ``incoming`` holds, beside the live one it stands for (for
        ``check_not_stale``); none by default."""
        return ()


def _same_codebook(saved: torch.Tensor, live: torch.Tensor) -> bool:
    """Whether ``saved`` (a format-2 slot may be longer) begins with the values of ``live``."""
    values = local_tensor(saved).detach().flatten()
    if values.numel() < live.numel() or values.dtype != live.dtype:
        return False
    return torch.equal(values[: live.numel()].to(live.device), live.flatten())


def _same_count(saved: object, live: object) -> bool:
    """Whether an entry's ``step`` is the live one's: the same object (AdamW's aliased step
    tensor) or an equal int."""
    return saved is live or (type(saved) is int and type(live) is int and saved == live)


def _has_storage(tensor: torch.Tensor) -> bool:
    """Strided, with data (a sparse or meta tensor has no storage to compare)."""
    return tensor.layout == torch.strided and tensor.device.type != "meta" and tensor.numel() > 0


def live_tensors(value: object) -> Iterator[torch.Tensor]:
    """Every local tensor with a storage in a nest of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        local = local_tensor(value)
        if _has_storage(local):
            yield local
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from live_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from live_tensors(item)
