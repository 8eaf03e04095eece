"""The storage seam: one Store interface, a local directory and an object store behind it.

Every test runs on a local directory and on a prefix of the S3 server on loopback, and
asserts the same outcome: the manager (and everything above ``_storage/``) has one code
path, and the differences that remain live in the store (its transaction's commit, its
named capabilities).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._format.manifest import MANIFEST_NAME, PENDING_NAME
from shardpoint._storage import Store, open_store
from shardpoint._storage.fsspec_store import FsspecStore
from shardpoint._storage.local_store import LocalStore
from shardpoint.errors import CorruptCheckpointError, InvalidArgumentError

_STEP = re.compile(r"^step-(\d+)$")


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    """(root, storage_options): a local directory, or a fresh prefix on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "root"), None
    return request.getfixturevalue("url"), request.getfixturevalue("opts")


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), float(step))}, "step": step}


def test_open_store_names_the_capabilities_not_the_kind(where: tuple[str, dict[str, Any] | None]) -> None:
    root, options = where
    store: Store = open_store(root, options)
    local = options is None
    assert isinstance(store, LocalStore if local else FsspecStore)
    assert (store.tracks_versions, store.small_reads_are_cheap) == (local, local)
    assert store.shared_files is local
    assert str(store.location) == root
    assert str(store.child("step-000001").location) == f"{root}/step-000001"


def test_the_manager_behaves_the_same_on_both_stores(where: tuple[str, dict[str, Any] | None]) -> None:
    root, options = where
    mgr = sp.CheckpointManager(root, keep_last=2, keep_best=1, metric="loss", storage_options=options)
    for step, loss in ((1, 0.1), (2, 0.5), (3, 0.4), (4, 0.3)):
        mgr.save(step, _state(step), metrics={"loss": loss})
    assert mgr.steps() == [1, 3, 4]  # the last two, and the best one
    assert mgr.latest_step() == 4
    assert mgr.best_steps() == [1, 4, 3]
    assert mgr.metrics(3) == {"loss": 0.4}
    target = _state(0)
    assert mgr.restore(target) == 4
    assert target["model"]["w"].tolist() == [4.0] * 8 and target["step"] == 4
    assert mgr.restore(target, step=1) == 1
    assert target["model"]["w"].tolist() == [1.0] * 8
    latest = open_store(root, options).read_small("latest", limit=64)
    assert latest == b"step-000004\n"


def test_small_files_are_whole_capped_and_missing_alike(where: tuple[str, dict[str, Any] | None]) -> None:
    root, options = where
    store = open_store(root, options)
    store.make()
    store.replace_small("pointer", b"step-000007\n")
    assert store.read_small("pointer", limit=64) == b"step-000007\n"
    store.replace_small("pointer", b"step-000008\n")  # replaced whole
    assert store.read_small("pointer", limit=64) == b"step-000008\n"
    with pytest.raises(CorruptCheckpointError, match=r"is 12 bytes, over the 4-byte limit"):
        store.read_small("pointer", limit=4)
    with pytest.raises(FileNotFoundError):
        store.read_small("absent", limit=64)


def test_the_commit_difference_lives_in_the_transaction(where: tuple[str, dict[str, Any] | None]) -> None:
    """Before its commit a save is never a committed child: locally its files are in a
    hidden temporary directory, on the store they are under the final prefix beside the
    pending marker, without the manifest. After it, both list the child as committed."""
    root, options = where
    store = open_store(root, options)
    store.make()
    txn = store.child("step-000001").open_transaction(overwrite=False)
    txn.write_bytes("notes.txt", b"data", durable=False)
    assert store.children().get("step-000001", False) is False
    txn.write_bytes(MANIFEST_NAME, b"{}", durable=False)
    txn.commit(durable=False)
    assert store.children()["step-000001"] is True
    assert store.child("step-000001").read_small("notes.txt", limit=64) == b"data"
    store.child("step-000001").delete_tree()
    assert "step-000001" not in store.children()


