"""The native CPU update (docs/core.md §11): ``gefen_update.c`` built on first use.

Inductor's CPU code performs every indirect load lane by lane and decodes each block twice, so
the compiled Python source cannot reach fused AdamW's speed on a CPU. This small C kernel does
one block at a time in an L1-resident buffer; on AVX-512 CPUs with VBMI its table lookups are
byte permutations in registers instead of gathers (``gefen_avx512.h``), on AVX2 CPUs its passes
run eight lanes at a time with gathers (``gefen_avx2.h``). It is compiled with
the C compiler inductor needs anyway (``cc``/``gcc``, ``-O3 -march=native``, OpenMP when
available) into a per-user cache and called through ``ctypes`` with raw pointers, so it needs
no Python or torch headers and builds in about a second. It covers codebook8 and codebook4 on fp32
and bf16 parameters, both families, nearest and stochastic rounding; everything else takes the
inductor implementation. The same library holds the CPU finiteness check of §7.2
(``first_nonfinite``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import torch
from torch import Tensor

from gefen.core.kernels import fused_update as reference
from gefen.core.updaters import (
    StepScalars,
    Updater,
    eager_advance_momentum_,
    eager_update_,
    hyper_values,
    stream_value,
)
from gefen.dist.torch_internals import tensor_version

__all__ = [
    "EncodeTables",
    "GradientSums",
    "NativeMomentum",
    "NativeUpdater",
    "build_library",
    "first_nonfinite",
    "native_momentum",
    "native_updater",
    "simd_available",
    "simd_passes",
]

logger = logging.getLogger("gefen.core")

_SOURCE = pathlib.Path(__file__).with_name("gefen_update.c")
_HEADERS = tuple(
    pathlib.Path(__file__).with_name(name)
    for name in (
        "gefen_avx512.h",
        "gefen_avx2.h",
        "gefen_tables.h",
        "gefen_finite.h",
        "gefen_momentum.h",
    )
)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_F32 = torch.float32  # the state's dtype, explicit: a caller's set_default_dtype must not reach it
_LOCK = threading.Lock()
_LIBRARY: ctypes.CDLL | None = None


class _Scalars(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("sqrt_bc2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("inv_bc1", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("has_decay", ctypes.c_int32),
        ("write", ctypes.c_int32),
        ("stochastic", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("portable", ctypes.c_int32),
        ("factored_floor", ctypes.c_int32),
        ("nesterov", ctypes.c_int32),
        ("stream", ctypes.c_uint64),
    ]


def _machine_key() -> str:
    """What ``-march=native`` depends on: the CPU's flags (a cache shared between machines
    must never hand one machine another's instructions)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("GEFEN_NATIVE_CACHE")
    if root:
        return pathlib.Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "gefen" / "native"


def _compiler() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler found (set CC, or install gcc)")


def _compile(target: pathlib.Path) -> None:
    compiler = _compiler()
    base = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = pathlib.Path(scratch) / target.name
        for flags in (["-fopenmp"], []):  # OpenMP when the toolchain has it
            command = [*base, *flags, str(_SOURCE), "-o", str(built), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode == 0:
                os.replace(built, target)  # atomic: concurrent ranks never see half a file
                return
        raise RuntimeError(f"building the native kernel failed: {result.stderr.strip()[-500:]}")


def _load(target: pathlib.Path) -> ctypes.CDLL:
    """The library at ``target``, built when missing, and rebuilt when a cached file does not
    load (truncated by a full disk, another toolchain's): a bad file is never trusted again."""
    if target.exists():
        try:
            return ctypes.CDLL(str(target))
        except OSError as error:
            logger.warning("cached native kernel %s does not load (%s): rebuilding", target, error)
    logger.info("building the native Gefen kernel into %s", target)
    _compile(target)
    return ctypes.CDLL(str(target))


def build_library() -> ctypes.CDLL:
    """The loaded kernel library, compiled into the cache on first use (into a directory of
    this process's own where the cache cannot be written); raises on failure."""
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is not None:
            return _LIBRARY
        sources = b"".join(path.read_bytes() for path in (_SOURCE, *_HEADERS))
        name = f"gefen_update-{hashlib.sha256(sources).hexdigest()[:16]}-{_machine_key()}.so"
        try:
            library = _load(_cache_dir() / name)
        except OSError as error:  # not writable, a file in its path, a bad file kept anyway
            scratch = pathlib.Path(tempfile.mkdtemp(prefix="gefen-native-"))
            logger.warning("native kernel cache unusable (%s): building into %s", error, scratch)
            try:
                library = _load(scratch / name)
            finally:  # a loaded library stays mapped: nothing of the build need outlive it
                shutil.rmtree(scratch, ignore_errors=True)
        function = library.gefen_update_codebook8
        function.restype = ctypes.c_int
        function.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.POINTER(_Scalars), ctypes.c_void_p,
        ]  # fmt: skip
        sums = library.gefen_factored_sums
        sums.restype = ctypes.c_int
        sums.argtypes = [
            ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int32,
        ]  # fmt: skip
        momentum = library.gefen_momentum_codebook8
        momentum.restype = ctypes.c_int
        momentum.argtypes = [
            ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.POINTER(_Scalars),
        ]  # fmt: skip
        library.gefen_build_tables.restype = ctypes.c_int
        library.gefen_build_tables.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
        library.gefen_tables_size.restype = ctypes.c_int64
        library.gefen_tables_size.argtypes = []
        library.gefen_simd_available.restype = ctypes.c_int32
        library.gefen_simd_available.argtypes = []
        finite = library.gefen_first_nonfinite
        finite.restype = ctypes.c_int64
        finite.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        _LIBRARY = library
        return library


