"""The explicit codebook scope on a real 2-rank Gloo world (docs/dist.md §9, §12; docs/core.md §13).

Every scenario builds plain tensors, tells the optimizer what they have become with
``post_sharding`` and a ``CodebookProcessGroupBinding`` over ``dist.group.WORLD`` (identity
``"dp"`` with members ``("rank:0", "rank:1")``), then makes one rank diverge. Each rejected
operation is timed, both ranks' messages are compared exactly, a deep snapshot proves nothing
changed (parameters, gradients, state, codebook, step, latch, binding, finalized layout) and the
scenario then retries or trains on every rank.

Codebooks are compared with a one-process oracle computed here, in the test process: the
histogram over the same logical shard slices, each with the period ``select_period`` picks from
that slice, the §9.6 contribution rules applied by hand, and ``solve_codebook``.

All scenarios share one spawned world (process start-up dominates on this machine). Scenario
functions are module-level so the children load them by reference; they catch the operations
under test themselves and return plain data only, so a rank never strands its peer.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.core.testing import attempt, snapshot_changes
from gefen.core.testing import finalized_snapshot as _snapshot
from gefen.core.testing import oracle_codebook as _oracle
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios

pytestmark = [pytest.mark.multirank, gloo_required()]

DEADLINE_S = 10.0  # docs/dist.md §11: a failing operation < 10 s
PG_TIMEOUT_S = 30.0
WORLD_DEADLINE_S = 600.0
SHAPE = (8, 6)
NUMEL = 48
MEMBERS = ("rank:0", "rank:1")
INJECTED = "injected failure"
OTHER = "failed on another process-group member"
LAYOUT_CHANGED = "parameter layout changed after post_sharding"
SWAPPED = "process-group binding changed during the step preflight"
NO_CODEBOOK = "refresh_codebook: no codebook has been learned"
CHECKPOINT_BINDING = (
    "checkpoint_binding does not match the installed codebook binding (same identity, member, "
    "device and process-group handle object required)"
)

# --- data shared by the ranks and the one-process oracle -------------------------------------


def _grad(seed: int) -> torch.Tensor:
    """A full (8, 6) gradient, a pure function of ``seed``."""
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _dyadic_grids() -> tuple[list[float], list[float]]:
    """Two fp32-exact dyadic codebooks: every interior word ``i/128`` of the first lies exactly
    halfway between two neighbouring words of the second, so the §5.6 table rule meets ties
    (broken towards the lower index, here ``i + 1``, so the codes do move)."""
    old = [k / 128 for k in range(-128, 127)] + [1.0]  # -1, ..., 126/128, 1
    new = [-1.0, -511 / 512] + [(2 * k + 1) / 256 for k in range(-128, 125)] + [1.0]
    assert len(old) == len(new) == 256
    assert all(a < b for a, b in itertools.pairwise(new))
    return old, new


def _table_rule(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, int]:
    """docs/core.md §5.6 by brute force: L[i] = the lowest index j minimising |old[i] - new[j]|
    in fp32; also the number of rows with a tie."""
    distance = (old.to(torch.float32)[:, None] - new.to(torch.float32)[None, :]).abs()
    best = distance.min(dim=1, keepdim=True).values
    ties = int(((distance == best).sum(dim=1) > 1).sum())
    return torch.argmin(distance, dim=1), ties


# --- helpers that run inside the spawned ranks --------------------------------------------


def _identity(members: tuple[str, ...] = MEMBERS) -> Any:
    from gefen.contracts import ProcessGroupIdentity

    return ProcessGroupIdentity("dp", members)


def _binding(rank: int, members: tuple[str, ...] = MEMBERS) -> Any:
    import torch.distributed as dist

    from gefen.dist import CodebookProcessGroupBinding

    member = f"rank:{rank}"
    return CodebookProcessGroupBinding(_identity(members), member, dist.group.WORLD, "cpu")


def _extents(layout: str) -> list[tuple[int, int]]:
    return {
        "replicated": [(0, NUMEL), (0, NUMEL)],
        "flat": [(0, 24), (24, 24)],
        "flat_empty": [(0, NUMEL), (NUMEL, 0)],
        "owner": [(0, NUMEL), (0, 0)],
    }[layout]


def _manifest(layout: str, members: tuple[str, ...] = MEMBERS) -> tuple[Any, list[Any]]:
    from gefen.contracts import (
        LogicalSlice,
        ParameterIdentity,
        ParameterLayout,
        PlacementKind,
        ShardIdentity,
        ShardingManifest,
        ShardPlacement,
    )

    identity = _identity(members)
    parameter = ParameterIdentity("w", SHAPE)
    kinds = {
        "replicated": (ParameterLayout.REPLICATED, PlacementKind.REPLICATE),
        "flat": (ParameterLayout.FLATTENED_ELEMENT_SHARD, PlacementKind.FLAT_SHARD),
        "flat_empty": (ParameterLayout.FLATTENED_ELEMENT_SHARD, PlacementKind.FLAT_SHARD),
        "owner": (ParameterLayout.WHOLE_PARAMETER_OWNER, PlacementKind.WHOLE_PARAMETER_OWNER),
    }
    layout_kind, placement_kind = kinds[layout]
    shards = []
    for coordinate, (start, length) in enumerate(_extents(layout)):
        member = members[coordinate]
        shards.append(
            ShardIdentity(
                parameter,
                layout_kind,
                LogicalSlice(start, length),
                (ShardPlacement("dp", placement_kind, coordinate, len(members)),),
                identity,
                member,
                owner=members[0] if layout == "owner" else None,
            )
        )
    return ShardingManifest(tuple(shards)), shards


def _target(layout: str, rank: int, full: torch.Tensor) -> torch.Tensor | None:
    start, length = _extents(layout)[rank]
    if layout == "owner" and rank != 0:
        return None
    if layout.startswith("flat"):
        return torch.nn.Parameter(full.reshape(-1)[start : start + length].clone())
    return torch.nn.Parameter(full.clone())


def _local_grad(layout: str, rank: int, full_grad: torch.Tensor) -> torch.Tensor:
    start, length = _extents(layout)[rank]
    if layout.startswith("flat"):
        return full_grad.reshape(-1)[start : start + length].clone()
    return full_grad.clone()


class Scoped:
    """One finalized optimizer of this rank, with its target tensor and layout."""

    def __init__(self, rank: int, layout: str = "replicated", cls: str = "Gefen", **options: Any):
        from gefen.core import Gefen, ParameterRebinding

        self.rank = rank
        self.layout = layout
        torch.manual_seed(0)
        full = torch.randn(SHAPE)
        self.original = torch.nn.Parameter(full.clone())
        options.setdefault("lr", 0.01)
        if cls == "GefenMuon":
            # Imported only here: gefen-core's own nox session runs without gefen-muon.
            from gefen.muon import GefenMuon

            self.opt = GefenMuon([self.original], **options)
        else:
            self.opt = Gefen([self.original], **options)
        self.target = _target(layout, rank, full)
        self.binding = _binding(rank)
        manifest, shards = _manifest(layout)
        self.rebinding = ParameterRebinding(self.original, self.target, shards[rank])
        self.manifest = manifest
        self.opt.post_sharding(
            [self.rebinding], manifest=manifest, codebook_process_group=self.binding
        )

    def set_grad(self, seed: int) -> None:
        if self.target is not None:
            self.target.grad = _local_grad(self.layout, self.rank, _grad(seed))

    def train(self, seeds: range) -> None:
        for seed in seeds:
            self.set_grad(seed)
            self.opt.step()

    def codebook(self) -> list[float] | None:
        codebook = self.opt.codebook
        return None if codebook is None else codebook.tolist()


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run a (failing) operation under ``timed``; describe the error and its cause."""
    return attempt(fn, attributes=("phase", "local_failure"))


