"""save / async_save: orchestration only (prepare -> [stage] -> write -> commit)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

from ._async import AsyncQueue, AsyncSave, default_queue, raise_unobserved_failure
from ._distributed.group import Group, resolve_group
from ._flags import check_flags
from ._gc import collector_paused
from ._load.into import load_into
from ._load.new import load
from ._load.result import LoadResult
from ._options import OptionsArg, applied, merged, using
from ._prepare import PreparedState, prepare_state
from ._sizes import parse_size
from ._write import SaveInfo, json_metadata, write_checkpoint
from .errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = ["AsyncSave", "LoadResult", "SaveInfo", "async_save", "load", "load_into", "save"]


def check_options(layout: str | None, storage_options: Any) -> None:
    if layout not in (None, "hf", "chunked"):
        raise InvalidArgumentError(
            f"unknown layout {layout!r}; use 'hf' (whole tensors) or 'chunked' (per-rank files)"
        )
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise InvalidArgumentTypeError(
            f"storage_options must be a dict of fsspec filesystem options, not {type(storage_options).__name__}"
        )


def write_prepared(prepared: PreparedState, path: str | os.PathLike[str], *, group: Group, layout: str | None,
                   **settings: Any) -> SaveInfo:
    """Write with the one writer: layout ``hf`` by default in one process, ``chunked`` in a
    collective save."""
    chosen = layout or ("chunked" if group.distributed else "hf")
    return write_checkpoint(prepared, path, group=group, layout=chosen, **settings)


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    layout: str | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    durable: bool = True,
    allow_pickle: bool = False,
    options: OptionsArg = None,
) -> SaveInfo:
    """Save a state dict (or nested training state) as an atomic, sharded checkpoint.

    A flat ``dict[str, Tensor]`` (or an ``nn.Module``) becomes the component ``model``:
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, exactly what
    ``transformers`` reads. In a nested state each top-level key is a component with its
    own files (``optim-…``); modules, optimizers (keyed by parameter name), LR schedulers,
    ``Stateful`` objects, containers and JSON values are all stored. ``shardpoint.json`` is
    written last; the directory appears at ``path`` only once everything is on disk.

    Args:
        state: ``model.state_dict()``, a module, or a mapping of components.
        path: the checkpoint directory to create, or an fsspec URL (``s3://bucket/run/step-100``,
            ``gs://…``, ``memory://…``; needs ``pip install 'shardpoint[s3]'`` for S3). On an
            object store the data objects are uploaded concurrently (multipart, discarded on
            failure), then the indexes, then ``shardpoint.json`` last: a prefix without it
            never loads.
        max_shard_size: largest data file, e.g. ``"5GB"`` (10^9) or ``"5GiB"`` (2^30), or an int.
        layout: ``"hf"`` (every tensor whole, HF files; the default in one process) or
            ``"chunked"`` (each rank writes the chunks it holds to its own files; the
            default for collective saves).
        process_group: save collectively: every rank of the group calls ``save`` with its
            own shards. Without it, a state holding DTensors is saved over the default group.
        overwrite: replace an existing checkpoint at ``path`` (atomically; files in it
            that the checkpoint does not own are kept). An existing empty directory is
            written into without it.
        metadata: JSON values stored in the manifest.
        storage_options: options of the URL's fsspec filesystem, e.g. for S3 ``{"key": …,
            "secret": …, "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}``.
        progress: show a progress bar (default: when stderr is a terminal).
        durable: fsync files and directories before returning (default True).
        allow_pickle: pickle values that are not tensors, containers or JSON (loading them
            then needs ``allow_pickle=True`` too).
        options: tunables for this call: an :class:`IOOptions` (threads, segment size),
            :class:`RemoteOptions` (retries, upload parts), :class:`CollectiveOptions`
            (timeout), several of them in a list, or an :class:`Options`; groups not given
            are the ones in effect (:func:`shardpoint.using`, else the defaults).

    Returns:
        A :class:`SaveInfo` with the files written and their sizes.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False.
        StorageError: the object store failed (after bounded retries of transient errors).
        InvalidStateError: a value cannot be stored (sparse, meta, unsupported dtype, object).
        InvalidSizeError: ``max_shard_size`` cannot be parsed.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> info = sp.save({"w": torch.ones(2, 2)}, os.path.join(d, "ckpt"))
        >>> sorted(info.files)
        ['model.safetensors']
        >>> info = sp.save({"w": torch.ones(2)}, "memory://doc/ckpt")  # any fsspec URL
        >>> sp.load("memory://doc/ckpt")["w"].tolist()
        [1.0, 1.0]
    """
    check_flags("save", overwrite=overwrite, durable=durable, allow_pickle=allow_pickle, progress=progress,
                optional=("progress",))
    if not _manager_call.get():
        raise_unobserved_failure()
    with applied(options), collector_paused():
        prepared, (max_bytes, meta) = _prepared_together(
            state, allow_pickle, process_group,
            checks=lambda: (_checked_size(max_shard_size, layout, storage_options), json_metadata(metadata)))
        group = resolve_group(process_group, prepared.all_tensors())
        return write_prepared(
            prepared,
            path,
            group=group,
            layout=layout,
            max_shard_bytes=max_bytes,
            overwrite=overwrite,
            metadata=meta,
            durable=durable,
            progress=progress,
            storage_options=storage_options,
        )


_T = TypeVar("_T")


def _checked_size(max_shard_size: int | str, layout: str | None, storage_options: Any) -> int:
    """A save's arguments checked: its largest data file in bytes."""
    check_options(layout, storage_options)
    return parse_size(max_shard_size)


def _prepared_together(state: Any, allow_pickle: bool, process_group: Any, phase: str = "planning the save", *,
                       checks: Callable[[], _T]) -> tuple[Any, _T]:
    """(``prepare_state(state)``, ``checks()``: the call's arguments checked); where either
    fails in a save over a process group (given, or the default group for a state holding
    DTensors), the failure goes through the save's first exchange (an async save's first
    one too), so every rank raises it (naming this rank) instead of the others waiting and
    meeting this rank's next call."""
    try:
        checked = checks()
        return prepare_state(state, allow_pickle=allow_pickle), checked
    except Exception as exc:
        error = exc
        group = resolve_group(process_group, [] if process_group is not None else state)
        if not group.distributed:
            raise

        def failed() -> tuple[None, None]:
            raise error

        group.exchange(phase, failed)
        raise  # not reached: the exchange raised on every rank


_manager_call: ContextVar[bool] = ContextVar("shardpoint_manager_call", default=False)
"""True inside :func:`save_now`: a ``CheckpointManager`` tracks its own async saves."""
_queue_in_effect: ContextVar[AsyncQueue | None] = ContextVar("shardpoint_async_queue", default=None)
"""The queue :func:`async_save` submits to inside :func:`async_save_on` (else the default one)."""


def save_now(state: Any, path: str | os.PathLike[str], **kwargs: Any) -> SaveInfo:
    """:func:`save` without its check for an unseen failure of a bare ``async_save`` (a
    ``CheckpointManager`` tracks its own async saves)."""
    token = _manager_call.set(True)
    try:
        return save(state, path, **kwargs)
    finally:
        _manager_call.reset(token)


def async_save_on(queue: AsyncQueue, state: Any, path: str | os.PathLike[str], **kwargs: Any) -> AsyncSave:
    """:func:`async_save` through ``queue`` (a manager's own, or the default one)."""
    token = _queue_in_effect.set(queue)
    try:
        return async_save(state, path, **kwargs)
    finally:
        _queue_in_effect.reset(token)


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
    options: OptionsArg = None,
) -> AsyncSave:
    """Save in the background; return once the state is staged and safe to mutate.

    Takes the same arguments as :func:`save`. The caller is blocked for the staging copy
    (and, if one is still running, for the previous bare ``async_save`` to commit: these
    calls share one reused staging buffer). Errors raised in the background surface on
    ``.result()`` and, if never looked at, on the next ``save`` or ``async_save``. The
    saves of a ``CheckpointManager`` are not among them: each manager has its own.

    Args:
        on_commit: called on the background thread with the SaveInfo after the commit.
        options: tunables (see :func:`shardpoint.save`): the ones in effect at this call
            (``options=`` laid over :func:`shardpoint.using`'s) are the background write's.

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
    check_flags("async_save", overwrite=overwrite, durable=durable, allow_pickle=allow_pickle, progress=progress,
                optional=("progress",))
    if on_commit is not None and not callable(on_commit):
        raise InvalidArgumentTypeError(f"async_save(on_commit=...) must be callable, not a {type(on_commit).__name__}")
    queue = _queue_in_effect.get() or default_queue()
    chosen = merged(options)  # the background thread writes under the options of this call
    with collector_paused():
        prepared, (max_bytes, meta) = _prepared_together(
            state, allow_pickle, process_group, "preparing the async save",
            checks=lambda: (_checked_size(max_shard_size, layout, storage_options), json_metadata(metadata)))
    target = os.fspath(path)
    caller_group = resolve_group(process_group, prepared.all_tensors())
    if caller_group.distributed:
        # Where the ranks meet one whose state could not be prepared (its failure goes through
        # this exchange: every rank raises it), or one making another call (a sync save, its
        # identity differs), before the collective that makes the twin group, which a rank
        # that never comes would block for ever.
        caller_group.exchange("preparing the async save", lambda: (None, None),
                              identity="saving asynchronously")
    # created here, on the caller's thread: making the twin group is a collective
    group = queue.background_group(caller_group)

    def persist(staged: PreparedState) -> SaveInfo:
        with using(chosen):
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
            committed.set()
            if on_commit is not None:
                on_commit(info)
        return info

    committed = threading.Event()
    handle = queue.submit(prepared, target, persist, started=started)
    handle.committed = committed
    return handle
