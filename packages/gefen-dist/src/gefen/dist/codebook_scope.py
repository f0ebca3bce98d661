"""The core-free parts of the codebook-scope protocol (docs/dist.md §9.0–§9.2, §9.6).

``gefen.core`` runs the initialize/refresh/step drivers; what lives here is what every member
must compute identically without the optimizer: the op codes, the header payload and its
labels, the installation checks of a scope and the agreement rules on gathered contribution
records.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from gefen.contracts import (
    ParameterLayout,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardingManifest,
    fingerprint,
)
from gefen.dist.binding import CodebookProcessGroupBinding
from gefen.dist.errors import BindingError, GroupAgreementError
from gefen.dist.guarded import HEADER_PAYLOAD_WORDS

__all__ = [
    "CONTRIBUTION_LAYOUT_CODES",
    "CONTRIBUTION_RECORD_WORDS",
    "HEADER_WORD_NAMES",
    "LOAD_HEADER_WORD_NAMES",
    "OP_INITIALIZE",
    "OP_LOAD",
    "OP_REFRESH",
    "OP_STEP",
    "check_contribution_records",
    "codebook_fingerprint_of",
    "codebook_header_payload",
    "fingerprint_words",
    "manifest_fingerprint_of",
    "scope_fingerprint_of",
    "validate_scope_installation",
]

OP_INITIALIZE = 1
OP_REFRESH = 2
OP_STEP = 3
OP_LOAD = 4

# One label per payload word (header words 3..23); a fingerprint spans four words.
HEADER_WORD_NAMES: tuple[str, ...] = (
    "global_step",
    "codebook_present",
    "deterministic",
    "refresh_every",
    "reserved",
    "local_shard_count",
    *(("scope_fingerprint",) * 4),
    *(("manifest_fingerprint",) * 4),
    *(("codebook_fingerprint",) * 4),
    *(("gradient_presence",) * 2),
    "group_options",
)
assert len(HEADER_WORD_NAMES) == HEADER_PAYLOAD_WORDS

# A load's header: the loaded step and codebook in the same words, in words 21-22 the digest of
# the state every member must hold identically (``gefen.core.replicas``), and in word 23 the
# options of the groups it would publish.
LOAD_HEADER_WORD_NAMES: tuple[str, ...] = (
    *HEADER_WORD_NAMES[:18],
    *(("replicated_state",) * 2),
    "group_options",
)
assert len(LOAD_HEADER_WORD_NAMES) == HEADER_PAYLOAD_WORDS

_SCOPED_LAYOUTS = (
    ParameterLayout.REPLICATED,
    ParameterLayout.FLATTENED_ELEMENT_SHARD,
    ParameterLayout.WHOLE_PARAMETER_OWNER,
)
CONTRIBUTION_LAYOUT_CODES: dict[ParameterLayout, int] = {
    ParameterLayout.REPLICATED: 1,
    ParameterLayout.FLATTENED_ELEMENT_SHARD: 2,
    ParameterLayout.WHOLE_PARAMETER_OWNER: 3,
}
CONTRIBUTION_RECORD_WORDS = 4  # [layout code, active 0/1, period or -1, local length]
_DIGEST_BYTES = 32
_INT64_MAX = 2**63 - 1


# -- fingerprints ------------------------------------------------------------------------------


def fingerprint_words(digest: bytes | None) -> tuple[int, int, int, int]:
    """A 32-byte digest as four big-endian signed int64 words; ``None`` gives zeros."""
    if digest is None:
        return (0, 0, 0, 0)
    if type(digest) is not bytes or len(digest) != _DIGEST_BYTES:
        raise TypeError(f"a fingerprint must be {_DIGEST_BYTES} bytes or None, got {digest!r:.80}")
    words = [
        int.from_bytes(digest[i : i + 8], "big", signed=True) for i in range(0, _DIGEST_BYTES, 8)
    ]
    return (words[0], words[1], words[2], words[3])


def scope_fingerprint_of(identity: ProcessGroupIdentity, refresh_every: int) -> bytes:
    """Fingerprint of ``{"identity": identity primitive, "refresh_every": n}`` (header 9–12)."""
    return fingerprint({"identity": identity.to_primitive(), "refresh_every": refresh_every})


def manifest_fingerprint_of(manifest: ShardingManifest) -> bytes:
    """Fingerprint of the manifest primitive (header words 13–16)."""
    return fingerprint(manifest.to_primitive())


def codebook_fingerprint_of(codebook: torch.Tensor) -> bytes:
    """SHA-256 of the codebook's little-endian float32 bytes (header words 17–20)."""
    values = codebook.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
    # "<f" pins little-endian bytes whatever the host order is; struct keeps gefen-dist numpy-free.
    little_endian = struct.pack(f"<{values.numel()}f", *values.tolist())
    return hashlib.sha256(little_endian).digest()


# -- header payload ------------------------------------------------------------------------------


