"""CheckpointManager under SIGKILL, and its rules: retention, ``latest``, leftovers, errors.

The crash test: a helper process (this file run as a script) imports torch and shardpoint
once, then for each round forks a child that resumes with ``mgr.restore(...)`` and runs a
``CheckpointManager(root, keep_last=2, async_save=True)`` loop, saving a small model and
its Adam state (multi-shard) at every step. Every value of step ``s`` is a known function
of ``s``, so any step can be checked bit for bit. The child reports on its stdout (a pipe
the helper reads) the step it restored, each step it starts saving, and each step it knows
committed. The helper SIGKILLs it (``os.kill(pid, SIGKILL)``) after a seeded random delay;
the test then checks the root with a fresh manager: ``restore`` gives the newest committed
step, no older than the last one the child reported, its content is exactly that step's,
every listed step loads exactly, and nothing half-written is listed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _helper_process import HelperProcess
from shardpoint import _async as sp_async
from shardpoint._io import files as sp_files
from shardpoint._storage.local import marker_name

# ------------------------------------------------------------------------- the training state

LAYERS = 4
WIDTH = 256  # crash test: each weight 262 kB; 3.2 MB in all with Adam's two moments
MAX_SHARD = "300KB"  # model: 4 files, optimizer: 8
SMALL = 64  # unit tests: the same layout 16 times smaller
FAST = {"max_shard_size": "20KB", "durable": False}  # fsync is not what the unit tests check


def build(width: int = WIDTH) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A fresh model, its Adam (state created) and the state dict the manager saves."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg, exp_avg_sq and step for every parameter
    opt.zero_grad(set_to_none=True)
    return model, opt, {"model": model, "optim": opt, "step": -1}


def pattern(shape: torch.Size, salt: int, step: int) -> torch.Tensor:
    """Exact float32 integers below 2**24, distinct per tensor and per step."""
    values = torch.arange(math.prod(shape), dtype=torch.int64).mul_(2 * salt + 1)
    values.add_(step * 7919 + salt * 104729).bitwise_and_((1 << 24) - 1)
    return values.to(torch.float32).reshape(shape)


def fill(
    model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any], step: int
) -> None:
    """Set every saved value to the one of ``step``."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(pattern(p.shape, i, step))
            st = opt.state[p]
            st["exp_avg"].copy_(pattern(p.shape, 100 + i, step))
            st["exp_avg_sq"].copy_(pattern(p.shape, 200 + i, step))
            st["step"].fill_(float(step))
    opt.param_groups[0]["lr"] = 1.0 / (step + 1)
    state["step"] = step


def mismatch(
    model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any], step: int
) -> str | None:
    """None if every value is exactly the one of ``step``, else what differs."""
    if state["step"] != step:
        return f"state['step'] is {state['step']!r}, not {step}"
    if opt.param_groups[0]["lr"] != 1.0 / (step + 1):
        return f"lr is {opt.param_groups[0]['lr']!r}, not that of step {step}"
    for i, (name, p) in enumerate(model.named_parameters()):
        expected = {
            name: (p, i),
            f"exp_avg of {name}": (opt.state[p]["exp_avg"], 100 + i),
            f"exp_avg_sq of {name}": (opt.state[p]["exp_avg_sq"], 200 + i),
        }
        for label, (tensor, salt) in expected.items():
            if not torch.equal(tensor.detach(), pattern(p.shape, salt, step)):
                return f"{label} is not that of step {step}"
        if not torch.equal(opt.state[p]["step"], torch.tensor(float(step))):
            return f"Adam step of {name} is {opt.state[p]['step']!r}, not {step}"
    return None


# ------------------------------------------------------------------- the child and its helper


def _report(line: str) -> None:
    os.write(1, (line + "\n").encode())  # unbuffered: every line is in the pipe before a kill


def _child_main(root: str, max_seconds: float) -> None:
    """Resume from the newest committed step, then save every step until killed."""
    model, opt, state = build()
    mgr = sp.CheckpointManager(root, keep_last=2, async_save=True, max_shard_size=MAX_SHARD)
    restored = mgr.restore(state)
    if restored is not None and (problem := mismatch(model, opt, state, restored)):
        raise AssertionError(f"restored step {restored}: {problem}")
    _report(f"restored {restored}")
    step = 0 if restored is None else restored + 1
    previous = None
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:  # a guard only: the helper kills us long before
        fill(model, opt, state, step)  # the previous step may still be being written
        _report(f"saving {step}")
        mgr.save(step, state)  # returns once `step` is staged; `previous` is committed
        if previous is not None:
            _report(f"committed {previous}")
        previous, step = step, step + 1
    mgr.wait()


