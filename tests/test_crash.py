"""SIGKILL in the middle of a save never leaves a half-written checkpoint at the path.

A helper process (this file run as a script) imports torch and shardpoint once, then for
every round forks a child that saves a ~58 MB, six-shard state dict whose values encode
a version number ``k``. The helper SIGKILLs the child (real ``os.kill(pid, SIGKILL)``)
either after a delay chosen across the measured duration of one save, or the moment the
child reaches a phase seen on disk (temporary directory created, index written, manifest
written, directory renamed into place). After every kill the test loads the path and
checks, bit for bit, that it holds exactly one complete version: the one committed before
the round or the one being saved, never a mix, and never a load error.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import shardpoint as sp
from _helper_process import HelperProcess

MAX_SHARD = "16MB"
INDEX = "model.safetensors.index.json"
MANIFEST = "shardpoint.json"

# name -> (dtype, numel, low, high): values are integers in [low, high) so that adding the
# version k (< 1000) is exact in every dtype, in any order of additions.
_LAYOUT: dict[str, tuple[torch.dtype, int, int, int]] = {
    "version": (torch.int64, 1, 0, 1),
    "embed.weight": (torch.int32, 2_500_000, -(2**30), 2**30),
    "layers.0.weight": (torch.int32, 2_000_000, -(2**30), 2**30),
    "layers.0.bias": (torch.float32, 500_000, -(2**22), 2**22),
    "layers.1.weight": (torch.int32, 2_000_000, -(2**30), 2**30),
    "layers.1.bias": (torch.float32, 500_000, -(2**22), 2**22),
    "layers.2.weight": (torch.int32, 2_000_000, -(2**30), 2**30),
    "layers.2.half": (torch.float16, 1_000_000, -1000, 1000),
    "layers.3.weight": (torch.int32, 2_000_000, -(2**30), 2**30),
    "head.weight": (torch.int32, 2_500_000, -(2**30), 2**30),
    "version_last": (torch.int64, 1, 0, 1),
}


def _base_state() -> dict[str, torch.Tensor]:
    """Version 0: deterministic in every process (fixed seeds, CPU generator)."""
    out = {}
    for i, (name, (dtype, numel, low, high)) in enumerate(_LAYOUT.items()):
        gen = torch.Generator().manual_seed(1234 + i)
        out[name] = torch.randint(low, high, (numel,), generator=gen, dtype=torch.int64).to(dtype)
    return out


# ----------------------------------------------------------------------------- helper process


def _tmp_siblings(path: str) -> set[str]:
    parent, name = os.path.split(path)
    prefix = f".{name}.tmp-"
    try:
        return {n for n in os.listdir(parent) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def _reaped(pid: int) -> int | None:
    """The wait status if the child has exited (and is now reaped), else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return status if done else None


class _Watch:
    """Cheap polling for one on-disk phase of the save into ``path``."""

    def __init__(self, event: str, path: str) -> None:
        self.event, self.path = event, path
        self.before = _tmp_siblings(path)
        self.inode = os.stat(path).st_ino if os.path.exists(path) else None
        self.tmp: str | None = None  # the save's temporary directory, once seen

    def happened(self) -> bool:
        if self.event == "swapped":  # another directory sits at `path`: the rename happened
            try:
                return os.stat(self.path).st_ino != self.inode
            except FileNotFoundError:
                return False
        if self.tmp is None:
            new = _tmp_siblings(self.path) - self.before
            if not new:
                return False
            self.tmp = os.path.join(os.path.dirname(self.path), new.pop())
        if self.event == "tmpdir":
            return True
        wanted = {"index": INDEX, "manifest": MANIFEST}[self.event]
        return os.path.exists(os.path.join(self.tmp, wanted))


def _run_round(state: dict[str, torch.Tensor], cmd: dict[str, Any]) -> dict[str, Any]:
    path, overwrite, kill = cmd["path"], cmd["overwrite"], cmd.get("kill")
    watch = _Watch(kill["event"], path) if kill and "event" in kill else None
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: save, then leave without running any of the helper's cleanup
        code = 1
        try:
            os.nice(5)  # let the watching parent preempt the writer threads on few cores
            sp.save(state, path, max_shard_size=MAX_SHARD, overwrite=overwrite, progress=False)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)

    status: int | None = None
    event_seen = False
    if kill is None:
        status = os.waitpid(pid, 0)[1]
    elif watch is None:
        deadline = t0 + kill["after"]
        while status is None and time.perf_counter() < deadline:
            time.sleep(min(0.002, max(0.0, deadline - time.perf_counter())))
            status = _reaped(pid)
    else:
        while status is None and time.perf_counter() - t0 < 60:
            if watch.happened():
                event_seen = True
                break
            status = _reaped(pid)
        deadline = time.perf_counter() + kill.get("after", 0.0)
        while status is None and time.perf_counter() < deadline:
            pass  # sub-millisecond delays: spin
    t_kill = time.perf_counter() - t0
    if status is None:
        # Not reaped yet, so the pid is still ours (alive, or a zombie that just exited).
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    return {
        "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "event_seen": event_seen,
        "t_kill": t_kill,
        "duration": time.perf_counter() - t0,
    }