def _count(name: str, value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= _INT64_MAX:
        raise ValueError(f"{name} must be a non-negative int64, got {value}")
    return value


def _flag(name: str, value: object) -> int:
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return int(value)


def codebook_header_payload(
    *,
    global_step: int,
    codebook_present: bool,
    deterministic: bool,
    refresh_every: int,
    local_shard_count: int,
    scope_fingerprint: bytes | None,
    manifest_fingerprint: bytes | None,
    codebook_fingerprint: bytes | None,
    agreement: tuple[int, int] = (0, 0),
    options: int = 0,
) -> tuple[int, ...]:
    """The 21 payload words of a codebook operation header, labelled by ``HEADER_WORD_NAMES``
    (``LOAD_HEADER_WORD_NAMES`` for a load).

    ``agreement`` fills words 21-22: ``gefen.dist.presence_words`` of the gradient presence the
    members must agree on (initialize, refresh, step), or a load's replicated-state words;
    ``options`` fills word 23: the digest of the group options the members must agree on
    (initialize, refresh, step; 0 in a load's header). docs/dist.md §9.2."""
    if type(agreement) is not tuple or len(agreement) != 2:
        raise TypeError(f"agreement must be a pair of ints, got {agreement!r:.80}")
    words = (
        _count("global_step", global_step),
        _flag("codebook_present", codebook_present),
        _flag("deterministic", deterministic),
        _count("refresh_every", refresh_every),
        0,
        _count("local_shard_count", local_shard_count),
        *fingerprint_words(scope_fingerprint),
        *fingerprint_words(manifest_fingerprint),
        *fingerprint_words(codebook_fingerprint),
        _count("agreement", agreement[0]),
        _count("agreement", agreement[1]),
        _count("options", options),
    )
    assert len(words) == HEADER_PAYLOAD_WORDS
    return words


# -- installation ------------------------------------------------------------------------------


def validate_scope_installation(
    binding: CodebookProcessGroupBinding,
    manifest: ShardingManifest,
    local_shards: Sequence[ShardIdentity],
) -> None:
    """The scope checks ``post_sharding`` runs last, rank-local and collective-free (§9.1).

    ``local_shards`` are the manifest shards whose ``local_member`` is this rank's.
    """
    if type(binding) is not CodebookProcessGroupBinding:
        raise TypeError(
            f"a codebook scope needs exactly a CodebookProcessGroupBinding, got "
            f"{type(binding).__name__}"
        )
    if type(manifest) is not ShardingManifest:
        raise TypeError(f"manifest must be a ShardingManifest, got {type(manifest).__name__}")
    shards = tuple(local_shards)
    for index, shard in enumerate(shards):
        if type(shard) is not ShardIdentity:
            raise TypeError(
                f"local_shards[{index}] must be a ShardIdentity, got {type(shard).__name__}"
            )
    name = binding.identity.semantic_name
    for shard in manifest.shards:
        if shard.process_group != binding.identity:
            raise BindingError(
                f"codebook scope {name!r}: manifest shard {shard.parameter.fqn!r} must use the "
                "binding's process-group identity"
            )
    for shard in shards:
        if shard.local_member != binding.local_member:
            raise BindingError(
                f"codebook scope {name!r}: local shard {shard.parameter.fqn!r} belongs to "
                f"{shard.local_member!r}, not to the binding's local_member "
                f"{binding.local_member!r}"
            )
    for shard in shards:
        if shard.layout not in _SCOPED_LAYOUTS:
            raise BindingError(
                f"codebook scope {name!r}: local shard {shard.parameter.fqn!r} has layout "
                f"{shard.layout.value}; a scope takes "
                f"{', '.join(layout.value for layout in _SCOPED_LAYOUTS)}"
            )
    binding.validate_runtime()


# -- contributions -----------------------------------------------------------------------------


def _agreement_error(owner_name: str, message: str, what: str) -> GroupAgreementError:
    return GroupAgreementError(f"{owner_name} {message}", owner_name=owner_name, what=what)


def _check_one_parameter(owner_name: str, fqn: str, rows: list[tuple[int, ...]]) -> None:
    """Apply the §9.6 rule of one parameter to its records, one row per member."""
    if len({row[0] for row in rows}) > 1:
        raise _agreement_error(
            owner_name,
            "codebook contribution layouts differ across process-group members",
            "codebook contribution layouts",
        )
    code = rows[0][0]
    if code == CONTRIBUTION_LAYOUT_CODES[ParameterLayout.REPLICATED]:
        if len({(row[1], row[2]) for row in rows}) > 1:
            raise _agreement_error(
                owner_name,
                "requires identical gradient presence and automatic periods for replicated "
                f"parameter '{fqn}' on every process-group member",
                "replicated contribution",
            )
    elif code == CONTRIBUTION_LAYOUT_CODES[ParameterLayout.FLATTENED_ELEMENT_SHARD]:
        # Zero-length shards hold no gradient to agree on; they still join every collective.
        if len({row[1] for row in rows if row[3] > 0}) > 1:
            raise _agreement_error(
                owner_name,
                f"requires every nonempty shard of flattened parameter '{fqn}' to agree on "
                "gradient presence",
                "flattened contribution",
            )
    elif code != CONTRIBUTION_LAYOUT_CODES[ParameterLayout.WHOLE_PARAMETER_OWNER]:
        raise ValueError(f"{owner_name} codebook contribution record for '{fqn}' has code {code}")


def check_contribution_records(
    records: Sequence[Sequence[int]], manifest: ShardingManifest, owner_name: str
) -> None:
    """Check the gathered contribution records of every member (member order) (§9.6).

    Each member's record holds ``CONTRIBUTION_RECORD_WORDS`` words per local shard in canonical
    order, one shard per manifest FQN. The data are identical on every member, so every member
    raises the same error.
    """
    if type(manifest) is not ShardingManifest:
        raise TypeError(f"manifest must be a ShardingManifest, got {type(manifest).__name__}")
    fqns = manifest.fqns
    expected = CONTRIBUTION_RECORD_WORDS * len(fqns)
    members = [tuple(record) for record in records]
    if not members or any(len(record) != expected for record in members):
        raise ValueError(
            f"{owner_name} codebook contribution records must hold {expected} words per member "
            f"({len(fqns)} parameters), got lengths {[len(record) for record in members]}"
        )
    for index, fqn in enumerate(fqns):
        start = CONTRIBUTION_RECORD_WORDS * index
        rows = [record[start : start + CONTRIBUTION_RECORD_WORDS] for record in members]
        _check_one_parameter(owner_name, fqn, rows)
