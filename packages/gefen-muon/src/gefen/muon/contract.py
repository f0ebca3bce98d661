"""``GefenMuon.optimizer_contract()`` (docs/muon.md §10): a pure read of the live options.

Exact and distributed state is global (the full matrix, consolidated on save), so it is
declared with the global extent and survives a world-size change; approx state is the local
shard's and is rank-local. NorMuon adds its pair of keys, declared as separate variants so
every live entry matches exactly one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gefen.contracts import (
    CheckpointSupport,
    CheckpointTransport,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
    StateField,
    StateGeometry,
    StateVariant,
    TopologyChange,
    TrainingSupport,
)
from gefen.core.extension import (
    CODEBOOK_CODECS,
    VARIANT_PREFIX,
    api_flags,
    checkpoint_scope,
    extras_field,
    finalized_training,
    group_codecs,
    installed_layouts,
    parameter_field,
)

if TYPE_CHECKING:
    from gefen.core.extension import ShellInterface

__all__ = ["muon_contract"]

_REPLICATED = ParameterLayout.REPLICATED
_SHARD = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
_NORMUON = ("normuon_v", "normuon_step")


def _fields() -> tuple[StateField, ...]:
    return (
        extras_field("the extras: format, global step, codebook, flags, manifest"),
        parameter_field("period", StateGeometry.SCALAR, "block length P (0: pristine)"),
        parameter_field("step", StateGeometry.SCALAR, "updates applied to this matrix"),
        parameter_field(
            "momentum_codes",
            StateGeometry.BLOCK,
            "uint8 indices (B, P), codebook4 two per byte (B, ceil(P/2)); flat in an (N, 1) "
            "slot if P is searched",
        ),
        parameter_field(
            "momentum_scale",
            StateGeometry.BLOCK,
            "fp32 block maxima (B, 1), in an (N, 1) slot if P is searched",
        ),
        parameter_field("matrix_cols", StateGeometry.SCALAR, "the matrix width C of the codes"),
        parameter_field("momentum_buffer", StateGeometry.PARAMETER, "momentum, codec none"),
        parameter_field("normuon_v", StateGeometry.ROW, "fp32 NorMuon row statistics (R, 1)"),
        parameter_field("normuon_step", StateGeometry.SCALAR, "NorMuon bias-correction age"),
    )


def _momentum_variants(
    prefix: str, momentum: tuple[str, ...], layouts: frozenset[ParameterLayout], extent: StateExtent
) -> list[StateVariant]:
    base = ("period", "step", *momentum)
    return [
        StateVariant(
            name=prefix, fields=base, layouts=layouts, extent=extent, parameter_ranks=(2,)
        ),
        StateVariant(
            name=f"{prefix}_normuon",
            fields=(*base, *_NORMUON),
            layouts=layouts,
            extent=extent,
            parameter_ranks=(2,),
        ),
    ]


def _variants(
    codecs: tuple[str, ...],
    global_shards: bool,
    local_shards: bool,
    installed: frozenset[ParameterLayout],
) -> tuple[StateVariant, ...]:
    """The uninitialized variant, then each kept codec's (``installed``: the layouts
    ``post_sharding`` installed; a whole-parameter owner holds the full matrix's state)."""
    variants = [
        StateVariant(
            name="uninitialized",
            fields=("period",),
            layouts=frozenset({_REPLICATED, _SHARD}) | installed,
            extent=StateExtent.METADATA_ONLY,
            initialized=False,
        )
    ]
    global_layouts = frozenset({_REPLICATED, _SHARD}) if global_shards else frozenset({_REPLICATED})
    global_layouts |= installed & {ParameterLayout.WHOLE_PARAMETER_OWNER}
    for codec in codecs:
        prefix = VARIANT_PREFIX[codec]
        momentum = (
            ("momentum_codes", "momentum_scale", "matrix_cols")
            if codec in CODEBOOK_CODECS
            else ("momentum_buffer",)
        )
        variants += _momentum_variants(
            prefix, momentum, global_layouts, StateExtent.GLOBAL_PARAMETER
        )
        if local_shards:
            variants += _momentum_variants(
                f"{prefix}_local", momentum, frozenset({_SHARD}), StateExtent.LOCAL_STORAGE
            )
    return tuple(variants)


def _training(modes: set[str]) -> tuple[TrainingSupport, ...]:
    training = [TrainingSupport(layout=_REPLICATED, process_group_scope=ProcessGroupScope.NONE)]
    for mode in ("exact", "distributed", "approx"):
        if mode in modes:
            training.append(
                TrainingSupport(
                    layout=_SHARD,
                    process_group_scope=ProcessGroupScope.INFERRED_DEVICE_MESH,
                    sharded_mode=mode,
                    requires_complete_logical_matrix=mode != "approx",
                )
            )
    return tuple(training)


def _checkpoints(
    optimizer: ShellInterface, modes: set[str], collective: bool
) -> tuple[CheckpointSupport, ...]:
    scope = checkpoint_scope(optimizer, collective)
    layouts = frozenset({_REPLICATED, _SHARD}) | installed_layouts(optimizer)
    global_only = "approx" not in modes
    native = CheckpointSupport(
        transport=CheckpointTransport.NATIVE_OPTIMIZER,
        same_topology=layouts,
        process_group_scope=scope,
        topology_changing=frozenset({_SHARD}) if global_only else frozenset(),
        topology_change_kinds=frozenset({TopologyChange.WORLD_SIZE_OWNER_REDISTRIBUTION})
        if global_only
        else frozenset(),
        requires_collective=collective,
        atomic_load=True,
    )
    if global_only:
        return (native,)
    rank_local = CheckpointSupport(
        transport=CheckpointTransport.PYTORCH_RANK_LOCAL,
        same_topology=layouts,
        process_group_scope=scope,
        requires_collective=collective,
        atomic_load=True,
    )
    return (native, rank_local)


def muon_contract(optimizer: ShellInterface) -> OptimizerContract:
    """Build the contract from the live options and failure scope; reads only."""
    modes = {str(group["sharded_mode"]) for group in optimizer.param_groups}
    collective = len(optimizer.step_failure_scope()) > 0
    capabilities = OptimizerCapabilities(
        training=_training(modes) + finalized_training(optimizer),
        checkpoints=_checkpoints(optimizer, modes, collective),
        precisions=frozenset(
            {Precision.FLOAT32, Precision.BFLOAT16, Precision.FLOAT16, Precision.FLOAT64}
        ),
        supported_parameter_ranks=(2,),
        **api_flags(optimizer),
    )
    layout = OptimizerStateLayout(
        fields=_fields(),
        parameter_variants=_variants(
            group_codecs(optimizer.param_groups),
            global_shards=bool(modes & {"exact", "distributed"}),
            local_shards="approx" in modes,
            installed=installed_layouts(optimizer),
        ),
    )
    return OptimizerContract(
        implementation="gefen.muon.GefenMuon", state_layout=layout, capabilities=capabilities
    )
