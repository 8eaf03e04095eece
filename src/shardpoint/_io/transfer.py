"""Moving tensor bytes between memory and local files, on a thread pool.

Writes: each tensor's own memory goes to ``pwrite`` (no ``tobytes`` copy), crc32c computed
on each segment while it is still in cache. Reads: ``preadv`` straight into the destination
tensor's memory, or through a bounded staging buffer when a dtype cast or device copy is
needed; a piece already wholly in the page cache is instead copied from the mapped cache
with crc32c folded in (``_native.copy_cached``); with the ``direct_reads`` knob a piece
that is not is read past the page cache (``O_DIRECT``, ``_native.pread_direct``) through a
small aligned bounce buffer.
Large tensors are split into pieces so several threads share them; piece crcs are combined
into one crc per tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._checksum import NATIVE, crc32c_combine, crc32c_update
from .._options import adopt, current_options
from ..errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    StateChangedError,
    StorageError,
)

PIECE_BYTES = 64 << 20
"""Unit of work shared between threads; crcs of whole pieces are combined cheaply. (For
reads, 16 MB pieces balanced the threads' finish no better and made cold reads ~15 %
slower: more, shorter streams.)"""

CACHED_COPY_MIN_BYTES = 1 << 20
"""Smallest piece worth mapping to copy from the page cache (below it, ``pread``)."""

DIRECT_MIN_BYTES = 1 << 20
"""Smallest uncached remainder of a piece read past the page cache (below it, ``pread``)."""

DIRECT_REQUEST_BYTES = 2 << 20
"""Bytes per ``O_DIRECT`` read (each reader thread's bounce buffer; ``direct_reads`` knob).
On the 2-core VM's virtio disk, 3.8 GB read with 2 threads and nothing else done: 1-2 MiB
requests 2.1-3.0 GB/s, 4 MiB 1.5 GB/s, 8 MiB 1.6-2.1 GB/s."""

Advance = Callable[[int], None]

_native = NATIVE
"""The C loops (``pread_into``, ``pwrite_from``) when built, else None: the Python loops run.
Fault-injection tests set it to None so that every ``pwrite`` goes through ``os``."""


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().reshape(-1)
    if flat.stride(0) != 1:  # one element with any stride (e.g. ``x.conj().imag[:1]``)
        flat = flat.as_strided((flat.numel(),), (1,))
    # ``ndarray.data`` is ``memoryview(array)``; numpy types ``__buffer__`` for Python 3.12+ only.
    return flat.view(torch.uint8).numpy().data.cast("B")


def contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is a contiguous CPU tensor, else a contiguous CPU copy."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


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
    err = StorageError(
        f"{where}: {doing} the file failed: [Errno {exc.errno}] {exc.strerror or exc}; the disk or file system "
        "reported an error. Check it (e.g. dmesg), then load again, or restore the file from a copy"
    )
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


CRC_AFTER_WRITE_MAX = 1 << 20
"""Largest write segment checksummed after its write rather than before (``pwrite_from``)."""


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


def _combine(crcs: Sequence[tuple[int, int]]) -> int:
    """Combine (crc, length) of consecutive pieces into one crc."""
    total = 0
    for crc, length in crcs:
        total = crc32c_combine(total, crc, length)
    return total


def _pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    if nbytes == 0:
        return [(0, 0)]
    return [(start, min(start + piece, nbytes)) for start in range(0, nbytes, piece)]


SMALL_TENSOR_BYTES = 64 << 10
"""Tensors of at most this many bytes are written (and read) in runs of neighbours: one
``pwrite`` / ``preadv`` per run through one buffer, instead of one call (and one work item
of the thread pool) per tensor, whose fixed cost dwarfs copying a few bytes."""

SMALL_RUN_BYTES = 4 << 20
"""Largest run of small tensors moved by one call."""


def small_runs(
    entries: Sequence[tuple[int, int]], *, tensor_max: int = SMALL_TENSOR_BYTES, run_max: int = SMALL_RUN_BYTES
) -> list[tuple[int, int]]:
    """Group (offset, nbytes) entries, in order, into runs of adjacent small ones.

    Returns (first index, one past the last index) per run of at least two entries whose
    bytes follow each other in the file with no gap, each at most ``tensor_max`` bytes and
    the run at most ``run_max``; every other entry is left out (moved on its own).

    >>> small_runs([(0, 4), (4, 4), (8, 100), (108, 4), (112, 4), (200, 4)], tensor_max=8)
    [(0, 2), (3, 5)]
    """
    runs: list[tuple[int, int]] = []
    first = -1
    end = total = 0
    for i, (offset, nbytes) in enumerate(entries):
        if nbytes > tensor_max:
            if first >= 0 and i - first > 1:
                runs.append((first, i))
            first = -1
            continue
        if first >= 0 and offset == end and total + nbytes <= run_max:
            end += nbytes
            total += nbytes
            continue
        if first >= 0 and i - first > 1:
            runs.append((first, i))
        first, end, total = i, offset + nbytes, nbytes
    if first >= 0 and len(entries) - first > 1:
        runs.append((first, len(entries)))
    return runs


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its memory holds exactly its stored bytes (contiguous CPU, no
    lazy conjugate or negative bit), else such a copy (:func:`contiguous_cpu`)."""
    if tensor.is_contiguous() and tensor.device.type == "cpu" and not (tensor.is_conj() or tensor.is_neg()):
        return tensor
    return contiguous_cpu(tensor)


def _write_small_run(
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
            source = _host_bytes(tensor)
            if source.numel() * source.element_size() != size:
                raise StateChangedError(
                    f"tensor {key!r} changed size while it was being saved (another thread resized "
                    "it); nothing was committed. Save when the state is not being changed"
                )
            memmove(base + pos, source.data_ptr(), size)
            crcs.append((key, crc32c_update(view[pos : pos + size], 0)))
            pos += size
        else:
            crcs.append((key, 0))
    del view
    _pwrite_all(fd, memoryview(buf), start)
    return crcs


@dataclass(frozen=True)
class FileWrite:
    """One data file to write: its header and, in order, the tensors and their offsets."""

    name: str
    header: bytes
    """Written at offset 0 (empty: someone else writes it, as in a cooperative save)."""
    size: int
    tensors: tuple[tuple[str, torch.Tensor, int], ...]
    """(key, tensor, absolute offset of its first byte)."""


def write_files(
    directory: str,
    files: Sequence[FileWrite],
    *,
    durable: bool,
    threads: int | None = None,
    advance: Advance | None = None,
    shared: bool = False,
    segment: int | None = None,
) -> dict[tuple[str, str], int]:
    """Write ``files`` into ``directory``; return the crc32c of every (file, key).

    Files are created fresh, or with ``shared`` opened without truncation because several
    processes write disjoint parts of them. With ``durable`` each file is fsynced.
    ``segment``: bytes per ``pwrite`` (default the ``io_segment_bytes`` knob).
    """
    cfg = current_options()
    native = _native if cfg.io.native else None
    threads = threads or writer_threads()
    segment = segment or cfg.io.segment_bytes
    fds: dict[str, int] = {}
    results: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    lock = threading.Lock()
    try:
        for f in files:
            flags = os.O_WRONLY | os.O_CREAT | (0 if shared else os.O_TRUNC)
            fd = os.open(os.path.join(directory, f.name), flags, 0o644)
            fds[f.name] = fd
            if f.header:
                with naming(os.path.join(directory, f.name)):
                    if shared:
                        os.ftruncate(fd, f.size)
                    _pwrite_all(fd, memoryview(f.header), 0)

        # Work items, round-robin across files so concurrent threads mostly hit different inodes.
        # A run of small neighbouring tensors is one item (``small_runs``).
        per_file: list[list[Any]] = []
        for f in files:
            items: list[Any] = []
            sizes = [(offset, tensor.numel() * tensor.element_size()) for _key, tensor, offset in f.tensors]
            runs = small_runs(sizes)
            run_at = {first: stop for first, stop in runs}
            i = 0
            while i < len(f.tensors):
                stop = run_at.get(i)
                if stop is not None:
                    members = tuple((k, t, sizes[j][1]) for j, (k, t, _o) in enumerate(f.tensors[i:stop], i))
                    start = sizes[i][0]
                    items.append((f.name, members, start, sizes[stop - 1][0] + sizes[stop - 1][1] - start))
                    i = stop
                    continue
                key, tensor, offset = f.tensors[i]
                nbytes = sizes[i][1]
                simple = tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj()
                spans = _pieces(nbytes, PIECE_BYTES) if simple else [(0, nbytes)]
                for start, end in spans:
                    items.append((f.name, key, tensor, offset, start, end))
                i += 1
            per_file.append(items)
        work: list[Any] = []
        for i in range(max((len(x) for x in per_file), default=0)):
            work.extend(items[i] for items in per_file if i < len(items))
        whole: dict[tuple[str, str], int] = {}
        """crc32c of the tensors written in small runs (each whole, in one piece)."""

        def run(item: Any) -> None:
            if len(item) == 4:
                fname, members, at, nbytes = item
                with naming(os.path.join(directory, fname)):
                    crcs = _write_small_run(fds[fname], members, at, nbytes)
                    if durable:
                        start_writeback(fds[fname], at, nbytes)
                if advance is not None:
                    advance(nbytes)
                with lock:
                    for key, crc in crcs:
                        whole[(fname, key)] = crc
                return
            fname, key, tensor, offset, start, end = item
            data = byte_view(contiguous_cpu(tensor))
            if len(data) != tensor.numel() * tensor.element_size():
                raise StateChangedError(
                    f"{fname}: tensor {key!r} changed size while it was being saved (another thread "
                    "resized it); nothing was committed. Save when the state is not being changed"
                )
            fd = fds[fname]
            write = native.pwrite_from if native is not None else _write_segments
            with naming(os.path.join(directory, fname)):
                crc = write(fd, data[start:end], offset + start, segment)
            if advance is not None:
                advance(end - start)
            if durable:
                start_writeback(fd, offset + start, end - start)
            with lock:
                results.setdefault((fname, key), []).append((start, crc, end - start))

        def sync(fname: str) -> None:
            with naming(os.path.join(directory, fname)):
                os.fsync(fds[fname])

        _run_all(run, work, threads)
        if durable:
            _run_all(sync, list(fds), threads)
    finally:
        for fd in fds.values():
            os.close(fd)
    whole.update((k, _combine([(c, n) for _, c, n in sorted(v)])) for k, v in results.items())
    return whole


def _cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


MAX_WRITER_THREADS = 4


def writer_threads(processes_here: int = 1) -> int:
    """Writer threads for one process: ``SHARDPOINT_WRITE_THREADS`` when set, otherwise up
    to 4 but no more than this process's share of the CPUs.

    Writing to the page cache is CPU work (the kernel's copy, crc32c); more writers than
    cores only contend. On 2 cores a 2.14 GB save took 0.41 s with 2 threads and 0.47 s with
    4 (median of 5), and with 2 or 4 ranks on those cores, 1 thread per rank beat 4 by
    10-65 %. ``processes_here`` is the number of ranks on this machine, whose share is the
    CPUs divided among them, unless the process is pinned to fewer CPUs than the machine
    has (a launcher that binds each rank to its own cores): then its own CPUs are its share.

        >>> writer_threads() >= 1
        True
    """
    configured = current_options().io.write_threads
    if configured > 0:
        return configured
    return max(1, min(MAX_WRITER_THREADS, _cpu_share(processes_here)))


def _cpu_share(processes_here: int) -> int:
    """CPUs of this machine for one of ``processes_here`` processes (0 when they outnumber
    the CPUs), or this process's own CPUs when it is pinned to fewer than the machine has."""
    mine, machine = _cpu_count(), os.cpu_count() or 1
    return mine if mine < machine else machine // max(1, processes_here)


MAX_READER_THREADS = 4


def reader_threads(processes_here: int = 1) -> int:
    """Reader threads for one process: ``SHARDPOINT_READ_THREADS`` when set, otherwise twice
    this process's share of the CPUs, at least 2 and at most 4.

    A cold read waits on the disk, so a process runs more readers than it has cores; but the
    copies out (and the crc32c) are CPU work, and ranks sharing a machine share its cores:
    with 4 ranks on 2 cores, a cold collective load of 1.94 GB took 1.08-1.10 s with 4
    threads per rank and 0.99-1.00 s with 2 (median of 5, two runs); with 2 ranks, 0.95-0.97 s
    either way. ``processes_here`` and the share: as for :func:`writer_threads`.

        >>> 2 <= reader_threads() <= 4
        True
    """
    configured = current_options().io.read_threads
    if configured > 0:
        return configured
    return max(2, min(MAX_READER_THREADS, 2 * _cpu_share(processes_here)))


def _run_all(fn: Callable[..., object], items: Sequence[object], threads: int) -> None:
    if not items:
        return
    if threads <= 1 or len(items) == 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(
        max_workers=min(threads, len(items)), thread_name_prefix="shardpoint-io",
        initializer=adopt, initargs=(current_options(),),
    ) as pool:
        futures = [pool.submit(fn, item) for item in items]
        errors = []
        for fut in futures:
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
        if errors:
            raise errors[0]


def _same_file_runs(entries: Sequence[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """:func:`small_runs` over (file, offset, nbytes) entries: a run stays in one file.
    An offset of -1 keeps an entry out of every run."""
    runs: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(entries) + 1):
        if i == len(entries) or entries[i][0] != entries[first][0]:
            group = [(offset, nbytes) for _path, offset, nbytes in entries[first:i]]
            runs.extend((first + a, first + b) for a, b in small_runs(group))
            first = i
    return runs


def _read_small_run(fd: int, tasks: Sequence[ReadTask]) -> list[int]:
    """Read the bytes of small tasks lying back to back in one file with one request into
    one buffer, then checksum each task's slice (in cache) and copy it into its tensor.

    Returns the crc32c of each task's bytes (0 where it carries no crc to check).
    """
    start = tasks[0].start
    nbytes = tasks[-1].start + tasks[-1].nbytes - start
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = os.preadv(fd, [view[got:]], start + got)
        if n == 0:
            short = next(t for t in tasks if t.start + t.nbytes > start + got)
            raise CorruptCheckpointError(
                f"{short.name}: unexpected end of file at byte {start + got}; the file is truncated"
            )
        got += n
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if nbytes else 0
    memmove = ctypes.memmove
    crcs = []
    for task in tasks:
        pos = task.start - start
        size = task.nbytes
        crcs.append(crc32c_update(view[pos : pos + size], 0) if task.crc32c is not None else 0)
        if size:
            memmove(task.dest.data_ptr(), base + pos, size)
    del view
    return crcs


class ReadTask(NamedTuple):
    """Read ``nbytes`` at ``start`` of file ``name`` into ``dest``.

    ``dest`` is a contiguous tensor. When it is a CPU tensor of the stored dtype the bytes
    land in its memory directly; otherwise they pass through a staging buffer and are
    cast / copied into it. ``crc32c``, when given, is checked over the whole range.
    (A named tuple: a load makes one per tensor, and a state may hold 10^5 small ones.)
    """

    name: str
    path: str
    start: int
    nbytes: int
    dest: torch.Tensor
    stored_dtype: torch.dtype
    crc32c: int | None
    label: str
    """Names the tensor in errors."""
    fd: int = -1
    """The file, already open (held by the opened checkpoint, so that every read sees the
    version that was opened); -1: open ``path`` here."""


class _Staging(threading.local):
    """Each reader thread's staging buffers, allocated on first use and reused.

    Two buffers alternate, so the read into one overlaps the (asynchronous, for a GPU
    destination) copy out of the other; for GPU destinations they are pinned host memory
    and a buffer is reused only after the copy that last read it has finished.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.events: list[object | None] = []
        self.turn = 0
        self.direct: memoryview | None = None

    def take(self, nbytes: int, *, for_device: torch.device) -> tuple[int, torch.Tensor]:
        pin = for_device.type == "cuda"
        # Alternating only pays where the copy out is asynchronous (a GPU destination).
        i = self.turn = (self.turn + 1) % 2 if pin else 0
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
            self.events.append(None)
        event = self.events[i]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self.events[i] = None
        buf = self.buffers[i]
        if buf.numel() < nbytes or (pin and not buf.is_pinned()):
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.buffers[i] = buf
        return i, buf

    def bounce(self) -> memoryview:
        """This thread's page-aligned buffer for ``O_DIRECT`` reads."""
        if self.direct is None:
            self.direct = memoryview(mmap.mmap(-1, DIRECT_REQUEST_BYTES))
        return self.direct

    def copied(self, i: int, dest: torch.Tensor) -> None:
        """Remember the asynchronous copy out of buffer ``i`` (GPU destinations)."""
        if dest.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dest.device))
            self.events[i] = event


def run_reads(
    tasks: Sequence[ReadTask],
    *,
    threads: int | None = None,
    advance: Advance | None = None,
    staging_bytes: int | None = None,
) -> None:
    """Run read tasks on a thread pool, checking crc32c where the task carries one.

    ``staging_bytes`` bounds each thread's staging buffer (two per thread) for reads that
    cannot land in the destination directly (a dtype cast, a GPU destination); default
    the ``SHARDPOINT_STAGING_BUFFER_BYTES`` knob.
    """
    cfg = current_options()
    native = _native if cfg.io.native else None
    threads = threads or reader_threads()
    staging_bytes = staging_bytes or cfg.io.staging_buffer_bytes
    staging = _Staging()
    used_cuda: set[torch.device] = set()
    fds: dict[str, int] = {}
    fd_lock = threading.Lock()
    crcs: dict[int, list[tuple[int, int, int]]] = {}
    crc_lock = threading.Lock()

    def fd_for(task: ReadTask) -> int:
        if task.fd >= 0:
            return task.fd
        with fd_lock:
            fd = fds.get(task.path)
            if fd is None:
                fd = fds[task.path] = os.open(task.path, os.O_RDONLY)
            return fd

    direct_fds: dict[str, int | None] = {}
    """Each file opened again with ``O_DIRECT``; None where the file system refuses it."""
    read_direct = None
    if cfg.io.direct_reads and native is not None and hasattr(os, "O_DIRECT"):
        read_direct = native.pread_direct

    refused: set[str] = set()
    """Files whose reads with ``O_DIRECT`` failed with EINVAL (their fds close at the end:
    another thread may be reading with one)."""

    def direct_fd_for(task: ReadTask) -> int | None:
        with fd_lock:
            if task.path not in direct_fds:
                # A held descriptor is opened again through /proc: the same file, whatever
                # the path names now.
                source = f"/proc/self/fd/{task.fd}" if task.fd >= 0 else task.path
                try:
                    direct_fd = os.open(source, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    direct_fd = None
                if direct_fd is not None and task.fd >= 0 and not os.path.samestat(
                    os.fstat(direct_fd), os.fstat(task.fd)
                ):
                    os.close(direct_fd)
                    direct_fd = None
                direct_fds[task.path] = direct_fd
            return None if task.path in refused else direct_fds[task.path]

    def refuse_direct(task: ReadTask) -> None:
        with fd_lock:
            refused.add(task.path)

    work: list[Any] = []
    # Small tasks reading neighbouring bytes of one file straight into CPU memory are read
    # together: one request into one buffer, split by the run (``_read_small_run``).
    candidates = [
        (task.path, task.start, task.nbytes)
        if task.dest.is_cpu
        and task.dest.dtype == task.stored_dtype
        and task.dest.is_contiguous()
        and task.dest.nbytes == task.nbytes  # copied with memmove: exactly its bytes
        else ("", -1, SMALL_TENSOR_BYTES + 1)
        for task in tasks
    ]
    run_at = {first: stop for first, stop in _same_file_runs(candidates)}
    small_crcs: dict[int, int] = {}
    """crc32c of each task read in a small run (each whole, in one piece)."""
    i = 0
    while i < len(tasks):
        stop = run_at.get(i)
        if stop is not None:
            work.append((i, stop))
            i = stop
            continue
        task = tasks[i]
        direct = task.dest.is_cpu and task.dest.dtype == task.stored_dtype
        piece = PIECE_BYTES if direct else max(staging_bytes // 64 * 64, 64)
        for start, end in _pieces(task.nbytes, piece):
            work.append((i, task, start, end))
        i += 1

    segment = cfg.io.segment_bytes
    copy_cached = None
    if cfg.io.cached_copy and native is not None and native.STREAM_COPY:
        copy_cached = native.copy_cached
    # Copies from the page cache keep a core busy each; more at once than there are cores
    # only thrash (the read threads outnumber the cores for the disk's sake: cold reads wait).
    copy_slots = threading.Semaphore(_cpu_count())

    def run(item: Any) -> None:
        with read_errors_named((tasks[item[0]] if len(item) == 2 else item[1]).name):
            read_piece(item)

    def read_piece(item: Any) -> None:
        if len(item) == 2:
            first, stop = item
            members = tasks[first:stop]
            with naming(members[0].path):
                run_crcs = _read_small_run(fd_for(members[0]), members)
            if advance is not None:
                advance(sum(t.nbytes for t in members))
            with crc_lock:
                small_crcs.update(zip(range(first, stop), run_crcs, strict=True))
            return
        i, task, start, end = item
        fd = fd_for(task)
        direct = task.dest.is_cpu and task.dest.dtype == task.stored_dtype
        slot, buffer = -1, None
        if direct:
            view = byte_view(task.dest)[start:end]
        else:
            slot, buffer = staging.take(max(end - start, 1), for_device=task.dest.device)  # grows to a piece, never past what is read
            view = byte_view(buffer)[: end - start]
        check = task.crc32c is not None
        # Unchecked, a piece goes in one call: from the page cache that copies fastest.
        step = segment if check else max(len(view), 1)
        read = native.pread_into if native is not None else _read_segments
        at = task.start + start
        parts: list[tuple[int, int]] = []  # (crc, length) of what each step filled, in order
        got = 0
        with naming(task.path):
            mapped = copy_cached is not None and len(view) >= CACHED_COPY_MIN_BYTES
            if mapped:
                # What is in the page cache goes by a mapped copy with non-temporal stores,
                # which moves a third less memory than pread, crc32c included.
                with copy_slots:
                    n, c = copy_cached(fd, view, at)  # type: ignore[misc]
                parts.append((c, n))
                got += n
            if read_direct is not None and len(view) - got >= DIRECT_MIN_BYTES:
                # The mapped copy stops where the cache does; without it, read what is cached
                # through the cache, and go past it for the rest.
                warm = 0 if mapped else native.cached_prefix(fd, at + got, len(view) - got)  # type: ignore[union-attr]
                if len(view) - got - warm >= DIRECT_MIN_BYTES and (dfd := direct_fd_for(task)) is not None:
                    if warm:
                        n, c = read(fd, view[got : got + warm], at + got, step, check)
                        parts.append((c, n))
                        got += n
                    try:
                        n, c = read_direct(dfd, view[got:], at + got, staging.bounce(), check)
                        parts.append((c, n))
                        got += n
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        refuse_direct(task)  # this file system wants another alignment
            if got < len(view):  # not (all) cached: read the rest
                n, c = read(fd, view[got:], at + got, step, check)
                parts.append((c, n))
                got += n
        crc = _combine(parts)
        if got != len(view):
            raise CorruptCheckpointError(
                f"{task.name}: unexpected end of file at byte {at + got}; the file is truncated"
            )
        if advance is not None:
            advance(end - start)
        if buffer is not None and end > start:
            src_item = torch.empty((), dtype=task.stored_dtype).element_size()
            src = buffer[: end - start].view(task.stored_dtype)
            lo, hi = start // src_item, end // src_item
            on_gpu = task.dest.device.type == "cuda"
            task.dest.view(-1)[lo:hi].copy_(src, non_blocking=on_gpu)
            staging.copied(slot, task.dest)
            if on_gpu:
                used_cuda.add(task.dest.device)
        if task.crc32c is not None:
            with crc_lock:
                crcs.setdefault(i, []).append((start, crc, end - start))

    try:
        _run_all(run, work, threads)
    finally:
        for fd in [*fds.values(), *direct_fds.values()]:
            if fd is not None:
                os.close(fd)
        for device in used_cuda:  # every asynchronous copy has landed before we return
            torch.cuda.synchronize(device)
    for i, task in enumerate(tasks):
        if task.crc32c is None:
            continue
        got = small_crcs.get(i)
        if got is None:
            got = _combine([(c, n) for _, c, n in sorted(crcs.get(i, []))])
        if got != task.crc32c:
            raise ChecksumMismatchError(
                f"{task.name}, tensor {task.label!r}: crc32c of the stored bytes is {got:#010x}, "
                f"the manifest recorded {task.crc32c:#010x}; the file is damaged. Restore it from "
                "a copy, or load an earlier checkpoint"
            )
