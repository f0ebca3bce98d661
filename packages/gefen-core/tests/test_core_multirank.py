"""FSDP2 / DTensor on Gloo with real ``fully_shard``
(docs/core.md §7, §8.2, §8.5, §9; §12 #49, #59).

All scenarios share one spawned 2-rank world (process start-up dominates on this machine).
Scenario functions are module-level so the spawned children can load them by reference.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed

pytestmark = [pytest.mark.multirank, gloo_required()]

DEADLINE_S = 30.0  # the liveness bound asserted for one failing operation


def _sharded_model(seed: int = 0) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank: int, seed: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed * 10 + rank))


def _train(model: Any, optimizer: Any, rank: int, seeds: range) -> None:
    for seed in seeds:
        optimizer.zero_grad()
        model(_batch(rank, seed)).square().mean().backward()
        optimizer.step()


def _snapshot(optimizer: Any) -> Any:
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot

    return deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)


def _changes(optimizer: Any, before: Any) -> list[str]:
    from gefen.dist.testing import snapshot_diff

    return snapshot_diff(before, _snapshot(optimizer))


def scenario_train_block_family(rank: int, world_size: int) -> dict[str, Any]:
    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    first = model(_batch(rank, 0)).square().mean().item()
    _train(model, optimizer, rank, range(5))
    entries = list(optimizer.state.values())
    return {
        "scope": len(optimizer.step_failure_scope()),
        "global_step": optimizer.global_step,
        "families": sorted({"v_block" in e for e in entries}),
        "amp": optimizer._step_supports_amp_scaling,
        "moved": first != model(_batch(rank, 0)).square().mean().item(),
        "rank_local": "rank_local" in optimizer.state_dict()["gefen"],
    }


def scenario_one_rank_closure_failure(rank: int, world_size: int) -> dict[str, Any]:
    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    model(_batch(rank, 7)).square().mean().backward()
    before = _snapshot(optimizer)

    def closure() -> None:
        if rank == 1:
            raise KeyError("closure failed on rank 1")

    elapsed, error, _ = timed(lambda: optimizer.step(closure))
    changes = _changes(optimizer, before)
    optimizer.step()  # still trains, together
    return {"elapsed": elapsed, "error": error, "changes": changes, "step": optimizer.global_step}


def scenario_one_rank_missing_gradient(rank: int, world_size: int) -> dict[str, Any]:
    from gefen.core import Gefen

    model = _sharded_model()
    twin_model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    twin = Gefen(twin_model.parameters(), lr=0.01)
    for net, opt in ((model, optimizer), (twin_model, twin)):
        _train(net, opt, rank, range(2))
        opt.zero_grad()
        net(_batch(rank, 7)).square().mean().backward()
    last = list(model.parameters())[-1]
    kept = last.grad
    if rank == 1:
        last.grad = None  # this rank lost one gradient (a skipped branch, a bad hook)
    before = _snapshot(optimizer)
    elapsed, error, _ = timed(optimizer.step)
    changes = _changes(optimizer, before)
    last.grad = kept
    optimizer.step()  # the repaired step, together
    twin.step()  # the twin never saw the mismatch
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), twin_model.parameters(), strict=True)
    )
    return {"elapsed": elapsed, "error": error, "changes": changes, "same": same}


def scenario_one_rank_extra_parameter(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 registered one more parameter: the presence patterns differ in length."""
    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.named_parameters(), lr=0.01)
    _train(model, optimizer, rank, range(1))
    extra = torch.nn.Parameter(torch.ones(4))
    if rank == 1:
        optimizer.add_param_group({"params": [extra], "param_names": ["extra.bias"]})
    optimizer.zero_grad()
    model(_batch(rank, 7)).square().mean().backward()
    extra.grad = torch.ones(4)
    before = _snapshot(optimizer)
    elapsed, error, _ = timed(optimizer.step)
    changes = _changes(optimizer, before)
    if rank == 1:
        optimizer.param_groups.pop()
    optimizer.step()  # together again
    return {"elapsed": elapsed, "error": error, "changes": changes}


