"""``GefenMuon.post_sharding`` in one process (docs/muon.md §6 "Explicit codebook scope";
docs/core.md §13).

GefenMuon accepts ``REPLICATED`` and ``WHOLE_PARAMETER_OWNER`` shards and refuses a flattened or
DTensor layout. Ungrouped shards, one-member groups with a one-member
``CodebookProcessGroupBinding``, and — for a whole-parameter non-owner slot, which needs two
members — a two-member identity seen from member ``"rank:0"`` without a binding. Every
rejection proves with a deep snapshot that nothing changed and that a corrected retry succeeds
and trains; the layout guard, the contract, and the ``"scope"`` checkpoint extras are covered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from gefen.contracts import (
    ParameterIdentity,
    ParameterLayout,
    ProcessGroupIdentity,
    ProcessGroupScope,
    ShardIdentity,
    ShardingManifest,
    TrainingSupport,
)
from gefen.core import ParameterRebinding
from gefen.core.testing import (
    dtensor_replicate_shard,
    fill_grads,
    flattened_shard,
    rejects,
    replicated_shard,
    solo_binding,
    whole_owner_shard,
)
from gefen.core.testing import takes_a_step as trains
from gefen.core.testing import weights_only_round_trip as _roundtrip
from gefen.dist import BindingError, CheckpointProcessGroupBinding, CodebookProcessGroupBinding
from gefen.muon import GefenMuon

SOLO = ProcessGroupIdentity("solo", ("rank:0",))
OTHER = ProcessGroupIdentity("other", ("rank:0",))
PAIR = ProcessGroupIdentity("pair", ("rank:0", "rank:1"))
ME = "rank:0"

SHAPES: dict[str, tuple[int, ...]] = {
    "blocks.0.weight": (8, 6),
    "blocks.1.weight": (6, 8),
    "blocks.2.weight": (4, 6),
}
GROUPS = (("blocks.0.weight", "blocks.1.weight"), ("blocks.2.weight",))
ORDER = tuple(f for g in GROUPS for f in g)
PRISTINE = "post_sharding requires a pristine optimizer"
LAYOUT = "parameter layout changed after post_sharding"
SCOPE = "codebook scope"
MISMATCH = "checkpoint_binding does not match the installed codebook binding"
NO_GROUP = "a checkpoint_binding needs exactly one eligible distributed process group, found 0"


def _pid(fqn: str) -> ParameterIdentity:
    return ParameterIdentity(fqn, SHAPES[fqn])


def replicated(
    fqn: str, group: ProcessGroupIdentity | None = None, member: str = ME
) -> ShardIdentity:
    return replicated_shard(_pid(fqn), group, member)


def whole_owner(
    fqn: str, group: ProcessGroupIdentity = SOLO, member: str = ME, owner: str = ME
) -> ShardIdentity:
    return whole_owner_shard(_pid(fqn), group, member, owner)


def owner_peers(fqn: str, group: ProcessGroupIdentity, owner: str) -> tuple[ShardIdentity, ...]:
    """Every member's shard of one whole-owner parameter (the manifest needs them all)."""
    return tuple(whole_owner(fqn, group, m, owner) for m in group.ordered_members)


def flattened(fqn: str, group: ProcessGroupIdentity = SOLO) -> ShardIdentity:
    return flattened_shard(_pid(fqn), group)


def dtensor_replicate(fqn: str, group: ProcessGroupIdentity = SOLO) -> ShardIdentity:
    return dtensor_replicate_shard(_pid(fqn), group)


@dataclass
class Setup:
    mode: str
    opt: GefenMuon
    olds: dict[str, torch.nn.Parameter]
    targets: dict[str, Tensor | None]
    shards: dict[str, ShardIdentity]
    manifest_shards: tuple[ShardIdentity, ...]
    binding: CodebookProcessGroupBinding | None

    def rebindings(self) -> list[ParameterRebinding]:
        return [ParameterRebinding(self.olds[f], self.targets[f], self.shards[f]) for f in ORDER]

    @property
    def manifest(self) -> ShardingManifest:
        return ShardingManifest(self.manifest_shards)

    def kwargs(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "codebook_process_group": self.binding}

    def finalize(self) -> None:
        self.opt.post_sharding(self.rebindings(), **self.kwargs())

    def live_targets(self) -> list[Tensor]:
        return [t for f in ORDER if (t := self.targets[f]) is not None]


MODES = ("ungrouped", "solo", "owner", "mixed", "pruned", "pruned-group")


