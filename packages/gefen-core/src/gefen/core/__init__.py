"""gefen.core: ``Gefen``, an AdamW replacement with about 1 byte of state per parameter.

The public API for sibling packages lives at the import paths of 10-core.md §1.1
(``gefen.core.shell``, ``gefen.core.state``, ``gefen.core.codec``, ``gefen.core.kernels``,
``gefen.core.validation``).
"""

from gefen.core._version import __version__
from gefen.core.finalization import ParameterRebinding
from gefen.core.optimizer import Gefen
from gefen.core.validation import NonFiniteGradientError

__all__ = ["Gefen", "NonFiniteGradientError", "ParameterRebinding", "__version__"]
