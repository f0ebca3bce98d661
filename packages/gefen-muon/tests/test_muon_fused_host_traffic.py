"""What GefenMuon's compiled momentum sends between the host and the device: the code path
CUDA runs, measured on the CPU (see gefen-core's test_core_fused_host_traffic)."""

from __future__ import annotations

import torch

from gefen.core.testing import compiled_path_only, fill_grads, host_traffic
from gefen.muon import GefenMuon


def test_the_compiled_momentum_moves_no_scalars_in_steady_state(monkeypatch) -> None:
    compiled_path_only(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    shapes = [(48, 40), (64, 64), (32, 48), (40, 96), (64, 32)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    optimizer = GefenMuon(params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):  # codebook learning and the first steps behind us
        fill_grads(params, step)
        optimizer.step()
    for step in range(3, 5):
        fill_grads(params, step)
        with host_traffic(monkeypatch) as counts:
            optimizer.step()
        assert counts["tensor"] == 0, counts
        assert counts["read"] <= 1, counts
