"""Micro-benchmark: one ``optimizer.step()`` on a single large tensor, and the codebook solve.

For every optimizer of the comparison harness (peers only when importable), times ``step()`` on
one fp32 parameter of 1M and 16M elements: a flat vector for the Adam family, a square matrix
(1024x1024, 4096x4096) for the Muon family, which is the shape Muon is for. With a single matrix
both ``GefenMuonHybrid`` variants train it with ``GefenMuon`` alone (there is nothing for the
backup). Then times ``gefen.core.kernels.histogram`` and ``solve_codebook`` on 4096 active bins
(target: <= 1 s, 60-quality.md). Prints a table and writes ``OUT/micro.json``. Usage::

    python benchmarks/micro.py --threads 1
    python benchmarks/micro.py --sizes 1M --optimizers adamw,gefen --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
from harness import (
    PEER_MODULES,
    Unavailable,
    build_optimizer,
    environment,
    peer_missing,
    state_bytes,
)
from harness_config import CODEBOOK_SOLVE_SECONDS, OPTIMIZERS
from torch import nn

MUON_FAMILY = ("muon", "gefen_muon_gefen", "gefen_muon_adamw")
SIZES = {"1M": 1 << 20, "4M": 1 << 22, "16M": 1 << 24}


class Holder(nn.Module):
    """One parameter named ``weight``, so the hybrid's routing sends a matrix to Muon."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))


def shape_for(name: str, numel: int) -> tuple[int, ...]:
    if name not in MUON_FAMILY:
        return (numel,)
    side = math.isqrt(numel)
    rows = 1 << (side.bit_length() - 1)  # a power of two near sqrt(numel)
    return (rows, numel // rows)


def time_step(name: str, numel: int, repeats: int, warmup: int) -> dict[str, Any]:
    shape = shape_for(name, numel)
    holder = Holder(shape)
    lr = 1e-3
    try:
        optimizer = build_optimizer(name, holder, lr)
    except Unavailable as error:
        return {"optimizer": name, "numel": numel, "skipped": str(error)}
    except Exception as error:  # a peer that imports but cannot run here
        if name in PEER_MODULES:
            return {"optimizer": name, "numel": numel, "skipped": f"not usable: {error!r}"}
        raise
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=generator) for _ in range(2)]
    seconds: list[float] = []
    for index in range(warmup + repeats):
        holder.weight.grad = grads[index % 2]
        begin = time.perf_counter()
        try:
            optimizer.step()
        except Exception as error:
            if index == 0 and name in PEER_MODULES:
                return {"optimizer": name, "numel": numel, "skipped": f"not usable: {error!r}"}
            raise
        seconds.append(time.perf_counter() - begin)
    timed = seconds[warmup:]
    return {
        "optimizer": name,
        "numel": numel,
        "shape": list(shape),
        "first_step_ms": 1000 * seconds[0],
        "step_ms_median": 1000 * statistics.median(timed),
        "step_ms_min": 1000 * min(timed),
        "timed_steps": len(timed),
        "state_bytes_per_param": state_bytes(optimizer) / numel,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--optimizers", default="all", help=f"subset of {','.join(OPTIMIZERS)}")
    parser.add_argument("--sizes", default="1M,16M", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (Muon 16M: 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="bench-out", help="writes OUT/micro.json")
    parser.add_argument("--skip-codebook", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = list(OPTIMIZERS) if args.optimizers == "all" else args.optimizers.split(",")
    unknown = [name for name in names if name not in OPTIMIZERS]
    if unknown:
        parser.error(f"unknown optimizer(s) {unknown}")
    sizes = [SIZES[item] for item in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for name in names:
        reason = peer_missing(name)
        if reason is not None:
            print(f"note: skipping {name}: {reason}")
            skipped.append({"optimizer": name, "reason": reason})
            continue
        for numel in sizes:
            slow = name in MUON_FAMILY and numel >= SIZES["16M"]
            repeats, warmup = (min(2, args.repeats), 1) if slow else (args.repeats, args.warmup)
            print(f"  {name} on {numel:,} elements ...", file=sys.stderr, flush=True)
            row = time_step(name, numel, repeats, warmup)
            if "skipped" in row:
                print(f"note: skipping {name}: {row['skipped']}")
                skipped.append({"optimizer": name, "reason": row["skipped"]})
                break
            rows.append(row)
    adamw = {row["numel"]: row["step_ms_median"] for row in rows if row["optimizer"] == "adamw"}
    for row in rows:
        base = adamw.get(row["numel"])
        row["ratio_vs_adamw"] = None if base is None else row["step_ms_median"] / base
    print()
    header = (
        f"{'optimizer':<19}{'numel':>11}{'shape':>12}{'step ms':>11}"
        f"{'x AdamW':>9}{'first ms':>11}{'B/param':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        shape = "x".join(str(n) for n in row["shape"])
        ratio = "-" if row["ratio_vs_adamw"] is None else f"{row['ratio_vs_adamw']:.1f}"
        print(
            f"{row['optimizer']:<19}{row['numel']:>11,}{shape:>12}{row['step_ms_median']:>11.1f}"
            f"{ratio:>9}{row['first_step_ms']:>11.1f}{row['state_bytes_per_param']:>9.3f}"
        )
    codebook = None
    if not args.skip_codebook:
        codebook = time_codebook(max(sizes), repeats=3)
        verdict = "met" if codebook["solve_target_met"] else "NOT MET"
        print(
            f"\nhistogram of {codebook['histogram_numel']:,} values (period "
            f"{codebook['histogram_period']}): {codebook['histogram_ms_median']:.1f} ms, "
            f"{codebook['histogram_active_bins']} active bins; solve on it "
            f"{codebook['solve_ms_median_on_histogram']:.1f} ms"
        )
        print(
            f"codebook solve on 4096 active bins: {codebook['solve_4096_active_bins_s']:.3f} s "
            f"(target <= {CODEBOOK_SOLVE_SECONDS} s: {verdict})"
        )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "environment": environment(args.threads),
        "config": {"sizes": sizes, "repeats": args.repeats, "warmup": args.warmup},
        "results": rows,
        "skipped": skipped,
        "codebook": codebook,
    }
    (out / "micro.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {out / 'micro.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
