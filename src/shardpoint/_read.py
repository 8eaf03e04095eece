"""Reading: plan which bytes go where (in place, or into new tensors), then read in one batch.

``load_into`` walks the target alongside the saved tree in a planning pass that touches no
data, so ``strict=True`` can refuse a mismatch before a single byte of the target changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import mmap as _mmap
import os
import re
import socket
from collections import Counter
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _module_fit
from ._checkpoint import Checkpoint
from ._distributed.group import Group, local_chunk, resolve_group
from ._flatten import WRAPPER_TYPES, tree_tensor_names, unflatten_state
from ._format.manifest import ComponentRecord, TensorRecord
from ._format.safetensors import HeaderEntry
from ._gc import collector_paused
from ._hub import resolve_hub
from ._io.files import LocalFiles
from ._io.reads import ByteSource, ObjectRanges, ReadTask, run_reads
from ._io.threads import reader_threads
from ._options import OptionsArg, applied, current_options
from ._planning.chunks import byte_runs, intersect
from ._prepare import storage_key
from ._progress import byte_progress
from ._read_pickled import PickledBatch, load_pickled, route
from ._sizes import parse_size
from ._source import OPEN_TRIES, open_checkpoint
from ._stateful import Stateful, find_modules, optimizer_state_for, parameter_names
from ._tensor_source import SourceSpec
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidSizeError,
    InvalidStateError,
    LoadMismatchError,
    StorageError,
)


@dataclass(frozen=True)
class LoadResult:
    """What ``load_into`` found, as ``transformers`` reports a load."""

    missing_keys: list[str] = field(default_factory=list)
    """In the target but not in the checkpoint (left untouched)."""
    unexpected_keys: list[str] = field(default_factory=list)
    """In the checkpoint but not in the target (not read)."""
    mismatched_keys: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """(name, saved shape, target shape) for keys whose shapes differ (not read)."""
    bytes_read: int = 0
    """Bytes read from the checkpoint's files by this process."""
    meta_keys: list[str] = field(default_factory=list)
    """Parameters and buffers still on the ``meta`` device after the load (a model that
    cannot run): missing from the checkpoint, or non-persistent buffers the module's own
    initialization could not rebuild. Those a ``device_map`` sends to ``"meta"`` are not
    listed."""
    prefix_mapping: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Module path (``""`` for the whole target) -> ``(checkpoint prefix, target prefix)``
    where the keys matched only after a rename, as ``from_pretrained`` does: ``("",
    "model.")`` loaded the checkpoint's ``norm.weight`` into ``model.norm.weight`` (a base
    model's checkpoint into a model with a head), ``("model.", "")`` the other way."""

    @property
    def ok(self) -> bool:
        """True when every key matched and no tensor is left on ``meta``."""
        return not (self.missing_keys or self.unexpected_keys or self.mismatched_keys or self.meta_keys)

    def summary(self) -> str:
        """The report in a few lines (what ``strict=True`` raises with, minus the advice).

        Example:
            >>> import shardpoint as sp
            >>> print(sp.LoadResult(missing_keys=["w"], prefix_mapping={"": ("", "model.")}).summary())
            keys renamed to match: checkpoint '<name>' -> target 'model.<name>'
            missing from the checkpoint: 'w'
        """
        return "\n".join(_report_lines(self))


class ReadBatch:
    """Collects reads from one checkpoint and runs them together on the I/O pool."""

    def __init__(
        self, ckpt: Checkpoint, *, verify: bool, staging_bytes: int | None = None, threads: int | None = None
    ) -> None:
        self.ckpt = ckpt
        self.verify = verify
        self.staging_bytes = staging_bytes
        self.threads = threads
        """Reader threads (default: ``reader_threads()``)."""
        self.tasks: list[ReadTask] = []
        self._names: dict[str, str] = {}
        """Data file -> how errors name it."""
        self._files: dict[str, tuple[str, str, int]] = {}
        """Data file -> (its name in errors, its path, its held descriptor): asked once per
        file, not once per tensor."""
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

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
            view = dest[tuple(slice(o - t, o - t + n) for o, t, n in zip(box_offsets, offsets, box_shape, strict=False))]
            relative = tuple(o - c for o, c in zip(box_offsets, chunk.offsets, strict=False))
            whole = box_shape == chunk.shape
            if view.is_contiguous():
                # Straight into the destination (a GPU tensor is filled through the
                # bounded staging buffers of run_reads, never a full host copy).
                buffer = view
            else:
                buffer = torch.empty(box_shape, dtype=entry.dtype)
                self._copies.append((view, buffer))
            flat = buffer.view(-1) if buffer.dim() else buffer.view(1)
            item = entry.dtype.itemsize
            name = self.ckpt.location if self.ckpt.kind == "hf-file" else os.path.join(self.ckpt.location, chunk.file)
            path = self.ckpt.file_path(chunk.file)
            fd = self._fd(chunk.file)
            pos = 0
            for start, length in byte_runs(chunk.shape, relative, box_shape, item):
                count = length // item
                self.tasks.append(
                    ReadTask(
                        name=name,
                        path=path,
                        start=entry.start + start,
                        nbytes=length,
                        dest=flat[pos : pos + count],
                        stored_dtype=entry.dtype,
                        crc32c=chunk.crc32c if (whole and self.verify) else None,
                        label=label,
                        fd=fd,
                    )
                )
                pos += count
        if covered != dest.numel():
            raise CorruptCheckpointError(
                f"{self.ckpt.location}: tensor {label!r}: the stored chunks cover {covered} of the "
                f"{dest.numel()} elements needed at offsets {list(offsets)} (shape {list(dest.shape)}); "
                "the checkpoint is incomplete for this tensor"
            )

    def _fd(self, file: str) -> int:
        """The checkpoint's held descriptor of ``file`` (-1 on an object store)."""
        return self.ckpt.fd(file) if self.ckpt.store is None else -1

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
        flat = dest if len(shape) == 1 else dest.view(-1) if shape else dest.view(1)
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
        return sum(self.ckpt.entry(chunk, record.dtype, label).nbytes for chunk in record.chunks)

    def new(self, record: TensorRecord, label: str, *, device: torch.device, dtype: torch.dtype | None,
            entry: HeaderEntry | None = None) -> torch.Tensor:
        """A new tensor that will hold ``record`` once the batch has run.

        Every chunk is checked against its file before the tensor is allocated (``entry``:
        the first chunk's header entry, when the caller already checked it).
        """
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
                         dest if dest.dim() == 1 else dest.view(-1) if dest.dim() else dest.view(1), entry.dtype,
                         chunk.crc32c if self.verify else None, label, fd)
            )
            return dest
        self.fill(record, dest, label)
        return dest

    def run(self, progress: bool | None) -> None:
        total = sum(t.nbytes for t in self.tasks)
        desc = f"loading {os.path.basename(os.path.normpath(self.ckpt.location))}"
        with torch.no_grad(), byte_progress(total, desc, progress) as advance:
            # The byte source: an object store's ranged GETs (its own thread count,
            # ``RemoteOptions.threads``), or the local files.
            source: ByteSource
            if self.ckpt.store is not None:
                source, threads = ObjectRanges(self.ckpt.store), None
            else:
                source, threads = LocalFiles(), self.threads
            run_reads(self.tasks, source, threads=threads, advance=advance, staging_bytes=self.staging_bytes)
            for dest, temp in self._copies:
                dest.copy_(temp)


