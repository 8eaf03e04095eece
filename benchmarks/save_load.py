"""Save and load a transformer-shaped fp32 state dict: shardpoint against its peers and the limit.

One run, one state dict (default ~2.15 GB), four sections, each interleaved (A B C ...)
over one discarded warm-up round plus ``--rounds`` timed rounds (``--load-rounds`` for the
loads), ``sync`` before every timed call:

* save, page cache (no fsync) and durable (every file, directory and parent fsynced; peers
  that do not fsync themselves get it done after, inside their time);
* load into a preallocated state dict of the same shapes, warm (files in the page cache)
  and cold (caches dropped before every call);

then the peak RSS of each load, each in a fresh process, and the project's targets.

    .venv/bin/python benchmarks/save_load.py            # full size, ~2.15 GB
    .venv/bin/python benchmarks/save_load.py --quick    # 0.2 GB, 1 round: smoke run
    .venv/bin/python benchmarks/save_load.py --gb 4 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c
import psutil
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from _common import (
    Case,
    ReaderConfig,
    SectionResult,
    TargetCheck,
    accepts_direct,
    can_drop_caches,
    current_rss,
    drop_caches,
    files_under,
    format_section,
    freed_memory_held,
    fsync_tree,
    log_err,
    peak_rss,
    read_into_cache,
    read_with,
    remove,
    reset_peak_rss,
    run_interleaved,
    sweep_read_limit,
)
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open

import shardpoint as sp

# DCP warns that it runs without a process group; that is the single-process case measured.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*process group.*")

SHARD_SIZE = "500MB"
PLAIN_READ_THREADS = 2
PLAIN_PIECE_BYTES = 64 << 20
VOCAB = 32_000

Shapes = dict[str, tuple[int, ...]]
StateDict = dict[str, torch.Tensor]

# ----------------------------------------------------------------------------- the data


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


def make_model(shapes: Shapes) -> StateDict:
    """The preallocated target of every load: same shapes, every page touched."""
    return {name: torch.empty(shape).zero_() for name, shape in shapes.items()}


def tensor_bytes(state: StateDict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def fingerprints(state: StateDict) -> dict[str, int]:
    """crc32c of every tensor's bytes: lets the loads be checked after the source is freed."""
    return {name: crc32c.crc32c(byte_view(t)) for name, t in state.items()}



# ------------------------------------------------------------------------------- peers
#
# Optional peers (``pip install -e '.[bench]'``): each is skipped, with a printed line, when
# its package is missing.


