"""Reading: plan which bytes go where (in place, or into new tensors), then read in one batch.

``load_into`` walks the target alongside the saved tree in a planning pass that touches no
data, so ``strict=True`` can refuse a mismatch before a single byte of the target changes.
"""

from __future__ import annotations

import math
import mmap as _mmap
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._distributed.group import Group, local_chunk
from ._flatten import WRAPPER_TYPES, tree_tensor_names, unflatten_state
from ._format.manifest import ComponentRecord, TensorRecord
from ._io.transfer import ReadTask, reader_threads, run_reads
from ._knobs import knobs
from ._planning.chunks import byte_runs, intersect
from ._prepare import storage_key
from ._progress import byte_progress
from ._read_pickled import load_pickled, load_pickled_into, route
from ._sizes import parse_size
from ._source import Checkpoint, open_checkpoint
from ._stateful import Stateful, find_modules, optimizer_state_for, parameter_names
from ._storage.remote import run_remote_reads
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidSizeError,
    InvalidStateError,
    LoadMismatchError,
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

    @property
    def ok(self) -> bool:
        return not (self.missing_keys or self.unexpected_keys or self.mismatched_keys)


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
                    )
                )
                pos += count
        if covered != dest.numel():
            raise CorruptCheckpointError(
                f"{self.ckpt.location}: tensor {label!r}: the stored chunks cover {covered} of the "
                f"{dest.numel()} elements needed at offsets {list(offsets)} (shape {list(dest.shape)}); "
                "the checkpoint is incomplete for this tensor"
            )

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
        if len(record.chunks) != 1 or chunk.shape != record.shape or dest.shape != chunk.shape:
            return False
        if any(offsets) or any(chunk.offsets) or not dest.is_contiguous():
            return False
        if entry is None:
            entry = self.ckpt.entry(chunk, record.dtype, label)
        self.tasks.append(
            ReadTask(
                name=self._name(chunk.file),
                path=self.ckpt.file_path(chunk.file),
                start=entry.start,
                nbytes=entry.nbytes,
                dest=dest.view(-1) if dest.dim() else dest.view(1),
                stored_dtype=entry.dtype,
                crc32c=chunk.crc32c if self.verify else None,
                label=label,
            )
        )
        return True

    @property
    def planned_bytes(self) -> int:
        return sum(t.nbytes for t in self.tasks)

    def new(self, record: TensorRecord, label: str, *, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        """A new tensor that will hold ``record`` once the batch has run."""
        entry = self.ckpt.entry(record.chunks[0], record.dtype, label)
        stored = entry.dtype
        want = dtype if (dtype is not None and stored.is_floating_point) else stored
        dest = torch.empty(record.shape, dtype=want, device=device)
        chunk = record.chunks[0]
        if entry.nbytes and len(record.chunks) == 1 and chunk.shape == record.shape and not any(chunk.offsets):
            # The whole tensor into memory of its shape just allocated: _fill_whole's case,
            # without its checks (a state of 10^5 small tensors takes this 10^5 times).
            self.tasks.append(
                ReadTask(self._name(chunk.file), self.ckpt.file_path(chunk.file), entry.start, entry.nbytes,
                         dest.view(-1) if dest.dim() else dest.view(1), entry.dtype,
                         chunk.crc32c if self.verify else None, label)
            )
            return dest
        self.fill(record, dest, label)
        return dest

    def run(self, progress: bool | None) -> None:
        total = sum(t.nbytes for t in self.tasks)
        desc = f"loading {os.path.basename(os.path.normpath(self.ckpt.location))}"
        with torch.no_grad(), byte_progress(total, desc, progress) as advance:
            if self.ckpt.store is not None:
                run_remote_reads(self.ckpt.store, self.tasks, advance=advance)
            else:
                run_reads(self.tasks, threads=self.threads, advance=advance, staging_bytes=self.staging_bytes)
            for dest, temp in self._copies:
                dest.copy_(temp)


def _buffer_size(value: int | str | None) -> int | None:
    if value is None:
        return None
    size = parse_size(value)
    if size < 4096:
        raise InvalidSizeError(f"max_buffer_bytes={value!r} is too small; use at least 4 KiB, e.g. '16MiB'")
    return size


def resolve_verify(verify: bool | None) -> bool:
    return knobs().verify_checksums if verify is None else verify


# ---------------------------------------------------------------------------------- load


def _mmap_tensor(ckpt: Checkpoint, record: TensorRecord, label: str, maps: dict[str, Any]) -> torch.Tensor:
    chunk = record.chunks[0]
    if len(record.chunks) != 1 or chunk.shape != record.shape:
        raise CheckpointError(f"{ckpt.location}: tensor {label!r} is chunked; mmap needs whole tensors")
    entry = ckpt.entry(chunk, record.dtype, label)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    mm = maps.get(chunk.file)
    if mm is None:
        with open(ckpt.file_path(chunk.file), "rb") as f:
            mm = maps[chunk.file] = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY)
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
            raise CheckpointError(
                f"{ckpt.location} has no tensor named {', '.join(map(repr, unknown[:10]))}"
                + (f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else "")
                + "; `shardpoint inspect` lists the names"
            )
        return {"model": wanted}
    unknown = [k for k in wanted if k not in ckpt.components]
    if unknown:
        raise CheckpointError(
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
            (``s3://bucket/run/step-100``): only the byte ranges needed are read, concurrently.
        keys: tensor names to read (flat checkpoints) or components (nested ones).
        device: where the tensors go (read through a bounded staging buffer if not CPU).
        dtype: cast floating-point tensors to this dtype while reading.
        mmap: return CPU tensors backed by the files' pages (zero-copy, lazy; not verified).
        storage_options: options of the URL's fsspec filesystem (see :func:`shardpoint.save`).
        progress: show a progress bar (default: when stderr is a terminal).
        verify: check crc32c (default on; ``SHARDPOINT_VERIFY=0`` turns it off).
        allow_pickle: unpickle values that were saved with ``allow_pickle=True``.
        max_buffer_bytes: size of each reader thread's reusable staging buffer, used only
            where bytes cannot land in the destination directly (a dtype cast, a GPU);
            e.g. ``"16MiB"``. Default: the ``SHARDPOINT_STAGING_BUFFER_BYTES`` knob (64 MiB).

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
    path, pickled = route(path)
    if pickled is not None:
        if mmap:
            raise CheckpointError(f"{os.fspath(path)} holds .bin (torch.save) weights; mmap=True needs safetensors")
        return load_pickled(path, pickled, keys=keys, device=torch.device(device), dtype=dtype)
    ckpt = open_checkpoint(path, storage_options)
    if mmap and ckpt.store is not None:
        raise CheckpointError(f"{ckpt.location}: mmap=True needs local files; load it with mmap=False")
    device = torch.device(device)
    batch = ReadBatch(ckpt, verify=resolve_verify(verify) and not mmap, staging_bytes=_buffer_size(max_buffer_bytes))
    maps: dict[str, Any] = {}
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    selection = _selection(ckpt, keys)
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
                out[stored] = batch.new(record, stored, device=device, dtype=dtype)
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
    device_map: Mapping[str, Any],
) -> tuple[torch.device, torch.dtype]:
    """Device and dtype for materializing meta tensor ``key``: the longest matching
    ``device_map`` prefix (module names, as Accelerate's), else ``device``."""
    best = -1
    for prefix, target in device_map.items():
        if (prefix == "" or key == prefix or key.startswith(prefix + ".")) and len(prefix) > best:
            best, device = len(prefix), torch.device(target)
    want = dtype if (dtype is not None and tensor.dtype.is_floating_point) else tensor.dtype
    return device, want


class _Planner:
    """Walks a target beside the saved trees; records reads, report entries and fix-ups."""

    def __init__(self, ckpt: Checkpoint, batch: ReadBatch, *, allow_pickle: bool) -> None:
        self.ckpt = ckpt
        self.batch = batch
        self.allow_pickle = allow_pickle
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.post: list[Callable[[], None]] = []
        self.param_names: dict[int, str] = {}
        self.device: torch.device = torch.device("cpu")
        self.dtype: torch.dtype | None = None
        self.device_map: dict[str, Any] = {}

    def placement(self, key: str, tensor: torch.Tensor) -> tuple[torch.device, torch.dtype]:
        return _placement(key, tensor, self.device, self.dtype, self.device_map)

    # A subtree read into new tensors, turned into a value after the batch ran.
    def build(self, comp: ComponentRecord, node: dict[str, Any], apply: Callable[[Any], None], path: str) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for name in tree_tensor_names(node):
            stored = comp.aliases.get(name, name)
            if stored not in tensors:
                tensors[stored] = self.batch.new(comp.tensors[stored], stored, device=torch.device("cpu"), dtype=None)
            tensors[name] = tensors[stored]
        where = f"{self.ckpt.location}, {path}"
        allow = self.allow_pickle
        self.post.append(lambda: apply(unflatten_state(node, tensors, where=where, allow_pickle=allow)))

    def tensors_into(self, targets: Mapping[str, torch.Tensor], names: Mapping[str, str],
                     comp: ComponentRecord, prefix: str, module: torch.nn.Module | None) -> None:
        """Fill target tensors in place; ``names`` maps a target key to its saved tensor name."""
        matched = []
        for key, tensor in targets.items():
            saved = names.get(key)
            if saved is None:
                continue
            record = comp.tensors[comp.aliases.get(saved, saved)]
            if tuple(tensor.shape) != record.shape:
                self.mismatched.append((prefix + key, record.shape, tuple(tensor.shape)))
            else:
                matched.append(key)
        first_with: dict[Any, str] = {}
        for m in matched:
            for ident in identities(targets[m]):
                first_with.setdefault(ident, m)
        tied: dict[str, str] = {}  # target key absent from the checkpoint -> matched key it is tied to
        for key in targets:
            if key in names:
                continue
            twin = next((first_with[i] for i in identities(targets[key]) if i in first_with), None)
            if twin is None:
                self.missing.append(prefix + key)
            else:
                tied[key] = twin
        self.unexpected.extend(prefix + k for k in names if k not in targets)

        filled: set[Any] = set()
        materialized: dict[int, torch.Tensor] = {}
        for key in matched:
            tensor = targets[key]
            saved = names[key]
            stored = comp.aliases.get(saved, saved)
            record = comp.tensors[stored]
            if tensor.device.type == "meta":
                if module is None:
                    raise InvalidStateError(
                        f"target tensor {prefix + key!r} is on the meta device; pass the module itself"
                    )
                value = materialized.get(id(tensor))
                if value is None:
                    device, dtype = self.placement(key, tensor)
                    if device.type == "meta":
                        continue  # the device map keeps it off this process
                    new = torch.empty(tensor.shape, dtype=dtype, device=device)
                    self.batch.fill(record, new, stored)
                    value = (
                        torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
                        if isinstance(tensor, torch.nn.Parameter)
                        else new
                    )
                    materialized[id(tensor)] = value
                for k in [key, *(t for t, twin in tied.items() if twin == key)]:

                    def put(m: torch.nn.Module = module, k: str = k, v: torch.Tensor = value) -> None:
                        if not _assign(m, k, v):
                            m.load_state_dict({k: v}, strict=False, assign=True)

                    self.post.append(put)
                continue
            idents = identities(tensor)
            if any(i in filled for i in idents):
                continue  # tied to a tensor already being filled
            filled.update(idents)
            _global_shape, offsets, local = local_chunk(tensor)
            self.batch.fill(record, local.detach(), stored, offsets)

    def node(self, target: Any, node: dict[str, Any], comp: ComponentRecord, path: str,
             setter: Callable[[Any], None] | None) -> None:
        kind = node.get("type")
        inner = node["value"] if kind in WRAPPER_TYPES else node
        if isinstance(target, torch.nn.Module):
            if inner.get("type") != "dict":
                self.mismatched.append((path, (), ()))
                return
            names = {str(k): child["name"] for _, k, child in inner["items"] if child.get("type") == "tensor"}
            self.tensors_into(target.state_dict(keep_vars=True), names, comp, f"{path}/" if path else "", target)
            return
        if isinstance(target, torch.optim.Optimizer):
            if kind != "optimizer":
                raise LoadMismatchError(f"{self.ckpt.location}: {path!r} was not saved from an optimizer")
            by_name = node.get("by_name", False)
            param_names = self.param_names
            where = f"{self.ckpt.location}, {path}"

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
) -> LoadResult:
    """Load a checkpoint into existing objects, in place.

    ``target`` is what was passed to ``save`` (freshly built): a module, a flat state dict,
    or a mapping of components holding modules, optimizers, schedulers, ``Stateful``
    objects, tensors and containers. Tensors are read straight into the target's own
    memory (dtype casts through a bounded staging buffer); parameters on the ``meta``
    device are materialized from the file with no second copy; tied parameters stay tied.
    Optimizers are matched by parameter name; other objects get ``load_state_dict``;
    values in mutable containers are replaced.

    Args:
        target: the objects to fill.
        path: checkpoint directory or ``.safetensors`` file (local HF ``.bin`` weights too), or an fsspec URL of either
            (``s3://bucket/run/step-100``): only the byte ranges needed are read, concurrently.
        strict: raise :class:`LoadMismatchError` (before changing anything) when keys are
            missing, unexpected or mis-shaped.
        progress: show a progress bar (default: when stderr is a terminal).
        verify: check crc32c (default on).
        allow_pickle: unpickle values saved with ``allow_pickle=True``.
        process_group: load collectively: every rank fills its own shards (DTensors read
            only the byte ranges they hold); an error on any rank is raised on all.
        device, dtype: where and in which floating dtype ``meta`` parameters are
            materialized (one tensor at a time, read straight into its final memory).
        device_map: module-name prefix -> device for ``meta`` parameters (the longest
            prefix wins; ``"meta"`` leaves them unmaterialized), as Accelerate's.
        storage_options: options of the URL's fsspec filesystem (see :func:`shardpoint.save`).
        max_buffer_bytes: size of each reader thread's reusable staging buffer (dtype
            casts, GPU destinations): peak host memory is what stays on the host plus
            about ``read threads x max_buffer_bytes`` (x 2 for a GPU, where the next read
            overlaps the previous copy). Default: ``SHARDPOINT_STAGING_BUFFER_BYTES``.

    Returns:
        A :class:`LoadResult` listing missing, unexpected and mismatched keys and the
        bytes read.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = sp.save(model.state_dict(), d)
        >>> sp.load_into(torch.nn.Linear(2, 2), d).ok
        True
    """
    group = Group(process_group)
    threads = None
    if group.distributed:  # the ranks on this machine share its CPUs
        host = socket.gethostname()
        threads = reader_threads(group.all_gather(host).count(host))
    return group.phase(
        f"loading {os.fspath(path)}",
        lambda: _load_into(target, path, strict, progress, verify, allow_pickle, device, dtype, device_map,
                           _buffer_size(max_buffer_bytes), storage_options, threads),
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
) -> LoadResult:
    path, pickled = route(path)
    if pickled is not None:
        return load_pickled_into(
            target, path, pickled, strict=strict,
            placement=lambda k, t: _placement(k, t, torch.device(device), dtype, dict(device_map or {})),
            assign=lambda m, k, v: None if _assign(m, k, v) else m.load_state_dict({k: v}, strict=False, assign=True),
            mismatch_message=_mismatch_message,
        )
    ckpt = open_checkpoint(path, storage_options)
    batch = ReadBatch(ckpt, verify=resolve_verify(verify), staging_bytes=staging_bytes, threads=threads)
    planner = _Planner(ckpt, batch, allow_pickle=allow_pickle)
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
            planner.tensors_into(value, names, comp, "", None)
            continue
        setter = (lambda v, k=cname: target.__setitem__(k, v)) if isinstance(target, MutableMapping) else None
        planner.node(value, comp.tree, comp, "" if ckpt.flat else cname, setter)
    planner.unexpected.extend(c for c in ckpt.components if c not in targets)
    result = LoadResult(planner.missing, planner.unexpected, planner.mismatched)
    if strict and not result.ok:
        raise LoadMismatchError(_mismatch_message(ckpt.location, result), result)
    batch.run(progress)
    for fix in planner.post:
        fix()
    return LoadResult(result.missing_keys, result.unexpected_keys, result.mismatched_keys, batch.planned_bytes)


def _mismatch_message(location: str, result: LoadResult) -> str:
    def show(items: Sequence[Any]) -> str:
        head = ", ".join(
            repr(i) if isinstance(i, str) else f"{i[0]!r} (saved {list(i[1])}, target {list(i[2])})"
            for i in items[:10]
        )
        return head + (f" and {len(items) - 10} more" if len(items) > 10 else "")

    parts = [f"loading {location} into the target does not match (strict=True):"]
    if result.missing_keys:
        parts.append(f"missing from the checkpoint: {show(result.missing_keys)}")
    if result.unexpected_keys:
        parts.append(f"unexpected (in the checkpoint, not the target): {show(result.unexpected_keys)}")
    if result.mismatched_keys:
        parts.append(f"shape mismatch: {show(result.mismatched_keys)}")
    parts.append("nothing was loaded; pass strict=False to load the matching tensors and get this report")
    return "\n  ".join(parts)
