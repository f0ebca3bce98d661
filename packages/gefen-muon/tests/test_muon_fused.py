"""The fused codebook8 momentum and its selection (docs/muon.md §2, §6; docs/core.md §11).

``fused=None`` (the default) runs ``gefen.core.fused.fused_momentum`` where ``torch.compile``
works and otherwise the eager reference with one warning; ``fused=True`` requires it (a compile
failure raises "fused implementation failed" in the local preflight, with nothing mutated);
``fused=False`` is the eager reference. The fused update matches the eager one within the
§11 parity bounds, with and without stochastic rounding, for fp32 and bf16 parameters.

The suite maps ``fused=None`` to the eager path (see the repository's conftest); tests that need
the library default are marked ``fused_default``, the others pass ``fused=True`` explicitly.
Shapes are kept few so that one process compiles few graphs.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch

import gefen.core.fused as fused_module
from gefen.core.testing import rejects
from gefen.muon import GefenMuon

SHAPES = [(16, 24), (24, 16), (20, 20), (1, 8)]
DTYPES = [torch.float32, torch.bfloat16]
FAILURE = "fused implementation failed"
FAST = {"lr": 0.02, "ns_steps": 2}


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)


def _run(params: list[torch.nn.Parameter], optimizer: GefenMuon, steps: int, seed: int) -> None:
    for step in range(steps):
        _grads(params, seed + step)
        optimizer.step()


def _copy_state(source: GefenMuon, target: GefenMuon) -> None:
    """Make ``target`` (same shapes) hold ``source``'s parameters, state and codebook."""
    with torch.no_grad():
        pairs = zip(source.param_groups[0]["params"], target.param_groups[0]["params"], strict=True)
        for theirs, ours in pairs:
            ours.copy_(theirs)
            entry, mine = source.state[theirs], target.state[ours]
            assert entry.keys() == mine.keys()
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    mine[key].copy_(value)
                else:
                    mine[key] = value
    assert source.codebook is not None
    target._codebook = source.codebook.clone()
    target._global_step = source.global_step


def _trains(params: list[torch.nn.Parameter], optimizer: GefenMuon, seed: int = 77) -> None:
    before = [p.detach().clone() for p in params]
    step = optimizer.global_step
    _run(params, optimizer, 1, seed)
    assert optimizer.global_step == step + 1
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))


def _codes(optimizer: GefenMuon) -> torch.Tensor:
    entries = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    return torch.cat([e["momentum_codes"].reshape(-1).long() for e in entries])


def _scales(optimizer: GefenMuon) -> torch.Tensor:
    entries = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    return torch.cat([e["momentum_scale"].reshape(-1) for e in entries])


