"""Release one Gefen distribution: bump, date the CHANGELOG, follow the ranges, record the set, tag.

``nox -s release -- <package> <major|minor|patch>`` runs ``python tools/release.py <package>
<kind>``. In one commit it

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
``python tools/release.py --check`` runs the consistency rules of :func:`check` (a CHANGELOG entry
for every current version, sibling ranges that admit the siblings' versions, the matrix's torch
inside every torch range, identical LICENSE/NOTICE copies, self-contained package READMEs) and
exits 1 on a finding. The procedure is written up in ``docs/releasing.md``.

Standard library only: the release session runs without a virtual environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("major", "minor", "patch")
LEGAL_FILES = ("LICENSE", "NOTICE")
CONSTRAINTS_DIR = "constraints"


class ReleaseRefused(Exception):
    """A release rule does not hold; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One string of a ``dependencies`` array, e.g. ``"gefen-core>=0.1,<0.2"``."""

    name: str  # normalized project name
    specifier: str  # ">=0.1,<0.2" (extras and markers dropped)
    text: str  # the string as written in pyproject.toml


@dataclasses.dataclass(frozen=True)
class Package:
    name: str
    folder: pathlib.Path
    pyproject: pathlib.Path
    version_file: pathlib.Path
    changelog: pathlib.Path
    version: str
    requirements: tuple[Requirement, ...]


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


# --- versions and specifiers (PEP 440 release segments only) -------------------------------------

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
_CLAUSE = re.compile(r"^(===|~=|==|!=|<=|>=|<|>)\s*([0-9][0-9.]*(?:\.\*)?)$")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.1.0"`` -> ``(0, 1, 0)``; releases here are always three numbers."""
    match = _VERSION.match(text)
    if match is None:
        raise ValueError(f"version {text!r} is not MAJOR.MINOR.PATCH")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def bump(version: str, kind: str) -> str:
    major, minor, patch = parse_version(version)
    if kind == "major":
        return f"{major + 1}.0.0"
    if kind == "minor":
        return f"{major}.{minor + 1}.0"
    if kind == "patch":
        return f"{major}.{minor}.{patch + 1}"
    raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _padded(left: tuple[int, ...], right: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    width = max(len(left), len(right))
    return tuple(side + (0,) * (width - len(side)) for side in (left, right))


def _clause_admits(operator: str, bound: str, version: str) -> bool:
    if operator == "===":
        return version == bound
    if bound.endswith(".*"):
        if operator not in ("==", "!="):
            raise ValueError(f"a wildcard needs == or !=, got {operator}{bound}")
        prefix = _release(bound[:-2])
        inside = _release(version)[: len(prefix)] == prefix
        return inside if operator == "==" else not inside
    have, want = _padded(_release(version), _release(bound))
    if operator == "~=":
        parts = _release(bound)
        if len(parts) < 2:
            raise ValueError(f"~= needs at least two components, got ~={bound}")
        return have >= want and _release(version)[: len(parts) - 1] == parts[:-1]
    results = {
        "==": have == want,
        "!=": have != want,
        ">=": have >= want,
        "<=": have <= want,
        ">": have > want,
        "<": have < want,
    }
    return results[operator]


def admits(specifier: str, version: str) -> bool:
    """Whether ``version`` (numbers only) satisfies every clause of ``specifier``."""
    for clause in filter(None, (part.strip() for part in specifier.split(","))):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"cannot read the specifier clause {clause!r}")
        if not _clause_admits(match.group(1), match.group(2), version):
            return False
    return True


_COMPATIBLE = re.compile(r"^>=\s*\d+(\.\d+)*\s*,\s*<\s*\d+(\.\d+)*$")


def is_compatible_range(specifier: str) -> bool:
    """The one range form the release rewrites: ``>=LOW,<HIGH``."""
    return _COMPATIBLE.match(specifier.strip()) is not None


