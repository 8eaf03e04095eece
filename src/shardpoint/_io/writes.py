"""The write engine: every data file of a save goes through :func:`run_writes`, into local
files (:class:`LocalFileSink`: ``pwrite`` at planned offsets, many threads per file) or an
object store (:class:`UploadSink`: each file one streamed multipart upload).

One planner cuts each sink's work, one runner runs it (:func:`.threads.run_all`: the first
error cancels the rest), and the crc32c of every (file, key) is combined one way from the
pieces' (:func:`~shardpoint._checksum.combine_runs`). ``write_files`` and ``upload_files``
are the two entry points.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from .._checksum import combine_runs, crc32c
from .._options import current_options
from ..errors import CheckpointError, StorageError
from . import files as _files
from . import plan
from .files import naming, start_writeback
from .memory import byte_view, contiguous_cpu, unchanged_size
from .threads import run_all, writer_threads

Advance = Callable[[int], None]
Piece = tuple[str, str, int, int, int]
"""What writing one work item produced: (file, key, start in the tensor, crc32c, length)."""

_T = TypeVar("_T")


@dataclass(frozen=True)
class FileWrite:
    """One data file to write: its header and, in order, the tensors and their offsets."""

    name: str
    header: bytes
    """Written at offset 0 (empty: someone else writes it, as in a cooperative save)."""
    size: int
    tensors: tuple[tuple[str, torch.Tensor, int], ...]
    """(key, tensor, absolute offset of its first byte)."""


class WriteSink(Protocol):
    """Where the write engine's bytes go."""

    cancelled: threading.Event
    """Set by the runner on the first error: a long write may stop early."""

    def plan(self, files: Sequence[FileWrite]) -> list[Any]:
        """The work items, in the order the threads should take them."""

    def write(self, item: Any) -> list[Piece]:
        """Write one work item."""


def run_writes(sink: WriteSink, files: Sequence[FileWrite], threads: int) -> dict[tuple[str, str], int]:
    """Write ``files`` through ``sink`` on ``threads`` threads; return the crc32c of every
    (file, key), combined from its pieces'."""
    pieces: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    lock = threading.Lock()

    def run(item: Any) -> None:
        done = sink.write(item)
        with lock:
            for fname, key, start, crc, length in done:
                pieces.setdefault((fname, key), []).append((start, crc, length))

    run_all(run, sink.plan(files), threads, cancelled=sink.cancelled)
    return {
        k: v[0][1] if len(v) == 1 else combine_runs(v, sum(n for _, _, n in v), where=f"{k[0]}/{k[1]}")
        for k, v in pieces.items()
    }


# ------------------------------------------------------------------------ local files


