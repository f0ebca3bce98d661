"""state_dict / load_state_dict (docs/core.md §8; §12 #46–#52, #59 single-process parts)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gefen.core import Gefen
from gefen.core.testing import format1_state_dict
from gefen.core.testing import weights_only_round_trip as _roundtrip


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(12, 16, generator=generator)),
        torch.nn.Parameter(torch.randn(24, generator=generator)),
    ]


def _grads(params, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def _trained(steps: int = 3, **options) -> tuple[Gefen, list[torch.nn.Parameter]]:
    params = _params()
    optimizer = Gefen([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.01}], **options)
    for seed in range(steps):
        _grads(params, seed)
        optimizer.step()
    return optimizer, params


def test_state_dict_weights_only_extras_mirrored_and_frozen() -> None:
    optimizer, params = _trained()
    sd = optimizer.state_dict()
    loaded = _roundtrip(sd)
    extras = sd["gefen"]
    assert set(extras) == {
        "optimizer",
        "format_version",
        "global_step",
        "codebook",
        "deterministic",
        "momentum_codec",
        "initialized_params",
        "codebook_present",
    }
    assert extras["optimizer"] == "Gefen"  # the writer, so that no other class loads it
    assert extras["format_version"] == 2
    assert extras["codebook_present"] == 1
    for group in sd["param_groups"]:
        assert group["gefen"] is not extras
        # the writer at the top level only: DCP would ask earlier builds' files for it
        assert group["gefen"].keys() == extras.keys() - {"optimizer"}
        assert torch.equal(group["gefen"]["codebook"], extras["codebook"])
    assert extras["initialized_params"] == [1, 1]  # format 2: one flag per parameter
    assert extras["global_step"] == 3
    assert set(sd["state"]) == {0, 1}
    assert loaded["gefen"]["global_step"] == 3
    snapshot = copy.deepcopy(extras)
    _grads(params, 9)
    optimizer.step()
    assert extras["global_step"] == snapshot["global_step"]
    assert torch.equal(extras["codebook"], snapshot["codebook"])


RESUME_OPTIONS = [
    {},
    {"momentum_codec": "none"},
    {"factored_v_2d": False},
    {"stochastic_round": True},
    {"codebook_refresh_every": 2},
]


@pytest.mark.parametrize("options", RESUME_OPTIONS)
def test_resume_is_bit_exact(options: dict) -> None:
    optimizer, params = _trained(3, **options)
    sd = _roundtrip(optimizer.state_dict())
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = Gefen(
        [{"params": [twin_params[0]]}, {"params": [twin_params[1]], "lr": 0.01}], **options
    )
    twin.load_state_dict(sd)
    for seed in range(10, 15):
        _grads(params, seed)
        _grads(twin_params, seed)
        optimizer.step()
        twin.step()
        for ours, theirs in zip(params, twin_params, strict=True):
            assert torch.equal(ours, theirs)
    assert twin.global_step == optimizer.global_step


def test_successful_load_identity_hooks_and_twice() -> None:
    optimizer, _ = _trained()
    sd = optimizer.state_dict()
    reference = copy.deepcopy(sd)
    target, _ = _trained(1)
    calls: list[str] = []
    target.register_load_state_dict_pre_hook(lambda opt, d: calls.append("pre"))
    target.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    old_state, defaults = target.state, target.defaults
    target.load_state_dict(sd)
    assert target.state is not old_state
    assert target.defaults is defaults
    assert calls == ["pre", "post"]
    target.load_state_dict(sd)
    assert target.global_step == 3
    assert sd.keys() == reference.keys()
    assert sd["param_groups"][0].keys() == reference["param_groups"][0].keys()
    assert sd["state"][0].keys() == reference["state"][0].keys()


def _deep_record(value):
    """Every container and tensor of ``value`` with the object itself, for ``is`` checks, and
    tensors by bytes, dtype and shape (bytes, so NaN payloads compare too)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1)
        return ("tensor", value, value.dtype, tuple(value.shape), data.view(torch.uint8).clone())
    if isinstance(value, dict):
        items = [(key, _deep_record(item)) for key, item in value.items()]
        return ("dict", value, type(value), items)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, value, type(value), [_deep_record(x) for x in value])
    return ("value", type(value), value)


