"""Block quantization: values as codebook indices times one fp32 magnitude per block.

Published as ``gefen.core.codec`` (docs/core.md §1.1), shared by ``Gefen`` and ``GefenMuon``; it
lives among the kernels because the update kernels re-quantize the momentum with it. A block is
``period`` consecutive elements in logical order. Its magnitude is the block's absolute maximum,
so the largest element of every block is stored exactly (it maps to the endpoint -1 or +1).

The codebook's size is the code width: a 256-value codebook (``codebook8``) stores one uint8
index per element, a codebook of at most 16 values (``codebook4``) two per byte, element ``2j``
in the low nibble of byte ``j`` and ``2j + 1`` in the high one, so a block of ``P`` elements
takes ``ceil(P / 2)`` bytes (an odd block's last high nibble is 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gefen.core.kernels.quantize import nearest_index, stochastic_index

__all__ = [
    "PACKED_CODEBOOK_SIZE",
    "code_bytes",
    "decode_blocks",
    "encode_blocks",
    "is_packed",
    "pack_codes",
    "requantized_lerp",
    "unpack_codes",
]

PACKED_CODEBOOK_SIZE = 16
"""The largest codebook whose indices are stored two per byte (4-bit codes)."""


def is_packed(codebook: Tensor) -> bool:
    """Whether indices into ``codebook`` are stored two per byte."""
    return codebook.numel() <= PACKED_CODEBOOK_SIZE


def code_bytes(period: int, packed: bool) -> int:
    """Bytes of codes per block of ``period`` elements."""
    return (period + 1) // 2 if packed else period


def pack_codes(index: Tensor) -> Tensor:
    """Indices (B, P) below 16 (any integer dtype) as uint8 (B, ceil(P / 2)), two per byte."""
    rows, period = index.shape
    if period % 2:
        index = torch.cat([index, index.new_zeros(rows, 1)], dim=1)
    pairs = index.to(torch.uint8).view(rows, -1, 2)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 4)


def unpack_codes(codes: Tensor, period: int) -> Tensor:
    """The int64 indices (B, ``period``) that ``pack_codes`` stored in ``codes``."""
    pairs = torch.stack([codes & 15, codes >> 4], dim=2).view(codes.shape[0], -1)
    return pairs[:, :period].to(torch.int64)


def encode_blocks(
    m: Tensor, codebook: Tensor, period: int, *, seed: tuple[int, ...] | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize fp32 values in logical order to ``(codes uint8 (B, P), scale fp32 (B, 1))``,
    or codes (B, ceil(P / 2)) two per byte for a codebook of at most 16 values.

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
    return (pack_codes(codes) if is_packed(codebook) else codes), scale


def decode_blocks(
    codes: Tensor, scale: Tensor, codebook: Tensor, *, period: int | None = None
) -> Tensor:
    """``cb[codes] · scale``: fp32 (B, P) from uint8 codes and fp32 scales (B, 1).

    Codes are (B, P), or (B, ceil(P / 2)) two per byte for a codebook of at most 16 values;
    ``period`` is P, needed only for packed codes of an odd period (default: two per byte)."""
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
    if not is_packed(codebook):
        return codebook[codes.long()] * scale
    width = codes.shape[1]
    if period is None:
        period = 2 * width
    if code_bytes(period, packed=True) != width:
        raise ValueError(
            f"decode_blocks: {width} bytes of packed codes do not hold period {period}"
        )
    return codebook[unpack_codes(codes, period)] * scale


def requantized_lerp(
    codes: Tensor,
    scale: Tensor,
    codebook: Tensor,
    target: Tensor,
    weight: float,
    seed: tuple[int, ...] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Codebook momentum's advance, the reference both Gefen and GefenMuon use: decode,
    ``lerp(decoded, target, weight)`` (fp32, (B, P)), re-encode. Returns the new codes and
    scale and their decoded values (what the update applies is exactly what is stored).
    Nothing is modified."""
    period = target.shape[1]
    decoded = decode_blocks(codes, scale, codebook, period=period)
    advanced = torch.lerp(decoded, target, weight)
    new_codes, new_scale = encode_blocks(advanced, codebook, period, seed=seed)
    return new_codes, new_scale, decode_blocks(new_codes, new_scale, codebook, period=period)
