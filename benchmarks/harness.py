"""Shared pieces of ``compare.py`` and ``micro.py``: building each optimizer, counting its state
bytes, measuring the extra memory of its ``step()``, and describing the environment."""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import math
import os
import platform
import resource
import sys
import time
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from harness_config import APOLLO_RECIPES, BETAS, GEFEN_ABLATION, WEIGHT_DECAY
from torch import Tensor, nn

NamedParams = list[tuple[str, Tensor]]

PEER_MODULES = {
    "bnb_adamw8bit": "bitsandbytes",
    "torchao_adamw8bit": "torchao",
    "torchao_adamw4bit": "torchao",
    "apollo": "apollo_torch",
    "apollo_mini": "apollo_torch",
    "adam_mini": "adam_mini",
    "gefenx": "gefen",  # Gefen-X: imported only in its own venv (see OWN_VENV)
    "gefenx_hybrid": "gefen",
}

# Peers that must run in a venv of their own: Gefen-X ships a regular ``gefen/__init__.py``, which
# would shadow our ``gefen`` namespace, so its workers run under the interpreter this variable
# names (a venv with torch, tqdm and gefen-x and none of our packages; ``nox -s bench`` makes one).
OWN_VENV = {"gefenx": "GEFENX_PYTHON", "gefenx_hybrid": "GEFENX_PYTHON"}

# adam-mini partitions parameters by name substrings and lets users add their own (its documented
# ``optimizer.<kind>_names.add(...)``). compare.py's Decoder names them differently from the
# LLaMA/GPT-2 names it knows: ``qkv`` is the fused query/key/value (one learning rate per head,
# which is adam-mini's rule for queries and keys and a finer one than it allows for values),
# ``proj`` the attention output and ``fc``/``fc_out`` the MLP (one per output neuron). The
# embedding (tied head) and position embedding already match its ``embed`` name (one per row).
ADAM_MINI_NAMES: dict[str, tuple[str, ...]] = {
    "wqk_names": ("qkv",),
    "attn_proj_names": (".proj.",),
    "mlp_names": (".fc",),
}


class Unavailable(Exception):
    """The optimizer cannot run here (peer not installed or not usable on this device)."""


def worker_python(name: str) -> str:
    """The interpreter ``name``'s worker runs under: its own venv's for OWN_VENV peers."""
    variable = OWN_VENV.get(name)
    return os.environ.get(variable, "") if variable else sys.executable


def peer_missing(name: str) -> str | None:
    """Why ``name`` cannot run (its peer package is not importable), or None."""
    if name in OWN_VENV:
        python = worker_python(name)
        if not python or not os.path.exists(python):
            return f"{name} runs in its own venv: set {OWN_VENV[name]} to that venv's python"
        return None  # the worker itself reports a venv without gefen-x
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


def apollo_param_groups(model: nn.Module, recipe: dict[str, Any]) -> list[dict[str, Any]]:
    """APOLLO's published grouping: the hidden matrices (routed like the hybrid's Muon part:
    ``gefen.hybrid.split_params_for_muon``) in low-rank groups carrying ``recipe``'s keys, one
    group per rank after capping it at each matrix's smaller dimension; the embedding (and tied
    head), position embedding, norms and biases first, in a plain group without them."""
    from gefen.hybrid import split_params_for_muon

    matrices, rest = split_params_for_muon(model)
    groups: list[dict[str, Any]] = [{"params": [p for _, p in rest]}] if rest else []
    by_rank: dict[int, list[Tensor]] = {}
    for _, param in matrices:
        rank = min(int(recipe["rank"]), *param.shape)
        by_rank.setdefault(rank, []).append(param)
    for rank, params in sorted(by_rank.items(), reverse=True):
        groups.append({"params": params, **recipe, "rank": rank})
    return groups


