"""gefen.core: skeleton; the capability lands with its own issue."""

from gefen.core._version import __version__

__all__ = ["__version__"]
