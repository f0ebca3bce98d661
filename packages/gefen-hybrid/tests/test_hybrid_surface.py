"""GefenMuonHybrid's torch-facing surface in one process (docs/hybrid.md §4, §5, §9, §10).

``param_groups``, ``defaults``, the read-only ``state`` view, LR and momentum schedulers,
``deepcopy``, hooks, ``zero_grad``, the AMP-scaling property, the repr, AdamW parity and the
composite contract. Every rejection proves that neither child changed (a deep snapshot of both)
and that the hybrid still trains afterwards.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, ReduceLROnPlateau, StepLR
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from gefen.contracts import (
    CheckpointTransport,
    ConformanceError,
    OptimizerContract,
    ParameterLayout,
    ProcessGroupScope,
    StateGeometry,
    StateScope,
)
from gefen.contracts.conformance import check_provider, check_state_dict
from gefen.core.testing import weights_only_round_trip as _round_trip
from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.flat_layout import split
from gefen.hybrid.testing import OneHiddenLM as TinyLM
from gefen.hybrid.testing import assert_same_hybrid, hybrid_snapshot

READ_ONLY = (
    "GefenMuonHybrid.state is read-only for parameters; modify a child's state through "
    "hybrid.muon or hybrid.backup (keys that are not tensors may be set and deleted)"
)
NOT_OWNED = (
    "not owned by GefenMuonHybrid; parameters swapped in after construction (e.g. DeepSpeed ZeRO "
    "flat partitions) are not supported"
)
NO_ASSIGNMENT = (
    "GefenMuonHybrid.param_groups cannot be assigned; wrappers that replace param_groups (e.g. "
    "DeepSpeed ZeRO) are not supported"
)
FAST = {"fused": False, "ns_steps": 1}
BACKENDS = ["gefen", "adamw"]
ADAMW_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD})

# --------------------------------------------------------------------------------------------
# Model and helpers


def _tiny(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _hybrid(
    backend: str = "gefen", *, seed: int = 0, **kwargs: Any
) -> tuple[TinyLM, GefenMuonHybrid]:
    model = _tiny(seed)
    options = {**FAST, "lr": 1e-2, "backup_optimizer": backend, **kwargs}
    return model, GefenMuonHybrid(model, **options)


def _params(hybrid: GefenMuonHybrid) -> list[torch.Tensor]:
    return [p for group in hybrid.param_groups for p in group["params"]]


def _set_grads(params: list[torch.Tensor], seed: int) -> None:
    for index, p in enumerate(params):
        generator = torch.Generator().manual_seed(seed + index)
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)


def _trains(hybrid: GefenMuonHybrid, seed: int = 123) -> None:
    """A normal step moves every non-empty parameter and leaves everything finite."""
    params = _params(hybrid)
    _set_grads(params, seed)
    before = [p.detach().clone() for p in params]
    hybrid.step()
    for b, p in zip(before, params, strict=True):
        assert bool(torch.isfinite(p).all())
        if p.numel():
            assert not torch.equal(b, p.detach())


def _stepped(hybrid: GefenMuonHybrid, steps: int = 1, seed: int = 50) -> None:
    for step in range(steps):
        _set_grads(_params(hybrid), seed + 10 * step)
        hybrid.step()


def _snapshot(hybrid: GefenMuonHybrid) -> dict[str, Any]:
    return {**hybrid_snapshot(hybrid), "dict": dict(hybrid.__dict__)}


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert_same_hybrid(before, after)
    assert before["dict"].keys() == after["dict"].keys()
    assert all(before["dict"][key] is after["dict"][key] for key in before["dict"])


def _rejects(
    hybrid: GefenMuonHybrid,
    action: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    *,
    restore: Callable[[], Any] | None = None,
) -> pytest.ExceptionInfo[Any]:
    """``action`` raises, changes neither child, and the hybrid still trains afterwards."""
    before = _snapshot(hybrid)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        action()
    _assert_same(before, _snapshot(hybrid))
    if restore is not None:
        restore()
    _trains(hybrid)
    return info


def _entries_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Class, repr


def test_is_a_torch_optimizer_with_six_hook_registries() -> None:
    _, hybrid = _hybrid()
    assert isinstance(hybrid, torch.optim.Optimizer)
    for name in (
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    ):
        registry = hybrid.__dict__[name]
        assert type(registry).__name__ == "OrderedDict"
        assert len(registry) == 0
    assert GefenMuonHybrid.step.hooked is True  # type: ignore[attr-defined]

    class Sub(GefenMuonHybrid):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    assert Sub.step.hooked is True  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (
            lambda: _hybrid("adamw")[1],
            "GefenMuonHybrid(muon_params=1, backup_params=5, backup_optimizer='adamw')",
        ),
        (
            lambda: _hybrid("gefen", no_decay_substrings=("bias", "norm"))[1],
            "GefenMuonHybrid(muon_params=1, backup_params=5, backup_optimizer='gefen')",
        ),
        (
            lambda: GefenMuonHybrid(
                [("a", nn.Parameter(torch.ones(2, 2))), ("b", nn.Parameter(torch.ones(3, 2)))],
                [],
                lr=1e-2,
                backup_optimizer="adamw",
            ),
            "GefenMuonHybrid(muon_params=2, backup_params=0, backup_optimizer='adamw')",
        ),
        (
            lambda: GefenMuonHybrid([], [("c", nn.Parameter(torch.ones(3)))], lr=1e-2),
            "GefenMuonHybrid(muon_params=0, backup_params=1, backup_optimizer='gefen')",
        ),
    ],
    ids=["adamw", "gefen-two-groups", "muon-only", "backup-only"],
)
def test_repr(build: Callable[[], GefenMuonHybrid], expected: str) -> None:
    hybrid = build()
    assert repr(hybrid) == expected
    text = repr(_hybrid("adamw")[1])
    for fragment in ("muon_params=1", "backup_params=5", "backup_optimizer='adamw'"):
        assert fragment in text


# --------------------------------------------------------------------------------------------
# AdamW parity (§4)


@pytest.mark.parametrize("with_muon", [False, True], ids=["muon-free", "with-muon"])
@pytest.mark.parametrize(
    "adamw_kwargs",
    [None, {"foreach": False}, {"amsgrad": True}],
    ids=["default", "no-foreach", "amsgrad"],
)
def test_adamw_backup_with_named_groups_is_bit_identical_to_adamw(
    with_muon: bool, adamw_kwargs: dict[str, Any] | None
) -> None:
    def tensors() -> dict[str, nn.Parameter]:
        generator = torch.Generator().manual_seed(5)
        shapes = {
            "embed.weight": (12, 6),
            "block.bias": (6,),
            "norm.weight": (6,),
            "lm_head.weight": (12, 6),
            "conv.weight": (2, 3, 3),
        }
        return {
            name: nn.Parameter(torch.randn(shape, generator=generator))
            for name, shape in shapes.items()
        }

    ours, theirs = tensors(), tensors()
    muon = [("hidden.weight", nn.Parameter(torch.randn(6, 6)))] if with_muon else []
    options = {"lr": 3e-3, "betas": (0.85, 0.98), "eps": 1e-7}
    hybrid = GefenMuonHybrid(
        muon,
        list(ours.items()),
        weight_decay=0.1,
        backup_optimizer="adamw",
        no_decay_substrings=("bias", "norm"),
        backup_adamw_kwargs=adamw_kwargs,
        **options,
        **FAST,
    )
    decay = [(name, theirs[name]) for name in ("embed.weight", "lm_head.weight", "conv.weight")]
    no_decay = [(name, theirs[name]) for name in ("block.bias", "norm.weight")]
    reference = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        weight_decay=0.1,
        **options,
        **(adamw_kwargs or {}),
    )
    assert hybrid.backup is not None
    assert [g["param_names"] for g in hybrid.backup.param_groups] == [
        g["param_names"] for g in reference.param_groups
    ]
    for step in range(4):
        for index, name in enumerate(ours):
            generator = torch.Generator().manual_seed(100 * step + index)
            grad = torch.randn(ours[name].shape, generator=generator)
            ours[name].grad, theirs[name].grad = grad.clone(), grad.clone()
        if with_muon:
            muon[0][1].grad = torch.randn(6, 6)
        hybrid.step()
        reference.step()
        for name in ours:
            assert torch.equal(ours[name].detach(), theirs[name].detach()), (step, name)
            assert _entries_equal(hybrid.backup.state[ours[name]], reference.state[theirs[name]])
    expected = reference.state_dict()
    actual = split(hybrid, hybrid.state_dict())["backup"]
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for key in expected["state"]:
        assert _entries_equal(actual["state"][key], expected["state"][key])


# --------------------------------------------------------------------------------------------
# param_groups (§5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_param_groups_are_the_childrens_live_groups(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    groups = hybrid.param_groups
    assert type(groups) is list
    assert len(groups) == 2  # one per half, never one per parameter
    assert groups[0] is hybrid.muon.param_groups[0]
    assert groups[1] is hybrid.backup.param_groups[0]
    again = hybrid.param_groups
    assert again is not groups
    assert all(a is b for a, b in zip(again, groups, strict=True))
    # The returned list is the caller's: changing it changes nothing of the hybrid.
    groups.append({"params": []})
    groups.reverse()
    groups.clear()
    assert len(hybrid.param_groups) == 2
    assert len(hybrid.muon.param_groups) == 1
    assert len(hybrid.backup.param_groups) == 1
    _, split = _hybrid(backend, no_decay_substrings=("bias", "norm"))
    assert split.muon is not None
    assert split.backup is not None
    assert [id(g) for g in split.param_groups] == [
        id(g) for g in (*split.muon.param_groups, *split.backup.param_groups)
    ]
    assert len(split.param_groups) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_group_edits_reach_the_children(backend: str) -> None:
    model, hybrid = _hybrid(backend)
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    hybrid.param_groups[0]["lr"] = 0.0
    hybrid.param_groups[1]["weight_decay"] = 0.25
    assert hybrid.muon.param_groups[0]["lr"] == 0.0
    assert hybrid.backup.param_groups[0]["weight_decay"] == 0.25
    # A zero Muon lr freezes the Muon matrix while the backup still learns.
    hidden = model.hidden.weight.detach().clone()
    embed = model.embed.weight.detach().clone()
    _stepped(hybrid)
    assert torch.equal(model.hidden.weight.detach(), hidden)
    assert not torch.equal(model.embed.weight.detach(), embed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_param_groups_cannot_be_assigned(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    _stepped(hybrid)
    live = hybrid.param_groups

    def assign(value: Any) -> Callable[[], None]:
        def action() -> None:
            hybrid.param_groups = value  # type: ignore[misc]

        return action

    _rejects(hybrid, assign([]), TypeError, NO_ASSIGNMENT)
    _rejects(hybrid, assign(live), TypeError, NO_ASSIGNMENT)
    _rejects(hybrid, lambda: setattr(hybrid, "param_groups", [live[0]]), TypeError, NO_ASSIGNMENT)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("gamma", "expected"), [(0.1, (1e-4, 2.5e-5)), (0.5, (5e-4, 1.25e-4))], ids=["0.1", "0.5"]
)
def test_step_lr_scales_both_halves_and_keeps_the_ratio(
    backend: str, gamma: float, expected: tuple[float, float]
) -> None:
    _, hybrid = _hybrid(backend, lr=1e-3, backup_lr=2.5e-4)
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    scheduler = StepLR(hybrid, step_size=1, gamma=gamma)
    assert hybrid.muon.param_groups[0]["initial_lr"] == 1e-3
    assert hybrid.backup.param_groups[0]["initial_lr"] == 2.5e-4
    _stepped(hybrid)
    scheduler.step()
    muon_lr = hybrid.muon.param_groups[0]["lr"]
    backup_lr = hybrid.backup.param_groups[0]["lr"]
    assert muon_lr == pytest.approx(expected[0], rel=1e-12)
    assert backup_lr == pytest.approx(expected[1], rel=1e-12)
    assert muon_lr / backup_lr == pytest.approx(4.0, rel=1e-12)
    assert scheduler.get_last_lr() == pytest.approx(list(expected), rel=1e-12)
    _stepped(hybrid, seed=70)
    scheduler.step()
    assert hybrid.muon.param_groups[0]["lr"] == pytest.approx(expected[0] * gamma, rel=1e-12)
    assert hybrid.backup.param_groups[0]["lr"] == pytest.approx(expected[1] * gamma, rel=1e-12)
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_lr_is_scheduled_per_group_as_torchs_one_group_would_be(backend: str) -> None:
    # One tensor lr reached every group the hybrid split it into, and torch's schedulers write
    # each group's rate in place: ReduceLROnPlateau reduced it once per group, and per-group
    # lambdas all ended at the last group's rate.
    _, plateau = _hybrid(backend, lr=torch.tensor(0.01), no_decay_substrings=("bias",))
    assert len(plateau.param_groups) == 3
    reduce = ReduceLROnPlateau(plateau, factor=0.1, patience=0)
    for seed in range(3):
        _stepped(plateau, seed=seed)
        reduce.step(1.0)  # the loss never improves: one reduction a step after the first
    for group in plateau.param_groups:
        assert isinstance(group["lr"], torch.Tensor)
        assert float(group["lr"]) == pytest.approx(1e-4, rel=1e-5)
    lr = torch.tensor(0.01)
    _, hybrid = _hybrid(backend, lr=lr)
    scheduler = LambdaLR(hybrid, [lambda epoch: 1.0, lambda epoch: 0.5])
    _stepped(hybrid)
    scheduler.step()
    assert [float(g["lr"]) for g in hybrid.param_groups] == pytest.approx([0.01, 0.005])
    extra = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]
    hybrid.add_param_group({"params": extra, "param_names": ["extra.weight", "extra.bias"]})
    held = [g["lr"] for g in hybrid.param_groups]
    assert len({id(value) for value in held}) == len(held) == 4
    assert float(lr) == pytest.approx(0.01)  # the caller's tensor took no group's write
    _trains(hybrid)


# --------------------------------------------------------------------------------------------
# defaults (§5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_defaults_are_the_muon_childs_else_the_backups(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    assert hybrid.muon is not None
    assert hybrid.defaults is hybrid.muon.defaults
    assert "momentum" in hybrid.defaults
    assert "betas" not in hybrid.defaults
    backup_only = GefenMuonHybrid(
        [], [("c", nn.Parameter(torch.ones(3)))], lr=1e-2, backup_optimizer=backend, fused=False
    )
    assert backup_only.backup is not None
    assert backup_only.defaults is backup_only.backup.defaults
    assert "betas" in backup_only.defaults
    muon_only = GefenMuonHybrid([("w", nn.Parameter(torch.ones(3, 3)))], [], lr=1e-2, **FAST)
    assert muon_only.muon is not None
    assert muon_only.defaults is muon_only.muon.defaults


# --------------------------------------------------------------------------------------------
# state (§5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_reads_route_to_the_owning_child(backend: str) -> None:
    model, hybrid = _hybrid(backend)
    _stepped(hybrid)
    muon, backup = hybrid.muon, hybrid.backup
    assert muon is not None
    assert backup is not None
    state = hybrid.state
    assert isinstance(state, Mapping)
    assert not isinstance(state, dict)
    hidden, embed = model.hidden.weight, model.embed.weight
    assert state[hidden] is muon.state[hidden]
    assert state[embed] is backup.state[embed]
    assert "step" in state[embed]
    assert hidden in state
    assert embed in state
    assert state.get(hidden) is muon.state[hidden]
    assert len(state) == len(muon.state) + len(backup.state) == 6
    assert list(state) == [*muon.state, *backup.state]
    assert list(state.keys()) == list(state)
    assert all(
        a is b
        for a, b in zip(state.values(), [*muon.state.values(), *backup.state.values()], strict=True)
    )
    items = list(state.items())
    assert all(state[key] is value for key, value in items)
    assert [key for key, _ in items] == list(state)
    # Mutating a routed entry reaches the child (the view is read-only, its values are live).
    marker = object()
    state[embed]["probe"] = marker
    assert backup.state[embed]["probe"] is marker
    del backup.state[embed]["probe"]


def test_in_and_get_never_create_entries_but_a_read_returns_the_childs_entry() -> None:
    model, hybrid = _hybrid("adamw")
    backup = hybrid.backup
    assert backup is not None
    embed = model.embed.weight
    assert len(backup.state) == 0
    before = _snapshot(hybrid)
    assert embed not in hybrid.state
    assert hybrid.state.get(embed) is None
    assert hybrid.state.get(embed, "fallback") == "fallback"
    assert len(backup.state) == 0
    _assert_same(before, _snapshot(hybrid))
    # A read behaves as the child's defaultdict does: it returns (and creates) its entry.
    entry = hybrid.state[embed]
    assert entry == {}
    assert backup.state[embed] is entry
    _trains(hybrid)
    assert "exp_avg" in hybrid.state[embed]


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_unknown_keys_raise_key_error(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    _stepped(hybrid)
    stranger = nn.Parameter(torch.zeros(8, 8))
    for key in (stranger, torch.zeros(8), "hidden.weight", 0, None):
        before = _snapshot(hybrid)
        with pytest.raises(KeyError, match=re.escape(NOT_OWNED)):
            hybrid.state[key]  # type: ignore[index]
        assert key not in hybrid.state
        assert hybrid.state.get(key, "absent") == "absent"  # type: ignore[arg-type]
        _assert_same(before, _snapshot(hybrid))
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_unknown_key_after_a_zero_style_group_swap(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    _stepped(hybrid)
    backup = hybrid.backup
    assert backup is not None
    params = backup.param_groups[0]["params"]
    original = params[0]
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    params[0] = flat
    assert any(p is flat for group in hybrid.param_groups for p in group["params"])

    def restore() -> None:
        params[0] = original

    _rejects(hybrid, lambda: hybrid.state[flat], KeyError, NOT_OWNED, restore=restore)
    params[0] = flat
    assert flat not in hybrid.state
    assert hybrid.state.get(flat) is None
    # The swapped-out original is still owned and routes as before.
    assert hybrid.state[original] is backup.state[original]
    restore()


def _writes(hybrid: GefenMuonHybrid, key: Any) -> dict[str, Callable[[], Any]]:
    state: Any = hybrid.state
    return {
        "setitem": lambda: state.__setitem__(key, {}),
        "delitem": lambda: state.__delitem__(key),
        "setdefault": lambda: state.setdefault(key, {}),
        "update": lambda: state.update({key: {}}),
        "update-kwargs": lambda: state.update(x=1),
        "pop": lambda: state.pop(key),
        "pop-default": lambda: state.pop(key, None),
        "popitem": lambda: state.popitem(),
        "clear": lambda: state.clear(),
    }


WRITES = [
    "setitem",
    "delitem",
    "setdefault",
    "update",
    "update-kwargs",
    "pop",
    "pop-default",
    "popitem",
    "clear",
]


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("owner", ["muon", "backup", "stranger"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_state_write_is_type_error_and_changes_nothing(
    backend: str, owner: str, write: str
) -> None:
    model, hybrid = _hybrid(backend)
    _stepped(hybrid)
    key = {
        "muon": model.hidden.weight,
        "backup": model.norm.bias,
        "stranger": nn.Parameter(torch.zeros(2)),
    }[owner]
    _rejects(hybrid, _writes(hybrid, key)[write], TypeError, READ_ONLY)
    # The syntactic forms too.
    state: Any = hybrid.state
    before = _snapshot(hybrid)
    with pytest.raises(TypeError, match=re.escape(READ_ONLY)):
        state[key] = {}
    with pytest.raises(TypeError, match=re.escape(READ_ONLY)):
        del state[key]
    _assert_same(before, _snapshot(hybrid))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_user_key_lives_in_the_first_child_and_round_trips(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    _stepped(hybrid)
    state: Any = hybrid.state
    state["note"] = {"phase": 2}
    assert "note" in state
    assert state["note"] == {"phase": 2}
    assert state.get("note") == {"phase": 2}
    assert hybrid.children[0].state["note"] == {"phase": 2}
    saved = hybrid.state_dict()
    assert saved["state"]["note"] == {"phase": 2}
    del state["note"]
    assert "note" not in state
    assert state.get("note", "gone") == "gone"
    hybrid.load_state_dict(saved)
    assert state["note"] == {"phase": 2}
    _stepped(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_user_key_round_trips_when_the_backup_is_the_only_child(backend: str) -> None:
    # With an AdamW backup and no Muon child, the hybrid refused its own checkpoint: "state
    # holds entries for parameter ids no group lists: ['epoch']".
    norm = nn.LayerNorm(4)
    hybrid = GefenMuonHybrid(norm, lr=1e-2, backup_optimizer=backend, **FAST)
    hybrid.state["epoch"] = 3
    _stepped(hybrid)
    saved = hybrid.state_dict()
    twin = GefenMuonHybrid(nn.LayerNorm(4), lr=1e-2, backup_optimizer=backend, **FAST)
    twin.load_state_dict(saved)
    assert twin.state["epoch"] == 3
    _stepped(twin)


# --------------------------------------------------------------------------------------------
# Momentum-cycling schedulers (§5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_cycle_cycles_muon_momentum_and_the_backups_beta1_and_round_trips(
    backend: str,
) -> None:
    """As torch's Muon and AdamW under one scheduler each: the scheduler writes ``momentum``
    into every group (the hybrid's defaults are Muon's); the backup reads it as beta1."""
    model, hybrid = _hybrid(backend, betas=(0.9, 0.99))
    muon, backup = hybrid.muon, hybrid.backup
    assert muon is not None
    assert backup is not None
    scheduler = OneCycleLR(
        hybrid,
        max_lr=1e-2,
        total_steps=8,
        cycle_momentum=True,
        base_momentum=0.8,
        max_momentum=0.95,
    )
    momenta = [muon.param_groups[0]["momentum"]]
    for step in range(4):
        params = _params(hybrid)
        before = [p.detach().clone() for p in params]
        _set_grads(params, 300 + 10 * step)
        hybrid.step()
        scheduler.step()
        assert all(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))
        assert all(bool(torch.isfinite(p).all()) for p in params)
        momenta.append(muon.param_groups[0]["momentum"])
        # The step just taken used the momentum the scheduler wrote before it, as beta1.
        assert backup.param_groups[0]["betas"] == (momenta[-2], 0.99)
    assert momenta[0] == pytest.approx(0.95)
    # It cycles: down towards base_momentum while the lr warms up, then back up.
    low = momenta.index(min(momenta))
    assert min(momenta) < 0.85
    assert 0 < low < len(momenta) - 1
    assert momenta[-1] > momenta[low]
    assert "momentum" in backup.param_groups[0]
    # The checkpoint round-trips, groups' unknown keys included, and resumes identically.
    saved = _round_trip(hybrid.state_dict())
    twin_model = _tiny(99)
    twin_model.load_state_dict(model.state_dict())
    twin = GefenMuonHybrid(twin_model, lr=1e-2, backup_optimizer=backend, betas=(0.9, 0.99), **FAST)
    twin.load_state_dict(saved)
    assert twin.muon is not None
    assert twin.backup is not None
    assert twin.muon.param_groups[0]["momentum"] == muon.param_groups[0]["momentum"]
    assert twin.backup.param_groups[0]["momentum"] == backup.param_groups[0]["momentum"]
    assert twin.backup.param_groups[0]["betas"] == backup.param_groups[0]["betas"]
    for ours, theirs in zip(hybrid.param_groups, twin.param_groups, strict=True):
        assert {k: v for k, v in ours.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"
        }
    _set_grads(_params(hybrid), 900)
    _set_grads(_params(twin), 900)
    hybrid.step()
    twin.step()
    for ours, theirs in zip(_params(hybrid), _params(twin), strict=True):
        assert torch.equal(ours.detach(), theirs.detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_beta1_set_by_hand_after_the_schedulers_last_write_is_kept(backend: str) -> None:
    # It was overwritten from ``momentum`` at every later step (torch's AdamW keeps it).
    _, hybrid = _hybrid(backend, betas=(0.9, 0.99))
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    scheduler = OneCycleLR(hybrid, max_lr=1e-2, total_steps=3)
    for step in range(3):
        _stepped(hybrid, seed=400 + 10 * step)
        scheduler.step()
    group["betas"] = (0.5, 0.99)  # a second phase, by hand
    for step in range(2):
        _stepped(hybrid, seed=500 + 10 * step)
        assert group["betas"] == (0.5, 0.99)
    for muon_group in hybrid.param_groups:
        muon_group["momentum"] = 0.7  # a scheduler's write again: followed
    _stepped(hybrid, seed=600)
    assert group["betas"] == (0.7, 0.99)


def test_the_adamw_backup_under_the_hybrids_scheduler_matches_adamw_under_its_own() -> None:
    """torch.optim.AdamW with its own OneCycleLR is the reference: the hybrid's AdamW backup,
    driven by one OneCycleLR over the whole hybrid, takes the same beta1 at every step and the
    same parameters."""
    _, hybrid = _hybrid("adamw", betas=(0.9, 0.99))
    assert hybrid.backup is not None
    backup_params = list(hybrid.backup.param_groups[0]["params"])
    twins = [nn.Parameter(p.detach().clone()) for p in backup_params]
    reference = torch.optim.AdamW(twins, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    options = {"max_lr": 1e-2, "total_steps": 8, "base_momentum": 0.8, "max_momentum": 0.95}
    scheduler = OneCycleLR(hybrid, cycle_momentum=True, **options)
    reference_scheduler = OneCycleLR(reference, cycle_momentum=True, **options)
    for step in range(5):
        _set_grads(_params(hybrid), 40 + 10 * step)
        for mine, twin in zip(backup_params, twins, strict=True):
            twin.grad = mine.grad.clone()
        hybrid.step()
        reference.step()
        assert hybrid.backup.param_groups[0]["betas"] == reference.param_groups[0]["betas"]
        for mine, twin in zip(backup_params, twins, strict=True):
            assert torch.equal(mine, twin)
        scheduler.step()
        reference_scheduler.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backup_momentum_no_beta1_may_take_is_refused_before_anything_changes(
    backend: str,
) -> None:
    _, hybrid = _hybrid(backend)
    _stepped(hybrid)
    assert hybrid.backup is not None
    hybrid.backup.param_groups[0]["momentum"] = 1.0
    _set_grads(_params(hybrid), 77)
    before = _snapshot(hybrid)
    with pytest.raises(ValueError, match=re.escape("'momentum' is read as beta1")):
        hybrid.step()
    _assert_same(before, _snapshot(hybrid))
    hybrid.backup.param_groups[0]["momentum"] = 0.85
    _trains(hybrid)
    assert hybrid.backup.param_groups[0]["betas"][0] == 0.85


def test_one_cycle_on_a_backup_only_gefen_hybrid_cycles_beta1() -> None:
    hybrid = GefenMuonHybrid(
        [], [("c", nn.Parameter(torch.ones(4)))], lr=1e-2, betas=(0.9, 0.99), fused=False
    )
    assert hybrid.backup is not None
    scheduler = OneCycleLR(hybrid, max_lr=1e-2, total_steps=6, base_momentum=0.8, max_momentum=0.95)
    beta1 = [hybrid.backup.param_groups[0]["betas"][0]]
    for step in range(3):
        _stepped(hybrid, seed=20 * step)
        scheduler.step()
        beta1.append(hybrid.backup.param_groups[0]["betas"][0])
        assert hybrid.backup.param_groups[0]["betas"][1] == 0.99
    assert beta1[0] == pytest.approx(0.95)
    assert min(beta1) < 0.9


# --------------------------------------------------------------------------------------------
# deepcopy (§5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepcopy_rebuilds_the_registry_and_steps_identically(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    _stepped(hybrid, steps=2)
    clone = copy.deepcopy(hybrid)
    assert clone.muon is not None
    assert clone.backup is not None
    assert clone.muon is not hybrid.muon
    assert clone.backup is not hybrid.backup
    assert clone._registry is not hybrid._registry
    ours, theirs = _params(hybrid), _params(clone)
    assert all(a is not b for a, b in zip(ours, theirs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # copy.state routes to the copy's children, and only the copy's parameters are its keys.
    hidden = clone.muon.param_groups[0]["params"][0]
    embed = clone.backup.param_groups[0]["params"][0]
    assert clone.state[hidden] is clone.muon.state[hidden]
    assert clone.state[embed] is clone.backup.state[embed]
    assert len(clone.state) == len(hybrid.state)
    with pytest.raises(KeyError, match=re.escape(NOT_OWNED)):
        clone.state[ours[0]]
    with pytest.raises(KeyError, match=re.escape(NOT_OWNED)):
        hybrid.state[theirs[0]]
    for step in range(3):
        _set_grads(ours, 700 + 10 * step)
        _set_grads(theirs, 700 + 10 * step)
        hybrid.step()
        clone.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for a, b in zip(ours, theirs, strict=True):
        assert _entries_equal(hybrid.state[a], clone.state[b])
    assert repr(clone) == repr(hybrid)


@pytest.mark.parametrize("scheduler", [False, True], ids=["plain", "with-scheduler"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_deepcopy_hooks_fire_once_and_the_copy_steps_only_itself(
    backend: str, scheduler: bool
) -> None:
    _, hybrid = _hybrid(backend)
    calls: list[tuple[str, object]] = []
    global_calls: list[object] = []
    hybrid.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt)))
    hybrid.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt)))
    if scheduler:
        StepLR(hybrid, step_size=1, gamma=0.5)
        assert "step" in hybrid.__dict__  # torch wrapped the instance's step
    clone = copy.deepcopy(hybrid)
    assert "step" not in clone.__dict__
    assert len(clone._optimizer_step_pre_hooks) == 1
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: global_calls.append(opt)),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: global_calls.append(opt)),
    ]
    try:
        originals, copies = _params(hybrid), _params(clone)
        copies_before = [p.detach().clone() for p in copies]
        _set_grads(originals, 10)
        _set_grads(copies, 10)
        hybrid.step()
        assert calls == [("pre", hybrid), ("post", hybrid)]
        assert all(torch.equal(b, p) for b, p in zip(copies_before, copies, strict=True))
        assert global_calls == [hybrid, hybrid]  # an AdamW child's step fires none
        originals_before = [p.detach().clone() for p in originals]
        calls.clear()
        global_calls.clear()
        clone.step()
        assert calls == [("pre", clone), ("post", clone)]
        assert all(torch.equal(b, p) for b, p in zip(originals_before, originals, strict=True))
        assert not all(torch.equal(b, p) for b, p in zip(copies_before, copies, strict=True))
        assert hybrid not in global_calls
        assert global_calls == [clone, clone]
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------------
# Hooks (§5) and load by keyword


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_hooks_fire_exactly_once_per_step(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    calls: list[str] = []
    global_calls: list[str] = []
    hybrid.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    hybrid.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: global_calls.append("pre")),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: global_calls.append("post")),
    ]
    try:
        for step in range(2):
            _stepped(hybrid, seed=step)
            assert calls == ["pre", "post"] * (step + 1)
        assert global_calls == ["pre", "post"] * 2
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_and_load_hooks_fire_once_each(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    _stepped(hybrid)
    assert hybrid.muon is not None
    calls: list[str] = []
    replacement: dict[str, Any] = {}

    def post(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("sd-post")
        replacement.clear()
        replacement.update(sd, marker="replaced")
        return replacement

    hybrid.register_state_dict_pre_hook(lambda opt: calls.append("sd-pre"))
    hybrid.register_state_dict_post_hook(post)
    hybrid.muon.register_state_dict_post_hook(lambda opt, sd: calls.append("muon-sd-post"))
    result = hybrid.state_dict()
    assert calls == ["sd-pre", "muon-sd-post", "sd-post"]
    assert result is replacement
    assert result["marker"] == "replaced"
    saved = {key: value for key, value in result.items() if key != "marker"}
    calls.clear()
    seen: list[Any] = []

    def load_pre(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("load-pre")
        seen.append(sd)
        return {**sd, "gefen_hybrid": {**sd["gefen_hybrid"], "backup_optimizer": backend}}

    hybrid.register_load_state_dict_pre_hook(load_pre)
    hybrid.register_load_state_dict_post_hook(lambda opt: calls.append("load-post"))
    # The pre-hook's replacement is what loads: the caller's dict has a foreign tag.
    untagged = {**saved, "gefen_hybrid": {**saved["gefen_hybrid"], "backup_optimizer": "sgd"}}
    hybrid.load_state_dict(untagged)
    assert calls == ["load-pre", "load-post"]
    assert seen[0] is not untagged
    assert untagged["gefen_hybrid"]["backup_optimizer"] == "sgd"
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_by_keyword(backend: str) -> None:
    model, hybrid = _hybrid(backend)
    _stepped(hybrid, steps=2)
    saved = _round_trip(hybrid.state_dict())
    twin_model = _tiny(3)
    twin_model.load_state_dict(model.state_dict())
    twin = GefenMuonHybrid(twin_model, lr=1e-2, backup_optimizer=backend, **FAST)
    twin.load_state_dict(state_dict=saved)
    for a, b in zip(_params(hybrid), _params(twin), strict=True):
        assert _entries_equal(hybrid.state[a], twin.state[b])


# --------------------------------------------------------------------------------------------
# zero_grad and AMP scaling (§5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_grad_is_forwarded_to_both_children(backend: str) -> None:
    _, hybrid = _hybrid(backend)
    params = _params(hybrid)
    _set_grads(params, 1)
    grads = [p.grad for p in params]
    hybrid.zero_grad(set_to_none=False)
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert all(not bool(p.grad.any()) for p in params)  # type: ignore[union-attr]
    hybrid.zero_grad()
    assert all(p.grad is None for p in params)
    calls: list[tuple[str, bool]] = []
    for role, child in (("muon", hybrid.muon), ("backup", hybrid.backup)):
        original = child.zero_grad  # type: ignore[union-attr]

        def spy(set_to_none: bool = True, role: str = role, original: Any = original) -> None:
            calls.append((role, set_to_none))
            original(set_to_none=set_to_none)

        child.zero_grad = spy  # type: ignore[union-attr, method-assign]
    hybrid.zero_grad(False)
    assert calls == [("muon", False), ("backup", False)]


def test_amp_scaling_property_in_one_process() -> None:
    assert isinstance(GefenMuonHybrid.__dict__["_step_supports_amp_scaling"], property)
    for dtype in (torch.float32, torch.bfloat16):
        model = _tiny().to(dtype)
        hybrid = GefenMuonHybrid(model, lr=1e-2, **FAST)
        assert hybrid._step_supports_amp_scaling is False
        _set_grads(_params(hybrid), 3)
        before = _snapshot(hybrid)
        assert hybrid._step_supports_amp_scaling is False
        _assert_same(before, _snapshot(hybrid))
    for half in ("muon", "backup"):
        matrix = nn.Parameter(torch.randn(4, 4, dtype=torch.float16 if half == "muon" else None))
        vector = nn.Parameter(torch.randn(4, dtype=torch.float16 if half == "backup" else None))
        hybrid = GefenMuonHybrid([("w", matrix)], [("b", vector)], lr=1e-2, **FAST)
        assert hybrid._step_supports_amp_scaling is False  # no gradient yet
        matrix.grad = torch.randn_like(matrix)
        vector.grad = torch.randn_like(vector)
        before = _snapshot(hybrid)
        assert hybrid._step_supports_amp_scaling is True
        _assert_same(before, _snapshot(hybrid))


# --------------------------------------------------------------------------------------------
# Contract (§9)


def _walk(value: object) -> Iterator[Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield value
        for item in dataclasses.fields(value):
            yield from _walk(getattr(value, item.name))
    elif isinstance(value, (tuple, list, frozenset, set)):
        for item in value:
            yield from _walk(item)


CONFIGURATIONS = {
    "gefen": lambda: _hybrid("gefen")[1],
    "adamw": lambda: _hybrid("adamw")[1],
    "muon-only": lambda: GefenMuonHybrid(
        [("w", nn.Parameter(torch.randn(4, 4)))], [], lr=1e-2, backup_optimizer="adamw", **FAST
    ),
    "backup-only-gefen": lambda: GefenMuonHybrid(
        [], [("b", nn.Parameter(torch.randn(4)))], lr=1e-2, fused=False
    ),
    "backup-only-adamw": lambda: GefenMuonHybrid(
        [], [("b", nn.Parameter(torch.randn(4)))], lr=1e-2, backup_optimizer="adamw"
    ),
}


def _checked_contract(hybrid: GefenMuonHybrid) -> OptimizerContract:
    before = _snapshot(hybrid)
    contract = check_provider(hybrid)
    again = hybrid.optimizer_contract()
    _assert_same(before, _snapshot(hybrid))
    assert again == contract
    return contract


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("config", list(CONFIGURATIONS))
def test_contract(config: str, stepped: bool) -> None:
    hybrid = CONFIGURATIONS[config]()
    if stepped:
        _stepped(hybrid)
    contract = _checked_contract(hybrid)
    assert contract.implementation == "gefen.hybrid.GefenMuonHybrid"
    layout = contract.state_layout
    assert layout.composite_namespaces == ()  # torch's flat layout, one index space
    extras = layout.fields[0]
    assert extras.name == "gefen_hybrid"
    assert extras.scope is StateScope.OPTIMIZER_COMMON
    assert extras.geometry is StateGeometry.OPAQUE
    assert extras.checkpointed is True
    assert all(field.scope is StateScope.PARAMETER for field in layout.fields[1:])
    roles = {variant.name.split("/")[0] for variant in layout.parameter_variants}
    assert roles == {
        role for role, child in (("muon", hybrid.muon), ("backup", hybrid.backup)) if child
    }
    # Children, in fixed order, absent ones omitted.
    expected_roles = [
        role for role, child in (("muon", hybrid.muon), ("backup", hybrid.backup)) if child
    ]
    assert [child.role for child in contract.children] == expected_roles
    if hybrid.muon is not None:
        muon = contract.child("muon")
        assert muon is not None
        assert muon.implementation == "gefen.muon.GefenMuon"
        assert muon.contract == hybrid.muon.optimizer_contract()
    else:
        assert contract.child("muon") is None
    backup_child = contract.child("backup")
    if hybrid.backup is None:
        assert backup_child is None
    elif hybrid.backup_optimizer == "adamw":
        assert backup_child is not None
        assert backup_child.implementation == "torch.optim.adamw.AdamW"
        assert backup_child.contract is None
    else:
        assert backup_child is not None
        assert backup_child.contract == hybrid.backup.optimizer_contract()  # type: ignore[union-attr]
    # One composite checkpoint entry: atomic for both backends, not collective in one process.
    checkpoints = contract.capabilities.checkpoints
    assert len(checkpoints) == 1
    entry = checkpoints[0]
    assert entry.transport is CheckpointTransport.COMPOSITE_NATIVE
    assert entry.atomic_load is True
    assert entry.requires_collective is False
    assert entry.process_group_scope is ProcessGroupScope.NONE
    same_topology = None
    training: list[Any] = []
    for child in contract.children:
        if child.contract is None:
            claim = ADAMW_LAYOUTS
            layouts = {t.layout for t in contract.capabilities.training}
            assert layouts >= ADAMW_LAYOUTS
        else:
            claim = frozenset().union(
                *(
                    c.same_topology
                    for c in child.contract.capabilities.checkpoints
                    if c.transport is CheckpointTransport.NATIVE_OPTIMIZER
                )
            )
            training += [t for t in child.contract.capabilities.training if t not in training]
        same_topology = claim if same_topology is None else same_topology & claim
    assert entry.same_topology == same_topology
    # Training is the ordered, de-duplicated union (Gefen children's entries keep their order).
    listed = list(contract.capabilities.training)
    assert len(listed) == len(set(listed))
    positions = [listed.index(t) for t in training]
    assert positions == sorted(positions)
    # Every flag is an exact bool.
    checked = 0
    for value in _walk(contract):
        for item in dataclasses.fields(value):
            if item.type in ("bool", bool):
                assert type(getattr(value, item.name)) is bool, (type(value).__name__, item.name)
                checked += 1
    assert checked > 5
    capabilities = contract.capabilities
    # Live flags: nothing has been finalized, so neither is claimed.
    assert capabilities.canonical_parameter_fqns is False
    assert capabilities.stable_shard_identity is False
    # Static flags: the forwarding of §6 exists unless the backup is AdamW.
    forwards = not isinstance(hybrid.backup, torch.optim.AdamW)
    assert capabilities.post_sharding is forwards
    assert capabilities.shard_rebinding is forwards
    assert capabilities.explicit_process_group_codebook_scope is forwards


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("config", list(CONFIGURATIONS))
def test_conformance_accepts_the_flat_state_dict(config: str, stepped: bool) -> None:
    hybrid = CONFIGURATIONS[config]()
    if stepped:
        _stepped(hybrid)
    contract = _checked_contract(hybrid)
    state_dict = hybrid.state_dict()
    assert set(state_dict) == {"state", "param_groups", "gefen_hybrid"}
    result = check_state_dict(contract, state_dict)
    assert set(result) == set(state_dict["state"])
    muon_ids = [i for g in state_dict["param_groups"] if g["use_muon"] for i in g["params"]]
    for key, names in result.items():
        role = "muon" if key in muon_ids else "backup"
        assert any(name.startswith(f"{role}/") for name in names), (key, names)
    if hybrid.muon is not None:
        # format 2 saves a fresh entry complete (zeros, step 0): it has the codec's keys and,
        # with the hybrid's default NorMuon, the NorMuon pair
        assert "muon/q8_normuon" in result[0]
    # The checker is not vacuous: a stray top-level key or missing extras are caught.
    with pytest.raises(ConformanceError):
        check_state_dict(contract, {**state_dict, "stray": 1})
    with pytest.raises(ConformanceError):
        check_state_dict(contract, {k: v for k, v in state_dict.items() if k != "gefen_hybrid"})


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_refused_after_the_scheduled_beta1_changes_no_betas(backend: str) -> None:
    """The backup ``betas`` follow ``momentum`` before the children's checks; a step those
    checks refuse (a later group's momentum out of range, a NaN gradient) wrote them anyway."""
    _, hybrid = _hybrid(backend, no_decay_substrings=("norm",))
    _stepped(hybrid)
    assert hybrid.backup is not None
    groups = hybrid.backup.param_groups
    assert len(groups) == 2
    for refuse, fragment in (
        (lambda: groups[1].__setitem__("momentum", 1.5), "'momentum' is read as beta1"),
        (lambda: _params(hybrid)[-1].grad.view(-1).__setitem__(0, float("nan")), "NaN"),
    ):
        groups[0]["momentum"] = 0.5  # a scheduler's write, not yet followed into betas
        _set_grads(_params(hybrid), 78)
        refuse()
        before = _snapshot(hybrid)
        with pytest.raises((ValueError, RuntimeError), match=re.escape(fragment)):
            hybrid.step()
        _assert_same(before, _snapshot(hybrid))
        groups[1].pop("momentum", None)
        groups[0]["momentum"] = groups[0]["betas"][0]
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_whose_backup_momentum_no_beta1_may_take_is_refused_at_load(
    backend: str,
) -> None:
    """It loaded, then every step failed; the same value in a Muon group was refused at load."""
    _, hybrid = _hybrid(backend)
    _stepped(hybrid)
    saved = copy.deepcopy(hybrid.state_dict())
    backup_group = next(i for i, g in enumerate(saved["param_groups"]) if not g["use_muon"])
    saved["param_groups"][backup_group]["momentum"] = 1.5
    before = _snapshot(hybrid)
    where = f"GefenMuonHybrid checkpoint: param_groups[{backup_group}]"  # the checkpoint's
    with pytest.raises(ValueError, match=re.escape(where)):
        hybrid.load_state_dict(saved)
    _assert_same(before, _snapshot(hybrid))
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_hybrids_own_state_keys_follow_a_muon_child_built_later(backend: str) -> None:
    """Non-tensor keys live in the first child's state (§5); a Muon child built by
    ``add_param_group`` becomes the first, and the keys stayed behind in the backup's."""
    norm = nn.LayerNorm(4)
    hybrid = GefenMuonHybrid.from_model(norm, backup_optimizer=backend, **FAST)
    hybrid.state["user"] = 1
    hybrid.add_param_group({"params": [("w", nn.Parameter(torch.randn(4, 4)))]})
    assert "user" in hybrid.state
    assert list(hybrid.state).count("user") == 1
    hybrid.state["user"] = 2
    assert hybrid.state["user"] == 2
    assert hybrid.state_dict()["state"]["user"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("model", "options", "fragment"),
    [
        (lambda: nn.LayerNorm(4), {"momentum": 1.2}, "Invalid momentum value: 1.2"),
        (lambda: nn.LayerNorm(4), {"ns_steps": 0}, "ns_steps"),
        (lambda: nn.Linear(4, 4, bias=False), {"eps": -1.0}, "eps"),
    ],
    ids=["no-muon-child-momentum", "no-muon-child-ns-steps", "no-backup-child-eps"],
)
def test_options_of_a_child_the_hybrid_lacks_are_checked_at_construction(
    backend: str, model: Callable[[], nn.Module], options: dict[str, Any], fragment: str
) -> None:
    """They were accepted, and refused only when ``add_param_group`` built that child, with a
    message about an option the added group never set."""
    with pytest.raises(ValueError, match=re.escape(fragment)):
        GefenMuonHybrid.from_model(model(), backup_optimizer=backend, **{**FAST, **options})


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_the_state_view_iterates_only_what_it_holds(backup: str) -> None:
    # A group added through the child and removed again left the child an entry the hybrid
    # does not own: iterating the view yielded it, `[]` raised, and state_dict() failed for good.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    hybrid = GefenMuonHybrid(model, backup_optimizer=backup, lr=1e-2)
    model(torch.randn(2, 8)).square().mean().backward()
    hybrid.step()
    stray = nn.Parameter(torch.randn(4, 4))
    assert hybrid.muon is not None
    hybrid.muon.add_param_group({"params": [stray], "param_names": ["stray"]})
    hybrid.muon.state[stray]  # an entry of the child's own
    hybrid.muon.param_groups.pop()
    keys = list(hybrid.state)
    assert all(key is not stray for key in keys)
    assert len(hybrid.state) == len(keys) == len(list(model.parameters()))
    assert dict(hybrid.state.items()).keys() == set(model.parameters())
    hybrid.state_dict()
    hybrid.step()
