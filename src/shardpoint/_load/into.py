"""``sp.load_into``: a checkpoint into the user's objects, in place.

Opens the checkpoint (over a process group, every rank the same save), pairs the target's
components with the saved ones, and hands them to the :class:`~shardpoint._load.planner.Planner`;
the batch runs only once the whole target is planned (and, under ``strict``, matched).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections import Counter
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from .._checkpoint import Checkpoint
from .._distributed.group import Group, resolve_group
from .._flags import check_flags
from .._format.dtypes import parse_dtype
from .._gc import collector_paused
from .._hub import resolve_hub
from .._options import OptionsArg, applied
from .._progress import byte_progress, loading_label
from .._read import ReadBatch
from .._source import OPEN_TRIES, open_checkpoint
from .._sources.contract import SourceSpec
from .._stateful import find_modules, parameter_names, state_objects
from .._storage.store import open_store
from ..errors import (
    CheckpointError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidStateError,
    LoadMismatchError,
    StorageError,
    _extended,
)
from .pickled import PickledBatch, route
from .planner import Planner
from .result import LoadResult, mismatch_message
from .settings import (
    IntoSettings,
    device_arg,
    device_map_arg,
    is_auto,
    resolve_verify,
    staging_size,
)


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
    device_map: Mapping[str, str | int | torch.device] | str | int | torch.device | None = None,
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
            where no key at all matches raises even with ``strict=False``, and so does one
            that would copy fractions into an integer or bool parameter or tensor (or complex
            values into a real one): that drops part of each value.
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
            as ``from_pretrained(dtype=...)`` (``"auto"``: the checkpoint's own, the dtype
            its ``config.json`` names, else the one holding most of its floating-point
            elements): integer and bool tensors keep theirs,
            a ``transformers`` model's non-persistent buffers take the dtype its class
            builds them in under ``dtype`` (rotary ``inv_freq`` stays float32; other
            models' non-persistent buffers keep theirs), and keys of a
            ``transformers`` model's ``_keep_in_fp32_modules`` (float16) /
            ``_keep_in_fp32_modules_strict`` (float16, bfloat16) stay float32. A real
            parameter of another dtype keeps its ``Parameter`` object (new ``.data``).
            Tensors of plain dicts in the target are filled in place and keep their dtype
            (an EMA kept in float32 beside a bfloat16 model stays float32). A module's
            DTensor (FSDP2, tensor parallel) is filled where it is: another dtype than its
            own is refused before reading (convert the model before sharding it).
        device_map: module-name prefix -> device for ``meta`` parameters (the longest
            prefix wins; ``"meta"`` leaves them unmaterialized, listed in
            ``LoadResult.kept_off_keys``), as Accelerate's; or one
            device for all (``"cpu"``, ``0``); or ``"auto"`` / ``"balanced"`` /
            ``"balanced_low_0"`` / ``"sequential"``: accelerate's map for the target module.
            Disk offload is not supported.
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
    check_flags("load_into", strict=strict, allow_pickle=allow_pickle, progress=progress, verify=verify,
                optional=("progress", "verify"))
    if isinstance(target, type):
        raise InvalidArgumentTypeError(
            f"load_into loads into objects that exist, and got the class {target.__name__}: build it first, e.g. "
            f"model = sp.empty_model({target.__name__}, config) (weights on meta, filled by the load), then "
            "sp.load_into(model, path)"
        )
    with applied(options):
        group = resolve_group(process_group, target)

        planned: list[Callable[[], LoadResult]] = []

        def plan_here() -> Callable[[], LoadResult]:  # in a phase: a refusal fails alike on every rank
            auto = is_auto(dtype)
            cast = None if auto else parse_dtype(dtype)
            settings = IntoSettings(strict, progress, resolve_verify(verify), allow_pickle, device_arg(device),
                                    cast, device_map_arg(device_map, target, cast), staging_size(max_buffer_bytes),
                                    ranks_here, auto_dtype=auto)
            planned.append(_load_into(target, path, settings, storage_options, opened))
            return planned[-1]

        with collector_paused():
            # the ranks on this machine share its CPUs (1 without a group)
            opened, ranks_here = _open_on_every_rank(group, path, storage_options)
            try:
                if not group.distributed:
                    return plan_here()()
                # Planned and checked on every rank before any rank reads a byte: a refusal on
                # one rank (strict, a misfit) leaves every target as it was.
                read = group.phase(f"planning the load of {os.fspath(path)}", plan_here)
                return group.phase(f"loading {os.fspath(path)}", read)
            finally:
                for read in planned:  # a plan another rank refused is never read: its files close here
                    discard = getattr(read, "discard", None)
                    if discard is not None:
                        discard()
                if opened is not None:
                    opened.close()


def _open_on_every_rank(group: Group, path: str | os.PathLike[str],
                        storage_options: Mapping[str, Any] | None) -> tuple[Checkpoint | None, int]:
    """In a process group, open the checkpoint on every rank and agree that all opened the
    same save (its ``save_id``); a save committed between two ranks' opens makes every rank
    open again (a few times). Also how many ranks share this rank's machine (same host
    name), counted by the coordinator: each rank hears its own count, not every rank's host.
    (None, 1) without a group; the checkpoint is None for ``.bin`` weights."""
    if not group.distributed:
        return None, 1
    where = os.fspath(path)
    host = socket.gethostname()

    def open_here() -> tuple[Checkpoint | None, Any]:
        hub_path, options = resolve_hub(path, storage_options)
        store, pickled = route(open_store(hub_path, options))
        if pickled is not None:
            return None, (None, host, store.location)
        ckpt = open_checkpoint(store, lazy=True)
        return ckpt, (ckpt.manifest.save_id if ckpt.manifest is not None else None, host, store.location)

    def decide(reports: list[tuple[str | None, str, str]]) -> list[tuple[bool, int]]:
        save_ids = {save_id for save_id, _, _ in reports}
        places = {place for _, _, place in reports}
        if len(places) > 1 and (None in save_ids or len(save_ids) > 1):
            # Folders without a save id (save_pretrained's, .bin) are the same only at the same place.
            shown = "; ".join(f"rank {r}: {place}" for r, (_, _, place) in enumerate(reports[:4]))
            raise InvalidArgumentError(
                f"the ranks opened different checkpoints ({shown}{' ...' if len(reports) > 4 else ''}): every rank "
                "must load the same one (an hf:// reference resolved to another revision in some machine's cache?). "
                "Nothing was loaded"
            )
        same = len(save_ids) == 1
        per_host = Counter(h for _, h, _ in reports)
        return [(same, per_host[h]) for _, h, _ in reports]

    for _ in range(OPEN_TRIES):
        # The identity: a rank loading while another saves fails both, named, instead of one
        # rank taking the other's reply for its own.
        ckpt, (same, ranks_here) = group.exchange(f"opening {where}", open_here, decide=decide,
                                                  identity="loading a checkpoint")
        if same:
            return ckpt, ranks_here
        if ckpt is not None:
            ckpt.close()
    raise StorageError(
        f"{where}: the ranks opened different saves {OPEN_TRIES} times (it is being overwritten "
        "while being loaded); load it again once the saves to it stop, or load a fixed step"
    )


def _load_into(target: Any, path: str | os.PathLike[str], settings: IntoSettings,
               storage_options: Mapping[str, Any] | None, opened: Checkpoint | None) -> Callable[[], LoadResult]:
    """Plan the load and check it (``strict``); return what reads it (a checkpoint this opens
    itself is read before it returns)."""
    if opened is not None:  # opened (and later closed) by load_into, agreed on by every rank
        return _load_into_checkpoint(target, opened, settings)
    path, storage_options = resolve_hub(path, storage_options)
    store, pickled = route(open_store(path, storage_options))  # the path resolved once, here
    if pickled is not None:
        return _load_pickled_into(target, path, pickled, settings)
    with open_checkpoint(store, lazy=True) as ckpt:
        result = _load_into_checkpoint(target, ckpt, settings)()
    return lambda: result


@torch.no_grad()  # planning makes views of the targets' memory to read into: no autograd nodes
def _load_into_checkpoint(target: Any, ckpt: Checkpoint, settings: IntoSettings) -> Callable[[], LoadResult]:
    settings = settings.settled([(r.dtype, r.shape) for comp in ckpt.components.values() for r in comp.tensors.values()],
                                lambda: _config_of(ckpt))
    batch = ReadBatch(ckpt, verify=settings.verify, staging_bytes=settings.staging_bytes,
                      ranks_here=settings.ranks_here)
    planner = Planner(ckpt.location, batch, allow_pickle=settings.allow_pickle, device=settings.device,
                      dtype=settings.dtype, device_map=settings.device_map)
    targets = _component_targets(target, ckpt)
    _refuse_meta_optimizers(targets)
    planner.modules = find_modules(targets)
    planner.param_names = parameter_names(planner.modules)
    for cname, value in targets.items():
        comp = ckpt.components.get(cname)
        if comp is None:
            planner.missing.append(cname)
            continue
        if ckpt.flat and isinstance(value, Mapping) and not isinstance(value, torch.nn.Module):
            planner.dict_into(value, {k: k for k in list(comp.tensors) + list(comp.aliases)}, comp)
            continue
        setter = (lambda v, k=cname: target.__setitem__(k, v)) if isinstance(target, MutableMapping) else None
        planner.node(value, comp.tree, comp, "" if ckpt.flat else cname, setter)
    planner.unexpected.extend(c for c in ckpt.components if c not in targets)
    return _run(planner, batch, ckpt.location, settings)


def _refuse_meta_optimizers(targets: Any) -> None:
    """Refuse, before anything is planned, an optimizer over ``meta`` parameters: the load
    gives their model new ones, and the optimizer would keep the old, empty ones (its state
    cast to ``meta``), so training would never update the model."""
    for path, value in state_objects(targets):
        if isinstance(value, torch.optim.Optimizer) and any(
                p.is_meta for group in value.param_groups for p in group["params"]):
            raise InvalidStateError(
                f"the optimizer at {path!r} holds parameters on the meta device (built over a model made with "
                "sp.empty_model or under torch.device('meta')): a load gives such a model new parameters, and the "
                "optimizer would keep the old, empty ones, so training would never update the model. Call "
                "model.to_empty(device=...) before building the optimizer (the load then fills the parameters in "
                "place), or build it after loading the model; nothing was loaded"
            )


def _config_of(ckpt: Checkpoint) -> bytes | None:
    """The checkpoint's ``config.json`` (for ``dtype="auto"``), or None."""
    if ckpt.single_file or "config.json" not in ckpt.listing():
        return None
    try:
        return ckpt.read_member("config.json", where=os.path.join(ckpt.location, "config.json"))
    except (CheckpointError, OSError):
        return None  # unreadable: the weights decide


