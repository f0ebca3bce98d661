"""``GefenMuon``: Muon for 2-D matrices with 8-bit codebook momentum (20-muon.md).

The step and load transactions, codebook learning, the latch and the hooks are the shell's
(``gefen.core.shell.OptimizerShell``); this class supplies the options, the per-parameter
state codec, the per-mode update and the distributed consolidation of checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from gefen.contracts import OptimizerContract, ParameterLayout
from gefen.core.kernels import select_period
from gefen.core.learning import CodebookInput, StagedLearning
from gefen.core.options import check_optimizer_wide, lr_value
from gefen.core.shell import OptimizerShell
from gefen.core.state import CodecKeys, EntrySpec, allocate_entry, is_initialized
from gefen.core.transaction import STEP_SIGNATURE, run_step
from gefen.core.validation import local_tensor
from gefen.dist import GuardedOperation, cuda_graph_capturing
from gefen.muon.kernels import STANDARD_TRIPLE, adjust_lr_ratio, local_slice_of_full
from gefen.muon.modes import (
    APPROX,
    DistributedSlot,
    broadcast_update,
    distributed_slots,
    full_gradient,
    parameter_mode,
    quantized_shape,
)
from gefen.muon.options import (
    MUON_OPTIMIZER_WIDE,
    check_mode_mix,
    group_schedule,
    normalise_schedule_steps,
    validate_muon_options,
)
from gefen.muon.preflight import check_presence_and_order
from gefen.muon.update import MuonHyper, apply_update, orthogonal_update

__all__ = ["GefenMuon"]

_MUON_CODEC_KEYS = CodecKeys(dense="momentum_buffer")
PHASE_STATE_DICT_PREFLIGHT = "state dict preflight"


@dataclass(frozen=True)
class _Staged:
    """One parameter's staged result: its new entry (None: unchanged) and new local value."""

    param: Tensor
    entry: dict[str, Any] | None
    value: Tensor


def _hyper(group: Mapping[str, Any]) -> MuonHyper:
    return MuonHyper(
        lr=lr_value(group["lr"]),
        weight_decay=float(group["weight_decay"]),
        momentum=float(group["momentum"]),
        nesterov=bool(group["nesterov"]),
        schedule=group_schedule(group),
        eps=float(group["eps"]),
        normuon=bool(group["normuon"]),
        normuon_beta2=float(group["normuon_beta2"]),
        normuon_eps=float(group["normuon_eps"]),
    )


