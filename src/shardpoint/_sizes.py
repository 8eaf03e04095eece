"""Human sizes: parse ``"5GB"`` / ``"5GiB"`` and print ``1.23 GB``."""

from __future__ import annotations

import re
from fractions import Fraction

from .errors import InvalidSizeError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Parse a byte size: an int, or a string like ``"5GB"`` (10^9) or ``"5GiB"`` (2^30).

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size(1000)
    (5000000000, 2097152, 1000)
    """
    if isinstance(size, bool):
        raise InvalidSizeError(f"size {size!r} is a bool; pass an int of bytes or a string like '5GB'")
    if isinstance(size, int):
        if size <= 0:
            raise InvalidSizeError(f"size {size!r} must be a positive number of bytes")
        return _at_most_max(size, size)
    if not isinstance(size, str):
        raise InvalidSizeError(
            f"size {size!r} has type {type(size).__name__}; pass an int of bytes or a string like '5GB'"
        )
    match = _SIZE_RE.match(size)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidSizeError(
            f"cannot parse size {size!r}; use an int of bytes or a number followed by one of "
            "B, kB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. '5GB'"
        )
    value = int(Fraction(match.group(1)) * _UNITS[unit])  # exact: no float rounding or overflow
    if value <= 0:
        raise InvalidSizeError(f"size {size!r} must be at least one byte")
    return _at_most_max(value, size)


MAX_SIZE = 2**63 - 1
"""The largest size a file (``off_t``) can have."""


def _at_most_max(value: int, given: object) -> int:
    if value > MAX_SIZE:
        shown = given if not isinstance(given, (int, str)) or len(str(given)) <= 40 else f"{str(given)[:40]}..."
        raise InvalidSizeError(f"size {shown!r} is larger than any file can be ({MAX_SIZE} bytes); pass a smaller one")
    return value


def human_size(nbytes: float) -> str:
    """Format bytes with decimal units, as disks and the HF hub do.

    >>> human_size(0), human_size(1234), human_size(5_000_000_000)
    ('0 B', '1.23 kB', '5.00 GB')
    """
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