def test_tidy_removes_what_crashed_saves_left(where: tuple[str, dict[str, Any] | None]) -> None:
    root, options = where
    mgr = sp.CheckpointManager(root, storage_options=options)
    mgr.save(1, _state(1))
    store = open_store(root, options)
    dead = store.child("step-000002")  # a save killed before its manifest
    txn = dead.open_transaction(overwrite=False)
    txn.write_bytes("model.safetensors", b"partial", durable=False)
    if isinstance(store, LocalStore):
        txn._unlock()  # type: ignore[attr-defined]  # as if its process died: the lock is free
        (store.location / ".latest.tmp-0123").write_bytes(b"torn")
    else:
        assert PENDING_NAME in dead.list()
    store.tidy(_STEP, small_files=["latest"])
    assert store.children() == {"step-000001": True}
    if isinstance(store, LocalStore):
        assert sorted(p.name for p in store.location.iterdir() if p.name != ".shardpoint-writer.lock") == [
            "latest", "step-000001"]
    assert mgr.steps() == [1]


def test_storage_options_with_a_local_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"storage_options were given but .* is a local path"):
        open_store(tmp_path / "x", {"key": "k"})


def test_a_checkpoint_opens_from_the_store_resolved_at_the_edge(where: tuple[str, dict[str, Any] | None]) -> None:
    from shardpoint._source import open_checkpoint
    from shardpoint._verify import verify_checkpoint

    root, options = where
    sp.save({"w": torch.arange(4.0)}, f"{root}/ckpt", storage_options=options)
    store = open_store(root, options).child("ckpt")
    with open_checkpoint(store) as ckpt:
        assert (ckpt.kind, ckpt.local_files) == ("shardpoint", options is None)
        assert ckpt.listing() == ["model.safetensors", MANIFEST_NAME]
        assert ckpt.header("model.safetensors").entries["w"].shape == (4,)
    report = verify_checkpoint(f"{root}/ckpt", storage_options=options)
    assert (report.ok, report.files_checked, report.bytes_checked) == (True, 1, 16)


def test_a_folder_not_named_as_the_manager_names_steps_is_not_a_step(tmp_path: Path) -> None:
    """A committed checkpoint copied in as ``step-500`` (or with non-ASCII digits) is the
    user's folder: not listed, not restored, not retired; the manager's own steps are."""
    mgr = sp.CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2):
        mgr.save(step, {"model": {"w": torch.full((2,), float(step))}})
    sp.save({"model": {"w": torch.full((2,), 500.0)}}, tmp_path / "step-500")
    sp.save({"model": {"w": torch.full((2,), 7.0)}}, tmp_path / "step-\u0661\u0662\u0663\u0664\u0665\u0666")
    assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
    mgr.save(3, {"model": {"w": torch.full((2,), 3.0)}})
    assert mgr.steps() == [2, 3]
    target = {"model": {"w": torch.zeros(2)}}
    assert mgr.restore(target) == 3 and torch.equal(target["model"]["w"], torch.full((2,), 3.0))
    assert sorted(os.listdir(tmp_path)) == [".shardpoint-writer.lock", "latest", "step-000002", "step-000003", "step-500",
                                            "step-\u0661\u0662\u0663\u0664\u0665\u0666"]


def test_a_metric_too_large_for_a_float_neither_stops_saving_nor_ranks_best(tmp_path: Path) -> None:
    """A step's manifest whose metric is a 400-digit integer (forged, or another tool's):
    ranking compares it as the number it is (math.isnan refused it with OverflowError,
    and every later save of a keep_best manager failed before committing)."""
    mgr = sp.CheckpointManager(tmp_path, keep_last=1, keep_best=1, metric="loss")
    mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 0.125})
    mgr.save(2, {"w": torch.ones(2)}, metrics={"loss": 0.25})  # step 1 stays: the best
    manifest = tmp_path / "step-000001" / "shardpoint.json"
    text = manifest.read_text()
    assert '"metrics":{"loss":0.125}' in text
    manifest.write_text(text.replace('"loss":0.125', '"loss":' + "9" * 400))
    assert mgr.best_steps() == [2, 1]
    mgr.save(3, {"w": torch.ones(2)}, metrics={"loss": 1.0})
    assert mgr.steps() == [2, 3]
