"""A refused load whose state dict is the optimizer's own live state (a DCP load template:
``get_optimizer_state_dict`` hands out the live tensors and ``dcp.load`` fills them in place)
has already written the file into the optimizer. The refusal used to leave it training on the
refused values (a NaN scale turned the parameters NaN; another sharded mode's momentum was used
silently); it now latches it until a valid checkpoint loads (docs/core.md §8.2)."""

from __future__ import annotations

import copy
import pathlib
import types
from collections.abc import Callable

import pytest
import torch

from gefen.core import Gefen
from gefen.hybrid import GefenMuonHybrid
from gefen.muon import GefenMuon


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


BUILDERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "gefen": lambda model: Gefen(model.parameters(), lr=1e-2),
    "muon": lambda model: GefenMuon(
        [param for param in model.parameters() if param.ndim == 2], lr=1e-2
    ),
    "hybrid": lambda model: GefenMuonHybrid.from_model(model, lr=1e-2),
}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_continues_alike(ours: tuple, theirs: tuple) -> None:
    """Two (model, optimizer) pairs train two more steps on the same batches bit for bit."""
    for model, optimizer in (ours, theirs):
        torch.manual_seed(5)
        _train(model, optimizer, 2)
    for mine, other in zip(ours[0].parameters(), theirs[0].parameters(), strict=True):
        assert torch.equal(mine, other)


def _a_live_scale(state_dict: dict) -> torch.Tensor:
    """The first ``momentum_scale`` of the state dict (nested per child for the hybrid)."""
    for key in ("state", "muon"):
        if key in state_dict:
            inner = state_dict[key] if key == "state" else state_dict[key]["state"]
            return next(entry["momentum_scale"] for entry in inner.values() if entry)
    raise AssertionError("no momentum_scale")


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_refused_load_written_into_the_live_state_latches(kind: str) -> None:
    model = _model()
    optimizer = BUILDERS[kind](model)
    _train(model, optimizer, 2)
    saved = copy.deepcopy(optimizer.state_dict())  # a valid checkpoint to come back to
    template = optimizer.state_dict()
    _a_live_scale(template).fill_(float("nan"))  # what dcp.load of a corrupt file does
    with pytest.raises(ValueError, match="must be finite"):
        optimizer.load_state_dict(template)
    assert optimizer.latched
    with pytest.raises(RuntimeError, match="refused load had already been written"):
        _train(model, optimizer, 1)
    optimizer.load_state_dict(saved)  # clears the latch
    assert not optimizer.latched
    _train(model, optimizer, 1)
    assert all(torch.isfinite(param).all() for param in model.parameters())


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_own_state_dict_still_loads_and_a_copy_refused_changes_nothing(kind: str) -> None:
    model = _model()
    optimizer = BUILDERS[kind](model)
    _train(model, optimizer, 2)
    optimizer.load_state_dict(optimizer.state_dict())  # in place and valid: loads
    corrupt = copy.deepcopy(optimizer.state_dict())
    _a_live_scale(corrupt).fill_(float("nan"))
    with pytest.raises(ValueError, match="must be finite"):
        optimizer.load_state_dict(corrupt)
    assert not optimizer.latched  # a copy: nothing was written, nothing to latch
    _train(model, optimizer, 1)


def test_another_optimizers_commit_does_not_hide_the_write() -> None:
    """The note of what was handed out is each optimizer's own: a process-wide count of commits
    let one optimizer's load (a DCP resume of two optimizers) or step disarm the other's."""
    first_model, second_model = _model(), _model()
    first, second = Gefen(first_model.parameters(), lr=1e-2), Gefen(second_model.parameters())
    _train(first_model, first, 2)
    _train(second_model, second, 2)
    first_template, second_template = first.state_dict(), second.state_dict()
    _a_live_scale(first_template).fill_(float("nan"))
    second.load_state_dict(second_template)  # valid: loads, and commits
    _train(second_model, second, 1)
    with pytest.raises(ValueError, match="must be finite"):
        first.load_state_dict(first_template)
    assert first.latched
    assert not second.latched


