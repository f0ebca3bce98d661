"""``GefenMuonHybrid``: one optimizer for a whole model (docs/hybrid.md).

2-D hidden matrices go to a ``GefenMuon`` child, everything else to a ``Gefen`` or
``torch.optim.AdamW`` backup. The hybrid runs the shared step and load transactions of
``gefen.core.transaction`` once, over both children: one preflight voted over the union failure
scope, one AMP decision, then each child's prepared phases 4–5.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from gefen.contracts import OptimizerContract, ShardingManifest
from gefen.core import ParameterRebinding
from gefen.core.extension import (
    STEP_SIGNATURE,
    HookedStepState,
    OptimizerShell,
    amp_scaling_supported,
    local_tensor,
    run_load,
    run_step,
)
from gefen.dist import (
    Channel,
    CodebookProcessGroupBinding,
    GuardedOperation,
    collect_failure_scope,
    cuda_graph_capturing,
)
from gefen.dist.codebook_scope import HEADER_WORD_NAMES, OP_STEP
from gefen.dist.torch_internals import HOOK_REGISTRIES, fresh_hook_registries, state_dict_with_hooks
from gefen.hybrid.adamw_participant import AdamWParticipant, ChildParticipant, PreparedChildLoad
from gefen.hybrid.checkpoint import build_hybrid_state_dict, prepare_hybrid_load
from gefen.hybrid.composite import child_presence_mask, children_labels
from gefen.hybrid.construction import (
    HybridConfig,
    backup_child,
    build_children,
    check_disjoint,
    check_new_backup_group,
    muon_child,
    own_tensor_options,
    resolve_groups,
)
from gefen.hybrid.finalization import children_binding, forward_post_sharding
from gefen.hybrid.flat_layout import child_view
from gefen.hybrid.group_form import follow_scheduled_momentum, renumber_groups, split_groups
from gefen.hybrid.state_view import HybridState
from gefen.muon import GefenMuon

__all__ = ["GefenMuonHybrid"]


def _distinct(params: Any) -> list[Tensor]:
    """The group's tensors without repeats, in first-listed order (by identity)."""
    seen: dict[int, Tensor] = {}
    for param in params:
        seen.setdefault(id(param), param)
    return list(seen.values())


