"""``torch.save`` files and Hugging Face ``.bin`` shards, read one batch at a time.

- ``torch.save`` file: ``torch.load(weights_only=True, mmap=True)``. Tensors are views of
  the mapped file; a page is read when a tensor is used, and dropped again
  (``madvise(MADV_DONTNEED)``, Linux) once its batch is done, so resident memory stays
  about one batch. A file that needs a full unpickle is refused unless ``trust_pickle``.
  Files in the legacy (pre-1.6, non-zip) format cannot be mapped: they are loaded whole.
- HF ``.bin`` shards (``pytorch_model.bin.index.json``): the same, one shard at a time.

Used by ``convert`` / ``diff`` (through ``_sources.open.open_source``), by ``sp.load`` /
``load_into`` of ``.bin`` weights (``_load.pickled``), and by ``verify`` and ``inspect``.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap as _mmap
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._checkpoint import read_json_file
from .._format.detect import detect
from .._format.index import parse_index
from .._format.names import check_file_name
from .._source import list_directory
from .._storage.paths import member_path, missing_file_advice, open_regular
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingShardError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .contract import (
    TensorSource,
    as_descriptors,
    cast,
    components_from_object,
    meta_like,
    refuse_unfolding,
)

if TYPE_CHECKING:
    from .contract import Ref, SourceSpec

_MADV_DONTNEED = 4


def _mappings() -> list[tuple[int, int, int, str, str]]:
    """(start, end, file offset, inode, path) of each range mapped into this process
    (Linux's ``/proc/self/maps``; else none)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) >= 5:
                    lo, hi = parts[0].split("-")
                    path = parts[5].rstrip("\n") if len(parts) == 6 else ""
                    found.append((int(lo, 16), int(hi, 16), int(parts[2], 16), parts[4], path))
    except (OSError, ValueError):
        return []
    return found


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges where ``path`` is mapped into this process (Linux; else none)."""
    real = os.path.realpath(path)
    return [(lo, hi) for lo, hi, _, _, mapped in _mappings() if mapped == real]


def _inode_mappings(inode: int) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each range where the file with this inode number is
    mapped into this process, sorted (Linux; else none)."""
    return sorted((lo, hi, offset) for lo, hi, offset, ino, _ in _mappings() if ino == str(inode))


_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, then (after 22 bytes) the name and extra lengths."""


class ZipRecords:
    """The records of a zip-format ``torch.save`` file: where each one's bytes start, and
    their CRC-32, checked against a mapped tensor's storage the first time it is read.

    ``torch.load(mmap=True)`` maps the file and takes each storage's bytes from where the
    archive says its record lies; it never checks them. So a flipped bit, or a record
    stored compressed (``torch.save`` never compresses; a mapped load would read the
    deflated bytes as values), would load as wrong values without a word. Compressed and
    encrypted records are refused when the file is opened; every other record is checked
    against its CRC-32 when its storage is first read (zlib, a few GB/s).
    """

    def __init__(self, fd: int, path: str) -> None:
        self.path = path
        self.inode = os.fstat(fd).st_ino
        size = os.fstat(fd).st_size
        try:
            with os.fdopen(os.dup(fd), "rb") as file, zipfile.ZipFile(file) as archive:  # a ZipFile leaves a
                records = archive.infolist()                                            # file it was given open
        except Exception as exc:  # zipfile raises many kinds on a damaged archive
            raise CorruptCheckpointError(
                f"{path} is not a readable zip archive ({type(exc).__name__}: "
                f"{str(exc)[:200]}); the file is truncated or damaged. Restore it from a copy"
            ) from None
        self.starts: dict[int, tuple[str, int, int]] = {}
        """Where each record's bytes start in the file: (name, size, CRC-32)."""
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED or record.flag_bits & 1:
                raise CorruptCheckpointError(
                    f"{path}: record {record.filename!r} of the zip archive is "
                    f"{'encrypted' if record.flag_bits & 1 else 'compressed'}, which torch.save "
                    "never does; its bytes cannot be read as tensor values. The file is damaged "
                    "or forged: restore it from a copy"
                )
            head = os.pread(fd, _LOCAL_HEADER.size, record.header_offset)
            if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
                raise CorruptCheckpointError(
                    f"{path}: record {record.filename!r} of the zip archive has no local header "
                    "where the directory says; the file is damaged. Restore it from a copy"
                )
            name_len, extra_len = _LOCAL_HEADER.unpack(head)[1:]
            start = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if start + record.file_size > size:
                raise CorruptCheckpointError(
                    f"{path}: record {record.filename!r} of the zip archive runs past the end of "
                    "the file; the file is truncated. Restore it from a copy"
                )
            self.starts[start] = (record.filename, record.file_size, record.CRC)
        # Saved with torch.serialization.set_crc32_options(False), every CRC-32 is 0.
        self.recorded = any(crc for _, n, crc in self.starts.values() if n)
        self._checked: set[int] = set()
        self._ranges: list[tuple[int, int, int]] | None = None
        """This file's mappings, read once at the first check (the load that mapped it ran
        before; a shard's tensors are checked one call each)."""

    def check(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Check the storage of each (name, tensor) not checked before against its record's
        CRC-32; raise CorruptCheckpointError naming the tensor and the file where one differs.
        Nothing is checked where the mappings cannot be read (not Linux) or no CRC is recorded."""
        if not self.recorded:
            return
        todo = [
            (k, t)
            for k, t in named
            if t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in self._checked
        ]
        if not todo:
            return
        if self._ranges is None:
            self._ranges = _inode_mappings(self.inode)
        ranges = self._ranges
        if not ranges:
            return
        starts = [r[0] for r in ranges]
        for key, tensor in todo:
            ptr = tensor.untyped_storage().data_ptr()
            i = bisect.bisect_right(starts, ptr) - 1
            lo, hi, offset = ranges[i] if i >= 0 else (0, 0, 0)
            if not lo <= ptr < hi:
                continue  # not the file's bytes: made in memory by a trusted full unpickle
            record = self.starts.get(ptr - lo + offset)
            if record is None:
                raise CorruptCheckpointError(
                    f"{self.path}: the bytes of tensor {key!r} lie in no record of the zip "
                    "archive; the file is damaged or forged. Restore it from a copy"
                )
            rname, nbytes, crc = record
            if ptr + nbytes > hi or nbytes < tensor.untyped_storage().nbytes():
                raise CorruptCheckpointError(
                    f"{self.path}: record {rname!r} of the zip archive is smaller than the storage "
                    f"of tensor {key!r}; the file is damaged or forged. Restore it from a copy"
                )
            got = zlib.crc32((ctypes.c_char * nbytes).from_address(ptr)) if nbytes else 0
            if got != crc:
                raise CorruptCheckpointError(
                    f"{self.path}: the bytes of tensor {key!r} (record {rname!r}) do not match the "
                    f"CRC-32 the zip archive records for them ({got:08x}, recorded {crc:08x}); the "
                    "file is damaged. Restore it from a copy"
                )
            self._checked.add(ptr)


class _PageDropper:
    """Drops the resident pages of mapped tensors, only inside the file's own mapping.

    The mapping is private and never written, so dropped pages are simply read from the
    file again if touched; memory outside the mapping (anonymous) is never touched.
    """

    def __init__(self, path: str) -> None:
        self.ranges = _file_mappings(path)
        self._madvise = None
        if self.ranges:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                self._madvise = fn
            except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
                self.ranges = []

    def drop(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._madvise is None:
            return
        page = _mmap.PAGESIZE
        for tensor in tensors:
            storage = tensor.untyped_storage()
            start, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0:
                continue
            lo, hi = start // page * page, -(-(start + nbytes) // page) * page
            for mlo, mhi in self.ranges:
                a, b = max(lo, mlo), min(hi, mhi)
                if a < b:
                    self._madvise(a, b - a, _MADV_DONTNEED)


def _refusal_reason(exc: BaseException) -> str:
    """What ``weights_only`` refused, in torch's own words: the line naming the global
    (``Trying to load unsupported GLOBAL posix.system ...``), not torch's preamble, whose
    advice (re-run with ``weights_only=False``) is what must not be done with a stranger's
    file, and which was all a cut at 200 characters kept.

    >>> _refusal_reason(RuntimeError("Weights only load failed. In PyTorch 2.6, ... trusted source."
    ...     "\\n\\nTrying to load unsupported GLOBAL posix.system whose module posix is blocked.\\n\\nCheck the docs."))
    'Trying to load unsupported GLOBAL posix.system whose module posix is blocked'
    """
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip()
        return reason.split(". Please", 1)[0].split("\n", 1)[0].strip()
    for part in text.split("\n\n"):
        line = part.strip().split("\n", 1)[0].strip()
        if line and not line.startswith(("Weights only load failed", "Check the documentation", "Please file")):
            return line.removesuffix(".")[:300]
    return text.strip().split("\n", 1)[0][:200]


def torch_load(
    path: str, *, trust_pickle: bool, zip_only: bool = False
) -> tuple[Any, ZipRecords | None]:
    """Load a ``torch.save`` file mapped (zip format) or whole (legacy); (object, the zip's
    records to check tensors against: None for a legacy file, which is not mapped).

    Raises UnsafePickleError naming the file when it needs a full unpickle and
    ``trust_pickle`` is False; with ``zip_only`` a legacy file is refused before unpickling.
    The file is opened once: what is checked is what is loaded, whatever the path names
    meanwhile (through ``/proc/self/fd`` where there is one).
    """
    fd = open_regular(path, where=path)  # a FIFO or device would hang or never end
    try:
        return _load_open(fd, path, trust_pickle=trust_pickle, zip_only=zip_only)
    finally:
        os.close(fd)


def _load_open(
    fd: int, path: str, *, trust_pickle: bool, zip_only: bool
) -> tuple[Any, ZipRecords | None]:
    magic = os.pread(fd, 4, 0)
    records = None
    if magic == b"PK\x03\x04":
        mapped = True
        records = ZipRecords(fd, path)
    elif magic[:1] == b"\x80" and zip_only:
        raise UnsupportedFormatError(
            f"{path} is not a zip-format torch.save file (a legacy pre-1.6 pickle); sp.load reads "
            "only zip-format .bin/.pt weights. Convert it once: `shardpoint convert SRC DST` (it reads "
            "with weights_only=True, and asks for --trust-pickle only if the file needs more)"
        )
    elif magic[:1] == b"\x80":  # a pickle: the legacy (pre-1.6) torch.save format
        mapped = False
    else:
        raise UnsupportedFormatError(
            f"{path} is not a torch.save file (neither a zip archive nor a pickle); convert reads "
            "torch.save files, safetensors, Hugging Face .bin shards and DCP directories"
        )
    try:
        held = f"/proc/self/fd/{fd}"
        obj = torch.load(
            held if os.path.exists(held) else path,
            map_location="cpu",
            weights_only=not trust_pickle,
            mmap=mapped,
        )
    except pickle.UnpicklingError as exc:
        if trust_pickle or "Weights only load failed" not in str(exc):
            raise CorruptCheckpointError(
                f"{path} could not be unpickled: {_refusal_reason(exc)}"
            ) from None
        raise UnsafePickleError(
            f"{path} cannot be loaded with weights_only=True ({_refusal_reason(exc)}): reading "
            "it needs a full unpickle, which can run arbitrary code from the file, so it is "
            "refused. "
            + (
                "sp.load never runs a full unpickle; if you trust whoever wrote the file, convert "
                "it once with `shardpoint convert SRC DST --trust-pickle` and load DST"
                if zip_only
                else "Pass trust_pickle=True (CLI: --trust-pickle) only if you trust whoever wrote this file"
            )
        ) from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CorruptCheckpointError(
            f"{path} is not a readable torch.save file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); it may be truncated"
        ) from None
    return obj, records


class TorchSaveSource(TensorSource):
    """One ``torch.save`` file, mapped; tensors read (page-faulted) one batch at a time."""

    def __init__(self, spec: SourceSpec, notes: list[str]) -> None:
        obj, records = torch_load(spec.path, trust_pickle=spec.trust_pickle, zip_only=spec.zip_only)
        mapped = records is not None
        real, flat = components_from_object(obj, where=spec.path, allow_pickle=spec.trust_pickle)
        if not mapped:
            notes.append(
                f"{spec.path} is in the legacy (non-zip) torch.save format, which cannot be "
                "memory-mapped: it was loaded into memory whole"
            )
        super().__init__(spec, as_descriptors(real), flat, notes)
        self._tensors: dict[Ref, torch.Tensor] | None = {
            (c.name, n): c.tensors[n] for c in real for n in c.stored
        }
        self._dropper = _PageDropper(spec.path) if mapped else None
        self._records = records
        self._last: list[torch.Tensor] = []

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        assert self._tensors is not None, "source is closed"
        self._last = [self._tensors[r] for r in refs]
        if self._records is not None:
            self._records.check(
                [
                    (name or component, t)
                    for (component, name), t in zip(refs, self._last, strict=True)
                ]
            )
        return [cast(t, dtype) for t in self._last]

    def release(self) -> None:
        if self._dropper is not None:
            self._dropper.drop(self._last)
        self._last = []

    def close(self) -> None:
        self._tensors = None
        self._last = []


class BinShardsSource(TensorSource):
    """HF ``pytorch_model.bin.index.json`` + shards; one shard mapped at a time."""

    def __init__(self, spec: SourceSpec, notes: list[str]) -> None:
        self.spec = spec  # _load needs it before the dataclass fields are set
        directory = spec.path
        iname = spec.index or detect(list_directory(directory, "convert")).index
        if iname is None:
            raise CheckpointNotFoundError(
                f"{directory} holds no *.bin.index.json; it is not a directory of .bin shards"
            )
        where = os.path.join(directory, iname)
        index = parse_index(
            read_json_file(member_path(directory, iname, where=directory), where=where), where=where
        )
        self.directory = directory
        self._file_of: dict[str, str] = {}
        skeleton: dict[str, torch.Tensor] = {}
        # First pass: shapes and dtypes, one shard mapped at a time (no tensor data read).
        unfolded = 0
        for fname in sorted(set(index.weight_map.values())):
            shard = self._load(fname)[0]
            for key, tensor in shard.items():
                mapped = index.weight_map.get(key)
                if mapped is not None and mapped != fname:
                    raise CorruptCheckpointError(
                        f"{directory}: tensor {key!r} is stored in both {mapped!r} (where {iname} maps it) and "
                        f"{fname!r}; the checkpoint is ambiguous (transformers loads whichever copy it reads last)"
                    )
                if mapped is None:
                    continue  # not in the index: not read (a warning of verify names it)
                if not isinstance(tensor, torch.Tensor):
                    raise CorruptCheckpointError(f"{self._label(fname)}: {key!r} is not a tensor")
                skeleton[key] = meta_like(tensor.dtype, tensor.shape)
                self._file_of[key] = fname
            unfolded = refuse_unfolding(((k, t) for k, t in shard.items()
                                         if k in self._file_of and isinstance(t, torch.Tensor)),
                                        where=self._label(fname), spent=unfolded)  # one budget for all shards
            del shard
        missing = [k for k in index.weight_map if k not in skeleton]
        if missing:
            fname = index.weight_map[missing[0]]
            raise CorruptCheckpointError(
                f"{self._label(fname)}: tensor {missing[0]!r} is listed in {iname} but absent "
                f"from this file ({len(missing)} listed tensors are absent); the checkpoint is damaged"
            )
        components, flat = components_from_object(skeleton, where=directory, allow_pickle=False)
        super().__init__(spec, components, flat, notes)
        self._current: (
            tuple[str, dict[str, torch.Tensor], _PageDropper, ZipRecords | None] | None
        ) = None
        self._last: list[torch.Tensor] = []

    def _label(self, fname: str) -> str:
        return os.path.join(self.directory, fname)

    def _load(self, fname: str) -> tuple[dict[str, torch.Tensor], ZipRecords | None]:
        check_file_name(fname, where=self._label("pytorch_model.bin.index.json"))
        path = member_path(self.directory, fname, where=self.directory)
        if not os.path.exists(path):  # absent, or a dangling link
            raise MissingShardError(
                f"{path} is missing: the index lists it but it is not there; the checkpoint is "
                f"incomplete ({missing_file_advice(self.directory)})"
            )
        obj, records = torch_load(
            path, trust_pickle=self.spec.trust_pickle, zip_only=self.spec.zip_only
        )
        if not isinstance(obj, Mapping):
            raise CorruptCheckpointError(
                f"{path} holds a {type(obj).__name__}, not a state dict shard"
            )
        return dict(obj), records

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        out = []
        for _, name in refs:
            fname = self._file_of[name]
            if self._current is None or self._current[0] != fname:
                self.release()
                self._current = None  # unmap the previous shard before mapping the next
                shard, records = self._load(fname)
                self._current = (fname, shard, _PageDropper(self._label(fname)), records)
            source = self._current[1][name]
            if self._current[3] is not None:
                self._current[3].check([(name, source)])
            self._last.append(source)
            out.append(cast(source, dtype))
        return out

    def release(self) -> None:
        if self._current is not None:
            self._current[2].drop(self._last)
        self._last = []

    def close(self) -> None:
        self._current = None
        self._last = []
