"""The §9 verification seams of GefenMuon (docs/muon.md §9, §12).

Seam 1: with ``momentum_codec="none"`` and ``normuon=False`` GefenMuon matches
``torch.optim.Muon`` for every listed configuration, shape and parameter dtype, fed the same
precomputed gradients (independent of the parameters, so errors cannot compound). bf16
parameters with ``nesterov=False`` are compared with an oracle that clones the buffer before
Newton–Schulz, because torch's Muon normalises that aliased bf16 buffer in place.

Seam 2: the same gradients through ``"codebook8"``: the Newton–Schulz input is exactly
``lerp(fp32(g), decode(stored), β)`` (nesterov) or ``decode(stored)``, and the stored state is
the plain EMA ``encode(lerp(decode(previous), g, 1 − β))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gefen.muon.update as update_module
from gefen.core.codec import decode_blocks, encode_blocks
from gefen.muon import GefenMuon, adjust_lr_ratio, newton_schulz

TorchMuon = getattr(torch.optim, "Muon", None)
requires_torch_muon = pytest.mark.skipif(TorchMuon is None, reason="needs torch.optim.Muon")

STEPS = 5
SHAPES = [(16, 24), (24, 16), (20, 20), (1, 8)]
DTYPES = [torch.float32, torch.bfloat16]
# torch's conformance inputs for Muon, plus each adjust_lr_fn (§9). "tensor_lr" is built fresh
# for each optimizer, so neither can see the other's tensor.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "lr_0.01": {"lr": 0.01},
    "tensor_lr": {"lr": "tensor:0.01"},
    "wd_0.2": {"weight_decay": 0.2},
    "momentum_0.8": {"momentum": 0.8},
    "ns_steps_6": {"ns_steps": 6},
    "alt_triple": {"ns_coefficients": (3.0, -3.2, 1.2)},
    "nesterov_false": {"nesterov": False},
    "adjust_original": {"adjust_lr_fn": "original"},
    "adjust_match_rms_adamw": {"adjust_lr_fn": "match_rms_adamw"},
}
DEFAULT_TRIPLE = (3.4445, -4.7750, 2.0315)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """§9 runs on one CPU thread (the matmul reduction order is then fixed); restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _options(config: dict[str, Any]) -> dict[str, Any]:
    options = dict(config)
    lr = options.get("lr")
    if isinstance(lr, str) and lr.startswith("tensor:"):
        options["lr"] = torch.tensor(float(lr.split(":", 1)[1]))
    return options


def _gradients(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(STEPS)]


def _initial(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1000)).to(dtype)


def _lr_float(options: dict[str, Any]) -> float:
    lr = options.get("lr", 1e-3)
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


class _CloningOracle:
    """torch.optim.Muon's single-tensor update, but Newton–Schulz reads a clone of the buffer.

    Used only where torch's own Muon aliases its input (bf16 parameters, ``nesterov=False``):
    ``buf.lerp_(g, 1 − β)``; ``N = buf`` (cloned); ``O = NS(N)`` through torch's own kernel;
    ``p ← p·(1 − η·wd)``; ``p ← p − η·ratio·O``.
    """

    def __init__(self, param: torch.Tensor, options: dict[str, Any]) -> None:
        self.param = param
        self.buffer = torch.zeros_like(param)
        self.momentum = float(options.get("momentum", 0.95))
        self.weight_decay = float(options.get("weight_decay", 0.1))
        self.lr = _lr_float(options)
        self.coefficients = tuple(options.get("ns_coefficients", DEFAULT_TRIPLE))
        self.ns_steps = int(options.get("ns_steps", 5))
        self.eps = float(options.get("eps", 1e-7))
        self.ratio = adjust_lr_ratio(options.get("adjust_lr_fn"), tuple(param.shape))
        assert options.get("nesterov", True) is False

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        from torch.optim._muon import _zeropower_via_newtonschulz

        self.buffer.lerp_(grad, 1 - self.momentum)
        update = _zeropower_via_newtonschulz(
            self.buffer.clone(), self.coefficients, self.ns_steps, self.eps
        )
        self.param.mul_(1 - self.lr * self.weight_decay)
        self.param.add_(update, alpha=-(self.lr * self.ratio))


