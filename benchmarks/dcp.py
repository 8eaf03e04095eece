"""``dcp.save`` / ``dcp.load`` with DCP's ``FileSystemWriter`` / ``FileSystemReader`` vs
``ShardpointStorageWriter`` / ``ShardpointStorageReader``, the same state, in one run.

    python benchmarks/dcp.py --mb 256 --tensors 64 --rounds 5

One process (``no_dist``). Each round
saves the same random float32 state both ways into fresh directories (page cache, both
fsync their files), then loads both into preallocated tensors; the two are interleaved,
one warm-up round is thrown away, and medians are printed with GB/s. Every load is checked
equal to the saved values.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch.distributed.checkpoint as dcp

from shardpoint.integrations.dcp import ShardpointStorageReader, ShardpointStorageWriter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MB (default 256)")
    parser.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    per = args.mb * (1 << 20) // 4 // args.tensors
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(args.tensors)}}
    nbytes = sum(t.nbytes for t in state["model"].values())
    writers = {
        "dcp FileSystemWriter": lambda p: dcp.FileSystemWriter(p),
        "ShardpointStorageWriter": lambda p: ShardpointStorageWriter(p),
    }
    readers = {
        "dcp FileSystemReader": lambda p: dcp.FileSystemReader(p),
        "ShardpointStorageReader": lambda p: ShardpointStorageReader(p),
    }
    saves: dict[str, list[float]] = {name: [] for name in writers}
    loads: dict[str, list[float]] = {name: [] for name in readers}
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for round_ in range(args.rounds + 1):
            paths = {}
            for (wname, make_writer), rname in zip(writers.items(), readers, strict=True):
                path = paths[rname] = os.path.join(root, f"{round_}-{len(paths)}")
                os.sync()
                start = time.perf_counter()
                dcp.save(state, storage_writer=make_writer(path), no_dist=True)
                if round_:  # round 0 is the warm-up
                    saves[wname].append(time.perf_counter() - start)
            for rname, make_reader in readers.items():
                for t in target["model"].values():
                    t.zero_()
                start = time.perf_counter()
                dcp.load(target, storage_reader=make_reader(paths[rname]), no_dist=True)
                elapsed = time.perf_counter() - start
                for k, v in state["model"].items():
                    assert torch.equal(target["model"][k], v), (rname, k)
                if round_:
                    loads[rname].append(elapsed)
            for path in paths.values():
                shutil.rmtree(path)
    print(f"{nbytes / 1e6:.0f} MB in {args.tensors} tensors, {args.rounds} rounds, one process")
    for title, table in (("dcp.save", saves), ("dcp.load (warm cache)", loads)):
        print(title)
        for name, values in table.items():
            med = statistics.median(values)
            print(f"  {name:26s} median {med:.3f} s  {nbytes / med / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
