"""The rank-local checkpoint transport's topology header and its checks (docs/dist.md §10.3).

State that only means something on the rank that saved it (GefenMuon's approx shards) is
stored beside a header describing that rank's place in its failure scope, built only from
content that survives a restart (never group names, which are per-process counters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gefen.dist.errors import GroupAgreementError
from gefen.dist.scope import Channel
from gefen.dist.transport import all_gather_records

__all__ = ["check_rank_local_header", "check_rank_local_records", "rank_local_header"]

RANK_LOCAL_HEADER_VERSION = 1
_HEADER_FIELDS = ("version", "world_size", "rank", "channels")
_CHANNEL_FIELDS = ("mesh_key", "mesh_dim", "group_ranks", "group_rank", "group_size")


def _channel_record(channel: Channel) -> dict[str, Any]:
    import torch.distributed as dist

    group = channel.process_group
    key = channel.mesh_key
    return {
        "mesh_key": None if key is None else [key[0], list(key[1]), list(key[2])],
        "mesh_dim": channel.mesh_dim,
        "group_ranks": list(dist.get_process_group_ranks(group)),
        "group_rank": dist.get_group_rank(group, dist.get_rank()),
        "group_size": dist.get_world_size(group),
    }


def rank_local_header(scope: Sequence[Channel]) -> dict[str, Any]:
    """This rank's topology in ``scope``, as a JSON primitive (local queries only)."""
    channels = tuple(scope)
    if not channels:
        return {"version": RANK_LOCAL_HEADER_VERSION, "world_size": 1, "rank": 0, "channels": []}
    import torch.distributed as dist

    return {
        "version": RANK_LOCAL_HEADER_VERSION,
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "channels": [_channel_record(channel) for channel in channels],
    }


def _same(saved: object, live: object) -> bool:
    """Equal and of the same type at every level: a saved ``True`` is not a live rank ``1``."""
    if isinstance(live, list):
        return (
            isinstance(saved, list)
            and len(saved) == len(live)
            and all(_same(old, new) for old, new in zip(saved, live, strict=True))
        )
    return type(saved) is type(live) and saved == live


def _first_difference(saved: object, live: dict[str, Any]) -> str | None:
    """The name of the first field where ``saved`` differs from ``live``, in header order."""
    if not isinstance(saved, dict):
        return "header"
    for field in _HEADER_FIELDS:
        if field == "channels":
            continue
        if field not in saved or not _same(saved[field], live[field]):
            return field
    saved_channels = saved.get("channels")
    if not isinstance(saved_channels, list) or len(saved_channels) != len(live["channels"]):
        return "channels"
    for index, (old, new) in enumerate(zip(saved_channels, live["channels"], strict=True)):
        if not isinstance(old, dict):
            return f"channels[{index}]"
        for field in _CHANNEL_FIELDS:
            if field not in old or not _same(old[field], new[field]):
                return f"channels[{index}].{field}"
        extra = sorted(set(old) - set(_CHANNEL_FIELDS))
        if extra:
            return f"channels[{index}].{extra[0]}"
    extra = sorted(set(saved) - set(_HEADER_FIELDS))
    return extra[0] if extra else None


def check_rank_local_header(saved: object, scope: Sequence[Channel]) -> None:
    """Refuse a rank-local file saved by another rank, world size or mesh (local check).

    Runs inside the load's voted ``load validation`` phase, so the ``ValueError`` reaches every
    member through the vote.
    """
    field = _first_difference(saved, rank_local_header(scope))
    if field is not None:
        raise ValueError(
            f"rank-local checkpoint topology differs: {field} (rank-local state resumes only "
            "on the ranks, world size and meshes that saved it, each rank from its own file; "
            "one DCP file written by every rank keeps a single rank's copy of it, so save "
            "state_dict() per rank, each to a file of its own, or move it in memory with "
            "get_/set_optimizer_state_dict)"
        )


def _saved_rank(header: object) -> object:
    return header.get("rank") if isinstance(header, dict) else None


def check_rank_local_records(
    header: dict[str, Any], tag: object, *, scope: Sequence[Channel], owner_name: str
) -> None:
    """Agree, per channel, that every member loads its own rank's file saved at the same tag.

    The gathered data are identical on every member, so the ``GroupAgreementError`` is too.
    """
    import torch.distributed as dist

    for channel in scope:
        record = {"rank": _saved_rank(header), "tag": tag}
        gathered = all_gather_records(record, channel=channel, owner_name=owner_name)
        ranks = [_saved_rank(item) for item in gathered]
        tags = [item.get("tag") if isinstance(item, dict) else None for item in gathered]
        if ranks != list(dist.get_process_group_ranks(channel.process_group)):
            what = "rank"
        elif any(value != tags[0] for value in tags):
            what = "tag"
        else:
            continue
        raise GroupAgreementError(
            f"{owner_name} rank-local checkpoint differs across process-group members: {what}",
            owner_name=owner_name,
            what=what,
        )
