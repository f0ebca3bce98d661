"""The steady-state fast path (``gefen.core.steady``): a step whose inputs did not change skips
the structural checks and reuses its plan, and every change a check reads is still noticed.

Each case trains a few steps into the steady state, changes one thing, and asserts the next
step behaves exactly as the full path would: it is rejected (by name, nothing changed) or it
trains with the new value, bit-identical to a twin that never takes the fast path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gefen.core.shell as shell_module
from gefen.core import Gefen
from gefen.core.steady import step_token

SHAPES = ((16, 8), (32,))


def _model(seed: int = 0, **options: Any) -> tuple[Gefen, list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    return Gefen(params, lr=1e-2, **options), params


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _train(
    optimizer: Gefen, params: list[torch.nn.Parameter], steps: range, between: Callable[[int], None]
) -> None:
    for step in steps:
        between(step)
        _grads(params, step)
        optimizer.step()


def _never_steady(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell_module, "step_token", lambda *args: None)


def _schedule(optimizer: Gefen) -> Callable[[int], None]:
    def change(step: int) -> None:
        if step == 4:
            optimizer.param_groups[0]["lr"] = 3e-3  # a scheduler's float write
        if step == 6:
            optimizer.param_groups[0]["weight_decay"] = 0.05
        if step == 8:
            optimizer.param_groups[0]["betas"] = (0.8, 0.99)

    return change


@pytest.mark.parametrize("factored", [True, False])
def test_the_fast_path_trains_bit_identically_to_the_full_path(
    factored: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, fast_params = _model(factored_v_2d=factored)
    _train(fast, fast_params, range(10), _schedule(fast))
    assert fast.__dict__["_steady"] is not None  # the fast path was taken
    slow, slow_params = _model(factored_v_2d=factored)
    _never_steady(monkeypatch)
    _train(slow, slow_params, range(10), _schedule(slow))
    for a, b in zip(fast_params, slow_params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fast_params, slow_params, strict=True):
        for key, value in fast.state[a].items():
            other = slow.state[b][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def test_a_tensor_lr_written_in_place_is_read_on_the_next_step() -> None:
    optimizer, params = _model()
    optimizer.param_groups[0]["lr"] = torch.tensor(1e-2)
    _train(optimizer, params, range(4), lambda step: None)
    optimizer.param_groups[0]["lr"].fill_(0.0)  # lr 0: the parameters must not move
    before = [param.detach().clone() for param in params]
    _grads(params, 99)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda opt, ps: opt.param_groups[0].__setitem__("eps", -1.0), ValueError, "eps"),
        (
            lambda opt, ps: opt.param_groups[0].__setitem__("lr", float("nan")),
            ValueError,
            "learning rate",
        ),
        (lambda opt, ps: opt.param_groups[0].__setitem__("betas", (1.0, 0.9)), ValueError, "beta"),
        (
            lambda opt, ps: setattr(ps[0], "data", ps[0].data.t().contiguous()),
            RuntimeError,
            "gradient shape",
        ),
        (
            lambda opt, ps: setattr(ps[1], "data", ps[1].data.double()),
            RuntimeError,
            "gradient dtype",
        ),
        (
            lambda opt, ps: opt.state[ps[0]].__setitem__(
                "v_row", torch.zeros(3, dtype=torch.float32)
            ),
            RuntimeError,
            "state does not match parameter",
        ),
    ],
    ids=["eps", "nan-lr", "betas", "grad-shape", "grad-dtype", "entry-tensor"],
)
def test_a_change_between_steady_steps_is_rejected_before_anything_changes(
    change: Callable[[Gefen, list[torch.nn.Parameter]], None],
    error: type[Exception],
    message: str,
    rejects: Any,
) -> None:
    optimizer, params = _model()
    _train(optimizer, params, range(4), lambda step: None)
    assert optimizer.__dict__["_steady"] is not None
    _grads(params, 50)
    saved = {
        "eps": optimizer.param_groups[0]["eps"],
        "lr": optimizer.param_groups[0]["lr"],
        "betas": optimizer.param_groups[0]["betas"],
        "grads": [param.grad for param in params],
        "data": [param.data for param in params],
        "v_row": optimizer.state[params[0]].get("v_row"),
    }
    change(optimizer, params)

    def restore() -> None:
        optimizer.param_groups[0]["eps"] = saved["eps"]
        optimizer.param_groups[0]["lr"] = saved["lr"]
        optimizer.param_groups[0]["betas"] = saved["betas"]
        for param, grad, data in zip(params, saved["grads"], saved["data"], strict=True):
            param.data = data
            param.grad = grad
        optimizer.state[params[0]]["v_row"] = saved["v_row"]

    rejects(optimizer, optimizer.step, error, message, restore=restore)


def test_a_list_option_edited_in_place_is_checked_again(rejects: Any) -> None:
    """``group["betas"][1] = nan`` edits the list the last check saw: the options token held
    the list itself, so it still compared equal, the step skipped the check and wrote NaN."""
    optimizer, params = _model()
    betas = [0.9, 0.999]
    optimizer.param_groups[0]["betas"] = betas
    _train(optimizer, params, range(3), lambda step: None)
    betas[1] = float("nan")
    _grads(params, 52)
    rejects(
        optimizer, optimizer.step, ValueError, "beta", restore=lambda: betas.__setitem__(1, 0.999)
    )


_MISSING = object()


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("step", 0, "'step' must be an int >= 1, got 0"),  # a torch-style warm restart
        ("step", -1, "'step' must be an int >= 1, got -1"),
        ("step", 2.5, "'step' must be an int >= 1, got 2.5"),
        ("v_step", 100, "'v_step' must be an int with 0 <= v_step <= step, got 100"),
        ("v_step", -1, "'v_step' must be an int with 0 <= v_step <= step, got -1"),
        ("v_step", _MISSING, "missing key 'v_step'"),
    ],
)
def test_an_edited_counter_is_refused_by_name_before_anything_changes(
    fused: bool, key: str, value: object, message: str, rejects: Any
) -> None:
    """The step token and the entry match leave the counters' values out (the commit advances
    them), so an edit between steady steps was taken: silently by the native kernel (a state
    its own load refuses), or as an error from inside the eager commit, latched."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
    optimizer = Gefen(params, lr=1e-2, fused=fused)
    _train(optimizer, params, range(3), lambda step: None)
    entry = optimizer.state[params[0]]
    good = entry[key]
    if value is _MISSING:
        del entry[key]
    else:
        entry[key] = value
    _grads(params, 51)

    def restore() -> None:
        entry[key] = good

    full = f"parameter param_groups[0][0]: state does not match parameter (entry: {message}"
    rejects(optimizer, optimizer.state_dict, RuntimeError, full, check_training=False)
    rejects(optimizer, optimizer.step, RuntimeError, full, restore=restore)


