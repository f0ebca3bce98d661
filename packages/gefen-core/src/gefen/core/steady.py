"""The steady-state step: what a step may skip because nothing it checks has changed.

A training loop calls ``step()`` thousands of times on the same parameters, groups and state
entries; only the gradient values, the counters and (under a schedule) the hyperparameter
values move. ``step_token`` captures in one pass everything the structural preflight (gradient
structure, entry match, kernel selection) and the step plan's updates depend on. When it equals
the token of the last step that passed those checks, the shell skips them and the optimizer
reuses its planned updates; what reads values runs every step (the option rules, each group's
scalars, finiteness, GradScaler's controls, the vote).

The token is written as plain loops on purpose: it runs every step, and a comprehension or a
helper call per parameter would cost more than the checks it replaces. It covers plain tensors
only (``None`` otherwise): DTensor parameters and an installed binding always take the full
path, whose failure scope and collectives the token does not describe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from gefen.core.checked import PLAIN_VALUE_TYPES, value_key
from gefen.core.state import counters_fit

__all__ = ["SteadyToken", "plain_parameters", "same_token", "step_token"]

_PLAIN = (Tensor, Parameter)

SteadyToken = tuple[tuple[Any, ...], list[Any], dict[str, Any]]
"""(the compared key, the objects whose identities it uses, kept alive so no id is reused, and
what was computed under it: the optimizer's plan, the idle learning's codebook). The derived
values live and die with the token, so a load or a layout change that drops it frees them too
(kept on the optimizer, a plan held the state a load had replaced until the next step)."""


def step_token(
    param_groups: list[dict[str, Any]], state: Mapping[Any, Any], defaults: Mapping[str, Any]
) -> SteadyToken | None:
    """The steady-state token of this step's inputs, or None (a DTensor or another tensor
    subclass is present: no fast path). Options compare by name and type (numbers and tensors)
    or as ``checked.value_key`` writes them (flags, names); entries by identity, their tensors by
    identity, shape, dtype, device and strides, their other values but the counters by type and
    value (the counters by presence, and their values by ``state.counters_fit``: an edited
    counter gets None, so the full checks name it)."""
    entries: dict[int, Any] = {}
    for param, entry in state.items():  # by id: a Tensor key would hash in Python every time
        entries[id(param)] = entry
    key: list[Any] = [defaults.get("momentum_codec"), defaults.get("fused")]
    key.append(defaults.get("deterministic"))
    held: list[Any] = []
    stepped: list[Mapping[str, Any]] = []  # the entries whose counters must fit
    for group in param_groups:
        params = group["params"]
        held.append(group)
        key.append((id(group), id(params), len(params)))
        for name, value in group.items():
            if name == "params" or name == "param_names":
                continue
            # Scalar hyperparameters (an LR schedule writes lr every step) are not structure:
            # their values are validated every step (``checked.revalidate_changed_groups``)
            # and the plan's scalars follow them; the token keeps their names and types.
            kind = type(value)
            if kind is float or kind is int or isinstance(value, Tensor):
                key.append((name, kind))
            elif kind is tuple or kind is list:
                key.append((name, kind, len(value)))
            elif kind in PLAIN_VALUE_TYPES:
                key.append((name, kind, value))
            else:
                key.append((name, value_key(value, held)))
        for param in params:
            grad = param.grad
            if type(param) not in _PLAIN or (grad is not None and type(grad) is not Tensor):
                return None
            held.append(param)
            # the strides too: a ``.data`` swapped for an expand()ed view keeps the shape
            strides = param.stride() if param.layout is torch.strided else param.layout
            key.append((id(param), param.dtype, param.shape, strides, param.device))
            key.append(None if grad is None else (grad.dtype, grad.shape, grad.device, grad.layout))
            entry = entries.get(id(param))
            key.append(None if entry is None else id(entry))
            if entry is None:
                continue
            held.append(entry)
            for name, value in entry.items():
                if isinstance(value, Tensor):
                    held.append(value)
                    # the strides too: an in-place t_() or set_() keeps the object and shape
                    layout = value.stride() if value.layout is torch.strided else value.layout
                    key.append((name, id(value), value.shape, value.dtype, value.device, layout))
                elif name == "step" or name == "v_step":
                    key.append(name)  # the commit advances the counters: their presence only
                elif type(value) in PLAIN_VALUE_TYPES:  # typed: a period of 8.0 is not 8
                    key.append((name, type(value), value))
                else:
                    key.append((name, value_key(value, held)))
            stepped.append(entry)
    if not counters_fit(*stepped):
        return None  # an edited counter: the full checks refuse it by name
    return tuple(key), held, {}


def same_token(a: SteadyToken | None, b: SteadyToken | None) -> bool:
    """Whether two tokens describe the same step inputs (None matches nothing)."""
    return a is not None and b is not None and a[0] == b[0]


def plain_parameters(param_groups: list[dict[str, Any]]) -> bool:
    """Whether every parameter is a plain tensor (no DTensor: the failure scope is empty)."""
    for group in param_groups:
        for param in group["params"]:
            if type(param) not in _PLAIN:
                return False
    return True
