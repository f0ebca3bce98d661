"""Report where library code uses an underscore name that another module or class of the project
defines (the structure issue's rule: no module reaches into another's private names).

An access counts when it reads ``obj._name`` on anything but ``self``/``cls`` and ``_name`` is
defined somewhere in the project (a module-level name, a method or class attribute, or an
attribute assigned through ``self``), or when a module imports an underscore name from another
project module. Torch's own private names are not counted (``TORCH_NAMES`` lists those that
clash with a name the project defines too). Usage::

    python tools/private_access.py            # a summary per file, then the total
    python tools/private_access.py --list     # every access with its line
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_NAMES = frozenset({"_version"})  # Tensor._version: torch's in-place version counter


def library_files() -> list[pathlib.Path]:
    files = sorted(ROOT.glob("packages/*/src/gefen/**/*.py"))
    return [path for path in files if path.name != "testing.py" and "/testing/" not in str(path)]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(trees: dict[pathlib.Path, ast.Module]) -> set[str]:
    """Every underscore name the project defines."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _private(node.name):
                    names.add(node.name)
            elif (
                isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id)
            ):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and _private(node.attr)
            ):
                names.add(node.attr)
    return names


def accesses(path: pathlib.Path, tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr in names
            and node.attr not in TORCH_NAMES
        ):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gefen"):
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"import {node.module}.{alias.name}"))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="every access with its line")
    args = parser.parse_args(argv)
    trees = {path: ast.parse(path.read_text(), str(path)) for path in library_files()}
    names = defined_names(trees)
    total = 0
    per_file: Counter[str] = Counter()
    for path, tree in trees.items():
        relative = str(path.relative_to(ROOT))
        for line, what in accesses(path, tree, names):
            total += 1
            per_file[relative] += 1
            if args.list:
                sys.stdout.write(f"{relative}:{line}: {what}\n")
    for relative, count in per_file.most_common():
        sys.stdout.write(f"{count:5d}  {relative}\n")
    sys.stdout.write(f"{total} cross-object private accesses in {len(per_file)} files\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
