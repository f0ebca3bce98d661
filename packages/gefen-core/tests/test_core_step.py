"""The step: learning, refresh, update edge cases and dtypes (docs/core.md §5–§7; §12)."""

from __future__ import annotations

import struct

import pytest
import torch

import gefen.core.codebook_ops as codebook_ops_module
import gefen.core.learning as learning_module
from gefen.core import Gefen, NonFiniteGradientError
from gefen.core.kernels import nearest_index
from gefen.core.testing import SNAPSHOT_ATTRIBUTES
from gefen.dist.testing import assert_unchanged, deep_snapshot


def _p(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    )


def _grad(p: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype)


def test_first_step_with_zero_or_absent_gradients_is_a_noop() -> None:
    a, b = _p(8, 4), _p(16)
    optimizer = Gefen([a, b], weight_decay=0.5)
    before = [a.detach().clone(), b.detach().clone()]
    optimizer.step()  # absent
    a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
    optimizer.step()  # all zero
    assert optimizer.global_step == 0
    assert optimizer.codebook is None
    assert torch.equal(a, before[0])
    assert torch.equal(b, before[1])
    assert optimizer.state[a] == {"period": 0}
    assert optimizer.state[b] == {"period": 0}
    a.grad = _grad(a, 1)
    optimizer.step()
    assert optimizer.global_step == 1
    assert optimizer.codebook is not None
    assert optimizer.state[a]["period"] > 0
    assert optimizer.state[b]["period"] > 0


def test_initialize_codebook_once_and_pure() -> None:
    a = _p(32, 8)
    optimizer = Gefen([a], weight_decay=0.1)
    assert optimizer.initialize_codebook() is False  # no gradient
    a.grad = _grad(a, 1)
    before = a.detach().clone()
    assert optimizer.initialize_codebook() is True
    assert optimizer.initialize_codebook() is False
    assert torch.equal(a, before)
    assert optimizer.global_step == 0
    assert set(optimizer.state[a]) == {"period"}
    assert optimizer.state[a]["period"] > 0
    codebook = optimizer.codebook
    assert codebook is not None
    assert codebook.shape == (256,)
    optimizer.step()
    assert optimizer.codebook is codebook
    assert optimizer.state[a]["step"] == 1
    none = Gefen([_p(4)], momentum_codec="none")
    none.param_groups[0]["params"][0].grad = torch.ones(4)
    assert none.initialize_codebook() is False
    assert none.codebook is None


def test_refresh_without_codebook_raises() -> None:
    optimizer = Gefen([_p(4)])
    with pytest.raises(RuntimeError, match="refresh_codebook: no codebook has been learned"):
        optimizer.refresh_codebook()
    with pytest.raises(RuntimeError, match="no codebook"):
        Gefen([_p(4)], momentum_codec="none").refresh_codebook()


def test_refresh_remaps_codes_and_keeps_magnitudes() -> None:
    a = _p(64, 32)
    optimizer = Gefen([a])
    for seed in range(3):
        a.grad = _grad(a, seed)
        optimizer.step()
    old_codebook = optimizer.codebook.clone()
    entry = optimizer.state[a]
    old_codes, old_scale, old_v = (
        entry["momentum_codes"].clone(),
        entry["momentum_scale"],
        entry["v_row"],
    )
    a.grad = _grad(a, 10) ** 3  # a different distribution
    assert optimizer.refresh_codebook() is True
    new_codebook = optimizer.codebook
    table = nearest_index(new_codebook, old_codebook)
    assert torch.equal(entry["momentum_codes"], table.long()[old_codes.long()].to(torch.uint8))
    assert entry["momentum_scale"] is old_scale
    assert entry["v_row"] is old_v
    assert new_codebook[0] == -1.0
    assert new_codebook[-1] == 1.0
    assert optimizer.global_step == 3
    a.grad = torch.zeros_like(a)
    assert optimizer.refresh_codebook() is False  # empty histogram


