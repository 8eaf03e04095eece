"""Opening a checkpoint for reading: ours (manifest) or a foreign HF safetensors one.

Everything is validated before any tensor memory is allocated: the manifest or index,
every file name (plain basenames that stay inside the directory), file sizes, and each
file's safetensors header (read once, when a tensor of that file is first needed).

A local checkpoint is read as one snapshot. Saves replace a checkpoint by an atomic
directory exchange (or move-aside + rename) and then delete the old directory, and a
``CheckpointManager`` deletes retired steps; so :func:`open_checkpoint` opens the
directory once (``O_DIRECTORY``) and, through that descriptor, the manifest or index and
every data file it names, before any tensor byte is read. Every later read (headers,
tensors, mmap, checksums) goes through those held descriptors: a load sees exactly the
committed version it opened, whatever is saved to or deleted from the path meanwhile. If
the directory is replaced or removed while it is being opened, the open starts over from
the path (a few times); a checkpoint that is gone for good is reported as removed.

What the path holds is decided by ``_format.detect`` (:func:`detect_local` feeds it a
local path's listing and a named file's first bytes); the opened checkpoint itself, its
held descriptors and validated headers, is a :class:`~shardpoint._checkpoint.Checkpoint`.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from typing import Any

from ._checkpoint import Checkpoint, Replaced, changing, read_json_at
from ._format.detect import (
    DCP,
    HEAD_BYTES,
    HF_BIN,
    HF_FILE,
    HF_INDEX,
    SHARDPOINT,
    TORCH_SAVE,
    UNCOMMITTED,
    UNKNOWN,
    Detected,
    detect,
)
from ._format.index import parse_index
from ._format.manifest import (
    MANIFEST_NAME,
    ChunkRef,
    ComponentRecord,
    TensorRecord,
    parse_manifest,
)
from ._format.names import is_tmp_name
from ._io.files import read_error
from ._options import current_options
from ._storage.fsspec_store import FsspecStore
from ._storage.local_recovery import hidden_sibling_message, missing_path_message, moved_aside
from ._storage.local_store import LocalStore
from ._storage.paths import member_path, missing_file_advice, open_regular
from ._storage.remote_store import RemoteStore
from ._storage.store import Store, open_store
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingShardError,
    StorageError,
    UnsupportedFormatError,
)

OPEN_TRIES = 5
"""How many times an open starts over when the directory is replaced while being opened."""


def _being_replaced(location: str) -> bool:
    """Whether a save is moving a previous version of ``location`` aside right now (where
    ``renameat2`` is missing, the path is absent between its two renames). The temporary
    directory of a first save, running or dead, says nothing of the kind: the path never
    existed, and the load is told so at once."""
    return bool(moved_aside(location))


def _from_headers(location: str, directory: str, kind: str, weight_map: dict[str, str] | None,
                  files: list[str], *, single_file: bool = False, store: RemoteStore | None = None,
                  sizes: dict[str, int] | None = None) -> Checkpoint:
    """A foreign HF checkpoint: one flat component ``model`` described by the headers."""
    ckpt = Checkpoint(location, directory, kind, {}, flat=True, single_file=single_file,
                      store=store, sizes=dict(sizes or {}))
    return _fill_from_headers(ckpt, weight_map, files)


def _fill_from_headers(ckpt: Checkpoint, weight_map: dict[str, str] | None, files: list[str]) -> Checkpoint:
    """Describe a foreign HF checkpoint's one flat component ``model`` from its headers."""
    location = ckpt.location
    ckpt.flat = True
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
    path: str | os.PathLike[str] | Store, storage_options: Mapping[str, Any] | None = None, *, lazy: bool = False
) -> Checkpoint:
    """Open a checkpoint directory (ours or HF) or a single ``.safetensors`` file, local or
    at an fsspec URL (``storage_options`` go to its filesystem), or the store a caller
    already resolved at its API edge (:func:`~shardpoint._storage.store.open_store`).

    A format-3 checkpoint's chunk tables are all read now, unless ``lazy``: then a load
    reads only those it needs (:meth:`Checkpoint.resolved`)."""
    store = open_store(path, storage_options) if isinstance(path, (str, os.PathLike)) else path
    ckpt = _OPENERS[type(store)](store)
    if not lazy:
        try:
            ckpt.expand_tables()
        except BaseException:
            ckpt.close()
            raise
    return ckpt


