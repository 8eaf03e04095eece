"""Typed tunables: :class:`IOOptions`, :class:`RemoteOptions`, :class:`CollectiveOptions`.

A call takes them as ``options=`` (``sp.save(sd, path, options=sp.IOOptions(write_threads=2))``);
a block of code takes them from :func:`using`::

    with sp.using(io=sp.IOOptions(read_threads=2)):
        sp.load(path)

A field left unset takes its default. ``SHARDPOINT_*`` environment variables seed those
defaults (``SHARDPOINT_WRITE_THREADS=8 python train.py`` still works); they are read once,
on first use, and never again. Everything below the public calls reads the options in
effect with :func:`current_options`: the ones of the innermost ``options=`` / ``using``,
else the defaults. Threads shardpoint starts for a call run under the caller's options
(:func:`adopt` is their pools' initializer).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from .errors import InvalidArgumentError, InvalidArgumentTypeError

# ------------------------------------------------------------------ environment seeds

_ENV: dict[tuple[str, str], str] = {
    ("io", "write_threads"): "SHARDPOINT_WRITE_THREADS",
    ("io", "read_threads"): "SHARDPOINT_READ_THREADS",
    ("io", "segment_bytes"): "SHARDPOINT_IO_SEGMENT_BYTES",
    ("io", "staging_buffer_bytes"): "SHARDPOINT_STAGING_BUFFER_BYTES",
    ("io", "piece_bytes"): "SHARDPOINT_IO_PIECE_BYTES",
    ("io", "verify_checksums"): "SHARDPOINT_VERIFY",
    ("io", "native"): "SHARDPOINT_NATIVE",
    ("io", "cached_copy"): "SHARDPOINT_CACHED_COPY",
    ("io", "direct_reads"): "SHARDPOINT_DIRECT_READS",
    ("io", "max_header_bytes"): "SHARDPOINT_MAX_HEADER_BYTES",
    ("io", "max_json_bytes"): "SHARDPOINT_MAX_JSON_BYTES",
    ("remote", "threads"): "SHARDPOINT_REMOTE_THREADS",
    ("remote", "block_bytes"): "SHARDPOINT_REMOTE_BLOCK_BYTES",
    ("remote", "read_bytes"): "SHARDPOINT_REMOTE_READ_BYTES",
    ("remote", "retries"): "SHARDPOINT_REMOTE_RETRIES",
    ("remote", "backoff_ms"): "SHARDPOINT_REMOTE_BACKOFF_MS",
    ("remote", "timeout_s"): "SHARDPOINT_REMOTE_TIMEOUT",
    ("collective", "timeout_s"): "SHARDPOINT_COLLECTIVE_TIMEOUT",
    ("collective", "segment_bytes"): "SHARDPOINT_COLLECTIVE_SEGMENT_BYTES",
}
"""The environment variable that seeds each (group, field)'s default."""

_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name`` (``0``/``false``/``no``/``off`` are false)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() not in _FALSE


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"environment variable {name}={raw!r} is not an integer; set it to a whole number "
            "or unset it (or pass the option in code instead)"
        ) from None


_seeds: dict[tuple[str, str], int | bool] | None = None
_seeds_lock = threading.Lock()


def _read_environment() -> dict[tuple[str, str], int | bool]:
    seeds: dict[tuple[str, str], int | bool] = {}
    for (group, name), var in _ENV.items():
        if (group, name) in _BOOL_FIELDS:
            if os.environ.get(var, "").strip():
                seeds[group, name] = env_flag(var, True)
        else:
            value = _env_int(var)
            if value is not None:
                seeds[group, name] = value
    return seeds


def _seed(group: str, name: str, default: int | bool) -> Any:
    """The default of ``group.name``: its environment variable's value (read once, on the
    first call) or ``default``."""
    global _seeds
    if _seeds is None:
        with _seeds_lock:
            if _seeds is None:
                _seeds = _read_environment()
    return _seeds.get((group, name), default)


def _seeded(group: str, name: str, default: int | bool) -> Any:
    return field(default_factory=lambda: _seed(group, name, default))


