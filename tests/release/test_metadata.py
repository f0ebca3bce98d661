"""Index-ready metadata for every distribution: the license files, project URLs, classifiers and
keywords in each ``pyproject.toml``, and READMEs whose links work on an index page."""

from __future__ import annotations

import pathlib
import re
from types import ModuleType
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIRS = sorted(path.parent for path in ROOT.glob("packages/*/pyproject.toml"))
HOST = "https://github.com/gefen-optim/gefen"  # placeholder until the project is hosted
CLASSIFIERS = {
    "Development Status :: 3 - Alpha",
    "Programming Language :: Python :: 3 :: Only",
    "Programming Language :: Python :: 3.10",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: Python :: 3.13",
    "Typing :: Typed",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Operating System :: OS Independent",
}


def project(folder: pathlib.Path) -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((folder / "pyproject.toml").read_text())
    return data


def test_there_is_one_package_folder_per_distribution() -> None:
    assert [folder.name for folder in PACKAGE_DIRS] == sorted(
        ["gefen-contracts", "gefen-dist", "gefen-core", "gefen-muon", "gefen-hybrid"]
    )


def test_the_root_license_is_apache_2_and_the_notice_names_the_copyright() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text
    assert "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert "Copyright 2026 The Gefen developers" in (ROOT / "NOTICE").read_text()


@pytest.mark.parametrize("legal", ["LICENSE", "NOTICE"])
@pytest.mark.parametrize("folder", PACKAGE_DIRS, ids=lambda folder: folder.name)
def test_every_package_holds_an_identical_copy(folder: pathlib.Path, legal: str) -> None:
    assert (folder / legal).read_bytes() == (ROOT / legal).read_bytes()


@pytest.mark.parametrize("folder", PACKAGE_DIRS, ids=lambda folder: folder.name)
def test_the_metadata_is_ready_for_an_index(folder: pathlib.Path) -> None:
    data = project(folder)
    meta = data["project"]
    assert meta["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
    assert set(meta["license-files"]) >= {"LICENSE", "NOTICE"}
    # PEP 639: with an SPDX expression the License :: classifiers are deprecated; PyPI refuses
    # uploads that carry both.
    assert not [c for c in meta["classifiers"] if c.startswith("License ::")]
    assert set(meta["classifiers"]) >= CLASSIFIERS
    assert "Intended Audience :: Science/Research" in meta["classifiers"]
    assert meta["keywords"]
    assert meta["urls"] == {
        "Homepage": HOST,
        "Documentation": f"{HOST}/tree/main/docs",
        "Changelog": f"{HOST}/blob/main/packages/{folder.name}/CHANGELOG.md",
        "Issues": f"{HOST}/issues",
    }
    sdist = data["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    assert {"LICENSE", "NOTICE", "README.md", "CHANGELOG.md"} <= set(sdist)
    assert any(
        re.match(r"hatchling>=1\.(2[7-9]|[3-9]\d)", r) for r in data["build-system"]["requires"]
    )


@pytest.mark.parametrize("folder", PACKAGE_DIRS, ids=lambda folder: folder.name)
def test_the_readme_links_work_on_an_index_page(tool: ModuleType, folder: pathlib.Path) -> None:
    links = tool.readme_links((folder / "README.md").read_text())
    assert [link for link in links if tool.leaves_index_page(link)] == []


def test_the_link_finder_sees_every_kind_of_link(tool: ModuleType) -> None:
    text = (
        "[inline](../../tests/x.py) and [absolute](https://example.org/a) and [anchor](#usage)\n"
        "[ref]: docs/page.md\n"
        '<img src="benchmarks/report.png"> <a href="https://example.org/b">b</a>\n'
    )
    links = tool.readme_links(text)
    assert sorted(link for link in links if tool.leaves_index_page(link)) == [
        "#usage",
        "../../tests/x.py",
        "benchmarks/report.png",
        "docs/page.md",
    ]
    assert sorted(link for link in links if not tool.leaves_index_page(link)) == [
        "https://example.org/a",
        "https://example.org/b",
    ]
