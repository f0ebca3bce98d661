"""GefenMuon's single-process step (docs/muon.md §4–§6, §12; docs/core.md §7).

Every rejection proves that nothing changed (a deep snapshot of parameters, gradients, groups,
state, codebook, global step and latch) and that the optimizer still trains afterwards.
"""

from __future__ import annotations

import copy
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from gefen.core import NonFiniteGradientError
from gefen.core.codec import encode_blocks
from gefen.core.testing import SNAPSHOT_ATTRIBUTES, forbid_collectives
from gefen.dist.testing import assert_unchanged, deep_snapshot, gloo_required
from gefen.muon import GefenMuon, adjust_lr_ratio, newton_schulz

STANDARD = ((3.4445, -4.7750, 2.0315),) * 5


def _p(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    )


def _grad(p: torch.Tensor, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)


def _params(optimizer: GefenMuon) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _trains(optimizer: GefenMuon, seed: int = 123) -> None:
    """The optimizer still takes a normal step that moves its parameters."""
    params = _params(optimizer)
    for index, p in enumerate(params):
        p.grad = _grad(p, seed + index)
    before = [p.detach().clone() for p in params]
    step = optimizer.global_step
    optimizer.step()
    assert optimizer.global_step == step + 1
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in params)


def _snapshot(optimizer: GefenMuon) -> Any:
    return deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)


def _rejects(
    optimizer: GefenMuon,
    action: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    *,
    restore: Callable[[], Any] | None = None,
    check_training: bool = True,
) -> pytest.ExceptionInfo[Any]:
    """``action`` raises ``error`` matching ``fragment``, changes nothing, and (after
    ``restore`` fixes the input) the optimizer still trains."""
    before = _snapshot(optimizer)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        action()
    assert_unchanged(before, _snapshot(optimizer))
    if restore is not None:
        restore()
    if check_training:
        _trains(optimizer)
    return info


def _stepped(optimizer: GefenMuon, steps: int = 1, seed: int = 50) -> None:
    for step in range(steps):
        for index, p in enumerate(_params(optimizer)):
            p.grad = _grad(p, seed + 10 * step + index)
        optimizer.step()


# --------------------------------------------------------------------------------------------
# Weight decay, zero gradients, NorMuon


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_decay_uses_raw_lr_under_match_rms_adamw(dtype: torch.dtype) -> None:
    # A zero gradient orthogonalises to exactly zero, so the step is the decay alone; the
    # ratio of (64, 16) under match_rms_adamw is 1.6, so decaying by lr·ratio would differ.
    lr, wd = 0.05, 0.3
    assert adjust_lr_ratio("match_rms_adamw", (64, 16)) == pytest.approx(1.6)
    assert torch.equal(newton_schulz(torch.zeros(64, 16), STANDARD, 1e-7), torch.zeros(64, 16))
    p = _p(64, 16, dtype=dtype)
    optimizer = GefenMuon(
        [p], lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw", momentum_codec="none"
    )
    expected = p.detach().clone().mul_(1 - lr * wd)
    p.grad = torch.zeros_like(p)
    optimizer.step()
    assert torch.equal(p.detach(), expected)
    assert optimizer.global_step == 1


def test_weight_decay_raw_lr_codebook8_zero_momentum() -> None:
    # codebook8 with momentum 0: after the codebook exists, a zero gradient gives m̂ = 0.
    lr, wd = 0.02, 0.25
    p = _p(64, 16)
    optimizer = GefenMuon([p], lr=lr, weight_decay=wd, momentum=0.0, adjust_lr_fn="match_rms_adamw")
    _stepped(optimizer)
    expected = p.detach().clone().mul_(1 - lr * wd)
    p.grad = torch.zeros_like(p)
    optimizer.step()
    assert torch.equal(p.detach(), expected)
    assert optimizer.global_step == 2


