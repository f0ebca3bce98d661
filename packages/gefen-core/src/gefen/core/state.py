"""The per-parameter state codec of ``gefen.core`` (docs/core.md §3, §8.3).

The codebook check of §5.4, the description of one parameter's entry (``CodecKeys``,
``EntrySpec``), its allocation, the one entry validator of §8.3 (``validate_entry``) and the
family migration of §8.4. Loading, the step-time state match, the contract and the tests all
use these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from gefen.core.kernels.blocks import code_bytes
from gefen.core.validation import local_tensor

__all__ = [
    "CODEBOOK_SIZE",
    "COUNTER_KEYS",
    "FAMILY_KEYS",
    "CodecKeys",
    "EntrySpec",
    "allocate_entry",
    "copy_entry",
    "counters_fit",
    "entries_nbytes",
    "entry_family",
    "entry_matches",
    "is_initialized",
    "migrate_family",
    "validate_codebook",
    "validate_entry",
]

CODEBOOK_SIZE = 256
"""Entries of the codebook8 codebook (uint8 indices); codebook4's holds 16 (4-bit indices)."""


def validate_codebook(cb: object, size: int = CODEBOOK_SIZE) -> None:
    """Raise ValueError unless ``cb`` is a valid learned or loaded codebook (docs/core.md §5.4).

    The rules, checked in this order: a torch.Tensor with the strided layout, holding data (not
    on the meta device); float32; 1-D; ``size`` values (256 for codebook8, 16 for codebook4);
    all finite; strictly increasing; ``cb[0] == -1.0``; ``cb[size-1] == +1.0``. The message
    names the rule that failed. This is the one codebook check for Gefen and GefenMuon alike.
    """
    if not isinstance(cb, Tensor) or cb.layout != torch.strided:
        layout = f" ({cb.layout})" if isinstance(cb, Tensor) else ""
        raise ValueError(
            f"codebook must be a strided torch.Tensor, got {type(cb).__name__}{layout}"
        )
    if cb.is_meta:
        raise ValueError("codebook must hold data (it is on the meta device)")
    if cb.dtype != torch.float32:
        raise ValueError(f"codebook must be float32, got {cb.dtype}")
    if cb.dim() != 1:
        raise ValueError(f"codebook must be 1-D, got shape {tuple(cb.shape)}")
    if cb.numel() != size:
        raise ValueError(f"codebook must hold {size} values, got {cb.numel()}")
    values = cb.detach().cpu()
    if not bool(torch.isfinite(values).all()):
        raise ValueError("codebook values must all be finite")
    if not bool((values[1:] > values[:-1]).all()):
        raise ValueError("codebook must be strictly increasing")
    if float(values[0]) != -1.0:
        raise ValueError(f"codebook must start at exactly -1.0, got cb[0] = {float(values[0])!r}")
    if float(values[-1]) != 1.0:
        raise ValueError(
            f"codebook must end at exactly +1.0, got cb[{size - 1}] = {float(values[-1])!r}"
        )


# -- the per-parameter entry (§3.2) ---------------------------------------------------------------

Family = Literal["block", "factored"]

COUNTER_KEYS = ("period", "step", "v_step")
"""The exact-int keys of an entry (``v_step`` only for optimizers with a second moment)."""

FAMILY_KEYS: dict[str, tuple[str, ...]] = {"block": ("v_block",), "factored": ("v_row", "v_col")}
"""The tensors of each second-moment family."""


@dataclass(frozen=True)
class CodecKeys:
    """The momentum keys of a codec: codebook8 and codebook4 use ``codes``/``scale``,
    ``"none"`` ``dense``."""

    codes: str = "momentum_codes"
    scale: str = "momentum_scale"
    dense: str = "momentum"


