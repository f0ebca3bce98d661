"""Property-based checkpoint corruption over Gefen, GefenMuon and both hybrids.

Hypothesis mutates one place of a valid checkpoint (a leaf replaced by a value of the wrong
type, dtype, shape, layout or value; a key deleted or added; a list shortened or lengthened)
and loads it into the trained optimizer. Every outcome must be one of:

* rejected cleanly: ``ValueError("<Owner> checkpoint: …")`` (the hybrid's children keep their
  own prefix), nothing changed (deep snapshot), and the optimizer trains afterwards;
* accepted by design (a valid value of an option, a live-kept option, a dropped entry that the
  loader refills with a warning): the next step raises nothing and keeps every parameter finite
  (a finite hyperparameter the user chose, such as a Newton–Schulz coefficient of 1e30, may
  diverge, as an absurd lr does in any torch optimizer; it still must not raise).

Anything else (torch's NotImplementedError, a bare KeyError, a NaN after an accepted load) is a
defect. The derandomized run is the same on every machine; the figures are printed with ``-s``.
"""

from __future__ import annotations

import collections
import copy
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gefen.core import Gefen  # noqa: E402
from gefen.core.testing import SNAPSHOT_ATTRIBUTES  # noqa: E402
from gefen.dist.testing import deep_snapshot, snapshot_diff  # noqa: E402
from gefen.hybrid import GefenMuonHybrid  # noqa: E402
from gefen.muon import GefenMuon  # noqa: E402

KINDS = ("gefen", "muon", "hybrid_gefen", "hybrid_adamw")
PREFIXES = ("Gefen checkpoint:", "GefenMuon checkpoint:", "GefenMuonHybrid checkpoint:")
OUTCOMES: collections.Counter[tuple[str, str]] = collections.Counter()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _build(kind: str) -> tuple[Any, list[torch.nn.Parameter]]:
    model = _model()
    params = list(model.parameters())
    if kind == "gefen":
        return Gefen(params, lr=0.01), params
    if kind == "muon":
        matrices = [p for p in params if p.dim() == 2]
        return GefenMuon(matrices, lr=0.02), matrices
    backup = kind.split("_")[1]
    return GefenMuonHybrid(model, lr=0.01, backup_optimizer=backup, fused=False), params


