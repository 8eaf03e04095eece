"""Checkpoints of any format read one batch of tensors at a time (for convert and diff).

A :class:`TensorSource` describes a checkpoint as components (name, JSON tree, stored
tensor names, aliases) whose tensors are ``meta`` descriptors (dtype and shape, no data),
and reads the tensors themselves only when asked, a few at a time. Nothing ever holds the
whole checkpoint in memory:

- ``torch.save`` file: ``torch.load(weights_only=True, mmap=True)``. Tensors are views of
  the mapped file; a page is read when a tensor is used, and dropped again
  (``madvise(MADV_DONTNEED)``, Linux) once its batch is done, so resident memory stays
  about one batch. A file that needs a full unpickle is refused unless ``trust_pickle``.
  Files in the legacy (pre-1.6, non-zip) format cannot be mapped: they are loaded whole.
- HF ``.bin`` shards (``pytorch_model.bin.index.json``): the same, one shard at a time.
- safetensors (ours, HF directory or file): :class:`ReadBatch` reads each batch into fresh
  tensors (crc32c checked, chunks of ``chunked`` checkpoints assembled).
- DCP (``.metadata``, a pickle): refused unless ``trust_pickle``; then ``dcp.load`` of a
  batch of keys into empty tensors (transiently about twice the batch: DCP reads each
  stored chunk into a tensor of its own, then copies it).

Every file opened inside a checkpoint directory (indexes, shards, a single ``.bin``/``.pt``,
DCP's ``.metadata`` and the data files it names) is first checked with
``_storage.paths.member_path`` (plain name, no link out of the directory except into a
Hugging Face cache repository's ``blobs/``) and ``open_regular`` (no FIFO, device or
directory); control files are size-capped before they are read.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap as _mmap
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._flatten import flatten_state
from ._format.companions import torch_weights_file
from ._format.dtypes import dtype_from_name, dtype_name
from ._format.index import parse_index
from ._format.manifest import MANIFEST_NAME
from ._format.names import check_file_name
from ._io.transfer import contiguous_cpu
from ._options import current_options
from ._prepare import Component, check_tensor, dedup, split_components
from ._read import ReadBatch
from ._source import Checkpoint, _read_json_file, open_checkpoint
from ._stateful import find_modules, make_to_state, parameter_names
from ._storage.paths import member_path, open_regular
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidStateError,
    MissingShardError,
    UnsafePickleError,
    UnsupportedFormatError,
)

BATCH_BYTES = 64 << 20
"""Tensors are read (and written, compared) in batches of about this many bytes; a larger
tensor is a batch of its own. Peak memory of convert / diff is about one batch."""

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

Ref = tuple[str, str]
"""(component, stored tensor name): how a tensor is asked for."""


@dataclass(frozen=True)
class SourceSpec:
    """Enough to open a source again (in a worker process): picklable."""

    path: str
    """The file or directory actually read."""
    kind: str
    """``torch-save``, ``hf-bin``, ``safetensors`` or ``dcp``."""
    trust_pickle: bool
    zip_only: bool = False
    """Read for ``sp.load`` / ``load_into``: only zip-format ``torch.save`` files (a legacy
    file is one big pickle), and refusals point at ``convert --trust-pickle``."""


@dataclass
class TensorSource:
    """An opened checkpoint of any supported format, read a batch at a time."""

    spec: SourceSpec
    components: list[Component]
    """Tensors are ``meta`` descriptors (stored dtype and shape); aliases included."""
    flat: bool
    """A flat state dict (the component ``model``), as ``sp.load`` would return it."""
    notes: list[str] = field(default_factory=list)
    """What a person should know about how the source was read (printed by the CLI)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """User metadata of a shardpoint checkpoint (carried over by convert)."""

    def describe(self) -> str:
        return {
            "torch-save": "torch.save file",
            "hf-bin": "Hugging Face .bin shards",
            "safetensors": "safetensors checkpoint",
            "dcp": "torch.distributed.checkpoint (DCP) directory",
        }[self.spec.kind]

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Contiguous CPU tensors for ``refs``, floating-point ones cast to ``dtype``.

        They stay valid until :meth:`release` (which a mapped source uses to drop pages).
        """
        raise NotImplementedError

    def release(self) -> None:
        """The tensors of the last :meth:`read` are no longer needed."""

    def close(self) -> None:
        """Drop every mapping and handle."""

    @contextlib.contextmanager
    def batch(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> Iterator[list[torch.Tensor]]:
        """``read`` as a context: the tensors are released when the block ends."""
        tensors = self.read(refs, dtype)
        try:
            yield tensors
        finally:
            del tensors
            self.release()

    def descriptor(self, ref: Ref) -> torch.Tensor:
        """The meta tensor (stored dtype and shape) of ``ref``."""
        for comp in self.components:
            if comp.name == ref[0]:
                return comp.tensors[ref[1]]
        raise KeyError(ref)


def cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as a contiguous CPU tensor, floating point cast to ``dtype``."""
    tensor = contiguous_cpu(tensor)
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def batches(sizes: Sequence[int], budget: int = BATCH_BYTES) -> list[list[int]]:
    """Split indexes of consecutive items into runs of at most ``budget`` bytes.

    >>> batches([10, 10, 30, 5], budget=20)
    [[0, 1], [2], [3]]
    """
    out: list[list[int]] = []
    total = 0
    for i, nbytes in enumerate(sizes):
        if out and out[-1] and total + nbytes <= budget:
            out[-1].append(i)
            total += nbytes
        else:
            out.append([i])
            total = nbytes
    return out


