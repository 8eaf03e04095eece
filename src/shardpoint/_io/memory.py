"""Fresh host memory for tensors that a load is about to fill.

A load into new tensors (``sp.load``, ``meta`` parameters materialized by ``load_into``)
touches every page of memory the process has never used: with 4 KiB pages the kernel
faults and zeroes each one, which costs as much as reading the bytes from the page cache.
Asking for transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux; a no-op elsewhere or
where the kernel says no) makes that first touch about 3x cheaper.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - unusual libc
        _madvise = None


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask for huge pages under the 2 MiB-aligned interior of a large CPU tensor's memory."""
    if _madvise is None or tensor.device.type != "cpu":
        return
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < 2 * _HUGE:
        return
    start = tensor.data_ptr()
    first = (start + _HUGE - 1) // _HUGE * _HUGE
    last = (start + nbytes) // _HUGE * _HUGE
    if last > first:
        _madvise(first, last - first, _MADV_HUGEPAGE)  # advice only: failure changes nothing


def empty_for_read(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for a tensor whose every byte a read will write."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor
