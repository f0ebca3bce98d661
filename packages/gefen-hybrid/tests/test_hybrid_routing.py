"""GefenMuonHybrid routing and construction in one process (docs/hybrid.md §2–§4, §10).

Routing: substrings, embedding identity, tied heads, the INFO record and ``validate_split``.
Construction: the three forms, the ordered checks of §3 (every rejection happens before any
child exists, so the model is untouched and a correct hybrid still builds and trains from it),
the warning, and what reaches each child.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gefen.core import Gefen
from gefen.hybrid import (
    DEFAULT_BACKUP_SUBSTRINGS,
    GefenMuonHybrid,
    is_muon_param,
    split_params_for_muon,
    validate_split,
)
from gefen.hybrid.testing import OneHiddenLM as TinyLM
from gefen.hybrid.testing import assert_same_hybrid as _assert_same
from gefen.hybrid.testing import hybrid_snapshot as _snapshot
from gefen.muon import GefenMuon

BARE_TENSORS = (
    "GefenMuonHybrid cannot route bare tensors: pass model.named_parameters(), a module, or use "
    "GefenMuonHybrid.from_model"
)
SUBSTRINGS_ONLY = (
    "backup_substrings is only valid when the first argument is a module or a (name, parameter) "
    "iterable"
)
NO_PARAMETERS = "GefenMuonHybrid received no parameters to optimize"
ZERO3 = (
    "GefenMuonHybrid received only zero-numel backup parameters and no Muon parameters: this is "
    "the DeepSpeed ZeRO stage 3 placeholder signature; use plain Gefen"
)
SUGGESTION = ("model.named_parameters()", "GefenMuonHybrid.from_model")
FAST = {"fused": False, "ns_steps": 1}

# --------------------------------------------------------------------------------------------
# Models


TINY_BACKUP = ["embed.weight", "hidden.bias", "norm.weight", "norm.bias", "lm_head.weight"]


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width)


class GPT2Like(nn.Module):
    """wte, wpe, attention blocks, ln_f and an lm_head tied to wte."""

    def __init__(self, vocab: int = 16, width: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(12, width)
        self.h = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


class T5Like(nn.Module):
    """A T5-style ``shared`` embedding: no routing substring matches its name."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(16, 8)
        self.encoder = nn.Linear(8, 8, bias=False)


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8, bias=False)
        self.score = nn.Linear(8, 1, bias=False)
        self.classifier = nn.Linear(8, 3, bias=False)


class DecoderFirst(nn.Module):
    """A head registered before the embedding it is tied to, under a neutral name."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(8, 16, bias=False)
        self.body = nn.Linear(8, 8, bias=False)
        self.tokens = nn.Embedding(16, 8)
        self.tokens.weight = self.decoder.weight


class OneD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.gain = nn.Parameter(torch.ones(3))


class Placeholders(nn.Module):
    """DeepSpeed ZeRO-3's signature: every parameter is an empty 1-D slot."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(0))
        self.b = nn.Parameter(torch.empty(0))


