"""A rank's steps of a save, and the coordinator's plan: the writer (``_write.py``) runs them.

Every save, of one process or of many, is two round trips through the coordinator (each a
:meth:`Group.exchange`, so a failure anywhere makes every rank raise one error naming the
failed ranks, and nothing is committed); a group of one runs the same steps in one process:

1. plan: each rank lists the chunks it holds (:func:`plan_local`: DTensor shards, or whole
   plain tensors); the coordinator assigns writers (:func:`assign`: replicated chunks
   written once, balanced by bytes), lays out the shared files for ``hf``
   (:func:`plan_hf`, with the pure planner ``_planning/files.py``) and answers each rank
   with what it writes and where.
2. write: ``chunked`` — each rank writes its chunks to files of its own
   (``model-r00003-00001.safetensors``, :func:`write_chunked`); ``hf`` — a file whose
   tensors one rank holds whole is written by that rank like any file (one process writes
   them all so, to a local directory or an object store); other files are shared: every
   rank ``pwrite``s its chunks' bytes at their planned positions (a dim-0 shard is one
   range; other shards one range per contiguous run; :func:`write_hf_part`). Each rank
   reports its chunk records and crc32c; the coordinator turns them into the manifest's
   records (:func:`chunked_records`, :func:`hf_records`) and commits.

No full tensor is gathered anywhere; a collective ``hf`` save needs a filesystem every rank
sees (``chunked`` also works on an fsspec URL: each rank uploads its own objects under the
final prefix, the coordinator uploads the manifest last).
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any, NamedTuple

import torch

from .._checksum import combine_runs
from .._format.dtypes import DTYPE_TO_NAME, NAME_TO_DTYPE, dtype_name
from .._format.index import index_name
from .._format.manifest import MANIFEST_NAME, ChunkRef, ComponentRecord, Manifest, TensorRecord
from .._format.safetensors import TensorSpec
from .._io.threads import writer_threads
from .._io.writes import FileWrite, write_files
from .._options import current_options
from .._planning.chunks import ChunkPlan, assign_writers, byte_runs, intersect, split_replicated
from .._planning.files import PlannedFile, hf_index, plan_hf_files, plan_rank_files
from .._prepare import PreparedState, hf_sizes
from .._storage import Transaction
from .._version import __version__
from ..errors import InvalidStateError
from .group import local_chunk


def _plan_local(prepared: PreparedState) -> tuple[list[ChunkPlan], dict[tuple[str, str], torch.Tensor]]:
    """The chunks this rank holds, and each one's local tensor."""
    chunks = []
    local_tensors = {}
    names = DTYPE_TO_NAME
    for comp in prepared.components:
        for name in comp.stored:
            tensor = comp.tensors[name]
            dtype = names.get(tensor.dtype) or dtype_name(tensor.dtype, key=name)
            if name in comp.placements:
                (global_shape, offsets), local = comp.placements[name], tensor
                shape = tuple(local.shape)
            elif type(tensor).__name__ != "DTensor":  # a plain tensor: one whole chunk (most states)
                local = tensor
                global_shape = shape = tuple(tensor.shape)
                offsets = (0,) * len(shape)
            else:
                global_shape, offsets, local = local_chunk(tensor, name)
                shape = tuple(local.shape)
            if local.requires_grad:
                local = local.detach()
            chunks.append(ChunkPlan(comp.name, name, dtype, global_shape, offsets, shape, local.nbytes))
            local_tensors[(comp.name, name)] = local
    return chunks, local_tensors


def _tensor_order(all_plans: Sequence[Sequence[ChunkPlan]]) -> dict[str, dict[str, ChunkPlan]]:
    """component -> name -> a plan of it, in first-seen order (rank 0 first)."""
    order: dict[str, dict[str, ChunkPlan]] = {}
    for plans in all_plans:
        for plan in plans:
            order.setdefault(plan.component, {}).setdefault(plan.name, plan)
    return order


def _wanted(plan: ChunkPlan) -> bool:
    """Empty shards of a non-empty tensor (uneven sharding) hold nothing to write."""
    return plan.nbytes > 0 or math.prod(plan.global_shape) == 0


