"""The factored family's gradient sums, computed once by the step preflight (docs/step.md):
they double as the finiteness check of a factored gradient the native kernel updates, and the
commit reuses them instead of reading the gradient again. The result must be the one the
kernel gives computing them itself, bit for bit; a gradient they do not prove finite is read
by the plain check (a finite |g| above ~1.8e19 overflows g²); stale sums are never used."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from gefen.core import Gefen
from gefen.core.testing import rejects
from gefen.core.updaters import StepScalars
from gefen.core.validation import NonFiniteGradientError

pytestmark = pytest.mark.skipif(
    not any(shutil.which(name) for name in ("cc", "gcc", "clang")), reason="needs a C compiler"
)

SHAPES = [(64, 48), (3, 700), (100,)]  # two factored matrices and a block-family vector


def _model(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in SHAPES
    ]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def _without_preflight_sums(monkeypatch: Any) -> None:
    """The finiteness check reads every gradient itself; the kernel computes its own sums."""
    import gefen.core.native as native

    monkeypatch.setattr(native.NativeUpdater, "gradient_sums", lambda self, grad: None)


def _train(reductions: bool, dtype: torch.dtype, monkeypatch: Any) -> dict[str, Any]:
    params = _model(dtype)
    optimizer = Gefen(params, lr=1e-2, weight_decay=0.1, fused=True)
    if not reductions:
        _without_preflight_sums(monkeypatch)
    for step in range(5):
        _grads(params, step)
        optimizer.step()
    monkeypatch.undo()
    return {"params": [p.detach().clone() for p in params], "state": optimizer.state_dict()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):  # NaN-safe: the same values, NaN where the other has NaN
        nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
        return (
            a.dtype == b.dtype
            and torch.equal(nan, b.isnan() if b.is_floating_point() else nan)
            and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_preflight_sums_give_the_kernels_own_result_bit_for_bit(dtype, monkeypatch) -> None:
    with_sums = _train(True, dtype, monkeypatch)
    without = _train(False, dtype, monkeypatch)
    assert _same(with_sums, without)


def test_the_finiteness_check_does_not_read_a_factored_gradient_again(monkeypatch) -> None:
    import gefen.core.native as native

    params = _model()
    optimizer = Gefen(params, lr=1e-2, fused=True)
    _grads(params, 0)
    optimizer.step()
    read: list[tuple[int, ...]] = []
    plain = native.first_nonfinite

    def recording(tensors: list[torch.Tensor]) -> int | None:
        read.extend(tuple(t.shape) for t in tensors)
        return plain(tensors)

    computed: list[tuple[int, ...]] = []
    kernel_sums = native.NativeUpdater.gradient_sums

    def counting(self: Any, grad: torch.Tensor) -> Any:
        computed.append(tuple(grad.shape))
        return kernel_sums(self, grad)

    monkeypatch.setattr(native, "first_nonfinite", recording)
    monkeypatch.setattr(native.NativeUpdater, "gradient_sums", counting)
    _grads(params, 1)
    optimizer.step()
    assert read == [(100,)]  # only the block-family vector is read by the plain check
    assert computed == [(64, 48), (3, 700)]  # once each, in the preflight


def test_a_non_finite_factored_gradient_is_rejected_by_name_and_nothing_changes() -> None:
    params = _model()
    optimizer = Gefen(params, lr=1e-2, fused=True)
    _grads(params, 0)
    optimizer.step()
    for bad in (float("nan"), float("inf"), float("-inf")):
        _grads(params, 1)
        params[1].grad[2, 699] = bad  # the last element of the second matrix
        rejects(
            optimizer,
            optimizer.step,
            NonFiniteGradientError,
            "parameter param_groups[0][1] has a non-finite gradient",
            attributes=("state", "param_groups", "_global_step", "_codebook"),
        )
    before = [p.detach().clone() for p in params]
    _grads(params, 2)
    optimizer.step()  # still trains
    assert all(not torch.equal(a, p) for a, p in zip(before, params, strict=True))


@pytest.mark.parametrize("reductions", [True, False], ids=["sums", "no-sums"])
def test_a_finite_gradient_whose_squares_overflow_is_refused_either_way(
    monkeypatch, reductions: bool
) -> None:
    """Finite, but g² is +inf in fp32: the factored second moment would be infinite and the
    parameter NaN for good, so it is refused (docs/core.md §7.2) whether the preflight's sums
    or the extrema bound it. (It used to be taken, and turned the parameter NaN.)"""
    params = _model()
    optimizer = Gefen(params, lr=1e-2, fused=True)
    if not reductions:
        _without_preflight_sums(monkeypatch)
    _grads(params, 0)
    optimizer.step()
    _grads(params, 1)
    params[0].grad[5, 5] = 3e19
    rejects(optimizer, optimizer.step, NonFiniteGradientError, "squares overflow float32")


@pytest.mark.parametrize("fused", [True, False], ids=["native", "eager"])
def test_a_gradient_whose_column_sum_overflows_is_refused_on_every_path(fused: bool) -> None:
    """Every square and every row sum finite, but four rows near 1e19 in one column overflow
    that column's sum: the native preflight looked only at the rows and took the step, and
    ``v_col`` stayed +Inf for good (the column froze, and 0·Inf put NaN in a row with no
    gradient there). The eager path already refused it."""
    param = torch.nn.Parameter(torch.ones(5, 8))
    optimizer = Gefen([param], lr=1e-2, fused=fused)
    grad = torch.zeros(5, 8)
    grad[:4, 1:] = 1.0
    param.grad = grad.clone()
    optimizer.step()
    grad[:4, 0] = 1e19
    param.grad = grad
    rejects(optimizer, optimizer.step, NonFiniteGradientError, "squares overflow float32")


@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("factored", [True, False], ids=["factored", "block"])
def test_a_float64_gradient_beyond_float32_range_is_refused(codec: str, factored: bool) -> None:
    """A float64 gradient of 1e300 is finite, but the step computes in float32, where it is
    +Inf: the block family's momentum and second moment became NaN for good (the parameter with
    them). Refused like a non-finite gradient, before anything changes; the step then trains."""
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64))
        for shape in [(12, 16), (100,)]
    ]
    optimizer = Gefen(params, lr=1e-2, momentum_codec=codec, factored_v_2d=factored)
    for seed in range(2):
        _grads(params, seed)
        optimizer.step()
    _grads(params, 2)
    params[1].grad[7] = 1e300
    rejects(optimizer, optimizer.step, NonFiniteGradientError, "beyond float32's range")
    params[1].grad[7] = 0.5
    before = [p.detach().clone() for p in params]
    optimizer.step()
    assert all(
        torch.isfinite(p).all() and not torch.equal(a, p)
        for a, p in zip(before, params, strict=True)
    )


def _entry(rows: int, cols: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    return {
        "period": cols,
        "step": 2,
        "v_step": 2,
        "momentum_codes": torch.randint(
            0, 256, (rows, cols), dtype=torch.uint8, generator=generator
        ),
        "momentum_scale": torch.rand(rows, 1, generator=generator),
        "v_row": torch.rand(rows, generator=generator),
        "v_col": torch.rand(cols, generator=generator),
    }


def test_sums_of_a_gradient_changed_since_are_not_used() -> None:
    from gefen.core.native import NativeUpdater

    updater = NativeUpdater()
    scalars = StepScalars(1e-2, (0.9, 0.999), 1e-8, 0.0, torch.linspace(-1.0, 1.0, 256))
    grad = torch.randn(16, 32)
    reduced = updater.gradient_sums(grad)
    assert reduced is not None
    assert reduced[1] is True
    bound = reduced[0]  # the kernel with the sums bound to it (a functools.partial)
    values = bound.keywords["sums"][2]
    rows, cols = values[:16], values[16:]
    assert torch.allclose(rows, (grad * grad).mean(dim=1), rtol=1e-6)
    assert torch.allclose(cols, (grad * grad).sum(dim=0), rtol=1e-6)
    grad.mul_(3.0)  # in place after the preflight: a new version, the sums are stale
    param = torch.randn(16, 32)
    expected_param = param.clone()
    entry, expected = _entry(16, 32), _entry(16, 32)
    bound(param, grad, entry, scalars)
    updater(expected_param, grad, expected, scalars)
    assert torch.equal(param, expected_param)
    assert all(torch.equal(entry[k], expected[k]) for k in ("momentum_codes", "v_row", "v_col"))


def test_the_sums_report_what_they_cannot_prove_finite() -> None:
    from gefen.core.native import NativeUpdater

    updater = NativeUpdater()
    for bad in (float("nan"), float("inf"), 3e19):
        grad = torch.randn(8, 8)
        grad[7, 7] = bad
        reduced = updater.gradient_sums(grad)
        assert reduced is not None
        assert reduced[1] is False
    assert updater.gradient_sums(torch.randn(8, 8).t()) is None  # read through a copy
    assert updater.gradient_sums(torch.randn(8, 8, dtype=torch.float64)) is None
