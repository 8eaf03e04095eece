"""Is a checkpoint whole? Check it without loading it.

``verify_checkpoint`` reads the manifest (or the HF index), then every data file: it exists,
has the recorded size, its safetensors header validates, and every tensor the manifest lists
sits in it with the recorded dtype and shape. With ``checksums=True`` it also streams the
stored bytes of every tensor through crc32c in bounded buffers (a few MiB per thread, never
a whole file) and compares with the crc recorded at save time.

It does not stop at the first bad file: every problem is collected, per file, each as one
line that names the file (and the tensor). Files in the directory that the checkpoint does
not account for are warnings, not problems. Foreign HF checkpoints record no crc32c, so only
their structure is verified, and the report says so.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable, Mapping
from typing import Any

from ._checkpoint import Checkpoint, unlisted_message
from ._format import detect as kinds
from ._format.detect import Detected, detect
from ._format.index import index_name, parse_index
from ._format.manifest import MANIFEST_NAME, PENDING_NAME, ChunkRef, Manifest
from ._format.names import is_tmp_name
from ._hub import resolve_hub
from ._source import detect_local, list_directory, not_readable, open_checkpoint, remote_listing
from ._storage.fsspec_store import FsspecStore
from ._storage.local_recovery import hidden_sibling_message, missing_path_message
from ._storage.local_store import LocalStore
from ._storage.remote_store import RemoteStore
from ._storage.store import open_store
from ._verify_crc import check_crcs, read_headers
from ._verify_pickled import verify_pickled
from ._verify_report import (
    CrcItem,
    Findings,
    VerifyReport,
    name_list,
    nbytes_of,
    unreferenced,
)
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
)

__all__ = ["VerifyReport", "verify_checkpoint"]


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    checksums: bool = True,
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check that a checkpoint is whole, without loading it; collect every problem.

    Args:
        path: checkpoint directory (shardpoint or HF) or a single ``.safetensors`` file,
            or an fsspec URL of either (``s3://bucket/run/step-100``; checksumming then
            streams every object through ranged reads), or ``hf://org/name[@revision]``
            (a repository in the local Hugging Face cache; ``storage_options`` may name its
            ``cache_dir``).
        storage_options: options of the URL's fsspec filesystem (see ``shardpoint.save``).
        checksums: also read every stored tensor and compare its crc32c (the slow part;
            ``False`` checks structure only: manifest, file sizes, headers, entries).
        progress: show a progress bar while checksumming (default: when stderr is a terminal).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when the checkpoint is whole.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no checkpoint at all.
        UnsafePickleError: a ``.bin`` / ``.pt`` file needs more than ``weights_only`` to be
            read (verify never unpickles it; ``sp.load`` would refuse it too).
        UnsupportedFormatError: a ``.bin`` / ``.pt`` file is not a zip-format ``torch.save``
            file (a legacy pickle, which ``sp.load`` refuses too).
        OSError: the directory itself cannot be listed.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = sp.save({"w": torch.ones(4)}, d)
        >>> report = verify_checkpoint(d)
        >>> report.ok, report.files_checked, report.bytes_checked
        (True, 1, 16)
    """
    path, storage_options = resolve_hub(path, storage_options)
    store = open_store(path, storage_options)
    return _VERIFIERS[type(store)](store, checksums=checksums, progress=progress)


def _verify_local(store: LocalStore, *, checksums: bool, progress: bool | None) -> VerifyReport:
    """``verify_checkpoint`` of a local directory or file."""
    location = store.path
    if not os.path.lexists(location):
        raise CheckpointNotFoundError(
            missing_path_message(location).replace("nothing to load", "nothing to verify")
        )
    base = os.path.basename(os.path.normpath(location))
    if os.path.isdir(location) and is_tmp_name(base):
        message = hidden_sibling_message(location)
        return VerifyReport(location, "shardpoint", [message], [], 0, 0, 0, False)
    if os.path.isfile(location):
        found = detect_local(location)
        if found.instead_of is not None and found.file is not None:
            sibling = os.path.join(os.path.dirname(location), found.file)
            note = (
                f"verified {sibling} instead of {location}: load reads the .safetensors file of "
                "the same stem beside it (same tensors, no unpickling)"
            )
            report = verify_checkpoint(sibling, checksums=checksums, progress=progress)
            return dataclasses.replace(report, notes=[note, *report.notes])
        if found.kind == kinds.TORCH_SAVE:
            return verify_pickled(
                location, os.path.dirname(location) or ".", None,
                [os.path.basename(location)], checksums=checksums, progress=progress,
            )
        if found.kind != kinds.HF_FILE:
            raise not_readable(location, found)
        # The user named this file: follow it if it is a link (as in a Hugging Face cache).
        directory, name = os.path.split(os.path.realpath(location))
        return _verify_foreign(location, directory, "hf-file", None, [name], checksums=checksums)
    if not os.path.isdir(location):
        raise CheckpointNotFoundError(f"{location} is neither a directory nor a checkpoint file")
    # A save overwriting the path swaps a new directory in, then empties the old one: what
    # this verification read of the old one may then be gone. The new one is judged instead.
    for _ in range(_REPLACED_TRIES - 1):
        before = _identity(location)
        try:
            report = _verify_directory(store, location, checksums=checksums, progress=progress)
        except (CheckpointError, OSError):
            if _identity(location) == before:
                raise
            continue
        if report.ok or _identity(location) == before:
            return report
    return _verify_directory(store, location, checksums=checksums, progress=progress)


