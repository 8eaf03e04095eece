"""``verify_checkpoint``'s reads: every data file's header, then the stored bytes of every
tensor streamed through crc32c (several files at once, one reused buffer per file, ranged
reads on an object store), each mismatch a problem naming the file and tensor."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ._checkpoint import Checkpoint
from ._checksum import crc32c
from ._format.manifest import ChunkRef
from ._format.safetensors import SafetensorsHeader
from ._io.transfer import reader_threads
from ._options import adopt, current_options
from ._progress import byte_progress
from ._storage.remote import RemoteStore
from ._verify_report import CrcItem, Findings, file_label, name_list
from .errors import (
    CheckpointError,
)


def read_headers(
    ckpt: Checkpoint,
    files: list[str],
    chunks_in: dict[str, list[tuple[str, str, ChunkRef]]],
    found: Findings,
) -> dict[str, SafetensorsHeader]:
    """Validate every file's size and header; a file that fails is reported with what it held."""
    headers: dict[str, SafetensorsHeader] = {}
    for fname in files:
        try:
            headers[fname] = ckpt.header(fname)
            continue
        except CheckpointError as exc:
            message = str(exc)
        except OSError as exc:
            where = file_label(ckpt, fname)
            message = f"{where} cannot be read: {exc.strerror or exc}"
        held = list(dict.fromkeys(label for label, _, _ in chunks_in.get(fname, [])))
        unnamed = [label for label in held if repr(label) not in message]
        if unnamed:
            message += f"; it holds {name_list(held)}"
        found.problem(fname, message)
    return headers


def check_crcs(
    ckpt: Checkpoint, items: list[CrcItem], found: Findings, *, progress: bool | None
) -> int:
    """Stream every item's bytes through crc32c, several files at once; return bytes read."""
    cfg = current_options()
    per_file: dict[str, list[CrcItem]] = {}
    for item in items:
        per_file.setdefault(item.file, []).append(item)
    total = sum(item.nbytes for item in items)
    name = os.path.basename(os.path.normpath(ckpt.location))
    lock = threading.Lock()
    read = [0]

    with byte_progress(total, f"verifying {name}", progress) as advance:

        def run(fname: str) -> None:
            got, problems = _crc_file(
                ckpt, fname, per_file[fname], segment=cfg.io.segment_bytes, advance=advance
            )
            with lock:
                read[0] += got
                for message in problems:
                    found.problem(fname, message)

        threads = max(1, min(reader_threads(), len(per_file)))
        if threads == 1:
            for fname in per_file:
                run(fname)
        else:
            with ThreadPoolExecutor(
                threads, thread_name_prefix="shardpoint-verify", initializer=adopt, initargs=(current_options(),)
            ) as pool:
                for fut in [pool.submit(run, f) for f in per_file]:
                    fut.result()
    return read[0]


def _crc_file(
    ckpt: Checkpoint,
    fname: str,
    items: list[CrcItem],
    *,
    segment: int,
    advance: Callable[[int], None] | None,
) -> tuple[int, list[str]]:
    """crc32c of each item of one file, read in ``segment``-byte pieces into one reused buffer."""
    where = file_label(ckpt, fname)
    problems: list[str] = []
    read = 0
    if ckpt.store is not None:
        return _crc_object(ckpt.store, fname, where, items, advance=advance)
    try:
        # The checkpoint's held descriptor (the version that was opened), duplicated.
        fd = os.dup(ckpt.fd(fname))
    except (OSError, CheckpointError) as exc:
        return 0, [f"{where} cannot be read: {exc}"]
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buffer = memoryview(bytearray(max(1, min(segment, max(i.nbytes for i in items)))))
        for item in sorted(items, key=lambda i: i.start):
            crc, pos, end = 0, item.start, item.start + item.nbytes
            try:
                while pos < end:
                    n = os.preadv(fd, [buffer[: min(len(buffer), end - pos)]], pos)
                    if n <= 0:
                        raise EOFError(pos)
                    crc = crc32c(buffer[:n], crc)
                    pos += n
                    read += n
                    if advance is not None:
                        advance(n)
            except EOFError:
                problems.append(
                    f"{where}, tensor {item.label!r}: unexpected end of file at byte {pos}; "
                    "the file is truncated"
                )
                continue
            except OSError as exc:
                problems.append(f"{where}, tensor {item.label!r}: read failed at byte {pos}: {exc}")
                continue
            if crc != item.crc32c:
                problems.append(
                    f"{where}, tensor {item.label!r}: crc32c of the stored bytes is {crc:#010x}, "
                    f"the manifest recorded {item.crc32c:#010x}; the file is damaged. Restore it "
                    "from a copy, or use an earlier checkpoint"
                )
    finally:
        os.close(fd)
    return read, problems


def _crc_object(
    store: RemoteStore,
    fname: str,
    where: str,
    items: list[CrcItem],
    *,
    advance: Callable[[int], None] | None,
) -> tuple[int, list[str]]:
    """crc32c of each item of one remote object, one ranged read per piece."""
    piece = current_options().remote.read_bytes
    problems: list[str] = []
    read = 0
    for item in sorted(items, key=lambda i: i.start):
        crc, pos, end = 0, item.start, item.start + item.nbytes
        try:
            while pos < end:
                data = store.read_range(fname, pos, min(piece, end - pos))
                crc = crc32c(data, crc)
                pos += len(data)
                read += len(data)
                if advance is not None:
                    advance(len(data))
        except (OSError, CheckpointError) as exc:
            problems.append(f"{where}, tensor {item.label!r}: read failed at byte {pos}: {exc}")
            continue
        if crc != item.crc32c:
            problems.append(
                f"{where}, tensor {item.label!r}: crc32c of the stored bytes is {crc:#010x}, "
                f"the manifest recorded {item.crc32c:#010x}; the object is damaged. Restore it "
                "from a copy, or use an earlier checkpoint"
            )
    return read, problems
