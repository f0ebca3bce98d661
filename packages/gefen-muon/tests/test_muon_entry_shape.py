"""GefenMuon's codebook8 momentum knows its matrix's shape, not only its element count.

(B, P) codes hold rows * cols values in row-major order, so a (16, 8) momentum read as (8, 16)
is another matrix. A checkpoint saved for the transposed shape, or ``p.data`` replaced by its
transpose between steps, must be refused (naming the entry and the rule) before anything
changes, and the optimizer must train normally afterwards.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot
from gefen.muon import GefenMuon


def _stepped(shape: tuple[int, int], seed: int = 0) -> tuple[GefenMuon, torch.nn.Parameter]:
    torch.manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(*shape))
    optimizer = GefenMuon([param], lr=0.02)
    for _ in range(2):
        param.grad = torch.randn(*shape)
        optimizer.step()
    return optimizer, param


def _trains(optimizer: GefenMuon, param: torch.nn.Parameter) -> None:
    before = param.detach().clone()
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert not torch.equal(before, param.detach())


def test_a_new_entry_records_its_matrix_width() -> None:
    optimizer, param = _stepped((16, 8))
    assert optimizer.state[param]["matrix_cols"] == 8
    assert optimizer.state_dict()["state"][0]["matrix_cols"] == 8


def test_a_checkpoint_of_the_transposed_shape_is_refused_and_nothing_changes() -> None:
    saved, _ = _stepped((16, 8), seed=1)
    optimizer, param = _stepped((8, 16), seed=2)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    params_before = param.detach().clone()
    with pytest.raises(
        ValueError,
        match=r"GefenMuon checkpoint: entry .*'matrix_cols' is 8, the parameter needs 16",
    ):
        optimizer.load_state_dict(saved.state_dict())
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert torch.equal(params_before, param.detach())
    _trains(optimizer, param)


def test_a_transposed_parameter_between_steps_is_refused_before_any_write() -> None:
    optimizer, param = _stepped((16, 8))
    original = param.data
    param.data = original.t().contiguous()
    param.grad = torch.randn(8, 16)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    value_before = param.detach().clone()
    with pytest.raises(RuntimeError, match=r"'matrix_cols' is 8, the parameter needs 16"):
        optimizer.step()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert torch.equal(value_before, param.detach())
    assert optimizer.global_step == 2
    param.data = original  # put the matrix back: the optimizer goes on as if nothing happened
    param.grad = torch.randn(16, 8)
    _trains(optimizer, param)


@pytest.mark.parametrize("value", [0, -1, 2.5, None])
def test_an_edited_step_counter_is_refused_before_any_write(value: object) -> None:
    """The counters' values are not in the step token (the commit advances them): ``step = -1``
    was stored as 0 (a state its own load refuses), 2.5 taken as 3."""
    optimizer, param = _stepped((16, 8))
    optimizer.state[param]["step"] = value
    param.grad = torch.randn(16, 8)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    value_before = param.detach().clone()
    with pytest.raises(RuntimeError, match=re.escape(f"'step' must be an int >= 1, got {value}")):
        optimizer.step()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert torch.equal(value_before, param.detach())
    optimizer.state[param]["step"] = 2
    _trains(optimizer, param)


@pytest.mark.parametrize("transposed", [False, True], ids=["expanded", "transposed"])
def test_momentum_codes_put_in_with_other_strides_are_refused_before_any_write(
    transposed: bool,
) -> None:
    """The fused kernels read codes row-major through ``data_ptr()``: an ``expand()``ed tensor
    was written out of bounds (a crash or hang on large matrices), a transposed one read out of
    order."""
    optimizer, param = _stepped((16, 8))
    good = optimizer.state[param]["momentum_codes"]
    odd = good.t().contiguous().t() if transposed else good[:1].clone().expand_as(good)
    optimizer.state[param]["momentum_codes"] = odd
    param.grad = torch.randn(16, 8)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    value_before = param.detach().clone()
    with pytest.raises(RuntimeError, match="'momentum_codes' must be contiguous"):
        optimizer.step()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert torch.equal(value_before, param.detach())
    optimizer.state[param]["momentum_codes"] = good
    _trains(optimizer, param)


def test_momentum_codes_transposed_in_place_are_refused_before_any_write() -> None:
    """The same object with the same shape: the steady-state token kept no strides, so the
    fast path read the codes out of order (fresh, the same entry was refused)."""
    optimizer, param = _stepped((8, 8))
    codes = optimizer.state[param]["momentum_codes"]
    good = codes.clone()
    rows, cols = codes.shape
    codes.as_strided_((rows, cols), (1, rows))
    param.grad = torch.randn(8, 8)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    value_before = param.detach().clone()
    with pytest.raises(RuntimeError, match="'momentum_codes' must be contiguous"):
        optimizer.step()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert torch.equal(value_before, param.detach())
    codes.set_(good)
    _trains(optimizer, param)


def test_a_checkpoint_written_before_the_width_was_recorded_loads_and_records_it() -> None:
    source, _ = _stepped((16, 8), seed=3)
    legacy = copy.deepcopy(source.state_dict())
    del legacy["state"][0]["matrix_cols"]
    optimizer, param = _stepped((16, 8), seed=4)
    optimizer.load_state_dict(legacy)
    assert optimizer.state[param]["matrix_cols"] == 8
    for key in ("momentum_codes", "momentum_scale"):
        assert torch.equal(optimizer.state[param][key], source.state[source_param(source)][key])
    _trains(optimizer, param)


def test_a_wrong_width_value_is_refused_by_type_and_value() -> None:
    saved, _ = _stepped((16, 8), seed=5)
    optimizer, param = _stepped((16, 8), seed=6)
    for bad in (16, 8.0, "8", -8):
        state = copy.deepcopy(saved.state_dict())
        state["state"][0]["matrix_cols"] = bad
        before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
        with pytest.raises(ValueError, match=r"GefenMuon checkpoint: entry .*'matrix_cols'"):
            optimizer.load_state_dict(state)
        assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    _trains(optimizer, param)


def source_param(optimizer: GefenMuon) -> torch.Tensor:
    return optimizer.param_groups[0]["params"][0]  # type: ignore[no-any-return]
