"""Async save: how long the training loop is blocked, against a synchronous save and DCP.

One run, one transformer-shaped fp32 state dict (default ~2.15 GB, the same shapes as
``save_load.py``), 500 MB shards, every save durable (fsync). Two parts:

1. Stall and total, interleaved (A B C ...) over one discarded warm-up round plus
   ``--rounds`` timed rounds, ``sync`` before every call, medians. For each peer the
   *stall* is the time until the call returns control to the training loop; the *total*
   is the time until the checkpoint is durable (for the async peers the wait for that
   happens after the stall was taken, outside the timed region of the stall).

   * plain memcpy into a preallocated, reused buffer: the limit of any stall;
   * plain sequential ``os.write`` + fsync into one file: the limit of any total;
   * ``sp.async_save``: stall = return of the call, total = until ``.result()`` returns;
   * ``sp.save``: synchronous, stall = total;
   * DCP ``torch.distributed.checkpoint.async_save`` in one process, with a reused
     ``DefaultStager`` (CPU buffers cached across saves, the fair twin of ours), and with
     its default staging (``FileSystemWriter`` copies into fresh memory every save).
     On torch >= 2.6 DCP runs without a process group (it warns and assumes a single
     process), so none is created. Its total includes fsyncing the directories and the
     ``.metadata`` file (it fsyncs only its data files itself).

2. Host RSS across 10 consecutive ``sp.async_save`` calls to 10 different directories, each
   waited: the staging buffer is allocated once and reused, so RSS must stay flat.

    .venv/bin/python benchmarks/async_save.py             # full size, ~2.15 GB
    .venv/bin/python benchmarks/async_save.py --quick     # 0.1 GB, 1 round (< 1 minute)
    .venv/bin/python benchmarks/async_save.py --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import shardpoint as sp
from shardpoint import _async as sp_async

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    SectionResult,
    TargetCheck,
    current_rss,
    format_section,
    fsync_tree,
    log_err,
    process_cpu_seconds,
    remove,
    sync,
)

# DCP warns that it runs without a process group; that is the single-process case measured.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*process group.*")

SHARD_SIZE = "500MB"
VOCAB = 32_000
RSS_SAVES = 10
STALL_TARGET = 0.5
RSS_TARGET = 0.05

Shapes = dict[str, tuple[int, ...]]
StateDict = dict[str, torch.Tensor]

# ----------------------------------------------------------------------------- the data
#
# The same Llama-like shapes as benchmarks/save_load.py (it keeps its builder to itself, so
# the few lines are repeated here rather than imported from a file being edited).


@dataclass(frozen=True)
class ModelShape:
    """A Llama-like decoder sized to a byte budget."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int

    def shapes(self) -> Shapes:
        h, i = self.hidden, self.intermediate
        out: Shapes = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = (h,)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{proj}.weight"] = (h, h)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out


def model_shape_for(nbytes: float) -> ModelShape:
    """The widest Llama-like shape (hidden a multiple of 128) that still has about 8 layers."""
    params = nbytes / 4

    def shape(hidden: int) -> ModelShape:
        vocab = min(VOCAB, 16 * hidden)
        inter = round(hidden * 2.6875 / 64) * 64  # Llama's 11008 / 4096
        per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
        layers = round((params - 2 * vocab * hidden - hidden) / per_layer)
        return ModelShape(vocab, hidden, inter, layers)

    hidden = 128
    while shape(hidden + 128).layers >= 8:
        hidden += 128
    best = shape(hidden)
    return ModelShape(best.vocab, best.hidden, best.intermediate, max(1, best.layers))


