"""The torch.optim convention checks (``gefen.core.testing_conventions``) for ``Gefen``, and for
``torch.optim.AdamW``: the reference they are modelled on, so a check that torch would fail is
caught here rather than trusted."""

from __future__ import annotations

import pytest

from gefen.core import Gefen
from gefen.core.testing_conventions import CHECKS, TORCH_ADAMW, Factory

GEFEN = Factory(
    "Gefen",
    Gefen,
    group_options={
        "lr": 0.02,
        "betas": (0.8, 0.95),
        "eps": 1e-6,
        "weight_decay": 0.05,
        "factored_v_2d": False,
        "factored_floor": False,
        "nesterov": False,
        "force_1d_period_one": True,
        "force_2d_period_one": True,
        "stochastic_round": True,
        "deterministic": True,
        "check_finite": False,
        "momentum_codec": "none",
        "fused": False,
    },
    optimizer_wide={"codebook_refresh_every": 7},
)
FACTORIES = [TORCH_ADAMW, GEFEN]


def test_the_factory_names_every_option() -> None:
    """A new Gefen option must be declared per-group or optimizer-wide in the factory."""
    declared = set(GEFEN.group_options) | set(GEFEN.optimizer_wide)
    assert declared == set(Gefen(GEFEN.params()).defaults)
    assert set(GEFEN.optimizer_wide) == set(Gefen.OPTIMIZER_WIDE)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("factory", FACTORIES, ids=[factory.name for factory in FACTORIES])
def test_torch_convention(factory: Factory, check: str) -> None:
    CHECKS[check](factory)
