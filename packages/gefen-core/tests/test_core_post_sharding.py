"""``Gefen.post_sharding`` in one process
(docs/core.md §13; docs/dist.md §9.1, §12 single-rank parts).

Ungrouped shards (no process group, no binding), one-member groups with a one-member
``CodebookProcessGroupBinding`` (no handle, no collective), and — where a rule needs two
members — shards of a two-member identity built for member ``"rank:0"`` without a binding.
Every rejection proves with a deep snapshot that nothing changed (parameters, groups, names,
state, codebook, step, latch, finalization, binding) and that a corrected retry succeeds and
trains. Multi-rank scope behaviour (headers, votes, collective learning) is covered on Gloo
elsewhere.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

from gefen.contracts import (
    LogicalSlice,
    ParameterIdentity,
    ParameterLayout,
    ProcessGroupIdentity,
    ProcessGroupScope,
    ShardIdentity,
    ShardingManifest,
    TrainingSupport,
)
from gefen.core import Gefen, ParameterRebinding
from gefen.core.kernels import histogram, select_period, solve_codebook
from gefen.core.learning import with_exact_zero
from gefen.core.testing import (
    dtensor_replicate_shard,
    fill_grads,
    flattened_shard,
    rejects,
    replicated_shard,
    solo_binding,
    whole_owner_shard,
)
from gefen.core.testing import finalized_snapshot as snapshot
from gefen.core.testing import takes_a_step as trains
from gefen.core.testing import weights_only_round_trip as _roundtrip
from gefen.dist import BindingError, CheckpointProcessGroupBinding, CodebookProcessGroupBinding
from gefen.dist.testing import assert_unchanged

SOLO = ProcessGroupIdentity("solo", ("rank:0",))
OTHER = ProcessGroupIdentity("other", ("rank:0",))
PAIR = ProcessGroupIdentity("pair", ("rank:0", "rank:1"))
ME = "rank:0"

SHAPES: dict[str, tuple[int, ...]] = {
    "layer.weight": (8, 6),
    "head.weight": (4, 8),
    "layer.bias": (6,),
    "stranger.weight": (2, 2),  # never a parameter of the optimizer
}
# Group 0 holds layer.weight then head.weight, group 1 holds layer.bias (another lr).
GROUPS = (("layer.weight", "head.weight"), ("layer.bias",))
ORDER = tuple(fqn for group in GROUPS for fqn in group)
PRISTINE = "post_sharding requires a pristine optimizer"
LAYOUT = "parameter layout changed after post_sharding"
SCOPE = "codebook scope"


# -- shard identities ----------------------------------------------------------------------------


def _pid(fqn: str) -> ParameterIdentity:
    return ParameterIdentity(fqn, SHAPES[fqn])


def _numel(fqn: str) -> int:
    return _pid(fqn).numel


def replicated(
    fqn: str, group: ProcessGroupIdentity | None = None, member: str = ME
) -> ShardIdentity:
    return replicated_shard(_pid(fqn), group, member)


def flattened(
    fqn: str, offset: int, length: int, group: ProcessGroupIdentity = SOLO, member: str = ME
) -> ShardIdentity:
    return flattened_shard(_pid(fqn), group, member, offset, length)


def whole_owner(
    fqn: str, group: ProcessGroupIdentity = SOLO, member: str = ME, owner: str = ME
) -> ShardIdentity:
    return whole_owner_shard(_pid(fqn), group, member, owner)


def dtensor_replicate(fqn: str, group: ProcessGroupIdentity = SOLO) -> ShardIdentity:
    return dtensor_replicate_shard(_pid(fqn), group)


# -- the optimizer under test -------------------------------------------------------------------


@dataclass
class Setup:
    """A pristine Gefen over ``olds`` and the good finalization of it (``mode``)."""

    mode: str
    opt: Gefen
    olds: dict[str, torch.nn.Parameter]
    targets: dict[str, Tensor]
    shards: dict[str, ShardIdentity]
    binding: CodebookProcessGroupBinding | None
    extra_manifest: tuple[ShardIdentity, ...] = field(default=())

    def rebindings(self) -> list[ParameterRebinding]:
        return [ParameterRebinding(self.olds[f], self.targets[f], self.shards[f]) for f in ORDER]

    @property
    def manifest(self) -> ShardingManifest:
        return ShardingManifest((*self.shards.values(), *self.extra_manifest))

    def kwargs(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "codebook_process_group": self.binding}

    def finalize(self) -> None:
        self.opt.post_sharding(self.rebindings(), **self.kwargs())

    def live(self) -> list[Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]


def _olds(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return {fqn: torch.nn.Parameter(torch.randn(SHAPES[fqn], generator=generator)) for fqn in ORDER}


def make(
    mode: str = "solo",
    *,
    identity: ProcessGroupIdentity = SOLO,
    named: bool = False,
    seed: int = 0,
    **options: Any,
) -> Setup:
    """``ungrouped``: no group, no binding; ``solo``: one-member group with its binding;
    ``solo-unbound``: the same shards without a binding; ``flat``: layer.weight as one 1-D
    flattened shard of the one-member group, the rest replicated in it, with the binding."""
    olds = _olds(seed)

    def entry(fqn: str) -> Any:
        return (f"orig.{fqn}", olds[fqn]) if named else olds[fqn]

    groups = [
        {"params": [entry(f) for f in GROUPS[0]]},
        {"params": [entry(f) for f in GROUPS[1]], "lr": 0.01},
    ]
    options.setdefault("lr", 0.05)
    opt = Gefen(groups, **options)
    targets: dict[str, Tensor] = {
        fqn: torch.nn.Parameter(olds[fqn].detach().clone()) for fqn in ORDER
    }
    group = None if mode == "ungrouped" else identity
    shards = {fqn: replicated(fqn, group) for fqn in ORDER}
    if mode == "flat":
        fqn = "layer.weight"
        shards[fqn] = flattened(fqn, 0, _numel(fqn), identity)
        targets[fqn] = torch.nn.Parameter(olds[fqn].detach().reshape(-1).clone())
    binding = solo_binding(identity) if mode in ("solo", "flat") else None
    return Setup(mode, opt, olds, targets, shards, binding)


# -- argument types ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: object(), id="object"),
        pytest.param(lambda: "rank:0", id="str"),
        pytest.param(lambda: CheckpointProcessGroupBinding(SOLO, ME, None, "cpu"), id="checkpoint"),
    ],
)
def test_codebook_process_group_must_be_exactly_a_codebook_binding(bad: Callable[[], Any]) -> None:
    setup = make("solo")
    rejects(
        setup.opt,
        lambda: setup.opt.post_sharding(
            setup.rebindings(), manifest=setup.manifest, codebook_process_group=bad()
        ),
        TypeError,
        "codebook_process_group must be a gefen.dist.CodebookProcessGroupBinding or None",
    )
    setup.finalize()
    assert setup.opt.finalized is not None
    assert setup.opt.finalized.binding is setup.binding
    trains(setup.opt)


def test_codebook_binding_subclass_is_refused() -> None:
    class Derived(CodebookProcessGroupBinding):
        pass

    setup = make("solo")
    rejects(
        setup.opt,
        lambda: setup.opt.post_sharding(
            setup.rebindings(),
            manifest=setup.manifest,
            codebook_process_group=Derived(SOLO, ME, None, "cpu"),
        ),
        TypeError,
        "codebook_process_group",
    )
    setup.finalize()
    trains(setup.opt)


@pytest.mark.parametrize(
    "shard",
    [
        pytest.param(lambda: object(), id="object"),
        pytest.param(lambda: None, id="none"),
        pytest.param(lambda: replicated("layer.weight").to_primitive(), id="primitive"),
        pytest.param(lambda: _pid("layer.weight"), id="parameter-identity"),
    ],
)
def test_rebinding_shard_must_be_a_shard_identity(shard: Callable[[], Any]) -> None:
    old = torch.nn.Parameter(torch.zeros(8, 6))
    with pytest.raises(TypeError, match=r"ParameterRebinding\.shard must be a "):
        ParameterRebinding(old, torch.nn.Parameter(torch.zeros(8, 6)), shard())


def test_rebinding_is_frozen_and_compares_by_identity() -> None:
    old, new = torch.nn.Parameter(torch.zeros(8, 6)), torch.nn.Parameter(torch.zeros(8, 6))
    shard = replicated("layer.weight")
    a = ParameterRebinding(old, new, shard)
    b = ParameterRebinding(old, new, shard)
    assert a == a
    assert a != b
    assert len({a, b}) == 2
    with pytest.raises(AttributeError):
        a.new_parameter = old  # type: ignore[misc]


def test_manifest_and_rebinding_records_are_type_checked() -> None:
    setup = make("solo")
    opt = setup.opt
    rejects(
        opt,
        lambda: opt.post_sharding(
            setup.rebindings(),
            manifest=setup.manifest.to_primitive(),  # type: ignore[arg-type]
            codebook_process_group=setup.binding,
        ),
        TypeError,
        "manifest must be a ShardingManifest",
    )
    bad = [*setup.rebindings()[:-1], ("layer.bias", setup.targets["layer.bias"])]
    rejects(
        opt,
        lambda: opt.post_sharding(bad, **setup.kwargs()),  # type: ignore[arg-type]
        TypeError,
        "rebindings[2] must be a ParameterRebinding",
    )
    setup.finalize()
    trains(opt)


# -- preconditions -------------------------------------------------------------------------------


def _after_step(setup: Setup) -> None:
    trains(setup.opt, setup.live())


def _with_codebook(setup: Setup) -> None:
    fill_grads(setup.live(), 3)
    assert setup.opt.initialize_codebook() is True
    setup.opt.zero_grad(set_to_none=True)
    assert setup.opt.global_step == 0
    assert setup.opt.codebook is not None


def _with_codebook_only(setup: Setup) -> None:
    """A codebook at step 0 with every entry still pristine (a loaded checkpoint)."""
    donor = make("ungrouped", seed=4)
    fill_grads(donor.live(), 5)
    assert donor.opt.initialize_codebook() is True
    sd = setup.opt.state_dict()
    for extras in (sd["gefen"], *(g["gefen"] for g in sd["param_groups"])):
        extras["codebook"] = donor.opt.codebook.clone()
        extras["codebook_present"] = 1
    setup.opt.load_state_dict(sd)
    assert setup.opt.codebook is not None
    assert setup.opt.global_step == 0
    assert all(entry == {"period": 0} for entry in setup.opt.state.values())


def _with_gradient(setup: Setup) -> None:
    setup.olds["layer.bias"].grad = torch.ones(6)


def _with_zero_gradient(setup: Setup) -> None:
    setup.olds["head.weight"].grad = torch.zeros(4, 8)


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(_after_step, id="after-step"),
        pytest.param(_with_codebook, id="codebook"),
        pytest.param(_with_codebook_only, id="codebook-only"),
        pytest.param(_with_gradient, id="gradient"),
        pytest.param(_with_zero_gradient, id="zero-gradient"),
    ],
)
@pytest.mark.parametrize("mode", ["ungrouped", "solo"])
def test_preconditions_require_a_pristine_optimizer(
    mode: str, spoil: Callable[[Setup], None]
) -> None:
    setup = make(mode)
    spoil(setup)
    rejects(setup.opt, setup.finalize, RuntimeError, PRISTINE)
    assert setup.opt.finalized is None
    assert setup.opt.optimizer_contract().capabilities.canonical_parameter_fqns is False


def test_gradient_precondition_clears_and_retry_succeeds() -> None:
    setup = make("solo")
    _with_gradient(setup)
    rejects(setup.opt, setup.finalize, RuntimeError, PRISTINE)
    setup.opt.zero_grad(set_to_none=True)
    setup.finalize()
    trains(setup.opt)


@pytest.mark.parametrize("mode", ["ungrouped", "solo", "flat"])
def test_second_post_sharding_is_already_finalized(mode: str) -> None:
    setup = make(mode)
    setup.finalize()
    opt = setup.opt
    rejects(opt, setup.finalize, RuntimeError, "already finalized")
    # Rebinding the live targets onto themselves is refused the same way.
    again = [
        ParameterRebinding(setup.targets[f], torch.nn.Parameter(setup.targets[f].detach().clone()),
                           setup.shards[f])
        for f in ORDER
    ]  # fmt: skip
    rejects(opt, lambda: opt.post_sharding(again, **setup.kwargs()), RuntimeError, "finalized")
    trains(opt)


# -- validation ----------------------------------------------------------------------------------

Case = Callable[[Setup], tuple[list[ParameterRebinding], ShardingManifest]]


def _swap(setup: Setup, fqn: str, **fields: Any) -> list[ParameterRebinding]:
    out = []
    for f in ORDER:
        old, new, shard = setup.olds[f], setup.targets[f], setup.shards[f]
        if f == fqn:
            old = fields.get("old", old)
            new = fields.get("new", new)
            shard = fields.get("shard", shard)
        out.append(ParameterRebinding(old, new, shard))
    return out


def _with_target(fqn: str, make_target: Callable[[Setup], Any]) -> Case:
    return lambda s: (_swap(s, fqn, new=make_target(s)), s.manifest)


def _grouped(setup: Setup) -> ProcessGroupIdentity | None:
    return None if setup.mode == "ungrouped" else SOLO


def _missing(s: Setup) -> Any:
    return [r for r in s.rebindings() if r.shard.parameter.fqn != "layer.bias"], s.manifest


def _two_for_one_slot(s: Setup) -> Any:
    extra = ParameterRebinding(s.olds["head.weight"], torch.nn.Parameter(torch.zeros(4, 8)),
                               s.shards["head.weight"])  # fmt: skip
    return [*s.rebindings(), extra], s.manifest


def _foreign_source(s: Setup) -> Any:
    stranger = torch.nn.Parameter(torch.zeros(2, 2))
    shard = replicated("stranger.weight", _grouped(s))
    extra = ParameterRebinding(stranger, torch.nn.Parameter(torch.zeros(2, 2)), shard)
    return [*s.rebindings(), extra], ShardingManifest((*s.manifest.shards, shard))


def _duplicate_target(s: Setup) -> Any:
    shared = torch.nn.Parameter(torch.zeros(6))
    rebindings = _swap(s, "layer.bias", new=shared)
    rebindings[0] = ParameterRebinding(s.olds["layer.weight"], shared, s.shards["layer.weight"])
    return rebindings, s.manifest


def _duplicate_fqn(s: Setup) -> Any:
    renamed = ShardIdentity(
        ParameterIdentity("layer.weight", SHAPES["head.weight"]),
        ParameterLayout.REPLICATED,
        LogicalSlice(0, _numel("head.weight")),
    )
    return _swap(s, "head.weight", shard=renamed), s.manifest


def _manifest_missing_fqn(s: Setup) -> Any:
    shards = tuple(x for x in s.manifest.shards if x.parameter.fqn != "layer.bias")
    return s.rebindings(), ShardingManifest(shards)


def _manifest_extra_fqn(s: Setup) -> Any:
    extra = replicated("stranger.weight", _grouped(s))
    return s.rebindings(), ShardingManifest((*s.manifest.shards, extra))


def _shard_not_in_manifest(s: Setup) -> Any:
    other = replicated("layer.bias", SOLO if s.mode == "ungrouped" else None)
    shards = tuple(x for x in s.manifest.shards if x.parameter.fqn != "layer.bias")
    return s.rebindings(), ShardingManifest((*shards, other))


def _two_local_members(s: Setup) -> Any:
    mine = replicated("layer.weight", PAIR, "rank:0")
    theirs = replicated("head.weight", PAIR, "rank:1")
    peers = (replicated("layer.weight", PAIR, "rank:1"), replicated("head.weight", PAIR, "rank:0"))
    rebindings = _swap(s, "layer.weight", shard=mine)
    rebindings[1] = ParameterRebinding(s.olds["head.weight"], s.targets["head.weight"], theirs)
    bias = s.shards["layer.bias"]
    return rebindings, ShardingManifest((mine, theirs, *peers, bias))


def _none_target(s: Setup) -> Any:
    return _swap(s, "head.weight", new=None), s.manifest


def _dtype_target(dtype: torch.dtype) -> Case:
    return _with_target("head.weight", lambda s: torch.zeros(4, 8, dtype=dtype))


def _meta_target(s: Setup) -> Any:
    return _swap(s, "head.weight", new=torch.empty(4, 8, device="meta")), s.manifest


def _non_leaf_target(s: Setup) -> Any:
    base = torch.zeros(4, 8, requires_grad=True)
    return _swap(s, "head.weight", new=base * 2), s.manifest


def _grad_target(s: Setup) -> Any:
    target = torch.nn.Parameter(torch.zeros(4, 8))
    target.grad = torch.ones(4, 8)
    return _swap(s, "head.weight", new=target), s.manifest


def _sparse_target(s: Setup) -> Any:
    return _swap(s, "head.weight", new=torch.zeros(4, 8).to_sparse()), s.manifest


def _overlapping_views(s: Setup) -> Any:
    base = torch.zeros(48 + 32)
    rebindings = _swap(s, "layer.weight", new=base[:48].view(8, 6))
    rebindings[1] = ParameterRebinding(
        s.olds["head.weight"], base[40:72].view(4, 8), s.shards["head.weight"]
    )
    return rebindings, s.manifest


def _wrong_replicated_shape(s: Setup) -> Any:
    return _swap(s, "layer.weight", new=torch.nn.Parameter(torch.zeros(6, 8))), s.manifest


def _flat_shard(s: Setup, target: Tensor) -> Any:
    group = SOLO
    shard = flattened("layer.weight", 0, 48, group)
    shards = tuple(x for x in s.manifest.shards if x.parameter.fqn != "layer.weight")
    if s.mode == "ungrouped":
        # A flattened shard needs a group: regroup every shard into the one-member group.
        shards = tuple(replicated(x.parameter.fqn, SOLO) for x in shards)
        rebindings = [
            ParameterRebinding(s.olds[f], s.targets[f], replicated(f, SOLO)) for f in ORDER
        ]
    else:
        rebindings = s.rebindings()
    rebindings[0] = ParameterRebinding(s.olds["layer.weight"], target, shard)
    return rebindings, ShardingManifest((*shards, shard))


def _flat_two_dim(s: Setup) -> Any:
    return _flat_shard(s, torch.nn.Parameter(torch.zeros(8, 6)))


def _flat_strided(s: Setup) -> Any:
    return _flat_shard(s, torch.zeros(96)[::2])


def _flat_short(s: Setup) -> Any:
    return _flat_shard(s, torch.nn.Parameter(torch.zeros(47)))


def _layout_shard(s: Setup, shard: ShardIdentity) -> Any:
    if s.mode == "ungrouped":
        rebindings = [
            ParameterRebinding(s.olds[f], s.targets[f], replicated(f, SOLO)) for f in ORDER
        ]
        shards = [replicated(f, SOLO) for f in ORDER if f != shard.parameter.fqn]
    else:
        rebindings = s.rebindings()
        shards = [s.shards[f] for f in ORDER if f != shard.parameter.fqn]
    position = ORDER.index(shard.parameter.fqn)
    rebindings[position] = ParameterRebinding(
        s.olds[shard.parameter.fqn], s.targets[shard.parameter.fqn], shard
    )
    return rebindings, ShardingManifest((*shards, shard))


def _whole_owner_layout(s: Setup) -> Any:
    return _layout_shard(s, whole_owner("head.weight"))


def _dtensor_layout(s: Setup) -> Any:
    return _layout_shard(s, dtensor_replicate("head.weight"))


VALIDATION: dict[str, tuple[Case, str, str]] = {
    "missing": (_missing, "param_groups[1][0]", "has no rebinding"),
    "two-for-one-slot": (_two_for_one_slot, "head.weight", "two rebindings share one source"),
    "foreign-source": (_foreign_source, "stranger.weight", "the source is not a parameter"),
    "duplicate-target": (_duplicate_target, "targets", "two rebindings bind one target"),
    "duplicate-fqn": (_duplicate_fqn, "layer.weight", "two rebindings name one FQN"),
    "manifest-missing-fqn": (_manifest_missing_fqn, "layer.bias", "manifest's FQN set differs"),
    "manifest-extra-fqn": (_manifest_extra_fqn, "stranger.weight", "manifest's FQN set differs"),
    "shard-not-in-manifest": (_shard_not_in_manifest, "layer.bias", "not in the manifest"),
    "two-local-members": (_two_local_members, "head.weight", "two local members"),
    "none-target": (_none_target, "head.weight", "only a whole-parameter-owner non-owner"),
    "int-target": (_dtype_target(torch.int64), "head.weight", "real floating"),
    "bool-target": (_dtype_target(torch.bool), "head.weight", "real floating"),
    "complex-target": (_dtype_target(torch.complex64), "head.weight", "real floating"),
    "meta-target": (_meta_target, "head.weight", "strided and materialized"),
    "sparse-target": (_sparse_target, "head.weight", "strided and materialized"),
    "non-leaf-target": (_non_leaf_target, "head.weight", "a leaf without a gradient"),
    "grad-target": (_grad_target, "head.weight", "a leaf without a gradient"),
    "overlapping-views": (_overlapping_views, "head.weight", "shares storage with layer.weight"),
    "replicated-shape": (_wrong_replicated_shape, "layer.weight", "global shape (8, 6)"),
    "flat-two-dim": (_flat_two_dim, "layer.weight", "1-D contiguous of length 48"),
    "flat-strided": (_flat_strided, "layer.weight", "1-D contiguous of length 48"),
    "flat-short": (_flat_short, "layer.weight", "1-D contiguous of length 48"),
    "whole-owner-layout": (
        _whole_owner_layout,
        "head.weight",
        "layout whole_parameter_owner is not supported",
    ),
    "dtensor-layout": (
        _dtensor_layout,
        "head.weight",
        "layout dtensor_1d_default_world is not supported",
    ),
}


@pytest.mark.parametrize("case", list(VALIDATION))
@pytest.mark.parametrize("mode", ["ungrouped", "solo"])
def test_validation_rejects_naming_the_slot_and_retry_succeeds(mode: str, case: str) -> None:
    build, slot, rule = VALIDATION[case]
    setup = make(mode, named=True)
    opt = setup.opt
    rebindings, manifest = build(setup)
    binding = setup.binding
    if case in ("two-local-members",):
        binding = None  # a two-member identity cannot be bound in one process
    info = rejects(
        opt,
        lambda: opt.post_sharding(rebindings, manifest=manifest, codebook_process_group=binding),
        ValueError,
        rule,
    )
    message = str(info.value)
    assert message.startswith("post_sharding: ")
    assert message.startswith(f"post_sharding: {slot}: ")
    assert opt.finalized is None
    assert opt.param_groups[0]["param_names"] == ["orig.layer.weight", "orig.head.weight"]
    # The corrected call succeeds and the optimizer trains on the targets.
    setup.finalize()
    assert opt.finalized is not None
    trains(opt, [setup.targets[f] for f in ORDER])


def test_prepare_post_sharding_validates_without_mutation_and_commit_publishes() -> None:
    setup = make("solo")
    opt = setup.opt
    before = snapshot(opt)
    prepared = opt.prepare_post_sharding(setup.rebindings(), **setup.kwargs())
    assert_unchanged(before, snapshot(opt))
    assert opt.finalized is None
    prepared.commit()
    assert opt.finalized is prepared.finalized
    assert [p for g in opt.param_groups for p in g["params"]] == [setup.targets[f] for f in ORDER]


def test_disjoint_views_of_one_storage_are_accepted() -> None:
    setup = make("ungrouped")
    base = torch.zeros(48 + 32 + 6)
    views = {"layer.weight": base[:48].view(8, 6), "head.weight": base[48:80].view(4, 8),
             "layer.bias": base[80:]}  # fmt: skip
    for fqn, view in views.items():
        view.copy_(setup.olds[fqn].detach())
        view.requires_grad_(True)
    setup.targets = views
    setup.finalize()
    trains(setup.opt, list(views.values()))


@pytest.mark.parametrize("mode", ["ungrouped", "solo"])
def test_rebinding_a_slot_to_its_own_tensor_is_allowed(mode: str) -> None:
    """An adapter that keeps the tensors and only declares identities rebinds each slot to
    itself; the names become the FQNs and training continues on the same tensors."""
    setup = make(mode, named=True)
    setup.targets = dict(setup.olds)
    setup.finalize()
    assert setup.opt.param_groups[0]["params"][0] is setup.olds["layer.weight"]
    assert setup.opt.param_groups[0]["param_names"] == list(GROUPS[0])
    trains(setup.opt)


def test_validation_order_binding_checks_run_last() -> None:
    """With a binding, an ungrouped manifest fails the §9.1 scope check (BindingError) only
    after every ValueError rule passed; nothing changes."""
    setup = make("ungrouped")
    opt = setup.opt
    binding = solo_binding(SOLO)
    rejects(
        opt,
        lambda: opt.post_sharding(
            setup.rebindings(), manifest=setup.manifest, codebook_process_group=binding
        ),
        BindingError,
        "must use the binding's process-group identity",
    )
    # A ValueError rule still wins over the binding mismatch.
    bad, manifest = _none_target(setup)
    rejects(
        opt,
        lambda: opt.post_sharding(bad, manifest=manifest, codebook_process_group=binding),
        ValueError,
        "only a whole-parameter-owner non-owner",
    )
    setup.finalize()
    trains(opt)


# -- effect --------------------------------------------------------------------------------------


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("mode", ["ungrouped", "solo", "solo-unbound", "flat"])
def test_effect_targets_names_state_and_finalized(mode: str, named: bool) -> None:
    setup = make(mode, named=named)
    opt = setup.opt
    lrs = [g["lr"] for g in opt.param_groups]
    setup.finalize()
    groups = opt.param_groups
    assert len(groups) == 2
    for group, fqns in zip(groups, GROUPS, strict=True):
        assert len(group["params"]) == len(fqns)
        assert all(p is setup.targets[f] for p, f in zip(group["params"], fqns, strict=True))
        assert group["param_names"] == list(fqns)
        assert type(group["param_names"]) is list
    assert [g["lr"] for g in groups] == lrs
    assert len(opt.state) == len(ORDER)
    for fqn in ORDER:
        assert opt.state[setup.targets[fqn]] == {"period": 0}
    assert all(old not in opt.state for old in setup.olds.values())
    finalized = opt.finalized
    assert finalized is not None
    assert finalized.manifest == setup.manifest
    assert finalized.binding is setup.binding
    assert opt._binding is setup.binding
    assert (finalized.scope_fingerprint is None) == (setup.binding is None)
    assert [shard for shard, _ in finalized.shards] == sorted(
        setup.shards.values(), key=lambda s: s.sort_key
    )
    assert all(tensor is setup.targets[s.parameter.fqn] for s, tensor in finalized.shards)
    assert opt.global_step == 0
    assert opt.codebook is None
    # The sources are no longer the optimizer's: their values never change again.
    olds = {f: p.detach().clone() for f, p in setup.olds.items()}
    trains(opt, [setup.targets[f] for f in ORDER])
    assert all(torch.equal(olds[f], setup.olds[f]) for f in ORDER)


@pytest.mark.parametrize("mode", ["ungrouped", "solo"])
def test_add_param_group_is_refused_after_finalization(mode: str) -> None:
    setup = make(mode)
    setup.finalize()
    opt = setup.opt
    rejects(
        opt,
        lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]}),
        RuntimeError,
        "finalized",
    )
    trains(opt)


# -- the layout guard ----------------------------------------------------------------------------


def _guarded_actions(opt: Gefen, sd: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    return {
        "step": opt.step,
        "step-closure": lambda: opt.step(lambda: torch.tensor(1.0)),
        "initialize_codebook": opt.initialize_codebook,
        "refresh_codebook": opt.refresh_codebook,
        "state_dict": opt.state_dict,
        "load_state_dict": lambda: opt.load_state_dict(sd),
    }


@pytest.mark.parametrize("with_grads", [False, True], ids=["no-grads", "grads"])
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("mode", ["ungrouped", "solo", "flat"])
def test_layout_guard_after_replacing_a_parameter(
    mode: str, stepped: bool, with_grads: bool
) -> None:
    setup = make(mode, codebook_refresh_every=1)
    setup.finalize()
    opt = setup.opt
    if stepped:
        trains(opt)
    sd = opt.state_dict()
    original = opt.param_groups[0]["params"][0]
    impostor = torch.nn.Parameter(original.detach().clone())
    opt.param_groups[0]["params"][0] = impostor
    if with_grads:
        fill_grads(
            [impostor, *opt.param_groups[0]["params"][1:], *opt.param_groups[1]["params"]], 1
        )
    for name, action in _guarded_actions(opt, sd).items():
        info = rejects(opt, action, RuntimeError, LAYOUT)
        assert "Gefen" in str(info.value), name
    assert impostor not in opt.state
    # Another order of the same tensors, or a removed tensor, trips the guard as well.
    opt.param_groups[0]["params"][0] = original
    opt.param_groups[0]["params"].reverse()
    rejects(opt, opt.step, RuntimeError, LAYOUT)
    opt.param_groups[0]["params"].reverse()
    removed = opt.param_groups[1]["params"].pop()
    rejects(opt, opt.state_dict, RuntimeError, LAYOUT)
    opt.param_groups[1]["params"].append(removed)
    opt.zero_grad(set_to_none=True)
    trains(opt)


def test_layout_guard_detects_a_replaced_params_list_and_an_extra_group() -> None:
    setup = make("solo")
    setup.finalize()
    opt = setup.opt
    kept = opt.param_groups[1]["params"]
    opt.param_groups[1]["params"] = list(kept)  # equal contents, new list: still intact
    trains(opt)
    extra = dict(opt.param_groups[1])
    extra["params"] = [torch.nn.Parameter(torch.zeros(3))]
    opt.param_groups.append(extra)
    rejects(opt, opt.step, RuntimeError, LAYOUT)
    opt.param_groups.pop()
    trains(opt)


# -- training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ungrouped", "solo", "solo-unbound", "flat"])
def test_training_after_post_sharding(mode: str) -> None:
    setup = make(mode, codebook_refresh_every=2)
    setup.finalize()
    opt = setup.opt
    for seed in range(5):
        trains(opt, seed=seed)
    assert opt.global_step == 5
    for fqn in ORDER:
        entry = opt.state[setup.targets[fqn]]
        assert entry["period"] > 0
        assert "momentum_codes" in entry
    assert opt.refresh_codebook() in (True, False)


def _unsharded_twin(setup: Setup) -> Gefen:
    twin_params = {f: torch.nn.Parameter(setup.olds[f].detach().clone()) for f in ORDER}
    opt = Gefen(
        [{"params": [twin_params[f] for f in GROUPS[0]]},
         {"params": [twin_params[f] for f in GROUPS[1]], "lr": 0.01}],
        lr=0.05,
    )  # fmt: skip
    opt._twin = twin_params  # type: ignore[attr-defined]
    return opt


@pytest.mark.parametrize("mode", ["ungrouped", "solo", "solo-unbound"])
def test_replicated_finalization_trains_exactly_like_the_unsharded_optimizer(mode: str) -> None:
    setup = make(mode)
    setup.finalize()
    twin = _unsharded_twin(setup)
    twin_params = twin._twin  # type: ignore[attr-defined]
    for seed in range(4):
        fill_grads([setup.targets[f] for f in ORDER], seed)
        fill_grads([twin_params[f] for f in ORDER], seed)
        setup.opt.step()
        twin.step()
    assert torch.equal(setup.opt.codebook, twin.codebook)
    for fqn in ORDER:
        assert torch.equal(setup.targets[fqn], twin_params[fqn]), fqn


def test_a_scoped_refresh_counts_a_parameter_whose_first_gradient_arrives_with_it() -> None:
    """docs/core.md §5.6 step 1: a periodic refresh histograms the periods staged this step.
    The scoped refresh left out a parameter whose first gradient came on the refresh step, so
    a one-member scope learned another codebook than the unsharded optimizer."""
    solo = ProcessGroupIdentity("solo", ("rank:0",))
    shape = (8, 16)
    initial = [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def run(scoped: bool) -> tuple[Tensor, list[Tensor]]:
        olds = [torch.nn.Parameter(value.clone()) for value in initial]
        optimizer = Gefen(olds, lr=0.01, codebook_refresh_every=2)
        params = olds
        if scoped:
            params = [torch.nn.Parameter(value.clone()) for value in initial]
            shards = [replicated_shard(ParameterIdentity(n, shape), solo) for n in ("a", "b")]
            optimizer.post_sharding(
                [ParameterRebinding(o, t, s) for o, t, s in zip(olds, params, shards, strict=True)],
                manifest=ShardingManifest(tuple(shards)),
                codebook_process_group=solo_binding(solo),
            )
        for step in range(3):
            generator = torch.Generator().manual_seed(100 + step)
            params[0].grad = torch.randn(shape, generator=generator)
            late = torch.randn(shape, generator=generator) * 50  # another distribution
            params[1].grad = late if step == 2 else None  # first seen at the refresh step
            optimizer.step()
        assert optimizer.codebook is not None
        return optimizer.codebook, [p.detach().clone() for p in params]

    (plain_codebook, plain), (scoped_codebook, scoped) = run(False), run(True)
    assert torch.equal(plain_codebook, scoped_codebook)
    assert all(torch.equal(a, b) for a, b in zip(plain, scoped, strict=True))


def test_one_member_flattened_codebook_equals_the_shard_oracle() -> None:
    """docs/core.md §13 oracle over one member: the flattened shard selects its period from its
    own 1-D slice; the replicated shards contribute once; the histogram is solved."""
    setup = make("flat")
    setup.finalize()
    opt = setup.opt
    live = [setup.targets[f] for f in ORDER]
    fill_grads(live, 11)
    assert opt.initialize_codebook() is True
    counts = torch.zeros(4096, dtype=torch.int64)
    for fqn in ORDER:
        grad = setup.targets[fqn].grad
        assert grad is not None
        # Gefen's rule: one block per row where the shape allows, else §4's search.
        fixed = opt.template_period(opt.param_groups[0], setup.targets[fqn])
        period = fixed or select_period(grad, tuple(grad.shape), force_one=False)
        assert period is not None
        assert opt.state[setup.targets[fqn]]["period"] == period
        counts += histogram(grad, period)
    assert torch.equal(opt.codebook, with_exact_zero(solve_codebook(counts)))
    assert opt.global_step == 0


def _pair_flat(offset: int, length: int, target: Tensor | None = None) -> Setup:
    """layer.weight flattened over a two-member group, seen from member rank:0 without a
    binding (the peer's slice is in the manifest only); the rest replicated in that group."""
    setup = make("ungrouped")
    fqn = "layer.weight"
    rest = (length, 48 - length) if offset == 0 else (0, offset)
    peer = flattened(fqn, rest[0], rest[1], PAIR, "rank:1")
    setup.shards = {f: replicated(f, PAIR) for f in ORDER}
    setup.shards[fqn] = flattened(fqn, offset, length, PAIR, ME)
    others = tuple(replicated(f, PAIR, "rank:1") for f in ORDER if f != fqn)
    setup.extra_manifest = (peer, *others)
    flat = setup.olds[fqn].detach().reshape(-1)[offset : offset + length].clone()
    setup.targets[fqn] = torch.nn.Parameter(flat) if target is None else target
    return setup


@pytest.mark.parametrize(("offset", "length"), [(0, 24), (24, 24), (0, 0)])
def test_two_member_flattened_shard_without_binding(offset: int, length: int) -> None:
    setup = _pair_flat(offset, length)
    opt = setup.opt
    setup.finalize()
    target = setup.targets["layer.weight"]
    assert opt.param_groups[0]["params"][0] is target
    assert tuple(target.shape) == (length,)
    layouts = {
        t.layout
        for t in opt.optimizer_contract().capabilities.training
        if t.process_group_scope is ProcessGroupScope.ADAPTER_DEFINED
    }
    assert layouts == {ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD}
    live = setup.live()
    fill_grads(live, 13)
    assert opt.initialize_codebook() is True
    # The oracle over this member's slices: the flattened slice picks its own period.
    counts = torch.zeros(4096, dtype=torch.int64)
    for tensor in live:
        if tensor.numel() == 0:
            continue
        assert tensor.grad is not None
        fixed = opt.template_period(opt.param_groups[0], tensor)
        period = fixed or select_period(tensor.grad, tuple(tensor.grad.shape), force_one=False)
        assert period is not None
        counts += histogram(tensor.grad, period)
    assert torch.equal(opt.codebook, with_exact_zero(solve_codebook(counts)))
    for seed in range(3):
        fill_grads(live, seed)
        opt.step()
    assert opt.global_step == 3


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(lambda: torch.nn.Parameter(torch.zeros(48)), id="global-length"),
        pytest.param(lambda: torch.nn.Parameter(torch.zeros(4, 6)), id="two-dim"),
        pytest.param(lambda: torch.zeros(48)[::2], id="strided"),
    ],
)
def test_two_member_flattened_target_must_match_the_slice(target: Callable[[], Tensor]) -> None:
    setup = _pair_flat(0, 24, target())
    rejects(
        setup.opt,
        setup.finalize,
        ValueError,
        "post_sharding: layer.weight: a flattened shard target must be 1-D contiguous of length 24",
    )
    good = _pair_flat(0, 24)
    setup.targets["layer.weight"] = good.targets["layer.weight"]
    setup.finalize()
    trains(setup.opt)