def make_state_dict(shapes: Shapes, seed: int) -> StateDict:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def tensor_bytes(state: StateDict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy)."""
    return memoryview(tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


# ------------------------------------------------------------------------------- peers
#
# Each peer's ``start`` writes the state to ``out`` (which does not exist yet) and returns
# when the training loop could go on; it returns a ``finish`` callable that blocks until
# the checkpoint is durable (None when ``start`` already made it so).

Finish = Callable[[], object] | None


@dataclass
class Peer:
    key: str
    label: str
    start: Callable[[StateDict, str], Finish]
    stall_only: bool = False
    """Not a save (the memcpy limit): no total."""
    total_only: bool = False
    """Not a stall (the plain write limit): no stall."""


class PlainCopy:
    """The stall limit: one memcpy of every tensor into buffers allocated once."""

    def __init__(self) -> None:
        self.buffers: StateDict = {}

    def __call__(self, state: StateDict, out: str) -> Finish:
        with torch.no_grad():
            for name, t in state.items():
                buf = self.buffers.get(name)
                if buf is None:
                    buf = self.buffers[name] = torch.empty_like(t)
                buf.copy_(t)
        return None


def plain_write(state: StateDict, out: str) -> Finish:
    """The total limit: sequential os.write of every tensor into one file, then fsync."""
    os.mkdir(out)
    fd = os.open(os.path.join(out, "plain.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in state.values():
            view = byte_view(tensor)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    fsync_tree(out)
    return None


def sp_async_save(state: StateDict, out: str) -> Finish:
    handle = sp.async_save(state, out, max_shard_size=SHARD_SIZE, durable=True, progress=False)
    return handle.result


def sp_sync_save(state: StateDict, out: str) -> Finish:
    sp.save(state, out, max_shard_size=SHARD_SIZE, durable=True, progress=False)
    return None


def dcp_async(stager: DefaultStager | None) -> Callable[[StateDict, str], Finish]:
    def start(state: StateDict, out: str) -> Finish:
        writer = dcp.FileSystemWriter(out, sync_files=True)
        future = dcp.async_save(state, storage_writer=writer, async_stager=stager)

        def finish() -> None:
            future.result()
            fsync_tree(out)

        return finish

    return start


class TorchCheckpointingAsync:
    """torch-checkpointing's async saver, made once (on the first call: it starts a writer
    process and keeps its staging buffers) and reused, as DCP's stager is: buffered I/O
    (its default O_DIRECT path fails on ext4 here), no barrier, no temporary directory (one
    process). The stall is until its stage future resolves; the total until its write
    future does, plus the fsync of every file and directory it does not do itself."""

    def __init__(self) -> None:
        self.saver: Any = None

    def __call__(self, state: StateDict, out: str) -> Finish:
        import torch_checkpointing as tc
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        if self.saver is None:
            rank = tc.RankInfo(global_rank=0, global_world_size=1, role_rank=0, role_world_size=1)
            config = tc.AsyncCheckpointSaverConfig(
                writer_config=tc.CheckpointWriterConfig(barrier_config=None, write_to_temp_dir=False)
            )
            self.saver = tc.make_async_checkpoint_saver(
                config=config, rank_info=rank, storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
            )
        item = _torch_checkpointing_item(state)
        staged, written = self.saver.save(out, item)
        staged.result()

        def finish() -> None:
            written.result()
            fsync_tree(out)

        return finish

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
            self.saver = None


def _torch_checkpointing_item(state: StateDict) -> Any:
    """torch-checkpointing's view of a state dict: one item."""
    import torch_checkpointing as tc

    class Item(tc.CheckpointBase):  # type: ignore[misc]
        def get_items(self) -> dict[str, Any]:
            return {"model": tc.CheckpointItem(value=state)}

        def load_state_dict(self, state_dict: Any) -> None:
            del state_dict

    return Item()


