"""The distribution installs as its own subpackage of the ``gefen`` namespace."""

from __future__ import annotations

import importlib.metadata
import pathlib

import gefen.core


def test_version_matches_distribution_metadata() -> None:
    assert gefen.core.__version__ == importlib.metadata.version("gefen-core")


def test_ships_py_typed() -> None:
    package_dir = pathlib.Path(gefen.core.__file__).parent
    assert (package_dir / "py.typed").is_file()
