"""Local files as the I/O engines' byte source and sink: the read and write loops over a
file descriptor (the C extension's, GIL-free, or their Python twins), ``O_DIRECT`` reads,
copies from the page cache, and OSErrors named after the file.

Reads: ``preadv`` straight into the memory given; a range wholly in the page cache is
instead copied from the mapped cache with crc32c folded in (``_native.copy_cached``); with
``IOOptions(direct_reads=True)`` a range that is not is read past the page cache
(``O_DIRECT``, ``_native.pread_direct``) through a small aligned bounce buffer. Writes:
``pwrite`` from the tensor's own memory, crc32c computed on each segment while it is still
in cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._checksum import NATIVE, combine_runs, crc32c_update
from .._options import current_options
from ..errors import CheckpointError, StorageError
from .memory import host_bytes, unchanged_size
from .plan import ReadTask
from .threads import cpu_count, reader_threads

CACHED_COPY_MIN_BYTES = 1 << 20
"""Smallest piece worth mapping to copy from the page cache (below it, ``pread``)."""

DIRECT_MIN_BYTES = 1 << 20
"""Smallest uncached remainder of a piece read past the page cache (below it, ``pread``)."""

DIRECT_REQUEST_BYTES = 2 << 20
"""Bytes per ``O_DIRECT`` read (each reader thread's bounce buffer; ``direct_reads`` option).
On the 2-core VM's virtio disk, 3.8 GB read with 2 threads and nothing else done: 1-2 MiB
requests 2.1-3.0 GB/s, 4 MiB 1.5 GB/s, 8 MiB 1.6-2.1 GB/s."""

CRC_AFTER_WRITE_MAX = 1 << 20
"""Largest write segment checksummed after its write rather than before (``pwrite_from``)."""

CACHE_SAMPLE_TASKS = 32
"""Tasks whose residency in the page cache picks a read's thread count (see ``LocalFiles.threads``)."""

_native = NATIVE
"""The C loops (``pread_into``, ``pwrite_from``) when built, else None: the Python loops run.
Fault-injection tests set it to None so that every ``pwrite`` goes through ``os``."""


def native_loops() -> Any:
    """The C loops when built and ``IOOptions(native=True)``, else None."""
    return _native if current_options().io.native else None


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Name ``path`` in OSErrors of calls on its file descriptor (``pwrite``, ``fsync``: the
    kernel's error names no file), so "No space left on device" says where."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = path
        raise


def read_error(exc: OSError, where: str, doing: str) -> StorageError:
    """An OSError of a local read (EIO, ...) as a :class:`StorageError` naming the file:
    the kernel's ``[Errno 5] Input/output error`` alone names nothing."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        advice = ("this user may not read it: make it readable (chmod, chown) or run as a user who may; "
                  "nothing says its bytes are damaged")
    else:
        advice = ("the disk or file system reported an error. Check it (e.g. dmesg), then load again, or "
                  "restore the file from a copy")
    err = StorageError(f"{where}: {doing} the file failed: [Errno {exc.errno}] {exc.strerror or exc}; {advice}")
    err.errno = exc.errno
    return err


@contextlib.contextmanager
def read_errors_named(where: str, doing: str = "reading") -> Iterator[None]:
    """Turn OSErrors of reads into :class:`StorageError` naming ``where``."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise read_error(exc, where, doing) from exc


# ---------------------------------------------------------------------------- writing


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        view = view[n:]
        offset += n


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None
try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _sync_file_range = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a just-written range to the disk now, without waiting for it.

    A durable save then overlaps the disk's work with producing the rest of the file, and
    the final fsync waits only for the tail, instead of the whole file being flushed at
    the end (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere a no-op).
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _write_segments(fd: int, view: memoryview, offset: int, segment: int) -> int:
    """Write ``view`` at ``offset`` a segment at a time; return the crc32c of the bytes.

    Each segment is checksummed while it is in the CPU cache: right after its write up to
    1 MiB, right before it above (see ``pwrite_from``). The Python twin of
    ``_native.pwrite_from``.
    """
    after = segment <= CRC_AFTER_WRITE_MAX
    crc = 0
    pos = 0
    while pos < len(view):
        # Segments end on multiples of ``segment`` in the file: see ``pwrite_from``.
        end = min(len(view), pos + segment - (offset + pos) % segment)
        chunk = view[pos:end]
        if not after:
            crc = crc32c_update(chunk, crc)
        _pwrite_all(fd, chunk, offset + pos)
        if after:
            crc = crc32c_update(chunk, crc)
        pos = end
    return crc


def write_range(fd: int, view: memoryview, offset: int, segment: int) -> int:
    """Write ``view`` at ``offset`` (the C loop, or its Python twin); return its crc32c."""
    native = native_loops()
    if native is not None:
        return int(native.pwrite_from(fd, view, offset, segment))
    return _write_segments(fd, view, offset, segment)


def write_small_run(
    fd: int, items: Sequence[tuple[str, torch.Tensor, int]], start: int, nbytes: int
) -> list[tuple[str, int]]:
    """Pack the bytes of small tensors lying back to back from ``start`` into one buffer,
    checksum each from it (still in cache) and write the buffer with one ``pwrite``.

    Returns (key, crc32c) per tensor. ``items``: (key, tensor, byte count) in file order.
    """
    buf = bytearray(nbytes)
    view = memoryview(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if nbytes else 0
    crcs = []
    pos = 0
    memmove = ctypes.memmove
    for key, tensor, size in items:
        if size:
            source = host_bytes(tensor)
            unchanged_size(key, source.numel() * source.element_size(), size)
            memmove(base + pos, source.data_ptr(), size)
            crcs.append((key, crc32c_update(view[pos : pos + size], 0)))
            pos += size
        else:
            crcs.append((key, 0))
    del view
    _pwrite_all(fd, memoryview(buf), start)
    return crcs


# ---------------------------------------------------------------------------- reading


def _read_segments(fd: int, view: memoryview, offset: int, segment: int, check: bool) -> tuple[int, int]:
    """Fill ``view`` from ``offset`` a segment at a time; return (bytes read, their crc32c).

    Each segment is checksummed (when ``check``) straight after it lands, while it is still
    in the CPU cache, so verification adds a pass over cache, not over memory. Stops early
    only at the end of the file. The Python twin of ``_native.pread_into``.
    """
    crc = pos = 0
    while pos < len(view):
        part = view[pos : pos + segment]
        got = os.preadv(fd, [part], offset + pos)
        if got == 0:
            break
        if check:
            crc = crc32c_update(part[:got], crc)
        pos += got
    return pos, crc


class LocalFiles:
    """Local files as the read engine's byte source (one per run of the engine).

    A task's file is its held descriptor (``ReadTask.fd``: the version the checkpoint
    opened), else ``ReadTask.path`` opened here once; each is opened again with
    ``O_DIRECT`` on first need (with the ``direct_reads`` option), or never where the file
    system refuses it.
    """

    def __init__(self, threads: int | None = None, processes_here: int = 1) -> None:
        cfg = current_options()
        native = native_loops()
        self._threads = threads
        """Reads at once (default :func:`.threads.reader_threads`, for cached bytes or not)."""
        self._processes_here = processes_here
        """Processes sharing this machine's CPUs (the ranks of a collective load on it)."""
        self.segment = cfg.io.segment_bytes
        self._read = native.pread_into if native is not None else _read_segments
        self._cached_prefix = native.cached_prefix if native is not None else None
        self._copy_cached = (
            native.copy_cached if cfg.io.cached_copy and native is not None and native.STREAM_COPY else None
        )
        self._read_direct = (
            native.pread_direct if cfg.io.direct_reads and native is not None and hasattr(os, "O_DIRECT") else None
        )
        # Unchecked, the mapped copy wins only with 512-bit registers: on an AVX2 CPU,
        # ``pread`` copied the small folios a collective save leaves in the page cache 15 %
        # faster (8.2 against 7.2 GB/s, 2 threads), where with crc32c the mapped copy was
        # 19 % (small folios) to 46 % (2 MiB folios) faster than ``pread`` + crc32c.
        self._copy_unchecked = native is not None and native.IMPLEMENTATION == "vpclmulqdq"
        # A checked ``pread_into`` goes through a per-thread bounce buffer and the folding copy
        # (``STREAM_COPY``). From the disk that is faster than an unchecked ``pread`` straight
        # into the tensor (2 GiB cold, 8 threads: 0.63-0.69 s against 0.74-0.85 s), so the
        # part of an unchecked piece that is not in the page cache is read that way too, its
        # crc32c unused; from the page cache the plain ``pread`` stays faster.
        self._bounce_uncached = native is not None and bool(native.STREAM_COPY)
        # Copies from the page cache keep a core busy each; more at once than there are cores
        # only thrash (the read threads outnumber the cores for the disk's sake: cold reads wait).
        self._copy_slots = threading.Semaphore(cpu_count())
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int | None] = {}
        """Each file opened again with ``O_DIRECT``; None where the file system refuses it."""
        self._refused: set[str] = set()
        """Files whose reads with ``O_DIRECT`` failed with EINVAL (their fds close at the end:
        another thread may be reading with one)."""
        self._bounce = threading.local()
        self._cold = True
        """Whether the tasks last given to :meth:`threads` were mostly not in the page cache."""

    def threads(self, tasks: Sequence[ReadTask]) -> int:
        """The given count, else :func:`.threads.reader_threads` for these tasks: fewer
        threads when their bytes are mostly in the page cache (copies are CPU work), more
        when they must come from the disk (more requests in flight)."""
        cached = self._mostly_cached(tasks)
        self._cold = not cached
        return self._threads or reader_threads(self._processes_here, cached=cached)

    def tapered(self) -> bool:
        return self._cold

    def _mostly_cached(self, tasks: Sequence[ReadTask]) -> bool:
        """Whether at least half of up to 32 tasks, spread over the list, have their first
        64 KiB in the page cache (``mincore``, ~9 us a probe; nothing is read). False
        without the C loops, and where a file cannot be opened: the reads then report that,
        naming the file."""
        if self._cached_prefix is None or not tasks:
            return False
        sample = tasks[:: max(1, len(tasks) // CACHE_SAMPLE_TASKS)][:CACHE_SAMPLE_TASKS]
        cached = missing = 0
        try:
            for task in sample:  # until the majority is known
                probe = min(task.nbytes, 64 << 10)
                if probe == 0 or self._cached_prefix(self.fd(task), task.start, probe) == probe:
                    cached += 1
                else:
                    missing += 1
                if 2 * cached >= len(sample) or 2 * missing > len(sample):
                    break
        except OSError:
            return False
        return 2 * cached >= len(sample)

    def piece_bytes(self) -> int:
        return current_options().io.piece_bytes

    def fd(self, task: ReadTask) -> int:
        if task.fd >= 0:
            return task.fd
        with self._lock:
            fd = self._fds.get(task.path)
            if fd is None:
                fd = self._fds[task.path] = os.open(task.path, os.O_RDONLY)
            return fd

    def _direct_fd(self, task: ReadTask) -> int | None:
        with self._lock:
            if task.path not in self._direct_fds:
                # A held descriptor is opened again through /proc: the same file, whatever
                # the path names now.
                source = f"/proc/self/fd/{task.fd}" if task.fd >= 0 else task.path
                try:
                    direct_fd: int | None = os.open(source, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    direct_fd = None
                if direct_fd is not None and task.fd >= 0 and not os.path.samestat(
                    os.fstat(direct_fd), os.fstat(task.fd)
                ):
                    os.close(direct_fd)
                    direct_fd = None
                self._direct_fds[task.path] = direct_fd
            return None if task.path in self._refused else self._direct_fds[task.path]

    def _bounce_buffer(self) -> memoryview:
        """This thread's page-aligned buffer for ``O_DIRECT`` reads."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None:
            buf = self._bounce.buf = memoryview(mmap.mmap(-1, DIRECT_REQUEST_BYTES))
        return buf

    def fill(self, task: ReadTask, view: memoryview, at: int, check: bool) -> tuple[int, int]:
        """Read ``len(view)`` bytes of ``task``'s file at ``at`` into ``view``; return (bytes
        read: fewer only at the end of the file, their crc32c when ``check``)."""
        fd = self.fd(task)
        # Unchecked, a piece goes in one call: from the page cache that copies fastest.
        step = self.segment if check else max(len(view), 1)
        read = self._read
        parts: list[tuple[int, int, int]] = []  # (start, crc, length) of what each call filled
        got = 0
        with naming(task.path):
            mapped = (
                self._copy_cached is not None
                and len(view) >= CACHED_COPY_MIN_BYTES
                and (check or self._copy_unchecked)
            )
            if mapped:
                # What is in the page cache goes by a mapped copy with non-temporal stores,
                # which moves a third less memory than pread, crc32c included.
                with self._copy_slots:
                    n, c = self._copy_cached(fd, view, at)  # type: ignore[misc]
                parts.append((got, c, n))
                got += n
            if self._read_direct is not None and len(view) - got >= DIRECT_MIN_BYTES:
                # The mapped copy stops where the cache does; without it, read what is cached
                # through the cache, and go past it for the rest.
                warm = 0 if mapped else self._cached_prefix(fd, at + got, len(view) - got)  # type: ignore[misc]
                if len(view) - got - warm >= DIRECT_MIN_BYTES and (dfd := self._direct_fd(task)) is not None:
                    if warm:
                        n, c = read(fd, view[got : got + warm], at + got, step, check)
                        parts.append((got, c, n))
                        got += n
                    try:
                        n, c = self._read_direct(dfd, view[got:], at + got, self._bounce_buffer(), check)
                        parts.append((got, c, n))
                        got += n
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        with self._lock:
                            self._refused.add(task.path)  # this file system wants another alignment
            bounced = not check and self._bounce_uncached and got < len(view)
            if bounced:
                # Unchecked: what is cached goes by one plain pread, the rest through the
                # checked read's bounce buffer (see _bounce_uncached), its crc32c unused.
                warm = self._cached_prefix(fd, at + got, len(view) - got)  # type: ignore[misc]
                if warm:
                    n, c = read(fd, view[got : got + warm], at + got, step, False)
                    parts.append((got, c, n))
                    got += n
            if got < len(view):  # not (all) cached: read the rest
                n, c = read(fd, view[got:], at + got, self.segment if bounced else step, check or bounced)
                parts.append((got, c, n))
                got += n
        if not check:
            return got, 0
        if len(parts) == 1:
            return got, parts[0][1]
        return got, combine_runs(parts, got, where=task.name)

    def fill_run(self, task: ReadTask, view: memoryview, at: int) -> int:
        """Read ``view`` at ``at`` with plain ``preadv`` calls (a run of small tensors);
        return the bytes read (fewer only at the end of the file)."""
        fd = self.fd(task)
        got = 0
        with naming(task.path):
            while got < len(view):
                n = os.preadv(fd, [view[got:]], at + got)
                if n == 0:
                    break
                got += n
        return got

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            if fd is not None:
                os.close(fd)
