"""The vote's agreement words (``vote_over``, ``presence_words``) in one process; the world-2
behaviour is tested with each optimizer (a gradient missing on one rank fails every rank)."""

from __future__ import annotations

import pytest

from gefen.dist import AGREEMENT_WIDTH, GuardedOperation, presence_words, vote_over, vote_words


def test_presence_words_are_two_int64_words_that_follow_the_pattern_and_its_order() -> None:
    words = presence_words([True, False, True])
    assert len(words) == AGREEMENT_WIDTH == 2
    digest, count = words
    assert count == 2
    assert 0 <= digest < 2**56  # negation and MAX stay inside int64
    assert presence_words([True, False, True]) == words  # deterministic (no salted hash)
    assert presence_words([False, True, True])[0] != digest  # order matters
    assert presence_words([True, False, True, False]) != words  # so does the length
    # The Mersenne-modulus trap of hashing the pattern as an integer: patterns that differ at
    # positions 61 apart must still differ.
    first = [False] * 70
    second = [False] * 70
    first[0], second[61] = True, True
    assert presence_words(first) != presence_words(second)


def test_an_uncompared_position_is_neither_present_nor_absent() -> None:
    """``None`` (a shard whose presence no rule compares) digests as its own value: a pattern
    with it differs from both flags there, and it is not counted as present."""
    with_marker = presence_words([True, None, False])
    assert with_marker[1] == 1
    assert with_marker != presence_words([True, True, False])
    assert with_marker != presence_words([True, False, False])
    assert presence_words([True, None, False]) == with_marker


def test_an_empty_scope_votes_nothing() -> None:
    assert vote_over((), True, (5, 7)) == (True, True)
    assert vote_over((), False) == (False, True)


def test_local_agreeing_in_one_process_returns_the_result_and_raises_unchanged() -> None:
    op = GuardedOperation("Owner", scope=())
    assert op.local_agreeing("phase", "gradient presence", lambda: ("done", (1, 2))) == "done"
    failure = KeyError("bad")

    def failing() -> tuple[str, tuple[int, int]]:
        raise failure

    with pytest.raises(KeyError) as info:
        op.local_agreeing("phase", "gradient presence", failing)
    assert info.value is failure  # single process: the very same exception


def test_vote_words_reports_agreement_per_word() -> None:
    assert vote_words((), False, (5, 7)) == (False, (True, True))
    assert vote_words((), True) == (True, ())


@pytest.mark.parametrize("subjects", [("gradient presence",), ("gradient presence", "")])
def test_agreement_subjects_must_be_one_per_word(subjects: tuple[str, ...]) -> None:
    op = GuardedOperation("Owner", scope=())
    with pytest.raises(ValueError, match="must be one non-empty str, or a tuple of 2"):
        op.local_agreeing("phase", subjects, lambda: ("done", (1, 2)))
    pair = ("gradient presence", "group options")
    assert op.local_agreeing("phase", pair, lambda: ("done", (1, 2))) == "done"
