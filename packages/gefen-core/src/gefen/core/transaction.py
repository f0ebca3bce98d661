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
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import torch

from gefen.core.checked import options_word
from gefen.core.handout import HandOutNotes, HandOutRecord
from gefen.dist import (
    PHASE_LOAD_VALIDATION,
    PHASE_STEP_PREFLIGHT,
    DistributedStepError,
    GroupAgreementError,
    GuardedOperation,
    differing_positions,
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
)

__all__ = [
    "FAILED_COMMIT_VALUES",
    "IN_PLACE_REFUSAL",
    "LATCHED",
    "REFUSED_VALUES",
    "STAGING_FAILED",
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


class HookedStepState(HandOutNotes):
    """Mixin for optimizers whose ``step`` fires the hooks itself (docs/core.md §2.4).

    Every ``step`` override is marked ``hooked`` so torch's ``_patch_step_function`` never wraps
    it again, and pickling copies an explicit whitelist (never an instance-level ``step``
    wrapper an LR scheduler installed, which would step the original from a copy).
    """

    _PICKLED_ATTRIBUTES: ClassVar[tuple[str, ...]] = HOOK_REGISTRIES
    OWNER_NAME: ClassVar[str]
    _commit_failed: bool | str = False  # the latch: True after a failed commit, or a reason

    @property
    def latched(self) -> bool:
        """Whether a commit failed part-way or a refused load wrote the state; a load clears it."""
        return bool(self._commit_failed)

    @property
    def live_values_refusal(self) -> str | None:
        """Why a load may not take the live state tensors' own values back, or None: a refused
        load written in place (``REFUSED_VALUES``) or a commit that failed part-way
        (``FAILED_COMMIT_VALUES``) left values in them that no checkpoint holds."""
        if self._commit_failed == IN_PLACE_REFUSAL:
            return REFUSED_VALUES
        return FAILED_COMMIT_VALUES if self._commit_failed is True else None

    def latch(self, reason: str) -> None:
        """Refuse every step, saying ``reason``, until a load succeeds (which clears it)."""
        self._commit_failed = reason

    def latch_unvoted_failure(self, operation: GuardedOperation, error: BaseException) -> None:
        """A step failed after its vote, in phase 4 (staging), before its commit wrote
        anything. In one process nothing changed. Across ranks the failure may be this rank's
        alone, unvoted, while the others commit the step: latch (``STAGING_FAILED``), so the
        next step fails on every rank (its vote) until each loads a checkpoint. A failure that
        phase 4 voted or agreed itself (an explicit scope's codebook learning) failed every
        rank before any wrote: retryable, no latch."""
        voted = isinstance(error, (DistributedStepError, GroupAgreementError))
        if operation.scope and not voted:
            self._commit_failed = STAGING_FAILED

    def latch_failed_commit(self, kept: HandOutRecord | None) -> None:
        """A commit failed part-way: refuse every step until a load succeeds, and note the
        handed-out live tensors at their versions now (``kept``: the note as the commit found
        it), so that their part-written values never read as a DCP template filled in place,
        while a template ``dcp.load`` fills again since does (``run_load``)."""
        self._commit_failed = True
        self.note_commit()
        self.renote(kept)

    def check_latch(self) -> None:
        """Raise while latched: a commit failed part-way, or ``latch`` said why."""
        latched = self._commit_failed
        if latched:
            reason = latched if isinstance(latched, str) else LATCHED
            raise RuntimeError(f"{self.OWNER_NAME}: {reason}")

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
    def gradient_labels(self) -> list[str]: ...
    def step_header_payload(self) -> Any: ...
    def exchange_step_headers(self, op: GuardedOperation, payload: Any) -> None: ...
    def check_step_agreement(self) -> None: ...
    def apply_prepared_step(self, *, operation: GuardedOperation | None = None) -> None: ...


class PreparedLoadLike(Protocol):
    @property
    def replica_words(self) -> tuple[int, int]: ...
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...
    def agree(self, operation: GuardedOperation) -> None: ...
    def commit(self) -> None: ...
    def run_post_hooks(self) -> None: ...


class LoadParticipant(Protocol):
    OWNER_NAME: ClassVar[str]

    @property
    def live_values_refusal(self) -> str | None: ...
    def guarded_operation(self) -> GuardedOperation: ...
    def check_not_stale(self, incoming: object) -> None: ...
    def written_in_place(self, incoming: object) -> bool: ...
    def shares_live_state(self, incoming: object) -> bool: ...
    def note_commit(self) -> Any: ...
    def current_note(self) -> Any: ...
    def renote(self, record: Any) -> None: ...
    def latch(self, reason: str) -> None: ...


IN_PLACE_REFUSAL = (
    "a refused load had already been written into this optimizer's live state (its tensors were "
    "those of this optimizer's own state_dict(), as in a DCP load template that dcp.load fills "
    "in place); load a valid checkpoint with load_state_dict to continue"
)

REFUSED_VALUES = (
    "this state dict shares the optimizer's live state tensors, which hold a refused load's "
    "values (the optimizer is latched), and it was not filled again since; fill it again "
    "(dcp.load), or load a copy or a file"
)

LATCHED = "previous step failed during commit; load a checkpoint with load_state_dict to continue"

STAGING_FAILED = (
    "a distributed step failed on this rank after its vote, while staging (phase 4), so the "
    "other ranks may have committed it; load a checkpoint on every rank to continue"
)

FAILED_COMMIT_VALUES = (
    "this state dict shares the optimizer's live state tensors, which a step that failed during "
    "its commit wrote in part (the optimizer is latched), and it was not filled again since; "
    "load a copy or a file, or fill it again (dcp.load)"
)


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


def _presence_named(
    optimizer: StepParticipant, op: GuardedOperation, refused: GroupAgreementError
) -> GroupAgreementError:
    """The vote's presence refusal with the parameters it concerns: every member got it, so
    every member joins the collective that finds them (and raises the same words)."""
    labels = optimizer.gradient_labels()
    positions = differing_positions(op.scope, optimizer.gradient_presence(), labels)
    if positions is None:
        which = "the members list different parameters"
    else:
        which = "parameters with a gradient on some members only: " + ", ".join(
            labels[index] for index in positions
        )
    return GroupAgreementError(
        f"{refused}; {which}", owner_name=refused.owner_name, what=refused.what
    )


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
    try:  # whatever fails, a hook or the preflight too, GradScaler's controls must not outlive
        return _transaction(optimizer, call_args, call_kwargs)  # (a retry would unscale twice)
    except BaseException:
        _drop_amp_controls(optimizer)
        raise


def _transaction(
    optimizer: StepParticipant, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]
) -> Any:
    """``run_step``'s phases: preflight and vote, headers and agreement, AMP, prepare and
    commit, post-hooks; returns the closure's loss."""
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
        try:
            loss, args, kwargs, payload = op.local_agreeing(
                PHASE_STEP_PREFLIGHT,
                STEP_AGREEMENT,
                lambda: _agreed_preflight(optimizer, args, kwargs),
            )
        except GroupAgreementError as refused:
            if refused.what != STEP_AGREEMENT[0]:
                raise
            raise _presence_named(optimizer, op, refused) from None
    else:
        loss, args, kwargs, payload = op.local(
            PHASE_STEP_PREFLIGHT, _local_preflight, optimizer, args, kwargs
        )
    optimizer.exchange_step_headers(op, payload)
    optimizer.check_step_agreement()
    grad_enabled = torch.is_grad_enabled()
    set_grad_enabled(False)  # torch.no_grad() without its Python context-manager frames
    try:
        proceed = prepare_synchronized_amp_step(optimizer, op.scope, optimizer.OWNER_NAME)
    finally:
        set_grad_enabled(grad_enabled)
    if proceed:
        optimizer.apply_prepared_step(operation=op)
    _run_post_hooks(optimizer, args, kwargs)
    return loss


