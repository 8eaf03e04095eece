"""Bounded fuzzing of every parser of untrusted bytes, in the normal suite.

The targets and generators live in ``fuzz/`` (``targets.py``, ``seeds.py``) and are the
same ones the long runs use (``python fuzz/run.py --parser header --minutes 10``). Each
input must end in a result or a CheckpointError: a traceback, an answer the
``safetensors`` library disagrees with (we may refuse more than it does, never less), an
allocation beyond the bound or a wrong ``latest`` is a failure, and so is an input slower
than the deadline. Bounded by ``max_examples`` so the file runs in well under a minute.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
sys.path.insert(0, str(FUZZ))

import run as fuzz_run  # noqa: E402
import seeds  # noqa: E402
import targets  # noqa: E402

BOUNDED = settings(
    max_examples=150,
    deadline=2000,  # ms per input: nothing may hang
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", autouse=True)
def _fixtures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The checkpoints the targets load through, made once for the module."""
    targets._fixtures = None
    import os

    os.environ["SHARDPOINT_FUZZ_FIXTURES"] = str(tmp_path_factory.mktemp("fuzz-fixtures"))
    targets._fixture_dir()
    yield
    del os.environ["SHARDPOINT_FUZZ_FIXTURES"]
    targets._fixtures = None


def corpus(parser: str) -> list[bytes]:
    return seeds.seeds(parser, targets._fixture_dir())


def check(parser: str, data: bytes) -> str:
    try:
        return targets.TARGETS[parser](data)
    except targets.Finding as finding:
        pytest.fail(f"{parser} fuzz finding on {data[:200]!r}...: {finding}")


# ------------------------------------------------------------------- the four parsers


@pytest.mark.parametrize("parser", targets.PARSERS)
def test_seeds_are_accepted(parser: str) -> None:
    """The generators start from valid inputs (a fuzzer that only sees garbage tests little)."""
    outcomes = [check(parser, data) for data in corpus(parser)]
    assert outcomes[0] == "result", outcomes


@given(data=st.data())
@BOUNDED
def test_fuzz_safetensors_header(data: st.DataObject) -> None:
    check("header", data.draw(seeds.input_strategy("header", corpus("header"))))


@given(data=st.data())
@BOUNDED
def test_fuzz_safetensors_header_built_field_by_field(data: st.DataObject) -> None:
    """Near-valid files compared with the ``safetensors`` library, field by field."""
    check("header", data.draw(seeds.header_strategy()))


@given(data=st.data())
@BOUNDED
def test_fuzz_hf_index(data: st.DataObject) -> None:
    check("index", data.draw(seeds.input_strategy("index", corpus("index"))))


@given(data=st.data())
@settings(BOUNDED, max_examples=100)
def test_fuzz_manifest(data: st.DataObject) -> None:
    check("manifest", data.draw(seeds.input_strategy("manifest", corpus("manifest"))))


@given(data=st.data())
@BOUNDED
def test_fuzz_latest_pointer(data: st.DataObject) -> None:
    assert check("latest", data.draw(seeds.input_strategy("latest", corpus("latest")))) == "result"


# ---------------------------------------------------------------- the harness can fail


def test_the_cross_check_flags_a_looser_header_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were safetensors to refuse a file we accept, the header target reports it."""
    monkeypatch.setattr(targets, "_safetensors_view", lambda data: None)
    with pytest.raises(targets.Finding, match="looser: shardpoint accepted a header the safetensors library refuses"):
        targets.header(corpus("header")[0])


def test_the_targets_flag_tracebacks_and_big_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import shardpoint._format.index as index_mod

    def broken(raw: bytes, *, where: str) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(targets, "parse_index", broken)
    with pytest.raises(targets.Finding, match=r"(?s)crash: .*KeyError: 'a bug'"):
        targets.index(b"{}")
    monkeypatch.setattr(targets, "parse_index", index_mod.parse_index)
    with pytest.raises(targets.Finding, match=r"alloc: torch.empty\(1048577, 4\) \(16777232 bytes\)"):
        targets._classify(lambda: torch.empty((2**20 + 1, 4)))


def test_a_wrong_latest_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardpoint as sp

    monkeypatch.setattr(sp.CheckpointManager, "latest_step", lambda self: 2)
    with pytest.raises(targets.Finding, match="wrong: latest_step"):
        targets.latest(b"step-000002\n")


# ------------------------------------------------------------------------ memory bound


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b"[" + b"{}," * 40_000 + b"{}]", id="many-empty-objects"),
        pytest.param(b'{"a": [' + b"0," * 100_000 + b"0]}", id="long-list"),
        pytest.param(b"[" * 50_000 + b"]" * 50_000, id="deep-nesting"),
        pytest.param(json.dumps({f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(3000)}).encode(), id="many-tensors"),
        pytest.param(b'{"' + b"k" * 500_000 + b'": 1}', id="long-key"),
    ],
)
def test_header_parsing_allocates_in_proportion_to_the_header(header: bytes) -> None:
    """Python objects made from the JSON stay within a fixed multiple of its size."""
    data = struct.pack("<Q", len(header)) + header + bytes(12_000)
    tracemalloc.start()
    try:
        outcome = targets._classify(lambda: targets.header(data))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome in ("result", "error")
    assert peak < 64 * len(data) + (1 << 20), f"{peak} bytes for a {len(data)}-byte file"


# ---------------------------------------------------------------------- the long runs


def test_long_run_driver_counts_inputs_and_findings(tmp_path: Path) -> None:
    """``fuzz/run.py``'s Hypothesis engine, one second per parser."""
    for parser in targets.PARSERS:
        stats = fuzz_run.fuzz_with_hypothesis(parser, 1.0, tmp_path / "findings", seed=1)
        assert stats.inputs > 20 and stats.inputs == stats.results + stats.errors + stats.findings
        assert stats.findings == 0, stats.saved
    assert not (tmp_path / "findings").exists()


def test_long_run_cli_with_atheris(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is not installed: the long runs use Hypothesis")
    done = subprocess.run(
        [sys.executable, str(FUZZ / "run.py"), "--parser", "header", "--seconds", "3", "--engine", "atheris",
         "--corpus", str(tmp_path / "corpus" / "header"), "--findings", str(tmp_path / "findings")],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = re.search(r"parser header \(atheris, \d+ s\): (\d+) inputs, (\d+) results, (\d+) CheckpointErrors, 0 findings", done.stdout)
    assert line, done.stdout
    inputs, results, errors = map(int, line.groups())
    assert inputs > 100 and results > 0 and errors > 0 and inputs == results + errors


# ------------------------------------------------------------- the CLI's human output


def test_cli_seeds_are_accepted() -> None:
    outcomes = [check("cli", data) for data in seeds.cli_seeds()]
    assert outcomes == ["result", "result", "result"]


@given(data=st.data())
@settings(BOUNDED, max_examples=60)
def test_fuzz_cli_output(data: st.DataObject) -> None:
    """Fuzzed manifests, headers and indexes (names full of terminal controls) through
    inspect, verify and diff: exit 0/1/2, no traceback, nothing unescaped printed."""
    check("cli", data.draw(seeds.input_strategy("cli", seeds.cli_seeds())))


def test_the_cli_target_flags_an_unescaped_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were a command to print names raw, the target reports it."""
    import shardpoint._printable as printable

    monkeypatch.setattr(printable, "_escape_char", lambda match: match.group())
    with pytest.raises(targets.Finding, match=r"escape: inspect printed .*'\\x1b'"):
        targets.cli(seeds.cli_seeds()[0])
