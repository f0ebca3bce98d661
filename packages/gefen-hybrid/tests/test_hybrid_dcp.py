"""GefenMuonHybrid through DCP's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.

DCP keeps only ``state`` and ``param_groups`` (the top-level ``gefen_hybrid`` extras are dropped)
and hands ``load_state_dict`` parameter names instead of ids, so the hybrid mirrors its own words
into every group and maps names to ids by position, as torch does. Every rejection leaves both
children unchanged (deep snapshot) and the hybrid still trains.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.testing import MUON_NAMES, TinyLM, assert_same_hybrid, hybrid_snapshot

BACKENDS = ["gefen", "adamw"]
PREFIX = "GefenMuonHybrid checkpoint: "


def _build(backend: str, form: str = "full") -> tuple[TinyLM, GefenMuonHybrid]:
    torch.manual_seed(0)
    model = TinyLM()
    kwargs: dict[str, Any] = {"lr": 1e-2, "ns_steps": 1, "fused": False}
    if form == "full":
        return model, GefenMuonHybrid(model, backup_optimizer=backend, **kwargs)
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if n in MUON_NAMES] if form == "muon-only" else []
    backup = [(n, p) for n, p in named if n not in MUON_NAMES] if form == "backup-only" else []
    return model, GefenMuonHybrid(muon, backup, backup_optimizer=backend, **kwargs)


def _grads(model: TinyLM, seed: int) -> None:
    for index, param in enumerate(model.parameters()):
        generator = torch.Generator().manual_seed(seed + index)
        param.grad = torch.randn(param.shape, generator=generator)


def _train(model: TinyLM, hybrid: GefenMuonHybrid, steps: int, seed: int) -> None:
    for step in range(steps):
        _grads(model, seed + 100 * step)
        hybrid.step()


def _values(model: TinyLM) -> list[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_keeps_the_hybrid_words_in_every_group(backend: str) -> None:
    model, hybrid = _build(backend)
    _train(model, hybrid, 2, seed=1)
    saved = get_optimizer_state_dict(model, hybrid)
    assert "gefen_hybrid" not in saved  # DCP keeps group keys only
    words = {"format_version": 1, "backup_optimizer": backend, "muon": True, "backup": True}
    assert [group["gefen_hybrid"] for group in saved["param_groups"]] == [words] * len(
        saved["param_groups"]
    )
    assert all(isinstance(name, str) for group in saved["param_groups"] for name in group["params"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fresh_hybrid_stays_pristine_under_get(backend: str) -> None:
    model, hybrid = _build(backend)
    before, values = hybrid_snapshot(hybrid), _values(model)
    get_optimizer_state_dict(model, hybrid)
    assert_same_hybrid(before, hybrid_snapshot(hybrid))
    assert all(torch.equal(a, b) for a, b in zip(values, _values(model), strict=True))


@pytest.mark.parametrize("form", ["full", "muon-only", "backup-only"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_get_then_set_into_a_fresh_hybrid_resumes_bit_exactly(backend: str, form: str) -> None:
    model, hybrid = _build(backend, form)
    _train(model, hybrid, 3, seed=1)
    # A copy, as a file would hold: torch's AdamW keeps the very tensors it loads.
    saved = copy.deepcopy(get_optimizer_state_dict(model, hybrid))
    assert "gefen_hybrid" not in saved
    resumed_model, resumed = _build(backend, form)
    resumed_model.load_state_dict(model.state_dict())
    set_optimizer_state_dict(resumed_model, resumed, saved)
    _train(model, hybrid, 3, seed=7)
    _train(resumed_model, resumed, 3, seed=7)
    for a, b in zip(_values(model), _values(resumed_model), strict=True):
        assert torch.equal(a, b)
    expected, got = hybrid.state_dict(), resumed.state_dict()
    for key, entry in expected["state"].items():
        for name, value in entry.items():
            other = got["state"][key][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def _named_checkpoint(backend: str) -> tuple[TinyLM, GefenMuonHybrid, dict[str, Any]]:
    """A stepped hybrid and a DCP-style checkpoint of another stepped hybrid: groups with the
    hybrid's words and FQN params, state keyed by FQN, no top-level extras."""
    source_model, source = _build(backend)
    _train(source_model, source, 2, seed=3)
    named = get_optimizer_state_dict(source_model, source)
    model, hybrid = _build(backend)
    _train(model, hybrid, 1, seed=5)
    return model, hybrid, named


def _words_differ(sd: dict[str, Any]) -> None:
    sd["param_groups"][-1]["gefen_hybrid"]["backup_optimizer"] = "sgd"


def _words_missing(sd: dict[str, Any]) -> None:
    del sd["param_groups"][0]["gefen_hybrid"]


def _words_hold_a_tensor(sd: dict[str, Any]) -> None:
    for group in sd["param_groups"]:
        group["gefen_hybrid"]["muon"] = torch.ones(1)


def _words_extra_key(sd: dict[str, Any]) -> None:
    for group in sd["param_groups"]:
        group["gefen_hybrid"]["colour"] = "red"


def _a_name_too_few(sd: dict[str, Any]) -> None:
    sd["param_groups"][-1]["params"].pop()


def _names_and_ids(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["params"] = list(range(len(sd["param_groups"][0]["params"])))


def _a_name_twice(sd: dict[str, Any]) -> None:
    sd["param_groups"][-1]["params"][-1] = sd["param_groups"][0]["params"][0]


REJECTIONS = {
    "words differ between groups": (_words_differ, "the groups' 'gefen_hybrid' copies differ"),
    "words in only some groups": (_words_missing, "'gefen_hybrid' present in only some"),
    "words hold a tensor": (_words_hold_a_tensor, "copy holds an int format_version"),
    "words with an extra key": (_words_extra_key, "copy must hold exactly"),
    "a name too few": (_a_name_too_few, "param_groups name 6 parameters, the live hybrid has 7"),
    "names and ids mixed": (_names_and_ids, "param_groups[1]['params'] must be a list of int"),
    "a name twice": (_a_name_twice, "param_groups name a parameter more than once"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(REJECTIONS))
def test_a_bad_group_copy_or_name_is_rejected_with_nothing_changed(backend: str, case: str) -> None:
    model, hybrid, named = _named_checkpoint(backend)
    corrupt, message = REJECTIONS[case]
    broken = copy.deepcopy(named)
    corrupt(broken)
    before, values = hybrid_snapshot(hybrid), _values(model)
    with pytest.raises(ValueError, match=PREFIX + ".*" + re.escape(message)):
        hybrid.load_state_dict(broken)
    assert_same_hybrid(before, hybrid_snapshot(hybrid))
    assert all(torch.equal(a, b) for a, b in zip(values, _values(model), strict=True))
    hybrid.load_state_dict(named)  # the intact checkpoint still loads, and training goes on
    params = _values(model)
    _train(model, hybrid, 1, seed=9)
    assert all(not torch.equal(a, b) for a, b in zip(params, _values(model), strict=True))
