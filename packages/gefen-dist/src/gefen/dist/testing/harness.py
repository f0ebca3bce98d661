"""A multi-process test harness that turns every hang into a prompt test failure
(docs/dist.md §11.1).

Each rank runs in a ``spawn``-ed process with its own process group. Results, progress marks
and formatted failures travel through small files in a per-run temporary directory, so the
parent never blocks on a pipe a child may still be writing to. The parent polls until the
rank deadline, then terminates whatever is still running and reports it.

Workers are passed by reference (module name, qualified name and source file), never pickled
as code objects: a child imports the module by name, or loads it from its file when the name
is not importable there (test modules collected by pytest's ``--import-mode=importlib`` are
not on ``sys.path``). Workers must therefore be module-level functions; they may live in test
modules. Arguments are pickled and should be plain data.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import inspect
import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "RankFailure",
    "RankTimeout",
    "default_backend",
    "mark",
    "rank_device",
    "run_ranks",
]

Scenario = tuple[str, Callable[..., Any], tuple[Any, ...]]
_SINGLE = "__worker__"  # the scenario name a single callable runs under
_POLL_S = 0.05
_JOIN_S = 5.0


class RankFailure(AssertionError):
    """A rank exited non-zero, sent no result or raised; carries every rank's outcome."""

    def __init__(self, message: str, outcomes: Sequence[dict[str, Any] | None] = ()) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)


class RankTimeout(RankFailure):
    """Some rank was still running at the deadline (a hang)."""


def default_backend() -> str:
    """The backend multi-rank tests use: ``GEFEN_TEST_BACKEND`` (set by nox), else Gloo."""
    return os.environ.get("GEFEN_TEST_BACKEND", "gloo")


def rank_device(rank: int, backend: str | None = None) -> torch.device:
    """Where a rank's tensors live: CPU for Gloo (and other CPU backends), ``cuda:rank`` for
    NCCL."""
    name = (backend if backend is not None else default_backend()).lower()
    return torch.device(f"cuda:{rank}") if name == "nccl" else torch.device("cpu")


# -- child side ----------------------------------------------------------------------------------

_child_files: tuple[Path, int] | None = None  # (run directory, rank) inside a spawned rank


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def mark(label: str) -> None:
    """Record this rank's latest progress label (reported if the rank hangs).

    Outside a rank spawned by ``run_ranks`` it does nothing, so scenario code runs unchanged
    in a single process.
    """
    if _child_files is None:
        return
    directory, rank = _child_files
    _write_atomically(directory / f"rank{rank}.mark", str(label).encode("utf-8", "replace"))


@dataclass(frozen=True)
class _WorkerRef:
    module: str
    qualname: str
    file: str | None


@dataclass(frozen=True)
class _RunConfig:
    world_size: int
    backend: str
    init_method: str
    tcp_port: int | None
    pg_timeout_s: float
    threads: int
    cuda_visible: bool
    run_dir: str
    names: tuple[str, ...]
    workers: tuple[_WorkerRef, ...]
    args_blob: bytes


def _worker_ref(fn: object) -> _WorkerRef:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or module is None or qualname is None or "<" in qualname:
        raise TypeError(f"run_ranks needs module-level callables, got {fn!r:.80}")
    bound: Any = fn
    if inspect.ismethod(bound):  # a rank would import the unbound function: the rank as ``self``
        raise TypeError(f"run_ranks needs module-level callables, not a bound method: {fn!r:.80}")
    source = getattr(sys.modules.get(module), "__file__", None)
    return _WorkerRef(module, qualname, source)


