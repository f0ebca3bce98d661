"""``momentum_codec="codebook4"``: a learned 16-value codebook, two 4-bit codes per byte.

The codec (pack, decode, the eager and fused advance), Gefen's state and its bytes, the learned
codebook, the refresh's byte remap, checkpoints (native, format 2 through torch's full state
dict) and the rejections: codebook8 and codebook4 in one optimizer, a codec changed after the
codebook is learned, a codebook8 file, a damaged padding nibble.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from gefen.core import Gefen
from gefen.core.codec import decode_blocks, encode_blocks
from gefen.core.kernels.blocks import pack_codes, unpack_codes
from gefen.core.kernels.quantize import nearest_index
from gefen.core.testing import fill_grads, live_params, rejects, takes_a_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # a (33, 16) matrix (one block of 16 per row), an odd 33-vector (a searched period)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> float:
    loss = torch.zeros(())
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(32, 16, generator=generator)
        y = torch.randn(32, 4, generator=generator)
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def _gefen(model: nn.Module, **options: object) -> Gefen:
    return Gefen(model.parameters(), lr=1e-2, momentum_codec="codebook4", **options)  # type: ignore[arg-type]


# -- the codec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("period", [1, 2, 7, 16])
def test_pack_and_unpack_are_inverse_with_the_low_nibble_first(period: int) -> None:
    index = torch.randint(0, 16, (5, period))
    packed = pack_codes(index)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, (period + 1) // 2)
    assert torch.equal(unpack_codes(packed, period), index)
    assert torch.equal(packed[:, 0] & 15, index[:, 0].to(torch.uint8))
    if period % 2:
        assert not bool((packed[:, -1] >> 4).any())  # the unused high nibble stays 0


@pytest.mark.parametrize("period", [3, 8])
def test_encode_and_decode_with_a_16_value_codebook(period: int) -> None:
    codebook = torch.linspace(-1.0, 1.0, 16)
    values = torch.randn(6, period)
    codes, scale = encode_blocks(values, codebook, period)
    assert codes.shape == (6, (period + 1) // 2)
    decoded = decode_blocks(codes, scale, codebook, period=period)
    expected = codebook[nearest_index(codebook, values / scale).long()] * scale
    assert torch.equal(decoded, expected)
    # the block maximum is stored exactly, and no value is further than half a gap
    assert torch.equal(decoded.abs().amax(dim=1), values.abs().amax(dim=1))
    assert bool(((decoded - values).abs() <= scale * (1.0 / 15) * 1.0001).all())


def test_decode_refuses_packed_codes_of_another_period() -> None:
    codebook = torch.linspace(-1.0, 1.0, 16)
    codes, scale = encode_blocks(torch.randn(2, 5), codebook, 5)
    with pytest.raises(ValueError, match="do not hold period 8"):
        decode_blocks(codes, scale, codebook, period=8)


# -- Gefen with codebook4 ------------------------------------------------------------------------


def test_gefen_keeps_half_a_byte_of_codes_per_element_and_learns_16_values() -> None:
    model = _net()
    optimizer = _gefen(model)
    _train(model, optimizer, range(2))
    codebook = optimizer.codebook
    assert codebook is not None
    assert codebook.numel() == 16
    assert float(codebook[0]) == -1.0
    assert float(codebook[-1]) == 1.0
    assert bool((codebook[1:] > codebook[:-1]).all())
    for param in model.parameters():
        entry = optimizer.state[param]
        codes, period = entry["momentum_codes"], entry["period"]
        assert codes.shape == (param.numel() // period, math.ceil(period / 2))
    model8 = _net()
    eight = Gefen(model8.parameters(), lr=1e-2)
    _train(model8, eight, range(2))
    codes4 = sum(optimizer.state[p]["momentum_codes"].numel() for p in model.parameters())
    codes8 = sum(eight.state[p]["momentum_codes"].numel() for p in model8.parameters())
    assert codes4 < 0.52 * codes8


def test_gefen_codebook4_trains_close_to_codebook8() -> None:
    losses = {}
    for codec in ("codebook8", "codebook4"):
        model = _net()
        optimizer = Gefen(model.parameters(), lr=1e-2, momentum_codec=codec)
        first = _train(model, optimizer, range(1))
        losses[codec] = (first, _train(model, optimizer, range(1, 60)))
    assert losses["codebook4"][1] < 0.8 * losses["codebook4"][0]
    assert losses["codebook4"][1] < 1.1 * losses["codebook8"][1]


def test_a_refresh_remaps_both_codes_of_every_byte() -> None:
    model = _net()
    optimizer = _gefen(model)
    _train(model, optimizer, range(3))
    old_codebook = optimizer.codebook
    assert old_codebook is not None
    old = {p: optimizer.state[p]["momentum_codes"].clone() for p in model.parameters()}
    fill_grads(live_params(optimizer), seed=11)
    for param in model.parameters():
        assert param.grad is not None
        param.grad.mul_(torch.linspace(0.1, 3.0, param.numel()).reshape(param.shape))
    assert optimizer.refresh_codebook()
    new_codebook = optimizer.codebook
    assert new_codebook is not None
    assert new_codebook.numel() == 16
    assert not torch.equal(new_codebook, old_codebook)
    table = nearest_index(new_codebook, old_codebook).long()
    for param in model.parameters():
        period = optimizer.state[param]["period"]
        expected = pack_codes(table[unpack_codes(old[param], period)])
        assert torch.equal(optimizer.state[param]["momentum_codes"], expected)


def test_a_state_dict_resumes_a_fresh_optimizer_bit_for_bit() -> None:
    model = _net()
    optimizer = _gefen(model)
    _train(model, optimizer, range(3))
    saved = copy.deepcopy(optimizer.state_dict())
    twin = _net()
    twin.load_state_dict(model.state_dict())
    target = _gefen(twin)
    target.load_state_dict(saved)
    _train(model, optimizer, range(3, 6))
    _train(twin, target, range(3, 6))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_full_state_dict_loads_through_torch_into_a_fresh_optimizer() -> None:
    """Format 2 keeps the 16-value codebook slot, and a searched period's packed codes sit
    flat in their (N, 1) slot, so torch's item-by-item load fits a fresh optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    model = _net()
    source = _gefen(model)
    _train(model, source, range(3))
    full = copy.deepcopy(get_optimizer_state_dict(model, source, options=options))
    assert full["state"]["0.bias"]["momentum_codes"].shape == (33, 1)  # the searched slot
    twin = _net()
    twin.load_state_dict(model.state_dict())
    target = _gefen(twin)
    set_optimizer_state_dict(twin, target, full, options=options)
    assert target.global_step == 3
    _train(model, source, range(3, 5))
    _train(twin, target, range(3, 5))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_contract_declares_the_q4_variants() -> None:
    model = _net()
    names = {v.name for v in _gefen(model).optimizer_contract().state_layout.parameter_variants}
    assert {"q4_block", "q4_block_local", "q4_factored"} <= names
    assert not any(name.startswith("q8") for name in names)


