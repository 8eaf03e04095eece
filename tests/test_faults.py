"""Faults at every step of a local save, damage on load, and security regressions.

Fault injection (see ``_fault_steps.py``): a dry run records every filesystem call a save
makes under its root (open, pwrite, write, fsync, mkdir, renameat2, rename, replace, unlink,
rmdir, in order), then the fault is walked through each of them in turn:

* an exception at the call: ``OSError(EIO)`` as the kernel would report it (injected at the
  syscall boundary: the ``os`` function, or ``renameat2`` returning -1 with ``errno``) and
  a plain ``RuntimeError``; in this process;
* ``SIGKILL`` at the call, in a child forked by a helper process (this file run as a script);
* ``ENOSPC`` for real, on a 4 MiB tmpfs mounted for the test (skipped where mounting is not
  allowed), with the free space shrunk one page at a time so the disk fills at every file.

After each fault the path holds exactly the previous checkpoint, bit for bit (or, once the
commit's rename has happened, exactly the new one), the half-written save is invisible and
not loadable, no temporary file is left behind (after a kill, or a failed delete, the next
save removes what is left), and the error names its cause (the errno and the file).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _fault_steps import FaultSteps, first_step
from _helper_process import HelperProcess
from shardpoint import _async as sp_async
from shardpoint.errors import (
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingShardError,
    UnsafePickleError,
)

MAX_SHARD = 1000  # bytes: every tensor of the states below gets a file of its own
DELETION = ("unlink ", "rmdir ")


def make_state(version: int) -> dict[str, torch.Tensor]:
    """Three tensors (three files) whose every value is a known function of ``version``."""
    return {
        "a": torch.arange(300, dtype=torch.float32) + 1000 * version,
        "b": torch.arange(256, dtype=torch.int64) * 7 + version,
        "c": (torch.arange(256, dtype=torch.float16) + version) / 4,
    }


def assert_version(loaded: dict[str, torch.Tensor], version: int, where: str) -> None:
    expected = make_state(version)
    assert set(loaded) == set(expected), f"{where}: keys {sorted(loaded)}"
    for key, tensor in expected.items():
        got = loaded[key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), (
            f"{where}: tensor {key!r} is not version {version}"
        )


def loaded_version(path: Path, where: str) -> int:
    """The version ``path`` holds, checking every byte of it (crc32c on, values exact)."""
    state = sp.load(path)
    version = int(state["b"][0].item())
    assert_version(state, version, where)
    return version


def tmp_entries(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".") and ".tmp-" in n)


def assert_invisible(parent: Path, where: str) -> None:
    """Every leftover of an interrupted save refuses to load as a checkpoint."""
    for name in tmp_entries(parent):
        leftover = parent / name
        if leftover.is_dir():
            with pytest.raises(IncompleteCheckpointError, match="never committed"):
                sp.load(leftover)


@pytest.fixture(autouse=True)
def _one_writer_thread(use_options: Any) -> Iterator[None]:
    """The steps of a save come in the same order on every run."""
    use_options(io=sp.IOOptions(write_threads=1))
    yield
    last = sp_async.default_queue().last  # an async failure left unseen must not leak into other tests
    if last is not None:
        last.exception()
        last.observed = True


def dry_run(root: Path, monkeypatch: pytest.MonkeyPatch, run: Callable[[], Any]) -> list[str]:
    """The steps of a fault-free ``run()`` under ``root``."""
    steps = FaultSteps(root)
    with monkeypatch.context() as m:
        steps.install(m.setattr)
        run()
    return steps.steps


def run_with_fault(
    root: Path, monkeypatch: pytest.MonkeyPatch, at: int, action: str, run: Callable[[], Any]
) -> tuple[FaultSteps, BaseException | None]:
    steps = FaultSteps(root, at=at, action=action)
    error: BaseException | None = None
    with monkeypatch.context() as m:
        steps.install(m.setattr)
        try:
            run()
        except Exception as exc:
            error = exc
    return steps, error


def check_error_names_cause(error: BaseException, steps: FaultSteps, action: str, where: str) -> None:
    """The error says what failed: the injected errno and the file (or it is the injected one)."""
    text = str(error)
    if action == "runtime":
        assert "injected failure at step" in text, f"{where}: {error!r}"
        return
    assert isinstance(error, OSError), f"{where}: {error!r}"
    assert isinstance(error, sp.CheckpointError), f"{where}: not a CheckpointError: {error!r}"
    assert error.errno == errno.EIO, f"{where}: {error!r}"
    assert os.strerror(errno.EIO) in text, f"{where}: {text}"
    named = [os.path.basename(p) for p in steps.fired_paths]
    assert any(name in text for name in named), (
        f"{where}: the error does not name the file ({named}): {text}"
    )


# ------------------------------------------------------------- exceptions at every step

SAVE_KINDS = ["first-save", "overwrite", "chunked-overwrite"]


def _save_call(kind: str, path: Path, version: int) -> Callable[[], Any]:
    layout = "chunked" if kind.startswith("chunked") else None
    overwrite = kind != "first-save"
    return lambda: sp.save(
        make_state(version), path, max_shard_size=MAX_SHARD, overwrite=overwrite, layout=layout, progress=False
    )


@pytest.mark.parametrize("action", ["eio", "runtime"])
@pytest.mark.parametrize("kind", SAVE_KINDS)
def test_exception_at_every_step_of_a_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, action: str
) -> None:
    path = tmp_path / "ckpt"
    layout = "chunked" if kind.startswith("chunked") else None
    version = 1
    if kind != "first-save":
        sp.save(make_state(version), path, max_shard_size=MAX_SHARD, layout=layout)
    steps = dry_run(tmp_path, monkeypatch, _save_call(kind, path, version + 1))
    commit = first_step(steps, "renameat2")
    assert {"pwrite", "fsync", "write", "renameat2"} <= {s.split()[0] for s in steps}
    if kind == "first-save":
        shutil.rmtree(path)
    else:
        version += 1
    seen = []
    for at in range(1, len(steps) + 1):
        where = f"{kind}, {action} at step {at}/{len(steps)} ({steps[at - 1]})"
        before = version if kind != "first-save" else None
        fault, error = run_with_fault(tmp_path, monkeypatch, at, action, _save_call(kind, path, version + 1))
        assert fault.fired is not None, f"{where}: the fault never fired (steps: {fault.steps})"
        seen.append(fault.fired.split()[0])
        deleting = is_deletion(fault.fired, at, commit)
        if error is None:
            # Only a best-effort step may fail silently: removing the replaced checkpoint, or
            # creating a parent that already exists.
            assert deleting or (fault.fired.startswith("mkdir ") and at == 1), f"{where}: no error"
        else:
            check_error_names_cause(error, fault, action, where)
        committed = at > commit or error is None
        expect = version + 1 if committed else before
        if expect is None:
            assert not path.exists(), f"{where}: a failed first save left {path}"
        else:
            assert loaded_version(path, where) == expect, where
        if committed:
            version += 1
        assert_invisible(tmp_path, where)
        if not deleting:
            assert tmp_entries(tmp_path) == [], f"{where}: leftovers {tmp_entries(tmp_path)}"
        if kind == "first-save" and path.exists():
            shutil.rmtree(path)
        # Whatever is left, the next save of the path starts clean and leaves nothing behind.
        if kind != "first-save":
            version += 1
            sp.save(make_state(version), path, max_shard_size=MAX_SHARD, overwrite=True, layout=layout)
            assert loaded_version(path, f"{where}, next save") == version
            assert tmp_entries(tmp_path) == [], f"{where}: the next save left {tmp_entries(tmp_path)}"
    assert {"mkdir", "open", "pwrite", "fsync", "write", "renameat2"} <= set(seen), seen


def is_deletion(label: str, at: int, commit: int) -> bool:
    """A step of removing a replaced or retired checkpoint (best effort: a failure there
    leaves a hidden `.tmp-` directory that the next save removes)."""
    return label.startswith(DELETION) or (label.startswith("open ") and at > commit and ".tmp-" in label)


def _manager(root: Path) -> sp.CheckpointManager:
    return sp.CheckpointManager(root, keep_last=2, max_shard_size=MAX_SHARD, progress=False)


@pytest.mark.parametrize("action", ["eio", "runtime"])
def test_exception_at_every_step_of_a_manager_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """Through the commit, the ``latest`` update and retention of the oldest step."""
    dry = tmp_path / "dry"
    for step in (1, 2):
        _manager(dry).save(step, make_state(step))
    steps = dry_run(dry, monkeypatch, lambda: _manager(dry).save(3, make_state(3)))
    commit = first_step(steps, "renameat2")
    latest_replace = first_step(steps, "replace ")
    assert first_step(steps, "rename ") > latest_replace  # retention after `latest`

    seen = []
    for at in range(1, len(steps) + 1):
        where = f"{action} at step {at}/{len(steps)} ({steps[at - 1]})"
        root = tmp_path / f"run{at}"
        for step in (1, 2):
            _manager(root).save(step, make_state(step))
        fault, error = run_with_fault(
            root, monkeypatch, at, action, lambda root=root: _manager(root).save(3, make_state(3))
        )
        assert fault.fired is not None, where
        seen.append(fault.fired.split()[0])
        deleting = is_deletion(fault.fired, at, commit)
        if error is None:  # a deletion, the root made ahead, or the writer lock (a warning's, best effort)
            assert deleting or fault.fired.startswith("mkdir ") or fault.fired.endswith("/.shardpoint-writer.lock"), (
                f"{where}: no error")
        else:
            check_error_names_cause(error, fault, action, where)
        fresh = _manager(root)
        newest = 3 if at > commit or error is None else 2
        assert fresh.latest_step() == newest, where
        assert set(fresh.steps()) <= {1, 2, 3} and {2, newest} <= set(fresh.steps()), where
        assert (root / "latest").read_text() in ("step-000002\n", f"step-{newest:06d}\n"), where
        target = make_state(0)
        assert fresh.restore(target) == newest
        assert_version(target, newest, where)
        assert_invisible(root, where)
        if not deleting:
            assert tmp_entries(root) == [], f"{where}: leftovers {tmp_entries(root)}"
        # The next save finishes what was cut short: leftovers gone, retention applied.
        fresh.save(4, make_state(4))
        assert tmp_entries(root) == [], f"{where}: the next save left {tmp_entries(root)}"
        assert fresh.steps() == [3, 4] if newest == 3 else fresh.steps() == [2, 4], (where, fresh.steps())
        assert (root / "latest").read_text() == "step-000004\n", where
        shutil.rmtree(root)
    assert {"pwrite", "fsync", "write", "renameat2", "replace", "rename", "unlink"} <= set(seen), seen


def test_eio_on_rename_without_renameat2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel lacks renameat2, commit falls back to rename(2): EIO there too."""
    from shardpoint._storage import posix as sp_posix

    path = tmp_path / "ckpt"
    sp.save(make_state(1), path, max_shard_size=MAX_SHARD)
    monkeypatch.setattr(sp_posix, "_renameat2", None)
    steps = dry_run(tmp_path, monkeypatch, _save_call("overwrite", path, 2))
    renames = [i for i, s in enumerate(steps, start=1) if s.startswith("rename ")]
    assert len(renames) == 2, steps  # the old one aside, then the new one into place
    assert loaded_version(path, "dry run") == 2
    version = 2
    for at in renames:
        fault, error = run_with_fault(tmp_path, monkeypatch, at, "eio", _save_call("overwrite", path, version + 1))
        where = f"EIO at {fault.fired}"
        assert error is not None, where
        check_error_names_cause(error, fault, "eio", where)
        # At the second rename the previous checkpoint was already moved aside: it is put back.
        assert loaded_version(path, where) == version
        assert tmp_entries(tmp_path) == [], f"{where}: leftovers {tmp_entries(tmp_path)}"


