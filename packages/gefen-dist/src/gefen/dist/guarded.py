"""The guarded collective operation: capture, voted local phases, the operation header and
the agreement helpers (docs/dist.md §8).

The rule it enforces: between capture and the end of an operation, anything that can raise on
some ranks and not others runs inside ``local``, so the failure is voted before any member
enters a collective its peers would skip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import torch

from gefen.dist.binding import ProcessGroupBinding
from gefen.dist.errors import GroupAgreementError
from gefen.dist.runtime import collective
from gefen.dist.scope import Channel
from gefen.dist.vote import AGREEMENT_WIDTH, any_true_over, synchronize_step_error

__all__ = [
    "HEADER_MAGIC",
    "HEADER_PAYLOAD_WORDS",
    "HEADER_VERSION",
    "HEADER_WORDS",
    "GuardedOperation",
]

P = ParamSpec("P")
T = TypeVar("T")

HEADER_WORDS = 24
HEADER_PAYLOAD_WORDS = 21
HEADER_MAGIC = int.from_bytes(b"GFNHDR01", "big", signed=True)
HEADER_VERSION = 3  # 2: words 21-22 carry the gradient presence; 3: a load's word 23 its options
_RESERVED = "reserved"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int64_words(words: Sequence[int], what: str) -> list[int]:
    checked: list[int] = []
    for index, word in enumerate(words):
        if type(word) is not int:
            raise TypeError(f"{what}[{index}] must be an int, got {type(word).__name__}")
        if not _INT64_MIN <= word <= _INT64_MAX:
            raise ValueError(f"{what}[{index}] = {word} does not fit a signed int64")
        checked.append(word)
    return checked


def _checked_scope(scope: Sequence[Channel]) -> tuple[Channel, ...]:
    channels = tuple(scope)
    for index, channel in enumerate(channels):
        if not isinstance(channel, Channel):
            raise TypeError(f"scope[{index}] must be a Channel, got {type(channel).__name__}")
    return channels


@collective
def _all_gather_words(channel: Channel, words: list[int]) -> tuple[tuple[int, ...], ...]:
    import torch.distributed as dist

    local = torch.tensor(words, dtype=torch.int64, device=channel.device)
    size = dist.get_world_size(channel.process_group)
    rows = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(rows, local, group=channel.process_group)
    return tuple(tuple(int(word) for word in row.tolist()) for row in rows)


_NOT_INT64 = (
    "sum_int64 sums integers: the tensor holds a complex value, a fraction, a NaN, an infinity "
    "or a value outside int64's range"
)


def _exact_int64(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A copy of ``tensor`` as int64, and whether converting it would change a value (then
    zeros): ``sum_int64`` is exact, so a fraction, a NaN or a value past int64 is no input."""
    values = tensor.detach()
    if values.is_complex():  # refused through the all-reduce too: it is one member's data
        return torch.zeros(values.shape, dtype=torch.int64, device=values.device), True
    if values.is_floating_point():
        held = values.to(torch.float64)
        fits = (held >= -(2.0**63)) & (held < 2.0**63) & (held == held.round())
        if not bool(fits.all()):
            return torch.zeros(values.shape, dtype=torch.int64, device=values.device), True
    elif values.dtype == torch.uint64 and bool((values.view(torch.int64) < 0).any()):
        # 2**63 and above: the conversion wrapped them to negative counts (torch compares no
        # uint64, so the same bits read as int64 tell them)
        return torch.zeros(values.shape, dtype=torch.int64, device=values.device), True
    return values.to(dtype=torch.int64, copy=True), False


@collective
def _all_reduce_sum_int64(channel: Channel, tensor: torch.Tensor) -> torch.Tensor:
    """The sum, its refusal counted in the same all-reduce: a value one member cannot sum
    exactly fails every member alike (it depends on data, not on the caller's protocol)."""
    import torch.distributed as dist

    values, refused = _exact_int64(tensor)
    flag = torch.tensor([int(refused)], dtype=torch.int64, device=values.device)
    flagged = torch.cat([values.reshape(-1), flag]).to(channel.device)
    dist.all_reduce(flagged, op=dist.ReduceOp.SUM, group=channel.process_group)
    if int(flagged[-1]) > 0:
        raise ValueError(f"{_NOT_INT64} on {int(flagged[-1])} member(s)")
    return flagged[:-1].reshape(values.shape).cpu()


def _header_labels(rows: tuple[tuple[int, ...], ...], names: tuple[str, ...]) -> str:
    """The labels of the words that differ from row 0, once each, in word order."""
    differing = sorted({i for row in rows[1:] for i, word in enumerate(row) if word != rows[0][i]})
    if any(i < HEADER_WORDS - HEADER_PAYLOAD_WORDS for i in differing):
        # Another magic, version or op code means the members run different operations; the
        # payload words then mean different things and listing them would mislead.
        return "operation"
    labels: list[str] = []
    for index in differing:
        label = names[index - (HEADER_WORDS - HEADER_PAYLOAD_WORDS)]
        if label not in labels:
            labels.append(label)
    return ", ".join(labels)


