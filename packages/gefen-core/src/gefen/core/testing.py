"""Test support for optimizers built on ``gefen.core`` (docs/dist.md §11.2).

``SNAPSHOT_ATTRIBUTES`` names the optimizer-level facts a deep snapshot must cover besides
parameters, gradients, groups and state: the codebook, the global step and the latch;
``FINALIZED_SNAPSHOT_ATTRIBUTES`` adds the ``post_sharding`` finalization and binding.

The helpers serve the one-process ``post_sharding`` tests of every optimizer package: shard
builders for the ``REPLICATED``, ``FLATTENED_ELEMENT_SHARD``, ``WHOLE_PARAMETER_OWNER`` and
default-world DTensor layouts, a one-member ``CodebookProcessGroupBinding``, a weights-only
``torch.save``/``torch.load`` round trip, ``takes_a_step`` (one more step moves every parameter)
and ``rejects`` (an action fails with a given error and changes nothing). For the multi-rank
scenarios: ``attempt`` (a must-fail operation, timed, described as plain data), ``local_shard``,
``same_or_none``, ``finalized_snapshot``/``snapshot_changes`` and ``oracle_codebook``.
``format1_state_dict`` rewrites a format 2 checkpoint in format 1 (what older releases wrote);
``gathered_optimizer_state`` and ``nested_equal`` compare DCP state across world sizes. For the
step's host traffic (what stalls a CUDA host): ``compiled_path_only`` (the code path CUDA runs,
on the CPU) and ``host_traffic`` (counts host-to-device tensors and reads back). The module
imports neither pytest nor ``torch.distributed`` at import time.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.contracts import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ParameterLayout,
    PlacementKind,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen.dist import CodebookProcessGroupBinding

if TYPE_CHECKING:
    import pytest

__all__ = [
    "COLLECTIVES",
    "FINALIZED_SNAPSHOT_ATTRIBUTES",
    "MEMBER",
    "SNAPSHOT_ATTRIBUTES",
    "attempt",
    "compiled_path_only",
    "dtensor_replicate_shard",
    "fill_grads",
    "finalized_snapshot",
    "flattened_shard",
    "forbid_collectives",
    "format1_state_dict",
    "gathered_optimizer_state",
    "host_traffic",
    "live_params",
    "local_shard",
    "nested_equal",
    "oracle_codebook",
    "rejects",
    "replicated_shard",
    "same_or_none",
    "snapshot_changes",
    "solo_binding",
    "takes_a_step",
    "weights_only_round_trip",
    "whole_owner_shard",
]

SNAPSHOT_ATTRIBUTES: tuple[str, ...] = ("_codebook", "_global_step", "_commit_failed", "defaults")
FINALIZED_SNAPSHOT_ATTRIBUTES: tuple[str, ...] = (*SNAPSHOT_ATTRIBUTES, "_finalized", "_binding")
MEMBER = "rank:0"
"""The member the one-process tests act as."""


# -- shard identities ----------------------------------------------------------------------------


def replicated_shard(
    pid: ParameterIdentity, group: ProcessGroupIdentity | None = None, member: str = MEMBER
) -> ShardIdentity:
    """A ``REPLICATED`` shard of the whole parameter: ungrouped, or ``member``'s in ``group``."""
    extent = LogicalSlice.full(pid)
    if group is None:
        return ShardIdentity(pid, ParameterLayout.REPLICATED, extent)
    placement = ShardPlacement(
        group.semantic_name, PlacementKind.REPLICATE, group.coordinate(member), group.size
    )
    return ShardIdentity(pid, ParameterLayout.REPLICATED, extent, (placement,), group, member)


def flattened_shard(
    pid: ParameterIdentity,
    group: ProcessGroupIdentity,
    member: str = MEMBER,
    offset: int = 0,
    length: int | None = None,
) -> ShardIdentity:
    """``member``'s ``FLATTENED_ELEMENT_SHARD`` of ``pid`` in ``group``: elements
    ``[offset, offset + length)`` of the flattened parameter (all of them by default)."""
    placement = ShardPlacement(
        group.semantic_name, PlacementKind.FLAT_SHARD, group.coordinate(member), group.size
    )
    extent = LogicalSlice(offset, pid.numel - offset if length is None else length)
    return ShardIdentity(
        pid, ParameterLayout.FLATTENED_ELEMENT_SHARD, extent, (placement,), group, member
    )


def whole_owner_shard(
    pid: ParameterIdentity,
    group: ProcessGroupIdentity,
    member: str = MEMBER,
    owner: str = MEMBER,
) -> ShardIdentity:
    """``member``'s ``WHOLE_PARAMETER_OWNER`` slot of ``pid`` in ``group``: the whole parameter
    when ``member`` is the ``owner``, an empty extent otherwise."""
    placement = ShardPlacement(
        group.semantic_name,
        PlacementKind.WHOLE_PARAMETER_OWNER,
        group.coordinate(member),
        group.size,
    )
    extent = LogicalSlice.full(pid) if member == owner else LogicalSlice(0, 0)
    return ShardIdentity(
        pid,
        ParameterLayout.WHOLE_PARAMETER_OWNER,
        extent,
        (placement,),
        group,
        member,
        owner=owner,
    )


