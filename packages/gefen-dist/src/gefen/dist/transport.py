"""Checkpoint transports without pickling: owner consolidation and record gathering
(docs/dist.md §10.1–§10.2).

Everything travels as fixed-size int64 headers, canonical JSON bytes (``canonical_bytes``)
and raw tensor bytes viewed as uint8, so any dtype rides any backend and nothing is ever
unpickled from a peer. Every member issues the same collectives with sizes fixed by the
protocol or by an earlier header; local failures are voted before the next collective.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gefen.contracts import canonical_bytes
from gefen.dist.errors import GroupAgreementError
from gefen.dist.runtime import collective
from gefen.dist.scope import Channel
from gefen.dist.vote import (
    PHASE_OWNER_STATE_HEADER,
    PHASE_OWNER_STATE_METADATA,
    PHASE_RECORD_PREPARATION,
    synchronize_step_error,
)

__all__ = [
    "OWNER_STATE_MAGIC",
    "TRANSPORT_DTYPES",
    "TransportLimits",
    "all_gather_records",
    "broadcast_owner_state",
]

OWNER_STATE_MAGIC = int.from_bytes(b"GFNOWN01", "big", signed=True)
OWNER_STATE_VERSION = 1
_METADATA_FORMAT = 1
_STATUS_OK, _STATUS_OWNER_FAILED = 0, 1

TRANSPORT_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in TRANSPORT_DTYPES.items()}


@dataclass(frozen=True)
class TransportLimits:
    """Upper bounds a receiver enforces before it allocates anything a peer announced."""

    max_metadata_bytes: int = 64 * 2**20
    max_tensors: int = 262_144
    max_tensor_bytes: int = 2**40

    def __post_init__(self) -> None:
        for name in ("max_metadata_bytes", "max_tensors", "max_tensor_bytes"):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"TransportLimits.{name} must be an int, got {value!r:.80}")
            if value < 1:
                raise ValueError(f"TransportLimits.{name} must be >= 1, got {value}")


# -- shared encoding helpers -------------------------------------------------------------------


def _digest_words(payload: bytes) -> list[int]:
    digest = hashlib.sha256(payload).digest()
    return [int.from_bytes(digest[i : i + 8], "big", signed=True) for i in range(0, 32, 8)]


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-finite number {token} in transported JSON")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key in transported JSON")
    return dict(pairs)


def _strict_json(payload: bytes) -> Any:
    """Parse canonical JSON strictly: UTF-8, no NaN/Infinity, no duplicate keys, canonical."""
    value = json.loads(
        payload.decode("utf-8"),
        parse_constant=_reject_constant,
        object_pairs_hook=_reject_duplicates,
    )
    if canonical_bytes(value) != payload:
        raise ValueError("transported JSON is not in canonical form")
    return value


def _bytes_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    # ctypes instead of numpy: torch does not require numpy, and gefen-dist must not either.
    flat = tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
    return ctypes.string_at(flat.data_ptr(), flat.numel()) if flat.numel() else b""


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous bytes of ``tensor`` as a flat uint8 view (shares storage)."""
    return tensor.reshape(-1).view(torch.uint8)


# -- owner consolidation: encoding ---------------------------------------------------------------


def _checked_tensor(key: str, value: torch.Tensor) -> str:
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"owner state entry {key!r}: a {type(value).__name__} is not a plain tensor"
        )
    if value.layout is not torch.strided or value.is_sparse:
        raise TypeError(f"owner state entry {key!r}: only strided dense tensors travel")
    if value.device.type == "meta":
        raise ValueError(f"owner state entry {key!r}: a meta tensor holds no data")
    name = _DTYPE_NAMES.get(value.dtype)
    if name is None:
        raise TypeError(f"owner state entry {key!r}: dtype {value.dtype} cannot be transported")
    return name


