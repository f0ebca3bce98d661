"""Each package README's first Python example runs as written (on its own tiny model and data)
and trains: a quickstart a user copies must not name anything it does not define."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIRST_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("package", ["gefen-core", "gefen-muon", "gefen-hybrid"])
def test_the_readme_quickstart_runs_as_written_and_trains(package: str) -> None:
    readme = (ROOT / "packages" / package / "README.md").read_text(encoding="utf-8")
    found = FIRST_PYTHON_BLOCK.search(readme)
    assert found is not None, f"{package}/README.md has no python example"
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": "quickstart"}
    exec(compile(found.group(1), f"{package}/README.md", "exec"), namespace)
    loader = namespace["loader"]
    assert isinstance(loader, list)
    optimizers = [v for v in namespace.values() if isinstance(v, torch.optim.Optimizer)]
    assert optimizers, "the example builds no optimizer"
    for optimizer in optimizers:  # each stepped every parameter once per batch
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps = {int(optimizer.state[p]["step"]) for p in params}
        assert steps == {len(loader)}, type(optimizer).__name__
