"""The state codec: the one entry validator and allocation (docs/core.md §3.2, §8.3, §8.4)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gefen.core import Gefen
from gefen.core.state import CodecKeys, EntrySpec, allocate_entry, migrate_family, validate_entry
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot

GEFEN = CodecKeys()
MUON = CodecKeys(dense="momentum_buffer")


def _spec(**overrides) -> EntrySpec:
    base = {
        "numel": 24,
        "matrix_shape": (4, 6),
        "codec_keys": GEFEN,
        "dense_dtype": torch.float32,
        "dense_shape": None,
        "second_moment": "factored",
    }
    base.update(overrides)
    return EntrySpec(**base)


@pytest.mark.parametrize(
    ("codebook8", "family", "variant"),
    [
        (True, "block", "q8_block"),
        (True, "factored", "q8_factored"),
        (False, "block", "fp32_block"),
    ],
)
def test_allocated_entries_validate_as_their_variant(codebook8, family, variant) -> None:
    spec = _spec(second_moment=family)
    entry = allocate_entry(spec, 6, codebook8=codebook8, device=torch.device("cpu"))
    entry["step"] = 1
    assert validate_entry(entry, where="x", **spec.kwargs()) == variant
    assert validate_entry({"period": 0}, where="x", **spec.kwargs()) == "uninitialized"
    assert validate_entry({"period": 6}, where="x", **spec.kwargs()) == "uninitialized"


def test_other_family_accepted_for_migration_and_migrated() -> None:
    block = _spec(second_moment="block")
    entry = allocate_entry(block, 4, codebook8=True, device=torch.device("cpu"))
    entry.update(step=5, v_step=5)
    entry["v_block"] += 1.0
    factored = _spec(second_moment="factored")
    assert validate_entry(entry, where="x", **factored.kwargs()) == "q8_block"
    migrated = migrate_family(entry, factored, torch.device("cpu"))
    assert migrated["step"] == 5
    assert migrated["v_step"] == 5  # the statistics carry over, and their age with them
    assert "v_block" not in migrated
    assert torch.equal(migrated["v_row"], torch.ones(4))
    assert torch.equal(migrated["v_col"], torch.ones(6))
    assert validate_entry(migrated, where="x", **factored.kwargs()) == "q8_factored"
    with pytest.raises(ValueError, match="state does not match parameter"):
        validate_entry(
            migrated, where="x", **_spec(matrix_shape=None, second_moment="block").kwargs()
        )


def test_a_migrated_family_holds_the_old_familys_picture_averaged_its_own_way() -> None:
    # It held zeros beside the kept momentum: wherever the next gradient was zero, the step
    # divided that momentum by eps alone (a parameter moved by about 1e4 at lr 0.01).
    block, factored = _spec(second_moment="block"), _spec(second_moment="factored")
    entry = allocate_entry(factored, 4, codebook8=True, device=torch.device("cpu"))
    entry.update(step=3, v_step=2)
    entry["v_row"] += torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3
    entry["v_col"] += torch.arange(1.0, 7.0)
    estimate = (entry["v_row"] / 3.0).unsqueeze(1) * entry["v_col"]  # §6.2's (4, 6) picture
    to_block = migrate_family(entry, block, torch.device("cpu"))
    assert to_block["v_step"] == 2
    assert torch.allclose(to_block["v_block"], estimate.reshape(6, 4).mean(dim=1, keepdim=True))
    assert validate_entry(to_block, where="x", **block.kwargs()) == "q8_block"
    back = migrate_family(to_block, factored, torch.device("cpu"))
    picture = to_block["v_block"].expand(6, 4).reshape(4, 6)
    assert torch.allclose(back["v_row"], picture.mean(dim=1))
    assert torch.allclose(back["v_col"], picture.mean(dim=0))
    assert validate_entry(back, where="x", **factored.kwargs()) == "q8_factored"


def test_muon_style_entry_without_second_moment_and_extra_pairs() -> None:
    spec = _spec(
        codec_keys=MUON,
        dense_dtype=torch.bfloat16,
        dense_shape=(4, 6),
        second_moment=None,
        extra_pairs={"normuon_v": ((4, 1), torch.float32), "normuon_step": ((), torch.int64)},
    )
    entry = {"period": 1, "step": 2, "momentum_buffer": torch.zeros(4, 6, dtype=torch.bfloat16)}
    assert validate_entry(entry, where="m", **spec.kwargs()) == "fp32"
    entry.update(normuon_v=torch.zeros(4, 1), normuon_step=3)
    assert validate_entry(entry, where="m", **spec.kwargs()) == "fp32"
    entry["v_step"] = 1
    with pytest.raises(ValueError, match="m: unknown state key 'v_step'"):
        validate_entry(entry, where="m", **spec.kwargs())


def _trained() -> tuple[Gefen, dict]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(16))]
    optimizer = Gefen(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return optimizer, optimizer.state_dict()


CORRUPTIONS = {
    "drop": lambda value: None,
    "float64": lambda value: value.double() if isinstance(value, torch.Tensor) else 1.5,
    "reshape": lambda value: value.unsqueeze(0) if isinstance(value, torch.Tensor) else -1,
    "negate": lambda value: -value.float() - 1 if isinstance(value, torch.Tensor) else -value - 1,
    "bool": lambda value: True,
}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    index=st.sampled_from([0, 1]),
    key=st.sampled_from(
        [
            "period",
            "step",
            "momentum_codes",
            "momentum_scale",
            "v_row",
            "v_col",
            "v_block",
            "v_step",
        ]
    ),
    kind=st.sampled_from(sorted(CORRUPTIONS)),
)
def test_corrupted_entries_never_load_and_change_nothing(index: int, key: str, kind: str) -> None:
    optimizer, sd = _trained()
    corrupted = copy.deepcopy(sd)
    entry = corrupted["state"][index]
    if key not in entry:
        entry[key] = torch.zeros(1)
    else:
        value = CORRUPTIONS[kind](entry[key])
        if value is None:
            del entry[key]
        else:
            entry[key] = value
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(ValueError, match="Gefen checkpoint: "):
        optimizer.load_state_dict(corrupted)
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
