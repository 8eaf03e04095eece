"""Asynchronous saves: stage -> persist -> commit, through a queue that a caller owns.

An :class:`AsyncQueue` is one series of async saves: one background thread, one staging
buffer allocated once and reused by every later save of the series (pinned when CUDA is
available, so host memory stays flat save after save), and the handle of its last save.
The caller is blocked only while tensors are copied into the buffer; writing and the
atomic commit run on the queue's thread, and the next save of the same queue waits for
the previous one to commit before it reuses the buffer.

Queues are independent: each ``CheckpointManager`` and each ``ShardpointTrainer`` owns
one, so one's saves never wait on another's, and a failure is reported by the owner whose
save failed. Bare ``sp.async_save`` calls (and ``sp.save``'s check for an unseen failure
of one) share the process's default queue, :func:`default_queue`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ._distributed.group import Group, local_chunk
from ._distributed.regular import mesh_layout
from ._gc import collector_paused
from ._prepare import Component, PreparedState
from ._printable import printable
from ._write import SaveInfo
from .errors import PreviousSaveFailedError

_ALIGN = 64


class StagingPool:
    """One growable host buffer, reused across saves."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def acquire(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one before allocating the larger one
            pin = torch.cuda.is_available()
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        return self._buffer


def stage(prepared: PreparedState, pool: StagingPool) -> PreparedState:
    """Copy every stored tensor into the pool's buffer; aliases keep pointing at their twin."""
    offsets: list[tuple[Component, str, int]] = []
    cursor = 0
    for comp in prepared.components:
        for name in comp.stored:
            t = local_chunk(comp.tensors[name])[2]
            offsets.append((comp, name, cursor))
            cursor += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
    arena = pool.acquire(cursor)
    staged: dict[str, dict[str, torch.Tensor]] = {c.name: {} for c in prepared.components}
    cuda_used = False
    placements = {c.name: dict(c.placements) for c in prepared.components}
    layouts = {c.name: dict(c.layouts) for c in prepared.components}
    meshes: dict[int, tuple[int, ...]] = {}
    typed: dict[torch.dtype, torch.Tensor] = {}
    """The arena as each dtype (offsets are multiples of ``_ALIGN``, so of every itemsize)."""
    cpu_dst: list[torch.Tensor] = []
    cpu_src: list[torch.Tensor] = []
    with torch.no_grad():
        for comp, name, offset in offsets:
            tensor = comp.tensors[name]
            if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
                src = tensor
            else:
                global_shape, chunk_offsets, src = local_chunk(tensor)
                if src is not tensor:  # a DTensor: keep where its shard sits, and its mesh layout
                    placements[comp.name][name] = (global_shape, chunk_offsets)
                    layouts[comp.name][name] = mesh_layout(tensor, meshes)
            view = typed.get(src.dtype)
            if view is None:
                view = typed[src.dtype] = arena[: arena.numel() // src.element_size() * src.element_size()].view(
                    src.dtype)
            start = offset // src.element_size()
            dst = view[start : start + src.numel()].view(src.shape)
            if src.device.type == "cuda":
                cuda_used = True
                dst.copy_(src, non_blocking=True)
            else:  # copied together below: one call for all, not one per tensor
                cpu_dst.append(dst)
                cpu_src.append(src)
            staged[comp.name][name] = dst
        if cpu_dst:
            torch._foreach_copy_(cpu_dst, cpu_src)
    if cuda_used:
        torch.cuda.synchronize()
    components = []
    for comp in prepared.components:
        tensors = dict(staged[comp.name])
        for alias, stored in comp.aliases.items():
            tensors[alias] = tensors[stored]
        components.append(
            Component(comp.name, comp.tree, tensors, list(comp.stored), dict(comp.aliases), placements[comp.name],
                      dict(comp.hf_storage), comp.parameters, comp.buffers, layouts[comp.name])
        )
    return PreparedState(components, prepared.flat)


