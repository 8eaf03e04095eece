"""Many small tensors: the coalesced write and read runs, and the compact manifest (format 2)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardpoint as sp
from shardpoint._checksum import crc32c
from shardpoint._io.plan import SMALL_TENSOR_BYTES, small_runs
from shardpoint.errors import ChecksumMismatchError, CorruptCheckpointError


def _state(count: int = 300) -> dict[str, torch.Tensor]:
    """Small tensors of mixed dtypes and shapes, with one large tensor in the middle (it
    splits the runs) and an empty one."""
    state: dict[str, torch.Tensor] = {}
    for i in range(count):
        state[f"layers.{i}.w"] = torch.arange(4, dtype=torch.float32) + i
        if i % 7 == 0:
            state[f"layers.{i}.b"] = torch.tensor([i, -i], dtype=torch.int64)
        if i % 11 == 0:
            state[f"layers.{i}.h"] = torch.full((2, 3), i / 8, dtype=torch.bfloat16)
    state["big"] = torch.arange(SMALL_TENSOR_BYTES // 4 + 1, dtype=torch.float32)
    state["empty"] = torch.zeros(0)
    state["scalar"] = torch.tensor(3.5)
    return state


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), key


def test_small_runs_groups_adjacent_small_entries() -> None:
    entries = [(0, 4), (4, 4), (8, 100), (108, 4), (112, 4), (116, 0), (200, 4), (204, 4)]
    assert small_runs(entries, tensor_max=8) == [(0, 2), (3, 6), (6, 8)]
    # the run limit cuts a run; a single leftover entry is not a run
    assert small_runs([(0, 4), (4, 4), (8, 4)], tensor_max=8, run_max=8) == [(0, 2)]
    assert small_runs([(0, 4)], tensor_max=8) == []


def test_round_trip_of_many_small_tensors(tmp_path: Path) -> None:
    state = _state()
    sp.save(state, tmp_path / "ck")
    _assert_same(sp.load(tmp_path / "ck"), state)
    # the file is plain safetensors, and the recorded crcs are those of each tensor's bytes
    _assert_same(load_file(str(tmp_path / "ck" / "model.safetensors")), state)
    doc = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    record = doc["components"]["model"]["tensors"]["layers.3.w"]
    assert record["chunks"] == [
        {"file": "model.safetensors", "crc32c": crc32c(torch.tensor([3.0, 4, 5, 6]).numpy().tobytes())}
    ]


def test_load_into_many_small_tensors(tmp_path: Path) -> None:
    state = _state()
    sp.save(state, tmp_path / "ck")
    target = {k: torch.full_like(v, 7) if v.dtype != torch.bool else v.clone() for k, v in state.items()}
    kept = {k: v.data_ptr() for k, v in target.items() if v.numel()}
    result = sp.load_into(target, tmp_path / "ck")
    assert result.ok
    _assert_same(target, state)
    assert {k: v.data_ptr() for k, v in target.items() if v.numel()} == kept  # in place


def test_keys_subset_reads_only_those(tmp_path: Path) -> None:
    state = _state()
    sp.save(state, tmp_path / "ck")
    keys = ["layers.5.w", "layers.6.w", "layers.7.b", "layers.200.w", "scalar"]
    got = sp.load(tmp_path / "ck", keys=keys)
    assert list(got) == keys
    _assert_same(got, {k: state[k] for k in keys})


def test_sharded_small_tensors_round_trip(tmp_path: Path) -> None:
    state = _state(120)
    sp.save(state, tmp_path / "ck", max_shard_size=1000)
    assert len([n for n in os.listdir(tmp_path / "ck") if n.endswith(".safetensors")]) > 3
    _assert_same(sp.load(tmp_path / "ck"), state)


def _flip_byte_of(ckpt: Path, key: str, index: int) -> None:
    """Flip one byte of tensor ``key``'s data in its file."""
    path = ckpt / "model.safetensors"
    raw = bytearray(path.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    begin, _end = header[key]["data_offsets"]
    raw[8 + length + begin + index] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("loader", ["load", "load_into"])
def test_flipped_byte_inside_a_run_is_caught(tmp_path: Path, loader: str) -> None:
    state = _state()
    sp.save(state, tmp_path / "ck")
    _flip_byte_of(tmp_path / "ck", "layers.150.w", 5)
    expected = (
        f"{tmp_path / 'ck' / 'model.safetensors'}, tensor 'layers.150.w': crc32c of the stored bytes is "
    )
    with pytest.raises(ChecksumMismatchError, match=re.escape(expected) + r".*the file is damaged"):
        if loader == "load":
            sp.load(tmp_path / "ck")
        else:
            sp.load_into({k: torch.empty_like(v) for k, v in state.items()}, tmp_path / "ck")
    # the neighbours in the same run are fine: a subset without it loads
    got = sp.load(tmp_path / "ck", keys=["layers.149.w", "layers.151.w"])
    _assert_same(got, {k: state[k] for k in ["layers.149.w", "layers.151.w"]})
    # and verify=False reads the damaged bytes as they are
    damaged = sp.load(tmp_path / "ck", verify=False)["layers.150.w"]
    assert not torch.equal(damaged, state["layers.150.w"])


def test_truncated_file_inside_a_run_names_the_file(tmp_path: Path) -> None:
    state = {f"t.{i}": torch.ones(4) * i for i in range(50)}
    sp.save(state, tmp_path / "ck")
    path = tmp_path / "ck" / "model.safetensors"
    raw = path.read_bytes()
    # Keep the size the manifest recorded: cut the tail, then pad in a way the header cannot
    # see (a file shrunk under a reader would do the same); reading straight past the end
    # must still be an error, not zeros.
    doc = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    doc["files"]["model.safetensors"]["size"] = len(raw) - 16
    (tmp_path / "ck" / "shardpoint.json").write_text(json.dumps(doc))
    path.write_bytes(raw[:-16])
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(path))):
        sp.load(tmp_path / "ck")


