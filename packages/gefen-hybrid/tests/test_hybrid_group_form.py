"""The hybrid built like any torch optimizer: param-group dicts with a ``use_muon`` flag (the
``MuonWithAuxAdam`` form), groups routed per parameter when the flag is absent, a default
``lr``, and ``add_param_group`` (docs/hybrid.md §3). Every rejection names the rule and leaves
the hybrid unchanged; a hybrid that refused a group still trains."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gefen.core.testing_conventions import CHECKS, Factory
from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.testing import OneHiddenLM
from gefen.hybrid.testing import assert_same_hybrid as _assert_same
from gefen.hybrid.testing import hybrid_snapshot as _snapshot

FAST = {"fused": False, "ns_steps": 1}
BACKENDS = ["gefen", "adamw"]


def _model(seed: int = 0) -> OneHiddenLM:
    torch.manual_seed(seed)
    return OneHiddenLM()


def _split(model: OneHiddenLM) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    hidden = [model.hidden.weight]
    rest = [p for p in model.parameters() if p is not model.hidden.weight]
    return hidden, rest


def _steps(hybrid: GefenMuonHybrid, model: nn.Module, count: int = 3) -> None:
    for seed in range(count):
        tokens = torch.randint(16, (6,), generator=torch.Generator().manual_seed(seed))
        hybrid.zero_grad()
        model(tokens).square().mean().backward()
        hybrid.step()


def _rejected(hybrid: GefenMuonHybrid, action: Callable[[], Any], error: type, text: str) -> None:
    before = _snapshot(hybrid)
    groups = [(id(group), len(group["params"])) for group in hybrid.param_groups]
    with pytest.raises(error, match=re.escape(text)):
        action()
    _assert_same(before, _snapshot(hybrid))
    assert [(id(group), len(group["params"])) for group in hybrid.param_groups] == groups


@pytest.mark.parametrize("backend", BACKENDS)
def test_flagged_groups_train_exactly_as_the_two_list_form(backend: str) -> None:
    """The group form is a spelling of the same optimizer: children, options and every step
    are those of the explicit two-list form."""
    grouped_model, listed_model = _model(), _model()
    hidden, rest = _split(grouped_model)
    grouped = GefenMuonHybrid(
        [{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}],
        lr=0.01,
        backup_optimizer=backend,
        **FAST,
    )
    names = dict(listed_model.named_parameters())
    listed = GefenMuonHybrid(
        [("hidden.weight", names["hidden.weight"])],
        [(n, p) for n, p in names.items() if n != "hidden.weight"],
        lr=0.01,
        backup_optimizer=backend,
        **FAST,
    )
    assert [group["use_muon"] for group in grouped.param_groups] == [True, False]
    _steps(grouped, grouped_model)
    _steps(listed, listed_model)
    for a, b in zip(grouped_model.parameters(), listed_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_group_keeps_its_own_options_under_the_childs_names(backend: str) -> None:
    model = _model()
    hidden, rest = _split(model)
    hybrid = GefenMuonHybrid(
        [
            {"params": hidden, "use_muon": True, "momentum": 0.9, "lr": 0.05},
            {"params": rest, "use_muon": False, "lr": 3e-4, "betas": (0.8, 0.99)},
        ],
        lr=0.02,
        backup_optimizer=backend,
        **FAST,
    )
    muon_group, backup_group = hybrid.param_groups
    assert muon_group["params"] == hidden
    assert (muon_group["lr"], muon_group["momentum"]) == (0.05, 0.9)
    assert backup_group["params"] == rest
    assert (backup_group["lr"], tuple(backup_group["betas"])) == (3e-4, (0.8, 0.99))
    _steps(hybrid, model, 2)


def test_a_muon_group_may_give_its_own_coefficients() -> None:
    # They were refused, "pass either ns_schedule or ns_coefficients, not both": the group
    # took the hybrid's default ns_schedule="standard" beside them.
    triple = (3.0, -3.2, 1.2)
    trained = []
    for form in ("group", "constructor"):
        model = _model()
        hidden, rest = _split(model)
        own = {"ns_coefficients": triple} if form == "group" else {}
        groups = [{"params": hidden, "use_muon": True, **own}, {"params": rest, "use_muon": False}]
        shared = {"ns_schedule": [triple]} if form != "group" else {}  # FAST: one step
        hybrid = GefenMuonHybrid(groups, lr=0.02, **FAST, **shared)
        if form == "group":
            muon_group = hybrid.param_groups[0]
            assert muon_group["ns_schedule"] is None
            assert tuple(muon_group["ns_coefficients"]) == triple
        _steps(hybrid, model, 2)
        trained.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trained, strict=True))


def test_a_muon_group_giving_the_standard_triple_keeps_the_schedule() -> None:
    # GefenMuon reads the standard triple as no coefficients given; the hybrid read it as its
    # own and ran it three times in place of tuned3.
    from gefen.muon import STANDARD_TRIPLE

    model = _model()
    hidden, rest = _split(model)
    groups = [
        {"params": hidden, "use_muon": True, "ns_coefficients": STANDARD_TRIPLE},
        {"params": rest, "use_muon": False},
    ]
    hybrid = GefenMuonHybrid(groups, lr=0.02, ns_schedule="tuned3", fused=False)
    assert (hybrid.param_groups[0]["ns_schedule"], hybrid.param_groups[0]["ns_steps"]) == (
        "tuned3",
        3,
    )


def test_a_group_without_the_flag_is_routed_per_parameter() -> None:
    """Named pairs by the routing rules ("embed" and "lm_head" go to the backup), bare tensors by
    shape (2-D to Muon); each part keeps the group's options and records where it went."""
    model = _model()
    named = GefenMuonHybrid([{"params": list(model.named_parameters()), "lr": 0.03}], **FAST)
    assert named.muon is not None
    assert named.backup is not None
    assert named.muon.param_groups[0]["param_names"] == ["hidden.weight"]
    assert {"embed.weight", "lm_head.weight"} <= set(named.backup.param_groups[0]["param_names"])
    assert [(g["use_muon"], g["lr"]) for g in named.param_groups] == [(True, 0.03), (False, 0.03)]
    matrix, vector = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    bare = GefenMuonHybrid([{"params": [matrix, vector]}], **FAST)
    assert bare.muon is not None
    assert bare.backup is not None
    assert bare.muon.param_groups[0]["params"] == [matrix]
    assert bare.backup.param_groups[0]["params"] == [vector]
    _steps(named, model, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
def test_torchs_named_form_splits_its_names_with_its_parameters(backend: str, how: str) -> None:
    """A group in torch's named form (``param_names`` beside the tensors) is routed by name, and
    each part keeps only its own names, so the hybrid's ``state_dict`` loads back (each half
    used to carry the whole list, which its own load then refused)."""
    model = _model()
    names, params = zip(*model.named_parameters(), strict=True)
    group = {"params": list(params), "param_names": list(names)}
    if how == "constructor":
        hybrid = GefenMuonHybrid([group], backup_optimizer=backend, **FAST)
    else:
        spare = nn.Parameter(torch.randn(3, 3))
        hybrid = GefenMuonHybrid(
            [{"params": [("spare", spare)], "use_muon": True}], backup_optimizer=backend, **FAST
        )
        hybrid.add_param_group(group)
    by_flag = {g["use_muon"]: g for g in hybrid.param_groups if "param_names" in g}
    assert by_flag[True]["param_names"] == ["hidden.weight"]
    assert "embed.weight" in by_flag[False]["param_names"]  # by name, though it is 2-D
    for part in by_flag.values():
        assert len(part["param_names"]) == len(part["params"])
    _steps(hybrid, model, 1)
    twin = copy.deepcopy((hybrid, model))
    hybrid.load_state_dict(hybrid.state_dict())
    _steps(hybrid, model, 1)
    _steps(twin[0], twin[1], 1)
    for mine, theirs in zip(model.parameters(), twin[1].parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_param_names_of_another_length_are_refused_before_anything_changes() -> None:
    model = _model()
    hybrid = GefenMuonHybrid(model, **FAST)
    _steps(hybrid, model, 1)
    extra = nn.Linear(8, 8)
    group = {"params": [extra.weight, extra.bias], "param_names": ["extra.weight"]}
    text = "param group 2: 'param_names' must be a list with one name per parameter (2)"
    _rejected(hybrid, lambda: hybrid.add_param_group(group), ValueError, text)
    _steps(hybrid, model, 1)


def test_a_flagless_group_gives_each_part_only_the_keys_its_child_reads() -> None:
    """A backup group's ``momentum`` is its beta1 (a momentum-cycling scheduler's key), so a
    flagless group's Muon ``momentum`` stays with the Muon part and its ``betas`` with the
    backup part."""
    matrix, vector = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    group = {"params": [matrix, vector], "momentum": 0.9, "betas": (0.8, 0.99)}
    hybrid = GefenMuonHybrid([group], **FAST)
    muon_group, backup_group = hybrid.param_groups
    assert muon_group["momentum"] == 0.9
    assert "betas" not in muon_group
    assert tuple(backup_group["betas"]) == (0.8, 0.99)
    assert "momentum" not in backup_group


@pytest.mark.parametrize(
    ("groups", "error", "text"),
    [
        ([{"params": [], "use_muon": 1}], TypeError, "param group 0: 'use_muon' must be a bool"),
        ([{"lr": 0.1}], ValueError, "param group 0 has no 'params' key"),
        ([{"params": {nn.Parameter(torch.ones(2))}}], TypeError, "ordered collections"),
    ],
)
def test_malformed_groups_are_refused_before_any_child_exists(
    groups: list[dict[str, Any]], error: type, text: str
) -> None:
    with pytest.raises(error, match=re.escape(text)):
        GefenMuonHybrid(groups, **FAST)


def test_one_parameter_in_both_children_is_refused() -> None:
    model = _model()
    hidden, rest = _split(model)
    with pytest.raises(ValueError, match="more than one parameter group"):
        GefenMuonHybrid(
            [{"params": hidden, "use_muon": True}, {"params": hidden + rest, "use_muon": False}],
            **FAST,
        )


def test_the_group_form_takes_no_second_list_and_no_no_decay_substrings() -> None:
    model = _model()
    hidden, rest = _split(model)
    groups = [{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}]
    with pytest.raises(TypeError, match="takes no second list"):
        GefenMuonHybrid(groups, [("x", rest[0])], **FAST)
    with pytest.raises(ValueError, match="give the no-decay parameters their own group"):
        GefenMuonHybrid(groups, no_decay_substrings=("bias",), **FAST)


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_param_group_routes_like_the_constructor(backend: str) -> None:
    model = _model()
    hybrid = GefenMuonHybrid(model, lr=0.01, backup_optimizer=backend, **FAST)
    _steps(hybrid, model, 1)
    extra = nn.Linear(8, 8)
    hybrid.add_param_group({"params": [("extra.weight", extra.weight)], "lr": 0.05})
    hybrid.add_param_group({"params": [("extra.bias", extra.bias)], "use_muon": False})
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    assert hybrid.muon.param_groups[-1]["params"] == [extra.weight]
    assert hybrid.muon.param_groups[-1]["lr"] == 0.05
    assert hybrid.backup.param_groups[-1]["params"] == [extra.bias]
    assert hybrid.owner_of(extra.weight) is hybrid.muon
    assert hybrid.owner_of(extra.bias) is hybrid.backup
    before = [extra.weight.detach().clone(), extra.bias.detach().clone()]
    _steps(hybrid, model, 1)  # the new parameters have no gradient: skipped as in torch
    extra.weight.grad, extra.bias.grad = torch.ones(8, 8), torch.ones(8)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    hybrid.step()
    assert not torch.equal(before[0], extra.weight)
    assert not torch.equal(before[1], extra.bias)


def test_add_param_group_builds_a_child_the_hybrid_lacks() -> None:
    matrix = nn.Parameter(torch.randn(4, 4))
    hybrid = GefenMuonHybrid([{"params": [matrix], "use_muon": True}], **FAST)
    assert hybrid.backup is None
    bias = nn.Parameter(torch.randn(4))
    hybrid.add_param_group({"params": [bias], "use_muon": False, "lr": 1e-2})
    assert hybrid.backup is not None
    assert hybrid.backup.param_groups[0]["params"] == [bias]
    assert [child for _, child in hybrid.participants][-1] is hybrid.backup
    matrix.grad, bias.grad = torch.ones(4, 4), torch.ones(4)
    before = bias.detach().clone()
    hybrid.step()
    assert not torch.equal(before, bias)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_group_changes_nothing_and_the_hybrid_still_trains(backend: str) -> None:
    model = _model()
    hybrid = GefenMuonHybrid(model, lr=0.01, backup_optimizer=backend, **FAST)
    _steps(hybrid, model, 2)
    extra = nn.Linear(8, 8)
    present = model.hidden.weight
    cases: list[tuple[Any, type, str]] = [
        ([extra.weight], TypeError, "param_group must be a dict"),
        ({"params": [("hidden.weight", present)]}, ValueError, "more than one parameter group"),
        ({"params": [("x", extra.weight)], "use_muon": "yes"}, TypeError, "must be a bool"),
        (
            {"params": [("extra.weight", extra.weight), ("extra.bias", extra.bias)], "lr": -1.0},
            ValueError,
            "Invalid learning rate",
        ),
        # The Muon part is valid and joins the Muon child first; the backup part is not, so the
        # Muon part is taken back out.
        (
            {"params": [("extra.weight", extra.weight), ("doubled", extra.bias * 2)]},
            ValueError,
            "can't optimize a non-leaf Tensor",
        ),
        # Options torch's AdamW takes into a group and refuses only at its step: the AdamW
        # backup used to accept the group, and every later step then failed.
        (
            {"params": [("extra.weight", extra.weight), ("extra.bias", extra.bias)],
             "betas": (1.5, 0.9)},
            ValueError,
            "beta",
        ),
    ]  # fmt: skip
    for group, error, text in cases:
        _rejected(hybrid, lambda group=group: hybrid.add_param_group(group), error, text)
    assert hybrid.owner_of(extra.weight) is None
    _steps(hybrid, model, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_group_is_refused_by_name_not_dropped(backend: str) -> None:
    # It used to be dropped without a word: the group count stayed, and code indexing the
    # group it had just added got another one. torch keeps an empty group, but its DCP load
    # gives one no options (a hybrid so loaded would be refused), so the hybrid refuses it.
    model = _model()
    hybrid = GefenMuonHybrid(model, lr=0.01, backup_optimizer=backend, **FAST)
    _steps(hybrid, model, 1)
    for flag in ({}, {"use_muon": True}, {"use_muon": False}):
        _rejected(
            hybrid,
            lambda flag=flag: hybrid.add_param_group(
                {"params": [], "param_names": [], "lr": 0.5, **flag}
            ),
            ValueError,
            "param group 2 has no parameters: the hybrid keeps no empty group",
        )
    hidden, _ = _split(model)
    groups = [{"params": hidden, "use_muon": True}, {"params": [], "use_muon": False}]
    with pytest.raises(ValueError, match=re.escape("param group 1 has no parameters")):
        GefenMuonHybrid(groups, backup_optimizer=backend, **FAST)
    _steps(hybrid, model, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_parameter_name_is_refused_in_every_form(backend: str) -> None:
    # The pair form refused a repeated name; torch's named form and add_param_group took it.
    model = _model()
    hidden, rest = _split(model)
    groups = [
        {"params": hidden, "param_names": ["hidden.weight"], "use_muon": True},
        {"params": rest, "param_names": ["hidden.weight"] + [f"p{i}" for i in range(1, len(rest))]},
    ]
    with pytest.raises(ValueError, match=re.escape("duplicate parameter name 'hidden.weight'")):
        GefenMuonHybrid(groups, backup_optimizer=backend, **FAST)
    hybrid = GefenMuonHybrid(model, lr=0.01, backup_optimizer=backend, **FAST)
    extra = nn.Parameter(torch.randn(4))
    _rejected(
        hybrid,
        lambda: hybrid.add_param_group({"params": [extra], "param_names": ["hidden.weight"]}),
        ValueError,
        "param group 2: duplicate parameter name 'hidden.weight'",
    )
    pairs = {"params": [("twice", extra), ("twice", nn.Parameter(torch.randn(4)))]}
    _rejected(
        hybrid,
        lambda: hybrid.add_param_group(pairs),
        ValueError,
        "param group 2: duplicate parameter name 'twice'",
    )
    hybrid.add_param_group({"params": [extra], "param_names": ["extra"]})
    _steps(hybrid, model, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_matrix_sent_to_muon_is_refused_naming_the_parameter(backend: str) -> None:
    # GefenMuon's own refusal names only a size: the caller could not tell which parameter of
    # which group (or list) it meant, nor where that parameter belongs.
    model = _model()
    hidden, rest = _split(model)
    conv = nn.Parameter(torch.randn(6, 4, 3, 3))
    flagged = [{"params": [*hidden, conv], "param_names": ["hidden.weight", "conv"],
                "use_muon": True}]  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(
        "param group 0: use_muon=True, but its params[1] ('conv') has size (6, 4, 3, 3): "
        "GefenMuon steps only 2-D matrices (give it a group with use_muon=False)"
    )):  # fmt: skip
        GefenMuonHybrid(flagged, backup_optimizer=backend, **FAST)
    with pytest.raises(ValueError, match=re.escape(
        "parameter 'conv' in the muon list has size (6, 4, 3, 3): GefenMuon steps only 2-D "
        "matrices (put it in the backup list)"
    )):  # fmt: skip
        GefenMuonHybrid([("conv", conv)], [("bias", rest[0])], backup_optimizer=backend, **FAST)
    hybrid = GefenMuonHybrid(model, lr=0.01, backup_optimizer=backend, **FAST)
    _steps(hybrid, model, 1)
    _rejected(
        hybrid,
        lambda: hybrid.add_param_group(
            {"params": [conv], "param_names": ["conv"], "use_muon": True}
        ),
        ValueError,
        "param group 2: use_muon=True, but its params[0] ('conv') has size (6, 4, 3, 3)",
    )
    hybrid.add_param_group({"params": [conv], "param_names": ["conv"], "use_muon": False})
    _steps(hybrid, model, 1)
    assert hybrid.owner_of(conv) is hybrid.backup


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_complex_backup_parameter_is_refused_at_registration_in_the_hybrids_numbering(
    backend: str,
) -> None:
    # The AdamW backup took one (torch's AdamW does), then refused every step and its own
    # state_dict; the Gefen backup refused it, but under the backup's own group number.
    model = _model()
    hidden, _ = _split(model)
    complex_param = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    rule = (
        "parameter param_groups[1][0]: complex parameters are not supported (got torch.complex64)"
    )
    groups = [{"params": hidden, "use_muon": True}, {"params": [complex_param], "use_muon": False}]
    with pytest.raises(ValueError, match=re.escape(rule)):
        GefenMuonHybrid(groups, backup_optimizer=backend, **FAST)
    hybrid = GefenMuonHybrid(groups[:1], lr=0.01, backup_optimizer=backend, **FAST)
    _rejected(hybrid, lambda: hybrid.add_param_group(groups[1]), ValueError, rule)
    assert hybrid.backup is None
    _steps(hybrid, model, 1)


@pytest.mark.parametrize("betas", [(0.9,), 0.9], ids=["one", "float"])
def test_an_adamw_backup_refuses_betas_that_are_no_pair_by_name(betas: Any) -> None:
    # torch's AdamW indexed them first: an IndexError or "'float' object is not subscriptable".
    with pytest.raises(ValueError, match=re.escape(f"betas must be a pair, got {betas!r}")):
        GefenMuonHybrid(_model(), backup_optimizer="adamw", betas=betas, **FAST)


def test_an_adamw_backup_step_error_says_which_of_the_hybrids_groups_it_is() -> None:
    # The preflight named only the backup's own number: its group 1 was the hybrid's
    # param_groups[2] (the Muon child's groups come first), and param_groups[1] another group.
    model = _model()
    hybrid = GefenMuonHybrid(
        model, lr=0.01, backup_optimizer="adamw", no_decay_substrings=("bias",), **FAST
    )
    assert len(hybrid.param_groups) == 3
    _steps(hybrid, model, 1)
    hybrid.param_groups[2]["eps"] = 0.0
    hybrid.zero_grad()
    model(torch.arange(6) % 16).square().mean().backward()
    _rejected(
        hybrid,
        hybrid.step,
        ValueError,
        "AdamW backup group 1: eps must be finite and > 0, got 0.0 (AdamW backup group 1 is the "
        "hybrid's param_groups[2])",
    )
    hybrid.param_groups[2]["eps"] = 1e-8
    _steps(hybrid, model, 1)


def test_a_muon_only_hybrid_names_the_backup_options_not_a_group_it_lacks() -> None:
    # The AdamW backup is built over one empty group to check its options; its refusal read
    # "(AdamW backup group 0 is the hybrid's param_groups[1])" of a hybrid with one group.
    matrix = nn.Sequential(nn.Linear(8, 8, bias=False))
    with pytest.raises(ValueError) as refused:
        GefenMuonHybrid(
            matrix, backup_optimizer="adamw", backup_adamw_kwargs={"amsgrad": "x"}, **FAST
        )
    assert str(refused.value) == (
        "GefenMuonHybrid: AdamW backup options: amsgrad must be a bool, got 'x'"
    )


def test_a_refused_state_dict_says_which_of_the_hybrids_groups_it_names() -> None:
    # state_dict() passed on a Gefen child's refusal in the child's numbering: the backup's
    # group 0 read as param_groups[0], a Muon group of the hybrid. It is noted, not rewritten,
    # since the text may be a hook's own. (torch's AdamW checks nothing in its state_dict.)
    model = _model()
    hidden, rest = _split(model)
    groups = [{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}]
    hybrid = GefenMuonHybrid(groups, lr=0.01, **FAST)
    _steps(hybrid, model, 1)
    hybrid.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError) as refused:
        hybrid.state_dict()
    assert str(refused.value) == (
        "param_groups[0]: Invalid learning rate: -1.0 [numbered within the backup: its group g "
        "is the hybrid's param_groups[g + 1]]"
    )
    hybrid.param_groups[1]["lr"] = 0.01
    _steps(hybrid, model, 1)


def test_a_group_form_adamw_backup_refuses_a_group_its_step_would_refuse() -> None:
    model = _model()
    hidden, rest = _split(model)
    groups = [{"params": hidden, "use_muon": True}, {"params": rest, "betas": (1.5, 0.9)}]
    with pytest.raises(ValueError, match=r"AdamW backup group 0: betas\[0\] must be in"):
        GefenMuonHybrid(groups, backup_optimizer="adamw", **FAST)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_repeated_in_a_backup_group_round_trips(backend: str) -> None:
    """torch numbers a repeated parameter by one index (``[2, 1, 2]``); the backup's load
    accepts the numbering its own ``state_dict`` wrote, and the twin then steps identically."""

    def build(seed: int) -> tuple[GefenMuonHybrid, list[nn.Parameter]]:
        generator = torch.Generator().manual_seed(seed)
        matrix = nn.Parameter(torch.randn(4, 4, generator=generator))
        first, second = (nn.Parameter(torch.randn(4, generator=generator)) for _ in range(2))
        groups = [
            {"params": [matrix], "use_muon": True},
            {"params": [first, second, first], "use_muon": False},
        ]
        with pytest.warns(UserWarning, match="duplicate parameters"):
            hybrid = GefenMuonHybrid(groups, backup_optimizer=backend, lr=1e-2, **FAST)
        return hybrid, [matrix, first, second]

    hybrid, params = build(0)
    for param in params:
        param.grad = torch.ones_like(param)
    hybrid.step()
    twin, twin_params = build(0)
    # A copy, as torch.save/torch.load give: torch's AdamW keeps a loaded 'step' tensor as is.
    twin.load_state_dict(copy.deepcopy(hybrid.state_dict()))
    for mine, theirs in zip(params, twin_params, strict=True):
        with torch.no_grad():
            theirs.copy_(mine)
        mine.grad = torch.full_like(mine, 0.5)
        theirs.grad = torch.full_like(theirs, 0.5)
    hybrid.step()
    twin.step()
    for mine, theirs in zip(params, twin_params, strict=True):
        assert torch.equal(mine, theirs)


# A flagless group of matrices goes to the Muon child (no names: 2-D is Muon's), so a group may
# override every Muon option; the hybrid's defaults are the Muon child's.
MUON_GROUP_OPTIONS: dict[str, Any] = {
    "lr": 0.05,
    "weight_decay": 0.05,
    "momentum": 0.9,
    "nesterov": False,
    "eps": 1e-6,
    "ns_steps": 3,
    "adjust_lr_fn": "original",
    "momentum_codec": "none",
    "normuon": False,  # the hybrid's default is True
    "stochastic_round": True,
    "deterministic": True,
    "check_finite": False,
}


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_shared_torch_conventions_hold_for_the_hybrid(backend: str, check: str) -> None:
    def build(params: Any, **options: Any) -> GefenMuonHybrid:
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        return GefenMuonHybrid(groups, backup_optimizer=backend, **FAST, **options)

    factory = Factory(f"GefenMuonHybrid({backend})", build, group_options=MUON_GROUP_OPTIONS)
    CHECKS[check](factory)


def test_a_groups_codec_and_rounding_reach_its_childs_group() -> None:
    """Per-group ``momentum_codec`` / ``stochastic_round`` (core and muon groups take them, as
    any option): a Muon group with fp32 momentum and a backup group keeping fp32 momentum for
    norms, beside codebook8 groups of each child; the layout survives a round trip."""
    model = _model()
    hidden, rest = _split(model)
    groups = [
        {"params": hidden, "use_muon": True, "momentum_codec": "none"},
        {"params": rest[:1], "use_muon": False, "stochastic_round": True},
        {"params": rest[1:], "use_muon": False, "momentum_codec": "none"},
    ]
    hybrid = GefenMuonHybrid(groups, lr=0.02, **FAST)
    _steps(hybrid, model)
    assert "momentum_buffer" in hybrid.muon.state[hidden[0]]
    assert "momentum_codes" in hybrid.backup.state[rest[0]]
    assert all("momentum" in hybrid.backup.state[p] for p in rest[1:])
    assert hybrid.backup.param_groups[0]["stochastic_round"] is True
    twin_model = _model()
    twin_model.load_state_dict(model.state_dict())
    twin_hidden, twin_rest = _split(twin_model)
    twin_groups = [dict(group) for group in groups]
    for group, params in zip(twin_groups, (twin_hidden, twin_rest[:1], twin_rest[1:]), strict=True):
        group["params"] = params
    twin = GefenMuonHybrid(twin_groups, lr=0.02, **FAST)
    twin.load_state_dict(copy.deepcopy(hybrid.state_dict()))
    _steps(hybrid, model, 1)
    _steps(twin, twin_model, 1)
    for mine, theirs in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def _numpy_scalar_trajectory(backend: str, kind: Callable[[float], Any]) -> list[torch.Tensor]:
    model = _model()
    hidden, rest = _split(model)
    hybrid = GefenMuonHybrid(
        [{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}],
        lr=kind(0.01),
        backup_optimizer=backend,
        **FAST,
    )
    for step in range(3):
        _steps(hybrid, model, 1)
        for group in hybrid.param_groups:  # a scheduler written against NumPy
            group["lr"] = kind(0.01 / (step + 2))
            group["momentum"] = kind(0.9 - 0.05 * step)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_scalar_lr_and_momentum_train_as_their_float_values(backend: str) -> None:
    """``np.float32`` hyperparameters (a config or a scheduler read through NumPy) are real
    numbers to torch's optimizers and to every child here, the AdamW backup included. Gefen
    reads them as floats (the same bits); torch's AdamW does its scalar arithmetic in the
    NumPy type (float32 under NumPy 2's promotion), so its half agrees to float32 precision."""
    import numpy as np

    as_float = _numpy_scalar_trajectory(backend, lambda value: float(np.float32(value)))
    as_numpy = _numpy_scalar_trajectory(backend, np.float32)
    for a, b in zip(as_float, as_numpy, strict=True):
        if backend == "gefen":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
