"""One process-group rule, and async state per manager (issue 21, items 6 and 8).

The rule (``_distributed/group.py: resolve_group``): an explicit ``process_group`` wins;
else a state or target holding DTensors runs over the default group; else the calling
process alone. ``save``, ``async_save``, ``load_into`` and ``CheckpointManager`` all use it;
the manager's ``restore`` agrees on one step across the ranks (the newest every rank sees)
or raises the same error on every rank. Async saves go through queues: each manager owns
one, bare ``sp.async_save`` calls share the default one, so no manager waits on, or raises,
another's save.

The distributed cases run on real gloo ranks (``_dist_utils.run_ranks``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _dist_utils import run_ranks
from shardpoint import _async as sp_async
from shardpoint._distributed.group import holds_dtensor, resolve_group
from shardpoint._manager_steps import agreed_step as _agreed_step

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_fsdp.py"
FAST = {"durable": False}


@pytest.fixture(autouse=True)
def _no_async_failure_leaks() -> Any:
    """A failed bare async save left unseen would be raised by another test's next save."""
    yield
    last = sp_async.default_queue().last
    if last is not None:
        last.exception()
        last.observed = True


# ------------------------------------------------------------------ the rule, without ranks


def test_without_a_default_group_every_state_is_saved_by_the_calling_process() -> None:
    group = resolve_group(None, {"w": torch.ones(2)})
    assert (group.pg, group.rank, group.world_size, group.distributed) == (None, 0, 1, False)


def test_holds_dtensor_walks_what_prepare_state_walks() -> None:
    class Holder:  # a Stateful: what its state_dict() returns is what is saved
        def __init__(self, value: Any) -> None:
            self.value = value

        def state_dict(self) -> dict[str, Any]:
            return {"inner": self.value}

    plain = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    state = {"model": plain, "optim": opt, "extra": [1, "a", {"t": torch.ones(1)}], "h": Holder(torch.ones(1))}
    assert holds_dtensor(state) is False
    assert holds_dtensor([state, state]) is False  # shared objects are walked once
    assert holds_dtensor(iter([state])) is False  # an iterator (a generator of tensors) is walked too


@pytest.mark.parametrize(
    ("views", "step", "expected"),
    [
        ([[1, 2, 3]], None, (3, None)),
        ([[]], None, (None, None)),
        ([[1, 2], [1, 2]], None, (2, None)),
        ([[1, 2], [1, 2]], 1, (1, None)),
        ([[], []], None, (None, None)),
    ],
)
def test_agreed_step_when_the_views_agree(views: list[list[int]], step: int | None, expected: Any) -> None:
    assert _agreed_step("/r", views, step) == expected


def test_agreed_step_is_the_newest_every_rank_sees_with_a_warning_naming_the_others() -> None:
    chosen, note = _agreed_step("/r", [[1, 2, 3], [1, 2]], None)
    assert chosen == 2
    assert note == (
        "restoring step 2 from /r, the newest step every rank sees: step [3] is committed in the "
        "view of some ranks only (rank 0 sees steps [1, 2, 3]; rank 1 sees steps [1, 2])"
    )


def test_agreed_step_refuses_a_step_some_rank_does_not_see() -> None:
    with pytest.raises(sp.CheckpointError) as info:
        _agreed_step("/r", [[1, 2], [1], [2]], 2)
    assert str(info.value) == (
        "/r has no committed step 2 in the view of rank 1 (rank 0 sees steps [1, 2]; rank 1 sees "
        "steps [1]; rank 2 sees steps [2]); every rank must see the step it restores: restore a "
        "step all of them list, or wait for the file system to show the step on every rank"
    )
    with pytest.raises(sp.CheckpointError, match=r"^/r has no committed step 5; it has \[1, 2\]$"):
        _agreed_step("/r", [[1, 2]], 5)


def test_agreed_step_refuses_views_without_a_common_step() -> None:
    with pytest.raises(sp.CheckpointError, match=r"the ranks see no committed step in common under /r "
                       r"\(rank 0 sees steps \[2\]; rank 1 sees steps \[\]\)"):
        _agreed_step("/r", [[2], []], None)


# ------------------------------------------------------------------ async state per manager


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), value), "b": torch.full((8,), -value)}


