"""``GefenMuonHybrid.state``: a read-only routing view over the children's state
(docs/hybrid.md §5).

Reads route to the owning child's live per-parameter dict (so a child's defaultdict behaves as
in torch); ``in`` and ``get`` never create an entry; every write raises, so no caller can drop an
entry a Gefen child needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from torch import Tensor

if TYPE_CHECKING:
    from gefen.hybrid.composite import HybridInterface

__all__ = ["HybridState"]

_READ_ONLY = (
    "GefenMuonHybrid.state is read-only; modify a child's state through hybrid.muon or "
    "hybrid.backup"
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

    def __getitem__(self, key: Tensor) -> Any:
        return self._owner(key).state[key]

    def __contains__(self, key: object) -> bool:
        child = self._hybrid.owner_of(key)
        return child is not None and key in child.state

    def get(self, key: Tensor, default: Any = None) -> Any:
        child = self._hybrid.owner_of(key)
        if child is None or key not in child.state:
            return default
        return child.state[key]

    def __iter__(self) -> Iterator[Tensor]:
        for child in self._hybrid.children:
            yield from child.state

    def __len__(self) -> int:
        return sum(len(child.state) for child in self._hybrid.children)

    def __repr__(self) -> str:
        return f"HybridState({len(self)} entries)"

    # -- every write is refused ---------------------------------------------------------------

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(_READ_ONLY)

    __setitem__ = _refuse
    __delitem__ = _refuse
    setdefault = _refuse
    update = _refuse
    pop = _refuse
    popitem = _refuse
    clear = _refuse