def dtensor_replicate_shard(
    pid: ParameterIdentity, group: ProcessGroupIdentity, member: str = MEMBER
) -> ShardIdentity:
    """A replicated ``DTENSOR_1D_DEFAULT_WORLD`` shard of the whole parameter at coordinate 0."""
    placement = ShardPlacement(group.semantic_name, PlacementKind.REPLICATE, 0, group.size)
    return ShardIdentity(
        pid,
        ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
        LogicalRegion.full(pid),
        (placement,),
        group,
        member,
    )


def solo_binding(group: ProcessGroupIdentity, member: str = MEMBER) -> CodebookProcessGroupBinding:
    """A one-member codebook binding of ``group`` on CPU with no process-group handle."""
    return CodebookProcessGroupBinding(group, member, None, "cpu")


# -- checks --------------------------------------------------------------------------------------


def weights_only_round_trip(obj: Any) -> Any:
    """``obj`` after ``torch.save`` to memory and ``torch.load(..., weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def fill_grads(params: Sequence[Tensor], seed: int) -> None:
    """Seeded standard-normal gradients of each parameter's shape and dtype."""
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)


def live_params(opt: Any) -> list[Tensor]:
    """Every parameter of ``opt``'s param groups, in group order."""
    return [p for g in opt.param_groups for p in g["params"]]


def takes_a_step(opt: Any, params: Sequence[Tensor] | None = None, seed: int = 7) -> None:
    """One more step moves every live parameter (or every one of ``params``), advances
    ``global_step`` by one and leaves a codebook; gradients are then cleared."""
    live = live_params(opt) if params is None else list(params)
    fill_grads(live, seed)
    before = [p.detach().clone() for p in live]
    step = opt.global_step
    opt.step()
    assert opt.global_step == step + 1
    assert opt.codebook is not None
    for b, p in zip(before, live, strict=True):
        assert not torch.equal(b, p)
    opt.zero_grad(set_to_none=True)


def rejects(
    opt: Any,
    action: Callable[[], Any],
    error: type[BaseException],
    fragment: str,
    *,
    attributes: tuple[str, ...] = FINALIZED_SNAPSHOT_ATTRIBUTES,
    snapshot: Callable[[Any], Any] | None = None,
    unchanged: Callable[[Any, Any], None] | None = None,
) -> pytest.ExceptionInfo[Any]:
    """``action()`` raises ``error`` whose message contains ``fragment`` literally, and ``opt``
    is unchanged: a deep snapshot over ``attributes`` (or ``snapshot(opt)``) taken before equals
    the one after (or ``unchanged(before, opt)`` passes)."""
    import pytest

    from gefen.dist.testing import assert_unchanged, deep_snapshot

    def take(target: Any) -> Any:
        if snapshot is not None:
            return snapshot(target)
        return deep_snapshot(target, attributes=attributes)

    before = take(opt)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        action()
    if unchanged is not None:
        unchanged(before, opt)
    else:
        assert_unchanged(before, take(opt))
    return info


# -- multi-rank scenario helpers ------------------------------------------------------------------


def attempt(
    fn: Callable[[], Any],
    *,
    attributes: Sequence[str] = ("what", "phase", "local_failure", "rank"),
    value: bool = True,
) -> dict[str, Any]:
    """Run a (failing) operation under ``gefen.dist.testing.timed``; describe the error and its
    cause as plain data: ``elapsed``, ``error``, ``value`` (unless ``value`` is false),
    ``cause`` and each of ``attributes`` of the error (None where absent)."""
    from gefen.dist.testing import timed

    caught: list[BaseException] = []

    def run() -> Any:
        try:
            return fn()
        except Exception as exc:
            caught.append(exc)
            raise

    elapsed, text, returned = timed(run)
    error = caught[0] if caught else None
    cause = None if error is None else error.__cause__
    result: dict[str, Any] = {"elapsed": elapsed, "error": text}
    if value:
        result["value"] = returned
    result["cause"] = None if cause is None else f"{type(cause).__name__}: {cause}"
    for name in attributes:
        result[name] = getattr(error, name, None)
    return result


def local_shard(tensor: Tensor) -> Tensor:
    """A DTensor's local shard; any other tensor itself."""
    local: Tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local


def same_or_none(a: Tensor | None, b: Tensor | None) -> bool:
    """Both None, or tensors equal in dtype, shape and every element."""
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def finalized_snapshot(optimizer: Any) -> Any:
    """A deep snapshot of ``optimizer`` over ``FINALIZED_SNAPSHOT_ATTRIBUTES``."""
    from gefen.dist.testing import deep_snapshot

    return deep_snapshot(optimizer, attributes=FINALIZED_SNAPSHOT_ATTRIBUTES)


def snapshot_changes(
    optimizer: Any, before: Any, snapshot: Callable[[Any], Any] = finalized_snapshot
) -> list[str]:
    """Every difference between ``before`` and ``snapshot(optimizer)`` now (empty: unchanged)."""
    from gefen.dist.testing import snapshot_diff

    changes: list[str] = snapshot_diff(before, snapshot(optimizer))
    return changes


