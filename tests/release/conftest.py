"""Fixtures for the release tests: ``tools/release.py`` loaded as a module, and throwaway git
repositories shaped like this one.

Loading it imports its read-only rules as ``tools.release_rules`` (it puts the repository root on
``sys.path`` for that); the tests reach the rules through the loaded module.

A throwaway repository copies what the tool reads from the real tree (every package's
``pyproject.toml``, ``noxfile.py``, LICENSE and NOTICE) so the dependency graph and the torch
requirements are the real ones, and writes the parts that move with real releases in a known state:
every version at 0.1.0, every sibling range at ``>=0.1,<0.2``, a CHANGELOG with one Unreleased
entry, a one-line README. No network: git runs locally only.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL_NAME = "gefen_release_tool"


def load_tool() -> ModuleType:
    if TOOL_NAME in sys.modules:
        return sys.modules[TOOL_NAME]
    spec = importlib.util.spec_from_file_location(TOOL_NAME, ROOT / "tools" / "release.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[TOOL_NAME] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tool() -> ModuleType:
    return load_tool()


def git(root: pathlib.Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def changelog(name: str, unreleased: str = "") -> str:
    body = f"{unreleased}\n\n" if unreleased else ""
    return (
        f"# Changelog — {name}\n\n"
        "All notable changes to this distribution.\n\n"
        f"## Unreleased\n\n{body}"
        "## 0.1.0 — unreleased\n\n- First release.\n"
    )


def build_repository(destination: pathlib.Path) -> pathlib.Path:
    """A committed git repository shaped like the real one, at the known state above."""
    if shutil.which("git") is None:  # the release tool commits and tags
        pytest.skip("the throwaway repositories need git")
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("noxfile.py", "LICENSE", "NOTICE"):
        shutil.copyfile(ROOT / name, destination / name)
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        folder = destination / "packages" / pyproject.parent.name
        folder.mkdir(parents=True)
        text = pyproject.read_text(encoding="utf-8")
        text = re.sub(r'"(gefen-[a-z]+)\s*[<>=!~][^"]*"', r'"\1>=0.1,<0.2"', text)  # sibling ranges
        (folder / "pyproject.toml").write_text(text, encoding="utf-8")
        version_path = re.search(r'\[tool\.hatch\.version\]\s*\npath\s*=\s*"([^"]+)"', text)
        assert version_path is not None
        version_file = folder / version_path.group(1)
        version_file.parent.mkdir(parents=True)
        version_file.write_text('"""The version."""\n\n__version__ = "0.1.0"\n', encoding="utf-8")
        name = pyproject.parent.name
        entry = f"- {name}: a change waiting for its release."
        (folder / "CHANGELOG.md").write_text(changelog(name, entry), encoding="utf-8")
        (folder / "README.md").write_text(f"# {name}\n\nSee https://example.org/.\n")
        for legal in ("LICENSE", "NOTICE"):
            shutil.copyfile(ROOT / legal, folder / legal)
    git(destination, "init", "--quiet")
    for key, value in (
        ("user.name", "Release Test"),
        ("user.email", "release-test@example.org"),
        ("commit.gpgsign", "false"),
        ("tag.gpgsign", "false"),
    ):
        git(destination, "config", key, value)
    commit_all(destination, "The starting tree")
    return destination


def commit_all(root: pathlib.Path, message: str) -> None:
    git(root, "add", "--all")
    git(root, "commit", "--quiet", "-m", message)


@pytest.fixture
def repo(tmp_path: pathlib.Path) -> pathlib.Path:
    return build_repository(tmp_path / "repo")


Snapshot = tuple[dict[str, bytes], str, str, str]


def snapshot(root: pathlib.Path) -> Snapshot:
    """Every file's bytes (outside .git), HEAD, the tags and git's status."""
    files = {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(root).parts
    }
    return (
        files,
        git(root, "rev-parse", "HEAD"),
        git(root, "tag", "--list"),
        git(root, "status", "--porcelain"),
    )


@pytest.fixture
def take_snapshot() -> Callable[[pathlib.Path], Snapshot]:
    return snapshot


@pytest.fixture
def run_git() -> Callable[..., str]:
    """``run_git(root, *args)``: git's stripped stdout; raises on a non-zero exit."""
    return git


@pytest.fixture
def commit() -> Callable[[pathlib.Path, str], None]:
    """``commit(root, message)``: commit every change of the throwaway repository."""
    return commit_all