def _buffer_size(value: int | str | None) -> int | None:
    if value is None:
        return None
    size = parse_size(value)
    if size < 4096:
        raise InvalidSizeError(f"max_buffer_bytes={value!r} is too small; use at least 4 KiB, e.g. '16MiB'")
    return size


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
    if ckpt.store is None:
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


def resolve_verify(verify: bool | None) -> bool:
    return current_options().io.verify_checksums if verify is None else verify


# ---------------------------------------------------------------------------------- load


def _mmap_tensor(ckpt: Checkpoint, record: TensorRecord, label: str, maps: dict[str, Any]) -> torch.Tensor:
    chunk = record.chunks[0]
    if len(record.chunks) != 1 or chunk.shape != record.shape:
        raise InvalidArgumentError(
            f"{ckpt.location}: tensor {label!r} is chunked (saved in pieces by several ranks); "
            "mmap=True needs whole tensors: load it with mmap=False"
        )
    entry = ckpt.entry(chunk, record.dtype, label)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    mm = maps.get(chunk.file)
    if mm is None:
        # Mapped from the descriptor the checkpoint holds: the version that was opened.
        mm = maps[chunk.file] = _mmap.mmap(ckpt.fd(chunk.file), 0, access=_mmap.ACCESS_COPY)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=entry.nbytes, offset=entry.start)
    return flat.view(entry.dtype).reshape(entry.shape)


def _selection(ckpt: Checkpoint, keys: Sequence[str] | None) -> dict[str, list[str] | None]:
    """Which tensors of which components to read: component -> names (None = all)."""
    if keys is None:
        return {c: None for c in ckpt.components}
    wanted = [keys] if isinstance(keys, str) else list(keys)
    if ckpt.flat:
        comp = ckpt.components["model"]
        unknown = [k for k in wanted if k not in comp.tensors and k not in comp.aliases]
        if unknown:
            raise InvalidArgumentError(
                f"{ckpt.location} has no tensor named {', '.join(map(repr, unknown[:10]))}"
                + (f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else "")
                + "; `shardpoint inspect` lists the names"
            )
        return {"model": wanted}
    unknown = [k for k in wanted if k not in ckpt.components]
    if unknown:
        raise InvalidArgumentError(
            f"{ckpt.location} has no component named {', '.join(map(repr, unknown))}; "
            f"it has {', '.join(map(repr, ckpt.components))}"
        )
    return {k: None for k in wanted}


