"""The registry of fused update implementations and their selection (10-core.md §11).

The eager kernels of ``gefen.core.kernels`` are normative. A fused implementation is
registered per (device type, dtype, codec, family), declares whether it is deterministic, and
compiles lazily into a callable with the signature of ``update_block`` or ``update_factored``
(by family). Selection runs in the local preflight, so a compile failure with ``fused=True``
is raised before any mutation and inside the vote.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FusedImplementation",
    "KernelKey",
    "KernelSelector",
    "has_fused_implementation",
    "register_fused",
]

logger = logging.getLogger("gefen.core")

KernelKey = tuple[str, torch.dtype, str, str]
"""(device type, parameter dtype, codec, family)."""

UpdateKernel = Callable[..., Any]


@dataclass(frozen=True, eq=False)
class FusedImplementation:
    """A registered implementation; ``compile()`` returns the update callable or raises."""

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    codecs: tuple[str, ...]
    families: tuple[str, ...]
    deterministic: bool
    compile: Callable[[], UpdateKernel]

    def covers(self, key: KernelKey) -> bool:
        device_type, dtype, codec, family = key
        return (
            device_type == self.device_type
            and dtype in self.dtypes
            and codec in self.codecs
            and family in self.families
        )


_REGISTRY: list[FusedImplementation] = []


def register_fused(implementation: FusedImplementation) -> Callable[[], None]:
    """Register an implementation; returns a function that unregisters it."""
    _REGISTRY.append(implementation)

    def unregister() -> None:
        if implementation in _REGISTRY:
            _REGISTRY.remove(implementation)

    return unregister


def has_fused_implementation(device_type: str) -> bool:
    """Whether some implementation is registered for ``device_type`` (the ``fused=True`` rule)."""
    return any(impl.device_type == device_type for impl in _REGISTRY)


def _candidate(key: KernelKey, deterministic: bool) -> FusedImplementation | None:
    for implementation in _REGISTRY:
        if implementation.covers(key) and (implementation.deterministic or not deterministic):
            return implementation
    return None


class KernelSelector:
    """Per-optimizer cache of selected kernels; ``None`` means the eager path.

    A cache of compiled code, not optimizer state: it is never serialized, and an entry is
    only added once a compile succeeded (or fell back with ``fused=None``).
    """

    def __init__(self) -> None:
        self._selected: dict[tuple[KernelKey, bool | None, bool], UpdateKernel | None] = {}

    def select(
        self, key: KernelKey, *, fused: bool | None, deterministic: bool
    ) -> UpdateKernel | None:
        if fused is False:
            return None
        cache_key = (key, fused, deterministic)
        if cache_key in self._selected:
            return self._selected[cache_key]
        implementation = _candidate(key, deterministic)
        if implementation is None:
            if fused:
                raise RuntimeError(f"no fused implementation covers {key} (fused=True)")
            self._selected[cache_key] = None
            return None
        kernel = self._compile(implementation, key, fused)
        self._selected[cache_key] = kernel
        return kernel

    @staticmethod
    def _compile(
        implementation: FusedImplementation, key: KernelKey, fused: bool | None
    ) -> UpdateKernel | None:
        try:
            return implementation.compile()
        except Exception as error:
            if fused:
                raise RuntimeError(
                    f"fused implementation failed to compile "
                    f"({implementation.name}, {key}): {error}"
                ) from error
            warnings.warn(
                f"fused implementation {implementation.name} failed to compile for {key}; "
                f"using the eager path ({error})",
                RuntimeWarning,
                stacklevel=4,
            )
            logger.warning("fused implementation %s failed: %s", implementation.name, error)
            return None
