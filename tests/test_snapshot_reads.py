"""Loads see exactly one committed version, whatever happens to the path meanwhile.

Saves replace a checkpoint by an atomic directory exchange and then delete the old
directory; a ``CheckpointManager`` deletes retired steps. A load opens the directory once
and every file through it before reading, so it returns one whole version (or, when the
checkpoint is gone for good, says so) and never a mix or a false "damaged" alarm.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint._read import ReadBatch
from shardpoint._source import open_checkpoint
from shardpoint._verify import verify_checkpoint
from shardpoint.errors import CheckpointError, CheckpointNotFoundError, StorageError

SRC = str(Path(__file__).resolve().parents[1] / "src")

# 4 tensors of 1 MiB, one file each: a multi-file checkpoint of ~4 MB.
_NAMES = ("a", "b", "c", "d")
_NUMEL = 1 << 18


def _state(value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full((_NUMEL,), value) for n in _NAMES}


def _versions(state: dict[str, torch.Tensor]) -> set[float]:
    """The distinct values a loaded state holds (one per version it was read from)."""
    return {float(v) for t in state.values() for v in torch.unique(t).tolist()}


_WRITER = textwrap.dedent(
    """
    import sys, time, torch, shardpoint as sp
    path, seconds, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    end = time.monotonic() + seconds
    i = 1
    while time.monotonic() < end:
        i += 1
        state = {n: torch.full((1 << 18,), float(i)) for n in "abcd"}
        if mode == "overwrite":
            sp.save(state, path, max_shard_size="1MiB", overwrite=True)
        elif mode == "overwrite-small":  # many small saves: many swaps
            sp.save({f"l{j}": torch.full((2000,), float(i)) for j in range(6)}, path, max_shard_size="10KB",
                    overwrite=True, durable=False)
        else:  # appear, then be deleted (retention)
            sp.save(state, path, max_shard_size="1MiB", overwrite=True)
            time.sleep(0.02)  # a step lives a while before retention retires it
            import shutil; shutil.rmtree(path, ignore_errors=True)
    """
)


def _writer(path: Path, seconds: float, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(seconds), mode], env=env)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["verify", "no-verify", "mmap"])
def test_loads_racing_overwrites_see_one_version(tmp_path: Path, how: str) -> None:
    """Two processes: one overwrites a 4-file checkpoint in a loop with a new value each
    time, this one loads it (10 s per mode, 30 s in all): every load is one whole version,
    and none fails."""
    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) == 4
    writer = _writer(path, 10.0, "overwrite")
    loads, mixed, errors, values = 0, [], [], set()
    try:
        while writer.poll() is None:
            try:
                if how == "mmap":
                    state = sp.load(path, mmap=True)
                else:
                    state = sp.load(path, verify=(how == "verify"))
            except CheckpointError as exc:
                errors.append(str(exc))
                continue
            loads += 1
            seen = _versions(state)
            values |= seen
            if len(seen) != 1:
                mixed.append(sorted(seen))
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert mixed == [] and errors == []
    assert loads >= 20
    assert len(values) >= 3  # the loads really raced the saves (saw several versions)


@pytest.mark.slow
def test_verify_racing_overwrites_never_calls_a_version_damaged(tmp_path: Path) -> None:
    """An overwrite swaps a new directory in and empties the old one: verify read the index
    of the old one after it was emptied ("cannot be read: No such file", 1 in 20), or took
    a file removed under it for one it may not read ("permission denied")."""
    from shardpoint._verify import verify_checkpoint

    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    writer = _writer(path, 6.0, "overwrite")
    problems, verified = [], 0
    try:
        while writer.poll() is None:
            try:
                report = verify_checkpoint(path, checksums=False)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            verified += 1
            problems.extend(report.problems)
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert problems == [] and verified >= 20


@pytest.mark.slow
def test_two_processes_overwriting_one_path_both_succeed_every_time(tmp_path: Path) -> None:
    """reliability.md: with overwrite=True both saves succeed, one after the other. One in
    30 failed (ENOENT, "the filesystem failed after the rename"): a save took over the
    directory another had just swapped in, before that one had dealt with the one it
    replaced, and their clean-ups raced over it."""
    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    (path / "notes.txt").write_text("mine")
    writers = [_writer(path, 6.0, "overwrite-small") for _ in range(2)]
    for writer in writers:
        writer.wait(timeout=120)
    assert [w.returncode for w in writers] == [0, 0]
    assert (path / "notes.txt").read_text() == "mine"
    assert len(_versions(sp.load(path))) == 1
    assert [n for n in os.listdir(tmp_path) if n != "ckpt"] == []


@pytest.mark.slow
def test_loads_racing_deletion_see_one_version_or_say_removed(tmp_path: Path) -> None:
    """A checkpoint saved and deleted in a loop (as retention retires steps): a load returns
    one whole version or says the checkpoint is not there; never a mix or a damage alarm."""
    path = tmp_path / "ckpt"
    writer = _writer(path, 5.0, "delete")
    loads, bad = 0, []
    try:
        while writer.poll() is None:
            try:
                state = sp.load(path)
            except CheckpointNotFoundError as exc:
                text = str(exc)
                if not ("does not exist" in text or "was removed (e.g. retired by a CheckpointManager's "
                                                      "retention) while being loaded" in text
                        or "is not a checkpoint" in text or "holds no committed checkpoint" in text):
                    bad.append(text)
                continue
            except StorageError as exc:
                # Saved and deleted again within each of the 5 tries: said so honestly.
                if "was replaced 5 times while being opened" not in str(exc):
                    bad.append(f"{type(exc).__name__}: {exc}")
                continue
            except CheckpointError as exc:
                bad.append(f"{type(exc).__name__}: {exc}")
                continue
            loads += 1
            if len(_versions(state)) != 1:
                bad.append(f"mixed {sorted(_versions(state))}")
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert bad == []
    assert loads >= 1


def test_opened_checkpoint_is_read_after_its_directory_is_deleted(tmp_path: Path) -> None:
    """Once opened, a checkpoint is read whole even if its directory is deleted before the
    tensor bytes are read (the files are held open)."""
    path = tmp_path / "ckpt"
    sp.save(_state(7.0), path, max_shard_size="1MiB")
    with open_checkpoint(path) as ckpt:
        shutil.rmtree(path)
        assert not path.exists()
        batch = ReadBatch(ckpt, verify=True)
        comp = ckpt.components["model"]
        out = {n: batch.new(comp.tensors[n], n, device=torch.device("cpu"), dtype=None) for n in _NAMES}
        batch.run(False)
    assert _versions(out) == {7.0}


def test_opened_checkpoint_is_read_after_an_overwrite(tmp_path: Path) -> None:
    """An overwrite committed after the open does not leak into the opened version."""
    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    with open_checkpoint(path) as ckpt:
        sp.save(_state(2.0), path, max_shard_size="1MiB", overwrite=True)
        batch = ReadBatch(ckpt, verify=True)
        comp = ckpt.components["model"]
        out = {n: batch.new(comp.tensors[n], n, device=torch.device("cpu"), dtype=None) for n in _NAMES}
        batch.run(False)
    assert _versions(out) == {1.0}
    assert _versions(sp.load(path)) == {2.0}


def test_mmap_load_keeps_its_version_after_an_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    state = sp.load(path, mmap=True)
    sp.save(_state(2.0), path, max_shard_size="1MiB", overwrite=True)
    assert _versions(state) == {1.0}


def test_verify_sees_one_version(tmp_path: Path) -> None:
    """verify_checkpoint after an overwrite between its open and its reads: no false alarm."""
    from shardpoint._verify import verify_checkpoint

    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    report = verify_checkpoint(path)
    assert report.ok and report.files_checked == 4


def test_open_checkpoint_holds_every_file(tmp_path: Path) -> None:
    """Every data file is opened before any read, and closed with the checkpoint."""
    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    ckpt = open_checkpoint(path)
    assert sorted(ckpt._fds) == [
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
    ]
    fds = list(ckpt._fds.values())
    ckpt.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_removed_for_good_is_said_plainly(tmp_path: Path) -> None:
    """A directory replaced by nothing while being opened: the open starts over from the
    path and, finding nothing, says the checkpoint was removed (not 'copy the file back')."""
    from shardpoint import _source

    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    real = _source._fill_local
    calls = []

    def delete_then_fill(ckpt: _source.Checkpoint) -> _source.Checkpoint:
        calls.append(1)
        shutil.rmtree(path, ignore_errors=True)  # retention deletes the step mid-open
        return real(ckpt)

    _source._fill_local = delete_then_fill  # a real deletion, at the worst moment
    try:
        with pytest.raises(CheckpointNotFoundError, match=re.escape(
                "was removed (e.g. retired by a CheckpointManager's retention) while being loaded")):
            sp.load(path)
    finally:
        _source._fill_local = real
    assert len(calls) == 1


def _when_listed(monkeypatch: pytest.MonkeyPatch, path: Path, happen: Callable[[], None]) -> None:
    """Run ``happen`` each time ``path`` is about to be listed (then list it for real): an
    event at the worst moment for the code that just saw the directory."""
    real = os.listdir

    def listing(where: object = ".") -> list[str]:
        if os.fspath(where) == str(path):  # type: ignore[arg-type]
            happen()
        return real(where)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "listdir", listing)


@pytest.mark.parametrize("entry", ["load", "load_into", "verify"])
def test_a_directory_removed_as_it_is_listed_is_said_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str) -> None:
    """Retention deletes the step after the entry point saw the directory and before it
    listed it to tell the format: the same 'removed' error, not a bare FileNotFoundError."""
    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    _when_listed(monkeypatch, path, lambda: shutil.rmtree(path))  # a real deletion
    with pytest.raises(CheckpointNotFoundError) as caught:
        if entry == "load":
            sp.load(path)
        elif entry == "load_into":
            sp.load_into(_state(0.0), path)
        else:
            verify_checkpoint(str(path))
    done, doing = ("verified", "verify") if entry == "verify" else ("loaded", "load")
    assert str(caught.value) == (
        f"{path} was removed (e.g. retired by a CheckpointManager's retention) while being "
        f"{done}; {doing} a checkpoint that is still there")


@pytest.mark.parametrize(("code", "entry", "expected"), [
    (errno.EACCES, "load", "[Errno 13] Permission denied; make it readable and listable by this "
                           "user, then load again"),
    (errno.EIO, "verify", "[Errno 5] Input/output error; the disk or file system reported an "
                          "error; check it (e.g. dmesg), then verify again"),
])
def test_a_directory_that_cannot_be_listed_is_a_storage_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, entry: str, expected: str) -> None:
    """The listing fails (root passes permission checks, so the error is raised where the
    listing happens): a StorageError naming the path, keeping the errno, saying what to do."""
    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")

    def fail() -> None:
        raise OSError(code, os.strerror(code), str(path))

    _when_listed(monkeypatch, path, fail)
    with pytest.raises(StorageError) as caught:
        sp.load(path) if entry == "load" else verify_checkpoint(str(path))
    assert caught.value.errno == code
    assert str(caught.value) == f"{path}: listing the directory failed: {expected}"


def test_fd_limit_is_raised_for_many_files(tmp_path: Path) -> None:
    """A load holding more files than the soft RLIMIT_NOFILE raises it toward the hard one."""
    import resource

    path = tmp_path / "ckpt"
    state = {f"t{i:03d}": torch.full((4,), float(i)) for i in range(300)}
    sp.save(state, path, max_shard_size=16)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 700:
        pytest.skip("hard open-files limit too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
    try:
        out = sp.load(path)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 300
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert out["t299"].tolist() == [299.0] * 4


def _ranks_load_while_one_overwrites(rank: int, world_size: int, path: str, out: str) -> None:
    import torch.distributed as dist

    writer = _writer(Path(path), 6.0, "overwrite") if rank == 1 else None
    target = {n: torch.zeros(_NUMEL) for n in _NAMES}
    seen = []
    try:
        while True:
            running = [writer is not None and writer.poll() is None]
            dist.broadcast_object_list(running, src=1)  # rank 1 knows when the writer is done
            if not running[0]:
                break
            try:
                sp.load_into(target, path, process_group=dist.group.WORLD)
                seen.append(sorted(_versions(target)))
            except sp.CheckpointError as exc:
                seen.append([f"{type(exc).__name__}: {str(exc)[:300]}"])
    finally:
        if writer is not None:
            writer.wait(timeout=60)
    Path(out, f"rank{rank}.json").write_text(repr(seen))


@pytest.mark.slow
def test_a_collective_load_reads_one_version_on_every_rank(tmp_path: Path) -> None:
    """A process overwrites the checkpoint in a loop (6 s) while 2 ranks load it collectively
    again and again: in every load both ranks hold the same one version (they agree on the
    save id they opened), and no load fails."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _dist_utils import run_ranks

    path = tmp_path / "ckpt"
    sp.save(_state(1.0), path, max_shard_size="1MiB")
    run_ranks(_ranks_load_while_one_overwrites, 2, str(path), str(tmp_path))
    rank0, rank1 = ((tmp_path / f"rank{r}.json").read_text() for r in range(2))
    assert rank0 == rank1
    loads = eval(rank0)  # a list of lists of floats, written above
    assert all(len(values) == 1 and isinstance(values[0], float) for values in loads), loads
    assert len({values[0] for values in loads}) >= 3  # the loads really raced the saves
