"""Example values shared by the gefen-contracts test modules.

The builders are plain functions (wrapped in fixtures below) because the golden-fixture test also
runs them in a fresh interpreter through ``runpy.run_path`` on this file, with another
``PYTHONHASHSEED``; they therefore use ``gefen.contracts`` only.
"""

from __future__ import annotations

import pytest

from gefen.contracts import (
    CheckpointSupport,
    CheckpointTransport,
    LogicalSlice,
    OptimizerCapabilities,
    OptimizerChildContract,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterIdentity,
    ParameterLayout,
    PlacementKind,
    Precision,
    ProcessGroupIdentity,
    ProcessGroupScope,
    ShardIdentity,
    ShardingManifest,
    ShardPlacement,
    StateExtent,
    StateField,
    StateGeometry,
    StateScope,
    StateVariant,
    TrainingSupport,
)

REPLICATED = ParameterLayout.REPLICATED
FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD


def build_adamw_contract() -> OptimizerContract:
    """The contract of ``torch.optim.AdamW`` exactly as spec 40 §9 declares it."""
    moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    fields = [
        StateField(
            name="step",
            scope=StateScope.PARAMETER,
            geometry=StateGeometry.SCALAR,
            checkpointed=True,
        ),
        *(
            StateField(
                name=name,
                scope=StateScope.PARAMETER,
                geometry=StateGeometry.PARAMETER,
                checkpointed=True,
            )
            for name in moments
        ),
    ]
    variants = [
        StateVariant(
            name=name,
            fields=keys,
            layouts={REPLICATED},
            extent=StateExtent.GLOBAL_PARAMETER,
        )
        for name, keys in (
            ("adamw", ("step", "exp_avg", "exp_avg_sq")),
            ("adamw_amsgrad", ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        )
    ]
    capabilities = OptimizerCapabilities(
        training=[TrainingSupport(layout=REPLICATED, process_group_scope=ProcessGroupScope.NONE)],
        checkpoints=[
            CheckpointSupport(
                transport=CheckpointTransport.NATIVE_OPTIMIZER,
                same_topology={REPLICATED},
                process_group_scope=ProcessGroupScope.NONE,
                requires_collective=False,
                atomic_load=False,
            )
        ],
        precisions=set(Precision),
    )
    return OptimizerContract(
        implementation="torch.optim.adamw.AdamW",
        state_layout=OptimizerStateLayout(fields=fields, parameter_variants=variants),
        capabilities=capabilities,
    )


def build_composite_contract() -> OptimizerContract:
    """A composite with a contracted child (``"main"``) and one without a contract (``"backup"``).

    Its layout also declares a third namespace, ``"spare"``, that no child fills.
    """
    layout = OptimizerStateLayout(
        fields=[
            StateField(
                name="composite_meta",
                scope=StateScope.OPTIMIZER_COMMON,
                geometry=StateGeometry.OPAQUE,
                checkpointed=True,
            )
        ],
        parameter_variants=[],
        composite_namespaces=["main", "backup", "spare"],
    )
    adamw = build_adamw_contract()
    return OptimizerContract(
        implementation="tests.Composite",
        state_layout=layout,
        capabilities=adamw.capabilities,
        children=[
            OptimizerChildContract(role="main", implementation="tests.Main", contract=adamw),
            OptimizerChildContract(role="backup", implementation="tests.Backup", contract=None),
        ],
    )


def build_golden_manifest() -> ShardingManifest:
    """A flat-sharded weight over a two-member group plus an ungrouped replicated bias."""
    weight = ParameterIdentity("layer.weight", (2, 4))
    group = ProcessGroupIdentity("dp", ("rank:0", "rank:1"))
    shards = [
        ShardIdentity(
            weight,
            FLAT,
            LogicalSlice(4 * index, 4),
            [ShardPlacement("data_parallel", PlacementKind.FLAT_SHARD, index, 2)],
            group,
            member,
        )
        for index, member in enumerate(group.ordered_members)
    ]
    bias = ParameterIdentity("layer.bias", (4,))
    shards.append(ShardIdentity(bias, REPLICATED, LogicalSlice(0, 4)))
    return ShardingManifest(shards)


@pytest.fixture
def adamw_contract() -> OptimizerContract:
    return build_adamw_contract()


@pytest.fixture
def composite_contract() -> OptimizerContract:
    return build_composite_contract()


@pytest.fixture
def golden_manifest() -> ShardingManifest:
    return build_golden_manifest()
