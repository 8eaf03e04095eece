"""save / load / load_into: orchestration only. Planning, I/O and commit live elsewhere."""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import __version__
from ._flatten import flatten_state, unflatten_state
from ._format.dtypes import dtype_name
from ._format.index import index_name, render_index
from ._format.manifest import MANIFEST_NAME, ChunkRef, ComponentRecord, Manifest, TensorRecord
from ._format.names import validate_component_key
from ._format.safetensors import TensorSpec, plan_file
from ._io.transfer import FileWrite, ReadTask, run_reads, write_files
from ._knobs import knobs
from ._planning.shards import plan_shards, shard_file_names
from ._progress import byte_progress
from ._sizes import parse_size
from ._source import Checkpoint, open_checkpoint
from ._stateful import to_state
from ._storage.local import LocalTransaction
from .errors import CheckpointError, InvalidStateError, LoadMismatchError

__all__ = ["LoadResult", "SaveInfo", "load", "load_into", "save"]


@dataclass(frozen=True)
class SaveInfo:
    """What a save wrote."""

    path: str
    save_id: str
    files: dict[str, int]
    """Data file name -> bytes."""
    tensor_bytes: int
    """Bytes of tensor data stored (aliases counted once)."""
    seconds: float


@dataclass(frozen=True)
class LoadResult:
    """What ``load_into`` found, as ``transformers`` reports a load."""

    missing_keys: list[str] = field(default_factory=list)
    """In the target but not in the checkpoint (left untouched)."""
    unexpected_keys: list[str] = field(default_factory=list)
    """In the checkpoint but not in the target (not read)."""
    mismatched_keys: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """(name, saved shape, target shape) for keys whose shapes differ (not read)."""

    @property
    def ok(self) -> bool:
        return not (self.missing_keys or self.unexpected_keys or self.mismatched_keys)


# ---------------------------------------------------------------------------- save


@dataclass
class _Component:
    name: str
    tree: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    stored: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)


def _split_components(state: Any) -> tuple[dict[str, Any], bool]:
    """Top-level components of ``state``, and whether it is a flat model state dict."""
    if isinstance(state, torch.nn.Module):
        return {"model": state.state_dict()}, True
    if not isinstance(state, Mapping):
        raise InvalidStateError(
            f"save() takes a state dict or a mapping of components, not {type(state).__name__}"
        )
    if not state:
        raise InvalidStateError("the state is empty; there is nothing to save")
    if all(isinstance(v, torch.Tensor) for v in state.values()):
        for key in state:
            if not isinstance(key, str):
                raise InvalidStateError(
                    f"key {key!r} of the state dict is a {type(key).__name__}; tensor names must be str"
                )
        return {"model": state}, True
    return {validate_component_key(k): v for k, v in state.items()}, False


