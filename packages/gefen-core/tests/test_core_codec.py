"""The block codec (docs/core.md §1.1) and the codebook check (§5.4)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from gefen.core.codec import decode_blocks, encode_blocks
from gefen.core.kernels import nearest_index, solve_codebook, stochastic_index
from gefen.core.state import validate_codebook


@functools.cache
def codebook() -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(4096, dtype=torch.int64)
    counts[torch.randperm(4096, generator=generator)[:500]] = 3
    counts[[0, 4095]] = 11
    return solve_codebook(counts)


def test_round_trip_shapes_dtypes_and_exact_block_maxima() -> None:
    m = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))
    codes, scale = encode_blocks(m, codebook(), 16)
    assert codes.dtype == torch.uint8
    assert codes.shape == (12, 16)
    assert scale.dtype == torch.float32
    assert scale.shape == (12, 1)
    assert torch.equal(scale, m.abs().amax(dim=1, keepdim=True))
    decoded = decode_blocks(codes, scale, codebook())
    assert decoded.dtype == torch.float32
    assert decoded.shape == (12, 16)
    peak = m.abs().argmax(dim=1, keepdim=True)
    assert torch.equal(decoded.gather(1, peak), m.gather(1, peak))
    assert set(codes.gather(1, peak).flatten().tolist()) <= {0, 255}
    widest_gap = (codebook()[1:] - codebook()[:-1]).max()
    assert bool(((decoded - m).abs() <= scale * widest_gap / 2 + 1e-7).all())


def test_encode_is_nearest_of_the_block_normalised_values() -> None:
    m = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 1e-3
    codes, _scale = encode_blocks(m, codebook(), 32)
    expected = nearest_index(codebook(), m / m.abs().amax(dim=1, keepdim=True))
    assert torch.equal(codes, expected)


def test_a_seed_selects_stochastic_rounding_and_replays() -> None:
    m = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    codes, scale = encode_blocks(m, codebook(), 32, seed=(4, 1))
    expected = stochastic_index(codebook(), m / scale, seed=(4, 1))
    assert torch.equal(codes, expected)
    assert torch.equal(codes, encode_blocks(m, codebook(), 32, seed=(4, 1))[0])
    assert not torch.equal(codes, encode_blocks(m, codebook(), 32)[0])


def test_zero_blocks_get_zero_scale_and_decode_to_zero() -> None:
    m = torch.zeros(3, 8)
    m[1] = torch.linspace(-1, 2, 8)
    codes, scale = encode_blocks(m, codebook(), 8)
    assert scale[0].item() == 0
    assert scale[2].item() == 0
    decoded = decode_blocks(codes, scale, codebook())
    assert torch.equal(decoded[0], torch.zeros(8))
    assert torch.equal(decoded[2], torch.zeros(8))
    zero_codes = torch.zeros(2, 4, dtype=torch.uint8)
    assert torch.equal(decode_blocks(zero_codes, torch.zeros(2, 1), codebook()), torch.zeros(2, 4))


def test_blocks_follow_the_logical_order() -> None:
    base = torch.randn(16, 24, generator=torch.Generator().manual_seed(3))
    transposed = base.t()
    codes, scale = encode_blocks(transposed, codebook(), 16)
    twin_codes, twin_scale = encode_blocks(transposed.contiguous().reshape(-1, 16), codebook(), 16)
    assert torch.equal(codes, twin_codes)
    assert torch.equal(scale, twin_scale)
    assert codes.shape == (24, 16)


def test_other_dtypes_are_read_as_fp32() -> None:
    m = torch.randn(4, 8, dtype=torch.bfloat16)
    codes, scale = encode_blocks(m, codebook(), 8)
    twin = encode_blocks(m.float(), codebook(), 8)
    assert torch.equal(codes, twin[0])
    assert torch.equal(scale, twin[1])


def test_codec_does_not_modify_inputs() -> None:
    m = torch.randn(4, 8)
    saved_m, version = m.clone(), m._version
    codes, scale = encode_blocks(m, codebook(), 8, seed=(0, 0))
    saved = (codes.clone(), scale.clone())
    decode_blocks(codes, scale, codebook())
    assert torch.equal(m, saved_m)
    assert m._version == version
    assert torch.equal(codes, saved[0])
    assert torch.equal(scale, saved[1])


def test_codec_rejects_malformed_inputs() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        encode_blocks(torch.zeros(10), codebook(), 4)
    with pytest.raises(ValueError, match="period"):
        encode_blocks(torch.zeros(8), codebook(), 0)
    with pytest.raises(ValueError, match="uint8"):
        decode_blocks(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 1), codebook())
    with pytest.raises(ValueError, match="scale"):
        decode_blocks(torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2), codebook())


def test_validate_codebook_accepts_a_learned_codebook() -> None:
    validate_codebook(codebook())


@pytest.mark.parametrize(
    ("make", "rule"),
    [
        (lambda cb: cb.tolist(), "torch.Tensor"),
        (lambda cb: cb.double(), "float32"),
        (lambda cb: cb.reshape(16, 16), "1-D"),
        (lambda cb: cb[:255], "256 values"),
        (lambda cb: torch.cat([cb, torch.ones(1)]), "256 values"),
        (lambda cb: cb.index_put((torch.tensor([5]),), torch.tensor(float("nan"))), "finite"),
        (lambda cb: cb.index_put((torch.tensor([255]),), torch.tensor(float("inf"))), "finite"),
        (lambda cb: cb.index_put((torch.tensor([7]),), cb[6]), "strictly increasing"),
        (lambda cb: cb.flip(0), "strictly increasing"),
        (lambda cb: cb.index_put((torch.tensor([0]),), torch.tensor(-0.9999999)), "-1.0"),
        (lambda cb: cb * 2, "-1.0"),
        (lambda cb: cb.index_put((torch.tensor([255]),), torch.tensor(0.99999994)), r"\+1.0"),
    ],
)
def test_validate_codebook_names_the_failed_rule(
    make: Callable[[torch.Tensor], object], rule: str
) -> None:
    with pytest.raises(ValueError, match=rule):
        validate_codebook(make(codebook()))