class AsyncSave:
    """Handle of a save running in the background.

    ``staged()`` is true once the state may be mutated again (``async_save`` returns only
    then); ``result()`` waits until the checkpoint is committed and durable and returns
    its :class:`SaveInfo`, re-raising any background error with its traceback.
    """

    def __init__(self, path: str, future: Future[SaveInfo], stall_seconds: float) -> None:
        self.path = path
        self._future = future
        self.stall_seconds = stall_seconds
        """Seconds the caller was blocked (waiting for the previous save + staging)."""
        self.observed = False
        """Its outcome reached the caller: ``result()`` returned or raised its error (not a
        timeout, not a Ctrl-C while waiting), or the next save or ``wait()`` raised it."""
        self.committed = threading.Event()
        """Set once the checkpoint was committed (a later step, ``on_commit``, may still fail)."""

    def staged(self) -> bool:
        """True: the state was copied before ``async_save`` returned; it is safe to mutate."""
        return True

    def done(self) -> bool:
        """Whether the background work finished (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait for the commit; return its SaveInfo or raise the background error."""
        try:
            info = self._future.result(timeout)
        except BaseException as exc:
            # Only the save's own error counts as seen: after a timeout or a Ctrl-C while
            # waiting, the next save, wait() or the exit report still raise it.
            if self._future.done() and not self._future.cancelled() and exc is self._future.exception(0):
                self.observed = True
            raise
        self.observed = True
        return info

    def wait(self) -> None:
        """Wait for the background work to finish, without taking its error: an error nobody
        looked at is still raised by the next save, or reported at exit."""
        futures.wait([self._future])

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the background work; return its error (None when it committed). Only
        ``result()`` counts as seeing it: an error not raised there is still raised by the
        next save, or reported at exit."""
        return self._future.exception(timeout)


class AsyncQueue:
    """One series of async saves: a background thread, a reused staging buffer, the last
    save's handle, and the gloo twins of the groups its saves run over.

    Saves submitted to one queue are serialized (the next one is staged once the previous
    one committed, as they share the buffer); saves of different queues run independently.
    """

    def __init__(self) -> None:
        self.pool = StagingPool()
        self.last: AsyncSave | None = None
        """The handle of the last save submitted (None before the first)."""
        self._executor: ThreadPoolExecutor | None = None  # started with the first save
        self._lock = threading.Lock()
        self._twins: dict[int, tuple[Any, Group]] = {}
        _queues.add(self)

    def _forget_parent(self) -> None:
        """In a child made by ``fork()``: the parent's thread is not in this process, so its
        last save is the parent's business; this queue starts afresh (a save here would
        wait forever for work no thread runs)."""
        self.last = None
        self._executor = None
        self._lock = threading.Lock()
        self._twins = {}

    def unseen_failure(self) -> str | None:
        """What to say at exit of a finished save that failed and that nobody looked at."""
        last = self.last
        if last is None or last.observed or not last.done():
            return None
        exc = last._future.exception()
        if exc is None:
            return None
        return (f"shardpoint: error: the async save to {printable(last.path)} failed, and nothing in this program "
                f"waited for it (call .result() on its handle, or CheckpointManager.wait(), before the end): "
                f"{printable(str(exc))}")

    def background_group(self, group: Group) -> Group:
        """A gloo group twin of ``group`` for this queue's background collectives.

        Collectives must not run on the training process group from another thread, so an
        async collective save talks over its own group, created once per queue (collectively,
        on the queue's first async save over ``group``) and reused. Each queue has its own
        twin: two queues' threads never interleave collectives on one group.
        """
        if not group.distributed:
            return group
        entry = self._twins.get(id(group.pg))
        if entry is None or entry[0] is not group.pg:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group.pg)
            # Made by the group's own ranks alone (torch's default asks every rank of the job:
            # two subgroups making theirs at once got one group between them, and hung).
            local = len(ranks) < dist.get_world_size()
            entry = (group.pg, Group(dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=local)))
            self._twins[id(group.pg)] = entry
        return entry[1]

    def raise_unobserved_failure(self) -> None:
        """Raise the error of this queue's previous save if nobody has seen it yet.

        Waits for that save to finish first: a save that is still running when the next one
        starts may yet fail, and its error must not depend on how fast it failed.
        """
        last = self.last
        if last is None or last.observed:
            return
        exc = last._future.exception()  # waits for it to finish
        if exc is None or last.observed:
            return
        last.observed = True
        outcome = (" after its commit (the checkpoint there is whole)" if last.committed.is_set()
                   else " and nothing was committed there")
        raise PreviousSaveFailedError(
            f"the previous async save to {last.path} failed{outcome}: "
            f"{exc}. Call .result() on async_save handles to see such errors where they happen"
        ) from exc

    def wait_previous(self) -> None:
        """Block until this queue's previous save finished; raise its error if unseen."""
        self.raise_unobserved_failure()
        last = self.last
        if last is not None:
            last.wait()  # an error seen already: just wait for the end

    def submit(
        self,
        prepared: PreparedState,
        target: str,
        persist: Callable[[PreparedState], SaveInfo],
        *,
        started: float,
    ) -> AsyncSave:
        """Wait for this queue's previous save, stage ``prepared``, and run
        ``persist(staged)`` on the queue's thread (the ``transformers`` Trainer integration
        writes its extra files this way)."""
        with self._lock:
            self.wait_previous()
            with collector_paused():
                staged = stage(prepared, self.pool)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardpoint-async")
            handle = AsyncSave(target, self._executor.submit(persist, staged), time.perf_counter() - started)
            self.last = handle
        return handle

    @property
    def staging_bytes(self) -> int:
        """Bytes held by this queue's reusable staging buffer."""
        return self.pool.nbytes


_queues: weakref.WeakSet[AsyncQueue] = weakref.WeakSet()
"""Every queue of this process: told of a ``fork()``, and asked at exit for failures
nobody saw."""


def _after_fork_in_child() -> None:
    for queue in list(_queues):
        queue._forget_parent()


def _report_unseen_failures() -> None:
    """At exit (after the queues' threads finished their last saves): a save that failed
    where nothing looked would otherwise end the program without a word."""
    for queue in list(_queues):
        message = queue.unseen_failure()
        if message is not None:
            print(message, file=sys.stderr, flush=True)


def _finish_pending_saves() -> None:
    """At interpreter shutdown, before ``concurrent.futures`` refuses new work: let each
    queue's last save run to its end. Run later, a save whose store opens connections
    through an executor (s3fs resolving a host) failed with "cannot schedule new futures
    after interpreter shutdown", and the program's last checkpoint was lost. Its outcome is
    left for :func:`_report_unseen_failures`."""
    pending = [q.last._future for q in list(_queues) if q.last is not None]
    if pending:
        futures.wait(pending)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_report_unseen_failures)
# threading's exit hooks run in reverse order of registration, and before the one
# concurrent.futures registered when it was imported (above): so before it stops executors.
threading._register_atexit(_finish_pending_saves)  # type: ignore[attr-defined]

_default = AsyncQueue()


def default_queue() -> AsyncQueue:
    """The queue of bare ``sp.async_save`` calls in this process."""
    return _default


def raise_unobserved_failure() -> None:
    """Raise the unseen error of the previous bare ``sp.async_save``, if any (``sp.save``
    and ``sp.async_save`` call this first)."""
    _default.raise_unobserved_failure()


def submit_prepared(
    prepared: PreparedState,
    target: str,
    persist: Callable[[PreparedState], SaveInfo],
    *,
    started: float,
) -> AsyncSave:
    """:meth:`AsyncQueue.submit` on the default queue."""
    return _default.submit(prepared, target, persist, started=started)


def staging_bytes() -> int:
    """Bytes held by the default queue's reusable staging buffer (for tests and benchmarks)."""
    return _default.staging_bytes
