"""Single-process behaviour of the vote and of the AMP parser (docs/dist.md §5, §6): the empty
scope changes nothing about exceptions, and the parser accepts exactly GradScaler's forms."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gefen.dist import (
    PHASE_STEP_PREFLIGHT,
    GuardedOperation,
    parse_amp_controls,
    prepare_synchronized_amp_step,
    synchronize_step_error,
)
from gefen.dist.testing import assert_unchanged, deep_snapshot

# -- the vote ----------------------------------------------------------------------------------


def test_empty_scope_reraises_the_same_exception_object() -> None:
    original = ValueError("bad checkpoint")
    with pytest.raises(ValueError) as caught:
        synchronize_step_error(original, PHASE_STEP_PREFLIGHT, (), "Gefen")
    assert caught.value is original
    assert caught.value.__cause__ is None


def test_empty_scope_without_error_returns() -> None:
    assert synchronize_step_error(None, PHASE_STEP_PREFLIGHT, (), "Gefen") is None


@pytest.mark.parametrize("not_an_exception", [KeyboardInterrupt(), "boom", 3])
def test_vote_accepts_only_exceptions(not_an_exception: Any) -> None:
    with pytest.raises(TypeError):
        synchronize_step_error(not_an_exception, PHASE_STEP_PREFLIGHT, (), "Gefen")


def test_keyboard_interrupt_in_a_local_phase_is_not_caught_or_voted() -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    operation = GuardedOperation("GefenMuon", scope=())
    with pytest.raises(KeyboardInterrupt):
        operation.local(PHASE_STEP_PREFLIGHT, interrupted)


def test_local_phase_reraises_unchanged_in_an_empty_scope() -> None:
    original = RuntimeError("closure failed")

    def failing() -> None:
        raise original

    with pytest.raises(RuntimeError) as caught:
        GuardedOperation("Gefen", scope=()).local(PHASE_STEP_PREFLIGHT, failing)
    assert caught.value is original


def test_local_phase_returns_the_result() -> None:
    operation = GuardedOperation("Gefen", scope=())
    assert operation.local(PHASE_STEP_PREFLIGHT, lambda a, b=0: a + b, 2, b=3) == 5


def test_guarded_operation_needs_exactly_one_form() -> None:
    with pytest.raises(TypeError):
        GuardedOperation("Gefen")
    with pytest.raises(TypeError):
        GuardedOperation("Gefen", scope=(), binding_getter=lambda: None)
    with pytest.raises(TypeError):
        GuardedOperation("Gefen", scope=("not a channel",))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        GuardedOperation("Gefen", binding_getter=lambda: "not a binding")  # type: ignore[arg-type,return-value]


def test_mesh_form_offers_only_local() -> None:
    operation = GuardedOperation("Gefen", scope=())
    for call in (
        lambda: operation.any_true(True),
        lambda: operation.gather([1]),
        lambda: operation.agree("x", [1]),
        lambda: operation.sum_int64(torch.zeros(2)),
        lambda: operation.header(3, [], []),
    ):
        with pytest.raises(RuntimeError, match="binding form"):
            call()


# -- the AMP parser --------------------------------------------------------------------------


class _Decorated:
    """What GradScaler decorates: an object with param_groups and, maybe, the two controls."""

    def __init__(self, grads: list[torch.Tensor | None]) -> None:
        params = []
        for grad in grads:
            param = torch.nn.Parameter(torch.zeros(3) if grad is None else torch.zeros_like(grad))
            param.grad = grad
            params.append(param)
        self.param_groups = [{"params": params}]
        self.state: dict[Any, Any] = {}


def _decorated(**controls: object) -> _Decorated:
    optimizer = _Decorated([torch.tensor([8.0, -16.0, 0.5]), None])
    for name, value in controls.items():
        setattr(optimizer, name, value)
    return optimizer


@pytest.mark.parametrize(
    ("found_inf", "overflow"),
    [
        (None, False),
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        (1.0, True),
        (0.0, False),
        (torch.tensor([1.0]), True),
        (torch.tensor(0.0), False),
        (torch.tensor([[True]]), True),
    ],
)
def test_parser_accepts_found_inf_forms(found_inf: object, overflow: bool) -> None:
    controls = parse_amp_controls(_decorated(found_inf=found_inf))
    assert controls.present is True
    assert controls.overflow is overflow


@pytest.mark.parametrize("found_inf", [torch.tensor([1.0, 0.0]), "inf", [1], torch.zeros(0)])
def test_parser_rejects_other_found_inf_forms(found_inf: object) -> None:
    with pytest.raises(RuntimeError, match="found_inf"):
        parse_amp_controls(_decorated(found_inf=found_inf))


@pytest.mark.parametrize(
    ("grad_scale", "scale"),
    [(None, None), (8, 8.0), (0.5, 0.5), (torch.tensor([4.0]), 4.0), (torch.tensor(2.0), 2.0)],
)
def test_parser_accepts_grad_scale_forms(grad_scale: object, scale: float | None) -> None:
    assert parse_amp_controls(_decorated(grad_scale=grad_scale)).scale == scale


@pytest.mark.parametrize("grad_scale", [True, "8", torch.tensor([1.0, 2.0]), [8.0]])
def test_parser_rejects_other_grad_scale_forms(grad_scale: object) -> None:
    with pytest.raises(RuntimeError, match="grad_scale"):
        parse_amp_controls(_decorated(grad_scale=grad_scale))


@pytest.mark.parametrize(
    "grad_scale", [0, -1.0, float("inf"), float("nan"), torch.tensor(0.0), 10**400]
)
@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_non_finite_or_non_positive_scale_raises_even_with_overflow(
    grad_scale: object, found_inf: float
) -> None:
    optimizer = _decorated(found_inf=found_inf, grad_scale=grad_scale)
    before = deep_snapshot(optimizer)
    with pytest.raises(RuntimeError, match="non-finite or non-positive grad_scale"):
        prepare_synchronized_amp_step(optimizer, (), "Gefen")
    assert_unchanged(before, deep_snapshot(optimizer))


def test_parse_errors_raise_unchanged_in_an_empty_scope() -> None:
    with pytest.raises(RuntimeError, match="found_inf"):
        prepare_synchronized_amp_step(_decorated(found_inf="yes"), (), "Gefen")


def test_absent_controls_step_without_touching_gradients() -> None:
    optimizer = _decorated()
    before = deep_snapshot(optimizer)
    assert prepare_synchronized_amp_step(optimizer, (), "Gefen") is True
    assert_unchanged(before, deep_snapshot(optimizer))


def test_overflow_skips_without_unscaling() -> None:
    optimizer = _decorated(found_inf=torch.tensor([1.0]), grad_scale=torch.tensor([8.0]))
    before = deep_snapshot(optimizer)
    assert prepare_synchronized_amp_step(optimizer, (), "Gefen") is False
    assert_unchanged(before, deep_snapshot(optimizer))


def test_scale_none_never_divides() -> None:
    optimizer = _decorated(found_inf=torch.tensor([0.0]), grad_scale=None)
    before = deep_snapshot(optimizer)
    assert prepare_synchronized_amp_step(optimizer, (), "Gefen") is True
    assert_unchanged(before, deep_snapshot(optimizer))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_unscale_multiplies_by_gradscalers_reciprocal(dtype: torch.dtype) -> None:
    grads = [torch.tensor([3.0, -6.0, 1e-3], dtype=dtype), torch.tensor([7.0], dtype=dtype)]
    optimizer = _Decorated([g.clone() for g in grads])
    optimizer.grad_scale = torch.tensor([3.0])  # type: ignore[attr-defined]
    optimizer.found_inf = torch.tensor([0.0])  # type: ignore[attr-defined]
    assert prepare_synchronized_amp_step(optimizer, (), "Gefen") is True
    # GradScaler's reciprocal: computed in float64 and rounded to float32; the product is
    # formed at (at least) float32 precision and stored in the gradient's dtype, as
    # GradScaler's own unscale kernel does.
    inverse = torch.tensor(3.0, dtype=torch.float64).reciprocal().float().item()
    for param, original in zip(optimizer.param_groups[0]["params"], grads, strict=True):
        wide = original.double() if dtype == torch.float64 else original.float()
        assert torch.equal(param.grad, (wide * inverse).to(dtype))
    if dtype == torch.float64:  # the float32 rounding is visible at float64 precision
        assert not torch.equal(optimizer.param_groups[0]["params"][0].grad, grads[0] / 3.0)
    # The controls belong to the scaler: they are read, never changed or removed.
    assert optimizer.grad_scale.item() == 3.0  # type: ignore[attr-defined]


def test_agreeing_power_of_two_scale_recovers_the_unscaled_gradient_exactly() -> None:
    unscaled = torch.randn(64, generator=torch.Generator().manual_seed(0))
    optimizer = _Decorated([unscaled * 8])
    optimizer.grad_scale = 8.0  # type: ignore[attr-defined]
    assert prepare_synchronized_amp_step(optimizer, (), "Gefen") is True
    assert torch.equal(optimizer.param_groups[0]["params"][0].grad, unscaled)