def check_names(prepared: PreparedState, all_plans: Sequence[Sequence[ChunkPlan]],
                merged: Set[tuple[str, str]] = frozenset()) -> None:
    """Refuse a tensor some rank holds that the coordinator's state does not have, unless
    the trees merged from every rank's (``merged``: (component, name) of their tensors)
    refer to it: else it would be saved but never loaded."""
    known = {(comp.name, name) for comp in prepared.components for name in comp.stored} | merged
    tied = {(comp.name, name): to for comp in prepared.components for name, to in comp.aliases.items()}
    for rank, plans in enumerate(all_plans):
        for p in plans:
            if (p.component, p.name) in tied:
                raise InvalidStateError(
                    f"tensor {p.name!r} of component {p.component!r} is tied to {tied[(p.component, p.name)]!r} on "
                    f"rank 0 (one tensor) but a tensor of its own on rank {rank}: in a collective save every rank "
                    "ties the same weights; tie them on every rank, or on none. Nothing was saved"
                )
            if (p.component, p.name) not in known:
                raise InvalidStateError(
                    f"rank {rank} holds tensor {p.name!r} of component {p.component!r}, which rank 0's "
                    "state does not have: in a collective save every rank passes the same structure "
                    "(the same components and names, each rank its own shards of them). Save states "
                    "that differ per rank (pipeline stages) each to its own path, with "
                    "process_group= the ranks of that stage"
                )


_PAIRWISE = 256
"""Up to this many distinct chunks of a tensor are checked pair by pair for overlaps (a
count of elements equal to the whole can hide an overlap and a gap)."""


def check_agreement(all_plans: Sequence[Sequence[ChunkPlan]]) -> None:
    """Refuse, before anything is written, a tensor the ranks describe differently (a plain
    tensor taken as replicated but of another shape or dtype on some rank), or whose chunks
    do not cover it (a DTensor whose mesh has ranks outside the save's group): either was
    committed as a checkpoint that loads rank 0's copy, or not at all."""
    first: dict[tuple[str, str], tuple[int, str, tuple[int, ...]]] = {}
    chunks: dict[tuple[str, str], dict[tuple[tuple[int, ...], tuple[int, ...]], int]] = {}
    for rank, plans in enumerate(all_plans):
        for p in plans:
            key = (p.component, p.name)
            seen = first.setdefault(key, (rank, p.dtype, p.global_shape))
            if (seen[1], seen[2]) != (p.dtype, p.global_shape):
                raise InvalidStateError(
                    f"tensor {p.name!r} of component {p.component!r} is {seen[1]}{list(seen[2])} on rank {seen[0]} "
                    f"but {p.dtype}{list(p.global_shape)} on rank {rank}: in a collective save a tensor has one "
                    "shape and dtype on every rank (a plain tensor is taken as replicated, a DTensor's global shape "
                    "as its placements give it). Make them agree (for a plain tensor held apart on each rank, make "
                    "it a DTensor, or save what differs per rank to a path of its own). Nothing was saved"
                )
            if len(p.offsets) != len(p.global_shape) or any(
                    o < 0 or o + n > g for o, n, g in zip(p.offsets, p.shape, p.global_shape, strict=False)):
                raise InvalidStateError(
                    f"tensor {p.name!r} of component {p.component!r}: rank {rank}'s chunk at {list(p.offsets)} of "
                    f"shape {list(p.shape)} lies outside its shape {list(p.global_shape)} (a DTensor made with "
                    "DTensor.from_local and local shards other than its placements give?). Nothing was saved"
                )
            chunks.setdefault(key, {})[(p.offsets, p.shape)] = math.prod(p.shape)
    for (component, name), held in chunks.items():
        whole = math.prod(first[(component, name)][2])
        if sum(held.values()) == whole and 1 < len(held) <= _PAIRWISE:
            boxes = [box for box, n in held.items() if n]
            for i, (a_at, a_shape) in enumerate(boxes):
                for b_at, b_shape in boxes[i + 1:]:
                    if intersect(a_at, a_shape, b_at, b_shape) is not None:
                        raise InvalidStateError(
                            f"tensor {name!r} of component {component!r}: two ranks' chunks overlap (at "
                            f"{list(a_at)} of shape {list(a_shape)} and at {list(b_at)} of shape {list(b_shape)}) and "
                            "leave a gap elsewhere; save DTensors whose local shards are the ones their placements "
                            "give. Nothing was saved"
                        )
        if sum(held.values()) != whole:
            raise InvalidStateError(
                f"tensor {name!r} of component {component!r}: the ranks of this save hold {sum(held.values())} of its "
                f"{whole} elements in chunks that do not tile it (a DTensor whose mesh has ranks outside "
                "process_group?); save over a group holding every rank of its mesh. Nothing was saved"
            )


