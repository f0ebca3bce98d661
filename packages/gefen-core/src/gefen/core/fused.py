"""The in-place update of one parameter, its implementations and their selection (§7.1, §11).

An *updater* takes one parameter's local tensor, its gradient, its initialized state entry and
the step's ``StepScalars``, and writes the new codes, scales, second moments, counters and value
into their own storage. Two kinds exist:

* ``eager_update_``: the normative eager kernels of ``gefen.core.kernels.update`` on one
  parameter, copied into place (its working set is one parameter's temporaries);
* the fused implementations registered here, by default ``inductor``: the functions of
  ``gefen.core.kernels.fused_update`` compiled with ``torch.compile(fullgraph=True)`` and run
  over chunks of whole blocks, so the extra memory is one chunk's.

Selection runs in the local preflight and is cached per optimizer (``KernelSelector``): a
compile failure with ``fused=True`` raises there, before any mutation and inside the vote;
``fused=None`` falls back to the eager path with one warning.
"""

from __future__ import annotations

import logging
import math
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.core.kernels import fused_update as kernels
from gefen.core.kernels.update import (
    CodebookMomentum,
    DenseMomentum,
    update_block,
    update_factored,
)

__all__ = [
    "CHUNK_ELEMENTS",
    "CodebookTables",
    "FusedImplementation",
    "KernelKey",
    "KernelSelector",
    "MomentumAdvancer",
    "StepScalars",
    "Updater",
    "compiled_graph_count",
    "eager_advance_momentum_",
    "eager_update_",
    "fused_momentum",
    "has_fused_implementation",
    "hyper_values",
    "pack_hyper",
    "register_fused",
    "resolve_default",
    "stream_tensor",
    "stream_value",
]

logger = logging.getLogger("gefen.core")

KernelKey = tuple[str, torch.dtype, str, str]
"""(device type, parameter dtype, codec, family)."""

CHUNK_ELEMENTS = 1 << 18
"""Elements per fused call: bounds a step's temporaries (about 1 MB) whatever the model."""


@dataclass(frozen=True)
class StepScalars:
    """What one parameter's update needs besides its tensors (all read in phase 4).

    ``codebook`` is the codebook of codebook8 momentum (None for "none"); ``seed`` is
    ``(global_step, param_index)`` for stochastic rounding, else None.
    """

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    codebook: Tensor | None = None
    seed: tuple[int, int] | None = None


Updater = Callable[[Tensor, Tensor, dict[str, Any], StepScalars], None]
"""``updater(param, grad, entry, scalars)``: one parameter's update, in place."""


# -- the eager reference ---------------------------------------------------------------------


def _momentum_of(entry: dict[str, Any]) -> CodebookMomentum | DenseMomentum:
    if "momentum_codes" in entry:
        return CodebookMomentum(entry["momentum_codes"], entry["momentum_scale"])
    return DenseMomentum(entry["momentum"])


def eager_update_(param: Tensor, grad: Tensor, entry: dict[str, Any], scalars: StepScalars) -> None:
    """The reference: §6.1/§6.2 by the eager kernels, then every result copied into place."""
    arguments: dict[str, Any] = {
        "period": int(entry["period"]),
        "step": int(entry["step"]),
        "v_step": int(entry["v_step"]),
        "lr": scalars.lr,
        "betas": scalars.betas,
        "eps": scalars.eps,
        "weight_decay": scalars.weight_decay,
        "codebook": scalars.codebook,
        "seed": scalars.seed,
    }
    momentum = _momentum_of(entry)
    if "v_block" in entry:
        result: Any = update_block(param, grad, momentum, entry["v_block"], **arguments)
        entry["v_block"].copy_(result.v_block)
    else:
        result = update_factored(param, grad, momentum, entry["v_row"], entry["v_col"], **arguments)
        entry["v_row"].copy_(result.v_row)
        entry["v_col"].copy_(result.v_col)
    if isinstance(result.momentum, CodebookMomentum):
        entry["momentum_codes"].copy_(result.momentum.codes)
        entry["momentum_scale"].copy_(result.momentum.scale)
    else:
        entry["momentum"].copy_(result.momentum.momentum)
    if result.param is not None:
        param.copy_(result.param)
    entry["step"], entry["v_step"] = result.step, result.v_step


# -- the fused implementation ----------------------------------------------------------------


