"""float16 parameters under GradScaler with an AdamW backup: refused up front unless the backup is
fused (it used to step and produce NaN parameters after a few steps: torch's non-fused AdamW
underflows ``eps`` in float16), and the contract declares FLOAT16 only where it is true."""

from __future__ import annotations

import pytest
import torch

from gefen.contracts import Precision
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot
from gefen.hybrid import GefenMuonHybrid


def _hybrid(fused: bool) -> tuple[GefenMuonHybrid, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).half()
    kwargs = {"fused": True} if fused else None
    hybrid = GefenMuonHybrid(model, lr=0.01, backup_optimizer="adamw", backup_adamw_kwargs=kwargs)
    return hybrid, model


def _scaled_grads(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        grad = torch.randn(param.shape, generator=generator) * 1024
        grad[..., 0] = 0  # zero gradient elements: 0 / (sqrt(0) + eps) with eps = 0 in fp16
        param.grad = grad.half()


def _scaled_step(hybrid: GefenMuonHybrid) -> None:
    hybrid.grad_scale = torch.full((1,), 1024.0)  # what GradScaler sets before step()
    hybrid.found_inf = torch.zeros(1)
    try:
        hybrid.step()
    finally:
        for name in ("grad_scale", "found_inf"):
            hybrid.__dict__.pop(name, None)


def test_a_non_fused_backup_refuses_float16_under_grad_scaler_before_anything_changes() -> None:
    hybrid, model = _hybrid(fused=False)
    _scaled_grads(model, seed=0)
    before = {role: deep_snapshot(child, attributes=SNAPSHOT_ATTRIBUTES)
              for role, child in hybrid.participants if hasattr(child, "state")}  # fmt: skip
    values = [param.detach().clone() for param in model.parameters()]
    with pytest.raises(
        RuntimeError,
        match=r"AdamW backup group 0 parameter 0 is float16 under GradScaler with eps=1e-08",
    ):
        _scaled_step(hybrid)
    for role, child in hybrid.participants:
        if role in before:
            assert_unchanged(before[role], deep_snapshot(child, attributes=SNAPSHOT_ATTRIBUTES))
    assert all(torch.equal(a, b) for a, b in zip(values, model.parameters(), strict=True))
    assert Precision.FLOAT16 not in hybrid.optimizer_contract().capabilities.precisions


def test_a_fused_backup_trains_float16_under_grad_scaler_and_stays_finite() -> None:
    hybrid, model = _hybrid(fused=True)
    for seed in range(5):
        _scaled_grads(model, seed)
        _scaled_step(hybrid)
    assert all(bool(torch.isfinite(param).all()) for param in model.parameters())
    assert Precision.FLOAT16 in hybrid.optimizer_contract().capabilities.precisions


def test_without_grad_scaler_float16_steps_as_torch_adamw_would() -> None:
    hybrid, model = _hybrid(fused=False)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    hybrid.step()  # no scaler: torch's own AdamW accepts fp16 parameters, and so does the hybrid
    assert hybrid.backup is not None
    backup_params = hybrid.backup.param_groups[0]["params"]
    assert all(float(hybrid.backup.state[p]["step"]) == 1 for p in backup_params)
