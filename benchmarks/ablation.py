"""Ablation of Gefen's design choices on the comparison harness's model.

Trains the model of ``compare.py`` (same data, seed, recipe and worker subprocesses) with every
variant of ``harness_config.GEFEN_ABLATION`` — momentum codec, second-moment family, period rule,
codebook refresh — and with AdamW as the reference, then prints a Markdown table (held-out loss,
its gap to AdamW and to the default Gefen, state bytes per parameter) and writes
``OUT/ablation.json``. Losses do not depend on timing, so ``--jobs 2`` runs two workers at once
(step times are then not comparable and are not reported). Usage::

    python benchmarks/ablation.py --threads 1 --jobs 2 --out DIR
    python benchmarks/ablation.py --model-size large --steps 300 --variants gefen,gefen_period_shape
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import sys
import tempfile
from typing import Any

import compare
from harness import chosen_names, environment
from harness_config import (
    DEFAULT_BATCH,
    DEFAULT_EVAL_BATCHES,
    DEFAULT_LR,
    DEFAULT_SEED,
    GEFEN_ABLATION,
    MODEL_SIZES,
    SWEEP_MULTIPLIERS,
)

REFERENCE = "adamw"
STEPS = {"tiny": 3, "default": 150, "large": 300}


def base_lr(name: str) -> float:
    return DEFAULT_LR[REFERENCE if name == REFERENCE else "gefen"]


def run_all(names: list[str], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every (optimizer, learning rate) worker, ``args.jobs`` at a time; runs per optimizer."""
    multipliers = SWEEP_MULTIPLIERS if args.lr_sweep else (1.0,)
    jobs = [(name, base_lr(name) * m) for name in names for m in multipliers]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with (
        tempfile.TemporaryDirectory(prefix="gefen-ablation-") as scratch,
        concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool,
    ):
        futures = {
            pool.submit(compare.run_worker, name, lr, args, pathlib.Path(scratch), args.seed): name
            for name, lr in jobs
        }
        for future in concurrent.futures.as_completed(futures):
            runs[futures[future]].append(future.result())
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per optimizer at its best learning rate, with the gaps to AdamW and to Gefen."""
    best = {
        name: compare.best_run(sorted(found, key=lambda run: run["lr"]))
        for name, found in runs.items()
    }
    reference = best.get(REFERENCE, {}).get("eval_loss")
    default = best.get("gefen", {}).get("eval_loss")
    rows = []
    for name, run in best.items():
        loss = run.get("eval_loss")
        rows.append(
            {
                "optimizer": name,
                "what": "reference" if name == REFERENCE else GEFEN_ABLATION[name].what,
                "options": {} if name == REFERENCE else GEFEN_ABLATION[name].options,
                "period_rule": None if name == REFERENCE else GEFEN_ABLATION[name].period_rule,
                "lr": run.get("lr"),
                "eval_loss": loss,
                "train_loss": run.get("train_loss"),
                "state_bytes_per_param": run.get("state_bytes_per_param"),
                "gap_vs_adamw": None if loss is None or not reference else loss / reference - 1,
                "gap_vs_gefen": None if loss is None or not default else loss / default - 1,
                "sweep": [{"lr": r.get("lr"), "eval_loss": r.get("eval_loss")} for r in runs[name]],
                "failed": run.get("failed") or run.get("skipped"),
            }
        )
    return rows


def _cell(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | what | LR | held-out | vs AdamW | vs Gefen | B/param |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| `{row['optimizer']}` | {row['what']} | {_cell(row['lr'], '.3g')} "
            f"| {_cell(row['eval_loss'], '.3f')} | {_cell(row['gap_vs_adamw'], '+.2%')} "
            f"| {_cell(row['gap_vs_gefen'], '+.2%')} "
            f"| {_cell(row['state_bytes_per_param'], '.3f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default="all", help="comma-separated GEFEN_ABLATION names")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="default")
    parser.add_argument("--steps", type=int, help="default: 150 (default model), 300 (large)")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--eval-batches", type=int, default=DEFAULT_EVAL_BATCHES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--jobs", type=int, default=1, help="workers run at once")
    parser.add_argument("--lr-sweep", action="store_true", help=f"x{SWEEP_MULTIPLIERS} each LR")
    parser.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip AdamW (gaps to it are then not given)"
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or STEPS[args.model_size]
    if min(args.steps, args.batch, args.eval_batches, args.threads, args.jobs) < 1:
        parser.error("--steps, --batch, --eval-batches, --threads and --jobs must be positive")
    reference = [] if args.no_reference else [REFERENCE]
    variants = chosen_names(args.variants, GEFEN_ABLATION, "variant")
    names = [*reference, *(name for name in variants if name != REFERENCE)]
    rows = summarise(run_all(names, args))
    table = markdown(rows)
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {key: getattr(args, key.replace("-", "_")) for key in ("model-size", "steps", "batch")}
    config.update(lr_sweep=args.lr_sweep, seed=args.seed, threads=args.threads, jobs=args.jobs)
    document = {"environment": environment(args.threads), "config": config, "results": rows}
    (out / "ablation.json").write_text(json.dumps(compare.json_safe(document), indent=1) + "\n")
    print(f"\nwrote {out / 'ablation.json'}")
    return 1 if any(row["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