# -- the contract --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ungrouped", "solo", "flat"])
def test_contract_flags_and_finalized_training(mode: str) -> None:
    setup = make(mode)
    opt = setup.opt
    before = opt.optimizer_contract().capabilities
    for name in ("post_sharding", "shard_rebinding", "explicit_process_group_codebook_scope"):
        assert getattr(before, name) is True, name
    assert before.canonical_parameter_fqns is False
    assert before.stable_shard_identity is False
    assert all(t.process_group_scope is not ProcessGroupScope.ADAPTER_DEFINED
               for t in before.training)  # fmt: skip
    snap = snapshot(opt)
    opt.optimizer_contract()
    assert_unchanged(snap, snapshot(opt))
    setup.finalize()
    after = opt.optimizer_contract().capabilities
    for name in (
        "post_sharding",
        "shard_rebinding",
        "explicit_process_group_codebook_scope",
        "canonical_parameter_fqns",
        "stable_shard_identity",
    ):
        assert getattr(after, name) is True, name
    adapter = [
        t for t in after.training if t.process_group_scope is ProcessGroupScope.ADAPTER_DEFINED
    ]
    layouts = {ParameterLayout.REPLICATED}
    if mode == "flat":
        layouts.add(ParameterLayout.FLATTENED_ELEMENT_SHARD)
    assert {t.layout for t in adapter} == layouts
    for entry in adapter:
        assert entry == TrainingSupport(
            layout=entry.layout,
            process_group_scope=ProcessGroupScope.ADAPTER_DEFINED,
            requires_post_step_parameter_sync=False,
        )
    # The base entries stay.
    assert before.training == tuple(t for t in after.training if t not in adapter)


