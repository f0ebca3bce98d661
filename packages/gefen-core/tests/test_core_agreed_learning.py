"""A rank with no local signal still learns when its scope agreed to learn (docs/core.md §5.5)."""

from __future__ import annotations

import pytest
import torch

from gefen.core import Gefen, codebook_ops
from gefen.core.state import validate_codebook


def test_agreed_learning_with_an_all_zero_local_histogram_publishes_the_padded_grid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stand-in for a peer whose shards were non-zero: the MAX vote said "learn".
    monkeypatch.setattr(codebook_ops, "any_nonzero_agreed", lambda counts, scope: True)
    weight = torch.nn.Parameter(torch.ones(4, 8))
    optimizer = Gefen([weight], lr=0.1, weight_decay=0.5)
    weight.grad = torch.zeros_like(weight)

    optimizer.step()

    assert optimizer.global_step == 1
    codebook = optimizer.codebook
    assert codebook is not None
    validate_codebook(codebook)
    # §5.2 from {-1, +1} alone: seven rounds of bisection give the grid of step 1/64, and the
    # last 127 leftmost-first insertions halve every gap but the rightmost one.
    expected = [-1.0 + i / 128 for i in range(255)] + [1.0]
    assert codebook.tolist() == expected
    assert optimizer.state[weight]["period"] > 0
    # All-zero gradient after learning: only decoupled decay moves the parameter (§12 #31).
    assert torch.equal(weight.detach(), torch.full((4, 8), 1.0 * (1 - 0.1 * 0.5)))