def _tiny(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _names(pairs: list[tuple[str, torch.Tensor]]) -> list[str]:
    return [name for name, _ in pairs]


def _p(*shape: int, seed: int = 0) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


# --------------------------------------------------------------------------------------------
# Helpers: nothing changed, still trains


def _params(hybrid: GefenMuonHybrid) -> list[torch.Tensor]:
    return [p for group in hybrid.param_groups for p in group["params"]]


def _trains(hybrid: GefenMuonHybrid, seed: int = 123) -> None:
    """A normal step moves every non-empty parameter and leaves everything finite."""
    params = _params(hybrid)
    for index, p in enumerate(params):
        generator = torch.Generator().manual_seed(seed + index)
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    before = [p.detach().clone() for p in params]
    hybrid.step()
    for b, p in zip(before, params, strict=True):
        assert bool(torch.isfinite(p).all())
        if p.numel():
            assert not torch.equal(b, p.detach())


def _model_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _construction_rejected(
    build: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    model: nn.Module | None = None,
    *,
    rebuild: Callable[[], GefenMuonHybrid] | None = None,
) -> pytest.ExceptionInfo[Any]:
    """``build`` raises before any child exists: the model (parameters and gradients) is
    untouched, and a correct hybrid over the same model still builds and trains."""
    model = model if model is not None else _tiny(7)
    before = _model_values(model)
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(error, match=re.escape(fragment)) as info:
        build()
    after = _model_values(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(g is p.grad for g, p in zip(grads, model.parameters(), strict=True))
    if rebuild is not None:
        _trains(rebuild())
    elif any(p.requires_grad and p.numel() for p in model.parameters()):
        _trains(GefenMuonHybrid(model, lr=1e-2, **FAST))
    return info


def _rejects(
    hybrid: GefenMuonHybrid, action: Callable[[], Any], error: type[BaseException], fragment: str
) -> None:
    before = _snapshot(hybrid)
    with pytest.raises(error, match=re.escape(fragment)):
        action()
    _assert_same(before, _snapshot(hybrid))
    _trains(hybrid)


@pytest.fixture
def no_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


# --------------------------------------------------------------------------------------------
# Routing (§2)


def test_default_substrings_and_is_muon_param() -> None:
    assert DEFAULT_BACKUP_SUBSTRINGS == ("embed", "wte", "wpe", "lm_head", "classifier", "score")
    matrix, vector, cube = torch.zeros(4, 4), torch.zeros(4), torch.zeros(2, 2, 2)
    assert is_muon_param("layers.0.mlp.weight", matrix)
    # "head" and "output" are deliberately absent: they would catch hidden layers.
    assert is_muon_param("attn.head_proj.weight", matrix)
    assert is_muon_param("block.output.dense.weight", matrix)
    for name in ("model.Embed_tokens.weight", "WTE", "x.WPE.w", "LM_HEAD", "Classifier", "SCORE"):
        assert not is_muon_param(name, matrix)
    assert not is_muon_param("layers.0.bias", vector)
    assert not is_muon_param("conv.weight", cube)
    assert not is_muon_param("scalar", torch.zeros(()))
    assert not is_muon_param("hidden.weight", matrix, ("HIDDEN",))
    assert is_muon_param("embed.weight", matrix, ())


@pytest.mark.parametrize("construct", ["module", "from_model"])
def test_tinylm_module_routing(construct: str) -> None:
    model = _tiny()
    muon, backup = split_params_for_muon(model)
    assert _names(muon) == ["hidden.weight"]
    assert muon[0][1] is model.hidden.weight
    assert _names(backup) == TINY_BACKUP
    assert all(p is dict(model.named_parameters())[n] for n, p in backup)
    if construct == "module":
        hybrid = GefenMuonHybrid(model, lr=1e-2, **FAST)
    else:
        hybrid = GefenMuonHybrid.from_model(model, lr=1e-2, **FAST)
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    assert [p for g in hybrid.muon.param_groups for p in g["params"]] == [model.hidden.weight]
    backup_params = [p for g in hybrid.backup.param_groups for p in g["params"]]
    assert len(backup_params) == 5
    assert all(a is b for a, (_, b) in zip(backup_params, backup, strict=True))
    _trains(hybrid)


def test_frozen_parameters_are_skipped() -> None:
    model = _tiny()
    model.norm.bias.requires_grad_(False)
    model.hidden.weight.requires_grad_(False)
    muon, backup = split_params_for_muon(model)
    assert muon == []
    assert _names(backup) == ["embed.weight", "hidden.bias", "norm.weight", "lm_head.weight"]


def test_gpt2_like_routes_only_attention_matrices_to_muon() -> None:
    model = GPT2Like()
    muon, backup = split_params_for_muon(model)
    assert _names(muon) == [
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_proj.weight",
        "h.1.attn.c_attn.weight",
        "h.1.attn.c_proj.weight",
    ]
    backup_names = _names(backup)
    assert backup_names[:2] == ["wte.weight", "wpe.weight"]
    assert {"ln_f.weight", "ln_f.bias", "h.0.ln_1.weight", "h.1.attn.c_proj.bias"} <= set(
        backup_names
    )
    # The tied head appears once, under its first registered name, in the backup.
    assert "lm_head.weight" not in backup_names
    assert any(p is model.lm_head.weight for _, p in backup)
    assert not any(p is model.lm_head.weight for _, p in muon)
    assert len(muon) + len(backup) == len(list(model.parameters()))


def test_t5_shared_embedding_goes_to_backup_by_identity() -> None:
    model = T5Like()
    # No substring matches "shared": name-only routing would send it to Muon ...
    assert is_muon_param("shared.weight", model.shared.weight)
    pairs_hybrid = GefenMuonHybrid(model.named_parameters(), lr=1e-2, **FAST)
    assert pairs_hybrid.muon is not None
    assert any(p is model.shared.weight for p in pairs_hybrid.muon.param_groups[0]["params"])
    # ... while the module form recognises the embedding by identity.
    muon, backup = split_params_for_muon(model)
    assert _names(muon) == ["encoder.weight"]
    assert _names(backup) == ["shared.weight"]
    hybrid = GefenMuonHybrid(model, lr=1e-2, **FAST)
    assert hybrid.backup is not None
    assert hybrid.backup.param_groups[0]["params"] == [model.shared.weight]


def test_embedding_bag_and_subclasses_go_to_backup() -> None:
    class MyEmbedding(nn.Embedding):
        pass

    model = nn.Module()
    model.bag = nn.EmbeddingBag(10, 4)
    model.custom = MyEmbedding(10, 4)
    model.proj = nn.Linear(4, 4, bias=False)
    muon, backup = split_params_for_muon(model)
    assert _names(muon) == ["proj.weight"]
    assert _names(backup) == ["bag.weight", "custom.weight"]


def test_score_and_classifier_heads_go_to_backup() -> None:
    model = Heads()
    muon, backup = split_params_for_muon(model)
    assert _names(muon) == ["body.weight"]
    assert _names(backup) == ["score.weight", "classifier.weight"]
    hybrid = GefenMuonHybrid(model.named_parameters(), lr=1e-2, **FAST)
    assert hybrid.backup is not None
    assert hybrid.muon is not None
    assert hybrid.backup.param_groups[0]["params"] == [model.score.weight, model.classifier.weight]


def test_tied_head_registered_before_its_embedding_goes_to_backup() -> None:
    model = DecoderFirst()
    assert [n for n, _ in model.named_parameters()] == ["decoder.weight", "body.weight"]
    assert is_muon_param("decoder.weight", model.decoder.weight)
    muon, backup = split_params_for_muon(model)
    assert _names(muon) == ["body.weight"]
    assert _names(backup) == ["decoder.weight"]
    assert backup[0][1] is model.tokens.weight


def test_custom_backup_substrings_move_hidden_to_backup() -> None:
    model = _tiny()
    substrings = ("embed", "lm_head", "hidden")
    muon, backup = split_params_for_muon(model, substrings)
    assert muon == []
    assert "hidden.weight" in _names(backup)
    hybrid = GefenMuonHybrid(model, lr=1e-2, backup_substrings=substrings, **FAST)
    assert hybrid.muon is None
    assert hybrid.backup is not None
    assert any(p is model.hidden.weight for p in hybrid.backup.param_groups[0]["params"])
    same = GefenMuonHybrid.from_model(model, lr=1e-2, backup_substrings=substrings, **FAST)
    assert same.muon is None
    # The pair form honours the substrings too.
    pairs = GefenMuonHybrid(model.named_parameters(), lr=1e-2, backup_substrings=substrings)
    assert pairs.muon is None
    _trains(hybrid)


def test_split_logs_exactly_one_info_record(caplog: pytest.LogCaptureFixture) -> None:
    model = _tiny()
    with caplog.at_level(logging.INFO, logger="gefen.hybrid"):
        split_params_for_muon(model)
    records = [r for r in caplog.records if r.name == "gefen.hybrid"]
    assert len(records) == 1
    record = records[0]
    assert record.levelno == logging.INFO
    assert record.msg == "split_params_for_muon: %d muon / %d backup params; backup = %s"
    assert record.args == (1, 5, TINY_BACKUP)
    message = record.getMessage()
    assert message.startswith("split_params_for_muon: 1 muon / 5 backup params; backup = ")
    assert all(name in message for name in TINY_BACKUP)
    assert "hidden.weight" not in message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gefen.hybrid"):
        GefenMuonHybrid(model, lr=1e-2, **FAST)
    assert len([r for r in caplog.records if r.name == "gefen.hybrid"]) == 1


# --------------------------------------------------------------------------------------------
# validate_split (§2)


def test_validate_split_returns_the_lists_unchanged() -> None:
    w, b = _p(4, 4), _p(4, seed=1)
    muon, backup = [("w", w)], (("b", b),)
    got_muon, got_backup = validate_split(muon, backup)
    assert got_muon == [("w", w)]
    assert got_muon[0][1] is w
    assert [(n, p) for n, p in got_backup] == [("b", b)]
    assert got_backup[0][1] is b
    # 2-lists count as pairs.
    assert validate_split([["w", w]], [])[0][0][1] is w


@pytest.mark.parametrize(
    ("item", "shown"),
    [
        (torch.zeros(4, 4), "(4, 4)"),
        (torch.zeros(2, 3), "(2, 3)"),  # two rows: must not unpack as a pair
        (("w", [1.0, 2.0]), "[1.0, 2.0]"),
        (("w", torch.zeros(2), "extra"), "'extra'"),
        (("w",), "('w',)"),
        ((3, torch.zeros(2)), "(3, tensor"),
    ],
    ids=["bare", "two-row", "non-tensor", "3-tuple", "1-tuple", "non-str-name"],
)
@pytest.mark.parametrize("side", ["muon", "backup"])
def test_validate_split_rejects_non_pairs(item: Any, shown: str, side: str) -> None:
    good = ("ok", _p(3, 3))
    muon, backup = ([item], [good]) if side == "muon" else ([good], [item])
    with pytest.raises(TypeError) as info:
        validate_split(muon, backup)
    message = str(info.value)
    assert shown in message
    assert all(fragment in message for fragment in SUGGESTION)
    assert side in message


def test_validate_split_value_errors() -> None:
    w, v, b = _p(4, 4), _p(4, 4, seed=1), _p(4, seed=2)
    with pytest.raises(
        ValueError, match=re.escape("parameter 'w2' appears twice in the muon list")
    ):
        validate_split([("w", w), ("w2", w)], [])
    with pytest.raises(
        ValueError, match=re.escape("parameter 'b2' appears twice in the backup list")
    ):
        validate_split([("w", w)], [("b", b), ("b2", b)])
    with pytest.raises(
        ValueError, match=re.escape("parameter 'b' appears in BOTH the muon and backup lists")
    ):
        validate_split([("w", w)], [("b", w)])
    # in both lists and not 2-D: "in BOTH" first, as documented ("put it in the backup list",
    # the non-2-D rule's advice, misled a parameter already there)
    with pytest.raises(
        ValueError, match=re.escape("parameter 'c' appears in BOTH the muon and backup lists")
    ):
        validate_split([("c", b)], [("c", b)])
    with pytest.raises(ValueError, match=re.escape("duplicate parameter name 'x'")):
        validate_split([("x", w)], [("x", b)])
    with pytest.raises(ValueError, match=re.escape("duplicate parameter name 'x'")):
        validate_split([("x", w), ("x", v)], [])


def test_validate_split_case_distinct_names_are_accepted() -> None:
    w, v = _p(4, 4), _p(4, 4, seed=1)
    muon, backup = validate_split([("Layer.weight", w)], [("layer.weight", v)])
    assert _names(muon) == ["Layer.weight"]
    assert _names(backup) == ["layer.weight"]
    hybrid = GefenMuonHybrid([("Layer.weight", w)], [("layer.weight", v)], lr=1e-2, **FAST)
    _trains(hybrid)


def test_validate_split_with_model_requires_coverage() -> None:
    model = _tiny()
    muon, backup = split_params_for_muon(model)
    assert validate_split(muon, backup, model) == (muon, backup)
    with pytest.raises(
        ValueError, match=re.escape("trainable parameters in neither list: ['norm.bias']")
    ):
        validate_split(muon, [pair for pair in backup if pair[0] != "norm.bias"], model)
    # A frozen parameter may be left out.
    model.norm.bias.requires_grad_(False)
    validate_split(muon, [pair for pair in backup if pair[0] != "norm.bias"], model)


# --------------------------------------------------------------------------------------------
# Forms (§3)


def test_pairs_form_routes_by_name_and_skips_frozen() -> None:
    model = _tiny()
    model.norm.weight.requires_grad_(False)
    hybrid = GefenMuonHybrid(model.named_parameters(), lr=1e-2, **FAST)
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    assert hybrid.muon.param_groups[0]["params"] == [model.hidden.weight]
    backup = hybrid.backup.param_groups[0]["params"]
    assert len(backup) == 4
    assert not any(p is model.norm.weight for p in backup)
    _trains(hybrid)


@pytest.mark.parametrize(
    "first",
    [
        lambda m: list(m.parameters()),
        lambda m: m.parameters(),
        lambda m: m.hidden.weight,
        lambda m: [m.hidden.weight],
    ],
    ids=["list", "generator", "single-tensor", "one-tensor-list"],
)
def test_pairs_form_rejects_bare_tensors(first: Callable[[nn.Module], Any]) -> None:
    model = _tiny()
    _construction_rejected(
        lambda: GefenMuonHybrid(first(model), lr=1e-2), TypeError, BARE_TENSORS, model
    )


def test_two_list_form_including_one_sided_hybrids() -> None:
    w, v, b = _p(4, 4), _p(6, 4, seed=1), _p(4, seed=2)
    full = GefenMuonHybrid([("w", w), ("v", v)], [("b", b)], lr=1e-2, **FAST)
    assert full.muon is not None
    assert full.backup is not None
    assert full.muon.param_groups[0]["params"] == [w, v]
    assert full.backup.param_groups[0]["params"] == [b]
    assert full.children == (full.muon, full.backup)
    _trains(full)
    muon_only = GefenMuonHybrid([("w", w)], [], lr=1e-2, **FAST)
    assert muon_only.backup is None
    assert muon_only.children == (muon_only.muon,)
    _trains(muon_only)
    backup_only = GefenMuonHybrid([], [("b", b)], lr=1e-2, **FAST)
    assert backup_only.muon is None
    assert backup_only.children == (backup_only.backup,)
    _trains(backup_only)
    # The two-list form never re-routes: a 1-D tensor in the Muon list reaches GefenMuon,
    # whose own constructor rejects it.
    with pytest.raises(ValueError):
        GefenMuonHybrid([("b", b)], [], lr=1e-2, **FAST)


def test_backup_substrings_with_two_lists_or_module_plus_list_is_type_error() -> None:
    model = _tiny()
    muon, backup = split_params_for_muon(model)
    _construction_rejected(
        lambda: GefenMuonHybrid(muon, backup, lr=1e-2, backup_substrings=("embed",)),
        TypeError,
        SUBSTRINGS_ONLY,
        model,
    )
    _construction_rejected(
        lambda: GefenMuonHybrid(muon, backup, lr=1e-2, backup_substrings=()),
        TypeError,
        SUBSTRINGS_ONLY,
        model,
    )
    _construction_rejected(
        lambda: GefenMuonHybrid(model, backup, lr=1e-2), TypeError, SUBSTRINGS_ONLY, model
    )
    _construction_rejected(
        lambda: GefenMuonHybrid(model, [], lr=1e-2), TypeError, SUBSTRINGS_ONLY, model
    )


def test_lr_has_a_default_and_is_keyword_only() -> None:
    """Like every other option (torch.optim.AdamW's and Muon's default, 1e-3)."""
    model = _tiny()
    assert {group["lr"] for group in GefenMuonHybrid(model, **FAST).param_groups} == {1e-3}
    assert {group["lr"] for group in GefenMuonHybrid.from_model(model).param_groups} == {1e-3}
    _construction_rejected(
        lambda: GefenMuonHybrid(model, None, 1e-2),  # type: ignore[misc]
        TypeError,
        "positional",
        model,
    )
    with pytest.raises(TypeError):
        GefenMuonHybrid.from_model(model, 1e-2)  # type: ignore[misc]


@pytest.mark.parametrize(
    "build",
    [
        lambda: GefenMuonHybrid([], lr=1e-2),
        lambda: GefenMuonHybrid(iter(()), lr=1e-2),
        lambda: GefenMuonHybrid([], [], lr=1e-2),
        lambda: GefenMuonHybrid(nn.Module(), lr=1e-2),
        lambda: GefenMuonHybrid(_tiny().requires_grad_(False), lr=1e-2),
        lambda: GefenMuonHybrid(_tiny().requires_grad_(False).named_parameters(), lr=1e-2),
    ],
    ids=[
        "empty-pairs",
        "empty-iterator",
        "two-empty-lists",
        "empty-module",
        "frozen",
        "frozen-pairs",
    ],
)
def test_no_parameters_is_value_error(build: Callable[[], Any]) -> None:
    _construction_rejected(build, ValueError, NO_PARAMETERS)


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
@pytest.mark.parametrize("form", ["module", "from_model", "pairs", "two-lists"])
def test_zero3_placeholder_signature_is_rejected_in_every_form(form: str, backend: str) -> None:
    model = Placeholders()
    pairs = list(model.named_parameters())
    build: dict[str, Callable[[], Any]] = {
        "module": lambda: GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backend),
        "from_model": lambda: GefenMuonHybrid.from_model(model, lr=1e-2, backup_optimizer=backend),
        "pairs": lambda: GefenMuonHybrid(iter(pairs), lr=1e-2, backup_optimizer=backend),
        "two-lists": lambda: GefenMuonHybrid([], pairs, lr=1e-2, backup_optimizer=backend),
    }
    one_d = OneD()
    _construction_rejected(
        build[form],
        ValueError,
        ZERO3,
        model,
        rebuild=lambda: GefenMuonHybrid(one_d, lr=1e-2, backup_optimizer=backend),
    )


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_mixed_zero_numel_set_constructs_and_trains(backend: str) -> None:
    model = OneD()
    model.slot = nn.Parameter(torch.empty(0))
    hybrid = GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backend, fused=False)
    assert hybrid.muon is None
    assert hybrid.backup is not None
    assert any(p is model.slot for p in hybrid.backup.param_groups[0]["params"])
    # An empty slot next to a Muon matrix is not the signature either.
    with_muon = GefenMuonHybrid(
        [("w", _p(4, 4))], [("slot", nn.Parameter(torch.empty(0)))], lr=1e-2, **FAST
    )
    assert with_muon.muon is not None
    assert with_muon.backup is not None
    _trains(hybrid)
    _trains(with_muon)


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_one_d_only_model_builds_backup_only_hybrid(backend: str) -> None:
    model = OneD()
    hybrid = GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backend, fused=False)
    assert hybrid.muon is None
    assert hybrid.backup is not None
    assert hybrid.children == (hybrid.backup,)
    expected = Gefen if backend == "gefen" else torch.optim.AdamW
    assert type(hybrid.backup) is expected
    _trains(hybrid)


