"""Many small tensors: shardpoint's per-tensor cost against ``safetensors`` on the same state.

One run, one state (default 100 000 fp32 tensors of shape (4,), 1.6 MB of data), two
interleaved sections over one discarded warm-up round plus ``--rounds`` timed rounds,
``sync`` before every call, files in the page cache (warm), medians:

* save: ``sp.save`` against ``safetensors.torch.save_file`` (one file each);
* load: ``sp.load`` and ``sp.load_into`` (into an existing state dict, in place) against
  ``safetensors.torch.load_file``;

then the peak extra RSS of each call, each in a fresh spawned process, the manifest's size
against the data's, and the ratios (target: shardpoint no slower than safetensors).

    .venv/bin/python benchmarks/small_tensors.py               # 10^5 tensors, 5 rounds (~1 min)
    .venv/bin/python benchmarks/small_tensors.py --quick       # 10^4 tensors, 1 round: smoke run
    .venv/bin/python benchmarks/small_tensors.py --count 200000 --numel 16 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import safetensors
import safetensors.torch
import torch
from _common import (
    Case,
    SectionResult,
    TargetCheck,
    current_rss,
    files_under,
    format_section,
    freed_memory_held,
    log_err,
    peak_rss,
    read_into_cache,
    remove,
    reset_peak_rss,
    run_interleaved,
)

import shardpoint as sp

StateDict = dict[str, torch.Tensor]


def make_state(count: int, numel: int, seed: int) -> StateDict:
    """``count`` fp32 tensors of ``numel`` values, named like a deep module's parameters."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(count, numel, generator=gen)
    # Each its own storage, as a model's parameters are (no views of one big buffer).
    return {f"blocks.{i // 100}.layer.{i % 100}.weight": values[i].clone() for i in range(count)}


