"""The read engine: every read of tensor bytes (load, load_into, reshard, convert, diff,
verify) goes through :func:`run_reads`.

It plans pieces (:mod:`.plan`: large ranges split so several threads share them, runs of
small neighbours read with one request), runs them on the one runner
(:func:`.threads.run_all`: the first error cancels the rest), lands each piece straight in
its destination's memory where it can, else in the thread's staging double buffer
(:mod:`.staging`: a dtype cast, a GPU destination, a read only checksummed), combines the
pieces' crc32c per task (:func:`~shardpoint._checksum.combine_runs`) and checks it. The bytes
come from a byte source: :class:`~.files.LocalFiles` (held descriptors, the C loops,
``O_DIRECT``) or :class:`ObjectRanges` (an object store's ranged GETs). A failure raises,
or, with ``problems=`` (verify), is handed to that sink and the other tasks go on.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .. import _checksum
from .._format.dtypes import OutOfRange, narrows
from .._options import current_options
from ..errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    MissingShardError,
)
from . import plan
from .files import LocalFiles, read_errors_named
from .memory import byte_view
from .plan import ReadTask
from .staging import Staging
from .threads import run_all

Advance = Callable[[int], None]


class ByteSource(Protocol):
    """Where the read engine's bytes come from (:class:`~.files.LocalFiles`, :class:`ObjectRanges`)."""

    def threads(self, tasks: Sequence[ReadTask]) -> int:
        """How many of these reads to run at once by default."""

    def piece_bytes(self) -> int:
        """The largest piece read in one go into a destination's own memory."""

    def tapered(self) -> bool:
        """Whether the last :meth:`threads` found reads that wait (on a disk, a network):
        their pieces then shrink towards the end, so the threads finish together. Copies
        from the page cache keep whole pieces (each piece's mapped copy sets up windows)."""

    def fill(self, task: ReadTask, view: memoryview, at: int, check: bool) -> tuple[int, int]:
        """Read ``view`` from ``at`` of the task's file: (bytes read, their crc32c if ``check``)."""

    def fill_run(self, task: ReadTask, view: memoryview, at: int) -> int:
        """Read ``view`` from ``at`` of the task's file, unchecked; return the bytes read."""

    def close(self) -> None:
        """Release what the reads held (descriptors)."""


class RangedStore(Protocol):
    """What the engines need of an object store (``RemoteStore``)."""

    def read_range(self, name: str, start: int, nbytes: int) -> bytes: ...

    def url_of(self, name: str) -> str: ...


class ObjectRanges:
    """An object store as the read engine's byte source: one ranged GET per piece, its bytes
    copied once, into the destination's memory or the staging buffer."""

    def __init__(self, store: RangedStore) -> None:
        self.store = store

    def threads(self, tasks: Sequence[ReadTask]) -> int:
        return current_options().remote.threads

    def piece_bytes(self) -> int:
        return current_options().remote.read_bytes

    def tapered(self) -> bool:
        return True

    def _get(self, task: ReadTask, at: int, nbytes: int) -> bytes:
        try:
            return self.store.read_range(task.path, at, nbytes)
        except FileNotFoundError:
            raise MissingShardError(
                f"{task.name} is missing: the checkpoint lists it but the store does not have it "
                "(deleted?); the checkpoint is incomplete (upload the object again or load "
                "another checkpoint)"
            ) from None

    def fill(self, task: ReadTask, view: memoryview, at: int, check: bool) -> tuple[int, int]:
        data = self._get(task, at, len(view))
        view[: len(data)] = data
        return len(data), _checksum.crc32c(data) if check else 0

    def fill_run(self, task: ReadTask, view: memoryview, at: int) -> int:
        return self.fill(task, view, at, False)[0]

    def close(self) -> None:
        pass


def mismatch(task: ReadTask, got: int) -> ChecksumMismatchError:
    """The one checksum-mismatch error of a read."""
    return ChecksumMismatchError(
        f"{task.name}, tensor {task.label!r}: crc32c of the stored bytes is {got:#010x}, "
        f"the manifest recorded {task.crc32c or 0:#010x}; the file is damaged. Restore it from "
        "a copy, or load an earlier checkpoint"
    )