def _assert_deep_equal(before, after, path: str = "sd") -> None:
    assert before[0] == after[0], f"{path}: {before[0]} became {after[0]}"
    if before[0] == "value":
        assert before[1] is after[1], f"{path}: type {before[1]} became {after[1]}"
        assert before[2] == after[2] or (before[2] != before[2] and after[2] != after[2]), path
        return
    assert before[1] is after[1], f"{path}: a different object"
    if before[0] == "tensor":
        assert before[2:4] == after[2:4], f"{path}: dtype or shape changed"
        assert torch.equal(before[4], after[4]), f"{path}: values changed"
        return
    assert before[2] is after[2], f"{path}: container type changed"
    if before[0] == "dict":
        assert [k for k, _ in before[3]] == [k for k, _ in after[3]], f"{path}: keys changed"
        for (key, x), (_, y) in zip(before[3], after[3], strict=True):
            _assert_deep_equal(x, y, f"{path}[{key!r}]")
    else:
        assert len(before[3]) == len(after[3]), f"{path}: length changed"
        for index, (x, y) in enumerate(zip(before[3], after[3], strict=True)):
            _assert_deep_equal(x, y, f"{path}[{index}]")


def _valid_rewrite(optimizer, sd) -> None:
    """A load pre-hook that rewrites its argument in place at every depth and stays loadable."""
    sd["param_groups"][0]["lr"] = 0.123
    sd["param_groups"][1]["betas"] = [0.8, 0.95]
    sd["param_groups"][1]["note"] = "added by the hook"
    entry = sd["state"][0]
    entry["momentum_scale"] = entry["momentum_scale"] * 2  # a new tensor, never in place
    sd["state"][1]["step"] += 1
    sd["state"][1]["v_step"] += 1
    for extras in (sd["gefen"], *(group["gefen"] for group in sd["param_groups"])):
        extras["initialized_params"].reverse()
        extras["global_step"] += 1  # counters stay consistent: no entry above global_step
    sd["param_groups"][0]["params"].clear()
    sd["param_groups"][0]["params"].append(0)


def _vandalise(value):
    """Rewrite every container below ``value`` in place (tensors are replaced, not written)."""
    if isinstance(value, dict):
        for key in list(value):
            value[key] = _vandalise(value[key])
        value.pop(next(iter(value)), None)
        value["vandal"] = 1
        return value
    if isinstance(value, list):
        for index, item in enumerate(value):
            value[index] = _vandalise(item)
        value.append("vandal")
        value.reverse()
        return value
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return value


def test_load_pre_hook_never_mutates_callers_dict_on_success() -> None:
    source, _ = _trained(3)
    sd = source.state_dict()
    record = _deep_record(sd)
    target, _ = _trained(1)
    target.register_load_state_dict_pre_hook(_valid_rewrite)
    target.load_state_dict(sd)
    _assert_deep_equal(record, _deep_record(sd))
    # The hook's rewrite is what was loaded, so it really ran on a copy.
    assert target.param_groups[0]["lr"] == 0.123
    assert target.param_groups[1]["betas"] == (0.8, 0.95)
    assert target.param_groups[1]["note"] == "added by the hook"
    params = [p for group in target.param_groups for p in group["params"]]
    assert target.state[params[1]]["step"] == sd["state"][1]["step"] + 1
    assert torch.equal(
        target.state[params[0]]["momentum_scale"], sd["state"][0]["momentum_scale"] * 2
    )
    target.load_state_dict(sd)  # the same dict loads twice
    _assert_deep_equal(record, _deep_record(sd))


@pytest.mark.parametrize("hook", [_valid_rewrite, lambda opt, sd: _vandalise(sd)])
def test_load_pre_hook_never_mutates_callers_dict_on_rejection(hook) -> None:
    # Rejected by the last entry, after the hook and every group have been processed.
    sd = _corrupt(lambda sd: sd["state"][1].__setitem__("period", 5))
    record = _deep_record(sd)
    target, _ = _trained(2)
    target.register_load_state_dict_pre_hook(hook)
    with pytest.raises(ValueError, match="Gefen checkpoint: "):
        target.load_state_dict(sd)
    _assert_deep_equal(record, _deep_record(sd))