_REPLACED_TRIES = 6
"""Verifications of a directory replaced (by an overwriting save) while being verified."""


def _identity(location: str) -> tuple[int, int] | None:
    """(device, inode) of the directory at ``location`` now (an overwrite swaps in another)."""
    try:
        st = os.stat(location)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _verify_directory(store: LocalStore, location: str, *, checksums: bool, progress: bool | None) -> VerifyReport:
    names = list_directory(location, "verify")
    _refuse_unreadable(location, names)
    found = detect(names)
    if found.kind == kinds.SHARDPOINT:
        return _verify_shardpoint(store, location, names, checksums=checksums, progress=progress)
    if found.kind == kinds.HF_BIN:
        return verify_pickled(location, location, found.index, [], checksums=checksums, listing=names,
                              progress=progress)
    if found.kind == kinds.TORCH_SAVE and found.file is not None:
        return verify_pickled(location, location, None, [found.file], checksums=checksums, listing=names,
                              progress=progress)
    if found.kind == kinds.UNCOMMITTED:
        return _uncommitted_report(location)
    kind, found_index, files = _foreign(location, found)
    return _verify_foreign(location, location, kind, found_index, files, checksums=checksums)


def _refuse_unreadable(location: str, names: list[str]) -> None:
    """Raise when this user may not read a file of the checkpoint: a permission says nothing
    of the bytes, so verify judges nothing (exit 2), rather than calling the checkpoint
    damaged and advising to restore it from a copy."""
    for name in names:
        path = os.path.join(location, name)
        if os.path.isfile(path) and not os.access(path, os.R_OK) and os.path.lexists(path):  # not just removed
            err = StorageError(
                f"{path}: this user may not read it (permission denied); make it readable (chmod, chown) "
                "or verify as a user who may. Nothing was judged"
            )
            err.errno = errno.EACCES
            raise err


# ------------------------------------------------------------------------ shardpoint


def _verify_remote(store: FsspecStore, *, checksums: bool, progress: bool | None) -> VerifyReport:
    """``verify_checkpoint`` for a prefix (or single ``.safetensors`` object) on a store."""
    location = store.url
    holder, sizes, single = remote_listing(store, "verify")
    if single is not None:
        return _verify_foreign(location, holder.url, "hf-file", None, [single], checksums=checksums,
                               store=holder, sizes=sizes)
    if MANIFEST_NAME in sizes:
        return _verify_shardpoint(store, location, list(sizes), checksums=checksums, progress=progress)
    found = detect(sizes)
    if found.kind == kinds.UNCOMMITTED:
        return _uncommitted_report(location)
    kind, index, files = _foreign(location, found, remote=True)
    return _verify_foreign(location, location, kind, index, files, checksums=checksums,
                           store=store, sizes=sizes)


