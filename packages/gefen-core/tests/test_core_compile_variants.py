"""The compiled (inductor) update across parameter shapes and modes (docs/core.md §11).

Even with ``dynamic=True`` each shape class compiles a graph of its own (a dimension of 1,
equal dimensions, a dimension above 4096, ``requires_grad``). Under Dynamo's default limit of 8
graphs, ``fullgraph=True`` raised ``FailOnRecompileLimitHit`` in the middle of the commit: a
model with nine such shapes had its step half-written and the optimizer latched. The limit is
the library's own per compiled variant now (``compiled.GRAPHS_PER_VARIANT``); here Dynamo's
global limit is set to 1, so each new class would exceed it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo

from gefen.core import Gefen
from gefen.core.compiled import inductor_updater
from gefen.core.fused import KernelKey

pytestmark = pytest.mark.fused_default

# fp32 with fp32 momentum ("none"): the inductor kernel on the CPU (the native one covers the
# codebook codecs); three classes: a plain matrix, a one-row matrix, a square one
SHAPES = [(5, 7), (1, 30), (6, 6)]


def _model() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _assert_close_to_eager(params: list[torch.nn.Parameter]) -> None:
    """``params`` after two fused steps are the eager reference's, to fp32 kernel tolerance."""
    reference = _model()
    eager = Gefen(reference, lr=1e-2, momentum_codec="none", fused=False)
    for seed in range(2):
        _grads(reference, seed)
        eager.step()
    for fused, plain in zip(params, reference, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


@torch._dynamo.config.patch(recompile_limit=1)
def test_shape_classes_beyond_dynamos_limit_never_fail_the_commit() -> None:
    params = _model()
    optimizer = Gefen(params, lr=1e-2, momentum_codec="none", fused=True)
    for seed in range(2):
        _grads(params, seed)
        before = [param.detach().clone() for param in params]
        optimizer.step()
        assert all(not torch.equal(old, new) for old, new in zip(before, params, strict=True))
    assert optimizer.global_step == 2
    _assert_close_to_eager(params)


def test_the_warm_up_compiles_the_graph_a_parameter_runs() -> None:
    """The warm-up ran on a tensor without ``requires_grad`` (a guard), so the first real step
    compiled again in its commit; a parameter of no special shape now reuses its graph."""
    key: KernelKey = ("cpu", torch.float32, "none", "factored")
    updater = inductor_updater("cpu", key)  # compiled and warmed (cached per process)
    del updater
    param = torch.nn.Parameter(torch.randn(5, 9))
    optimizer = Gefen([param], lr=1e-2, momentum_codec="none", fused=True)
    param.grad = torch.randn(5, 9)
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    assert optimizer.global_step == 1


def test_a_step_under_inference_mode_selects_and_keeps_the_fused_kernel() -> None:
    """Under ``torch.inference_mode()`` the selection read version counters of inference
    tensors: ``fused=True`` raised "failed to compile", ``None`` stayed eager for good, and state
    allocated there could not be updated by a step outside the mode."""
    params = _model()
    optimizer = Gefen(params, lr=1e-2, fused=True)
    _grads(params, 0)
    with torch.inference_mode():
        optimizer.step()
    _grads(params, 1)
    optimizer.step()  # outside the mode: the state is no inference tensor
    assert optimizer.global_step == 2
    assert not any(
        value.is_inference()
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )


def test_a_callers_fail_on_recompile_stance_does_not_fail_the_commit() -> None:
    """A group of a new shape class added under ``set_stance("fail_on_recompile")`` (the
    caller's "no recompiles after warm-up" promise for their own code) compiled its kernel
    inside the commit and raised there: the first parameter moved, the second did not, and
    the optimizer latched."""
    torch._dynamo.reset()  # no graph of the one-row class left from another test
    first, second = _model()[:2]
    optimizer = Gefen([first], lr=1e-2, momentum_codec="none", fused=True)
    _grads([first], 1)
    optimizer.step()  # the warm-up
    optimizer.add_param_group({"params": [second]})  # a new class: a dimension of 1
    _grads([first, second], 2)
    before = [first.detach().clone(), second.detach().clone()]
    with torch.compiler.set_stance("fail_on_recompile"):
        optimizer.step()
    assert optimizer.global_step == 2
    assert all(not torch.equal(b, p) for b, p in zip(before, (first, second), strict=True))


def test_a_kernel_past_its_own_graph_limit_runs_uncompiled_instead_of_failing_the_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reaching ``GRAPHS_PER_VARIANT`` graphs of one variant raised ``FailOnRecompileLimitHit``
    inside the commit (the step half-written, the optimizer latched); Dynamo refuses before
    running anything, so the call now runs the kernel uncompiled, with one warning."""
    import gefen.core.compiled as compiled

    monkeypatch.setattr(compiled, "GRAPHS_PER_VARIANT", 1)
    monkeypatch.setattr(compiled, "_COMPILED", {})  # variants compiled anew, under the limit
    monkeypatch.setattr(compiled, "_PAST_THE_LIMIT", set())
    params = _model()
    optimizer = Gefen(params, lr=1e-2, momentum_codec="none", fused=True)
    _grads(params, 0)
    with pytest.warns(RuntimeWarning, match="graph limit; parameters of further shape classes"):
        optimizer.step()
    _grads(params, 1)
    optimizer.step()
    assert optimizer.global_step == 2
    assert not optimizer.latched
    _assert_close_to_eager(params)