@dataclass(frozen=True)
class EntrySpec:
    """The ``validate_entry`` keyword arguments for one live parameter (docs/core.md §1.1).

    ``numel`` is N as the optimizer defines it; ``matrix_shape`` is set only where the factored
    family is possible (a plain 2-D tensor); ``dense_shape=None`` means the (B, P) block grid;
    ``second_moment`` is the family the parameter's group selects now (None: no second moment).
    ``extra_pairs`` declares optional further keys: a floating dtype means a tensor of that
    shape and dtype, finite and >= 0; an integer dtype means a Python int >= 0.
    ``recorded_ints`` are Python ints a new codebook8 entry records about its parameter (GefenMuon:
    ``matrix_cols``, since (B, P) codes alone cannot tell a (16, 8) matrix from an (8, 16) one);
    a saved entry may lack one (written before it was recorded), but one it holds must match.
    ``codes_per_byte`` is 2 where the group keeps codebook4 codes ((B, ceil(P / 2)) bytes),
    else 1 ((B, P)).
    """

    numel: int
    matrix_shape: tuple[int, int] | None
    codec_keys: CodecKeys
    dense_dtype: torch.dtype
    dense_shape: tuple[int, ...] | None
    second_moment: Family | None
    extra_pairs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    recorded_ints: Mapping[str, int] = field(default_factory=dict)
    codes_per_byte: int = 1

    def tensor_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of every tensor key an entry may hold: the one table the checks read."""
        keys = self.codec_keys
        dtypes = {keys.codes: torch.uint8, keys.scale: torch.float32, keys.dense: self.dense_dtype}
        dtypes.update(dict.fromkeys(("v_block", "v_row", "v_col"), torch.float32))
        dtypes.update({k: d for k, (_, d) in self.extra_pairs.items() if d.is_floating_point})
        return dtypes

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``validate_entry`` (everything but ``entry`` and ``where``)."""
        return {
            "numel": self.numel,
            "matrix_shape": self.matrix_shape,
            "codec_keys": self.codec_keys,
            "dense_dtype": self.dense_dtype,
            "dense_shape": self.dense_shape,
            "second_moment": self.second_moment,
            "extra_pairs": self.extra_pairs,
            "recorded_ints": self.recorded_ints,
            "codes_per_byte": self.codes_per_byte,
        }


def _is_exact_int(value: object) -> bool:
    return type(value) is int


def is_initialized(entry: Mapping[str, Any]) -> bool:
    """True when the entry holds more than its period (the initialized variant)."""
    return "step" in entry


def entry_family(entry: Mapping[str, Any]) -> Family | None:
    """The second-moment family an entry holds, or None (uninitialized or no second moment)."""
    if "v_block" in entry:
        return "block"
    if "v_row" in entry or "v_col" in entry:
        return "factored"
    return None


