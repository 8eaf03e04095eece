"""Round trips, sizes, planning, layout and commit of the core HF-layout save/load."""

from __future__ import annotations

import inspect
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardpoint as sp
from shardpoint._checksum import crc32c, crc32c_combine
from shardpoint._planning.shards import plan_shards, shard_file_names
from shardpoint._sizes import human_size, parse_size


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5GB", 5_000_000_000), ("5GiB", 5 * 2**30), ("10kB", 10_000), ("3KiB", 3072),
     ("2MB", 2_000_000), ("2MiB", 2 * 2**20), ("1TB", 10**12), ("7", 7), (123, 123), ("1.5GB", 1_500_000_000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5XB", "-1", "", "GB", 0, -5, True, 1.5, "5 G B"])
def test_parse_size_rejects(bad):
    with pytest.raises(sp.InvalidSizeError, match=r"size"):
        parse_size(bad)


def test_human_size():
    assert human_size(999) == "999 B"
    assert human_size(2_150_000_000) == "2.15 GB"


def test_plan_shards_follows_transformers_rule():
    sizes = [("a", 3), ("b", 3), ("c", 3), ("big", 20), ("d", 1)]
    # huggingface_hub: the oversized tensor's file is closed at once; "c" and "d" share the
    # file still being filled, which comes after it.
    assert plan_shards(sizes, 6) == [["a", "b"], ["big"], ["c", "d"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "big", "d"]]
    assert shard_file_names("model", 3)[2] == "model-00003-of-00003.safetensors"


def test_crc32c_combine_matches_whole():
    a, b = os.urandom(1000), os.urandom(70_001)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    assert crc32c(b"123456789") == 0xE3069283  # the standard crc32c check value


ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod().item()) * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype):
    torch.manual_seed(0)
    sd = {"x": _sample(dtype, (3, 5)), "scalar": _sample(dtype, ()), "empty": torch.empty(0, 4, dtype=dtype)}
    sp.save(sd, tmp_path / "ck")
    out = sp.load(tmp_path / "ck")
    assert list(out) == ["x", "scalar", "empty"]
    for k, v in sd.items():
        assert out[k].dtype == dtype and out[k].shape == v.shape
        assert _bits(out[k]) == _bits(v)
    # The real safetensors reader agrees.
    ref = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert _bits(ref["x"]) == _bits(sd["x"])


def test_sharded_layout_index_and_metadata(tmp_path):
    sd = {f"layer.{i}.weight": torch.full((10, 10), float(i)) for i in range(5)}  # 400 B each
    info = sp.save(sd, tmp_path / "ck", max_shard_size=1000)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "shardpoint.json",
    ]
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2000
    assert index["weight_map"] == {
        "layer.0.weight": "model-00001-of-00003.safetensors",
        "layer.1.weight": "model-00001-of-00003.safetensors",
        "layer.2.weight": "model-00002-of-00003.safetensors",
        "layer.3.weight": "model-00002-of-00003.safetensors",
        "layer.4.weight": "model-00003-of-00003.safetensors",
    }
    assert info.tensor_bytes == 2000
    for fname in names[:3]:
        with safe_open(str(tmp_path / "ck" / fname), "pt") as f:
            assert f.metadata()["format"] == "pt"
            assert f.metadata()["shardpoint.save_id"] == info.save_id
    manifest = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    assert manifest["format"] == "shardpoint" and manifest["format_version"] == 3
    assert manifest["layout"] == "hf" and manifest["world_size"] == 1 and manifest["flat"] is True
    chunk = manifest["components"]["model"]["tensors"]["layer.3.weight"]["chunks"][0]
    data = torch.full((10, 10), 3.0).numpy().tobytes()
    # a whole tensor under its own name: key, offsets and shape are implied (format 2)
    assert chunk == {"file": "model-00002-of-00003.safetensors", "crc32c": crc32c(data)}
    assert manifest["files"]["model-00002-of-00003.safetensors"]["size"] == os.path.getsize(
        tmp_path / "ck" / "model-00002-of-00003.safetensors")


