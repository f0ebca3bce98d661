"""The collective presence/order preflight (docs/muon.md §7 and its §12 edge cases).

Unit tests cover the rules that need no processes (no collective without sharded parameters,
the probe's categories and message texts, the warning once-guard); one spawned 2-rank Gloo world
runs every real-collective scenario. Scenario functions are module-level so the spawned children
can load them by reference, and they return plain dicts only.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, cast

import pytest
import torch
from torch import nn

from gefen.dist import GroupAgreementError
from gefen.dist.testing import ScenarioWorld, gloo_required, run_scenarios
from gefen.muon import preflight
from gefen.muon.preflight import check_presence_and_order

DEADLINE_S = 10.0  # liveness bound of one preflight, below the process-group timeout

COUNT = (
    "GefenMuon requires the same DTensor parameters on every rank of a mesh; parameter count "
    "differs across ranks (min {a}, max {b})"
)
DUPLICATES = (
    "GefenMuon requires unique parameter names on a DTensor mesh; some rank has parameters "
    "sharing a name, shape, and dtype. Give every parameter a unique name."
)
LABELS = (
    "GefenMuon requires identical parameter names, shapes and dtypes on every rank of a DTensor "
    "mesh; mismatch at sorted positions {positions}"
)
ORDER = (
    "GefenMuon requires identical parameter-group order on every rank of a DTensor mesh; "
    "parameters at rank-divergent positions: {names}"
)
PRESENCE = (
    "GefenMuon requires identical gradient presence on every rank of a DTensor mesh; "
    "mismatched parameters: {names}"
)
UNVERIFIABLE = "cannot verify cross-rank parameter order"


def _forbid_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("all_reduce must not be called")

    monkeypatch.setattr(torch.distributed, "all_reduce", refuse)


# --- unit tests: no processes ----------------------------------------------------------------


def test_uninitialised_distributed_enters_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_all_reduce(monkeypatch)
    params = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4, 4))]
    check_presence_and_order([{"params": params, "sharded_mode": "exact"}])


def test_plain_tensors_enter_no_collective_even_when_initialised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_all_reduce(monkeypatch)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    params = [nn.Parameter(torch.zeros(4, 4)) for _ in range(3)]
    params[0].grad = torch.zeros(4, 4)
    groups: list[dict[str, Any]] = [
        {"params": params[:2], "param_names": ["a", "b"], "sharded_mode": "exact"},
        {"params": params[2:], "sharded_mode": "distributed"},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unverifiable-order warning for plain tensors
        check_presence_and_order(groups)


def _item(name: str, position: int, has: bool = True, shape: tuple[int, ...] = (4, 4)) -> Any:
    return preflight._Item(name, shape, "torch.float32", has, position, False)


def _outcome(*ranks: list[Any]) -> GroupAgreementError | None:
    """What the preflight raises when ``ranks`` hold these items on one mesh (counts equal)."""
    probes = [preflight._encode(sorted(items, key=preflight._label)) for items in ranks]
    reduced = [max(values) for values in zip(*probes, strict=True)]
    findings = preflight._Findings()
    preflight._absorb(sorted(ranks[0], key=preflight._label), reduced, findings)
    return preflight._first_error(findings, "GefenMuon")


def test_probe_agreeing_ranks_pass() -> None:
    items = [_item("a", 0), _item("b", 1, has=False)]
    assert _outcome(items, list(items)) is None


def test_probe_categories_and_texts() -> None:
    a, b = _item("a", 0), _item("b", 1)
    presence = _outcome([a, b], [a, b._replace(has_grad=False)])
    assert presence is not None
    assert (str(presence), presence.what) == (PRESENCE.format(names="b"), "gradient presence")
    swapped = [a._replace(position=1), b._replace(position=0)]
    order = _outcome([a, b], swapped)
    assert order is not None
    assert (str(order), order.what) == (ORDER.format(names="a, b"), "parameter order")
    # Order outranks a coexisting presence mismatch.
    both = _outcome([a._replace(has_grad=False), b], swapped)
    assert both is not None
    assert str(both) == ORDER.format(names="a, b")
    labels = _outcome([a, b], [a, _item("c", 1)])
    assert labels is not None
    assert (str(labels), labels.what) == (LABELS.format(positions="1"), "parameter labels")
    reshaped = _outcome([a, b], [a._replace(shape=(8, 4)), b._replace(dtype="torch.bfloat16")])
    assert reshaped is not None
    assert str(reshaped) == LABELS.format(positions="0, 1")
    duplicates = _outcome([a, _item("a", 1)], [a, b])
    assert duplicates is not None
    assert (str(duplicates), duplicates.what) == (DUPLICATES, "unique parameter names")


def test_count_error_text_substitutes_owner_and_outranks_everything() -> None:
    findings = preflight._Findings(
        counts=[(2, 3)], duplicates=True, order_names={"a"}, presence_names={"b"}
    )
    error = preflight._first_error(findings, "GefenMuonHybrid")
    assert error is not None
    assert str(error) == COUNT.format(a=2, b=3).replace("GefenMuon", "GefenMuonHybrid", 1)
    assert (error.owner_name, error.what) == ("GefenMuonHybrid", "parameter count")


def test_unverifiable_order_warns_once_per_parameter_set() -> None:
    def meshes(params: list[torch.Tensor]) -> dict[Any, Any]:
        items = [
            preflight._Item(f"param_groups[0][{i}]", (4, 4), "torch.float32", True, i, True)
            for i in range(len(params))
        ]
        return {
            ("cpu", (2,), (0, 1)): preflight._Mesh(
                cast(Any, None), torch.device("cpu"), items, params
            )
        }

    params = [torch.zeros(4, 4), torch.zeros(4, 4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preflight._warn_unverifiable_order(meshes(params), "GefenMuon")
        preflight._warn_unverifiable_order(meshes(params), "GefenMuon")
        preflight._warn_unverifiable_order(meshes(params[:1]), "GefenMuon")  # nothing ambiguous
        fresh = [torch.zeros(4, 4), torch.zeros(4, 4)]  # another optimizer's parameters
        preflight._warn_unverifiable_order(meshes(fresh), "GefenMuon")
    assert [w.category for w in caught] == [RuntimeWarning, RuntimeWarning]
    assert all(UNVERIFIABLE in str(w.message) for w in caught)


# --- multi-rank scenarios (spawned children) -------------------------------------------------

_MESHES: dict[tuple[int, ...], Any] = {}


def _mesh(shape: tuple[int, ...] = (2,)) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:  # one mesh per shape per child: each new mesh makes new groups
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def _param(shape: tuple[int, ...], mesh: Any = None) -> nn.Parameter:
    """A ``Shard(0)`` DTensor parameter with a gradient; every rank must call it (collective)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh() if mesh is None else mesh
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    param = nn.Parameter(distribute_tensor(torch.randn(shape), mesh, placements))
    param.grad = distribute_tensor(torch.randn(shape), mesh, placements)
    return param


