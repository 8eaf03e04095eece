"""The read engine's staging buffers: where bytes land when they cannot land in their
destination directly (a dtype cast, a GPU destination, a read only checksummed), whatever
the byte source (local files or an object store's ranged GETs)."""

from __future__ import annotations

import threading

import torch

_CPU = torch.device("cpu")


class Staging(threading.local):
    """Each reader thread's staging buffers, allocated on first use and reused.

    Two buffers alternate, so the read into one overlaps the (asynchronous, for a GPU
    destination) copy out of the other; for GPU destinations they are pinned host memory
    and a buffer is reused only after the copy that last read it has finished.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.events: list[object | None] = []
        self.turn = 0

    def take(self, nbytes: int, *, for_device: torch.device = _CPU) -> tuple[int, torch.Tensor]:
        """(slot, a buffer of at least ``nbytes`` bytes) for a copy to ``for_device``."""
        pin = for_device.type == "cuda"
        # Alternating only pays where the copy out is asynchronous (a GPU destination).
        i = self.turn = (self.turn + 1) % 2 if pin else 0
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
            self.events.append(None)
        event = self.events[i]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self.events[i] = None
        buf = self.buffers[i]
        if buf.numel() < nbytes or (pin and not buf.is_pinned()):
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.buffers[i] = buf
        return i, buf

    def copy_out(self, slot: int, buffer: torch.Tensor, dest: torch.Tensor, stored: torch.dtype,
                 start: int, end: int) -> None:
        """Copy bytes ``[start, end)`` of ``dest``'s stored form, staged at the start of
        ``buffer``, into ``dest`` (cast to its dtype; asynchronously to a GPU, the buffer's
        slot then held until that copy has finished)."""
        item = stored.itemsize
        src = buffer[: end - start].view(stored)
        on_gpu = dest.device.type == "cuda"
        dest.view(-1)[start // item : end // item].copy_(src, non_blocking=on_gpu)
        if on_gpu:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dest.device))
            self.events[slot] = event
