"""Collective saves: every rank writes its own bytes, the coordinator commits.

Two round trips through the coordinator (each a :meth:`Group.exchange`, so a failure
anywhere makes every rank raise one error naming the failed ranks, and nothing is
committed):

1. plan: each rank lists the chunks it holds (DTensor shards, or whole plain tensors) and
   sends the list to the coordinator, which assigns writers (replicated chunks written
   once, balanced by bytes), lays out the shared files for ``hf``, creates the temporary
   directory, and answers each rank with what it writes and where.
2. write: ``chunked`` — each rank writes its chunks to files of its own
   (``model-r00003-00001.safetensors``); ``hf`` — all ranks share the planned HF files and
   each ``pwrite``s its chunks' bytes at their planned positions (a dim-0 shard is one
   range; other shards one range per contiguous run). Each rank reports its chunk records
   and crc32c; once every rank has, the coordinator writes the index and the manifest,
   renames the directory into place, and answers with the files.

No full tensor is gathered anywhere; this needs a filesystem every rank sees, or an
fsspec URL (layout ``chunked`` only: each rank uploads its own objects under the final
prefix, the coordinator uploads the manifest last once every rank reported success).
"""

from __future__ import annotations

import functools
import math
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .._checksum import combine_runs
from .._format.dtypes import NAME_TO_DTYPE, dtype_name
from .._format.index import index_name, render_index
from .._format.manifest import ChunkRef, ComponentRecord, TensorRecord
from .._format.safetensors import TensorSpec, plan_file
from .._io.threads import writer_threads
from .._io.writes import FileWrite, write_files
from .._options import current_options
from .._planning.chunks import ChunkPlan, assign_writers, byte_runs, split_replicated
from .._planning.shards import plan_shards, shard_file_names
from .._prepare import PreparedState
from .._progress import byte_progress
from .._storage import Transaction, open_transaction
from .._storage.local import reported
from .._storage.store import resolve, write_files_at
from .._write import SaveInfo, file_metadata, write_manifest
from ..errors import InvalidArgumentError
from .group import Group, local_chunk


def _plan_local(prepared: PreparedState) -> tuple[list[ChunkPlan], dict[tuple[str, str], torch.Tensor]]:
    chunks = []
    local_tensors = {}
    for comp in prepared.components:
        for name in comp.stored:
            tensor = comp.tensors[name]
            if name in comp.placements:
                (global_shape, offsets), local = comp.placements[name], tensor
            else:
                global_shape, offsets, local = local_chunk(tensor, name)
            local = local.detach()
            nbytes = local.numel() * local.element_size()
            chunks.append(
                ChunkPlan(comp.name, name, dtype_name(tensor.dtype, key=name), global_shape, offsets,
                          tuple(local.shape), nbytes)
            )
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


