"""The one place this distribution's version is written."""

__version__ = "0.1.0"
