"""``Gefen.optimizer_contract()`` (docs/core.md §10): a pure read of the live options.

The variants follow the state codec of ``gefen.core.state``: ``uninitialized`` holds only the
period; the initialized variants are limited to the live codec and to the families the live
groups can select, and the block variants are declared twice by extent (replicated tensors and
DTensor local shards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

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
    StateScope,
    StateVariant,
    TopologyChange,
    TrainingSupport,
)
from gefen.core.options import CODEBOOK_CODECS, VARIANT_PREFIX, group_codecs

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = [
    "api_flags",
    "checkpoint_scope",
    "extras_field",
    "finalized_training",
    "gefen_contract",
    "installed_layouts",
    "parameter_field",
]

_REPLICATED = ParameterLayout.REPLICATED
_SHARD = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD


def parameter_field(name: str, geometry: StateGeometry, description: str) -> StateField:
    """A checkpointed per-parameter state field."""
    return StateField(
        name=name,
        scope=StateScope.PARAMETER,
        geometry=geometry,
        checkpointed=True,
        description=description,
    )


def extras_field(description: str) -> StateField:
    """The one checkpointed ``OPTIMIZER_COMMON`` field ``gefen`` (the extras of §8.1)."""
    return StateField(
        name="gefen",
        scope=StateScope.OPTIMIZER_COMMON,
        geometry=StateGeometry.OPAQUE,
        checkpointed=True,
        description=description,
    )


# Format 2 (docs/core.md §8.7) shapes a searched period's tensors by N alone, so a fresh
# optimizer's are the same as a trained one's.
_SLOTS = "{} (B, P); (N, 1) where the first gradient searches P"
_SLOT = "; the first B rows of an (N, 1) slot where P is searched"


def _fields() -> tuple[StateField, ...]:
    return (
        extras_field("the extras: format, global step, codebook slot, flags, initialized flags"),
        parameter_field("period", StateGeometry.SCALAR, "block length P (0: pristine)"),
        parameter_field("step", StateGeometry.SCALAR, "momentum age"),
        parameter_field(
            "momentum_codes",
            StateGeometry.BLOCK,
            _SLOTS.format("uint8 indices")
            + "; codebook4: two 4-bit indices per byte, (B, ceil(P/2)), flat in the slot",
        ),
        parameter_field("momentum_scale", StateGeometry.BLOCK, "fp32 block maxima (B, 1)" + _SLOT),
        parameter_field("momentum", StateGeometry.BLOCK, _SLOTS.format("codec none, fp32")),
        parameter_field("v_block", StateGeometry.BLOCK, "fp32 block second moment (B, 1)" + _SLOT),
        parameter_field("v_row", StateGeometry.ROW, "fp32 row second moment (R,)"),
        parameter_field("v_col", StateGeometry.COLUMN, "fp32 column second moment (C,)"),
        parameter_field("v_step", StateGeometry.SCALAR, "age of the second-moment family"),
    )


def _variants(
    codecs: tuple[str, ...], factored: bool, installed: frozenset[ParameterLayout]
) -> tuple[StateVariant, ...]:
    """The uninitialized variant, then each codec's (``codecs``: every codec some group
    keeps; ``installed``: the layouts ``post_sharding`` installed)."""
    variants = [
        StateVariant(
            name="uninitialized",
            fields=("period",),
            layouts=frozenset({_REPLICATED, _SHARD}) | installed,
            extent=StateExtent.METADATA_ONLY,
            initialized=False,
        )
    ]
    local = frozenset({_SHARD}) | (installed & {ParameterLayout.FLATTENED_ELEMENT_SHARD})
    for codec in codecs:
        variants += _codec_variants(codec, factored, local)
    return tuple(variants)


def _codec_variants(
    codec: str, factored: bool, local: frozenset[ParameterLayout]
) -> list[StateVariant]:
    prefix = VARIANT_PREFIX[codec]
    coded = codec in CODEBOOK_CODECS
    momentum = ("momentum_codes", "momentum_scale") if coded else ("momentum",)
    block_fields = ("period", "step", *momentum, "v_block", "v_step")
    variants = [
        StateVariant(
            name=f"{prefix}_block",
            fields=block_fields,
            layouts=frozenset({_REPLICATED}),
            extent=StateExtent.GLOBAL_PARAMETER,
        ),
        StateVariant(
            name=f"{prefix}_block_local",
            fields=block_fields,
            layouts=local,  # a DTensor's rows, a flattened slice
            extent=StateExtent.LOCAL_STORAGE,
        ),
    ]
    if factored:
        variants.append(
            StateVariant(
                name=f"{prefix}_factored",
                fields=("period", "step", *momentum, "v_row", "v_col", "v_step"),
                layouts=frozenset({_REPLICATED}),
                extent=StateExtent.GLOBAL_PARAMETER,
                parameter_ranks=(2,),
            )
        )
    return variants


def _checkpoints(optimizer: ShellInterface, collective: bool) -> tuple[CheckpointSupport, ...]:
    """Native (DCP reshards row-sharded state, docs/core.md §9.1) and rank-local transports,
    over the installed layouts too."""
    layouts = frozenset({_REPLICATED, _SHARD}) | installed_layouts(optimizer)
    scope = checkpoint_scope(optimizer, collective)
    return (
        CheckpointSupport(
            transport=CheckpointTransport.NATIVE_OPTIMIZER,
            same_topology=layouts,
            process_group_scope=scope,
            topology_changing=frozenset({_SHARD}),
            topology_change_kinds=frozenset({TopologyChange.PLACEMENT_RESHARD}),
            requires_collective=collective,
            atomic_load=True,
        ),
        CheckpointSupport(
            transport=CheckpointTransport.PYTORCH_RANK_LOCAL,
            same_topology=layouts,
            process_group_scope=scope,
            requires_collective=collective,
            atomic_load=True,
        ),
    )


def installed_layouts(optimizer: ShellInterface) -> frozenset[ParameterLayout]:
    """The layouts ``post_sharding`` installed (none before)."""
    finalized = optimizer.finalized
    return frozenset() if finalized is None else frozenset(s.layout for s, _ in finalized.shards)


def checkpoint_scope(optimizer: ShellInterface, collective: bool) -> ProcessGroupScope:
    """Where a checkpoint's collectives get their group: the installed binding's (the adapter's),
    else the parameters' mesh; none without a scope."""
    if not collective:
        return ProcessGroupScope.NONE
    if optimizer.finalized is not None and optimizer.finalized.binding is not None:
        return ProcessGroupScope.ADAPTER_DEFINED
    return ProcessGroupScope.INFERRED_DEVICE_MESH


def api_flags(optimizer: ShellInterface) -> dict[str, bool]:
    """The explicit-scope flags (§13): the API ones are static, the identity ones live."""
    finalized = optimizer.finalized is not None
    return {
        "post_sharding": True,
        "shard_rebinding": True,
        "explicit_process_group_codebook_scope": True,
        "canonical_parameter_fqns": finalized,
        "stable_shard_identity": finalized,
    }


def finalized_training(optimizer: ShellInterface) -> tuple[TrainingSupport, ...]:
    """Once finalized, the installed layouts, trained with the adapter's process group; a
    whole-parameter owner's update must be copied to the non-owners after each step."""
    finalized = optimizer.finalized
    if finalized is None:
        return ()
    layouts = sorted({shard.layout for shard, _ in finalized.shards}, key=lambda x: x.value)
    return tuple(
        TrainingSupport(
            layout=layout,
            process_group_scope=ProcessGroupScope.ADAPTER_DEFINED,
            requires_post_step_parameter_sync=layout is ParameterLayout.WHOLE_PARAMETER_OWNER,
        )
        for layout in layouts
    )


def gefen_contract(
    optimizer: ShellInterface, groups: Sequence[Mapping[str, Any]], implementation: str
) -> OptimizerContract:
    """Build the contract from the live options and failure scope; reads only."""
    codecs = group_codecs(groups)
    # a live edit to the block family migrates each entry at its next update (§8.4)
    factored = any(bool(group.get("factored_v_2d")) for group in groups) or any(
        "v_row" in entry for entry in optimizer.state.values()
    )
    collective = len(optimizer.step_failure_scope()) > 0
    capabilities = OptimizerCapabilities(
        training=(
            TrainingSupport(layout=_REPLICATED, process_group_scope=ProcessGroupScope.NONE),
            TrainingSupport(
                layout=_SHARD, process_group_scope=ProcessGroupScope.INFERRED_DEVICE_MESH
            ),
            *finalized_training(optimizer),
        ),
        checkpoints=_checkpoints(optimizer, collective),
        precisions=frozenset(
            {Precision.FLOAT32, Precision.BFLOAT16, Precision.FLOAT16, Precision.FLOAT64}
        ),
        **api_flags(optimizer),  # type: ignore[arg-type]
    )
    variants = _variants(codecs, factored, installed_layouts(optimizer))
    layout = OptimizerStateLayout(fields=_fields(), parameter_variants=variants)
    return OptimizerContract(
        implementation=implementation, state_layout=layout, capabilities=capabilities
    )