def write_distributed(
    prepared: PreparedState,
    path: str | os.PathLike[str],
    *,
    group: Group,
    layout: str,
    max_shard_bytes: int,
    overwrite: bool,
    metadata: dict[str, Any],
    durable: bool,
    progress: bool | None,
    storage_options: Mapping[str, Any] | None = None,
) -> SaveInfo:
    """Save collectively over ``group``; every rank calls this with its own shards."""
    started = time.perf_counter()
    if layout == "hf" and resolve(path, storage_options)[1] is not None:
        raise InvalidArgumentError(
            f"{os.fspath(path)}: layout='hf' in a collective save needs a shared POSIX "
            "filesystem (ranks write parts of the same files), which an object store is not. "
            "Save with layout='chunked' (each rank uploads its own files), then "
            "`shardpoint convert` it to HF files where you need them"
        )
    chunked = layout == "chunked"
    txn: Transaction | None = None
    all_plans: list[list[ChunkPlan]] = []  # the coordinator's, for the manifest
    hf_files: _HfFiles | None = None

    def plan() -> tuple[tuple[list[ChunkPlan], dict[tuple[str, str], torch.Tensor]], tuple[list[ChunkPlan], str]]:
        mine, local_tensors = _plan_local(prepared)
        return (mine, local_tensors), (mine, socket.gethostname())

    def assign(reports: list[tuple[list[ChunkPlan], str]]) -> list[_Assignment]:
        """The coordinator: who writes what, then the temporary directory (opened last)."""
        nonlocal txn, all_plans, hf_files
        gathered = [plans for plans, _ in reports]
        hosts = [host for _, host in reports]
        # Large replicated tensors: one row piece per holder.
        all_plans = split_replicated(gathered) if chunked else [list(p) for p in gathered]
        owner = assign_writers([[p for p in plans if _wanted(p)] for plans in all_plans])
        save_id = uuid.uuid4().hex
        hf_files = None if chunked else _hf_files(all_plans, max_shard_bytes, file_metadata(save_id))
        total = sum({p.ident: p.nbytes for plans in all_plans for p in plans if _wanted(p)}.values())
        writes = [[p for p in plans if _wanted(p) and owner.get(p.ident) == rank]
                  for rank, plans in enumerate(all_plans)]
        parts = [None if hf_files is None else hf_files.part(w, coordinator=rank == 0) for rank, w in enumerate(writes)]
        txn = open_transaction(path, overwrite=overwrite, storage_options=storage_options)
        per_host = Counter(hosts)  # not hosts.count per rank: quadratic over thousands of ranks
        return [_Assignment(save_id, txn.directory, w, part, total, per_host[host])
                for w, part, host in zip(writes, parts, hosts, strict=True)]

    try:
        (mine, local_tensors), job = group.exchange(
            "planning the save", plan, assign, deciding="creating the checkpoint directory"
        )
        local_offsets = {(p.component, p.name): p.offsets for p in mine}
        file_meta = file_metadata(job.save_id)

        threads = writer_threads(job.ranks_here)
        segment = current_options().collective.segment_bytes

        def write() -> tuple[None, _Written]:
            nbytes = sum(p.nbytes for p in job.to_write)
            with reported(path, "writing its data files"), \
                    byte_progress(nbytes, f"saving rank {group.rank}", progress) as advance:
                if job.hf_part is None:
                    pieces = {(p.component, p.name): _piece(p, local_tensors, local_offsets) for p in job.to_write}
                    refs, files = _write_chunked(job.to_write, pieces, job.directory, group.rank, max_shard_bytes,
                                                 file_meta, durable, advance, storage_options, threads, segment)
                    return None, (refs, files, [])
                runs = _write_hf_part(job.to_write, local_tensors, job.hf_part, job.directory, durable, advance,
                                      threads, segment)
                return None, ([], {}, runs)

        def commit(reports: list[_Written]) -> list[dict[str, int]]:
            """The coordinator, once every rank has written: the manifest, then the rename."""
            assert txn is not None
            if hf_files is None:
                records, files, indexes = _chunked_records(prepared, all_plans, reports)
            else:
                records, files, indexes = _hf_records(prepared, all_plans, reports, hf_files)
            write_manifest(txn, prepared, records, files, indexes, save_id=job.save_id, layout=layout,
                           world_size=group.world_size, metadata=metadata, durable=durable)
            txn.commit(durable=durable)
            return [files] * group.world_size

        _, data_files = group.exchange(
            "writing the checkpoint files", write, commit, deciding="committing the checkpoint"
        )
    except BaseException:
        if txn is not None:
            txn.abort()
        raise
    return SaveInfo(os.fspath(path), job.save_id, data_files, job.total, time.perf_counter() - started)


class _Assignment(NamedTuple):
    """What the coordinator tells a rank after planning."""

    save_id: str
    directory: str
    to_write: list[ChunkPlan]
    """The chunks (or row pieces of replicated ones) this rank writes."""
    hf_part: _HfPart | None
    """Layout ``hf``: where this rank's chunks go in the shared files."""
    total: int
    """Bytes of every distinct chunk, all ranks together."""
    ranks_here: int
    """Ranks on this rank's machine (same host name): they share its CPUs for writing."""


_Written = tuple[list[tuple[str, str, ChunkRef]], dict[str, int], list[tuple[str, str, int, int, int]]]
"""A rank's report after writing: chunked (chunk refs, files and sizes), or hf runs."""


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


SPLIT_FLOOR_BYTES = 256 << 20
"""Smallest file a rank splits its bytes into so that each writer thread has one of its own."""


