"""What a step checks only when it changed (docs/core.md §11, "checks at the edges").

The shell re-validates a group's options, or re-matches a state entry against its parameter,
only when the token or signature computed here differs from the one that last passed. Both
are cheap to compute and compare identities (and versions, for tensors), never tensor values.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gefen.core.options import group_uses_codebook
from gefen.core.state import CodecKeys, counters_fit, entry_matches, is_initialized
from gefen.core.validation import check_matrix, local_tensor, parameter_label
from gefen.dist.torch_internals import tensor_version

if TYPE_CHECKING:
    from gefen.core.participant import ShellInterface

__all__ = [
    "PLAIN_VALUE_TYPES",
    "entry_signature",
    "match_changed_entries",
    "options_token",
    "options_word",
    "revalidate_changed_groups",
    "value_key",
]


PLAIN_VALUE_TYPES = frozenset({type(None), bool, int, float, str})
"""Types compared by value (their ``==`` is plain) and written by their repr, which is the same
in every process and tells them apart (``1``, ``1.0``, ``True``, ``'1'``)."""


def options_token(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies a group's option values (``value_key``): a tensor by its identity and
    version (an LR scheduler's ``fill_`` bumps it), anything else as ``value_key`` writes it."""
    token: list[Any] = []
    held: list[Any] = []
    for name, value in group.items():  # a loop, not a generator: this runs every step
        if name == "params" or name == "param_names":
            continue
        kind = type(value)
        if kind in PLAIN_VALUE_TYPES:
            token.append((name, kind, value))
        elif isinstance(value, Tensor):
            token.append((name, kind, id(value), tensor_version(value)))
        else:
            token.append((name, value_key(value, held)))
    if held:  # alive while the token is, so no id in it is reused meanwhile
        token.append(_Held(tuple(held)))
    return tuple(token)


def value_key(value: Any, held: list[Any]) -> tuple[Any, ...]:
    """How the step's caches compare a value: a plain value (None, bool, int, float, str) by
    its type and value, a tuple or list item by item (a copy: ``group["betas"][1] = nan``
    edits the list itself), a tensor by identity and version, any other object by its type
    and identity, since its ``==`` may be element-wise (an array's is). What is compared by
    identity is appended to ``held``, which the caller keeps alive with the key."""
    kind = type(value)
    if kind in PLAIN_VALUE_TYPES:
        return (kind, value)
    if kind is tuple or kind is list:
        items: list[tuple[Any, ...]] = []
        for item in value:  # a loop: betas take this path at every step
            plain = type(item) in PLAIN_VALUE_TYPES
            items.append((type(item), item) if plain else value_key(item, held))
        return (kind, tuple(items))
    held.append(value)
    if isinstance(value, Tensor):
        return (kind, id(value), tensor_version(value))
    return (kind, id(value))


_READ_TENSOR_OPTIONS_UP_TO = 16
"""A CPU tensor option (a tensor lr) is compared by value up to this many elements."""


def _option_text(value: Any) -> str:
    """A value as every process writes it alike: a plain value by its repr, sequences item by
    item, a tensor by dtype and shape and, on the CPU, its values (an accelerator tensor's
    would cost a device synchronization: docs/dist.md §5), any other object by its type only
    (its repr may hold a per-process address)."""
    if type(value) in PLAIN_VALUE_TYPES:
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = ",".join(_option_text(item) for item in value)
        return f"({items})" if isinstance(value, tuple) else f"[{items}]"
    if isinstance(value, Tensor):
        text = f"tensor:{value.dtype}:{tuple(value.shape)}"
        if value.device.type == "cpu" and value.numel() <= _READ_TENSOR_OPTIONS_UP_TO:
            text += f":{value.detach().reshape(-1).tolist()!r}"  # an LR scheduler's fill_
        return text
    if isinstance(value, numbers.Real):  # a NumPy scalar: its value, as the step reads it
        return f"{type(value).__name__}:{float(value)!r}"
    return f"object:{type(value).__module__}.{type(value).__qualname__}"


