"""``GefenMuon``: Muon for 2-D matrices with 8-bit codebook momentum (docs/muon.md).

The step and load transactions, codebook learning, the latch and the hooks are the shell's
(``gefen.core.shell.OptimizerShell``); this class supplies the options, the per-parameter
state codec, the per-mode update and the distributed consolidation of checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from gefen.contracts import OptimizerContract, ParameterLayout
from gefen.core.extension import (
    STEP_SIGNATURE,
    CodebookInput,
    CodecKeys,
    EntrySpec,
    MomentumAdvancer,
    OptimizerShell,
    StagedLearning,
    allocate_entry,
    check_group_codec,
    check_optimizer_wide,
    check_torch_flags,
    codes_per_byte,
    eager_advance_momentum_,
    group_uses_codebook,
    is_dtensor,
    is_initialized,
    local_tensor,
    row_period,
    run_step,
)
from gefen.dist import GuardedOperation, cuda_graph_capturing
from gefen.muon.kernels import STANDARD_TRIPLE, adjust_lr_ratio, local_slice_of_full
from gefen.muon.modes import (
    APPROX,
    DISTRIBUTED,
    EXACT,
    PLAIN,
    broadcast_update,
    distributed_slots,
    full_gradient,
    parameter_mode,
    quantized_shape,
)
from gefen.muon.momentum_kernels import MomentumKernels
from gefen.muon.options import (
    MUON_OPTIMIZER_WIDE,
    check_mode_mix,
    check_schedule_steps,
    normalise_schedule_steps,
    validate_muon_options,
)
from gefen.muon.plan import OwnerBucket, PlannedMatrix, group_hyper, stochastic_seed
from gefen.muon.preflight import check_presence_and_order, uncovered_labels, uncovered_presence
from gefen.muon.rows import approx_row_sharded, assembles_rows, presents_rows
from gefen.muon.update import MuonHyper, apply_update_, orthogonal_update_

__all__ = ["GefenMuon"]

_MUON_CODEC_KEYS = CodecKeys(dense="momentum_buffer")
_POST_SHARDING_LAYOUTS = (ParameterLayout.REPLICATED, ParameterLayout.WHOLE_PARAMETER_OWNER)


class GefenMuon(OptimizerShell):
    r"""Muon (momentum → Newton–Schulz → shape-scaled step) with ~1 byte of momentum per element.

    For each 2-D parameter with a gradient :math:`g_t` (docs/muon.md §4):

    .. math::
        \begin{aligned}
        &\hat m_t = \mathrm{dec}\big(\mathrm{enc}\big(\mathrm{lerp}(\hat m_{t-1}, g_t,
            1-\mu)\big)\big) \quad (\texttt{momentum\_codec="codebook8"}; \text{ a plain
            buffer with } \texttt{"none"}) \\
        &N = \mathrm{lerp}(g_t, \hat m_t, \mu) \text{ if nesterov else } \hat m_t \\
        &O = \mathrm{NS}(N):\ X \leftarrow N/\lVert N\rVert_F \text{ (bf16)}, \\
        &\quad X \leftarrow aX + b(XX^\top)X + c(XX^\top)^2X \text{ per } (a, b, c) \\
        &p_t = p_{t-1}(1-\gamma\lambda) - \gamma\, r(\text{shape})\, O
        \end{aligned}

    with :math:`r = \sqrt{\max(1, \text{rows}/\text{cols})}` (``adjust_lr_fn=None``) or
    :math:`0.2\sqrt{\max(\text{rows}, \text{cols})}` (``"match_rms_adamw"``). NorMuon
    optionally rescales the rows of :math:`O` by a second-moment EMA of their norms. With
    ``momentum_codec="none"`` the step is bit-identical to ``torch.optim.Muon``. The first nine
    arguments match ``torch.optim.Muon``; the package README lists the rest (Newton–Schulz
    schedules, sharded modes under FSDP2, NorMuon, stochastic rounding).
    """

    OWNER_NAME: ClassVar[str] = "GefenMuon"
    CHECKPOINT_OWNER: ClassVar[str] = "GefenMuon"  # a subclass keeps it (see Gefen's)
    OPTIMIZER_WIDE: ClassVar[tuple[str, ...]] = MUON_OPTIMIZER_WIDE
    CODEC_KEYS: ClassVar[CodecKeys] = _MUON_CODEC_KEYS
    TEMPLATE_COMPLETE: ClassVar[bool] = True
    OPTIONAL_EXTRAS: ClassVar[tuple[str, ...]] = ("scope", "muon_distributed", "rank_local")
    # The manifest describes a consolidated save to a plain load; through DCP it would make a
    # distributed optimizer's template ask an exact file for it (docs/muon.md §8).
    TOP_LEVEL_EXTRAS: ClassVar[tuple[str, ...]] = ("muon_distributed",)
    REQUIRE_2D: ClassVar[bool] = True
    LAYOUT_OPTIONS: ClassVar[tuple[str, ...]] = ("momentum_codec", "sharded_mode")
    POST_SHARDING_LAYOUTS: ClassVar[tuple[ParameterLayout, ...]] = _POST_SHARDING_LAYOUTS

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = STANDARD_TRIPLE,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_schedule: Any = None,
        momentum_codec: str = "codebook8",
        sharded_mode: str = "exact",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        fused: bool | None = None,
        stochastic_round: bool = False,
        deterministic: bool = False,
        check_finite: bool = True,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "ns_steps": ns_steps,
            "ns_schedule": ns_schedule,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
            "momentum_codec": momentum_codec,
            "sharded_mode": sharded_mode,
            "normuon": normuon,
            "normuon_beta2": normuon_beta2,
            "normuon_eps": normuon_eps,
            "fused": fused,
            "stochastic_round": stochastic_round,
            "deterministic": deterministic,
            "check_finite": check_finite,
        }
        validate_muon_options(defaults)
        normalise_schedule_steps(defaults)
        # Momentum kernels by (device type, fused option): compiled code, never pickled.
        self._momentum_kernels = MomentumKernels()
        super().__init__(params, defaults)

    # -- options ----------------------------------------------------------------------------

    def validate_group(self, group: Mapping[str, Any]) -> None:
        check_optimizer_wide(group, self.defaults, self.OPTIMIZER_WIDE)
        check_torch_flags(group)
        validate_muon_options(group)
        check_schedule_steps(group)
        others = self.__dict__.get("param_groups") or []
        check_group_codec(group, others, self.__dict__.get("_codebook"), self.OWNER_NAME)

    def _validate_registration(self, candidate: Mapping[str, Any]) -> None:
        for param in candidate["params"]:
            if param.dim() != 2:
                raise ValueError(
                    "GefenMuon only supports 2D parameters whereas we found a parameter with "
                    f"size: {param.size()}"
                )
        check_mode_mix([*self.param_groups, candidate])
        validate_muon_options(candidate)  # then the group stores its schedule's length
        normalise_schedule_steps(candidate)  # type: ignore[arg-type]

    def _check_local_inputs(self) -> None:
        check_mode_mix(self.param_groups)
        super()._check_local_inputs()

    def gradient_presence(self) -> list[bool]:
        return uncovered_presence(self.param_groups)  # the rest is checked by name, below

    def gradient_labels(self, first_group: int = 0) -> list[str]:
        return uncovered_labels(self.param_groups, first_group)

    # -- the state codec --------------------------------------------------------------------

    def entry_spec(self, group: Mapping[str, Any], param: Tensor) -> EntrySpec:
        rows, cols = quantized_shape(group, param)
        return EntrySpec(
            numel=rows * cols,
            matrix_shape=None,
            codec_keys=self.CODEC_KEYS,
            dense_dtype=param.dtype,
            dense_shape=(rows, cols),
            second_moment=None,
            extra_pairs={
                "normuon_v": ((rows, 1), torch.float32),
                "normuon_step": ((), torch.int64),
            },
            # (B, P) codes cannot tell a (16, 8) momentum from an (8, 16) one; the width can.
            recorded_ints={"matrix_cols": cols},
            codes_per_byte=codes_per_byte(group),
        )

    def template_period(self, group: Mapping[str, Any], param: Tensor) -> int | None:
        """1 for codec "none" (the matrix as is); else one block per row of the momentum
        matrix where rows hold at least 8 elements (docs/core.md §4.1), else None (searched).
        A rank without rows of an approx matrix names the same row width as the others. An
        empty matrix: None (the search leaves it pristine)."""
        if param.numel() == 0:
            return None
        if not group_uses_codebook(group):
            return 1
        rows, cols = quantized_shape(group, param)
        return row_period((max(rows, 1) if is_dtensor(param) else rows, cols))

    def template_keys(self, group: Mapping[str, Any], param: Tensor) -> tuple[str, ...]:
        """A NorMuon group's entries create the NorMuon pair at their first update."""
        return ("normuon_v", "normuon_step") if group["normuon"] else ()

    def _learning_view(self, group: Mapping[str, Any], param: Tensor) -> Tensor | None:
        """The gradient a period and the codebook are learned from (§5); None: nothing."""
        grad = param.grad
        assert grad is not None
        mode = parameter_mode(group, param)
        if mode == APPROX:
            local = local_tensor(grad)
            return local if local.numel() > 0 else None
        if mode == "plain":
            return grad
        if not group_uses_codebook(group):
            return local_tensor(grad)  # the period is 1 whatever the view; no gather needed
        return full_gradient(grad)

    def codebook_inputs(self, operation: GuardedOperation) -> list[CodebookInput]:
        learning_codebook = self.uses_codebook and self._codebook is None
        inputs: list[CodebookInput] = []
        for index, group, param in self.indexed_params():
            if param.grad is None:
                continue
            if not learning_codebook and self.state[param].get("period", 0) != 0:
                continue  # the period is chosen once and the codebook is frozen
            view = self._learning_view(group, param)
            if view is not None:
                inputs.append((index, view, tuple(view.shape)))
        return inputs

    # -- kernels (docs/core.md §11) ----------------------------------------------------------

    def _restore_derived(self) -> None:
        super()._restore_derived()
        self._momentum_kernels = MomentumKernels()

    def _select_kernels(self) -> None:
        """The local preflight's selection: every group and device a codebook momentum will
        run on, and the float64 gradients bounded by float32's range (NS runs in bfloat16)."""
        bounded: dict[int, bool] = {}
        for _, group, param in self.indexed_params():
            if param.grad is not None and group_uses_codebook(group):
                self._momentum_kernels.select(group, local_tensor(param).device.type)
            if param.grad is not None and param.dtype == torch.float64:
                bounded[id(param)] = False
        self._bounded = bounded

    # -- phase 4: read-only plan -------------------------------------------------------------

    def _prepare_step(self, operation: GuardedOperation, learning: StagedLearning) -> Any:
        """Phase 4: which matrices update, in which order, with what scalars; reads only.

        The plan is a list of units, committed in order: one ``PlannedMatrix`` per plain, approx or
        exact matrix (parameter order), then one ``OwnerBucket`` per ``world`` active parameters
        of each distributed process group. It holds no tensor proportional to the model (only
        references to the parameters themselves); tensor lrs are read once per group.
        """
        hypers: dict[int, MuonHyper] = {}

        def planned(
            index: int, group: Mapping[str, Any], param: Tensor, mode: str
        ) -> PlannedMatrix:
            hyper = hypers.get(id(group))
            if hyper is None:
                hyper = hypers[id(group)] = group_hyper(group)
            return PlannedMatrix(
                index=index,
                group=group,
                param=param,
                mode=mode,
                period=int(learning.periods.get(index, self.state[param].get("period", 0))),
                hyper=hyper,
                ratio=adjust_lr_ratio(group["adjust_lr_fn"], tuple(param.shape)),
                seed=stochastic_seed(self._global_step, index, group, param, mode),
            )

        # an empty matrix has nothing to update and stays pristine, as in Gefen (numel is global
        # for a DTensor, so every rank skips the same ones)
        indexed = [item for item in self.indexed_params() if item[2].numel() > 0]
        slots = distributed_slots(indexed)
        distributed = {slot.index for per_group in slots for slot in per_group}
        # no codebook yet (its groups' gradients were all zero): they wait (docs/core.md §5.5)
        waiting = self.codebook is None and learning.codebook is None
        stepped = {id(g) for g in self.param_groups if not (waiting and group_uses_codebook(g))}
        plan: list[PlannedMatrix | OwnerBucket] = []
        for index, group, param in indexed:
            if param.grad is None or index in distributed or id(group) not in stepped:
                continue
            mode = parameter_mode(group, param)
            if mode == APPROX and local_tensor(param).numel() == 0:
                continue  # an empty approx shard has nothing to update (and no collective)
            plan.append(planned(index, group, param, mode))
        for per_group in slots:
            active = [s for s in per_group if s.param.grad is not None and id(s.group) in stepped]
            world = active[0].world if active else 1
            for start in range(0, len(active), world):
                bucket = active[start : start + world]
                plan.append(
                    OwnerBucket(
                        tuple(
                            (slot, planned(slot.index, slot.group, slot.param, DISTRIBUTED))
                            for slot in bucket
                        )
                    )
                )
        return plan

    # -- phase 5: streamed commit -----------------------------------------------------------

    def _live_entry(self, planned: PlannedMatrix, device: torch.device) -> dict[str, Any]:
        """The parameter's own entry: a pristine one is allocated just before its first update;
        an initialized one keeps its tensors, moved to ``device`` only where needed."""
        entry: dict[str, Any] = self.state[planned.param]
        if not is_initialized(entry):
            spec = self.entry_spec(planned.group, planned.param)
            fresh = allocate_entry(
                spec, planned.period, codebook8=group_uses_codebook(planned.group), device=device
            )
            entry.clear()
            entry.update(fresh)
            return entry
        for key, value in list(entry.items()):
            if isinstance(value, Tensor) and value.device != device:
                entry[key] = value.to(device)
        return entry

    def _orthogonal_(
        self, planned: PlannedMatrix, matrix: Tensor, codebooks: dict[torch.device, Tensor]
    ) -> Tensor:
        """Steps 1–3 for one matrix: its entry updated in place; returns O."""
        device = matrix.device
        entry = self._live_entry(planned, device)
        codebook: Tensor | None = None
        advance: MomentumAdvancer | None = None
        if group_uses_codebook(planned.group):
            assert self._codebook is not None  # published by the shell before the commit
            codebook = codebooks.get(device)
            if codebook is None:
                codebook = codebooks[device] = self._codebook.to(device)
            kernel = self._momentum_kernels.select(planned.group, device.type)
            advance = kernel or eager_advance_momentum_
        return orthogonal_update_(
            entry,
            matrix,
            codebook=codebook,
            hyper=planned.hyper,
            seed=planned.seed,
            advance=advance,
        )

    def _commit_local(self, planned: PlannedMatrix, codebooks: dict[torch.device, Tensor]) -> None:
        """The plain, approx and exact paths: every rank computes the whole update it needs."""
        param, mode = planned.param, planned.mode
        grad = param.grad
        assert grad is not None
        if mode == APPROX:
            matrix = local_tensor(grad)
        elif mode == PLAIN:
            matrix = grad
        else:
            matrix = full_gradient(grad)  # every rank, empty shards too, in parameter order
        update = self._orthogonal_(planned, matrix, codebooks)
        del matrix
        if mode not in (APPROX, PLAIN):
            update = local_slice_of_full(update, param)
        apply_update_(local_tensor(param), update, hyper=planned.hyper, ratio=planned.ratio)

    def _commit_bucket(self, bucket: OwnerBucket, codebooks: dict[torch.device, Tensor]) -> None:
        """One owner bucket: gather (the owner keeps its matrix), owners compute, broadcast,
        every member writes its shard."""
        kept: dict[int, Tensor] = {}
        for slot, _ in bucket.slots:
            grad = slot.param.grad
            assert grad is not None
            full = full_gradient(grad)
            if slot.is_owner():
                kept[slot.index] = full
            del full
        computed: dict[int, Tensor] = {}
        for slot, planned in bucket.slots:
            matrix = kept.pop(slot.index, None)
            if matrix is not None:
                computed[slot.index] = self._orthogonal_(planned, matrix, codebooks)
            del matrix
        for slot, planned in bucket.slots:
            full_update = broadcast_update(computed.pop(slot.index, None), slot)
            local_update = local_slice_of_full(full_update, slot.param)
            apply_update_(
                local_tensor(slot.param), local_update, hyper=planned.hyper, ratio=planned.ratio
            )

    def _commit_step(self, plan: Any) -> None:
        """Phase 5, streamed: one matrix (or one owner bucket) at a time, its state and value
        written into their own storage before the next is touched."""
        codebooks: dict[torch.device, Tensor] = {}
        for unit in plan:
            if isinstance(unit, OwnerBucket):
                self._commit_bucket(unit, codebooks)
            else:
                self._commit_local(unit, codebooks)

    # -- the step (§6) ----------------------------------------------------------------------

    def check_step_agreement(self) -> None:
        """The collective presence/order preflight of §7 (no collective when unsharded)."""
        check_presence_and_order(self.param_groups, owner=self.OWNER_NAME)

    def step(self, *args: Any, **kwargs: Any) -> Any:  # step(closure=None)
        """One transactional step (docs/core.md §7.1); returns the closure's loss or None."""
        params = [local_tensor(p) for group in self.param_groups for p in group["params"]]
        if cuda_graph_capturing(params):
            raise RuntimeError("GefenMuon does not support CUDA graph capture")
        return run_step(self, args, kwargs)

    step.__signature__ = STEP_SIGNATURE  # type: ignore[attr-defined]

    def refresh_codebook(self) -> bool:
        """Periodic refresh is out of scope for GefenMuon (docs/muon.md §1)."""
        raise NotImplementedError("GefenMuon does not support refresh_codebook")

    # -- contract (§10) ---------------------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        """The contract of the live options (docs/muon.md §10); a pure read."""
        from gefen.muon.contract import muon_contract

        return muon_contract(self)

    # -- checkpoints (§8) -------------------------------------------------------------------

    def replicated_positions(self, groups: list[dict[str, Any]]) -> list[int] | None:
        """exact/distributed matrices hold the full logical state on every rank (a replica)."""
        modes = [parameter_mode(g, p) for g in groups for p in g["params"]]
        own = [i for i, mode in enumerate(modes) if mode in (EXACT, DISTRIBUTED)]
        return own or super().replicated_positions(groups)

    def row_sharded(self) -> bool:
        """approx state DCP reshards (docs/muon.md §8, docs/core.md §9.1; gefen.muon.rows)."""
        return approx_row_sharded(self)

    def presents_rows(self, group: Mapping[str, Any], param: Tensor) -> bool:
        """A distributed matrix's state is saved as each rank's rows (gefen.muon.rows)."""
        return presents_rows(self, group, param)

    def assembles_rows(self, group: Mapping[str, Any], param: Tensor) -> bool:
        """Exact and distributed state saved as rows is gathered at load (gefen.muon.rows)."""
        return assembles_rows(group, param)

    def rank_local_checkpoint(self) -> bool:
        approx = any(group["sharded_mode"] == APPROX for group in self.param_groups)
        return approx and len(self.step_failure_scope()) > 0

    def _check_checkpoint_binding(self, checkpoint_binding: object) -> None:
        from gefen.muon.checkpoint import check_checkpoint_binding

        check_checkpoint_binding(self, checkpoint_binding)

    def _build_state_entries(self, operation: GuardedOperation) -> dict[int, dict[str, Any]]:
        from gefen.muon.checkpoint import consolidated_entries

        return consolidated_entries(self)

    def checkpoint_extras(self, entries: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        from gefen.muon.checkpoint import manifest

        built = manifest(self, entries)
        return {} if built is None else {"muon_distributed": built}

    def stage_entries(
        self,
        saved_state: Mapping[int, Any],
        groups: list[dict[str, Any]],
        extras: Mapping[str, Any],
    ) -> dict[int, dict[str, Any]]:
        from gefen.muon.checkpoint import stage_muon_entries

        return stage_muon_entries(self, saved_state, groups, extras)
