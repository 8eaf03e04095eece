"""A local directory as a :class:`~shardpoint._storage.store.Store`.

Its saves go through :class:`~shardpoint._storage.local.LocalTransaction` (temporary
sibling directory, fsync, ``renameat2``); its small files are replaced atomically (temp
file, fsync, rename, fsync of the directory); a child is deleted by renaming it to a hidden
``.<name>.tmp-del-<uuid>`` first, so a half-deleted child never reads as a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

from .._format.manifest import MANIFEST_NAME
from .._format.names import TMP_MARKER, is_tmp_name
from .._io.writes import FileWrite
from ..errors import StorageError
from .local import LocalTransaction
from .local_recovery import moved_aside, recover, recover_all
from .paths import read_small_file
from .posix import fsync_dir, write_small_file
from .transaction import Advance, Crcs

_DELETING = "del-"
"""What follows ``.<name>.tmp-`` in a child being deleted."""


class LocalStore:
    """A directory on a POSIX filesystem (it need not exist yet)."""

    tracks_versions = True
    small_reads_are_cheap = True
    shared_files = True
    """Ranks of a collective save may write parts of one file (a shared POSIX filesystem)."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.path = os.fspath(location)
        """The path as it was given (errors name it so)."""
        self.local_path: str = self.path
        self.location = Path(location)
        self.sole_writer = False
        """True once :meth:`locked` found no locks here: one writer per directory is then
        assumed, and :meth:`tidy` takes every dead-looking temporary directory for a dead save's."""

    def child(self, name: str) -> LocalStore:
        return LocalStore(self.location / name)

    def children(self) -> dict[str, bool]:
        if not self.location.is_dir():
            return {}
        return {
            e.name: os.path.isfile(os.path.join(e.path, MANIFEST_NAME))
            for e in os.scandir(self.location)
            if e.is_dir(follow_symlinks=False)  # a link is the user's, never a step of ours
        }

    def read_small(self, name: str, *, limit: int) -> bytes:
        where = str(self.location / name)
        return read_small_file(where, where=where, limit=limit)

    def replace_small(self, name: str, data: bytes) -> None:
        tmp = self.location / f".{name}{TMP_MARKER}{uuid.uuid4().hex}"
        try:
            write_small_file(str(tmp), data, durable=True)
            os.replace(tmp, self.location / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a disk that is full must not keep a torn file
            raise
        fsync_dir(self.location)

    def version(self, name: str) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.location / name, follow_symlinks=False)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def make(self) -> None:
        self.location.mkdir(parents=True, exist_ok=True)

    def missing_bucket(self) -> None:
        return None  # a directory that does not exist yet is a new run's root

    @contextlib.contextmanager
    def locked(self, wait_s: float) -> Iterator[None]:
        """An exclusive ``flock`` on the directory: managers in other processes (or other
        managers of this one) take turns to clean up, update pointers and apply retention."""
        fd = os.open(self.location, os.O_RDONLY | os.O_DIRECTORY)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        self.sole_writer = True  # no locks here: one writer per root is assumed
                        break
                    if time.monotonic() > deadline:
                        raise StorageError(
                            errno.EWOULDBLOCK,
                            f"another process has held the lock on {self.location} for "
                            f"{wait_s:.0f} s (another CheckpointManager saving into "
                            "this root, hung?); stop it, or give each run its own root",
                        ) from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # releases the lock

    def put_back_moved_aside(self) -> None:
        """Put back a child that an overwrite without ``renameat2`` moved aside and never
        moved the new copy in (a crash between the two renames): never lose a whole one."""
        if not self.location.is_dir():
            return
        try:
            names = os.listdir(self.location)
        except OSError:
            return
        for name in names:
            if is_tmp_name(name) and f"{TMP_MARKER}old-" in name:
                final = self.location / name[1:].partition(TMP_MARKER)[0]
                if not os.path.lexists(final) and moved_aside(final):
                    recover(final, no_locks_means_dead=True)  # the caller owns this directory

    def tidy(self, children: re.Pattern[str], small_files: Collection[str] = ()) -> None:
        """Saves' temporary directories go through
        :func:`~shardpoint._storage.local_recovery.recover_all` (those of saves still
        running, locked, are left alone; dead ones removed; a child moved aside by an
        interrupted overwrite put back); half-deleted children and torn small files are
        removed (the temporary files of :meth:`replace_small` for ``small_files``).
        ``children`` is for object stores (a local directory has no uncommitted
        children: a save's work is in its temporary directory)."""
        recover_all(self.location, no_locks_means_dead=self.sole_writer)
        for entry in os.scandir(self.location):
            name = entry.name
            if not is_tmp_name(name):
                continue
            torn = any(name.startswith(f".{small}{TMP_MARKER}") for small in small_files)
            if torn and not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            elif f"{TMP_MARKER}{_DELETING}" in name and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)

    def delete_tree(self) -> None:
        doomed = self.location.parent / f".{self.location.name}{TMP_MARKER}{_DELETING}{uuid.uuid4().hex}"
        try:
            os.rename(self.location, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def write_data_files(self, files: Sequence[FileWrite], *, durable: bool, advance: Advance,
                         local: Callable[..., Crcs]) -> Crcs:
        """Write planned files straight into this directory with ``local`` (a collective
        save's ranks write into the coordinator's temporary directory)."""
        return local(self.path, files, durable=durable, advance=advance)

    def open_transaction(self, *, overwrite: bool) -> LocalTransaction:
        return LocalTransaction(self.location, overwrite=overwrite)

    def writing_into(self, directory: str) -> LocalStore:
        return LocalStore(directory)