def test_async_save_fault_commits_nothing_and_surfaces_on_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    sp.save(make_state(1), path, max_shard_size=MAX_SHARD)
    steps = dry_run(tmp_path, monkeypatch, _save_call("overwrite", path, 2))
    manifest_write = next(
        i for i, s in enumerate(steps, start=1) if s.startswith("write ") and s.endswith("shardpoint.json")
    )
    fault = FaultSteps(tmp_path, at=manifest_write, action="eio")
    with monkeypatch.context() as m:
        fault.install(m.setattr)
        handle = sp.async_save(make_state(3), path, max_shard_size=MAX_SHARD, overwrite=True)
        with pytest.raises(OSError, match=r"Input/output error.*shardpoint\.json") as info:
            handle.result()
    assert info.value.errno == errno.EIO
    assert fault.fired is not None and fault.fired.endswith("shardpoint.json")
    assert loaded_version(path, "after the async fault") == 2
    assert tmp_entries(tmp_path) == []


# ------------------------------------------------------------------ SIGKILL at every step


class KillHelper(HelperProcess):
    """A process that imports torch once and forks a child per round (this file as a script)."""

    def __init__(self, workdir: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one writer thread: see _helper_main
        super().__init__(__file__, workdir, env=env)
        assert self.call({"op": "ping"}) == {"pong": True}


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KillHelper]:
    h = KillHelper(tmp_path_factory.mktemp("fault-helper"))
    try:
        yield h
    finally:
        h.close()


