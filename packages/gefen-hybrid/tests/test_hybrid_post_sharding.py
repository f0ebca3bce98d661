"""``GefenMuonHybrid.post_sharding`` forwarding in one process
(docs/hybrid.md §6; docs/core.md §13).

The hybrid splits the rebindings per child through its ownership registry, restricts the
manifest per child, prepares both children (Muon first) and commits both or neither. Shards are
ungrouped or belong to a one-member group with a one-member ``CodebookProcessGroupBinding``.
Every rejection proves with a deep snapshot of both children (and the hybrid's registry) that
nothing changed, and that a corrected retry succeeds and trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gefen.contracts import (
    ParameterIdentity,
    ProcessGroupIdentity,
    ProcessGroupScope,
    ShardIdentity,
    ShardingManifest,
)
from gefen.core import Gefen, ParameterRebinding
from gefen.core.testing import (
    FINALIZED_SNAPSHOT_ATTRIBUTES,
    fill_grads,
    flattened_shard,
    replicated_shard,
    solo_binding,
    whole_owner_shard,
)
from gefen.core.testing import rejects as core_rejects
from gefen.core.testing import weights_only_round_trip as _roundtrip
from gefen.dist import CheckpointProcessGroupBinding, CodebookProcessGroupBinding
from gefen.dist.testing import deep_snapshot, snapshot_diff
from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.flat_layout import join, split
from gefen.hybrid.testing import MUON_NAMES, TinyLM
from gefen.muon import GefenMuon

SOLO = ProcessGroupIdentity("solo", ("rank:0",))
OTHER = ProcessGroupIdentity("other", ("rank:0",))
ME = "rank:0"
ATTRIBUTES = FINALIZED_SNAPSHOT_ATTRIBUTES
SCOPE = "codebook scope"


# -- shards --------------------------------------------------------------------------------------


def _pid(fqn: str, shape: tuple[int, ...]) -> ParameterIdentity:
    return ParameterIdentity(fqn, shape)


def replicated(
    fqn: str, shape: tuple[int, ...], group: ProcessGroupIdentity | None
) -> ShardIdentity:
    return replicated_shard(_pid(fqn, shape), group)


def whole_owner(fqn: str, shape: tuple[int, ...], group: ProcessGroupIdentity) -> ShardIdentity:
    return whole_owner_shard(_pid(fqn, shape), group)


def flattened(fqn: str, shape: tuple[int, ...], group: ProcessGroupIdentity) -> ShardIdentity:
    return flattened_shard(_pid(fqn, shape), group)


# -- the hybrid under test -----------------------------------------------------------------------


@dataclass
class Setup:
    hybrid: GefenMuonHybrid
    names: tuple[str, ...]
    olds: dict[str, nn.Parameter]
    targets: dict[str, Tensor]
    shards: dict[str, ShardIdentity]
    binding: CodebookProcessGroupBinding | None

    def rebindings(self) -> list[ParameterRebinding]:
        return [
            ParameterRebinding(self.olds[f], self.targets[f], self.shards[f]) for f in self.names
        ]

    @property
    def manifest(self) -> ShardingManifest:
        return ShardingManifest(tuple(self.shards.values()))

    def finalize(self) -> None:
        self.hybrid.post_sharding(
            self.rebindings(), manifest=self.manifest, codebook_process_group=self.binding
        )

    def muon_names(self) -> list[str]:
        return [f for f in self.names if f in MUON_NAMES]

    def backup_names(self) -> list[str]:
        return [f for f in self.names if f not in MUON_NAMES]


def make(
    mode: str = "solo",
    *,
    backend: str = "gefen",
    form: str = "full",
    identity: ProcessGroupIdentity = SOLO,
    seed: int = 0,
) -> Setup:
    """``ungrouped``: no groups, no binding; ``solo``: every shard replicated in a bound
    one-member group; ``mixed``: Muon whole-owner shards and backup matrices as flattened 1-D
    shards of the bound one-member group."""
    torch.manual_seed(seed)
    model = TinyLM()
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if n in MUON_NAMES]
    backup = [(n, p) for n, p in named if n not in MUON_NAMES]
    if form == "muon-only":
        backup = []
    hybrid = GefenMuonHybrid(
        muon, backup, backup_optimizer=backend, lr=1e-2, ns_steps=1, fused=False
    )
    pairs = muon + backup
    names = tuple(n for n, _ in pairs)
    olds = dict(pairs)
    group = None if mode == "ungrouped" else identity
    targets: dict[str, Tensor] = {}
    shards: dict[str, ShardIdentity] = {}
    for name, param in pairs:
        shape = tuple(param.shape)
        targets[name] = nn.Parameter(param.detach().clone())
        shards[name] = replicated(name, shape, group)
        if mode == "mixed" and name in MUON_NAMES:
            shards[name] = whole_owner(name, shape, identity)
        elif mode == "mixed" and param.dim() == 2:
            shards[name] = flattened(name, shape, identity)
            targets[name] = nn.Parameter(param.detach().reshape(-1).clone())
    binding = None if mode == "ungrouped" else solo_binding(identity)
    return Setup(hybrid, names, olds, targets, shards, binding)


def snapshot(hybrid: GefenMuonHybrid) -> Any:
    children = {"muon": ATTRIBUTES, "backup": ATTRIBUTES}
    return (
        deep_snapshot(hybrid, attributes=("_commit_failed",), children=children),
        dict(hybrid._registry),
        hybrid._snapshots,
    )


def unchanged(before: Any, hybrid: GefenMuonHybrid) -> None:
    snap, registry, snapshots = before
    diff = snapshot_diff(snap, snapshot(hybrid)[0])
    assert not diff, "the hybrid changed:\n  " + "\n  ".join(diff)
    now = dict(hybrid._registry)
    assert now.keys() == registry.keys()
    assert all(now[k] is registry[k] for k in registry)
    assert hybrid._snapshots == snapshots


def rejects(
    hybrid: GefenMuonHybrid, action: Callable[[], Any], error: type[BaseException], fragment: str
) -> pytest.ExceptionInfo[Any]:
    return core_rejects(hybrid, action, error, fragment, snapshot=snapshot, unchanged=unchanged)


def params(hybrid: GefenMuonHybrid) -> list[Tensor]:
    return [p for g in hybrid.param_groups for p in g["params"]]


def trains(hybrid: GefenMuonHybrid, seed: int = 7) -> None:
    live = params(hybrid)
    fill_grads(live, seed)
    before = [p.detach().clone() for p in live]
    counters = [c.global_step for c in hybrid.gefen_children()]
    hybrid.step()
    assert [c.global_step for c in hybrid.gefen_children()] == [n + 1 for n in counters]
    assert all(not torch.equal(b, p) for b, p in zip(before, live, strict=True))
    hybrid.zero_grad(set_to_none=True)


# -- forwarding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ungrouped", "solo", "mixed"])
def test_forwarding_splits_per_child(mode: str) -> None:
    setup = make(mode)
    hybrid = setup.hybrid
    assert hybrid.finalized is False
    setup.finalize()
    assert hybrid.finalized is True
    muon, backup = hybrid.muon, hybrid.backup
    assert isinstance(muon, GefenMuon)
    assert isinstance(backup, Gefen)
    for child, names in ((muon, setup.muon_names()), (backup, setup.backup_names())):
        finalized = child.finalized
        assert finalized is not None
        assert finalized.manifest.fqns == tuple(sorted(names))
        assert finalized.manifest.shards == tuple(
            sorted((setup.shards[f] for f in names), key=lambda s: s.sort_key)
        )
        assert finalized.binding is setup.binding
        assert child._binding is setup.binding
        live = [p for g in child.param_groups for p in g["params"]]
        assert live == [setup.targets[f] for f in names]
        assert all(p is setup.targets[f] for p, f in zip(live, names, strict=True))
        assert [n for g in child.param_groups for n in g["param_names"]] == names
        assert all(child.state[setup.targets[f]] == {"period": 0} for f in names)
        assert len(child.state) == len(names)
    assert params(hybrid) == [setup.targets[f] for f in setup.names]
    for _ in range(3):
        trains(hybrid)


def test_forwarding_routes_registry_and_state_to_the_targets() -> None:
    setup = make("solo")
    setup.finalize()
    hybrid = setup.hybrid
    for fqn in setup.names:
        child = hybrid.muon if fqn in MUON_NAMES else hybrid.backup
        target, old = setup.targets[fqn], setup.olds[fqn]
        assert hybrid.owner_of(target) is child
        assert hybrid.owner_of(old) is None
        assert target in hybrid.state
        assert old not in hybrid.state
        assert hybrid.state[target] is child.state[target]
        assert hybrid.state.get(old, "absent") == "absent"
        with pytest.raises(KeyError):
            hybrid.state[old]
    assert len(hybrid.state) == len(setup.names)
    assert set(map(id, hybrid.state)) == {id(t) for t in setup.targets.values()}
    trains(hybrid)
    for fqn in setup.names:
        entry = hybrid.state[setup.targets[fqn]]
        assert entry["period"] > 0


def test_source_outside_the_registry_is_rejected_untouched() -> None:
    setup = make("solo")
    hybrid = setup.hybrid
    stranger = nn.Parameter(torch.zeros(3, 3))
    shard = replicated("stranger.weight", (3, 3), SOLO)
    bad = [
        *setup.rebindings(),
        ParameterRebinding(stranger, nn.Parameter(torch.zeros(3, 3)), shard),
    ]
    manifest = ShardingManifest((*setup.manifest.shards, shard))
    info = rejects(
        hybrid,
        lambda: hybrid.post_sharding(bad, manifest=manifest, codebook_process_group=setup.binding),
        ValueError,
        "post_sharding: stranger.weight: the source is not a parameter of this GefenMuonHybrid",
    )
    assert isinstance(info.value, ValueError)
    assert hybrid.finalized is False
    setup.finalize()
    trains(hybrid)


def test_a_manifest_naming_a_parameter_no_rebinding_names_is_refused_untouched() -> None:
    # Each child saw only its own FQNs' shards, so the stranger was dropped and the hybrid
    # finalized, where Gefen's own post_sharding refuses the same manifest.
    setup = make("solo")
    hybrid = setup.hybrid
    shard = replicated("stranger.weight", (3, 3), SOLO)
    manifest = ShardingManifest((*setup.manifest.shards, shard))
    rejects(
        hybrid,
        lambda: hybrid.post_sharding(
            setup.rebindings(), manifest=manifest, codebook_process_group=setup.binding
        ),
        ValueError,
        "post_sharding: stranger.weight: the manifest's FQN set differs from the rebindings'",
    )
    assert hybrid.finalized is False
    setup.finalize()
    trains(hybrid)


def _backup_unsupported_layout(setup: Setup) -> tuple[list[ParameterRebinding], ShardingManifest]:
    """The Muon half is valid; the Gefen backup refuses a whole-owner shard (prepared second)."""
    fqn = "lm_head.weight"
    shape = tuple(setup.olds[fqn].shape)
    shards = dict(setup.shards)
    shards[fqn] = whole_owner(fqn, shape, SOLO)
    rebindings = [
        ParameterRebinding(setup.olds[f], setup.targets[f], shards[f]) for f in setup.names
    ]
    return rebindings, ShardingManifest(tuple(shards.values()))


def _backup_wrong_shape(setup: Setup) -> tuple[list[ParameterRebinding], ShardingManifest]:
    rebindings = setup.rebindings()
    index = setup.names.index("embed.weight")
    rebindings[index] = ParameterRebinding(
        setup.olds["embed.weight"], nn.Parameter(torch.zeros(8, 16)), setup.shards["embed.weight"]
    )
    return rebindings, setup.manifest


def _backup_missing(setup: Setup) -> tuple[list[ParameterRebinding], ShardingManifest]:
    rebindings = [r for r in setup.rebindings() if r.shard.parameter.fqn != "norm.bias"]
    shards = tuple(s for s in setup.manifest.shards if s.parameter.fqn != "norm.bias")
    return rebindings, ShardingManifest(shards)


def _muon_flattened(setup: Setup) -> tuple[list[ParameterRebinding], ShardingManifest]:
    fqn = "proj.weight"
    shards = dict(setup.shards)
    shards[fqn] = flattened(fqn, (8, 8), SOLO)
    targets = dict(setup.targets)
    targets[fqn] = nn.Parameter(torch.zeros(64))
    rebindings = [ParameterRebinding(setup.olds[f], targets[f], shards[f]) for f in setup.names]
    return rebindings, ShardingManifest(tuple(shards.values()))


def _backup_ungrouped_under_binding(setup: Setup) -> Any:
    """The backup's shards are ungrouped: its §9.1 scope check (run last, after the Muon child
    was prepared) raises a BindingError."""
    shards = dict(setup.shards)
    for fqn in setup.backup_names():
        shards[fqn] = replicated(fqn, tuple(setup.olds[fqn].shape), None)
    rebindings = [
        ParameterRebinding(setup.olds[f], setup.targets[f], shards[f]) for f in setup.names
    ]
    return rebindings, ShardingManifest(tuple(shards.values()))


FAILURES: dict[str, tuple[Callable[[Setup], Any], str]] = {
    "backup-binding": (_backup_ungrouped_under_binding, "must use the binding's process-group"),
    "backup-layout": (_backup_unsupported_layout, "layout whole_parameter_owner is not supported"),
    "backup-shape": (_backup_wrong_shape, "post_sharding: embed.weight: the target must have"),
    "backup-missing": (_backup_missing, "has no rebinding"),
    "muon-layout": (_muon_flattened, "layout flattened_element_shard is not supported"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_child_preparation_failure_leaves_both_children_untouched(case: str) -> None:
    setup = make("solo")
    hybrid = setup.hybrid
    build, fragment = FAILURES[case]
    rebindings, manifest = build(setup)
    rejects(
        hybrid,
        lambda: hybrid.post_sharding(
            rebindings, manifest=manifest, codebook_process_group=setup.binding
        ),
        ValueError,
        fragment,
    )
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    assert hybrid.muon.finalized is None
    assert hybrid.backup.finalized is None  # type: ignore[union-attr]
    assert hybrid.muon._binding is None
    trains(hybrid)  # the untouched hybrid trains on its original parameters
    hybrid.zero_grad(set_to_none=True)
    # post_sharding needs a pristine optimizer: a fresh hybrid takes the corrected call.
    fresh = make("solo")
    fresh.finalize()
    trains(fresh.hybrid)


def test_a_child_preparation_failure_is_retryable_on_the_same_hybrid() -> None:
    setup = make("solo")
    hybrid = setup.hybrid
    rebindings, manifest = _backup_unsupported_layout(setup)
    rejects(
        hybrid,
        lambda: hybrid.post_sharding(
            rebindings, manifest=manifest, codebook_process_group=setup.binding
        ),
        ValueError,
        "not supported",
    )
    setup.finalize()
    assert hybrid.finalized is True
    trains(hybrid)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        pytest.param({"codebook_process_group": object()}, "codebook_process_group", id="object"),
        pytest.param(
            {"codebook_process_group": CheckpointProcessGroupBinding(SOLO, ME, None, "cpu")},
            "codebook_process_group",
            id="checkpoint-binding",
        ),
        pytest.param(
            {"manifest": "primitive"}, "manifest must be a ShardingManifest", id="manifest"
        ),
        pytest.param({"rebindings": "extra"}, "ParameterRebinding", id="record"),
    ],
)
def test_forwarding_type_errors_leave_the_hybrid_untouched(
    change: dict[str, Any], fragment: str
) -> None:
    setup = make("solo")
    hybrid = setup.hybrid
    kwargs: dict[str, Any] = {
        "rebindings": setup.rebindings(),
        "manifest": setup.manifest,
        "codebook_process_group": setup.binding,
    }
    kwargs.update(change)
    if kwargs["manifest"] == "primitive":
        kwargs["manifest"] = setup.manifest.to_primitive()
    if kwargs["rebindings"] == "extra":
        kwargs["rebindings"] = [*setup.rebindings(), ("x", torch.zeros(1))]
    rebindings = kwargs.pop("rebindings")
    rejects(hybrid, lambda: hybrid.post_sharding(rebindings, **kwargs), TypeError, fragment)
    setup.finalize()
    trains(hybrid)


def test_adamw_backup_refuses_forwarding() -> None:
    setup = make("solo", backend="adamw")
    hybrid = setup.hybrid
    rejects(
        hybrid,
        setup.finalize,
        NotImplementedError,
        "GefenMuonHybrid post_sharding needs Gefen-backed children",
    )
    assert hybrid.muon is not None
    assert hybrid.muon.finalized is None
    caps = hybrid.optimizer_contract().capabilities
    assert caps.post_sharding is False
    assert caps.shard_rebinding is False
    assert caps.explicit_process_group_codebook_scope is False
    assert caps.canonical_parameter_fqns is False
    assert caps.stable_shard_identity is False
    live = params(hybrid)
    fill_grads(live, 1)
    before = [p.detach().clone() for p in live]
    hybrid.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, live, strict=True))


def test_muon_only_hybrid_with_adamw_setting_forwards() -> None:
    """Without a backup child the AdamW setting is moot: forwarding works and the flags say so."""
    setup = make("solo", backend="adamw", form="muon-only")
    hybrid = setup.hybrid
    assert hybrid.backup is None
    caps = hybrid.optimizer_contract().capabilities
    assert caps.post_sharding is True
    assert caps.shard_rebinding is True
    assert caps.explicit_process_group_codebook_scope is True
    setup.finalize()
    assert hybrid.finalized is True
    assert hybrid.optimizer_contract().capabilities.canonical_parameter_fqns is True
    trains(hybrid)


@pytest.mark.parametrize("mode", ["ungrouped", "solo", "mixed"])
def test_contract_flags_are_live_after_finalization(mode: str) -> None:
    setup = make(mode)
    hybrid = setup.hybrid
    before = hybrid.optimizer_contract().capabilities
    for name in ("post_sharding", "shard_rebinding", "explicit_process_group_codebook_scope"):
        assert getattr(before, name) is True, name
    assert before.canonical_parameter_fqns is False
    assert before.stable_shard_identity is False
    setup.finalize()
    after = hybrid.optimizer_contract().capabilities
    for name in (
        "post_sharding",
        "shard_rebinding",
        "explicit_process_group_codebook_scope",
        "canonical_parameter_fqns",
        "stable_shard_identity",
    ):
        assert getattr(after, name) is True, name
    adapter = {
        t.layout
        for t in after.training
        if t.process_group_scope is ProcessGroupScope.ADAPTER_DEFINED
    }
    assert adapter == {s.layout for s in setup.shards.values()}
    children = {c.role: c.contract for c in hybrid.optimizer_contract().children}
    for role in ("muon", "backup"):
        contract = children[role]
        assert contract is not None
        assert contract.capabilities.canonical_parameter_fqns is True


def test_second_forwarding_is_refused_untouched() -> None:
    setup = make("solo")
    setup.finalize()
    hybrid = setup.hybrid
    again = [
        ParameterRebinding(setup.targets[f], nn.Parameter(setup.targets[f].detach().clone()),
                           setup.shards[f])
        for f in setup.names
    ]  # fmt: skip
    rejects(
        hybrid,
        lambda: hybrid.post_sharding(
            again, manifest=setup.manifest, codebook_process_group=setup.binding
        ),
        RuntimeError,
        "already finalized",
    )
    trains(hybrid)


def test_children_with_different_bindings_fail_at_step_entry() -> None:
    """Finalizing the children one by one with two binding objects (bypassing the hybrid)
    leaves them with different bindings: the hybrid refuses to step, nothing changes."""
    setup = make("solo")
    hybrid = setup.hybrid
    assert hybrid.muon is not None
    assert isinstance(hybrid.backup, Gefen)
    for child, names in ((hybrid.muon, setup.muon_names()), (hybrid.backup, setup.backup_names())):
        child.post_sharding(
            [ParameterRebinding(setup.olds[f], setup.targets[f], setup.shards[f]) for f in names],
            manifest=ShardingManifest(tuple(setup.shards[f] for f in names)),
            codebook_process_group=CodebookProcessGroupBinding(SOLO, ME, None, "cpu"),
        )
    hybrid.rebuild_registry()
    fill_grads(params(hybrid), 3)
    rejects(hybrid, hybrid.step, RuntimeError, "different codebook bindings")


# -- the layout guard through the hybrid ---------------------------------------------------------


def _tampered(role: str) -> tuple[Setup, dict[str, Any], Tensor]:
    """A finalized, stepped hybrid whose ``role`` child had ``params[0]`` replaced, and a
    checkpoint taken before the replacement."""
    setup = make("solo")
    setup.finalize()
    hybrid = setup.hybrid
    trains(hybrid)
    sd = hybrid.state_dict()
    child = getattr(hybrid, role)
    original = child.param_groups[0]["params"][0]
    child.param_groups[0]["params"][0] = nn.Parameter(original.detach().clone())
    return setup, sd, original


@pytest.mark.parametrize("with_grads", [False, True], ids=["no-grads", "grads"])
@pytest.mark.parametrize("role", ["muon", "backup"])
def test_layout_guard_through_the_hybrid_step_and_state_dict(role: str, with_grads: bool) -> None:
    setup, _, original = _tampered(role)
    hybrid = setup.hybrid
    if with_grads:
        fill_grads(params(hybrid), 2)
    for action in (hybrid.step, hybrid.state_dict):
        rejects(hybrid, action, RuntimeError, "parameter layout changed")
    child = getattr(hybrid, role)
    child.param_groups[0]["params"][0] = original
    hybrid.zero_grad(set_to_none=True)
    trains(hybrid)


@pytest.mark.parametrize("role", ["muon", "backup"])
def test_layout_guard_through_the_hybrid_load(role: str) -> None:
    """docs/core.md §13: the layout guard covers load as well. The hybrid stages its children
    through ``prepare_load_state_dict``; a finalized child whose layout changed must refuse,
    and nothing may change (the checkpoint's state must not be rebound to the impostor)."""
    setup, sd, original = _tampered(role)
    hybrid = setup.hybrid
    rejects(hybrid, lambda: hybrid.load_state_dict(sd), RuntimeError, "parameter layout changed")
    child = getattr(hybrid, role)
    child.param_groups[0]["params"][0] = original
    trains(hybrid)


# -- scoped steps and checkpoints ----------------------------------------------------------------


def _trained(mode: str = "solo", steps: int = 3, seed: int = 0) -> Setup:
    setup = make(mode, seed=seed)
    setup.finalize()
    for index in range(steps):
        trains(setup.hybrid, seed=index)
    return setup


def _entries_equal(a: Any, b: Any) -> None:
    assert a.global_step == b.global_step
    assert torch.equal(a.codebook, b.codebook)
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for x, y in zip(pa, pb, strict=True):
        ea, eb = a.state[x], b.state[y]
        assert ea.keys() == eb.keys()
        for key, value in ea.items():
            if isinstance(value, Tensor):
                assert torch.equal(value, eb[key]), key
            else:
                assert value == eb[key], key


@pytest.mark.parametrize("mode", ["solo", "mixed"])
def test_scoped_hybrid_steps_and_round_trips(mode: str) -> None:
    source = _trained(mode)
    sd = source.hybrid.state_dict()
    expected = {"identity": SOLO.to_primitive(), "refresh_every": 0}
    for half in ("muon", "backup"):
        assert sd["gefen_hybrid"][half]["gefen"]["scope"] == expected
    target = make(mode, seed=4)
    target.finalize()
    for fqn in target.names:
        with torch.no_grad():
            target.targets[fqn].copy_(source.targets[fqn])
    target.hybrid.load_state_dict(_roundtrip(sd))
    for role in ("muon", "backup"):
        _entries_equal(getattr(source.hybrid, role), getattr(target.hybrid, role))
    for seed in (20, 21):
        fill_grads(params(source.hybrid), seed)
        fill_grads(params(target.hybrid), seed)
        source.hybrid.step()
        target.hybrid.step()
    for fqn in source.names:
        assert torch.equal(source.targets[fqn], target.targets[fqn]), fqn


MISMATCHES: dict[str, tuple[str, Callable[[], Setup]]] = {
    "scoped-into-unscoped": ("solo", lambda: make("ungrouped")),
    "unscoped-into-scoped": ("ungrouped", lambda: make("solo")),
    "other-identity": ("solo", lambda: make("solo", identity=OTHER)),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_scope_mismatch_rejects_the_whole_load(case: str) -> None:
    source_mode, build_target = MISMATCHES[case]
    sd = _trained(source_mode).hybrid.state_dict()
    target = build_target()
    target.finalize()
    trains(target.hybrid, seed=30)
    rejects(target.hybrid, lambda: target.hybrid.load_state_dict(sd), ValueError, SCOPE)
    trains(target.hybrid, seed=31)


def test_scope_mismatch_in_the_backup_half_leaves_the_muon_half_untouched() -> None:
    """Only the backup half's scope differs: the Muon half validates, the backup refuses, and
    neither child is committed."""
    solo, ungrouped = _trained("solo").hybrid, _trained("ungrouped").hybrid
    scoped = split(solo, solo.state_dict())
    unscoped_backup = split(ungrouped, ungrouped.state_dict())["backup"]
    sd = join({"muon": scoped["muon"], "backup": unscoped_backup, "backup_optimizer": "gefen"})
    target = make("solo", seed=2)
    target.finalize()
    trains(target.hybrid, seed=30)
    rejects(target.hybrid, lambda: target.hybrid.load_state_dict(sd), ValueError, SCOPE)
    trains(target.hybrid, seed=31)


def test_the_contract_describes_the_installed_layouts_state_and_checkpoint() -> None:
    # Both children's installed layouts were listed for training only: the state of the
    # whole-owner and flattened parameters failed the hybrid's own contract.
    from gefen.contracts import ParameterLayout
    from gefen.contracts.conformance import check_provider, check_state_dict

    setup = make("mixed")
    setup.finalize()
    hybrid = setup.hybrid
    for _ in range(2):
        for param in params(hybrid):
            param.grad = torch.randn_like(param)
        hybrid.step()
    contract = check_provider(hybrid)
    fqn_of = {id(target): fqn for fqn, target in setup.targets.items()}
    live = params(hybrid)
    layouts = {i: setup.shards[fqn_of[id(p)]].layout for i, p in enumerate(live)}
    installed = {ParameterLayout.WHOLE_PARAMETER_OWNER, ParameterLayout.FLATTENED_ELEMENT_SHARD}
    assert installed <= set(layouts.values())
    ndims = {i: p.dim() for i, p in enumerate(live)}
    check_state_dict(contract, hybrid.state_dict(), ndims=ndims, parameter_layouts=layouts)
    assert installed <= contract.capabilities.checkpoints[0].same_topology