class _EntryCheck:
    """One validation pass; ``values`` adds the finite/non-negative/all-zero value checks."""

    def __init__(self, where: str, spec: EntrySpec, values: bool) -> None:
        self.where = where
        self.spec = spec
        self.values = values

    def fail(self, rule: str) -> None:
        raise ValueError(f"{self.where}: {rule}")

    def mismatch(self, detail: str) -> None:
        self.fail(f"state does not match parameter ({detail})")

    def tensor(
        self, entry: Mapping[str, Any], key: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> Tensor:
        value = entry[key]
        if not isinstance(value, Tensor):
            self.fail(f"'{key}' must be a tensor, got {type(value).__name__}")
        local: Tensor = value.to_local() if hasattr(value, "to_local") else value
        # Layout before anything reads the values: a sparse or meta tensor would otherwise pass
        # here and fail later with torch's own error, in the step's unvoted phase.
        if local.layout != torch.strided:
            self.fail(f"'{key}' must be a dense strided tensor, got layout {local.layout}")
        if local.device.type == "meta":
            self.fail(f"'{key}' must hold data (it is on the meta device)")
        if local.dtype != dtype:
            self.fail(f"'{key}' must be {dtype}, got {local.dtype}")
        if tuple(local.shape) != shape:
            self.mismatch(f"'{key}' has shape {tuple(local.shape)}, expected {shape}")
        return local

    def non_negative(self, key: str, tensor: Tensor, *, signed: bool = False) -> None:
        if not self.values:
            return
        if not bool(torch.isfinite(tensor).all()):
            self.fail(f"'{key}' must be finite")
        if not signed and bool((tensor < 0).any()):
            self.fail(f"'{key}' must be >= 0")


def _check_period(check: _EntryCheck, entry: Mapping[str, Any]) -> int:
    if "period" not in entry:
        check.fail("missing key 'period'")
    period = entry["period"]
    if not _is_exact_int(period) or period < 0:
        check.fail(f"'period' must be an int >= 0, got {period!r}")
    numel = check.spec.numel
    if numel == 0 and period != 0:
        check.mismatch(f"period {period} for a parameter with no element")
    if period > 0 and numel % period != 0:
        check.mismatch(f"period {period} does not divide numel {numel}")
    return int(period)


def _allowed_keys(spec: EntrySpec) -> set[str]:
    keys = {"period", "step", spec.codec_keys.codes, spec.codec_keys.scale, spec.codec_keys.dense}
    keys.update(spec.extra_pairs)
    keys.update(spec.recorded_ints)
    if spec.second_moment is not None:
        keys.update({"v_step", "v_block", "v_row", "v_col"})
    return keys


def _check_momentum(check: _EntryCheck, entry: Mapping[str, Any], grid: tuple[int, int]) -> str:
    keys = check.spec.codec_keys
    has_codes = keys.codes in entry or keys.scale in entry
    if has_codes and keys.dense in entry:
        check.fail(f"entry holds both '{keys.codes}' and '{keys.dense}'")
    if has_codes:
        for key in (keys.codes, keys.scale):
            if key not in entry:
                check.fail(f"missing key '{key}'")
        packed = check.spec.codes_per_byte == 2
        width = code_bytes(grid[1], packed=packed)
        dtypes = check.spec.tensor_dtypes()
        codes = check.tensor(entry, keys.codes, dtypes[keys.codes], (grid[0], width))
        if check.values and packed and grid[1] % 2 and bool((codes[:, -1] >> 4).any()):
            check.fail(f"'{keys.codes}': the unused high nibble of an odd block must be 0")
        scale = check.tensor(entry, keys.scale, dtypes[keys.scale], (grid[0], 1))
        check.non_negative(keys.scale, scale)
        return "q4" if packed else "q8"
    if keys.dense not in entry:
        check.fail(f"missing momentum key '{keys.codes}' or '{keys.dense}'")
    shape = check.spec.dense_shape if check.spec.dense_shape is not None else grid
    dense = check.tensor(entry, keys.dense, check.spec.dense_dtype, tuple(shape))
    check.non_negative(keys.dense, dense, signed=True)
    return "fp32"


def counters_fit(*entries: Mapping[str, Any]) -> bool:
    """``_check_counters``' rules, cheap enough for every entry at every step (the step token
    and the entry match leave the counter values out, since the commit advances them): an edit
    such as a warm restart's ``state[p]["step"] = 0`` below ``v_step`` takes the full checks,
    which refuse it by name before anything changes. True for an entry with no counters; one
    call checks all ``entries`` (the step token checks the whole model's in one)."""
    for entry in entries:
        step, v_step = entry.get("step", 1), entry.get("v_step", 0)
        if not (type(step) is int and type(v_step) is int and 0 <= v_step <= step and step >= 1):
            return False
    return True


def _check_counters(check: _EntryCheck, entry: Mapping[str, Any]) -> tuple[int, int]:
    step = entry["step"]
    if not _is_exact_int(step) or step < 1:
        check.fail(f"'step' must be an int >= 1, got {step!r}")
    if check.spec.second_moment is None:
        return int(step), 0
    if "v_step" not in entry:
        check.fail("missing key 'v_step'")
    v_step = entry["v_step"]
    if not _is_exact_int(v_step) or not 0 <= v_step <= step:
        check.fail(f"'v_step' must be an int with 0 <= v_step <= step, got {v_step!r}")
    return int(step), int(v_step)


def _check_second_moment(
    check: _EntryCheck, entry: Mapping[str, Any], blocks: int, v_step: int
) -> Family:
    block = "v_block" in entry
    factored = "v_row" in entry or "v_col" in entry
    if block == factored:
        check.fail(
            "entry must hold exactly one second-moment family ('v_block' or 'v_row'/'v_col')"
        )
    if block:
        tensors = [("v_block", check.tensor(entry, "v_block", torch.float32, (blocks, 1)))]
    else:
        matrix = check.spec.matrix_shape
        if matrix is None:
            check.mismatch("a factored second moment on a parameter that is not a plain matrix")
        assert matrix is not None
        for key in ("v_row", "v_col"):
            if key not in entry:
                check.fail(f"missing key '{key}'")
        tensors = [
            ("v_row", check.tensor(entry, "v_row", torch.float32, (matrix[0],))),
            ("v_col", check.tensor(entry, "v_col", torch.float32, (matrix[1],))),
        ]
    for key, tensor in tensors:
        check.non_negative(key, tensor)
        if check.values and v_step == 0 and bool(tensor.any()):
            check.fail(f"'{key}' must be all zero while 'v_step' is 0")
    return "block" if block else "factored"


def _check_extras(check: _EntryCheck, entry: Mapping[str, Any]) -> None:
    for key, (shape, dtype) in check.spec.extra_pairs.items():
        if key not in entry:
            continue
        value = entry[key]
        if dtype.is_floating_point:
            if not isinstance(value, Tensor):
                check.fail(f"'{key}' must be a tensor, got {type(value).__name__}")
            check.non_negative(key, check.tensor(entry, key, dtype, tuple(shape)))
        elif not _is_exact_int(value) or value < 0:
            # A counter is a Python int, as 'step' is (never a tensor: DCP flattens tensors).
            check.fail(f"'{key}' must be an int >= 0, got {value!r}")
    for key, expected in check.spec.recorded_ints.items():
        if key in entry and not (_is_exact_int(entry[key]) and entry[key] == expected):
            check.mismatch(f"'{key}' is {entry[key]!r}, the parameter needs {expected}")


def _validate(entry: object, where: str, spec: EntrySpec, values: bool) -> str:
    check = _EntryCheck(where, spec, values)
    if not isinstance(entry, Mapping):
        check.fail(f"entry must be a dict, got {type(entry).__name__}")
    assert isinstance(entry, Mapping)
    allowed = _allowed_keys(spec)
    for key in entry:
        if key not in allowed:
            check.fail(f"unknown state key {key!r}")
    period = _check_period(check, entry)
    if "step" not in entry:
        others = [key for key in entry if key != "period"]
        if others:
            check.fail(f"an entry without 'step' holds {others[0]!r}")
        return "uninitialized"
    if period == 0:
        check.fail("an initialized entry needs a period > 0")
    grid = (spec.numel // period, period)
    codec = _check_momentum(check, entry, grid)
    _, v_step = _check_counters(check, entry)
    _check_extras(check, entry)
    if spec.second_moment is None:
        return codec
    return f"{codec}_{_check_second_moment(check, entry, grid[0], v_step)}"


def validate_entry(
    entry: object,
    *,
    where: str,
    numel: int,
    matrix_shape: tuple[int, int] | None,
    codec_keys: CodecKeys,
    dense_dtype: torch.dtype,
    dense_shape: tuple[int, ...] | None,
    second_moment: Family | None,
    extra_pairs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    recorded_ints: Mapping[str, int] | None = None,
    codes_per_byte: int = 1,
) -> str:
    """The one entry validator (docs/core.md §8.3); returns the matched variant name.

    Variants: ``"uninitialized"`` (pristine or period-selected), ``"q8_block"``,
    ``"q8_factored"``, ``"fp32_block"``, ``"fp32_factored"`` (``"q4_…"`` for codebook4 codes,
    ``codes_per_byte=2``); without a second moment (``second_moment=None``) ``"q8"``, ``"q4"``
    or ``"fp32"``. The family is read from the entry: a family
    other than ``second_moment`` is accepted when it fits the parameter, so the caller can
    migrate it (§8.4); the codec is read from the momentum keys, so the caller rejects the other
    codec. Raises ValueError ``"{where}: <rule>"``; nothing is modified.
    """
    spec = EntrySpec(
        numel, matrix_shape, codec_keys, dense_dtype, dense_shape, second_moment,
        dict(extra_pairs or {}), dict(recorded_ints or {}), codes_per_byte,
    )  # fmt: skip
    return _validate(entry, where, spec, values=True)


def copy_entry(entry: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A copy of an entry whose tensors are detached copies on ``device`` in their own dtype
    (torch's base loader would cast floating state to the parameter dtype)."""
    return {
        # Row-major: the native kernels read the state through data_ptr() (a dense transposed
        # tensor from a file would otherwise be read in the wrong order).
        key: value.detach().to(device=device, copy=True, memory_format=torch.contiguous_format)
        if isinstance(value, Tensor)
        else value
        for key, value in entry.items()
    }


def entry_matches(entry: Mapping[str, Any], spec: EntrySpec) -> str | None:
    """Step-time structural check (no value scan): None when the entry fits, else the reason."""
    try:
        _validate(entry, "entry", spec, values=False)
    except ValueError as error:
        return str(error)
    for key, value in entry.items():
        # The kernels read state row-major through data_ptr(): an expand()ed or transposed
        # tensor put into the state would be read (and written) out of order or out of bounds.
        if isinstance(value, Tensor) and not local_tensor(value).is_contiguous():
            return f"entry: '{key}' must be contiguous"
    return None


def _family_tensors(
    family: Family, spec: EntrySpec, blocks: int, device: torch.device
) -> dict[str, Tensor]:
    if family == "block":
        return {"v_block": torch.zeros(blocks, 1, dtype=torch.float32, device=device)}
    assert spec.matrix_shape is not None
    rows, cols = spec.matrix_shape
    return {
        "v_row": torch.zeros(rows, dtype=torch.float32, device=device),
        "v_col": torch.zeros(cols, dtype=torch.float32, device=device),
    }


def allocate_entry(
    spec: EntrySpec, period: int, *, codebook8: bool, device: torch.device
) -> dict[str, Any]:
    """A new initialized entry: zero tensors, counters at 0 (incremented before use, §3.2).
    ``codebook8`` means codes into the codebook (two per byte where ``spec.codes_per_byte``
    is 2); else the dense momentum."""
    blocks = spec.numel // period
    entry: dict[str, Any] = {"period": period, "step": 0}
    keys = spec.codec_keys
    if codebook8:
        width = code_bytes(period, packed=spec.codes_per_byte == 2)
        entry[keys.codes] = torch.zeros(blocks, width, dtype=torch.uint8, device=device)
        entry[keys.scale] = torch.zeros(blocks, 1, dtype=torch.float32, device=device)
        entry.update(spec.recorded_ints)
    else:
        shape = spec.dense_shape if spec.dense_shape is not None else (blocks, period)
        entry[keys.dense] = torch.zeros(shape, dtype=spec.dense_dtype, device=device)
    if spec.second_moment is not None:
        entry.update(_family_tensors(spec.second_moment, spec, blocks, device))
        entry["v_step"] = 0
    return entry


def migrate_family(
    entry: Mapping[str, Any], spec: EntrySpec, device: torch.device
) -> dict[str, Any]:
    """A new entry with the family ``spec.second_moment`` selects (§8.4): its statistics are
    the old family's per-element picture averaged the new family's way, and ``v_step``, ``step``
    and the momentum carry over. (Zeros beside a kept momentum divided it by ``eps`` wherever a
    gradient was zero next: a parameter moved by ``lr·m/eps``.)"""
    assert spec.second_moment is not None
    assert spec.matrix_shape is not None  # a factored family exists on plain matrices only
    dropped = {key for keys in FAMILY_KEYS.values() for key in keys}
    migrated = {key: value for key, value in entry.items() if key not in dropped}
    period = int(entry["period"])
    blocks = spec.numel // period
    if "v_block" in entry:  # each element holds its block's value
        picture = entry["v_block"].to(device).expand(blocks, period)
    else:  # the factored estimate of §6.2, unfloored
        v_row, v_col = entry["v_row"].to(device), entry["v_col"].to(device)
        floor = torch.finfo(torch.float32).tiny
        picture = (v_row / v_row.mean().clamp_min(floor)).unsqueeze(1) * v_col.unsqueeze(0)
    if spec.second_moment == "block":
        fresh = {"v_block": picture.reshape(blocks, period).mean(dim=1, keepdim=True)}
    else:
        matrix = picture.reshape(spec.matrix_shape)
        fresh = {"v_row": matrix.mean(dim=1), "v_col": matrix.mean(dim=0)}
    migrated.update({key: value.contiguous() for key, value in fresh.items()})
    return migrated


def entries_nbytes(entries: Iterable[object]) -> int:
    """Bytes of every tensor in ``entries`` (a DTensor counts its local shard); values that are
    not entries (a user's own ``optimizer.state`` key) count nothing."""
    total = 0
    for entry in entries:
        if not isinstance(entry, Mapping):
            continue
        for value in entry.values():
            if isinstance(value, Tensor):
                total += local_tensor(value).numel() * value.element_size()
    return total
