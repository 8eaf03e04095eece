"""A rank's side of a save described by rules (``_planning/rules.py``): no chunk lists sent.

When every tensor of a state is a plain tensor (held by every rank) or a ``DTensor``
sharded by ``Shard(d)`` / ``Replicate()`` on a mesh of the save's ranks, every rank can
describe the whole layout of the state from its own tensors. :func:`describe` does so and
checks that its own chunk is the one the description predicts; the ranks then compare one
digest of it (:func:`digest`) instead of sending the coordinator their chunk lists, and
each rank works out the chunks it writes itself (:func:`my_writes`). Anything else (a
``_StridedShard``, a mesh that is not the save's ranks in order, a nested shard of a
dimension that does not divide evenly, explicit placements) makes the description
``None``: the save then plans from explicit chunk lists, as it always could.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import torch

from .._format.dtypes import DTYPE_TO_NAME, NAME_TO_DTYPE, dtype_name
from .._format.manifest import ChunkRef, ComponentRecord, TensorRecord
from .._planning.chunks import ChunkPlan
from .._planning.rules import Entry, Rule, cell_box, cell_of, linear
from .._prepare import PreparedState
from .group import local_chunk
from .plan_cache import fingerprint


class Description(NamedTuple):
    """A rank's description of a regular state."""

    entries: list[Entry]
    """Every tensor, in save order (the same on every rank)."""
    own: list[tuple[int, ...]]
    """The cell this rank holds of each tensor (all zeros for a tensor it holds whole)."""
    local: list[torch.Tensor]
    """This rank's local tensor of each."""


class MeshLayout(NamedTuple):
    """Where a DTensor's shard sits, as plain data (kept when an async save stages it)."""

    mesh_ranks: tuple[int, ...]
    """The mesh's global ranks, row-major (one tuple shared by the tensors of one mesh)."""
    mesh_shape: tuple[int, ...]
    placements: tuple[tuple[str, int], ...]
    """Per mesh dimension: ("Shard", dim), ("Replicate", 0), or (another placement's class name, 0)."""
    coordinate: tuple[int, ...] | None
    """This rank's place in the mesh."""


def mesh_layout(tensor: Any, seen: dict[int, tuple[int, ...]]) -> MeshLayout:
    """The layout of DTensor ``tensor``; ``seen`` caches each mesh's ranks (a mesh is shared
    by every tensor of a model: its rank list is read once, not once per tensor)."""
    mesh = tensor.device_mesh
    ranks = seen.get(id(mesh))
    if ranks is None:
        ranks = seen[id(mesh)] = tuple(mesh.mesh.flatten().tolist())
    placements = tuple(
        (type(p).__name__, p.dim if type(p).__name__ == "Shard" else 0) for p in tensor.placements
    )
    coord = mesh.get_coordinate()
    return MeshLayout(ranks, tuple(int(s) for s in mesh.mesh.shape), placements,
                      tuple(coord) if coord is not None else None)


def _sharded_entry(
    component: str, name: str, dtype: str, item: int, global_shape: tuple[int, ...], offsets: tuple[int, ...],
    local: torch.Tensor, layout: MeshLayout, group_ranks: tuple[int, ...],
) -> tuple[Entry, tuple[int, ...]] | None:
    """The entry of a shard laid out by ``layout``, and the cell this rank holds; None when
    the layout is not one a rule describes, or the shard is not the cell it predicts."""
    if layout.mesh_ranks != group_ranks or layout.coordinate is None:
        return None
    mesh_shape, coord, shape = layout.mesh_shape, layout.coordinate, global_shape
    stride = [math.prod(mesh_shape[m + 1 :]) for m in range(len(mesh_shape))]
    by_dim: list[list[int]] = [[] for _ in shape]
    replicas = []
    for m, (kind, dim) in enumerate(layout.placements):
        if kind == "Shard":
            by_dim[dim % max(1, len(shape))].append(m)
        elif kind == "Replicate":
            replicas.append((mesh_shape[m], stride[m]))
        else:  # _StridedShard, anything new (Partial is refused when the shard is taken)
            return None
    grid, strides, cell = [], [], []
    for d, dims in enumerate(by_dim):
        k = math.prod(mesh_shape[m] for m in dims)
        if len(dims) > 1 and shape[d] % k:
            return None  # nested uneven cuts are not one torch.chunk cut
        for a, b in itertools.pairwise(dims):
            if stride[a] != mesh_shape[b] * stride[b]:
                return None  # the writer would not be affine in the cell index
        c = 0
        for m in dims:
            c = c * mesh_shape[m] + coord[m]
        grid.append(k)
        strides.append(stride[dims[-1]] if dims else 0)
        cell.append(c)
    want_offsets, want_shape = cell_box(global_shape, grid, cell)
    if math.prod(want_shape):
        if tuple(offsets) != want_offsets or tuple(local.shape) != want_shape:
            return None
    elif local.numel():
        return None
    return Entry(component, name, dtype, global_shape, item, tuple(grid), tuple(strides), tuple(replicas)), tuple(cell)


