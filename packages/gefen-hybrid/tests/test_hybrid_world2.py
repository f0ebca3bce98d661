"""GefenMuonHybrid's failure semantics on a 2-rank Gloo world (docs/hybrid.md §6–§8, §10).

Every scenario builds a small language model (an ``Embedding``, bias-free hidden ``Linear``
layers, a ``LayerNorm`` and an ``lm_head``), shards it with FSDP2 ``fully_shard`` on
``init_device_mesh("cpu", (2,))`` (each submodule, then the model; or only the backup's modules
for a backup-only mesh), builds ``GefenMuonHybrid(model, …, ns_steps=1, fused=False)`` and makes
one rank diverge: a failing closure, AMP controls, a dropped gradient, another registration
order, a swapped parameter, a sparse gradient, a rejected checkpoint. Each scenario snapshots
both children (local shards of parameters and gradients, deep state, codebooks and global
steps) before and after the rejected operation, times it, and then proves the hybrid still
steps together on both ranks.

All scenarios share one spawned 2-rank world (process start-up dominates on this machine).
Scenario functions are module-level so the spawned children load them by reference; they catch
the operations under test themselves and return plain data only, so a rank never leaves its
peer waiting in a collective.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from gefen.core.testing import attempt as _attempt
from gefen.core.testing import live_params as _params
from gefen.core.testing import local_shard as _local
from gefen.core.testing import same_or_none as _same
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed
from gefen.muon.testing import shared_mesh as _mesh

DEADLINE_S = 10.0  # docs/muon.md §11: a failing operation < 10 s < process-group timeout 20 s
PG_TIMEOUT_S = 20.0
WORLD_DEADLINE_S = 600.0  # the whole world, generous: this machine is shared

VOCAB, WIDTH, HIDDEN = 10, 8, 16
MUON_NAMES = ["hidden.0.weight", "hidden.2.weight"]
BACKUP_NAMES = ["embed.weight", "norm.weight", "norm.bias", "lm_head.weight"]

CLOSURE_TEXT = "rank-zero closure failure"
PREFLIGHT_LOCAL = "GefenMuonHybrid step preflight failed on local rank 0: "
PREFLIGHT_OTHER = "GefenMuonHybrid step preflight failed on another process-group member"
LOAD_LOCAL = "GefenMuonHybrid load validation failed on local rank 1: "
LOAD_OTHER = "GefenMuonHybrid load validation failed on another process-group member"
SCHEMA = (
    "GefenMuonHybrid checkpoint: torch's {'state', 'param_groups'} layout needs the 'gefen_hybrid' "
    "extras (a checkpoint of another optimizer, or one consolidated without them, cannot be "
    "loaded)"
)
CHILD_CAUSE = "GefenMuon checkpoint: unknown extras key 'colour'"
ADAMW_CAUSE = (
    "GefenMuonHybrid checkpoint: AdamW backup: group 0 entry 0: missing 'step' [numbered within "
    "the backup's part: its group g is the checkpoint's param_groups[g + 1], its parameter id i "
    "the checkpoint's id i + 2]"
)
LAYOUT = (
    "GefenMuonHybrid parameter layout changed after construction: backup group 0 position 0 "
    "holds a different tensor"
)
SPARSE = (
    "parameter 'lm_head.weight' has a sparse or non-strided gradient (torch.sparse_coo); "
    "Gefen optimizers need dense strided gradients"
)

AMP_FOUND_INF = (
    "GefenMuonHybrid AMP found_inf differs across process-group members; use a group-aware "
    "gradient scaler (ShardedGradScaler with scaler.unscale_(optimizer) before "
    "scaler.step(optimizer))"
)
AMP_PRESENCE = (
    "GefenMuonHybrid AMP protocol presence differs across process-group members; use the same "
    "group-aware gradient scaler on every member"
)
AMP_GRAD_SCALE = (
    "GefenMuonHybrid AMP grad_scale differs across process-group members; use a group-aware "
    "gradient scaler"
)
ORDER = (
    "GefenMuon requires identical parameter-group order on every rank of a DTensor mesh; "
    "parameters at rank-divergent positions: {names}"
)
PRESENCE = (
    "GefenMuon requires identical gradient presence on every rank of a DTensor mesh; "
    "mismatched parameters: {names}"
)

# --- helpers that run inside the spawned ranks ------------------------------------------------


class TinyLM(nn.Module):
    """Embedding, bias-free hidden matrices (optional), LayerNorm and an untied head."""

    def __init__(self, hidden: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = (
            nn.Sequential(
                nn.Linear(WIDTH, HIDDEN, bias=False),
                nn.Tanh(),
                nn.Linear(HIDDEN, WIDTH, bias=False),
            )
            if hidden
            else None
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.hidden is not None:
            x = self.hidden(x)
        return self.lm_head(self.norm(x))


def _model(shard: str = "full", *, hidden: bool = True, seed: int = 0) -> TinyLM:
    """``"full"``: every submodule, then the model, is sharded (one mesh for both halves).
    ``"backup"``: only the embedding and the norm are sharded; the hidden matrices (Muon) and
    the head stay plain tensors, so the only mesh is one the backup owns."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyLM(hidden)
    if shard == "full":
        modules: list[nn.Module] = [model.embed, model.norm, model.lm_head]
        if model.hidden is not None:
            modules[1:1] = [model.hidden[0], model.hidden[2]]
        for module in modules:
            fully_shard(module, mesh=_mesh())
        fully_shard(model, mesh=_mesh())
    elif shard == "backup":
        fully_shard(model.embed, mesh=_mesh())
        fully_shard(model.norm, mesh=_mesh())
    return model


