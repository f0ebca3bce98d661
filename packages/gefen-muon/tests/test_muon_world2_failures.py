"""GefenMuon's failure semantics on a 2-rank Gloo world (docs/muon.md §6, §7, §11, §12).

Every step scenario shards a real module with FSDP2 ``fully_shard`` on ``init_device_mesh("cpu",
(2,))``, takes gradients from a backward pass or assigns them as ``distribute_tensor(g, mesh,
[Shard(0)])`` on every rank, then makes one rank diverge (a failing closure, AMP controls, a
dropped gradient, another registration). Each scenario snapshots the local shards of parameters
and gradients, the deep optimizer state, the codebook and the global step before and after the
rejected operation, times it, and then proves the optimizer still steps together.

All scenarios share one spawned 2-rank world (process start-up dominates on this machine).
Scenario functions are module-level so the spawned children load them by reference; they catch
the operations under test themselves and return plain dicts only, so a rank never leaves its
peer waiting in a collective.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from itertools import pairwise
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from gefen.core.testing import attempt as _attempt
from gefen.core.testing import live_params as _params
from gefen.core.testing import local_shard as _local
from gefen.core.testing import same_or_none as _same
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios
from gefen.muon.testing import shared_mesh as _mesh

DEADLINE_S = 10.0  # docs/muon.md §11: a failing operation < 10 s < process-group timeout 20 s
PG_TIMEOUT_S = 20.0
WORLD_DEADLINE_S = 600.0  # the whole world, generous: this machine is shared

CLOSURE_TEXT = "rank-zero closure failure"
PREFLIGHT_LOCAL = "GefenMuon step preflight failed on local rank 0: " + CLOSURE_TEXT
PREFLIGHT_OTHER = "GefenMuon step preflight failed on another process-group member"
LOAD_LOCAL = "GefenMuon load validation failed on local rank 1: "
LOAD_OTHER = "GefenMuon load validation failed on another process-group member"
LOAD_CAUSE = "GefenMuon checkpoint: unknown extras key 'colour'"

AMP_FOUND_INF = (
    "GefenMuon AMP found_inf differs across process-group members; use a group-aware gradient "
    "scaler (ShardedGradScaler with scaler.unscale_(optimizer) before scaler.step(optimizer))"
)
AMP_PRESENCE = (
    "GefenMuon AMP protocol presence differs across process-group members; use the same "
    "group-aware gradient scaler on every member"
)
AMP_GRAD_SCALE = (
    "GefenMuon AMP grad_scale differs across process-group members; use a group-aware gradient "
    "scaler"
)
COUNT = (
    "GefenMuon requires the same DTensor parameters on every rank of a mesh; parameter count "
    "differs across ranks (min {a}, max {b})"
)
DUPLICATES = (
    "GefenMuon requires unique parameter names on a DTensor mesh; some rank has parameters "
    "sharing a name, shape, and dtype. Give every parameter a unique name."
)
ORDER = (
    "GefenMuon requires identical parameter-group order on every rank of a DTensor mesh; "
    "parameters at rank-divergent positions: {names}"
)
PRESENCE = (
    "GefenMuon requires identical gradient presence on every rank of a DTensor mesh; "
    "mismatched parameters: {names}"
)
VOTED_PRESENCE = (
    "GefenMuon step preflight: gradient presence differs across the process-group members "
    "(every member must present the same; nothing was changed)"
)
STALE_REPLICA = (
    "GefenMuon load validation: replicated state differs across the process-group members "
    "(every member must present the same; nothing was changed)"
)
UNVERIFIABLE = "cannot verify cross-rank parameter order"

# --- helpers that run inside the spawned ranks ------------------------------------------------


def _model(widths: tuple[int, ...] = (8, 16, 4), *, shard: bool = True, seed: int = 0) -> Any:
    """Bias-free ``Linear`` layers (every parameter 2-D), each layer then the model sharded."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(pairwise(widths)):
        if index > 0:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(fan_in, fan_out, bias=False))
    model = nn.Sequential(*layers)
    if shard:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=_mesh())
        fully_shard(model, mesh=_mesh())
    return model


