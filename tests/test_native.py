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


class _CountingNative:
    """The extension with its ``copy_cached`` counted: (calls, pieces it copied)."""

    def __init__(self, module):
        self._module = module
        self.calls = self.copied = 0
        self.prefixes: list[int] = []

    def __getattr__(self, name):
        return getattr(self._module, name)

    def copy_cached(self, fd, buffer, offset):
        self.calls += 1
        done = self._module.copy_cached(fd, buffer, offset)
        self.copied += done[0] == len(buffer)
        self.prefixes.append(done[0])
        return done


@pytest.mark.parametrize("loops", ["cached", "native", "python"])
def test_loops_round_trip_and_detect_damage(tmp_path, monkeypatch, loops):
    if loops != "python" and native is None:
        pytest.skip("shardpoint._native is not built here")
    if loops == "cached" and not native.STREAM_COPY:
        pytest.skip("this CPU has no AVX-512 + VPCLMULQDQ for the mapped copy")
    counting = None
    if loops == "python":
        monkeypatch.setattr(transfer, "_native", None)
    elif loops == "native":
        monkeypatch.setenv("SHARDPOINT_CACHED_COPY", "0")
    else:
        counting = _CountingNative(native)
        monkeypatch.setattr(transfer, "_native", counting)
    monkeypatch.setenv("SHARDPOINT_IO_SEGMENT_BYTES", "4096")  # many segments per tensor
    gen = torch.Generator().manual_seed(4)
    state = {
        "a": torch.randn(300, 257, generator=gen),
        "b": torch.randint(0, 255, (70_001,), dtype=torch.uint8, generator=gen),
        "c": torch.randn(3, 5, generator=gen).t(),  # non-contiguous
        "d": torch.randn(600_001, generator=gen),  # over CACHED_COPY_MIN_BYTES
    }
    out = tmp_path / "ckpt"
    sp.save(state, out, max_shard_size="200KB")
    loaded = sp.load(out)
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value)
    if counting is not None:  # the files were just written, so "d" came from the page cache
        assert counting.copied == counting.calls == 1
    # One byte of "a" and of "d" flipped: the loops' crc must catch each.
    for key, at in (("a", 150_000), ("d", 2_000_001)):
        f, start = _data_start(out, key)
        blob = bytearray(f.read_bytes())
        blob[start + at] ^= 0x01
        f.write_bytes(bytes(blob))
        with pytest.raises(ChecksumMismatchError, match=f"{f.name}.*'{key}'"):
            sp.load(out, keys=[key])
        # Cut the file short: named as a truncation, not a crc mismatch or a bare OSError.
        f.write_bytes(bytes(blob[: start + 1000]))
        with pytest.raises(CorruptCheckpointError, match=f.name):
            sp.load(out, keys=[key], verify=False)


@needs_native
def test_copy_cached_copies_any_alignment_with_its_crc(tmp_path):
    if not native.STREAM_COPY:
        pytest.skip("this CPU has no AVX-512 + VPCLMULQDQ for the mapped copy")
    rng = random.Random(5)
    data = rng.randbytes(3 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = [0, 1, 63, 64, 4095, 4096, 4097]
        lengths = [1, 63, 64, 255, 256, 257, 511, 4096, 65_543]
        cases = [(o, n) for o in offsets for n in lengths]
        cases += [(rng.randrange(1 << 20), rng.randrange(1, 2 << 20)) for _ in range(40)]
        cases.append((0, len(data)))
        for offset, length in cases:
            shift = rng.randrange(128)  # every alignment of the destination
            dest = bytearray(shift + length + 64)
            view = memoryview(dest)[shift : shift + length]
            window = rng.choice([16 << 20, 4096, 65_600, 1000])  # windows chain their crcs
            got = native.copy_cached(fd, view, offset, window)
            expected = data[offset : offset + length]
            assert got == (length, reference.crc32c(expected)), (offset, length, shift, window)
            assert bytes(view) == expected
            assert not any(dest[:shift]) and not any(dest[shift + length :]), "wrote outside"
    finally:
        os.close(fd)


@needs_native
def test_copy_cached_copies_only_what_is_cached_and_the_caller_reads_the_rest(tmp_path, monkeypatch):
    if not native.STREAM_COPY:
        pytest.skip("this CPU has no AVX-512 + VPCLMULQDQ for the mapped copy")
    window = 1 << 20
    data = random.Random(6).randbytes(3 * window + 12_345)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(4096)
        assert native.copy_cached(fd, buf, len(data) - 100) == (0, 0)  # runs past the end
        assert native.copy_cached(fd, bytearray(0), 0) == (0, 0)
        assert native.copy_cached(fd, buf, 0) == (4096, reference.crc32c(data[:4096]))
        os.fsync(fd)  # clean pages can be evicted
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        fresh = bytearray(4096)
        assert native.copy_cached(fd, fresh, 0) == (0, 0), "pages not in the cache: read them"
        assert fresh == bytearray(4096), "declined, yet it wrote"
        # Cached up to a point: a prefix of whole windows comes from the cache.
        os.pread(fd, len(data), 0)
        os.posix_fadvise(fd, 2 * window + 4096, 0, os.POSIX_FADV_DONTNEED)
        whole = bytearray(len(data) - 100)
        got, crc = native.copy_cached(fd, whole, 100, window)
        assert got == 2 * window and crc == reference.crc32c(data[100 : 100 + got])
        assert whole[:got] == data[100 : 100 + got] and not any(whole[got:])
        with pytest.raises(ValueError, match="offset"):
            native.copy_cached(fd, buf, -1)
        with pytest.raises(TypeError):
            native.copy_cached(fd, bytes(10), 0)  # not writable
    finally:
        os.close(fd)
    read_end, write_end = os.pipe()
    try:
        assert native.copy_cached(read_end, bytearray(10), 0) == (0, 0)  # not a regular file
    finally:
        os.close(read_end)
        os.close(write_end)
    # Through a load: the cached prefix and the read rest make one tensor and one crc.
    window = 16 << 20  # the default
    tensor = torch.randn(3 * window // 4 + 1001, generator=torch.Generator().manual_seed(7))
    out = tmp_path / "ckpt"
    sp.save({"t": tensor}, out)
    (f,) = out.glob("*.safetensors")
    _, start = _data_start(out, "t")
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, start + window + 8192, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    counting = _CountingNative(native)
    monkeypatch.setattr(transfer, "_native", counting)
    assert torch.equal(sp.load(out)["t"], tensor)
    # Partly cached (whole windows up to the evicted range), and the crc still checked.
    assert counting.calls == 1 and 0 < counting.prefixes[0] < tensor.numel() * 4


def test_write_segments_end_on_multiples_of_the_segment_in_the_file(monkeypatch):
    """Aligned writes let the page cache keep large folios (see _knobs.io_segment_bytes)."""
    calls = []
    monkeypatch.setattr(transfer, "_pwrite_all", lambda fd, chunk, at: calls.append((at, len(chunk))))
    data = memoryview(random.Random(8).randbytes(10_000))
    crc = transfer._write_segments(-1, data, 100, 4096)
    assert calls == [(100, 3996), (4096, 4096), (8192, 1908)]
    assert crc == reference.crc32c(bytes(data))
