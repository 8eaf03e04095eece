"""16 gloo ranks on 4 "hosts": a collective save, the same structure saved again through the
reused plan, a changed structure replanned; then the middle checkpoint resharded to 5 ranks.

One launch of 16 processes (``tests/_sixteen_worker.py save``) makes three chunked saves of
an FSDP2-like nested state (1-D ``Shard(0)`` DTensors, one with rows not divisible by 16 so
the last ranks hold empty shards, a 4x4-mesh ``(Shard(0), Shard(1))`` one, a ``Replicate()``
one, a plain tensor, an optimizer-like ``{"step": 3, "exp_avg": {...}}``):

* ``step-1``: ``SaveInfo.plan_reused`` False on every rank (nothing to reuse);
* ``step-2``: same structure, new values: True on every rank;
* ``step-3``: one more tensor: False on every rank (a changed structure replans).

One launch of 5 processes (``load``) ``sp.load_into`` ``step-2`` on a 1-D mesh of 5 and
compares every local shard bit-exactly. In this process, ``sp.load`` reads every checkpoint
whole and compares it exactly, and ``shardpoint verify step-2`` exits 0.

Each rank runs in its own UTS namespace (``unshare --uts``) with the host name
``host-<rank // 4>`` (16 ranks: 4 hosts x 4 ranks; 5 ranks: 3 + 2), and checks
``socket.gethostname()``: what a save's per-host thread share sees. Where ``unshare`` is not
possible (not root, no user namespaces) the ranks run on this host's name, said in the skip
reason of ``test_ranks_saw_their_host_names``.

``plan_reused`` is asserted last (``test_plan_reused``), after everything else has passed,
so a tree without the feature fails only there.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _sixteen_worker import SAVE_WORLD, expected_state

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]

WORKER = Path(__file__).with_name("_sixteen_worker.py")
LOAD_WORLD = 5
RANKS_PER_HOST = 4
LAUNCH_TIMEOUT = 300.0
"""Seconds one launch may take before every rank still running is killed."""
GRACE_SECONDS = 10.0
"""How long the other ranks may go on after one rank failed, before they are killed."""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if this process dies (even by SIGKILL), so that
    no rank outlives an interrupted test. Kept across unshare's and sh's exec."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unshare_works() -> str | None:
    """None when ``unshare --uts`` can give a process a host name of its own, else why not."""
    if shutil.which("unshare") is None or shutil.which("hostname") is None:
        return "no unshare / hostname command"
    try:
        probe = subprocess.run(
            ["unshare", "--uts", "sh", "-c", "hostname sp-probe-host && hostname"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --uts failed: {exc}"
    if probe.returncode != 0 or probe.stdout.strip() != "sp-probe-host":
        return f"unshare --uts failed (exit {probe.returncode}): {probe.stderr.strip()}"
    return None


UNSHARE_PROBLEM = _unshare_works()


def _host(rank: int, world: int) -> str:
    if world == SAVE_WORLD:
        return f"host-{rank // RANKS_PER_HOST}"
    return f"host-{rank // 3}"  # 5 ranks: 3 on host-0, 2 on host-1


def _env() -> dict[str, str]:
    src = str(Path(sp.__file__).resolve().parent.parent)  # the shardpoint this test imported
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",  # the made-up host names resolve to nothing: gloo on loopback
        PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    return env


def launch(phase: str, world: int, root: Path) -> dict[int, dict[str, Any]]:
    """Run ``world`` worker processes; return each rank's result, or raise one AssertionError
    with every failing rank's traceback (or log tail). Every process is gone on return."""
    results = root / "results"
    results.mkdir(exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    port = _free_port()
    env = _env()
    procs: list[subprocess.Popen[bytes]] = []
    timed_out = False
    try:
        for rank in range(world):
            host = _host(rank, world) if UNSHARE_PROBLEM is None else "-"
            cmd = [sys.executable, str(WORKER), phase, str(rank), str(world), str(port), str(root), host]
            if UNSHARE_PROBLEM is None:
                # unshare execs sh, which execs python: the Popen pid is the worker's
                line = shlex.join(cmd)
                cmd = ["unshare", "--uts", "sh", "-c", f"hostname {shlex.quote(host)} && exec {line}"]
            with open(logs / f"{phase}-rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: killed whole below
                    preexec_fn=_die_with_parent,
                ))
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        first_failure: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now > first_failure + GRACE_SECONDS):
                timed_out = first_failure is None
                break
            time.sleep(0.05)
    finally:
        killed: set[int] = {rank for rank, p in enumerate(procs) if p.poll() is None}
        if killed:  # where they are stuck, into their logs (the worker's faulthandler), then kill
            for rank in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[rank].pid, signal.SIGUSR1)
            time.sleep(1.0)
        for rank in killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(procs[rank].pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    out: dict[int, dict[str, Any]] = {}
    died: list[str] = []  # ranks gone without a traceback (a crash, a signal): likely the cause
    raised: list[tuple[float, int, str]] = []  # (when, rank, traceback)
    stopped: list[str] = []  # ranks killed here
    for rank, p in enumerate(procs):
        err = results / f"{phase}-rank{rank}.err"
        done = results / f"{phase}-rank{rank}.json"
        log = logs / f"{phase}-rank{rank}.log"
        if err.exists():
            raised.append((err.stat().st_mtime, rank, err.read_text()))
        elif rank in killed:
            why = "timed out" if timed_out else "was stopped after another rank failed"
            stopped.append(f"--- rank {rank} {why} (killed){_stuck_at(log)}")
        elif p.returncode != 0 or not done.exists():
            tail = log.read_text(errors="replace")[-4000:]
            died.append(f"--- rank {rank} died with exit code {p.returncode}; its output ends:\n{tail}")
        else:
            out[rank] = json.loads(done.read_text())
    # the first traceback in full (usually the cause), the others' last line (usually "failed
    # on rank N"): 16 copies of the same stack would bury it; every rank's output is in logs/
    raised.sort()
    problems = [f"the {world} ranks did not finish within {LAUNCH_TIMEOUT:.0f} s"] if timed_out else []
    problems += died
    problems += [f"--- rank {rank} raised first:\n{text}" for _, rank, text in raised[:1]]
    problems += [f"--- rank {rank} raised: {text.strip().splitlines()[-1]}" for _, rank, text in raised[1:]]
    problems += stopped
    if problems:
        raise AssertionError(
            f"{phase} on {world} ranks failed (every rank's output: {logs}):\n" + "\n".join(problems)
        )
    return out


def _stuck_at(log: Path) -> str:
    """The innermost frames of the main thread in the last stack dump in ``log``."""
    text = log.read_text(errors="replace") if log.exists() else ""
    start = text.rfind("Current thread")
    if start < 0:
        return ""
    frames = text[start:].splitlines()[1:7]
    return ", in:\n" + "\n".join(frames)


@dataclass
class Run:
    root: Path
    saves: dict[int, dict[str, Any]]
    loads: dict[int, dict[str, Any]]
    seconds: float


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("sixteen")
    started = time.monotonic()
    saves = launch("save", SAVE_WORLD, root)
    loads = launch("load", LOAD_WORLD, root)
    yield Run(root, saves, loads, time.monotonic() - started)


def _assert_exact(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__}"
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            _assert_exact(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype} {got.shape}"
        same = torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
        assert same, f"{where}: values differ"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_sixteen_ranks_saved_three_checkpoints(run: Run) -> None:
    assert sorted(run.saves) == list(range(SAVE_WORLD))
    for rank, out in run.saves.items():
        assert sorted(out["saves"]) == ["1", "2", "3"], rank
        for number, info in out["saves"].items():
            assert info["path"].endswith(f"step-{number}"), (rank, info)
        # 37 rows over 16 ranks: 3 each on ranks 0-11, 1 on rank 12, none on 13-15
        assert out["local_rows_uneven"] == (3 if rank < 12 else 1 if rank == 12 else 0), (rank, out)
        assert out["local_shape_2d"] == [16, 24], (rank, out)  # (64, 96) over 4 x 4
    for number in (1, 2, 3):
        assert (run.root / f"step-{number}" / "shardpoint.json").is_file()
        assert len({out["saves"][str(number)]["tensor_bytes"] for out in run.saves.values()}) == 1


def test_resharded_to_five_ranks(run: Run) -> None:
    assert sorted(run.loads) == list(range(LOAD_WORLD))
    for rank, out in run.loads.items():
        assert out["compared"] == 8, (rank, out)  # 5 model tensors + 3 exp_avg, every one compared


@pytest.mark.parametrize(("number", "extra"), [(1, False), (2, False), (3, True)])
def test_loaded_whole_in_one_process(run: Run, number: int, extra: bool) -> None:
    loaded = sp.load(run.root / f"step-{number}")
    _assert_exact(loaded, expected_state(number, extra), f"step-{number}")


def test_cli_verify(run: Run) -> None:
    cli = Path(sys.executable).with_name("shardpoint")
    if cli.exists():  # the console script, run with the shardpoint this test imported
        cmd = [str(cli)]
    else:
        cmd = [sys.executable, "-c", "import sys; from shardpoint._cli.main import main; sys.exit(main())"]
    done = subprocess.run(
        [*cmd, "verify", str(run.root / "step-2")],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ranks_saw_their_host_names(run: Run) -> None:
    if UNSHARE_PROBLEM is not None:
        pytest.skip(f"ranks ran on this host's own name: {UNSHARE_PROBLEM}")
    for world, outs in ((SAVE_WORLD, run.saves), (LOAD_WORLD, run.loads)):
        for rank, out in outs.items():
            assert out["host"] == _host(rank, world), (world, rank, out["host"])
    assert len({out["host"] for out in run.saves.values()}) == SAVE_WORLD // RANKS_PER_HOST


def test_plan_reused(run: Run) -> None:
    """Last: save 1 plans, save 2 (same structure) reuses the plan, save 3 (one more tensor)
    replans, on every rank."""
    got: dict[str, dict[str, list[int]]] = {}  # save -> repr(plan_reused) -> ranks
    for rank, out in sorted(run.saves.items()):
        for number, info in out["saves"].items():
            got.setdefault(number, {}).setdefault(repr(info["plan_reused"]), []).append(rank)
    everyone = list(range(SAVE_WORLD))
    want = {"1": {"False": everyone}, "2": {"True": everyone}, "3": {"False": everyone}}
    missing = "" if "'missing'" not in str(got) else " ('missing': SaveInfo has no plan_reused)"
    assert got == want, f"SaveInfo.plan_reused: save -> value -> ranks{missing}: {got}"