def make(
    mode: str = "solo",
    *,
    identity: ProcessGroupIdentity = SOLO,
    named: bool = False,
    seed: int = 0,
    **options: Any,
) -> Setup:
    """``ungrouped``: no group; ``solo``: replicated in a bound one-member group; ``owner``:
    every slot whole-owned by the bound member; ``mixed``: blocks.1 whole-owned, the rest
    replicated (bound); ``pruned``: a two-member group, blocks.1 owned by the peer (this
    member binds None), no binding; ``pruned-group``: the same for blocks.2, which empties
    group 1."""
    generator = torch.Generator().manual_seed(seed)
    olds = {f: torch.nn.Parameter(torch.randn(SHAPES[f], generator=generator)) for f in ORDER}

    def entry(fqn: str) -> Any:
        return (f"orig.{fqn}", olds[fqn]) if named else olds[fqn]

    options.setdefault("lr", 0.02)
    options.setdefault("ns_steps", 2)
    opt = GefenMuon(
        [
            {"params": [entry(f) for f in GROUPS[0]]},
            {"params": [entry(f) for f in GROUPS[1]], "lr": 0.01},
        ],
        **options,
    )
    targets: dict[str, Tensor | None] = {
        f: torch.nn.Parameter(olds[f].detach().clone()) for f in ORDER
    }
    binding: CodebookProcessGroupBinding | None = None
    if mode == "ungrouped":
        shards = {f: replicated(f) for f in ORDER}
        extra: tuple[ShardIdentity, ...] = ()
    elif mode in ("solo", "owner", "mixed"):
        owned = {"owner": set(ORDER), "mixed": {"blocks.1.weight"}}.get(mode, set())
        shards = {
            f: whole_owner(f, identity) if f in owned else replicated(f, identity) for f in ORDER
        }
        extra = ()
        binding = solo_binding(identity)
    else:
        pruned = "blocks.1.weight" if mode == "pruned" else "blocks.2.weight"
        shards = {f: replicated(f, PAIR) for f in ORDER}
        shards[pruned] = whole_owner(pruned, PAIR, ME, owner="rank:1")
        targets[pruned] = None
        extra = tuple(replicated(f, PAIR, "rank:1") for f in ORDER if f != pruned)
        extra += (whole_owner(pruned, PAIR, "rank:1", owner="rank:1"),)
    return Setup(mode, opt, olds, targets, shards, (*shards.values(), *extra), binding)


# -- types and preconditions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: object(), id="object"),
        pytest.param(lambda: CheckpointProcessGroupBinding(SOLO, ME, None, "cpu"), id="checkpoint"),
    ],
)
def test_codebook_process_group_type(bad: Callable[[], Any]) -> None:
    setup = make("owner")
    rejects(
        setup.opt,
        lambda: setup.opt.post_sharding(
            setup.rebindings(), manifest=setup.manifest, codebook_process_group=bad()
        ),
        TypeError,
        "codebook_process_group must be a gefen.dist.CodebookProcessGroupBinding or None",
    )
    setup.finalize()
    trains(setup.opt)


def _after_step(setup: Setup) -> None:
    trains(setup.opt)


def _with_codebook(setup: Setup) -> None:
    fill_grads([p for g in setup.opt.param_groups for p in g["params"]], 3)
    assert setup.opt.initialize_codebook() is True
    setup.opt.zero_grad(set_to_none=True)


def _with_gradient(setup: Setup) -> None:
    setup.olds["blocks.2.weight"].grad = torch.zeros(4, 6)


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(_after_step, id="after-step"),
        pytest.param(_with_codebook, id="codebook"),
        pytest.param(_with_gradient, id="gradient"),
    ],
)
@pytest.mark.parametrize("mode", ["owner", "pruned"])
def test_preconditions(mode: str, spoil: Callable[[Setup], None]) -> None:
    setup = make(mode)
    spoil(setup)
    rejects(setup.opt, setup.finalize, RuntimeError, PRISTINE)
    assert setup.opt.finalized is None


@pytest.mark.parametrize("mode", MODES)
def test_second_post_sharding_is_already_finalized(mode: str) -> None:
    setup = make(mode)
    setup.finalize()
    rejects(setup.opt, setup.finalize, RuntimeError, "already finalized")
    trains(setup.opt)


# -- validation ----------------------------------------------------------------------------------

Case = Callable[[Setup], tuple[list[ParameterRebinding], ShardingManifest, Any]]


