"""Malformed and untrusted input: every case raises a named CheckpointError naming the file.

Each damaged checkpoint is built by hand (``struct`` + ``json``) or by saving a small
checkpoint and then damaging it. Every test asserts the error class *and* a literal part of
the message that names the offending file (and tensor, where there is one). Two guards run
throughout: nothing may unpickle (``pickle.load*`` and ``torch.load`` raise if called), and
the tests about forged shapes refuse any large ``torch.empty``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._verify import verify_checkpoint
from shardpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidSizeError,
    InvalidStateError,
    MissingShardError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedFormatError,
)

# ------------------------------------------------------------------------------ helpers


def _raises(cls: type[BaseException], text: str) -> Any:
    """``pytest.raises`` matching a literal substring of the message."""
    return pytest.raises(cls, match=re.escape(text))


def _st(header: dict[str, Any] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte little-endian header length, header JSON, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _f32(shape: list[Any], offsets: list[Any], dtype: Any = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return 8 + length


def _two_shards(tmp_path: Path, name: str = "ckpt") -> Path:
    """A shardpoint checkpoint: ``a`` in ``model-00001-of-00002``, ``b`` in ``-00002``."""
    path = tmp_path / name
    state = {
        "a": torch.arange(4, dtype=torch.float32),
        "b": torch.arange(4, dtype=torch.float32) + 10,
    }
    info = sp.save(state, path, max_shard_size=16)
    assert sorted(info.files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    return path


def _one_file(tmp_path: Path, name: str = "ckpt") -> Path:
    """A shardpoint checkpoint holding ``w`` (4 x F32) in ``model.safetensors``."""
    path = tmp_path / name
    sp.save({"w": torch.arange(4, dtype=torch.float32)}, path)
    return path


def _hf_only(path: Path) -> Path:
    """Drop the manifest: what is left is a plain HF checkpoint (index or single file)."""
    (path / "shardpoint.json").unlink()
    return path


def _two_targets() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(4), "b": torch.zeros(4)}


Loader = Callable[[Path, dict[str, torch.Tensor]], Any]


@pytest.fixture(params=["load", "load_into"])
def load_fn(request: pytest.FixtureRequest) -> Loader:
    """Load ``path`` with ``sp.load``, or into ``target`` with ``sp.load_into``."""
    if request.param == "load":
        return lambda path, target: sp.load(path)
    return lambda path, target: sp.load_into(target, path)


@pytest.fixture(autouse=True)
def _no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in these tests may unpickle: untrusted input never reaches pickle."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("shardpoint unpickled untrusted input")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.fixture
def no_big_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` refuses more than 2**30 elements: forged shapes fail before allocating."""
    real_empty = torch.empty

    def guarded(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = (
            size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        )
        assert math.prod(shape) <= 2**30, f"torch.empty{tuple(shape)} for a forged header"
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", guarded)


# ------------------------------------------------------- one malformed safetensors file

EIGHT = bytes(range(8))
"""Data for one F32 [2] tensor."""

# (file content, error class, message with "{file}" for the file's path)
FILE_CASES = [
    pytest.param(
        b"",
        CorruptCheckpointError,
        "{file} is 0 bytes, shorter than the 8-byte safetensors length prefix",
        id="empty",
    ),
    pytest.param(
        b"\x02\x00\x00",
        CorruptCheckpointError,
        "{file} is 3 bytes, shorter than the 8-byte safetensors length prefix",
        id="short-3",
    ),
    pytest.param(
        b"\x02\x00\x00\x00\x00\x00\x00",
        CorruptCheckpointError,
        "{file} is 7 bytes, shorter than the 8-byte safetensors length prefix",
        id="short-7",
    ),
    pytest.param(
        _st(b"{}", length=1000),
        CorruptCheckpointError,
        "{file}: header length 1000 runs past the end of the 10-byte file",
        id="length-past-eof",
    ),
    pytest.param(
        _st(b"", length=1),
        CorruptCheckpointError,
        "{file}: header length 1 runs past the end of the 8-byte file",
        id="length-past-eof-empty",
    ),
    pytest.param(
        _st(b"{}", length=100_000_001),
        CorruptCheckpointError,
        "{file}: header length 100000001 exceeds the 100000000-byte limit",
        id="length-over-100MB",
    ),
    pytest.param(
        _st(b"{}", length=2**64 - 1),
        CorruptCheckpointError,
        f"{{file}}: header length {2**64 - 1} exceeds the 100000000-byte limit",
        id="length-u64-max",
    ),
    pytest.param(
        _st(b'{"w\xff": 1}'),
        CorruptCheckpointError,
        "safetensors header of {file} is not valid UTF-8",
        id="not-utf8",
    ),
    pytest.param(
        _st(b"\xfe\xff{}"),
        CorruptCheckpointError,
        "safetensors header of {file} is not valid UTF-8",
        id="utf16-bom",
    ),
    pytest.param(
        _st(b'{"w": '),
        CorruptCheckpointError,
        "safetensors header of {file} is not valid JSON",
        id="not-json",
    ),
    pytest.param(
        _st(b"[1, 2]"),
        CorruptCheckpointError,
        "safetensors header of {file} must be a JSON object, found list",
        id="json-list",
    ),
    pytest.param(
        _st(b"42"),
        CorruptCheckpointError,
        "safetensors header of {file} must be a JSON object, found int",
        id="json-number",
    ),
    pytest.param(
        _st(b'"w"'),
        CorruptCheckpointError,
        "safetensors header of {file} must be a JSON object, found str",
        id="json-string",
    ),
    pytest.param(
        _st(b"null"),
        CorruptCheckpointError,
        "safetensors header of {file} must be a JSON object, found NoneType",
        id="json-null",
    ),
    pytest.param(  # found by fuzz/run.py: Python's json reads -0 as 0, safetensors refuses it
        _st(b'{"w": {"dtype": "F32", "shape": [], "data_offsets": [-0, 4]}}', EIGHT[:4]),
        CorruptCheckpointError,
        "safetensors header of {file} is not valid JSON (-0 is not an integer",
        id="negative-zero-offset",
    ),
    pytest.param(
        _st(b"[" * 100_000 + b"]" * 100_000),
        CorruptCheckpointError,
        "safetensors header of {file} nests JSON too deeply",
        id="json-bomb",
    ),
    pytest.param(
        _st(
            (
                f'{{"w": {json.dumps(_f32([2], [0, 8]))}, "w": {json.dumps(_f32([2], [0, 8]))}}}'
            ).encode(),
            EIGHT,
        ),
        CorruptCheckpointError,
        "safetensors header of {file} has the key 'w' twice",
        id="duplicate-key",
    ),
    pytest.param(
        _st(b'{"__metadata__": {"format": "pt"}, "__metadata__": {"format": "np"}}'),
        CorruptCheckpointError,
        "safetensors header of {file} has the key '__metadata__' twice",
        id="duplicate-metadata",
    ),
    pytest.param(
        _st({"__metadata__": {"format": 1}}),
        CorruptCheckpointError,
        "{file}: __metadata__ must map strings to strings",
        id="metadata-not-str",
    ),
    pytest.param(
        _st({"w": [1, 2]}),
        CorruptCheckpointError,
        "{file}, tensor 'w': entry is not an object",
        id="entry-not-object",
    ),
    pytest.param(
        _st({"w": {**_f32([2], [0, 8]), "extra": 1}}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': entry must have exactly dtype, shape and data_offsets",
        id="entry-extra-field",
    ),
    pytest.param(
        _st({"w": {"dtype": "F32", "shape": [2]}}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': entry must have exactly dtype, shape and data_offsets",
        id="entry-no-offsets",
    ),
    # dtypes
    pytest.param(
        _st({"w": _f32([2], [0, 8], "F128")}, EIGHT),
        UnsupportedFormatError,
        "{file}, tensor 'w': unknown dtype 'F128'",
        id="dtype-unknown",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 8], "f32")}, EIGHT),
        UnsupportedFormatError,
        "{file}, tensor 'w': unknown dtype 'f32'",
        id="dtype-lowercase",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 8], 4)}, EIGHT),
        UnsupportedFormatError,
        "{file}, tensor 'w': unknown dtype 4",
        id="dtype-int",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 8], ["F32"])}, EIGHT),
        UnsupportedFormatError,
        "{file}, tensor 'w': unknown dtype ['F32']",
        id="dtype-list",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 8], {"F32": 1})}, EIGHT),
        UnsupportedFormatError,
        "{file}, tensor 'w': unknown dtype {{'F32': 1}}",
        id="dtype-object",
    ),
    # shapes
    pytest.param(
        _st({"w": _f32([-2], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': shape [-2] has a dimension that is not a non-negative integer",
        id="shape-negative",
    ),
    pytest.param(
        _st({"w": _f32([2.0], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': shape [2.0] has a dimension that is not a non-negative integer",
        id="shape-float",
    ),
    pytest.param(
        _st({"w": _f32(["2"], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': shape ['2'] has a dimension that is not a non-negative integer",
        id="shape-string",
    ),
    pytest.param(
        _st({"w": _f32([True, 2], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': shape [True, 2] has a dimension that is not a non-negative integer",
        id="shape-bool",
    ),
    pytest.param(
        _st({"w": _f32([None], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': shape [None] has a dimension that is not a non-negative integer",
        id="shape-null",
    ),
    pytest.param(
        _st({"w": _f32(2, [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': shape 2 is not a list of at most 64 dims",
        id="shape-not-list",
    ),
    pytest.param(
        _st({"w": _f32([1] * 65, [0, 4])}, EIGHT[:4]),
        CorruptCheckpointError,
        "is not a list of at most 64 dims",
        id="shape-65-dims",
    ),
    pytest.param(
        _st({"w": _f32([2**40], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [0, 8] hold 8 bytes but dtype F32 and shape "
        "[1099511627776] need 4398046511104",
        id="shape-huge-2**40",
    ),
    pytest.param(
        _st({"w": _f32([2**32, 2**32, 2**32], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        f"{{file}}, tensor 'w': shape [{2**32}, {2**32}, {2**32}] is too large",
        id="shape-overflows-int64",
    ),
    pytest.param(
        _st({"w": _f32([2**64, 0], [0, 0])}),
        CorruptCheckpointError,
        f"{{file}}, tensor 'w': shape [{2**64}, 0] is too large",
        id="shape-dim-over-int64",
    ),
    pytest.param(
        _st({"w": _f32([2**62, 2**62, 0], [0, 0])}),
        CorruptCheckpointError,
        f"{{file}}, tensor 'w': shape [{2**62}, {2**62}, 0] is too large",
        id="shape-empty-but-overflowing",
    ),
    # data_offsets
    pytest.param(
        _st({"w": _f32([2], [0, 8])}, EIGHT[:4]),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [0, 8] run past the end of the data (4 bytes)",
        id="offsets-past-data",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 2**64])}, EIGHT),
        CorruptCheckpointError,
        f"{{file}}, tensor 'w': data_offsets [0, {2**64}] run past the end of the data (8 bytes)",
        id="offsets-past-data-huge",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 4])}, EIGHT[:4]),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [0, 4] hold 4 bytes but dtype F32 and shape [2] need 8",
        id="offsets-disagree-with-shape",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 8], "F16")}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [0, 8] hold 8 bytes but dtype F16 and shape [2] need 4",
        id="offsets-disagree-with-dtype",
    ),
    pytest.param(
        _st({"w": _f32([2], [8, 0])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [8, 0] must be two non-negative, ordered integers",
        id="offsets-reversed",
    ),
    pytest.param(
        _st({"w": _f32([2], [-8, 0])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [-8, 0] must be two non-negative, ordered integers",
        id="offsets-negative",
    ),
    pytest.param(
        _st({"w": _f32([2], [0.0, 8.0])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [0.0, 8.0] must be two non-negative, ordered integers",
        id="offsets-float",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 8, 16])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [0, 8, 16] must be two non-negative, ordered integers",
        id="offsets-three",
    ),
    pytest.param(
        _st({"w": _f32([2], [False, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': data_offsets [False, 8] must be two non-negative, ordered integers",
        id="offsets-bool",
    ),
    pytest.param(
        _st({"a": _f32([2], [0, 8]), "b": _f32([2], [4, 12])}, EIGHT + EIGHT[:4]),
        CorruptCheckpointError,
        "{file}, tensor 'b': its bytes overlap the previous tensor's",
        id="offsets-overlap",
    ),
    pytest.param(
        _st({"a": _f32([2], [0, 8]), "b": _f32([2], [0, 8])}, EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'b': its bytes overlap the previous tensor's",
        id="offsets-same-range",
    ),
    pytest.param(
        _st({"a": _f32([2], [0, 8]), "b": _f32([2], [12, 20])}, EIGHT + bytes(4) + EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'b': a hole of 4 bytes precedes it",
        id="offsets-hole-between",
    ),
    pytest.param(
        _st({"w": _f32([2], [4, 12])}, bytes(4) + EIGHT),
        CorruptCheckpointError,
        "{file}, tensor 'w': a hole of 4 bytes precedes it",
        id="offsets-hole-at-start",
    ),
    pytest.param(
        _st({"w": _f32([2], [0, 8])}, EIGHT + b"xyz"),
        CorruptCheckpointError,
        "{file}: 3 trailing bytes after the last tensor",
        id="trailing-bytes",
    ),
    pytest.param(
        _st({}, b"x"),
        CorruptCheckpointError,
        "{file}: 1 trailing bytes after the last tensor",
        id="trailing-bytes-no-tensor",
    ),
    pytest.param(
        pickle.dumps({"w": [1.0, 2.0]}),
        CorruptCheckpointError,
        "{file}: header length",
        id="pickle-named-safetensors",
    ),
]


@pytest.mark.parametrize(("content", "error", "message"), FILE_CASES)
def test_malformed_safetensors_file(
    tmp_path: Path, load_fn: Loader, content: bytes, error: type[Exception], message: str
) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with _raises(error, message.format(file=path)):
        load_fn(path, {"w": torch.zeros(2)})


@pytest.mark.parametrize(("content", "error", "message"), FILE_CASES)
def test_malformed_file_in_hf_directory(
    tmp_path: Path, content: bytes, error: type[Exception], message: str
) -> None:
    """The same file as the single ``model.safetensors`` of a directory: named by its path."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(content)
    with _raises(error, message.format(file=ckpt / "model.safetensors")):
        sp.load(ckpt)


def test_malformed_errors_are_checkpoint_errors_and_builtins(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x00")
    with pytest.raises(ValueError) as info:
        sp.load(path)
    assert isinstance(info.value, CheckpointError)
    path.write_bytes(_st({"w": _f32([2], [0, 8], "F128")}, EIGHT))
    with pytest.raises(ValueError) as info:
        sp.load(path)
    assert isinstance(info.value, CheckpointError)


def test_damaged_shard_header_of_shardpoint_checkpoint_names_shard_and_tensor(
    tmp_path: Path, load_fn: Loader
) -> None:
    """Same-size damage to the header of shard 2 (the manifest's size check passes)."""
    ckpt = _two_shards(tmp_path)
    shard = ckpt / "model-00002-of-00002.safetensors"
    raw = shard.read_bytes()
    assert raw.count(b'"dtype":"F32"') == 1
    shard.write_bytes(raw.replace(b'"dtype":"F32"', b'"dtype":"X32"'))
    with _raises(UnsupportedFormatError, f"{shard}, tensor 'b': unknown dtype 'X32'"):
        load_fn(ckpt, _two_targets())


def test_forged_huge_shape_in_header_is_rejected_before_allocation(
    tmp_path: Path, load_fn: Loader, no_big_allocations: None
) -> None:
    path = tmp_path / "bomb.safetensors"
    path.write_bytes(_st({"w": _f32([2**40], [0, 8])}, EIGHT))
    with _raises(CorruptCheckpointError, f"{path}, tensor 'w': data_offsets [0, 8] hold 8 bytes"):
        load_fn(path, {"w": torch.zeros(2)})


def test_allocation_guard_lets_small_loads_through(
    tmp_path: Path, no_big_allocations: None
) -> None:
    """The guard itself must not be what makes the forged-shape tests pass."""
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_st({"w": _f32([2], [0, 8])}, struct.pack("<2f", 1.5, -2.0)))
    assert sp.load(path)["w"].tolist() == [1.5, -2.0]
    with pytest.raises(AssertionError, match="forged header"):
        torch.empty(2**31)


# --------------------------------------------------------------- index: unsafe file names

UNSAFE_NAMES = [
    "../x.safetensors",
    "a/b.safetensors",
    "a\\b.safetensors",
    "/etc/passwd",
    "s3://x/y",
    "http://example.com/model.safetensors",
    "file:x.safetensors",
    "a\x00b.safetensors",
    "..",
    ".",
    "",
    "~/x.safetensors",
    "x" * 300 + ".safetensors",
]


@pytest.mark.parametrize("bad", UNSAFE_NAMES)
def test_index_file_name_must_be_plain_basename(tmp_path: Path, load_fn: Loader, bad: str) -> None:
    sp.save({"w": torch.ones(2)}, tmp_path / "outside")  # something "../" could reach
    shutil.copy(tmp_path / "outside" / "model.safetensors", tmp_path / "x.safetensors")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    index = ckpt / "model.safetensors.index.json"
    _write_json(index, {"metadata": {"total_size": 8}, "weight_map": {"w": bad}})
    expected = f"{index}, tensor 'w': file name {bad[:100]!r} is not a plain file name"
    with _raises(UnsafePathError, expected):
        load_fn(ckpt, {"w": torch.zeros(2)})


@pytest.mark.parametrize("bad", [3, None, ["model.safetensors"]])
def test_index_file_name_must_be_a_string(tmp_path: Path, bad: Any) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    index = ckpt / "model.safetensors.index.json"
    _write_json(index, {"metadata": {}, "weight_map": {"w": bad}})
    with _raises(
        UnsafePathError, f"{index}, tensor 'w': file name {str(bad)!r} is not a plain file name"
    ):
        sp.load(ckpt)


@pytest.mark.parametrize("bad", UNSAFE_NAMES)
def test_manifest_file_name_must_be_plain_basename(
    tmp_path: Path, load_fn: Loader, bad: str
) -> None:
    ckpt = _one_file(tmp_path)
    shutil.copy(ckpt / "model.safetensors", tmp_path / "x.safetensors")
    manifest = ckpt / "shardpoint.json"
    doc = _read_json(manifest)
    doc["files"] = {bad: doc["files"]["model.safetensors"]}
    doc["components"]["model"]["tensors"]["w"]["chunks"][0]["file"] = bad
    _write_json(manifest, doc)
    with _raises(UnsafePathError, f"{manifest}: file name {bad[:100]!r} is not a plain file name"):
        load_fn(ckpt, {"w": torch.zeros(4)})


@pytest.mark.parametrize("relative", [True, False])
def test_symlink_leaving_the_directory_is_refused(
    tmp_path: Path, load_fn: Loader, relative: bool
) -> None:
    ckpt = _one_file(tmp_path)
    outside = tmp_path / "outside.safetensors"
    os.replace(ckpt / "model.safetensors", outside)
    os.symlink("../outside.safetensors" if relative else outside, ckpt / "model.safetensors")
    expected = f"{ckpt}: 'model.safetensors' is a symlink that leaves the checkpoint directory"
    with _raises(UnsafePathError, expected):
        load_fn(ckpt, {"w": torch.zeros(4)})
    _hf_only(ckpt)  # the same without a manifest
    with _raises(UnsafePathError, expected):
        load_fn(ckpt, {"w": torch.zeros(4)})


def test_symlink_in_index_checkpoint_leaving_the_directory_is_refused(tmp_path: Path) -> None:
    ckpt = _hf_only(_two_shards(tmp_path))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = "model-00002-of-00002.safetensors"
    os.replace(ckpt / shard, outside / shard)
    os.symlink(outside / shard, ckpt / shard)
    with _raises(
        UnsafePathError, f"{ckpt}: {shard!r} is a symlink that leaves the checkpoint directory"
    ):
        sp.load(ckpt)


def test_symlink_within_the_directory_is_followed(tmp_path: Path) -> None:
    ckpt = _hf_only(_one_file(tmp_path))
    os.replace(ckpt / "model.safetensors", ckpt / "real.bin")
    os.symlink("real.bin", ckpt / "model.safetensors")
    assert sp.load(ckpt)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_symlinked_single_file_given_directly_is_read(tmp_path: Path) -> None:
    """The user named this file (e.g. a Hugging Face cache snapshot link): follow it."""
    ckpt = _one_file(tmp_path)
    link = tmp_path / "link.safetensors"
    os.symlink(ckpt / "model.safetensors", link)
    assert sp.load(link)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_data_file_that_is_not_a_regular_file(tmp_path: Path, load_fn: Loader, kind: str) -> None:
    """A directory or FIFO in place of a shard is refused (a FIFO would block forever)."""
    ckpt = _one_file(tmp_path)
    shard = ckpt / "model.safetensors"
    shard.unlink()
    if kind == "directory":
        shard.mkdir()
    else:
        os.mkfifo(shard)
    with _raises(CorruptCheckpointError, f"{shard} is not a regular file"):
        load_fn(ckpt, {"w": torch.zeros(4)})


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_manifest_that_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    ckpt = _one_file(tmp_path)
    manifest = ckpt / "shardpoint.json"
    manifest.unlink()
    if kind == "directory":
        manifest.mkdir()
    else:
        os.mkfifo(manifest)
    with _raises(CorruptCheckpointError, f"{manifest} is not a regular file"):
        sp.load(ckpt)


# ------------------------------------------------------------ missing / misplaced tensors


def test_missing_shard(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _two_shards(tmp_path)
    shard = ckpt / "model-00002-of-00002.safetensors"
    shard.unlink()
    with _raises(MissingShardError, f"{shard} is missing"):
        load_fn(ckpt, _two_targets())
    with pytest.raises(FileNotFoundError):
        load_fn(ckpt, _two_targets())


def test_missing_shard_of_hf_index(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _hf_only(_two_shards(tmp_path))
    shard = ckpt / "model-00001-of-00002.safetensors"
    shard.unlink()
    with _raises(MissingShardError, f"{shard} is missing"):
        load_fn(ckpt, _two_targets())


def test_tensor_in_index_but_absent_from_its_file(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _hf_only(_two_shards(tmp_path))
    index = ckpt / "model.safetensors.index.json"
    doc = _read_json(index)
    doc["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    _write_json(index, doc)
    shard = ckpt / "model-00001-of-00002.safetensors"
    with _raises(
        CorruptCheckpointError,
        f"{shard}: tensor 'b' is listed in the index but absent from this file",
    ):
        load_fn(ckpt, _two_targets())


def test_tensor_in_manifest_but_absent_from_its_file(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _two_shards(tmp_path)
    manifest = ckpt / "shardpoint.json"
    doc = _read_json(manifest)
    doc["components"]["model"]["tensors"]["b"]["chunks"][0]["file"] = (
        "model-00001-of-00002.safetensors"
    )
    _write_json(manifest, doc)
    shard = ckpt / "model-00001-of-00002.safetensors"
    with _raises(
        CorruptCheckpointError, f"{shard}: tensor 'b' (key 'b') is listed in the checkpoint's"
    ):
        load_fn(ckpt, _two_targets())


def test_tensor_key_renamed_inside_file(tmp_path: Path, load_fn: Loader) -> None:
    """Same-size rename of the key inside the file: the manifest's key is absent."""
    ckpt = _two_shards(tmp_path)
    shard = ckpt / "model-00002-of-00002.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw.replace(b'"b":{', b'"c":{', 1))
    with _raises(
        CorruptCheckpointError, f"{shard}: tensor 'b' (key 'b') is listed in the checkpoint's"
    ):
        load_fn(ckpt, _two_targets())


def test_tensor_present_in_two_files_of_hf_index(tmp_path: Path, load_fn: Loader) -> None:
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(
        {"a": torch.ones(2), "b": torch.ones(2)},
        ckpt / "one.safetensors",
        metadata={"format": "pt"},
    )
    save_file(
        {"a": torch.zeros(2), "c": torch.ones(2)},
        ckpt / "two.safetensors",
        metadata={"format": "pt"},
    )
    _write_json(
        ckpt / "model.safetensors.index.json",
        {
            "metadata": {},
            "weight_map": {"a": "one.safetensors", "b": "one.safetensors", "c": "two.safetensors"},
        },
    )
    target = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}
    expected = f"{ckpt}: tensor 'a' is stored in both 'one.safetensors' and 'two.safetensors'"
    with _raises(CorruptCheckpointError, expected):
        load_fn(ckpt, target)


def test_tensor_present_in_two_files_of_manifest(tmp_path: Path, load_fn: Loader) -> None:
    """A whole-tensor chunk listed twice (once per file): the chunks cover it twice."""
    ckpt = _two_shards(tmp_path)
    manifest = ckpt / "shardpoint.json"
    doc = _read_json(manifest)
    tensors = doc["components"]["model"]["tensors"]
    tensors["a"]["chunks"].append({**tensors["b"]["chunks"][0]})
    _write_json(manifest, doc)
    expected = (
        f"{manifest}, component 'model', tensor 'a': chunks hold 8 elements, the tensor has 4"
    )
    with _raises(CorruptCheckpointError, expected):
        load_fn(ckpt, _two_targets())


def test_one_stored_tensor_claimed_by_two_manifest_entries(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _two_shards(tmp_path)
    manifest = ckpt / "shardpoint.json"
    doc = _explicit_chunks(_read_json(manifest))
    tensors = doc["components"]["model"]["tensors"]
    tensors["b"]["chunks"] = [{**tensors["a"]["chunks"][0]}]
    _write_json(manifest, doc)
    expected = (
        f"{manifest}, component 'model', tensor 'b': chunk 'a' of "
        "'model-00001-of-00002.safetensors' is already used by another tensor"
    )
    with _raises(CorruptCheckpointError, expected):
        load_fn(ckpt, _two_targets())


@pytest.mark.parametrize("second_at", [[0], [1]])
def test_chunks_that_overlap_are_refused_though_they_hold_the_tensor_s_count(
    tmp_path: Path, second_at: list[int]
) -> None:
    """Two chunks of 2 elements for a tensor of 4, both at 0 (or at 0 and 1): the count
    matches, but part of the tensor would never be read (load would hand back whatever the
    memory held, verify would pass it and convert launder it). Refused by every reader."""
    ckpt = _two_shards(tmp_path)
    manifest = ckpt / "shardpoint.json"
    doc = _explicit_chunks(_read_json(manifest))
    tensors = doc["components"]["model"]["tensors"]
    a, b = tensors["a"]["chunks"][0], tensors["b"]["chunks"][0]
    tensors["w"] = {"dtype": "F32", "shape": [8], "chunks": [
        {**a, "offsets": [0], "shape": [4]}, {**b, "offsets": second_at, "shape": [4]}]}
    del tensors["a"], tensors["b"]
    doc["components"]["model"]["tree"] = {"type": "dict", "tensors": ["w"]}
    _write_json(manifest, doc)
    expected = (
        f"{manifest}, component 'model', tensor 'w': chunks overlap ('a' of "
        f"'model-00001-of-00002.safetensors' at [0] shape [4] and 'b' of 'model-00002-of-00002.safetensors' "
        f"at {second_at} shape [4]; a tensor's chunks must each hold a different part of it); "
        "the manifest is damaged or forged"
    )
    with _raises(CorruptCheckpointError, expected):
        sp.load(ckpt)
    with _raises(CorruptCheckpointError, expected):
        sp.load_into({"w": torch.full((8,), -1.0)}, ckpt)
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(expected in str(p) for p in report.problems), report.problems


def test_a_data_file_without_a_save_id_under_a_manifest_is_refused(tmp_path: Path) -> None:
    """A same-size file in place of one of the save's, its save_id key renamed: the identity
    check that also guards mmap loads (which skip crc32c) must not be skipped."""
    first = _two_shards(tmp_path)
    shard = first / "model-00002-of-00002.safetensors"
    raw = shard.read_bytes()
    forged = raw.replace(b'"shardpoint.save_id"', b'"shardpoint.save_iX"', 1)
    assert forged != raw and len(forged) == len(raw)
    shard.write_bytes(forged)
    expected = f"{shard} carries no shardpoint save_id (the manifest's save is "
    for mmap in (False, True):
        with _raises(CorruptCheckpointError, expected):
            sp.load(first, mmap=mmap)


# --------------------------------------------------------------------- sizes and checksums


@pytest.mark.parametrize("change", [-1, 1, -100, 4096])
def test_file_size_disagrees_with_manifest(tmp_path: Path, load_fn: Loader, change: int) -> None:
    ckpt = _two_shards(tmp_path)
    shard = ckpt / "model-00002-of-00002.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:change] if change < 0 else raw + b"\0" * change)
    expected = f"{shard} is {len(raw) + change} bytes but the manifest recorded {len(raw)}"
    with _raises(CorruptCheckpointError, expected):
        load_fn(ckpt, _two_targets())


def test_truncated_shard_of_hf_checkpoint(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _hf_only(_two_shards(tmp_path))
    shard = ckpt / "model-00002-of-00002.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-4])
    expected = f"{shard}, tensor 'b': data_offsets [0, 16] run past the end of the data (12 bytes)"
    with _raises(CorruptCheckpointError, expected):
        load_fn(ckpt, _two_targets())


def test_padded_shard_of_hf_checkpoint(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _hf_only(_two_shards(tmp_path))
    shard = ckpt / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes() + b"\0\0")
    with _raises(CorruptCheckpointError, f"{shard}: 2 trailing bytes after the last tensor"):
        load_fn(ckpt, _two_targets())


def _flip_last_byte(shard: Path) -> None:
    raw = bytearray(shard.read_bytes())
    assert len(raw) > _data_start(shard)  # the last byte is tensor data
    raw[-1] ^= 0x40
    shard.write_bytes(bytes(raw))


def test_crc32c_mismatch(tmp_path: Path) -> None:
    ckpt = _two_shards(tmp_path)
    shard = ckpt / "model-00002-of-00002.safetensors"
    _flip_last_byte(shard)
    expected = f"{shard}, tensor 'b': crc32c of the stored bytes is 0x"
    with _raises(ChecksumMismatchError, expected):
        sp.load(ckpt)
    with _raises(ChecksumMismatchError, expected):
        sp.load_into(_two_targets(), ckpt)
    with _raises(ChecksumMismatchError, expected):
        sp.load(ckpt, keys=["b"])


def test_crc32c_mismatch_not_checked_with_verify_false(tmp_path: Path) -> None:
    ckpt = _two_shards(tmp_path)
    _flip_last_byte(ckpt / "model-00002-of-00002.safetensors")
    damaged = struct.unpack(
        "<f", struct.pack("<f", 13.0)[:3] + bytes([struct.pack("<f", 13.0)[3] ^ 0x40])
    )[0]
    state = sp.load(ckpt, verify=False)
    assert state["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert state["b"].tolist() == [10.0, 11.0, 12.0, damaged]
    target = _two_targets()
    assert sp.load_into(target, ckpt, verify=False).ok
    assert target["b"].tolist() == [10.0, 11.0, 12.0, damaged]


def test_crc32c_mismatch_honours_the_verify_option(tmp_path: Path) -> None:
    ckpt = _two_shards(tmp_path)
    _flip_last_byte(ckpt / "model-00001-of-00002.safetensors")
    with sp.using(io=sp.IOOptions(verify_checksums=False)):
        assert sp.load(ckpt)["b"].tolist() == [10.0, 11.0, 12.0, 13.0]
        with _raises(ChecksumMismatchError, "model-00001-of-00002.safetensors, tensor 'a': crc32c"):
            sp.load(ckpt, verify=True)  # the argument wins over the option
    with _raises(ChecksumMismatchError, "model-00001-of-00002.safetensors, tensor 'a': crc32c"):
        sp.load(ckpt, options=sp.IOOptions(verify_checksums=True))


def test_shard_swapped_in_from_another_save(tmp_path: Path, load_fn: Loader) -> None:
    first = _two_shards(tmp_path, "first")
    second = _two_shards(tmp_path, "second")
    shard = "model-00002-of-00002.safetensors"
    assert (first / shard).stat().st_size == (second / shard).stat().st_size
    shutil.copy(second / shard, first / shard)
    other_id = _read_json(second / "shardpoint.json")["save_id"]
    expected = f"{first / shard} belongs to another save (save_id {other_id}"
    with _raises(CorruptCheckpointError, expected):
        load_fn(first, _two_targets())


# -------------------------------------------------------------------- the manifest itself


def _explicit_chunks(doc: dict[str, Any]) -> dict[str, Any]:
    """Write out the chunk fields format 2 implies (key, offsets, shape), so that a forgery
    can change one of them."""
    for comp in doc["components"].values():
        for name, rec in comp["tensors"].items():
            for chunk in rec["chunks"]:
                chunk.setdefault("key", name)
                if "offsets" not in chunk and "shape" not in chunk:
                    chunk["offsets"], chunk["shape"] = [0] * len(rec["shape"]), list(rec["shape"])
    return doc


def _forge_manifest(ckpt: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    manifest = ckpt / "shardpoint.json"
    doc = _explicit_chunks(_read_json(manifest))
    edit(doc)
    _write_json(manifest, doc)
    return manifest


def _tensor_w(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["components"]["model"]["tensors"]["w"]  # type: ignore[no-any-return]


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return edit


_W = ["components", "model", "tensors", "w"]
_CHUNK = [*_W, "chunks", 0]

# (edit, error class, message after "{manifest}")
MANIFEST_CASES = [
    pytest.param(
        _set(["format_version"], 4),
        UnsupportedFormatError,
        ": format_version 4 is not supported by this shardpoint (reads versions 1, 2, 3)",
        id="format-version-4",
    ),
    pytest.param(
        _set(["format_version"], "1"),
        UnsupportedFormatError,
        ": format_version '1' is not supported",
        id="format-version-str",
    ),
    pytest.param(
        _set(["format"], "orbax"),
        UnsupportedFormatError,
        ": 'format' is 'orbax', not 'shardpoint'",
        id="format-name",
    ),
    pytest.param(
        _set(["layout"], "zigzag"), UnsupportedFormatError, ": unknown layout 'zigzag'", id="layout"
    ),
    pytest.param(
        _set(["world_size"], 0),
        CorruptCheckpointError,
        ": world_size 0 is invalid",
        id="world-size",
    ),
    pytest.param(
        _set(["flat"], "yes"),
        CorruptCheckpointError,
        ": 'flat' is missing or not a bool",
        id="flat-not-bool",
    ),
    pytest.param(
        _set(["components"], {"optim": {"tree": {"type": "dict", "items": []}, "tensors": {}}}),
        CorruptCheckpointError,
        ": a flat checkpoint must have exactly the component 'model'",
        id="flat-without-model",
    ),
    pytest.param(
        _set(["files", "model.safetensors", "size"], -1),
        CorruptCheckpointError,
        ": file 'model.safetensors' has invalid size -1",
        id="file-size-negative",
    ),
    pytest.param(
        lambda doc: doc.update(flat=False, components={"../x": doc["components"]["model"]}),
        UnsafePathError,
        ": component name '../x' is not allowed",
        id="component-name",
    ),
    pytest.param(
        _set([*_W, "dtype"], "F128"),
        UnsupportedFormatError,
        ", component 'model', tensor 'w': unknown dtype 'F128'",
        id="dtype-unknown",
    ),
    pytest.param(
        _set([*_W, "dtype"], ["F32"]),
        UnsupportedFormatError,
        ", component 'model', tensor 'w': unknown dtype ['F32']",
        id="dtype-list",
    ),
    pytest.param(
        _set([*_W, "shape"], [-4]),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': shape [-4] is not a list of non-negative integers",
        id="shape-negative",
    ),
    pytest.param(
        _set([*_W, "shape"], [4.0]),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': shape [4.0] is not a list of non-negative integers",
        id="shape-float",
    ),
    pytest.param(
        _set([*_W, "shape"], [True]),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': shape [True] is not a list of non-negative integers",
        id="shape-bool",
    ),
    pytest.param(
        _set([*_W, "shape"], [2**64]),
        CorruptCheckpointError,
        f", component 'model', tensor 'w': shape [{2**64}] is too large",
        id="shape-dim-over-int64",
    ),
    pytest.param(
        _set([*_CHUNK, "shape"], [8]),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': chunk at [0] of shape [8] does not fit shape [4]",
        id="chunk-too-big",
    ),
    pytest.param(
        _set([*_CHUNK, "offsets"], [1]),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': chunk at [1] of shape [4] does not fit shape [4]",
        id="chunk-offset",
    ),
    pytest.param(
        _set([*_CHUNK, "file"], "other.safetensors"),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': chunk file 'other.safetensors' is not in 'files'",
        id="chunk-file-unlisted",
    ),
    pytest.param(
        _set([*_CHUNK, "crc32c"], 2**32),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': bad crc32c",
        id="crc-out-of-range",
    ),
    pytest.param(
        _set([*_W, "chunks"], []),
        CorruptCheckpointError,
        ", component 'model', tensor 'w': 'chunks' is missing or empty",
        id="no-chunks",
    ),
    pytest.param(
        _set(["components", "model", "aliases"], {"v": "nope"}),
        CorruptCheckpointError,
        ", component 'model': alias 'v' points to unknown tensor 'nope'",
        id="alias-unknown",
    ),
]


@pytest.mark.parametrize(("edit", "error", "message"), MANIFEST_CASES)
def test_forged_manifest_field(
    tmp_path: Path,
    load_fn: Loader,
    edit: Callable[[dict[str, Any]], None],
    error: type[Exception],
    message: str,
) -> None:
    manifest = _forge_manifest(_one_file(tmp_path), edit)
    with _raises(error, f"{manifest}{message}"):
        load_fn(manifest.parent, {"w": torch.zeros(4)})


def test_forged_manifest_shape_is_rejected_before_allocation(
    tmp_path: Path, load_fn: Loader, no_big_allocations: None
) -> None:
    """A global shape of 2**40 with one 4-element chunk: the chunks do not cover it."""
    manifest = _forge_manifest(_one_file(tmp_path), _set([*_W, "shape"], [2**40]))
    expected = (
        f"{manifest}, component 'model', tensor 'w': chunks hold 4 elements, the tensor has {2**40}"
    )
    with _raises(CorruptCheckpointError, expected):
        load_fn(manifest.parent, {"w": torch.zeros(4)})


def test_forged_manifest_chunk_larger_than_file(
    tmp_path: Path, load_fn: Loader, no_big_allocations: None
) -> None:
    def edit(doc: dict[str, Any]) -> None:
        _tensor_w(doc)["shape"] = [2**40]
        _tensor_w(doc)["chunks"][0]["shape"] = [2**40]

    manifest = _forge_manifest(_one_file(tmp_path), edit)
    expected = (
        f"{manifest}, component 'model', tensor 'w': chunk of shape [{2**40}] is larger than its "
        "file 'model.safetensors'"
    )
    with _raises(CorruptCheckpointError, expected):
        load_fn(manifest.parent, {"w": torch.zeros(4)})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b"not json {", " is not valid JSON", id="not-json"),
        pytest.param(b"", " is not valid JSON", id="empty"),
        pytest.param(b"\xff\xfe{}", " is not valid UTF-8", id="not-utf8"),
        pytest.param(b"[1, 2, 3]", " must be a JSON object, found list", id="list"),
        pytest.param(b"3.5", " must be a JSON object, found float", id="number"),
        pytest.param(b"[" * 200_000 + b"]" * 200_000, " nests JSON too deeply", id="bomb-lists"),
        pytest.param(
            b'{"a":' * 200_000 + b"1" + b"}" * 200_000, " nests JSON too deeply", id="bomb-objects"
        ),
        pytest.param(
            b'{"format": "shardpoint", "format": "shardpoint"}',
            " has the key 'format' twice",
            id="duplicate-key",
        ),
        pytest.param(b'{"n": ' + b"9" * 5000 + b"}", " is not valid JSON", id="huge-int"),
    ],
)
def test_manifest_not_a_json_object(
    tmp_path: Path, load_fn: Loader, content: bytes, message: str
) -> None:
    ckpt = _one_file(tmp_path)
    manifest = ckpt / "shardpoint.json"
    manifest.write_bytes(content)
    with _raises(CorruptCheckpointError, f"{manifest}{message}"):
        load_fn(ckpt, {"w": torch.zeros(4)})


def test_manifest_bomb_nested_inside_valid_manifest(tmp_path: Path) -> None:
    """A deep (but parseable) state tree is refused by depth, not by running out of stack."""
    ckpt = _one_file(tmp_path)
    node: dict[str, Any] = {"type": "json", "value": 1}
    for _ in range(300):
        node = {"type": "list", "items": [node]}

    def edit(doc: dict[str, Any]) -> None:
        doc["components"]["model"]["tree"] = node
        doc["flat"] = False
        doc["components"]["other"] = doc["components"].pop("model")

    _forge_manifest(ckpt, edit)
    with _raises(CorruptCheckpointError, "malformed state tree node") as info:
        sp.load(ckpt)
    assert str(info.value).startswith(f"{ckpt}")


def test_manifest_over_the_json_size_limit(tmp_path: Path) -> None:
    ckpt = _one_file(tmp_path)
    manifest = ckpt / "shardpoint.json"
    size = manifest.stat().st_size
    with _raises(
        CorruptCheckpointError, f"{manifest} is {size} bytes, over the {size - 1}-byte limit"
    ):
        sp.load(ckpt, options=sp.IOOptions(max_json_bytes=size - 1))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b"{", " is not valid JSON", id="not-json"),
        pytest.param(b"[]", " must be a JSON object, found list", id="list"),
        pytest.param(b"[" * 200_000, " nests JSON too deeply", id="bomb"),
        pytest.param(
            b'{"weight_map": {"a": "x", "a": "y"}}', " has the key 'a' twice", id="duplicate-key"
        ),
        pytest.param(
            b'{"weight_map": ["a"]}',
            ": 'weight_map' is missing or not an object",
            id="no-weight-map",
        ),
        pytest.param(
            b'{"weight_map": {}, "metadata": 1}', ": 'metadata' is not an object", id="bad-metadata"
        ),
    ],
)
def test_index_not_a_valid_json_object(tmp_path: Path, content: bytes, message: str) -> None:
    ckpt = _hf_only(_two_shards(tmp_path))
    index = ckpt / "model.safetensors.index.json"
    index.write_bytes(content)
    with _raises(CorruptCheckpointError, f"{index}{message}"):
        sp.load(ckpt)


# -------------------------------------------------------------- incomplete or not there


def test_loading_a_tmp_directory(tmp_path: Path, load_fn: Loader) -> None:
    ckpt = _one_file(tmp_path)
    tmp = tmp_path / ".ckpt.tmp-0123456789abcdef"
    os.rename(ckpt, tmp)
    expected = f"{tmp} is the temporary directory of a save that never committed"
    with _raises(IncompleteCheckpointError, expected):
        load_fn(tmp, {"w": torch.zeros(4)})
    with _raises(IncompleteCheckpointError, expected):
        load_fn(Path(f"{tmp}/"), {"w": torch.zeros(4)})


def test_loading_a_tmp_directory_without_manifest(tmp_path: Path) -> None:
    """What a crash mid-save leaves: data files, no manifest, a .tmp- name."""
    ckpt = _one_file(tmp_path)
    (ckpt / "shardpoint.json").unlink()
    tmp = tmp_path / ".ckpt.tmp-feedface"
    os.rename(ckpt, tmp)
    with _raises(IncompleteCheckpointError, f"{tmp} is the temporary directory"):
        sp.load(tmp)


def test_parent_holding_only_a_tmp_directory(tmp_path: Path) -> None:
    _one_file(tmp_path)
    os.rename(tmp_path / "ckpt", tmp_path / ".ckpt.tmp-0123")
    with _raises(CheckpointNotFoundError, f"{tmp_path} holds no committed checkpoint"):
        sp.load(tmp_path)


def test_path_that_does_not_exist(tmp_path: Path, load_fn: Loader) -> None:
    with _raises(CheckpointNotFoundError, f"{tmp_path / 'nope'} does not exist"):
        load_fn(tmp_path / "nope", {"w": torch.zeros(4)})


def test_empty_directory(tmp_path: Path) -> None:
    with _raises(CheckpointNotFoundError, f"{tmp_path} is not a checkpoint"):
        sp.load(tmp_path)


# -------------------------------------------------------------------- nothing unpickles


class _Payload:
    """Unpickling this creates a marker file: the proof that something unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (str(self.marker), "w"))


def test_pickle_checkpoint_is_never_unpickled(tmp_path: Path, load_fn: Loader) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    payload = pickle.dumps(_Payload(marker))
    (ckpt / "pytorch_model.bin").write_bytes(payload)
    # .bin weights are read only in the zip format (weights_only); a bare pickle is refused.
    with _raises(UnsupportedFormatError, f"{ckpt / 'pytorch_model.bin'} is not a zip-format torch.save"):
        load_fn(ckpt, {"w": torch.zeros(4)})
    with _raises(UnsupportedFormatError, f"{ckpt / 'pytorch_model.bin'} is not a zip-format torch.save"):
        load_fn(ckpt / "pytorch_model.bin", {"w": torch.zeros(4)})
    (ckpt / "model.safetensors").write_bytes(payload)
    with _raises(CorruptCheckpointError, f"{ckpt / 'model.safetensors'}: header length"):
        load_fn(ckpt, {"w": torch.zeros(4)})
    assert not marker.exists()


def test_forged_pickle_node_in_manifest_is_not_unpickled(tmp_path: Path) -> None:
    """A manifest whose tree claims a pickled leaf, pointing at a stored uint8 tensor."""
    marker = tmp_path / "pwned"
    payload = torch.frombuffer(bytearray(pickle.dumps(_Payload(marker))), dtype=torch.uint8)
    ckpt = tmp_path / "ckpt"
    sp.save({"model": {"blob": payload, "n": 1}}, ckpt)

    def edit(doc: dict[str, Any]) -> None:
        items = doc["components"]["model"]["tree"]["items"]
        assert items[0][1] == "blob"
        items[0][2] = {"type": "pickle", "name": items[0][2]["name"], "class": "os.system"}

    _forge_manifest(ckpt, edit)
    with _raises(UnsafePickleError, "'blob' (a os.system) was pickled at save time") as info:
        sp.load(ckpt)
    assert str(info.value).startswith(str(ckpt))
    assert not marker.exists()


# ------------------------------------------------------------------------ bad save input


def _nothing_written(tmp_path: Path) -> None:
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == [], f"a refused save left {leftovers}"


@pytest.mark.parametrize(
    ("make_state", "message"),
    [
        pytest.param(
            lambda: {"w": torch.ones(2), "s": torch.eye(2).to_sparse()},
            "tensor 's' is a torch.sparse_coo tensor",
            id="sparse-coo",
        ),
        pytest.param(
            lambda: {"s": torch.eye(2).to_sparse_csr()},
            "tensor 's' is a torch.sparse_csr tensor",
            id="sparse-csr",
        ),
        pytest.param(
            lambda: {"w": torch.ones(2), "m": torch.empty(3, device="meta")},
            "tensor 'm' is on the meta device",
            id="meta",
        ),
        pytest.param(
            lambda: {"z": torch.zeros(2, dtype=torch.complex128)},
            "tensor 'z' has dtype torch.complex128, which safetensors cannot store",
            id="complex128",
        ),
        pytest.param(
            lambda: {"a": torch.zeros(1), "b": object()},
            "state at b is a builtins.object",
            id="object-flat",
        ),
        pytest.param(
            lambda: {"model": {"w": torch.zeros(1), "opt": [1, object()]}},
            "state at model['opt']['1'] is a builtins.object",
            id="object-nested",
        ),
        pytest.param(
            lambda: {"model": {"w": torch.zeros(1), (1, 2): torch.zeros(1)}},
            "state at model has key (1, 2) of type tuple",
            id="tuple-key",
        ),
        pytest.param(
            lambda: {1: torch.zeros(1)}, "key 1 of the state dict is a int", id="int-key-flat"
        ),
        pytest.param(
            lambda: {"../evil": {"w": torch.zeros(1)}, "n": 1},
            "top-level key '../evil' of the state",
            id="component-name",
        ),
        pytest.param(  # its file, model-00001-of-00002.safetensors, would overwrite model's first shard
            lambda: {"model": {f"w{i}": torch.zeros(64) for i in range(4)}, "model-00001-of-00002": {"n": 1}},
            "top-level key 'model-00001-of-00002' of the state cannot name a component: "
            "model-00001-of-00002.safetensors is the name of one of another component's data files, which it "
            "would overwrite; rename the key (e.g. 'model_00001_of_00002')",
            id="component-named-like-a-shard",
        ),
        pytest.param(  # `$` let a trailing newline through: a file named "model\n.safetensors"
            lambda: {"model\n": {"w": torch.zeros(1)}, "n": {"w": torch.zeros(1)}},
            "top-level key 'model\\n' of the state cannot name a component",
            id="component-name-with-a-newline",
        ),
        pytest.param(
            lambda: {"optim": {"w": torch.zeros(1)}, "optim-r00000-00000": {"w": torch.zeros(1)}},
            "top-level key 'optim-r00000-00000' of the state cannot name a component",
            id="component-named-like-a-rank-file",
        ),
        pytest.param(
            lambda: {"Optim": {"w": torch.zeros(1)}, "optim": {"w": torch.zeros(1)}},
            "top-level keys 'Optim' and 'optim' of the state differ only in case: their files would be one file "
            "on a case-insensitive filesystem",
            id="components-differing-in-case",
        ),
        pytest.param(lambda: {}, "the state is empty", id="empty"),
        pytest.param(
            lambda: [torch.zeros(1)],
            "save() takes a state dict or a mapping of components, not list",
            id="not-a-mapping",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_save_refuses_state(tmp_path: Path, make_state: Callable[[], Any], message: str) -> None:
    state = make_state()
    with _raises(InvalidStateError, message):
        sp.save(state, tmp_path / "ckpt")
    _nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("size", "message"),
    [
        pytest.param("5XB", "cannot parse size '5XB'", id="unknown-unit"),
        pytest.param("-1", "cannot parse size '-1'", id="negative-str"),
        pytest.param("", "cannot parse size ''", id="empty"),
        pytest.param("GB", "cannot parse size 'GB'", id="no-number"),
        pytest.param("1e9", "cannot parse size '1e9'", id="exponent"),
        pytest.param("0.1B", "size '0.1B' must be at least one byte", id="below-one-byte"),
        pytest.param(0, "size 0 must be a positive number of bytes", id="zero"),
        pytest.param(-5, "size -5 must be a positive number of bytes", id="negative-int"),
        pytest.param(True, "size True is a bool", id="bool"),
        pytest.param(1.5e9, "size 1500000000.0 has type float", id="float"),
        pytest.param(None, "size None has type NoneType", id="none"),
    ],
)
def test_save_refuses_max_shard_size(tmp_path: Path, size: Any, message: str) -> None:
    with _raises(InvalidSizeError, message):
        sp.save({"w": torch.ones(2)}, tmp_path / "ckpt", max_shard_size=size)
    _nothing_written(tmp_path)


def test_save_refuses_existing_checkpoint(tmp_path: Path) -> None:
    ckpt = _one_file(tmp_path)
    before = (ckpt / "shardpoint.json").read_bytes()
    with _raises(CheckpointExistsError, f"{ckpt} already exists; pass overwrite=True"):
        sp.save({"w": torch.zeros(1)}, ckpt)
    assert (ckpt / "shardpoint.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_save_into_existing_non_checkpoint_refuses_a_file_and_keeps_a_folders_files(
    tmp_path: Path, kind: str
) -> None:
    target = tmp_path / "data"
    if kind == "file":
        target.write_text("precious")
    else:
        target.mkdir()
        (target / "precious.txt").write_text("precious")
    # A file: what overwrite=True would say too, at once (it advised overwrite=True, then refused it).
    first = f"{target} exists and is not a shardpoint checkpoint" if kind == "file" else f"{target} already exists"
    with _raises(CheckpointExistsError, first):
        sp.save({"w": torch.zeros(1)}, target)
    if kind == "file":
        with _raises(CheckpointExistsError, f"{target} exists and is not a shardpoint checkpoint"):
            sp.save({"w": torch.zeros(1)}, target, overwrite=True)
        assert target.read_text() == "precious"
    else:  # overwrite=True writes the checkpoint into the folder and keeps the user's file
        sp.save({"w": torch.zeros(1)}, target, overwrite=True)
        assert (target / "precious.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_tensor_added_to_a_data_file_of_a_manifest_is_refused(tmp_path: Path, load_fn: Loader) -> None:
    """A second copy of 'a' (kept in the file's save) in the file of 'b': verify said OK
    with a warning, shardpoint loaded the manifest's 'a' while transformers, which loads
    every tensor of every file, loaded the added one. Now refused by loads and verify."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    ckpt = _two_shards(tmp_path)
    shard = ckpt / "model-00002-of-00002.safetensors"
    with safe_open(str(shard), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
    save_file({**tensors, "a": torch.full((4,), 666.0)}, str(shard), metadata=metadata)
    manifest = ckpt / "shardpoint.json"
    doc = _read_json(manifest)
    doc["files"][shard.name]["size"] = shard.stat().st_size
    _write_json(manifest, doc)
    message = (
        f"{shard} holds 1 tensor(s) the manifest does not list in it ('a'); a save writes none, and other "
        "readers (transformers loads every tensor of every file) would load them where shardpoint does not: "
        "the file was changed after its save. Restore it from a copy"
    )
    with _raises(CorruptCheckpointError, message):
        load_fn(ckpt, _two_targets())
    report = verify_checkpoint(ckpt)
    assert not report.ok and any(message in p for p in report.problems), report.problems


def test_an_hf_layout_manifest_reading_a_tensor_from_another_key_is_refused(tmp_path: Path, load_fn: Loader) -> None:
    """Swapping the chunk keys of 'a' and 'b' (crcs swapped too) made shardpoint load b's
    values as 'a' while every other reader of the files loads the file's 'a'."""
    path = tmp_path / "ckpt"
    sp.save({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, path)
    manifest = path / "shardpoint.json"
    doc = _read_json(manifest)
    tensors = doc["components"]["model"]["tensors"]
    ca, cb = tensors["a"]["chunks"][0], tensors["b"]["chunks"][0]
    tensors["a"]["chunks"], tensors["b"]["chunks"] = [dict(cb, key="b")], [dict(ca, key="a")]
    _write_json(manifest, doc)
    message = (
        f"{manifest}, component 'model', tensor 'a': in the 'hf' layout a tensor is stored whole under its own "
        "name (what every other reader of the files loads), but the manifest reads it from 'b'; the manifest "
        "is damaged or forged"
    )
    with _raises(CorruptCheckpointError, message):
        load_fn(path, _two_targets())
    assert not verify_checkpoint(path).ok


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400"])
def test_json_numbers_that_are_not_finite_are_refused(tmp_path: Path, number: str) -> None:
    """JSON has no NaN or infinities (1e400 decodes to inf): a manifest holding one in its
    metadata passed verify, and `inspect --json` then printed invalid JSON."""
    path = tmp_path / "ckpt"
    sp.save({"a": torch.ones(2)}, path, metadata={"m": 1.5})
    manifest = path / "shardpoint.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"m":1.5', b'"m":' + number.encode()))
    with _raises(CorruptCheckpointError, f"{manifest} holds the number {number}, which is not finite"):
        sp.load(path)
    assert not verify_checkpoint(path).ok

