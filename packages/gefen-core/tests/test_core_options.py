"""Constructor, options, groups and names (docs/core.md §2; §12 #1–#11)."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import numpy as np
import pytest
import torch

from gefen.core import Gefen

GROUP_CASES = [
    ({"lr": torch.tensor([0.1, 0.2])}, ValueError, "Tensor lr must be 1-element"),
    ({"lr": -1.0}, ValueError, "Invalid learning rate"),
    ({"lr": math.nan}, ValueError, "Invalid learning rate"),
    ({"lr": math.inf}, ValueError, "Invalid learning rate"),
    ({"lr": True}, ValueError, "Invalid learning rate"),
    ({"betas": (1.0, 0.9)}, ValueError, "Invalid beta parameter at index 0"),
    ({"betas": (0.9, math.nan)}, ValueError, "Invalid beta parameter at index 1"),
    ({"betas": (0.9, -0.1)}, ValueError, "Invalid beta parameter at index 1"),
    ({"betas": (0.9,)}, ValueError, "Invalid beta parameter"),
    ({"eps": 0.0}, ValueError, "Invalid epsilon value"),
    ({"eps": math.inf}, ValueError, "Invalid epsilon value"),
    ({"eps": 1e-38}, ValueError, "Invalid epsilon value: 1e-38"),
    # eps·(1 − β1) overflowed the first step's 1/(eps·bc1) where a block's v is 0: NaN
    ({"eps": 1e-30, "betas": (1 - 1e-9, 0.999)}, ValueError, "below 4e-39: the first step"),
    ({"weight_decay": -0.1}, ValueError, "Invalid weight_decay value"),
    ({"weight_decay": math.nan}, ValueError, "Invalid weight_decay value"),
    ({"factored_v_2d": 1}, TypeError, "factored_v_2d must be a bool"),
    ({"factored_floor": 1.0}, TypeError, "factored_floor must be a bool"),
    ({"nesterov": 1}, TypeError, "nesterov must be a bool"),
    ({"force_1d_period_one": "yes"}, TypeError, "force_1d_period_one must be a bool"),
    ({"force_2d_period_one": None}, TypeError, "force_2d_period_one must be a bool"),
    # Per-group since torch.optim's convention (every option may be overridden in a group):
    ({"deterministic": 1}, TypeError, "deterministic must be a bool"),
    ({"check_finite": "yes"}, TypeError, "check_finite must be a bool"),
    ({"stochastic_round": 0}, TypeError, "stochastic_round must be a bool"),
    ({"momentum_codec": "int4"}, ValueError, "momentum_codec must be one of"),
    # Saved as a numpy.str_, which torch.load(weights_only=True) refuses to read back.
    ({"momentum_codec": np.str_("codebook8")}, ValueError, "momentum_codec must be one of"),
    ({"momentum_codec": "none", "stochastic_round": True}, ValueError, "requires momentum_codec"),
    ({"fused": "yes"}, TypeError, "fused"),
]
WIDE_CASES = [
    ({"codebook_refresh_every": True}, TypeError, "codebook_refresh_every"),
    ({"codebook_refresh_every": 1.0}, TypeError, "codebook_refresh_every"),
    ({"codebook_refresh_every": -1}, ValueError, "codebook_refresh_every"),
    # Taken, and a scoped optimizer then failed every step on the header's int64 word.
    ({"codebook_refresh_every": 2**63}, ValueError, "codebook_refresh_every must satisfy"),
    (
        {"momentum_codec": "none", "codebook_refresh_every": 3},
        ValueError,
        "requires momentum_codec='codebook8'",
    ),
]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]


@pytest.mark.parametrize(("options", "error", "fragment"), GROUP_CASES + WIDE_CASES)
def test_invalid_constructor_option(options: dict, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        Gefen(_params(), **options)


@pytest.mark.parametrize(("options", "error", "fragment"), GROUP_CASES)
def test_invalid_group_option(options: dict, error: type, fragment: str, rejects) -> None:
    first, second = _params()
    with pytest.raises(error, match=fragment):
        Gefen([{"params": [first]}, {"params": [second], **options}])
    optimizer = Gefen([first])
    rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": [second], **options}),
        error,
        fragment,
    )
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize(("options", "error", "fragment"), WIDE_CASES)
def test_optimizer_wide_option_in_group_must_equal_constructor(options, error, fragment) -> None:
    with pytest.raises(ValueError, match="optimizer-wide option 'codebook_refresh_every'"):
        Gefen([{"params": _params(), **options}])


def test_the_refresh_schedule_is_optimizer_wide_and_the_message_says_why(rejects) -> None:
    a, b = _params()
    with pytest.raises(ValueError, match=r"shares the optimizer's one codebook"):
        Gefen([{"params": [a]}, {"params": [b], "codebook_refresh_every": 5}])
    optimizer = Gefen([a], codebook_refresh_every=5)
    rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": [b], "codebook_refresh_every": 0}),
        ValueError,
        "optimizer-wide option 'codebook_refresh_every'",
    )
    # A fp32-momentum group beside a refreshed codebook8 group is fine (it has no codes).
    Gefen([{"params": [a]}, {"params": [b], "momentum_codec": "none"}], codebook_refresh_every=5)


def test_group_options_override_the_constructor_values() -> None:
    a, b = _params()
    optimizer = Gefen([{"params": [a], "lr": 0.5, "factored_v_2d": False}, {"params": [b]}], lr=0.1)
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert optimizer.param_groups[1]["lr"] == 0.1
    a.grad = torch.randn_like(a)
    optimizer.step()
    assert "v_block" in optimizer.state[a]  # factored_v_2d=False honoured for the 2-D parameter


def test_lr_zero_accepted_and_tensor_lr() -> None:
    Gefen(_params(), lr=0.0)
    Gefen(_params(), lr=torch.tensor(0.01))
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        Gefen(_params(), lr=torch.tensor([0.01, 0.02]))


def test_float_and_tensor_lr_trajectories_equal() -> None:
    torch.manual_seed(0)
    init = torch.randn(6, 5)
    runs = []
    for lr in (0.01, torch.tensor(0.01)):
        p = torch.nn.Parameter(init.clone())
        optimizer = Gefen([p], lr=lr, weight_decay=0.1)
        for step in range(5):
            p.grad = torch.sin(torch.arange(30.0).reshape(6, 5) + step)
            optimizer.step()
        runs.append(p.detach().clone())
    assert torch.equal(runs[0], runs[1])


def test_tensor_lr_is_read_once_per_group_per_step(monkeypatch) -> None:
    import gefen.core.optimizer as optimizer_module

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 6, generator=generator)) for _ in range(6)]
    optimizer = Gefen(
        [
            {"params": params[0:3], "lr": torch.tensor(0.01)},
            {"params": params[3:5], "lr": 0.02},
            {"params": params[5:6], "lr": torch.tensor(0.03)},  # no gradient: never read
        ]
    )
    real = optimizer_module._lr_value
    reads: list[object] = []

    def counting(lr: object) -> float:
        reads.append(lr)
        return real(lr)

    monkeypatch.setattr(optimizer_module, "_lr_value", counting)
    for step in range(3):
        for p in params[0:5]:
            p.grad = torch.randn(p.shape, generator=generator)
        params[1].grad = None if step == 1 else params[1].grad
        reads.clear()
        optimizer.step()
        assert optimizer.global_step == step + 1
        assert len(reads) == 2
        assert reads[0] is optimizer.param_groups[0]["lr"]
        assert reads[1] == 0.02


def test_betas_list_normalised() -> None:
    optimizer = Gefen(_params(), betas=[0.8, 0.9])
    assert optimizer.defaults["betas"] == (0.8, 0.9)
    assert isinstance(optimizer.param_groups[0]["betas"], tuple)
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra], "betas": [0.5, 0.6]})
    assert optimizer.param_groups[1]["betas"] == (0.5, 0.6)


def test_bare_tensor_set_and_empty_list() -> None:
    with pytest.raises(TypeError):
        Gefen(torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(TypeError):
        Gefen({torch.nn.Parameter(torch.ones(3))})
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        Gefen([])


def test_complex_and_integer_parameters_rejected() -> None:
    with pytest.raises(ValueError, match="complex"):
        Gefen([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])
    with pytest.raises(ValueError, match="float16, bfloat16, float32 or float64"):
        Gefen([torch.zeros(3, dtype=torch.int64)])


def test_non_leaf_rejected() -> None:
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="non-leaf"):
        Gefen([leaf * 2])


@pytest.mark.parametrize(
    ("bad", "error", "rule"),
    [
        (lambda: torch.zeros(3, dtype=torch.int64), ValueError, "parameters must be float16"),
        (lambda: torch.zeros(3, dtype=torch.complex64, requires_grad=True), ValueError, "complex"),
        (lambda: torch.ones(3, requires_grad=True) * 2, ValueError, "can't optimize a non-leaf"),
        (lambda: "weight", TypeError, "optimizer can only optimize Tensors"),
    ],
    ids=["int", "complex", "non-leaf", "not-a-tensor"],
)
def test_a_refused_parameter_is_named_in_the_message(bad, error, rule, rejects) -> None:
    """§2.3: a message names the parameter, by its name where the group has names."""
    with pytest.raises(error, match=re.escape(f"parameter param_groups[0][1]: {rule}")):
        Gefen([torch.nn.Parameter(torch.zeros(2)), bad()])
    with pytest.raises(error, match=re.escape(f"parameter 'head.weight': {rule}")):
        Gefen([("body.weight", torch.nn.Parameter(torch.zeros(2))), ("head.weight", bad())])
    optimizer = Gefen(_params())
    added = {"params": [torch.nn.Parameter(torch.zeros(2)), bad()]}
    fragment = f"parameter param_groups[1][1]: {rule}"  # the index the group would take
    rejects(optimizer, lambda: optimizer.add_param_group(added), error, fragment)


def test_duplicate_tensor_warned_in_one_group_and_rejected_across_groups(rejects) -> None:
    """torch.optim's rules: a parameter repeated inside one group is a warning (torch's text),
    one shared by two groups an error."""
    a, b = _params()
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        repeated = Gefen([a, a])
    assert repeated.param_groups[0]["params"] == [a, a]
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        Gefen([{"params": [a]}, {"params": [b, a]}])
    optimizer = Gefen([a])
    rejects(
        optimizer,
        lambda: optimizer.add_param_group({"params": [b, a]}),
        ValueError,
        "some parameters appear in more than one parameter group",
    )
    assert len(optimizer.param_groups) == 1
    assert b not in optimizer.state


def test_add_param_group_with_invalid_second_tensor_changes_nothing(rejects) -> None:
    a, b = _params()
    optimizer = Gefen([("first", a)])
    group = {"params": [("second", b), ("third", torch.zeros(2, dtype=torch.int32))]}
    rejects(optimizer, lambda: optimizer.add_param_group(group), ValueError, "float16")
    assert len(optimizer.param_groups) == 1
    assert list(optimizer.state) == [a]
    assert optimizer.param_groups[0]["param_names"] == ["first"]
    assert isinstance(group["params"][0], tuple)  # the caller's dict is untouched


def test_add_param_group_names_a_bad_tensor_by_its_param_names(rejects) -> None:
    """torch's own named form of ``add_param_group`` (tensors plus a ``param_names`` list):
    the rejected tensor was named ``param_groups[1][1]`` there, by its name in the constructor."""
    a, b = _params()
    optimizer = Gefen([("first", a)])
    bad = torch.zeros(2, dtype=torch.int32)
    group = {"params": [b, bad], "param_names": ["second", "bad_one"]}
    rejects(optimizer, lambda: optimizer.add_param_group(group), ValueError, "parameter 'bad_one'")
    optimizer.add_param_group({"params": [b], "param_names": ["second"]})
    assert optimizer.param_groups[1]["param_names"] == ["second"]


def test_add_param_group_non_dict() -> None:
    optimizer = Gefen(_params())
    with pytest.raises(TypeError, match="param_group must be a dict"):
        optimizer.add_param_group([torch.ones(2)])  # type: ignore[arg-type]


def test_mixing_named_and_unnamed_raises_torch_error() -> None:
    a, b = _params()
    with pytest.raises(ValueError, match="with/without names"):
        Gefen([("a", a), b])
    optimizer = Gefen([("a", a)])
    with pytest.raises(ValueError, match="with/without names"):
        optimizer.add_param_group({"params": [b]})


def test_three_groups_kept_and_names_keep_case() -> None:
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(5)]
    groups = [
        {"params": [("Layer.Weight", params[0]), ("layer.weight", params[1])]},
        {"params": [("X", params[2])], "lr": 0.1},
        {"params": [("x", params[3]), ("X2", params[4])]},
    ]
    optimizer = Gefen(groups)
    assert len(optimizer.param_groups) == 3
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 1, 2]
    assert optimizer.param_groups[0]["params"][0] is params[0]
    assert optimizer.param_groups[0]["param_names"] == ["Layer.Weight", "layer.weight"]
    assert optimizer.param_groups[1] is groups[1]  # the group dict kept as given
    assert optimizer.state_dict()["param_groups"][2]["param_names"] == ["x", "X2"]


def test_defaults_hold_15_keys_with_tuple_betas() -> None:
    optimizer = Gefen(_params())
    assert len(optimizer.defaults) == 15
    assert isinstance(optimizer.defaults["betas"], tuple)
    for group in optimizer.param_groups:
        assert set(optimizer.defaults) <= set(group)


def test_one_cycle_lr_cycles_beta1() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = Gefen([p], lr=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.1, total_steps=10, cycle_momentum=True
    )
    seen = set()
    for _ in range(9):
        p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
        seen.add(optimizer.param_groups[0]["betas"][0])
        assert isinstance(optimizer.param_groups[0]["betas"], tuple)
    assert len(seen) > 3


def test_fresh_state_placeholder_repr_deepcopy_and_no_print(capsys) -> None:
    a, b = _params()
    optimizer = Gefen([a, b])
    assert dict(optimizer.state) == {a: {"period": 0}, b: {"period": 0}}
    text = repr(optimizer)
    assert text.startswith("Gefen (")
    assert "lr: 0.001" in text
    clone = copy.deepcopy(optimizer)
    assert clone.state[clone.param_groups[0]["params"][0]] == {"period": 0}
    assert len(clone.defaults) == 15
    assert "differentiable" not in clone.defaults
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


def test_requires_grad_false_parameters_accepted_and_skipped() -> None:
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    live = torch.nn.Parameter(torch.randn(4))
    optimizer = Gefen([frozen, live])
    live.grad = torch.randn(4)
    before = frozen.detach().clone()
    optimizer.step()
    assert torch.equal(frozen, before)
    assert optimizer.state[frozen] == {"period": 0}


@pytest.mark.parametrize(
    ("key", "value", "error", "fragment"),
    [
        ("lr", -1.0, ValueError, "Invalid learning rate"),
        ("betas", (0.9, 1.5), ValueError, "Invalid beta parameter at index 1"),
        ("eps", 0.0, ValueError, "Invalid epsilon value"),
        ("eps", 1e-38, ValueError, "1/eps overflows float32"),
        ("codebook_refresh_every", 5, ValueError, "optimizer-wide option 'codebook_refresh_every'"),
        ("deterministic", 1, TypeError, "deterministic must be a bool"),
        ("momentum_codec", "none", RuntimeError, "a group's codec cannot change"),
        ("factored_v_2d", "no", TypeError, "factored_v_2d must be a bool"),
        ("factored_floor", None, TypeError, "factored_floor must be a bool"),
    ],
)
def test_invalid_group_edit_caught_by_step_preflight(key, value, error, fragment, rejects) -> None:
    a, b = _params()
    optimizer = Gefen([a, b])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    optimizer.step()
    good = optimizer.param_groups[0][key]
    optimizer.param_groups[0][key] = value
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)

    def restore() -> None:
        optimizer.param_groups[0][key] = good

    rejects(optimizer, optimizer.step, error, fragment, restore=restore)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("lr", -1.0, "param_groups[1]: Invalid learning rate: -1.0"),
        ("eps", 0.0, "param_groups[1]: Invalid epsilon value: 0.0"),
    ],
)
def test_a_step_refusing_a_group_edit_names_the_group(
    key: str, value: object, message: str, rejects: Any
) -> None:
    # It gave the rule alone ("Invalid learning rate: -1.0"): with several groups the caller
    # could not tell which one (a load's refusal names it).
    a, b = _params()
    optimizer = Gefen([{"params": [a]}, {"params": [b]}])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    optimizer.step()
    good = optimizer.param_groups[1][key]
    optimizer.param_groups[1][key] = value
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    rejects(
        optimizer,
        optimizer.step,
        ValueError,
        message,
        restore=lambda: optimizer.param_groups[1].__setitem__(key, good),
    )


def test_factored_floor_is_a_group_option_read_every_step_and_keeps_no_state() -> None:
    # g² far from rank one (a diagonal): the product under-estimates the diagonal 8-fold, so
    # without the floor it moves about sqrt(8)·lr; with the floor at most lr (t = 1).
    start = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    floored, plain = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    # nesterov=False: the bound is the stored momentum's (the look-ahead moves up to (1 + β1)·lr)
    optimizer = Gefen(
        [{"params": [floored]}, {"params": [plain], "factored_floor": False}],
        lr=1e-2,
        nesterov=False,
    )
    assert optimizer.param_groups[0]["factored_floor"] is True  # the default

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        before = floored.detach().clone(), plain.detach().clone()
        floored.grad, plain.grad = torch.eye(8) + 1e-3, torch.eye(8) + 1e-3
        optimizer.step()
        return (floored.detach() - before[0]).abs(), (plain.detach() - before[1]).abs()

    moved_floored, moved_plain = step()
    assert float(moved_floored.max()) <= 1e-2 * (1 + 1e-5)
    assert float(moved_plain.diagonal().min()) > 2e-2
    # the floor keeps no state of its own: both parameters' state is the same
    for key in ("v_row", "v_col", "momentum_codes", "momentum_scale"):
        assert torch.equal(optimizer.state[floored][key], optimizer.state[plain][key]), key
    optimizer.param_groups[0]["factored_floor"] = False  # read again at the next step
    moved_floored, moved_plain = step()
    torch.testing.assert_close(moved_floored, moved_plain, rtol=1e-4, atol=1e-7)


def _numpy_scalar_run(kind: type) -> torch.Tensor:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 5))
    optimizer = Gefen(
        [p],
        lr=kind(0.01),
        betas=(kind(0.9), kind(0.99)),
        eps=kind(1e-8),
        weight_decay=kind(0.1),
    )
    for step in range(4):
        p.grad = torch.sin(torch.arange(30.0).reshape(6, 5) + step)
        optimizer.step()
        optimizer.param_groups[0]["lr"] = kind(0.01 / (step + 2))  # a scheduler's own number type
    return p.detach().clone()


def test_numpy_scalar_hyperparameters_train_as_their_float_values() -> None:
    """torch's optimizers take ``np.float32(lr)`` (a config read through NumPy); so do we, with
    the trajectory of the same values given as Python floats."""
    import numpy as np

    as_float = _numpy_scalar_run(lambda value: float(np.float32(value)))
    as_numpy = _numpy_scalar_run(np.float32)
    assert torch.equal(as_float, as_numpy)
    Gefen(_params(), lr=np.int64(0))  # an integer zero, as torch allows


@pytest.mark.parametrize("bad", ["np.bool_", "10**400", "nan"])
def test_values_that_are_not_finite_reals_are_refused_by_name(bad: str) -> None:
    import numpy as np

    value = {"np.bool_": np.bool_(True), "10**400": 10**400, "nan": np.float32("nan")}[bad]
    with pytest.raises(ValueError, match="Invalid learning rate"):
        Gefen(_params(), lr=value)
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        Gefen(_params(), weight_decay=value)


@pytest.mark.parametrize("flag", ["maximize", "amsgrad", "capturable", "differentiable"])
def test_a_torch_flag_set_in_a_group_is_refused_by_name_not_ignored(flag: str, rejects) -> None:
    """The constructor refuses ``maximize=True`` (no such keyword); the same flag in a group dict
    was accepted and ignored, so a ``maximize`` group still descended."""
    message = f"{flag}=True is not supported"
    with pytest.raises(ValueError, match=message):
        Gefen([{"params": _params(), flag: True}])
    params = _params()
    optimizer = Gefen([{"params": params[:1], flag: False}])  # torch's off value is fine
    params[0].grad = torch.randn_like(params[0])
    optimizer.step()
    group = optimizer.param_groups[0]
    group[flag] = True  # written later: refused by the step's option check
    params[0].grad = torch.randn_like(params[0])
    rejects(optimizer, optimizer.step, ValueError, message, restore=lambda: group.pop(flag))
    added = {"params": params[1:], flag: True}
    rejects(optimizer, lambda: optimizer.add_param_group(added), ValueError, message)
    assert len(optimizer.param_groups) == 1


def test_a_betas_edit_that_overflows_the_first_step_is_refused(rejects: Any) -> None:
    a, b = _params()
    optimizer = Gefen([a, b], eps=1e-30)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    optimizer.step()
    group = optimizer.param_groups[0]
    group["betas"] = (1 - 1e-9, 0.999)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    restore = lambda: group.__setitem__("betas", (0.9, 0.999))  # noqa: E731
    rejects(optimizer, optimizer.step, ValueError, "below 4e-39: the first step", restore=restore)


@pytest.mark.parametrize("fused", [True, False], ids=["native", "eager"])
def test_the_smallest_eps_times_one_minus_beta1_keeps_an_all_zero_block_finite(
    fused: bool,
) -> None:
    # betas[0] = 1 − 1e-9 with eps = 1e-30 was taken and wrote NaN into the all-zero row.
    param = torch.nn.Parameter(torch.ones(2, 8))
    optimizer = Gefen([param], lr=1e-3, betas=(1 - 1e-8, 0.999), eps=1e-30, fused=fused)
    grad = torch.zeros(2, 8)
    grad[0] = 1.0
    param.grad = grad
    optimizer.step()
    assert bool(param.isfinite().all())


@pytest.mark.parametrize("fused", [True, False], ids=["native", "eager"])
def test_the_smallest_eps_keeps_an_all_zero_block_finite(fused: bool) -> None:
    # eps=1e-38 was taken: 1/eps overflowed float32 where a block's v is 0, and times the
    # block's zero momentum gave NaN (AdamW divides instead, and stays finite).
    param = torch.nn.Parameter(torch.ones(2, 8))
    optimizer = Gefen([param], lr=1e-3, eps=1e-30, fused=fused)
    grad = torch.zeros(2, 8)
    grad[0] = 1.0
    param.grad = grad
    optimizer.step()
    assert bool(param.isfinite().all())
    decay = optimizer.param_groups[0]["weight_decay"]
    assert torch.allclose(param[1], torch.full((8,), 1 - 1e-3 * decay))  # weight decay only