def _cases() -> list[Any]:
    return [
        pytest.param(shape, dtype, name, id=f"{shape[0]}x{shape[1]}-{str(dtype)[6:]}-{name}")
        for shape in SHAPES
        for dtype in DTYPES
        for name in CONFIGS
    ]


@requires_torch_muon
@pytest.mark.parametrize(("shape", "dtype", "name"), _cases())
def test_none_codec_matches_torch_muon(
    one_thread: None, shape: tuple[int, int], dtype: torch.dtype, name: str
) -> None:
    config = CONFIGS[name]
    seed = SHAPES.index(shape) * 100 + DTYPES.index(dtype) * 10
    grads = _gradients(shape, dtype, seed)
    ours = torch.nn.Parameter(_initial(shape, dtype, seed))
    theirs = torch.nn.Parameter(_initial(shape, dtype, seed))
    options = _options(config)
    optimizer = GefenMuon([ours], momentum_codec="none", normuon=False, **options)
    aliased = dtype == torch.bfloat16 and config.get("nesterov", True) is False
    oracle: Any
    if aliased:
        oracle = _CloningOracle(theirs, _options(config))
    else:
        oracle = TorchMuon([theirs], **_options(config))
    lr = _lr_float(options)
    ratio = adjust_lr_ratio(config.get("adjust_lr_fn"), shape)
    ema = torch.zeros(shape, dtype=dtype)  # the plain EMA, rebuilt independently
    beta = float(config.get("momentum", 0.95))
    for t, grad in enumerate(grads, start=1):
        ours.grad = grad.clone()
        optimizer.step()
        if aliased:
            oracle.step(grad.clone())
            reference_buffer = oracle.buffer
        else:
            theirs.grad = grad.clone()
            oracle.step()
            reference_buffer = oracle.state[theirs]["momentum_buffer"]
        ema.lerp_(grad, 1 - beta)
        entry = optimizer.state[ours]
        assert entry["step"] == t
        assert entry["period"] == 1
        buffer = entry["momentum_buffer"]
        assert buffer.dtype == dtype
        assert buffer.shape == shape
        assert torch.equal(buffer, reference_buffer), f"momentum differs at step {t}"
        # GefenMuon's momentum stays the plain EMA (no in-place normalisation leaks into it).
        assert torch.equal(buffer, ema), f"momentum is not the plain EMA at step {t}"
        difference = (ours.detach().float() - theirs.detach().float()).abs().max().item()
        bound = t * lr * ratio * 2.0**-6
        if dtype == torch.bfloat16:
            bound += t * 2.0**-8 * theirs.detach().float().abs().max().item()
        assert difference <= bound, f"step {t}: |Δp| = {difference} > {bound}"
        if dtype == torch.float32:
            assert torch.equal(ours.detach(), theirs.detach()), f"fp32 not bitwise at step {t}"
    assert optimizer.global_step == STEPS
    # The run moved the parameter (the parity is not vacuous).
    assert not torch.equal(ours.detach(), _initial(shape, dtype, seed))


@requires_torch_muon
@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_a_tensor_lr_scales_as_torch_muon_does(
    one_thread: None, lr_dtype: torch.dtype, fused: bool
) -> None:
    # torch forms lr·ratio and 1 − lr·wd in the lr tensor's dtype; GefenMuon formed them from
    # the lr read as a float, one float32 step apart on 11 of (40, 7)'s elements.
    for shape in [(40, 7), (7, 40), (300, 257)]:
        grads = _gradients(shape, torch.float32, seed=3)
        ours = torch.nn.Parameter(_initial(shape, torch.float32, seed=3))
        theirs = torch.nn.Parameter(_initial(shape, torch.float32, seed=3))
        lr = 0.0123
        optimizer = GefenMuon(
            [ours], lr=torch.tensor(lr, dtype=lr_dtype), momentum_codec="none", fused=fused
        )
        oracle = TorchMuon([theirs], lr=torch.tensor(lr, dtype=lr_dtype))
        for grad in grads:
            ours.grad, theirs.grad = grad.clone(), grad.clone()
            optimizer.step()
            oracle.step()
        assert torch.equal(ours.detach(), theirs.detach()), shape


