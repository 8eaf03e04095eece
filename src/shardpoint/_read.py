"""The read batch: reads from one checkpoint, planned into destinations, run together.

:class:`ReadBatch` turns "these bytes of this stored tensor go into that memory" into
:class:`~shardpoint._io.plan.ReadTask` s (resharded reads included: ``fill`` reads only
the stored chunks that overlap the destination) and runs them on the I/O pool. ``load`` and
``load_into`` (``_load/``) plan into it; so do the DCP and ``convert`` sources.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from ._checkpoint import Checkpoint
from ._format.dtypes import OutOfRange
from ._format.manifest import TensorRecord
from ._format.safetensors import HeaderEntry
from ._io.reads import ReadTask, run_reads
from ._load.memory import allocate
from ._planning.chunks import byte_runs, intersect
from ._progress import byte_progress, loading_label
from .errors import ChecksumMismatchError, CorruptCheckpointError, StorageError


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as one dimension (a 0-d one as one element), without a copy."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


class ReadBatch:
    """Collects reads from one checkpoint and runs them together on the I/O pool."""

    def __init__(
        self, ckpt: Checkpoint, *, verify: bool, staging_bytes: int | None = None, ranks_here: int = 1,
        warn_casts: bool = True,
    ) -> None:
        self.ckpt = ckpt
        self.warn_casts = warn_casts
        """Whether values a cast pushes past a narrower float's range are warned about here
        (``convert`` counts them itself, naming its destination)."""
        self.verify = verify
        self.staging_bytes = staging_bytes
        self.ranks_here = ranks_here
        """Processes sharing this machine's CPUs, whose share sets the reader threads."""
        self.tasks: list[ReadTask] = []
        self._names: dict[str, str] = {}
        """Data file -> how errors name it."""
        self._files: dict[str, tuple[str, str, int]] = {}
        """Data file -> (its name in errors, its path, its held descriptor): asked once per
        file, not once per tensor."""
        self._copies: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        """(destination, the buffer read for it, the tensor's label): copied (cast) after the reads."""
        self.out_of_range = OutOfRange()
        """Values that casts to a narrower float (float32 to float16) pushed past its range:
        warned about when the batch has run."""

    def fill(
        self,
        record: TensorRecord,
        dest: torch.Tensor,
        label: str,
        offsets: tuple[int, ...] | None = None,
    ) -> None:
        """Read into ``dest`` the part of ``record`` at ``offsets`` (default: all of it).

        ``dest`` may be any region of the global tensor (a rank's shard): only the bytes of
        stored chunks that overlap it are read, each overlap as few contiguous runs as the
        layouts allow. crc32c is checked where a whole stored chunk is read. Every element of
        ``dest`` must be covered, else the checkpoint is incomplete for it.
        """
        if offsets is None:
            offsets = (0,) * dest.dim()
        if dest.numel() == 0:
            return
        record = self.ckpt.resolved(record, offsets, tuple(dest.shape))
        if self._fill_whole(record, dest, label, offsets):
            return
        covered = 0
        for chunk in record.chunks:
            box = intersect(chunk.offsets, chunk.shape, offsets, tuple(dest.shape))
            if box is None:
                continue
            entry = self.ckpt.entry(chunk, record.dtype, label)
            box_offsets, box_shape = box
            covered += math.prod(box_shape)
            view = dest
            for dim, (o, t, n) in enumerate(zip(box_offsets, offsets, box_shape, strict=False)):
                if n != view.shape[dim]:  # narrow: a tenth of the cost of indexing with slices
                    view = view.narrow(dim, o - t, n)
            relative = tuple(o - c for o, c in zip(box_offsets, chunk.offsets, strict=False))
            whole = box_shape == chunk.shape
            if view.is_contiguous():
                # Straight into the destination (a GPU tensor is filled through the
                # bounded staging buffers of run_reads, never a full host copy).
                buffer = view
            else:
                buffer = torch.empty(box_shape, dtype=entry.dtype)
                self._copies.append((view, buffer, label))
            flat = _flat(buffer)
            item = entry.dtype.itemsize
            name, path, fd = self._file(chunk.file)
            crc = chunk.crc32c if (whole and self.verify) else None
            pos = 0
            for start, length in byte_runs(chunk.shape, relative, box_shape, item):
                count = length // item
                part = flat if count == flat.numel() else flat.narrow(0, pos, count)
                self.tasks.append(ReadTask(name, path, entry.start + start, length, part, entry.dtype, crc, label, fd))
                pos += count
        if covered != dest.numel():
            raise CorruptCheckpointError(
                f"{self.ckpt.location}: tensor {label!r}: the stored chunks cover {covered} of the "
                f"{dest.numel()} elements needed at offsets {list(offsets)} (shape {list(dest.shape)}); "
                "the checkpoint is incomplete for this tensor"
            )

    def sub(self) -> ReadBatch:
        """A new, empty batch of reads from the same checkpoint, with the same settings."""
        return ReadBatch(self.ckpt, verify=self.verify, staging_bytes=self.staging_bytes, ranks_here=self.ranks_here,
                         warn_casts=self.warn_casts)

    def _fd(self, file: str) -> int:
        """The checkpoint's held descriptor of ``file`` (-1 on an object store)."""
        return self.ckpt.held_fd(file)

    def _file(self, file: str) -> tuple[str, str, int]:
        """(how errors name data file ``file``, its path, its held descriptor)."""
        info = self._files.get(file)
        if info is None:
            info = self._files[file] = (self._name(file), self.ckpt.file_path(file), self._fd(file))
        return info

    def _name(self, file: str) -> str:
        """How errors name data file ``file`` (worked out once per file)."""
        name = self._names.get(file)
        if name is None:
            name = self._names[file] = (
                self.ckpt.location if self.ckpt.kind == "hf-file" else os.path.join(self.ckpt.location, file)
            )
        return name

    def _fill_whole(
        self, record: TensorRecord, dest: torch.Tensor, label: str, offsets: tuple[int, ...], entry: Any = None
    ) -> bool:
        """The common case of :meth:`fill` without its box arithmetic: the record is one
        chunk, the whole tensor, read whole into a contiguous ``dest``. False otherwise."""
        chunk = record.chunks[0]
        shape = record.shape
        if len(record.chunks) != 1 or chunk.shape != shape or dest.shape != shape:
            return False
        if any(offsets) or any(chunk.offsets) or not dest.is_contiguous():
            return False
        if entry is None:
            entry = self.ckpt.entry(chunk, record.dtype, label)
        name, path, fd = self._file(chunk.file)
        flat = _flat(dest)
        self.tasks.append(
            ReadTask(name, path, entry.start, entry.nbytes, flat, entry.dtype,
                     chunk.crc32c if self.verify else None, label, fd)
        )
        return True

    @property
    def planned_bytes(self) -> int:
        return sum(t.nbytes for t in self.tasks)

    def check(self, record: TensorRecord, label: str) -> int:
        """Check every chunk of ``record`` against its file's header; return the stored bytes.

        Each chunk must be an entry of its file's header (validated against the file's real
        size) with the manifest's dtype and shape, and the manifest gives each (file, key) to
        one chunk only: so the tensors of a load never need more memory than its files hold.
        """
        record = self.ckpt.resolved(record)
        return sum(self.ckpt.entry(chunk, record.dtype, label).nbytes for chunk in record.chunks)

    def new(self, record: TensorRecord, label: str, *, device: torch.device, dtype: torch.dtype | None,
            entry: HeaderEntry | None = None) -> torch.Tensor:
        """A new tensor that will hold ``record`` once the batch has run.

        Every chunk is checked against its file before the tensor is allocated (``entry``:
        the first chunk's header entry, when the caller already checked it).
        """
        record = self.ckpt.resolved(record)
        if entry is None:
            entry = self.ckpt.entry(record.chunks[0], record.dtype, label)
        if len(record.chunks) > 1:
            self.check(record, label)
        stored = entry.dtype
        want = dtype if (dtype is not None and stored.is_floating_point) else stored
        dest = allocate(record.shape, want, device, self.ckpt.location, label)
        chunk = record.chunks[0]
        if entry.nbytes and len(record.chunks) == 1 and chunk.shape == record.shape and not any(chunk.offsets):
            # The whole tensor into memory of its shape just allocated: _fill_whole's case,
            # without its checks (a state of 10^5 small tensors takes this 10^5 times).
            name, path, fd = self._file(chunk.file)
            self.tasks.append(
                ReadTask(name, path, entry.start, entry.nbytes,
                         _flat(dest), entry.dtype,
                         chunk.crc32c if self.verify else None, label, fd)
            )
            return dest
        self.fill(record, dest, label)
        return dest

    def run(self, progress: bool | None, advance: Callable[[int], None] | None = None) -> None:
        """Run the planned reads: a progress bar of their bytes per ``progress``, or, given
        ``advance``, that callback told of each piece read (a bar the caller holds)."""
        if advance is None:
            with byte_progress(sum(t.nbytes for t in self.tasks), loading_label(self.ckpt.location),
                               progress) as bar:
                self._run(bar)
        else:
            self._run(advance)

    def _run(self, advance: Callable[[int], None] | None) -> None:
        with torch.no_grad():
            try:
                run_reads(self.tasks, self.ckpt.byte_source(processes_here=self.ranks_here), advance=advance,
                          staging_bytes=self.staging_bytes, out_of_range=self.out_of_range)
            except ChecksumMismatchError:
                self._refuse_if_replaced()  # not damaged: overwritten under the load
                raise
            self._refuse_if_replaced()
            for dest, temp, label in self._copies:
                if dest.dtype != temp.dtype:
                    self.out_of_range.check(label, temp, dest.dtype)
                dest.copy_(temp)
        self.warn_out_of_range()

    def _refuse_if_replaced(self) -> None:
        """On an object store: refuse values read while another save replaced the objects
        (a mix of two saves, or bytes that fail crc32c though nothing is damaged)."""
        if self.ckpt.store is None or not self.tasks:
            return
        replaced = self.ckpt.replaced_meanwhile(t.path for t in self.tasks)
        if replaced is not None:
            raise StorageError(
                f"{self._name(replaced)} was replaced by another save while this load read it (an object store "
                "holds no snapshot: an overwrite replaces its objects one by one), so what was read may mix the two "
                "saves (a load_into target may hold part of it). Load again, or load a step nothing writes over"
            )

    def warn_out_of_range(self) -> None:
        """Warn of the values a cast pushed past a narrower float's range (they became inf, as
        ``from_pretrained(dtype=torch.float16)`` makes them, but never without a word)."""
        if self.warn_casts:
            self.out_of_range.warn("load as", f"as read from {self.ckpt.location}")
