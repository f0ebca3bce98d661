"""GefenMuonHybrid's nested checkpoint and its atomic load (docs/hybrid.md §8, §10).

Every rejected load proves that neither child changed (a deep snapshot of both children, taken
against a checkpoint from an earlier step so that a partial commit would show), that no child
load method ran when the rule is the hybrid's own, and that the hybrid still trains afterwards.
"""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gefen.hybrid.adamw_participant as adamw_participant
from gefen.core import Gefen
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist import DistributedStepError
from gefen.dist.testing import deep_snapshot, snapshot_diff
from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.flat_layout import join, split
from gefen.hybrid.testing import MUON_NAMES, TinyLM
from gefen.muon import GefenMuon

BACKENDS = ["gefen", "adamw"]
FORMS = ["full", "muon-only", "backup-only"]
PREFIX = "GefenMuonHybrid checkpoint: "
SCHEMA = (
    PREFIX + "expects torch's {'state', 'param_groups'} layout with the 'gefen_hybrid' extras "
    "(or the nested {'muon', 'backup', 'backup_optimizer'} layout of gefen-hybrid 0.1)"
)
NO_EXTRAS = (
    "GefenMuonHybrid checkpoint: torch's {'state', 'param_groups'} layout needs the 'gefen_hybrid' "
    "extras (a checkpoint of another optimizer, or one consolidated without them, cannot be "
    "loaded)"
)
NESTED_WARNING = "nested {'muon', 'backup', 'backup_optimizer'} layout of gefen-hybrid 0.1"
LATCHED = "previous step failed during commit"


def _model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _on(model: nn.Module, form: str, backend: str, **kwargs: Any) -> GefenMuonHybrid:
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if n in MUON_NAMES]
    backup = [(n, p) for n, p in named if n not in MUON_NAMES]
    if form == "muon-only":
        backup = []
    elif form == "backup-only":
        muon = []
    kwargs.setdefault("lr", 1e-2)
    kwargs.setdefault("ns_steps", 1)
    kwargs.setdefault("fused", False)
    return GefenMuonHybrid(muon, backup, backup_optimizer=backend, **kwargs)


def _build(
    backend: str, form: str = "full", seed: int = 0, **kwargs: Any
) -> tuple[TinyLM, GefenMuonHybrid]:
    model = _model(seed)
    return model, _on(model, form, backend, **kwargs)


def _params(hybrid: GefenMuonHybrid) -> list[torch.Tensor]:
    return [p for group in hybrid.param_groups for p in group["params"]]


def _set_grads(hybrid: GefenMuonHybrid, seed: int) -> None:
    for index, p in enumerate(_params(hybrid)):
        generator = torch.Generator().manual_seed(seed + index)
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)


def _stepped(hybrid: GefenMuonHybrid, steps: int = 1, seed: int = 50) -> None:
    for step in range(steps):
        _set_grads(hybrid, seed + 100 * step)
        hybrid.step()


def _step_in_lockstep(hybrid: GefenMuonHybrid, twin: GefenMuonHybrid, steps: int) -> None:
    """Step both on the same gradients; their parameters must stay bitwise equal."""
    for step in range(steps):
        _set_grads(hybrid, 300 + 10 * step)
        _set_grads(twin, 300 + 10 * step)
        hybrid.step()
        twin.step()
        for p, q in zip(_params(hybrid), _params(twin), strict=True):
            assert torch.equal(p.detach(), q.detach())


def _counters(hybrid: GefenMuonHybrid) -> tuple[int, ...]:
    counts = []
    for child in hybrid.children:
        if isinstance(child, (Gefen, GefenMuon)):
            counts.append(child.global_step)
        else:
            steps = [int(entry["step"]) for entry in child.state.values() if "step" in entry]
            counts.append(max(steps, default=0))
    return tuple(counts)


def _trains(hybrid: GefenMuonHybrid, seed: int = 123) -> None:
    params = _params(hybrid)
    _set_grads(hybrid, seed)
    before = [p.detach().clone() for p in params]
    counters = _counters(hybrid)
    hybrid.step()
    assert _counters(hybrid) == tuple(c + 1 for c in counters)
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert not hybrid._commit_failed


def _snapshot(hybrid: GefenMuonHybrid) -> dict[str, Any]:
    snap: dict[str, Any] = {
        role: deep_snapshot(child, attributes=SNAPSHOT_ATTRIBUTES)
        for role, child in (("muon", hybrid.muon), ("backup", hybrid.backup))
        if child is not None
    }
    snap["latched"] = hybrid._commit_failed
    return snap


def _assert_unchanged(before: dict[str, Any], hybrid: GefenMuonHybrid) -> None:
    after = _snapshot(hybrid)
    assert before.keys() == after.keys()
    assert before["latched"] == after["latched"]
    problems = [
        f"{role}: {line}"
        for role in before
        if role != "latched"
        for line in snapshot_diff(before[role], after[role])
    ]
    assert not problems, "a child changed:\n  " + "\n  ".join(problems)