def _encode_owner_entry(entry: object, limits: TransportLimits) -> tuple[bytes, list[torch.Tensor]]:
    """The owner's canonical metadata and its tensors in metadata (sorted key) order."""
    if not isinstance(entry, Mapping):
        raise TypeError(f"the owner's entry must be a dict, got {type(entry).__name__}")
    for key in entry:
        if type(key) is not str:
            raise TypeError(f"owner state keys must be str, got {type(key).__name__}")
    items: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for key in sorted(entry):
        value = entry[key]
        if isinstance(value, torch.Tensor):
            dtype = _checked_tensor(key, value)
            items.append({"key": key, "kind": "tensor", "dtype": dtype, "shape": list(value.shape)})
            tensors.append(value)
        else:
            items.append({"key": key, "kind": "value", "value": value})
    metadata = canonical_bytes({"format": _METADATA_FORMAT, "entries": items})
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    if len(metadata) > limits.max_metadata_bytes:
        raise ValueError(f"owner state metadata of {len(metadata)} bytes exceeds the limit")
    if len(tensors) > limits.max_tensors or total > limits.max_tensor_bytes:
        raise ValueError(f"owner state of {len(tensors)} tensors, {total} bytes exceeds the limits")
    return metadata, tensors


# -- owner consolidation: receiving --------------------------------------------------------------


@dataclass(frozen=True)
class _OwnerHeader:
    status: int
    metadata_bytes: int
    tensor_count: int
    tensor_bytes: int
    digest: list[int]

    @classmethod
    def from_words(cls, words: list[int], limits: TransportLimits) -> _OwnerHeader:
        if words[0] != OWNER_STATE_MAGIC or words[1] != OWNER_STATE_VERSION:
            raise ValueError("owner state header has a foreign magic or version")
        header = cls(words[2], words[3], words[4], words[5], words[6:10])
        if header.status not in (_STATUS_OK, _STATUS_OWNER_FAILED):
            raise ValueError(f"owner state header has an unknown status {header.status}")
        ok = header.status == _STATUS_OK
        if ok and not 0 < header.metadata_bytes <= limits.max_metadata_bytes:
            raise ValueError(
                f"owner state metadata of {header.metadata_bytes} bytes is out of limits"
            )
        if not 0 <= header.tensor_count <= limits.max_tensors:
            raise ValueError(f"owner state announces {header.tensor_count} tensors, out of limits")
        if not 0 <= header.tensor_bytes <= limits.max_tensor_bytes:
            raise ValueError(f"owner state announces {header.tensor_bytes} bytes, out of limits")
        return header


def _parse_metadata_entry(item: object) -> tuple[str, str, Any]:
    """One metadata entry -> (key, kind, dtype name and shape, or the value)."""
    if not isinstance(item, dict) or type(item.get("key")) is not str:
        raise ValueError("owner state metadata entry is malformed")
    if item.get("kind") == "value" and set(item) == {"key", "kind", "value"}:
        return item["key"], "value", item["value"]
    if item.get("kind") == "tensor" and set(item) == {"key", "kind", "dtype", "shape"}:
        shape = item["shape"]
        if item["dtype"] not in TRANSPORT_DTYPES or not isinstance(shape, list):
            raise ValueError(f"owner state tensor {item['key']!r} has a malformed dtype or shape")
        if any(type(size) is not int or size < 0 for size in shape):
            raise ValueError(f"owner state tensor {item['key']!r} has a malformed shape")
        return item["key"], "tensor", (item["dtype"], tuple(shape))
    raise ValueError("owner state metadata entry is malformed")


def _receive_plan(payload: bytes, header: _OwnerHeader, device: torch.device) -> dict[str, Any]:
    """Parse and check the metadata; allocate every announced tensor on ``device``."""
    if _digest_words(payload) != header.digest:
        raise ValueError("owner state metadata does not match the owner's SHA-256 digest")
    document = _strict_json(payload)
    if not isinstance(document, dict) or set(document) != {"format", "entries"}:
        raise ValueError("owner state metadata is malformed")
    if document["format"] != _METADATA_FORMAT or not isinstance(document["entries"], list):
        raise ValueError("owner state metadata has an unknown format")
    received: dict[str, Any] = {}
    tensor_count = tensor_bytes = 0
    for item in document["entries"]:
        key, kind, spec = _parse_metadata_entry(item)
        if received and key <= list(received)[-1]:
            raise ValueError("owner state metadata keys are not unique and sorted")
        if kind == "value":
            received[key] = spec
            continue
        dtype = TRANSPORT_DTYPES[spec[0]]
        numel = math.prod(spec[1])
        tensor_count += 1
        tensor_bytes += numel * torch.empty((), dtype=dtype).element_size()
        if tensor_count > header.tensor_count or tensor_bytes > header.tensor_bytes:
            raise ValueError("owner state metadata exceeds the announced tensor totals")
        received[key] = torch.empty(spec[1], dtype=dtype, device=device)
    if (tensor_count, tensor_bytes) != (header.tensor_count, header.tensor_bytes):
        raise ValueError("owner state metadata does not match the announced tensor totals")
    return received