# --------------------------------------------------------------------------------------------
# Option checks (§3 checks 1–3, 8) and their order


@pytest.mark.parametrize("name", ["deterministic", "check_finite"])
@pytest.mark.parametrize("value", [1, 0, "yes", None, torch.tensor(True)], ids=repr)
def test_flags_must_be_exact_bools(name: str, value: Any) -> None:
    model = _tiny()
    _construction_rejected(
        lambda: GefenMuonHybrid(model, lr=1e-2, **{name: value}), TypeError, name, model
    )


def test_unknown_backup_optimizer_is_value_error() -> None:
    model = _tiny()
    for value in ("sgd", "AdamW", "Gefen", None):
        _construction_rejected(
            lambda value=value: GefenMuonHybrid(model, lr=1e-2, backup_optimizer=value),
            ValueError,
            f"backup_optimizer must be 'gefen' or 'adamw', got {value!r}",
            model,
        )


@pytest.mark.parametrize(
    ("backend", "option", "value"),
    [
        ("adamw", "backup_1d_period_one", True),
        ("adamw", "backup_2d_period_one", True),
        ("adamw", "backup_factored_v_2d", False),
        ("adamw", "backup_factored_floor", False),
        ("adamw", "backup_nesterov", True),
        ("gefen", "backup_adamw_kwargs", {"foreach": False}),
        ("gefen", "backup_adamw_kwargs", {}),
    ],
    ids=[
        "1d-period-one",
        "2d-period-one",
        "factored-v-2d",
        "factored-floor",
        "nesterov",
        "adamw-kwargs",
        "empty-adamw-kwargs",
    ],
)
def test_backend_specific_options_to_the_other_backend(
    backend: str, option: str, value: Any
) -> None:
    model = _tiny()
    info = _construction_rejected(
        lambda: GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backend, **{option: value}),
        ValueError,
        option,
        model,
    )
    assert backend in str(info.value)


