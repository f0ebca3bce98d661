"""The comparison harness runs end to end with tiny settings and writes what the README promises."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

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


def run_tiny_compare(out: pathlib.Path, *options: str) -> str:
    """compare.py on the tiny model (one thread, two held-out batches) into ``out``; its stdout."""
    command = [sys.executable, str(COMPARE), "--model-size", "tiny", "--threads", "1"]
    command += ["--eval-batches", "2", "--out", str(out), *options]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout


def test_compare_tiny_run_writes_results_and_report(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    stdout = run_tiny_compare(out, "--steps", "3", "--optimizers", "adamw,gefen")
    assert "met" in stdout  # the targets are printed
    assert "first ms" in stdout
    assert "extra B/p" in stdout

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

    for png in (out / "report.png", out / "frontier.png"):
        assert png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(document["pareto_front"]) <= {"adamw", "gefen"}
    assert document["pareto_front"]  # two finished runs: at least one is not dominated
    frontier_goal = goals["every optimizer of ours on the loss / state-bytes Pareto front"]
    assert frontier_goal["met"] == ("gefen" in document["pareto_front"])


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
    assert micro.case_shapes("1M", "apollo_mini") == [(1024, 1024)]  # APOLLO is for matrices
    assert micro.case_shapes("1M", "adam_mini") == [(1 << 20,)]
    for name in ("adamw", "gefen", "muon", "gefen_muon_gefen", "apollo"):
        assert micro.case_shapes("4x2048", name) == [(2048, 2048)] * 4
    assert "4x2048" in micro.DEFAULT_SIZES.split(",")
    with pytest.raises(ValueError, match="unknown size"):
        micro.case_shapes("3M", "adamw")


# -- the APOLLO, APOLLO-Mini and Adam-mini peers (in process: their adapters, not a training run)

NEW_PEERS = ("apollo", "apollo_mini", "adam_mini")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """benchmarks/harness.py, harness_config.py and compare.py, imported as siblings."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return types.SimpleNamespace(
        **{name: importlib.import_module(name) for name in ("harness", "harness_config", "compare")}
    )


def tiny_decoder(bench: types.SimpleNamespace) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = bench.compare.Decoder(bench.harness_config.MODEL_SIZES["tiny"])
    return model


def one_step(model: nn.Module, optimizer: Any, bench: types.SimpleNamespace) -> None:
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    optimizer.zero_grad(set_to_none=True)
    bench.compare.lm_loss(model, tokens, 256).backward()
    optimizer.step()


def hidden_matrices(model: nn.Module) -> set[str]:
    """The recipe's low-rank parameters in compare.py's Decoder: its blocks' Linear weights."""
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("blocks.")
    }


def test_new_peers_are_registered(bench: types.SimpleNamespace) -> None:
    config, harness = bench.harness_config, bench.harness
    for name in NEW_PEERS:
        assert name in config.OPTIMIZERS
        assert config.DEFAULT_LR[name] > 0
    assert harness.PEER_MODULES["apollo"] == harness.PEER_MODULES["apollo_mini"] == "apollo_torch"
    assert harness.PEER_MODULES["adam_mini"] == "adam_mini"
    assert config.APOLLO_RECIPES["apollo"] == {
        "rank": 48,
        "proj": "random",
        "proj_type": "std",
        "scale_type": "channel",
        "scale": 1,
        "update_proj_gap": 200,
    }
    assert config.APOLLO_RECIPES["apollo_mini"] == {
        "rank": 1,
        "proj": "random",
        "proj_type": "std",
        "scale_type": "tensor",
        "scale": 128,
        "update_proj_gap": 200,
    }


@pytest.mark.parametrize("name", NEW_PEERS)
def test_absent_peer_is_a_clean_skip(
    bench: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    harness = bench.harness
    module = harness.PEER_MODULES[name]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        harness.importlib.util,
        "find_spec",
        lambda wanted, *rest: None if wanted == module else real_find_spec(wanted, *rest),
    )
    assert harness.peer_missing(name) == f"{module} is not installed"
    with pytest.raises(harness.Unavailable, match="is not installed"):
        harness.build_optimizer(name, tiny_decoder(bench), 1e-3)
    args = argparse.Namespace(
        threads=1, model_size="tiny", steps=2, batch=2, eval_batches=1, seed=0
    )
    result = bench.compare.train_one(name, 1e-3, args)  # the worker's answer to the parent
    assert result == {"optimizer": name, "skipped": f"{module} is not installed"}