def _verify_shardpoint(
    store: LocalStore | FsspecStore,
    location: str,
    names: list[str],
    *,
    checksums: bool,
    progress: bool | None,
) -> VerifyReport:
    try:
        ckpt = open_checkpoint(store)
    except CheckpointNotFoundError:
        raise
    except CheckpointError as exc:
        return VerifyReport(location, "shardpoint", [str(exc)], [], 0, 0, 0, False)
    except OSError as exc:
        where = os.path.join(location, MANIFEST_NAME)
        return VerifyReport(
            location, "shardpoint", [f"{where} cannot be read: {exc}"], [], 0, 0, 0, False
        )
    manifest = ckpt.manifest
    assert manifest is not None
    if ckpt.names is not None:
        names = ckpt.names  # the listing of the version that was opened
    found = Findings()

    # Which stored tensors each file must hold, in manifest order.
    chunks_in: dict[str, list[tuple[str, str, ChunkRef]]] = {f: [] for f in manifest.files}
    for cname, comp in manifest.components.items():
        for tname, record in comp.tensors.items():
            label = tname if ckpt.flat else f"{cname}/{tname}"
            for chunk in record.chunks:
                chunks_in[chunk.file].append((label, record.dtype, chunk))

    headers = read_headers(ckpt, list(manifest.files), chunks_in, found)
    tensors_checked = 0
    crc_items: list[CrcItem] = []
    no_crc = 0
    for fname, header in headers.items():
        claimed: set[str] = set()
        for label, dtype, chunk in chunks_in[fname]:
            claimed.add(chunk.key)
            try:
                entry = ckpt.entry(chunk, dtype, label)
            except CheckpointError as exc:
                found.problem(fname, str(exc))
                continue
            tensors_checked += 1
            if chunk.crc32c is None:
                no_crc += 1
            else:
                crc_items.append(CrcItem(fname, entry.start, entry.nbytes, chunk.crc32c, label))
        where = os.path.join(location, fname)
        extra = [key for key in header.entries if key not in claimed]
        if extra:  # format 3's rank files (the others' headers were refused as they were read)
            found.problem(fname, unlisted_message(where, extra))
        if header.metadata.get("format") != "pt":
            found.warnings.append(
                f'{where}: __metadata__ has no "format": "pt"; transformers refuses such files'
            )

    expected_indexes = _check_indexes(ckpt, manifest, names, found)
    accounted = {MANIFEST_NAME, *manifest.files, *expected_indexes, *manifest.table_files()}
    unchecked = unreferenced(
        found, location, names, accounted, "safetensors", "the manifest does not list it"
    )
    if no_crc:
        found.warnings.append(
            f"{location}: {no_crc} stored tensor(s) have no recorded crc32c; their bytes were not checked"
        )

    bytes_checked = 0
    if checksums and crc_items:
        bytes_checked = check_crcs(ckpt, crc_items, found, progress=progress)
    return VerifyReport(
        path=location,
        kind="shardpoint",
        problems=found.flat(list(manifest.files)),
        warnings=found.warnings,
        files_checked=len(manifest.files),
        tensors_checked=tensors_checked,
        bytes_checked=bytes_checked,
        checksums=checksums and not no_crc,
        unchecked=unchecked,
    )


def _check_indexes(
    ckpt: Checkpoint, manifest: Manifest, names: list[str], found: Findings
) -> set[str]:
    """Check each component's HF index against the manifest; return the index names expected."""
    location = ckpt.location
    expected: set[str] = set()
    if manifest.layout != "hf":
        return expected
    for cname, comp in manifest.components.items():
        weight_map = {t: rec.chunks[0].file for t, rec in comp.tensors.items()}
        total = sum(nbytes_of(rec.dtype, rec.shape) for rec in comp.tensors.values())
        iname = index_name(cname)
        where = os.path.join(location, iname)
        if len(set(weight_map.values())) <= 1 and iname not in names:
            continue
        expected.add(iname)
        if iname not in names:
            found.problem(
                "",
                f"{where} is missing; component {cname!r} is split over "
                f"{len(set(weight_map.values()))} files and transformers needs the index to find them",
            )
            continue
        try:
            raw = ckpt.read_member(iname, where=where)
            index = parse_index(raw, where=where)
        except CheckpointError as exc:
            found.problem("", str(exc))
            continue
        except OSError as exc:
            found.problem("", f"{where} cannot be read: {exc}")
            continue
        if index.weight_map != weight_map:
            wrong = sorted(set(index.weight_map.items()) ^ set(weight_map.items()))
            foreign = sorted(set(index.weight_map.values()) - set(manifest.files))
            why = ("the index is damaged" if not foreign else
                   f"it names files the manifest does not list ({name_list(foreign).split(' ', 1)[1]}): another "
                   "program saved into "
                   f"this folder after {MANIFEST_NAME}, which describes what was there before (transformers' "
                   f"save_pretrained leaves it so); if the folder was saved over on purpose, remove {MANIFEST_NAME} "
                   "to read what it now holds, else the index is damaged")
            found.problem(
                "",
                f"{where}: weight_map disagrees with the manifest on "
                f"{name_list(list(dict.fromkeys(k for k, _ in wrong)))}; {why}",
            )
            continue  # its total_size says the same again
        recorded = index.metadata.get("total_size")
        if recorded != total:
            found.problem(
                "",
                f"{where}: metadata.total_size is {recorded!r} but the manifest's tensors of "
                f"component {cname!r} hold {total} bytes; the index is damaged",
            )
    return expected