def _run_round(cmd: dict[str, Any]) -> dict[str, Any]:
    """Fork a child, kill it after ``cmd['after']`` seconds, return its stdout and status."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the helper's loop
        code = 1
        try:
            os.close(read_fd)
            os.dup2(write_fd, 1)
            os.close(write_fd)
            _child_main(cmd["root"], max_seconds=60.0)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + cmd["after"]
    status: int | None = None
    while (left := deadline - time.monotonic()) > 0:  # drain stdout while the child runs
        ready, _, _ = select.select([read_fd], [], [], left)
        if ready:
            data = os.read(read_fd, 65536)
            if not data:  # it closed stdout: it exited on its own
                break
            chunks.append(data)
    done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        os.kill(pid, signal.SIGKILL)  # not reaped yet, so the pid is still this child
        status = os.waitpid(pid, 0)[1]
    while data := os.read(read_fd, 65536):
        chunks.append(data)
    os.close(read_fd)
    return {
        "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "stdout": b"".join(chunks).decode(),
    }


def _helper_main() -> None:
    """Serve rounds: one JSON command per stdin line, one JSON reply per line."""
    torch.set_num_threads(1)  # no intra-op thread pool, so fork() is safe
    build()  # the first optimizer step imports a lot lazily (~1 s): do it once, here
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(_run_round(json.loads(line))) + "\n")
    replies.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torch


class Helper(HelperProcess):
    """The helper process, driven one round at a time."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(__file__, workdir)
        assert self.reply() == {"ready": True}

    def run_and_kill(self, root: Path, after: float) -> dict[str, Any]:
        reply = self.call({"root": str(root), "after": after})
        if not reply["killed"]:
            raise AssertionError(
                f"the child was not killed but ended ({reply}):\n{self.log.read_text()[-4000:]}"
            )
        return reply


@pytest.fixture
def helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helper]:
    h = Helper(tmp_path_factory.mktemp("manager-crash-helper"))
    try:
        yield h
    finally:
        h.close()


# ----------------------------------------------------------------------------------- checks


def _parse(stdout: str) -> dict[str, Any]:
    out: dict[str, Any] = {"restored": "unreported", "saving": [], "committed": []}
    for line in stdout.splitlines():
        word, value = line.split(" ", 1)
        if word == "restored":
            out["restored"] = None if value == "None" else int(value)
        else:
            out[word].append(int(value))
    return out


def _tmp_entries(root: Path) -> set[str]:
    return (
        {n for n in os.listdir(root) if n.startswith(".") and ".tmp-" in n}
        if root.is_dir()
        else set()
    )


def _check_root(root: Path, *, at_least: int | None, at_most: int | None, where: str) -> int | None:
    """What a fresh manager sees in ``root`` is whole; return the step ``restore`` gives."""
    mgr = sp.CheckpointManager(root)
    steps = mgr.steps()
    if root.is_dir():
        for name in os.listdir(root):
            hidden_tmp = name.startswith(".") and ".tmp-" in name
            committed = name in {f"step-{s:06d}" for s in steps}
            assert hidden_tmp or committed or name in ("latest", ".shardpoint-writer.lock"), (
                f"{where}: unexpected entry {name!r} in the root"
            )
    assert len(steps) <= 3, (
        f"{where}: keep_last=2 left {steps}"
    )  # 3 only between commit and retention
    model, opt, state = build()
    got = mgr.restore(state)
    assert got == (steps[-1] if steps else None), f"{where}: restore gave {got}, steps are {steps}"
    assert mgr.latest_step() == got, where
    if at_least is not None:
        assert got is not None and got >= at_least, (
            f"{where}: restored {got}, but step {at_least} was reported committed"
        )
    if got is not None:
        assert at_most is not None and got <= at_most, (
            f"{where}: restored {got}, the newest step begun is {at_most}"
        )
        problem = mismatch(model, opt, state, got)
        assert problem is None, f"{where}: step {got}: {problem}"
    for s in steps[:-1]:
        model, opt, state = build()
        assert mgr.restore(state, step=s) == s
        problem = mismatch(model, opt, state, s)
        assert problem is None, f"{where}: step {s}: {problem}"
    return got


# -------------------------------------------------------------------------------- crash test

KILLS = 22
MAX_DELAY = 0.6  # seconds after the fork: restore, then several async saves (~0.03-0.2 s each)