def simd_passes() -> tuple[str, ...]:
    """The SIMD passes the built kernel has, fastest first: ``"avx512"``, ``"avx2"`` (the
    ``passes`` an updater may force; the portable loops are always there)."""
    bits = int(build_library().gefen_simd_available())
    return tuple(name for bit, name in ((1, "avx512"), (2, "avx2")) if bits & bit)


def simd_available() -> bool:
    """Whether the built kernel has SIMD passes (else only the portable loops)."""
    return bool(simd_passes())


_PASSES = {"best": 0, "portable": 1, "avx2": 2}
"""``gefen_scalars.portable``: the fastest passes, the portable loops only, or the AVX2 passes
(the AVX-512 ones skipped: how an AVX-512 machine tests the AVX2 ones)."""


def _passes_flag(portable: bool, passes: str) -> int:
    """``gefen_scalars.portable`` for an updater's ``portable`` / ``passes`` arguments."""
    if passes not in _PASSES:
        raise ValueError(f"passes must be one of {sorted(_PASSES)}, got {passes!r}")
    return _PASSES["portable" if portable else passes]


_FINITE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def first_nonfinite(tensors: list[Tensor]) -> int | None:
    """The position of the first tensor holding a NaN or ±Inf (-1 if none), in one native
    pass over each; None where the native check does not apply: the library is not loaded yet
    (only a kernel selection loads it, so an eager-only run never builds it), or a tensor is
    not a contiguous CPU tensor of a floating dtype it reads."""
    library = _LIBRARY
    if library is None or not tensors:
        return None
    for tensor in tensors:
        if (
            tensor.device.type != "cpu"
            or tensor.dtype not in _FINITE_DTYPES
            or not tensor.is_contiguous()
        ):
            return None
    count = len(tensors)
    pointers, sizes, kinds = [], [], []
    for tensor in tensors:  # loops, not generators: this runs every step
        pointers.append(tensor.data_ptr())
        sizes.append(tensor.numel())
        kinds.append(_FINITE_DTYPES[tensor.dtype])
    return int(
        library.gefen_first_nonfinite(
            (ctypes.c_void_p * count)(*pointers),
            (ctypes.c_int64 * count)(*sizes),
            (ctypes.c_int32 * count)(*kinds),
            count,
        )
    )


