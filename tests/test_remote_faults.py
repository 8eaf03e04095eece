"""Faults at every step of a save to S3, against the real S3 server (SeaweedFS) on loopback.

The server is real (the session fixtures of ``test_remote.py``). Faults are injected by
wrapping, on the very s3fs filesystem instance shardpoint uses (fsspec caches it per
``storage_options``), the three calls through which a save writes to the store:
``pipe_file`` (the pending marker, indexes, manifest, ``latest``), ``open(..., "wb")`` (one
per data object upload) and ``rm_file`` (every deletion). Nothing of S3 is mocked: every
call that is not the faulted one goes to the server. Only calls on objects under the test's
prefix count as steps. A dry run lists the steps of a fault-free save; the fault is then
walked through each of them, once per action:

- ``runtime``: a plain ``InjectedError`` instead of the call (a bug in our code or a
  callback): it passes through shardpoint unchanged;
- ``denied``: ``PermissionError`` (what s3fs raises for a 403) instead of the call: a
  permanent storage error, raised at once as ``StorageError`` naming the object's URL;
- ``kill-before`` / ``kill-after`` (in a child process, ``test_remote_crash.py``):
  ``SIGKILL`` to itself before the call, or once it returned (for an upload: once the
  object is committed);
- ``pause``: ``on_pause(label)``, then the call (two saves racing, ``test_remote_crash.py``).

Uploads run one at a time (``RemoteOptions(threads=1)``) so the steps come in the same
order on every run.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint import _async as sp_async
from shardpoint._storage.store import open_store
from test_remote import keys_under, tensors_equal

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'shardpoint[s3]')")


class InjectedError(RuntimeError):
    pass


class S3Faults:
    """Count the writes and deletions under ``url``; fire ``action`` at step ``at`` (1-based).

    ``log`` sees each step's label before anything happens to it (a child writes it to a
    file, so the parent learns where a kill landed); ``on_pause`` is called at step ``at``
    when ``action`` is ``pause``.
    """

    def __init__(
        self,
        url: str,
        options: dict[str, Any],
        *,
        at: int | None = None,
        action: str = "runtime",
        log: Callable[[str], None] | None = None,
        on_pause: Callable[[str], None] | None = None,
    ) -> None:
        self.fs = open_store(url, options).fs  # the cached instance shardpoint gets
        self.root = url.removeprefix("s3://").rstrip("/")
        self.at = at
        self.action = action
        self.log = log
        self.on_pause = on_pause
        self.steps: list[str] = []
        self.fired: str | None = None
        self.fired_name: str | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_pipe, real_open, real_rm = self.fs.pipe_file, self.fs.open, self.fs.rm_file

        def pipe_file(path: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            kill_after = self._step("put", path)
            result = real_pipe(path, value, *args, **kwargs)
            if kill_after:
                _kill_self()
            return result

        def open_(path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            if "w" not in mode:
                return real_open(path, mode, *args, **kwargs)
            kill_after = self._step("upload", path)
            f = real_open(path, mode, *args, **kwargs)
            if kill_after:  # once the object is published, not while it is uploaded
                real_commit = f.commit

                def commit(*a: Any, **k: Any) -> Any:
                    result = real_commit(*a, **k)
                    _kill_self()
                    return result

                f.commit = commit
            return f

        def rm_file(path: str, *args: Any, **kwargs: Any) -> Any:
            kill_after = self._step("delete", path)
            result = real_rm(path, *args, **kwargs)
            if kill_after:
                _kill_self()
            return result

        monkeypatch.setattr(self.fs, "pipe_file", pipe_file)
        monkeypatch.setattr(self.fs, "open", open_)
        monkeypatch.setattr(self.fs, "rm_file", rm_file)

    def _step(self, verb: str, path: str) -> bool:
        """Count the call; act if it is step ``at``. True: kill once the call returned."""
        path = str(path)
        if not path.startswith(self.root + "/"):
            return False
        name = path[len(self.root) + 1 :]
        label = f"{verb} {name}"
        self.steps.append(label)
        if self.log is not None:
            self.log(label)
        if self.at is None or len(self.steps) != self.at:
            return False
        self.fired, self.fired_name = label, name
        if self.action == "runtime":
            raise InjectedError(f"injected at step {self.at} ({label})")
        if self.action == "denied":
            raise PermissionError(errno.EACCES, "Access Denied (injected)", path)
        if self.action == "kill-before":
            _kill_self()
        if self.action == "kill-after":
            return True
        if self.action == "pause" and self.on_pause is not None:
            self.on_pause(label)
            return False
        raise AssertionError(self.action)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # a real kill: no clean-up code runs


def no_open_multipart_uploads(fs: Any, url: str) -> bool:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return not [u for u in fs.list_multipart_uploads(bucket) if u["Key"].startswith(prefix + "/")]


def check_error(exc: BaseException, faults: S3Faults, url: str, action: str) -> None:
    """The error a failed save raised names the cause and the object."""
    text = str(exc)
    if action == "runtime":
        assert isinstance(exc, InjectedError) and faults.fired in text, text
    else:
        assert isinstance(exc, sp.StorageError), repr(exc)
        verb = {"put": "writing", "upload": "uploading", "delete": "deleting"}[faults.fired.split()[0]]
        assert f"{verb} {url}/{faults.fired_name} failed: PermissionError" in text, text
        assert "Access Denied (injected)" in text and "check the credentials" in text, text


A = {f"t{i}": torch.full((100,), float(i)) for i in range(3)}  # 3 objects of 500 bytes max
B = {"t0": torch.randn(100, generator=torch.Generator().manual_seed(1)), "t1": torch.arange(100.0)}


def keys_of(shards: int, layout: str = "hf") -> list[str]:
    """The objects of a committed save of ``shards`` data objects (one process)."""
    if layout == "chunked":  # one file set per rank, no index (the manifest places the chunks)
        return sorted([f"model-r00000-{i:05d}.safetensors" for i in range(1, shards + 1)] + ["shardpoint.json"])
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    return sorted([*names, "model.safetensors.index.json", "shardpoint.json"])


A_KEYS = keys_of(3)
B_KEYS = keys_of(2)


@pytest.fixture
def one_thread(use_options: Any) -> None:
    use_options(remote=sp.RemoteOptions(threads=1))


# ----------------------------------------------------------------- every step of a save


@pytest.mark.parametrize("action", ["runtime", "denied"])
@pytest.mark.parametrize("scenario", ["first-save", "overwrite", "chunked-first-save", "chunked-overwrite"])
def test_exception_at_every_step_of_an_s3_save(
    scenario: str, action: str, url: str, opts: dict[str, Any], fs: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """First save: a fault before the manifest leaves nothing at all. Overwrite (not atomic
    on an object store, see docs/design.md): a fault before the old manifest is deleted
    leaves the old checkpoint loading bit-exactly; a later one leaves a prefix that refuses
    to load (marker present whenever anything is). A fault at the marker's deletion after
    the commit is ignored (the manifest wins). The next save always cleans up.

    ``chunked-*``: the same with ``layout="chunked"`` (the collective save's code path in
    one process: per-rank files, no index), both checkpoints chunked."""
    layout = "chunked" if scenario.startswith("chunked-") else "hf"
    overwrite = scenario.endswith("overwrite")
    a_keys, b_keys = keys_of(3, layout), keys_of(2, layout)

    def prepare(prefix: str) -> None:
        if overwrite:
            sp.save(A, prefix, storage_options=opts, max_shard_size=500, layout=layout)
            assert keys_under(fs, prefix) == a_keys

    def save(prefix: str, state: dict[str, torch.Tensor] = B, *, again: bool = False) -> None:
        sp.save(state, prefix, storage_options=opts, max_shard_size=500, overwrite=overwrite or again, layout=layout)

    prefix = f"{url}/dry"
    prepare(prefix)
    with monkeypatch.context() as m:
        dry = S3Faults(prefix, opts)
        dry.install(m)
        save(prefix)
    steps = dry.steps
    assert steps[0] == "put shardpoint.pending" and steps[-1] == "delete shardpoint.pending", steps
    assert steps[-2] == "put shardpoint.json", steps
    assert [s for s in steps if s.startswith("upload ")] == [f"upload {k}" for k in b_keys if k.endswith(".safetensors")], steps
    if layout == "hf":
        assert steps[-3] == "put model.safetensors.index.json", steps
    else:
        assert not [s for s in steps if "index" in s], steps
    first_save_steps = 6 if layout == "hf" else 5  # marker, 2 uploads, [index], manifest, marker
    if overwrite:  # the old manifest first, then its other objects
        assert steps[1] == "delete shardpoint.json", steps
        assert steps[2 : 2 + len(a_keys) - 1] == [f"delete {k}" for k in a_keys if k != "shardpoint.json"], steps
        assert len(steps) == first_save_steps + len(a_keys), steps
    else:
        assert len(steps) == first_save_steps, steps
    commit = steps.index("put shardpoint.json") + 1

    for at, label in enumerate(steps, start=1):
        prefix = f"{url}/at{at}"
        prepare(prefix)
        faults = S3Faults(prefix, opts, at=at, action=action)
        with monkeypatch.context() as m:
            faults.install(m)
            if at > commit:  # the marker's deletion after the commit: best effort
                save(prefix)
                caught = None
            else:
                with pytest.raises(Exception) as info:
                    save(prefix)
                caught = info.value
        assert faults.fired == label, (faults.fired, label)
        keys = keys_under(fs, prefix)
        assert no_open_multipart_uploads(fs, prefix), label
        if caught is None:
            assert keys == sorted([*b_keys, "shardpoint.pending"]), (label, keys)
            assert tensors_equal(sp.load(prefix, storage_options=opts), B), label
        else:
            check_error(caught, faults, prefix, action)
            if not overwrite:
                assert keys == [], (label, keys)  # the failed save deleted all it uploaded
                with pytest.raises(sp.CheckpointNotFoundError, match=f"{prefix} holds no objects"):
                    sp.load(prefix, storage_options=opts)
            elif "shardpoint.json" in keys:  # failed before the old manifest was deleted
                assert at <= 2, label
                assert set(keys) - {"shardpoint.pending"} == set(a_keys), (label, keys)
                assert tensors_equal(sp.load(prefix, storage_options=opts), A), label
            else:  # the old checkpoint is gone (documented); never loads as a mix
                assert not keys or "shardpoint.pending" in keys, (label, keys)
                assert not set(keys) & set(b_keys) - set(a_keys), (label, keys)  # nothing new left
                with pytest.raises(sp.CheckpointError, match=f"{prefix} (holds no objects|is a save that never committed)"):
                    sp.load(prefix, storage_options=opts)
        # the next save cleans whatever is left and commits
        again = {k: v + 1 for k, v in B.items()}
        save(prefix, again, again=True)
        assert keys_under(fs, prefix) == b_keys, label
        assert tensors_equal(sp.load(prefix, storage_options=opts), again), label


def test_a_manifest_put_that_succeeds_but_reports_an_error_commits_nothing(
    url: str, opts: dict[str, Any], fs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest reached the server but the client saw an error (a lost response): the
    save raises, and its clean-up deletes the manifest first, so nothing half-done loads."""
    store_fs = open_store(url, opts).fs
    real = store_fs.pipe_file

    def pipe_file(path: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(path, value, *args, **kwargs)
        if str(path).endswith("/shardpoint.json"):
            raise PermissionError(errno.EACCES, "response lost (injected after the PUT)", path)
        return result

    monkeypatch.setattr(store_fs, "pipe_file", pipe_file)
    with pytest.raises(sp.StorageError, match=rf"writing {url}/shardpoint.json failed: .*response lost"):
        sp.save(A, url, storage_options=opts, max_shard_size=500)
    assert keys_under(fs, url) == []
    monkeypatch.undo()
    sp.save(A, url, storage_options=opts, max_shard_size=500)
    assert tensors_equal(sp.load(url, storage_options=opts), A)


# --------------------------------------------------------------- every step of a manager save


def _weights(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step)), "b": torch.arange(8.0) + step}


