"""Meta and sparse codebooks in a GefenMuon checkpoint are refused as
``ValueError("GefenMuon checkpoint: …")`` before anything changes (they used to raise torch's
NotImplementedError), and the optimizer trains afterwards."""

from __future__ import annotations

import copy

import pytest
import torch

from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot
from gefen.muon import GefenMuon


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_a_meta_or_sparse_codebook_is_refused_by_name(kind: str) -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = GefenMuon([param], lr=0.02)
    param.grad = torch.randn(8, 4)
    optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    codebook = state["gefen"]["codebook"]
    bad = torch.empty_like(codebook, device="meta") if kind == "meta" else codebook.to_sparse()
    state["gefen"]["codebook"] = bad
    for group in state["param_groups"]:
        group["gefen"]["codebook"] = bad
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(ValueError, match=r"^GefenMuon checkpoint: invalid codebook: codebook must"):
        optimizer.load_state_dict(state)
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    value = param.detach().clone()
    param.grad = torch.randn(8, 4)
    optimizer.step()
    assert not torch.equal(value, param.detach())
