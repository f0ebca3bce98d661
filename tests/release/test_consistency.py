"""The release consistency rules (``tools/release.py --check``, also run by the lint session) hold
for this repository, and each rule fires on a deliberately broken throwaway copy."""

from __future__ import annotations

import pathlib
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = "packages/gefen-core"
CORE_VERSION = f"{CORE}/src/gefen/core/_version.py"


def set_version(root: pathlib.Path, relative: str, version: str) -> None:
    (root / relative).write_text(f'__version__ = "{version}"\n')


def test_this_repository_is_consistent(tool: ModuleType) -> None:
    assert tool.check(ROOT) == []


def test_every_package_version_has_a_changelog_entry(tool: ModuleType) -> None:
    """Stated directly too: the version is a heading, or the initial unreleased 0.1.0."""
    for name, package in tool.discover(ROOT).items():
        headings = tool.changelog_headings(package.changelog.read_text())
        versions = {tool.heading_version(heading) for heading in headings}
        assert package.version in versions or (
            package.version == "0.1.0" and "Unreleased" in versions
        ), f"{name} {package.version}: no CHANGELOG entry"


def test_every_sibling_range_admits_the_siblings_version(tool: ModuleType) -> None:
    packages = tool.discover(ROOT)
    for package in packages.values():
        for requirement in tool.sibling_requirements(package, packages):
            sibling = packages[requirement.name].version
            assert tool.admits(requirement.specifier, sibling), (package.name, requirement.text)


def test_a_clean_copy_has_no_finding(tool: ModuleType, repo: pathlib.Path) -> None:
    assert tool.check(repo) == []


def test_a_version_moved_without_a_changelog_entry_is_found(
    tool: ModuleType, repo: pathlib.Path
) -> None:
    set_version(repo, CORE_VERSION, "0.1.1")
    assert tool.check(repo) == [
        f"{CORE}/CHANGELOG.md: gefen-core is at 0.1.1 (in {CORE_VERSION}) but has no "
        "'## 0.1.1' entry"
    ]
    notes = repo / CORE / "CHANGELOG.md"
    notes.write_text(notes.read_text().replace("## 0.1.0 — unreleased", "## 0.1.1 — 2026-12-01"))
    assert tool.check(repo) == []


def test_the_initial_version_counts_an_unreleased_section(
    tool: ModuleType, repo: pathlib.Path
) -> None:
    notes = repo / CORE / "CHANGELOG.md"
    notes.write_text("# Changelog — gefen-core\n\n## Unreleased\n\n- First release.\n")
    assert tool.check(repo) == []  # 0.1.0 and its Unreleased section
    set_version(repo, CORE_VERSION, "0.1.3")  # only 0.1.0 may lean on Unreleased
    assert [finding.split(":")[0] for finding in tool.check(repo)] == [f"{CORE}/CHANGELOG.md"]


def test_a_sibling_range_that_excludes_the_siblings_version_is_found(
    tool: ModuleType, repo: pathlib.Path
) -> None:
    set_version(repo, "packages/gefen-dist/src/gefen/dist/_version.py", "0.2.0")
    notes = repo / "packages/gefen-dist/CHANGELOG.md"
    notes.write_text(notes.read_text().replace("## Unreleased", "## 0.2.0 — 2026-12-01", 1))
    findings = tool.check(repo)
    assert findings == [
        f"packages/{name}/pyproject.toml: 'gefen-dist>=0.1,<0.2' excludes gefen-dist 0.2.0, "
        "its current version"
        for name in ("gefen-core", "gefen-muon", "gefen-hybrid")
    ]


def test_a_torch_range_that_excludes_the_matrix_torch_is_found(
    tool: ModuleType, repo: pathlib.Path
) -> None:
    pyproject = repo / "packages/gefen-muon/pyproject.toml"
    text = pyproject.read_text()
    torch = next(r.text for r in tool.read_requirements(text, pyproject) if r.name == "torch")
    pyproject.write_text(text.replace(f'"{torch}"', '"torch>=3.0"'))
    assert tool.check(repo) == [
        "packages/gefen-muon/pyproject.toml: 'torch>=3.0' excludes the matrix's "
        f"{tool.torch_pin(repo)} (noxfile.py TORCH)"
    ]


@pytest.mark.parametrize("legal", ["LICENSE", "NOTICE"])
def test_a_legal_file_copy_that_differs_is_found(
    tool: ModuleType, repo: pathlib.Path, legal: str
) -> None:
    copy = repo / "packages/gefen-muon" / legal
    copy.write_bytes(copy.read_bytes() + b"\n")
    assert tool.check(repo) == [
        f"packages/gefen-muon/{legal}: must be a byte-identical copy of /{legal}"
    ]
    copy.unlink()
    assert len(tool.check(repo)) == 1


def test_a_readme_link_that_leaves_the_package_is_found(
    tool: ModuleType, repo: pathlib.Path
) -> None:
    readme = repo / "packages/gefen-contracts/README.md"
    readme.write_text("# x\n\nSee [the example](../../tests/contracts/test_adopt_adamw.py).\n")
    assert tool.check(repo) == [
        "packages/gefen-contracts/README.md: link '../../tests/contracts/test_adopt_adamw.py' "
        "does not work on an index page (use an absolute https:// URL)"
    ]
