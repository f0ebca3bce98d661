"""No library module is over 500 lines (docs/architecture.md: one concept per module)."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 500


def test_no_library_module_is_over_500_lines() -> None:
    modules = sorted(ROOT.glob("packages/*/src/gefen/**/*.py"))
    assert len(modules) > 50  # the glob found the library, so an empty result means something
    over = {
        str(path.relative_to(ROOT)): count
        for path in modules
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > LIMIT
    }
    assert over == {}
