"""The fused-implementation registry and its selection (docs/core.md §11; §12 #45, #56)."""

from __future__ import annotations

import warnings

import pytest
import torch

import gefen.core.fused as fused_module
from gefen.core import Gefen
from gefen.core.fused import FusedImplementation, register_fused
from gefen.core.updaters import eager_update_


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
    f32 = torch.float32  # whatever the default dtype
    p = torch.nn.Parameter(torch.randn(16, 8, dtype=f32))
    q = torch.nn.Parameter(torch.randn(32, dtype=f32))
    optimizer = Gefen([p, q], **options)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        p.grad = torch.randn(16, 8, generator=generator, dtype=f32)
        q.grad = torch.randn(32, generator=generator, dtype=f32)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1), q.detach()])


def test_registered_wrapper_of_the_eager_path_is_used_and_equal() -> None:
    used = []
    keys = []

    def compile_wrapper(key):
        keys.append(key)

        def kernel(*args):
            used.append(1)
            eager_update_(*args)

        return kernel

    unregister = register_fused(_registration("test-wrapper", compile_wrapper))
    try:
        fused = _run(fused=True)
        assert used
        assert sorted(key[3] for key in keys) == ["block", "factored"]  # one compile per key
        used.clear()
        eager = _run(fused=False)
        assert not used
    finally:
        unregister()
    assert torch.equal(fused, eager)


@pytest.mark.fused_default
def test_fused_false_never_compiles_and_none_falls_back_with_one_warning(monkeypatch) -> None:
    monkeypatch.setattr(fused_module, "_REGISTRY", [])  # the broken one is the only candidate
    compiled = []

    def broken(key):
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


@pytest.mark.fused_default
def test_a_failure_common_to_every_kernel_key_warns_once_per_optimizer(monkeypatch) -> None:
    """Two kernel keys (the block and the factored family) failing for the same reason gave two
    warnings and two log lines; one optimizer now warns once, and a new optimizer again."""
    monkeypatch.setattr(fused_module, "_REGISTRY", [])

    def broken(key):
        raise RuntimeError("no compiler on this machine")

    unregister = register_fused(_registration("test-broken-everywhere", broken))
    try:
        for _ in range(2):  # each optimizer reports its own fallback
            with pytest.warns(RuntimeWarning, match="failed to compile") as caught:
                _run(fused=None)  # a (16, 8) matrix and a vector: two keys
            assert len([w for w in caught if "failed to compile" in str(w.message)]) == 1
    finally:
        unregister()


@pytest.mark.fused_default
def test_a_candidate_that_fails_before_one_that_compiles_is_logged_once(
    monkeypatch, caplog
) -> None:
    """The native kernel failing (a corrupt cache, say) left the CPU on inductor, several times
    slower, with only an INFO line; it is now a warning, once per optimizer."""
    monkeypatch.setattr(fused_module, "_REGISTRY", [])

    def broken(key):
        raise RuntimeError("cannot load the kernel")

    unregister_working = register_fused(_registration("test-works", lambda key: eager_update_))
    unregister_broken = register_fused(_registration("test-fails-first", broken))  # ahead of it
    try:
        with caplog.at_level("WARNING", logger="gefen.core"):
            result = _run(fused=None)
        lines = [r.getMessage() for r in caplog.records if "test-fails-first" in r.getMessage()]
        assert lines == ["test-fails-first: cannot load the kernel; using test-works"]
    finally:
        unregister_working()
        unregister_broken()
    assert torch.equal(result, _run(fused=False))


def test_fused_true_compile_failure_raises_before_anything_changes(monkeypatch, rejects) -> None:
    monkeypatch.setattr(fused_module, "_REGISTRY", [])

    def broken(key):
        raise RuntimeError("no compiler here")

    unregister = register_fused(_registration("test-broken", broken))
    try:
        p = torch.nn.Parameter(torch.randn(16, 8))
        optimizer = Gefen([p], fused=True)
        p.grad = torch.randn(16, 8)
        rejects(
            optimizer,
            optimizer.step,
            RuntimeError,
            "fused implementation failed to compile",
            check_training=False,
        )
    finally:
        unregister()


@pytest.mark.fused_default
def test_deterministic_excludes_non_deterministic_kernels(monkeypatch) -> None:
    monkeypatch.setattr(fused_module, "_REGISTRY", [])
    compiled = []

    def compile_fn(key):
        compiled.append(1)
        return eager_update_

    unregister = register_fused(_registration("test-nondet", compile_fn, deterministic=False))
    try:
        _run(fused=None, deterministic=True, factored_v_2d=False)
        assert compiled == []
        with pytest.raises(RuntimeError, match="no fused implementation"):
            _run(fused=True, deterministic=True)
    finally:
        unregister()


def test_fused_true_without_registration_fails_at_construction(monkeypatch) -> None:
    monkeypatch.setattr(fused_module, "_REGISTRY", [])
    with pytest.raises(RuntimeError, match="no fused implementation"):
        Gefen([torch.nn.Parameter(torch.ones(3))], fused=True)


def test_the_inductor_implementation_is_registered_for_cpu_and_cuda() -> None:
    names = {(impl.name, impl.device_type) for impl in fused_module._REGISTRY}
    assert {("inductor", "cpu"), ("inductor", "cuda")} <= names


@pytest.mark.fused_default
@pytest.mark.parametrize("name", ["native-cpu", "inductor"])
def test_a_float64_default_dtype_keeps_each_fused_implementation(monkeypatch, name) -> None:
    """The self-tests and warm-ups built their inputs with the default dtype: under
    ``torch.set_default_dtype(torch.float64)`` every implementation failed them, so fused=None
    fell back to the eager step with a warning (9x slower) and fused=True raised, although the
    state itself is float32 and the kernels serve it."""
    implementation = [i for i in fused_module._REGISTRY if (i.name, i.device_type) == (name, "cpu")]
    monkeypatch.setattr(fused_module, "_REGISTRY", implementation)
    reference = _run(fused=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            under_float64 = _run(fused=True)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(under_float64, reference)


@pytest.mark.fused_default
def test_a_float64_default_dtype_keeps_the_fused_momentum() -> None:
    from gefen.core.fused import fused_momentum

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert fused_momentum("cpu") is not None  # raised: its self-test ran on float64 inputs
    finally:
        torch.set_default_dtype(previous)


def test_a_fused_momentum_that_fails_everywhere_says_why_each_kernel_did(monkeypatch) -> None:
    # Only inductor's reason reached GefenMuon's error; the native kernel's went to an INFO log.
    import gefen.core.compiled
    import gefen.core.native
    from gefen.core.fused import fused_momentum

    def native(size: int) -> None:
        raise OSError("no C compiler found")

    def compiled(device_type: str, size: int) -> None:
        raise ValueError("no C++ compiler either")

    monkeypatch.setattr(gefen.core.native, "native_momentum", native)
    monkeypatch.setattr(gefen.core.compiled, "compiled_momentum", compiled)
    with pytest.raises(RuntimeError) as refused:
        fused_momentum("cpu")
    assert str(refused.value) == (
        "native-cpu: no C compiler found; inductor: ValueError: no C++ compiler either"
    )