def test_the_optimizers_own_codebook_refresh_is_not_a_foreign_write() -> None:
    """A refresh remaps the codes in place: the optimizer's own write, no reason to latch."""
    model = _model()
    optimizer = Gefen(model.parameters(), lr=1e-2)
    _train(model, optimizer, 2)
    template = optimizer.state_dict()
    model(torch.randn(8, 16)).square().mean().backward()
    assert optimizer.refresh_codebook()
    with pytest.raises(TypeError, match="checkpoint_binding"):
        optimizer.load_state_dict(template, checkpoint_binding=object())
    assert not optimizer.latched
    _train(model, optimizer, 1)


STALE_BUILDERS = {
    **BUILDERS,
    "hybrid-adamw": lambda model: GefenMuonHybrid.from_model(
        model, lr=1e-2, backup_optimizer="adamw"
    ),
}


@pytest.mark.parametrize("kind", STALE_BUILDERS)
def test_a_state_dict_handed_out_before_a_step_is_refused_and_a_copy_rolls_back(
    kind: str,
) -> None:
    """``sd = opt.state_dict(); opt.step(); opt.load_state_dict(sd)`` used to be accepted: the
    dict's tensors are the live ones, moved on by the step, its counters are not, and the load
    mixed the two (the next steps differed from a run resumed at ``sd``). It is refused by name,
    nothing changes; a deep copy taken at the same moment rolls back bit for bit."""
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    model = _model()
    optimizer = STALE_BUILDERS[kind](model)
    _train(model, optimizer, 2)
    handed_out = optimizer.state_dict()
    kept = copy.deepcopy(handed_out)
    twin_model, twin = copy.deepcopy((model, optimizer))  # one memo: twin steps twin_model
    _train(model, optimizer, 1)
    optimizer.state_dict()  # a later state_dict() (a log, a save) hides nothing
    before = deep_snapshot(optimizer)
    with pytest.raises(ValueError, match="handed out by state_dict\\(\\) before its last step"):
        optimizer.load_state_dict(handed_out)
    assert snapshot_diff(before, deep_snapshot(optimizer)) == []
    model.load_state_dict(twin_model.state_dict())
    optimizer.load_state_dict(kept)  # the rollback a copy makes
    _assert_continues_alike((model, optimizer), (twin_model, twin))


@pytest.mark.parametrize("kind", ["gefen", "hybrid"])
def test_a_state_dict_handed_out_before_a_codebook_refresh_is_refused(kind: str) -> None:
    """A manual ``refresh_codebook()`` remaps the live codes in place and moves no step count,
    so a dict handed out before it used to load: the new codes beside the old codebook. Its
    codebook is not the live one any more; it is refused by name, nothing changes, and a copy
    taken at the same moment rolls back bit for bit."""
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    model = _model()
    optimizer = BUILDERS[kind](model)
    refreshing = optimizer if kind == "gefen" else optimizer.backup
    _train(model, optimizer, 2)
    handed_out = optimizer.state_dict()
    kept = copy.deepcopy(handed_out)
    twin_model, twin = copy.deepcopy((model, optimizer))
    (model(torch.randn(8, 16)).square().mean() * 1e4).backward()
    assert refreshing.refresh_codebook()
    optimizer.zero_grad()
    before = deep_snapshot(optimizer)
    with pytest.raises(ValueError, match="before its last step \\(or codebook refresh\\)"):
        optimizer.load_state_dict(handed_out)
    assert snapshot_diff(before, deep_snapshot(optimizer)) == []
    optimizer.load_state_dict(kept)
    model.load_state_dict(twin_model.state_dict())
    _assert_continues_alike((model, optimizer), (twin_model, twin))


