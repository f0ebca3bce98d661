"""The comparison harness runs end to end with tiny settings and writes what the README promises."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPARE = ROOT / "benchmarks" / "compare.py"

_MISSING = [name for name in ("tqdm", "matplotlib") if importlib.util.find_spec(name) is None]

pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"the harness needs {', '.join(_MISSING)} (not installed here)"
)


def assert_step_fields(row: dict[str, Any]) -> None:
    """The first step's time, and the step's extra memory: a number, or None with a reason."""
    assert isinstance(row["step_ms_first"], float)
    assert row["step_ms_first"] > 0
    extra = row["step_extra_bytes_per_param"]
    if extra is None:
        assert row["step_extra_bytes"] is None
        assert isinstance(row["step_extra_bytes_reason"], str)
        assert row["step_extra_bytes_reason"]
    else:
        assert isinstance(extra, (int, float))
        assert extra >= 0
        assert isinstance(row["step_extra_bytes"], int)
        assert row["step_extra_bytes_reason"] is None
        assert row["step_extra_measured_steps"] >= 1


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
    assert "first ms" in completed.stdout
    assert "extra B/p" in completed.stdout

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
        assert_step_fields(row)
    assert rows["adamw"]["step_time_ratio_vs_adamw"] == pytest.approx(1.0)
    assert rows["gefen"]["step_time_ratio_vs_adamw"] > 0
    # AdamW keeps two fp32 moments (8 bytes/param) plus a step counter per tensor.
    assert 8.0 <= rows["adamw"]["state_bytes_per_param"] < 8.1
    assert 0 < rows["gefen"]["state_bytes_per_param"] < 2
    goals = {goal["what"]: goal for goal in document["targets"]}
    assert goals["Gefen step time vs fused AdamW"]["target"] == "<= 3.0x"
    assert "GefenMuonHybrid (Gefen backup) step time vs torch Muon + AdamW" in goals
    assert "step_memory" in document["config"]

    png = out / "report.png"
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_micro_small_cases_write_json(tmp_path: pathlib.Path) -> None:
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "micro.py"),
        "--sizes",
        "2x128",  # one small stack of matrices: each (optimizer, case) is its own subprocess
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
    rows = {(row["optimizer"], row["case"]): row for row in document["results"]}
    assert set(rows) == {("adamw", "2x128"), ("gefen", "2x128")}
    for row in rows.values():
        assert row["step_ms_median"] > 0
        assert (row["numel"], row["tensors"], row["shape"]) == (2 * 128 * 128, 2, [128, 128])
        assert_step_fields(row)
    for header in ("first ms", "extra B/p", "targets:"):
        assert header in completed.stdout
    goals = {goal["what"]: goal for goal in document["targets"]}
    assert goals["Gefen step extra memory, 4x2048"]["met"] is None  # that case did not run
    assert document["codebook"]["histogram_active_bins"] > 0
    assert document["codebook"]["solve_4096_active_bins_s"] > 0


def test_micro_case_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # micro.py imports harness as a sibling
    spec = importlib.util.spec_from_file_location("micro", ROOT / "benchmarks" / "micro.py")
    assert spec is not None
    assert spec.loader is not None
    micro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(micro)
    assert micro.case_shapes("1M", "adamw") == [(1 << 20,)]
    assert micro.case_shapes("16M", "gefen") == [(1 << 24,)]
    assert micro.case_shapes("1M", "muon") == [(1024, 1024)]
    assert micro.case_shapes("16M", "gefen_muon_gefen") == [(4096, 4096)]
    for name in ("adamw", "gefen", "muon", "gefen_muon_gefen"):
        assert micro.case_shapes("4x2048", name) == [(2048, 2048)] * 4
    assert "4x2048" in micro.DEFAULT_SIZES.split(",")
    with pytest.raises(ValueError, match="unknown size"):
        micro.case_shapes("3M", "adamw")
