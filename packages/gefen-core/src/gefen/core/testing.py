"""Test support for optimizers built on ``gefen.core`` (50-dist.md §11.2).

``SNAPSHOT_ATTRIBUTES`` names the optimizer-level facts a deep snapshot must cover besides
parameters, gradients, groups and state: the codebook, the global step and the latch.
"""

from __future__ import annotations

__all__ = ["SNAPSHOT_ATTRIBUTES"]

SNAPSHOT_ATTRIBUTES: tuple[str, ...] = ("_codebook", "_global_step", "_commit_failed", "defaults")
