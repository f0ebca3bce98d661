"""The comparison harness's configuration: the one table of default learning rates, the model
sizes, the shared training recipe and the targets of docs/quality.md.

The README lists ``DEFAULT_LR`` next to the results; ``compare.py --lr-sweep`` multiplies each
entry by ``SWEEP_MULTIPLIERS`` and keeps each optimizer's best.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Every optimizer the harness knows, in table order. Peers (bitsandbytes, torchao, apollo-torch,
# adam-mini) run only when importable and usable on the device, Gefen-X (``gefenx``,
# ``gefenx_hybrid``) only in its own venv (harness.OWN_VENV); the others always run.
OPTIMIZERS: tuple[str, ...] = (
    "adamw",
    "gefen",
    "gefen_eager",
    "gefen_q4",
    "muon",
    "gefen_muon_gefen",
    "gefen_muon_adamw",
    "gefen_muon_gefen_q4",
    "bnb_adamw8bit",
    "torchao_adamw8bit",
    "torchao_adamw4bit",
    "apollo",
    "apollo_mini",
    "adam_mini",
    "gefenx",
    "gefenx_hybrid",
)

# The one table of default learning rates (peak of the schedule below), chosen from a
# ``--lr-sweep`` of the default run (2026-11-30). The Muon-family entries use
# ``adjust_lr_fn="match_rms_adamw"``, so their learning rate is on the AdamW scale and is shared by
# the Muon matrices and the AdamW/Gefen backup.
DEFAULT_LR: dict[str, float] = {
    "adamw": 7.5e-4,
    "gefen": 7.5e-4,
    "gefen_eager": 7.5e-4,
    # codebook4 (4-bit momentum): the rates of their codebook8 twins.
    "gefen_q4": 7.5e-4,
    "muon": 1.2e-2,
    "gefen_muon_gefen": 1.2e-2,
    "gefen_muon_adamw": 1.2e-2,
    "gefen_muon_gefen_q4": 1.2e-2,
    "bnb_adamw8bit": 7.5e-4,
    "torchao_adamw8bit": 7.5e-4,
    "torchao_adamw4bit": 7.5e-4,
    # From two sweeps of the default run (2026-12-01, benchmarks/results/peers_sweep.json): the
    # first, around AdamW's 7.5e-4, put APOLLO's and APOLLO-Mini's best at its top (1.5e-3) and
    # adam-mini's at its bottom (3.75e-4); the second, around those, moved APOLLO to 3e-3 (again
    # the top: its published runs use 1e-2, so a higher rate may still do better).
    "apollo": 3e-3,
    "apollo_mini": 1.5e-3,
    "adam_mini": 3.75e-4,
    # Gefen-X 0.5.0 (its own venv): the rates of our Gefen and hybrid, each its best of a sweep
    # of the default run (2026-12-02, benchmarks/results/gefenx_sweep.json); its hybrid recipe
    # keeps Muon on the AdamW scale and halves the backup's rate itself.
    "gefenx": 7.5e-4,
    "gefenx_hybrid": 1.2e-2,
}

# The published APOLLO / APOLLO-Mini recipes (apollo-torch's README): the hidden matrices go to
# one low-rank group with these keys, everything else (embedding and tied head, position
# embedding, norms, biases) to a plain AdamW group of the same optimizer. ``rank`` is capped at
# each matrix's smaller dimension. The published APOLLO rank is about a quarter of the width
# (256 at 1B); 48 is that for the default model (width 192).
APOLLO_RECIPES: dict[str, dict[str, Any]] = {
    "apollo": {
        "rank": 48,
        "proj": "random",
        "proj_type": "std",
        "scale_type": "channel",
        "scale": 1,
        "update_proj_gap": 200,
    },
    "apollo_mini": {
        "rank": 1,
        "proj": "random",
        "proj_type": "std",
        "scale_type": "tensor",
        "scale": 128,
        "update_proj_gap": 200,
    },
}

SWEEP_MULTIPLIERS: tuple[float, ...] = (0.5, 1.0, 2.0)

# Shared recipe: every optimizer gets the same betas, weight decay, clipping and schedule.
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.999)
GRAD_CLIP = 1.0
WARMUP_FRACTION = 0.1  # linear warm-up over the first 10% of steps
FINAL_LR_FRACTION = 0.1  # cosine decay to 10% of the peak
EVAL_POINTS = 4  # held-out evaluations during training (the last one is the final eval)


@dataclass(frozen=True)
class ModelSize:
    d_model: int
    layers: int
    heads: int
    context: int
    vocab: int = 256  # bytes


MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(d_model=64, layers=2, heads=4, context=64),
    # Pinned by docs/quality.md: the bytes/param targets refer to this model (1,853,568 params).
    "default": ModelSize(d_model=192, layers=4, heads=4, context=128),
    "large": ModelSize(d_model=384, layers=6, heads=6, context=256),
}

# Defaults of the command line: the default run (5 optimizers) takes a few minutes on 2 cores.
DEFAULT_STEPS = 150
DEFAULT_BATCH = 8
DEFAULT_EVAL_BATCHES = 16
DEFAULT_SEED = 0
CORPUS_LIMIT_BYTES = 4_000_000
HELD_OUT_FRACTION = 0.1

# docs/quality.md "Numbers to reach" (bytes/param and loss are targets).
GEFEN_BYTES_PER_PARAM = 1.05
GEFEN_MUON_BYTES_PER_PARAM = 1.10
# Issue "the quality-per-byte frontier": the hybrid with codebook4 in both children.
HYBRID_Q4_BYTES_PER_PARAM = 0.6
HYBRID_Q4_LOSS_TOLERANCE = 0.01
LOSS_TOLERANCE = 0.02
CODEBOOK_SOLVE_SECONDS = 1.0

# What users feel (issue "The harness measures what users feel"): step time relative to the
# reference optimizer, and the memory a step needs beyond its inputs and state.
GEFEN_STEP_RATIO_MODEL = 3.0  # Gefen / fused AdamW median step(), compare.py's pinned model
GEFEN_STEP_RATIO_MICRO = 2.0  # the same on micro.py's 16M and 4x2048 cases
HYBRID_STEP_RATIO_VS_MUON = 1.2  # gefen_muon_gefen / torch Muon + AdamW, compare.py
GEFEN_MUON_STEP_RATIO_VS_MUON = 1.1  # gefen_muon_gefen / torch Muon on micro.py's single matrix
STEP_EXTRA_BYTES_PER_PARAM = 0.25  # Gefen's step extra (and GefenMuon's over torch Muon's), 4x2048

# The ablation of ``ablation.py`` (issue "the quality-per-byte frontier"): each variant is Gefen at
# its default LR with these constructor options and one period rule. ``row`` is Gefen's own rule
# since gefen-core 0.2 (one block per leading-dimension slice of every parameter with two or more
# dimensions and rows of at least 8 elements, §4's search for the rest); ``search``: §4's search
# for every parameter (the rule before 0.2); ``shape``: ``row``, and one block per vector (its §4
# fallback), a period known from the shape alone; ``fallback``: §4's fallback for every parameter.
PERIOD_RULES: tuple[str, ...] = ("search", "row", "shape", "fallback")


@dataclass(frozen=True)
class GefenVariant:
    what: str
    options: dict[str, Any]
    period_rule: str = "row"


GEFEN_ABLATION: dict[str, GefenVariant] = {
    "gefen": GefenVariant(
        "the defaults: codebook8, factored 2-D second moment floored by (1-b2)g², Nesterov "
        "look-ahead, one block per row",
        {},
    ),
    "gefen_codec_none": GefenVariant("fp32 momentum", {"momentum_codec": "none"}),
    "gefen_no_nesterov": GefenVariant(
        "the stored momentum applied, AdamW's update (nesterov=False)", {"nesterov": False}
    ),
    "gefen_v_product": GefenVariant(
        "factored second moment without the g² floor (factored_floor=False)",
        {"factored_floor": False},
    ),
    "gefen_v_block": GefenVariant("block second moment for matrices", {"factored_v_2d": False}),
    "gefen_v_element": GefenVariant(
        "per-element second moment (period 1 everywhere)",
        {"factored_v_2d": False, "force_1d_period_one": True, "force_2d_period_one": True},
    ),
    "gefen_period_search": GefenVariant("period: §4 search everywhere", {}, "search"),
    "gefen_period_shape": GefenVariant("period: from the shape alone", {}, "shape"),
    "gefen_period_fallback": GefenVariant("period: §4 fallback everywhere", {}, "fallback"),
    "gefen_period_row_vec1": GefenVariant(
        "period: one block per row, period 1 for vectors", {"force_1d_period_one": True}, "row"
    ),
    "gefen_refresh_50": GefenVariant(
        "codebook refreshed every 50 steps", {"codebook_refresh_every": 50}
    ),
}
