"""GefenMuon's constructor, option rules, groups, names and the step-time re-validation
(docs/muon.md §2, §3; §12 option, group and naming items). One process, plain tensors."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot
from gefen.muon import GefenMuon
from gefen.muon.testing import OPTION_KEYS

STANDARD = (3.4445, -4.7750, 2.0315)
TUNED3_LENGTH = 3
TUNED4_LENGTH = 4
DEFAULT_KEYS = OPTION_KEYS
MIX_MESSAGE = (
    "GefenMuon cannot mix sharded_mode 'approx' with 'exact' or 'distributed' in one optimizer"
)
TWO_D_MESSAGE = "GefenMuon only supports 2D parameters whereas we found a parameter with size: "

# -- helpers ------------------------------------------------------------------------------------


def _matrix(*shape: int, seed: int = 0) -> torch.nn.Parameter:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=generator))


def _params() -> list[torch.nn.Parameter]:
    return [_matrix(6, 4, seed=1), _matrix(3, 5, seed=2)]


def _trains(optimizer: GefenMuon) -> None:
    """The optimizer still takes a normal step that moves its parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    generator = torch.Generator().manual_seed(123)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    before = [p.detach().clone() for p in params]
    step = optimizer.global_step
    optimizer.step()
    assert optimizer.global_step == step + 1
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
    for p in params:
        assert "step" in optimizer.state[p]


def _rejects(
    optimizer: GefenMuon,
    action: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    *,
    restore: Callable[[], Any] | None = None,
) -> pytest.ExceptionInfo[Any]:
    """``action`` raises ``error`` matching ``fragment``, the deep snapshot is unchanged, and
    the optimizer trains afterwards (after ``restore`` undoes the bad input)."""
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        action()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    if restore is not None:
        restore()
    _trains(optimizer)
    return info


def _param_facts(params: list[torch.nn.Parameter]) -> list[tuple[Any, ...]]:
    return [(p.detach().clone(), p.grad, p._version, p.requires_grad) for p in params]


def _assert_params_unchanged(params: list[torch.nn.Parameter], facts: list[Any]) -> None:
    for p, (value, grad, version, requires_grad) in zip(params, facts, strict=True):
        assert torch.equal(p.detach(), value)
        assert p.grad is grad
        assert p._version == version
        assert p.requires_grad == requires_grad


def _constructor_rejects(
    build: Callable[[list[torch.nn.Parameter]], Any],
    error: type[BaseException],
    fragment: str,
) -> pytest.ExceptionInfo[Any]:
    """The constructor raises, the parameters are untouched, and a valid optimizer over the
    same parameters trains."""
    params = _params()
    facts = _param_facts(params)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        build(params)
    _assert_params_unchanged(params, facts)
    _trains(GefenMuon(params))
    return info


def _iterator(params: list[torch.nn.Parameter]) -> Iterator[torch.nn.Parameter]:
    yield from params


# -- option rules (§2) --------------------------------------------------------------------------