# -- rejections: named, nothing changed, still trains ---------------------------------------------


def test_codebook8_and_codebook4_groups_cannot_share_an_optimizer() -> None:
    model = _net()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="momentum_codec 'codebook8' cannot join a 'codebook4'"):
        Gefen(
            [{"params": params[:2]}, {"params": params[2:], "momentum_codec": "codebook8"}],
            momentum_codec="codebook4",
        )
    optimizer = Gefen([{"params": params[:2]}], lr=1e-2, momentum_codec="codebook4")
    _train(model, optimizer, range(1))
    group = {"params": params[2:], "momentum_codec": "codebook8"}
    rejects(optimizer, lambda: optimizer.add_param_group(group), ValueError, "cannot join")
    optimizer.add_param_group({"params": params[2:], "momentum_codec": "none"})  # fp32 may
    takes_a_step(optimizer)


def test_a_codec_changed_after_learning_is_refused_before_anything_changes() -> None:
    model = _net()
    optimizer = _gefen(model)
    _train(model, optimizer, range(2))
    optimizer.param_groups[0]["momentum_codec"] = "codebook8"
    fill_grads(live_params(optimizer), seed=5)
    rejects(optimizer, optimizer.step, ValueError, "needs a 256-value codebook")
    optimizer.param_groups[0]["momentum_codec"] = "codebook4"
    takes_a_step(optimizer)


def test_a_codebook8_checkpoint_is_refused_by_a_codebook4_optimizer() -> None:
    source_model = _net()
    source = Gefen(source_model.parameters(), lr=1e-2)
    _train(source_model, source, range(2))
    saved = source.state_dict()
    model = _net()
    optimizer = _gefen(model)
    _train(model, optimizer, range(2))
    rejects(optimizer, lambda: optimizer.load_state_dict(saved), ValueError, "momentum_codec")
    takes_a_step(optimizer)


