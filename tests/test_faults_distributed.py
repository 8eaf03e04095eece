"""Distributed faults on 3 gloo ranks: a rank raising in each phase, a rank killed, a hang.

Every save is a collective save of DTensors (``Shard(0)`` and ``Replicate``) on a 1-D mesh,
so every rank writes files of its own. Each rank records what it raised (type, message,
failed ranks, seconds) in a JSON file; the test compares them across ranks: all ranks raise
a :class:`DistributedCheckpointError` with the same summary naming the failed rank, within
a bounded time (a dead rank is noticed when its connection closes, long before
``CollectiveOptions.timeout_s``), nothing is committed, the previous checkpoint still
loads bit for bit, and no temporary directory is left (or, when the coordinator itself was
killed, the next save removes it). ``tests/test_distributed.py`` already covers a rank
failing its write on 2 ranks (sync, async, both layouts, overwrite).
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _dist_utils import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]

WORLD = 3
ROWS = 4  # rows of the sharded tensor per rank
BOUND_S = 30.0  # how long a rank may take to notice that a peer died (the timeout is 600 s)


def reference(version: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(WORLD * ROWS * 8, dtype=torch.float32).reshape(WORLD * ROWS, 8) + 1000 * version,
        "b": torch.arange(6, dtype=torch.float32) + version,
    }


def sharded(version: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    ref = reference(version)
    return {"w": distribute_tensor(ref["w"], mesh, [Shard(0)]), "b": distribute_tensor(ref["b"], mesh, [Replicate()])}


def record(root: Path, name: str, rank: int, run: Callable[[], Any]) -> None:
    """Run ``run`` and write what it raised to ``root/name-r<rank>.json``."""
    started = time.monotonic()
    doc: dict[str, Any] = {"ok": True}
    try:
        run()
    except Exception as exc:
        doc = {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "failed": sorted(getattr(exc, "failed_ranks", {})),
            "checkpoint_error": isinstance(exc, sp.CheckpointError),
        }
    doc["seconds"] = time.monotonic() - started
    (root / f"{name}-r{rank}.json").write_text(json.dumps(doc))


def outcomes(root: Path, name: str, ranks: list[int]) -> list[dict[str, Any]]:
    return [json.loads((root / f"{name}-r{r}.json").read_text()) for r in ranks]


def assert_same_error(docs: list[dict[str, Any]], victim: int, text: str, where: str) -> None:
    """Every rank raised a DistributedCheckpointError naming ``victim`` with the same summary."""
    for doc in docs:
        assert doc["ok"] is False, f"{where}: a rank did not raise: {doc}"
        assert doc["type"] == "DistributedCheckpointError" and doc["checkpoint_error"], (where, doc)
        assert doc["failed"] == [victim], (where, doc)
        assert f"failed on rank {victim} (rank {victim}: " in doc["message"], (where, doc)
        assert text in doc["message"], (where, text, doc)
        assert doc["seconds"] < BOUND_S, (where, doc)
    summaries = {doc["message"].splitlines()[0] for doc in docs}
    assert len(summaries) == 1, f"{where}: the ranks disagree: {summaries}"


def load_exact(path: Path, version: int, where: str) -> None:
    loaded = sp.load(path)
    for key, expected in reference(version).items():
        assert torch.equal(loaded[key], expected), f"{where}: {key} is not version {version}"


def tmp_entries(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".tmp-" in n)


# ------------------------------------------------------------------ a rank raises


class Injected(RuntimeError):
    pass


def raise_worker(rank: int, world: int, root_str: str, reports: str) -> None:
    import torch.distributed as dist

    import shardpoint._distributed.regular as regular
    import shardpoint._distributed.save as collective
    from shardpoint._distributed.group import Group
    from shardpoint._storage import posix as sp_posix

    if reports == "collectives":  # the path of groups without point to point (NCCL)
        Group._reports_point_to_point = lambda self: False  # type: ignore[method-assign]
    root = Path(root_str)
    sp.save(sharded(1), root / "previous")
    state = sharded(2)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise Injected(f"injected on rank {rank}")

    def eio_rename(*args: Any) -> int:
        import ctypes
        import errno

        ctypes.set_errno(errno.EIO)
        return -1

    # (name, victim rank, module, attribute, replacement, how the save is called)
    cases: list[tuple[str, int, Any, str, Any, str]] = [
        # a chunked save of this (regular) state plans by rules; an hf one from chunk lists
        ("plan", 1, regular, "describe", fail, "sync"),
        ("plan-async", 2, regular, "describe", fail, "async"),
        ("plan-hf", 1, collective, "_plan_local", fail, "hf"),
        ("write", 2, collective, "write_files", fail, "sync"),
        ("write-hf", 1, collective, "write_files", fail, "hf"),
        ("commit", 0, collective, "write_manifest", fail, "sync"),
        ("commit-async", 0, collective, "write_manifest", fail, "async"),
        ("commit-rename-eio", 0, sp_posix, "_renameat2", eio_rename, "overwrite"),
    ]
    for name, victim, module, attr, replacement, how in cases:
        target = root / ("previous" if how == "overwrite" else name)
        real = getattr(module, attr)
        if rank == victim:
            setattr(module, attr, replacement)
        try:
            if how == "async":
                record(root, name, rank, lambda t=target: sp.async_save(state, t).result())
            elif how == "hf":
                record(root, name, rank, lambda t=target: sp.save(state, t, layout="hf"))
            else:
                record(root, name, rank, lambda t=target, o=how == "overwrite": sp.save(state, t, overwrite=o))
        finally:
            setattr(module, attr, real)
        dist.barrier()  # every rank has finished this case (the coordinator has cleaned up)

    # Opening the directory fails on the coordinator alone: a plain file is in the way.
    if rank == 0:
        (root / "blocked").write_text("not a checkpoint")
    dist.barrier()
    record(root, "open", rank, lambda: sp.save(state, root / "blocked", overwrite=True))
    dist.barrier()
    sp.save(state, root / "after")  # the group still works


@pytest.mark.parametrize("reports", ["point-to-point", "collectives"])
def test_a_rank_raising_in_each_phase_fails_every_rank_alike(tmp_path: Path, reports: str) -> None:
    """Outcomes travel point to point through rank 0 on gloo; groups that cannot (NCCL)
    exchange them with object collectives instead, forced here on gloo."""
    run_ranks(raise_worker, WORLD, str(tmp_path), reports, timeout=240)
    ranks = list(range(WORLD))
    expected = {
        "plan": (1, "planning the save", "Injected: injected on rank 1"),
        "plan-async": (2, "planning the save", "Injected: injected on rank 2"),
        "plan-hf": (1, "planning the save", "Injected: injected on rank 1"),
        "write": (2, "writing the checkpoint files", "Injected: injected on rank 2"),
        "write-hf": (1, "writing the checkpoint files", "Injected: injected on rank 1"),
        "commit": (0, "committing the checkpoint", "Injected: injected on rank 0"),
        "commit-async": (0, "committing the checkpoint", "Injected: injected on rank 0"),
        "commit-rename-eio": (0, "committing the checkpoint", "Input/output error"),
        "open": (0, "creating the checkpoint directory", "exists and is not a shardpoint checkpoint"),
    }
    for name, (victim, phase, text) in expected.items():
        docs = outcomes(tmp_path, name, ranks)
        assert_same_error(docs, victim, text, name)
        assert docs[0]["message"].startswith(f"{phase} failed on rank {victim}"), docs[0]
        if name not in ("commit-rename-eio", "open"):
            assert not (tmp_path / name).exists(), f"{name}: something was committed"
    load_exact(tmp_path / "previous", 1, "after a failed overwrite")
    load_exact(tmp_path / "after", 2, "the save after the faults")
    assert (tmp_path / "blocked").read_text() == "not a checkpoint"
    assert tmp_entries(tmp_path) == []


# -------------------------------------------------------------------- a rank dies


def kill_worker(rank: int, world: int, root_str: str, victim: int, where: str) -> None:
    """``victim`` SIGKILLs itself at ``where``: mid-write (after its first data write), also
    with the coordinator held back until it is dead, or in the coordinator's commit (the
    manifest being written, before the rename)."""
    import torch.distributed as dist

    import shardpoint._distributed.save as collective
    from shardpoint._io import files as io_files

    root = Path(root_str)
    sp.save(sharded(1), root / "previous")
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    state = sharded(2)
    if rank == 0 and where == "write-first":
        # The coordinator reaches its report only once the victim is dead (a pidfd becomes
        # readable when the process exits): the "already gone" order, every time.
        real_write = collective.write_files

        def write_after_victim_died(*args: Any, **kwargs: Any) -> Any:
            out = real_write(*args, **kwargs)
            try:
                pidfd = os.pidfd_open(pids[victim])
            except ProcessLookupError:  # dead and already reaped by the launcher: the order wanted
                return out
            try:
                ready, _, _ = select.select([pidfd], [], [], 60)
                assert ready, "the victim did not die"
            finally:
                os.close(pidfd)
            return out

        collective.write_files = write_after_victim_died  # type: ignore[assignment]
    if rank == victim and where.startswith("write"):
        real_pwrite = io_files._pwrite_all

        def pwrite_then_die(fd: int, view: memoryview, offset: int) -> None:
            real_pwrite(fd, view, offset)
            os.kill(os.getpid(), signal.SIGKILL)

        io_files._pwrite_all = pwrite_then_die  # type: ignore[assignment]
    if rank == victim and where == "commit":
        real_manifest = collective.write_manifest

        def manifest_then_die(txn: Any, *args: Any, **kwargs: Any) -> None:
            real_manifest(txn, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        collective.write_manifest = manifest_then_die  # type: ignore[assignment]
    record(root, "killed", rank, lambda: sp.save(state, root / "previous", overwrite=True,
                                                 options=sp.CollectiveOptions(timeout_s=600)))
    # No collective after this: a peer is dead. Leave without waiting for one.


@pytest.mark.parametrize(
    ("victim", "where"),
    [(2, "write"), (2, "write-first"), (0, "commit")],
    ids=["rank2-mid-write", "rank2-dead-before-the-coordinator-reports", "coordinator-mid-commit"],
)
def test_a_rank_killed_mid_save_fails_the_others_promptly(tmp_path: Path, victim: int, where: str) -> None:
    run_ranks(kill_worker, WORLD, str(tmp_path), victim, where, timeout=180, may_be_killed=[victim])
    survivors = [r for r in range(WORLD) if r != victim]
    docs = outcomes(tmp_path, "killed", survivors)
    text = "stopped responding: its process died or dropped the connection"
    if victim == 0:
        text = "the coordinator stopped responding"
    assert_same_error(docs, victim, text, f"rank {victim} killed in {where}")
    assert not (tmp_path / f"killed-r{victim}.json").exists()
    load_exact(tmp_path / "previous", 1, "after the kill")  # the overwrite never committed
    if victim != 0:
        assert tmp_entries(tmp_path) == []  # the coordinator cleaned up before raising
    else:
        assert len(tmp_entries(tmp_path)) == 1  # the dead coordinator's, manifest and all
        with pytest.raises(sp.IncompleteCheckpointError):
            sp.load(tmp_path / tmp_entries(tmp_path)[0])
        sp.save(reference(3), tmp_path / "previous", overwrite=True)  # the next save cleans up
        assert tmp_entries(tmp_path) == []
        load_exact(tmp_path / "previous", 3, "the next save")


# -------------------------------------------------------------------- a rank hangs


def hang_worker(rank: int, world: int, root_str: str) -> None:
    """Rank 1 stops (a stuck disk) in its write for longer than the collective timeout."""
    import shardpoint._distributed.save as collective

    root = Path(root_str)
    state = sharded(2)
    if rank == 1:
        real = collective.write_files

        def stuck(*args: Any, **kwargs: Any) -> Any:
            threading.Event().wait(5)  # nothing sets it: the rank is stuck for 5 s
            return real(*args, **kwargs)

        collective.write_files = stuck  # type: ignore[assignment]
    record(root, "hang", rank, lambda: sp.save(state, root / "ckpt", options=sp.CollectiveOptions(timeout_s=2)))


def test_a_hanging_rank_is_given_up_on_after_the_collective_timeout(tmp_path: Path) -> None:
    run_ranks(hang_worker, WORLD, str(tmp_path), timeout=120)
    coordinator, stuck, other = outcomes(tmp_path, "hang", [0, 1, 2])
    # The coordinator names the rank that did not report in time...
    assert coordinator["failed"] == [1], coordinator
    assert "rank 1: stopped responding: it sent no report within 2 s" in coordinator["message"], coordinator
    assert 2 <= coordinator["seconds"] < BOUND_S, coordinator
    # ...and gloo then closes all its connections, so the others learn only that the
    # coordinator gave up (its error names the hung rank): every rank fails, none hangs.
    for doc in (stuck, other):
        assert doc["type"] == "DistributedCheckpointError" and 0 in doc["failed"], doc
        assert "the coordinator stopped responding" in doc["message"], doc
        assert doc["seconds"] < BOUND_S, doc
    assert not (tmp_path / "ckpt").exists()
    assert tmp_entries(tmp_path) == []


def sub_mesh_worker(rank: int, world: int, root_str: str) -> None:
    """Ranks 0 and 1 save a DTensor on a mesh of just those two, without process_group: the
    save runs over the default group, and rank 2 (outside the mesh) never makes the call."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = Path(root_str)
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]))  # every rank builds it; rank 2 is outside
    if rank == 2:  # alive, connected, and busy with something else until the others have failed
        deadline = time.monotonic() + 60  # (a fixed sleep ran out first on a loaded machine: "died")
        while not all((root / f"submesh-r{r}.json").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    w = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    record(root, "submesh", rank, lambda: sp.save({"w": w}, root / "ckpt", options=sp.CollectiveOptions(timeout_s=2)))


def test_a_dtensor_on_a_sub_mesh_saved_without_its_group_says_how_to_give_it(tmp_path: Path) -> None:
    """The error blamed a dead coordinator (rank 1) or a hung rank 2 alone; it now says the
    default group was taken because of the DTensors, and to pass the mesh's group."""
    run_ranks(sub_mesh_worker, WORLD, str(tmp_path), timeout=120)
    hint = ("This call runs over the default group (3 ranks) because the state holds DTensors and no "
            "process_group was given, so every rank of the default group must make it; for DTensors on a mesh "
            "of fewer ranks, pass process_group= the group of the mesh's ranks")
    coordinator, other = outcomes(tmp_path, "submesh", [0, 1])
    assert coordinator["failed"] == [2], coordinator
    assert "rank 2: stopped responding: it sent no report within 2 s; it hangs, never made this call" in \
        coordinator["message"], coordinator
    for doc in (coordinator, other):
        assert doc["type"] == "DistributedCheckpointError" and hint in doc["message"], doc
        assert doc["seconds"] < BOUND_S, doc
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------ ranks out of step


class Unsaveable:
    """An object whose state_dict() fails on one rank only: before the ranks meet."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise Injected("state_dict failed on this rank")
        return {"x": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def out_of_step_worker(rank: int, world: int, root_str: str) -> None:
    import torch.distributed as dist

    root = Path(root_str)
    group = dist.group.WORLD
    with sp.using(collective=sp.CollectiveOptions(timeout_s=60)):
        # Collecting the state fails on rank 1 before any exchange: every rank raises it.
        record(root, "collect", rank, lambda: sp.save(
            {**sharded(1), "obj": Unsaveable(rank == 1)}, root / "s1", process_group=group))
        # The same through a manager (its own phases come first).
        mgr = sp.CheckpointManager(root / "run", process_group=group)
        record(root, "collect-mgr", rank, lambda: mgr.save(1, {**sharded(1), "obj": Unsaveable(rank == 1)}))
        dist.barrier()
        # No process_group: a state holding DTensors saves over the default group; the same.
        record(root, "collect-default", rank, lambda: sp.save(
            {**sharded(1), "obj": Unsaveable(rank == 1)}, root / "s3"))
        default_mgr = sp.CheckpointManager(root / "run-default")
        record(root, "collect-default-mgr", rank, lambda: default_mgr.save(
            1, {**sharded(1), "obj": Unsaveable(rank == 1)}))
        dist.barrier()
        # Ranks given different paths: refused on every rank, nothing written anywhere.
        record(root, "paths", rank, lambda: sp.save(sharded(2), root / f"p{rank}", process_group=group))
        dist.barrier()
        # One rank asking to overwrite what the others would not: refused on every rank.
        record(root, "args", rank, lambda: sp.save(sharded(2), root / "s2", process_group=group,
                                                   overwrite=rank == 1))
        dist.barrier()
        # The group is still in step: the next saves work and hold exactly their version.
        sp.save(sharded(3), root / "s2", process_group=group)
        mgr.save(2, sharded(3))


ARGS = " (overwrite=False, layout=chunked, max_shard_size=5000000000)"
"""The arguments a collective save's ranks must agree on, as its identity shows them."""


def test_ranks_out_of_step_fail_together_and_save_nothing(tmp_path: Path) -> None:
    """A rank whose state cannot be collected used to raise alone: the others waited in the
    save, met that rank's next save and committed a mix of the two (rows of rank 0 from the
    first, of rank 1 from the second; verify passed). Different paths on different ranks
    went, silently, all to rank 0's."""
    run_ranks(out_of_step_worker, WORLD, str(tmp_path), timeout=240)
    ranks = list(range(WORLD))
    for name in ("collect", "collect-mgr", "collect-default", "collect-default-mgr"):
        docs = outcomes(tmp_path, name, ranks)
        assert_same_error(docs, 1, "Injected: state_dict failed on this rank", name)
        assert all(doc["message"].startswith("planning the save failed on rank 1") for doc in docs), docs
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s3").exists()
    assert sp.CheckpointManager(tmp_path / "run-default").steps() == []
    for doc in outcomes(tmp_path, "paths", ranks):
        assert doc["ok"] is False and doc["type"] == "DistributedCheckpointError", doc
        assert doc["message"].startswith(
            f"planning the save failed on rank 0 (rank 0: DistributedCheckpointError: the ranks are out of "
            f"step (rank 0: 'saving to {tmp_path / 'p0'}{ARGS}'; rank 1: 'saving to {tmp_path / 'p1'}{ARGS}'; "
            f"rank 2: 'saving to {tmp_path / 'p2'}{ARGS}'): every rank must make the same call (the same path "
            "and arguments)"), doc
    for doc in outcomes(tmp_path, "args", ranks):  # overwrite asked by one rank only: refused on every rank
        assert doc["ok"] is False and doc["type"] == "DistributedCheckpointError", doc
        assert "rank 1: 'saving to " + str(tmp_path / "s2") + " (overwrite=True, " in doc["message"], doc
    assert not any((tmp_path / f"p{r}").exists() for r in ranks)
    load_exact(tmp_path / "s2", 3, "s2")
    assert sp.CheckpointManager(tmp_path / "run").steps() == [2]
    load_exact(tmp_path / "run" / "step-000002", 3, "step 2")
    assert tmp_entries(tmp_path) == [] and tmp_entries(tmp_path / "run") == []


def disagreeing_worker(rank: int, world: int, root_str: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = Path(root_str)
    group = dist.group.WORLD
    with sp.using(collective=sp.CollectiveOptions(timeout_s=60)):
        # A plain tensor (taken as replicated) of another shape, or dtype, on one rank.
        record(root, "shape", rank, lambda: sp.save({"a": torch.zeros(6 + (rank == 1))}, root / "shape",
                                                    process_group=group))
        record(root, "dtype", rank, lambda: sp.save({"a": torch.zeros(4, dtype=torch.int64 if rank == 1 else
                                                                      torch.float32)}, root / "dtype",
                                                    process_group=group, layout="hf"))
        # Replicated plain tensors whose values drifted apart on one rank: its last element only (a
        # large tensor, written as row pieces by several ranks), a module built from each rank's seed.
        drift = torch.arange(2_200_000.0)
        drift[-1] += rank == 2
        record(root, "values", rank, lambda: sp.save({"a": torch.zeros(3), "b": drift}, root / "values",
                                                     process_group=group))
        # The same beside entries of each rank's own (the trees differ: compared tensor by tensor).
        record(root, "own-keys", rank, lambda: sp.save({"b": drift, f"count_rank{rank}": torch.tensor(rank)},
                                                       root / "own-keys", process_group=group))
        shared = torch.arange(4.0)
        record(root, "tie", rank, lambda: sp.save({"a": shared, "b": shared if rank == 0 else shared.clone()},
                                                  root / "tie", process_group=group))
        # A module's buffers are not compared: under DDP BatchNorm's running statistics are each
        # rank's own until the next forward broadcasts rank 0's (a ResNet could not be saved).
        norm = torch.nn.BatchNorm1d(3)
        norm.running_mean.fill_(float(rank))
        record(root, "buffers", rank, lambda: sp.save(norm, root / "buffers", process_group=group))
        torch.manual_seed(rank)
        record(root, "seeded", rank, lambda: sp.save(torch.nn.Linear(4, 2), root / "seeded", process_group=group,
                                                     layout="hf"))
        # A DTensor on the 3-rank mesh saved over a group of 2: rank 2's rows are in no one's save.
        mesh = init_device_mesh("cpu", (world,))
        # A DTensor placed Replicate() whose copies drifted: 17 MB, written as row pieces by every
        # rank, so committed as a mix of rows no rank held (verify passed it).
        from torch.distributed.tensor import DTensor, Replicate

        copy = DTensor.from_local(torch.full((4_200_000,), float(rank == 1)), mesh, [Replicate()], run_check=False)
        record(root, "replicate", rank, lambda: sp.save({"r": copy}, root / "replicate", process_group=group))
        record(root, "replicate-async", rank, lambda: sp.async_save({"r": copy}, root / "replicate-async",
                                                                    process_group=group).result())
        # The first async save, where one rank's state cannot be prepared: the others waited in the
        # collective that makes the background group, past every timeout.
        sharded = {"w": distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])}
        odd_one = {"model": sharded, "extra": {"x": object() if rank == 1 else 1}}
        record(root, "async-prepare", rank, lambda: sp.async_save(odd_one, root / "async-prepare").result())
        # An argument refused on one rank (a size it cannot parse, a step that is no step): the
        # others waited out the collective timeout, then blamed that rank for hanging.
        record(root, "bad-size", rank, lambda: sp.save(sharded, root / "bad-size",
                                                       max_shard_size="zz" if rank == 1 else "1GB"))
        manager = sp.CheckpointManager(root / "run", process_group=group)
        record(root, "bad-step", rank, lambda: manager.restore(sharded, step=-1 if rank == 1 else None))
        w = distribute_tensor(torch.arange(15.0).reshape(5, 3), mesh, [Shard(0)])
        pair = dist.new_group([0, 1])
        if rank in (0, 1):
            record(root, "mesh", rank, lambda: sp.save({"w": w}, root / "mesh", process_group=pair))
        dist.barrier()
        # Local shards of 2, 2 and 3 rows declared a (7, 3) tensor: torch's placements give 3, 3 and 1.
        odd = DTensor.from_local(torch.ones(3 if rank == 2 else 2, 3), mesh, [Shard(0)], shape=(7, 3),
                                 stride=(3, 1), run_check=False)
        record(root, "bounds", rank, lambda: sp.save({"w": odd}, root / "bounds"))
        # Plain tensors and no process_group: each rank saves alone; the second finds the first's.
        if rank == 0:
            sp.save({"a": torch.zeros(2)}, root / "alone")
        dist.barrier()
        if rank == 1:
            record(root, "alone", rank, lambda: sp.save({"a": torch.zeros(2)}, root / "alone"))


