"""The core-free parts of the codebook-scope protocol on synthetic bindings, manifests and
records (docs/dist.md §9.0–§9.2, §9.6), without gefen-core."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from gefen.contracts import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ParameterLayout,
    PlacementKind,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardingManifest,
    ShardPlacement,
    fingerprint,
)
from gefen.dist import (
    BindingError,
    CheckpointProcessGroupBinding,
    CodebookProcessGroupBinding,
    GroupAgreementError,
    presence_words,
)
from gefen.dist.codebook_scope import (
    HEADER_WORD_NAMES,
    LOAD_HEADER_WORD_NAMES,
    OP_INITIALIZE,
    OP_REFRESH,
    OP_STEP,
    check_contribution_records,
    codebook_fingerprint_of,
    codebook_header_payload,
    fingerprint_words,
    manifest_fingerprint_of,
    scope_fingerprint_of,
    validate_scope_installation,
)

DP = ProcessGroupIdentity("dp", ("rank:0", "rank:1"))
OTHER = ProcessGroupIdentity("tp", ("rank:0", "rank:1"))
SOLO = ProcessGroupIdentity("solo", ("rank:0",))


def _flat(member: int, offset: int, length: int, group: ProcessGroupIdentity = DP) -> ShardIdentity:
    parameter = ParameterIdentity("layer.weight", (8,))
    placement = ShardPlacement("dp", PlacementKind.FLAT_SHARD, member, group.size)
    return ShardIdentity(
        parameter,
        ParameterLayout.FLATTENED_ELEMENT_SHARD,
        LogicalSlice(offset, length),
        (placement,),
        group,
        f"rank:{member}",
    )


def _replicated(member: int, group: ProcessGroupIdentity = DP) -> ShardIdentity:
    parameter = ParameterIdentity("bias", (3,))
    placement = ShardPlacement("dp", PlacementKind.REPLICATE, member, group.size)
    return ShardIdentity(
        parameter,
        ParameterLayout.REPLICATED,
        LogicalSlice(0, 3),
        (placement,),
        group,
        f"rank:{member}",
    )


def _owned(member: int) -> ShardIdentity:
    parameter = ParameterIdentity("head", (2, 2))
    placement = ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, member, 2)
    extent = LogicalSlice(0, 4) if member == 0 else LogicalSlice(0, 0)
    return ShardIdentity(
        parameter,
        ParameterLayout.WHOLE_PARAMETER_OWNER,
        extent,
        (placement,),
        DP,
        f"rank:{member}",
        "rank:0",
    )


def _dtensor_shard(member: int) -> ShardIdentity:
    parameter = ParameterIdentity("emb", (4, 2))
    placement = ShardPlacement(
        "dp", PlacementKind.DIMENSION_SHARD, member, 2, parameter_dimension=0
    )
    region = LogicalRegion((2 * member, 0), (2, 2))
    return ShardIdentity(
        parameter,
        ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
        region,
        (placement,),
        DP,
        f"rank:{member}",
    )


# Manifest FQN order (sorted): bias, head, layer.weight.
MANIFEST = ShardingManifest(
    (_flat(0, 0, 4), _flat(1, 4, 4), _replicated(0), _replicated(1), _owned(0), _owned(1))
)


def _local(member: int) -> list[ShardIdentity]:
    return [shard for shard in MANIFEST.shards if shard.local_member == f"rank:{member}"]


def _binding(member: int = 0) -> CodebookProcessGroupBinding:
    return CodebookProcessGroupBinding(
        DP, f"rank:{member}", dist.ProcessGroup(dist.HashStore(), 0, 2), "cpu"
    )


def _fake_world(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_group_rank", lambda group, global_rank: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")


# -- op codes, payload, labels -------------------------------------------------------------------


def test_op_codes() -> None:
    assert (OP_INITIALIZE, OP_REFRESH, OP_STEP) == (1, 2, 3)


def test_header_word_names_label_every_payload_word() -> None:
    assert len(HEADER_WORD_NAMES) == 21
    assert HEADER_WORD_NAMES[:6] == (
        "global_step",
        "codebook_present",
        "deterministic",
        "refresh_every",
        "reserved",
        "local_shard_count",
    )
    assert HEADER_WORD_NAMES[6:10] == ("scope_fingerprint",) * 4
    assert HEADER_WORD_NAMES[10:14] == ("manifest_fingerprint",) * 4
    assert HEADER_WORD_NAMES[14:18] == ("codebook_fingerprint",) * 4
    assert HEADER_WORD_NAMES[18:] == ("gradient_presence", "gradient_presence", "group_options")


def test_load_header_word_names_carry_the_replicated_state_and_the_options() -> None:
    assert LOAD_HEADER_WORD_NAMES[:18] == HEADER_WORD_NAMES[:18]
    assert LOAD_HEADER_WORD_NAMES[18:] == ("replicated_state", "replicated_state", "group_options")


def test_payload_layout_follows_the_table() -> None:
    scope = scope_fingerprint_of(DP, 10)
    manifest = manifest_fingerprint_of(MANIFEST)
    codebook = codebook_fingerprint_of(torch.linspace(-1, 1, 256))
    payload = codebook_header_payload(
        global_step=41,
        codebook_present=True,
        deterministic=False,
        refresh_every=10,
        local_shard_count=3,
        scope_fingerprint=scope,
        manifest_fingerprint=manifest,
        codebook_fingerprint=codebook,
        agreement=presence_words([True, None, False]),
        options=2**55 + 7,
    )
    assert len(payload) == 21
    assert payload[:6] == (41, 1, 0, 10, 0, 3)
    assert payload[6:10] == fingerprint_words(scope)
    assert payload[10:14] == fingerprint_words(manifest)
    assert payload[14:18] == fingerprint_words(codebook)
    assert payload[18:] == (*presence_words([True, None, False]), 2**55 + 7)


@pytest.mark.parametrize(("options", "error"), [(-1, ValueError), (1.0, TypeError)])
def test_the_options_word_is_a_non_negative_int(options: object, error: type) -> None:
    with pytest.raises(error, match=r"^options must be"):
        codebook_header_payload(
            global_step=0,
            codebook_present=False,
            deterministic=True,
            refresh_every=0,
            local_shard_count=0,
            scope_fingerprint=None,
            manifest_fingerprint=None,
            codebook_fingerprint=None,
            options=options,  # type: ignore[arg-type]
        )


def test_absent_fingerprints_are_zeros() -> None:
    payload = codebook_header_payload(
        global_step=0,
        codebook_present=False,
        deterministic=True,
        refresh_every=0,
        local_shard_count=0,
        scope_fingerprint=None,
        manifest_fingerprint=None,
        codebook_fingerprint=None,
    )
    assert payload == (0, 0, 1, 0, 0, 0) + (0,) * 15


def test_fingerprint_words_are_big_endian_signed_int64() -> None:
    digest = bytes(range(255, 223, -1))
    words = fingerprint_words(digest)
    assert words[0] == int.from_bytes(digest[:8], "big", signed=True) < 0
    assert b"".join(w.to_bytes(8, "big", signed=True) for w in words) == digest
    with pytest.raises(TypeError):
        fingerprint_words(b"short")
    with pytest.raises(TypeError):
        fingerprint_words(bytearray(32))  # type: ignore[arg-type]


def test_fingerprints_use_the_contract_encoding() -> None:
    assert scope_fingerprint_of(DP, 5) == fingerprint(
        {"identity": DP.to_primitive(), "refresh_every": 5}
    )
    assert manifest_fingerprint_of(MANIFEST) == fingerprint(MANIFEST.to_primitive())
    codebook = torch.tensor([1.0, -0.5], dtype=torch.float32)
    little_endian = b"\x00\x00\x80\x3f\x00\x00\x00\xbf"
    assert codebook_fingerprint_of(codebook) == hashlib.sha256(little_endian).digest()


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ({"global_step": -1}, ValueError),
        ({"global_step": 1.0}, TypeError),
        ({"codebook_present": 1}, TypeError),
        ({"deterministic": None}, TypeError),
        ({"refresh_every": True}, TypeError),
        ({"local_shard_count": 2**63}, ValueError),
        ({"codebook_fingerprint": b"x" * 31}, TypeError),
        ({"agreement": [1, 2]}, TypeError),
        ({"agreement": (1,)}, TypeError),
        ({"agreement": (-1, 0)}, ValueError),
        ({"agreement": (0, 1.0)}, TypeError),
    ],
)
def test_payload_rejects_bad_words(override: dict[str, object], error: type) -> None:
    arguments: dict[str, object] = {
        "global_step": 0,
        "codebook_present": False,
        "deterministic": True,
        "refresh_every": 0,
        "local_shard_count": 0,
        "scope_fingerprint": None,
        "manifest_fingerprint": None,
        "codebook_fingerprint": None,
    }
    arguments.update(override)
    with pytest.raises(error):
        codebook_header_payload(**arguments)  # type: ignore[arg-type]


# -- installation ------------------------------------------------------------------------------


def test_a_consistent_scope_installs(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_world(monkeypatch, rank=1)
    validate_scope_installation(_binding(1), MANIFEST, _local(1))


def test_installation_needs_exactly_a_codebook_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_world(monkeypatch, rank=0)
    checkpoint = CheckpointProcessGroupBinding(
        DP, "rank:0", dist.ProcessGroup(dist.HashStore(), 0, 2), "cpu"
    )
    with pytest.raises(TypeError, match="CodebookProcessGroupBinding"):
        validate_scope_installation(checkpoint, MANIFEST, _local(0))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        validate_scope_installation(_binding(0), MANIFEST.to_primitive(), _local(0))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        validate_scope_installation(
            _binding(0), MANIFEST, [shard.to_primitive() for shard in _local(0)]
        )  # type: ignore[misc]


def test_every_manifest_shard_must_use_the_binding_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_world(monkeypatch, rank=0)
    mixed = ShardingManifest(
        (_flat(0, 0, 4), _flat(1, 4, 4), _replicated(0, OTHER), _replicated(1, OTHER))
    )
    local = [shard for shard in mixed.shards if shard.local_member == "rank:0"]
    with pytest.raises(BindingError, match="process-group identity"):
        validate_scope_installation(_binding(0), mixed, local)


def test_local_shards_must_belong_to_the_local_member(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_world(monkeypatch, rank=0)
    with pytest.raises(BindingError, match="local_member"):
        validate_scope_installation(_binding(0), MANIFEST, _local(1))


def test_local_layouts_are_limited(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_world(monkeypatch, rank=0)
    manifest = ShardingManifest((_dtensor_shard(0), _dtensor_shard(1)))
    with pytest.raises(BindingError, match="dtensor_1d_default_world"):
        validate_scope_installation(_binding(0), manifest, [_dtensor_shard(0)])


def test_installation_ends_with_runtime_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_world(monkeypatch, rank=1)  # this process is rank 1, the binding claims rank:0
    with pytest.raises(BindingError, match="ordered semantic members"):
        validate_scope_installation(_binding(0), MANIFEST, _local(0))


# -- contribution records ------------------------------------------------------------------------

# Per member: bias (REPLICATED 1), head (WHOLE_PARAMETER_OWNER 3), layer.weight (FLATTENED 2).
AGREEING = [
    (1, 1, 4, 3, 3, 1, 2, 4, 2, 1, 8, 4),
    (1, 1, 4, 3, 3, 0, -1, 0, 2, 1, 8, 4),
]


def test_agreeing_records_pass() -> None:
    check_contribution_records(AGREEING, MANIFEST, "Gefen")


def test_layouts_must_agree() -> None:
    records = [AGREEING[0], (2, 1, 4, 3, *AGREEING[1][4:])]
    with pytest.raises(
        GroupAgreementError,
        match=r"^Gefen codebook contribution layouts differ across process-group members$",
    ):
        check_contribution_records(records, MANIFEST, "Gefen")


@pytest.mark.parametrize("bias", [(1, 0, -1, 3), (1, 1, 8, 3)])
def test_replicated_presence_and_period_must_agree(bias: tuple[int, ...]) -> None:
    records = [AGREEING[0], (*bias, *AGREEING[1][4:])]
    with pytest.raises(GroupAgreementError) as caught:
        check_contribution_records(records, MANIFEST, "GefenMuon")
    assert str(caught.value) == (
        "GefenMuon requires identical gradient presence and automatic periods for replicated "
        "parameter 'bias' on every process-group member"
    )


def test_nonempty_flattened_shards_must_agree_on_presence() -> None:
    records = [AGREEING[0], (*AGREEING[1][:8], 2, 0, -1, 4)]
    with pytest.raises(GroupAgreementError) as caught:
        check_contribution_records(records, MANIFEST, "Gefen")
    assert str(caught.value) == (
        "Gefen requires every nonempty shard of flattened parameter 'layer.weight' to agree on "
        "gradient presence"
    )


def test_zero_length_flattened_shards_are_excluded() -> None:
    records = [AGREEING[0], (*AGREEING[1][:8], 2, 0, -1, 0)]
    check_contribution_records(records, MANIFEST, "Gefen")


def test_whole_owner_records_have_no_rule() -> None:
    records = [AGREEING[0], (*AGREEING[1][:4], 3, 1, 16, 4, *AGREEING[1][8:])]
    check_contribution_records(records, MANIFEST, "Gefen")


def test_record_lengths_follow_the_manifest() -> None:
    with pytest.raises(ValueError, match="12 words"):
        check_contribution_records([AGREEING[0][:8], AGREEING[1][:8]], MANIFEST, "Gefen")
    with pytest.raises(ValueError):
        check_contribution_records([], MANIFEST, "Gefen")
    with pytest.raises(ValueError, match="code 9"):
        check_contribution_records([(9, *AGREEING[0][1:])] * 2, MANIFEST, "Gefen")
