"""The backend/device table, the channel-device choice, the CUDA-capture query and the
``collective`` decorator (docs/dist.md §1, §3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gefen.dist
from gefen.dist import backend_allows, choose_collective_device, collective, cuda_graph_capturing


@pytest.mark.parametrize(
    ("backend", "device_type", "allowed"),
    [
        ("nccl", "cpu", False),
        ("nccl", "cuda", True),
        ("gloo", "cpu", True),
        ("gloo", "cuda", True),
        ("mpi", "cpu", True),
        ("mpi", "cuda", False),
        ("cpu:gloo,cuda:nccl", "cpu", True),
        ("cpu:gloo,cuda:nccl", "cuda", True),
        ("cuda:nccl", "cpu", False),
        ("cpu:mpi", "cuda", False),
        ("undefined", "cpu", True),
        ("undefined", "cuda", True),
        ("ucc", "cuda", True),
        ("GLOO", "CPU", True),
        ("gloo", "meta", False),
        ("", "cpu", False),
    ],
)
def test_backend_table(backend: str, device_type: str, allowed: bool) -> None:
    assert backend_allows(backend, device_type) is allowed


def test_backend_allows_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        backend_allows(3, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        backend_allows("gloo", torch.device("cpu"))  # type: ignore[arg-type]


class _Group:
    """Stands in for a process group: ``choose_collective_device`` only reads the backend
    (monkeypatched) and ``bound_device_id``."""

    def __init__(self, bound: torch.device | None = None) -> None:
        self.bound_device_id = bound


def _with_backend(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)


def test_choose_device_prefers_an_allowed_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_backend(monkeypatch, "gloo")
    group: object = _Group(bound=torch.device("cuda:1"))
    assert choose_collective_device(group, hint=torch.device("cpu")) == torch.device("cpu")  # type: ignore[arg-type]


def test_choose_device_falls_back_to_the_bound_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_backend(monkeypatch, "nccl")
    group: object = _Group(bound=torch.device("cuda:1"))
    chosen = choose_collective_device(group, hint=torch.device("cpu"))  # type: ignore[arg-type]
    assert chosen == torch.device("cuda:1")


def test_choose_device_uses_the_current_cuda_device_for_cuda_only_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_backend(monkeypatch, "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert choose_collective_device(_Group()) == torch.device("cuda:3")  # type: ignore[arg-type]


def test_choose_device_defaults_to_cpu_without_touching_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("CUDA must not be queried")

    monkeypatch.setattr(torch.cuda, "current_device", forbidden)
    for backend in ("gloo", "mpi", "undefined"):
        _with_backend(monkeypatch, backend)
        assert choose_collective_device(_Group()) == torch.device("cpu")  # type: ignore[arg-type]


def test_cuda_graph_capturing_never_queries_cuda_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> bool:
        raise AssertionError("CUDA must not be queried for CPU tensors")

    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", forbidden)
    assert cuda_graph_capturing([torch.zeros(2), torch.device("cpu"), "cpu"]) is False
    assert cuda_graph_capturing([]) is False


@pytest.mark.parametrize(
    ("item", "error", "match"),
    [("nope", ValueError, "'nope' is not a device name"), (3, TypeError, "got int")],
)
def test_cuda_graph_capturing_names_what_is_not_a_device(
    item: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        cuda_graph_capturing([item])


def test_cuda_graph_capturing_asks_only_when_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_graph_capturing([torch.device("cuda:0")]) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cuda_graph_capturing([torch.device("cpu"), torch.device("cuda:0")]) is True


def test_cuda_graph_capturing_rejects_other_objects() -> None:
    with pytest.raises(TypeError):
        cuda_graph_capturing([3])


def test_collective_runs_without_grad_and_keeps_the_function() -> None:
    @collective
    def grad_enabled(x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x * 2).requires_grad

    leaf = torch.ones(2, requires_grad=True)
    assert torch.is_grad_enabled()
    assert grad_enabled(leaf) is False
    assert grad_enabled.__name__ == "grad_enabled"
    assert gefen.dist.collective is collective


def test_a_collective_runs_eagerly_inside_a_compiled_region() -> None:
    """torch.compile must not trace a vote (the graph would bake in one rank's branch): inside a
    compiled region the function runs eagerly, where ``is_compiling()`` reads False (Dynamo
    would read it as True while tracing)."""
    seen: list[bool] = []

    @collective
    def vote(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x + 1

    compiled = torch.compile(lambda x: vote(x) * 2, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 4.0))
    assert seen == [False]
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 4.0))
    assert seen == [False, False]