@pytest.mark.parametrize("action", ["runtime", "denied"])
def test_exception_at_every_step_of_a_manager_save_on_s3(
    action: str, url: str, opts: dict[str, Any], fs: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """Steps 1 and 2 are committed (keep_last=2); step 3 is saved with a fault at each of
    its steps: the upload, the manifest, the ``latest`` update, retention's deletion of step 1.
    ``restore`` returns the newest committed step bit-exactly; the next save leaves exactly
    the two newest steps and a ``latest`` naming the newest."""

    def prepare(root: str) -> sp.CheckpointManager:
        mgr = sp.CheckpointManager(root, keep_last=2, storage_options=opts)
        for step in (1, 2):
            mgr.save(step, {"model": _weights(step), "step": step})
        return mgr

    root = f"{url}/dry"
    mgr = prepare(root)
    with monkeypatch.context() as m:
        dry = S3Faults(root, opts)
        dry.install(m)
        mgr.save(3, {"model": _weights(3), "step": 3})
    steps = dry.steps
    assert steps[:3] == ["put step-000003/shardpoint.pending", "upload step-000003/model.safetensors",
                         "put step-000003/shardpoint.json"], steps
    assert steps[3:5] == ["delete step-000003/shardpoint.pending", "put latest"], steps
    # retention: the marker first (a deletion cut short refuses to load), then the manifest
    assert steps[5:7] == ["put step-000001/shardpoint.pending", "delete step-000001/shardpoint.json"], steps
    assert all(s.startswith("delete step-000001/") for s in steps[6:]), steps
    assert steps[-1] == "delete step-000001/shardpoint.pending", steps
    commit = 3

    for at, label in enumerate(steps, start=1):
        root = f"{url}/at{at}"
        mgr = prepare(root)
        faults = S3Faults(root, opts, at=at, action=action)
        with monkeypatch.context() as m:
            faults.install(m)
            if at == commit + 1:  # the marker's deletion after the commit is best effort
                mgr.save(3, {"model": _weights(3), "step": 3})
            else:
                with pytest.raises(Exception) as info:
                    mgr.save(3, {"model": _weights(3), "step": 3})
                check_error(info.value, faults, root, action)
        assert faults.fired == label
        assert no_open_multipart_uploads(fs, root), label
        fresh = sp.CheckpointManager(root, keep_last=2, storage_options=opts)
        newest = 3 if at > commit else 2
        assert fresh.latest_step() == newest, label
        target = {"model": {k: torch.zeros_like(v) for k, v in _weights(0).items()}, "step": 0}
        assert fresh.restore(target) == newest, label
        assert target["step"] == newest and tensors_equal(target["model"], _weights(newest)), label
        if at <= commit:
            assert not [k for k in keys_under(fs, root) if k.startswith("step-000003/")], label
            with pytest.raises(sp.CheckpointNotFoundError, match="step-000003 holds no objects"):
                sp.load(f"{root}/step-000003", storage_options=opts)
        # the next save finishes retention, removes the leftovers and moves `latest`
        fresh.save(4, {"model": _weights(4), "step": 4})
        assert fresh.steps() == [3, 4] if at > commit else [2, 4], label
        keep = {"step-000003", "step-000004"} if at > commit else {"step-000002", "step-000004"}
        keys = keys_under(fs, root)
        assert {k.split("/")[0] for k in keys} == keep | {"latest"}, (label, keys)
        # a marker that the commit failed to delete stays beside its manifest (ignored, as
        # documented: the manifest wins) until retention deletes the step; no other is left
        stray = ["step-000003/shardpoint.pending"] if at == commit + 1 else []
        assert [k for k in keys if k.endswith("shardpoint.pending")] == stray, (label, keys)
        assert fs.cat_file(f"{root.removeprefix('s3://')}/latest") == b"step-000004\n", label


# ----------------------------------------------------------------- async saves on S3


@pytest.fixture
def no_async_failure_leaks() -> Iterator[None]:
    """A failed async save left unseen would be raised by another test's next save."""
    yield
    last = sp_async.default_queue().last
    if last is not None:
        last.exception()
        last.observed = True


@pytest.mark.parametrize("action", ["runtime", "denied"])
def test_async_save_to_s3_failing_in_the_background_commits_nothing(
    action: str, url: str, opts: dict[str, Any], fs: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None,
    no_async_failure_leaks: None,
) -> None:
    """``async_save`` to a new prefix beside a committed checkpoint, with the fault at each
    step of its upload on the background thread: ``result()`` raises the error a save would
    (naming the object), nothing is left at the prefix, the checkpoint beside it loads
    bit-exactly. The caller mutating its state once ``async_save`` returned changes nothing.
    An error nobody looked at is raised by the next save, which saves nothing."""
    previous = f"{url}/previous"
    sp.save(A, previous, storage_options=opts, max_shard_size=500)
    prefix = f"{url}/dry"
    with monkeypatch.context() as m:
        dry = S3Faults(prefix, opts)
        dry.install(m)
        sp.async_save(B, prefix, storage_options=opts, max_shard_size=500).result()
    steps = dry.steps
    assert len(steps) == 6, steps  # marker, 2 uploads, index, manifest, marker
    commit = steps.index("put shardpoint.json") + 1

    for at, label in enumerate(steps, start=1):
        prefix = f"{url}/at{at}"
        faults = S3Faults(prefix, opts, at=at, action=action)
        state = {k: v.clone() for k, v in B.items()}
        with monkeypatch.context() as m:
            faults.install(m)
            handle = sp.async_save(state, prefix, storage_options=opts, max_shard_size=500)
            for v in state.values():
                v.add_(1000)  # the caller goes on training: the save holds its own copy
            caught = None
            if at > commit:  # the marker's deletion after the commit: best effort
                handle.result()
            else:
                with pytest.raises(Exception) as info:
                    handle.result()
                caught = info.value
        assert faults.fired == label, (faults.fired, label)
        keys = keys_under(fs, prefix)
        assert no_open_multipart_uploads(fs, prefix), label
        if caught is None:
            assert keys == sorted([*B_KEYS, "shardpoint.pending"]), (label, keys)
            assert tensors_equal(sp.load(prefix, storage_options=opts), B), label
        else:
            check_error(caught, faults, prefix, action)
            assert keys == [], (label, keys)
            with pytest.raises(sp.CheckpointNotFoundError, match=f"{prefix} holds no objects"):
                sp.load(prefix, storage_options=opts)
        assert tensors_equal(sp.load(previous, storage_options=opts), A), label

    # nobody looks at the handle: the next save raises, naming the failed prefix, and saves nothing
    prefix, other = f"{url}/unseen", f"{url}/other"
    with monkeypatch.context() as m:
        faults = S3Faults(prefix, opts, at=commit, action=action)
        faults.install(m)
        sp.async_save(B, prefix, storage_options=opts, max_shard_size=500)
        with pytest.raises(sp.CheckpointError) as info:
            sp.save(A, other, storage_options=opts, max_shard_size=500)
    text = str(info.value)
    assert f"the previous async save to {prefix} failed and nothing was committed there" in text, text
    check_error(info.value.__cause__, faults, prefix, action)  # type: ignore[arg-type]
    assert keys_under(fs, prefix) == [] and keys_under(fs, other) == []
    sp.save(A, other, storage_options=opts, max_shard_size=500)  # seen once: the next save works
    assert tensors_equal(sp.load(other, storage_options=opts), A)


@pytest.mark.parametrize("action", ["runtime", "denied"])
def test_exception_at_every_step_of_an_async_manager_save_on_s3(
    action: str, url: str, opts: dict[str, Any], fs: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None,
    no_async_failure_leaks: None,
) -> None:
    """``test_exception_at_every_step_of_a_manager_save_on_s3`` with ``async_save=True``: the
    fault fires on the background thread, in the save or in what follows its commit
    (``latest``, retention). ``result()`` raises it naming the object; before the commit
    nothing is committed for step 3 and ``restore`` gives step 2 bit-exactly, after it step
    3. An error nobody looked at is raised by the next ``save``, naming the step, and that
    save saves nothing; the one after it cleans up."""

    def prepare(root: str) -> sp.CheckpointManager:
        mgr = sp.CheckpointManager(root, keep_last=2, async_save=True, storage_options=opts)
        for step in (1, 2):
            mgr.save(step, {"model": _weights(step), "step": step})
        mgr.wait()
        return mgr

    def restored(root: str) -> int | None:
        target = {"model": {k: torch.zeros_like(v) for k, v in _weights(0).items()}, "step": 0}
        step = sp.CheckpointManager(root, storage_options=opts).restore(target)
        assert step is not None and target["step"] == step and tensors_equal(target["model"], _weights(step))
        return step

    root = f"{url}/dry"
    mgr = prepare(root)
    with monkeypatch.context() as m:
        dry = S3Faults(root, opts)
        dry.install(m)
        mgr.save(3, {"model": _weights(3), "step": 3})
        mgr.wait()
    steps = dry.steps
    commit = steps.index("put step-000003/shardpoint.json") + 1
    assert steps[commit:commit + 2] == ["delete step-000003/shardpoint.pending", "put latest"], steps
    assert steps[commit + 2] == "put step-000001/shardpoint.pending", steps
    assert all(s.startswith("delete step-000001/") for s in steps[commit + 3 :]), steps

    for at, label in enumerate(steps, start=1):
        root = f"{url}/at{at}"
        mgr = prepare(root)
        faults = S3Faults(root, opts, at=at, action=action)
        with monkeypatch.context() as m:
            faults.install(m)
            handle = mgr.save(3, {"model": _weights(3), "step": 3})
            assert isinstance(handle, sp.AsyncSave)
            if at == commit + 1:  # the marker's deletion after the commit is best effort
                handle.result()
            else:
                with pytest.raises(Exception) as info:
                    handle.result()
                check_error(info.value, faults, root, action)
        assert faults.fired == label
        assert no_open_multipart_uploads(fs, root), label
        newest = 3 if at > commit else 2
        assert restored(root) == newest, label
        if at <= commit:
            assert not [k for k in keys_under(fs, root) if k.startswith("step-000003/")], label
        mgr.save(4, {"model": _weights(4), "step": 4})  # the error was seen: this one saves
        mgr.wait()
        assert mgr.steps() == ([3, 4] if at > commit else [2, 4]), label
        keep = {"step-000003", "step-000004"} if at > commit else {"step-000002", "step-000004"}
        keys = keys_under(fs, root)
        assert {k.split("/")[0] for k in keys} == keep | {"latest"}, (label, keys)
        stray = ["step-000003/shardpoint.pending"] if at == commit + 1 else []
        assert [k for k in keys if k.endswith("shardpoint.pending")] == stray, (label, keys)
        assert fs.cat_file(f"{root.removeprefix('s3://')}/latest") == b"step-000004\n", label

    # nobody looks at the handle: the next save raises naming step 3, and saves nothing
    for at, committed in ((commit, False), (commit + 2, True)):  # the manifest; `latest`
        root = f"{url}/unseen{at}"
        mgr = prepare(root)
        with monkeypatch.context() as m:
            S3Faults(root, opts, at=at, action=action).install(m)
            mgr.save(3, {"model": _weights(3), "step": 3})
            with pytest.raises(sp.CheckpointError) as info:
                mgr.save(4, {"model": _weights(4), "step": 4})
        text = str(info.value)
        done = " after its commit" if committed else "; nothing was committed for it"
        assert f"the async save of step 3 to {root} failed{done}" in text, text
        assert "Step 4 was not saved either" in text, text
        assert not [k for k in keys_under(fs, root) if k.startswith("step-000004/")]
        assert restored(root) == (3 if committed else 2)
        mgr.save(4, {"model": _weights(4), "step": 4})
        mgr.wait()
        assert mgr.steps() == ([3, 4] if committed else [2, 4])


# ------------------------------------------------------------ stale state of a manager


def test_stale_leftovers_on_s3_are_ignored_by_restore_and_removed_by_the_next_save(
    url: str, opts: dict[str, Any], fs: Any
) -> None:
    """What crashes leave under a manager's root on S3, made by hand: a save cut mid-upload
    (marker and one object), one cut right after its marker, and a dead ``latest`` naming
    one of them; beside them two step prefixes with data objects and an index but neither
    manifest nor marker (a step being copied in, or one an old version's retention cut
    short). ``steps()``, ``latest_step()`` and ``restore`` see only the committed steps,
    bit-exactly; the cut saves refuse to load naming their prefix; the next save removes
    what the cut saves left (their marker says so) and keeps the unmarked prefixes."""
    root = url.removeprefix("s3://")
    shard = {"max_shard_size": 260}  # _weights: 2 objects (256 and 32 bytes) and an index per step
    mgr = sp.CheckpointManager(url, keep_last=2, storage_options=opts, **shard)
    for step in (1, 2):
        mgr.save(step, {"model": _weights(step), "step": step})
    step_keys = sorted(k.split("/", 1)[1] for k in keys_under(fs, url) if k.startswith("step-000002/"))
    assert len([k for k in step_keys if k.endswith(".safetensors")]) == 2, step_keys

    for n in (0, 5):  # copies of whole steps, then damaged below
        sp.save({"model": _weights(n), "step": n}, f"{url}/step-{n:06d}", storage_options=opts, **shard)
    fs.rm_file(f"{root}/step-000000/shardpoint.json")  # retention killed after the manifest
    sp.save({"model": _weights(6), "step": 6}, f"{url}/step-000006", storage_options=opts, **shard)
    fs.rm_file(f"{root}/step-000006/shardpoint.json")  # ... and after a data object too
    fs.rm_file(f"{root}/step-000006/model-00001-of-00002.safetensors")
    for name in sorted(fs.find(f"{root}/step-000005")):  # a save killed mid-upload
        if not name.endswith("model-00001-of-00002.safetensors"):
            fs.rm_file(name)
    fs.pipe_file(f"{root}/step-000005/shardpoint.pending", b"a shardpoint save is in progress or was interrupted\n")
    fs.pipe_file(f"{root}/step-000007/shardpoint.pending", b"a shardpoint save is in progress or was interrupted\n")
    fs.pipe_file(f"{root}/latest", b"step-000005\n")  # a dead latest, naming the cut save

    fresh = sp.CheckpointManager(url, keep_last=2, storage_options=opts, **shard)
    assert fresh.steps() == [1, 2] and fresh.latest_step() == 2
    target = {"model": {k: torch.zeros_like(v) for k, v in _weights(0).items()}, "step": 0}
    assert fresh.restore(target) == 2
    assert target["step"] == 2 and tensors_equal(target["model"], _weights(2))
    for n in (5, 7):
        with pytest.raises(sp.IncompleteCheckpointError, match=f"{url}/step-00000{n} is a save that never committed"):
            sp.load(f"{url}/step-00000{n}", storage_options=opts)
    with pytest.raises(sp.CheckpointError, match=re.escape(f"{url} has no committed step 5; it has [1, 2]")):
        fresh.restore(target, step=5)

    fresh.save(3, {"model": _weights(3), "step": 3})
    keys = keys_under(fs, url)
    assert {k.split("/")[0] for k in keys} == {"step-000000", "step-000002", "step-000003", "step-000006",
                                              "latest"}, keys
    assert sorted(k.split("/", 1)[1] for k in keys if k.startswith("step-000003/")) == step_keys, keys
    assert fs.cat_file(f"{root}/latest") == b"step-000003\n"
    assert fresh.steps() == [2, 3] and fresh.restore(target) == 3 and tensors_equal(target["model"], _weights(3))


# ------------------------------------------------------------------------- real SIGKILL

_KILL_CHILD = r"""
import json, os, signal, sys
import torch
import shardpoint as sp
from shardpoint._storage.store import open_store

url, options, where, when = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
mgr = sp.CheckpointManager(url, keep_last=2, storage_options=options)
for step in (1, 2):
    mgr.save(step, {"model": {"w": torch.full((64,), float(step))}, "step": step})
fs = open_store(url, options).fs
root = url.removeprefix("s3://")
for method in ("pipe_file", "rm_file"):
    real = getattr(fs, method)
    def wrapper(path, *args, _real=real, **kwargs):
        hit = str(path) == f"{root}/{where}"
        if hit and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = _real(path, *args, **kwargs)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(fs, method, wrapper)
mgr.save(3, {"model": {"w": torch.full((64,), 3.0)}, "step": 3})
os._exit(3)  # not reached: the kill fired
"""


@pytest.mark.parametrize(
    ("where", "when", "newest"),
    [
        ("step-000003/shardpoint.json", "before", 2),  # during the manifest upload
        ("step-000003/shardpoint.json", "after", 3),  # manifest stored, marker still there
        ("latest", "before", 3),  # during the `latest` update
        ("step-000001/shardpoint.json", "after", 3),  # retention cut short
    ],
    ids=["before-manifest", "after-manifest", "before-latest", "mid-retention"],
)
def test_sigkill_at_named_steps_of_a_manager_save_on_s3(
    where: str, when: str, newest: int, url: str, opts: dict[str, Any], fs: Any
) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-c", _KILL_CHILD, url, json.dumps(opts), where, when],
        capture_output=True, env=env, timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stderr.decode()[-2000:])
    keys = keys_under(fs, url)
    step3 = [k for k in keys if k.startswith("step-000003/")]
    if newest == 2:
        assert step3 == ["step-000003/model.safetensors", "step-000003/shardpoint.pending"], keys
        with pytest.raises(sp.IncompleteCheckpointError, match=f"{url}/step-000003 is a save that never committed"):
            sp.load(f"{url}/step-000003", storage_options=opts)
    mgr = sp.CheckpointManager(url, keep_last=2, storage_options=opts)
    assert mgr.latest_step() == newest
    target = {"model": {"w": torch.zeros(64)}, "step": 0}
    assert mgr.restore(target) == newest
    assert target["step"] == newest and torch.equal(target["model"]["w"], torch.full((64,), float(newest)))
    if where == "step-000001/shardpoint.json":  # half-deleted step 1: not a step any more
        assert 1 not in mgr.steps() and any(k.startswith("step-000001/") for k in keys)
        assert "step-000001/shardpoint.pending" in keys, keys  # so a direct load refuses it too
        with pytest.raises(sp.IncompleteCheckpointError, match=f"{url}/step-000001 is a save that never committed"):
            sp.load(f"{url}/step-000001", storage_options=opts)
    mgr.save(4, {"model": {"w": torch.full((64,), 4.0)}, "step": 4})  # cleans every leftover
    keys = keys_under(fs, url)
    assert {k.split("/")[0] for k in keys} == {f"step-00000{newest}", "step-000004", "latest"}, keys
    # killed after the manifest: the step is committed and its marker stays beside the
    # manifest (ignored: the manifest wins) until retention deletes the step
    stray = ["step-000003/shardpoint.pending"] if when == "after" and where.startswith("step-000003/") else []
    assert [k for k in keys if k.endswith("shardpoint.pending")] == stray, keys