class LocalFileSink:
    """Local files, opened by :func:`write_files`: the work is cut into pieces that several
    threads ``pwrite`` at once, round-robin across files, small neighbours in runs."""

    def __init__(self, directory: str, fds: dict[str, int], *, durable: bool, segment: int,
                 advance: Advance | None) -> None:
        self.directory = directory
        self.fds = fds
        self.durable = durable
        self.segment = segment
        self.advance = advance
        self.cancelled = threading.Event()

    def plan(self, files: Sequence[FileWrite]) -> list[Any]:
        # Round-robin across files so concurrent threads mostly hit different inodes. A run
        # of small neighbouring tensors is one item (``small_runs``).
        piece = current_options().io.piece_bytes
        per_file: list[list[Any]] = []
        for f in files:
            items: list[Any] = []
            sizes = [(offset, tensor.numel() * tensor.element_size()) for _key, tensor, offset in f.tensors]
            run_at = dict(plan.small_runs(sizes))
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
                spans = plan.pieces(nbytes, piece) if simple else [(0, nbytes)]
                for start, end in spans:
                    items.append((f.name, key, tensor, offset, start, end))
                i += 1
            per_file.append(items)
        work: list[Any] = []
        for i in range(max((len(x) for x in per_file), default=0)):
            work.extend(items[i] for items in per_file if i < len(items))
        return work

    def write(self, item: Any) -> list[Piece]:
        if len(item) == 4:
            fname, members, at, nbytes = item
            fd = self.fds[fname]
            with naming(os.path.join(self.directory, fname)):
                crcs = _files.write_small_run(fd, members, at, nbytes)
                if self.durable:
                    start_writeback(fd, at, nbytes)
            if self.advance is not None:
                self.advance(nbytes)
            return [(fname, key, 0, crc, size) for (key, crc), (_k, _t, size) in zip(crcs, members, strict=True)]
        fname, key, tensor, offset, start, end = item
        data = byte_view(contiguous_cpu(tensor))
        unchanged_size(key, len(data), tensor.numel() * tensor.element_size(), where=fname)
        fd = self.fds[fname]
        with naming(os.path.join(self.directory, fname)):
            crc = _files.write_range(fd, data[start:end], offset + start, self.segment)
        if self.advance is not None:
            self.advance(end - start)
        if self.durable:
            start_writeback(fd, offset + start, end - start)
        return [(fname, key, start, crc, end - start)]


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
    ``segment``: bytes per ``pwrite`` (default ``IOOptions.segment_bytes``).
    """
    threads = threads or writer_threads()
    fds: dict[str, int] = {}
    try:
        for f in files:
            flags = os.O_WRONLY | os.O_CREAT | (0 if shared else os.O_TRUNC)
            fd = os.open(os.path.join(directory, f.name), flags, 0o644)
            fds[f.name] = fd
            if f.header:
                with naming(os.path.join(directory, f.name)):
                    if shared:
                        os.ftruncate(fd, f.size)
                    _files._pwrite_all(fd, memoryview(f.header), 0)
        sink = LocalFileSink(directory, fds, durable=durable, advance=advance,
                             segment=segment or current_options().io.segment_bytes)
        crcs = run_writes(sink, files, threads)

        def sync(fname: str) -> None:
            with naming(os.path.join(directory, fname)):
                os.fsync(fds[fname])

        if durable:
            run_all(sync, list(fds), threads)
    finally:
        for fd in fds.values():
            os.close(fd)
    return crcs


# ------------------------------------------------------------------------ object store


class UploadStore(Protocol):
    """What the write engine needs of an object store (``RemoteStore``)."""

    def upload(self, name: str, produce: Callable[[Callable[[Any], object]], _T]) -> _T: ...

    def url_of(self, name: str) -> str: ...


class UploadAbortedError(StorageError):
    """A multipart upload vanished before its commit: someone aborted it."""


class UploadSink:
    """An object store: each file is one work item, streamed as one upload (header, then
    each tensor's own memory in ``RemoteOptions.block_bytes`` pieces, crc32c on the way)."""

    def __init__(self, store: UploadStore, *, advance: Advance | None,
                 on_uploaded: Callable[[str], None] | None) -> None:
        self.store = store
        self.advance = advance
        self.on_uploaded = on_uploaded
        self.block = current_options().remote.block_bytes
        self.cancelled = threading.Event()

    def plan(self, files: Sequence[FileWrite]) -> list[Any]:
        return list(files)

    def write(self, item: Any) -> list[Piece]:
        f: FileWrite = item
        try:
            crcs = self.store.upload(f.name, lambda write: self._stream(f, write))
        except FileNotFoundError as exc:  # S3 NoSuchUpload: the multipart upload was aborted
            raise UploadAbortedError(
                f"uploading {self.store.url_of(f.name)} failed: its multipart upload was aborted by "
                "someone else (another save that took this prefix over, or a bucket lifecycle "
                "rule); nothing of this save is committed"
            ) from exc
        if self.on_uploaded is not None:
            self.on_uploaded(f.name)
        return crcs

    def _stream(self, f: FileWrite, write: Callable[[Any], object]) -> list[Piece]:
        if not f.header:
            raise CheckpointError(f"{f.name}: a file without its header cannot be uploaded")
        write(f.header)
        pos = len(f.header)
        done: list[Piece] = []
        for key, tensor, offset in f.tensors:
            if offset < pos:
                raise CheckpointError(f"{f.name}: tensor {key!r} overlaps the previous one in the file plan")
            if offset > pos:
                write(bytes(offset - pos))
                pos = offset
            data = byte_view(contiguous_cpu(tensor))
            unchanged_size(key, len(data), tensor.numel() * tensor.element_size(), where=f.name)
            crc = 0
            for start in range(0, len(data), self.block):
                if self.cancelled.is_set():
                    raise CheckpointError(f"{f.name}: upload cancelled because another upload failed")
                piece = data[start : start + self.block]
                crc = crc32c(piece, crc)
                write(piece)
                if self.advance is not None:
                    self.advance(len(piece))
            done.append((f.name, key, 0, crc, len(data)))
            pos += len(data)
        if pos != f.size:
            raise CheckpointError(f"{f.name}: wrote {pos} bytes but the plan says {f.size}")
        return done


def upload_files(
    store: UploadStore,
    files: Sequence[FileWrite],
    *,
    advance: Advance | None = None,
    on_uploaded: Callable[[str], None] | None = None,
) -> dict[tuple[str, str], int]:
    """Upload planned files concurrently (one file per thread); return (file, key) -> crc32c.

    The first failure cancels the other uploads (each discarded) and is raised.
    """
    sink = UploadSink(store, advance=advance, on_uploaded=on_uploaded)
    return run_writes(sink, files, min(current_options().remote.threads, max(1, len(files))))
