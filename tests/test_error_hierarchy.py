"""Every error the public API raises for a bad argument or a runtime condition is a
``CheckpointError`` subclass, also the matching builtin, with a message naming the value and
what to do: a walk over the entry points with bad arguments and conditions."""

from __future__ import annotations

import errno
import fcntl
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
import shardpoint.errors as errors_module
from shardpoint._io import files as io_files


def test_every_error_class_is_a_checkpoint_error_and_a_builtin() -> None:
    classes = [c for _, c in inspect.getmembers(errors_module, inspect.isclass) if c.__module__ == errors_module.__name__]
    assert len(classes) == len(errors_module.__all__) == 21
    for cls in classes:
        assert issubclass(cls, sp.CheckpointError), cls
        if cls is not sp.CheckpointError:
            builtins = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
            assert builtins, f"{cls.__name__} refines no builtin exception"
        assert getattr(sp, cls.__name__) is cls  # exported
    assert issubclass(sp.InvalidArgumentTypeError, TypeError) and issubclass(sp.InvalidArgumentTypeError, ValueError)
    assert issubclass(sp.InvalidSizeError, sp.InvalidArgumentError)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    sp.save({"w": torch.arange(4.0)}, path)
    return path


def _cases(ckpt: Path, tmp: Path) -> list[tuple[str, Callable[[], Any], type[Exception], type[Exception], str]]:
    """(what, call, shardpoint class, builtin, text the message holds)."""
    state = {"w": torch.ones(2)}
    return [
        ("save layout", lambda: sp.save(state, tmp / "a", layout="columns"),
         sp.InvalidArgumentError, ValueError, "unknown layout 'columns'; use 'hf' (whole tensors) or 'chunked'"),
        ("save storage_options type", lambda: sp.save(state, tmp / "b", storage_options="key=x"),
         sp.InvalidArgumentTypeError, TypeError, "storage_options must be a dict of fsspec filesystem options, not str"),
        ("save max_shard_size", lambda: sp.save(state, tmp / "c", max_shard_size="lots"),
         sp.InvalidSizeError, ValueError, "'lots'"),
        ("local path with storage_options", lambda: sp.save(state, tmp / "d", storage_options={"key": "k"}),
         sp.InvalidArgumentError, ValueError, "storage_options were given but"),
        ("unknown URL protocol", lambda: sp.load("nosuchproto://bucket/x"),
         sp.CheckpointError, ValueError, "nosuchproto://bucket/x"),
        ("load keys", lambda: sp.load(ckpt, keys=["nope"]),
         sp.InvalidArgumentError, ValueError, f"{ckpt} has no tensor named 'nope'; `shardpoint inspect` lists the names"),
        ("load mmap of a URL", lambda: (sp.save(state, "memory://errors/m", overwrite=True),
                                        sp.load("memory://errors/m", mmap=True)),
         sp.InvalidArgumentError, ValueError, "memory://errors/m: mmap=True needs local files; load it with mmap=False"),
        ("options type", lambda: sp.load(ckpt, options={"read_threads": 2}),
         sp.InvalidArgumentTypeError, TypeError, "options= takes a shardpoint.Options, IOOptions"),
        ("manager mode", lambda: sp.CheckpointManager(tmp / "r", mode="best"),
         sp.InvalidArgumentError, ValueError, "CheckpointManager: mode must be 'min' or 'max', not 'best'"),
        ("manager keep_last", lambda: sp.CheckpointManager(tmp / "r", keep_last=0),
         sp.InvalidArgumentError, ValueError, "CheckpointManager: keep_last must be a positive int or None, not 0"),
        ("manager keep_last bool", lambda: sp.CheckpointManager(tmp / "r", keep_last=True),
         sp.InvalidArgumentError, ValueError, "keep_last must be a positive int or None, not True"),
        ("manager keep_best", lambda: sp.CheckpointManager(tmp / "r", keep_best=2),
         sp.InvalidArgumentError, ValueError, "keep_best needs metric="),
        ("manager step", lambda: sp.CheckpointManager(tmp / "r").save(-1, state),
         sp.InvalidArgumentError, ValueError, "CheckpointManager.save: step must be a non-negative int, not -1"),
        ("manager restore step", lambda: sp.CheckpointManager(tmp / "r").restore(state, step=7),
         sp.CheckpointNotFoundError, FileNotFoundError, "has no committed step 7"),
        ("convert dtype", lambda: sp.convert(ckpt, tmp / "o1", dtype="fp8"),
         sp.InvalidArgumentError, ValueError, "unknown dtype 'fp8'; use bf16, fp16, fp32 or fp64"),
        ("convert integer dtype", lambda: sp.convert(ckpt, tmp / "o2", dtype=torch.int8),
         sp.InvalidArgumentError, ValueError, "dtype torch.int8 is not a floating-point dtype"),
        ("convert workers", lambda: sp.convert(ckpt, tmp / "o3", workers=0),
         sp.InvalidArgumentError, ValueError, "convert: workers must be at least 1, not 0"),
        ("convert component", lambda: sp.convert(ckpt, tmp / "o4", components=["optim"]),
         sp.InvalidArgumentError, ValueError, "has no component named 'optim'"),
        ("diff tolerance", lambda: sp.diff(ckpt, ckpt, atol=-1.0),
         sp.InvalidArgumentError, ValueError, "diff: atol and rtol must be >= 0 (got atol=-1.0"),
        ("save max_shard_size past any file", lambda: sp.save(state, tmp / "e", max_shard_size="1" + "0" * 400 + "GB"),
         sp.InvalidSizeError, ValueError,
         "size '1000000000000000000000000000000000000000...' is larger than any file can be (9223372036854775807 bytes)"),
        ("load max_buffer_bytes past any file", lambda: sp.load(ckpt, max_buffer_bytes=2**64),
         sp.InvalidSizeError, ValueError, f"size {2**64} is larger than any file can be"),
        ("load integer dtype", lambda: sp.load(ckpt, dtype=torch.bool),
         sp.InvalidArgumentError, ValueError, "dtype torch.bool is not a floating-point dtype; use bf16, fp16, fp32 or fp64"),
        ("load_into integer dtype", lambda: sp.load_into({"w": torch.zeros(4)}, ckpt, dtype=torch.int8),
         sp.InvalidArgumentError, ValueError, "dtype torch.int8 is not a floating-point dtype"),
        ("load dtype of another type", lambda: sp.load(ckpt, dtype=16),
         sp.InvalidArgumentTypeError, TypeError, "dtype must be a torch.dtype or its name (e.g. torch.bfloat16 or 'bf16'), not int"),
        ("load unknown dtype name", lambda: sp.load(ckpt, dtype="float17"),
         sp.InvalidArgumentError, ValueError, "unknown dtype 'float17'; use bf16, fp16, fp32 or fp64"),
        ("load device", lambda: sp.load(ckpt, device="gpu0"),
         sp.InvalidArgumentError, ValueError, "device 'gpu0' is not a device torch knows; use e.g. 'cpu', 'cuda', 'cuda:0'"),
        ("load_into device", lambda: sp.load_into({"w": torch.zeros(4)}, ckpt, device=["cpu"]),
         sp.InvalidArgumentTypeError, TypeError, "device must be a torch.device or a string such as 'cpu' or 'cuda:0', not list"),
        ("load keys of lists", lambda: sp.load(ckpt, keys=[["w"]]),
         sp.InvalidArgumentTypeError, TypeError, "keys must be names (strings); got list \"['w']\""),
        ("load keys not a list", lambda: sp.load(ckpt, keys=3),
         sp.InvalidArgumentTypeError, TypeError, "keys must be a list of names, not int"),
        ("load None", lambda: sp.load(None),
         sp.InvalidArgumentTypeError, TypeError, "the path must be a str or os.PathLike (a directory, a file or a URL), not NoneType"),
        ("load a path with NUL", lambda: sp.load(f"{ckpt}\x00x"),
         sp.InvalidArgumentError, ValueError, "holds a NUL character; no file has that name"),
        ("save a path with NUL", lambda: sp.save(state, f"{tmp}/x\x00y"),
         sp.InvalidArgumentError, ValueError, "holds a NUL character; no file has that name"),
        ("load_into an expanded target", lambda: sp.load_into({"w": torch.zeros(1).expand(4)}, ckpt),
         sp.InvalidStateError, TypeError, "target tensor 'w' has elements that share one memory location"),
        ("load a GPU that is not there", lambda: sp.load(ckpt, device="cuda:0"),
         sp.InvalidArgumentError, ValueError, "device 'cuda:0' is a CUDA device, and torch sees none on this machine"),
        ("device_map to disk", lambda: sp.load_into({"w": torch.zeros(4)}, ckpt, device_map={"": "disk"}),
         sp.InvalidArgumentError, ValueError, "device_map[''] = 'disk': offloading to disk is not supported by load_into"),
        ("device_map of an index", lambda: sp.load_into({"w": torch.zeros(4)}, ckpt, device_map={"": 0}),
         sp.InvalidArgumentError, ValueError, "device '0' is a CUDA device, and torch sees none on this machine"),
        ("device_map auto for a dict", lambda: sp.load_into({"w": torch.zeros(4)}, ckpt, device_map="auto"),
         sp.InvalidArgumentError, ValueError, "device_map='auto' plans the placement of a module; pass the module"),
        ("device_map of another type", lambda: sp.load_into({"w": torch.zeros(4)}, ckpt, device_map={1: "cpu"}),
         sp.InvalidArgumentTypeError, TypeError, "device_map keys must be module names (strings, '' for all), not int"),
        ("diff tolerance type", lambda: sp.diff(ckpt, ckpt, atol="0.1"),
         sp.InvalidArgumentTypeError, TypeError, "diff: atol must be a number, not str"),
        ("hf:// storage_options", lambda: sp.load("hf://org/name", storage_options={"token": "x"}),
         sp.InvalidArgumentError, ValueError, "storage_options ['token'] do not apply to hf://org/name"),
        ("empty_model of a built model", lambda: sp.empty_model(torch.nn.Linear(2, 2)),
         sp.InvalidArgumentTypeError, TypeError, "empty_model takes a class or a function that builds the model "
         "(e.g. sp.empty_model(LlamaForCausalLM, config)), not a model already built (a Linear): calling it would "
         "run its forward"),
        ("load_into a class", lambda: sp.load_into(torch.nn.Linear, ckpt),
         sp.InvalidArgumentTypeError, TypeError, "load_into loads into objects that exist, and got the class Linear: "
         "build it first, e.g. model = sp.empty_model(Linear, config)"),
    ]