def _swap(setup: Setup, fqn: str, **fields: Any) -> list[ParameterRebinding]:
    out = []
    for f in ORDER:
        old, new, shard = setup.olds[f], setup.targets[f], setup.shards[f]
        if f == fqn:
            old, new, shard = (fields.get(k, v) for k, v in (("old", old), ("new", new),
                                                                 ("shard", shard)))  # fmt: skip
        out.append(ParameterRebinding(old, new, shard))
    return out


def _replace_layout(setup: Setup, fqn: str, shard: ShardIdentity) -> Any:
    shards = [s for s in setup.manifest_shards if s.parameter.fqn != fqn]
    return _swap(setup, fqn, shard=shard), ShardingManifest((*shards, shard)), setup.binding


def _flattened_layout(setup: Setup) -> Any:
    fqn = "blocks.1.weight"
    target = torch.nn.Parameter(setup.olds[fqn].detach().reshape(-1).clone())
    rebindings, manifest, binding = _replace_layout(setup, fqn, flattened(fqn))
    rebindings[1] = ParameterRebinding(setup.olds[fqn], target, flattened(fqn))
    return rebindings, manifest, binding


def _dtensor_layout(setup: Setup) -> Any:
    return _replace_layout(setup, "blocks.1.weight", dtensor_replicate("blocks.1.weight"))


def _owner_binds_none(setup: Setup) -> Any:
    return _swap(setup, "blocks.1.weight", new=None), setup.manifest, setup.binding


def _non_owner_binds_tensor(setup: Setup) -> Any:
    target = torch.nn.Parameter(torch.zeros(6, 8))
    return _swap(setup, "blocks.1.weight", new=target), setup.manifest, setup.binding


def _owner_wrong_shape(setup: Setup) -> Any:
    fqn = "blocks.1.weight"
    return (
        _swap(setup, fqn, new=torch.nn.Parameter(torch.zeros(8, 6))),
        setup.manifest,
        setup.binding,
    )


def _owner_flat_target(setup: Setup) -> Any:
    fqn = "blocks.1.weight"
    return _swap(setup, fqn, new=torch.nn.Parameter(torch.zeros(48))), setup.manifest, setup.binding


def _missing(setup: Setup) -> Any:
    rebindings = [r for r in setup.rebindings() if r.shard.parameter.fqn != "blocks.0.weight"]
    return rebindings, setup.manifest, setup.binding


def _pruned_duplicate_none(setup: Setup) -> Any:
    """Two non-owner rebindings of one source (both None)."""
    rebindings = setup.rebindings()
    return [*rebindings, rebindings[1]], setup.manifest, setup.binding


VALIDATION: dict[str, tuple[str, Case, str, str]] = {
    "flattened-layout": (
        "mixed",
        _flattened_layout,
        "blocks.1.weight",
        "layout flattened_element_shard is not supported (supported: replicated, "
        "whole_parameter_owner)",
    ),
    "dtensor-layout": (
        "mixed",
        _dtensor_layout,
        "blocks.1.weight",
        "layout dtensor_1d_default_world is not supported",
    ),
    "owner-binds-none": (
        "mixed",
        _owner_binds_none,
        "blocks.1.weight",
        "only a whole-parameter-owner non-owner may bind None",
    ),
    "non-owner-binds-tensor": (
        "pruned",
        _non_owner_binds_tensor,
        "blocks.1.weight",
        "a whole-parameter-owner non-owner must bind None",
    ),
    "owner-wrong-shape": ("owner", _owner_wrong_shape, "blocks.1.weight", "global shape (6, 8)"),
    "owner-flat-target": ("owner", _owner_flat_target, "blocks.1.weight", "global shape (6, 8)"),
    "missing-pruned-rebinding": ("pruned", _missing, "param_groups[0][0]", "has no rebinding"),
    "duplicate-pruned-source": (
        "pruned",
        _pruned_duplicate_none,
        "blocks.1.weight",
        "two rebindings share one source slot",
    ),
}


@pytest.mark.parametrize("case", list(VALIDATION))
def test_validation_rejects_and_retry_succeeds(case: str) -> None:
    mode, build, slot, rule = VALIDATION[case]
    setup = make(mode, named=True)
    opt = setup.opt
    rebindings, manifest, binding = build(setup)
    info = rejects(
        opt,
        lambda: opt.post_sharding(rebindings, manifest=manifest, codebook_process_group=binding),
        ValueError,
        rule,
    )
    assert str(info.value).startswith(f"post_sharding: {slot}: ")
    assert opt.finalized is None
    assert opt.param_groups[0]["param_names"] == [f"orig.{f}" for f in GROUPS[0]]
    setup.finalize()
    trains(opt)