def test_deep_record_detects_each_kind_of_mutation() -> None:
    optimizer, _ = _trained(1)
    mutations = [
        lambda sd: sd["param_groups"][0].__setitem__("lr", 0.5),
        lambda sd: sd["param_groups"][0]["params"].append(9),
        lambda sd: sd["gefen"]["initialized_params"].append(0),
        lambda sd: sd["state"][0].__setitem__(
            "momentum_scale", sd["state"][0]["momentum_scale"].clone()
        ),
        lambda sd: sd["state"][0]["momentum_codes"].view(-1)[0].add_(1),
        lambda sd: sd["state"].__setitem__(1, dict(sd["state"][1])),
        lambda sd: sd["param_groups"][1].__setitem__("betas", list(sd["param_groups"][1]["betas"])),
    ]
    for mutate in mutations:
        sd = copy.deepcopy(optimizer.state_dict())
        record = _deep_record(sd)
        mutate(sd)
        with pytest.raises(AssertionError):
            _assert_deep_equal(record, _deep_record(sd))


def _corrupt(mutator):
    """A format 1 checkpoint (the live forms the rules name) with one rule broken."""
    optimizer, _ = _trained()
    sd = format1_state_dict(optimizer, optimizer.state_dict())
    mutator(sd)
    return sd


def _both(sd, key, value):
    sd["gefen"][key] = value
    for group in sd["param_groups"]:
        group["gefen"][key] = value


def _factored_on_vector(sd) -> None:
    entry = sd["state"][1]
    del entry["v_block"]
    entry["v_row"], entry["v_col"] = torch.zeros(24), torch.zeros(1)


