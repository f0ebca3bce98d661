"""gefen.hybrid: ``GefenMuonHybrid`` (whole-model Muon with a Gefen or AdamW backup) and routing."""

from gefen.hybrid._version import __version__
from gefen.hybrid.optimizer import GefenMuonHybrid
from gefen.hybrid.routing import (
    DEFAULT_BACKUP_SUBSTRINGS,
    is_muon_param,
    split_params_for_muon,
    validate_split,
)

__all__ = [
    "DEFAULT_BACKUP_SUBSTRINGS",
    "GefenMuonHybrid",
    "__version__",
    "is_muon_param",
    "split_params_for_muon",
    "validate_split",
]