def describe(prepared: PreparedState, group_ranks: list[int]) -> Description | None:
    """This rank's description of ``prepared``, or None when it is not regular."""
    ranks = tuple(group_ranks)
    world = len(ranks)
    entries: list[Entry] = []
    own: list[tuple[int, ...]] = []
    local: list[torch.Tensor] = []
    seen: dict[int, tuple[int, ...]] = {}
    for comp in prepared.components:
        for name in comp.stored:
            tensor = comp.tensors[name]
            dtype = DTYPE_TO_NAME.get(tensor.dtype) or dtype_name(tensor.dtype, key=name)
            item = NAME_TO_DTYPE[dtype].itemsize
            if name in comp.placements:  # a staged shard (async save): its layout was kept
                layout = comp.layouts.get(name)
                if layout is None:
                    return None
                global_shape, offsets = comp.placements[name]
                found = _sharded_entry(comp.name, name, dtype, item, global_shape, offsets, tensor, layout, ranks)
            elif type(tensor).__name__ == "DTensor":
                layout = mesh_layout(tensor, seen)
                global_shape, offsets, tensor = local_chunk(tensor, name)
                found = _sharded_entry(comp.name, name, dtype, item, global_shape, offsets, tensor, layout, ranks)
            else:
                shape = tuple(tensor.shape)
                entry = Entry(comp.name, name, dtype, shape, item, (1,) * len(shape), (0,) * len(shape), ((world, 1),))
                found = entry, (0,) * len(shape)
            if found is None:
                return None
            if tensor.requires_grad:
                tensor = tensor.detach()
            entries.append(found[0])
            own.append(found[1])
            local.append(tensor)
    return Description(entries, own, local)


def digest(entries: list[Entry], world_size: int) -> str:
    """One string that is equal on two ranks only when their descriptions are."""
    return fingerprint(world_size, *entries)


def my_writes(
    desc: Description, rules: list[Rule], rank: int, world_size: int
) -> tuple[list[ChunkPlan], dict[tuple[str, str], torch.Tensor]]:
    """The chunks this rank writes (the cells whose writer it is) and the tensor of each."""
    plans: list[ChunkPlan] = []
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for e, rule, cell, local in zip(desc.entries, rules, desc.own, desc.local, strict=True):
        if math.prod(e.shape) == 0:  # stored once, whole, by the writer of cell 0
            zeros = (0,) * len(e.shape)
            if rule.writer(zeros) == rank:
                plans.append(ChunkPlan(e.component, e.name, e.dtype, e.shape, zeros, e.shape, 0))
                tensors[(e.component, e.name)] = torch.empty(e.shape, dtype=local.dtype)
            continue
        if rule.grid != e.grid:  # a tensor every rank holds, cut into row pieces
            piece = rank - rule.base
            if not 0 <= piece < rule.grid[0]:
                continue
            cell = (piece,) + (0,) * (len(e.shape) - 1)
        elif rule.writer(cell) != rank:
            continue
        offsets, shape = cell_box(e.shape, rule.grid, cell)
        if not math.prod(shape):
            continue
        if shape != tuple(local.shape):
            local = local.narrow(0, offsets[0], shape[0])
        plans.append(ChunkPlan(e.component, e.name, e.dtype, e.shape, offsets, shape, math.prod(shape) * e.itemsize))
        tensors[(e.component, e.name)] = local
    return plans, tensors


def total_bytes(entries: list[Entry]) -> int:
    """Bytes of every tensor of the state, whole (each stored once)."""
    return sum(math.prod(e.shape) * e.itemsize for e in entries)


def table_rows(
    desc: Description, rules: list[Rule], refs: list[tuple[str, str, ChunkRef]]
) -> list[tuple[int, int, str, int]]:
    """(slot, cell number, file, crc32c) of each chunk this rank wrote, for its table."""
    slot_of = {(e.component, e.name): i for i, e in enumerate(desc.entries)}
    rows = []
    for component, name, ref in refs:
        slot = slot_of[(component, name)]
        e, rule = desc.entries[slot], rules[slot]
        cell = cell_of(e.shape, rule.grid, ref.offsets)
        rows.append((slot, linear(rule.grid, cell), ref.file, ref.crc32c if ref.crc32c is not None else 0))
    return rows


def records(
    prepared: PreparedState, desc: Description, rules: list[Rule]
) -> dict[str, ComponentRecord]:
    """The manifest's records of a save by rules: each tensor's rule, no chunk lists."""
    tensors: dict[str, dict[str, TensorRecord]] = {comp.name: {} for comp in prepared.components}
    for slot, (e, rule) in enumerate(zip(desc.entries, rules, strict=True)):
        tensors[e.component][e.name] = TensorRecord(e.dtype, e.shape, (), rule, slot)
    return {comp.name: ComponentRecord(comp.tree, tensors[comp.name], dict(comp.aliases)) for comp in prepared.components}