def test_a_state_dict_handed_out_before_the_first_codebook_still_loads() -> None:
    """Format 2 presents a zero codebook slot while none is learned: no older codebook, so a
    dict taken then is not stale once ``initialize_codebook()`` has learned one."""
    torch.manual_seed(0)
    plain, coded = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    groups = [{"params": plain.parameters(), "momentum_codec": "none"}]
    optimizer = Gefen([*groups, {"params": coded.parameters()}], lr=1e-2)
    for _ in range(2):
        plain(torch.randn(4, 16)).square().mean().backward()
        for param in coded.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
    handed_out = optimizer.state_dict()
    coded(torch.randn(4, 16)).square().mean().backward()
    assert optimizer.initialize_codebook()
    optimizer.load_state_dict(handed_out)
    assert optimizer.codebook is None
    assert not optimizer.latched


def _child_refresh(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The hybrid's Gefen child refreshes its codebook itself (its own write, not the hybrid's)."""
    (model(torch.randn(8, 16)).square().mean() * 1e4).backward()
    assert optimizer.backup.refresh_codebook()
    optimizer.zero_grad()


def _failed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A hybrid step refused in its first child's read-only phase 4: nothing is written."""
    muon = optimizer.muon

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("refused in phase 4")

    muon._prepare_step = refuse
    try:
        with pytest.raises(RuntimeError, match="refused in phase 4"):
            _train(model, optimizer, 1)
    finally:
        del muon._prepare_step
    optimizer.zero_grad()
    assert not optimizer.latched


