"""gefen.core: ``Gefen``, an AdamW replacement with about 1 byte of state per parameter.

This module is the user API. Optimizers built on gefen-core's shell (gefen-muon, gefen-hybrid,
a third party's) import everything else from ``gefen.core.extension``, the extension API.
"""

from gefen.core._version import __version__
from gefen.core.optimizer import Gefen
from gefen.core.sharded_layout import ParameterRebinding
from gefen.core.validation import NonFiniteGradientError

__all__ = ["Gefen", "NonFiniteGradientError", "ParameterRebinding", "__version__"]
