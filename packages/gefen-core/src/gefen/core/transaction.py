"""The step and load transactions, written once (docs/architecture.md; docs/core.md §7.1, §8.2).

``run_step`` is the step template of every Gefen optimizer and of composites built from them
(``GefenMuonHybrid``): one rank-local preflight (pre-hooks, closure, checks) voted once over the
failure scope, the scoped operation headers, the symmetric agreement checks, one AMP decision,
then the prepared phases 4–5 and the post-hooks. ``run_load`` is the load template: prepare
(voted), agree, commit, post-hooks.
A participant supplies the members named in ``StepParticipant`` / ``LoadParticipant``; the
templates never touch a private flag of anything else.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Protocol, TypeVar, cast

import torch

from gefen.core.checked import options_word
from gefen.core.validation import local_tensor
from gefen.dist import (
    PHASE_LOAD_VALIDATION,
    PHASE_STEP_PREFLIGHT,
    GuardedOperation,
    prepare_synchronized_amp_step,
    presence_words,
)
from gefen.dist.torch_internals import (
    HOOK_REGISTRIES,
    fresh_hook_registries,
    lazily_disable_dynamo,
    set_grad_enabled,
    step_post_hooks,
    step_pre_hooks,
    tensor_version,
)

_Dict = TypeVar("_Dict")

__all__ = [
    "IN_PLACE_REFUSAL",
    "STEP_SIGNATURE",
    "HookedStepState",
    "LoadParticipant",
    "PreparedLoadLike",
    "StepParticipant",
    "amp_controls_present",
    "copy_containers",
    "run_load",
    "run_step",
]


_HandOutRecord = tuple[int, dict[int, tuple["weakref.ref[torch.Tensor]", int]]]


class HookedStepState:
    """Mixin for optimizers whose ``step`` fires the hooks itself (docs/core.md §2.4).

    Every ``step`` override is marked ``hooked`` so torch's ``_patch_step_function`` never wraps
    it again, and pickling copies an explicit whitelist (never an instance-level ``step``
    wrapper an LR scheduler installed, which would step the original from a copy).
    """

    _PICKLED_ATTRIBUTES: ClassVar[tuple[str, ...]] = HOOK_REGISTRIES
    OWNER_NAME: ClassVar[str]
    _commit_failed: bool | str = False  # the latch: True after a failed commit, or a reason
    # hand_out's record: the commit count it is good for, and by storage address the live
    # tensor handed out with its in-place version then
    _handed_out: _HandOutRecord | None = None
    _commits = 0  # the optimizer's own writes of its live state (note_commit)

    def note_commit(self) -> _HandOutRecord | None:
        """The optimizer itself is about to write its live state (a load's commit, a codebook
        publication): the note ``hand_out`` made is taken off (a load may set the global step
        back, so its count could come round again) and returned where it covered the live state,
        for ``renote`` once the write is done."""
        covered = self.current_note()
        self._commits += 1
        self._handed_out = None
        return covered

    def current_note(self) -> _HandOutRecord | None:
        """``hand_out``'s note where it covers the live state as it is (no own write since)."""
        record = self._handed_out
        return record if record is not None and record[0] == self.commit_count else None

    def renote(self, record: _HandOutRecord | None) -> None:
        """After an own write of the live state that ``record`` covered (a step's commit, a
        load's, a codebook refresh remapping the codes): note the still-live tensors it holds
        as they are now, so that write is not read as a foreign one (``written_in_place``) and
        a template kept across it is still vouched for."""
        if record is None:
            return
        live_state = list(cast(Any, self).state.values())  # torch's, or the hybrid's view
        live = {tensor.untyped_storage().data_ptr() for tensor in _tensors(live_state)}
        noted = {}
        for address, (ref, _) in record[1].items():
            tensor = ref()
            if tensor is not None and address in live:
                noted[address] = (ref, tensor_version(tensor))
        self._handed_out = (self.commit_count, noted)

    @property
    def commit_count(self) -> int:
        """How many times the optimizer has written its live state itself: ``note_commit``'s
        count, plus what a subclass counts anyway (the shell its global step, so a step's
        commit costs nothing here)."""
        return self._commits

    @property
    def latched(self) -> bool:
        """Whether a commit failed part-way or a refused load wrote the state; a load clears it."""
        return bool(self._commit_failed)

    def hand_out(self, state_dict: _Dict) -> _Dict:
        """Note the in-place version of each live state tensor ``state_dict`` shares, as it was
        when first handed out (a DCP load asks again after it wrote the file into its template);
        the optimizer's own writes renote it, and ``written_in_place`` compares at a load."""
        record = self.current_note()
        if record is None:
            record = self._handed_out = (self.commit_count, {})
        shared = {tensor.untyped_storage().data_ptr() for tensor in _tensors(state_dict)}
        live_state = list(cast(Any, self).state.values())  # torch's, or the hybrid's view
        for tensor in _tensors(live_state):
            address = tensor.untyped_storage().data_ptr()
            if address in shared and address not in record[1]:
                record[1][address] = (weakref.ref(tensor), tensor_version(tensor))
        return state_dict

    def written_in_place(self, incoming: object) -> bool:
        """Whether a live state tensor that ``incoming`` shares was written after it was handed
        out by ``state_dict()`` (and not by the optimizer): then the load's input is in it."""
        record = self.current_note()
        if record is None:
            return False
        for tensor in _tensors(incoming):
            noted = record[1].get(tensor.untyped_storage().data_ptr())
            if noted is not None:
                live = noted[0]()
                if live is not None and tensor_version(live) != noted[1]:
                    return True
        return False

    def check_not_stale(self, incoming: object) -> None:
        """Raise ``ValueError`` when an entry of ``incoming`` holds a live state tensor but
        another ``step`` count than the live entry, or a learned codebook of ``incoming`` is not
        the live one (``saved_codebooks``; a refresh remaps codes in place): ``state_dict()``
        handed it out before a step or refresh, the tensor has moved on since and the rest has
        not, so loading it would mix the two (a rollback must copy). Read by content, whatever
        was handed out since;
        ``run_load`` skips it for a dict written in place since its hand-out (a DCP template
        filled with a file holds the file's counts beside the file's values)."""
        live_entries: dict[int, Mapping[str, Any]] = {}
        for entry in cast(Any, self).state.values():
            if isinstance(entry, Mapping):
                for tensor in _tensors(entry):
                    live_entries[tensor.untyped_storage().data_ptr()] = entry
        state = incoming.get("state") if isinstance(incoming, Mapping) else None
        aliased = False
        for entry in state.values() if isinstance(state, Mapping) and live_entries else ():
            for tensor in _tensors(entry):
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

    def latch(self, reason: str) -> None:
        """Refuse every step, saying ``reason``, until a load succeeds (which clears it)."""
        self._commit_failed = reason

    def latch_message(self, failed_commit: str) -> str:
        """Why every step is refused: the ``latch`` reason, else ``failed_commit``'s words."""
        latched = self._commit_failed
        return f"{self.OWNER_NAME}: {latched}" if isinstance(latched, str) else failed_commit

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("step")
        if step is not None:
            step.hooked = True

    def _restore_derived(self) -> None:
        """Rebuild what ``__getstate__`` leaves out (caches, registries) after unpickling."""

    def __getstate__(self) -> dict[str, Any]:
        return {
            name: self.__dict__[name] for name in self._PICKLED_ATTRIBUTES if name in self.__dict__
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        fresh_hook_registries(self, keep_existing=True)
        self._restore_derived()


class StepParticipant(Protocol):
    """What ``run_step`` needs of an optimizer (the public composite members of §1.1)."""

    OWNER_NAME: ClassVar[str]

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...
    def guarded_operation(self) -> GuardedOperation: ...
    def check_latch(self) -> None: ...
    def validate_step_inputs(self, *, amp_present: bool) -> None: ...
    def gradient_presence(self) -> list[bool]: ...
    def step_header_payload(self) -> Any: ...
    def exchange_step_headers(self, op: GuardedOperation, payload: Any) -> None: ...
    def check_step_agreement(self) -> None: ...
    def apply_prepared_step(self, *, operation: GuardedOperation | None = None) -> None: ...


class PreparedLoadLike(Protocol):
    @property
    def replica_words(self) -> tuple[int, int]: ...
    def agree(self, operation: GuardedOperation) -> None: ...
    def commit(self) -> None: ...
    def run_post_hooks(self) -> None: ...


class LoadParticipant(Protocol):
    def guarded_operation(self) -> GuardedOperation: ...
    def check_not_stale(self, incoming: object) -> None: ...
    def written_in_place(self, incoming: object) -> bool: ...
    def note_commit(self) -> Any: ...
    def renote(self, record: Any) -> None: ...
    def latch(self, reason: str) -> None: ...


IN_PLACE_REFUSAL = (
    "a refused load had already been written into this optimizer's live state (its tensors were "
    "those of this optimizer's own state_dict(), as in a DCP load template that dcp.load fills "
    "in place); load a valid checkpoint with load_state_dict to continue"
)

STALE_STATE_DICT = (
    "this state dict holds the optimizer's live state tensors, handed out by state_dict() before "
    "its last step (or codebook refresh): they have moved on since, its step counts (or codebook) "
    "have not, and loading it would mix the two (copy.deepcopy a state_dict() kept for a "
    "rollback, or save it to a file)"
)


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


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """Every local tensor with a storage in a nest of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        local = local_tensor(value)
        if _has_storage(local):
            yield local
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def amp_controls_present(optimizer: object) -> bool:
    """Whether GradScaler's attributes are on the object it decorated."""
    return hasattr(optimizer, "found_inf") or hasattr(optimizer, "grad_scale")


def _run_pre_hooks(
    optimizer: StepParticipant, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    for hook in step_pre_hooks(optimizer):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"{hook} must return None or a tuple of (new_args, new_kwargs), but got "
                    f"{result}."
                )
            args, kwargs = result
    return args, kwargs


def _local_preflight(
    optimizer: StepParticipant, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
    """Phase 1: latch, pre-hooks, the closure once, every rank-local check, the header payload."""
    optimizer.check_latch()
    args, kwargs = _run_pre_hooks(optimizer, args, kwargs)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    optimizer.validate_step_inputs(amp_present=amp_controls_present(optimizer))
    return loss, args, kwargs, optimizer.step_header_payload()


STEP_AGREEMENT = ("gradient presence", "group options")
"""What the step vote agrees on, one subject per word (docs/dist.md §5)."""


def _agreed_preflight(
    optimizer: StepParticipant, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, tuple[Any, ...], dict[str, Any], Any], tuple[int, int]]:
    """Phase 1 and the words the vote agrees on: the gradient-presence digest, then the
    options digest (the options as phase 1 leaves them: pre-hooks may set them)."""
    outcome = _local_preflight(optimizer, args, kwargs)
    presence, _count = presence_words(optimizer.gradient_presence())
    return outcome, (presence, options_word(optimizer.param_groups))


def _run_post_hooks(
    optimizer: StepParticipant, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    for hook in step_post_hooks(optimizer):
        hook(optimizer, args, kwargs)


def _drop_amp_controls(optimizer: object) -> None:
    # GradScaler never reaches its own deletion when step raises; a retry must not unscale
    # again by a stale scale.
    for name in ("found_inf", "grad_scale"):
        if name in optimizer.__dict__:
            delattr(optimizer, name)


STEP_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("closure", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
    ]
)
"""What ``step(*args, **kwargs)`` accepts: ``step(closure=None)``, as ``torch.optim``."""


@lazily_disable_dynamo
def run_step(
    optimizer: StepParticipant, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]
) -> Any:
    """One transactional step for ``optimizer.step(*call_args, **call_kwargs)``; returns the
    closure's loss or None. The hooks see the call as made (``args[0]`` is the optimizer), as
    torch's step wrapper would pass it.

    The step never runs inside a user's ``torch.compile``d graph: Dynamo would drop its writes
    to Python attributes (the global step, the codebook), so a compiled training loop would
    silently stop training. It runs eagerly there (one graph break) and runs its own compiled
    kernels."""
    if torch.is_inference_mode_enabled():
        # Run outside it: state the step allocates would be inference tensors, which no later
        # step outside the mode can update (its commit would fail, and latch), and the kernel
        # selection reads version counters, which inference tensors lack.
        with torch.inference_mode(False):
            return run_step(optimizer, call_args, call_kwargs)
    if len(call_args) > 1 or (call_kwargs and (call_args or set(call_kwargs) != {"closure"})):
        STEP_SIGNATURE.bind(optimizer, *call_args, **call_kwargs)  # TypeError as a plain call
    op = optimizer.guarded_operation()
    args: tuple[Any, ...] = (optimizer, *call_args)
    kwargs: dict[str, Any] = dict(call_kwargs)
    if op.scope and op.binding is None:
        # Ranks that disagree on which gradients exist would update different shards: the vote
        # checks the presence pattern in its own all-reduce (docs/dist.md §5). The binding form
        # keeps its one-word vote, so every operation of a codebook scope starts with the same
        # all-reduce and a mismatched operation fails cleanly at the operation header.
        loss, args, kwargs, payload = op.local_agreeing(
            PHASE_STEP_PREFLIGHT,
            STEP_AGREEMENT,
            lambda: _agreed_preflight(optimizer, args, kwargs),
        )
    else:
        loss, args, kwargs, payload = op.local(
            PHASE_STEP_PREFLIGHT, _local_preflight, optimizer, args, kwargs
        )
    optimizer.exchange_step_headers(op, payload)
    optimizer.check_step_agreement()
    try:
        grad_enabled = torch.is_grad_enabled()
        set_grad_enabled(False)  # torch.no_grad() without its Python context-manager frames
        try:
            proceed = prepare_synchronized_amp_step(optimizer, op.scope, optimizer.OWNER_NAME)
        finally:
            set_grad_enabled(grad_enabled)
        if proceed:
            optimizer.apply_prepared_step(operation=op)
    except BaseException:
        _drop_amp_controls(optimizer)
        raise
    _run_post_hooks(optimizer, args, kwargs)
    return loss


