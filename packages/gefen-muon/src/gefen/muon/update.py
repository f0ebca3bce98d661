"""One matrix's Muon update, in place (docs/muon.md §4 "One parameter's update", §5, §6 phase 5).

``orthogonal_update_`` runs steps 1–3 on the matrix the mode quantizes (full or local): it
advances the momentum **in the entry's own tensors** (codes and scale, or the dense buffer),
increments ``step``, updates the NorMuon state in place and returns the orthogonalised update
``O``. ``apply_update_`` runs steps 4–5 on a parameter's (local) values, in place. Together they
are the streamed commit's working set for one matrix: the gradient view, the decoded momentum,
the Newton–Schulz temporaries and ``O``; nothing is staged for the rest of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.core.extension import MomentumAdvancer
from gefen.muon.kernels import newton_schulz, normuon_rescale

__all__ = [
    "MuonHyper",
    "advance_momentum_",
    "apply_update_",
    "orthogonal_update_",
]

CODES, SCALE, BUFFER = "momentum_codes", "momentum_scale", "momentum_buffer"


@dataclass(frozen=True)
class MuonHyper:
    """One group's hyperparameters for one step, read once (a tensor lr as a float)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    schedule: tuple[tuple[float, float, float], ...]
    eps: float
    normuon: bool
    normuon_beta2: float
    normuon_eps: float
    lr_dtype: torch.dtype | None = None  # a tensor lr's: torch.optim.Muon scales it in it

    def scaled_lr(self, ratio: float) -> float:
        """``lr·ratio`` as ``torch.optim.Muon`` forms it: a tensor lr in its own dtype."""
        if self.lr_dtype is None:
            return self.lr * ratio
        return float(torch.tensor(self.lr, dtype=self.lr_dtype) * ratio)

    def decay(self) -> float:
        """``1 - lr·weight_decay`` as ``torch.optim.Muon`` forms it (a tensor lr likewise)."""
        if self.lr_dtype is None:
            return 1.0 - self.lr * self.weight_decay
        return float(1 - torch.tensor(self.lr, dtype=self.lr_dtype) * self.weight_decay)


def advance_momentum_(
    entry: dict[str, Any],
    grad: Tensor,
    *,
    codebook: Tensor | None,
    momentum: float,
    seed: tuple[int, ...] | None,
    advance: MomentumAdvancer | None,
) -> Tensor:
    """Step 1 in place; returns the stored momentum m̂ in ``grad``'s shape.

    codebook8/codebook4: ``advance`` (the fused ``MomentumAdvancer`` or the eager reference)
    decodes, lerps with weight ``1 − β``, re-encodes into ``entry``'s codes/scale and returns
    the decoded stored momentum (fp32). "none": ``momentum_buffer.lerp_(g, 1 − β)`` in the
    parameter dtype (as ``torch.optim.Muon``); m̂ is the buffer itself (Newton–Schulz never
    writes its input).
    """
    if CODES in entry:
        if codebook is None or advance is None:
            raise ValueError("codebook momentum needs a codebook and a momentum kernel")
        codes: Tensor = entry[CODES]
        grad_blocks = grad.detach().reshape(codes.shape[0], -1)
        stored = advance(grad_blocks, codes, entry[SCALE], codebook, 1.0 - momentum, seed)
        return stored.reshape(grad.shape)
    buffer: Tensor = entry[BUFFER]
    buffer.lerp_(grad.detach(), 1.0 - momentum)
    return buffer


def _normuon_(entry: dict[str, Any], update: Tensor, hyper: MuonHyper) -> Tensor:
    """NorMuon state is created lazily (so it may be switched on mid-run), then updated in
    place; returns the rescaled update."""
    if "normuon_v" not in entry:
        rows = update.shape[0]
        entry["normuon_v"] = torch.zeros(rows, 1, dtype=torch.float32, device=update.device)
        entry["normuon_step"] = 0
    rescaled, t = normuon_rescale(
        update,
        entry["normuon_v"],
        int(entry["normuon_step"]),
        hyper.normuon_beta2,
        hyper.normuon_eps,
    )
    entry["normuon_step"] = t
    return rescaled


def orthogonal_update_(
    entry: dict[str, Any],
    grad: Tensor,
    *,
    codebook: Tensor | None,
    hyper: MuonHyper,
    seed: tuple[int, ...] | None = None,
    advance: MomentumAdvancer | None = None,
) -> Tensor:
    """Steps 1–3 on ``grad`` (the quantized matrix), writing ``entry`` in place; returns the
    bf16 update O.

    ``entry`` is an initialized entry (``step`` may be 0 for a new one) with the codec's keys,
    its tensors on ``grad``'s device; ``codebook`` and ``advance`` are required with the
    codebook keys. The stored state is the plain EMA; Nesterov is applied after quantization,
    to the decoded stored momentum.
    """
    stored = advance_momentum_(
        entry, grad, codebook=codebook, momentum=hyper.momentum, seed=seed, advance=advance
    )
    if CODES in entry and hyper.nesterov:
        # ``stored`` is this step's own fp32 decode: Nesterov's lerp overwrites it (same
        # arithmetic as a fresh result, one matrix less at the peak).
        nesterov_input = torch.lerp(
            grad.detach().to(torch.float32), stored, hyper.momentum, out=stored
        )
    elif hyper.nesterov:
        nesterov_input = torch.lerp(grad.detach(), stored, hyper.momentum)
    else:
        nesterov_input = stored
    update = newton_schulz(nesterov_input, hyper.schedule, hyper.eps)
    entry["step"] = int(entry["step"]) + 1
    if hyper.normuon:
        update = _normuon_(entry, update, hyper)
    return update


def apply_update_(local: Tensor, update: Tensor, *, hyper: MuonHyper, ratio: float) -> None:
    """Steps 4–5 on ``local`` in place: decay with the raw lr, then ``-(lr·ratio)·O``."""
    target = local.detach()
    if hyper.weight_decay > 0:
        target.mul_(hyper.decay())
    target.add_(update, alpha=-hyper.scaled_lr(ratio))