def scenario_one_rank_edited_option(rank: int, world_size: int, option: str) -> dict[str, Any]:
    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    optimizer.zero_grad()
    model(_batch(rank, 7)).square().mean().backward()
    group = optimizer.param_groups[0]
    kept = group[option]
    if rank == 1:  # an edit on one member only (a per-rank schedule, a stray assignment)
        group[option] = 0.02 if option == "lr" else not kept
    before = _snapshot(optimizer)
    elapsed, error, _ = timed(optimizer.step)
    changes = _changes(optimizer, before)
    group[option] = kept
    optimizer.step()  # repaired: it trains, together
    return {"elapsed": elapsed, "error": error, "changes": changes, "step": optimizer.global_step}


def scenario_one_rank_regrouped(rank: int, world_size: int, change: str) -> dict[str, Any]:
    from gefen.core import Gefen

    model = _sharded_model()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    lr = torch.tensor(0.01) if change == "filled_tensor_lr" else 0.01
    optimizer = Gefen([{"params": first}, {"params": second, "lr": 0.1}], lr=lr)
    _train(model, optimizer, rank, range(2))
    optimizer.zero_grad()
    model(_batch(rank, 7)).square().mean().backward()
    groups = optimizer.param_groups

    def edit(undo: bool) -> None:  # on one member only (a set's order, a per-rank scheduler)
        if rank != 1:
            return
        if change == "filled_tensor_lr":
            groups[0]["lr"].fill_(0.01 if undo else 0.02)
        elif undo:
            groups[1]["params"].insert(0, groups[0]["params"].pop())
        else:
            groups[0]["params"].append(groups[1]["params"].pop(0))

    edit(undo=False)
    before = _snapshot(optimizer)
    elapsed, error, _ = timed(optimizer.step)
    changes = _changes(optimizer, before)
    edit(undo=True)
    optimizer.step()  # repaired: it trains, together
    return {"elapsed": elapsed, "error": error, "changes": changes, "step": optimizer.global_step}


def scenario_one_rank_edited_defaults(rank: int, world_size: int) -> dict[str, Any]:
    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    if rank == 1:  # defaults are not what the step agrees on: the groups hold the value
        optimizer.defaults["codebook_refresh_every"] = 1
    _train(model, optimizer, rank, range(2, 4))
    codebook = optimizer.codebook
    assert codebook is not None
    return {"codebook": codebook.tolist(), "step": optimizer.global_step}


def scenario_step_meets_other_operation(rank: int, world_size: int, other: str) -> dict[str, Any]:
    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    saved = optimizer.state_dict()
    optimizer.zero_grad()
    model(_batch(rank, 7)).square().mean().backward()
    before = _snapshot(optimizer)
    if rank == 0:  # a common mistake: one rank checkpoints (or restores) while the other steps
        elapsed, error, _ = timed(optimizer.step)
    elif other == "load":
        elapsed, error, _ = timed(lambda: optimizer.load_state_dict(saved))
    else:
        elapsed, error, _ = timed(optimizer.state_dict)
    changes = _changes(optimizer, before)
    optimizer.step()  # together again: it trains
    return {"elapsed": elapsed, "error": error, "changes": changes, "step": optimizer.global_step}


def scenario_operations_meet(rank: int, world_size: int, mine: str, theirs: str) -> dict[str, Any]:
    """Rank 0 runs ``mine`` while rank 1 runs ``theirs`` (codebook calls and a state dict)."""
    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    optimizer.zero_grad()
    model(_batch(rank, 7)).square().mean().backward()
    actions = {
        "initialize": optimizer.initialize_codebook,
        "refresh": optimizer.refresh_codebook,
        "state_dict": optimizer.state_dict,
    }
    before = _snapshot(optimizer)
    elapsed, error, _ = timed(actions[mine if rank == 0 else theirs])
    changes = _changes(optimizer, before)
    optimizer.step()  # together again: it trains
    return {"elapsed": elapsed, "error": error, "changes": changes, "step": optimizer.global_step}


def scenario_one_rank_load_rejection(rank: int, world_size: int) -> dict[str, Any]:
    from gefen.core import Gefen
    from gefen.dist import DistributedStepError

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    sd = optimizer.state_dict()
    if rank == 1:
        sd["gefen"]["colour"] = "red"
        for group in sd["param_groups"]:
            group["gefen"]["colour"] = "red"
    fired: list[int] = []
    optimizer.register_load_state_dict_post_hook(lambda opt: fired.append(1))
    before = _snapshot(optimizer)
    cause = None
    message = None
    try:
        optimizer.load_state_dict(sd)
    except DistributedStepError as error:
        message = str(error)
        cause = (
            None
            if error.__cause__ is None
            else f"{type(error.__cause__).__name__}: {error.__cause__}"
        )
    return {
        "message": message,
        "cause": cause,
        "changes": _changes(optimizer, before),
        "hooks": fired,
    }


