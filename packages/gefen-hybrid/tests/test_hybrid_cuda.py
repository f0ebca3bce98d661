"""The hybrid on CUDA (its default, compiled update in both children) against the same model on
the CPU (the eager reference), and a CUDA checkpoint resumed on the CPU. Skipped without CUDA.

Two devices never round alike, and a few steps of Muon turn the smallest difference into a
visible one: a 1e-6 relative perturbation of the starting weights moves the CPU run's own
updates by up to 7% (the output matrix of the model below). So the CUDA run is held to that
noise floor, measured in the test, not to a fixed tolerance: each parameter's update may differ
from the CPU reference by at most ``FLOOR_FACTOR`` times what the perturbation does (plus
``ABSOLUTE_SLACK``), and the losses must agree closely at every step.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from gefen.hybrid import GefenMuonHybrid

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FLOOR_FACTOR = 4.0
ABSOLUTE_SLACK = 0.01  # relative update error always allowed (one code level here and there)
LOSS_RELATIVE = 1e-3  # per-step training loss, CUDA against the CPU
RESUME_BOUND = 0.05  # three eager steps after the resume (seen on an H200: within it)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = OrderedDict(
        embed=nn.Embedding(64, 32),  # the backup (Gefen), by name
        hidden=nn.Linear(32, 96),  # Muon; its bias goes to the backup
        out=nn.Linear(96, 64),
    )
    return nn.Sequential(layers)


def _loss(model: nn.Module, step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (16, 9), generator=generator).to(device)
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))


def _train(model: nn.Module, optimizer: GefenMuonHybrid, steps: range) -> list[float]:
    device = next(model.parameters()).device
    losses = []
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, step, device)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _relative_errors(start: nn.Module, cpu: nn.Module, cuda: nn.Module) -> dict[str, float]:
    """||update(cuda) - update(cpu)|| / ||update(cpu)|| for each parameter, by name."""
    errors = {}
    for (name, p0), p_cpu, p_cuda in zip(
        start.named_parameters(), cpu.parameters(), cuda.parameters(), strict=True
    ):
        reference = p_cpu.detach() - p0.detach()
        difference = p_cuda.detach().cpu() - p_cpu.detach()
        errors[name] = float(difference.norm() / reference.norm().clamp_min(1e-12))
    return errors


def _noise_floor(
    start: nn.Module, reference: nn.Module, steps: range, options: dict[str, str]
) -> dict[str, float]:
    """The CPU run's own update errors when its starting weights move by 1e-6 (relative)."""
    perturbed = copy.deepcopy(start)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=generator))
    optimizer = GefenMuonHybrid(perturbed, lr=1e-2, weight_decay=0.1, fused=False, **options)
    _train(perturbed, optimizer, steps)
    return _relative_errors(start, reference, perturbed)


def _assert_within_the_floor(errors: dict[str, float], floor: dict[str, float]) -> None:
    allowed = {name: FLOOR_FACTOR * floor[name] + ABSOLUTE_SLACK for name in errors}
    assert all(errors[name] <= allowed[name] for name in errors), (errors, allowed)


@pytest.mark.fused_default
@pytest.mark.parametrize(
    "options",
    [
        {},  # the defaults: codebook8 Muon momentum, Gefen backup
        {"backup_optimizer": "adamw"},
        {"momentum_codec": "codebook4", "backup_momentum_codec": "codebook4"},
    ],
    ids=["defaults", "adamw-backup", "codebook4"],
)
def test_the_compiled_cuda_step_follows_the_cpu_reference(options: dict[str, str]) -> None:
    start = _model()
    cpu, cuda = copy.deepcopy(start), copy.deepcopy(start).cuda()
    cpu_optimizer = GefenMuonHybrid(cpu, lr=1e-2, weight_decay=0.1, fused=False, **options)
    # fused=None, the default: the compiled update on CUDA
    cuda_optimizer = GefenMuonHybrid(cuda, lr=1e-2, weight_decay=0.1, **options)
    cpu_losses = _train(cpu, cpu_optimizer, range(6))
    cuda_losses = _train(cuda, cuda_optimizer, range(6))
    assert cuda_losses == pytest.approx(cpu_losses, rel=LOSS_RELATIVE)
    floor = _noise_floor(start, cpu, range(6), options)
    _assert_within_the_floor(_relative_errors(start, cpu, cuda), floor)


def test_a_cuda_checkpoint_resumes_on_the_cpu() -> None:
    start = _model()
    cuda = copy.deepcopy(start).cuda()
    cuda_optimizer = GefenMuonHybrid(cuda, lr=1e-2, weight_decay=0.1, fused=False)
    _train(cuda, cuda_optimizer, range(3))
    saved = copy.deepcopy(cuda_optimizer.state_dict())
    cpu = copy.deepcopy(cuda).cpu()
    cpu_optimizer = GefenMuonHybrid(cpu, lr=1e-2, weight_decay=0.1, fused=False)
    cpu_optimizer.load_state_dict(saved)
    for state in cpu_optimizer.state.values():
        for value in state.values():
            assert not torch.is_tensor(value) or value.device.type == "cpu"
    resumed_from = copy.deepcopy(cpu)
    cpu_losses = _train(cpu, cpu_optimizer, range(3, 6))
    cuda_losses = _train(cuda, cuda_optimizer, range(3, 6))
    assert cuda_losses == pytest.approx(cpu_losses, rel=LOSS_RELATIVE)
    errors = _relative_errors(resumed_from, cpu, cuda)
    assert max(errors.values()) <= RESUME_BOUND, errors
