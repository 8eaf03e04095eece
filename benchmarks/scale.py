"""Ten thousand ranks without the machines: planning, manifest and load planning at scale.

Drives the real code of a collective save by rules (format 3) and of a load's planning, for
simulated world sizes (8 -> 16 384) and tensor counts (10^2 -> 10^5), with no files and no
processes. What every rank's ``regular.describe`` would return is built directly (the
``Entry`` list; ``describe`` itself needs real DTensors), for three shardings of a
Llama-8B-shaped bf16 state (per layer q, k, v, o, gate, up, down and two norms; embedding,
final norm and lm_head), scaled to T tensors:

* ``fsdp2``: every tensor ``Shard(0)`` over a 1-D mesh of W ranks;
* ``fsdp_tp``: a (W/8, 8) mesh; 2-D weights ``(Shard(0), Shard(1))``, norms
  ``(Shard(0), Replicate())``;
* ``ddp``: plain tensors every rank holds.

Per (sharding, W, T), with the functions ``_write.write_checkpoint`` sequences:

1. first save, coordinator: unpickle W offers (fingerprint ``"rules:" + digest``),
   ``PlanCache.agreed`` (a miss) + ``agree``, the W assignments (pickled back), then, as a
   rank, ``plan_rules``; at commit: unpickle W reports (each rank's files and its table's
   size and crc32c: the real ones for the ranks whose tables are rendered, the sampled
   ranks' typical size and a made-up crc32c for the others), ``regular.records``, the
   manifest (``commit_written`` into a transaction that only keeps the bytes), W answers
   pickled. The transport is not simulated, nor the transaction. Timed (best of
   ``--repeat``), and its peak of Python allocations (``tracemalloc``, in a separate pass);
2. steady state: the same offers carrying the agreed plan id (``agreed`` hits), the same
   commit; timed (best of ``--repeat``);
3. one rank (W/2 + 1): ``digest``, ``plan_rules`` (first save only), ``my_writes`` over
   ``meta`` tensors of its local shapes, ``_write_chunked`` with a write that only returns
   crc32c, ``table_rows`` + ``render_table``: times and its table's bytes;
4. metadata: the format-3 manifest (every rank reads it), the tables (each read only by
   the ranks that need one of its chunks; their total is estimated from sampled ranks
   where W is large), and today's format (every chunk listed, as the explicit path writes
   it: ``steps.assign`` over every rank's ``ChunkPlan`` list, each rank's
   ``_write_chunked``, ``chunked_records``, the manifest). Today's is built while the
   ranks' chunk lists stay under ``--v2-cap`` chunks in all; past that it is extrapolated
   linearly in chunks from the largest built size of the same sharding and T (marked
   ``~``; its bytes per chunk are printed);
5. per-rank load planning: ``parse_manifest`` of the format-3 bytes, then
   ``RuleChunks.chunks`` for every tensor's box of one rank, reading tables through a
   function that counts their bytes (the tables are rendered for their ranks by the code of
   3, before the timed pass): the rank's own placement at the same world size (for ``ddp``,
   every tensor whole), and a rank of an FSDP2 ``Shard(0)`` world of W/4 (resharding);
6. growth ratios between successive world sizes (same T) and tensor counts (same W), next
   to the size ratio: linear growth gives the same ratio.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale.py            # ~14 min, < 2 GB
    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale.py --quick    # ~25 s
    PYTHONPATH=src .venv/bin/python benchmarks/scale.py --kinds fsdp2 --worlds 1024,16384 \\
        --tensors 1000 --json scale.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import pickle
import platform
import resource
import socket
import sys
import time
import tracemalloc
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import shardpoint as sp
from shardpoint._checksum import crc32c
from shardpoint._distributed import regular
from shardpoint._distributed import save as steps
from shardpoint._distributed.plan_cache import Offer, PlanCache
from shardpoint._format.manifest import parse_manifest
from shardpoint._format.tables import render_table
from shardpoint._gc import collector_paused
from shardpoint._planning.chunks import ChunkPlan
from shardpoint._planning.rules import Entry, Rule, cell_box, cells_overlapping, plan_rules
from shardpoint._rule_chunks import RuleChunks
from shardpoint._write import Written, commit_written, file_metadata

KINDS = ("fsdp2", "fsdp_tp", "ddp")
TP = 8
"""Tensor-parallel size of ``fsdp_tp`` (and ranks per simulated host)."""
DTYPE, ITEMSIZE = "BF16", 2
MAX_SHARD_BYTES = 5 * 10**9
"""``sp.save``'s default ``max_shard_size="5GB"``."""
COMPONENT = "model"

HIDDEN, KV, INTER, VOCAB = 4096, 1024, 14336, 128256
LAYER = (
    ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
    ("self_attn.k_proj.weight", (KV, HIDDEN)),
    ("self_attn.v_proj.weight", (KV, HIDDEN)),
    ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
    ("mlp.gate_proj.weight", (INTER, HIDDEN)),
    ("mlp.up_proj.weight", (INTER, HIDDEN)),
    ("mlp.down_proj.weight", (HIDDEN, INTER)),
    ("input_layernorm.weight", (HIDDEN,)),
    ("post_attention_layernorm.weight", (HIDDEN,)),
)