def _block_step(root: Path, step: int) -> None:
    """A plain file where ``step`` would go: a real save error, even with overwrite."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"step-{step:06d}").write_bytes(b"not a checkpoint")


def test_a_managers_async_failure_is_reported_by_that_manager_only(tmp_path: Path) -> None:
    a = sp.CheckpointManager(tmp_path / "a", async_save=True, **FAST)
    b = sp.CheckpointManager(tmp_path / "b", async_save=True, **FAST)
    _block_step(tmp_path / "a", 2)
    a.save(1, _state(1.0))
    failed = a.save(2, _state(2.0))  # fails in the background; nobody looks at its handle
    assert isinstance(failed.exception(), sp.CheckpointExistsError)
    # Neither manager B, nor a bare save / async_save, raises A's failure.
    b.save(1, _state(1.0))
    b.save(2, _state(2.0))
    b.wait()
    sp.save(_state(3.0), tmp_path / "bare")
    sp.async_save(_state(4.0), tmp_path / "bare-async").result()
    assert b.steps() == [1, 2]
    # A reports it, once, naming its step.
    with pytest.raises(
        sp.CheckpointError,
        match=r"async save of step 2 to .*a failed; nothing was committed for it: .*step-000002 exists.* "
        r"Step 3 was not saved either",
    ):
        a.save(3, _state(3.0))
    a.save(4, _state(4.0))
    a.wait()
    assert a.steps() == [1, 4]


def test_a_bare_async_failure_is_raised_by_the_next_bare_save_not_by_a_manager(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("a user's file")
    handle = sp.async_save(_state(1.0), tmp_path / "taken")  # fails in the background
    assert isinstance(handle.exception(), sp.CheckpointExistsError)
    mgr = sp.CheckpointManager(tmp_path / "run", async_save=True, **FAST)
    mgr.save(1, _state(1.0))
    mgr.wait()
    sync = sp.CheckpointManager(tmp_path / "run-sync", **FAST)
    sync.save(1, _state(1.0))
    assert (mgr.steps(), sync.steps()) == ([1], [1])
    # The documented behaviour of bare calls is kept: the next bare save raises it.
    with pytest.raises(sp.CheckpointError, match=r"the previous async save to .*taken failed and nothing was "
                       r"committed there: .*Call \.result\(\) on async_save handles"):
        sp.save(_state(2.0), tmp_path / "next")
    assert not (tmp_path / "next").exists()
    assert (tmp_path / "taken" / "mine.txt").read_text() == "a user's file"


def _in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_a_manager_does_not_wait_for_a_bare_async_save(tmp_path: Path) -> None:
    release = threading.Event()
    bare = sp.async_save(_state(1.0), tmp_path / "bare", on_commit=lambda info: release.wait(60))
    mgr = sp.CheckpointManager(tmp_path / "run", async_save=True, **FAST)

    def manager_saves() -> None:
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))
        mgr.wait()

    try:
        thread, errors = _in_thread(manager_saves)
        thread.join(30)
        finished = not thread.is_alive()
        assert not bare.done()  # still held in its on_commit
    finally:
        release.set()
    assert finished, "the manager's saves waited for the bare async_save"
    assert errors == []
    assert mgr.steps() == [1, 2]
    assert bare.result().tensor_bytes == 72 * 4


@pytest.mark.slow
def test_an_async_trainer_does_not_wait_for_a_bare_async_save(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from _hf_trainer_worker import trainer

    release = threading.Event()
    bare = sp.async_save(_state(1.0), tmp_path / "bare", on_commit=lambda info: release.wait(120))
    t = trainer(str(tmp_path / "run"), 2, shardpoint_async=True)
    try:
        thread, errors = _in_thread(t.train)  # saves checkpoint-2 through its own queue
        thread.join(60)
        finished = not thread.is_alive()
        assert not bare.done()
    finally:
        release.set()
    assert finished, "the Trainer's async checkpoint waited for the bare async_save"
    assert errors == []
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2"]
    assert sp.load_into(t.model, tmp_path / "run" / "checkpoint-2" / "model.safetensors").ok


def test_two_managers_do_not_wait_on_each_other(tmp_path: Path) -> None:
    """Manager B's background commit is held (its root lock taken, as another process's
    manager would hold it); manager A saves, waits and restores meanwhile."""
    a = sp.CheckpointManager(tmp_path / "a", async_save=True, **FAST)
    b = sp.CheckpointManager(tmp_path / "b", async_save=True, max_shard_size="4MB")
    big = {"w": torch.ones(4 * 2**20)}  # 16 MB, durable: its write outlasts taking the lock
    (tmp_path / "b").mkdir()
    fd = os.open(tmp_path / "b", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for step in range(1, 6):  # B's background must still be writing when the lock is taken
            handle = b.save(step, big)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not handle.done():
                break
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:
            pytest.fail("manager B's save committed before its root lock could be taken, 5 times")

        def a_saves() -> None:
            a.save(1, _state(1.0))
            a.save(2, _state(2.0))
            a.wait()
            assert a.restore(_state(0.0)) == 2

        thread, errors = _in_thread(a_saves)
        thread.join(30)
        finished = not thread.is_alive()
        assert not handle.done()  # B is still in its bookkeeping, behind the lock
    finally:
        os.close(fd)  # releases the lock
    assert finished, "manager A waited for manager B's save"
    assert errors == []
    b.wait()
    assert a.steps() == [1, 2] and b.steps()[-1] == step


def test_each_manager_has_its_own_staging_buffer(tmp_path: Path) -> None:
    before = sp_async.staging_bytes()
    mgr = sp.CheckpointManager(tmp_path, async_save=True, **FAST)
    mgr.save(1, {"w": torch.ones(10_000)})
    mgr.wait()
    assert mgr._queue.staging_bytes == 40_000
    assert sp_async.staging_bytes() == before


# ------------------------------------------------------------------ on gloo ranks


def _write_outcome(out: Path, rank: int, **outcome: Any) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps(outcome))


def _outcomes(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def _lagging_view(root: Path, lag: Path, steps: list[int]) -> None:
    """``lag``: the root as a rank whose listing lags sees it (only ``steps``)."""
    for step in steps:
        shutil.copytree(root / f"step-{step:06d}", lag / f"step-{step:06d}")


def _restore_with_a_lagging_rank(rank: int, world: int, base: str) -> None:
    import torch.distributed as dist

    base_path = Path(base)
    root, lag = base_path / "root", base_path / "lag"
    mgr = sp.CheckpointManager(root, process_group=dist.group.WORLD, **FAST)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step)), "step": torch.tensor(step)})
    dist.barrier()
    if rank == 0:
        _lagging_view(root, lag, [1])
    dist.barrier()
    view = sp.CheckpointManager(root if rank == 0 else lag, process_group=dist.group.WORLD)
    target = {"w": torch.zeros(4), "step": torch.tensor(-1)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = view.restore(target)
    try:
        view.restore(target, step=2)
        error = None
    except sp.DistributedCheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    _write_outcome(base_path, rank, chosen=chosen, w=target["w"].tolist(), warnings=[str(w.message) for w in caught],
                   error=error)


def _both_restore_cases(rank: int, world: int, base: str) -> None:
    """One spawn of the ranks for both cases below (starting ranks is most of their time)."""
    for case, fn in (("plain", _restore_with_a_lagging_rank), ("dtensor", _dtensor_manager_without_a_group)):
        (Path(base) / case).mkdir(exist_ok=True)
        fn(rank, world, str(Path(base) / case))


@pytest.fixture(scope="module")
def restored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("restore-cases")
    run_ranks(_both_restore_cases, 2, str(base), timeout=180)
    return base


@pytest.mark.slow
def test_manager_restore_agrees_on_the_step_when_one_ranks_view_lags(restored: Path) -> None:
    tmp_path = restored / "plain"
    outcomes = _outcomes(tmp_path, 2)
    root, lag = tmp_path / "root", tmp_path / "lag"
    assert [o["chosen"] for o in outcomes] == [1, 1]
    assert [o["w"] for o in outcomes] == [[1.0] * 4, [1.0] * 4]
    assert outcomes[0]["warnings"] == [
        f"restoring step 1 from {root}, the newest step every rank sees: step [2] is committed in the "
        "view of some ranks only (rank 0 sees steps [1, 2]; rank 1 sees steps [1])"
    ]
    assert outcomes[1]["warnings"] == outcomes[0]["warnings"]  # the coordinator's decision
    # restore(step=2): rank 1 does not see it, so both raise, alike, naming rank 1.
    assert outcomes[0]["error"] == (
        f"DistributedCheckpointError: choosing the step to restore from {root} failed on rank 0 "
        f"(rank 0: CheckpointNotFoundError: {root} has no committed step 2 in the view of rank 1 (rank 0 sees "
        "steps [1, 2]; rank 1 sees steps [1]); every rank must see the step it restores: restore a step "
        "all of them list, or wait for the file system to show the step on every rank)"
    )
    assert outcomes[1]["error"] == outcomes[0]["error"].replace(f"from {root} failed", f"from {lag} failed")


def _dtensor_state(rank: int, value: float) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(8, dtype=torch.float32) + value
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def _dtensor_manager_without_a_group(rank: int, world: int, base: str) -> None:
    import torch.distributed as dist

    base_path = Path(base)
    root, lag = base_path / "root", base_path / "lag"
    mgr = sp.CheckpointManager(root, **FAST)  # no process_group: DTensors mean the default group
    for step in (1, 2):
        mgr.save(step, _dtensor_state(rank, 100.0 * step))
    dist.barrier()
    if rank == 0:
        _lagging_view(root, lag, [1])
    dist.barrier()
    view = sp.CheckpointManager(root if rank == 0 else lag)
    target = _dtensor_state(rank, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = view.restore(target)
    local = target["w"].to_local().tolist()
    # load_into of a DTensor target without process_group: an error on one rank is every rank's.
    try:
        sp.load_into(_dtensor_state(rank, 0.0), root / "step-000001" if rank == 0 else base_path / "missing")
        error = None
    except sp.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    _write_outcome(base_path, rank, chosen=chosen, local=local, steps=mgr.steps(), error=error)


@pytest.mark.slow
def test_dtensor_states_use_the_default_group_in_the_manager_and_load_into(restored: Path) -> None:
    tmp_path = restored / "dtensor"
    outcomes = _outcomes(tmp_path, 2)
    assert [o["chosen"] for o in outcomes] == [1, 1]
    assert [o["local"] for o in outcomes] == [[100.0, 101.0, 102.0, 103.0], [104.0, 105.0, 106.0, 107.0]]
    assert [o["steps"] for o in outcomes] == [[1, 2], [1, 2]]
    # one chunked save per step: rank 0 committed it, each rank wrote its own shard's file
    manifest = json.loads((tmp_path / "root" / "step-000002" / "shardpoint.json").read_text())
    assert manifest["metadata"]["step"] == 2
    errors = [o["error"] for o in outcomes]
    # each rank names the phase by its own path; what failed, and where, is the same
    assert errors[0].startswith(f"DistributedCheckpointError: opening {tmp_path / 'root' / 'step-000001'} failed")
    assert errors[1].startswith(f"DistributedCheckpointError: opening {tmp_path / 'missing'} failed")
    tails = [e.partition(" failed on rank 1 (rank 1: ")[2] for e in errors]
    assert tails[0] != "" and tails[0] == tails[1]
    assert tails[0].startswith("CheckpointNotFoundError: ") and str(tmp_path / "missing") in tails[0]


def _run_the_fsdp_example(rank: int, world: int, base: str) -> None:
    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("train_fsdp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    base_path = Path(base)
    root, lag = base_path / "root", base_path / "lag"
    first = example.main(["--steps", "4", "--root", str(root)])  # saves 2 and 4
    dist.barrier()
    if rank == 0:
        _lagging_view(root, lag, [2])
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lagging = example.main(["--steps", "2", "--root", str(root if rank == 0 else lag)])
    resumed = example.main(["--steps", "6", "--root", str(root), "--async-save"])
    _write_outcome(base_path, rank, first=first, lagging=lagging, resumed=resumed,
                   warned=any("the newest step every rank sees" in str(w.message) for w in caught))


@pytest.mark.slow
def test_the_fsdp_example_restores_the_same_step_on_every_rank(tmp_path: Path) -> None:
    run_ranks(_run_the_fsdp_example, 2, str(tmp_path), timeout=180)
    outcomes = _outcomes(tmp_path, 2)
    assert [o["first"] for o in outcomes] == [0, 0]
    assert [o["lagging"] for o in outcomes] == [2, 2]  # rank 0 sees step 4, rank 1 only step 2
    assert [o["warned"] for o in outcomes] == [True, True]
    assert [o["resumed"] for o in outcomes] == [4, 4]
    assert sp.CheckpointManager(tmp_path / "root").steps() == [4, 6]


# ------------------------------------------------------------------ exit and fork

_EXIT_SCRIPT = r"""
import sys, torch, shardpoint as sp
root, how = sys.argv[1], sys.argv[2]
state = {"w": torch.ones(8)}
if how == "manager":
    mgr = sp.CheckpointManager(root + "/run", async_save=True)
    open(root + "/run/step-000001", "w").write("in the way")   # the save fails in the background
    mgr.save(1, state)
