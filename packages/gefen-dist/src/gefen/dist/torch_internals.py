"""The torch internals the Gefen optimizers touch, in one place.

An optimizer that runs its own step transaction must fire the hooks torch's step wrapper would
fire, and those registries are private attributes of ``torch.optim.Optimizer`` and of its
module. The step also reads a tensor's in-place version counter, multiplies gradients with the
multi-tensor ``_foreach`` kernel GradScaler uses, and the harness reads Dynamo's graph counter.
Nothing else in the project names a torch private: when torch moves one of these, this module
is the one place to change. ``TORCH_INTERNALS`` lists them for the project's lint test.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
from torch._compile import _disable_dynamo
from torch.optim import optimizer as torch_optimizer

__all__ = [
    "HOOK_REGISTRIES",
    "TORCH_INTERNALS",
    "copy_with_load_pre_hooks",
    "dynamo_stance",
    "dynamo_unique_graphs",
    "foreach_mul_",
    "fresh_hook_registries",
    "instance_hooks",
    "lazily_disable_dynamo",
    "recompile_limit_error",
    "run_load_post_hooks",
    "set_grad_enabled",
    "state_dict_with_hooks",
    "step_post_hooks",
    "step_pre_hooks",
    "tensor_version",
    "unhooked_step",
]

HOOK_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
"""The per-instance hook registries torch's ``register_*`` methods fill (ordered dicts)."""

TORCH_INTERNALS = (
    *HOOK_REGISTRIES,
    "_global_optimizer_pre_hooks",
    "_global_optimizer_post_hooks",
    "_version",
    "_foreach_mul_",
    "_dynamo",
    "_C",
    "_set_grad_enabled",
    "_compile",
    "_disable_dynamo",
    "_stance",
)
"""Every torch private name this module reads; the lint test allows them here only."""


def lazily_disable_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)`` without importing Dynamo (about 1.5 s at every process
    start, on every rank) unless a compiled region calls ``fn``: outside one ``fn`` runs as it
    is, inside one (Dynamo reads ``is_compiling()`` as True while tracing) the disabled ``fn``
    runs, through the lazy helper torch's own ``Optimizer`` methods use."""
    disabled = _disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


_HOOK_KINDS = {
    "step_pre": "_optimizer_step_pre_hooks",
    "step_post": "_optimizer_step_post_hooks",
    "state_dict_pre": "_optimizer_state_dict_pre_hooks",
    "state_dict_post": "_optimizer_state_dict_post_hooks",
    "load_pre": "_optimizer_load_state_dict_pre_hooks",
    "load_post": "_optimizer_load_state_dict_post_hooks",
}


def instance_hooks(optimizer: object, kind: str) -> list[Callable[..., Any]]:
    """The hooks registered on ``optimizer`` for ``kind`` (``"step_pre"``, ``"step_post"``,
    ``"state_dict_pre"``, ``"state_dict_post"``, ``"load_pre"``, ``"load_post"``), in order."""
    registry = getattr(optimizer, _HOOK_KINDS[kind])
    return list(registry.values())


def step_pre_hooks(optimizer: Any) -> list[Callable[..., Any]]:
    """The global step pre-hooks, then the optimizer's own, as torch's step wrapper runs them."""
    own = optimizer._optimizer_step_pre_hooks
    registered = torch_optimizer._global_optimizer_pre_hooks
    if not registered and not own:
        return []
    return list(chain(registered.values(), own.values()))


def step_post_hooks(optimizer: Any) -> list[Callable[..., Any]]:
    """The optimizer's own step post-hooks, then the global ones (torch's order)."""
    own = optimizer._optimizer_step_post_hooks
    registered = torch_optimizer._global_optimizer_post_hooks
    if not registered and not own:
        return []
    return list(chain(own.values(), registered.values()))


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """``optimizer.step`` without torch's hook wrapper (``Optimizer.profile_hook_step``, which
    ``functools.wraps`` the class's own step): a child a composite steps inside its commit must
    fire no hook there, neither the global ones (the composite fired them) nor its own (a hook
    that raises or edits an option after the vote would fail or change one member alone)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = getattr(step, "__wrapped__", step)
    return functools.partial(step, optimizer)


def fresh_hook_registries(optimizer: object, *, keep_existing: bool = False) -> None:
    """Give ``optimizer`` empty hook registries of its own (a shadow, a fresh composite, or
    with ``keep_existing`` an unpickled copy that lacks some)."""
    for name in HOOK_REGISTRIES:
        if not (keep_existing and name in optimizer.__dict__):
            setattr(optimizer, name, OrderedDict())


@lazily_disable_dynamo  # as torch's own: a traced group holds Dynamo's capturable=True
def state_dict_with_hooks(optimizer: object, build: Callable[[], dict[str, Any]]) -> Any:
    """torch's ``state_dict`` protocol around ``build``: pre-hooks, then post-hooks, each of
    which may replace the result."""
    for hook in instance_hooks(optimizer, "state_dict_pre"):
        hook(optimizer)
    result = build()
    for post_hook in instance_hooks(optimizer, "state_dict_post"):
        replaced = post_hook(optimizer, result)
        if replaced is not None:
            result = replaced
    return result


def copy_with_load_pre_hooks(optimizer: object, copied: Any) -> Any:
    """Run the load pre-hooks on the caller's (already copied) state dict; each may replace it."""
    for hook in instance_hooks(optimizer, "load_pre"):
        replaced = hook(optimizer, copied)
        if replaced is not None:
            copied = replaced
    return copied


def run_load_post_hooks(optimizer: object) -> None:
    for hook in instance_hooks(optimizer, "load_post"):
        hook(optimizer)


tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""The tensor's in-place version counter (bumped by every in-place write). An ``attrgetter``:
a C callable, so the per-step checks that read it add no Python frame."""


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by ``factor`` with one multi-tensor kernel."""
    torch._foreach_mul_(list(tensors), factor)


def dynamo_stance() -> str:
    """Dynamo's current stance name (``torch.compiler.set_stance`` offers no reader; entering
    it costs about 70 µs, too much to do on every compiled call)."""
    from torch._dynamo.eval_frame import _stance

    return str(_stance.stance)


def dynamo_unique_graphs() -> int:
    """Graphs Dynamo compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def recompile_limit_error() -> type[Exception]:
    """What a ``fullgraph`` compiled function raises, before running anything, once a call
    would take it past its recompile limit."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    return FailOnRecompileLimitHit


set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled
"""Switch autograd recording: ``torch.no_grad()``'s effect as one C call (no Python frames),
for the step's hot path."""
