"""What the I/O engines do, and how they cut it: a :class:`ReadTask` per range to read;
large ranges into pieces that several threads share (their crcs combined afterwards), runs
of small neighbouring tensors into one request each. Pure functions of offsets and sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

SMALL_TENSOR_BYTES = 64 << 10
"""Tensors of at most this many bytes are written (and read) in runs of neighbours: one
``pwrite`` / ``preadv`` (or ranged GET) per run through one buffer, instead of one call (and
one work item of the I/O threads) per tensor, whose fixed cost dwarfs copying a few bytes."""

SMALL_RUN_BYTES = 4 << 20
"""Largest run of small tensors moved by one call."""


class ReadTask(NamedTuple):
    """Read ``nbytes`` at ``start`` of file ``name`` into ``dest``.

    ``dest`` is a contiguous tensor. When it is a CPU tensor of the stored dtype the bytes
    land in its memory directly; otherwise they pass through a staging buffer and are
    cast / copied into it. ``crc32c``, when given, is checked over the whole range.
    (A named tuple: a load makes one per tensor, and a state may hold 10^5 small ones.)
    """

    name: str
    """Names the file in errors."""
    path: str
    """The file: its local path, or its object's name under the store."""
    start: int
    nbytes: int
    dest: torch.Tensor | None
    """None: the bytes are only checksummed (verify), through a staging buffer."""
    stored_dtype: torch.dtype
    crc32c: int | None
    label: str
    """Names the tensor in errors."""
    fd: int = -1
    """The file, already open (held by the opened checkpoint, so that every read sees the
    version that was opened); -1: open ``path`` here."""


def pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """(start, end) of the pieces of ``nbytes`` bytes, each at most ``piece``; one empty
    piece for an empty range (its crc, 0, still gets recorded).

    >>> pieces(10, 4)
    [(0, 4), (4, 8), (8, 10)]
    >>> pieces(0, 4)
    [(0, 0)]
    """
    if nbytes == 0:
        return [(0, 0)]
    return [(start, min(start + piece, nbytes)) for start in range(0, nbytes, piece)]


TAPER_FLOOR_BYTES = 4 << 20
"""Smallest piece :func:`tapered_pieces` cuts (unless the range itself is smaller)."""


def tapered_pieces(nbytes: int, piece: int, left: int, threads: int) -> list[tuple[int, int]]:
    """:func:`pieces` of a range that ``left`` bytes of work (this range's included) finish,
    shrinking towards the end of the work: each piece at most ``piece`` and at most a
    ``2 * threads``-th of the bytes left from its start (in whole MiB), but not below 4 MiB.

    The threads take pieces in order; with equal pieces the last few ran on one or two
    threads while the rest had finished (a 2.14 GB cold load, 8 threads: 3 of 8 busy over
    its last 50 ms). Shrinking pieces let the threads finish together.

    >>> tapered_pieces(64 << 20, 64 << 20, 1 << 30, 8)  # far from the end: whole
    [(0, 67108864)]
    >>> [(b - a) >> 20 for a, b in tapered_pieces(64 << 20, 64 << 20, 64 << 20, 2)]
    [16, 12, 9, 6, 5, 4, 4, 4, 4]
    >>> tapered_pieces(0, 4, 0, 2)
    [(0, 0)]
    >>> tapered_pieces(10, 4, 10, 1)  # one thread: as pieces()
    [(0, 4), (4, 8), (8, 10)]
    """
    if threads <= 1:
        return pieces(nbytes, piece)  # one thread: nothing to balance
    if nbytes == 0:
        return [(0, 0)]
    out = []
    start = 0
    while start < nbytes:
        share = (left - start) // (2 * threads) >> 20 << 20  # whole MiB: pieces stay aligned
        size = min(piece, max(TAPER_FLOOR_BYTES, share))
        out.append((start, min(nbytes, start + size)))
        start += size
    return out


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


def same_file_runs(entries: Sequence[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """:func:`small_runs` over (file, offset, nbytes) entries: a run stays in one file.
    An offset of -1 keeps an entry out of every run.

    >>> same_file_runs([("a", 0, 4), ("a", 4, 4), ("b", 8, 4), ("b", 12, 4)])
    [(0, 2), (2, 4)]
    """
    runs: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(entries) + 1):
        if i == len(entries) or entries[i][0] != entries[first][0]:
            group = [(offset, nbytes) for _path, offset, nbytes in entries[first:i]]
            runs.extend((first + a, first + b) for a, b in small_runs(group))
            first = i
    return runs
