"""``tools/release.py`` in throwaway git repositories: a patch release, a minor release whose
dependants' ranges follow, a release train, and every refusal leaving the repository untouched."""

from __future__ import annotations

import datetime
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DAY = datetime.date(2026, 12, 1)
CORE_VERSION = "packages/gefen-core/src/gefen/core/_version.py"
CORE_CHANGELOG = "packages/gefen-core/CHANGELOG.md"
PACKAGES = ("gefen-contracts", "gefen-dist", "gefen-core", "gefen-muon", "gefen-hybrid")


def pins(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def cli(repo: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python tools/release.py`` as the nox session runs it, on the throwaway repository."""
    command = [sys.executable, str(ROOT / "tools" / "release.py"), "--root", str(repo), *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def changed_in_head(run_git: Callable[..., str], root: pathlib.Path) -> set[str]:
    return set(run_git(root, "show", "--name-only", "--format=", "HEAD").splitlines())


def test_patch_release_bumps_dates_records_commits_and_tags(
    tool: ModuleType, repo: pathlib.Path, run_git: Callable[..., str]
) -> None:
    start = run_git(repo, "rev-parse", "HEAD")
    plan = tool.release(repo, "gefen-core", "patch", day=DAY)

    assert (plan.old_version, plan.version, plan.tag) == ("0.1.0", "0.1.1", "gefen-core-v0.1.1")
    assert '__version__ = "0.1.1"' in (repo / CORE_VERSION).read_text()
    notes = (repo / CORE_CHANGELOG).read_text()
    assert (
        "## Unreleased\n\n## 0.1.1 — 2026-12-01\n\n"
        "- gefen-core: a change waiting for its release.\n\n## 0.1.0 — unreleased\n"
    ) in notes
    assert notes.startswith("# Changelog — gefen-core\n")
    assert tool.unreleased_body(notes) == ""

    constraints = (repo / "constraints" / "2026-12-01.txt").read_text()
    assert pins(constraints) == [
        "gefen-contracts==0.1.0",
        "gefen-dist==0.1.0",
        "gefen-core==0.1.1",
        "gefen-muon==0.1.0",
        "gefen-hybrid==0.1.0",
        "torch==2.13.0",  # noxfile.py TORCH, read from the copy
    ]
    assert "torch>=2.13,<2.15" in constraints  # the packages' torch range
    assert "pip install gefen-hybrid -c constraints/2026-12-01.txt" in constraints

    head = run_git(repo, "rev-parse", "HEAD")
    assert run_git(repo, "rev-parse", "HEAD~1") == start
    assert run_git(repo, "log", "-1", "--format=%s") == "Release gefen-core 0.1.1"
    assert changed_in_head(run_git, repo) == {
        CORE_VERSION,
        CORE_CHANGELOG,
        "constraints/2026-12-01.txt",
    }
    assert run_git(repo, "status", "--porcelain") == ""
    assert run_git(repo, "tag", "--list") == "gefen-core-v0.1.1"
    assert run_git(repo, "cat-file", "-t", "gefen-core-v0.1.1") == "tag"  # annotated
    assert run_git(repo, "rev-parse", "gefen-core-v0.1.1^{commit}") == head
    assert plan.range_updates == ()
    assert plan.dependants == ()
    assert tool.check(repo) == []


def test_the_initial_release_publishes_the_version_in_the_tree_once(
    tool: ModuleType,
    repo: pathlib.Path,
    run_git: Callable[..., str],
    take_snapshot: Callable[[pathlib.Path], Any],
) -> None:
    """The first release of a distribution is the version its tree was written at (0.1.0, its
    CHANGELOG's "## 0.1.0 — unreleased"): no bump, that section dated, Unreleased merged in."""
    plan = tool.release(repo, "gefen-core", "initial", day=DAY)

    assert (plan.old_version, plan.version, plan.tag) == ("0.1.0", "0.1.0", "gefen-core-v0.1.0")
    assert '__version__ = "0.1.0"' in (repo / CORE_VERSION).read_text()
    notes = (repo / CORE_CHANGELOG).read_text()
    assert notes.endswith(
        "## Unreleased\n\n## 0.1.0 — 2026-12-01\n\n"
        "- gefen-core: a change waiting for its release.\n\n- First release.\n"
    )
    assert "unreleased\n" not in notes.lower().replace("## unreleased\n", "")
    assert changed_in_head(run_git, repo) == {CORE_CHANGELOG, "constraints/2026-12-01.txt"}
    assert run_git(repo, "tag", "--list") == "gefen-core-v0.1.0"
    assert "gefen-core==0.1.0" in pins((repo / "constraints" / "2026-12-01.txt").read_text())
    assert tool.check(repo) == []

    before = take_snapshot(repo)  # once only
    with pytest.raises(tool.ReleaseRefused, match="already exists: a version is released once"):
        tool.release(repo, "gefen-core", "initial", day=DAY)
    assert take_snapshot(repo) == before


def test_the_initial_release_is_refused_for_a_version_already_dated(
    tool: ModuleType,
    repo: pathlib.Path,
    take_snapshot: Callable[[pathlib.Path], Any],
    commit: Callable[[pathlib.Path, str], None],
) -> None:
    notes = repo / "packages/gefen-muon/CHANGELOG.md"
    notes.write_text(notes.read_text().replace("## 0.1.0 — unreleased", "## 0.1.0 — 2026-11-30"))
    commit(repo, "0.1.0 was released elsewhere")
    before = take_snapshot(repo)
    with pytest.raises(tool.ReleaseRefused, match=re.escape("no '## 0.1.0 — unreleased' section")):
        tool.release(repo, "gefen-muon", "initial", day=DAY)
    assert take_snapshot(repo) == before


def test_the_command_line_releases_as_the_nox_session_does(
    repo: pathlib.Path, run_git: Callable[..., str]
) -> None:
    before = datetime.date.today()
    done = cli(repo, "gefen-core", "patch")
    assert done.returncode == 0, done.stderr
    day = next(
        d for d in {before, datetime.date.today()} if (repo / f"constraints/{d}.txt").exists()
    )
    assert "gefen-core: 0.1.0 -> 0.1.1 (committed, tag gefen-core-v0.1.1)" in done.stdout
    assert "nothing was pushed" in done.stdout
    assert f"## 0.1.1 — {day.isoformat()}" in (repo / CORE_CHANGELOG).read_text()
    assert run_git(repo, "tag", "--list") == "gefen-core-v0.1.1"
    assert run_git(repo, "status", "--porcelain") == ""


def test_a_dry_run_writes_nothing(
    repo: pathlib.Path, take_snapshot: Callable[[pathlib.Path], Any]
) -> None:
    before = take_snapshot(repo)
    done = cli(repo, "gefen-core", "minor", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "dry run: nothing written" in done.stdout
    assert "need a release too (their gefen-core range changed): gefen-muon, gefen-hybrid" in (
        done.stdout
    )
    assert take_snapshot(repo) == before


def test_a_minor_release_moves_the_dependants_ranges_and_names_them(
    tool: ModuleType, repo: pathlib.Path, run_git: Callable[..., str]
) -> None:
    untouched = {
        name: (repo / "packages" / name / "pyproject.toml").read_bytes()
        for name in ("gefen-contracts", "gefen-dist")
    }
    plan = tool.release(repo, "gefen-core", "minor", day=DAY)

    assert plan.version == "0.2.0"
    assert plan.dependants == ("gefen-muon", "gefen-hybrid")  # both require gefen-core
    for name in plan.dependants:
        pyproject = (repo / "packages" / name / "pyproject.toml").read_text()
        assert '"gefen-core>=0.2,<0.3"' in pyproject
        assert "gefen-core>=0.1,<0.2" not in pyproject
        assert '"gefen-dist>=0.1,<0.2"' in pyproject  # other ranges stay
        notes = (repo / "packages" / name / "CHANGELOG.md").read_text()
        first = tool.unreleased_body(notes).splitlines()[0]
        assert first.startswith("- Requires `gefen-core>=0.2,<0.3` (was `gefen-core>=0.1,<0.2`)")
    for name, data in untouched.items():
        assert (repo / "packages" / name / "pyproject.toml").read_bytes() == data
    described = "\n".join(tool.describe(repo, plan, applied=True))
    assert "need a release too (their gefen-core range changed): gefen-muon, gefen-hybrid" in (
        described
    )
    assert "gefen-muon: gefen-core>=0.1,<0.2 -> gefen-core>=0.2,<0.3" in run_git(
        repo, "log", "-1", "--format=%b"
    )
    assert {
        "packages/gefen-muon/pyproject.toml",
        "packages/gefen-hybrid/pyproject.toml",
        "packages/gefen-muon/CHANGELOG.md",
        "packages/gefen-hybrid/CHANGELOG.md",
    } <= changed_in_head(run_git, repo)
    assert "gefen-core==0.2.0" in pins((repo / "constraints/2026-12-01.txt").read_text())
    assert tool.check(repo) == []  # every range admits every current version again


def test_a_release_train_ends_with_a_set_released_as_pinned(
    tool: ModuleType, repo: pathlib.Path, run_git: Callable[..., str]
) -> None:
    for name in PACKAGES:  # as if every 0.1.0 had been released from this tree
        run_git(repo, "tag", "-a", f"{name}-v0.1.0", "-m", f"{name} 0.1.0")
    core = tool.release(repo, "gefen-core", "minor", day=DAY)
    assert core.unpublished == ("gefen-muon", "gefen-hybrid")  # their 0.1.0 says gefen-core<0.2
    assert (
        "Not yet released at these versions: gefen-muon, gefen-hybrid"
        in (repo / "constraints/2026-12-01.txt").read_text()
    )

    muon = tool.release(repo, "gefen-muon", "patch", day=DAY)
    assert muon.dependants == ()  # gefen-hybrid's gefen-muon range admits 0.1.1
    assert muon.unpublished == ("gefen-hybrid",)

    hybrid = tool.release(repo, "gefen-hybrid", "patch", day=DAY)
    assert hybrid.unpublished == ()
    constraints = (repo / "constraints/2026-12-01.txt").read_text()
    assert "Not yet released" not in constraints
    assert pins(constraints)[:5] == [
        "gefen-contracts==0.1.0",
        "gefen-dist==0.1.0",
        "gefen-core==0.2.0",
        "gefen-muon==0.1.1",
        "gefen-hybrid==0.1.1",
    ]
    new_tags = set(run_git(repo, "tag", "--list").splitlines()) - {f"{n}-v0.1.0" for n in PACKAGES}
    assert new_tags == {"gefen-core-v0.2.0", "gefen-muon-v0.1.1", "gefen-hybrid-v0.1.1"}


def _dirty_tracked(root: pathlib.Path, _: Callable[[pathlib.Path, str], None]) -> None:
    with (root / "packages/gefen-core/README.md").open("a") as readme:
        readme.write("An edit nobody committed.\n")


def _dirty_untracked(root: pathlib.Path, _: Callable[[pathlib.Path, str], None]) -> None:
    (root / "notes.txt").write_text("not added\n")


def _existing_tag(root: pathlib.Path, _: Callable[[pathlib.Path, str], None]) -> None:
    subprocess.run(["git", "-C", str(root), "tag", "gefen-core-v0.1.1"], check=True)


def _empty_unreleased(root: pathlib.Path, commit: Callable[[pathlib.Path, str], None]) -> None:
    (root / CORE_CHANGELOG).write_text(
        "# Changelog — gefen-core\n\n## Unreleased\n\n## 0.1.0 — unreleased\n\n- First.\n"
    )
    commit(root, "Nothing to release")


def _excluding_range(root: pathlib.Path, commit: Callable[[pathlib.Path, str], None]) -> None:
    path = root / "packages/gefen-muon/pyproject.toml"
    path.write_text(path.read_text().replace("gefen-core>=0.1,<0.2", "gefen-core>=0.3,<0.4"))
    commit(root, "An inconsistent range")


def _pinned_range(root: pathlib.Path, commit: Callable[[pathlib.Path, str], None]) -> None:
    path = root / "packages/gefen-muon/pyproject.toml"
    path.write_text(path.read_text().replace("gefen-core>=0.1,<0.2", "gefen-core==0.1.0"))
    commit(root, "An exact pin the release cannot move")


def _nothing(root: pathlib.Path, _: Callable[[pathlib.Path, str], None]) -> None:
    pass


REFUSALS = [
    ("dirty-tracked", _dirty_tracked, "gefen-core", "patch", "dirty working tree"),
    ("dirty-untracked", _dirty_untracked, "gefen-core", "patch", "dirty working tree"),
    ("unknown-package", _nothing, "gefen-nope", "patch", "unknown package 'gefen-nope'"),
    ("unknown-kind", _nothing, "gefen-core", "huge", "unknown kind 'huge'"),
    ("existing-tag", _existing_tag, "gefen-core", "patch", "tag gefen-core-v0.1.1 already exists"),
    (
        "empty-unreleased",
        _empty_unreleased,
        "gefen-core",
        "patch",
        "'## Unreleased' section is empty",
    ),
    ("inconsistent", _excluding_range, "gefen-core", "patch", "fails tools/release.py --check"),
    ("pinned-range", _pinned_range, "gefen-core", "minor", "not a '>=X.Y,<X.Z' range"),
]


@pytest.mark.parametrize(
    ("setup", "package", "kind", "rule"),
    [case[1:] for case in REFUSALS],
    ids=[case[0] for case in REFUSALS],
)
def test_a_refused_release_changes_nothing(
    tool: ModuleType,
    repo: pathlib.Path,
    take_snapshot: Callable[[pathlib.Path], Any],
    commit: Callable[[pathlib.Path, str], None],
    setup: Callable[[pathlib.Path, Callable[[pathlib.Path, str], None]], None],
    package: str,
    kind: str,
    rule: str,
) -> None:
    setup(repo, commit)
    before = take_snapshot(repo)
    with pytest.raises(tool.ReleaseRefused) as refused:
        tool.release(repo, package, kind, day=DAY)
    assert rule in str(refused.value)
    assert take_snapshot(repo) == before  # files, HEAD, tags and status


def test_the_command_line_reports_a_refusal(
    repo: pathlib.Path, take_snapshot: Callable[[pathlib.Path], Any]
) -> None:
    _dirty_untracked(repo, lambda root, message: None)
    before = take_snapshot(repo)
    done = cli(repo, "gefen-core", "patch")
    assert done.returncode == 1
    assert "release refused: dirty working tree" in done.stderr
    assert take_snapshot(repo) == before


@pytest.mark.parametrize(
    ("version", "kind", "bumped", "compatible", "admits_old"),
    [
        ("0.1.0", "patch", "0.1.1", ">=0.1,<0.2", True),
        ("0.1.7", "minor", "0.2.0", ">=0.2,<0.3", False),  # 0.x: a minor release may break
        ("0.4.2", "major", "1.0.0", ">=1.0,<2", False),
        ("1.3.9", "minor", "1.4.0", ">=1.4,<2", False),
    ],
)
def test_version_rules(
    tool: ModuleType, version: str, kind: str, bumped: str, compatible: str, admits_old: bool
) -> None:
    assert tool.bump(version, kind) == bumped
    assert tool.compatible_range(bumped) == compatible
    assert tool.is_compatible_range(compatible)
    assert tool.admits(compatible, bumped)
    assert tool.admits(compatible, version) is admits_old


@pytest.mark.parametrize(
    ("specifier", "version", "expected"),
    [
        (">=0.1,<0.2", "0.1.0", True),
        (">=0.1,<0.2", "0.1.9", True),
        (">=0.1,<0.2", "0.2.0", False),
        (">=2.13,<2.15", "2.13.0", True),
        (">=2.13,<2.15", "2.15.0", False),
        ("==0.1.*", "0.1.4", True),
        ("==0.1.*", "0.2.0", False),
        ("~=0.1.2", "0.1.5", True),
        ("~=0.1.2", "0.2.0", False),
        ("!=0.1.1", "0.1.1", False),
        ("", "3.0.0", True),
    ],
)
def test_specifiers(tool: ModuleType, specifier: str, version: str, expected: bool) -> None:
    assert tool.admits(specifier, version) is expected