@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("normuon", [False, True], ids=["muon", "normuon"])
def test_zero_gradient_without_weight_decay_is_bit_identical(codec: str, normuon: bool) -> None:
    # `a` has a real gradient (so codebook8 learns its codebook); `b` is all zero.
    a, b = _p(12, 8), _p(8, 12, seed=1)
    optimizer = GefenMuon([a, b], weight_decay=0.0, momentum_codec=codec, normuon=normuon)
    b_before = b.detach().clone()
    for step in range(3):
        a.grad, b.grad = _grad(a, step), torch.zeros_like(b)
        optimizer.step()
        assert torch.equal(b.detach(), b_before)
    entry = optimizer.state[b]
    assert entry["step"] == 3
    assert optimizer.global_step == 3
    for p in (a, b):
        assert bool(torch.isfinite(p).all())
        for value in optimizer.state[p].values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert bool(torch.isfinite(value).all())
    if normuon:
        assert torch.equal(entry["normuon_v"], torch.zeros(8, 1))
        assert entry["normuon_step"] == 3


@pytest.mark.parametrize("codec", ["codebook8", "codebook4", "none"])
@pytest.mark.parametrize("shape", [(0, 4), (4, 0)], ids=["no-rows", "no-columns"])
def test_a_zero_element_matrix_stays_pristine(codec: str, shape: tuple[int, int]) -> None:
    """As in Gefen (docs/core.md §4) and torch's own optimizers: an empty matrix is skipped. It
    used to fail the commit with a ZeroDivisionError after the codebook was published, which
    latched the optimizer."""
    empty, w = torch.nn.Parameter(torch.zeros(shape)), _p(4, 6)
    twin = copy.deepcopy(w)
    optimizer = GefenMuon([empty, w], momentum_codec=codec)
    alone = GefenMuon([twin], momentum_codec=codec)
    for step in range(2):
        empty.grad = torch.zeros(shape)
        w.grad, twin.grad = _grad(w, step), _grad(twin, step)
        optimizer.step()
        alone.step()
    assert torch.equal(w, twin)
    assert optimizer.state[empty].get("step", 0) == 0
    assert not optimizer.latched
    optimizer.load_state_dict(optimizer.state_dict())


def test_zero_gradient_everywhere_with_normuon_stays_finite() -> None:
    p = _p(6, 10)
    optimizer = GefenMuon([p], weight_decay=0.0, momentum_codec="none", normuon=True)
    before = p.detach().clone()
    for _ in range(2):
        p.grad = torch.zeros_like(p)
        optimizer.step()
    assert torch.equal(p.detach(), before)
    entry = optimizer.state[p]
    assert bool(torch.isfinite(entry["normuon_v"]).all())
    assert entry["normuon_step"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_normuon_state_is_fp32_rows_and_round_trips(dtype: torch.dtype, codec: str) -> None:
    wide, tall = _p(6, 10, dtype=dtype), _p(10, 6, seed=1, dtype=dtype)
    optimizer = GefenMuon([wide, tall], normuon=True, momentum_codec=codec)
    for t in range(1, 4):
        _stepped(optimizer, seed=10 * t)
        for p in (wide, tall):
            entry = optimizer.state[p]
            v = entry["normuon_v"]
            assert v.dtype == torch.float32
            assert v.shape == (p.shape[0], 1)
            assert bool((v >= 0).all())
            assert bool(torch.isfinite(v).all())
            assert type(entry["normuon_step"]) is int
            assert entry["normuon_step"] == t
            assert entry["step"] == t
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in (wide, tall)]
    twin = GefenMuon(twin_params, normuon=True, momentum_codec=codec)
    twin.load_state_dict(loaded)
    for ours, theirs in zip((wide, tall), twin_params, strict=True):
        mine, copied = optimizer.state[ours], twin.state[theirs]
        assert copied["normuon_v"].dtype == torch.float32
        assert torch.equal(copied["normuon_v"], mine["normuon_v"])
        assert copied["normuon_step"] == mine["normuon_step"] == 3
    # The resumed copy continues bit-identically.
    for index, (ours, theirs) in enumerate(zip((wide, tall), twin_params, strict=True)):
        ours.grad = _grad(ours, 900 + index)
        theirs.grad = ours.grad.clone()
    optimizer.step()
    twin.step()
    for ours, theirs in zip((wide, tall), twin_params, strict=True):
        assert torch.equal(ours.detach(), theirs.detach())
        assert torch.equal(optimizer.state[ours]["normuon_v"], twin.state[theirs]["normuon_v"])


