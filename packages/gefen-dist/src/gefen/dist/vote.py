"""The failure vote and the names of the voted phases (docs/dist.md §5)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gefen.dist.errors import DistributedStepError
from gefen.dist.runtime import collective
from gefen.dist.scope import Channel

__all__ = [
    "PHASE_AMP_CONTROL_PREFLIGHT",
    "PHASE_AMP_PREPARATION",
    "PHASE_CODEBOOK_SOLVE",
    "PHASE_INITIALIZE_PREAMBLE",
    "PHASE_LOAD_VALIDATION",
    "PHASE_LOCAL_HISTOGRAM_PREPARATION",
    "PHASE_MOMENTUM_REQUANTIZATION_STAGING",
    "PHASE_OWNER_STATE_HEADER",
    "PHASE_OWNER_STATE_METADATA",
    "PHASE_RECORD_PREPARATION",
    "PHASE_REFRESH_PREAMBLE",
    "PHASE_STEP_PREFLIGHT",
    "any_true_over",
    "synchronize_step_error",
]

PHASE_STEP_PREFLIGHT = "step preflight"
PHASE_LOAD_VALIDATION = "load validation"
PHASE_INITIALIZE_PREAMBLE = "initialize preamble"
PHASE_REFRESH_PREAMBLE = "refresh preamble"
PHASE_AMP_CONTROL_PREFLIGHT = "AMP control preflight"
PHASE_AMP_PREPARATION = "AMP preparation"
PHASE_LOCAL_HISTOGRAM_PREPARATION = "local histogram preparation"
PHASE_CODEBOOK_SOLVE = "codebook solve"
PHASE_MOMENTUM_REQUANTIZATION_STAGING = "momentum requantization staging"
PHASE_OWNER_STATE_HEADER = "owner state header"
PHASE_OWNER_STATE_METADATA = "owner state metadata"
PHASE_RECORD_PREPARATION = "record preparation"


@collective
def any_true_over(scope: Sequence[Channel], flag: bool) -> bool:
    """True on every member when ``flag`` is true on any: one MAX all-reduce per channel, folded
    channel by channel. Every rank enters every channel (no short-circuit), so a true flag
    travels along the chain to every rank the scope links. An empty scope returns ``flag``."""
    import torch.distributed as dist

    seen = bool(flag)
    for channel in scope:
        value = torch.tensor([1 if seen else 0], dtype=torch.int32, device=channel.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=channel.process_group)
        seen = bool(value.item())
    return seen


def synchronize_step_error(
    error: Exception | None, phase: str, scope: Sequence[Channel], owner_name: str
) -> None:
    """Make every member of ``scope`` fail together when any of them captured ``error``.

    Empty scope: the captured exception is re-raised unchanged (same object), so single-process
    callers see exactly what they would without this library. Callers capture with
    ``except Exception`` only: ``KeyboardInterrupt`` and friends propagate unvoted.
    """
    if error is not None and not isinstance(error, Exception):
        raise TypeError(
            f"synchronize_step_error expects an Exception or None, got {type(error).__name__}"
        )
    if len(scope) == 0:
        if error is not None:
            raise error
        return
    if not any_true_over(scope, error is not None):
        return
    if error is not None:
        import torch.distributed as dist

        rank = dist.get_rank()
        cause = str(error) or type(error).__name__
        raise DistributedStepError(
            f"{owner_name} {phase} failed on local rank {rank}: {cause}",
            owner_name=owner_name,
            phase=phase,
            local_failure=True,
            rank=rank,
        ) from error
    raise DistributedStepError(
        f"{owner_name} {phase} failed on another process-group member",
        owner_name=owner_name,
        phase=phase,
        local_failure=False,
        # The failing member is not known here; only that some member of the chain failed.
        rank=None,
    )
