"""``verify_checkpoint``'s reads: every data file's header, then the stored bytes of every
tensor through the read engine into a sink (:func:`~shardpoint._io.reads.run_reads` with
``problems=``): each failure a problem naming the file and tensor, the reads going on."""

from __future__ import annotations

import os

import torch

from ._checkpoint import Checkpoint
from ._format.manifest import ChunkRef
from ._format.safetensors import SafetensorsHeader
from ._io.reads import ReadTask, run_reads
from ._io.threads import reader_threads
from ._progress import byte_progress
from ._verify_report import CrcItem, Findings, file_label, name_list
from .errors import CheckpointError, StorageError

VERIFY_BUFFER_BYTES = 2 << 20
"""Each reader thread's buffer for the bytes it checksums: reused for every read, so that
each lands in the CPU cache where its crc32c reads it (8 MiB took 1.8x as long warm)."""


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
    """Read every item's bytes through crc32c (the read engine, into a sink); return bytes read."""
    per_file: dict[str, list[CrcItem]] = {}
    for item in items:
        per_file.setdefault(item.file, []).append(item)
    tasks: list[ReadTask] = []
    names: dict[str, str] = {}
    """How problems name each file -> the file."""
    for fname, held in per_file.items():
        where = file_label(ckpt, fname)
        try:
            # The checkpoint's held descriptor: the version that was opened.
            fd = ckpt.held_fd(fname)
            path = ckpt.file_path(fname)
            if fd >= 0 and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # read once, front to back
        except (OSError, CheckpointError) as exc:
            found.problem(fname, f"{where} cannot be read: {exc}")
            continue
        names[where] = fname
        for item in sorted(held, key=lambda i: i.start):
            tasks.append(ReadTask(where, path, item.start, item.nbytes, None, torch.uint8, item.crc32c, item.label, fd))
    failed: list[tuple[int, str]] = []
    order = {id(task): i for i, task in enumerate(tasks)}
    name = os.path.basename(os.path.normpath(ckpt.location))
    with byte_progress(sum(t.nbytes for t in tasks), f"verifying {name}", progress) as advance:
        # A thread per file (one stream each: a cold disk reads one file fastest front to
        # back), on local files; an object store's ranged GETs on its own threads.
        read = run_reads(
            tasks, ckpt.byte_source(min(reader_threads(), max(len(names), 1))), advance=advance,
            staging_bytes=VERIFY_BUFFER_BYTES,
            problems=lambda task, exc: failed.append((order[id(task)], str(exc))),
        )
    if failed and ckpt.store is not None:  # an object store holds no snapshot: overwritten meanwhile?
        replaced = ckpt.replaced_meanwhile(tasks[i].path for i, _ in failed)
        if replaced is not None:
            raise StorageError(
                f"{file_label(ckpt, replaced)} was replaced by another save while it was verified (an object store "
                "holds no snapshot: an overwrite replaces its objects one by one); the bytes that did not match "
                "were the new save's. Verify again, or verify a step nothing writes over"
            )
    for i, message in sorted(failed):  # in file order, whichever thread found them first
        found.problem(names[tasks[i].name], message)
    return read