HUNDRED = [STANDARD] * 100
# Options any group may override: rejected by the constructor, by a group dict at construction,
# by add_param_group and (where editable) by the step preflight.
GROUP_CASES: list[tuple[dict[str, Any], type[BaseException], str]] = [
    ({"momentum": 1.0}, ValueError, "momentum"),
    ({"momentum": -0.5}, ValueError, "momentum"),
    ({"momentum": math.nan}, ValueError, "momentum"),
    ({"lr": -1.0}, ValueError, "Invalid learning rate"),
    ({"lr": math.nan}, ValueError, "Invalid learning rate"),
    ({"lr": math.inf}, ValueError, "Invalid learning rate"),
    ({"lr": True}, ValueError, "Invalid learning rate"),
    ({"lr": torch.tensor([0.1, 0.2])}, ValueError, "Tensor lr must be 1-element"),
    ({"lr": torch.tensor(math.nan)}, ValueError, "Invalid learning rate"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"weight_decay": math.nan}, ValueError, "weight_decay"),
    ({"weight_decay": math.inf}, ValueError, "weight_decay"),
    ({"eps": 0.0}, ValueError, "eps"),
    ({"eps": -1.0}, ValueError, "eps"),
    ({"eps": math.nan}, ValueError, "eps"),
    ({"eps": math.inf}, ValueError, "eps"),
    ({"eps": -math.inf}, ValueError, "eps"),
    ({"normuon_eps": 0.0}, ValueError, "normuon_eps"),
    ({"normuon_eps": -1.0}, ValueError, "normuon_eps"),
    ({"normuon_eps": math.nan}, ValueError, "normuon_eps"),
    ({"normuon_eps": math.inf}, ValueError, "normuon_eps"),
    ({"normuon_eps": -math.inf}, ValueError, "normuon_eps"),
    ({"normuon_beta2": 1.0}, ValueError, "normuon_beta2"),
    ({"normuon_beta2": -0.1}, ValueError, "normuon_beta2"),
    ({"adjust_lr_fn": "foo"}, ValueError, "adjust_lr_fn"),
    ({"adjust_lr_fn": "Original"}, ValueError, "adjust_lr_fn"),
    ({"sharded_mode": "foo"}, ValueError, "sharded_mode"),
    ({"sharded_mode": "EXACT"}, ValueError, "sharded_mode"),
    ({"ns_schedule": "bogus"}, ValueError, "Unknown ns_schedule"),
    ({"ns_schedule": []}, ValueError, "ns_schedule"),
    ({"ns_schedule": [(1.0, 2.0)]}, ValueError, "ns_schedule"),
    ({"ns_schedule": [(1.0, 2.0, 3.0, 4.0)]}, ValueError, "ns_schedule"),
    ({"ns_schedule": [STANDARD, (1.0, 2.0)]}, ValueError, "ns_schedule"),
    ({"ns_schedule": HUNDRED}, ValueError, "ns_schedule"),
    ({"ns_schedule": [(math.nan, 1.0, 1.0)]}, ValueError, "ns_schedule"),
    ({"ns_steps": 0}, ValueError, "ns_steps"),
    ({"ns_steps": -1}, ValueError, "ns_steps"),
    ({"ns_steps": 100}, ValueError, "ns_steps"),
    ({"ns_steps": True}, ValueError, "ns_steps"),
    ({"ns_steps": 0, "ns_schedule": "standard"}, ValueError, "ns_steps"),
    ({"ns_steps": -1, "ns_schedule": "standard"}, ValueError, "ns_steps"),
    ({"ns_steps": 100, "ns_schedule": "standard"}, ValueError, "ns_steps"),
    ({"ns_steps": True, "ns_schedule": "tuned3"}, ValueError, "ns_steps"),
    ({"ns_steps": 5.0}, ValueError, "ns_steps"),
    ({"ns_steps": 5.0, "ns_schedule": "tuned4"}, ValueError, "ns_steps"),
    ({"ns_schedule": [(True, 1.0, 1.0)]}, ValueError, "ns_schedule"),
    ({"ns_coefficients": (1.0, 2.0)}, ValueError, "ns_coefficients"),
    ({"ns_coefficients": (True, 1.0, 1.0)}, ValueError, "ns_coefficients"),
    ({"ns_coefficients": (math.inf, 1.0, 1.0)}, ValueError, "ns_coefficients"),
    (
        {"ns_schedule": "tuned3", "ns_coefficients": (3.0, -4.0, 2.0)},
        ValueError,
        "pass either ns_schedule or ns_coefficients, not both",
    ),
    (
        {"ns_schedule": [STANDARD], "ns_coefficients": (3.0, -4.0, 2.0)},
        ValueError,
        "pass either ns_schedule or ns_coefficients, not both",
    ),
    ({"nesterov": 1}, TypeError, "nesterov must be a bool"),
    ({"normuon": "yes"}, TypeError, "normuon must be a bool"),
    # Per group since torch.optim's convention (every option may be overridden in a group):
    ({"momentum_codec": "int4"}, ValueError, "momentum_codec"),
    ({"deterministic": 1}, TypeError, "deterministic must be a bool"),
    ({"deterministic": None}, TypeError, "deterministic must be a bool"),
    ({"check_finite": "yes"}, TypeError, "check_finite must be a bool"),
    ({"check_finite": 0}, TypeError, "check_finite must be a bool"),
    ({"stochastic_round": 0}, TypeError, "stochastic_round must be a bool"),
    ({"fused": "yes"}, TypeError, "fused"),
    ({"fused": 1}, TypeError, "fused must be None, True or False"),
    ({"momentum_codec": "none", "stochastic_round": True}, ValueError, "momentum_codec"),
]