def test_conjugate_view_is_not_stored_as_an_alias(tmp_path: Path) -> None:
    """A lazily conjugated view shares its base's memory but holds other values."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    sp.save({"a": x, "b": x.conj()}, tmp_path / "ck")
    got = sp.load(tmp_path / "ck")
    assert got["b"].tolist() == [1 - 2j, 3 + 4j]
    assert got["a"].tolist() == [1 + 2j, 3 - 4j]


# ------------------------------------------------------------------- the compact manifest


def test_manifest_is_compact(tmp_path: Path) -> None:
    state = {f"t.{i}": torch.ones(4) for i in range(1000)}
    sp.save(state, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    assert doc["format_version"] == 3
    assert doc["components"]["model"]["tensors"]["t.7"] == {
        "dtype": "F32",
        "shape": [4],
        "chunks": [{"file": "model.safetensors", "crc32c": crc32c(torch.ones(4).numpy().tobytes())}],
    }
    size = (tmp_path / "ck" / "shardpoint.json").stat().st_size
    assert size < 160 * 1000  # was ~230 bytes per tensor with every chunk field written


def _as_version_1(ckpt: Path) -> None:
    """Rewrite a manifest as format version 1 wrote it: every chunk field explicit, the
    tree in full."""
    path = ckpt / "shardpoint.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = 1
    for comp in doc["components"].values():
        if "tensors" in comp["tree"]:
            names = comp["tree"].pop("tensors")
            comp["tree"]["items"] = [["str", n, {"type": "tensor", "name": n}] for n in names]
        for name, rec in comp["tensors"].items():
            rec["chunks"] = [
                {
                    "file": c["file"],
                    "key": c.get("key", name),
                    "offsets": c.get("offsets", [0] * len(rec["shape"])),
                    "shape": c.get("shape", rec["shape"]),
                    "crc32c": c["crc32c"],
                }
                for c in rec["chunks"]
            ]
    path.write_text(json.dumps(doc, indent=1))


def test_version_1_manifest_still_loads(tmp_path: Path) -> None:
    state = _state(40)
    sp.save(state, tmp_path / "ck")
    _as_version_1(tmp_path / "ck")
    _assert_same(sp.load(tmp_path / "ck"), state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert sp.load_into(target, tmp_path / "ck").ok
    _assert_same(target, state)


def test_version_1_manifest_must_give_every_chunk_field(tmp_path: Path) -> None:
    sp.save({"w": torch.ones(4)}, tmp_path / "ck")
    path = tmp_path / "ck" / "shardpoint.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = 1  # a version 1 manifest with a compact chunk: not what 1 wrote
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{path}, component 'model', tensor 'w': chunk key is not a string")):
        sp.load(tmp_path / "ck")


def test_compact_chunk_needs_offsets_and_shape_together(tmp_path: Path) -> None:
    sp.save({"w": torch.ones(4)}, tmp_path / "ck")
    path = tmp_path / "ck" / "shardpoint.json"
    doc = json.loads(path.read_text())
    doc["components"]["model"]["tensors"]["w"]["chunks"][0]["offsets"] = [0]
    path.write_text(json.dumps(doc))
    expected = f"{path}, component 'model', tensor 'w': chunk shape None is not a list of non-negative integers"
    with pytest.raises(CorruptCheckpointError, match=re.escape(expected)):
        sp.load(tmp_path / "ck")


def test_compact_chunk_key_defaults_to_the_tensor_name(tmp_path: Path) -> None:
    """A chunk without ``key`` is the header entry named like the tensor: renaming the
    tensor in the manifest alone points it at an entry the file does not have."""
    sp.save({"w": torch.ones(4), "v": torch.zeros(4)}, tmp_path / "ck")
    path = tmp_path / "ck" / "shardpoint.json"
    doc = json.loads(path.read_text())
    tensors = doc["components"]["model"]["tensors"]
    tensors["u"] = tensors.pop("w")
    doc["components"]["model"]["tree"]["tensors"][0] = "u"
    path.write_text(json.dumps(doc))
    expected = f"{tmp_path / 'ck' / 'model.safetensors'}: tensor 'u' (key 'u') is listed in the checkpoint's"
    with pytest.raises(CorruptCheckpointError, match=re.escape(expected)):
        sp.load(tmp_path / "ck")


# Duplicate keys are refused by counting: the header and manifest of many small tensors
# are parsed without a per-object hook, and the keys and in-string colons of what was
# validated are compared with the text's colons. Names, metadata and a timestamp holding
# colons exercise that count; each forged duplicate below would otherwise be read silently
# (the second value winning).

_COLON_STATE = {"a:0": torch.arange(4, dtype=torch.float32), "b": torch.ones(2), "c::": torch.zeros(3)}


def _colon_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ck"
    sp.save(_COLON_STATE, ckpt, metadata={"when": "12:30", "notes": ["x:y", {"k:": "v:"}]})
    return ckpt


def test_names_and_metadata_with_colons_load(tmp_path: Path) -> None:
    ckpt = _colon_checkpoint(tmp_path)
    _assert_same(sp.load(ckpt), _COLON_STATE)
    target = {k: torch.empty_like(v) for k, v in _COLON_STATE.items()}
    sp.load_into(target, ckpt)
    _assert_same(target, _COLON_STATE)


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        # a tensor record given twice, the second with another crc32c
        ('"b":{"dtype"', '"b":{"dtype":"F32","shape":[2],"chunks":[{"file":"model.safetensors","crc32c":1}]},"b":{"dtype"', "b"),
        # a chunk field given twice (the first value would be ignored)
        ('"chunks":[{"file":"model.safetensors","crc32c"', '"chunks":[{"file":"model.safetensors","file":"model.safetensors","crc32c"', "file"),
        # a top-level field given twice
        ('"save_id":', '"save_id":"forged:1","save_id":', "save_id"),
        # metadata and tree keys given twice
        ('"when":"12:30"', '"when":"1:2","when":"12:30"', "when"),
        ('"type":"dict"', '"type":"list","type":"dict"', "type"),
        # a duplicate beside an escaped colon (the text's colons no longer tell; the full check runs)
        ('"when":"12:30"', '"when":"\\u003a","when":"12:30"', "when"),
    ],
    ids=["tensor", "chunk-field", "top-level", "metadata", "tree", "escaped-colon"],
)
def test_duplicate_manifest_key_is_refused(tmp_path: Path, old: str, new: str, key: str) -> None:
    ckpt = _colon_checkpoint(tmp_path)
    path = ckpt / "shardpoint.json"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(CorruptCheckpointError) as info:
        sp.load(ckpt)
    assert f"shardpoint.json has the key {key!r} twice; the file is damaged or forged" in str(info.value)


def _header(entries: str, metadata: str = '"__metadata__":{"format":"pt","t":"1:2"},') -> bytes:
    return ("{" + metadata + entries + "}").encode()


_ENTRY_A = '"a:0":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
_ENTRY_B = '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}'


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (_header(_ENTRY_A + "," + _ENTRY_A.replace("a:0", "b") + "," + _ENTRY_B), "b"),
        (_header(_ENTRY_A + "," + _ENTRY_B.replace('"dtype":"F32"', '"dtype":"F16","dtype":"F32"')), "dtype"),
        (_header(_ENTRY_A + "," + _ENTRY_B, '"__metadata__":{"t":"x","t":"1:2"},'), "t"),
        (_header(_ENTRY_A + "," + _ENTRY_B, '"__metadata__":{"u":"\\u003a","u":"1:2"},'), "u"),
    ],
    ids=["entry", "entry-field", "metadata", "escaped-colon"],
)
def test_duplicate_header_key_is_refused(raw: bytes, key: str) -> None:
    from shardpoint._format.safetensors import validate_header

    with pytest.raises(CorruptCheckpointError) as info:
        validate_header(raw, 8 + len(raw) + 8, name="x.safetensors")
    assert str(info.value) == f"safetensors header of x.safetensors has the key {key!r} twice; the file is damaged or forged"


def test_header_with_colons_and_escapes_is_read() -> None:
    from shardpoint._format.safetensors import validate_header

    raw = _header(_ENTRY_A + "," + _ENTRY_B.replace('"b"', '"\\u0062:"'))
    header = validate_header(raw, 8 + len(raw) + 8, name="x.safetensors")
    assert list(header.entries) == ["a:0", "b:"]
    assert header.metadata == {"format": "pt", "t": "1:2"}


def test_flat_tree_names_each_tensor_once(tmp_path: Path) -> None:
    """A flat state dict's tree is written as its names in order (format 2 shorthand), and
    comes back as the full tree, in that order, aliases included."""
    state = {"z": torch.ones(2), "a:1": torch.zeros(3)}
    state["tied"] = state["z"]
    sp.save(state, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    assert doc["components"]["model"]["tree"] == {"type": "dict", "tensors": ["z", "a:1", "tied"]}
    loaded = sp.load(tmp_path / "ck")
    assert list(loaded) == ["z", "a:1", "tied"]
    _assert_same(loaded, state)
    from shardpoint._format.manifest import parse_manifest

    raw = (tmp_path / "ck" / "shardpoint.json").read_bytes()
    assert parse_manifest(raw, where="m").components["model"].tree == {
        "type": "dict",
        "items": [["str", n, {"type": "tensor", "name": n}] for n in ("z", "a:1", "tied")],
    }


def test_nested_state_tree_is_written_in_full(tmp_path: Path) -> None:
    """Only a dict whose every value is the tensor named as its key takes the shorthand."""
    state = {"model": {"layer": {"w": torch.ones(2)}, "b": torch.zeros(1)}, "opt": {"lr": 0.5, "m": torch.ones(1)}}
    sp.save(state, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    trees = {name: comp["tree"] for name, comp in doc["components"].items()}
    assert [tree["items"][0][1] for tree in trees.values()] == ["layer", "lr"]
    loaded = sp.load(tmp_path / "ck")
    assert loaded["opt"]["lr"] == 0.5
    assert torch.equal(loaded["model"]["layer"]["w"], torch.ones(2))


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"type": "dict", "tensors": ["w", "w"]}, "the tree's 'tensors' list names 'w' twice"),
        ({"type": "dict", "tensors": ["w", 1]}, "the tree's 'tensors' list holds a name that is not a string"),
        ({"type": "dict", "tensors": ["w", "nope"]}, "the tree names 'nope', which is not a tensor of this component"),
        ({"type": "dict", "tensors": "w"}, "the tree's 'tensors' form must be only a list of names"),
        ({"type": "dict", "tensors": ["w"], "items": []}, "the tree's 'tensors' form must be only a list of names"),
    ],
    ids=["twice", "not-str", "unknown", "not-list", "extra-field"],
)
def test_forged_flat_tree_is_refused(tmp_path: Path, tree: dict, message: str) -> None:
    sp.save({"w": torch.ones(2), "v": torch.ones(1)}, tmp_path / "ck")
    path = tmp_path / "ck" / "shardpoint.json"
    doc = json.loads(path.read_text())
    doc["components"]["model"]["tree"] = tree
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError) as info:
        sp.load(tmp_path / "ck")
    assert str(info.value) == f"{path}, component 'model': {message}; the manifest is damaged or forged"


def test_flat_tree_shorthand_is_not_read_in_version_1(tmp_path: Path) -> None:
    sp.save({"w": torch.ones(2)}, tmp_path / "ck")
    path = tmp_path / "ck" / "shardpoint.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = 1
    doc["components"]["model"]["tensors"]["w"]["chunks"] = [
        {"file": "model.safetensors", "key": "w", "offsets": [0], "shape": [2], "crc32c": 0}
    ]
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="dict node has no 'items' list"):
        sp.load(tmp_path / "ck")


def test_collector_is_paused_only_inside_the_calls(tmp_path: Path) -> None:
    """save/load/load_into pause Python's cyclic collector while they build their objects,
    and leave it as they found it: on again after a call (also one that raised), off if the
    caller had turned it off."""
    import gc

    seen: list[bool] = []

    class Probe(sp.Stateful):
        def state_dict(self) -> dict:
            seen.append(gc.isenabled())
            return {"n": 1}

        def load_state_dict(self, state: dict) -> None:
            seen.append(gc.isenabled())

    assert gc.isenabled()
    sp.save({"model": {"w": torch.ones(2)}, "probe": Probe()}, tmp_path / "a")
    sp.load_into({"model": {"w": torch.zeros(2)}, "probe": Probe()}, tmp_path / "a")
    assert seen == [False, False] and gc.isenabled()
    assert sp.load(tmp_path / "a")["probe"] == {"n": 1} and gc.isenabled()
    (tmp_path / "a" / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(CorruptCheckpointError):
        sp.load(tmp_path / "a")
    assert gc.isenabled()
    gc.disable()
    try:
        sp.save({"w": torch.ones(2)}, tmp_path / "b")
        sp.load(tmp_path / "b")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_load_into_keeps_ties_among_many_plain_tensors(tmp_path: Path) -> None:
    """load_into knows a plain tensor by its address alone only when no other target
    shares it: a key that is the same tensor as another (or a view at the same address)
    is still found tied, not reported missing."""
    state = {f"t.{i}": torch.full((4,), float(i)) for i in range(1000)}
    sp.save(state, tmp_path / "c")
    shared = torch.zeros(4)
    target = {f"t.{i}": torch.zeros(4) for i in range(1000)}
    target["t.5"] = shared
    target["tied"] = shared  # not in the checkpoint: the same memory as t.5
    target["view"] = shared.view(2, 2)  # same address, another shape: not the same tensor
    result = sp.load_into(target, tmp_path / "c", strict=False)
    assert result.missing_keys == ["view"]
    assert target["tied"].tolist() == [5.0] * 4 and target["t.999"].tolist() == [999.0] * 4
