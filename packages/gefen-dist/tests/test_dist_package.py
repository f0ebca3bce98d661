"""The distribution installs as its own subpackage of the ``gefen`` namespace."""

from __future__ import annotations

import importlib.metadata
import pathlib

import gefen.dist


def test_version_matches_distribution_metadata() -> None:
    assert gefen.dist.__version__ == importlib.metadata.version("gefen-dist")


def test_ships_py_typed() -> None:
    package_dir = pathlib.Path(gefen.dist.__file__).parent
    assert (package_dir / "py.typed").is_file()
