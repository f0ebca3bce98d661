"""The multi-rank harness itself (docs/dist.md §11.1): hangs become RankTimeout within the
deadline, helpers behave, and the Gloo mark skips cleanly. Raising workers and scenario lists
are exercised in test_dist_world2_protocol."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from gefen.dist.testing import (
    RankFailure,
    RankTimeout,
    default_backend,
    gloo_only,
    gloo_required,
    mark,
    rank_device,
    run_ranks,
    timed,
)

# The deadline counts from process start, so it must outlast start-up (a few seconds on an
# idle machine, far more on a loaded one). An attempt whose ranks had not even reached the
# worker proves nothing about the harness; it is repeated with twice the deadline.
DEADLINES_S = (30.0, 60.0, 120.0)


def sleep_forever_on_rank_one(rank: int, world_size: int) -> str:
    if rank == 1:
        mark("sleeping forever")
        while True:
            time.sleep(1)
    return "done"


def _hang_once(deadline_s: float) -> tuple[RankTimeout, float]:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as caught:
        run_ranks(
            sleep_forever_on_rank_one,
            2,
            backend="gloo",  # the worker needs no device; run it on Gloo in every session
            rendezvous="tcp",
            rank_deadline_s=deadline_s,
            pg_timeout_s=deadline_s / 2,
        )
    return caught.value, time.monotonic() - start


@gloo_required()
@pytest.mark.multirank
def test_a_hung_rank_times_out_naming_the_rank_and_its_mark() -> None:
    for deadline_s in DEADLINES_S:
        error, elapsed = _hang_once(deadline_s)
        started = error.outcomes[0] is not None and "sleeping forever" in str(error)
        if started or deadline_s == DEADLINES_S[-1]:
            break
    message = str(error)
    assert "rank 1 (last mark 'sleeping forever')" in message
    assert "rank 0 (last mark" not in message
    assert isinstance(error, RankFailure)
    assert isinstance(error, AssertionError)
    assert error.outcomes[0] is not None
    assert error.outcomes[0]["results"] == {"__worker__": "done"}
    assert elapsed < deadline_s + 10.0


def ignore_sigterm_and_sleep(rank: int, world_size: int) -> str:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark("ignoring SIGTERM")
    while True:
        time.sleep(1)


@gloo_required()
@pytest.mark.multirank
def test_ranks_that_ignore_sigterm_are_killed_within_one_grace_period() -> None:
    """The harness waited 5 s per rank, one after another, before killing: a world of 3 that
    ignores SIGTERM overran the documented bound (deadline + 10 s) by 5 s."""
    for deadline_s in (15.0, 30.0, 60.0):
        start = time.monotonic()
        with pytest.raises(RankTimeout) as caught:
            run_ranks(
                ignore_sigterm_and_sleep, 3, backend="gloo", rendezvous="tcp",
                rank_deadline_s=deadline_s, pg_timeout_s=deadline_s / 2,
            )  # fmt: skip
        elapsed = time.monotonic() - start
        marked = [f"rank {r} (last mark 'ignoring SIGTERM')" in str(caught.value) for r in range(3)]
        if all(marked):
            break  # every rank had installed its handler: the case under test
    assert all(marked)
    assert elapsed < deadline_s + 10.0


def test_a_rank_that_fails_to_start_is_the_error_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed ``start()`` was hidden behind "can only join a started process"."""
    import multiprocessing.context

    original = multiprocessing.context.SpawnProcess.start

    def start(process: object) -> None:
        if getattr(process, "name", "") == "gefen-rank-1":
            raise OSError("no more processes")
        original(process)  # type: ignore[arg-type]

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    with pytest.raises(OSError, match="no more processes"):
        run_ranks(sleep_forever_on_rank_one, 2, rank_deadline_s=30.0, pg_timeout_s=10.0)


def test_refused_arguments_create_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused worker or rendezvous left an empty ``gefen-ranks-*`` directory behind."""
    import gefen.dist.testing.harness as harness

    def no_directory(*args: object, **kwargs: object) -> str:
        raise AssertionError("a directory was created before the arguments were checked")

    monkeypatch.setattr(harness.tempfile, "mkdtemp", no_directory)
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda rank, world_size: None, 2)
    with pytest.raises(ValueError, match="rendezvous"):
        run_ranks(sleep_forever_on_rank_one, 2, rendezvous="udp")


def test_deadlines_must_nest() -> None:
    with pytest.raises(ValueError, match="nest"):
        run_ranks(sleep_forever_on_rank_one, 2, rank_deadline_s=10.0, pg_timeout_s=20.0)


class _Holder:
    def work(self, rank: int, world_size: int) -> None:
        return None


@pytest.mark.parametrize(
    "arguments",
    [
        {"rank_deadline_s": "60"},
        {"pg_timeout_s": float("nan")},
        {"rank_deadline_s": True},
        {"args": 1},
        {"args": "ab"},
    ],
    ids=["deadline-str", "timeout-nan", "deadline-bool", "args-int", "args-str"],
)
def test_malformed_arguments_are_refused_by_name(arguments: dict[str, object]) -> None:
    # A string deadline failed with "'<' not supported", a NaN timeout read as deadlines
    # that do not nest, and a string of args was spread into the call, a character an
    # argument.
    name = next(iter(arguments))
    with pytest.raises(TypeError, match=name):
        run_ranks(sleep_forever_on_rank_one, 2, **arguments)  # type: ignore[arg-type]


def test_workers_must_be_module_level() -> None:
    # A bound method was called in each rank as its unbound function, the rank as ``self``.
    with pytest.raises(TypeError, match="bound method"):
        run_ranks(_Holder().work, 2)
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda rank, world_size: None, 2)
    with pytest.raises(TypeError, match="scenario"):
        run_ranks([("only a name",)], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="unique"):
        run_ranks([("a", sleep_forever_on_rank_one, ()), ("a", sleep_forever_on_rank_one, ())], 2)


def test_mark_outside_a_rank_does_nothing() -> None:
    mark("not in a spawned rank")


def test_rank_device_follows_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_device(1, "gloo") == torch.device("cpu")
    assert rank_device(1, "nccl") == torch.device("cuda:1")
    monkeypatch.setenv("GEFEN_TEST_BACKEND", "nccl")
    assert default_backend() == "nccl"
    assert rank_device(0) == torch.device("cuda:0")
    monkeypatch.delenv("GEFEN_TEST_BACKEND")
    assert default_backend() == "gloo"


def test_timed_reports_errors_and_values() -> None:
    elapsed, error, value = timed(lambda: 5)
    assert error is None
    assert value == 5
    assert 0 <= elapsed < 10

    def fails() -> None:
        raise ValueError("bad input")

    elapsed, error, value = timed(fails)
    assert error == "ValueError: bad input"
    assert value is None


def test_gloo_only_follows_the_session_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEFEN_TEST_BACKEND", "nccl")
    assert gloo_only().mark.args[0] is True
    monkeypatch.setenv("GEFEN_TEST_BACKEND", "gloo")
    assert gloo_only().mark.args[0] is False


def test_gloo_required_skips_without_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    available = gloo_required()
    assert available.mark.name == "skipif"
    assert available.mark.args[0] is not (dist.is_available() and dist.is_gloo_available())
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    assert gloo_required().mark.args[0] is True
    monkeypatch.setattr(dist, "is_available", lambda: False)
    assert gloo_required().mark.args[0] is True
