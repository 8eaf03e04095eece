"""CheckpointManager: steps under one root, the newest committed one, retention, best-by-metric.

Layout::

    root/
      step-000100/        one committed checkpoint per step (shardpoint.json inside)
      step-000200/
      latest              text file naming the newest committed step (a hint, verified)

On an object store (``root`` an fsspec URL such as ``s3://bucket/run``) the same layout is
kept as prefixes: a step is committed when ``step-<n>/shardpoint.json`` exists (one listing
of the root finds them all), ``latest`` is one small object written in one request (a hint,
verified the same way), retention writes the step's pending marker, deletes its manifest and then its objects
(a deletion cut short refuses to load, like an interrupted save), and
step prefixes without a manifest (interrupted saves) are ignored and removed by the next save.

``latest`` is replaced atomically (write a temp file, fsync, rename) after each commit. It
is only a hint: ``restore`` checks that the step it names is committed, and otherwise
scans for the newest committed step. Retention deletes only after a new step committed and
never deletes the step ``latest`` names or the best steps by metric. Deleting renames the
step to a hidden ``.tmp-`` name first, so a half-deleted step is never mistaken for one.
A crash between a commit and its retention leaves one step too many; the next ``save``
finishes that retention (and removes the crashed saves' ``.tmp-`` leftovers) before it
writes, so crash after crash never piles up more than ``keep_last + 1`` steps.
"""

from __future__ import annotations

import contextlib
import operator
import os
import socket
import threading
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._api import async_save_on, save_now
from ._async import AsyncQueue, AsyncSave
from ._distributed.group import Group, _world_group, resolve_group
from ._flags import check_flags
from ._format.manifest import MANIFEST_NAME
from ._load.into import load_into
from ._load.result import LoadResult
from ._manager_steps import (
    STEP_RE,
    agreed_step,
    metrics_json,
    metrics_of_manifest,
    step_dir_name,
    step_of,
)
from ._options import OptionsArg, current_options, merged
from ._printable import printable
from ._sizes import parse_size
from ._storage.local_store import LocalStore
from ._storage.posix import lock_nowait, reported
from ._storage.store import open_store
from ._write import SaveInfo
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidSizeError,
    LoadMismatchError,
    PreviousSaveFailedError,
    _extended,
)

LATEST_NAME = "latest"
_LATEST_LIMIT = 64
"""``latest`` holds one step name; a larger file is not one (never read)."""
_RESTORE_ATTEMPTS = 5
"""How many times ``restore()`` picks the newest step again when retention retired the one
it was loading."""
_ROOT_LOCK_WAIT = 600.0
"""Seconds a save waits for another process's manager to finish managing the same root."""


_SAVE_KWARGS = ("max_shard_size", "layout", "durable", "allow_pickle", "progress", "overwrite")
"""What ``CheckpointManager(**save_kwargs)`` passes on to each save (the others it sets itself)."""


def _check_save_kwargs(save_kwargs: Mapping[str, Any]) -> None:
    """Refuse, when the manager is made, a save argument its first save would refuse: a
    misspelled option (``keep=`` for ``keep_last=``) must not wait for step 1000 to fail."""
    unknown = sorted(set(save_kwargs) - set(_SAVE_KWARGS))
    if unknown:
        hints = {"keep": "keep_last", "keep_n": "keep_last", "max_to_keep": "keep_last",
                 "metadata": "metrics= of CheckpointManager.save"}
        named = ", ".join(f"{k}" + (f" (did you mean {hints[k]}?)" if k in hints else "") for k in unknown)
        raise InvalidArgumentTypeError(
            f"CheckpointManager() got unsupported argument(s) {named}; it takes keep_last, keep_best, "
            f"metric, mode, async_save, storage_options, process_group, options and, for every save, "
            f"{', '.join(_SAVE_KWARGS)}"
        )
    flags = {k: v for k, v in save_kwargs.items() if k in ("durable", "allow_pickle", "progress", "overwrite")}
    check_flags("CheckpointManager", optional=("progress",), **flags)
    if "max_shard_size" in save_kwargs:
        try:
            parse_size(save_kwargs["max_shard_size"])
        except InvalidSizeError as exc:
            raise InvalidSizeError(f"CheckpointManager(max_shard_size=...): {exc}") from None