def scenario_rank_local_refusal(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from gefen.core import Gefen
    from gefen.dist import DistributedStepError

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, rank, range(2))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    files: list[Any] = [None, None]
    dist.all_gather_object(files, buffer.getvalue())
    other = torch.load(io.BytesIO(files[1 - rank]), weights_only=True)
    own = torch.load(io.BytesIO(files[rank]), weights_only=True)
    causes = []
    try:
        optimizer.load_state_dict(other)
    except DistributedStepError as error:
        causes.append(str(error.__cause__))
    optimizer.load_state_dict(own)  # its own file loads
    return {"causes": causes, "step": optimizer.global_step}


def scenario_dcp_round_trip(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from gefen.core import Gefen

    model = _sharded_model()
    optimizer = Gefen(model.parameters(), lr=0.01)
    fresh_model = _sharded_model()
    fresh = Gefen(fresh_model.parameters(), lr=0.01)
    get_optimizer_state_dict(fresh_model, fresh)
    pristine = fresh.global_step == 0 and all(e == {"period": 0} for e in fresh.state.values())
    _train(model, optimizer, rank, range(3))
    osd = get_optimizer_state_dict(model, optimizer)
    fresh_model.load_state_dict(model.state_dict())
    set_optimizer_state_dict(fresh_model, fresh, osd)
    _train(model, optimizer, rank, range(5, 8))
    _train(fresh_model, fresh, rank, range(5, 8))
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True)
    )
    return {"pristine": pristine, "same": same, "step": fresh.global_step}


SCENARIOS = [
    ("train", scenario_train_block_family, ()),
    ("closure", scenario_one_rank_closure_failure, ()),
    ("load", scenario_one_rank_load_rejection, ()),
    ("missing_grad", scenario_one_rank_missing_gradient, ()),
    ("extra_parameter", scenario_one_rank_extra_parameter, ()),
    ("edited_lr", scenario_one_rank_edited_option, ("lr",)),
    ("edited_period", scenario_one_rank_edited_option, ("force_2d_period_one",)),
    ("moved_parameter", scenario_one_rank_regrouped, ("moved_parameter",)),
    ("filled_tensor_lr", scenario_one_rank_regrouped, ("filled_tensor_lr",)),
    ("edited_defaults", scenario_one_rank_edited_defaults, ()),
    ("step_meets_load", scenario_step_meets_other_operation, ("load",)),
    ("step_meets_state_dict", scenario_step_meets_other_operation, ("state_dict",)),
    ("initialize_meets_state_dict", scenario_operations_meet, ("initialize", "state_dict")),
    ("refresh_meets_state_dict", scenario_operations_meet, ("refresh", "state_dict")),
    ("initialize_meets_refresh", scenario_operations_meet, ("initialize", "refresh")),
    ("rank_local", scenario_rank_local_refusal, ()),
    ("dcp", scenario_dcp_round_trip, ()),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rank_deadline_s=400.0, pg_timeout_s=120.0)


@pytest.mark.smoke
def test_fsdp2_trains_local_shards_with_block_family(world: ScenarioWorld) -> None:
    for result in world["train"]:
        assert result == {
            "scope": 1,
            "global_step": 5,
            "families": [True],
            "amp": True,
            "moved": True,
            "rank_local": True,
        }


@pytest.mark.smoke
def test_one_rank_closure_failure_fails_every_rank_with_nothing_mutated(
    world: ScenarioWorld,
) -> None:
    first, second = world["closure"]
    assert (
        first["error"]
        == "DistributedStepError: Gefen step preflight failed on another process-group member"
    )
    assert second["error"].startswith(
        "DistributedStepError: Gefen step preflight failed on local rank 1"
    )
    for result in (first, second):
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        assert result["step"] == 3