def _expanded(value: torch.Tensor) -> torch.Tensor:
    return value[:1].clone().expand_as(value)


def _transposed(value: torch.Tensor) -> torch.Tensor:
    return value.t().contiguous().t()  # equal values, column-major strides


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("layout", [_expanded, _transposed], ids=["expanded", "transposed"])
def test_state_put_in_with_other_strides_is_refused_before_anything_changes(
    fused: bool, layout: Any, rejects: Any
) -> None:
    """The native kernels read state through ``data_ptr()`` as row-major: an ``expand()``ed
    tensor put into the state was written out of bounds (a crash or a hang on large
    parameters), a transposed one was read out of order (a silently wrong update)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
    optimizer = Gefen(params, lr=1e-2, fused=fused)
    _train(optimizer, params, range(3), lambda step: None)
    entry = optimizer.state[params[0]]
    good = entry["momentum_codes"]
    entry["momentum_codes"] = layout(good)
    _grads(params, 53)

    def restore() -> None:
        entry["momentum_codes"] = good

    full = "parameter param_groups[0][0]: state does not match parameter (entry: "
    rule = full + "'momentum_codes' must be contiguous"
    rejects(optimizer, optimizer.step, RuntimeError, rule, restore=restore)


def test_a_checkpoint_with_column_major_state_loads_row_major() -> None:
    """A file may hold state with any dense strides: the load copies it row-major, so the
    native kernel resumes exactly as from the row-major file."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
    optimizer = Gefen(params, lr=1e-2, fused=True)
    _train(optimizer, params, range(3), lambda step: None)
    saved = optimizer.state_dict()
    permuted = copy.deepcopy(saved)
    for entry in permuted["state"].values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and min(value.shape) > 1:
                entry[key] = _transposed(value)
    assert not permuted["state"][0]["momentum_codes"].is_contiguous()
    runs = []
    for state_dict in (saved, permuted):
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        twin = Gefen(twins, lr=1e-2, fused=True)
        twin.load_state_dict(state_dict)
        assert all(v.is_contiguous() for v in twin.state[twins[0]].values() if torch.is_tensor(v))
        _train(twin, twins, range(3, 5), lambda step: None)
        runs.append([p.detach().clone() for p in twins])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_new_group_and_a_replaced_parameter_take_the_full_path() -> None:
    optimizer, params = _model()
    _train(optimizer, params, range(4), lambda step: None)
    token = optimizer.__dict__["_steady"]
    extra = torch.nn.Parameter(torch.randn(4, 4))
    optimizer.add_param_group({"params": [extra]})
    extra.grad = torch.randn(4, 4)
    _grads(params, 60)
    optimizer.step()
    assert optimizer.__dict__["_steady"] is not token
    assert optimizer.state[extra]["step"] == 1  # the new parameter trained
    replacement = torch.nn.Parameter(torch.randn(32))
    optimizer.param_groups[0]["params"][1] = replacement
    replacement.grad = torch.randn(32)
    _grads(params[:1], 61)
    optimizer.step()
    assert optimizer.state[replacement]["step"] == 1  # started fresh, as torch would


def test_the_token_declines_dtensors_and_other_tensor_subclasses() -> None:
    class Tagged(torch.Tensor):
        pass

    param = torch.nn.Parameter(torch.randn(4))
    groups = [{"params": [param], "lr": 0.1}]
    assert step_token(groups, {}, {}) is not None
    param.grad = torch.randn(4).as_subclass(Tagged)
    assert step_token(groups, {}, {}) is None


def test_an_lr_schedule_keeps_the_fast_path() -> None:
    # A scheduler writes lr every step; the structure did not change, so neither does the token.
    optimizer, params = _model()
    _train(optimizer, params, range(3), lambda step: None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    _grads(params, 3)
    optimizer.step()  # the scheduler added "initial_lr" to the group: one full step
    scheduler.step()
    token = optimizer.__dict__["_steady"]
    for step in range(4, 8):
        _grads(params, step)
        optimizer.step()
        scheduler.step()
        assert optimizer.__dict__["_steady"] is token
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 6)