def _check_root(path: str | None) -> None:
    """Refuse a local root that is a file, or a checkpoint itself (a step the user meant to
    resume from): ``restore`` would find no step there and return None, so training
    silently started over, with new steps and ``latest`` written inside the checkpoint."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(
            f"CheckpointManager root {path} is a file, not a directory; give the directory its steps go in"
        )
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        parent, name = os.path.split(os.path.normpath(path))
        step = step_of(name)
        how = (f"CheckpointManager({parent!r}) and restore(state, step={step}) to resume from it"
               if step is not None else "its parent directory as the root, or sp.load_into(state, path) to load it")
        raise InvalidArgumentError(
            f"CheckpointManager root {path} is a checkpoint (it holds {MANIFEST_NAME}), not a folder of steps; "
            f"use {how}"
        )


WRITER_LOCK_NAME = ".shardpoint-writer.lock"
"""The file in a local root whose lock the saving process holds (see ``_claim_root``)."""
_WRITERS: dict[str, list[int]] = {}
"""Roots whose writer lock this process holds: real path -> [the locked descriptor, the
managers of this process holding it] (a new manager of the same root here is no other
writer); released with the last of them."""
_WRITERS_LOCK = threading.Lock()


def _release_root(root: str) -> None:
    """One manager holding ``root``'s writer lock is gone; the last one closes it."""
    with _WRITERS_LOCK:
        held = _WRITERS.get(root)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _WRITERS[root]
            with contextlib.suppress(OSError):
                os.close(held[0])


def _ranks_alone(process_group: Any) -> int:
    """The ranks torch.distributed runs when there are several and no group was given, else 0."""
    if process_group is not None or _world_group() is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_world_size())


def _check_latest(path: str) -> None:
    """Refuse, before a save writes anything, a local root whose ``latest`` is the user's:
    a directory, a link or any other non-file (reads ignore it; a save would replace a link,
    or fail after committing, at every step)."""
    latest = os.path.join(path, LATEST_NAME)
    if os.path.lexists(latest) and (os.path.islink(latest) or not os.path.isfile(latest)):
        kind = "a symbolic link" if os.path.islink(latest) else "a directory" if os.path.isdir(latest) else "no file"
        raise InvalidArgumentError(
            f"{latest} is {kind}, not the manager's own '{LATEST_NAME}' file (the newest step's name, which every "
            "save replaces): a save would fail after committing, or replace it. Rename or move it, then save "
            "again; nothing was written"
        )
    if os.path.isfile(latest):
        try:
            with open(latest, "rb") as f:
                held = f.read(256)
        except OSError:
            return
        name = held.decode("utf-8", "replace").strip()
        # Another tool's names something of the root (a torn write of ours names nothing).
        if (STEP_RE.match(name) is None and name not in ("", ".", "..") and "/" not in name and "\0" not in name
                and os.path.lexists(os.path.join(path, name))):
            raise InvalidArgumentError(
                f"{latest} names {printable(name[:80])!r}, not a step of a CheckpointManager (step-NNNNNN): it is "
                "another tool's (DeepSpeed writes one naming its global_stepN folder), and a save would replace it. "
                "Give the manager a root of its own; nothing was written"
            )


def _check_step(call: str, step: object) -> int:
    """``step`` as an int: an integer of any kind (``numpy.int64`` too); refuse what is not
    one (``'3'`` from argparse, ``3.0``, ``True``) or is negative."""
    try:
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or isinstance(step, bool):
        raise InvalidArgumentTypeError(
            f"CheckpointManager.{call}: step must be a non-negative int, not {step!r}"
            + (" (convert it with int(...))" if isinstance(step, (str, float)) else "")
        )
    if value < 0:
        raise InvalidArgumentError(f"CheckpointManager.{call}: step must be a non-negative int, not {step!r}")
    return value


