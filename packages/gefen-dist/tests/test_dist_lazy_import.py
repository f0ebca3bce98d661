"""``import gefen.dist`` works on builds without torch.distributed (docs/dist.md §1)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist

    # A build without torch.distributed: the availability query says no and the DTensor
    # package cannot be imported at all.
    dist.is_available = lambda: False
    for name in [n for n in sys.modules if n.startswith("torch.distributed.tensor")]:
        del sys.modules[name]
    sys.modules["torch.distributed.tensor"] = None

    import gefen.dist
    import gefen.dist.testing
    from gefen.contracts import ProcessGroupIdentity

    params = [torch.nn.Parameter(torch.ones(2))]
    assert gefen.dist.collect_failure_scope([{"params": params, "sharded_mode": "approx"}]) == ()
    try:
        # Every other argument is wrong too: availability is checked first.
        gefen.dist.CodebookProcessGroupBinding(
            ProcessGroupIdentity("dp", ("rank:0", "rank:1")), 5, object(), 3.0
        )
    except RuntimeError as error:
        assert "torch.distributed" in str(error), error
        print("multi-member:", type(error).__name__)
    else:
        raise AssertionError("a multi-member binding was built without torch.distributed")
    solo = gefen.dist.CodebookProcessGroupBinding(
        ProcessGroupIdentity("solo", ("rank:0",)), "rank:0", None, "cpu"
    )
    solo.validate_runtime()
    gefen.dist.synchronize_step_error(None, "step preflight", solo.failure_scope(), "Gefen")
    assert sys.modules["torch.distributed.tensor"] is None
    assert "pytest" not in sys.modules  # the testing package imports pytest only on demand
    print("ok")
    """
)


def test_import_without_torch_distributed() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == ["multi-member: RuntimeError", "ok"]
