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
from shardpoint._io import files, reads
from shardpoint.errors import ChecksumMismatchError, CorruptCheckpointError

native = _checksum.NATIVE
needs_native = pytest.mark.skipif(native is None, reason="shardpoint._native is not built here")

PATHS = ("table", "sse4.2", "pclmulqdq", "vpclmulqdq-256", "vpclmulqdq")


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
@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "disk"])
def test_checked_pread_into_gives_the_bytes_and_crc_at_any_alignment_and_segment(tmp_path, cached):
    """A checked read goes through the thread's bounce buffer where the folding copy exists
    (256 KiB at a time, whatever segment is asked): the bytes and the crc32c are the file's,
    for every destination alignment and for ranges that end mid-buffer or past the file."""
    rng = random.Random(9)
    data = rng.randbytes((3 << 20) + 12_345)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for segment in (4096, 256 << 10, 2 << 20, 8 << 20):
            for _ in range(6):
                offset = rng.randrange(len(data) // 2)
                length = rng.randrange(1, len(data) - offset + 5000)  # may run past the end
                shift = rng.randrange(128)
                dest = bytearray(shift + length + 64)
                if not cached:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                got, crc = native.pread_into(fd, memoryview(dest)[shift : shift + length], offset, segment, True)
                expected = data[offset : offset + length]
                assert (got, crc) == (len(expected), reference.crc32c(expected)), (segment, offset, length)
                assert dest[shift : shift + got] == expected
                assert not any(dest[:shift]) and not any(dest[shift + got :]), "wrote outside what it read"
    finally:
        os.close(fd)


@needs_native
@pytest.mark.parametrize("segment", [65_536, 1 << 20, 2 << 20])  # crc after / after / before the write
def test_pwrite_from_writes_everything_and_returns_its_crc(tmp_path, segment):
    data = random.Random(3).randbytes(3_333_333)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        crc = native.pwrite_from(fd, memoryview(data), 100, segment)
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
    """The extension with its ``copy_cached`` counted: (calls, pieces it copied), and its
    ``pread_direct`` calls counted (bytes each read), or failing with ``direct_errno``;
    ``used`` names every other function of it that was looked up."""

    def __init__(self, module, direct_errno=None):
        self._module = module
        self.used: set[str] = set()
        self.calls = self.copied = 0
        self.prefixes: list[int] = []
        self.direct: list[int] = []
        self.direct_errno = direct_errno
        self.preads: list[tuple[int, bool]] = []  # (bytes read, checked) of each pread_into

    def pread_into(self, fd, buffer, offset, segment, check):
        self.used.add("pread_into")
        done = self._module.pread_into(fd, buffer, offset, segment, check)
        self.preads.append((done[0], bool(check)))
        return done

    def pread_direct(self, fd, buffer, offset, bounce, check):
        if self.direct_errno is not None:
            self.direct.append(0)
            raise OSError(self.direct_errno, os.strerror(self.direct_errno))
        done = self._module.pread_direct(fd, buffer, offset, bounce, check)
        self.direct.append(done[0])
        return done

    def __getattr__(self, name):
        if not name.isupper():  # functions, not constants such as STREAM_COPY
            self.used.add(name)
        return getattr(self._module, name)

    def copy_cached(self, fd, buffer, offset):
        self.calls += 1
        done = self._module.copy_cached(fd, buffer, offset)
        self.copied += done[0] == len(buffer)
        self.prefixes.append(done[0])
        return done


@needs_native
def test_an_unchecked_load_reads_what_is_not_cached_through_the_bounce_buffer(tmp_path, monkeypatch, use_options):
    """verify=False: the cached part of a piece is one plain pread, the part the page cache
    does not hold goes through the checked read's bounce buffer (faster from the disk), and
    the tensor is whole either way."""
    if not native.STREAM_COPY:
        pytest.skip("this CPU has no VPCLMULQDQ for the folding copy")
    counting = _CountingNative(native)
    monkeypatch.setattr(files, "_native", counting)
    use_options(io=sp.IOOptions(cached_copy=False))  # reads by pread only, cached or not
    t = torch.randn(3 << 20, generator=torch.Generator().manual_seed(11))  # 12 MiB: one piece
    sp.save({"t": t}, tmp_path / "ck")
    path = tmp_path / "ck" / "model.safetensors"
    size = path.stat().st_size
    evicted_from = (size // 2 + 4095) // 4096 * 4096  # DONTNEED drops the whole pages only
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, size // 2, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    out = sp.load(tmp_path / "ck", verify=False)
    assert torch.equal(out["t"], t)
    checked = sum(n for n, check in counting.preads if check)
    plain = sum(n for n, check in counting.preads if not check)
    assert checked + plain == t.nbytes
    # The cached half went plain; the evicted half bounced, less what readahead brought back
    # into the cache before its own piece came up.
    data_start = size - t.nbytes
    assert plain >= evicted_from - data_start and checked > 0, (plain, checked)


@pytest.mark.parametrize("loops", ["cached", "native", "python"])
def test_loops_round_trip_and_detect_damage(tmp_path, monkeypatch, use_options, loops):
    if loops != "python" and native is None:
        pytest.skip("shardpoint._native is not built here")
    if loops == "cached" and not native.STREAM_COPY:
        pytest.skip("this CPU has no VPCLMULQDQ for the mapped copy")
    counting = _CountingNative(native) if native is not None else None
    if counting is not None:
        monkeypatch.setattr(files, "_native", counting)  # counts the extension's calls
    use_options(io=sp.IOOptions(
        native=loops != "python",
        cached_copy=loops == "cached",
        segment_bytes=4096,  # many segments per tensor
    ))
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
    if loops == "cached":  # the files were just written, so "d" came from the page cache
        assert counting.copied == counting.calls == 1
    elif loops == "native":  # IOOptions(cached_copy=False): the extension's pread, no mapped copy
        assert counting.calls == 0 and {"pread_into", "pwrite_from"} <= counting.used, counting.used
    elif counting is not None:  # IOOptions(native=False): the Python loops, the extension unused
        assert counting.calls == 0 and counting.used == set(), counting.used
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
@pytest.mark.parametrize("mapped", [None, True, False], ids=["as-the-cache-maps", "mapped", "bounced"])
def test_copy_cached_copies_any_alignment_with_its_crc(tmp_path, mapped):
    """Both ways of copying a cached window (mapped, or pread through the thread's bounce
    buffer), and the choice between them by how the page cache maps it, give the same bytes
    and crc32c at every alignment of file, length and destination."""
    if not native.STREAM_COPY:
        pytest.skip("this CPU has no VPCLMULQDQ for the mapped copy")
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
            got = native.copy_cached(fd, view, offset, window, mapped)
            expected = data[offset : offset + length]
            assert got == (length, reference.crc32c(expected)), (offset, length, shift, window, mapped)
            assert bytes(view) == expected
            assert not any(dest[:shift]) and not any(dest[shift + length :]), "wrote outside"
    finally:
        os.close(fd)


@needs_native
def test_copy_cached_works_in_a_forked_child(tmp_path):
    """The extension keeps /proc/self/pagemap open to see how windows are mapped; a forked
    child must not scan its parent's page tables through it (nor hang on it): it copies the
    same bytes and crc."""
    if not native.STREAM_COPY:
        pytest.skip("this CPU has no VPCLMULQDQ for the mapped copy")
    data = random.Random(8).randbytes(6 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = (len(data), reference.crc32c(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert native.copy_cached(fd, bytearray(len(data)), 0) == expected  # the parent's scan
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit code
            out = bytearray(len(data))
            os._exit(0 if native.copy_cached(fd, out, 0) == expected and out == data else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)


@needs_native
def test_copy_cached_copies_only_what_is_cached_and_the_caller_reads_the_rest(tmp_path, monkeypatch):
    if not native.STREAM_COPY:
        pytest.skip("this CPU has no VPCLMULQDQ for the mapped copy")
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
    monkeypatch.setattr(files, "_native", counting)
    with sp.using(io=sp.IOOptions(read_threads=1)):  # one thread: the tensor is one piece
        assert torch.equal(sp.load(out)["t"], tensor)
    # Partly cached (whole windows up to the evicted range), and the crc still checked.
    assert counting.calls == 1 and 0 < counting.prefixes[0] < tensor.numel() * 4


@pytest.mark.parametrize(
    ("size", "segment", "expected"),
    [
        (10_000, 4096, [(100, 3996), (4096, 4096), (8192, 1908)]),  # crc after each write
        (5_000_000, 2 << 20, [(100, 2_097_052), (2_097_152, 2_097_152), (4_194_304, 805_796)]),
    ],
)
def test_write_segments_end_on_multiples_of_the_segment_in_the_file(monkeypatch, size, segment, expected):
    """Aligned writes let the page cache keep large folios (see IOOptions.segment_bytes)."""
    calls = []
    monkeypatch.setattr(files, "_pwrite_all", lambda fd, chunk, at: calls.append((at, len(chunk))))
    data = memoryview(random.Random(8).randbytes(size))
    crc = files._write_segments(-1, data, 100, segment)
    assert calls == expected
    assert crc == reference.crc32c(bytes(data))


def _direct_fd(path):
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError) as exc:
        pytest.skip(f"the file system under {path} refuses O_DIRECT here: {exc}")


def _evict(path):
    """Drop ``path`` from the page cache (clean pages only, hence the fsync), as after a reboot;
    skip where the file system keeps them (tmpfs: its page cache is the storage)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if native is not None and native.cached_prefix(fd, 0, os.fstat(fd).st_size) > 0:
            pytest.skip(f"the file system under {path} keeps its pages in memory")
    finally:
        os.close(fd)


@needs_native
def test_pread_direct_reads_any_alignment_and_reports_the_end_of_file(tmp_path):
    import mmap

    rng = random.Random(8)
    data = rng.randbytes((3 << 20) + 4321)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = _direct_fd(path)
    try:
        small = memoryview(mmap.mmap(-1, 4096))  # one block per request: many requests
        large = memoryview(mmap.mmap(-1, 1 << 20))
        offsets = [0, 1, 511, 512, 4095, 4096, 4097]
        lengths = [1, 511, 4096, 4097, 65_543, (1 << 20) + 3]
        cases = [(o, n) for o in offsets for n in lengths]
        cases += [(rng.randrange(len(data)), rng.randrange(1, 2 << 20)) for _ in range(30)]
        cases.append((0, len(data)))
        for offset, length in cases:
            shift = rng.randrange(128)  # the destination at every alignment
            dest = bytearray(shift + length + 64)
            view = memoryview(dest)[shift : shift + length]
            bounce = rng.choice([small, large])
            got, crc = native.pread_direct(fd, view, offset, bounce, True)
            expected = data[offset : offset + length]  # shorter past the end of the file
            assert got == len(expected) and crc == reference.crc32c(expected), (offset, length, shift)
            assert bytes(view[:got]) == expected
            assert not any(dest[:shift]) and not any(dest[shift + got :]), "wrote outside"
        assert native.pread_direct(fd, bytearray(10), 5, large, False) == (10, 0)
        assert native.pread_direct(fd, bytearray(10), len(data) + 5, large, True) == (0, 0)
        for bad in (small[1:], memoryview(bytearray(0)), large[:1000]):
            with pytest.raises(ValueError, match="multiples of 4096"):
                native.pread_direct(fd, bytearray(10), 0, bad, True)
        with pytest.raises(ValueError, match="offset"):
            native.pread_direct(fd, bytearray(10), -1, large, True)
        with pytest.raises(TypeError):
            native.pread_direct(fd, bytes(10), 0, large, True)  # not writable
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        native.pread_direct(fd, bytearray(10), 0, large, True)  # closed
    assert err.value.errno == errno.EBADF


@needs_native
@pytest.mark.parametrize("cached_copy", ["1", "0"])
def test_cold_loads_go_past_the_page_cache_and_still_check_every_byte(
    tmp_path, monkeypatch, use_options, cached_copy
):
    """A file not in the page cache is read with O_DIRECT (found cold by the mapped copy, or
    where that is off by a non-blocking probe); a cached one never is; damage is caught."""
    use_options(io=sp.IOOptions(cached_copy=cached_copy == "1", direct_reads=True))
    gen = torch.Generator().manual_seed(9)
    state = {"big": torch.randn(3_000_001, generator=gen), "small": torch.randn(1000, generator=gen)}
    out = tmp_path / "ckpt"
    sp.save(state, out)
    (f,) = out.glob("*.safetensors")
    _direct_fd(f)  # skips where O_DIRECT is refused
    counting = _CountingNative(native)
    monkeypatch.setattr(files, "_native", counting)

    loaded = sp.load(out)  # just written: in the page cache
    assert torch.equal(loaded["big"], state["big"]) and counting.direct == []

    _evict(f)
    loaded = sp.load(out)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])
    # The mapped copy (or the probe) copies what reading the header pulled into the cache
    # (readahead: a few pages, seen 16 KiB) from it; the rest, and no more, comes via O_DIRECT.
    direct = sum(counting.direct)  # one call per piece the threads shared
    assert 3_000_001 * 4 - (1 << 20) < direct <= 3_000_001 * 4, "the cold tensor came through O_DIRECT"

    counting.direct.clear()
    _evict(f)
    off = sp.IOOptions(cached_copy=cached_copy == "1", direct_reads=False)
    assert torch.equal(sp.load(out, options=off)["big"], state["big"]) and counting.direct == []

    _, start = _data_start(out, "big")
    blob = bytearray(f.read_bytes())
    blob[start + 7_777_777] ^= 0x10
    f.write_bytes(bytes(blob))
    _evict(f)
    with pytest.raises(ChecksumMismatchError, match=f"{f.name}.*'big'"):
        sp.load(out, keys=["big"])
    f.write_bytes(bytes(blob[: start + (5 << 20) + 3]))
    _evict(f)
    with pytest.raises(CorruptCheckpointError, match=f"{f.name} is {start + (5 << 20) + 3} bytes"):
        sp.load(out, keys=["big"], verify=False)


@needs_native
def test_cached_prefix_counts_resident_bytes_up_to_the_first_page_that_is_not(tmp_path):
    page = os.sysconf("SC_PAGESIZE")
    path = tmp_path / "f.bin"
    path.write_bytes(random.Random(11).randbytes(40 * page + 123))
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.path.getsize(path)
        assert native.cached_prefix(fd, 0, size) == 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly the pages read
        os.pread(fd, 3 * page, 2 * page)  # pages 2, 3, 4
        assert native.cached_prefix(fd, 2 * page, size - 2 * page) == 3 * page
        assert native.cached_prefix(fd, 2 * page + 100, size) == 0  # runs past the end
        assert native.cached_prefix(fd, 2 * page + 100, 10 * page) == 3 * page - 100
        assert native.cached_prefix(fd, 3 * page, 5) == 5
        assert native.cached_prefix(fd, 0, 10 * page) == 0
        assert native.cached_prefix(fd, 5, 0) == 0
        with pytest.raises(ValueError, match="offset"):
            native.cached_prefix(fd, -1, 5)
    finally:
        os.close(fd)


@needs_native
def test_a_file_system_refusing_direct_reads_is_read_through_the_page_cache(tmp_path, monkeypatch, use_options):
    tensor = torch.randn(5_000_000, generator=torch.Generator().manual_seed(10))  # 20 MB: one piece
    out = tmp_path / "ckpt"
    sp.save({"t": tensor}, out)
    (f,) = out.glob("*.safetensors")
    _evict(f)
    refusing = _CountingNative(native, direct_errno=errno.EINVAL)
    monkeypatch.setattr(files, "_native", refusing)
    use_options(io=sp.IOOptions(read_threads=1, direct_reads=True, piece_bytes=4 << 20))  # 5 pieces of the one file
    assert torch.equal(sp.load(out)["t"], tensor)
    assert refusing.direct == [0], "refused once, then that file is read as usual"
    # Any other error is the disk's: it is raised, naming the file.
    _evict(f)
    monkeypatch.setattr(files, "_native", _CountingNative(native, direct_errno=errno.EIO))
    with pytest.raises(OSError, match=f.name) as err:
        sp.load(out)
    assert err.value.errno == errno.EIO


@needs_native
def test_reads_run_fewer_threads_over_cached_bytes_and_more_over_the_disk(tmp_path, use_options, monkeypatch):
    from shardpoint._io import threads as io_threads
    from shardpoint._io.plan import ReadTask

    use_options(io=sp.IOOptions(read_threads=0))  # follow the CPUs, whatever the environment seeds
    monkeypatch.setattr(io_threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(io_threads, "cpu_count", lambda: 2)  # a 2-core machine
    data = random.Random(9).randbytes(8 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    tasks = [
        ReadTask("f.bin", str(path), start, 1 << 20, None, torch.uint8, None, f"t{start}")
        for start in range(0, len(data), 1 << 20)
    ]
    cold, cached = 8, 2  # four times the cores waiting on the disk; the cores copying from the cache
    source = files.LocalFiles()
    try:
        os.pread(source.fd(tasks[0]), len(data), 0)
        probes = []
        probe = source._cached_prefix
        assert probe is not None
        source._cached_prefix = lambda *args: probes.append(args) or probe(*args)
        assert source.threads(tasks) == cached
        assert len(probes) == 4  # it stops probing once half the sample is found cached
        assert not source.tapered()  # page-cache copies keep whole pieces
        fd = source.fd(tasks[0])
        os.fsync(fd)  # clean pages can be evicted
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert source.threads(tasks) == cold
        assert source.tapered()  # reads that wait on the disk taper towards the end
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only what is read gets cached
        os.pread(fd, 3 << 20, 0)  # 3 of the 8 sampled tasks cached: still mostly on the disk
        assert source.threads(tasks) == cold
        os.pread(fd, 1 << 20, 5 << 20)  # now 4 of 8: half, read as cached
        assert source.threads(tasks) == cached
    finally:
        source.close()
    # A thread count given: used as it is, and the pieces still follow where the bytes are.
    fixed = files.LocalFiles(threads=3)
    try:
        fd = fixed.fd(tasks[0])
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert fixed.threads(tasks) == 3 and fixed.tapered()
        os.pread(fd, len(data), 0)
        assert fixed.threads(tasks) == 3 and not fixed.tapered()
    finally:
        fixed.close()
    # A file that cannot be opened: counted as on the disk; the reads report it, by name.
    missing = [task._replace(path=str(tmp_path / "gone.bin"), name="gone.bin") for task in tasks]
    gone = files.LocalFiles()
    try:
        assert gone.threads(missing) == cold
    finally:
        gone.close()
    with pytest.raises(sp.StorageError, match=r"gone\.bin: reading the file failed"):
        reads.run_reads(missing)
    assert files.LocalFiles(threads=3).threads(tasks) == 3  # a count given wins
    use_options(io=sp.IOOptions(read_threads=5))
    assert files.LocalFiles().threads(tasks) == 5  # as does the option