def test_refresh_failure_while_staging_the_remap_table_changes_nothing(
    monkeypatch, rejects
) -> None:
    a, b = _p(16, 8), _p(32, seed=1)
    optimizer = Gefen([a, b])
    a.grad, b.grad = _grad(a, 1), _grad(b, 2)
    optimizer.step()
    import gefen.core.codebook_ops as shell

    real = shell.remap_table

    def failing(*args, **kwargs):
        raise MemoryError("injected")

    monkeypatch.setattr(shell, "remap_table", failing)
    rejects(optimizer, optimizer.refresh_codebook, MemoryError, "injected", check_training=False)
    assert not optimizer._commit_failed
    monkeypatch.setattr(shell, "remap_table", real)
    assert optimizer.refresh_codebook() is True


def test_refresh_stages_only_the_256_entry_table(monkeypatch) -> None:
    # §5.6 step 3 / §7.1 phase 4: no code tensor is copied while staging.
    a, b = _p(64, 32), _p(96, seed=1)
    optimizer = Gefen([a, b], codebook_refresh_every=2)
    for seed in range(2):
        a.grad, b.grad = _grad(a, seed), _grad(b, seed + 50)
        optimizer.step()
    codes_before = {p: optimizer.state[p]["momentum_codes"] for p in (a, b)}
    plans = []
    original = Gefen._prepare_step

    def spy(self, operation, learning):
        plan = original(self, operation, learning)
        plans.append((learning, plan))
        return plan

    monkeypatch.setattr(Gefen, "_prepare_step", spy)
    a.grad, b.grad = _grad(a, 7), _grad(b, 8) ** 3
    optimizer.step()
    learning, plan = plans[0]
    assert learning.remap is not None
    assert learning.remap.shape == (256,)
    staged_tensors = [
        value for item in plan for value in vars(item).values() if isinstance(value, torch.Tensor)
    ]
    assert all(t is a or t is b for t in staged_tensors)  # only the parameters themselves
    for p in (a, b):  # codes were rewritten in their own storage
        assert optimizer.state[p]["momentum_codes"] is codes_before[p]


def _fp32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _oracle_remap(old_codebook: torch.Tensor, new_codebook: torch.Tensor) -> torch.Tensor:
    """``L[i]`` by brute force over every new codeword, sharing no code with the kernels.

    §6.3 compares distances in fp32. Both operands are fp32, so their float64 difference is
    exact and rounding it once gives the fp32 subtraction; without that rounding, a pair the
    spec calls a tie could resolve to the upper index here.
    """
    old = [float(value) for value in old_codebook.tolist()]
    new = [float(value) for value in new_codebook.tolist()]
    table = []
    for target in old:
        best, best_distance = 0, abs(_fp32(new[0] - target))
        for index in range(1, len(new)):
            distance = abs(_fp32(new[index] - target))
            if distance < best_distance:  # strict: ties keep the lower index
                best, best_distance = index, distance
        table.append(best)
    return torch.tensor(table, dtype=torch.int64)


def _assert_remap_is_nontrivial(oracle: torch.Tensor, old_codes: torch.Tensor) -> None:
    # An identity remap on the codes in use would let a refresh that kept the codes pass.
    used = old_codes.long().unique()
    assert bool((oracle[used] != used).any())


def test_oracle_remap_pins_ties_and_exact_codewords() -> None:
    new = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
    old = torch.tensor([-1.0, -0.75, -0.25, 0.25, 0.75, 1.0, 0.5, 0.3])
    assert _oracle_remap(old, new).tolist() == [0, 0, 1, 2, 3, 4, 3, 3]
    # Exactly, x is nearer to 1.0, but both distances round to the same fp32 value: an fp32
    # tie, which the lower index wins (in the kernel too).
    low, x = 2.0**-23 - 2.0**-27, 0.5 + 2.0**-24
    assert abs(x - low) > abs(1.0 - x)
    assert _oracle_remap(torch.tensor([x]), torch.tensor([-1.0, low, 1.0])).tolist() == [1]
    codebook = torch.cat([torch.linspace(-1.0, -0.01, 254), torch.tensor([low, 1.0])])
    assert nearest_index(codebook, torch.tensor([x])).tolist() == [254]


