"""Block quantization: values as uint8 codebook indices times one fp32 magnitude per block.

Published as ``gefen.core.codec`` (docs/core.md §1.1), shared by ``Gefen`` and ``GefenMuon``; it
lives among the kernels because the update kernels re-quantize the momentum with it. A block is
``period`` consecutive elements in logical order. Its magnitude is the block's absolute maximum,
so the largest element of every block is stored exactly (it maps to the endpoint -1 or +1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gefen.core.kernels.quantize import nearest_index, stochastic_index

__all__ = ["decode_blocks", "encode_blocks", "requantized_lerp"]


def encode_blocks(
    m: Tensor, codebook: Tensor, period: int, *, seed: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize fp32 values in logical order to ``(codes uint8 (B, P), scale fp32 (B, 1))``.

    ``scale`` is the per-block absolute maximum; each value is divided by its block's scale (0
    where the scale is 0) and rounded with ``nearest_index``, or with ``stochastic_index`` when
    ``seed = (global_step, param_index)`` is given. ``m`` is read as ``fp32(m)``; its element count
    must be a multiple of ``period``. Nothing is modified.
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"encode_blocks: period must be an int >= 1, got {period!r}")
    if m.numel() % period != 0:
        raise ValueError(f"encode_blocks: period {period} does not divide numel {m.numel()}")
    blocks = m.detach().reshape(-1, period).to(torch.float32)
    scale = blocks.abs().amax(dim=1, keepdim=True)
    normalised = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks))
    if seed is None:
        codes = nearest_index(codebook, normalised)
    else:
        codes = stochastic_index(codebook, normalised, seed=seed)
    return codes, scale


def decode_blocks(codes: Tensor, scale: Tensor, codebook: Tensor) -> Tensor:
    """``cb[codes] · scale``: fp32 (B, P) from uint8 codes (B, P) and fp32 scales (B, 1)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(
            f"decode_blocks: codes must be uint8 (B, P), got {codes.dtype} {tuple(codes.shape)}"
        )
    if scale.dtype != torch.float32 or scale.shape != (codes.shape[0], 1):
        raise ValueError(
            f"decode_blocks: scale must be float32 ({codes.shape[0]}, 1), got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    if codebook.dtype != torch.float32 or codebook.dim() != 1:
        raise ValueError("decode_blocks: codebook must be a 1-D float32 tensor")
    return codebook[codes.long()] * scale


def requantized_lerp(
    codes: Tensor,
    scale: Tensor,
    codebook: Tensor,
    target: Tensor,
    weight: float,
    seed: tuple[int, int] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """codebook8 momentum's advance, the reference both Gefen and GefenMuon use: decode,
    ``lerp(decoded, target, weight)`` (fp32, (B, P)), re-encode. Returns the new codes and
    scale and their decoded values (what the update applies is exactly what is stored).
    Nothing is modified."""
    advanced = torch.lerp(decode_blocks(codes, scale, codebook), target, weight)
    new_codes, new_scale = encode_blocks(advanced, codebook, codes.shape[1], seed=seed)
    return new_codes, new_scale, decode_blocks(new_codes, new_scale, codebook)
