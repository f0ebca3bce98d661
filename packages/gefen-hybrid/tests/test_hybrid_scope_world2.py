"""GefenMuonHybrid under an explicit codebook scope on a real 2-rank Gloo world (docs/hybrid.md §6;
docs/dist.md §9.3, §12).

The hybrid routes two matrices to its Muon child and a matrix and a vector to its Gefen backup.
``post_sharding`` replaces every parameter by a REPLICATED copy and installs one
``CodebookProcessGroupBinding`` over ``dist.group.WORLD`` in both children. The scenarios check
that both children learn the one-process oracle's codebook on both ranks, that composite headers
that differ (after a one-rank reload of another run) fail identically on both ranks naming the
differing word with the composite owner, and that a closure clearing the children's binding on
rank 0 fails the voted preflight before any header. Every rejection is timed, compared with a
deep snapshot of both children, and followed by a step both ranks take together.

All scenarios share one spawned world; scenario functions are module-level and return plain
data only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.core.testing import attempt, snapshot_changes
from gefen.core.testing import oracle_codebook as _oracle
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios

pytestmark = [pytest.mark.multirank, gloo_required()]

DEADLINE_S = 10.0
PG_TIMEOUT_S = 30.0
WORLD_DEADLINE_S = 600.0
MEMBERS = ("rank:0", "rank:1")
SHAPES = {
    "hidden.0.weight": (8, 6),
    "hidden.1.weight": (6, 8),
    "head.weight": (4, 6),
    "norm.bias": (6,),
}
MUON_NAMES = ("hidden.0.weight", "hidden.1.weight")
BACKUP_NAMES = ("head.weight", "norm.bias")
OWNER = "GefenMuonHybrid"
OTHER = f"{OWNER} step preflight failed on another process-group member"

# --- data shared by the ranks and the one-process oracle -------------------------------------


def _grads(seed: int, muon_seed: int | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, a pure function of the seeds (Muon's may differ)."""
    grads = {}
    for index, (name, shape) in enumerate(SHAPES.items()):
        base = muon_seed if muon_seed is not None and name in MUON_NAMES else seed
        generator = torch.Generator().manual_seed(base * 100 + index)
        grads[name] = torch.randn(shape, generator=generator)
    return grads


# --- helpers that run inside the spawned ranks --------------------------------------------


class ScopedHybrid:
    """A hybrid of this rank whose parameters were replaced by REPLICATED copies."""

    def __init__(self, rank: int, muon_names: tuple[str, ...] = MUON_NAMES) -> None:
        import torch.distributed as dist

        from gefen.contracts import (
            LogicalSlice,
            ParameterIdentity,
            ParameterLayout,
            PlacementKind,
            ProcessGroupIdentity,
            ShardIdentity,
            ShardingManifest,
            ShardPlacement,
        )
        from gefen.core import ParameterRebinding
        from gefen.dist import CodebookProcessGroupBinding
        from gefen.hybrid import GefenMuonHybrid

        torch.manual_seed(0)
        names = (*muon_names, *BACKUP_NAMES)
        originals = {name: torch.nn.Parameter(torch.randn(SHAPES[name])) for name in names}
        self.hybrid = GefenMuonHybrid(
            [(name, originals[name]) for name in muon_names],
            [(name, originals[name]) for name in BACKUP_NAMES],
            lr=0.01,
            ns_steps=1,
            fused=False,
        )
        identity = ProcessGroupIdentity("dp", MEMBERS)
        member = f"rank:{rank}"
        self.binding = CodebookProcessGroupBinding(identity, member, dist.group.WORLD, "cpu")
        shards: dict[str, list[Any]] = {}
        for name in names:
            shape = SHAPES[name]
            parameter = ParameterIdentity(name, shape)
            numel = int(torch.Size(shape).numel())
            shards[name] = [
                ShardIdentity(
                    parameter,
                    ParameterLayout.REPLICATED,
                    LogicalSlice(0, numel),
                    (ShardPlacement("dp", PlacementKind.REPLICATE, coordinate, 2),),
                    identity,
                    MEMBERS[coordinate],
                )
                for coordinate in range(2)
            ]
        manifest = ShardingManifest(tuple(shard for pair in shards.values() for shard in pair))
        self.targets = {
            name: torch.nn.Parameter(param.detach().clone()) for name, param in originals.items()
        }
        rebindings = [
            ParameterRebinding(originals[name], self.targets[name], shards[name][rank])
            for name in names
        ]
        self.hybrid.post_sharding(
            rebindings, manifest=manifest, codebook_process_group=self.binding
        )

    def set_grads(self, seed: int, muon_seed: int | None = None) -> None:
        for name, grad in _grads(seed, muon_seed).items():
            if name in self.targets:
                self.targets[name].grad = grad

    def train(self, seeds: range, muon_offset: int = 0) -> None:
        for seed in seeds:
            self.set_grads(seed, seed + muon_offset if muon_offset else None)
            self.hybrid.step()

    def codebooks(self) -> dict[str, Any]:
        result = {}
        for role in ("muon", "backup"):
            child = getattr(self.hybrid, role)
            if child is None:
                result[role] = None
                continue
            codebook = child.codebook
            result[role] = None if codebook is None else codebook.tolist()
        return result