def test_sigkill_at_random_moments_always_resumes_from_a_whole_step(
    helper: Helper, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    rng = random.Random(20240611)
    reported: int | None = None  # the newest step any child reported committed
    begun: int | None = None  # the newest step any child began to save
    newest: int | None = None  # what the root held after the previous kill
    mid_save_kills = cleaned = 0
    log = []
    for k in range(KILLS):
        where = f"kill {k + 1}/{KILLS}"
        stale = _tmp_entries(root)
        after = rng.uniform(0.0, MAX_DELAY)
        reply = helper.run_and_kill(root, after)
        seen = _parse(reply["stdout"])
        if seen["restored"] != "unreported":  # the child resumed exactly where the last one stopped
            assert seen["restored"] == newest, (
                f"{where}: the child restored {seen['restored']}, the root held {newest}"
            )
        if seen["committed"]:
            assert seen["committed"] == sorted(seen["committed"]), where
            reported = max(seen["committed"])
        if seen["saving"]:
            begun = max(seen["saving"]) if begun is None else max(begun, *seen["saving"])
        if len(seen["saving"]) >= 2:  # its first save ran, and removed the leftovers
            assert not (stale & _tmp_entries(root)), (
                f"{where}: leftovers {stale & _tmp_entries(root)} survived a save"
            )
            cleaned += bool(stale)
        newest = _check_root(root, at_least=reported, at_most=begun, where=where)
        mid_save_kills += bool(_tmp_entries(root) - stale)
        last_line = reply["stdout"].splitlines()[-1:] or ["(nothing)"]
        log.append(
            f"{where}: after {after * 1e3:4.0f} ms, last said {last_line[0]!r}; root holds {newest}"
        )

    log.append(
        f"{mid_save_kills} kills left a half-written save; {cleaned} times the next child removed leftovers"
    )
    summary = "\n".join(log)
    print(summary)  # shown with -rP or on failure
    # The run made progress across the kills, and they landed in the middle of saves.
    assert newest is not None and newest >= 4, summary  # (~1 step per kill on a busy 2-core VM)
    files = sorted(p.name for p in (root / f"step-{newest:06d}").glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)] + [
        f"optim-{i:05d}-of-00008.safetensors" for i in range(1, 9)
    ], files
    assert mid_save_kills >= 3, f"only {mid_save_kills} kills left a save half-written:\n{summary}"
    assert cleaned >= 1, summary


# -------------------------------------------------------------------------------- unit tests


@pytest.fixture(autouse=True)
def _no_async_failure_leaks() -> Iterator[None]:
    """A failed async save left unseen would be raised by another test's next save."""
    yield
    last = sp_async.default_queue().last
    if last is not None:
        last.exception()
        last.observed = True


def _save_steps(
    mgr: sp.CheckpointManager, steps: list[int], metrics: dict[int, float] | None = None
) -> None:
    model, opt, state = build(SMALL)
    for s in steps:
        fill(model, opt, state, s)
        mgr.save(s, state, metrics={"loss": metrics[s]} if metrics else None)
    mgr.wait()


def _restored(root: Path, step: int | None = None) -> int | None:
    """Restore into a fresh small state with a fresh manager; check the content exactly."""
    model, opt, state = build(SMALL)
    got = sp.CheckpointManager(root).restore(state, step=step)
    if got is not None:
        problem = mismatch(model, opt, state, got)
        assert problem is None, problem
    return got


LOSSES = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.6, 5: 0.7, 6: 0.8}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_retention_keeps_the_best_and_the_latest(
    tmp_path: Path, async_save: bool, mode: str
) -> None:
    sign = 1 if mode == "min" else -1  # step 2 is the best either way
    mgr = sp.CheckpointManager(
        tmp_path, keep_last=2, keep_best=1, metric="loss", mode=mode, async_save=async_save, **FAST
    )
    expected = {1: [1], 2: [1, 2], 3: [2, 3], 4: [2, 3, 4], 5: [2, 4, 5], 6: [2, 5, 6]}
    model, opt, state = build(SMALL)
    for s, loss in LOSSES.items():
        fill(model, opt, state, s)
        mgr.save(s, state, metrics={"loss": sign * loss})
        mgr.wait()
        assert mgr.steps() == expected[s]
        assert mgr.latest_step() == s
        assert (tmp_path / "latest").read_text() == f"step-{s:06d}\n"
    assert mgr.best_steps() == [2, 5, 6]
    assert mgr.metrics(2) == {"loss": sign * 0.1}
    assert _restored(tmp_path) == 6
    assert _restored(tmp_path, step=2) == 2
    assert _tmp_entries(tmp_path) == set()


