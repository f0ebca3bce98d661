"""Per-group ``momentum_codec``, ``stochastic_round``, ``deterministic``, ``check_finite`` and
``fused`` (torch.optim's convention: every option may be overridden in a group); only the
codebook's ``codebook_refresh_every`` stays optimizer-wide (``test_core_options``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.core import Gefen, NonFiniteGradientError


def _pair(seed: int = 0) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.nn.Parameter(torch.randn(8, 16, generator=generator)),
        torch.nn.Parameter(torch.randn(64, generator=generator)),
    )


def _clone(params: tuple[torch.nn.Parameter, ...]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _train(optimizer: torch.optim.Optimizer, params: list[Any], steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def test_a_group_keeps_fp32_momentum_and_learns_nothing_into_the_codebook() -> None:
    """The fp32 group steps exactly as a ``momentum_codec="none"`` optimizer over it alone, and
    the codebook8 group exactly as a Gefen over it alone: the fp32 group's gradients do not
    shape the shared codebook."""
    matrix, vector = _pair()
    mixed = Gefen([{"params": [matrix]}, {"params": [vector], "momentum_codec": "none"}], lr=0.01)
    alone_matrix, alone_vector = _clone((matrix, vector))
    coded = Gefen([alone_matrix], lr=0.01)
    dense = Gefen([alone_vector], lr=0.01, momentum_codec="none")
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        for live, twin in ((matrix, alone_matrix), (vector, alone_vector)):
            twin.grad = torch.randn(live.shape, generator=generator)
            live.grad = twin.grad.clone()
        mixed.step()
        coded.step()
        dense.step()
    assert set(mixed.state[matrix]) >= {"momentum_codes", "momentum_scale"}
    assert "momentum" in mixed.state[vector]
    assert "momentum_codes" not in mixed.state[vector]
    assert torch.equal(matrix, alone_matrix)
    assert torch.equal(vector, alone_vector)
    assert mixed.codebook is not None
    assert coded.codebook is not None
    assert torch.equal(mixed.codebook, coded.codebook)


def test_only_fp32_groups_hold_no_codebook_and_round_trip() -> None:
    matrix, vector = _pair()
    optimizer = Gefen([{"params": [matrix, vector], "momentum_codec": "none"}])
    assert not optimizer.uses_codebook
    _train(optimizer, [matrix, vector], 2)
    assert optimizer.codebook is None
    saved = optimizer.state_dict()
    assert saved["gefen"]["codebook_present"] == 0  # format 2: an empty slot
    twin_params = _clone((matrix, vector))
    twin = Gefen([{"params": twin_params, "momentum_codec": "none"}])
    twin.load_state_dict(copy.deepcopy(saved))
    _train(optimizer, [matrix, vector], 1, start=5)
    _train(twin, twin_params, 1, start=5)
    assert torch.equal(matrix, twin_params[0])
    assert torch.equal(vector, twin_params[1])


def test_a_codebook8_group_added_after_fp32_steps_learns_the_first_codebook() -> None:
    matrix, vector = _pair()
    optimizer = Gefen([{"params": [vector], "momentum_codec": "none"}])
    _train(optimizer, [vector], 2)
    optimizer.add_param_group({"params": [matrix]})
    # Saved between the add and the first step that learns: no codebook yet, steps taken.
    saved = optimizer.state_dict()
    twin_matrix, twin_vector = _clone((matrix, vector))
    twin = Gefen([{"params": [twin_vector], "momentum_codec": "none"}])
    twin.add_param_group({"params": [twin_matrix]})
    twin.load_state_dict(copy.deepcopy(saved))
    _train(optimizer, [vector, matrix], 2, start=5)
    _train(twin, [twin_vector, twin_matrix], 2, start=5)
    assert optimizer.codebook is not None
    assert "momentum_codes" in optimizer.state[matrix]
    assert torch.equal(matrix, twin_matrix)
    assert torch.equal(vector, twin_vector)


@pytest.mark.parametrize("absent", ["none", "zeros"])
def test_an_fp32_group_steps_while_the_codebook_group_has_no_gradient(absent: str) -> None:
    # The whole step was the pre-initialization no-op: the fp32 group's parameters, which had
    # real gradients, silently never moved while the codebook8 group (frozen for a warm-up)
    # had none.
    matrix, vector = _pair()
    mixed = Gefen([{"params": [matrix]}, {"params": [vector], "momentum_codec": "none"}], lr=0.01)
    alone_matrix, alone_vector = _clone((matrix, vector))
    dense = Gefen([alone_vector], lr=0.01, momentum_codec="none")
    coded = Gefen([alone_matrix], lr=0.01)
    start = matrix.detach().clone()
    for step in range(5):
        generator = torch.Generator().manual_seed(step)
        alone_vector.grad = torch.randn(vector.shape, generator=generator)
        vector.grad = alone_vector.grad.clone()
        warm_up = step < 3  # the codebook8 group's gradients start at step 3
        if warm_up:
            matrix.grad = None if absent == "none" else torch.zeros_like(matrix)
        else:
            alone_matrix.grad = torch.randn(matrix.shape, generator=generator)
            matrix.grad = alone_matrix.grad.clone()
            coded.step()
        mixed.step()
        dense.step()
        assert torch.equal(vector, alone_vector)
        assert mixed.global_step == step + 1
        if warm_up:
            assert torch.equal(matrix, start)
            assert mixed.codebook is None
            assert mixed.state[matrix] == {"period": 0}  # it waits for its first gradient
            if step == 1:  # saved while it waits: loads, as an fp32-first optimizer does
                saved = copy.deepcopy(mixed.state_dict())
    assert mixed.codebook is not None
    assert torch.equal(matrix, alone_matrix)  # it learned from its own first gradient
    twin_matrix, twin_vector = _clone((start, vector))
    twin = Gefen([{"params": [twin_matrix]}, {"params": [twin_vector], "momentum_codec": "none"}])
    twin.load_state_dict(saved)
    assert twin.global_step == 2


def test_initialize_codebook_learns_nothing_from_fp32_gradients_alone() -> None:
    matrix, vector = _pair()
    mixed = Gefen([{"params": [matrix]}, {"params": [vector], "momentum_codec": "none"}])
    matrix.grad, vector.grad = torch.zeros_like(matrix), torch.randn_like(vector)
    assert mixed.initialize_codebook() is False
    assert mixed.codebook is None
    assert [mixed.state[p] for p in (matrix, vector)] == [{"period": 0}, {"period": 0}]


def _mixed(params: list[torch.nn.Parameter], **second: Any) -> Gefen:
    return Gefen([{"params": [params[0]]}, {"params": [params[1]], **second}], lr=0.01)


@pytest.mark.parametrize(
    ("saved_options", "live_options", "fragment"),
    [
        ({"momentum_codec": "none"}, {}, "group 1: momentum_codec 'none' differs from the live"),
        ({}, {"momentum_codec": "none"}, "group 1: momentum_codec 'codebook8' differs"),
        ({"deterministic": True}, {}, "group 1: deterministic differs from the live flag"),
    ],
)
def test_a_group_loads_only_into_the_same_codec_and_determinism(
    saved_options: dict[str, Any],
    live_options: dict[str, Any],
    fragment: str,
    rejects: Callable[..., Any],
) -> None:
    params = list(_pair())
    source = _mixed(params, **saved_options)
    _train(source, params, 2)
    live_params = _clone(tuple(params))
    live = _mixed(live_params, **live_options)
    _train(live, live_params, 1)
    rejects(live, lambda: live.load_state_dict(source.state_dict()), ValueError, fragment)


def test_a_checkpoint_entry_of_the_other_codec_is_refused_by_its_group(
    rejects: Callable[..., Any],
) -> None:
    """The entry's codec is checked against its own group's (not the constructor's) codec."""
    params = list(_pair())
    source = _mixed(params, momentum_codec="none")
    _train(source, params, 2)
    saved = source.state_dict()
    saved["param_groups"][1]["momentum_codec"] = "codebook8"  # the entry still holds fp32
    live_params = _clone(tuple(params))
    live = _mixed(live_params)
    _train(live, live_params, 1)
    rejects(live, lambda: live.load_state_dict(saved), ValueError, "the other momentum codec")


def test_stochastic_rounding_is_a_group_option() -> None:
    """Only the stochastic group's codes differ from a round-to-nearest twin; the other group
    (same codebook: both learn it) steps bit-identically."""
    params = list(_pair())
    stochastic = _mixed(params, stochastic_round=True)
    twin_params = _clone(tuple(params))
    nearest = _mixed(twin_params)
    _train(stochastic, params, 3)
    _train(nearest, twin_params, 3)
    assert torch.equal(params[0], twin_params[0])
    assert not torch.equal(params[1], twin_params[1])


def test_check_finite_is_a_group_option(rejects: Callable[..., Any]) -> None:
    params = list(_pair())
    optimizer = _mixed(params, check_finite=False)
    _train(optimizer, params, 1)
    params[0].grad = torch.randn(params[0].shape)
    params[1].grad = torch.full(params[1].shape, float("nan"))
    optimizer.step()  # the unchecked group's NaN is the caller's business, as check_finite=False
    params[0].grad = torch.full(params[0].shape, float("inf"))
    params[1].grad = torch.randn(params[1].shape)

    def restore() -> None:
        params[0].grad = torch.randn(params[0].shape)

    rejects(
        optimizer,
        optimizer.step,
        NonFiniteGradientError,
        "param_groups[0][0] has a non-finite",
        restore=restore,
    )


def test_fused_is_a_group_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused=False`` in one group selects the eager kernel for it alone."""
    params = list(_pair())
    optimizer = _mixed(params, fused=False)
    selected: list[Any] = []
    original = optimizer._kernels.select

    def record(key: Any, *, fused: Any, deterministic: bool) -> Any:
        selected.append((key[2], fused, deterministic))
        return original(key, fused=fused, deterministic=deterministic)

    monkeypatch.setattr(optimizer._kernels, "select", record)
    optimizer.param_groups[1]["deterministic"] = True
    _train(optimizer, params, 1)
    assert ("codebook8", None, False) in selected
    assert ("codebook8", False, True) in selected
