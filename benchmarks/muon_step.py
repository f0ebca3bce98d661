"""Step time and state bytes of torch.optim.Muon and GefenMuon on the same matrices.

Usage::

    python benchmarks/muon_step.py --shapes 1024x1024,1024x4096,4096x1024 --steps 10 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = sum(
        value.numel() * value.element_size()
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )
    codebook = getattr(optimizer, "codebook", None)
    return total + (codebook.numel() * codebook.element_size() if codebook is not None else 0)


def measure(name: str, shapes: list[tuple[int, int]], steps: int) -> dict[str, object]:
    from gefen.muon import GefenMuon

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(3)]
    optimizer: torch.optim.Optimizer = (
        torch.optim.Muon(params, lr=0.02)
        if name == "muon"
        else GefenMuon(params, lr=0.02, momentum_codec=name.removeprefix("gefen-muon-"))
    )
    seconds = []
    for step in range(steps + 1):
        for param, grad in zip(params, grads[step % 3], strict=True):
            param.grad = grad
        start = time.perf_counter()
        optimizer.step()
        if step > 0:  # the first step learns the codebook
            seconds.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in params)
    return {
        "optimizer": name,
        "parameters": numel,
        "state_bytes_per_param": state_bytes(optimizer) / numel,
        "step_ms_median": 1000 * statistics.median(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="1024x1024,1024x4096,4096x1024")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in item.split("x")) for item in args.shapes.split(",")]
    for name in ("muon", "gefen-muon-none", "gefen-muon-codebook8"):
        print(json.dumps(measure(name, shapes, args.steps)))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
