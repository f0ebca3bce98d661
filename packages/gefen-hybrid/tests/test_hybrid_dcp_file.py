"""A DCP file into a freshly built GefenMuonHybrid and GefenMuon, in one process (docs/core.md
§8.7, docs/hybrid.md §8): torchtitan's resume, ``get_optimizer_state_dict`` of the fresh
optimizer as DCP's template, ``dcp.load``, ``set_optimizer_state_dict``; then the run continues
bit for bit as if it had never stopped."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.testing import TinyLM, assert_same_hybrid, hybrid_snapshot
from gefen.muon import GefenMuon

CASES = [
    ("gefen", {}),
    ("adamw", {}),
    ("gefen", {"normuon": True}),
    ("gefen", {"momentum_codec": "none"}),
]


def _hybrid(backend: str, options: dict[str, Any]) -> tuple[TinyLM, GefenMuonHybrid]:
    torch.manual_seed(0)
    model = TinyLM()
    kwargs: dict[str, Any] = {"lr": 1e-2, "ns_steps": 1, "fused": False, **options}
    return model, GefenMuonHybrid(model, backup_optimizer=backend, **kwargs)


def _train(model: torch.nn.Module, optimizer: Any, seeds: range) -> None:
    for seed in seeds:
        for index, param in enumerate(model.parameters()):
            generator = torch.Generator().manual_seed(1000 * seed + index)
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def _round_trip(model: torch.nn.Module, optimizer: Any, twin: Any, twin_model: Any, path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own one-process warnings
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))
        template = get_optimizer_state_dict(twin_model, twin)
        dcp.load({"optim": template}, checkpoint_id=str(path))
        set_optimizer_state_dict(twin_model, twin, template)


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(("backend", "options"), CASES, ids=[f"{b}-{o}" for b, o in CASES])
def test_a_fresh_hybrid_resumes_a_dcp_file_bit_exactly(
    backend: str, options: dict[str, Any], tmp_path: Path
) -> None:
    model, hybrid = _hybrid(backend, options)
    _train(model, hybrid, range(3))
    twin_model, twin = _hybrid(backend, options)
    twin_model.load_state_dict(model.state_dict())
    fresh = hybrid_snapshot(twin)
    template = get_optimizer_state_dict(twin_model, twin)
    assert_same_hybrid(fresh, hybrid_snapshot(twin))  # offering the template changed nothing
    assert template["param_groups"]
    _round_trip(model, hybrid, twin, twin_model, tmp_path)
    _train(model, hybrid, range(3, 6))
    _train(twin_model, twin, range(3, 6))
    assert _same_params(model, twin_model)


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_a_fresh_hybrid_whose_state_was_read_resumes_a_dcp_file_bit_exactly(
    backend: str, tmp_path: Path
) -> None:
    # A read of a fresh AdamW entry (a logging callback's state[p].get("step")) stores {} in
    # torch's defaultdict: the template offered no tensors for it, DCP filled none, and that
    # parameter's moments silently restarted from zero.
    model, hybrid = _hybrid(backend, {})
    _train(model, hybrid, range(3))
    twin_model, twin = _hybrid(backend, {})
    twin_model.load_state_dict(model.state_dict())
    for param in twin_model.parameters():
        twin.state[param].get("step")
    _round_trip(model, hybrid, twin, twin_model, tmp_path)
    assert [sorted(twin.state[p]) for p in twin_model.parameters()] == [
        sorted(hybrid.state[p]) for p in model.parameters()
    ]
    _train(model, hybrid, range(3, 6))
    _train(twin_model, twin, range(3, 6))
    assert _same_params(model, twin_model)


@pytest.mark.parametrize("options", [{}, {"normuon": True}, {"momentum_codec": "none"}])
def test_a_fresh_gefen_muon_resumes_a_dcp_file_bit_exactly(
    options: dict[str, Any], tmp_path: Path
) -> None:
    def build() -> tuple[torch.nn.Module, GefenMuon]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 4))
        matrices = [model[0].weight, model[1].weight]
        return model, GefenMuon(matrices, lr=0.02, ns_steps=1, fused=False, **options)

    model, optimizer = build()
    _train(model, optimizer, range(3))
    twin_model, twin = build()
    twin_model.load_state_dict(model.state_dict())
    assert twin.codebook is None
    _round_trip(model, optimizer, twin, twin_model, tmp_path)
    assert twin.global_step == 3
    _train(model, optimizer, range(3, 6))
    _train(twin_model, twin, range(3, 6))
    assert _same_params(model, twin_model)


def _muon() -> tuple[torch.nn.Module, GefenMuon]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 4))
    return model, GefenMuon([model[0].weight, model[1].weight], lr=0.02, ns_steps=1, fused=False)


FULL_CASES = {
    "hybrid-gefen": lambda: _hybrid("gefen", {}),
    "hybrid-adamw": lambda: _hybrid("adamw", {}),
    "gefen-muon": _muon,
}


@pytest.mark.parametrize("case", sorted(FULL_CASES))
def test_a_full_state_dict_loads_through_torch_into_a_fresh_optimizer(case: str) -> None:
    """torch's full-state-dict pair (``StateDictOptions(full_state_dict=True)`` both ways): its
    load matches the extras' lists item by item against the fresh optimizer's, which format 2's
    one flag per parameter makes possible; the run continues bit for bit."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(full_state_dict=True)
    model, optimizer = FULL_CASES[case]()
    _train(model, optimizer, range(3))
    twin_model, twin = FULL_CASES[case]()
    twin_model.load_state_dict(model.state_dict())
    # as a file holds it: without cpu_offload the dict holds the live tensors of plain state
    full = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=options))
    set_optimizer_state_dict(twin_model, twin, full, options=options)
    _train(model, optimizer, range(3, 6))
    _train(twin_model, twin, range(3, 6))
    assert _same_params(model, twin_model)


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_a_flattened_dcp_state_dict_is_refused_naming_the_option(backend: str) -> None:
    # torchtitan flattens by default; the message named only another optimizer's checkpoint.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model, hybrid = _hybrid(backend, {})
    _train(model, hybrid, range(2))
    flat = get_optimizer_state_dict(model, hybrid, options=options)
    twin_model, twin = _hybrid(backend, {})
    for param in twin_model.parameters():
        twin.state[param]  # torch's unflattening reads every entry: {} in AdamW's defaultdict
    before = hybrid_snapshot(twin)
    with pytest.raises(ValueError, match=r"StateDictOptions\(flatten_optimizer_state_dict=True\)"):
        set_optimizer_state_dict(twin_model, twin, flat, options=options)
    assert_same_hybrid(before, hybrid_snapshot(twin))
    start = [param.detach().clone() for param in twin_model.parameters()]
    _train(twin_model, twin, range(2))
    assert all(not torch.equal(a, b) for a, b in zip(start, twin_model.parameters(), strict=True))


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_a_plain_state_dict_through_a_dcp_file_is_refused_naming_the_route(
    backend: str, tmp_path: Path
) -> None:
    # The refusal said "a step-0 entry must hold zeros": DCP cannot write the Python-int
    # counters back in place and adds them under string ids instead.
    model, hybrid = _hybrid(backend, {})
    _train(model, hybrid, range(2))
    twin_model, twin = _hybrid(backend, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"o": hybrid.state_dict()}, checkpoint_id=str(tmp_path))
        template = {"o": twin.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path))
    before = hybrid_snapshot(twin)
    with pytest.raises(ValueError, match="get_optimizer_state_dict and set_optimizer_state_dict"):
        twin.load_state_dict(template["o"])
    assert_same_hybrid(before, hybrid_snapshot(twin))
    start = [param.detach().clone() for param in twin_model.parameters()]
    _train(twin_model, twin, range(2))
    assert all(not torch.equal(a, b) for a, b in zip(start, twin_model.parameters(), strict=True))