def test_bad_arguments_raise_checkpoint_errors_naming_the_value(ckpt: Path, tmp_path: Path) -> None:
    failures = []
    for what, call, cls, builtin, text in _cases(ckpt, tmp_path):
        try:
            call()
        except Exception as exc:
            if not (isinstance(exc, cls) and isinstance(exc, builtin) and text in str(exc)):
                failures.append(f"{what}: {type(exc).__name__}: {exc}")
        else:
            failures.append(f"{what}: nothing raised")
    assert failures == []


def test_an_unseen_async_failure_is_a_previous_save_failed_error(ckpt: Path, tmp_path: Path) -> None:
    handle = sp.async_save({"w": torch.ones(2)}, ckpt)  # exists, no overwrite: fails in the background
    assert isinstance(handle.exception(), sp.CheckpointExistsError)
    with pytest.raises(sp.PreviousSaveFailedError) as caught:
        sp.save({"w": torch.ones(2)}, tmp_path / "next")
    assert isinstance(caught.value, RuntimeError)
    assert str(caught.value).startswith(f"the previous async save to {ckpt} failed and nothing was committed there")
    assert isinstance(caught.value.__cause__, sp.CheckpointExistsError)
    assert not (tmp_path / "next").exists()


def test_an_unseen_failure_after_the_commit_says_the_checkpoint_is_whole(tmp_path: Path) -> None:
    def tracker(info: sp.SaveInfo) -> None:
        raise RuntimeError("upload to my tracker failed")

    sp.async_save({"w": torch.ones(2)}, tmp_path / "a", on_commit=tracker).wait()
    with pytest.raises(sp.PreviousSaveFailedError) as caught:
        sp.save({"w": torch.ones(2)}, tmp_path / "b")
    assert str(caught.value) == (
        f"the previous async save to {tmp_path / 'a'} failed after its commit (the checkpoint there is whole): "
        "upload to my tracker failed. Call .result() on async_save handles to see such errors where they happen")
    assert sp.load(tmp_path / "a")["w"].tolist() == [1.0, 1.0]


