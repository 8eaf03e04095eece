"""crc32c (Castagnoli) on hardware, plus combining the crcs of adjacent pieces.

Combining lets several threads checksum different pieces of one tensor and still record
one crc32c per stored tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from types import ModuleType
from typing import cast

from ._options import env_flag
from .errors import CheckpointError

_POLY_REVERSED = 0x82F63B78
_CHECK_INPUT, _CHECK_VALUE = b"123456789", 0xE3069283  # the catalogue's crc32c check value


def _computes_crc32c(crc: Callable[..., int]) -> bool:
    """``crc`` gives the catalogue's check value, whole and continued."""
    return bool(crc(_CHECK_INPUT) == _CHECK_VALUE and crc(_CHECK_INPUT[4:], crc(_CHECK_INPUT[:4])) == _CHECK_VALUE)


def _load_native() -> ModuleType | None:
    """``shardpoint._native`` if it was built and computes crc32c right; else None.

    ``SHARDPOINT_NATIVE=0`` turns it off (shardpoint then runs its Python loops); the same
    variable seeds ``IOOptions.native``, which turns the loops off per call.
    """
    if not env_flag("SHARDPOINT_NATIVE", True):
        return None
    try:
        from . import _native
    except ImportError:  # pragma: no cover - depends on the install
        return None
    if _native.IMPLEMENTATION == "table":  # pragma: no cover - not x86-64: fastcrc is faster there
        return None
    if not _computes_crc32c(_native.crc32c):
        return None  # pragma: no cover - a miscompiled extension
    return cast(ModuleType, _native)


NATIVE = _load_native()
"""The C extension's GIL-free read/write loops (``pread_into``, ``pwrite_from``), or None."""


def _pick_implementation() -> tuple[str, Callable[..., int]]:
    """The fastest crc32c at hand that gives the right answer.

    The C extension and ``fastcrc`` fold with carry-less multiplies (AVX-512 VPCLMULQDQ
    where the CPU has it; the extension also folds 256 bits at a time on AVX2 CPUs with
    VPCLMULQDQ but no AVX-512, ~18 GiB/s in cache on an AMD EPYC): ~80 GB/s on data in cache, so checksumming a segment that was
    just read or is about to be written costs a few percent of moving it. The extension
    also releases the GIL on large buffers. ``crc32c`` (SSE4.2, ~20 GB/s in cache) is the
    last resort.
    """
    if NATIVE is not None:
        return f"shardpoint._native ({NATIVE.IMPLEMENTATION})", NATIVE.crc32c
    try:
        import fastcrc

        fast = fastcrc.crc32.iscsi
        if _computes_crc32c(fast):
            return "fastcrc", fast
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - depends on the install
        pass
    import crc32c as _crc32c

    return "crc32c", _crc32c.crc32c


IMPLEMENTATION, _crc = _pick_implementation()
crc32c_update: Callable[[object, int], int] = _crc
"""The implementation itself, ``crc32c_update(data, crc) -> crc``: no wrapper call in hot loops."""


def crc32c(data: object, value: int = 0) -> int:
    """crc32c (Castagnoli) of a bytes-like object, continuing ``value``."""
    return int(_crc(data, value))


def _gf2_times(matrix: list[int], vec: int) -> int:
    total = 0
    i = 0
    while vec:
        if vec & 1:
            total ^= matrix[i]
        vec >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


@lru_cache(maxsize=256)
def _zeros_operator(length: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a crc over ``length`` zero bytes."""
    op = [1 << n for n in range(32)]  # identity
    square = [_POLY_REVERSED] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        square = _gf2_square(square)  # one zero byte after three squarings
    while length:
        if length & 1:
            op = [_gf2_times(square, v) for v in op]
        length >>= 1
        if length:
            square = _gf2_square(square)
    return tuple(op)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``.

    >>> a, b = b"hello ", b"world"
    >>> crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    True
    """
    if crc_a == 0 or len_b == 0:
        return crc_b if len_b else crc_a
    return _gf2_times(list(_zeros_operator(len_b)), crc_a) ^ crc_b


def combine_runs(runs: list[tuple[int, int, int]], total: int, *, where: str) -> int:
    """crc32c of ``total`` bytes from (start, crc, length) of runs that must tile them exactly."""
    crc = 0
    cursor = 0
    for start, run_crc, length in sorted(runs):
        if start != cursor:
            raise CheckpointError(f"{where}: written byte runs leave a gap or overlap at byte {cursor}")
        crc = crc32c_combine(crc, run_crc, length)
        cursor += length
    if cursor != total:
        raise CheckpointError(f"{where}: written byte runs cover {cursor} of {total} bytes")
    return crc
