"""The failure vote and the names of the voted phases (docs/dist.md §5)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from gefen.dist.errors import DistributedStepError, GroupAgreementError
from gefen.dist.runtime import collective
from gefen.dist.scope import Channel

__all__ = [
    "AGREEMENT_WIDTH",
    "PHASE_AMP_CONTROL_PREFLIGHT",
    "PHASE_AMP_PREPARATION",
    "PHASE_CODEBOOK_SOLVE",
    "PHASE_INITIALIZE_PREAMBLE",
    "PHASE_LOAD_VALIDATION",
    "PHASE_LOCAL_HISTOGRAM_PREPARATION",
    "PHASE_MOMENTUM_REQUANTIZATION_STAGING",
    "PHASE_OWNER_STATE_HEADER",
    "PHASE_OWNER_STATE_METADATA",
    "PHASE_RECORD_PREPARATION",
    "PHASE_REFRESH_PREAMBLE",
    "PHASE_STATE_DICT_PREFLIGHT",
    "PHASE_STEP_PREFLIGHT",
    "any_true_over",
    "differing_positions",
    "presence_words",
    "synchronize_step_error",
    "vote_over",
    "vote_words",
]
_WORD_BOUND = 2**63  # a word and its negation both fit in int64

PHASE_STEP_PREFLIGHT = "step preflight"
PHASE_LOAD_VALIDATION = "load validation"
PHASE_INITIALIZE_PREAMBLE = "initialize preamble"
PHASE_REFRESH_PREAMBLE = "refresh preamble"
PHASE_AMP_CONTROL_PREFLIGHT = "AMP control preflight"
PHASE_AMP_PREPARATION = "AMP preparation"
PHASE_LOCAL_HISTOGRAM_PREPARATION = "local histogram preparation"
PHASE_CODEBOOK_SOLVE = "codebook solve"
PHASE_MOMENTUM_REQUANTIZATION_STAGING = "momentum requantization staging"
PHASE_OWNER_STATE_HEADER = "owner state header"
PHASE_OWNER_STATE_METADATA = "owner state metadata"
PHASE_RECORD_PREPARATION = "record preparation"
PHASE_STATE_DICT_PREFLIGHT = "state dict preflight"


AGREEMENT_WIDTH = 2
"""Words a voted phase may also agree on (``presence_words``): fixed, so every member's vote
has the same length whatever it found."""


@collective
def vote_words(
    scope: Sequence[Channel], flag: bool, words: Sequence[int] = ()
) -> tuple[bool, tuple[bool, ...]]:
    """(whether ``flag`` is true on any member, for each word whether every member passed it
    equal): one MAX all-reduce per channel of ``[flag, *words, *-words]``, folded channel by
    channel, so the agreement costs no extra round trip. Every rank enters every channel (no
    short-circuit), so the folded values reach every rank the scope links. Words must fit in
    int64 and have the same length on every member. An empty scope agrees on every word."""
    import torch.distributed as dist

    values = [1 if flag else 0, *words, *(-word for word in words)]
    for channel in scope:
        folded = torch.tensor(values, dtype=torch.int64, device=channel.device)
        dist.all_reduce(folded, op=dist.ReduceOp.MAX, group=channel.process_group)
        values = folded.tolist()
    width = len(words)
    same = tuple(values[1 + i] == -values[1 + width + i] for i in range(width))  # max == min
    return bool(values[0]), same


def vote_over(scope: Sequence[Channel], flag: bool, words: Sequence[int] = ()) -> tuple[bool, bool]:
    """(whether ``flag`` is true on any member, whether every member passed equal ``words``):
    ``vote_words`` with the agreement folded to one answer."""
    flagged, same = vote_words(scope, flag, words)
    return flagged, all(same)


def any_true_over(scope: Sequence[Channel], flag: bool) -> bool:
    """True on every member when ``flag`` is true on any (``vote_over`` without words)."""
    return vote_over(scope, flag)[0]


def presence_words(present: Iterable[bool | None]) -> tuple[int, int]:
    """The ``AGREEMENT_WIDTH`` words of a gradient-presence pattern: a 56-bit digest of the
    flags in order, and how many are set (equal words on every member = equal patterns, up to
    a digest collision). ``None`` marks a position that is not compared (it digests as its own
    value, the same on every member)."""
    flags = bytes(2 if flag is None else 1 if flag else 0 for flag in present)
    digest = int.from_bytes(hashlib.blake2b(flags, digest_size=7).digest(), "big")
    return digest, flags.count(1)


@collective
def differing_positions(
    scope: Sequence[Channel], present: Sequence[bool | None], labels: Sequence[str] = ()
) -> list[int] | None:
    """The positions at which the members' presence patterns differ, the same list on every
    member: what a vote that found ``presence_words`` unequal reports by name. None where the
    members' patterns differ in length or their ``labels`` (one per position) differ, since no
    position would then name one parameter on every member. Two MAX all-reduces per channel
    (the lengths and a digest of the labels, then each flag and its negation); call it on every
    member, as the vote itself."""
    import torch.distributed as dist

    def folded(values: list[int]) -> list[int]:
        for channel in scope:
            reduced = torch.tensor(values, dtype=torch.int64, device=channel.device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=channel.process_group)
            values = reduced.tolist()
        return values

    named = "\0".join(labels).encode()
    digest = int.from_bytes(hashlib.blake2b(named, digest_size=7).digest(), "big")
    width, shorter, most, least = folded([len(present), -len(present), digest, -digest])
    if width != -shorter or most != -least:
        return None
    flags = [2 if flag is None else int(flag) for flag in present]
    both = folded([*flags, *(-flag for flag in flags)])
    return [index for index in range(width) if both[index] != -both[width + index]]


def _agreement(
    agreement: tuple[str | tuple[str, ...], Sequence[int]] | None,
) -> tuple[tuple[str, ...], tuple[int, ...], Exception | None]:
    """(the subject of each word, the words to vote, a ValueError when the caller's agreement
    breaks the rules). The vote always carries ``AGREEMENT_WIDTH`` words (zeros without an
    agreement or after a misuse), so members that disagree on having one still vote the same
    length. ``what`` is one subject for every word, or a tuple of one subject per word."""
    if agreement is None:
        return ("",) * AGREEMENT_WIDTH, (0,) * AGREEMENT_WIDTH, None
    what, words = agreement[0], tuple(agreement[1])
    subjects = what if isinstance(what, tuple) else (what,) * AGREEMENT_WIDTH
    problem: ValueError | None = None
    if len(subjects) != AGREEMENT_WIDTH or not all(isinstance(s, str) and s for s in subjects):
        problem = ValueError(
            f"agreement subjects {what!r} must be one non-empty str, or a tuple of "
            f"{AGREEMENT_WIDTH} non-empty strs (one per word)"
        )
    elif len(words) != AGREEMENT_WIDTH or any(
        type(word) is not int or not -_WORD_BOUND < word < _WORD_BOUND for word in words
    ):
        problem = ValueError(
            f"agreement {what!r} needs {AGREEMENT_WIDTH} int words, each strictly between "
            f"-2**63 and 2**63, got {words!r}"
        )
    if problem is not None:  # this member's vote fails, so no subject is ever reported
        return ("",) * AGREEMENT_WIDTH, (0,) * AGREEMENT_WIDTH, problem
    return subjects, words, None


def _operation_word(owner: str, phase: str, subjects: Sequence[str]) -> int:
    """A 56-bit digest of the vote's owner, phase and subjects (what its words agree on):
    members in different operations vote different words even where neither agrees on anything
    (a ``state_dict()`` preflight against a step's in the binding form, an initialize preamble
    against a refresh's, one hybrid's Muon child against another's backup), so neither returns
    while the other waits in a collective."""
    text = "|".join((owner, phase, *subjects))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def synchronize_step_error(
    error: Exception | None,
    phase: str,
    scope: Sequence[Channel],
    owner_name: str,
    *,
    agreement: tuple[str | tuple[str, ...], Sequence[int]] | None = None,
) -> None:
    """Make every member of ``scope`` fail together when any of them captured ``error``.

    Empty scope: the captured exception is re-raised unchanged (same object), so single-process
    callers see exactly what they would without this library. Callers capture with
    ``except Exception`` only: ``KeyboardInterrupt`` and friends propagate unvoted.
    ``agreement=(what, words)`` (``AGREEMENT_WIDTH`` words; a failing member passes zeros)
    rides in the same all-reduce: when nobody failed but the words differ, every member raises
    the same ``GroupAgreementError`` naming ``what`` (or, when ``what`` is a tuple of one subject
    per word, the subject of the first word that differs).
    """
    if error is not None and not isinstance(error, Exception):
        raise TypeError(
            f"synchronize_step_error expects an Exception or None, got {type(error).__name__}"
        )
    subjects, words, misuse = _agreement(agreement)
    if error is None:
        error = misuse  # a caller's mistake on one member fails every member, by name
    if len(scope) == 0:
        if error is not None:
            raise error
        return
    # A first word names the operation by its phase and subjects: members in different
    # operations (one steps while another saves, or loads) are told so on both sides, instead
    # of one reading the other's words as its own first subject differing, or returning while
    # the other waits in the collective that follows its vote.
    failed, same = vote_words(
        scope, error is not None, (_operation_word(owner_name, phase, subjects), *words)
    )
    if not failed:
        if not same[0]:
            raise GroupAgreementError(
                f"{owner_name} {phase}: another process-group member is in a different "
                "operation (its vote is another optimizer's or phase's, or agrees on other "
                "subjects: one steps while another saves or loads, say; nothing was changed)",
                owner_name=owner_name,
                what="operation",
            )
        if not all(same):
            what = subjects[same.index(False) - 1]
            raise GroupAgreementError(
                f"{owner_name} {phase}: {what} differs across the process-group members "
                "(every member must present the same; nothing was changed)",
                owner_name=owner_name,
                what=what,
            )
        return
    if error is not None:
        import torch.distributed as dist

        rank = dist.get_rank()
        cause = str(error) or type(error).__name__
        raise DistributedStepError(
            f"{owner_name} {phase} failed on local rank {rank}: {cause}",
            owner_name=owner_name,
            phase=phase,
            local_failure=True,
            rank=rank,
        ) from error
    raise DistributedStepError(
        f"{owner_name} {phase} failed on another process-group member",
        owner_name=owner_name,
        phase=phase,
        local_failure=False,
        # The failing member is not known here; only that some member of the chain failed.
        rank=None,
    )