def have(module: str) -> bool:
    """Whether an optional peer is installed; says so when it is not."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        print(f"peer skipped: {module} is not installed; pip install -e '.[bench]'", flush=True)
        return False
    return True


# ------------------------------------------------------------------------- stall / total


@dataclass
class StallResult:
    nbytes: int
    labels: dict[str, str]
    stall: dict[str, list[float]] = field(default_factory=dict)
    total: dict[str, list[float]] = field(default_factory=dict)
    stall_cpu: dict[str, list[float]] = field(default_factory=dict)
    total_cpu: dict[str, list[float]] = field(default_factory=dict)

    def section(self, which: str, baseline: str) -> SectionResult:
        seconds = self.stall if which == "stall" else self.total
        cpu = self.stall_cpu if which == "stall" else self.total_cpu
        labels = {k: self.labels[k] for k in seconds}
        return SectionResult(
            which, self.nbytes, labels, dict(seconds), baseline, cpu_seconds=dict(cpu)
        )


def verify_async_copy(state: StateDict, root: str) -> None:
    """Warm-up check: a tensor mutated right after async_save returns is saved as it was."""
    name = next(iter(state))
    tensor = state[name]
    before = tensor.flatten()[:16].clone()
    out = os.path.join(root, "verify-async")
    handle = sp.async_save(state, out, max_shard_size=SHARD_SIZE, progress=False)
    tensor.flatten()[:16].add_(1.0)  # the training loop goes on
    handle.result()
    tensor.flatten()[:16].copy_(before)
    loaded = sp.load(out)
    if not torch.equal(loaded[name].flatten()[:16], before):
        raise RuntimeError("async_save stored a tensor mutated after the call returned")
    for key, value in state.items():
        if not torch.equal(loaded[key], value):
            raise RuntimeError(f"async_save stored {key} wrongly")
    del loaded
    remove(out)


def run_stall_section(state: StateDict, root: str, peers: list[Peer], rounds: int) -> StallResult:
    result = StallResult(tensor_bytes(state), {p.key: p.label for p in peers})
    for round_no in range(rounds + 1):
        warmup = round_no == 0
        parts = []
        for peer in peers:
            out = os.path.join(root, f"{peer.key}-{round_no}")
            remove(out)
            gc.collect()
            sync()
            cpu_before = process_cpu_seconds()
            started = time.perf_counter()
            finish = peer.start(state, out)
            stalled = time.perf_counter() - started
            stalled_cpu = process_cpu_seconds() - cpu_before
            if finish is not None:
                finish()
            total = time.perf_counter() - started
            total_cpu = process_cpu_seconds() - cpu_before
            if os.path.exists(out) and not os.listdir(out):
                raise RuntimeError(f"{peer.key} saved nothing at {out}")
            remove(out)
            if not warmup:
                if not peer.total_only:
                    result.stall.setdefault(peer.key, []).append(stalled)
                    result.stall_cpu.setdefault(peer.key, []).append(stalled_cpu)
                if not peer.stall_only:
                    result.total.setdefault(peer.key, []).append(total)
                    result.total_cpu.setdefault(peer.key, []).append(total_cpu)
            parts.append(f"{peer.key} {stalled:.2f}/{total:.2f}")
        tag = "warm-up" if warmup else f"round {round_no}/{rounds}"
        log_err(f"  [stall/total s] {tag}: " + "  ".join(parts))
    return result


# ----------------------------------------------------------------------------------- RSS


def anon_rss() -> int:
    """Anonymous resident memory (RssAnon): RSS without the mapped library files, which
    the kernel may evict and reload under memory pressure from other processes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return current_rss()