def _case_id(case: tuple[dict[str, Any], type, str]) -> str:
    return ",".join(f"{k}={v!r}"[:40] for k, v in case[0].items())


@pytest.mark.parametrize("case", GROUP_CASES, ids=_case_id)
def test_constructor_rejects_before_registering_anything(
    case: tuple[dict[str, Any], type[BaseException], str],
) -> None:
    options, error, fragment = case
    params = _params()
    facts = _param_facts(params)
    source = _iterator(params)
    with pytest.raises(error, match=re.escape(fragment)):
        GefenMuon(source, **options)
    # The option rules run before registration: the parameter iterator was never consumed.
    assert next(source) is params[0]
    _assert_params_unchanged(params, facts)
    _trains(GefenMuon(params))


@pytest.mark.parametrize("case", GROUP_CASES, ids=_case_id)
def test_group_dict_at_construction_is_rejected(
    case: tuple[dict[str, Any], type[BaseException], str],
) -> None:
    options, error, fragment = case
    _constructor_rejects(
        lambda ps: GefenMuon([{"params": [ps[0]]}, {"params": [ps[1]], **options}]),
        error,
        fragment,
    )


@pytest.mark.parametrize("case", GROUP_CASES, ids=_case_id)
def test_add_param_group_rejects_atomically(
    case: tuple[dict[str, Any], type[BaseException], str],
) -> None:
    options, error, fragment = case
    first, second = _params()
    optimizer = GefenMuon([("first", first)])
    group = {"params": [("second", second)], **options}
    given = dict(group)
    _rejects(optimizer, lambda: optimizer.add_param_group(group), error, fragment)
    assert len(optimizer.param_groups) == 1
    assert second not in optimizer.state
    assert optimizer.param_groups[0]["param_names"] == ["first"]
    assert group.keys() == given.keys()  # the caller's dict is untouched
    assert all(group[k] is given[k] for k in given)


