"""Release one Gefen distribution: bump, date the CHANGELOG, follow the ranges, record the set, tag.

``nox -s release -- <package> <major|minor|patch>`` runs ``python tools/release.py <package>
<kind>`` (``initial`` instead releases the version already in the tree, which its CHANGELOG
holds as ``## <version> — unreleased``: no bump, and that section is dated). In one commit it

1. bumps ``__version__`` in the package's version file (``[tool.hatch.version] path``);
2. moves the CHANGELOG's ``## Unreleased`` body under ``## <version> — <YYYY-MM-DD>``, leaving an
   empty ``## Unreleased`` on top;
3. rewrites every sibling range that excludes the new version (``>=X.Y,<X.Z`` ranges only), notes
   the change in that sibling's CHANGELOG and reports that the sibling needs a release too;
4. writes the tested set ``constraints/<YYYY-MM-DD>.txt``: ``==`` pins of every distribution's
   version and the torch requirement the test matrix installs (``TORCH`` in ``noxfile.py``);

then creates the annotated tag ``<package>-v<version>``. It never pushes or uploads. Every rule is
checked before anything is written; a refused release changes nothing.

``python tools/release.py --write-constraints`` records today's tested set without a release.
``python tools/release.py --check`` runs the consistency rules of ``release_rules.check`` (a
CHANGELOG entry for every current version, sibling ranges that admit the siblings' versions, the
matrix's torch inside every torch range, identical LICENSE/NOTICE copies, self-contained package
READMEs) and exits 1 on a finding. The procedure is written up in ``docs/releasing.md``.

This module is the release command: git, the tested set, the plan and its application. What it
reads and checks (versions, specifiers, the packages, the CHANGELOGs, the rules) is the read-only
``tools/release_rules.py``; the names the tests use from there are importable from here too.

Standard library only: the release session runs without a virtual environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Sequence

# Run as a script, sys.path[0] is tools/. With the repository root on the path the rules import
# as ``tools.release_rules``, the name mypy gives them, here and in the tests (which load this file
# by path).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tools.release_rules import (
    KINDS,
    Package,
    Requirement,
    add_unreleased_note,
    admits,
    bump,
    check,
    compatible_range,
    date_changelog,
    date_initial_changelog,
    discover,
    initial_span,
    is_compatible_range,
    read_requirements,
    replace_requirement,
    set_version,
    torch_pin,
    torch_ranges,
    unreleased_body,
)

# The rest of the rules that the tests reach through this module.
from tools.release_rules import changelog_headings as changelog_headings
from tools.release_rules import heading_version as heading_version
from tools.release_rules import leaves_index_page as leaves_index_page
from tools.release_rules import readme_links as readme_links
from tools.release_rules import sibling_requirements as sibling_requirements

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSTRAINTS_DIR = "constraints"
INITIAL = "initial"  # release the version in the tree, never released yet: no bump


class ReleaseRefused(Exception):
    """A release rule does not hold; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class RangeUpdate:
    dependant: str
    old: str  # the old requirement string
    new: str  # the new requirement string


@dataclasses.dataclass(frozen=True)
class Plan:
    """A release computed in full before anything is written."""

    package: str
    old_version: str
    version: str
    tag: str
    day: datetime.date
    writes: dict[pathlib.Path, str]  # absolute path -> new text
    range_updates: tuple[RangeUpdate, ...]
    unpublished: tuple[str, ...]  # pinned siblings with no tag, or ranges changed since it

    @property
    def dependants(self) -> tuple[str, ...]:
        """The siblings whose range followed: each needs a release too."""
        return tuple(dict.fromkeys(update.dependant for update in self.range_updates))


# --- git -----------------------------------------------------------------------------------------


def git(root: pathlib.Path, *args: str, check_rc: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=check_rc
    )


def tag_exists(root: pathlib.Path, tag: str) -> bool:
    return (
        git(root, "rev-parse", "-q", "--verify", f"refs/tags/{tag}", check_rc=False).returncode == 0
    )


