"""The distribution installs as its own subpackage of the ``gefen`` namespace."""

from __future__ import annotations

import importlib.metadata
import pathlib

import gefen.hybrid


def test_version_matches_distribution_metadata() -> None:
    assert gefen.hybrid.__version__ == importlib.metadata.version("gefen-hybrid")


def test_ships_py_typed() -> None:
    package_dir = pathlib.Path(gefen.hybrid.__file__).parent
    assert (package_dir / "py.typed").is_file()