def test_retention_with_keep_last_1_nan_and_tensor_metrics(tmp_path: Path) -> None:
    mgr = sp.CheckpointManager(tmp_path, keep_last=1, keep_best=1, metric="loss", **FAST)
    model, opt, state = build(SMALL)
    metrics: dict[int, Any] = {1: 0.1, 2: torch.tensor(0.05), 3: float("nan"), 4: 0.9, 5: 0.95}
    for s, loss in metrics.items():
        fill(model, opt, state, s)
        mgr.save(s, state, metrics={"loss": loss})
        if s == 3:
            assert mgr.steps() == [2, 3]  # a diverged step is saved; the best and the latest kept
            assert math.isnan(mgr.metrics(3)["loss"])
    assert mgr.steps() == [2, 5]  # 2 is the best (a tensor metric), 5 the latest
    assert mgr.metrics(2) == {"loss": pytest.approx(0.05)}
    with pytest.raises(sp.InvalidStateError, match="JSON"):
        mgr.save(6, state, metrics={"loss": torch.ones(2)})
    assert mgr.steps() == [2, 5]
    assert _restored(tmp_path) == 5


def test_retention_cut_short_by_a_crash_is_finished_by_the_next_save(tmp_path: Path) -> None:
    # Steps 1-4 committed, as after crashes between each commit and its retention.
    _save_steps(sp.CheckpointManager(tmp_path, **FAST), [1, 2, 3, 4])
    mgr = sp.CheckpointManager(tmp_path, keep_last=2, async_save=True, **FAST)
    assert mgr.steps() == [1, 2, 3, 4]  # listing and restoring delete nothing
    assert _restored(tmp_path) == 4
    # The next save trims to keep_last before writing: even when its own write fails.
    _block_step(tmp_path, 5)
    model, opt, state = build(SMALL)
    fill(model, opt, state, 5)
    with pytest.raises(sp.CheckpointExistsError):
        mgr.save(5, state).result()  # type: ignore[union-attr]
    assert mgr.steps() == [3, 4]
    (tmp_path / "step-000005").unlink()
    mgr.save(5, state)
    mgr.wait()
    assert mgr.steps() == [4, 5]
    assert _restored(tmp_path) == 5


@pytest.mark.parametrize(
    "latest",
    [
        b"",
        b"step-",
        b"step-0000",
        b"\x00\xff\xfe garbage\n",
        b"step-000099\n",
        b"step-000000\n",
        None,
    ],
    ids=[
        "empty",
        "torn-name",
        "torn-to-step-0",
        "binary",
        "missing-step",
        "older-step",
        "a-directory",
    ],
)
def test_torn_or_garbage_latest_is_ignored(tmp_path: Path, latest: bytes | None) -> None:
    mgr = sp.CheckpointManager(tmp_path, **FAST)
    _save_steps(mgr, [0, 3])  # "step-0000" (torn "step-000003") names the committed step 0
    (tmp_path / "latest").unlink()
    if latest is None:
        (tmp_path / "latest").mkdir()
    else:
        (tmp_path / "latest").write_bytes(latest)

    fresh = sp.CheckpointManager(tmp_path, **FAST)
    assert fresh.steps() == [0, 3]
    assert fresh.latest_step() == 3
    assert _restored(tmp_path) == 3
    if latest is not None:  # the next save rewrites it
        _save_steps(fresh, [4])
        assert (tmp_path / "latest").read_text() == "step-000004\n"
        assert _restored(tmp_path) == 4


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_stale_temp_dirs_are_ignored_by_restore_and_removed_by_the_next_save(
    tmp_path: Path, async_save: bool
) -> None:
    mgr = sp.CheckpointManager(tmp_path, async_save=async_save, **FAST)
    _save_steps(mgr, [1, 2, 3])
    # A crashed save of step 5 that had written everything, manifest included, but was
    # never renamed into place; a half-deleted step; a crashed update of `latest`.
    stale_save = tmp_path / ".step-000005.tmp-0123456789abcdef0123456789abcdef"
    model, opt, state = build(SMALL)
    fill(model, opt, state, 5)
    sp.save(state, stale_save, **FAST)
    (stale_save / marker_name(str(stale_save))).write_bytes(b"")  # as a save marks its temp dir
    assert (stale_save / "shardpoint.json").is_file()
    half_deleted = tmp_path / ".step-000002.tmp-del-feedface"
    half_deleted.mkdir()
    (half_deleted / "model-00001-of-00004.safetensors").write_bytes(b"\x00" * 100)
    (tmp_path / ".latest.tmp-cafe").write_bytes(b"step-0000")

    fresh = sp.CheckpointManager(tmp_path, async_save=async_save, **FAST)
    assert fresh.steps() == [1, 2, 3]
    assert fresh.latest_step() == 3
    assert _restored(tmp_path) == 3
    with pytest.raises(sp.CheckpointError, match="no committed step 5"):
        fresh.restore(build(SMALL)[2], step=5)
    assert len(_tmp_entries(tmp_path)) == 3  # restore only reads

    _save_steps(fresh, [4])
    assert _tmp_entries(tmp_path) == set()
    assert fresh.steps() == [1, 2, 3, 4]
    assert _restored(tmp_path) == 4