def test_backend_options_matching_their_backend_are_accepted() -> None:
    model = _tiny()
    gefen = GefenMuonHybrid(
        model,
        lr=1e-2,
        backup_1d_period_one=True,
        backup_2d_period_one=True,
        backup_factored_v_2d=False,
        backup_factored_floor=False,
        backup_nesterov=True,
        **FAST,
    )
    adamw = GefenMuonHybrid(
        model, lr=1e-2, backup_optimizer="adamw", backup_adamw_kwargs={"foreach": False}, **FAST
    )
    _trains(gefen)
    _trains(adamw)


def _user_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("adjust", ["original", None])
def test_muon_scale_adjustment_with_shared_lr_warns_once(
    adjust: str | None, no_warnings: list[warnings.WarningMessage]
) -> None:
    hybrid = GefenMuonHybrid(_tiny(), lr=1e-2, adjust_lr_fn=adjust, **FAST)
    messages = _user_warnings(no_warnings)
    assert messages == [
        f"adjust_lr_fn={adjust!r} with a shared lr expects Muon-scale learning rates; use "
        "'match_rms_adamw' or set muon_lr"
    ]
    assert [w.category for w in no_warnings if issubclass(w.category, UserWarning)] == [UserWarning]
    assert hybrid.muon is not None
    assert hybrid.muon.param_groups[0]["adjust_lr_fn"] == adjust