class EncodeTables:
    """The kernel's encode tables of a codebook (``gefen_tables`` in the C file: bucket counts,
    the nearest-rounding thresholds and their byte planes), built by the library and cached by
    the codebook tensor and its version, as ``gefen.core.updaters.CodebookTables`` does."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library
        self._size = int(library.gefen_tables_size())
        self._codebook: Tensor | None = None
        self._codebook_version = -1
        self._tables = torch.zeros(0, dtype=torch.uint8)

    def get(self, codebook: Tensor) -> Tensor:
        if codebook is not self._codebook or tensor_version(codebook) != self._codebook_version:
            values = codebook.detach().to(device="cpu", dtype=torch.float32).contiguous()
            tables = torch.zeros(self._size, dtype=torch.uint8)
            built = self._library.gefen_build_tables(
                values.data_ptr(), values.numel(), tables.data_ptr()
            )
            if built != 0:
                raise ValueError("native kernel: the codebook is not strictly increasing")
            self._tables, self._codebook = tables, codebook
            self._codebook_version = tensor_version(codebook)
        return self._tables


GradientSums = tuple[int, int, Tensor]
"""A factored gradient's row means and column sums of g² (rows then columns, fp32), computed by
the step preflight, after the storage address and version of the gradient they are of."""


# The packed scalars of the last call, shared by every updater (one per kernel key): a group's
# parameters share their StepScalars object and usually their step counts, so most calls of a
# step reuse them, whatever their family.
_LAST_PACKED: tuple[Any, int, int, int, int, _Scalars] | None = None


class NativeUpdater:
    """The ``Updater`` of ``gefen.core.updaters`` backed by the native kernel (CPU, contiguous)."""

    def __init__(self, *, portable: bool = False, passes: str = "best") -> None:
        library = build_library()
        self._function = library.gefen_update_codebook8
        self._sums = library.gefen_factored_sums
        self._tables = EncodeTables(library)
        self._portable = _passes_flag(portable, passes)

    def _scalars(self, scalars: Any, t: int, tau: int) -> _Scalars:
        threads = torch.get_num_threads()
        global _LAST_PACKED
        last = _LAST_PACKED
        if (
            last is not None
            and last[0] is scalars
            and last[1:5] == (t, tau, threads, self._portable)
        ):
            return last[5]
        packed = _Scalars(
            *hyper_values(scalars, t, tau)[: reference.HP_SIZE],
            int(scalars.lr * scalars.weight_decay != 0),
            int(scalars.lr != 0),
            int(scalars.seed is not None),
            threads,
            self._portable,
            int(scalars.factored_floor),
            int(scalars.nesterov),
            stream_value(scalars.seed),
        )
        _LAST_PACKED = (scalars, t, tau, threads, self._portable, packed)
        return packed

    def gradient_sums(self, grad: Tensor) -> tuple[Updater, bool] | None:
        """The factored family's reduction of a 2-D gradient (each row's mean of g², each
        column's sum), read once in the step preflight: this kernel bound to it, for the commit,
        and whether it shows the gradient finite (False: read the gradient itself, as g² may
        overflow); None for a gradient the kernel reads through a copy (not a contiguous
        fp32/bf16 CPU one)."""
        if (
            grad.dim() != 2
            or grad.dtype not in _DTYPES
            or grad.device.type != "cpu"
            or not grad.is_contiguous()
        ):
            return None
        rows, cols = int(grad.shape[0]), int(grad.shape[1])
        values = torch.empty(rows + cols, dtype=torch.float32)
        pointer = values.data_ptr()
        status = self._sums(
            grad.data_ptr(), _DTYPES[grad.dtype], rows, cols, pointer, pointer + 4 * rows,
            self._portable,
        )  # fmt: skip
        sums = (grad.data_ptr(), tensor_version(grad), values)
        return functools.partial(self, sums=sums), status == 0

    def __call__(
        self,
        param: Tensor,
        grad: Tensor,
        entry: dict[str, Any],
        scalars: Any,
        sums: GradientSums | None = None,
    ) -> None:
        """One parameter's update in place; ``sums``: the preflight's ``gradient_sums`` of this
        very gradient (used only while its storage and version are unchanged)."""
        period = int(entry["period"])
        t, tau = int(entry["step"]) + 1, int(entry["v_step"]) + 1
        work = param if param.is_contiguous() else param.contiguous()
        gradient = grad if grad.is_contiguous() else grad.contiguous()
        codebook = scalars.codebook.contiguous()
        packed = self._scalars(scalars, t, tau)
        v_row, v_col, v_block = entry.get("v_row"), entry.get("v_col"), entry.get("v_block")
        rows, cols = (int(param.shape[0]), int(param.shape[1])) if v_row is not None else (0, 0)
        reduced = None
        if (
            sums is not None
            and v_row is not None
            and gradient is grad
            and sums[2].numel() == rows + cols
            and sums[0] == grad.data_ptr()
            and sums[1] == tensor_version(grad)
        ):
            reduced = sums[2].data_ptr()
        status = self._function(
            work.data_ptr(), gradient.data_ptr(), _DTYPES[param.dtype],
            entry["momentum_codes"].data_ptr(), entry["momentum_scale"].data_ptr(),
            None if v_block is None else v_block.data_ptr(),
            None if v_row is None else v_row.data_ptr(),
            None if v_col is None else v_col.data_ptr(),
            rows, cols, param.numel() // period, period,
            codebook.data_ptr(), self._tables.get(scalars.codebook).data_ptr(),
            ctypes.byref(packed), reduced,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"native kernel rejected its input (status {status})")
        if work is not param and scalars.lr != 0:
            param.copy_(work)
        entry["step"], entry["v_step"] = t, tau


def native_updater(key: tuple[str, torch.dtype, str, str]) -> NativeUpdater:
    """Build (or load) the library and check it on a tiny parameter against the reference."""
    updater = NativeUpdater()
    _self_test(updater, key)
    return updater


def _self_test(updater: NativeUpdater, key: tuple[str, torch.dtype, str, str]) -> None:
    _, dtype, codec, family = key
    size = 16 if codec == "codebook4" else 256  # codebook4: two codes per byte
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(4, 8, generator=generator, dtype=_F32).to(dtype)
    grad = torch.randn(4, 8, generator=generator, dtype=_F32).to(dtype)
    entry: dict[str, Any] = {
        "period": 8,
        "step": 0,
        "v_step": 0,
        "momentum_codes": torch.zeros(4, 8 if size == 256 else 4, dtype=torch.uint8),
        "momentum_scale": torch.zeros(4, 1, dtype=_F32),
    }
    if family == "factored":
        entry["v_row"], entry["v_col"] = torch.zeros(4, dtype=_F32), torch.zeros(8, dtype=_F32)
    else:
        entry["v_block"] = torch.zeros(4, 1, dtype=_F32)
    expected_param = param.clone()
    expected = {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
    codebook = torch.linspace(-1.0, 1.0, size, dtype=_F32)
    scalars = StepScalars(
        1e-2, (0.9, 0.999), 1e-8, 0.1, codebook, None, factored_floor=True, nesterov=True
    )
    updater(param, grad, entry, scalars)
    eager_update_(expected_param, grad, expected, scalars)
    if not torch.equal(entry["momentum_codes"], expected["momentum_codes"]) or not torch.allclose(
        param.float(), expected_param.float(), rtol=1e-5, atol=1e-7
    ):
        raise RuntimeError("the native kernel disagrees with the eager reference")


class NativeMomentum:
    """GefenMuon's codebook momentum (``gefen.core.updaters.MomentumAdvancer``; codebook8, or
    codebook4's packed codes) on the native kernel: fp32 and bf16 gradients; other dtypes take
    the eager reference."""

    def __init__(self, *, portable: bool = False, passes: str = "best") -> None:
        library = build_library()
        self._function = library.gefen_momentum_codebook8
        self._tables = EncodeTables(library)
        self._portable = _passes_flag(portable, passes)

    def __call__(
        self,
        grad: Tensor,
        codes: Tensor,
        scale: Tensor,
        codebook: Tensor,
        weight: float,
        seed: tuple[int, ...] | None,
    ) -> Tensor:
        if grad.dtype not in _DTYPES or grad.device.type != "cpu":
            return eager_advance_momentum_(grad, codes, scale, codebook, weight, seed)
        blocks = codes.shape[0]
        period = grad.numel() // blocks
        gradient = grad.reshape(blocks, period).contiguous()
        tables = self._tables.get(codebook)
        out = torch.empty(blocks, period, dtype=torch.float32)
        packed = _Scalars(one_minus_beta1=weight, stochastic=int(seed is not None))
        packed.threads = torch.get_num_threads()
        packed.portable = self._portable
        packed.stream = stream_value(seed)
        status = self._function(
            gradient.data_ptr(), _DTYPES[grad.dtype], codes.data_ptr(), scale.data_ptr(),
            out.data_ptr(), blocks, period, codebook.contiguous().data_ptr(), tables.data_ptr(),
            ctypes.byref(packed),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"native kernel rejected its input (status {status})")
        return out


def native_momentum(codebook_size: int = 256) -> NativeMomentum:
    """Build (or load) the library and check the momentum kernel against the reference, for a
    codebook of ``codebook_size`` values (16: codebook4's two codes per byte)."""
    advance = NativeMomentum()
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(4, 8, generator=generator, dtype=_F32)
    width = 8 if codebook_size == 256 else 4
    codes = torch.randint(0, 256, (4, width), dtype=torch.uint8, generator=generator)
    scale = torch.rand(4, 1, generator=generator, dtype=_F32)
    codebook = torch.linspace(-1.0, 1.0, codebook_size, dtype=_F32)
    expected_codes, expected_scale = codes.clone(), scale.clone()
    got = advance(grad, codes, scale, codebook, 0.05, (3, 1))
    want = eager_advance_momentum_(grad, expected_codes, expected_scale, codebook, 0.05, (3, 1))
    if not torch.equal(codes, expected_codes) or not torch.allclose(got, want, rtol=1e-6):
        raise RuntimeError("the native momentum kernel disagrees with the eager reference")
    return advance
