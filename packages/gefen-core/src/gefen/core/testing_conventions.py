"""The ``torch.optim`` conventions a Gefen optimizer keeps, as checks over an optimizer factory.

Each check builds optimizers through a ``Factory`` and raises ``AssertionError`` where the
convention breaks. The checks are modelled on PyTorch's generic optimizer tests
(``TestOptimRenewed`` over ``OptimizerInfo`` entries) and pass for ``torch.optim.AdamW`` itself
(``TORCH_ADAMW``), so what they assert is torch's behaviour, not ours. A package registers its
optimizer by one factory and runs every check in ``CHECKS`` (see ``test_core_torch_conventions``);
a new optimizer gets the whole suite the same way. Each package README's "Differences from
``torch.optim``" section lists what is deliberately different. The module imports neither
pytest nor ``torch.distributed``.
"""

from __future__ import annotations

import copy
import functools
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

__all__ = ["CHECKS", "TORCH_ADAMW", "Factory"]


@dataclass(frozen=True)
class Factory:
    """How to build one optimizer: ``build(params, **options)``; ``shape`` is the shape of the
    parameters it optimizes (GefenMuon: matrices only). ``group_options`` gives, per option a
    group may override, a valid value other than the default; ``optimizer_wide`` the same for
    the options a group must not change."""

    name: str
    build: Callable[..., torch.optim.Optimizer]
    shape: tuple[int, ...] = (4, 8)
    group_options: Mapping[str, Any] = field(default_factory=dict)
    optimizer_wide: Mapping[str, Any] = field(default_factory=dict)

    def params(self, count: int = 2, seed: int = 0) -> list[torch.nn.Parameter]:
        generator = torch.Generator().manual_seed(seed)
        return [
            torch.nn.Parameter(torch.randn(self.shape, generator=generator)) for _ in range(count)
        ]


TORCH_ADAMW = Factory(
    "torch.optim.AdamW",
    lambda params, **kw: torch.optim.AdamW(params, **kw),
    group_options={
        "lr": 0.02,
        "betas": (0.8, 0.95),
        "eps": 1e-6,
        "weight_decay": 0.05,
        "amsgrad": True,
        "maximize": True,
        "foreach": False,
    },
)


