"""Train the pinned small transformer on stdlib text; print loss, state bytes and step time.

A precursor of the full comparison harness (``compare.py``, its own issue): one process, no
plots. Optimizers: adamw, gefen, muon (torch.optim.Muon on the hidden matrices + AdamW), and
gefen-muon (GefenMuon on the hidden matrices + Gefen). Usage::

    python benchmarks/train_small.py --steps 150 --lr 2e-3 --optimizers adamw,gefen,muon,gefen-muon
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sysconfig
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def load_corpus(limit_bytes: int = 4_000_000) -> torch.Tensor:
    """Bytes of the running interpreter's standard library sources, in sorted file order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, d_model: int = 192, layers: int = 4, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        self.blocks = nn.ModuleList(Block(d_model, 4) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        for block in self.blocks:
            x = block(x, self.mask[:length, :length])
        return self.norm(x) @ self.embed.weight.T  # tied head


def batches(
    data: torch.Tensor, steps: int, batch: int, context: int, seed: int
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - context - 1, (steps, batch), generator=generator)
    return [torch.stack([data[s : s + context + 1] for s in row.tolist()]) for row in starts]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = sum(
        value.numel() * value.element_size()
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )
    codebook = getattr(optimizer, "codebook", None)
    return total + (codebook.numel() * codebook.element_size() if codebook is not None else 0)


class Pair:
    """Muon for the hidden matrices, an Adam-family optimizer for everything else."""

    def __init__(self, matrices: torch.optim.Optimizer, rest: torch.optim.Optimizer) -> None:
        self.matrices, self.rest = matrices, rest

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.matrices.zero_grad(set_to_none=set_to_none)
        self.rest.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.matrices.step()
        self.rest.step()


def hidden_matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(2-D weights inside the blocks, every other parameter): the usual Muon split."""
    matrices, rest = [], []
    for name, param in model.named_parameters():
        (matrices if param.ndim == 2 and name.startswith("blocks.") else rest).append(param)
    return matrices, rest


def build(name: str, model: nn.Module, lr: float) -> tuple[Any, torch.optim.Optimizer | None]:
    """The optimizer to train with, and the Muon part whose state is reported separately."""
    from gefen.core import Gefen

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1), None
    if name == "gefen":
        return Gefen(model.parameters(), lr=lr, weight_decay=0.1), None
    from gefen.muon import GefenMuon

    matrices, rest = hidden_matrices(model)
    # match_rms_adamw lets the AdamW learning rate and weight decay carry over (Moonlight).
    if name == "muon":
        muon: torch.optim.Optimizer = torch.optim.Muon(
            matrices, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
        )
        return Pair(muon, torch.optim.AdamW(rest, lr=lr, weight_decay=0.1)), muon
    if name == "gefen-muon":
        muon = GefenMuon(matrices, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        return Pair(muon, Gefen(rest, lr=lr, weight_decay=0.1)), muon
    raise ValueError(f"unknown optimizer {name!r}")


def total_state_bytes(optimizer: object) -> int:
    if isinstance(optimizer, Pair):
        return state_bytes(optimizer.matrices) + state_bytes(optimizer.rest)
    assert isinstance(optimizer, torch.optim.Optimizer)
    return state_bytes(optimizer)


def run(name: str, args: argparse.Namespace, data: torch.Tensor) -> dict[str, object]:
    torch.manual_seed(args.seed)
    model = TinyDecoder(context=args.context)
    params = sum(p.numel() for p in model.parameters())
    optimizer, muon_part = build(name, model, args.lr)
    split = int(data.numel() * 0.9)
    train = batches(data[:split], args.steps, args.batch, args.context, args.seed)
    held_out = batches(data[split:], 8, args.batch, args.context, args.seed + 1)
    step_seconds: list[float] = []
    losses: list[float] = []
    for tokens in train:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        start = time.perf_counter()
        optimizer.step()
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    with torch.no_grad():
        eval_losses = [
            F.cross_entropy(model(t[:, :-1]).reshape(-1, 256), t[:, 1:].reshape(-1)).item()
            for t in held_out
        ]
    step_seconds.sort()
    result: dict[str, object] = {
        "optimizer": name,
        "parameters": params,
        "train_loss_last10": sum(losses[-10:]) / 10,
        "eval_loss": sum(eval_losses) / len(eval_losses),
        "state_bytes_per_param": total_state_bytes(optimizer) / params,
        "step_ms_median": 1000 * step_seconds[len(step_seconds) // 2],
    }
    if muon_part is not None:
        muon_params = sum(p.numel() for g in muon_part.param_groups for p in g["params"])
        result["muon_parameters"] = muon_params
        result["muon_state_bytes_per_param"] = state_bytes(muon_part) / muon_params
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizers", default="adamw,gefen")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_corpus()
    for name in args.optimizers.split(","):
        result = run(name, args, data)
        assert math.isfinite(float(str(result["eval_loss"])))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
