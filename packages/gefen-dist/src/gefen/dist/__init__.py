"""gefen.dist: skeleton; the capability lands with its own issue."""

from gefen.dist._version import __version__

__all__ = ["__version__"]
