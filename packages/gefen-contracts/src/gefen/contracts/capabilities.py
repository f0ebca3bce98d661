"""What an optimizer claims to support, and the contract that bundles it (spec 40 §5).

A ``False`` flag is an explicit "unsupported"; readers never infer support from anything else.
*Static* flags describe the optimizer's class and configuration, *live* flags its current state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gefen.contracts._base import (
    BoolKind,
    ContractValue,
    EnumKind,
    FrozenSetKind,
    IntKind,
    NameKind,
    NestedKind,
    OptionalKind,
    SchemaVersionKind,
    TupleKind,
    meta,
)
from gefen.contracts._check import check_unique, value_error
from gefen.contracts.enums import (
    CONTRACT_SCHEMA_VERSION,
    CheckpointTransport,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    TopologyChange,
)
from gefen.contracts.state import OptimizerStateLayout

_NAME = meta(NameKind())
_FLAG = meta(BoolKind())
_SCOPE = meta(EnumKind(ProcessGroupScope))
# None: any; an empty tuple would claim no mesh at all (a declaration that can never match)
_MESH_DIMENSIONS = meta(OptionalKind(TupleKind(IntKind(minimum=1), unique=True, non_empty=True)))
_LAYOUT_SET = FrozenSetKind(EnumKind(ParameterLayout))


@dataclass(frozen=True, kw_only=True)
class TrainingSupport(ContractValue):
    """One validated training combination of layout and process-group scope."""

    layout: ParameterLayout = field(metadata=meta(EnumKind(ParameterLayout)))
    process_group_scope: ProcessGroupScope = field(metadata=_SCOPE)
    mesh_dimensions: tuple[int, ...] | None = field(default=None, metadata=_MESH_DIMENSIONS)
    sharded_mode: str | None = field(default=None, metadata=meta(OptionalKind(NameKind())))
    requires_complete_parameter_storage: bool = field(default=False, metadata=_FLAG)
    requires_complete_logical_matrix: bool = field(default=False, metadata=_FLAG)
    requires_post_step_parameter_sync: bool = field(default=False, metadata=_FLAG)


@dataclass(frozen=True, kw_only=True)
class CheckpointSupport(ContractValue):
    """One checkpoint transport and what it survives.

    ``atomic_load=True`` promises fail-before-mutation of this optimizer's own state; it is not
    a coordinated all-rank commit and does not cover user hooks.
    """

    transport: CheckpointTransport = field(metadata=meta(EnumKind(CheckpointTransport)))
    same_topology: frozenset[ParameterLayout] = field(metadata=meta(_LAYOUT_SET))
    process_group_scope: ProcessGroupScope = field(metadata=_SCOPE)
    topology_changing: frozenset[ParameterLayout] = field(
        default=frozenset(), metadata=meta(_LAYOUT_SET)
    )
    topology_change_kinds: frozenset[TopologyChange] = field(
        default=frozenset(), metadata=meta(FrozenSetKind(EnumKind(TopologyChange)))
    )
    mesh_dimensions: tuple[int, ...] | None = field(default=None, metadata=_MESH_DIMENSIONS)
    required_sharded_modes: frozenset[str] = field(
        default=frozenset(), metadata=meta(FrozenSetKind(NameKind()))
    )
    requires_collective: bool = field(default=False, metadata=_FLAG)
    atomic_load: bool = field(default=False, metadata=_FLAG)

    def _validate(self) -> None:
        if not self.same_topology and not self.topology_changing:
            rule = "a transport must carry some layout: same_topology or topology_changing"
            raise value_error("CheckpointSupport.same_topology", rule, [])
        if bool(self.topology_changing) != bool(self.topology_change_kinds):
            raise value_error(
                "CheckpointSupport.topology_change_kinds",
                "must be non-empty exactly when topology_changing is non-empty",
                sorted(kind.value for kind in self.topology_change_kinds),
            )


_CANONICAL = frozenset({CheckpointTransport.CANONICAL_LOCAL, CheckpointTransport.CANONICAL_GLOBAL})


@dataclass(frozen=True, kw_only=True)
class OptimizerCapabilities(ContractValue):
    """Training combinations, checkpoint transports, precisions and explicit feature flags."""

    training: tuple[TrainingSupport, ...] = field(
        metadata=meta(
            TupleKind(NestedKind("TrainingSupport"), unique=True, non_empty=True, what="entry")
        )
    )
    checkpoints: tuple[CheckpointSupport, ...] = field(
        default=(),
        metadata=meta(TupleKind(NestedKind("CheckpointSupport"), unique=True, what="entry")),
    )
    precisions: frozenset[Precision] = field(
        metadata=meta(FrozenSetKind(EnumKind(Precision), non_empty=True))
    )
    supported_parameter_ranks: tuple[int, ...] | None = field(
        default=None,
        metadata=meta(OptionalKind(TupleKind(IntKind(minimum=0), unique=True, non_empty=True))),
    )
    canonical_parameter_fqns: bool = field(default=False, metadata=_FLAG)
    stable_shard_identity: bool = field(default=False, metadata=_FLAG)
    explicit_process_group_codebook_scope: bool = field(default=False, metadata=_FLAG)
    shard_rebinding: bool = field(default=False, metadata=_FLAG)
    post_sharding: bool = field(default=False, metadata=_FLAG)

    @property
    def canonical_state_io(self) -> bool:
        """Derived from ``checkpoints`` so it can never contradict them."""
        return any(entry.transport in _CANONICAL for entry in self.checkpoints)


@dataclass(frozen=True, kw_only=True)
class OptimizerChildContract(ContractValue):
    """A composite's child: its role, implementation and contract (``None`` if it has none)."""

    role: str = field(metadata=_NAME)
    implementation: str = field(metadata=_NAME)
    contract: OptimizerContract | None = field(
        metadata=meta(OptionalKind(NestedKind("OptimizerContract")))
    )


