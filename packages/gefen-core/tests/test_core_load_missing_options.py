"""A checkpoint group saved without an option loads with the constructor's value, and says so
(it used to fill it in silently: a hand-edited checkpoint without ``lr`` trained at the
constructor's learning rate without a word)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gefen.core import Gefen


def _saved() -> tuple[Gefen, torch.nn.Parameter, dict]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = Gefen([param], lr=0.1, weight_decay=0.0)
    param.grad = torch.randn(8, 4)
    optimizer.step()
    return optimizer, param, copy.deepcopy(optimizer.state_dict())


def test_a_group_saved_without_lr_warns_with_the_value_it_gets() -> None:
    optimizer, param, saved = _saved()
    optimizer.param_groups[0]["lr"] = 0.5  # the live group's value is not what fills it
    del saved["param_groups"][0]["lr"]
    with pytest.warns(UserWarning, match=r"group 0 was saved without 'lr'.*\(lr=0\.1\)"):
        optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["lr"] == 0.1
    before = param.detach().clone()
    param.grad = torch.randn(8, 4)
    optimizer.step()
    assert not torch.equal(before, param.detach())


@pytest.mark.parametrize("option", ["factored_floor", "nesterov"])
def test_a_checkpoint_from_before_an_option_loads_with_the_constructors_choice(
    option: str,
) -> None:
    # Checkpoints written before the option existed lack it; the optimizer they load into
    # decides (here the former behaviour, to keep a run's trajectory), and the warning says so.
    _, _, saved = _saved()
    del saved["param_groups"][0][option]
    param = torch.nn.Parameter(torch.randn(8, 4))
    resumed = Gefen([param], lr=0.1, weight_decay=0.0, **{option: False})
    with pytest.warns(UserWarning, match=rf"without '{option}'.*\({option}=False\)"):
        resumed.load_state_dict(saved)
    assert resumed.param_groups[0][option] is False
    before = param.detach().clone()
    param.grad = torch.randn(8, 4)
    resumed.step()
    assert not torch.equal(before, param.detach())


def test_several_missing_options_are_named_in_one_warning() -> None:
    optimizer, _, saved = _saved()
    for name in ("eps", "betas"):
        del saved["param_groups"][0][name]
    with pytest.warns(UserWarning, match="was saved without") as caught:
        optimizer.load_state_dict(saved)
    messages = [str(w.message) for w in caught if "was saved without" in str(w.message)]
    assert len(messages) == 1
    assert "'betas'" in messages[0]
    assert "'eps'" in messages[0]


def test_a_complete_checkpoint_and_the_live_kept_options_warn_nothing() -> None:
    optimizer, _, saved = _saved()
    del saved["param_groups"][0]["fused"]  # live-kept: always the live optimizer's value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.load_state_dict(saved)


def test_gefen_muon_warns_too() -> None:
    muon = pytest.importorskip("gefen.muon")
    param = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = muon.GefenMuon([param], lr=0.02)
    param.grad = torch.randn(8, 4)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    del saved["param_groups"][0]["lr"]
    with pytest.warns(UserWarning, match=r"GefenMuon checkpoint: group 0 was saved without 'lr'"):
        optimizer.load_state_dict(saved)
