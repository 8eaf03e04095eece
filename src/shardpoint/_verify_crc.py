"""``verify_checkpoint``'s reads: every data file's header, then the stored bytes of every
tensor through the read engine into a sink (:func:`~shardpoint._io.reads.run_reads` with
``problems=``): each failure a problem naming the file and tensor, the reads going on."""

from __future__ import annotations

import os

import torch

from ._checkpoint import Checkpoint
from ._format.manifest import ChunkRef
from ._format.safetensors import SafetensorsHeader
from ._io.files import LocalFiles
from ._io.reads import ByteSource, ObjectRanges, ReadTask, run_reads
from ._progress import byte_progress
from ._verify_report import CrcItem, Findings, file_label, name_list
from .errors import CheckpointError

VERIFY_STAGING_BYTES = 8 << 20
"""Each reader thread's buffer for bytes that are only checksummed."""


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
            fd = ckpt.fd(fname) if ckpt.store is None else -1
            path = ckpt.file_path(fname)
        except (OSError, CheckpointError) as exc:
            found.problem(fname, f"{where} cannot be read: {exc}")
            continue
        names[where] = fname
        for item in sorted(held, key=lambda i: i.start):
            tasks.append(ReadTask(where, path, item.start, item.nbytes, None, torch.uint8, item.crc32c, item.label, fd))
    failed: list[tuple[int, str]] = []
    order = {id(task): i for i, task in enumerate(tasks)}
    name = os.path.basename(os.path.normpath(ckpt.location))
    source: ByteSource = ObjectRanges(ckpt.store) if ckpt.store is not None else LocalFiles()
    with byte_progress(sum(t.nbytes for t in tasks), f"verifying {name}", progress) as advance:
        read = run_reads(
            tasks, source, advance=advance, staging_bytes=VERIFY_STAGING_BYTES,
            problems=lambda task, exc: failed.append((order[id(task)], str(exc))),
        )
    for i, message in sorted(failed):  # in file order, whichever thread found them first
        found.problem(names[tasks[i].name], message)
    return read
