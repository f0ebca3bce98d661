"""GefenMuon's fused codebook momentum, selected per group and device type and cached.

A ``MomentumKernels`` maps ``(device type, resolved fused option, codebook size)`` to the compiled
``MomentumAdvancer`` (or None: the eager reference). It is derived data: the optimizer keeps one,
never pickles it, and makes a fresh one after a load or unpickling.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from gefen.core import extension as core_extension
from gefen.core.extension import CODEBOOK_CODECS, MomentumAdvancer, group_uses_codebook

__all__ = ["MomentumKernels"]


class MomentumKernels(dict[tuple[str, bool | None, int], MomentumAdvancer | None]):
    """The cache of selected momentum kernels, keyed ``(device type, fused, codebook size)``."""

    def select(self, group: Mapping[str, Any], device_type: str) -> MomentumAdvancer | None:
        """The fused codebook momentum of ``group`` on ``device_type``, or None for the eager
        reference (its codec is "none", or its ``fused`` is False).

        Selected (and compiled) in the local preflight, then cached. ``fused=True``: a compile
        failure raises and nothing is cached, so a retry selects again; ``fused=None``: one
        warning, then the eager path.
        """
        fused = core_extension.resolve_default(group["fused"])
        if fused is False or not group_uses_codebook(group):
            return None
        size = CODEBOOK_CODECS[group["momentum_codec"]]
        key = (device_type, fused, size)
        if key in self:
            return self[key]
        try:
            # The commit runs under no_grad: warming up under it too keeps Dynamo from
            # compiling a second graph for the grad mode (the preflight runs with grad on).
            with torch.no_grad():
                kernel: MomentumAdvancer | None = core_extension.fused_momentum(device_type, size)
        except Exception as error:
            what = f"the fused {group['momentum_codec']} momentum for device type {device_type!r}"
            if fused:
                raise RuntimeError(
                    f"GefenMuon: fused implementation failed to compile {what}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            warnings.warn(
                f"GefenMuon: {what} failed to compile; using the eager path "
                f"({type(error).__name__}: {error})",
                RuntimeWarning,
                stacklevel=2,
            )
            kernel = None
        self[key] = kernel
        return kernel
