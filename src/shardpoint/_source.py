"""Opening a checkpoint for reading: ours (manifest) or a foreign HF safetensors one.

Everything is validated before any tensor memory is allocated: the manifest or index,
every file name (plain basenames that stay inside the directory), file sizes, and each
file's safetensors header (read lazily, once, when a tensor of that file is needed).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._format.dtypes import DTYPE_TO_NAME
from ._format.index import parse_index
from ._format.manifest import (
    MANIFEST_NAME,
    ChunkRef,
    ComponentRecord,
    Manifest,
    TensorRecord,
    parse_manifest,
)
from ._format.names import check_file_name
from ._format.safetensors import HeaderEntry, SafetensorsHeader, read_header, read_header_with
from ._knobs import knobs
from ._storage.local import TMP_MARKER, hidden_sibling_message, missing_path_message
from ._storage.paths import member_path, open_regular, read_small_file
from ._storage.remote import PENDING_NAME, RemoteStore, header_reader, resolve
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingShardError,
)


@dataclass
class Checkpoint:
    """An opened checkpoint: what it holds and where each byte is."""

    location: str
    """The path the user gave (directory or single file)."""
    directory: str
    kind: str
    """``shardpoint``, ``hf-index`` or ``hf-file``."""
    components: dict[str, ComponentRecord]
    flat: bool
    manifest: Manifest | None = None
    single_file: bool = False
    """``location`` is the data file itself, not a directory."""
    store: RemoteStore | None = None
    """The prefix on an object store (fsspec URL) holding the files; None for local files."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Object sizes listed when a remote checkpoint was opened."""
    _headers: dict[str, SafetensorsHeader] = field(default_factory=dict)
    _paths: dict[str, str] = field(default_factory=dict)
    """Data files already checked by ``file_path`` (name -> path)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def file_path(self, name: str) -> str:
        """Absolute path of a data file, refusing names or symlinks that leave the directory.

        For a remote checkpoint: the object's name under ``store`` (a plain basename).
        """
        known = self._paths.get(name)
        if known is not None:
            return known
        check_file_name(name, where=self.location)
        if self.store is not None:
            return name
        path = member_path(self.directory, name, where=self.location)
        self._paths[name] = path
        return path

    def file_label(self, name: str) -> str:
        """How errors name data file ``name``: the path the user gave, joined with the name."""
        return self.location if self.single_file else os.path.join(self.location, name)

    def header(self, name: str) -> SafetensorsHeader:
        """The validated header of data file ``name`` (read once, then cached)."""
        cached = self._headers.get(name)  # a dict lookup is atomic: no lock once it is there
        if cached is not None:
            return cached
        with self._lock:
            cached = self._headers.get(name)
        if cached is not None:
            return cached
        path = self.file_path(name)
        where = self.file_label(name)
        if self.store is not None:
            header = self._remote_header(name, where)
            with self._lock:
                self._headers[name] = header
            return header
        try:
            fd = _open_regular(path, where=where)
        except FileNotFoundError:
            raise MissingShardError(
                f"{where} is missing: the checkpoint lists it but it is not there; "
                "the checkpoint is incomplete (copy the file back or load another checkpoint)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if self.manifest is not None:
                expected = self.manifest.files.get(name)
                if expected is not None and size != expected:
                    raise CorruptCheckpointError(
                        f"{where} is {size} bytes but the manifest recorded {expected}; "
                        "the file is truncated, padded or from another save"
                    )
            header = read_header(fd, size, name=where, max_header_bytes=knobs().max_header_bytes)
        finally:
            os.close(fd)
        self._check_save_id(header, where)
        with self._lock:
            self._headers[name] = header
        return header

    def _remote_header(self, name: str, where: str) -> SafetensorsHeader:
        assert self.store is not None
        size = self.sizes.get(name)
        missing = MissingShardError(
            f"{where} is missing: the checkpoint lists it but the store does not have it "
            "(deleted?); the checkpoint is incomplete (upload the object again or load another checkpoint)"
        )
        if size is None:
            raise missing
        if self.manifest is not None:
            expected = self.manifest.files.get(name)
            if expected is not None and size != expected:
                raise CorruptCheckpointError(
                    f"{where} is {size} bytes but the manifest recorded {expected}; "
                    "the object is truncated, padded or from another save"
                )
        try:
            header = read_header_with(
                header_reader(self.store, name, size), size, name=where,
                max_header_bytes=knobs().max_header_bytes,
            )
        except FileNotFoundError:
            raise missing from None
        self._check_save_id(header, where)
        return header

    def _check_save_id(self, header: SafetensorsHeader, where: str) -> None:
        if self.manifest is not None:
            save_id = header.metadata.get("shardpoint.save_id")
            if save_id is not None and save_id != self.manifest.save_id:
                raise CorruptCheckpointError(
                    f"{where} belongs to another save (save_id {save_id}, the manifest says "
                    f"{self.manifest.save_id}); a shard was swapped in from another checkpoint"
                )

    def entry(self, chunk: ChunkRef, dtype: str, label: str) -> HeaderEntry:
        """The header entry holding ``chunk``, checked against what the manifest says."""
        header = self.header(chunk.file)
        entry = header.entries.get(chunk.key)
        if entry is None:
            where = self.file_label(chunk.file)
            raise CorruptCheckpointError(
                f"{where}: tensor {label!r} (key {chunk.key!r}) is listed in the checkpoint's "
                "index/manifest but absent from this file; the checkpoint is damaged"
            )
        if entry.dtype_name != dtype or entry.shape != chunk.shape:
            where = self.file_label(chunk.file)
            raise CorruptCheckpointError(
                f"{where}: tensor {label!r} is {entry.dtype_name}{list(entry.shape)} in the file "
                f"but {dtype}{list(chunk.shape)} in the manifest; the checkpoint is damaged"
            )
        return entry


def _open_regular(path: str, *, where: str) -> int:
    return open_regular(path, where=where)


def _read_json_file(path: str, *, where: str) -> bytes:
    return read_small_file(path, where=where, limit=knobs().max_json_bytes)


def _from_headers(location: str, directory: str, kind: str, weight_map: dict[str, str] | None,
                  files: list[str], *, single_file: bool = False, store: RemoteStore | None = None,
                  sizes: dict[str, int] | None = None) -> Checkpoint:
    """A foreign HF checkpoint: one flat component ``model`` described by the headers."""
    ckpt = Checkpoint(location, directory, kind, {}, flat=True, single_file=single_file,
                      store=store, sizes=dict(sizes or {}))
    tensors: dict[str, TensorRecord] = {}
    seen_in: dict[str, str] = {}
    for fname in files:
        header = ckpt.header(fname)
        for key, entry in header.entries.items():
            if key in seen_in:
                raise CorruptCheckpointError(
                    f"{location}: tensor {key!r} is stored in both {seen_in[key]!r} and {fname!r}; "
                    "the checkpoint is ambiguous"
                )
            seen_in[key] = fname
            if weight_map is not None and weight_map.get(key) != fname:
                continue
            tensors[key] = TensorRecord(
                entry.dtype_name,
                entry.shape,
                (ChunkRef(fname, key, (0,) * len(entry.shape), entry.shape, None),),
            )
    if weight_map is not None:
        for key, fname in weight_map.items():
            if key not in tensors:
                raise CorruptCheckpointError(
                    f"{ckpt.file_label(fname)}: tensor {key!r} is listed in the index but "
                    "absent from this file; the checkpoint is damaged"
                )
        # Keep the index's order, as transformers does.
        tensors = {key: tensors[key] for key in weight_map}
    tree = {"type": "dict", "items": [["str", k, {"type": "tensor", "name": k}] for k in tensors]}
    ckpt.components["model"] = ComponentRecord(tree, tensors, {})
    return ckpt


def open_checkpoint(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Open a checkpoint directory (ours or HF) or a single ``.safetensors`` file, local or
    at an fsspec URL (``storage_options`` go to its filesystem)."""
    path, store = resolve(path, storage_options)
    if store is not None:
        return _open_remote(store)
    location = os.fspath(path)
    base = os.path.basename(os.path.normpath(location))
    if TMP_MARKER in base and base.startswith("."):
        raise IncompleteCheckpointError(hidden_sibling_message(location))
    if os.path.isfile(location):
        if not location.endswith(".safetensors"):
            raise CheckpointNotFoundError(
                f"{location} is a file but not a .safetensors file; shardpoint loads checkpoint "
                "directories and .safetensors files (convert other formats with `shardpoint convert`)"
            )
        # The user named this file: follow it if it is a link (as in a Hugging Face cache).
        directory, name = os.path.split(os.path.realpath(location))
        return _from_headers(location, directory, "hf-file", None, [name], single_file=True)
    if not os.path.isdir(location):
        raise CheckpointNotFoundError(missing_path_message(location))
    names = os.listdir(location)
    if MANIFEST_NAME in names:
        where = os.path.join(location, MANIFEST_NAME)
        path = member_path(location, MANIFEST_NAME, where=location)
        manifest = parse_manifest(_read_json_file(path, where=where), where=where)
        return Checkpoint(
            location, location, "shardpoint", manifest.components, manifest.flat, manifest
        )
    indexes = sorted(n for n in names if n.endswith(".safetensors.index.json"))
    singles = sorted(n for n in names if n.endswith(".safetensors"))
    if "model.safetensors.index.json" in indexes:
        indexes = ["model.safetensors.index.json"]
    if "model.safetensors" in singles:
        return _from_headers(location, location, "hf-file", None, ["model.safetensors"])
    if len(indexes) == 1:
        where = os.path.join(location, indexes[0])
        path = member_path(location, indexes[0], where=location)
        index = parse_index(_read_json_file(path, where=where), where=where)
        files = list(dict.fromkeys(index.weight_map.values()))
        return _from_headers(location, location, "hf-index", index.weight_map, files)
    if len(singles) == 1:
        return _from_headers(location, location, "hf-file", None, singles)
    if any(is_tmp(n) for n in names) and not singles:
        raise CheckpointNotFoundError(
            f"{location} holds no committed checkpoint, only the temporary directory of a save "
            "that did not finish"
        )
    raise CheckpointNotFoundError(
        f"{location} is not a checkpoint: no shardpoint.json, no *.safetensors.index.json and "
        f"no single .safetensors file (found {len(singles)} .safetensors files, {len(indexes)} indexes)"
    )