def _load_pickled_into(target: Any, path: str | os.PathLike[str], spec: SourceSpec,
                       settings: IntoSettings) -> Callable[[], LoadResult]:
    """``load_into`` of ``.bin`` weights (a flat state dict): the same planning, then the
    tensors read a batch at a time (the files closed once read)."""
    batch = PickledBatch(path, spec)
    settings = settings.settled((t.dtype, tuple(t.shape)) for t in batch.comp.tensors.values())
    try:
        planner = Planner(batch.location, batch, allow_pickle=False, device=settings.device, dtype=settings.dtype,
                          device_map=settings.device_map)
        comp = batch.comp
        names = {k: k for k in comp.tensors}
        if isinstance(target, torch.nn.Module):
            planner.module_into(target, names, comp, "")
        elif isinstance(target, Mapping) and all(isinstance(v, torch.Tensor) for v in target.values()):
            planner.dict_into(target, names, comp)
        else:
            raise InvalidStateError(f"{batch.location} holds a flat state dict; load it into a module or a dict of tensors")
        read = _run(planner, batch, batch.location, settings)
    except BaseException:
        batch.close()
        raise

    def read_and_close() -> LoadResult:
        try:
            return read()
        finally:
            batch.close()

    read_and_close.discard = batch.close  # type: ignore[attr-defined]
    return read_and_close