elif how == "bare":
    open(root + "/taken", "w").write("in the way")
    sp.async_save(state, root + "/taken")
elif how == "looked":
    open(root + "/taken", "w").write("in the way")
    try:
        sp.async_save(state, root + "/taken").result()
    except sp.CheckpointExistsError:
        pass
else:
    sp.async_save(state, root + "/fine")
print("the program ends")
"""


@pytest.mark.parametrize("how", ["manager", "bare", "looked", "fine"])
def test_an_async_failure_nothing_waited_for_is_reported_at_exit(how: str, tmp_path: Path) -> None:
    """The last save of a run failed in the background and the program ended without a word
    (exit 0, nothing on stderr): the run's final checkpoint was lost silently."""
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), how], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "the program ends\n", done
    lines = done.stderr.strip().splitlines()
    if how in ("looked", "fine"):
        assert lines == [], done.stderr  # seen by the program, or committed: nothing to say
        assert how == "looked" or sp.load(tmp_path / "fine")["w"].tolist() == [1.0] * 8
        return
    path = tmp_path / ("run/step-000001" if how == "manager" else "taken")
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"shardpoint: error: the async save to {path} failed, and nothing in this program "
                               "waited for it (call .result() on its handle, or CheckpointManager.wait(), before "
                               "the end): "), lines
    assert "exists" in lines[0]


