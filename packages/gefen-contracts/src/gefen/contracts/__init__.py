"""gefen.contracts: the torch-free vocabulary optimizers use to declare what they support.

Every type is an immutable value with exact-type validation and a JSON-compatible primitive form
that round-trips. The conformance helpers live in ``gefen.contracts.conformance``.
"""

from gefen.contracts._version import __version__ as __version__
from gefen.contracts.capabilities import (
    CheckpointSupport,
    OptimizerCapabilities,
    OptimizerChildContract,
    OptimizerContract,
    OptimizerContractProvider,
    TrainingSupport,
)
from gefen.contracts.enums import (
    CONTRACT_SCHEMA_VERSION,
    IDENTITY_SCHEMA_VERSION,
    CheckpointTransport,
    ParameterLayout,
    ParameterStateRole,
    PlacementKind,
    Precision,
    ProcessGroupScope,
    StateExtent,
    StateGeometry,
    StateKeyMatch,
    StateScope,
    TopologyChange,
)
from gefen.contracts.errors import (
    ConformanceError,
    ContractError,
    ContractTypeError,
    ContractValueError,
    PrimitiveFormError,
)
from gefen.contracts.identity import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardPlacement,
)
from gefen.contracts.manifest import ShardingManifest
from gefen.contracts.primitive import canonical_bytes, fingerprint
from gefen.contracts.shards import ShardIdentity
from gefen.contracts.state import OptimizerStateLayout, StateField, StateVariant

__all__ = [
    "CONTRACT_SCHEMA_VERSION",
    "IDENTITY_SCHEMA_VERSION",
    "CheckpointSupport",
    "CheckpointTransport",
    "ConformanceError",
    "ContractError",
    "ContractTypeError",
    "ContractValueError",
    "LogicalRegion",
    "LogicalSlice",
    "OptimizerCapabilities",
    "OptimizerChildContract",
    "OptimizerContract",
    "OptimizerContractProvider",
    "OptimizerStateLayout",
    "ParameterIdentity",
    "ParameterLayout",
    "ParameterStateRole",
    "PlacementKind",
    "Precision",
    "PrimitiveFormError",
    "ProcessGroupIdentity",
    "ProcessGroupScope",
    "ShardIdentity",
    "ShardPlacement",
    "ShardingManifest",
    "StateExtent",
    "StateField",
    "StateGeometry",
    "StateKeyMatch",
    "StateScope",
    "StateVariant",
    "TopologyChange",
    "TrainingSupport",
    "canonical_bytes",
    "fingerprint",
]


def _publish() -> None:
    # Public classes report the package as their home, so reprs, pickles and docs name the
    # stable import path rather than the private module layout.
    for name in __all__:
        value = globals()[name]
        if isinstance(value, type):
            value.__module__ = __name__


_publish()