def test_restore_on_an_empty_root_returns_none(tmp_path: Path) -> None:
    for root in (tmp_path / "never-created", tmp_path):
        mgr = sp.CheckpointManager(root, keep_last=2, async_save=True)
        model, _, state = build(SMALL)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert mgr.restore(state) is None
        assert mgr.latest_step() is None and mgr.steps() == []
        assert state["step"] == -1 and all(
            torch.equal(v, before[k]) for k, v in model.state_dict().items()
        )
    assert not (tmp_path / "never-created").exists()  # restore creates nothing
    # A root holding only junk and leftovers has no step either.
    (tmp_path / "step-000007").mkdir()  # no manifest: not a committed step
    (tmp_path / ".step-000008.tmp-abc").mkdir()
    (tmp_path / "latest").write_text("step-000007\n")
    assert sp.CheckpointManager(tmp_path).restore(build(SMALL)[2]) is None


def _block_step(root: Path, step: int) -> bytes:
    """Put a plain file where ``step`` would go: a real save error, even with overwrite."""
    obstacle = root / f"step-{step:06d}"
    obstacle.write_bytes(b"not a checkpoint")
    return obstacle.read_bytes()


def test_async_error_surfaces_on_result_and_nothing_is_committed(tmp_path: Path) -> None:
    mgr = sp.CheckpointManager(tmp_path, keep_last=2, async_save=True, **FAST)
    _save_steps(mgr, [1])
    content = _block_step(tmp_path, 2)
    model, opt, state = build(SMALL)
    fill(model, opt, state, 2)
    handle = mgr.save(2, state)
    assert isinstance(handle, sp.AsyncSave)
    with pytest.raises(
        sp.CheckpointExistsError, match=r"step-000002 exists and is not a shardpoint checkpoint"
    ):
        handle.result()
    assert handle.done()
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    assert (tmp_path / "latest").read_text() == "step-000001\n"
    assert (tmp_path / "step-000002").read_bytes() == content
    assert _tmp_entries(tmp_path) == set()
    # Seen through the handle: the next save does not raise it again, and commits.
    fill(model, opt, state, 3)
    mgr.save(3, state)
    mgr.wait()
    assert mgr.steps() == [1, 3]
    assert _restored(tmp_path) == 3


def test_unseen_async_error_is_raised_by_the_next_save_which_saves_nothing(tmp_path: Path) -> None:
    mgr = sp.CheckpointManager(tmp_path, keep_last=2, async_save=True, **FAST)
    _save_steps(mgr, [1])
    _block_step(tmp_path, 2)
    model, opt, state = build(SMALL)
    fill(model, opt, state, 2)
    handle = mgr.save(2, state)  # never looked at
    fill(model, opt, state, 3)
    with pytest.raises(
        sp.CheckpointError,
        match=r"async save of step 2 .* failed; nothing was committed for it: .*step-000002 exists.* Step 3 was not saved either",
    ) as info:
        mgr.save(3, state)
    assert isinstance(info.value.__cause__, sp.CheckpointExistsError)
    assert isinstance(handle.exception(), sp.CheckpointExistsError)
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    assert not (tmp_path / "step-000003").exists()
    assert _tmp_entries(tmp_path) == set()
    mgr.wait()  # raised once already: not again
    # The error was raised once; the manager goes on.
    fill(model, opt, state, 4)
    mgr.save(4, state)
    mgr.wait()
    assert mgr.steps() == [1, 4]
    assert _restored(tmp_path) == 4