def _kill_round(helper: KillHelper, tmp_path: Path, job: dict[str, Any], at: int | None) -> dict[str, Any]:
    trace = tmp_path / "trace.txt"
    outcome = tmp_path / "outcome.json"
    for f in (trace, outcome):
        f.unlink(missing_ok=True)
    reply = helper.call({**job, "at": at, "action": "kill", "trace": str(trace), "outcome": str(outcome)})
    reply["steps"] = trace.read_text().splitlines() if trace.exists() else []
    reply["outcome"] = json.loads(outcome.read_text()) if outcome.exists() else None
    return reply


@pytest.mark.parametrize("layout", ["hf", "chunked"])
def test_sigkill_at_every_step_of_a_save(helper: KillHelper, tmp_path: Path, layout: str) -> None:
    parent = tmp_path / "data"
    parent.mkdir()
    path = parent / "ckpt"
    version = 1
    sp.save(make_state(version), path, max_shard_size=MAX_SHARD, layout=layout)
    job = {"op": "save", "root": str(parent), "path": str(path), "layout": layout}
    dry = _kill_round(helper, tmp_path, {**job, "version": version + 1}, None)
    assert dry["exit"] == 0 and dry["outcome"] == {"ok": True}, dry
    version += 1
    steps = dry["steps"]
    commit = first_step(steps, "renameat2")
    killed_at = []
    for at in range(1, len(steps) + 1):
        where = f"{layout}: SIGKILL at step {at}/{len(steps)} ({steps[at - 1]})"
        reply = _kill_round(helper, tmp_path, {**job, "version": version + 1}, at)
        assert reply["killed"], f"{where}: {reply}"
        killed_at.append(reply["steps"][-1].split()[0])
        expect = version + 1 if at > commit else version
        assert loaded_version(path, where) == expect, where
        version = expect
        assert_invisible(parent, where)
        # The next save removes what the killed one left (its lock died with it).
        version += 1
        sp.save(make_state(version), path, max_shard_size=MAX_SHARD, overwrite=True, layout=layout)
        assert loaded_version(path, f"{where}, next save") == version
        assert tmp_entries(parent) == [], f"{where}: the next save left {tmp_entries(parent)}"
    assert {"mkdir", "open", "pwrite", "fsync", "write", "renameat2", "unlink"} <= set(killed_at), killed_at


