"""Asynchronous saves: stage -> persist -> commit.

The caller is blocked only while tensors are copied into staging buffers, which are
allocated once and reused by every later save (pinned when CUDA is available), so host
memory stays flat save after save. Writing and the atomic commit run on one background
thread; a second save waits for the first to commit before it reuses the buffers.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ._distributed.group import Group, local_chunk, resolve_group
from ._gc import collector_paused
from ._prepare import Component, PreparedState, prepare_state
from ._save import check_options, write_prepared
from ._sizes import parse_size
from ._write import SaveInfo, json_metadata
from .errors import CheckpointError

_ALIGN = 64
_background_groups: dict[int, Group] = {}


def background_group(group: Group) -> Group:
    """A gloo group twin of ``group`` for the background thread's collectives.

    Collectives must not run on the training process group from another thread, so an
    async collective save talks over its own group, created once (collectively, on the
    first async save) and reused.
    """
    if not group.distributed:
        return group
    key = id(group.pg)
    if key not in _background_groups:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group.pg)
        _background_groups[key] = Group(dist.new_group(ranks=ranks, backend="gloo"))
    return _background_groups[key]


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
                if src is not tensor:  # a DTensor: keep where its shard sits
                    placements[comp.name][name] = (global_shape, chunk_offsets)
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
                      dict(comp.hf_storage), comp.parameters)
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

    def staged(self) -> bool:
        """True: the state was copied before ``async_save`` returned; it is safe to mutate."""
        return True

    def done(self) -> bool:
        """Whether the background work finished (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait for the commit; return its SaveInfo or raise the background error."""
        self.observed = True
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)


_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardpoint-async")
_pool = StagingPool()
_lock = threading.Lock()
_last: AsyncSave | None = None


def raise_unobserved_failure() -> None:
    """Raise the error of the previous async save if nobody has seen it yet.

    Waits for that save to finish first: a save that is still running when the next one
    starts may yet fail, and its error must not depend on how fast it failed.
    """
    last = _last
    if last is None or last.observed:
        return
    exc = last.exception()  # waits for it to finish
    if exc is None or last.observed:
        return
    last.observed = True
    raise CheckpointError(
        f"the previous async save to {last.path} failed and nothing was committed there: "
        f"{exc}. Call .result() on async_save handles to see such errors where they happen"
    ) from exc


def wait_previous() -> None:
    """Block until the previous async save (if any) finished; raise its error if unseen."""
    raise_unobserved_failure()
    last = _last
    if last is not None:
        last._future.exception()  # an error seen already: just wait for the end


def async_save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    layout: str | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = False,
    durable: bool = True,
    allow_pickle: bool = False,
    on_commit: Callable[[SaveInfo], None] | None = None,
) -> AsyncSave:
    """Save in the background; return once the state is staged and safe to mutate.

    Takes the same arguments as :func:`save`. The caller is blocked for the staging copy
    (and, if one is still running, for the previous async save to commit). Errors raised
    in the background surface on ``.result()`` and, if never looked at, on the next save.

    Args:
        on_commit: called on the background thread with the SaveInfo after the commit.

    Returns:
        An :class:`AsyncSave` handle.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> w = torch.ones(3)
        >>> handle = sp.async_save({"w": w}, os.path.join(tempfile.mkdtemp(), "ckpt"))
        >>> w.add_(1)  # safe: the save holds its own copy
        tensor([2., 2., 2.])
        >>> handle.result().tensor_bytes
        12
    """
    started = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    check_options(layout, storage_options)
    meta = json_metadata(metadata)
    with collector_paused():
        prepared = prepare_state(state, allow_pickle=allow_pickle)
    target = os.fspath(path)
    # created here, on the caller's thread: making the twin group is a collective
    group = background_group(resolve_group(process_group, prepared.all_tensors()))

    def persist(staged: PreparedState) -> SaveInfo:
        info = write_prepared(
            staged,
            target,
            group=group,
            layout=layout,
            max_shard_bytes=max_bytes,
            overwrite=overwrite,
            metadata=meta,
            durable=durable,
            progress=progress,
            storage_options=storage_options,
        )
        if on_commit is not None:
            on_commit(info)
        return info

    return submit_prepared(prepared, target, persist, started=started)


def submit_prepared(
    prepared: PreparedState,
    target: str,
    persist: Callable[[PreparedState], SaveInfo],
    *,
    started: float,
) -> AsyncSave:
    """Wait for the previous async save, stage ``prepared``, and run ``persist(staged)``
    on the background thread; the one queue every async save goes through (the
    ``transformers`` Trainer integration writes its extra files this way)."""
    global _last
    with _lock:
        wait_previous()
        with collector_paused():
            staged = stage(prepared, _pool)
        handle = AsyncSave(target, _executor.submit(persist, staged), time.perf_counter() - started)
        _last = handle
    return handle


def staging_bytes() -> int:
    """Bytes held by the reusable staging buffer (for tests and benchmarks)."""
    return _pool.nbytes
