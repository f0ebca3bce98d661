"""Process-group bindings: construction, runtime validation against (monkeypatched) groups,
identity semantics, and the one-member form that never touches torch.distributed
(docs/dist.md §7, §8)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest
import torch
import torch.distributed as dist

from gefen.contracts import ProcessGroupIdentity
from gefen.dist import (
    PHASE_STEP_PREFLIGHT,
    BindingError,
    Channel,
    CheckpointProcessGroupBinding,
    CodebookProcessGroupBinding,
    GuardedOperation,
    ProcessGroupBinding,
    all_gather_records,
    broadcast_owner_state,
    check_rank_local_records,
    prepare_synchronized_amp_step,
    rank_local_header,
    synchronize_step_error,
)
from gefen.dist.codebook_scope import HEADER_WORD_NAMES, OP_STEP, codebook_header_payload

PAIR = ProcessGroupIdentity("dp", ("rank:0", "rank:1"))
SOLO = ProcessGroupIdentity("solo", ("rank:0",))


def _handle() -> dist.ProcessGroup:
    """A real ProcessGroup object that no collective ever runs on."""
    return dist.ProcessGroup(dist.HashStore(), 0, 2)


def _fake_world(
    monkeypatch: pytest.MonkeyPatch,
    *,
    backend: str = "gloo",
    world_size: int = 2,
    ranks: tuple[int, ...] = (0, 1),
    rank: int = 0,
    group_rank: int = 0,
    cuda_count: int = 0,
) -> None:
    """Answer the local queries ``validate_runtime`` makes, as a live group would."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: list(ranks))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_group_rank", lambda group, global_rank: group_rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_count)


# -- construction ------------------------------------------------------------------------------


def test_a_valid_binding_normalises_its_device() -> None:
    handle = _handle()
    binding = CodebookProcessGroupBinding(PAIR, "rank:1", handle, "cpu")
    assert binding.collective_device == torch.device("cpu")
    assert binding.process_group is handle
    assert binding.coordinate == 1
    assert binding.is_single is False
    assert binding.sort_key == ("dp", ("rank:0", "rank:1"))
    assert binding.channel == Channel(handle, torch.device("cpu"), None, None)
    assert isinstance(binding.channel, Channel)
    assert binding.failure_scope() == (binding.channel,)
    assert [f.name for f in dataclasses.fields(ProcessGroupBinding)] == [
        "identity",
        "local_member",
        "process_group",
        "collective_device",
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"identity": ("dp", ("rank:0",))}, TypeError, "ProcessGroupIdentity"),
        ({"local_member": 0}, TypeError, "local_member"),
        ({"local_member": "rank:7"}, BindingError, "local_member must belong"),
        ({"collective_device": 0}, TypeError, "collective_device"),
        ({"collective_device": "cuda"}, BindingError, "explicit CUDA index"),
        ({"collective_device": torch.device("meta")}, BindingError, "CPU or CUDA"),
        ({"collective_device": "not-a-device"}, BindingError, "not a device"),
        ({"process_group": None}, BindingError, "None never means the default world"),
        ({"process_group": object()}, TypeError, "ProcessGroup"),
        ({"process_group": dist.GroupMember.NON_GROUP_MEMBER}, TypeError, "ProcessGroup"),
    ],
)
def test_construction_rejects(kwargs: dict[str, object], error: type, fragment: str) -> None:
    arguments: dict[str, object] = {
        "identity": PAIR,
        "local_member": "rank:0",
        "process_group": _handle(),
        "collective_device": "cpu",
    }
    arguments.update(kwargs)
    with pytest.raises(error, match=fragment):
        CodebookProcessGroupBinding(**arguments)  # type: ignore[arg-type]


def test_a_binding_before_init_says_torch_distributed_is_not_initialized() -> None:
    # group.WORLD is None until init_process_group: the message told the user to pass it.
    assert not dist.is_initialized()
    with pytest.raises(BindingError, match=r"torch\.distributed is not initialized"):
        CodebookProcessGroupBinding(PAIR, "rank:0", dist.group.WORLD, "cpu")


def test_one_member_binding_must_not_carry_a_handle() -> None:
    with pytest.raises(BindingError, match="a one-member binding must use process_group=None"):
        CodebookProcessGroupBinding(SOLO, "rank:0", _handle(), "cpu")