_FORK_SCRIPT = r"""
import os, sys, torch, shardpoint as sp
root = sys.argv[1]
big = {"w": torch.randn(4 << 20)}                       # 16 MiB: still being written at the fork
mgr = sp.CheckpointManager(root + "/run", async_save=True)
mgr.save(1, big)
pending = sp.async_save(big, root + "/parent")
pid = os.fork()
if pid == 0:                                            # the child: its own saves, sync and async
    try:
        sp.save({"c": torch.ones(2)}, root + "/child-sync")
        sp.async_save({"c": torch.ones(3)}, root + "/child-async").result(timeout=60)
        child = sp.CheckpointManager(root + "/child-run", async_save=True)
        child.save(1, {"c": torch.ones(4)})
        child.wait()
        os._exit(0)
    except BaseException as exc:
        print("child:", type(exc).__name__, exc, flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
pending.result()
mgr.wait()
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_saves_in_a_forked_child_run_while_the_parent_s_are_in_flight(tmp_path: Path) -> None:
    """A child forked with a save in flight (a DataLoader worker, an eval process) waited
    forever: its copy of the queue waited on the parent's thread, which is not in it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "child exit 0\n", done
    assert sp.load(tmp_path / "child-sync")["c"].tolist() == [1.0, 1.0]
    assert sp.load(tmp_path / "child-async")["c"].tolist() == [1.0] * 3
    assert sp.CheckpointManager(tmp_path / "child-run").steps() == [1]
    assert torch.equal(sp.load(tmp_path / "parent")["w"], sp.load(tmp_path / "run" / "step-000001")["w"])


