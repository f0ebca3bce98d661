"""A checkpoint whose counters no run produces is rejected at load: an entry updated more often
than the optimizer stepped (``step`` above ``global_step``, including initialized entries under
``global_step = 0``). Nothing changes and the optimizer still trains."""

from __future__ import annotations

import pytest
import torch

from gefen.core import Gefen
from gefen.core.testing import rejects, takes_a_step


def _trained(kind: str) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(32))]
    if kind == "gefen":
        optimizer: torch.optim.Optimizer = Gefen(params, lr=1e-2)
    else:
        muon = pytest.importorskip("gefen.muon")
        params = params[:1]
        optimizer = muon.GefenMuon(params, lr=1e-2)
    for seed in range(2):
        takes_a_step(optimizer, params, seed=seed)
    return optimizer, params


def _set_global_step(sd: dict, value: int) -> None:
    for extras in (sd["gefen"], *(group["gefen"] for group in sd["param_groups"])):
        extras["global_step"] = value


@pytest.mark.parametrize("kind", ["gefen", "gefen_muon"])
@pytest.mark.parametrize("case", ["entry_ahead", "global_step_zero"])
def test_counters_no_run_produces_are_rejected(kind: str, case: str) -> None:
    optimizer, params = _trained(kind)
    saved = optimizer.state_dict()
    if case == "entry_ahead":
        saved["state"][0]["step"] = saved["gefen"]["global_step"] + 1
    else:
        _set_global_step(saved, 0)
    owner = "Gefen" if kind == "gefen" else "GefenMuon"
    info = rejects(optimizer, lambda: optimizer.load_state_dict(saved), ValueError, "exceeds")
    assert str(info.value).startswith(f"{owner} checkpoint: entry 0: 'step' ")
    takes_a_step(optimizer, params)
    optimizer.load_state_dict(optimizer.state_dict())  # a real checkpoint still loads