def test_a_tensor_that_changed_size_during_a_save_is_a_state_changed_error(tmp_path: Path) -> None:
    """The write of a run of small tensors checks each against the plan's byte count (as if
    another thread resized one after the plan was made)."""
    with (tmp_path / "f").open("wb") as f, pytest.raises(sp.StateChangedError) as caught:
        io_files.write_small_run(f.fileno(), [("a", torch.ones(2), 8), ("b", torch.ones(3), 8)], 0, 16)
    assert isinstance(caught.value, RuntimeError)
    assert str(caught.value).startswith("tensor 'b' changed size while it was being saved")


def test_a_manager_root_locked_too_long_is_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardpoint._manager as manager

    root = tmp_path / "run"
    mgr = sp.CheckpointManager(root)
    mgr.save(1, {"w": torch.ones(2)})
    monkeypatch.setattr(manager, "_ROOT_LOCK_WAIT", 0.2)  # instead of 600 s
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another manager, hung while managing the root
        with pytest.raises(sp.StorageError) as caught:
            mgr.save(2, {"w": torch.ones(2)})
    finally:
        os.close(fd)
    assert caught.value.errno == errno.EWOULDBLOCK
    assert f"another process has held the lock on {root} for 0 s" in str(caught.value)
    assert mgr.steps() == [1]


