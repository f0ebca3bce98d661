"""What the compiled (inductor) step sends between the host and the device: the code path CUDA
runs, measured on the CPU.

On CUDA, a tensor made from host values (``torch.tensor(..., device=...)``) is a copy from
pageable memory that synchronizes the stream, and ``item()`` / ``tolist()`` wait for the
device. Either one per parameter or chunk would stall the host behind the GPU throughout the
step, so the steady-state step makes them per group and per step only.
"""

from __future__ import annotations

import torch

from gefen.core import Gefen
from gefen.core.compiled import DeviceScalars
from gefen.core.testing import compiled_path_only, fill_grads, host_traffic

# Enough parameters (block and factored, several chunks in none) that one host transfer per
# parameter could not hide under the bounds below.
SHAPES = [(48, 40), (96,), (64, 64), (300,), (24, 64), (40,), (32, 48), (128,)]


def test_the_compiled_gefen_step_moves_scalars_once_per_group(monkeypatch) -> None:
    compiled_path_only(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]
    groups = [{"params": params[:5]}, {"params": params[5:], "lr": 5e-3}]
    optimizer = Gefen(groups, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):  # codebook learning and the first steps behind us
        fill_grads(params, step)
        optimizer.step()
    for step in range(3, 6):
        fill_grads(params, step)
        for group in optimizer.param_groups:
            group["lr"] *= 0.9  # a schedule: new hyperparameters every step
        with host_traffic(monkeypatch) as counts:
            optimizer.step()
        # one packed-hyperparameter tensor per group (the bias corrections move every step);
        # one read: the finiteness check's, once per device
        assert counts["tensor"] <= len(groups), counts
        assert counts["read"] <= 1, counts


def test_device_scalars_reuse_one_tensor_per_value_and_keep_the_sign_of_zero() -> None:
    cache = DeviceScalars(capacity=3)
    cpu = torch.device("cpu")
    hp = cache.get((1e-3, 0.9), torch.float64, cpu)
    assert cache.get((1e-3, 0.9), torch.float64, cpu) is hp
    assert hp.dtype == torch.float64
    assert hp.tolist() == [1e-3, 0.9]
    zero, negative_zero = cache.get(0.0, torch.float32, cpu), cache.get(-0.0, torch.float32, cpu)
    assert zero is not negative_zero
    assert zero.shape == ()
    assert torch.signbit(negative_zero)
    assert not torch.signbit(zero)
    assert cache.get(7, torch.int64, cpu) is not cache.get(7, torch.int32, cpu)  # dtype is key
    # capacity 3, least recently used dropped: 7/int32, 7/int64 and -0.0 stay; hp was dropped
    assert cache.get((1e-3, 0.9), torch.float64, cpu) is not hp
