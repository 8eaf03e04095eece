"""sp.load / sp.load_into read Hugging Face ``.bin`` weights (torch.save), sharded or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


class Opaque:
    """An arbitrary object: torch.load(weights_only=True) refuses it, and so do we."""


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def _save_bin(sd: dict[str, torch.Tensor], directory, shards: int) -> None:
    """The HF .bin layout: pytorch_model.bin, or shards + pytorch_model.bin.index.json."""
    os.makedirs(directory)
    names = list(sd)
    if shards == 1:
        torch.save(sd, os.path.join(directory, "pytorch_model.bin"))
        return
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: sd[k] for k in names[i::shards]}
        torch.save(part, os.path.join(directory, fname))
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
             "weight_map": weight_map}
    with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
        json.dump(index, f)


@pytest.mark.parametrize("shards", [1, 3])
def test_load_and_load_into_hf_bin_directory(tmp_path, shards):
    src = _model(0)
    sd = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}  # tied: HF drops it
    _save_bin(sd, tmp_path / "bin", shards)

    loaded = sp.load(tmp_path / "bin")
    assert sorted(loaded) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k
    assert sp.load(tmp_path / "bin", keys=["model.norm.weight"], dtype=torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16

    dst = _model(1)
    result = sp.load_into(dst, tmp_path / "bin")  # strict: the tied lm_head counts as covered
    assert result.ok and result.bytes_read == sum(v.numel() * v.element_size() for v in sd.values())
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k

    meta = sp.empty_model(lambda: _model(2))
    sp.load_into(meta, tmp_path / "bin", dtype=torch.bfloat16)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight  # still tied
    assert meta.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(meta.model.norm.weight, src.model.norm.weight.bfloat16())
    assert not any(p.device.type == "meta" for p in meta.parameters())


def test_load_into_bin_reports_mismatches(tmp_path):
    sd = _model(0).state_dict()
    sd.pop("model.norm.weight")
    sd["extra.weight"] = torch.ones(2)
    _save_bin(sd, tmp_path / "bin", 1)
    with pytest.raises(sp.LoadMismatchError, match=r"missing from the checkpoint: 'model.norm.weight'") as err:
        sp.load_into(_model(1), tmp_path / "bin")
    assert "unexpected (in the checkpoint, not the target): 'extra.weight'" in str(err.value)
    result = sp.load_into(_model(1), tmp_path / "bin", strict=False)
    assert result.missing_keys == ["model.norm.weight"] and result.unexpected_keys == ["extra.weight"]


def test_single_pt_file_and_refusals(tmp_path):
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.int64)}
    torch.save(sd, tmp_path / "w.pt")
    out = sp.load(tmp_path / "w.pt")
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])
    # A nested training state in a .pt is for `convert`, which keeps its structure.
    torch.save({"model": sd, "epoch": 3}, tmp_path / "nested.pt")
    with pytest.raises(sp.InvalidStateError, match=r"nested.pt holds a nested torch.save state.*shardpoint convert"):
        sp.load(tmp_path / "nested.pt")

    torch.save({"w": torch.ones(1), "obj": Opaque()}, tmp_path / "evil.bin")
    with pytest.raises(sp.UnsafePickleError, match=r"evil.bin cannot be loaded with weights_only=True.*shardpoint convert SRC DST --trust-pickle"):
        sp.load(tmp_path / "evil.bin")


def test_a_safetensors_sibling_is_read_instead_of_the_pickle(tmp_path):
    sd = {"w": torch.arange(4.0)}
    torch.save({"w": torch.zeros(4)}, tmp_path / "model.pt")  # differs: shows which file was read
    sp.save(sd, tmp_path / "ck")
    os.rename(tmp_path / "ck" / "model.safetensors", tmp_path / "model.safetensors")
    said = (f"reading {tmp_path / 'model.safetensors'} instead of {tmp_path / 'model.pt'}: a .safetensors "
            "file of the same stem sits beside it and is read in its place (no unpickling); move it away "
            "to read the pickle")
    with pytest.warns(UserWarning) as caught:  # never a silent swap: the two may differ, as here
        assert sp.load(tmp_path / "model.pt")["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert [str(w.message) for w in caught] == [said]
    target = {"w": torch.full((4,), float("nan"))}
    with pytest.warns(UserWarning, match="is read in its place"):
        sp.load_into(target, tmp_path / "model.pt")
    assert target["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_local_bin_path_refuses_storage_options_as_safetensors_does(tmp_path):
    """The path is resolved once, to its store, before the format is looked at: options for
    an object store given with a local path are refused alike for every format."""
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    sp.save({"w": torch.ones(2)}, tmp_path / "ck", progress=False)
    for path in (tmp_path / "model.pt", tmp_path / "ck"):
        with pytest.raises(sp.InvalidArgumentError, match=f"storage_options were given but {path} is a local path"):
            sp.load(path, storage_options={"anon": True})
        with pytest.raises(sp.InvalidArgumentError, match="is a local path; they apply to fsspec URLs only"):
            sp.load_into({"w": torch.zeros(2)}, path, storage_options={"anon": True})


def _record_start(path, suffix: str) -> int:
    """Where the bytes of the zip record whose name ends with ``suffix`` start in the file."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<26xHH", f.read(30))
    return info.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize("layout", ["file", "shards"])
