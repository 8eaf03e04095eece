"""``sp.convert`` / ``shardpoint convert``: every source format, round trips, refusals, memory.

Sources are written by the real producers (``torch.save``, ``huggingface_hub``'s torch
serializer for ``.bin`` shards, ``transformers.save_pretrained`` for safetensors, a 2-rank
gloo ``sp.save`` for chunked checkpoints, ``torch.distributed.checkpoint.save`` for DCP);
every output is compared with the original values, and HF outputs are loaded with
``transformers.from_pretrained``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._cli.main import main
from shardpoint._convert import run_convert

transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

INPUT_IDS = torch.tensor([[1, 7, 42, 3, 63, 0, 33, 9, 5, 18]])


class Custom:
    """A class torch.load(weights_only=True) refuses to build."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    return _llama()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layers.0.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layers.0.bias": torch.zeros(8, dtype=torch.float16),
        "layers.0.count": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
    }


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Nested equality: same containers, keys, tensors (dtype, shape, bits) and values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} is not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
        )
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (
            f"{where}: keys {list(got)} != {list(want)}"
        )
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want and type(got) is type(want), f"{where}: {got!r} != {want!r}"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------- torch.save


def test_torch_save_flat_round_trip_sharded_with_tied_weights(tmp_path: Path) -> None:
    state = _state()
    state["head.weight"] = state["embed.weight"]  # tied: same tensor, stored once
    src = tmp_path / "model.pt"
    torch.save(state, src)
    info = sp.convert(src, tmp_path / "out", max_shard_size=600)
    assert sorted(info.files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    back = sp.load(tmp_path / "out")
    assert_same(back, state)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "head.weight" not in index["weight_map"]  # an alias in the manifest, as sp.save does
    assert main(["verify", str(tmp_path / "out")]) == 0


def test_torch_save_nested_training_state_converts_whole(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 7,
        "best": float("inf"),
        "rng": torch.get_rng_state(),
        "history": [0.5, 0.25],
    }
    torch.save(state, tmp_path / "train.pt")
    sp.convert(tmp_path / "train.pt", tmp_path / "out")
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == [
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "shardpoint.json",
    ]
    back = sp.load(tmp_path / "out")
    assert_same(back, state)
    # and it resumes: a fresh model and optimizer take the converted state
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optimizer"])
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def test_pickle_needing_full_unpickle_is_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "custom.pt"
    torch.save({"w": torch.ones(2), "extra": Custom(3)}, src)
    with pytest.raises(sp.UnsafePickleError) as info:
        sp.convert(src, tmp_path / "out")
    message = str(info.value)
    assert str(src) in message
    assert "Custom" in message and "trust_pickle=True" in message
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["custom.pt"]  # no temporary directory left

    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out")
    assert code == 2 and out == ""
    assert err.startswith("shardpoint: error: ") and str(src) in err and "--trust-pickle" in err


class _Opaque:
    """An object shardpoint can store only pickled."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.n == self.n


def test_trust_pickle_converts_and_stores_other_objects_pickled(tmp_path: Path) -> None:
    src = tmp_path / "lightning.ckpt"
    hparams = argparse.Namespace(lr=0.1, layers=2)
    torch.save({"state_dict": {"w": torch.arange(4.0)}, "hparams": hparams, "epoch": 2, "obj": _Opaque(3)}, src)
    with pytest.raises(sp.UnsafePickleError, match=r"argparse\.Namespace"):
        sp.convert(src, tmp_path / "out")
    sp.convert(src, tmp_path / "out", trust_pickle=True)
    # the custom object was stored pickled: loading it needs the opt-in too
    with pytest.raises(sp.UnsafePickleError, match=r"component 'obj': value '' \(a (tests\.)?test_convert\._Opaque\) was pickled at save time"):
        sp.load(tmp_path / "out")
    back = sp.load(tmp_path / "out", allow_pickle=True)
    assert back["hparams"] == hparams and back["epoch"] == 2 and back["obj"] == _Opaque(3)
    assert torch.equal(back["state_dict"]["w"], torch.arange(4.0))
    # the Namespace is a typed node: it loads without the opt-in
    assert sp.load(tmp_path / "out", keys=["hparams"])["hparams"] == hparams


def test_safetensors_sibling_is_preferred_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    torch.save({"w": torch.zeros(3)}, tmp_path / "model.pt")
    save_file({"w": torch.ones(3)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    sp.convert(tmp_path / "model.pt", tmp_path / "out")
    assert torch.equal(sp.load(tmp_path / "out")["w"], torch.ones(3))

    code, out, err = run_cli(capsys, "convert", tmp_path / "model.pt", tmp_path / "out2")
    assert code == 0
    assert (
        f"shardpoint: note: reading {tmp_path / 'model.safetensors'} instead of {tmp_path / 'model.pt'}"
        in err
    )
    assert out.startswith(
        f"converted {tmp_path / 'model.safetensors'} (safetensors checkpoint) -> "
    )


def test_legacy_torch_save_format_is_read_whole_with_a_note(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    _, source = run_convert(tmp_path / "old.pt", tmp_path / "out")
    assert any("legacy" in n for n in source.notes)
    assert_same(sp.load(tmp_path / "out"), state)


def test_not_a_torch_file(tmp_path: Path) -> None:
    (tmp_path / "notes.pt").write_bytes(b"hello, not a checkpoint")
    with pytest.raises(sp.UnsupportedFormatError, match=r"not a torch\.save file"):
        sp.convert(tmp_path / "notes.pt", tmp_path / "out")
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.convert(tmp_path / "missing.pt", tmp_path / "out")


# --------------------------------------------------------------------- HF .bin shards


def test_hf_bin_sharded_directory(tmp_path: Path, llama: LlamaForCausalLM) -> None:
    # transformers 5 dropped save_pretrained(safe_serialization=False); its .bin writer is
    # huggingface_hub's torch serializer, which is what this uses.
    from huggingface_hub import save_torch_state_dict

    sd = llama.state_dict()
    src = tmp_path / "bin"
    src.mkdir()
    save_torch_state_dict(sd, src, safe_serialization=False, max_shard_size="30KB")
    bins = sorted(n for n in os.listdir(src) if n.endswith(".bin"))
    assert len(bins) > 2 and bins[0] == f"pytorch_model-00001-of-{len(bins):05d}.bin"
    assert (src / "pytorch_model.bin.index.json").exists()

    info = sp.convert(src, tmp_path / "out", max_shard_size="40KB")
    assert len(info.files) > 1
    assert_same(sp.load(tmp_path / "out"), dict(sd))
    llama.config.save_pretrained(tmp_path / "out")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(_logits(loaded), _logits(llama))


def test_hf_bin_shard_needing_full_unpickle_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "bin"
    src.mkdir()
    torch.save({"a": torch.ones(2)}, src / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.ones(2), "evil": Custom(1)}, src / "pytorch_model-00002-of-00002.bin")
    index = {
        "metadata": {},
        "weight_map": {
            "a": "pytorch_model-00001-of-00002.bin",
            "b": "pytorch_model-00002-of-00002.bin",
        },
    }
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(sp.UnsafePickleError, match=r"pytorch_model-00002-of-00002\.bin"):
        sp.convert(src, tmp_path / "out")


# ------------------------------------------------------------------------ safetensors


def test_hf_safetensors_reshard_with_dtype_change(tmp_path: Path, llama: LlamaForCausalLM) -> None:
    llama.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert len([n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]) > 2

    info = sp.convert(tmp_path / "hf", tmp_path / "out", max_shard_size="1MB", dtype="bf16")
    assert sorted(info.files) == ["model.safetensors"]
    want = {k: v.to(torch.bfloat16) for k, v in sorted(llama.state_dict().items())}
    assert_same(sp.load(tmp_path / "out"), want)  # in the HF index's (sorted) order
    # diff sees the dtype change, whatever the tolerance
    assert main(["diff", str(tmp_path / "out"), str(tmp_path / "hf"), "--atol", "0.02"]) == 1


def test_shardpoint_nested_checkpoint_reshards_keeping_tree_and_metadata(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sp.save(
        {"model": model, "optim": opt, "step": 11},
        tmp_path / "a",
        max_shard_size=100,
        metadata={"run": "x"},
    )
    before = sp.load(tmp_path / "a")
    sp.convert(tmp_path / "a", tmp_path / "b", max_shard_size="1GB", dtype="fp16")
    after = sp.load(tmp_path / "b")
    assert after["step"] == 11
    assert torch.equal(after["model"]["weight"], before["model"]["weight"].half())
    manifest = json.loads((tmp_path / "b" / "shardpoint.json").read_text())
    assert manifest["metadata"] == {"run": "x"}
    # optimizer keyed by parameter name survives, so load_into a fresh optimizer works
    model2 = torch.nn.Linear(8, 8)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    sp.convert(tmp_path / "a", tmp_path / "c")
    sp.load_into({"model": model2, "optim": opt2, "step": 0}, tmp_path / "c")
    want = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], want)


def test_chunked_checkpoint_consolidates_and_loads_with_transformers(
    tmp_path: Path, llama: LlamaForCausalLM
) -> None:
    sp.save(llama.state_dict(), tmp_path / "chunked", layout="chunked", max_shard_size="50KB")
    manifest = json.loads((tmp_path / "chunked" / "shardpoint.json").read_text())
    assert manifest["layout"] == "chunked"
    assert all("-r00000-" in n for n in manifest["files"])

    info = sp.convert(tmp_path / "chunked", tmp_path / "hf", max_shard_size="40KB")
    assert all(n.startswith("model-") and "-of-" in n for n in info.files) and len(info.files) > 1
    assert json.loads((tmp_path / "hf" / "shardpoint.json").read_text())["layout"] == "hf"
    llama.config.save_pretrained(tmp_path / "hf")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(loaded), _logits(llama))


@pytest.mark.slow
def test_consolidation_with_worker_processes(tmp_path: Path, llama: LlamaForCausalLM) -> None:
    sp.save(llama.state_dict(), tmp_path / "chunked", layout="chunked", max_shard_size="50KB")
    info = sp.convert(tmp_path / "chunked", tmp_path / "hf", max_shard_size="30KB", workers=2)
    assert len(info.files) > 2
    assert_same(sp.load(tmp_path / "hf"), dict(llama.state_dict()))
    assert main(["verify", str(tmp_path / "hf")]) == 0


def _save_sharded(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() and v.shape[0] >= world else v
        for k, v in _llama().state_dict().items()
    }
    sp.save(state, path, layout="chunked", max_shard_size="40KB")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_two_rank_chunked_save_consolidates_to_whole_tensors(
    tmp_path: Path, llama: LlamaForCausalLM
) -> None:
    run_ranks = pytest.importorskip("_dist_utils").run_ranks  # tests/_dist_utils.py

    run_ranks(_save_sharded, 2, str(tmp_path / "dist"))
    from shardpoint._source import open_checkpoint

    with open_checkpoint(tmp_path / "dist") as ckpt:  # the chunks, from the rule and the ranks' tables
        chunks = ckpt.components["model"].tensors["model.embed_tokens.weight"].chunks
    # really split across the ranks
    assert sorted(c.offsets for c in chunks) == [(0, 0), (32, 0)]
    sp.convert(tmp_path / "dist", tmp_path / "hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors", "shardpoint.json"]
    assert_same(sp.load(tmp_path / "hf"), dict(llama.state_dict()))


def test_damaged_source_fails_and_leaves_nothing(tmp_path: Path) -> None:
    sp.save(_state(), tmp_path / "a", layout="chunked")
    data = next(p for p in (tmp_path / "a").iterdir() if p.suffix == ".safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(sp.ChecksumMismatchError):
        sp.convert(tmp_path / "a", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no output, no temporary directory


# -------------------------------------------------------------------------------- DCP


def test_dcp_refused_without_trust_and_converted_with_it(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"epoch": 3, "ids": torch.arange(3)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))

    with pytest.raises(sp.UnsafePickleError) as info:
        sp.convert(tmp_path / "dcp", tmp_path / "out")
    assert str(tmp_path / "dcp" / ".metadata") in str(info.value)
    assert not (tmp_path / "out").exists()

    sp.convert(tmp_path / "dcp", tmp_path / "out", trust_pickle=True, max_shard_size=100)
    back = sp.load(tmp_path / "out")
    assert_same(back["model"], state["model"])
    assert back["extra"]["epoch"] == 3 and torch.equal(back["extra"]["ids"], torch.arange(3))
    osd = opt.state_dict()
    for i in (0, 1):  # DCP stores the int keys of optimizer state as strings
        assert_same(back["optim"]["state"][str(i)], osd["state"][i], f"optim.state.{i}")
    assert back["optim"]["param_groups"][0]["lr"] == osd["param_groups"][0]["lr"]


def _forged_dcp(tmp_path: Path, forge: Any) -> Path:
    """A DCP checkpoint of one 64 x 4 tensor whose ``.metadata`` ``forge`` edits (this test
    wrote it, so it reads its own pickle)."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(256.0).reshape(64, 4)}}, checkpoint_id=str(path))
    metadata = pickle.loads((path / ".metadata").read_bytes())
    forge(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


def _shrink_chunk(metadata: Any) -> None:
    chunk = metadata.state_dict_metadata["model.w"].chunks[0]
    chunk.sizes = torch.Size([3, 4])


def _huge_size(metadata: Any) -> None:
    metadata.state_dict_metadata["model.w"].size = torch.Size([10**6, 10**6])


def _offset_past_the_end(metadata: Any) -> None:
    for info in metadata.storage_data.values():
        info.offset = 10**15


@pytest.mark.parametrize(("forge", "message"), [
    (_shrink_chunk, "tensor 'model.w': its chunks do not cover its size [64, 4] exactly (outside it, "
                    "overlapping, or leaving part of it unstored); the .metadata is damaged"),
    (_huge_size, "tensor 'model.w': size [1000000, 1000000] needs more bytes than all its data files hold"),
    (_offset_past_the_end, "is stored at offset 1000000000000000, length"),
])
def test_forged_dcp_metadata_is_refused_before_anything_is_read(tmp_path: Path, forge: Any, message: str) -> None:
    """A chunk that leaves rows 3-63 unstored (converted, they were memory never read, given
    fresh checksums), a size of 10^12 elements, a range past its file: refused, naming it,
    with trust_pickle too, and nothing written."""
    path = _forged_dcp(tmp_path, forge)
    with pytest.raises(sp.CorruptCheckpointError) as info:
        sp.convert(path, tmp_path / "out", trust_pickle=True)
    assert str(info.value).startswith(f"{path / '.metadata'}")
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()


def _torchtitan_dcp(tmp_path: Path) -> tuple[LlamaForCausalLM, dict[str, Any], Path]:
    """A DCP checkpoint in torchtitan's layout: model keys at the top level, beside nested
    ``optimizer`` / ``lr_scheduler`` / ``train_state`` entries."""
    import warnings

    import torch.distributed.checkpoint as dcp

    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(INPUT_IDS).logits.sum().backward()
    opt.step()
    state: dict[str, Any] = {
        **model.state_dict(),
        "optimizer": opt.state_dict(),
        "lr_scheduler": {"last_epoch": 1, "base_lrs": [1e-3]},
        "train_state": {"step": torch.tensor(7, dtype=torch.int32), "losses": [2.5, 2.0]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "titan"))
    return model, state, tmp_path / "titan"


def test_dcp_torchtitan_layout_model_is_hf_files_and_nested_entries_are_components(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, state, src = _torchtitan_dcp(tmp_path)
    code, _, err = run_cli(
        capsys, "convert", src, tmp_path / "out", "--trust-pickle", "--max-shard-size", "20KB"
    )
    assert code == 0, err
    assert "torchtitan's layout" in err and "'optimizer', 'lr_scheduler', 'train_state'" in err
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in names
    assert not any(n.startswith(("embed", "layers", "lm_head")) for n in names), names
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())

    model.config.save_pretrained(tmp_path / "out")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same(loaded.state_dict(), model.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded(INPUT_IDS).logits, model(INPUT_IDS).logits)

    back = sp.load(tmp_path / "out")
    assert list(back) == ["model", "optimizer", "lr_scheduler", "train_state"]
    assert_same(back["model"], model.state_dict())
    osd = state["optimizer"]
    assert len(osd["state"]) == 21  # one AdamW state per parameter of the tiny Llama
    # DCP stores the int keys of nested dicts as strings
    assert_same(back["optimizer"]["state"], {str(i): v for i, v in osd["state"].items()})
    assert back["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert back["lr_scheduler"] == {"last_epoch": 1, "base_lrs": [1e-3]}
    assert back["train_state"]["losses"] == [2.5, 2.0]
    assert_same(back["train_state"]["step"], torch.tensor(7, dtype=torch.int32))
    # diff reads the DCP source with the same grouping: the two are equal.
    code, out, err = run_cli(capsys, "diff", src, tmp_path / "out", "--trust-pickle")
    assert code == 0, (out, err)


def test_dcp_torchtitan_convert_selected_components(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _, src = _torchtitan_dcp(tmp_path)
    # The model alone, for publishing: a flat checkpoint of HF files, nothing else.
    code, _, err = run_cli(
        capsys, "convert", src, tmp_path / "pub", "--trust-pickle", "--component", "model"
    )
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "pub").iterdir())
    assert names == ["model.safetensors", "shardpoint.json"]
    assert_same(sp.load(tmp_path / "pub"), model.state_dict())  # flat: the state dict itself

    sp.convert(src, tmp_path / "two", trust_pickle=True, components=["train_state", "optimizer"])
    back = sp.load(tmp_path / "two")
    assert list(back) == ["train_state", "optimizer"]
    assert back["train_state"]["losses"] == [2.5, 2.0]
    assert not (tmp_path / "two" / "model.safetensors").exists()

    with pytest.raises(sp.CheckpointError) as info:
        sp.convert(src, tmp_path / "bad", trust_pickle=True, components=["model", "optim"])
    assert str(info.value) == (
        f"{src} has no component named 'optim'; it has 'model', 'optimizer', 'lr_scheduler', "
        "'train_state': name one or more of these (CLI: --component NAME, repeatable)"
    )
    assert not (tmp_path / "bad").exists()


# -------------------------------------------------------------------------------- CLI


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(_state(), tmp_path / "m.pt")
    code, out, err = run_cli(
        capsys,
        "convert",
        tmp_path / "m.pt",
        tmp_path / "out",
        "--dtype",
        "fp32",
        "--max-shard-size",
        "300B",
        "--layout",
        "hf",
    )
    assert code == 0, err
    assert out.startswith(
        f"converted {tmp_path / 'm.pt'} (torch.save file) -> {tmp_path / 'out'}: 6 tensors"
    )
    back = sp.load(tmp_path / "out")
    assert (
        back["layers.0.weight"].dtype == torch.float32
        and back["layers.0.count"].dtype == torch.int64
    )

    code, _, err = run_cli(capsys, "convert", tmp_path / "m.pt", tmp_path / "out")
    assert code == 2 and "already exists" in err
    code, _, err = run_cli(
        capsys, "convert", tmp_path / "m.pt", tmp_path / "out", "--overwrite", "--dtype", "bf16"
    )
    assert code == 0 and sp.load(tmp_path / "out")["embed.weight"].dtype == torch.bfloat16
    code, _, err = run_cli(capsys, "convert", tmp_path / "nowhere", tmp_path / "x")
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(capsys, "convert", tmp_path / "m.pt", tmp_path / "y", "--dtype", "int8")
    assert code == 2  # argparse refuses the choice


# ----------------------------------------------------------------------------- memory

_CHILD = r"""
import json, resource, sys
import torch, shardpoint as sp
src, dst = sys.argv[1], sys.argv[2]
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
sp.convert(src, dst, max_shard_size="100MB")
plain = peak()
sp.convert(src, dst + "-bf16", max_shard_size="100MB", dtype="bf16")
bf16 = peak()
torch.load(src, weights_only=True)  # the control: a whole load shows up in the measure
print(json.dumps({"base": base, "plain": plain, "bf16": bf16, "whole": peak()}))
"""

# Linux keeps ru_maxrss across exec: a child started straight from this (large) test
# process would inherit its peak. A bare Python in between starts the child clean.
_TRAMPOLINE = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


@pytest.mark.slow
def test_convert_memory_stays_bounded(tmp_path: Path) -> None:
    count, numel = 25, 4 << 20  # 25 tensors of 16 MiB: a 420 MB file
    state = {f"layer.{i}.weight": torch.full((numel,), float(i)) for i in range(count)}
    src = tmp_path / "big.pt"
    torch.save(state, src)
    size = src.stat().st_size
    assert size > 400e6
    del state
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _TRAMPOLINE,
            sys.executable,
            "-c",
            _CHILD,
            str(src),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    plain, bf16 = rss["plain"] - rss["base"], rss["bf16"] - rss["base"]
    print(
        f"convert of a {size / 1e6:.0f} MB torch.save file: peak RSS growth {plain / 1e6:.0f} MB, "
        f"with --dtype bf16 {bf16 / 1e6:.0f} MB; whole torch.load {(rss['whole'] - rss['base']) / 1e6:.0f} MB"
    )
    assert rss["whole"] - rss["base"] > 0.9 * size  # the measure does see a whole load
    assert plain < 200e6, (
        f"peak RSS grew by {plain / 1e6:.0f} MB converting a {size / 1e6:.0f} MB file"
    )
    assert bf16 < 200e6, (
        f"peak RSS grew by {bf16 / 1e6:.0f} MB converting a {size / 1e6:.0f} MB file to bf16"
    )
    out = sp.load(tmp_path / "out", keys=["layer.24.weight"])["layer.24.weight"]
    assert out.shape == (numel,) and bool((out == 24.0).all())
    # 5 shards (100 MB holds 5 tensors of 16.8 MB), the index and the manifest
    assert len(os.listdir(tmp_path / "out")) == 7
    half = sp.load(tmp_path / "out-bf16", keys=["layer.3.weight"])["layer.3.weight"]
    assert half.dtype == torch.bfloat16 and bool((half == 3.0).all())


def test_cli_refusals_name_the_flag_not_the_python_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    assert run_cli(capsys, "convert", tmp_path / "m.pt", tmp_path / "out")[0] == 0
    code, _, err = run_cli(capsys, "convert", tmp_path / "m.pt", tmp_path / "out")
    assert code == 2
    assert err == (
        f"shardpoint: error: {tmp_path / 'out'} already exists; pass --overwrite to replace it, "
        "or save to a new path\n"
    )
    (tmp_path / "f.txt").write_text("x")
    code, _, err = run_cli(capsys, "convert", tmp_path / "m.pt", tmp_path / "f.txt", "--overwrite")
    assert code == 2 and "refusing to replace it even with --overwrite." in err
    assert (tmp_path / "f.txt").read_text() == "x"


def test_convert_json_output_on_success_and_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "m.pt")
    code, out, err = run_cli(capsys, "convert", tmp_path / "m.pt", tmp_path / "out", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["seconds"] >= 0
    del doc["seconds"]
    files = {name: os.path.getsize(tmp_path / "out" / name) for name in os.listdir(tmp_path / "out")
             if name.endswith(".safetensors")}
    assert doc == {
        "source": str(tmp_path / "m.pt"), "source_format": "torch.save file",
        "destination": str(tmp_path / "out"), "components": ["model"], "tensors": 2,
        "tensor_bytes": 16, "files": files, "notes": [],
    }
    code, out, _ = run_cli(capsys, "convert", tmp_path / "m.pt", tmp_path / "out", "--json")
    assert code == 2
    assert json.loads(out) == {
        "error": "CheckpointExistsError",
        "message": f"{tmp_path / 'out'} already exists; pass --overwrite to replace it, or save to a new path",
        "path": str(tmp_path / "out"),
    }


def test_convert_of_a_model_folder_keeps_what_from_pretrained_needs(tmp_path: Path) -> None:
    """config.json, generation config, tokenizer files and the model card travel with the
    weights, so the output loads with from_pretrained as the source did; the Trainer's
    training state does not; with dtype= the config names the new dtype."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "README.md").write_text("# tiny llama\n")
    for name in ("training_args.bin", "optimizer.pt", "rng_state.pth", "trainer_state.json"):
        (src / name).write_bytes(b"not for the output")
    outside = tmp_path / "secret.txt"
    outside.write_text("outside")
    (src / "notes.txt").symlink_to(outside)

    sp.convert(src, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors", "shardpoint.json", "tokenizer.json"]
    for name in ("config.json", "generation_config.json", "README.md", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    ids = torch.tensor([[1, 5, 9, 2]])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    _, source = run_convert(src, tmp_path / "bf16", dtype="bf16")
    config_out = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config_out["dtype"] == "bfloat16"
    assert {k: v for k, v in config_out.items() if k != "dtype"} == {
        k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "dtype"}
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert source.notes[0] == (
        f"copied from {src} beside the weights: README.md, config.json, generation_config.json, tokenizer.json")
    assert source.notes[1].startswith(f"not copied: notes.txt ({src}: 'notes.txt' is a symlink that leaves")


def test_convert_over_a_folder_keeps_its_own_config_notes_and_tokenizer(tmp_path: Path) -> None:
    """--overwrite replaced the destination's own README.md and config.json with the
    source's: the README promises overwrite keeps a folder's files that are not the old
    checkpoint's. They stay (a note names them); with --dtype the kept config.json names
    the new dtype. Converting in place still writes the new dtype into its config."""
    src = tmp_path / "src"
    sp.save({"w": torch.ones(3)}, src)
    (src / "config.json").write_text('{"model_type": "from-src", "dtype": "float32"}')
    (src / "README.md").write_text("src readme\n")
    (src / "tokenizer.json").write_text('{"from": "src"}')
    dst = tmp_path / "dst"
    sp.save({"w": torch.zeros(3)}, dst)
    (dst / "README.md").write_text("MY NOTES: run 17\n")
    (dst / "config.json").write_text('{"model_type": "mine", "dtype": "float32"}')

    _, source = run_convert(src, dst, overwrite=True, dtype="bf16")
    assert (dst / "README.md").read_text() == "MY NOTES: run 17\n"
    assert json.loads((dst / "config.json").read_text()) == {"model_type": "mine", "dtype": "bfloat16"}
    assert (dst / "tokenizer.json").read_text() == '{"from": "src"}'  # not there before: copied
    assert sp.load(dst)["w"].tolist() == [1.0, 1.0, 1.0] and sp.load(dst)["w"].dtype == torch.bfloat16
    assert source.notes == [
        f"copied from {src} beside the weights: tokenizer.json",
        f"kept {dst}'s own README.md, config.json (the source's were not copied over them; its config.json "
        "now names the new dtype)",
    ]

    run_convert(src, src, overwrite=True, dtype="fp16")  # in place: its own config takes the dtype
    assert json.loads((src / "config.json").read_text()) == {"model_type": "from-src", "dtype": "float16"}
    assert (src / "README.md").read_text() == "src readme\n"


def test_a_cast_past_the_dtypes_range_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype fp16 turned 1e6 into inf without a word: the converted model computes inf and
    nan there. A warning names the tensors, how many values, the largest and the range."""
    torch.save({"w": torch.tensor([1e6, 1.0, -7e4]), "b": torch.tensor([1e5]), "ok": torch.tensor([1.0, -2.0]),
                "inf": torch.tensor([math.inf])}, tmp_path / "model.pt")
    message = (
        "convert to float16: 3 value(s) of 'w', 'b' are past float16's range (largest magnitude 1e+06; float16 "
        f"holds up to 65504) and became inf in {tmp_path / 'out'}; a model computes inf / nan there. Convert to "
        "bfloat16 (float32's range) instead"
    )
    with pytest.warns(UserWarning) as seen:
        sp.convert(tmp_path / "model.pt", tmp_path / "out", dtype="fp16")
    assert [str(w.message) for w in seen] == [message]
    # From safetensors files (read through the load path, which warns of its own casts): one warning.
    sp.save(torch.load(tmp_path / "model.pt"), tmp_path / "st")
    with pytest.warns(UserWarning) as seen:
        sp.convert(tmp_path / "st", tmp_path / "out-st", dtype="fp16")
    assert [str(w.message) for w in seen] == [message.replace(str(tmp_path / "out"), str(tmp_path / "out-st"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sp.convert(tmp_path / "model.pt", tmp_path / "bf16", dtype="bf16")  # in range: no warning
    assert main(["convert", str(tmp_path / "model.pt"), str(tmp_path / "cli"), "--dtype", "fp16", "--no-progress"]) == 0
    assert f"shardpoint: warning: {message.replace(str(tmp_path / 'out'), str(tmp_path / 'cli'))}\n" in capsys.readouterr().err


def test_destinations_that_can_hold_no_checkpoint_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under a file: a bare '[Errno 17] File exists' from deep inside; '-': a folder named '-'."""
    torch.save({"w": torch.ones(2)}, tmp_path / "flat.pt")
    assert main(["convert", str(tmp_path / "flat.pt"), str(tmp_path / "flat.pt" / "dst")]) == 2
    assert capsys.readouterr().err == (
        f"shardpoint: error: cannot save to {tmp_path / 'flat.pt' / 'dst'}: {tmp_path / 'flat.pt'} is a file, not a "
        "directory, so nothing can go under it; pick another path\n")
    with pytest.raises(sp.InvalidArgumentError, match=r"is a file, not a directory"):
        sp.save({"w": torch.ones(2)}, tmp_path / "flat.pt" / "a" / "b")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["convert", "flat.pt", "-"]) == 2
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().err == (
        "shardpoint: error: '-' names no checkpoint here (a checkpoint is a folder of files, not a stream): give a path\n")
    assert sorted(os.listdir(tmp_path)) == ["flat.pt"]


def test_float8_convert_and_a_kept_config_of_another_model(tmp_path: Path) -> None:
    """float8 was a bare KeyError (the config's dtype name); past its range it saturates.
    A kept config.json describing another model than the source's is warned about."""
    torch.save({"w": torch.tensor([1.0, 1000.0])}, tmp_path / "model.pt")
    with pytest.warns(UserWarning, match=r"^convert to float8_e4m3fn: 1 value\(s\) of 'w' are past float8_e4m3fn's "
                      r"range \(largest magnitude 1000; float8_e4m3fn holds up to 448\) and became 448 \(the largest it holds\) in .*; those weights are clipped\. Convert to bfloat16"):
        sp.convert(tmp_path / "model.pt", tmp_path / "f8", dtype=torch.float8_e4m3fn)
    assert sp.load(tmp_path / "f8")["w"].dtype == torch.float8_e4m3fn

    src = tmp_path / "src"
    sp.save({"w": torch.ones(2)}, src)
    (src / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    dst = tmp_path / "dst"
    sp.save({"w": torch.zeros(2)}, dst)
    (dst / "config.json").write_text('{"model_type": "gpt2", "n_embd": 4}')
    with pytest.warns(UserWarning, match=r"convert: kept .*dst's own config.json, which describes another model"):
        sp.convert(src, dst, overwrite=True, dtype="bf16")
    assert json.loads((dst / "config.json").read_text()) == {"model_type": "gpt2", "n_embd": 4}


def test_convert_keeps_in_float32_what_from_pretrained_keeps(tmp_path: Path) -> None:
    """T5 keeps its feed-forward output ("wo") in float32 under float16, as its class says
    (_keep_in_fp32_modules): convert --dtype fp16 cast it, where transformers' own
    from_pretrained(dtype=float16).save_pretrained() keeps it."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "fp32")
    sp.convert(tmp_path / "fp32", tmp_path / "sp-fp16", dtype="fp16")
    transformers.T5ForConditionalGeneration.from_pretrained(
        tmp_path / "fp32", dtype=torch.float16).save_pretrained(tmp_path / "hf-fp16")

    def dtypes(folder: Path) -> dict[str, str]:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 - not a dict

    ours, theirs = dtypes(tmp_path / "sp-fp16"), dtypes(tmp_path / "hf-fp16")
    assert {k: v for k, v in ours.items() if "wo" in k} == {
        "encoder.block.0.layer.1.DenseReluDense.wo.weight": "F32",
        "decoder.block.0.layer.2.DenseReluDense.wo.weight": "F32"}
    assert {k: v for k, v in ours.items() if k in theirs} == theirs
    assert set(ours.values()) == {"F16", "F32"}