def run_rss_section(state: StateDict, root: str, saves: int) -> dict[str, object]:
    """``saves`` consecutive async saves to different directories, each waited; RSS after each."""
    gc.collect()
    before = current_rss()
    series = []
    previous: list[str] = []
    for i in range(saves):
        out = os.path.join(root, f"rss-{i:02d}")
        started = time.perf_counter()
        handle = sp.async_save(state, out, max_shard_size=SHARD_SIZE, progress=False)
        stalled = time.perf_counter() - started
        handle.result()
        total = time.perf_counter() - started
        rss = current_rss()
        anon = anon_rss()
        series.append({"rss": rss, "rss_anon": anon, "stall_s": stalled, "total_s": total})
        print(
            f"  save {i + 1:2d}/{saves}: RSS {rss / 1e9:7.3f} GB (anon {anon / 1e9:7.3f} GB)  "
            f"stall {stalled:6.3f} s  total {total:6.3f} s",
            flush=True,
        )
        previous.append(out)
        if len(previous) > 2:  # keep the disk use bounded, as keep_last=2 would
            remove(previous.pop(0))
    for out in previous:
        remove(out)
    first = series[0]["rss"]
    assert isinstance(first, int)
    deviations = [abs(int(s["rss"]) - first) for s in series]  # type: ignore[call-overload]
    worst = max(deviations)
    first_anon = int(series[0]["rss_anon"])  # type: ignore[call-overload]
    worst_anon = max(abs(int(s["rss_anon"]) - first_anon) for s in series)  # type: ignore[call-overload]
    return {
        "max_anon_deviation_bytes": worst_anon,
        "rss_before_first_save": before,
        "series": series,
        "first_post_save_rss": first,
        "max_deviation_bytes": worst,
        "max_deviation_fraction": worst / first,
        "staging_bytes": sp_async.staging_bytes(),
    }


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gb", type=float, default=None, help="state dict size in GB (default 2.15)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds after the warm-up (default 4)"
    )
    parser.add_argument(
        "--dir", default=None, help="where to create the scratch directory (default: /tmp)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 0.1 GB, 1 round (< 1 minute)"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write every measurement to this JSON file"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.gb is None:
        args.gb = 0.1 if args.quick else 2.15
    if args.rounds is None:
        args.rounds = 1 if args.quick else 4
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    shape = model_shape_for(args.gb * 1e9)
    root = tempfile.mkdtemp(prefix="shardpoint-bench-async-", dir=args.dir)
    dcp_stager = DefaultStager(StagingOptions(False, False, False, False))
    tc_async = TorchCheckpointingAsync()
    try:
        log_err("building the state dict ...")
        state = make_state_dict(shape.shapes(), args.seed)
        nbytes = tensor_bytes(state)
        print(
            "\n".join(
                [
                    f"shardpoint {sp.__version__}, torch {torch.__version__}, "
                    f"python {platform.python_version()}",
                    f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
                    f"state dict: fp32 Llama-like, vocab {shape.vocab}, hidden {shape.hidden}, "
                    f"intermediate {shape.intermediate}, {shape.layers} layers, "
                    f"{len(state)} tensors: {nbytes / 1e9:.3f} GB; shards {SHARD_SIZE}; all saves durable",
                    f"rounds: 1 warm-up (discarded) + {args.rounds} timed, interleaved; medians",
                    f"scratch: {root}",
                ]
            ),
            flush=True,
        )

        # (d) first, in a process whose only big allocation so far is the state: RSS before
        # the first save is the state alone, after it the state plus the staging buffer.
        print(
            f"\nHOST RSS across {RSS_SAVES} consecutive sp.async_save (each waited, new directory each)"
        )
        rss = run_rss_section(state, root, RSS_SAVES)

        log_err("checking that async_save keeps the state as it was when the call returned ...")
        verify_async_copy(state, root)

        peers = [
            Peer(
                "memcpy",
                "plain memcpy into reused buffers (stall limit)",
                PlainCopy(),
                stall_only=True,
            ),
            Peer(
                "plain",
                "plain os.write + fsync, 1 file (total limit)",
                plain_write,
                total_only=True,
            ),
            Peer("sp_async", "shardpoint async_save", sp_async_save),
            Peer("sp_sync", "shardpoint save (synchronous)", sp_sync_save),
            Peer("dcp", "DCP async_save, reused DefaultStager", dcp_async(dcp_stager)),
            Peer("dcp_default", "DCP async_save, default staging", dcp_async(None)),
        ]
        if have("torch_checkpointing"):
            peers.append(Peer("tc", "torch-checkpointing async saver (buffered, reused)", tc_async))
        stall = run_stall_section(state, root, peers, args.rounds)
        stall_sec = stall.section("stall", "memcpy")
        total_sec = stall.section("total", "plain")

        print()
        print(
            format_section(
                f"STALL: training loop blocked until the call returns, {nbytes / 1e9:.2f} GB, "
                f"median of {args.rounds} (vs plain = vs memcpy)",
                stall_sec,
            )
        )
        print()
        print(
            format_section(
                f"TOTAL: until the checkpoint is durable, {nbytes / 1e9:.2f} GB, "
                f"median of {args.rounds} (vs plain = vs os.write + fsync)",
                total_sec,
            )
        )
        print()
        first = rss["first_post_save_rss"]
        print(
            f"RSS: before the first save {rss['rss_before_first_save'] / 1e9:.3f} GB (state alone), "  # type: ignore[operator]
            f"after the first {first / 1e9:.3f} GB; max deviation from it over {RSS_SAVES} saves "  # type: ignore[operator]
            f"{rss['max_deviation_bytes'] / 1e6:.1f} MB = {rss['max_deviation_fraction'] * 100:.2f} % "  # type: ignore[operator]
            f"(anonymous memory: {rss['max_anon_deviation_bytes'] / 1e6:.1f} MB); "  # type: ignore[operator]
            f"staging_bytes {rss['staging_bytes'] / 1e9:.3f} GB (state {nbytes / 1e9:.3f} GB)"  # type: ignore[operator]
        )
        print()

        stall_vs_sync = stall_sec.median("sp_async") / total_sec.median("sp_sync")
        checks = [
            TargetCheck(
                "sp async stall / sp sync save (durable)", stall_vs_sync, "<=", STALL_TARGET
            ),
            TargetCheck(
                f"RSS max deviation over {RSS_SAVES} async saves",
                float(rss["max_deviation_fraction"]) * 100,  # type: ignore[arg-type]
                "<=",
                RSS_TARGET * 100,
                unit="%",
            ),
        ]
        print("TARGETS")
        for check in checks:
            print(check.line())
        info = [
            (
                "sp async stall / DCP async stall (reused stager)",
                stall_sec.ratio("sp_async", "dcp"),
            ),
            (
                "sp async stall / DCP async stall (default)",
                stall_sec.ratio("sp_async", "dcp_default"),
            ),
            ("sp async stall / memcpy of the same bytes", stall_sec.ratio("sp_async", "memcpy")),
            ("sp async total / sp sync save", total_sec.ratio("sp_async", "sp_sync")),
            (
                "sp async total / DCP async total (reused stager)",
                total_sec.ratio("sp_async", "dcp"),
            ),
            ("sp sync save / plain os.write + fsync", total_sec.ratio("sp_sync", "plain")),
        ]
        print("RATIOS (information)")
        for name, value in info:
            print(f"        {name:<52} {value:8.2f}x")
        failed = sum(not c.passed for c in checks)
        elapsed = time.perf_counter() - started
        print(f"\n{len(checks) - failed}/{len(checks)} targets met; run took {elapsed:.0f} s")

        if args.json:
            report = {
                "setup": {
                    "bytes": nbytes,
                    "shape": shape.__dict__,
                    "shard_size": SHARD_SIZE,
                    "rounds": args.rounds,
                    "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "versions": {"shardpoint": sp.__version__, "torch": torch.__version__},
                },
                "stall": stall_sec.to_json(),
                "total": total_sec.to_json(),
                "rss": rss,
                "targets": [c.to_json() for c in checks],
                "ratios": dict(info),
                "seconds": elapsed,
            }
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            log_err(f"wrote {args.json}")
        return 0
    finally:
        dcp_stager.close()
        tc_async.close()
        remove(root)


if __name__ == "__main__":
    sys.exit(main())
