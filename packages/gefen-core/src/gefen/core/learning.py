"""Codebook learning, period staging and the refresh transaction (docs/core.md §4–§5).

Everything here stages: it returns new periods, a new codebook and remapped codes, and writes
nothing. The shell publishes the result in its commit phase, so a failure while staging leaves
the optimizer exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gefen.core.kernels import BIN_COUNT, histogram, nearest_index, pad_codebook, solve_codebook
from gefen.core.kernels.blocks import PACKED_CODEBOOK_SIZE
from gefen.core.state import CODEBOOK_SIZE
from gefen.dist import Channel, any_true_over

__all__ = [
    "CodebookInput",
    "StagedLearning",
    "any_nonzero_agreed",
    "build_histogram",
    "remap_codes_",
    "remap_table",
    "solve_new_codebook",
    "stage_periods",
    "with_exact_zero",
]

CodebookInput = tuple[int, Tensor, tuple[int, ...]]
"""(flat parameter index, the gradient view learned from, its quantized shape)."""

PeriodSelector = Callable[[int, Tensor, tuple[int, ...]], "int | None"]


@dataclass
class StagedLearning:
    """What phase 4 (or initialize/refresh) learned, to be published at commit.

    ``periods``: new periods by flat index; ``codebook``: a codebook to publish (None keeps the
    live one); ``remap``: a refresh's 256-entry byte table ``L`` (int64), applied to every
    code tensor in place at commit, one parameter at a time; ``noop``: the pre-initialization no-op
    of §5.5 (nothing is staged then). Nothing here is proportional to the model.
    """

    periods: dict[int, int] = field(default_factory=dict)
    codebook: Tensor | None = None
    remap: Tensor | None = None
    noop: bool = False


def stage_periods(
    inputs: Sequence[CodebookInput], live_periods: Mapping[int, int], select: PeriodSelector
) -> dict[int, int]:
    """A period for every input whose parameter has none yet (§4: chosen once, never again)."""
    staged: dict[int, int] = {}
    for index, view, shape in inputs:
        if live_periods.get(index, 0) != 0:
            continue
        period = select(index, view, shape)
        if period is not None:
            staged[index] = period
    return staged


def build_histogram(inputs: Sequence[CodebookInput], periods: Mapping[int, int]) -> Tensor:
    """The summed 4096-bin histogram of every input that has a period (§5.1); int64 on CPU."""
    counts = torch.zeros(BIN_COUNT, dtype=torch.int64)
    for index, view, _ in inputs:
        period = periods.get(index, 0)
        if period > 0:
            counts += histogram(_finite(view), period)
    return counts


def _finite(view: Tensor) -> Tensor:
    # With check_finite=False non-finite gradients give unspecified state but must never crash;
    # the binning kernel cannot index a NaN bin, so such elements count as zero here.
    if bool(torch.isfinite(view).all()):
        return view
    return torch.nan_to_num(view.float(), nan=0.0, posinf=0.0, neginf=0.0)


def any_nonzero_agreed(counts: Tensor, scope: Sequence[Channel]) -> bool:
    """ "Some gradient element is non-zero", agreed by a MAX all-reduce over a non-empty scope.

    Every rank then learns (each from its own shards) or no-ops together (§5.5), so
    ``global_step`` never diverges. An empty scope decides locally without a collective.
    """
    local = bool(counts.sum().item() > 0)
    if len(scope) == 0:
        return local
    return any_true_over(tuple(scope), local)


def solve_new_codebook(counts: Tensor, device: torch.device, size: int = CODEBOOK_SIZE) -> Tensor:
    """Solve §5.2–§5.3 for a ``size``-value codebook (256, or 16 for codebook4) and place it on
    ``device`` (the first contributing one).

    Under a non-empty failure scope "learn" is agreed by a MAX over the ranks, so a rank whose
    own shards are all zero (or empty) must still publish a codebook in the same step, or its
    ``global_step`` would diverge from its peers'. It takes the §5.2 padding path from
    ``{-1, +1}`` alone, the same grid every such rank derives without communicating.
    """
    if int(counts.sum()) == 0:
        no_active_bins = np.zeros(0, dtype=np.int64)
        padded = pad_codebook(no_active_bins, size)  # holds 0: the first midpoint of [-1, 1]
        return torch.from_numpy(padded).to(dtype=torch.float32, device=device)
    return with_exact_zero(solve_codebook(counts, size)).to(device)


def with_exact_zero(codebook: Tensor) -> Tensor:
    """``codebook`` with its value nearest to 0 set to exactly 0 (§5.8): a zero momentum then
    encodes to a zero codeword, so an element whose gradient is zero never moves, even where its
    factored second moment is zero too and the step size is 1/eps. Still strictly increasing:
    the nearest value's neighbours lie on either side of 0 (the ends, -1 and +1, stay)."""
    nearest = 1 + int(codebook[1:-1].abs().argmin())
    zeroed = codebook.clone()
    zeroed[nearest] = 0.0
    return zeroed


def remap_table(old_codebook: Tensor, new_codebook: Tensor) -> Tensor:
    """§5.6 step 3: ``L[i] = nearest(cb', cb[i])`` for every index i (int64, on cb's device),
    as a table over code bytes: for 4-bit codes ``L'[b] = L[b & 15] | L[b >> 4] << 4`` for b in
    0..255, so one byte lookup remaps both codes it holds."""
    table = nearest_index(new_codebook, old_codebook.to(new_codebook.device)).to(torch.int64)
    if new_codebook.numel() > PACKED_CODEBOOK_SIZE:
        return table
    byte = torch.arange(256, device=table.device)
    return table[byte & 15] | (table[byte >> 4] << 4)


_REMAP_CHUNK = 1 << 20


def remap_codes_(table: Tensor, codes: Tensor) -> None:
    """§5.6 step 4 on one code tensor, in place: ``codes = L[codes]`` (chunked, so the int64
    temporaries stay bounded)."""
    flat = codes.view(-1)
    local = table.to(codes.device)
    for first in range(0, flat.numel(), _REMAP_CHUNK):
        part = flat[first : first + _REMAP_CHUNK]
        part.copy_(local[part.to(torch.int64)].to(torch.uint8))
