"""Schema constants and the eleven enums of the contract vocabulary (spec 40 §4).

Member values are the wire form and part of the schema: renaming a value is a schema change.
Code that needs the text of a member uses ``member.value``; ``str(member)`` and
``format(member)`` differ between Python versions for ``str``-mixin enums.
"""

from __future__ import annotations

from enum import Enum

CONTRACT_SCHEMA_VERSION = 1
IDENTITY_SCHEMA_VERSION = 1


class StateScope(str, Enum):
    """Who owns a state field; ``DERIVED`` is a rebuildable cache, never authoritative."""

    OPTIMIZER_COMMON = "optimizer_common"
    PARAMETER = "parameter"
    DERIVED = "derived"


class StateGeometry(str, Enum):
    """Logical shape kind of a state field, independent of sharding."""

    SCALAR = "scalar"
    CODEBOOK = "codebook"
    PARAMETER = "parameter"
    BLOCK = "block"
    ROW = "row"
    COLUMN = "column"
    OPAQUE = "opaque"


class StateKeyMatch(str, Enum):
    """How a field name matches live state keys."""

    EXACT = "exact"
    PREFIX = "prefix"


class StateExtent(str, Enum):
    """Extent a per-parameter state variant represents."""

    METADATA_ONLY = "metadata_only"
    LOCAL_STORAGE = "local_storage"
    GLOBAL_PARAMETER = "global_parameter"
    OWNER_PARAMETER = "owner_parameter"


class ParameterStateRole(str, Enum):
    """Where a per-parameter state variant may appear."""

    ANY = "any"
    OWNER = "owner"
    NON_OWNER = "non_owner"


class ParameterLayout(str, Enum):
    """Concrete parameter layouts an optimizer may train or checkpoint."""

    REPLICATED = "replicated"
    FLATTENED_ELEMENT_SHARD = "flattened_element_shard"
    WHOLE_PARAMETER_OWNER = "whole_parameter_owner"
    DTENSOR_1D_DEFAULT_WORLD = "dtensor_1d_default_world"


class PlacementKind(str, Enum):
    """Placement of a parameter on one mesh axis."""

    REPLICATE = "replicate"
    FLAT_SHARD = "flat_shard"
    DIMENSION_SHARD = "dimension_shard"
    WHOLE_PARAMETER_OWNER = "whole_parameter_owner"


class ProcessGroupScope(str, Enum):
    """Where a training or checkpoint path gets its collective group."""

    NONE = "none"
    DEFAULT_WORLD = "default_world"
    INFERRED_DEVICE_MESH = "inferred_device_mesh"
    ADAPTER_DEFINED = "adapter_defined"


class CheckpointTransport(str, Enum):
    """Checkpoint transport kinds."""

    NATIVE_OPTIMIZER = "native_optimizer"
    PYTORCH_RANK_LOCAL = "pytorch_rank_local"
    COMPOSITE_NATIVE = "composite_native"
    CANONICAL_LOCAL = "canonical_local"
    CANONICAL_GLOBAL = "canonical_global"


class TopologyChange(str, Enum):
    """Topology change a checkpoint transport survives."""

    WORLD_SIZE_OWNER_REDISTRIBUTION = "world_size_owner_redistribution"
    PLACEMENT_RESHARD = "placement_reshard"


class Precision(str, Enum):
    """Accepted parameter and gradient storage dtypes."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT64 = "float64"
