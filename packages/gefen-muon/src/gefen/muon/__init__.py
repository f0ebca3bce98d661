"""gefen.muon: ``GefenMuon`` (Muon with 8-bit codebook momentum) and its pure kernels."""

from gefen.muon._version import __version__
from gefen.muon.kernels import (
    NS_SCHEDULES,
    STANDARD_TRIPLE,
    adjust_lr_ratio,
    local_slice_of_full,
    newton_schulz,
    normuon_rescale,
    resolve_ns_schedule,
    stable_owner,
)
from gefen.muon.optimizer import GefenMuon

__all__ = [
    "NS_SCHEDULES",
    "STANDARD_TRIPLE",
    "GefenMuon",
    "__version__",
    "adjust_lr_ratio",
    "local_slice_of_full",
    "newton_schulz",
    "normuon_rescale",
    "resolve_ns_schedule",
    "stable_owner",
]
