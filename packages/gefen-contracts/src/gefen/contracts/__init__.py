"""gefen.contracts: filled by the contracts work."""

from gefen.contracts._version import __version__

__all__ = ["__version__"]
