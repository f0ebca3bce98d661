"""The shell's codebook operations: learning in a step, ``initialize_codebook`` and
``refresh_codebook`` (docs/core.md §5.5–§5.6), unscoped or under an explicit codebook scope
(docs/dist.md §9.3–§9.5).

Everything here stages; publication happens in one place (``publish``), inside the shell's
commit or right after an agreed initialize/refresh, and a failure there latches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.core.learning import (
    CodebookInput,
    StagedLearning,
    any_nonzero_agreed,
    build_histogram,
    remap_codes_,
    remap_table,
    solve_new_codebook,
    stage_periods,
)
from gefen.core.options import codebook_size, group_uses_codebook
from gefen.core.resharding import summed_over
from gefen.core.scoped import scoped_learn, scoped_refresh_table
from gefen.dist import PHASE_INITIALIZE_PREAMBLE, PHASE_REFRESH_PREAMBLE, GuardedOperation
from gefen.dist.codebook_scope import HEADER_WORD_NAMES, OP_INITIALIZE, OP_REFRESH

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = ["initialize", "publish", "refresh", "stage_step_learning"]


def _live_periods(opt: ShellInterface) -> dict[int, int]:
    return {
        index: int(opt.state.get(param, {}).get("period", 0))
        for index, _, param in opt.indexed_params()
    }


def _stage_new_periods(opt: ShellInterface, inputs: list[CodebookInput]) -> dict[int, int]:
    by_index = {index: (group, param) for index, group, param in opt.indexed_params()}

    def select(index: int, view: Tensor, shape: tuple[int, ...]) -> int | None:
        group, param = by_index[index]
        return opt.select_new_period(group, param, view, shape)

    return stage_periods(inputs, _live_periods(opt), select)


def _coded(opt: ShellInterface, inputs: list[CodebookInput]) -> list[CodebookInput]:
    """The inputs of codebook groups: a group keeping fp32 momentum picks a period (it is
    the layout of its second moment) but does not shape the codebook."""
    coded = {index for index, group, _ in opt.indexed_params() if group_uses_codebook(group)}
    return [item for item in inputs if item[0] in coded]


def _first_codebook(opt: ShellInterface, op: GuardedOperation) -> StagedLearning:
    """Periods for every input and the first codebook, or, while the codebook groups'
    gradients are all zero, what ``_before_codebook`` stages (§5.5)."""
    if _scoped(opt, op):
        learned = scoped_learn(opt, op, stage_periods=True)
        return _before_codebook(opt, op) if learned is None else learned
    inputs = opt.codebook_inputs(op)
    periods = _stage_new_periods(opt, inputs)
    counts = _shared(opt, op, build_histogram(_coded(opt, inputs), periods))
    if not any_nonzero_agreed(counts, op.scope):
        return _before_codebook(opt, op, periods)
    device = inputs[0][1].device if inputs else torch.device("cpu")
    codebook = solve_new_codebook(counts, device, codebook_size(opt.param_groups))
    return StagedLearning(periods=periods, codebook=codebook)


def _before_codebook(
    opt: ShellInterface, op: GuardedOperation, periods: Mapping[int, int] | None = None
) -> StagedLearning:
    """An empty histogram: the fp32-momentum groups step alone (their new periods staged, from
    ``periods`` when learning staged them already; the codebook groups wait, their periods
    unstaged, and the plans leave them out), or the agreed no-op when no fp32-momentum
    parameter has a gradient. Gradient presence is agreed before phase 4 (the vote, or the
    scoped header), so every member decides alike."""
    uncoded = {
        index
        for index, group, param in opt.indexed_params()
        if param.grad is not None and not group_uses_codebook(group)
    }
    if not uncoded:
        return StagedLearning(noop=True)
    if periods is None:
        inputs = [item for item in opt.codebook_inputs(op) if item[0] in uncoded]
        periods = _stage_new_periods(opt, inputs)
    return StagedLearning(periods={i: p for i, p in periods.items() if i in uncoded})


def _refreshed(
    opt: ShellInterface,
    op: GuardedOperation,
    inputs: list[CodebookInput],
    staged: Mapping[int, int],
) -> tuple[Tensor, Tensor] | None:
    """§5.6 steps 1–3: a new codebook and the 256-entry byte remap table, or None (empty)."""
    current = opt.codebook
    assert current is not None
    if _scoped(opt, op):
        learned = scoped_learn(opt, op, stage_periods=False, staged=staged)
        if learned is None or learned.codebook is None:
            return None
        return learned.codebook, scoped_refresh_table(opt, op, learned.codebook)
    counts = _shared(
        opt, op, build_histogram(_coded(opt, inputs), {**_live_periods(opt), **staged})
    )
    if not bool(counts.sum().item() > 0):
        return None
    new_codebook = solve_new_codebook(counts, current.device, codebook_size(opt.param_groups))
    return new_codebook, remap_table(current, new_codebook)


def _shared(opt: ShellInterface, op: GuardedOperation, counts: Tensor) -> Tensor:
    """A row-sharded optimizer learns one codebook per mesh: the histogram summed over it."""
    return summed_over(counts, op.scope) if opt.row_sharded() else counts


def _scoped(opt: ShellInterface, op: GuardedOperation) -> bool:
    return op.binding is not None and opt.finalized is not None


def refresh_due(opt: ShellInterface) -> bool:
    """Whether this step refreshes the codebook. The period is read from the groups, which the
    step vote agrees on (optimizer-wide: every group holds the constructor's value), never from
    ``defaults``, which one member may edit alone: its refresh would be a collective the others
    never enter."""
    groups = opt.param_groups
    every = int(groups[0].get("codebook_refresh_every", 0)) if groups else 0
    return every > 0 and opt.global_step > 0 and opt.global_step % every == 0


def stage_step_learning(opt: ShellInterface, op: GuardedOperation) -> StagedLearning:
    """What phase 4 learns before the update: new periods, and a first or refreshed codebook."""
    if not opt.uses_codebook:
        return StagedLearning(periods=_stage_new_periods(opt, opt.codebook_inputs(op)))
    if opt.codebook is None:
        return _first_codebook(opt, op)
    inputs = opt.codebook_inputs(op)
    learning = StagedLearning(periods=_stage_new_periods(opt, inputs))
    if refresh_due(opt):
        refreshed = _refreshed(opt, op, inputs, learning.periods)
        if refreshed is not None:
            learning.codebook, learning.remap = refreshed
    return learning


def publish(opt: ShellInterface, learning: StagedLearning) -> None:
    """Write staged periods and remap every code tensor in place, one at a time (the shell
    installs the new codebook after this and latches on failure)."""
    by_index = {index: param for index, _, param in opt.indexed_params()}
    for index, period in learning.periods.items():
        opt.state[by_index[index]]["period"] = period
    if learning.remap is not None:
        key = opt.CODEC_KEYS.codes
        for entry in opt.state.values():
            if isinstance(entry, dict) and key in entry:
                remap_codes_(learning.remap, entry[key])


def _voted_preamble(opt: ShellInterface, phase: str, checks: Any, op_code: int) -> GuardedOperation:
    """The preamble voted over the scope, then (scoped) the operation header."""
    op = opt.guarded_operation()
    payload = op.local(phase, checks)
    if op.binding is not None and payload is not None:
        op.header(op_code, payload, HEADER_WORD_NAMES)
    return op


def initialize(opt: ShellInterface) -> bool:
    """Learn the codebook from the current gradients without stepping (§2.4, §9.4)."""
    op = _voted_preamble(opt, PHASE_INITIALIZE_PREAMBLE, opt.initialize_preamble, OP_INITIALIZE)
    if not opt.uses_codebook or opt.codebook is not None:
        return False
    # Learning may gather gradients (GefenMuon's full_tensor): agree on presence first.
    opt.check_step_agreement()
    with torch.no_grad():
        learning = _first_codebook(opt, op)
    if learning.codebook is None:  # an empty histogram: nothing is learned or written
        return False
    opt.publish_learning(learning)
    return True


def refresh(opt: ShellInterface) -> bool:
    """The refresh transaction of §5.6 / §9.5 on demand; True iff the codebook was replaced."""
    op = _voted_preamble(opt, PHASE_REFRESH_PREAMBLE, opt.refresh_preamble, OP_REFRESH)
    with torch.no_grad():
        # The scoped refresh reads the finalized shards itself; only the unscoped one needs inputs.
        inputs = [] if _scoped(opt, op) else opt.codebook_inputs(op)
        refreshed = _refreshed(opt, op, inputs, {})
    if refreshed is None:
        return False
    codebook, table = refreshed
    opt.publish_learning(StagedLearning(codebook=codebook, remap=table))
    return True
