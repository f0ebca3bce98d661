"""torch.optim conformance (docs/quality.md "torch optimizer conformance"; §12 #57)."""

from __future__ import annotations

import copy
import pickle
from collections import Counter

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from gefen.core import Gefen
from gefen.core.shell import OptimizerShell


def _regression(optimizer_factory, scheduler: bool) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(128, 10)
    y = x @ torch.randn(10, 1)
    optimizer = optimizer_factory(model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 60) if scheduler else None
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("scheduler", [False, True])
def test_loss_decreases(scheduler: bool) -> None:
    losses = _regression(lambda p: Gefen(p, lr=0.01), scheduler)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("nesterov", [False, True])
def test_per_group_lr_and_weight_decay(nesterov: bool) -> None:
    a, b, c = (torch.nn.Parameter(torch.ones(4, 4)) for _ in range(3))
    optimizer = Gefen(
        [
            {"params": [a], "lr": 0.1},
            {"params": [b], "lr": 0.0},
            {"params": [c], "lr": 0.1, "weight_decay": 1.0},
        ],
        nesterov=nesterov,
    )
    for p in (a, b, c):
        p.grad = torch.ones(4, 4)
    optimizer.step()
    # the first step moves lr·g/|g|, and (1 + β1) times that with the look-ahead
    move = 0.1 * (1.9 if nesterov else 1.0)
    assert torch.equal(b, torch.ones(4, 4))  # lr 0 group unchanged
    assert float(a.detach().mean()) == pytest.approx(1 - move, abs=1e-3)
    assert float(c.detach().mean()) == pytest.approx(1 * (1 - 0.1) - move, abs=1e-3)


def test_zero_grads_with_zero_weight_decay_leave_params_unchanged() -> None:
    a = torch.nn.Parameter(torch.randn(6, 6))
    optimizer = Gefen([a])
    a.grad = torch.randn(6, 6)
    optimizer.step()
    before = a.detach().clone()
    optimizer.zero_grad()
    optimizer.step()  # no grads: nothing moves, the step still counts
    assert torch.equal(a, before)
    assert optimizer.global_step == 2
    state = optimizer.state[a]["step"]
    a.grad = torch.zeros(6, 6)
    for _ in range(3):
        optimizer.step()
    assert optimizer.state[a]["step"] == state + 3
    # zero gradients with wd=0 keep a decaying momentum, so only the very first moment is static:
    fresh = torch.nn.Parameter(torch.randn(5))
    zero_only = Gefen([torch.nn.Parameter(torch.randn(3)), fresh])
    zero_only.param_groups[0]["params"][0].grad = torch.ones(3)
    zero_only.step()
    fresh.grad = torch.zeros(5)
    before_fresh = fresh.detach().clone()
    zero_only.step()
    assert torch.equal(fresh, before_fresh)


def test_state_dict_roundtrip_lockstep_and_weights_only(tmp_path) -> None:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 8))
    optimizer = Gefen([a], lr=0.01)
    for _ in range(3):
        a.grad = torch.randn(8, 8)
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    twin_param = torch.nn.Parameter(a.detach().clone())
    twin = Gefen([twin_param], lr=0.01)
    twin.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for _ in range(3):
        grad = torch.randn(8, 8)
        a.grad, twin_param.grad = grad.clone(), grad.clone()
        optimizer.step()
        twin.step()
        assert torch.equal(a, twin_param)


def test_hooks_fire_in_torch_order() -> None:
    a = torch.nn.Parameter(torch.randn(4))
    optimizer = Gefen([a])
    order: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: order.append("global pre")),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: order.append("global post")),
    ]
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: order.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: order.append("post"))
    optimizer.register_state_dict_pre_hook(lambda opt: order.append("sd pre"))
    optimizer.register_state_dict_post_hook(lambda opt, sd: order.append("sd post"))
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: order.append("load pre"))
    optimizer.register_load_state_dict_post_hook(lambda opt: order.append("load post"))
    try:
        a.grad = torch.ones(4)
        optimizer.step()
        optimizer.load_state_dict(optimizer.state_dict())
    finally:
        for handle in handles:
            handle.remove()
    assert order == [
        "global pre",
        "pre",
        "post",
        "global post",
        "sd pre",
        "sd post",
        "load pre",
        "load post",
    ]