# ----------------------------------------------------------------------- damage on load


def test_truncated_and_swapped_objects_fail_the_load_naming_the_object(url: str, opts: dict[str, Any], fs: Any) -> None:
    first, second = f"{url}/a", f"{url}/b"
    sp.save(A, first, storage_options=opts, max_shard_size=500)
    other = {k: v + 10 for k, v in A.items()}
    sp.save(other, second, storage_options=opts, max_shard_size=500)  # same layout, other save
    root = first.removeprefix("s3://")
    victim = "model-00002-of-00003.safetensors"
    original = fs.cat_file(f"{root}/{victim}")

    for cut in (1, 100):
        fs.pipe_file(f"{root}/{victim}", original[:-cut])
        with pytest.raises(sp.CorruptCheckpointError) as caught:
            sp.load(first, storage_options=opts)
        text = str(caught.value)
        assert f"{first}/{victim} is {len(original) - cut} bytes but the manifest recorded {len(original)}" in text, text

    fs.pipe_file(f"{root}/{victim}", fs.cat_file(f"{second.removeprefix('s3://')}/{victim}"))
    for attempt in (
        lambda: sp.load(first, storage_options=opts),
        lambda: sp.load_into({k: torch.zeros(100) for k in A}, first, storage_options=opts),
    ):
        with pytest.raises(sp.CorruptCheckpointError) as caught:
            attempt()
        text = str(caught.value)
        assert f"{first}/{victim} belongs to another save" in text and "swapped in from another checkpoint" in text, text

    fs.pipe_file(f"{root}/{victim}", original)  # put back: loads again, bit for bit
    assert tensors_equal(sp.load(first, storage_options=opts), A)
