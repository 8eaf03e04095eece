"""Atomic checkpoint directories on a POSIX filesystem.

A save writes into a hidden sibling ``.<name>.tmp-<uuid>/``, fsyncs every file, writes the
indexes and then the manifest, fsyncs the directory and renames it into place, then fsyncs
the parent. On Linux the rename is ``renameat2``: ``RENAME_NOREPLACE`` so two saves of one
name cannot both win, and ``RENAME_EXCHANGE`` for ``overwrite=True`` so at every instant
either the old or the new checkpoint sits at the path.

A save holds an exclusive ``flock`` on its temporary directory until it commits or aborts,
so the next save of the same name can tell the leftovers of saves that died (no lock: it
removes them) from saves still running (locked: it leaves them alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from .._io.transfer import FileWrite, naming, write_files
from ..errors import CheckpointExistsError

TMP_MARKER = ".tmp-"
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2 = getattr(_libc, "renameat2", None)
except OSError:  # pragma: no cover - non-glibc platforms
    _renameat2 = None


def _rename2(src: str, dst: str, flags: int) -> bool:
    """renameat2; False when the kernel or filesystem does not support the flag."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with naming(os.fspath(path)):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_small_file(path: str, data: bytes, *, durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with naming(path):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
    finally:
        os.close(fd)


_SAVE_TMP = re.compile(r"[0-9a-f]{32}")
"""What follows ``.<name>.tmp-`` in the temporary directory of a save (its uuid)."""


def _lock(fd: int) -> bool | None:
    """flock ``fd`` without waiting: True, False when another process holds it, None where
    the filesystem has no locks (then nothing is ever removed as stale)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        return None
    return True


def _make_locked_temp(final: Path) -> tuple[str, int | None]:
    """Create ``.<name>.tmp-<uuid>`` and lock it; the fd is None where locks do not work."""
    for _ in range(5):
        directory = str(final.parent / f".{final.name}{TMP_MARKER}{uuid.uuid4().hex}")
        os.mkdir(directory)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # removed between mkdir and open, taken for a dead save's: start over
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(directory)
            raise
        locked = _lock(fd)
        if locked is None:
            os.close(fd)
            return directory, None
        # Between mkdir and flock another save may have taken it for a dead save's (it
        # holds the lock, or has removed it): start over under a new name.
        if locked and os.path.exists(directory) and os.path.samestat(os.fstat(fd), os.stat(directory)):
            return directory, fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "could not create and lock a temporary directory", str(final.parent))


def remove_dead_temps(final: Path, keep: str) -> None:
    """Remove the temporary directories of saves of ``final`` that died (nobody holds their lock)."""
    prefix = f".{final.name}{TMP_MARKER}"
    try:
        entries = [e for e in os.scandir(final.parent) if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        if entry.path == keep or not _SAVE_TMP.fullmatch(entry.name[len(prefix) :]):
            continue  # ours, or not a save's temp dir (`.tmp-old-`: a previous checkpoint)
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if _lock(fd):
                shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def is_tmp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARKER in name


def _replaceable(path: Path) -> bool:
    """overwrite=True replaces a checkpoint or an empty directory, never other data."""
    if not path.is_dir() or path.is_symlink():
        return False
    names = os.listdir(path)
    return not names or "shardpoint.json" in names


class LocalTransaction:
    """One save into ``final``: write files into ``.directory``, then ``commit()``."""

    def __init__(self, final: str | os.PathLike[str], *, overwrite: bool) -> None:
        self.final = Path(final).absolute()
        self.overwrite = overwrite
        self._check_target()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.directory, self._lock_fd = _make_locked_temp(self.final)
        self._done = False
        if self._lock_fd is not None:
            remove_dead_temps(self.final, keep=self.directory)

    def _check_target(self) -> None:
        if not os.path.lexists(self.final):
            return
        if not self.overwrite:
            raise CheckpointExistsError(
                f"{self.final} already exists; pass overwrite=True to replace it, "
                "or save to a new path"
            )
        if not _replaceable(self.final):
            raise CheckpointExistsError(
                f"{self.final} exists and is not a shardpoint checkpoint (no shardpoint.json); "
                "refusing to replace it even with overwrite=True. Remove it yourself or pick another path"
            )

    def write_files(
        self,
        files: Sequence[FileWrite],
        *,
        durable: bool,
        advance: Callable[[int], None] | None = None,
        write: Callable[..., dict[tuple[str, str], int]] | None = None,
    ) -> dict[tuple[str, str], int]:
        """Write the planned data files into the temporary directory (``write`` replaces
        :func:`~shardpoint._io.transfer.write_files`, as ``convert`` does)."""
        return (write or write_files)(self.directory, files, durable=durable, advance=advance)

    def write_bytes(self, name: str, data: bytes, *, durable: bool) -> None:
        write_small_file(os.path.join(self.directory, name), data, durable=durable)

    def data_files(self) -> dict[str, int]:
        """Data files of the committed checkpoint: name -> size."""
        final = str(self.final)
        return {n: os.path.getsize(os.path.join(final, n)) for n in sorted(os.listdir(final))
                if n.endswith(".safetensors")}

    def commit(self, *, durable: bool) -> None:
        """Make the checkpoint visible at ``final`` in one step."""
        if durable:
            fsync_dir(self.directory)
        self._check_target()
        # Without overwrite, never the replacing branch, even if the path appeared since the
        # check: only the no-replace rename, which fails if another save committed meanwhile.
        replace = self.overwrite and os.path.lexists(self.final)
        if not replace:
            try:
                renamed = _rename2(self.directory, str(self.final), _RENAME_NOREPLACE)
            except FileExistsError:
                if not self.overwrite:
                    raise CheckpointExistsError(
                        f"{self.final} was created by someone else while this save ran; "
                        "this save was discarded"
                    ) from None
                self._check_target()  # another save committed meanwhile: replace it, as asked
                replace = True
            else:
                if not renamed:
                    os.rename(self.directory, self.final)
                if durable:
                    fsync_dir(self.final.parent)
        if replace:
            if not _rename2(self.directory, str(self.final), _RENAME_EXCHANGE):
                # No atomic exchange here: move the old one aside first (a crash in between
                # leaves it as a hidden `.tmp-` sibling, never a half-written checkpoint).
                aside = str(self.final.parent / f".{self.final.name}{TMP_MARKER}old-{uuid.uuid4().hex}")
                os.rename(self.final, aside)
                try:
                    os.rename(self.directory, self.final)
                except BaseException:
                    os.rename(aside, self.final)  # put the previous checkpoint back
                    raise
                self.directory = aside
            # self.directory now holds the previous checkpoint.
            if durable:
                fsync_dir(self.final.parent)
            shutil.rmtree(self.directory, ignore_errors=True)
        self._done = True
        self._unlock()

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._done = True
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