def compatible_range(version: str) -> str:
    """The sibling range that admits ``version`` and its compatible successors.

    While a package is 0.x a minor release may break, so the range stops at the next minor
    (``0.2.0`` -> ``>=0.2,<0.3``); from 1.0 it stops at the next major (``1.3.0`` -> ``>=1.3,<2``).
    """
    major, minor, _ = parse_version(version)
    if major == 0:
        return f">=0.{minor},<0.{minor + 1}"
    return f">={major}.{minor},<{major + 1}"


# --- reading the repository ----------------------------------------------------------------------

_NAME = re.compile(r'^name\s*=\s*"([^"]+)"', re.MULTILINE)
_DEPENDENCIES = re.compile(r"^dependencies\s*=\s*\[(.*?)^\]", re.MULTILINE | re.DOTALL)
_VERSION_PATH = re.compile(r'^\[tool\.hatch\.version\]\s*\npath\s*=\s*"([^"]+)"', re.MULTILINE)
_VERSION_LINE = re.compile(r'^__version__\s*=\s*"([^"]*)"', re.MULTILINE)
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")
_TORCH_PIN = re.compile(r'^TORCH\s*=\s*"([^"]+)"', re.MULTILINE)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(text: str) -> Requirement:
    match = _REQUIREMENT.match(text)
    if match is None:
        raise ValueError(f"cannot read the requirement {text!r}")
    return Requirement(normalize(match.group(1)), match.group(2).strip(), text)


def _dependencies_block(text: str, where: pathlib.Path) -> re.Match[str]:
    match = _DEPENDENCIES.search(text)
    if match is None:
        raise ValueError(f"{where}: no [project] dependencies array")
    return match


def read_requirements(text: str, where: pathlib.Path) -> tuple[Requirement, ...]:
    block = _dependencies_block(text, where).group(1)
    return tuple(parse_requirement(raw) for raw in re.findall(r'"([^"]*)"', block))


def _read_package(folder: pathlib.Path) -> Package:
    pyproject = folder / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    name = _NAME.search(text)
    version_path = _VERSION_PATH.search(text)
    if name is None or version_path is None:
        raise ValueError(f"{pyproject}: needs [project] name and [tool.hatch.version] path")
    version_file = folder / version_path.group(1)
    version = _VERSION_LINE.search(version_file.read_text(encoding="utf-8"))
    if version is None:
        raise ValueError(f"{version_file}: no __version__ line")
    return Package(
        name=normalize(name.group(1)),
        folder=folder,
        pyproject=pyproject,
        version_file=version_file,
        changelog=folder / "CHANGELOG.md",
        version=version.group(1),
        requirements=read_requirements(text, pyproject),
    )


def discover(root: pathlib.Path) -> dict[str, Package]:
    """Every ``packages/*/pyproject.toml``, in dependency order (a package after its siblings)."""
    found: dict[str, Package] = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        package = _read_package(pyproject.parent)
        found[package.name] = package
    ordered: dict[str, Package] = {}
    while len(ordered) < len(found):
        ready = [
            name
            for name, package in sorted(found.items())
            if name not in ordered
            and all(r.name in ordered for r in package.requirements if r.name in found)
        ]
        if not ready:
            raise ValueError(f"sibling dependency cycle among {sorted(set(found) - set(ordered))}")
        ordered[ready[0]] = found[ready[0]]
    return ordered


def sibling_requirements(package: Package, packages: dict[str, Package]) -> list[Requirement]:
    return [r for r in package.requirements if r.name in packages]


def torch_pin(root: pathlib.Path) -> str:
    """The torch requirement the test matrix installs (``TORCH`` in ``noxfile.py``)."""
    match = _TORCH_PIN.search((root / "noxfile.py").read_text(encoding="utf-8"))
    if match is None:
        raise ValueError(f'{root / "noxfile.py"}: no TORCH = "..." line')
    return match.group(1)


def torch_ranges(packages: dict[str, Package]) -> list[str]:
    """The distinct torch specifiers the packages declare, in package order."""
    specs = [r.specifier for p in packages.values() for r in p.requirements if r.name == "torch"]
    return list(dict.fromkeys(specs))


# --- CHANGELOG -----------------------------------------------------------------------------------

_HEADING = re.compile(r"^## (.*)$", re.MULTILINE)


