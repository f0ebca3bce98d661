"""``options_word``: the digest of the group options the step vote agrees on (docs/dist.md §5)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gefen.core.checked import options_word


def _groups(**edits: Any) -> list[dict[str, Any]]:
    group: dict[str, Any] = {"params": [torch.zeros(2)], "lr": 0.01, "betas": (0.9, 0.99)}
    group.update(edits)
    return [group, {"params": [torch.zeros(1)], "lr": 0.02, "fused": None}]


def test_equal_options_give_equal_words_and_any_edit_changes_it() -> None:
    word = options_word(_groups())
    assert 0 <= word < 2**56  # negation and MAX stay inside int64
    assert options_word(_groups()) == word
    assert options_word(_groups(lr=0.011)) != word
    assert options_word(_groups(betas=(0.9, 0.98))) != word
    assert options_word(_groups(betas=[0.9, 0.99])) != word  # the type is part of the value
    assert options_word(_groups(lr=1)) != options_word(_groups(lr=1.0))
    assert options_word(_groups(extra="x")) != word
    assert options_word(list(reversed(_groups()))) != word  # group order matters


def test_only_what_each_parameter_is_stepped_with_counts_not_the_grouping() -> None:
    a, b = torch.zeros(2), torch.zeros(3)
    one = [{"params": [a, b], "lr": 0.01}]
    split = [{"params": [a], "lr": 0.01}, {"params": [b], "lr": 0.01}, {"params": [], "lr": 9.0}]
    assert options_word(one) == options_word(split)
    # the total is the presence word's (and each optimizer's own checks') to compare, with a
    # message naming it, so the last run's count is left out ...
    assert options_word(one) == options_word([{"params": [a], "lr": 0.01}])
    # ... but how many parameters each other run steps is compared: a parameter moved on one
    # member into a group with other options would be stepped with them there alone
    c = torch.zeros(4)
    two_and_one = [{"params": [a, b], "lr": 0.01}, {"params": [c], "lr": 0.1}]
    one_and_two = [{"params": [a], "lr": 0.01}, {"params": [b, c], "lr": 0.1}]
    assert options_word(two_and_one) != options_word(one_and_two)
    assert options_word(split) != options_word(
        [{"params": [a], "lr": 0.01}, {"params": [b], "lr": 0.02}]
    )


def test_the_binding_form_counts_empty_groups_too() -> None:
    # After post_sharding a whole-parameter owner's group is empty on every other member: the
    # binding form's header compares every group's options, held parameters or not.
    owner = [{"params": [torch.zeros(2)], "lr": 0.01}, {"params": [], "lr": 0.02}]
    other = [{"params": [], "lr": 0.01}, {"params": [torch.zeros(3)], "lr": 0.02}]
    assert options_word(owner, empty_groups=True) == options_word(other, empty_groups=True)
    assert options_word(owner) != options_word(other)
    edited = [{"params": [], "lr": 0.01}, {"params": [torch.zeros(3)], "lr": 0.03}]
    assert options_word(owner, empty_groups=True) != options_word(edited, empty_groups=True)


def test_a_cpu_tensor_option_is_compared_by_value() -> None:
    # An LR scheduler fills a tensor lr in place: one member's fill_ alone must change the word.
    word = options_word(_groups(lr=torch.tensor(0.01)))
    assert options_word(_groups(lr=torch.tensor(0.01))) == word
    assert options_word(_groups(lr=torch.tensor(0.02))) != word
    assert options_word(_groups(lr=torch.tensor(0.01, dtype=torch.float64))) != word


def test_what_differs_per_process_by_construction_is_left_out() -> None:
    word = options_word(_groups())
    assert options_word(_groups(params=[torch.ones(3)], param_names=["a"])) == word
    # key order inside a group is not an option
    reordered = [dict(reversed(list(group.items()))) for group in _groups()]
    assert options_word(reordered) == word
    # an object is written by its type only: its repr may hold a per-process address
    assert options_word(_groups(hook=lambda: 1)) == options_word(_groups(hook=lambda: 2))

    # a tensor off the CPU by dtype and shape: reading its value would synchronize a device
    # (the meta device stands in for an accelerator: it holds no values at all)
    def meta(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(value, dtype=dtype, device="meta")

    assert options_word(_groups(lr=meta(0.01))) == options_word(_groups(lr=meta(0.5)))
    assert options_word(_groups(lr=meta(0.01))) != options_word(
        _groups(lr=meta(0.01, torch.float64))
    )


def test_a_numpy_scalar_is_written_by_its_value() -> None:
    assert options_word(_groups(lr=np.float32(0.5))) == options_word(_groups(lr=np.float32(0.5)))
    assert options_word(_groups(lr=np.float32(0.5))) != options_word(_groups(lr=np.float32(0.25)))