def test_refresh_codes_equal_brute_force_oracle() -> None:
    a, b = _p(64, 32), _p(96, seed=1)
    optimizer = Gefen([a, b])
    for seed in range(3):
        a.grad, b.grad = _grad(a, seed), _grad(b, seed + 50)
        optimizer.step()
    old_codebook = optimizer.codebook.clone()
    old_codes = {p: optimizer.state[p]["momentum_codes"].clone() for p in (a, b)}
    a.grad, b.grad = _grad(a, 10) ** 3, _grad(b, 11) ** 3
    assert optimizer.refresh_codebook() is True
    new_codebook = optimizer.codebook
    assert not torch.equal(new_codebook, old_codebook)
    oracle = _oracle_remap(old_codebook, new_codebook)
    assert oracle[0] == 0
    assert oracle[255] == 255
    for p in (a, b):
        _assert_remap_is_nontrivial(oracle, old_codes[p])
        codes = optimizer.state[p]["momentum_codes"]
        assert codes.dtype == torch.uint8
        assert torch.equal(codes, oracle[old_codes[p].long()].to(torch.uint8))


def test_periodic_refresh_codes_equal_brute_force_oracle(monkeypatch) -> None:
    # `a` steps with an all-zero gradient on the refresh step, so its momentum only decays by
    # beta1 and re-quantizes to the remapped codes: what the step stores is the remap itself.
    a, b = _p(64, 32), _p(96, seed=1)
    optimizer = Gefen([a, b], codebook_refresh_every=2)
    for seed in range(2):
        a.grad, b.grad = _grad(a, seed), _grad(b, seed + 50)
        optimizer.step()
    old_codebook = optimizer.codebook.clone()
    old_codes = {p: optimizer.state[p]["momentum_codes"].clone() for p in (a, b)}
    staged: list[torch.Tensor] = []
    original = Gefen._prepare_step

    def spy(self, operation, learning):
        staged.append(learning.remap.clone())
        return original(self, operation, learning)

    monkeypatch.setattr(Gefen, "_prepare_step", spy)
    a.grad, b.grad = torch.zeros_like(a), _grad(b, 11) ** 3
    optimizer.step()
    assert optimizer.global_step == 3
    new_codebook = optimizer.codebook
    assert not torch.equal(new_codebook, old_codebook)
    oracle = _oracle_remap(old_codebook, new_codebook)
    assert torch.equal(staged[0].to(torch.uint8), oracle.to(torch.uint8))
    expected = {p: oracle[old_codes[p].long()].to(torch.uint8) for p in (a, b)}
    for p in (a, b):
        _assert_remap_is_nontrivial(oracle, old_codes[p])
    assert torch.equal(optimizer.state[a]["momentum_codes"], expected[a])


