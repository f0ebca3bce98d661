"""Checks at the edges (docs/core.md §11): options are validated when a group is added or
changed, not on every step; the finiteness check is one reduction per gradient."""

from __future__ import annotations

import pytest
import torch

from gefen.core import Gefen, NonFiniteGradientError


def _optimizer(**options) -> tuple[Gefen, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.randn(8, 4))
    return Gefen([p], **options), p


def _count_validations(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = Gefen.validate_group

    def counting(self, group):
        calls.append(1)
        return original(self, group)

    monkeypatch.setattr(Gefen, "validate_group", counting)
    return calls


def test_unchanged_options_are_not_revalidated_each_step(monkeypatch) -> None:
    optimizer, p = _optimizer()
    calls = _count_validations(monkeypatch)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        optimizer.step()
    assert calls == []


def test_a_changed_option_is_validated_before_the_step(monkeypatch, rejects) -> None:
    optimizer, p = _optimizer()
    calls = _count_validations(monkeypatch)
    p.grad = torch.randn_like(p)
    optimizer.param_groups[0]["lr"] = 2e-3  # a scheduler's write: validated once
    optimizer.step()
    optimizer.step()
    assert len(calls) == 1
    optimizer.param_groups[0]["eps"] = -1.0

    def restore() -> None:
        optimizer.param_groups[0]["eps"] = 1e-8

    rejects(optimizer, optimizer.step, ValueError, "epsilon", restore=restore)


def test_a_tensor_lr_written_in_place_is_revalidated(monkeypatch, rejects) -> None:
    optimizer, p = _optimizer(lr=torch.tensor(1e-3))
    calls = _count_validations(monkeypatch)
    p.grad = torch.randn_like(p)
    optimizer.step()
    assert calls == []
    optimizer.param_groups[0]["lr"].fill_(-1.0)

    def restore() -> None:
        optimizer.param_groups[0]["lr"].fill_(1e-3)

    rejects(optimizer, optimizer.step, ValueError, "learning rate", restore=restore)
    assert calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finiteness_names_the_parameter_for_every_dtype(dtype, bad, rejects) -> None:
    a = torch.nn.Parameter(torch.randn(6, dtype=dtype))
    b = torch.nn.Parameter(torch.randn(0, dtype=dtype))  # empty gradients are skipped
    c = torch.nn.Parameter(torch.randn(4, 3, dtype=dtype))
    optimizer = Gefen([a, b, c])
    a.grad, b.grad, c.grad = torch.ones_like(a), torch.ones_like(b), torch.ones_like(c)
    c.grad[2, 1] = bad

    def restore() -> None:
        c.grad[2, 1] = 1.0

    rejects(
        optimizer, optimizer.step, NonFiniteGradientError, "param_groups[0][2]", restore=restore
    )


def test_state_entries_are_checked_when_they_change_not_every_step(monkeypatch, rejects) -> None:
    import gefen.core.checked as checked

    optimizer, p = _optimizer()
    p.grad = torch.randn_like(p)
    optimizer.step()
    calls: list[int] = []
    original = checked.entry_matches

    def counting(entry, spec):
        calls.append(1)
        return original(entry, spec)

    monkeypatch.setattr(checked, "entry_matches", counting)
    optimizer.step()
    optimizer.step()
    assert len(calls) <= 1  # at most the first step after the spy went in
    calls.clear()
    optimizer.step()
    assert calls == []
    entry = optimizer.state[p]
    good = entry["momentum_codes"]
    entry["momentum_codes"] = torch.zeros(1, 1, dtype=torch.uint8)  # a replaced tensor

    def restore() -> None:
        entry["momentum_codes"] = good

    rejects(
        optimizer, optimizer.step, RuntimeError, "state does not match parameter", restore=restore
    )
    assert calls


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"fused": False},
        {"momentum_codec": "none", "fused": False},
        {"momentum_codec": "codebook4"},
    ],
    ids=["native", "eager", "none-eager", "codebook4"],
)
@pytest.mark.parametrize(
    "huge",
    [lambda g: g.fill_(2e19), lambda g: g[0].fill_(1.5e19)],
    ids=["squares-overflow", "a-row-sum-overflows"],
)
def test_a_gradient_whose_squares_overflow_is_refused(rejects, options, huge) -> None:
    """Finite, but its factored second moment would be infinite: the step used to turn the
    parameter into NaN for good (v_row and v_col infinite). Refused like a non-finite one."""
    p, v = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))
    optimizer = Gefen([p, v], **options)
    p.grad, v.grad = torch.randn(8, 16), torch.randn(16)
    optimizer.step()
    p.grad = torch.randn(8, 16)
    huge(p.grad)
    assert bool(torch.isfinite(p.grad).all())
    rejects(optimizer, optimizer.step, NonFiniteGradientError, "overflow float32")