def _requirements_at(
    root: pathlib.Path, revision: str, package: Package
) -> tuple[Requirement, ...]:
    path = package.pyproject.relative_to(root).as_posix()
    shown = git(root, "show", f"{revision}:{path}", check_rc=False)
    if shown.returncode != 0:
        return ()
    return read_requirements(shown.stdout, package.pyproject)


# --- the release ---------------------------------------------------------------------------------


def constraints_text(
    packages: dict[str, Package],
    versions: dict[str, str],
    pin: str,
    ranges: Sequence[str],
    day: datetime.date,
    unpublished: Sequence[str],
) -> str:
    """The tested set: a pip constraints file pinning every distribution and the matrix's torch."""
    name = f"{CONSTRAINTS_DIR}/{day.isoformat()}.txt"
    lines = [
        f"# The Gefen tested set of {day.isoformat()}: these versions of the distributions were",
        "# tested together by the nox matrix. Use it as a pip constraints file:",
        f"#     pip install gefen-hybrid -c {name}",
        f"# torch: the matrix installs {pin}; the packages accept torch{' / torch'.join(ranges)}.",
    ]
    if unpublished:
        note = (
            f"Not yet released at these versions: {', '.join(unpublished)} (no <name>-v<version> "
            "tag, or sibling ranges changed since the tag); until they are, install the pinned "
            "versions from wheels built from this repository (nox -s build)."
        )
        lines += textwrap.wrap(
            note, width=98, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
        )
    lines += [f"{package}=={versions[package]}" for package in packages]
    lines.append(pin)
    return "\n".join(lines) + "\n"


def unpublished_siblings(
    root: pathlib.Path,
    packages: dict[str, Package],
    requirements: dict[str, tuple[Requirement, ...]],
    released: str | None,
) -> list[str]:
    """Siblings whose pinned version is not what an index would hold: no tag for it yet, or
    dependency ranges (``requirements``, as they will be committed) that differ from the tag's."""
    found = []
    for name, sibling in packages.items():
        if name == released:
            continue
        tag = f"{name}-v{sibling.version}"
        if not tag_exists(root, tag) or _requirements_at(root, tag, sibling) != requirements[name]:
            found.append(name)
    return found


def write_constraints(root: pathlib.Path, day: datetime.date) -> pathlib.Path:
    """``constraints/<day>.txt`` for the tree as it is (the release writes it as part of its
    commit; this is for a tested set recorded without a release)."""
    packages = discover(root)
    requirements = {name: p.requirements for name, p in packages.items()}
    path = root / CONSTRAINTS_DIR / f"{day.isoformat()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = constraints_text(
        packages,
        {name: p.version for name, p in packages.items()},
        torch_pin(root),
        torch_ranges(packages),
        day,
        unpublished_siblings(root, packages, requirements, None),
    )
    path.write_text(text, encoding="utf-8")
    return path


def _refuse_unless_ready(
    root: pathlib.Path, packages: dict[str, Package], package: str, kind: str
) -> None:
    """:class:`ReleaseRefused` unless ``package`` and ``kind`` are known and the tree is a clean,
    consistent git working tree with a committer identity."""
    if package not in packages:
        raise ReleaseRefused(
            f"unknown package {package!r}: a release names one of {', '.join(packages)}"
        )
    if kind not in (*KINDS, INITIAL):
        raise ReleaseRefused(
            f"unknown kind {kind!r}: a release is one of {', '.join((*KINDS, INITIAL))}"
        )
    inside = git(root, "rev-parse", "--is-inside-work-tree", check_rc=False)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        raise ReleaseRefused(f"{root} is not a git working tree: a release commits and tags")
    status = git(root, "status", "--porcelain").stdout
    if status.strip():
        changed = ", ".join(line[3:] for line in status.splitlines()[:5])
        raise ReleaseRefused(
            "dirty working tree: a release starts from a clean checkout (commit or stash "
            f"first; changed: {changed})"
        )
    findings = check(root)
    if findings:
        raise ReleaseRefused(
            "the repository fails tools/release.py --check: a release starts from a consistent "
            "set:\n  " + "\n  ".join(findings)
        )
    if git(root, "var", "GIT_COMMITTER_IDENT", check_rc=False).returncode != 0:
        raise ReleaseRefused("git has no user.name/user.email: a release commits and tags")