def _values(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in params])


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fused_momentum_matches_the_eager_reference(dtype: torch.dtype, stochastic: bool) -> None:
    """§11 parity from identical state: one step (codes ≥ 99.99 % identical and within ±1,
    scales rtol 1e-6, parameters rtol 1e-5 / atol 1e-7), then six steps (mean relative
    parameter difference < 2e-3)."""
    options = {**FAST, "stochastic_round": stochastic}
    eager_params, fused_params = _params(dtype), _params(dtype)
    eager = GefenMuon(eager_params, fused=False, **options)
    fused = GefenMuon(fused_params, fused=True, **options)
    _run(eager_params, eager, 3, seed=10)  # a non-trivial momentum first
    _run(fused_params, fused, 1, seed=10)  # entries and codebook exist
    _copy_state(eager, fused)
    assert torch.equal(_codes(eager), _codes(fused))

    _run(eager_params, eager, 1, seed=20)
    _run(fused_params, fused, 1, seed=20)
    assert fused._momentum_kernels[("cpu", True, 256)] is not None  # the fused path ran
    codes_e, codes_f = _codes(eager), _codes(fused)
    assert (codes_e == codes_f).float().mean().item() >= 0.9999
    assert (codes_e - codes_f).abs().max().item() <= 1
    torch.testing.assert_close(_scales(fused), _scales(eager), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(_values(fused_params), _values(eager_params), rtol=1e-5, atol=1e-7)

    _run(eager_params, eager, 5, seed=30)
    _run(fused_params, fused, 5, seed=30)
    eager_values, fused_values = _values(eager_params), _values(fused_params)
    relative = (fused_values - eager_values).abs() / eager_values.abs().clamp(min=1e-3)
    assert relative.mean().item() < 2e-3
    assert bool(torch.isfinite(fused_values).all())


@pytest.mark.fused_default
def test_default_selects_the_fused_momentum_once_per_device_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real = fused_module.fused_momentum

    def counting(device_type: str, codebook_size: int = 256) -> Any:
        calls.append(device_type)
        return real(device_type)

    monkeypatch.setattr(fused_module, "fused_momentum", counting)
    params = _params(torch.float32)
    optimizer = GefenMuon(params, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning where compile works
        _run(params, optimizer, 3, seed=0)
    assert calls == ["cpu"]  # selected in the first preflight, then cached
    assert optimizer._momentum_kernels[("cpu", None, 256)] is not None
    # The same numbers as fused=True (same kernel), and a second instance selects again.
    explicit_params = _params(torch.float32)
    explicit = GefenMuon(explicit_params, fused=True, **FAST)
    _run(explicit_params, explicit, 3, seed=0)
    assert calls == ["cpu", "cpu"]
    assert torch.equal(_values(params), _values(explicit_params))


def _failing(device_type: str, codebook_size: int = 256) -> Any:
    raise RuntimeError("no compiler here")


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
def test_fused_true_compile_failure_raises_in_the_preflight_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, later: bool
) -> None:
    params = _params(torch.float32)
    optimizer = GefenMuon(params, fused=True, **FAST)
    if later:
        _run(params, optimizer, 1, seed=0)
        # A copy rebuilds its kernel cache, so its next preflight selects (and compiles) again.
        optimizer = copy.deepcopy(optimizer)
        params = optimizer.param_groups[0]["params"]
    _grads(params, 5)
    monkeypatch.setattr(fused_module, "fused_momentum", _failing)
    info = rejects(optimizer, optimizer.step, RuntimeError, FAILURE)
    assert "no compiler here" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert optimizer._momentum_kernels == {}  # a failure is not cached: a retry selects again
    rejects(optimizer, optimizer.step, RuntimeError, FAILURE)
    assert not optimizer._commit_failed
    monkeypatch.undo()
    _trains(params, optimizer)
    assert optimizer._momentum_kernels[("cpu", True, 256)] is not None


@pytest.mark.fused_default
def test_fused_none_falls_back_to_eager_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_module, "fused_momentum", _failing)
    params = _params(torch.float32)
    optimizer = GefenMuon(params, **FAST)
    with pytest.warns(RuntimeWarning, match="failed to compile") as caught:
        _run(params, optimizer, 3, seed=0)
    messages = [str(w.message) for w in caught if "failed to compile" in str(w.message)]
    assert len(messages) == 1
    assert "no compiler here" in messages[0]  # the warning names the reason
    assert "'cpu'" in messages[0]
    reference_params = _params(torch.float32)
    reference = GefenMuon(reference_params, fused=False, **FAST)
    _run(reference_params, reference, 3, seed=0)
    assert torch.equal(_values(params), _values(reference_params))


def test_fused_false_and_the_none_codec_never_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(device_type: str) -> Any:
        raise AssertionError("compiled")

    monkeypatch.setattr(fused_module, "fused_momentum", never)
    for options in ({"fused": False}, {"fused": True, "momentum_codec": "none"}):
        params = _params(torch.float32)
        optimizer = GefenMuon(params, **FAST, **options)  # type: ignore[arg-type]
        _run(params, optimizer, 2, seed=0)
        assert optimizer._momentum_kernels == {}


def test_kernel_cache_is_per_instance_and_never_serialized() -> None:
    params = _params(torch.float32)
    optimizer = GefenMuon(params, fused=True, **FAST)
    _run(params, optimizer, 2, seed=0)
    assert set(optimizer._momentum_kernels) == {("cpu", True, 256)}
    assert "_momentum_kernels" not in optimizer.__getstate__()
    restored = pickle.loads(pickle.dumps(optimizer))
    assert restored._momentum_kernels == {}
    twin = copy.deepcopy(optimizer)
    assert twin._momentum_kernels == {}
    twin_params = twin.param_groups[0]["params"]
    _run(params, optimizer, 1, seed=40)
    _run(twin_params, twin, 1, seed=40)
    assert torch.equal(_values(params), _values(twin_params))  # the copy steps identically
    assert twin._momentum_kernels[("cpu", True, 256)] is not None


def test_fused_resume_is_bit_exact() -> None:
    """fused → fused resume from a state_dict is bit-exact (docs/core.md §11)."""
    params = _params(torch.bfloat16)
    optimizer = GefenMuon(params, fused=True, stochastic_round=True, **FAST)
    _run(params, optimizer, 2, seed=0)
    saved = copy.deepcopy(optimizer.state_dict())
    saved_values = [p.detach().clone() for p in params]
    _run(params, optimizer, 2, seed=50)
    resumed_params = [torch.nn.Parameter(v.clone()) for v in saved_values]
    resumed = GefenMuon(resumed_params, fused=True, stochastic_round=True, **FAST)
    resumed.load_state_dict(saved)
    _run(resumed_params, resumed, 2, seed=50)
    assert torch.equal(_values(params), _values(resumed_params))
    assert torch.equal(_codes(optimizer), _codes(resumed))