def _child_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The hybrid's Muon child steps by itself (its own write, outside the hybrid's step)."""
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.muon.step()
    optimizer.zero_grad()


BETWEEN = {
    "step": lambda model, optimizer: _train(model, optimizer, 1),
    "child_refresh": _child_refresh,
    "child_step": _child_step,
    "failed_step": _failed_step,
}


@pytest.mark.parametrize(
    ("kind", "between"),
    [(kind, "step") for kind in STALE_BUILDERS]
    + [("hybrid", "child_refresh"), ("hybrid", "child_step")]
    + [("hybrid", "failed_step"), ("hybrid-adamw", "failed_step")],
)
@pytest.mark.parametrize("write", ["nan", "older_file"])
def test_a_template_kept_across_an_own_write_is_still_read_as_written_in_place(
    kind: str, between: str, write: str
) -> None:
    """A template handed out before a step (or, in the hybrid, a child's own refresh or step, or
    a step refused before any write) and filled after it (``dcp.load`` into a template kept from
    earlier) lost its note there: a NaN file was refused without a latch, though it was in the
    live state already, and the next step trained on it (NaN parameters); an older valid file
    was refused as stale. The optimizer's own writes are renoted now: the NaN file latches, and
    the older file loads, as a copy of it would."""
    model = _model()
    optimizer = STALE_BUILDERS[kind](model)
    _train(model, optimizer, 2)
    older = copy.deepcopy(optimizer.state_dict())
    twin_model, twin = copy.deepcopy((model, optimizer))
    template = optimizer.state_dict()
    BETWEEN[between](model, optimizer)
    if write == "nan":
        _a_live_scale(template).fill_(float("nan"))
        with pytest.raises(ValueError, match="must be finite"):
            optimizer.load_state_dict(template)
        assert optimizer.latched
        with pytest.raises(RuntimeError, match="refused load had already been written"):
            _train(model, optimizer, 1)
        model.zero_grad()
        optimizer.load_state_dict(older)  # a valid checkpoint clears it
    else:
        for entry, saved in zip(template["state"].values(), older["state"].values(), strict=True):
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    value.copy_(saved[key])  # what dcp.load of the older file does
        optimizer.load_state_dict(template)
    assert not optimizer.latched
    model.load_state_dict(twin_model.state_dict())
    _assert_continues_alike((model, optimizer), (twin_model, twin))


def _latch_by_a_refused_fill(optimizer: torch.optim.Optimizer, template: dict) -> None:
    """Fill ``template`` in place as ``dcp.load`` of a file refused for its options would, and
    load it: refused, and the optimizer latches (its live state holds the refused values)."""
    for value in template["state"].values():
        for tensor in value.values():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                tensor.mul_(3.0)
    template["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optimizer.load_state_dict(template)
    assert optimizer.latched


@pytest.mark.parametrize("kind", ["gefen", "hybrid"])
def test_after_an_in_place_refusal_a_stale_dict_is_still_refused(kind: str) -> None:
    """Once a refused template written in place latched the optimizer, any dict sharing a
    written tensor read as written in place, so a stale dict (kept across two steps, without a
    copy) skipped the staleness rule and loaded: step-2 counts beside the refused file's
    values. The refusal renotes the template's write, so the stale dict is no template written
    in place: it is refused (it shares the tensors holding the refused values)."""
    model = _model()
    optimizer = BUILDERS[kind](model)
    _train(model, optimizer, 2)
    kept = optimizer.state_dict()
    _train(model, optimizer, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    template = optimizer.state_dict()
    _latch_by_a_refused_fill(optimizer, template)
    with pytest.raises(ValueError, match="which hold a refused load's values"):
        optimizer.load_state_dict(kept)
    assert optimizer.latched
    optimizer.load_state_dict(saved)
    _train(model, optimizer, 1)
    assert all(torch.isfinite(param).all() for param in model.parameters())


@pytest.mark.parametrize("kind", ["gefen", "hybrid"])
@pytest.mark.parametrize("retry", ["own_state_dict", "same_template"])
def test_while_latched_by_an_in_place_refusal_a_dict_of_the_refused_values_is_refused(
    kind: str, retry: str
) -> None:
    """After a refused load written in place latched the optimizer, ``load_state_dict`` of its
    own ``state_dict()`` loaded the refused values and cleared the latch; the same template
    loaded again was refused as stale, a misleading reason. Both hold the refused values and
    were not filled again: refused by that rule, still latched; a valid copy loads."""
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    model = _model()
    optimizer = BUILDERS[kind](model)
    _train(model, optimizer, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    template = optimizer.state_dict()
    _train(model, optimizer, 1)  # the template is kept across a step: its counts are older
    _latch_by_a_refused_fill(optimizer, template)
    template["param_groups"][0]["lr"] = saved["param_groups"][0]["lr"]
    again = optimizer.state_dict() if retry == "own_state_dict" else template
    before = deep_snapshot(optimizer)
    with pytest.raises(ValueError, match="which hold a refused load's values"):
        optimizer.load_state_dict(again)
    assert snapshot_diff(before, deep_snapshot(optimizer)) == []
    assert optimizer.latched
    optimizer.load_state_dict(saved)
    _train(model, optimizer, 1)
    assert all(torch.isfinite(param).all() for param in model.parameters())


# -- a commit that failed part-way -----------------------------------------------------------

FAILED_COMMIT_KINDS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    **BUILDERS,
    "gefen_fp32": lambda model: Gefen(model.parameters(), lr=1e-2, momentum_codec="none"),
    "hybrid_adamw": lambda model: GefenMuonHybrid.from_model(
        model, lr=1e-2, backup_optimizer="adamw"
    ),
}


def _commit_one_unit_then_fail(real: Callable[..., None]) -> Callable[..., None]:
    """A ``_commit_step`` that writes the first unit of the plan (a Gefen parameter, a Muon
    matrix) and then fails, as an out-of-memory error part-way through the commit would."""

    def commit(self: object, plan: object) -> None:
        if hasattr(plan, "updates"):  # Gefen's plan: the updates and their scalars
            scalars = plan.scalars  # type: ignore[attr-defined]
            real(self, types.SimpleNamespace(updates=list(plan.updates)[:1], scalars=scalars))
        else:  # GefenMuon's plan: its units
            real(self, list(plan)[:1])  # type: ignore[call-overload]
        raise RuntimeError("injected failure after the first unit of the commit")

    return commit


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP in one process, without a group
@pytest.mark.parametrize("refill", [False, True], ids=["copy", "refilled"])
@pytest.mark.parametrize("kind", FAILED_COMMIT_KINDS)
def test_after_a_commit_failed_part_way_a_dict_sharing_the_live_state_is_refused(
    kind: str, refill: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """A ``state_dict()`` handed out before a step whose commit then failed part-way shares
    live tensors the commit wrote in part. Its load was accepted (the failed commit's writes
    read as a DCP template filled in place, so the staleness rule was skipped), cleared the
    latch and left the optimizer training on the failed step's partial writes beside the old
    counts. It is refused by name, nothing changes, and a copy of the checkpoint, or that same
    dict once ``dcp.load`` filled it again from a file, resumes as an uninterrupted run from the
    checkpoint does (the refilled one was refused too, for a while)."""
    from gefen.dist.testing import deep_snapshot, snapshot_diff

    build = FAILED_COMMIT_KINDS[kind]
    model = _model()
    optimizer = build(model)
    _train(model, optimizer, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    weights = copy.deepcopy(model.state_dict())
    handed_out = optimizer.state_dict()
    shell = optimizer.children[0] if isinstance(optimizer, GefenMuonHybrid) else optimizer
    real = type(shell)._commit_step
    monkeypatch.setattr(type(shell), "_commit_step", _commit_one_unit_then_fail(real))
    model(torch.randn(8, 16)).square().mean().backward()
    with pytest.raises(RuntimeError, match="injected failure"):
        optimizer.step()
    monkeypatch.undo()
    model.zero_grad()
    assert optimizer.latched
    before = deep_snapshot(optimizer)
    with pytest.raises(ValueError, match="a step that failed during its commit wrote in part"):
        optimizer.load_state_dict(handed_out)
    assert snapshot_diff(before, deep_snapshot(optimizer)) == []
    assert optimizer.latched
    model.load_state_dict(weights)
    if refill:  # the dict handed out before the failure, filled again from a file in place
        import torch.distributed.checkpoint as dcp

        dcp.save(saved, checkpoint_id=str(tmp_path))
        dcp.load(handed_out, checkpoint_id=str(tmp_path))
        optimizer.load_state_dict(handed_out)
    else:
        optimizer.load_state_dict(saved)
    assert not optimizer.latched
    reference = _model()
    reference.load_state_dict(weights)
    reference_optimizer = build(reference)
    reference_optimizer.load_state_dict(copy.deepcopy(saved))
    _assert_continues_alike((model, optimizer), (reference, reference_optimizer))


# -- GradScaler's controls after a failed step -----------------------------------------------

SCALER_KINDS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "gefen": lambda params: Gefen(params, lr=1e-2),
    "muon": lambda params: GefenMuon(params, lr=1e-2),
    "hybrid": lambda params: GefenMuonHybrid([("w", params[0])], lr=1e-2),
}


@pytest.mark.parametrize("where", ["pre", "post"])
@pytest.mark.parametrize("kind", SCALER_KINDS)
def test_a_step_failing_in_a_hook_leaves_no_scaler_controls_behind(kind: str, where: str) -> None:
    """``GradScaler.step`` sets ``found_inf`` and ``grad_scale`` on the optimizer and deletes them
    only when ``step()`` returns. They were dropped only for failures in phases 3–5: after a
    step pre-hook (or the latch check, or the vote) raised, or a post-hook did, the next
    ``scaler.step`` multiplied the stale scale into its own and the gradients were unscaled by
    the scale squared. Now any failure drops them: each step sees its gradient unscaled once."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float16))
    optimizer = SCALER_KINDS[kind]([param])
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    armed = [True]

    def hook(*_: object) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("transient hook failure")

    if where == "pre":
        optimizer.register_step_pre_hook(hook)
    else:
        optimizer.register_step_post_hook(hook)
    direction = torch.randn(8, 8, dtype=torch.float16)
    for iteration in range(2):
        param.grad = None
        scaler.scale((param * direction).sum()).backward()
        if iteration == 0:  # the hook fails this once
            with pytest.raises(RuntimeError, match="transient hook failure"):
                scaler.step(optimizer)
            assert not hasattr(optimizer, "found_inf")
            assert not hasattr(optimizer, "grad_scale")
            if where == "pre":
                scaler.step(optimizer)  # the same step, retried
        else:
            scaler.step(optimizer)
        scaler.update()
        unscaled = param.grad.float().abs().max() / direction.float().abs().max()
        assert unscaled.item() == pytest.approx(1.0, rel=1e-2)