def test_post_hooks_skip_on_raise_and_pre_hook_can_replace_args() -> None:
    a = torch.nn.Parameter(torch.randn(4))
    optimizer = Gefen([a])
    fired: list[str] = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: fired.append("post"))
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: ((opt,), {"closure": lambda: 7.0}))
    a.grad = torch.ones(4)
    assert optimizer.step() == 7.0
    a.grad = torch.full((4,), float("nan"))
    with pytest.raises(RuntimeError):
        optimizer.step()
    assert fired == ["post"]


def test_deepcopy_hooks_fire_once_per_step_with_scheduler() -> None:
    a = torch.nn.Parameter(torch.randn(4))
    optimizer = Gefen([a], lr=0.1)
    counts = {"pre": 0, "post": 0}
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: counts.__setitem__("pre", counts["pre"] + 1)
    )
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: counts.__setitem__("post", counts["post"] + 1)
    )
    torch.optim.lr_scheduler.StepLR(optimizer, 2)
    copies = [copy.deepcopy(optimizer)]
    copies.append(copy.deepcopy(copies[0]))
    assert "step" not in copies[0].__dict__  # the scheduler's instance-level wrapper is not copied
    a.grad = torch.ones(4)
    optimizer.step()
    assert counts == {"pre": 1, "post": 1}
    copy_param = copies[1].param_groups[0]["params"][0]
    copy_param.grad = torch.ones(4)
    before = a.detach().clone()
    copies[1].step()
    assert counts == {"pre": 2, "post": 2}
    assert torch.equal(a, before)
    assert copies[1].global_step == 1
    assert len(copies[1].defaults) == 15


def test_load_state_dict_by_keyword() -> None:
    a = torch.nn.Parameter(torch.randn(4))
    optimizer = Gefen([a])
    a.grad = torch.ones(4)
    optimizer.step()
    other = Gefen([torch.nn.Parameter(a.detach().clone())])
    other.load_state_dict(state_dict=optimizer.state_dict())
    assert other.global_step == 1


def test_add_param_group_after_training_starts() -> None:
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(16))
    optimizer = Gefen([a])
    a.grad = torch.randn(8)
    optimizer.step()
    codebook = optimizer.codebook
    optimizer.add_param_group({"params": [b], "lr": 0.01})
    assert optimizer.state[b] == {"period": 0}
    b.grad = torch.randn(16)
    optimizer.step()
    assert optimizer.codebook is codebook
    assert optimizer.state[b]["step"] == 1


def test_named_and_unnamed_state_dicts_load_into_each_other() -> None:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 4))
    named = Gefen([("layer.weight", a)])
    a.grad = torch.randn(6, 4)
    named.step()
    unnamed = Gefen([torch.nn.Parameter(a.detach().clone())])
    unnamed.load_state_dict(named.state_dict())
    assert unnamed.param_groups[0]["param_names"] == ["layer.weight"]
    assert unnamed.global_step == 1
    other = Gefen([("layer.weight", torch.nn.Parameter(a.detach().clone()))])
    sd = Gefen([torch.nn.Parameter(a.detach().clone())]).state_dict()
    other.load_state_dict(sd)
    assert other.param_groups[0]["param_names"] == ["layer.weight"]


# -- step.hooked and __init_subclass__ ------------------------------------------------------------

_FIRED: Counter[str] = Counter()


def _count_pre(optimizer, args, kwargs) -> None:
    # Module level, so an optimizer holding it still pickles.
    _FIRED["pre"] += 1


def _count_post(optimizer, args, kwargs) -> None:
    _FIRED["post"] += 1


class _PicklableSubclass(Gefen):
    # Module level: pickle finds a class by its qualified name, which a local class lacks.
    def step(self, closure=None):
        return super().step(closure)


def _subclasses() -> tuple[type[Gefen], type[Gefen], type[Gefen]]:
    """Fresh classes per test: torch patches ``step`` on the class, so a leak would persist."""

    class Overriding(Gefen):
        def step(self, closure=None):
            self.own_calls = getattr(self, "own_calls", 0) + 1
            return super().step(closure)

    class Inheriting(Gefen):
        pass

    class Deeper(Overriding):
        def step(self, closure=None):
            return super().step(closure)

    return Overriding, Inheriting, Deeper