def _optional(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        print(f"peer skipped: {module} is not installed ({exc}); pip install -e '.[bench]'", flush=True)
        return None


runai_streamer = _optional("runai_model_streamer")
tensorizer = _optional("tensorizer")
torch_checkpointing = _optional("torch_checkpointing")
try:
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
except ImportError:
    HuggingFaceStorageReader = HuggingFaceStorageWriter = None
    print("peer skipped: this torch has no DCP HuggingFaceStorageReader/Writer", flush=True)


class _TorchCheckpointingItem:
    """torch-checkpointing's view of a state dict: one item, saved and loaded in place."""

    def __init__(self, state: StateDict) -> None:
        self.state = state

    def get_items(self) -> dict[str, Any]:
        return {"model": torch_checkpointing.CheckpointItem(value=self.state, requires_copy=False)}

    def load_state_dict(self, state_dict: Any) -> None:
        del state_dict  # the loader already copied into self.state, in place


if torch_checkpointing is not None:
    _TorchCheckpointingItem = type(  # type: ignore[misc]
        "_TorchCheckpointingItem", (_TorchCheckpointingItem, torch_checkpointing.CheckpointBase), {}
    )


def _torch_checkpointing_parts() -> tuple[Any, Any]:
    """(rank info of one process, local storage with buffered I/O: the default O_DIRECT
    path fails on ext4 here)."""
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    rank = torch_checkpointing.RankInfo(global_rank=0, global_world_size=1, role_rank=0, role_world_size=1)
    return rank, LocalFileSystemStorageConfig(use_direct_io=False)


# -------------------------------------------------------------------------------- saves
#
# Each saver writes the state dict to ``out`` (which does not exist yet). With
# ``durable`` the result must be on disk when it returns.


def save_plain(state: StateDict, out: str, durable: bool) -> None:
    """The limit: every tensor's bytes, in order, with sequential os.write into one file."""
    os.mkdir(out)
    fd = os.open(os.path.join(out, "plain.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in state.values():
            view = byte_view(tensor)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    if durable:
        fsync_tree(out)


def save_shardpoint(state: StateDict, out: str, durable: bool) -> None:
    sp.save(state, out, max_shard_size=SHARD_SIZE, durable=durable, progress=False)


def save_hub(state: StateDict, out: str, durable: bool) -> None:
    os.mkdir(out)
    save_torch_state_dict(state, out, max_shard_size=SHARD_SIZE)
    if durable:
        fsync_tree(out)


def save_safetensors_file(state: StateDict, out: str, durable: bool) -> None:
    os.mkdir(out)
    safetensors.torch.save_file(state, os.path.join(out, "model.safetensors"))
    if durable:
        fsync_tree(out)


def save_torch(state: StateDict, out: str, durable: bool) -> None:
    os.mkdir(out)
    torch.save(state, os.path.join(out, "model.pt"))
    if durable:
        fsync_tree(out)


def save_dcp(state: StateDict, out: str, durable: bool) -> None:
    # DCP fsyncs its data files itself when sync_files=True; fsync_tree adds the metadata
    # file and the directories, as for every other peer.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out, sync_files=durable))
    if durable:
        fsync_tree(out)


def save_dcp_hf(state: StateDict, out: str, durable: bool) -> None:
    # HuggingFaceStorageWriter does not fsync: fsync_tree adds it, as for every other peer.
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(out))
    if durable:
        fsync_tree(out)


def save_torch_checkpointing(state: StateDict, out: str, durable: bool) -> None:
    rank, storage = _torch_checkpointing_parts()
    config = torch_checkpointing.SyncCheckpointSaverConfig(
        writer_config=torch_checkpointing.CheckpointWriterConfig(barrier_config=None, write_to_temp_dir=False)
    )
    saver = torch_checkpointing.make_sync_checkpoint_saver(config=config, rank_info=rank, storage_config=storage)
    saver.save(out, _TorchCheckpointingItem(state))
    if durable:
        fsync_tree(out)


def save_tensorizer(state: StateDict, out: str, durable: bool) -> None:
    os.mkdir(out)
    serializer = tensorizer.TensorSerializer(os.path.join(out, "model.tensors"))
    serializer.write_state_dict(state)
    serializer.close()
    if durable:
        fsync_tree(out)


Saver = Callable[[StateDict, str, bool], None]

SAVERS: dict[str, tuple[str, Saver]] = {
    "plain": ("plain os.write (limit, 1 stream)", save_plain),
    "sp": (f"shardpoint save ({SHARD_SIZE} shards)", save_shardpoint),
    "hub": (f"hf_hub save_torch_state_dict ({SHARD_SIZE})", save_hub),
    "st_file": ("safetensors save_file (one file)", save_safetensors_file),
    "torch": ("torch.save", save_torch),
    "dcp": ("DCP save (1 process)", save_dcp),
}
if HuggingFaceStorageWriter is not None:
    SAVERS["dcp_hf"] = ("DCP save, HuggingFaceStorageWriter", save_dcp_hf)
if torch_checkpointing is not None:
    SAVERS["tc"] = ("torch-checkpointing save (buffered)", save_torch_checkpointing)
if tensorizer is not None:
    SAVERS["tensorizer"] = ("tensorizer TensorSerializer", save_tensorizer)

# -------------------------------------------------------------------------------- loads
#
# Each loader fills ``model`` (preallocated, same shapes) in place from the files that the
# matching saver wrote at ``src``.


def load_plain(model: StateDict, src: str) -> None:
    """The limit: preadv of plain.bin straight into the tensors' memory, 2 threads."""
    pieces = []
    offset = 0
    for tensor in model.values():
        view = byte_view(tensor)
        for start in range(0, len(view), PLAIN_PIECE_BYTES):
            part = view[start : start + PLAIN_PIECE_BYTES]
            pieces.append((part, offset + start))
        offset += len(view)
    fd = os.open(os.path.join(src, "plain.bin"), os.O_RDONLY)

    def read(piece: tuple[memoryview, int]) -> None:
        view, pos = piece
        while view:
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise EOFError(f"plain.bin ends before byte {pos}")
            view, pos = view[n:], pos + n

    try:
        with ThreadPoolExecutor(PLAIN_READ_THREADS) as pool:
            list(pool.map(read, pieces))
    finally:
        os.close(fd)


def load_limit(config: ReaderConfig) -> Loader:
    """The device's limit: plain.bin read by the fastest plain reader of the sweep
    (:func:`sweep_read_limit`), no tensor work, no copy into ``model``. Cold loads only."""

    def load(model: StateDict, src: str) -> None:
        del model
        read_with(config, os.path.join(src, "plain.bin"))

    return load


def load_shardpoint(model: StateDict, src: str) -> None:
    sp.load_into(model, src, verify=True, progress=False)


def load_shardpoint_noverify(model: StateDict, src: str) -> None:
    sp.load_into(model, src, verify=False, progress=False)


def _copy_safetensors(model: StateDict, path: str) -> None:
    with safe_open(path, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            model[key].copy_(f.get_tensor(key))


def load_safe_open_shards(model: StateDict, src: str) -> None:
    for path in files_under(src):
        if path.endswith(".safetensors"):
            _copy_safetensors(model, path)


def load_safe_open_file(model: StateDict, src: str) -> None:
    _copy_safetensors(model, os.path.join(src, "model.safetensors"))


def load_torch_mmap(model: StateDict, src: str) -> None:
    loaded = torch.load(os.path.join(src, "model.pt"), weights_only=True, mmap=True)
    for key, tensor in loaded.items():
        model[key].copy_(tensor)


def load_dcp(model: StateDict, src: str) -> None:
    dcp.load(model, storage_reader=dcp.FileSystemReader(src))


def load_dcp_hf(model: StateDict, src: str) -> None:
    dcp.load(model, storage_reader=HuggingFaceStorageReader(src))


def load_torch_checkpointing(model: StateDict, src: str) -> None:
    rank, storage = _torch_checkpointing_parts()
    reader = torch_checkpointing.CheckpointReader(rank, storage)
    torch_checkpointing.CheckpointLoader(reader).load(src, _TorchCheckpointingItem(model))


def load_runai(model: StateDict, src: str) -> None:
    """runai-model-streamer's SafetensorsStreamer over the hub shards (its defaults)."""
    paths = [p for p in files_under(src) if p.endswith(".safetensors")]
    with runai_streamer.SafetensorsStreamer() as streamer:
        streamer.stream_files(paths)
        for name, tensor in streamer.get_tensors():
            model[name].copy_(tensor)


def load_tensorizer(model: StateDict, src: str) -> None:
    """tensorizer's TensorDeserializer (its defaults), each tensor copied into ``model``.
    Timed in a process of its own per call (:class:`ChildLoad`): it keeps the state's size
    of memory after a load."""
    with tensorizer.TensorDeserializer(os.path.join(src, "model.tensors"), device="cpu") as tensors:
        for name, tensor in tensors.items():
            model[name].copy_(tensor)


Loader = Callable[[StateDict, str], None]

LOADERS: dict[str, tuple[str, str, Loader]] = {
    # key: (label, which save it reads, loader)
    "plain": ("plain preadv (limit, 2 threads)", "plain", load_plain),
    "sp": ("shardpoint load_into, crc32c", "sp", load_shardpoint),
    "sp_noverify": ("shardpoint load_into, verify=False", "sp", load_shardpoint_noverify),
    "st_shards": ("safe_open + copy_, HF shards", "hub", load_safe_open_shards),
    "st_file": ("safe_open + copy_, one file", "st_file", load_safe_open_file),
    "torch": ("torch.load(mmap=True) + copy_", "torch", load_torch_mmap),
    "dcp": ("DCP load (in place)", "dcp", load_dcp),
}
if HuggingFaceStorageReader is not None:
    LOADERS["dcp_hf"] = ("DCP load, HuggingFaceStorageReader", "dcp_hf", load_dcp_hf)
if torch_checkpointing is not None:
    LOADERS["tc"] = ("torch-checkpointing load (buffered)", "tc", load_torch_checkpointing)
if runai_streamer is not None:
    LOADERS["runai"] = ("runai-model-streamer SafetensorsStreamer, HF shards", "hub", load_runai)
if tensorizer is not None:
    LOADERS["tensorizer"] = ("tensorizer TensorDeserializer (own process)", "tensorizer", load_tensorizer)

IN_OWN_PROCESS = {"tensorizer"}
"""Loaders timed in a fresh process per call (started untimed, then told to go)."""


def _child_load(loader_key: str, src: str, shapes: Shapes, conn: Any) -> None:
    """A fresh process: allocate the model, say ready, load when told, answer checks."""
    model = make_model(shapes)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "load":
            try:
                LOADERS[loader_key][2](model, src)
                conn.send("done")
            except BaseException as exc:
                conn.send(f"error: {type(exc).__name__}: {exc}")
                raise
        elif command == "fingerprints":
            conn.send(fingerprints(model))
        else:
            return


class ChildLoad:
    """One loader in a process of its own per call: :meth:`start` (untimed) spawns it and
    waits until its model is allocated; :meth:`load` is the timed call."""

    def __init__(self, key: str, src: str, shapes: Shapes) -> None:
        self.key, self.src, self.shapes = key, src, shapes
        self.proc: Any = None
        self.conn: Any = None

    def start(self) -> None:
        self.stop()
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_load, args=(self.key, self.src, self.shapes, child))
        self.proc.start()
        child.close()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{self.key}: the loading process did not start")

    def load(self) -> None:
        self.conn.send("load")
        answer = self.conn.recv()
        if answer != "done":
            raise RuntimeError(f"load {self.key} failed in its process: {answer}")

    def fingerprints(self) -> dict[str, int]:
        self.conn.send("fingerprints")
        return self.conn.recv()  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc is not None:
            self.conn.send("exit")
            self.proc.join()
            self.proc = None

# ------------------------------------------------------------------------------ sections


def save_section(
    state: StateDict, root: str, durable: bool, rounds: int, outputs: dict[str, str]
) -> SectionResult:
    """Interleaved saves; each call writes a fresh path, the previous one is removed first.

    ``outputs`` receives the last path each peer wrote (the loads read those).
    """
    mode = "durable" if durable else "pagecache"
    cases = []
    for key, (label, saver) in SAVERS.items():
        counter = iter(range(1_000_000))

        def prepare(key: str = key, counter: Any = counter) -> None:
            if key in outputs:
                remove(outputs[key])
            outputs[key] = os.path.join(root, f"{key}-{mode}-{next(counter)}")

        def run(key: str = key, saver: Saver = saver) -> None:
            saver(state, outputs[key], durable)

        def check(key: str = key) -> None:
            if not files_under(outputs[key]):
                raise RuntimeError(f"{key} saved nothing at {outputs[key]}")

        cases.append(Case(key, label, run, prepare, check))
    return run_interleaved(f"save {mode}", cases, rounds=rounds, nbytes=tensor_bytes(state))


def load_section(
    expected: dict[str, int], model: StateDict, outputs: dict[str, str], cold: bool, rounds: int
) -> SectionResult:
    """Interleaved loads into ``model``; the warm-up round of a warm section checks the bytes."""
    cases = []
    loaders = dict(LOADERS)
    if cold:
        # The limit row: the fastest plain reader of plain.bin, swept once per run on a part
        # of it (O_DIRECT where the file system takes it, see accepts_direct).
        plain_bin = os.path.join(outputs["plain"], "plain.bin")
        finalists, _ = sweep_read_limit(plain_bin, direct=accepts_direct(outputs["plain"]), log=log_err)
        readers = {
            key: (f"plain reader: {config.label()} (limit)", "plain", load_limit(config))
            for key, config in zip(LIMIT_KEYS, finalists, strict=False)  # fewer where fewer readers ran
        }
        loaders = {**readers, **loaders}
    shapes = {name: tuple(t.shape) for name, t in model.items()}
    children: list[ChildLoad] = []
    for key, (label, source, loader) in loaders.items():
        src = outputs[source]
        paths = files_under(src)
        child = ChildLoad(key, src, shapes) if key in IN_OWN_PROCESS else None

        def run(loader: Loader = loader, src: str = src, child: ChildLoad | None = child) -> None:
            if child is not None:
                child.load()
            else:
                loader(model, src)

        def fresh(child: ChildLoad | None = child) -> None:
            """A loader timed in its own process gets a new one (untimed) before each call."""
            if child is not None:
                child.start()

        def result(child: ChildLoad | None = child) -> dict[str, int]:
            return child.fingerprints() if child is not None else fingerprints(model)

        if cold:

            def prepare(paths: list[str] = paths, fresh: Callable[[], None] = fresh) -> None:
                fresh()
                drop_caches(paths)

            def check() -> None:
                return None
        else:

            def prepare(paths: list[str] = paths, fresh: Callable[[], None] = fresh) -> None:
                fresh()
                for tensor in model.values():
                    tensor.zero_()  # so that the check sees what this peer wrote
                read_into_cache(paths)

            def check(key: str = key, result: Callable[[], dict[str, int]] = result) -> None:
                bad = [k for k, crc in result().items() if crc != expected[k]]
                if bad:
                    raise RuntimeError(f"load {key} left {len(bad)} tensors wrong, e.g. {bad[0]}")

        if child is not None:
            children.append(child)
        cases.append(Case(key, label, run, prepare, check))
    name = "load cold" if cold else "load warm"
    try:
        result = run_interleaved(name, cases, rounds=rounds, nbytes=tensor_bytes(model))
        if cold:  # "vs limit": against the fastest plain reader over the whole file
            result.baseline = fastest_plain_reader(result)
        return result
    finally:
        for child in children:
            child.stop()


# --------------------------------------------------------------------------- peak memory


def _rss_child(loader_key: str, src: str, shapes: Shapes, conn: Any) -> None:
    """In a fresh process: allocate the model, then measure the peak RSS of one load."""
    try:
        base = current_rss()
        model = make_model(shapes)
        before = current_rss()
        reset = reset_peak_rss()
        LOADERS[loader_key][2](model, src)
        peak = peak_rss()
        conn.send({"base": base, "before": before, "peak": peak, "reset": reset})
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        conn.close()


def measure_rss(
    outputs: dict[str, str], shapes: Shapes, model_bytes: int, keys: list[str]
) -> dict[str, dict[str, Any]]:
    """Peak RSS of each load, each in its own spawned process (files warm in the page cache).

    ``over_model`` is the peak during the load minus the RSS just before it, which already
    holds the interpreter, the libraries and the touched model: what the load itself added.
    """
    ctx = multiprocessing.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    for key in keys:
        label, source, _loader = LOADERS[key]
        src = outputs[source]
        read_into_cache(files_under(src))
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rss_child, args=(key, src, shapes, child))
        proc.start()
        child.close()
        got = parent.recv()
        proc.join()
        if "error" in got:
            raise RuntimeError(f"RSS measurement of {key} failed: {got['error']}")
        got["label"] = label
        got["model_bytes"] = model_bytes
        got["over_model"] = got["peak"] - got["before"]
        results[key] = got
    return results


def format_rss(rss: dict[str, dict[str, Any]]) -> str:
    width = max(len(r["label"]) for r in rss.values())
    head = (
        f"{'':{width}}  {'peak MB':>8} {'peak-model':>10} {'interp MB':>9} {'before MB':>9} "
        f"{'over model MB':>13}"
    )
    lines = [
        "PEAK RSS OF ONE LOAD (a fresh process each, files in the page cache)",
        "  interp = interpreter + libraries; before = interp + the touched model, just before the",
        "  load; over model = peak - before: what the load itself added on top of the model",
        head,
        "-" * len(head),
    ]
    for r in rss.values():
        lines.append(
            f"{r['label']:{width}}  {r['peak'] / 1e6:8.0f} {(r['peak'] - r['model_bytes']) / 1e6:10.0f} "
            f"{r['base'] / 1e6:9.0f} {r['before'] / 1e6:9.0f} {r['over_model'] / 1e6:13.0f}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------- targets


def evaluate_targets(
    sections: dict[str, SectionResult], rss: dict[str, dict[str, Any]] | None
) -> list[TargetCheck]:
    """The targets of the sections that ran."""
    checks = []
    if "save_pagecache" in sections:
        spc = sections["save_pagecache"]
        checks += [
            TargetCheck("save page cache: hub / sp", spc.ratio("hub", "sp"), ">=", 1.5),
            TargetCheck("save page cache: torch.save / sp", spc.ratio("torch", "sp"), ">=", 2.0),
            TargetCheck("save page cache: dcp / sp", spc.ratio("dcp", "sp"), ">=", 2.0),
        ]
    if "save_durable" in sections:
        sdur = sections["save_durable"]
        checks.append(TargetCheck("save durable: hub / sp", sdur.ratio("hub", "sp"), ">=", 1.3))
    if "load_cold" in sections:
        cold = sections["load_cold"]
        # The disk sets the pace of a cold load: the fastest plain reader is what a load at
        # the disk's speed would take in this run.
        limit = cold.median(fastest_plain_reader(cold))
        checks.append(
            TargetCheck(
                "load cold: safe_open shards / sp (crc)",
                cold.ratio("st_shards", "sp"),
                ">=",
                1.3,
                bound=cold.median("st_shards") / limit,
            )
        )
        peers = [key for key in cold.seconds if key not in {"sp", "sp_noverify", "plain", *LIMIT_KEYS}]
        if peers:
            fastest = min(peers, key=cold.median)
            checks.append(
                TargetCheck(
                    f"load cold: sp (crc) / fastest peer ({fastest})", cold.ratio("sp", fastest), "<=", 1.0
                )
            )
        checks.append(TargetCheck("load cold: sp (crc) / fastest plain reader", cold.median("sp") / limit, "<=", 1.05))
    if "load_warm" in sections:
        warm = sections["load_warm"]
        checks += [
            TargetCheck(
                "load warm: sp (crc) / safe_open shards", warm.ratio("sp", "st_shards"), "<=", 1.15
            ),
            TargetCheck(
                "load warm: sp verify=False / safe_open shards",
                warm.ratio("sp_noverify", "st_shards"),
                "<=",
                1.0,
            ),
            TargetCheck("load warm: dcp / sp (crc)", warm.ratio("dcp", "sp"), ">=", 2.5),
        ]
    if rss is not None:
        for key in ("sp", "sp_noverify"):
            checks.append(
                TargetCheck(
                    f"load RSS over model: {LOADERS[key][0]}",
                    rss[key]["over_model"] / 1e6,
                    "<=",
                    300,
                    " MB",
                )
            )
    return checks


LIMIT_KEYS = ("limit", "limit2", "limit3")
"""The cold section's rows for the read-limit sweep's three finalists."""


def fastest_plain_reader(cold: SectionResult) -> str:
    """The cold section's limit row: the plain reader (``plain``, the sweep's finalists),
    each timed over the whole file in the interleaved rounds, with the fastest median."""
    return min((key for key in ("plain", *LIMIT_KEYS) if key in cold.seconds), key=cold.median)


def informational_ratios(sections: dict[str, SectionResult]) -> list[str]:
    """Ratios with no target that still tell where shardpoint stands (of the sections that ran)."""
    wanted = [
        ("save_pagecache", "save page cache: safetensors one file / sp", "st_file", "sp"),
        ("save_durable", "save durable: torch.save / sp", "torch", "sp"),
        ("save_durable", "save durable: dcp / sp", "dcp", "sp"),
        ("save_durable", "save durable: safetensors one file / sp", "st_file", "sp"),
        ("load_cold", "load cold: safe_open one file / sp (crc)", "st_file", "sp"),
        ("load_cold", "load cold: torch.load mmap / sp (crc)", "torch", "sp"),
        ("load_cold", "load cold: dcp / sp (crc)", "dcp", "sp"),
        ("load_cold", "load cold: sp verify=False / sp (crc)", "sp_noverify", "sp"),
        ("load_warm", "load warm: sp (crc) / plain", "sp", "plain"),
        ("load_cold", "load cold: sp (crc) / plain readinto", "sp", "plain"),
    ]
    return [
        f"  info  {name:<52} {sections[key].ratio(a, b):8.2f}x"
        for key, name, a, b in wanted
        if key in sections and {a, b} <= sections[key].seconds.keys()
    ]


# ---------------------------------------------------------------------------------- main

SECTIONS = ("save_pagecache", "save_durable", "load_warm", "load_cold")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gb", type=float, default=None, help="state dict size in GB (10^9; default 2.15)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds after the warm-up (default 3)"
    )
    parser.add_argument(
        "--load-rounds",
        type=int,
        default=None,
        help="timed rounds of the load sections (default 9: a load takes 0.2-2 s, and these "
        "VMs' memory and disk speed swing between calls, so medians need more samples)",
    )
    parser.add_argument(
        "--dir", default=None, help="where to create the scratch directory (default: /tmp)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 0.2 GB, 1 round, RSS of 3 loads (< 1 minute)",
    )
    parser.add_argument(
        "--no-rss", action="store_true", help="skip the per-process peak RSS measurements"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write every measurement to this JSON file"
    )
    parser.add_argument("--keep", action="store_true", help="leave the scratch directory in place")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vm-memory-as-is",
        action="store_true",
        help="leave this VM's free page reporting as it is (by default freed memory is held "
        "in the guest during the run; see freed_memory_held in _common.py)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated subset of " + ", ".join(SECTIONS) + " (default: all); without the "
        "save sections each peer's files are written once, untimed, for the loads",
    )
    args = parser.parse_args(argv)
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown or not args.sections:
        parser.error(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}")
    if args.gb is None:
        args.gb = 0.2 if args.quick else 2.15
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.load_rounds is None:
        args.load_rounds = 1 if args.quick else 9
    if args.rounds < 1 or args.load_rounds < 1:
        parser.error("--rounds and --load-rounds must be at least 1")
    return args


