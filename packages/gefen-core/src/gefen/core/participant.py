"""The public interface of the optimizer shell that its helper modules program against.

The checkpoint transaction (``gefen.core.checkpoint``, ``gefen.core.loading``), codebook
learning (``gefen.core.codebook_ops``, ``gefen.core.scoped``) and post-sharding finalization
(``gefen.core.finalization``) each take an optimizer and use only the members listed here:
read-only views of its progress, the extension points a subclass implements, and one
``publish_*`` method per transaction that writes what the transaction staged. They never touch
a private name of the optimizer, and they import this protocol rather than the shell, so no
module imports the shell back (not even for typing).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from torch import Tensor

from gefen.core.learning import CodebookInput, StagedLearning
from gefen.core.sharded_layout import Finalized
from gefen.core.state import CodecKeys, EntrySpec
from gefen.dist import Channel, GuardedOperation, ProcessGroupBinding

__all__ = ["ShellInterface"]


class ShellInterface(Protocol):
    """What ``OptimizerShell`` (``Gefen``, ``GefenMuon``) offers its transactions."""

    OWNER_NAME: ClassVar[str]
    CHECKPOINT_OWNER: ClassVar[str]
    OPTIMIZER_WIDE: ClassVar[tuple[str, ...]]
    OPTIONAL_EXTRAS: ClassVar[tuple[str, ...]]
    TOP_LEVEL_EXTRAS: ClassVar[tuple[str, ...]]
    CODEC_KEYS: ClassVar[CodecKeys]
    REQUIRE_2D: ClassVar[bool]
    LAYOUT_OPTIONS: ClassVar[tuple[str, ...]]
    POST_SHARDING_LAYOUTS: ClassVar[tuple[Any, ...]]
    TEMPLATE_COMPLETE: ClassVar[bool]
    state: defaultdict[Tensor, Any]
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]

    # -- read-only views -------------------------------------------------------------------

    @property
    def global_step(self) -> int: ...
    @property
    def codebook(self) -> Tensor | None: ...
    @property
    def finalized(self) -> Finalized | None: ...
    @property
    def binding(self) -> ProcessGroupBinding | None: ...
    @property
    def uses_codebook(self) -> bool: ...
    def indexed_params(self) -> list[tuple[int, dict[str, Any], Tensor]]: ...
    def step_failure_scope(self) -> tuple[Channel, ...]: ...
    def guarded_operation(self) -> GuardedOperation: ...
    def hand_out(self, state_dict: dict[str, Any]) -> dict[str, Any]: ...

    # -- extension points a subclass implements --------------------------------------------

    def validate_group(self, group: Mapping[str, Any]) -> None: ...
    def entry_spec(self, group: Mapping[str, Any], param: Tensor) -> EntrySpec: ...
    def template_period(self, group: Mapping[str, Any], param: Tensor) -> int | None: ...
    def template_keys(self, group: Mapping[str, Any], param: Tensor) -> tuple[str, ...]: ...
    def row_sharded(self) -> bool: ...
    def presents_rows(self, group: Mapping[str, Any], param: Tensor) -> bool: ...
    def assembles_rows(self, group: Mapping[str, Any], param: Tensor) -> bool: ...
    def select_new_period(
        self, group: Mapping[str, Any], param: Tensor, view: Tensor, shape: tuple[int, ...]
    ) -> int | None: ...
    def codebook_inputs(self, operation: GuardedOperation) -> list[CodebookInput]: ...
    def checkpoint_extras(self, entries: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]: ...
    def rank_local_checkpoint(self) -> bool: ...
    def replicated_positions(self, groups: list[dict[str, Any]]) -> list[int] | None: ...
    def stage_entries(
        self,
        saved_state: Mapping[int, Any],
        groups: list[dict[str, Any]],
        extras: Mapping[str, Any],
    ) -> dict[int, dict[str, Any]]: ...

    # -- the voted preambles and agreement of the codebook transactions --------------------

    def initialize_preamble(self) -> list[int] | None: ...
    def refresh_preamble(self) -> list[int] | None: ...
    def check_step_agreement(self) -> None: ...

    # -- publication: one per transaction, assignment only ---------------------------------

    def publish_learning(self, learning: StagedLearning) -> None: ...
    def publish_load(
        self,
        state: defaultdict[Tensor, Any],
        param_groups: list[dict[str, Any]],
        global_step: int,
        codebook: Tensor | None,
    ) -> None: ...
    def publish_finalization(self, finalized: Finalized, groups: list[Any]) -> None: ...
