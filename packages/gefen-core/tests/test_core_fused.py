"""The fused-implementation registry with test-only registrations (10-core.md §11; §12 #45, #56)."""

from __future__ import annotations

import pytest
import torch

from gefen.core import Gefen
from gefen.core.fused import FusedImplementation, register_fused
from gefen.core.kernels import update_block, update_factored


def _registration(name: str, compile_fn, *, deterministic: bool = True) -> FusedImplementation:
    return FusedImplementation(
        name,
        "cpu",
        (torch.float32,),
        ("codebook8", "none"),
        ("block", "factored"),
        deterministic,
        compile_fn,
    )


def _run(**options) -> torch.Tensor:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8))
    q = torch.nn.Parameter(torch.randn(32))
    optimizer = Gefen([p, q], **options)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        p.grad = torch.randn(16, 8, generator=generator)
        q.grad = torch.randn(32, generator=generator)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1), q.detach()])


def test_registered_wrapper_of_the_eager_path_is_used_and_equal() -> None:
    used = []

    def compile_wrapper():
        def kernel(*args, **kwargs):
            used.append(1)
            factored = len(args) == 5
            return (update_factored if factored else update_block)(*args, **kwargs)

        return kernel

    unregister = register_fused(_registration("test-wrapper", compile_wrapper))
    try:
        fused = _run(fused=True)
        assert used
        used.clear()
        eager = _run(fused=False)
        assert not used
    finally:
        unregister()
    assert torch.equal(fused, eager)


def test_fused_false_never_compiles_and_none_falls_back_with_one_warning() -> None:
    compiled = []

    def broken():
        compiled.append(1)
        raise RuntimeError("no compiler here")

    unregister = register_fused(_registration("test-broken", broken))
    try:
        _run(fused=False)
        assert compiled == []
        with pytest.warns(RuntimeWarning, match="failed to compile") as caught:
            result = _run(fused=None, factored_v_2d=False)  # one kernel key
        assert len([w for w in caught if "failed to compile" in str(w.message)]) == 1
    finally:
        unregister()
    assert torch.equal(result, _run(fused=False, factored_v_2d=False))


def test_deterministic_excludes_non_deterministic_kernels() -> None:
    compiled = []

    def compile_fn():
        compiled.append(1)
        return update_block

    unregister = register_fused(_registration("test-nondet", compile_fn, deterministic=False))
    try:
        _run(fused=None, deterministic=True, factored_v_2d=False)
        assert compiled == []
        with pytest.raises(RuntimeError, match="no fused implementation"):
            _run(fused=True, deterministic=True)
    finally:
        unregister()


def test_fused_true_without_registration_fails_at_construction() -> None:
    with pytest.raises(RuntimeError, match="no fused implementation"):
        Gefen([torch.nn.Parameter(torch.ones(3))], fused=True)