@pytest.mark.parametrize(
    "kwargs",
    [
        {"adjust_lr_fn": "original", "muon_lr": 0.02},
        {"adjust_lr_fn": None, "muon_lr": 0.02},
        {"adjust_lr_fn": "match_rms_adamw"},
        {},
    ],
    ids=["original+muon_lr", "none+muon_lr", "match_rms_adamw", "default"],
)
def test_no_warning_otherwise(
    kwargs: dict[str, Any], no_warnings: list[warnings.WarningMessage]
) -> None:
    GefenMuonHybrid(_tiny(), lr=1e-2, **kwargs, **FAST)
    assert _user_warnings(no_warnings) == []


def test_checks_run_in_the_specified_order(no_warnings: list[warnings.WarningMessage]) -> None:
    model = _tiny()
    empty = nn.Module()
    # 1 before 2–5: a bad flag wins over an unknown backend, backend options and an empty model.
    _construction_rejected(
        lambda: GefenMuonHybrid(empty, lr=1e-2, deterministic=1), TypeError, "deterministic", model
    )
    _construction_rejected(
        lambda: GefenMuonHybrid(model.hidden.weight, lr=1e-2, check_finite="no"),
        TypeError,
        "check_finite",
        model,
    )
    _construction_rejected(
        lambda: GefenMuonHybrid(model, lr=1e-2, deterministic=0, backup_optimizer="sgd"),
        TypeError,
        "deterministic",
        model,
    )
    # 2 before 3 and 4: the backend name wins over a form error and the backend options.
    _construction_rejected(
        lambda: GefenMuonHybrid(model.hidden.weight, lr=1e-2, backup_optimizer="sgd"),
        ValueError,
        "backup_optimizer must be 'gefen' or 'adamw', got 'sgd'",
        model,
    )
    _construction_rejected(
        lambda: GefenMuonHybrid(
            model, lr=1e-2, backup_optimizer="sgd", backup_adamw_kwargs={"foreach": False}
        ),
        ValueError,
        "backup_optimizer must be 'gefen' or 'adamw', got 'sgd'",
        model,
    )
    # 3 before 4, 5 and 7: backend options win over bare tensors, emptiness and a bad split.
    _construction_rejected(
        lambda: GefenMuonHybrid(
            model.hidden.weight, lr=1e-2, backup_optimizer="adamw", backup_1d_period_one=True
        ),
        ValueError,
        "backup_1d_period_one",
        model,
    )
    _construction_rejected(
        lambda: GefenMuonHybrid(empty, lr=1e-2, backup_adamw_kwargs={}),
        ValueError,
        "backup_adamw_kwargs",
        model,
    )
    w = model.hidden.weight
    _construction_rejected(
        lambda: GefenMuonHybrid(
            [("w", w)], [("w2", w)], lr=1e-2, backup_optimizer="adamw", backup_factored_v_2d=False
        ),
        ValueError,
        "backup_factored_v_2d",
        model,
    )
    # 4 before 7: the form error (substrings with two lists) wins over a bad split.
    _construction_rejected(
        lambda: GefenMuonHybrid([("w", w)], [("w2", w)], lr=1e-2, backup_substrings=()),
        TypeError,
        SUBSTRINGS_ONLY,
        model,
    )
    # 6 before 7: the ZeRO-3 signature wins over a duplicate inside the backup list.
    slot = nn.Parameter(torch.empty(0))
    _construction_rejected(
        lambda: GefenMuonHybrid([], [("a", slot), ("b", slot)], lr=1e-2), ValueError, ZERO3, model
    )
    assert _user_warnings(no_warnings) == []
    # 7 before 8: a bad split raises without the learning-rate warning.
    _construction_rejected(
        lambda: GefenMuonHybrid([("w", w)], [("w2", w)], lr=1e-2, adjust_lr_fn="original"),
        ValueError,
        "appears in BOTH the muon and backup lists",
        model,
    )
    assert _user_warnings(no_warnings) == []
    # 8 before 9: the warning is issued, then a child's constructor error propagates; the Muon
    # child is built first, so its error wins over the backup's.
    _construction_rejected(
        lambda: GefenMuonHybrid(
            model, lr=1e-2, adjust_lr_fn="original", momentum=1.5, betas=(1.5, 0.999)
        ),
        ValueError,
        "Invalid momentum value: 1.5",
        model,
    )
    assert len(_user_warnings(no_warnings)) == 1
    with pytest.raises(ValueError) as info:
        Gefen([nn.Parameter(torch.zeros(2))], betas=(1.5, 0.999))
    _construction_rejected(
        lambda: GefenMuonHybrid(model, lr=1e-2, betas=(1.5, 0.999)),
        ValueError,
        str(info.value),
        model,
    )