@requires_torch_muon
def test_torch_muon_aliases_bf16_buffer_without_nesterov(one_thread: None) -> None:
    """Why the oracle exists: torch's bf16 buffer is no longer the EMA, GefenMuon's is."""
    shape, dtype = (16, 24), torch.bfloat16
    grads = _gradients(shape, dtype, 7)
    theirs = torch.nn.Parameter(_initial(shape, dtype, 7))
    ours = torch.nn.Parameter(_initial(shape, dtype, 7))
    torch_muon = TorchMuon([theirs], nesterov=False)
    optimizer = GefenMuon([ours], nesterov=False, momentum_codec="none")
    ema = torch.zeros(shape, dtype=dtype)
    for grad in grads[:2]:
        theirs.grad, ours.grad = grad.clone(), grad.clone()
        torch_muon.step()
        optimizer.step()
        ema.lerp_(grad, 0.05)
    assert torch.equal(optimizer.state[ours]["momentum_buffer"], ema)
    if torch.equal(torch_muon.state[theirs]["momentum_buffer"], ema):
        pytest.skip("this torch no longer aliases the bf16 momentum buffer")
    # The normalised buffer has unit Frobenius norm (up to bf16 rounding).
    norm = torch_muon.state[theirs]["momentum_buffer"].float().norm().item()
    assert math.isclose(norm, 1.0, rel_tol=2e-2)


# --------------------------------------------------------------------------------------------
# Seam 2: codebook8 — Nesterov after quantization, stored state the plain EMA


class _Spy:
    """Records every Newton–Schulz input (cloned) and delegates to the real kernel."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def __call__(self, matrix: torch.Tensor, schedule: Any, eps: float) -> torch.Tensor:
        self.inputs.append(matrix.detach().clone())
        return newton_schulz(matrix, schedule, eps)


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_codebook8_newton_schulz_input_and_plain_ema(
    one_thread: None,
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, int],
    dtype: torch.dtype,
    nesterov: bool,
) -> None:
    seed = SHAPES.index(shape) * 100 + DTYPES.index(dtype) * 10
    grads = _gradients(shape, dtype, seed)
    param = torch.nn.Parameter(_initial(shape, dtype, seed))
    beta = 0.8
    optimizer = GefenMuon([param], momentum=beta, nesterov=nesterov, momentum_codec="codebook8")
    spy = _Spy()
    monkeypatch.setattr(update_module, "newton_schulz", spy)
    previous: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    for t, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        optimizer.step()
        assert len(spy.inputs) == t
        entry = optimizer.state[param]
        period = entry["period"]
        assert entry["step"] == t
        if codebook is None:
            codebook = optimizer.codebook.clone()
        assert torch.equal(optimizer.codebook, codebook)  # learned once, frozen
        stored = decode_blocks(entry["momentum_codes"], entry["momentum_scale"], codebook)
        g32 = grad.to(torch.float32)
        if previous is None:
            previous = torch.zeros(stored.shape)  # zero codes and scale decode to exactly 0
        # Stored state: the plain EMA of the decoded previous state, re-encoded.
        ema = torch.lerp(previous, g32.reshape(-1, period), 1.0 - beta)
        codes, scale = encode_blocks(ema.reshape(-1), codebook, period)
        assert torch.equal(entry["momentum_codes"], codes), f"codes differ at step {t}"
        assert torch.equal(entry["momentum_scale"], scale), f"scales differ at step {t}"
        decoded = stored.reshape(shape)
        expected = torch.lerp(g32, decoded, beta) if nesterov else decoded
        seen = spy.inputs[-1]
        assert seen.dtype == torch.float32
        assert seen.shape == shape
        assert torch.equal(seen, expected), f"Newton–Schulz input differs at step {t}"
        previous = stored
    # Nesterov is applied after quantization, not to the unquantized EMA: with the unquantized
    # EMA the input would differ (the seam above is not satisfied by a pre-quantization lerp).
    if nesterov and shape != (1, 8):
        exact = torch.zeros(shape)
        for grad in grads:
            exact = torch.lerp(exact, grad.float(), 1.0 - beta)
        unquantized = torch.lerp(grads[-1].float(), exact, beta)
        assert not torch.equal(spy.inputs[-1], unquantized)
