"""Typed options (``IOOptions``, ``RemoteOptions``, ``CollectiveOptions``): literal defaults,
environment seeds read once, ``options=`` on every entry point, ``sp.using``, and the
threads shardpoint starts running under the caller's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._io.threads import run_all

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with no SHARDPOINT_* variable but ``env``'s."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDPOINT_")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**clean, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", **env},
    )


_DUMP = (
    "import dataclasses, json, shardpoint as sp; "
    "print(json.dumps(dataclasses.asdict(sp.current_options())))"
)


def test_literal_defaults_without_the_environment() -> None:
    done = _python(_DUMP)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "io": {
            "write_threads": 0, "read_threads": 0, "segment_bytes": 2 << 20, "piece_bytes": 64 << 20,
            "staging_buffer_bytes": 64 << 20, "verify_checksums": True, "native": True,
            "cached_copy": True, "direct_reads": False, "max_header_bytes": 100_000_000,
            "max_json_bytes": 256 << 20,
        },
        "remote": {"threads": 8, "block_bytes": 16 << 20, "read_bytes": 16 << 20, "retries": 4,
                   "backoff_ms": 200, "timeout_s": 30},
        "collective": {"timeout_s": 1800, "segment_bytes": 256 << 10},
    }


def test_environment_variables_seed_the_defaults_and_are_read_once() -> None:
    code = (
        "import os, shardpoint as sp\n"
        "first = sp.current_options()\n"
        "os.environ['SHARDPOINT_WRITE_THREADS'] = '5'  # too late: read once\n"
        "print(first.io.write_threads, first.io.verify_checksums, first.remote.retries, "
        "first.collective.timeout_s, sp.current_options().io.write_threads, "
        "sp.IOOptions().write_threads, sp.IOOptions(read_threads=2).verify_checksums)\n"
    )
    done = _python(code, SHARDPOINT_WRITE_THREADS="3", SHARDPOINT_VERIFY="0",
                   SHARDPOINT_REMOTE_RETRIES="0", SHARDPOINT_COLLECTIVE_TIMEOUT="60")
    assert done.returncode == 0, done.stderr
    # The seeds are every option's default, also of a group made in code with other fields set.
    assert done.stdout.split() == ["3", "False", "0", "60", "3", "3", "False"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("eight", "environment variable SHARDPOINT_READ_THREADS='eight' is not an integer"),
        ("-1", "IOOptions.read_threads (environment variable SHARDPOINT_READ_THREADS) must be an "
               "integer >= 0, not -1"),
    ],
)
def test_a_bad_environment_value_is_named_at_first_use_not_at_import(value: str, message: str) -> None:
    code = (
        "import shardpoint as sp\n"
        "try:\n"
        "    sp.current_options()\n"
        "except sp.InvalidArgumentError as exc:\n"
        "    print(type(exc).__name__, isinstance(exc, ValueError), exc)\n"
    )
    done = _python(code, SHARDPOINT_READ_THREADS=value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"InvalidArgumentError True {message}"), done.stdout


@pytest.mark.parametrize(
    ("make", "kind", "message"),
    [
        (lambda: sp.IOOptions(read_threads="2"), TypeError, "IOOptions.read_threads must be an int, not '2'"),
        (lambda: sp.IOOptions(verify_checksums=1), TypeError, "IOOptions.verify_checksums must be True or False, not 1"),
        (lambda: sp.IOOptions(segment_bytes=0), ValueError, "IOOptions.segment_bytes must be a positive integer, not 0"),
        (lambda: sp.RemoteOptions(retries=-1), ValueError, "RemoteOptions.retries must be an integer >= 0, not -1"),
        (lambda: sp.CollectiveOptions(timeout_s=True), TypeError, "CollectiveOptions.timeout_s must be an int, not True"),
        (lambda: sp.Options(io=sp.RemoteOptions()), TypeError, "Options.io must be a shardpoint.IOOptions"),
    ],
)
def test_options_check_their_fields(make: Any, kind: type[Exception], message: str) -> None:
    with pytest.raises(sp.InvalidArgumentError) as caught:
        make()
    assert isinstance(caught.value, kind)
    assert str(caught.value).startswith(message), str(caught.value)


def test_using_layers_groups_and_restores_on_exit() -> None:
    before = sp.current_options()
    with sp.using(io=sp.IOOptions(read_threads=3)) as outer:
        assert outer == sp.current_options() and outer.io.read_threads == 3
        with sp.using(sp.RemoteOptions(retries=1)) as inner:
            assert inner.io.read_threads == 3 and inner.remote.retries == 1  # the outer io kept
            with sp.using([sp.IOOptions(read_threads=1), sp.CollectiveOptions(timeout_s=9)]) as innermost:
                assert (innermost.io.read_threads, innermost.remote.retries, innermost.collective.timeout_s) == (1, 1, 9)
        assert sp.current_options() == outer
    assert sp.current_options() == before
    with pytest.raises(sp.InvalidArgumentTypeError, match=r"options= takes a shardpoint.Options, .* not 'fast'"):
        sp.save({"w": torch.ones(1)}, "memory://options/never", options="fast")


def test_threads_started_for_a_call_run_under_its_options() -> None:
    seen: list[sp.Options] = []
    lock = threading.Lock()

    def record(_: object) -> None:
        with lock:
            seen.append(sp.current_options())
        threading.Event().wait(0.01)  # let the other threads of the pool take items too

    with sp.using(io=sp.IOOptions(read_threads=3), remote=sp.RemoteOptions(retries=0)) as chosen:
        run_all(record, list(range(6)), threads=3)
        run_all(record, list(range(6)), 3, cancelled=threading.Event())
    assert len(seen) == 12 and all(o == chosen for o in seen), {o.io.read_threads for o in seen}


class _Probe:
    """A ``Stateful`` whose ``state_dict()`` (called by the save) records the options in effect."""

    def __init__(self) -> None:
        self.seen: list[sp.Options] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(sp.current_options())
        return {"w": torch.ones(2)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen.append(sp.current_options())


def test_save_and_async_save_run_under_the_options_of_their_call(tmp_path: Path) -> None:
    one = sp.IOOptions(write_threads=1)
    probe = _Probe()
    sp.save({"probe": probe}, tmp_path / "a", options=one)
    assert probe.seen == [sp.Options(io=one)]
    assert sp.current_options() == sp.Options()  # and ended with it

    inside: list[sp.Options] = []
    handle = sp.async_save({"w": torch.ones(3)}, tmp_path / "b", options=[one, sp.RemoteOptions(retries=0)],
                           on_commit=lambda info: inside.append(sp.current_options()))
    handle.result()
    # the background thread wrote (and called on_commit) under the options of the call
    assert inside == [sp.Options(io=one, remote=sp.RemoteOptions(retries=0))]

    mgr = sp.CheckpointManager(tmp_path / "run", options=one)
    probe = _Probe()
    mgr.save(1, {"probe": probe})
    assert probe.seen == [sp.Options(io=one)]
    assert mgr.restore({"probe": probe}) == 1 and probe.seen[-1] == sp.Options(io=one)


def _oversized_manifest(tmp_path: Path) -> tuple[Path, int]:
    path = tmp_path / "ckpt"
    sp.save({"w": torch.arange(4.0)}, path)
    return path, (path / "shardpoint.json").stat().st_size


def test_every_entry_point_takes_options(tmp_path: Path) -> None:
    path, size = _oversized_manifest(tmp_path)
    small = sp.IOOptions(max_json_bytes=size - 1)
    over = f"{path / 'shardpoint.json'} is {size} bytes, over the {size - 1}-byte limit"
    with pytest.raises(sp.CorruptCheckpointError, match=over):
        sp.load(path, options=small)
    with pytest.raises(sp.CorruptCheckpointError, match=over):
        sp.load_into({"w": torch.zeros(4)}, path, options=[small])
    with pytest.raises(sp.CorruptCheckpointError, match=over):
        sp.load_into({"w": torch.zeros(4)}, path, options=sp.Options(io=small))
    assert sp.load(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the call's options ended with it

    # The manager: its restores (and saves) run under the options it was made with.
    mgr = sp.CheckpointManager(tmp_path / "run", options=small)
    mgr.save(1, {"w": torch.arange(4.0)})
    manifest = tmp_path / "run" / "step-000001" / "shardpoint.json"
    with pytest.raises(sp.CorruptCheckpointError, match=f"{manifest} is .* bytes, over the {size - 1}-byte limit"):
        mgr.restore({"w": torch.zeros(4)})
    target = {"w": torch.zeros(4)}
    assert sp.CheckpointManager(tmp_path / "run").restore(target) == 1 and target["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_runner_uses_the_callers_thread_and_stops_at_the_first_error() -> None:
    """``run_all`` runs each item once, on the caller's thread and ``threads - 1`` more; the
    first error stops new items and is raised only once the running ones have finished."""
    ran: list[tuple[int, int]] = []
    lock = threading.Lock()

    def record(item: int) -> None:
        with lock:
            ran.append((item, threading.get_ident()))
        threading.Event().wait(0.01)  # long enough that every thread takes items

    run_all(record, list(range(12)), threads=3)
    assert sorted(i for i, _ in ran) == list(range(12))
    idents = {t for _, t in ran}
    assert threading.get_ident() in idents and len(idents) == 3

    finished: list[int] = []

    def fail_or_wait(item: int) -> None:
        if item == 1:
            raise OSError(28, "No space left on device")
        threading.Event().wait(0.2)
        finished.append(item)

    with pytest.raises(OSError, match="No space left on device"):
        run_all(fail_or_wait, list(range(20)), threads=2)
    assert finished == [0]  # item 0 ran to its end before the error was raised; no item after 1 started

    # Ctrl-C while the caller's thread runs an item: the helper finishes the item it holds,
    # takes no other, and the interrupt is raised.
    caller = threading.get_ident()
    done: list[int] = []

    def interrupted_in_caller(item: int) -> None:
        if threading.get_ident() == caller:
            raise KeyboardInterrupt
        threading.Event().wait(0.1)
        done.append(item)

    with pytest.raises(KeyboardInterrupt):
        run_all(interrupted_in_caller, list(range(20)), threads=2)
    assert len(done) <= 1  # at most the item it held when the interrupt came
