"""A zero gradient moves nothing (docs/core.md §5.8): every learned codebook holds an exact 0.

Before: the learned codebook's smallest magnitude was about 2e-4, so an element whose gradient
was exactly zero (a dead ReLU unit's column in the next layer, an always-zero input feature) had
its zero momentum re-encoded to a non-zero codeword. The factored second moment of that column is
exactly zero as well, so the step size was 1/eps and the element moved by 7e4 × lr in one step
(9e6 × lr with codebook4), where AdamW leaves it where it is.
"""

from __future__ import annotations

import pytest
import torch

from gefen.core import Gefen
from gefen.core.kernels import BIN_COUNT
from gefen.core.learning import solve_new_codebook
from gefen.core.state import validate_codebook

CODECS = ["codebook8", "codebook4"]


def _zero_column_step(codec: str, steps: int, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(the zero-gradient column after ``steps`` steps, its starting value)."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(8, 32, generator=generator)
    w = torch.nn.Parameter(start.clone())
    optimizer = Gefen([w], lr=1e-2, momentum_codec=codec, **options)
    for _ in range(steps):
        grad = torch.randn(8, 32, generator=generator)
        grad[:, 5] = 0.0  # one input feature that is always zero
        w.grad = grad
        optimizer.step()
    return w.detach()[:, 5].clone(), start[:, 5]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "options",
    [{}, {"fused": False}, {"stochastic_round": True}, {"nesterov": False}],
    ids=["default", "eager", "stochastic", "plain-momentum"],
)
def test_a_zero_gradient_column_does_not_move(codec: str, options: dict) -> None:
    after, before = _zero_column_step(codec, steps=3, **options)
    assert torch.equal(after, before)


@pytest.mark.parametrize("codec", CODECS)
def test_a_zero_gradient_column_only_decays(codec: str) -> None:
    after, before = _zero_column_step(codec, steps=1, weight_decay=0.1)
    assert torch.equal(after, before * (1 - 1e-2 * 0.1))


@pytest.mark.parametrize("size", [256, 16])
@pytest.mark.parametrize("shape", ["symmetric", "skewed", "one-sided", "few-bins"], ids=lambda s: s)
def test_learned_codebooks_hold_an_exact_zero(size: int, shape: str) -> None:
    generator = torch.Generator().manual_seed(size)
    centres = torch.arange(BIN_COUNT, dtype=torch.float64) - BIN_COUNT / 2
    if shape == "symmetric":
        counts = (1e6 * torch.exp(-((centres / 300) ** 2))).to(torch.int64)
    elif shape == "skewed":
        counts = (1e6 * torch.exp(-(((centres - 400) / 200) ** 2))).to(torch.int64)
    elif shape == "one-sided":
        counts = torch.where(centres > 100, 1000, 0).to(torch.int64)
    else:
        counts = torch.zeros(BIN_COUNT, dtype=torch.int64)
        counts[torch.randint(0, BIN_COUNT, (5,), generator=generator)] = 7
    counts[0] += 1  # a block's maximum always lands in an end bin
    codebook = solve_new_codebook(counts, torch.device("cpu"), size)
    validate_codebook(codebook, size)
    assert int((codebook == 0).sum()) == 1


def test_a_refreshed_codebook_holds_an_exact_zero() -> None:
    w = torch.nn.Parameter(torch.randn(8, 32))
    optimizer = Gefen([w], codebook_refresh_every=1)
    for _ in range(3):
        w.grad = torch.randn(8, 32) ** 3  # heavy tails: a different codebook each time
        optimizer.step()
    assert int((optimizer.state_dict()["gefen"]["codebook"] == 0).sum()) == 1