def test_periodic_refresh_failure_inside_step_changes_nothing(monkeypatch) -> None:
    a, b = _p(16, 8), _p(32, seed=1)
    optimizer = Gefen([a, b], lr=0.01, codebook_refresh_every=2)

    def set_quadratic_grads() -> float:
        # The gradient of sum(p**2), set in place of a closure so the failing step sees the
        # same gradient objects the snapshot recorded.
        for p in (a, b):
            p.grad = 2 * p.detach().clone()
        return float(sum((p.detach() ** 2).sum() for p in (a, b)))

    for _ in range(2):
        set_quadratic_grads()
        optimizer.step()
    assert optimizer.global_step == 2  # the next step is a refresh step (N = 2)
    codebook = optimizer.codebook
    calls: list[int] = []

    def failing(counts, device, size=256):
        calls.append(optimizer.global_step)
        raise MemoryError("injected refresh failure")

    # The codebook operations import the name; patch it where it is resolved, and at its
    # source in case a later edit calls it through the module.
    assert codebook_ops_module.solve_new_codebook is learning_module.solve_new_codebook
    monkeypatch.setattr(codebook_ops_module, "solve_new_codebook", failing)
    monkeypatch.setattr(learning_module, "solve_new_codebook", failing)
    set_quadratic_grads()
    before = deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)
    with pytest.raises(MemoryError, match="injected refresh failure"):
        optimizer.step()
    assert calls == [2]
    assert_unchanged(before, deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES))
    assert optimizer._commit_failed is False
    assert optimizer.codebook is codebook

    monkeypatch.undo()
    loss_before = set_quadratic_grads()
    params_before = [p.detach().clone() for p in (a, b)]
    optimizer.step()
    assert optimizer.global_step == 3
    assert optimizer.codebook is not codebook  # the retried step refreshed
    assert all(not torch.equal(p, q) for p, q in zip((a, b), params_before, strict=True))
    assert set_quadratic_grads() < loss_before


def test_periodic_refresh_at_multiples_of_n(monkeypatch) -> None:
    a = _p(16, 8)
    optimizer = Gefen([a], codebook_refresh_every=3)
    refreshed_at = []
    original = codebook_ops_module._refreshed

    def spy(opt, op, inputs, periods):
        refreshed_at.append(opt.global_step)
        return original(opt, op, inputs, periods)

    monkeypatch.setattr(codebook_ops_module, "_refreshed", spy)
    for seed in range(11):
        a.grad = _grad(a, seed)
        optimizer.step()
    assert refreshed_at == [3, 6, 9]


def test_lr_zero_leaves_parameters_bit_unchanged_while_state_advances() -> None:
    a = _p(8, 8)
    optimizer = Gefen([a], lr=0.0, weight_decay=0.5)
    before = a.detach().clone()
    for seed in range(3):
        a.grad = _grad(a, seed)
        optimizer.step()
    assert torch.equal(a, before)
    assert optimizer.state[a]["step"] == 3
    assert optimizer.global_step == 3


def test_zero_first_gradient_after_codebook_exists_only_decays() -> None:
    a, b = _p(8, 8), _p(16, seed=3, dtype=torch.bfloat16)
    optimizer = Gefen([a, b], lr=0.1, weight_decay=0.2)
    a.grad = _grad(a, 1)
    optimizer.step()
    b.grad = torch.zeros_like(b)
    a.grad = None
    expected = (b.detach().float() * (1 - 0.1 * 0.2)).to(torch.bfloat16)
    optimizer.step()
    assert torch.equal(b, expected)
    assert optimizer.state[b]["period"] == 16  # its fallback period