def _give_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(1000 + seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    for seed in range(steps):
        _give_grads(params, seed)
        optimizer.step()


def _state(optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
    """``optimizer.state`` as what it is at run time: torch types its keys as tensors, but any
    key may be stored (and torch's ``state_dict`` keeps it)."""
    return cast(dict[Any, Any], optimizer.state)


def _raises(kind: type[Exception], pattern: str, action: Callable[[], Any]) -> None:
    caught: Exception | None = None
    try:
        action()
    except kind as error:
        caught = error
    if caught is None:
        raise AssertionError(f"expected {kind.__name__} matching {pattern!r}; nothing was raised")
    if not re.search(pattern, str(caught)):
        raise AssertionError(f"{kind.__name__} {str(caught)!r} does not match {pattern!r}")


def tensor_lr_must_be_one_element(factory: Factory) -> None:
    """A 2-element tensor ``lr`` is refused with torch's message."""
    params = factory.params()
    _raises(
        ValueError,
        "Tensor lr must be 1-element",
        lambda: factory.build(params, lr=torch.tensor([0.01, 0.02])),
    )


def non_parameter_state_round_trips(factory: Factory) -> None:
    """``state_dict()`` keeps ``optimizer.state`` entries under keys that are not parameters
    (a pre-hook may add one, a post-hook reads it back), and a load restores them as they are."""
    params = factory.params()
    optimizer = factory.build(params, lr=0.01)
    _train(optimizer, params, 2)

    def add_entry(opt: torch.optim.Optimizer) -> None:
        _state(opt)["schedule_note"] = {"phase": "warmup", "seen": 2}

    seen: list[Any] = []

    def read_entry(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        seen.append(state_dict["state"].get("schedule_note"))

    optimizer.register_state_dict_pre_hook(add_entry)
    optimizer.register_state_dict_post_hook(read_entry)
    saved = optimizer.state_dict()
    expected = {"phase": "warmup", "seen": 2}
    assert saved["state"]["schedule_note"] == expected, sorted(map(str, saved["state"]))
    assert seen == [expected]
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = factory.build(twin_params, lr=0.01)
    twin.load_state_dict(copy.deepcopy(saved))
    assert _state(twin)["schedule_note"] == expected
    _give_grads(params, 5)
    _give_grads(twin_params, 5)
    optimizer.step()
    twin.step()
    for mine, theirs in zip(params, twin_params, strict=True):
        assert torch.equal(mine, theirs), "the loaded twin steps differently"
    assert twin.state_dict()["state"]["schedule_note"] == expected


def duplicate_parameter_in_a_group_warns(factory: Factory) -> None:
    """A parameter listed twice in one group: torch's warning, and the optimizer is built."""
    first, second = factory.params()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = factory.build([first, second, first], lr=0.01)
    messages = [str(warning.message) for warning in caught]
    assert any("duplicate parameters" in message for message in messages), messages
    assert [p is first for p in optimizer.param_groups[0]["params"]] == [True, False, True]


def duplicates_share_one_index_in_the_state_dict(factory: Factory) -> None:
    """With one parameter listed twice, ``state_dict()`` numbers both places by the index torch
    gives it and saves its state once; the dict loads back into the same layout."""
    first, second = factory.params()
    optimizer = factory.build([first, second], lr=0.01)
    optimizer.param_groups[0]["params"].append(first)  # edited in place, as users do
    _train(optimizer, [first, second], 1)
    saved = optimizer.state_dict()
    reference = torch.optim.AdamW([first, second], lr=0.01)
    reference.param_groups[0]["params"].append(first)
    assert saved["param_groups"][0]["params"] == reference.state_dict()["param_groups"][0]["params"]
    ids = saved["param_groups"][0]["params"]
    state_ids = sorted(key for key in saved["state"] if isinstance(key, int))
    assert state_ids == sorted(set(ids)), (ids, state_ids)
    twin_first, twin_second = (torch.nn.Parameter(p.detach().clone()) for p in (first, second))
    twin = factory.build([twin_first, twin_second], lr=0.01)
    twin.param_groups[0]["params"].append(twin_first)
    twin.load_state_dict(copy.deepcopy(saved))
    for mine, theirs in ((first, twin_first), (second, twin_second)):
        mine.grad = torch.ones_like(mine)
        theirs.grad = torch.ones_like(theirs)
    optimizer.step()
    twin.step()
    assert torch.equal(first, twin_first)
    assert torch.equal(second, twin_second)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return tuple(a) == tuple(b)
    return type(a) is type(b) and bool(a == b)


def every_option_can_be_set_per_group(factory: Factory) -> None:
    """Each option a group may override keeps the group's value beside a group with the
    default (at construction and through ``add_param_group``), trains, and survives a
    ``state_dict`` round trip; an optimizer-wide option in a group is refused, naming it."""
    for name, value in factory.group_options.items():
        first, second = factory.params()
        optimizer = factory.build([{"params": [first]}, {"params": [second], name: value}], lr=0.01)
        default = optimizer.defaults[name]
        assert not _same_value(value, default), f"{name}: {value!r} is the default"
        assert _same_value(optimizer.param_groups[1][name], value), name
        assert _same_value(optimizer.param_groups[0][name], default), name
        _train(optimizer, [first, second], 2)
        assert all(bool(p.isfinite().all()) for p in (first, second)), name
        twin_first, twin_second = (torch.nn.Parameter(p.detach().clone()) for p in (first, second))
        twin = factory.build([twin_first], lr=0.01)
        twin.add_param_group({"params": [twin_second], name: value})
        assert _same_value(twin.param_groups[1][name], value), name
        twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        assert _same_value(twin.param_groups[1][name], value), name
        _train(optimizer, [first, second], 1)
        _train(twin, [twin_first, twin_second], 1)
        assert torch.equal(second, twin_second), f"{name}: the loaded twin steps differently"
    for name, value in factory.optimizer_wide.items():
        groups: list[dict[str, Any]] = [{"params": [param]} for param in factory.params()]
        groups[1][name] = value
        _raises(
            ValueError, f"optimizer-wide option '{name}'", functools.partial(factory.build, groups)
        )


CHECKS: dict[str, Callable[[Factory], None]] = {
    "every_option_can_be_set_per_group": every_option_can_be_set_per_group,
    "tensor_lr_must_be_one_element": tensor_lr_must_be_one_element,
    "non_parameter_state_round_trips": non_parameter_state_round_trips,
    "duplicate_parameter_in_a_group_warns": duplicate_parameter_in_a_group_warns,
    "duplicates_share_one_index_in_the_state_dict": duplicates_share_one_index_in_the_state_dict,
}
"""Every convention check, by name (each takes a ``Factory``)."""
