"""Which parameters Muon trains and which go to the backup (docs/hybrid.md §2).

Routing is by name substring (case-insensitive) and, in the module form, by identity: every
``nn.Embedding``/``nn.EmbeddingBag`` weight goes to the backup whatever its name, which also
catches heads tied to an embedding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn

__all__ = [
    "DEFAULT_BACKUP_SUBSTRINGS",
    "NamedParams",
    "check_matrix",
    "is_muon_param",
    "route_pairs",
    "split_params_for_muon",
    "validate_split",
]

_LOGGER = logging.getLogger("gefen.hybrid")

DEFAULT_BACKUP_SUBSTRINGS: tuple[str, ...] = (
    "embed",
    "wte",
    "wpe",
    "lm_head",
    "classifier",
    "score",
)
"""Name substrings that route a 2-D parameter to the backup. "head" and "output" are absent on
purpose: they would catch hidden layers."""

NamedParams = list[tuple[str, Tensor]]


def is_muon_param(
    name: str, p: Tensor, backup_substrings: Sequence[str] = DEFAULT_BACKUP_SUBSTRINGS
) -> bool:
    """True iff ``p`` is 2-D and its lower-cased name contains none of the substrings."""
    lowered = name.lower()
    return p.ndim == 2 and not any(token.lower() in lowered for token in backup_substrings)


def _embedding_weights(model: nn.Module) -> set[int]:
    return {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
    }


def split_params_for_muon(
    model: nn.Module, backup_substrings: Sequence[str] = DEFAULT_BACKUP_SUBSTRINGS
) -> tuple[NamedParams, NamedParams]:
    """``(muon_pairs, backup_pairs)`` of the model's trainable parameters (tied ones once)."""
    embeddings = _embedding_weights(model)
    muon: NamedParams = []
    backup: NamedParams = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        to_muon = id(param) not in embeddings and is_muon_param(name, param, backup_substrings)
        (muon if to_muon else backup).append((name, param))
    _LOGGER.info(
        "split_params_for_muon: %d muon / %d backup params; backup = %s",
        len(muon),
        len(backup),
        [name for name, _ in backup],
    )
    return muon, backup


def _check_pair(item: object, role: str) -> tuple[str, Tensor]:
    if (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], Tensor)
    ):
        return item[0], item[1]
    shown = f"a tensor of shape {tuple(item.shape)}" if isinstance(item, Tensor) else repr(item)
    raise TypeError(
        f"the {role} list must hold (name, parameter) pairs, got {shown[:200]}; pass "
        "model.named_parameters() or use GefenMuonHybrid.from_model"
    )


def _check_list(pairs: list[tuple[str, Tensor]], role: str) -> None:
    seen: set[int] = set()
    for name, param in pairs:
        if id(param) in seen:
            raise ValueError(f"parameter '{name}' appears twice in the {role} list")
        seen.add(id(param))


def check_matrix(param: Tensor, subject: str, remedy: str) -> None:
    """GefenMuon steps 2-D matrices only: say which parameter the caller sent it, and where
    it belongs, before GefenMuon's own (unnamed) refusal."""
    if param.ndim != 2:
        raise ValueError(
            f"{subject} has size {tuple(param.shape)}: GefenMuon steps only 2-D matrices ({remedy})"
        )


def validate_split(
    muon_pairs: Iterable[Any], backup_pairs: Iterable[Any], model: nn.Module | None = None
) -> tuple[NamedParams, NamedParams]:
    """Return both lists unchanged (as lists) or raise on the first inconsistency (§2)."""
    muon = [_check_pair(item, "muon") for item in muon_pairs]
    backup = [_check_pair(item, "backup") for item in backup_pairs]
    _check_list(muon, "muon")
    _check_list(backup, "backup")
    muon_ids = {id(param) for _, param in muon}
    for name, param in backup:  # first: "put it in the backup list" would mislead here
        if id(param) in muon_ids:
            raise ValueError(f"parameter '{name}' appears in BOTH the muon and backup lists")
    for name, param in muon:
        check_matrix(param, f"parameter '{name}' in the muon list", "put it in the backup list")
    names: set[str] = set()
    for name, _ in [*muon, *backup]:
        if name in names:
            raise ValueError(f"duplicate parameter name '{name}'")
        names.add(name)
    if model is not None:
        covered = muon_ids | {id(param) for _, param in backup}
        missing = [
            name
            for name, param in model.named_parameters()
            if param.requires_grad and id(param) not in covered
        ]
        if missing:
            raise ValueError(f"trainable parameters in neither list: {missing}")
    return muon, backup


def route_pairs(
    pairs: Iterable[Any], backup_substrings: Sequence[str]
) -> tuple[NamedParams, NamedParams]:
    """The pair-iterable form: skip frozen items, route by ``is_muon_param`` (names only)."""
    muon: NamedParams = []
    backup: NamedParams = []
    for item in pairs:
        if isinstance(item, Tensor):
            raise TypeError(
                "GefenMuonHybrid cannot route bare tensors: pass model.named_parameters(), a "
                "module, or use GefenMuonHybrid.from_model"
            )
        name, param = _check_pair(item, "parameter")
        if not param.requires_grad:
            continue
        (muon if is_muon_param(name, param, backup_substrings) else backup).append((name, param))
    return muon, backup