def _snapshot(hybrid: Any) -> Any:
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot

    attributes = (*SNAPSHOT_ATTRIBUTES, "_binding", "_finalized")
    return deep_snapshot(
        hybrid,
        attributes=("_commit_failed",),
        children={"muon": attributes, "backup": attributes},
    )


def _changes(hybrid: Any, before: Any) -> list[str]:
    return snapshot_changes(hybrid, before, _snapshot)


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    return attempt(fn, attributes=("local_failure",), value=False)


def _steps(scoped: ScopedHybrid, seed: int = 90) -> dict[str, Any]:
    scoped.set_grads(seed)
    before = {name: target.detach().clone() for name, target in scoped.targets.items()}
    scoped.hybrid.step()
    moved = all(not torch.equal(before[name], t.detach()) for name, t in scoped.targets.items())
    steps = [scoped.hybrid.muon.global_step, scoped.hybrid.backup.global_step]
    return {"global_steps": steps, "moved": moved, "codebooks": scoped.codebooks()}


_HEADER_PATCH: list[Any] = []


def _record_headers() -> list[tuple[int, int]]:
    """Patch ``GuardedOperation.header`` (this process only): (op code, payload words)."""
    from gefen.dist.guarded import GuardedOperation

    calls: list[tuple[int, int]] = []
    original = GuardedOperation.header

    def recording(self: Any, op_code: int, payload: Any, names: Any) -> None:
        calls.append((op_code, len(list(payload))))
        return original(self, op_code, payload, names)

    GuardedOperation.header = recording  # type: ignore[method-assign]
    _HEADER_PATCH.append(original)
    return calls


def _restore_headers() -> None:
    from gefen.dist.guarded import GuardedOperation

    while _HEADER_PATCH:
        GuardedOperation.header = _HEADER_PATCH.pop()  # type: ignore[method-assign]


# --- scenarios ---------------------------------------------------------------------------


def scenario_learn(rank: int, world_size: int) -> dict[str, Any]:
    scoped = ScopedHybrid(rank)
    hybrid = scoped.hybrid
    binding = scoped.binding
    installed = {
        "same_object": hybrid.muon._binding is binding and hybrid.backup._binding is binding,
        "finalized": hybrid.finalized,
        "muon_fqns": [n for g in hybrid.muon.param_groups for n in g["param_names"]],
        "backup_fqns": [n for g in hybrid.backup.param_groups for n in g["param_names"]],
        "targets": all(
            any(p is scoped.targets[name] for g in hybrid.param_groups for p in g["params"])
            for name in SHAPES
        ),
    }
    scoped.set_grads(1)
    hybrid.step()
    return {"installed": installed, "codebooks": scoped.codebooks(), "after": _steps(scoped)}