# -- effect --------------------------------------------------------------------------------------


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("mode", MODES)
def test_effect_targets_pruning_names_and_state(mode: str, named: bool) -> None:
    setup = make(mode, named=named)
    opt = setup.opt
    setup.finalize()
    for group, fqns in zip(opt.param_groups, GROUPS, strict=True):
        kept = [f for f in fqns if setup.targets[f] is not None]
        assert group["params"] == [setup.targets[f] for f in kept]
        assert all(p is setup.targets[f] for p, f in zip(group["params"], kept, strict=True))
        assert group["param_names"] == kept
    if mode == "pruned-group":
        assert opt.param_groups[1]["params"] == []
        assert opt.param_groups[1]["param_names"] == []
        assert opt.param_groups[1]["lr"] == 0.01
    live = setup.live_targets()
    assert len(opt.state) == len(live)
    assert all(opt.state[t] == {"period": 0} for t in live)
    assert all(old not in opt.state for old in setup.olds.values())
    finalized = opt.finalized
    assert finalized is not None
    assert finalized.binding is setup.binding
    assert finalized.manifest == setup.manifest
    # A pruned slot stays in the local shard list with no tensor.
    assert {s.parameter.fqn: t for s, t in finalized.shards} == setup.targets
    olds = {f: p.detach().clone() for f, p in setup.olds.items()}
    trains(opt, live)
    assert all(torch.equal(olds[f], setup.olds[f]) for f in ORDER)


@pytest.mark.parametrize("mode", ["owner", "pruned"])
def test_add_param_group_is_refused_after_finalization(mode: str) -> None:
    setup = make(mode)
    setup.finalize()
    rejects(
        setup.opt,
        lambda: setup.opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 3))]}),
        RuntimeError,
        "finalized",
    )
    trains(setup.opt)


@pytest.mark.parametrize("mode", ["ungrouped", "solo", "owner", "mixed", "pruned"])
def test_training_equals_the_unsharded_optimizer_on_the_kept_slots(mode: str) -> None:
    """Finalization changes which tensors are trained, not how: a twin GefenMuon over copies of
    the kept slots (same groups and options) produces bit-identical parameters."""
    setup = make(mode)
    setup.finalize()
    twin_params = {f: torch.nn.Parameter(setup.olds[f].detach().clone()) for f in ORDER}
    kept = [f for f in ORDER if setup.targets[f] is not None]
    twin = GefenMuon(
        [
            {"params": [twin_params[f] for f in GROUPS[0] if f in kept]},
            {"params": [twin_params[f] for f in GROUPS[1] if f in kept], "lr": 0.01},
        ],
        lr=0.02,
        ns_steps=2,
    )
    for seed in range(3):
        fill_grads(setup.live_targets(), seed)
        fill_grads([twin_params[f] for f in kept], seed)
        setup.opt.step()
        twin.step()
    assert torch.equal(setup.opt.codebook, twin.codebook)
    for fqn in kept:
        assert torch.equal(setup.targets[fqn], twin_params[fqn]), fqn


def test_refresh_codebook_is_not_implemented_even_when_finalized() -> None:
    setup = make("owner")
    setup.finalize()
    trains(setup.opt)
    rejects(setup.opt, setup.opt.refresh_codebook, NotImplementedError, "refresh_codebook")
    trains(setup.opt)


# -- the layout guard ----------------------------------------------------------------------------


@pytest.mark.parametrize("with_grads", [False, True], ids=["no-grads", "grads"])
@pytest.mark.parametrize("mode", ["solo", "owner", "pruned"])
def test_layout_guard(mode: str, with_grads: bool) -> None:
    setup = make(mode)
    setup.finalize()
    opt = setup.opt
    trains(opt)
    sd = opt.state_dict()
    original = opt.param_groups[0]["params"][0]
    impostor = torch.nn.Parameter(original.detach().clone())
    opt.param_groups[0]["params"][0] = impostor
    if with_grads:
        fill_grads([p for g in opt.param_groups for p in g["params"]], 1)
    actions = {
        "step": opt.step,
        "initialize_codebook": opt.initialize_codebook,
        "state_dict": opt.state_dict,
        "load_state_dict": lambda: opt.load_state_dict(sd),
    }
    for name, action in actions.items():
        info = rejects(opt, action, RuntimeError, LAYOUT)
        assert str(info.value).startswith("GefenMuon"), name
    opt.param_groups[0]["params"][0] = original
    opt.zero_grad(set_to_none=True)
    trains(opt)


