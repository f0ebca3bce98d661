"""The contract (docs/core.md §10; §12 #54)."""

from __future__ import annotations

import torch

from gefen.contracts import ParameterLayout
from gefen.contracts.conformance import check_provider, check_state_dict, match_state_variant
from gefen.core import Gefen
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot


def _trained(**options) -> Gefen:
    params = [
        torch.nn.Parameter(torch.randn(8, 16)),
        torch.nn.Parameter(torch.randn(24)),
        torch.nn.Parameter(torch.randn(2, 3, 4)),
        torch.nn.Parameter(torch.randn(5)),  # stays pristine: never gets a gradient
    ]
    optimizer = Gefen(
        [{"params": params[:2]}, {"params": params[2:], "factored_v_2d": False}], **options
    )
    for _ in range(2):
        for p in params[:3]:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return optimizer


def _check(optimizer: Gefen, expected: dict[int, str]) -> None:
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    contract = check_provider(optimizer)
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert contract.implementation == "gefen.core.Gefen"
    sd = optimizer.state_dict()
    layouts = dict.fromkeys(sd["state"], ParameterLayout.REPLICATED)
    ndims = {
        i: p.dim() for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
    }
    matched = check_state_dict(contract, sd, parameter_layouts=layouts, ndims=ndims)
    assert dict(matched.items()) == {k: (v,) for k, v in expected.items()}
    for key, entry in sd["state"].items():
        variants = match_state_variant(
            contract.state_layout,
            entry,
            parameter_layout=ParameterLayout.REPLICATED,
            ndim=ndims[key],
        )
        assert len(variants) == 1


# Format 2 saves a pristine entry complete (step 0, zeros), so it matches its codec's variant.
def test_codebook8_entries_match_exactly_one_variant() -> None:
    _check(_trained(), {0: "q8_factored", 1: "q8_block", 2: "q8_block", 3: "q8_block"})


def test_none_codec_entries_match_exactly_one_variant() -> None:
    _check(
        _trained(momentum_codec="none"),
        {0: "fp32_factored", 1: "fp32_block", 2: "fp32_block", 3: "fp32_block"},
    )


def test_local_shard_variant_is_selected_by_layout() -> None:
    optimizer = _trained(factored_v_2d=False)
    contract = optimizer.optimizer_contract()
    entry = optimizer.state_dict()["state"][1]
    names = [
        v.name
        for v in match_state_variant(
            contract.state_layout, entry, parameter_layout=ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
        )
    ]
    assert names == ["q8_block_local"]
    assert all(v.name != "q8_factored" for v in contract.state_layout.parameter_variants)
