"""The AdamW verification seam (docs/core.md §6.5; §12 #27)."""

from __future__ import annotations

import torch

from gefen.core import Gefen

PARITY_OPTIONS = {
    "momentum_codec": "none",
    "force_1d_period_one": True,
    "force_2d_period_one": True,
    "factored_v_2d": False,
    "nesterov": False,  # AdamW applies the stored momentum; the look-ahead is NAdamW's
}


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    first, second = model[0], model[2]
    return [
        {"params": [first.weight, first.bias], "lr": torch.tensor(0.01), "weight_decay": 0.1},
        {"params": [second.weight, second.bias], "lr": torch.tensor(0.003), "weight_decay": 0.0},
    ]


def test_adamw_parity_over_20_steps() -> None:
    ours, theirs = _model(), _model()
    gefen = Gefen(_groups(ours), betas=(0.9, 0.99), eps=1e-6, **PARITY_OPTIONS)
    adamw = torch.optim.AdamW(_groups(theirs), betas=(0.9, 0.99), eps=1e-6, foreach=False)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.7) for o in (gefen, adamw)
    ]
    data = torch.randn(20, 16, 6, generator=torch.Generator().manual_seed(1))
    target = torch.randn(20, 16, 3, generator=torch.Generator().manual_seed(2))
    for step in range(20):
        frozen = 5 <= step < 9  # the second layer's bias is frozen, then unfrozen
        for model in (ours, theirs):
            model[2].bias.requires_grad_(not frozen)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(data[step]), target[step]).backward()
            if step == 3:
                model[0].bias.grad = None  # one gradient set to None on one step
        for optimizer, scheduler in zip((gefen, adamw), schedulers, strict=True):
            optimizer.step()
            scheduler.step()
        for (name, ours_p), theirs_p in zip(
            ours.named_parameters(), theirs.parameters(), strict=True
        ):
            torch.testing.assert_close(ours_p, theirs_p, rtol=1e-5, atol=1e-6, msg=name)
            state, reference = gefen.state[ours_p], adamw.state[theirs_p]
            if not reference:
                assert "step" not in state
                continue
            assert state["step"] == int(reference["step"])
            torch.testing.assert_close(
                state["momentum"],
                reference["exp_avg"].reshape(state["momentum"].shape),
                rtol=1e-5,
                atol=1e-7,
            )
            torch.testing.assert_close(
                state["v_block"],
                reference["exp_avg_sq"].reshape(state["v_block"].shape),
                rtol=1e-5,
                atol=1e-9,
            )
    assert gefen.global_step == 20
