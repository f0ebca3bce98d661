"""Process-group bindings: a semantic group identity tied to this rank's runtime handle
(docs/dist.md §7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from gefen.contracts import ProcessGroupIdentity
from gefen.dist.backends import backend_allows, backend_name
from gefen.dist.errors import BindingError
from gefen.dist.runtime import distributed_ready
from gefen.dist.scope import Channel

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CheckpointProcessGroupBinding",
    "CodebookProcessGroupBinding",
    "ProcessGroupBinding",
]


def _member_count(identity: object) -> int:
    members = getattr(identity, "ordered_members", ())
    return len(members) if isinstance(members, tuple) else 0


def _require_distributed_available(identity: object) -> None:
    # Runs before every other check: without torch.distributed no multi-member binding can
    # exist, whatever else is wrong with the arguments.
    import torch.distributed as dist

    if _member_count(identity) > 1 and not dist.is_available():
        raise RuntimeError(
            "a multi-member process-group binding requires torch.distributed, which is "
            "unavailable in this build"
        )


def _normalised_device(device: object) -> torch.device:
    if not isinstance(device, (torch.device, str)):
        raise TypeError(
            f"collective_device must be a torch.device or str, got {type(device).__name__}"
        )
    try:
        normalised = torch.device(device)
    except RuntimeError as exc:
        raise BindingError(f"collective_device {device!r} is not a device") from exc
    if normalised.type not in ("cpu", "cuda"):
        raise BindingError(f"collective_device must be a CPU or CUDA device, got {normalised}")
    if normalised.type == "cuda" and normalised.index is None:
        raise BindingError(
            f"collective_device {normalised} must carry an explicit CUDA index (cuda:N)"
        )
    return normalised


def _check_handle(identity: ProcessGroupIdentity, process_group: object) -> None:
    if len(identity.ordered_members) == 1:
        if process_group is not None:
            raise BindingError("a one-member binding must use process_group=None")
        return
    if process_group is None:
        import torch.distributed as dist

        # group.WORLD itself is None until init_process_group: say so, not "pass group.WORLD"
        uninitialized = dist.is_available() and not dist.is_initialized()
        raise BindingError(
            f"a binding of {len(identity.ordered_members)} members requires an explicit "
            "runtime process group; None never means the default world "
            + (
                "(torch.distributed is not initialized: call init_process_group first)"
                if uninitialized
                else "(pass torch.distributed.group.WORLD for the world)"
            )
        )
    from torch.distributed import ProcessGroup

    if not isinstance(process_group, ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup, got "
            f"{type(process_group).__name__} {process_group!r:.80}"
        )


@dataclass(frozen=True, eq=False, init=False)
class ProcessGroupBinding:
    """A ``ProcessGroupIdentity`` bound to this rank's member name, handle and control device.

    Equality and hashing are by object identity, so a swapped binding is detected with ``is``;
    bindings are never serialised and are shared by copies of an optimizer.
    """

    identity: ProcessGroupIdentity
    local_member: str
    process_group: ProcessGroup | None
    collective_device: torch.device

    def __init__(
        self,
        identity: ProcessGroupIdentity,
        local_member: str,
        process_group: ProcessGroup | None,
        collective_device: torch.device | str,
    ) -> None:
        _require_distributed_available(identity)
        if type(identity) is not ProcessGroupIdentity:
            raise TypeError(
                f"identity must be a ProcessGroupIdentity, got {type(identity).__name__}"
            )
        if type(local_member) is not str:
            raise TypeError(f"local_member must be a str, got {type(local_member).__name__}")
        if local_member not in identity.ordered_members:
            raise BindingError(
                f"local_member must belong to the ordered members of "
                f"{identity.semantic_name!r} {identity.ordered_members!r:.200}, got "
                f"{local_member!r}"
            )
        device = _normalised_device(collective_device)
        _check_handle(identity, process_group)
        object.__setattr__(self, "identity", identity)
        object.__setattr__(self, "local_member", local_member)
        object.__setattr__(self, "process_group", process_group)
        object.__setattr__(self, "collective_device", device)

    # -- identity semantics -------------------------------------------------------------------

    def __copy__(self) -> ProcessGroupBinding:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ProcessGroupBinding:
        return self

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"{type(self).__name__} holds a runtime handle and is never serialized")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self.__reduce__()

    # -- properties ---------------------------------------------------------------------------

    @property
    def coordinate(self) -> int:
        """This rank's member index in the identity's order."""
        return self.identity.coordinate(self.local_member)

    @property
    def is_single(self) -> bool:
        return len(self.identity.ordered_members) == 1

    @property
    def sort_key(self) -> tuple[str, tuple[str, ...]]:
        """A rank-invariant order for code that handles several scopes."""
        return (self.identity.semantic_name, self.identity.ordered_members)

    @property
    def channel(self) -> Channel | None:
        if self.is_single:
            return None
        assert self.process_group is not None  # guaranteed by construction
        return Channel(self.process_group, self.collective_device, None, None)

    def failure_scope(self) -> tuple[Channel, ...]:
        channel = self.channel
        return () if channel is None else (channel,)

    # -- runtime validation -------------------------------------------------------------------

    def _fail(self, rule: str) -> NoReturn:
        raise BindingError(f"{type(self).__name__} {self.identity.semantic_name!r}: {rule}")

    def validate_runtime(self) -> None:
        """Check the binding against the live group with local queries only (no collective)."""
        if self.is_single:
            return
        if not distributed_ready():
            raise RuntimeError(
                f"{type(self).__name__} {self.identity.semantic_name!r} requires initialized "
                "torch.distributed"
            )
        import torch.distributed as dist

        group = self.process_group
        try:
            world_size = dist.get_world_size(group)
            ranks = dist.get_process_group_ranks(group)
            rank = dist.get_rank()
            group_rank = dist.get_group_rank(group, rank)  # type: ignore[arg-type]
            backend = backend_name(group)
        except Exception as exc:
            raise BindingError(
                f"{type(self).__name__} {self.identity.semantic_name!r}: current rank must "
                "belong to the process group"
            ) from exc
        self._check_membership(world_size, ranks, rank, group_rank)
        self._check_device(backend)

    def _check_membership(
        self, world_size: int, ranks: list[int], rank: int, group_rank: int
    ) -> None:
        members = self.identity.ordered_members
        if not world_size == len(members) == len(ranks):
            self._fail(
                f"runtime world size {world_size} ({len(ranks)} ranks) does not match "
                f"{len(members)} ordered semantic members"
            )
        if not 0 <= group_rank < len(ranks) or ranks[group_rank] != rank:
            self._fail(f"global rank {rank} is not a consistent member of the runtime group")
        if members[group_rank] != self.local_member:
            self._fail(
                f"runtime group order does not match ordered semantic members: group rank "
                f"{group_rank} is {members[group_rank]!r}, local_member is {self.local_member!r}"
            )

    def _check_device(self, backend: str) -> None:
        device = self.collective_device
        if not backend_allows(backend, device.type):
            self._fail(f"runtime backend {backend} cannot carry collectives on {device}")
        if device.type == "cuda":
            index = device.index if device.index is not None else -1
            if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                self._fail(f"CUDA device is unavailable: {device}")


class CodebookProcessGroupBinding(ProcessGroupBinding):
    """The binding ``post_sharding`` installs as an optimizer's codebook scope."""


class CheckpointProcessGroupBinding(ProcessGroupBinding):
    """The binding a collective checkpoint API accepts through ``checkpoint_binding=``."""
