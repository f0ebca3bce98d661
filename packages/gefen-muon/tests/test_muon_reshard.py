"""GefenMuon under FSDP2: ``dcp.save`` at one world size, ``dcp.load`` into a freshly built
optimizer at another (docs/muon.md §8), on Gloo with real ``fully_shard``, in every sharded
mode: ``"exact"`` (every rank holds each full momentum), ``"distributed"`` (each owner's,
consolidated by ``state_dict()``) and ``"approx"`` (each rank's rows, saved as row-sharded
DTensors, docs/core.md §9.1). Saved at world 2 and resumed at 1, 2, 3 and 4; saved
at 4 and resumed at 2. After the load the state, gathered, equals the saved state bit for bit and
training continues on every rank; at the same world size the continuation is bit-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gefen.core.testing import gathered_optimizer_state, nested_equal
from gefen.dist.testing import gloo_required, run_scenarios
from gefen.muon import testing as mt

pytestmark = [pytest.mark.multirank, gloo_required()]

SHAPES = [(8, 12), (12, 16), (16, 8)]
MODES = ("exact", "distributed", "approx")
# (3, 16) at world 4 splits 1, 1, 1, 0: rank 3 holds no row of it.
NARROW = [(8, 12), (3, 16), (16, 8)]
NARROW_MODES = ("distributed_narrow", "approx_narrow")
# "_idle": a (9, 8) matrix that never gets a gradient (its entry stays pristine).
IDLE = [*SHAPES, (9, 8)]


def _shapes(mode: str) -> list[tuple[int, int]]:
    if mode.endswith("_idle"):
        return IDLE
    return NARROW if mode.endswith("_narrow") else SHAPES


def _mesh(world: int, mode: str) -> Any:
    """One mesh of ``world``, or for an ``_hsdp`` mode HSDP's (2, world / 2): replicated over
    the first dimension, row-sharded over the second."""
    from torch.distributed.device_mesh import init_device_mesh

    if not mode.endswith("_hsdp"):
        return mt.mesh_1d(world)
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def _build(world: int, mode: str) -> tuple[Any, Any]:
    """``mode``'s suffix: ``_narrow``/``_idle`` shapes, ``_hsdp`` mesh, ``_groups`` a group per
    matrix."""
    model = mt.sharded(_mesh(world, mode), mt.fulls(_shapes(mode), 0))
    sharded_mode = mode.split("_")[0]
    if not mode.endswith("_groups"):
        return model, mt.sharded_muon(model, sharded_mode=sharded_mode)
    from gefen.muon import GefenMuon

    groups = [{"params": [param]} for param in model.parameters()]  # each owned by one rank
    return model, GefenMuon(groups, **{**mt.SCENARIO_OPTIONS, "sharded_mode": sharded_mode})


def _train(model: Any, optimizer: Any, steps: range, mode: str = "") -> None:
    shapes = [tuple(param.shape) for param in model.parameters()]
    idle = (len(shapes) - 1,) if mode.endswith("_idle") else ()
    for step in steps:
        mt.assign_sharded(model, mt.grads(shapes, 7, step), skip=idle)
        optimizer.step()


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def scenario_save(rank: int, world_size: int, folder: str, mode: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model, optimizer = _build(world_size, mode)
    _train(model, optimizer, range(3), mode)
    expected = gathered_optimizer_state(model, optimizer)
    dcp.save(_state(model, optimizer), checkpoint_id=str(Path(folder) / mode))
    _train(model, optimizer, range(3, 5), mode)
    continued = mt.full_params(model)
    if rank == 0:
        torch.save({"expected": expected, "continued": continued}, Path(folder) / f"{mode}.pt")
    return {"step": optimizer.global_step, "row_sharded": optimizer.row_sharded()}


def scenario_resume(
    rank: int, world_size: int, folder: str, mode: str, saved_world: int, built: str = ""
) -> dict[str, Any]:
    """Resume the file of ``mode`` into an optimizer built as ``built`` (default: ``mode``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = _build(world_size, built or mode)
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(Path(folder) / mode))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    saved = torch.load(Path(folder) / f"{mode}.pt", weights_only=True)
    gathered = gathered_optimizer_state(model, optimizer)
    step = optimizer.global_step
    _train(model, optimizer, range(3, 5), mode)
    after = mt.full_params(model)
    return {
        "state_equal": nested_equal(gathered["state"], saved["expected"]["state"]),
        "step": step,
        "trained": optimizer.global_step == step + 2
        and all(bool(p.isfinite().all()) for p in after),
        "bitwise": mt.bits_equal(after, saved["continued"]),
    }