def _group(params: list[Any], names: list[str] | None, mode: str = "exact") -> dict[str, Any]:
    group: dict[str, Any] = {"params": params, "sharded_mode": mode}
    if names is not None:
        group["param_names"] = names
    return group


def _check(
    groups: list[dict[str, Any]], owner: str = "GefenMuon", calls: int = 1
) -> dict[str, Any]:
    """Run the preflight ``calls`` times; report errors, warnings and the all-reduces issued."""
    import torch.distributed as dist

    original = dist.all_reduce
    issued: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        issued.append(1)
        return original(*args, **kwargs)

    def local_state() -> list[Any]:
        return [
            (p.to_local().clone(), None if p.grad is None else p.grad.to_local().clone())
            for group in groups
            for p in group["params"]
        ]

    before = local_state()
    errors: list[dict[str, Any] | None] = []
    start = time.perf_counter()
    dist.all_reduce = counting
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(calls):
                try:
                    check_presence_and_order(groups, owner=owner)
                    errors.append(None)
                except GroupAgreementError as error:
                    errors.append(
                        {"message": str(error), "what": error.what, "owner": error.owner_name}
                    )
    finally:
        dist.all_reduce = original
    after = local_state()
    unchanged = all(
        torch.equal(p0, p1) and (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1))
        for (p0, g0), (p1, g1) in zip(before, after, strict=True)
    )
    return {
        "errors": errors,
        "error": errors[-1],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "all_reduces": len(issued),
        "elapsed": time.perf_counter() - start,
        "unchanged": unchanged,
    }


def scenario_agree(rank: int, world_size: int) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((6, 4))
    return _check([_group([a, b], ["a", "b"])])


def scenario_presence(rank: int, world_size: int) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((6, 4))
    if rank == 0:
        b.grad = None
    return _check([_group([a], ["a"]), _group([b], ["b"], "distributed")])


def scenario_presence_owner(rank: int, world_size: int) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((6, 4))
    if rank == 1:
        a.grad = None
    return _check([_group([a, b], ["a", "b"])], owner="GefenMuonHybrid")


def scenario_reversed(rank: int, world_size: int, drop_grad: bool) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((6, 4))
    if drop_grad and rank == 0:
        b.grad = None
    if rank == 1:
        return _check([_group([b, a], ["b", "a"])])
    return _check([_group([a, b], ["a", "b"])])


def scenario_cross_mesh(rank: int, world_size: int, reverse: bool) -> dict[str, Any]:
    # A (1, 2) mesh has a different content key from the (2,) mesh over the same ranks, and
    # its size-1 first dimension must be skipped by the world > 1 rule.
    a, b = _param((4, 4)), _param((6, 4), _mesh((1, 2)))
    if reverse and rank == 1:
        return _check([_group([b], ["b"]), _group([a], ["a"])])
    return _check([_group([a], ["a"]), _group([b], ["b"])])


def scenario_duplicate(rank: int, world_size: int) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((4, 4))
    return _check([_group([a, b], ["a", "a"] if rank == 0 else ["a", "b"])])


def scenario_labels(rank: int, world_size: int) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((6, 4))
    return _check([_group([a, b], ["a", "b"] if rank == 0 else ["a", "c"])])


