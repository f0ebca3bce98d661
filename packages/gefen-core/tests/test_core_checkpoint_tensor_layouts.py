"""Meta and sparse tensors anywhere in a Gefen checkpoint are refused as
``ValueError("Gefen checkpoint: …")`` naming what is wrong, before anything changes (they used to
raise torch's NotImplementedError from inside the comparison of the extras copies)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from gefen.core import Gefen


def _trained() -> tuple[Gefen, dict[str, Any]]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = Gefen([param], lr=0.05)
    param.grad = torch.randn(6, 4)
    optimizer.step()
    return optimizer, optimizer.state_dict()


def _bad(codebook: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(codebook, device="meta") if kind == "meta" else codebook.to_sparse()


@pytest.mark.parametrize("kind", ["meta", "sparse"])
@pytest.mark.parametrize("where", ["top-level", "group copy", "every copy"])
def test_a_meta_or_sparse_codebook_is_refused_by_name(kind: str, where: str, rejects: Any) -> None:
    optimizer, saved = _trained()
    state = copy.deepcopy(saved)
    bad = _bad(state["gefen"]["codebook"], kind)
    if where != "group copy":
        state["gefen"]["codebook"] = bad
    if where != "top-level":
        for group in state["param_groups"]:
            group["gefen"]["codebook"] = bad
    rule = "codebook must hold data" if kind == "meta" else "codebook must be a strided"
    rule = f"invalid codebook: {rule}"
    message = f"Gefen checkpoint: {rule if where == 'every copy' else 'extras copies differ'}"
    rejects(optimizer, lambda: optimizer.load_state_dict(state), ValueError, message)