@pytest.mark.parametrize("name", NEW_PEERS)
def test_peer_that_does_not_import_is_a_clean_skip(
    bench: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    harness = bench.harness
    module = harness.PEER_MODULES[name]
    monkeypatch.setattr(harness, "peer_missing", lambda _: None)  # "installed"
    monkeypatch.setitem(sys.modules, module, None)  # ... but its import fails
    with pytest.raises(harness.Unavailable, match=f"{module} does not import"):
        harness.build_optimizer(name, tiny_decoder(bench), 1e-3)


def test_apollo_rank_is_capped_at_the_smaller_dimension(bench: types.SimpleNamespace) -> None:
    model = nn.Sequential(nn.Linear(8, 100), nn.Linear(100, 64), nn.LayerNorm(64))
    recipe = bench.harness_config.APOLLO_RECIPES["apollo"]
    groups = bench.harness.apollo_param_groups(model, recipe)
    assert "rank" not in groups[0]  # the plain group first: biases and the norm
    assert {id(p) for p in groups[0]["params"]} == {
        id(p) for name, p in model.named_parameters() if not name.endswith(("0.weight", "1.weight"))
    }
    ranks = {group["rank"]: group["params"] for group in groups[1:]}
    assert set(ranks) == {48, 8}  # 48 for the 64x100 matrix, 8 for the 100x8 one
    assert ranks[8] == [model[0].weight]
    assert ranks[48] == [model[1].weight]
    for group in groups[1:]:
        assert {key: group[key] for key in recipe if key != "rank"} == {
            key: value for key, value in recipe.items() if key != "rank"
        }


@pytest.mark.parametrize("name", ["apollo", "apollo_mini"])
def test_apollo_groups_follow_the_recipe(bench: types.SimpleNamespace, name: str) -> None:
    apollo_torch = pytest.importorskip("apollo_torch")
    model = tiny_decoder(bench)
    optimizer = bench.harness.build_optimizer(name, model, 1e-3)
    assert isinstance(optimizer, apollo_torch.APOLLOAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    recipe = bench.harness_config.APOLLO_RECIPES[name]
    plain, *low_rank = optimizer.param_groups
    assert not set(recipe) & set(plain)
    assert {names[id(p)] for p in plain["params"]} == set(names.values()) - hidden_matrices(model)
    assert {"embed.weight", "pos_embed"} <= {names[id(p)] for p in plain["params"]}
    assert len(low_rank) == 1  # the tiny model's matrices are all at least 64 wide
    assert {names[id(p)] for p in low_rank[0]["params"]} == hidden_matrices(model)
    assert {key: low_rank[0][key] for key in recipe} == recipe
    for group in optimizer.param_groups:
        assert group["betas"] == bench.harness_config.BETAS
        assert group["weight_decay"] == bench.harness_config.WEIGHT_DECAY

    one_step(model, optimizer, bench)
    # The state count includes each projector's random matrix, an attribute of a plain object.
    direct = projectors = 0
    for state in optimizer.state.values():
        direct += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        if "projector" in state:
            matrix = state["projector"].ortho_matrix
            assert matrix.shape[0] == recipe["rank"] or matrix.shape[1] == recipe["rank"]
            projectors += matrix.numel() * matrix.element_size()
    assert projectors > 0
    assert bench.harness.state_bytes(optimizer) == direct + projectors


def test_adam_mini_partitions_the_harness_model(bench: types.SimpleNamespace) -> None:
    adam_mini = pytest.importorskip("adam_mini")
    model = tiny_decoder(bench)
    size = bench.harness_config.MODEL_SIZES["tiny"]
    optimizer = bench.harness.build_optimizer("adam_mini", model, 1e-3)
    assert isinstance(optimizer, adam_mini.Adam_mini)
    assert (optimizer.dim, optimizer.n_heads, optimizer.n_kv_heads) == (size.d_model, 4, 4)
    decay = {group["name"]: group["weight_decay"] for group in optimizer.param_groups}
    assert set(decay) == {name.lower() for name, _ in model.named_parameters()}
    assert decay["blocks.0.qkv.weight"] == bench.harness_config.WEIGHT_DECAY
    assert decay["blocks.0.norm1.weight"] == decay["blocks.0.fc.bias"] == 0.0

    one_step(model, optimizer, bench)
    block = model.blocks[0]
    state = optimizer.state
    # qkv: one second moment per head of Q, K and V (adam-mini's rule for queries and keys)
    assert state[block.qkv.weight]["vmean"].shape == (3 * size.heads, 1)
    # attention output, MLP, embedding (tied head) and position embedding: one per row
    for param in (block.proj.weight, block.fc.weight, block.fc_out.weight, model.embed.weight):
        assert state[param]["vmean"].shape == (param.shape[0], 1)
    assert state[model.pos_embed]["vmean"].shape == (size.context, 1)
    assert state[block.norm1.weight]["vmean"].numel() == 1  # one per block
    assert state[block.qkv.bias]["v"].shape == block.qkv.bias.shape  # biases: plain Adam
    per_param = bench.harness.state_bytes(optimizer) / sum(p.numel() for p in model.parameters())
    assert 4.0 < per_param < 4.5  # the first moment in full, second moments nearly free


# -- the ablation (benchmarks/ablation.py)


def test_period_rules(bench: types.SimpleNamespace) -> None:
    period = bench.harness.variant_period
    assert period("search", (576, 192)) is None  # defers to §4's search
    assert period("row", (576, 192)) == period("shape", (576, 192)) == 192
    assert period("row", (4, 3, 8)) == 24  # the product of the non-leading dimensions
    assert period("row", (192,)) is None  # a vector keeps the search under ``row``
    assert period("shape", (192,)) == 192  # ... and is one block under ``shape``
    assert period("row", (64, 4)) is None  # a row under 8 elements: the search and its fallback
    assert period("shape", (64, 4)) == 256
    assert period("fallback", (576, 192)) == 2048
    assert period("shape", (1,)) is None
    with pytest.raises(ValueError, match="unknown period rule"):
        period("diagonal", (8, 8))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gefen", {"blocks.0.qkv.weight": 64, "embed.weight": 64}),  # Gefen's own row rule
        ("gefen_period_search", {"embed.weight": 2048, "blocks.1.qkv.bias": 64}),
        ("gefen_period_shape", {"blocks.0.qkv.weight": 64, "blocks.0.qkv.bias": 192}),
        ("gefen_period_fallback", {"blocks.0.qkv.weight": 2048, "blocks.0.norm1.weight": 64}),
    ],
)
def test_ablation_variants_apply_their_period_rule(
    bench: types.SimpleNamespace, name: str, expected: dict[str, int]
) -> None:
    model = tiny_decoder(bench)
    optimizer = bench.harness.build_optimizer(name, model, 1e-3)
    one_step(model, optimizer, bench)
    periods = {key: optimizer.state[param]["period"] for key, param in model.named_parameters()}
    for key, period in expected.items():
        assert periods[key] == period, (key, periods[key])


