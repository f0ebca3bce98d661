"""How many Python calls one steady-state ``Gefen.step()`` makes (issue: the step's Python
path). Reported, not asserted: the figure is a design measure, printed with ``-s`` and recorded
as a junit property; the test asserts only that the measured step really stepped."""

from __future__ import annotations

import collections
import sys
from types import FrameType
from typing import Any

import pytest
import torch

from gefen.core import Gefen


@pytest.mark.fused_default  # the default kernel selection, as users run it
def test_report_python_calls_of_a_steady_state_step(record_property) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(64))]
    optimizer = Gefen(params, lr=1e-2)
    for param in params:
        param.grad = torch.randn_like(param)
    for _ in range(3):  # codebook learning, kernel selection and first allocations are done
        optimizer.step()
    before = [param.detach().clone() for param in params]
    calls: collections.Counter[str] = collections.Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls[frame.f_code.co_filename] += 1

    sys.setprofile(count)
    try:
        optimizer.step()
    finally:
        sys.setprofile(None)
    assert all(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
    total = sum(calls.values())
    record_property("python_calls", total)
    record_property("python_files", len(calls))
    report = f"Gefen.step() on two parameters: {total} Python calls in {len(calls)} files"
    print(f"\n{report}")  # noqa: T201 - the report is this test's purpose