def _muon(params: Any, mode: str = "exact", **options: Any) -> Any:
    from gefen.muon import GefenMuon

    options.setdefault("lr", 0.02)
    return GefenMuon(params, ns_steps=1, fused=False, sharded_mode=mode, normuon=False, **options)


def _backward(model: Any, rank: int, seed: int) -> None:
    """One forward/backward on a rank-dependent batch (collective under FSDP2)."""
    fan_in = next(layer for layer in model if isinstance(layer, nn.Linear)).in_features
    batch = torch.randn(6, fan_in, generator=torch.Generator().manual_seed(seed * 10 + rank))
    model(batch).square().mean().backward()


def _assign(model: Any, seed: int, zero_rows: Callable[[int], slice] | None = None) -> None:
    """``p.grad = distribute_tensor(g, mesh, [Shard(0)])`` on every rank (collective).

    ``zero_rows(rows)`` zeroes those rows of every full gradient before it is distributed.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    for index, param in enumerate(model.parameters()):
        generator = torch.Generator().manual_seed(seed * 100 + index)
        full = torch.randn(tuple(param.shape), generator=generator)
        if zero_rows is not None:
            full[zero_rows(full.shape[0])] = 0.0
        param.grad = distribute_tensor(full, param.device_mesh, [Shard(0)])


def _capture(optimizer: Any) -> dict[str, Any]:
    """A deep snapshot plus clones of the local shards, codebook and global step."""
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot

    with torch.no_grad():
        shards = [
            (
                _local(param).detach().clone(),
                None if param.grad is None else _local(param.grad).detach().clone(),
            )
            for param in _params(optimizer)
        ]
        codebook = optimizer.codebook
        return {
            "snapshot": deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES),
            "shards": shards,
            "codebook": None if codebook is None else codebook.detach().clone(),
            "global_step": optimizer.global_step,
        }


def _changes(optimizer: Any, before: dict[str, Any]) -> list[str]:
    """Every difference from ``before`` (empty: nothing was mutated)."""
    from gefen.dist.testing import snapshot_diff

    after = _capture(optimizer)
    changes = snapshot_diff(before["snapshot"], after["snapshot"])
    if len(after["shards"]) != len(before["shards"]):
        changes.append("number of parameters differs")
    for index, (old, new) in enumerate(zip(before["shards"], after["shards"], strict=False)):
        if not _same(old[0], new[0]):
            changes.append(f"local parameter shard {index} differs")
        if not _same(old[1], new[1]):
            changes.append(f"local gradient shard {index} differs")
    if not _same(before["codebook"], after["codebook"]):
        changes.append("codebook differs")
    if before["global_step"] != after["global_step"]:
        changes.append("global_step differs")
    return changes


def _steps_together(optimizer: Any, model: Any, seed: int) -> dict[str, Any]:
    """Fresh gradients on every rank, then one step; reports whether local shards moved."""
    _assign(model, seed)
    before = [_local(param).detach().clone() for param in _params(optimizer)]
    optimizer.step()
    after = [_local(param).detach() for param in _params(optimizer)]
    moved = [not torch.equal(a, b) for a, b in zip(before, after, strict=True) if a.numel() > 0]
    return {"global_step": optimizer.global_step, "moved": bool(moved) and all(moved)}


def _rejected_step(
    optimizer: Any, model: Any, fn: Callable[[], Any], *, recover: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Snapshot, attempt ``fn`` (timed), diff, optionally repair, then step together."""
    before = _capture(optimizer)
    result = _attempt(fn)
    result["changes"] = _changes(optimizer, before)
    result["step_before"] = before["global_step"]
    if recover is not None:
        recover()
    result["after"] = _steps_together(optimizer, model, seed=90)
    return result


# --- scenarios -----------------------------------------------------------------------------------