def scenario_reload_header(rank: int, world_size: int, which: str) -> dict[str, Any]:
    """Rank 1 loads another run's checkpoint (same step) whose ``which`` child learned another
    codebook; the composite load fails at that child's load header on both ranks."""
    scoped = ScopedHybrid(rank)
    scoped.train(range(2))
    mine = copy.deepcopy(scoped.hybrid.state_dict())
    other = ScopedHybrid(rank)
    for seed in range(2):  # the same gradients, except for the ``which`` child
        other.set_grads(seed, seed + 50 if which == "muon" else None)
        if which == "backup":
            for name in BACKUP_NAMES:
                other.targets[name].grad = _grads(seed + 50)[name]
        other.hybrid.step()
    theirs = copy.deepcopy(other.hybrid.state_dict())
    before_load = scoped.codebooks()
    before = _snapshot(scoped.hybrid)
    headers = _record_headers()
    try:
        result = _attempt(
            lambda: scoped.hybrid.load_state_dict(copy.deepcopy(theirs if rank == 1 else mine))
        )
    finally:
        _restore_headers()
    result["changes"] = _changes(scoped.hybrid, before)
    result["headers"] = headers
    after_load = scoped.codebooks()
    result["loaded"] = {role: after_load[role] == before_load[role] for role in ("muon", "backup")}
    result["after"] = _steps(scoped)
    return result


def scenario_clear_binding(rank: int, world_size: int, which: str) -> dict[str, Any]:
    scoped = ScopedHybrid(rank)
    scoped.train(range(2))
    scoped.set_grads(3)
    hybrid = scoped.hybrid
    roles = ("muon", "backup") if which == "both" else (which,)

    def closure() -> float:
        if rank == 0:
            for role in roles:
                getattr(hybrid, role)._binding = None
        return 2.5

    before = _snapshot(hybrid)
    headers = _record_headers()
    try:
        result = _attempt(lambda: hybrid.step(closure))
    finally:
        _restore_headers()
    result["cleared_left"] = [getattr(hybrid, role)._binding is None for role in roles]
    for role in roles:
        getattr(hybrid, role)._binding = scoped.binding
    result["changes"] = _changes(hybrid, before)
    result["headers"] = headers
    result["after"] = _steps(scoped)
    return result


def scenario_child_presence(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's hybrid has no Muon child: the first composite header names child_presence."""
    scoped = ScopedHybrid(rank, MUON_NAMES if rank == 0 else ())
    scoped.set_grads(1)
    before = _snapshot(scoped.hybrid) if rank == 0 else None
    headers = _record_headers()
    try:
        result = _attempt(scoped.hybrid.step)
    finally:
        _restore_headers()
    result["headers"] = headers
    result["muon_present"] = scoped.hybrid.muon is not None
    result["changes"] = None if before is None else _changes(scoped.hybrid, before)
    return result


def scenario_steady_presence(rank: int, world_size: int, which: str) -> dict[str, Any]:
    """Rank 1 lacks one gradient of the ``which`` child at a step that learns nothing."""
    scoped = ScopedHybrid(rank)
    scoped.train(range(2))
    scoped.set_grads(3)
    if rank == 1:
        name = (MUON_NAMES if which == "muon" else BACKUP_NAMES)[0]
        scoped.targets[name].grad = None
    before = _snapshot(scoped.hybrid)
    headers = _record_headers()
    try:
        result = _attempt(scoped.hybrid.step)
    finally:
        _restore_headers()
    result["changes"] = _changes(scoped.hybrid, before)
    result["headers"] = headers
    result["after"] = _steps(scoped)
    return result


SCENARIOS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("learn", scenario_learn, ()),
    ("steady_presence_muon", scenario_steady_presence, ("muon",)),
    ("steady_presence_backup", scenario_steady_presence, ("backup",)),
    ("reload_muon", scenario_reload_header, ("muon",)),
    ("reload_backup", scenario_reload_header, ("backup",)),
    ("clear_both", scenario_clear_binding, ("both",)),
    ("clear_muon", scenario_clear_binding, ("muon",)),
    ("child_presence", scenario_child_presence, ()),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rank_deadline_s=WORLD_DEADLINE_S, pg_timeout_s=PG_TIMEOUT_S)


# --- the tests -------------------------------------------------------------------------------


