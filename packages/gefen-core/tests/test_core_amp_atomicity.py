"""Rejected gradients, AMP controls and the failed-commit latch (docs/core.md §7).

§12 #37–#45 and #58.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gefen.core import Gefen
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot


def _p(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    )


def _trained(steps: int = 1, **options) -> tuple[Gefen, torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(11)
    a, b = _p(8, 8), _p(16, seed=1)
    optimizer = Gefen([a, b], **options)
    for seed in range(steps):
        a.grad, b.grad = torch.randn_like(a) + seed, torch.randn_like(b)
        optimizer.step()
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    return optimizer, a, b


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("steps", [0, 2])
def test_sparse_coo_gradient_rejected(steps: int, rejects) -> None:
    optimizer, _a, b = _trained(steps)
    good = b.grad
    b.grad = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (16,))

    def fix() -> None:
        b.grad = good

    rejects(optimizer, optimizer.step, RuntimeError, "sparse or non-strided gradient", restore=fix)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
@pytest.mark.parametrize("layout", ["csr", "mkldnn"])
def test_non_strided_parameter_gradient_rejected(layout: str) -> None:
    a = _p(4, 4)
    if layout == "csr":
        weird = torch.nn.Parameter(torch.eye(3).to_sparse_csr())
        weird.grad = torch.eye(3).to_sparse_csr()
    else:
        if not torch.backends.mkldnn.is_available():
            pytest.skip("mkldnn unavailable")
        weird = torch.nn.Parameter(torch.ones(3, 3).to_mkldnn())
        weird.grad = torch.ones(3, 3).to_mkldnn()
    optimizer = Gefen([a, weird])
    a.grad = torch.randn_like(a)
    before = a.detach().clone()
    with pytest.raises(RuntimeError, match="sparse or non-strided gradient"):
        optimizer.step()
    assert torch.equal(a, before)
    assert optimizer.codebook is None
    assert optimizer.global_step == 0
    assert optimizer.state[a] == {"period": 0}


@pytest.mark.parametrize(
    ("bad_grad", "fragment"),
    [
        (lambda: torch.randn(3, 3), "gradient shape"),
        (lambda: torch.randn(16, dtype=torch.float64), "gradient dtype"),
        (lambda: torch.randn(16, dtype=torch.complex64), "complex gradient"),
    ],
)
def test_mismatched_gradient_rejected_then_retry_learns(bad_grad, fragment: str, rejects) -> None:
    a, b = _p(8, 8), _p(16, seed=1)
    optimizer = Gefen([a, b])
    a.grad = torch.randn_like(a)
    original = b.data
    wrong = bad_grad()
    b.data = torch.zeros_like(wrong)  # torch's grad setter checks against p.data: swap it around
    b.grad = wrong
    b.data = original

    def fix() -> None:
        b.grad = torch.randn_like(b)

    rejects(optimizer, optimizer.step, RuntimeError, fragment, restore=fix)
    assert optimizer.codebook is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gradient_on_another_device_rejected_cuda(rejects) -> None:
    a = _p(4)
    optimizer = Gefen([a])
    original = a.data
    a.data = torch.zeros(4, device="cuda")
    a.grad = torch.ones(4, device="cuda")
    a.data = original

    def fix() -> None:
        a.grad = torch.ones(4)

    rejects(optimizer, optimizer.step, RuntimeError, "same device", restore=fix)


def test_wrong_device_rejected(monkeypatch) -> None:
    from gefen.core import validation

    a = _p(4)
    optimizer = Gefen([a])
    a.grad = torch.ones(4)
    real = validation.local_tensor

    class _Elsewhere:
        device = torch.device("meta")

    monkeypatch.setattr(
        validation, "local_tensor", lambda t: _Elsewhere() if t is a.grad else real(t)
    )
    with pytest.raises(RuntimeError, match="same device"):
        optimizer.step()
    assert optimizer.global_step == 0


@pytest.mark.parametrize("found_inf", [1, 1.0, True, torch.tensor([1.0])])
@pytest.mark.parametrize("steps", [0, 2])
def test_found_inf_skips_everything(found_inf, steps: int) -> None:
    optimizer, _a, _ = _trained(steps)
    optimizer.found_inf = found_inf
    optimizer.grad_scale = torch.tensor([128.0])
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    loss = optimizer.step(lambda: torch.tensor(3.0))
    assert float(loss) == 3.0
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert hasattr(optimizer, "found_inf")  # GradScaler owns its attributes


def test_grad_scale_unscales_once_bit_equal() -> None:
    runs = []
    for scale in (None, 128.0):
        optimizer, a, b = _trained(1)
        grads = [a.grad.clone(), b.grad.clone()]
        if scale is not None:
            a.grad.mul_(scale)
            b.grad.mul_(scale)
            optimizer.found_inf = 0
            optimizer.grad_scale = torch.tensor([scale])
        optimizer.step()
        inverse = torch.tensor(1 / 128.0, dtype=torch.float64).float()
        if scale is not None:
            assert torch.equal(a.grad, (grads[0] * 128.0) * inverse)
        runs.append((a.detach().clone(), b.detach().clone()))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
    optimizer, a, _ = _trained(1)
    grad = a.grad.clone()
    optimizer.found_inf, optimizer.grad_scale = 0, None
    optimizer.step()
    assert torch.equal(a.grad, grad)


@pytest.mark.parametrize(
    ("found_inf", "grad_scale", "fragment"),
    [
        (torch.tensor([1.0, 0.0]), 2.0, "found_inf"),
        (1.0, 0.0, "grad_scale"),
        (1.0, -1.0, "grad_scale"),
        (1.0, float("nan"), "grad_scale"),
        (0.0, float("inf"), "grad_scale"),
    ],
)
def test_malformed_amp_controls_raise_even_on_overflow(found_inf, grad_scale, fragment) -> None:
    optimizer, _, _ = _trained(1)
    optimizer.found_inf, optimizer.grad_scale = found_inf, grad_scale
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(RuntimeError, match=fragment):
        optimizer.step()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))


def test_nan_gradient_under_amp_is_not_a_non_finite_error() -> None:
    optimizer, a, _ = _trained(1)
    a.grad[0, 0] = float("nan")
    optimizer.found_inf, optimizer.grad_scale = 1.0, 2.0
    optimizer.step()  # overflow decides: skipped, no NonFiniteGradientError


def test_step_supports_amp_scaling() -> None:
    a, h = _p(4), _p(4, dtype=torch.float16)
    optimizer = Gefen([a, h])
    a.grad = torch.ones(4)
    assert optimizer._step_supports_amp_scaling is False
    h.grad = torch.ones(4, dtype=torch.float16)
    assert optimizer._step_supports_amp_scaling is True
    bf = _p(4, dtype=torch.bfloat16)
    bf.grad = torch.ones(4, dtype=torch.bfloat16)
    assert Gefen([bf])._step_supports_amp_scaling is False


def test_commit_failure_latches_until_load(monkeypatch) -> None:
    optimizer, _a, _b = _trained(2)
    handed_out = optimizer.state_dict()  # shares the live tensors the failed commit may write
    saved = copy.deepcopy(handed_out)
    real = Gefen._commit_step

    def broken(self, plan):
        raise MemoryError("commit failed")

    monkeypatch.setattr(Gefen, "_commit_step", broken)
    with pytest.raises(MemoryError):
        optimizer.step()
    monkeypatch.setattr(Gefen, "_commit_step", real)
    for action in (optimizer.step, optimizer.initialize_codebook, optimizer.refresh_codebook):
        with pytest.raises(RuntimeError, match="previous step failed during commit"):
            action()
    with pytest.raises(ValueError, match="a step that failed during its commit wrote in part"):
        optimizer.load_state_dict(handed_out)  # the live values, which no checkpoint holds
    assert optimizer.latched
    optimizer.load_state_dict(saved)
    optimizer.step()
    assert optimizer.global_step == 3


def test_amp_retry_after_phase_four_failure_unscales_once(monkeypatch) -> None:
    h = torch.nn.Parameter(torch.randn(8, 8).half())
    optimizer = Gefen([h])
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    grad = torch.randn(8, 8).half()
    real = Gefen._prepare_step
    calls = []

    def failing_once(self, operation, learning):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("phase 4 failed")
        return real(self, operation, learning)

    monkeypatch.setattr(Gefen, "_prepare_step", failing_once)
    weights = grad.float()

    def backward() -> None:
        optimizer.zero_grad()
        scaler.scale((h.float() * weights).sum()).backward()

    backward()
    assert torch.equal(h.grad, grad * 128)
    with pytest.raises(MemoryError):
        scaler.step(optimizer)
    assert not hasattr(optimizer, "found_inf")
    assert not hasattr(optimizer, "grad_scale")
    scaler.update()
    assert scaler.get_scale() == 128.0
    backward()
    scaler.step(optimizer)
    assert optimizer.global_step == 1
    assert torch.equal(h.grad, grad)


def test_fused_true_compile_failure_mutates_nothing(monkeypatch, rejects) -> None:
    import gefen.core.fused as fused_module
    from gefen.core.fused import FusedImplementation, register_fused

    monkeypatch.setattr(fused_module, "_REGISTRY", [])  # the broken one is the only candidate

    def broken_compile(key):
        raise RuntimeError("compiler exploded")

    unregister = register_fused(
        FusedImplementation(
            "test-broken",
            "cpu",
            (torch.float32,),
            ("codebook8",),
            ("block", "factored"),
            True,
            broken_compile,
        )
    )
    try:
        optimizer, _, _ = _trained(0, fused=True)
        rejects(
            optimizer,
            optimizer.step,
            RuntimeError,
            "fused implementation failed",
            check_training=False,
        )
    finally:
        unregister()
