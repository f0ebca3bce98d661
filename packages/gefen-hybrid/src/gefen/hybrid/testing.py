"""Test support for ``GefenMuonHybrid`` (docs/hybrid.md).

``TinyLM`` is the small language model the one-process hybrid tests share (Muon owns its two
hidden matrices, ``MUON_NAMES``); ``OneHiddenLM`` is a smaller one with a single hidden layer.
``hybrid_snapshot`` and ``assert_same_hybrid`` prove that an operation left both children, the
child objects and the commit latch untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "MUON_NAMES",
    "OneHiddenLM",
    "TinyLM",
    "assert_same_hybrid",
    "child_snapshot",
    "hybrid_snapshot",
]

MUON_NAMES = ("hidden.weight", "proj.weight")
"""The parameters of ``TinyLM`` that go to the Muon child."""


class TinyLM(nn.Module):
    """embed → two hidden matrices → LayerNorm → untied lm_head (Muon: the hidden weights)."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.proj = nn.Linear(width, width, bias=False)
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.proj(torch.relu(self.hidden(x)))
        out: torch.Tensor = self.lm_head(self.norm(x))
        return out


class OneHiddenLM(nn.Module):
    """embed, hidden (with bias), LayerNorm, untied lm_head: Muon = {hidden.weight}, 5 backup."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(torch.relu(self.hidden(self.embed(tokens)))))
        return out


def child_snapshot(child: torch.optim.Optimizer | None) -> Any:
    """A deep snapshot of one child: ``SNAPSHOT_ATTRIBUTES`` for a Gefen-backed child,
    ``defaults`` for any other optimizer, None for an absent child."""
    from gefen.core import Gefen
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot
    from gefen.muon import GefenMuon

    if child is None:
        return None
    if isinstance(child, (Gefen, GefenMuon)):
        return deep_snapshot(child, attributes=SNAPSHOT_ATTRIBUTES)
    return deep_snapshot(child, attributes=("defaults",))


def hybrid_snapshot(hybrid: Any) -> dict[str, Any]:
    """Both children's snapshots, the child objects themselves and the commit latch."""
    return {
        "muon": child_snapshot(hybrid.muon),
        "backup": child_snapshot(hybrid.backup),
        "children": (hybrid.muon, hybrid.backup),
        "latch": hybrid._commit_failed,
    }


def assert_same_hybrid(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Two ``hybrid_snapshot`` results agree: same children, unchanged, same latch."""
    from gefen.dist.testing import assert_unchanged

    for role in ("muon", "backup"):
        assert (before[role] is None) == (after[role] is None)
        if before[role] is not None:
            assert_unchanged(before[role], after[role])
    assert all(a is b for a, b in zip(before["children"], after["children"], strict=True))
    assert before["latch"] == after["latch"]