def oracle_codebook(pieces: Sequence[Tensor]) -> list[float]:
    """The one-process codebook of ``pieces``: each piece's own automatic period (one block per
    row where its shape allows, docs/core.md §4.1, else §4's search), the summed histogram, the
    solve with its exact zero (§5.8; what a scope's collective learning must reproduce)."""
    from gefen.core.kernels import BIN_COUNT, histogram, row_period, select_period, solve_codebook
    from gefen.core.learning import with_exact_zero

    counts = torch.zeros(BIN_COUNT, dtype=torch.int64)
    for piece in pieces:
        shape = tuple(piece.shape)
        period = row_period(shape) or select_period(piece, shape, force_one=False)
        assert period is not None
        counts += histogram(piece, period)
    codebook: list[float] = with_exact_zero(solve_codebook(counts)).tolist()
    return codebook


COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "barrier",
)
"""The ``torch.distributed`` collectives a one-process optimizer must never enter."""


def forbid_collectives(monkeypatch: Any, caller: str, names: Sequence[str] = COLLECTIVES) -> None:
    """Patch each of ``names`` that ``torch.distributed`` has (via pytest's ``monkeypatch``) to
    raise ``AssertionError("<caller> called torch.distributed.<name>")``."""
    import torch.distributed as dist

    for name in names:
        if hasattr(dist, name):

            def forbidden(*args: Any, _name: str = name, **kwargs: Any) -> None:
                raise AssertionError(f"{caller} called torch.distributed.{_name}")

            monkeypatch.setattr(dist, name, forbidden)


def compiled_path_only(monkeypatch: Any) -> None:
    """Leave only the compiled (inductor) implementation of the fused update and momentum, as on
    CUDA: on the CPU the native kernel would otherwise come first."""
    import gefen.core.fused as fused
    import gefen.core.native as native

    kept = [impl for impl in fused._REGISTRY if impl.name == "inductor"]
    monkeypatch.setattr(fused, "_REGISTRY", kept)

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the native kernel is left out here (compiled_path_only)")

    monkeypatch.setattr(native, "native_momentum", unavailable)


@contextlib.contextmanager
def host_traffic(monkeypatch: Any) -> Iterator[Counter[str]]:
    """Count, while the block runs, the tensors made from host values (``"tensor"``:
    ``torch.tensor``) and the values read back to the host (``"read"``: ``Tensor.item`` and
    ``Tensor.tolist``). On CUDA each of these synchronizes the stream with the host."""
    counts: Counter[str] = Counter()
    make, item, tolist = torch.tensor, torch.Tensor.item, torch.Tensor.tolist

    def counted_tensor(*args: Any, **kwargs: Any) -> Tensor:
        counts["tensor"] += 1
        return make(*args, **kwargs)

    def counted_item(self: Tensor) -> Any:
        counts["read"] += 1
        return item(self)

    def counted_tolist(self: Tensor) -> Any:
        counts["read"] += 1
        return tolist(self)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "tensor", counted_tensor)
        patch.setattr(torch.Tensor, "item", counted_item)
        patch.setattr(torch.Tensor, "tolist", counted_tolist)
        yield counts


def format1_state_dict(optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``optimizer``'s format 2 ``state_dict`` ``sd`` in format 1: the codebook
    slot as the codebook or None, the initialized flags as positions, and every entry in its
    live form (docs/core.md §8.7)."""
    import copy

    from gefen.core.options import codebook_size
    from gefen.core.saving import EXTRAS_KEY, FORMAT_VERSION, torch_indices
    from gefen.core.template import absorb_entry, absorb_extras

    old = copy.deepcopy(sd)
    count = sum(len(group["params"]) for group in old["param_groups"])
    for holder in (old, *old["param_groups"]):
        if EXTRAS_KEY in holder:
            size = codebook_size(optimizer.param_groups)
            holder[EXTRAS_KEY] = absorb_extras(holder[EXTRAS_KEY], count, size)
            holder[EXTRAS_KEY]["format_version"] = FORMAT_VERSION
    indices = torch_indices(optimizer.param_groups)
    for group, group_indices in zip(optimizer.param_groups, indices, strict=True):
        for index, param in zip(group_indices, group["params"], strict=True):
            old["state"][index] = absorb_entry(optimizer, group, param, old["state"][index], "")
    return old


def gathered(value: Any) -> Any:
    """``value`` with every DTensor gathered by ``full_tensor()`` (collective: every rank calls
    it, as DCP's ``full_state_dict`` does) and every plain tensor copied, through dicts and
    lists, so it keeps the values of this moment while the live state moves on."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: gathered(item) for key, item in value.items()}
    if isinstance(value, list):
        return [gathered(item) for item in value]
    return value


def gathered_optimizer_state(model: Any, optimizer: Any) -> Any:
    """``get_optimizer_state_dict(model, optimizer)``, ``gathered``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return gathered(get_optimizer_state_dict(model, optimizer))


def nested_equal(a: Any, b: Any) -> bool:
    """Exact equality through dicts, lists and tuples: tensors by dtype and values."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(nested_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(nested_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)
