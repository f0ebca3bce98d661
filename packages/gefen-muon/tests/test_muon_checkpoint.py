"""Single-process checkpoint tests of GefenMuon (docs/muon.md §8, §12 checkpoint items).

Layout, ``weights_only`` round trips, bit-exact resume, structural keys, every fail-closed rule
that applies in one process (each with its message, nothing mutated, still trains afterwards),
the ``"muon_distributed"`` manifest rebound by ``saved_id`` when no live eligible group exists,
the load hooks and the failed-commit latch. Multi-rank behaviour lives elsewhere.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gefen.core.testing import SNAPSHOT_ATTRIBUTES, format1_state_dict
from gefen.core.testing import weights_only_round_trip as _roundtrip
from gefen.dist.testing import assert_unchanged, deep_snapshot
from gefen.muon import GefenMuon
from gefen.muon.checkpoint import _names
from gefen.muon.testing import OPTION_KEYS

SHAPES = ((12, 16), (8, 8), (6, 10))
NAMES = ("enc.weight", "enc.proj", "head.weight")
BASE_EXTRAS = {
    "format_version",
    "global_step",
    "codebook",
    "deterministic",
    "momentum_codec",
    "initialized_params",
}
HYPERPARAMETERS = OPTION_KEYS


# -- builders -----------------------------------------------------------------------------------


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in SHAPES
    ]


def _build(params: list[torch.nn.Parameter], *, named: bool = True, **options: Any) -> GefenMuon:
    """Two groups: (enc.weight, enc.proj) and (head.weight) with its own lr."""
    options = {"ns_steps": 1, "fused": False, **options}
    items = list(zip(NAMES, params, strict=True)) if named else list(params)
    return GefenMuon([{"params": items[:2]}, {"params": items[2:], "lr": 0.01}], **options)


def _grads(params: list[torch.nn.Parameter], seed: int, active: tuple[int, ...] = (0, 1)) -> None:
    """Gradients for the ``active`` positions; the others get none."""
    generator = torch.Generator().manual_seed(1000 + seed)
    for index, p in enumerate(params):
        g = torch.randn(p.shape, generator=generator).to(p.dtype)
        p.grad = g if index in active else None


def _trained(
    steps: int = 3, *, seed: int = 0, named: bool = True, dtype=torch.float32, **options: Any
) -> tuple[GefenMuon, list[torch.nn.Parameter]]:
    """``steps`` steps with gradients for the first two parameters only: the third parameter's
    entry stays the pristine placeholder, so checkpoints hold both kinds of entry."""
    params = _params(seed, dtype)
    optimizer = _build(params, named=named, **options)
    for step in range(steps):
        _grads(params, seed * 100 + step)
        optimizer.step()
    return optimizer, params


def _flat(optimizer: GefenMuon) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _both(sd: dict[str, Any], key: str, value: Any) -> None:
    """Set an extras key identically at the top level and in every group copy."""
    sd["gefen"][key] = copy.deepcopy(value)
    for group in sd["param_groups"]:
        group["gefen"][key] = copy.deepcopy(value)


# -- checks -------------------------------------------------------------------------------------


def _trains(optimizer: GefenMuon) -> None:
    """The optimizer still takes a normal step that moves every parameter."""
    params = _flat(optimizer)
    generator = torch.Generator().manual_seed(123)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    before = [p.detach().clone() for p in params]
    step = optimizer.global_step
    optimizer.step()
    assert optimizer.global_step == step + 1
    for b, p in zip(before, params, strict=True):
        assert not torch.equal(b, p)
        assert bool(torch.isfinite(p).all())


def _rejects(
    optimizer: GefenMuon,
    action: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    *,
    check_training: bool = True,
) -> pytest.ExceptionInfo[Any]:
    """Raises with ``fragment``, mutates nothing (deep snapshot plus the identity of the
    group list, every group and the state mapping), and the optimizer trains afterwards."""
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    groups, group_objects, state = (
        optimizer.param_groups,
        list(optimizer.param_groups),
        optimizer.state,
    )
    with pytest.raises(error, match=re.escape(fragment)) as info:
        action()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert optimizer.param_groups is groups
    assert all(a is b for a, b in zip(optimizer.param_groups, group_objects, strict=True))
    assert optimizer.state is state
    if check_training:
        _trains(optimizer)
    return info


def _deep_record(value: Any) -> Any:
    """Every container and tensor with the object itself (for ``is``) and tensors by bytes."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).clone()
        return ("tensor", value, value.dtype, tuple(value.shape), data)
    if isinstance(value, dict):
        return ("dict", value, [(key, _deep_record(item)) for key, item in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, value, [_deep_record(item) for item in value])
    return ("value", type(value), value)


def _assert_record(before: Any, after: Any, path: str = "sd") -> None:
    assert before[0] == after[0], f"{path}: {before[0]} became {after[0]}"
    if before[0] == "value":
        assert before[1] is after[1], f"{path}: type changed"
        same_nan = before[2] != before[2] and after[2] != after[2]
        assert before[2] == after[2] or same_nan, f"{path}: {before[2]!r} -> {after[2]!r}"
        return
    assert before[1] is after[1], f"{path}: replaced by another object"
    if before[0] == "tensor":
        assert before[2:4] == after[2:4], f"{path}: dtype or shape changed"
        assert torch.equal(before[4], after[4]), f"{path}: values changed"
        return
    if before[0] == "dict":
        assert [k for k, _ in before[2]] == [k for k, _ in after[2]], f"{path}: keys changed"
        for (key, x), (_, y) in zip(before[2], after[2], strict=True):
            _assert_record(x, y, f"{path}[{key!r}]")
        return
    assert len(before[2]) == len(after[2]), f"{path}: length changed"
    for index, (x, y) in enumerate(zip(before[2], after[2], strict=True)):
        _assert_record(x, y, f"{path}[{index}]")


def _assert_entries_equal(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert a.keys() == b.keys(), where
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor), f"{where}[{key}]"
            assert value.dtype == other.dtype, f"{where}[{key}]"
            assert value.shape == other.shape, f"{where}[{key}]"
            assert torch.equal(value, other), f"{where}[{key}]"
        else:
            assert type(value) is type(other), f"{where}[{key}]"
            assert value == other, f"{where}[{key}]"


def _assert_same_optimizer(a: GefenMuon, b: GefenMuon) -> None:
    """Parameters, state, codebook and global step bitwise equal."""
    for index, (p, q) in enumerate(zip(_flat(a), _flat(b), strict=True)):
        assert p.dtype == q.dtype, f"parameter {index}"
        assert torch.equal(p, q), f"parameter {index}"
        _assert_entries_equal(a.state[p], b.state[q], f"state {index}")
    assert a.global_step == b.global_step
    if a.codebook is None:
        assert b.codebook is None
    else:
        assert b.codebook is not None
        assert torch.equal(a.codebook, b.codebook)


# -- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["codebook8", "none"])
@pytest.mark.parametrize("mode", ["exact", "distributed", "approx"])
def test_state_dict_layout(codec: str, mode: str) -> None:
    optimizer, params = _trained(3, momentum_codec=codec, sharded_mode=mode, normuon=True)
    sd = optimizer.state_dict()
    assert set(sd) == {"state", "param_groups", "gefen"}
    # torch's layout: params as flat indices, every entry keyed by its flat index.
    assert [group["params"] for group in sd["param_groups"]] == [[0, 1], [2]]
    assert set(sd["state"]) == {0, 1, 2}
    # format 2: the pristine entry is saved complete, zeros with step 0 (its live form is the
    # placeholder), so a fresh optimizer is a DCP template
    assert sd["state"][2]["step"] == 0
    assert sd["state"][2]["period"] == 0
    assert format1_state_dict(optimizer, sd)["state"][2] == {"period": 0}
    for group in sd["param_groups"]:
        assert set(group) >= HYPERPARAMETERS
        assert group["sharded_mode"] == mode
    assert sd["param_groups"][0]["param_names"] == list(NAMES[:2])
    assert sd["param_groups"][1]["param_names"] == [NAMES[2]]
    assert sd["param_groups"][1]["lr"] == 0.01
    extras = sd["gefen"]
    # One process: never a manifest, a rank-local header or a scope, whatever the mode.
    assert set(extras) == {*BASE_EXTRAS, "codebook_present", "optimizer"}
    assert extras["optimizer"] == "GefenMuon"
    assert extras["format_version"] == 2
    assert extras["global_step"] == 3
    assert extras["deterministic"] is False
    assert extras["momentum_codec"] == codec
    assert extras["initialized_params"] == [1, 1, 0]  # format 2: one flag per parameter
    if codec == "codebook8":
        assert extras["codebook_present"] == 1
        assert extras["codebook"] is not optimizer.codebook
        assert torch.equal(extras["codebook"], optimizer.codebook)
    else:
        assert extras["codebook_present"] == 0
        assert not extras["codebook"].any()
    for group in sd["param_groups"]:
        copy_ = group["gefen"]
        assert copy_ is not extras
        assert copy_.keys() == extras.keys() - {"optimizer"}  # the writer: top level only
        for key, value in extras.items():
            if key == "optimizer":
                continue
            if isinstance(value, torch.Tensor):
                assert copy_[key] is not value
                assert torch.equal(copy_[key], value)
            else:
                assert copy_[key] == value
    momentum = (
        {"momentum_codes", "momentum_scale", "matrix_cols"}
        if codec == "codebook8"
        else {"momentum_buffer"}
    )
    for index, p in enumerate(params[:2]):
        entry = sd["state"][index]
        assert set(entry) == {"period", "step", "normuon_v", "normuon_step"} | momentum
        assert entry["step"] == 3
        assert type(entry["step"]) is int
        assert entry["normuon_step"] == 3
        assert type(entry["normuon_step"]) is int
        assert entry["normuon_v"].dtype == torch.float32
        assert tuple(entry["normuon_v"].shape) == (p.shape[0], 1)
        if codec == "codebook8":
            period = entry["period"]
            assert entry["momentum_codes"].dtype == torch.uint8
            assert tuple(entry["momentum_codes"].shape) == (p.numel() // period, period)
            assert entry["momentum_scale"].dtype == torch.float32
        else:
            assert entry["period"] == 1
            assert entry["momentum_buffer"].dtype == p.dtype
            assert entry["momentum_buffer"].shape == p.shape


@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_weights_only_round_trip_keeps_dtypes(codec: str) -> None:
    """bf16 parameters: uint8 codes and fp32 scales / NorMuon state; a bf16 dense buffer."""
    source, _ = _trained(3, dtype=torch.bfloat16, momentum_codec=codec, normuon=True)
    sd = source.state_dict()
    loaded = _roundtrip(sd)
    for index in (0, 1):
        _assert_entries_equal(sd["state"][index], loaded["state"][index], f"entry {index}")
    target, twin = _trained(1, dtype=torch.bfloat16, momentum_codec=codec, normuon=True)
    target.load_state_dict(loaded)
    for index, p in enumerate(twin[:2]):
        entry = target.state[p]
        _assert_entries_equal(entry, sd["state"][index], f"loaded {index}")
        assert entry["normuon_v"].dtype == torch.float32
        if codec == "codebook8":
            assert entry["momentum_codes"].dtype == torch.uint8
            assert entry["momentum_scale"].dtype == torch.float32
        else:
            assert entry["momentum_buffer"].dtype == torch.bfloat16
        # The loaded state is the optimizer's own, not the checkpoint's tensors.
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert value is not loaded["state"][index][key]
    assert target.state[twin[2]] == {"period": 0}
    assert target.global_step == 3


# -- bit-exact resume ---------------------------------------------------------------------------


RESUME = [
    {"momentum_codec": "codebook8"},
    {"momentum_codec": "codebook8", "normuon": True},
    {"momentum_codec": "none"},
    {"momentum_codec": "none", "normuon": True},
    {"momentum_codec": "codebook8", "stochastic_round": True, "normuon": True},
]


def _resume(options: dict[str, Any], edit: Callable[[dict[str, Any]], None] | None) -> None:
    """Train A 3 steps, save (weights_only), build B from copies of A's parameters, load,
    then train both 3 more steps on the same gradients: bitwise equal throughout."""
    a, a_params = _trained(3, **options)
    sd = _roundtrip(a.state_dict())
    if edit is not None:
        edit(sd)
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    b = _build(b_params, **options)
    b.load_state_dict(sd)
    _assert_same_optimizer(a, b)
    for step in range(3):
        # All three parameters now: the third one initialises against the frozen codebook.
        _grads(a_params, 50 + step, active=(0, 1, 2))
        _grads(b_params, 50 + step, active=(0, 1, 2))
        a.step()
        b.step()
        _assert_same_optimizer(a, b)
    assert b.global_step == 6
    assert b.state[b_params[2]]["step"] == 3


@pytest.mark.parametrize(
    "options", RESUME, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_resume_is_bit_exact(options: dict[str, Any]) -> None:
    _resume(options, None)


@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_resume_without_top_level_marker_uses_group_copies(codec: str) -> None:
    def drop_top_level(sd: dict[str, Any]) -> None:
        del sd["gefen"]

    _resume({"momentum_codec": codec, "normuon": True}, drop_top_level)


def test_resume_into_unnamed_optimizer() -> None:
    a, a_params = _trained(3, named=False)
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    b = _build(b_params, named=False)
    b.load_state_dict(_roundtrip(a.state_dict()))
    _assert_same_optimizer(a, b)
    assert "param_names" not in b.param_groups[0]


def test_load_by_keyword() -> None:
    source, _ = _trained(3)
    sd = source.state_dict()
    target, params = _trained(1, seed=1)
    target.load_state_dict(state_dict=sd)
    assert target.global_step == 3
    assert torch.equal(target.codebook, source.codebook)
    live_forms = format1_state_dict(source, sd)["state"]
    for index, p in enumerate(params):
        _assert_entries_equal(target.state[p], live_forms[index], f"entry {index}")


# -- structural keys and hyperparameters -------------------------------------------------------


@pytest.mark.parametrize(("saved", "live"), [("codebook8", "none"), ("none", "codebook8")])
def test_codec_mismatch_rejected(saved: str, live: str) -> None:
    source, _ = _trained(3, momentum_codec=saved)
    sd = source.state_dict()
    target, _ = _trained(2, momentum_codec=live)
    _rejects(
        target,
        lambda: target.load_state_dict(sd),
        ValueError,
        f"GefenMuon checkpoint: momentum_codec {saved!r} differs from the live {live!r}",
    )


def test_entry_of_the_other_codec_rejected() -> None:
    """Extras claim codebook8, but an entry holds a dense buffer."""
    sd = _source_sd()
    entry = sd["state"][1]
    del entry["momentum_codes"], entry["momentum_scale"]
    entry["momentum_buffer"] = torch.zeros(SHAPES[1])
    target, _ = _target()
    _rejects(target, lambda: target.load_state_dict(sd), ValueError, "other momentum codec")


@pytest.mark.parametrize(("saved", "live"), [("distributed", "exact"), ("exact", "distributed")])
def test_sharded_mode_is_never_overwritten(saved: str, live: str) -> None:
    source, _ = _trained(3)
    sd = source.state_dict()
    for group in sd["param_groups"]:
        group["sharded_mode"] = saved
    target, params = _trained(1, seed=1, sharded_mode=live)
    target.load_state_dict(sd)
    assert [group["sharded_mode"] for group in target.param_groups] == [live, live]
    assert target.global_step == 3
    _assert_entries_equal(target.state[params[0]], sd["state"][0], "entry 0")
    _trains(target)


def test_checkpoint_saved_in_distributed_mode_loads_into_exact() -> None:
    source, _ = _trained(3, sharded_mode="distributed")
    target, _ = _trained(1, seed=1)
    target.load_state_dict(source.state_dict())
    assert target.param_groups[0]["sharded_mode"] == "exact"
    _trains(target)


def test_approx_checkpoint_into_live_exact_rejected() -> None:
    source, _ = _trained(3)
    sd = source.state_dict()
    sd["param_groups"][0]["sharded_mode"] = "approx"
    target, _ = _trained(2)
    _rejects(
        target,
        lambda: target.load_state_dict(sd),
        ValueError,
        "GefenMuon checkpoint: group 0: sharded_mode 'approx' cannot load into 'exact'",
    )


def test_exact_checkpoint_into_live_approx_rejected() -> None:
    source, _ = _trained(3)
    sd = source.state_dict()
    target, _ = _trained(2, sharded_mode="approx")
    _rejects(
        target,
        lambda: target.load_state_dict(sd),
        ValueError,
        "GefenMuon checkpoint: group 0: sharded_mode 'exact' cannot load into 'approx'",
    )


def test_approx_checkpoint_into_live_approx_loads() -> None:
    source, _ = _trained(3, sharded_mode="approx")
    target, _ = _trained(1, seed=1, sharded_mode="approx")
    target.load_state_dict(source.state_dict())
    assert target.global_step == 3
    _trains(target)


def test_hyperparameters_load_as_in_torch() -> None:
    source, _ = _trained(3)
    sd = source.state_dict()
    edited = copy.deepcopy(sd)
    group_edit = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "nesterov": False}
    edited["param_groups"][0].update(group_edit)
    edited["param_groups"][1]["adjust_lr_fn"] = "match_rms_adamw"
    target, params = _trained(1, seed=1)
    target.load_state_dict(edited)
    first, second = target.param_groups
    assert (first["lr"], first["momentum"], first["weight_decay"]) == (0.05, 0.9, 0.0)
    assert first["nesterov"] is False
    assert second["adjust_lr_fn"] == "match_rms_adamw"
    assert second["lr"] == 0.01
    # The next step uses the loaded values: it equals a twin that loaded the unedited
    # checkpoint and then had the same values set by hand, and differs from one that did not.
    twin, twin_params = _trained(1, seed=1)
    control, control_params = _trained(1, seed=1)
    twin.load_state_dict(sd)
    control.load_state_dict(sd)
    twin.param_groups[0].update(group_edit)
    twin.param_groups[1]["adjust_lr_fn"] = "match_rms_adamw"
    for run in (params, twin_params, control_params):
        _grads(run, 60, active=(0, 1, 2))
    for optimizer in (target, twin, control):
        optimizer.step()
    _assert_same_optimizer(target, twin)
    for ours, theirs in zip(params, control_params, strict=True):
        assert not torch.equal(ours, theirs)


HYPER_REJECTIONS = [
    ("momentum 1.5", {"momentum": 1.5}, "GefenMuon checkpoint: group 0: Invalid momentum value"),
    ("momentum -0.5", {"momentum": -0.5}, "Invalid momentum value"),
    ("lr -1", {"lr": -1.0}, "GefenMuon checkpoint: group 0: "),
    ("weight decay -0.1", {"weight_decay": -0.1}, "Invalid weight_decay value"),
    ("eps 0", {"eps": 0.0}, "Invalid eps value"),
    ("sharded mode", {"sharded_mode": "bogus"}, "sharded_mode must be one of"),
    ("adjust_lr_fn", {"adjust_lr_fn": "bogus"}, "adjust_lr_fn must be one of"),
    ("normuon_beta2 1.0", {"normuon_beta2": 1.0}, "Invalid normuon_beta2 value"),
    ("ns_steps 0", {"ns_steps": 0}, "GefenMuon checkpoint: group 0: "),
    ("nesterov not bool", {"nesterov": 1}, "GefenMuon checkpoint: group 0: "),
]


@pytest.mark.parametrize(
    ("name", "edit", "fragment"), HYPER_REJECTIONS, ids=[r[0] for r in HYPER_REJECTIONS]
)
def test_saved_hyperparameters_are_revalidated(name: str, edit: dict, fragment: str) -> None:
    sd = _source_sd()
    sd["param_groups"][0].update(edit)
    target, _ = _target()
    fired: list[int] = []
    target.register_load_state_dict_post_hook(lambda opt: fired.append(1))
    _rejects(target, lambda: target.load_state_dict(sd), ValueError, fragment)
    assert fired == []


# -- fail-closed validation (§8, one process) ---------------------------------------------------


def _source_sd(**options: Any) -> dict[str, Any]:
    options = {"normuon": True, **options}
    source, _ = _trained(3, **options)
    # the rules are those of format 1, the live forms (format 2 is read into it first)
    return format1_state_dict(source, source.state_dict())


def _target(**options: Any) -> tuple[GefenMuon, list[torch.nn.Parameter]]:
    options = {"normuon": True, **options}
    return _trained(2, seed=1, **options)


def _set(index: int, key: str, value: Callable[[dict[str, Any]], Any]) -> Callable:
    def mutate(sd: dict[str, Any]) -> None:
        sd["state"][index][key] = value(sd["state"][index])

    return mutate


def _drop(index: int, key: str) -> Callable:
    def mutate(sd: dict[str, Any]) -> None:
        del sd["state"][index][key]

    return mutate


def _group_copy(index: int, key: str, value: Any) -> Callable:
    def mutate(sd: dict[str, Any]) -> None:
        sd["param_groups"][index]["gefen"][key] = value

    return mutate


def _codebook(edit: Callable[[torch.Tensor], None]) -> Callable:
    def mutate(sd: dict[str, Any]) -> None:
        codebook = sd["gefen"]["codebook"].clone()
        edit(codebook)
        _both(sd, "codebook", codebook)

    return mutate


def _repeat_entry(cb: torch.Tensor) -> None:
    cb[5] = cb[4]


def _swap_entries(cb: torch.Tensor) -> None:
    cb[10], cb[11] = cb[11].clone(), cb[10].clone()


def _first_not_minus_one(cb: torch.Tensor) -> None:
    cb[0] = -0.999  # still below cb[1], so only the endpoint rule fails


def _last_not_one(cb: torch.Tensor) -> None:
    cb[255] = 0.999


def _no_codebook_at_step_zero(sd: dict[str, Any]) -> None:
    _both(sd, "codebook", None)
    _both(sd, "global_step", 0)


def _only_group_copies_differ(sd: dict[str, Any]) -> None:
    del sd["gefen"]
    sd["param_groups"][1]["gefen"]["global_step"] = 99


def _group_copy_missing_without_top(sd: dict[str, Any]) -> None:
    del sd["gefen"]
    del sd["param_groups"][0]["gefen"]


def _codes_wrong_shape(entry: dict[str, Any]) -> torch.Tensor:
    rows, period = entry["momentum_codes"].shape
    return torch.zeros(rows + 1, period, dtype=torch.uint8)


def _period_not_dividing(sd: dict[str, Any]) -> None:
    sd["state"][0]["period"] = 7  # 12 * 16 = 192 is not a multiple of 7


FAIL_CLOSED = [
    # 1. copies
    (
        "group copy in only some groups",
        lambda sd: sd["param_groups"][1].pop("gefen"),
        "extras 'gefen' present in only some parameter groups",
    ),
    (
        "group copy missing, no top level",
        _group_copy_missing_without_top,
        "extras 'gefen' present in only some parameter groups",
    ),
    (
        "group copy differs from top level",
        _group_copy(0, "global_step", 99),
        "extras copies differ between the top level and the groups",
    ),
    (
        "group codebook differs from top level",
        lambda sd: sd["param_groups"][1]["gefen"].__setitem__(
            "codebook", torch.linspace(-1, 1, 256)
        ),
        "extras copies differ",
    ),
    ("group copies differ among themselves", _only_group_copies_differ, "extras copies differ"),
    (
        "no extras anywhere",
        lambda sd: [sd.pop("gefen"), *(g.pop("gefen") for g in sd["param_groups"])],
        "extras 'gefen' missing",
    ),
    # 8. extras keys, deterministic tag, global step
    ("unknown extras key", lambda sd: _both(sd, "colour", 1), "unknown extras key 'colour'"),
    (
        "deterministic not a bool",
        lambda sd: _both(sd, "deterministic", 0),
        "deterministic differs from the live flag",
    ),
    (
        "deterministic differs",
        lambda sd: _both(sd, "deterministic", True),
        "deterministic differs from the live flag",
    ),
    (
        "global_step negative",
        lambda sd: _both(sd, "global_step", -1),
        "global_step must be an int >= 0, got -1",
    ),
    (
        "global_step float",
        lambda sd: _both(sd, "global_step", 3.0),
        "global_step must be an int >= 0, got 3.0",
    ),
    (
        "global_step bool",
        lambda sd: _both(sd, "global_step", True),
        "global_step must be an int >= 0, got True",
    ),
    ("format_version", lambda sd: _both(sd, "format_version", 3), "format_version must be 1"),
    (
        "rank_local in one process",
        lambda sd: _both(sd, "rank_local", {"version": 1}),
        "rank-local checkpoint topology differs",
    ),
    ("scope in one process", lambda sd: _both(sd, "scope", {"identity": None}), "codebook scope"),
    # 6. entries
    (
        "entry with an unknown key",
        _set(0, "exp_avg", lambda e: torch.zeros(1)),
        "entry 'enc.weight': unknown state key 'exp_avg'",
    ),
    ("entry not a dict", lambda sd: sd["state"].__setitem__(0, [1]), "entry must be a dict"),
    (
        "codes wrong shape",
        _set(0, "momentum_codes", _codes_wrong_shape),
        "state does not match parameter ('momentum_codes' has shape",
    ),
    (
        "codes wrong dtype",
        _set(0, "momentum_codes", lambda e: e["momentum_codes"].int()),
        "'momentum_codes' must be torch.uint8",
    ),
    ("period not dividing N", _period_not_dividing, "period 7 does not divide numel 192"),
    ("period a bool", _set(1, "period", lambda e: True), "'period' must be an int >= 0"),
    (
        "initialized with period 0",
        _set(1, "period", lambda e: 0),
        "an initialized entry needs a period > 0",
    ),
    (
        "scale negative",
        _set(0, "momentum_scale", lambda e: -e["momentum_scale"] - 1),
        "'momentum_scale' must be >= 0",
    ),
    (
        "scale NaN",
        _set(0, "momentum_scale", lambda e: e["momentum_scale"] * float("nan")),
        "'momentum_scale' must be finite",
    ),
    (
        "scale wrong dtype",
        _set(0, "momentum_scale", lambda e: e["momentum_scale"].double()),
        "'momentum_scale' must be torch.float32",
    ),
    ("codes missing", _drop(0, "momentum_codes"), "missing key 'momentum_codes'"),
    ("step a bool", _set(0, "step", lambda e: True), "'step' must be an int >= 1, got True"),
    ("step 0", _set(0, "step", lambda e: 0), "'step' must be an int >= 1, got 0"),
    (
        "step a 0-dim tensor",
        _set(0, "step", lambda e: torch.tensor(3)),
        "'step' must be an int >= 1",
    ),
    ("step a float", _set(0, "step", lambda e: 3.0), "'step' must be an int >= 1"),
    (
        "uninitialized entry holding state",
        lambda sd: sd["state"][2].__setitem__("normuon_step", 1),
        "an entry without 'step' holds 'normuon_step'",
    ),
    # NorMuon pair
    (
        "normuon_v without normuon_step",
        _drop(0, "normuon_step"),
        "'normuon_v' and 'normuon_step' must appear together",
    ),
    (
        "normuon_step without normuon_v",
        _drop(1, "normuon_v"),
        "'normuon_v' and 'normuon_step' must appear together",
    ),
    (
        "normuon_v wrong dtype",
        _set(0, "normuon_v", lambda e: e["normuon_v"].double()),
        "'normuon_v' must be torch.float32",
    ),
    (
        "normuon_v wrong shape",
        _set(0, "normuon_v", lambda e: torch.zeros(SHAPES[0][1], 1)),
        "state does not match parameter ('normuon_v' has shape",
    ),
    (
        "normuon_v negative",
        _set(0, "normuon_v", lambda e: -e["normuon_v"] - 1),
        "'normuon_v' must be >= 0",
    ),
    (
        "normuon_v NaN",
        _set(0, "normuon_v", lambda e: e["normuon_v"] * float("nan")),
        "'normuon_v' must be finite",
    ),
    (
        "normuon_step a bool",
        _set(0, "normuon_step", lambda e: True),
        "'normuon_step' must be an int >= 0",
    ),
    (
        "normuon_step a 0-dim tensor",
        _set(0, "normuon_step", lambda e: torch.tensor(3)),
        "'normuon_step' must be an int >= 0",
    ),
    # Unbounded, past int64 it loaded, and a row-sharded state_dict() then failed on one rank
    # before the counters' all-reduce the others waited in.
    (
        "normuon_step past int64",
        _set(0, "normuon_step", lambda e: 2**63),
        "'normuon_step' must be an int with 0 <= normuon_step < 2**63, got 9223372036854775808",
    ),
    # Below 2**63 it loaded, and one more step then wrote 2**63, a file no load takes.
    (
        "normuon_step past global_step",
        _set(0, "normuon_step", lambda e: 2**63 - 1),
        "entry 0: 'normuon_step' 9223372036854775807 exceeds global_step",
    ),
    # 7. codebook
    (
        "codebook missing with initialised entries",
        lambda sd: _both(sd, "codebook", None),
        "codes but no codebook",
    ),
    ("codebook missing at global_step 0", _no_codebook_at_step_zero, "codes but no codebook"),
    (
        "codebook repeated value",
        _codebook(_repeat_entry),
        "invalid codebook: codebook must be strictly increasing",
    ),
    (
        "codebook decreasing pair",
        _codebook(_swap_entries),
        "invalid codebook: codebook must be strictly increasing",
    ),
    (
        "codebook cb[0] != -1",
        _codebook(_first_not_minus_one),
        "invalid codebook: codebook must start at exactly -1.0",
    ),
    (
        "codebook cb[255] != 1",
        _codebook(_last_not_one),
        "invalid codebook: codebook must end at exactly +1.0",
    ),
    (
        "codebook fp64",
        lambda sd: _both(sd, "codebook", sd["gefen"]["codebook"].double()),
        "invalid codebook: codebook must be float32",
    ),
    (
        "codebook 255 values",
        lambda sd: _both(sd, "codebook", sd["gefen"]["codebook"][:255].clone()),
        "invalid codebook: codebook must hold 256 values",
    ),
    (
        "initialized_params lists a pristine entry",
        lambda sd: _both(sd, "initialized_params", [0, 1, 2]),
        "initialized_params lists position 2",
    ),
]


def _check_rejection(
    sd: dict[str, Any], target: GefenMuon, fragment: str, check_training: bool = True
) -> None:
    """Rejected with the shared prefix and the rule's fragment; no post-hook fired; nothing of
    the optimizer or the caller's dict changed; the optimizer trains afterwards."""
    record = _deep_record(sd)
    fired: list[int] = []
    target.register_load_state_dict_post_hook(lambda opt: fired.append(1))
    info = _rejects(
        target,
        lambda: target.load_state_dict(sd),
        ValueError,
        fragment,
        check_training=check_training,
    )
    assert str(info.value).startswith("GefenMuon checkpoint: ")
    assert fired == []
    _assert_record(record, _deep_record(sd))


@pytest.mark.parametrize(
    ("name", "mutate", "fragment"), FAIL_CLOSED, ids=[r[0] for r in FAIL_CLOSED]
)
def test_fail_closed_rule(name: str, mutate: Callable, fragment: str) -> None:
    sd = _source_sd()
    mutate(sd)
    target, _ = _target()
    _check_rejection(sd, target, fragment)


def _none_buffer(value: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    return _set(0, "momentum_buffer", lambda e: value(e["momentum_buffer"]))


NONE_CODEC = [
    ("buffer NaN", _none_buffer(lambda b: b * float("nan")), "'momentum_buffer' must be finite"),
    (
        "buffer inf",
        _none_buffer(lambda b: b + float("inf")),
        "'momentum_buffer' must be finite",
    ),
    (
        "buffer wrong shape",
        _none_buffer(lambda b: b.t().contiguous()),
        "state does not match parameter ('momentum_buffer' has shape (16, 12)",
    ),
    (
        "buffer flat",
        _none_buffer(lambda b: b.reshape(-1)),
        "state does not match parameter ('momentum_buffer' has shape (192,)",
    ),
    (
        "buffer wrong dtype",
        _none_buffer(lambda b: b.double()),
        "'momentum_buffer' must be torch.float32",
    ),
    (
        "buffer missing",
        _drop(0, "momentum_buffer"),
        "missing momentum key",
    ),
    (
        "codebook with the none codec",
        lambda sd: _both(sd, "codebook", torch.linspace(-1, 1, 256)),
        "momentum_codec 'none' holds no codebook",
    ),
    (
        "codes in a none entry",
        _set(0, "momentum_codes", lambda e: torch.zeros(12, 16, dtype=torch.uint8)),
        "entry holds both 'momentum_codes' and 'momentum_buffer'",
    ),
    ("step 0-dim tensor", _set(1, "step", lambda e: torch.tensor(3)), "'step' must be an int"),
]


@pytest.mark.parametrize(("name", "mutate", "fragment"), NONE_CODEC, ids=[r[0] for r in NONE_CODEC])
def test_fail_closed_rule_none_codec(name: str, mutate: Callable, fragment: str) -> None:
    sd = _source_sd(momentum_codec="none")
    mutate(sd)
    target, _ = _target(momentum_codec="none")
    _check_rejection(sd, target, fragment)


def test_rejected_load_then_training_matches_a_control_run() -> None:
    """A load rejected by the last parameter's entry changes nothing observable later."""
    bad = _source_sd()
    bad["state"][2]["period"] = 7  # 6 * 10 = 60
    runs = []
    for attempt in (False, True):
        optimizer, params = _target()
        if attempt:
            with pytest.raises(ValueError, match="does not divide numel 60"):
                optimizer.load_state_dict(bad)
        for step in range(3):
            _grads(params, 70 + step, active=(0, 1, 2))
            optimizer.step()
        runs.append(optimizer)
    _assert_same_optimizer(*runs)


# -- the manifest in one process (rebind by saved_id) ------------------------------------------


def _manifest_for(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    params = []
    for index in range(len(SHAPES)):
        entry = sd["state"].get(index, {})
        params.append(
            {
                "saved_id": index,
                "name": names[index],
                "shape": list(SHAPES[index]),
                "owner": index % 2,
                "state_keys": sorted(entry),
                "initialized": "step" in entry,
            }
        )
    return {
        "version": 1,
        "ownership": "stable_index_mod_world",
        "consolidated": True,
        "groups": [{"world_size": 2, "params": params}],
    }


def _with_manifest(
    named: bool = True, edit: Callable[[dict[str, Any]], None] | None = None
) -> tuple[dict[str, Any], GefenMuon, list[torch.nn.Parameter]]:
    """A real one-process state dict plus a hand-built manifest (top level and every group copy,
    identical), and a fresh target optimizer to load it into."""
    source, _ = _trained(3, named=named, normuon=True)
    sd = format1_state_dict(source, source.state_dict())
    target, params = _trained(2, seed=1, named=named, normuon=True)
    manifest = _manifest_for(sd, _names(target.param_groups))
    if edit is not None:
        edit(manifest)
    _both(sd, "muon_distributed", manifest)
    return sd, target, params


def test_manifest_names_are_the_parameter_names() -> None:
    """The expected names come from the implementation's ``_names``; pin what they are."""
    named, _ = _trained(0)
    unnamed, _ = _trained(0, named=False)
    assert _names(named.param_groups) == list(NAMES)
    assert _names(unnamed.param_groups) == [
        "param_groups[0][0]",
        "param_groups[0][1]",
        "param_groups[1][0]",
    ]


@pytest.mark.parametrize("named", [True, False])
def test_valid_manifest_loads_by_saved_id(named: bool) -> None:
    sd, target, params = _with_manifest(named)
    assert sd["param_groups"][0]["gefen"]["muon_distributed"] == sd["gefen"]["muon_distributed"]
    target.load_state_dict(sd)
    assert target.global_step == 3
    # Every entry is kept in one process (nothing is dropped by ownership).
    for index, p in enumerate(params):
        _assert_entries_equal(target.state[p], sd["state"][index], f"entry {index}")
    _trains(target)


def test_valid_manifest_survives_weights_only() -> None:
    sd, target, _ = _with_manifest()
    target.load_state_dict(_roundtrip(sd))
    assert target.global_step == 3


def _param_edit(index: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["groups"][0]["params"][index][key] = value

    return edit


def _header_edit(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest[key] = value

    return edit


def _unsorted_keys(manifest: dict[str, Any]) -> None:
    item = manifest["groups"][0]["params"][0]
    item["state_keys"] = list(reversed(item["state_keys"]))


def _duplicate_key(manifest: dict[str, Any]) -> None:
    item = manifest["groups"][0]["params"][0]
    item["state_keys"] = [*item["state_keys"], item["state_keys"][0]]


def _missing_key(manifest: dict[str, Any]) -> None:
    item = manifest["groups"][0]["params"][0]
    item["state_keys"] = [key for key in item["state_keys"] if key != "normuon_v"]


def _extra_key(manifest: dict[str, Any]) -> None:
    item = manifest["groups"][0]["params"][2]
    item["state_keys"] = ["period", "step"]


def _world_size(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["groups"][0]["world_size"] = value

    return edit


MANIFEST_REJECTIONS = [
    ("version 2", _header_edit("version", 2), "manifest version must be the int 1"),
    ("version 1.0", _header_edit("version", 1.0), "manifest version must be the int 1"),
    ("version True", _header_edit("version", True), "manifest version must be the int 1"),
    (
        "ownership x",
        _header_edit("ownership", "x"),
        "manifest ownership must be 'stable_index_mod_world'",
    ),
    (
        "consolidated False",
        _header_edit("consolidated", False),
        "manifest 'consolidated' must be True",
    ),
    ("consolidated 1", _header_edit("consolidated", 1), "manifest 'consolidated' must be True"),
    ("groups not a list", _header_edit("groups", {}), "manifest 'groups' must be a list"),
    (
        "duplicate saved_id",
        _param_edit(1, "saved_id", 0),
        "manifest saved_id 0 does not name one live parameter",
    ),
    (
        "out-of-range saved_id",
        _param_edit(2, "saved_id", 3),
        "manifest saved_id 3 does not name one live parameter",
    ),
    (
        "negative saved_id",
        _param_edit(2, "saved_id", -1),
        "manifest saved_id -1 does not name one live parameter",
    ),
    (
        "saved_id a bool",
        _param_edit(1, "saved_id", True),
        "manifest saved_id True does not name one live parameter",
    ),
    ("wrong name", _param_edit(1, "name", "enc.other"), "manifest name 'enc.other' differs"),
    ("wrong shape", _param_edit(0, "shape", [16, 12]), "manifest shape of 'enc.weight' differs"),
    (
        "shape as a tuple",
        _param_edit(0, "shape", (12, 16)),
        "manifest shape of 'enc.weight' differs",
    ),
    (
        "wrong owner",
        _param_edit(1, "owner", 0),
        "manifest owner of 'enc.proj' is not position mod world",
    ),
    (
        "state_keys missing a key",
        _missing_key,
        "manifest state_keys of 'enc.weight' differ from its entry",
    ),
    (
        "state_keys with an extra key",
        _extra_key,
        "manifest state_keys of 'head.weight' differ from its entry",
    ),
    (
        "state_keys unsorted",
        _unsorted_keys,
        "manifest state_keys of 'enc.weight' differ from its entry",
    ),
    (
        "state_keys duplicate",
        _duplicate_key,
        "manifest state_keys of 'enc.weight' differ from its entry",
    ),
    (
        "initialized not a bool",
        _param_edit(0, "initialized", 1),
        "manifest 'initialized' of 'enc.weight' is wrong",
    ),
    (
        "initialized False for an initialised entry",
        _param_edit(1, "initialized", False),
        "manifest 'initialized' of 'enc.proj' is wrong",
    ),
    (
        "initialized True for a pristine entry",
        _param_edit(2, "initialized", True),
        "manifest 'initialized' of 'head.weight' is wrong",
    ),
    ("world_size 0", _world_size(0), "manifest world_size must be an int >= 1"),
    ("world_size a bool", _world_size(True), "manifest world_size must be an int >= 1"),
]


@pytest.mark.parametrize(
    ("name", "edit", "fragment"), MANIFEST_REJECTIONS, ids=[r[0] for r in MANIFEST_REJECTIONS]
)
def test_manifest_rule_rejects(name: str, edit: Callable, fragment: str) -> None:
    sd, target, _ = _with_manifest(edit=edit)
    _check_rejection(sd, target, fragment)


def test_manifest_not_a_dict_rejected() -> None:
    sd, target, _ = _with_manifest()
    _both(sd, "muon_distributed", [1])
    _check_rejection(sd, target, "the muon_distributed manifest must be a dict")


def test_manifest_at_top_level_only_loads() -> None:
    """What ``state_dict()`` writes: the manifest at the top level only (docs/core.md §8.1)."""
    sd, target, _ = _with_manifest()
    for group in sd["param_groups"]:
        del group["gefen"]["muon_distributed"]
    target.load_state_dict(sd)
    assert target.global_step == 3


def test_a_group_manifest_that_differs_from_the_top_level_one_is_rejected() -> None:
    """A file of an earlier release has the manifest in its groups too: there it must agree."""
    sd, target, _ = _with_manifest()
    sd["param_groups"][1]["gefen"]["muon_distributed"]["groups"] = []
    _check_rejection(sd, target, "extras copies differ between the top level and the groups")


def test_manifest_in_group_copies_only_loads() -> None:
    sd, target, _ = _with_manifest()
    del sd["gefen"]
    target.load_state_dict(sd)
    assert target.global_step == 3


# -- hooks ----------------------------------------------------------------------------------------


def _rewrite_in_place(optimizer: GefenMuon, sd: dict[str, Any]) -> None:
    """A pre-hook that rewrites its argument in place at every depth and stays loadable."""
    sd["param_groups"][0]["lr"] = 0.123
    sd["param_groups"][1]["note"] = "added by the hook"
    entry = sd["state"][0]
    entry["momentum_scale"] = entry["momentum_scale"] * 2  # a new tensor, never in place
    entry["step"] += 1
    for extras in (sd["gefen"], *(group["gefen"] for group in sd["param_groups"])):
        extras["initialized_params"].reverse()
        extras["global_step"] += 1  # counters stay consistent: no entry above global_step
    sd["param_groups"][0]["params"].reverse()
    sd["param_groups"][0]["params"].reverse()


def test_load_pre_hook_runs_on_a_copy() -> None:
    sd = _source_sd()
    record = _deep_record(sd)
    target, params = _target()
    target.register_load_state_dict_pre_hook(_rewrite_in_place)
    target.load_state_dict(sd)
    _assert_record(record, _deep_record(sd))
    # What loaded is the hook's rewrite, so the hook really ran (on a copy).
    assert target.param_groups[0]["lr"] == 0.123
    assert target.param_groups[1]["note"] == "added by the hook"
    entry = target.state[params[0]]
    assert entry["step"] == sd["state"][0]["step"] + 1
    assert torch.equal(entry["momentum_scale"], sd["state"][0]["momentum_scale"] * 2)
    target.load_state_dict(sd)  # the same dict loads again
    _assert_record(record, _deep_record(sd))


def test_load_pre_hook_may_return_a_replacement() -> None:
    sd = _source_sd()
    record = _deep_record(sd)
    target, _ = _target()
    seen: list[Any] = []

    def replace(optimizer: GefenMuon, given: dict[str, Any]) -> dict[str, Any]:
        seen.append(given)
        replacement = copy.deepcopy(given)
        replacement["param_groups"][1]["lr"] = 0.02
        return replacement

    target.register_load_state_dict_pre_hook(replace)
    target.load_state_dict(sd)
    assert seen[0] is not sd
    assert target.param_groups[1]["lr"] == 0.02
    _assert_record(record, _deep_record(sd))


def test_load_pre_hook_on_a_rejected_load_leaves_callers_dict() -> None:
    sd = _source_sd()
    sd["state"][2]["period"] = 7  # rejected by the last entry, after the hook ran
    target, _ = _target()
    target.register_load_state_dict_pre_hook(_rewrite_in_place)
    _check_rejection(sd, target, "does not divide numel 60")


def test_load_post_hook_fires_once_per_successful_load() -> None:
    sd = _source_sd()
    target, _ = _target()
    calls: list[tuple[str, int]] = []
    target.register_load_state_dict_pre_hook(lambda opt, d: calls.append(("pre", opt.global_step)))
    target.register_load_state_dict_post_hook(lambda opt: calls.append(("post", opt.global_step)))
    target.load_state_dict(sd)
    # The post-hook sees the committed state; the pre-hook the old one.
    assert calls == [("pre", 2), ("post", 3)]
    bad = copy.deepcopy(sd)
    _both(bad, "deterministic", True)
    with pytest.raises(ValueError, match="deterministic differs"):
        target.load_state_dict(bad)
    assert calls == [("pre", 2), ("post", 3), ("pre", 3)]
    target.load_state_dict(sd)
    assert calls[-1] == ("post", 3)
    assert len(calls) == 5


# -- the failed-commit latch -------------------------------------------------------------------


def test_commit_failure_latch_survives_rejected_load_and_clears_on_success() -> None:
    sd = _source_sd()
    target, params = _target()

    def failing_commit(plan: Any) -> None:
        raise MemoryError("injected commit failure")

    target._commit_step = failing_commit  # type: ignore[method-assign]
    _grads(params, 90)
    with pytest.raises(MemoryError, match="injected commit failure"):
        target.step()
    assert target._commit_failed is True
    del target._commit_step
    _grads(params, 91)
    with pytest.raises(RuntimeError, match="previous step failed during commit"):
        target.step()

    bad = copy.deepcopy(sd)
    bad["state"][0]["step"] = 0
    _check_rejection(bad, target, "'step' must be an int >= 1", check_training=False)
    assert target._commit_failed is True
    with pytest.raises(RuntimeError, match="previous step failed during commit"):
        target.step()

    target.load_state_dict(sd)
    assert target._commit_failed is False
    assert target.global_step == 3
    _trains(target)


def test_state_dict_creates_no_live_entry_for_a_parameter_added_to_a_group() -> None:
    # state_dict() is a read: a parameter appended to a group and never stepped gets a complete
    # fresh entry in the checkpoint and none in the live state (it used to get a live {}).
    torch.manual_seed(0)
    matrix = torch.nn.Parameter(torch.randn(16, 32))
    optimizer = GefenMuon([matrix], lr=1e-3)
    matrix.grad = torch.randn_like(matrix)
    optimizer.step()
    added = torch.nn.Parameter(torch.randn(8, 8))
    optimizer.param_groups[0]["params"].append(added)
    saved = optimizer.state_dict()
    assert added not in optimizer.state
    twin = GefenMuon(
        [matrix.detach().clone().requires_grad_(), added.detach().clone().requires_grad_()],
        lr=1e-3,
    )
    twin.load_state_dict(saved)
    assert twin.global_step == optimizer.global_step


def test_a_warm_restarts_live_step_edit_still_writes_a_checkpoint_that_loads() -> None:
    # NorMuon's age is the optimizer's steps, not the entry's `step`: a warm restart lowers
    # `step` live and leaves it, and a rule tying the two refused the optimizer's own file.
    matrix = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    optimizer = GefenMuon([matrix], lr=0.01, normuon=True, fused=False)
    for seed in range(3):
        matrix.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))
        optimizer.step()
    optimizer.state[matrix]["step"] = 1
    matrix.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    optimizer.step()
    assert (optimizer.state[matrix]["step"], optimizer.state[matrix]["normuon_step"]) == (2, 4)
    fresh = GefenMuon([matrix], lr=0.01, normuon=True, fused=False)
    fresh.load_state_dict(optimizer.state_dict())
    assert fresh.state[matrix]["normuon_step"] == 4


@pytest.mark.parametrize("stepped", [False, True], ids=["unstepped", "stepped"])
@pytest.mark.parametrize("direction", ["gefen_into_muon", "muon_into_gefen"])
def test_a_checkpoint_of_the_other_class_is_refused_by_name(direction: str, stepped: bool) -> None:
    # An unstepped Gefen file loaded into a GefenMuon (lr 3e-4, betas and the rest replacing
    # Muon's, with a warning only); stepped ones were refused by accident ("unknown state key
    # 'v_row'", "'matrix_cols' does not").
    from gefen.core import Gefen

    torch.manual_seed(0)
    source_params = [torch.nn.Parameter(torch.randn(8, 16))]
    target_params = [torch.nn.Parameter(torch.randn(8, 16))]
    gefen = Gefen(source_params if direction == "gefen_into_muon" else target_params, lr=3e-4)
    muon = GefenMuon(target_params if direction == "gefen_into_muon" else source_params, lr=0.02)
    source, target = (gefen, muon) if direction == "gefen_into_muon" else (muon, gefen)
    if stepped:
        source_params[0].grad = torch.randn(8, 16)
        source.step()
    saved = source.state_dict()
    before = deep_snapshot(target, attributes=SNAPSHOT_ATTRIBUTES)
    owner = type(source).__name__
    with pytest.raises(ValueError, match=f"this is a checkpoint of '{owner}'"):
        target.load_state_dict(saved)
    assert_unchanged(before, deep_snapshot(target, attributes=SNAPSHOT_ATTRIBUTES))
    target_params[0].grad = torch.randn(8, 16)
    target.step()
    assert target.global_step == 1


def test_a_checkpoint_without_the_writers_name_still_loads() -> None:
    params = [torch.nn.Parameter(torch.randn(8, 16))]
    optimizer = GefenMuon(params, lr=0.02)
    params[0].grad = torch.randn(8, 16)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())  # as an earlier build wrote it
    del saved["gefen"]["optimizer"]
    optimizer.load_state_dict(saved)
    assert optimizer.global_step == 1


def test_the_writers_name_stays_out_of_the_group_copies_dcp_keeps() -> None:
    # In the group copies it made a fresh optimizer's DCP template ask every earlier build's
    # file for it: DCP refused them all ("Missing key ... gefen.optimizer").
    params = [torch.nn.Parameter(torch.randn(8, 16))]
    sd = GefenMuon(params, lr=0.02).state_dict()
    assert sd["gefen"]["optimizer"] == "GefenMuon"
    assert all("optimizer" not in group["gefen"] for group in sd["param_groups"])


def test_a_subclass_with_its_own_owner_name_reads_and_writes_its_bases_files() -> None:
    # The writer's name was OWNER_NAME at first: a subclass naming its messages refused its
    # base class's files, and the base refused the subclass's.
    class MyMuon(GefenMuon):
        OWNER_NAME = "MyMuon"

    params = [torch.nn.Parameter(torch.randn(8, 16))]
    base = GefenMuon(params, lr=0.02)
    params[0].grad = torch.randn(8, 16)
    base.step()
    mine = MyMuon([torch.nn.Parameter(params[0].detach().clone())], lr=0.02)
    mine.load_state_dict(base.state_dict())
    assert mine.global_step == 1
    base.load_state_dict(mine.state_dict())
    assert base.global_step == 1
