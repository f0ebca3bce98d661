"""Shared pieces of ``compare.py`` and ``micro.py``: building each optimizer, counting its state
bytes, and describing the environment."""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import os
import platform
import resource
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from harness_config import BETAS, WEIGHT_DECAY
from torch import Tensor, nn

NamedParams = list[tuple[str, Tensor]]

PEER_MODULES = {
    "bnb_adamw8bit": "bitsandbytes",
    "torchao_adamw8bit": "torchao",
    "torchao_adamw4bit": "torchao",
}


class Unavailable(Exception):
    """The optimizer cannot run here (peer not installed or not usable on this device)."""


def peer_missing(name: str) -> str | None:
    """Why ``name`` cannot run (its peer package is not importable), or None."""
    module = PEER_MODULES.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    return None


class OptimizerPair:
    """torch.optim.Muon on the hidden matrices plus AdamW on the rest, stepped together."""

    def __init__(self, muon: torch.optim.Optimizer, rest: torch.optim.Optimizer | None) -> None:
        self.muon = muon
        self.rest = rest

    @property
    def children(self) -> list[torch.optim.Optimizer]:
        return [self.muon] if self.rest is None else [self.muon, self.rest]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for child in self.children for group in child.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.children:
            child.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for child in self.children:
            child.step()


def _adamw(params: Iterable[Tensor], lr: float) -> torch.optim.Optimizer:
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)
    except RuntimeError:  # no fused kernel for this device
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def build_optimizer(name: str, model: nn.Module, lr: float) -> Any:
    """The optimizer ``name`` over ``model``'s parameters; raises Unavailable for missing peers."""
    reason = peer_missing(name)
    if reason is not None:
        raise Unavailable(reason)
    if name == "adamw":
        return _adamw(model.parameters(), lr)
    if name == "gefen":
        from gefen.core import Gefen

        return Gefen(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if name == "muon":
        from gefen.hybrid import split_params_for_muon

        matrices, rest = split_params_for_muon(model)
        muon = torch.optim.Muon(
            [p for _, p in matrices],
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            adjust_lr_fn="match_rms_adamw",
        )
        return OptimizerPair(muon, _adamw([p for _, p in rest], lr) if rest else None)
    if name in ("gefen_muon_gefen", "gefen_muon_adamw"):
        from gefen.hybrid import GefenMuonHybrid

        return GefenMuonHybrid(
            model,
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            betas=BETAS,
            backup_optimizer=name.removeprefix("gefen_muon_"),
        )
    if name == "bnb_adamw8bit":
        try:
            import bitsandbytes
        except Exception as error:  # installed but broken (e.g. no usable backend)
            raise Unavailable(f"bitsandbytes does not import: {error}") from error
        return bitsandbytes.optim.AdamW8bit(
            model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY
        )
    if name in ("torchao_adamw8bit", "torchao_adamw4bit"):
        try:
            from torchao.optim import AdamW4bit, AdamW8bit
        except Exception as error:
            raise Unavailable(f"torchao.optim does not import: {error}") from error
        cls = AdamW8bit if name.endswith("8bit") else AdamW4bit
        return cls(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    raise ValueError(f"unknown optimizer {name!r}")


def child_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers that hold state: a pair's or a hybrid's children, else itself."""
    if isinstance(optimizer, OptimizerPair):
        return optimizer.children
    children = getattr(optimizer, "_children", None)  # GefenMuonHybrid
    if isinstance(children, tuple) and children:
        return list(children)
    return [optimizer]


def _leaf_tensors(value: object) -> Iterator[Tensor]:
    """Plain tensors reachable from ``value``: containers walked, subclasses flattened."""
    if isinstance(value, Tensor):
        flatten = getattr(type(value), "__tensor_flatten__", None)
        if flatten is not None and type(value) not in (Tensor, nn.Parameter):
            names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
            for inner in names:
                yield from _leaf_tensors(getattr(value, inner))
        else:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaf_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaf_tensors(item)


def _optimizer_level_tensors(optimizer: Any) -> list[object]:
    """Tensors an optimizer keeps outside ``state``: Gefen's codebook, bitsandbytes' qmaps."""
    found: list[object] = []
    codebook = getattr(optimizer, "codebook", None)
    if isinstance(codebook, Tensor):
        found.append(codebook)
    for attribute in ("name2qmap", "qmaps"):
        value = getattr(optimizer, attribute, None)
        if value is not None:
            found.append(value)
    return found


def state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor reachable from the optimizer's state (children summed) plus the
    optimizer-level tensors; a tensor reached twice counts once, Python numbers not at all."""
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for child in child_optimizers(optimizer):
        roots: list[object] = [dict(child.state)]
        roots.extend(_optimizer_level_tensors(child))
        for root in roots:
            for tensor in _leaf_tensors(root):
                nbytes = tensor.numel() * tensor.element_size()
                key = (tensor.data_ptr(), nbytes, id(tensor) if tensor.data_ptr() == 0 else 0)
                if key not in seen:  # the same tensor (or view) reached twice counts once
                    seen.add(key)
                    total += nbytes
    return total


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (ru_maxrss only grows)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(threads: int) -> dict[str, Any]:
    """Versions, CPU and threads, for results.json."""
    distributions = (
        "gefen-contracts",
        "gefen-dist",
        "gefen-core",
        "gefen-muon",
        "gefen-hybrid",
        "bitsandbytes",
        "torchao",
        "numpy",
    )
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "versions": {name: _version(name) for name in distributions},
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "mkldnn": bool(torch.backends.mkldnn.is_available()),  # type: ignore[no-untyped-call]
    }
