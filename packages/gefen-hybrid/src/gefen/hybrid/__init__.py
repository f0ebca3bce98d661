"""gefen.hybrid: skeleton; the capability lands with its own issue."""

from gefen.hybrid._version import __version__

__all__ = ["__version__"]
