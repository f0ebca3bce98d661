"""Test utilities for packages built on ``gefen.dist`` (docs/dist.md §11).

Importing this package never imports pytest; only ``gloo_required()`` does, when called.
"""

from __future__ import annotations

from gefen.dist.testing.harness import (
    RankFailure,
    RankTimeout,
    default_backend,
    mark,
    rank_device,
    run_ranks,
)
from gefen.dist.testing.snapshot import Snapshot, assert_unchanged, deep_snapshot, snapshot_diff
from gefen.dist.testing.tools import (
    ScenarioWorld,
    gloo_only,
    gloo_required,
    run_scenarios,
    timed,
)

__all__ = [
    "RankFailure",
    "RankTimeout",
    "ScenarioWorld",
    "Snapshot",
    "assert_unchanged",
    "deep_snapshot",
    "default_backend",
    "gloo_only",
    "gloo_required",
    "mark",
    "rank_device",
    "run_ranks",
    "run_scenarios",
    "snapshot_diff",
    "timed",
]