_BOOL_FIELDS = {
    ("io", "verify_checksums"),
    ("io", "native"),
    ("io", "cached_copy"),
    ("io", "direct_reads"),
}


_MAXIMUM = 1 << 48
"""Above any sensible count, size (256 TiB) or time: larger values overflowed in C later."""


def _check(options: object, group: str, minimum: dict[str, int]) -> None:
    """Type- and range-check every field of ``options``, naming its environment variable
    when the value came from there."""
    for f in fields(options):  # type: ignore[arg-type]
        value = getattr(options, f.name)
        where = f"{type(options).__name__}.{f.name}"
        var = _ENV.get((group, f.name))
        seeded = (_seeds or {}).get((group, f.name))
        source = f" (environment variable {var})" if var and seeded is not None and seeded == value else ""
        if (group, f.name) in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise InvalidArgumentTypeError(f"{where}{source} must be True or False, not {value!r}")
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgumentTypeError(f"{where}{source} must be an int, not {value!r}")
        low = minimum.get(f.name, 1)
        if value < low:
            rule = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise InvalidArgumentError(f"{where}{source} must be {rule}, not {value!r}")
        if value > _MAXIMUM:
            raise InvalidArgumentError(f"{where}{source} must be at most 2**48, not {value!r}")


# ------------------------------------------------------------------ the option groups


class _Checked:
    """Checks every field of an option group when it is built (see :func:`_check`)."""

    _group: ClassVar[str]
    """The group's name in ``_ENV``."""
    _minimum: ClassVar[dict[str, int]]
    """Fields that may go below 1, and their least value."""

    def __init_subclass__(cls, *, group: str, minimum: dict[str, int] | None = None) -> None:
        super().__init_subclass__()
        cls._group, cls._minimum = group, minimum or {}

    def __post_init__(self) -> None:
        _check(self, self._group, self._minimum)


@dataclass(frozen=True)
class IOOptions(_Checked, group="io", minimum={"write_threads": 0, "read_threads": 0}):
    """How shardpoint moves bytes between memory and local files.

    Every field's default can be seeded by the environment variable named in its doc.

    Example:
        >>> import shardpoint as sp
        >>> sp.IOOptions(read_threads=2).read_threads
        2
    """

    write_threads: int = _seeded("io", "write_threads", 0)
    """Threads writing data files concurrently (``SHARDPOINT_WRITE_THREADS``). 0, the
    default: up to 4, but no more than this process's share of the CPUs."""
    read_threads: int = _seeded("io", "read_threads", 0)
    """Threads reading tensors concurrently on load (``SHARDPOINT_READ_THREADS``). 0, the
    default: this process's share of the CPUs (at least 2) when the bytes are mostly in the
    page cache, four times that (at most 8, but never fewer than the share, nor than 2)
    when they must come from the disk."""
    segment_bytes: int = _seeded("io", "segment_bytes", 2 << 20)
    """Bytes moved per write/read syscall, crc32c computed on each segment while it is in
    the CPU cache (``SHARDPOINT_IO_SEGMENT_BYTES``, 2 MiB). Writes end their segments on
    multiples of this in the file, so the page cache holds each as one aligned folio."""
    piece_bytes: int = _seeded("io", "piece_bytes", 64 << 20)
    """Largest part of one tensor that one thread reads or writes in one go: a larger tensor
    is cut into pieces the threads share, their crc32c combined (``SHARDPOINT_IO_PIECE_BYTES``,
    64 MiB; 16 MiB pieces balanced the threads no better and made cold reads ~15 % slower)."""
    staging_buffer_bytes: int = _seeded("io", "staging_buffer_bytes", 64 << 20)
    """Size of each reusable staging buffer for dtype casts and device copies on load
    (``SHARDPOINT_STAGING_BUFFER_BYTES``, 64 MiB); ``load(max_buffer_bytes=)`` wins."""
    verify_checksums: bool = _seeded("io", "verify_checksums", True)
    """Check crc32c whenever a whole stored tensor is read (``SHARDPOINT_VERIFY``, on);
    ``load(verify=)`` wins."""
    native: bool = _seeded("io", "native", True)
    """Run the C extension's GIL-free read/write loops where it is built
    (``SHARDPOINT_NATIVE``, on); off: the Python loops. ``SHARDPOINT_NATIVE=0`` also keeps
    the extension from being imported at all."""
    cached_copy: bool = _seeded("io", "cached_copy", True)
    """Copy page-cache-resident pieces of 1 MiB or more with non-temporal stores and crc32c
    folded in (C extension, x86-64 with VPCLMULQDQ: AVX-512, or AVX2 for checked reads):
    mapped where the page cache maps them huge, else through a per-thread buffer in the CPU
    cache; off: ``pread`` (``SHARDPOINT_CACHED_COPY``, on)."""
    direct_reads: bool = _seeded("io", "direct_reads", False)
    """Read pieces that are not in the page cache with ``O_DIRECT`` (C extension, Linux)
    through a 2 MiB aligned buffer per reader thread (``SHARDPOINT_DIRECT_READS``, off):
    for a model larger than the RAM, or a resume read once, no page cache is left behind."""
    max_header_bytes: int = _seeded("io", "max_header_bytes", 100_000_000)
    """Largest safetensors header accepted (``SHARDPOINT_MAX_HEADER_BYTES``; the format's
    own limit, 100 MB)."""
    max_json_bytes: int = _seeded("io", "max_json_bytes", 256 << 20)
    """Largest index or manifest accepted (``SHARDPOINT_MAX_JSON_BYTES``, 256 MiB)."""