def load(
    path: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    mmap: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    verify: bool | None = None,
    allow_pickle: bool = False,
    max_buffer_bytes: int | str | None = None,
    options: OptionsArg = None,
) -> Any:
    """Load a checkpoint as a new state: a flat state dict, or the nested state saved.

    Reads shardpoint checkpoints, HF safetensors directories (index or single file),
    single ``.safetensors`` files, and HF ``.bin`` weights (``pytorch_model.bin``, sharded
    or not, or one ``.bin`` / ``.pt`` file: ``torch.load(weights_only=True, mmap=True)``, a
    batch at a time). Each tensor is read straight into freshly allocated
    memory (no mmap residency, no second copy); crc32c is checked unless ``verify=False``.
    In a nested state, modules, optimizers and ``Stateful`` objects come back as their
    state dicts (optimizer state keyed by parameter name).

    Args:
        path: checkpoint directory or ``.safetensors`` file (local HF ``.bin`` weights too), or an fsspec URL of either
            (``s3://bucket/run/step-100``): only the byte ranges needed are read, concurrently;
            or ``hf://org/name[@revision][/subfolder]``: a repository in the local Hugging Face
            cache, never downloaded (``storage_options={"cache_dir": ...}`` names another cache).
        keys: tensor names to read (flat checkpoints) or components (nested ones).
        device: where the tensors go (read through a bounded staging buffer if not CPU).
        dtype: cast floating-point tensors to this dtype while reading.
        mmap: return CPU tensors backed by the files' pages (zero-copy, lazy; not verified).
        storage_options: options of the URL's fsspec filesystem (see :func:`shardpoint.save`).
        progress: show a progress bar (default: when stderr is a terminal).
        verify: check crc32c (default: ``IOOptions.verify_checksums``, on).
        allow_pickle: unpickle values that were saved with ``allow_pickle=True``.
        max_buffer_bytes: size of each reader thread's reusable staging buffer, used only
            where bytes cannot land in the destination directly (a dtype cast, a GPU);
            e.g. ``"16MiB"``. Default: ``IOOptions.staging_buffer_bytes`` (64 MiB).
        options: tunables for this call (:class:`IOOptions`, :class:`RemoteOptions`, ...;
            see :func:`shardpoint.save`).

    Returns:
        ``dict[str, Tensor]`` for a flat checkpoint; the nested state otherwise.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, ChecksumMismatchError, UnsafePickleError.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = sp.save({"w": torch.arange(4.0)}, d)
        >>> sp.load(d)["w"].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    with applied(options):
        path, storage_options = resolve_hub(path, storage_options)
        path, pickled = route(path)
        if pickled is not None:
            if mmap:
                raise InvalidArgumentError(
                    f"{os.fspath(path)} holds .bin (torch.save) weights; mmap=True needs safetensors: "
                    "load it with mmap=False, or convert it first (shardpoint convert)"
                )
            return load_pickled(path, pickled, keys=keys, device=torch.device(device), dtype=dtype)
        with collector_paused(), open_checkpoint(path, storage_options) as ckpt:
            return _load(ckpt, keys, device, dtype, mmap, progress, verify, allow_pickle, max_buffer_bytes)


def _load(
    ckpt: Checkpoint,
    keys: Sequence[str] | None,
    device: str | torch.device,
    dtype: torch.dtype | None,
    mmap: bool,
    progress: bool | None,
    verify: bool | None,
    allow_pickle: bool,
    max_buffer_bytes: int | str | None,
) -> Any:
    if mmap and ckpt.store is not None:
        raise InvalidArgumentError(f"{ckpt.location}: mmap=True needs local files; load it with mmap=False")
    device = torch.device(device)
    batch = ReadBatch(ckpt, verify=resolve_verify(verify) and not mmap, staging_bytes=_buffer_size(max_buffer_bytes))
    maps: dict[str, Any] = {}
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    selection = _selection(ckpt, keys)
    # Every chunk to read is checked against its file before the first allocation.
    total = 0
    files: set[str] = set()
    entries: dict[str, HeaderEntry] = {}
    """Stored name -> the header entry of a tensor stored in one chunk (checked once)."""
    entry_of = ckpt.entry
    for cname, names in selection.items():
        comp = ckpt.components[cname]
        stored_names = dict.fromkeys(comp.aliases.get(n, n) for n in (list(comp.tensors) if names is None else names))
        for stored in stored_names:
            record = comp.tensors[stored]
            if len(record.chunks) == 1:
                chunk = record.chunks[0]
                entry = entries[stored] = entry_of(chunk, record.dtype, stored)
                total += entry.nbytes
                files.add(chunk.file)
            else:
                total += batch.check(record, stored)
                files.update(c.file for c in record.chunks)
    if not mmap and device.type == "cpu":
        check_memory(ckpt, total, files)
    for cname, names in selection.items():
        comp = ckpt.components[cname]
        wanted = list(comp.tensors) if names is None else names
        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            stored = comp.aliases.get(name, name)
            if stored in out:
                continue
            record = comp.tensors[stored]
            if mmap:
                t = _mmap_tensor(ckpt, record, stored, maps)
                if device.type != "cpu" or (dtype is not None and t.is_floating_point()):
                    t = t.to(device=device, dtype=dtype if t.is_floating_point() else None)
                out[stored] = t
            else:
                out[stored] = batch.new(record, stored, device=device, dtype=dtype, entry=entries.get(stored))
        for alias, stored in comp.aliases.items():
            if stored in out:
                out[alias] = out[stored]
        loaded[cname] = out
    batch.run(progress)

    result: dict[str, Any] = {}
    for cname, names in selection.items():
        out = loaded[cname]
        if names is not None:
            result[cname] = {k: out[k] for k in names}
        else:
            comp = ckpt.components[cname]
            where = f"{ckpt.location}, component {cname!r}"
            result[cname] = unflatten_state(comp.tree, out, where=where, allow_pickle=allow_pickle)
    return result["model"] if ckpt.flat else result


# ----------------------------------------------------------------------------- load_into


def identities(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Keys under which two tensors are the same memory: the same object, or the same view
    of the same storage (looked up in sets and dicts: a model of thousands of tensors must
    not compare every pair)."""
    key = storage_key(tensor)
    return (id(tensor),) if key is None else (id(tensor), key)


def identity_table(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, ...]]:
    """:func:`identities` of every tensor of ``tensors``, by key. A plain tensor whose
    first element's address no other tensor of ``tensors`` shares cannot be the same memory
    as any of them: it is known by its ``id`` alone, without :func:`identities`' per-tensor
    work (a flat state of 10^5 small tensors is 10^5 such)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    address = {k: t.data_ptr() if type(t) in plain else 0 for k, t in tensors.items()}
    shared = Counter(address.values())
    return {
        k: (id(t),) if (a := address[k]) and shared[a] == 1 else identities(t)
        for k, t in tensors.items()
    }


def _assign(module: torch.nn.Module, name: str, value: torch.Tensor) -> bool:
    """Replace parameter/buffer ``name`` of ``module`` by ``value``; False if not found."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        return False
    if leaf in owner._parameters:
        owner._parameters[leaf] = value  # type: ignore[assignment]
        return True
    if leaf in owner._buffers:
        owner._buffers[leaf] = value
        return True
    return False


def _item_setter(
    container: MutableMapping[Any, Any] | MutableSequence[Any], key: Any
) -> Callable[[Any], None]:
    """A callback that stores its argument as ``container[key]``."""

    def store(value: Any) -> None:
        container.__setitem__(key, value)

    return store


