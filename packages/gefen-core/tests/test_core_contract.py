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


def test_entries_left_factored_by_a_family_edit_stay_declared() -> None:
    # docs/core.md §8.4: an edit to the block family migrates each entry at its next update;
    # the contract dropped the factored variant at once, and the optimizer's own state_dict
    # (an entry without a gradient since keeps v_row and v_col) then failed it.
    a, b = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(6, 4))
    optimizer = Gefen([a, b], lr=1e-2)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    optimizer.step()
    optimizer.param_groups[0]["factored_v_2d"] = False
    a.grad, b.grad = torch.randn_like(a), None
    optimizer.step()
    assert "v_row" in optimizer.state[b]
    assert "v_row" not in optimizer.state[a]
    matched = check_state_dict(
        check_provider(optimizer),
        optimizer.state_dict(),
        ndims={0: 2, 1: 2},
        parameter_layouts=dict.fromkeys((0, 1), ParameterLayout.REPLICATED),
    )
    assert matched == {0: ("q8_block",), 1: ("q8_factored",)}


def test_the_native_checkpoint_claims_dcp_resharding_of_row_sharded_state() -> None:
    # docs/core.md §9.1: DCP reshards row-sharded state to any world size; the contract said
    # nothing of it, an explicit "unsupported".
    from gefen.contracts import CheckpointTransport, TopologyChange

    native = next(
        entry
        for entry in check_provider(_trained()).capabilities.checkpoints
        if entry.transport is CheckpointTransport.NATIVE_OPTIMIZER
    )
    assert native.topology_changing == {ParameterLayout.DTENSOR_1D_DEFAULT_WORLD}
    assert native.topology_change_kinds == {TopologyChange.PLACEMENT_RESHARD}