def _helper_main() -> None:
    """Serve rounds: one JSON command per stdin line, one JSON reply per line."""
    torch.set_num_threads(1)  # stay single-threaded so fork() is safe
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    state = _base_state()
    version = 0
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        k = cmd["k"]
        for t in state.values():  # in place: exact, and cheap
            t.add_(k - version)
        version = k
        replies.write(json.dumps(_run_round(state, cmd)) + "\n")


# ---------------------------------------------------------------------------------- tests


class Helper(HelperProcess):
    """The helper process, driven one round at a time."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(__file__, workdir)
        assert self.reply() == {"ready": True}

    def save(
        self, path: Path, k: int, *, overwrite: bool, kill: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        cmd = {"path": str(path), "k": k, "overwrite": overwrite, "kill": kill}
        reply = self.call(cmd)
        if reply["exit"] not in (None, 0):
            raise AssertionError(f"the saving child failed:\n{self.log.read_text()[-4000:]}")
        return reply


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helper]:
    h = Helper(tmp_path_factory.mktemp("crash-helper"))
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    return _base_state()


def _check_version(
    loaded: dict[str, torch.Tensor], base: dict[str, torch.Tensor], where: str
) -> int:
    """The one version ``loaded`` holds, checking every byte of every tensor against it."""
    assert set(loaded) == set(base), f"{where}: keys {sorted(loaded)}"
    k = int(loaded["version"].item())
    for name, expected in base.items():
        got = loaded[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, f"{where}: {name}"
        # Exact integer arithmetic in every dtype: got - k == version 0, bit for bit.
        assert torch.equal(got.sub_(k), expected), (
            f"{where}: {name} is not version {k} (mixed save)"
        )
    return k


def _load_committed(path: Path, base: dict[str, torch.Tensor], where: str) -> int:
    """Load ``path`` fully through shardpoint (every byte checked) and probe its HF view."""
    k = _check_version(sp.load(path), base, f"{where} (sp.load)")
    # The plain-HF view (index + safetensors files, ignoring shardpoint.json) is the same
    # version in every file: probe the first and last element of every tensor.
    index = json.loads((path / INDEX).read_text())
    assert set(index["weight_map"]) == set(base), where
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), framework="pt") as f:
            assert f.metadata()["format"] == "pt", f"{where}: {fname}"
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert index["weight_map"][key] == fname, f"{where}: {key}"
                got = f.get_slice(key)
                n = base[key].numel()
                for i in (0, n - 1):
                    value = got[i : i + 1]
                    assert torch.equal(value - k, base[key][i : i + 1]), f"{where}: {fname}:{key}"
    return k


def _assert_never_loaded(path: Path, tmp_names: set[str], where: str) -> None:
    for name in tmp_names:
        with pytest.raises(sp.IncompleteCheckpointError, match="never committed"):
            sp.load(path.parent / name)


TIMED_KILLS = 20
PHASE_KILLS: list[dict[str, Any]] = [
    {"event": "tmpdir"},  # the save has just created its temporary directory
    {"event": "tmpdir", "after": 0.005},
    {"event": "index"},  # every data file written, the index just created
    {"event": "manifest"},  # the manifest just created (maybe half written)
    {"event": "manifest", "after": 0.0002},
    {"event": "manifest", "after": 0.001},
    {"event": "swapped"},  # renamed into place: now fsyncing the parent, removing the old one
    {"event": "swapped", "after": 0.0005},
    {"event": "swapped", "after": 0.002},
]
# Each of these must be hit by at least one kill of a running save; the event that
# targets it is retried (a few times at most) if scheduling made the planned kills miss it.
REQUIRED_PHASES = {
    "old": {"event": "index"},
    "old, manifest written": {"event": "manifest"},
    "new": {"event": "swapped"},
}


class _Rounds:
    """Drives kill rounds against one path, checking the committed version after each."""

    def __init__(self, helper: Helper, base: dict[str, torch.Tensor], path: Path) -> None:
        self.helper, self.base, self.path = helper, base, path
        self.k = 0
        self.committed = 0
        self.durations: list[float] = []
        self.log: list[tuple[str, bool, str]] = []

    def clean_save(self) -> None:
        self.k += 1
        reply = self.helper.save(self.path, self.k, overwrite=self.k > 1)
        assert not reply["killed"]
        self.durations.append(reply["duration"])
        assert _load_committed(self.path, self.base, f"clean save {self.k}") == self.k
        self.committed = self.k

    def kill_round(self, kill: dict[str, Any]) -> str:
        self.k += 1
        where = f"round k={self.k} kill={kill}"
        before = _tmp_siblings(str(self.path))
        reply = self.helper.save(self.path, self.k, overwrite=True, kill=kill)
        new_tmps = _tmp_siblings(str(self.path)) - before

        got = _load_committed(self.path, self.base, where)
        assert got in (self.committed, self.k), (
            f"{where}: loaded version {got}, expected {self.committed} (old) or {self.k} (new)"
        )
        if not reply["killed"]:
            assert got == self.k, f"{where}: the save finished but the path holds version {got}"
            self.durations.append(reply["duration"])
        phase = "old" if got == self.committed else "new"
        if phase == "old" and any((self.path.parent / t / MANIFEST).exists() for t in new_tmps):
            phase = "old, manifest written"
        self.log.append((phase, reply["killed"], f"{where} t_kill={reply['t_kill'] * 1e3:.1f}ms"))
        self.committed = got

        _assert_never_loaded(self.path, new_tmps, where)
        for t in new_tmps:  # keep the disk small; the next save must not need them
            shutil.rmtree(self.path.parent / t)
        return phase if reply["killed"] else "finished"

    def summary(self) -> str:
        return "\n".join(f"{p:>22} killed={kd!s:5} {w}" for p, kd, w in self.log)


def test_sigkill_during_overwrite_keeps_one_whole_version(
    helper: Helper, base: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    rounds = _Rounds(helper, base, tmp_path / "ckpt")
    for _ in range(4):  # the first creates the path; the others time a replace
        rounds.clean_save()
    assert _tmp_siblings(str(rounds.path)) == set()
    assert len(list(rounds.path.glob("model-*-of-*.safetensors"))) >= 5

    # Kill points spread evenly over one save, from its first milliseconds to a little past
    # its typical end (the time of a save varies; a kill after the end is wasted, not wrong).
    for i in range(TIMED_KILLS):
        typical = statistics.median(rounds.durations[1:])
        rounds.kill_round({"after": typical * (0.02 + 1.18 * i / (TIMED_KILLS - 1))})
    hit = {rounds.kill_round(kill) for kill in PHASE_KILLS}
    for phase, kill in REQUIRED_PHASES.items():
        for _ in range(5):
            if phase in hit:
                break
            hit.add(rounds.kill_round(kill))

    # On a loaded machine a save can outrun its timed kill; top up with early kills (which
    # always land inside a running save) until at least 20 kills hit one, within a bound.
    for extra in range(15):
        if sum(1 for entry in rounds.log if entry[1]) >= 20:
            break
        typical = statistics.median(rounds.durations[1:])
        rounds.kill_round({"after": typical * 0.1 * (1 + extra % 5)})

    print(rounds.summary())  # shown with -rP, or on failure
    killed = [entry for entry in rounds.log if entry[1]]
    assert len(killed) >= 20, f"only {len(killed)} kills hit a running save:\n{rounds.summary()}"
    # The kills landed on both sides of the commit, and between manifest and rename.
    assert set(REQUIRED_PHASES) <= {p for p, _, _ in killed}, rounds.summary()

    # After all that, a plain save still works and replaces the last committed version.
    rounds.clean_save()
    assert _tmp_siblings(str(rounds.path)) == set()


@pytest.mark.parametrize(
    "kill",
    [
        {"event": "tmpdir"},
        {"event": "tmpdir", "after": 0.01},
        {"event": "index"},
        {"event": "manifest"},
    ],
    ids=["tmpdir", "writing-data", "index", "manifest"],
)
def test_sigkill_during_first_save_leaves_nothing(
    helper: Helper, base: dict[str, torch.Tensor], tmp_path: Path, kill: dict[str, Any]
) -> None:
    for attempt in range(5):
        path = tmp_path / f"run{attempt}" / "ckpt"
        reply = helper.save(path, 7, overwrite=False, kill=kill)
        if reply["killed"] and not os.path.lexists(path):
            break
        # The save got past its commit before the kill (scheduling): it must be whole.
        assert _load_committed(path, base, f"attempt {attempt}, {reply}") == 7
    else:
        pytest.fail(f"no kill landed before the commit in 5 attempts ({kill})")
    assert reply["event_seen"] or "event" not in kill, reply
    tmps = _tmp_siblings(str(path))
    assert len(tmps) == 1, tmps

    with pytest.raises(sp.CheckpointNotFoundError, match="does not exist"):
        sp.load(path)
    with pytest.raises(sp.CheckpointNotFoundError, match="does not exist"):
        sp.load_into(dict.fromkeys(base, torch.empty(0)), path)
    # The parent holds only the temporary directory: not a checkpoint either.
    with pytest.raises(sp.CheckpointNotFoundError, match="no committed checkpoint"):
        sp.load(path.parent)
    _assert_never_loaded(path, tmps, "first save")

    # The leftover does not block the next save of the same name (overwrite=False).
    assert not helper.save(path, 8, overwrite=False)["killed"]
    assert _load_committed(path, base, "save after crash") == 8


if __name__ == "__main__" and sys.argv[1:] == ["helper"]:
    _helper_main()
