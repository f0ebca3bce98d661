"""The extension API (``gefen.core.extension``) is a deliberate, documented list.

Sibling packages import gefen-core only through ``gefen.core`` and this module (the repository's
lint check enforces it); these tests lock the list, check each name is the object its defining
module holds, documented, and that the fused-momentum entry points look their implementation up
at call time (so a patch of ``gefen.core.fused`` reaches GefenMuon).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from gefen.core import extension, fused

EXPECTED = {
    "CODEBOOK_CODECS": "gefen.core.options",
    "VARIANT_PREFIX": "gefen.core.options",
    "check_group_codec": "gefen.core.options",
    "codes_per_byte": "gefen.core.options",
    "variant_prefix": "gefen.core.options",
    "STEP_SIGNATURE": "gefen.core.transaction",
    "TEMPLATE_FORMAT": "gefen.core.template",
    "CodebookInput": "gefen.core.learning",
    "CodecKeys": "gefen.core.state",
    "EntrySpec": "gefen.core.state",
    "HookedStepState": "gefen.core.transaction",
    "MomentumAdvancer": "gefen.core.updaters",
    "OptimizerShell": "gefen.core.shell",
    "PendingEntry": "gefen.core.deferred",
    "PreparedFinalization": "gefen.core.finalization",
    "PreparedLoad": "gefen.core.checkpoint",
    "ShellInterface": "gefen.core.participant",
    "StagedLearning": "gefen.core.learning",
    "absorb_entry": "gefen.core.template",
    "allocate_entry": "gefen.core.state",
    "amp_scaling_supported": "gefen.core.validation",
    "api_flags": "gefen.core.contract",
    "check_finite_gradients": "gefen.core.validation",
    "check_flag": "gefen.core.options",
    "check_lr": "gefen.core.options",
    "check_optimizer_wide": "gefen.core.options",
    "check_torch_flags": "gefen.core.options",
    "checkpoint_scope": "gefen.core.contract",
    "copy_containers": "gefen.core.transaction",
    "eager_advance_momentum_": "gefen.core.updaters",
    "every_rank_has_rows": "gefen.core.resharding",
    "extras_field": "gefen.core.contract",
    "first_logical_element": "gefen.core.resharding",
    "finalized_training": "gefen.core.contract",
    "flattened_dcp_hint": "gefen.core.template",
    "fused_momentum": "gefen.core.extension",
    "group_codecs": "gefen.core.options",
    "group_uses_codebook": "gefen.core.options",
    "installed_layouts": "gefen.core.contract",
    "is_dtensor": "gefen.core.validation",
    "is_initialized": "gefen.core.state",
    "iter_parameters": "gefen.core.validation",
    "local_rows": "gefen.core.resharding",
    "local_tensor": "gefen.core.validation",
    "lr_value": "gefen.core.options",
    "real_value": "gefen.core.options",
    "parameter_field": "gefen.core.contract",
    "parameter_label": "gefen.core.validation",
    "resolve_default": "gefen.core.extension",
    "run_load": "gefen.core.transaction",
    "run_step": "gefen.core.transaction",
    "select_period": "gefen.core.kernels",
    "row_period": "gefen.core.kernels",
    "row_sharded_mesh": "gefen.core.resharding",
    "stage_entries": "gefen.core.loading",
    "stage_entry": "gefen.core.loading",
    "torch_indices": "gefen.core.saving",
    "validate_gradient_structure": "gefen.core.validation",
}


def test_the_list_is_exactly_the_declared_one() -> None:
    assert sorted(extension.__all__) == sorted(EXPECTED)


def test_the_readme_table_lists_exactly_the_declared_names() -> None:
    # The table had fallen behind: checkpoint_scope and installed_layouts were exported unlisted.
    import pathlib
    import re

    readme = pathlib.Path(__file__).parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    table = text[text.index("| group | names |") :].split("\n\n", 1)[0]
    listed = {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row)}
    assert listed == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_name_is_its_defining_modules_object_and_documented(name: str) -> None:
    value = getattr(extension, name)
    home = importlib.import_module(EXPECTED[name])
    assert getattr(home, name) is value
    if inspect.isclass(value) or inspect.isfunction(value):
        assert inspect.getdoc(value), f"{name} has no docstring"


def test_the_fused_entry_points_follow_a_patch_of_gefen_core_fused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[object] = []

    def momentum(device_type: str, codebook_size: int = 256) -> str:
        seen.append((device_type, codebook_size))
        return "patched"

    monkeypatch.setattr(fused, "fused_momentum", momentum)
    monkeypatch.setattr(fused, "resolve_default", lambda value: ("resolved", value))
    assert extension.fused_momentum("cpu") == "patched"
    assert extension.fused_momentum("cpu", 16) == "patched"
    assert extension.resolve_default(None) == ("resolved", None)
    assert seen == [("cpu", 256), ("cpu", 16)]


def test_the_extension_api_is_enough_for_gefen_muon() -> None:
    # GefenMuon is built from the shell through this module only (the lint check proves it
    # imports nothing else of gefen-core); here: it is an OptimizerShell and steps.
    torch = pytest.importorskip("torch")
    muon = pytest.importorskip("gefen.muon")
    param = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = muon.GefenMuon([param], lr=0.02)
    assert isinstance(optimizer, extension.OptimizerShell)
    before = param.detach().clone()
    param.grad = torch.randn(8, 4)
    optimizer.step()
    assert not torch.equal(before, param.detach())
