"""The compiled (inductor) implementation of the fused update (docs/core.md §11).

The functions of ``gefen.core.kernels.fused_update`` compiled with ``torch.compile(fullgraph=
True, dynamic=True)`` and called over chunks of whole blocks (``chunk_elements``: 2¹⁸ elements
on the CPU, 2²⁴ on an accelerator), so the extra memory is one chunk's; the same source becomes
C++ on the CPU and Triton on CUDA. Scalars arrive packed in one tensor, so an LR schedule never
recompiles.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gefen.core.kernels import fused_update as kernels
from gefen.core.kernels.blocks import PACKED_CODEBOOK_SIZE, code_bytes, is_packed
from gefen.core.updaters import (
    CodebookTables,
    KernelKey,
    MomentumAdvancer,
    StepScalars,
    Updater,
    chunk_elements,
    hyper_values,
    stream_value,
)
from gefen.dist.torch_internals import (
    dynamo_stance,
    dynamo_unique_graphs,
    recompile_limit_error,
)

__all__ = [
    "DeviceScalars",
    "FusedMomentum",
    "FusedUpdater",
    "compiled_graph_count",
    "compiled_momentum",
    "inductor_updater",
    "pack_hyper",
    "stream_tensor",
]


class DeviceScalars:
    """The small read-only tensors the compiled kernels take (packed hyperparameters, stream
    seeds, chunk offsets, momentum weights), made once per value and device and then reused.

    Making one from host values on CUDA is a copy from pageable memory, which synchronizes the
    stream: one per parameter and chunk would stall the host behind the GPU dozens of times a
    step. The values recur (the offsets and seeds always, a group's hyperparameters for each of
    its parameters within a step), and the kernels only read these tensors, so one tensor per
    value serves every call, of every compiled updater in the process (``SCALARS``); the least
    recently used are dropped past ``capacity``.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._tensors: OrderedDict[tuple[bytes, torch.dtype, torch.device], Tensor] = OrderedDict()

    def get(
        self, values: float | tuple[float, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A 0-d (``values`` a number) or 1-d (a tuple) tensor of ``values`` on ``device``."""
        numbers = values if isinstance(values, tuple) else (values,)
        # the bytes, not the numbers: -0.0 == 0.0 as a key, but a kernel may tell them apart
        layout = "d" if dtype.is_floating_point else "q"
        key = (struct.pack(f"<{len(numbers)}{layout}", *numbers), dtype, device)
        with self._lock:  # optimizers stepping in several threads share the cache
            found = self._tensors.get(key)
            if found is not None:
                self._tensors.move_to_end(key)
                return found
            found = torch.tensor(values, dtype=dtype, device=device)
            self._tensors[key] = found
            if len(self._tensors) > self._capacity:
                self._tensors.popitem(last=False)
            return found


SCALARS = DeviceScalars()


def pack_hyper(scalars: StepScalars, t: int, tau: int, device: torch.device) -> Tensor:
    """``hyper_values`` as the one fp64 tensor the compiled kernels take."""
    return SCALARS.get(tuple(hyper_values(scalars, t, tau)), torch.float64, device)


def stream_tensor(seed: tuple[int, ...] | None, device: torch.device) -> Tensor:
    """``stream_value`` as the int64 (two's complement) 0-d tensor the fused encode hashes."""
    value = stream_value(seed)
    signed = value - (1 << 64) if value >= 1 << 63 else value
    return SCALARS.get(signed, torch.int64, device)


_F32 = torch.float32  # the state's dtype, explicit: a caller's set_default_dtype must not reach it
_COMPILED: dict[tuple[str, str, tuple[Any, ...]], Callable[..., Any]] = {}

GRAPHS_PER_VARIANT = 64
"""Dynamo's recompile limit for each compiled variant. Even with ``dynamic=True`` a shape
compiles a graph of its own class: a dimension of 1 (sizes 0 and 1 are specialised), equal
dimensions (duck sizing), a dimension over inductor's CPU reduction bound (4096), a parameter
with or without ``requires_grad``. Dynamo's default limit is 8, and past it ``fullgraph=True``
raises in the middle of the commit: a model with nine such shapes (an embedding of 4100 rows,
``Linear(64, 1)``, a square and a non-square matrix ...) left its step half-written, latched."""


def _compiled(function: Callable[..., Any], device_type: str, variant: tuple[Any, ...]) -> Any:
    """``function`` compiled for one structural variant (dtypes, codec, flags, scan window),
    shared by every optimizer in the process.

    Each variant gets its own copy of the function's code object: Dynamo caches graphs (and
    counts its recompile limit) per code object, so variants never evict one another and the
    graphs are bounded by the variants in use, whatever the shapes (dynamic) or scalars
    (tensors) of the calls.
    """
    key = (function.__name__, device_type, variant)
    found = _COMPILED.get(key)
    if found is None:
        code = function.__code__.replace(co_name=f"{function.__name__}_v{len(_COMPILED)}")
        clone = types.FunctionType(
            code, function.__globals__, code.co_name, function.__defaults__, function.__closure__
        )
        compiled = torch.compile(  # type: ignore[call-overload]  # the overloads lack the limit
            clone, fullgraph=True, dynamic=True, recompile_limit=GRAPHS_PER_VARIANT
        )
        found = _COMPILED[key] = _in_the_default_stance(compiled, function)
    return found


def _in_the_default_stance(
    compiled: Callable[..., Any], eager: Callable[..., Any]
) -> Callable[..., Any]:
    """``compiled`` run in Dynamo's default stance: a new shape class compiles its graph on
    first use, inside a commit, where a caller's ``set_stance("fail_on_recompile")`` (a promise
    about their own code) would fail the step part-way and latch it. Past its
    ``GRAPHS_PER_VARIANT`` graphs a call runs ``eager``, the same function uncompiled (Dynamo
    refuses before running anything): the limit raised inside the commit and latched it."""

    @functools.wraps(compiled)
    def call(*args: Any) -> Any:
        try:
            if dynamo_stance() == "default":  # the common case: entering the stance costs ~70 µs
                return compiled(*args)
            with torch.compiler.set_stance("default"):
                return compiled(*args)
        except Exception as error:
            if not isinstance(error, recompile_limit_error()):
                raise
        if eager not in _PAST_THE_LIMIT:
            _PAST_THE_LIMIT.add(eager)
            warnings.warn(
                f"Gefen: the compiled kernel {eager.__name__} reached its {GRAPHS_PER_VARIANT}"
                "-graph limit; parameters of further shape classes run it uncompiled",
                RuntimeWarning,
                stacklevel=2,
            )
        return eager(*args)

    return call


_PAST_THE_LIMIT: set[Callable[..., Any]] = set()  # the kernels warned about (once each)


def compiled_graph_count() -> int:
    """Graphs Dynamo compiled so far in this process (for the harness and the tests)."""
    return dynamo_unique_graphs()


class FusedUpdater:
    """``torch.compile``d in-place updates over chunks of whole blocks of about ``chunk``
    elements (``chunk_elements(device_type)`` by default)."""

    def __init__(self, device_type: str, chunk: int | None = None) -> None:
        self._device_type = device_type
        self._chunk = chunk_elements(device_type) if chunk is None else chunk
        self._tables = CodebookTables()

    def _codebooks(
        self, entry: dict[str, Any], scalars: StepScalars
    ) -> tuple[tuple[Tensor, ...], int]:
        if "momentum_codes" not in entry:
            return (), 1
        assert scalars.codebook is not None
        table, window = self._tables.get(scalars.codebook)
        return (scalars.codebook, table), window

    def __call__(
        self, param: Tensor, grad: Tensor, entry: dict[str, Any], scalars: StepScalars
    ) -> None:
        period = int(entry["period"])
        t, tau = int(entry["step"]) + 1, int(entry["v_step"]) + 1
        device = param.device
        hp = pack_hyper(scalars, t, tau, device)
        flags = (scalars.lr * scalars.weight_decay != 0, scalars.lr != 0)
        blocks = param.numel() // period
        work = param if param.is_contiguous() else param.contiguous()
        # contiguous inputs only: a strided one is a new guard, and enough of them would hit
        # Dynamo's recompile limit in the middle of a commit
        grad = grad if grad.is_contiguous() else grad.contiguous()
        param_blocks, grad_blocks = work.view(blocks, period), grad.view(blocks, period)
        codebooks, window = self._codebooks(entry, scalars)
        keys = ("momentum_codes", "momentum_scale") if codebooks else ("momentum",)
        stream = stream_tensor(scalars.seed, device)
        factored = "v_row" in entry
        stochastic = scalars.seed is not None
        packed = bool(codebooks) and is_packed(codebooks[0])
        # then the group's options: factored_floor (the factored kernel only) and nesterov
        floor = (scalars.factored_floor,) if factored else ()
        kernel_flags = (*flags, *floor, scalars.nesterov)
        variant = (param.dtype, grad.dtype, len(keys), stochastic, window, kernel_flags, packed)
        rows = _chunk_blocks(period, int(param.shape[-1]) if factored else 0, self._chunk)
        one_call = factored and blocks <= rows  # the moments and the update in one call
        if one_call:
            whole = _compiled(kernels.factored_whole_update_, self._device_type, variant)
            rounding = (window, stochastic, stream, SCALARS.get(0, torch.int64, device), packed)
            state = tuple(entry[key] for key in keys)
            factors = (entry["v_row"], entry["v_col"])
            whole(param_blocks, grad_blocks, state, factors, codebooks, hp, rounding, kernel_flags)
        elif factored:
            moments = _compiled(kernels.factored_moments_, self._device_type, (grad.dtype,))
            normaliser = moments(grad.reshape(param.shape), entry["v_row"], entry["v_col"], hp)
            update = _compiled(kernels.factored_update_, self._device_type, variant)
        else:
            update = _compiled(kernels.block_update_, self._device_type, variant)
        chunks = range(0) if one_call else range(0, blocks, rows)
        for first_row in chunks:
            chunk = slice(first_row, min(blocks, first_row + rows))
            first = SCALARS.get(first_row * period, torch.int64, device)
            state = tuple(entry[key][chunk] for key in keys)
            rounding = (window, stochastic, stream, first, packed)
            inputs = (param_blocks[chunk], grad_blocks[chunk], state)
            if factored:
                elements = (chunk.stop - chunk.start) * period
                columns = int(param.shape[-1])
                v_row = _rows_covered(entry["v_row"], columns, first_row * period, elements)
                update(
                    *inputs,
                    (v_row, entry["v_col"], normaliser),
                    codebooks,
                    hp,
                    rounding,
                    kernel_flags,
                )
            else:
                update(*inputs, entry["v_block"][chunk], codebooks, hp, rounding, kernel_flags)
        if work is not param and flags[1]:
            param.copy_(work)
        entry["step"], entry["v_step"] = t, tau


class FusedMomentum:
    """The compiled ``MomentumAdvancer``, over chunks of whole blocks of about ``chunk``
    elements (``chunk_elements(device_type)`` by default)."""

    def __init__(self, device_type: str, chunk: int | None = None) -> None:
        self._device_type = device_type
        self._chunk = chunk_elements(device_type) if chunk is None else chunk
        self._tables = CodebookTables()

    def __call__(
        self,
        grad: Tensor,
        codes: Tensor,
        scale: Tensor,
        codebook: Tensor,
        weight: float,
        seed: tuple[int, ...] | None,
    ) -> Tensor:
        blocks = codes.shape[0]
        period = grad.numel() // blocks
        packed = is_packed(codebook)
        device = codes.device
        table, window = self._tables.get(codebook)
        stream = stream_tensor(seed, device)
        weight_tensor = SCALARS.get(weight, torch.float32, device)
        grad_blocks = grad.reshape(blocks, period)
        out = torch.empty(blocks, period, dtype=torch.float32, device=device)
        variant = (seed is not None, window, packed)
        function = _compiled(kernels.advance_momentum_, self._device_type, variant)
        rows = max(1, self._chunk // period)
        # Every chunk reaches the compiled function in one form (a slice of one fp32 staging
        # buffer, whatever the gradient's dtype, shape or strides): Dynamo guards on how an
        # input was made, so gradients passed as they come would multiply the graphs.
        staging = torch.empty(min(rows, blocks), period, dtype=torch.float32, device=device)
        for first_row in range(0, blocks, rows):
            chunk = slice(first_row, min(blocks, first_row + rows))
            first = SCALARS.get(first_row * period, torch.int64, device)
            rounding = (window, seed is not None, stream, first, packed)
            state = (codes[chunk], scale[chunk])
            gradient = staging[: chunk.stop - chunk.start]
            gradient.copy_(grad_blocks[chunk])
            out[chunk] = function(gradient, state, (codebook, table), weight_tensor, rounding)
        return out


def _chunk_blocks(period: int, columns: int, chunk: int) -> int:
    """Blocks per fused call: about ``chunk`` elements; for a factored (R, C) parameter a
    multiple of whole rows too when that stays small (lcm(P, C) elements), so the chunk's
    second moment is a broadcast instead of a per-element gather."""
    rows = max(1, chunk // period)
    if columns > 0:
        unit = math.lcm(period, columns) // period
        if unit * period <= 4 * chunk:
            rows = max(unit, rows // unit * unit)
    return rows


def _rows_covered(v_row: Tensor, columns: int, first: int, elements: int) -> Tensor:
    """The slice of ``v_row`` a chunk of ``elements`` from logical element ``first`` covers
    exactly (whole rows of ``columns``), else the whole vector (the kernel then gathers)."""
    if first % columns == 0 and elements % columns == 0:
        return v_row[first // columns : (first + elements) // columns]
    return v_row


def _warm_up(updater: Updater, key: KernelKey) -> None:
    """Compile (and run once) the graph ``key`` needs on a tiny parameter, so that a compile
    failure surfaces in the local preflight instead of the commit."""
    device_type, dtype, codec, family = key
    device = torch.device(device_type)
    # A parameter as the step sees one (requires_grad is in Dynamo's guards), no two sizes
    # equal (duck sizing would guard the equality): 3 rows of 24 against HP_SIZE 8, codebooks
    # of 256 or 16 and codebook4's 12 bytes a row.
    rows, cols = 3, 24
    param = torch.zeros(rows, cols, dtype=dtype, device=device, requires_grad=True)
    entry: dict[str, Any] = {"period": cols, "step": 0, "v_step": 0}
    codebook = None
    if codec in ("codebook8", "codebook4"):
        size = PACKED_CODEBOOK_SIZE if codec == "codebook4" else 256
        codebook = torch.linspace(-1.0, 1.0, size, dtype=_F32, device=device)
        width = code_bytes(cols, packed=codec == "codebook4")
        entry["momentum_codes"] = torch.zeros(rows, width, dtype=torch.uint8, device=device)
        entry["momentum_scale"] = torch.zeros(rows, 1, dtype=_F32, device=device)
    else:
        entry["momentum"] = torch.zeros(rows, cols, dtype=_F32, device=device)
    if family == "factored":
        entry["v_row"] = torch.zeros(rows, dtype=_F32, device=device)
        entry["v_col"] = torch.zeros(cols, dtype=_F32, device=device)
    else:
        entry["v_block"] = torch.zeros(rows, 1, dtype=_F32, device=device)
    # the defaults' variant, so that a default run compiles nothing after this
    scalars = StepScalars(
        1e-3, (0.9, 0.999), 1e-8, 0.0, codebook, None, factored_floor=True, nesterov=True
    )
    # a factored parameter takes one call when it fits a chunk and two kernels per chunk when
    # not: one-block chunks compile the second form too
    forms: list[Updater] = [updater]
    if family == "factored":
        forms.append(FusedUpdater(device_type, chunk=8))
    with torch.no_grad():  # the commit runs without grad; grad mode is part of Dynamo's guards
        for form in forms:
            form(param, torch.ones_like(param), entry, scalars)


def inductor_updater(device_type: str, key: KernelKey) -> Updater:
    """The compiled updater for ``key``, its main graph compiled (and run once) already."""
    updater = FusedUpdater(device_type)
    _warm_up(updater, key)
    return updater


def compiled_momentum(device_type: str, codebook_size: int = 256) -> MomentumAdvancer:
    """A compiled ``MomentumAdvancer`` for ``device_type`` and a codebook of
    ``codebook_size`` values, proven on a tiny input first."""
    advance = FusedMomentum(device_type)
    device = torch.device(device_type)
    width = code_bytes(8, packed=codebook_size <= PACKED_CODEBOOK_SIZE)
    codes = torch.zeros(2, width, dtype=torch.uint8, device=device)
    scale = torch.zeros(2, 1, dtype=_F32, device=device)
    codebook = torch.linspace(-1.0, 1.0, codebook_size, dtype=_F32, device=device)
    with torch.no_grad():
        advance(torch.ones(2, 8, dtype=_F32, device=device), codes, scale, codebook, 0.05, None)
    return advance
