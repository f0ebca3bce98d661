"""Repository-wide test configuration.

Most tests exercise the optimizers' logic, not their kernels, so they run the eager reference
(compiling the fused update costs seconds per process). ``fused=None`` (the library default:
the fused update where ``torch.compile`` works) is mapped to the eager path unless a test is
marked ``fused_default``; an explicit ``fused=True`` / ``fused=False`` is never changed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _eager_unless_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("fused_default") is not None:
        yield
        return
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("gefen.core") is None:
        yield
        return
    import gefen.core.fused as fused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "resolve_default", lambda option: False if option is None else option)
        yield
