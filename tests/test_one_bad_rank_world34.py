"""One bad rank at world 3 and 4 (FSDP2 on a CPU mesh, uneven ``Shard(0)`` chunks at world 3,
and HSDP on a 2 x 2 mesh at world 4), for Gefen, GefenMuon (``exact`` and ``approx``) and the
hybrid with either backup. On the last rank: a raising closure, a missing gradient (of either
hybrid half), a NaN gradient, AMP controls that saw an overflow only there, a checkpoint with a
NaN moment (in the hybrid's Muon half or its backup), and a stale replica (one step older).
Every rank must reject the operation with the same kind of error, change nothing, and then
train bit-identically to an untouched twin.

Scenario functions are module-level so the spawned children load them by reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios, timed

pytestmark = [pytest.mark.multirank, gloo_required()]

DEADLINE_S = 30.0  # the liveness bound of one rejected operation
KINDS = ("gefen", "muon_exact", "muon_approx", "hybrid_gefen", "hybrid_adamw")
FAULTS = ("closure", "missing_grad", "nan_grad", "amp_found_inf", "bad_load", "stale")
# Replicated state: GefenMuon exact and the hybrid's Muon half (exact by default); Gefen's and
# approx state is rank-local, so a file of another step is its rank-local header's business.
STALE_KINDS = ("muon_exact", "hybrid_gefen", "hybrid_adamw")


def _model(world: int, hsdp: bool = False) -> nn.Module:
    """FSDP2 over all ranks, or HSDP (``hsdp``: a (2, world / 2) mesh, replicated over its first
    dimension and sharded over its second)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # The last bias is the hybrid's backup parameter (1-D); the weights go to Muon.
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 4))
    shape = (2, world // 2) if hsdp else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(kind: str, model: nn.Module) -> Any:
    if kind == "gefen":
        from gefen.core import Gefen

        return Gefen(model.parameters(), lr=0.01)
    if kind.startswith("hybrid"):
        from gefen.hybrid import GefenMuonHybrid

        backup = kind.split("_")[1]
        return GefenMuonHybrid(model, lr=0.02, ns_steps=1, fused=False, backup_optimizer=backup)
    from gefen.muon import GefenMuon

    mode = kind.split("_")[1]
    matrices = [param for param in model.parameters() if param.ndim == 2]
    return GefenMuon(matrices, lr=0.02, ns_steps=1, fused=False, sharded_mode=mode)


def _backward(model: nn.Module, rank: int, seed: int) -> None:
    batch = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed * 10 + rank))
    model(batch).square().mean().backward()


def _snapshot(optimizer: Any) -> Any:
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import deep_snapshot

    return deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)


def _pair(kind: str, world: int, rank: int, hsdp: bool = False) -> tuple[Any, ...]:
    """The model and optimizer under test and an untouched twin, both two steps in."""
    model, twin_model = _model(world, hsdp), _model(world, hsdp)
    optimizer, twin = _optimizer(kind, model), _optimizer(kind, twin_model)
    for seed in range(2):
        for net, opt in ((model, optimizer), (twin_model, twin)):
            opt.zero_grad()
            _backward(net, rank, seed)
            opt.step()
    for net, opt in ((model, optimizer), (twin_model, twin)):
        opt.zero_grad()
        _backward(net, rank, 7)
    return model, optimizer, twin_model, twin


def _same(model: nn.Module, twin_model: nn.Module) -> bool:
    return all(
        torch.equal(a.to_local(), b.to_local())  # type: ignore[operator]
        for a, b in zip(model.parameters(), twin_model.parameters(), strict=True)
    )


def _poison_first_moment(saved: Any) -> bool:
    """Write NaN into the first non-empty floating tensor under a ``"state"`` key (depth first);
    where this rank's shards are all empty (world 3 splits a 4-element bias 2/2/0), make the
    first entry's counter (``step``, or ``period`` of a pristine entry) negative instead."""
    states = list(_states(saved))
    return any(_poison_any(state) for state in states) or any(_negate_counter(s) for s in states)


def _backup_half(saved: dict[str, Any]) -> dict[str, Any]:
    """The hybrid backup's entries of a flat checkpoint (the same dicts: poisoning them
    poisons ``saved``)."""
    ids = [i for group in saved["param_groups"] if not group["use_muon"] for i in group["params"]]
    return {"state": {i: saved["state"][i] for i in ids if i in saved["state"]}}


def _states(saved: Any) -> Any:
    if isinstance(saved, dict):
        for key, value in saved.items():
            if key == "state":
                yield value
            else:
                yield from _states(value)


def _poison_any(value: Any) -> bool:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.numel() > 0:
            local.view(-1)[0] = float("nan")
            return True
    if isinstance(value, dict):
        return any(_poison_any(item) for item in value.values())
    return False


def _negate_counter(state: Any) -> bool:
    for entry in state.values():
        for key in ("step", "period"):
            if isinstance(entry, dict) and type(entry.get(key)) is int:
                entry[key] = -1
                return True
    return False


