"""The distribution installs as its own subpackage of the ``gefen`` namespace."""

from __future__ import annotations

import importlib.metadata
import pathlib

import gefen.muon


def test_version_matches_distribution_metadata() -> None:
    assert gefen.muon.__version__ == importlib.metadata.version("gefen-muon")


def test_ships_py_typed() -> None:
    package_dir = pathlib.Path(gefen.muon.__file__).parent
    assert (package_dir / "py.typed").is_file()
