"""``GefenMuonHybrid.optimizer_contract()`` (docs/hybrid.md §9): a pure read.

The hybrid's checkpoint is torch's flat layout over both children (``gefen.hybrid.flat_layout``),
so its layout declares the ``gefen_hybrid`` extras, every per-parameter field of its children
(each name once) and their variants under the child's role (``muon/q8``, ``backup/adamw``); each
Gefen child also carries its own contract, an AdamW child none.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from gefen.contracts import (
    CheckpointSupport,
    CheckpointTransport,
    OptimizerCapabilities,
    OptimizerChildContract,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
    StateField,
    StateGeometry,
    StateScope,
    StateVariant,
    TrainingSupport,
)
from gefen.hybrid.adamw_preflight import fp16_safe
from gefen.hybrid.flat_layout import EXTRAS_KEY

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["hybrid_contract"]

_ADAMW_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD})
_GLOBAL = StateExtent.GLOBAL_PARAMETER
_ALL_PRECISIONS = frozenset(
    {Precision.FLOAT32, Precision.BFLOAT16, Precision.FLOAT16, Precision.FLOAT64}
)


def _adamw_training() -> tuple[TrainingSupport, ...]:
    return (
        TrainingSupport(
            layout=ParameterLayout.REPLICATED, process_group_scope=ProcessGroupScope.NONE
        ),
        TrainingSupport(
            layout=ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
            process_group_scope=ProcessGroupScope.INFERRED_DEVICE_MESH,
        ),
    )


def _children(hybrid: HybridInterface) -> tuple[OptimizerChildContract, ...]:
    children = []
    if hybrid.muon is not None:
        children.append(
            OptimizerChildContract(
                role="muon",
                implementation="gefen.muon.GefenMuon",
                contract=hybrid.muon.optimizer_contract(),
            )
        )
    if hybrid.backup is not None:
        if hybrid.backup_optimizer == "adamw":
            children.append(
                OptimizerChildContract(
                    role="backup", implementation="torch.optim.adamw.AdamW", contract=None
                )
            )
        else:
            children.append(
                OptimizerChildContract(
                    role="backup",
                    implementation="gefen.core.Gefen",
                    contract=hybrid.backup.optimizer_contract(),  # type: ignore[attr-defined]
                )
            )
    return tuple(children)


def _native(child: OptimizerChildContract) -> list[CheckpointSupport]:
    """A child's native checkpoint claims (none for an AdamW backup, which has no contract)."""
    if child.contract is None:
        return []
    checkpoints = child.contract.capabilities.checkpoints
    return [
        entry for entry in checkpoints if entry.transport is CheckpointTransport.NATIVE_OPTIMIZER
    ]


def _native_layouts(child: OptimizerChildContract) -> frozenset[ParameterLayout]:
    if child.contract is None:
        return _ADAMW_LAYOUTS
    return frozenset().union(*(entry.same_topology for entry in _native(child)))


def _adamw_layout() -> OptimizerStateLayout:
    """What a torch AdamW backup keeps per parameter (amsgrad adds one moment)."""
    moments = ("step", "exp_avg", "exp_avg_sq")
    geometry = {"step": StateGeometry.SCALAR}
    fields = tuple(
        StateField(
            name=name,
            scope=StateScope.PARAMETER,
            geometry=geometry.get(name, StateGeometry.PARAMETER),
            checkpointed=True,
        )
        for name in (*moments, "max_exp_avg_sq")
    )
    variants = tuple(
        StateVariant(name=name, fields=keys, layouts=_ADAMW_LAYOUTS, extent=_GLOBAL)
        for name, keys in (("adamw", moments), ("adamw_amsgrad", (*moments, "max_exp_avg_sq")))
    )
    return OptimizerStateLayout(fields=fields, parameter_variants=variants)


def _flat_layout(children: tuple[OptimizerChildContract, ...]) -> OptimizerStateLayout:
    """The extras field, each child's per-parameter fields (first declaration of a name wins),
    and each child's variants named ``<role>/<variant>``."""
    fields: dict[str, StateField] = {
        EXTRAS_KEY: StateField(
            name=EXTRAS_KEY,
            scope=StateScope.OPTIMIZER_COMMON,
            geometry=StateGeometry.OPAQUE,
            checkpointed=True,
            description="format version, backup backend ('gefen' or 'adamw'), and each "
            "child's own top-level extras (None for an absent child)",
        )
    }
    variants: list[StateVariant] = []
    for child in children:
        own = _adamw_layout() if child.contract is None else child.contract.state_layout
        for declared in own.fields:
            if declared.scope is StateScope.PARAMETER:
                fields.setdefault(declared.name, declared)
        variants += [replace(v, name=f"{child.role}/{v.name}") for v in own.parameter_variants]
    return OptimizerStateLayout(fields=tuple(fields.values()), parameter_variants=tuple(variants))


def hybrid_contract(hybrid: HybridInterface) -> OptimizerContract:
    """Build the composite contract from the live children; reads only."""
    children = _children(hybrid)
    training: list[TrainingSupport] = []
    precisions = _ALL_PRECISIONS
    same_topology = _ADAMW_LAYOUTS
    for child in children:
        entries = (
            _adamw_training() if child.contract is None else child.contract.capabilities.training
        )
        training += [entry for entry in entries if entry not in training]
        if child.contract is not None:
            precisions = precisions & child.contract.capabilities.precisions
        elif hybrid.backup is not None and not all(map(fp16_safe, hybrid.backup.param_groups)):
            precisions = precisions - {Precision.FLOAT16}  # refused under GradScaler, above
        same_topology = same_topology & _native_layouts(child)
    # each layout post_sharding installed is its child's own, which that child's load takes
    same_topology |= {
        entry.layout
        for child in children
        if child.contract is not None
        for entry in child.contract.capabilities.training
        if entry.process_group_scope is ProcessGroupScope.ADAPTER_DEFINED
    }
    collective = len(hybrid.step_failure_scope()) > 0
    scope = ProcessGroupScope.INFERRED_DEVICE_MESH if collective else ProcessGroupScope.NONE
    adapter = ProcessGroupScope.ADAPTER_DEFINED
    if collective and any(e.process_group_scope is adapter for c in children for e in _native(c)):
        scope = ProcessGroupScope.ADAPTER_DEFINED  # the installed binding's group
    checkpoint = CheckpointSupport(
        transport=CheckpointTransport.COMPOSITE_NATIVE,
        same_topology=same_topology,
        process_group_scope=scope,
        requires_collective=collective,
        atomic_load=True,
    )
    layout = _flat_layout(children)
    forwards = hybrid.backup_optimizer != "adamw" or hybrid.backup is None
    capabilities = OptimizerCapabilities(
        training=tuple(training),
        checkpoints=(checkpoint,),
        precisions=precisions,
        post_sharding=forwards,
        shard_rebinding=forwards,
        explicit_process_group_codebook_scope=forwards,
        canonical_parameter_fqns=hybrid.finalized,
        stable_shard_identity=hybrid.finalized,
    )
    return OptimizerContract(
        implementation="gefen.hybrid.GefenMuonHybrid",
        state_layout=layout,
        capabilities=capabilities,
        children=children,
    )
