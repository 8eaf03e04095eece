"""The remote I/O loops: concurrent uploads of planned files, and ranged reads into tensors.

They run over a :class:`~shardpoint._storage.remote_store.RemoteStore` (a prefix of an
fsspec filesystem, every request retried by :mod:`~shardpoint._storage.retry`). Where a
save's objects go and in which order they commit is
:class:`~shardpoint._storage.remote_transaction.RemoteTransaction`'s; which store a path
names is decided once, at the API edge, by :func:`~shardpoint._storage.store.open_store`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .._checksum import combine_runs, crc32c
from .._io.transfer import FileWrite, ReadTask, byte_view, contiguous_cpu
from .._options import adopt, current_options
from ..errors import (
    CheckpointError,
    ChecksumMismatchError,
    MissingShardError,
    StateChangedError,
    StorageError,
)
from .remote_store import RemoteStore

if TYPE_CHECKING:  # the static declaration of the lazy re-exports below
    from .store import resolve as resolve
    from .store import store_for as store_for
    from .store import write_files_at as write_files_at

__all__ = ["RemoteStore", "UploadAbortedError", "header_reader", "run_remote_reads", "upload_files"]


# ---------------------------------------------------------------------------- transfers


def _stream_file(
    f: FileWrite,
    write: Callable[[Any], object],
    *,
    block: int,
    cancelled: threading.Event,
    advance: Callable[[int], None] | None,
) -> dict[str, int]:
    """Write one planned file: header, then each tensor's own memory in ``block`` pieces,
    crc32c of each piece computed on the way. Returns key -> crc32c."""
    if not f.header:
        raise CheckpointError(f"{f.name}: a file without its header cannot be uploaded")
    write(f.header)
    pos = len(f.header)
    crcs: dict[str, int] = {}
    for key, tensor, offset in f.tensors:
        if offset < pos:
            raise CheckpointError(f"{f.name}: tensor {key!r} overlaps the previous one in the file plan")
        if offset > pos:
            write(bytes(offset - pos))
            pos = offset
        data = byte_view(contiguous_cpu(tensor))
        if len(data) != tensor.numel() * tensor.element_size():
            raise StateChangedError(
                f"{f.name}: tensor {key!r} changed size while it was being saved (another thread "
                "resized it); nothing was committed. Save when the state is not being changed"
            )
        crc = 0
        for start in range(0, len(data), block):
            if cancelled.is_set():
                raise CheckpointError(f"{f.name}: upload cancelled because another upload failed")
            piece = data[start : start + block]
            crc = crc32c(piece, crc)
            write(piece)
            if advance is not None:
                advance(len(piece))
        crcs[key] = crc
        pos += len(data)
    if pos != f.size:
        raise CheckpointError(f"{f.name}: wrote {pos} bytes but the plan says {f.size}")
    return crcs


class UploadAbortedError(StorageError):
    """A multipart upload vanished before its commit: someone aborted it."""


def upload_files(
    store: RemoteStore,
    files: Sequence[FileWrite],
    *,
    advance: Callable[[int], None] | None = None,
    on_uploaded: Callable[[str], None] | None = None,
) -> dict[tuple[str, str], int]:
    """Upload planned files concurrently (one file per thread); return (file, key) -> crc32c.

    The first failure cancels the other uploads (each discarded) and is raised.
    """
    cfg = current_options()
    cancelled = threading.Event()
    results: dict[tuple[str, str], int] = {}
    lock = threading.Lock()

    def one(f: FileWrite) -> None:
        try:
            crcs = store.upload(
                f.name,
                lambda write: _stream_file(
                    f, write, block=cfg.remote.block_bytes, cancelled=cancelled, advance=advance
                ),
            )
        except FileNotFoundError as exc:  # S3 NoSuchUpload: the multipart upload was aborted
            raise UploadAbortedError(
                f"uploading {store.url_of(f.name)} failed: its multipart upload was aborted by "
                "someone else (another save that took this prefix over, or a bucket lifecycle "
                "rule); nothing of this save is committed"
            ) from exc
        with lock:
            results.update({(f.name, k): c for k, c in crcs.items()})
        if on_uploaded is not None:
            on_uploaded(f.name)

    _run_cancelling(one, list(files), min(cfg.remote.threads, max(1, len(files))), cancelled)
    return results


def _run_cancelling(fn: Callable[[Any], None], items: Sequence[Any], threads: int, cancelled: threading.Event) -> None:
    if not items:
        return
    errors: list[BaseException] = []

    def guarded(item: Any) -> None:
        if cancelled.is_set():
            return
        try:
            fn(item)
        except BaseException as exc:
            if not cancelled.is_set():
                errors.append(exc)
            cancelled.set()

    with ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix="shardpoint-remote",
        initializer=adopt, initargs=(current_options(),),
    ) as pool:
        list(pool.map(guarded, items))
    if errors:
        raise errors[0]


def _pieces(task: ReadTask, piece: int) -> Iterator[tuple[int, int]]:
    if task.nbytes == 0:
        return
    for start in range(0, task.nbytes, piece):
        yield start, min(start + piece, task.nbytes)


def run_remote_reads(
    store: RemoteStore,
    tasks: Sequence[ReadTask],
    *,
    advance: Callable[[int], None] | None = None,
) -> None:
    """Ranged reads of exactly the tasks' bytes, concurrently, into their destinations.

    ``ReadTask.path`` is the object's name under ``store``. Each piece is one ranged GET;
    crc32c is checked where the task carries one (pieces combined per task).
    """
    cfg = current_options()
    work = [(i, task, s, e) for i, task in enumerate(tasks) for s, e in _pieces(task, cfg.remote.read_bytes)]
    crcs: dict[int, list[tuple[int, int, int]]] = {}
    lock = threading.Lock()
    cancelled = threading.Event()

    def run(item: tuple[int, ReadTask, int, int]) -> None:
        i, task, start, end = item
        try:
            data = store.read_range(task.path, task.start + start, end - start)
        except FileNotFoundError:
            raise MissingShardError(
                f"{task.name} is missing: the checkpoint lists it but the store does not have it "
                "(deleted?); the checkpoint is incomplete (upload the object again or load "
                "another checkpoint)"
            ) from None
        if task.crc32c is not None:
            crc = crc32c(data)
            with lock:
                crcs.setdefault(i, []).append((start, crc, end - start))
        direct = task.dest.device.type == "cpu" and task.dest.dtype == task.stored_dtype
        if direct:
            byte_view(task.dest)[start:end] = data
        else:
            staging = torch.empty(end - start, dtype=torch.uint8)
            byte_view(staging)[:] = data
            item_size = torch.empty((), dtype=task.stored_dtype).element_size()
            src = staging.view(task.stored_dtype)
            task.dest.view(-1)[start // item_size : end // item_size].copy_(src)
        if advance is not None:
            advance(end - start)

    threads = min(cfg.remote.threads, max(1, len(work)))
    if threads <= 1:
        for item in work:
            run(item)
    else:
        _run_cancelling(run, work, threads, cancelled)
    for i, task in enumerate(tasks):
        if task.crc32c is None:
            continue
        got = combine_runs(crcs.get(i, []), task.nbytes, where=task.name)
        if got != task.crc32c:
            raise ChecksumMismatchError(
                f"{task.name}, tensor {task.label!r}: crc32c of the stored bytes is {got:#010x}, "
                f"the manifest recorded {task.crc32c:#010x}; the object is damaged. Restore it "
                "from a copy, or load an earlier checkpoint"
            )


def header_reader(store: RemoteStore, name: str, size: int) -> Callable[[int, int], bytes]:
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


_MOVED = {"resolve", "store_for", "write_files_at"}


def __getattr__(name: str) -> Any:
    """Names that moved to :mod:`~shardpoint._storage.store` (the API edge), served lazily for
    callers that still import them from here."""
    if name in _MOVED:
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
