"""DCP file checkpoints into a freshly built Gefen, in one process (docs/core.md §8.7).

torchtitan's resume: ``sd = get_optimizer_state_dict(model, fresh)``, ``dcp.load({"optim": sd})``,
``set_optimizer_state_dict(model, fresh, sd)``. DCP fills the template's tensors in place and
refuses a tensor whose saved shape differs, so format 2 must give a fresh optimizer every slot a
trained one saves, and the load must reject a damaged format 2 entry with nothing changed.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gefen.core import Gefen

OPTIONS = [
    {},
    {"momentum_codec": "none"},
    {"factored_v_2d": False},
    {"stochastic_round": True},
    {"force_1d_period_one": True},
]


class _Net(torch.nn.Module):
    """Matrices (one block per row), vectors (searched periods), a 3-D tensor, and a parameter
    that never gets a gradient (its entry stays pristine)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.last = torch.nn.Linear(16, 4)
        self.cube = torch.nn.Parameter(torch.randn(2, 4, 4))
        self.unused = torch.nn.Parameter(torch.randn(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.norm(torch.tanh(self.first(x)))
        return self.last(mixed) + (self.cube.sum(0) @ mixed[:, :4].T).T.sum()


def _index(name: str) -> int:
    """The state_dict index of a parameter of ``_Net`` (its position in ``parameters()``)."""
    return [key for key, _ in _Net(seed=0).named_parameters()].index(name)


def _train(model: torch.nn.Module, optimizer: Gefen, seeds: range) -> None:
    for seed in seeds:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _fresh(options: dict[str, Any], trained: torch.nn.Module) -> tuple[_Net, Gefen]:
    model = _Net(seed=99)
    model.load_state_dict(trained.state_dict())
    return model, Gefen(model.parameters(), lr=0.01, **options)


def _save(model: torch.nn.Module, optimizer: Gefen, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own warnings about one-process use
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))


def _load(model: torch.nn.Module, optimizer: Gefen, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        template = get_optimizer_state_dict(model, optimizer)
        dcp.load({"optim": template}, checkpoint_id=str(path))
        set_optimizer_state_dict(model, optimizer, template)


@pytest.mark.parametrize("options", OPTIONS, ids=[str(o) for o in OPTIONS])
def test_a_fresh_optimizer_resumes_a_dcp_file_bit_exactly(
    options: dict[str, Any], tmp_path: Path
) -> None:
    model = _Net(seed=0)
    optimizer = Gefen(model.parameters(), lr=0.01, **options)
    _train(model, optimizer, range(3))
    _save(model, optimizer, tmp_path)
    resumed_model, resumed = _fresh(options, model)
    _load(resumed_model, resumed, tmp_path)
    assert resumed.global_step == 3
    for ours, theirs in zip(optimizer.state.values(), resumed.state.values(), strict=True):
        assert ours.keys() == theirs.keys()
        for key, value in ours.items():
            other = theirs[key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert resumed.state[resumed_model.unused] == {"period": 0}
    _train(model, optimizer, range(3, 6))
    _train(resumed_model, resumed, range(3, 6))
    for ours, theirs in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_the_fresh_template_has_every_slot_a_trained_optimizer_saves() -> None:
    trained_model = _Net(seed=0)
    trained = Gefen(trained_model.parameters(), lr=0.01)
    _train(trained_model, trained, range(2))
    _model, fresh = _fresh({}, trained_model)
    saved, template = trained.state_dict(), fresh.state_dict()
    assert template["gefen"]["codebook_present"] == 0
    assert tuple(template["gefen"]["codebook"].shape) == (256,)
    for index, entry in saved["state"].items():
        slots = template["state"][index]
        assert entry.keys() == slots.keys(), index
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert (value.shape, value.dtype) == (slots[key].shape, slots[key].dtype), key
    # building the template learned nothing and changed nothing
    assert fresh.global_step == 0
    assert fresh.codebook is None
    assert all(entry == {"period": 0} for entry in fresh.state.values())


def test_matrices_take_one_block_per_row_and_vectors_are_searched() -> None:
    model = _Net(seed=0)
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, range(1))
    periods = {name: optimizer.state[p]["period"] for name, p in model.named_parameters()}
    assert periods["first.weight"] == 8
    assert periods["last.weight"] == 16
    assert periods["cube"] == 16  # a (2, 4, 4) tensor: rows of 16 elements
    assert periods["unused"] == 0
    group = optimizer.param_groups[0]
    assert optimizer.template_period(group, model.first.bias) is None  # searched
    assert optimizer.template_period(group, torch.nn.Parameter(torch.zeros(300, 4))) is None
    saved = optimizer.state_dict()["state"]
    bias = saved[_index("first.bias")]  # 16 elements: codes and per-block tensors in (16, 1) slots
    assert bias["period"] == optimizer.state[model.first.bias]["period"]
    assert tuple(bias["momentum_codes"].shape) == tuple(bias["momentum_scale"].shape) == (16, 1)


def _trained_sd() -> tuple[dict[str, Any], Gefen]:
    model = _Net(seed=0)
    optimizer = Gefen(model.parameters(), lr=0.01)
    _train(model, optimizer, range(3))
    return optimizer.state_dict(), optimizer


def _both(sd: dict[str, Any], key: str, value: Any) -> None:
    for extras in (sd["gefen"], *(group["gefen"] for group in sd["param_groups"])):
        extras[key] = copy.deepcopy(value)


def _past_blocks(sd: dict[str, Any]) -> None:
    sd["state"][_index("first.bias")]["momentum_scale"][-1] = 1.0  # a searched period above 1


def _pristine_not_zero(sd: dict[str, Any]) -> None:
    sd["state"][_index("unused")]["momentum_codes"][0] = 3  # never stepped: step 0


def _slot_shape(sd: dict[str, Any]) -> None:
    sd["state"][_index("first.bias")]["v_block"] = torch.zeros(4, 1)


FORMAT2_REJECTIONS = [
    ("presence not int", lambda sd: _both(sd, "codebook_present", True), "'codebook_present'"),
    ("presence missing", lambda sd: _both(sd, "codebook_present", None), "'codebook_present'"),
    ("absent but filled", lambda sd: _both(sd, "codebook_present", 0), "not 256 zeros"),
    ("present but zeros", lambda sd: _both(sd, "codebook", torch.zeros(256)), "invalid codebook"),
    ("past its blocks", _past_blocks, "holds values past its"),
    ("pristine not zero", _pristine_not_zero, "a step-0 entry must hold zeros"),
    ("slot shape", _slot_shape, "must be the (16, 1) slot of a searched period"),
    ("flags as positions", lambda sd: _both(sd, "initialized_params", [0, 1]), "must be 8 flags"),
    ("flag not 0 or 1", lambda sd: _both(sd, "initialized_params", [1] * 6 + [2, 0]), "0 or 1"),
    (
        "a flag per parameter of another optimizer",  # the message said nothing of the count
        lambda sd: _both(sd, "initialized_params", [0] * 9),
        "must be 8 flags, each the int 0 or 1; got 9: a file of an optimizer over 9 parameters",
    ),
]


@pytest.mark.parametrize(
    ("name", "mutator", "fragment"), FORMAT2_REJECTIONS, ids=[r[0] for r in FORMAT2_REJECTIONS]
)
def test_a_damaged_format2_checkpoint_is_rejected_without_change(
    name: str, mutator: Any, fragment: str, rejects: Any
) -> None:
    sd, _ = _trained_sd()
    sd = copy.deepcopy(sd)
    assert sd["gefen"]["format_version"] == 2
    mutator(sd)
    model = _Net(seed=1)
    target = Gefen(model.parameters(), lr=0.01)
    _train(model, target, range(2))
    rejects(target, lambda: target.load_state_dict(sd), ValueError, fragment)


def test_a_format1_checkpoint_still_loads() -> None:
    from gefen.core.testing import format1_state_dict

    sd, source = _trained_sd()
    old = format1_state_dict(source, sd)
    assert old["gefen"]["format_version"] == 1
    assert "codebook_present" not in old["gefen"]
    assert old["state"][_index("unused")] == {"period": 0}
    model = _Net(seed=1)
    target = Gefen(model.parameters(), lr=0.01)
    target.load_state_dict(old)
    assert target.global_step == 3
    assert torch.equal(target.codebook, source.codebook)


MISFITS = [
    ({"momentum_codec": "none"}, "another codec"),
    ({"factored_v_2d": False}, "another second-moment family"),
    ({"force_2d_period_one": True}, "another period for the matrices"),
]


@pytest.mark.parametrize(("live", "what"), MISFITS, ids=[m[1] for m in MISFITS])
def test_a_dcp_file_that_does_not_fit_is_refused_with_nothing_changed(
    live: dict[str, Any], what: str, tmp_path: Path
) -> None:
    """DCP's planner refuses the file before our load runs (a key the template needs is missing,
    or a shape differs); the live optimizer, trained or fresh, is untouched and still trains."""
    from gefen.core.testing import SNAPSHOT_ATTRIBUTES
    from gefen.dist.testing import assert_unchanged, deep_snapshot

    model = _Net(seed=0)
    source = Gefen(model.parameters(), lr=0.01)
    _train(model, source, range(2))
    _save(model, source, tmp_path)
    for steps in (0, 2):
        target_model, target = _fresh(live, model)
        _train(target_model, target, range(10, 10 + steps))
        before = deep_snapshot(target, attributes=SNAPSHOT_ATTRIBUTES)
        with pytest.raises(CheckpointException) as refused:
            _load(target_model, target, tmp_path)
        causes = " ".join(str(failure[0]) for failure in refused.value.failures.values())
        assert "Missing key" in causes or "Size mismatch" in causes, causes
        assert_unchanged(before, deep_snapshot(target, attributes=SNAPSHOT_ATTRIBUTES))
        step = target.global_step
        _train(target_model, target, range(20, 21))
        assert target.global_step == step + 1


def test_a_dcp_file_of_a_parameter_frozen_after_training_is_refused_naming_it(
    tmp_path: Path, rejects: Any
) -> None:
    # The refusal named a position only, not the frozen parameter nor the way out.
    model = _Net(seed=0)
    source = Gefen(model.parameters(), lr=0.01)
    _train(model, source, range(2))
    model.first.weight.requires_grad_(False)
    _train(model, source, range(2, 3))
    _save(model, source, tmp_path)
    target_model, target = _fresh({}, model)
    target_model.first.weight.requires_grad_(False)

    def template() -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            filled = get_optimizer_state_dict(target_model, target)
            dcp.load({"optim": filled}, checkpoint_id=str(tmp_path))
        return filled

    filled, at = template(), _index("first.weight")
    rejects(
        target,
        lambda: set_optimizer_state_dict(target_model, target, filled),
        ValueError,
        f"initialized_params lists position {at} but its entry is not initialized (param_groups"
        f"[0][{at}] is frozen: DCP loads no state of a frozen parameter; make it trainable for "
        "the load)",
    )
    target_model.first.weight.requires_grad_(True)  # the way out the message names
    target.load_state_dict(template())
    assert torch.equal(target.state[target_model.first.weight]["momentum_codes"],
                       source.state[model.first.weight]["momentum_codes"])  # fmt: skip


class _Renamed(_Net):
    """``_Net`` with ``last`` renamed (the same parameters, in the same order)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.final = self.last
        del self.last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.norm(torch.tanh(self.first(x)))
        return self.final(mixed) + (self.cube.sum(0) @ mixed[:, :4].T).T.sum()


def test_a_non_strict_dcp_load_of_a_renamed_parameter_is_refused_naming_it(
    tmp_path: Path, rejects: Any
) -> None:
    """A module renamed since the save, loaded with ``strict=False``: the file has no state for
    the parameter under its new name, and the refusal named a position only ("initialized_params
    lists position 3 but its entry is not initialized"). It names the parameter and the likely
    cause; nothing changes, and the optimizer trains on."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model = _Net(seed=0)
    source = Gefen(model.parameters(), lr=0.01)
    _train(model, source, range(2))
    _save(model, source, tmp_path)
    renamed = _Renamed(seed=1)
    target = Gefen(renamed.parameters(), lr=0.01)
    options = StateDictOptions(strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        template = {"optim": get_optimizer_state_dict(renamed, target, options=options)}
        planner = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load(template, checkpoint_id=str(tmp_path), planner=planner)
    at = [name for name, _ in renamed.named_parameters()].index("final.weight")
    rejects(
        target,
        lambda: set_optimizer_state_dict(renamed, target, template["optim"], options=options),
        ValueError,
        f"initialized_params lists position {at} but its entry is not initialized (param_groups"
        f"[0][{at}] has no state in the file: renamed, or added since the save? (strict=False "
        "skips it))",
    )


def test_a_full_state_dict_loads_through_torch_into_a_fresh_optimizer() -> None:
    """torch's full-state-dict round trip (``StateDictOptions(full_state_dict=True)`` both ways)
    into a freshly built Gefen: its flattening matches lists item by item, so format 2's
    ``initialized_params`` is one flag per parameter; the run continues bit for bit."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    model = _Net(seed=0)
    source = Gefen(model.parameters(), lr=0.01)
    _train(model, source, range(3))
    full = get_optimizer_state_dict(model, source, options=options)
    twin = _Net(seed=0)
    twin.load_state_dict(model.state_dict())
    target = Gefen(twin.parameters(), lr=0.01)
    set_optimizer_state_dict(twin, target, full, options=options)
    assert target.global_step == 3
    _train(model, source, range(3, 5))
    _train(twin, target, range(3, 5))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


FLATTENED_HINT = (
    "its groups hold exactly the live groups' keys, as a DCP state dict set with "
    "StateDictOptions(flatten_optimizer_state_dict=True) does"
)


def test_a_flattened_dcp_state_dict_is_refused_naming_the_option(rejects: Any) -> None:
    """torchtitan flattens by default. torch rebuilds a flattened state dict from the keys the
    live optimizer holds, so a fresh Gefen receives no extras and no momentum: refused, as
    before, but the message named only "another optimizer's checkpoint"."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _Net(seed=0)
    source = Gefen(model.parameters(), lr=0.01)
    _train(model, source, range(2))
    flat = get_optimizer_state_dict(model, source, options=options)
    twin, target = _fresh({}, model)
    rejects(
        target,
        lambda: set_optimizer_state_dict(twin, target, flat, options=options),
        ValueError,
        FLATTENED_HINT,
    )


def test_another_optimizers_checkpoint_gets_no_flattening_hint() -> None:
    model = _Net(seed=0)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, adamw, range(1))  # type: ignore[arg-type]
    _, target = _fresh({}, model)
    with pytest.raises(ValueError, match="extras 'gefen' missing") as info:
        target.load_state_dict(adamw.state_dict())
    assert "flatten_optimizer_state_dict" not in str(info.value)


PLAIN_DCP_HINT = "a plain state_dict() after torch.distributed.checkpoint"


def test_a_plain_state_dict_through_a_dcp_file_is_refused_naming_the_route(
    tmp_path: Path, rejects: Any
) -> None:
    """torch's AdamW survives ``dcp.save({"o": opt.state_dict()})`` and a load into a fresh
    ``state_dict()`` (its counters are tensors); ours are Python ints, which DCP writes beside
    the template under string ids. The load was refused with "a step-0 entry must hold
    zeros", which named neither the cause nor the route that works."""
    model = _Net(seed=0)
    source = Gefen(model.parameters(), lr=0.01)
    _train(model, source, range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"o": source.state_dict()}, checkpoint_id=str(tmp_path))
        _, target = _fresh({}, model)
        template = {"o": target.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path))
    rejects(
        target,
        lambda: target.load_state_dict(template["o"]),
        ValueError,
        f"{PLAIN_DCP_HINT} (dcp.load fills",
    )
    with pytest.raises(ValueError, match="get_optimizer_state_dict and set_optimizer_state_dict"):
        target.load_state_dict(template["o"])