def _other_codec_entry(sd) -> None:
    entry = sd["state"][1]
    del entry["momentum_codes"], entry["momentum_scale"]
    entry["momentum"] = torch.zeros(entry["v_block"].shape[0], 24 // entry["v_block"].shape[0])


REJECTIONS = [
    ("state not a dict", lambda sd: sd.__setitem__("state", []), "'state' must be a dict"),
    ("group count", lambda sd: sd["param_groups"].pop(), "group count"),
    ("params length", lambda sd: sd["param_groups"][0]["params"].append(7), "'params' must list"),
    ("duplicate ids", lambda sd: sd["param_groups"][1].__setitem__("params", [0]), "unique"),
    (
        "unknown state id",
        lambda sd: sd["state"].__setitem__(9, {"period": 0}),
        "unknown parameter id",
    ),
    (
        "only some groups",
        lambda sd: sd["param_groups"][1].pop("gefen"),
        "only some parameter groups",
    ),
    (
        "copies differ",
        lambda sd: sd["param_groups"][0]["gefen"].__setitem__("global_step", 99),
        "differ",
    ),
    ("unknown extras", lambda sd: _both(sd, "colour", 1), "unknown extras key 'colour'"),
    ("format", lambda sd: _both(sd, "format_version", 3), "format_version"),
    ("global step", lambda sd: _both(sd, "global_step", True), "global_step"),
    ("deterministic", lambda sd: _both(sd, "deterministic", True), "deterministic"),
    ("codec", lambda sd: _both(sd, "momentum_codec", "none"), "momentum_codec"),
    ("codebook", lambda sd: _both(sd, "codebook", torch.zeros(256)), "invalid codebook"),
    ("no codebook", lambda sd: _both(sd, "codebook", None), "codes but no codebook"),
    ("initialized", lambda sd: sd["state"].__setitem__(1, {"period": 0}), "initialized_params"),
    (
        "rank local",
        lambda sd: _both(sd, "rank_local", {"version": 1}),
        "rank-local checkpoint topology differs",
    ),
    ("scope", lambda sd: _both(sd, "scope", {"identity": None}), "codebook scope"),
    (
        "group option",
        lambda sd: sd["param_groups"][0].__setitem__("eps", -1.0),
        "Invalid epsilon value",
    ),
    (
        "names",
        lambda sd: sd["param_groups"][0].__setitem__("param_names", ["a", "b"]),
        "param_names",
    ),
    ("entry type", lambda sd: sd["state"].__setitem__(0, [1]), "entry must be a dict"),
    (
        "entry key",
        lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(1)),
        "unknown state key 'exp_avg'",
    ),
    (
        "period",
        lambda sd: sd["state"][1].__setitem__("period", 5),
        "state does not match parameter",
    ),
    ("step bool", lambda sd: sd["state"][1].__setitem__("step", True), "'step' must be an int"),
    ("v_step", lambda sd: sd["state"][1].__setitem__("v_step", 99), "v_step"),
    (
        "codes dtype",
        lambda sd: sd["state"][1].__setitem__(
            "momentum_codes", sd["state"][1]["momentum_codes"].int()
        ),
        "uint8",
    ),
    (
        "scale negative",
        lambda sd: sd["state"][1].__setitem__(
            "momentum_scale", -sd["state"][1]["momentum_scale"] - 1
        ),
        ">= 0",
    ),
    (
        "v not finite",
        lambda sd: sd["state"][1].__setitem__("v_block", sd["state"][1]["v_block"] * float("nan")),
        "finite",
    ),
    (
        "row shape",
        lambda sd: sd["state"][0].__setitem__("v_row", torch.zeros(5)),
        "state does not match parameter",
    ),
    ("other codec", lambda sd: sd["state"][1].__setitem__("momentum", torch.zeros(1, 24)), "both"),
    (
        "no extras",
        lambda sd: [sd.pop("gefen"), *(g.pop("gefen") for g in sd["param_groups"])],
        "missing",
    ),
    ("positions", lambda sd: _both(sd, "initialized_params", [0, 1, 7]), "out of range"),
    ("codec entry", _other_codec_entry, "other momentum codec"),
    ("v_step zero", lambda sd: sd["state"][1].__setitem__("v_step", 0), "all zero"),
    (
        "groups not dicts",
        lambda sd: sd.__setitem__("param_groups", [1, 2]),
        "'param_groups' must be a list of dicts",
    ),
    ("global step negative", lambda sd: _both(sd, "global_step", -1), "global_step must be"),
    ("format float", lambda sd: _both(sd, "format_version", 1.0), "format_version must be 1"),
    ("step zero", lambda sd: sd["state"][1].__setitem__("step", 0), "'step' must be an int >= 1"),
    (
        "both families",
        lambda sd: sd["state"][1].update(v_row=torch.zeros(3), v_col=torch.zeros(8)),
        "exactly one second-moment family",
    ),
    (
        "initialized period zero",
        lambda sd: sd["state"][1].__setitem__("period", 0),
        "an initialized entry needs a period > 0",
    ),
    (
        "names not str",
        lambda sd: sd["param_groups"][0].__setitem__("param_names", [7]),
        "param_names must hold str",
    ),
    ("factored on 1-D", _factored_on_vector, "state does not match parameter"),
    # The entry is in the file without its counter: the hint blamed a rename.
    (
        "entry without step",
        lambda sd: sd["state"][1].pop("step"),
        r"param_groups\[1\]\[0\]'s entry in the file holds no 'step'",
    ),
    (
        "entry cut to its period",
        lambda sd: sd["state"].__setitem__(1, {"period": sd["state"][1]["period"]}),
        r"param_groups\[1\]\[0\]'s entry in the file holds no 'step'",
    ),
    # Named by position within the file ("entry 1"), unlike every other entry rule.
    (
        "step past global_step",
        lambda sd: sd["state"][1].__setitem__("step", 4),
        r"entry 1: 'step' 4 exceeds global_step 3 .param_groups\[1\]\[0\]: no run",
    ),
]


def _nan_momentum(sd) -> None:
    sd["state"][1]["momentum"] = sd["state"][1]["momentum"] * float("nan")


NONE_CODEC_REJECTIONS = [
    (
        "none codec with a codebook",
        lambda sd: _both(sd, "codebook", torch.linspace(-1, 1, 256)),
        "holds no codebook",
    ),
    ("dense momentum not finite", _nan_momentum, "'momentum' must be finite"),
]


@pytest.mark.parametrize(
    ("name", "mutator", "fragment"),
    NONE_CODEC_REJECTIONS,
    ids=[r[0] for r in NONE_CODEC_REJECTIONS],
)
def test_none_codec_rules_reject_without_change(name: str, mutator, fragment: str, rejects) -> None:
    source, _ = _trained(3, momentum_codec="none")
    sd = format1_state_dict(source, source.state_dict())
    mutator(sd)
    pristine = copy.deepcopy(sd)
    target, _ = _trained(2, momentum_codec="none")
    rejects(target, lambda: target.load_state_dict(sd), ValueError, "Gefen checkpoint: ")
    with pytest.raises(ValueError, match=fragment):
        target.load_state_dict(sd)
    _assert_same(sd, pristine)


