"""Long fuzz runs of shardpoint's parsers of untrusted bytes.

    python fuzz/run.py --parser header --minutes 10
    python fuzz/run.py --parser all --minutes 10          # each parser in turn
    python fuzz/run.py --parser manifest --seconds 30 --engine hypothesis

Parsers: ``header`` (safetensors header, cross-checked against the ``safetensors``
library), ``index`` (HF ``*.safetensors.index.json``, then a load through it),
``manifest`` (``shardpoint.json``, then loads through it), ``latest`` (the
``CheckpointManager`` pointer), ``cli`` (a manifest, data file header or index of
checkpoints whose names hold terminal controls, then ``inspect``, ``verify`` and ``diff``
on them: their human output must escape every control character). See ``fuzz/targets.py`` for what counts as a finding.

Engines: ``atheris`` (coverage-guided libFuzzer, the default where it is installed; it
runs in a child process, restarted after a crash or a hang it reports) and
``hypothesis`` (random and structure-aware generation, everywhere). Both mutate the
seed inputs of ``fuzz/seeds.py`` structurally as well as byte by byte. The corpus grows
in ``--corpus`` (default ``fuzz/corpus/<parser>``); every finding is saved in
``--findings`` (default ``fuzz/findings``) as ``<parser>-<kind>-<sha1>.bin`` with a
``.txt`` saying what happened. Prints, per parser: inputs, results, CheckpointErrors and
findings; exits 1 if there were findings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SLOW_S = 5.0
"""An input that takes longer than this is a finding (``slow``): nothing may hang."""
MAX_LEN = 64 << 10
"""Largest input the fuzzers generate."""


@dataclass
class Stats:
    inputs: int = 0
    results: int = 0
    errors: int = 0
    findings: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)

    def add(self, other: Stats) -> None:
        self.inputs += other.inputs
        self.results += other.results
        self.errors += other.errors
        self.findings += other.findings
        for kind, n in other.kinds.items():
            self.kinds[kind] = self.kinds.get(kind, 0) + n
        self.saved += other.saved

    def line(self) -> str:
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(self.kinds.items()))
        return (
            f"{self.inputs} inputs, {self.results} results, {self.errors} CheckpointErrors, "
            f"{self.findings} findings" + (f" ({kinds})" if kinds else "")
        )


def record_finding(stats: Stats, findings: Path, parser: str, kind: str, data: bytes, detail: str) -> None:
    findings.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(data).hexdigest()[:16]
    base = findings / f"{parser}-{kind}-{digest}"
    if not base.with_suffix(".bin").exists():
        base.with_suffix(".bin").write_bytes(data)
        base.with_suffix(".txt").write_text(f"{parser}: {kind}\n\n{detail}\n")
        stats.saved.append(str(base.with_suffix(".bin")))
    stats.findings += 1
    stats.kinds[kind] = stats.kinds.get(kind, 0) + 1


def run_input(parser: str, data: bytes, stats: Stats, findings: Path) -> None:
    """Feed one input to a target and count what it ended in."""
    from targets import TARGETS, Finding

    stats.inputs += 1
    started = time.monotonic()
    try:
        outcome = TARGETS[parser](data)
    except Finding as finding:
        record_finding(stats, findings, parser, finding.kind, data, finding.detail)
    else:
        if outcome == "result":
            stats.results += 1
        else:
            stats.errors += 1
    took = time.monotonic() - started
    if took > SLOW_S:
        record_finding(stats, findings, parser, "slow", data, f"{took:.1f} s for one input")


# ------------------------------------------------------------------------------ hypothesis


def fuzz_with_hypothesis(parser: str, seconds: float, findings: Path, *, seed: int | None = None) -> Stats:
    """Generate inputs with Hypothesis until ``seconds`` have passed."""
    import seeds as seed_inputs
    import targets
    from hypothesis import HealthCheck, Phase, given, settings

    corpus = seed_inputs.seeds(parser, targets._fixture_dir())
    stats = Stats()
    rng = random.Random(seed)
    strategy = seed_inputs.input_strategy(parser, corpus)
    deadline = time.monotonic() + seconds

    @settings(max_examples=500, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(data: bytes) -> None:
        if time.monotonic() < deadline:
            run_input(parser, data, stats, findings)

    while time.monotonic() < deadline:
        one._hypothesis_internal_use_seed = rng.getrandbits(64)  # type: ignore[attr-defined]
        one()
    return stats


# -------------------------------------------------------------------------------- atheris


def _dictionary(path: Path) -> None:
    tokens = [
        "dtype", "shape", "data_offsets", "__metadata__", "format", "pt", "weight_map", "metadata",
        "total_size", "shardpoint", "format_version", "save_id", "world_size", "layout", "flat",
        "components", "tree", "tensors", "chunks", "file", "key", "offsets", "crc32c", "aliases",
        "files", "size", "type", "items", "name", "value", "dict", "list", "tensor", "json", "pickle",
        "F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "chunked",
        "hf", "model.safetensors", "step-", "..", "/",
    ]
    lines = [json.dumps(json.dumps(t)) for t in tokens] + ['"{"', '"}"', '"["', '"]"', '":"', '","', '"null"']
    path.write_text("\n".join(lines) + "\n")


def _atheris_worker(args: argparse.Namespace) -> None:
    """In the child: instrument shardpoint, fuzz until the time is up, write the stats."""
    import atheris
    import safetensors  # noqa: F401  (imported before instrumenting: not fuzzed itself)
    import torch  # noqa: F401

    with atheris.instrument_imports(include=["shardpoint"]):
        import shardpoint
        import shardpoint._format.index
        import shardpoint._format.manifest
        import shardpoint._format.safetensors
        import shardpoint._manager
        import shardpoint._read  # noqa: F401
    import seeds as seed_inputs

    stats = Stats()
    findings = Path(args.findings)
    stats_path = Path(args.stats)
    end = time.monotonic() + args.seconds
    last_flush = [time.monotonic()]

    def flush() -> None:
        stats_path.write_text(json.dumps(asdict(stats)))

    def test_one_input(data: bytes) -> None:
        run_input(args.parser, data, stats, findings)
        now = time.monotonic()
        if now - last_flush[0] > 1.0:
            last_flush[0] = now
            flush()
        if now > end:
            flush()
            os._exit(0)

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            try:
                out = seed_inputs.mutate_input(args.parser, data, rng)
            except RecursionError:
                out = data
            if out != data and len(out) <= max_size:
                return out
        return bytes(atheris.Mutate(data, max_size))

    flush()
    atheris.Setup(
        [sys.argv[0], args.corpus, f"-max_total_time={int(args.seconds) + 60}", f"-timeout={int(SLOW_S * 4)}",
         "-rss_limit_mb=4096", f"-max_len={MAX_LEN}", f"-dict={args.dict}",
         f"-artifact_prefix={findings}/{args.parser}-libfuzzer-", "-print_final_stats=0"],
        test_one_input,
        custom_mutator=custom_mutator,
    )
    atheris.Fuzz()


def fuzz_with_atheris(parser: str, seconds: float, findings: Path, corpus: Path) -> Stats:
    """Run the atheris worker for ``seconds``, restarting it if libFuzzer stops on a crash."""
    import seeds as seed_inputs
    import targets

    corpus.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)  # libFuzzer writes its artifacts there
    for data in seed_inputs.seeds(parser, targets._fixture_dir()):
        (corpus / f"seed-{hashlib.sha1(data).hexdigest()[:16]}").write_bytes(data)
    total = Stats()
    end = time.monotonic() + seconds
    with tempfile.TemporaryDirectory(prefix="shardpoint-fuzz-") as work:
        dict_path = Path(work) / "tokens.dict"
        _dictionary(dict_path)
        run = 0
        while (left := end - time.monotonic()) > 1:
            run += 1
            stats_path = Path(work) / f"stats-{run}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--parser", parser,
                   "--seconds", str(left), "--findings", str(findings), "--corpus", str(corpus),
                   "--stats", str(stats_path), "--dict", str(dict_path)]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            part = Stats(**json.loads(stats_path.read_text())) if stats_path.exists() else Stats()
            if done.returncode != 0:  # libFuzzer stopped on a crash, a hang or memory
                tail = done.stdout[-3000:]
                record_finding(part, findings, parser, "libfuzzer", tail.encode(), tail)
                print(f"  worker {run} stopped (rc={done.returncode}); restarting\n{tail[-800:]}", file=sys.stderr)
            total.add(part)
    return total


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parser", default="all", choices=["all", "header", "index", "manifest", "latest", "cli"])
    parser.add_argument("--minutes", type=float, default=None, help="time per parser")
    parser.add_argument("--seconds", type=float, default=None, help="time per parser (instead of --minutes)")
    parser.add_argument("--engine", default="auto", choices=["auto", "atheris", "hypothesis"])
    parser.add_argument("--findings", default=str(HERE / "findings"))
    parser.add_argument("--corpus", default=None, help="default: fuzz/corpus/<parser>")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis engine: reproducible runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    parser.add_argument("--dict", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _atheris_worker(args)
        return 0
    seconds = args.seconds if args.seconds is not None else 60.0 * (args.minutes if args.minutes is not None else 1.0)
    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # noqa: F401

            engine = "atheris"
        except ImportError:
            engine = "hypothesis"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    corpus_root = Path(args.corpus).parent if args.corpus else HERE / "corpus"
    os.environ.setdefault("SHARDPOINT_FUZZ_FIXTURES", str(corpus_root / "fixtures"))
    findings = Path(args.findings)
    parsers = ["header", "index", "manifest", "latest", "cli"] if args.parser == "all" else [args.parser]
    any_findings = False
    for name in parsers:
        started = time.monotonic()
        if engine == "atheris":
            corpus = Path(args.corpus) if args.corpus else HERE / "corpus" / name
            stats = fuzz_with_atheris(name, seconds, findings, corpus)
        else:
            stats = fuzz_with_hypothesis(name, seconds, findings, seed=args.seed)
        took = time.monotonic() - started
        print(f"parser {name} ({engine}, {took:.0f} s): {stats.line()}", flush=True)
        for path in stats.saved[:20]:
            print(f"  finding: {path}")
        any_findings |= stats.findings > 0
    return 1 if any_findings else 0


if __name__ == "__main__":
    sys.exit(main())