def format_loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class CpuShare:
    """How much CPU everything else on the machine used while the benchmark ran."""

    def __init__(self) -> None:
        self.machine = self._machine_busy()
        self.own = self._own()
        self.wall = time.perf_counter()

    @staticmethod
    def _machine_busy() -> float:
        t = psutil.cpu_times()
        return float(t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0))

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def report(self) -> tuple[str, float]:
        """A line for the output, and the others' share of the machine (0..1)."""
        wall = time.perf_counter() - self.wall
        others = max(0.0, (self._machine_busy() - self.machine) - (self._own() - self.own))
        share = others / (wall * (os.cpu_count() or 1))
        line = (
            f"other processes (incl. kernel writeback) used {others:.0f} CPU-s of "
            f"{wall * (os.cpu_count() or 1):.0f} during the run ({share:.0%}); "
            f"load average now {format_loadavg()}"
        )
        if share > 0.15:
            line += "\nWARNING: the machine was busy with other work; expect noisy ratios, rerun when quiet"
        return line, share


def describe_setup(
    args: argparse.Namespace, shape: ModelShape, nbytes: int, root: str, memory: str
) -> str:
    sp_env = {k: v for k, v in os.environ.items() if k.startswith("SHARDPOINT_")}
    return "\n".join(
        [
            f"shardpoint {sp.__version__}, torch {torch.__version__}, safetensors "
            f"{safetensors.__version__}, python {platform.python_version()}",
            f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
            f"drop_caches {'yes' if can_drop_caches() else 'no (fadvise fallback)'}, "
            f"load average {format_loadavg()}",
            memory,
            f"state dict: fp32 Llama-like, vocab {shape.vocab}, hidden {shape.hidden}, "
            f"intermediate {shape.intermediate}, {shape.layers} layers: {nbytes / 1e9:.3f} GB",
            f"rounds: 1 warm-up (discarded) + {args.rounds} timed saves / {args.load_rounds} "
            "timed loads, interleaved; medians",
            f"sections: {', '.join(args.sections)}; shardpoint from {os.path.dirname(sp.__file__)}",
            f"scratch: {root}" + (f"; env {sp_env}" if sp_env else ""),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with freed_memory_held(not args.vm_memory_as_is) as memory:
        return run(args, memory)


def run(args: argparse.Namespace, memory: str) -> int:
    started = time.perf_counter()
    cpu_share = CpuShare()
    shape = model_shape_for(args.gb * 1e9)
    shapes = shape.shapes()
    root = tempfile.mkdtemp(prefix="shardpoint-bench-", dir=args.dir)
    try:
        log_err("building the state dict ...")
        state = make_state_dict(shapes, args.seed)
        nbytes = tensor_bytes(state)
        print(describe_setup(args, shape, nbytes, root, memory), flush=True)

        outputs: dict[str, str] = {}
        sections: dict[str, SectionResult] = {}
        for durable in (False, True):
            key = "save_durable" if durable else "save_pagecache"
            if key in args.sections:
                sections[key] = save_section(state, root, durable, args.rounds, outputs)
        if not outputs:  # the loads still need every peer's files: written once, untimed
            log_err("writing each peer's files once for the loads ...")
            for key, (_label, saver) in SAVERS.items():
                outputs[key] = os.path.join(root, f"{key}-input")
                saver(state, outputs[key], True)
        expected = fingerprints(state)
        del state  # one state dict in memory at a time: keep reclaim out of the timings
        model = make_model(shapes)
        for cold in (False, True):
            key = "load_cold" if cold else "load_warm"
            if key in args.sections:
                sections[key] = load_section(
                    expected, model, outputs, cold=cold, rounds=args.load_rounds
                )
        rss = None
        if not args.no_rss and any(k.startswith("load") for k in args.sections):
            del model  # the children allocate their own
            # A quick run measures only what the targets need; each child costs seconds.
            keys = ["sp", "sp_noverify", "st_shards"] if args.quick else list(LOADERS)
            rss = measure_rss(outputs, shapes, nbytes, keys)

        titles = {
            "save_pagecache": "SAVE, page cache (no fsync)",
            "save_durable": "SAVE, durable (fsync of every file, directory and parent)",
            "load_warm": "LOAD into preallocated tensors, warm (files in page cache)",
            "load_cold": "LOAD into preallocated tensors, cold (caches dropped before each call)",
        }
        print()
        for key, result in sections.items():
            rounds = args.rounds if key.startswith("save") else args.load_rounds
            print(format_section(f"{titles[key]}, {nbytes / 1e9:.2f} GB, median of {rounds}", result))
            print()
        if rss is not None:
            print(format_rss(rss))
            print()
        checks = evaluate_targets(sections, rss)
        print("TARGETS")
        for check in checks:
            print(check.line())
        if any(c.bound is not None for c in checks):
            print(
                "  (at the limit: the ratio a load reading at the disk's speed measured in this run,\n"
                "   the fastest plain reader over the whole file (plain preadv, the sweep's three finalists), would have\n"
                "   scored against the same peer)"
            )
        print("\n".join(informational_ratios(sections)))
        failed = sum(not c.passed for c in checks)
        elapsed = time.perf_counter() - started
        print(f"\n{len(checks) - failed}/{len(checks)} targets met; run took {elapsed:.0f} s")
        cpu_line, others_share = cpu_share.report()
        print(cpu_line)

        if args.json:
            report = {
                "setup": {
                    "bytes": nbytes,
                    "shape": shape.__dict__,
                    "rounds": args.rounds,
                    "load_rounds": args.load_rounds,
                    "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "versions": {
                        "shardpoint": sp.__version__,
                        "torch": torch.__version__,
                        "safetensors": safetensors.__version__,
                    },
                },
                "sections": {k: r.to_json() for k, r in sections.items()},
                "rss": rss,
                "targets": [c.to_json() for c in checks],
                "seconds": elapsed,
                "other_processes_cpu_share": others_share,
            }
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            log_err(f"wrote {args.json}")
    finally:
        if args.keep:
            log_err(f"kept {root}")
        else:
            remove(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