def is_tmp(name: str) -> bool:
    return name.startswith(".") and TMP_MARKER in name


def dtype_str(dtype: object) -> str:
    return DTYPE_TO_NAME.get(dtype, str(dtype))  # type: ignore[call-overload]


def _open_remote(store: RemoteStore) -> Checkpoint:
    """Open a checkpoint under a prefix of an object store, or a single remote ``.safetensors``.

    A prefix holding ``shardpoint.pending`` but no manifest is a save that never committed:
    refused, never read as a Hugging Face checkpoint.
    """
    location = store.url
    if location.endswith(".safetensors"):
        info = store.info()
        if info is not None and info.get("type") == "file":
            parent, name = store.parent_and_name()
            return _from_headers(location, parent.url, "hf-file", None, [name], single_file=True,
                                 store=parent, sizes={name: int(info.get("size") or 0)})
    names, _ = store.entries()
    if not names:
        raise CheckpointNotFoundError(f"{location} holds no objects; nothing to load")
    limit = knobs().max_json_bytes
    if MANIFEST_NAME in names:
        where = store.url_of(MANIFEST_NAME)
        manifest = parse_manifest(store.get(MANIFEST_NAME, limit=limit), where=where)
        return Checkpoint(location, location, "shardpoint", manifest.components, manifest.flat,
                          manifest, store=store, sizes=names)
    if PENDING_NAME in names:
        raise IncompleteCheckpointError(
            f"{location} is a save that never committed ({PENDING_NAME} is there, "
            f"{MANIFEST_NAME} is not): it was interrupted or is still running. Load the previous "
            "checkpoint; the next save to this prefix (or CheckpointManager.save) replaces it"
        )
    indexes = sorted(n for n in names if n.endswith(".safetensors.index.json"))
    singles = sorted(n for n in names if n.endswith(".safetensors"))
    if "model.safetensors.index.json" in indexes:
        indexes = ["model.safetensors.index.json"]
    if "model.safetensors" in singles:
        return _from_headers(location, location, "hf-file", None, ["model.safetensors"],
                             store=store, sizes=names)
    if len(indexes) == 1:
        where = store.url_of(indexes[0])
        index = parse_index(store.get(indexes[0], limit=limit), where=where)
        files = list(dict.fromkeys(index.weight_map.values()))
        return _from_headers(location, location, "hf-index", index.weight_map, files,
                             store=store, sizes=names)
    if len(singles) == 1:
        return _from_headers(location, location, "hf-file", None, singles, store=store, sizes=names)
    raise CheckpointNotFoundError(
        f"{location} is not a checkpoint: no shardpoint.json, no *.safetensors.index.json and "
        f"no single .safetensors file (found {len(singles)} .safetensors files, {len(indexes)} indexes)"
    )
