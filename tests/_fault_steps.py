"""Fault injection at the syscall boundary of a local save, one filesystem call at a time.

:class:`FaultSteps` wraps the ``os`` functions a save, the ``latest`` update and retention
use (``open``, ``pwrite``, ``write``, ``ftruncate``, ``fsync``, ``mkdir``, ``rename``,
``replace``, ``unlink``, ``rmdir``) and the ``renameat2`` that commits a checkpoint
directory. Only calls that touch a path under ``root`` are counted (a file descriptor is
resolved through ``/proc/self/fd``), so everything else in the process runs untouched.
Each counted call is a *step* with a readable label (``fsync model-00002-of-00003.safetensors``,
``renameat2 .ckpt.tmp-* -> ckpt``); at step ``at`` the action fires *instead of* the call:

- ``eio``: ``OSError(EIO)`` exactly as the kernel reports it through Python (a call on a
  file descriptor names no file; a call on paths names them);
- ``enospc``: the same with ``ENOSPC``;
- ``runtime``: a plain ``RuntimeError`` (any bug in our code or a callback);
- ``kill``: ``SIGKILL`` to this very process (used in forked children only);
- ``pause``: call ``on_pause(label)`` and then perform the call (two saves racing).

A dry run (``at=None``) records the steps of a fault-free save, so a test can walk a fault
through every one of them. The writer pool must run one thread
(``IOOptions(write_threads=1)``) so the order of the steps is the same on every run.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import signal
from collections.abc import Callable
from typing import Any

from shardpoint._io import files as sp_files
from shardpoint._storage import posix as sp_posix

FD_CALLS = ("pwrite", "write", "ftruncate", "fsync")
PATH_CALLS = ("open", "mkdir", "unlink", "rmdir")
TWO_PATH_CALLS = ("rename", "replace")
_TMP_HEX = re.compile(r"\.tmp-(old-|del-)?[0-9a-f]{8,}")


def normalize(name: str) -> str:
    """``.ckpt.tmp-3fa9...`` -> ``.ckpt.tmp-*``: labels that compare across runs."""
    return _TMP_HEX.sub(lambda m: f".tmp-{m.group(1) or ''}*", name)


class FaultSteps:
    """Count the filesystem calls under ``root``; act at call number ``at`` (1-based)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        at: int | None = None,
        action: str = "eio",
        on_pause: Callable[[str], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.root = os.path.realpath(root)
        self.at = at
        self.action = action
        self.on_pause = on_pause
        self.log = log
        self.steps: list[str] = []
        """Label of every counted call, in order (the acted-on one included)."""
        self.paths: list[tuple[str, ...]] = []
        """Absolute paths each counted call touched."""
        self.fired: str | None = None
        """Label of the step the action fired at."""
        self.fired_paths: tuple[str, ...] = ()
        """The paths that step touched."""
        self.enabled = True
        self._real: dict[str, Any] = {name: getattr(os, name) for name in (*FD_CALLS, *PATH_CALLS, *TWO_PATH_CALLS)}
        self._real_renameat2 = sp_posix._renameat2

    # -------------------------------------------------------------------- install

    def install(self, setattr_: Callable[[Any, str, Any], None]) -> None:
        """Patch ``os`` (and ``renameat2``) with ``setattr_`` (``monkeypatch.setattr`` in
        a test, plain ``setattr`` in a child that never restores)."""
        for name in FD_CALLS:
            setattr_(os, name, self._fd_wrapper(name))
        for name in PATH_CALLS:
            setattr_(os, name, self._path_wrapper(name))
        for name in TWO_PATH_CALLS:
            setattr_(os, name, self._two_path_wrapper(name))
        if self._real_renameat2 is not None:
            setattr_(sp_posix, "_renameat2", self._renameat2)
        # The C write loop calls pwrite(2) itself; the Python loop goes through ``os``.
        setattr_(sp_files, "_native", None)

    # -------------------------------------------------------------------- helpers

    def _inside(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def _rel(self, path: str) -> str:
        rel = os.path.relpath(path, os.path.dirname(self.root)) if path != self.root else os.path.basename(path)
        return normalize(rel)

    @staticmethod
    def _fd_path(fd: int) -> str | None:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        except OSError:
            return None

    def _abs(self, path: Any, dir_fd: int | None) -> str:
        text = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(text):
            base = self._fd_path(dir_fd) or ""
            text = os.path.join(base, text)
        return os.path.abspath(text)

    def _step(self, label: str, paths: tuple[str, ...]) -> bool:
        """Record a counted call; True if the action fires at it."""
        self.steps.append(label)
        self.paths.append(paths)
        if self.log is not None:
            self.log(label)
        return self.enabled and self.at is not None and len(self.steps) == self.at

    def _act(self, label: str, paths: tuple[str, ...], *, named: bool) -> None:
        """Fire the action at the call ``label`` (raises, kills, or pauses and returns)."""
        self.fired, self.fired_paths = label, paths
        if self.action in ("eio", "enospc"):
            code = errno.EIO if self.action == "eio" else errno.ENOSPC
            if not named:
                raise OSError(code, os.strerror(code))
            if len(paths) == 2:
                raise OSError(code, os.strerror(code), paths[0], None, paths[1])
            raise OSError(code, os.strerror(code), paths[0])
        if self.action == "runtime":
            raise RuntimeError(f"injected failure at step {len(self.steps)} ({label})")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "pause":
            assert self.on_pause is not None
            self.on_pause(label)
            return
        raise AssertionError(f"unknown action {self.action!r}")

    # -------------------------------------------------------------------- wrappers

    def _fd_wrapper(self, name: str) -> Callable[..., Any]:
        real = self._real[name]

        def call(fd: int, *args: Any, **kwargs: Any) -> Any:
            path = self._fd_path(fd) if self.enabled else None
            if path is not None and self._inside(path):
                label = f"{name} {self._rel(path)}"
                if self._step(label, (path,)):
                    self._act(label, (path,), named=False)
            return real(fd, *args, **kwargs)

        return call

    def _path_wrapper(self, name: str) -> Callable[..., Any]:
        real = self._real[name]

        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if self.enabled and isinstance(path, (str, bytes, os.PathLike)):
                full = self._abs(path, kwargs.get("dir_fd"))
                if self._inside(full):
                    label = f"{name} {self._rel(full)}"
                    if self._step(label, (full,)):
                        self._act(label, (full,), named=True)
            return real(path, *args, **kwargs)

        return call

    def _two_path_wrapper(self, name: str) -> Callable[..., Any]:
        real = self._real[name]

        def call(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if self.enabled:
                a = self._abs(src, kwargs.get("src_dir_fd"))
                b = self._abs(dst, kwargs.get("dst_dir_fd"))
                if self._inside(a) or self._inside(b):
                    label = f"{name} {self._rel(a)} -> {self._rel(b)}"
                    if self._step(label, (a, b)):
                        self._act(label, (a, b), named=True)
            return real(src, dst, *args, **kwargs)

        return call

    def _renameat2(self, src_fd: int, src: bytes, dst_fd: int, dst: bytes, flags: int) -> int:
        a, b = os.path.abspath(os.fsdecode(src)), os.path.abspath(os.fsdecode(dst))
        if self.enabled and (self._inside(a) or self._inside(b)):
            label = f"renameat2 {self._rel(a)} -> {self._rel(b)}"
            if self._step(label, (a, b)):
                if self.action in ("eio", "enospc"):
                    # What the kernel does: -1 and errno (shardpoint raises OSError from it).
                    self.fired, self.fired_paths = label, (a, b)
                    ctypes.set_errno(errno.EIO if self.action == "eio" else errno.ENOSPC)
                    return -1
                self._act(label, (a, b), named=True)
        assert self._real_renameat2 is not None
        return int(self._real_renameat2(src_fd, src, dst_fd, dst, flags))


def first_step(steps: list[str], prefix: str) -> int:
    """1-based index of the first step whose label starts with ``prefix``."""
    for i, label in enumerate(steps, start=1):
        if label.startswith(prefix):
            return i
    raise AssertionError(f"no step starts with {prefix!r} in {steps}")