def _step(optimizer: Any, params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


_TRAINED: dict[str, tuple[Any, list[torch.nn.Parameter], dict[str, Any]]] = {}
_VALUES: dict[str, list[torch.Tensor]] = {}


def _trained(kind: str) -> tuple[Any, list[torch.nn.Parameter], dict[str, Any]]:
    if kind not in _TRAINED:
        optimizer, params = _build(kind)
        for seed in range(3):
            _step(optimizer, params, seed)
        _TRAINED[kind] = (optimizer, params, copy.deepcopy(optimizer.state_dict()))
        _VALUES[kind] = [param.detach().clone() for param in params]
    return _TRAINED[kind]


# -- the mutations ------------------------------------------------------------------------------


def _places(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a node of the checkpoint (containers and leaves)."""
    yield path
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _places(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _places(value, (*path, index))


def _tensor_variants(value: torch.Tensor) -> list[Any]:
    variants: list[Any] = [
        value.reshape(-1)[:0],
        value.reshape(1, -1) if value.dim() != 2 else value.reshape(-1),
        value.bool(),
        torch.empty_like(value, device="meta"),
        value.reshape(-1).to_sparse() if value.dim() > 0 else value.reshape(1).to_sparse(),
        value.tolist(),
    ]
    if value.is_floating_point():
        variants += [
            value.double() if value.dtype != torch.float64 else value.float(),
            value.half(),
            torch.full_like(value, math.nan),
            torch.full_like(value, math.inf),
            -value.abs() - 1,
        ]
    else:
        variants += [value.float(), value.to(torch.int64) + 1]
    if value.dim() == 2 and value.shape[0] != value.shape[1]:
        variants.append(value.t())  # transposed: another shape, same numel, non-contiguous
    return variants


def _leaf_variants(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return _tensor_variants(value)
    if isinstance(value, bool):
        return [not value, int(value), None, "yes"]
    if isinstance(value, int):
        return [value + 1, value - 1, -1, 2**40, float(value), str(value), None, True]
    if isinstance(value, float):
        return [math.nan, math.inf, -1.0, 0.0, 1e30, None, "x", torch.tensor(value)]
    if isinstance(value, str):
        return ["bogus", "", None, 1]
    if value is None:
        return [0, "x", torch.zeros(3)]
    if isinstance(value, (list, tuple)):
        return [type(value)(), None, "x", type(value)([*value, *value[:1]])]
    return [None, "x"]


def _mutations(state: dict[str, Any]) -> list[tuple[str, tuple[Any, ...], Any]]:
    """(action, path, value) of every single-place mutation of ``state``."""
    found: list[tuple[str, tuple[Any, ...], Any]] = []
    for path in _places(state):
        node = _get(state, path)
        if path:
            found += [("set", path, value) for value in _leaf_variants(node)]
            if isinstance(_get(state, path[:-1]), dict):
                found.append(("delete", path, None))
        if isinstance(node, dict):
            found.append(("set", (*path, "zz_unknown"), 1))
    return found


def _exists(tree: Any, path: tuple[Any, ...]) -> bool:
    """Whether ``path`` still leads to a container (an earlier mutation may have removed it)."""
    for key in path:
        if isinstance(tree, dict):
            if key not in tree:
                return False
        elif not (isinstance(tree, (list, tuple)) and isinstance(key, int) and key < len(tree)):
            return False
        tree = tree[key]
    return isinstance(tree, (dict, list, tuple))


def _applies(tree: Any, action: str, path: tuple[Any, ...]) -> bool:
    """Whether the mutation still has its place (its container, and for a delete or a list
    item the element itself)."""
    if not _exists(tree, path[:-1]):
        return False
    parent, key = _get(tree, path[:-1]), path[-1]
    if isinstance(parent, dict):
        return action == "set" or key in parent
    return isinstance(key, int) and key < len(parent)


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _apply(state: dict[str, Any], action: str, path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    mutated = copy.deepcopy(state)
    parent = _get(mutated, path[:-1])
    if isinstance(parent, tuple):  # betas: rebuild the tuple one level up
        items = list(parent)
        if action == "delete":
            del items[path[-1]]
        else:
            items[path[-1]] = value
        _get(mutated, path[:-2])[path[-2]] = tuple(items)
    elif action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return mutated


# -- the property -------------------------------------------------------------------------------


def _snapshot(optimizer: Any) -> list[Any]:
    if isinstance(optimizer, GefenMuonHybrid):
        children = [c for c in (optimizer.muon, optimizer.backup) if c is not None]
        return [deep_snapshot(child, attributes=SNAPSHOT_ATTRIBUTES) for child in children]
    return [deep_snapshot(optimizer, attributes=SNAPSHOT_ATTRIBUTES)]


def _unchanged(before: list[Any], optimizer: Any) -> list[str]:
    after = _snapshot(optimizer)
    return [line for a, b in zip(before, after, strict=True) for line in snapshot_diff(a, b)]


def _finite(params: list[torch.nn.Parameter]) -> bool:
    return all(bool(torch.isfinite(param).all()) for param in params)


def _reset(kind: str) -> tuple[Any, list[torch.nn.Parameter], dict[str, Any]]:
    """The trained optimizer back at its checkpoint, its parameters at their values."""
    optimizer, params, valid = _trained(kind)
    optimizer.load_state_dict(valid)
    with torch.no_grad():
        for param, saved_value in zip(params, _VALUES[kind], strict=True):
            param.copy_(saved_value)
            param.grad = torch.randn_like(param)
    return optimizer, params, valid


def _check(kind: str, *mutations: tuple[str, tuple[Any, ...], Any]) -> None:
    optimizer, params, valid = _reset(kind)
    mutated = valid
    for action, path, value in mutations:
        if not _applies(mutated, action, path):
            return  # a pair whose first mutation removed the second's place: nothing to try
        mutated = _apply(mutated, action, path, value)
    before = _snapshot(optimizer)
    where = f"{kind}: " + "; ".join(
        f"{action} {'/'.join(map(str, path))} = {type(value).__name__}"
        for action, path, value in mutations
    )
    rejection: ValueError | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.load_state_dict(mutated)
    except ValueError as error:
        rejection = error
    except Exception as error:  # any other type is the defect being searched for
        pytest.fail(f"{where}: {type(error).__name__}: {error}")
    if rejection is not None:
        assert str(rejection).startswith(PREFIXES), f"{where}: unprefixed: {rejection}"
        assert _unchanged(before, optimizer) == [], f"{where}: rejected but changed"
        OUTCOMES[(kind, "rejected")] += 1
        optimizer.step()  # still trains
        assert _finite(params), f"{where}: training after a rejection went non-finite"
        return
    OUTCOMES[(kind, "accepted")] += 1
    try:
        optimizer.step()
    except Exception as error:
        pytest.fail(f"{where}: accepted, then the step raised {type(error).__name__}: {error}")
    if not all(_user_hyperparameter(path, value) for _, path, value in mutations):
        assert _finite(params), f"{where}: accepted, then the step made a parameter non-finite"


def _user_hyperparameter(path: tuple[Any, ...], value: Any) -> bool:
    """A finite number written into a group option: a valid hyperparameter the user chose (an
    lr of 1e30 diverges in torch's own optimizers too), accepted by design whatever it does."""
    finite = isinstance(value, (int, float)) and not isinstance(value, bool)
    return "param_groups" in path and finite and math.isfinite(value)


def _cases(kind: str) -> list[tuple[str, tuple[Any, ...], Any]]:
    return _mutations(_trained(kind)[2])


@pytest.mark.parametrize("kind", KINDS)
def test_every_single_place_corruption_is_rejected_cleanly_or_harmless(kind: str) -> None:
    before = collections.Counter(OUTCOMES)
    cases = _cases(kind)
    for case in cases:  # all of them: a few hundred loads per optimizer, seconds
        _check(kind, case)
    rejected = OUTCOMES[(kind, "rejected")] - before[(kind, "rejected")]
    accepted = OUTCOMES[(kind, "accepted")] - before[(kind, "accepted")]
    report = f"{kind}: {len(cases)} tried, {rejected} rejected, {accepted} accepted by design"
    print(f"\ncheckpoint corruption, {report}")  # noqa: T201 - the report
    assert rejected + accepted == len(cases)  # every case reached a verdict
    assert rejected > 0  # the mutations really corrupt (a no-op mutator would accept all)


@pytest.mark.parametrize("kind", KINDS)
def test_pairs_of_corruptions_are_rejected_cleanly_or_harmless(kind: str) -> None:
    cases = _cases(kind)

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        database=None,
    )
    @given(st.sampled_from(range(len(cases))), st.sampled_from(range(len(cases))))
    def property_holds(first: int, second: int) -> None:
        _check(kind, cases[first], cases[second])

    property_holds()
