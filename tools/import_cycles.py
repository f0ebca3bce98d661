"""Check that the library's modules import each other without a cycle, type-only imports
included (docs/architecture.md: helper modules type against protocols, never against the
class that imports them).

Every ``import``/``from … import`` of a project module counts, wherever it sits (top level,
inside a function, under ``if TYPE_CHECKING:``). Usage::

    python tools/import_cycles.py            # the cycles found, one per line
    python tools/import_cycles.py --check    # the same; exit status 1 when there is one

The ``lint`` nox session runs ``--check``; ``tests/test_private_access.py`` plants a cycle.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections.abc import Mapping

ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_sources(root: pathlib.Path = ROOT) -> dict[str, str]:
    """Dotted module name → source, for every library module (testing helpers included)."""
    sources: dict[str, str] = {}
    for path in sorted(root.glob("packages/*/src/gefen/**/*.py")):
        parts = path.parts[path.parts.index("src") + 1 :]
        name = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        sources[name] = path.read_text()
    return sources


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Module → the project modules it imports (a ``from pkg import name`` of a submodule
    counts as that submodule, otherwise as ``pkg`` itself)."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target in sources:
                        graph[name].add(target)
                    elif node.module in sources:
                        graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in sources)
        graph[name].discard(name)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a cycle is found")
    args = parser.parse_args(argv)
    found = cycles(import_graph(module_sources()))
    for component in found:
        sys.stdout.write(" <-> ".join(component) + "\n")
    sys.stdout.write(f"{len(found)} import cycles\n")
    return 1 if args.check and found else 0


if __name__ == "__main__":
    raise SystemExit(main())