def _truncated(task: ReadTask, at: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{task.name}: unexpected end of file at byte {at}; the file is truncated")


def _straight(task: ReadTask) -> bool:
    """Whether the task's bytes land in its destination's memory as they are."""
    dest = task.dest
    return dest is not None and dest.is_cpu and dest.dtype == task.stored_dtype


def _plan(tasks: Sequence[ReadTask], straight_piece: int, staged_piece: int, threads: int = 1) -> list[Any]:
    """Work items: (first, stop) for a run of small tasks read together, (i, task, start,
    end) for a piece of one task; pieces shrink towards the end of the work
    (:func:`.plan.tapered_pieces`) so that the ``threads`` finish together."""
    # Small tasks reading neighbouring bytes of one file straight into CPU memory (or only
    # checksummed) are read together: one request into one buffer, split by the run
    # (``_read_small_run``).
    candidates = [
        (task.path, task.start, task.nbytes)
        if task.dest is None
        or (
            _straight(task)
            and task.dest.is_contiguous()
            and task.dest.nbytes == task.nbytes  # copied with memmove: exactly its bytes
        )
        else ("", -1, plan.SMALL_TENSOR_BYTES + 1)
        for task in tasks
    ]
    run_at = dict(plan.same_file_runs(candidates))
    work: list[Any] = []
    left = sum(task.nbytes for task in tasks)
    i = 0
    while i < len(tasks):
        stop = run_at.get(i)
        if stop is not None:
            work.append((i, stop))
            left -= sum(task.nbytes for task in tasks[i:stop])
            i = stop
            continue
        task = tasks[i]
        # A piece cast or copied out goes through the staging buffer in one go; one only
        # checksummed (no destination) is read a buffer at a time, a long stream per thread.
        staged = task.dest is not None and not _straight(task)
        for start, end in plan.tapered_pieces(task.nbytes, staged_piece if staged else straight_piece, left, threads):
            work.append((i, task, start, end))
        left -= task.nbytes
        i += 1
    return work


def _read_small_run(source: ByteSource, tasks: Sequence[ReadTask]) -> list[int]:
    """Read the bytes of small tasks lying back to back in one file with one request into
    one buffer, then checksum each task's slice (in cache) and copy it into its tensor (if
    it has one).

    Returns the crc32c of each task's bytes (0 where it carries no crc to check).
    """
    start = tasks[0].start
    nbytes = tasks[-1].start + tasks[-1].nbytes - start
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = source.fill_run(tasks[0], view, start)
    if got < nbytes:
        raise _truncated(next(t for t in tasks if t.start + t.nbytes > start + got), start + got)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if nbytes else 0
    memmove = ctypes.memmove
    crcs = []
    for task in tasks:
        pos = task.start - start
        size = task.nbytes
        crcs.append(_checksum.crc32c_update(view[pos : pos + size], 0) if task.crc32c is not None else 0)
        if size and task.dest is not None:
            memmove(task.dest.data_ptr(), base + pos, size)
    del view
    return crcs


def run_reads(
    tasks: Sequence[ReadTask],
    source: ByteSource | None = None,
    *,
    threads: int | None = None,
    advance: Advance | None = None,
    staging_bytes: int | None = None,
    problems: Callable[[ReadTask, CheckpointError], None] | None = None,
    out_of_range: OutOfRange | None = None,
) -> int:
    """Run read tasks on the reader threads, checking crc32c where the task carries one; return
    the bytes read.

    ``source``: where the bytes come from (default :class:`~.files.LocalFiles`; an
    :class:`ObjectRanges` reads an object store), closed when the reads are done.
    ``threads``: default the source's (:func:`.threads.reader_threads` for local files,
    ``RemoteOptions.threads`` for a store).
    ``staging_bytes`` bounds each thread's staging buffer (two per thread) for reads that
    cannot land in the destination directly (a dtype cast, a GPU destination); default
    ``IOOptions.staging_buffer_bytes``. ``problems``: where each task's failure (a read
    error, a truncated file, a crc mismatch) goes instead of being raised; every other task
    is still read. ``out_of_range``: where each cast to a narrower float (float32 to float16)
    tallies the values past its range, counted in the staging buffer before the cast.
    """
    src: ByteSource = LocalFiles() if source is None else source
    staging_bytes = staging_bytes or current_options().io.staging_buffer_bytes
    straight_piece = src.piece_bytes()
    staged_piece = min(max(staging_bytes // 64 * 64, 64), straight_piece)
    threads = threads or src.threads(tasks)
    staging = Staging()
    used_cuda: set[torch.device] = set()
    lock = threading.Lock()
    crcs: dict[int, list[tuple[int, int, int]]] = {}
    whole: dict[int, int] = {}
    """crc32c of each task read in a small run (each whole, in one piece)."""
    failed: set[int] = set()
    total = [0]

    def read_piece(item: Any) -> None:
        if len(item) == 2:
            first, stop = item
            run_crcs = _read_small_run(src, tasks[first:stop])
            nbytes = sum(t.nbytes for t in tasks[first:stop])
            if advance is not None:
                advance(nbytes)
            with lock:
                whole.update(zip(range(first, stop), run_crcs, strict=True))
                total[0] += nbytes
            return
        i, task, start, end = item
        dest = task.dest
        check = task.crc32c is not None
        if _straight(task):
            at = task.start + start
            got, crc = src.fill(task, byte_view(dest)[start:end], at, check) if end > start else (0, 0)
            if got != end - start:
                raise _truncated(task, at + got)
            if advance is not None:
                advance(got)
        else:
            device = dest.device if dest is not None else torch.device("cpu")
            tally = out_of_range if dest is not None and narrows(task.stored_dtype, dest.dtype) else None
            parts = []
            for lo, hi in plan.pieces(end - start, staged_piece):
                # The buffer grows to a piece, never past what is read.
                slot, buffer = staging.take(max(hi - lo, 1), for_device=device)
                at = task.start + start + lo
                n, c = src.fill(task, byte_view(buffer)[: hi - lo], at, check) if hi > lo else (0, 0)
                if n != hi - lo:
                    raise _truncated(task, at + n)
                if advance is not None:
                    advance(n)
                if dest is not None and hi > lo:
                    if tally is not None:
                        tally.check(task.label, buffer[: hi - lo].view(task.stored_dtype), dest.dtype)
                    staging.copy_out(slot, buffer, dest, task.stored_dtype, start + lo, start + hi)
                    if dest.device.type == "cuda":
                        used_cuda.add(dest.device)
                parts.append((lo, c, n))
            got = end - start
            crc = parts[0][1] if len(parts) == 1 or not check else _checksum.combine_runs(parts, got, where=task.name)
        with lock:
            total[0] += got
            if check:
                crcs.setdefault(i, []).append((start, crc, end - start))

    def run(item: Any) -> None:
        try:
            with read_errors_named((tasks[item[0]] if len(item) == 2 else item[1]).name):
                read_piece(item)
        except CheckpointError as exc:
            if problems is None:
                raise
            first, stop = (item[0], item[1]) if len(item) == 2 else (item[0], item[0] + 1)
            with lock:
                for i in range(first, stop):
                    if i not in failed:
                        failed.add(i)
                        problems(tasks[i], exc)

    try:
        run_all(run, _plan(tasks, straight_piece, staged_piece, threads if src.tapered() else 1), threads)
    finally:
        src.close()
        for device in used_cuda:  # every asynchronous copy has landed before we return
            torch.cuda.synchronize(device)
    for i, task in enumerate(tasks):
        if task.crc32c is None or i in failed:
            continue
        got = whole.get(i)
        if got is None:
            got = _checksum.combine_runs(crcs.get(i, []), task.nbytes, where=task.name)
        if got != task.crc32c:
            if problems is None:
                raise mismatch(task, got)
            problems(task, mismatch(task, got))
    return total[0]


def header_reader(store: RangedStore, name: str, size: int) -> Callable[[int, int], bytes]:
    """A ``pread(n, offset)`` for reading a safetensors header in (usually) one request:
    the first call fetches up to 64 KiB and later calls inside that window reuse it."""
    cache: list[tuple[int, bytes]] = []

    def pread(n: int, offset: int) -> bytes:
        for start, data in cache:
            if start <= offset and offset + n <= start + len(data):
                return data[offset - start : offset - start + n]
        want = min(size - offset, max(n, 64 << 10))
        data = store.read_range(name, offset, want)
        cache.append((offset, data))
        return data[:n]

    return pread
