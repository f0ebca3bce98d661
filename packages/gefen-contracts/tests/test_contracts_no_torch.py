"""gefen.contracts depends on the standard library only (spec 40 §1, §11 "No torch").

Proof (a) is the nox session that installs this package without torch; (b) and (c) are here.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import gefen.contracts

PACKAGE_DIR = pathlib.Path(gefen.contracts.__file__).parent
EXPECTED_MODULES = {
    "__init__.py",
    "_base.py",
    "_check.py",
    "_version.py",
    "capabilities.py",
    "conformance.py",
    "enums.py",
    "errors.py",
    "identity.py",
    "manifest.py",
    "primitive.py",
    "shards.py",
    "state.py",
}

_PROBE = """
import json, sys
before = set(sys.modules)
import gefen.contracts, gefen.contracts.conformance
new = sorted(set(sys.modules) - before)
print(json.dumps({"new": new, "torch_loaded": "torch" in sys.modules}))
"""


@pytest.fixture(scope="module")
def probe() -> dict[str, object]:
    """What a fresh interpreter holds after importing gefen.contracts and its conformance module."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    report: dict[str, object] = json.loads(result.stdout)
    return report


@pytest.fixture
def new_modules(probe: dict[str, object]) -> list[str]:
    modules = probe["new"]
    assert isinstance(modules, list)
    return modules


def test_import_leaves_torch_out_of_sys_modules(
    probe: dict[str, object], new_modules: list[str]
) -> None:
    assert probe["torch_loaded"] is False
    assert "gefen.contracts.conformance" in new_modules
    assert "torch" not in new_modules
    assert not [name for name in new_modules if name.split(".")[0] in {"torch", "numpy"}]


def test_import_pulls_in_only_stdlib_and_gefen_contracts(new_modules: list[str]) -> None:
    for name in new_modules:
        top = name.split(".")[0]
        inside = name == "gefen" or name.startswith("gefen.contracts")
        assert inside or top in sys.stdlib_module_names, name


def _violations(source: str) -> list[str]:
    """Every import target (or dynamic import call) that is not stdlib or gefen.contracts."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                continue  # relative: inside the package by construction
            targets = [node.module or ""]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in {"__import__", "import_module"}:
                found.append(f"dynamic import at line {node.lineno}")
        for target in targets:
            allowed = (
                target == "__future__"
                or target.split(".")[0] in sys.stdlib_module_names
                or target == "gefen.contracts"
                or target.startswith("gefen.contracts.")
            )
            if not allowed:
                found.append(target)
    return found


def test_ast_scan_finds_only_stdlib_imports() -> None:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert {path.name for path in files} >= EXPECTED_MODULES
    imported = 0
    for path in files:
        source = path.read_text(encoding="utf-8")
        assert _violations(source) == [], path
        imported += source.count("import ")
    assert imported > len(files)  # the scan really saw import statements


def test_ast_scan_rejects_third_party_and_lazy_imports() -> None:
    assert _violations("import torch") == ["torch"]
    assert _violations("from numpy import ndarray") == ["numpy"]
    assert _violations("import typing_extensions") == ["typing_extensions"]
    assert _violations("def f():\n    import torch.nn\n") == ["torch.nn"]
    assert _violations("from gefen.core import Gefen") == ["gefen.core"]
    assert len(_violations("import importlib\nimportlib.import_module('torch')")) == 1
    assert _violations("from __future__ import annotations\nimport json") == []
