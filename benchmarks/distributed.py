"""Collective save and load on one machine: shardpoint against torch.distributed.checkpoint.

N gloo ranks (spawned CPU processes; default 2) hold an FSDP-style state: a Llama-shaped
fp32 state dict (default ~1 GB in total), every tensor a DTensor ``Shard(0)`` over the
ranks. Interleaved over one discarded warm-up round plus ``--rounds`` rounds (``sync`` and a
barrier before every timed call; a call's time is the slowest rank's; medians):

* save, page cache: ``sp.save(layout="chunked", durable=False)`` vs ``dcp.save`` with
  ``sync_files=False`` vs the limit: each rank ``os.write``s its shard bytes to one file;
* save, durable: ``sp.save(durable=True)`` vs ``dcp.save`` (``sync_files=True``, DCP's
  default) vs the limit with ``fsync`` (and with ``O_DIRECT``: 2 threads per rank writing
  8 MiB requests from reused page-aligned buffers, then ``fsync``);
* load into the same sharded targets, warm (page cache) and cold (caches dropped before
  every call, when root): ``sp.load_into`` vs ``dcp.load`` vs the limit: each rank
  ``preadv``s its own bytes into a preallocated buffer (cold, also with ``O_DIRECT``, 2 MiB
  requests into a reused page-aligned buffer: the disk's own speed, no page cache, no copy);

then bytes written per rank for a DDP-replicated state (plain tensors, every rank holds
all of them; shardpoint with ``process_group=WORLD``, DCP as is), and a resharded load:
4 ranks save a smaller Shard(0) state, 2 ranks load it into their Shard(0) targets; bytes
read per rank (from ``/proc/self/io``) against the bytes each rank needs, and times.

    .venv/bin/python benchmarks/distributed.py                # ~1 GB, 2 ranks, 3 rounds
    .venv/bin/python benchmarks/distributed.py --quick        # 0.1 GB, 1 round: smoke run
    .venv/bin/python benchmarks/distributed.py --gb 2 --ranks 2,4 --rounds 5

Needs about 4x the state on disk and 3x in RAM.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _common import (
    accepts_direct,
    can_drop_caches,
    drop_caches,
    files_under,
    freed_memory_held,
    fsync_tree,
    read_direct,
    refresh_free_memory,
    remove,
    round_order,
    start_writeback,
    write_direct,
)

# ----------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class Shapes:
    """A Llama-like decoder sized to a byte budget (fp32)."""

    hidden: int
    layers: int
    vocab: int

    @classmethod
    def for_bytes(cls, nbytes: int) -> Shapes:
        hidden = 2048 if nbytes >= 400e6 else 1024 if nbytes >= 150e6 else 512
        vocab = max(1024, min(32_000, int(nbytes * 0.25 / (2 * hidden * 4))))  # embeddings <= ~1/4
        per_layer = (4 * hidden * hidden + 3 * hidden * (11 * hidden // 4) + 2 * hidden) * 4
        fixed = (2 * vocab * hidden + hidden) * 4
        return cls(hidden, max(1, round((nbytes - fixed) / per_layer)), vocab)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden, 11 * self.hidden // 4
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{name}.weight"] = (h, h)
            out[p + "mlp.gate_proj.weight"] = (f, h)
            out[p + "mlp.up_proj.weight"] = (f, h)
            out[p + "mlp.down_proj.weight"] = (h, f)
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out

    def nbytes(self) -> int:
        return sum(math.prod(s) * 4 for s in self.tensors().values())


def sharded_state(shapes: Shapes, mesh: Any, *, blank: bool) -> dict[str, Any]:
    """Shard(0) DTensors built from their local shards (no full tensor anywhere)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for i, (name, shape) in enumerate(shapes.tensors().items()):
        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        if blank:
            local = torch.full(local_shape, math.nan)
        else:  # values that depend on the global position only: any world size can check them
            start = i * 1_000_003 + offsets[0] * math.prod(shape[1:])
            local = torch.arange(start, start + math.prod(local_shape), dtype=torch.float64)
            local = torch.remainder(local, 65_521).to(torch.float32).reshape(local_shape)
        out[name] = DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    return out