_EACCES_CHILD = """
import os, sys
import torch, shardpoint as sp
sp.save({"w": torch.ones(2)}, sys.argv[2])  # lazy imports done while we may still read them
if os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)  # nobody: the directory is not ours to write in
try:
    sp.save({"w": torch.ones(2)}, sys.argv[1])
except sp.StorageError as exc:
    print(exc.errno, isinstance(exc, PermissionError) or isinstance(exc, OSError), exc)
"""


def test_eacces_during_a_local_save_is_a_storage_error_naming_the_path() -> None:
    """A real EACCES: a child process (dropping root to ``nobody`` where it runs as root)
    saves into a directory it may not write."""
    base = tempfile.mkdtemp(prefix="sp-eacces-")
    try:
        os.chmod(base, 0o755)
        locked = os.path.join(base, "locked")
        os.mkdir(locked, 0o555)
        target = os.path.join(locked, "ckpt")
        src = str(Path(sp.__file__).resolve().parents[1])
        done = subprocess.run([sys.executable, "-c", _EACCES_CHILD, target, os.path.join(base, "warm")], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr
        code, is_oserror, message = done.stdout.strip().split(" ", 2)
        assert (int(code), is_oserror) == (errno.EACCES, "True"), done.stdout
        assert message.startswith(f"[Errno 13] saving {target} failed while creating its temporary directory: "
                                  "Permission denied"), message
        assert "you may not write there: fix the directory's permissions or save somewhere else" in message
        assert message.endswith("Nothing was committed there by this save: the checkpoint that was there "
                                "before, if any, is unchanged, and this save's temporary directory is removed")
        assert os.listdir(locked) == []
    finally:
        os.chmod(os.path.join(base, "locked"), 0o755)
        shutil.rmtree(base)
