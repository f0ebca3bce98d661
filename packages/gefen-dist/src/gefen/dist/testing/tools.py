"""Small helpers for multi-rank tests: liveness timing, the Gloo skip mark and scenario
worlds whose results tests read one scenario at a time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gefen.dist.testing.harness import (
    RankFailure,
    RankTimeout,
    Scenario,
    default_backend,
    run_ranks,
)

__all__ = ["ScenarioWorld", "gloo_only", "gloo_required", "run_scenarios", "timed"]

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[float, str | None, T | None]:
    """Run ``fn``; return ``(elapsed seconds, "Type: message" or None, value or None)``.

    Multi-rank scenarios assert liveness with it (an operation that must fail fast finishes
    within its budget), never performance.
    """
    start = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:
        return time.perf_counter() - start, f"{type(exc).__name__}: {exc}", None
    return time.perf_counter() - start, None, value


def gloo_required() -> Any:
    """A ``pytest.mark.skipif`` that skips when ``torch.distributed`` or Gloo is unavailable."""
    import pytest  # only test code asks for a mark; the library never imports pytest
    import torch.distributed as dist

    available = bool(dist.is_available() and dist.is_gloo_available())
    return pytest.mark.skipif(not available, reason="needs torch.distributed with Gloo")


def gloo_only() -> Any:
    """A ``pytest.mark.skipif`` for scenarios that build CPU tensors or CPU meshes: they run
    only when the session's backend (``GEFEN_TEST_BACKEND``) is Gloo."""
    import pytest

    backend = default_backend()
    return pytest.mark.skipif(
        backend.lower() != "gloo",
        reason=f"Gloo-only scenario (CPU tensors or meshes); GEFEN_TEST_BACKEND={backend}",
    )


class ScenarioWorld:
    """The outcome of one scenario-list world, read per scenario.

    A scenario that failed on some rank re-raises that failure (with its tracebacks) only for
    the test that reads it; a world that timed out or broke re-raises for every scenario that
    did not complete on every rank.
    """

    def __init__(
        self,
        names: Sequence[str],
        results: list[dict[str, Any]] | None,
        error: RankFailure | None,
    ) -> None:
        self.names = tuple(names)
        self._results = results
        self._error = error

    @property
    def error(self) -> RankFailure | None:
        """The world-level failure ``run_ranks`` raised, if any."""
        return self._error

    def __getitem__(self, name: str) -> list[Any]:
        """Every rank's result of scenario ``name``, in rank order."""
        if name not in self.names:
            raise KeyError(f"no scenario named {name!r}")
        if self._results is not None:
            return [rank_results[name] for rank_results in self._results]
        assert self._error is not None
        outcomes = self._error.outcomes
        finished = [o["results"] for o in outcomes if o is not None and name in o["results"]]
        if outcomes and len(finished) == len(outcomes):
            return [results[name] for results in finished]
        failures = [
            f"--- rank {rank}:\n{o['failures'][name]}"
            for rank, o in enumerate(outcomes)
            if o is not None and name in o["failures"]
        ]
        if failures and not isinstance(self._error, RankTimeout):
            raise RankFailure(f"scenario {name!r} failed\n" + "\n".join(failures), outcomes)
        raise self._error


def run_scenarios(scenarios: list[Scenario], world_size: int = 2, **kwargs: Any) -> ScenarioWorld:
    """``run_ranks`` over a scenario list, keeping per-scenario outcomes for the tests."""
    names = [name for name, _, _ in scenarios]
    try:
        return ScenarioWorld(names, run_ranks(scenarios, world_size, **kwargs), None)
    except RankFailure as error:
        return ScenarioWorld(names, None, error)
