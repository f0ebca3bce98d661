"""The per-parameter update kernels, docs/core.md §6.1-§6.2 (§12 #28, #30-#32, #34, #35, #55)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor

from gefen.core.codec import decode_blocks, encode_blocks
from gefen.core.kernels import (
    BlockUpdate,
    CodebookMomentum,
    DenseMomentum,
    FactoredUpdate,
    Momentum,
    factored_second_moment,
    histogram,
    solve_codebook,
    update_block,
    update_factored,
)

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1


@functools.cache
def codebook() -> torch.Tensor:
    gradient = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    return solve_codebook(histogram(gradient, 32))


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fresh_codes(blocks: int, period: int) -> CodebookMomentum:
    return CodebookMomentum(torch.zeros(blocks, period, dtype=torch.uint8), torch.zeros(blocks, 1))


def fresh_dense(blocks: int, period: int) -> DenseMomentum:
    return DenseMomentum(torch.zeros(blocks, period))


def reference_block_step(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, t: int
) -> tuple[Tensor, Tensor, Tensor]:
    """§6.1 closed form in float64 on (B, P) blocks: returns the new (p, m, v)."""
    beta1, beta2 = BETAS
    v = beta2 * v + (1 - beta2) * (g * g).mean(dim=1, keepdim=True)
    m = beta1 * m + (1 - beta1) * g
    denominator = (v / (1 - beta2**t)).sqrt() + EPS
    return p * (1 - LR * WD) - LR * (m / (1 - beta1**t)) / denominator, m, v


# §12 #28
def test_first_block_update_is_about_lr_g_over_block_rms() -> None:
    blocks, period, lr = 16, 32, 1e-3
    g = randn(blocks, period, seed=1) * torch.linspace(0.01, 10, blocks).unsqueeze(1)
    result = update_block(
        torch.zeros(blocks * period), g.reshape(-1), fresh_codes(blocks, period),
        torch.zeros(blocks, 1), period=period, step=0, v_step=0, lr=lr, betas=BETAS,
        eps=EPS, weight_decay=0.0, codebook=codebook(),
    )  # fmt: skip
    assert result.param is not None
    update = -result.param.reshape(blocks, period).double()
    rms = g.double().square().mean(dim=1, keepdim=True).sqrt()
    expected = lr * g.double() / (rms + EPS)
    peak = g.abs().argmax(dim=1, keepdim=True)
    torch.testing.assert_close(update.gather(1, peak), expected.gather(1, peak), rtol=1e-5, atol=0)
    widest_gap = (codebook()[1:] - codebook()[:-1]).max().item()
    bound = lr * g.abs().amax(dim=1, keepdim=True).double() * widest_gap / 2 / rms
    assert bool(((update - expected).abs() <= bound * (1 + 1e-5) + 1e-12).all())
    # The block maximum of M1 = lerp(0, g, 1 - beta1) is stored exactly.
    first_moment = torch.lerp(torch.zeros_like(g), g, 1 - BETAS[0])
    assert isinstance(result.momentum, CodebookMomentum)
    assert torch.equal(result.momentum.scale, first_moment.abs().amax(dim=1, keepdim=True))
    decoded = decode_blocks(result.momentum.codes, result.momentum.scale, codebook())
    assert torch.equal(decoded.gather(1, peak), first_moment.gather(1, peak))
    assert (result.step, result.v_step) == (1, 1)


def test_dense_block_path_follows_the_closed_form() -> None:
    blocks, period = 6, 16
    p = randn(blocks * period, seed=2)
    momentum, v = fresh_dense(blocks, period), torch.zeros(blocks, 1)
    ref_p = p.double().reshape(blocks, period)
    ref_m, ref_v = torch.zeros(blocks, period, dtype=torch.float64), torch.zeros(blocks, 1).double()
    for t in range(1, 9):
        g = randn(blocks * period, seed=100 + t)
        result = update_block(
            p, g, momentum, v, period=period, step=t - 1, v_step=t - 1, lr=LR, betas=BETAS,
            eps=EPS, weight_decay=WD,
        )  # fmt: skip
        assert result.param is not None
        assert isinstance(result.momentum, DenseMomentum)
        p, momentum, v = result.param, result.momentum, result.v_block
        ref_p, ref_m, ref_v = reference_block_step(
            ref_p, g.double().reshape(blocks, period), ref_m, ref_v, t
        )
        torch.testing.assert_close(p.double(), ref_p.reshape(-1), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(momentum.momentum.double(), ref_m, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v.double(), ref_v, rtol=1e-5, atol=0)


def test_codebook_update_applies_the_requantized_momentum() -> None:
    blocks, period = 32, 16
    p = randn(blocks * period, seed=3)
    momentum, v = fresh_codes(blocks, period), torch.zeros(blocks, 1)
    for t in range(1, 4):
        g = randn(blocks * period, seed=200 + t)
        previous = decode_blocks(momentum.codes, momentum.scale, codebook()).double()
        result = update_block(
            p, g, momentum, v, period=period, step=t - 1, v_step=t - 1, lr=LR, betas=BETAS,
            eps=EPS, weight_decay=WD, codebook=codebook(),
        )  # fmt: skip
        assert result.param is not None
        assert isinstance(result.momentum, CodebookMomentum)
        g64 = g.double().reshape(blocks, period)
        advanced = previous + (1 - BETAS[0]) * (g64 - previous)
        scale = advanced.abs().amax(dim=1, keepdim=True)
        torch.testing.assert_close(result.momentum.scale.double(), scale, rtol=1e-6, atol=0)
        distances = ((advanced / scale).unsqueeze(-1) - codebook().double()).abs()
        nearest = distances.argmin(dim=-1)
        codes = result.momentum.codes.long()
        assert (codes == nearest).double().mean() > 0.999
        assert bool(((codes - nearest).abs() <= 1).all())
        _, _, ref_v = reference_block_step(
            p.double().reshape(blocks, period), g64, previous, v.double(), t
        )
        denominator = (ref_v / (1 - BETAS[1] ** t)).sqrt() + EPS
        stored = decode_blocks(result.momentum.codes, result.momentum.scale, codebook()).double()
        decayed = p.double().reshape(blocks, period) * (1 - LR * WD)
        expected = decayed - LR * stored / (1 - BETAS[0] ** t) / denominator
        torch.testing.assert_close(
            result.param.double(), expected.reshape(-1), rtol=1e-6, atol=1e-7
        )
        unquantized = decayed - LR * advanced / (1 - BETAS[0] ** t) / denominator
        assert not torch.allclose(
            result.param.double(), unquantized.reshape(-1), rtol=1e-6, atol=1e-7
        )
        p, momentum, v = result.param, result.momentum, result.v_block


# §12 #32
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("floor", [False, True])
def test_factored_moments_are_emas_of_row_and_column_means(floor: bool, nesterov: bool) -> None:
    rows, cols = 12, 20
    p = randn(rows, cols, seed=4)
    momentum: Momentum
    momentum, v_row, v_col = (
        fresh_dense(rows * cols // 20, 20),
        torch.zeros(rows),
        torch.zeros(cols),
    )
    ref_row, ref_col = (
        torch.zeros(rows, dtype=torch.float64),
        torch.zeros(cols, dtype=torch.float64),
    )
    ref_p, ref_m = p.double(), torch.zeros(rows, cols, dtype=torch.float64)
    beta1, beta2 = BETAS
    for t in range(1, 5):
        g = randn(rows, cols, seed=300 + t)
        result = update_factored(
            p, g, momentum, v_row, v_col, period=20, step=t - 1, v_step=t - 1, lr=LR,
            betas=BETAS, eps=EPS, weight_decay=WD, factored_floor=floor, nesterov=nesterov,
        )  # fmt: skip
        assert result.param is not None
        p, momentum, v_row, v_col = result.param, result.momentum, result.v_row, result.v_col
        square = g.double().square()
        ref_row = beta2 * ref_row + (1 - beta2) * square.mean(dim=1)
        ref_col = beta2 * ref_col + (1 - beta2) * square.mean(dim=0)
        torch.testing.assert_close(v_row.double(), ref_row, rtol=1e-6, atol=0)
        torch.testing.assert_close(v_col.double(), ref_col, rtol=1e-6, atol=0)
        v_hat = torch.outer(ref_row, ref_col) / ref_row.mean()
        if floor:
            v_hat = torch.maximum(v_hat, (1 - beta2) * square)
        ref_m = beta1 * ref_m + (1 - beta1) * g.double()
        # NAdamW's look-ahead: the update applies β1·m_t + (1 - β1)·g_t; m_t alone is stored
        applied = beta1 * ref_m + (1 - beta1) * g.double() if nesterov else ref_m
        denominator = (v_hat / (1 - beta2**t)).sqrt() + EPS
        ref_p = ref_p * (1 - LR * WD) - LR * applied / (1 - beta1**t) / denominator
        torch.testing.assert_close(p.double(), ref_p, rtol=1e-5, atol=1e-7)


def test_factored_estimate_is_exact_for_rank_one_squares() -> None:
    a, b = randn(9, seed=5).abs() + 0.1, randn(14, seed=6).abs() + 0.1
    v_row, v_col = torch.zeros(9), torch.zeros(14)
    ema = torch.zeros(9, 14, dtype=torch.float64)
    beta2 = BETAS[1]
    for t, factor in enumerate([1.0, 0.5, 3.0]):
        g = factor * torch.outer(a, b) * torch.where(randn(9, 14, seed=t) > 0, 1.0, -1.0)
        result = update_factored(
            torch.zeros(9, 14), g, fresh_dense(9, 14), v_row, v_col, period=14, step=t,
            v_step=t, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
        )  # fmt: skip
        v_row, v_col = result.v_row, result.v_col
        ema = beta2 * ema + (1 - beta2) * g.double().square()
        estimate = factored_second_moment(v_row, v_col)
        assert estimate.dtype == torch.float32
        torch.testing.assert_close(estimate.double(), ema, rtol=1e-5, atol=0)


def test_floored_estimate_bounds_the_first_step_by_lr_where_the_product_does_not() -> None:
    # A diagonal gradient is far from rank one: the row-column product spreads each row's mass
    # over all 16 columns and under-estimates the diagonal 16-fold, so its first step is 4·lr;
    # the g² floor makes v̂/bc2 >= g² at t = 1, so no element moves more than lr, as with AdamW.
    g = torch.eye(16) + 1e-3
    moves = {}
    for floor in (False, True):
        result = update_factored(
            torch.zeros(16, 16), g, fresh_dense(16, 16), torch.zeros(16), torch.zeros(16),
            period=16, step=0, v_step=0, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
            factored_floor=floor,
        )  # fmt: skip
        assert result.param is not None
        moves[floor] = result.param.abs()
    assert float(moves[False].diagonal().min()) > 3 * LR
    assert float(moves[True].max()) <= LR * (1 + 1e-6)
    # off the diagonal the product is far above g² and the floor changes nothing
    off = ~torch.eye(16, dtype=torch.bool)
    assert torch.equal(moves[True][off], moves[False][off])


def test_factored_estimate_floors_the_normaliser() -> None:
    estimate = factored_second_moment(torch.zeros(3), torch.ones(4))
    assert torch.equal(estimate, torch.zeros(3, 4))


def test_bias_corrections_use_step_for_momentum_and_v_step_for_the_second_moment() -> None:
    # A migrated family (§8.4) has v_step < step: bc1 uses t = step + 1, bc2 uses τ = v_step + 1.
    blocks, period, step, v_step = 4, 8, 5, 2
    p, g = randn(blocks, period, seed=42), randn(blocks, period, seed=43)
    m, v = randn(blocks, period, seed=44) * 0.1, randn(blocks, 1, seed=45).abs()
    result = update_block(
        p, g, DenseMomentum(m), v, period=period, step=step, v_step=v_step, lr=LR,
        betas=BETAS, eps=EPS, weight_decay=WD,
    )  # fmt: skip
    assert (result.step, result.v_step) == (6, 3)
    assert result.param is not None
    beta1, beta2 = BETAS
    new_v = beta2 * v.double() + (1 - beta2) * g.double().square().mean(dim=1, keepdim=True)
    new_m = beta1 * m.double() + (1 - beta1) * g.double()
    denominator = (new_v / (1 - beta2**3)).sqrt() + EPS
    expected = p.double() * (1 - LR * WD) - LR * new_m / (1 - beta1**6) / denominator
    torch.testing.assert_close(result.param.double(), expected, rtol=1e-6, atol=1e-7)


def test_eps_is_added_outside_the_square_root() -> None:
    # With g ~ 1e-6 and eps = 1e-6 the two placements differ by two orders of magnitude.
    blocks, period, eps = 4, 8, 1e-6
    g = randn(blocks, period, seed=40) * 1e-6
    p = randn(blocks, period, seed=41)
    result = update_block(
        p, g, fresh_dense(blocks, period), torch.zeros(blocks, 1), period=period, step=0,
        v_step=0, lr=LR, betas=BETAS, eps=eps, weight_decay=0.0,
    )  # fmt: skip
    assert result.param is not None
    rms = g.double().square().mean(dim=1, keepdim=True).sqrt()
    expected = p.double() - LR * g.double() / (rms + eps)
    torch.testing.assert_close(result.param.double(), expected, rtol=1e-6, atol=1e-9)


# §12 #30
@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("family", ["block", "factored"])
def test_lr_zero_writes_nothing_while_state_advances(codec: str, family: str) -> None:
    result = run_update(family, codec, randn(8, 16, seed=7), randn(8, 16, seed=8), lr=0.0, wd=0.5)
    assert result.param is None
    assert (result.step, result.v_step) == (1, 1)
    if isinstance(result.momentum, CodebookMomentum):
        assert bool((result.momentum.scale > 0).all())
    else:
        assert bool(result.momentum.momentum.abs().sum() > 0)
    second = result.v_block if isinstance(result, BlockUpdate) else result.v_row
    assert bool((second > 0).all())


def run_update(
    family: str,
    codec: str,
    param: Tensor,
    grad: Tensor,
    *,
    lr: float = LR,
    wd: float = WD,
    period: int = 16,
    seed: tuple[int, int] | None = None,
) -> BlockUpdate | FactoredUpdate:
    """One update from fresh state, the way a shell would call it."""
    blocks = param.numel() // period
    momentum: Momentum
    if codec == "codebook8":
        momentum, table = fresh_codes(blocks, period), codebook()
    else:
        momentum, table, seed = fresh_dense(blocks, period), None, None
    if family == "block":
        return update_block(
            param, grad, momentum, torch.zeros(blocks, 1), period=period, step=0, v_step=0,
            lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, codebook=table, seed=seed,
        )  # fmt: skip
    rows, cols = param.shape
    return update_factored(
        param, grad, momentum, torch.zeros(rows), torch.zeros(cols), period=period, step=0,
        v_step=0, lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, codebook=table, seed=seed,
    )  # fmt: skip


def codes_of(result: BlockUpdate | FactoredUpdate) -> Tensor:
    assert isinstance(result.momentum, CodebookMomentum)
    return result.momentum.codes


# §12 #31
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("family", ["block", "factored"])
def test_all_zero_gradient_only_applies_decay(dtype: torch.dtype, codec: str, family: str) -> None:
    param = randn(8, 16, seed=9, dtype=dtype)
    result = run_update(family, codec, param, torch.zeros(8, 16, dtype=dtype))
    work = torch.float64 if dtype == torch.float64 else torch.float32
    assert result.param is not None
    assert torch.equal(result.param, (param.to(work) * (1 - LR * WD)).to(dtype))


# §12 #34
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("family", ["block", "factored"])
def test_state_dtypes_do_not_follow_the_parameter(dtype: torch.dtype, family: str) -> None:
    param = randn(8, 16, seed=10, dtype=dtype)
    result = run_update(family, "codebook8", param, randn(8, 16, seed=11, dtype=dtype))
    assert isinstance(result.momentum, CodebookMomentum)
    assert result.momentum.codes.dtype == torch.uint8
    assert result.momentum.scale.dtype == torch.float32
    assert result.param is not None
    assert result.param.dtype == dtype
    for name in ("v_block",) if family == "block" else ("v_row", "v_col"):
        assert getattr(result, name).dtype == torch.float32


@pytest.mark.parametrize("family", ["block", "factored"])
def test_fp16_gradient_of_300_is_widened_before_squaring(family: str) -> None:
    grad = torch.full((8, 16), 300.0, dtype=torch.float16)
    result = run_update(family, "codebook8", torch.zeros(8, 16, dtype=torch.float16), grad)
    expected = 300.0**2 * (1 - BETAS[1])
    for name in ("v_block",) if family == "block" else ("v_row", "v_col"):
        moment = getattr(result, name)
        assert bool(torch.isfinite(moment).all())
        torch.testing.assert_close(moment.double(), torch.full_like(moment.double(), expected))
    assert result.param is not None
    assert bool(torch.isfinite(result.param).all())


def test_fp64_parameters_are_written_in_fp64() -> None:
    grad = randn(4, 16, seed=12, dtype=torch.float64)
    param = torch.full((4, 16), 1.0 + 2.0**-40, dtype=torch.float64)
    result = run_update("block", "codebook8", param, grad, wd=0.0)
    twin = run_update("block", "codebook8", torch.zeros(4, 16), grad.float(), wd=0.0)
    assert result.param is not None
    assert twin.param is not None
    # The twin's parameter is exactly -U, so the fp64 write must be p - fp64(U) with no fp32 trip.
    assert torch.equal(result.param, param + twin.param.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_are_rounded_once(dtype: torch.dtype) -> None:
    grad = randn(8, 16, seed=13)
    param = randn(8, 16, seed=14, dtype=dtype)
    result = run_update("factored", "codebook8", param, grad.to(dtype))
    twin = run_update("factored", "codebook8", torch.zeros(8, 16), grad.to(dtype).float(), wd=0.0)
    assert result.param is not None
    assert twin.param is not None
    expected = (param.float() * (1 - LR * WD) + twin.param).to(dtype)
    assert torch.equal(result.param, expected)


# §12 #35
@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("family", ["block", "factored"])
def test_transposed_parameter_matches_a_contiguous_twin(codec: str, family: str) -> None:
    param = randn(16, 8, seed=15).t()
    grad = randn(16, 8, seed=16).t()
    assert not param.is_contiguous()
    assert not grad.is_contiguous()
    seed = (3, 1) if codec == "codebook8" else None
    result = run_update(family, codec, param, grad, seed=seed)
    twin = run_update(family, codec, param.contiguous(), grad.contiguous(), seed=seed)
    assert result.param is not None
    assert twin.param is not None
    assert result.param.shape == (8, 16)
    assert result.param.is_contiguous()
    assert torch.equal(result.param, twin.param)
    for left, right in zip(flat_tensors(result), flat_tensors(twin), strict=True):
        assert torch.equal(left, right)


def flat_tensors(result: BlockUpdate | FactoredUpdate) -> list[Tensor]:
    momentum = result.momentum
    tensors = (
        [momentum.codes, momentum.scale]
        if isinstance(momentum, CodebookMomentum)
        else [momentum.momentum]
    )
    if isinstance(result, BlockUpdate):
        tensors.append(result.v_block)
    else:
        tensors += [result.v_row, result.v_col]
    if result.param is not None:
        tensors.append(result.param)
    return tensors


# §12 #55 at kernel level
def test_stochastic_rounding_replays_and_depends_on_the_parameter_index() -> None:
    param, grad = randn(32, 16, seed=17), randn(32, 16, seed=18)
    first = run_update("block", "codebook8", param, grad, seed=(5, 2))
    again = run_update("block", "codebook8", param, grad, seed=(5, 2))
    other = run_update("block", "codebook8", param, grad, seed=(5, 3))
    nearest = run_update("block", "codebook8", param, grad, seed=None)
    assert torch.equal(codes_of(first), codes_of(again))
    assert first.param is not None
    assert again.param is not None
    assert torch.equal(first.param, again.param)
    assert not torch.equal(codes_of(first), codes_of(other))
    assert not torch.equal(codes_of(first), codes_of(nearest))
    advanced = torch.lerp(torch.zeros(32, 16), grad, 1 - BETAS[0])
    expected_codes, _ = encode_blocks(advanced, codebook(), 16, seed=(5, 2))
    assert torch.equal(codes_of(first), expected_codes)


def test_nesterov_applies_the_look_ahead_and_stores_what_plain_momentum_stores() -> None:
    blocks, period = 32, 16
    p = randn(blocks * period, seed=7)
    momentum, v = fresh_codes(blocks, period), torch.zeros(blocks, 1)
    for t in range(1, 4):
        g = randn(blocks * period, seed=400 + t)
        arguments: dict[str, Any] = {
            "period": period, "step": t - 1, "v_step": t - 1, "lr": LR, "betas": BETAS,
            "eps": EPS, "weight_decay": WD, "codebook": codebook(),
        }  # fmt: skip
        plain = update_block(p, g, momentum, v, **arguments)
        ahead = update_block(p, g, momentum, v, nesterov=True, **arguments)
        assert isinstance(ahead.momentum, CodebookMomentum)
        assert isinstance(plain.momentum, CodebookMomentum)
        # the look-ahead is applied, never stored: the new state is bit for bit the plain one
        assert torch.equal(ahead.momentum.codes, plain.momentum.codes)
        assert torch.equal(ahead.momentum.scale, plain.momentum.scale)
        assert torch.equal(ahead.v_block, plain.v_block)
        stored = decode_blocks(ahead.momentum.codes, ahead.momentum.scale, codebook()).double()
        g64 = g.double().reshape(blocks, period)
        applied = BETAS[0] * stored + (1 - BETAS[0]) * g64
        denominator = (ahead.v_block.double() / (1 - BETAS[1] ** t)).sqrt() + EPS
        decayed = p.double().reshape(blocks, period) * (1 - LR * WD)
        expected = decayed - LR * applied / (1 - BETAS[0] ** t) / denominator
        assert ahead.param is not None
        assert plain.param is not None
        torch.testing.assert_close(ahead.param.double(), expected.reshape(-1), rtol=1e-6, atol=1e-7)
        assert not torch.allclose(ahead.param, plain.param, rtol=1e-6, atol=1e-7)
        p, momentum, v = ahead.param, ahead.momentum, ahead.v_block


def test_block_kernel_reproduces_torch_adamw_for_20_steps() -> None:
    lr, betas, eps, wd = 1e-2, (0.9, 0.99), 1e-8, 0.1
    shapes = [(5, 3), (7,)]
    reference = [randn(*shape, seed=20 + i).requires_grad_(True) for i, shape in enumerate(shapes)]
    adamw = torch.optim.AdamW(reference, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    params = [p.detach().clone() for p in reference]
    states = [(fresh_dense(p.numel(), 1), torch.zeros(p.numel(), 1)) for p in params]
    for t in range(1, 21):
        grads = [randn(*p.shape, seed=1000 * t + i) for i, p in enumerate(params)]
        for p, g in zip(reference, grads, strict=True):
            p.grad = g.clone()
        adamw.step()
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            momentum, v = states[i]
            result = update_block(
                p, g, momentum, v, period=1, step=t - 1, v_step=t - 1, lr=lr, betas=betas,
                eps=eps, weight_decay=wd,
            )  # fmt: skip
            assert result.param is not None
            assert isinstance(result.momentum, DenseMomentum)
            params[i], states[i] = result.param, (result.momentum, result.v_block)
            torch.testing.assert_close(params[i], reference[i].detach(), rtol=1e-5, atol=1e-6)
    for (momentum, v), p in zip(states, reference, strict=True):
        state = adamw.state[p]
        torch.testing.assert_close(momentum.momentum.reshape(p.shape), state["exp_avg"])
        torch.testing.assert_close(v.reshape(p.shape), state["exp_avg_sq"])


def storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("family", ["block", "factored"])
def test_inputs_are_not_modified_and_outputs_do_not_alias_them(codec: str, family: str) -> None:
    param = randn(8, 16, seed=30).requires_grad_(True)
    grad = randn(8, 16, seed=31)
    momentum: Momentum
    if codec == "codebook8":
        codes = torch.randint(0, 256, (8, 16), dtype=torch.uint8)
        momentum, state_tensors = CodebookMomentum(codes, torch.rand(8, 1)), [codes]
        state_tensors.append(momentum.scale)
        table, seed = codebook(), (1, 2)
    else:
        momentum = DenseMomentum(randn(8, 16, seed=32))
        state_tensors, table, seed = [momentum.momentum], None, None
    v_block, v_row, v_col = torch.rand(8, 1), torch.rand(8), torch.rand(16)
    seconds = [v_block] if family == "block" else [v_row, v_col]
    inputs = [param, grad, *state_tensors, *seconds, codebook()]
    saved = [(t.detach().clone(), t._version) for t in inputs]
    result: BlockUpdate | FactoredUpdate
    if family == "block":
        result = update_block(
            param, grad, momentum, v_block, period=16, step=3, v_step=2, lr=LR, betas=BETAS,
            eps=EPS, weight_decay=WD, codebook=table, seed=seed,
        )  # fmt: skip
    else:
        result = update_factored(
            param, grad, momentum, v_row, v_col, period=16, step=3, v_step=2, lr=LR,
            betas=BETAS, eps=EPS, weight_decay=WD, codebook=table, seed=seed,
        )  # fmt: skip
    for tensor, (before, version) in zip(inputs, saved, strict=True):
        assert torch.equal(tensor.detach(), before)
        assert tensor._version == version
    outputs = flat_tensors(result)
    assert not any(storage(out) == storage(inp) for out in outputs for inp in inputs)
    assert not any(out.requires_grad for out in outputs)
    assert (result.step, result.v_step) == (4, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"period": 5}, "period"),
        ({"v_block": torch.zeros(8, 2)}, "v_block"),
        ({"grad": torch.zeros(8, 15)}, "grad shape"),
        ({"momentum": fresh_dense(8, 16)}, "no codebook"),
        ({"codebook": None}, "needs the codebook"),
        ({"momentum": fresh_codes(16, 8)}, "momentum_codes"),
        ({"step": 0, "v_step": 1}, "v_step"),
        ({"lr": torch.tensor(0.1)}, "lr must be a Python float"),
        ({"betas": (0.9, True)}, "beta2"),
    ],
)
def test_block_kernel_rejects_mismatched_inputs(change: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {
        "param": torch.zeros(8, 16), "grad": torch.zeros(8, 16),
        "momentum": fresh_codes(8, 16), "v_block": torch.zeros(8, 1), "period": 16,
        "step": 0, "v_step": 0, "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD,
        "codebook": codebook(),
    }  # fmt: skip
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        update_block(**arguments)


def test_factored_kernel_needs_a_matrix_and_matching_moments() -> None:
    with pytest.raises(ValueError, match="2-D"):
        update_factored(
            torch.zeros(16), torch.zeros(16), fresh_dense(4, 4), torch.zeros(4), torch.zeros(4),
            period=4, step=0, v_step=0, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
        )  # fmt: skip
    with pytest.raises(ValueError, match="v_col"):
        update_factored(
            torch.zeros(4, 4), torch.zeros(4, 4), fresh_dense(4, 4), torch.zeros(4), torch.zeros(3),
            period=4, step=0, v_step=0, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
        )  # fmt: skip