@dataclass(frozen=True)
class RemoteOptions(_Checked, group="remote", minimum={"retries": 0, "backoff_ms": 0}):
    """How shardpoint talks to an object store through fsspec (``s3://``, ``gs://``...).

    Example:
        >>> import shardpoint as sp
        >>> sp.RemoteOptions(retries=2).retries
        2
    """

    threads: int = _seeded("remote", "threads", 8)
    """Concurrent uploads (one file each) and ranged reads (``SHARDPOINT_REMOTE_THREADS``, 8)."""
    block_bytes: int = _seeded("remote", "block_bytes", 16 << 20)
    """Bytes per upload part (``SHARDPOINT_REMOTE_BLOCK_BYTES``, 16 MiB; S3's smallest is 5 MiB)."""
    read_bytes: int = _seeded("remote", "read_bytes", 16 << 20)
    """Bytes per ranged read, one GET each (``SHARDPOINT_REMOTE_READ_BYTES``, 16 MiB)."""
    retries: int = _seeded("remote", "retries", 4)
    """Retries of a transient error (connection reset, 5xx, throttling) before giving up
    (``SHARDPOINT_REMOTE_RETRIES``, 4; 0: none)."""
    backoff_ms: int = _seeded("remote", "backoff_ms", 200)
    """First retry delay in milliseconds; it doubles with each further retry
    (``SHARDPOINT_REMOTE_BACKOFF_MS``, 200)."""
    timeout_s: int = _seeded("remote", "timeout_s", 30)
    """Seconds an S3 request may wait to connect, or wait for the next bytes of its answer,
    before it counts as failed and is retried (``SHARDPOINT_REMOTE_TIMEOUT``, 30). An
    endpoint that accepts connections but never answers fails a call in about
    ``(retries + 1) * timeout_s``. Applied where ``storage_options`` leave botocore's
    ``connect_timeout`` / ``read_timeout`` unset; the client's own retries are then off, so
    that ``retries`` counts every attempt."""



@dataclass(frozen=True)
class CollectiveOptions(_Checked, group="collective"):
    """How the ranks of a collective save or load work together.

    Example:
        >>> import shardpoint as sp
        >>> with sp.using(collective=sp.CollectiveOptions(timeout_s=60)):
        ...     sp.current_options().collective.timeout_s
        60
    """

    timeout_s: int = _seeded("collective", "timeout_s", 1800)
    """Seconds a rank waits for the others' reports in a collective phase before it gives
    up on them (``SHARDPOINT_COLLECTIVE_TIMEOUT``, 1800); a rank that died is noticed at
    once, not after this."""
    segment_bytes: int = _seeded("collective", "segment_bytes", 256 << 10)
    """Bytes per write syscall in a collective save, every rank of a machine writing at
    once (``SHARDPOINT_COLLECTIVE_SEGMENT_BYTES``, 256 KiB)."""