def test_ranks_that_disagree_on_a_tensor_save_nothing(tmp_path: Path) -> None:
    """Each committed on every rank ("OK") a checkpoint that loads rank 0's copy or that
    sp.load refuses as damaged; now refused on every rank before anything is written."""
    run_ranks(disagreeing_worker, WORLD, str(tmp_path), timeout=240)
    expected = {
        "shape": "tensor 'a' of component 'model' is F32[6] on rank 0 but F32[7] on rank 1: in a collective save a "
                 "tensor has one shape and dtype on every rank (a plain tensor is taken as replicated, a DTensor's "
                 "global shape as its placements give it)",
        "dtype": "tensor 'a' of component 'model' is F32[4] on rank 0 but I64[4] on rank 1",
        "values": "tensor 'b' of component 'model' holds different values on rank 0 and rank 2: in a collective "
                  "save a plain tensor (or a DTensor placed Replicate()) is taken as the same on every rank "
                  "(replicated, as DDP keeps it) and written once, so one rank's values (or a mix of rows of several) "
                  "would be committed. Make the ranks agree (the same seed, gradients reduced), shard it, or put what "
                  "differs under a key of each rank's own. Nothing was saved",
        "async-prepare": "state at extra['x'] is a builtins.object, which shardpoint cannot store",
        "replicate": "tensor 'r' of component 'model' holds different values on rank 0 and rank 1: in a collective "
                     "save a plain tensor (or a DTensor placed Replicate()) is taken as the same on every rank",
        "replicate-async": "tensor 'r' of component 'model' holds different values on rank 0 and rank 1",
        "seeded": "tensor 'weight' of component 'model' holds different values on rank 0 and rank 1",
        "own-keys": "tensor 'b' of component 'model' holds different values on rank 0 and rank 2",
        "tie": "tensor 'b' of component 'model' is tied to 'a' on rank 0 (one tensor) but a tensor of its own on "
               "rank 1: in a collective save every rank ties the same weights; tie them on every rank, or on none. "
               "Nothing was saved",
        "mesh": "tensor 'w' of component 'model': the ranks of this save hold 12 of its 15 elements in chunks that "
                "do not tile it (a DTensor whose mesh has ranks outside process_group?)",
        "bounds": "tensor 'w' of component 'model': rank 2's chunk at [6, 0] of shape [3, 3] lies outside its shape "
                  "[7, 3]",
    }
    assert [d["ok"] for d in outcomes(tmp_path, "buffers", list(range(WORLD)))] == [True] * WORLD
    assert sp.load(tmp_path / "buffers")["running_mean"].tolist() in ([float(r)] * 3 for r in range(WORLD))
    (alone,) = outcomes(tmp_path, "alone", [1])
    assert alone["type"] == "CheckpointExistsError" and alone["message"] == (
        f"{tmp_path / 'alone'} already exists; pass overwrite=True to replace it, or save to a new path. "
        f"torch.distributed runs {WORLD} ranks and this save was this process's alone (a state of plain tensors, no "
        "process_group=): if every rank saves this path, another rank's save is what is there; save from one rank "
        "(if dist.get_rank() == 0), or collectively with process_group=dist.group.WORLD"), alone
    for name, text in expected.items():
        ranks = [0, 1] if name == "mesh" else list(range(WORLD))
        for doc in outcomes(tmp_path, name, ranks):
            assert doc["ok"] is False and doc["type"] == "DistributedCheckpointError", doc
            assert f"InvalidStateError: {text}" in doc["message"], doc
        assert not (tmp_path / name).exists()
    refused = {"bad-size": "InvalidSizeError: cannot parse size 'zz'",
               "bad-step": "InvalidArgumentError: CheckpointManager.restore: step must be a non-negative int, not -1"}
    for name, text in refused.items():  # every rank at once, naming rank 1's error
        for doc in outcomes(tmp_path, name, list(range(WORLD))):
            assert doc["ok"] is False and doc["type"] == "DistributedCheckpointError", doc
            assert f"failed on rank 1 (rank 1: {text}" in doc["message"], doc