def assign(all_plans: Sequence[Sequence[ChunkPlan]], *, chunked: bool) -> tuple[list[list[ChunkPlan]], list[list[ChunkPlan]], int]:
    """The coordinator's choice of writers: (every rank's plans as the manifest sees them,
    the chunks each rank writes, the bytes of every distinct chunk together)."""
    if len(all_plans) == 1:  # a group of one writes all it holds
        plans = list(all_plans[0])
        mine = [p for p in plans if _wanted(p)]
        return [plans], [mine], sum(p.nbytes for p in mine)
    # Large replicated tensors: one row piece per holder.
    planned = split_replicated(all_plans) if chunked else [list(p) for p in all_plans]
    owner = assign_writers([[p for p in plans if _wanted(p)] for plans in planned])
    total = sum({p.ident: p.nbytes for plans in planned for p in plans if _wanted(p)}.values())
    writes = [[p for p in plans if _wanted(p) and owner.get(p.ident) == rank] for rank, plans in enumerate(planned)]
    return planned, writes, total


# --------------------------------------------------------------------------- chunked


def _piece(
    plan: ChunkPlan,
    local_tensors: Mapping[tuple[str, str], torch.Tensor],
    local_offsets: Mapping[tuple[str, str], tuple[int, ...]],
) -> torch.Tensor:
    """The part of this rank's chunk that ``plan`` covers: all of it, or a row piece of it
    (:func:`split_replicated`)."""
    key = (plan.component, plan.name)
    tensor = local_tensors[key]
    if tuple(tensor.shape) == plan.shape:
        return tensor
    return tensor.narrow(0, plan.offsets[0] - local_offsets[key][0], plan.shape[0])


def pieces(
    to_write: Sequence[ChunkPlan], mine: Sequence[ChunkPlan], local_tensors: Mapping[tuple[str, str], torch.Tensor]
) -> dict[tuple[str, str], torch.Tensor]:
    """(component, name) -> the tensor a ``chunked`` rank writes for each of ``to_write``."""
    local_offsets = {(p.component, p.name): p.offsets for p in mine}
    return {(p.component, p.name): _piece(p, local_tensors, local_offsets) for p in to_write}


SPLIT_FLOOR_BYTES = 256 << 20
"""Smallest file a rank splits its bytes into so that each writer thread has one of its own."""


def _rank_file_bytes(total: int, max_shard_bytes: int, threads: int) -> int:
    """Largest data file a rank writes: the shard limit, or less so its writer threads each
    fill files of their own.

    Buffered writes to one file hold its inode lock while they copy (ext4, XFS), so two
    threads on one file take turns and the waiting one spins (``benchmarks/README.md``
    has the profile). Files never go below 256 MiB for this (small states stay in one file).

        >>> _rank_file_bytes(2 << 30, 5 << 30, threads=2) == 1 << 30
        True
        >>> _rank_file_bytes(100 << 20, 5 << 30, threads=2) == 5 << 30
        True
    """
    if threads <= 1 or total <= SPLIT_FLOOR_BYTES:
        return max_shard_bytes
    return min(max_shard_bytes, max(SPLIT_FLOOR_BYTES, math.ceil(total / threads)))


def io_share(ranks_here: int) -> tuple[int, int]:
    """(writer threads, bytes per write) of a rank: its share of the machine's CPUs (the
    ranks on one host divide them), and the collective segment size."""
    return writer_threads(ranks_here), current_options().collective.segment_bytes