# ------------------------------------------------------------------------- components


def meta_like(dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def components_from_object(
    obj: Any, *, where: str, allow_pickle: bool
) -> tuple[list[Component], bool]:
    """Components of a loaded object, as ``save`` would store it (meta tensors allowed).

    Same flattening, checks and tied-weight dedup as ``save``; tensors keep their identity
    (real ones for mapped files, ``meta`` placeholders for DCP and shards).
    """
    if isinstance(obj, torch.Tensor) or not isinstance(obj, (Mapping, torch.nn.Module)):
        raise InvalidStateError(
            f"{where} holds a {type(obj).__name__}, not a state dict or a mapping of components; "
            "there is nothing to convert"
        )
    try:
        raw, flat = split_components(obj)
        to_state = make_to_state(parameter_names(find_modules(obj)))
        components = []
        for cname, value in raw.items():
            tree, tensors = flatten_state(
                value, path=cname, to_state=to_state, allow_pickle=allow_pickle
            )
            comp = Component(cname, tree, tensors)
            for name, tensor in tensors.items():
                if tensor.device.type == "meta":
                    dtype_name(tensor.dtype, key=name)
                else:
                    check_tensor(name, cname, tensor)
            dedup(comp)
            components.append(comp)
    except InvalidStateError as exc:
        raise InvalidStateError(f"{where}: {exc}") from None
    return components, flat


def as_descriptors(components: list[Component]) -> list[Component]:
    """The same components with every tensor replaced by a meta descriptor."""
    out = []
    for comp in components:
        metas = {n: meta_like(comp.tensors[n].dtype, comp.tensors[n].shape) for n in comp.stored}
        tensors = {n: metas[comp.aliases.get(n, n)] for n in comp.tensors}
        out.append(Component(comp.name, comp.tree, tensors, list(comp.stored), dict(comp.aliases)))
    return out


# ------------------------------------------------------------------- torch.save files

_MADV_DONTNEED = 4


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges where ``path`` is mapped into this process (Linux; else none)."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


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
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip()
        return reason.split(". Please", 1)[0].split("\n", 1)[0].strip()
    return text.strip().split("\n", 1)[0][:200]


def torch_load(path: str, *, trust_pickle: bool, zip_only: bool = False) -> tuple[Any, bool]:
    """Load a ``torch.save`` file mapped (zip format) or whole (legacy); (object, mapped).

    Raises UnsafePickleError naming the file when it needs a full unpickle and
    ``trust_pickle`` is False; with ``zip_only`` a legacy file is refused before unpickling.
    """
    fd = open_regular(path, where=path)  # a FIFO or device would hang or never end
    try:
        magic = os.pread(fd, 4, 0)
    finally:
        os.close(fd)
    if magic == b"PK\x03\x04":
        mapped = True
    elif magic[:1] == b"\x80" and zip_only:
        raise UnsupportedFormatError(
            f"{path} is not a zip-format torch.save file (a legacy pre-1.6 pickle); sp.load reads "
            "only zip-format .bin/.pt weights. If you trust whoever wrote it, convert it once: "
            "`shardpoint convert SRC DST --trust-pickle`"
        )
    elif magic[:1] == b"\x80":  # a pickle: the legacy (pre-1.6) torch.save format
        mapped = False
    else:
        raise UnsupportedFormatError(
            f"{path} is not a torch.save file (neither a zip archive nor a pickle); convert reads "
            "torch.save files, safetensors, Hugging Face .bin shards and DCP directories"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust_pickle, mmap=mapped)
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
    return obj, mapped


class TorchSaveSource(TensorSource):
    """One ``torch.save`` file, mapped; tensors read (page-faulted) one batch at a time."""

    def __init__(self, spec: SourceSpec, notes: list[str]) -> None:
        obj, mapped = torch_load(spec.path, trust_pickle=spec.trust_pickle, zip_only=spec.zip_only)
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
        self._last: list[torch.Tensor] = []

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        assert self._tensors is not None, "source is closed"
        self._last = [self._tensors[r] for r in refs]
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
        indexes = sorted(n for n in os.listdir(directory) if n.endswith(".bin.index.json"))
        iname = (
            "pytorch_model.bin.index.json"
            if "pytorch_model.bin.index.json" in indexes
            else indexes[0]
        )
        where = os.path.join(directory, iname)
        index = parse_index(
            _read_json_file(member_path(directory, iname, where=directory), where=where), where=where
        )
        self.directory = directory
        self._file_of: dict[str, str] = {}
        skeleton: dict[str, torch.Tensor] = {}
        # First pass: shapes and dtypes, one shard mapped at a time (no tensor data read).
        for fname in sorted(set(index.weight_map.values())):
            shard = self._load(fname)
            for key, tensor in shard.items():
                if index.weight_map.get(key) != fname:
                    continue  # not this shard's according to the index (as transformers reads it)
                if not isinstance(tensor, torch.Tensor):
                    raise CorruptCheckpointError(f"{self._label(fname)}: {key!r} is not a tensor")
                skeleton[key] = meta_like(tensor.dtype, tensor.shape)
                self._file_of[key] = fname
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
        self._current: tuple[str, dict[str, torch.Tensor], _PageDropper] | None = None
        self._last: list[torch.Tensor] = []

    def _label(self, fname: str) -> str:
        return os.path.join(self.directory, fname)

    def _load(self, fname: str) -> dict[str, torch.Tensor]:
        check_file_name(fname, where=self._label("pytorch_model.bin.index.json"))
        path = member_path(self.directory, fname, where=self.directory)
        if not os.path.exists(path):  # absent, or a dangling link
            raise MissingShardError(
                f"{path} is missing: the index lists it but it is not there; the checkpoint is "
                "incomplete (copy the file back or load another checkpoint)"
            )
        obj, _ = torch_load(path, trust_pickle=self.spec.trust_pickle, zip_only=self.spec.zip_only)
        if not isinstance(obj, Mapping):
            raise CorruptCheckpointError(
                f"{path} holds a {type(obj).__name__}, not a state dict shard"
            )
        return dict(obj)

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        out = []
        for _, name in refs:
            fname = self._file_of[name]
            if self._current is None or self._current[0] != fname:
                self.release()
                self._current = None  # unmap the previous shard before mapping the next
                self._current = (fname, self._load(fname), _PageDropper(self._label(fname)))
            source = self._current[1][name]
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


# ------------------------------------------------------------------------ safetensors


class SafetensorsSource(TensorSource):
    """A shardpoint checkpoint (any layout) or a Hugging Face safetensors directory / file."""

    def __init__(self, spec: SourceSpec, notes: list[str]) -> None:
        ckpt = open_checkpoint(spec.path)
        components = []
        for cname, rec in ckpt.components.items():
            tensors = {}
            for name, trec in rec.tensors.items():
                where = f"{ckpt.location}, tensor {name!r}"
                tensors[name] = meta_like(dtype_from_name(trec.dtype, where=where), trec.shape)
            for alias, stored in rec.aliases.items():
                if stored not in tensors:
                    raise CorruptCheckpointError(
                        f"{ckpt.location}: alias {alias!r} names tensor {stored!r}, which is not stored"
                    )
                tensors[alias] = tensors[stored]
            components.append(
                Component(cname, rec.tree, tensors, list(rec.tensors), dict(rec.aliases))
            )
        metadata = dict(ckpt.manifest.metadata) if ckpt.manifest is not None else {}
        super().__init__(spec, components, ckpt.flat, notes, metadata)
        self.ckpt: Checkpoint = ckpt

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        batch = ReadBatch(self.ckpt, verify=True)
        cpu = torch.device("cpu")
        out = [
            batch.new(self.ckpt.components[c].tensors[n], n, device=cpu, dtype=dtype)
            for c, n in refs
        ]
        batch.run(False)
        return out


# ----------------------------------------------------------------------------- DCP


def _dcp_reader(path: str, metadata: Any = None) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        """Reads the metadata pickle once, not once per batch."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata if metadata is not None else super().read_metadata(*args, **kwargs)

    return _Reader(path)


def _check_control_file(path: str, where: str) -> None:
    """A control file another library opens: a regular file, within the size cap."""
    fd = open_regular(path, where=where)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    limit = current_options().io.max_json_bytes
    if size > limit:
        raise CorruptCheckpointError(
            f"{where} is {size} bytes, over the {limit}-byte limit for this kind of file; "
            "refusing to read it (the file is damaged or forged)"
        )


def _check_dcp_files(directory: str, metadata: Any) -> None:
    """Every data file DCP's ``.metadata`` names: a plain name inside ``directory``, regular."""
    infos = getattr(metadata, "storage_data", None) or {}
    names: set[Any] = {getattr(info, "relative_path", None) for info in infos.values()}
    for name in sorted(names, key=str):
        path = member_path(directory, name, where=os.path.join(directory, ".metadata"))
        where = os.path.join(directory, str(name))
        try:
            os.close(open_regular(path, where=where))
        except FileNotFoundError:
            raise MissingShardError(
                f"{where} is missing: the DCP .metadata lists it but it is not there; the "
                "checkpoint is incomplete"
            ) from None


def _set_path(root: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    """Place ``value`` at ``path`` in nested dicts / lists (as DCP's planner rebuilds state)."""
    node: Any = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        nxt: Any = value if last else ([] if isinstance(path[i + 1], int) else {})
        if isinstance(key, int) and isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if last or node[key] is None:
                node[key] = nxt
            node = node[key]
        else:
            if last or key not in node:
                node[key] = nxt
            node = node[key]


def group_top_level_tensors(obj: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """torchtitan's layout, ``{**model_state_dict, "optimizer": {...}, "train_state": ...}``:
    the top-level tensors become the component ``model``; (new object, tensors moved).

    Only a mixed state is regrouped (some top-level tensors, some other entries) and only
    when no entry is already named ``model``; anything else is returned unchanged.

    >>> t = torch.zeros(1)
    >>> out, n = group_top_level_tensors({"w": t, "optimizer": {"lr": 1}})
    >>> list(out), list(out["model"]), n
    (['model', 'optimizer'], ['w'], 1)
    >>> group_top_level_tensors({"w": t})[1], group_top_level_tensors({"model": {}, "w": t})[1]
    (0, 0)
    """
    top = [k for k, v in obj.items() if isinstance(v, torch.Tensor)]
    if not top or len(top) == len(obj) or "model" in obj:
        return obj, 0
    out: dict[str, Any] = {"model": {k: obj[k] for k in top}}
    out.update((k, v) for k, v in obj.items() if not isinstance(v, torch.Tensor))
    return out, len(top)


class DCPSource(TensorSource):
    """A torch.distributed.checkpoint directory (needs ``trust_pickle``)."""

    def __init__(self, spec: SourceSpec, notes: list[str]) -> None:
        if not spec.trust_pickle:
            raise UnsafePickleError(
                f"{os.path.join(spec.path, '.metadata')} is a pickle (this is a "
                "torch.distributed.checkpoint directory); reading it runs arbitrary code, so it "
                "is refused. Pass trust_pickle=True (CLI: --trust-pickle) only if you trust "
                "whoever wrote this checkpoint"
            )
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        where = os.path.join(spec.path, ".metadata")
        # The same path rule and size cap as every control file, before DCP opens it.
        _check_control_file(member_path(spec.path, ".metadata", where=spec.path), where)
        try:
            metadata = _dcp_reader(spec.path).read_metadata()
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{where} could not be read: {type(exc).__name__}: {exc}"
            ) from None
        _check_dcp_files(spec.path, metadata)
        self._metadata = metadata
        self.spec = spec  # _dcp_load needs it before the dataclass fields are set
        planner_data = getattr(metadata, "planner_data", None) or {}
        placeholders: dict[str, torch.Tensor] = {}
        values: dict[str, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                placeholders[fqn] = meta_like(md.properties.dtype, tuple(md.size))
            else:
                values[fqn] = None
        if values:
            self._dcp_load(values)  # non-tensor values (pickles in DCP): small, loaded now
        obj: dict[str, Any] = {}
        for fqn in metadata.state_dict_metadata:
            value = placeholders.get(fqn, values.get(fqn))
            _set_path(obj, planner_data.get(fqn, (fqn,)), value)
        obj, grouped = group_top_level_tensors(obj)
        if grouped:
            notes.append(
                f"DCP: the {grouped} tensor{'s' if grouped != 1 else ''} at the top level beside "
                f"nested entries (torchtitan's layout) form the component 'model'; the other "
                f"top-level entries ({', '.join(repr(k) for k in obj if k != 'model')}) are "
                "components of their own (select some with --component)"
            )
        components, flat = components_from_object(obj, where=spec.path, allow_pickle=True)
        fqn_of = {id(t): fqn for fqn, t in placeholders.items()}
        self._refs: dict[Ref, str | torch.Tensor] = {}
        for comp in components:
            for name in comp.stored:
                t = comp.tensors[name]
                self._refs[(comp.name, name)] = fqn_of.get(id(t), t)
        notes.append(
            "DCP: each batch of tensors is read by torch.distributed.checkpoint.load into "
            "empty tensors (transiently about twice the batch in memory); int keys of nested "
            "dicts come back as strings, as DCP stores them"
        )
        super().__init__(spec, as_descriptors(components), flat, notes)

    def _dcp_load(self, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
            dcp.load(
                state,
                storage_reader=_dcp_reader(self.spec.path, self._metadata),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        wanted: dict[str, Any] = {}
        for ref in refs:
            src = self._refs[ref]
            if isinstance(src, str):
                desc = self.descriptor(ref)
                wanted[src] = torch.empty(desc.shape, dtype=desc.dtype)
        if wanted:
            self._dcp_load(wanted)
        out = []
        for ref in refs:
            src = self._refs[ref]
            out.append(cast(wanted[src] if isinstance(src, str) else src, dtype))
        return out


# ---------------------------------------------------------------------------- opening

_KINDS: dict[str, Callable[[SourceSpec, list[str]], TensorSource]] = {
    "torch-save": TorchSaveSource,
    "hf-bin": BinShardsSource,
    "safetensors": SafetensorsSource,
    "dcp": DCPSource,
}


def resolve_source(path: str | os.PathLike[str]) -> tuple[str, str, list[str]]:
    """(path to read, kind, notes) for what the user named.

    A ``torch.save`` file with a ``.safetensors`` sibling of the same stem
    (``model.pt`` beside ``model.safetensors``) is read from the sibling: same tensors, no
    unpickling. A directory holding both safetensors and ``.bin`` files is read from the
    safetensors files.
    """
    location = os.fspath(path)
    if os.path.exists(location) and not os.path.isdir(location):
        if location.endswith(".safetensors"):
            return location, "safetensors", []
        stem, _ = os.path.splitext(location)
        sibling = stem + ".safetensors"
        if os.path.isfile(sibling):
            # The user named the .pt file; its sibling must stay beside it (same path rule).
            parent = os.path.dirname(location) or "."
            member_path(parent, os.path.basename(sibling), where=parent)
            note = (
                f"reading {sibling} instead of {location}: a .safetensors file of the same stem "
                "sits beside it (same tensors, no unpickling); move it away to convert the "
                "pickle itself"
            )
            return sibling, "safetensors", [note]
        return location, "torch-save", []
    if not os.path.isdir(location):
        raise CheckpointNotFoundError(f"{location} does not exist; nothing to read")
    names = os.listdir(location)
    has_safetensors = MANIFEST_NAME in names or any(n.endswith(".safetensors") for n in names)
    bins = [n for n in names if n.endswith(".bin.index.json")]
    torch_files = sorted(n for n in names if n.endswith(TORCH_SAVE_SUFFIXES))
    if has_safetensors:
        notes = []
        if bins or torch_files:
            notes.append(
                f"{location} holds both safetensors and .bin/.pt files; reading the safetensors files"
            )
        return location, "safetensors", notes
    if ".metadata" in names:
        return location, "dcp", []
    if bins:
        return location, "hf-bin", []
    if len(torch_files) == 1:
        return member_path(location, torch_files[0], where=location), "torch-save", []
    weights, _ = torch_weights_file(names)  # pytorch_model.bin beside training_args.bin, ...
    if weights is not None:
        return member_path(location, weights, where=location), "torch-save", []
    raise CheckpointNotFoundError(
        f"{location} is not a checkpoint convert can read: no shardpoint.json or .safetensors "
        "files, no DCP .metadata, no pytorch_model.bin.index.json and not exactly one "
        f".pt/.bin file (found {len(torch_files)})"
    )


def open_source(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> TensorSource:
    """Open any checkpoint convert and diff read (see the module docstring)."""
    real, kind, notes = resolve_source(path)
    return open_spec(SourceSpec(real, kind, trust_pickle), notes)


def open_spec(spec: SourceSpec, notes: list[str] | None = None) -> TensorSource:
    return _KINDS[spec.kind](spec, notes if notes is not None else [])
