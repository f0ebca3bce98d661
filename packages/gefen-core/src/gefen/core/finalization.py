"""Post-sharding finalization: the entry point of the explicit codebook scope (docs/core.md §13).

An adapter that shards a model after the optimizer was built tells the optimizer, once, what
each original slot has become. ``prepare_finalization`` checks the preconditions and every
rebinding without mutating anything; ``PreparedFinalization.commit`` publishes the result by
assignment only, so a composite can prepare all of its children before it commits any.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.contracts import LogicalSlice, ParameterLayout, ShardingManifest
from gefen.core.sharded_layout import Finalized, ParameterRebinding
from gefen.core.validation import is_dtensor
from gefen.dist import CodebookProcessGroupBinding
from gefen.dist.codebook_scope import (
    manifest_fingerprint_of,
    scope_fingerprint_of,
    validate_scope_installation,
)

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = ["PreparedFinalization", "prepare_finalization"]

_OWNER = ParameterLayout.WHOLE_PARAMETER_OWNER
_FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD


@dataclass(eq=False)
class PreparedFinalization:
    """A validated finalization; ``commit()`` swaps it in and cannot fail."""

    optimizer: ShellInterface
    groups: list[tuple[list[Tensor], list[str]]]
    finalized: Finalized

    def commit(self) -> None:
        self.optimizer.publish_finalization(self.finalized, list(self.groups))


def _fail(slot: str, rule: str) -> ValueError:
    return ValueError(f"post_sharding: {slot}: {rule}")


def _check_preconditions(optimizer: ShellInterface) -> None:
    if optimizer.finalized is not None:
        raise RuntimeError("post_sharding: the optimizer is already finalized")
    pristine = (
        optimizer.global_step == 0
        and optimizer.codebook is None
        and all(set(entry) <= {"period"} and entry.get("period", 0) == 0
                for param, entry in optimizer.state.items() if isinstance(param, Tensor))
        and all(p.grad is None for g in optimizer.param_groups for p in g["params"])
    )  # fmt: skip
    if not pristine:
        raise RuntimeError(
            "post_sharding requires a pristine optimizer (no step, no codebook, pristine state, "
            "no gradients)"
        )


def _check_types(rebindings: object, manifest: object, binding: object) -> list[Any]:
    if binding is not None and type(binding) is not CodebookProcessGroupBinding:
        raise TypeError(
            "codebook_process_group must be a gefen.dist.CodebookProcessGroupBinding or None, "
            f"got {type(binding).__name__}"
        )
    if type(manifest) is not ShardingManifest:
        raise TypeError(f"manifest must be a ShardingManifest, got {type(manifest).__name__}")
    if not isinstance(rebindings, Iterable):
        raise TypeError("rebindings must be an iterable of ParameterRebinding")
    listed = list(rebindings)
    for index, item in enumerate(listed):
        if type(item) is not ParameterRebinding:
            raise TypeError(f"rebindings[{index}] must be a ParameterRebinding")
    return listed


def _check_target(
    slot: str, rebinding: ParameterRebinding, allowed: Sequence[ParameterLayout]
) -> None:
    shard, target = rebinding.shard, rebinding.new_parameter
    if shard.layout not in allowed:
        names = ", ".join(layout.value for layout in allowed)
        raise _fail(slot, f"layout {shard.layout.value} is not supported (supported: {names})")
    is_owner = shard.layout is _OWNER and shard.owner == shard.local_member
    if target is None:
        if shard.layout is not _OWNER or is_owner:
            raise _fail(slot, "only a whole-parameter-owner non-owner may bind None")
        return
    if shard.layout is _OWNER and not is_owner:
        raise _fail(slot, "a whole-parameter-owner non-owner must bind None")
    if not isinstance(target, Tensor) or is_dtensor(target):
        raise _fail(slot, "the target must be a plain tensor (not a DTensor)")
    if not target.is_floating_point() or target.is_complex():
        raise _fail(slot, f"the target must be a real floating tensor, got {target.dtype}")
    if target.layout != torch.strided or target.device.type == "meta":
        raise _fail(slot, "the target must be strided and materialized")
    if not target.is_leaf or target.grad is not None:
        raise _fail(slot, "the target must be a leaf without a gradient")
    global_shape = tuple(shard.parameter.global_shape)
    if shard.layout is _FLAT:
        extent = shard.extent
        length = extent.length if isinstance(extent, LogicalSlice) else -1
        if target.dim() != 1 or not target.is_contiguous() or target.numel() != length:
            raise _fail(slot, f"a flattened shard target must be 1-D contiguous of length {length}")
    elif tuple(target.shape) != global_shape:
        raise _fail(slot, f"the target must have the global shape {global_shape}")


def _storage_disjoint(targets: list[tuple[str, Tensor]]) -> None:
    spans: list[tuple[int, int, str]] = []
    for slot, target in targets:
        if target.numel() == 0:
            continue
        size = target.element_size()
        start = int(target.untyped_storage().data_ptr()) + int(target.storage_offset()) * size
        spans.append((start, start + target.numel() * size, slot))
    spans.sort()
    reach, holder = -1, ""
    for start, end, slot in spans:
        if start < reach:
            raise _fail(slot, f"the target shares storage with {holder}")
        if end > reach:
            reach, holder = end, slot


def _match_slots(
    optimizer: ShellInterface, rebindings: list[ParameterRebinding]
) -> list[list[ParameterRebinding]]:
    by_source: dict[int, ParameterRebinding] = {}
    for rebinding in rebindings:
        if id(rebinding.old_parameter) in by_source:
            raise _fail(rebinding.shard.parameter.fqn, "two rebindings share one source slot")
        by_source[id(rebinding.old_parameter)] = rebinding
    per_group = []
    for group_index, group in enumerate(optimizer.param_groups):
        matched = []
        for position, param in enumerate(group["params"]):
            if id(param) not in by_source:
                raise _fail(f"param_groups[{group_index}][{position}]", "has no rebinding")
            matched.append(by_source.pop(id(param)))
        per_group.append(matched)
    if by_source:
        extra = next(iter(by_source.values()))
        raise _fail(extra.shard.parameter.fqn, "the source is not a parameter of this optimizer")
    return per_group


def _check_set(rebindings: list[ParameterRebinding], manifest: ShardingManifest) -> None:
    fqns = [r.shard.parameter.fqn for r in rebindings]
    duplicates = sorted({fqn for fqn in fqns if fqns.count(fqn) > 1})
    if duplicates:
        raise _fail(duplicates[0], "two rebindings name one FQN")
    targets = [r.new_parameter for r in rebindings if r.new_parameter is not None]
    if len({id(t) for t in targets}) != len(targets):
        raise _fail("targets", "two rebindings bind one target tensor")
    if set(fqns) != set(manifest.fqns):
        missing = sorted(set(manifest.fqns) ^ set(fqns))
        raise _fail(missing[0], "the manifest's FQN set differs from the rebindings'")
    listed = set(manifest.shards)
    members: dict[Any, str | None] = {}
    for rebinding in rebindings:
        shard = rebinding.shard
        if shard not in listed:
            raise _fail(shard.parameter.fqn, "the shard identity is not in the manifest")
        group = shard.process_group
        if members.setdefault(group, shard.local_member) != shard.local_member:
            raise _fail(shard.parameter.fqn, "one process group has two local members")


def prepare_finalization(
    optimizer: ShellInterface,
    rebindings: object,
    manifest: object,
    binding: object,
    allowed: Sequence[ParameterLayout],
) -> PreparedFinalization:
    """Preconditions and validation (ValueError naming the slot); mutates nothing."""
    listed = _check_types(rebindings, manifest, binding)
    assert isinstance(manifest, ShardingManifest)
    _check_preconditions(optimizer)
    per_group = _match_slots(optimizer, listed)
    _check_set(listed, manifest)
    for rebinding in listed:
        _check_target(rebinding.shard.parameter.fqn, rebinding, allowed)
    _storage_disjoint(
        [(r.shard.parameter.fqn, r.new_parameter) for r in listed if r.new_parameter is not None]
    )
    if binding is not None:
        assert isinstance(binding, CodebookProcessGroupBinding)
        validate_scope_installation(binding, manifest, [r.shard for r in listed])
    return _staged(optimizer, per_group, manifest, binding)


def _staged(
    optimizer: ShellInterface,
    per_group: list[list[ParameterRebinding]],
    manifest: ShardingManifest,
    binding: CodebookProcessGroupBinding | None,
) -> PreparedFinalization:
    groups: list[tuple[list[Tensor], list[str]]] = []
    group_shards = []
    for matched in per_group:
        kept = [(r.new_parameter, r.shard) for r in matched if r.new_parameter is not None]
        groups.append(([t for t, _ in kept], [shard.parameter.fqn for _, shard in kept]))
        group_shards.append(tuple(shard for _, shard in kept))
    rebindings = sorted((r for m in per_group for r in m), key=lambda r: r.shard.sort_key)
    refresh_every = int(optimizer.defaults.get("codebook_refresh_every", 0))
    finalized = Finalized(
        group_params=tuple(tuple(params) for params, _ in groups),
        group_shards=tuple(group_shards),
        shards=tuple((r.shard, r.new_parameter) for r in rebindings),
        manifest=manifest,
        binding=binding,
        scope_fingerprint=None
        if binding is None
        else scope_fingerprint_of(binding.identity, refresh_every),
        manifest_fingerprint=manifest_fingerprint_of(manifest),
    )
    return PreparedFinalization(optimizer, groups, finalized)