def _rank_file_bytes(total: int, max_shard_bytes: int, threads: int) -> int:
    """Largest data file a rank writes: the shard limit, or less so its writer threads each
    fill files of their own.

    Buffered writes to one file hold its inode lock while they copy (ext4, XFS), so two
    threads on one file take turns, and the waiting one spins: with 1 rank writing 1.94 GB
    durably into one file, 27 % of the CPU samples were ``rwsem_spin_on_owner``; with the
    bytes in two files, 7 % and 1.5 % (perf, 2026-11-24). Files never go below 256 MiB for
    this (small states stay in one file).

        >>> _rank_file_bytes(2 << 30, 5 << 30, threads=2) == 1 << 30
        True
        >>> _rank_file_bytes(100 << 20, 5 << 30, threads=2) == 5 << 30
        True
    """
    if threads <= 1 or total <= SPLIT_FLOOR_BYTES:
        return max_shard_bytes
    return min(max_shard_bytes, max(SPLIT_FLOOR_BYTES, math.ceil(total / threads)))


def _write_chunked(
    to_write: list[ChunkPlan],
    local_tensors: dict[tuple[str, str], torch.Tensor],
    directory: str,
    rank: int,
    max_shard_bytes: int,
    file_meta: dict[str, str],
    durable: bool,
    advance: Any,
    storage_options: Mapping[str, Any] | None,
    threads: int,
    segment: int,
) -> tuple[list[tuple[str, str, ChunkRef]], dict[str, int]]:
    by_component: dict[str, list[ChunkPlan]] = {}
    for plan in to_write:
        by_component.setdefault(plan.component, []).append(plan)
    writes: list[FileWrite] = []
    placed: list[tuple[ChunkPlan, str]] = []
    files: dict[str, int] = {}
    for component, plans in by_component.items():
        file_bytes = _rank_file_bytes(sum(p.nbytes for p in plans), max_shard_bytes, threads)
        groups = plan_shards([(p.name, p.nbytes) for p in plans], file_bytes)
        by_name = {p.name: p for p in plans}
        for i, names in enumerate(groups, start=1):
            fname = f"{component}-r{rank:05d}-{i:05d}.safetensors"
            specs = [TensorSpec(n, by_name[n].dtype, by_name[n].shape, by_name[n].nbytes) for n in names]
            layout = plan_file(specs, file_meta)
            tensors = tuple((n, local_tensors[(component, n)], layout.ranges[n][0]) for n in names)
            writes.append(FileWrite(fname, layout.header, layout.size, tensors))
            files[fname] = layout.size
            placed.extend((by_name[n], fname) for n in names)
    crcs = write_files_at(directory, writes, durable=durable, advance=advance,
                          storage_options=storage_options, local=functools.partial(write_files, threads=threads, segment=segment))
    refs = [
        (p.component, p.name, ChunkRef(fname, p.name, p.offsets, p.shape, crcs[(fname, p.name)]))
        for p, fname in placed
    ]
    return refs, files


def _chunked_records(
    prepared: PreparedState,
    all_plans: Sequence[Sequence[ChunkPlan]],
    reports: Sequence[tuple[list[tuple[str, str, ChunkRef]], dict[str, int], list[Any]]],
) -> tuple[dict[str, ComponentRecord], dict[str, int], dict[str, bytes]]:
    order = _tensor_order(all_plans)
    chunks: dict[tuple[str, str], list[ChunkRef]] = {}
    files: dict[str, int] = {}
    for refs, rank_files, _ in reports:
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


class _HfPart(NamedTuple):
    """A rank's share of the shared HF files."""

    placement: dict[tuple[str, str], tuple[str, int]]
    """(component, name) of each chunk it writes -> (file, the tensor's first byte there)."""
    files: dict[str, tuple[bytes, int]]
    """Each file it writes to -> (header, or b"" where the coordinator writes it; file size)."""


class _HfFiles(NamedTuple):
    """The shared HF file layout of a collective save (computed by the coordinator)."""

    placement: dict[tuple[str, str], tuple[str, int]]
    """(component, name) -> (file, the tensor's first byte there)."""
    headers: dict[str, tuple[bytes, int]]
    """file -> (header, size)."""
    weight_maps: dict[str, dict[str, str]]
    """component -> tensor name -> file."""

    def part(self, to_write: Sequence[ChunkPlan], *, coordinator: bool) -> _HfPart:
        """What a rank writing ``to_write`` needs; the coordinator also writes every header."""
        placement = {(p.component, p.name): self.placement[(p.component, p.name)] for p in to_write}
        if coordinator:
            return _HfPart(placement, dict(self.headers))
        return _HfPart(placement, {f: (b"", self.headers[f][1]) for f, _ in placement.values()})


