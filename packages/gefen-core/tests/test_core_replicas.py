"""The replica words of a load (``gefen.core.replicas``): what the load vote compares so that one
stale file on one rank fails every rank (the world-2 tests live with GefenMuon and the hybrid)."""

from __future__ import annotations

import torch

from gefen.core.replicas import NO_REPLICA, replica_words


def _entry(seed: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (2, 8), dtype=torch.uint8, generator=generator)
    return {"period": 8, "step": 3, "momentum_codes": codes, "momentum_scale": torch.ones(2, 1)}


def test_equal_replicas_give_equal_words_and_any_difference_changes_them() -> None:
    codebook = torch.linspace(-1, 1, 256)
    base = replica_words(3, codebook, [_entry(0), _entry(1)])
    assert base == replica_words(3, codebook.clone(), [_entry(0), _entry(1)])
    assert base[1] == 2
    assert 0 <= base[0] < 2**56
    variants = [
        replica_words(4, codebook, [_entry(0), _entry(1)]),  # another global step
        replica_words(3, codebook * 0.5, [_entry(0), _entry(1)]),  # another codebook
        replica_words(3, None, [_entry(0), _entry(1)]),
        replica_words(3, codebook, [_entry(0), _entry(2)]),  # other codes
        replica_words(3, codebook, [_entry(1), _entry(0)]),  # other order
        replica_words(3, codebook, [_entry(0)]),
        replica_words(3, codebook, [_entry(0), None]),  # a pristine position
    ]
    assert len({base, *variants}) == len(variants) + 1
    shifted = _entry(1)
    shifted["step"] = 4
    assert replica_words(3, codebook, [_entry(0), shifted]) != base
    reshaped = _entry(1)
    reshaped["momentum_codes"] = reshaped["momentum_codes"].reshape(4, 4)  # type: ignore[union-attr]
    assert replica_words(3, codebook, [_entry(0), reshaped]) != base


def test_gefen_state_is_rank_local_so_its_load_has_no_replica_words() -> None:
    from gefen.core import Gefen

    param = torch.nn.Parameter(torch.randn(4, 4))
    gefen = Gefen([param], lr=0.1)
    assert gefen.replicated_positions(gefen.param_groups) is None
    param.grad = torch.randn(4, 4)
    gefen.step()
    prepared = gefen.prepare_load_state_dict(gefen.state_dict())
    assert prepared.replica_words == NO_REPLICA
