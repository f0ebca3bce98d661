"""FSDP2 checkpoints that reshard: ``dcp.save`` at one world size, ``dcp.load`` into a freshly
built Gefen at another (docs/core.md §9.1), on Gloo with real ``fully_shard``.

Saved at world 2, resumed at worlds 1, 2, 3 and 4; saved at 4, resumed at 2. After the load every
state tensor, gathered, equals the saved one bit for bit, the codebook and counters too, and
training continues on every rank; at the same world size the continuation is bit-identical to a
run that never stopped. Each world is spawned once per test module (process start-up dominates).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gefen.core.testing import gathered_optimizer_state, nested_equal
from gefen.dist.testing import gloo_required, run_scenarios

pytestmark = [pytest.mark.multirank, gloo_required()]

# Rows 24 and 10 split unevenly at worlds 3 and 4 (torch.chunk: 4, 4, 2 and 3, 3, 3, 1).
WIDTHS = (8, 24, 10)
# Three rows at world 4 (torch.chunk: 1, 1, 1, 0): rank 3 holds no row of the first layer.
NARROW = (8, 3, 16)


def _model(world: int, widths: tuple[int, ...] = WIDTHS, layout: str = "fsdp") -> Any:
    """``layout`` "fsdp": one mesh of ``world``; "hsdp": (2, world / 2), replicated over the
    first dimension and row-sharded over the second."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    first, last = torch.nn.Linear(*widths[:2]), torch.nn.Linear(*widths[1:])
    model = torch.nn.Sequential(first, torch.nn.Tanh(), last, torch.nn.LayerNorm(widths[2]))
    shape = (world,) if layout == "fsdp" else (2, world // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
    for module in (first, last, model):
        fully_shard(module, mesh=mesh)
    return model


def _train(model: Any, optimizer: Any, rank: int, seeds: range) -> None:
    for seed in seeds:
        generator = torch.Generator().manual_seed(100 * seed + rank)
        x = torch.randn(4, model[0].in_features, generator=generator)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _full_params(model: Any) -> list[torch.Tensor]:
    # a copy: on a one-rank mesh full_tensor() is the parameter's own storage
    return [param.full_tensor().detach().clone() for param in model.parameters()]


def scenario_save(
    rank: int,
    world_size: int,
    folder: str,
    widths: tuple[int, ...] = WIDTHS,
    layout: str = "fsdp",
    codec: str = "codebook8",
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from gefen.core import Gefen

    model = _model(world_size, widths, layout)
    optimizer = Gefen(model.parameters(), lr=0.01, momentum_codec=codec)
    _train(model, optimizer, rank, range(3))
    expected = gathered_optimizer_state(model, optimizer)
    optim = get_optimizer_state_dict(model, optimizer)
    state = {"model": get_model_state_dict(model), "optim": optim}
    dcp.save(state, checkpoint_id=str(Path(folder) / "checkpoint"))
    _train(model, optimizer, rank, range(3, 5))
    continued = _full_params(model)
    if rank == 0:
        saved = {"expected": expected, "continued": continued, "layout": layout}
        torch.save(saved, Path(folder) / "saved.pt")
    return {
        "row_sharded": optimizer.row_sharded(),
        "periods": sorted({entry["period"] for entry in optimizer.state.values()}),
    }


def scenario_resume(
    rank: int,
    world_size: int,
    folder: str,
    saved_world: int,
    widths: tuple[int, ...] = WIDTHS,
    layout: str = "fsdp",
    codec: str = "codebook8",
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from gefen.core import Gefen

    model = _model(world_size, widths, layout)
    optimizer = Gefen(model.parameters(), lr=0.01, momentum_codec=codec)
    template = get_optimizer_state_dict(model, optimizer)
    state = {"model": get_model_state_dict(model), "optim": template}
    dcp.load(state, checkpoint_id=str(Path(folder) / "checkpoint"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    saved = torch.load(Path(folder) / "saved.pt", weights_only=True)
    expected, gathered = saved["expected"], gathered_optimizer_state(model, optimizer)
    state_equal = nested_equal(gathered["state"], expected["state"])
    extras = [sd["param_groups"][0]["gefen"] for sd in (gathered, expected)]
    extras_equal = nested_equal(*extras)
    step = optimizer.global_step
    before = _full_params(model)
    _train(model, optimizer, rank, range(3, 5))
    after = _full_params(model)
    return {
        "state_equal": state_equal,
        "extras_equal": extras_equal,
        "step": step,
        "trained": optimizer.global_step == step + 2
        and all(bool(torch.isfinite(p).all()) for p in after)
        and any(not torch.equal(x, y) for x, y in zip(before, after, strict=True)),
        "bitwise": world_size == saved_world
        and saved["layout"] == layout
        and all(torch.equal(x, y) for x, y in zip(after, saved["continued"], strict=True)),
    }


def _resumes(
    folder: Path,
    saved_world: int,
    worlds: tuple[int | tuple[int, str], ...],
    widths: tuple[int, ...] = WIDTHS,
    layout: str = "fsdp",
    codec: str = "codebook8",
) -> dict[Any, Any]:
    """Save at ``saved_world`` in ``layout``; resume at each world (a ``(world, layout)`` pair
    for another layout than FSDP's)."""
    save = (str(folder), widths, layout, codec)
    saved = run_scenarios([("save", scenario_save, save)], saved_world, rank_deadline_s=300.0)
    outcomes: dict[Any, Any] = {0: saved["save"]}
    for target in worlds:
        world, resume_layout = target if isinstance(target, tuple) else (target, "fsdp")
        resumed = run_scenarios(
            [
                (
                    "resume",
                    scenario_resume,
                    (str(folder), saved_world, widths, resume_layout, codec),
                )
            ],
            world,
            rank_deadline_s=300.0,
        )
        outcomes[target] = resumed["resume"]
    return outcomes


@pytest.fixture(scope="module")
def from_two(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return _resumes(tmp_path_factory.mktemp("world2"), 2, (1, 2, 3, 4))


@pytest.fixture(scope="module")
def from_four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return _resumes(tmp_path_factory.mktemp("world4"), 4, (2,))


def _resumed(result: dict[str, Any]) -> bool:
    """The state and extras equal the saved ones, at step 3, and training went on."""
    return bool(
        result["state_equal"]
        and result["extras_equal"]
        and result["step"] == 3
        and result["trained"]
    )


def test_the_saving_optimizer_is_row_sharded(from_two: dict[int, Any]) -> None:
    for result in from_two[0]:
        assert result == {"row_sharded": True, "periods": [1, 8, 24]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_world_two_checkpoint_resumes_at(world: int, from_two: dict[int, Any]) -> None:
    for result in from_two[world]:
        assert _resumed(result), result
        assert result["bitwise"] == (world == 2)


def test_a_world_four_checkpoint_resumes_at_two(from_four: dict[int, Any]) -> None:
    for result in from_four[0]:
        assert result["row_sharded"]
    for result in from_four[2]:
        assert _resumed(result), result


@pytest.fixture(scope="module")
def codebook4_from_two(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return _resumes(tmp_path_factory.mktemp("q4"), 2, (2, 3), codec="codebook4")


@pytest.mark.parametrize("world", [2, 3])
def test_codebook4_state_reshards_from_two_to(
    world: int, codebook4_from_two: dict[int, Any]
) -> None:
    """Packed codes are rows like codebook8's (each block's ceil(P/2) bytes): DCP cuts them by
    rows, including the uneven split at world 3."""
    for result in codebook4_from_two[0]:
        assert result == {"row_sharded": True, "periods": [1, 8, 24]}
    for result in codebook4_from_two[world]:
        assert _resumed(result), result
        assert result["bitwise"] == (world == 2)


@pytest.fixture(scope="module")
def narrow_from_four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return _resumes(tmp_path_factory.mktemp("narrow4"), 4, (2, 3, 4), NARROW)


@pytest.fixture(scope="module")
def narrow_from_two(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return _resumes(tmp_path_factory.mktemp("narrow2"), 2, (4,), NARROW)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_rank_without_rows_still_reshards_from_four_to(
    world: int, narrow_from_four: dict[int, Any]
) -> None:
    """Rank 3 of 4 holds no row of a (3, 8) layer: the optimizer stays row-sharded, that rank
    learns the layer's counters at save, and the file resumes at 2, 3 and 4 (bit for bit)."""
    for result in narrow_from_four[0]:
        assert result["row_sharded"]
    assert narrow_from_four[0][3]["periods"] == [0, 1, 3]  # no state for the layer it lacks
    for result in narrow_from_four[world]:
        assert _resumed(result), result
        assert result["bitwise"] == (world == 4)


def test_a_world_two_file_resumes_where_a_rank_holds_no_row(
    narrow_from_two: dict[int, Any],
) -> None:
    for result in narrow_from_two[4]:
        assert _resumed(result), result


@pytest.fixture(scope="module")
def hsdp_from_four(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return _resumes(tmp_path_factory.mktemp("hsdp4"), 4, (2, 3, (4, "hsdp")), WIDTHS, "hsdp")


@pytest.mark.parametrize("target", [2, 3, (4, "hsdp")])
def test_an_hsdp_checkpoint_resumes_under_fsdp_and_hsdp(
    target: Any, hsdp_from_four: dict[Any, Any]
) -> None:
    """HSDP, a (2, 2) mesh replicated over its first dimension and row-sharded over its second:
    row-sharded too (the codebook summed over the shards), so DCP moves its file to FSDP at 2 and
    3 and back to HSDP at 4, where the run continues bit for bit."""
    for result in hsdp_from_four[0]:
        assert result["row_sharded"]
    for result in hsdp_from_four[target]:
        assert _resumed(result), result
        assert result["bitwise"] == (target == (4, "hsdp"))


def test_an_fsdp_checkpoint_resumes_under_hsdp(tmp_path: Path) -> None:
    outcomes = _resumes(tmp_path, 2, ((4, "hsdp"),))
    for result in outcomes[(4, "hsdp")]:
        assert _resumed(result), result


def scenario_full_save(rank: int, world_size: int, folder: str) -> None:
    """One portable file, as for torch's AdamW: the full state dict, saved on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from gefen.core import Gefen

    model = _model(world_size, NARROW)
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(3))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_optimizer_state_dict(model, optimizer, options=options)
    expected = gathered_optimizer_state(model, optimizer)
    if rank == 0:
        torch.save({"full": full, "expected": expected}, Path(folder) / "full.pt")


def scenario_full_resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from gefen.core import Gefen

    model = _model(world_size, NARROW)
    optimizer = Gefen(model.parameters(), lr=0.01)
    saved = torch.load(Path(folder) / "full.pt", weights_only=True)
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, saved["full"], options=options)
    gathered = gathered_optimizer_state(model, optimizer)
    step = optimizer.global_step
    _train(model, optimizer, rank, range(3, 5))
    return {
        "state_equal": nested_equal(gathered["state"], saved["expected"]["state"]),
        "trained": (step, optimizer.global_step),
    }


def test_a_full_state_dict_file_resumes_at_another_world_size(tmp_path: Path) -> None:
    """Saved at world 2 through torch's full-state-dict path, resumed through it at 3 and 4
    (rank 3 of 4 holding no row of the (3, 8) layer)."""
    run_scenarios([("save", scenario_full_save, (str(tmp_path),))], 2, rank_deadline_s=300.0)
    for world in (3, 4):
        resumed = run_scenarios(
            [("resume", scenario_full_resume, (str(tmp_path),))], world, rank_deadline_s=300.0
        )
        for result in resumed["resume"]:
            assert result["state_equal"]
            assert result["trained"] == (3, 5)
    _resume_in_a_plain_process(torch.load(tmp_path / "full.pt", weights_only=True)["full"])


def _resume_in_a_plain_process(full: dict[str, Any]) -> None:
    """The file into a Gefen over a model that is not ``fully_shard``-ed (this process), with
    ``load_state_dict``: each matrix keeps the file's periods and migrates from the row-sharded
    block family to the factored one, its statistics carried over. The load used to refuse a
    period the plain optimizer would have searched ("must be the (48, 1) slot of a searched
    period"), and the statistics used to restart at zero beside the kept momentum: the first
    step moved rows without gradient by about 1e4."""
    from gefen.core import Gefen

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 3), torch.nn.Tanh(), torch.nn.Linear(3, 16), torch.nn.LayerNorm(16)
    )
    optimizer = Gefen(model.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match="second-moment family"):
        optimizer.load_state_dict(full)
    entry = optimizer.state[model[2].weight]
    assert "v_row" in entry
    assert entry["period"] == 3  # the file's: one block per row of (16, 3)
    assert entry["v_step"] == entry["step"] == 3
    before = [param.detach().clone() for param in model.parameters()]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    model[2].weight.grad[0] = 1.0  # one row: the rest move by their momentum alone
    optimizer.step()
    moved = max(
        float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True)
    )
    assert moved < 0.05  # a few times lr


def scenario_values_without_rows(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 3 holds no row of the (3, 8) layer: a state dict whose rows there are not empty
    (made by hand) is refused on every rank, nothing changed, and the optimizer trains."""
    from torch.distributed.tensor import DTensor

    from gefen.core import Gefen
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES, attempt
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    model = _model(world_size, NARROW)
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    sd = optimizer.state_dict()
    codes = sd["state"][0]["momentum_codes"]
    local = codes.to_local() if rank != 3 else torch.ones(1, 8, dtype=torch.uint8)
    sd["state"][0]["momentum_codes"] = DTensor.from_local(
        local, codes.device_mesh, codes.placements, run_check=False, shape=codes.shape,
        stride=codes.stride(),
    )  # fmt: skip
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    outcome = attempt(lambda: optimizer.load_state_dict(sd), value=False)
    changes = snapshot_diff(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    _train(model, optimizer, rank, range(2, 3))
    return {"outcome": outcome, "changes": changes, "step": optimizer.global_step}


def test_values_on_a_rank_without_rows_fail_closed_on_every_rank() -> None:
    world = run_scenarios([("values", scenario_values_without_rows, ())], 4, rank_deadline_s=300.0)
    for rank, result in enumerate(world["values"]):
        assert result["changes"] == []
        assert result["step"] == 3
        error = result["outcome"]["error"]
        if rank == 3:
            assert error == (
                "DistributedStepError: Gefen load validation failed on local rank 3: Gefen "
                "checkpoint: entry param_groups[0][0]: 'momentum_codes' holds values on a rank "
                "without rows"
            )
        else:
            assert error == (
                "DistributedStepError: Gefen load validation failed on another process-group member"
            )


MISFIT_FILES = [
    ("codec", {"momentum_codec": "none"}, "Missing key"),
    ("periods", {"force_2d_period_one": True}, "Size mismatch"),
]


def scenario_misfits(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Fail closed on every rank, nothing changed, training continues: DCP files of another
    codec or other periods (DCP's planner refuses them), and a codebook presence flag damaged on
    one rank only (the load vote refuses it everywhere)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from gefen.core import Gefen
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist import DistributedStepError
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    model = _model(world_size)
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    outcomes: dict[str, Any] = {}
    # another codec: keys the template needs are missing; other periods (a rank-local save with
    # period 1 for the matrices): the shapes differ
    for name, options, cause in MISFIT_FILES:
        source_model = _model(world_size)
        source = Gefen(source_model.parameters(), lr=0.01, **options)
        _train(source_model, source, rank, range(2))
        path = str(Path(folder) / name)
        dcp.save({"optim": get_optimizer_state_dict(source_model, source)}, checkpoint_id=path)
        before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
        try:
            template = get_optimizer_state_dict(model, optimizer)
            dcp.load({"optim": template}, checkpoint_id=path)
            outcomes[name] = "loaded"
        except CheckpointException as error:
            causes = " ".join(str(failure[0]) for failure in error.failures.values())
            outcomes[name] = cause in causes
        outcomes[f"{name}_changes"] = snapshot_diff(
            before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
        )
    # an entry re-blocked by hand (period 4 where the rule is one block per row, 8): its shapes
    # fit the validator, and every rank refuses it in the load vote
    reblocked = get_optimizer_state_dict(model, optimizer)
    entry = reblocked["state"]["0.weight"]
    rows = entry["momentum_codes"].to_local().shape[0] * 2
    entry.update(
        period=4,
        momentum_codes=torch.zeros(rows, 4, dtype=torch.uint8),
        momentum_scale=torch.zeros(rows, 1),
        v_block=torch.zeros(rows, 1),
    )
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    try:
        set_optimizer_state_dict(model, optimizer, reblocked)
        outcomes["row_periods"] = "loaded"
    except DistributedStepError as error:
        outcomes["row_periods"] = str(error.__cause__)
    outcomes["row_periods_changes"] = snapshot_diff(
        before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    )
    damaged = get_optimizer_state_dict(model, optimizer)
    if rank == 1:
        for group in damaged["param_groups"]:
            group["gefen"]["codebook_present"] = 0
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    try:
        set_optimizer_state_dict(model, optimizer, damaged)
        outcomes["presence"] = "loaded"
    except DistributedStepError as error:
        outcomes["presence"] = str(error)
    outcomes["presence_changes"] = snapshot_diff(
        before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    )
    _train(model, optimizer, rank, range(2, 3))
    outcomes["step"] = optimizer.global_step
    return outcomes


@pytest.fixture(scope="module")
def misfits(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = str(tmp_path_factory.mktemp("misfits"))
    return run_scenarios([("misfits", scenario_misfits, (folder,))], 2, rank_deadline_s=300.0)


def test_a_misfitting_checkpoint_fails_closed_on_every_rank(misfits: Any) -> None:
    first, second = misfits["misfits"]
    for result in (first, second):
        for name, _, _ in MISFIT_FILES:
            assert result[name] is True, name
            assert result[f"{name}_changes"] == [], name
        assert result["presence_changes"] == []
        assert result["step"] == 3
        assert "period 4 does not fit the row-sharded FSDP2 layout" in result["row_periods"]
        assert result["row_periods_changes"] == []
    assert first["presence"] == "Gefen load validation failed on another process-group member"
    assert second["presence"].startswith("Gefen load validation failed on local rank 1")


def scenario_stale_on_one_rank(rank: int, world_size: int, what: str) -> dict[str, Any]:
    """Rank 1 loads its state from one step before rank 0's (``what="file"``), or rank 0's
    file with every entry's ``step`` and ``v_step`` one lower (``"counters"``) or another ``lr``
    (``"options"``), through torch's in-memory get/set_optimizer_state_dict (no header at this
    level): the step, the codebook and the entries' counters of a row-sharded optimizer are
    replicas, and the options every rank's step, so every rank refuses, nothing changed."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from gefen.core import Gefen
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES, attempt
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    model = _model(world_size)
    optimizer = Gefen(model.parameters(), lr=0.01)
    assert optimizer.row_sharded()
    saved = []
    for seed in range(3):
        _train(model, optimizer, rank, range(seed, seed + 1))
        saved.append(copy.deepcopy(get_optimizer_state_dict(model, optimizer)))
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    stale = saved[1] if rank == 1 and what == "file" else saved[2]
    if rank == 1 and what == "counters":  # global step and codebook still rank 0's
        for entry in stale["state"].values():
            entry["step"], entry["v_step"] = entry["step"] - 1, entry["v_step"] - 1
    if rank == 1 and what == "options":  # state all rank 0's, one option edited
        stale["param_groups"][0]["lr"] = 0.02
    outcome = attempt(lambda: set_optimizer_state_dict(model, optimizer, stale), value=False)
    changes = snapshot_diff(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    _train(model, optimizer, rank, range(3, 4))
    return {"outcome": outcome, "changes": changes, "step": optimizer.global_step}


@pytest.mark.parametrize("what", ["file", "counters", "options"])
def test_a_stale_state_on_one_rank_of_a_row_sharded_optimizer_fails_every_rank(what: str) -> None:
    # It was accepted: ranks then disagreed on the global step and the codebook, and the next
    # refresh ran its all-reduce on one rank only; with other entry counters, the two halves
    # of each parameter were updated with different bias corrections; with another option, every
    # step failed until a consistent load.
    scenarios = [("stale", scenario_stale_on_one_rank, (what,))]
    world = run_scenarios(scenarios, 2, rank_deadline_s=300.0)
    subject = "group options" if what == "options" else "replicated state"
    for result in world["stale"]:
        assert result["changes"] == []
        assert result["step"] == 4
        assert f"{subject} differs across the process-group members" in result["outcome"]["error"]