def changelog_headings(text: str) -> list[str]:
    return [match.group(1).strip() for match in _HEADING.finditer(text)]


def heading_version(heading: str) -> str:
    """``"0.1.1 — 2026-12-01"`` -> ``"0.1.1"``; ``"Unreleased"`` -> ``"Unreleased"``."""
    return heading.split()[0] if heading.split() else ""


def _unreleased_span(text: str) -> tuple[int, int] | None:
    """(start of the heading line, end of its body) of ``## Unreleased``, or None."""
    headings = list(_HEADING.finditer(text))
    for index, match in enumerate(headings):
        if match.group(1).strip().lower() == "unreleased":
            end = headings[index + 1].start() if index + 1 < len(headings) else len(text)
            return match.start(), end
    return None


def unreleased_body(text: str) -> str | None:
    span = _unreleased_span(text)
    if span is None:
        return None
    start, end = span
    return text[start:end].split("\n", 1)[1].strip() if "\n" in text[start:end] else ""


def date_changelog(text: str, version: str, day: datetime.date) -> str:
    """The ``## Unreleased`` body moves under ``## <version> — <day>``; Unreleased stays, empty."""
    span = _unreleased_span(text)
    body = unreleased_body(text)
    if span is None or not body:
        raise ValueError("no non-empty ## Unreleased section")
    start, end = span
    section = f"## Unreleased\n\n## {version} — {day.isoformat()}\n\n{body}\n"
    rest = text[end:]
    return text[:start] + section + ("\n" + rest if rest else "")


