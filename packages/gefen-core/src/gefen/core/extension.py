"""The extension API of gefen-core: everything a sibling optimizer may build on.

gefen-muon and gefen-hybrid import from gefen-core only ``gefen.core`` (the user API),
this module, and ``gefen.core.testing`` in their own testing helpers; the lint check
(``tools/private_access.py``) refuses any other gefen-core import in a sibling distribution,
so the boundary between the distributions is this list and nothing else. A third-party optimizer
built on the shell uses the same list. Names are grouped by what they are for:

* the shell and its transactions: ``OptimizerShell`` (subclass it), ``ShellInterface`` (its
  public members, to type helpers with instead of the class), ``PreparedLoad``,
  ``PreparedFinalization``, ``run_step`` / ``run_load`` / ``STEP_SIGNATURE`` /
  ``HookedStepState`` (the step and load templates for a composite), ``copy_containers``;
* state entries: ``CodecKeys``, ``EntrySpec``, ``allocate_entry``, ``is_initialized``,
  ``stage_entries`` / ``stage_entry``, ``absorb_entry`` (a format 2 entry as format 1) and
  ``TEMPLATE_FORMAT``, ``flattened_dcp_hint`` (why a load may lack its extras),
  ``PendingEntry`` (an entry a post-vote collective assembles),
  ``torch_indices`` (torch's ``state_dict`` numbering of the parameters);
* codebook learning: ``CodebookInput``, ``StagedLearning``, ``select_period``, ``row_period``;
* FSDP2 resharding: ``row_sharded_mesh``, ``every_rank_has_rows``, ``local_rows``,
  ``first_logical_element``;
* the fused momentum: ``MomentumAdvancer``, ``eager_advance_momentum_``, ``fused_momentum``,
  ``resolve_default``;
* option and input checks: ``check_flag``, ``check_lr``, ``check_optimizer_wide``,
  ``check_torch_flags``,
  ``group_uses_codebook``, ``group_codecs`` (a group's own ``momentum_codec``),
  ``check_group_codec``, ``codes_per_byte``, ``variant_prefix``, ``CODEBOOK_CODECS``,
  ``VARIANT_PREFIX`` (codebook8 and codebook4), ``lr_value``, ``real_value``,
  ``amp_scaling_supported``, ``check_finite_gradients``, ``validate_gradient_structure``,
  ``is_dtensor``, ``local_tensor``, ``parameter_label``, ``iter_parameters``;
* contracts: ``api_flags``, ``checkpoint_scope``, ``extras_field``, ``finalized_training``,
  ``installed_layouts``, ``parameter_field``.

Everything here is covered by gefen-core's own tests (``tests/test_core_extension_api.py``
checks the list itself). Changing a signature here is a breaking change of gefen-core.
"""

from __future__ import annotations

from gefen.core import fused as _fused
from gefen.core.checkpoint import PreparedLoad
from gefen.core.contract import (
    api_flags,
    checkpoint_scope,
    extras_field,
    finalized_training,
    installed_layouts,
    parameter_field,
)
from gefen.core.deferred import PendingEntry
from gefen.core.finalization import PreparedFinalization
from gefen.core.kernels import row_period, select_period
from gefen.core.learning import CodebookInput, StagedLearning
from gefen.core.loading import stage_entries, stage_entry
from gefen.core.options import (
    CODEBOOK_CODECS,
    VARIANT_PREFIX,
    check_flag,
    check_group_codec,
    check_lr,
    check_optimizer_wide,
    check_torch_flags,
    codes_per_byte,
    group_codecs,
    group_uses_codebook,
    lr_value,
    real_value,
    variant_prefix,
)
from gefen.core.participant import ShellInterface
from gefen.core.resharding import (
    every_rank_has_rows,
    first_logical_element,
    local_rows,
    row_sharded_mesh,
)
from gefen.core.saving import torch_indices
from gefen.core.shell import OptimizerShell
from gefen.core.state import CodecKeys, EntrySpec, allocate_entry, is_initialized
from gefen.core.template import TEMPLATE_FORMAT, absorb_entry, flattened_dcp_hint
from gefen.core.transaction import (
    STEP_SIGNATURE,
    HookedStepState,
    copy_containers,
    run_load,
    run_step,
)
from gefen.core.updaters import MomentumAdvancer, eager_advance_momentum_
from gefen.core.validation import (
    amp_scaling_supported,
    check_finite_gradients,
    is_dtensor,
    iter_parameters,
    local_tensor,
    parameter_label,
    validate_gradient_structure,
)

__all__ = [
    "CODEBOOK_CODECS",
    "STEP_SIGNATURE",
    "TEMPLATE_FORMAT",
    "VARIANT_PREFIX",
    "CodebookInput",
    "CodecKeys",
    "EntrySpec",
    "HookedStepState",
    "MomentumAdvancer",
    "OptimizerShell",
    "PendingEntry",
    "PreparedFinalization",
    "PreparedLoad",
    "ShellInterface",
    "StagedLearning",
    "absorb_entry",
    "allocate_entry",
    "amp_scaling_supported",
    "api_flags",
    "check_finite_gradients",
    "check_flag",
    "check_group_codec",
    "check_lr",
    "check_optimizer_wide",
    "check_torch_flags",
    "checkpoint_scope",
    "codes_per_byte",
    "copy_containers",
    "eager_advance_momentum_",
    "every_rank_has_rows",
    "extras_field",
    "finalized_training",
    "first_logical_element",
    "flattened_dcp_hint",
    "fused_momentum",
    "group_codecs",
    "group_uses_codebook",
    "installed_layouts",
    "is_dtensor",
    "is_initialized",
    "iter_parameters",
    "local_rows",
    "local_tensor",
    "lr_value",
    "parameter_field",
    "parameter_label",
    "real_value",
    "resolve_default",
    "row_period",
    "row_sharded_mesh",
    "run_load",
    "run_step",
    "select_period",
    "stage_entries",
    "stage_entry",
    "torch_indices",
    "validate_gradient_structure",
    "variant_prefix",
]


def fused_momentum(device_type: str, codebook_size: int = 256) -> MomentumAdvancer:
    """A fused ``MomentumAdvancer`` for ``device_type`` and a ``codebook_size``-value codebook
    (proven on a tiny input; raises when none builds). Looked up in ``gefen.core.fused`` at
    each call, so a test's patch applies."""
    return _fused.fused_momentum(device_type, codebook_size)


def resolve_default(fused: bool | None) -> bool | None:
    """The effective ``fused`` option: None (try, fall back with a warning), True or False."""
    return _fused.resolve_default(fused)