def options_word(groups: Iterable[Mapping[Any, Any]], *, empty_groups: bool = False) -> int:
    """A 56-bit digest of the options each parameter is stepped with, in parameter order (keys
    sorted, ``params`` and ``param_names`` left out): the step vote agrees on it, so an option
    edited on one process-group member alone fails every member before anything runs
    (docs/dist.md §5). Adjacent groups with equal options count as one run, written with how
    many parameters it steps: how the parameters are split into groups of equal options is not
    compared, but a parameter moved into a group with other options on one member is. The last
    run's count is left out: it is the total less the others, and the total is compared by the
    presence word and each optimizer's own checks, whose messages name it.

    ``empty_groups``: count a group with no parameters too, and leave the counts out. After
    ``post_sharding`` every member keeps every group but holds only its own shards (a
    whole-parameter owner's group is empty elsewhere), so the binding form's header compares
    every group's options (docs/dist.md §9.2); the binding's presence pattern covers the rest."""
    runs: list[tuple[str, int]] = []
    for group in groups:
        count = 0 if empty_groups else len(group.get("params") or ())
        if not empty_groups and not count:
            continue  # an empty group steps nothing
        text = ";".join(
            f"{key!s}={_option_text(value)}"
            for key, value in sorted(group.items(), key=lambda item: str(item[0]))
            if key != "params" and key != "param_names"
        )
        if runs and runs[-1][0] == text:
            runs[-1] = (text, runs[-1][1] + count)
        else:
            runs.append((text, count))
    written = [f"{text}#{count}" for text, count in runs[:-1]]
    written.extend(text for text, _ in runs[-1:])  # the last run's count is the total's
    digest = hashlib.blake2b("|".join(written).encode(), digest_size=7)
    return int.from_bytes(digest.digest(), "big")


class _Held:
    """Objects kept alive by a signature; always equal, so they never affect comparison."""

    __slots__ = ("objects",)

    def __init__(self, objects: tuple[Any, ...]) -> None:
        self.objects = objects

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held)

    __hash__ = None  # type: ignore[assignment]


def entry_signature(
    group: Mapping[str, Any],
    param: Tensor,
    entry: Mapping[str, Any],
    layout_options: tuple[str, ...],
) -> tuple[Any, ...]:
    """What an entry's structural match depends on: the objects involved (by identity), the
    shapes and the group options that lay the state out. The objects themselves ride along
    (last item) so no id can be reused meanwhile; comparison uses the identities only."""
    local = local_tensor(param)
    values: list[tuple[Any, ...]] = []
    held: list[Any] = [param, group, entry, local]
    for key, value in entry.items():  # one pass: this runs for every parameter every step
        if isinstance(value, Tensor):
            held.append(value)
            # the strides too: an in-place t_() or set_() keeps the object and its shape
            layout = value.stride() if value.layout is torch.strided else value.layout
            values.append((key, id(value), value.shape, value.dtype, layout))
        elif key != "step" and key != "v_step":  # typed: a period of 8.0 is not 8
            values.append((key, value_key(value, held)))
        else:  # the commit advances the counters: their presence here, their values below
            values.append((key,))
    laid_out_by = tuple([group.get(name) for name in layout_options])
    ids = (id(param), id(group), id(entry), id(local))
    identity = (*ids, local.shape, local.dtype, param.dim(), laid_out_by)  # dtype: a cast
    return (identity, tuple(values), _Held(tuple(held)))