def _apollo(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    try:
        from apollo_torch import APOLLOAdamW
    except Exception as error:  # it imports transformers and bitsandbytes at import time
        raise Unavailable(f"apollo_torch does not import: {error}") from error
    groups = apollo_param_groups(model, APOLLO_RECIPES[name])
    optimizer: torch.optim.Optimizer = APOLLOAdamW(
        groups, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY
    )
    return optimizer


def _adam_mini(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    try:
        from adam_mini import Adam_mini
    except Exception as error:
        raise Unavailable(f"adam_mini does not import: {error}") from error
    size = getattr(model, "size", None)  # compare.py's Decoder; micro.py's holder has none
    dims: dict[str, int] = {}
    if size is not None:
        dims = {"dim": size.d_model, "n_heads": size.heads, "n_kv_heads": size.heads}
    optimizer: torch.optim.Optimizer = Adam_mini(
        model.named_parameters(),
        lr=lr,
        betas=BETAS,
        weight_decay=WEIGHT_DECAY,
        verbose=False,
        **dims,
    )
    for attribute, substrings in ADAM_MINI_NAMES.items():
        names = getattr(optimizer, attribute, None)
        if not isinstance(names, set):
            raise Unavailable(
                f"adam_mini.Adam_mini has no {attribute} set: this adam-mini cannot be told the "
                "harness model's block names"
            )
        names.update(substrings)
    return optimizer


def variant_period(rule: str, shape: tuple[int, ...]) -> int | None:
    """The period ``rule`` (harness_config.PERIOD_RULES) gives a parameter of quantized ``shape``,
    or None where it defers to §4's search (``search``; ``row`` for a vector)."""
    from gefen.core.kernels import MIN_SEARCHED_PERIOD, fallback

    n = math.prod(shape)
    if rule == "search" or n <= 1:
        return None
    if rule in ("row", "shape") and len(shape) >= 2 and n // shape[0] >= MIN_SEARCHED_PERIOD:
        return n // shape[0]
    if rule == "row":
        return None
    if rule in ("shape", "fallback"):
        return fallback(n, shape)
    raise ValueError(f"unknown period rule {rule!r}")


def _gefen_variant(name: str, model: nn.Module, lr: float) -> Any:
    """Gefen with an ablation variant's options; a period rule other than §4's search is applied
    through Gefen's public ``select_new_period`` hook."""
    from gefen.core import Gefen
    from gefen.core.kernels import select_period

    variant = GEFEN_ABLATION[name]

    class VariantGefen(Gefen):
        def select_new_period(
            self, group: Any, param: Tensor, view: Tensor, shape: tuple[int, ...]
        ) -> int | None:
            chosen = variant_period(variant.period_rule, shape)
            if chosen is not None:
                return chosen
            if variant.period_rule == "search" and self.template_period(group, param) != 1:
                return select_period(view, shape, force_one=False)  # §4 even for matrices
            return super().select_new_period(group, param, view, shape)

    return VariantGefen(
        model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, **variant.options
    )


def _gefenx(name: str, model: nn.Module, lr: float) -> Any:
    """Gefen-X 0.5.0 with its published recipes: ``Gefen`` at its defaults (factored 2-D second
    moment); the hybrid with its lowest-memory recipe (Gefen backup at half the learning rate
    with period-one vectors, tuned three-step Newton–Schulz, NorMuon, AdamW-matched LR)."""
    try:
        version = importlib.metadata.version("gefen-x")
        from gefen import Gefen, GefenMuonHybrid  # type: ignore[attr-defined]
    except Exception as error:
        raise Unavailable(f"gefen-x does not import in this interpreter: {error!r}") from error
    if not version.startswith("0.5."):
        raise Unavailable(f"the recipe is gefen-x 0.5's; this is {version}")
    if name == "gefenx":
        return Gefen(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return GefenMuonHybrid(
        model,
        lr=lr,
        backup_optimizer="gefen",
        backup_lr=0.5 * lr,
        backup_1d_period_one=True,
        ns_schedule="tuned3",
        normuon=True,
        adjust_lr_fn="match_rms_adamw",
        betas=BETAS,
        weight_decay=WEIGHT_DECAY,
    )


def build_optimizer(name: str, model: nn.Module, lr: float) -> Any:
    """The optimizer ``name`` over ``model``'s parameters; raises Unavailable for missing peers."""
    reason = peer_missing(name)
    if reason is not None:
        raise Unavailable(reason)
    if name == "adamw":
        return _adamw(model.parameters(), lr)
    if name in ("gefen", "gefen_eager", "gefen_q4"):
        from gefen.core import Gefen

        # gefen_eager: the eager reference kernels, for the fused-vs-eager loss comparison.
        fused = False if name == "gefen_eager" else None
        codec = "codebook4" if name == "gefen_q4" else "codebook8"
        return Gefen(
            model.parameters(),
            lr=lr,
            betas=BETAS,
            weight_decay=WEIGHT_DECAY,
            fused=fused,
            momentum_codec=codec,
        )
    if name in GEFEN_ABLATION:
        return _gefen_variant(name, model, lr)
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
    if name == "gefen_muon_gefen_q4":
        from gefen.hybrid import GefenMuonHybrid

        return GefenMuonHybrid(
            model,
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            betas=BETAS,
            momentum_codec="codebook4",
            backup_momentum_codec="codebook4",
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
    if name in APOLLO_RECIPES:
        return _apollo(name, model, lr)
    if name in OWN_VENV:
        return _gefenx(name, model, lr)
    if name == "adam_mini":
        return _adam_mini(model, lr)
    raise ValueError(f"unknown optimizer {name!r}")


def child_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers that hold state: a pair's or a hybrid's children, else itself."""
    if isinstance(optimizer, OptimizerPair):
        return optimizer.children
    halves = [getattr(optimizer, half, None) for half in ("muon", "backup")]  # either hybrid
    children = [child for child in halves if isinstance(child, torch.optim.Optimizer)]
    return children or [optimizer]


# Objects in optimizer state whose attributes are not walked (they are not state the optimizer
# keeps per parameter, or they reach the model itself).
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, nn.Module)


def _leaf_tensors(value: object, walked: set[int] | None = None) -> Iterator[Tensor]:
    """Plain tensors reachable from ``value``: containers walked, subclasses flattened, and the
    attributes of plain objects kept in the state walked too (APOLLO's projectors hold their
    projection matrix as an attribute)."""
    walked = set() if walked is None else walked
    if isinstance(value, Tensor):
        flatten = getattr(type(value), "__tensor_flatten__", None)
        if flatten is not None and type(value) not in (Tensor, nn.Parameter):
            names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
            for inner in names:
                yield from _leaf_tensors(getattr(value, inner), walked)
        else:
            yield value
        return
    if id(value) in walked:  # a container or object reached again (or a cycle)
        return
    if isinstance(value, dict):
        walked.add(id(value))
        for item in value.values():
            yield from _leaf_tensors(item, walked)
    elif isinstance(value, (list, tuple)):
        walked.add(id(value))
        for item in value:
            yield from _leaf_tensors(item, walked)
    elif hasattr(value, "__dict__") and not isinstance(value, _OPAQUE):
        walked.add(id(value))
        yield from _leaf_tensors(vars(value), walked)


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


_PEAK_BEFORE_RESETS = 0
"""The largest VmHWM (bytes) read just before a reset: StepMemory's resets of VmHWM also reset
ru_maxrss (both are the kernel's one high-water mark), so the process's peak is the largest of
this and the counter now."""


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB since it started, across StepMemory's resets
    of the high-water mark."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    return max(peak_bytes, _PEAK_BEFORE_RESETS) / (1024 * 1024)


# glibc serves every allocation of at least this many bytes with its own mmap and unmaps it on
# free, so RSS follows live memory instead of the heap's retained high-water mark. glibc reads the
# variable only at process start: it goes into each measuring worker's environment.
MMAP_THRESHOLD = "65536"
MMAP_THRESHOLD_VAR = "MALLOC_MMAP_THRESHOLD_"

STEP_MEMORY_METHOD = (
    "max over the measured steps of (peak during optimizer.step() - resident just before it). "
    "CPU: VmHWM from /proc/self/status after resetting it by writing 5 to /proc/self/clear_refs "
    "right before step(), minus VmRSS read right after the reset, in a worker process started "
    f"with {MMAP_THRESHOLD_VAR}={MMAP_THRESHOLD}; CUDA: torch.cuda.max_memory_allocated after "
    "reset_peak_memory_stats, minus memory_allocated before"
)


def worker_env() -> dict[str, str]:
    """The environment of a worker whose step memory is measured (see MMAP_THRESHOLD)."""
    return {**os.environ, MMAP_THRESHOLD_VAR: MMAP_THRESHOLD}


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """VmHWM := the current RSS (Linux >= 4.0), the peak so far kept for ``peak_rss_mb``."""
    global _PEAK_BEFORE_RESETS
    _PEAK_BEFORE_RESETS = max(_PEAK_BEFORE_RESETS, _status_bytes("VmHWM"))
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


class StepMemory:
    """The extra memory ``optimizer.step()`` needs beyond what is resident when it starts: wrap
    each measured step in ``before()`` / ``after()``; ``extra`` is the largest of them (bytes),
    or None with ``reason`` saying why it cannot be measured here."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.extra: int | None = None
        self.steps = 0
        self.reason: str | None = None if self.cuda else self._cpu_unusable()
        self._base = 0

    @staticmethod
    def _cpu_unusable() -> str | None:
        if os.environ.get(MMAP_THRESHOLD_VAR) != MMAP_THRESHOLD:
            # Without it, freed blocks stay in the heap: RSS shows retained, not live, memory.
            return f"{MMAP_THRESHOLD_VAR}={MMAP_THRESHOLD} is not set in this process"
        try:
            _reset_peak_rss()
            _status_bytes("VmHWM")
        except OSError as error:
            return f"peak RSS cannot be reset here (/proc/self/clear_refs: {error}); needs Linux"
        return None

    def before(self) -> None:
        if self.reason is not None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _reset_peak_rss()
            self._base = _status_bytes("VmRSS")

    def after(self) -> None:
        if self.reason is not None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_bytes("VmHWM")
        # VmHWM read after step() returns: a temporary freed before then left a lower mark than
        # its true peak (about 60-250 KiB less, all of one of ~100 KiB or less), so the figure
        # is a lower bound at that resolution (README, "extra memory in step()")
        extra = max(0, peak - self._base)
        self.extra = extra if self.extra is None else max(self.extra, extra)
        self.steps += 1

    def fields(self, parameters: int) -> dict[str, Any]:
        """The JSON fields of a result row."""
        reason = self.reason
        if reason is None and self.extra is None:
            reason = "no step was measured"
        return {
            "step_extra_bytes": self.extra,
            "step_extra_bytes_per_param": None if self.extra is None else self.extra / parameters,
            "step_extra_bytes_reason": reason,
            "step_extra_measured_steps": self.steps,
        }


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(
    optimizer: Any, meter: StepMemory | None = None, device: torch.device | None = None
) -> float:
    """Seconds of one ``optimizer.step()``; ``meter`` brackets it outside the timed span. On a
    CUDA ``device`` the span starts and ends with a synchronize, so it holds the kernels' time,
    not only their launches."""
    if meter is not None:
        meter.before()
    if device is not None:
        synchronize(device)
    begin = time.perf_counter()
    optimizer.step()
    if device is not None:
        synchronize(device)
    seconds = time.perf_counter() - begin
    if meter is not None:
        meter.after()
    return seconds


def chosen_names(spec: str, known: Iterable[str], what: str) -> list[str]:
    """``--optimizers a,b`` (or ``all``) as names in ``known``: spaces stripped, a repeated name
    kept once; an unknown one exits naming it and ``what`` it should have been."""
    known = list(known)
    if spec.strip() == "all":
        return known
    names = list(dict.fromkeys(name.strip() for name in spec.split(",") if name.strip()))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown {what}(s) {unknown}; choose from {', '.join(known)}")
    if not names:
        raise SystemExit(f"no {what} named in {spec!r}; choose from {', '.join(known)}")
    return names


def print_targets(title: str, goals: list[dict[str, Any]]) -> None:
    """Target rows (``what``, ``target``, ``value``, ``met``, ``note``) as met / NOT MET lines
    (a value with ``met`` None: measured, but the note says why it is not judged)."""
    print()
    print(title)
    for goal in goals:
        unjudged = "not measured" if goal["value"] is None else "not judged"  # see its note
        verdict = {True: "met", False: "NOT MET", None: unjudged}[goal["met"]]
        value = "-" if goal["value"] is None else format(goal["value"], ".4g")
        print(f"  [{verdict:^12}] {goal['what']}: {value} (need {goal['target']}; {goal['note']})")


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` of /proc/cpuinfo (None off Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _cpu_generation() -> str | None:
    """Family and model numbers and the L1 data cache: a VM's "AMD EPYC" hides the generation,
    and the native kernel's speed relative to fused AdamW depends on it (Zen 4 is family 25,
    Zen 5 family 26)."""
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    if family is None:
        return None
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index0/size", encoding="utf-8") as handle:
            l1d = handle.read().strip()
    except OSError:
        l1d = "?"
    return f"family {family} model {model}, L1d {l1d}"


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
        "apollo-torch",
        "adam-mini",
        "numpy",
    )
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "versions": {name: _version(name) for name in distributions},
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_generation": _cpu_generation(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "mkldnn": bool(torch.backends.mkldnn.is_available()),  # type: ignore[no-untyped-call]
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` (Dynamo) built in this process so far: the optimizer's fused
    kernels, or a peer's compiled step."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
