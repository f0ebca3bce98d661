"""Every state tensor of a checkpoint entry must be a dense strided tensor holding data: a sparse
or meta tensor is rejected at load with ``ValueError("<Owner> checkpoint: entry …")`` naming the
key, nothing changes, and the optimizer still trains (it used to load a sparse tensor and then
fail every step, and to surface a meta tensor as torch's NotImplementedError)."""

from __future__ import annotations

import pytest
import torch

from gefen.core import Gefen
from gefen.core.testing import rejects, takes_a_step


def _trained(kind: str, factored: bool) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16))]
    if kind == "gefen":
        optimizer: torch.optim.Optimizer = Gefen(params, lr=1e-2, factored_v_2d=factored)
    else:  # the same validator serves GefenMuon; runs where gefen-muon is installed too
        muon = pytest.importorskip("gefen.muon")
        optimizer = muon.GefenMuon(params, lr=1e-2)
    takes_a_step(optimizer, params)
    return optimizer, params


def _corrupt(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "sparse":
        return tensor.to_sparse()
    return torch.empty_like(tensor, device="meta")


CASES = [
    ("gefen", True, "momentum_codes"),
    ("gefen", True, "momentum_scale"),
    ("gefen", True, "v_row"),
    ("gefen", True, "v_col"),
    ("gefen", False, "v_block"),
    ("gefen_muon", False, "momentum_codes"),
    ("gefen_muon", False, "momentum_scale"),
]


@pytest.mark.parametrize(("kind", "factored", "key"), CASES)
@pytest.mark.parametrize("layout", ["sparse", "meta"])
def test_a_sparse_or_meta_state_tensor_is_rejected_at_load(kind, factored, key, layout) -> None:
    optimizer, params = _trained(kind, factored)
    saved = optimizer.state_dict()
    entry = saved["state"][0]
    assert key in entry
    entry[key] = _corrupt(entry[key], layout)
    owner = "Gefen" if kind == "gefen" else "GefenMuon"
    expected = "must be a dense strided tensor" if layout == "sparse" else "must hold data"
    info = rejects(optimizer, lambda: optimizer.load_state_dict(saved), ValueError, expected)
    assert str(info.value).startswith(f"{owner} checkpoint: entry param_groups[0][0]: '{key}'")
    takes_a_step(optimizer, params)
