"""The in-place update of one parameter: its vocabulary and the eager reference (§7.1, §11).

An *updater* takes one parameter's local tensor, its gradient, its initialized state entry and
the step's ``StepScalars``, and writes the new codes, scales, second moments, counters and value
into their own storage. ``eager_update_`` is the normative eager kernels of
``gefen.core.kernels.update`` on one parameter, copied into place (its working set is one
parameter's temporaries); ``eager_advance_momentum_`` is the reference of a
``MomentumAdvancer``. The fused implementations (``gefen.core.compiled``, ``gefen.core.native``)
build on this vocabulary; ``gefen.core.fused`` registers and selects them.
"""

from __future__ import annotations

import math
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
from gefen.dist.torch_internals import tensor_version

__all__ = [
    "CHUNK_ELEMENTS",
    "DEVICE_CHUNK_ELEMENTS",
    "CodebookTables",
    "KernelKey",
    "MomentumAdvancer",
    "StepScalars",
    "Updater",
    "chunk_elements",
    "eager_advance_momentum_",
    "eager_update_",
    "hyper_values",
    "stream_value",
]

KernelKey = tuple[str, torch.dtype, str, str]
"""(device type, parameter dtype, codec, family)."""

CHUNK_ELEMENTS = 1 << 18
"""Elements per compiled call on the CPU: the chunk stays in cache, and a step's temporaries
are about 1 MB whatever the model."""

DEVICE_CHUNK_ELEMENTS = 1 << 24
"""Elements per compiled call on an accelerator. Every call costs the host tens of
microseconds (Dynamo's guards, the launches) however little it updates, while a GPU with
terabytes a second updates 2¹⁸ elements in a microsecond or two: at the CPU's size a
7B-parameter model would make about 27,000 calls a step and leave the GPU idle, at 2²⁴ about
420 (plus one per parameter). The temporaries stay bounded: 8 bytes per chunk element in the
CPU's compiled code (128 MiB at this size), about 2.3 in the Triton code measured on an
H200."""


def chunk_elements(device_type: str) -> int:
    """Elements per compiled call on ``device_type`` (the results do not depend on it)."""
    return CHUNK_ELEMENTS if device_type == "cpu" else DEVICE_CHUNK_ELEMENTS


@dataclass(frozen=True)
class StepScalars:
    """What one parameter's update needs besides its tensors (all read in phase 4).

    ``codebook`` is the codebook of codebook8 momentum (None for "none"); ``seed`` is
    ``(global_step, param_index)`` for stochastic rounding, else None; ``factored_floor`` is the
    group's option (the factored family floors its estimate by ``(1 - β2)·g²``); ``nesterov``
    is the group's option (the update applies ``lerp(m̂, G, 1 - β1)`` instead of ``m̂``).
    """

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    codebook: Tensor | None = None
    seed: tuple[int, ...] | None = None
    factored_floor: bool = False
    nesterov: bool = False


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
        "nesterov": scalars.nesterov,
    }
    momentum = _momentum_of(entry)
    if "v_block" in entry:
        result: Any = update_block(param, grad, momentum, entry["v_block"], **arguments)
        entry["v_block"].copy_(result.v_block)
    else:
        arguments["factored_floor"] = scalars.factored_floor
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


def stream_value(seed: tuple[int, ...] | None) -> int:
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
        self._codebook_version = -1
        self._value: tuple[Tensor, int] = (torch.zeros(0, dtype=table_dtype), 1)

    def get(self, codebook: Tensor) -> tuple[Tensor, int]:
        if codebook is not self._codebook or tensor_version(codebook) != self._codebook_version:
            table = kernels.count_table(codebook).to(self._table_dtype).contiguous()
            self._value = (table, kernels.scan_window(codebook))
            self._codebook, self._codebook_version = codebook, tensor_version(codebook)
        return self._value


MomentumAdvancer = Callable[
    [Tensor, Tensor, Tensor, Tensor, float, "tuple[int, ...] | None"], Tensor
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
    seed: tuple[int, ...] | None,
) -> Tensor:
    """The reference of ``MomentumAdvancer``: decode, lerp, encode, store, decode."""
    from gefen.core.kernels.blocks import requantized_lerp

    target = grad.to(torch.float32)
    new_codes, new_scale, stored = requantized_lerp(codes, scale, codebook, target, weight, seed)
    codes.copy_(new_codes)
    scale.copy_(new_scale)
    return stored