def test_layout_guard_readding_a_pruned_source() -> None:
    """Putting the pruned source back into its group is a layout change too."""
    setup = make("pruned")
    setup.finalize()
    opt = setup.opt
    opt.param_groups[0]["params"].append(setup.olds["blocks.1.weight"])
    rejects(opt, opt.step, RuntimeError, LAYOUT)
    opt.param_groups[0]["params"].pop()
    trains(opt)


# -- the contract --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_contract_flags_and_finalized_training(mode: str) -> None:
    setup = make(mode)
    before = setup.opt.optimizer_contract().capabilities
    for name in ("post_sharding", "shard_rebinding", "explicit_process_group_codebook_scope"):
        assert getattr(before, name) is True, name
    assert before.canonical_parameter_fqns is False
    assert before.stable_shard_identity is False
    setup.finalize()
    after = setup.opt.optimizer_contract().capabilities
    for name in (
        "post_sharding",
        "shard_rebinding",
        "explicit_process_group_codebook_scope",
        "canonical_parameter_fqns",
        "stable_shard_identity",
    ):
        assert getattr(after, name) is True, name
    adapter = {
        t.layout: t
        for t in after.training
        if t.process_group_scope is ProcessGroupScope.ADAPTER_DEFINED
    }
    layouts = {s.layout for s in setup.shards.values()}
    assert set(adapter) == layouts
    for layout, entry in adapter.items():
        owner = layout is ParameterLayout.WHOLE_PARAMETER_OWNER
        assert entry == TrainingSupport(
            layout=layout,
            process_group_scope=ProcessGroupScope.ADAPTER_DEFINED,
            requires_post_step_parameter_sync=owner,
        )
        assert entry.requires_post_step_parameter_sync is owner
    base = tuple(
        t for t in after.training if t.process_group_scope is not ProcessGroupScope.ADAPTER_DEFINED
    )
    assert base == before.training


# -- checkpoints ---------------------------------------------------------------------------------


def _trained(mode: str = "owner", *, steps: int = 3, **options: Any) -> Setup:
    setup = make(mode, **options)
    setup.finalize()
    for seed in range(steps):
        trains(setup.opt, seed=seed)
    return setup


def _state_equal(a: GefenMuon, b: GefenMuon) -> None:
    assert a.global_step == b.global_step
    assert torch.equal(a.codebook, b.codebook)
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for x, y in zip(pa, pb, strict=True):
        ea, eb = a.state[x], b.state[y]
        assert ea.keys() == eb.keys()
        for key in ea:
            same = (
                torch.equal(ea[key], eb[key]) if isinstance(ea[key], Tensor) else ea[key] == eb[key]
            )
            assert same, key


@pytest.mark.parametrize("mode", ["solo", "owner", "mixed"])
def test_scoped_checkpoint_round_trips(mode: str) -> None:
    source = _trained(mode)
    sd = source.opt.state_dict()
    expected = {"identity": SOLO.to_primitive(), "refresh_every": 0}
    assert sd["gefen"]["scope"] == expected
    assert all(g["gefen"]["scope"] == expected for g in sd["param_groups"])
    target = make(mode, seed=3)
    target.finalize()
    for fqn in ORDER:
        with torch.no_grad():
            target.targets[fqn].copy_(source.targets[fqn])  # type: ignore[union-attr]
    target.opt.load_state_dict(_roundtrip(sd))
    _state_equal(source.opt, target.opt)
    for seed in (20, 21):
        fill_grads(source.live_targets(), seed)
        fill_grads(target.live_targets(), seed)
        source.opt.step()
        target.opt.step()
    _state_equal(source.opt, target.opt)
    for fqn in ORDER:
        assert torch.equal(source.targets[fqn], target.targets[fqn])


def test_pruned_checkpoint_round_trips_unscoped() -> None:
    source = _trained("pruned")
    sd = source.opt.state_dict()
    assert "scope" not in sd["gefen"]
    assert [len(g["params"]) for g in sd["param_groups"]] == [1, 1]
    assert sd["param_groups"][0]["param_names"] == ["blocks.0.weight"]
    target = make("pruned", seed=3)
    target.finalize()
    target.opt.load_state_dict(_roundtrip(sd))
    _state_equal(source.opt, target.opt)