class GuardedOperation:
    """The only way an optimizer enters a scoped collective.

    Give exactly one of ``binding_getter`` (returns the installed binding or ``None``) or
    ``scope`` (a failure scope of channels, the mesh form, which offers only ``local``).
    """

    def __init__(
        self,
        owner_name: str,
        *,
        binding_getter: Callable[[], ProcessGroupBinding | None] | None = None,
        scope: Sequence[Channel] | None = None,
    ) -> None:
        if (binding_getter is None) == (scope is None):
            raise TypeError("GuardedOperation takes exactly one of binding_getter= or scope=")
        self.owner_name = owner_name
        self._binding_getter = binding_getter
        self.binding: ProcessGroupBinding | None = None
        self.scope: tuple[Channel, ...] = ()
        if binding_getter is None:
            assert scope is not None
            self.scope = _checked_scope(scope)
            return
        binding = binding_getter()
        if binding is not None and not isinstance(binding, ProcessGroupBinding):
            raise TypeError(
                "binding_getter must return a ProcessGroupBinding or None, got "
                f"{type(binding).__name__}"
            )
        # The only un-voted check: it reads the binding alone, never parameters, so whatever
        # goes wrong later is reported through this known-good channel.
        if binding is not None:
            binding.validate_runtime()
            self.scope = binding.failure_scope()
        self.binding = binding

    def local(self, phase: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` and the binding-swap check, then vote the outcome over the scope."""
        return self.local_agreeing(phase, "", lambda: (fn(*args, **kwargs), ()))

    def local_agreeing(
        self,
        phase: str,
        what: str | tuple[str, ...],
        fn: Callable[[], tuple[T, Sequence[int]]],
    ) -> T:
        """``local`` for an ``fn`` returning ``(result, words)``: the vote also checks, in the same
        all-reduce, that every member returned equal words (``AGREEMENT_WIDTH`` of them, or none
        at all); a difference raises ``GroupAgreementError`` naming ``what`` (or the subject of
        the first differing word, for a tuple of one subject per word) on every member."""
        error: Exception | None = None
        result: T | None = None
        words: Sequence[int] = ()
        try:
            result, returned = fn()
            words = tuple(returned)  # here: a malformed return is this member's failure, voted
            if self._binding_getter is not None and self._binding_getter() is not self.binding:
                raise RuntimeError(
                    f"{self.owner_name} process-group binding changed during the {phase}"
                )
        except Exception as exc:
            error = exc
        if what and (error is not None or len(words) == 0):
            words = (0,) * AGREEMENT_WIDTH  # a failing member's vote keeps its length
        agreement = (what, words) if what else None
        synchronize_step_error(error, phase, self.scope, self.owner_name, agreement=agreement)
        return result  # type: ignore[return-value]  # set whenever no error was voted

    # -- binding-form helpers -----------------------------------------------------------------

    def _binding_channel(self, method: str) -> Channel | None:
        if self._binding_getter is None:
            raise RuntimeError(
                f"GuardedOperation.{method} needs the binding form; the mesh form offers only local"
            )
        return None if self.binding is None else self.binding.channel

    def header(self, op_code: int, payload: Sequence[int], names: Sequence[str]) -> None:
        """Exchange the fixed 24-word header and fail identically on any difference."""
        channel = self._binding_channel("header")
        words = _int64_words(list(payload), "payload")
        (op,) = _int64_words([op_code], "op_code")
        labels = tuple(names)
        if (
            len(words) > HEADER_PAYLOAD_WORDS
            or not len(words) <= len(labels) <= HEADER_PAYLOAD_WORDS
        ):
            raise ValueError(
                f"a header carries at most {HEADER_PAYLOAD_WORDS} payload words and one label "
                f"per word; got {len(words)} words and {len(labels)} labels"
            )
        if any(type(label) is not str for label in labels):
            raise TypeError("header labels must be str")
        if channel is None:
            return
        padding = HEADER_PAYLOAD_WORDS - len(words)
        vector = [HEADER_MAGIC, HEADER_VERSION, op, *words, *([0] * padding)]
        names_padded = labels + (_RESERVED,) * (HEADER_PAYLOAD_WORDS - len(labels))
        rows = _all_gather_words(channel, vector)
        if any(row != rows[0] for row in rows):
            raise GroupAgreementError(
                f"{self.owner_name} operation header differs across process-group members: "
                f"{_header_labels(rows, names_padded)}",
                owner_name=self.owner_name,
                what="operation header",
            )

    def any_true(self, flag: bool) -> bool:
        channel = self._binding_channel("any_true")
        if channel is None:
            return bool(flag)
        return any_true_over((channel,), bool(flag))

    def gather(self, words: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Every member's words, in member order (equal lengths are the caller's protocol)."""
        channel = self._binding_channel("gather")
        checked = _int64_words(list(words), "words")
        if channel is None:
            return (tuple(checked),)
        return _all_gather_words(channel, checked)

    def agree(self, what: str, words: Sequence[int]) -> tuple[int, ...]:
        """Gather and require equality; returns the agreed words."""
        rows = self.gather(words)
        if any(row != rows[0] for row in rows):
            raise GroupAgreementError(
                f"{self.owner_name} {what} differs across process-group members",
                owner_name=self.owner_name,
                what=what,
            )
        return rows[0]

    def sum_int64(self, tensor: torch.Tensor) -> torch.Tensor:
        """Exact, order-independent sum over the members; returns a CPU int64 tensor."""
        channel = self._binding_channel("sum_int64")
        if channel is None:
            values, refused = _exact_int64(tensor)
            if refused:
                raise ValueError(_NOT_INT64)
            return values
        return _all_reduce_sum_int64(channel, tensor)