class _DiskFillsUp:
    """Stands in for the pwrite loop of the writer: the first ``room`` writes land on disk,
    then the disk is full (ENOSPC), after ``delay`` seconds (a slow disk failing late)."""

    def __init__(self, room: int, delay: float = 0.0) -> None:
        self.room, self.delay = room, delay
        self.real = sp_files._pwrite_all
        self.lock = threading.Lock()

    def __call__(self, fd: int, view: memoryview, offset: int) -> None:
        with self.lock:
            self.room -= 1
            full = self.room < 0
        if not full:
            return self.real(fd, view, offset)
        threading.Event().wait(self.delay)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_async_error_in_the_middle_of_writing_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = sp.CheckpointManager(tmp_path, keep_last=2, async_save=True, **FAST)
    _save_steps(mgr, [1])
    disk = _DiskFillsUp(room=3)
    monkeypatch.setattr(sp_files, "_pwrite_all", disk)
    model, opt, state = build(SMALL)
    fill(model, opt, state, 2)
    handle = mgr.save(2, state)
    with pytest.raises(OSError, match="No space left on device") as info:
        handle.result()
    assert info.value.errno == errno.ENOSPC and disk.room < 0  # failed after writing some
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    assert _tmp_entries(tmp_path) == set()  # the half-written temp dir was removed
    assert _restored(tmp_path) == 1

    # The same through a bare async_save whose error nobody looks at, on a disk that takes
    # a while to fail: the next sp.save, called at once, waits for it, raises it, and
    # writes nothing.
    monkeypatch.setattr(sp_files, "_pwrite_all", _DiskFillsUp(room=3, delay=0.3))
    sp.async_save(state, tmp_path / "bare")
    with pytest.raises(
        sp.CheckpointError,
        match=r"previous async save to .*bare failed and nothing was committed there: .*No space left",
    ):
        sp.save(state, tmp_path / "other")
    assert not (tmp_path / "bare").exists() and not (tmp_path / "other").exists()
    monkeypatch.undo()
    sp.save(state, tmp_path / "other")  # raised once; then saves work again
    assert sp.load(tmp_path / "other")["step"] == 2