def _placement(
    key: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None,
    device_map: Mapping[str, Any], keep_fp32: re.Pattern[str] | None = None,
) -> tuple[torch.device, torch.dtype]:
    """Device and dtype for materializing meta tensor ``key``: the longest matching
    ``device_map`` prefix (module names, as Accelerate's), else ``device``; ``dtype`` for a
    floating-point tensor (float32 where ``keep_fp32`` matches the key), else its own."""
    best = -1
    for prefix, target in device_map.items():
        if (prefix == "" or key == prefix or key.startswith(prefix + ".")) and len(prefix) > best:
            best, device = len(prefix), torch.device(target)
    want = tensor.dtype
    if dtype is not None and tensor.dtype.is_floating_point:
        want = torch.float32 if keep_fp32 is not None and keep_fp32.search(key) else dtype
    return device, want


@dataclass
class _ModuleLoad:
    """What the planner knows about the module it is filling."""

    module: torch.nn.Module
    empty: bool
    """Some parameter or buffer was on ``meta``: its buffers go where ``device=`` /
    ``device_map`` say, like its parameters (an empty model has no other placement)."""
    keep_fp32: re.Pattern[str] | None = None
    declared_ties: dict[str, str] = field(default_factory=dict)
    """Target key -> the key it is tied to, as the model declares (``transformers``'
    ``all_tied_weights_keys``): one absent from the checkpoint gets its twin's tensor."""
    materialized: set[str] = field(default_factory=set)
    """Keys given a new tensor by this load (meta ones among them)."""