def _same_file(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _load_module(ref: _WorkerRef) -> Any:
    module: Any = None
    try:
        module = importlib.import_module(ref.module)
    except Exception:
        module = None
    if module is not None and ref.file is not None and not _same_file(module.__file__, ref.file):
        module = None
    if module is not None:
        return module
    if ref.file is None:
        raise ImportError(f"cannot import worker module {ref.module!r}")
    spec = importlib.util.spec_from_file_location(ref.module, ref.file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load worker module {ref.module!r} from {ref.file}")
    module = importlib.util.module_from_spec(spec)
    # Registered under the parent's name so pickled arguments that refer to it resolve.
    sys.modules[ref.module] = module
    spec.loader.exec_module(module)
    return module


def _resolve(ref: _WorkerRef) -> Callable[..., Any]:
    target: Any = _load_module(ref)
    for part in ref.qualname.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


def _reject_tensors(value: object, where: str) -> None:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where} holds a tensor; return torch.save bytes instead")
    if isinstance(value, dict):
        for key, item in value.items():
            _reject_tensors(key, f"{where} key")
            _reject_tensors(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            _reject_tensors(item, f"{where}[{index}]")


def _initialise_group(rank: int, config: _RunConfig) -> None:
    import torch.distributed as dist

    if config.tcp_port is not None:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(config.tcp_port),
            RANK=str(rank),
            WORLD_SIZE=str(config.world_size),
        )
    dist.init_process_group(
        config.backend,
        init_method=config.init_method,
        rank=rank,
        world_size=config.world_size,
        timeout=datetime.timedelta(seconds=config.pg_timeout_s),
    )


def _run_scenarios(rank: int, config: _RunConfig, outcome: dict[str, Any], path: Path) -> None:
    workers = [_resolve(ref) for ref in config.workers]
    all_args = pickle.loads(config.args_blob)
    for name, worker, args in zip(config.names, workers, all_args, strict=True):
        mark(f"scenario {name}")
        try:
            value = worker(rank, config.world_size, *args)
            _reject_tensors(value, f"result of {name!r}")
            pickle.dumps(value)
            outcome["results"][name] = value
        except Exception:
            outcome["failures"][name] = traceback.format_exc()
        _write_atomically(path, pickle.dumps(outcome))


def _child_main(rank: int, config: _RunConfig) -> None:
    global _child_files
    if not config.cuda_visible:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    _child_files = (Path(config.run_dir), rank)
    torch.set_num_threads(config.threads)
    path = Path(config.run_dir) / f"rank{rank}.result"
    outcome: dict[str, Any] = {"results": {}, "failures": {}, "error": None, "complete": False}
    import torch.distributed as dist

    try:
        mark("init_process_group")
        _initialise_group(rank, config)
        _run_scenarios(rank, config, outcome, path)
        outcome["complete"] = True
    except BaseException:
        outcome["error"] = traceback.format_exc()
    finally:
        _write_atomically(path, pickle.dumps(outcome))
        mark("destroy_process_group")
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        mark("exited")
        sys.stdout.flush()
        sys.stderr.flush()
        # Everything the parent reads is on disk; tearing down an interpreter that imported
        # torch takes seconds on a loaded machine, and no rank has anything left to clean up.
        os._exit(0 if outcome["complete"] else 1)


# -- parent side ---------------------------------------------------------------------------------


def _scenarios(worker: object, args: tuple[Any, ...]) -> tuple[list[Scenario], bool]:
    if isinstance(worker, list):
        scenarios: list[Scenario] = []
        for item in worker:
            if not (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], str)):
                raise TypeError("a scenario list holds (name, callable, args) tuples")
            scenarios.append((item[0], item[1], tuple(item[2])))
        names = [name for name, _, _ in scenarios]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"scenario names must be unique and non-empty: {names}")
        return scenarios, False
    if not callable(worker):
        raise TypeError(f"worker must be a callable or a scenario list, got {worker!r:.80}")
    return [(_SINGLE, worker, tuple(args))], True


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class _Rendezvous:
    init_method: str
    tcp_port: int | None = None
    file: str | None = None

    @classmethod
    def create(cls, kind: str) -> _Rendezvous:
        if kind == "file":
            handle, path = tempfile.mkstemp(prefix="gefen-rendezvous-")
            os.close(handle)
            os.unlink(path)  # the FileStore creates it; a stale file would confuse it
            return cls(init_method=f"file://{path}", file=path)
        if kind == "tcp":
            return cls(init_method="env://", tcp_port=_free_tcp_port())
        raise ValueError(f"rendezvous must be 'file' or 'tcp', got {kind!r}")

    def remove(self) -> None:
        if self.file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.file)


@dataclass
class _Observed:
    hung: list[int] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    marks: list[str | None] = field(default_factory=list)
    outcomes: list[dict[str, Any] | None] = field(default_factory=list)


def _read_files(run_dir: Path, world_size: int, observed: _Observed) -> None:
    for rank in range(world_size):
        mark_file = run_dir / f"rank{rank}.mark"
        result_file = run_dir / f"rank{rank}.result"
        label = mark_file.read_text("utf-8") if mark_file.exists() else None
        observed.marks.append(label)
        try:
            observed.outcomes.append(pickle.loads(result_file.read_bytes()))
        except (OSError, pickle.UnpicklingError, EOFError):
            observed.outcomes.append(None)


def _stop(processes: list[Any]) -> None:
    """Terminate, then kill what is left: one shared grace period for the whole world (a wait
    per process would grow the hang bound with the world size); a rank that never started
    (its ``start()`` raised) is skipped, so that error is the one reported."""
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.is_alive():
            process.terminate()
    grace = time.monotonic() + _JOIN_S
    for process in started:
        process.join(max(0.0, grace - time.monotonic()))
    for process in started:
        if process.is_alive():
            process.kill()
            process.join(_JOIN_S)


