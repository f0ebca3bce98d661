"""The native CPU kernel's own paths (gefen.core.native): the AVX-512 passes against the
portable loops bit for bit, the nearest-rounding thresholds against ``nearest_index``, and the
native finiteness check of §7.2."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from gefen.core.kernels import nearest_index
from gefen.core.updaters import StepScalars

pytestmark = pytest.mark.skipif(
    not any(shutil.which(name) for name in ("cc", "gcc", "clang")), reason="needs a C compiler"
)


def _learned_like_codebook() -> torch.Tensor:
    # Dense near 0, sparse near ±1, like a learned codebook (and exactly ±1 at the ends).
    u = torch.linspace(-1.0, 1.0, 256, dtype=torch.float64)
    return (u.sign() * u.abs() ** 1.6).to(torch.float32)


def _clustered_codebook() -> torch.Tensor:
    # 200 codewords inside [-0.01, 0.01]: the coarse table's window exceeds the SIMD limit, so
    # the portable loops take over inside the same call.
    inner = torch.linspace(-0.01, 0.01, 200)
    outer = torch.cat([torch.linspace(-1.0, -0.02, 28), torch.linspace(0.02, 1.0, 28)])
    return torch.sort(torch.cat([inner, outer])).values


def _sixteen() -> torch.Tensor:
    # codebook4's size: two codes per byte (the SIMD passes see them unpacked)
    u = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64)
    return (u.sign() * u.abs() ** 1.6).to(torch.float32)


CODEBOOKS = {
    "learned": _learned_like_codebook,
    "sixteen": _sixteen,
    "uniform": lambda: torch.linspace(-1.0, 1.0, 256),
    "clustered": _clustered_codebook,
}


def _entry(shape: tuple[int, ...], period: int, factored: bool, size: int) -> dict[str, Any]:
    from gefen.core.kernels.blocks import pack_codes

    numel = torch.Size(shape).numel()
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(
        0, size, (numel // period, period), dtype=torch.uint8, generator=generator
    )
    entry: dict[str, Any] = {
        "period": period,
        "step": 0,
        "v_step": 0,
        "momentum_codes": codes if size == 256 else pack_codes(codes),
        "momentum_scale": torch.rand(numel // period, 1, generator=generator),
    }
    if factored:
        entry["v_row"], entry["v_col"] = torch.zeros(shape[0]), torch.zeros(shape[1])
    else:
        entry["v_block"] = torch.zeros(numel // period, 1)
    return entry


def _simd_or_skip(passes: str = "best") -> None:
    from gefen.core.native import simd_passes

    available = simd_passes()
    if not available:
        pytest.skip("this build of the native kernel has no SIMD passes to compare")
    if passes != "best" and passes not in available:
        pytest.skip(f"this build of the native kernel has no {passes} passes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "period", "factored"),
    [
        ((37, 24), 24, True),  # rows of 24: tails in every 64-lane chunk
        ((8, 1000), 4000, True),  # blocks spanning rows, longer than one 64-chunk
        ((3, 5000), 15000, False),  # a block longer than the kernel's scratch
        ((777,), 7, False),
        ((130,), 65, False),
        ((4096,), 64, False),
        ((3,), 1, False),
    ],
)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("codebook_name", ["learned", "clustered", "sixteen"])
@pytest.mark.parametrize("passes", ["best", "avx2"])  # an AVX-512 build holds both
def test_the_simd_passes_match_the_portable_loops_bit_for_bit(
    dtype, shape, period, factored, stochastic, codebook_name, passes
) -> None:
    from gefen.core.native import NativeUpdater

    _simd_or_skip(passes)
    simd, portable = NativeUpdater(passes=passes), NativeUpdater(portable=True)
    generator = torch.Generator().manual_seed(7)
    param = (torch.randn(shape, generator=generator) * 3).to(dtype)
    twin = param.clone()
    codebook = CODEBOOKS[codebook_name]()
    entry = _entry(shape, period, factored, codebook.numel())
    twin_entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
    for step in range(4):
        grad = (torch.randn(shape, generator=generator) * 10.0 ** (step - 2)).to(dtype)
        lr = 0.0 if step == 2 else 1e-2  # lr = 0: state advances, the parameter stays
        seed = (step, 3) if stochastic else None
        # both factored estimates: the g²-floored one (its own pass) on odd steps
        scalars = StepScalars(lr, (0.9, 0.999), 1e-8, 0.1, codebook, seed, step % 2 == 1)
        simd(param, grad, entry, scalars)
        portable(twin, grad, twin_entry, scalars)
        assert torch.equal(param, twin)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, twin_entry[key]), key


@pytest.mark.parametrize("codebook_name", sorted(CODEBOOKS))
@pytest.mark.parametrize("passes", ["best", "avx2", "portable"])
def test_the_thresholds_round_exactly_like_nearest_index(codebook_name, passes) -> None:
    # weight 1 makes the advanced momentum the gradient itself; a 1.0 in every block makes the
    # block scale 1, so the kernel encodes exactly these values.
    from gefen.core.native import NativeMomentum

    if passes != "portable":
        _simd_or_skip(passes)
    codebook = CODEBOOKS[codebook_name]()
    below, above = codebook[:-1], codebook[1:]
    halfway = (below + above) / 2
    probes = torch.cat(
        [
            codebook,
            halfway,
            torch.nextafter(halfway, torch.full_like(halfway, -2.0)),
            torch.nextafter(halfway, torch.full_like(halfway, 2.0)),
            torch.nextafter(codebook, torch.full_like(codebook, 2.0)),
            torch.nextafter(codebook, torch.full_like(codebook, -2.0)),
            torch.rand(5000, generator=torch.Generator().manual_seed(1)) * 2 - 1,
            torch.tensor([0.0, -0.0, 1.0, -1.0]),
        ]
    ).clamp(-1.0, 1.0)
    period = 127
    blocks = -(-probes.numel() // (period - 1))
    padded = torch.zeros(blocks * (period - 1))
    padded[: probes.numel()] = probes
    values = torch.cat([torch.ones(blocks, 1), padded.reshape(blocks, period - 1)], dim=1)
    packed = codebook.numel() == 16
    codes = torch.zeros(blocks, (period + 1) // 2 if packed else period, dtype=torch.uint8)
    scale = torch.zeros(blocks, 1)
    NativeMomentum(passes=passes)(values, codes, scale, codebook, 1.0, None)
    assert torch.equal(scale, torch.ones(blocks, 1))
    if packed:
        from gefen.core.kernels.blocks import unpack_codes

        assert not bool((codes[:, -1] >> 4).any())  # the odd block's padding nibble
        codes = unpack_codes(codes, period).to(torch.uint8)
    assert torch.equal(codes, nearest_index(codebook, values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 40, 99])
def test_the_native_finiteness_check_finds_the_first_bad_tensor(dtype, bad, where) -> None:
    from gefen.core.native import build_library, first_nonfinite

    build_library()
    tensors = [torch.randn(100).to(dtype) * 1e3 for _ in range(3)]
    tensors.append(torch.full((5,), torch.finfo(dtype).max, dtype=dtype))  # finite extremes
    assert first_nonfinite(tensors) == -1
    tensors[1][where] = bad
    tensors[2][0] = bad
    assert first_nonfinite(tensors) == 1


def test_the_native_finiteness_check_declines_what_it_cannot_read(monkeypatch) -> None:
    import gefen.core.native as native

    native.build_library()
    assert native.first_nonfinite([torch.randn(4, 4).t()]) is None  # not contiguous
    assert native.first_nonfinite([torch.ones(3, dtype=torch.int32)]) is None
    monkeypatch.setattr(native, "_LIBRARY", None)  # never loaded: the torch path decides
    assert native.first_nonfinite([torch.randn(3)]) is None


def test_a_non_finite_gradient_is_rejected_by_name_through_the_native_check() -> None:
    from gefen.core import Gefen
    from gefen.core.native import build_library
    from gefen.core.validation import NonFiniteGradientError

    build_library()
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(100))]
    optimizer = Gefen(params, lr=1e-2)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    before = [param.detach().clone() for param in params]
    state = {k: v.clone() for k, v in optimizer.state[params[1]].items() if torch.is_tensor(v)}
    params[1].grad[99] = float("nan")  # the tail of the second gradient
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\[1\]"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    for key, value in state.items():
        assert torch.equal(value, optimizer.state[params[1]][key]), key
    params[1].grad = torch.randn_like(params[1])
    optimizer.step()  # still trains
    assert not torch.equal(before[1], params[1])


def test_an_unknown_choice_of_passes_is_refused_by_name() -> None:
    from gefen.core.native import NativeMomentum, NativeUpdater

    for kind in (NativeUpdater, NativeMomentum):
        with pytest.raises(ValueError, match="passes must be one of"):
            kind(passes="avx1024")


_BUILD = (
    "import logging; logging.basicConfig(level=logging.WARNING)\n"
    "from gefen.core.native import build_library\n"
    "build_library()\n"
    "print('loaded')\n"
)


def _build_in(cache: Any, **environ: str) -> Any:
    """``build_library()`` in a fresh process (a loaded library stays loaded in this one) with
    the kernel cache at ``cache``."""
    import os
    import subprocess
    import sys

    environment = dict(os.environ, GEFEN_NATIVE_CACHE=str(cache), **environ)
    command = [sys.executable, "-c", _BUILD]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)


def test_a_cached_kernel_that_does_not_load_is_rebuilt(tmp_path) -> None:
    """An empty or truncated file in the cache (a full disk) was trusted for good: every later
    process failed to load it and ran the step on inductor, several times slower."""
    cache = tmp_path / "cache"
    first = _build_in(cache)
    assert first.returncode == 0, first.stderr
    (built,) = cache.glob("gefen_update-*.so")
    built.write_bytes(b"")
    second = _build_in(cache)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "loaded"
    assert "does not load" in second.stderr
    assert built.stat().st_size > 0  # rebuilt in place: the next process loads it as it is
    third = _build_in(cache)
    assert third.returncode == 0, third.stderr
    assert "does not load" not in third.stderr


def test_an_unusable_cache_directory_gives_way_to_one_of_the_process(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache path runs through a file: nothing can be written there
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = _build_in(blocker / "cache", TMPDIR=str(scratch))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"
    assert "native kernel cache unusable" in done.stderr
    assert list(scratch.iterdir()) == []  # each process left its build folder behind