def _hf_files(
    all_plans: Sequence[Sequence[ChunkPlan]], max_shard_bytes: int, file_meta: dict[str, str]
) -> _HfFiles:
    """Lay out the HF files every rank writes into: whole tensors, in first-seen order."""
    placement: dict[tuple[str, str], tuple[str, int]] = {}
    headers: dict[str, tuple[bytes, int]] = {}
    weight_maps: dict[str, dict[str, str]] = {}
    for component, plans in _tensor_order(all_plans).items():
        itemsizes = {n: NAME_TO_DTYPE[p.dtype].itemsize for n, p in plans.items()}
        sizes = [(n, math.prod(p.global_shape) * itemsizes[n]) for n, p in plans.items()]
        groups = plan_shards(sizes, max_shard_bytes)
        weight_map: dict[str, str] = {}
        for fname, names in zip(shard_file_names(component, len(groups)), groups, strict=True):
            specs = [TensorSpec(n, plans[n].dtype, plans[n].global_shape, dict(sizes)[n]) for n in names]
            layout = plan_file(specs, file_meta)
            headers[fname] = (layout.header, layout.size)
            for n in names:
                placement[(component, n)] = (fname, layout.ranges[n][0])
                weight_map[n] = fname
        weight_maps[component] = weight_map
    return _HfFiles(placement, headers, weight_maps)


def _write_hf_part(
    to_write: list[ChunkPlan],
    local_tensors: dict[tuple[str, str], torch.Tensor],
    part: _HfPart,
    directory: str,
    durable: bool,
    advance: Any,
    threads: int,
    segment: int,
) -> list[tuple[str, str, int, int, int]]:
    """Write this rank's chunks into the shared HF files; return (component, name,
    byte start within the tensor, crc32c, length) for every contiguous run written."""
    items: dict[str, list[tuple[str, torch.Tensor, int]]] = {}
    runs_of: dict[str, tuple[str, str, int, int]] = {}
    for plan in to_write:
        fname, start = part.placement[(plan.component, plan.name)]
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
        for fname, (header, size) in sorted(part.files.items())
    ]
    crcs = write_files(directory, writes, durable=durable, advance=advance, shared=True, threads=threads,
                       segment=segment)
    return [(*runs_of[key][:3], crc, runs_of[key][3]) for (_, key), crc in crcs.items()]


def _hf_records(
    prepared: PreparedState,
    all_plans: Sequence[Sequence[ChunkPlan]],
    reports: Sequence[tuple[list[Any], dict[str, int], list[tuple[str, str, int, int, int]]]],
    hf_files: _HfFiles,
) -> tuple[dict[str, ComponentRecord], dict[str, int], dict[str, bytes]]:
    placement, headers, weight_maps = hf_files
    runs: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for _, _, rank_runs in reports:
        for component, name, start, crc, length in rank_runs:
            runs.setdefault((component, name), []).append((start, crc, length))
    order = _tensor_order(all_plans)
    records = {}
    indexes = {}
    for comp in prepared.components:
        tensors = {}
        total = elements = 0
        for name, plan in order.get(comp.name, {}).items():
            nbytes = math.prod(plan.global_shape) * NAME_TO_DTYPE[plan.dtype].itemsize
            crc = combine_runs(runs.get((comp.name, name), []), nbytes, where=f"{comp.name}/{name}")
            fname, _ = placement[(comp.name, name)]
            shape = plan.global_shape
            tensors[name] = TensorRecord(plan.dtype, shape, (ChunkRef(fname, name, (0,) * len(shape), shape, crc),))
            total += nbytes
            elements += math.prod(plan.global_shape)
        records[comp.name] = ComponentRecord(comp.tree, tensors, dict(comp.aliases))
        if len(set(weight_maps.get(comp.name, {}).values())) > 1:
            indexes[index_name(comp.name)] = render_index(
                weight_maps[comp.name], total, elements if comp.parameters is None else comp.parameters
            )
    files = {fname: size for fname, (_, size) in headers.items()}
    return records, files, indexes