# --------------------------------------------------------------------------------------------
# The codebook


def test_codebook_is_learned_once_and_frozen_and_serves_a_later_group() -> None:
    a = _p(32, 16)
    optimizer = GefenMuon([a], momentum=0.9)
    assert optimizer.codebook is None
    _stepped(optimizer)
    frozen = optimizer.codebook.clone()
    assert frozen.shape == (256,)
    assert frozen.dtype == torch.float32
    assert frozen[0] == -1.0
    assert frozen[-1] == 1.0
    # Later gradients from a very different distribution do not relearn it.
    a.grad = _grad(a, 7) ** 3
    optimizer.step()
    assert torch.equal(optimizer.codebook, frozen)
    # A group added after step 1 steps against the frozen codebook.
    b = _p(24, 8, seed=3)
    optimizer.add_param_group({"params": [b], "lr": 0.01})
    assert optimizer.state[b] == {"period": 0}
    a.grad, b.grad = _grad(a, 8), _grad(b, 9) * 100.0
    optimizer.step()
    assert torch.equal(optimizer.codebook, frozen)
    entry = optimizer.state[b]
    assert entry["step"] == 1
    period = entry["period"]
    assert period > 0
    assert (24 * 8) % period == 0
    expected = torch.lerp(torch.zeros(24 * 8 // period, period), b.grad.reshape(-1, period), 0.1)
    codes, scale = encode_blocks(expected.reshape(-1), frozen, period)
    assert torch.equal(entry["momentum_codes"], codes)
    assert torch.equal(entry["momentum_scale"], scale)
    assert optimizer.global_step == 3


def test_initialize_codebook_learns_without_stepping() -> None:
    a, b = _p(16, 8), _p(8, 24, seed=1)
    optimizer = GefenMuon([a, b], weight_decay=0.5)
    assert optimizer.initialize_codebook() is False  # no gradient yet
    assert optimizer.codebook is None
    a.grad, b.grad = _grad(a, 1), _grad(b, 2)
    params_before = [a.detach().clone(), b.detach().clone()]
    assert optimizer.initialize_codebook() is True
    codebook = optimizer.codebook
    assert codebook is not None
    assert codebook.shape == (256,)
    assert optimizer.global_step == 0
    assert torch.equal(a.detach(), params_before[0])
    assert torch.equal(b.detach(), params_before[1])
    periods = {}
    for p in (a, b):
        assert set(optimizer.state[p]) == {"period"}
        periods[p] = optimizer.state[p]["period"]
        assert periods[p] > 0
    learned = codebook.clone()
    before = _snapshot(optimizer)
    assert optimizer.initialize_codebook() is False  # already learned: nothing changes
    assert_unchanged(before, _snapshot(optimizer))
    optimizer.step()  # the first step uses that codebook and those periods
    assert torch.equal(optimizer.codebook, learned)
    assert optimizer.global_step == 1
    for p in (a, b):
        entry = optimizer.state[p]
        assert entry["period"] == periods[p]
        assert entry["step"] == 1
        ema = torch.lerp(
            torch.zeros(p.numel() // periods[p], periods[p]),
            p.grad.reshape(-1, periods[p]),
            1 - 0.95,
        )
        codes, scale = encode_blocks(ema.reshape(-1), learned, periods[p])
        assert torch.equal(entry["momentum_codes"], codes)
        assert torch.equal(entry["momentum_scale"], scale)


def test_initialize_codebook_with_none_codec_is_false() -> None:
    p = _p(4, 4)
    optimizer = GefenMuon([p], momentum_codec="none")
    p.grad = _grad(p, 1)
    assert optimizer.initialize_codebook() is False
    assert optimizer.codebook is None
    assert optimizer.global_step == 0


@pytest.mark.parametrize("kind", ["absent", "zero", "mixed"])
def test_first_codebook8_step_with_empty_histogram_is_a_noop(kind: str) -> None:
    a, b = _p(8, 4), _p(4, 8, seed=1)
    optimizer = GefenMuon([a, b], weight_decay=0.5, lr=0.1)
    if kind == "zero":
        a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
    elif kind == "mixed":
        a.grad = torch.zeros_like(a)
    before = _snapshot(optimizer)
    assert optimizer.step() is None
    assert_unchanged(before, _snapshot(optimizer))
    assert optimizer.global_step == 0
    assert optimizer.codebook is None
    assert optimizer.state[a] == {"period": 0}
    assert optimizer.state[b] == {"period": 0}
    _trains(optimizer)
    assert optimizer.codebook is not None
    assert optimizer.global_step == 1


def test_refresh_codebook_is_not_implemented() -> None:
    p = _p(8, 8)
    optimizer = GefenMuon([p])
    _rejects(
        optimizer,
        optimizer.refresh_codebook,
        NotImplementedError,
        "GefenMuon does not support refresh_codebook",
    )
    assert optimizer.codebook is not None  # learned by the training step
    _rejects(
        optimizer,
        optimizer.refresh_codebook,
        NotImplementedError,
        "GefenMuon does not support refresh_codebook",
    )


def test_none_entry_has_period_one_and_no_codebook() -> None:
    p, q = _p(8, 6), _p(1, 1, seed=1)
    optimizer = GefenMuon([p, q], momentum_codec="none")
    assert optimizer.state[p] == {"period": 0}
    _stepped(optimizer, steps=2)
    for param in (p, q):
        entry = optimizer.state[param]
        assert entry["period"] == 1
        assert entry["step"] == 2
        assert set(entry) == {"period", "step", "momentum_buffer"}
        assert entry["momentum_buffer"].dtype == param.dtype
        assert entry["momentum_buffer"].shape == param.shape
    assert optimizer.codebook is None


# --------------------------------------------------------------------------------------------
# Step-time rejections (docs/core.md §7.2): nothing mutated, still trains


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
def test_flat_partition_swapped_in_is_rejected_at_step(later: bool) -> None:
    real = _p(4, 3)
    other = _p(5, 2, seed=1)
    optimizer = GefenMuon([real, other])
    if later:
        _stepped(optimizer)
    flat = torch.nn.Parameter(torch.zeros(12))
    optimizer.param_groups[0]["params"][0] = flat  # a ZeRO-style 1-D fp32 partition

    def restore() -> None:
        optimizer.param_groups[0]["params"][0] = real

    # Without any gradient ...
    _rejects(
        optimizer,
        optimizer.step,
        ValueError,
        "GefenMuon found a 1-D parameter param_groups[0][0] at step time",
        check_training=False,
    )
    # ... and with gradients everywhere (including the partition's).
    flat.grad = torch.ones(12)
    other.grad = _grad(other, 3)
    info = _rejects(
        optimizer,
        optimizer.step,
        ValueError,
        "GefenMuon found a 1-D parameter",
        restore=restore,
    )
    assert "Muon cannot be applied to a flat partition" in str(info.value)
    assert "use plain Gefen" in str(info.value)
    assert flat not in optimizer.state


class _ElsewhereGrad(torch.Tensor):
    """A CPU gradient that reports the meta device (§7.2's "monkeypatched device check")."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("meta")


def _swapped_grad(p: torch.Tensor, make: Callable[[], torch.Tensor]) -> None:
    """Assign a gradient torch's setter would refuse: swap ``p.data`` around the assignment."""
    original = p.data
    replacement = make()
    p.data = torch.zeros_like(replacement)
    p.grad = replacement
    p.data = original


def _wrong_device(p: torch.Tensor) -> None:
    try:
        _swapped_grad(p, lambda: torch.zeros(p.shape, device="meta"))
        return
    except RuntimeError:
        pass  # torch refuses a CPU ↔ meta data swap; use the device-reporting gradient
    grad = torch.Tensor._make_subclass(_ElsewhereGrad, torch.randn(p.shape))
    p.grad = grad
    if p.grad.device == p.device:
        pytest.skip("cannot build a gradient on another device")


BAD_GRADIENTS: dict[str, tuple[Callable[[torch.Tensor], None], str]] = {
    "sparse": (
        lambda p: setattr(p, "grad", torch.randn(p.shape).to_sparse()),
        "sparse or non-strided gradient",
    ),
    "complex": (
        lambda p: _swapped_grad(p, lambda: torch.randn(p.shape, dtype=torch.complex64)),
        "complex gradient",
    ),
    "shape": (
        lambda p: _swapped_grad(p, lambda: torch.randn(p.shape[1], p.shape[0] + 1)),
        "gradient shape",
    ),
    "device": (_wrong_device, "same device"),
    "dtype": (
        lambda p: _swapped_grad(p, lambda: torch.randn(p.shape, dtype=torch.float64)),
        "gradient dtype",
    ),
}


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("kind", list(BAD_GRADIENTS))
def test_malformed_gradient_is_rejected_before_mutation(kind: str, codec: str, later: bool) -> None:
    good, bad = _p(6, 4), _p(4, 6, seed=1)
    optimizer = GefenMuon([("good.weight", good), ("bad.weight", bad)], momentum_codec=codec)
    if later:
        _stepped(optimizer)
    make, fragment = BAD_GRADIENTS[kind]
    good.grad = _grad(good, 5)
    make(bad)

    def restore() -> None:
        bad.grad = None

    info = _rejects(optimizer, optimizer.step, RuntimeError, fragment, restore=restore)
    assert "'bad.weight'" in str(info.value)
    assert optimizer.global_step == (2 if later else 1)


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_non_finite_gradient_is_rejected_naming_the_parameter(
    codec: str, value: float, later: bool
) -> None:
    good, bad = _p(6, 4), _p(4, 6, seed=1)
    optimizer = GefenMuon([("enc.weight", good), ("dec.weight", bad)], momentum_codec=codec)
    if later:
        _stepped(optimizer)
    good.grad, bad.grad = _grad(good, 5), _grad(bad, 6)
    bad.grad[2, 3] = value

    def restore() -> None:
        bad.grad = None

    info = _rejects(
        optimizer, optimizer.step, NonFiniteGradientError, "non-finite gradient", restore=restore
    )
    assert "'dec.weight'" in str(info.value)
    assert "'enc.weight'" not in str(info.value)


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_check_finite_false_skips_the_check(codec: str, later: bool) -> None:
    p, q = _p(6, 4), _p(4, 6, seed=1)
    optimizer = GefenMuon([p, q], momentum_codec=codec, check_finite=False)
    if later:
        _stepped(optimizer)
    p.grad, q.grad = _grad(p, 5), _grad(q, 6)
    q.grad[0, 0] = float("nan")
    q.grad[1, 1] = float("inf")
    step = optimizer.global_step
    optimizer.step()  # no NonFiniteGradientError, and no crash
    assert optimizer.global_step == step + 1
    assert optimizer.state[q]["step"] == step + 1


@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_amp_attributes_skip_the_finiteness_check(codec: str) -> None:
    p, q = _p(6, 4), _p(4, 6, seed=1)
    optimizer = GefenMuon([p, q], momentum_codec=codec)
    _stepped(optimizer)
    p.grad, q.grad = _grad(p, 5), _grad(q, 6)
    q.grad[0, 0] = float("inf")
    # GradScaler found the overflow: the step is skipped (no error), nothing is mutated and
    # the gradients are not unscaled.
    optimizer.grad_scale = torch.tensor(4.0)
    optimizer.found_inf = torch.tensor([1.0])
    before = _snapshot(optimizer)
    assert optimizer.step() is None
    assert_unchanged(before, _snapshot(optimizer))
    del optimizer.grad_scale, optimizer.found_inf
    # The scaler already unscaled (grad_scale None) and reports no overflow: the step runs on
    # the non-finite gradient instead of raising NonFiniteGradientError.
    optimizer.grad_scale = None
    optimizer.found_inf = torch.tensor([0.0])
    optimizer.step()
    assert optimizer.global_step == 2
    del optimizer.grad_scale, optimizer.found_inf
    # Without the attributes, the check is back.
    q.grad = _grad(q, 7)
    q.grad[1, 1] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="param_groups\\[0\\]\\[1\\]"):
        optimizer.step()


# --------------------------------------------------------------------------------------------
# The failed-commit latch


def test_commit_failure_latches_until_a_load(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _p(8, 4), _p(4, 8, seed=1)
    optimizer = GefenMuon([a, b])
    _stepped(optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    saved_params = [a.detach().clone(), b.detach().clone()]
    real_commit = GefenMuon._commit_step

    def partial_commit(self: GefenMuon, plan: Any) -> None:
        real_commit(self, plan[:1])  # the first parameter is written ...
        raise RuntimeError("injected commit failure")  # ... then resources run out

    monkeypatch.setattr(GefenMuon, "_commit_step", partial_commit)
    a.grad, b.grad = _grad(a, 11), _grad(b, 12)
    with pytest.raises(RuntimeError, match="injected commit failure"):
        optimizer.step()
    assert not torch.equal(a.detach(), saved_params[0])  # partially committed
    assert torch.equal(b.detach(), saved_params[1])
    monkeypatch.setattr(GefenMuon, "_commit_step", real_commit)
    latched = "previous step failed during commit"
    for action in (optimizer.step, optimizer.initialize_codebook):
        _rejects(optimizer, action, RuntimeError, latched, check_training=False)
    a.grad, b.grad = None, None
    _rejects(optimizer, optimizer.step, RuntimeError, latched, check_training=False)
    # A successful load clears the latch and restores the state; then training continues.
    a.data.copy_(saved_params[0])
    optimizer.load_state_dict(saved)
    assert optimizer.global_step == 1
    assert not optimizer._commit_failed
    _trains(optimizer)
    assert optimizer.global_step == 2


def test_failed_load_does_not_clear_the_latch(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _p(8, 4)
    optimizer = GefenMuon([a])
    _stepped(optimizer)
    saved = copy.deepcopy(optimizer.state_dict())

    def failing_commit(self: GefenMuon, plan: Any) -> None:
        raise MemoryError("injected")

    monkeypatch.setattr(GefenMuon, "_commit_step", failing_commit)
    a.grad = _grad(a, 3)
    with pytest.raises(MemoryError):
        optimizer.step()
    monkeypatch.undo()
    broken = copy.deepcopy(saved)
    broken["state"][0]["step"] = torch.tensor(1)  # a 0-dim tensor step is rejected
    with pytest.raises(ValueError, match="GefenMuon checkpoint"):
        optimizer.load_state_dict(broken)
    with pytest.raises(RuntimeError, match="previous step failed during commit"):
        optimizer.step()
    optimizer.load_state_dict(saved)
    _trains(optimizer)


# --------------------------------------------------------------------------------------------
# No collectives, no CUDA queries


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter_tensor",
    "barrier",
)


def _forbid_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_collectives(monkeypatch, "a non-sharded step", _COLLECTIVES)


def _exercise(optimizer: GefenMuon, params: list[torch.Tensor]) -> None:
    """A gradient-free step, codebook learning, steps with partial presence, save and load."""
    codebook8 = optimizer.defaults["momentum_codec"] == "codebook8"
    optimizer.step()  # no gradients: the pre-initialization no-op (codebook8) or a commit
    for index, p in enumerate(params):
        p.grad = _grad(p, index)
    assert optimizer.initialize_codebook() is codebook8
    optimizer.step()
    params[0].grad = None
    optimizer.step()
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    optimizer.step()
    assert optimizer.global_step == (3 if codebook8 else 4)


@pytest.fixture
def single_rank_gloo() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    handle, path = tempfile.mkstemp(prefix="gefen_muon_step_")
    os.close(handle)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("mode", ["exact", "distributed", "approx"])
def test_non_sharded_step_never_calls_collectives(
    monkeypatch: pytest.MonkeyPatch, codec: str, mode: str
) -> None:
    assert not (dist.is_available() and dist.is_initialized())
    params = [_p(8, 4), _p(4, 8, seed=1)]
    optimizer = GefenMuon(params, momentum_codec=codec, sharded_mode=mode, normuon=True)
    _forbid_collectives(monkeypatch)
    assert optimizer.step_failure_scope() == ()
    _exercise(optimizer, params)


@gloo_required()
@pytest.mark.parametrize("mode", ["exact", "distributed"])
def test_non_sharded_step_never_calls_collectives_with_a_process_group(
    single_rank_gloo: None, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    params = [_p(8, 4), _p(4, 8, seed=1)]
    optimizer = GefenMuon(params, sharded_mode=mode)
    _forbid_collectives(monkeypatch)
    assert optimizer.step_failure_scope() == ()
    _exercise(optimizer, params)


def test_cpu_step_never_queries_cuda_capture_state(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError("a CPU step queried the CUDA capture state")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", forbidden)
    params = [_p(8, 4), _p(4, 8, seed=1)]
    optimizer = GefenMuon(params)
    _exercise(optimizer, params)


# --------------------------------------------------------------------------------------------
# Learning rates, copies, hooks, closures


def test_tensor_lr_changes_in_place_take_effect() -> None:
    lr = torch.tensor(0.01)
    p = _p(12, 8)
    twin = torch.nn.Parameter(p.detach().clone())
    optimizer = GefenMuon([p], lr=lr)
    reference = GefenMuon([twin], lr=lr.clone())  # a tensor lr scales as torch's Muon does
    for step, value in enumerate([0.01, 0.03, 0.0, 0.02]):
        lr.fill_(value)  # in place: same object, new version
        reference.param_groups[0]["lr"] = torch.tensor(value)  # a new object each step
        p.grad, twin.grad = _grad(p, step), _grad(p, step)
        before = p.detach().clone()
        optimizer.step()
        reference.step()
        assert torch.equal(p.detach(), twin.detach()), f"step {step} used a stale lr"
        assert torch.equal(p.detach(), before) == (value == 0.0)
    assert optimizer.param_groups[0]["lr"] is lr


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
def test_step_lr_scheduler_takes_effect(tensor_lr: bool) -> None:
    p = _p(12, 8)
    twin = torch.nn.Parameter(p.detach().clone())
    optimizer = GefenMuon([p], lr=torch.tensor(0.1) if tensor_lr else 0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    reference = GefenMuon([twin], lr=0.1)
    for step in range(4):
        current = optimizer.param_groups[0]["lr"]
        value = float(current)
        assert value == pytest.approx(0.1 * 0.5**step)
        reference.param_groups[0]["lr"] = value
        p.grad, twin.grad = _grad(p, step), _grad(p, step)
        optimizer.step()
        reference.step()
        scheduler.step()
        assert torch.equal(p.detach(), twin.detach()), f"step {step}"
    assert optimizer.global_step == 4


def test_deepcopy_steps_identically() -> None:
    params = [_p(8, 4), _p(4, 8, seed=1)]
    optimizer = GefenMuon(params, normuon=True)
    _stepped(optimizer, steps=2)
    copied_params, copied = copy.deepcopy((params, optimizer))
    assert copied.param_groups[0]["params"][0] is copied_params[0]
    assert copied.codebook is not optimizer.codebook
    assert torch.equal(copied.codebook, optimizer.codebook)
    for step in range(3):
        for index, (p, q) in enumerate(zip(params, copied_params, strict=True)):
            p.grad = _grad(p, 100 + 10 * step + index)
            q.grad = p.grad.clone()
        optimizer.step()
        copied.step()
        for p, q in zip(params, copied_params, strict=True):
            assert torch.equal(p.detach(), q.detach())
            mine, theirs = optimizer.state[p], copied.state[q]
            assert set(mine) == set(theirs)
            for key, value in mine.items():
                if isinstance(value, torch.Tensor):
                    assert value is not theirs[key]
                    assert torch.equal(value, theirs[key])
                else:
                    assert value == theirs[key]
    assert optimizer.global_step == copied.global_step == 5
    assert torch.equal(optimizer.codebook, copied.codebook)


def test_step_hooks_fire_once_per_step() -> None:
    p = _p(8, 4)
    optimizer = GefenMuon([p])
    calls: list[str] = []
    handles = [
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre")),
        optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post")),
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("global-pre")),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append("global-post")),
    ]
    try:
        optimizer.step()  # the pre-initialization no-op still runs the hooks once
        assert calls == ["global-pre", "pre", "post", "global-post"]
        calls.clear()
        for step in range(2):
            p.grad = _grad(p, step)
            optimizer.step()
        assert calls == ["global-pre", "pre", "post", "global-post"] * 2
    finally:
        for handle in handles:
            handle.remove()


def test_closure_loss_is_returned_and_runs_with_grad() -> None:
    layer = torch.nn.Linear(6, 4, bias=False)
    optimizer = GefenMuon(layer.parameters(), lr=0.02)
    inputs = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    seen: list[bool] = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        optimizer.zero_grad()
        loss = layer(inputs).pow(2).mean()
        loss.backward()
        return loss

    with torch.no_grad():
        first = optimizer.step(closure)
    assert seen == [True]
    assert isinstance(first, torch.Tensor)
    assert optimizer.global_step == 1
    losses = [float(first.detach())]
    for _ in range(5):
        losses.append(float(optimizer.step(closure).detach()))
    assert losses[-1] < losses[0]
    assert optimizer.global_step == 6


def test_closure_failure_propagates_unchanged_and_mutates_nothing() -> None:
    p = _p(8, 4)
    optimizer = GefenMuon([p])
    _stepped(optimizer)
    p.grad = _grad(p, 9)

    def closure() -> None:
        raise KeyError("closure failure")

    _rejects(optimizer, lambda: optimizer.step(closure), KeyError, "closure failure")


@pytest.mark.parametrize("codec", ["none", "codebook8"])
def test_a_parameter_cast_after_its_state_exists_is_refused_by_name_and_nothing_latches(
    codec: str,
) -> None:
    """``model.to(torch.bfloat16)`` after a step: with codec "none" the momentum buffer is in the
    parameter's dtype, so the step must refuse it up front. The entry check that says so was
    skipped (its cached signature kept the shape, not the dtype): the step failed inside its
    commit with torch's bare lerp error and latched the optimizer, even once cast back."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 24))
    v = torch.nn.Parameter(torch.randn(16, 8))
    optimizer = GefenMuon([w, v], lr=1e-2, momentum_codec=codec)
    for _ in range(2):  # the second step's checks record the initialized entries' signatures
        w.grad, v.grad = torch.randn_like(w), torch.randn_like(v)
        optimizer.step()
    w.data = w.data.to(torch.bfloat16)
    w.grad, v.grad = torch.randn(16, 24, dtype=torch.bfloat16), torch.randn_like(v)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    v_before = v.detach().clone()
    if codec == "none":
        with pytest.raises(RuntimeError, match=r"parameter param_groups\[0\]\[0\]: state does "
                           r"not match parameter \(entry: 'momentum_buffer' must be "
                           r"torch.bfloat16"):  # fmt: skip
            optimizer.step()
        assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
        assert torch.equal(v.detach(), v_before)
        assert not optimizer.latched
        w.data = w.data.float()
        w.grad = torch.randn_like(w)
    optimizer.step()  # codebook8 keeps no dtype-bound state: the cast steps; "none" cast back
    assert optimizer.global_step == 3
    assert torch.isfinite(w.float()).all()


@pytest.mark.parametrize("shape", [(384,), (), (4, 8, 12)], ids=["1-D", "0-D", "3-D"])
@pytest.mark.parametrize("stepped", [False, True], ids=["pristine", "stepped"])
def test_a_matrix_turned_into_another_rank_is_refused_by_name_at_save(
    shape: tuple[int, ...], stepped: bool
) -> None:
    """``p.data = flat`` (a ZeRO-style partition) after construction: ``step()`` refuses it by
    name; ``state_dict()`` raised a bare ``IndexError`` from the matrix shape of the entry (or,
    for a 3-D tensor, named a period against rows × columns). It now refuses it by name too,
    before anything is built, and saves again once the matrix is back."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 24))
    optimizer = GefenMuon([w], lr=1e-2)
    if stepped:
        w.grad = torch.randn_like(w)
        optimizer.step()
    matrix = w.data
    w.data = torch.randn(shape)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(ValueError, match=rf"GefenMuon found a {len(shape)}-D parameter "
                       r"param_groups\[0\]\[0\] at save time"):  # fmt: skip
        optimizer.state_dict()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    w.data = matrix
    saved = optimizer.state_dict()
    assert len(saved["state"]) == 1
    w.grad = torch.randn_like(w)
    optimizer.step()
    assert optimizer.global_step == (2 if stepped else 1)