# -- checkpoints ---------------------------------------------------------------------------------


def _trained(mode: str = "solo", *, steps: int = 3, **options: Any) -> Setup:
    options.setdefault("codebook_refresh_every", 2)
    setup = make(mode, **options)
    setup.finalize()
    for seed in range(steps):
        trains(setup.opt, seed=seed)
    return setup


@pytest.mark.parametrize("mode", ["solo", "flat"])
def test_scoped_checkpoint_records_the_scope_everywhere(mode: str) -> None:
    setup = _trained(mode, codebook_refresh_every=3)
    sd = setup.opt.state_dict()
    expected = {"identity": SOLO.to_primitive(), "refresh_every": 3}
    assert sd["gefen"]["scope"] == expected
    for group in sd["param_groups"]:
        assert group["gefen"]["scope"] == expected
        assert group["gefen"]["scope"] is not sd["gefen"]["scope"]
    loaded = _roundtrip(sd)  # weights_only: the scope holds primitives only
    assert loaded["gefen"]["scope"] == expected
    assert loaded["param_groups"][0]["param_names"] == list(GROUPS[0])


@pytest.mark.parametrize("mode", ["ungrouped", "solo-unbound"])
def test_unscoped_finalized_checkpoint_has_no_scope(mode: str) -> None:
    setup = _trained(mode)
    sd = setup.opt.state_dict()
    assert "scope" not in sd["gefen"]
    assert all("scope" not in group["gefen"] for group in sd["param_groups"])
    twin = make(mode, codebook_refresh_every=2, seed=5)
    twin.finalize()
    twin.opt.load_state_dict(_roundtrip(sd))
    assert twin.opt.global_step == 3