def _check_tensor(name: str, component: str, tensor: torch.Tensor) -> None:
    where = f"tensor {name!r}" + (f" of component {component!r}" if component != "model" else "")
    if tensor.layout != torch.strided:
        raise InvalidStateError(
            f"{where} is a {tensor.layout} tensor; safetensors stores dense tensors only. "
            "Call `.to_dense()` on it before saving"
        )
    if tensor.device.type == "meta":
        raise InvalidStateError(
            f"{where} is on the meta device and holds no data; materialize the module "
            "(e.g. `module.to_empty(device='cpu')` and initialize it) before saving"
        )
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        cls = type(tensor).__name__
        if cls == "DTensor":
            raise InvalidStateError(
                f"{where} is a DTensor; save it collectively with a process group "
                "(distributed saving is not available in this version)"
            )
    dtype_name(tensor.dtype, key=name)


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    if tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    return (
        tensor.device,
        storage.data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _dedup(comp: _Component) -> None:
    """Store tensors that are the same view of the same memory once (tied weights)."""
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in comp.tensors.items():
        key = _storage_key(tensor)
        if key is not None and key in seen:
            comp.aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        comp.stored.append(name)


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidStateError(f"metadata must be a dict of JSON values, not {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))  # type: ignore[no-any-return]
    except (TypeError, ValueError) as exc:
        raise InvalidStateError(f"metadata must hold only JSON values (no nan/inf): {exc}") from None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    layout: str | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    durable: bool = True,
) -> SaveInfo:
    """Save a state dict (or nested training state) as an atomic, sharded checkpoint.

    A flat ``dict[str, Tensor]`` (or an ``nn.Module``) becomes the component ``model``:
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, exactly what
    ``transformers`` reads. In a nested state each top-level key is a component with its
    own files. ``shardpoint.json`` is written last; the directory appears at ``path`` only
    once everything is on disk.

    Args:
        state: ``model.state_dict()``, a module, or a mapping of components.
        path: the checkpoint directory to create.
        max_shard_size: largest data file, e.g. ``"5GB"`` (10^9) or ``"5GiB"`` (2^30), or an int.
        layout: ``"hf"`` (default: every tensor whole in one file).
        process_group: for collective saves (not in this version; must be None).
        overwrite: replace an existing checkpoint at ``path`` (atomically).
        metadata: JSON values stored in the manifest.
        storage_options: for fsspec URLs (not in this version; must be None).
        progress: show a progress bar (default: when stderr is a terminal).
        durable: fsync files and directories before returning (default True).

    Returns:
        A :class:`SaveInfo` with the files written and their sizes.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False.
        InvalidStateError: a value cannot be stored (sparse, meta, unsupported dtype, object).
        InvalidSizeError: ``max_shard_size`` cannot be parsed.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> info = sp.save({"w": torch.ones(2, 2)}, os.path.join(d, "ckpt"))
        >>> sorted(info.files)
        ['model.safetensors']
    """
    started = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    if layout not in (None, "hf"):
        raise CheckpointError(f"layout {layout!r} is not available in this version; use layout='hf'")
    if process_group is not None or storage_options is not None:
        raise CheckpointError(
            "process_group and storage_options are not available in this version of shardpoint"
        )
    raw_components, flat = _split_components(state)
    user_metadata = _json_metadata(metadata)

    components: list[_Component] = []
    for cname, value in raw_components.items():
        tree, tensors = flatten_state(value, path=cname, to_state=to_state)
        comp = _Component(cname, tree, tensors)
        for name, tensor in tensors.items():
            _check_tensor(name, cname, tensor)
        _dedup(comp)
        components.append(comp)

    save_id = uuid.uuid4().hex
    file_meta = {"format": "pt", "shardpoint.save_id": save_id}
    writes: list[FileWrite] = []
    records: dict[str, ComponentRecord] = {}
    indexes: dict[str, bytes] = {}
    file_of: dict[tuple[str, str], str] = {}  # (component, tensor) -> data file
    files: dict[str, int] = {}
    total = 0
    for comp in components:
        sizes = [(n, comp.tensors[n].numel() * comp.tensors[n].element_size()) for n in comp.stored]
        groups = plan_shards(sizes, max_bytes)
        names = shard_file_names(comp.name, len(groups))
        weight_map: dict[str, str] = {}
        comp_bytes = 0
        for fname, group in zip(names, groups):
            specs = []
            for key in group:
                t = comp.tensors[key]
                nbytes = t.numel() * t.element_size()
                specs.append(TensorSpec(key, dtype_name(t.dtype, key=key), tuple(t.shape), nbytes))
                weight_map[key] = fname
                file_of[(comp.name, key)] = fname
                comp_bytes += nbytes
            layout_plan = plan_file(specs, file_meta)
            writes.append(
                FileWrite(
                    fname,
                    layout_plan.header,
                    layout_plan.size,
                    tuple((k, comp.tensors[k], layout_plan.ranges[k][0]) for k in group),
                )
            )
            files[fname] = layout_plan.size
        total += comp_bytes
        if len(groups) > 1:
            indexes[index_name(comp.name)] = render_index(weight_map, comp_bytes)

    txn = LocalTransaction(path, overwrite=overwrite)
    try:
        with byte_progress(total, f"saving {os.path.basename(os.fspath(path))}", progress) as advance:
            crcs = write_files(txn.directory, writes, durable=durable, advance=advance)
        for comp in components:
            tensors_rec: dict[str, TensorRecord] = {}
            for name in comp.stored:
                t = comp.tensors[name]
                fname = file_of[(comp.name, name)]
                shape = tuple(t.shape)
                tensors_rec[name] = TensorRecord(
                    dtype_name(t.dtype, key=name),
                    shape,
                    (ChunkRef(fname, name, (0,) * len(shape), shape, crcs[(fname, name)]),),
                )
            records[comp.name] = ComponentRecord(comp.tree, tensors_rec, comp.aliases)
        manifest = Manifest(
            save_id=save_id,
            created=_now(),
            library_version=__version__,
            world_size=1,
            layout="hf",
            flat=flat,
            components=records,
            files=files,
            metadata=user_metadata,
        )
        for iname, data in indexes.items():
            txn.write_bytes(iname, data, durable=durable)
        txn.write_bytes(MANIFEST_NAME, manifest.to_json(), durable=durable)
        txn.commit(durable=durable)
    except BaseException:
        txn.abort()
        raise
    return SaveInfo(os.fspath(path), save_id, files, total, time.perf_counter() - started)


# ---------------------------------------------------------------------------- load


def _resolve_verify(verify: bool | None) -> bool:
    return knobs().verify_checksums if verify is None else verify


def _chunk_tasks(
    ckpt: Checkpoint,
    record: TensorRecord,
    dest: torch.Tensor,
    *,
    label: str,
    verify: bool,
) -> list[ReadTask]:
    """Read tasks that fill the contiguous tensor ``dest`` (global shape) from ``record``."""
    tasks = []
    stored = record.dtype
    for chunk in record.chunks:
        entry = ckpt.entry(chunk, stored, label)
        if chunk.shape != record.shape:
            raise CheckpointError(
                f"{ckpt.location}: tensor {label!r} is stored in {len(record.chunks)} chunks; "
                "reading chunked checkpoints is not available in this version"
            )
        tasks.append(
            ReadTask(
                name=f"{ckpt.location}/{chunk.file}" if ckpt.kind != "hf-file" else ckpt.location,
                path=ckpt.file_path(chunk.file),
                start=entry.start,
                nbytes=entry.nbytes,
                dest=dest,
                stored_dtype=entry.dtype,
                crc32c=chunk.crc32c if verify else None,
                label=label,
            )
        )
    return tasks


def _select(ckpt: Checkpoint, keys: Sequence[str] | None) -> dict[str, list[str] | None]:
    """Which tensors of which components to read: component -> names (None = all)."""
    if keys is None:
        return {c: None for c in ckpt.components}
    wanted = list(keys)
    if ckpt.flat:
        comp = ckpt.components["model"]
        known = set(comp.tensors) | set(comp.aliases)
        unknown = [k for k in wanted if k not in known]
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


def _mmap_tensor(ckpt: Checkpoint, record: TensorRecord, label: str, maps: dict[str, Any]) -> torch.Tensor:
    import mmap as _mmap

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
) -> Any:
    """Load a checkpoint as a new state: a flat state dict, or the nested state saved.

    Reads shardpoint checkpoints, HF safetensors directories (index or single file) and
    single ``.safetensors`` files. Each tensor is read straight into freshly allocated
    memory (no mmap residency, no second copy); crc32c is checked unless ``verify=False``.

    Args:
        path: checkpoint directory or ``.safetensors`` file.
        keys: tensor names to read (flat checkpoints) or components (nested ones).
        device: where the tensors go (read through a bounded staging buffer if not CPU).
        dtype: cast floating-point tensors to this dtype while reading.
        mmap: return CPU tensors backed by the files' pages (zero-copy, lazy; not verified).
        storage_options: for fsspec URLs (not in this version).
        progress: show a progress bar (default: when stderr is a terminal).
        verify: check crc32c (default on; ``SHARDPOINT_VERIFY=0`` turns it off).

    Returns:
        ``dict[str, Tensor]`` for a flat checkpoint; the nested state otherwise.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, ChecksumMismatchError.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = sp.save({"w": torch.arange(4.0)}, d)
        >>> sp.load(d)["w"].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    if storage_options is not None:
        raise CheckpointError("storage_options is not available in this version of shardpoint")
    ckpt = open_checkpoint(path)
    check = _resolve_verify(verify) and not mmap
    device = torch.device(device)
    selection = _select(ckpt, keys)
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    tasks: list[ReadTask] = []
    maps: dict[str, Any] = {}
    for cname, names in selection.items():
        comp = ckpt.components[cname]
        wanted = list(comp.tensors) + list(comp.aliases) if names is None else names
        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            stored_name = comp.aliases.get(name, name)
            if stored_name in out:
                continue
            record = comp.tensors[stored_name]
            if mmap:
                out[stored_name] = _mmap_tensor(ckpt, record, stored_name, maps)
                continue
            stored_dtype = ckpt.entry(record.chunks[0], record.dtype, stored_name).dtype
            want_dtype = dtype if (dtype is not None and stored_dtype.is_floating_point) else stored_dtype
            dest = torch.empty(record.shape, dtype=want_dtype, device=device)
            out[stored_name] = dest
            tasks.extend(_chunk_tasks(ckpt, record, dest, label=stored_name, verify=check))
        loaded[cname] = out
    if mmap and (device.type != "cpu" or dtype is not None):
        for out in loaded.values():
            for k, t in out.items():
                out[k] = t.to(device=device, dtype=dtype if t.is_floating_point() else None)
    total = sum(t.nbytes for t in tasks)
    with byte_progress(total, f"loading {os.path.basename(os.fspath(path))}", progress) as advance:
        run_reads(tasks, advance=advance)

    result: dict[str, Any] = {}
    for cname, out in loaded.items():
        comp = ckpt.components[cname]
        for alias, stored_name in comp.aliases.items():
            if stored_name in out and (selection[cname] is None or alias in (selection[cname] or [])):
                out[alias] = out[stored_name]
        if selection[cname] is not None and ckpt.flat:
            result[cname] = {k: out[comp.aliases.get(k, k)] for k in selection[cname] or []}
        else:
            result[cname] = unflatten_state(comp.tree, _with_aliases(out, comp), where=ckpt.location)
    if ckpt.flat:
        return result["model"]
    return result


def _with_aliases(out: dict[str, torch.Tensor], comp: ComponentRecord) -> dict[str, torch.Tensor]:
    for alias, stored_name in comp.aliases.items():
        if stored_name in out:
            out.setdefault(alias, out[stored_name])
    return out


# ------------------------------------------------------------------------ load_into


def _target_tensors(target: Any) -> tuple[dict[str, torch.Tensor], torch.nn.Module | None]:
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True)), target
    if isinstance(target, Mapping) and all(isinstance(v, torch.Tensor) for v in target.values()):
        return dict(target), None
    raise InvalidStateError(
        f"load_into() takes an nn.Module or a flat dict of tensors, not {type(target).__name__}"
    )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.device.type == "meta" or b.device.type == "meta":
        return False
    return _storage_key(a) is not None and _storage_key(a) == _storage_key(b)


def _assign(module: torch.nn.Module, name: str, value: torch.Tensor, original: torch.Tensor) -> bool:
    """Replace parameter/buffer ``name`` of ``module`` by ``value``; False if not found."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        return False
    if leaf in owner._parameters:
        owner._parameters[leaf] = (
            value
            if isinstance(value, torch.nn.Parameter)
            else torch.nn.Parameter(value, requires_grad=original.requires_grad)
        )
        return True
    if leaf in owner._buffers:
        owner._buffers[leaf] = value
        return True
    return False