def _open_local(store: LocalStore) -> Checkpoint:
    """Open a local checkpoint as one snapshot, starting over if it is replaced meanwhile."""
    location = store.path
    base = os.path.basename(os.path.normpath(location))
    if is_tmp_name(base):
        raise IncompleteCheckpointError(hidden_sibling_message(location))
    existed = False
    for attempt in range(OPEN_TRIES):
        if attempt:
            time.sleep(0.005 * 2**attempt)
        try:
            ckpt = _open_local_once(location, retry=existed or attempt > 0)
        except Replaced:
            existed = True
            continue
        return ckpt
    if not os.path.lexists(location):
        raise gone_while_reading(location)
    raise StorageError(
        f"{location} was replaced {OPEN_TRIES} times while being opened (saves to it follow "
        "each other too fast to load a whole version); load it again, or load a fixed step"
    )


def _open_local_once(location: str, *, retry: bool) -> Checkpoint:
    if os.path.isfile(location):
        found = detect_local(location)
        if found.kind != HF_FILE or found.instead_of is not None:
            raise not_readable(location, found)
        # The user named this file: follow it if it is a link (as in a Hugging Face cache).
        directory, name = os.path.split(os.path.realpath(location))
        ckpt = Checkpoint(location, directory, "hf-file", {}, flat=True, single_file=True)
        try:
            ckpt.pin_directory()
            ckpt.open_all([name])
        except BaseException:
            ckpt.close()
            raise
        if name in ckpt._open_errors and isinstance(ckpt._open_errors[name], FileNotFoundError):
            ckpt.close()
            raise Replaced  # replaced between the check and the open
        return _fill_from_headers(ckpt, None, [name])
    try:
        dir_fd = os.open(location, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if retry or _being_replaced(location):
            raise Replaced from None
        raise CheckpointNotFoundError(missing_path_message(location)) from None
    except NotADirectoryError:
        if os.path.exists(location):  # a FIFO, socket or device, not a missing path
            raise CorruptCheckpointError(
                f"{location} is neither a directory nor a regular file (a FIFO, device or "
                "socket); shardpoint loads checkpoint directories and .safetensors files"
            ) from None
        raise CheckpointNotFoundError(missing_path_message(location)) from None
    ckpt = Checkpoint(location, location, "shardpoint", {}, flat=True)
    ckpt._adopt(dir_fd)
    try:
        return _fill_local(ckpt)
    except BaseException:
        ckpt.close()
        raise


def _fill_local(ckpt: Checkpoint) -> Checkpoint:
    """Read the manifest or index through the held directory and open every data file."""
    assert ckpt.dir_fd is not None
    location = ckpt.location
    names = os.listdir(ckpt.dir_fd)
    ckpt.names = names

    def control(name: str) -> bytes:
        where = os.path.join(location, name)
        member_path(location, name, where=location)  # the one path rule (links stay inside)
        try:
            return read_json_at(ckpt.dir_fd, name, where=where)  # type: ignore[arg-type]
        except FileNotFoundError:
            if _dangling(ckpt.dir_fd, name):  # missing for good, not being replaced
                raise MissingShardError(
                    f"{where} is a symbolic link to a file that does not exist ({os.readlink(where)}); "
                    f"{missing_file_advice(location)}"
                ) from None
            raise Replaced from None  # listed a moment ago: the directory is being deleted
        except CheckpointError:
            raise
        except OSError as exc:
            raise read_error(exc, where, "reading") from None

    found = detect(names)
    if found.kind == SHARDPOINT:
        where = os.path.join(location, MANIFEST_NAME)
        manifest = parse_manifest(control(MANIFEST_NAME), where=where)
        ckpt.attach_manifest(manifest)
        ckpt.open_all(list(manifest.files))
        return ckpt
    if found.kind == HF_FILE and found.file is not None:
        ckpt.kind = "hf-file"
        ckpt.open_all([found.file])
        return _fill_from_headers(ckpt, None, [found.file])
    if found.kind == HF_INDEX and found.index is not None:
        where = os.path.join(location, found.index)
        index = parse_index(control(found.index), where=where)
        files = list(dict.fromkeys(index.weight_map.values()))
        ckpt.kind = "hf-index"
        ckpt.open_all(files)
        return _fill_from_headers(ckpt, index.weight_map, files)
    if found.kind in (UNCOMMITTED, DCP, HF_BIN, TORCH_SAVE):
        raise not_readable(location, found)
    if changing(ckpt):
        raise Replaced  # a deletion in progress (it may have taken the manifest first)
    raise not_readable(location, found)


_PARTICIPLE = {"load": "loaded", "verify": "verified", "inspect": "inspected", "convert": "converted"}


def _dangling(dir_fd: int | None, name: str) -> bool:
    try:
        return dir_fd is not None and stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def gone_while_reading(location: str, doing: str = "load") -> CheckpointNotFoundError:
    """The error for a local path that existed when a ``doing`` ("load", "verify") began and
    is gone now."""
    if moved_aside(location):  # an overwrite interrupted between its two renames
        return CheckpointNotFoundError(missing_path_message(location))
    return CheckpointNotFoundError(
        f"{location} was removed (e.g. retired by a CheckpointManager's retention) while "
        f"being {_PARTICIPLE.get(doing, doing)}; {doing} a checkpoint that is still there"
    )


def list_directory(location: str, doing: str = "load") -> list[str]:
    """The names in a local directory the caller just saw, for a ``doing`` ("load",
    "verify"). One removed meanwhile (retention retiring a step while it is read) is
    :class:`CheckpointNotFoundError`; one that cannot be listed is :class:`StorageError`."""
    try:
        return os.listdir(location)
    except FileNotFoundError:
        raise gone_while_reading(location, doing) from None
    except OSError as exc:
        fix = (
            "make it readable and listable by this user" if exc.errno in (errno.EACCES, errno.EPERM)
            else "the disk or file system reported an error; check it (e.g. dmesg)"
        )
        err = StorageError(
            f"{location}: listing the directory failed: [Errno {exc.errno}] {exc.strerror or exc}; "
            f"{fix}, then {doing} again"
        )
        err.errno = exc.errno
        raise err from None


def detect_local(location: str) -> Detected:
    """:func:`~shardpoint._format.detect.detect` of an existing local path: a directory's
    listing (:func:`list_directory`), or a file's name, its directory's listing and its
    first bytes."""
    if os.path.isdir(location):
        try:
            return detect(list_directory(location))
        except StorageError as exc:
            if exc.errno != errno.ENOTDIR:
                raise
            # replaced by a file meanwhile: detected as the file it now is
    parent = os.path.dirname(location) or "."
    try:
        siblings = os.listdir(parent)
    except OSError:
        siblings = []
    head = None
    try:
        fd = open_regular(location, where=location)
    except (OSError, CheckpointError):
        pass  # not a regular file, unreadable: detected by name; the reader says what is wrong
    else:
        try:
            head = os.pread(fd, HEAD_BYTES, 0)
        except OSError:
            head = None
        finally:
            os.close(fd)
    return detect(siblings, file=os.path.basename(location), head=head)


def not_readable(location: str, found: Detected, *, remote: bool = False) -> CheckpointError:
    """The error for a path whose format (``found``) the caller does not read, naming it and
    saying what does."""
    if found.kind == UNCOMMITTED:
        return IncompleteCheckpointError(
            f"{location} {found.reason}. Load the previous checkpoint; the next save to this "
            "prefix (or CheckpointManager.save) replaces it"
        )
    if found.kind == DCP:
        return UnsupportedFormatError(
            f"{location} is a torch.distributed.checkpoint (DCP) directory, which shardpoint reads "
            "only through convert and diff with --trust-pickle (its .metadata is a pickle): "
            "`shardpoint convert SRC DST --trust-pickle` if you trust whoever wrote it, then use DST"
        )
    if found.kind in (HF_BIN, TORCH_SAVE) or found.instead_of is not None:
        what = "Hugging Face .bin shards" if found.kind == HF_BIN else "a torch.save (.bin/.pt) weights file"
        where = "on an object store, which is read only from local files" if remote else (
            "read by sp.load, sp.load_into, verify, inspect and convert, not here"
        )
        return UnsupportedFormatError(
            f"{location} holds {what}, {where}; convert it to safetensors with `shardpoint "
            "convert SRC DST` and use DST"
        )
    if found.named_file:
        return UnsupportedFormatError(f"{location} {found.reason}")
    inside = [] if remote else nested_checkpoints(location)
    hint = ""
    if inside:
        more = f" and {len(inside) - 3} more" if len(inside) > 3 else ""
        hint = (
            f". It holds checkpoints in subfolders ({', '.join(inside[:3])}{more}; a CheckpointManager "
            f"root or a Trainer output_dir): name one of them, e.g. {os.path.join(location, inside[-1])}"
        )
    return CheckpointNotFoundError(f"{location} {found.reason}{hint}")


def holds_checkpoint(location: str) -> bool:
    """Whether the directory ``location`` holds a checkpoint a reader would read, by the
    rules of ``_format.detect`` (False where it cannot be listed)."""
    try:
        names = os.listdir(location)
    except OSError:
        return False
    return detect(names).kind not in (UNKNOWN, UNCOMMITTED)


def nested_checkpoints(location: str, limit: int = 10_000) -> list[str]:
    """The subfolders of ``location`` that hold a checkpoint, by name in natural order
    (``step-9`` before ``step-10``); at most ``limit`` entries are looked at."""
    try:
        with os.scandir(location) as entries:
            names = [e.name for _, e in zip(range(limit), entries, strict=False) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    found = [n for n in names if holds_checkpoint(os.path.join(location, n))]
    return sorted(found, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def remote_listing(store: RemoteStore, doing: str) -> tuple[RemoteStore, dict[str, int], str | None]:
    """What a location on an object store holds: (the prefix holding its files, their sizes,
    the object's name when the location is a single ``.safetensors`` object, else None).

    Raises:
        CheckpointNotFoundError: nothing is there (``doing``: what there is then nothing to do).
    """
    if store.url.endswith(".safetensors"):
        info = store.info()
        if info is not None and info.get("type") == "file":
            parent, name = store.parent_and_name()
            return parent, {name: int(info.get("size") or 0)}, name
    elif store.url.endswith(".json"):
        info = store.info()
        if info is not None and info.get("type") == "file":  # an index or manifest named itself
            parent, name = store.parent_and_name()
            raise UnsupportedFormatError(
                f"{store.url} is one object, an index or manifest, not a checkpoint; give the prefix that holds "
                f"it: {parent.url}"
            )
    names = store.list()
    if not names:
        missing = getattr(store, "missing_bucket", lambda: None)()
        if missing is not None:
            raise CheckpointNotFoundError(
                f"{store.url}: the bucket {missing!r} does not exist; nothing to {doing}. Check the URL"
            )
        raise CheckpointNotFoundError(f"{store.url} holds no objects; nothing to {doing}")
    return store, names, None


def _open_remote(store: FsspecStore) -> Checkpoint:
    """Open a checkpoint under a prefix of an object store, or a single remote ``.safetensors``.

    A prefix holding ``shardpoint.pending`` but no manifest is a save that never committed:
    refused, never read as a Hugging Face checkpoint.
    """
    location = store.url
    holder, names, single = remote_listing(store, "load")
    if single is not None:
        return _from_headers(location, holder.url, "hf-file", None, [single], single_file=True,
                             store=holder, sizes=names)
    limit = current_options().io.max_json_bytes
    found = detect(names)
    if found.kind == SHARDPOINT:
        where = store.url_of(MANIFEST_NAME)
        try:
            raw = store.get(MANIFEST_NAME, limit=limit)
        except FileNotFoundError:  # listed, then gone: retention, or another save replacing it
            raise CheckpointNotFoundError(
                f"{where} was removed after the prefix was listed: the checkpoint was deleted or is being "
                "replaced by another save while this call read it; load it again (or another checkpoint)"
            ) from None
        manifest = parse_manifest(raw, where=where)
        ckpt = Checkpoint(location, location, "shardpoint", {}, manifest.flat, store=store, sizes=names)
        ckpt.attach_manifest(manifest)
        return ckpt
    if found.kind == HF_FILE and found.file is not None:
        return _from_headers(location, location, "hf-file", None, [found.file], store=store, sizes=names)
    if found.kind == HF_INDEX and found.index is not None:
        where = store.url_of(found.index)
        index = parse_index(store.get(found.index, limit=limit), where=where)
        files = list(dict.fromkeys(index.weight_map.values()))
        return _from_headers(location, location, "hf-index", index.weight_map, files,
                             store=store, sizes=names)
    raise not_readable(location, found, remote=True)


_OPENERS: dict[type, Callable[[Any], Checkpoint]] = {LocalStore: _open_local, FsspecStore: _open_remote}
"""How each kind of store opens a checkpoint: a local one as a snapshot of held descriptors,
one on an object store from one listing."""
