"""gefen.muon: skeleton; the capability lands with its own issue."""

from gefen.muon._version import __version__

__all__ = ["__version__"]