def test_a_large_gradient_whose_squares_stay_finite_is_taken() -> None:
    p = torch.nn.Parameter(torch.randn(8, 16))
    optimizer = Gefen([p])
    p.grad = torch.full((8, 16), 1e18)  # 16 squares of 1e36 per row: finite
    optimizer.step()
    assert bool(torch.isfinite(p).all())


@pytest.mark.parametrize(
    "kind",
    [torch.float32, torch.float64],
    ids=["fp32", "fp64"],
)
def test_a_large_finite_gradient_does_not_freeze_a_factored_parameter(kind: torch.dtype) -> None:
    """v_row·v_col overflowed fp32 long before g² did (|g| ≈ 1e12 against 1.8e19): the eager and
    compiled paths then stepped by exactly 0, then and for thousands of steps after, while the
    native kernel (a product of roots) stepped. v̂ is now formed as (v_row / mean)·v_col, which
    stays finite wherever the squares' sums do, and every path steps like the native one."""
    moves: dict[bool, list[float]] = {}
    for fused in (True, False):  # fp32 on the CPU: the native kernel; fp64: inductor
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(16, 24, dtype=kind))
        optimizer = Gefen([p], lr=1e-2, fused=fused)
        moves[fused] = []
        for step in range(4):
            before = p.detach().clone()
            p.grad = torch.randn(16, 24, dtype=kind) * (1e15 if step == 1 else 1.0)
            optimizer.step()
            assert bool(torch.isfinite(p).all())
            moves[fused].append((p.detach() - before).abs().max().item())
    for fused, moved in moves.items():
        assert moved[1] > 0.5e-2, (fused, moved)  # the spike's step is an Adam-sized one
        assert all(m > 0 for m in moved[2:]), (fused, moved)  # and the parameter goes on moving
    assert moves[False][1] == pytest.approx(moves[True][1], rel=1e-3)


def test_a_parameter_whose_elements_share_memory_is_refused_before_anything_changes(
    rejects,
) -> None:
    """An ``expand()``ed view passed every check, then the commit's in-place write failed after
    the earlier parameters and the codebook were written: a latched optimizer. It is refused at
    registration, and (swapped in later through ``.data``) by the step's checks."""
    shared = torch.zeros(1, 24).expand(16, 24)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[1\]: its elements share memory"):
        Gefen([torch.nn.Parameter(torch.randn(8)), shared.requires_grad_()])
    first, second = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(16, 24))
    optimizer = Gefen([first, second], fused=False)
    for _ in range(2):  # the steady path too
        first.grad, second.grad = torch.randn(8), torch.randn(16, 24)
        optimizer.step()
    own = second.data
    second.data = torch.randn(1, 24).expand(16, 24)
    first.grad, second.grad = torch.randn(8), torch.randn(16, 24)

    def restore() -> None:
        second.data = own

    rejects(
        optimizer, optimizer.step, RuntimeError,
        "parameter param_groups[0][1]: its elements share memory", restore=restore,
    )  # fmt: skip