def test_ablation_options_reach_the_optimizer(bench: types.SimpleNamespace) -> None:
    model = tiny_decoder(bench)
    optimizer = bench.harness.build_optimizer("gefen_codec_none", model, 1e-3)
    assert {group["momentum_codec"] for group in optimizer.param_groups} == {"none"}
    assert set(bench.harness_config.GEFEN_ABLATION) >= {"gefen", "gefen_period_shape"}
    for variant in bench.harness_config.GEFEN_ABLATION.values():
        assert variant.period_rule in bench.harness_config.PERIOD_RULES


def test_ablation_tiny_run_writes_the_table(tmp_path: pathlib.Path) -> None:
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "ablation.py"),
        "--model-size",
        "tiny",
        "--variants",
        "gefen,gefen_codec_none",
        "--eval-batches",
        "2",
        "--jobs",
        "2",
        "--out",
        str(tmp_path),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "| `gefen_codec_none` | fp32 momentum |" in completed.stdout
    document = json.loads((tmp_path / "ablation.json").read_text())
    rows = {row["optimizer"]: row for row in document["results"]}
    assert set(rows) == {"adamw", "gefen", "gefen_codec_none"}
    assert rows["adamw"]["gap_vs_adamw"] == 0.0
    assert rows["gefen"]["gap_vs_gefen"] == 0.0
    assert (
        0
        < rows["gefen"]["state_bytes_per_param"]
        < 2
        < rows["gefen_codec_none"]["state_bytes_per_param"]
    )
    assert document["config"]["steps"] == 3