def test_an_async_error_after_a_timed_out_or_interrupted_wait_is_still_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll (result(timeout=0)) or a Ctrl-C in wait() is not seeing the outcome: they had
    made a later failure pass without a word (wait() returned, step 2 silently missing), and
    a Ctrl-C in wait() made the manager forget its pending save (restore() then read step 1
    while step 2 was still being written)."""
    mgr = sp.CheckpointManager(tmp_path / "run", async_save=True, **FAST)
    _save_steps(mgr, [1])
    real_write = sp_files._pwrite_all
    monkeypatch.setattr(sp_files, "_pwrite_all", _DiskFillsUp(room=3, delay=0.5))
    model, opt, state = build(SMALL)
    fill(model, opt, state, 2)
    handle = mgr.save(2, state)
    with pytest.raises(TimeoutError):
        handle.result(timeout=0)
    with pytest.raises(OSError, match="No space left on device"):
        mgr.wait()
    assert mgr.steps() == [1]

    handle = sp.async_save(state, tmp_path / "bare")
    with pytest.raises(TimeoutError):
        handle.result(timeout=0)
    with pytest.raises(sp.PreviousSaveFailedError,
                       match=r"previous async save to .*bare failed and nothing was committed there: .*No space"):
        sp.save(state, tmp_path / "other")


    gate = threading.Event()

    def slow(fd: int, view: memoryview, offset: int) -> None:
        gate.wait(60)
        real_write(fd, view, offset)

    monkeypatch.setattr(sp_files, "_pwrite_all", slow)
    mgr.save(3, state)
    # A Ctrl-C, raised as Python raises it (a run started in the background may ignore SIGINT),
    # sent to the waiting thread itself: a signal the kernel hands to another thread of the
    # process does not wake a lock wait.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.1, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert mgr.steps() == [1]  # still being written
    gate.set()
    mgr.wait()  # waits for it again, not forgotten
    assert mgr.steps() == [1, 3]


# ------------------------------------------------------------------ damage and company


def _tiny(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8,), value)}


@pytest.mark.parametrize("damage", ["truncated", "deeply-nested", "huge"])
def test_a_damaged_old_step_is_named_skipped_and_saves_go_on(tmp_path: Path, damage: str) -> None:
    """keep_best/metric: an old step whose manifest is damaged no longer stops every save.
    It is named in a warning, never chosen as best and never deleted by retention."""
    mgr = sp.CheckpointManager(tmp_path, keep_last=1, keep_best=1, metric="loss", durable=False)
    mgr.save(1, _tiny(1.0), metrics={"loss": 0.1})  # the best loss, then damaged
    mgr.save(2, _tiny(2.0), metrics={"loss": 0.5})
    manifest = tmp_path / "step-000001" / "shardpoint.json"
    if damage == "truncated":
        manifest.write_bytes(manifest.read_bytes()[:40])
    elif damage == "deeply-nested":
        manifest.write_text('{"metadata": {"metrics": ' + "[" * 100_000 + "]" * 100_000 + "}}")
    else:
        with open(manifest, "r+b") as f:
            f.truncate(4 << 30)  # sparse: never read into memory
    with pytest.raises(sp.CorruptCheckpointError, match=r"step-000001/shardpoint.json: cannot read the step's metrics"):
        mgr.metrics(1)
    for step in (3, 4):
        with pytest.warns(UserWarning, match=r"step 1 under .* is damaged and is skipped \(never chosen as best, never deleted by retention\)"):
            mgr.save(step, _tiny(float(step)), metrics={"loss": 1.0 / step})
    assert mgr.steps() == [1, 4]  # 2 and 3 retired; the damaged step 1 kept, not counted
    with pytest.warns(UserWarning, match=r"step 1 under"):
        assert mgr.best_steps() == [4]
    target = _tiny(0.0)
    assert mgr.restore(target) == 4 and torch.equal(target["w"], torch.full((8,), 4.0))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "sparse-2GiB", "directory"])
def test_a_latest_that_is_no_small_regular_file_is_ignored(tmp_path: Path, kind: str) -> None:
    """``latest`` as a FIFO (would block an open), a symlink to /dev/zero (endless), a 2 GiB
    sparse file (4 GB to decode) or a directory: never waited on or read, latest_step()
    falls back to the scan, within a second and without memory."""
    mgr = sp.CheckpointManager(tmp_path, durable=False)
    mgr.save(1, _tiny(1.0))
    mgr.save(2, _tiny(2.0))
    latest = tmp_path / "latest"
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)
    elif kind == "dev-zero":
        latest.symlink_to("/dev/zero")
    elif kind == "sparse-2GiB":
        with open(latest, "wb") as f:
            f.truncate(2 << 30)
    else:
        latest.mkdir()
    results: list[Any] = []

    def query() -> None:
        fresh = sp.CheckpointManager(tmp_path)
        target = _tiny(0.0)
        results.extend([fresh.latest_step(), fresh.restore(target), target["w"][0].item()])

    started = time.monotonic()
    worker = threading.Thread(target=query, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), f"latest as {kind} hangs latest_step()/restore()"
    assert results == [2, 2, 2.0]
    assert time.monotonic() - started < 10


def test_no_renameat2_resave_killed_between_the_renames_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, the state a kill between the two renames leaves (old step moved aside,
    the finished new copy in its temp dir): the manager puts the old copy back when
    constructed, on steps(), restore() and save(); it never deletes a whole copy."""
    from shardpoint._storage import posix as sp_posix

    monkeypatch.setattr(sp_posix, "_renameat2", None)
    real = os.rename

    class Killed(BaseException):
        pass

    def die_after_moving_aside(src: Any, dst: Any) -> None:
        real(src, dst)
        if ".tmp-old-" in os.fspath(dst):
            raise Killed  # stands for the SIGKILL of test_overwrite's process test

    for entry_point in ("constructor", "steps", "restore", "save"):
        root = tmp_path / entry_point
        mgr = sp.CheckpointManager(root, keep_last=1, durable=False)
        mgr.save(1, _tiny(1.0))
        monkeypatch.setattr(os, "rename", die_after_moving_aside)
        with pytest.raises(Killed):
            mgr.save(1, _tiny(2.0))
        monkeypatch.setattr(os, "rename", real)
        left = sorted(_tmp_entries(root))  # (the new copy's temp dir was aborted in process)
        assert not (root / "step-000001").exists() and [n for n in left if ".tmp-old-" in n], left
        if entry_point == "constructor":
            sp.CheckpointManager(root)
        elif entry_point == "steps":
            assert mgr.steps() == [1]
        elif entry_point == "restore":
            target = _tiny(0.0)
            assert mgr.restore(target) == 1 and target["w"][0].item() == 1.0
        else:
            mgr.save(2, _tiny(3.0))
        steps = [1] if entry_point != "save" else [2]
        assert sp.CheckpointManager(root).steps() == steps, entry_point
        if entry_point != "save":
            assert sp.load(root / "step-000001")["w"][0].item() == 1.0


if __name__ == "__main__" and sys.argv[1:] == ["helper"]:
    _helper_main()