@pytest.mark.parametrize(
    ("name", "mutator", "fragment"), REJECTIONS, ids=[r[0] for r in REJECTIONS]
)
def test_every_rule_rejects_without_change(name: str, mutator, fragment: str, rejects) -> None:
    sd = _corrupt(mutator)
    pristine = copy.deepcopy(sd)
    target, _ = _trained(2)
    fired: list[str] = []
    target.register_load_state_dict_post_hook(lambda opt: fired.append("post"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rejects(target, lambda: target.load_state_dict(sd), ValueError, "Gefen checkpoint: ")
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            target.load_state_dict(sd)
    assert fired == []
    _assert_same(sd, pristine)


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)


def test_rejected_last_entry_then_continuation_matches_control() -> None:
    bad = _corrupt(lambda sd: sd["state"][1].__setitem__("period", 5))
    runs = []
    for attempt in (False, True):
        optimizer, params = _trained(2)
        if attempt:
            with pytest.raises(ValueError, match="Gefen checkpoint"):
                optimizer.load_state_dict(bad)
        for seed in range(20, 23):
            _grads(params, seed)
            optimizer.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(x, y) for x, y in zip(*runs, strict=True))


@pytest.mark.parametrize("saved_factored", [True, False])
def test_family_migration_on_load(saved_factored: bool) -> None:
    optimizer, params = _trained(5, factored_v_2d=saved_factored)
    sd = optimizer.state_dict()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = Gefen(
        [{"params": [twin_params[0]]}, {"params": [twin_params[1]], "lr": 0.01}],
        factored_v_2d=not saved_factored,
    )
    sd["param_groups"][0]["factored_v_2d"] = not saved_factored
    with pytest.warns(UserWarning, match="second-moment family"):
        twin.load_state_dict(sd)
    entry = twin.state[twin_params[0]]
    assert entry["v_step"] == 5  # the statistics carry over (§8.4)
    assert entry["step"] == 5
    assert ("v_row" in entry) == (not saved_factored)
    for seed in range(3):
        _grads(twin_params, seed)
        twin.step()
    assert entry["step"] == 8
    assert entry["v_step"] == 8


def test_family_migration_at_step_when_group_edited() -> None:
    optimizer, params = _trained(2)
    optimizer.param_groups[0]["factored_v_2d"] = False
    _grads(params, 5)
    with pytest.warns(UserWarning, match="second moment"):
        optimizer.step()
    assert "v_block" in optimizer.state[params[0]]
    assert optimizer.state[params[0]]["v_step"] == 3


@pytest.mark.parametrize("factored_before", [True, False])
@pytest.mark.parametrize("how", ["edit", "load"])
def test_a_migrated_family_keeps_a_rows_step_within_lr_where_its_gradient_is_zero(
    factored_before: bool, how: str
) -> None:
    # The new family started at zero beside the kept momentum: an embedding row absent from
    # the next batch moved by lr * m / eps, about 1e4 at lr 0.01.
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(16, 8))
    optimizer = Gefen([table], lr=0.01, factored_v_2d=factored_before)
    for seed in range(5):
        rows = torch.randint(16, (4,), generator=torch.Generator().manual_seed(seed))
        table.grad = torch.zeros(16, 8).index_add_(0, rows, torch.randn(4, 8))
        optimizer.step()
    if how == "edit":
        optimizer.param_groups[0]["factored_v_2d"] = not factored_before
    else:
        saved = optimizer.state_dict()
        saved["param_groups"][0]["factored_v_2d"] = not factored_before
        optimizer = Gefen([table], lr=0.01, factored_v_2d=not factored_before)
        with pytest.warns(UserWarning, match="second-moment family"):
            optimizer.load_state_dict(saved)
    before = table.detach().clone()
    table.grad = torch.zeros(16, 8)
    table.grad[0] = torch.randn(8)  # every other row: zero gradient, momentum only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the edit's own migration warning
        optimizer.step()
    assert float((table.detach() - before).abs().max()) < 0.05  # a few times lr at most