@dataclass(frozen=True, kw_only=True)
class OptimizerContract(ContractValue):
    """Everything an optimizer declares: state layout, capabilities and composite children."""

    implementation: str = field(metadata=_NAME)
    state_layout: OptimizerStateLayout = field(metadata=meta(NestedKind("OptimizerStateLayout")))
    capabilities: OptimizerCapabilities = field(metadata=meta(NestedKind("OptimizerCapabilities")))
    children: tuple[OptimizerChildContract, ...] = field(
        default=(), metadata=meta(TupleKind(NestedKind("OptimizerChildContract")))
    )
    schema_version: int = field(
        default=CONTRACT_SCHEMA_VERSION, metadata=meta(SchemaVersionKind(CONTRACT_SCHEMA_VERSION))
    )

    def _validate(self) -> None:
        roles = tuple(child.role for child in self.children)
        check_unique("OptimizerContract.children", roles, "role")
        supported = self.capabilities.supported_parameter_ranks
        for index, variant in enumerate(self.state_layout.parameter_variants):
            ranks = variant.parameter_ranks
            if supported is not None and ranks is not None and not set(ranks) & set(supported):
                where = (
                    f"OptimizerContract.state_layout.parameter_variants[{index}].parameter_ranks"
                )
                rule = f"must meet capabilities.supported_parameter_ranks {supported}"
                raise value_error(where, rule, ranks)

    def child(self, role: str) -> OptimizerChildContract | None:
        """The child with ``role``, or ``None``."""
        return next((child for child in self.children if child.role == role), None)


@runtime_checkable
class OptimizerContractProvider(Protocol):
    """An object that publishes its contract.

    ``optimizer_contract()`` recomputes the contract from live configuration on every call,
    performs no collective and no mutation, returns equal contracts for equal configuration and
    never raises on a valid optimizer (a dynamic claim whose readiness check fails is simply not
    claimed).
    """

    def optimizer_contract(self) -> OptimizerContract: ...
