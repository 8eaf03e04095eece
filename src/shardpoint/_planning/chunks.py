"""Pure chunk math: who writes which chunk, and which bytes a reader needs.

A chunk is a box inside a global tensor: ``offsets`` and ``shape`` per dimension, stored
row-major and contiguous. Nothing here touches files or processes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple


class ChunkPlan(NamedTuple):
    """One chunk a rank holds, as announced when a save is planned. (A named tuple: every
    save makes one per tensor, and a state may hold 10^5 small ones.)"""

    component: str
    """The component (top-level key) the tensor belongs to."""
    name: str
    """The tensor's name in its component."""
    dtype: str
    """safetensors dtype string."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor."""
    offsets: tuple[int, ...]
    """Where the chunk starts in the whole tensor, per dimension."""
    shape: tuple[int, ...]
    """Shape of the chunk."""
    nbytes: int
    """Bytes of the chunk."""

    @property
    def ident(self) -> tuple[str, str, tuple[int, ...], tuple[int, ...]]:
        return (self.component, self.name, self.offsets, self.shape)


def assign_writers(plans: Sequence[Sequence[ChunkPlan]]) -> dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], int]:
    """Choose one writer rank per distinct chunk, balancing the bytes each rank writes.

    A chunk held by one rank is written by it. A chunk held by several (replicated) goes,
    largest first, to the holder with the fewest bytes so far (ties: lowest rank).

    >>> a = ChunkPlan("model", "w", "F32", (4,), (0,), (4,), 16)
    >>> b = ChunkPlan("model", "b", "F32", (2,), (0,), (2,), 8)
    >>> sorted(assign_writers([[a, b], [a, b]]).values())
    [0, 1]
    """
    holders: dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    size: dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], int] = {}
    for rank, chunks in enumerate(plans):
        for chunk in chunks:
            holders.setdefault(chunk.ident, []).append(rank)
            size[chunk.ident] = chunk.nbytes
    load = [0] * len(plans)
    owner: dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], int] = {}
    for ident, ranks in holders.items():
        if len(ranks) == 1:
            owner[ident] = ranks[0]
            load[ranks[0]] += size[ident]
    shared = [i for i, r in holders.items() if len(r) > 1]
    order = sorted(range(len(shared)), key=lambda i: -size[shared[i]])
    for i in order:
        ident = shared[i]
        best = min(holders[ident], key=lambda r: (load[r], r))
        owner[ident] = best
        load[best] += size[ident]
    return owner