def _observe(config: _RunConfig, rank_deadline_s: float, processes: list[Any]) -> _Observed:
    """Start every rank, poll until all exited or the deadline passed, then stop them all."""
    observed = _Observed()
    deadline = time.monotonic() + rank_deadline_s
    try:
        for process in processes:
            process.start()
        while time.monotonic() < deadline and any(p.is_alive() for p in processes):
            time.sleep(_POLL_S)
        observed.hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    finally:
        _stop(processes)
    observed.exit_codes = [p.exitcode for p in processes]
    _read_files(Path(config.run_dir), config.world_size, observed)
    return observed


def _describe_outcome(rank: int, observed: _Observed) -> str:
    outcome = observed.outcomes[rank]
    lines = [
        f"--- rank {rank}: exit code {observed.exit_codes[rank]}, last mark "
        f"{observed.marks[rank]!r}"
    ]
    if outcome is None:
        lines.append("no result was received")
        return "\n".join(lines)
    if outcome["error"] is not None:
        lines.append(outcome["error"])
    for name, trace in outcome["failures"].items():
        lines.append(f"scenario {name!r} failed:\n{trace}")
    if not outcome["complete"] and outcome["error"] is None:
        lines.append(f"finished scenarios: {sorted(outcome['results'])}")
    return "\n".join(lines)


def _verdict(observed: _Observed, rank_deadline_s: float) -> None:
    if observed.hung:
        received = [r for r, o in enumerate(observed.outcomes) if o is not None and o["complete"]]
        hung = ", ".join(f"rank {r} (last mark {observed.marks[r]!r})" for r in observed.hung)
        details = "\n".join(_describe_outcome(r, observed) for r in range(len(observed.marks)))
        raise RankTimeout(
            f"still running after the {rank_deadline_s:g} s rank deadline: {hung}; exit codes "
            f"{observed.exit_codes}; complete results from ranks {received}\n{details}",
            observed.outcomes,
        )
    failed = [
        rank
        for rank, outcome in enumerate(observed.outcomes)
        if observed.exit_codes[rank] != 0
        or outcome is None
        or outcome["error"] is not None
        or outcome["failures"]
        or not outcome["complete"]
    ]
    if failed:
        details = "\n".join(_describe_outcome(r, observed) for r in range(len(observed.marks)))
        raise RankFailure(f"ranks {failed} failed\n{details}", observed.outcomes)


def run_ranks(
    worker: Callable[..., Any] | list[Scenario],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    backend: str | None = None,
    rendezvous: str = "file",
    rank_deadline_s: float = 60.0,
    pg_timeout_s: float = 20.0,
    threads: int = 1,
    cuda_visible: bool = False,
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    ``worker`` is a module-level callable (the result list holds each rank's return value) or
    a list of ``(name, callable, args)`` scenarios run in order in one world (each rank's result
    is a dict keyed by scenario name). Raises ``RankTimeout`` if a rank is still running at
    ``rank_deadline_s`` and ``RankFailure`` on any failure, with every rank's traceback.
    """
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    for name, value in (("rank_deadline_s", rank_deadline_s), ("pg_timeout_s", pg_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise TypeError(f"{name} must be a real number of seconds, got {value!r}")
    if not 0 < pg_timeout_s < rank_deadline_s:
        raise ValueError("deadlines must nest: 0 < pg_timeout_s < rank_deadline_s")
    if not isinstance(args, (tuple, list)):  # a string would be spread into the call
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    scenarios, single = _scenarios(worker, args)
    args_blob = pickle.dumps([scenario_args for _, _, scenario_args in scenarios])
    workers = tuple(_worker_ref(fn) for _, fn, _ in scenarios)  # refused before anything exists
    meeting = _Rendezvous.create(rendezvous)
    run_dir = tempfile.mkdtemp(prefix="gefen-ranks-")
    config = _RunConfig(
        world_size=world_size,
        backend=backend if backend is not None else default_backend(),
        init_method=meeting.init_method,
        tcp_port=meeting.tcp_port,
        pg_timeout_s=float(pg_timeout_s),
        threads=threads,
        cuda_visible=cuda_visible,
        run_dir=run_dir,
        names=tuple(name for name, _, _ in scenarios),
        workers=workers,
        args_blob=args_blob,
    )
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_child_main, args=(rank, config), name=f"gefen-rank-{rank}")
        for rank in range(world_size)
    ]
    try:
        observed = _observe(config, rank_deadline_s, processes)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        meeting.remove()
    _verdict(observed, rank_deadline_s)
    outcomes = [outcome for outcome in observed.outcomes if outcome is not None]
    if single:
        return [outcome["results"][_SINGLE] for outcome in outcomes]
    return [dict(outcome["results"]) for outcome in outcomes]
