"""The safetensors container: an 8-byte little-endian header length, a JSON header, the data.

Writing plans the header from dtypes and shapes alone, so tensor bytes can be streamed
afterwards. Reading validates everything in the header against the file size before any
tensor memory is allocated.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointError, CorruptCheckpointError, InvalidStateError, StorageError
from .dtypes import dtype_from_name, itemsize
from .names import check_tensor_name

SAFETENSORS_MAX_HEADER = 100_000_000
"""The ``safetensors`` library refuses headers longer than this; so do we, at save time."""

HEADER_ALIGN = 8
"""The JSON header is padded with spaces so tensor data starts 8-byte aligned."""


class TensorSpec(NamedTuple):
    """A tensor as the planner sees it: enough to lay out a file. (A named tuple: plans
    make one per tensor, and a state may hold 10^5 small ones.)"""

    key: str
    """Name of the tensor inside the file."""
    dtype: str
    """safetensors dtype string (``"F32"``, ``"BF16"``, ...)."""
    shape: tuple[int, ...]
    """Shape of the stored (contiguous) tensor."""
    nbytes: int
    """Stored bytes: numel x itemsize."""


class HeaderEntry(NamedTuple):
    """One validated tensor entry of a safetensors header (a named tuple: one per tensor)."""

    key: str
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]
    start: int
    """Absolute offset of the first byte in the file."""
    end: int
    """Absolute offset one past the last byte in the file."""
    nbytes: int
    """``end - start`` (a field, not worked out per use: a load asks it several times per tensor)."""


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: entries in file order plus the string metadata."""

    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


@dataclass(frozen=True)
class FileLayout:
    """A planned file: the header bytes and, per tensor, its absolute byte range."""

    header: bytes
    ranges: dict[str, tuple[int, int]]
    size: int


