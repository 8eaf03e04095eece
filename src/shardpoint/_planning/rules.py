"""Regular shardings described by a rule instead of a list of chunks. Pure.

A tensor that FSDP2 (``Shard(0)``), tensor parallelism (``Shard(d)``), a 2-D mesh or
``Replicate`` spreads over the ranks is cut by a *grid*: dimension ``d`` into ``grid[d]``
cells the way ``torch.chunk`` (and so ``DTensor``) cuts it, ``ceil(n / k)`` elements each,
the last ones shorter or empty. The rank that stores cell ``c`` is an affine function of
the cell's index, ``base + sum(c[d] * strides[d])``. So the tensor's whole layout over
10 000 ranks is a few integers (:class:`Rule`), the same on every rank; the per-chunk facts
that only the writer knows (its file and crc32c) go to that rank's own table
(``_format/tables.py``), which a loader reads only when it needs one of its chunks.

:func:`plan_rules` chooses the writers of the cells that several ranks hold (one copy is
written, the bytes balanced over the ranks); every rank runs it on the same description and
gets the same answer, so the coordinator only checks that the descriptions agree.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np


class Rule(NamedTuple):
    """Where a regularly sharded tensor is stored: a grid of cells and their writers."""

    grid: tuple[int, ...]
    """Cells per dimension (``torch.chunk`` cuts: ``ceil(n / k)`` elements per cell)."""
    base: int
    """The rank that stores cell (0, 0, ...)."""
    strides: tuple[int, ...]
    """How the writer rank grows with the cell index in each dimension."""

    def writer(self, cell: Sequence[int]) -> int:
        """The rank that stores ``cell``.

        >>> Rule((4, 2), 0, (2, 1)).writer((3, 1))
        7
        """
        return self.base + sum(c * s for c, s in zip(cell, self.strides, strict=True))

    @property
    def cells(self) -> int:
        return math.prod(self.grid)


class Entry(NamedTuple):
    """One tensor of a regular state as every rank describes it (before writers are chosen)."""

    component: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    grid: tuple[int, ...]
    strides: tuple[int, ...]
    """Writer-rank step per cell index, per dimension (the sharding mesh dimensions)."""
    replicas: tuple[tuple[int, int], ...]
    """(size, rank stride) of each mesh dimension the tensor is replicated over; the writer
    of a cell is the holder at one chosen replica position. ``((world, 1),)`` for a plain
    tensor every rank holds."""


def cell_size(n: int, k: int) -> int:
    """Elements per cell when ``n`` is cut into ``k`` (``torch.chunk``'s rule)."""
    return -(-n // k) if n else 0


def cell_box(shape: Sequence[int], grid: Sequence[int], cell: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of ``cell`` in a tensor of ``shape`` cut by ``grid``; a cell past the
    end is empty (its shape holds a 0).

    >>> cell_box((10, 4), (4, 1), (3, 0))   # ceil(10 / 4) = 3 rows per cell
    ((9, 0), (1, 4))
    >>> cell_box((2,), (4,), (3,))
    ((2,), (0,))
    """
    offsets, lengths = [], []
    for n, k, i in zip(shape, grid, cell, strict=True):
        size = cell_size(n, k)
        start = min(n, i * size)
        offsets.append(start)
        lengths.append(min(n, start + size) - start)
    return tuple(offsets), tuple(lengths)


def cell_of(shape: Sequence[int], grid: Sequence[int], offsets: Sequence[int]) -> tuple[int, ...]:
    """The cell that starts at ``offsets`` (a non-empty one)."""
    return tuple(o // cell_size(n, k) if n else 0 for n, k, o in zip(shape, grid, offsets, strict=True))


def linear(grid: Sequence[int], cell: Sequence[int]) -> int:
    """Row-major number of ``cell`` (how tables name it).

    >>> linear((4, 2), (3, 1)), unravel((4, 2), 7)
    (7, (3, 1))
    """
    index = 0
    for k, c in zip(grid, cell, strict=True):
        index = index * k + c
    return index


def unravel(grid: Sequence[int], index: int) -> tuple[int, ...]:
    out = []
    for k in reversed(grid):
        index, c = divmod(index, k)
        out.append(c)
    return tuple(reversed(out))


def cells_overlapping(
    shape: Sequence[int], grid: Sequence[int], offsets: Sequence[int], box: Sequence[int]
) -> Iterator[tuple[int, ...]]:
    """The non-empty cells that overlap the box at ``offsets`` of shape ``box``, in
    row-major order: only these are read (and only their writers' tables).

    >>> list(cells_overlapping((8, 4), (4, 2), (3, 0), (2, 2)))
    [(1, 0), (2, 0)]
    """
    ranges = []
    for n, k, o, b in zip(shape, grid, offsets, box, strict=True):
        size = cell_size(n, k)
        if b == 0 or size == 0:
            return
        ranges.append(range(o // size, min(k, -(-(o + b) // size))))
    yield from itertools.product(*ranges)


def describe_checks(rule: Rule, shape: Sequence[int], world_size: int) -> str | None:
    """What is wrong with ``rule`` for a tensor of ``shape`` saved by ``world_size`` ranks
    (None when nothing): the grid must fit the tensor's rank count and every writer must be
    a rank of the save. Each rank stores at most one cell of a tensor, so a grid never has
    more cells than ranks: nothing a forged manifest says makes a load iterate past that."""
    if len(rule.grid) != len(shape) or len(rule.strides) != len(shape):
        return f"grid {list(rule.grid)[:8]} / strides {list(rule.strides)[:8]} do not match shape {list(shape)[:8]}"
    if any(k < 1 for k in rule.grid) or any(s < 0 for s in rule.strides) or rule.base < 0:
        return f"grid {list(rule.grid)[:8]}, base {rule.base} or strides {list(rule.strides)[:8]} are negative or zero"
    if math.prod(rule.grid) > world_size:
        return f"grid {list(rule.grid)[:8]} has more cells than the {world_size} ranks that saved it"
    last = rule.base + sum((k - 1) * s for k, s in zip(rule.grid, rule.strides, strict=True))
    if last >= world_size:
        return f"its cells are written by rank {last}, but only {world_size} ranks saved it"
    return None


SPLIT_PIECES_PER_RANK = 8
SPLIT_MIN_PIECE_BYTES = 4 << 20


def plan_rules(entries: Sequence[Entry], world_size: int) -> list[Rule]:
    """Choose the writers of every tensor of a regular state; the same answer on every rank.

    - A cell one rank holds is written by it.
    - A tensor every rank holds (a plain tensor, or replicated over the whole mesh) that is
      larger than ``1 / (8 x world)`` of all such bytes is cut into row pieces, piece ``j``
      written by rank ``j`` (no piece under 4 MiB): one embedding is often a fifth of a
      model, and one writer for it would leave the ranks' bytes far apart. Smaller ones go,
      largest first, to the rank with the fewest bytes so far (ties: lowest rank).
    - A tensor replicated over part of the mesh (HSDP's replica groups, a TP-replicated
      bias) is written by one replica position, taken in turn tensor by tensor.

    The work is linear in tensors and cells (numpy over the cells of each tensor) plus
    ``log(world)`` per replicated tensor.

    >>> w = Entry("model", "w", "F32", (8, 2), 4, (1, 1), (0, 0), ((2, 1),))   # 64 bytes, 2 holders
    >>> s = Entry("model", "s", "F32", (4,), 4, (2,), (1,), ())               # Shard(0) over 2 ranks
    >>> plan_rules([s, w], 2)
    [Rule(grid=(2,), base=0, strides=(1,)), Rule(grid=(1, 1), base=0, strides=(0, 0))]
    """
    load = np.zeros(world_size, dtype=np.int64)
    rules: list[Rule | None] = [None] * len(entries)
    everyone = [i for i, e in enumerate(entries) if _held_by_all(e, world_size)]
    held_by_all = set(everyone)
    threshold = sum(_nbytes(entries[i]) for i in everyone) / (SPLIT_PIECES_PER_RANK * max(1, world_size))
    for i in everyone:  # large ones: a row piece per rank
        e = entries[i]
        count = min(world_size, e.shape[0] if e.shape else 0, _nbytes(e) // SPLIT_MIN_PIECE_BYTES)
        if _nbytes(e) > threshold and count >= 2:
            rules[i] = Rule((count,) + (1,) * (len(e.shape) - 1), 0, (1,) + (0,) * (len(e.shape) - 1))
    rest = sorted((i for i in everyone if rules[i] is None), key=lambda i: -_nbytes(entries[i]))
    turn = 0
    for i, e in enumerate(entries):
        if i in held_by_all:
            continue
        if e.replicas:
            replica = turn % math.prod(size for size, _ in e.replicas)
            turn += 1
            base = 0
            for size, stride in reversed(e.replicas):
                replica, coord = divmod(replica, size)
                base += coord * stride
            rules[i] = Rule(e.grid, base, e.strides)
        else:
            rules[i] = Rule(e.grid, 0, e.strides)
    if not rest:  # nothing to place by bytes (an FSDP2 or TP state): no loads to add up
        return [r for r in rules if r is not None]
    for i, e in enumerate(entries):
        rule = rules[i]
        if rule is not None:
            _add_load(load, e, rule)
    heap = [(int(b), r) for r, b in enumerate(load)]
    heapq.heapify(heap)
    for i in rest:  # largest first, to the least loaded rank (ties: the lowest)
        e = entries[i]
        nbytes, rank = heapq.heappop(heap)
        rules[i] = Rule((1,) * len(e.shape), rank, (0,) * len(e.shape))
        heapq.heappush(heap, (nbytes + _nbytes(e), rank))
    return [r for r in rules if r is not None]


def _held_by_all(e: Entry, world_size: int) -> bool:
    return all(k == 1 for k in e.grid) and math.prod(size for size, _ in e.replicas) == world_size


def _nbytes(e: Entry) -> int:
    return math.prod(e.shape) * e.itemsize


def _add_load(load: np.ndarray, e: Entry, rule: Rule) -> None:
    """Add the bytes of each cell to its writer's load (vectorized over the cells)."""
    if math.prod(e.shape) == 0:
        return
    writers = np.full((), rule.base, dtype=np.int64)
    sizes = np.full((), e.itemsize, dtype=np.int64)
    for n, k, s in zip(e.shape, rule.grid, rule.strides, strict=True):
        size = cell_size(n, k)
        starts = np.minimum(np.arange(k, dtype=np.int64) * size, n)
        lengths = np.minimum(starts + size, n) - starts
        writers = writers[..., None] + np.arange(k, dtype=np.int64) * s
        sizes = sizes[..., None] * lengths
    load += np.bincount(writers.ravel(), weights=sizes.ravel(), minlength=len(load)).astype(np.int64)