def _state_equal(a: Gefen, b: Gefen) -> None:
    assert a.global_step == b.global_step
    assert torch.equal(a.codebook, b.codebook)
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for x, y in zip(pa, pb, strict=True):
        ea, eb = a.state[x], b.state[y]
        assert ea.keys() == eb.keys()
        for key in ea:
            if isinstance(ea[key], Tensor):
                assert torch.equal(ea[key], eb[key]), key
            else:
                assert ea[key] == eb[key], key


@pytest.mark.parametrize("with_checkpoint_binding", [False, True], ids=["plain", "cp-binding"])
@pytest.mark.parametrize("mode", ["solo", "flat"])
def test_scoped_checkpoint_round_trips_into_an_equal_scope(
    mode: str, with_checkpoint_binding: bool
) -> None:
    source = _trained(mode)
    sd = _roundtrip(source.opt.state_dict())
    target = make(mode, codebook_refresh_every=2, seed=9)  # another binding object, equal scope
    target.finalize()
    assert target.binding is not source.binding
    for fqn in ORDER:
        with torch.no_grad():
            target.targets[fqn].copy_(source.targets[fqn])
    kwargs = {}
    if with_checkpoint_binding:
        kwargs["checkpoint_binding"] = CheckpointProcessGroupBinding(SOLO, ME, None, "cpu")
    target.opt.load_state_dict(sd, **kwargs)
    _state_equal(source.opt, target.opt)
    assert target.opt.finalized is not None
    assert target.opt.finalized.binding is target.binding
    assert target.opt.param_groups[0]["param_names"] == list(GROUPS[0])
    # Both continue identically (the refresh every 2 steps included).
    for seed in (20, 21):
        fill_grads([source.targets[f] for f in ORDER], seed)
        fill_grads([target.targets[f] for f in ORDER], seed)
        source.opt.step()
        target.opt.step()
    _state_equal(source.opt, target.opt)
    for fqn in ORDER:
        assert torch.equal(source.targets[fqn], target.targets[fqn])