def local_bytes(state: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in state.values())


def same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(a[k].to_local(), b[k].to_local()) for k in a)


# ----------------------------------------------------------------------------- measuring


def _rchar() -> int:
    """Bytes this process read through read syscalls so far (page cache included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


@dataclass
class Case:
    key: str
    label: str
    run: Callable[[], object]
    prepare: Callable[[], object] = lambda: None
    """Untimed, on every rank before the call (removing the previous output)."""
    check: Callable[[], object] = lambda: None
    """Untimed, after the warm-up call only."""


class Ranks:
    """Collective timing: a call's time is the slowest rank's, from a common start."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def log(self, text: str = "") -> None:
        if self.rank == 0:
            print(text, flush=True)

    def max(self, value: float) -> float:
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def gather(self, value: float) -> list[float]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, value)
        return out

    def timed(self, case: Case, *, cold_paths: list[str] | None) -> float:
        # sync (or drop the caches) first, then delete this case's previous output, then
        # time at once: every case writes into memory freed a moment ago, not into memory
        # this VM has meanwhile handed back to its host (see run_interleaved in _common.py).
        self.dist.barrier()
        if self.rank == 0:
            if cold_paths is not None:
                drop_caches(f for p in cold_paths for f in files_under(p))
            else:
                os.sync()
        self.dist.barrier()
        case.prepare()  # ends with a barrier
        started = time.perf_counter()
        case.run()
        return self.max(time.perf_counter() - started)

    def interleaved(
        self, name: str, cases: list[Case], rounds: int, cold_paths: list[str] | None = None
    ) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {c.key: [] for c in cases}
        self.dist.barrier()
        if self.rank == 0:
            refresh_free_memory()
        for round_no in range(rounds + 1):
            parts = []
            for case in round_order(cases, round_no):  # each round its own order
                seconds = self.timed(case, cold_paths=cold_paths)
                if round_no == 0:
                    case.check()
                else:
                    times[case.key].append(seconds)
                parts.append(f"{case.key} {seconds:.2f}")
            tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
            self.log(f"  [{name}] {tag}: " + "  ".join(parts))
        return times


def table(
    title: str, labels: dict[str, str], times: dict[str, list[float]], nbytes: int, base: str
) -> str:
    width = max(len(v) for v in labels.values())
    versus = "vs limit" if base == "plain" else f"vs {base}"
    head = f"{'':{width}}  {'median s':>9} {'GB/s':>6} {versus:>9}  {'min-max s':>11}"
    lines = [title, head, "-" * len(head)]
    for key, label in labels.items():
        med = statistics.median(times[key])
        lines.append(
            f"{label:{width}}  {med:9.3f} {nbytes / med / 1e9:6.2f} "
            f"{med / statistics.median(times[base]):8.2f}x  {min(times[key]):5.2f}-{max(times[key]):<5.2f}"
        )
    return "\n".join(lines)


def median(times: dict[str, list[float]], key: str) -> float:
    return statistics.median(times[key])


def disk_limit(times: dict[str, list[float]]) -> float:
    """The faster of a section's limits: ``plain`` and, where it ran, ``plain_direct``."""
    return min(median(times, k) for k in ("plain", "plain_direct") if k in times)


# ----------------------------------------------------------------------------- the limit


WRITEBACK_BYTES = 64 << 20


def plain_write(path: str, state: dict[str, Any], *, durable: bool) -> None:
    """One sequential stream of this rank's shard bytes: the physical limit for a rank.

    Durable, the disk is started on every 64 MB as soon as it is written
    (``sync_file_range``) and the file fsynced at the end: what the disk can take durably
    from one stream, not a write to the page cache followed by a flush of all of it.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = flushed = 0
        for t in state.values():
            view = memoryview(t.to_local().reshape(-1).view(-1).numpy()).cast("B")
            while view:
                n = os.write(fd, view[:WRITEBACK_BYTES])
                view, written = view[n:], written + n
                if durable and written - flushed >= WRITEBACK_BYTES:
                    start_writeback(fd, flushed, written - flushed)
                    flushed = written
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


DIRECT_WRITE_STREAMS, DIRECT_WRITE_BYTES = 2, 8 << 20
"""The O_DIRECT write limit: this disk took direct writes fastest with several 8 MiB
requests in flight (fio, 2 GB: 1.7-2.5 GB/s with 1-4 jobs, 2.66 GB/s at best with 2 jobs
of 4 requests each)."""

DIRECT_READ_BYTES = 2 << 20
"""Request size of the O_DIRECT limit: this disk read fastest at 1-2 MiB (see _io/files.py)."""


def plain_read(path: str, buffer: Any) -> None:
    view = memoryview(buffer.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < len(view):
            n = os.preadv(fd, [view[pos : pos + (64 << 20)]], pos)
            if n <= 0:
                raise OSError(f"{path}: short read")
            pos += n
    finally:
        os.close(fd)


RESHARD_PLAIN_THREADS = 2
"""Threads of the resharded load's plain read (64 MiB requests), as save_load.py's."""


def plain_read_into(path: str, views: list[memoryview], *, threads: int, request_bytes: int = 64 << 20) -> None:
    """``preadv`` the file at ``path`` into ``views`` (its bytes in order, back to back),
    ``request_bytes`` a request, on ``threads`` threads."""
    from concurrent.futures import ThreadPoolExecutor

    pieces, offset = [], 0
    for view in views:
        for start in range(0, len(view), request_bytes):
            pieces.append((view[start : start + request_bytes], offset + start))
        offset += len(view)
    fd = os.open(path, os.O_RDONLY)

    def read(piece: tuple[memoryview, int]) -> None:
        view, pos = piece
        while view:
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise OSError(f"{path}: short read at byte {pos}")
            view, pos = view[n:], pos + n

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, pieces))
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the ranks


def dcp_hf_classes() -> tuple[Any, Any]:
    """DCP's ``HuggingFaceStorageReader`` and ``Writer``, or (None, None) on a torch without
    them (their rows are then left out)."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    except ImportError:
        return None, None
    return HuggingFaceStorageReader, HuggingFaceStorageWriter