def _same(a: Any, b: Any, path: str = "sd") -> None:
    """Deep equality of two checkpoint trees; tensors compared by dtype, shape and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a) == list(b), (path, list(a), list(b))
        for key in a:
            _same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), path
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{index}]")
    else:
        assert type(a) is type(b), (path, a, b)
        assert a == b, (path, a, b)


def _tensor_ids(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [id(value)]
    if isinstance(value, dict):
        return [i for item in value.values() for i in _tensor_ids(item)]
    if isinstance(value, (list, tuple)):
        return [i for item in value for i in _tensor_ids(item)]
    return []


def _watch_children(hybrid: GefenMuonHybrid, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (and pass through) every child load method the hybrid could call."""
    calls: list[str] = []
    for role, child in (("muon", hybrid.muon), ("backup", hybrid.backup)):
        if child is None:
            continue
        for name in ("prepare_load_state_dict", "load_state_dict"):
            real = getattr(child, name, None)
            if real is None:
                continue

            def recorder(*args: Any, _real: Any = real, _tag: str = f"{role}.{name}") -> Any:
                calls.append(_tag)
                return _real(*args)

            monkeypatch.setattr(child, name, recorder)
    real_adamw = adamw_participant.prepare_adamw_load

    def adamw_recorder(*args: Any) -> Any:
        calls.append("backup.prepare_adamw_load")
        return real_adamw(*args)

    monkeypatch.setattr(adamw_participant, "prepare_adamw_load", adamw_recorder)
    return calls


def _rejects_load(
    hybrid: GefenMuonHybrid,
    sd: Any,
    message: str,
    *,
    exact: bool = True,
) -> ValueError:
    before = _snapshot(hybrid)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        hybrid.load_state_dict(sd)
    assert not isinstance(info.value, DistributedStepError)  # empty scope: unchanged error
    if exact:
        assert str(info.value) == message
    _assert_unchanged(before, hybrid)
    _trains(hybrid)
    return info.value


def _saved_then_stepped(
    backend: str, form: str = "full", **kwargs: Any
) -> tuple[TinyLM, GefenMuonHybrid, dict[str, Any]]:
    """A hybrid one step ahead of ``saved``, so any partial commit of ``saved`` would show."""
    model, hybrid = _build(backend, form, **kwargs)
    _stepped(hybrid)
    saved = copy.deepcopy(hybrid.state_dict())
    _stepped(hybrid, seed=77)
    return model, hybrid, saved