# -- owner consolidation: the protocol ------------------------------------------------------------


def broadcast_owner_state(
    entry: Mapping[str, Any] | None,
    *,
    owner: int,
    channel: Channel | None,
    owner_name: str,
    limits: TransportLimits = TransportLimits(),
) -> dict[str, Any]:
    """Move one owner-held entry (tensors and JSON primitives) to every member of ``channel``.

    Every member calls it for the same entries in the same order; ``owner`` is a group
    coordinate, ``entry`` a dict on the owner and ``None`` elsewhere. The owner gets its own
    dict back (same value objects); receivers get tensors on the channel device.
    """
    if type(limits) is not TransportLimits:
        raise TypeError(f"limits must be TransportLimits, got {type(limits).__name__}")
    if type(owner) is not int:
        raise TypeError(f"owner must be an int group coordinate, got {type(owner).__name__}")
    if channel is None:
        if owner != 0:
            raise ValueError(f"a single-member transport has only owner 0, got {owner}")
        _encode_owner_entry(entry, limits)
        assert entry is not None
        return dict(entry)
    return _broadcast_owner_state(entry, owner, channel, owner_name, limits)


@collective
def _broadcast_owner_state(
    entry: Mapping[str, Any] | None,
    owner: int,
    channel: Channel,
    owner_name: str,
    limits: TransportLimits,
) -> dict[str, Any]:
    import torch.distributed as dist

    group, device, scope = channel.process_group, channel.device, (channel,)
    if not 0 <= owner < dist.get_world_size(group):
        raise ValueError(f"owner coordinate {owner} is outside the group")
    source = dist.get_global_rank(group, owner)
    is_owner = dist.get_rank(group) == owner

    error: Exception | None = None
    staged: list[torch.Tensor] = []  # metadata bytes, then the outgoing tensors (owner)
    words = [OWNER_STATE_MAGIC, OWNER_STATE_VERSION, _STATUS_OK, 0, 0, 0, 0, 0, 0, 0]
    if is_owner:
        try:
            metadata, tensors = _encode_owner_entry(entry, limits)
            total = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            # Staged here so that a failure to place them on the channel device is voted too.
            staged = [_bytes_tensor(metadata, device)]
            staged += [tensor.detach().to(device).contiguous() for tensor in tensors]
            words[3:] = [len(metadata), len(tensors), total, *_digest_words(metadata)]
        except Exception as exc:
            error, words[2] = exc, _STATUS_OWNER_FAILED
    header_tensor = torch.tensor(words, dtype=torch.int64, device=device)
    dist.broadcast(header_tensor, src=source, group=group)

    header: _OwnerHeader | None = None
    if not is_owner:
        try:
            if entry is not None:
                raise ValueError("only the owner passes an entry; receivers pass None")
            header = _OwnerHeader.from_words([int(w) for w in header_tensor.tolist()], limits)
            size = header.metadata_bytes if header.status == _STATUS_OK else 0
            staged = [torch.empty(size, dtype=torch.uint8, device=device)]
        except Exception as exc:
            error = exc
    # The owner's own encoding failure is voted here too: the owner reports its cause, every
    # receiver "another process-group member".
    synchronize_step_error(error, PHASE_OWNER_STATE_HEADER, scope, owner_name)
    return _exchange_metadata_and_tensors(entry, header, staged, channel, source, owner_name)


