"""``GefenMuonHybrid.optimizer_contract()`` (docs/hybrid.md §9): a pure read.

The hybrid's checkpoint nests its children's under the namespaces ``muon`` and ``backup``, so its
own layout declares only those namespaces and the ``backup_optimizer`` tag; each Gefen child
carries its own contract, an AdamW child none.
"""

from __future__ import annotations

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
    StateField,
    StateGeometry,
    StateScope,
    TrainingSupport,
)
from gefen.hybrid.adamw_preflight import fp16_safe

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["hybrid_contract"]

_ADAMW_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD})
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


def _native_layouts(child: OptimizerChildContract) -> frozenset[ParameterLayout]:
    if child.contract is None:
        return _ADAMW_LAYOUTS
    native = [
        entry.same_topology
        for entry in child.contract.capabilities.checkpoints
        if entry.transport is CheckpointTransport.NATIVE_OPTIMIZER
    ]
    return frozenset().union(*native)


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
    collective = len(hybrid.step_failure_scope()) > 0
    checkpoint = CheckpointSupport(
        transport=CheckpointTransport.COMPOSITE_NATIVE,
        same_topology=same_topology,
        process_group_scope=ProcessGroupScope.INFERRED_DEVICE_MESH
        if collective
        else ProcessGroupScope.NONE,
        requires_collective=collective,
        atomic_load=True,
    )
    layout = OptimizerStateLayout(
        fields=(
            StateField(
                name="backup_optimizer",
                scope=StateScope.OPTIMIZER_COMMON,
                geometry=StateGeometry.OPAQUE,
                checkpointed=True,
                description="the backup backend, 'gefen' or 'adamw'",
            ),
        ),
        parameter_variants=(),
        composite_namespaces=("muon", "backup"),
    )
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
