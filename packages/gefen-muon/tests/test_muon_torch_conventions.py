"""The torch.optim convention checks (``gefen.core.testing_conventions``) for ``GefenMuon``."""

from __future__ import annotations

import pytest

from gefen.core.testing_conventions import CHECKS, Factory
from gefen.muon import GefenMuon

FACTORY = Factory(
    "GefenMuon",
    lambda params, **kw: GefenMuon(params, fused=False, **kw),
    group_options={
        "lr": 0.05,
        "weight_decay": 0.05,
        "momentum": 0.9,
        "nesterov": False,
        "ns_coefficients": (3.0, -3.2, 1.2),
        "eps": 1e-6,
        "ns_steps": 3,
        "adjust_lr_fn": "match_rms_adamw",
        "momentum_codec": "none",
        "sharded_mode": "distributed",  # "approx" may not sit beside "exact" (one codebook)
        "normuon": True,
        "normuon_beta2": 0.9,
        "normuon_eps": 1e-6,
        "ns_schedule": "tuned3",
        "stochastic_round": True,
        "deterministic": True,
        "check_finite": False,
    },
)
# ``fused`` is per group too; its alternatives compile (tests/test_muon_group_options.py).
NOT_EXERCISED = {"fused"}


def test_the_factory_names_every_option() -> None:
    """A new GefenMuon option must be declared in the factory (or said not exercised)."""
    defaults = GefenMuon(FACTORY.params(), fused=False).defaults
    assert set(FACTORY.group_options) | NOT_EXERCISED == set(defaults)
    assert GefenMuon.OPTIMIZER_WIDE == ()


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_torch_convention(check: str) -> None:
    CHECKS[check](FACTORY)