def _rejected(optimizer: Any, fn: Callable[[], Any]) -> dict[str, Any]:
    """Snapshot, attempt ``fn`` (timed), and list what changed."""
    before = _snapshot(optimizer)
    result = _attempt(fn)
    result["changes"] = snapshot_changes(optimizer, before)
    return result


def _steps(scoped: Scoped, seed: int = 90) -> dict[str, Any]:
    """A normal step on every rank: the step counts and the local parameter moves."""
    scoped.set_grad(seed)
    target = scoped.target
    before = None if target is None else target.detach().clone()
    scoped.opt.step()
    moved = None
    if target is not None and before is not None and target.numel() > 0:
        moved = not torch.equal(before, target.detach())
    return {"global_step": scoped.opt.global_step, "moved": moved, "codebook": scoped.codebook()}


_HEADER_PATCH: list[Any] = []


def _count_headers() -> list[int]:
    """Patch ``GuardedOperation.header`` (this process only) to count the headers entered."""
    from gefen.dist.guarded import GuardedOperation

    calls: list[int] = []
    original = GuardedOperation.header

    def counting(self: Any, op_code: int, *args: Any, **kwargs: Any) -> None:
        calls.append(op_code)
        return original(self, op_code, *args, **kwargs)

    GuardedOperation.header = counting  # type: ignore[method-assign]
    _HEADER_PATCH.append(original)
    return calls


def _restore_headers() -> None:
    from gefen.dist.guarded import GuardedOperation

    while _HEADER_PATCH:
        GuardedOperation.header = _HEADER_PATCH.pop()  # type: ignore[method-assign]


# --- scenarios: voted preambles ----------------------------------------------------------


def scenario_initialize_preamble(rank: int, world_size: int, how: str) -> dict[str, Any]:
    scoped = Scoped(rank)
    scoped.set_grad(1)
    swapped: list[Any] = []
    if rank == 0:
        if how == "nan":
            assert scoped.target is not None
            assert scoped.target.grad is not None
            scoped.target.grad[0, 0] = float("nan")
        elif how == "sparse":
            assert scoped.target is not None
            scoped.target.grad = _grad(1).to_sparse()
        else:  # "layout": another tensor in the finalized slot
            group = scoped.opt.param_groups[0]
            swapped.append(group["params"][0])
            group["params"][0] = torch.nn.Parameter(torch.zeros(SHAPE))
    result = _rejected(scoped.opt, scoped.opt.initialize_codebook)
    if swapped:
        scoped.opt.param_groups[0]["params"][0] = swapped[0]
    scoped.set_grad(1)
    result["retry"] = scoped.opt.initialize_codebook()
    result["codebook"] = scoped.codebook()
    result["global_step"] = scoped.opt.global_step
    result["after"] = _steps(scoped)
    return result


def scenario_refresh_preamble(rank: int, world_size: int, how: str) -> dict[str, Any]:
    scoped = Scoped(rank)
    if how != "no_codebook":
        scoped.train(range(2))
    scoped.set_grad(5)
    swapped: list[Any] = []
    if how == "layout" and rank == 0:
        group = scoped.opt.param_groups[0]
        swapped.append(group["params"][0])
        group["params"][0] = torch.nn.Parameter(torch.zeros(SHAPE))
    elif how == "sparse" and rank == 0:
        assert scoped.target is not None
        scoped.target.grad = _grad(5).to_sparse()
    result = _rejected(scoped.opt, scoped.opt.refresh_codebook)
    if swapped:
        scoped.opt.param_groups[0]["params"][0] = swapped[0]
    scoped.set_grad(5)
    if how == "no_codebook":
        scoped.opt.step()  # learns the first codebook on both ranks
    before = scoped.codebook()
    result["retry"] = scoped.opt.refresh_codebook()
    result["changed"] = scoped.codebook() != before
    result["codebook"] = scoped.codebook()
    result["after"] = _steps(scoped)
    return result


# --- scenarios: a closure that swaps the binding -----------------------------------------


def scenario_binding_swap(rank: int, world_size: int, cls: str, how: str) -> dict[str, Any]:
    scoped = Scoped(rank, cls=cls)
    scoped.train(range(2))
    scoped.set_grad(3)
    original = scoped.opt._binding
    fresh = _binding(rank)  # equal content, another object

    def closure() -> float:
        if rank == 0:
            scoped.opt._binding = None if how == "clear" else fresh
        return 1.5

    # The snapshot excludes the binding the closure itself swaps; it is restored before the
    # comparison (the swap is the caller's doing, not the optimizer's).
    before = _snapshot(scoped.opt)
    headers = _count_headers()
    try:
        result = _attempt(lambda: scoped.opt.step(closure))
    finally:
        _restore_headers()
    result["swapped_left"] = scoped.opt._binding is not original
    scoped.opt._binding = original
    result["changes"] = snapshot_changes(scoped.opt, before)
    result["headers"] = list(headers)
    result["after"] = _steps(scoped)
    return result


# --- scenarios: operation headers --------------------------------------------------------


def scenario_refresh_versus_step(rank: int, world_size: int) -> dict[str, Any]:
    scoped = Scoped(rank)
    scoped.train(range(2))
    scoped.set_grad(3)
    operation = scoped.opt.refresh_codebook if rank == 0 else scoped.opt.step
    result = _rejected(scoped.opt, operation)
    result["after"] = _steps(scoped)
    return result


def scenario_step_apart(
    rank: int, world_size: int, saved_at: int, cls: str = "GefenMuon"
) -> dict[str, Any]:
    """Rank 1 reloads an older checkpoint: the load's header (the step, codebook and replicated
    state it would publish) differs, so the load is refused on both ranks."""
    scoped = Scoped(rank, cls=cls)
    saved = {0: copy.deepcopy(scoped.opt.state_dict())}
    for step in (1, 2):
        scoped.train(range(step, step + 1))
        saved[step] = copy.deepcopy(scoped.opt.state_dict())
    older = copy.deepcopy(saved[saved_at if rank == 1 else 2])
    result = _rejected(scoped.opt, lambda: scoped.opt.load_state_dict(older))
    result["loaded_step"] = scoped.opt.global_step
    result["rank_local"] = "rank_local" in older["gefen"]
    scoped.opt.load_state_dict(copy.deepcopy(saved[2]))
    result["after"] = _steps(scoped)
    return result