def local_writer(threads: int, segment: int) -> Callable[..., dict[tuple[str, str], int]]:
    """How a rank of a collective save writes whole files into a local directory: its share
    of the machine's writer threads, the collective segment size."""
    return functools.partial(write_files, threads=threads, segment=segment)


Write = Callable[[Sequence[FileWrite]], dict[tuple[str, str], int]]
"""Writes whole files of the save (into its directory, or under its URL): crc32c of each (file, key)."""


def _write_chunked(
    to_write: list[ChunkPlan],
    local_tensors: dict[tuple[str, str], torch.Tensor],
    rank: int,
    max_shard_bytes: int,
    file_meta: dict[str, str],
    threads: int,
    write: Write,
) -> tuple[list[tuple[str, str, ChunkRef]], dict[str, int]]:
    """Write this rank's chunks into files of its own; return their records and sizes."""
    by_component: dict[str, list[ChunkPlan]] = {}
    for plan in to_write:
        by_component.setdefault(plan.component, []).append(plan)
    writes: list[FileWrite] = []
    placed: list[tuple[ChunkPlan, str]] = []
    files: dict[str, int] = {}
    for component, plans in by_component.items():
        file_bytes = _rank_file_bytes(sum(p.nbytes for p in plans), max_shard_bytes, threads)
        by_name = {p.name: p for p in plans}
        specs = [TensorSpec(p.name, p.dtype, p.shape, p.nbytes) for p in plans]
        for f in plan_rank_files(component, rank, specs, file_bytes, file_meta):
            tensors = tuple((n, local_tensors[(component, n)], off) for n, off in f.offsets.items())
            writes.append(FileWrite(f.name, f.header, f.size, tensors))
            files[f.name] = f.size
            placed.extend((by_name[n], f.name) for n in f.offsets)
    crcs = write(writes)
    refs = [
        (p.component, p.name, ChunkRef(fname, p.name, p.offsets, p.shape, crcs[(fname, p.name)]))
        for p, fname in placed
    ]
    return refs, files


def chunked_records(
    prepared: PreparedState,
    all_plans: Sequence[Sequence[ChunkPlan]],
    reports: Sequence[tuple[list[tuple[str, str, ChunkRef]], dict[str, int]]],
) -> tuple[dict[str, ComponentRecord], dict[str, int], dict[str, bytes]]:
    """The manifest's records, files and (no) indexes of a ``chunked`` save."""
    order = _tensor_order(all_plans)
    chunks: dict[tuple[str, str], list[ChunkRef]] = {}
    files: dict[str, int] = {}
    for refs, rank_files in reports:
        files.update(rank_files)
        for component, name, ref in refs:
            chunks.setdefault((component, name), []).append(ref)
    records = {}
    for comp in prepared.components:
        tensors = {}
        for name, plan in order.get(comp.name, {}).items():
            placed = sorted(chunks.get((comp.name, name), []), key=lambda r: r.offsets)
            tensors[name] = TensorRecord(plan.dtype, plan.global_shape, tuple(placed))
        records[comp.name] = ComponentRecord(comp.tree, tensors, dict(comp.aliases))
    return records, dict(sorted(files.items())), {}


# -------------------------------------------------------------------------------- hf


class HfPart(NamedTuple):
    """A rank's share of the HF files."""

    whole: list[tuple[str, PlannedFile]]
    """(component, file) of each file this rank writes alone, header included."""
    placement: dict[tuple[str, str], tuple[str, int]]
    """(component, name) of each chunk it writes into a shared file -> (file, the tensor's
    first byte there)."""
    shared: dict[str, tuple[bytes, int]]
    """Each shared file it writes to -> (header, or b"" where the coordinator writes it; size)."""