def plan_file(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> FileLayout:
    """Lay out a safetensors file: header bytes and each tensor's absolute byte range.

    >>> layout = plan_file([TensorSpec("w", "F32", (2,), 8)], {"format": "pt"})
    >>> layout.size, layout.ranges["w"][1] - layout.ranges["w"][0]
    (104, 8)
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    relative: list[tuple[str, int, int]] = []
    for key, dtype, shape, nbytes in specs:
        check_tensor_name(key, where="planning a safetensors file")
        end = offset + nbytes
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        relative.append((key, offset, end))
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
    if len(raw) > SAFETENSORS_MAX_HEADER:
        longest = max((spec.key for spec in specs), key=len, default="")
        raise InvalidStateError(
            f"the safetensors header of a file holding {len(specs)} tensors would be {len(raw)} "
            f"bytes, over the {SAFETENSORS_MAX_HEADER}-byte limit readers accept (the longest "
            f"name is {len(longest)} characters: {longest[:80]!r}...); shorten the tensor names "
            "or save with a smaller max_shard_size"
        )
    data_start = 8 + len(raw)
    ranges = {key: (data_start + begin, data_start + end) for key, begin, end in relative}
    return FileLayout(struct.pack("<Q", len(raw)) + raw, ranges, data_start + offset)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Built in C, then compared: a header or manifest holds an object per tensor, and a
    # Python loop over every pair of each cost more than the parse itself.
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


def _parse_int(literal: str) -> int:
    """JSON integers as the format's reference reader takes them: ``-0`` is a float there
    (and no writer emits it), so it is refused here too (found by fuzzing against it)."""
    if literal == "-0":
        raise ValueError("-0 is not an integer")
    return int(literal)


class _NotFinite(Exception):
    def __init__(self, text: str) -> None:
        self.text = text


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; one past float's range (``1e400``,
    decoded as inf) is refused: strict JSON readers of our output would choke on it."""
    value = float(text)
    if math.isinf(value):
        raise _NotFinite(text)
    return value


def _refuse_constant(text: str) -> Any:
    """``NaN``, ``Infinity``, ``-Infinity``: Python's extension of JSON, never valid JSON."""
    raise _NotFinite(text)


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def parse_json_object(raw: bytes, *, where: str, count_keys: bool = False) -> dict[str, Any]:
    """Decode untrusted JSON that must be an object; duplicate keys and bombs are errors.

    With ``count_keys``, text holding no backslash is parsed without the per-object
    duplicate check (a hook call per object: 10^5 of them in the header of 10^5 small
    tensors), and the caller must then count what it validated and call
    :func:`require_unique_keys`, which refuses duplicates from that count.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"{where} is not valid UTF-8 ({exc}); the file is damaged") from None
    quick = count_keys and "\\" not in text
    try:
        # ``parse_int`` (a call per integer) only where a ``-0`` may be: a header of 10^5
        # tensors has 5 x 10^5 integers.
        value = json.loads(
            text,
            object_pairs_hook=None if quick else _reject_duplicates,
            parse_int=_parse_int if "-0" in text else None,
            parse_float=_finite_float,
            parse_constant=_refuse_constant,
        )
    except _NotFinite as bad:
        raise CorruptCheckpointError(
            f"{where} holds the number {bad.text[:40]}, which is not finite; JSON has no such numbers (no "
            "writer of this format emits them): the file is damaged or forged"
        ) from None
    except _DuplicateKey as dup:
        raise CorruptCheckpointError(
            f"{where} has the key {dup.key!r} twice; the file is damaged or forged"
        ) from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where} nests JSON too deeply; refusing to parse it") from None
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{where} must be a JSON object, found {type(value).__name__}; the file is damaged"
        )
    return value


def require_unique_keys(raw: bytes, counted: int, *, where: str) -> None:
    """Refuse JSON ``raw`` that held a key twice in one object, after a
    ``parse_json_object(raw, count_keys=True)`` whose caller validated the whole value and
    ``counted`` its keys plus the colons inside its strings.

    Every key in the text is followed by one colon, and any other colon lies inside a
    string. With no backslash in the text (the only case parsed without the per-object
    check) the decoded strings are the text's own, so a key dropped as a duplicate (its
    colon, and any inside its value, gone from the decoded value) leaves ``counted`` below
    the text's colons. Equal counts prove every key unique; otherwise the text is parsed
    again with the per-object check, which names the duplicate (or finds none, when the
    caller's count left out some string's colons).
    """
    if counted != raw.count(b":"):
        parse_json_object(raw, where=where)


def colons(strings: Any) -> int:
    """Colons inside ``strings`` (an iterable of str), for :func:`require_unique_keys`."""
    return "".join(strings).count(":")


MAX_EXTENT = 2**63 - 1
"""torch sizes and strides are int64: no dimension, nor any product of them, may pass this."""


def addressable(shape: Sequence[int]) -> bool:
    """Whether torch can describe a tensor of ``shape`` (zero dims do not shrink the strides)."""
    if len(shape) <= 1:
        return not shape or shape[0] <= MAX_EXTENT
    return math.prod(max(dim, 1) for dim in shape) <= MAX_EXTENT


def quick_shape(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape when it plainly is one (at most 4 dims, each below 2**15, so no
    extent can pass 2**63); None when it needs the full checks, which name what is wrong."""
    if type(value) is not list or len(value) > 4:
        return None
    for dim in value:
        if type(dim) is not int or not 0 <= dim < 32768:
            return None
    return tuple(value)