def test_sigkill_at_every_step_of_a_manager_save(helper: KillHelper, tmp_path: Path) -> None:
    """Kills during the save, the ``latest`` update (temp file, replace) and retention."""
    dry_root = tmp_path / "dry"
    for step in (1, 2):
        _manager(dry_root).save(step, make_state(step))
    dry = _kill_round(helper, tmp_path, {"op": "manager", "root": str(dry_root), "step": 3}, None)
    assert dry["exit"] == 0 and dry["outcome"] == {"ok": True}, dry
    steps = dry["steps"]
    commit = first_step(steps, "renameat2")
    killed_at = []
    for at in range(1, len(steps) + 1):
        where = f"SIGKILL at step {at}/{len(steps)} ({steps[at - 1]})"
        root = tmp_path / f"run{at}"
        for step in (1, 2):
            _manager(root).save(step, make_state(step))
        reply = _kill_round(helper, tmp_path, {"op": "manager", "root": str(root), "step": 3}, at)
        assert reply["killed"], f"{where}: {reply}"
        killed_at.append(reply["steps"][-1].split()[0])
        fresh = _manager(root)
        newest = 3 if at > commit else 2
        assert fresh.latest_step() == newest, (where, fresh.steps())
        assert set(fresh.steps()) in ({1, 2, 3}, {2, 3}) if newest == 3 else fresh.steps() == [1, 2], where
        target = make_state(0)
        assert fresh.restore(target) == newest, where
        assert_version(target, newest, where)
        assert_invisible(root, where)
        fresh.save(4, make_state(4))
        assert tmp_entries(root) == [], f"{where}: the next save left {tmp_entries(root)}"
        assert fresh.steps() == ([3, 4] if newest == 3 else [2, 4]), (where, fresh.steps())
        assert (root / "latest").read_text() == "step-000004\n", where
        shutil.rmtree(root)
    assert {"pwrite", "write", "fsync", "renameat2", "replace", "rename", "unlink"} <= set(killed_at), killed_at


# ------------------------------------------------------------- two saves of one path at once


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_that_commits_while_another_runs(helper: KillHelper, tmp_path: Path, overwrite: bool) -> None:
    """A stops right before its rename; B saves the same path start to end; A goes on.

    B must leave A's temporary directory alone (A is alive). Then A's rename finds B's
    checkpoint: without ``overwrite`` A fails, naming the path, and B's stays; with it, A
    replaces B's atomically, as asked. Either way one whole checkpoint and no leftovers.
    """
    path = tmp_path / "ckpt"
    reply = helper.call({"op": "race", "path": str(path), "overwrite": overwrite, "versions": [5, 6],
                         "outcomes": [str(tmp_path / "a.json"), str(tmp_path / "b.json")]})
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in ("a", "b"))
    assert reply["paused"], reply
    assert b == {"ok": True}, b
    if overwrite:
        assert a == {"ok": True}, a
        assert loaded_version(path, "after the race") == 5
    else:
        assert a["ok"] is False and a["type"] == "CheckpointExistsError", a
        assert f"{path} was created by someone else while this save ran" in a["message"], a
        assert loaded_version(path, "after the race") == 6
    assert tmp_entries(tmp_path) == []