def test_step_is_marked_hooked_for_gefen_and_subclasses() -> None:
    assert OptimizerShell.step.hooked is True
    assert Gefen.step.hooked is True
    assert "step" not in Gefen.__dict__
    for cls in _subclasses():
        defined = cls.__dict__.get("step")
        assert cls.step.hooked is True
        cls([torch.nn.Parameter(torch.randn(4))])
        # torch's _patch_step_function replaces an unmarked class `step` with its wrapper.
        assert cls.__dict__.get("step") is defined
    Gefen([torch.nn.Parameter(torch.randn(4))])
    assert "step" not in Gefen.__dict__


@pytest.mark.parametrize("which", ["Gefen", "Overriding", "Inheriting", "Deeper"])
def test_step_hooks_fire_exactly_once_per_step(which: str) -> None:
    classes = {cls.__name__: cls for cls in _subclasses()}
    cls = Gefen if which == "Gefen" else classes[which]
    a = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = cls([a], lr=0.01)
    counts: Counter[str] = Counter()
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: counts.update(["pre"]))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: counts.update(["post"]))
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: counts.update(["global pre"])),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: counts.update(["global post"])),
    ]
    try:
        for step in range(1, 4):
            a.grad = torch.randn(6, 4)
            optimizer.step()
            assert counts == {"pre": step, "post": step, "global pre": step, "global post": step}
    finally:
        for handle in handles:
            handle.remove()
    assert optimizer.global_step == 3
    if which in ("Overriding", "Deeper"):
        assert optimizer.own_calls == 3


@pytest.mark.parametrize("copier", ["pickle", "deepcopy"])
@pytest.mark.parametrize("which", ["Gefen", "subclass"])
def test_copies_carry_no_instance_step_and_hooks_fire_once(copier: str, which: str) -> None:
    cls = Gefen if which == "Gefen" else _PicklableSubclass
    a = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = cls([a], lr=0.1)
    optimizer.register_step_pre_hook(_count_pre)
    optimizer.register_step_post_hook(_count_post)
    torch.optim.lr_scheduler.StepLR(optimizer, 2)
    assert "step" in optimizer.__dict__  # the scheduler's instance-level wrapper
    a.grad = torch.randn(6, 4)
    optimizer.step()
    clone = (
        pickle.loads(pickle.dumps(optimizer)) if copier == "pickle" else copy.deepcopy(optimizer)
    )
    assert "step" not in clone.__dict__
    assert type(clone) is cls
    clone_param = clone.param_groups[0]["params"][0]
    assert clone_param is not a
    assert clone.state[clone_param]["step"] == 1
    _FIRED.clear()
    clone_param.grad = torch.randn(6, 4)
    before = a.detach().clone()
    clone_before = clone_param.detach().clone()
    clone.step()
    assert _FIRED == {"pre": 1, "post": 1}
    assert clone.global_step == 2
    assert torch.equal(a, before)
    assert not torch.equal(clone_param, clone_before)


def test_step_hooks_see_the_call_as_made() -> None:
    """torch's step wrapper passes (args, kwargs) as called; the shell does the same."""
    import inspect

    weight = torch.nn.Parameter(torch.randn(4, 6))
    optimizer = Gefen([weight], lr=0.1)
    calls: list[tuple[int, tuple[str, ...]]] = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: calls.append((len(args), tuple(kwargs)))
    )
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: calls.append((len(args), tuple(kwargs)))
    )
    weight.grad = torch.randn(4, 6)
    assert optimizer.step(closure=lambda: 2.0) == 2.0
    weight.grad = torch.randn(4, 6)
    assert optimizer.step(lambda: 3.0) == 3.0
    weight.grad = torch.randn(4, 6)
    assert optimizer.step() is None
    assert calls == [(1, ("closure",)), (1, ("closure",)), (2, ()), (2, ()), (1, ()), (1, ())]
    assert str(inspect.signature(Gefen.step)) == "(self, closure=None)"


def test_step_rejects_a_call_torch_would_reject_before_anything_runs() -> None:
    weight = torch.nn.Parameter(torch.randn(4, 6))
    optimizer = Gefen([weight], lr=0.1)
    weight.grad = torch.randn(4, 6)
    fired: list[int] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: fired.append(1))
    before = weight.detach().clone()
    for args, kwargs in (((None, None), {}), ((), {"closure": None, "other": 1})):
        with pytest.raises(TypeError):
            optimizer.step(*args, **kwargs)
    assert fired == []
    assert torch.equal(weight.detach(), before)
    assert optimizer.global_step == 0
    optimizer.step()
    assert optimizer.global_step == 1