# --------------------------------------------------------------------------------------------
# Children (§3 fallbacks and deliberate defaults, §4)


def test_muon_child_receives_every_muon_option(no_warnings: list[warnings.WarningMessage]) -> None:
    model = _tiny()
    hybrid = GefenMuonHybrid(
        model,
        lr=1e-2,
        muon_lr=0.02,
        backup_lr=3e-3,
        weight_decay=0.3,
        muon_weight_decay=0.05,
        eps=1e-6,
        muon_eps=1e-5,
        momentum=0.9,
        nesterov=False,
        ns_steps=3,
        ns_schedule="standard",
        adjust_lr_fn="original",
        momentum_codec="codebook8",
        sharded_mode="distributed",
        normuon=True,
        normuon_beta2=0.9,
        normuon_eps=1e-6,
        fused=False,
        stochastic_round=True,
        deterministic=True,
        check_finite=False,
    )
    assert _user_warnings(no_warnings) == []
    muon = hybrid.muon
    assert type(muon) is GefenMuon
    assert len(muon.param_groups) == 1
    group = muon.param_groups[0]
    expected = {
        "lr": 0.02,
        "weight_decay": 0.05,
        "eps": 1e-5,
        "momentum": 0.9,
        "nesterov": False,
        "ns_steps": 3,
        "ns_schedule": "standard",
        "adjust_lr_fn": "original",
        "momentum_codec": "codebook8",
        "sharded_mode": "distributed",
        "normuon": True,
        "normuon_beta2": 0.9,
        "normuon_eps": 1e-6,
        "fused": False,
        "stochastic_round": True,
        "deterministic": True,
        "check_finite": False,
    }
    for key, value in expected.items():
        assert group[key] == value, key
        assert type(group[key]) is type(value), key
        assert muon.defaults[key] == value, key
    assert group["param_names"] == ["hidden.weight"]
    # The backup keeps its own lr, weight decay and eps, and the optimizer-wide flags.
    backup = hybrid.backup
    assert type(backup) is Gefen
    for group in backup.param_groups:
        assert group["lr"] == 3e-3
        assert group["weight_decay"] == 0.3
        assert group["eps"] == 1e-6
        assert group["stochastic_round"] is True
        assert group["deterministic"] is True
        assert group["check_finite"] is False
        assert group["fused"] is False