@pytest.mark.parametrize(
    ("byte", "fragment"), [(16, "unused high nibble"), (20, "holds values past its 1 blocks")]
)
def test_damaged_packed_codes_are_refused_at_load(byte: int, fragment: str) -> None:
    """The 33-vector's searched period is one odd block: its 17 code bytes open an (N, 1)
    slot. A set high nibble in the last byte, or a value past the 17, is refused."""
    model = _net()
    optimizer = _gefen(model)
    _train(model, optimizer, range(2))
    saved = copy.deepcopy(optimizer.state_dict())
    assert optimizer.state[model[0].bias]["momentum_codes"].shape == (1, 17)
    slot = saved["state"][1]["momentum_codes"]
    assert slot.shape == (33, 1)
    slot[byte, 0] |= 0x30
    rejects(optimizer, lambda: optimizer.load_state_dict(saved), ValueError, fragment)
    takes_a_step(optimizer)


def _two_groups() -> tuple[Gefen, nn.Parameter]:
    generator = torch.Generator().manual_seed(5)
    first, second = (nn.Parameter(torch.randn(8, 16, generator=generator)) for _ in range(2))
    optimizer = Gefen([{"params": [first]}, {"params": [second]}], lr=1e-2, fused=False)
    first.grad = torch.randn(8, 16, generator=generator)
    optimizer.step()  # the first group holds codebook8 state, the second none yet
    return optimizer, first


def test_a_refresh_under_a_group_edited_to_the_other_codec_is_refused_with_nothing_changed() -> (
    None
):
    # The refresh ran no option check: it sized the codebook by the edited group (16 values),
    # remapped the first group's live codebook8 codes with the 4-bit table, and the next step
    # failed inside its commit and latched.
    optimizer, _ = _two_groups()
    optimizer.param_groups[1]["momentum_codec"] = "codebook4"
    rejects(
        optimizer,
        optimizer.refresh_codebook,
        ValueError,
        "param_groups[1]: Gefen: momentum_codec 'codebook4' cannot join a 'codebook8' group",
    )
    optimizer.param_groups[1]["momentum_codec"] = "codebook8"
    takes_a_step(optimizer)


def test_a_codec_undone_after_initialize_codebook_is_refused_before_the_step_writes() -> None:
    # The step's option check skipped groups whose options had not changed since they last
    # passed, though the codebook they must fit had: the step failed inside its commit and
    # latched.
    param = nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(6)))
    optimizer = Gefen([param], lr=1e-2, fused=False)
    optimizer.param_groups[0]["momentum_codec"] = "codebook4"  # no state yet: allowed
    fill_grads([param], 1)
    assert optimizer.initialize_codebook()
    assert optimizer.codebook is not None
    assert optimizer.codebook.numel() == 16
    optimizer.param_groups[0]["momentum_codec"] = "codebook8"
    rejects(
        optimizer,
        optimizer.step,
        ValueError,
        "momentum_codec 'codebook8' needs a 256-value codebook but the learned one holds 16",
    )
    assert not optimizer.latched
    optimizer.param_groups[0]["momentum_codec"] = "codebook4"
    takes_a_step(optimizer)


def test_a_manual_refresh_refuses_a_non_finite_gradient_by_name() -> None:
    # It learned a codebook counting the NaN elements as 0 and remapped every code, where the
    # step and initialize_codebook refuse the gradient under check_finite=True.
    optimizer, first = _two_groups()
    first.grad = torch.full_like(first, math.nan)
    rejects(
        optimizer,
        optimizer.refresh_codebook,
        RuntimeError,
        "parameter param_groups[0][0] has a non-finite gradient (NaN or Inf)",
    )
    takes_a_step(optimizer)


@pytest.mark.parametrize("call", ["initialize_codebook", "refresh_codebook"])
def test_learning_outside_a_step_refuses_a_gradient_past_float32_by_name(call: str) -> None:
    # It failed inside torch's bincount ("bincount only supports 1-d non-negative integral
    # inputs"), naming no parameter; the step refuses such a gradient by name.
    param = nn.Parameter(torch.randn(8, 16, dtype=torch.float64))
    optimizer = Gefen([param], lr=1e-2, fused=False)
    if call == "refresh_codebook":
        fill_grads([param], 2)
        optimizer.step()
    param.grad = torch.full_like(param, 1e300)
    rejects(
        optimizer,
        getattr(optimizer, call),
        RuntimeError,
        "parameter param_groups[0][0] has a finite gradient (|g| up to 1e+300) beyond float32",
    )
    takes_a_step(optimizer)
