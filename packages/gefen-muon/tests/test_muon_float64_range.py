"""A float64 matrix's codebook momentum keeps one float32 scale per block: a finite gradient
beyond float32's range made that scale +Inf, and the parameter NaN for good. Newton–Schulz runs
in bfloat16 (float32's range) for every codec, so without a codebook ("none") such a gradient
made the update, and the parameter, NaN too (as in torch's Muon). It is refused before anything
changes."""

from __future__ import annotations

import pytest
import torch

from gefen.core import NonFiniteGradientError
from gefen.core.testing import rejects
from gefen.muon import GefenMuon


def _matrices() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64))
        for shape in [(8, 12), (6, 8)]
    ]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("codec", ["codebook8", "codebook4", "none"])
def test_a_float64_gradient_beyond_float32_range_is_refused(codec: str) -> None:
    params = _matrices()
    optimizer = GefenMuon(params, lr=1e-2, momentum_codec=codec)
    for seed in range(2):
        _grads(params, seed)
        optimizer.step()
    _grads(params, 2)
    params[1].grad[3, 4] = 1e300
    rejects(optimizer, optimizer.step, NonFiniteGradientError, "beyond float32's range")
    params[1].grad[3, 4] = 0.5
    before = [param.detach().clone() for param in params]
    optimizer.step()
    for old, param in zip(before, params, strict=True):
        assert torch.isfinite(param).all()
        assert not torch.equal(old, param)


def test_float64_momentum_without_a_codebook_takes_a_huge_gradient() -> None:
    """1e30 is within float32's range: the momentum ("none" keeps the param's dtype) steps."""
    params = _matrices()
    optimizer = GefenMuon(params, lr=1e-2, momentum_codec="none")
    _grads(params, 0)
    params[1].grad[3, 4] = 1e30
    optimizer.step()
    assert all(torch.isfinite(param).all() for param in params)