def test_tuned_schedule_is_forwarded_unchanged() -> None:
    hybrid = GefenMuonHybrid(_tiny(), lr=1e-2, ns_schedule="tuned3", fused=False)
    reference = GefenMuon([_p(8, 8)], ns_schedule="tuned3", fused=False)
    assert hybrid.muon is not None
    group = hybrid.muon.param_groups[0]
    assert group["ns_schedule"] == "tuned3"
    assert group["ns_steps"] == reference.param_groups[0]["ns_steps"]


def test_gefen_backup_receives_its_options() -> None:
    hybrid = GefenMuonHybrid(
        _tiny(),
        lr=1e-2,
        backup_lr=4e-3,
        weight_decay=0.01,
        backup_weight_decay=0.2,
        betas=(0.8, 0.95),
        eps=1e-7,
        backup_1d_period_one=True,
        backup_2d_period_one=True,
        backup_factored_v_2d=False,
        backup_factored_floor=False,
        backup_nesterov=True,
        fused=False,
        stochastic_round=True,
        deterministic=True,
        check_finite=False,
        ns_steps=1,
    )
    backup = hybrid.backup
    assert type(backup) is Gefen
    assert len(backup.param_groups) == 1
    group = backup.param_groups[0]
    expected = {
        "lr": 4e-3,
        "weight_decay": 0.2,
        "betas": (0.8, 0.95),
        "eps": 1e-7,
        "force_1d_period_one": True,
        "force_2d_period_one": True,
        "factored_v_2d": False,
        "factored_floor": False,
        "nesterov": True,
        "fused": False,
        "stochastic_round": True,
        "deterministic": True,
        "check_finite": False,
    }
    for key, value in expected.items():
        assert group[key] == value, key
        assert backup.defaults[key] == value, key
    # Gefen's own defaults apply to everything the hybrid does not set.
    alone = Gefen([nn.Parameter(torch.zeros(3))])
    for key in ("codebook_refresh_every", "momentum_codec"):
        assert group[key] == alone.defaults[key]
    assert hybrid.muon is not None
    assert hybrid.muon.param_groups[0]["weight_decay"] == 0.01


def test_gefen_backup_defaults_match_gefen_alone() -> None:
    hybrid = GefenMuonHybrid(_tiny(), lr=1e-2, **FAST)
    assert hybrid.backup is not None
    group = hybrid.backup.param_groups[0]
    alone = Gefen([nn.Parameter(torch.zeros(3))])
    for key in ("betas", "eps", "factored_v_2d", "force_1d_period_one", "force_2d_period_one"):
        assert group[key] == alone.defaults[key], key
    assert group["factored_v_2d"] is True
    # deliberately not Gefen's default: at the hybrid's Muon-scale rate the look-ahead cost the
    # large harness model 7.6% (docs/hybrid.md §4)
    assert group["nesterov"] is False
    assert alone.defaults["nesterov"] is True


