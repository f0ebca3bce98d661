"""The fused implementations of the in-place update, their registry and their selection (§11).

The vocabulary (``StepScalars``, ``Updater``, the eager reference) lives in
``gefen.core.updaters``; the compiled implementation in ``gefen.core.compiled``, the native one
in ``gefen.core.native``. By default ``inductor`` runs the functions of
``gefen.core.kernels.fused_update`` compiled with ``torch.compile(fullgraph=True)`` over chunks
of whole blocks, so the extra memory is one chunk's; on the CPU the native kernel is tried first.

Selection runs in the local preflight and is cached per optimizer (``KernelSelector``): a
compile failure with ``fused=True`` raises there, before any mutation and inside the vote;
``fused=None`` falls back to the eager path with one warning.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gefen.core.updaters import KernelKey, MomentumAdvancer, Updater

__all__ = [
    "FusedImplementation",
    "KernelSelector",
    "fused_momentum",
    "has_fused_implementation",
    "register_fused",
    "resolve_default",
]

logger = logging.getLogger("gefen.core")


def fused_momentum(device_type: str, codebook_size: int = 256) -> MomentumAdvancer:
    """A fused ``MomentumAdvancer`` for ``device_type`` and a codebook of ``codebook_size``
    values, proven on a tiny input first (so a build failure surfaces where the caller selects
    it); raises on failure. On the CPU the native kernel when it builds, else (and elsewhere)
    the compiled one."""
    native_failure = None
    if device_type == "cpu":
        try:
            from gefen.core.native import native_momentum

            return native_momentum(codebook_size)
        except Exception as error:
            logger.info("native momentum kernel unavailable, using inductor: %s", error)
            native_failure = error
    from gefen.core.compiled import compiled_momentum

    try:
        return compiled_momentum(device_type, codebook_size)
    except Exception as error:
        if native_failure is None:
            raise
        # the caller's message must say why the native kernel went too, not only inductor
        raise RuntimeError(
            f"native-cpu: {native_failure}; inductor: {type(error).__name__}: {error}"
        ) from error


# -- the registry and the per-optimizer selection --------------------------------------------


@dataclass(frozen=True, eq=False)
class FusedImplementation:
    """A registered implementation; ``compile(key)`` returns an ``Updater`` for that key (having
    compiled what it needs) or raises."""

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    codecs: tuple[str, ...]
    families: tuple[str, ...]
    deterministic: bool
    compile: Callable[[KernelKey], Updater]

    def covers(self, key: KernelKey) -> bool:
        device_type, dtype, codec, family = key
        return (
            device_type == self.device_type
            and dtype in self.dtypes
            and codec in self.codecs
            and family in self.families
        )


_REGISTRY: list[FusedImplementation] = []


def register_fused(
    implementation: FusedImplementation, *, first: bool = True
) -> Callable[[], None]:
    """Register an implementation (ahead of the others unless ``first=False``); returns a
    function that unregisters it."""
    if first:
        _REGISTRY.insert(0, implementation)
    else:
        _REGISTRY.append(implementation)

    def unregister() -> None:
        if implementation in _REGISTRY:
            _REGISTRY.remove(implementation)

    return unregister


def _compile_inductor(device_type: str, key: KernelKey) -> Updater:
    from gefen.core.compiled import inductor_updater

    return inductor_updater(device_type, key)


def _compile_native(key: KernelKey) -> Updater:
    from gefen.core.native import native_updater

    return native_updater(key)


_ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
register_fused(
    FusedImplementation(
        "native-cpu",
        "cpu",
        (torch.float32, torch.bfloat16),
        ("codebook8", "codebook4"),
        ("block", "factored"),
        True,  # blocks are independent; every block's reductions run in a fixed order
        _compile_native,
    ),
    first=False,
)
for _device_type in ("cpu", "cuda"):
    register_fused(
        FusedImplementation(
            "inductor",
            _device_type,
            _ALL_DTYPES,
            ("codebook8", "codebook4", "none"),
            ("block", "factored"),
            True,  # no atomics: every reduction has a fixed order
            lambda key, device_type=_device_type: _compile_inductor(device_type, key),  # type: ignore[misc]
        ),
        first=False,
    )


def has_fused_implementation(device_type: str) -> bool:
    """Whether some implementation is registered for ``device_type`` (the ``fused=True`` rule)."""
    return any(impl.device_type == device_type for impl in _REGISTRY)


def _candidates(key: KernelKey, deterministic: bool) -> list[FusedImplementation]:
    """The registered implementations covering ``key``, in registration order."""
    return [
        implementation
        for implementation in _REGISTRY
        if implementation.covers(key) and (implementation.deterministic or not deterministic)
    ]


def resolve_default(fused: bool | None) -> bool | None:
    """The effective ``fused`` option. A seam for test suites that keep most tests eager; the
    library itself returns the option unchanged."""
    return fused


class KernelSelector:
    """Per-optimizer cache of selected updaters; ``None`` means the eager reference.

    A cache of compiled code, not optimizer state: it is never serialized, and an entry is only
    added once a compile succeeded (or fell back with ``fused=None``).
    """

    def __init__(self) -> None:
        self._selected: dict[tuple[KernelKey, bool | None, bool], Updater | None] = {}
        self._reported: set[str] = set()  # each failure once per optimizer, not once per key

    def select(self, key: KernelKey, *, fused: bool | None, deterministic: bool) -> Updater | None:
        fused = resolve_default(fused)
        if fused is False:
            return None
        cache_key = (key, fused, deterministic)
        if cache_key in self._selected:
            return self._selected[cache_key]
        candidates = _candidates(key, deterministic)
        if not candidates:
            if fused:
                raise RuntimeError(f"no fused implementation covers {key} (fused=True)")
            self._selected[cache_key] = None
            return None
        kernel = self._first_that_compiles(candidates, key, fused)
        self._selected[cache_key] = kernel
        return kernel

    def _first_that_compiles(
        self, candidates: list[FusedImplementation], key: KernelKey, fused: bool | None
    ) -> Updater | None:
        """The first candidate that compiles; when none does, ``fused=True`` raises and
        ``fused=None`` warns and takes the eager path. Failures before one that compiles are
        logged as a warning (the native kernel failing leaves the CPU on inductor, several times
        slower). Each is reported once per optimizer, not once per kernel key."""
        failures: list[str] = []
        for implementation in candidates:
            try:
                kernel = implementation.compile(key)
            except Exception as error:
                failures.append(f"{implementation.name}: {error}")
                continue
            if failures and self._first_report("; ".join(failures)):
                logger.warning("%s; using %s", "; ".join(failures), implementation.name)
            return kernel
        reasons = "; ".join(failures)
        if fused:
            raise RuntimeError(f"fused implementation failed to compile for {key}: {reasons}")
        if self._first_report(reasons):
            warnings.warn(
                f"fused implementation failed to compile (first for {key}); using the eager path "
                f"({reasons})",
                RuntimeWarning,
                stacklevel=5,
            )
        return None

    def _first_report(self, reasons: str) -> bool:
        new = reasons not in self._reported
        self._reported.add(reasons)
        return new
