"""The private-access rule of docs/architecture.md holds for the library, and each of its rules
fires on a planted violation (so a clean report means something)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys
import textwrap
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool(name: str = "private_access") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / f"tools/{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


TOOL = _tool()
CYCLES = _tool("import_cycles")
TORCH = frozenset({"_optimizer_step_pre_hooks", "_version"})


def _found(source: str, *, module: str = "gefen.core.x", adapter: bool = False) -> list[str]:
    tree = ast.parse(textwrap.dedent(source))
    project = TOOL.defined_names([tree]) | {"_stage", "_latched"}
    return [what for _, what in TOOL.violations(module, tree, project, TORCH, is_adapter=adapter)]


def test_the_library_has_no_refused_private_access() -> None:
    assert TOOL.check_tree() == []


def test_a_project_private_on_another_object_is_refused() -> None:
    assert _found("def f(opt):\n    return opt._stage()\n") == ["private project name ._stage"]


def test_own_privates_through_self_cls_and_super_are_allowed() -> None:
    source = """
    class A:
        def _stage(self):
            return self._latched

        @classmethod
        def make(cls):
            return cls._stage

        def again(self):
            return super()._stage()
    """
    assert _found(source) == []


def test_torch_privates_live_in_the_adapter_only() -> None:
    hooks = "def f(opt):\n    return opt._optimizer_step_pre_hooks\n"
    assert _found(hooks) == ["torch private ._optimizer_step_pre_hooks outside the adapter"]
    assert _found(hooks, adapter=True) == []
    # Through self too: the hook registries are torch's, whoever holds them.
    own = "class A:\n    def f(self):\n        return self._optimizer_step_pre_hooks\n"
    assert _found(own) == ["torch private ._optimizer_step_pre_hooks outside the adapter"]
    # A torch private the adapter does not list is refused even there.
    unlisted = "def f(t):\n    return t._base\n"
    assert _found(unlisted, adapter=True) == ["torch private ._base outside the adapter"]


def test_private_torch_imports_live_in_the_adapter_only() -> None:
    assert _found("from torch._dynamo.utils import counters\n") == [
        "import from torch._dynamo.utils outside the adapter"
    ]
    assert _found("import torch._dynamo\n") == ["import torch._dynamo outside the adapter"]
    assert _found("from torch._dynamo.utils import counters\n", adapter=True) == []


def test_private_project_imports_are_refused() -> None:
    assert _found("from gefen.core.shell import _LATCHED\n") == [
        "import of private gefen.core.shell._LATCHED"
    ]
    # A distribution's private module is its own business, never a sibling's.
    other = "from gefen.contracts._base import ContractValue\n"
    assert _found(other, module="gefen.core.x") == [
        "import from another distribution's private gefen.contracts._base"
    ]
    assert _found(other, module="gefen.contracts.enums") == []


def test_the_adapter_lists_what_it_reads() -> None:
    adapter = ast.parse((ROOT / TOOL.ADAPTER).read_text())
    listed = TOOL.torch_internals(adapter)
    assert {"_optimizer_step_pre_hooks", "_global_optimizer_pre_hooks", "_version"} <= listed


def test_siblings_import_gefen_core_through_its_api_only() -> None:
    inside = "from gefen.core.shell import OptimizerShell\n"
    assert _found(inside, module="gefen.muon.optimizer") == [
        "import from gefen.core.shell, not gefen-core's API"
    ]
    assert _found(inside, module="gefen.core.optimizer") == []
    assert _found("import gefen.core.fused\n", module="gefen.muon.optimizer") == [
        "import gefen.core.fused, not gefen-core's API"
    ]
    for allowed in (
        "from gefen.core import Gefen\n",
        "from gefen.core.extension import run_step\n",
    ):
        assert _found(allowed, module="gefen.hybrid.optimizer") == []


def test_the_library_has_no_import_cycle_type_only_ones_included() -> None:
    assert CYCLES.cycles(CYCLES.import_graph(CYCLES.module_sources())) == []


def test_a_type_only_cycle_is_found() -> None:
    sources = {
        "gefen.core.shell": "from gefen.core.checkpoint import build\n",
        "gefen.core.checkpoint": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from gefen.core.shell import OptimizerShell\n"
        ),
        "gefen.core.state": "import gefen.core.shell\n",
    }
    graph = CYCLES.import_graph(sources)
    assert graph["gefen.core.state"] == {"gefen.core.shell"}
    assert CYCLES.cycles(graph) == [["gefen.core.checkpoint", "gefen.core.shell"]]