class HfFiles(NamedTuple):
    """The HF file plan of a save (made by the coordinator)."""

    files: list[tuple[str, PlannedFile]]
    """(component, file), in file order."""
    placement: dict[tuple[str, str], tuple[str, int]]
    """(component, name) -> (file, the tensor's first byte there)."""
    indexes: dict[str, bytes]
    """Index file name -> its bytes (components of several files)."""
    order: dict[str, dict[str, ChunkPlan]]
    """component -> name -> a chunk of it, in the order the tensors are saved."""

    def parts(self, writes: Sequence[Sequence[ChunkPlan]]) -> list[HfPart]:
        """Each rank's share, given the chunks each writes: a file whose every tensor one
        rank writes whole is that rank's alone; the coordinator writes the headers of the
        others."""
        if len(writes) == 1 and all(p.shape == p.global_shape for p in writes[0]):
            return [HfPart(list(self.files), {}, {})]  # one process holding whole tensors
        writer: dict[str, int | None] = {}
        for rank, plans in enumerate(writes):
            for p in plans:
                fname = self.placement[(p.component, p.name)][0]
                alone = p.shape == p.global_shape and writer.get(fname, rank) == rank
                writer[fname] = rank if alone else None
        # Each file looked at once, not once per rank: linear in ranks and files.
        whole_of: dict[int, list[tuple[str, PlannedFile]]] = {}
        shared_files = {}
        for c, f in self.files:
            owner = writer.get(f.name, -1)
            if owner is None:
                shared_files[f.name] = f
            elif owner >= 0:
                whole_of.setdefault(owner, []).append((c, f))
        out = []
        for rank, plans in enumerate(writes):
            placement = {}
            for p in plans:
                where = self.placement[(p.component, p.name)]
                if writer.get(where[0]) is None:
                    placement[(p.component, p.name)] = where
            if rank == 0:  # the coordinator writes every shared file's header
                shared = {name: (f.header, f.size) for name, f in shared_files.items()}
            else:
                shared = {fname: (b"", shared_files[fname].size) for fname, _ in sorted(placement.values())}
            out.append(HfPart(whole_of.get(rank, []), placement, shared))
        return out


def _global_bytes(plan: ChunkPlan) -> int:
    if plan.shape == plan.global_shape:
        return plan.nbytes
    return math.prod(plan.global_shape) * NAME_TO_DTYPE[plan.dtype].itemsize


def plan_hf(
    prepared: PreparedState, all_plans: Sequence[Sequence[ChunkPlan]], max_shard_bytes: int, file_meta: dict[str, str]
) -> HfFiles:
    """Lay out the HF files of every component: whole tensors, in first-seen order, grouped
    by the bytes ``transformers`` counts for the coordinator's own tensors (a view counts its
    storage, views of one storage share a file) and by their own bytes for the rest."""
    own = {comp.name: comp for comp in prepared.components}
    order = _tensor_order(all_plans)
    files: list[tuple[str, PlannedFile]] = []
    placement: dict[tuple[str, str], tuple[str, int]] = {}
    indexes: dict[str, bytes] = {}
    for component, plans in order.items():
        specs = {n: TensorSpec(n, p.dtype, p.global_shape, _global_bytes(p)) for n, p in plans.items()}
        comp = own.get(component)
        sizes, storage = hf_sizes(comp) if comp is not None else ([], {})
        if len(sizes) != len(specs):  # the coordinator holds only some of them (else the same names, in order)
            counted = dict(sizes)
            sizes = [(n, counted.get(n, spec.nbytes)) for n, spec in specs.items()]
        planned = plan_hf_files(component, specs, max_shard_bytes, file_meta, sizes=sizes, storage=storage)
        for f in planned:
            files.append((component, f))
            placement.update({(component, n): (f.name, off) for n, off in f.offsets.items()})
        if len(planned) > 1:
            total = sum(spec.nbytes for spec in specs.values())
            params = comp.parameters if comp is not None and comp.parameters is not None else \
                sum(math.prod(p.global_shape) for p in plans.values())
            indexes[index_name(component)] = hf_index(planned, total, params) or b""
    return HfFiles(files, placement, indexes, order)


_Runs = list[tuple[str, str, int, int, int]]
"""(component, name, byte start within the tensor, crc32c, length) of each run written."""


