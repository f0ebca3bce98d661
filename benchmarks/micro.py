"""Micro-benchmark: ``optimizer.step()`` on large tensors, its extra memory, and the codebook solve.

For every optimizer of the comparison harness (peers only when importable), times ``step()`` on
each case of ``--sizes``:

* ``1M``, ``4M``, ``16M`` (``64M``, ``256M`` for a GPU): one fp32 parameter of that many
  elements, a flat vector for the Adam family and a square matrix (1024x1024, 4096x4096) for the
  Muon family and APOLLO / APOLLO-Mini, which is the shape they are for. With a single matrix
  both ``GefenMuonHybrid`` variants train it with ``GefenMuon`` alone (there is nothing for the
  backup), and APOLLO has only its low-rank group.
* ``NxS`` (``4x2048`` by default): one model holding N fp32 SxS matrices, the same for every
  optimizer (the Muon family trains all N with Muon).

Gradients are fixed random tensors (two sets, alternating). Each (optimizer, case) runs in its
own subprocess, so its memory is its own: ``step_extra_bytes_per_param`` is the largest extra
memory of one ``step()`` over the timed steps (``harness.StepMemory``). ``step_ms_first`` is the
first step (compilation and codebook learning included). Then times
``gefen.core.kernels.histogram`` and ``solve_codebook`` on 4096 active bins, prints a table and the
targets (met / not met), and writes ``OUT/micro.json``. Usage::

    python benchmarks/micro.py --threads 1
    python benchmarks/micro.py --sizes 1M,4x2048 --optimizers adamw,gefen --repeats 3
    python benchmarks/micro.py --device cuda --sizes 16M,64M,4x4096 --skip-codebook
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from harness import (
    PEER_MODULES,
    STEP_MEMORY_METHOD,
    StepMemory,
    Unavailable,
    build_optimizer,
    chosen_names,
    environment,
    peer_missing,
    print_targets,
    state_bytes,
    timed_step,
    worker_env,
    worker_python,
)
from harness_config import (
    CODEBOOK_SOLVE_SECONDS,
    GEFEN_MUON_STEP_RATIO_VS_MUON,
    GEFEN_STEP_RATIO_MICRO,
    OPTIMIZERS,
    STEP_EXTRA_BYTES_PER_PARAM,
)
from torch import nn

MUON_FAMILY = ("muon", "gefen_muon_gefen", "gefen_muon_adamw", "gefen_muon_gefen_q4")
MATRIX_SHAPED = (*MUON_FAMILY, "apollo", "apollo_mini")  # single cases are square matrices
SINGLE_SIZES = {"1M": 1 << 20, "4M": 1 << 22, "16M": 1 << 24, "64M": 1 << 26, "256M": 1 << 28}
STACK = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")  # NxS: N matrices of SxS
DEFAULT_SIZES = "1M,16M,4x2048"
SLOW_NUMEL = 1 << 24  # from here the Muon family gets at most 2 timed steps and 1 warm-up
PEERS = ("bnb_adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit")
SPEED_CASES = ("16M", "4x2048")  # where Gefen's step time is compared
MUON_SPEED_CASE = "16M"  # GefenMuon vs torch Muon on the single matrix
MEMORY_CASE = "4x2048"  # where the step's extra memory is compared


def case_shapes(case: str, name: str) -> list[tuple[int, ...]]:
    """The parameter shapes of ``case`` for optimizer ``name``; ValueError for an unknown case."""
    if case in SINGLE_SIZES:
        numel = SINGLE_SIZES[case]
        if name not in MATRIX_SHAPED:
            return [(numel,)]
        rows = 1 << (math.isqrt(numel).bit_length() - 1)  # a power of two near sqrt(numel)
        return [(rows, numel // rows)]
    match = STACK.fullmatch(case)
    if match is None:
        raise ValueError(f"unknown size {case!r}: use {', '.join(SINGLE_SIZES)} or NxS")
    count, side = int(match[1]), int(match[2])
    return [(side, side)] * count


class Holder(nn.Module):
    """The case's parameters, all 2-D ones named so that the hybrid's routing sends them to Muon."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes
        )


