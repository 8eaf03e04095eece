"""Saving a state whose tensors are unchanged since a previous save, by linking its files.

When every stored tensor of the new state is byte-identical to what a committed checkpoint
already holds (same components, names, dtypes, shapes, aliases and crc32c of the bytes),
the new checkpoint hard-links that checkpoint's data files and indexes instead of writing
them again, and gets a manifest of its own (the JSON parts of the state may differ). It is
committed like any save: linked into a temporary sibling, manifest last, one rename.

The linked data files carry the ``save_id`` of the save that wrote them, so the new
manifest records that ``save_id`` too: it names the write of the data, which both
checkpoints share. Files are never modified after commit, so sharing inodes is safe;
deleting either checkpoint leaves the other whole.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ._checkpoint import Checkpoint
from ._checksum import crc32c
from ._format.dtypes import dtype_name
from ._format.index import index_name
from ._format.manifest import ComponentRecord, Manifest, TensorRecord
from ._io.memory import byte_view, contiguous_cpu
from ._prepare import PreparedState
from ._source import open_checkpoint
from ._storage.local_store import LocalStore
from ._write import SaveInfo, Written, commit_written
from .errors import CheckpointError


def _matching_records(
    prepared: PreparedState, manifest: Manifest
) -> dict[str, ComponentRecord] | None:
    """The new components' records, pointing at the previous files; None if any tensor differs.

    Names, dtypes, shapes and aliases are compared first (no data touched), then the crc32c
    of each tensor's bytes, stopping at the first difference.
    """
    if manifest.layout != "hf" or manifest.world_size != 1:
        return None
    new_names = {c.name for c in prepared.components if c.stored}
    old_names = {name for name, rec in manifest.components.items() if rec.tensors}
    if new_names != old_names:
        return None
    pending: list[tuple[Any, int]] = []
    records: dict[str, ComponentRecord] = {}
    for comp in prepared.components:
        old = manifest.components.get(comp.name)
        old_tensors = old.tensors if old is not None else {}
        old_aliases = old.aliases if old is not None else {}
        if set(comp.stored) != set(old_tensors) or dict(comp.aliases) != dict(old_aliases):
            return None
        tensor_records: dict[str, TensorRecord] = {}
        for name in comp.stored:
            tensor = comp.tensors[name]
            record = old_tensors[name]
            if (
                dtype_name(tensor.dtype, key=name) != record.dtype
                or tuple(tensor.shape) != record.shape
                or len(record.chunks) != 1
                or record.chunks[0].crc32c is None
            ):
                return None
            pending.append((tensor, record.chunks[0].crc32c))
            tensor_records[name] = record
        records[comp.name] = ComponentRecord(comp.tree, tensor_records, dict(comp.aliases))
    for tensor, expected in pending:
        if crc32c(byte_view(contiguous_cpu(tensor))) != expected:
            return None
    return records


def _link_files(ckpt: Checkpoint, manifest: Manifest, names: list[str], directory: str) -> bool:
    """Hard-link ``names`` of the opened ``ckpt`` into ``directory``; False if any cannot be
    linked as recorded.

    Each link is made through the directory descriptor the checkpoint holds, and each data
    file checked to be the very file it holds open: a save committed to the previous path
    meanwhile (an overwrite swaps in another directory) cannot give this checkpoint files of
    another version than the manifest about to be written describes.
    """
    if ckpt.dir_fd is None:
        return False
    try:
        for name in names:
            expected = manifest.files.get(name)
            held = os.fstat(ckpt.fd(name)) if expected is not None else None
            if held is not None and held.st_size != expected:
                return False
            link = os.path.join(directory, name)
            os.link(name, link, src_dir_fd=ckpt.dir_fd, follow_symlinks=False)
            if held is not None and not os.path.samestat(os.stat(link, follow_symlinks=False), held):
                return False
    except (CheckpointError, OSError):
        return False  # removed meanwhile, another filesystem, no hard links here
    return True


def link_unchanged(
    prepared: PreparedState,
    previous: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    save_id: str | None,
    overwrite: bool,
    metadata: dict[str, Any],
    durable: bool,
) -> SaveInfo | None:
    """Commit ``prepared`` at ``path`` by linking the data files of ``previous``.

    Returns None, having written nothing, when ``previous`` is not a committed checkpoint
    with ``save_id`` (when given) holding exactly these tensors, or when its files cannot
    be hard-linked (another filesystem, removed meanwhile): then save normally.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False.
    """
    started = time.perf_counter()
    try:
        ckpt = open_checkpoint(previous)
    except (CheckpointError, OSError):
        return None
    with ckpt:
        return _link_opened(prepared, ckpt, path, save_id=save_id, overwrite=overwrite, metadata=metadata,
                            durable=durable, started=started)


def _link_opened(
    prepared: PreparedState,
    ckpt: Checkpoint,
    path: str | os.PathLike[str],
    *,
    save_id: str | None,
    overwrite: bool,
    metadata: dict[str, Any],
    durable: bool,
    started: float,
) -> SaveInfo | None:
    manifest = ckpt.manifest
    if manifest is None or (save_id is not None and manifest.save_id != save_id):
        return None
    records = _matching_records(prepared, manifest)
    if records is None:
        return None
    names = list(manifest.files)
    if ckpt.names is None:
        return None
    names += [index_name(c) for c in manifest.components if index_name(c) in ckpt.names]
    txn = LocalStore(path).open_transaction(overwrite=overwrite)  # hard links: local files only
    try:
        if not _link_files(ckpt, manifest, names, txn.directory):
            txn.abort()
            return None
        # The indexes were linked with the data files: the stored names are the same.
        linked = Written(manifest.save_id, "hf", 1, records, dict(manifest.files), {})
        commit_written(txn, prepared, linked, metadata=metadata, durable=durable)
    except BaseException:
        txn.abort()
        raise
    total = prepared.total_bytes()
    return SaveInfo(
        os.fspath(path),
        manifest.save_id,
        dict(manifest.files),
        total,
        time.perf_counter() - started,
    )