def _nested(hybrid: GefenMuonHybrid, saved: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``saved`` as the children's own dicts (``flat_layout.split``)."""
    return split(hybrid, copy.deepcopy(saved))


# --------------------------------------------------------------------------------------------
# Format and round trips


def _only_tensors_and_primitives(value: Any, path: str = "sd") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, (str, int)), (path, key)
            assert not isinstance(key, bool), (path, key)
            _only_tensors_and_primitives(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _only_tensors_and_primitives(item, f"{path}[{index}]")
    else:
        assert value is None or isinstance(value, (torch.Tensor, bool, int, float, str)), (
            path,
            type(value),
        )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_is_torchs_flat_layout_primitive_and_weights_only_loadable(
    backend: str, form: str
) -> None:
    _, hybrid = _build(backend, form)
    _stepped(hybrid, steps=2)
    sd = hybrid.state_dict()
    assert type(sd) is dict
    assert list(sd) == ["state", "param_groups", "gefen_hybrid"]
    extras = sd["gefen_hybrid"]
    assert extras["backup_optimizer"] == backend
    assert extras["format_version"] == 1
    # One index space, as torch numbers hybrid.param_groups; groups in order, each flagged.
    flags = [group["use_muon"] for group in sd["param_groups"]]
    assert flags == [child is hybrid.muon for child in hybrid.children for _ in child.param_groups]
    # Every group carries the hybrid's own words, for DCP (which drops top-level keys).
    words = {
        "format_version": 1,
        "backup_optimizer": backend,
        **{half: getattr(hybrid, half) is not None for half in ("muon", "backup")},
    }
    assert all(group["gefen_hybrid"] == words for group in sd["param_groups"])
    ids = [index for group in sd["param_groups"] for index in group["params"]]
    assert ids == list(range(len(_params(hybrid))))
    assert sorted(sd["state"]) == ids
    offset = 0
    for half in ("muon", "backup"):
        child = getattr(hybrid, half)
        if child is None:
            assert extras[half] is None
            continue
        own = child.state_dict()
        groups = [g for g in sd["param_groups"] if g["use_muon"] == (half == "muon")]
        for group, child_group in zip(groups, own["param_groups"], strict=True):
            assert group["params"] == [index + offset for index in child_group["params"]]
            hybrid_only = ("params", "use_muon", "gefen_hybrid")
            _same({k: v for k, v in group.items() if k not in hybrid_only},
                  {k: v for k, v in child_group.items() if k != "params"})  # fmt: skip
        for index, entry in own["state"].items():
            _same(sd["state"][index + offset], entry)
        _same(extras[half], {k: v for k, v in own.items() if k not in ("state", "param_groups")})
        _same(split(hybrid, sd)[half], own)
        offset += len(own["state"])
    _only_tensors_and_primitives(sd)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    _same(torch.load(buffer, weights_only=True), sd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_nested_layout_of_0_1_loads_with_one_warning(backend: str) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    nested = _nested(hybrid, saved)
    with pytest.warns(FutureWarning, match=re.escape(NESTED_WARNING)) as caught:
        hybrid.load_state_dict(nested)
    assert len([w for w in caught if issubclass(w.category, FutureWarning)]) == 1
    _same(hybrid.state_dict(), saved)
    assert _counters(hybrid) == (1, 1)
    _trains(hybrid)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_then_step_resumes_bit_exactly(backend: str, form: str) -> None:
    model, hybrid = _build(backend, form)
    _stepped(hybrid, steps=2)
    buffer = io.BytesIO()
    torch.save(hybrid.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    twin_model = copy.deepcopy(model)
    twin = _on(twin_model, form, backend)
    twin.load_state_dict(loaded)
    _same(twin.state_dict(), hybrid.state_dict())
    assert _counters(twin) == _counters(hybrid)
    _step_in_lockstep(hybrid, twin, steps=3)
    _same(twin.state_dict(), hybrid.state_dict())
    assert _counters(twin) == tuple(5 for _ in hybrid.children)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_without_normuon_resumes_without_it_in_a_default_hybrid(backend: str) -> None:
    """NorMuon became the default after checkpoints were written with ``normuon=False``: such a
    checkpoint keeps its own setting (torch restores group options on load), so resuming it in
    a hybrid built with the new default continues the old run bit for bit."""
    model, hybrid = _build(backend, normuon=False)
    _stepped(hybrid, steps=2)
    twin_model = copy.deepcopy(model)
    twin = _on(twin_model, "full", backend)
    assert twin.muon is not None
    assert twin.muon.param_groups[0]["normuon"] is True
    twin.load_state_dict(copy.deepcopy(hybrid.state_dict()))
    assert twin.muon.param_groups[0]["normuon"] is False
    _step_in_lockstep(hybrid, twin, steps=2)
    assert not any("normuon_v" in entry for entry in twin.muon.state.values())
    _same(twin.state_dict(), hybrid.state_dict())


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_accepts_the_keyword(backend: str) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    hybrid.load_state_dict(state_dict=saved)
    _same(hybrid.state_dict(), saved)
    assert _counters(hybrid) == (1, 1)
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_successful_load_stages_through_the_children_and_never_calls_their_load(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The positive control of the "before any child method" tests below: the recorders work.
    _, hybrid, saved = _saved_then_stepped(backend)
    calls = _watch_children(hybrid, monkeypatch)
    hybrid.load_state_dict(saved)
    backup_call = (
        "backup.prepare_load_state_dict" if backend == "gefen" else "backup.prepare_adamw_load"
    )
    assert calls == ["muon.prepare_load_state_dict", backup_call]
    _same(hybrid.state_dict(), saved)


def test_state_dict_hooks_fire_once_and_the_post_hook_may_replace() -> None:
    _, hybrid = _build("gefen")
    _stepped(hybrid)
    counts = {"pre": 0, "post": 0}

    def pre(optimizer: Any) -> None:
        assert optimizer is hybrid
        counts["pre"] += 1

    def post(optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
        counts["post"] += 1
        assert list(sd) == ["state", "param_groups", "gefen_hybrid"]
        return {**sd, "note": "replaced"}

    hybrid.register_state_dict_pre_hook(pre)
    hybrid.register_state_dict_post_hook(post)
    sd = hybrid.state_dict()
    assert counts == {"pre": 1, "post": 1}
    assert sd["note"] == "replaced"


# --------------------------------------------------------------------------------------------
# The hybrid's own rejections: before any child method is called


def _schema_cases(hybrid: GefenMuonHybrid, saved: dict[str, Any]) -> dict[str, Any]:
    nested = _nested(hybrid, saved)
    return {
        "standard": ({"state": {}, "param_groups": [{"params": [0, 1]}]}, NO_EXTRAS),
        "muon-as-standard": (nested["muon"], NO_EXTRAS),
        "list": ([nested["muon"], nested["backup"]], SCHEMA),
        "string": ("checkpoint.pt", SCHEMA),
        "neither": ({"optimizer": saved}, SCHEMA),
    }


@pytest.mark.parametrize("case", ["standard", "muon-as-standard", "list", "string", "neither"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_schema_rejections(backend: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    calls = _watch_children(hybrid, monkeypatch)
    checkpoint, message = _schema_cases(hybrid, saved)[case]
    _rejects_load(hybrid, checkpoint, message)
    assert calls == []


FLAT_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "flag-int": (
        lambda sd: sd["param_groups"][0].__setitem__("use_muon", 1),
        "param_groups[0]['use_muon'] must be a bool, got 1",
    ),
    "flag-missing": (
        lambda sd: sd["param_groups"][0].pop("use_muon"),
        "param_groups[0]['use_muon'] must be a bool, got None",
    ),
    "params-str": (
        lambda sd: sd["param_groups"][0].__setitem__("params", ["0"]),
        "param_groups[0]['params'] must be a list of int ids",
    ),
    "groups-dict": (
        lambda sd: sd.__setitem__("param_groups", {}),
        "'param_groups' must be a list, got dict",
    ),
    "group-list": (
        lambda sd: sd["param_groups"].__setitem__(0, []),
        "param_groups[0] must be a dict",
    ),
    "state-list": (lambda sd: sd.__setitem__("state", []), "'state' must be a dict, got list"),
    "version": (
        lambda sd: sd["gefen_hybrid"].__setitem__("format_version", 2),
        "'gefen_hybrid' format_version must be 1",
    ),
    "extras-key": (
        lambda sd: sd["gefen_hybrid"].__setitem__("colour", "red"),
        "'gefen_hybrid' keys must be",
    ),
    "child-extras": (
        lambda sd: sd["gefen_hybrid"].__setitem__("muon", {"state": {}}),
        "'gefen_hybrid' 'muon' must be None or a dict of its extras",
    ),
    "routed-to-none": (
        lambda sd: sd["gefen_hybrid"].__setitem__("muon", None),
        "param groups route to 'muon' but its extras are None",
    ),
}


@pytest.mark.parametrize("case", sorted(FLAT_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_layout_rejections(backend: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the split itself needs is checked before any child method runs."""
    _, hybrid, saved = _saved_then_stepped(backend)
    corrupt, fragment = FLAT_CASES[case]
    broken = copy.deepcopy(saved)
    corrupt(broken)
    calls = _watch_children(hybrid, monkeypatch)
    _rejects_load(hybrid, broken, PREFIX + fragment, exact=False)
    assert calls == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_id_past_a_missing_child_is_rejected(backend: str) -> None:
    """In a Muon-only hybrid an id past the Muon child's would belong to no child at all."""
    _, hybrid, saved = _saved_then_stepped(backend, "muon-only")
    broken = copy.deepcopy(saved)
    broken["state"][99] = copy.deepcopy(broken["state"][0])
    _rejects_load(hybrid, broken, PREFIX + "state key 99 names no parameter of any param group")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flipped_use_muon_flag_reaches_the_children_as_a_group_count(backend: str) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    broken = copy.deepcopy(saved)
    broken["param_groups"][0]["use_muon"] = False  # the Muon group now routes to the backup
    _rejects_load(hybrid, broken, "checkpoint: ", exact=False)


def _lacks(half: str) -> str:
    return f"{PREFIX}lacks the '{half}' half; loading would silently reset its state"


def _carries(half: str) -> str:
    return f"{PREFIX}carries a '{half}' half but this optimizer has none"


@pytest.mark.parametrize("how", ["none", "absent"])
@pytest.mark.parametrize("half", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_half_is_rejected(
    backend: str, half: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    broken = _nested(hybrid, saved)
    if how == "none":  # the flat layout: its extras None, no group routed to it
        broken[half] = None
        checkpoint: dict[str, Any] = join(broken)
    else:  # the nested layout of 0.1, without the key
        del broken[half]
        checkpoint = broken
    calls = _watch_children(hybrid, monkeypatch)
    _rejects_load(hybrid, checkpoint, _lacks(half))
    assert calls == []


@pytest.mark.parametrize("extra", ["backup", "muon"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_extra_half_is_rejected(
    backend: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, full = _build(backend)
    _stepped(full)
    full_sd = copy.deepcopy(full.state_dict())
    form = "muon-only" if extra == "backup" else "backup-only"
    _, hybrid = _build(backend, form)
    _stepped(hybrid, steps=2)
    calls = _watch_children(hybrid, monkeypatch)
    _rejects_load(hybrid, full_sd, _carries(extra))
    assert calls == []


def _tag_message(saved: object, live: str) -> str:
    return (
        f"{PREFIX}backup_optimizer={saved!r} does not match backup_optimizer={live!r}; there is "
        "no cross-backend conversion"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_of_the_other_backend_is_rejected(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = "adamw" if backend == "gefen" else "gefen"
    _, source = _build(other)
    _stepped(source)
    foreign = copy.deepcopy(source.state_dict())
    _, hybrid = _build(backend)
    _stepped(hybrid, steps=2)
    calls = _watch_children(hybrid, monkeypatch)
    _rejects_load(hybrid, foreign, _tag_message(other, backend))
    assert calls == []


@pytest.mark.parametrize("tag", ["untagged", "sgd", "GEFEN", "none-value"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_or_missing_tag_is_rejected(
    backend: str, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    broken = _nested(hybrid, saved)
    if tag == "untagged":  # the nested layout of 0.1 without its tag
        del broken["backup_optimizer"]
        saved_tag: object = None
    elif tag == "none-value":
        broken["backup_optimizer"] = None
        saved_tag = None
    else:
        saved_tag = backend.upper() if tag == "GEFEN" else tag
        broken["backup_optimizer"] = saved_tag
    checkpoint = broken if tag == "untagged" else join(broken)
    calls = _watch_children(hybrid, monkeypatch)
    _rejects_load(hybrid, checkpoint, _tag_message(saved_tag, backend))
    assert calls == []


def test_a_gefen_tagged_checkpoint_without_backup_loads_into_an_adamw_muon_only_hybrid() -> None:
    _, gefen_hybrid = _build("gefen", "muon-only")
    _stepped(gefen_hybrid)
    sd = copy.deepcopy(gefen_hybrid.state_dict())
    assert sd["gefen_hybrid"]["backup"] is None
    assert sd["gefen_hybrid"]["backup_optimizer"] == "gefen"
    _, adamw_hybrid = _build("adamw", "muon-only")
    _stepped(adamw_hybrid, steps=2)
    adamw_hybrid.load_state_dict(sd)  # the tag is only checked when a backup half exists
    _same(adamw_hybrid.state_dict()["state"], sd["state"])
    assert adamw_hybrid.state_dict()["gefen_hybrid"]["backup_optimizer"] == "adamw"
    _trains(adamw_hybrid)


# --------------------------------------------------------------------------------------------
# Child rejections: their own prefix, and nothing committed anywhere


@pytest.mark.parametrize("half", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_child_rejection_keeps_its_own_prefix(backend: str, half: str) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    broken = _nested(hybrid, saved)
    group = broken[half]["param_groups"][0]
    group["params"] = group["params"][:-1]  # one parameter id short
    if half == "muon":
        prefix = "GefenMuon checkpoint: "
    elif backend == "gefen":
        prefix = "Gefen checkpoint: "
    else:
        prefix = PREFIX + "AdamW backup: "
    error = _rejects_load(hybrid, join(broken), prefix, exact=False)
    assert str(error).startswith(prefix)
    if half == "muon" or backend == "gefen":
        assert not str(error).startswith(PREFIX)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backup_group_count_rejection_leaves_muon_byte_identical(backend: str) -> None:
    _, hybrid, saved = _saved_then_stepped(backend, no_decay_substrings=("bias", "norm"))
    assert hybrid.backup is not None
    assert len(hybrid.backup.param_groups) == 2
    assert hybrid.muon is not None
    broken = _nested(hybrid, saved)
    broken["backup"]["param_groups"] = broken["backup"]["param_groups"][:1]
    muon_state = hybrid.muon.state
    muon_ids = _tensor_ids(list(hybrid.muon.state.values()))
    codebook = hybrid.muon.codebook
    prefix = "Gefen checkpoint: " if backend == "gefen" else PREFIX + "AdamW backup: "
    error = _rejects_load(hybrid, join(broken), prefix + "the group count 1 differs", exact=False)
    assert str(error).startswith(prefix)
    # _rejects_load already compared both deep snapshots (bytes and identities) and then took
    # one training step; the Muon objects are still the very same ones.
    assert hybrid.muon.state is muon_state
    assert hybrid.muon.codebook is codebook
    assert len(muon_ids) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backup_group_count_rejection_commits_no_muon_state(backend: str) -> None:
    # The same rejection, checked without the training step: ids of every Muon tensor kept.
    _, hybrid, saved = _saved_then_stepped(backend, no_decay_substrings=("bias", "norm"))
    assert hybrid.muon is not None
    broken = _nested(hybrid, saved)
    broken["backup"]["param_groups"] = broken["backup"]["param_groups"][:1]
    entries = {id(p): dict(entry) for p, entry in hybrid.muon.state.items()}
    ids = _tensor_ids(entries)
    before = deep_snapshot(hybrid.muon, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(ValueError, match="the group count 1 differs"):
        hybrid.load_state_dict(join(broken))
    assert snapshot_diff(before, deep_snapshot(hybrid.muon, attributes=SNAPSHOT_ATTRIBUTES)) == []
    after = {id(p): dict(entry) for p, entry in hybrid.muon.state.items()}
    assert _tensor_ids(after) == ids
    assert hybrid.muon.global_step == 2


@pytest.mark.parametrize("key", ["step", "exp_avg", "exp_avg_sq"])
def test_an_adamw_entry_missing_a_key_is_rejected(key: str) -> None:
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    entry_id = broken["backup"]["param_groups"][0]["params"][0]
    del broken["backup"]["state"][entry_id][key]
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert f"missing '{key}'" in str(error)


@pytest.mark.parametrize(
    "step", [float("nan"), -1.0, "three"], ids=["nan-step", "negative-step", "str-step"]
)
def test_an_adamw_entry_with_a_bad_step_is_rejected(step: object) -> None:
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    entry_id = broken["backup"]["param_groups"][0]["params"][0]
    broken["backup"]["state"][entry_id]["step"] = (
        torch.tensor(step) if isinstance(step, float) else step
    )
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert "'step'" in str(error)


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_an_adamw_entry_with_a_meta_or_sparse_step_is_rejected_by_name(kind: str) -> None:
    # It used to raise torch's RuntimeError (".item() on meta", "reshape ... sparse").
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    entry_id = broken["backup"]["param_groups"][0]["params"][0]
    step = torch.tensor([3.0])
    bad = torch.empty_like(step, device="meta") if kind == "meta" else step.to_sparse()
    broken["backup"]["state"][entry_id]["step"] = bad
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert "'step' must be a dense tensor holding data" in str(error)


def test_an_adamw_entry_with_a_wrong_shape_is_rejected() -> None:
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    entry_id = broken["backup"]["param_groups"][0]["params"][0]
    entry = broken["backup"]["state"][entry_id]
    entry["exp_avg"] = entry["exp_avg"].flatten()
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert "'exp_avg' must be a tensor of shape" in str(error)


# --------------------------------------------------------------------------------------------
# Hooks around a load


@pytest.mark.parametrize("raiser", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_raising_child_load_post_hook_leaves_both_children_committed(
    backend: str, raiser: str
) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    child = hybrid.muon if raiser == "muon" else hybrid.backup
    assert child is not None

    def raising(optimizer: Any) -> None:
        raise RuntimeError(f"{raiser} post-hook failure")

    child.register_load_state_dict_post_hook(raising)
    with pytest.raises(RuntimeError, match=f"{raiser} post-hook failure"):
        hybrid.load_state_dict(saved)
    # Both halves hold the checkpoint, not the live state one step ahead of it.
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    _same(hybrid.muon.state_dict(), _nested(hybrid, saved)["muon"])
    _same(hybrid.backup.state_dict(), _nested(hybrid, saved)["backup"])
    assert _counters(hybrid) == (1, 1)
    assert not hybrid._commit_failed
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_pre_hooks_run_on_a_copy(backend: str) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    caller = copy.deepcopy(saved)
    reference = copy.deepcopy(caller)
    ids = _tensor_ids(caller)
    received: list[Any] = []

    def mutating(optimizer: Any, sd: dict[str, Any]) -> None:
        assert optimizer is hybrid
        received.append(sd)
        muon_group, backup_group = (
            next(g for g in sd["param_groups"] if g["use_muon"] is flag) for flag in (True, False)
        )
        muon_group["lr"] = 0.125
        backup_group["lr"] = 0.25
        sd["note"] = "added by the hook"
        for entry in sd["state"].values():  # entry dicts are copies too
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor):
                    entry[key] = value.clone()

    hybrid.register_load_state_dict_pre_hook(mutating)
    hybrid.load_state_dict(caller)
    assert len(received) == 1
    assert received[0] is not caller
    _same(caller, reference)  # deep-unchanged: containers, keys, order and values
    assert _tensor_ids(caller) == ids
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    assert hybrid.muon.param_groups[0]["lr"] == 0.125  # the hook's edits were loaded
    assert hybrid.backup.param_groups[0]["lr"] == 0.25
    _trains(hybrid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_load_pre_hook_may_return_a_replacement(backend: str) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)  # saved: 1 step; live: 2 steps
    later = copy.deepcopy(hybrid.state_dict())
    caller = copy.deepcopy(later)
    calls = []

    def replacing(optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        return copy.deepcopy(saved)

    hybrid.register_load_state_dict_pre_hook(replacing)
    _stepped(hybrid, seed=88)
    hybrid.load_state_dict(caller)
    assert calls == [1]
    _same(hybrid.state_dict(), saved)  # the replacement was loaded, not the caller's dict
    assert _counters(hybrid) == (1, 1)
    _same(caller, later)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_hybrid_load_post_hook_fires_once_after_success_never_after_rejection(
    backend: str,
) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    fired: list[Any] = []
    hybrid.register_load_state_dict_post_hook(lambda optimizer: fired.append(optimizer))
    rejected = [
        join({**_nested(hybrid, saved), "backup_optimizer": "sgd"}),
        {"state": {}, "param_groups": []},
        join({**_nested(hybrid, saved), "muon": None}),
    ]
    for sd in rejected:
        with pytest.raises(ValueError, match=re.escape(PREFIX)):
            hybrid.load_state_dict(sd)
        assert fired == []
    broken = _nested(hybrid, saved)
    broken["muon"]["param_groups"] = []
    with pytest.raises(ValueError, match="GefenMuon checkpoint: "):
        hybrid.load_state_dict(join(broken))
    assert fired == []
    hybrid.load_state_dict(saved)
    assert fired == [hybrid]
    hybrid.load_state_dict(saved)
    assert fired == [hybrid, hybrid]


# --------------------------------------------------------------------------------------------
# The failed-commit latch and loads


def _inject_failure(
    hybrid: GefenMuonHybrid, half: str, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], None]:
    child = hybrid.muon if half == "muon" else hybrid.backup
    assert child is not None

    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"injected {half} commit failure")

    if not isinstance(child, (Gefen, GefenMuon)):  # AdamW's step is its class's, unwrapped
        original = type(child).step
        monkeypatch.setattr(type(child), "step", failing)
        return lambda: monkeypatch.setattr(type(child), "step", original)
    monkeypatch.setattr(child, "_commit_step", failing)
    return lambda: monkeypatch.delattr(child, "_commit_step")


@pytest.mark.parametrize("half", ["muon", "backup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_successful_load_clears_the_hybrid_latch_and_the_childrens(
    backend: str, half: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, hybrid, saved = _saved_then_stepped(backend)
    remove = _inject_failure(hybrid, half, monkeypatch)
    _set_grads(hybrid, 5)
    with pytest.raises(RuntimeError, match=f"injected {half} commit failure"):
        hybrid.step()
    remove()
    assert hybrid._commit_failed
    failing_child = hybrid.muon if half == "muon" else hybrid.backup
    if isinstance(failing_child, (Gefen, GefenMuon)):
        assert failing_child._commit_failed
    with pytest.raises(RuntimeError, match=LATCHED):
        hybrid.step()
    # A rejected load (hybrid rule, then a child rule) keeps every latch.
    with pytest.raises(ValueError, match=re.escape(PREFIX)):
        hybrid.load_state_dict(join({**_nested(hybrid, saved), "backup_optimizer": "sgd"}))
    broken = _nested(hybrid, saved)
    broken["muon"]["param_groups"] = []
    with pytest.raises(ValueError, match="GefenMuon checkpoint: "):
        hybrid.load_state_dict(join(broken))
    assert hybrid._commit_failed
    with pytest.raises(RuntimeError, match=LATCHED):
        hybrid.step()
    hybrid.load_state_dict(saved)
    assert not hybrid._commit_failed
    for child in hybrid.children:
        assert not getattr(child, "_commit_failed", False)
    _same(hybrid.state_dict(), saved)
    _trains(hybrid)


def _nan(tensor: torch.Tensor) -> torch.Tensor:
    broken = tensor.clone()
    broken.view(-1)[0] = float("nan")
    return broken


ADAMW_BAD_MOMENTS = {
    "nan-exp_avg": ("exp_avg", _nan, "'exp_avg' must be finite"),
    "nan-exp_avg_sq": ("exp_avg_sq", _nan, "'exp_avg_sq' must be finite"),
    "negative-exp_avg_sq": ("exp_avg_sq", lambda t: t - 1.0, "'exp_avg_sq' must be >= 0"),
    "sparse-exp_avg": ("exp_avg", lambda t: t.to_sparse(), "must be a dense strided tensor"),
    "bool-exp_avg": ("exp_avg", lambda t: t > 0, "'exp_avg' must be a floating tensor"),
}


@pytest.mark.parametrize("case", sorted(ADAMW_BAD_MOMENTS))
def test_an_adamw_entry_with_bad_moment_values_is_rejected(case: str) -> None:
    key, corrupt, fragment = ADAMW_BAD_MOMENTS[case]
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    entry_id = broken["backup"]["param_groups"][0]["params"][0]
    entry = broken["backup"]["state"][entry_id]
    entry[key] = corrupt(entry[key])
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert fragment in str(error)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("betas", (1.0, 0.999), "betas[0] must be in [0, 1)"),
        ("lr", float("inf"), "lr must be finite and >= 0"),
        ("eps", 0.0, "eps must be finite and > 0"),
        ("weight_decay", float("nan"), "weight_decay must be finite and >= 0"),
    ],
)
def test_an_adamw_group_with_a_bad_option_is_rejected(
    key: str, value: object, fragment: str
) -> None:
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    broken["backup"]["param_groups"][0][key] = value
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: group 0: ", exact=False)
    assert fragment in str(error)


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        (lambda names: names[:-1], "param_names must be a list of the group's length"),
        (lambda names: [7] * len(names), "param_names must hold str"),
    ],
    ids=["short", "not-str"],
)
def test_adamw_param_names_follow_the_gefen_backups_rules(names, fragment: str) -> None:
    """Such a checkpoint used to be installed as it was (names no longer one per parameter)."""
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    group = next(g for g in broken["backup"]["param_groups"] if "param_names" in g)
    group["param_names"] = names(group["param_names"])
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert fragment in str(error)


def test_re_keyed_adamw_ids_are_rejected() -> None:
    # torch's state_dict numbers parameters 0..n-1 in group order; a permuted numbering maps
    # moments onto other parameters (of the same shape: no shape check could notice).
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    groups = broken["backup"]["param_groups"]
    ids = [ident for group in groups for ident in group["params"]]
    assert len(ids) >= 2
    groups[0]["params"] = [ids[1], ids[0], *groups[0]["params"][2:]]
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert "parameter ids must be 0.." in str(error)


def test_an_adamw_entry_for_an_unlisted_id_is_rejected() -> None:
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    state = broken["backup"]["state"]
    state[len(state) + 7] = copy.deepcopy(next(iter(state.values())))
    error = _rejects_load(hybrid, join(broken), PREFIX + "AdamW backup: ", exact=False)
    assert "entries for parameter ids no group lists" in str(error)


def test_a_dropped_adamw_entry_warns_that_its_moments_restart() -> None:
    _, hybrid, saved = _saved_then_stepped("adamw")
    broken = _nested(hybrid, saved)
    del broken["backup"]["state"][0]
    assert hybrid.backup is not None
    name = hybrid.backup.param_groups[0]["param_names"][0]  # its id was the backup's own 0
    with pytest.warns(UserWarning, match=re.escape(f"no entry for parameters [{name!r}]")):
        hybrid.load_state_dict(join(broken))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loaded_hybrid_owns_its_state_never_the_callers_tensors(backend: str) -> None:
    """An AdamW backup used to keep the loaded dict's tensors (torch's load does): two hybrids
    loaded from one dict shared their moments, training wrote into the caller's in-memory
    checkpoint, and NaN written into that dict later reached the live state unchecked."""
    _, _, saved = _saved_then_stepped(backend)
    pristine = copy.deepcopy(saved)
    _, first = _build(backend, "full")
    _, second = _build(backend, "full")
    first.load_state_dict(saved)
    second.load_state_dict(saved)
    caller = {id(t) for entry in saved["state"].values() for t in entry.values()
              if isinstance(t, torch.Tensor)}  # fmt: skip
    for hybrid in (first, second):
        live = [t for entry in hybrid.state.values() for t in entry.values()
                if isinstance(t, torch.Tensor)]  # fmt: skip
        assert live
        assert not any(id(t) in caller for t in live)
    _trains(first)
    _same(saved, pristine)  # the caller's checkpoint is as it was saved
    for entry in saved["state"].values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.fill_(float("nan"))
    _trains(second)
    assert all(torch.isfinite(p).all() for p in _params(second))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("across", [False, True], ids=["one-group", "across-children"])
def test_a_checkpoint_naming_two_parameters_alike_is_refused(backend: str, across: bool) -> None:
    """The constructor and add_param_group refuse a repeated name; a load used to install one
    (each child checks only its own groups, and only warned of a renamed parameter)."""
    _, hybrid, saved = _saved_then_stepped(backend)
    groups = saved["param_groups"]
    named = [group for group in groups if len(group.get("param_names", ())) >= (1 if across else 2)]
    assert named
    if across:  # the backup's first name becomes the Muon child's first
        muon = next(group for group in groups if group["use_muon"])
        backup = next(group for group in groups if not group["use_muon"])
        backup["param_names"][0] = muon["param_names"][0]
        repeated = muon["param_names"][0]
    else:
        names = named[0]["param_names"]
        names[1] = repeated = names[0]
    before = _snapshot(hybrid)
    with pytest.raises(ValueError, match=re.escape(f"duplicate parameter name {repeated!r}")):
        hybrid.load_state_dict(saved)
    _assert_unchanged(before, hybrid)
    _trains(hybrid)


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_a_load_frees_both_childrens_replaced_state_before_the_next_step(backup: str) -> None:
    # Each Gefen child's steady-step caches held its replaced entries until the next step.
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
    hybrid = GefenMuonHybrid(model, backup_optimizer=backup, lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 32)).square().mean().backward()
        hybrid.step()
        hybrid.zero_grad()
    saved = copy.deepcopy(hybrid.state_dict())
    replaced = [
        weakref.ref(value)
        for child in hybrid.children
        for entry in child.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    ]
    hybrid.load_state_dict(saved)
    del saved
    gc.collect()
    assert [ref for ref in replaced if ref() is not None] == []