def test_a_flipped_bit_in_a_bin_record_is_caught_by_its_zip_crc(tmp_path, layout):
    """torch.load(mmap=True) never checks the zip's CRC-32s: a flipped bit would load as a
    wrong value. Every read path (load, load_into, convert) checks each storage's record."""
    sd = {"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(4, 4, dtype=torch.bfloat16)}
    if layout == "file":
        target = tmp_path / "model.pt"
        torch.save(sd, target)
        victim, record = target, "/data/1"  # "b", stored second
    else:
        target = tmp_path / "bin"
        _save_bin(sd, target, shards=2)
        victim, record = target / "pytorch_model-00002-of-00002.bin", "/data/0"  # holds "b" alone
    at = _record_start(victim, record) + 5
    data = bytearray(victim.read_bytes())
    data[at] ^= 0x10
    victim.write_bytes(bytes(data))

    with pytest.raises(sp.CorruptCheckpointError) as err:
        sp.load(target)
    message = str(err.value)
    assert "'b'" in message and str(victim) in message and "CRC-32" in message, message
    assert "Restore it from a copy" in message
    with pytest.raises(sp.CorruptCheckpointError, match="CRC-32"):
        sp.load_into({"a": torch.zeros(8), "b": torch.zeros(4, 4, dtype=torch.bfloat16)}, target)
    with pytest.raises(sp.CorruptCheckpointError, match="CRC-32"):
        sp.convert(target, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # The undamaged tensor still loads on its own.
    assert torch.equal(sp.load(target, keys=["a"])["a"], sd["a"])


def test_a_compressed_bin_record_is_refused_not_read_as_values(tmp_path):
    """A zip record stored deflated is valid zip, and torch.load without mmap inflates it,
    but a mapped load would read the deflated bytes as values: refused by name."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            packed = (
                zipfile.ZIP_DEFLATED if info.filename.endswith("/data/0") else zipfile.ZIP_STORED
            )
            out.writestr(info.filename, source.read(info.filename), compress_type=packed)
    assert torch.equal(
        torch.load(path, weights_only=True)["w"], torch.arange(64, dtype=torch.float32)
    )
    with pytest.raises(sp.CorruptCheckpointError) as err:
        sp.load(path)
    assert str(err.value) == (
        f"{path}: record 'archive/data/0' of the zip archive is compressed, which torch.save never "
        "does; its bytes cannot be read as tensor values. The file is damaged or forged: restore "
        "it from a copy"
    )
    with pytest.raises(sp.CorruptCheckpointError, match="compressed"):
        sp.convert(path, tmp_path / "out")


def test_a_second_copy_of_a_tensor_in_another_bin_shard_is_refused(tmp_path):
    """The index maps 'a' to shard 1 and shard 2 holds another 'a': shardpoint loaded the
    index's copy and verify said OK, while transformers loads whichever copy it reads last."""
    from shardpoint._verify import verify_checkpoint

    d = tmp_path / "ck"
    _save_bin({"a": torch.ones(2), "b": torch.ones(2)}, d, shards=2)
    second = d / "pytorch_model-00002-of-00002.bin"
    torch.save({"b": torch.ones(2), "a": torch.full((2,), 666.0)}, second)
    message = (
        f"{d}: tensor 'a' is stored in both 'pytorch_model-00001-of-00002.bin' (where the index maps it) and "
        "'pytorch_model-00002-of-00002.bin'; the checkpoint is ambiguous (transformers loads whichever copy it "
        "reads last)"
    )
    report = verify_checkpoint(d)
    assert not report.ok and report.problems == [message], report.problems
    with pytest.raises(sp.CorruptCheckpointError) as exc:
        sp.load(d)
    assert str(exc.value) == message.replace("where the index", "where pytorch_model.bin.index.json")


# ------------------------------------------------------------------ pickles built to unfold


def test_a_pickle_of_shared_containers_unfolding_exponentially_is_refused(tmp_path: Path) -> None:
    """1.9 KB, only dicts, lists and a tensor (weights_only takes it): walked as a tree it has
    2^40 nodes; load, inspect, verify and convert ran on, memory growing, until killed."""
    node: Any = {"w": torch.zeros(2)}
    for _ in range(40):
        node = [node, node]
    torch.save({"model": node}, tmp_path / "model.pt")
    text = (f"{tmp_path / 'model.pt'} is read by torch.load(weights_only=True), but what it holds cannot be a "
            "checkpoint's state (state at model refers to the same 41 dicts, lists and tuples over and over: walked "
            "as a tree it has more than 131073 values and keeps growing (a pickle built to unfold exponentially?); "
            "store each value once); read it with torch.load and save the parts you need with sp.save")
    with pytest.raises(sp.UnsupportedFormatError) as caught:
        sp.load(tmp_path / "model.pt")
    assert str(caught.value) == text
    for argv in (["verify"], ["convert", str(tmp_path / "out")]):
        done = subprocess.run([sys.executable, "-m", "shardpoint", argv[0], str(tmp_path / "model.pt"), *argv[1:]],
                              capture_output=True, text=True, timeout=120, check=False)
        assert (done.returncode, done.stdout, done.stderr) == (2, "", f"shardpoint: error: {text}\n"), argv
    assert not (tmp_path / "out").exists()
    # Sharing that does not unfold: one tuple 140 000 times in a list, 140 000 temporary dicts
    # (each Namespace's fields) whose ids are reused. Both were refused by the first version.
    import argparse

    legit = {"pairs": [(0, 0)] * 140_000, "recs": [argparse.Namespace(a=i) for i in range(140_000)]}
    # Fan-out without nesting ([[0] * F] * F: F + 1 lists, F^2 values) and a long text held many
    # times unfold too: refused; so is an int JSON cannot hold.
    row = [0] * 2000
    text = "x" * (1 << 20)
    for what, state in (("fan-out", {"x": [row] * 2000}), ("text", {"x": [text] * 2000})):
        with pytest.raises(sp.InvalidStateError, match=r"refers to the same .* over and over"):
            sp.save(state, tmp_path / what)
    with pytest.raises(sp.InvalidStateError, match=r"state at n is an int of 16610 bits, more than the manifest"):
        sp.save({"n": 10**5000}, tmp_path / "int")
    assert not any((tmp_path / w).exists() for w in ("fan-out", "text", "int"))
    sp.save(legit, tmp_path / "legit")
    back = sp.load(tmp_path / "legit")
    assert len(back["pairs"]) == len(back["recs"]) == 140_000 and back["pairs"][-1] == (0, 0)


def test_the_walk_that_finds_modules_looks_at_each_container_once_and_passes_over_numbers() -> None:
    """The fan-out refusal above took 15 s, all of it in the walk that looks for modules
    (4 million visits of one row of 2000 ints): each container is walked once, numbers are
    passed over, and a module after a data loader's 300 000 indices is still found (a budget
    of values stopped there: the optimizer was then stored by position)."""
    from shardpoint._stateful import find_modules, state_objects

    row = [0] * 2000
    assert list(state_objects({"x": [row] * 2000, "t": torch.zeros(1)})) == [("t", torch.zeros(1))]
    model = torch.nn.Linear(1, 1)
    state = {"loader": [[i] * 200 for i in range(1500)], "model": model}
    assert find_modules(state) == [("model", model)]


def test_a_pickled_view_unfolding_far_past_its_data_is_refused(tmp_path: Path) -> None:
    """torch.zeros(1).expand(2**37): 4 bytes in a 1.5 KB file, 512 GiB as safetensors (every
    element stored); sp.load died in torch's allocator, convert wrote 268 MB for 2**26."""
    torch.save({"w": torch.zeros(1).expand(2**37)}, tmp_path / "model.pt")
    text = (f"{tmp_path / 'model.pt'}: tensor 'w' is a view of 4 B of data that unfolds into 549.76 GB (a stride-0 or "
            "overlapping view): reading it as a checkpoint would allocate and write every element. If the file is "
            "yours and this is meant, torch.load it and save .contiguous() copies of what you need")
    with pytest.raises(sp.UnsupportedFormatError) as caught:
        sp.load(tmp_path / "model.pt")
    assert str(caught.value) == text
    done = subprocess.run([sys.executable, "-m", "shardpoint", "verify", str(tmp_path / "model.pt")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"shardpoint: error: {text}\n")
    # The same in a shard of a pytorch_model.bin index.
    shards = tmp_path / "bins"
    shards.mkdir()
    torch.save({"a": torch.ones(2), "b": torch.zeros(1).expand(2**37)}, shards / "pytorch_model-00001-of-00001.bin")
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "pytorch_model-00001-of-00001.bin", "b": "pytorch_model-00001-of-00001.bin"}}))
    with pytest.raises(sp.UnsupportedFormatError, match=r"pytorch_model-00001-of-00001.bin: tensor 'b' is a view of 4 B"):
        sp.load(shards)
    # Many overlapping views of one storage (2.3 MB -> 2.1 GB), and expanded tensors spread
    # over .bin shards: one budget for the views of a storage, and for all shards.
    base = torch.zeros(1 << 19)
    torch.save({f"v{i}": base[i:i + (1 << 18)] for i in range(1100)}, tmp_path / "views.pt")
    with pytest.raises(sp.UnsupportedFormatError, match=r"views.pt: tensor 'v\d+' is a view of 2.10 MB of data"):
        sp.load(tmp_path / "views.pt")
    spread = tmp_path / "spread"
    spread.mkdir()
    weight_map = {}
    for i in range(3):
        name = f"pytorch_model-0000{i + 1}-of-00003.bin"
        torch.save({f"w{i}": torch.zeros(1).expand(100 << 18)}, spread / name)  # 100 MiB each
        weight_map[f"w{i}"] = name
    (spread / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(sp.UnsupportedFormatError, match=r"pytorch_model-00003-of-00003.bin: tensor 'w2' is a view"):
        sp.load(spread)
    # One tensor under three names (tied weights) is read once: not an unfolding.
    tied = torch.zeros(40 << 20)  # 160 MiB
    torch.save({"a": tied, "b": tied, "c": tied}, tmp_path / "tied.pt")
    assert sorted(sp.load(tmp_path / "tied.pt", keys=["a"])) == ["a"]
    # A view a little larger than its data is what some files hold: read as the tensor it is.
    torch.save({"bias": torch.arange(3.0).expand(1000, 3)}, tmp_path / "small.pt")
    assert torch.equal(sp.load(tmp_path / "small.pt")["bias"], torch.arange(3.0).expand(1000, 3))