def _scoped_sd() -> dict[str, Any]:
    return _trained("solo").opt.state_dict()


def _unscoped_sd() -> dict[str, Any]:
    return _trained("solo-unbound").opt.state_dict()


MISMATCHES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[], Setup]]] = {
    "scoped-into-unscoped": (_scoped_sd, lambda: make("solo-unbound", codebook_refresh_every=2)),
    "scoped-into-ungrouped": (_scoped_sd, lambda: make("ungrouped", codebook_refresh_every=2)),
    "unscoped-into-scoped": (_unscoped_sd, lambda: make("solo", codebook_refresh_every=2)),
    "other-identity": (
        _scoped_sd,
        lambda: make("solo", identity=OTHER, codebook_refresh_every=2),
    ),
    "other-refresh-every": (_scoped_sd, lambda: make("solo", codebook_refresh_every=3)),
    "refresh-off": (_scoped_sd, lambda: make("solo", codebook_refresh_every=0)),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_scope_mismatch_is_rejected_without_change(case: str) -> None:
    build_sd, build_target = MISMATCHES[case]
    sd = build_sd()
    target = build_target()
    target.finalize()
    trains(target.opt, seed=30)
    saved = copy.deepcopy(sd)
    rejects(target.opt, lambda: target.opt.load_state_dict(sd), ValueError, SCOPE)
    assert sd["gefen"].keys() == saved["gefen"].keys()  # the caller's dict is untouched
    trains(target.opt, seed=31)


def test_scoped_checkpoint_into_a_pristine_unfinalized_optimizer_is_rejected() -> None:
    sd = _scoped_sd()
    fresh = make("solo", codebook_refresh_every=2)
    rejects(fresh.opt, lambda: fresh.opt.load_state_dict(sd), ValueError, SCOPE)
    # post_sharding is still possible afterwards, then the load succeeds.
    fresh.finalize()
    fresh.opt.load_state_dict(sd)
    assert fresh.opt.global_step == 3


def test_tampered_scope_in_every_copy_is_rejected() -> None:
    setup = _trained("solo")
    sd = setup.opt.state_dict()
    for extras in (sd["gefen"], *(g["gefen"] for g in sd["param_groups"])):
        extras["scope"]["refresh_every"] = 7
    rejects(setup.opt, lambda: setup.opt.load_state_dict(sd), ValueError, SCOPE)
    trains(setup.opt)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: CheckpointProcessGroupBinding(OTHER, ME, None, "cpu"), id="identity"),
        pytest.param(lambda: CheckpointProcessGroupBinding(SOLO, ME, None, "cuda:0"), id="device"),
    ],
)
def test_checkpoint_binding_with_other_fields_is_a_binding_error(
    other: Callable[[], CheckpointProcessGroupBinding],
) -> None:
    setup = _trained("solo")
    sd = copy.deepcopy(setup.opt.state_dict())  # kept across a step: a copy (docs/core.md §8.1)
    trains(setup.opt, seed=40)
    rejects(
        setup.opt,
        lambda: setup.opt.load_state_dict(sd, checkpoint_binding=other()),
        BindingError,
        "checkpoint_binding does not match the installed codebook binding",
    )
    same = CheckpointProcessGroupBinding(SOLO, ME, None, "cpu")
    setup.opt.load_state_dict(sd, checkpoint_binding=same)
    assert setup.opt.global_step == 3
    trains(setup.opt)