@lazily_disable_dynamo  # as torch's own load_state_dict
def run_load(
    optimizer: LoadParticipant,
    prepare: Callable[[], PreparedLoadLike],
    incoming: object = None,
) -> None:
    """Prepare (voted as "load validation"), agree, commit, then the post-hooks (§8.2).

    A refused load changes nothing, unless ``incoming`` (the state dict) holds live state
    tensors written since ``state_dict()`` handed them out (``dcp.load`` fills its template in
    place): the optimizer holds the refused values already, so the refusal latches it
    (``IN_PLACE_REFUSAL``) rather than let it train on them, and renotes it (a stale dict
    loaded next is no template written in place). While so latched, a dict that shares the live
    tensors without being filled again holds the refused values: refused (``REFUSED_VALUES``),
    as is one after a commit that failed part-way (``FAILED_COMMIT_VALUES``). The optimizer's
    own writes since the hand-out (steps, loads, codebook publications) are renoted, so they
    count as none."""
    if torch.is_inference_mode_enabled():  # as run_step: loaded state is no inference tensor
        with torch.inference_mode(False):
            run_load(optimizer, prepare, incoming)
            return
    in_place = incoming is not None and optimizer.written_in_place(incoming)
    refused_values = None if in_place else optimizer.live_values_refusal
    op = optimizer.guarded_operation()

    def checked() -> PreparedLoadLike:
        _refuse_plain_dcp_round_trip(incoming, optimizer.OWNER_NAME)
        prepared = prepare()  # its own refusals first: these rules are the last
        if refused_values is not None and optimizer.shares_live_state(incoming):
            raise ValueError(f"{optimizer.OWNER_NAME} checkpoint: {refused_values}")
        if not in_place:  # a DCP template filled in place holds the file's counts, not stale
            optimizer.check_not_stale(incoming)
        return prepared

    try:
        if op.scope and op.binding is None:
            # One stale file on one rank must not load: replicated state is compared in the vote.
            prepared = op.local_agreeing(
                PHASE_LOAD_VALIDATION, LOAD_AGREEMENT, lambda: _with_load_words(checked())
            )
        else:
            prepared = op.local(PHASE_LOAD_VALIDATION, checked)
        prepared.agree(op)
    except BaseException:
        if in_place:
            optimizer.latch(IN_PLACE_REFUSAL)
            optimizer.renote(optimizer.current_note())  # a later load reads writes after it
        raise
    kept = optimizer.note_commit()
    prepared.commit()
    optimizer.renote(kept)
    prepared.run_post_hooks()


