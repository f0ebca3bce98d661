"""gefen.dist: the distributed building blocks of the Gefen optimizers.

Failure scopes and votes, AMP agreement, process-group bindings, the guarded collective
operation, the core-free parts of the codebook-scope protocol, pickle-free checkpoint
transports and (in ``gefen.dist.testing``) a multi-rank test harness and deep snapshots.

``import gefen.dist`` works when ``torch.distributed`` is unavailable: then every failure
scope is empty and no multi-member binding can be built.
"""

from gefen.dist._version import __version__
from gefen.dist.amp import AmpControls, parse_amp_controls, prepare_synchronized_amp_step
from gefen.dist.backends import backend_allows, choose_collective_device
from gefen.dist.binding import (
    CheckpointProcessGroupBinding,
    CodebookProcessGroupBinding,
    ProcessGroupBinding,
)
from gefen.dist.errors import BindingError, DistributedStepError, GroupAgreementError
from gefen.dist.guarded import GuardedOperation
from gefen.dist.rank_local import (
    check_rank_local_header,
    check_rank_local_records,
    rank_local_header,
)
from gefen.dist.runtime import collective, cuda_graph_capturing
from gefen.dist.scope import Channel, collect_failure_scope, mesh_key
from gefen.dist.transport import TransportLimits, all_gather_records, broadcast_owner_state
from gefen.dist.vote import (
    AGREEMENT_WIDTH,
    PHASE_AMP_CONTROL_PREFLIGHT,
    PHASE_AMP_PREPARATION,
    PHASE_CODEBOOK_SOLVE,
    PHASE_INITIALIZE_PREAMBLE,
    PHASE_LOAD_VALIDATION,
    PHASE_LOCAL_HISTOGRAM_PREPARATION,
    PHASE_MOMENTUM_REQUANTIZATION_STAGING,
    PHASE_OWNER_STATE_HEADER,
    PHASE_OWNER_STATE_METADATA,
    PHASE_RECORD_PREPARATION,
    PHASE_REFRESH_PREAMBLE,
    PHASE_STATE_DICT_PREFLIGHT,
    PHASE_STEP_PREFLIGHT,
    any_true_over,
    differing_positions,
    presence_words,
    synchronize_step_error,
    vote_over,
    vote_words,
)

__all__ = [
    "AGREEMENT_WIDTH",
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
    "PHASE_STATE_DICT_PREFLIGHT",
    "PHASE_STEP_PREFLIGHT",
    "AmpControls",
    "BindingError",
    "Channel",
    "CheckpointProcessGroupBinding",
    "CodebookProcessGroupBinding",
    "DistributedStepError",
    "GroupAgreementError",
    "GuardedOperation",
    "ProcessGroupBinding",
    "TransportLimits",
    "__version__",
    "all_gather_records",
    "any_true_over",
    "backend_allows",
    "broadcast_owner_state",
    "check_rank_local_header",
    "check_rank_local_records",
    "choose_collective_device",
    "collect_failure_scope",
    "collective",
    "cuda_graph_capturing",
    "differing_positions",
    "mesh_key",
    "parse_amp_controls",
    "prepare_synchronized_amp_step",
    "presence_words",
    "rank_local_header",
    "synchronize_step_error",
    "vote_over",
    "vote_words",
]
