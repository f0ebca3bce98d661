"""Edits the steady-state caches could not see (a fourth adversarial round): each is refused by
name before anything changes, or trains exactly as the full path does.

The step token and the entry signature kept a state tensor by identity, shape, dtype and device,
the other entry values by ``==``, and a tensor lr by its version. An in-place ``set_`` or
``as_strided_`` keeps the first four, ``8.0 == 8``, and a write through ``.data`` or NumPy
leaves the version as it was; an array's ``==`` is element-wise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import gefen.core.shell as shell_module
from gefen.core import Gefen

SHAPES = ((64, 8), (16,))
LABEL = "parameter param_groups[0][0]: state does not match parameter (entry: "


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(2000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _steady(fast: bool = True, **options: Any) -> tuple[Gefen, list[torch.nn.Parameter]]:
    """An optimizer three steps in, its fast path live (unless ``fast`` is False: the token is
    patched away), with the next gradients set."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    optimizer = Gefen(params, **{"lr": 1e-2, **options})
    for step in range(3):
        _grads(params, step)
        optimizer.step()
    assert (optimizer.__dict__["_steady"] is not None) == fast
    _grads(params, 3)
    return optimizer, params


def _onto_one_element(value: torch.Tensor) -> np.ndarray[Any, Any]:
    """Re-point ``value`` in place at a one-element storage with zero strides; returns the
    array the storage starts in, so a write past that element lands there, not in the heap."""
    arena = np.zeros(value.numel(), dtype=value.numpy().dtype)
    storage = torch.from_numpy(arena[:1]).untyped_storage()
    value.set_(storage, 0, value.shape, (0,) * value.dim())
    return arena


def _column_major_in_place(value: torch.Tensor) -> None:
    rows, cols = value.shape
    value.as_strided_((rows, cols), (1, rows))


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("key", ["momentum_codes", "momentum_scale"])
def test_a_state_tensor_restrided_in_place_is_refused_and_nothing_is_written(
    fused: bool, key: str, rejects: Any
) -> None:
    # The native kernel wrote 63 floats past a 4-byte storage; the eager one latched.
    optimizer, params = _steady(fused=fused)
    value = optimizer.state[params[0]][key]
    good = value.clone()
    arena = _onto_one_element(value)
    rule = f"{LABEL}'{key}' must be contiguous"
    rejects(optimizer, optimizer.step, RuntimeError, rule, restore=lambda: value.set_(good))
    assert not arena[1:].any()


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_a_state_tensor_transposed_in_place_is_refused(fused: bool, rejects: Any) -> None:
    # The kernel read the codes out of order: a silently wrong update that the checkpoint
    # taken at the same moment did not reproduce.
    optimizer, params = _steady(fused=fused)
    codes = optimizer.state[params[0]]["momentum_codes"]
    good = codes.clone()
    _column_major_in_place(codes)
    rule = f"{LABEL}'momentum_codes' must be contiguous"
    rejects(optimizer, optimizer.step, RuntimeError, rule, restore=lambda: codes.set_(good))


def _data_fill_nan(lr: torch.Tensor) -> None:
    lr.data.fill_(float("nan"))


def _numpy_write_inf(lr: torch.Tensor) -> None:
    lr.numpy()[()] = np.inf


def _data_rebound_negative(lr: torch.Tensor) -> None:
    lr.data = torch.tensor(-1.0)


@pytest.mark.parametrize(
    ("edit", "shown"),
    [(_data_fill_nan, "nan"), (_numpy_write_inf, "inf"), (_data_rebound_negative, "-1.")],
    ids=["data-nan", "numpy-inf", "data-negative"],
)
def test_a_tensor_lr_written_around_its_version_is_refused(
    edit: Callable[[torch.Tensor], None], shown: str, rejects: Any
) -> None:
    # The parameters became NaN (or moved uphill): the options check watches the version.
    lr = torch.tensor(1e-2)
    optimizer, _ = _steady(lr=lr)
    edit(lr)

    def restore() -> None:
        lr.data = torch.tensor(1e-2)

    message = f"Invalid learning rate: tensor({shown})"
    rejects(optimizer, optimizer.step, ValueError, message, restore=restore)


@pytest.mark.parametrize("period", [8.0, np.int64(8)], ids=["float", "numpy-int"])
def test_a_period_of_another_type_is_refused_by_name(period: object, rejects: Any) -> None:
    # 8.0 == 8: the step took it and wrote a checkpoint that its own load refuses.
    optimizer, params = _steady()
    entry = optimizer.state[params[0]]
    good = entry["period"]
    assert good == 8
    entry["period"] = period
    rule = f"{LABEL}'period' must be an int >= 0, got {period!r}"
    rejects(optimizer, optimizer.state_dict, RuntimeError, rule, check_training=False)
    rejects(optimizer, optimizer.step, RuntimeError, rule, restore=lambda: entry.update(period=8))


def test_a_beta_of_another_type_is_checked_again(rejects: Any) -> None:
    optimizer, _ = _steady(betas=(0.0, 0.999))
    group = optimizer.param_groups[0]
    group["betas"] = (False, 0.999)  # equal to (0.0, 0.999), and refused by the full check

    def restore() -> None:
        group["betas"] = (0.0, 0.999)

    message = "Invalid beta parameter at index 0: False"
    rejects(optimizer, optimizer.step, ValueError, message, restore=restore)


def _array() -> Any:
    return np.ones(3)


def _tensors() -> Any:
    return [torch.ones(3)]


def _twin_steps(
    edit: Callable[[Gefen, list[torch.nn.Parameter]], None], monkeypatch: pytest.MonkeyPatch
) -> list[list[torch.Tensor]]:
    """Three more steps after ``edit``, through the fast path and through the full path."""
    runs: list[list[torch.Tensor]] = []
    for steady in (True, False):
        with monkeypatch.context() as patch:
            if not steady:
                patch.setattr(shell_module, "step_token", lambda *args: None)
            optimizer, params = _steady(fast=steady)
            for step in range(4, 7):
                edit(optimizer, params)
                optimizer.step()
                _grads(params, step)
            optimizer.state_dict()
            runs.append([param.detach().clone() for param in params])
    return runs


@pytest.mark.parametrize("extra", [_array, _tensors], ids=["ndarray", "list-of-tensors"])
def test_a_group_key_holding_an_array_or_tensors_is_ignored_as_torch_does(
    extra: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every step after the first raised "The truth value of an array ... is ambiguous", and so
    # did state_dict(): the run could not even be saved.
    def edit(optimizer: Gefen, params: list[torch.nn.Parameter]) -> None:
        optimizer.param_groups[0]["layer_scales"] = extra()

    steady, full = _twin_steps(edit, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(steady, full, strict=True))


def test_a_tensor_subclass_in_an_entry_steps_as_on_the_full_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Parameter put into the state raised "Boolean value of Tensor with more than one value
    # is ambiguous" at every later step: the token compared it by ==.
    def edit(optimizer: Gefen, params: list[torch.nn.Parameter]) -> None:
        entry = optimizer.state[params[0]]
        scale = entry["momentum_scale"]
        if type(scale) is torch.Tensor:
            entry["momentum_scale"] = torch.nn.Parameter(scale, requires_grad=False)

    steady, full = _twin_steps(edit, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(steady, full, strict=True))