def _run(planner: Planner, batch: ReadBatch | PickledBatch, location: str,
         settings: IntoSettings) -> Callable[[], LoadResult]:
    """The planned load's report, refused under ``strict`` when not ok (nothing read yet);
    else what runs the batch, applies the target's fix-ups and counts the bytes read."""
    result = LoadResult(planner.missing, planner.unexpected, planner.mismatched, 0, planner.meta_left,
                        planner.prefix_mapping, planner.kept_off)
    if settings.strict and not result.matched:
        raise LoadMismatchError(mismatch_message(location, result), result)
    for check in planner.checks:
        check()
    return functools.partial(_read_planned, planner, batch, location, settings, result)


def _read_planned(planner: Planner, batch: ReadBatch | PickledBatch, location: str, settings: IntoSettings,
                  result: LoadResult) -> LoadResult:
    with byte_progress(batch.planned_bytes + planner.fusion_bytes, loading_label(location),
                       settings.progress) as advance:
        try:
            batch.run(False, advance)
            planner.run_fusions(advance)
        except (CheckpointError, OSError) as exc:
            # the tensors read before the failure are in the target already (read in place)
            _extended(exc, "The target may now hold part of this checkpoint's values: load a whole "
                           "checkpoint into it before using it")
            raise
        finally:
            for tensor in planner.in_place:
                torch.autograd.graph.increment_version(tensor)
    for fix in planner.post:
        fix()
    read = batch.planned_bytes if isinstance(batch, ReadBatch) else batch.bytes_read
    return dataclasses.replace(result, bytes_read=read + planner.fusion_bytes)
