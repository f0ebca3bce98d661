"""The compiled update does not depend on how it is chunked (docs/core.md §11).

The compiled path calls its kernels over chunks of whole blocks: 2¹⁸ elements on the CPU and
2²⁴ on an accelerator, where each call's host cost would otherwise dominate. Blocks never span
chunks, stochastic rounding draws by logical element index and a factored chunk's second
moment comes from its own rows, so the chunk size must not change a single bit of the state or
the parameters. Small chunks here stand in for the CPU's size against a larger parameter, and
the default size for the accelerator's. At the default size each factored matrix fits one chunk
and takes one call for its moments and its update; in small chunks it takes the moments' call
and one per chunk.
"""

from __future__ import annotations

import pytest
import torch

import gefen.core.compiled as compiled
from gefen.core import Gefen
from gefen.core.compiled import FusedMomentum
from gefen.core.testing import compiled_path_only, fill_grads
from gefen.core.updaters import CHUNK_ELEMENTS, chunk_elements, eager_advance_momentum_

# factored matrices whose rows do and do not fit a chunk whole; block vectors and a block
# matrix (group 2) longer than the small chunks
SHAPES = [(40, 24), (50, 30), (1000,), (30, 50), (777,)]


def _train(monkeypatch, chunk: int | None, codec: str, stochastic: bool, device: str):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(device)) for s in SHAPES]
    groups = [{"params": params[:3]}, {"params": params[3:], "factored_v_2d": False}]
    with monkeypatch.context() as patch:
        if chunk is not None:
            patch.setattr(compiled, "chunk_elements", lambda device_type: chunk)
        optimizer = Gefen(
            groups,
            lr=1e-2,
            weight_decay=0.1,
            momentum_codec=codec,
            stochastic_round=stochastic,
            fused=True,
        )
        for step in range(4):
            fill_grads(params, step)
            for p in params:
                p.grad = p.grad.to(device)
            optimizer.step()
    return params, optimizer


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("codec", "stochastic"), [("codebook8", True), ("codebook4", False), ("none", False)]
)
def test_the_compiled_update_is_the_same_bits_whatever_its_chunk(
    monkeypatch, codec, stochastic, device
) -> None:
    compiled_path_only(monkeypatch)
    whole, reference = _train(monkeypatch, None, codec, stochastic, device)
    for chunk in (64, 200):  # a block or two per call; and several blocks, rows cut mid-way
        params, optimizer = _train(monkeypatch, chunk, codec, stochastic, device)
        for p, q in zip(whole, params, strict=True):
            assert torch.equal(p, q), (chunk, tuple(p.shape))
            ours, theirs = reference.state[p], optimizer.state[q]
            assert ours.keys() == theirs.keys()
            for key, value in ours.items():
                if torch.is_tensor(value):
                    assert torch.equal(value, theirs[key]), (chunk, key)
                else:
                    assert value == theirs[key], (chunk, key)


@pytest.mark.parametrize("seed", [None, (3, 1)])
def test_the_compiled_momentum_is_the_same_bits_whatever_its_chunk(seed) -> None:
    generator = torch.Generator().manual_seed(1)
    codebook = torch.sort(torch.rand(254, generator=generator) * 2 - 1).values
    codebook = torch.cat([torch.tensor([-1.0]), codebook, torch.tensor([1.0])])
    codes = torch.randint(0, 256, (24, 96), dtype=torch.uint8, generator=generator)
    scale = torch.rand(24, 1, generator=generator)
    grad = torch.randn(24, 96, generator=generator)
    results = []
    for chunk in (None, 96, 5 * 96):  # the default (one call), one block a call, five
        twin_codes, twin_scale = codes.clone(), scale.clone()
        with torch.no_grad():
            out = FusedMomentum("cpu", chunk)(grad, twin_codes, twin_scale, codebook, 0.1, seed)
        results.append((out, twin_codes, twin_scale))
    for out, twin_codes, twin_scale in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(twin_codes, results[0][1])
        assert torch.equal(twin_scale, results[0][2])
    # and the chunked result is the momentum the eager reference advances to (§11's bounds)
    want = eager_advance_momentum_(grad, codes, scale, codebook, 0.1, seed)
    torch.testing.assert_close(want, results[1][0], rtol=1e-5, atol=1e-7)


def test_an_accelerator_takes_larger_chunks_than_the_cpu() -> None:
    # the CPU keeps a chunk in cache; elsewhere fewer, larger calls keep the host off the
    # critical path (2^22 elements: a 4096 x 4096 matrix in four calls, not 64)
    assert chunk_elements("cpu") == CHUNK_ELEMENTS
    assert chunk_elements("cuda") >= 16 * chunk_elements("cpu")
