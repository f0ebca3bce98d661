"""GefenMuonHybrid's single-process step transaction and AMP decision (docs/hybrid.md §5, §7, §10).

Every rejection proves that neither child changed (a deep snapshot of parameters, gradients,
groups, state, codebook, global step and latch of both children, plus the hybrid's latch) and
that the hybrid still trains afterwards. Both backup backends are covered wherever the step
differs between them.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from gefen.core import Gefen, NonFiniteGradientError
from gefen.core.testing import SNAPSHOT_ATTRIBUTES, forbid_collectives
from gefen.core.validation import validate_gradient_structure
from gefen.dist import DistributedStepError
from gefen.dist.testing import assert_unchanged, deep_snapshot, snapshot_diff
from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.testing import MUON_NAMES, TinyLM
from gefen.muon import GefenMuon

BACKENDS = ["gefen", "adamw"]
LATCHED = "previous step failed during commit"


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(dtype)


def _hybrid(
    model: nn.Module, backend: str, *, fused: bool | None = False, **kwargs: Any
) -> GefenMuonHybrid:
    kwargs.setdefault("lr", 1e-2)
    kwargs.setdefault("ns_steps", 1)
    return GefenMuonHybrid(model, backup_optimizer=backend, fused=fused, **kwargs)


def _params(hybrid: GefenMuonHybrid) -> list[torch.Tensor]:
    return [p for group in hybrid.param_groups for p in group["params"]]


def _grad(p: torch.Tensor, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)


def _set_grads(hybrid: GefenMuonHybrid, seed: int, scale: float = 1.0) -> None:
    for index, p in enumerate(_params(hybrid)):
        p.grad = _grad(p, seed + index, scale)


def _half_params(hybrid: GefenMuonHybrid, half: str) -> list[torch.Tensor]:
    child = hybrid.muon if half == "muon" else hybrid.backup
    assert child is not None
    return [p for group in child.param_groups for p in group["params"]]


def _counters(hybrid: GefenMuonHybrid) -> tuple[int, ...]:
    """Committed steps per child: GefenMuon/Gefen's global_step, AdamW's largest ``step``."""
    counts = []
    for child in hybrid.children:
        if isinstance(child, (Gefen, GefenMuon)):
            counts.append(child.global_step)
        else:
            steps = [int(entry["step"]) for entry in child.state.values() if "step" in entry]
            counts.append(max(steps, default=0))
    return tuple(counts)


class _HybridSnapshot:
    """Deep snapshots of both children (never of the hybrid's routing views) and its latch."""

    def __init__(self, hybrid: GefenMuonHybrid) -> None:
        self.children = {
            role: deep_snapshot(child, attributes=SNAPSHOT_ATTRIBUTES)
            for role, child in (("muon", hybrid.muon), ("backup", hybrid.backup))
            if child is not None
        }
        self.latched = hybrid._commit_failed


def _snapshot(hybrid: GefenMuonHybrid) -> _HybridSnapshot:
    return _HybridSnapshot(hybrid)


def _assert_unchanged(before: _HybridSnapshot, hybrid: GefenMuonHybrid) -> None:
    after = _snapshot(hybrid)
    assert set(before.children) == set(after.children)
    problems = []
    for role, snap in before.children.items():
        problems += [f"{role}: {line}" for line in snapshot_diff(snap, after.children[role])]
    assert not problems, "a child changed:\n  " + "\n  ".join(problems)
    assert before.latched == after.latched


def _trains(hybrid: GefenMuonHybrid, seed: int = 123) -> None:
    """The hybrid still takes a normal step that moves every parameter of both children."""
    params = _params(hybrid)
    _set_grads(hybrid, seed)
    before = [p.detach().clone() for p in params]
    counters = _counters(hybrid)
    hybrid.step()
    assert _counters(hybrid) == tuple(c + 1 for c in counters)
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in params)
    assert not hybrid._commit_failed


def _rejects(
    hybrid: GefenMuonHybrid,
    action: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    *,
    restore: Callable[[], Any] | None = None,
    check_training: bool = True,
    before: _HybridSnapshot | None = None,
) -> pytest.ExceptionInfo[Any]:
    """``action`` raises ``error`` matching ``fragment``, changes neither child (compared with
    ``before`` once ``restore`` undid the test's own corruption), and the hybrid still trains."""
    if before is None:
        before = _snapshot(hybrid)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        action()
    if restore is not None:
        restore()
    _assert_unchanged(before, hybrid)
    if check_training:
        _trains(hybrid)
    return info


def _stepped(hybrid: GefenMuonHybrid, steps: int = 1, seed: int = 50) -> None:
    for step in range(steps):
        _set_grads(hybrid, seed + 100 * step)
        hybrid.step()


def _layout_message(role: str, group: int, position: int) -> str:
    return (
        "GefenMuonHybrid parameter layout changed after construction: "
        f"{role} group {group} position {position} holds a different tensor"
    )


def _clear_amp(hybrid: GefenMuonHybrid) -> None:
    for name in ("found_inf", "grad_scale"):
        hybrid.__dict__.pop(name, None)


# --------------------------------------------------------------------------------------------
# Layout checks (§7 step 1.2 and 1.5)


