"""``GefenMuonHybrid.state``: a routing view over the children's state (docs/hybrid.md §5).

Reads of a parameter route to the owning child's live per-parameter dict (so a child's
defaultdict behaves as in torch); ``in`` and ``get`` never create an entry; a parameter's entry
cannot be replaced or removed through the view, so no caller can drop an entry a Gefen child
needs. A key that is not a tensor (what a ``state_dict`` pre-hook stores, as torch allows) is
the hybrid's own: it lives in the first child's state, which saves and restores it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, cast

from torch import Tensor

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["HybridState"]

_READ_ONLY = (
    "GefenMuonHybrid.state is read-only for parameters; modify a child's state through "
    "hybrid.muon or hybrid.backup (keys that are not tensors may be set and deleted)"
)


class HybridState(Mapping[Tensor, Any]):
    """Maps each registered parameter to its owning child's ``state[p]``."""

    def __init__(self, hybrid: HybridInterface) -> None:
        self._hybrid = hybrid

    def _owner(self, key: object) -> Any:
        child = self._hybrid.owner_of(key)
        if child is None:
            raise KeyError(
                f"{type(key).__name__} is not owned by GefenMuonHybrid; parameters swapped in "
                "after construction (e.g. DeepSpeed ZeRO flat partitions) are not supported"
            )
        return child

    def _own(self) -> dict[Any, Any]:
        """The first child's state, where the hybrid's own (non-tensor) keys live."""
        return cast(dict[Any, Any], self._hybrid.children[0].state)

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, Tensor) and key in self._own():
            return self._own()[key]
        return self._owner(key).state[key]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, Tensor):
            return key in self._own()
        child = self._hybrid.owner_of(key)
        return child is not None and key in child.state

    def get(self, key: Any, default: Any = None) -> Any:
        if not isinstance(key, Tensor):
            return self._own().get(key, default)
        child = self._hybrid.owner_of(key)
        if child is None or key not in child.state:
            return default
        return child.state[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, Tensor):
            raise TypeError(_READ_ONLY)
        self._own()[key] = value

    def __delitem__(self, key: Any) -> None:
        if isinstance(key, Tensor):
            raise TypeError(_READ_ONLY)
        del self._own()[key]

    def __iter__(self) -> Iterator[Tensor]:
        """The keys ``in`` and ``[]`` take: each child's registered parameters, and the first
        child's other keys. (A tensor a child holds an entry for without the hybrid owning it,
        after a group added through the child and removed again, made ``state_dict()`` raise
        a KeyError for good.)"""
        children = self._hybrid.children
        for child in children:
            for key in cast(dict[Any, Any], child.state):  # user keys need not be tensors
                if isinstance(key, Tensor):
                    if self._hybrid.owner_of(key) is child:
                        yield key
                elif child is children[0]:
                    yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"HybridState({len(self)} entries)"

    # -- every write is refused ---------------------------------------------------------------

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(_READ_ONLY)

    setdefault = _refuse
    update = _refuse
    pop = _refuse
    popitem = _refuse
    clear = _refuse