class GefenMuon(OptimizerShell):
    """Muon (momentum → Newton–Schulz → shape-scaled step) with ~1 byte of momentum per element.

    The first nine arguments match ``torch.optim.Muon``; see the package README for the rest.
    """

    OWNER_NAME: ClassVar[str] = "GefenMuon"
    OPTIMIZER_WIDE: ClassVar[tuple[str, ...]] = MUON_OPTIMIZER_WIDE
    CODEC_KEYS: ClassVar[CodecKeys] = _MUON_CODEC_KEYS
    OPTIONAL_EXTRAS: ClassVar[tuple[str, ...]] = ("scope", "muon_distributed", "rank_local")
    REQUIRE_2D: ClassVar[bool] = True
    POST_SHARDING_LAYOUTS: ClassVar[tuple[ParameterLayout, ...]] = (
        ParameterLayout.REPLICATED,
        ParameterLayout.WHOLE_PARAMETER_OWNER,
    )

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
        self._check_fused(fused)
        normalise_schedule_steps(defaults)
        super().__init__(params, defaults)

    # -- options ----------------------------------------------------------------------------

    @staticmethod
    def _check_fused(fused: object) -> None:
        if fused is True:
            raise RuntimeError(
                "GefenMuon: fused=True but no fused implementation is registered; "
                "use fused=None or fused=False"
            )

    def _validate_group(self, group: Mapping[str, Any]) -> None:
        check_optimizer_wide(group, self.defaults, self.OPTIMIZER_WIDE)
        validate_muon_options(group)
        self._check_fused(group["fused"])

    def _validate_registration(self, candidate: Mapping[str, Any]) -> None:
        for param in candidate["params"]:
            if param.dim() != 2:
                raise ValueError(
                    "GefenMuon only supports 2D parameters whereas we found a parameter with "
                    f"size: {param.size()}"
                )
        check_mode_mix([*self.param_groups, candidate])
        self._validate_group(candidate)
        normalise_schedule_steps(candidate)  # type: ignore[arg-type]

    def _check_local_inputs(self) -> None:
        check_mode_mix(self.param_groups)
        super()._check_local_inputs()

    # -- the state codec --------------------------------------------------------------------

    def _entry_spec(self, group: Mapping[str, Any], param: Tensor) -> EntrySpec:
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
        )

    def _select_period(
        self, group: Mapping[str, Any], param: Tensor, view: Tensor, shape: tuple[int, ...]
    ) -> int | None:
        if not self._codebook8:
            return 1  # codec "none" stores the matrix as is; no selection runs
        return select_period(view, shape, force_one=False)

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
        if not self._codebook8:
            return local_tensor(grad)  # the period is 1 whatever the view; no gather needed
        return full_gradient(grad)

    def _codebook_inputs(self, operation: GuardedOperation) -> list[CodebookInput]:
        learning_codebook = self._codebook8 and self._codebook is None
        inputs: list[CodebookInput] = []
        for index, group, param in self._indexed():
            if param.grad is None:
                continue
            if not learning_codebook and self.state[param].get("period", 0) != 0:
                continue  # the period is chosen once and the codebook is frozen
            view = self._learning_view(group, param)
            if view is not None:
                inputs.append((index, view, tuple(view.shape)))
        return inputs

    # -- phase 4: stage ---------------------------------------------------------------------

    def _working_entry(
        self, group: Mapping[str, Any], param: Tensor, period: int, device: torch.device
    ) -> dict[str, Any]:
        entry = self.state[param]
        if not is_initialized(entry):
            spec = self._entry_spec(group, param)
            return allocate_entry(spec, period, codebook8=self._codebook8, device=device)
        return {
            key: value.to(device) if isinstance(value, Tensor) else value
            for key, value in entry.items()
        }

    def _orthogonal(
        self,
        index: int,
        group: Mapping[str, Any],
        param: Tensor,
        grad: Tensor,
        learning: StagedLearning,
        hyper: MuonHyper,
    ) -> tuple[dict[str, Any], Tensor]:
        """Steps 1–3 for one parameter on ``grad`` (the matrix its mode quantizes)."""
        period = learning.periods.get(index, self.state[param].get("period", 0))
        entry = self._working_entry(group, param, period, grad.device)
        codebook = learning.codebook if learning.codebook is not None else self._codebook
        if codebook is not None:
            codebook = codebook.to(grad.device)
        stochastic = self._codebook8 and bool(self.defaults["stochastic_round"])
        seed = (self._global_step, index) if stochastic else None
        return orthogonal_update(entry, grad, codebook=codebook, hyper=hyper, seed=seed)

    def _stage_local(
        self,
        index: int,
        group: Mapping[str, Any],
        param: Tensor,
        learning: StagedLearning,
        hyper: MuonHyper,
    ) -> _Staged | None:
        """The plain, approx and exact paths: every rank computes the whole update it needs."""
        mode = parameter_mode(group, param)
        grad = param.grad
        assert grad is not None
        local = local_tensor(param)
        if mode == APPROX:
            if local.numel() == 0:
                return None
            matrix = local_tensor(grad)
        elif mode == "plain":
            matrix = grad
        else:
            matrix = full_gradient(grad)  # every rank, empty shards too, in parameter order
        entry, update = self._orthogonal(index, group, param, matrix, learning, hyper)
        if mode not in (APPROX, "plain"):
            update = local_slice_of_full(update, param)
        ratio = adjust_lr_ratio(group["adjust_lr_fn"], tuple(param.shape))
        return _Staged(param, entry, apply_update(local, update, hyper=hyper, ratio=ratio))

    def _stage_distributed(
        self, slots: list[DistributedSlot], learning: StagedLearning, hypers: dict[int, MuonHyper]
    ) -> list[_Staged]:
        """Buckets of ``world`` items: gather (owner keeps), owners compute, broadcast, apply."""
        active = [slot for slot in slots if slot.param.grad is not None]
        staged: list[_Staged] = []
        world = active[0].world if active else 1
        for start in range(0, len(active), world):
            bucket = active[start : start + world]
            kept: dict[int, Tensor] = {}
            for slot in bucket:
                grad = slot.param.grad
                assert grad is not None
                full = full_gradient(grad)
                if slot.is_owner():
                    kept[slot.index] = full
            computed: dict[int, tuple[dict[str, Any], Tensor]] = {}
            for slot in bucket:
                if slot.index in kept:
                    computed[slot.index] = self._orthogonal(
                        slot.index,
                        slot.group,
                        slot.param,
                        kept[slot.index],
                        learning,
                        hypers[id(slot.group)],
                    )
            for slot in bucket:
                entry, update = computed.get(slot.index, (None, None))
                full_update = broadcast_update(update, slot)
                local_update = local_slice_of_full(full_update, slot.param)
                ratio = adjust_lr_ratio(slot.group["adjust_lr_fn"], tuple(slot.param.shape))
                hyper = hypers[id(slot.group)]
                value = apply_update(
                    local_tensor(slot.param), local_update, hyper=hyper, ratio=ratio
                )
                staged.append(_Staged(slot.param, entry, value))
        return staged

    def _prepare_step(self, operation: GuardedOperation, learning: StagedLearning) -> Any:
        hypers = {id(group): _hyper(group) for group in self.param_groups}
        indexed = self._indexed()
        slots = distributed_slots(indexed)
        distributed = {slot.index for per_group in slots for slot in per_group}
        staged: list[_Staged] = []
        for index, group, param in indexed:
            if param.grad is None or index in distributed:
                continue
            result = self._stage_local(index, group, param, learning, hypers[id(group)])
            if result is not None:
                staged.append(result)
        for per_group in slots:
            staged.extend(self._stage_distributed(per_group, learning, hypers))
        return staged

    # -- phase 5: commit --------------------------------------------------------------------

    def _commit_step(self, plan: Any) -> None:
        for update in plan:
            if update.entry is not None:
                entry = self.state[update.param]
                entry.clear()
                entry.update(update.entry)
            local_tensor(update.param).copy_(update.value)

    # -- the step (§6) ----------------------------------------------------------------------

    def check_step_agreement(self) -> None:
        """The collective presence/order preflight of §7 (no collective when unsharded)."""
        check_presence_and_order(self.param_groups, owner=self.OWNER_NAME)

    def step(self, *args: Any, **kwargs: Any) -> Any:  # step(closure=None)
        """One transactional step (10-core.md §7.1); returns the closure's loss or None."""
        params = [local_tensor(p) for group in self.param_groups for p in group["params"]]
        if cuda_graph_capturing(params):
            raise RuntimeError("GefenMuon does not support CUDA graph capture")
        return run_step(self, args, kwargs)

    step.__signature__ = STEP_SIGNATURE  # type: ignore[attr-defined]

    def refresh_codebook(self) -> bool:
        """Periodic refresh is out of scope for GefenMuon (20-muon.md §1)."""
        raise NotImplementedError("GefenMuon does not support refresh_codebook")

    # -- contract (§10) ---------------------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        """The contract of the live options (20-muon.md §10); a pure read."""
        from gefen.muon.contract import muon_contract

        return muon_contract(self)

    # -- checkpoints (§8) -------------------------------------------------------------------

    def _rank_local_checkpoint(self) -> bool:
        approx = any(group["sharded_mode"] == APPROX for group in self.param_groups)
        return approx and len(self.step_failure_scope()) > 0

    def _check_checkpoint_binding(self, checkpoint_binding: object) -> None:
        from gefen.muon.checkpoint import check_checkpoint_binding

        check_checkpoint_binding(self, checkpoint_binding)

    def state_dict(self, *, checkpoint_binding: object = None) -> dict[str, Any]:
        """torch's layout plus the extras; collective with eligible distributed groups (§8)."""
        if checkpoint_binding is not None or len(self.step_failure_scope()) > 0:
            self._operation().local(
                PHASE_STATE_DICT_PREFLIGHT, self._check_checkpoint_binding, checkpoint_binding
            )
        return super().state_dict()

    def _build_state_entries(self, operation: GuardedOperation) -> dict[int, dict[str, Any]]:
        from gefen.muon.checkpoint import consolidated_entries

        return consolidated_entries(self)

    def _checkpoint_extras(self, entries: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        from gefen.muon.checkpoint import manifest

        built = manifest(self, entries)
        return {} if built is None else {"muon_distributed": built}

    def _stage_entries(
        self,
        saved_state: Mapping[int, Any],
        groups: list[dict[str, Any]],
        extras: Mapping[str, Any],
    ) -> dict[int, dict[str, Any]]:
        from gefen.muon.checkpoint import stage_muon_entries

        return stage_muon_entries(self, saved_state, groups, extras)