def _follow_ranges(
    root: pathlib.Path,
    packages: dict[str, Package],
    package: str,
    version: str,
    writes: dict[pathlib.Path, str],
    requirements: dict[str, tuple[Requirement, ...]],
) -> list[RangeUpdate]:
    """Every sibling range that excludes ``package`` ``version`` follows, in ``writes`` (with a
    note in the dependant's CHANGELOG) and in ``requirements``; a range of another form refuses."""
    updates: list[RangeUpdate] = []
    for dependant in packages.values():
        for requirement in dependant.requirements:
            if requirement.name != package or admits(requirement.specifier, version):
                continue
            if not is_compatible_range(requirement.specifier):
                raise ReleaseRefused(
                    f"{dependant.pyproject.relative_to(root)}: {requirement.text!r} excludes "
                    f"{version} and is not a '>=X.Y,<X.Z' range the release can update: "
                    "widen it by hand and commit first"
                )
            new = requirement.text.replace(requirement.specifier, compatible_range(version), 1)
            updates.append(RangeUpdate(dependant.name, requirement.text, new))
            text = writes.get(dependant.pyproject) or dependant.pyproject.read_text("utf-8")
            writes[dependant.pyproject] = replace_requirement(
                text, dependant.pyproject, requirement.text, new
            )
            requirements[dependant.name] = read_requirements(
                writes[dependant.pyproject], dependant.pyproject
            )
            note = (
                f"Requires `{new}` (was `{requirement.text}`): {package} {version} is out of the "
                "old range."
            )
            notes_text = writes.get(dependant.changelog) or dependant.changelog.read_text("utf-8")
            writes[dependant.changelog] = add_unreleased_note(notes_text, note)
    return updates


def _initial_changelog(
    root: pathlib.Path, released: Package, changelog: str, day: datetime.date
) -> str:
    """The CHANGELOG of the first release of the version in the tree, or a refusal: that
    version must be written down as ``## <version> — unreleased`` (never released)."""
    where = released.changelog.relative_to(root)
    if initial_span(changelog, released.version) is None:
        raise ReleaseRefused(
            f"{where}: no '## {released.version} — unreleased' section: 'initial' releases the "
            "version in the tree once, before any other release of it (use patch/minor/major)"
        )
    try:
        return date_initial_changelog(changelog, released.version, day)
    except ValueError as error:
        raise ReleaseRefused(f"{where}: {error}") from error


def plan_release(root: pathlib.Path, package: str, kind: str, day: datetime.date) -> Plan:
    """Every file the release writes, or :class:`ReleaseRefused` naming the rule that fails."""
    packages = discover(root)
    _refuse_unless_ready(root, packages, package, kind)
    released = packages[package]
    version = released.version if kind == INITIAL else bump(released.version, kind)
    tag = f"{package}-v{version}"
    if tag_exists(root, tag):
        raise ReleaseRefused(f"tag {tag} already exists: a version is released once")
    changelog = released.changelog.read_text(encoding="utf-8")
    writes: dict[pathlib.Path, str] = {}
    if kind == INITIAL:
        writes[released.changelog] = _initial_changelog(root, released, changelog, day)
    elif not unreleased_body(changelog):
        raise ReleaseRefused(
            f"{released.changelog.relative_to(root)}: the '## Unreleased' section is "
            f"{'missing' if unreleased_body(changelog) is None else 'empty'}: a release "
            "publishes at least one recorded change"
        )
    else:
        old = released.version_file.read_text("utf-8")
        writes[released.version_file] = set_version(old, version)
        writes[released.changelog] = date_changelog(changelog, version, day)
    requirements = {name: p.requirements for name, p in packages.items()}
    updates = _follow_ranges(root, packages, package, version, writes, requirements)
    unpublished = unpublished_siblings(root, packages, requirements, package)
    versions = {name: p.version for name, p in packages.items()} | {package: version}
    constraints = root / CONSTRAINTS_DIR / f"{day.isoformat()}.txt"
    writes[constraints] = constraints_text(
        packages, versions, torch_pin(root), torch_ranges(packages), day, unpublished
    )
    return Plan(
        package=package,
        old_version=released.version,
        version=version,
        tag=tag,
        day=day,
        writes=writes,
        range_updates=tuple(updates),
        unpublished=tuple(unpublished),
    )