def test_an_unchanged_step_manifest_is_parsed_once_per_manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save ranks and retires steps from their metrics: a step's manifest (15 MB for
    10^5 tensors) is parsed once per manager while it stays the same file, and again once it
    changes (a re-save of the step, or damage)."""
    mgr = sp.CheckpointManager(tmp_path, keep_last=3, keep_best=1, metric="loss", durable=False)
    parsed: list[int] = []
    parse = mgr._parse_metrics

    def counting(step: int) -> dict[str, Any]:
        parsed.append(step)
        return parse(step)

    monkeypatch.setattr(mgr, "_parse_metrics", counting)
    for step in (1, 2, 3, 4):
        mgr.save(step, _tiny(float(step)), metrics={"loss": 1.0 / step})
    assert sorted(set(parsed)) == [1, 2, 3, 4] and len(parsed) == 4
    mgr.save(4, _tiny(9.0), metrics={"loss": 0.01})  # a re-save: step 4 is another file now
    assert parsed.count(4) == 2 and mgr.metrics(4) == {"loss": 0.01}


def test_another_tools_latest_file_is_refused_before_a_save_writes_anything(tmp_path: Path) -> None:
    """DeepSpeed's latest (naming its global_stepN folder) was replaced by the manager's
    without a word, so DeepSpeed's load_checkpoint(root) then looked for step-000001."""
    (tmp_path / "global_step100").mkdir()
    latest = tmp_path / "latest"
    latest.write_text("global_step100")
    mgr = sp.CheckpointManager(tmp_path, durable=False)
    assert mgr.restore(_tiny(0.0)) is None
    with pytest.raises(sp.InvalidArgumentError) as exc:
        mgr.save(1, _tiny(1.0))
    assert str(exc.value) == (
        f"{latest} names 'global_step100', not a step of a CheckpointManager (step-NNNNNN): it is another tool's "
        "(DeepSpeed writes one naming its global_stepN folder), and a save would replace it. Give the manager a "
        "root of its own; nothing was written"
    )
    assert latest.read_text() == "global_step100" and sorted(os.listdir(tmp_path)) == ["global_step100", "latest"]


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_users_latest_is_refused_before_a_save_writes_anything(tmp_path: Path, kind: str) -> None:
    """A folder named latest made every save fail after committing ("check the filesystem"),
    retention a step behind; a user's link latest -> step-N was replaced by a file."""
    mgr = sp.CheckpointManager(tmp_path, durable=False)
    mgr.save(1, _tiny(1.0))
    latest = tmp_path / "latest"
    latest.unlink()
    if kind == "directory":
        latest.mkdir()
    else:
        latest.symlink_to("step-000001")
    with pytest.raises(sp.InvalidArgumentError) as exc:
        mgr.save(2, _tiny(2.0))
    what = "a directory" if kind == "directory" else "a symbolic link"
    assert str(exc.value) == (
        f"{latest} is {what}, not the manager's own 'latest' file (the newest step's name, which every save "
        "replaces): a save would fail after committing, or replace it. Rename or move it, then save again; "
        "nothing was written"
    )
    assert mgr.steps() == [1] and (latest.is_dir() if kind == "directory" else latest.is_symlink())
    target = _tiny(0.0)
    assert mgr.restore(target) == 1  # reads go on, from the scan


def test_a_second_process_saving_into_the_root_is_warned_about(tmp_path: Path) -> None:
    """Every rank of a job running its own manager on one root, with no process_group: each
    step was written by every rank, the last one's copy kept (the other ranks' RNG and data
    position lost), and every rank applied retention, without a word."""
    child = (
        "import sys, time, torch, shardpoint as sp\n"
        "mgr = sp.CheckpointManager(sys.argv[1])\n"
        "mgr.save(1, {'w': torch.zeros(1)})\n"
        "print('saved', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    other = subprocess.Popen([sys.executable, "-c", child, str(tmp_path / "run")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "saved\n"
        mine = sp.CheckpointManager(tmp_path / "run")
        assert mine.restore({"w": torch.ones(1)}) == 1  # restoring takes nothing
        with pytest.warns(UserWarning) as caught:
            mine.save(2, {"w": torch.ones(1)})
        (warning,) = [w for w in caught if "saving into this root too" in str(w.message)]
        assert str(warning.message) == (
            f"CheckpointManager({str(tmp_path / 'run')!r}): pid {other.pid} on {socket.gethostname()} is saving into "
            "this root too. Two managers saving into one root replace each other's steps (each step keeps one "
            "writer's state: another rank's sp.RNGState or data position is lost) and both apply retention: give "
            "each run a root of its own")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mine.save(3, {"w": torch.ones(1)})  # said once
    finally:
        other.communicate("\n", timeout=60)
    with warnings.catch_warnings():  # the other writer is gone: its lock with it
        warnings.simplefilter("error")
        sp.CheckpointManager(tmp_path / "run").save(4, {"w": torch.ones(1)})
        sp.CheckpointManager(tmp_path / "run").save(5, {"w": torch.ones(1)})  # this process holds it now