def _hybrid(first: Any, second: Any = None, **options: Any) -> Any:
    from gefen.hybrid import GefenMuonHybrid

    options.setdefault("lr", 0.01)
    return GefenMuonHybrid(first, second, ns_steps=1, fused=False, **options)


def _tokens(rank: int, seed: int) -> torch.Tensor:
    return torch.randint(VOCAB, (6,), generator=torch.Generator().manual_seed(seed * 10 + rank))


def _backward(model: Any, rank: int, seed: int) -> None:
    """One forward/backward on a rank-dependent batch (collective under FSDP2)."""
    model(_tokens(rank, seed)).square().mean().backward()


def _assign(model: Any, seed: int) -> None:
    """The same full gradient on every rank: ``distribute_tensor`` onto a DTensor parameter's
    own mesh and placements (collective), a plain tensor otherwise."""
    from torch.distributed.tensor import distribute_tensor

    for index, param in enumerate(model.parameters()):
        generator = torch.Generator().manual_seed(seed * 100 + index)
        full = torch.randn(tuple(param.shape), generator=generator)
        if hasattr(param, "device_mesh"):
            param.grad = distribute_tensor(full, param.device_mesh, list(param.placements))
        else:
            param.grad = full


def _children(hybrid: Any) -> list[tuple[str, Any]]:
    return [(role, child) for role, child in (("muon", hybrid.muon), ("backup", hybrid.backup))
            if child is not None]  # fmt: skip


def _is_adamw(child: Any) -> bool:
    return isinstance(child, torch.optim.AdamW)


def _child_step(child: Any) -> int:
    """A Gefen-backed child's global step; an AdamW child's largest per-parameter ``step``."""
    if not _is_adamw(child):
        return int(child.global_step)
    steps = [float(entry["step"]) for entry in child.state.values() if "step" in entry]
    return int(max(steps, default=0.0))


def _steps(hybrid: Any) -> dict[str, int]:
    return {role: _child_step(child) for role, child in _children(hybrid)}


def _capture(hybrid: Any) -> dict[str, Any]:
    """Per child: a deep snapshot (SNAPSHOT_ATTRIBUTES for Gefen-backed children; state and
    param_groups for AdamW), clones of the local shards, the codebook and the global step."""
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot

    captured: dict[str, Any] = {"latch": hybrid._commit_failed}
    with torch.no_grad():
        for role, child in _children(hybrid):
            adamw = _is_adamw(child)
            attributes = () if adamw else SNAPSHOT_ATTRIBUTES
            codebook = None if adamw else child.codebook
            captured[role] = {
                "snapshot": deep_snapshot(child, attributes=attributes),
                "shards": [
                    (
                        _local(param).detach().clone(),
                        None if param.grad is None else _dense(_local(param.grad)),
                    )
                    for param in _params(child)
                ],
                "codebook": None if codebook is None else codebook.detach().clone(),
                "global_step": _child_step(child),
            }
    return captured


