"""Transport limits, the single-member transports, the rank-local header check and the
package-wide ban on object collectives (docs/dist.md §1, §10)."""

from __future__ import annotations

import copy
import inspect
import pathlib
import re

import pytest
import torch
import torch.distributed as dist

import gefen.dist
from gefen.contracts import ContractError
from gefen.dist import (
    Channel,
    TransportLimits,
    all_gather_records,
    broadcast_owner_state,
    check_rank_local_header,
    rank_local_header,
)


def _forbid_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.distributed_c10d as c10d

    for module in (dist, c10d):
        for name, value in list(vars(module).items()):
            if name != "reduce_op" and (inspect.isfunction(value) or inspect.isbuiltin(value)):

                def forbidden(*args: object, _name: str = name, **kwargs: object) -> None:
                    raise AssertionError(f"torch.distributed.{_name} was called")

                monkeypatch.setattr(module, name, forbidden)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_metadata_bytes", 0, ValueError),
        ("max_tensors", 1.0, TypeError),
        ("max_tensor_bytes", True, TypeError),
    ],
)
def test_limits_are_exact_positive_ints(field: str, value: object, error: type) -> None:
    with pytest.raises(error):
        TransportLimits(**{field: value})  # type: ignore[arg-type]


def test_default_limits() -> None:
    assert TransportLimits() == TransportLimits(64 * 2**20, 262_144, 2**40)


def test_single_member_owner_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_torch_distributed(monkeypatch)
    entry = {"codes": torch.zeros(2, dtype=torch.uint8), "period": 4, "names": ["a", None]}
    moved = broadcast_owner_state(entry, owner=0, channel=None, owner_name="GefenMuon")
    assert moved == entry
    assert moved is not entry
    assert moved["codes"] is entry["codes"]
    with pytest.raises(ValueError, match="owner 0"):
        broadcast_owner_state(entry, owner=1, channel=None, owner_name="GefenMuon")
    with pytest.raises(TypeError, match="cannot be transported"):
        broadcast_owner_state(
            {"z": torch.zeros(2, dtype=torch.complex64)}, owner=0, channel=None, owner_name="G"
        )
    with pytest.raises(TypeError):
        broadcast_owner_state(entry, owner=0, channel=None, owner_name="G", limits=None)  # type: ignore[arg-type]


def test_single_member_records_decode_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_torch_distributed(monkeypatch)
    record = {"rank": 0, "tag": [1, 2], "weights": [0.5, True, None, "x"]}
    gathered = all_gather_records(record, channel=None, owner_name="Gefen")
    assert gathered == ({"rank": 0, "tag": [1, 2], "weights": [0.5, True, None, "x"]},)
    for bad in ({"nan": float("nan")}, {"tuple": (1, 2)}, {1: "int key"}):
        with pytest.raises(ContractError):
            all_gather_records(bad, channel=None, owner_name="Gefen")
    with pytest.raises(ValueError, match="max_metadata_bytes"):
        all_gather_records(
            {"big": "x" * 64},
            channel=None,
            owner_name="Gefen",
            limits=TransportLimits(max_metadata_bytes=16),
        )


EMPTY = {"version": 1, "world_size": 1, "rank": 0, "channels": []}


def test_empty_scope_header() -> None:
    assert rank_local_header(()) == EMPTY
    check_rank_local_header(copy.deepcopy(EMPTY), ())


@pytest.mark.parametrize(
    ("saved", "field"),
    [
        ([], "header"),
        ({**EMPTY, "version": 2}, "version"),
        ({**EMPTY, "world_size": 2}, "world_size"),
        ({**EMPTY, "rank": 1}, "rank"),
        ({**EMPTY, "rank": False}, "rank"),
        ({**EMPTY, "world_size": True}, "world_size"),
        ({**EMPTY, "version": 1.0}, "version"),
        ({k: v for k, v in EMPTY.items() if k != "rank"}, "rank"),
        ({**EMPTY, "channels": [{}]}, "channels"),
        ({**EMPTY, "extra": 1}, "extra"),
    ],
)
def test_header_mismatch_names_the_first_field(saved: object, field: str) -> None:
    with pytest.raises(
        ValueError, match=f"^rank-local checkpoint topology differs: {re.escape(field)} \\("
    ) as refused:
        check_rank_local_header(saved, ())
    # it said no more: not what rank-local state needs, nor why one DCP file cannot hold it
    assert "each rank from its own file" in str(refused.value)
    assert "one DCP file written by every rank" in str(refused.value)


def _fake_channel(monkeypatch: pytest.MonkeyPatch) -> Channel:
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [1, 3])
    monkeypatch.setattr(dist, "get_group_rank", lambda group, global_rank: 1)
    group = dist.ProcessGroup(dist.HashStore(), 1, 2)
    return Channel(group, torch.device("cpu"), ("cpu", (2, 2), (0, 1, 2, 3)), 0)


def test_channel_header_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    scope = (_fake_channel(monkeypatch),)
    header = rank_local_header(scope)
    assert header == {
        "version": 1,
        "world_size": 4,
        "rank": 3,
        "channels": [
            {
                "mesh_key": ["cpu", [2, 2], [0, 1, 2, 3]],
                "mesh_dim": 0,
                "group_ranks": [1, 3],
                "group_rank": 1,
                "group_size": 4,
            }
        ],
    }
    check_rank_local_header(copy.deepcopy(header), scope)
    for field, value in [
        ("mesh_dim", 1),
        ("mesh_dim", False),
        ("group_ranks", [3, 1]),
        ("group_ranks", [True, 3]),
        ("group_rank", 1.0),
        ("mesh_key", None),
        ("mesh_key", ["cpu", [2, 2], [0, 1, 2, 3.0]]),
    ]:
        saved = copy.deepcopy(header)
        saved["channels"][0][field] = value
        with pytest.raises(ValueError, match=rf"differs: channels\[0\]\.{field} \("):
            check_rank_local_header(saved, scope)


# -- no object collectives -----------------------------------------------------------------------

_BANNED = re.compile(
    r"broadcast_object_list|all_gather_object|gather_object|scatter_object_list|send_object_list"
    r"|recv_object_list"
)


def test_no_module_uses_object_collectives_or_pickles_peer_data() -> None:
    root = pathlib.Path(gefen.dist.__file__).parent
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 10
    for source in sources:
        text = source.read_text("utf-8")
        assert not _BANNED.search(text), f"{source.name} uses an object collective"
        # Only the test harness pickles: its own workers' results, through files it created.
        if source.name != "harness.py":
            assert not re.search(r"import pickle|pickle\.|torch\.load|torch\.save", text), (
                source.name
            )