def test_golden_bytes_of_a_tiny_file(tmp_path):
    """The exact bytes of a one-tensor file: length prefix, padded JSON header, data."""
    info = sp.save({"w": torch.tensor([1.0, 2.0])}, tmp_path / "ck")
    raw = (tmp_path / "ck" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n]
    expected = (
        f'{{"__metadata__":{{"format":"pt","shardpoint.save_id":"{info.save_id}"}},'
        '"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    ).encode()
    assert header.rstrip(b" ") == expected
    assert (8 + n) % 8 == 0
    assert raw[8 + n :] == struct.pack("<2f", 1.0, 2.0)


def test_non_contiguous_and_views_written_contiguous(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    sd = {"t": base.t(), "slice": base[:, 1:3], "step": base[::2]}
    sp.save(sd, tmp_path / "ck")
    out = sp.load(tmp_path / "ck")
    for k, v in sd.items():
        assert torch.equal(out[k], v) and out[k].is_contiguous()


def test_tied_tensors_stored_once_and_restored_tied(tmp_path):
    emb = torch.randn(8, 4)
    sd = {"embed.weight": emb, "other": torch.ones(2), "lm_head.weight": emb}
    sp.save(sd, tmp_path / "ck")
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "other"]
    manifest = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    assert manifest["components"]["model"]["aliases"] == {"lm_head.weight": "embed.weight"}
    out = sp.load(tmp_path / "ck")
    assert list(out) == ["embed.weight", "other", "lm_head.weight"]
    assert out["lm_head.weight"] is out["embed.weight"]
    assert torch.equal(out["lm_head.weight"], emb)
    assert sp.load(tmp_path / "ck", keys=["lm_head.weight"])["lm_head.weight"].shape == (8, 4)


class _TiedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("how", ["in-place", "empty", "empty-bf16"])
def test_tied_target_keys_stored_apart_must_hold_the_same_values(tmp_path, how):
    """A checkpoint of an untied model loaded into a tied one: both stored values went into
    the one tensor, the last read won, and the load said ok. Equal values (a file that
    stores both copies of a tied weight) load; different ones are refused, naming both."""
    emb = torch.randn(8, 4)
    sp.save({"emb.weight": emb, "head.weight": emb.clone()}, tmp_path / "same")
    sp.save({"emb.weight": emb, "head.weight": emb + 1}, tmp_path / "apart")

    def target() -> torch.nn.Module:
        return sp.empty_model(_TiedNet) if how.startswith("empty") else _TiedNet()

    kwargs = {"dtype": torch.bfloat16} if how == "empty-bf16" else {}
    net = target()
    assert sp.load_into(net, tmp_path / "same", **kwargs).ok
    assert net.head.weight is net.emb.weight and torch.equal(net.emb.weight.float(), emb.to(net.emb.weight.dtype).float())
    for strict in (True, False):
        with pytest.raises(sp.LoadMismatchError) as exc:
            sp.load_into(target(), tmp_path / "apart", strict=strict, **kwargs)
        assert str(exc.value) == (
            f"{tmp_path / 'apart'}: 'emb.weight' and 'head.weight' share one tensor in the target (tied weights), "
            "but the checkpoint stores different values for them; loading both into one tensor would drop one. "
            "Untie them in the target (for transformers: tie_word_embeddings=False in the config), or load a "
            "checkpoint saved from a tied model. The target may now hold part of this checkpoint's values"
        )


def test_load_keys_device_dtype_and_mmap(tmp_path):
    sd = {"a": torch.randn(4, 4), "b": torch.arange(5), "c": torch.randn(3).half()}
    sp.save(sd, tmp_path / "ck")
    part = sp.load(tmp_path / "ck", keys=["c"])
    assert list(part) == ["c"] and torch.equal(part["c"], sd["c"])
    cast = sp.load(tmp_path / "ck", dtype=torch.bfloat16)
    assert cast["a"].dtype == torch.bfloat16 and cast["b"].dtype == torch.int64
    assert torch.equal(cast["a"], sd["a"].bfloat16())
    mapped = sp.load(tmp_path / "ck", mmap=True)
    assert torch.equal(mapped["a"], sd["a"])
    mapped["a"].add_(1)  # copy-on-write: the file is untouched
    assert torch.equal(sp.load(tmp_path / "ck")["a"], sd["a"])
    with pytest.raises(sp.CheckpointError, match=r"no tensor named 'nope'"):
        sp.load(tmp_path / "ck", keys=["nope"])


def test_load_into_module_in_place_and_meta(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    sp.save(src.state_dict(), tmp_path / "ck", max_shard_size=40)
    dst = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    weight_ptr = dst[0].weight.data_ptr()
    assert sp.load_into(dst, tmp_path / "ck").ok
    assert dst[0].weight.data_ptr() == weight_ptr  # in place
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v)
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    sp.load_into(meta, tmp_path / "ck")
    assert meta[0].weight.device.type == "cpu" and meta[0].weight.requires_grad
    assert isinstance(meta[0].weight, torch.nn.Parameter)
    assert torch.equal(meta[0].weight, src[0].weight)


def test_load_into_casts_to_target_dtype(tmp_path):
    sd = {"w": torch.randn(64, 64)}
    sp.save(sd, tmp_path / "ck")
    target = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
    sp.load_into(target, tmp_path / "ck")
    assert torch.equal(target["w"], sd["w"].bfloat16())


def test_load_into_strict_reports_everything_and_changes_nothing(tmp_path):
    sp.save({"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(4)}, tmp_path / "ck")
    target = {"a": torch.zeros(2), "b": torch.zeros(5), "d": torch.zeros(1)}
    with pytest.raises(sp.LoadMismatchError) as info:
        sp.load_into(target, tmp_path / "ck")
    message = str(info.value)
    assert "missing from the checkpoint: 'd'" in message
    assert "unexpected (in the checkpoint, not the target): 'c'" in message
    assert "shape mismatch: 'b' (saved [3], target [5])" in message
    assert torch.equal(target["a"], torch.zeros(2))  # nothing loaded
    result = sp.load_into(target, tmp_path / "ck", strict=False)
    assert result.missing_keys == ["d"] and result.unexpected_keys == ["c"]
    assert result.mismatched_keys == [("b", (3,), (5,))]
    assert torch.equal(target["a"], torch.ones(2))


def test_overwrite_refused_then_atomic(tmp_path):
    path = tmp_path / "ck"
    sp.save({"w": torch.zeros(3)}, path)
    with pytest.raises(sp.CheckpointExistsError, match=r"already exists; pass overwrite=True"):
        sp.save({"w": torch.ones(3)}, path)
    sp.save({"w": torch.ones(3)}, path, overwrite=True)
    assert torch.equal(sp.load(path)["w"], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp dirs left behind
    # A folder of other files: overwrite=True adds the checkpoint and keeps every file.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("precious")
    sp.save({"w": torch.ones(3)}, tmp_path / "data", overwrite=True)
    assert (tmp_path / "data" / "notes.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path / "data")) == ["model.safetensors", "notes.txt", "shardpoint.json"]
    # A plain file is not replaced, even with overwrite=True.
    (tmp_path / "file").write_text("precious")
    with pytest.raises(sp.CheckpointExistsError, match=r"file exists and is not a shardpoint checkpoint, nor a directory"):
        sp.save({"w": torch.ones(3)}, tmp_path / "file", overwrite=True)
    assert (tmp_path / "file").read_text() == "precious"


def test_failed_save_leaves_nothing(tmp_path):
    sd = {"ok": torch.ones(2), "bad": torch.sparse_coo_tensor([[0]], [1.0], (2,))}
    with pytest.raises(sp.InvalidStateError, match=r"tensor 'bad' is a torch.sparse_coo tensor"):
        sp.save(sd, tmp_path / "ck")
    assert os.listdir(tmp_path) == []


def test_foreign_single_file_and_directory(tmp_path):
    from safetensors.torch import save_file

    sd = {"x": torch.randn(3, 3), "y": torch.arange(4)}
    save_file(sd, str(tmp_path / "weights.safetensors"), metadata={"format": "pt"})
    out = sp.load(tmp_path / "weights.safetensors")
    assert torch.equal(out["x"], sd["x"]) and torch.equal(out["y"], sd["y"])
    (tmp_path / "dir").mkdir()
    save_file(sd, str(tmp_path / "dir" / "model.safetensors"))
    target = {"x": torch.zeros(3, 3), "y": torch.zeros(4, dtype=torch.int64)}
    assert sp.load_into(target, tmp_path / "dir").ok
    assert torch.equal(target["x"], sd["x"])


def test_large_tensor_split_across_threads_verifies(tmp_path, monkeypatch, use_options):
    """A tensor larger than one I/O piece is written/read by several threads; crcs combine."""
    use_options(io=sp.IOOptions(segment_bytes=1000, piece_bytes=4096))
    t = torch.randn(10_000)
    sp.save({"t": t}, tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    assert manifest["components"]["model"]["tensors"]["t"]["chunks"][0]["crc32c"] == crc32c(t.numpy().tobytes())
    assert torch.equal(sp.load(tmp_path / "ck")["t"], t)
    target = {"t": torch.zeros(10_000, dtype=torch.float64)}  # staged cast path
    sp.load_into(target, tmp_path / "ck")
    assert torch.equal(target["t"], t.double())


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("mmap", [False, True])
def test_components_holding_tensors_of_the_same_name_load_each_their_own(tmp_path: Path, verify: bool, mmap: bool) -> None:
    """A model and its EMA (or any two components) name their tensors alike: each loads
    from its own file and place. (A lookup by name alone once read model/w at ema/w's offset:
    wrong values with verify=False, a false checksum error with it on.)"""
    state = {
        "model": {"a": torch.zeros(2), "w": torch.arange(4.0)},
        "ema": {"w": torch.arange(4.0) + 100, "b": torch.zeros(2)},
        "other": {"w": torch.arange(8.0) - 50},
    }
    sp.save(state, tmp_path / "ck")
    out = sp.load(tmp_path / "ck", verify=verify, mmap=mmap)
    assert out["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out["ema"]["w"].tolist() == [100.0, 101.0, 102.0, 103.0]
    assert out["other"]["w"].tolist() == [-50.0, -49.0, -48.0, -47.0, -46.0, -45.0, -44.0, -43.0]
    assert sp.load(tmp_path / "ck", keys=["ema"], verify=verify)["ema"]["w"].tolist() == [100.0, 101.0, 102.0, 103.0]


def test_async_save_takes_every_keyword_of_save_with_the_same_defaults() -> None:
    """The two public signatures are written out twice (for help() and IDEs); this keeps them
    in step: a keyword added to save and forgotten in async_save fails here."""
    save_params = inspect.signature(sp.save).parameters
    async_params = inspect.signature(sp.async_save).parameters
    assert list(save_params) == [
        "state", "path", "max_shard_size", "layout", "process_group", "overwrite", "metadata",
        "storage_options", "progress", "durable", "allow_pickle", "options",
    ]
    assert [name for name in async_params if name != "on_commit"] == list(save_params)
    differing = {
        name: (save_params[name].default, async_params[name].default)
        for name in save_params
        if save_params[name].default != async_params[name].default
    }
    assert differing == {"progress": (None, False)}  # no bar from a background thread by default
    assert all(async_params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(save_params)[2:])


def test_tied_copies_holding_nan_are_the_same_values(tmp_path):
    emb = torch.randn(8, 4)
    emb[0, 0] = float("nan")
    sp.save({"emb.weight": emb, "head.weight": emb.clone()}, tmp_path / "ck")
    net = _TiedNet()
    assert sp.load_into(net, tmp_path / "ck").ok and torch.isnan(net.emb.weight[0, 0])
