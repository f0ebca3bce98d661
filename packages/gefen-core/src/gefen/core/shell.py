"""The shared optimizer shell of ``Gefen`` and ``GefenMuon`` (docs/core.md §1.1, §2.3, §7).

``OptimizerShell`` owns the groups and names, the ``{"period": 0}`` placeholder, the step template
(preflight, vote, AMP agreement, preparation, commit), codebook learning and refresh, the hooks,
the failed-commit latch and the checkpoint transaction. A subclass supplies the extension points
of §1.1; a composite drives the public step members (``step_failure_scope`` and the rest).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from gefen.contracts import ParameterLayout, ShardingManifest
from gefen.core import codebook_ops
from gefen.core.checked import match_changed_entries, options_token, revalidate_changed_groups
from gefen.core.checkpoint import PreparedLoad, prepare_load
from gefen.core.finalization import PreparedFinalization, prepare_finalization
from gefen.core.fused import KernelSelector
from gefen.core.groups import check_params_argument, checked_new_group
from gefen.core.kernels import select_period
from gefen.core.learning import CodebookInput, StagedLearning
from gefen.core.options import group_uses_codebook
from gefen.core.saving import build_state_dict, saved_codebooks
from gefen.core.scoped import check_checkpoint_binding, scope_header_payload
from gefen.core.sharded_layout import Finalized, ParameterRebinding
from gefen.core.state import CodecKeys, EntrySpec, entries_nbytes
from gefen.core.steady import SteadyToken, plain_parameters, same_token, step_token
from gefen.core.template import TemplateLayout
from gefen.core.transaction import STEP_SIGNATURE, HookedStepState, run_load, run_step
from gefen.core.validation import (
    amp_scaling_supported,
    check_finite_gradients,
    check_learnable_gradients,
    iter_parameters,
    validate_gradient_structure,
)
from gefen.dist import (
    PHASE_STATE_DICT_PREFLIGHT,
    Channel,
    CodebookProcessGroupBinding,
    GuardedOperation,
    ProcessGroupBinding,
    collect_failure_scope,
)
from gefen.dist.codebook_scope import HEADER_WORD_NAMES, OP_STEP
from gefen.dist.torch_internals import HOOK_REGISTRIES, set_grad_enabled, state_dict_with_hooks

__all__ = ["OptimizerShell", "PreparedLoad", "amp_scaling_supported"]

_LAST_STEP = "global_step is 2**63 - 1, the last a checkpoint can hold (it must be below 2**63)"


class OptimizerShell(TemplateLayout, HookedStepState, Optimizer):
    """The ``torch.optim.Optimizer`` base class of the Gefen optimizers (docs/core.md §1.1)."""

    OWNER_NAME: ClassVar[str] = "OptimizerShell"
    CHECKPOINT_OWNER: ClassVar[str] = "OptimizerShell"  # the writer its files name (§8.1)
    OPTIMIZER_WIDE: ClassVar[tuple[str, ...]] = ()
    CODEC_KEYS: ClassVar[CodecKeys] = CodecKeys()
    OPTIONAL_EXTRAS: ClassVar[tuple[str, ...]] = ("scope", "rank_local")
    # Extras written at the top level only: DCP, which keeps only the group copies, neither
    # saves nor asks for them (docs/core.md §8.1).
    TOP_LEVEL_EXTRAS: ClassVar[tuple[str, ...]] = ()
    # GefenMuon: every parameter must stay 2-D, even without a gradient (docs/muon.md §6).
    REQUIRE_2D: ClassVar[bool] = False
    LAYOUT_OPTIONS: ClassVar[tuple[str, ...]] = ("momentum_codec",)  # fixed once state exists
    # The attributes __getstate__ copies (a whitelist: never an instance-level `step` wrapper).
    _PICKLED_ATTRIBUTES: ClassVar[tuple[str, ...]] = (
        *("defaults", "state", "param_groups", "_global_step", "_codebook", "_commit_failed"),
        *("_binding", "_finalized", *HOOK_REGISTRIES),
    )
    # The layouts post_sharding accepts (docs/core.md §13); GefenMuon overrides.
    POST_SHARDING_LAYOUTS: ClassVar[tuple[ParameterLayout, ...]] = (
        ParameterLayout.REPLICATED,
        ParameterLayout.FLATTENED_ELEMENT_SHARD,
    )

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        check_params_argument(params)
        self._global_step = 0
        self._codebook: Tensor | None = None
        self._commit_failed = False
        self._binding: ProcessGroupBinding | None = None
        self._finalized: Finalized | None = None
        self._kernels = KernelSelector()
        self._steady: SteadyToken | None = None  # gefen.core.steady: what the last checks passed
        super().__init__(params, defaults)

    # -- extension points (docs/core.md §1.1) -------------------------------------------------

    def validate_group(self, group: Mapping[str, Any]) -> None:
        """Option checks of one group (§2.2); raise on the first failing rule."""

    def _check_structure(self) -> None:
        """§7.2's structural checks: the layout, each gradient, each entry against its group."""
        self._check_finalized_layout()
        groups, owner = self.param_groups, self.OWNER_NAME
        validate_gradient_structure(groups, owner=owner, require_2d=self.REQUIRE_2D)
        self._check_local_inputs()

    def _check_local_inputs(self) -> None:
        """Further rank-local step checks; by default §7.2's match of each changed entry."""
        previous = self.__dict__.get("_matched_entries", {})
        self._matched_entries = match_changed_entries(self, previous)

    def checkpoint_extras(self, entries: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """Optional extras keys of this optimizer, from the entries ``state_dict`` emits."""
        return {}

    def rank_local_checkpoint(self) -> bool:  # carries "rank_local" (docs/dist.md §10.3)
        return "rank_local" in self.OPTIONAL_EXTRAS and len(self.step_failure_scope()) > 0

    def replicated_positions(self, groups: list[dict[str, Any]]) -> list[int] | None:
        """Flat positions identical on every rank (None: none; []: step and codebook, §9.1)."""
        if self._finalized is None:
            return [] if self.row_sharded() else None
        return self._finalized.replicated_positions()

    def _validate_registration(self, candidate: Mapping[str, Any]) -> None:
        """Registration-only rules of a new group (GefenMuon's 2-D, unmixed modes); once."""

    def select_new_period(
        self, group: Mapping[str, Any], param: Tensor, view: Tensor, shape: tuple[int, ...]
    ) -> int | None:
        """A new parameter's period: ``template_period`` (§4.1), else §4's gradient search."""
        fixed = self.template_period(group, param)
        return fixed if fixed is not None else select_period(view, shape, force_one=False)

    def codebook_inputs(self, operation: GuardedOperation) -> list[CodebookInput]:
        """Per parameter with a non-empty gradient: (flat index, the gradient view the codebook
        and period are learned from, its quantized shape). May be collective (GefenMuon)."""
        raise NotImplementedError

    def entry_spec(self, group: Mapping[str, Any], param: Tensor) -> EntrySpec:
        """The ``validate_entry`` keyword arguments for ``param`` in ``group``."""
        raise NotImplementedError

    def _prepare_step(self, operation: GuardedOperation, learning: StagedLearning) -> Any:
        """Phase 4: stage every update, writing nothing; returns the plan ``_commit_step`` takes
        (``learning``, what the shell staged, is published before ``_commit_step`` runs)."""
        raise NotImplementedError

    def _commit_step(self, plan: Any) -> None:
        """Phase 5: publish the plan (state entries, parameter writes); must not fail."""
        raise NotImplementedError

    def _select_kernels(self) -> None:
        """Kernel selection of the local preflight (§11); the default has nothing to select."""

    def _build_state_entries(self, operation: GuardedOperation) -> dict[int, dict[str, Any]]:
        entries = self.state  # .get: a parameter put in a group later has none (never emit {})
        return {i: dict(entries.get(p, {"period": 0})) for i, _, p in self.indexed_params()}

    def stage_entries(
        self, saved: Mapping[int, Any], groups: list[dict[str, Any]], extras: Mapping[str, Any]
    ) -> dict[int, dict[str, Any]]:
        """Shadow entries by flat position from the saved entries (same positions; a missing
        entry is the pristine placeholder), validated with ``validate_entry``."""
        raise NotImplementedError

    # -- groups and names (§2.3) ------------------------------------------------------------

    def indexed_params(self) -> list[tuple[int, dict[str, Any], Tensor]]:
        """(flat index, group, parameter) in group order, then parameter order."""
        flat = ((group, param) for group in self.param_groups for param in group["params"])
        return [(index, group, param) for index, (group, param) in enumerate(flat)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """All-or-nothing: the whole group is validated before anything is registered."""
        finalized = self.__dict__.get("_finalized") is not None
        candidate = checked_new_group(self, param_group, finalized=finalized)
        self._validate_registration(candidate)
        self.validate_group(candidate)
        # Publish: the caller's dict itself becomes the group, as in torch.
        param_group.update(candidate)
        self.param_groups.append(param_group)
        validated = self.__dict__.setdefault("_validated_options", {})
        validated[id(param_group)] = (param_group, options_token(param_group))
        for param in param_group["params"]:
            self.state[param] = {"period": 0}

    # -- the composite step protocol (§1.1) -------------------------------------------------

    def step_failure_scope(self) -> tuple[Channel, ...]:
        """The installed binding's scope, else the failure scope of the groups; pure."""
        if self._binding is not None:
            return self._binding.failure_scope()
        return collect_failure_scope(self.param_groups)

    def guarded_operation(self) -> GuardedOperation:
        if self._binding is not None:
            return GuardedOperation(self.OWNER_NAME, binding_getter=lambda: self._binding)
        # Plain tensors only: the scope is empty and the operation stateless, so reuse it.
        local = self.__dict__.get("_local_operation")
        if local is not None and plain_parameters(self.param_groups):
            return local  # type: ignore[no-any-return]
        op = GuardedOperation(self.OWNER_NAME, scope=self.step_failure_scope())
        self._local_operation = op if not op.scope and plain_parameters(self.param_groups) else None
        return op

    def validate_step_inputs(self, *, amp_present: bool) -> None:
        """Rank-local, no collective, no mutation: latch, options, §7.2 checks, kernels; the
        structural ones only when the steady-state token changed (``gefen.core.steady``)."""
        if self._commit_failed:  # a child of the hybrid is checked here, not by the transaction
            self.check_latch()
        if self._global_step >= 2**63 - 1:  # the next could not be saved (checkpoint.py's rule)
            raise RuntimeError(f"{self.OWNER_NAME}: {_LAST_STEP}")
        groups, binding = self.param_groups, self._binding
        token = step_token(groups, self.state, self.defaults) if binding is None else None
        self._validate_changed_groups()  # option values: every step (schedules change them)
        if not same_token(token, self.__dict__.get("_steady")):
            self._steady = None
            self._check_structure()
            self._select_kernels()
            self._steady = token  # what passed; the plan and learning caches key on it
        # Reads the commit needs that prove finiteness (by _select_kernels) run in the check.
        reductions, bounded = self.__dict__.get("_reductions"), self.__dict__.get("_bounded")
        sums = {} if amp_present else check_finite_gradients(groups, reductions, bounded)
        self._gradient_sums = sums

    def gradient_presence(self) -> list[bool]:
        """Which parameters have a gradient, in group order (the vote agrees on it)."""
        return [param.grad is not None for group in self.param_groups for param in group["params"]]

    def gradient_labels(self, first_group: int = 0) -> list[str]:
        """Each parameter's label in presence order, groups numbered from ``first_group``."""
        return [label for label, _ in iter_parameters(self.param_groups, first_group)]

    def _validate_changed_groups(self) -> None:
        """§2.2 at the edges: a group's options are re-validated only when one of them changed."""
        previous = self.__dict__.get("_validated_options", {})
        self._validated_options = revalidate_changed_groups(self, previous)

    def step_header_payload(self) -> list[int] | None:
        """The payload words of docs/dist.md §9.2; None while no binding is installed."""
        return None if self._binding is None else scope_header_payload(self)

    def exchange_step_headers(self, op: GuardedOperation, payload: Any) -> None:
        """Scoped: the step's operation header (docs/dist.md §9.3 step 3)."""
        if op.binding is not None and payload is not None:
            op.header(OP_STEP, payload, HEADER_WORD_NAMES)

    # -- post-sharding finalization (§13) ---------------------------------------------------

    def _check_finalized_layout(self) -> None:
        finalized = self._finalized
        if finalized is not None and not finalized.layout_intact(self.param_groups):
            raise RuntimeError(f"{self.OWNER_NAME}: parameter layout changed after post_sharding")

    def prepare_post_sharding(
        self,
        rebindings: Iterable[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        codebook_process_group: CodebookProcessGroupBinding | None = None,
    ) -> PreparedFinalization:
        """Preconditions and validation of §13, no mutation; ``commit()`` publishes."""
        return prepare_finalization(
            self, rebindings, manifest, codebook_process_group, self.POST_SHARDING_LAYOUTS
        )

    def post_sharding(
        self,
        rebindings: Iterable[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        codebook_process_group: CodebookProcessGroupBinding | None = None,
    ) -> None:
        """Tell the optimizer, once, what each slot has become (docs/core.md §13)."""
        prepared = self.prepare_post_sharding(
            rebindings, manifest=manifest, codebook_process_group=codebook_process_group
        )
        prepared.commit()

    @property
    def finalized(self) -> Finalized | None:
        """The post-sharding layout, or None before ``post_sharding``."""
        return self._finalized

    @property
    def binding(self) -> ProcessGroupBinding | None:
        """The codebook binding ``post_sharding`` installed, or None."""
        return self._binding

    def publish_finalization(self, finalized: Finalized, groups: list[Any]) -> None:
        """``post_sharding``'s publication, assignment only: groups, placeholders, layout."""
        state: dict[Tensor, Any] = {}
        for group, (params, names) in zip(self.param_groups, groups, strict=True):
            group["params"], group["param_names"] = params, names
            for param in params:
                state[param] = {"period": 0}
        self.state.clear()
        self.state.update(state)
        self._binding = finalized.binding
        self._finalized = finalized
        self._steady = None

    def check_step_agreement(self) -> None:
        """Symmetric agreement checks after the vote: none for Gefen."""

    def apply_prepared_step(self, *, operation: GuardedOperation | None = None) -> None:
        """Phases 4–5 only: stage (collectives allowed), then commit. A commit failure latches,
        and so does a staging failure across ranks (``latch_unvoted_failure``)."""
        op = operation if operation is not None else self.guarded_operation()
        grad_enabled = torch.is_grad_enabled()
        set_grad_enabled(False)  # torch.no_grad() without its Python context-manager calls
        try:
            learning = self._stage_step_learning(op)
            if learning.noop:
                return
            plan = self._prepare_step(op, learning)
            self._commit(learning, plan)
        except BaseException as error:
            if not self._commit_failed:  # phase 4: nothing written, but perhaps on one rank
                self.latch_unvoted_failure(op, error)
            raise
        finally:
            set_grad_enabled(grad_enabled)

    # -- the step template (§7.1) -----------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return amp_scaling_supported(self.param_groups, self.step_failure_scope())

    def step(self, *args: Any, **kwargs: Any) -> Any:  # step(closure=None)
        """One transactional step (§7.1); returns the closure's loss or None."""
        return run_step(self, args, kwargs)

    step.__signature__ = STEP_SIGNATURE  # type: ignore[attr-defined]

    # -- codebook learning and refresh (§5.5, §5.6; scoped: docs/dist.md §9.3–§9.5) ------------

    @property
    def uses_codebook(self) -> bool:
        """True iff some group keeps codebook momentum (they share the one codebook)."""
        for group in self.__dict__.get("param_groups") or [self.defaults]:  # a loop: per step
            if group_uses_codebook(group):
                return True
        return False

    def _stage_step_learning(self, op: GuardedOperation) -> StagedLearning:
        """§5.5–§5.6 learning; skipped while token and codebook are an idle step's, none due."""
        steady, codebook = self.__dict__.get("_steady"), self._codebook
        due = codebook_ops.refresh_due(self)
        if steady is not None and steady[2].get("idle", op) is codebook and not due:
            return StagedLearning()
        learning = codebook_ops.stage_step_learning(self, op)
        nothing = not (learning.noop or learning.periods or learning.codebook is not None)
        # never idle while a codebook is to be learned: zero gradients may turn non-zero
        if steady is not None and nothing and (codebook is not None or not self.uses_codebook):
            steady[2]["idle"] = codebook
        elif steady is not None:
            steady[2].pop("idle", None)
        return learning

    def _commit(self, learning: StagedLearning, plan: Any) -> None:
        """Phase 5: publish, update, count, renote. Any failure latches (§7.4)."""
        # no call while nothing is handed out; a hybrid's child renotes its hybrid's note
        kept = self.current_note() if self.hand_out_note or self._composite else None
        self.publish_learning(learning)
        try:
            self._commit_step(plan)
            self._global_step += 1
        except BaseException:
            self.latch_failed_commit(kept)
            raise
        if kept:  # the step's own writes are no foreign ones to what state_dict() handed out
            self.renote(kept)

    def publish_learning(self, learning: StagedLearning) -> None:
        """Write what learning staged (periods, remapped codes, codebook) for a step, an
        ``initialize_codebook`` or a ``refresh_codebook``; a failure part-way latches."""
        if not learning.periods and learning.remap is None and learning.codebook is None:
            return
        kept = self.note_commit()
        try:
            codebook_ops.publish(self, learning)
            if learning.codebook is not None:
                self._codebook = learning.codebook
            self.renote(kept)
        except BaseException:
            self.latch_failed_commit(kept)
            raise

    def initialize_preamble(self) -> list[int] | None:
        """The rank-local checks ``initialize_codebook`` votes on; the header payload."""
        self.check_latch()
        self._validate_changed_groups()  # the options it learns under, as the step's preflight
        self._check_structure()
        check_learnable_gradients(self.param_groups)
        return self.step_header_payload()

    def initialize_codebook(self) -> bool:
        """Learn the codebook from the current gradients without stepping (§2.4, §5.5)."""
        return codebook_ops.initialize(self)

    def refresh_preamble(self) -> list[int] | None:
        """The rank-local checks ``refresh_codebook`` votes on; the header payload."""
        self.check_latch()
        self._check_finalized_layout()  # before the codebook: a replaced parameter says so first
        if not self.uses_codebook or self._codebook is None:
            raise RuntimeError("refresh_codebook: no codebook has been learned")
        self._validate_changed_groups()  # a group edited to the other codec would size it
        self._check_structure()
        check_learnable_gradients(self.param_groups)
        return self.step_header_payload()

    def refresh_codebook(self) -> bool:
        """The refresh transaction of §5.6 on demand; True iff the codebook was replaced."""
        return codebook_ops.refresh(self)

    def state_nbytes(self) -> int:
        """Persistent state bytes (§2.4): every entry tensor, plus 1024 with a codebook; pure."""
        return entries_nbytes(self.state.values()) + (1024 if self._codebook is not None else 0)

    @property
    def global_step(self) -> int:
        """Committed steps (§3.1)."""
        return self._global_step

    @property
    def commit_count(self) -> int:
        return self._commits + self._global_step  # a step's commit advances the global step

    @property
    def codebook(self) -> Tensor | None:
        """The learned fp32 codebook (256 values, 16 for codebook4), or None."""
        return self._codebook

    def saved_codebooks(self, incoming: object) -> list[tuple[Tensor, Tensor]]:
        """Each learned codebook ``incoming`` holds, beside the live one (``check_not_stale``)."""
        return saved_codebooks(incoming, self._codebook)

    # -- checkpoints (§8) -------------------------------------------------------------------

    def state_dict(self, *, checkpoint_binding: object = None) -> dict[str, Any]:
        """torch's layout plus the extras (§8.1) after one voted preflight of the binding and of
        options edited since the step (a codec edited after its state exists fails there)."""
        self._check_finalized_layout()
        op = self.guarded_operation()
        op.local(PHASE_STATE_DICT_PREFLIGHT, self._check_state_to_save, checkpoint_binding)
        return state_dict_with_hooks(  # type: ignore[no-any-return]
            self,
            lambda: build_state_dict(self, self._build_state_entries(self.guarded_operation())),
        )

    def _check_state_to_save(self, checkpoint_binding: object) -> None:
        self._check_checkpoint_binding(checkpoint_binding)
        self._validate_changed_groups()
        self._check_local_inputs()

    def prepare_load_state_dict(self, sd: Mapping[str, Any]) -> PreparedLoad:
        """Stage and validate a load on shadow objects; mutates nothing (§8.2)."""
        self._check_finalized_layout()
        return prepare_load(self, sd)

    def publish_load(
        self,
        state: defaultdict[Tensor, Any],
        param_groups: list[dict[str, Any]],
        global_step: int,
        codebook: Tensor | None,
    ) -> None:
        """The load transaction's publication (assignment only); clears the latch. What was
        derived from the replaced entries goes with them (the token's plan, the signatures)."""
        self.state, self.param_groups = state, param_groups
        self._global_step, self._codebook = global_step, codebook
        self._commit_failed, self._steady, self._matched_entries = False, None, {}

    def _check_checkpoint_binding(self, checkpoint_binding: object) -> None:
        """Gefen: it must match the installed codebook binding; GefenMuon overrides."""
        check_checkpoint_binding(checkpoint_binding, self._binding)

    def _checked_prepare(self, sd: Mapping[str, Any], checkpoint_binding: object) -> PreparedLoad:
        self._check_checkpoint_binding(checkpoint_binding)
        return self.prepare_load_state_dict(sd)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], *, checkpoint_binding: object = None
    ) -> None:
        """Prepare (voted as "load validation"), agree, commit, then the post-hooks (§8.2)."""
        run_load(self, lambda: self._checked_prepare(state_dict, checkpoint_binding), state_dict)

    # -- pickling and copies (§2.4) ---------------------------------------------------------

    def _restore_derived(self) -> None:
        self._kernels = KernelSelector()
        self._steady = None
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        self._warned_capturable_if_run_uncaptured = True


OptimizerShell.step.hooked = True  # type: ignore[attr-defined]