# ----------------------------------------------------------------------- the simulated state


def llama_tensors(count: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` (name, shape) of a Llama-8B-shaped model: as many layers as it takes (the
    last one cut short), the embedding first, final norm and lm_head last (291 = Llama-8B)."""
    if count < 4:
        raise ValueError("at least 4 tensors")
    layers = -(-(count - 3) // len(LAYER))
    body = [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in LAYER][: count - 3]
    return [("model.embed_tokens.weight", (VOCAB, HIDDEN)), *body,
            ("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def entries_for(kind: str, world: int, count: int) -> list[Entry]:
    """What ``regular.describe`` returns on every rank for this sharding."""
    out = []
    for name, shape in llama_tensors(count):
        n = len(shape)
        if kind == "fsdp2":
            grid, strides, replicas = (world,) + (1,) * (n - 1), (1,) + (0,) * (n - 1), ()
        elif kind == "fsdp_tp":
            if world % TP:
                raise ValueError(f"fsdp_tp needs a world size divisible by {TP}")
            if n == 2:
                grid, strides, replicas = (world // TP, TP), (TP, 1), ()
            else:
                grid, strides, replicas = (world // TP,), (TP,), ((TP, 1),)
        elif kind == "ddp":
            grid, strides, replicas = (1,) * n, (0,) * n, ((world, 1),)
        else:
            raise ValueError(kind)
        out.append(Entry(COMPONENT, name, DTYPE, shape, ITEMSIZE, grid, strides, replicas))
    return out


def own_cell(kind: str, entry: Entry, rank: int) -> tuple[int, ...]:
    """The cell ``rank`` holds of ``entry`` (``Description.own``)."""
    n = len(entry.shape)
    if kind == "fsdp2":
        return (rank,) + (0,) * (n - 1)
    if kind == "fsdp_tp":
        return (rank // TP, rank % TP) if n == 2 else (rank // TP,)
    return (0,) * n


_META: dict[tuple[int, ...], torch.Tensor] = {}


def meta(shape: tuple[int, ...]) -> torch.Tensor:
    """A ``meta`` bf16 tensor of ``shape`` (one per shape: nothing writes into them)."""
    found = _META.get(shape)
    if found is None:
        found = _META[shape] = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    return found


def description(kind: str, entries: list[Entry], rank: int, slots: Sequence[int] | None = None) -> regular.Description:
    """Rank ``rank``'s ``Description`` (of the tensors at ``slots`` only, when given)."""
    chosen = entries if slots is None else [entries[s] for s in slots]
    own = [own_cell(kind, e, rank) for e in chosen]
    local = [meta(cell_box(e.shape, e.grid, c)[1]) for e, c in zip(chosen, own, strict=True)]
    return regular.Description(list(chosen), own, local)


def prepared_for(entries: list[Entry]) -> Any:
    """What ``regular.records`` and the manifest writer read of a ``PreparedState``: a flat
    state dict of one component."""
    tree = {"type": "dict", "items": [["str", e.name, {"type": "tensor", "name": e.name}] for e in entries]}
    comp = SimpleNamespace(name=COMPONENT, tree=tree, aliases={})
    return SimpleNamespace(components=[comp], flat=True)


def host_of(rank: int) -> str:
    return f"node{rank // TP:05d}"


class _KeepBytes:
    """A transaction that keeps what is written into it (the manifest) and nothing else."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.directory = "sim"

    def write_bytes(self, name: str, data: bytes, *, durable: bool) -> None:
        self.files[name] = bytes(data)

    def commit(self, *, durable: bool) -> None:
        pass


def fake_write(files: Sequence[Any]) -> dict[tuple[str, str], int]:
    """``_write_chunked``'s write, without the writing: a crc32c per (file, key)."""
    return {(f.name, key): zlib.crc32(f"{f.name}/{key}".encode()) for f in files for key, _, _ in f.tensors}


class _NoTensors(dict):  # type: ignore[type-arg]
    """``local_tensors`` for the explicit path's file planning (the tensors are not read)."""

    def __missing__(self, key: Any) -> None:
        return None


# ------------------------------------------------------------------------------ a rank


def writer_mask(entries: list[Entry], rules: list[Rule], world: int) -> np.ndarray:
    """Which ranks write at least one non-empty cell (numpy over each tensor's cells)."""
    mask = np.zeros(world, dtype=bool)
    for e, rule in zip(entries, rules, strict=True):
        if math.prod(e.shape) == 0:
            mask[rule.base] = True
            continue
        writers = np.full((), rule.base, dtype=np.int64)
        nonempty = np.ones((), dtype=bool)
        for n, k, stride in zip(e.shape, rule.grid, rule.strides, strict=True):
            size = -(-n // k)
            starts = np.arange(k, dtype=np.int64) * size
            writers = writers[..., None] + np.arange(k, dtype=np.int64) * stride
            nonempty = nonempty[..., None] & (starts < n)
        mask[writers[nonempty]] = True
    return mask


def rank_table(
    kind: str, entries: list[Entry], rules: list[Rule], rank: int, world: int, save_id: str,
    slots: Sequence[int] | None = None,
) -> tuple[bytes, dict[str, int], dict[str, float]]:
    """Rank ``rank``'s work after planning: its writes, files and table (bytes, files, times).

    ``slots``: a superset of the tensors the rank writes a cell of (``my_writes`` keeps
    only those); default every tensor. The table is the same either way (its slots are
    numbered over every tensor by ``table_rows``)."""
    times = {}
    started = time.perf_counter()
    desc = description(kind, entries, rank, slots)
    sub_rules = rules if slots is None else [rules[s] for s in slots]
    times["describe_sim"] = time.perf_counter() - started
    started = time.perf_counter()
    to_write, tensors = regular.my_writes(desc, sub_rules, rank, world)
    times["my_writes"] = time.perf_counter() - started
    if not all(t.device.type == "meta" for t in tensors.values()):
        raise AssertionError("my_writes materialized a tensor")
    started = time.perf_counter()
    refs, files = steps._write_chunked(to_write, tensors, rank, MAX_SHARD_BYTES, file_metadata(save_id), 1, fake_write)
    full = desc if slots is None else regular.Description(entries, [], [])
    rows = regular.table_rows(full, rules, refs)
    table = render_table(save_id, rank, files, rows) if rows else b""  # no chunk: no table (write_checkpoint)
    times["table"] = time.perf_counter() - started
    return table, files, times


def candidate_slots(entries: list[Entry], rules: list[Rule]) -> tuple[dict[int, list[int]], list[int]]:
    """(rank -> the one-cell tensors it writes, the tensors of several cells): a rank writes
    cells of at most those two lists, so its table is made from them alone (much faster
    for a DDP state, whose tensors are mostly whole, each written by one rank)."""
    single: dict[int, list[int]] = {}
    multi = []
    for slot, rule in enumerate(rules):
        if rule.cells == 1:
            single.setdefault(rule.base, []).append(slot)
        else:
            multi.append(slot)
    return single, multi


class Tables:
    """Every rank's table of one simulated save, rendered when first asked for."""

    def __init__(self, kind: str, entries: list[Entry], rules: list[Rule], world: int, save_id: str) -> None:
        self.kind, self.entries, self.rules, self.world, self.save_id = kind, entries, rules, world, save_id
        self.single, self.multi = candidate_slots(entries, rules)
        self.cache: dict[int, tuple[bytes, dict[str, int]]] = {}

    def get(self, rank: int) -> tuple[bytes, dict[str, int]]:
        found = self.cache.get(rank)
        if found is None:
            slots = sorted(self.single.get(rank, []) + self.multi)
            table, files, _ = rank_table(self.kind, self.entries, self.rules, rank, self.world, self.save_id, slots)
            found = self.cache[rank] = (table, files)
        return found


# ------------------------------------------------------------------------- the coordinator


def _assign(cache: PlanCache, sent: list[tuple[Any, ...]], save_id: str) -> tuple[list[tuple[Any, ...]], str, bool]:
    """The coordinator's step of the planning exchange of a save by rules (``write_checkpoint``'s
    ``assign``, without opening the transaction)."""
    offers = [Offer._make(o) for o in sent]
    agreed = cache.agreed(offers)
    rules = all(o.fingerprint == offers[0].fingerprint for o in offers) and offers[0].fingerprint.startswith("rules:")
    if not rules:
        raise AssertionError("the simulated ranks' descriptions differ")
    plan_id = agreed[0] if agreed is not None else cache.agree(offers, None)
    per_host = Counter(o.host for o in offers)
    reused = agreed is not None
    answers = [(save_id, "sim", None, None, 0, per_host[o.host], plan_id, reused, True) for o in offers]
    return answers, plan_id, reused


@dataclass
class Save:
    """The inputs of one simulated save, built once (untimed)."""

    kind: str
    world: int
    entries: list[Entry]
    prepared: Any
    fp: str
    rules: list[Rule]
    """What every rank holds after the first save (``PLANS.mine``)."""
    save_id: str
    first_messages: list[bytes] = field(default_factory=list)
    """Each rank's pickled report of the planning exchange, first save."""
    report_messages: list[bytes] = field(default_factory=list)
    """Each rank's pickled report of the writing exchange."""


def coordinator(save: Save, cache: PlanCache, messages: list[bytes], *, first: bool) -> dict[str, Any]:
    """Everything the coordinator does in one save, timed by part (with Python's cyclic
    collector paused, as ``sp.save`` runs)."""
    with collector_paused():
        return _coordinator(save, cache, messages, first=first)


def _coordinator(save: Save, cache: PlanCache, messages: list[bytes], *, first: bool) -> dict[str, Any]:
    clock = time.perf_counter
    t0 = clock()
    offers = [pickle.loads(m)[1] for m in messages]
    m0 = clock() - t0
    uuid.uuid4()  # the save id the real coordinator draws; the simulated save keeps one (its tables name it)
    save_id = save.save_id
    answers, plan_id, reused = _assign(cache, offers, save_id)
    t = clock()
    sent = [pickle.dumps(({}, a, False)) for a in answers]
    t1 = clock()
    m1 = t1 - t
    rules = plan_rules(save.entries, save.world) if first else None
    t2 = clock()
    reports = [pickle.loads(m)[1] for m in save.report_messages]
    m2 = clock() - t2
    if rules is None:
        rules = save.rules  # the coordinator, as a rank, holds them from the first save
    comps = regular.records(save.prepared, regular.Description(save.entries, [], []), rules)
    everything = {name: size for files, _ in reports for name, size in files.items()}
    written = Written(save_id, "chunked", save.world, comps, {}, {}, tuple(table for _, table in reports))
    txn = _KeepBytes()
    commit_written(txn, save.prepared, written, metadata={}, durable=False)
    answers2 = [everything] + [None] * (save.world - 1)
    t = clock()
    sent2 = [pickle.dumps(({}, a, False)) for a in answers2]
    t3 = clock()
    m3 = t3 - t
    del sent, sent2
    messages_s = m0 + m1 + m2 + m3
    return {"plan_s": t1 - t0, "plan_rules_s": t2 - t1, "commit_s": t3 - t2, "total_s": t3 - t0,
            "messages_s": messages_s, "decide_s": t3 - t0 - messages_s - (t2 - t1),
            "plan_id": plan_id, "reused": reused, "manifest": txn.files["shardpoint.json"]}


def build_save(kind: str, world: int, count: int) -> tuple[Save, list[Rule], dict[str, Any]]:
    """The simulated save's inputs: entries, every rank's planning and writing reports."""
    entries = entries_for(kind, world, count)
    started = time.perf_counter()
    fp = "rules:" + regular.digest(entries, world)
    digest_s = time.perf_counter() - started
    rules = plan_rules(entries, world)
    save = Save(kind, world, entries, prepared_for(entries), fp, rules, uuid.uuid4().hex)
    plans = PlanCache()
    save.first_messages = [pickle.dumps((None, tuple(plans.offer(fp, None, host_of(r), rules=True))))
                           for r in range(world)]
    return save, rules, {"digest_s": digest_s}


def set_reports(save: Save, table_sizes: Callable[[int], tuple[int, int] | None], files_of: Callable[[int], dict[str, int]]) -> None:
    save.report_messages = [pickle.dumps((None, (files_of(r), table_sizes(r)))) for r in range(save.world)]


def steady_messages(save: Save, plan_id: str) -> list[bytes]:
    """The planning reports of the next save: every rank offers the plan it holds."""
    return [pickle.dumps((None, tuple(Offer(save.fp, None, host_of(r), plan_id)))) for r in range(save.world)]


# ------------------------------------------------------------------- today's format (v2)


V2_REPLICATED_WORLDS = 4096
"""Today's path is not built for a replicated state past this many ranks: every rank's list
holds every tensor (W x T chunk plans to build and assign), while its manifest lists the
same chunks at any W, so the extrapolation is exact there. (``split_replicated`` used to
look each holder up with ``list.index``, quadratic in ranks; it counts positions now.)"""


def v2_plans(kind: str, entries: list[Entry], world: int) -> list[list[ChunkPlan]]:
    """Every rank's chunk list as ``steps._plan_local`` reports it (empty shards included)."""
    out = []
    for rank in range(world):
        plans = []
        for e in entries:
            offsets, shape = cell_box(e.shape, e.grid, own_cell(kind, e, rank))
            plans.append(ChunkPlan(e.component, e.name, e.dtype, e.shape, offsets, shape, math.prod(shape) * e.itemsize))
        out.append(plans)
    return out


def today_manifest(kind: str, entries: list[Entry], world: int) -> dict[str, Any]:
    """Today's explicit path end to end (every chunk listed): bytes, chunks, coordinator time."""
    all_plans = v2_plans(kind, entries, world)
    prepared = prepared_for(entries)
    save_id = uuid.uuid4().hex
    started = time.perf_counter()
    planned, writes, _total = steps.assign(all_plans, chunked=True)
    assign_s = time.perf_counter() - started
    meta_files = file_metadata(save_id)
    reports = [steps._write_chunked(w, _NoTensors(), r, MAX_SHARD_BYTES, meta_files, 1, fake_write)
               for r, w in enumerate(writes)]
    del writes
    started = time.perf_counter()
    records, files, indexes = steps.chunked_records(prepared, planned, reports)
    txn = _KeepBytes()
    commit_written(txn, prepared, Written(save_id, "chunked", world, records, files, indexes), metadata={}, durable=False)
    records_s = time.perf_counter() - started
    raw = txn.files["shardpoint.json"]
    chunks = sum(len(r.chunks) for comp in records.values() for r in comp.tensors.values())
    del all_plans, planned, reports, records
    started = time.perf_counter()
    parse_manifest(raw, where="today")
    parse_s = time.perf_counter() - started
    return {"bytes": len(raw), "chunks": chunks, "coordinator_s": assign_s + records_s,
            "assign_s": assign_s, "parse_s": parse_s}


def cells_written(entries: list[Entry], rules: list[Rule]) -> int:
    """Non-empty cells of a save (the chunks today's manifest would list)."""
    total = 0
    for e, rule in zip(entries, rules, strict=True):
        if math.prod(e.shape) == 0:
            total += 1
            continue
        count = 1
        for n, k in zip(e.shape, rule.grid, strict=True):
            size = -(-n // k)
            count *= -(-n // size)  # the non-empty cells of a torch.chunk cut
        total += count
    return total


# ------------------------------------------------------------------------ load planning


def reshard_box(shape: tuple[int, ...], world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A rank's box of an FSDP2 ``Shard(0)`` target over ``world`` ranks."""
    grid = (world,) + (1,) * (len(shape) - 1)
    return cell_box(shape, grid, (rank,) + (0,) * (len(shape) - 1))


def needed_ranks(entries: list[Entry], rules: list[Rule], boxes: Callable[..., Any]) -> set[int]:
    """The ranks whose tables a load of ``boxes`` reads (what ``RuleChunks.chunks`` reads)."""
    ranks = set()
    for e, rule in zip(entries, rules, strict=True):
        offsets, shape = boxes(e.name, e.shape)
        if not math.prod(shape):
            continue
        if not math.prod(e.shape):
            ranks.add(rule.writer((0,) * len(e.shape)))
            continue
        for cell in cells_overlapping(e.shape, rule.grid, offsets, shape):
            if math.prod(cell_box(e.shape, rule.grid, cell)[1]):
                ranks.add(rule.writer(cell))
    return ranks


def load_planning(
    raw: bytes, tables: Tables, boxes: Callable[[str, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]],
    repeat: int,
) -> dict[str, Any]:
    """One rank's load planning: the manifest parsed, then the chunks of each tensor's box
    through ``RuleChunks`` (tables read on demand, from those rendered beforehand)."""

    @collector_paused()
    def once(read: Callable[[str, str], bytes]) -> tuple[float, int, int]:
        started = time.perf_counter()
        manifest = parse_manifest(raw, where="sim/shardpoint.json")
        rc = RuleChunks(manifest, "sim", read)
        chunks = 0
        for name, record in manifest.components[COMPONENT].tensors.items():
            offsets, shape = boxes(name, record.shape)
            if not math.prod(shape):
                continue  # nothing of this tensor to load
            chunks += len(rc.chunks(record, offsets, shape))
        return time.perf_counter() - started, rc.tables_read, chunks

    read_bytes = [0]

    def read(name: str, where: str) -> bytes:
        data = tables.cache[int(name[len("shardpoint-r"):-len(".json")])][0]
        read_bytes[0] += len(data)
        return data

    def timed() -> tuple[float, int, int, int]:
        read_bytes[0] = 0
        return (*once(read), read_bytes[0])

    seconds, tables_read, chunks, table_bytes = best_of(timed, repeat, lambda r: r[0])
    return {"s": seconds, "tables": tables_read, "table_bytes": table_bytes, "bytes": len(raw) + table_bytes,
            "chunks": chunks}


# ------------------------------------------------------------------------------ one size


REPEAT_BUDGET_S = 2.0
"""A timing is repeated up to ``--repeat`` times while its passes so far took less than this."""


def best_of(fn: Callable[[], Any], repeat: int, seconds: Callable[[Any], float]) -> Any:
    """The fastest of up to ``repeat`` calls (fewer once they took ``REPEAT_BUDGET_S``)."""
    best, spent = None, 0.0
    for _ in range(max(1, repeat)):
        result = fn()
        spent += seconds(result)
        if best is None or seconds(result) < seconds(best):
            best = result
        if spent > REPEAT_BUDGET_S:
            break
    return best


def sample_ranks(world: int, count: int) -> list[int]:
    if world <= count:
        return list(range(world))
    return sorted({round(i * (world - 1) / (count - 1)) for i in range(count)})


def measure(
    kind: str, world: int, count: int, *, repeat: int = 5, memory: bool = True, v2_cap: int = 2_000_000,
    load: bool = True, samples: int = 16,
) -> dict[str, Any]:
    """Every figure of one (sharding, world size, tensor count), with Python's cyclic
    collector paused as ``sp.save`` and the loads run (objects are freed by reference
    counting; a collector pass would walk everything the simulation holds)."""
    gc.collect()
    with collector_paused():
        return _measure(kind, world, count, repeat=repeat, memory=memory, v2_cap=v2_cap, load=load, samples=samples)


def _measure(
    kind: str, world: int, count: int, *, repeat: int, memory: bool, v2_cap: int, load: bool, samples: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "world": world, "tensors": count}
    save, rules, _ = build_save(kind, world, count)
    entries = save.entries
    out["cells"] = cells_written(entries, rules)
    save_id = save.save_id
    tables = Tables(kind, entries, rules, world, save_id)

    # One rank's work (W/2 + 1), on the full description as a real rank has it.
    me = min(world - 1, world // 2 + 1)
    started = time.perf_counter()
    regular.digest(entries, world)
    digest_s = time.perf_counter() - started
    started = time.perf_counter()
    plan_rules(entries, world)
    rules_s = time.perf_counter() - started
    table, files, times = rank_table(kind, entries, rules, me, world, save_id)
    if tables.get(me) != (table, files):  # the shortcut Tables takes for the other ranks
        raise AssertionError(f"rank {me}'s table differs when made from its candidate tensors only")
    out["rank"] = {"rank": me, "digest_s": digest_s, "plan_rules_s": rules_s, "my_writes_s": times["my_writes"],
                   "table_s": times["table"], "table_bytes": len(table),
                   "first_s": digest_s + rules_s + times["my_writes"] + times["table"],
                   "steady_s": digest_s + times["my_writes"] + times["table"]}

    # The boxes one rank loads: its own placement, and FSDP2 Shard(0) over W/4 ranks.
    by_name = {e.name: e for e in entries}

    def own(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        e = by_name[name]
        return cell_box(shape, e.grid, own_cell(kind, e, me))

    small = max(1, world // 4)
    other = min(small - 1, small // 2 + 1)

    def reshard(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return reshard_box(shape, small, other)

    # Tables: rendered for sampled ranks (every rank when few: their total) and for those
    # the loads read; the others' (size, crc32c) in the manifest are placeholders.
    sampled = sample_ranks(world, max(2, min(samples, 400_000 // count)))  # 4 ranks at T = 10^5
    needed = set().union(*(needed_ranks(entries, rules, b) for b in (own, reshard))) if load else set()
    sizes = {r: len(tables.get(r)[0]) for r in sampled}
    exact = len(sampled) == world
    writing = writer_mask(entries, rules, world)  # the ranks that write a table
    written = [size for size in sizes.values() if size] or [0]
    typical = round(sum(written) / len(written))
    out["tables_total_bytes"] = sum(sizes.values()) if exact else typical * int(writing.sum())
    out["tables_total_exact"] = exact
    out["table_bytes_max_sampled"] = max(sizes.values())
    files_seen = {r: tables.get(r)[1] for r in set(sampled) | needed}
    size_each = max((size for f in files_seen.values() for size in f.values()), default=1 << 30)

    def table_facts(rank: int) -> tuple[int, int] | None:
        if rank in tables.cache:
            raw = tables.cache[rank][0]
            return (len(raw), crc32c(raw)) if raw else None
        return (typical, zlib.crc32(str(rank).encode())) if writing[rank] else None

    def files_of(rank: int) -> dict[str, int]:
        found = files_seen.get(rank)
        return found if found is not None else {f"{COMPONENT}-r{rank:05d}-00001.safetensors": size_each}

    set_reports(save, table_facts, files_of)

    # The coordinator: first save, then steady state.
    first = best_of(lambda: coordinator(save, PlanCache(), save.first_messages, first=True), repeat,
                    lambda r: r["total_s"])
    cache = PlanCache()
    agreed = coordinator(save, cache, save.first_messages, first=True)
    steady_msgs = steady_messages(save, agreed["plan_id"])
    steady = best_of(lambda: coordinator(save, cache, steady_msgs, first=False), repeat, lambda r: r["total_s"])
    if not steady["reused"] or first["reused"]:
        raise AssertionError("the plan cache did not hit on the steady-state save (or hit on a first one)")
    raw = first["manifest"]
    out["coordinator_first"] = {k: v for k, v in first.items() if k.endswith("_s") or k == "reused"}
    out["coordinator_steady"] = {k: v for k, v in steady.items() if k.endswith("_s") or k == "reused"}
    if memory:
        gc.collect()
        tracemalloc.start()
        tracemalloc.reset_peak()
        coordinator(save, PlanCache(), save.first_messages, first=True)
        out["coordinator_first"]["peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out["manifest_bytes"] = len(raw)
    # Of the manifest, its list of every rank's table (size, crc32c): the part that grows with W.
    tables_list = json.loads(raw).get("tables", [])
    out["manifest_tables_bytes"] = len('"tables":,') + len(json.dumps(tables_list, separators=(",", ":")))

    # Today's format.
    if world * count <= v2_cap and (kind != "ddp" or world <= V2_REPLICATED_WORLDS):
        out["today"] = today_manifest(kind, entries, world)
        out["today"]["extrapolated"] = False
    gc.collect()

    if load:
        out["load_own"] = load_planning(raw, tables, own, repeat)
        out["load_reshard"] = load_planning(raw, tables, reshard, repeat)
        out["load_reshard"]["world"], out["load_reshard"]["rank"] = small, other
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def extrapolate_today(results: list[dict[str, Any]]) -> None:
    """Today's manifest past ``--v2-cap``: linear in chunks from the largest built size of
    the same sharding and tensor count (its bytes per chunk)."""
    for r in results:
        if "today" in r:
            continue
        built = [b for b in results if b["kind"] == r["kind"] and b["tensors"] == r["tensors"]
                 and "today" in b and not b["today"]["extrapolated"]]
        if not built:
            continue
        base = max(built, key=lambda b: b["today"]["chunks"])
        per_chunk = base["today"]["bytes"] / base["today"]["chunks"]
        r["today"] = {"bytes": round(per_chunk * r["cells"]), "chunks": r["cells"], "extrapolated": True,
                      "from_world": base["world"], "bytes_per_chunk": per_chunk}


# ------------------------------------------------------------------------------- output


def _kb(n: float) -> str:
    return f"{n / 1e3:,.1f}" if n < 1e7 else f"{n / 1e6:,.1f}M"


def _s(x: float) -> str:
    return f"{x:.4f}" if x < 1 else f"{x:.2f}"


def table_lines(results: list[dict[str, Any]], kind: str) -> list[str]:
    rows = [r for r in results if r["kind"] == kind]
    head = (f"{'W':>6} {'T':>7} {'chunks':>10} | {'first s':>8} {'(rules)':>8} {'peak MB':>8} {'steady s':>8}"
            f" {'(msgs)':>7} |"
            f" {'manifest KB':>11} {'(tables)':>8} {'today KB':>11} {'new/today':>9} | {'table B':>8} {'tables KB':>10} |"
            f" {'own s':>7} {'own KB':>7} {'tbl':>4} | {'W/4 s':>7} {'W/4 KB':>7} {'tbl':>4} |"
            f" {'rank 1st s':>10} {'rank s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        today = r.get("today")
        if today:
            mark = "~" if today["extrapolated"] else " "
            today_s = f"{mark}{_kb(today['bytes'])}"
            ratio = f"{r['manifest_bytes'] / today['bytes']:.2%}"
        else:
            today_s, ratio = "-", "-"
        lo, lr = r.get("load_own"), r.get("load_reshard")
        cf, cs = r["coordinator_first"], r["coordinator_steady"]
        peak = f"{cf['peak_bytes'] / 1e6:.1f}" if "peak_bytes" in cf else "-"
        total = _kb(r["tables_total_bytes"]) + ("" if r["tables_total_exact"] else "*")
        lines.append(
            f"{r['world']:>6} {r['tensors']:>7} {r['cells']:>10,} | {_s(cf['total_s']):>8} {_s(cf['plan_rules_s']):>8}"
            f" {peak:>8} {_s(cs['total_s']):>8} {_s(cs['messages_s']):>7} | {_kb(r['manifest_bytes']):>11}"
            f" {_kb(r['manifest_tables_bytes']):>8} {today_s:>11} {ratio:>9} |"
            f" {r['rank']['table_bytes']:>8,} {total:>10} |"
            + (f" {_s(lo['s']):>7} {_kb(lo['bytes']):>7} {lo['tables']:>4} | {_s(lr['s']):>7} {_kb(lr['bytes']):>7}"
               f" {lr['tables']:>4} |" if lo else f" {'-':>7} {'-':>7} {'-':>4} | {'-':>7} {'-':>7} {'-':>4} |")
            + f" {_s(r['rank']['first_s']):>10} {_s(r['rank']['steady_s']):>7}"
        )
    return lines


GROWTH = (
    ("first s", lambda r: r["coordinator_first"]["total_s"]),
    ("steady s", lambda r: r["coordinator_steady"]["total_s"]),
    ("peak mem", lambda r: r["coordinator_first"].get("peak_bytes")),
    ("manifest B", lambda r: r["manifest_bytes"]),
    ("- tables B", lambda r: r["manifest_bytes"] - r["manifest_tables_bytes"]),
    ("tables B", lambda r: r["tables_total_bytes"]),
    ("load own B", lambda r: r["load_own"]["bytes"] if "load_own" in r else None),
    ("load own s", lambda r: r["load_own"]["s"] if "load_own" in r else None),
    ("load W/4 B", lambda r: r["load_reshard"]["bytes"] if "load_reshard" in r else None),
    ("rank 1st s", lambda r: r["rank"]["first_s"]),
)


def growth(results: list[dict[str, Any]], kind: str, axis: str) -> list[dict[str, Any]]:
    """Ratios between successive sizes along ``axis`` ("world" or "tensors"), the other fixed."""
    other = "tensors" if axis == "world" else "world"
    rows = sorted((r for r in results if r["kind"] == kind), key=lambda r: (r[other], r[axis]))
    out = []
    for a, b in itertools.pairwise(rows):
        if a[other] != b[other]:
            continue
        ratios = {}
        for name, get in GROWTH:
            x, y = get(a), get(b)
            ratios[name] = y / x if x and y is not None else None
        out.append({"from": a[axis], "to": b[axis], other: a[other], "size_ratio": b[axis] / a[axis], "ratios": ratios})
    return out


def growth_lines(rows: list[dict[str, Any]], axis: str) -> list[str]:
    other = "T" if axis == "world" else "W"
    label = "W" if axis == "world" else "T"
    head = f"  {other:>6} {label + ' from -> to':>18} {'size x':>7} | " + " ".join(f"{n:>10}" for n, _ in GROWTH)
    lines = [head]
    for g in rows:
        fixed = g["tensors"] if axis == "world" else g["world"]
        vals = " ".join(f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in g["ratios"].values())
        lines.append(f"  {fixed:>6} {g['from']:>8} -> {g['to']:>6} {g['size_ratio']:>7.1f} | {vals}")
    return lines


def report(results: list[dict[str, Any]], kinds: Sequence[str]) -> str:
    lines = []
    for kind in kinds:
        if not any(r["kind"] == kind for r in results):
            continue
        lines += ["", f"== {kind} " + "=" * 60, *table_lines(results, kind)]
        for axis, what in (("world", "world size (same T)"), ("tensors", "tensor count (same W)")):
            rows = growth(results, kind, axis)
            if rows:
                lines += ["", f"growth with the {what}: ratio of each figure between successive sizes "
                              "(linear = the size ratio; constant = 1)", *growth_lines(rows, axis)]
        per_chunk = [f"W={r['world']} T={r['tensors']}: {r['today']['bytes'] / r['today']['chunks']:.1f} B"
                     for r in results if r["kind"] == kind and r.get("today") and not r["today"]["extrapolated"]]
        if per_chunk:
            lines += ["", "today's manifest, measured bytes per chunk: " + ", ".join(per_chunk),
                      "  ('~' above: extrapolated linearly in chunks from the largest built W of the same T)"]
        built = [r for r in results if r["kind"] == kind and r.get("today") and not r["today"]["extrapolated"]]
        if built:
            lines += ["today's explicit path, coordinator (assign + chunked_records + manifest, no messaging) "
                      "and per-rank parse of its manifest:"]
            lines += [f"  W={r['world']:>6} T={r['tensors']:>6}: {r['today']['chunks']:>9,} chunks, coordinator "
                      f"{_s(r['today']['coordinator_s'])} s, parse {_s(r['today']['parse_s'])} s" for r in built]
    return "\n".join(lines)


LEGEND = """\
columns: chunks = non-empty cells written (today's manifest lists each); first s = the coordinator's
work in a first save (offers in, agree, assignments out, plan_rules as a rank, reports in, records,
manifest, answers out), best of --repeat, of which (rules) = plan_rules; peak MB = its peak of Python
allocations (tracemalloc, separate pass); steady s = the same in a save that reuses the agreed plan
(no plan_rules), of which (msgs) = unpickling the 2 x W reports and pickling the 2 x W answers (the
transport itself is not simulated); manifest KB = format 3, read by every rank, of which (tables) = its list of every rank's
table size and crc32c (growth column '- tables B' = the manifest without it); today KB = the same save with every chunk
listed (~ = extrapolated); table B = one rank's table (W/2+1); tables KB = all tables (* = estimated
from sampled ranks), each read only by ranks needing one of its chunks; own / W/4 = one rank's load
planning (parse_manifest + RuleChunks.chunks of every tensor's box) into its own placement / an FSDP2
Shard(0) placement over W/4 ranks: seconds, metadata bytes read (manifest + tables), tables read;
rank 1st s / rank s = one rank's digest + plan_rules + my_writes + table (first save) / without
plan_rules (steady state)."""


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def default_sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.quick:
        return [(w, t) for t in (100, 1000) for w in (8, 64, 512)]
    if args.worlds or args.tensors:
        worlds = parse_list(args.worlds) if args.worlds else [8, 64, 512, 4096, 16384]
        counts = parse_list(args.tensors) if args.tensors else [100, 1000]
        return [(w, t) for t in counts for w in worlds]
    sizes = [(w, t) for t in (100, 1000) for w in (8, 64, 512, 4096, 16384)]
    return sizes + [(w, t) for t in (10_000, 100_000) for w in (8, 512)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS), help="shardings, comma separated (default all three)")
    parser.add_argument("--worlds", default=None, help="world sizes, comma separated (default 8,64,512,4096,16384)")
    parser.add_argument("--tensors", default=None, help="tensor counts, comma separated (default 100,1000, then "
                                                        "10^4 and 10^5 at W = 8 and 512)")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per figure, the best kept (default 5; "
                                                              "fewer once a figure's passes took 2 s)")
    parser.add_argument("--v2-cap", type=int, default=2_000_000,
                        help="build today's manifest while W x T stays under this (default 2e6: ~2 KB and ~45 us "
                             "each; ddp up to W = 4096 only)")
    parser.add_argument("--samples", type=int, default=16, help="ranks whose tables are rendered to estimate the "
                                                               "total (default 16; every rank when W is smaller)")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    parser.add_argument("--quick", action="store_true", help="W in 8, 64, 512 x T in 100, 1000, today's format up "
                                                             "to 10^5 chunks: a smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.v2_cap = min(args.v2_cap, 100_000)
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            parser.error(f"unknown sharding {k!r}; known: {', '.join(KINDS)}")
    sizes = default_sizes(args)
    started = time.perf_counter()
    print(f"shardpoint {sp.__version__} from {os.path.dirname(sp.__file__)}, torch {torch.__version__}, numpy "
          f"{np.__version__}, python {platform.python_version()}")
    print(f"machine: {socket.gethostname()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; best of {args.repeat} per timing")
    print(LEGEND)
    results = []
    for kind in kinds:
        for world, count in sizes:
            t0 = time.perf_counter()
            r = measure(kind, world, count, repeat=args.repeat, memory=not args.no_memory, v2_cap=args.v2_cap,
                        samples=args.samples)
            results.append(r)
            print(f"  [{kind} W={world} T={count}: {time.perf_counter() - t0:.1f} s, max RSS "
                  f"{r['max_rss_bytes'] / 1e9:.2f} GB]", file=sys.stderr, flush=True)
    extrapolate_today(results)
    print(report(results, kinds))
    print(f"\nrun took {time.perf_counter() - started:.0f} s; max RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "growth": {k: {a: growth(results, k, a) for a in ("world", "tensors")}
                                                        for k in kinds}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
