"""Atomic checkpoint directories on a POSIX filesystem.

A save writes into a hidden sibling ``.<name>.tmp-<uuid>/``, fsyncs every file, writes the
indexes and then the manifest, fsyncs the directory and renames it into place, then fsyncs
the parent. On Linux the rename is ``renameat2``: ``RENAME_NOREPLACE`` so two saves of one
name cannot both win, and ``RENAME_EXCHANGE`` for ``overwrite=True`` so at every instant
either the old or the new checkpoint sits at the path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

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
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small_file(path: str, data: bytes, *, durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
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
        self.directory = str(self.final.parent / f".{self.final.name}{TMP_MARKER}{uuid.uuid4().hex}")
        os.mkdir(self.directory)
        self._done = False

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

    def write_bytes(self, name: str, data: bytes, *, durable: bool) -> None:
        write_small_file(os.path.join(self.directory, name), data, durable=durable)

    def commit(self, *, durable: bool) -> None:
        """Make the checkpoint visible at ``final`` in one step."""
        if durable:
            fsync_dir(self.directory)
        self._check_target()
        if os.path.lexists(self.final):
            if not _rename2(self.directory, str(self.final), _RENAME_EXCHANGE):
                # No atomic exchange here: move the old one aside first (a crash in between
                # leaves it as a hidden `.tmp-` sibling, never a half-written checkpoint).
                aside = str(self.final.parent / f".{self.final.name}{TMP_MARKER}old-{uuid.uuid4().hex}")
                os.rename(self.final, aside)
                os.rename(self.directory, self.final)
                self.directory = aside
            # self.directory now holds the previous checkpoint.
            if durable:
                fsync_dir(self.final.parent)
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            try:
                renamed = _rename2(self.directory, str(self.final), _RENAME_NOREPLACE)
            except FileExistsError:
                raise CheckpointExistsError(
                    f"{self.final} was created by someone else while this save ran; "
                    "this save was discarded"
                ) from None
            if not renamed:
                os.rename(self.directory, self.final)
            if durable:
                fsync_dir(self.final.parent)
        self._done = True

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._done = True