def split_replicated(
    plans: Sequence[Sequence[ChunkPlan]], *, pieces_per_rank: int = 8, min_piece_bytes: int = 4 << 20
) -> list[list[ChunkPlan]]:
    """Cut large replicated chunks into one row piece per holder, so every rank writes a share.

    A chunk that several ranks hold (a DDP-replicated tensor, or ``Replicate()`` on a mesh
    dimension) and that is larger than ``1 / (pieces_per_rank x world)`` of all replicated
    bytes is split along dim 0 as evenly as its rows allow; piece ``j`` is kept only in the
    list of the ``j``-th holder, who alone will write it. Smaller chunks stay whole and are
    balanced by :func:`assign_writers`. Whole-tensor writers (one embedding is often a fifth
    of a model) would otherwise leave the bytes per rank far apart. No piece is smaller than
    ``min_piece_bytes`` (fewer holders write when there are fewer such pieces): tiny states
    are not worth more chunks.

    >>> w = ChunkPlan("model", "w", "F32", (4, 2), (0, 0), (4, 2), 32)
    >>> [[(p.offsets, p.shape) for p in ranks] for ranks in split_replicated([[w], [w]], min_piece_bytes=1)]
    [[((0, 0), (2, 2))], [((2, 0), (2, 2))]]
    """
    holders: dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    place: dict[tuple[tuple[str, str, tuple[int, ...], tuple[int, ...]], int], int] = {}
    """(chunk, rank) -> the rank's place among the chunk's holders (not ``list.index``:
    that is quadratic in ranks when every rank holds every chunk)."""
    for rank, chunks in enumerate(plans):
        for chunk in chunks:
            ranks = holders.setdefault(chunk.ident, [])
            place[(chunk.ident, rank)] = len(ranks)
            ranks.append(rank)
    shared = {ident for ident, ranks in holders.items() if len(ranks) > 1}
    sizes = {c.ident: c.nbytes for chunks in plans for c in chunks if c.ident in shared}
    threshold = sum(sizes.values()) / (pieces_per_rank * max(1, len(plans)))
    out: list[list[ChunkPlan]] = [[] for _ in plans]
    for rank, chunks in enumerate(plans):
        for chunk in chunks:
            ranks = holders[chunk.ident]
            rows = chunk.shape[0] if chunk.shape else 0
            count = min(len(ranks), rows, chunk.nbytes // max(1, min_piece_bytes))
            if chunk.ident not in shared or chunk.nbytes <= threshold or count < 2:
                out[rank].append(chunk)
                continue
            j = place[(chunk.ident, rank)]
            if j >= count:
                continue  # fewer pieces than holders: the first `count` holders write them
            base, extra = divmod(rows, count)
            start = j * base + min(j, extra)
            length = base + (1 if j < extra else 0)
            row_bytes = chunk.nbytes // rows
            out[rank].append(
                ChunkPlan(
                    chunk.component, chunk.name, chunk.dtype, chunk.global_shape,
                    (chunk.offsets[0] + start, *chunk.offsets[1:]), (length, *chunk.shape[1:]),
                    length * row_bytes,
                )
            )
    return out


def overlapping_pair(boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int] | None:
    """Indices of two boxes (offsets, shape) that share an element, or None.

    A tensor's chunks that hold as many elements as the tensor and fit inside it cover it
    exactly only if no two overlap: a manifest whose chunks overlap would leave part of the
    tensor unread. A sweep along the dimension with the most distinct starts compares each
    box only with those still open there (a rank grid: a handful each), not every pair.

    >>> overlapping_pair([((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    True
    >>> overlapping_pair([((0,), (2,)), ((1,), (2,))])
    (0, 1)
    """
    live = [i for i, (_, shape) in enumerate(boxes) if all(shape)]  # an empty box holds nothing
    if len(live) < 2:
        return None
    ndim = len(boxes[live[0]][0])
    if ndim == 0:
        return live[0], live[1]  # two chunks of one scalar
    dim = max(range(ndim), key=lambda d: len({boxes[i][0][d] for i in live}))
    active: list[tuple[int, int]] = []  # (end along dim, box) of boxes still open at the sweep
    for i in sorted(live, key=lambda i: boxes[i][0][dim]):
        offsets, shape = boxes[i]
        active = [(end, j) for end, j in active if end > offsets[dim]]
        for _, j in active:
            other_offsets, other_shape = boxes[j]
            if all(o < p + q and p < o + s
                   for o, s, p, q in zip(offsets, shape, other_offsets, other_shape, strict=True)):
                return min(i, j), max(i, j)
        active.append((offsets[dim] + shape[dim], i))
    return None


def intersect(
    a_offsets: Sequence[int], a_shape: Sequence[int], b_offsets: Sequence[int], b_shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box shared by two boxes, as (offsets, shape); None when they do not overlap.

    >>> intersect((0, 0), (4, 4), (2, 1), (4, 2))
    ((2, 1), (2, 2))
    """
    lo = [max(a, b) for a, b in zip(a_offsets, b_offsets, strict=True)]
    hi = [min(a + s, b + t) for a, s, b, t in zip(a_offsets, a_shape, b_offsets, b_shape, strict=True)]
    if any(end <= start for start, end in zip(lo, hi, strict=True)) and len(lo) > 0:
        return None
    return tuple(lo), tuple(end - start for start, end in zip(lo, hi, strict=True))


def byte_runs(
    chunk_shape: Sequence[int], box_offsets: Sequence[int], box_shape: Sequence[int], itemsize: int
) -> list[tuple[int, int]]:
    """Contiguous byte ranges (start, length) of a box inside a row-major chunk, in order.

    ``box_offsets`` are relative to the chunk. The runs also tile a row-major buffer of the
    box's shape in the same order, so they can be read back to back into one.

    >>> byte_runs((4, 3), (1, 0), (2, 3), 4)   # two whole rows: one run
    [(12, 24)]
    >>> byte_runs((4, 3), (0, 1), (2, 2), 4)   # a column block: one run per row
    [(4, 8), (16, 8)]
    """
    ndim = len(chunk_shape)
    if ndim == 0:
        return [(0, itemsize)]
    if math.prod(box_shape) == 0:
        return []
    # k: the first dim from which the box spans everything to the end (after dim k).
    k = ndim - 1
    while k > 0 and box_offsets[k] == 0 and box_shape[k] == chunk_shape[k]:
        k -= 1
    inner = math.prod(chunk_shape[k + 1 :]) * itemsize
    run = box_shape[k] * inner
    strides = [math.prod(chunk_shape[d + 1 :]) * itemsize for d in range(ndim)]
    runs = []
    for index in itertools.product(*(range(box_offsets[d], box_offsets[d] + box_shape[d]) for d in range(k))):
        start = sum(i * strides[d] for d, i in enumerate(index)) + box_offsets[k] * strides[k]
        runs.append((start, run))
    return runs
