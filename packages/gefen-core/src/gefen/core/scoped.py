"""Codebook learning and refresh under an explicit codebook scope (docs/dist.md §9.3–§9.6).

Every member of the scope enters the same sequence, whatever its local gradients: a voted local
phase that stages periods and builds the histogram and the contribution records, one gather of
the records (checked identically everywhere), one exact int64 SUM of the histograms, a voted
deterministic solve and an agreement on the candidate's fingerprint. Nothing is written: the
caller publishes what these functions stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.contracts import ParameterLayout, ShardIdentity
from gefen.core.checked import options_word
from gefen.core.learning import StagedLearning, build_histogram, remap_table, solve_new_codebook
from gefen.core.options import codebook_size, group_uses_codebook
from gefen.dist import (
    PHASE_CODEBOOK_SOLVE,
    PHASE_LOCAL_HISTOGRAM_PREPARATION,
    PHASE_MOMENTUM_REQUANTIZATION_STAGING,
    BindingError,
    CheckpointProcessGroupBinding,
    GuardedOperation,
    ProcessGroupBinding,
    presence_words,
)
from gefen.dist.codebook_scope import (
    CONTRIBUTION_LAYOUT_CODES,
    check_contribution_records,
    codebook_fingerprint_of,
    codebook_header_payload,
    fingerprint_words,
)

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface
    from gefen.core.sharded_layout import Finalized

__all__ = [
    "check_checkpoint_binding",
    "load_header_payload",
    "scope_header_payload",
    "scoped_learn",
    "scoped_refresh_table",
]

_Local = tuple[list[int], Tensor, dict[int, int]]


def _contributes(shard: ShardIdentity, tensor: Tensor | None, coordinate: int) -> bool:
    """§9.6: a replicated parameter once (coordinate 0), every non-empty flattened shard, and
    a whole parameter on its owner only."""
    if tensor is None or tensor.numel() == 0:
        return False
    if shard.layout is ParameterLayout.REPLICATED:
        return coordinate == 0
    return True


def _local_contributions(
    optimizer: ShellInterface,
    finalized: Finalized,
    *,
    stage_periods: bool,
    staged: Mapping[int, int],
) -> _Local:
    """Records, local histogram and staged periods over the local shards in canonical order
    (``staged``: periods this step already staged, as a refresh during a step counts them)."""
    index_of = {id(param): (index, group) for index, group, param in optimizer.indexed_params()}
    binding = finalized.binding
    coordinate = 0 if binding is None else binding.coordinate
    records: list[int] = []
    periods: dict[int, int] = {}
    inputs = []
    input_periods: dict[int, int] = {}
    for shard, tensor in finalized.shards:
        grad = None if tensor is None else tensor.grad
        active = tensor is not None and grad is not None and tensor.numel() > 0
        period = 0
        if tensor is not None:
            index, group = index_of[id(tensor)]
            period = int(optimizer.state.get(tensor, {}).get("period", 0)) or staged.get(index, 0)
            if active and period == 0 and stage_periods:
                assert grad is not None
                view = grad.detach()
                period = optimizer.select_new_period(group, tensor, view, tuple(view.shape)) or 0
                periods[index] = period
            coded = group_uses_codebook(group)  # an fp32-momentum group learns no codebook
            if active and period > 0 and coded and _contributes(shard, tensor, coordinate):
                assert grad is not None
                inputs.append((index, grad.detach(), tuple(grad.shape)))
                input_periods[index] = period
        length = 0 if tensor is None else tensor.numel()
        code = CONTRIBUTION_LAYOUT_CODES[shard.layout]
        records += [code, int(active), period if period > 0 else -1, length]
    counts = build_histogram(inputs, input_periods)
    return records, counts, periods


def _device(finalized: Finalized) -> torch.device:
    tensors = [tensor for _, tensor in finalized.shards if tensor is not None]
    return tensors[0].device if tensors else torch.device("cpu")


def scoped_learn(
    optimizer: ShellInterface,
    op: GuardedOperation,
    *,
    stage_periods: bool,
    staged: Mapping[int, int] | None = None,
) -> StagedLearning | None:
    """§9.4 step 5 a–e (and §9.5 step 4): a candidate codebook agreed by every member, with
    the staged periods; None when the summed histogram is empty."""
    finalized = optimizer.finalized
    assert finalized is not None
    records, counts, periods = op.local(
        PHASE_LOCAL_HISTOGRAM_PREPARATION,
        _local_contributions,
        optimizer,
        finalized,
        stage_periods=stage_periods,
        staged=staged or {},
    )
    rows = op.gather(records)
    check_contribution_records(rows, finalized.manifest, op.owner_name)
    total = op.sum_int64(counts)
    if int(total.sum()) == 0:
        return None
    candidate = op.local(
        PHASE_CODEBOOK_SOLVE,
        solve_new_codebook,
        total,
        _device(finalized),
        codebook_size(optimizer.param_groups),
    )
    op.agree("codebook values", fingerprint_words(codebook_fingerprint_of(candidate)))
    return StagedLearning(periods=periods, codebook=candidate)


def _staged_table(optimizer: ShellInterface, new_codebook: Tensor) -> Tensor:
    assert optimizer.codebook is not None
    return remap_table(optimizer.codebook, new_codebook)


def scoped_refresh_table(
    optimizer: ShellInterface, op: GuardedOperation, new_codebook: Tensor
) -> Tensor:
    """§9.5 step 5: the table rule's 256-entry remap table, staged in a voted local phase (the
    commit applies it to every local quantized momentum in place)."""
    staged: Tensor = op.local(
        PHASE_MOMENTUM_REQUANTIZATION_STAGING, _staged_table, optimizer, new_codebook
    )
    return staged


def scope_header_payload(optimizer: ShellInterface) -> list[int] | None:
    """The step header's payload words (docs/dist.md §9.2); None while no binding is installed.

    A step that learns nothing exchanges no contribution record (§9.6), so the header carries the
    presence pattern; it is in every header so that its words never differ by anything but the
    pattern. The options digest rides in it too (``checked.options_word``: an option edited on
    one member fails every member before anything changes, as the mesh form's vote does)."""
    finalized = optimizer.finalized
    if optimizer.binding is None or finalized is None:
        return None
    presence = presence_words(finalized.presence_pattern())
    options = options_word(optimizer.param_groups, empty_groups=True)
    return _header_words(
        optimizer, finalized, optimizer.global_step, optimizer.codebook, presence, options
    )


def load_header_payload(
    optimizer: ShellInterface,
    global_step: int,
    codebook: Tensor | None,
    replica: tuple[int, int],
    groups: list[dict[str, Any]],
) -> list[int] | None:
    """A staged load's header words (``LOAD_HEADER_WORD_NAMES``): the step, codebook and
    options (of ``groups``) it would publish and its replicated-state words; None while no
    binding is installed."""
    finalized = optimizer.finalized
    if optimizer.binding is None or finalized is None:
        return None
    options = options_word(groups, empty_groups=True)  # as the step header's
    return _header_words(optimizer, finalized, global_step, codebook, replica, options)


def _header_words(
    optimizer: ShellInterface,
    finalized: Finalized,
    global_step: int,
    codebook: Tensor | None,
    agreement: tuple[int, int],
    options: int,
) -> list[int]:
    digest = None if codebook is None else codebook_fingerprint_of(codebook)
    return list(
        codebook_header_payload(
            global_step=global_step,
            codebook_present=codebook is not None,
            deterministic=bool(optimizer.defaults["deterministic"]),
            refresh_every=int(optimizer.defaults.get("codebook_refresh_every", 0)),
            local_shard_count=len(finalized.shards),
            scope_fingerprint=finalized.scope_fingerprint,
            manifest_fingerprint=finalized.manifest_fingerprint,
            codebook_fingerprint=digest,
            agreement=agreement,
            options=options,
        )
    )


def check_checkpoint_binding(
    checkpoint_binding: object, installed: ProcessGroupBinding | None
) -> None:
    """A ``checkpoint_binding`` (None: no check) matches the installed one (docs/dist.md §7)."""
    if checkpoint_binding is None:
        return
    if not isinstance(checkpoint_binding, CheckpointProcessGroupBinding):
        kind = type(checkpoint_binding).__name__
        raise TypeError(f"checkpoint_binding must be a CheckpointProcessGroupBinding, got {kind}")
    if installed is None:
        raise BindingError("no codebook binding is installed")
    if (
        checkpoint_binding.process_group is not installed.process_group
        or checkpoint_binding.identity != installed.identity
        or checkpoint_binding.local_member != installed.local_member
        or checkpoint_binding.collective_device != installed.collective_device
    ):
        raise BindingError(
            "checkpoint_binding does not match the installed codebook binding (same "
            "identity, member, device and process-group handle object required)"
        )
