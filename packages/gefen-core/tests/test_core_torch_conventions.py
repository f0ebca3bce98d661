"""The torch.optim convention checks (``gefen.core.testing_conventions``) for ``Gefen``, and for
``torch.optim.AdamW``: the reference they are modelled on, so a check that torch would fail is
caught here rather than trusted."""

from __future__ import annotations

import pytest

from gefen.core import Gefen
from gefen.core.testing_conventions import CHECKS, TORCH_ADAMW, Factory

FACTORIES = [TORCH_ADAMW, Factory("Gefen", Gefen)]


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("factory", FACTORIES, ids=[factory.name for factory in FACTORIES])
def test_torch_convention(factory: Factory, check: str) -> None:
    CHECKS[check](factory)
