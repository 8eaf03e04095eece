"""Every tunable in one place, each overridable by an environment variable.

``SHARDPOINT_WRITE_THREADS=8 python train.py`` changes the writer pool without code changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r} must be a positive integer")
    return value


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Knobs:
    write_threads: int
    """Threads writing data files concurrently (syscalls release the GIL). 0, the default:
    up to 4, but no more than this process's share of the CPUs (``writer_threads``)."""
    read_threads: int
    """Threads reading tensors concurrently on load. 0, the default: twice this process's
    share of the CPUs, at least 2 and at most 4 (``reader_threads``). More than the cores:
    on a cold read each thread waits on the disk, and more requests in flight keep it busy."""
    io_segment_bytes: int
    """Bytes moved per write/read syscall, crc32c computed on each segment while it is in the
    CPU cache (L2), instead of a second pass over memory: just after it was read; for writes,
    just before (segments over 1 MiB) or just after (1 MiB or less, which the kernel's copy
    leaves in L2; see ``_native.pwrite_from``). Writes end their segments on multiples of this in the file, so
    the page cache holds each as one aligned folio of this size: 2 MiB folios are mapped with
    huge pages, and a warm load of files written in 2 MiB segments took 0.17 s against 0.21 s
    for 256 KiB ones (2.14 GB, median of 5; the saves themselves were no slower, within the
    VM's noise). (Large reads gain nothing from bigger syscalls: readahead issues large
    requests anyway.)"""
    collective_segment_bytes: int
    """The same for the writes of a collective save (every rank of a machine writing at
    once). On the 2-core VM, with 2 and 4 ranks, 2 MiB writes (2 MiB folios) landed in its
    slow mode (page cache allocated from memory the VM had already handed back to its host,
    5x the system time) in 3/8 and 6/8 saves against 2/8 with 256 KiB (medians 0.52 /
    1.31 s against 0.35 / 0.40 s for 1.94 GB), and a resumed job's load is cold, where the
    folio size does not matter. With that memory held in the guest (no slow mode), 2 MiB
    was still slower: ``sp.save`` took 1.33x / 1.48x plain's time with 2 / 4 ranks against
    1.23x / 1.29x with 256 KiB (``benchmarks/distributed.py --gb 2 --rounds 5``, one run each)."""
    cached_copy: bool
    """Copy page-cache-resident pieces straight from the mapped cache with non-temporal
    stores and crc32c folded in (the C extension on x86-64 with AVX-512), instead of
    ``pread``; pieces not wholly in the cache are read as usual."""
    direct_reads: bool
    """Read pieces that are not in the page cache with ``O_DIRECT`` (C extension, Linux)
    through a 2 MiB aligned buffer per reader thread, and the cached part of a piece from
    the cache; where the file system refuses ``O_DIRECT``, ``pread``. Off by default. For a
    model larger than the RAM, or a resume read once: no page is allocated for the files and
    none is left behind, and a 2.15 GB cold load in one process took 0.22 CPU-s against
    0.72-0.97 buffered, in the same time (1.20 s against 1.19 s, median of 5, 2-core VM).
    On that VM with its memory handed back to the host, direct was faster (1.06 s against
    1.47 s), but with 4 ranks on its 2 cores slower (1.22 s against 1.00 s: each rank waits
    for a core before its next read, where buffered readahead runs on). And a checkpoint
    loaded twice is read from the disk twice."""
    staging_buffer_bytes: int
    """Size of each reusable staging buffer for dtype casts and device copies on load."""
    max_header_bytes: int
    """Largest safetensors header accepted (the format's own limit is 100 MB)."""
    max_json_bytes: int
    """Largest index or manifest accepted."""
    verify_checksums: bool
    """Check crc32c whenever a whole stored tensor is read."""
    collective_timeout_s: int
    """Seconds a rank waits for the others' reports in a collective save or load phase
    before it gives up on them (a rank that died is noticed at once, not after this)."""
    remote_threads: int
    """Concurrent uploads (one file each) and ranged reads on fsspec URLs (``s3://``...)."""
    remote_block_bytes: int
    """Bytes per upload part on fsspec URLs (s3fs uploads one multipart part per block)."""
    remote_read_bytes: int
    """Bytes per ranged read (one GET) on fsspec URLs."""
    remote_retries: int
    """Retries of a transient remote error (connection reset, 5xx, throttling) before giving up."""
    remote_backoff_ms: int
    """First retry delay; it doubles with each further retry."""


def knobs() -> Knobs:
    """Read the knobs now (environment variables are consulted on every call)."""
    return Knobs(
        write_threads=_env_int("SHARDPOINT_WRITE_THREADS", 0),
        read_threads=_env_int("SHARDPOINT_READ_THREADS", 0),
        io_segment_bytes=_env_int("SHARDPOINT_IO_SEGMENT_BYTES", 2 << 20),
        collective_segment_bytes=_env_int("SHARDPOINT_COLLECTIVE_SEGMENT_BYTES", 256 << 10),
        cached_copy=_env_bool("SHARDPOINT_CACHED_COPY", True),
        direct_reads=_env_bool("SHARDPOINT_DIRECT_READS", False),
        staging_buffer_bytes=_env_int("SHARDPOINT_STAGING_BUFFER_BYTES", 64 << 20),
        max_header_bytes=_env_int("SHARDPOINT_MAX_HEADER_BYTES", 100_000_000),
        max_json_bytes=_env_int("SHARDPOINT_MAX_JSON_BYTES", 256 << 20),
        verify_checksums=_env_bool("SHARDPOINT_VERIFY", True),
        collective_timeout_s=_env_int("SHARDPOINT_COLLECTIVE_TIMEOUT", 1800),
        remote_threads=_env_int("SHARDPOINT_REMOTE_THREADS", 8),
        remote_block_bytes=_env_int("SHARDPOINT_REMOTE_BLOCK_BYTES", 16 << 20),
        remote_read_bytes=_env_int("SHARDPOINT_REMOTE_READ_BYTES", 16 << 20),
        remote_retries=_env_int("SHARDPOINT_REMOTE_RETRIES", 4),
        remote_backoff_ms=_env_int("SHARDPOINT_REMOTE_BACKOFF_MS", 200),
    )