def test_pareto_front(bench: types.SimpleNamespace) -> None:
    frontier = importlib.import_module("frontier")
    found = [
        ("adamw", 8.0, 2.52),
        ("gefen", 1.05, 2.55),
        ("apollo_mini", 0.41, 2.50),  # fewer bytes and a lower loss than gefen: gefen is off
        ("hybrid", 1.02, 2.25),
        ("twin", 1.02, 2.25),  # an equal point dominates nothing and is not dominated
        ("muon", 4.2, 2.27),
    ]
    assert frontier.front(found) == ["apollo_mini", "hybrid", "twin"]
    assert frontier.front([]) == []
    rows = [
        {"optimizer": "gefen", "eval_loss": 2.5, "state_bytes_per_param": 1.0},
        {"optimizer": "gefen_eager", "eval_loss": 2.5, "state_bytes_per_param": 1.0},
        {"optimizer": "adamw", "eval_loss": None, "state_bytes_per_param": 8.0},  # diverged
    ]
    assert frontier.points(rows) == [("gefen", 1.0, 2.5)]  # the eager twin is left out


def write_results(path: pathlib.Path, *rows: tuple[str, float, float]) -> pathlib.Path:
    """A results.json holding (optimizer, held-out loss, state bytes/param) rows."""
    keys = ("optimizer", "eval_loss", "state_bytes_per_param")
    path.write_text(json.dumps({"results": [dict(zip(keys, row, strict=True)) for row in rows]}))
    return path


