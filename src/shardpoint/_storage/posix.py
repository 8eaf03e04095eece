"""POSIX primitives of a local save: ``renameat2``, fsync, small files, ``flock``, and errors.

:func:`reported` turns an ``OSError`` of a local save into a
:class:`~shardpoint.errors.StorageError` naming the checkpoint, the file and what was left.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
from collections.abc import Callable, Iterator

from .._io.files import naming
from ..errors import CheckpointError, StorageError

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


def lock_nowait(fd: int) -> bool | None:
    """flock ``fd`` without waiting: True, False when another process holds it, None where
    the filesystem has no locks (then nothing is ever removed as stale)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        return None
    return True

# ------------------------------------------------------------------ errors


_ADVICE = {
    errno.ENOSPC: "free space on that filesystem or save somewhere else",
    errno.EDQUOT: "free space within your quota or save somewhere else",
    errno.EROFS: "the filesystem is mounted read-only: save to a writable location",
    errno.EACCES: "you may not write there: fix the directory's permissions or save somewhere else",
    errno.EPERM: "the filesystem refused the operation: fix the permissions or save somewhere else",
    errno.ENAMETOOLONG: "use a shorter checkpoint name or path",
    errno.EIO: "the disk reported an I/O error: check it and try again",
}


NOTHING_LEFT = (
    "Nothing was committed there by this save: the checkpoint that was there before, if any, "
    "is unchanged, and this save's temporary directory is removed"
)


@contextlib.contextmanager
def reported(
    final: str | os.PathLike[str], doing: str, left: Callable[[], str] = lambda: NOTHING_LEFT
) -> Iterator[None]:
    """Turn an OSError of a local save into :class:`~shardpoint.errors.StorageError` naming
    the checkpoint path, the file (where the OSError names one), the errno's meaning, what
    to do and what the failure left behind (``left()``); ``errno`` is kept. An OSError
    without an errno (a write that stored nothing) is reported as ``EIO``."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        code = exc.errno if exc.errno is not None else errno.EIO
        meaning = os.strerror(code)
        advice = _ADVICE.get(code, "check the filesystem and try again")
        raise StorageError(
            code,
            f"saving {os.fspath(final)} failed while {doing}: {meaning} ({exc}); {advice}. {left()}",
        ) from exc