def write_hf_part(
    to_write: list[ChunkPlan],
    local_tensors: dict[tuple[str, str], torch.Tensor],
    part: HfPart,
    directory: str,
    *,
    durable: bool,
    advance: Any,
    threads: int,
    segment: int,
    write: Write,
) -> tuple[dict[tuple[str, str], int], _Runs]:
    """Write this rank's share of the HF files; return the crc32c of each (file, tensor) of
    the files it wrote whole, and the runs it wrote into shared ones (a dim-0 shard is one
    run; other shards one per contiguous range)."""
    whole: dict[tuple[str, str], int] = {}
    if part.whole:
        writes = []
        for component, f in part.whole:
            tensors = tuple((n, local_tensors[(component, n)], off) for n, off in f.offsets.items())
            writes.append(FileWrite(f.name, f.header, f.size, tensors))
        whole = write(writes)
    if not part.shared:
        return whole, []
    items: dict[str, list[tuple[str, torch.Tensor, int]]] = {}
    runs_of: dict[str, tuple[str, str, int, int]] = {}
    for plan in to_write:
        where = part.placement.get((plan.component, plan.name))
        if where is None:
            continue  # in a file this rank writes whole
        fname, start = where
        local = local_tensors[(plan.component, plan.name)]
        if not local.is_contiguous() or local.device.type != "cpu":
            local = local.contiguous().cpu()
        raw = local.reshape(-1).view(torch.uint8) if local.numel() else torch.empty(0, dtype=torch.uint8)
        item = NAME_TO_DTYPE[plan.dtype].itemsize
        pos = 0
        for run_start, length in byte_runs(plan.global_shape, plan.offsets, plan.shape, item):
            key = f"{plan.component}/{plan.name}@{run_start}"
            items.setdefault(fname, []).append((key, raw[pos : pos + length], start + run_start))
            runs_of[key] = (plan.component, plan.name, run_start, length)
            pos += length
    writes = [
        FileWrite(fname, header, size, tuple(items.get(fname, ())))
        for fname, (header, size) in sorted(part.shared.items())
    ]
    crcs = write_files(directory, writes, durable=durable, advance=advance, shared=True, threads=threads,
                       segment=segment)
    return whole, [(*runs_of[key][:3], crc, runs_of[key][3]) for (_, key), crc in crcs.items()]


def hf_records(
    prepared: PreparedState,
    reports: Sequence[tuple[dict[tuple[str, str], int], _Runs]],
    hf_files: HfFiles,
) -> tuple[dict[str, ComponentRecord], dict[str, int], dict[str, bytes]]:
    """The manifest's records, files and indexes of an ``hf`` save."""
    whole: dict[tuple[str, str], int] = {}
    runs: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for rank_whole, rank_runs in reports:
        whole.update(rank_whole)
        for component, name, start, run_crc, length in rank_runs:
            runs.setdefault((component, name), []).append((start, run_crc, length))
    records = {}
    placement = hf_files.placement
    for comp in prepared.components:
        tensors = {}
        for name, plan in hf_files.order.get(comp.name, {}).items():
            shape = plan.global_shape
            fname = placement[(comp.name, name)][0]
            crc = whole.get((fname, name))
            if crc is None:
                crc = combine_runs(runs.get((comp.name, name), []), _global_bytes(plan), where=f"{comp.name}/{name}")
            tensors[name] = TensorRecord(plan.dtype, shape, (ChunkRef(fname, name, (0,) * len(shape), shape, crc),))
        records[comp.name] = ComponentRecord(comp.tree, tensors, dict(comp.aliases))
    files = {f.name: f.size for _, f in hf_files.files}
    return records, files, hf_files.indexes


def write_manifest(
    txn: Transaction,
    prepared: PreparedState,
    records: dict[str, ComponentRecord],
    files: dict[str, int],
    indexes: dict[str, bytes],
    *,
    save_id: str,
    layout: str,
    world_size: int,
    metadata: dict[str, Any],
    durable: bool,
    tables: tuple[tuple[int, int] | None, ...] = (),
) -> None:
    """Write the indexes, then the manifest (the commit marker) into the transaction."""
    manifest = Manifest(
        save_id=save_id,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__,
        world_size=world_size,
        layout=layout,
        flat=prepared.flat,
        components=records,
        files=files,
        metadata=metadata,
        tables=tables,
    )
    for iname, data in indexes.items():
        txn.write_bytes(iname, data, durable=durable)
    txn.write_bytes(MANIFEST_NAME, manifest.to_json(), durable=durable)
