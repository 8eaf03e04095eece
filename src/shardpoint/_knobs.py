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
    """Threads writing data files concurrently (syscalls release the GIL)."""
    read_threads: int
    """Threads reading tensors concurrently on load."""
    io_segment_bytes: int
    """Bytes moved per write/read syscall; crc32c runs on each segment while it is in cache."""
    staging_buffer_bytes: int
    """Size of each reusable staging buffer for dtype casts and device copies on load."""
    max_header_bytes: int
    """Largest safetensors header accepted (the format's own limit is 100 MB)."""
    max_json_bytes: int
    """Largest index or manifest accepted."""
    verify_checksums: bool
    """Check crc32c whenever a whole stored tensor is read."""


def knobs() -> Knobs:
    """Read the knobs now (environment variables are consulted on every call)."""
    return Knobs(
        write_threads=_env_int("SHARDPOINT_WRITE_THREADS", 4),
        read_threads=_env_int("SHARDPOINT_READ_THREADS", 2),
        io_segment_bytes=_env_int("SHARDPOINT_IO_SEGMENT_BYTES", 8 << 20),
        staging_buffer_bytes=_env_int("SHARDPOINT_STAGING_BUFFER_BYTES", 64 << 20),
        max_header_bytes=_env_int("SHARDPOINT_MAX_HEADER_BYTES", 100_000_000),
        max_json_bytes=_env_int("SHARDPOINT_MAX_JSON_BYTES", 256 << 20),
        verify_checksums=_env_bool("SHARDPOINT_VERIFY", True),
    )