def test_named_state_dict_replaces_names_with_warning() -> None:
    a, b = _params()
    optimizer = Gefen([("a", a), ("b", b)])
    sd = optimizer.state_dict()
    sd["param_groups"][0]["param_names"] = ["a", "B"]
    with pytest.warns(UserWarning, match="'B' replaces 'b'"):
        optimizer.load_state_dict(sd)
    assert optimizer.param_groups[0]["param_names"] == ["a", "B"]


def test_shape_changed_parameter_rejected_on_load_and_at_step() -> None:
    optimizer, params = _trained(2)
    sd = optimizer.state_dict()
    reshaped = [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(24))]
    other = Gefen([{"params": [reshaped[0]]}, {"params": [reshaped[1]], "lr": 0.01}])
    with pytest.raises(ValueError, match="state does not match parameter"):
        other.load_state_dict(sd)
    params[0].data = torch.randn(16, 12)
    params[0].grad = torch.randn(16, 12)
    with pytest.raises(RuntimeError, match="state does not match parameter"):
        optimizer.step()


def _frozen_warnings(optimizer, sd) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.load_state_dict(sd)
    return [str(w.message) for w in caught if "frozen parameter" in str(w.message)]


def test_frozen_parameter_listed_but_dropped_keeps_live_entry() -> None:
    optimizer, params = _trained(2)
    sd = optimizer.state_dict()
    del sd["state"][1]
    params[1].requires_grad_(False)
    live = optimizer.state[params[1]]
    messages = _frozen_warnings(optimizer, sd)
    assert len(messages) == 1
    assert "frozen parameter param_groups[1][0] (position 1;" in messages[0]
    assert torch.equal(optimizer.state[params[1]]["momentum_codes"], live["momentum_codes"])


def test_frozen_parameter_warning_names_the_parameter() -> None:
    params = _params()
    extra = torch.nn.Parameter(torch.randn(5, 3))
    optimizer = Gefen(
        [
            {"params": [("encoder.weight", params[0])]},
            {"params": [("head.weight", extra), ("head.bias", params[1])], "lr": 0.01},
        ]
    )
    for seed in range(2):
        _grads([*params, extra], seed)
        optimizer.step()
    sd = optimizer.state_dict()
    del sd["state"][2]
    params[1].requires_grad_(False)
    messages = _frozen_warnings(optimizer, sd)
    assert len(messages) == 1
    assert "frozen parameter 'head.bias' (position 2;" in messages[0]
    assert optimizer.state[params[1]]["step"] == 2


def test_state_nbytes() -> None:
    matrix = torch.nn.Parameter(torch.randn(256, 384))
    vector = torch.nn.Parameter(torch.randn(1000))
    optimizer = Gefen([matrix, vector])
    assert optimizer.state_nbytes() == 0
    matrix.grad, vector.grad = torch.randn(256, 384), torch.randn(1000)
    optimizer.step()
    p_matrix = optimizer.state[matrix]["period"]
    p_vector = optimizer.state[vector]["period"]
    n = 256 * 384
    expected_matrix = n + 4 * n // p_matrix + 4 * (256 + 384)
    expected_vector = 1000 + 8 * 1000 // p_vector
    assert optimizer.state_nbytes() == expected_matrix + expected_vector + 1024


@pytest.mark.parametrize("codec", ["codebook8", "codebook4"])
@pytest.mark.parametrize(
    ("edited", "error", "fragment"),
    [
        ("none", RuntimeError, "a group's codec cannot change once its state exists"),
        ("bogus", ValueError, "momentum_codec must be one of"),
    ],
)
def test_state_dict_refuses_a_codec_edited_after_its_state_exists(
    rejects, codec: str, edited: str, error: type, fragment: str
) -> None:
    """By the step's own rules and message; a codebook4 group's state_dict used to fail inside
    the build with a bare reshape error, and its step named a shape instead of the codec."""
    optimizer, _ = _trained(momentum_codec=codec)
    group = optimizer.param_groups[1]  # the vector's group

    def restore() -> None:
        group["momentum_codec"] = codec

    group["momentum_codec"] = edited
    rejects(optimizer, optimizer.state_dict, error, fragment, restore=restore)
    group["momentum_codec"] = edited
    rejects(optimizer, optimizer.step, error, fragment, restore=restore)
    optimizer.load_state_dict(optimizer.state_dict())


