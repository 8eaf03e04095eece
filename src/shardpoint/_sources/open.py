"""Checkpoints of any format read one batch of tensors at a time (for convert and diff):
safetensors and DCP sources, and :func:`open_source`, which opens any path as the right one.

The :class:`~shardpoint._sources.contract.TensorSource` contract and the ``torch.save`` / HF
``.bin`` sources live in ``contract`` and ``pickled``. Here:

- safetensors (ours, HF directory or file): :class:`ReadBatch` reads each batch into fresh
  tensors (crc32c checked, chunks of ``chunked`` checkpoints assembled).
- DCP (``.metadata``, a pickle): refused unless ``trust_pickle``; then ``dcp.load`` of a
  batch of keys into empty tensors (transiently about twice the batch: DCP reads each
  stored chunk into a tensor of its own, then copies it).

Which one a path is, is decided once, by ``_format.detect`` (:func:`resolve_source`).
Every file opened inside a checkpoint directory (indexes, shards, a single ``.bin``/``.pt``,
DCP's ``.metadata`` and the data files it names) is first checked with
``_storage.paths.member_path`` (plain name, no link out of the directory except into a
Hugging Face cache repository's ``blobs/``) and ``open_regular`` (no FIFO, device or
directory); control files are size-capped before they are read.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._checkpoint import Checkpoint
from .._format.detect import DCP, HF_BIN, HF_FILE, HF_INDEX, SHARDPOINT, TORCH_SAVE
from .._format.dtypes import dtype_from_name
from .._options import current_options
from .._planning.chunks import overlapping_pair
from .._prepare import Component
from .._printable import printable
from .._read import ReadBatch
from .._source import detect_local, not_readable, open_checkpoint
from .._storage.paths import member_path, open_regular
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingShardError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .contract import (
    Ref,
    SourceSpec,
    TensorSource,
    as_descriptors,
    cast,
    components_from_object,
    meta_like,
)
from .pickled import BinShardsSource, TorchSaveSource

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
        batch = ReadBatch(self.ckpt, verify=True, warn_casts=False)  # the caller (convert) counts them
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
    """What DCP's ``.metadata`` says, checked before anything is read or allocated: every
    data file a plain name inside ``directory``, regular, each stored range inside its
    file; every tensor's chunks inside its size, not overlapping and covering it exactly
    (else part of it would be memory never read), and no tensor larger than the data
    files hold."""
    where = os.path.join(directory, ".metadata")
    infos = getattr(metadata, "storage_data", None)
    tensors = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(infos, dict) or not isinstance(tensors, dict):
        raise CorruptCheckpointError(f"{where}: its storage_data or state_dict_metadata is not a mapping; "
                                     "the .metadata is damaged")
    sizes: dict[Any, int] = {}
    names: set[Any] = {getattr(info, "relative_path", None) for info in infos.values()}
    for name in sorted(names, key=str):
        path = member_path(directory, name, where=where)
        file = os.path.join(directory, str(name))
        try:
            fd = open_regular(path, where=file)
        except FileNotFoundError:
            raise MissingShardError(
                f"{file} is missing: the DCP .metadata lists it but it is not there; the "
                "checkpoint is incomplete"
            ) from None
        try:
            sizes[name] = os.fstat(fd).st_size
        finally:
            os.close(fd)
    for index, info in infos.items():
        offset: Any = getattr(info, "offset", None)
        length: Any = getattr(info, "length", None)
        if not (_count(offset) and _count(length) and offset + length <= sizes[info.relative_path]):
            raise CorruptCheckpointError(
                f"{where}: {printable(str(index))[:200]} is stored at offset {printable(offset)}, length "
                f"{printable(length)} of {info.relative_path} ({sizes[info.relative_path]} bytes); "
                "the .metadata is damaged or the file truncated")
    held = sum(sizes.values())
    for fqn, md in tensors.items():
        size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
        if size is None:
            continue  # a non-tensor value (bytes): read by DCP itself
        label = f"{where}, tensor {printable(str(fqn))[:200]!r}"
        if not (isinstance(size, Sequence) and all(_count(n) for n in size) and isinstance(chunks, list)):
            raise CorruptCheckpointError(f"{label}: its size or chunks are malformed; the .metadata is damaged")
        numel = math.prod(size)
        if numel * md.properties.dtype.itemsize > held:
            raise CorruptCheckpointError(
                f"{label}: size {list(size)[:8]} needs more bytes than all its data files hold ({held}); "
                "the .metadata is damaged")
        boxes = [(tuple(getattr(c, "offsets", ())), tuple(getattr(c, "sizes", ()))) for c in chunks]
        fits = all(len(o) == len(n) == len(size) and all(_count(v) for v in (*o, *n))
                   and all(a + b <= d for a, b, d in zip(o, n, size, strict=True)) for o, n in boxes)
        if not fits or sum(math.prod(n) for _, n in boxes) != numel or overlapping_pair(boxes) is not None:
            raise CorruptCheckpointError(
                f"{label}: its chunks do not cover its size {list(size)[:8]} exactly (outside it, "
                "overlapping, or leaving part of it unstored); the .metadata is damaged")


def _count(value: object) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
                reader = _dcp_reader(self.spec.path, self._metadata)
                planner = DefaultLoadPlanner(allow_partial_load=True)
                if "no_dist" in inspect.signature(dcp.load).parameters:
                    dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
                else:  # torch < 2.7: dcp.load would run collectives whenever a process group is up
                    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

                    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointError:
            raise
        except Exception as exc:  # DCP's own reader (a seek past the end, a torn file)
            raise CorruptCheckpointError(
                f"{self.spec.path}: torch.distributed.checkpoint could not read its data "
                f"({type(exc).__name__}: {printable(str(exc))[:300]}); the checkpoint is damaged"
            ) from None

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


def resolve_source(path: str | os.PathLike[str], *, trust_pickle: bool = False,
                   as_named: bool = False) -> tuple[SourceSpec, list[str]]:
    """What to open for what the user named, as ``_format.detect`` decides; (spec, notes).

    A ``torch.save`` file with a ``.safetensors`` sibling of the same stem
    (``model.pt`` beside ``model.safetensors``) is read from the sibling: same tensors, no
    unpickling; with ``as_named`` (``diff``, which is asked whether the two are the same)
    the file named is read. A directory holding both safetensors and ``.bin`` files is read
    from the safetensors files.
    """
    location = os.fspath(path)
    if "://" in location:  # an fsspec URL (a local file:// one was resolved before)
        raise UnsupportedFormatError(
            f"{location}: convert and diff read local checkpoints only (and hf:// ones in the local cache); "
            "copy it to a local folder first, or read it with sp.load(url, storage_options=...)"
        )
    if not os.path.exists(location):
        raise CheckpointNotFoundError(f"{location} does not exist; nothing to read")
    found = detect_local(location)
    if found.named_file:
        if found.instead_of is not None and found.file is not None and not as_named:
            # The user named the .pt file; its sibling must stay beside it (same path rule).
            parent = os.path.dirname(location) or "."
            sibling = member_path(parent, found.file, where=parent)
            note = (
                f"reading {sibling} instead of {location}: a .safetensors file of the same stem "
                "sits beside it (same tensors, no unpickling); move it away to convert the "
                "pickle itself"
            )
            return SourceSpec(sibling, "safetensors", trust_pickle), [note]
        if found.kind == HF_FILE and found.instead_of is None:
            return SourceSpec(location, "safetensors", trust_pickle), []
        if found.kind == TORCH_SAVE or found.instead_of is not None:
            return SourceSpec(location, "torch-save", trust_pickle), []
        raise not_readable(location, found)
    if found.kind in (SHARDPOINT, HF_INDEX, HF_FILE):
        notes = []
        if found.skipped:
            notes.append(
                f"{location} holds both safetensors and .bin/.pt files; reading the safetensors files"
            )
        return SourceSpec(location, "safetensors", trust_pickle), notes
    if found.kind == DCP:
        return SourceSpec(location, "dcp", trust_pickle), []
    if found.kind == HF_BIN:
        return SourceSpec(location, "hf-bin", trust_pickle, index=found.index), []
    if found.kind == TORCH_SAVE and found.file is not None:
        return SourceSpec(member_path(location, found.file, where=location), "torch-save", trust_pickle), []
    raise not_readable(location, found)


def open_source(path: str | os.PathLike[str], *, trust_pickle: bool = False, as_named: bool = False) -> TensorSource:
    """Open any checkpoint convert and diff read (see the module docstring)."""
    spec, notes = resolve_source(path, trust_pickle=trust_pickle, as_named=as_named)
    return open_spec(spec, notes)


def open_spec(spec: SourceSpec, notes: list[str] | None = None) -> TensorSource:
    return _KINDS[spec.kind](spec, notes if notes is not None else [])