def test_grad_bit_unchanged_for_fp32_and_bf16() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        a = _p(8, 4, dtype=dtype)
        optimizer = Gefen([a])
        a.grad = _grad(a, 1)
        grad = a.grad.clone()
        optimizer.step()
        assert torch.equal(a.grad, grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_state_dtypes(dtype: torch.dtype) -> None:
    a = _p(4, 16, dtype=dtype)
    optimizer = Gefen([a], factored_v_2d=False, betas=(0.9, 0.999))
    a.grad = torch.full_like(a, 300.0)
    optimizer.step()
    entry = optimizer.state[a]
    assert entry["momentum_codes"].dtype == torch.uint8
    assert entry["momentum_scale"].dtype == torch.float32
    assert entry["v_block"].dtype == torch.float32
    assert a.dtype == dtype
    assert bool(torch.isfinite(a).all())
    torch.testing.assert_close(
        entry["v_block"], torch.full_like(entry["v_block"], 300.0**2 * 0.001)
    )


def test_non_contiguous_parameter_matches_contiguous_twin() -> None:
    base = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    transposed = torch.nn.Parameter(base.t())  # (12, 8), a non-contiguous view
    twin = torch.nn.Parameter(transposed.detach().contiguous().clone())
    assert not transposed.is_contiguous()
    storage = transposed.data_ptr()
    optimizers = [Gefen([transposed]), Gefen([twin])]
    for seed in range(3):
        grad = _grad(twin, seed)
        transposed.grad, twin.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert transposed.data_ptr() == storage
    assert torch.equal(transposed, twin)


def test_none_gradient_parameter_untouched() -> None:
    a, b = _p(8, 4), _p(12, seed=1)
    optimizer = Gefen([a, b], weight_decay=0.3)
    a.grad, b.grad = _grad(a, 1), _grad(b, 2)
    optimizer.step()
    entry_b = dict(optimizer.state[b])
    before_b = b.detach().clone()
    a.grad, b.grad = _grad(a, 3), None
    before_a = a.detach().clone()
    optimizer.step()
    assert torch.equal(b, before_b)
    assert not torch.equal(a, before_a)
    assert all(optimizer.state[b][k] is v for k, v in entry_b.items())


def test_non_finite_gradient_rejected_and_check_finite_false(rejects) -> None:
    a, b = _p(4, 4), _p(6, seed=1)
    optimizer = Gefen([("a", a), ("bias.X", b)])
    a.grad = _grad(a, 1)
    b.grad = _grad(b, 2)
    b.grad[3] = float("nan")
    good = _grad(b, 2)

    def fix() -> None:
        b.grad = good

    info = rejects(
        optimizer, optimizer.step, NonFiniteGradientError, "non-finite gradient", restore=fix
    )
    assert "'bias.X'" in str(info.value)
    a.grad = torch.full_like(a, float("inf"))
    b.grad = good
    relaxed = Gefen([a, b], check_finite=False)
    relaxed.step()  # no crash; state is unspecified


def test_closure_runs_under_enable_grad_and_feeds_codebook() -> None:
    a = _p(8, 8)
    optimizer = Gefen([a])

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        optimizer.zero_grad()
        loss = (a**2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = optimizer.step(closure)
    assert loss is not None
    assert optimizer.codebook is not None
    assert optimizer.global_step == 1


def test_closure_that_raises_mutates_nothing(rejects) -> None:
    a = _p(8, 8)
    optimizer = Gefen([a])

    def closure() -> None:
        raise KeyError("closure failed")

    a.grad = _grad(a, 1)
    rejects(optimizer, lambda: optimizer.step(closure), KeyError, "closure failed")


def test_stochastic_rounding_replays_and_differs_between_parameters() -> None:
    def run() -> tuple[torch.Tensor, torch.Tensor]:
        a, b = _p(16, 16), _p(16, 16)
        optimizer = Gefen([a, b], stochastic_round=True)
        for seed in range(3):
            a.grad = _grad(a, seed)
            b.grad = a.grad.clone()
            optimizer.step()
        return optimizer.state[a]["momentum_codes"].clone(), optimizer.state[b][
            "momentum_codes"
        ].clone()

    first, second = run(), run()
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    assert not torch.equal(first[0], first[1])  # equal inputs, different parameter index


def test_stochastic_rounding_is_unbiased_in_the_mean() -> None:
    import numpy as np

    from gefen.core.codec import decode_blocks, encode_blocks
    from gefen.core.kernels import pad_codebook

    codebook = torch.from_numpy(pad_codebook(np.array([0, 2048, 4095]), 256).astype("float32"))
    values = torch.rand(1, 4096, generator=torch.Generator().manual_seed(0)) * 2 - 1
    values[0, 0] = 1.0
    decoded = [
        decode_blocks(*encode_blocks(values, codebook, 4096, seed=(step, 0)), codebook)
        for step in range(64)
    ]
    mean = torch.stack(decoded).mean(0)
    assert float((mean - values).abs().mean()) < 1e-3
