"""The torch.optim convention checks (``gefen.core.testing_conventions``) for ``GefenMuon``."""

from __future__ import annotations

import pytest

from gefen.core.testing_conventions import CHECKS, Factory
from gefen.muon import GefenMuon

FACTORY = Factory("GefenMuon", lambda params, **kw: GefenMuon(params, fused=False, **kw))


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_torch_convention(check: str) -> None:
    CHECKS[check](FACTORY)