@pytest.mark.parametrize("mode", ["ungrouped", "solo-unbound", "pristine"])
def test_checkpoint_binding_without_an_installed_binding_is_a_binding_error(mode: str) -> None:
    setup = make("ungrouped" if mode == "pristine" else mode)
    if mode != "pristine":
        setup.finalize()
    trains(setup.opt)
    sd = copy.deepcopy(setup.opt.state_dict())  # kept across a step: a copy (docs/core.md §8.1)
    trains(setup.opt, seed=41)
    rejects(
        setup.opt,
        lambda: setup.opt.load_state_dict(
            sd, checkpoint_binding=CheckpointProcessGroupBinding(SOLO, ME, None, "cpu")
        ),
        BindingError,
        "no codebook binding is installed",
    )
    setup.opt.load_state_dict(sd)
    trains(setup.opt)


def test_checkpoint_binding_must_be_a_checkpoint_binding() -> None:
    setup = _trained("solo")
    sd = setup.opt.state_dict()
    rejects(
        setup.opt,
        lambda: setup.opt.load_state_dict(sd, checkpoint_binding=setup.binding),
        TypeError,
        "checkpoint_binding must be a CheckpointProcessGroupBinding",
    )
    trains(setup.opt)


def test_state_dict_checks_a_checkpoint_binding_by_the_load_rules() -> None:
    """``state_dict(checkpoint_binding=)`` refuses what ``load_state_dict`` refuses, in the
    same voted preflight as the state it saves (docs/core.md §8.1)."""
    setup = _trained("solo")
    plain = setup.opt.state_dict()
    for wrong, error, rule in (
        (setup.binding, TypeError, "checkpoint_binding must be a CheckpointProcessGroupBinding"),
        (
            CheckpointProcessGroupBinding(OTHER, ME, None, "cpu"),
            BindingError,
            "checkpoint_binding does not match the installed codebook binding",
        ),
    ):
        rejects(setup.opt, lambda b=wrong: setup.opt.state_dict(checkpoint_binding=b), error, rule)
    same = CheckpointProcessGroupBinding(SOLO, ME, None, "cpu")
    saved = setup.opt.state_dict(checkpoint_binding=same)
    assert saved["gefen"]["global_step"] == plain["gefen"]["global_step"] == 3
    assert torch.equal(saved["gefen"]["codebook"], plain["gefen"]["codebook"])
    trains(setup.opt)


