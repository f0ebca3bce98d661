"""The quality-per-byte frontier of a comparison run: held-out loss against optimizer-state bytes
per parameter, with the Pareto front (no other optimizer has both fewer bytes and a lower loss).

``compare.py`` calls ``front`` for its targets and ``plot_frontier`` for ``OUT/frontier.png``.
Run alone, it charts several runs' ``results.json`` together, a later file's row replacing an
earlier one of the same optimizer (rerun a few optimizers without rerunning every peer); a
file named as ``PATH:a,b`` gives only those optimizers' rows (a rerun that also holds rows the
chart should not take):

    python benchmarks/frontier.py OUT.png full/results.json rerun/results.json
    python benchmarks/frontier.py OUT.png full/results.json rerun/results.json:gefen,gefen_q4
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

OURS = ("gefen", "gefen_q4", "gefen_muon_gefen", "gefen_muon_adamw", "gefen_muon_gefen_q4")
# Not a point of its own: the same optimizer as ``gefen`` on the eager reference kernels.
LEFT_OUT = ("gefen_eager",)


def points(rows: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(optimizer, state bytes/param, held-out loss) of every finished run on the chart."""
    found = []
    for row in rows:
        loss, size = row.get("eval_loss"), row.get("state_bytes_per_param")
        if row["optimizer"] not in LEFT_OUT and loss is not None and size is not None:
            found.append((row["optimizer"], float(size), float(loss)))
    return found


def front(found: list[tuple[str, float, float]]) -> list[str]:
    """The names on the Pareto front, by bytes: a point is off it when another has at most its
    bytes and at most its loss, and less of one."""
    on = []
    for name, size, loss in found:
        dominated = any(
            other_size <= size and other_loss <= loss and (other_size, other_loss) != (size, loss)
            for _, other_size, other_loss in found
        )
        if not dominated:
            on.append((size, loss, name))
    return [name for _, _, name in sorted(on)]


def plot_frontier(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    found = points(rows)
    on = front(found)
    figure, axes = plt.subplots(figsize=(6.5, 4.2))
    for index, (name, size, loss) in enumerate(found):
        ours = name in OURS
        axes.scatter(size, loss, marker="*" if ours else "o", s=90 if ours else 30,
                     color="C3" if ours else "C0", zorder=3)  # fmt: skip
        axes.annotate(  # staggered: clustered points stay legible
            name,
            (size, loss),
            textcoords="offset points",
            xytext=(5, 3 - 8 * (index % 2)),
            fontsize=7,
        )
    by_name = {name: (size, loss) for name, size, loss in found}
    if on:
        xs: list[float] = []
        ys: list[float] = []
        for name in on:  # a staircase: the best loss reachable at each size
            size, loss = by_name[name]
            if xs:
                xs.append(size)
                ys.append(ys[-1])
            xs.append(size)
            ys.append(loss)
        axes.plot(xs, ys, color="grey", lw=1, ls="--", label="Pareto front", zorder=2)
        axes.legend(fontsize=7)
    axes.set_xscale("log")
    axes.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes.set_xticks([0.25, 0.5, 1, 2, 4, 8])
    axes.set_xlabel("optimizer state bytes / param (log)")
    axes.set_ylabel("held-out loss (nats/byte)")
    axes.grid(alpha=0.3)
    axes.set_title(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def source(argument: str) -> tuple[pathlib.Path, frozenset[str] | None]:
    """``PATH`` (every row) or ``PATH:a,b`` (only those optimizers' rows); a file whose own name
    holds a colon is taken whole."""
    path, _, names = argument.rpartition(":")
    if not path or pathlib.Path(argument).exists():
        return pathlib.Path(argument), None
    return pathlib.Path(path), frozenset(name.strip() for name in names.split(",") if name.strip())


def merged_rows(sources: list[pathlib.Path | str]) -> list[dict[str, Any]]:
    """The rows of every file in order, a later file's row replacing an earlier one's of the same
    optimizer (it keeps its position). A source ``PATH:a,b`` gives only those optimizers; a name
    it lacks is an error (a typo would otherwise chart the old row silently)."""
    rows: dict[str, dict[str, Any]] = {}
    for argument in sources:
        path, wanted = source(str(argument))
        found = {row["optimizer"]: row for row in json.loads(path.read_text())["results"]}
        missing = sorted((wanted or frozenset()) - found.keys())
        if missing:
            raise ValueError(f"{path} has no rows for {', '.join(missing)}")
        for name, row in found.items():
            if wanted is None or name in wanted:
                rows[name] = row
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path, help="the chart to write (.png)")
    parser.add_argument(
        "results", nargs="+", help="results.json files, each optionally PATH:optimizer,optimizer"
    )
    parser.add_argument("--title", default="", help="the chart's title")
    args = parser.parse_args(argv)
    rows = merged_rows(args.results)
    plot_frontier(rows, args.out, args.title)
    for name, size, loss in sorted(points(rows), key=lambda point: point[1]):
        on = "front" if name in front(points(rows)) else ""
        print(f"{name:24s} {size:7.3f} B/param  {loss:.4f}  {on}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