def bullet_lines(note: str) -> str:
    """``- note`` wrapped at 100 columns like the hand-written entries."""
    return textwrap.fill(
        note,
        width=100,
        initial_indent="- ",
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def add_unreleased_note(text: str, note: str) -> str:
    """``note`` becomes the first bullet of ``## Unreleased`` (created above the first version)."""
    bullet = bullet_lines(note)
    span = _unreleased_span(text)
    if span is None:
        first = _HEADING.search(text)
        at = first.start() if first is not None else len(text)
        prefix = text[:at] if text[:at].endswith("\n\n") or not text[:at] else text[:at] + "\n"
        return prefix + f"## Unreleased\n\n{bullet}\n\n" + text[at:]
    start, end = span
    body = unreleased_body(text) or ""
    section = f"## Unreleased\n\n{bullet}\n" + (f"\n{body}\n" if body else "")
    rest = text[end:]
    return text[:start] + section + ("\n" + rest if rest else "")


# --- the consistency rules -----------------------------------------------------------------------

_LINK_TARGETS = (
    re.compile(r"\]\(\s*<?([^)\s>]+)"),  # [text](target)
    re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?\s*$", re.MULTILINE),  # [label]: target
    re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']"""),  # <a href=...>, <img src=...>
)


def readme_links(text: str) -> list[str]:
    """Every link target in a Markdown README (inline, reference-style and HTML)."""
    return [match.group(1) for pattern in _LINK_TARGETS for match in pattern.finditer(text)]


def leaves_index_page(target: str) -> bool:
    """A link that does not work on a package index page: anything but an absolute URL."""
    return re.match(r"^(https?://|mailto:)", target) is None


def check(root: pathlib.Path) -> list[str]:
    """Findings that would make the released set inconsistent; ``[]`` when all rules hold."""
    findings: list[str] = []
    packages = discover(root)

    def rel(path: pathlib.Path) -> str:
        return path.relative_to(root).as_posix()

    for package in packages.values():
        try:
            parse_version(package.version)
        except ValueError as error:
            findings.append(f"{rel(package.version_file)}: {error}")
        # A current version needs its CHANGELOG entry: a "## <version>" heading, or (the initial
        # 0.1.0 only) an "## Unreleased" section collecting what 0.1.0 will hold.
        headings = changelog_headings(package.changelog.read_text(encoding="utf-8"))
        has_entry = package.version in {heading_version(h) for h in headings} or (
            package.version == "0.1.0" and any(h.lower() == "unreleased" for h in headings)
        )
        if not has_entry:
            findings.append(
                f"{rel(package.changelog)}: {package.name} is at {package.version} (in "
                f"{rel(package.version_file)}) but has no '## {package.version}' entry"
            )
        for requirement in sibling_requirements(package, packages):
            sibling = packages[requirement.name]
            try:
                ok = admits(requirement.specifier, sibling.version)
            except ValueError as error:
                findings.append(f"{rel(package.pyproject)}: {requirement.text!r}: {error}")
                continue
            if not ok:
                findings.append(
                    f"{rel(package.pyproject)}: {requirement.text!r} excludes {sibling.name} "
                    f"{sibling.version}, its current version"
                )
    pin = parse_requirement(torch_pin(root))
    exact = re.fullmatch(r"==\s*([0-9][0-9.]*)", pin.specifier)
    if exact is not None:
        for package in packages.values():
            for requirement in package.requirements:
                if requirement.name == "torch" and not admits(requirement.specifier, exact[1]):
                    findings.append(
                        f"{rel(package.pyproject)}: {requirement.text!r} excludes the matrix's "
                        f"{pin.text} (noxfile.py TORCH)"
                    )
    for legal in LEGAL_FILES:
        original = root / legal
        if not original.is_file():
            findings.append(f"{legal}: missing at the repository root")
            continue
        for package in packages.values():
            copy = package.folder / legal
            if not copy.is_file() or copy.read_bytes() != original.read_bytes():
                findings.append(f"{rel(copy)}: must be a byte-identical copy of /{legal}")
    for package in packages.values():
        readme = package.folder / "README.md"
        for target in readme_links(readme.read_text(encoding="utf-8")):
            if leaves_index_page(target):
                findings.append(
                    f"{rel(readme)}: link {target!r} does not work on an index page "
                    "(use an absolute https:// URL)"
                )
    return findings


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


def plan_release(root: pathlib.Path, package: str, kind: str, day: datetime.date) -> Plan:
    """Every file the release writes, or :class:`ReleaseRefused` naming the rule that fails."""
    packages = discover(root)
    if package not in packages:
        raise ReleaseRefused(
            f"unknown package {package!r}: a release names one of {', '.join(packages)}"
        )
    if kind not in KINDS:
        raise ReleaseRefused(f"unknown kind {kind!r}: a release is one of {', '.join(KINDS)}")
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

    released = packages[package]
    version = bump(released.version, kind)
    tag = f"{package}-v{version}"
    if tag_exists(root, tag):
        raise ReleaseRefused(f"tag {tag} already exists: a version is released once")
    changelog = released.changelog.read_text(encoding="utf-8")
    if not unreleased_body(changelog):
        raise ReleaseRefused(
            f"{released.changelog.relative_to(root)}: the '## Unreleased' section is "
            f"{'missing' if unreleased_body(changelog) is None else 'empty'}: a release "
            "publishes at least one recorded change"
        )

    version_text = released.version_file.read_text(encoding="utf-8")
    writes: dict[pathlib.Path, str] = {
        released.version_file: _VERSION_LINE.sub(f'__version__ = "{version}"', version_text, 1),
        released.changelog: date_changelog(changelog, version, day),
    }
    updates: list[RangeUpdate] = []
    requirements = {name: p.requirements for name, p in packages.items()}
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
            block = _dependencies_block(text, dependant.pyproject)
            edited = block.group(0).replace(f'"{requirement.text}"', f'"{new}"', 1)
            writes[dependant.pyproject] = text[: block.start()] + edited + text[block.end() :]
            requirements[dependant.name] = read_requirements(
                writes[dependant.pyproject], dependant.pyproject
            )
            note = (
                f"Requires `{new}` (was `{requirement.text}`): {package} {version} is out of the "
                "old range."
            )
            notes_text = writes.get(dependant.changelog) or dependant.changelog.read_text("utf-8")
            writes[dependant.changelog] = add_unreleased_note(notes_text, note)

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
    parser.add_argument("kind", nargs="?", choices=KINDS, help="which version part moves")
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
        parser.error("give <package> <major|minor|patch>, or --check")
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
