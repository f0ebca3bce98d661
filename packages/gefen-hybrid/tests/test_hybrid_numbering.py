"""The hybrid's messages number groups as its own ``param_groups`` does (Muon child's first),
never as a child does (docs/hybrid.md §2, docs/core.md §2.3)."""

from __future__ import annotations

import re

import pytest
import torch

from gefen.hybrid import GefenMuonHybrid
from gefen.hybrid.testing import assert_same_hybrid, hybrid_snapshot

BACKENDS = ["gefen", "adamw"]


def _parameter(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape))


def _four_groups(backend: str) -> tuple[GefenMuonHybrid, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    a, b, c, d = _parameter(4, 4), _parameter(4), _parameter(4, 4), _parameter(4)
    groups = [
        {"params": [a], "use_muon": True},
        {"params": [b], "use_muon": False},
        {"params": [c], "use_muon": True},
        {"params": [d], "use_muon": False},
    ]
    hybrid = GefenMuonHybrid(groups, lr=1e-2, fused=False, backup_optimizer=backend)
    assert [g["params"][0] for g in hybrid.param_groups] == [a, c, b, d]
    return hybrid, [a, b, c, d]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", [0, 1, 2, 3])
def test_a_step_error_names_the_parameter_by_the_hybrids_numbering(
    backend: str, target: int
) -> None:
    # It used to name a backup parameter by the backup's own groups: param_groups[1][0] for
    # the hybrid's param_groups[3][0], which is another tensor of the hybrid.
    hybrid, params = _four_groups(backend)
    bad = hybrid.param_groups[target]["params"][0]
    for p in params:
        p.grad = torch.randn_like(p)
    assert bad.grad is not None
    bad.grad[0] = float("nan")
    before = hybrid_snapshot(hybrid)
    with pytest.raises(RuntimeError, match=re.escape(f"param_groups[{target}][0]")):
        hybrid.step()
    assert_same_hybrid(before, hybrid_snapshot(hybrid))
    bad.grad[0] = 0.0
    hybrid.step()  # still trains


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backup_momentum_no_beta1_may_take_is_refused_at_construction(backend: str) -> None:
    # It used to be accepted until the first step, whose message numbered the backup's groups.
    w, b1, b2 = _parameter(4, 4), _parameter(4), _parameter(4)
    groups = [
        {"params": [w], "use_muon": True},
        {"params": [b1], "use_muon": False},
        {"params": [b2], "use_muon": False, "momentum": 2.0},
    ]
    with pytest.raises(ValueError, match=re.escape("param group 2: 'momentum' is read as")):
        GefenMuonHybrid(groups, lr=1e-2, fused=False, backup_optimizer=backend)
    groups[0], groups[2] = groups[2], groups[0]  # the caller's numbering: no hybrid exists yet
    with pytest.raises(ValueError, match=re.escape("param group 0: 'momentum' is read as")):
        GefenMuonHybrid(groups, lr=1e-2, fused=False, backup_optimizer=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_param_group_refuses_a_backup_momentum_and_changes_nothing(backend: str) -> None:
    w, b1 = _parameter(4, 4), _parameter(4)
    hybrid = GefenMuonHybrid(
        [{"params": [w], "use_muon": True}, {"params": [b1], "use_muon": False}],
        lr=1e-2,
        fused=False,
        backup_optimizer=backend,
    )
    before = hybrid_snapshot(hybrid)
    extra = _parameter(4)
    with pytest.raises(ValueError, match=re.escape("param group 2: 'momentum' is read as")):
        hybrid.add_param_group({"params": [extra], "use_muon": False, "momentum": 2.0})
    assert_same_hybrid(before, hybrid_snapshot(hybrid))
    assert len(hybrid.param_groups) == 2
    hybrid.add_param_group({"params": [extra], "use_muon": False, "momentum": 0.8})
    for p in (w, b1, extra):
        p.grad = torch.randn_like(p)
    hybrid.step()
    assert hybrid.param_groups[2]["betas"][0] == 0.8


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_load_says_how_the_backups_numbers_map_to_the_checkpoint(backend: str) -> None:
    # The backup checks its own part, numbered from 0: "group 0" and "id 97" stood for the
    # checkpoint's param_groups[2] and id 99 with nothing to say so.
    hybrid, params = _four_groups(backend)
    for p in params:
        p.grad = torch.randn_like(p)
    hybrid.step()
    saved = hybrid.state_dict()
    assert [len(group["params"]) for group in saved["param_groups"]] == [1, 1, 1, 1]
    saved["param_groups"][3]["lr"] = -1.0
    before = hybrid_snapshot(hybrid)
    with pytest.raises(ValueError, match=r"group 1\b.*") as refused:
        hybrid.load_state_dict(saved)
    assert refused.value.args[0].endswith(
        "[numbered within the backup's part: its group g is the checkpoint's "
        "param_groups[g + 2], its parameter id i the checkpoint's id i + 2]"
    )
    assert_same_hybrid(before, hybrid_snapshot(hybrid))
    saved["param_groups"][3]["lr"] = 1e-2
    hybrid.load_state_dict(saved)
    hybrid.step()  # still trains
