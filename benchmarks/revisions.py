"""One benchmark, two revisions of shardpoint, in one sitting: before against after.

Runs a benchmark script of this checkout (the measuring code is the same for both) once per
revision per pair, alternating ABBA (before, after, after, before, ...) so neither revision
always runs first or after the other, with ``PYTHONPATH`` pointing at each revision's
``src/``. The base revision is checked out into a temporary git worktree (its native
extension copied when ``_native.c`` is the same, built otherwise). Every run writes
``--json``; the table lists every median the script recorded (shardpoint's and its peers':
the peers did not change, so their spread is the sitting's noise), the median of each
revision's runs, after / before, and the largest spread between two runs of the same
revision of that row.

    .venv/bin/python benchmarks/revisions.py --base 1371448 --pairs 2 -- save_load.py --gb 1 --rounds 3
    .venv/bin/python benchmarks/revisions.py --base main~5 -- distributed.py --quick
    .venv/bin/python benchmarks/revisions.py --base v0.3.0 -- remote.py --quick --no-dcp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NATIVE_SOURCE = "src/shardpoint/_native.c"


def _git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str, where: str) -> str:
    """A worktree of ``rev`` at ``where`` with its native extension in place; its ``src``."""
    _git("worktree", "add", "--detach", "-q", where, rev)
    same_native = subprocess.run(
        ["git", "diff", "--quiet", rev, "--", NATIVE_SOURCE], cwd=ROOT
    ).returncode == 0
    built = [n for n in os.listdir(os.path.join(ROOT, "src", "shardpoint")) if n.startswith("_native.") and n.endswith(".so")]
    if same_native and built:
        for name in built:
            shutil.copy2(os.path.join(ROOT, "src", "shardpoint", name), os.path.join(where, "src", "shardpoint", name))
    else:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=where, check=True,
                       stdout=subprocess.DEVNULL)
    return os.path.join(where, "src")


def medians(doc: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, float]]:
    """Every ``median_s`` number in a benchmark's JSON, named by where it sits."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "median_s" and isinstance(value, (int, float)):
                yield _name(path), float(value)
            elif key == "median_s" and isinstance(value, dict):
                for name, times in value.items():
                    yield from _leaves(times, (*path, name))
            elif key not in ("seconds", "cpu_seconds"):
                yield from medians(value, (*path, str(key)))


def _name(path: tuple[str, ...]) -> str:
    """``sections/load_warm/peers/sp`` reads as ``load_warm/sp``."""
    return "/".join(p for p in path if p not in ("sections", "peers"))


def _leaves(doc: Any, path: tuple[str, ...]) -> Iterator[tuple[str, float]]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(doc, (int, float)):
        yield _name(path), float(doc)


def run_once(script: list[str], src: str, out: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    command = [sys.executable, os.path.join(HERE, script[0]), *script[1:], "--json", out]
    print("$ PYTHONPATH=" + src + " " + " ".join(command[1:]), flush=True)
    done = subprocess.run(command, env=env, check=False, stdout=sys.stderr)
    if not os.path.exists(out):  # a crash; a run whose own targets failed still wrote its figures
        raise SystemExit(f"{' '.join(command[1:])} exited {done.returncode} without writing {out}")
    with open(out) as f:
        return dict(medians(json.load(f)))


def spread(values: list[float]) -> float:
    """Largest over smallest, minus one: 0.05 means the runs differed by 5 %."""
    return max(values) / min(values) - 1 if len(values) > 1 and min(values) > 0 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the 'before' revision (any git revision)")
    parser.add_argument("--pairs", type=int, default=2, help="before/after pairs, run ABBA (default 2)")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: a benchmark with --json")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the benchmark after --, e.g. -- save_load.py --quick")
    base = _git("rev-parse", "--short", args.base)
    head = _git("rev-parse", "--short", "HEAD") + ("+changes" if _git("status", "--porcelain", "--untracked-files=no") else "")
    work = tempfile.mkdtemp(prefix="sp-revisions-")
    tree = os.path.join(work, "base")
    try:
        srcs = {"before": checkout(base, tree), "after": os.path.join(ROOT, "src")}
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        order = []
        for i in range(args.pairs):
            order += ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for n, which in enumerate(order):
            runs[which].append(run_once(script, srcs[which], os.path.join(work, f"{n}.json")))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    rows = sorted(set().union(*runs["before"], *runs["after"]))
    print(f"\n{' '.join(script)}: before = {base}, after = {head}, {args.pairs} runs each, order {' '.join(order)}")
    print(f"{'median seconds of':<58} {'before':>8} {'after':>8} {'after/before':>13} {'spread b/a':>12}")
    for row in rows:
        b = [r[row] for r in runs["before"] if row in r]
        a = [r[row] for r in runs["after"] if row in r]
        if not a or not b:
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = ma / mb if mb > 0 else float("nan")
        spreads = f"{spread(b) * 100:5.0f}%/{spread(a) * 100:3.0f}%" if len(a) > 1 and len(b) > 1 else "-"
        print(f"{row:<58} {mb:8.3f} {ma:8.3f} {ratio:12.2f}x {spreads:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
