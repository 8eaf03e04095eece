"""An opened checkpoint: what it holds and where each byte is, its files held open.

A :class:`Checkpoint` holds the checkpoint's directory open (``O_DIRECTORY``) and, through
that descriptor, every data file it names; every read (headers, tensors, mmap, checksums)
goes through those held descriptors, so a load sees exactly the committed version it
opened, whatever is saved to or deleted from the path meanwhile. Headers are validated
once, when a tensor of their file is first needed. ``_source.open_checkpoint`` makes one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import resource
import stat
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ._format.manifest import (
    MANIFEST_NAME,
    ChunkRef,
    ComponentRecord,
    Manifest,
    TensorRecord,
)
from ._format.names import check_file_name
from ._format.safetensors import HeaderEntry, SafetensorsHeader, read_header, read_header_with
from ._io.files import LocalFiles, read_error
from ._io.reads import ByteSource, ObjectRanges, header_reader
from ._options import current_options
from ._printable import printable
from ._rule_chunks import RuleChunks
from ._storage.paths import member_path, missing_file_advice, open_regular, read_small_file
from ._storage.remote_store import RemoteStore
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    MissingShardError,
    StorageError,
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
    dir_fd: int | None = None
    """The directory, opened once (local checkpoints opened by :func:`open_checkpoint`);
    every file is opened through it, so all reads see the version that was opened."""
    names: list[str] | None = None
    """The directory's listing, taken through ``dir_fd``."""
    _fds: dict[str, int] = field(default_factory=dict)
    """Data files opened (name -> descriptor), held until :meth:`close`."""
    _open_errors: dict[str, BaseException] = field(default_factory=dict)
    """Why a data file could not be opened (raised when the file is needed)."""
    _finalizer: Any = None
    rules: RuleChunks | None = None
    """Format 3: the writers' tables of rule-described tensors, read as they are needed."""
    _listed_count: dict[str, int] | None = None
    """Data file -> how many keys the manifest reads from it (made when a header is first read)."""

    def attach_manifest(self, manifest: Manifest) -> None:
        """Take ``manifest`` as what this checkpoint holds."""
        self.kind = "shardpoint"
        self.manifest = manifest
        self.components = manifest.components
        self.flat = manifest.flat
        if manifest.tables:
            self.rules = RuleChunks(manifest, self.location, lambda name, where: self.read_member(name, where=where))

    def expand_tables(self) -> None:
        """Read every table now and list every chunk in :attr:`components` (for the tools
        that look at everything; loads read only the tables they need)."""
        if self.rules is None or self.manifest is None:
            return
        listed = self.manifest.files
        self.components, files = self.rules.expand()
        self.manifest = dataclasses.replace(self.manifest, components=self.components, files=files)
        self.open_all([f for f in files if f not in listed])

    def resolved(
        self, record: TensorRecord, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> TensorRecord:
        """``record`` with its chunks listed: those overlapping the box (default: all) of a
        rule-described tensor not yet expanded; any other record as it is."""
        if record.rule is None or record.chunks or self.rules is None:
            return record
        return record._replace(chunks=self.rules.chunks(record, offsets, shape))

    @property
    def local_files(self) -> bool:
        """Whether the data files are local files held open (read with pread, mappable with
        mmap) rather than objects of a store (read with ranged requests)."""
        return self.store is None

    def held_fd(self, name: str) -> int:
        """The held descriptor of data file ``name`` (see :meth:`fd`); -1 on an object store,
        whose bytes are read with ranged requests."""
        return self.fd(name) if self.store is None else -1

    def byte_source(self, local_threads: int | None = None, processes_here: int = 1) -> ByteSource:
        """Where the read engine gets this checkpoint's bytes: its held local files (read by
        ``local_threads`` threads, default :func:`~shardpoint._io.threads.reader_threads` for
        ``processes_here`` processes on this machine) or ranged requests to its store
        (``RemoteOptions.threads`` at once)."""
        if self.store is not None:
            return ObjectRanges(self.store)
        return LocalFiles(threads=local_threads, processes_here=processes_here)

    def pin_directory(self) -> None:
        """Open the directory once; every file is then opened through it (idempotent)."""
        if self.dir_fd is not None or self.store is not None:
            return
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        self._adopt(fd)

    def _adopt(self, dir_fd: int) -> None:
        self.dir_fd = dir_fd
        self._finalizer = weakref.finalize(self, _close_all, self._fds, [dir_fd])

    def close(self) -> None:
        """Close the held descriptors (tensors already mapped from them stay valid)."""
        if self._finalizer is not None:
            self._finalizer()
        else:
            _close_all(self._fds, [])
        self.dir_fd = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, name: str) -> int:
        """The held read-only descriptor of data file ``name`` (opened now if it was not).

        Raises:
            MissingShardError: the file is not in the opened directory.
            CorruptCheckpointError: it is not a regular file.
        """
        with self._lock:
            fd = self._fds.get(name)
            error = self._open_errors.get(name)
        if fd is not None:
            return fd
        if error is not None:
            raise error
        path = self.file_path(name)
        where = self.file_label(name)
        try:
            fd = self._open_file(name, path, where)
        except FileNotFoundError:
            raise self._missing(name) from None
        with self._lock:
            if name in self._fds:  # another thread opened it meanwhile
                os.close(fd)
                return self._fds[name]
            self._fds[name] = fd
        return fd

    def _open_file(self, name: str, path: str, where: str) -> int:
        not_regular = CorruptCheckpointError(
            f"{where} is not a regular file (a FIFO, device, socket or directory); "
            "the checkpoint is damaged or forged"
        )
        try:
            if self.dir_fd is None:
                return open_regular(path, where=where)
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0), dir_fd=self.dir_fd)
        except FileNotFoundError:
            raise
        except OSError:
            # A socket cannot be opened at all (ENXIO); say what it is, not the errno.
            try:
                mode = os.stat(name, dir_fd=self.dir_fd).st_mode if self.dir_fd is not None else os.stat(path).st_mode
            except OSError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):
                raise not_regular from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise not_regular
        return fd

    def _missing(self, name: str) -> MissingShardError:
        where = self.file_label(name)
        others = self._unlisted_weights() if self.manifest is not None and not self.single_file else []
        if others:  # the folder was written over: say so, not "copy the file back"
            return MissingShardError(
                f"{where} is missing, and the folder holds {', '.join(repr(printable(o)) for o in others[:3])}, which "
                f"this save did not write: another program wrote into the folder after {MANIFEST_NAME}, which "
                "describes what was there before (transformers' save_pretrained into the same folder removes the "
                f"shards it does not write and leaves it so). If the folder was saved over on purpose, remove "
                f"{MANIFEST_NAME} to read what it now holds; else restore the checkpoint from a copy"
            )
        return MissingShardError(
            f"{where} is missing: the checkpoint lists it but it is not there; "
            f"the checkpoint is incomplete ({missing_file_advice(os.path.dirname(where))})"
        )

    def _unlisted_weights(self) -> list[str]:
        """The ``.safetensors`` files of the folder that its manifest does not list and that
        are named as its own are (``model.safetensors`` where it lists ``model-0000k-of-…``:
        another save of the same weights; an ``adapter_model.safetensors`` beside them is not)."""
        assert self.manifest is not None
        try:
            names = os.listdir(self.dir_fd if self.dir_fd is not None else self.location)
        except OSError:
            return []
        stems = {re.split(r"[-.]", n, maxsplit=1)[0] for n in self.manifest.files}
        return sorted(n for n in names if n.endswith(".safetensors") and n not in self.manifest.files
                      and re.split(r"[-.]", n, maxsplit=1)[0] in stems)

    def open_all(self, names: list[str]) -> None:
        """Open every data file in ``names`` now, through the held directory.

        A file that is absent is remembered and reported when it is needed, unless the
        directory itself was replaced or removed meanwhile: then :class:`Replaced` is
        raised so that the whole open starts over.
        """
        _raise_nofile_limit(len(names) + 64)
        for name in names:
            if name in self._fds or name in self._open_errors:
                continue
            try:
                self.fd(name)
            except MissingShardError as exc:
                if self.dir_fd is not None and changing(self, name):
                    raise Replaced from None
                with self._lock:
                    self._open_errors[name] = exc
            except CheckpointError as exc:
                with self._lock:
                    self._open_errors[name] = exc
            except OSError as exc:
                if exc.errno == errno.EMFILE:
                    raise StorageError(
                        f"{self.location}: cannot hold its {len(names)} files open at once "
                        f"({exc.strerror}); raise the open-files limit (ulimit -n) and load again"
                    ) from None
                with self._lock:
                    self._open_errors[name] = read_error(exc, self.file_label(name), "opening")

    def read_member(self, name: str, *, where: str) -> bytes:
        """A small control file of the directory (an index), size-capped: an object of the
        store, or a file read through ``dir_fd`` (the version that was opened)."""
        if self.store is not None:
            return self.store.get(name, limit=current_options().io.max_json_bytes)
        member_path(self.directory, name, where=self.location)  # the one path rule
        if self.dir_fd is None:
            return read_json_file(os.path.join(self.directory, name), where=where)
        return read_json_at(self.dir_fd, name, where=where)

    def listing(self) -> list[str]:
        """The names in the checkpoint's directory (prefix), as opened."""
        if self.store is not None:
            return sorted(self.sizes)
        return sorted(os.listdir(self.dir_fd if self.dir_fd is not None else self.directory))

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
        self.file_path(name)
        where = self.file_label(name)
        if self.store is not None:
            header = self._remote_header(name, where)
            self._check_unlisted(name, header, where)
            with self._lock:
                self._headers[name] = header
            return header
        fd = self.fd(name)
        size = os.fstat(fd).st_size
        try:
            self._check_size(name, size, where, "file")
        except CorruptCheckpointError:
            # Written over by another program (save_pretrained into the same folder)? Then say so.
            written: SafetensorsHeader | None = None
            with contextlib.suppress(CheckpointError, OSError):
                written = read_header(fd, size, name=where, max_header_bytes=current_options().io.max_header_bytes)
            if written is not None:
                self._check_save_id(written, where)
            raise
        try:
            header = read_header(fd, size, name=where, max_header_bytes=current_options().io.max_header_bytes)
        except CheckpointError:
            raise
        except OSError as exc:
            raise read_error(exc, where, "reading the header of") from None
        self._check_save_id(header, where)
        self._check_unlisted(name, header, where)
        with self._lock:
            self._headers[name] = header
        return header

    def _check_unlisted(self, name: str, header: SafetensorsHeader, where: str) -> None:
        """Refuse a data file of a manifest that holds a tensor the manifest does not list in
        it: a save writes none, and ``transformers`` (which loads every tensor of every file)
        would load that one, a second copy of a name or a new one, where shardpoint loads
        what the manifest lists. (Rule-described tensors of format 3 are listed per rank's
        table: their files are not checked here.)"""
        if self.manifest is None or self.rules is not None:
            return
        if self._listed_count is None:  # chunks per file: each (file, key) backs one chunk
            if len(self.manifest.files) == 1:
                self._listed_count = {name: sum(len(r.chunks) for c in self.components.values()
                                                for r in c.tensors.values())}
            else:
                self._listed_count = Counter(chunk.file for c in self.components.values()
                                             for r in c.tensors.values() for chunk in r.chunks)
        if len(header.entries) == self._listed_count.get(name, 0):
            return  # as many entries as listed keys: none unlisted (a listed key renamed is named by entry())
        listed_here = {chunk.key for c in self.components.values() for r in c.tensors.values()
                       for chunk in r.chunks if chunk.file == name}
        extra = [key for key in header.entries if key not in listed_here]
        if extra and all(key in header.entries for key in listed_here):  # else: a renamed key, named by entry()
            raise CorruptCheckpointError(unlisted_message(where, extra))

    def _remote_header(self, name: str, where: str) -> SafetensorsHeader:
        assert self.store is not None
        size = self.sizes.get(name)
        missing = MissingShardError(
            f"{where} is missing: the checkpoint lists it but the store does not have it "
            "(deleted?); the checkpoint is incomplete (upload the object again or load another checkpoint)"
        )
        if size is None:
            raise missing
        self._check_size(name, size, where, "object")
        try:
            header = read_header_with(
                header_reader(self.store, name, size), size, name=where,
                max_header_bytes=current_options().io.max_header_bytes,
            )
        except FileNotFoundError:
            raise missing from None
        self._check_save_id(header, where)
        return header

    def _check_size(self, name: str, size: int, where: str, what: str) -> None:
        """Refuse a data file whose size is not the one the manifest recorded."""
        expected = None if self.manifest is None else self.manifest.files.get(name)
        if expected is None and self.rules is not None:
            expected = self.rules.files.get(name)
        if expected is not None and size != expected:
            raise CorruptCheckpointError(
                f"{where} is {size} bytes but the manifest recorded {expected}; "
                f"the {what} is truncated, padded or from another save"
            )

    def replaced_meanwhile(self, names: Iterable[str]) -> str | None:
        """On an object store, the first of the data objects ``names`` that another save has
        written since this checkpoint was opened (its save id is no longer the manifest's),
        else None. A store reads no snapshot: an overwrite during a load replaces objects
        under it, one by one."""
        save_id_of = getattr(self.store, "save_id_of", None)
        if self.manifest is None or save_id_of is None:
            return None
        asked = [(n, self.sizes[n]) for n in sorted(set(names)) if n in self.sizes]
        if not asked:
            return None
        workers = max(1, min(len(asked), current_options().remote.threads))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardpoint-recheck") as pool:
            found = list(pool.map(lambda item: save_id_of(*item), asked))
        return next((n for (n, _), got in zip(asked, found, strict=True) if got != self.manifest.save_id), None)

    def _check_save_id(self, header: SafetensorsHeader, where: str) -> None:
        if self.manifest is not None:
            save_id = header.metadata.get("shardpoint.save_id")
            if save_id is None:  # every save writes its id into each of its files
                raise CorruptCheckpointError(
                    f"{where} carries no shardpoint save_id (the manifest's save is {self.manifest.save_id}): "
                    f"another program wrote it over this save's file after {MANIFEST_NAME}, which now describes "
                    "what was there before (transformers' save_pretrained into the same folder leaves it so). If "
                    f"the folder was saved over on purpose, remove {MANIFEST_NAME} to read what it now holds; "
                    "else restore the checkpoint from a copy"
                )
            if save_id != self.manifest.save_id:
                if self.store is not None:  # no snapshot on a store: most likely an overwrite meanwhile
                    raise CorruptCheckpointError(
                        f"{where} belongs to another save (save_id {printable(save_id)}, the manifest read says "
                        f"{self.manifest.save_id}): the checkpoint was replaced by another save while this call "
                        "read it (load it again), or a shard was swapped in from another checkpoint"
                    )
                raise CorruptCheckpointError(
                    f"{where} belongs to another save (save_id {printable(save_id)}, the manifest says "
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


def unlisted_message(where: str, extra: list[str]) -> str:
    """What is wrong with data file ``where`` holding tensors ``extra`` its manifest does not
    list in it (refused by loads, a problem for ``verify``)."""
    shown = ", ".join(printable(repr(k)) for k in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
    return (
        f"{where} holds {len(extra)} tensor(s) the manifest does not list in it ({shown}); a save writes "
        "none, and other readers (transformers loads every tensor of every file) would load them where "
        "shardpoint does not: the file was changed after its save. Restore it from a copy"
    )


def read_json_file(path: str, *, where: str) -> bytes:
    return read_small_file(path, where=where, limit=current_options().io.max_json_bytes)


def read_json_at(dir_fd: int, name: str, *, where: str) -> bytes:
    """A capped control file of the directory held open as ``dir_fd``."""
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    try:
        return _read_capped(fd, where)
    finally:
        os.close(fd)


def _read_capped(fd: int, where: str) -> bytes:
    limit = current_options().io.max_json_bytes
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise CorruptCheckpointError(
            f"{where} is not a regular file (a FIFO, device, socket or directory); "
            "the checkpoint is damaged or forged"
        )
    size = os.fstat(fd).st_size
    if size > limit:
        raise CorruptCheckpointError(
            f"{where} is {size} bytes, over the {limit}-byte limit for this kind of file; "
            "refusing to read it (the file is damaged or forged)"
        )
    data = os.pread(fd, limit + 1, 0)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{where} grew past the {limit}-byte limit while being read")
    return data


def _close_all(fds: dict[str, int], others: list[int]) -> None:
    for fd in [*fds.values(), *others]:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    others.clear()


def _raise_nofile_limit(needed: int) -> None:
    """Raise RLIMIT_NOFILE's soft limit toward the hard one when a load holds many files."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - not POSIX
        return
    if soft == resource.RLIM_INFINITY or needed + 64 <= soft:
        return
    want = needed + 256 if hard == resource.RLIM_INFINITY else min(hard, needed + 256)
    if want > soft:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class Replaced(Exception):
    """The directory being opened was replaced or removed meanwhile: start over."""


def _replaced(location: str, dir_fd: int) -> bool:
    """Whether ``location`` no longer names the directory held as ``dir_fd``."""
    held = os.fstat(dir_fd)
    if held.st_nlink == 0:
        return True  # removed (a retired step, the old version after an exchange)
    try:
        now = os.stat(location)
    except OSError:
        return True
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def changing(ckpt: Checkpoint, missing: str | None = None) -> bool:
    """Whether the directory held by ``ckpt`` is being replaced, removed or deleted file by
    file (``rm -r``, a manager retiring the step) right now.

    A committed checkpoint directory never changes: a ``missing`` file that was listed
    when the directory was opened (and is not a dangling link), or a listing that differs
    from that one within a few short waits, means a deletion in progress. A directory not
    modified for 2 s is not being deleted: its missing file is reported at once.
    """
    assert ckpt.dir_fd is not None
    before = set(ckpt.names or ())
    if _replaced(ckpt.location, ckpt.dir_fd):
        return True
    if missing is not None and missing in before:
        try:  # a dangling symlink is listed and cannot be opened: missing for good
            if stat.S_ISLNK(os.lstat(missing, dir_fd=ckpt.dir_fd).st_mode):
                return False
        except OSError:
            pass
        return True  # listed when the directory was opened, gone now: being deleted
    # A directory nobody touched for a while is not being deleted (an unlink updates its
    # mtime): the file is missing for good, reported at once.
    if time.time() - os.fstat(ckpt.dir_fd).st_mtime > 2.0:
        return False
    for delay in (0.0, 0.01, 0.03, 0.1):
        time.sleep(delay)
        if _replaced(ckpt.location, ckpt.dir_fd):
            return True
        try:
            if set(os.listdir(ckpt.dir_fd)) != before:
                return True
        except OSError:
            return True
    return False
