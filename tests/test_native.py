"""The C extension: every crc32c path agrees with the reference, and the GIL-free read and
write loops move exactly the bytes asked, report end of file and raise errno errors.

The Python loops that run where the extension is absent are exercised by
``test_loops_round_trip_and_detect_damage[python]`` (and by every fault-injection test, which
turns the extension off so each ``pwrite`` passes through ``os``).
"""

from __future__ import annotations

import errno
import json
import os
import random

import crc32c as reference
import pytest
import torch

import shardpoint as sp
from shardpoint import _checksum
from shardpoint._io import transfer
from shardpoint.errors import ChecksumMismatchError, CorruptCheckpointError

native = _checksum.NATIVE
needs_native = pytest.mark.skipif(native is None, reason="shardpoint._native is not built here")

PATHS = ("table", "sse4.2", "pclmulqdq", "vpclmulqdq")


def _available(path: str) -> bool:
    try:
        native.crc32c_using(path, b"x")
    except ValueError:
        return False
    return True


@needs_native
@pytest.mark.parametrize("path", PATHS)
def test_every_crc_path_matches_the_reference(path):
    if not _available(path):
        pytest.skip(f"this CPU has no {path}")
    rng = random.Random(path)
    data = rng.randbytes(70_000)
    lengths = [*range(600), 1023, 1024, 4096, 65_535, 65_536, 69_000]
    for length in lengths:
        start = rng.randrange(0, 64)  # every alignment of the first load
        piece = memoryview(data)[start : start + length]
        value = rng.getrandbits(32)
        assert native.crc32c_using(path, piece, value) == reference.crc32c(bytes(piece), value), (path, length, start)
    assert native.crc32c_using(path, b"123456789") == 0xE3069283


@needs_native
def test_module_crc_is_the_dispatched_path_and_continues():
    data = random.Random(1).randbytes(3 << 20)
    whole = reference.crc32c(data)
    assert native.crc32c(data) == whole
    cut = 1_234_567
    assert native.crc32c(memoryview(data)[cut:], native.crc32c(memoryview(data)[:cut])) == whole
    with pytest.raises(TypeError):
        native.crc32c("not bytes")


@needs_native
def test_pread_into_reads_exactly_and_reports_the_end_of_file(tmp_path):
    data = random.Random(2).randbytes(1_000_003)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(600_001)
        got, crc = native.pread_into(fd, buf, 17, 65_536, True)
        assert got == 600_001 and bytes(buf) == data[17 : 17 + 600_001]
        assert crc == reference.crc32c(data[17 : 17 + 600_001])
        got, crc = native.pread_into(fd, buf, 17, 65_536, False)
        assert (got, crc) == (600_001, 0)
        # Past the end: fewer bytes than asked, the count says how many.
        got, crc = native.pread_into(fd, buf, len(data) - 10, 4096, True)
        assert got == 10 and crc == reference.crc32c(data[-10:])
        with pytest.raises(ValueError, match="segment"):
            native.pread_into(fd, buf, 0, 0, True)
        with pytest.raises(TypeError):
            native.pread_into(fd, bytes(10), 0, 4096, True)  # not writable
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        native.pread_into(fd, bytearray(10), 0, 4096, True)  # closed
    assert err.value.errno == errno.EBADF


@needs_native
def test_pwrite_from_writes_everything_and_returns_its_crc(tmp_path):
    data = random.Random(3).randbytes(777_777)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        crc = native.pwrite_from(fd, memoryview(data), 100, 65_536)
    finally:
        os.close(fd)
    assert crc == reference.crc32c(data)
    assert path.read_bytes() == b"\0" * 100 + data
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as err:
            native.pwrite_from(fd, b"abc", 0, 4096)
    finally:
        os.close(fd)
    assert err.value.errno == errno.EBADF


def _data_start(directory, key):
    """(file, absolute offset of the first data byte of ``key``)."""
    for f in sorted(directory.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        if key in header:
            return f, 8 + n + header[key]["data_offsets"][0]
    raise AssertionError(f"{key} in no file")


@pytest.mark.parametrize("loops", ["native", "python"])
def test_loops_round_trip_and_detect_damage(tmp_path, monkeypatch, loops):
    if loops == "native" and native is None:
        pytest.skip("shardpoint._native is not built here")
    if loops == "python":
        monkeypatch.setattr(transfer, "_native", None)
    monkeypatch.setenv("SHARDPOINT_IO_SEGMENT_BYTES", "4096")  # many segments per tensor
    gen = torch.Generator().manual_seed(4)
    state = {
        "a": torch.randn(300, 257, generator=gen),
        "b": torch.randint(0, 255, (70_001,), dtype=torch.uint8, generator=gen),
        "c": torch.randn(3, 5, generator=gen).t(),  # non-contiguous
    }
    out = tmp_path / "ckpt"
    sp.save(state, out, max_shard_size="200KB")
    loaded = sp.load(out)
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value)
    # One byte of "a" flipped: the segment loop's crc must catch it.
    f, start = _data_start(out, "a")
    blob = bytearray(f.read_bytes())
    blob[start + 150_000] ^= 0x01
    f.write_bytes(bytes(blob))
    with pytest.raises(ChecksumMismatchError, match=f.name):
        sp.load(out)
    # Cut the file short: named as a truncation, not a crc mismatch or a bare OSError.
    f.write_bytes(bytes(blob[: start + 1000]))
    with pytest.raises(CorruptCheckpointError, match=f.name):
        sp.load(out, verify=False)