def main_section(r: Ranks, args: argparse.Namespace, work: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardpoint as sp

    HuggingFaceStorageReader, HuggingFaceStorageWriter = dcp_hf_classes()

    shapes = Shapes.for_bytes(int(args.gb * 1e9))
    mesh = init_device_mesh("cpu", (r.world,))
    state = sharded_state(shapes, mesh, blank=False)
    targets = sharded_state(shapes, mesh, blank=True)
    total, mine = shapes.nbytes(), local_bytes(state)
    r.log(
        f"\n=== {r.world} ranks: {total / 1e9:.2f} GB fp32 ({len(shapes.tensors())} tensors, "
        f"hidden {shapes.hidden}, {shapes.layers} layers), Shard(0), {mine / 1e9:.2f} GB per rank ==="
    )
    d = os.path.join(work, f"ws{r.world}")
    if r.rank == 0:
        os.makedirs(d, exist_ok=True)
    r.dist.barrier()
    paths = {k: os.path.join(d, k) for k in ("sp", "sp_durable", "dcp", "dcp_durable", "dcp_hf", "dcp_hf_durable")}
    plain = os.path.join(d, f"plain-rank{r.rank}.bin")

    def removing(*names: str) -> Callable[[], None]:
        """Delete this case's previous output, and only its own (see ``Ranks.timed``)."""

        def prepare() -> None:
            if r.rank == 0:
                for n in names:
                    remove(paths[n])
            if not names:  # the limit
                remove(plain)
            r.dist.barrier()

        return prepare

    def check_load(name: str) -> Callable[[], None]:
        def check() -> None:
            ok = same_values(targets, state)
            for t in targets.values():
                t.to_local().fill_(math.nan)
            if not all(r.gather(ok)):
                raise AssertionError(f"{name} did not reproduce the saved tensors")

        return check

    def writer(durable: bool) -> Any:
        return dcp.FileSystemWriter(paths["dcp_durable" if durable else "dcp"], sync_files=durable)

    def save_dcp_hf(durable: bool) -> None:
        """DCP with its safetensors writer: one file per rank (``save_distributed``), not
        consolidated into the model's files (that is a second pass over every byte). It
        does not fsync: for the durable save every rank fsyncs the directory after it,
        inside the timed call, as ``save_load.py`` does for every peer that does not."""
        out = paths["dcp_hf_durable" if durable else "dcp_hf"]
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
        if durable:
            fsync_tree(out)

    saves = [
        Case(
            "plain",
            "plain os.write, 1 stream per rank (limit)",
            lambda: plain_write(plain, state, durable=False),
            removing(),
        ),
        Case(
            "sp",
            "sp.save(layout='chunked', durable=False)",
            lambda: sp.save(state, paths["sp"], layout="chunked", durable=False),
            removing("sp"),
        ),
        Case(
            "dcp",
            "dcp.save(sync_files=False)",
            lambda: dcp.save(state, storage_writer=writer(False)),
            removing("dcp"),
        ),
    ]
    if HuggingFaceStorageWriter is not None:
        saves.append(
            Case(
                "dcp_hf",
                "dcp.save, HuggingFaceStorageWriter (1 file per rank)",
                lambda: save_dcp_hf(False),
                removing("dcp_hf"),
            )
        )
    durable_saves = [
        Case(
            "plain",
            "plain os.write + writeback + fsync, 1 stream/rank (limit)",
            lambda: plain_write(plain, state, durable=True),
            removing(),
        ),
        Case(
            "sp",
            "sp.save(layout='chunked', durable=True)",
            lambda: sp.save(state, paths["sp_durable"], layout="chunked", durable=True),
            removing("sp_durable"),
        ),
        Case(
            "dcp",
            "dcp.save (sync_files=True, the default)",
            lambda: dcp.save(state, storage_writer=writer(True)),
            removing("dcp_durable"),
        ),
    ]
    if HuggingFaceStorageWriter is not None:
        durable_saves.append(
            Case(
                "dcp_hf",
                "dcp.save, HuggingFaceStorageWriter + fsync",
                lambda: save_dcp_hf(True),
                removing("dcp_hf_durable"),
            )
        )
    # The O_DIRECT limits, where the file system takes O_DIRECT (not all do: tmpfs before
    # Linux 6.6, some network file systems).
    direct_ok = accepts_direct(d)
    if direct_ok:
        durable_saves.append(
            Case(
                "plain_direct",
                "plain O_DIRECT write + fsync, 2 streams/rank (limit)",
                lambda: write_direct(
                    plain, mine, streams=DIRECT_WRITE_STREAMS, request_bytes=DIRECT_WRITE_BYTES
                ),
                removing(),
            )
        )
    results: dict[str, Any] = {}
    t_save = r.interleaved("save, page cache", saves, args.rounds)
    t_dsave = r.interleaved("save, durable", durable_saves, args.rounds)

    plain_write(plain, state, durable=False)  # what the plain read reads
    buffer = torch.empty(mine, dtype=torch.uint8)
    loads = [
        Case(
            "plain", "plain preadv of this rank's bytes (limit)", lambda: plain_read(plain, buffer)
        ),
        Case(
            "sp",
            "sp.load_into(targets, process_group=WORLD)",
            lambda: sp.load_into(targets, paths["sp"], process_group=r.dist.group.WORLD),
            check=check_load("sp.load_into"),
        ),
        Case(
            "dcp",
            "dcp.load(targets)",
            lambda: dcp.load(targets, checkpoint_id=paths["dcp"]),
            check=check_load("dcp.load"),
        ),
    ]
    if HuggingFaceStorageReader is not None:
        loads.append(
            Case(
                "dcp_hf",
                "dcp.load(targets), HuggingFaceStorageReader",
                lambda: dcp.load(targets, storage_reader=HuggingFaceStorageReader(paths["dcp_hf"])),
                check=check_load("dcp.load (HuggingFaceStorageReader)"),
            )
        )
    t_load = r.interleaved("load, warm", loads, args.rounds)
    t_cold = None
    direct = Case(
        "plain_direct",
        "plain O_DIRECT read of this rank's bytes (limit)",
        lambda: read_direct(plain, streams=1, request_bytes=DIRECT_READ_BYTES),
    )
    if not args.no_cold:
        colds = [*loads, direct] if direct_ok else loads
        t_cold = r.interleaved("load, cold", colds, args.rounds, cold_paths=[d])

    labels_s = {c.key: c.label for c in saves}
    labels_d = {c.key: c.label for c in durable_saves}
    labels_l = {c.key: c.label for c in loads}
    labels_c = {**labels_l, direct.key: direct.label} if direct_ok else labels_l
    r.log("")
    r.log(table(f"save to the page cache, {r.world} ranks", labels_s, t_save, total, "plain"))
    r.log("")
    r.log(table(f"durable save, {r.world} ranks", labels_d, t_dsave, total, "plain"))
    r.log("")
    r.log(
        table(
            f"load into the sharded targets, warm, {r.world} ranks",
            labels_l,
            t_load,
            total,
            "plain",
        )
    )
    if t_cold is not None:
        r.log("")
        r.log(
            table(
                f"load into the sharded targets, cold, {r.world} ranks",
                labels_c,
                t_cold,
                total,
                "plain",
            )
        )
    results["save"] = median(t_save, "dcp") / median(t_save, "sp")
    results["save_durable"] = median(t_dsave, "dcp") / median(t_dsave, "sp")
    # A durable save ends at the disk too: what a save writing at the limit (the faster of a
    # buffered stream flushed as it goes and direct writes) would have scored.
    results["bound_save_durable"] = median(t_dsave, "dcp") / disk_limit(t_dsave)
    results["sp_vs_limit_durable"] = median(t_dsave, "sp") / median(t_dsave, "plain")
    results["load_warm"] = median(t_load, "dcp") / median(t_load, "sp")
    if t_cold is not None:
        results["load_cold"] = median(t_cold, "dcp") / median(t_cold, "sp")
        # The disk sets the pace of a cold load: what a load at the limit (the faster of a
        # buffered and a direct read) would have scored.
        results["bound_load_cold"] = median(t_cold, "dcp") / disk_limit(t_cold)
    results["sp_vs_limit_save"] = median(t_save, "sp") / median(t_save, "plain")
    sections = {"save": t_save, "save_durable": t_dsave, "load_warm": t_load, "load_cold": t_cold}
    results["median_s"] = {
        name: {key: median(times, key) for key in times} for name, times in sections.items() if times is not None
    }
    results["sp_vs_limit_load"] = median(t_load, "sp") / median(t_load, "plain")

    # -- bytes written per rank, DDP-replicated state
    rep_shapes = Shapes.for_bytes(int(max(args.gb / 4, 0.02) * 1e9))
    replicated = {
        k: v.full_tensor() for k, v in sharded_state(rep_shapes, mesh, blank=False).items()
    }
    rep_sp, rep_dcp = os.path.join(d, "rep-sp"), os.path.join(d, "rep-dcp")
    sp.save(replicated, rep_sp, layout="chunked", durable=False, process_group=r.dist.group.WORLD)
    dcp.save(replicated, storage_writer=dcp.FileSystemWriter(rep_dcp, sync_files=False))
    r.dist.barrier()
    if r.rank == 0:
        sp_bytes = [0] * r.world
        for n in os.listdir(rep_sp):
            if n.startswith("model-r"):
                sp_bytes[int(n[7:12])] += os.path.getsize(os.path.join(rep_sp, n))
        dcp_bytes = [0] * r.world
        for n in os.listdir(rep_dcp):
            if n.endswith(".distcp"):
                dcp_bytes[int(n.split("_")[2])] += os.path.getsize(os.path.join(rep_dcp, n))
        rep_total = rep_shapes.nbytes()
        print(
            f"\nbytes written per rank, DDP-replicated state ({rep_total / 1e9:.3f} GB, every rank holds all of it)"
        )
        for name, per in (("sp.save(process_group=WORLD)", sp_bytes), ("dcp.save", dcp_bytes)):
            shown = ", ".join(f"rank {i}: {b / 1e6:.1f} MB" for i, b in enumerate(per))
            print(
                f"  {name:<30} {shown}   max/min {max(per) / max(min(per), 1):.3f}   "
                f"sum/state {sum(per) / rep_total:.3f}"
            )
        results["ddp_balance"] = max(sp_bytes) / max(min(sp_bytes), 1)
        results["ddp_sum"] = sum(sp_bytes) / rep_total
    for p in (rep_sp, rep_dcp):
        if r.rank == 0:
            remove(p)
    r.dist.barrier()
    return results


def reshard_save(r: Ranks, args: argparse.Namespace, work: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardpoint as sp

    _, HuggingFaceStorageWriter = dcp_hf_classes()

    shapes = Shapes.for_bytes(int(args.reshard_gb * 1e9))
    mesh = init_device_mesh("cpu", (r.world,))
    state = sharded_state(shapes, mesh, blank=False)
    sp.save(state, os.path.join(work, "reshard-sp"), layout="chunked", durable=False)
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(os.path.join(work, "reshard-dcp"), sync_files=False),
    )
    if HuggingFaceStorageWriter is not None:
        out = os.path.join(work, "reshard-dcp-hf")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))