def test_fused_true_is_accepted_and_compiles_nothing_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fused=True is checked where kernels are selected, in the step's local preflight (§2,
    docs/core.md §11): construction neither compiles nor rejects it."""
    import gefen.core.fused as fused_module

    def never(device_type: str) -> Any:
        raise AssertionError("compiled at construction")

    monkeypatch.setattr(fused_module, "fused_momentum", never)
    params = _params()
    for fused in (True, None, False):
        optimizer = GefenMuon(params, fused=fused)
        assert optimizer.defaults["fused"] is fused
        assert optimizer.param_groups[0]["fused"] is fused
    monkeypatch.undo()
    for fused in (None, False):  # None is the eager path in this suite (conftest)
        optimizer = GefenMuon(params, fused=fused)
        _trains(optimizer)


def test_valid_boundaries_are_accepted() -> None:
    optimizer = GefenMuon(
        _params(),
        lr=0.0,
        weight_decay=0.0,
        momentum=0.0,
        normuon_beta2=0.0,
        ns_steps=99,
        ns_schedule="standard",
    )
    assert optimizer.defaults["ns_steps"] == 99
    GefenMuon(_params(), lr=torch.tensor(0.01), ns_steps=1)
    # Passing the default triple explicitly is not a conflict with a schedule.
    optimizer = GefenMuon(_params(), ns_schedule="tuned3", ns_coefficients=list(STANDARD))
    assert optimizer.defaults["ns_steps"] == TUNED3_LENGTH
    _trains(optimizer)


# -- ns_steps and schedules (§2, §3) ------------------------------------------------------------


def test_tuned3_with_the_default_ns_steps_stores_three() -> None:
    optimizer = GefenMuon(_params(), ns_schedule="tuned3")
    assert optimizer.defaults["ns_steps"] == TUNED3_LENGTH
    assert optimizer.param_groups[0]["ns_steps"] == TUNED3_LENGTH
    _trains(optimizer)


@pytest.mark.parametrize("ns_steps", [0, -1, 5, 100])
@pytest.mark.parametrize(
    ("schedule", "length"),
    [
        ("tuned3", TUNED3_LENGTH),
        ("tuned4", TUNED4_LENGTH),
        ([STANDARD, (3.0, -4.0, 2.0)], 2),
        ([(3.0, -4.0, 2.0)] * 7, 7),
    ],
    ids=["tuned3", "tuned4", "list2", "list7"],
)
def test_fixed_length_schedules_accept_any_int_and_store_their_length(
    schedule: Any, length: int, ns_steps: int
) -> None:
    optimizer = GefenMuon(_params()[:1], ns_schedule=schedule, ns_steps=ns_steps)
    assert optimizer.defaults["ns_steps"] == length
    assert optimizer.param_groups[0]["ns_steps"] == length
    extra = _matrix(2, 3, seed=9)
    group = {"params": [extra], "ns_schedule": schedule, "ns_steps": ns_steps}
    optimizer.add_param_group(group)
    assert optimizer.param_groups[1] is group
    assert group["ns_steps"] == length
    _trains(optimizer)


@pytest.mark.parametrize("schedule", [None, "standard"])
def test_fixed_path_keeps_the_given_ns_steps(schedule: str | None) -> None:
    optimizer = GefenMuon(_params(), ns_schedule=schedule, ns_steps=7)
    assert optimizer.defaults["ns_steps"] == 7
    optimizer.add_param_group({"params": [_matrix(2, 2, seed=5)], "ns_steps": 2})
    assert optimizer.param_groups[1]["ns_steps"] == 2
    _trains(optimizer)


def test_a_group_schedule_conflicts_with_inherited_non_default_coefficients() -> None:
    first, second = _params()
    optimizer = GefenMuon([first], ns_coefficients=(3.0, -4.0, 2.0))
    _rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": [second], "ns_schedule": "tuned3"}),
        ValueError,
        "pass either ns_schedule or ns_coefficients, not both",
    )
    assert len(optimizer.param_groups) == 1


# -- parameters (§2) ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5,), (), (2, 3, 4)], ids=["1d", "0d", "3d"])
def test_non_2d_parameter_is_rejected(shape: tuple[int, ...]) -> None:
    bad = torch.nn.Parameter(torch.zeros(shape))
    info = _constructor_rejects(lambda ps: GefenMuon([*ps, bad]), ValueError, TWO_D_MESSAGE)
    assert str(info.value) == TWO_D_MESSAGE + str(bad.size())


def test_add_param_group_with_a_valid_and_a_1d_parameter_adds_nothing() -> None:
    first, second = _params()
    optimizer = GefenMuon([("Encoder.Weight", first)])
    flat = torch.nn.Parameter(torch.zeros(7))
    group = {"params": [("Second.W", second), ("bias", flat)], "lr": 0.5}
    info = _rejects(optimizer, lambda: optimizer.add_param_group(group), ValueError, TWO_D_MESSAGE)
    assert str(info.value) == TWO_D_MESSAGE + "torch.Size([7])"
    assert len(optimizer.param_groups) == 1
    assert list(optimizer.state) == [first]
    assert second not in optimizer.state
    assert flat not in optimizer.state
    assert optimizer.param_groups[0]["param_names"] == ["Encoder.Weight"]
    assert isinstance(group["params"][0], tuple)  # the caller's dict is untouched
    assert "ns_steps" not in group


def test_complex_and_non_tensor_parameters() -> None:
    bad = torch.zeros(3, 3, dtype=torch.complex64, requires_grad=True)
    _constructor_rejects(lambda ps: GefenMuon([*ps, bad]), ValueError, "complex")
    _constructor_rejects(lambda ps: GefenMuon([*ps, 1.0]), TypeError, "Tensor")
    first, second = _params()
    optimizer = GefenMuon([first])
    _rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": [second, "w"]}),
        TypeError,
        "Tensor",
    )


def test_bare_tensor_set_and_empty_list() -> None:
    _constructor_rejects(lambda ps: GefenMuon(ps[0]), TypeError, "params argument")
    _constructor_rejects(lambda ps: GefenMuon(set(ps)), TypeError, "set")
    _constructor_rejects(lambda ps: GefenMuon([]), ValueError, "empty parameter list")
    first, second = _params()
    optimizer = GefenMuon([first])
    _rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": {second}}),
        TypeError,
        "ordered collections",
    )
    _rejects(
        optimizer,
        lambda: optimizer.add_param_group([second]),  # type: ignore[arg-type]
        TypeError,
        "param_group must be a dict",
    )


def test_duplicate_parameter_is_rejected() -> None:
    first, second = _params()
    _constructor_rejects(
        lambda ps: GefenMuon([{"params": [ps[0]]}, {"params": [ps[1], ps[0]]}]),
        ValueError,
        "more than one parameter group",
    )
    optimizer = GefenMuon([first])
    _rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": [second, first]}),
        ValueError,
        "more than one parameter group",
    )
    assert second not in optimizer.state


# -- sharded-mode mixing (§3) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("default_mode", "group_mode"),
    [
        ("exact", "approx"),
        ("distributed", "approx"),
        ("approx", "exact"),
        ("approx", "distributed"),
    ],
)
def test_mixing_approx_with_exact_or_distributed_is_rejected(
    default_mode: str, group_mode: str
) -> None:
    _constructor_rejects(
        lambda ps: GefenMuon(
            [{"params": [ps[0]]}, {"params": [ps[1]], "sharded_mode": group_mode}],
            sharded_mode=default_mode,
        ),
        ValueError,
        MIX_MESSAGE,
    )
    first, second = _params()
    optimizer = GefenMuon([first], sharded_mode=default_mode)
    _rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": [second], "sharded_mode": group_mode}),
        ValueError,
        MIX_MESSAGE,
    )
    assert len(optimizer.param_groups) == 1
    assert second not in optimizer.state


def test_exact_and_distributed_groups_may_be_mixed() -> None:
    first, second = _params()
    third = _matrix(4, 4, seed=3)
    optimizer = GefenMuon(
        [{"params": [first]}, {"params": [second], "sharded_mode": "distributed"}]
    )
    optimizer.add_param_group({"params": [third], "sharded_mode": "exact"})
    assert [g["sharded_mode"] for g in optimizer.param_groups] == ["exact", "distributed", "exact"]
    _trains(optimizer)


# -- groups, defaults, names, placeholder (§3) --------------------------------------------------


def test_defaults_hold_exactly_the_18_keys_and_every_group_holds_them() -> None:
    optimizer = GefenMuon(_params())
    assert set(optimizer.defaults) == DEFAULT_KEYS
    assert len(optimizer.defaults) == len(DEFAULT_KEYS) == 18
    extra = _matrix(3, 3, seed=4)
    group = {"params": [extra]}
    optimizer.add_param_group(group)
    assert optimizer.param_groups[1] is group
    for g in optimizer.param_groups:
        assert set(g) == DEFAULT_KEYS | {"params"}
        for key in DEFAULT_KEYS:
            assert g[key] == optimizer.defaults[key]
    assert optimizer.state[extra] == {"period": 0}
    _trains(optimizer)


def test_defaults_match_the_torch_muon_signature_values() -> None:
    optimizer = GefenMuon(_params())
    expected = {
        "lr": 1e-3,
        "weight_decay": 0.1,
        "momentum": 0.95,
        "nesterov": True,
        "ns_coefficients": STANDARD,
        "eps": 1e-7,
        "ns_steps": 5,
        "adjust_lr_fn": None,
        "ns_schedule": None,
        "momentum_codec": "codebook8",
        "sharded_mode": "exact",
        "normuon": False,
        "normuon_beta2": 0.95,
        "normuon_eps": 1e-8,
        "fused": None,
        "stochastic_round": False,
        "deterministic": False,
        "check_finite": True,
    }
    assert {k: optimizer.defaults[k] for k in expected} == expected


def test_groups_are_kept_as_given_and_may_override_group_options() -> None:
    params = [_matrix(4, 3, seed=s) for s in range(4)]
    groups = [
        {"params": params[:2]},
        {"params": [params[2]], "lr": 0.02, "normuon": True, "ns_schedule": "tuned4"},
        {"params": [params[3]], "sharded_mode": "distributed", "nesterov": False},
    ]
    optimizer = GefenMuon(groups, lr=0.01)
    assert len(optimizer.param_groups) == 3
    assert all(a is b for a, b in zip(optimizer.param_groups, groups, strict=True))
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 1, 1]
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert optimizer.param_groups[1]["lr"] == 0.02
    assert optimizer.param_groups[1]["ns_steps"] == TUNED4_LENGTH
    assert optimizer.param_groups[0]["ns_steps"] == 5
    _trains(optimizer)
    assert "normuon_v" in optimizer.state[params[2]]
    assert "normuon_v" not in optimizer.state[params[0]]


def test_names_are_kept_as_given_through_torch_param_names() -> None:
    params = [_matrix(3, 4, seed=s) for s in range(4)]
    groups = [
        {"params": [("Layer.Weight", params[0]), ("layer.weight", params[1])]},
        {"params": [("X", params[2])], "lr": 0.1},
    ]
    optimizer = GefenMuon(groups)
    assert optimizer.param_groups[0]["param_names"] == ["Layer.Weight", "layer.weight"]
    assert optimizer.param_groups[1]["param_names"] == ["X"]
    assert optimizer.param_groups[0]["params"][0] is params[0]
    optimizer.add_param_group({"params": [("MLP.Up_Proj", params[3])]})
    assert optimizer.param_groups[2]["param_names"] == ["MLP.Up_Proj"]
    saved = optimizer.state_dict()["param_groups"]
    assert [g["param_names"] for g in saved] == [
        ["Layer.Weight", "layer.weight"],
        ["X"],
        ["MLP.Up_Proj"],
    ]
    with pytest.raises(ValueError, match="with/without names"):
        optimizer.add_param_group({"params": [_matrix(2, 2)]})
    _trains(optimizer)


def test_named_parameters_of_a_module() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("Up", torch.nn.Linear(4, 8, bias=False))
    model.add_module("Down", torch.nn.Linear(8, 4, bias=False))
    optimizer = GefenMuon(model.named_parameters())
    assert optimizer.param_groups[0]["param_names"] == ["Up.weight", "Down.weight"]
    _trains(optimizer)


def test_mixing_named_and_unnamed_raises_torch_error() -> None:
    _constructor_rejects(
        lambda ps: GefenMuon([("a", ps[0]), ps[1]]), ValueError, "with/without names"
    )


def test_every_registered_parameter_gets_the_pristine_placeholder() -> None:
    params = [_matrix(3, 4, seed=s) for s in range(4)]
    optimizer = GefenMuon([{"params": params[:2]}, {"params": [params[2]]}])
    optimizer.add_param_group({"params": [params[3]]})
    assert len(optimizer.state) == 4
    for p in params:
        entry = optimizer.state[p]
        assert entry == {"period": 0}
        assert type(entry["period"]) is int
    # An untouched parameter keeps it across a step; stepped ones never hold strings.
    for p in params[:3]:
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer.state[params[3]] == {"period": 0}
    for p in params[:3]:
        assert optimizer.state[p]["step"] == 1
        assert not any(isinstance(v, str) for v in optimizer.state[p].values())


# -- step-time re-validation (§2: "an invalid edit ... raises the same errors") ---------------

EDIT_CASES: list[tuple[str, Any, type[BaseException], str]] = [
    ("momentum", 1.5, ValueError, "momentum"),
    ("momentum", -0.5, ValueError, "momentum"),
    ("sharded_mode", "foo", ValueError, "sharded_mode"),
    ("lr", -1.0, ValueError, "Invalid learning rate"),
    ("weight_decay", math.nan, ValueError, "weight_decay"),
    ("eps", 0.0, ValueError, "eps"),
    ("normuon_eps", math.inf, ValueError, "normuon_eps"),
    ("normuon_beta2", 1.0, ValueError, "normuon_beta2"),
    ("ns_steps", 0, ValueError, "ns_steps"),
    ("ns_schedule", "bogus", ValueError, "Unknown ns_schedule"),
    ("adjust_lr_fn", "foo", ValueError, "adjust_lr_fn"),
    ("ns_coefficients", (1.0, 2.0), ValueError, "ns_coefficients"),
    ("nesterov", 1, TypeError, "nesterov must be a bool"),
    ("momentum_codec", "int4", ValueError, "momentum_codec must be one of"),
    ("fused", "yes", TypeError, "fused must be None, True or False"),
    ("deterministic", 1, TypeError, "deterministic must be a bool"),
    ("check_finite", None, TypeError, "check_finite must be a bool"),
    ("stochastic_round", 0, TypeError, "stochastic_round must be a bool"),
]


@pytest.mark.parametrize("warm", [False, True], ids=["first-step", "later"])
@pytest.mark.parametrize(
    ("key", "value", "error", "fragment"), EDIT_CASES, ids=[f"{c[0]}={c[1]!r}" for c in EDIT_CASES]
)
def test_invalid_group_edit_is_caught_by_the_step_preflight(
    key: str, value: Any, error: type[BaseException], fragment: str, warm: bool
) -> None:
    first, second = _params()
    optimizer = GefenMuon([{"params": [first]}, {"params": [second], "lr": 0.02}])
    if warm:
        _trains(optimizer)
        assert optimizer.codebook is not None
    group = optimizer.param_groups[1]
    original = group[key]
    for p in (first, second):
        p.grad = torch.randn_like(p)
    group[key] = value

    def restore() -> None:
        group[key] = original

    # The rank-local composite member rejects it too, without mutating anything (§6).
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(error, match=re.escape(fragment)):
        optimizer.validate_step_inputs(amp_present=False)
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    _rejects(optimizer, optimizer.step, error, fragment, restore=restore)


def test_a_group_edited_into_a_mode_mix_is_caught_by_the_step_preflight() -> None:
    first, second = _params()
    optimizer = GefenMuon([{"params": [first]}, {"params": [second]}])
    _trains(optimizer)
    group = optimizer.param_groups[1]
    for p in (first, second):
        p.grad = torch.randn_like(p)
    group["sharded_mode"] = "approx"

    def restore() -> None:
        group["sharded_mode"] = "exact"

    _rejects(optimizer, optimizer.step, ValueError, MIX_MESSAGE, restore=restore)


def test_a_schedule_edited_without_its_step_count_is_refused() -> None:
    # The edit ran three iterations while the group and its checkpoints said ns_steps=5.
    first, second = _params()
    optimizer = GefenMuon([first, second])
    _trains(optimizer)
    group = optimizer.param_groups[0]
    group["ns_schedule"] = "tuned3"

    def restore() -> None:
        group["ns_steps"] = 3  # both edited: the schedule runs, the group says so

    fragment = "param_groups[0]: ns_steps is 5 but ns_schedule 'tuned3' runs 3 steps"
    _rejects(optimizer, optimizer.step, ValueError, fragment, restore=restore)
    assert optimizer.state_dict()["param_groups"][0]["ns_steps"] == 3


def test_a_mode_edited_once_state_exists_is_refused() -> None:
    # Across ranks, distributed state lives on a matrix's owner alone and exact state on every
    # rank: the edit stepped from missing or stale momentum (tests at world 2). A pristine
    # group may still change its mode.
    first, second = _params()
    optimizer = GefenMuon([{"params": [first]}, {"params": [second]}])
    optimizer.param_groups[1]["sharded_mode"] = "distributed"
    _trains(optimizer)
    group = optimizer.param_groups[0]
    group["sharded_mode"] = "distributed"

    def restore() -> None:
        group["sharded_mode"] = "exact"

    fragment = "the group's sharded_mode changed from 'exact' to 'distributed'"
    _rejects(optimizer, optimizer.step, RuntimeError, fragment, restore=restore)


def test_a_valid_group_edit_is_honoured_at_the_next_step() -> None:
    first, second = _params()
    optimizer = GefenMuon([first, second], weight_decay=0.0)
    _trains(optimizer)
    for p in (first, second):
        p.grad = torch.zeros_like(p)
    optimizer.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in (first, second)]
    optimizer.step()
    assert optimizer.global_step == 2
    assert all(torch.equal(b, p) for b, p in zip(before, (first, second), strict=True))


def _numpy_scalar_trajectory(kind: Callable[[float], Any]) -> torch.Tensor:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 6))
    optimizer = GefenMuon(
        [p], lr=kind(0.02), momentum=kind(0.9), weight_decay=kind(0.1), eps=kind(1e-7)
    )
    for step in range(4):
        p.grad = torch.sin(torch.arange(48.0).reshape(8, 6) + step)
        optimizer.step()
        optimizer.param_groups[0]["lr"] = kind(0.02 / (step + 2))
    return p.detach().clone()


def test_numpy_scalar_hyperparameters_train_as_their_float_values() -> None:
    import numpy as np

    as_float = _numpy_scalar_trajectory(lambda value: float(np.float32(value)))
    as_numpy = _numpy_scalar_trajectory(np.float32)
    assert torch.equal(as_float, as_numpy)


def test_a_numpy_bool_is_not_a_momentum() -> None:
    import numpy as np

    with pytest.raises(ValueError, match="Invalid momentum value"):
        GefenMuon([torch.nn.Parameter(torch.randn(4, 4))], momentum=np.bool_(False))


@pytest.mark.parametrize("flag", ["maximize", "capturable", "differentiable"])
def test_a_torch_flag_set_in_a_group_is_refused_by_name_not_ignored(flag: str) -> None:
    message = f"{flag}=True is not supported"
    with pytest.raises(ValueError, match=message):
        GefenMuon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], flag: True}])
    param = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = GefenMuon([param])
    param.grad = torch.randn(4, 4)
    optimizer.step()
    optimizer.param_groups[0][flag] = True
    param.grad = torch.randn(4, 4)
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    value = param.detach().clone()
    with pytest.raises(ValueError, match=message):
        optimizer.step()
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert torch.equal(value, param.detach())
    del optimizer.param_groups[0][flag]
    optimizer.step()
    assert not torch.equal(value, param.detach())


@pytest.mark.parametrize("absent", ["none", "zeros"])
def test_an_unquantized_group_steps_while_the_codebook_group_has_no_gradient(absent: str) -> None:
    """docs/muon.md §3: a ``momentum_codec="none"`` group steps as a GefenMuon over it alone.
    While the codebook8 group had no gradient (or an all-zero one), the whole step was the
    pre-initialization no-op, so the unquantized group silently never moved."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 12))
    b = torch.nn.Parameter(torch.randn(8, 12))
    alone = torch.nn.Parameter(a.detach().clone())
    mixed = GefenMuon([{"params": [a], "momentum_codec": "none"}, {"params": [b]}], lr=0.02)
    reference = GefenMuon([alone], lr=0.02, momentum_codec="none")
    start = b.detach().clone()
    for _ in range(3):
        alone.grad = torch.randn(8, 12)
        a.grad = alone.grad.clone()
        b.grad = None if absent == "none" else torch.zeros(8, 12)
        mixed.step()
        reference.step()
        assert torch.equal(a, alone)
    assert torch.equal(b, start)
    assert mixed.codebook is None
    assert mixed.state[b] == {"period": 0}
    b.grad = torch.randn(8, 12)  # its first gradient: the codebook is learned, b moves
    a.grad = torch.randn(8, 12)
    mixed.step()
    assert mixed.codebook is not None
    assert not torch.equal(b, start)
