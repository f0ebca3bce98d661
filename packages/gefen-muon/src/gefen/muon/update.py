"""One matrix's Muon update, staged (20-muon.md §4 "One parameter's update", §5).

``orthogonal_update`` runs steps 1–3 on the matrix the mode quantizes (full or local) and
returns the new state entry and the orthogonalised update; ``apply_update`` runs steps 4–5 on
a parameter's (local) values. Both return new tensors and write nothing, so the optimizer can
stage a whole step before it commits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.core.codec import decode_blocks, encode_blocks
from gefen.muon.kernels import newton_schulz, normuon_rescale

__all__ = ["MuonHyper", "apply_update", "orthogonal_update"]

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


def _codebook_momentum(
    entry: Mapping[str, Any],
    grad: Tensor,
    codebook: Tensor,
    momentum: float,
    seed: tuple[int, int] | None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Step 1 for codebook8: lerp the decoded EMA, re-encode, and decode what is stored."""
    period = int(entry["period"])
    grad32 = grad.detach().to(torch.float32).reshape(-1, period)
    ema = decode_blocks(entry[CODES], entry[SCALE], codebook)
    ema = torch.lerp(ema, grad32, 1.0 - momentum)
    codes, scale = encode_blocks(ema.reshape(-1), codebook, period, seed=seed)
    stored = decode_blocks(codes, scale, codebook).reshape(grad.shape)
    return {CODES: codes, SCALE: scale}, stored


def _dense_momentum(
    entry: Mapping[str, Any], grad: Tensor, momentum: float
) -> tuple[dict[str, Tensor], Tensor]:
    """Step 1 for codec "none": the buffer's EMA in the parameter dtype (torch.optim.Muon)."""
    buffer = entry[BUFFER].clone()
    buffer.lerp_(grad, 1.0 - momentum)
    return {BUFFER: buffer}, buffer


def _normuon(
    entry: Mapping[str, Any], update: Tensor, hyper: MuonHyper
) -> tuple[Tensor, dict[str, Any]]:
    """NorMuon state is created lazily, so it may be switched on mid-run."""
    if "normuon_v" in entry:
        v = entry["normuon_v"].clone()
        t = int(entry["normuon_step"])
    else:
        v = torch.zeros(update.shape[0], 1, dtype=torch.float32, device=update.device)
        t = 0
    rescaled, t = normuon_rescale(update, v, t, hyper.normuon_beta2, hyper.normuon_eps)
    return rescaled, {"normuon_v": v, "normuon_step": t}


def orthogonal_update(
    entry: Mapping[str, Any],
    grad: Tensor,
    *,
    codebook: Tensor | None,
    hyper: MuonHyper,
    seed: tuple[int, int] | None = None,
) -> tuple[dict[str, Any], Tensor]:
    """Steps 1–3 on ``grad`` (the quantized matrix): the new entry and the bf16 update O.

    ``entry`` is an initialized entry (``step`` may be 0 for a new one) with the codec's keys;
    ``codebook`` is required with the codebook8 keys. The stored state is the plain EMA;
    Nesterov is applied after quantization, to the decoded stored momentum.
    """
    if CODES in entry:
        if codebook is None:
            raise ValueError("codebook8 momentum needs a codebook")
        momentum_keys, stored = _codebook_momentum(entry, grad, codebook, hyper.momentum, seed)
        grad_in = grad.detach().to(torch.float32)
    else:
        momentum_keys, stored = _dense_momentum(entry, grad, hyper.momentum)
        grad_in = grad.detach()
    nesterov_input = torch.lerp(grad_in, stored, hyper.momentum) if hyper.nesterov else stored
    update = newton_schulz(nesterov_input, hyper.schedule, hyper.eps)
    new_entry: dict[str, Any] = {"period": entry["period"], "step": int(entry["step"]) + 1}
    new_entry.update(momentum_keys)
    if hyper.normuon:
        update, normuon_keys = _normuon(entry, update, hyper)
        new_entry.update(normuon_keys)
    elif "normuon_v" in entry:
        new_entry["normuon_v"] = entry["normuon_v"]
        new_entry["normuon_step"] = entry["normuon_step"]
    return new_entry, update


def apply_update(local: Tensor, update: Tensor, *, hyper: MuonHyper, ratio: float) -> Tensor:
    """Steps 4–5 on a copy of ``local``: decay with the raw lr, then ``-(lr·ratio)·O``."""
    result = local.detach().clone()
    if hyper.weight_decay > 0:
        result.mul_(1.0 - hyper.lr * hyper.weight_decay)
    result.add_(update, alpha=-(hyper.lr * ratio))
    return result
