"""The block codec of docs/core.md §1.1: ``encode_blocks`` and ``decode_blocks``.

This is the public, semver-governed import path that ``gefen.muon`` and ``gefen.hybrid`` use.
The implementation lives in ``gefen.core.kernels.blocks`` because the update kernels need it too.
"""

from gefen.core.kernels.blocks import decode_blocks, encode_blocks

__all__ = ["decode_blocks", "encode_blocks"]
