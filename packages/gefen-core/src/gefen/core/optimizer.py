"""``Gefen``: a drop-in replacement for ``torch.optim.AdamW`` with about 1 byte of state per
parameter (docs/core.md §2, §3, §6). The step and load transactions are the shell's; this class
supplies the options, the per-parameter state codec and the update.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from gefen.contracts import LogicalSlice, OptimizerContract
from gefen.core.fused import has_fused_implementation
from gefen.core.kernels import row_period
from gefen.core.learning import CodebookInput, StagedLearning
from gefen.core.options import (
    GEFEN_OPTIMIZER_WIDE,
    check_betas,
    check_group_codec,
    check_optimizer_wide,
    check_torch_flags,
    codes_per_byte,
    group_uses_codebook,
    validate_gefen_options,
)
from gefen.core.options import lr_value as _lr_value  # module attribute: tests count reads
from gefen.core.resharding import dtensor_period, first_logical_element, row_sharded_mesh
from gefen.core.shell import OptimizerShell
from gefen.core.state import (
    CodecKeys,
    EntrySpec,
    Family,
    allocate_entry,
    entry_family,
    is_initialized,
    migrate_family,
)
from gefen.core.updaters import KernelKey, StepScalars, Updater, eager_update_
from gefen.core.validation import (
    GradientReduction,
    is_dtensor,
    local_tensor,
    parameter_label,
)
from gefen.dist import GuardedOperation

__all__ = ["Gefen"]


@dataclass(frozen=True)
class _PlannedUpdate:
    """One parameter of the plan phase 4 hands to the streamed commit (no staged tensors)."""

    param: Tensor
    group: Mapping[str, Any]
    position: tuple[int, int]  # (group index, index in the group): the label, when needed
    period: int
    updater: Updater | None  # the kernel phase 1 selected (None: the eager reference)
    local: Tensor  # the parameter's local tensor
    entry: dict[str, Any] | None  # its entry when already live (no allocation, move, migration)
    seed: tuple[int, ...] | None  # stochastic rounding's (global step, flat index, first)


@dataclass(frozen=True)
class _StepPlan:
    """Phase 4's plan: the updates in order and each group's scalars on each device its
    updates run on (by group index and device)."""

    updates: list[_PlannedUpdate]
    scalars: dict[tuple[int, Any], StepScalars]

    def __iter__(self) -> Iterator[_PlannedUpdate]:
        return iter(self.updates)


def group_step_scalars(group: Mapping[str, Any], codebook: Tensor | None = None) -> StepScalars:
    """A group's update scalars with ``codebook`` (a tensor ``lr`` is read here, one host
    sync)."""
    return StepScalars(
        lr=_lr_value(group["lr"]),
        betas=(float(group["betas"][0]), float(group["betas"][1])),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        codebook=codebook,
        factored_floor=bool(group["factored_floor"]),
        nesterov=bool(group["nesterov"]),
    )


class Gefen(OptimizerShell):
    r"""NAdamW with 8-bit codebook momentum and a block or factored second moment.

    About one byte of optimizer state per parameter (AdamW keeps eight). The algorithm, per
    parameter with a gradient :math:`g_t` (normative order and rounding: docs/core.md §6):

    .. math::
        \begin{aligned}
        &G = \mathrm{fp32}(g_t)\ \text{viewed as } B \text{ blocks of period } P
            \text{ (chosen once from the first gradient, §4)} \\
        &\textbf{second moment: } v \leftarrow \beta_2 v + (1-\beta_2)\,
            \overline{G^2}\quad (\text{one value per block, or row and column means of a
            matrix: } \hat v_{ij} = \max(v^{row}_i v^{col}_j / \overline{v^{row}},\,
            (1-\beta_2) G_{ij}^2)) \\
        &\textbf{momentum: } \hat m_t = \mathrm{dec}\big(\mathrm{enc}\big(\mathrm{lerp}
            (\mathrm{dec}(c_{t-1}, s_{t-1}), G, 1-\beta_1)\big)\big)
            \quad (c: \text{uint8 codes into the learned 256-value codebook, } s:
            \text{block absmax}) \\
        &\textbf{look-ahead (nesterov, default): } a_t = \mathrm{lerp}(\hat m_t, G,
            1-\beta_1) = \beta_1 \hat m_t + (1-\beta_1) G \quad (\text{else } a_t = \hat m_t) \\
        &p_t = p_{t-1}(1 - \gamma\lambda) - \gamma\, \frac{a_t / (1-\beta_1^t)}
            {\sqrt{v / (1-\beta_2^\tau)} + \epsilon}
        \end{aligned}

    The update builds on the re-quantized momentum :math:`\hat m_t`, which is what is stored;
    the look-ahead (NAdamW's) is applied, never stored. The codebook is learned once from the
    first gradients' histogram and refreshed every ``codebook_refresh_every`` steps.
    ``momentum_codec="none"`` keeps an fp32 momentum instead. Every hyperparameter has a default
    in ``defaults`` so ``add_param_group`` and the LR schedulers work as with AdamW; the package
    README lists the options.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr (float or 1-element Tensor): :math:`\gamma`. betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`, outside the square root. weight_decay: :math:`\lambda`,
            decoupled, applied with the raw ``lr``. factored_floor: the :math:`(1-\beta_2)
            G_{ij}^2` floor of a matrix's factored estimate (False: the product alone).
            nesterov: apply :math:`a_t` (False: :math:`\hat m_t`, AdamW's update).
    """

    OWNER_NAME: ClassVar[str] = "Gefen"
    CHECKPOINT_OWNER: ClassVar[str] = "Gefen"  # a subclass keeps it: it reads Gefen's files
    OPTIMIZER_WIDE: ClassVar[tuple[str, ...]] = GEFEN_OPTIMIZER_WIDE
    CODEC_KEYS: ClassVar[CodecKeys] = CodecKeys()
    TEMPLATE_COMPLETE: ClassVar[bool] = True
    OPTIONAL_EXTRAS: ClassVar[tuple[str, ...]] = ("scope", "rank_local")

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        factored_v_2d: bool = True,
        factored_floor: bool = True,
        nesterov: bool = True,
        force_1d_period_one: bool = False,
        force_2d_period_one: bool = False,
        codebook_refresh_every: int = 0,
        stochastic_round: bool = False,
        deterministic: bool = False,
        check_finite: bool = True,
        momentum_codec: str = "codebook8",
        fused: bool | None = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "factored_v_2d": factored_v_2d,
            "factored_floor": factored_floor,
            "nesterov": nesterov,
            "force_1d_period_one": force_1d_period_one,
            "force_2d_period_one": force_2d_period_one,
            "codebook_refresh_every": codebook_refresh_every,
            "stochastic_round": stochastic_round,
            "deterministic": deterministic,
            "check_finite": check_finite,
            "momentum_codec": momentum_codec,
            "fused": fused,
        }
        validate_gefen_options(defaults, constructor=True)
        defaults["betas"] = check_betas(betas)
        super().__init__(params, defaults)

    # -- options ----------------------------------------------------------------------------

    def validate_group(self, group: Mapping[str, Any]) -> None:
        check_optimizer_wide(group, self.defaults, self.OPTIMIZER_WIDE)
        check_torch_flags(group)
        validate_gefen_options(group)
        others = self.__dict__.get("param_groups") or []
        check_group_codec(group, others, self.__dict__.get("_codebook"), self.OWNER_NAME)
        if group["fused"] is True:
            for param in group["params"]:
                device_type = local_tensor(param).device.type
                if not has_fused_implementation(device_type):
                    raise RuntimeError(
                        f"fused=True but no fused implementation is registered for device "
                        f"type {device_type!r}"
                    )

    # -- the state codec --------------------------------------------------------------------

    @staticmethod
    def _family(group: Mapping[str, Any], param: Tensor) -> Family:
        """The second-moment family: factored iff a plain 2-D tensor in a factored group."""
        plain_matrix = param.dim() == 2 and not is_dtensor(param)
        return "factored" if plain_matrix and bool(group["factored_v_2d"]) else "block"

    def entry_spec(self, group: Mapping[str, Any], param: Tensor) -> EntrySpec:
        plain_matrix = param.dim() == 2 and not is_dtensor(param)
        matrix = (int(param.shape[0]), int(param.shape[1])) if plain_matrix else None
        return EntrySpec(
            numel=local_tensor(param).numel(),
            matrix_shape=matrix,
            codec_keys=self.CODEC_KEYS,
            dense_dtype=torch.float32,
            dense_shape=None,
            second_moment=self._family(group, param),
            codes_per_byte=codes_per_byte(group),
        )

    def codebook_inputs(self, operation: GuardedOperation) -> list[CodebookInput]:
        inputs: list[CodebookInput] = []
        for index, _, param in self.indexed_params():  # fp32-momentum groups choose periods too
            if param.grad is None:
                continue
            grad = local_tensor(param.grad)
            if grad.numel() > 0:
                inputs.append((index, grad, tuple(grad.shape)))
        return inputs

    def template_period(self, group: Mapping[str, Any], param: Tensor) -> int | None:
        """The period from the shape (docs/core.md §4.1): 1 where forced or for one element; one
        block per row where a tensor of two or more dimensions has rows of at least 8 elements
        (so blocks never cross a row-shard boundary); None for the rest, which §4 searches. A
        DTensor takes ``dtensor_period`` (§9.1): rows, or 1 for a vector."""
        forced = (param.dim() == 1 and bool(group["force_1d_period_one"])) or (
            param.dim() == 2 and bool(group["force_2d_period_one"])
        )
        if is_dtensor(param):  # rows, or 1: never a block across a row shard (§9.1)
            period = dtensor_period(param)
            return 1 if forced and period is not None else period
        numel = param.numel()
        if numel == 0:
            return None
        return 1 if forced or numel == 1 else row_period(tuple(param.shape))

    def row_sharded(self) -> bool:
        """FSDP2 state DCP reshards (docs/core.md §9.1): every parameter row-sharded over one
        mesh, no explicit scope, and no matrix forced to period 1. Decided from shapes and
        options alone, so alike on every rank (a load refuses other periods)."""
        if self.finalized is not None or any(g["force_2d_period_one"] for g in self.param_groups):
            return False
        params = (param for _, _, param in self.indexed_params())
        return row_sharded_mesh(params, rows_everywhere=False) is not None

    # -- kernels (§11) ----------------------------------------------------------------------

    def _kernel_key(self, group: Mapping[str, Any], param: Tensor) -> KernelKey:
        family = self._family(group, param)
        return (
            local_tensor(param).device.type,
            param.dtype,
            group["momentum_codec"],
            family,
        )

    def _kernel(self, group: Mapping[str, Any], param: Tensor) -> Updater | None:
        return self._kernels.select(
            self._kernel_key(group, param),
            fused=group["fused"],
            deterministic=group["deterministic"],
        )

    def _select_kernels(self) -> None:
        reductions: dict[int, GradientReduction] = {}  # by id(param), see _commit_step
        # by id(param): True where the row and column sums of g² must stay finite (factored),
        # False where only float32's range binds (a float64 gradient the step narrows)
        bounded: dict[int, bool] = {}
        for _, group, param in self.indexed_params():
            if param.grad is not None and local_tensor(param).numel() > 0:
                kernel = self._kernel(group, param)
                if self._family(group, param) != "factored":
                    if param.dtype == torch.float64:
                        bounded[id(param)] = False
                    continue
                bounded[id(param)] = True
                # the native kernel's factored row/column sums double as the finiteness check
                reduction = getattr(kernel, "gradient_sums", None)
                if reduction is not None:
                    reductions[id(param)] = reduction
        self._reductions, self._bounded = reductions, bounded

    # -- phase 4: read; phase 5: streamed commit (§7.1) --------------------------------------

    def _prepare_step(self, operation: GuardedOperation, learning: StagedLearning) -> Any:
        """Phase 4: which parameters update, with what scalars; reads only (a tensor lr once
        per group with an update). The plan holds no tensor proportional to the model.
        While the steady-state token is the one the updates were planned under and nothing is
        learned, they are reused (the same parameters, entries and kernels; gefen.core.steady);
        the scalars follow the options every step (an LR schedule changes them)."""
        steady = self.__dict__.get("_steady")
        cached: list[_PlannedUpdate] | None = None if steady is None else steady[2].get("plan")
        if cached is not None and not learning.periods:
            return _StepPlan(cached, self._step_scalars(cached, learning))
        updates = self._planned_updates(learning)
        # Seeds move with the global step: a stochastic plan is rebuilt every step.
        if steady is not None and not any(update.seed is not None for update in updates):
            steady[2]["plan"] = updates
        return _StepPlan(updates, self._step_scalars(updates, learning))

    def _planned_updates(self, learning: StagedLearning) -> list[_PlannedUpdate]:
        plan: list[_PlannedUpdate] = []
        index = -1
        # no codebook yet (its groups' gradients were all zero): those groups wait (§5.5)
        waiting = self._codebook is None and learning.codebook is None
        for group_index, group in enumerate(self.param_groups):
            coded = group_uses_codebook(group)
            stochastic = coded and bool(group["stochastic_round"])
            for position, param in enumerate(group["params"]):
                index += 1
                if param.grad is None or local_tensor(param).numel() == 0 or (waiting and coded):
                    continue
                # A parameter object put into a group after construction has no entry yet: like
                # torch, it starts fresh (its period is staged by learning, as for a new group).
                live = self.state.get(param, {}).get("period", 0)
                plan.append(
                    _PlannedUpdate(
                        param, group, (group_index, position), learning.periods.get(index, live),
                        self._kernel(group, param), local_tensor(param),
                        self._entry_if_live(group, param),
                        self._seed(index, group_index, position) if stochastic else None,
                    )
                )  # fmt: skip
        return plan

    def _seed(self, index: int, group_index: int, position: int) -> tuple[int, ...]:
        """§6.3's seed: the step, the flat index, and the local shard's first element in the
        whole parameter (a shard draws what one process draws for its elements)."""
        if self._finalized is not None:
            extent = self._finalized.group_shards[group_index][position].extent
            first = extent.flat_offset if isinstance(extent, LogicalSlice) else 0
        else:
            first = first_logical_element(self.param_groups[group_index]["params"][position])
        return (self._global_step, index, first)

    def _step_scalars(
        self, updates: list[_PlannedUpdate], learning: StagedLearning
    ) -> dict[tuple[int, Any], StepScalars]:
        """Each group's scalars with the codebook the commit publishes (a codebook8 group's),
        read once per step for each device the group's updates run on, and only for a group
        with an update (a group with nothing to update never syncs on its tensor lr)."""
        codebook = learning.codebook if learning.codebook is not None else self._codebook
        scalars: dict[tuple[int, Any], StepScalars] = {}
        for update in updates:
            key = (update.position[0], update.local.device)
            if key not in scalars:
                bound = None
                if codebook is not None and group_uses_codebook(update.group):
                    bound = codebook.to(key[1])
                scalars[key] = group_step_scalars(update.group, bound)
        return scalars

    def _entry_if_live(self, group: Mapping[str, Any], param: Tensor) -> dict[str, Any] | None:
        """The parameter's entry when it needs no allocation, migration or move, else None."""
        entry: dict[str, Any] | None = self.state.get(param)
        if entry is None or not is_initialized(entry):
            return None
        device = local_tensor(param).device
        if entry_family(entry) != self._family(group, param) or any(
            value.device != device for value in entry.values() if isinstance(value, Tensor)
        ):
            return None
        return entry

    def _live_entry(self, planned: _PlannedUpdate) -> dict[str, Any]:
        """The parameter's own entry, allocated, migrated or moved to its device as needed."""
        param, group = planned.param, planned.group
        entry: dict[str, Any] = self.state[param]
        if self._entry_if_live(group, param) is not None:
            return entry  # live after all (it was allocated by an earlier plan item)
        device = local_tensor(param).device
        spec = self.entry_spec(group, param)
        if not is_initialized(entry):
            fresh = allocate_entry(
                spec, planned.period, codebook8=group_uses_codebook(group), device=device
            )
        elif entry_family(entry) != spec.second_moment:
            warnings.warn(
                f"Gefen: parameter {parameter_label(group, *planned.position)} switches"
                f" its second moment to the "
                f"{spec.second_moment} family (factored_v_2d changed); its statistics carry over",
                UserWarning,
                stacklevel=2,
            )
            fresh = migrate_family(entry, spec, device)
        else:
            fresh = {
                key: value.to(device) if isinstance(value, Tensor) else value
                for key, value in entry.items()
            }
        entry.clear()
        entry.update(fresh)
        return entry

    def _commit_step(self, plan: Any) -> None:
        """Phase 5: one parameter at a time, its state and value updated in their own storage."""
        # by id: a Tensor's own __hash__ is a Python call; the key lives only for this step
        bound_updates: Mapping[int, Updater] = self.__dict__.get("_gradient_sums") or {}
        for planned in plan.updates:
            entry = planned.entry if planned.entry is not None else self._live_entry(planned)
            grad = planned.param.grad
            if type(grad) is not Tensor:
                grad = local_tensor(grad)
            scalars = plan.scalars[(planned.position[0], planned.local.device)]
            if planned.seed is not None:
                scalars = replace(scalars, seed=planned.seed)
            # the kernel bound to the sums the preflight computed, else the selected one
            update = bound_updates.get(id(planned.param)) or planned.updater or eager_update_
            update(planned.local, grad, entry, scalars)

    # -- contract (§10) ---------------------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        """The contract of the live options (§10); a pure read, recomputed on every call."""
        from gefen.core.contract import gefen_contract

        return gefen_contract(self, self.param_groups, "gefen.core.Gefen")

    # -- checkpoints ------------------------------------------------------------------------

    def stage_entries(
        self,
        saved_state: Mapping[int, Any],
        groups: list[dict[str, Any]],
        extras: Mapping[str, Any],
    ) -> dict[int, dict[str, Any]]:
        from gefen.core.loading import stage_gefen_entries

        return stage_gefen_entries(self, saved_state, groups)