def test_bindings_compare_by_identity_and_are_never_serialized() -> None:
    handle = _handle()
    codebook = CodebookProcessGroupBinding(PAIR, "rank:0", handle, "cpu")
    checkpoint = CheckpointProcessGroupBinding(PAIR, "rank:0", handle, "cpu")
    twin = CodebookProcessGroupBinding(PAIR, "rank:0", handle, "cpu")
    assert codebook != checkpoint
    assert codebook != twin
    assert codebook == codebook
    assert len({codebook, twin, checkpoint}) == 3
    assert copy.copy(codebook) is codebook
    assert copy.deepcopy({"binding": codebook})["binding"] is codebook
    with pytest.raises(TypeError):
        pickle.dumps(codebook)
    with pytest.raises(dataclasses.FrozenInstanceError):
        codebook.local_member = "rank:1"  # type: ignore[misc]
    assert type(codebook).__mro__[1] is ProcessGroupBinding
    assert vars(CodebookProcessGroupBinding).keys() <= {"__module__", "__doc__", "__qualname__"}


# -- validate_runtime ----------------------------------------------------------------------------


def test_codebook_and_checkpoint_bindings_validate_identically(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle = _handle()
    for kind in (CodebookProcessGroupBinding, CheckpointProcessGroupBinding):
        _fake_world(monkeypatch, rank=1, group_rank=1)
        kind(PAIR, "rank:1", handle, "cpu").validate_runtime()
        _fake_world(monkeypatch, world_size=3, ranks=(0, 1, 2))
        with pytest.raises(BindingError, match="world size"):
            kind(PAIR, "rank:0", handle, "cpu").validate_runtime()


def test_gloo_cuda_checkpoint_binding_needs_an_existing_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    binding = CheckpointProcessGroupBinding(PAIR, "rank:0", _handle(), "cuda:0")
    _fake_world(monkeypatch, backend="gloo", cuda_count=1)
    binding.validate_runtime()
    _fake_world(monkeypatch, backend="gloo", cuda_count=0)
    with pytest.raises(BindingError, match="CUDA device is unavailable"):
        binding.validate_runtime()
    late = CheckpointProcessGroupBinding(PAIR, "rank:0", _handle(), "cuda:1")
    _fake_world(monkeypatch, backend="gloo", cuda_count=1)
    with pytest.raises(BindingError, match="CUDA device is unavailable"):
        late.validate_runtime()


@pytest.mark.parametrize(
    ("backend", "device", "passes"),
    [
        ("mpi", "cuda:0", False),
        ("mpi", "cpu", True),
        ("nccl", "cpu", False),
        ("nccl", "cuda:0", True),
        ("cpu:gloo,cuda:nccl", "cuda:0", True),
    ],
)
def test_backend_is_checked_at_runtime_not_construction(
    monkeypatch: pytest.MonkeyPatch, backend: str, device: str, passes: bool
) -> None:
    binding = CheckpointProcessGroupBinding(PAIR, "rank:0", _handle(), device)
    _fake_world(monkeypatch, backend=backend, cuda_count=2)
    if passes:
        binding.validate_runtime()
    else:
        with pytest.raises(BindingError, match=f"runtime backend {backend}"):
            binding.validate_runtime()


def test_validate_runtime_needs_initialised_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = CodebookProcessGroupBinding(PAIR, "rank:0", _handle(), "cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"requires initialized torch\.distributed"):
        binding.validate_runtime()


def test_validate_runtime_wraps_failing_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = CodebookProcessGroupBinding(PAIR, "rank:0", _handle(), "cpu")
    _fake_world(monkeypatch)

    def not_a_member(group: object, global_rank: int) -> int:
        raise ValueError("rank is not part of group")

    monkeypatch.setattr(dist, "get_group_rank", not_a_member)
    with pytest.raises(BindingError, match="current rank must belong to the process group"):
        binding.validate_runtime()


@pytest.mark.parametrize(
    ("world", "fragment"),
    [
        ({"ranks": (0, 1, 2)}, "world size"),
        ({"rank": 1, "group_rank": 0}, "not a consistent member"),
        ({"rank": 1, "group_rank": 1}, "runtime group order does not match ordered semantic"),
    ],
)
def test_validate_runtime_checks_membership(
    monkeypatch: pytest.MonkeyPatch, world: dict[str, object], fragment: str
) -> None:
    binding = CodebookProcessGroupBinding(PAIR, "rank:0", _handle(), "cpu")
    _fake_world(monkeypatch, **world)  # type: ignore[arg-type]
    with pytest.raises(BindingError, match=fragment):
        binding.validate_runtime()


# -- the one-member form -------------------------------------------------------------------------


def _forbid_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every function of torch.distributed raise, so any call is caught."""
    import torch.distributed.distributed_c10d as c10d

    for module in (dist, c10d):
        for name, value in list(vars(module).items()):
            if name == "reduce_op":  # a deprecated alias that warns on inspection
                continue
            if inspect.isfunction(value) or inspect.isbuiltin(value):

                def forbidden(*args: object, _name: str = name, **kwargs: object) -> None:
                    raise AssertionError(f"torch.distributed.{_name} was called")

                monkeypatch.setattr(module, name, forbidden)


class _Holder:
    def __init__(self) -> None:
        self.param_groups = [{"params": [torch.nn.Parameter(torch.ones(2))]}]
        self.param_groups[0]["params"][0].grad = torch.full((2,), 4.0)
        self.grad_scale = 4.0
        self.found_inf = 0.0


def test_one_member_binding_never_touches_torch_distributed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    binding = CodebookProcessGroupBinding(SOLO, "rank:0", None, "cpu")
    _forbid_torch_distributed(monkeypatch)
    binding.validate_runtime()
    assert binding.is_single
    assert binding.channel is None
    assert binding.failure_scope() == ()
    operation = GuardedOperation("Gefen", binding_getter=lambda: binding)
    assert operation.scope == ()
    assert operation.local(PHASE_STEP_PREFLIGHT, lambda: 7) == 7
    payload = codebook_header_payload(
        global_step=1,
        codebook_present=False,
        deterministic=True,
        refresh_every=0,
        local_shard_count=1,
        scope_fingerprint=None,
        manifest_fingerprint=None,
        codebook_fingerprint=None,
    )
    operation.header(OP_STEP, payload, HEADER_WORD_NAMES)
    assert operation.any_true(True) is True
    assert operation.any_true(False) is False
    assert operation.gather([1, 2]) == ((1, 2),)
    assert operation.agree("codebook values", [3]) == (3,)
    summed = operation.sum_int64(torch.tensor([1.0, 2.0]))
    assert summed.dtype == torch.int64
    assert summed.tolist() == [1, 2]
    tensor = torch.arange(3)
    moved = broadcast_owner_state({"t": tensor, "n": 1}, owner=0, channel=None, owner_name="Gefen")
    assert moved["t"] is tensor
    assert moved["n"] == 1
    assert all_gather_records({"a": [1]}, channel=None, owner_name="Gefen") == ({"a": [1]},)
    synchronize_step_error(None, PHASE_STEP_PREFLIGHT, operation.scope, "Gefen")
    assert rank_local_header(()) == {"version": 1, "world_size": 1, "rank": 0, "channels": []}
    check_rank_local_records(rank_local_header(()), 3, scope=(), owner_name="Gefen")
    holder = _Holder()
    assert prepare_synchronized_amp_step(holder, operation.scope, "Gefen") is True
    assert holder.param_groups[0]["params"][0].grad.tolist() == [1.0, 1.0]


def test_one_member_swap_check_raises_unchanged() -> None:
    installed: dict[str, ProcessGroupBinding | None] = {
        "binding": CodebookProcessGroupBinding(SOLO, "rank:0", None, "cpu")
    }
    operation = GuardedOperation("Gefen", binding_getter=lambda: installed["binding"])

    def clear_binding() -> None:
        installed["binding"] = None

    with pytest.raises(RuntimeError, match=r"^Gefen process-group binding changed during the step"):
        operation.local(PHASE_STEP_PREFLIGHT, clear_binding)
    replacement = CodebookProcessGroupBinding(SOLO, "rank:0", None, "cpu")
    installed["binding"] = operation.binding
    with pytest.raises(RuntimeError, match="binding changed during the load validation"):
        operation.local("load validation", lambda: installed.update(binding=replacement))


def test_no_binding_means_an_unscoped_operation() -> None:
    operation = GuardedOperation("Gefen", binding_getter=lambda: None)
    assert operation.binding is None
    assert operation.scope == ()
    operation.header(OP_STEP, [1], ["global_step"])
    assert operation.gather([5]) == ((5,),)


def test_header_rejects_malformed_payloads() -> None:
    operation = GuardedOperation("Gefen", binding_getter=lambda: None)
    with pytest.raises(ValueError):
        operation.header(OP_STEP, [0] * 22, ["reserved"] * 22)
    with pytest.raises(ValueError):
        operation.header(OP_STEP, [1, 2], ["global_step"])
    with pytest.raises(TypeError):
        operation.header(OP_STEP, [True], ["global_step"])
    with pytest.raises(ValueError):
        operation.gather([2**63])