# ------------------------------------------------------------------------ foreign (HF)


def _uncommitted_report(location: str) -> VerifyReport:
    message = (
        f"{location} is a save that never committed ({PENDING_NAME} is there, {MANIFEST_NAME} "
        "is not); it is not a checkpoint. Verify the previous one, or save again"
    )
    return VerifyReport(location, "shardpoint", [message], [], 0, 0, 0, False)


def _foreign(location: str, found: Detected, *, remote: bool = False) -> tuple[str, str | None, list[str]]:
    """The HF safetensors checkpoint ``found`` names: (kind, index file or None, data files
    when there is no index); any other kind is refused, as load refuses it."""
    if found.kind == kinds.HF_INDEX and found.index is not None:
        return "hf-index", found.index, []
    if found.kind == kinds.HF_FILE and found.file is not None:
        return "hf-file", None, [found.file]
    raise not_readable(location, found, remote=remote)


def _verify_foreign(
    location: str,
    directory: str,
    kind: str,
    index: str | None,
    files: list[str],
    *,
    checksums: bool,
    store: RemoteStore | None = None,
    sizes: dict[str, int] | None = None,
) -> VerifyReport:
    found = Findings()
    ckpt = Checkpoint(location, directory, kind, {}, flat=True, store=store, sizes=dict(sizes or {}))
    # ``location`` is the data file itself: errors name it, not ``location/name``.
    ckpt.single_file = location != directory
    try:
        ckpt.pin_directory()  # the index and every file through one directory: one version
    except OSError as exc:
        return VerifyReport(location, kind, [f"{directory} cannot be opened: {exc}"], [], 0, 0, 0, False)
    weight_map: dict[str, str] | None = None
    if index is not None:
        where = os.path.join(location, index)
        try:
            raw = ckpt.read_member(index, where=where)
            weight_map = parse_index(raw, where=where).weight_map
        except CheckpointError as exc:
            return VerifyReport(location, kind, [str(exc)], [], 0, 0, 0, False)
        except OSError as exc:
            return VerifyReport(
                location, kind, [f"{where} cannot be read: {exc}"], [], 0, 0, 0, False
            )
        files = list(dict.fromkeys(weight_map.values()))

    listed: dict[str, list[tuple[str, str, ChunkRef]]] = {f: [] for f in files}
    if weight_map is not None:
        for key, fname in weight_map.items():
            listed[fname].append((key, "", ChunkRef(fname, key, (), (), None)))
    headers = read_headers(ckpt, files, listed, found)

    tensors_checked = 0
    seen_in: dict[str, str] = {}
    for fname, header in headers.items():
        where = os.path.join(location, fname) if location == directory else location
        for key in header.entries:
            if key in seen_in:
                found.problem(
                    fname,
                    f"{location}: tensor {key!r} is stored in both {seen_in[key]!r} and {fname!r}; "
                    "the checkpoint is ambiguous",
                )
            seen_in.setdefault(key, fname)
        if weight_map is None:
            tensors_checked += len(header.entries)
        else:
            unlisted = [k for k in header.entries if k not in weight_map]
            if unlisted:
                found.warnings.append(
                    f"{where} holds {name_list(unlisted)} that the index does not list; shardpoint does not "
                    "load them, transformers' from_pretrained does (it loads every tensor of a shard)"
                )
            for key, _, _ in listed[fname]:
                if key in header.entries:
                    tensors_checked += 1
                else:
                    found.problem(
                        fname,
                        f"{where}: tensor {key!r} is listed in the index but absent from this "
                        "file; the checkpoint is damaged",
                    )
        if header.metadata.get("format") not in ("pt", "tf", "flax", "mlx"):
            found.warnings.append(
                f'{where}: __metadata__ has no "format" (e.g. "pt"); transformers refuses such files'
            )

    unchecked: list[str] = []
    if location == directory:
        accounted = set(files) | ({index} if index else set())
        listing = ckpt.listing()
        why = "the index does not list it" if index else "another file was chosen"
        unchecked = unreferenced(found, location, listing, accounted, "safetensors", why)
    return found.report(
        location, kind, files, tensors_checked=tensors_checked, bytes_checked=0, checksums=False, unchecked=unchecked
    )


# ------------------------------------------------------------------------ stores


_VERIFIERS: dict[type, Callable[..., VerifyReport]] = {LocalStore: _verify_local, FsspecStore: _verify_remote}
"""How each kind of store is verified (a local path may also be a single file or a ``.bin``
checkpoint, read only from local files)."""