@dataclass(frozen=True)
class Options:
    """The three option groups together; what :func:`current_options` returns.

    Example:
        >>> import shardpoint as sp
        >>> sp.Options(io=sp.IOOptions(write_threads=1)).io.write_threads
        1
    """

    io: IOOptions = field(default_factory=IOOptions)
    remote: RemoteOptions = field(default_factory=RemoteOptions)
    collective: CollectiveOptions = field(default_factory=CollectiveOptions)

    def __post_init__(self) -> None:
        for name, kind in (("io", IOOptions), ("remote", RemoteOptions), ("collective", CollectiveOptions)):
            if not isinstance(getattr(self, name), kind):
                raise InvalidArgumentTypeError(
                    f"Options.{name} must be a shardpoint.{kind.__name__}, not {getattr(self, name)!r}"
                )


OptionsArg = Options | IOOptions | RemoteOptions | CollectiveOptions | Iterable[Any] | None
"""What ``options=`` accepts: an :class:`Options`, one group, several groups, or None."""

# ------------------------------------------------------------------ the options in effect

_in_effect: ContextVar[Options | None] = ContextVar("shardpoint_options", default=None)
_defaults: Options | None = None


def defaults() -> Options:
    """The defaults: literal, or seeded by the environment (read once, on the first call)."""
    global _defaults
    if _defaults is None:
        _defaults = Options()
    return _defaults


def current_options() -> Options:
    """The options in effect here: the innermost ``options=`` / :func:`using`, else
    :func:`defaults`.

    Example:
        >>> import shardpoint as sp
        >>> with sp.using(sp.IOOptions(read_threads=3)):
        ...     sp.current_options().io.read_threads
        3
    """
    return _in_effect.get() or defaults()


def merged(options: OptionsArg) -> Options:
    """``options`` laid over the options in effect: a group given replaces that group."""
    return _laid(current_options(), options)


def _laid(base: Options, options: OptionsArg) -> Options:
    if options is None:
        return base
    if isinstance(options, (Options, IOOptions, RemoteOptions, CollectiveOptions)):
        items: list[Any] = [options]
    elif isinstance(options, Iterable) and not isinstance(options, (str, bytes)):
        items = list(options)
    else:
        items = [options]
    for part in items:
        if isinstance(part, Options):
            base = part
        elif isinstance(part, IOOptions):
            base = replace(base, io=part)
        elif isinstance(part, RemoteOptions):
            base = replace(base, remote=part)
        elif isinstance(part, CollectiveOptions):
            base = replace(base, collective=part)
        else:
            raise InvalidArgumentTypeError(
                "options= takes a shardpoint.Options, IOOptions, RemoteOptions or CollectiveOptions "
                f"(or a list of them), not {part!r}"
            )
    return base


@contextlib.contextmanager
def using(
    options: OptionsArg = None,
    *,
    io: IOOptions | None = None,
    remote: RemoteOptions | None = None,
    collective: CollectiveOptions | None = None,
) -> Iterator[Options]:
    """Run a block with these options in effect (for every shardpoint call in it, on this
    thread and the threads shardpoint starts for it); yields the options in effect.

    Args:
        options: an :class:`Options`, one group, or a list of groups.
        io, remote, collective: a group each (laid over ``options``).

    Example:
        >>> import shardpoint as sp
        >>> with sp.using(remote=sp.RemoteOptions(retries=0)) as opts:
        ...     opts.remote.retries
        0
    """
    chosen = _laid(merged(options), [part for part in (io, remote, collective) if part is not None])
    token = _in_effect.set(chosen)
    try:
        yield chosen
    finally:
        _in_effect.reset(token)


def applied(options: OptionsArg) -> contextlib.AbstractContextManager[Options]:
    """``using(options)`` for an entry point's ``options=`` argument (nothing when None)."""
    if options is None:
        return contextlib.nullcontext(current_options())
    return using(options)


def adopt(options: Options) -> None:
    """Put ``options`` in effect on this thread (each thread the I/O runner starts, the async
    executor's), so that the threads of a call run under the options of the call."""
    _in_effect.set(options)