def test_two_processes_overwriting_the_same_path_leave_one_whole_checkpoint(
    helper: KillHelper, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    sp.save(make_state(1), path, max_shard_size=MAX_SHARD)
    helper.call({"op": "race", "path": str(path), "overwrite": True, "versions": [5, 6],
                 "outcomes": [str(tmp_path / "a.json"), str(tmp_path / "b.json")]})
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in ("a", "b"))
    assert a == {"ok": True} and b == {"ok": True}, (a, b)
    assert loaded_version(path, "after the race") == 5  # A renamed last
    assert tmp_entries(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_saving_at_the_same_moment(helper: KillHelper, tmp_path: Path, overwrite: bool) -> None:
    """Both start together, unsynchronized: never a mix, never a leftover."""
    for attempt in range(3):
        path = tmp_path / f"ckpt{attempt}"
        outcomes = [tmp_path / f"a{attempt}.json", tmp_path / f"b{attempt}.json"]
        helper.call({"op": "free-race", "path": str(path), "overwrite": overwrite, "versions": [7, 8],
                     "outcomes": [str(o) for o in outcomes]})
        a, b = (json.loads(o.read_text()) for o in outcomes)
        winner = loaded_version(path, f"attempt {attempt}")
        assert winner in (7, 8)
        if overwrite:
            assert a == {"ok": True} and b == {"ok": True}, (a, b)
        else:
            loser = a if winner == 8 else b
            assert (a if winner == 7 else b) == {"ok": True}, (a, b)
            assert loser["type"] == "CheckpointExistsError", loser
            assert str(path) in loser["message"], loser
        assert tmp_entries(tmp_path) == [], tmp_entries(tmp_path)


def test_a_checkpoint_committed_between_the_last_check_and_the_rename_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window the same-moment race found: the path appears just after the final check."""
    from shardpoint._storage.local import LocalTransaction

    path = tmp_path / "ckpt"
    real_check = LocalTransaction._check_target
    other_saved = []

    def check_then_lose_the_race(self: LocalTransaction) -> None:
        real_check(self)
        at_commit = hasattr(self, "directory")  # the constructor checks before it makes one
        if self.final == path and at_commit and not other_saved:
            other_saved.append(True)
            monkeypatch.setattr(LocalTransaction, "_check_target", real_check)
            sp.save(make_state(8), path, max_shard_size=MAX_SHARD)  # the other save commits

    monkeypatch.setattr(LocalTransaction, "_check_target", check_then_lose_the_race)
    with pytest.raises(CheckpointExistsError, match="created by someone else"):
        sp.save(make_state(7), path, max_shard_size=MAX_SHARD)
    assert other_saved
    assert loaded_version(path, "the other save's checkpoint") == 8
    assert tmp_entries(tmp_path) == []


def test_stale_temp_directory_of_a_dead_save_is_removed_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sp.save(make_state(1), path, max_shard_size=MAX_SHARD)
    stale = tmp_path / f".ckpt.tmp-{'ab' * 16}"
    shutil.copytree(path, stale)  # a whole save that died just before its rename
    (stale / "model-00001-of-00003.safetensors").write_bytes(b"half")
    other = tmp_path / f".other.tmp-{'cd' * 16}"  # another path's: not ours to touch
    other.mkdir()
    assert loaded_version(path, "with a stale temp dir beside it") == 1
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        sp.load(stale)
    sp.save(make_state(2), path, max_shard_size=MAX_SHARD, overwrite=True)
    assert loaded_version(path, "next save") == 2
    assert tmp_entries(tmp_path) == [other.name]


# --------------------------------------------------------------------- ENOSPC, for real

PAGE = 4096


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs (needs root and a kernel that lets this process mount)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({(done.stderr or done.stdout).strip()}); real ENOSPC is "
            "not tested on this machine, injected ENOSPC/EIO still is"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def free_pages(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // PAGE


def fill_leaving(mnt: Path, pages: int) -> Path:
    """Take all but ``pages`` free pages of the tmpfs with one filler file."""
    filler = mnt / "filler"
    filler.unlink(missing_ok=True)
    take = free_pages(mnt) - pages
    with open(filler, "wb") as f:
        f.write(b"\0" * (take * PAGE))
    assert free_pages(mnt) == pages, (free_pages(mnt), pages)
    return filler


def big_state(version: int) -> dict[str, torch.Tensor]:
    """Three 8 KiB tensors: three data files of three pages each."""
    return {k: torch.full((2048,), float(version + i)) for i, k in enumerate(("a", "b", "c"))}


def test_enospc_at_every_file_of_a_save_on_a_full_tmpfs(small_tmpfs: Path) -> None:
    data = small_tmpfs / "data"
    data.mkdir()
    path = data / "ckpt"
    sp.save(big_state(1), path, max_shard_size=MAX_SHARD)
    failed_on = []
    for pages in range(0, 40):
        fill_leaving(small_tmpfs, pages)
        where = f"{pages} free pages"
        try:
            sp.save(big_state(2), path, max_shard_size=MAX_SHARD, overwrite=True)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, f"{where}: {exc!r}"
            assert isinstance(exc, sp.StorageError), f"{where}: not a StorageError: {exc!r}"
            assert "No space left on device" in str(exc), where
            assert str(exc).endswith(
                "Nothing was committed there by this save: the checkpoint that was there before, "
                "if any, is unchanged, and this save's temporary directory is removed"
            ), f"{where}: {exc}"
            named = re.findall(r"(model[-.][\w.-]*\.(?:safetensors|json)|shardpoint\.json|\.ckpt\.tmp-\w+)", str(exc))
            assert named, f"{where}: the error names no file: {exc}"
            failed_on.append(named[-1])
            assert torch.equal(sp.load(path)["a"], big_state(1)["a"]), where
            assert sp.load(path)["c"][0].item() == 3.0, where
            assert tmp_entries(data) == [], f"{where}: leftovers {tmp_entries(data)}"
            assert free_pages(small_tmpfs) == pages, f"{where}: the failed save kept disk space"
            continue
        assert torch.equal(sp.load(path)["b"], big_state(2)["b"]), where
        assert tmp_entries(data) == []
        break
    else:
        pytest.fail(f"the save never fitted: {failed_on}")
    # The disk filled up in each data file, in the index and in the manifest.
    names = {re.sub(r"\.tmp-\w+", ".tmp-*", n) for n in failed_on}
    assert {
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "shardpoint.json",
    } <= names, failed_on


def test_enospc_during_a_manager_save_and_its_latest_update(small_tmpfs: Path) -> None:
    root = small_tmpfs / "run"
    mgr = sp.CheckpointManager(root, keep_last=2, max_shard_size=MAX_SHARD)
    mgr.save(1, big_state(1))
    mgr.save(2, big_state(2))
    hit_latest = False
    for pages in range(0, 40):
        filler = fill_leaving(small_tmpfs, pages)
        where = f"{pages} free pages"
        try:
            mgr.save(3, big_state(3))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, f"{where}: {exc!r}"
            assert isinstance(exc, sp.StorageError), f"{where}: not a StorageError: {exc!r}"
            fresh = sp.CheckpointManager(root)
            committed = 3 in fresh.steps()
            if committed:  # the step is whole; only the `latest` hint could not be written
                hit_latest = True
                assert ".latest.tmp-" in str(exc), f"{where}: {exc}"
                assert f"Step 3 is committed at {root / 'step-000003'}; 'latest' may still name the step " in str(exc)
                assert (root / "latest").read_text() == "step-000002\n"
            assert fresh.latest_step() == (3 if committed else 2), where
            target = big_state(0)
            assert fresh.restore(target) == fresh.latest_step()
            assert torch.equal(target["a"], big_state(fresh.latest_step() or 0)["a"]), where
            assert tmp_entries(root) == [], f"{where}: leftovers {tmp_entries(root)}"
            if committed:
                break
            assert free_pages(small_tmpfs) == pages, f"{where}: the failed save kept disk space"
            continue
        break
    assert hit_latest, "no amount of free space made exactly the `latest` update fail"
    filler.unlink()
    mgr.save(4, big_state(4))
    assert mgr.steps() == [3, 4] and (root / "latest").read_text() == "step-000004\n"
    assert tmp_entries(root) == []


# ------------------------------------------------------------------------ damage on load


def _saved(tmp_path: Path, name: str = "ckpt", *, layout: str | None = None, version: int = 1) -> Path:
    path = tmp_path / name
    sp.save(make_state(version), path, max_shard_size=MAX_SHARD, layout=layout)
    return path


@pytest.mark.parametrize("layout", ["hf", "chunked"])
def test_zero_length_shard_is_detected_naming_it(tmp_path: Path, layout: str) -> None:
    path = _saved(tmp_path, layout=layout)
    shard = sorted(path.glob("*.safetensors"))[1]
    recorded = shard.stat().st_size
    shard.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{shard} is 0 bytes but the manifest recorded {recorded}")):
        sp.load(path)
    (path / "shardpoint.json").unlink()
    if layout == "hf":  # without a manifest: the header check catches it
        with pytest.raises(CorruptCheckpointError, match=re.escape(f"{shard} is 0 bytes, shorter than")):
            sp.load(path)


def test_manifest_from_another_save_is_detected_naming_a_shard(tmp_path: Path) -> None:
    first = _saved(tmp_path, "first", version=1)
    second = _saved(tmp_path, "second", version=2)  # same names and sizes, other values
    shutil.copy(second / "shardpoint.json", first / "shardpoint.json")
    other = json.loads((second / "shardpoint.json").read_text())["save_id"]
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(str(first))}/model-0000\d-of-00003\.safetensors belongs to another save \(save_id \w+, the manifest says {other}\)"):
        sp.load(first)
    with pytest.raises(CorruptCheckpointError, match="belongs to another save"):
        sp.load_into(make_state(0), first)


@pytest.mark.parametrize("layout", ["hf", "chunked"])
def test_shard_swapped_from_another_save_of_the_same_layout(tmp_path: Path, layout: str) -> None:
    first = _saved(tmp_path, "first", layout=layout, version=1)
    second = _saved(tmp_path, "second", layout=layout, version=2)
    name = sorted(p.name for p in first.glob("*.safetensors"))[-1]
    shutil.copy(second / name, first / name)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{first / name} belongs to another save")):
        sp.load(first)


@pytest.mark.parametrize("layout", ["hf", "chunked"])
def test_every_single_bit_flip_in_a_shard_is_detected_or_harmless(tmp_path: Path, layout: str) -> None:
    """Flip one bit of every byte of every data file, one at a time (bit ``i % 8`` of byte i).

    Each load either fails with a CheckpointError naming that file, or returns exactly the
    saved values: a flip may land in bytes no value depends on (the ``format`` metadata),
    never silently change a value.
    """
    path = _saved(tmp_path, layout=layout)
    detected = 0
    harmless: list[str] = []
    for shard in sorted(path.glob("*.safetensors")):
        original = shard.read_bytes()
        (length,) = struct.unpack("<Q", original[:8])
        meta = re.search(rb'"__metadata__":\{[^}]*\}', original[: 8 + length])
        assert meta is not None
        data_start = 8 + length
        for i in [*range(data_start), *range(data_start, len(original), 7)]:
            damaged = bytearray(original)
            damaged[i] ^= 1 << (i % 8)
            shard.write_bytes(bytes(damaged))
            try:
                state = sp.load(path)
            except sp.CheckpointError as exc:
                assert shard.name in str(exc), f"byte {i} of {shard.name}: {exc}"
                detected += 1
            else:
                assert_version(state, 1, f"flip in byte {i} of {shard.name}")
                # Harmless only in the string metadata (the "format" tag, a metadata key).
                assert meta.start() <= i < meta.end(), (
                    f"an undetected flip in byte {i} of {shard.name}, outside __metadata__"
                )
                harmless.append(f"{shard.name}:{i}")
        shard.write_bytes(original)
    assert detected > 500, detected
    assert loaded_version(path, "restored") == 1


def test_bit_flip_in_data_is_detected_by_crc_on_every_load_path(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    shard = path / "model-00001-of-00003.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x10
    shard.write_bytes(bytes(raw))
    expected = re.escape(f"{shard}, tensor 'a': crc32c of the stored bytes is")
    with pytest.raises(ChecksumMismatchError, match=expected):
        sp.load(path)
    with pytest.raises(ChecksumMismatchError, match=expected):
        sp.load_into(make_state(0), path)
    with pytest.raises(ChecksumMismatchError, match=expected):
        sp.load(path, keys=["a"], dtype=torch.float64)  # through the staging buffer
    # mmap loads are zero-copy and unverified by design: the documented exception.
    assert not torch.equal(sp.load(path, mmap=True)["a"], make_state(1)["a"])


def test_truncated_and_deleted_shards_are_detected_on_mmap_loads_too(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    shard = path / "model-00003-of-00003.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{shard} is {size - 8} bytes but the manifest recorded {size}")):
        sp.load(path, mmap=True)
    shard.unlink()
    with pytest.raises(MissingShardError, match=re.escape(f"{shard} is missing")):
        sp.load(path, mmap=True)


# ---------------------------------------------------------------- security regressions


class _Payload:
    """Unpickling this creates a marker file: the proof that something unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (str(self.marker), "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch, reading the refused sidecar
def test_pickle_sidecars_beside_safetensors_are_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An HF directory as trainers leave it: safetensors plus pickled sidecar files."""
    from shardpoint._cli.main import main as cli

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    sp.save(make_state(1), ckpt, max_shard_size=MAX_SHARD)
    (ckpt / "shardpoint.json").unlink()  # a plain HF checkpoint
    payload = pickle.dumps(_Payload(marker))
    for name in ("pytorch_model.bin", "optimizer.pt", "rng_state.pth", "training_args.bin", "scheduler.pt"):
        (ckpt / name).write_bytes(payload)
    real_torch_load = torch.load

    def guarded_load(*args: Any, **kwargs: Any) -> Any:
        assert kwargs.get("weights_only", True), "a full unpickle without trust_pickle"
        return real_torch_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", guarded_load)
    assert_version(sp.load(ckpt), 1, "load")
    assert sp.load_into(make_state(0), ckpt).ok
    assert cli(["inspect", str(ckpt)]) == 0
    assert cli(["verify", str(ckpt)]) == 0
    sp.convert(ckpt, tmp_path / "converted")
    assert_version(sp.load(tmp_path / "converted"), 1, "converted")
    capsys.readouterr()
    # Pointed at a sidecar itself, without the opt-in: refused, naming the file.
    with pytest.raises(UnsafePickleError, match=re.escape(str(ckpt / "optimizer.pt"))):
        sp.convert(ckpt / "optimizer.pt", tmp_path / "out")
    assert not marker.exists()


def test_index_over_the_json_size_limit_is_refused_before_parsing(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    (ckpt / "shardpoint.json").unlink()
    index = ckpt / "model.safetensors.index.json"
    size = index.stat().st_size
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{index} is {size} bytes, over the {size - 1}-byte limit")):
        sp.load(ckpt, options=sp.IOOptions(max_json_bytes=size - 1))
    assert sp.load(ckpt, options=sp.IOOptions(max_json_bytes=size))  # at the limit: read


def test_json_bomb_in_the_manifest_metadata_is_refused(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    manifest = ckpt / "shardpoint.json"
    raw = manifest.read_text()
    bomb = "[" * 100_000 + "]" * 100_000
    manifest.write_text(raw.replace('"metadata":{}', f'"metadata":{{"x":{bomb}}}', 1))
    assert bomb in manifest.read_text()
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{manifest} nests JSON too deeply")):
        sp.load(ckpt)


# ------------------------------------------------------------------------ helper process


def _write_outcome(path: str, error: BaseException | None) -> None:
    doc = {"ok": True} if error is None else {"ok": False, "type": type(error).__name__, "message": str(error)}
    with open(path, "w") as f:
        json.dump(doc, f)


def _child(cmd: dict[str, Any], pause: tuple[int, int] | None = None) -> None:
    """In a forked child: install the fault, run the job, record the outcome, exit."""
    code = 1
    try:
        trace_fd = os.open(cmd["trace"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if cmd.get("trace") else None

        def log(label: str) -> None:
            if trace_fd is not None:
                os.write(trace_fd, (label + "\n").encode())  # on disk before a kill

        def on_pause(label: str) -> None:
            assert pause is not None
            os.write(pause[1], b"p")
            os.read(pause[0], 1)

        action = "pause" if pause is not None else cmd.get("action", "kill")
        steps = FaultSteps(cmd["root"], at=cmd.get("at"), action=action, on_pause=on_pause, log=log)
        steps.install(setattr)
        error: BaseException | None = None
        try:
            if cmd["op"] == "manager":
                _manager(Path(cmd["root"])).save(cmd["step"], make_state(cmd["step"]))
            else:
                sp.save(make_state(cmd["version"]), cmd["path"], max_shard_size=MAX_SHARD,
                        overwrite=cmd.get("overwrite", True), layout=cmd.get("layout"), progress=False)
        except Exception as exc:
            error = exc
        steps.enabled = False
        _write_outcome(cmd["outcome"], error)
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _status(pid: int) -> dict[str, Any]:
    status = os.waitpid(pid, 0)[1]
    return {
        "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
    }


def _race(cmd: dict[str, Any]) -> dict[str, Any]:
    """A runs up to its rename and waits there; B saves start to end; then A goes on."""
    path = cmd["path"]
    root = os.path.dirname(path)
    a_cmd = {"op": "save", "root": root, "path": path, "version": cmd["versions"][0],
             "overwrite": cmd["overwrite"], "outcome": cmd["outcomes"][0]}
    b_cmd = {**a_cmd, "version": cmd["versions"][1], "outcome": cmd["outcomes"][1], "at": None}
    # A's steps up to its rename are those of a first save: count them in a scratch twin.
    scratch = os.path.join(root, ".race-probe")
    os.mkdir(scratch)
    probe = FaultSteps(scratch)
    saved = {name: getattr(os, name) for name in ("open", "pwrite", "write", "ftruncate", "fsync", "mkdir",
                                                   "rename", "replace", "unlink", "rmdir")}
    probe.install(setattr)
    try:
        sp.save(make_state(0), os.path.join(scratch, os.path.basename(path)), max_shard_size=MAX_SHARD, progress=False)
    finally:
        for name, fn in saved.items():
            setattr(os, name, fn)
        from shardpoint._storage import posix as sp_posix

        sp_posix._renameat2 = probe._real_renameat2
        shutil.rmtree(scratch)
    a_cmd["at"] = first_step(probe.steps, "renameat2")
    paused_r, paused_w = os.pipe()
    go_r, go_w = os.pipe()
    a = os.fork()
    if a == 0:
        _child(a_cmd, pause=(go_r, paused_w))
    paused = os.read(paused_r, 1) == b"p"
    b = os.fork()
    if b == 0:
        _child(b_cmd)
    b_status = _status(b)
    os.write(go_w, b"g")
    a_status = _status(a)
    for fd in (paused_r, paused_w, go_r, go_w):
        os.close(fd)
    return {"paused": paused, "a": a_status, "b": b_status}


def _free_race(cmd: dict[str, Any]) -> dict[str, Any]:
    path = cmd["path"]
    root = os.path.dirname(path)
    pids = []
    for version, outcome in zip(cmd["versions"], cmd["outcomes"], strict=True):
        job = {"op": "save", "root": root, "path": path, "version": version,
               "overwrite": cmd["overwrite"], "outcome": outcome, "at": None}
        pid = os.fork()
        if pid == 0:
            _child(job)
        pids.append(pid)
    return {"statuses": [_status(pid) for pid in pids]}


def _helper_main() -> None:
    """Serve rounds: one JSON command per stdin line, one JSON reply per line."""
    torch.set_num_threads(1)  # single-threaded, so fork() is safe
    # One writer thread, so the steps of a save come in the same order in every round (the
    # forked children inherit this thread's options). Held by this frame, which serves until
    # the process exits.
    held = sp.using(io=sp.IOOptions(write_threads=1))
    held.__enter__()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    from shardpoint._storage import posix as sp_posix

    real = {name: getattr(os, name) for name in ("open", "pwrite", "write", "ftruncate", "fsync", "mkdir",
                                                  "rename", "replace", "unlink", "rmdir")}
    real_renameat2 = sp_posix._renameat2
    for line in sys.stdin:
        cmd = json.loads(line)
        for name, fn in real.items():  # a race probe patches this process; undo it
            setattr(os, name, fn)
        sp_posix._renameat2 = real_renameat2
        if cmd["op"] == "ping":
            reply: dict[str, Any] = {"pong": True}
        elif cmd["op"] == "race":
            reply = _race(cmd)
        elif cmd["op"] == "free-race":
            reply = _free_race(cmd)
        else:
            started = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                _child(cmd)
            reply = {**_status(pid), "seconds": time.perf_counter() - started}
        replies.write(json.dumps(reply) + "\n")
    replies.flush()
    os._exit(0)


if __name__ == "__main__" and sys.argv[1:] == ["helper"]:
    _helper_main()