def reshard_load(r: Ranks, args: argparse.Namespace, work: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardpoint as sp

    HuggingFaceStorageReader, _ = dcp_hf_classes()

    shapes = Shapes.for_bytes(int(args.reshard_gb * 1e9))
    mesh = init_device_mesh("cpu", (r.world,))
    expected = sharded_state(shapes, mesh, blank=False)
    targets = sharded_state(shapes, mesh, blank=True)
    needed = local_bytes(targets)
    paths = {"sp": os.path.join(work, "reshard-sp"), "dcp": os.path.join(work, "reshard-dcp")}
    read: dict[str, int] = {}
    reported: dict[str, int] = {}

    def counting(key: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            before = _rchar()
            out = fn()
            read[key] = _rchar() - before
            if key == "sp":
                reported[key] = out.bytes_read

        return run

    def check(name: str) -> Callable[[], None]:
        def run() -> None:
            ok = same_values(targets, expected)
            for t in targets.values():
                t.to_local().fill_(math.nan)
            if not all(r.gather(ok)):
                raise AssertionError(f"{name} did not reproduce the saved tensors after resharding")

        return run

    def load_sp() -> Any:
        return sp.load_into(targets, paths["sp"], process_group=r.dist.group.WORLD)

    def load_dcp() -> Any:
        return dcp.load(targets, checkpoint_id=paths["dcp"])

    # The limit: this rank's bytes, written once to a plain file (untimed) and read warm
    # straight into the targets' memory, the way save_load.py's plain reader reads.
    plain = os.path.join(work, f"reshard-plain-rank{r.rank}.bin")
    plain_write(plain, expected, durable=False)
    plain_views = [memoryview(t.to_local().reshape(-1).view(-1).numpy()).cast("B") for t in targets.values()]

    def load_plain() -> None:
        plain_read_into(plain, plain_views, threads=RESHARD_PLAIN_THREADS)

    cases = [
        Case(
            "plain",
            f"plain preadv of this rank's bytes, {RESHARD_PLAIN_THREADS} threads (limit)",
            load_plain,
            check=check("the plain read"),
        ),
        Case(
            "sp",
            "sp.load_into (Shard(0) targets, process_group=WORLD)",
            load_sp,
            check=check("sp.load_into"),
        ),
        Case("dcp", "dcp.load (Shard(0) targets)", load_dcp, check=check("dcp.load")),
    ]
    if HuggingFaceStorageReader is not None:
        hf_path = os.path.join(work, "reshard-dcp-hf")
        cases.append(
            Case(
                "dcp_hf",
                "dcp.load, HuggingFaceStorageReader (Shard(0) targets)",
                lambda: dcp.load(targets, storage_reader=HuggingFaceStorageReader(hf_path)),
                check=check("dcp.load (HuggingFaceStorageReader)"),
            )
        )
    r.log(
        f"\n=== resharded load: {args.reshard_from} ranks saved {shapes.nbytes() / 1e9:.2f} GB Shard(0); "
        f"{r.world} ranks load it into Shard(0) targets ==="
    )
    times = r.interleaved("reshard load, warm", cases, args.rounds)
    # Counted once more, untimed. rchar counts read syscalls: shardpoint's mapped copy of
    # page-cache-resident pieces bypasses them, so it is off for this count.
    with sp.using(io=sp.IOOptions(cached_copy=False)):
        counting("sp", load_sp)()
    counting("dcp", load_dcp)()
    check("counted loads")()
    per_sp = r.gather(read["sp"])
    per_dcp = r.gather(read["dcp"])
    per_reported = r.gather(reported["sp"])
    per_needed = r.gather(needed)
    r.log(
        table(
            f"\nresharded load {args.reshard_from} -> {r.world} ranks, warm",
            {c.key: c.label for c in cases},
            times,
            shapes.nbytes(),
            "plain",
        )
    )
    r.log(
        f"\nbytes read per rank in the {args.reshard_from} -> {r.world} reshard (from /proc/self/io rchar; "
        "sp with IOOptions(cached_copy=False), whose mapped copies rchar cannot see)"
    )
    for rank in range(r.world):
        r.log(
            f"  rank {rank}: needs {per_needed[rank] / 1e6:8.1f} MB   sp read {per_sp[rank] / 1e6:8.1f} MB "
            f"({per_sp[rank] / per_needed[rank]:.3f}x; LoadResult.bytes_read {per_reported[rank] / 1e6:.1f} MB)   "
            f"dcp read {per_dcp[rank] / 1e6:8.1f} MB ({per_dcp[rank] / per_needed[rank]:.3f}x)"
        )
    return {
        "reshard_read": max(s / n for s, n in zip(per_sp, per_needed, strict=True)),
        "reshard_read_dcp": max(s / n for s, n in zip(per_dcp, per_needed, strict=True)),
        "reshard_time": median(times, "dcp") / median(times, "sp"),
        "reshard_vs_limit": median(times, "sp") / median(times, "plain"),
        "median_s": {"reshard_load_warm": {key: median(times, key) for key in times}},
    }


SECTIONS = {"main": main_section, "reshard_save": reshard_save, "reshard_load": reshard_load}


def _entry(
    section: str, rank: int, world: int, port: int, args: argparse.Namespace, work: str, out: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=20),
    )
    try:
        result = SECTIONS[section](Ranks(), args, work)
        if rank == 0 and result:
            out.put(result)
    except BaseException:
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    gc.collect()  # drop reference cycles holding gloo work first (else a rare SIGABRT at exit)
    dist.destroy_process_group()
    # Skip the interpreter's teardown: a gloo thread still joinable when C++ statics are
    # destroyed aborts the process ("terminate called without an active exception"), seen
    # in 1 of 3 quick runs even after the collect above. The result is already sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(section: str, world: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_entry, args=(section, rank, world, port, args, work, out))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(5)
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.join()
    bad = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise SystemExit(f"{section} on {world} ranks failed on ranks {bad}")
    return out.get() if not out.empty() else {}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gb", type=float, default=1.0, help="state size in GB (10^9 bytes), all ranks together"
    )
    parser.add_argument(
        "--ranks", default="2", help="world sizes of the main section, e.g. 2 or 2,4 (\"\": none)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    parser.add_argument(
        "--reshard", default="4,2", help="save world size, load world size of the reshard"
    )
    parser.add_argument(
        "--reshard-gb", type=float, default=None, help="state size of the reshard (default gb/4)"
    )
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache loads")
    parser.add_argument("--quick", action="store_true", help="0.1 GB, 1 round: a smoke run")
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where the scratch directory goes"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--json", metavar="PATH", help="also write every median and ratio to this JSON file")
    parser.add_argument(
        "--vm-memory-as-is",
        action="store_true",
        help="leave this VM's free page reporting as it is (by default freed memory is held "
        "in the guest during the run; see freed_memory_held in _common.py)",
    )
    args = parser.parse_args()
    if args.quick:
        args.gb, args.rounds = 0.1, 1
    if args.reshard_gb is None:
        args.reshard_gb = max(args.gb / 4, 0.02)
    args.reshard_from, args.reshard_to = (int(x) for x in args.reshard.split(","))
    worlds = [int(x) for x in args.ranks.split(",") if x]  # --ranks "": the reshard only

    import torch

    with freed_memory_held(not args.vm_memory_as_is) as memory:
        print(
            f"shardpoint distributed benchmark: torch {torch.__version__}, python {platform.python_version()}, "
            f"{os.cpu_count()} cores, gloo on CPU, {args.rounds} rounds after a warm-up (interleaved, medians, "
            f"sync + barrier before each call; a call's time is the slowest rank's)"
            + (
                ""
                if can_drop_caches() or args.no_cold
                else "; cold = posix_fadvise(DONTNEED), not root"
            )
            + f"\n{memory}",
            flush=True,
        )
        work = tempfile.mkdtemp(prefix="sp-dist-bench-", dir=args.dir)
        try:
            ratios = {w: spawn("main", w, args, work) for w in worlds}
            spawn("reshard_save", args.reshard_from, args, work)
            reshard = spawn("reshard_load", args.reshard_to, args, work)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)

    print("\n=== targets ===")
    checks: list[tuple[str, float, str, float, float | None]] = []
    for w, res in ratios.items():
        checks += [
            (f"save, page cache, {w} ranks: dcp time / sp time", res["save"], ">=", 2.0, None),
            (
                f"save, durable, {w} ranks: dcp time / sp time",
                res["save_durable"],
                ">=",
                2.0,
                res["bound_save_durable"],
            ),
            (f"load, warm, {w} ranks: dcp time / sp time", res["load_warm"], ">=", 1.5, None),
        ]
        if "load_cold" in res:
            checks.append(
                (
                    f"load, cold, {w} ranks: dcp time / sp time",
                    res["load_cold"],
                    ">=",
                    1.5,
                    res["bound_load_cold"],
                )
            )
        checks.append(
            (
                f"DDP-replicated, {w} ranks: max/min bytes written per rank",
                res["ddp_balance"],
                "<=",
                1.1,
                None,
            )
        )
    checks.append(
        (
            f"reshard {args.reshard_from}->{args.reshard_to}: sp bytes read / bytes needed (worst rank)",
            reshard["reshard_read"],
            "<=",
            1.1,
            None,
        )
    )
    checks.append(
        (
            f"reshard {args.reshard_from}->{args.reshard_to} warm: sp time / plain read of its bytes",
            reshard["reshard_vs_limit"],
            "<=",
            1.3,
            None,
        )
    )
    for name, value, op, threshold, bound in checks:
        ok = value >= threshold if op == ">=" else value <= threshold
        print(
            f"  {'PASS' if ok else 'FAIL'}  {name:<66} {value:6.2f}x  (target {op} {threshold:g}x)"
            + (f"  at the limit: {bound:.2f}x" if bound is not None else "")
        )
    print(
        "  (at the limit: dcp's time over plain's in the same section (durable: the faster of one\n"
        "   fsynced stream per rank and O_DIRECT writes; cold: the faster of preadv and O_DIRECT\n"
        "   reads), the ratio a save or load at the disk's measured speed would have scored)"
    )
    print("  ----  without targets:")
    for w, res in ratios.items():
        print(
            f"        sp save / plain write, {w} ranks: {res['sp_vs_limit_save']:.2f}x;  "
            f"durable: {res['sp_vs_limit_durable']:.2f}x;  "
            f"sp warm load / plain read: {res['sp_vs_limit_load']:.2f}x;  "
            f"DDP-replicated: files / state bytes {res['ddp_sum']:.3f}"
        )
    print(
        f"        reshard {args.reshard_from}->{args.reshard_to}: dcp bytes read / needed "
        f"{reshard['reshard_read_dcp']:.2f}x;  dcp time / sp time {reshard['reshard_time']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"main": {str(w): res for w, res in ratios.items()}, "reshard": reshard}, f, indent=2)


if __name__ == "__main__":
    main()