def scenario_closure_failure(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    model = _model()
    optimizer = _muon(model.named_parameters(), mode)
    _backward(model, rank, seed=0)
    optimizer.step()  # a later step: state and codebook exist
    optimizer.zero_grad()
    _backward(model, rank, seed=1)
    scope = len(optimizer.step_failure_scope())

    def closure() -> float:
        if rank == 0:
            raise RuntimeError(CLOSURE_TEXT)
        return 0.0

    result = _rejected_step(optimizer, model, lambda: optimizer.step(closure))
    result["scope"] = scope
    return result


def scenario_amp(rank: int, world_size: int, case: str) -> dict[str, Any]:
    model = _model()
    optimizer = _muon(model.named_parameters())
    _assign(model, seed=0)
    optimizer.step()
    _assign(model, seed=1)
    scale = 8.0 if case != "grad_scale" or rank == 0 else 4.0
    found_inf = {"found_inf": float(rank == 0), "overflow": 1.0}.get(case, 0.0)
    if case != "presence" or rank == 0:
        # What GradScaler.step sets on an optimizer with _step_supports_amp_scaling.
        optimizer.grad_scale = torch.full((1,), scale)
        optimizer.found_inf = torch.full((1,), found_inf)
    fired: list[int] = []
    optimizer.register_step_post_hook(lambda *args: fired.append(1))
    supports = bool(optimizer._step_supports_amp_scaling)
    before = _capture(optimizer)
    result = _attempt(lambda: optimizer.step(lambda: 3.5))
    result["changes"] = _changes(optimizer, before)
    result["left"] = {
        name: float(getattr(optimizer, name).item())
        for name in ("found_inf", "grad_scale")
        if name in optimizer.__dict__
    }
    result["post_hooks"] = len(fired)
    result["supports_amp"] = supports
    for name in ("found_inf", "grad_scale"):  # GradScaler deletes them after its step
        optimizer.__dict__.pop(name, None)
    result["after"] = _steps_together(optimizer, model, seed=90)
    return result


def scenario_presence(
    rank: int, world_size: int, later: bool, mode: str = "exact", amp: bool = False
) -> dict[str, Any]:
    model = _model()
    optimizer = _muon(model.named_parameters(), mode)
    if later:
        _backward(model, rank, seed=0)
        optimizer.step()
    _assign(model, seed=1)
    if rank == 1:
        model[2].weight.grad = None
    if amp:  # agreeing controls: the presence check (phase 2) runs before any unscale
        optimizer.grad_scale = torch.full((1,), 8.0)
        optimizer.found_inf = torch.full((1,), 0.0)

    def recover() -> None:
        for name in ("found_inf", "grad_scale"):
            optimizer.__dict__.pop(name, None)

    left: dict[str, float] = {}

    def attempt() -> Any:
        try:
            return optimizer.step()
        finally:
            left.update(
                (name, float(getattr(optimizer, name).item()))
                for name in ("found_inf", "grad_scale")
                if name in optimizer.__dict__
            )

    result = _rejected_step(optimizer, model, attempt, recover=recover)
    result["left"] = left
    return result


def scenario_reversed(rank: int, world_size: int, drop_grad: bool) -> dict[str, Any]:
    model = _model()
    named = list(model.named_parameters())
    optimizer = _muon(named if rank == 0 else named[::-1])
    _assign(model, seed=1)
    if drop_grad and rank == 0:
        model[2].weight.grad = None

    def recover() -> None:
        if rank == 1:  # restore the registration order rank 0 uses
            optimizer.param_groups[0]["params"].reverse()
            optimizer.param_groups[0]["param_names"].reverse()

    return _rejected_step(optimizer, model, optimizer.step, recover=recover)


def scenario_duplicate(rank: int, world_size: int) -> dict[str, Any]:
    model = _model((8, 8, 8))  # two (8, 8) parameters: same shape and dtype
    params = [param for _, param in model.named_parameters()]
    names = ["layer.weight", "layer.weight"] if rank == 0 else ["0.weight", "2.weight"]
    optimizer = _muon(list(zip(names, params, strict=True)))
    _assign(model, seed=1)

    def recover() -> None:
        optimizer.param_groups[0]["param_names"] = ["0.weight", "2.weight"]

    return _rejected_step(optimizer, model, optimizer.step, recover=recover)


def scenario_counts(rank: int, world_size: int) -> dict[str, Any]:
    model = _model()
    named = list(model.named_parameters())
    optimizer = _muon(named if rank == 0 else named[:1])  # rank 1 registers one fewer
    _assign(model, seed=1)

    def recover() -> None:
        if rank == 1:
            optimizer.add_param_group({"params": named[1:]})

    return _rejected_step(optimizer, model, optimizer.step, recover=recover)


def scenario_synthesized(rank: int, world_size: int) -> dict[str, Any]:
    model = _model((8, 8, 8))
    optimizer = _muon(model.parameters())  # unnamed: param_groups[0][0], param_groups[0][1]
    outcomes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (1, 2):
            _assign(model, seed)
            outcomes.append(_attempt(optimizer.step))
    return {
        "errors": [outcome["error"] for outcome in outcomes],
        "elapsed": max(outcome["elapsed"] for outcome in outcomes),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "global_step": optimizer.global_step,
    }


def scenario_approx_empty(rank: int, world_size: int, case: str) -> dict[str, Any]:
    """The empty-histogram decision of a first approx step is agreed over the failure scope."""
    widths = (8, 1) if case.startswith("empty_shard") else (8, 16, 4)
    model = _model(widths)  # (8, 1): one (1, 8) parameter, rank 1's shard is (0, 8)
    optimizer = _muon(model.named_parameters(), "approx")
    if case == "empty_shard_zero":
        _assign(model, seed=1, zero_rows=lambda rows: slice(0, rows))  # zero everywhere
    elif case == "zero_rank1":
        _assign(model, seed=1, zero_rows=lambda rows: slice(rows // 2, rows))  # rank 1's rows
    else:
        _assign(model, seed=1)
    shard_numels = [_local(param).numel() for param in _params(optimizer)]
    local_nonzero = any(bool(_local(p.grad).count_nonzero() > 0) for p in _params(optimizer))
    before = _capture(optimizer)
    first = _attempt(optimizer.step)
    return {
        "error": first["error"],
        "elapsed": first["elapsed"],
        "shard_numels": shard_numels,
        "local_nonzero": local_nonzero,
        "changes": _changes(optimizer, before),
        "global_step": optimizer.global_step,
        "codebook": optimizer.codebook is not None,
        "state_keys": [sorted(optimizer.state[p]) for p in _params(optimizer)],
        "after": _steps_together(optimizer, model, seed=90),
    }


def scenario_load_rejection(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    model = _model()
    optimizer = _muon(model.named_parameters(), mode)
    _backward(model, rank, seed=0)
    optimizer.step()
    sd = optimizer.state_dict()  # collective in "distributed" (consolidation)
    good = copy.deepcopy(sd)
    if rank == 1:
        sd["gefen"]["colour"] = "red"
        for group in sd["param_groups"]:
            group["gefen"]["colour"] = "red"
    fired: list[int] = []
    optimizer.register_load_state_dict_post_hook(lambda opt: fired.append(1))
    before = _capture(optimizer)
    result = _attempt(lambda: optimizer.load_state_dict(sd))
    result["changes"] = _changes(optimizer, before)
    result["post_hooks"] = len(fired)
    optimizer.load_state_dict(good)  # the valid file loads on every rank
    result["post_hooks_after_good_load"] = len(fired)
    result["after"] = _steps_together(optimizer, model, seed=90)
    return result


def scenario_stale_replica(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """Rank 1 loads the file of one step earlier: exact/distributed state is a replica."""
    model = _model()
    optimizer = _muon(model.named_parameters(), mode)
    _backward(model, rank, seed=0)
    optimizer.step()
    stale = copy.deepcopy(optimizer.state_dict())  # collective in "distributed"
    _backward(model, rank, seed=1)
    optimizer.step()
    fresh = copy.deepcopy(optimizer.state_dict())
    before = _capture(optimizer)
    result = _attempt(lambda: optimizer.load_state_dict(stale if rank == 1 else fresh))
    result["changes"] = _changes(optimizer, before)
    optimizer.load_state_dict(fresh)  # the same file everywhere loads
    result["after"] = _steps_together(optimizer, model, seed=90)
    return result


_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "barrier",
)


def scenario_plain(rank: int, world_size: int) -> dict[str, Any]:
    """A non-sharded optimizer in the initialised world enters no collective."""
    import torch.distributed as dist

    model = _model(shard=False)
    optimizer = _muon(model.named_parameters())
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def refusing(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"torch.distributed.{name} must not be called")

        return refuse

    errors: list[str] = []
    steps: list[int] = []
    for name in _COLLECTIVES:
        setattr(dist, name, refusing(name))
    try:
        for seed in (0, 1):
            optimizer.zero_grad()
            _backward(model, rank, seed)
            outcome = _attempt(optimizer.step)
            errors.append(outcome["error"])
            steps.append(optimizer.global_step)
        loaded = _attempt(lambda: optimizer.load_state_dict(optimizer.state_dict()))
        errors.append(loaded["error"])
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    restored = all(getattr(dist, name) is originals[name] for name in _COLLECTIVES)
    return {
        "initialized": bool(dist.is_initialized()),
        "scope": len(optimizer.step_failure_scope()),
        "supports_amp": bool(optimizer._step_supports_amp_scaling),
        "calls": calls,
        "errors": errors,
        "steps": steps,
        "restored": restored,
    }


SCENARIOS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("closure_exact", scenario_closure_failure, ("exact",)),
    ("closure_distributed", scenario_closure_failure, ("distributed",)),
    ("closure_approx", scenario_closure_failure, ("approx",)),
    ("amp_found_inf", scenario_amp, ("found_inf",)),
    ("amp_presence", scenario_amp, ("presence",)),
    ("amp_grad_scale", scenario_amp, ("grad_scale",)),
    ("amp_overflow", scenario_amp, ("overflow",)),
    ("presence_first", scenario_presence, (False,)),
    ("presence_later", scenario_presence, (True,)),
    ("presence_distributed", scenario_presence, (True, "distributed")),
    ("presence_amp", scenario_presence, (True, "exact", True)),
    ("presence_approx", scenario_presence, (True, "approx")),
    ("reversed", scenario_reversed, (False,)),
    ("reversed_presence", scenario_reversed, (True,)),
    ("duplicate", scenario_duplicate, ()),
    ("counts", scenario_counts, ()),
    ("synthesized", scenario_synthesized, ()),
    ("approx_empty_shard", scenario_approx_empty, ("empty_shard",)),
    ("approx_empty_shard_zero", scenario_approx_empty, ("empty_shard_zero",)),
    ("approx_zero_rank1", scenario_approx_empty, ("zero_rank1",)),
    ("load_exact", scenario_load_rejection, ("exact",)),
    ("load_distributed", scenario_load_rejection, ("distributed",)),
    ("load_approx", scenario_load_rejection, ("approx",)),
    ("stale_exact", scenario_stale_replica, ("exact",)),
    ("stale_distributed", scenario_stale_replica, ("distributed",)),
    ("plain", scenario_plain, ()),
]


# --- the parent's assertions ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rank_deadline_s=WORLD_DEADLINE_S, pg_timeout_s=PG_TIMEOUT_S)


def _unchanged_and_trains(results: list[dict[str, Any]]) -> None:
    """Nothing mutated on any rank, within the bound; then one more step on every rank."""
    assert len(results) == 2
    for result in results:
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        assert result["after"] == {"global_step": result["step_before"] + 1, "moved": True}


def _agreement_error(world: ScenarioWorld, name: str, message: str, what: str) -> None:
    results = world[name]
    for result in results:
        assert result["error"] == f"GroupAgreementError: {message}"
        assert result["what"] == what
    _unchanged_and_trains(results)


class TestGlooWorld2:
    pytestmark: ClassVar[list[Any]] = [pytest.mark.multirank, gloo_required()]

    @pytest.mark.parametrize(
        "mode", [pytest.param("exact", marks=pytest.mark.smoke), "distributed", "approx"]
    )
    def test_rank_zero_closure_failure_is_voted(self, world: ScenarioWorld, mode: str) -> None:
        first, second = world[f"closure_{mode}"]
        assert first["error"] == f"DistributedStepError: {PREFLIGHT_LOCAL}"
        assert first["cause"] == f"RuntimeError: {CLOSURE_TEXT}"
        assert (first["phase"], first["local_failure"], first["rank"]) == (
            "step preflight",
            True,
            0,
        )
        assert second["error"] == f"DistributedStepError: {PREFLIGHT_OTHER}"
        assert second["cause"] is None
        assert (second["phase"], second["local_failure"], second["rank"]) == (
            "step preflight",
            False,
            None,
        )
        for result in (first, second):
            assert result["scope"] == 1  # approx's mesh is in the failure scope too
            assert result["step_before"] == 1
        _unchanged_and_trains([first, second])

    @pytest.mark.parametrize(
        ("case", "message", "what"),
        [
            pytest.param("found_inf", AMP_FOUND_INF, "AMP found_inf", marks=pytest.mark.smoke),
            ("presence", AMP_PRESENCE, "AMP protocol presence"),
            ("grad_scale", AMP_GRAD_SCALE, "AMP grad_scale"),
        ],
    )
    def test_divergent_amp_controls_fail_every_rank(
        self, world: ScenarioWorld, case: str, message: str, what: str
    ) -> None:
        results = world[f"amp_{case}"]
        for result in results:
            assert result["supports_amp"] is True
            assert result["error"] == f"GroupAgreementError: {message}"
            assert result["what"] == what
            assert result["elapsed"] < DEADLINE_S
            assert result["changes"] == []  # gradients not unscaled either
            assert result["left"] == {}  # the shell drops the controls when step raises
            assert result["post_hooks"] == 0
            assert result["after"] == {"global_step": 2, "moved": True}

    def test_group_wide_amp_overflow_skips_on_every_rank(self, world: ScenarioWorld) -> None:
        for result in world["amp_overflow"]:
            assert result["error"] is None
            assert result["value"] == 3.5  # the closure's loss is still returned
            assert result["elapsed"] < DEADLINE_S
            assert result["changes"] == []  # no state, no parameter, gradients not unscaled
            assert result["left"] == {"found_inf": 1.0, "grad_scale": 8.0}  # never touched
            assert result["post_hooks"] == 1
            assert result["after"] == {"global_step": 2, "moved": True}

    @pytest.mark.parametrize("when", ["first", pytest.param("later", marks=pytest.mark.smoke)])
    def test_gradient_presence_mismatch(self, world: ScenarioWorld, when: str) -> None:
        message = PRESENCE.format(names="2.weight")
        _agreement_error(world, f"presence_{when}", message, "gradient presence")
        for result in world[f"presence_{when}"]:
            assert result["step_before"] == (0 if when == "first" else 1)
            assert result["left"] == {}

    def test_gradient_presence_mismatch_in_distributed_mode(self, world: ScenarioWorld) -> None:
        message = PRESENCE.format(names="2.weight")
        _agreement_error(world, "presence_distributed", message, "gradient presence")

    def test_gradient_presence_mismatch_in_approx_mode_fails_every_rank(
        self, world: ScenarioWorld
    ) -> None:
        # approx has no presence/order collective of its own: the step vote compares the
        # presence pattern in its all-reduce (it used to skip the shard on one rank silently).
        # The vote used to name no parameter.
        named = f"{VOTED_PRESENCE}; parameters with a gradient on some members only: '2.weight'"
        _agreement_error(world, "presence_approx", named, "gradient presence")

    def test_presence_mismatch_fails_before_amp_unscales(self, world: ScenarioWorld) -> None:
        message = PRESENCE.format(names="2.weight")
        _agreement_error(world, "presence_amp", message, "gradient presence")
        for result in world["presence_amp"]:
            # Raised in phase 2, before phase 3 read the controls: gradients are not unscaled
            # (no changes), and GradScaler's attributes are deleted, as after any failed step:
            # left behind, the next scaler.step multiplied its scale into the stale one and the
            # retry unscaled by the scale squared (a successful step deletes them too).
            assert result["left"] == {}

    @pytest.mark.parametrize("name", ["reversed", "reversed_presence"])
    def test_reversed_registration_order_names_both(self, world: ScenarioWorld, name: str) -> None:
        message = ORDER.format(names="0.weight, 2.weight")
        _agreement_error(world, name, message, "parameter order")

    def test_duplicate_name_on_one_rank_fails_every_rank(self, world: ScenarioWorld) -> None:
        _agreement_error(world, "duplicate", DUPLICATES, "unique parameter names")

    def test_differing_parameter_counts_fail_without_hanging(self, world: ScenarioWorld) -> None:
        _agreement_error(world, "counts", COUNT.format(a=1, b=2), "parameter count")

    def test_same_shape_synthesized_names_warn_once(self, world: ScenarioWorld) -> None:
        for result in world["synthesized"]:
            assert result["errors"] == [None, None]
            assert result["elapsed"] < DEADLINE_S
            assert len(result["warnings"]) == 1
            assert UNVERIFIABLE in result["warnings"][0]
            assert result["global_step"] == 2

    def test_approx_empty_shard_rank_learns_with_its_peer(self, world: ScenarioWorld) -> None:
        first, second = world["approx_empty_shard"]
        assert first["shard_numels"] == [8]
        assert second["shard_numels"] == [0]
        assert (first["local_nonzero"], second["local_nonzero"]) == (True, False)
        for result in (first, second):
            assert result["error"] is None
            assert result["elapsed"] < DEADLINE_S
            assert result["global_step"] == 1
            assert result["codebook"] is True
            assert result["after"]["global_step"] == 2
        assert first["state_keys"] == [
            ["matrix_cols", "momentum_codes", "momentum_scale", "period", "step"]
        ]
        assert second["state_keys"] == [["period"]]  # an empty shard gets no state
        assert first["after"]["moved"] is True

    def test_approx_all_zero_first_step_noops_on_every_rank(self, world: ScenarioWorld) -> None:
        for result in world["approx_empty_shard_zero"]:
            assert result["error"] is None
            assert result["elapsed"] < DEADLINE_S
            assert result["local_nonzero"] is False
            assert result["changes"] == []
            assert result["global_step"] == 0
            assert result["codebook"] is False
            assert result["after"]["global_step"] == 1  # then both learn together

    def test_approx_zero_shards_on_one_rank_learn_together(self, world: ScenarioWorld) -> None:
        first, second = world["approx_zero_rank1"]
        assert (first["local_nonzero"], second["local_nonzero"]) == (True, False)
        for result in (first, second):
            assert result["error"] is None
            assert result["elapsed"] < DEADLINE_S
            assert result["global_step"] == 1
            assert result["codebook"] is True
            assert result["after"] == {"global_step": 2, "moved": True}

    @pytest.mark.parametrize("mode", ["exact", "distributed", "approx"])
    def test_load_rejected_on_one_rank_commits_nowhere(
        self, world: ScenarioWorld, mode: str
    ) -> None:
        first, second = world[f"load_{mode}"]
        assert first["error"] == f"DistributedStepError: {LOAD_OTHER}"
        assert first["cause"] is None
        assert second["error"] == f"DistributedStepError: {LOAD_LOCAL}{LOAD_CAUSE}"
        assert second["cause"] == f"ValueError: {LOAD_CAUSE}"
        for result in (first, second):
            assert result["phase"] == "load validation"
            assert result["elapsed"] < DEADLINE_S
            assert result["changes"] == []
            assert result["post_hooks"] == 0
            assert result["post_hooks_after_good_load"] == 1
            assert result["after"] == {"global_step": 2, "moved": True}

    @pytest.mark.parametrize("mode", ["exact", "distributed"])
    def test_a_stale_file_on_one_rank_fails_every_rank(
        self, world: ScenarioWorld, mode: str
    ) -> None:
        # It used to load: the replicas then diverged silently.
        for result in world[f"stale_{mode}"]:
            assert result["error"] == f"GroupAgreementError: {STALE_REPLICA}"
            assert result["what"] == "replicated state"
            assert result["elapsed"] < DEADLINE_S
            assert result["changes"] == []
            assert result["after"] == {"global_step": 3, "moved": True}

    def test_plain_optimizer_enters_no_collective(self, world: ScenarioWorld) -> None:
        for result in world["plain"]:
            assert result["initialized"] is True
            assert result["scope"] == 0
            assert result["supports_amp"] is False
            assert result["calls"] == []
            assert result["errors"] == [None, None, None]
            assert result["steps"] == [1, 2]
            assert result["restored"] is True