def test_a_gradient_missing_on_one_rank_fails_every_rank_with_nothing_mutated(
    world: ScenarioWorld,
) -> None:
    # It used to be accepted: the rank without the gradient skipped its shard silently.
    for result in world["missing_grad"]:
        assert result["error"] == (
            "GroupAgreementError: Gefen step preflight: gradient presence differs across the "
            "process-group members (every member must present the same; nothing was changed); "
            "parameters with a gradient on some members only: param_groups[0][3]"
        )  # the parameters used to go unnamed
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        assert result["same"]  # the repaired step equals an untouched twin's, bit for bit


def test_a_parameter_on_one_rank_only_fails_every_rank_with_the_same_words(
    world: ScenarioWorld,
) -> None:
    # Rank 0 named position "#6" and rank 1 'extra.bias': each from its own labels.
    for result in world["extra_parameter"]:
        assert result["error"] == (
            "GroupAgreementError: Gefen step preflight: gradient presence differs across the "
            "process-group members (every member must present the same; nothing was changed); "
            "the members list different parameters"
        )
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []


@pytest.mark.parametrize(
    "edit", ["edited_lr", "edited_period", "moved_parameter", "filled_tensor_lr"]
)
def test_an_option_edited_on_one_rank_fails_every_rank_with_nothing_mutated(
    world: ScenarioWorld, edit: str
) -> None:
    # It used to pass unseen: an edited lr made the ranks diverge, and an edited
    # force_2d_period_one made them run different collectives (a backend error or an abort).
    # So did a parameter moved into a group with another lr, and a tensor lr filled in place:
    # the options digest left out how many parameters each run of equal options steps, and
    # wrote a tensor lr by dtype and shape only.
    for result in world[edit]:
        assert result["error"] == (
            "GroupAgreementError: Gefen step preflight: group options differs across the "
            "process-group members (every member must present the same; nothing was changed)"
        )
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        assert result["step"] == 3


def test_a_refresh_period_edited_in_defaults_on_one_rank_changes_no_collective(
    world: ScenarioWorld,
) -> None:
    # It used to refresh on that rank alone: a collective the other rank never entered (Gloo
    # aborted the process). The groups, which the vote agrees on, hold the period.
    results = world["edited_defaults"]
    assert [result["step"] for result in results] == [4, 4]
    assert results[0]["codebook"] == results[1]["codebook"]


@pytest.mark.parametrize("other", ["step_meets_load", "step_meets_state_dict"])
def test_a_step_meeting_another_operation_says_so_on_every_rank(
    world: ScenarioWorld, other: str
) -> None:
    # The stepping rank used to read the other's vote as "gradient presence differs", the
    # wrong cause; the loading rank as "replicated state differs".
    for result in world[other]:
        assert "another process-group member is in a different operation" in result["error"]
        assert result["error"].startswith("GroupAgreementError: Gefen ")
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        assert result["step"] == 3


@pytest.mark.parametrize(
    "meeting",
    ["initialize_meets_state_dict", "refresh_meets_state_dict", "initialize_meets_refresh"],
)
def test_codebook_calls_meeting_another_operation_say_so_on_every_rank(
    world: ScenarioWorld, meeting: str
) -> None:
    # None of these votes agrees on anything, and the operation word digested only agreement
    # subjects: one rank returned while the other waited in its learning all-reduce (a gloo
    # error once the first moved on, or the process group's timeout).
    for result in world[meeting]:
        assert "another process-group member is in a different operation" in result["error"]
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        assert result["step"] == 3


def test_one_rank_load_rejection_raises_everywhere_and_commits_nowhere(
    world: ScenarioWorld,
) -> None:
    first, second = world["load"]
    assert first["message"] == "Gefen load validation failed on another process-group member"
    assert second["message"].startswith(
        "Gefen load validation failed on local rank 1: Gefen checkpoint:"
    )
    assert second["cause"] == "ValueError: Gefen checkpoint: unknown extras key 'colour'"
    for result in (first, second):
        assert result["changes"] == []
        assert result["hooks"] == []


def test_other_ranks_file_refused_via_rank_local(world: ScenarioWorld) -> None:
    for result in world["rank_local"]:
        assert len(result["causes"]) == 1
        assert "Gefen checkpoint: rank-local checkpoint topology differs" in result["causes"][0]
        assert result["step"] == 2


def test_dcp_round_trip_on_fsdp2(world: ScenarioWorld) -> None:
    for result in world["dcp"]:
        assert result == {"pristine": True, "same": True, "step": 6}