def _resumes(
    folder: Path, saved_world: int, worlds: tuple[int, ...], modes: tuple[str, ...] = MODES
) -> dict[Any, Any]:
    outcomes: dict[Any, Any] = {}
    saves = [(mode, scenario_save, (str(folder), mode)) for mode in modes]
    outcomes["save"] = run_scenarios(saves, saved_world, rank_deadline_s=300.0)
    for world in worlds:
        resumes = [(mode, scenario_resume, (str(folder), mode, saved_world)) for mode in modes]
        outcomes[world] = run_scenarios(resumes, world, rank_deadline_s=300.0)
    return outcomes


def _resumed(result: dict[str, Any]) -> bool:
    """The gathered state equals the saved one, at step 3, and training went on."""
    return bool(result["state_equal"] and result["step"] == 3 and result["trained"])


@pytest.fixture(scope="module")
def from_two(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return _resumes(tmp_path_factory.mktemp("muon2"), 2, (1, 2, 3, 4))


@pytest.fixture(scope="module")
def from_four(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return _resumes(tmp_path_factory.mktemp("muon4"), 4, (2,))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_world_two_checkpoint_resumes_at(world: int, mode: str, from_two: Any) -> None:
    assert all(result["step"] == 5 for result in from_two["save"][mode])
    for result in from_two[world][mode]:
        assert _resumed(result), result
        if world == 2:
            assert result["bitwise"]


@pytest.mark.parametrize("mode", MODES)
def test_a_world_four_checkpoint_resumes_at_two(mode: str, from_four: Any) -> None:
    for result in from_four[2][mode]:
        assert _resumed(result), result


@pytest.fixture(scope="module")
def idle_from_two(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return _resumes(tmp_path_factory.mktemp("muon_idle2"), 2, (2, 3), ("distributed_idle",))


@pytest.mark.parametrize("world", [2, 3])
def test_a_distributed_file_with_a_never_stepped_matrix_resumes_at(
    world: int, idle_from_two: Any
) -> None:
    """DCP keeps no top-level extras, so the file has no consolidation manifest; a pristine
    entry of a format-2 file was refused as "consolidation marker is missing"."""
    for result in idle_from_two[world]["distributed_idle"]:
        assert _resumed(result), result
        if world == 2:
            assert result["bitwise"]


@pytest.fixture(scope="module")
def narrow_from_four(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return _resumes(tmp_path_factory.mktemp("muon_narrow4"), 4, (2, 3, 4), NARROW_MODES)


def test_a_distributed_file_of_a_group_per_matrix_resumes(tmp_path: Path) -> None:
    # The extras' initialized flags were read from each rank's live state, which holds only the
    # matrices it owns: the ranks' copies differed, DCP kept some of each rank's, and the load
    # refused its own file ("extras copies differ between the top level and the groups").
    outcomes = _resumes(tmp_path, 2, (2,), modes=("distributed_groups",))
    for result in outcomes[2]["distributed_groups"]:
        assert _resumed(result), result
        assert result["bitwise"]


@pytest.mark.parametrize("mode", NARROW_MODES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_rank_without_rows_still_reshards_from_four_to(
    world: int, mode: str, narrow_from_four: Any
) -> None:
    """Rank 3 of 4 holds no row of a (3, 16) matrix: approx stays row-sharded (that rank
    learns the matrix's counters at save) and distributed saves that matrix whole."""
    assert [r["row_sharded"] for r in narrow_from_four["save"]["approx_narrow"]] == [True] * 4
    for result in narrow_from_four[world][mode]:
        assert _resumed(result), result
        if world == 4:
            assert result["bitwise"]


def test_an_approx_hsdp_checkpoint_resumes_under_fsdp_and_hsdp(tmp_path: Path) -> None:
    """approx under HSDP, a (2, 2) mesh: row-sharded over its second dimension, so DCP moves the
    file to FSDP at world 2 and back to HSDP at 4. Both split the rows in two, so approx (each
    rank orthogonalizes its rows) continues bit for bit in both."""
    folder, mode = str(tmp_path), "approx_hsdp"
    saved = run_scenarios([(mode, scenario_save, (folder, mode))], 4, rank_deadline_s=300.0)
    assert [result["row_sharded"] for result in saved[mode]] == [True] * 4
    for world, built in ((2, "approx"), (4, mode)):
        resumed = run_scenarios(
            [(mode, scenario_resume, (folder, mode, 4, built))], world, rank_deadline_s=300.0
        )
        for result in resumed[mode]:
            assert result["state_equal"]
            assert result["step"] == 3
            assert result["trained"]
            assert result["bitwise"]


def scenario_mode_misfit(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """An approx DCP file into an exact optimizer: DCP fills the template (the global shapes
    agree), so the file is in the live state already; the load vote refuses the mode on every
    rank, changes nothing more, and latches the optimizer (it trained on the approx momentum
    before), until a valid checkpoint loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from gefen.dist import DistributedStepError

    model, optimizer = _build(world_size, "approx")
    _train(model, optimizer, range(2))
    path = str(Path(folder) / "approx-misfit")
    dcp.save({"optim": _state(model, optimizer)["optim"]}, checkpoint_id=path)
    target_model, target = _build(world_size, "exact")
    _train(target_model, target, range(2))
    template = {"optim": _state(target_model, target)["optim"]}
    dcp.load(template, checkpoint_id=path)
    before = mt.snapshot(target)
    try:
        set_optimizer_state_dict(target_model, target, template["optim"])
        outcome = "loaded"
    except DistributedStepError as error:
        outcome = str(error.__cause__ or error)
    changes = [change for change in mt.changes(target, before) if "_commit_failed" not in change]
    latched = target.latched
    try:
        _train(target_model, target, range(2, 3))
        stepped = "stepped"
    except DistributedStepError as error:
        stepped = str(error)
    return {"outcome": outcome, "changes": changes, "latched": latched, "stepped": stepped}


def test_an_approx_file_fails_closed_in_an_exact_optimizer(tmp_path: Path) -> None:
    world = run_scenarios(
        [("misfit", scenario_mode_misfit, (str(tmp_path),))], 2, rank_deadline_s=300.0
    )
    for result in world["misfit"]:
        assert "sharded_mode 'approx' cannot load into 'exact'" in result["outcome"]
        assert result["changes"] == []
        assert result["latched"]
        assert "a refused load had already been written" in result["stepped"]


def scenario_counters_on_one_rank(rank: int, world_size: int, key: str) -> dict[str, Any]:
    """Row-sharded NorMuon: rank 1 loads rank 0's state with every entry's ``key`` one lower,
    through torch's in-memory get/set path (no header)."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from gefen.core.testing import attempt
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    model = mt.sharded(mt.mesh_1d(world_size), mt.fulls(SHAPES, 0))
    optimizer = mt.sharded_muon(model, sharded_mode="approx", normuon=True)
    assert optimizer.row_sharded()
    _train(model, optimizer, range(3))
    saved = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    if rank == 1:
        for entry in saved["state"].values():
            entry[key] -= 1
    before = deep_snapshot(optimizer)
    outcome = attempt(lambda: set_optimizer_state_dict(model, optimizer, saved), value=False)
    changes = snapshot_diff(before, deep_snapshot(optimizer))
    _train(model, optimizer, range(3, 4))
    return {"outcome": outcome, "changes": changes, "step": optimizer.global_step}


@pytest.mark.parametrize("key", ["normuon_step", "step"])
def test_other_counters_on_one_rank_fail_every_rank(key: str) -> None:
    # They loaded: the rows of one matrix were then updated with two bias corrections.
    scenarios = [("counters", scenario_counters_on_one_rank, (key,))]
    world = run_scenarios(scenarios, 2, rank_deadline_s=300.0)
    for result in world["counters"]:
        assert "replicated state differs" in result["outcome"]["error"]
        assert result["changes"] == []
        assert result["step"] == 4


def scenario_counter_past_int64(rank: int, world_size: int) -> dict[str, Any]:
    """Row-sharded NorMuon with a (1, 16) matrix rank 1 holds no row of: rank 0's live
    ``normuon_step`` of it is set past int64, then both ranks save and load back."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from gefen.core.testing import attempt

    model = mt.sharded(mt.mesh_1d(world_size), mt.fulls([(8, 12), (1, 16)], 0))
    optimizer = mt.sharded_muon(model, sharded_mode="approx", normuon=True)
    _train(model, optimizer, range(2))
    narrow = list(model.parameters())[1]
    if rank == 0:
        optimizer.state[narrow]["normuon_step"] = 2**63
    saved = get_optimizer_state_dict(model, optimizer)
    agreed = saved["state"]["1.weight"]["normuon_step"]
    outcome = attempt(lambda: set_optimizer_state_dict(model, optimizer, saved), value=False)
    return {"agreed": agreed, "outcome": outcome}


def test_a_counter_past_int64_on_one_rank_saves_without_a_hang() -> None:
    # Rank 0 failed to pack it into the counters' MAX all-reduce, before the collective rank 1
    # was already waiting in: rank 1 hung until the process group's timeout. It saturates, so
    # both ranks save the same value, and the load then refuses it by name on every rank.
    world = run_scenarios([("past", scenario_counter_past_int64, ())], 2, rank_deadline_s=120.0)
    for result in world["past"]:
        assert result["agreed"] == 2**63 - 1
        assert "GefenMuon load validation failed" in result["outcome"]["error"]
    errors = [result["outcome"]["error"] for result in world["past"]]
    assert any("'normuon_step' 9223372036854775807 exceeds global_step 2" in e for e in errors)


def _full_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def scenario_full_save(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """One portable file, as for torch's AdamW under FSDP2: the full state dict on rank 0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer = _build(world_size, "distributed")
    _train(model, optimizer, range(3))
    expected = gathered_optimizer_state(model, optimizer)
    full = get_optimizer_state_dict(model, optimizer, options=_full_options())
    if rank == 0:
        torch.save({"optim": full, "expected": expected}, Path(folder) / "full.pt")
    return {"plain": all(type(v) is torch.Tensor for v in _tensors(full))}


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, list):
        return [t for item in value for t in _tensors(item)]
    return []


def scenario_full_resume(rank: int, world_size: int, folder: str, how: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    model, optimizer = _build(world_size, "distributed")
    saved = torch.load(Path(folder) / "full.pt", weights_only=True)
    if how == "load_state_dict":
        optimizer.load_state_dict(saved["optim"])
    else:  # torch's own full-state-dict load, as for AdamW under FSDP2
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, saved["optim"], options=options)
    gathered = gathered_optimizer_state(model, optimizer)
    step = optimizer.global_step
    _train(model, optimizer, range(3, 5))
    return {
        "state_equal": nested_equal(gathered["state"], saved["expected"]["state"]),
        "trained": (step, optimizer.global_step),
    }


def test_a_full_state_dict_of_distributed_rows_is_one_file_for_any_world(tmp_path: Path) -> None:
    """Resumed with ``load_state_dict`` or torch's ``set_optimizer_state_dict(...,
    full_state_dict=True)``, which matches the extras item by item against a fresh optimizer's
    (the manifest, whose lists grow as entries initialise, stays out of the group copies)."""
    saved = run_scenarios(
        [("save", scenario_full_save, (str(tmp_path),))], 2, rank_deadline_s=300.0
    )
    assert all(result["plain"] for result in saved["save"])
    for world in (1, 3):
        resumes = [
            (how, scenario_full_resume, (str(tmp_path), how))
            for how in ("load_state_dict", "set_full")
        ]
        resumed = run_scenarios(resumes, world, rank_deadline_s=300.0)
        for how in ("load_state_dict", "set_full"):
            for result in resumed[how]:
                assert result["state_equal"], how
                assert result["trained"] == (3, 5), how


@pytest.fixture(scope="module")
def across_modes(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """exact and distributed state is global: each mode's world-2 file through DCP into a fresh
    optimizer of the other mode, at world 2 and 3 (docs/muon.md §8)."""
    folder = tmp_path_factory.mktemp("muon_across")
    outcomes: dict[Any, Any] = {}
    saves = [(mode, scenario_save, (str(folder), mode)) for mode in ("exact", "distributed")]
    outcomes["save"] = run_scenarios(saves, 2, rank_deadline_s=300.0)
    for world in (2, 3):
        resumes = [
            ("exact", scenario_resume, (str(folder), "exact", 2, "distributed")),
            ("distributed", scenario_resume, (str(folder), "distributed", 2, "exact")),
        ]
        outcomes[world] = run_scenarios(resumes, world, rank_deadline_s=300.0)
    return outcomes


@pytest.mark.parametrize("saved", ["exact", "distributed"])
@pytest.mark.parametrize("world", [2, 3])
def test_exact_and_distributed_files_resume_into_each_other_through_dcp(
    world: int, saved: str, across_modes: Any
) -> None:
    for result in across_modes[world][saved]:
        assert _resumed(result), result
