"""The dtypes of the safetensors format and their torch equivalents."""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping

import torch

from ..errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidStateError,
    UnsupportedFormatError,
)

_CANDIDATES: list[tuple[str, str]] = [
    ("F64", "float64"),
    ("F32", "float32"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I64", "int64"),
    ("I32", "int32"),
    ("I16", "int16"),
    ("I8", "int8"),
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("C64", "complex64"),
]

_NOT_READ = {
    "F4": "4-bit floats packed two to a byte, torch.float4_e2m1fn_x2",
    "F6_E2M3": "6-bit floats",
    "F6_E3M2": "6-bit floats",
}
"""safetensors dtypes of fewer than 8 bits an element: whole bytes hold several elements,
and shardpoint's reads, casts and resharding count whole-byte elements."""

NAME_TO_DTYPE: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _CANDIDATES if hasattr(torch, attr)
}
DTYPE_TO_NAME: dict[torch.dtype, str] = {dtype: name for name, dtype in NAME_TO_DTYPE.items()}


def dtype_from_name(name: object, *, where: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype string; ``where`` names the file and tensor."""
    newer = dict(_CANDIDATES).get(name) if isinstance(name, str) and name not in NAME_TO_DTYPE else None
    if newer is not None:
        raise UnsupportedFormatError(
            f"{where}: dtype {name} is torch.{newer}, which this torch ({torch.__version__}) does not have; "
            "the checkpoint was written with a newer torch: upgrade torch to read it"
        )
    if isinstance(name, str) and name in _NOT_READ:
        raise UnsupportedFormatError(
            f"{where}: dtype {name} ({_NOT_READ[name]}) is one shardpoint does not read: its elements are smaller "
            "than a byte. The file itself may be whole; read it with safetensors (safe_open or "
            "safetensors.torch.load_file)"
        )
    if not isinstance(name, str) or name not in NAME_TO_DTYPE:
        raise UnsupportedFormatError(
            f"{where}: unknown dtype {repr(name)[:80]}; known dtypes are {', '.join(NAME_TO_DTYPE)}"
        )
    return NAME_TO_DTYPE[name]


def as_dtype(stored: str | torch.dtype) -> torch.dtype | None:
    """A stored tensor's dtype as torch's: a safetensors code (a manifest record's) or a
    torch dtype already (a ``.bin`` file's tensor); None for a code this torch lacks.

    >>> as_dtype("BF16"), as_dtype(torch.int8), as_dtype("F99")
    (torch.bfloat16, torch.int8, None)
    """
    return stored if isinstance(stored, torch.dtype) else NAME_TO_DTYPE.get(stored)


def narrows(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether a cast from ``stored`` to ``target`` can push values out of ``target``'s range
    (what :meth:`OutOfRange.check` counts): a narrower float, or a narrower integer."""
    return range_lost(stored, target) is not None or int_range_lost(stored, target) is not None


def dtype_name(dtype: torch.dtype, *, key: str) -> str:
    """The safetensors dtype string for a torch dtype; ``key`` names the tensor."""
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        if str(dtype).startswith("torch.float4"):
            raise InvalidStateError(
                f"tensor {key!r} has dtype {dtype}, which shardpoint does not store (safetensors' F4: two 4-bit "
                f"values a byte, where shardpoint's reads and resharding count whole bytes); {_storable_hint(dtype)}"
            ) from None
        if "_packed_params" in key:  # a torch.ao quantized module's state
            raise InvalidStateError(
                f"tensor {key!r} has dtype {dtype}: it is the packed weight of a torch.ao quantized module, which "
                "safetensors cannot store. Save the float model (before quantize_dynamic / convert) and quantize "
                "after loading, or keep the quantized model with torch.save"
            ) from None
        raise InvalidStateError(
            f"tensor {key!r} has dtype {dtype}, which safetensors cannot store; {_storable_hint(dtype)}"
        ) from None


def _storable_hint(dtype: torch.dtype) -> str:
    """How to turn a tensor of ``dtype`` into one safetensors stores, keeping its values.

    >>> _storable_hint(torch.complex32)
    'convert it with `.to(torch.complex64)` (complex values in float32 parts) before saving'
    >>> _storable_hint(torch.complex128)[:50]
    'store `torch.view_as_real(t)` (its float64 parts, '
    >>> _storable_hint(torch.qint8)
    'store `.dequantize()` (float32 values), or its `.int_repr()` with its scale and zero point, instead'
    """
    if dtype == torch.complex128:  # complex64 would round its float64 parts
        return ("store `torch.view_as_real(t)` (its float64 parts, exactly) and `torch.view_as_complex` it after "
                "loading; `.to(torch.complex64)` would round each part to float32")
    if dtype.is_complex:
        return "convert it with `.to(torch.complex64)` (complex values in float32 parts) before saving"
    if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return "store `.dequantize()` (float32 values), or its `.int_repr()` with its scale and zero point, instead"
    if str(dtype).startswith("torch.float4"):  # packed two to a byte; torch casts it to nothing
        return ("store its bytes, `.view(torch.uint8)` (two 4-bit values each), and view them back with "
                f"`.view({dtype})` after loading")
    if dtype.is_floating_point:
        return "convert it with `.to(torch.float32)` before saving"
    return "convert it to a dtype safetensors stores (int64, int32, int16, int8, uint8, bool, a float) before saving"


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return int(dtype.itemsize)


CAST_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}
"""The names a ``dtype=`` argument (or ``--dtype``) may give a floating-point dtype by."""


def parse_dtype(dtype: object) -> torch.dtype | None:
    """A ``dtype=`` argument: None, a floating-point ``torch.dtype``, or its name (``"bf16"``,
    ``"float16"``, ``"torch.float32"``). It casts floating-point tensors only, so an integer
    or bool dtype (which would turn every weight into 0/1 or True) is refused.

    >>> parse_dtype("bf16"), parse_dtype("torch.float16"), parse_dtype(None)
    (torch.bfloat16, torch.float16, None)
    >>> parse_dtype(torch.bool)
    Traceback (most recent call last):
    ...
    shardpoint.errors.InvalidArgumentError: dtype torch.bool is not a floating-point dtype; use bf16, fp16, fp32 or fp64 (dtype= casts floating-point tensors only)
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InvalidArgumentError(
                f"dtype {dtype} is not a floating-point dtype; use bf16, fp16, fp32 or fp64 "
                "(dtype= casts floating-point tensors only)"
            )
        return dtype
    if not isinstance(dtype, str):
        raise InvalidArgumentTypeError(
            f"dtype must be a torch.dtype or its name (e.g. torch.bfloat16 or 'bf16'), not {type(dtype).__name__}"
        )
    found = CAST_NAMES.get(dtype.strip().lower().removeprefix("torch."))
    if found is None and dtype.strip().lower() == "auto":
        raise InvalidArgumentError(
            "dtype='auto' (the checkpoint's own dtype, as from_pretrained takes it) is load_into's; here leave dtype "
            "out to keep each tensor's stored dtype, or name one: bf16, fp16, fp32 or fp64"
        )
    if found is None:
        raise InvalidArgumentError(f"unknown dtype {dtype[:40]!r}; use bf16, fp16, fp32 or fp64")
    return found


def range_lost(stored: torch.dtype, target: torch.dtype) -> float | None:
    """The largest finite value of ``target`` when a cast from ``stored`` to it loses range
    (float32 or bfloat16 to float16, a wider float to float8, float16 to float8_e5m2), else
    None: values past it become inf (float16, float8_e5m2) or are clipped or made NaN (the
    other float8s). A cast to bfloat16 is not counted (float32's exponent range).

    >>> range_lost(torch.float32, torch.float16)
    65504.0
    >>> range_lost(torch.float32, torch.bfloat16) is None  # float32's exponent range
    True
    """
    if not target.is_floating_point or target == torch.bfloat16:
        return None  # bfloat16 has float32's exponents: only values past 3.39e38 would be lost
    if stored.is_floating_point:
        widest = float(torch.finfo(stored).max)
    elif stored != torch.bool and not stored.is_complex:
        widest = float(torch.iinfo(stored).max)  # int64 100000 as float16: inf
    else:
        return None
    largest = float(torch.finfo(target).max)
    return largest if largest < widest else None


def int_range_lost(stored: torch.dtype, target: torch.dtype) -> tuple[int, int] | None:
    """``(lowest, highest)`` of integer ``target`` when a cast from integer ``stored`` to it
    cannot hold every value (int64 to int8, int64 to uint8, uint64 to int64), else None:
    values outside wrap around to other values, silently, as torch's casts do.

    >>> int_range_lost(torch.int64, torch.int8)
    (-128, 127)
    >>> int_range_lost(torch.int8, torch.int64) is None
    True
    """
    if not _is_int(stored) or not _is_int(target):
        return None
    have, want = torch.iinfo(stored), torch.iinfo(target)
    return (int(want.min), int(want.max)) if have.min < want.min or have.max > want.max else None


def _is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


_REDUCIBLE = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
"""Floating-point dtypes torch takes the minimum and maximum of directly."""


class OutOfRange:
    """A tally, per tensor, of the finite values a cast to a narrower float pushed past its
    range (safe to add to from the reader threads); :meth:`message` says what became of them.

        >>> tally = OutOfRange()
        >>> tally.check("w", torch.tensor([1.0, 7e4, float("inf")]), torch.float16)
        >>> print(tally.message("load as", "as read from ckpt"))
        load as float16: 1 value(s) of 'w' are past float16's range (largest magnitude 7e+04; float16 holds up to 65504) and became inf as read from ckpt; a model computes inf / nan there. Load as bfloat16 (float32's range) instead
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.found: dict[str, tuple[torch.dtype, int, float]] = {}
        """Tensor -> (the dtype cast to, values past its range, their largest magnitude)."""

    def check(self, label: str, source: torch.Tensor, target: torch.dtype) -> None:
        """Count the finite values of ``source`` (values about to be cast to ``target``)
        past ``target``'s range, under ``label``. Costs one pass over ``source`` only when
        ``target`` is narrower (not for a cast to bfloat16 or a wider dtype)."""
        if source.numel() == 0:
            return
        bounds = int_range_lost(source.dtype, target)
        if bounds is not None:
            self._check_ints(label, source.detach(), target, bounds)
            return
        largest = range_lost(source.dtype, target)
        if largest is None:
            return
        values = source.detach()
        if values.dtype not in _REDUCIBLE:  # the float8s: no min / max kernels; widened a part at a time
            for part in values.reshape(-1).split(1 << 20):
                self.check(label, part.float(), target)
            return
        if values.dtype == torch.float32 and values.device.type == "cpu":
            flat = values.numpy()  # numpy's min / max: a third of the time of torch's aminmax
            low, high = float(flat.min()), float(flat.max())
        else:
            low, high = (float(x) for x in torch.aminmax(values))
        if -largest <= low and high <= largest:
            return  # (a NaN fails both tests: counted below)
        magnitude = values.abs()
        over = (magnitude > largest) & torch.isfinite(magnitude)
        count = int(over.sum())
        if count:
            self.add(label, target, count, float(magnitude[over].max()))

    def _check_ints(self, label: str, values: torch.Tensor, target: torch.dtype, bounds: tuple[int, int]) -> None:
        """Count the integers of ``values`` outside ``bounds`` (``target``'s range)."""
        if values.dtype == torch.uint64:  # no comparison kernels: its bits as int64 (2**63 and up negative)
            bits = values.view(torch.int64)
            over = (bits < 0) | (bits > bounds[1])
        else:
            if values.dtype in (torch.uint16, torch.uint32):  # no min / max kernels for these: widened
                values = values.to(torch.int64)
            low, high = (int(x) for x in torch.aminmax(values))
            if bounds[0] <= low and high <= bounds[1]:
                return
            over = (values < bounds[0]) | (values > bounds[1])
        count = int(over.sum())
        if count:
            self.add(label, target, count, 0.0)

    def add(self, label: str, target: torch.dtype, count: int, largest: float) -> None:
        with self._lock:
            _, before, top = self.found.get(label, (target, 0, 0.0))
            self.found[label] = (target, before + count, max(top, largest))

    def message(self, verb: str, where: str) -> str | None:
        """What the cast (``verb``: ``"load as"``, ``"convert to"``) did to the values past
        the range, ``where`` (``"in out/model"``); None when there were none."""
        if not self.found:
            return None
        ints = {k: v for k, v in self.found.items() if _is_int(v[0])}
        floats = {k: v for k, v in self.found.items() if k not in ints}
        # both kinds in one load: a sentence each
        return " ".join(say(found, verb, where) for found, say in ((floats, _float_message), (ints, _int_message))
                        if found)

    def warn(self, verb: str, where: str) -> None:
        """Warn with :meth:`message`, if there is one, and start a new tally."""
        message = self.message(verb, where)
        self.found = {}
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=3)


def _shown(found: Mapping[str, tuple[torch.dtype, int, float]]) -> tuple[str, int]:
    """The tensors of a tally as a message names them (five at most), and their count of values."""
    names = list(found)
    shown = ", ".join(repr(k) for k in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return shown, sum(n for _, n, _ in found.values())


def _float_message(found: Mapping[str, tuple[torch.dtype, int, float]], verb: str, where: str) -> str:
    """What a cast to a narrower float did to the values of ``found`` past its range."""
    dtype = next(iter(found.values()))[0]
    shown, total = _shown(found)
    largest = max(m for _, _, m in found.values())
    kind = str(dtype).removeprefix("torch.")
    probe = float(torch.tensor(1e38).to(dtype).float())  # what a value past the range becomes
    became = "inf" if math.isinf(probe) else "nan" if math.isnan(probe) else f"{probe:g} (the largest it holds)"
    then = "a model computes inf / nan there" if not math.isfinite(probe) else "those weights are clipped"
    return (
        f"{verb} {kind}: {total} value(s) of {shown} are past {kind}'s range (largest magnitude {largest:.4g}; "
        f"{kind} holds up to {torch.finfo(dtype).max:.6g}) and became {became} {where}; {then}. "
        f"{verb[:1].upper()}{verb[1:]} bfloat16 (float32's range) instead"
    )


def _int_message(found: Mapping[str, tuple[torch.dtype, int, float]], verb: str, where: str) -> str:
    """What a cast to a narrower integer did to the values of ``found`` outside its range."""
    dtype = next(iter(found.values()))[0]
    shown, total = _shown(found)
    kind = str(dtype).removeprefix("torch.")
    info = torch.iinfo(dtype)
    return (
        f"{verb} {kind}: {total} value(s) of {shown} are outside {kind}'s range ({info.min} to {info.max}) "
        f"and wrapped around to other values {where}. Load them into a wider integer dtype instead"
    )