def hyper_values(scalars: StepScalars, t: int, tau: int) -> list[float]:
    """The scalars of ``fused_update`` (``HP_*`` order), computed in float64 as the eager path
    computes them (each kernel rounds them to fp32 where the eager path does)."""
    beta1, beta2 = scalars.betas
    values = [0.0] * kernels.HP_SIZE
    values[kernels.HP_LR] = scalars.lr
    values[kernels.HP_ONE_MINUS_BETA1] = 1.0 - beta1
    values[kernels.HP_BETA2] = beta2
    values[kernels.HP_ONE_MINUS_BETA2] = 1.0 - beta2
    values[kernels.HP_SQRT_BC2] = math.sqrt(1.0 - beta2**tau)
    values[kernels.HP_EPS] = scalars.eps
    values[kernels.HP_INV_BC1] = 1.0 / (1.0 - beta1**t)
    values[kernels.HP_DECAY] = 1.0 - scalars.lr * scalars.weight_decay
    return values


def pack_hyper(scalars: StepScalars, t: int, tau: int, device: torch.device) -> Tensor:
    """``hyper_values`` as the one fp64 tensor the compiled kernels take."""
    return torch.tensor(hyper_values(scalars, t, tau), dtype=torch.float64, device=device)


def stream_value(seed: tuple[int, int] | None) -> int:
    """§6.3's stream seed (unsigned 64-bit; 0 without stochastic rounding)."""
    from gefen.core.kernels.quantize import stream_seed

    return 0 if seed is None else stream_seed(seed)


def stream_tensor(seed: tuple[int, int] | None, device: torch.device) -> Tensor:
    """``stream_value`` as the int64 (two's complement) 0-d tensor the fused encode hashes."""
    value = stream_value(seed)
    signed = value - (1 << 64) if value >= 1 << 63 else value
    return torch.tensor(signed, dtype=torch.int64, device=device)


_COMPILED: dict[tuple[str, str, tuple[Any, ...]], Callable[..., Any]] = {}


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
        found = torch.compile(clone, fullgraph=True, dynamic=True)
        _COMPILED[key] = found
    return found


def compiled_graph_count() -> int:
    """Graphs Dynamo compiled so far in this process (for the harness and the tests)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CodebookTables:
    """A codebook's count table (in ``table_dtype``) and scan window, cached by the tensor
    object and its version (the cache holds the tensor, so its identity cannot be reused by
    another one meanwhile)."""

    def __init__(self, table_dtype: torch.dtype = torch.int64) -> None:
        self._table_dtype = table_dtype
        self._codebook: Tensor | None = None
        self._version = -1
        self._value: tuple[Tensor, int] = (torch.zeros(0), 1)

    def get(self, codebook: Tensor) -> tuple[Tensor, int]:
        if codebook is not self._codebook or codebook._version != self._version:
            table = kernels.count_table(codebook).to(self._table_dtype).contiguous()
            self._value = (table, kernels.scan_window(codebook))
            self._codebook, self._version = codebook, codebook._version
        return self._value


class FusedUpdater:
    """``torch.compile``d in-place updates over chunks of whole blocks (``CHUNK_ELEMENTS``)."""

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
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
        param_blocks, grad_blocks = work.view(blocks, period), grad.reshape(blocks, period)
        codebooks, window = self._codebooks(entry, scalars)
        keys = ("momentum_codes", "momentum_scale") if codebooks else ("momentum",)
        stream = stream_tensor(scalars.seed, device)
        factored = "v_row" in entry
        stochastic = scalars.seed is not None
        variant = (param.dtype, grad.dtype, len(keys), stochastic, window, flags)
        if factored:
            moments = _compiled(kernels.factored_moments_, self._device_type, (grad.dtype,))
            normaliser = moments(grad.reshape(param.shape), entry["v_row"], entry["v_col"], hp)
            update = _compiled(kernels.factored_update_, self._device_type, variant)
        else:
            update = _compiled(kernels.block_update_, self._device_type, variant)
        rows = _chunk_blocks(period, int(param.shape[-1]) if factored else 0)
        for first_row in range(0, blocks, rows):
            chunk = slice(first_row, min(blocks, first_row + rows))
            first = torch.tensor(first_row * period, dtype=torch.int64, device=device)
            state = tuple(entry[key][chunk] for key in keys)
            rounding = (window, stochastic, stream, first)
            inputs = (param_blocks[chunk], grad_blocks[chunk], state)
            if factored:
                elements = (chunk.stop - chunk.start) * period
                columns = int(param.shape[-1])
                v_row = _rows_covered(entry["v_row"], columns, first_row * period, elements)
                factors = (v_row, entry["v_col"], normaliser)
                update(*inputs, factors, codebooks, hp, rounding, flags)
            else:
                update(*inputs, entry["v_block"][chunk], codebooks, hp, rounding, flags)
        if work is not param and flags[1]:
            param.copy_(work)
        entry["step"], entry["v_step"] = t, tau


MomentumAdvancer = Callable[
    [Tensor, Tensor, Tensor, Tensor, float, "tuple[int, int] | None"], Tensor
]
"""``advance(grad_blocks, codes, scale, codebook, weight, seed)``: codebook8 momentum
``lerp(decode, grad, weight)`` re-encoded into ``codes``/``scale`` in place; returns the decoded
stored momentum (fp32, (B, P)). GefenMuon's step 1."""