class _Planner:
    """Walks a target beside the saved trees; records reads, report entries and fix-ups."""

    def __init__(self, location: str, batch: ReadBatch | PickledBatch, *, allow_pickle: bool) -> None:
        self.location = location
        self.batch = batch
        self.allow_pickle = allow_pickle
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.meta_left: list[str] = []
        self.prefix_mapping: dict[str, tuple[str, str]] = {}
        self.post: list[Callable[[], None]] = []
        self.param_names: dict[int, str] = {}
        self.device: torch.device = torch.device("cpu")
        self.dtype: torch.dtype | None = None
        self.device_map: dict[str, Any] = {}

    def placement(self, key: str, tensor: torch.Tensor, keep_fp32: re.Pattern[str] | None = None
                  ) -> tuple[torch.device, torch.dtype]:
        return _placement(key, tensor, self.device, self.dtype, self.device_map, keep_fp32)

    # A subtree read into new tensors, turned into a value after the batch ran.
    def build(self, comp: ComponentRecord, node: dict[str, Any], apply: Callable[[Any], None], path: str) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for name in tree_tensor_names(node):
            stored = comp.aliases.get(name, name)
            if stored not in tensors:
                tensors[stored] = self.batch.new(comp.tensors[stored], stored, device=torch.device("cpu"), dtype=None)
            tensors[name] = tensors[stored]
        where = f"{self.location}, {path}"
        allow = self.allow_pickle
        self.post.append(lambda: _apply_saved(apply, unflatten_state(node, tensors, where=where, allow_pickle=allow), where))

    def _new_home(self, key: str, tensor: torch.Tensor, fit: _ModuleLoad | None
                  ) -> tuple[torch.device, torch.dtype] | None:
        """Where a target tensor must be replaced by a new one (device, dtype), or None to
        fill it in place: a meta tensor; a floating-point one of another dtype than
        ``dtype=`` asks; a buffer of an empty model away from its placement."""
        if fit is None and not tensor.is_meta:
            return None  # a plain dict's tensor: filled where it is (asked per tensor: no placement)
        device, want = self.placement(key, tensor, fit.keep_fp32 if fit else None)
        if tensor.is_meta:
            return device, want
        if fit is None or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return None  # a plain dict's tensor or a DTensor: filled where it is
        if not (fit.empty and not isinstance(tensor, torch.nn.Parameter)) or device.type == "meta":
            device = tensor.device
        if device == tensor.device and want == tensor.dtype:
            return None
        return device, want

    def tensors_into(self, targets: Mapping[str, torch.Tensor], names: Mapping[str, str],
                     comp: ComponentRecord, prefix: str, module: torch.nn.Module | None,
                     fit: _ModuleLoad | None = None, saved_names: Mapping[str, str] | None = None) -> None:
        """Fill target tensors in place; ``names`` maps a target key to its saved tensor name.

        ``saved_names`` (saved tensor name -> the key it has in the checkpoint's tree) names
        the unexpected keys when ``names`` was renamed; by default they are ``names``' keys.
        """
        matched = []
        for key, tensor in targets.items():
            saved = names.get(key)
            if saved is None:
                continue
            record = comp.tensors[comp.aliases.get(saved, saved)]
            if tensor.shape != record.shape:
                self.mismatched.append((prefix + key, record.shape, tuple(tensor.shape)))
            else:
                matched.append(key)
        first_with: dict[Any, str] = {}
        ids = identity_table(targets)  # asked again below: once each
        for m in matched:
            for ident in ids[m]:
                first_with.setdefault(ident, m)
        tied: dict[str, str] = {}  # target key absent from the checkpoint -> matched key it is tied to
        to_tie: list[str] = []  # tied by the model's declaration only: made to share the twin's tensor
        is_matched = set(matched)
        for key in targets:
            if key in names:
                continue
            twin = next((first_with[i] for i in ids[key] if i in first_with), None)
            declared = (fit.declared_ties if fit is not None else {}).get(key)
            if twin is None and declared in is_matched and targets[key].shape == targets[declared].shape:
                twin = declared  # e.g. built by accelerate.init_empty_weights, which unties them
                to_tie.append(key)
            if twin is None:
                self.missing.append(prefix + key)
            else:
                tied[key] = twin
        for key in to_tie:
            if fit is not None and self._new_home(tied[key], targets[tied[key]], fit) is None:
                self._assign_later(fit.module, key, targets[tied[key]])
                fit.materialized.add(key)
        if saved_names is None:
            self.unexpected.extend(prefix + k for k in names if k not in targets)
        else:
            used = set(names.values())
            self.unexpected.extend(prefix + tree_key for saved, tree_key in saved_names.items() if saved not in used)

        filled: set[Any] = set()
        materialized: dict[int, torch.Tensor] = {}
        for key in matched:
            tensor = targets[key]
            saved = names[key]
            stored = comp.aliases.get(saved, saved)
            record = comp.tensors[stored]
            home = self._new_home(key, tensor, fit)
            if home is not None:
                if module is None:
                    raise InvalidStateError(
                        f"target tensor {prefix + key!r} is on the meta device; pass the module itself"
                    )
                value = materialized.get(id(tensor))
                if value is None:
                    device, dtype = home
                    if device.type == "meta":
                        continue  # the device map keeps it off this process
                    if isinstance(self.batch, ReadBatch):
                        self.batch.check(record, stored)  # every chunk against its file, before allocating
                    new = allocate(tuple(tensor.shape), dtype, device, self.location, stored)
                    self.batch.fill(record, new, stored)
                    if isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
                        # A real parameter keeps its identity (optimizers, hooks): new data only.
                        self.post.append(functools.partial(setattr, tensor, "data", new))
                        value = tensor
                    elif isinstance(tensor, torch.nn.Parameter):
                        value = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
                    else:
                        value = new
                    materialized[id(tensor)] = value
                for k in [key, *(t for t, twin in tied.items() if twin == key)]:
                    if fit is not None:
                        fit.materialized.add(k)
                    if targets[k] is value:
                        continue  # the same object, given its new data above

                    def put(m: torch.nn.Module = module, k: str = k, v: torch.Tensor = value) -> None:
                        if not _assign(m, k, v):
                            m.load_state_dict({k: v}, strict=False, assign=True)

                    self.post.append(put)
                continue
            idents = ids[key]
            if any(i in filled for i in idents):
                continue  # tied to a tensor already being filled
            filled.update(idents)
            if type(tensor).__name__ == "DTensor":
                _global_shape, offsets, local = local_chunk(tensor)
                self.batch.fill(record, local.detach(), stored, offsets)
            else:
                self.batch.fill(record, tensor.detach(), stored)

    def module_into(self, target: torch.nn.Module, saved: Mapping[str, str], comp: ComponentRecord, path: str) -> None:
        """Fill a module from a saved state dict (its keys -> saved tensor names): keys
        renamed by a base-model prefix where that matches more, meta tensors materialized,
        non-persistent buffers rebuilt, and whatever stays on ``meta`` reported."""
        prefix = f"{path}/" if path else ""
        targets = target.state_dict(keep_vars=True)
        everything = _module_fit.module_tensors(target)
        fit = _ModuleLoad(
            target,
            empty=any(t.device.type == "meta" for t in everything.values()),
            keep_fp32=_module_fit.keep_fp32_pattern(target, self.dtype),
            declared_ties=_module_fit.declared_ties(target),
        )
        base = getattr(target, "base_model_prefix", None)
        rename = _module_fit.match_prefix(targets, saved, base if isinstance(base, str) else None)
        by_target = _module_fit.rename_keys(targets, saved, rename)
        if targets and saved and not by_target:
            raise LoadMismatchError(_no_match_message(self.location, path, list(targets), list(saved)))
        if rename is not None:
            self.prefix_mapping[path] = rename
        names = {k: saved[s] for k, s in by_target.items()}
        self.tensors_into(targets, names, comp, prefix, target, fit, {v: k for k, v in saved.items()})
        self._finish_module(fit, targets, prefix)

    def _finish_module(self, fit: _ModuleLoad, targets: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Non-persistent buffers of an empty model placed (rebuilt where on ``meta``), and
        every tensor that will still be on ``meta`` after the load listed."""
        for key, tensor in targets.items():
            off = isinstance(tensor, torch.Tensor) and tensor.device.type == "meta" and key not in fit.materialized
            if off and self.placement(key, tensor)[0].type != "meta":
                self.meta_left.append(prefix + key)
        rebuild: dict[str, tuple[torch.nn.Module, list[str]]] = {}
        for full, owner, name, buffer in _module_fit.non_persistent_buffers(fit.module):
            device = self.placement(full, buffer)[0] if fit.empty else buffer.device
            if buffer.device.type == "meta":
                if device.type != "meta":
                    owner_path = full.rpartition(".")[0]
                    rebuild.setdefault(owner_path, (owner, []))[1].append(name)
            elif device.type != "meta" and device != buffer.device:
                self._assign_later(fit.module, full, buffer.to(device))
        for owner_path, (owner, buffer_names) in rebuild.items():
            values = _module_fit.rebuild_buffers(fit.module, owner_path, owner, buffer_names)
            rest = [n for n in buffer_names if n not in values]
            if rest:
                values.update(_module_fit.rebuild_by_constructor(owner, rest))
            for name in buffer_names:
                full = f"{owner_path}.{name}" if owner_path else name
                if name in values:
                    self._assign_later(fit.module, full, values[name].to(self.placement(full, values[name])[0]))
                else:
                    self.meta_left.append(prefix + full)

    def _assign_later(self, module: torch.nn.Module, key: str, value: torch.Tensor) -> None:
        self.post.append(lambda: None if _assign(module, key, value) else module.load_state_dict(
            {key: value}, strict=False, assign=True))

    def node(self, target: Any, node: dict[str, Any], comp: ComponentRecord, path: str,
             setter: Callable[[Any], None] | None) -> None:
        kind = node.get("type")
        inner = node["value"] if kind in WRAPPER_TYPES else node
        if isinstance(target, torch.nn.Module):
            if inner.get("type") != "dict":
                self.mismatched.append((path, (), ()))
                return
            names = {str(k): child["name"] for _, k, child in inner["items"] if child.get("type") == "tensor"}
            self.module_into(target, names, comp, path)
            return
        if isinstance(target, torch.optim.Optimizer):
            if kind != "optimizer":
                raise LoadMismatchError(f"{self.location}: {path!r} was not saved from an optimizer")
            by_name = node.get("by_name", False)
            param_names = self.param_names
            where = f"{self.location}, {path}"

            def load_optimizer(value: Any, opt: torch.optim.Optimizer = target) -> None:
                sd = optimizer_state_for(opt, value, param_names, where=where) if by_name else value
                opt.load_state_dict(sd)

            self.build(comp, node, load_optimizer, path)
            return
        if isinstance(target, torch.Tensor):
            if kind != "tensor":
                self.mismatched.append((path, (), tuple(target.shape)))
                return
            self.tensors_into({"": target}, {"": node["name"]}, comp, path, None)
            return
        if isinstance(target, Stateful) and not isinstance(target, Mapping):
            self.build(comp, node, target.load_state_dict, path)
            return
        if isinstance(target, MutableMapping) and inner.get("type") == "dict":
            saved_keys = set()
            for _, key, child in inner["items"]:
                saved_keys.add(key)
                child_path = f"{path}.{key}" if path else str(key)
                if key in target:
                    self.node(target[key], child, comp, child_path, _item_setter(target, key))
                else:
                    self.build(comp, child, _item_setter(target, key), child_path)
            self.missing.extend(f"{path}.{k}" if path else str(k) for k in target if k not in saved_keys)
            return
        if isinstance(target, MutableSequence) and inner.get("type") in ("list", "tuple") and len(target) == len(inner["items"]):
            for i, child in enumerate(inner["items"]):
                self.node(target[i], child, comp, f"{path}.{i}", _item_setter(target, i))
            return
        if setter is None:
            raise InvalidStateError(
                f"cannot load {path!r} into a {type(target).__name__}: it is neither a module, "
                "optimizer, Stateful, tensor nor a mutable container"
            )
        self.build(comp, node, setter, path)


def _apply_saved(apply: Callable[[Any], None], value: Any, where: str) -> None:
    """Hand a rebuilt value to its target (``load_state_dict``, a container slot); a target
    that refuses it (an optimizer given groups of another size, ...) raises LoadMismatchError."""
    try:
        apply(value)
    except CheckpointError:
        raise
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise LoadMismatchError(
            f"{where}: the target refused the saved state ({type(exc).__name__}: {str(exc)[:200]}); "
            "the checkpoint was saved from a different object, or it is damaged"
        ) from exc


def _component_targets(target: Any, ckpt: Checkpoint) -> dict[str, Any]:
    """Pair target values with saved components."""
    if ckpt.flat:
        if isinstance(target, torch.nn.Module):
            return {"model": target}
        if isinstance(target, Mapping) and all(isinstance(v, torch.Tensor) for v in target.values()):
            return {"model": target}
        if isinstance(target, Mapping) and "model" in target:
            return dict(target)
        raise InvalidStateError(
            f"{ckpt.location} holds a flat state dict; load it into a module or a dict of tensors"
        )
    if isinstance(target, torch.nn.Module):
        return {"model": target}
    if isinstance(target, Mapping):
        return dict(target)
    raise InvalidStateError(f"load_into() takes a module or a mapping of components, not {type(target).__name__}")


def load_into(
    target: Any,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    process_group: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    verify: bool | None = None,
    allow_pickle: bool = False,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    device_map: Mapping[str, str | torch.device] | None = None,
    max_buffer_bytes: int | str | None = None,
    options: OptionsArg = None,
) -> LoadResult:
    """Load a checkpoint into existing objects, in place.

    ``target`` is what was passed to ``save`` (freshly built): a module, a flat state dict,
    or a mapping of components holding modules, optimizers, schedulers, ``Stateful``
    objects, tensors and containers. Tensors are read straight into the target's own
    memory (dtype casts through a bounded staging buffer); parameters on the ``meta``
    device are materialized from the file with no second copy; tied parameters stay tied.
    Optimizers are matched by parameter name; other objects get ``load_state_dict``;
    values in mutable containers are replaced.

    A module is loaded as ``from_pretrained`` loads one: keys that differ by a base-model
    prefix (``model.``, ``transformer.``, the module's ``base_model_prefix``) are renamed,
    either way, and the rename reported (``LoadResult.prefix_mapping``); a key the model
    declares tied and the checkpoint lacks gets its twin; non-persistent buffers left on
    ``meta`` (a model built under ``torch.device("meta")``) are rebuilt through the model's
    own ``_init_weights``. Whatever would still be on ``meta`` afterwards is listed in
    ``LoadResult.meta_keys`` (and ``ok`` is False; ``strict=True`` raises).

    Args:
        target: the objects to fill.
        path: checkpoint directory or ``.safetensors`` file (local HF ``.bin`` weights too), or an fsspec URL of either
            (``s3://bucket/run/step-100``): only the byte ranges needed are read, concurrently;
            or ``hf://org/name[@revision][/subfolder]``: a repository in the local Hugging Face
            cache, never downloaded (``storage_options={"cache_dir": ...}`` names another cache).
        strict: raise :class:`LoadMismatchError` (before changing anything) when keys are
            missing, unexpected or mis-shaped, or a tensor would be left on ``meta``. A load
            where no key at all matches raises even with ``strict=False``.
        progress: show a progress bar (default: when stderr is a terminal).
        verify: check crc32c (default on).
        allow_pickle: unpickle values saved with ``allow_pickle=True``.
        process_group: load collectively: every rank fills its own shards (DTensors read
            only the byte ranges they hold); an error on any rank is raised on all. Without
            it, a target holding DTensors is loaded over the default group (as ``save``
            saves one), any other target by the calling process alone.
        device: where ``meta`` tensors are materialized (one at a time, read straight into
            their final memory); in a module with anything on ``meta``, its real buffers
            move there too. Real parameters stay where they are.
        dtype: the floating-point dtype of every loaded parameter and persistent buffer,
            as ``from_pretrained(dtype=...)``: integer and bool tensors keep theirs,
            non-persistent buffers keep the dtype their module built them in, and keys of a
            ``transformers`` model's ``_keep_in_fp32_modules`` (float16) /
            ``_keep_in_fp32_modules_strict`` (float16, bfloat16) stay float32. A real
            parameter of another dtype keeps its ``Parameter`` object (new ``.data``).
        device_map: module-name prefix -> device for ``meta`` parameters (the longest
            prefix wins; ``"meta"`` leaves them unmaterialized), as Accelerate's.
        storage_options: options of the URL's fsspec filesystem (see :func:`shardpoint.save`).
        max_buffer_bytes: size of each reader thread's reusable staging buffer (dtype
            casts, GPU destinations): peak host memory is what stays on the host plus
            about ``read threads x max_buffer_bytes`` (x 2 for a GPU, where the next read
            overlaps the previous copy). Default: ``IOOptions.staging_buffer_bytes``.
        options: tunables for this call (:class:`IOOptions`, :class:`RemoteOptions`,
            :class:`CollectiveOptions`; see :func:`shardpoint.save`).

    Returns:
        A :class:`LoadResult` listing missing, unexpected and mismatched keys, tensors left
        on ``meta``, any prefix rename, and the bytes read.

    Raises:
        LoadMismatchError: ``strict=True`` and the report is not ok, or no key matches.
        CheckpointNotFoundError, CorruptCheckpointError, ChecksumMismatchError.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = sp.save(model.state_dict(), d)
        >>> sp.load_into(torch.nn.Linear(2, 2), d).ok
        True
    """
    with applied(options):
        return _load_into_call(target, path, strict, process_group, storage_options, progress, verify,
                               allow_pickle, device, dtype, device_map, max_buffer_bytes)


def _load_into_call(target: Any, path: str | os.PathLike[str], strict: bool, process_group: Any,
                    storage_options: Mapping[str, Any] | None, progress: bool | None, verify: bool | None,
                    allow_pickle: bool, device: str | torch.device, dtype: torch.dtype | None,
                    device_map: Any, max_buffer_bytes: int | str | None) -> LoadResult:
    group = resolve_group(process_group, target)
    threads = None
    if group.distributed:  # the ranks on this machine share its CPUs
        host = socket.gethostname()
        threads = reader_threads(group.all_gather(host).count(host))
    with collector_paused():
        opened = _open_on_every_rank(group, path, storage_options)
        try:
            return group.phase(
                f"loading {os.fspath(path)}",
                lambda: _load_into(target, path, strict, progress, verify, allow_pickle, device, dtype, device_map,
                                   _buffer_size(max_buffer_bytes), storage_options, threads, opened),
            )
        finally:
            if opened is not None:
                opened.close()


def _open_on_every_rank(group: Group, path: str | os.PathLike[str],
                        storage_options: Mapping[str, Any] | None) -> Checkpoint | None:
    """In a process group, open the checkpoint on every rank and agree that all opened the
    same save (its ``save_id``); a save committed between two ranks' opens makes every rank
    open again (a few times). None without a group, or for ``.bin`` weights."""
    if not group.distributed:
        return None
    where = os.fspath(path)

    def open_here() -> tuple[Checkpoint | None, Any]:
        hub_path, options = resolve_hub(path, storage_options)
        routed, pickled = route(hub_path)
        if pickled is not None:
            return None, None
        ckpt = open_checkpoint(routed, options)
        return ckpt, ckpt.manifest.save_id if ckpt.manifest is not None else None

    for _ in range(OPEN_TRIES):
        ckpt, same = group.exchange(f"opening {where}", open_here,
                                    decide=lambda ids: [len(set(ids)) == 1] * len(ids))
        if same:
            return ckpt
        if ckpt is not None:
            ckpt.close()
    raise StorageError(
        f"{where}: the ranks opened different saves {OPEN_TRIES} times (it is being overwritten "
        "while being loaded); load it again once the saves to it stop, or load a fixed step"
    )


def _load_into(
    target: Any,
    path: str | os.PathLike[str],
    strict: bool,
    progress: bool | None,
    verify: bool | None,
    allow_pickle: bool,
    device: str | torch.device,
    dtype: torch.dtype | None,
    device_map: Mapping[str, str | torch.device] | None,
    staging_bytes: int | None,
    storage_options: Mapping[str, Any] | None = None,
    threads: int | None = None,
    opened: Checkpoint | None = None,
) -> LoadResult:
    if opened is not None:  # opened (and later closed) by load_into, agreed on by every rank
        return _load_into_checkpoint(target, opened, strict, progress, verify, allow_pickle, device, dtype,
                                     device_map, staging_bytes, threads)
    path, storage_options = resolve_hub(path, storage_options)
    path, pickled = route(path)
    if pickled is not None:
        return _load_pickled_into(target, path, pickled, strict, progress, device, dtype, device_map)
    with open_checkpoint(path, storage_options) as ckpt:
        return _load_into_checkpoint(target, ckpt, strict, progress, verify, allow_pickle, device, dtype,
                                     device_map, staging_bytes, threads)


def _load_into_checkpoint(
    target: Any,
    ckpt: Checkpoint,
    strict: bool,
    progress: bool | None,
    verify: bool | None,
    allow_pickle: bool,
    device: str | torch.device,
    dtype: torch.dtype | None,
    device_map: Mapping[str, str | torch.device] | None,
    staging_bytes: int | None,
    threads: int | None,
) -> LoadResult:
    batch = ReadBatch(ckpt, verify=resolve_verify(verify), staging_bytes=staging_bytes, threads=threads)
    planner = _Planner(ckpt.location, batch, allow_pickle=allow_pickle)
    planner.device = torch.device(device)
    planner.dtype = dtype
    planner.device_map = dict(device_map or {})
    targets = _component_targets(target, ckpt)
    planner.param_names = parameter_names(find_modules(targets))
    for cname, value in targets.items():
        comp = ckpt.components.get(cname)
        if comp is None:
            planner.missing.append(cname)
            continue
        if ckpt.flat and isinstance(value, Mapping) and not isinstance(value, torch.nn.Module):
            names = {k: k for k in list(comp.tensors) + list(comp.aliases)}
            if value and names and not any(k in names for k in value):
                raise LoadMismatchError(_no_match_message(ckpt.location, "", list(value), list(names)))
            planner.tensors_into(value, names, comp, "", None)
            continue
        setter = (lambda v, k=cname: target.__setitem__(k, v)) if isinstance(target, MutableMapping) else None
        planner.node(value, comp.tree, comp, "" if ckpt.flat else cname, setter)
    planner.unexpected.extend(c for c in ckpt.components if c not in targets)
    result = LoadResult(planner.missing, planner.unexpected, planner.mismatched, 0, planner.meta_left,
                        planner.prefix_mapping)
    if strict and not result.ok:
        raise LoadMismatchError(_mismatch_message(ckpt.location, result), result)
    batch.run(progress)
    for fix in planner.post:
        fix()
    return dataclasses.replace(result, bytes_read=batch.planned_bytes)


def _load_pickled_into(
    target: Any,
    path: str | os.PathLike[str],
    spec: SourceSpec,
    strict: bool,
    progress: bool | None,
    device: str | torch.device,
    dtype: torch.dtype | None,
    device_map: Mapping[str, str | torch.device] | None,
) -> LoadResult:
    """``load_into`` of ``.bin`` weights (a flat state dict): the same planning, then the
    tensors read a batch at a time."""
    batch = PickledBatch(path, spec)
    try:
        planner = _Planner(batch.location, batch, allow_pickle=False)
        planner.device = torch.device(device)
        planner.dtype = dtype
        planner.device_map = dict(device_map or {})
        comp = batch.comp
        names = {k: k for k in comp.tensors}
        if isinstance(target, torch.nn.Module):
            planner.module_into(target, names, comp, "")
        elif isinstance(target, Mapping) and all(isinstance(v, torch.Tensor) for v in target.values()):
            if target and names and not any(k in names for k in target):
                raise LoadMismatchError(_no_match_message(batch.location, "", list(target), list(names)))
            planner.tensors_into(target, names, comp, "", None)
        else:
            raise InvalidStateError(f"{batch.location} holds a flat state dict; load it into a module or a dict of tensors")
        result = LoadResult(planner.missing, planner.unexpected, planner.mismatched, 0, planner.meta_left,
                            planner.prefix_mapping)
        if strict and not result.ok:
            raise LoadMismatchError(_mismatch_message(batch.location, result), result)
        batch.run(progress)
        for fix in planner.post:
            fix()
        return dataclasses.replace(result, bytes_read=batch.bytes_read)
    finally:
        batch.close()


def _show(items: Sequence[Any], limit: int = 10) -> str:
    head = ", ".join(
        repr(i) if isinstance(i, str) else f"{i[0]!r} (saved {list(i[1])}, target {list(i[2])})"
        for i in items[:limit]
    )
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _report_lines(result: LoadResult) -> list[str]:
    lines = []
    for path, (old, new) in result.prefix_mapping.items():
        where = f" of {path!r}" if path else ""
        lines.append(
            f"keys{where} renamed to match: checkpoint {old + '<name>'!r} -> target {new + '<name>'!r}"
        )
    if result.missing_keys:
        lines.append(f"missing from the checkpoint: {_show(result.missing_keys)}")
    if result.unexpected_keys:
        lines.append(f"unexpected (in the checkpoint, not the target): {_show(result.unexpected_keys)}")
    if result.mismatched_keys:
        lines.append(f"shape mismatch: {_show(result.mismatched_keys)}")
    if result.meta_keys:
        lines.append(
            f"left on the meta device (the model cannot run): {_show(result.meta_keys, len(result.meta_keys))}"
        )
    if not lines:
        lines.append("every key matched")
    return lines


def _mismatch_message(location: str, result: LoadResult) -> str:
    parts = [f"loading {location} into the target does not match (strict=True):", *_report_lines(result)]
    if result.meta_keys:
        parts.append(
            "a tensor on meta is neither in the checkpoint nor rebuilt by its module's own "
            "initialization: build the model with sp.empty_model (which keeps non-persistent "
            "buffers real) or set those tensors yourself before loading"
        )
    parts.append("nothing was loaded; pass strict=False to load the matching tensors and get this report")
    return "\n  ".join(parts)


def _no_match_message(location: str, path: str, target_keys: list[str], saved_keys: list[str]) -> str:
    where = f"{path!r} of the target" if path else "the target"
    return (
        f"loading {location}: not one of its {len(saved_keys)} keys matches the {len(target_keys)} "
        f"keys of {where}, even with a base-model prefix added or removed, so nothing would load.\n  "
        f"checkpoint keys: {_show(sorted(saved_keys), 5)}\n  target keys: {_show(sorted(target_keys), 5)}\n  "
        "is this the checkpoint of this model? If the names differ by a fixed prefix, rename them "
        "(sd = sp.load(path); sd = {prefix + k: v for k, v in sd.items()}) and load that dict with "
        "module.load_state_dict"
    )
