"""The pure kernels of ``gefen.muon`` (docs/muon.md §4, §7, §12)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gefen.muon
from gefen.dist.testing import gloo_required, run_ranks
from gefen.muon import (
    NS_SCHEDULES,
    STANDARD_TRIPLE,
    adjust_lr_ratio,
    local_slice_of_full,
    newton_schulz,
    normuon_rescale,
    resolve_ns_schedule,
    stable_owner,
)

EPS = 1e-7
TUNED3 = ((5.0067, -14.4125, 10.6001), (3.7534, -6.8083, 3.3840), (3.2080, -4.3501, 2.0330))
TUNED4 = (
    (5.4261, -15.5285, 11.2657),
    (3.0766, -4.9701, 2.1297),
    (3.0008, -6.4486, 4.3696),
    (2.8386, -4.1421, 2.5758),
)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_package_exports_the_kernels() -> None:
    exported = set(gefen.muon.__all__)
    assert {
        "NS_SCHEDULES",
        "resolve_ns_schedule",
        "newton_schulz",
        "normuon_rescale",
        "adjust_lr_ratio",
        "stable_owner",
        "local_slice_of_full",
    } <= exported
    assert STANDARD_TRIPLE == (3.4445, -4.7750, 2.0315)


# --------------------------------------------------------------------------------------------
# resolve_ns_schedule


def test_named_schedules_hold_the_exact_triples() -> None:
    assert NS_SCHEDULES["tuned3"] == TUNED3
    assert NS_SCHEDULES["tuned4"] == TUNED4
    assert set(NS_SCHEDULES) == {"tuned3", "tuned4"}
    with pytest.raises(TypeError):
        NS_SCHEDULES["tuned3"] = ()  # type: ignore[index]


def test_fixed_path_repeats_the_triple_ns_steps_times() -> None:
    assert resolve_ns_schedule(None, (1, 2, 3), 4) == ((1.0, 2.0, 3.0),) * 4
    assert all(type(x) is float for x in resolve_ns_schedule(None, (1, 2, 3), 1)[0])
    assert resolve_ns_schedule("standard", STANDARD_TRIPLE, 6) == (STANDARD_TRIPLE,) * 6
    assert resolve_ns_schedule(None, STANDARD_TRIPLE, 99) == (STANDARD_TRIPLE,) * 99


@pytest.mark.parametrize("ns_steps", [0, -1, 100, True, 2.0, None])
@pytest.mark.parametrize("schedule", [None, "standard"])
def test_fixed_path_rejects_bad_ns_steps(schedule: str | None, ns_steps: Any) -> None:
    with pytest.raises(ValueError, match="ns_steps"):
        resolve_ns_schedule(schedule, STANDARD_TRIPLE, ns_steps)


@pytest.mark.parametrize("ns_steps", [0, -1, 5, 100, 1000])
def test_fixed_length_schedules_accept_any_int_ns_steps(ns_steps: int) -> None:
    assert resolve_ns_schedule("tuned3", STANDARD_TRIPLE, ns_steps) == TUNED3
    assert resolve_ns_schedule("tuned4", STANDARD_TRIPLE, ns_steps) == TUNED4
    explicit = [(1, 2, 3), [4.0, 5.0, 6.0]]
    assert resolve_ns_schedule(explicit, STANDARD_TRIPLE, ns_steps) == ((1, 2, 3), (4, 5, 6))


def test_fixed_length_schedules_still_reject_a_non_int_ns_steps() -> None:
    # The spec admits "any int (not bool)" here.
    with pytest.raises(ValueError, match="ns_steps"):
        resolve_ns_schedule("tuned3", STANDARD_TRIPLE, True)
    with pytest.raises(ValueError, match="ns_steps"):
        resolve_ns_schedule([STANDARD_TRIPLE], STANDARD_TRIPLE, 3.0)


def test_explicit_schedule_accepts_99_triples_and_returns_floats() -> None:
    resolved = resolve_ns_schedule([(1, 0, 0)] * 99, STANDARD_TRIPLE, 5)
    assert len(resolved) == 99
    assert all(type(x) is float for triple in resolved for x in triple)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], "must not be empty"),
        ((), "must not be empty"),
        ([(1.0, 2.0)], "entry 0"),
        ([STANDARD_TRIPLE, (1.0, 2.0, 3.0, 4.0)], "entry 1"),
        ([STANDARD_TRIPLE] * 100, "fewer than 100"),
        ([STANDARD_TRIPLE, STANDARD_TRIPLE, (math.nan, 1.0, 1.0)], "entry 2"),
        ([(1.0, math.inf, 1.0)], "entry 0"),
        ([(1.0, 1.0, -math.inf)], "entry 0"),
        ([(True, 1.0, 1.0)], "entry 0"),
        ([(1.0, 1.0, False)], "entry 0"),
        ([(1.0, "2", 3.0)], "entry 0"),
        ([(1.0, 10**400, 3.0)], "entry 0"),
        (["abc"], "entry 0"),
        ([1.0, 2.0, 3.0], "entry 0"),
        ("tuned5", "Unknown ns_schedule"),
        ("Standard", "Unknown ns_schedule"),
        ("", "Unknown ns_schedule"),
        (b"tuned3", "ns_schedule"),
        (3, "ns_schedule"),
    ],
)
def test_bad_schedules_are_rejected(schedule: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_ns_schedule(schedule, STANDARD_TRIPLE, 5)


@pytest.mark.parametrize(
    "coefficients",
    [(1.0, 2.0), (1.0, 2.0, 3.0, 4.0), (math.nan, 1.0, 1.0), (1.0, math.inf, 1.0), (True, 1, 1)],
)
@pytest.mark.parametrize("schedule", [None, "standard", "tuned3"])
def test_bad_coefficients_are_rejected(schedule: str | None, coefficients: Any) -> None:
    with pytest.raises(ValueError, match="ns_coefficients"):
        resolve_ns_schedule(schedule, coefficients, 5)


# --------------------------------------------------------------------------------------------
# newton_schulz


def _composed(schedule: tuple[tuple[float, float, float], ...]) -> torch.Tensor:
    s = torch.linspace(0.01, 1.0, 100_000, dtype=torch.float64)
    for a, b, c in schedule:
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("standard", 0.68, 1.14), ("tuned3", 0.57, 1.15), ("tuned4", 0.96, 1.01)],
)
def test_composed_polynomial_ranges(name: str, low: float, high: float) -> None:
    values = _composed(resolve_ns_schedule(name, STANDARD_TRIPLE, 5))
    assert low <= values.min().item()
    assert values.max().item() <= high


def test_standard_and_five_explicit_triples_are_bit_identical() -> None:
    G = _randn(24, 40, seed=3)
    named = newton_schulz(G, resolve_ns_schedule("standard", STANDARD_TRIPLE, 5), EPS)
    explicit = newton_schulz(G, resolve_ns_schedule([STANDARD_TRIPLE] * 5, (1, 1, 1), 0), EPS)
    default = newton_schulz(G, resolve_ns_schedule(None, STANDARD_TRIPLE, 5), EPS)
    assert torch.equal(named, explicit)
    assert torch.equal(named, default)
    # A different schedule really changes the output, so the equalities above are meaningful.
    assert not torch.equal(named, newton_schulz(G, TUNED4, EPS))


def _torch_reference() -> Any:
    muon = pytest.importorskip("torch.optim._muon")
    return muon._zeropower_via_newtonschulz


@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (20, 20), (1, 8), (8, 1), (64, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("triple", "steps"),
    [(STANDARD_TRIPLE, 5), (STANDARD_TRIPLE, 1), ((2.0, -1.5, 0.5), 6), (TUNED4[0], 3)],
)
def test_bitwise_parity_with_torch_muon(
    shape: tuple[int, int], dtype: torch.dtype, triple: tuple[float, float, float], steps: int
) -> None:
    reference = _torch_reference()
    G = _randn(*shape, seed=sum(shape), dtype=dtype)
    before = G.clone()
    ours = newton_schulz(G, (triple,) * steps, EPS)
    theirs = reference(G.clone(), triple, steps, EPS)
    assert ours.dtype == torch.bfloat16
    assert ours.shape == G.shape
    assert torch.equal(ours, theirs)
    assert torch.equal(G, before)


def test_bitwise_parity_on_a_transposed_input() -> None:
    # A non-contiguous G must normalise with the same reduction order as torch's.
    reference = _torch_reference()
    G = _randn(24, 40, seed=5).mT
    ours = newton_schulz(G, (STANDARD_TRIPLE,) * 5, EPS)
    assert torch.equal(ours, reference(G.clone(), STANDARD_TRIPLE, 5, EPS))


def test_a_mixed_schedule_applies_its_triples_in_order() -> None:
    G = _randn(12, 20, seed=7)
    forward = newton_schulz(G, TUNED3, EPS)
    backward = newton_schulz(G, TUNED3[::-1], EPS)
    assert not torch.equal(forward, backward)
    prefix = newton_schulz(G, TUNED3[:1], EPS)
    assert torch.equal(prefix, _torch_reference()(G.clone(), TUNED3[0], 1, EPS))


@pytest.mark.parametrize("shape", [(64, 96), (96, 64)])
def test_default_schedule_orthogonalises(shape: tuple[int, int]) -> None:
    G = _randn(*shape, seed=11)
    out = newton_schulz(G, resolve_ns_schedule(None, STANDARD_TRIPLE, 5), EPS)
    assert out.shape == G.shape
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    singular = torch.linalg.svdvals(out.float())
    assert singular.min().item() > 0.5
    assert singular.max().item() < 1.3


def test_bf16_input_is_not_modified() -> None:
    G = _randn(8, 12, seed=2, dtype=torch.bfloat16)
    before = G.clone()
    out = newton_schulz(G, (STANDARD_TRIPLE,) * 5, EPS)
    assert torch.equal(G, before)
    assert out.data_ptr() != G.data_ptr()


def test_zero_matrix_stays_zero() -> None:
    out = newton_schulz(torch.zeros(6, 4), (STANDARD_TRIPLE,) * 5, EPS)
    assert torch.equal(out, torch.zeros(6, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(), (8,), (2, 3, 4)])
def test_non_2d_input_is_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="must be a 2D matrix"):
        newton_schulz(torch.ones(shape), (STANDARD_TRIPLE,), EPS)


# --------------------------------------------------------------------------------------------
# normuon_rescale


def test_normuon_hand_computed_example() -> None:
    # r = (5, 1); v = 0.5 * r^2 / 2 = (6.25, 0.25); d = sqrt(v / 0.5) = (sqrt 12.5, sqrt 0.5);
    # r / d = (sqrt 2, sqrt 2), so F = sqrt(26) / 2 and both rows end with norm sqrt(13).
    update = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    v = torch.zeros(2, 1)
    out, t = normuon_rescale(update, v, 0, 0.5, 0.0)
    assert t == 1
    assert torch.equal(v, torch.tensor([[6.25], [0.25]]))
    root13 = math.sqrt(13.0)
    expected = torch.tensor([[3.0 * root13 / 5.0, 4.0 * root13 / 5.0], [0.0, root13]])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0.0)
    assert torch.equal(update, torch.tensor([[3.0, 4.0], [0.0, 1.0]]))


def _normuon_oracle(
    rows: list[list[float]], v: list[float], t: int, beta2: float, eps: float
) -> tuple[list[list[float]], list[float]]:
    """§4 written out row by row in float64."""
    r = [math.sqrt(sum(x * x for x in row)) for row in rows]
    v = [beta2 * vi + (1 - beta2) * ri * ri / len(rows[0]) for vi, ri in zip(v, r, strict=True)]
    d = [math.sqrt(vi / (1 - beta2 ** (t + 1))) + eps for vi in v]
    factor = math.sqrt(sum(ri * ri for ri in r)) / math.sqrt(
        sum((ri / di) ** 2 for ri, di in zip(r, d, strict=True))
    )
    return [[x * factor / di for x in row] for row, di in zip(rows, d, strict=True)], v


def test_normuon_matches_the_formula_over_several_steps() -> None:
    # A large eps makes the bias correction visible (without eps it cancels in F / d).
    v = torch.zeros(3, 1)
    v_oracle = [0.0, 0.0, 0.0]
    for t in range(4):
        update = _randn(3, 5, seed=t) * torch.tensor([[0.1], [1.0], [3.0]])
        out, new_t = normuon_rescale(update, v, t, 0.9, 0.5)
        expected, v_oracle = _normuon_oracle(update.double().tolist(), v_oracle, t, 0.9, 0.5)
        assert new_t == t + 1
        torch.testing.assert_close(
            out.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0.0
        )
        torch.testing.assert_close(
            v.double().squeeze(1), torch.tensor(v_oracle, dtype=torch.float64), rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
def test_normuon_preserves_the_frobenius_norm(shape: tuple[int, int]) -> None:
    rows = shape[0]
    v = torch.zeros(rows, 1)
    v_ptr = v.data_ptr()
    t = 0
    for step in range(4):
        # Rows of very different scales, so the rescale has real work to do.
        scales = torch.logspace(-2, 1, rows).unsqueeze(1)
        update = (newton_schulz(_randn(*shape, seed=step), TUNED4, EPS).float() * scales).bfloat16()
        before_v = v.clone()
        out, new_t = normuon_rescale(update, v, t, 0.95, 1e-8)
        assert new_t == t + 1
        t = new_t
        assert out.dtype == torch.bfloat16
        assert out.shape == update.shape
        assert v.dtype == torch.float32
        assert v.shape == (rows, 1)
        assert v.data_ptr() == v_ptr
        assert not torch.equal(v, before_v)
        norm_in = update.float().norm().item()
        assert abs(out.float().norm().item() - norm_in) <= 5e-3 * norm_in
        row_norms = out.float().norm(dim=1)
        assert row_norms.max() / row_norms.min() < 2.0  # input spread was 1000x


def test_normuon_zero_update_stays_exactly_zero() -> None:
    update = torch.zeros(8, 16, dtype=torch.bfloat16)
    v = torch.zeros(8, 1)
    out, t = normuon_rescale(update, v, 0, 0.95, 1e-8)
    assert t == 1
    assert torch.equal(out, update)
    assert torch.equal(v, torch.zeros(8, 1))
    # And after the state has history.
    v.fill_(0.3)
    out, t = normuon_rescale(update, v, 5, 0.95, 1e-8)
    assert t == 6
    assert torch.equal(out, update)
    assert torch.isfinite(v).all()


@pytest.mark.parametrize(
    "state", [torch.zeros(8, 1, dtype=torch.bfloat16), torch.zeros(8), torch.zeros(4, 1)]
)
def test_normuon_rejects_a_malformed_state(state: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="normuon state"):
        normuon_rescale(torch.ones(8, 4), state, 0, 0.95, 1e-8)


def test_normuon_rejects_non_2d() -> None:
    with pytest.raises(ValueError, match="2D matrix"):
        normuon_rescale(torch.ones(8), torch.zeros(8, 1), 0, 0.95, 1e-8)


# --------------------------------------------------------------------------------------------
# adjust_lr_ratio and stable_owner


def test_adjust_lr_ratio_examples() -> None:
    assert adjust_lr_ratio(None, (1024, 256)) == 2.0
    assert adjust_lr_ratio("original", torch.Size([1024, 256])) == 2.0
    assert adjust_lr_ratio(None, (256, 1024)) == 1.0
    assert adjust_lr_ratio("original", (256, 1024)) == 1.0
    assert adjust_lr_ratio("match_rms_adamw", (1024, 256)) == pytest.approx(6.4, rel=1e-12)
    assert adjust_lr_ratio("match_rms_adamw", (256, 1024)) == pytest.approx(6.4, rel=1e-12)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (20, 20), (1, 8), (1000, 3)])
def test_adjust_lr_ratio_matches_torch(fn: str | None, shape: tuple[int, int]) -> None:
    muon = pytest.importorskip("torch.optim._muon")
    assert adjust_lr_ratio(fn, shape) == muon._adjust_lr(1.0, fn, torch.Size(shape))


@pytest.mark.parametrize("fn", ["Original", "", "rms", 1])
def test_adjust_lr_ratio_rejects_unknown_functions(fn: Any) -> None:
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjust_lr_ratio(fn, (4, 4))


def test_stable_owner_is_index_mod_world() -> None:
    assert [stable_owner(i, 2) for i in range(5)] == [0, 1, 0, 1, 0]
    assert [stable_owner(i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert stable_owner(7, 1) == 0


@pytest.mark.parametrize(("index", "world"), [(0, 0), (3, -1), (-1, 0)])
def test_stable_owner_rejects_a_non_positive_world(index: int, world: int) -> None:
    with pytest.raises(ValueError, match="world must be positive"):
        stable_owner(index, world)


def test_stable_owner_rejects_a_negative_index() -> None:
    with pytest.raises(ValueError, match="stable_index must be non-negative"):
        stable_owner(-1, 2)


# --------------------------------------------------------------------------------------------
# local_slice_of_full


@pytest.mark.parametrize("shape", [(5, 4), (1, 4), (0, 3), (3, 2)])
def test_local_slice_of_a_plain_parameter_is_the_full_tensor(shape: tuple[int, int]) -> None:
    full = _randn(*shape)
    assert local_slice_of_full(full, torch.empty(shape)) is full


SLICE_SHAPES = [(5, 4), (4, 4), (3, 2), (1, 4)]
NEEDS_GLOO: pytest.MarkDecorator = gloo_required()


def slice_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Compare ``local_slice_of_full`` with what DTensor itself keeps on this rank."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world_size,))
    grid = init_device_mesh("cpu", (1, world_size))
    layouts: list[tuple[str, Any, list[Any]]] = [
        ("rows", mesh, [Shard(0)]),
        ("cols", mesh, [Shard(1)]),
        ("negative", mesh, [Shard(-2)]),
        ("replicate", mesh, [Replicate()]),
        ("grid", grid, [Replicate(), Shard(0)]),
    ]
    results: dict[str, Any] = {}
    for shape in SLICE_SHAPES:
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        for name, on, placements in layouts:
            dtensor = distribute_tensor(full, on, placements)
            piece = local_slice_of_full(full, dtensor)
            results[f"{name}{shape}"] = (
                tuple(piece.shape),
                torch.equal(piece, dtensor.to_local()),
                piece.numel() == 0
                or piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(),
            )
    # A strided shard takes the redistribute fallback; its rows are not one torch.chunk.
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    replicated = DTensor.from_local(full, mesh, [Replicate()], run_check=False)
    strided = replicated.redistribute(mesh, [_StridedShard(0, split_factor=2)])
    piece = local_slice_of_full(full, strided)
    results["strided"] = (piece[:, 0].tolist(), torch.equal(piece, strided.to_local()))
    # A mesh without this rank: torch keeps an empty local tensor there.
    lonely = DeviceMesh("cpu", [0])
    outside = distribute_tensor(torch.ones(5, 4), lonely, [Shard(0)])
    results["outside"] = tuple(local_slice_of_full(torch.ones(5, 4), outside).shape)
    return results


@pytest.mark.multirank
@NEEDS_GLOO
def test_local_slice_of_full_matches_dtensor_shards_on_gloo() -> None:
    results = run_ranks(slice_worker, 2, rank_deadline_s=120.0, pg_timeout_s=60.0)
    expected_rows = {(5, 4): (3, 2), (4, 4): (2, 2), (3, 2): (2, 1), (1, 4): (1, 0)}
    for rank, result in enumerate(results):
        for shape in SLICE_SHAPES:
            for name in ("rows", "cols", "negative", "replicate", "grid"):
                _, equal, is_view = result[f"{name}{shape}"]
                assert equal, (rank, name, shape)
                assert is_view, (rank, name, shape)
            rows = expected_rows[shape][rank]
            assert result[f"rows{shape}"][0] == (rows, shape[1])
            assert result[f"grid{shape}"][0] == (rows, shape[1])
            assert result[f"replicate{shape}"][0] == shape
        assert result["outside"] == ((5, 4) if rank == 0 else (0, 4))
        assert result["strided"] == ([[0.0, 4.0, 12.0, 16.0], [8.0, 20.0]][rank], True)