def _nan_codebook(sd) -> None:
    sd["gefen"]["codebook"][100] = float("nan")  # the group copies share this tensor
    for group in sd["param_groups"]:
        group["gefen"]["codebook"] = sd["gefen"]["codebook"]


def _format_version(value):
    def mutate(sd) -> None:
        for extras in (sd["gefen"], *(group["gefen"] for group in sd["param_groups"])):
            extras["format_version"] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (_nan_codebook, "codebook values must all be finite"),
        (_format_version(3), "format_version must be 1 or 2"),
        (_format_version(None), "format_version must be 1 or 2"),
    ],
    ids=["nan-codebook", "format-3", "format-none"],
)
def test_a_load_names_the_rule_the_file_breaks(rejects, mutate, fragment: str) -> None:
    """These used to be refused under another rule's name ("extras copies differ", "unknown
    extras key 'codebook_present'")."""
    optimizer, _ = _trained()
    broken = copy.deepcopy(optimizer.state_dict())
    mutate(broken)
    rejects(optimizer, lambda: optimizer.load_state_dict(broken), ValueError, fragment)


@pytest.mark.parametrize(("saved_codec", "steps"), [("codebook8", 0), ("none", 1)])
def test_a_load_into_another_codec_names_the_codec(rejects, saved_codec: str, steps: int) -> None:
    """Not the codebook slot's size, which depends on the codec the file was written with."""
    saved, _ = _trained(steps=steps, momentum_codec=saved_codec)
    optimizer, _ = _trained(momentum_codec="codebook4")
    sd = saved.state_dict()
    fragment = f"momentum_codec {saved_codec!r} differs from the live 'codebook4'"
    rejects(optimizer, lambda: optimizer.load_state_dict(sd), ValueError, fragment)


@pytest.mark.parametrize("step", [2**63, 2**64])
def test_a_global_step_beyond_64_bits_is_refused_by_name(step: int, rejects) -> None:
    """Such a step loaded, then the stochastic-rounding seed (64 bits) raised inside the next
    step's commit, and the optimizer latched."""
    optimizer, _ = _trained(stochastic_round=True)
    sd = optimizer.state_dict()
    for extras in (sd["gefen"], *(group["gefen"] for group in sd["param_groups"])):
        extras["global_step"] = step
    rejects(
        optimizer,
        lambda: optimizer.load_state_dict(sd),
        ValueError,
        f"Gefen checkpoint: global_step must be below 2**63, got {step}",
    )


def test_the_last_global_step_a_checkpoint_can_hold_is_not_stepped_past(rejects) -> None:
    """A step at global step 2**63 - 1 (loaded from a checkpoint) used to count to 2**63: the
    optimizer's next state_dict() could not be loaded by any optimizer. That step is refused by
    name, nothing changes, and a checkpoint with a smaller count loads and trains."""
    optimizer, params = _trained()
    earlier = copy.deepcopy(optimizer.state_dict())
    sd = copy.deepcopy(earlier)
    for extras in (sd["gefen"], *(group["gefen"] for group in sd["param_groups"])):
        extras["global_step"] = 2**63 - 2
    optimizer.load_state_dict(sd)
    _grads(params, 7)
    optimizer.step()  # to the last count: its checkpoint still loads
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert optimizer.global_step == 2**63 - 1
    _grads(params, 8)
    rejects(
        optimizer,
        optimizer.step,
        RuntimeError,
        "Gefen: global_step is 2**63 - 1, the last a checkpoint can hold",
        restore=lambda: optimizer.load_state_dict(earlier),
    )


@pytest.mark.parametrize("codec", ["codebook8", "none"])
def test_a_load_frees_the_state_it_replaces_before_the_next_step(codec: str) -> None:
    # The steady step's caches (the plan, the idle learning, the entry signatures) held every
    # replaced entry until the next successful step: two copies of the state (+4 B/param with
    # "none") through the forward and backward after a rollback, for good if no step followed.
    import gc
    import weakref

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))]
    optimizer = Gefen(params, lr=1e-3, momentum_codec=codec)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    replaced = [
        weakref.ref(value)
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    ]
    optimizer.load_state_dict(saved)
    del saved
    gc.collect()
    assert [ref for ref in replaced if ref() is not None] == []
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    assert optimizer.global_step == 4