def test_adamw_backup_receives_kwargs_and_named_groups() -> None:
    hybrid = GefenMuonHybrid(
        _tiny(),
        lr=1e-2,
        backup_lr=5e-3,
        betas=(0.85, 0.99),
        eps=1e-6,
        backup_weight_decay=0.07,
        backup_optimizer="adamw",
        backup_adamw_kwargs={"amsgrad": True, "foreach": False, "maximize": False},
        **FAST,
    )
    backup = hybrid.backup
    assert type(backup) is torch.optim.AdamW
    assert hybrid.backup_optimizer == "adamw"
    assert len(backup.param_groups) == 1
    group = backup.param_groups[0]
    assert group["param_names"] == TINY_BACKUP
    assert group["lr"] == 5e-3
    assert group["betas"] == (0.85, 0.99)
    assert group["eps"] == 1e-6
    assert group["weight_decay"] == 0.07
    assert group["amsgrad"] is True
    assert group["foreach"] is False
    # Nothing else is passed: fused stays torch's default.
    assert group["fused"] is torch.optim.AdamW([nn.Parameter(torch.zeros(2))]).defaults["fused"]
    _trains(hybrid)


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_deliberate_defaults_reach_both_children(backend: str) -> None:
    hybrid = GefenMuonHybrid(_tiny(), lr=1e-2, backup_optimizer=backend, **FAST)
    assert hybrid.backup_optimizer == backend
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    muon_group = hybrid.muon.param_groups[0]
    # GefenMuon alone would decay by 0.1, torch's AdamW by 0.01; the hybrid gives both 0.0.
    assert GefenMuon([_p(4, 4)]).defaults["weight_decay"] == 0.1
    assert torch.optim.AdamW([_p(4)]).defaults["weight_decay"] == 0.01
    assert muon_group["weight_decay"] == 0.0
    assert muon_group["eps"] == 1e-7
    assert muon_group["lr"] == 1e-2
    assert muon_group["momentum"] == 0.95
    assert muon_group["nesterov"] is True
    assert muon_group["ns_schedule"] == "standard"
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw"
    # NorMuon is the hybrid's default (GefenMuon alone keeps torch Muon's algorithm).
    assert GefenMuon([_p(4, 4)]).defaults["normuon"] is False
    assert muon_group["normuon"] is True
    assert muon_group["momentum_codec"] == "codebook8"
    assert muon_group["sharded_mode"] == "exact"
    for group in hybrid.backup.param_groups:
        assert group["weight_decay"] == 0.0
        assert group["eps"] == 1e-8
        assert group["betas"] == (0.9, 0.999)
        assert group["lr"] == 1e-2


def test_fallbacks_resolve_from_the_shared_options() -> None:
    hybrid = GefenMuonHybrid(_tiny(), lr=3e-3, weight_decay=0.25, backup_lr=1e-3, **FAST)
    assert hybrid.muon is not None
    assert hybrid.backup is not None
    assert hybrid.muon.param_groups[0]["lr"] == 3e-3
    assert hybrid.muon.param_groups[0]["weight_decay"] == 0.25
    assert hybrid.backup.param_groups[0]["lr"] == 1e-3
    assert hybrid.backup.param_groups[0]["weight_decay"] == 0.25
    other = GefenMuonHybrid(_tiny(), lr=3e-3, weight_decay=0.25, muon_weight_decay=0.0, **FAST)
    assert other.muon is not None
    assert other.backup is not None
    assert other.muon.param_groups[0]["weight_decay"] == 0.0
    assert other.backup.param_groups[0]["weight_decay"] == 0.25
    assert other.backup.param_groups[0]["lr"] == 3e-3


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_no_decay_substrings_split_the_backup(backend: str) -> None:
    model = _tiny()
    hybrid = GefenMuonHybrid(
        model,
        lr=1e-2,
        backup_lr=2e-3,
        weight_decay=0.1,
        backup_weight_decay=0.3,
        betas=(0.8, 0.9),
        eps=1e-7,
        backup_optimizer=backend,
        no_decay_substrings=("BIAS", "Norm"),
        **FAST,
    )
    assert hybrid.backup is not None
    groups = hybrid.backup.param_groups
    assert len(groups) == 2
    named = dict(model.named_parameters())
    assert groups[0]["params"] == [named["embed.weight"], named["lm_head.weight"]]
    assert groups[1]["params"] == [named["hidden.bias"], named["norm.weight"], named["norm.bias"]]
    assert groups[0]["weight_decay"] == 0.3
    assert groups[1]["weight_decay"] == 0.0
    for group in groups:
        assert group["lr"] == 2e-3
        assert group["betas"] == (0.8, 0.9)
        assert group["eps"] == 1e-7
    if backend == "adamw":
        assert groups[0]["param_names"] == ["embed.weight", "lm_head.weight"]
        assert groups[1]["param_names"] == ["hidden.bias", "norm.weight", "norm.bias"]
    # The Muon child never splits.
    assert hybrid.muon is not None
    assert len(hybrid.muon.param_groups) == 1
    assert hybrid.muon.param_groups[0]["weight_decay"] == 0.1
    _trains(hybrid)


@pytest.mark.parametrize("backend", ["gefen", "adamw"])
def test_no_decay_empty_groups_are_omitted(backend: str) -> None:
    model = _tiny()
    everything = GefenMuonHybrid(
        model,
        lr=1e-2,
        weight_decay=0.2,
        backup_optimizer=backend,
        no_decay_substrings=("weight", "bias"),
        **FAST,
    )
    assert everything.backup is not None
    assert len(everything.backup.param_groups) == 1
    assert everything.backup.param_groups[0]["weight_decay"] == 0.0
    assert len(everything.backup.param_groups[0]["params"]) == 5
    nothing = GefenMuonHybrid(
        model,
        lr=1e-2,
        weight_decay=0.2,
        backup_optimizer=backend,
        no_decay_substrings=("zzz",),
        **FAST,
    )
    assert nothing.backup is not None
    assert len(nothing.backup.param_groups) == 1
    assert nothing.backup.param_groups[0]["weight_decay"] == 0.2
    without = GefenMuonHybrid(model, lr=1e-2, weight_decay=0.2, backup_optimizer=backend, **FAST)
    assert without.backup is not None
    assert len(without.backup.param_groups) == 1
    assert without.backup.param_groups[0]["weight_decay"] == 0.2
    _trains(everything)
    _trains(nothing)
