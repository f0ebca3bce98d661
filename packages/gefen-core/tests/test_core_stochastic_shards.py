"""Stochastic rounding draws by logical index (docs/core.md §6.3): a shard's element ``k`` takes
the draw of element ``first + k`` of the whole parameter, so a row-sharded run rounds as one
process does. Each shard drew from its own local index before: every rank reused the first
rows' draws, and a world-2 run with ``stochastic_round=True`` left the world-1 run's path.
"""

from __future__ import annotations

import pytest
import torch

from gefen.core.kernels import stream_seed, uniform_draws
from gefen.dist.testing import gloo_required, run_scenarios

WIDTHS = (8, 7, 5)  # 7 and 5 rows split unevenly over 2 ranks (torch.chunk: 4 + 3, 3 + 2)


def test_a_shard_draws_what_the_whole_parameter_draws_for_its_elements() -> None:
    whole = uniform_draws((3, 1), 40)
    assert torch.equal(uniform_draws((3, 1, 12), 28), whole[12:])
    assert stream_seed((3, 1, 0)) == stream_seed((3, 1))
    assert not torch.equal(uniform_draws((3, 1, 12), 28), whole[:28])
    with pytest.raises(ValueError, match="first must be an int >= 0"):
        stream_seed((3, 1, -1))


def scenario_train(rank: int, world_size: int) -> list[bytes]:
    """Five stochastic-rounding steps of a ``fully_shard`` model, the same batch on every rank
    (the averaged gradient is then the one-process one); the full parameters as bytes."""
    import io

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gefen.core import Gefen

    torch.manual_seed(0)
    first, last = torch.nn.Linear(*WIDTHS[:2]), torch.nn.Linear(*WIDTHS[1:])
    model = torch.nn.Sequential(first, torch.nn.Tanh(), last)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in (first, last, model):
        fully_shard(module, mesh=mesh)
    optimizer = Gefen(model.parameters(), lr=0.01, stochastic_round=True)
    for seed in range(5):
        x = torch.randn(6, WIDTHS[0], generator=torch.Generator().manual_seed(seed))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    blobs = []
    for param in model.parameters():
        buffer = io.BytesIO()
        torch.save(param.full_tensor().detach().clone(), buffer)
        blobs.append(buffer.getvalue())
    return blobs


@gloo_required()
@pytest.mark.multirank
def test_a_row_sharded_run_rounds_as_one_process_does() -> None:
    import io

    runs = {
        world: run_scenarios([("train", scenario_train, ())], world, rank_deadline_s=300.0)
        for world in (1, 2)
    }
    one = [torch.load(io.BytesIO(blob)) for blob in runs[1]["train"][0]]
    for rank_blobs in runs[2]["train"]:
        two = [torch.load(io.BytesIO(blob)) for blob in rank_blobs]
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