def scenario_counts(rank: int, world_size: int) -> dict[str, Any]:
    a, b, c = _param((4, 4)), _param((6, 4)), _param((2, 4))
    if rank == 0:
        return _check([_group([a, b, c], ["a", "b", "c"])])
    return _check([_group([a, b], ["a", "b"])])


def scenario_synthesized(rank: int, world_size: int) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((4, 4))
    # Reversed on one rank: undetectable without names, so it warns instead of failing.
    return _check([_group([a, b] if rank == 0 else [b, a], None)], calls=2)


def scenario_approx(rank: int, world_size: int) -> dict[str, Any]:
    a, b = _param((4, 4)), _param((6, 4))
    if rank == 0:
        b.grad = None
    params, names = ([a, b], ["a", "b"]) if rank == 0 else ([b, a], ["b", "a"])
    return _check([_group(params, names, "approx")])


SCENARIOS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("agree", scenario_agree, ()),
    ("presence", scenario_presence, ()),
    ("presence_owner", scenario_presence_owner, ()),
    ("reversed", scenario_reversed, (False,)),
    ("reversed_presence", scenario_reversed, (True,)),
    ("cross_mesh_agree", scenario_cross_mesh, (False,)),
    ("cross_mesh_reversed", scenario_cross_mesh, (True,)),
    ("duplicate", scenario_duplicate, ()),
    ("labels", scenario_labels, ()),
    ("counts", scenario_counts, ()),
    ("synthesized", scenario_synthesized, ()),
    ("approx", scenario_approx, ()),
]


@pytest.fixture(scope="module")
def world() -> ScenarioWorld:
    return run_scenarios(SCENARIOS, 2, rank_deadline_s=300.0, pg_timeout_s=20.0)


def _symmetric(
    world: ScenarioWorld, name: str, message: str | None, what: str | None = None
) -> list[dict[str, Any]]:
    """Both ranks' results, after asserting they raised ``message`` identically (or passed)."""
    results = world[name]
    assert len(results) == 2
    for result in results:
        assert result["unchanged"]
        assert result["elapsed"] < DEADLINE_S
        if message is None:
            assert result["error"] is None
        else:
            assert result["error"] is not None
            assert result["error"]["message"] == message
            assert result["error"]["owner"] == message.split(" ", 1)[0]
            if what is not None:
                assert result["error"]["what"] == what
    assert results[0]["error"] == results[1]["error"]
    return results


class TestGlooWorld:
    pytestmark: ClassVar[list[Any]] = [pytest.mark.multirank, gloo_required()]

    @pytest.mark.smoke
    def test_agreeing_ranks_pass_with_one_count_and_one_probe(self, world: ScenarioWorld) -> None:
        for result in _symmetric(world, "agree", None):
            assert result["all_reduces"] == 2
            assert result["warnings"] == []

    @pytest.mark.smoke
    def test_presence_mismatch_raises_identically(self, world: ScenarioWorld) -> None:
        _symmetric(world, "presence", PRESENCE.format(names="b"), "gradient presence")

    def test_messages_name_the_given_owner(self, world: ScenarioWorld) -> None:
        message = PRESENCE.format(names="a").replace("GefenMuon", "GefenMuonHybrid", 1)
        _symmetric(world, "presence_owner", message, "gradient presence")

    @pytest.mark.smoke
    def test_reversed_registration_order_names_both(self, world: ScenarioWorld) -> None:
        _symmetric(world, "reversed", ORDER.format(names="a, b"), "parameter order")

    def test_reversed_order_outranks_presence_mismatch(self, world: ScenarioWorld) -> None:
        _symmetric(world, "reversed_presence", ORDER.format(names="a, b"), "parameter order")

    def test_two_meshes_agree_with_two_all_reduces_each(self, world: ScenarioWorld) -> None:
        for result in _symmetric(world, "cross_mesh_agree", None):
            assert result["all_reduces"] == 4

    def test_cross_mesh_reversal_names_both(self, world: ScenarioWorld) -> None:
        _symmetric(world, "cross_mesh_reversed", ORDER.format(names="a, b"), "parameter order")

    def test_duplicate_on_one_rank_fails_every_rank(self, world: ScenarioWorld) -> None:
        _symmetric(world, "duplicate", DUPLICATES, "unique parameter names")

    def test_label_mismatch_names_sorted_positions(self, world: ScenarioWorld) -> None:
        _symmetric(world, "labels", LABELS.format(positions="1"), "parameter labels")

    def test_differing_counts_fail_fast_without_a_probe(self, world: ScenarioWorld) -> None:
        for result in _symmetric(world, "counts", COUNT.format(a=2, b=3), "parameter count"):
            assert result["all_reduces"] == 1

    def test_synthesized_same_shape_names_warn_once_and_pass(self, world: ScenarioWorld) -> None:
        for result in _symmetric(world, "synthesized", None):
            assert result["errors"] == [None, None]
            assert len(result["warnings"]) == 1
            assert UNVERIFIABLE in result["warnings"][0]

    def test_approx_groups_are_not_covered(self, world: ScenarioWorld) -> None:
        for result in _symmetric(world, "approx", None):
            assert result["all_reduces"] == 0