def _tamper_refresh_every(sd: dict[str, Any]) -> dict[str, Any]:
    for extras in (sd["gefen"], *(g["gefen"] for g in sd["param_groups"])):
        extras["scope"]["refresh_every"] = 4
    return sd


def _scoped_sd() -> dict[str, Any]:
    return _trained("owner").opt.state_dict()


MISMATCHES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[], Setup]]] = {
    "scoped-into-unscoped": (_scoped_sd, lambda: make("ungrouped")),
    "unscoped-into-scoped": (lambda: _trained("ungrouped").opt.state_dict(), lambda: make("owner")),
    "other-identity": (_scoped_sd, lambda: make("owner", identity=OTHER)),
    "other-refresh-every": (lambda: _tamper_refresh_every(_scoped_sd()), lambda: make("owner")),
    "scoped-into-unfinalized": (_scoped_sd, lambda: make("owner")),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_scope_mismatch_is_rejected_without_change(case: str) -> None:
    build_sd, build_target = MISMATCHES[case]
    sd = build_sd()
    target = build_target()
    if case != "scoped-into-unfinalized":
        target.finalize()
    trains(target.opt, seed=30)
    rejects(target.opt, lambda: target.opt.load_state_dict(sd), ValueError, SCOPE)
    trains(target.opt, seed=31)


def test_checkpoint_binding_on_save_and_load() -> None:
    setup = _trained("owner")
    opt = setup.opt
    same = CheckpointProcessGroupBinding(SOLO, ME, None, "cpu")
    sd = copy.deepcopy(opt.state_dict(checkpoint_binding=same))  # kept across a step: a copy
    assert sd["gefen"]["scope"]["identity"] == SOLO.to_primitive()
    trains(opt, seed=50)
    for other in (
        CheckpointProcessGroupBinding(OTHER, ME, None, "cpu"),
        CheckpointProcessGroupBinding(SOLO, ME, None, "cuda:0"),
    ):
        for action in (
            lambda o=other: opt.state_dict(checkpoint_binding=o),
            lambda o=other: opt.load_state_dict(sd, checkpoint_binding=o),
        ):
            rejects(opt, action, BindingError, MISMATCH)
    rejects(
        opt,
        lambda: opt.load_state_dict(sd, checkpoint_binding=setup.binding),
        TypeError,
        "checkpoint_binding must be a CheckpointProcessGroupBinding",
    )
    opt.load_state_dict(sd, checkpoint_binding=same)
    assert opt.global_step == 3
    trains(opt)


@pytest.mark.parametrize("mode", ["ungrouped", "pruned"])
def test_checkpoint_binding_without_an_installed_binding(mode: str) -> None:
    setup = _trained(mode)
    opt = setup.opt
    sd = opt.state_dict()
    cp = CheckpointProcessGroupBinding(SOLO, ME, None, "cpu")
    rejects(opt, lambda: opt.state_dict(checkpoint_binding=cp), BindingError, NO_GROUP)
    rejects(opt, lambda: opt.load_state_dict(sd, checkpoint_binding=cp), BindingError, NO_GROUP)
    opt.load_state_dict(sd)
    trains(opt)


def test_the_contract_describes_a_whole_parameter_owners_state_and_checkpoints() -> None:
    # It listed the owner layout for training only: no state variant covered an owner's
    # entry, so the optimizer's own state_dict failed its own contract.
    from gefen.contracts import CheckpointTransport, ParameterLayout
    from gefen.contracts.conformance import check_provider, check_state_dict
    from gefen.core.testing import takes_a_step

    setup = make("mixed")
    setup.finalize()
    for seed in range(2):
        takes_a_step(setup.opt, seed=seed)
    contract = check_provider(setup.opt)
    layouts = {i: setup.shards[fqn].layout for i, fqn in enumerate(ORDER)}
    assert ParameterLayout.WHOLE_PARAMETER_OWNER in layouts.values()
    check_state_dict(
        contract, setup.opt.state_dict(), ndims=dict.fromkeys(layouts, 2), parameter_layouts=layouts
    )
    native = [
        entry
        for entry in contract.capabilities.checkpoints
        if entry.transport is CheckpointTransport.NATIVE_OPTIMIZER
    ]
    assert all(ParameterLayout.WHOLE_PARAMETER_OWNER in entry.same_topology for entry in native)
