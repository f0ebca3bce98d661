"""A ``torch.optim.AdamW`` backup as a participant of the hybrid's transactions.

``Gefen`` and ``GefenMuon`` already offer what the shared step and load templates run (a local
preflight, a header payload, agreement checks, a prepared step, a staged load); torch's AdamW
does not. This adapter gives it the same members, so the hybrid drives its children as one list
of participants and no branch looks at the backup's type:

* ``validate_step_inputs``: the AdamW rules of ``adamw_preflight`` (options, moments), the
  gradient structure and, unless GradScaler's controls are present, finiteness;
* ``step_header_payload`` / ``check_step_agreement``: nothing (no codebook scope);
* ``apply_prepared_step``: AdamW's own step (its commit; a failure there latches the hybrid);
* ``prepare_load_state_dict``: the validated shadow load of ``adamw_backup``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gefen.core.extension import (
    check_finite_gradients,
    iter_parameters,
    validate_gradient_structure,
)
from gefen.dist import GuardedOperation, ProcessGroupBinding
from gefen.dist.torch_internals import unhooked_step
from gefen.hybrid.adamw_backup import (
    RANK_LOCAL_KEY,
    PreparedAdamWLoad,
    adamw_rank_local_header,
    prepare_adamw_load,
)
from gefen.hybrid.adamw_preflight import check_adamw_amp_precision, check_adamw_backup
from gefen.hybrid.adamw_template import with_unstarted_entries

__all__ = ["AdamWParticipant", "ChildParticipant", "PreparedChildLoad"]


class PreparedChildLoad(Protocol):
    """A child's staged load: symmetric agreement, a commit that cannot fail, its hooks."""

    @property
    def replica_words(self) -> tuple[int, int]: ...
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def agree(self, operation: GuardedOperation) -> None: ...
    def commit(self) -> None: ...
    def run_post_hooks(self) -> None: ...


class ChildParticipant(Protocol):
    """What the hybrid runs on each child: ``Gefen`` and ``GefenMuon`` as they are, an AdamW
    backup through ``AdamWParticipant``."""

    @property
    def binding(self) -> ProcessGroupBinding | None: ...
    def validate_step_inputs(self, *, amp_present: bool) -> None: ...
    def gradient_presence(self) -> list[bool]: ...
    def gradient_labels(self, first_group: int = 0) -> list[str]: ...
    def step_header_payload(self) -> list[int] | None: ...
    def check_step_agreement(self) -> None: ...
    def apply_prepared_step(self, *, operation: GuardedOperation | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def prepare_load_state_dict(self, state_dict: Any) -> PreparedChildLoad: ...


class AdamWParticipant:
    """The step and load members of one AdamW backup (``backup``), checked as ``owner``."""

    binding: ProcessGroupBinding | None = None  # an AdamW backup has no codebook scope

    def __init__(self, backup: torch.optim.Optimizer, owner: str, *, check_finite: bool) -> None:
        self.backup = backup
        self.owner = owner
        self.check_finite = check_finite

    def validate_step_inputs(self, *, amp_present: bool) -> None:
        """Rank-local, no collective, no mutation (the voted preflight's AdamW half)."""
        groups = self.backup.param_groups
        check_adamw_backup(self.backup, self.owner)
        if amp_present:
            check_adamw_amp_precision(self.backup, self.owner)
        validate_gradient_structure(groups, owner=self.owner, require_2d=False)
        if self.check_finite and not amp_present:
            check_finite_gradients(groups)

    def gradient_presence(self) -> list[bool]:
        return [p.grad is not None for group in self.backup.param_groups for p in group["params"]]

    def gradient_labels(self, first_group: int = 0) -> list[str]:
        return [label for label, _ in iter_parameters(self.backup.param_groups, first_group)]

    def step_header_payload(self) -> None:
        return None

    def check_step_agreement(self) -> None:
        """Nothing to agree on beyond the vote: AdamW's state is rank-local."""

    def apply_prepared_step(self, *, operation: GuardedOperation | None = None) -> None:
        """AdamW's own step, without torch's hook wrapper: the hybrid fired the hooks, and a
        hook registered on the backup would run after the vote (docs/hybrid.md §5)."""
        unhooked_step(self.backup)()

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with an entry for every parameter (a DCP template,
        ``adamw_template``), plus this rank's header when the backup is sharded."""
        saved = with_unstarted_entries(self.backup, self.backup.state_dict())
        header = adamw_rank_local_header(self.backup)
        if header is not None:
            saved[RANK_LOCAL_KEY] = header
        return saved

    def prepare_load_state_dict(self, state_dict: Any) -> PreparedAdamWLoad:
        return prepare_adamw_load(self.backup, state_dict)