def load_into(
    target: Any,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    process_group: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    verify: bool | None = None,
) -> LoadResult:
    """Load a checkpoint into an existing module or state dict, in place.

    Each tensor is read straight into the target's own memory (a dtype cast, if the
    target's dtype differs, goes through a bounded staging buffer). Parameters on the
    ``meta`` device are materialized from the file on the CPU, with no second copy.
    Tied parameters are filled once and stay tied.

    Args:
        target: an ``nn.Module`` or a flat ``dict[str, Tensor]``.
        path: checkpoint directory or ``.safetensors`` file.
        strict: raise :class:`LoadMismatchError` (before reading anything) when keys are
            missing, unexpected or mis-shaped.
        progress: show a progress bar (default: when stderr is a terminal).
        verify: check crc32c (default on).

    Returns:
        A :class:`LoadResult` listing missing, unexpected and mismatched keys.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = sp.save(model.state_dict(), d)
        >>> sp.load_into(torch.nn.Linear(2, 2), d).ok
        True
    """
    if process_group is not None or storage_options is not None:
        raise CheckpointError(
            "process_group and storage_options are not available in this version of shardpoint"
        )
    targets, module = _target_tensors(target)
    ckpt = open_checkpoint(path)
    if not ckpt.flat:
        raise CheckpointError(
            f"{ckpt.location} holds a nested state; loading it into a module is not available "
            "in this version (use sp.load)"
        )
    comp = ckpt.components["model"]
    available = set(comp.tensors) | set(comp.aliases)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    matched: list[str] = []
    for name, tensor in targets.items():
        if name not in available:
            continue
        record = comp.tensors[comp.aliases.get(name, name)]
        if tuple(tensor.shape) != record.shape:
            mismatched.append((name, record.shape, tuple(tensor.shape)))
        else:
            matched.append(name)
    missing = [n for n in targets if n not in available]
    # A target key tied to a loaded one (same parameter / memory) is covered by it.
    missing = [n for n in missing if not any(_same_memory(targets[n], targets[m]) for m in matched)]
    unexpected = [n for n in available if n not in targets]
    # An alias in the checkpoint whose target is tied to its stored twin is not unexpected.
    result = LoadResult(missing, unexpected, mismatched)
    if strict and not result.ok:
        raise LoadMismatchError(_mismatch_message(ckpt.location, result), result)

    check = _resolve_verify(verify)
    tasks: list[ReadTask] = []
    after: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, temp) copies after reading
    materialized: dict[int, torch.Tensor] = {}  # id(meta param) -> new tensor
    assigned: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    filled: list[torch.Tensor] = []
    for name in matched:
        tensor = targets[name]
        stored = comp.aliases.get(name, name)
        if tensor.device.type == "meta":
            if module is None:
                raise InvalidStateError(f"target tensor {name!r} is on the meta device; pass the module")
            new = materialized.get(id(tensor))
            if new is None:
                new = torch.empty(tensor.shape, dtype=tensor.dtype)
                materialized[id(tensor)] = new
                tasks.extend(_chunk_tasks(ckpt, comp.tensors[stored], new, label=stored, verify=check))
            assigned.append((name, new, tensor))
            continue
        if any(_same_memory(tensor, f) for f in filled):
            continue  # tied to a tensor already being filled
        filled.append(tensor)
        dest = tensor.detach()
        if not dest.is_contiguous():
            temp = torch.empty(dest.shape, dtype=dest.dtype)
            after.append((dest, temp))
            dest = temp
        tasks.extend(_chunk_tasks(ckpt, comp.tensors[stored], dest, label=stored, verify=check))
    total = sum(t.nbytes for t in tasks)
    with torch.no_grad(), byte_progress(total, f"loading {os.path.basename(os.fspath(path))}", progress) as advance:
        run_reads(tasks, advance=advance)
        for dest, temp in after:
            dest.copy_(temp)
    if module is not None and assigned:
        params: dict[int, torch.Tensor] = {}
        for name, new, original in assigned:
            value = params.get(id(original))
            if value is None:
                value = (
                    torch.nn.Parameter(new, requires_grad=original.requires_grad)
                    if isinstance(original, torch.nn.Parameter)
                    else new
                )
                params[id(original)] = value
            if not _assign(module, name, value, original):
                module.load_state_dict({name: value}, strict=False, assign=True)
    return result


def _mismatch_message(location: str, result: LoadResult) -> str:
    def show(items: Sequence[Any]) -> str:
        head = ", ".join(repr(i) if isinstance(i, str) else f"{i[0]!r} (saved {list(i[1])}, target {list(i[2])})" for i in items[:10])
        return head + (f" and {len(items) - 10} more" if len(items) > 10 else "")

    parts = [f"loading {location} into the target does not match (strict=True):"]
    if result.missing_keys:
        parts.append(f"missing from the checkpoint: {show(result.missing_keys)}")
    if result.unexpected_keys:
        parts.append(f"unexpected (in the checkpoint, not the target): {show(result.unexpected_keys)}")
    if result.mismatched_keys:
        parts.append(f"shape mismatch: {show(result.mismatched_keys)}")
    parts.append("pass strict=False to load the matching tensors and get this report as the result")
    return "\n  ".join(parts)
