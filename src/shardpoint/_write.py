"""Writing prepared components: plan files, stream tensors, indexes, manifest, commit."""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._format.dtypes import dtype_name
from ._format.index import index_name, render_index
from ._format.manifest import MANIFEST_NAME, ChunkRef, ComponentRecord, Manifest, TensorRecord
from ._format.names import check_file_name
from ._format.safetensors import TensorSpec, plan_file
from ._io.writes import FileWrite, write_files
from ._planning.shards import plan_shards, shard_file_names
from ._prepare import PreparedState, hf_sizes
from ._progress import byte_progress
from ._storage import Transaction, open_transaction
from ._version import __version__
from .errors import InvalidStateError


@dataclass(frozen=True)
class SaveInfo:
    """What a save wrote."""

    path: str
    save_id: str
    files: dict[str, int]
    """Data file name -> bytes."""
    tensor_bytes: int
    """Bytes of tensor data stored (aliases counted once)."""
    seconds: float


def json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user's metadata as plain JSON, refused early if it is not."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidStateError(f"metadata must be a dict of JSON values, not {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidStateError(f"metadata must hold only JSON values (no nan/inf): {exc}") from None


def file_metadata(save_id: str) -> dict[str, str]:
    """The ``__metadata__`` of every data file of a save: ``format`` as transformers
    expects, and the save id that ties the file to its manifest."""
    return {"format": "pt", "shardpoint.save_id": save_id}


def describe_tensors(
    tensors: Mapping[str, torch.Tensor], names: list[str]
) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """(safetensors dtype, shape, stored bytes) of each named tensor, worked out once: the
    file plans and the manifest records both need them."""
    out = {}
    for name in names:
        t = tensors[name]
        out[name] = (dtype_name(t.dtype, key=name), tuple(t.shape), t.nbytes)
    return out


def write_checkpoint(
    prepared: PreparedState,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int,
    overwrite: bool,
    metadata: dict[str, Any],
    durable: bool,
    progress: bool | None,
    extra_files: Mapping[str, bytes] | None = None,
    write: Callable[..., dict[tuple[str, str], int]] = write_files,
    storage_options: Mapping[str, Any] | None = None,
) -> SaveInfo:
    """Write ``prepared`` as an HF-layout checkpoint at ``path``, atomically.

    ``write`` moves the planned files' bytes (same signature as :func:`write_files`);
    ``convert`` passes one that produces each tensor only when its turn comes (its
    ``prepared`` holds ``meta`` descriptors, so planning costs no memory).

    ``extra_files`` (name -> bytes, e.g. ``config.json``) are written into the same
    temporary directory before the manifest, so they appear in the same commit.

    ``path`` may be an fsspec URL (``storage_options`` go to its filesystem): the files are
    then uploaded under the final prefix and the manifest last (see ``_storage/remote.py``).
    """
    started = time.perf_counter()
    save_id = uuid.uuid4().hex
    file_meta = file_metadata(save_id)
    writes: list[FileWrite] = []
    file_of: dict[tuple[str, str], str] = {}
    files: dict[str, int] = {}
    indexes: dict[str, bytes] = {}
    described: dict[str, dict[str, tuple[str, tuple[int, ...], int]]] = {}
    for comp in prepared.components:
        if not comp.stored:
            continue  # a component of JSON values only lives in the manifest
        info = described[comp.name] = describe_tensors(comp.tensors, comp.stored)
        sizes, storage = hf_sizes(comp)
        groups = plan_shards(sizes, max_shard_bytes, storage=storage)
        weight_map: dict[str, str] = {}
        for fname, group in zip(shard_file_names(comp.name, len(groups)), groups, strict=False):
            specs = []
            for key in group:
                specs.append(TensorSpec(key, *info[key]))
                weight_map[key] = file_of[(comp.name, key)] = fname
            plan = plan_file(specs, file_meta)
            tensors = tuple((k, comp.tensors[k], plan.ranges[k][0]) for k in group)
            writes.append(FileWrite(fname, plan.header, plan.size, tensors))
            files[fname] = plan.size
        if len(groups) > 1:
            indexes[index_name(comp.name)] = render_index(weight_map, comp.stored_bytes(), comp.parameter_count())

    extras = dict(extra_files or {})
    for name in extras:
        check_file_name(name, where=os.fspath(path))
        if name in files or name in indexes or name == MANIFEST_NAME:
            raise InvalidStateError(f"extra file {name!r} would replace a file of the checkpoint itself")
    total = prepared.total_bytes()
    txn = open_transaction(path, overwrite=overwrite, storage_options=storage_options)
    try:
        with byte_progress(total, f"saving {os.path.basename(os.fspath(path))}", progress) as advance:
            custom = None if write is write_files else write
            crcs = txn.write_files(writes, durable=durable, advance=advance, write=custom)
        for name, data in extras.items():
            txn.write_bytes(name, data, durable=durable)
        records: dict[str, ComponentRecord] = {}
        for comp in prepared.components:
            tensor_records = {}
            info = described.get(comp.name, {})
            for name in comp.stored:
                dtype, shape, _nbytes = info[name]
                fname = file_of[(comp.name, name)]
                chunk = ChunkRef(fname, name, (0,) * len(shape), shape, crcs[(fname, name)])
                tensor_records[name] = TensorRecord(dtype, shape, (chunk,))
            records[comp.name] = ComponentRecord(comp.tree, tensor_records, dict(comp.aliases))
        write_manifest(
            txn,
            prepared,
            records,
            files,
            indexes,
            save_id=save_id,
            layout="hf",
            world_size=1,
            metadata=metadata,
            durable=durable,
        )
        txn.commit(durable=durable)
    except BaseException:
        txn.abort()
        raise
    return SaveInfo(os.fspath(path), save_id, files, total, time.perf_counter() - started)


def write_manifest(
    txn: Transaction,
    prepared: PreparedState,
    records: dict[str, ComponentRecord],
    files: dict[str, int],
    indexes: dict[str, bytes],
    *,
    save_id: str,
    layout: str,
    world_size: int,
    metadata: dict[str, Any],
    durable: bool,
) -> None:
    """Write the indexes, then the manifest (the commit marker) into the transaction."""
    manifest = Manifest(
        save_id=save_id,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__,
        world_size=world_size,
        layout=layout,
        flat=prepared.flat,
        components=records,
        files=files,
        metadata=metadata,
    )
    for iname, data in indexes.items():
        txn.write_bytes(iname, data, durable=durable)
    txn.write_bytes(MANIFEST_NAME, manifest.to_json(), durable=durable)