def _refuse_plain_dcp_round_trip(incoming: object, owner_name: str) -> None:
    """A plain ``state_dict()`` saved with ``dcp.save`` and loaded into another's template
    comes back with each entry twice: the template's tensors filled in place under the int id,
    and the file's Python ints (``step``, ``period``) under the id as a string, since DCP
    cannot write a non-tensor value in place. Where the two disagree neither is the
    checkpoint; name the route that is (docs/core.md §8.7)."""
    state = incoming.get("state") if isinstance(incoming, Mapping) else None
    if not isinstance(state, Mapping):
        return
    for key in state:
        if type(key) is int and _file_counts_differ(state[key], state.get(str(key))):
            raise ValueError(
                f"{owner_name} checkpoint: 'state' holds entry {key} twice, as {key} and as "
                f"'{key}': that is a plain state_dict() after torch.distributed.checkpoint "
                "(dcp.load fills the template's tensors in place but cannot write back the "
                "Python ints 'step' and 'period'); save and load through "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict and "
                "set_optimizer_state_dict, which carry them"
            )


def _file_counts_differ(entry: object, beside: object) -> bool:
    """Whether the values DCP wrote beside an entry (under its id as a string) differ from the
    entry's own: a template that already held the file's counts (the same optimizer's dict,
    refilled) loads as before, its string ids dropped as torch drops unknown keys."""
    if not isinstance(beside, Mapping):
        return False
    if not isinstance(entry, Mapping):
        return True
    for name, value in beside.items():
        held = entry.get(name)
        if not isinstance(value, torch.Tensor) and (
            isinstance(held, torch.Tensor) or name not in entry or held != value
        ):
            return True
    return False


LOAD_AGREEMENT = ("replicated state", "group options")
"""What the load vote agrees on, one subject per word: the replicated state's digest
(``gefen.core.replicas``), and the options the load would publish, which the next step's vote
would refuse if they differed (docs/dist.md §5)."""


def _with_load_words(prepared: PreparedLoadLike) -> tuple[PreparedLoadLike, tuple[int, int]]:
    return prepared, (prepared.replica_words[0], options_word(prepared.param_groups))


def copy_containers(value: Any) -> Any:
    """Copy every dict, list and tuple (never the tensors) so nothing of the caller's changes."""
    if isinstance(value, Mapping):
        return {key: copy_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_containers(item) for item in value]
    if isinstance(value, tuple):
        return tuple(copy_containers(item) for item in value)
    return value