def apply(root: pathlib.Path, plan: Plan) -> None:
    """Write the plan's files, commit exactly them and tag the commit."""
    for path, text in plan.writes.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    paths = [path.relative_to(root).as_posix() for path in plan.writes]
    git(root, "add", "--", *paths)
    message = [f"Release {plan.package} {plan.version}", ""]
    message += [f"{u.dependant}: {u.old} -> {u.new}" for u in plan.range_updates]
    message += [f"Tested set: {CONSTRAINTS_DIR}/{plan.day.isoformat()}.txt"]
    git(root, "commit", "--quiet", "-m", "\n".join(message), "--", *paths)
    git(root, "tag", "-a", plan.tag, "-m", f"{plan.package} {plan.version}")


def release(
    root: pathlib.Path, package: str, kind: str, *, day: datetime.date | None = None
) -> Plan:
    """Plan the release (refusing before any change), then apply it."""
    plan = plan_release(root, package, kind, day or datetime.date.today())
    apply(root, plan)
    return plan


def describe(root: pathlib.Path, plan: Plan, *, applied: bool) -> list[str]:
    lines = [
        f"{plan.package}: {plan.old_version} -> {plan.version}"
        + (f" (committed, tag {plan.tag})" if applied else " (dry run: nothing written)")
    ]
    lines += [
        f"  {'wrote' if applied else 'would write'} {p.relative_to(root)}" for p in plan.writes
    ]
    for update in plan.range_updates:
        lines.append(f"  range followed: {update.dependant}: {update.old} -> {update.new}")
    if plan.dependants:
        lines.append(
            f"  these siblings need a release too (their {plan.package} range changed): "
            + ", ".join(plan.dependants)
        )
    if plan.unpublished:
        lines.append(
            "  pinned at versions not released as they stand (no tag, or ranges changed since): "
            + ", ".join(plan.unpublished)
        )
    if applied:
        lines.append(f"  nothing was pushed; publish with: git push origin HEAD {plan.tag}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("package", nargs="?", help="the distribution, e.g. gefen-core")
    parser.add_argument(
        "kind",
        nargs="?",
        choices=(*KINDS, INITIAL),
        help="which version part moves; 'initial' releases the version in the tree, unreleased",
    )
    parser.add_argument("--check", action="store_true", help="only run the consistency rules")
    parser.add_argument("--dry-run", action="store_true", help="show the release, write nothing")
    parser.add_argument(
        "--write-constraints",
        action="store_true",
        help="only record today's tested set (constraints/<date>.txt) for the tree as it is",
    )
    parser.add_argument("--root", type=pathlib.Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        findings = check(root)
        for line in findings:
            sys.stdout.write(line + "\n")
        sys.stdout.write(f"{len(findings)} release consistency findings\n")
        return 1 if findings else 0
    if args.write_constraints:
        path = write_constraints(root, datetime.date.today())
        sys.stdout.write(f"wrote {path.relative_to(root)}\n")
        return 0
    if args.package is None or args.kind is None:
        parser.error("give <package> <major|minor|patch|initial>, or --check")
    try:
        plan = plan_release(root, args.package, args.kind, datetime.date.today())
    except ReleaseRefused as refused:
        sys.stderr.write(f"release refused: {refused}\n")
        return 1
    if not args.dry_run:
        apply(root, plan)
    sys.stdout.write("\n".join(describe(root, plan, applied=not args.dry_run)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