# -- DTensor targets -----------------------------------------------------------------------------


@pytest.fixture
def one_rank_mesh() -> Any:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is unavailable")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    try:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as exc:  # pragma: no cover - environment dependent
        pytest.skip(f"cannot initialize a one-rank gloo group: {exc}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_target_is_rejected(one_rank_mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    setup = make("ungrouped")
    local = torch.zeros(4, 8)
    target = torch.nn.Parameter(DTensor.from_local(local, one_rank_mesh, [Replicate()]))
    rebindings = _swap(setup, "head.weight", new=target)
    rejects(
        setup.opt,
        lambda: setup.opt.post_sharding(rebindings, manifest=setup.manifest),
        ValueError,
        "post_sharding: head.weight: the target must be a plain tensor (not a DTensor)",
    )
    setup.finalize()
    trains(setup.opt)


def test_the_contract_describes_the_installed_layouts_state_and_checkpoints() -> None:
    # It listed the flattened layout for training only: its variants and its checkpoints'
    # layouts left it out, so the optimizer's own state_dict failed its own contract.
    from gefen.contracts import CheckpointTransport
    from gefen.contracts.conformance import check_provider, check_state_dict

    setup = make("flat")
    setup.finalize()
    for seed in range(2):
        fill_grads(setup.live(), seed)
        setup.opt.step()
    contract = check_provider(setup.opt)
    flat = ParameterLayout.FLATTENED_ELEMENT_SHARD
    live = setup.live()
    layouts = {
        i: flat if fqn == "layer.weight" else ParameterLayout.REPLICATED
        for i, fqn in enumerate(ORDER)
    }
    ndims = {i: p.dim() for i, p in enumerate(live)}
    matched = check_state_dict(
        contract, setup.opt.state_dict(), ndims=ndims, parameter_layouts=layouts
    )
    assert matched[ORDER.index("layer.weight")] == ("q8_block_local",)
    for entry in contract.capabilities.checkpoints:
        if entry.transport is not CheckpointTransport.PYTORCH_RANK_LOCAL:
            assert flat in entry.same_topology