def _same_after(results: list[dict[str, Any]], steps: int) -> None:
    first, second = (result["after"] for result in results)
    assert first["global_steps"] == second["global_steps"] == [steps, steps]
    assert first["moved"] is second["moved"] is True
    assert first["codebooks"] == second["codebooks"]
    assert None not in first["codebooks"].values()


@pytest.mark.smoke
def test_post_sharding_installs_one_binding_and_both_children_learn_the_oracle(
    world: ScenarioWorld,
) -> None:
    grads = _grads(1)
    expected = {
        "muon": _oracle([grads[name] for name in MUON_NAMES]),
        "backup": _oracle([grads[name] for name in BACKUP_NAMES]),
    }
    assert expected["muon"] != expected["backup"]
    results = world["learn"]
    for result in results:
        assert result["installed"] == {
            "same_object": True,
            "finalized": True,
            "muon_fqns": list(MUON_NAMES),
            "backup_fqns": list(BACKUP_NAMES),
            "targets": True,
        }
        assert result["codebooks"] == expected
    _same_after(results, 2)


@pytest.mark.parametrize(("which", "entered"), [("muon", 2), ("backup", 3)])
def test_a_one_rank_reload_of_another_run_is_refused_at_the_childs_load_header(
    world: ScenarioWorld, which: str, entered: int
) -> None:
    """The load exchanges the child-presence header and then one load header per child (op 4),
    as a step does: the child whose codebook differs fails both ranks, nothing published."""
    results = world[f"reload_{which}"]
    for result in results:
        assert result["loaded"] == {"muon": True, "backup": True}  # nothing published
        assert result["error"] == (
            f"GroupAgreementError: {OWNER} operation header differs across process-group "
            "members: codebook_fingerprint, replicated_state"
        )
        assert result["headers"] == [(4, 1), (4, 21), (4, 21)][:entered]
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
    _same_after(results, 3)


@pytest.mark.parametrize(
    ("which", "cause"),
    [
        pytest.param(
            "both",
            f"{OWNER} process-group binding changed during the step preflight",
            marks=pytest.mark.smoke,
        ),
        ("muon", f"{OWNER} children carry different codebook bindings"),
    ],
)
def test_closure_clearing_the_children_binding_on_rank_zero_fails_the_voted_preflight(
    world: ScenarioWorld, which: str, cause: str
) -> None:
    first, second = results = world[f"clear_{which}"]
    assert first["error"] == (
        f"DistributedStepError: {OWNER} step preflight failed on local rank 0: {cause}"
    )
    assert first["cause"] == f"RuntimeError: {cause}"
    assert second["error"] == f"DistributedStepError: {OTHER}"
    assert (first["local_failure"], second["local_failure"]) == (True, False)
    assert all(first["cleared_left"])
    assert not any(second["cleared_left"])
    for result in results:
        assert result["headers"] == []  # nobody reached the child-presence header
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
    _same_after(results, 3)


def test_child_presence_differing_fails_identically_at_the_first_header(
    world: ScenarioWorld,
) -> None:
    results = world["child_presence"]
    assert [r["muon_present"] for r in results] == [True, False]
    expected = (
        "GroupAgreementError: GefenMuonHybrid operation header differs across process-group "
        "members: child_presence"
    )
    for result in results:
        assert result["error"] == expected
        assert result["elapsed"] < DEADLINE_S
        # Only the mask header was exchanged: no child header, no learning, no commit.
        assert result["headers"] == [(3, 1)]
    assert results[0]["changes"] == []


@pytest.mark.parametrize("which", ["muon", "backup"])
def test_a_gradient_missing_on_one_rank_fails_that_childs_header_on_both_ranks(
    world: ScenarioWorld, which: str
) -> None:
    """The child headers carry each child's presence words, so a step that learns nothing still
    fails on every rank, at the header of the child that lacks the gradient, before any write."""
    results = world[f"steady_presence_{which}"]
    expected = (
        f"GroupAgreementError: {OWNER} operation header differs across process-group members: "
        "gradient_presence"
    )
    for result in results:
        assert result["error"] == expected
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        # The mask header, then the child headers up to the one that differs.
        assert result["headers"] == [(3, 1), (3, 21)] + ([(3, 21)] if which == "backup" else [])
    _same_after(results, 3)
