"""``sp.load``: a checkpoint as a new state (a flat state dict or the nested state saved).

Every chunk to read is checked against its file, and the whole load against the machine's
memory, before the first allocation; then each tensor is read straight into fresh memory
(or mapped, with ``mmap=True``) in one :class:`~shardpoint._read.ReadBatch`.
"""

from __future__ import annotations

import mmap as _mmap
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._checkpoint import Checkpoint
from .._flags import check_flags
from .._flatten import unflatten_state
from .._format.dtypes import parse_dtype
from .._format.manifest import TensorRecord
from .._format.safetensors import HeaderEntry
from .._gc import collector_paused
from .._hub import resolve_hub
from .._options import OptionsArg, applied
from .._read import ReadBatch
from .._source import open_checkpoint
from .._storage.store import open_store
from ..errors import InvalidArgumentError
from .memory import check_memory
from .pickled import load_pickled, route, tied_head_hint
from .settings import device_arg, keys_arg, resolve_verify, staging_size


def _mmap_tensor(ckpt: Checkpoint, record: TensorRecord, label: str, maps: dict[str, Any]) -> torch.Tensor:
    record = ckpt.resolved(record)
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
    wanted = list(keys)
    if ckpt.flat:
        comp = ckpt.components["model"]
        unknown = [k for k in wanted if k not in comp.tensors and k not in comp.aliases]
        if unknown:
            raise InvalidArgumentError(
                f"{ckpt.location} has no tensor named {', '.join(map(repr, unknown[:10]))}"
                + (f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else "")
                + "; `shardpoint inspect` lists the names" + tied_head_hint(unknown, list(comp.tensors))
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
    check_flags("load", mmap=mmap, allow_pickle=allow_pickle, progress=progress, verify=verify,
                optional=("progress", "verify"))
    with applied(options):
        keys, device, dtype = keys_arg(keys), device_arg(device), parse_dtype(dtype)
        path, storage_options = resolve_hub(path, storage_options)
        store, pickled = route(open_store(path, storage_options))  # the path resolved once, here
        if pickled is not None:
            if mmap:
                raise InvalidArgumentError(
                    f"{os.fspath(path)} holds .bin (torch.save) weights; mmap=True needs safetensors: "
                    "load it with mmap=False, or convert it first (shardpoint convert)"
                )
            return load_pickled(path, pickled, keys=keys, device=torch.device(device), dtype=dtype)
        with collector_paused(), open_checkpoint(store, lazy=True) as ckpt:
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
    if mmap and not ckpt.local_files:
        raise InvalidArgumentError(f"{ckpt.location}: mmap=True needs local files; load it with mmap=False")
    device = torch.device(device)
    batch = ReadBatch(ckpt, verify=resolve_verify(verify) and not mmap, staging_bytes=staging_size(max_buffer_bytes))
    maps: dict[str, Any] = {}
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    selection = _selection(ckpt, keys)
    # Every chunk to read is checked against its file before the first allocation.
    total = 0
    files: set[str] = set()
    entries: dict[tuple[str, str], HeaderEntry] = {}
    """(component, stored name) -> the header entry of a tensor stored in one chunk (checked
    once; two components may hold tensors of the same name)."""
    records: dict[tuple[str, str], TensorRecord] = {}
    """(component, stored name) -> its record, its chunks listed (format 3's from the tables)."""
    entry_of = ckpt.entry
    for cname, names in selection.items():
        comp = ckpt.components[cname]
        stored_names = dict.fromkeys(comp.aliases.get(n, n) for n in (list(comp.tensors) if names is None else names))
        for stored in stored_names:
            record = records[(cname, stored)] = ckpt.resolved(comp.tensors[stored])
            if len(record.chunks) == 1:
                chunk = record.chunks[0]
                entry = entries[(cname, stored)] = entry_of(chunk, record.dtype, stored)
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
            record = records[(cname, stored)]
            if mmap:
                t = _mmap_tensor(ckpt, record, stored, maps)
                if device.type != "cpu" or (dtype is not None and t.is_floating_point()):
                    if dtype is not None and t.is_floating_point():
                        batch.out_of_range.check(stored, t, dtype)
                    t = t.to(device=device, dtype=dtype if t.is_floating_point() else None)
                out[stored] = t
            else:
                out[stored] = batch.new(record, stored, device=device, dtype=dtype, entry=entries.get((cname, stored)))
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
