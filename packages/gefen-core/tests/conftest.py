"""Shared fixtures of the gefen-core tests: the fail-before-mutation check of docs/quality.md."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.core import Gefen
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot


def trains(optimizer: Any) -> None:
    """The optimizer still takes a normal step that moves its parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    torch.manual_seed(123)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    step = optimizer.global_step
    optimizer.step()
    assert optimizer.global_step == step + 1
    assert any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))


def _rejects(
    optimizer: Any,
    action: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    *,
    restore: Callable[[], Any] | None = None,
    check_training: bool = True,
) -> pytest.ExceptionInfo[Any]:
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        action()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    if restore is not None:
        restore()
    if check_training:
        trains(optimizer)
    return info


@pytest.fixture
def rejects() -> Callable[..., pytest.ExceptionInfo[Any]]:
    """``rejects(opt, action, ErrorType, "fragment", restore=None)``: raises, mutates nothing,
    and the optimizer trains afterwards (after ``restore`` fixes the input)."""
    return _rejects


@pytest.fixture
def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def fill_grads(params: Any, seed: int = 0, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)


@pytest.fixture
def grads() -> Callable[..., None]:
    return fill_grads


@pytest.fixture
def make_gefen() -> Callable[..., Gefen]:
    return Gefen