def eager_advance_momentum_(
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    codebook: Tensor,
    weight: float,
    seed: tuple[int, int] | None,
) -> Tensor:
    """The reference of ``MomentumAdvancer``: decode, lerp, encode, store, decode."""
    from gefen.core.kernels.blocks import decode_blocks, encode_blocks

    advanced = torch.lerp(decode_blocks(codes, scale, codebook), grad.to(torch.float32), weight)
    new_codes, new_scale = encode_blocks(advanced, codebook, codes.shape[1], seed=seed)
    codes.copy_(new_codes)
    scale.copy_(new_scale)
    return decode_blocks(codes, scale, codebook)


class FusedMomentum:
    """The compiled ``MomentumAdvancer``, over chunks of whole blocks."""

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
        self._tables = CodebookTables()

    def __call__(
        self,
        grad: Tensor,
        codes: Tensor,
        scale: Tensor,
        codebook: Tensor,
        weight: float,
        seed: tuple[int, int] | None,
    ) -> Tensor:
        blocks, period = codes.shape
        device = codes.device
        table, window = self._tables.get(codebook)
        stream = stream_tensor(seed, device)
        weight_tensor = torch.tensor(weight, dtype=torch.float32, device=device)
        grad_blocks = grad.reshape(blocks, period)
        out = torch.empty(blocks, period, dtype=torch.float32, device=device)
        variant = (seed is not None, window)
        function = _compiled(kernels.advance_momentum_, self._device_type, variant)
        rows = max(1, CHUNK_ELEMENTS // period)
        # Every chunk reaches the compiled function in one form (a slice of one fp32 staging
        # buffer, whatever the gradient's dtype, shape or strides): Dynamo guards on how an
        # input was made, so gradients passed as they come would multiply the graphs.
        staging = torch.empty(min(rows, blocks), period, dtype=torch.float32, device=device)
        for first_row in range(0, blocks, rows):
            chunk = slice(first_row, min(blocks, first_row + rows))
            first = torch.tensor(first_row * period, dtype=torch.int64, device=device)
            rounding = (window, seed is not None, stream, first)
            state = (codes[chunk], scale[chunk])
            gradient = staging[: chunk.stop - chunk.start]
            gradient.copy_(grad_blocks[chunk])
            out[chunk] = function(gradient, state, (codebook, table), weight_tensor, rounding)
        return out


def fused_momentum(device_type: str) -> MomentumAdvancer:
    """A fused ``MomentumAdvancer`` for ``device_type``, proven on a tiny input first (so a
    build failure surfaces where the caller selects it); raises on failure. On the CPU the
    native kernel when it builds, else (and elsewhere) the compiled one."""
    if device_type == "cpu":
        try:
            from gefen.core.native import native_momentum

            return native_momentum()
        except Exception as error:
            logger.info("native momentum kernel unavailable, using inductor: %s", error)
    advance = FusedMomentum(device_type)
    device = torch.device(device_type)
    codes = torch.zeros(2, 8, dtype=torch.uint8, device=device)
    scale = torch.zeros(2, 1, device=device)
    codebook = torch.linspace(-1.0, 1.0, 256, device=device)
    with torch.no_grad():
        advance(torch.ones(2, 8, device=device), codes, scale, codebook, 0.05, None)
    return advance


def _chunk_blocks(period: int, columns: int) -> int:
    """Blocks per fused call: about ``CHUNK_ELEMENTS`` elements; for a factored (R, C)
    parameter a multiple of whole rows too when that stays small (lcm(P, C) elements), so
    the chunk's second moment is a broadcast instead of a per-element gather."""
    rows = max(1, CHUNK_ELEMENTS // period)
    if columns > 0:
        unit = math.lcm(period, columns) // period
        if unit * period <= 4 * CHUNK_ELEMENTS:
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
    param = torch.zeros(4, 8, dtype=dtype, device=device)
    entry: dict[str, Any] = {"period": 8, "step": 0, "v_step": 0}
    codebook = None
    if codec == "codebook8":
        codebook = torch.linspace(-1.0, 1.0, 256, device=device)
        entry["momentum_codes"] = torch.zeros(4, 8, dtype=torch.uint8, device=device)
        entry["momentum_scale"] = torch.zeros(4, 1, device=device)
    else:
        entry["momentum"] = torch.zeros(4, 8, device=device)
    if family == "factored":
        entry["v_row"] = torch.zeros(4, device=device)
        entry["v_col"] = torch.zeros(8, device=device)
    else:
        entry["v_block"] = torch.zeros(4, 1, device=device)
    scalars = StepScalars(1e-3, (0.9, 0.999), 1e-8, 0.0, codebook)
    with torch.no_grad():  # the commit runs without grad; grad mode is part of Dynamo's guards
        updater(param, torch.ones_like(param), entry, scalars)


def _compile_inductor(device_type: str, key: KernelKey) -> Updater:
    updater = FusedUpdater(device_type)
    _warm_up(updater, key)
    return updater


# -- the registry and the per-optimizer selection --------------------------------------------


@dataclass(frozen=True, eq=False)
class FusedImplementation:
    """A registered implementation; ``compile(key)`` returns an ``Updater`` for that key (having
    compiled what it needs) or raises."""

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    codecs: tuple[str, ...]
    families: tuple[str, ...]
    deterministic: bool
    compile: Callable[[KernelKey], Updater]

    def covers(self, key: KernelKey) -> bool:
        device_type, dtype, codec, family = key
        return (
            device_type == self.device_type
            and dtype in self.dtypes
            and codec in self.codecs
            and family in self.families
        )


_REGISTRY: list[FusedImplementation] = []


def register_fused(
    implementation: FusedImplementation, *, first: bool = True
) -> Callable[[], None]:
    """Register an implementation (ahead of the others unless ``first=False``); returns a
    function that unregisters it."""
    if first:
        _REGISTRY.insert(0, implementation)
    else:
        _REGISTRY.append(implementation)

    def unregister() -> None:
        if implementation in _REGISTRY:
            _REGISTRY.remove(implementation)

    return unregister


def _compile_native(key: KernelKey) -> Updater:
    from gefen.core.native import native_updater

    return native_updater(key)


_ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
register_fused(
    FusedImplementation(
        "native-cpu",
        "cpu",
        (torch.float32, torch.bfloat16),
        ("codebook8",),
        ("block", "factored"),
        True,  # blocks are independent; every block's reductions run in a fixed order
        _compile_native,
    ),
    first=False,
)
for _device_type in ("cpu", "cuda"):
    register_fused(
        FusedImplementation(
            "inductor",
            _device_type,
            _ALL_DTYPES,
            ("codebook8", "none"),
            ("block", "factored"),
            True,  # no atomics: every reduction has a fixed order
            lambda key, device_type=_device_type: _compile_inductor(device_type, key),  # type: ignore[misc]
        ),
        first=False,
    )


def has_fused_implementation(device_type: str) -> bool:
    """Whether some implementation is registered for ``device_type`` (the ``fused=True`` rule)."""
    return any(impl.device_type == device_type for impl in _REGISTRY)


def _candidates(key: KernelKey, deterministic: bool) -> list[FusedImplementation]:
    """The registered implementations covering ``key``, in registration order."""
    return [
        implementation
        for implementation in _REGISTRY
        if implementation.covers(key) and (implementation.deterministic or not deterministic)
    ]


def resolve_default(fused: bool | None) -> bool | None:
    """The effective ``fused`` option. A seam for test suites that keep most tests eager; the
    library itself returns the option unchanged."""
    return fused


class KernelSelector:
    """Per-optimizer cache of selected updaters; ``None`` means the eager reference.

    A cache of compiled code, not optimizer state: it is never serialized, and an entry is only
    added once a compile succeeded (or fell back with ``fused=None``).
    """

    def __init__(self) -> None:
        self._selected: dict[tuple[KernelKey, bool | None, bool], Updater | None] = {}

    def select(self, key: KernelKey, *, fused: bool | None, deterministic: bool) -> Updater | None:
        fused = resolve_default(fused)
        if fused is False:
            return None
        cache_key = (key, fused, deterministic)
        if cache_key in self._selected:
            return self._selected[cache_key]
        candidates = _candidates(key, deterministic)
        if not candidates:
            if fused:
                raise RuntimeError(f"no fused implementation covers {key} (fused=True)")
            self._selected[cache_key] = None
            return None
        kernel = self._first_that_compiles(candidates, key, fused)
        self._selected[cache_key] = kernel
        return kernel

    @staticmethod
    def _first_that_compiles(
        candidates: list[FusedImplementation], key: KernelKey, fused: bool | None
    ) -> Updater | None:
        """The first candidate that compiles; when none does, ``fused=True`` raises and
        ``fused=None`` warns once and takes the eager path."""
        failures: list[str] = []
        for implementation in candidates:
            try:
                return implementation.compile(key)
            except Exception as error:
                failures.append(f"{implementation.name}: {error}")
                logger.info("fused implementation %s failed: %s", implementation.name, error)
        reasons = "; ".join(failures)
        if fused:
            raise RuntimeError(f"fused implementation failed to compile for {key}: {reasons}")
        warnings.warn(
            f"fused implementation failed to compile for {key}; using the eager path ({reasons})",
            RuntimeWarning,
            stacklevel=5,
        )
        logger.warning("no fused implementation compiled for %s: %s", key, reasons)
        return None