class GefenMuonHybrid(HookedStepState, torch.optim.Optimizer):
    """Muon for hidden matrices, Gefen (or AdamW) for the rest, as one torch optimizer.

    Routing (docs/hybrid.md §4): every 2-D hidden matrix goes to a ``GefenMuon`` child (the
    algorithm of ``GefenMuon``); embeddings, heads, norms, biases and anything matching
    ``backup_substrings`` go to the backup, a ``Gefen`` (default) or ``torch.optim.AdamW``
    (``backup_optimizer="adamw"``). One ``step()`` is one transaction over both children: one
    preflight (each child's checks, the AdamW backup's options included) voted once, one AMP
    decision, then Muon's streamed commit and the backup's; a failure in either commit latches
    the hybrid. ``lr`` is the backup's; ``muon_lr`` defaults to it with
    ``adjust_lr_fn="match_rms_adamw"`` so AdamW learning rates and weight decay carry over.
    ``momentum_codec`` is the Muon child's codec and ``backup_momentum_codec`` the Gefen
    backup's (``"codebook4"`` for both: about 0.55 byte of state per parameter). NorMuon is on
    by default (``normuon=False`` is torch Muon's update): on the harness it lowers held-out loss
    by about 2% for one fp32 per matrix row (docs/hybrid.md).
    The checkpoint is torch's flat ``{"state", "param_groups"}`` over both children, with their
    extras under ``"gefen_hybrid"`` (``gefen.hybrid.flat_layout``).

    ``muon_named_params`` is a module, ``(name, parameter)`` pairs, the Muon list of the
    two-list form (``backup_named_params`` the other), or torch-style param-group dicts with a
    ``use_muon`` flag (``gefen.hybrid.group_form``); ``add_param_group`` routes as they do.
    """

    OWNER_NAME: ClassVar[str] = "GefenMuonHybrid"
    _PICKLED_ATTRIBUTES: ClassVar[tuple[str, ...]] = (
        *("muon", "backup", "backup_optimizer", "_check_finite", "_commit_failed", "_config"),
        *HOOK_REGISTRIES,
    )

    def __init__(
        self,
        muon_named_params: Any,
        backup_named_params: Any = None,
        *,
        lr: float = 1e-3,
        muon_lr: float | None = None,
        backup_lr: float | None = None,
        weight_decay: float = 0.0,
        muon_weight_decay: float | None = None,
        backup_weight_decay: float | None = None,
        backup_optimizer: str = "gefen",
        backup_substrings: Sequence[str] | None = None,
        no_decay_substrings: Sequence[str] = (),
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        backup_1d_period_one: bool = False,
        backup_2d_period_one: bool = False,
        backup_adamw_kwargs: Mapping[str, Any] | None = None,
        backup_factored_v_2d: bool = True,
        backup_factored_floor: bool = True,
        backup_nesterov: bool = False,
        backup_momentum_codec: str = "codebook8",
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_schedule: Any = "standard",
        adjust_lr_fn: str | None = "match_rms_adamw",
        muon_eps: float = 1e-7,
        momentum_codec: str = "codebook8",
        sharded_mode: str = "exact",
        normuon: bool = True,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        fused: bool | None = None,
        stochastic_round: bool = False,
        deterministic: bool = False,
        check_finite: bool = True,
    ) -> None:
        options = dict(locals())
        config = HybridConfig.from_options(options)
        muon_groups, backup_groups = resolve_groups(
            config, muon_named_params, backup_named_params, backup_substrings
        )
        muon, backup = build_children(config, muon_groups, backup_groups)
        self._config = config
        self.muon: GefenMuon | None = muon
        self.backup: torch.optim.Optimizer | None = backup
        own_tensor_options(self.param_groups)
        self.backup_optimizer = backup_optimizer
        self._check_finite = check_finite
        self._commit_failed = False
        fresh_hook_registries(self)
        self.rebuild_registry()

    @classmethod
    def from_model(
        cls, model: nn.Module, *, lr: float = 1e-3, backup_substrings: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> GefenMuonHybrid:  # fmt: skip
        """Route ``model``'s trainable parameters (module form) and build the hybrid."""
        return cls(model, lr=lr, backup_substrings=backup_substrings, **kwargs)

    # -- children, registry and the torch-facing surface -------------------------------------

    @property
    def children(self) -> tuple[torch.optim.Optimizer, ...]:
        """The present children, Muon first."""
        return tuple(child for child in (self.muon, self.backup) if child is not None)

    def _roles(self) -> tuple[tuple[str, torch.optim.Optimizer], ...]:
        pairs = (("muon", self.muon), ("backup", self.backup))
        return tuple((role, child) for role, child in pairs if child is not None)

    def rebuild_registry(self) -> None:
        """Derived data (never pickled): who owns each parameter, and each child's layout."""
        owners: dict[Tensor, torch.optim.Optimizer] = {}
        snapshots = []
        for role, child in self._roles():
            groups = tuple(tuple(group["params"]) for group in child.param_groups)
            snapshots.append((role, child, groups))
            if isinstance(child, HookedStepState):
                child.hand_out_within(self)  # one note, the hybrid's: its dict holds theirs
            for group in groups:
                for param in group:
                    owners[param] = child
        self._registry: Mapping[Tensor, torch.optim.Optimizer] = MappingProxyType(owners)
        self._snapshots = tuple(snapshots)
        self._state_view = HybridState(self)
        self._participants = tuple(
            (role, self._participant(child)) for role, child in self._roles()
        )

    def _participant(self, child: torch.optim.Optimizer) -> ChildParticipant:
        if child is self.backup and self.backup_optimizer == "adamw":
            return AdamWParticipant(child, self.OWNER_NAME, check_finite=self._check_finite)
        return cast(ChildParticipant, child)  # Gefen and GefenMuon are participants as they are

    @property
    def participants(self) -> tuple[tuple[str, ChildParticipant], ...]:
        """(role, participant) of each present child, Muon first: what the step and load run."""
        return self._participants

    def saved_codebooks(self, incoming: object) -> list[tuple[Tensor, Tensor]]:
        """The Gefen children's pairs, each read from its part of the flat dict."""
        shells = [(role, c) for role, c in self._roles() if isinstance(c, OptimizerShell)]
        return [
            pair for role, c in shells for pair in c.saved_codebooks(child_view(incoming, role))
        ]

    def owner_of(self, key: object) -> torch.optim.Optimizer | None:
        """The child that owns parameter ``key``, or None."""
        if not isinstance(key, Tensor):
            return None
        return self._registry.get(key)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """A new list of the children's live group dicts: Muon's, then the backup's."""
        return [group for child in self.children for group in child.param_groups]

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise TypeError(
            "GefenMuonHybrid.param_groups cannot be assigned; wrappers that replace "
            "param_groups (e.g. DeepSpeed ZeRO) are not supported"
        )

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.children[0].defaults

    @property
    def state(self) -> HybridState:  # type: ignore[override]
        return self._state_view

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.children:
            child.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``: the group is split as the constructor splits one
        (``use_muon``, else the routing rules) and each part joins its child (a child the
        hybrid lacks is built); all or nothing."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        if self.finalized:
            raise RuntimeError(f"{self.OWNER_NAME} is finalized by post_sharding: "
                               "add_param_group is refused")  # fmt: skip
        config: HybridConfig = self._config
        existing = self.param_groups
        taken = {
            name: param
            for group in self.param_groups
            if "param_names" in group
            for name, param in zip(group["param_names"], group["params"], strict=True)
        }
        parts = split_groups(
            [param_group],
            config.backup_substrings,
            first_index=len(self.param_groups),
            taken=taken,
        )
        check_disjoint([{"params": list(self._registry)}], [*parts[0], *parts[1]])  # new ones
        check_disjoint(parts[0], parts[1])  # and in one child only
        added: list[tuple[str, torch.optim.Optimizer | None]] = []
        try:
            for role, groups, build in (
                ("muon", parts[0], muon_child),
                ("backup", parts[1], backup_child),
            ):
                child = getattr(self, role)
                with self.numbering(int(role == "backup" and self.muon is not None)):
                    if groups and child is None:
                        setattr(self, role, build(config, groups))
                        added.append((role, None))
                    elif groups:
                        child.add_param_group(groups[0])
                        added.append((role, child))
                        if role == "backup":
                            check_new_backup_group(config, child, len(child.param_groups) - 1)
        except BaseException:
            for role, child in reversed(added):
                if child is None:
                    setattr(self, role, None)
                else:
                    for param in child.param_groups.pop()["params"]:
                        child.state.pop(param, None)
            raise
        if ("muon", None) in added and self.muon is not None and self.backup is not None:
            # the hybrid's own (non-tensor) state keys live in the first child's state (§5)
            for key in [key for key in self.backup.state if not isinstance(key, torch.Tensor)]:
                self.muon.state[key] = self.backup.state.pop(key)
        own_tensor_options(self.param_groups, existing)
        self.rebuild_registry()

    def __repr__(self) -> str:
        sizes = {c: sum(len(g["params"]) for g in c.param_groups) for c in self.children}
        muon, backup = (sizes[c] if c else 0 for c in (self.muon, self.backup))
        return (
            f"GefenMuonHybrid(muon_params={muon}, backup_params={backup}, "
            f"backup_optimizer={self.backup_optimizer!r})"
        )

    # -- the composite step protocol (docs/hybrid.md §6–§7) ------------------------------------

    def step_failure_scope(self) -> tuple[Channel, ...]:
        """The children's codebook binding's scope, else the union scope of both children's
        groups; pure."""
        binding = children_binding(self)
        if binding is not None:
            return binding.failure_scope()
        return collect_failure_scope(self.param_groups)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return amp_scaling_supported(self.param_groups, self.step_failure_scope())

    def guarded_operation(self) -> GuardedOperation:
        if children_binding(self) is not None:
            return GuardedOperation(self.OWNER_NAME, binding_getter=lambda: children_binding(self))
        return GuardedOperation(self.OWNER_NAME, scope=self.step_failure_scope())

    # -- post-sharding (§6) -------------------------------------------------------------------

    def post_sharding(
        self,
        rebindings: Iterable[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        codebook_process_group: CodebookProcessGroupBinding | None = None,
    ) -> None:
        """Forward docs/core.md §13 to both children as one staged transaction."""
        forward_post_sharding(self, rebindings, manifest, codebook_process_group)

    @property
    def finalized(self) -> bool:
        """Whether ``post_sharding`` has finalized the children."""
        children = self.gefen_children()
        return bool(children) and all(child.finalized is not None for child in children)

    def check_layout(self) -> None:
        """Raise when a child's groups no longer hold the tensors they held at construction.
        A group may list one of its own parameters again (edited in place, as torch allows):
        each group is compared by its distinct tensors, in order."""
        for role, child, groups in self._snapshots:
            live = child.param_groups
            for index, expected in enumerate(groups):
                params = _distinct(live[index]["params"]) if index < len(live) else []
                for position, param in enumerate(_distinct(expected)):
                    if position >= len(params) or params[position] is not param:
                        raise RuntimeError(
                            "GefenMuonHybrid parameter layout changed after construction: "
                            f"{role} group {index} position {position} holds a different tensor"
                        )
            if len(live) != len(groups) or any(
                len(_distinct(group["params"])) != len(_distinct(expected))
                for group, expected in zip(live, groups, strict=True)
            ):
                raise RuntimeError(
                    f"GefenMuonHybrid parameter layout changed after construction: {role} "
                    "groups were added, removed or resized"
                )

    @property
    def commit_count(self) -> int:
        """Its own commits and its children's (a child's codebook refresh writes its state)."""
        return self._commits + sum(getattr(child, "commit_count", 0) for child in self.children)

    def check_latch(self) -> None:
        super().check_latch()
        self.check_layout()

    def validate_step_inputs(self, *, amp_present: bool) -> None:
        """Rank-local, no collective: layout, the backup's scheduled beta1, each child's checks
        (the one write: backup ``betas`` follow a scheduler's ``momentum``, undone when a check
        refuses the step)."""
        self.check_layout()
        groups = self.backup.param_groups if self.backup is not None else []
        before = [group.get("betas") for group in groups]
        try:
            first = len(self.param_groups) - len(groups)  # the backup's, after Muon's
            followed = follow_scheduled_momentum(groups, self.__dict__.get("_followed", {}), first)
            for index, (_, participant) in enumerate(self._participants):
                with self.numbering(index):
                    participant.validate_step_inputs(amp_present=amp_present)
        except BaseException:
            for group, betas in zip(groups, before, strict=True):  # a refused step writes nothing
                if betas is not None:
                    group["betas"] = betas
            raise
        self._followed = followed

    def gradient_presence(self) -> list[bool]:
        """Each child's presence pattern, Muon first (what the step vote agrees on)."""
        return [flag for _, child in self._participants for flag in child.gradient_presence()]

    def gradient_labels(self) -> list[str]:
        return children_labels(self)

    def gefen_children(self) -> tuple[OptimizerShell, ...]:
        """The children that are Gefen optimizers (they carry a codebook binding)."""
        return tuple(child for child in self.children if isinstance(child, OptimizerShell))

    def step_header_payload(self) -> tuple[int, list[list[int]]] | None:
        """With a codebook binding: the child-presence mask and each present child's payload."""
        payloads = [child.step_header_payload() for _, child in self._participants]
        if not payloads or any(payload is None for payload in payloads):
            return None
        return child_presence_mask(self), [payload for payload in payloads if payload is not None]

    def exchange_step_headers(self, op: GuardedOperation, payload: Any) -> None:
        """docs/dist.md §9.3: the child-presence header first, then one header per child."""
        if op.binding is None or payload is None:
            return
        mask, children = payload
        op.header(OP_STEP, [mask], ["child_presence"])
        for words in children:
            op.header(OP_STEP, words, HEADER_WORD_NAMES)

    def check_step_agreement(self) -> None:
        for index, (_, participant) in enumerate(self._participants):
            with self.numbering(index):
                participant.check_step_agreement()

    @contextlib.contextmanager
    def numbering(self, index: int) -> Iterator[None]:
        """Participant ``index``'s errors with its groups numbered as the hybrid's: a child's
        message names an unnamed parameter by its own ``param_groups[g][i]``, and the hybrid's
        groups list the Muon child's first."""
        try:
            yield
        except Exception as error:
            renumber_groups(error, sum(len(c.param_groups) for c in self.children[:index]))
            raise

    def apply_prepared_step(self, *, operation: GuardedOperation | None = None) -> None:
        """Phases 4–5 child by child (Muon first). A failure once a commit began latches the
        hybrid; one in the first child's read-only phase 4 leaves it as it was in one process,
        and latches it across ranks (``latch_unvoted_failure``)."""
        op = operation if operation is not None else self.guarded_operation()
        done, kept = 0, self.current_note()  # kept: what state_dict() handed out, if current
        self.writing_children = True  # they leave the note to this step's one renote
        try:
            with torch.no_grad():
                for _, participant in self._participants:
                    with self.numbering(done):
                        participant.apply_prepared_step(operation=op)
                    done += 1
            self._commits += 1  # its commit_count: an AdamW backup counts no step of its own
        except BaseException as error:
            # a Gefen child says whether its own commit failed; AdamW's step is all commit
            if done > 0 or getattr(self._participants[done][1], "live_values_refusal", True):
                self.latch_failed_commit(kept)
            else:  # the first child's phase 4: nothing written, but perhaps on one rank alone
                self.latch_unvoted_failure(op, error)
            raise
        finally:
            self.writing_children = False
        self.renote(kept)  # the children's writes are the hybrid's own, no foreign ones

    def step(self, *args: Any, **kwargs: Any) -> Any:  # step(closure=None)
        """One transactional step over both children; returns the closure's loss or None."""
        params = [local_tensor(p) for group in self.param_groups for p in group["params"]]
        if cuda_graph_capturing(params):
            raise RuntimeError("GefenMuonHybrid does not support CUDA graph capture")
        return run_step(self, args, kwargs)

    step.__signature__ = STEP_SIGNATURE  # type: ignore[attr-defined]

    # -- checkpoints (§8) ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return state_dict_with_hooks(self, lambda: self.hand_out(build_hybrid_state_dict(self)))  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Atomic over both children: prepare (voted), agree, commit, post-hooks."""
        run_load(self, lambda: prepare_hybrid_load(self, state_dict), state_dict)

    def publish_load(
        self, muon: PreparedChildLoad | None, backup: PreparedChildLoad | None
    ) -> None:
        """The load's publication: each child's staged load, then the latch clears."""
        for child_load in (muon, backup):
            if child_load is not None:
                child_load.commit()
        self._commit_failed = False

    # -- contract (§9) ------------------------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        from gefen.hybrid.contract import hybrid_contract

        return hybrid_contract(self)

    # -- pickling and copies ------------------------------------------------------------------

    def _restore_derived(self) -> None:
        self.rebuild_registry()


GefenMuonHybrid.step.hooked = True  # type: ignore[attr-defined]