def test_frontier_merges_runs_a_later_row_replacing_an_earlier_one(
    bench: types.SimpleNamespace, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frontier = importlib.import_module("frontier")
    full = write_results(
        tmp_path / "full.json",
        ("apollo_mini", 2.45, 0.41),
        ("gefen", 2.51, 1.05),
        ("adamw", 2.49, 8.0),
    )
    rerun = write_results(tmp_path / "rerun.json", ("gefen", 2.43, 1.05))
    rows = frontier.merged_rows([full, rerun])
    assert [row["optimizer"] for row in rows] == ["apollo_mini", "gefen", "adamw"]
    assert rows[1]["eval_loss"] == 2.43
    chart = tmp_path / "frontier.png"
    assert frontier.main([str(chart), str(full), str(rerun)]) == 0
    assert chart.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "gefen" in printed
    assert "2.4300  front" in printed  # the rerun's loss, now below APOLLO-Mini's
    assert frontier.front(frontier.points(frontier.merged_rows([full]))) == ["apollo_mini"]


def test_frontier_takes_only_the_named_rows_of_a_file(
    bench: types.SimpleNamespace, tmp_path: pathlib.Path
) -> None:
    frontier = importlib.import_module("frontier")
    full = write_results(tmp_path / "full.json", ("gefen", 2.51, 1.05), ("hybrid", 2.19, 1.03))
    rerun = write_results(tmp_path / "rerun.json", ("gefen", 2.43, 1.05), ("hybrid", 2.30, 1.03))
    rows = frontier.merged_rows([full, f"{rerun}:gefen"])
    assert {row["optimizer"]: row["eval_loss"] for row in rows} == {"gefen": 2.43, "hybrid": 2.19}
    every = frontier.merged_rows([full, rerun])
    assert {row["optimizer"]: row["eval_loss"] for row in every} == {"gefen": 2.43, "hybrid": 2.30}
    with pytest.raises(ValueError, match="has no rows for gefen_q4"):
        frontier.merged_rows([full, f"{rerun}:gefen,gefen_q4"])


# -- Gefen-X (its own venv: its regular ``gefen`` package would shadow ours)

GEFENX = ("gefenx", "gefenx_hybrid")


@pytest.mark.parametrize("name", GEFENX)
def test_gefenx_without_its_venv_is_a_clean_skip(
    bench: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    harness, config = bench.harness, bench.harness_config
    assert name in config.OPTIMIZERS
    assert config.DEFAULT_LR[name] > 0
    monkeypatch.delenv("GEFENX_PYTHON", raising=False)
    reason = harness.peer_missing(name)
    assert reason == f"{name} runs in its own venv: set GEFENX_PYTHON to that venv's python"
    with pytest.raises(harness.Unavailable, match="runs in its own venv"):
        harness.build_optimizer(name, tiny_decoder(bench), 1e-3)
    monkeypatch.setenv("GEFENX_PYTHON", "/nonexistent/python")
    assert harness.peer_missing(name) is not None


@pytest.mark.parametrize("name", GEFENX)
def test_gefenx_workers_use_their_own_interpreter_and_never_ours(
    bench: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    harness = bench.harness
    monkeypatch.setenv("GEFENX_PYTHON", sys.executable)  # a venv without gefen-x: ours
    assert harness.worker_python(name) == sys.executable
    assert harness.worker_python("gefen") == sys.executable
    assert harness.peer_missing(name) is None
    # Here ``gefen`` is our namespace package, so the worker reports a clean skip, never ours.
    with pytest.raises(harness.Unavailable, match="gefen-x does not import"):
        harness.build_optimizer(name, tiny_decoder(bench), 1e-3)
    monkeypatch.setenv("GEFENX_PYTHON", "/opt/gefenx/bin/python")
    assert harness.worker_python(name) == "/opt/gefenx/bin/python"
    assert harness.worker_python("adamw") == sys.executable


def test_ablation_summary_without_the_reference(bench: types.SimpleNamespace) -> None:
    ablation = importlib.import_module("ablation")
    runs = {
        "gefen": [{"lr": 1e-3, "eval_loss": 2.6}, {"lr": 5e-4, "eval_loss": 2.5}],
        "gefen_codec_none": [{"lr": 1e-3, "eval_loss": 2.55, "state_bytes_per_param": 4.0}],
    }
    rows = {row["optimizer"]: row for row in ablation.summarise(runs)}
    assert rows["gefen"]["lr"] == 5e-4  # the best of the sweep
    assert rows["gefen_codec_none"]["gap_vs_gefen"] == pytest.approx(2.55 / 2.5 - 1)
    assert all(row["gap_vs_adamw"] is None for row in rows.values())
    assert "| `gefen_codec_none` | fp32 momentum | 0.001 |" in ablation.markdown(
        list(rows.values())
    )


# -- several seeds: one seed's differences are noise at the size of the loss targets


def test_compare_seeds_average_the_losses_and_keep_each(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    stdout = run_tiny_compare(out, "--steps", "2", "--optimizers", "adamw", "--seeds", "3,5")
    assert "held-out loss per seed (3, 5)" in stdout
    document = json.loads((out / "results.json").read_text())
    assert document["config"]["seeds"] == [3, 5]
    (row,) = document["results"]
    assert row["seeds"] == [3, 5]
    first, second = row["eval_loss_seeds"]
    assert first != second  # each seed draws its own initialisation and data order
    assert row["eval_loss"] == pytest.approx((first + second) / 2)
    assert row["train_loss"] == pytest.approx(sum(row["train_loss_seeds"]) / 2)
    goals = {goal["what"]: goal for goal in document["targets"]}
    assert "mean of seeds 3,5" in goals["Gefen held-out loss vs AdamW"]["note"]


def test_merge_seeds(bench: types.SimpleNamespace) -> None:
    merge = bench.compare.merge_seeds
    runs = [
        {
            "optimizer": "gefen",
            "seed": 0,
            "eval_loss": 2.0,
            "train_loss": 3.0,
            "step_ms_median": 1.0,
        },
        {
            "optimizer": "gefen",
            "seed": 1,
            "eval_loss": 2.2,
            "train_loss": 3.2,
            "step_ms_median": 9.0,
        },
    ]
    merged = merge(runs)
    assert merged["eval_loss"] == pytest.approx(2.1)
    assert merged["train_loss"] == pytest.approx(3.1)
    assert merged["eval_loss_seeds"] == [2.0, 2.2]
    assert merged["seeds"] == [0, 1]
    assert merged["step_ms_median"] == 1.0  # times are the first seed's
    diverged = [runs[0], {**runs[1], "eval_loss": None}]
    assert merge(diverged)["eval_loss"] is None  # a seed that diverged is no mean
    skipped = {"optimizer": "gefen", "skipped": "absent"}
    assert merge([runs[0], skipped]) is skipped


def test_seed_list(bench: types.SimpleNamespace) -> None:
    seed_list = bench.compare.seed_list
    assert seed_list(argparse.Namespace(seeds=None, seed=4)) == [4]
    assert seed_list(argparse.Namespace(seeds="0,1,2", seed=4)) == [0, 1, 2]
    for bad in ("0,x", "1,1"):
        with pytest.raises(SystemExit, match="--seeds"):
            seed_list(argparse.Namespace(seeds=bad, seed=0))


# -- benchmarks/second_moment.py: the estimator study's reference optimizer


def test_second_moment_exact_variant_is_torch_adamw(bench: types.SimpleNamespace) -> None:
    study = importlib.import_module("second_moment")
    torch.manual_seed(0)
    weights = [torch.randn(6, 5), torch.randn(5)]
    ours = [w.clone().requires_grad_() for w in weights]
    theirs = [w.clone().requires_grad_() for w in weights]
    reference = study.Reference(ours, lr=1e-2, variant="exact")
    adamw = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        grads = [
            torch.randn_like(w, generator=torch.Generator().manual_seed(step)) for w in weights
        ]
        for params, optimizer in ((ours, reference), (theirs, adamw)):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
    for mine, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)


def test_second_moment_variants_differ_only_on_matrices(bench: types.SimpleNamespace) -> None:
    study = importlib.import_module("second_moment")
    grad = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # rank 2: the factored estimate misses it
    finals = {}
    for variant in study.VARIANTS:
        matrix = torch.zeros(2, 2, requires_grad=True)
        vector = torch.zeros(2, requires_grad=True)
        optimizer = study.Reference([matrix, vector], lr=1.0, variant=variant, weight_decay=0.0)
        matrix.grad, vector.grad = grad.clone(), torch.ones(2)
        optimizer.step()
        finals[variant] = (matrix.detach().clone(), vector.detach().clone())
    # at t = 1 AdamW's update is sign(g); the factored one is g / sqrt(r_i c_j / mean r)
    torch.testing.assert_close(finals["exact"][0], -grad)
    torch.testing.assert_close(finals["factored"][0], -grad * 2.0**0.5)  # V = 1/2 everywhere
    torch.testing.assert_close(finals["freshmax"][0], -grad)  # floored by g²: sign(g) again
    for variant in study.VARIANTS:
        torch.testing.assert_close(finals[variant][1], -torch.ones(2))
    with pytest.raises(ValueError, match="variant"):
        study.Reference([torch.zeros(1, requires_grad=True)], lr=1.0, variant="nope")


# -- the harness's own bookkeeping: peak memory, divergence, targets, names


PEAK_SCRIPT = """
import sys, torch
sys.path.insert(0, {benchmarks!r})
import harness
meter = harness.StepMemory(torch.device("cpu"))
assert meter.reason is None, meter.reason
block = torch.ones(64 * 2**20)  # 256 MiB, touched, then freed before the meter's reset
del block
meter.before()
meter.after()
with open("/proc/self/status") as status:
    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
print(harness.peak_rss_mb() - rss)
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(), reason="needs Linux")
def test_peak_rss_keeps_what_came_before_the_step_meters_resets() -> None:
    """The meter resets the kernel's high-water mark before each step(), and ru_maxrss with it:
    the reported peak must still hold a block freed before the reset."""
    script = PEAK_SCRIPT.format(benchmarks=str(ROOT / "benchmarks"))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    above_now = float(completed.stdout.split()[-1])
    assert above_now > 200  # MiB: the freed 256 MiB block is in the peak


@pytest.mark.parametrize("name", ["gefen", "adamw"])
def test_a_divergence_is_a_diverged_row_for_every_optimizer(
    bench: types.SimpleNamespace, name: str
) -> None:
    """Gefen refuses a non-finite gradient by raising; the worker judges divergence before
    step(), so Gefen's row says diverged as AdamW's does instead of the worker crashing."""
    args = argparse.Namespace(
        threads=1, model_size="tiny", steps=3, batch=8, eval_batches=1, seed=0, device="cpu"
    )
    row = bench.compare.train_one(name, 1000.0, args)  # diverges within three steps
    assert row["diverged"] is True
    assert row["eval_loss"] is None
    assert len(row["loss_curve"]) <= 3


def goal_rows(bench: types.SimpleNamespace, seeds: str | None) -> dict[str, dict[str, Any]]:
    measured = {"adamw": (2.50, 1.0, 8.0), "gefen": (2.51, 2.0, 1.04)}
    results = {
        name: {"optimizer": name, "eval_loss": loss, "step_ms_median": ms,
               "state_bytes_per_param": size}
        for name, (loss, ms, size) in measured.items()
    }  # fmt: skip
    args = argparse.Namespace(model_size="default", lr_sweep=True, seeds=seeds, seed=0)
    return {goal["what"]: goal for goal in bench.compare.targets(results, args)}


def test_a_loss_target_is_judged_only_on_three_seeds(bench: types.SimpleNamespace) -> None:
    """docs/quality.md: one seed moves a loss gap by about 1%, so one seed is no verdict."""
    what = "Gefen held-out loss vs AdamW"
    one = goal_rows(bench, None)[what]
    assert one["value"] == pytest.approx(2.51 / 2.50 - 1)
    assert one["met"] is None
    assert "not judged on 1 seed(s)" in one["note"]
    assert goal_rows(bench, "0,1")[what]["met"] is None
    three = goal_rows(bench, "0,1,2")[what]
    assert three["met"] is True
    assert "not judged" not in three["note"]
    assert goal_rows(bench, None)["Gefen state bytes/param"]["met"] is True  # bytes: one seed


def test_chosen_names(bench: types.SimpleNamespace) -> None:
    choose = bench.harness.chosen_names
    known = ("adamw", "gefen", "muon")
    assert choose("all", known, "optimizer") == ["adamw", "gefen", "muon"]
    assert choose("gefen, adamw,gefen", known, "optimizer") == ["gefen", "adamw"]
    with pytest.raises(SystemExit, match=r"unknown optimizer\(s\) \['sgd'\]"):
        choose("adamw,sgd", known, "optimizer")
    with pytest.raises(SystemExit, match="no variant named"):
        choose(" , ", known, "variant")


def test_bench_session_writes_the_large_model_inside_the_given_out() -> None:
    pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("gefen_noxfile", ROOT / "noxfile.py")
    assert spec is not None
    assert spec.loader is not None
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    large = noxfile.large_model_out
    assert large([]) == str(pathlib.Path("bench-out") / "large")
    assert large(["--out", "runs/a", "--steps", "5"]) == str(pathlib.Path("runs/a") / "large")
    assert large(["--out=runs/b"]) == str(pathlib.Path("runs/b") / "large")
    assert large(["--out", "x", "--out", "y"]) == str(pathlib.Path("y") / "large")


def test_micro_runs_gefenx_workers_under_their_own_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    # micro.py ran every worker under its own interpreter, where gefen-x never imports (it
    # must not share a venv with our namespace); compare.py already honoured GEFENX_PYTHON.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    micro = importlib.import_module("micro")
    monkeypatch.setenv("GEFENX_PYTHON", "/opt/gefenx/bin/python")
    interpreters: list[str] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        interpreters.append(command[0])
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(micro.subprocess, "run", run)
    args = micro.parse_args(["--threads", "1"])
    for name in ("gefenx", "gefen"):
        assert "failed" in micro.run_worker(name, "16M", args, tmp_path)
    assert interpreters == ["/opt/gefenx/bin/python", sys.executable]