def time_step(
    name: str, case: str, repeats: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    """``warmup + repeats`` steps of ``name`` on ``case``; the worker subprocess's whole job."""
    shapes = case_shapes(case, name)
    holder = Holder(shapes).to(device)
    params = list(holder.weights)
    numel = sum(p.numel() for p in params)
    head = {"optimizer": name, "case": case, "numel": numel}
    try:
        optimizer = build_optimizer(name, holder, lr=1e-3)
    except Unavailable as error:
        return {**head, "skipped": str(error)}
    except Exception as error:  # a peer that imports but cannot run here
        if name in PEER_MODULES:
            return {**head, "skipped": f"not usable: {error!r}"}
        raise
    generator = torch.Generator().manual_seed(1)
    grads = [
        [torch.randn(shape, generator=generator).to(device) for shape in shapes] for _ in range(2)
    ]
    meter = StepMemory(params[0].device)
    seconds: list[float] = []
    for index in range(warmup + repeats):
        for param, grad in zip(params, grads[index % 2], strict=True):
            param.grad = grad
        try:  # memory is measured on the timed steps, as the time is
            seconds.append(timed_step(optimizer, meter if index >= warmup else None, device))
        except Exception as error:
            if index == 0 and name in PEER_MODULES:
                return {**head, "skipped": f"not usable: {error!r}"}
            raise
    timed = seconds[warmup:]
    return {
        **head,
        "device": str(device),
        "shape": list(shapes[0]),
        "tensors": len(shapes),
        "step_ms_first": 1000 * seconds[0],
        "step_ms_median": 1000 * statistics.median(timed),
        "step_ms_min": 1000 * min(timed),
        "timed_steps": len(timed),
        "state_bytes_per_param": state_bytes(optimizer) / numel,
        **meter.fields(numel),
    }


def time_codebook(numel: int, repeats: int) -> dict[str, Any]:
    from gefen.core.kernels import BIN_COUNT, histogram, solve_codebook

    generator = torch.Generator().manual_seed(2)
    x = torch.randn(numel, generator=generator)
    period = 256
    hist_seconds, solve_seconds, full_seconds = [], [], []
    counts = histogram(x, period)
    # A histogram with every one of the 4096 bins active: the solver's worst case.
    full = torch.randint(1, 1000, (BIN_COUNT,), generator=generator, dtype=torch.int64)
    for _ in range(repeats):
        begin = time.perf_counter()
        counts = histogram(x, period)
        hist_seconds.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        solve_codebook(counts)
        solve_seconds.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        solve_codebook(full)
        full_seconds.append(time.perf_counter() - begin)
    solve_full_s = statistics.median(full_seconds)
    return {
        "histogram_numel": numel,
        "histogram_period": period,
        "histogram_ms_median": 1000 * statistics.median(hist_seconds),
        "histogram_active_bins": int((counts > 0).sum()),
        "solve_ms_median_on_histogram": 1000 * statistics.median(solve_seconds),
        "solve_4096_active_bins_s": solve_full_s,
        "solve_target_s": CODEBOOK_SOLVE_SECONDS,
        "solve_target_met": solve_full_s <= CODEBOOK_SOLVE_SECONDS,
    }


# -- the parent: one subprocess per (optimizer, case) -----------------------------------------


def run_worker(name: str, case: str, args: argparse.Namespace, scratch: pathlib.Path) -> Any:
    numel = sum(math.prod(shape) for shape in case_shapes(case, name))
    slow = name in MUON_FAMILY and numel >= SLOW_NUMEL
    repeats, warmup = (min(2, args.repeats), 1) if slow else (args.repeats, args.warmup)
    out = scratch / f"{name}-{case}.json"
    command = [
        worker_python(name),  # Gefen-X's workers run under GEFENX_PYTHON, as compare.py's
        str(pathlib.Path(__file__).resolve()),
        *("--worker", name, "--worker-case", case, "--worker-out", str(out)),
        *("--repeats", str(repeats), "--warmup", str(warmup), "--threads", str(args.threads)),
        *("--device", args.device),
    ]
    completed = subprocess.run(command, check=False, env=worker_env())
    if completed.returncode != 0 or not out.exists():
        return {"optimizer": name, "case": case, "failed": f"worker exited {completed.returncode}"}
    return json.loads(out.read_text())


def measure_all(
    names: list[str], cases: list[str], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
    """(rows, skipped, whether a worker failed) over every optimizer and case."""
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="gefen-micro-") as scratch:
        for name in names:
            reason = peer_missing(name)
            if reason is not None:
                print(f"note: skipping {name}: {reason}")
                skipped.append({"optimizer": name, "reason": reason})
                continue
            for case in cases:
                print(f"  {name} on {case} ...", file=sys.stderr, flush=True)
                row = run_worker(name, case, args, pathlib.Path(scratch))
                if "skipped" in row:
                    print(f"note: skipping {name}: {row['skipped']}")
                    skipped.append({"optimizer": name, "reason": row["skipped"]})
                    break
                if "failed" in row:
                    print(f"error: {name} on {case}: {row['failed']}", file=sys.stderr)
                    skipped.append({"optimizer": name, "case": case, "reason": row["failed"]})
                    failed = True
                    continue
                rows.append(row)
                # as it comes, so a run cut short (a device lease's limit) still reports it
                print(
                    f"  {name} on {case}: {row['step_ms_median']:.3f} ms, "
                    f"extra {row['step_extra_bytes_per_param']} B/param",
                    file=sys.stderr,
                    flush=True,
                )
    adamw = {row["case"]: row["step_ms_median"] for row in rows if row["optimizer"] == "adamw"}
    for row in rows:
        base = adamw.get(row["case"])
        row["ratio_vs_adamw"] = None if base is None else row["step_ms_median"] / base
    return rows, skipped, failed


def targets(rows: list[dict[str, Any]], codebook: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The micro-benchmark's targets, each met (True), not met (False) or not measured (None)."""
    found = {(row["optimizer"], row["case"]): row for row in rows}
    goals: list[dict[str, Any]] = []

    def get(name: str, case: str, key: str) -> float | None:
        value = found.get((name, case), {}).get(key)
        return None if value is None else float(value)

    def ratio(ours: str, theirs: str, case: str) -> float | None:
        mine, reference = get(ours, case, "step_ms_median"), get(theirs, case, "step_ms_median")
        return None if mine is None or reference is None else mine / reference

    def add(what: str, target: str, value: float | None, limit: float, note: str) -> None:
        met = None if value is None else value < limit if target == "faster" else value <= limit
        goals.append({"what": what, "target": target, "value": value, "met": met, "note": note})

    for case in SPEED_CASES:
        value = ratio("gefen", "adamw", case)
        limit = GEFEN_STEP_RATIO_MICRO
        add(f"Gefen step time vs fused AdamW, {case}", f"<= {limit}x", value, limit, "ratio")
        for peer in PEERS:
            if (peer, case) in found:  # only peers that ran here
                value = ratio("gefen", peer, case)
                add(f"Gefen step time vs {peer}, {case}", "faster", value, 1.0, "ratio Gefen/peer")
    case, limit = MUON_SPEED_CASE, GEFEN_MUON_STEP_RATIO_VS_MUON
    value = ratio("gefen_muon_gefen", "muon", case)
    add(f"GefenMuon step time vs torch Muon, {case} matrix", f"<= {limit}x", value, limit, "ratio")
    limit = STEP_EXTRA_BYTES_PER_PARAM
    gefen = get("gefen", MEMORY_CASE, "step_extra_bytes_per_param")
    add(f"Gefen step extra memory, {MEMORY_CASE}", f"<= {limit} B/param", gefen, limit, "B/param")
    mine = get("gefen_muon_gefen", MEMORY_CASE, "step_extra_bytes_per_param")
    theirs = get("muon", MEMORY_CASE, "step_extra_bytes_per_param")
    value = None if mine is None or theirs is None else mine - theirs
    what = f"GefenMuon step extra memory over torch Muon's, {MEMORY_CASE}"
    add(what, f"<= +{limit} B/param", value, limit, "difference, B/param")
    if codebook is not None:
        value, limit = codebook["solve_4096_active_bins_s"], CODEBOOK_SOLVE_SECONDS
        add("codebook solve on 4096 active bins", f"<= {limit} s", value, limit, "seconds")
    return goals


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'optimizer':<19}{'case':>8}{'shape':>12}{'step ms':>11}{'x AdamW':>9}"
        f"{'first ms':>11}{'B/param':>9}{'extra B/p':>11}"
    )
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        shape = "x".join(str(n) for n in row["shape"])
        extra = _fmt(row["step_extra_bytes_per_param"], ".3f")
        print(
            f"{row['optimizer']:<19}{row['case']:>8}{shape:>12}{row['step_ms_median']:>11.1f}"
            f"{_fmt(row['ratio_vs_adamw'], '.1f'):>9}{row['step_ms_first']:>11.1f}"
            f"{row['state_bytes_per_param']:>9.3f}{extra:>11}"
        )
    for row in rows:
        if row["step_extra_bytes_per_param"] is None:
            print(
                f"note: {row['optimizer']} {row['case']}: extra B/p not measured: "
                f"{row['step_extra_bytes_reason']}"
            )
    print(
        "first ms: the first step() (compilation, codebook learning); extra B/p: peak memory "
        "during step() beyond what was resident before it, per parameter, max over timed steps"
    )


