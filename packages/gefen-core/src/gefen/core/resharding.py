"""FSDP2 state that DCP reshards to another world size (docs/core.md §9.1).

FSDP2 shards every parameter by rows (``Shard(0)``) over one mesh. Gefen's DTensor period keeps
each block inside one row (one block per row, period 1 for a vector; rows under 8 elements give
blocks under 8, which costs bytes on a rare shape, never correctness), so a rank's codes, scales
and second moments belong to exactly its own rows. When every parameter is sharded that way over
one mesh of two or more ranks (or, under HSDP, over the second dimension of one 2-D mesh and
replicated over the first), the optimizer is *row-sharded*: it learns one codebook from the
histogram summed over the mesh, its counters are equal on every rank that holds rows (a rank
without rows of a parameter learns that entry's counters at save, ``agree_counters``), and
``state_dict()`` presents the per-row tensors as DTensors with the parameter's placement.
``get_optimizer_state_dict``, ``dcp.save``, ``dcp.load`` and ``set_optimizer_state_dict`` then
reshard them with no code of ours in between. Anything else keeps the rank-local state of
docs/dist.md §10.3.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.core.validation import is_dtensor, local_tensor, parameter_label
from gefen.dist import Channel, mesh_key

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from gefen.core.participant import ShellInterface

__all__ = [
    "COUNTERS",
    "agree_counters",
    "as_row_dtensors",
    "check_row_periods",
    "dtensor_period",
    "every_rank_has_rows",
    "first_logical_element",
    "local_rows",
    "row_sharded_mesh",
    "rows_on_every_rank",
    "summed_over",
]


def dtensor_period(param: Tensor) -> int | None:
    """A DTensor parameter's period, from its shape alone: one block per row of its local
    shard, ``prod(shape[1:])``, for two or more dimensions (below 8 elements too: a block must
    not cross a row), 1 for a vector; None for a parameter with no element at all."""
    if math.prod(param.shape) == 0:
        return None
    return math.prod(local_tensor(param).shape[1:]) if param.dim() >= 2 else 1


def every_rank_has_rows(rows: int, world: int) -> bool:
    """Whether ``torch.chunk`` (FSDP2's split) gives each of ``world`` ranks a row."""
    chunk = -(-rows // world)
    return rows > 0 and -(-rows // chunk) == world


def row_sharded_mesh(
    params: Iterable[Tensor], *, rows_everywhere: bool = True
) -> DeviceMesh | None:
    """The one mesh every parameter (with rows) is row-sharded over, or None; with
    ``rows_everywhere`` every rank must also hold rows of each. Computed from shapes and
    placements alone, so every rank decides alike."""
    mesh: DeviceMesh | None = None
    for param in params:
        if not is_dtensor(param) or param.dim() == 0 or not _rows_placed(param):
            return None
        own: DeviceMesh = param.device_mesh  # type: ignore[attr-defined]
        if mesh is not None and mesh_key(own) != mesh_key(mesh):
            return None
        rows = int(param.shape[0])
        if rows == 0 or (rows_everywhere and not every_rank_has_rows(rows, _shards(param))):
            return None
        mesh = own
    return mesh


def _rows_placed(param: Tensor) -> bool:
    """FSDP2's ``Shard(0)`` over a 1-D mesh, or HSDP's ``(Replicate(), Shard(0))`` over a 2-D
    one (each replica row-sharded alike), with two or more shards."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = param.device_mesh, tuple(param.placements)  # type: ignore[attr-defined]
    expected = {1: (Shard(0),), 2: (Replicate(), Shard(0))}.get(mesh.ndim)
    return placements == expected and _shards(param) >= 2


def rows_on_every_rank(param: Tensor) -> bool:
    """Whether every rank of a row-sharded DTensor's shard dimension holds rows of it."""
    return every_rank_has_rows(param.shape[0], _shards(param))


def _shards(param: Tensor) -> int:
    """The size of the mesh dimension the rows are split over (the last)."""
    mesh = param.device_mesh  # type: ignore[attr-defined]
    return int(mesh.size(mesh.ndim - 1))


def first_logical_element(param: Tensor) -> int:
    """The row-major index, in the whole parameter, of a row-sharded DTensor's first local
    element (0 for any other tensor): stochastic rounding draws by logical index (§6.3)."""
    if not is_dtensor(param) or not _rows_placed(param) or param.dim() == 0:
        return 0
    rows = int(param.shape[0])
    mesh = param.device_mesh  # type: ignore[attr-defined]
    start = min(rows, -(-rows // _shards(param)) * int(mesh.get_local_rank(mesh.ndim - 1)))
    return start * (param.numel() // rows) if rows else 0


def local_rows(value: Tensor, param: Tensor) -> Tensor:
    """This rank's rows (FSDP2's ``torch.chunk`` of dim 0) of a 2-D tensor holding all of a
    row-sharded ``param``'s rows, as a new tensor; any other tensor as it is."""
    rows, held = int(param.shape[0]), int(local_tensor(param).shape[0])
    if value.dim() != 2 or int(value.shape[0]) != rows or held == rows:
        return value
    mesh = param.device_mesh  # type: ignore[attr-defined]
    start = -(-rows // _shards(param)) * int(mesh.get_local_rank(mesh.ndim - 1))
    return value[start : start + held].clone()


def as_row_dtensors(entry: Mapping[str, Any], param: Tensor) -> dict[str, Any]:
    """``entry`` with each per-row tensor (one row per block, blocks inside rows) presented as
    a DTensor sharded like ``param``: (rows, width) globally, this rank's rows locally (a
    tensor of all the rows is cut to this rank's first, ``local_rows``)."""
    from torch.distributed.tensor import DTensor

    rows = int(param.shape[0])
    presented: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, Tensor) and value.dim() == 2:
            width = int(value.shape[1])
            presented[key] = DTensor.from_local(
                local_rows(value, param),
                param.device_mesh,  # type: ignore[attr-defined]
                param.placements,  # type: ignore[attr-defined]
                run_check=False,
                shape=torch.Size((rows, width)),
                stride=(width, 1),
            )
        else:
            presented[key] = value
    return presented


COUNTERS = ("period", "step", "v_step", "normuon_step")
"""The ints of an entry that a rank without rows cannot know (it never updates the entry)."""


def agree_counters(
    presented: Mapping[int, dict[str, Any]], params: Sequence[Tensor], scope: Sequence[Channel]
) -> None:
    """In place: the counters of each entry whose parameter leaves some rank without rows
    become the largest over the mesh, which every rank with rows holds (they update alike), so
    the ints DCP saves once do not depend on which rank wrote them. One MAX all-reduce over the
    shards (the scope's last channel); none where every rank has rows of all."""
    import torch.distributed as dist

    channel = scope[-1]  # the mesh's last dimension: the one its rows are split over
    world = dist.get_world_size(channel.process_group)
    targets = [
        entry
        for position, entry in sorted(presented.items())
        if not every_rank_has_rows(int(params[position].shape[0]), world)
    ]
    if not targets:
        return
    rows = [[_word(entry.get(key, -1)) for key in COUNTERS] for entry in targets]
    words = torch.tensor(rows, dtype=torch.int64, device=channel.device)
    dist.all_reduce(words, op=dist.ReduceOp.MAX, group=channel.process_group)
    for entry, agreed in zip(targets, words.tolist(), strict=True):
        entry.update(
            {key: value for key, value in zip(COUNTERS, agreed, strict=True) if value >= 0}
        )


def _word(value: object) -> int:
    """A counter as an int64 word. Never raises: this rank must not leave the others waiting
    in the all-reduce (a counter past int64 saturates; one that is no int counts as absent,
    and the entry keeps it for the checks that name it)."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return -1
    return max(-1, min(number, 2**63 - 1))


def summed_over(counts: Tensor, scope: Sequence[Channel]) -> Tensor:
    """``counts`` summed exactly (int64) over the shards of a row-sharded optimizer's mesh (its
    scope's last channel; HSDP's replicas hold equal gradients, hence equal sums): the
    histogram every rank of the mesh then solves alike."""
    import torch.distributed as dist

    channel = scope[-1]
    total = counts.to(device=channel.device, dtype=torch.int64, copy=True)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=channel.process_group)
    return total.to(counts.device)


def check_row_periods(
    optimizer: ShellInterface, entries: Mapping[int, Mapping[str, Any]], groups: list[Any]
) -> None:
    """A row-sharded optimizer's staged entries must keep one block per row (a checkpoint saved
    with other periods, say under ``force_2d_period_one``, would not fit the DTensors it saves)."""
    position = 0
    for group_index, group in enumerate(groups):
        for slot, param in enumerate(group["params"]):
            period = entries.get(position, {}).get("period", 0)
            expected = optimizer.template_period(group, param)
            position += 1
            if period in (0, expected):
                continue
            label = parameter_label(group, group_index, slot)
            raise ValueError(
                f"{optimizer.OWNER_NAME} checkpoint: entry {label}: period {period} does not fit "
                f"the row-sharded FSDP2 layout (one block per row: {expected})"
            )