class CheckpointManager:
    """Save every N steps, keep the last few and the best, resume from the newest.

    Args:
        root: directory holding one ``step-<n>`` checkpoint per saved step.
        keep_last: keep only this many newest steps (None: keep all).
        keep_best: also keep this many best steps by ``metric``.
        metric: name of the metric in ``save(..., metrics=)`` that ranks steps.
        mode: ``"min"`` or ``"max"``: which metric values are best.
        async_save: save in the background (``save`` returns once the state is staged).
        storage_options: options of the fsspec filesystem when ``root`` is a URL
            (``s3://bucket/run``); see :func:`shardpoint.save`.
        process_group: save and restore collectively over this group (every rank calls
            ``save`` / ``restore``). Without it, a state (or restore target) holding
            DTensors is saved (restored) over the default group, and any other state by
            the calling process alone, as :func:`shardpoint.save` decides. Over a group,
            rank 0 of it manages the root (writes ``latest``, applies retention, removes
            stale temporary directories), ``restore`` loads the same step on every rank,
            and an error on any rank is raised on all of them.
        options: tunables (:class:`IOOptions`, :class:`RemoteOptions`,
            :class:`CollectiveOptions`, or an :class:`Options`) for every save and restore of
            this manager and its reads of step metadata; fixed when the manager is made
            (groups not given: those in effect then). None: those in effect at each call.
        save_kwargs: passed to every save (``max_shard_size=``, ``durable=``, ...).

    Example:
        >>> import torch, shardpoint as sp, tempfile
        >>> model = torch.nn.Linear(2, 2)
        >>> mgr = sp.CheckpointManager(tempfile.mkdtemp(), keep_last=2)
        >>> for step in (10, 20, 30):
        ...     _ = mgr.save(step, {"model": model, "step": step})
        >>> mgr.steps()
        [20, 30]
        >>> mgr.restore({"model": torch.nn.Linear(2, 2), "step": 0})
        30
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        process_group: Any = None,
        options: OptionsArg = None,
        **save_kwargs: Any,
    ) -> None:
        if mode not in ("min", "max"):
            raise InvalidArgumentError(f"CheckpointManager: mode must be 'min' or 'max', not {mode!r}")
        if keep_best and not metric:
            raise InvalidArgumentError(
                "CheckpointManager: keep_best needs metric= (the name of the metric that ranks steps)"
            )
        for name, value in (("keep_last", keep_last), ("keep_best", keep_best)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgumentError(f"CheckpointManager: {name} must be a positive int or None, not {value!r}")
        self._store = open_store(root, storage_options)
        self.root: Path | str = self._store.location
        _check_root(self._store.local_path)
        self.storage_options = storage_options
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.metric = metric
        self.mode = mode
        check_flags("CheckpointManager", async_save=async_save)
        _check_save_kwargs(save_kwargs)
        self.async_save = async_save
        self.save_kwargs = save_kwargs
        self.process_group = process_group
        self.options = None if options is None else merged(options)
        """The tunables of this manager's saves, restores and reads (None: those in effect
        at each call)."""
        self.last_load: LoadResult | None = None
        """The report of this manager's last :meth:`restore` (None before one)."""
        self._pending: AsyncSave | None = None
        self._pending_step: int | None = None
        self._queue = AsyncQueue()
        """This manager's own async saves: never waits on (nor raises) another's."""
        self._lock = threading.Lock()
        self._metrics_cache: dict[int, tuple[tuple[int, ...], dict[str, Any] | BaseException]] = {}
        self._claimed = False
        """Whether this manager's first save took (or found taken) the root's writer lock."""
        """Step -> (its manifest's identity, the metrics read from it or why they could not be)."""
        self._store.put_back_moved_aside()

    # ------------------------------------------------------------------ queries

    def step_path(self, step: int) -> Path | str:
        """Where step ``step`` lives: a directory, or a URL on an object store."""
        return self._store.child(step_dir_name(step)).location

    def steps(self) -> list[int]:
        """Committed steps, oldest first (a step dir without a manifest is not one)."""
        self._store.put_back_moved_aside()
        found = []
        for name, committed in self._store.children().items():
            step = step_of(name)
            if step is not None and committed:
                found.append(step)
        return sorted(found)

    def latest_step(self) -> int | None:
        """The newest committed step: the ``latest`` hint if it checks out, else a scan."""
        hint = self._read_latest()
        steps = self.steps()
        if hint is not None and hint in steps and hint == max(steps):
            return hint
        return steps[-1] if steps else None

    def _read_latest(self) -> int | None:
        """The step ``latest`` names; None when it is missing, unreadable, larger than a step
        name, or not a regular file (a FIFO or a link to a device is never opened to wait
        or read from)."""
        try:
            raw = self._store.read_small(LATEST_NAME, limit=_LATEST_LIMIT).decode("utf-8", errors="replace")
        except (OSError, CheckpointError):
            return None
        return step_of(raw.strip())

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics recorded with ``step``.

        Raises:
            CorruptCheckpointError: the step's manifest cannot be read (missing, truncated,
                too deeply nested, over the size limit, not a regular file).
        """
        step = _check_step("metrics", step)
        try:
            return self._read_metrics(step)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.root} has no committed step {step}; it has {self.steps()}"
            ) from None
        except OSError as exc:
            raise CorruptCheckpointError(
                f"{self.step_path(step)}/{MANIFEST_NAME}: cannot read the step's metrics ({exc})"
            ) from None

    def _read_metrics(self, step: int) -> dict[str, Any]:
        """The step's metrics; OSError when the manifest cannot be read (the disk's error),
        CorruptCheckpointError when what it reads is not a manifest.

        The outcome is kept per manifest version: where the store tracks versions (a local
        root) the manifest file's (device, inode, size, times), a committed manifest never
        changing; on an object store, where one manager writes a root, one version until this
        manager saves or deletes that step (the entry is dropped then). Every save ranks and
        retires steps: a state of 10^5 tensors (a 15 MB manifest per step) was parsed again
        for each kept step at each save, and an object store's manifests fetched twice.
        """
        step_store = self._store.child(step_dir_name(step))
        tracked = self._store.tracks_versions
        before = step_store.version(MANIFEST_NAME) if tracked else ()
        cached = self._metrics_cache.get(step)
        if before is not None and cached is not None and cached[0] == before:
            if isinstance(cached[1], BaseException):
                raise cached[1]
            return dict(cached[1])
        try:
            metrics: dict[str, Any] | BaseException = self._parse_metrics(step)
        except CorruptCheckpointError as exc:
            metrics = exc
        if before is not None and (not tracked or step_store.version(MANIFEST_NAME) == before):
            self._metrics_cache[step] = (before, metrics)
        if isinstance(metrics, BaseException):
            raise metrics
        return dict(metrics)

    def _parse_metrics(self, step: int) -> dict[str, Any]:
        path = f"{self.step_path(step)}/{MANIFEST_NAME}"
        limit = (self.options or current_options()).io.max_json_bytes
        try:
            raw = self._store.child(step_dir_name(step)).read_small(MANIFEST_NAME, limit=limit)
        except CorruptCheckpointError as exc:  # not a regular file, over the size limit
            raise CorruptCheckpointError(f"{path}: cannot read the step's metrics ({exc})") from None
        return metrics_of_manifest(raw, where=path)

    def _readable_metrics(self, step: int) -> dict[str, Any] | None:
        """The step's metrics, or None when its manifest is damaged (after a warning naming
        the step: such a step is never ranked, and never retired as if it were whole) or
        gone (retired by another manager meanwhile). A disk error is raised as it is."""
        try:
            return self._read_metrics(step)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError as exc:
            warnings.warn(
                f"step {step} under {self.root} is damaged and is skipped (never chosen as best, "
                f"never deleted by retention): {exc}",
                stacklevel=3,
            )
            return None

    def best_steps(self) -> list[int]:
        """Steps ranked best first by ``metric`` (steps without it, or whose manifest is
        damaged, are not ranked; a damaged one is named in a warning)."""
        return self._best_of(self.steps())

    def _best_of(self, steps: list[int]) -> list[int]:
        """:meth:`best_steps` among ``steps`` (a listing already made)."""
        if not self.metric:
            return []
        scored = []
        for step in steps:
            metrics = self._readable_metrics(step)
            if metrics is None:
                continue
            value = metrics.get(self.metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # not nan
                scored.append((value if self.mode == "min" else -value, -step, step))  # ints of any size compare
        return [s for _, _, s in sorted(scored)]

    # ------------------------------------------------------------------ save / restore

    def save(
        self, step: int, state: Any, *, metrics: Mapping[str, float] | None = None
    ) -> SaveInfo | AsyncSave:
        """Save ``state`` as ``step``; returns its SaveInfo, or an AsyncSave handle when async.

        ``metrics`` (floats, or one-element tensors; nan and inf allowed) are recorded in
        the step's manifest and rank the steps for ``keep_best``; nan is never the best.

        Waits for the previous async save first. If it failed and its error was not seen
        through its handle's ``.result()``, a :class:`CheckpointError` naming that step is
        raised here and ``step`` is not saved either.
        """
        step = _check_step("save", step)
        if self.keep_best and self.metric not in (metrics or {}):
            given = ", ".join(repr(k) for k in list(metrics or {})[:10]) or "none"
            warnings.warn(
                f"CheckpointManager.save(step {step}): metrics holds no {self.metric!r}, the metric "
                f"keep_best ranks steps by (given: {given}); this step can never be kept as a best step",
                UserWarning, stacklevel=2,
            )
        group = resolve_group(self.process_group, state)
        coordinator = group.is_coordinator  # the group's rank 0 manages the root

        def prepare() -> None:
            self._raise_pending_failure(f"Step {step} was not saved either; call save() again to save it")
            if coordinator and isinstance(self._store, LocalStore):
                _check_latest(os.fspath(self._store.path))
            if coordinator:
                with reported(self.root, f"preparing its root for step {step}",
                              lambda: f"Step {step} was not saved; the steps committed before are unchanged"):
                    self._store.make()
                    self._claim_root()
                    with self._store.locked(_ROOT_LOCK_WAIT):
                        self._remove_stale_temps()
                        self._finish_interrupted_retention()
                        self._refuse_foreign_step_dir(step)

        group.phase(f"preparing to save step {step} under {self.root}", prepare, identity=f"saving step {step}")
        metadata = {"step": step, "metrics": metrics_json(metrics)}
        kwargs = {"overwrite": True, "progress": False, **self.save_kwargs, "metadata": metadata}
        if self.storage_options is not None:
            kwargs["storage_options"] = self.storage_options
        if group.pg is not None:
            kwargs["process_group"] = group.pg
        if self.options is not None:
            kwargs["options"] = self.options
        path = self.step_path(step)
        if self.async_save:

            def on_commit(info: SaveInfo) -> None:
                if coordinator:
                    self._after_commit(step)

            handle = async_save_on(self._queue, state, path, on_commit=on_commit, **kwargs)
            self._pending, self._pending_step = handle, step
            return handle
        info = save_now(state, path, **kwargs)
        group.phase(
            f"updating {LATEST_NAME} and retention under {self.root} after step {step}",
            lambda: self._after_commit(step) if coordinator else None,
        )
        return info

    def _claim_root(self) -> None:
        """At this manager's first save into a local root: take the root's writer lock, held
        by this process from then on, or warn that another process holds it (two managers
        saving into one root, every rank of a job with no ``process_group``, or two jobs,
        replace each other's steps, so each step keeps one writer's state, and each applies
        retention). A manager that only restores never takes it."""
        if self._claimed or not isinstance(self._store, LocalStore):
            return
        self._claimed = True
        root = os.path.realpath(self._store.path)
        with _WRITERS_LOCK:
            if root in _WRITERS:  # this process holds it (another manager of this process)
                _WRITERS[root][1] += 1
                weakref.finalize(self, _release_root, root)
                return
            try:
                fd = os.open(os.path.join(root, WRITER_LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                return
            held = lock_nowait(fd)
            if held:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
                _WRITERS[root] = [fd, 1]
                weakref.finalize(self, _release_root, root)
                return
            holder = b""
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 200, 0)
            os.close(fd)
        if held is False:
            who = printable(holder.decode("utf-8", "replace").strip()) or "another process"
            ranks = _ranks_alone(self.process_group)
            warnings.warn(
                f"CheckpointManager({str(self.root)!r}): {who} is saving into this root too. Two managers saving "
                "into one root replace each other's steps (each step keeps one writer's state: another rank's "
                "sp.RNGState or data position is lost) and both apply retention"
                + (f". torch.distributed runs {ranks} ranks and this manager saves alone (no process_group=, a "
                   "state of plain tensors): create it on rank 0 only (if dist.get_rank() == 0), or pass "
                   "process_group=dist.group.WORLD to save every rank's state together" if ranks else
                   ": give each run a root of its own"),
                UserWarning, stacklevel=3,
            )

    def _refuse_foreign_step_dir(self, step: int) -> None:
        """Refuse to save into a folder named like the step that is not a committed step (the
        user's own, or one being copied in): the save would make it the step's, and retention
        would delete it, with all it holds, when the step retires."""
        name = step_dir_name(step)
        if self._store.children().get(name, True):
            return  # absent, or a committed step (saved again: replaced)
        path = self._store.child(name).location
        if isinstance(path, Path) and not any(path.iterdir()):
            return  # an empty folder: nothing to lose
        raise CheckpointExistsError(
            f"{path} exists and is not a committed step (it has no {MANIFEST_NAME}): saving step {step} there would "
            "make the folder the step's, and retention would delete it with the step, with all it holds. Move it "
            f"out of {self.root} (or remove it), then save again. Step {step} was not saved"
        )

    def _raise_pending_failure(self, then: str) -> None:
        """Wait for the pending async save; raise its error if it failed and nobody saw it
        (``then`` says what that means for the call that found it)."""
        failed_step, exc = self._finish_pending()
        if exc is not None:
            done = failed_step is not None and failed_step in self.steps()
            raise PreviousSaveFailedError(
                f"the async save of step {failed_step} to {self.root} failed"
                + (" after its commit" if done else "; nothing was committed for it")
                + f": {exc}. {then}"
            ) from exc

    def wait(self) -> None:
        """Block until this manager's pending async save finished; raise its error if it
        failed (never another manager's: each has its own background queue).

        An error already raised by the handle's ``.result()`` is not raised again. Local to
        the calling process, also after a collective save; the next ``save`` or ``restore``
        raises an unseen failure of any rank on every rank.
        """
        _, exc = self._finish_pending()
        if exc is not None:
            raise exc

    def _finish_pending(self) -> tuple[int | None, BaseException | None]:
        """Wait for the pending async save; its step and its error if nobody has seen it."""
        pending, step = self._pending, self._pending_step
        if pending is None:
            return None, None
        exc = pending.exception()  # waits (a Ctrl-C here leaves it pending, to be waited for again)
        self._pending = self._pending_step = None
        if exc is None or pending.observed:
            return step, None
        pending.observed = True
        return step, exc

    def restore(self, target: Any, step: int | None = None, **load_kwargs: Any) -> int | None:
        """Load ``step`` (default: the newest committed) into ``target``; return the step.

        Returns None when the root holds no committed step. The load's report
        (:class:`LoadResult`) is ``manager.last_load``; a restore that is not ``ok``
        (``strict=False``: keys missing, unexpected or mis-shaped) also warns with it. A
        parameter left as it is for a shape mismatch starts its optimizer state afresh.
        Without ``step``, when retention (another process's manager saving into the same
        root) retires the step while it is being loaded, the newest step is chosen again and
        loaded (a few times at most).

        Over a process group (the manager's, ``process_group=`` here, or the default group
        for a target holding DTensors) every rank calls ``restore``: they load the newest
        step that every rank sees (a newer one some rank does not see yet is named in a
        warning), or ``step``, and return the same step or raise the same error.

        Raises:
            CheckpointError: ``step`` is not committed, or was retired (or replaced) while
                it was being loaded, or every newest step chosen was retired in turn.
            DistributedCheckpointError: over a group, a rank failed (every rank raises it),
                e.g. ``step`` is not committed in some rank's view of the root.
        """
        group = resolve_group(load_kwargs.get("process_group", self.process_group), target)
        if step is not None:
            try:
                step = _check_step("restore", step)
            except CheckpointError as exc:
                if not group.distributed:
                    raise
                refused = exc

                def refuse() -> tuple[None, None]:
                    raise refused

                # Through the exchange the other ranks wait in (choosing the step): every rank
                # raises it at once, where they waited out the collective timeout.
                group.exchange(f"choosing the step to restore from {self.root}", refuse,
                               identity="restoring a step")
                raise
        if group.pg is not None:
            load_kwargs["process_group"] = group.pg
        if self.storage_options is not None:
            load_kwargs.setdefault("storage_options", self.storage_options)
        if self.options is not None:
            load_kwargs.setdefault("options", self.options)
        retired: list[int] = []
        while True:
            chosen = self._choose_step(group, step, first=not retired)
            if chosen is None:
                if retired:
                    break
                self._refuse_missing_bucket()
                return None
            before = self._identity(chosen)
            try:
                result = load_into(target, self.step_path(chosen), **load_kwargs)
                self.last_load = result
                if not result.ok:  # strict=False: what it left out must not go unseen
                    warnings.warn(
                        f"restored step {chosen} from {self.root} in part; "
                        + "; ".join(result.summary().splitlines())
                        + ". The whole report: manager.last_load",
                        UserWarning, stacklevel=2,
                    )
                return chosen
            except (OSError, CheckpointError) as exc:
                if isinstance(exc, LoadMismatchError) or group.distributed:
                    raise  # over a group, the error is already the same on every rank
                if self._store.tracks_versions:
                    unchanged = before is not None and self._identity(chosen) == before
                else:  # an object store: no versions to compare, but a retired step is gone
                    unchanged = chosen in self.steps()
                if unchanged:
                    # the step is still there, unchanged: a real error of the step
                    if step is None and isinstance(exc, CorruptCheckpointError):
                        self._name_older_steps(exc, chosen)
                    raise
                if step is not None:
                    raise CheckpointNotFoundError(
                        f"step {chosen} under {self.root} was retired by retention (or replaced "
                        "by another save) while it was being restored; another process is "
                        f"saving into this root. Restore again (the steps now: {self.steps()})"
                    ) from exc
                retired.append(chosen)
                if len(retired) >= _RESTORE_ATTEMPTS:
                    break
        raise CheckpointNotFoundError(
            f"restore() from {self.root} chose steps {retired} in turn and each was retired by "
            "retention while it was being loaded (another process is saving into this root "
            "with keep_last); restore again, or keep more steps"
        )

    def _refuse_missing_bucket(self) -> None:
        """A root on a bucket that does not exist holds no step, as a new run's root does:
        resuming from a mistyped URL would silently start training over."""
        missing = self._store.missing_bucket()
        if missing is not None:
            raise CheckpointNotFoundError(
                f"restore() from {self.root}: the bucket {missing!r} does not exist, so there is no step to "
                "resume from; check the URL (a typo starts training over), or create the bucket for a new run"
            )

    def _name_older_steps(self, exc: CorruptCheckpointError, chosen: int) -> None:
        """Extend ``exc`` (the newest step is damaged) to say which older steps can be
        restored instead: restore never falls back by itself, since resuming from an older
        step than the user expects, with only a warning, silently repeats training."""
        older = [s for s in self.steps() if s < chosen]
        then = (
            f"restore(state, step={older[-1]}) restores the newest older step (committed: {older[-8:]})"
            if older else "No older step is committed under this root"
        )
        _extended(exc, f"Step {chosen} is the newest under {self.root}; {then}")

    def _choose_step(self, group: Group, step: int | None, *, first: bool) -> int | None:
        """The step every rank of ``group`` restores: ``step`` if it is committed in every
        rank's view of the root, else (``step`` None) the newest step that is. A rank whose
        view lags (a shared file system's cache) cannot make the ranks load different steps:
        they agree on one, or all raise the same error naming the ranks' views. On the first
        choice the pending async save is waited for (its unseen error raised on every rank)."""
        where = f"choosing the step to restore from {self.root}"

        def listing() -> tuple[None, list[int]]:
            if first:
                self.wait()
            return None, self.steps()

        def decide(views: list[list[int]]) -> list[tuple[int | None, str | None]]:
            return [agreed_step(str(self.root), views, step)] * len(views)

        _, (chosen, note) = group.exchange(where, listing, decide=decide, deciding=where,
                                           identity="restoring a step")
        if note is not None:
            warnings.warn(note, stacklevel=3)
        return chosen

    def _identity(self, step: int) -> tuple[int, ...] | None:
        """(device, inode) of the step's manifest; None when the step is gone."""
        version = self._store.child(step_dir_name(step)).version(MANIFEST_NAME)
        return None if version is None else version[:2]

    # ------------------------------------------------------------------ internals

    def _after_commit(self, step: int) -> None:
        self._metrics_cache.pop(step, None)  # a step saved again has a new manifest
        with reported(self.root, f"updating '{LATEST_NAME}' and applying retention after step {step}",
                      lambda: f"Step {step} is committed at {self.step_path(step)}; '{LATEST_NAME}' may still "
                              "name the step before and retention may not have run; the next save does both"):
            self._update_root(step)

    def _update_root(self, step: int) -> None:
        with self._lock, self._store.locked(_ROOT_LOCK_WAIT):
            steps = self.steps()
            newest = max(steps) if steps else step
            self._store.replace_small(LATEST_NAME, (step_dir_name(newest) + "\n").encode())
            self._apply_retention(newest)
            after = self.steps()
            newer = [s for s in after if s > step]
            if step in after and newer:
                warnings.warn(
                    f"step {step} was saved under {self.root}, but step(s) {newer[:8]} are newer: restore() and "
                    f"'{LATEST_NAME}' choose the newest ({newer[-1]}), so a resume would continue from there, not "
                    f"from step {step}. If training went back to an earlier step, remove the newer steps (or save "
                    "into another root)",
                    UserWarning, stacklevel=2,
                )
            if step in steps and step not in after:
                warnings.warn(
                    f"step {step} was saved to {self.step_path(step)} and at once removed by retention: "
                    f"keep_last={self.keep_last} keeps the newest steps, and {newest} is newer. To train "
                    "on from an earlier step, remove the later ones first (or raise keep_last)",
                    UserWarning, stacklevel=2,
                )

    def _finish_interrupted_retention(self) -> None:
        """Apply retention to the committed steps (a crash may have cut the last one short)."""
        with self._lock:
            steps = self.steps()
            if steps:
                self._apply_retention(steps[-1])

    def _apply_retention(self, latest: int) -> None:
        """Delete the steps beyond ``keep_last`` that are not ``latest`` nor among the
        ``keep_best``. Where small reads are cheap (a local root) a step whose manifest is
        damaged is not counted and never deleted (a warning names it)."""
        if self.keep_last is None:
            return
        steps = self.steps()
        if self._store.small_reads_are_cheap:
            steps = [s for s in steps if self._readable_metrics(s) is not None]
        keep = set(steps[-self.keep_last :]) | {latest}
        if self.keep_best:
            keep |= set(self._best_of(steps)[: self.keep_best])
        for step in steps:
            if step in keep:
                continue
            # Where reads cost a request (an object store) only the steps to delete are read:
            # a damaged one is kept (a warning names it), never deleted as if it were whole.
            if not self._store.small_reads_are_cheap and self._readable_metrics(step) is None:
                continue
            self._delete(step)

    def _delete(self, step: int) -> None:
        self._metrics_cache.pop(step, None)
        self._store.child(step_dir_name(step)).delete_tree()

    def _remove_stale_temps(self) -> None:
        """Tidy what crashed saves left (under the root lock: no other manager's retention
        or ``latest`` update is in flight): dead temporary directories, half-deleted steps,
        a torn ``latest``, and steps of interrupted remote saves (see ``Store.tidy``)."""
        self._store.tidy(STEP_RE, small_files=[LATEST_NAME])