def run_load(
    optimizer: LoadParticipant,
    prepare: Callable[[], PreparedLoadLike],
    incoming: object = None,
) -> None:
    """Prepare (voted as "load validation"), agree, commit, then the post-hooks (§8.2).

    A refused load changes nothing, unless ``incoming`` (the state dict) holds live state
    tensors written since ``state_dict()`` handed them out (``dcp.load`` fills its template in
    place): the optimizer holds the refused values already, so the refusal latches it
    (``IN_PLACE_REFUSAL``) rather than let it train on them. The optimizer's own writes since
    the hand-out (steps, loads) are renoted, so they count as none of these."""
    if torch.is_inference_mode_enabled():  # as run_step: loaded state is no inference tensor
        with torch.inference_mode(False):
            return run_load(optimizer, prepare, incoming)
    in_place = incoming is not None and optimizer.written_in_place(incoming)
    op = optimizer.guarded_operation()

    def checked() -> PreparedLoadLike:
        prepared = prepare()  # its own refusals first: the staleness is the last rule
        if not in_place:  # a DCP template filled in place holds the file's counts, not stale
            optimizer.check_not_stale(incoming)
        return prepared

    try:
        if op.scope and op.binding is None:
            # One stale file on one rank must not load: replicated state is compared in the vote.
            prepared = op.local_agreeing(
                PHASE_LOAD_VALIDATION, "replicated state", lambda: _with_replica_words(checked())
            )
        else:
            prepared = op.local(PHASE_LOAD_VALIDATION, checked)
        prepared.agree(op)
    except BaseException:
        if in_place:
            optimizer.latch(IN_PLACE_REFUSAL)
        raise
    kept = optimizer.note_commit()
    prepared.commit()
    optimizer.renote(kept)
    prepared.run_post_hooks()


def _with_replica_words(prepared: PreparedLoadLike) -> tuple[PreparedLoadLike, tuple[int, int]]:
    return prepared, prepared.replica_words


def copy_containers(value: Any) -> Any:
    """Copy every dict, list and tuple (never the tensors) so nothing of the caller's changes."""
    if isinstance(value, Mapping):
        return {key: copy_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_containers(item) for item in value]
    if isinstance(value, tuple):
        return tuple(copy_containers(item) for item in value)
    return value
