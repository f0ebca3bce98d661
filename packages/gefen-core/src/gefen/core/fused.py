"""The in-place update of one parameter, its implementations and their selection (§7.1, §11).
The compiled implementation lives in ``gefen.core.compiled``, the native one in
``gefen.core.native``; this module holds the shared vocabulary, the eager reference and the
registry.

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
    "eager_advance_momentum_",
    "eager_update_",
    "fused_momentum",
    "has_fused_implementation",
    "hyper_values",
    "register_fused",
    "resolve_default",
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


def stream_value(seed: tuple[int, int] | None) -> int:
    """§6.3's stream seed (unsigned 64-bit; 0 without stochastic rounding)."""
    from gefen.core.kernels.quantize import stream_seed

    return 0 if seed is None else stream_seed(seed)


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
    from gefen.core.kernels.blocks import requantized_lerp

    target = grad.to(torch.float32)
    new_codes, new_scale, stored = requantized_lerp(codes, scale, codebook, target, weight, seed)
    codes.copy_(new_codes)
    scale.copy_(new_scale)
    return stored


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
    from gefen.core.compiled import compiled_momentum

    return compiled_momentum(device_type)


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


def _compile_inductor(device_type: str, key: KernelKey) -> Updater:
    from gefen.core.compiled import inductor_updater

    return inductor_updater(device_type, key)


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