def tensor_bytes(state: StateDict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def same_values(state: StateDict, other: StateDict) -> bool:
    return sorted(state) == sorted(other) and all(torch.equal(state[k], other[k]) for k in state)


# ------------------------------------------------------------------------------ the peers

SAVE_FILE = "state.safetensors"


def save_sp(state: StateDict, out: str) -> None:
    sp.save(state, out)


def save_st(state: StateDict, out: str) -> None:
    os.makedirs(out)
    safetensors.torch.save_file(state, os.path.join(out, SAVE_FILE), metadata={"format": "pt"})


SAVERS: dict[str, tuple[str, Callable[[StateDict, str], None]]] = {
    "st": ("safetensors save_file", save_st),
    "sp": ("sp.save", save_sp),
}


def load_st(src: str, target: StateDict) -> Any:
    return safetensors.torch.load_file(os.path.join(src, SAVE_FILE))


def load_sp(src: str, target: StateDict) -> Any:
    return sp.load(src)


def load_into_sp(src: str, target: StateDict) -> Any:
    return sp.load_into(target, src)


LOADERS: dict[str, tuple[str, str, Callable[[str, StateDict], Any]]] = {
    # key: (label, whose files, loader)
    "st": ("safetensors load_file", "st", load_st),
    "sp": ("sp.load (crc32c checked)", "sp", load_sp),
    "sp_into": ("sp.load_into, in place (crc32c checked)", "sp", load_into_sp),
}

# ------------------------------------------------------------------------------ sections


def save_section(state: StateDict, root: str, rounds: int, outputs: dict[str, str]) -> SectionResult:
    """Interleaved saves; each call writes a fresh path, the peer's previous one removed first."""
    cases = []
    for key, (label, saver) in SAVERS.items():
        counter = iter(range(1_000_000))

        def prepare(key: str = key, counter: Any = counter) -> None:
            if key in outputs:
                remove(outputs[key])
            outputs[key] = os.path.join(root, f"{key}-{next(counter)}")

        def run(key: str = key, saver: Callable[[StateDict, str], None] = saver) -> None:
            saver(state, outputs[key])

        def check(key: str = key) -> None:
            if not files_under(outputs[key]):
                raise RuntimeError(f"{key} saved nothing at {outputs[key]}")

        cases.append(Case(key, label, run, prepare, check))
    return run_interleaved("save", cases, rounds=rounds, nbytes=tensor_bytes(state))


def load_section(state: StateDict, outputs: dict[str, str], rounds: int) -> SectionResult:
    """Interleaved warm loads; the warm-up round checks every value each peer returned."""
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    cases = []
    for key, (label, source, loader) in LOADERS.items():
        src = outputs[source]
        paths = files_under(src)
        got: dict[str, Any] = {}

        def prepare(paths: list[str] = paths, got: dict[str, Any] = got) -> None:
            got.clear()
            read_into_cache(paths)

        def run(loader: Callable[[str, StateDict], Any] = loader, src: str = src, got: dict[str, Any] = got) -> None:
            got["value"] = loader(src, target)

        def check(key: str = key, got: dict[str, Any] = got) -> None:
            value = target if key == "sp_into" else got["value"]
            if not same_values(state, value):
                raise RuntimeError(f"load {key} did not reproduce the saved tensors")

        cases.append(Case(key, label, run, prepare, check))
    return run_interleaved("load", cases, rounds=rounds, nbytes=tensor_bytes(state))


# --------------------------------------------------------------------------- peak memory


def _rss_child(op: str, key: str, src: str, count: int, numel: int, seed: int, conn: Any) -> None:
    """In a fresh process: build what the call needs, then measure its peak extra RSS."""
    try:
        state = make_state(count, numel, seed)
        if op == "load" and key != "sp_into":
            del state
            state = {}
        before = current_rss()
        reset = reset_peak_rss()
        result = SAVERS[key][1](state, src) if op == "save" else LOADERS[key][2](src, state)
        peak = peak_rss()
        conn.send({"before": before, "peak": peak, "reset": reset})
        del result
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        conn.close()


def measure_rss(root: str, outputs: dict[str, str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Peak RSS over the RSS just before each call, each call in its own spawned process."""
    ctx = multiprocessing.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    jobs = [("save", key, os.path.join(root, f"rss-{key}"), label) for key, (label, _) in SAVERS.items()]
    jobs += [("load", key, outputs[source], label) for key, (label, source, _) in LOADERS.items()]
    for op, key, src, label in jobs:
        if op == "load":
            read_into_cache(files_under(src))
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rss_child, args=(op, key, src, args.count, args.numel, args.seed, child))
        proc.start()
        child.close()
        got = parent.recv()
        proc.join()
        if "error" in got:
            raise RuntimeError(f"RSS measurement of {op} {key} failed: {got['error']}")
        got["label"] = f"{op}: {label}"
        got["extra"] = got["peak"] - got["before"]
        results[f"{op}_{key}"] = got
        if op == "save":
            remove(src)
    return results


def format_rss(rss: dict[str, dict[str, Any]]) -> str:
    width = max(len(r["label"]) for r in rss.values())
    head = f"{'':{width}}  {'before MB':>9} {'peak MB':>8} {'extra MB':>9}"
    lines = [
        "PEAK RSS OF ONE CALL (a fresh process each; before = interpreter, libraries and, for",
        "  saves and load_into, the state; extra = peak - before: what the call itself added)",
        head,
        "-" * len(head),
    ]
    for r in rss.values():
        lines.append(
            f"{r['label']:{width}}  {r['before'] / 1e6:9.1f} {r['peak'] / 1e6:8.1f} {r['extra'] / 1e6:9.1f}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------- the run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000, help="number of tensors (default 100000)")
    parser.add_argument("--numel", type=int, default=4, help="fp32 values per tensor (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up (default 5)")
    parser.add_argument("--quick", action="store_true", help="10^4 tensors, 1 round, no RSS: smoke run")
    parser.add_argument("--no-rss", action="store_true", help="skip the per-process peak RSS measurements")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="scratch directory parent (default: the system's temp)")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--hold-vm-memory",
        action="store_true",
        help="keep freed VM memory from the host for the run, as save_load.py does (tens of "
        "seconds to touch free memory first; the calls here move a few hundred MB at most)",
    )
    parser.add_argument(
        "--gc-off",
        action="store_true",
        help="turn Python's cyclic garbage collector off for the whole run, for every peer: the "
        "per-tensor cost without collector passes (shardpoint pauses it inside its own calls; "
        "safetensors does not, so by default its calls pay for those passes)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.count, args.rounds, args.no_rss = 10_000, 1, True
    if args.rounds < 1 or args.count < 1 or args.numel < 1:
        parser.error("--rounds, --count and --numel must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.hold_vm_memory:
        return run(args, "freed VM memory: left as it is (--hold-vm-memory holds it)")
    with freed_memory_held() as memory:
        return run(args, memory)


def run(args: argparse.Namespace, memory: str) -> int:
    started = time.perf_counter()
    if args.gc_off:
        gc.disable()
    root = tempfile.mkdtemp(prefix="shardpoint-small-", dir=args.dir)
    try:
        state = make_state(args.count, args.numel, args.seed)
        nbytes = tensor_bytes(state)
        print(
            "\n".join(
                [
                    f"shardpoint {sp.__version__}, torch {torch.__version__}, safetensors "
                    f"{safetensors.__version__}, python {platform.python_version()}",
                    f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
                    f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
                    memory,
                    "python's garbage collector: " + ("off for the whole run (--gc-off)" if args.gc_off else
                                                      "on (shardpoint's calls pause it; --gc-off turns it off)"),
                    f"state: {args.count} fp32 tensors of shape ({args.numel},): {nbytes / 1e6:.2f} MB of data",
                    f"rounds: 1 warm-up (discarded) + {args.rounds} timed, interleaved; medians; files warm",
                    f"shardpoint from {os.path.dirname(sp.__file__)}; scratch {root}",
                ]
            ),
            flush=True,
        )
        outputs: dict[str, str] = {}
        sections = {"save": save_section(state, root, args.rounds, outputs)}
        sections["load"] = load_section(state, outputs, args.rounds)
        rss = None if args.no_rss else measure_rss(root, outputs, args)

        manifest = os.path.getsize(os.path.join(outputs["sp"], "shardpoint.json"))
        sp_file = os.path.getsize(os.path.join(outputs["sp"], "model.safetensors"))
        st_file = os.path.getsize(os.path.join(outputs["st"], SAVE_FILE))
        print()
        print(format_section(f"SAVE, {args.count} tensors, page cache, median of {args.rounds}", sections["save"]))
        print()
        print(format_section(f"LOAD, {args.count} tensors, warm, median of {args.rounds}", sections["load"]))
        print()
        if rss is not None:
            print(format_rss(rss))
            print()
        print("SIZES")
        print(f"  tensor data                 {nbytes / 1e6:9.2f} MB")
        print(f"  safetensors file            {st_file / 1e6:9.2f} MB  (header {(st_file - nbytes) / 1e6:.2f} MB)")
        print(f"  shardpoint data file        {sp_file / 1e6:9.2f} MB  (header {(sp_file - nbytes) / 1e6:.2f} MB)")
        print(
            f"  shardpoint manifest         {manifest / 1e6:9.2f} MB  "
            f"({manifest / nbytes:.2f}x the data, {manifest / args.count:.0f} bytes per tensor)"
        )
        save, load = sections["save"], sections["load"]
        checks = [
            TargetCheck("save: sp.save / safetensors save_file", save.ratio("sp", "st"), "<=", 1.0),
            TargetCheck("load: sp.load / safetensors load_file", load.ratio("sp", "st"), "<=", 1.0),
            TargetCheck("load: sp.load_into / safetensors load_file", load.ratio("sp_into", "st"), "<=", 1.0),
        ]
        print()
        print("TARGETS (shardpoint no slower than safetensors, same run)")
        for check in checks:
            print(check.line())
        failed = sum(not c.passed for c in checks)
        elapsed = time.perf_counter() - started
        print(f"\n{len(checks) - failed}/{len(checks)} targets met; run took {elapsed:.0f} s")
        if args.json:
            report = {
                "setup": {"count": args.count, "numel": args.numel, "bytes": nbytes, "rounds": args.rounds},
                "sections": {k: r.to_json() for k, r in sections.items()},
                "rss": rss,
                "sizes": {"data": nbytes, "manifest": manifest, "sp_file": sp_file, "st_file": st_file},
                "targets": [c.to_json() for c in checks],
                "seconds": elapsed,
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