def _exchange_metadata_and_tensors(
    entry: Mapping[str, Any] | None,
    header: _OwnerHeader | None,
    staged: list[torch.Tensor],
    channel: Channel,
    source: int,
    owner_name: str,
) -> dict[str, Any]:
    """Steps 3–4: the metadata broadcast and its vote, then every tensor's bytes.

    ``header`` is ``None`` on the owner; ``staged`` starts with the metadata buffer.
    """
    import torch.distributed as dist

    group = channel.process_group
    metadata_tensor, outgoing = staged[0], staged[1:]
    dist.broadcast(metadata_tensor, src=source, group=group)

    error: Exception | None = None
    received: dict[str, Any] = {}
    if header is not None:
        try:
            payload = _tensor_bytes(metadata_tensor)
            received = _receive_plan(payload, header, channel.device)
        except Exception as exc:
            error = exc
    synchronize_step_error(error, PHASE_OWNER_STATE_METADATA, (channel,), owner_name)

    targets = (
        outgoing
        if header is None
        else [v for v in received.values() if isinstance(v, torch.Tensor)]
    )
    for target in targets:
        if target.numel() > 0:  # both sides know the sizes; an empty payload has nothing to send
            dist.broadcast(_byte_view(target), src=source, group=group)
    if header is None:
        assert entry is not None
        return dict(entry)
    return received


# -- record gathering --------------------------------------------------------------------------


def _encode_record(record: object, limits: TransportLimits) -> bytes:
    payload = canonical_bytes(record)
    if len(payload) > limits.max_metadata_bytes:
        raise ValueError(f"record of {len(payload)} bytes exceeds max_metadata_bytes")
    return payload


def all_gather_records(
    record: object,
    *,
    channel: Channel | None,
    owner_name: str,
    limits: TransportLimits = TransportLimits(),
) -> tuple[Any, ...]:
    """Every member's JSON-primitive ``record``, decoded, in member order.

    Encoding failures are voted (``record preparation``); a defect in the gathered data raises
    ``GroupAgreementError`` with identical text on every member.
    """
    if type(limits) is not TransportLimits:
        raise TypeError(f"limits must be TransportLimits, got {type(limits).__name__}")
    error: Exception | None = None
    payload = b""
    try:
        payload = _encode_record(record, limits)
    except Exception as exc:
        error = exc
    scope = () if channel is None else (channel,)
    synchronize_step_error(error, PHASE_RECORD_PREPARATION, scope, owner_name)
    if channel is None:
        return (_strict_json(payload),)
    return _gather_encoded(payload, channel, owner_name, limits)


def _corrupt(owner_name: str, member: int, reason: str) -> GroupAgreementError:
    return GroupAgreementError(
        f"{owner_name} gathered record of member {member} is corrupt: {reason}",
        owner_name=owner_name,
        what="gathered record",
    )


@collective
def _gather_encoded(
    payload: bytes, channel: Channel, owner_name: str, limits: TransportLimits
) -> tuple[Any, ...]:
    import torch.distributed as dist

    group, device = channel.process_group, channel.device
    size = dist.get_world_size(group)
    bounds = [limits.max_metadata_bytes, limits.max_tensors, limits.max_tensor_bytes]
    words = [len(payload), *_digest_words(payload), *bounds]
    header = torch.tensor(words, dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(size)]
    dist.all_gather(headers, header, group=group)
    rows = [[int(word) for word in row.tolist()] for row in headers]
    if any(row[5:] != rows[0][5:] for row in rows):  # seen alike by every member
        raise GroupAgreementError(
            f"{owner_name} gathered records: the members pass different TransportLimits",
            owner_name=owner_name,
            what="transport limits",
        )
    for member, row in enumerate(rows):
        if not 0 < row[0] <= limits.max_metadata_bytes:
            raise _corrupt(owner_name, member, f"announced length {row[0]} is out of limits")
    longest = max(row[0] for row in rows)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(payload)] = _bytes_tensor(payload, device)
    buffers = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(buffers, padded, group=group)
    decoded: list[Any] = []
    for member, (row, buffer) in enumerate(zip(rows, buffers, strict=True)):
        data = _tensor_bytes(buffer[: row[0]])
        if _digest_words(data) != row[1:5]:
            raise _corrupt(owner_name, member, "the bytes do not match their SHA-256 digest")
        try:
            decoded.append(_strict_json(data))
        except (ValueError, TypeError) as exc:
            raise _corrupt(owner_name, member, f"not canonical JSON ({exc})") from None
    return tuple(decoded)
