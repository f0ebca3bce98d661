"""Second-moment estimators for matrices, measured on compare.py's model and recipe.

A reference optimizer with fp32 momentum and an exact (per-element) second moment for vectors,
whose matrices take one of these second-moment estimates ``V`` (the update is AdamW's,
``m / bc1 / (sqrt(V / bc2) + eps)``, with decoupled weight decay):

- ``exact``: AdamW's per-element EMA of g² (this variant is torch AdamW; 8 B/param);
- ``factored``: Gefen's (docs/core.md §6.2), ``r_i c_j / mean(r)`` from row and column EMAs;
- ``freshmax``: ``max(factored, (1 - beta2) g²)``, the factored estimate floored by the
  current gradient's own square, at no extra state (Gefen's ``factored_floor=True``, its default
  since this measurement).

It isolates the estimator from Gefen's quantized momentum and block vectors, to say where the gap
to AdamW comes from and what closes it without changing a kernel to find out. Usage::

    python benchmarks/second_moment.py --model-size large --steps 300 --seeds 0,1 --jobs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import subprocess
import sys
from typing import Any

import torch
from compare import Decoder, batch_starts, gather, lm_loss, load_corpus, lr_factor
from harness_config import (
    BETAS,
    DEFAULT_BATCH,
    DEFAULT_EVAL_BATCHES,
    GRAD_CLIP,
    HELD_OUT_FRACTION,
    MODEL_SIZES,
    WEIGHT_DECAY,
)
from torch import Tensor

VARIANTS = ("exact", "factored", "freshmax")
FLT_MIN = 2.0**-126


class Reference(torch.optim.Optimizer):
    """AdamW with the matrices' second moment estimated by ``variant``."""

    def __init__(self, params: Any, lr: float, variant: str, weight_decay: float = WEIGHT_DECAY):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
        defaults = {"lr": lr, "betas": BETAS, "eps": 1e-8, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.variant = variant

    def _second_moment(self, state: dict[str, Any], square: Tensor, beta2: float) -> Tensor:
        if "v" in state:
            state["v"].mul_(beta2).add_(square, alpha=1 - beta2)
            return state["v"]  # type: ignore[no-any-return]
        rows, cols = state["v_row"], state["v_col"]
        rows.mul_(beta2).add_(square.mean(1), alpha=1 - beta2)
        cols.mul_(beta2).add_(square.mean(0), alpha=1 - beta2)
        factored: Tensor = torch.outer(rows, cols) / rows.mean().clamp_min(FLT_MIN)
        if self.variant == "freshmax":
            return torch.maximum(factored, square * (1 - beta2))
        return factored

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.float()
                state = self.state[param]
                if not state:
                    state["t"] = 0
                    state["m"] = torch.zeros_like(grad)
                    if grad.ndim == 2 and self.variant != "exact":
                        state["v_row"] = grad.new_zeros(grad.shape[0])
                        state["v_col"] = grad.new_zeros(grad.shape[1])
                    else:
                        state["v"] = torch.zeros_like(grad)
                state["t"] += 1
                bc1, bc2 = 1 - beta1 ** state["t"], 1 - beta2 ** state["t"]
                state["m"].lerp_(grad, 1 - beta1)
                second = self._second_moment(state, grad * grad, beta2)
                param.mul_(1 - lr * decay)
                update = state["m"] / bc1 / ((second / bc2).sqrt() + eps)
                param.add_(update.to(param.dtype), alpha=-lr)


def train(variant: str, seed: int, size_name: str, steps: int, lr: float) -> dict[str, Any]:
    """compare.py's training run (one thread) with ``Reference``; the held-out loss at the end."""
    torch.set_num_threads(1)
    size = MODEL_SIZES[size_name]
    data, _ = load_corpus()
    split = int(len(data) * (1 - HELD_OUT_FRACTION))
    train_data, held_out = data[:split], data[split:]
    starts = batch_starts(len(train_data), steps, DEFAULT_BATCH, size.context, seed)
    eval_starts = batch_starts(
        len(held_out), DEFAULT_EVAL_BATCHES, DEFAULT_BATCH, size.context, seed + 1
    )
    torch.manual_seed(seed)
    model = Decoder(size)
    optimizer = Reference(model.parameters(), lr, variant)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, steps)
        loss = lm_loss(model, gather(train_data, starts[step], size.context), size.vocab)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
    model.eval()
    with torch.no_grad():
        losses = [
            lm_loss(model, gather(held_out, row, size.context), size.vocab).item()
            for row in eval_starts
        ]
    held = sum(losses) / len(losses)
    return {"variant": variant, "seed": seed, "lr": lr, "eval_loss": held}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="default")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=7.5e-4)
    parser.add_argument("--jobs", type=int, default=1, help="workers run at once")
    parser.add_argument("--out", default="bench-out/second_moment.json")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one run in its own process: print its JSON line
        print(json.dumps(train(args.worker[0], int(args.worker[1]), args.model_size, args.steps,
                               args.lr)))  # fmt: skip
        return 0
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {VARIANTS}")
    jobs = [(v, int(seed)) for seed in args.seeds.split(",") for v in variants]
    common = ["--model-size", args.model_size, "--steps", str(args.steps), "--lr", repr(args.lr)]

    def run(job: tuple[str, int]) -> dict[str, Any]:
        command = [sys.executable, __file__, *common, "--worker", job[0], str(job[1])]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run, jobs))
    exact = {r["seed"]: r["eval_loss"] for r in results if r["variant"] == "exact"}
    for row in results:
        reference = exact.get(row["seed"])
        row["gap_vs_exact"] = None if reference is None else row["eval_loss"] / reference - 1
        gap = "" if reference is None else f"  {row['gap_vs_exact']:+.2%} vs exact"
        print(f"{row['variant']:<10} seed {row['seed']}  held-out {row['eval_loss']:.4f}{gap}")
    config = {key: getattr(args, key) for key in ("model_size", "steps", "lr", "seeds")}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