@pytest.mark.parametrize("with_grads", [False, True], ids=["no-grads", "grads"])
@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("role", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_partition_swapped_into_a_child_is_rejected_at_step(
    backend: str, role: str, later: bool, with_grads: bool
) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    if later:
        _stepped(hybrid)
    child = hybrid.muon if role == "muon" else hybrid.backup
    assert child is not None
    group = child.param_groups[0]
    position = 1
    real = group["params"][position]
    flat = nn.Parameter(torch.zeros(real.numel()))  # a ZeRO-style 1-D fp32 partition
    hybrid.zero_grad()
    if with_grads:
        _set_grads(hybrid, 7)
        flat.grad = torch.ones_like(flat)
    before = _snapshot(hybrid)
    group_id, length = id(group), len(group["params"])
    group["params"][position] = flat  # same dict, same length: only the tensor differs
    assert id(child.param_groups[0]) == group_id
    assert len(group["params"]) == length

    def restore() -> None:
        group["params"][position] = real

    info = _rejects(
        hybrid,
        hybrid.step,
        RuntimeError,
        _layout_message(role, 0, position),
        restore=restore,
        before=before,
    )
    assert str(info.value) == _layout_message(role, 0, position)
    assert flat not in child.state


@pytest.mark.parametrize("role", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_closure_that_swaps_a_tensor_is_caught_by_the_second_layout_check(
    backend: str, role: str
) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    _stepped(hybrid)
    child = hybrid.muon if role == "muon" else hybrid.backup
    assert child is not None
    group = child.param_groups[0]
    real = group["params"][0]
    calls = []

    def swapping_closure() -> torch.Tensor:
        calls.append("closure")
        group["params"][0] = nn.Parameter(real.detach().clone())
        return torch.tensor(1.0)

    _set_grads(hybrid, 3)

    def restore() -> None:
        group["params"][0] = real

    info = _rejects(
        hybrid,
        lambda: hybrid.step(swapping_closure),
        RuntimeError,
        _layout_message(role, 0, 0),
        restore=restore,
    )
    assert not isinstance(info.value, DistributedStepError)
    assert calls == ["closure"]  # the first check passed; the closure ran once


# --------------------------------------------------------------------------------------------
# Hooks and the closure (§5 "Step hooks", §7 step 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pre_hook_can_inject_a_closure_whose_loss_is_returned(backend: str) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    tokens = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    calls: list[str] = []
    seen_post: list[tuple[Any, ...]] = []

    def closure() -> torch.Tensor:
        calls.append("closure")
        assert torch.is_grad_enabled()
        hybrid.zero_grad()
        loss = model(tokens).float().square().mean()
        loss.backward()
        return loss.detach() + 41.0

    def inject(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert optimizer is hybrid
        assert args[0] is hybrid
        return (optimizer, closure), {}

    hybrid.register_step_pre_hook(inject)
    hybrid.register_step_post_hook(lambda opt, args, kwargs: seen_post.append(args))
    counters = _counters(hybrid)
    with torch.no_grad():
        loss = hybrid.step()
    assert calls == ["closure"]
    assert isinstance(loss, torch.Tensor)
    assert float(loss) > 41.0
    assert _counters(hybrid) == tuple(c + 1 for c in counters)
    assert len(seen_post) == 1
    assert seen_post[0][1] is closure


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bogus_pre_hook_return_is_rejected_naming_new_args(backend: str) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    _stepped(hybrid)
    handle = hybrid.register_step_pre_hook(lambda opt, args, kwargs: ("just", "three", "items"))
    _set_grads(hybrid, 9)
    info = _rejects(
        hybrid,
        hybrid.step,
        RuntimeError,
        "must return None or a tuple of (new_args, new_kwargs)",
        restore=handle.remove,
    )
    assert "new_args" in str(info.value)
    assert not isinstance(info.value, DistributedStepError)


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_closure_runs_exactly_once_before_either_child_commits(
    backend: str, later: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    if later:
        _stepped(hybrid)
    events: list[str] = []
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    muon_commit = hybrid.muon._commit_step

    def record_muon(plan: Any) -> None:
        events.append("muon commit")
        muon_commit(plan)

    monkeypatch.setattr(hybrid.muon, "_commit_step", record_muon)
    if backend == "gefen":
        backup_commit = hybrid.backup._commit_step  # type: ignore[attr-defined]

        def record_backup(plan: Any) -> None:
            events.append("backup commit")
            backup_commit(plan)

        monkeypatch.setattr(hybrid.backup, "_commit_step", record_backup)
    else:
        backup_step = type(hybrid.backup).step  # stepped as its class's, hooks unwrapped

        def record_backup_step(*args: Any, **kwargs: Any) -> Any:
            events.append("backup commit")
            return backup_step(*args, **kwargs)

        monkeypatch.setattr(type(hybrid.backup), "step", record_backup_step)
    tokens = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(2))
    values = [p.detach().clone() for p in _params(hybrid)]

    def closure() -> torch.Tensor:
        events.append("closure")
        # Nothing of either child has been written yet.
        assert all(torch.equal(v, p) for v, p in zip(values, _params(hybrid), strict=True))
        hybrid.zero_grad()
        loss = model(tokens).square().mean()
        loss.backward()
        return loss

    loss = hybrid.step(closure)
    assert events == ["closure", "muon commit", "backup commit"]
    assert isinstance(loss, torch.Tensor)
    assert loss.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_instance_hooks_and_global_hooks_fire_once_per_step(backend: str) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    counts = {"pre": 0, "post": 0, "global pre": 0, "global post": 0, "child": 0}

    def bump(key: str) -> Callable[..., None]:
        def hook(*args: Any) -> None:
            counts[key] += 1

        return hook

    def bump_global(key: str) -> Callable[..., None]:
        def hook(optimizer: Any, *args: Any) -> None:
            if optimizer is hybrid or optimizer is hybrid.backup:
                counts[key] += 1

        return hook

    hybrid.register_step_pre_hook(bump("pre"))
    hybrid.register_step_post_hook(bump("post"))
    handles = [
        register_optimizer_step_pre_hook(bump_global("global pre")),
        register_optimizer_step_post_hook(bump_global("global post")),
    ]
    for child in hybrid.children:  # no child fires a hook during a hybrid step (AdamW too)
        child.register_step_pre_hook(bump("child"))
        child.register_step_post_hook(bump("child"))
    try:
        for step in range(1, 4):
            _set_grads(hybrid, 10 * step)
            hybrid.step()
            assert counts["pre"] == step
            assert counts["post"] == step
            assert counts["global pre"] == step
            assert counts["global post"] == step
            assert counts["child"] == 0
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hook_on_a_child_never_runs_inside_the_hybrid_commit(backend: str) -> None:
    # An AdamW backup used to be stepped through torch's hook wrapper, after the vote: a hook
    # on it that raised failed the commit half-way (one member alone, latched), and one that
    # edited lr changed that member's step alone.
    model, twin_model = _model(), _model()
    hybrid, twin = _hybrid(model, backend), _hybrid(twin_model, backend)
    assert hybrid.backup is not None

    def meddle(optimizer: Any, args: Any, kwargs: Any) -> None:
        optimizer.param_groups[0]["lr"] = 123.0
        raise RuntimeError("a child's hook ran inside the hybrid's commit")

    hybrid.backup.register_step_pre_hook(meddle)
    for seed in (1, 2):
        for optimizer in (hybrid, twin):
            _set_grads(optimizer, seed)
            optimizer.step()
    assert not hybrid.latched
    assert all(torch.equal(a, b) for a, b in zip(_params(hybrid), _params(twin), strict=True))


# --------------------------------------------------------------------------------------------
# One AMP decision (§5 `_step_supports_amp_scaling`, §7 step 3)


@pytest.mark.parametrize("fused", [None, False], ids=["fused-None", "fused-False"])
@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("half", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_in_one_half_skips_both(
    backend: str, half: str, later: bool, fused: bool | None
) -> None:
    model = _model()
    hybrid = _hybrid(model, backend, fused=fused)
    if later:
        _stepped(hybrid)
    _set_grads(hybrid, 21, scale=8.0)
    _half_params(hybrid, half)[0].grad[0, 0] = float("inf")  # type: ignore[index]
    # GradScaler's attributes, as torch.amp.GradScaler.step sets them.
    hybrid.grad_scale = torch.tensor(8.0)
    hybrid.found_inf = torch.tensor([1.0])
    before = _snapshot(hybrid)
    assert hybrid.step() is None
    _assert_unchanged(before, hybrid)  # gradients included: none was unscaled
    _clear_amp(hybrid)
    _trains(hybrid)


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("half", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_grad_scaler_overflow_in_one_half_skips_both(
    backend: str, half: str, later: bool
) -> None:
    model = _model(dtype=torch.float16)
    hybrid = _hybrid(model, backend, eps=1e-3)  # fp16 AdamW needs an eps fp16 can hold
    if later:
        _stepped(hybrid)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # initializes the scale as a real forward would
    _set_grads(hybrid, 31, scale=8.0)
    _half_params(hybrid, half)[0].grad[0, 0] = float("inf")  # type: ignore[index]
    assert hybrid._step_supports_amp_scaling is True  # fp16 gradients
    before = _snapshot(hybrid)
    assert scaler.step(hybrid) is None
    _assert_unchanged(before, hybrid)
    assert not hasattr(hybrid, "found_inf")
    assert not hasattr(hybrid, "grad_scale")
    scaler.update()
    assert scaler.get_scale() == 4.0  # the scaler saw the overflow
    _trains(hybrid)


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("scale", [4.0, 8.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_scaled_step_equals_unscaled_step_bitwise(
    backend: str, scale: float, later: bool
) -> None:
    plain_model, scaled_model = _model(), _model()
    plain, scaled = _hybrid(plain_model, backend), _hybrid(scaled_model, backend)
    if later:
        _stepped(plain)
        _stepped(scaled)
    _set_grads(plain, 41)
    for p, q in zip(_params(plain), _params(scaled), strict=True):
        q.grad = p.grad * scale  # type: ignore[operator]
    scaled.grad_scale = torch.tensor(scale)
    scaled.found_inf = torch.tensor([0.0])
    plain.step()
    scaled.step()
    _clear_amp(scaled)
    for p, q in zip(_params(plain), _params(scaled), strict=True):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]  # unscaled, exactly once
    assert _counters(plain) == _counters(scaled)
    _assert_same_state(plain, scaled)


def _assert_same_state(a: GefenMuonHybrid, b: GefenMuonHybrid) -> None:
    for child_a, child_b in zip(a.children, b.children, strict=True):
        params_a = [p for g in child_a.param_groups for p in g["params"]]
        params_b = [p for g in child_b.param_groups for p in g["params"]]
        for p, q in zip(params_a, params_b, strict=True):
            entry_a, entry_b = child_a.state.get(p, {}), child_b.state.get(q, {})
            assert set(entry_a) == set(entry_b)
            for key, value in entry_a.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, entry_b[key]), key
                else:
                    assert value == entry_b[key], key
        codebook_a = getattr(child_a, "codebook", None)
        codebook_b = getattr(child_b, "codebook", None)
        assert (codebook_a is None) == (codebook_b is None)
        if codebook_a is not None:
            assert torch.equal(codebook_a, codebook_b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_grad_scaler_fp16_step_equals_unscaled_step(backend: str) -> None:
    plain_model, scaled_model = _model(dtype=torch.float16), _model(dtype=torch.float16)
    plain = _hybrid(plain_model, backend, eps=1e-3)
    scaled = _hybrid(scaled_model, backend, eps=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1000)
    for step in range(2):
        scaler.scale(torch.ones(()))
        _set_grads(plain, 60 + 10 * step)
        for p, q in zip(_params(plain), _params(scaled), strict=True):
            q.grad = p.grad * 8.0  # type: ignore[operator]
        assert scaled._step_supports_amp_scaling is True  # the hybrid unscales the union
        plain.step()
        scaler.step(scaled)
        scaler.update()
        assert scaler.get_scale() == 8.0
        for p, q in zip(_params(plain), _params(scaled), strict=True):
            assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
            assert torch.equal(p.detach(), q.detach())
    assert _counters(plain) == _counters(scaled) == (2, 2)
    _assert_same_state(plain, scaled)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_explicit_unscale_is_never_applied_twice(backend: str) -> None:
    # torch refuses scaler.unscale_ on fp16 gradients, so the one-process path where the
    # scaler already unscaled is driven through GradScaler's attributes: grad_scale None.
    plain, scaled = _hybrid(_model(), backend), _hybrid(_model(), backend)
    _stepped(plain)
    _stepped(scaled)
    _set_grads(plain, 61)
    _set_grads(scaled, 61)
    scaled.grad_scale = None
    scaled.found_inf = torch.tensor([0.0])
    plain.step()
    scaled.step()
    _clear_amp(scaled)
    for p, q in zip(_params(plain), _params(scaled), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        assert torch.equal(p.detach(), q.detach())
    _assert_same_state(plain, scaled)
    # A real GradScaler with an fp32 model: unscale_ through the union, then step.
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1000)
    scaler.scale(torch.ones(()))
    _set_grads(plain, 62)
    for p, q in zip(_params(plain), _params(scaled), strict=True):
        q.grad = p.grad * 8.0  # type: ignore[operator]
    scaler.unscale_(scaled)
    plain.step()
    scaler.step(scaled)
    scaler.update()
    for p, q in zip(_params(plain), _params(scaled), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        assert torch.equal(p.detach(), q.detach())
    _assert_same_state(plain, scaled)


def test_step_supports_amp_scaling_rule_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_collectives(monkeypatch)
    bf16 = _model(dtype=torch.bfloat16)
    hybrid = _hybrid(bf16, "gefen")
    assert hybrid.step_failure_scope() == ()
    assert hybrid._step_supports_amp_scaling is False  # no gradient at all
    _set_grads(hybrid, 3)
    assert hybrid._step_supports_amp_scaling is False  # BF16 AMP in an empty scope
    fp32 = _hybrid(_model(), "adamw")
    _set_grads(fp32, 3)
    assert fp32._step_supports_amp_scaling is False  # FP32-master AMP
    # One fp16 gradient in either half flips it.
    for half in ("muon", "backup"):
        mixed_model = _model()
        mixed = _hybrid(mixed_model, "gefen")
        _set_grads(mixed, 4)
        p = _half_params(mixed, half)[0]
        p.data = p.data.half()
        p.grad = p.grad.half()  # type: ignore[union-attr]
        assert mixed._step_supports_amp_scaling is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_grad_scaler_unscales_through_the_union_and_keeps_the_flag_false(
    backend: str,
) -> None:
    plain_model, scaled_model = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
    plain, scaled = _hybrid(plain_model, backend), _hybrid(scaled_model, backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1000)
    scaler.scale(torch.ones(()))
    _set_grads(plain, 70)
    for p, q in zip(_params(plain), _params(scaled), strict=True):
        q.grad = p.grad * 8.0  # type: ignore[operator]
    assert scaled._step_supports_amp_scaling is False
    plain.step()
    scaler.step(scaled)  # GradScaler unscales through the union param_groups itself
    scaler.update()
    for p, q in zip(_params(plain), _params(scaled), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        assert torch.equal(p.detach(), q.detach())
    # An overflow in one half: GradScaler skips step() on its own; nothing changes.
    scaler.scale(torch.ones(()))
    _set_grads(scaled, 80, scale=8.0)
    _half_params(scaled, "backup")[0].grad[0, 0] = float("inf")  # type: ignore[index]
    before = _snapshot(scaled)
    scaler.step(scaled)
    scaler.update()
    for role, child in (("muon", scaled.muon), ("backup", scaled.backup)):
        after = deep_snapshot(child, attributes=SNAPSHOT_ATTRIBUTES)
        changed = list(snapshot_diff(before.children[role], after))
        # GradScaler's own unscale_ multiplied the gradients; nothing else may differ.
        assert all(".grad:" in line for line in changed), changed
    assert _counters(scaled) == (1, 1)


@pytest.mark.parametrize("use_scaler", [False, True], ids=["attributes", "GradScaler"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_overflow_with_non_finite_backup_gradient_skips_both_without_error(
    backend: str, use_scaler: bool
) -> None:
    model = _model(dtype=torch.float16)
    hybrid = _hybrid(model, backend, eps=1e-3)
    _stepped(hybrid)
    _set_grads(hybrid, 91, scale=8.0)
    bad = _half_params(hybrid, "backup")[0]
    bad.grad[0, 0] = float("inf")  # type: ignore[index]
    bad.grad[1, 1] = float("nan")  # type: ignore[index]
    before = _snapshot(hybrid)
    if use_scaler:
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        scaler.scale(torch.ones(()))
        assert scaler.step(hybrid) is None
    else:
        hybrid.grad_scale = torch.tensor(8.0)
        hybrid.found_inf = torch.tensor([1.0])
        assert hybrid.step() is None  # no NonFiniteGradientError: the backup is told amp_present
        _clear_amp(hybrid)
    _assert_unchanged(before, hybrid)
    _trains(hybrid)


# --------------------------------------------------------------------------------------------
# Rank-local rejections in an empty scope (§7 steps 1–2)


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_backup_gradient_raises_locally_with_its_original_message(
    backend: str, later: bool
) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    if later:
        _stepped(hybrid)
    _set_grads(hybrid, 13)
    good = model.embed.weight.grad
    before = _snapshot(hybrid)
    model.embed.weight.grad = _grad(model.embed.weight, 14).to_sparse()
    assert hybrid.backup is not None
    with pytest.raises(RuntimeError) as original:
        validate_gradient_structure(
            hybrid.backup.param_groups, owner=type(hybrid.backup).__name__, require_2d=False
        )

    def restore() -> None:
        model.embed.weight.grad = good

    info = _rejects(
        hybrid,
        hybrid.step,
        RuntimeError,
        "sparse or non-strided gradient",
        restore=restore,
        before=before,
    )
    assert not isinstance(info.value, DistributedStepError)
    assert type(info.value) is type(original.value)
    assert str(info.value) == str(original.value)
    assert "'embed.weight'" in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
def test_nan_gradient_in_adamw_backup_raises_and_check_finite_false_skips(
    later: bool, value: float
) -> None:
    model = _model()
    hybrid = _hybrid(model, "adamw")
    if later:
        _stepped(hybrid)
    _set_grads(hybrid, 15)
    good = model.norm.weight.grad
    before = _snapshot(hybrid)
    model.norm.weight.grad = good.clone()  # type: ignore[union-attr]
    model.norm.weight.grad[3] = value

    def restore() -> None:
        model.norm.weight.grad = good

    info = _rejects(
        hybrid,
        hybrid.step,
        NonFiniteGradientError,
        "non-finite gradient",
        restore=restore,
        before=before,
    )
    assert "'norm.weight'" in str(info.value)
    assert not isinstance(info.value, DistributedStepError)
    # check_finite=False: the same gradient steps both children without a check.
    unchecked_model = _model()
    unchecked = _hybrid(unchecked_model, "adamw", check_finite=False)
    if later:
        _stepped(unchecked)
    _set_grads(unchecked, 15)
    unchecked_model.norm.weight.grad[3] = value  # type: ignore[index]
    counters = _counters(unchecked)
    unchecked.step()
    assert _counters(unchecked) == tuple(c + 1 for c in counters)


# --------------------------------------------------------------------------------------------
# Commit failures and the hybrid's latch (§7 "Failed-commit latch")


def _inject_backup_failure(
    hybrid: GefenMuonHybrid, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], None]:
    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected backup commit failure")

    if not isinstance(hybrid.backup, Gefen):  # AdamW's step is its class's, hooks unwrapped
        original = type(hybrid.backup).step
        monkeypatch.setattr(type(hybrid.backup), "step", failing)
        return lambda: monkeypatch.setattr(type(hybrid.backup), "step", original)
    monkeypatch.setattr(hybrid.backup, "_commit_step", failing)
    return lambda: monkeypatch.delattr(hybrid.backup, "_commit_step")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backup_commit_failure_latches_the_hybrid_until_a_load(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    _stepped(hybrid)
    saved = copy.deepcopy(hybrid.state_dict())
    saved_params = {name: p.detach().clone() for name, p in model.named_parameters()}
    remove = _inject_backup_failure(hybrid, monkeypatch)
    _set_grads(hybrid, 17)
    with pytest.raises(RuntimeError, match="injected backup commit failure"):
        hybrid.step()
    remove()
    assert hybrid._commit_failed
    # Not rolled back across the children (documented): the Muon child committed first.
    assert hybrid.muon is not None
    assert hybrid.muon.global_step == 2
    if backend == "gefen":
        assert hybrid.backup._commit_failed  # type: ignore[union-attr]
    _rejects(hybrid, hybrid.step, RuntimeError, LATCHED, check_training=False)
    hybrid.zero_grad()
    _rejects(hybrid, hybrid.step, RuntimeError, LATCHED, check_training=False)
    # A rejected load does not clear the latch.
    broken = copy.deepcopy(saved)
    broken["gefen_hybrid"]["backup_optimizer"] = "sgd"
    with pytest.raises(ValueError, match="GefenMuonHybrid checkpoint"):
        hybrid.load_state_dict(broken)
    _set_grads(hybrid, 18)
    _rejects(hybrid, hybrid.step, RuntimeError, LATCHED, check_training=False)
    # A successful hybrid load clears it (and the children's), then training continues.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(saved_params[name])
    hybrid.load_state_dict(saved)
    assert not hybrid._commit_failed
    assert all(not getattr(child, "_commit_failed", False) for child in hybrid.children)
    assert _counters(hybrid) == (1, 1)
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_muon_failure_before_the_backup_leaves_the_backup_untouched(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    hybrid = _hybrid(model, backend)
    _stepped(hybrid)
    saved = copy.deepcopy(hybrid.state_dict())
    assert hybrid.muon is not None
    assert hybrid.backup is not None

    def failing(plan: Any) -> None:
        raise MemoryError("injected muon commit failure")

    monkeypatch.setattr(hybrid.muon, "_commit_step", failing)
    _set_grads(hybrid, 19)
    backup_before = deep_snapshot(hybrid.backup, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(MemoryError, match="injected muon commit failure"):
        hybrid.step()
    assert_unchanged(backup_before, deep_snapshot(hybrid.backup, attributes=SNAPSHOT_ATTRIBUTES))
    assert hybrid._commit_failed
    assert hybrid.muon._commit_failed
    monkeypatch.delattr(hybrid.muon, "_commit_step")
    _rejects(hybrid, hybrid.step, RuntimeError, LATCHED, check_training=False)
    hybrid.load_state_dict(saved)
    assert not hybrid._commit_failed
    assert not hybrid.muon._commit_failed
    _trains(hybrid)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failure_in_the_first_childs_planning_changes_nothing_and_does_not_latch(
    backend: str, error: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phase 4 writes nothing: the hybrid used to latch anyway ("previous step failed during
    commit"), though a standalone Gefen or GefenMuon stays trainable at the same point."""
    model = _model()
    hybrid = _hybrid(model, backend)
    _stepped(hybrid)
    assert hybrid.muon is not None

    def failing(*args: Any) -> None:
        raise error("injected planning failure")

    monkeypatch.setattr(hybrid.muon, "_prepare_step", failing)
    _set_grads(hybrid, 21)
    _rejects(hybrid, hybrid.step, error, "injected planning failure", check_training=False)
    assert not hybrid._commit_failed
    monkeypatch.delattr(hybrid.muon, "_prepare_step")
    _trains(hybrid)


@pytest.mark.parametrize("backend", ["gefen"])
def test_a_planning_failure_after_muon_committed_latches(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Muon child is written by then: half a step, which only a load undoes."""
    model = _model()
    hybrid = _hybrid(model, backend)
    _stepped(hybrid)

    def failing(*args: Any) -> None:
        raise RuntimeError("injected backup planning failure")

    monkeypatch.setattr(hybrid.backup, "_prepare_step", failing)
    _set_grads(hybrid, 22)
    with pytest.raises(RuntimeError, match="injected backup planning failure"):
        hybrid.step()
    assert hybrid._commit_failed


# --------------------------------------------------------------------------------------------
# Partial hybrids, training, and no collectives


@pytest.mark.parametrize("which", ["muon-only", "backup-only"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_muon_only_and_backup_only_hybrids_step(backend: str, which: str) -> None:
    model = _model()
    named = list(model.named_parameters())
    muon_pairs = [(n, p) for n, p in named if n in MUON_NAMES]
    backup_pairs = [(n, p) for n, p in named if n not in MUON_NAMES]
    if which == "muon-only":
        hybrid = GefenMuonHybrid(
            muon_pairs, [], lr=1e-2, backup_optimizer=backend, ns_steps=1, fused=False
        )
        assert hybrid.backup is None
        assert hybrid.muon is not None
    else:
        hybrid = GefenMuonHybrid(
            [], backup_pairs, lr=1e-2, backup_optimizer=backend, ns_steps=1, fused=False
        )
        assert hybrid.muon is None
        assert hybrid.backup is not None
    assert len(hybrid.children) == 1
    for step in range(3):
        _trains(hybrid, seed=200 + 10 * step)
    assert _counters(hybrid) == (3,)
    hybrid.zero_grad()
    hybrid.step()  # a gradient-free step is accepted
    for p in _params(hybrid):
        assert p.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_hybrid_trains(backend: str) -> None:
    model = _model(seed=3)
    hybrid = _hybrid(model, backend, lr=2e-2)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 16, (8, 12), generator=generator)
    targets = torch.roll(tokens, shifts=-1, dims=1)

    def closure() -> torch.Tensor:
        hybrid.zero_grad()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss

    losses = [float(hybrid.step(closure).detach()) for _ in range(40)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses
    assert _counters(hybrid) == (40, 40)


def _forbid_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_collectives(monkeypatch, "a one-process hybrid")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_collective_is_ever_entered_in_one_process(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_collectives(monkeypatch)
    model = _model()
    hybrid = _hybrid(model, backend)
    assert hybrid.step_failure_scope() == ()
    hybrid.step()  # no gradients
    _stepped(hybrid, steps=2)
    assert hybrid._step_supports_amp_scaling is False
    # An AMP step, a skipped AMP step and a rejected step.
    _set_grads(hybrid, 5, scale=4.0)
    hybrid.grad_scale, hybrid.found_inf = torch.tensor(4.0), torch.tensor([0.0])
    hybrid.step()
    _set_grads(hybrid, 6, scale=4.0)
    hybrid.found_inf = torch.tensor([1.0])
    hybrid.step()
    _clear_amp(hybrid)
    _set_grads(hybrid, 7)
    model.lm_head.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    with pytest.raises(NonFiniteGradientError):
        hybrid.step()
    # Checkpoints.
    saved = hybrid.state_dict()
    hybrid.load_state_dict(saved)
    _trains(hybrid)


# --------------------------------------------------------------------------------------------
# The AdamW backup's options and state are checked in the voted preflight


BAD_ADAMW_OPTIONS = [
    ("betas", (1.0, 0.999), "betas[0] must be in [0, 1)"),
    ("betas", (0.9, 0.999, 0.5), "betas must be a pair"),
    ("lr", [1e-3, 2e-3], "lr must be a real number"),
    ("lr", "1e-3", "lr must be a real number"),
    ("lr", torch.tensor([1e-3, 2e-3]), "lr must be a real number or a 1-element real tensor"),
    ("lr", float("nan"), "lr must be finite and >= 0"),
    ("lr", float("inf"), "lr must be finite and >= 0"),
    ("lr", -1e-3, "lr must be finite and >= 0"),
    ("lr", torch.tensor(float("nan")), "lr must be finite and >= 0"),
    ("weight_decay", float("nan"), "weight_decay must be finite and >= 0"),
    ("eps", 0.0, "eps must be finite and > 0"),
    ("eps", -1e-8, "eps must be finite and > 0"),
    # These failed inside the backup's commit, after the Muon half was written: a (1, 1) eps
    # cannot broadcast a bias's in-place update, a meta tensor holds no value.
    (
        "eps",
        torch.tensor([[1e-8]]),
        "eps may have at most 1 dimensions (torch's single-tensor AdamW",
    ),
    ("lr", torch.tensor(1e-3, device="meta"), "lr is a meta tensor, which holds no value"),
    ("weight_decay", torch.tensor(0.0, device="meta"), "weight_decay is a meta tensor"),
]


@pytest.mark.parametrize(("key", "value", "fragment"), BAD_ADAMW_OPTIONS)
@pytest.mark.parametrize("later", [False, True])
def test_a_bad_adamw_backup_option_fails_before_either_half_changes(
    key: str, value: object, fragment: str, later: bool
) -> None:
    hybrid = _hybrid(_model(), "adamw")
    if later:
        _stepped(hybrid)
    _set_grads(hybrid, 31)
    info = _rejects_backup_edit(hybrid, key, value, fragment)
    assert "GefenMuonHybrid: AdamW backup group 0" in str(info.value)


def _rejects_backup_edit(
    hybrid: GefenMuonHybrid, key: str, value: object, fragment: str
) -> pytest.ExceptionInfo[Any]:
    """The AdamW backup's group 0 edited to ``key=value``: the step refuses it, nothing
    changes, and the hybrid trains once the edit is undone."""
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    before = _snapshot(hybrid)
    good = group[key]
    group[key] = value

    def restore() -> None:
        group[key] = good

    return _rejects(hybrid, hybrid.step, ValueError, fragment, restore=restore, before=before)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("eps", torch.tensor([1e-8]), "eps may have at most 0 dimensions (torch's for-each"),
        ("weight_decay", torch.tensor([0.1]), "weight_decay may have at most 0 dimensions"),
        ("betas", (torch.tensor(0.9), torch.tensor(0.99)), "tensor betas with foreach need"),
        ("fused", True, "eps may have at most 0 dimensions (torch's fused AdamW step)"),
    ],
)
def test_an_adamw_backup_refuses_what_its_for_each_step_cannot_take(
    key: str, value: object, fragment: str
) -> None:
    # torch's for-each AdamW raised these inside the backup's commit, after the Muon half.
    hybrid = _hybrid(_model(), "adamw")
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    group["foreach"] = key != "fused"
    if key == "fused":  # the fused step takes no 1-D eps either
        group["eps"] = torch.tensor([1e-8])
    _set_grads(hybrid, 33)
    _rejects_backup_edit(hybrid, key, value, fragment)


def test_an_adamw_backup_takes_the_tensor_shapes_torch_squeezes() -> None:
    # torch's AdamW squeezes lr and the betas: a (1, 1) tensor steps there, and here too.
    hybrid = _hybrid(_model(), "adamw")
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    group["lr"] = torch.tensor([[1e-3]])
    group["betas"] = (torch.tensor([[0.9]]), 0.999)
    _stepped(hybrid)
    group["lr"], group["betas"] = 1e-3, (0.9, 0.999)
    group["foreach"], group["weight_decay"] = True, torch.tensor([0.0])  # a zero decay: skipped
    _stepped(hybrid)
    # A (1, 1) eps broadcasts onto matrices: torch's single-tensor step takes it for a group
    # of matrices (an embedding), and the hybrid refused it.
    embedding, hidden = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(6, 6))
    matrices = GefenMuonHybrid(
        [
            {"params": [hidden], "use_muon": True},
            {"params": [embedding], "use_muon": False, "eps": torch.full((1, 1), 1e-8)},
        ],
        backup_optimizer="adamw",
        backup_adamw_kwargs={"foreach": False},
    )
    hidden.grad, embedding.grad = torch.randn(6, 6), torch.ones(4, 3)
    before = embedding.detach().clone()
    matrices.step()
    assert not torch.equal(before, embedding)


@pytest.mark.parametrize("key", ["lr", "betas", "eps", "weight_decay"])
def test_a_deleted_adamw_backup_option_is_named_missing(key: str) -> None:
    """It read as the wrong cause ("lr must be a real number, got NoneType")."""
    hybrid = _hybrid(_model(), "adamw")
    _stepped(hybrid)
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    _set_grads(hybrid, 32)
    before = _snapshot(hybrid)
    good = list(group.items())
    del group[key]

    def restore() -> None:  # in the group's own key order
        group.clear()
        group.update(good)

    fragment = f"AdamW backup group 0: the option '{key}' is missing"
    _rejects(
        hybrid,
        hybrid.step,
        ValueError,
        fragment,
        restore=restore,
        before=before,
    )


@pytest.mark.parametrize(
    ("edits", "fragment"),
    [
        ({"differentiable": True}, "differentiable=True is not supported"),
        ({"foreach": True, "lr": torch.tensor(1e-3)}, "a tensor lr with foreach=True needs"),
        ({"maximize": True}, "maximize=True is not supported"),
    ],
    ids=["differentiable", "foreach-tensor-lr", "maximize"],
)
@pytest.mark.parametrize("later", [False, True])
def test_adamw_options_its_step_refuses_together_fail_before_either_half_changes(
    edits: dict[str, object], fragment: str, later: bool
) -> None:
    """torch's AdamW refuses these inside its step, after the Muon child had committed: a
    half-applied step and a latched hybrid. The preflight now refuses them first."""
    hybrid = _hybrid(_model(), "adamw")
    if later:
        _stepped(hybrid)
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    _set_grads(hybrid, 33)
    before = _snapshot(hybrid)
    good = {key: group[key] for key in edits}
    group.update(edits)
    _rejects(
        hybrid, hybrid.step, ValueError, fragment, restore=lambda: group.update(good), before=before
    )


def test_a_differentiable_adamw_backup_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="AdamW backup group 0: differentiable=True is not"):
        _hybrid(_model(), "adamw", backup_adamw_kwargs={"differentiable": True})


def test_a_maximizing_adamw_backup_is_refused_at_construction() -> None:
    # It was taken: the AdamW half climbed the loss while the Muon half descended it (a Gefen
    # backup and a flagless group already refused maximize=True).
    with pytest.raises(ValueError, match="AdamW backup group 0: maximize=True is not supported"):
        _hybrid(_model(), "adamw", backup_adamw_kwargs={"maximize": True})


def test_an_adamw_moment_of_another_shape_fails_before_either_half_changes() -> None:
    hybrid = _hybrid(_model(), "adamw")
    _stepped(hybrid)
    assert hybrid.backup is not None
    param = hybrid.backup.param_groups[0]["params"][0]
    entry = hybrid.backup.state[param]
    good = entry["exp_avg"]
    _set_grads(hybrid, 32)
    before = _snapshot(hybrid)
    entry["exp_avg"] = torch.zeros(good.numel() + 1)  # e.g. the parameter was reshaped

    def restore() -> None:
        entry["exp_avg"] = good

    _rejects(
        hybrid, hybrid.step, RuntimeError, "state does not match parameter (exp_avg has shape",
        restore=restore, before=before,
    )  # fmt: skip


def _corrupt_exp_avg_dtype(entry: dict[str, Any]) -> None:
    entry["exp_avg"] = entry["exp_avg"].double()  # e.g. the model was moved with .to() after


def _drop_step(entry: dict[str, Any]) -> None:
    del entry["step"]


@pytest.mark.parametrize(
    ("corrupt", "fragment"),
    [
        (_corrupt_exp_avg_dtype, "exp_avg is torch.float64 on cpu, the parameter torch.float32"),
        (_drop_step, "state lacks step"),
        (None, "state lacks max_exp_avg_sq"),  # amsgrad switched on once state exists
    ],
)
def test_an_adamw_state_its_step_cannot_read_fails_before_either_half_changes(
    corrupt: Callable[[dict[str, Any]], None] | None, fragment: str
) -> None:
    # Before the fix these failed inside AdamW's commit, after the Muon half was written.
    hybrid = _hybrid(_model(), "adamw")
    _stepped(hybrid)
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    entry = hybrid.backup.state[group["params"][0]]
    good = dict(entry)
    _set_grads(hybrid, 33)
    before = _snapshot(hybrid)
    if corrupt is None:
        group["amsgrad"] = True
    else:
        corrupt(entry)

    def restore() -> None:
        group["amsgrad"] = False
        entry.clear()
        entry.update(good)

    _rejects(hybrid, hybrid.step, RuntimeError, fragment, restore=restore, before=before)
