"""A load allocates no more than the files it reads can hold, checked before the first allocation.

Each attack runs in a child process whose address space is capped at what it had after
importing torch plus the files' real sizes and a small constant (``RLIMIT_AS``): a load
that allocated beyond the files would fail there with the allocator's bare error. The
child reports its peak RSS (``getrusage``), which must stay within the same bound.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp

SRC = str(Path(__file__).resolve().parents[1] / "src")
SLACK = 384 << 20
"""Room above the files' sizes for the load's own working memory (threads, Python objects)."""

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch, shardpoint as sp
    cases, slack, cap = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "cap"
    held = sp.using(io=sp.IOOptions(read_threads=2))  # for this process's life
    held.__enter__()
    def vm():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cap:
        limit = vm() + max(files for _, files in cases) + slack
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    outcomes = []
    for path, files_bytes in cases:
        outcome = {}
        try:
            state = sp.load(path)  # LOAD
            outcome["result"] = {k: [list(v.shape), float(v.float().sum())] for k, v in state.items()}
            del state
        except sp.CheckpointError as exc:
            outcome["error"] = [type(exc).__name__, str(exc)[:600]]
        except BaseException as exc:
            outcome["bare"] = [type(exc).__name__, str(exc)[:600]]
        outcome["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
        outcomes.append(outcome)
    print(json.dumps(outcomes))
    """
)


def _load_in_child(cases: list[tuple[Path, int]], *, cap: bool = True, script: str = _CHILD) -> list[dict[str, Any]]:
    """Load each (path, bytes its files hold) in one child process, in order."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    arg = json.dumps([[str(p), n] for p, n in cases])
    done = subprocess.run([sys.executable, "-c", script, arg, str(SLACK), "cap" if cap else "nocap"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcomes


def _files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def _chunk_attack(tmp_path: Path, chunks: int) -> Path:
    """A real 4 MiB data file and a manifest giving one tensor ``chunks`` chunks of 4 MiB
    each, all but the first under keys the file's header does not hold."""
    path = tmp_path / "ckpt"
    sp.save({"w": torch.ones(1 << 20)}, path, layout="chunked", max_shard_size="8MiB")
    doc = json.loads((path / "shardpoint.json").read_bytes())
    record = doc["components"]["model"]["tensors"]["w"]
    (real,) = record["chunks"]
    record["shape"] = [chunks << 20]
    record["chunks"] = [
        {**real, "key": real.get("key", "w") if i == 0 else f"forged.{i}", "offsets": [i << 20], "shape": [1 << 20]}
        for i in range(chunks)
    ]
    doc["components"]["model"]["tree"] = {"type": "dict", "items": [["str", "w", {"type": "tensor", "name": "w"}]]}
    (path / "shardpoint.json").write_text(json.dumps(doc))
    return path


def _chunk_too_big(tmp_path: Path) -> Path:
    """Chunks that are real header entries but claim to cover far more than they hold."""
    path = tmp_path / "too-big"
    sp.save({"w": torch.ones(1 << 20)}, path, layout="chunked", max_shard_size="8MiB")
    doc = json.loads((path / "shardpoint.json").read_bytes())
    record = doc["components"]["model"]["tensors"]["w"]
    record["shape"] = [1 << 32]
    record["chunks"][0].update(key="w", offsets=[0], shape=[1 << 32])
    (path / "shardpoint.json").write_text(json.dumps(doc))
    return path


def _sparse_file(path: Path, nbytes: int) -> Path:
    """A safetensors file whose one U8 tensor of ``nbytes`` is a hole (no blocks on disk)."""
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "hole": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-(8 + len(header)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    return path


@pytest.mark.slow
def test_amplification_attacks_allocate_no_more_than_the_files_hold(tmp_path: Path) -> None:
    """One child process, its address space capped at the files' size plus a constant:
    4 000 chunks absent from their file (asked 15.6 GiB), 60 000 (234 GiB), a chunk shape
    far past its file, a sparse 1 TiB file (a few KiB on disk) and a sparse 64 MiB file.
    Each ends in a named CheckpointError or the right values; peak RSS stays bounded."""
    a4k = _chunk_attack(tmp_path / "a4k", 4_000)
    a60k = _chunk_attack(tmp_path / "a60k", 60_000)
    big = _chunk_too_big(tmp_path)
    tera = _sparse_file(tmp_path / "tera.safetensors", 1 << 40)
    assert tera.stat().st_blocks * 512 < 1 << 20
    fits = _sparse_file(tmp_path / "fits.safetensors", 64 << 20)
    cases = [(a4k, _files_bytes(a4k)), (a60k, _files_bytes(a60k)), (big, _files_bytes(big)),
             (tera, 1 << 20), (fits, fits.stat().st_size)]
    assert max(n for _, n in cases) <= 70 << 20
    o4k, o60k, obig, otera, ofits = _load_in_child(cases)
    for got in (o4k, o60k):
        assert got.get("error", [None])[0] == "CorruptCheckpointError", got
        assert ("tensor 'w' (key 'forged.1') is listed in the checkpoint's index/manifest but absent "
                "from this file; the checkpoint is damaged") in got["error"][1]
    assert obig.get("error", [None])[0] == "CorruptCheckpointError", obig
    assert "chunk of shape [4294967296] is larger than its file" in obig["error"][1]
    assert otera.get("error", [None])[0] == "InsufficientMemoryError", otera
    assert f"{tera}: loading it needs 1099511627776 bytes of memory for its tensors (its files occupy" in otera["error"][1]
    assert "nothing was allocated" in otera["error"][1]
    assert ofits.get("result") == {"hole": [[64 << 20], 0.0]}, ofits
    # Peak RSS: at most the largest files read plus the constant (the 64 MiB zeros).
    assert ofits["rss_growth"] < fits.stat().st_size + SLACK
    assert o60k["rss_growth"] < SLACK


@pytest.mark.slow
def test_the_bound_catches_an_over_allocating_load(tmp_path: Path) -> None:
    """The harness can fail: under the same cap, allocating 4x the files' size is refused,
    and a 1 TiB sparse file without the cap is refused by the RAM + swap check."""
    path = tmp_path / "ckpt"
    sp.save({"w": torch.ones(1 << 20)}, path)
    script = _CHILD.replace("state = sp.load(path)  # LOAD",
                            "state = {'big': torch.ones(4 * files_bytes + slack)}")
    (got,) = _load_in_child([(path, _files_bytes(path))], script=script)
    assert got.get("bare", [None])[0] == "RuntimeError", got
    tera = _sparse_file(tmp_path / "tera.safetensors", 1 << 40)
    (got,) = _load_in_child([(tera, 1 << 20)], cap=False)
    assert got.get("error", [None])[0] == "InsufficientMemoryError", got
    assert "of RAM + swap" in got["error"][1]
