"""The release rules: read the repository and say whether it holds a consistent set. Read-only.

Versions (``MAJOR.MINOR.PATCH``) and how a release bumps them, which versions a specifier admits
(PEP 440 release segments only), the packages as their ``pyproject.toml`` and ``_version.py``
describe them, the CHANGELOG's sections and the text edits a release makes to them, the links a
package README may hold, and :func:`check`, the consistency rules behind ``python tools/release.py
--check``. Nothing here writes a file or runs git: ``tools/release.py`` is the release command
built on these rules (docs/releasing.md).

Standard library only: the release session runs without a virtual environment.
"""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
import re
import textwrap

KINDS = ("major", "minor", "patch")
LEGAL_FILES = ("LICENSE", "NOTICE")


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


def replace_requirement(text: str, where: pathlib.Path, old: str, new: str) -> str:
    """A ``pyproject.toml`` text with the requirement string ``old`` of its ``dependencies``
    array replaced by ``new``."""
    block = _dependencies_block(text, where)
    edited = block.group(0).replace(f'"{old}"', f'"{new}"', 1)
    return text[: block.start()] + edited + text[block.end() :]


def set_version(text: str, version: str) -> str:
    """A version file's text with its ``__version__`` line set to ``version``."""
    return _VERSION_LINE.sub(f'__version__ = "{version}"', text, 1)


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


def initial_span(text: str, version: str) -> tuple[int, int] | None:
    """(start of the heading line, end of its body) of ``## <version> — unreleased``: a first
    version written down before it was ever released; None when there is none."""
    headings = list(_HEADING.finditer(text))
    for index, match in enumerate(headings):
        words = match.group(1).split()
        if len(words) > 1 and words[0] == version and words[-1].lower() == "unreleased":
            end = headings[index + 1].start() if index + 1 < len(headings) else len(text)
            return match.start(), end
    return None


def date_initial_changelog(text: str, version: str, day: datetime.date) -> str:
    """The first release of the version in the tree: the ``## Unreleased`` body, then the body
    of ``## <version> — unreleased``, move under ``## <version> — <day>``; Unreleased stays,
    empty. The two sections must be adjacent (Unreleased first) or Unreleased absent."""
    span = initial_span(text, version)
    if span is None:
        raise ValueError(f"no '## {version} — unreleased' section")
    start, end = span
    own = text[start:end].split("\n", 1)[1].strip() if "\n" in text[start:end] else ""
    pending = _unreleased_span(text)
    if pending is not None:
        if pending[1] != start:
            raise ValueError(f"'## Unreleased' must directly precede '## {version} — unreleased'")
        start = pending[0]
    body = "\n\n".join(part for part in (unreleased_body(text) or "", own) if part)
    if not body:
        raise ValueError(f"nothing recorded for {version}")
    section = f"## Unreleased\n\n## {version} — {day.isoformat()}\n\n{body}\n"
    rest = text[end:]
    return text[:start] + section + ("\n" + rest if rest else "")


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


def _rel(root: pathlib.Path, path: pathlib.Path) -> str:
    return path.relative_to(root).as_posix()


def _version_findings(root: pathlib.Path, package: Package) -> list[str]:
    """A version that is not ``MAJOR.MINOR.PATCH``, or one without its CHANGELOG entry."""
    findings: list[str] = []
    try:
        parse_version(package.version)
    except ValueError as error:
        findings.append(f"{_rel(root, package.version_file)}: {error}")
    # A current version needs its CHANGELOG entry: a "## <version>" heading, or (the initial
    # 0.1.0 only) an "## Unreleased" section collecting what 0.1.0 will hold.
    headings = changelog_headings(package.changelog.read_text(encoding="utf-8"))
    has_entry = package.version in {heading_version(h) for h in headings} or (
        package.version == "0.1.0" and any(h.lower() == "unreleased" for h in headings)
    )
    if not has_entry:
        findings.append(
            f"{_rel(root, package.changelog)}: {package.name} is at {package.version} (in "
            f"{_rel(root, package.version_file)}) but has no '## {package.version}' entry"
        )
    return findings


def _range_findings(
    root: pathlib.Path, package: Package, packages: dict[str, Package]
) -> list[str]:
    """Sibling ranges of ``package`` that cannot be read or exclude the sibling's version."""
    findings: list[str] = []
    for requirement in sibling_requirements(package, packages):
        sibling = packages[requirement.name]
        try:
            ok = admits(requirement.specifier, sibling.version)
        except ValueError as error:
            findings.append(f"{_rel(root, package.pyproject)}: {requirement.text!r}: {error}")
            continue
        if not ok:
            findings.append(
                f"{_rel(root, package.pyproject)}: {requirement.text!r} excludes {sibling.name} "
                f"{sibling.version}, its current version"
            )
    return findings


def _torch_findings(root: pathlib.Path, packages: dict[str, Package]) -> list[str]:
    """Torch ranges that exclude the matrix's exact torch pin (``TORCH`` in ``noxfile.py``)."""
    findings: list[str] = []
    pin = parse_requirement(torch_pin(root))
    exact = re.fullmatch(r"==\s*([0-9][0-9.]*)", pin.specifier)
    if exact is None:
        return findings
    for package in packages.values():
        for requirement in package.requirements:
            if requirement.name == "torch" and not admits(requirement.specifier, exact[1]):
                findings.append(
                    f"{_rel(root, package.pyproject)}: {requirement.text!r} excludes the "
                    f"matrix's {pin.text} (noxfile.py TORCH)"
                )
    return findings


def _legal_findings(root: pathlib.Path, packages: dict[str, Package]) -> list[str]:
    """A missing root LICENSE/NOTICE, or a package copy that differs from it."""
    findings: list[str] = []
    for legal in LEGAL_FILES:
        original = root / legal
        if not original.is_file():
            findings.append(f"{legal}: missing at the repository root")
            continue
        for package in packages.values():
            copy = package.folder / legal
            if not copy.is_file() or copy.read_bytes() != original.read_bytes():
                findings.append(f"{_rel(root, copy)}: must be a byte-identical copy of /{legal}")
    return findings


def _readme_findings(root: pathlib.Path, packages: dict[str, Package]) -> list[str]:
    """README links that would break on the package's index page."""
    findings: list[str] = []
    for package in packages.values():
        readme = package.folder / "README.md"
        for target in readme_links(readme.read_text(encoding="utf-8")):
            if leaves_index_page(target):
                findings.append(
                    f"{_rel(root, readme)}: link {target!r} does not work on an index page "
                    "(use an absolute https:// URL)"
                )
    return findings


def check(root: pathlib.Path) -> list[str]:
    """Findings that would make the released set inconsistent; ``[]`` when all rules hold."""
    findings: list[str] = []
    packages = discover(root)
    for package in packages.values():
        findings += _version_findings(root, package)
        findings += _range_findings(root, package, packages)
    findings += _torch_findings(root, packages)
    findings += _legal_findings(root, packages)
    findings += _readme_findings(root, packages)
    return findings
