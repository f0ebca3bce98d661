"""The comparison harness runs end to end with tiny settings and writes what the README promises."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPARE = ROOT / "benchmarks" / "compare.py"

_MISSING = [name for name in ("tqdm", "matplotlib") if importlib.util.find_spec(name) is None]

pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"the harness needs {', '.join(_MISSING)} (not installed here)"
)


def test_compare_tiny_run_writes_results_and_report(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    command = [
        sys.executable,
        str(COMPARE),
        "--steps",
        "3",
        "--model-size",
        "tiny",
        "--optimizers",
        "adamw,gefen",
        "--threads",
        "1",
        "--eval-batches",
        "2",
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "met" in completed.stdout  # the targets are printed

    document = json.loads((out / "results.json").read_text())
    assert document["config"]["steps"] == 3
    assert document["config"]["model_size"] == "tiny"
    assert {"torch", "python", "cpu", "threads", "versions"} <= set(document["environment"])
    rows = {row["optimizer"]: row for row in document["results"]}
    assert set(rows) == {"adamw", "gefen"}
    for row in rows.values():
        for key in ("train_loss", "eval_loss", "step_ms_median", "peak_rss_mb"):
            assert isinstance(row[key], float)
            assert row[key] > 0
        assert len(row["loss_curve"]) == 3
        assert row["eval_curve"]
    assert rows["adamw"]["step_time_ratio_vs_adamw"] == pytest.approx(1.0)
    assert rows["gefen"]["step_time_ratio_vs_adamw"] > 0
    # AdamW keeps two fp32 moments (8 bytes/param) plus a step counter per tensor.
    assert 8.0 <= rows["adamw"]["state_bytes_per_param"] < 8.1
    assert 0 < rows["gefen"]["state_bytes_per_param"] < 2
    assert [goal["what"] for goal in document["targets"]]

    png = out / "report.png"
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_micro_one_size_writes_json(tmp_path: pathlib.Path) -> None:
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "micro.py"),
        "--sizes",
        "1M",
        "--optimizers",
        "adamw,gefen",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    document = json.loads((tmp_path / "micro.json").read_text())
    rows = {row["optimizer"]: row for row in document["results"]}
    assert set(rows) == {"adamw", "gefen"}
    assert all(row["numel"] == 1 << 20 and row["step_ms_median"] > 0 for row in rows.values())
    assert document["codebook"]["histogram_active_bins"] > 0
    assert document["codebook"]["solve_4096_active_bins_s"] > 0