def _as_shape(value: Any, *, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise CorruptCheckpointError(f"{where}: shape {str(value)[:80]} is not a list of at most 64 dims")
    for dim in value:
        if type(dim) is not int or dim < 0:
            raise CorruptCheckpointError(
                f"{where}: shape {str(value)[:80]} has a dimension that is not a non-negative integer"
            )
    if not addressable(value):
        raise CorruptCheckpointError(
            f"{where}: shape {str(value)[:80]} is too large for any tensor (its extent passes 2**63); "
            "the file is damaged or forged"
        )
    return tuple(value)


def validate_header(raw: bytes, file_size: int, *, name: str) -> SafetensorsHeader:
    """Validate header JSON ``raw`` of a file of ``file_size`` bytes named ``name``."""
    try:
        return _validate_header(raw, file_size, name=name)
    except CheckpointError:
        # A key given twice is what is wrong with a forged header, whatever its
        # deduplicated value then failed: the full parse names it.
        parse_json_object(raw, where=f"safetensors header of {name}")
        raise


def _validate_header(raw: bytes, file_size: int, *, name: str) -> SafetensorsHeader:
    where = f"safetensors header of {name}"
    obj = parse_json_object(raw, where=where, count_keys=True)
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    # Keys (and colons inside strings) of the validated header, checked against the text
    # at the end: each entry is a name and its three keys; dtype strings are known names
    # (no colon); shapes and offsets are integers.
    counted = colons(obj) + len(obj)
    metadata_raw = obj.pop("__metadata__", None)
    metadata: dict[str, str] = {}
    if metadata_raw is not None:
        if not isinstance(metadata_raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
        ):
            raise CorruptCheckpointError(
                f"{name}: __metadata__ must map strings to strings; the file is damaged"
            )
        metadata = metadata_raw
        counted += len(metadata) + colons(metadata) + colons(metadata.values())
    counted += 3 * len(obj)
    spans: list[tuple[int, int, str]] = []
    entries: dict[str, HeaderEntry] = {}
    known: dict[str, tuple[torch.dtype, int]] = {}
    """Each dtype string already checked: its dtype and bytes per element."""
    # One pass per tensor, which a header of 10^5 small tensors runs 10^5 times: the error
    # paths build their messages, the common path only checks.
    for key, info in obj.items():
        if type(info) is not dict or len(info) != 3 or not ("dtype" in info and "shape" in info and "data_offsets" in info):
            where = f"{name}, tensor {key!r}"
            if not isinstance(info, dict):
                raise CorruptCheckpointError(f"{where}: entry is not an object")
            raise CorruptCheckpointError(
                f"{where}: entry must have exactly dtype, shape and data_offsets, has {sorted(info)}"
            )
        dtype_str = info["dtype"]
        seen = known.get(dtype_str) if type(dtype_str) is str else None
        if seen is None:
            dtype = dtype_from_name(dtype_str, where=f"{name}, tensor {key!r}")
            seen = known[dtype_str] = (dtype, itemsize(dtype))
        dtype, item = seen
        shape = quick_shape(info["shape"]) or _as_shape(info["shape"], where=f"{name}, tensor {key!r}")
        offsets = info["data_offsets"]
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or type(offsets[0]) is not int
            or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CorruptCheckpointError(
                f"{name}, tensor {key!r}: data_offsets {offsets!r} must be two non-negative, ordered integers"
            )
        begin, end = offsets
        if end > data_size:
            raise CorruptCheckpointError(
                f"{name}, tensor {key!r}: data_offsets {offsets!r} run past the end of the data "
                f"({data_size} bytes); the file is truncated or damaged"
            )
        expected = math.prod(shape) * item
        if end - begin != expected:
            where = f"{name}, tensor {key!r}"
            raise CorruptCheckpointError(
                f"{where}: data_offsets {offsets!r} hold {end - begin} bytes but dtype {dtype_str} "
                f"and shape {list(shape)} need {expected}; the file is damaged"
            )
        spans.append((begin, end, key))
        entries[key] = HeaderEntry(key, dtype, dtype_str, shape, data_start + begin, data_start + end, expected)
    spans.sort()
    cursor = 0
    for begin, end, key in spans:
        if begin < cursor:
            raise CorruptCheckpointError(
                f"{name}, tensor {key!r}: its bytes overlap the previous tensor's; the file is damaged or forged"
            )
        if begin > cursor:
            raise CorruptCheckpointError(
                f"{name}, tensor {key!r}: a hole of {begin - cursor} bytes precedes it; the file is damaged"
            )
        cursor = end
    if cursor != data_size:
        raise CorruptCheckpointError(
            f"{name}: {data_size - cursor} trailing bytes after the last tensor; "
            "the file is damaged or was appended to"
        )
    require_unique_keys(raw, counted, where=where)
    return SafetensorsHeader(entries, metadata, data_start, file_size)


def read_header(fd: int, file_size: int, *, name: str, max_header_bytes: int) -> SafetensorsHeader:
    """Read and validate the header of an open safetensors file.

    An OSError of the read (EIO from a failing disk: the kernel's message names no file)
    is raised as :class:`~shardpoint.errors.StorageError` naming ``name``.
    """

    def pread(n: int, offset: int) -> bytes:
        try:
            return os.pread(fd, n, offset)
        except OSError as exc:
            err = StorageError(
                f"{name}: reading the safetensors header failed: [Errno {exc.errno}] "
                f"{exc.strerror or exc}; the disk or file system reported an error. Check it "
                "(e.g. dmesg), then load again, or restore the file from a copy"
            )
            err.errno = exc.errno
            raise err from exc

    return read_header_with(pread, file_size, name=name, max_header_bytes=max_header_bytes)


def read_header_with(
    pread: Callable[[int, int], bytes], file_size: int, *, name: str, max_header_bytes: int
) -> SafetensorsHeader:
    """Read and validate a safetensors header through ``pread(n, offset)`` (a local file
    descriptor, or ranged reads of an object in a store)."""
    if file_size < 8:
        raise CorruptCheckpointError(
            f"{name} is {file_size} bytes, shorter than the 8-byte safetensors length prefix; "
            "the file is truncated"
        )
    prefix = pread(8, 0)
    (length,) = struct.unpack("<Q", prefix)
    if length > max_header_bytes:
        raise CorruptCheckpointError(
            f"{name}: header length {length} exceeds the {max_header_bytes}-byte limit; "
            f"the file is damaged or not safetensors{_other_format(prefix)}"
        )
    if 8 + length > file_size:
        raise CorruptCheckpointError(
            f"{name}: header length {length} runs past the end of the {file_size}-byte file; "
            f"the file is truncated or not safetensors{_other_format(prefix)}"
        )
    raw = pread(length, 8)
    if len(raw) != length:
        raise CorruptCheckpointError(f"{name}: file shrank while its header was read")
    return validate_header(raw, file_size, name=name)


def sniff(head: bytes | None) -> str | None:
    """``zip``, ``pickle`` or ``safetensors`` from a file's first bytes; None if unsure.

    >>> sniff(b"PK\\x03\\x04rest"), sniff(b"\\x80\\x04\\x95"), sniff(b"\\x02" + bytes(7) + b"{}")
    ('zip', 'pickle', 'safetensors')
    """
    if not head:
        return None
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:  # PROTO opcode
        return "pickle"
    if len(head) >= 9:
        (size,) = struct.unpack("<Q", head[:8])
        if head[8:9] == b"{" and 2 <= size <= _SNIFFED_HEADER_MAX:  # text ("metrics={") reads as exabytes
            return "safetensors"
    return None


_SNIFFED_HEADER_MAX = 100_000_000
"""The largest header a file's first bytes are taken as safetensors with (the default
``IOOptions.max_header_bytes``)."""


def _other_format(prefix: bytes) -> str:
    """What a file that fails as safetensors starts as, when its first bytes say so."""
    looks = sniff(prefix)
    if looks in ("zip", "pickle"):
        what = "a zip archive" if looks == "zip" else "a pickle"
        return (
            f" (it starts as {what}: a torch.save file under a .safetensors name? Rename it to "
            ".pt to read it as one)"
        )
    return ""
