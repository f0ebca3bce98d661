"""Check that no library module reaches into another object's private names.

The rules (the structure of docs/architecture.md: "nobody reaches into another object's
underscore names"):

1. ``obj._name`` on anything but ``self``, ``cls`` or ``super()`` is refused when ``_name`` is
   defined somewhere in the project (a module-level name, a method or class attribute, or an
   attribute assigned through ``self``): if a sibling needs it, it is public API.
2. Torch's private names are read in one adapter only, ``gefen/dist/torch_internals.py``, and
   only those it lists in ``TORCH_INTERNALS``: any other ``obj._name`` that the project does not
   define, ``self._name`` for a listed torch name, or an import from a private torch module
   elsewhere is refused.
3. No module imports an underscore name from another project module, and no distribution
   imports another distribution's private module (``gefen.contracts._base`` is gefen-contracts'
   own business).
4. A sibling distribution imports from gefen-core only ``gefen.core`` (the user API) and
   ``gefen.core.extension`` (the extension API); testing helpers are not checked.

Usage::

    python tools/private_access.py            # every refused access, then the total
    python tools/private_access.py --check    # the same; exit status 1 when any is found

The ``lint`` nox session runs ``--check``; ``tests/test_private_access.py`` proves each rule
fires on a planted violation.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[1]
ADAPTER = pathlib.Path("packages/gefen-dist/src/gefen/dist/torch_internals.py")
CORE_API = frozenset({"gefen.core", "gefen.core.extension"})


def library_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    files = sorted(root.glob("packages/*/src/gefen/**/*.py"))
    return [path for path in files if path.name != "testing.py" and "/testing/" not in str(path)]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(trees: Iterable[ast.Module]) -> set[str]:
    """Every underscore name the project defines."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            name: str | None = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            if name is not None and _private(name):
                names.add(name)
    return names


def torch_internals(adapter: ast.Module) -> frozenset[str]:
    """The names the adapter's ``TORCH_INTERNALS`` tuple lists (string literals)."""
    listed: set[str] = set()
    for node in ast.walk(adapter):
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id in ("TORCH_INTERNALS", "HOOK_REGISTRIES")
            for target in node.targets
        ):
            for item in ast.walk(node.value):
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    listed.add(item.value)
    return frozenset(listed)


def _distribution(module: str) -> str:
    """``gefen.core.kernels.update`` → ``core``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _own_object(owner: ast.expr) -> bool:
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
        return True
    return isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super"


def violations(
    module: str,
    tree: ast.Module,
    project_names: set[str],
    allowed_torch: frozenset[str],
    *,
    is_adapter: bool,
) -> list[tuple[int, str]]:
    """(line, what) for every refused access in one module named ``module``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            own = _own_object(node.value)
            if node.attr in project_names and node.attr not in allowed_torch:
                if not own:
                    found.append((node.lineno, f"private project name .{node.attr}"))
            elif not (is_adapter and node.attr in allowed_torch) and (
                not own or node.attr in allowed_torch
            ):
                found.append((node.lineno, f"torch private .{node.attr} outside the adapter"))
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found += _import_violations(module, node, is_adapter=is_adapter)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if (
                    alias.name.startswith("torch.")
                    and any(_private(part) for part in alias.name.split("."))
                    and not is_adapter
                ):
                    found.append((node.lineno, f"import {alias.name} outside the adapter"))
                elif (
                    _distribution(alias.name) == "core"
                    and _distribution(module) != "core"
                    and alias.name not in CORE_API
                ):
                    found.append((node.lineno, f"import {alias.name}, not gefen-core's API"))
    return found


def _import_violations(
    module: str, node: ast.ImportFrom, *, is_adapter: bool
) -> list[tuple[int, str]]:
    source = node.module or ""
    parts = source.split(".")
    found: list[tuple[int, str]] = []
    if parts[0] == "torch":
        private_path = any(_private(part) for part in parts)
        private_name = any(_private(alias.name) for alias in node.names)
        if (private_path or private_name) and not is_adapter:
            found.append((node.lineno, f"import from {source} outside the adapter"))
    elif parts[0] == "gefen":
        sibling = _distribution(source) != _distribution(module)
        if any(_private(part) for part in parts) and sibling:
            found.append((node.lineno, f"import from another distribution's private {source}"))
        elif sibling and _distribution(source) == "core" and source not in CORE_API:
            found.append((node.lineno, f"import from {source}, not gefen-core's API"))
        for alias in node.names:
            if _private(alias.name):
                found.append((node.lineno, f"import of private {source}.{alias.name}"))
    return found


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    relative = path.relative_to(root)
    parts = relative.parts[relative.parts.index("src") + 1 :]
    dotted = ".".join(parts).removesuffix(".py")
    return dotted.removesuffix(".__init__")


def check_tree(root: pathlib.Path = ROOT) -> list[str]:
    """Every refused access under ``root`` as ``path:line: what``."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in library_files(root)}
    project_names = defined_names(trees.values())
    adapter_path = root / ADAPTER
    allowed = torch_internals(trees[adapter_path]) if adapter_path in trees else frozenset()
    report: list[str] = []
    for path, tree in trees.items():
        found = violations(
            module_name(path, root),
            tree,
            project_names,
            allowed,
            is_adapter=path == adapter_path,
        )
        relative = path.relative_to(root)
        report += [f"{relative}:{line}: {what}" for line, what in sorted(found)]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when anything is found")
    args = parser.parse_args(argv)
    report = check_tree()
    for line in report:
        sys.stdout.write(line + "\n")
    sys.stdout.write(f"{len(report)} refused private accesses\n")
    return 1 if args.check and report else 0


if __name__ == "__main__":
    raise SystemExit(main())