def match_changed_entries(
    optimizer: ShellInterface, previous: Mapping[int, tuple[Any, ...]]
) -> dict[int, tuple[Any, ...]]:
    """The state match of §7.2 for every entry whose signature differs from ``previous`` (by
    parameter id); raises ``RuntimeError`` naming the first that no longer fits its parameter.
    Returns the signatures that matched, for the next step."""
    matched: dict[int, tuple[Any, ...]] = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for position, param in enumerate(group["params"]):
            if optimizer.REQUIRE_2D and param.dim() != 2:  # a save's check (a step's ran already)
                label = parameter_label(group, group_index, position)
                check_matrix(label, param, optimizer.OWNER_NAME, when="save")
            entry = optimizer.state.get(param)  # a parameter replaced in a group has none yet
            if entry is None:
                continue
            signature = entry_signature(group, param, entry, optimizer.LAYOUT_OPTIONS)
            before = previous.get(id(param))
            if entry.get("period", 0) == 0 and not is_initialized(entry):
                matched[id(param)] = signature  # the shape its first update lays the state out for
                continue
            if before != signature or not counters_fit(entry):
                # the codec first: an edited codec also changes the shapes the spec expects
                reason = _codec_mismatch(entry, group, optimizer.CODEC_KEYS)
                if reason is None:
                    reason = entry_matches(entry, optimizer.entry_spec(group, param))
                if reason is None:  # what the entry's own tensors cannot tell (the block family)
                    reason = _reshaped(before, signature)
                if reason is None:  # nor the mode it was laid out for (GefenMuon's sharded_mode)
                    reason = _relaid(before, signature, optimizer.LAYOUT_OPTIONS)
                if reason is not None:
                    label = parameter_label(group, group_index, position)
                    raise RuntimeError(
                        f"parameter {label}: state does not match parameter ({reason})"
                    )
            matched[id(param)] = signature
    return matched


def _reshaped(before: tuple[Any, ...] | None, now: tuple[Any, ...]) -> str | None:
    """Why a parameter given another shape since its entry was last checked (``p.data = x``)
    no longer fits it, or None: the same entry's blocks (or rows and columns) are the old
    shape's, and a block family of the same element count would step on them unnoticed. A
    pristine entry's record holds the shape its first update lays it out for."""
    if before is None or before[0][2] != now[0][2]:  # another entry (a load): nothing to compare
        return None
    old_shape, new_shape = before[0][4], now[0][4]
    if old_shape == new_shape:
        return None
    return f"the parameter's shape changed from {tuple(old_shape)} to {tuple(new_shape)}"


def _relaid(
    before: tuple[Any, ...] | None, now: tuple[Any, ...], names: tuple[str, ...]
) -> str | None:
    """Why an entry laid out under other group options (``LAYOUT_OPTIONS``) no longer fits,
    or None: GefenMuon's distributed mode keeps a matrix's state on its owner alone, its exact
    mode on every rank, so an edited mode would step from missing or stale momentum."""
    if before is None or before[0][2] != now[0][2]:  # another entry (a load): nothing to compare
        return None
    for name, old, new in zip(names, before[0][7], now[0][7], strict=True):
        if old != new:
            return (
                f"the group's {name} changed from {old!r} to {new!r}, but it cannot change "
                "while the state exists; a load lays the state out anew under the live option"
            )
    return None


def _codec_mismatch(
    entry: Mapping[str, Any], group: Mapping[str, Any], keys: CodecKeys
) -> str | None:
    """Why an initialized entry's momentum is not the group's codec, or None. The codec of a
    group is fixed once its state exists: the step would misread the other codec's tensors."""
    if not is_initialized(entry) or (keys.codes in entry) == group_uses_codebook(group):
        return None
    held = "codebook codes" if keys.codes in entry else "an fp32 momentum"
    return (
        f"the group's momentum_codec is {group.get('momentum_codec')!r} but the state holds "
        f"{held}; a group's codec cannot change once its state exists (load a checkpoint "
        "saved with this codec, or give the parameter a fresh state)"
    )


def revalidate_changed_groups(
    optimizer: ShellInterface, previous: Mapping[int, tuple[Any, tuple[Any, ...]]]
) -> dict[int, tuple[Any, tuple[Any, ...]]]:
    """§2.2 at the edges: ``validate_group`` for each group whose options token differs from
    the one that last passed (by group id); returns the tokens that passed."""
    passed: dict[int, tuple[Any, tuple[Any, ...]]] = {}
    for index, group in enumerate(optimizer.param_groups):
        token = options_token(group)
        seen = previous.get(id(group))
        if seen is None or seen[0] is not group or seen[1] != token:
            try:
                optimizer.validate_group(group)
            except (ValueError, TypeError, RuntimeError) as error:  # which group, as a load says
                if error.args and isinstance(error.args[0], str):
                    error.args = (f"param_groups[{index}]: {error.args[0]}", *error.args[1:])
                raise
        passed[id(group)] = (group, token)
    return passed