def _two_subgroups_worker(rank: int, world: int, root_str: str) -> None:
    import torch.distributed as dist

    root = Path(root_str)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, as torch asks
    mine = pairs[rank // 2]
    handle = sp.async_save({"w": torch.full((4,), float(rank // 2))}, root / f"g{rank // 2}", process_group=mine)
    handle.result()
    everyone = dist.new_group(list(range(world)))  # the job's groups still agree afterwards
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    (root / f"rank{rank}.json").write_text(json.dumps({"sum": total.item()}))


def test_two_subgroups_saving_asynchronously_at_once_neither_hang_nor_cross(tmp_path: Path) -> None:
    """Each queue's background group was made with every rank's new_group call expected: the
    two subgroups' calls made one group between them (the ranks out of step, then a hang),
    and after one subgroup's async save the next new_group of the whole job hung."""
    run_ranks(_two_subgroups_worker, 4, str(tmp_path), timeout=120)
    for g in (0, 1):
        assert sp.load(tmp_path / f"g{g}")["w"].tolist() == [float(g)] * 4
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["sum"] for r in range(4)] == [4.0] * 4


def _non_member_worker(rank: int, world: int, root_str: str) -> None:
    import torch.distributed as dist

    root = Path(root_str)
    pair = dist.new_group([0, 1])
    if rank == 2:  # not in the group it passes
        for name, call in (("save", lambda: sp.save({"w": torch.ones(2)}, root / "ck", process_group=pair)),
                           ("load", lambda: sp.load_into({"w": torch.zeros(2)}, root / "ck", process_group=pair))):
            try:
                call()
                outcome = "returned"
            except sp.CheckpointError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            (root / f"{name}-rank2.txt").write_text(outcome)


def test_a_process_outside_the_group_it_passes_is_refused(tmp_path: Path) -> None:
    """A rank outside process_group: save raised IndexError after writing as a group of one
    into the path the group writes; load_into ran alone without a word."""
    run_ranks(_non_member_worker, 3, str(tmp_path), timeout=120)
    for name in ("save", "load"):
        assert (tmp_path / f"{name}-rank2.txt").read_text() == (
            "InvalidArgumentError: process_group: this process (global rank 2) is not one of its ranks ([0, 1]); "
            "only the group's ranks make the call")
    assert not (tmp_path / "ck").exists()
