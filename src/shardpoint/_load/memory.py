"""Memory for a load: allocation that fails as an :class:`InsufficientMemoryError`, and the
check that refuses, before the first allocation, a load larger than the machine."""

from __future__ import annotations

import contextlib
import math
import os

import torch

from .._checkpoint import Checkpoint
from ..errors import CheckpointError, InsufficientMemoryError


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, location: str,
             label: str) -> torch.Tensor:
    """``torch.empty``, with the allocator's refusal as an :class:`InsufficientMemoryError`."""
    try:
        # (a CPU tensor without the device argument: parsing it costs as much as the rest)
        return torch.empty(shape, dtype=dtype) if device.type == "cpu" else torch.empty(
            shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:
        what = f"{location}, tensor {label!r}"
        if "alloc" not in str(exc).lower() and "memory" not in str(exc).lower():
            raise
        nbytes = math.prod(shape) * dtype.itemsize
        raise InsufficientMemoryError(
            f"{what}: allocating {nbytes} bytes on {device} failed ({str(exc).splitlines()[0][:200]}); "
            "free memory, or load fewer tensors at once (keys=..., mmap=True, or load_into a model "
            "on the meta device with a device_map)"
        ) from None


def memory_limit() -> int | None:
    """Bytes this process could allocate at most: RAM + swap, or its address-space limit."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        limits.append(info.get("MemTotal", 0) + info.get("SwapTotal", 0))
    except (OSError, ValueError, IndexError):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    limits = [x for x in limits if x > 0]
    return min(limits) if limits else None


def check_memory(ckpt: Checkpoint, total: int, files: set[str]) -> None:
    """Refuse, before the first allocation, a load needing more memory than the machine has.

    ``total`` is already bounded by the bytes the files hold (every chunk is a header entry
    inside its file); a sparse file may still declare far more than it occupies on disk.
    """
    limit = memory_limit()
    if limit is None or total <= limit:
        return
    on_disk = ""
    if ckpt.local_files:
        blocks = 0
        for name in files:
            with contextlib.suppress(CheckpointError, OSError):
                blocks += os.fstat(ckpt.fd(name)).st_blocks * 512
        on_disk = f" (its files occupy {blocks} bytes on disk)"
    raise InsufficientMemoryError(
        f"{ckpt.location}: loading it needs {total} bytes of memory for its tensors{on_disk}, more "
        f"than this machine has ({limit} bytes of RAM + swap); nothing was allocated. Load fewer "
        "tensors (keys=...), mmap=True, or load_into a model on the meta device with a device_map"
    )