def scenario_load_while_stepping(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 loads its own checkpoint while rank 1 steps: both votes pass, then the headers
    (op 4 against op 3) differ in the operation word, so neither rank waits on the other."""
    scoped = Scoped(rank)
    scoped.train(range(2))
    saved = copy.deepcopy(scoped.opt.state_dict())
    scoped.set_grad(3)
    if rank == 0:
        result = _rejected(scoped.opt, lambda: scoped.opt.load_state_dict(saved))
    else:
        result = _rejected(scoped.opt, scoped.opt.step)
    result["after"] = _steps(scoped)
    return result


def scenario_state_dict_versus(rank: int, world_size: int, other: str) -> dict[str, Any]:
    """Rank 0 takes a state dict while rank 1 steps, loads or initializes the codebook."""
    scoped = Scoped(rank)
    scoped.train(range(2))
    saved = copy.deepcopy(scoped.opt.state_dict())
    scoped.set_grad(3)
    actions = {
        "step": scoped.opt.step,
        "load": lambda: scoped.opt.load_state_dict(saved),
        "initialize": scoped.opt.initialize_codebook,
    }
    result = _rejected(scoped.opt, scoped.opt.state_dict if rank == 0 else actions[other])
    result["after"] = _steps(scoped)
    return result


def scenario_codebook_edit(rank: int, world_size: int) -> dict[str, Any]:
    scoped = Scoped(rank)
    scoped.train(range(2))
    original = scoped.opt._codebook
    assert original is not None
    if rank == 1:
        edited = original.clone()
        edited[128] = (edited[127] + edited[128]) / 2  # still strictly increasing
        scoped.opt._codebook = edited
    scoped.set_grad(3)
    result = _rejected(scoped.opt, scoped.opt.step)
    scoped.opt._codebook = original
    result["after"] = _steps(scoped)
    return result


def scenario_option_edit(rank: int, world_size: int, cls: str) -> dict[str, Any]:
    """An option edited on one rank only, at a steady step (the codebook exists, no refresh is
    due): the step header's ``group_options`` word sees it."""
    scoped = Scoped(rank, cls=cls)
    scoped.train(range(2))
    group = scoped.opt.param_groups[0]
    kept = group["lr"]
    if rank == 1:
        group["lr"] = kept * 2
    scoped.set_grad(3)
    result = _rejected(scoped.opt, scoped.opt.step)
    group["lr"] = kept
    result["after"] = _steps(scoped)
    return result


def scenario_options_reload(rank: int, world_size: int, cls: str) -> dict[str, Any]:
    """Rank 1 reloads the current checkpoint with another ``lr``: the load header's
    ``group_options`` word differs, so the load is refused on both ranks (it used to load, and
    every step's header failed until a consistent load)."""
    scoped = Scoped(rank, cls=cls)
    scoped.train(range(2))
    edited = copy.deepcopy(scoped.opt.state_dict())
    if rank == 1:
        for group in edited["param_groups"]:
            group["lr"] = group["lr"] * 2
    result = _rejected(scoped.opt, lambda: scoped.opt.load_state_dict(edited))
    result["after"] = _steps(scoped)
    return result


def _same_entries(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if set(a) != set(b):
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return bool(a)


def scenario_checkpoint_codebook_reload(rank: int, world_size: int) -> dict[str, Any]:
    """Scoped round trip, then rank 1 reloads a checkpoint of another run (same step, other
    codebook): the load's header names the codebook fingerprint on both ranks."""
    scoped = Scoped(rank)
    scoped.train(range(2))
    mine = copy.deepcopy(scoped.opt.state_dict())
    # Round trip at the same topology: a fresh finalized optimizer loads the checkpoint and
    # then steps exactly like the original.
    clone = Scoped(rank)
    assert scoped.target is not None
    assert clone.target is not None
    with torch.no_grad():
        clone.target.copy_(scoped.target)
    clone.opt.load_state_dict(copy.deepcopy(mine))
    round_trip = {
        "global_step": clone.opt.global_step,
        "codebook": clone.codebook() == scoped.codebook(),
    }
    scoped.set_grad(7)
    clone.set_grad(7)
    scoped.opt.step()
    clone.opt.step()
    round_trip["same_after_step"] = (
        torch.equal(scoped.target, clone.target)
        and scoped.codebook() == clone.codebook()
        and _same_entries(scoped.opt.state[scoped.target], clone.opt.state[clone.target])
    )
    mine = copy.deepcopy(scoped.opt.state_dict())
    other = Scoped(rank)  # another run at the same step with another codebook
    other.train(range(20, 23))
    theirs = copy.deepcopy(other.opt.state_dict())
    before_load = scoped.codebook()
    result = _rejected(
        scoped.opt, lambda: scoped.opt.load_state_dict(copy.deepcopy(theirs if rank == 1 else mine))
    )
    loaded = scoped.codebook()
    result["round_trip"] = round_trip
    result["loaded"] = {
        "own": loaded == before_load,
        "other_run": loaded == other.codebook(),
        "step": scoped.opt.global_step,
    }
    result["after"] = _steps(scoped)
    return result


def scenario_checkpoint_binding(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from gefen.dist import CheckpointProcessGroupBinding

    scoped = Scoped(rank)
    scoped.train(range(2))
    saved = copy.deepcopy(scoped.opt.state_dict())
    another = dist.new_group([0, 1])
    member = f"rank:{rank}"
    wrong = CheckpointProcessGroupBinding(_identity(), member, another, "cpu")
    right = CheckpointProcessGroupBinding(_identity(), member, dist.group.WORLD, "cpu")
    scoped.train(range(2, 3))
    result = _rejected(
        scoped.opt,
        lambda: scoped.opt.load_state_dict(copy.deepcopy(saved), checkpoint_binding=wrong),
    )
    result["same_handle"] = _attempt(
        lambda: scoped.opt.load_state_dict(copy.deepcopy(saved), checkpoint_binding=right)
    )["error"]
    result["loaded_step"] = scoped.opt.global_step
    result["after"] = _steps(scoped)
    return result


# --- scenarios: installation -------------------------------------------------------------


def scenario_reversed_members(rank: int, world_size: int) -> dict[str, Any]:
    from gefen.core import Gefen, ParameterRebinding

    torch.manual_seed(0)
    original = torch.nn.Parameter(torch.randn(SHAPE))
    opt = Gefen([original], lr=0.01)
    target = torch.nn.Parameter(original.detach().clone())
    reversed_members = ("rank:1", "rank:0")
    manifest, shards = _manifest("replicated", reversed_members)
    mine = next(shard for shard in shards if shard.local_member == f"rank:{rank}")

    def install() -> None:
        binding = _binding(rank, reversed_members)
        opt.post_sharding(
            [ParameterRebinding(original, target, mine)],
            manifest=manifest,
            codebook_process_group=binding,
        )

    result = _rejected(opt, install)
    result["finalized"] = opt.finalized is not None
    manifest, shards = _manifest("replicated")
    binding = _binding(rank)
    opt.post_sharding(
        [ParameterRebinding(original, target, shards[rank])],
        manifest=manifest,
        codebook_process_group=binding,
    )
    target.grad = _grad(1)
    opt.step()
    result["after"] = {"global_step": opt.global_step, "codebook": opt.codebook.tolist()}
    return result


# --- scenarios: contributions and the oracle ----------------------------------------------


def _learn_seed(layout: str, rank: int) -> int:
    """Replicas get different gradients with the same automatic period (48)."""
    if layout == "replicated":
        return 5 if rank == 1 else 0
    return 10


def scenario_learn(rank: int, world_size: int, layout: str, cls: str, how: str) -> dict[str, Any]:
    """``how``: "initialize" (initialize_codebook) or "step" (the first step learns)."""
    scoped = Scoped(rank, layout, cls)
    scoped.set_grad(_learn_seed(layout, rank))
    if how == "step_none" and scoped.target is not None and scoped.target.numel() == 0:
        scoped.target.grad = None  # a zero-length member without a gradient
    learned = scoped.opt.initialize_codebook() if how == "initialize" else None
    step = scoped.opt.global_step
    if how.startswith("step"):
        scoped.opt.step()
    params = [p for g in scoped.opt.param_groups for p in g["params"]]
    entries = [
        {
            key: (value.tolist() if isinstance(value, torch.Tensor) else value)
            for key, value in e.items()
        }
        for e in scoped.opt.state.values()
    ]
    return {
        "learned": learned,
        "step_before": step,
        "codebook": scoped.codebook(),
        "params": len(params),
        "state": len(scoped.opt.state),
        "periods": [entry.get("period") for entry in entries],
        "after": _steps(scoped),
    }


def scenario_presence(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    scoped = Scoped(rank, layout)
    scoped.set_grad(10)
    if rank == 1:
        assert scoped.target is not None
        scoped.target.grad = None
    result = _rejected(scoped.opt, scoped.opt.step)
    result["after"] = _steps(scoped)
    return result


def scenario_presence_steady(rank: int, world_size: int, layout: str, cls: str) -> dict[str, Any]:
    """A gradient missing on one rank at a step that learns nothing (the codebook exists, no
    refresh is due): only the step header can see it."""
    scoped = Scoped(rank, layout, cls)
    scoped.train(range(2))
    scoped.set_grad(10)
    if rank == 1 and scoped.target is not None:
        scoped.target.grad = None
    result = _rejected(scoped.opt, scoped.opt.step)
    result["after"] = _steps(scoped)
    return result


# --- scenarios: injected failures in the learning phases ----------------------------------


def scenario_injected(rank: int, world_size: int, where: str) -> dict[str, Any]:
    import gefen.core.scoped as scoped_module

    scoped = Scoped(rank)
    if where == "staging":
        scoped.train(range(2))
    scoped.set_grad(4)
    name = "remap_table" if where == "staging" else "solve_new_codebook"
    original = getattr(scoped_module, name)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(INJECTED)

    if rank == 0:
        setattr(scoped_module, name, broken)
    operation = {
        "solve": scoped.opt.initialize_codebook,
        "staging": scoped.opt.refresh_codebook,
        "step_solve": scoped.opt.step,  # the first step learns: its phase 4 votes the solve
    }[where]
    try:
        result = _rejected(scoped.opt, operation)
    finally:
        setattr(scoped_module, name, original)
    result["latched"] = scoped.opt.latched
    result["retry"] = operation() if where != "step_solve" else scoped.opt.step() is None
    result["codebook"] = scoped.codebook()
    result["after"] = _steps(scoped)
    return result


def scenario_refresh_codes(rank: int, world_size: int, crafted: bool) -> dict[str, Any]:
    """A scoped refresh remaps the stored codes by the §5.6 table rule, ties included."""
    import gefen.core.scoped as scoped_module
    from gefen.core.learning import remap_table

    scoped = Scoped(rank)
    old_grid, new_grid = _dyadic_grids()
    original = scoped_module.solve_new_codebook
    grids = [old_grid]

    def solve(counts: torch.Tensor, device: torch.device, size: int = 256) -> torch.Tensor:
        return torch.tensor(grids[0], dtype=torch.float32, device=device)

    if crafted:
        scoped_module.solve_new_codebook = solve
    try:
        scoped.train(range(2))
        key = scoped.opt.CODEC_KEYS.codes
        entry = scoped.opt.state[scoped.target]
        old_codes = entry[key].clone()
        old_codebook = scoped.opt.codebook.clone()
        grids[0] = new_grid
        scoped.set_grad(6)
        refreshed = scoped.opt.refresh_codebook()
    finally:
        scoped_module.solve_new_codebook = original
    new_codebook = scoped.opt.codebook
    new_codes = scoped.opt.state[scoped.target][key]
    table, _ties = _table_rule(old_codebook, new_codebook)
    used = torch.unique(old_codes.to(torch.int64))
    _, tie_rows = _table_rule(old_codebook[used], new_codebook)
    return {
        "refreshed": refreshed,
        "changed": not torch.equal(old_codebook, new_codebook),
        "codebook": new_codebook.tolist(),
        "library_rule": torch.equal(
            new_codes, remap_table(old_codebook, new_codebook)[old_codes.long()].to(torch.uint8)
        ),
        "table_rule": torch.equal(new_codes.to(torch.int64), table[old_codes.to(torch.int64)]),
        "dtype": str(new_codes.dtype),
        "ties_used": tie_rows,
        "codes_changed": not torch.equal(old_codes, new_codes),
        "after": _steps(scoped),
    }


def scenario_stochastic_flat(rank: int, world_size: int) -> list[int]:
    """Equal gradients on the two element slices of one parameter, stochastic rounding: the
    codes of the first step (each slice drew from its own local index before, so alike)."""
    scoped = Scoped(rank, "flat", stochastic_round=True)
    assert scoped.target is not None
    scoped.target.grad = torch.linspace(-1.0, 1.0, 24) ** 3
    scoped.opt.step()
    codes: list[int] = scoped.opt.state[scoped.target]["momentum_codes"].reshape(-1).tolist()
    return codes


SCENARIOS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("stochastic_flat", scenario_stochastic_flat, ()),
    ("init_nan", scenario_initialize_preamble, ("nan",)),
    ("init_sparse", scenario_initialize_preamble, ("sparse",)),
    ("init_layout", scenario_initialize_preamble, ("layout",)),
    ("refresh_layout", scenario_refresh_preamble, ("layout",)),
    ("refresh_sparse", scenario_refresh_preamble, ("sparse",)),
    ("refresh_no_codebook", scenario_refresh_preamble, ("no_codebook",)),
    ("swap_gefen_clear", scenario_binding_swap, ("Gefen", "clear")),
    ("swap_gefen_replace", scenario_binding_swap, ("Gefen", "replace")),
    ("swap_muon_clear", scenario_binding_swap, ("GefenMuon", "clear")),
    ("swap_muon_replace", scenario_binding_swap, ("GefenMuon", "replace")),
    ("refresh_vs_step", scenario_refresh_versus_step, ()),
    ("one_step_apart", scenario_step_apart, (1, "GefenMuon")),
    ("two_steps_apart", scenario_step_apart, (0, "GefenMuon")),
    ("gefen_step_apart", scenario_step_apart, (1, "Gefen")),
    ("codebook_edit", scenario_codebook_edit, ()),
    ("option_edit", scenario_option_edit, ("Gefen",)),
    ("option_edit_muon", scenario_option_edit, ("GefenMuon",)),
    ("options_reload_Gefen", scenario_options_reload, ("Gefen",)),
    ("options_reload_GefenMuon", scenario_options_reload, ("GefenMuon",)),
    ("load_while_stepping", scenario_load_while_stepping, ()),
    ("state_dict_vs_step", scenario_state_dict_versus, ("step",)),
    ("state_dict_vs_load", scenario_state_dict_versus, ("load",)),
    ("state_dict_vs_initialize", scenario_state_dict_versus, ("initialize",)),
    ("checkpoint_reload", scenario_checkpoint_codebook_reload, ()),
    ("checkpoint_binding", scenario_checkpoint_binding, ()),
    ("reversed", scenario_reversed_members, ()),
    ("learn_replicated", scenario_learn, ("replicated", "Gefen", "initialize")),
    ("learn_replicated_step", scenario_learn, ("replicated", "Gefen", "step")),
    ("learn_flat", scenario_learn, ("flat", "Gefen", "initialize")),
    ("learn_flat_empty", scenario_learn, ("flat_empty", "Gefen", "step")),
    ("learn_flat_empty_none", scenario_learn, ("flat_empty", "Gefen", "step_none")),
    ("learn_flat_empty_init", scenario_learn, ("flat_empty", "Gefen", "initialize")),
    ("learn_owner", scenario_learn, ("owner", "GefenMuon", "initialize")),
    ("learn_owner_step", scenario_learn, ("owner", "GefenMuon", "step")),
    ("learn_muon_replicated", scenario_learn, ("replicated", "GefenMuon", "initialize")),
    ("presence_replicated", scenario_presence, ("replicated",)),
    ("presence_flat", scenario_presence, ("flat",)),
    ("steady_presence_replicated", scenario_presence_steady, ("replicated", "Gefen")),
    ("steady_presence_flat", scenario_presence_steady, ("flat", "Gefen")),
    ("steady_presence_flat_empty", scenario_presence_steady, ("flat_empty", "Gefen")),
    ("steady_presence_muon", scenario_presence_steady, ("replicated", "GefenMuon")),
    ("solve", scenario_injected, ("solve",)),
    ("staging", scenario_injected, ("staging",)),
    ("step_solve", scenario_injected, ("step_solve",)),
    ("codes_crafted", scenario_refresh_codes, (True,)),
    ("codes_learned", scenario_refresh_codes, (False,)),
]


HAVE_MUON = importlib.util.find_spec("gefen.muon") is not None
# GefenMuon's scenarios need gefen-muon, which gefen-core's own session does not install.
_WITHOUT_MUON = {name for name, _, args in SCENARIOS if "GefenMuon" in args}


class _World:
    """The scenario world; a GefenMuon scenario skips its test where gefen-muon is absent."""

    def __init__(self, inner: ScenarioWorld) -> None:
        self.inner = inner

    def __getitem__(self, name: str) -> list[Any]:
        if not HAVE_MUON and name in _WITHOUT_MUON:
            pytest.skip("needs gefen-muon (tests_all installs every package)")
        return self.inner[name]

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.inner, attribute)


@pytest.fixture(scope="module")
def world() -> Any:
    scenarios = [s for s in SCENARIOS if HAVE_MUON or s[0] not in _WITHOUT_MUON]
    inner = run_scenarios(scenarios, 2, rank_deadline_s=WORLD_DEADLINE_S, pg_timeout_s=PG_TIMEOUT_S)
    return _World(inner)


# --- the tests -------------------------------------------------------------------------------


def _both(world: ScenarioWorld, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    first, second = world[name]
    return first, second


def _fast_and_unchanged(*results: dict[str, Any]) -> None:
    for result in results:
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []


def _voted(
    results: tuple[dict[str, Any], dict[str, Any]], owner: str, phase: str, cause: str
) -> None:
    """Rank 0 failed locally with ``cause``; rank 1 learns it failed elsewhere."""
    first, second = results
    assert first["error"] == (
        f"DistributedStepError: {owner} {phase} failed on local rank 0: {cause}"
    )
    assert second["error"] == f"DistributedStepError: {owner} {phase} {OTHER}"
    assert (first["phase"], second["phase"]) == (phase, phase)
    assert (first["local_failure"], second["local_failure"]) == (True, False)
    assert first["cause"] is not None
    assert first["cause"].endswith(f": {cause}")
    assert second["cause"] is None
    _fast_and_unchanged(first, second)


def _same_after(results: tuple[dict[str, Any], dict[str, Any]], global_step: int) -> None:
    """Both ranks stepped together afterwards and hold the same codebook."""
    first, second = (result["after"] for result in results)
    assert first["global_step"] == second["global_step"] == global_step
    assert first["codebook"] is not None
    assert first["codebook"] == second["codebook"]
    assert first["moved"] is True


def _header_error(owner: str, labels: str) -> str:
    return (
        f"GroupAgreementError: {owner} operation header differs across process-group members: "
        f"{labels}"
    )


PREAMBLE_CAUSES = {
    "nan": "parameter 'w' has a non-finite gradient (NaN or Inf)",
    "sparse": (
        "parameter 'w' has a sparse or non-strided gradient (torch.sparse_coo); Gefen "
        "optimizers need dense strided gradients"
    ),
    "layout": f"Gefen: {LAYOUT_CHANGED}",
}


@pytest.mark.parametrize("how", [pytest.param("nan", marks=pytest.mark.smoke), "sparse", "layout"])
def test_initialize_preamble_failure_on_rank_zero_fails_every_rank(
    world: ScenarioWorld, how: str
) -> None:
    results = _both(world, f"init_{how}")
    _voted(results, "Gefen", "initialize preamble", PREAMBLE_CAUSES[how])
    first, second = results
    # The retry learns on both ranks, from rank 0's replica only: the one-process oracle.
    assert first["retry"] is second["retry"] is True
    assert first["global_step"] == second["global_step"] == 0
    assert first["codebook"] == second["codebook"] == _oracle([_grad(1)])
    _same_after(results, 1)


@pytest.mark.parametrize("how", ["layout", "sparse"])
def test_refresh_preamble_failure_on_one_rank_fails_every_rank(
    world: ScenarioWorld, how: str
) -> None:
    results = _both(world, f"refresh_{how}")
    _voted(results, "Gefen", "refresh preamble", PREAMBLE_CAUSES[how])
    first, second = results
    assert first["retry"] is second["retry"] is True
    assert first["changed"] is second["changed"] is True
    assert first["codebook"] == second["codebook"]
    _same_after(results, 3)


def test_refresh_without_codebook_fails_inside_the_voted_preamble(world: ScenarioWorld) -> None:
    results = _both(world, "refresh_no_codebook")
    for rank, result in enumerate(results):
        assert result["error"] == (
            f"DistributedStepError: Gefen refresh preamble failed on local rank {rank}: "
            f"{NO_CODEBOOK}"
        )
        assert result["cause"] == f"RuntimeError: {NO_CODEBOOK}"
        assert result["phase"] == "refresh preamble"
        assert result["local_failure"] is True
    _fast_and_unchanged(*results)
    first, second = results
    assert first["retry"] is second["retry"] is True
    assert first["codebook"] == second["codebook"]
    _same_after(results, 2)


@pytest.mark.parametrize(
    ("cls", "how"),
    [
        pytest.param("Gefen", "clear", marks=pytest.mark.smoke),
        ("Gefen", "replace"),
        ("GefenMuon", "clear"),
        ("GefenMuon", "replace"),
    ],
)
def test_closure_that_swaps_the_binding_on_rank_zero_fails_before_any_header(
    world: ScenarioWorld, cls: str, how: str
) -> None:
    name = {"Gefen": "gefen", "GefenMuon": "muon"}[cls]
    results = _both(world, f"swap_{name}_{how}")
    _voted(results, cls, "step preflight", f"{cls} {SWAPPED}")
    first, second = results
    assert first["headers"] == second["headers"] == []  # nobody reached the header
    assert (first["swapped_left"], second["swapped_left"]) == (True, False)
    _same_after(results, 3)


def _other_operation(results: tuple[dict[str, Any], dict[str, Any]], phases: list[str]) -> None:
    """Each rank is told, at its first vote, that the other is in a different operation (the
    vote's operation word digests its phase; it used to digest only agreement subjects, which
    no binding-form vote has)."""
    for result, phase in zip(results, phases, strict=True):
        assert result["error"] == (
            f"GroupAgreementError: Gefen {phase}: another process-group member is in a "
            "different operation (its vote is another optimizer's or phase's, or agrees on "
            "other subjects: one steps while another saves or loads, say; nothing was changed)"
        )


def test_refresh_on_one_rank_while_the_other_steps_fails_the_first_vote(
    world: ScenarioWorld,
) -> None:
    results = _both(world, "refresh_vs_step")
    _other_operation(results, ["refresh preamble", "step preflight"])
    _fast_and_unchanged(*results)
    _same_after(results, 3)


@pytest.mark.parametrize("other", ["step", "load", "initialize"])
def test_a_state_dict_on_one_rank_meeting_another_operation_fails_both(
    world: ScenarioWorld, other: str
) -> None:
    # The state_dict preflight's vote and the other operation's first vote carried the same
    # operation word (0): the state_dict returned while the other rank waited in its header
    # exchange (a gloo error, or the process group's timeout).
    results = _both(world, f"state_dict_vs_{other}")
    phase = {
        "step": "step preflight",
        "load": "load validation",
        "initialize": "initialize preamble",
    }
    _other_operation(results, ["state dict preflight", phase[other]])
    _fast_and_unchanged(*results)
    _same_after(results, 3)


@pytest.mark.parametrize(
    ("name", "owner", "labels"),
    [
        ("one_step_apart", "GefenMuon", "global_step, replicated_state"),
        (
            "two_steps_apart",
            "GefenMuon",
            "global_step, codebook_present, codebook_fingerprint, replicated_state",
        ),
        ("gefen_step_apart", "Gefen", "global_step, replicated_state"),
    ],
)
def test_a_one_rank_reload_of_an_older_checkpoint_is_refused_at_the_load_header(
    world: ScenarioWorld, name: str, owner: str, labels: str
) -> None:
    """Replicated state must agree at load (nothing published, both ranks raise), not at the
    next step; Gefen's rank-local records would name the tag, but the header comes first."""
    results = _both(world, name)
    for result in results:
        assert result["rank_local"] is (owner == "Gefen")
        assert result["error"] == _header_error(owner, labels)
        assert result["loaded_step"] == 2
    _fast_and_unchanged(*results)
    _same_after(results, 3)


def test_a_load_on_one_rank_while_the_other_steps_fails_both_at_the_operation_word(
    world: ScenarioWorld,
) -> None:
    results = _both(world, "load_while_stepping")
    _other_operation(results, ["load validation", "step preflight"])
    _fast_and_unchanged(*results)
    _same_after(results, 3)


def test_codebook_changed_on_one_rank_fails_the_next_header(world: ScenarioWorld) -> None:
    results = _both(world, "codebook_edit")
    for result in results:
        assert result["error"] == _header_error("Gefen", "codebook_fingerprint")
    _fast_and_unchanged(*results)
    _same_after(results, 3)


@pytest.mark.parametrize("cls", ["Gefen", "GefenMuon"])
def test_an_option_edited_on_one_rank_fails_the_next_header(world: ScenarioWorld, cls: str) -> None:
    # It used to pass unseen in the binding form: the ranks stepped with different lr and
    # their replicated parameters silently diverged.
    results = _both(world, "option_edit" if cls == "Gefen" else "option_edit_muon")
    for result in results:
        assert result["error"] == _header_error(cls, "group_options")
    _fast_and_unchanged(*results)
    _same_after(results, 3)


@pytest.mark.parametrize("cls", ["Gefen", "GefenMuon"])
def test_a_one_rank_reload_with_another_option_is_refused_at_the_load_header(
    world: ScenarioWorld, cls: str
) -> None:
    results = _both(world, f"options_reload_{cls}")
    for result in results:
        assert result["error"] == _header_error(cls, "group_options")
    _fast_and_unchanged(*results)
    _same_after(results, 3)


def test_scoped_checkpoint_round_trip_and_a_one_rank_reload_of_another_codebook(
    world: ScenarioWorld,
) -> None:
    results = _both(world, "checkpoint_reload")
    for result in results:
        assert result["round_trip"] == {
            "global_step": 2,
            "codebook": True,
            "same_after_step": True,
        }
        assert result["error"] == _header_error("Gefen", "codebook_fingerprint, replicated_state")
        assert result["loaded"] == {"own": True, "other_run": False, "step": 3}
    _fast_and_unchanged(*results)
    _same_after(results, 4)


def test_checkpoint_binding_with_another_handle_is_refused_inside_the_voted_phase(
    world: ScenarioWorld,
) -> None:
    results = _both(world, "checkpoint_binding")
    for rank, result in enumerate(results):
        assert result["error"] == (
            f"DistributedStepError: Gefen load validation failed on local rank {rank}: "
            f"{CHECKPOINT_BINDING}"
        )
        assert result["cause"] == f"BindingError: {CHECKPOINT_BINDING}"
        assert result["phase"] == "load validation"
        assert result["same_handle"] is None  # the installed handle object passes
        assert result["loaded_step"] == 2
    _fast_and_unchanged(*results)
    _same_after(results, 3)


def test_reversed_member_order_at_post_sharding_is_a_binding_error(world: ScenarioWorld) -> None:
    results = _both(world, "reversed")
    for rank, result in enumerate(results):
        other = 1 - rank
        assert result["error"] == (
            "BindingError: CodebookProcessGroupBinding 'dp': runtime group order does not match "
            f"ordered semantic members: group rank {rank} is 'rank:{other}', local_member is "
            f"'rank:{rank}'"
        )
        assert result["finalized"] is False
    _fast_and_unchanged(*results)
    first, second = (result["after"] for result in results)
    assert first == second
    assert first["global_step"] == 1
    assert first["codebook"] == _oracle([_grad(1)])


def _period(piece: torch.Tensor) -> int:
    from gefen.core.kernels import select_period

    if piece.numel() == 0:
        return 0
    period = select_period(piece, tuple(piece.shape), force_one=False)
    assert period is not None
    return period


def _expected_learning(layout: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    """(the oracle's slices, each rank's expected state periods) for ``scenario_learn``."""
    slices = [_local_grad(layout, rank, _grad(_learn_seed(layout, rank))) for rank in (0, 1)]
    periods = [[_period(piece)] for piece in slices]
    if layout == "replicated":
        return slices[:1], periods  # coordinate 0 only, once
    if layout == "owner":
        return slices[:1], [periods[0], []]  # the owner's; the non-owner holds no slot
    return [piece for piece in slices if piece.numel() > 0], periods


@pytest.mark.parametrize(
    ("name", "layout", "initialize"),
    [
        ("learn_replicated", "replicated", True),
        ("learn_replicated_step", "replicated", False),
        ("learn_muon_replicated", "replicated", True),
        pytest.param("learn_flat", "flat", True, marks=pytest.mark.smoke),
        ("learn_flat_empty", "flat_empty", False),
        ("learn_flat_empty_none", "flat_empty", False),
        ("learn_flat_empty_init", "flat_empty", True),
        ("learn_owner", "owner", True),
        ("learn_owner_step", "owner", False),
    ],
)
def test_scoped_codebook_equals_the_one_process_oracle(
    world: ScenarioWorld, name: str, layout: str, initialize: bool
) -> None:
    slices, periods = _expected_learning(layout)
    oracle = _oracle(slices)
    results = _both(world, name)
    for rank, result in enumerate(results):
        assert result["learned"] is (True if initialize else None)
        assert result["step_before"] == 0
        assert result["codebook"] == oracle, f"rank {rank}"
        assert result["periods"] == periods[rank]
        owns_nothing = layout == "owner" and rank == 1
        assert (result["params"], result["state"]) == ((0, 0) if owns_nothing else (1, 1))
        after = result["after"]
        assert after["global_step"] == (1 if initialize else 2)
        empty = owns_nothing or (layout == "flat_empty" and rank == 1)
        assert after["moved"] is (None if empty else True)
    assert results[0]["after"]["codebook"] == results[1]["after"]["codebook"]


def test_the_oracle_distinguishes_the_contribution_rules() -> None:
    """The oracle comparisons above could fail: every wrong rule gives another codebook."""
    replicas = [_grad(0), _grad(5)]
    assert _period(replicas[0]) == _period(replicas[1])
    assert _oracle(replicas[:1]) != _oracle(replicas)  # both replicas counted
    assert _oracle(replicas[:1]) != _oracle(replicas[1:])  # the other coordinate counted
    flat = _grad(10).reshape(-1)
    # A histogram of the unsharded parameter is not the per-shard oracle.
    assert _period(flat[:24]) != _period(flat[24:])
    assert _oracle([flat[:24], flat[24:]]) != _oracle([flat])


@pytest.mark.parametrize("layout", ["replicated", "flat"])
def test_gradient_presence_mismatch_fails_on_both_ranks(world: ScenarioWorld, layout: str) -> None:
    """At the learning step the header's ``gradient_presence`` words see the mismatch first;
    the contribution records' own presence rule (tested in gefen-dist) stays behind it."""
    results = _both(world, f"presence_{layout}")
    for result in results:
        assert result["error"] == _header_error("Gefen", "gradient_presence")
    _fast_and_unchanged(*results)
    _same_after(results, 1)


@pytest.mark.parametrize("case", ["replicated", "flat", "muon"])
def test_gradient_presence_mismatch_at_a_steady_step_fails_the_header_on_both_ranks(
    world: ScenarioWorld, case: str
) -> None:
    """No learning runs at this step, so no contribution record is exchanged: the step header's
    ``gradient_presence`` words carry the pattern (no collective added)."""
    results = _both(world, f"steady_presence_{case}")
    owner = "GefenMuon" if case == "muon" else "Gefen"
    for result in results:
        assert result["error"] == _header_error(owner, "gradient_presence")
    _fast_and_unchanged(*results)
    _same_after(results, 3)


def test_an_empty_flattened_shard_does_not_take_part_in_the_presence_words(
    world: ScenarioWorld,
) -> None:
    """Rank 1 holds no element of ``w``: its missing gradient is no disagreement (the rule of the
    contribution records, docs/dist.md §9.6), so the step runs on both ranks."""
    first, second = _both(world, "steady_presence_flat_empty")
    assert first["error"] is None
    assert second["error"] is None
    assert first["after"]["global_step"] == second["after"]["global_step"] == 4


@pytest.mark.parametrize(
    ("where", "phase", "global_step"),
    [
        ("solve", "codebook solve", 1),
        ("staging", "momentum requantization staging", 3),
        ("step_solve", "codebook solve", 2),
    ],
)
def test_injected_failure_in_a_learning_phase_fails_every_rank(
    world: ScenarioWorld, where: str, phase: str, global_step: int
) -> None:
    """A voted failure changes nothing on any rank and the operation is retried as is: the
    step's own learning (phase 4, after the step's vote) latched every rank for a while, as
    if the failure had been one rank's alone (docs/dist.md §4, §9.5)."""
    results = _both(world, where)
    _voted(results, "Gefen", phase, INJECTED)
    first, second = results
    assert first["latched"] is second["latched"] is False
    assert first["retry"] is second["retry"] is True
    assert first["codebook"] == second["codebook"]
    _same_after(results, global_step)


@pytest.mark.parametrize("crafted", [True, False])
def test_scoped_refresh_remaps_codes_by_the_table_rule(world: ScenarioWorld, crafted: bool) -> None:
    results = _both(world, "codes_crafted" if crafted else "codes_learned")
    for result in results:
        assert result["refreshed"] is True
        assert result["changed"] is True
        assert result["dtype"] == "torch.uint8"
        assert result["library_rule"] is True
        assert result["table_rule"] is True
        assert result["codes_changed"] is True
    if crafted:
        for result in results:
            assert result["codebook"] == _dyadic_grids()[1]
            assert result["ties_used"] > 0  # the remapped codes went through ties
    assert results[0]["codebook"] == results[1]["codebook"]
    _same_after(results, 3)


def test_the_table_rule_helper_breaks_ties_towards_the_lower_index() -> None:
    old, new = (torch.tensor(grid) for grid in _dyadic_grids())
    table, ties = _table_rule(old, new)
    assert ties > 200
    assert table[128].item() == 129  # 0 is halfway between new[129] and new[130]
    from gefen.core.kernels import nearest_index

    assert torch.equal(table.to(torch.uint8), nearest_index(new, old))


def test_element_slices_draw_by_their_place_in_the_parameter(world: ScenarioWorld) -> None:
    # docs/core.md §6.3: the draw of element k is the whole parameter's; slice 1 holds
    # elements 24..47, so equal values round with other draws than slice 0's.
    first, second = _both(world, "stochastic_flat")
    assert len(first) == len(second) > 0
    assert first != second