def _dense(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.detach()
    return grad.to_dense() if grad.layout != torch.strided else grad.clone()


def _changes(hybrid: Any, before: dict[str, Any]) -> list[str]:
    """Every difference from ``before`` in either child (empty: nothing was mutated)."""
    from gefen.dist.testing import snapshot_diff

    after = _capture(hybrid)
    changes = [] if after["latch"] == before["latch"] else ["hybrid latch differs"]
    for role in ("muon", "backup"):
        old, new = before.get(role), after.get(role)
        if old is None or new is None:
            if (old is None) != (new is None):
                changes.append(f"{role}: presence differs")
            continue
        changes.extend(f"{role}.{line}" for line in snapshot_diff(old["snapshot"], new["snapshot"]))
        if len(old["shards"]) != len(new["shards"]):
            changes.append(f"{role}: number of parameters differs")
        for index, (a, b) in enumerate(zip(old["shards"], new["shards"], strict=False)):
            if not _same(a[0], b[0]):
                changes.append(f"{role}: local parameter shard {index} differs")
            if not _same(a[1], b[1]):
                changes.append(f"{role}: local gradient shard {index} differs")
        if not _same(old["codebook"], new["codebook"]):
            changes.append(f"{role}: codebook differs")
        if old["global_step"] != new["global_step"]:
            changes.append(f"{role}: global step differs")
    return changes


def _steps_together(hybrid: Any, model: Any, seed: int) -> dict[str, Any]:
    """Fresh gradients on every rank, then one hybrid step; reports whether every non-empty
    local shard of both children moved, and each child's step count afterwards."""
    _assign(model, seed)
    params = [param for _, child in _children(hybrid) for param in _params(child)]
    before = [_local(param).detach().clone() for param in params]
    hybrid.step()
    after = [_local(param).detach() for param in params]
    moved = [not torch.equal(a, b) for a, b in zip(before, after, strict=True) if a.numel() > 0]
    return {"steps": _steps(hybrid), "moved": bool(moved) and all(moved)}


def _rejected_step(
    hybrid: Any,
    model: Any,
    fn: Callable[[], Any],
    *,
    restore: Callable[[], None] | None = None,
    recover: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Snapshot, attempt ``fn`` (timed), undo the scenario's own edit (``restore``), diff,
    optionally repair the configuration (``recover``), then step together."""
    before = _capture(hybrid)
    result = _attempt(fn)
    if restore is not None:
        restore()
    result["changes"] = _changes(hybrid, before)
    result["steps_before"] = {role: before[role]["global_step"] for role, _ in _children(hybrid)}
    result["left"] = {
        name: float(getattr(hybrid, name).item())
        for name in ("found_inf", "grad_scale")
        if name in hybrid.__dict__
    }
    for name in ("found_inf", "grad_scale"):  # GradScaler deletes them after its step
        hybrid.__dict__.pop(name, None)
    if recover is not None:
        recover()
    result["after"] = _steps_together(hybrid, model, seed=90)
    return result


def _rank_zero_closure_failure(rank: int, hybrid: Any, model: Any) -> dict[str, Any]:
    def closure() -> float:
        if rank == 0:
            raise RuntimeError(CLOSURE_TEXT)
        return 0.0

    result = _rejected_step(hybrid, model, lambda: hybrid.step(closure))
    result["scope"] = len(hybrid.step_failure_scope())
    result["muon_scope"] = None if hybrid.muon is None else len(hybrid.muon.step_failure_scope())
    result["muon_is_none"] = hybrid.muon is None
    result["backup_type"] = type(hybrid.backup).__name__
    result["backup_dtensors"] = [hasattr(p, "device_mesh") for p in _params(hybrid.backup)]
    return result


# --- scenarios -----------------------------------------------------------------------------------


def scenario_closure_failure(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """Standard ``fully_shard``: one mesh for both halves; a later step (state exists)."""
    model = _model("full")
    hybrid = _hybrid(model, backup_optimizer=backend)
    _backward(model, rank, seed=0)
    hybrid.step()
    hybrid.zero_grad()
    _backward(model, rank, seed=1)
    return _rank_zero_closure_failure(rank, hybrid, model)


def scenario_backup_mesh(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """A sharded backup with a non-sharded Muon half: the backup's mesh alone is the scope."""
    model = _model("backup")
    hybrid = _hybrid(model, backup_optimizer=backend)
    _assign(model, seed=0)
    hybrid.step()
    _assign(model, seed=1)
    return _rank_zero_closure_failure(rank, hybrid, model)


def scenario_backup_only(rank: int, world_size: int, form: str) -> dict[str, Any]:
    """``muon is None`` on a sharded backup: the vote still runs over the backup's mesh."""
    model = _model("full", hidden=False)
    if form == "module":
        hybrid = _hybrid(model)
    else:  # the two-list form with an empty Muon list
        hybrid = _hybrid([], list(model.named_parameters()))
    _assign(model, seed=0)
    hybrid.step()
    _assign(model, seed=1)
    return _rank_zero_closure_failure(rank, hybrid, model)


def scenario_amp(rank: int, world_size: int, case: str) -> dict[str, Any]:
    model = _model("full")
    hybrid = _hybrid(model)
    _assign(model, seed=0)
    hybrid.step()
    _assign(model, seed=1)
    scale = 8.0 if case != "grad_scale" or rank == 0 else 4.0
    found_inf = {"found_inf": float(rank == 0), "overflow": 1.0}.get(case, 0.0)
    if case != "presence" or rank == 0:
        # What GradScaler.step sets on an optimizer with _step_supports_amp_scaling.
        hybrid.grad_scale = torch.full((1,), scale)
        hybrid.found_inf = torch.full((1,), found_inf)
    fired: list[int] = []
    hybrid.register_step_post_hook(lambda *args: fired.append(1))
    supports = bool(hybrid._step_supports_amp_scaling)
    counted: list[int] = []

    def attempt() -> Any:
        try:
            return hybrid.step(lambda: 3.5)
        finally:
            counted.append(len(fired))  # before the recovery step fires it again

    result = _rejected_step(hybrid, model, attempt)
    result["post_hooks"] = counted[0]
    result["supports_amp"] = supports
    return result


def scenario_presence(rank: int, world_size: int, amp: bool) -> dict[str, Any]:
    model = _model("full")
    hybrid = _hybrid(model)
    _assign(model, seed=0)
    hybrid.step()
    _assign(model, seed=1)
    if rank == 1:
        model.hidden[2].weight.grad = None
    if amp:  # agreeing controls: the presence check (phase 2) runs before any unscale
        hybrid.grad_scale = torch.full((1,), 8.0)
        hybrid.found_inf = torch.full((1,), 0.0)
    return _rejected_step(hybrid, model, hybrid.step)


def _norm_gradient_missing_on_rank_one(hybrid: Any, model: Any, rank: int) -> dict[str, Any]:
    """A step whose norm weight has no gradient on rank 1 (refused), then repaired."""
    _assign(model, seed=1)
    kept = model.norm.weight.grad
    if rank == 1:
        model.norm.weight.grad = None

    def restore() -> None:
        model.norm.weight.grad = kept

    return _rejected_step(hybrid, model, hybrid.step, recover=restore)


def scenario_backup_presence(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """A backup gradient missing on rank 1 (a Gefen or an AdamW backup on FSDP2)."""
    model = _model("full")
    hybrid = _hybrid(model, backup_optimizer=backend)
    _assign(model, seed=0)
    hybrid.step()
    return _norm_gradient_missing_on_rank_one(hybrid, model, rank)


def scenario_backup_presence_unnamed(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """The param-group-dict form (no names): the norm's weight, ``param_groups[1][0]`` of the
    hybrid, has no gradient on rank 1."""
    model = _model("full")
    muon = [param for name, param in model.named_parameters() if name.startswith("hidden.")]
    rest = [param for name, param in model.named_parameters() if not name.startswith("hidden.")]
    rest.sort(key=lambda param: param is not model.norm.weight)  # the norm's weight first
    groups = [{"params": muon, "use_muon": True}, {"params": rest, "use_muon": False}]
    hybrid = _hybrid(groups, backup_optimizer=backend)
    return _norm_gradient_missing_on_rank_one(hybrid, model, rank)


def scenario_reversed(rank: int, world_size: int) -> dict[str, Any]:
    from gefen.hybrid import split_params_for_muon

    model = _model("full")
    muon, backup = split_params_for_muon(model)
    hybrid = _hybrid(muon if rank == 0 else muon[::-1], backup)
    _assign(model, seed=1)
    registered = list(hybrid.muon.param_groups[0]["param_names"])

    def recover() -> None:
        if rank == 1:  # restore the registration order rank 0 uses
            group = hybrid.muon.param_groups[0]
            group["params"].reverse()
            group["param_names"].reverse()
            # The layout registry is derived data (docs/hybrid.md §4); it follows the repair.
            hybrid.rebuild_registry()

    result = _rejected_step(hybrid, model, hybrid.step, recover=recover)
    result["registered"] = registered
    return result


def scenario_layout_swap(rank: int, world_size: int) -> dict[str, Any]:
    model = _model("full")
    hybrid = _hybrid(model)
    _assign(model, seed=0)
    hybrid.step()
    _assign(model, seed=1)
    params = hybrid.backup.param_groups[0]["params"]
    original = params[0]

    def closure() -> float:
        if rank == 0:  # a ZeRO-style swap: same list, same length, another tensor
            params[0] = nn.Parameter(original.detach().clone())
        return 0.0

    def restore() -> None:
        params[0] = original

    result = _rejected_step(hybrid, model, lambda: hybrid.step(closure), restore=restore)
    result["swapped_name"] = hybrid.backup.param_groups[0]["param_names"][0]
    return result


def scenario_sparse(rank: int, world_size: int) -> dict[str, Any]:
    """A sparse gradient on a plain backup parameter (the head) of a hybrid whose scope is the
    backup's sharded embedding/norm mesh."""
    model = _model("backup")
    hybrid = _hybrid(model)
    _assign(model, seed=0)
    hybrid.step()
    _assign(model, seed=1)
    head = model.lm_head.weight
    dense = head.grad
    if rank == 0:
        head.grad = dense.to_sparse()
    sparse_on_rank = head.grad.is_sparse

    def recover() -> None:
        head.grad = dense

    # The snapshot is taken with the sparse gradient in place: it must still be there after.
    result = _rejected_step(hybrid, model, hybrid.step, recover=recover)
    result["sparse"] = sparse_on_rank
    return result


def scenario_stale_muon_half(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 loads the file of one step earlier: the Muon half's exact state is a replica."""
    model = _model("full")
    hybrid = _hybrid(model)
    _backward(model, rank, seed=0)
    hybrid.step()
    stale = copy.deepcopy(hybrid.state_dict())
    _backward(model, rank, seed=1)
    hybrid.step()
    fresh = copy.deepcopy(hybrid.state_dict())
    result = _rejected_step(
        hybrid,
        model,
        lambda: hybrid.load_state_dict(stale if rank == 1 else fresh),
        recover=lambda: hybrid.load_state_dict(fresh),
    )
    return result


def scenario_adamw_file(rank: int, world_size: int, case: str) -> dict[str, Any]:
    """The sharded AdamW half is rank-local: rank 1 loads a stale file (``"stale"``), or the
    ranks swap their files (``"swapped"``)."""
    import torch.distributed as dist

    from gefen.hybrid.flat_layout import join, split

    model = _model("full")
    hybrid = _hybrid(model, backup_optimizer="adamw")
    _backward(model, rank, seed=0)
    hybrid.step()
    stale = copy.deepcopy(hybrid.state_dict())
    _backward(model, rank, seed=1)
    hybrid.step()
    fresh = copy.deepcopy(hybrid.state_dict())
    # Only the AdamW half is stale: a stale Muon half is a replica the load vote catches first.
    stale_backup = split(hybrid, stale)["backup"]
    chosen = join({**split(hybrid, fresh), "backup": stale_backup}) if rank == 1 else fresh
    if case == "swapped":
        files: list[Any] = [None, None]
        dist.all_gather_object(files, fresh)
        chosen = files[1 - rank]
    result = _rejected_step(
        hybrid,
        model,
        lambda: hybrid.load_state_dict(chosen),
        recover=lambda: hybrid.load_state_dict(fresh),
    )
    result["header"] = "rank_local" in fresh["gefen_hybrid"]["backup"]
    return result


def scenario_load_rejection(rank: int, world_size: int, case: str) -> dict[str, Any]:
    from gefen.dist import DistributedStepError

    model = _model("full")
    hybrid = _hybrid(model, backup_optimizer="adamw" if case == "adamw" else "gefen")
    _backward(model, rank, seed=0)
    hybrid.step()
    sd = hybrid.state_dict()  # collective: the Muon child's state_dict is
    good = copy.deepcopy(sd)
    if rank == 1:
        if case == "schema":
            sd = {"state": {}, "param_groups": []}
        elif case == "child":  # a child-level rejection: the Muon half's extras are corrupt
            sd["gefen_hybrid"]["muon"]["gefen"]["colour"] = "red"
            for group in sd["param_groups"]:
                if group["use_muon"]:
                    group["gefen"]["colour"] = "red"
        else:  # the AdamW backup's staging rejects an entry without "step"
            first = next(g for g in sd["param_groups"] if not g["use_muon"])["params"][0]
            del sd["state"][first]["step"]
    fired: list[int] = []
    hybrid.register_load_state_dict_post_hook(lambda opt: fired.append(1))
    before = _capture(hybrid)
    caught: list[bool] = []

    def load() -> None:
        try:
            hybrid.load_state_dict(sd)
        except DistributedStepError:
            caught.append(True)
            raise

    result = _attempt(load)
    result["distributed"] = bool(caught)
    result["changes"] = _changes(hybrid, before)
    result["post_hooks"] = len(fired)
    result["steps_before"] = {role: before[role]["global_step"] for role, _ in _children(hybrid)}
    hybrid.load_state_dict(good)  # the valid file loads on every rank
    result["post_hooks_after_good_load"] = len(fired)
    result["after"] = _steps_together(hybrid, model, seed=90)
    return result


def _train(hybrid: Any, model: Any, rank: int, seeds: range) -> list[float]:
    losses = []
    for seed in seeds:
        hybrid.zero_grad()
        loss = model(_tokens(rank, seed)).square().mean()
        loss.backward()
        hybrid.step()
        losses.append(float(loss.detach()))
    return losses


def _local_params(model: Any) -> list[torch.Tensor]:
    return [_local(param).detach().clone() for param in model.parameters()]


def scenario_round_trip(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    model = _model("full")
    hybrid = _hybrid(model, backup_optimizer=backend)
    losses = _train(hybrid, model, rank, range(3))
    steps_saved = _steps(hybrid)
    buffer = io.BytesIO()
    torch.save(hybrid.state_dict(), buffer)  # collective: the Muon child's state_dict is
    weights = model.state_dict()

    fresh_model = _model("full", seed=1)  # other initial weights, then the same ones
    fresh_model.load_state_dict(weights)
    fresh = _hybrid(fresh_model, backup_optimizer=backend)
    same_start = all(
        torch.equal(a, b)
        for a, b in zip(_local_params(model), _local_params(fresh_model), strict=True)
    )
    buffer.seek(0)
    elapsed, error, _ = timed(lambda: fresh.load_state_dict(torch.load(buffer, weights_only=True)))
    steps_loaded = _steps(fresh)

    control_model = _model("full", seed=1)  # the same weights without the optimizer state
    control_model.load_state_dict(weights)
    control = _hybrid(control_model, backup_optimizer=backend)

    _train(hybrid, model, rank, range(3, 5))
    _train(fresh, fresh_model, rank, range(3, 5))
    _train(control, control_model, rank, range(3, 5))
    resumed = [
        torch.equal(a, b)
        for a, b in zip(_local_params(model), _local_params(fresh_model), strict=True)
    ]
    control_equal = [
        torch.equal(a, b)
        for a, b in zip(_local_params(model), _local_params(control_model), strict=True)
    ]
    return {
        "losses": losses,
        "load_error": error,
        "elapsed": elapsed,
        "same_start": same_start,
        "steps_saved": steps_saved,
        "steps_loaded": steps_loaded,
        "steps_final": (_steps(hybrid), _steps(fresh)),
        "resumed": resumed,
        "control_equal": control_equal,
        "codebooks_equal": [
            _same(a.codebook, b.codebook)
            for (_, a), (_, b) in zip(_children(hybrid), _children(fresh), strict=True)
            if not _is_adamw(a)
        ],
    }


def scenario_children_differ(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's hybrid holds the backup alone (every parameter routed to it), rank 0's both
    children, and each takes a state dict (the torchtitan flow does before any step)."""
    model = _model("full")
    hybrid = _hybrid(model) if rank == 0 else _hybrid([], list(model.named_parameters()))
    elapsed, error, _ = timed(hybrid.state_dict)
    return {"elapsed": elapsed, "error": error, "children": hybrid.muon is not None}


SCENARIOS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("children_differ", scenario_children_differ, ()),
    ("closure_gefen", scenario_closure_failure, ("gefen",)),
    ("closure_adamw", scenario_closure_failure, ("adamw",)),
    ("backup_mesh_gefen", scenario_backup_mesh, ("gefen",)),
    ("backup_mesh_adamw", scenario_backup_mesh, ("adamw",)),
    ("backup_only_module", scenario_backup_only, ("module",)),
    ("backup_only_lists", scenario_backup_only, ("lists",)),
    ("amp_found_inf", scenario_amp, ("found_inf",)),
    ("amp_presence", scenario_amp, ("presence",)),
    ("amp_grad_scale", scenario_amp, ("grad_scale",)),
    ("amp_overflow", scenario_amp, ("overflow",)),
    ("presence", scenario_presence, (False,)),
    ("presence_amp", scenario_presence, (True,)),
    ("backup_presence_gefen", scenario_backup_presence, ("gefen",)),
    ("backup_presence_adamw", scenario_backup_presence, ("adamw",)),
    ("backup_presence_unnamed_gefen", scenario_backup_presence_unnamed, ("gefen",)),
    ("backup_presence_unnamed_adamw", scenario_backup_presence_unnamed, ("adamw",)),
    ("reversed", scenario_reversed, ()),
    ("layout_swap", scenario_layout_swap, ()),
    ("sparse", scenario_sparse, ()),
    ("load_schema", scenario_load_rejection, ("schema",)),
    ("load_child", scenario_load_rejection, ("child",)),
    ("load_adamw", scenario_load_rejection, ("adamw",)),
    ("stale_muon_half", scenario_stale_muon_half, ()),
    ("adamw_stale", scenario_adamw_file, ("stale",)),
    ("adamw_swapped", scenario_adamw_file, ("swapped",)),
    ("round_trip_gefen", scenario_round_trip, ("gefen",)),
    ("round_trip_adamw", scenario_round_trip, ("adamw",)),
]


# --- the parent's assertions ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rank_deadline_s=WORLD_DEADLINE_S, pg_timeout_s=PG_TIMEOUT_S)


def _unchanged_and_trains(results: list[dict[str, Any]]) -> None:
    """Nothing mutated in either child on any rank, within the bound; then one more step on
    every rank advances every present child by one and moves every local shard."""
    assert len(results) == 2
    for result in results:
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        expected = {role: step + 1 for role, step in result["steps_before"].items()}
        assert result["after"] == {"steps": expected, "moved": True}


def _voted(results: list[dict[str, Any]], local_cause: str) -> None:
    """Rank 0 failed locally with ``local_cause``; rank 1 learns of it from the vote."""
    first, second = results
    assert first["error"] == f"DistributedStepError: {PREFLIGHT_LOCAL}{local_cause}"
    assert (first["phase"], first["local_failure"], first["rank"]) == ("step preflight", True, 0)
    assert second["error"] == f"DistributedStepError: {PREFLIGHT_OTHER}"
    assert second["cause"] is None
    assert (second["phase"], second["local_failure"], second["rank"]) == (
        "step preflight",
        False,
        None,
    )


def _agreement_error(results: list[dict[str, Any]], message: str, what: str) -> None:
    for result in results:
        assert result["error"] == f"GroupAgreementError: {message}"
        assert result["what"] == what


class TestGlooWorld2:
    pytestmark: ClassVar[list[Any]] = [pytest.mark.multirank, gloo_required()]

    @pytest.mark.parametrize(
        ("backend", "backup_type"),
        [pytest.param("gefen", "Gefen", marks=pytest.mark.smoke), ("adamw", "AdamW")],
    )
    def test_rank_zero_closure_failure_is_voted_over_both_children(
        self, world: ScenarioWorld, backend: str, backup_type: str
    ) -> None:
        results = world[f"closure_{backend}"]
        _voted(results, CLOSURE_TEXT)
        assert results[0]["cause"] == f"RuntimeError: {CLOSURE_TEXT}"
        for result in results:
            assert result["backup_type"] == backup_type
            assert result["scope"] == 1  # one mesh for both halves: no extra channel
            assert result["muon_scope"] == 1
            assert result["steps_before"] == {"muon": 1, "backup": 1}
        _unchanged_and_trains(results)

    @pytest.mark.parametrize(("backend", "backup_type"), [("gefen", "Gefen"), ("adamw", "AdamW")])
    def test_backup_only_mesh_closure_failure_fans_out(
        self, world: ScenarioWorld, backend: str, backup_type: str
    ) -> None:
        results = world[f"backup_mesh_{backend}"]
        _voted(results, CLOSURE_TEXT)
        assert results[0]["cause"] == f"RuntimeError: {CLOSURE_TEXT}"
        for result in results:
            assert result["backup_type"] == backup_type
            assert result["muon_scope"] == 0  # the Muon half is plain tensors
            assert result["scope"] == 1  # the mesh only the backup owns
            # embed.weight, norm.weight, norm.bias are sharded; the head is plain.
            assert result["backup_dtensors"] == [True, True, True, False]
        _unchanged_and_trains(results)

    @pytest.mark.parametrize("form", ["module", "lists"])
    def test_backup_only_hybrid_votes_a_closure_failure(
        self, world: ScenarioWorld, form: str
    ) -> None:
        results = world[f"backup_only_{form}"]
        _voted(results, CLOSURE_TEXT)
        assert results[0]["cause"] == f"RuntimeError: {CLOSURE_TEXT}"
        for result in results:
            assert result["muon_is_none"] is True
            assert result["scope"] == 1
            assert result["steps_before"] == {"backup": 1}
        _unchanged_and_trains(results)

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
        _agreement_error(results, message, what)
        for result in results:
            assert result["supports_amp"] is True
            assert result["left"] == {}  # the step drops GradScaler's controls when it raises
            assert result["post_hooks"] == 0
        _unchanged_and_trains(results)  # both children untouched, gradients not unscaled

    def test_group_wide_amp_overflow_skips_both_children(self, world: ScenarioWorld) -> None:
        results = world["amp_overflow"]
        for result in results:
            assert result["error"] is None
            assert result["value"] == 3.5  # the closure's loss is still returned
            assert result["left"] == {"found_inf": 1.0, "grad_scale": 8.0}  # never touched
            assert result["post_hooks"] == 1  # the hybrid's post-hook, exactly once per rank
        _unchanged_and_trains(results)

    @pytest.mark.parametrize("amp", [False, True])
    def test_muon_gradient_presence_mismatch_leaves_both_children(
        self, world: ScenarioWorld, amp: bool
    ) -> None:
        results = world["presence_amp" if amp else "presence"]
        _agreement_error(results, PRESENCE.format(names="hidden.2.weight"), "gradient presence")
        for result in results:
            # Raised in phase 2, before phase 3 read the controls: no gradient is unscaled
            # (no changes), and GradScaler's attributes are deleted, as after any failed step
            # (left behind, the retry's scaler.step would unscale by the scale squared).
            assert result["left"] == {}
        _unchanged_and_trains(results)

    @pytest.mark.parametrize("backend", ["gefen", "adamw"])
    def test_a_backup_gradient_missing_on_one_rank_fails_every_rank(
        self, world: ScenarioWorld, backend: str
    ) -> None:
        # It used to be accepted: the rank without it skipped that backup shard silently.
        results = world[f"backup_presence_{backend}"]
        message = (  # the parameter used to go unnamed
            "GefenMuonHybrid step preflight: gradient presence differs across the process-group "
            "members (every member must present the same; nothing was changed); parameters "
            "with a gradient on some members only: 'norm.weight'"
        )
        _agreement_error(results, message, "gradient presence")
        _unchanged_and_trains(results)

    @pytest.mark.parametrize("backend", ["gefen", "adamw"])
    def test_an_unnamed_backup_parameter_is_named_by_the_hybrids_groups(
        self, world: ScenarioWorld, backend: str
    ) -> None:
        # It named the backup's own param_groups[0][0]: the hybrid's first Muon matrix.
        results = world[f"backup_presence_unnamed_{backend}"]
        message = (
            "GefenMuonHybrid step preflight: gradient presence differs across the process-group "
            "members (every member must present the same; nothing was changed); parameters "
            "with a gradient on some members only: param_groups[1][0]"
        )
        _agreement_error(results, message, "gradient presence")
        _unchanged_and_trains(results)

    def test_a_stale_muon_half_on_one_rank_fails_every_rank(self, world: ScenarioWorld) -> None:
        # It used to load: the Muon replicas then diverged silently.
        results = world["stale_muon_half"]
        message = (
            "GefenMuonHybrid load validation: replicated state differs across the "
            "process-group members (every member must present the same; nothing was changed)"
        )
        _agreement_error(results, message, "replicated state")
        _unchanged_and_trains(results)

    def test_a_stale_adamw_file_on_one_rank_fails_every_rank(self, world: ScenarioWorld) -> None:
        # It used to load on that rank alone: its AdamW moments were a step behind the others'.
        results = world["adamw_stale"]
        message = "GefenMuonHybrid rank-local checkpoint differs across process-group members: tag"
        _agreement_error(results, message, "tag")
        assert all(result["header"] for result in results)
        _unchanged_and_trains(results)

    def test_another_ranks_adamw_file_is_refused_on_every_rank(self, world: ScenarioWorld) -> None:
        results = world["adamw_swapped"]
        for result in results:
            assert result["error"].startswith("DistributedStepError: GefenMuonHybrid load ")
            assert "rank-local checkpoint topology differs" in (result["cause"] or result["error"])
        assert any(result["local_failure"] for result in results)
        _unchanged_and_trains(results)

    def test_reversed_muon_order_on_one_rank(self, world: ScenarioWorld) -> None:
        results = world["reversed"]
        assert results[0]["registered"] == MUON_NAMES
        assert results[1]["registered"] == MUON_NAMES[::-1]
        _agreement_error(results, ORDER.format(names=", ".join(MUON_NAMES)), "parameter order")
        _unchanged_and_trains(results)

    def test_closure_swapping_a_backup_parameter_is_voted(self, world: ScenarioWorld) -> None:
        results = world["layout_swap"]
        _voted(results, LAYOUT)
        assert results[0]["cause"] == f"RuntimeError: {LAYOUT}"
        for result in results:
            assert result["swapped_name"] == "embed.weight"
        _unchanged_and_trains(results)

    def test_sparse_backup_gradient_on_rank_zero_is_voted(self, world: ScenarioWorld) -> None:
        results = world["sparse"]
        assert [result["sparse"] for result in results] == [True, False]
        _voted(results, SPARSE)
        assert results[0]["cause"] == f"RuntimeError: {SPARSE}"
        _unchanged_and_trains(results)

    @pytest.mark.parametrize(
        ("case", "cause"),
        [
            pytest.param("schema", SCHEMA, marks=pytest.mark.smoke),
            ("child", CHILD_CAUSE),
            ("adamw", ADAMW_CAUSE),
        ],
    )
    def test_load_rejected_on_one_rank_commits_nowhere(
        self, world: ScenarioWorld, case: str, cause: str
    ) -> None:
        first, second = world[f"load_{case}"]
        assert first["error"] == f"DistributedStepError: {LOAD_OTHER}"
        assert first["cause"] is None
        assert second["error"] == f"DistributedStepError: {LOAD_LOCAL}{cause}"
        assert second["cause"] == f"ValueError: {cause}"
        for result in (first, second):
            assert result["distributed"] is True
            assert result["phase"] == "load validation"
            assert result["post_hooks"] == 0
            assert result["post_hooks_after_good_load"] == 1
        _unchanged_and_trains([first, second])

    @pytest.mark.parametrize("backend", ["gefen", "adamw"])
    def test_training_round_trip_resumes_bit_exactly(
        self, world: ScenarioWorld, backend: str
    ) -> None:
        for result in world[f"round_trip_{backend}"]:
            assert result["load_error"] is None
            assert result["elapsed"] < DEADLINE_S
            assert result["same_start"] is True
            assert result["steps_saved"] == {"muon": 3, "backup": 3}
            assert result["steps_loaded"] == {"muon": 3, "backup": 3}
            assert result["steps_final"] == ({"muon": 5, "backup": 5}, {"muon": 5, "backup": 5})
            assert result["resumed"] == [True] * len(MUON_NAMES + BACKUP_NAMES)
            # Without the loaded state the same weights follow another trajectory.
            assert not all(result["control_equal"])
            assert all(result["codebooks_equal"])


def test_hybrids_holding_other_children_fail_a_state_dict_on_every_rank(
    world: ScenarioWorld,
) -> None:
    # Rank 0's Muon child's state dict vote met rank 1's backup's (the same phase, and the
    # operation word left out the owner): rank 1 returned a state dict, and rank 0 waited in its
    # backup's vote until the process group's timeout.
    results = world["children_differ"]
    assert [result["children"] for result in results] == [True, False]
    for result, owner in zip(results, ("GefenMuon", "Gefen"), strict=True):
        assert result["error"].startswith(f"GroupAgreementError: {owner} state dict preflight: ")
        assert "another process-group member is in a different operation" in result["error"]
        assert result["elapsed"] < DEADLINE_S