def print_codebook(codebook: dict[str, Any]) -> None:
    print(
        f"\nhistogram of {codebook['histogram_numel']:,} values (period "
        f"{codebook['histogram_period']}): {codebook['histogram_ms_median']:.1f} ms, "
        f"{codebook['histogram_active_bins']} active bins; solve on it "
        f"{codebook['solve_ms_median_on_histogram']:.1f} ms; on 4096 active bins "
        f"{codebook['solve_4096_active_bins_s']:.3f} s"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--optimizers", default="all", help=f"subset of {','.join(OPTIMIZERS)}")
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma-separated cases: {', '.join(SINGLE_SIZES)} or NxS (N SxS matrices); "
        f"default {DEFAULT_SIZES}",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (Muon >= 16M: 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default="bench-out", help="writes OUT/micro.json")
    parser.add_argument("--skip-codebook", action="store_true")
    parser.add_argument("--device", default="cpu", help="where the parameters live (cpu, cuda)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-case", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads must be positive, --warmup not negative")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    args.names = chosen_names(args.optimizers, OPTIMIZERS, "optimizer")
    args.cases = [case.strip() for case in args.sizes.split(",") if case.strip()]
    try:
        for case in args.cases:
            case_shapes(case, "adamw")
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        device = torch.device(args.device)
        result = time_step(args.worker, args.worker_case, args.repeats, args.warmup, device)
        pathlib.Path(args.worker_out).write_text(json.dumps(result))
        return 0
    rows, skipped, failed = measure_all(args.names, args.cases, args)
    print_table(rows)
    codebook = None
    if not args.skip_codebook:
        numel = max(sum(math.prod(s) for s in case_shapes(case, "adamw")) for case in args.cases)
        codebook = time_codebook(numel, repeats=3)
        print_codebook(codebook)
    goals = targets(rows, codebook)
    print_targets("targets:", goals)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "environment": environment(args.threads),
        "config": {
            "sizes": args.cases,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": args.threads,
            "step_memory": STEP_MEMORY_METHOD + "; measured steps: the timed ones",
        },
        "results": rows,
        "skipped": skipped,
        "codebook": codebook,
        "targets": goals,
    }
    (out / "micro.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {out / 'micro.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
