"""Registering a parameter group as torch does (``add_param_group``'s rules, torch's messages):
normalising the group and checking its membership, before the shell publishes anything."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.core.options import check_optimizer_wide
from gefen.core.validation import (
    OVERLAP_RULE,
    SUPPORTED_DTYPES,
    local_tensor,
    overlaps_itself,
    parameter_label,
)

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = [
    "check_membership",
    "check_param_tensor",
    "check_params_argument",
    "checked_new_group",
    "normalised_group",
]

_DUPLICATE = "some parameters appear in more than one parameter group"
_REPEATED = (  # torch's own words (torch.optim.Optimizer.add_param_group)
    "optimizer contains a parameter group with duplicate parameters; in future, this will cause "
    "an error; see github.com/pytorch/pytorch/issues/40967 for more information"
)


def check_params_argument(params: object) -> None:
    """torch's first rule: ``params`` is an iterable of tensors or dicts, never one tensor or
    a set (whose order differs between runs)."""
    if isinstance(params, (Tensor, set)):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or "
            f"dicts, but got {torch.typename(params)}"
        )


def check_param_tensor(param: object) -> Tensor:
    """``param`` itself if torch would register it (a leaf real floating tensor of a supported
    dtype); TypeError/ValueError otherwise."""
    if not isinstance(param, Tensor):
        raise TypeError(
            f"optimizer can only optimize Tensors, but one of the params is {type(param)}"
        )
    if not param.is_leaf:
        raise ValueError("can't optimize a non-leaf Tensor")
    if param.is_complex():
        raise ValueError(f"complex parameters are not supported (got {param.dtype})")
    if param.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"parameters must be float16, bfloat16, float32 or float64, got {param.dtype}"
        )
    if overlaps_itself(local_tensor(param)):
        raise ValueError(OVERLAP_RULE)
    return param


def normalised_group(
    param_group: Mapping[str, Any], defaults: Mapping[str, Any], index: int = 0
) -> dict[str, Any]:
    """A copy of ``param_group`` as torch registers it: params listed (names split off), each
    a leaf floating tensor, defaults filled in, betas a tuple; raises as torch does, naming the
    parameter (its name, else ``param_groups[index][i]``)."""
    params = param_group["params"]
    if isinstance(params, Tensor):
        listed: list[Any] = [params]
    elif isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs. Please use a list instead."
        )
    else:
        listed = list(params)
    names = [item[0] for item in listed if isinstance(item, tuple)]
    tensors = [item[1] if isinstance(item, tuple) else item for item in listed]
    candidate = dict(param_group)
    # named by its pairs, else by the group's own "param_names" (torch's add_param_group form)
    labelled = {"param_names": names} if len(names) == len(tensors) else param_group
    for position, param in enumerate(tensors):
        try:
            check_param_tensor(param)
        except (TypeError, ValueError) as error:
            label = parameter_label(labelled, index, position)
            raise type(error)(f"parameter {label}: {error}") from None
    candidate["params"] = tensors
    if names:
        if len(names) != len(tensors):
            raise ValueError(
                "all optimizer params should be with/without names. Some param names are missing"
            )
        candidate["param_names"] = names
    for name, default in defaults.items():
        candidate.setdefault(name, default)
    if isinstance(candidate.get("betas"), list):
        candidate["betas"] = tuple(candidate["betas"])
    return candidate


def check_membership(candidate: Mapping[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """A new group shares no parameter with the registered groups, and is named iff they are
    (torch's rules and messages); a parameter repeated inside the group is torch's warning."""
    params = candidate["params"]
    if len({id(p) for p in params}) != len(params):
        warnings.warn(_REPEATED, stacklevel=5)
    registered = {id(p) for group in param_groups for p in group["params"]}
    if any(id(p) in registered for p in params):
        raise ValueError(_DUPLICATE)
    for group in param_groups:
        if ("param_names" in group) != ("param_names" in candidate):
            kind = "with names" if "param_names" in candidate else "without names"
            raise ValueError(
                "all optimizer param groups should be with/without names. "
                f"cannot add param group {kind} to the optimizer"
            )


def checked_new_group(
    optimizer: ShellInterface, param_group: object, *, finalized: bool
) -> dict[str, Any]:
    """``add_param_group``'s shared checks, no mutation: a dict, not after ``post_sharding``,
    no optimizer-wide option, then the normalised group, whose parameters are new."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
    if finalized:
        raise RuntimeError(
            f"{optimizer.OWNER_NAME} is finalized by post_sharding: add_param_group is refused"
        )
    check_optimizer_wide(param_group, optimizer.defaults, optimizer.OPTIMIZER_WIDE)
    candidate = normalised_group(param_group, optimizer.defaults, len(optimizer.param_groups))
    check_membership(candidate, optimizer.param_groups)
    return candidate