def scenario_bad_rank(
    rank: int, world: int, kind: str, fault: str, hsdp: bool = False
) -> dict[str, Any]:
    from gefen.dist.testing import snapshot_diff

    model, optimizer, twin_model, twin = _pair(kind, world, rank, hsdp)
    last = rank == world - 1
    action: Any = optimizer.step
    repair: Any = None
    if fault == "closure":

        def closure() -> None:
            if last:
                raise KeyError("closure failed on the last rank")

        def action() -> Any:
            return optimizer.step(closure)

    elif fault in ("missing_grad", "missing_backup_grad", "nan_grad"):
        # At world 3 the last rank's chunk of the (4, 16) weight is empty; its (16, 8) one is not.
        weight = {"missing_grad": model[2].weight, "nan_grad": model[0].weight}.get(
            fault, model[2].bias
        )
        kept = weight.grad
        if last and fault != "nan_grad":
            weight.grad = None
        elif last:
            weight.grad = kept.clone()
            weight.grad.to_local().view(-1)[0] = float("nan")

        def repair() -> None:
            weight.grad = kept

    elif fault == "amp_found_inf":
        # What GradScaler.step sets on an optimizer with _step_supports_amp_scaling; a scaler
        # that is not group-aware saw the overflow on the last rank only.
        optimizer.grad_scale = torch.ones(1)
        optimizer.found_inf = torch.full((1,), float(last))

    elif fault in ("bad_load", "bad_backup_load"):
        import copy

        saved = copy.deepcopy(optimizer.state_dict())
        if last:
            assert _poison_first_moment(
                _backup_half(saved) if fault == "bad_backup_load" else saved
            )

        def action() -> Any:
            return optimizer.load_state_dict(saved)

    else:  # "stale": the last rank loads the file of one step earlier
        stale = optimizer.state_dict()
        import copy

        stale = copy.deepcopy(stale)
        optimizer.step()
        twin.step()
        fresh = copy.deepcopy(optimizer.state_dict())
        for net, opt in ((model, optimizer), (twin_model, twin)):
            opt.zero_grad()
            _backward(net, rank, 8)

        def action() -> Any:
            return optimizer.load_state_dict(stale if last else fresh)

    before = _snapshot(optimizer)
    elapsed, error, _ = timed(action)
    changes = snapshot_diff(before, _snapshot(optimizer))
    if repair is not None:
        repair()
    optimizer.step()  # the repaired step, on every rank together
    twin.step()
    return {
        "elapsed": elapsed,
        "error": error,
        "changes": changes,
        "same": _same(model, twin_model),
    }


CASES = [
    (kind, fault) for kind in KINDS for fault in FAULTS if fault != "stale" or kind in STALE_KINDS
] + [
    (kind, fault)
    for kind in KINDS
    if kind.startswith("hybrid")
    for fault in ("missing_backup_grad", "bad_backup_load")
]


def _scenarios(hsdp: bool) -> list[tuple[str, Any, tuple[Any, ...]]]:
    return [(f"{kind}-{fault}", scenario_bad_rank, (kind, fault, hsdp)) for kind, fault in CASES]


@pytest.fixture(
    scope="module", params=[(3, False), (4, False), (4, True)], ids=["world3", "world4", "hsdp2x2"]
)
def world(request: pytest.FixtureRequest) -> tuple[int, ScenarioWorld]:
    size, hsdp = request.param
    scenarios = _scenarios(hsdp)
    return size, run_scenarios(scenarios, size, rank_deadline_s=600.0, pg_timeout_s=180.0)


OWNERS = {"gefen": "Gefen", "muon_exact": "GefenMuon", "muon_approx": "GefenMuon"}
VOTED = {  # fault -> (phase, what the last rank's own error says)
    "closure": ("step preflight", "closure failed on the last rank"),
    "nan_grad": ("step preflight", "has a non-finite gradient (NaN or Inf)"),
    "bad_load": ("load validation", "checkpoint: entry"),
    "bad_backup_load": ("load validation", "checkpoint: "),
}
AGREED = {  # fault -> the GroupAgreementError every rank raises
    "missing_grad": "{owner} step preflight: gradient presence differs",
    "missing_backup_grad": "{owner} step preflight: gradient presence differs",
    "amp_found_inf": "{owner} AMP found_inf differs across process-group members",
    "stale": "{owner} load validation: replicated state differs",
}


def _expected(kind: str, fault: str, rank: int, size: int) -> tuple[str, str | None]:
    """The error's prefix on ``rank``, and a text the last rank's own cause must contain."""
    owner = OWNERS.get(kind, "GefenMuonHybrid")
    if fault in VOTED:
        phase, cause = VOTED[fault]
        if rank == size - 1:
            return f"DistributedStepError: {owner} {phase} failed on local rank {rank}: ", cause
        return f"DistributedStepError: {owner} {phase} failed on another process-group member", None
    if fault == "missing_grad" and kind != "gefen" and kind != "muon_approx":
        # GefenMuon exact (alone or as the hybrid's Muon half) checks presence itself, naming
        # the matrix; its check runs before the vote's presence words are compared.
        named = "2.weight" if kind.startswith("hybrid") else "param_groups[0][1]"
        return "GroupAgreementError: GefenMuon requires identical gradient presence", named
    return "GroupAgreementError: " + AGREED[fault].format(owner=owner), None


@pytest.mark.parametrize(("kind", "fault"), CASES)
def test_one_bad_rank_fails_every_rank_cleanly_and_training_stays_bit_identical(
    world: tuple[int, ScenarioWorld], kind: str, fault: str
) -> None:
    size, results = world
    outcomes = results[f"{kind}-{fault}"]
    assert len(outcomes) == size
    for rank, result in enumerate(outcomes):
        assert result["error"] is not None, f"rank {rank} accepted the bad operation"
        prefix, cause = _expected(kind, fault, rank, size)
        assert result["error"].startswith(prefix), (rank, result["error"])
        if cause is not None:
            assert cause in result["error"], (rank, result["error"])
        assert result["elapsed"] < DEADLINE_S
        assert result["changes"] == []
        assert result["same"], f"rank {rank}: training after the rejection left the twin"
