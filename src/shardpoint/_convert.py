"""convert: any checkpoint we can read -> an HF-layout shardpoint checkpoint, streaming.

Orchestration only: open the source (``_sources.open``), describe the output as meta
tensors (output dtype and shape), and hand it to the one writer (``write_checkpoint``:
shard planning, indexes, manifest, atomic commit) with a producer (``produce=``) that
writes each planned file's tensors a batch at a time from the source. Peak memory is about one batch
(``BATCH_BYTES``, or one tensor when larger), never the model.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ._flags import check_flags
from ._format.companions import travels_with_weights
from ._format.dtypes import OutOfRange, parse_dtype, range_lost
from ._hub import local_path
from ._io.writes import FileWrite, write_files
from ._module_fit import keep_fp32_pattern
from ._prepare import Component, PreparedState
from ._sizes import parse_size
from ._source import list_directory
from ._sources.contract import BATCH_BYTES, Ref, SourceSpec, TensorSource, batches, meta_like
from ._sources.open import open_source, open_spec
from ._storage.paths import member_path, read_small_file
from ._storage.store import home_expanded
from ._write import SaveInfo, json_metadata, write_checkpoint
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
)


@dataclass(frozen=True)
class _Entry:
    """One tensor of an output file: where it goes and where it comes from."""

    key: str
    ref: Ref
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _FileJob:
    name: str
    header: bytes
    size: int
    entries: tuple[_Entry, ...]

    @property
    def tensor_bytes(self) -> int:
        return sum(meta_like(e.dtype, e.shape).nbytes for e in self.entries)


def _write_job(
    source: TensorSource,
    directory: str,
    job: _FileJob,
    dtype: torch.dtype | None,
    *,
    durable: bool,
    advance: Callable[[int], None] | None,
    budget: int = BATCH_BYTES,
    overflowed: list[tuple[str, int, float]] | None = None,
) -> dict[tuple[str, str], int]:
    """Write one output file, its tensors read from ``source`` a batch at a time; a tensor
    whose cast to ``dtype`` overflowed finite values to infinity is added to ``overflowed``
    as (key, how many, largest magnitude)."""
    crcs: dict[tuple[str, str], int] = {}
    sizes = []  # memory a tensor holds while written: its source bytes, plus the cast copy
    for e in job.entries:
        src = source.descriptor(e.ref)
        out = meta_like(e.dtype, e.shape).nbytes
        sizes.append(src.nbytes + (out if src.dtype != e.dtype else 0))
    first = True
    for run in batches(sizes, budget):
        entries = [job.entries[i] for i in run]
        kept = {id(e) for e in entries if dtype is not None and source.descriptor(e.ref).dtype == e.dtype}
        entries = [e for e in entries if id(e) not in kept] + [e for e in entries if id(e) in kept]
        split = len(entries) - len(kept)  # cast ones first, then those read as stored (float32 kept)
        with _batch(source, entries[:split], dtype) as cast, _batch(source, entries[split:], None) as as_stored:
            tensors = [*cast, *as_stored]
            for e, t in zip(entries, tensors, strict=True):
                if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                    raise CorruptCheckpointError(
                        f"{source.spec.path}: tensor {e.ref[1]!r} read as {t.dtype}{list(t.shape)}, "
                        f"expected {e.dtype}{list(e.shape)}; the source changed while converting"
                    )
            if overflowed is not None and dtype is not None:
                for e, t in zip(entries, tensors, strict=True):
                    found = _overflow(source, e.ref, t)
                    if found is not None:
                        overflowed.append((e.key, *found))
            items = tuple((e.key, t, e.offset) for e, t in zip(entries, tensors, strict=True))
            part = FileWrite(job.name, job.header if first else b"", job.size, items)
            # shared: opened without truncation, so the file is filled in several calls.
            crcs.update(write_files(directory, [part], durable=False, advance=advance, shared=True))
        del tensors, cast, as_stored, items, part  # free this batch (cast copies) before reading the next
        first = False
    if durable:
        fd = os.open(os.path.join(directory, job.name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return crcs


def _batch(source: TensorSource, entries: Sequence[_Entry], dtype: torch.dtype | None
           ) -> AbstractContextManager[Sequence[torch.Tensor]]:
    """``source.batch`` of ``entries`` (nothing read for none)."""
    return source.batch([e.ref for e in entries], dtype) if entries else contextlib.nullcontext(())


def _overflow(source: TensorSource, ref: Ref, cast: torch.Tensor) -> tuple[int, float] | None:
    """(finite values the cast made infinite or clipped, largest magnitude of the source), or
    None, counted as loads count them (:class:`OutOfRange`). The source is read again only
    where the cast holds a value at the edge of its range or past it."""
    largest = range_lost(source.descriptor(ref).dtype, cast.dtype)
    if largest is None:
        return None
    wide = cast if cast.element_size() > 1 else cast.float()  # float8 has no isfinite
    if not bool((~torch.isfinite(wide) | (wide.abs() >= largest)).any()):
        return None  # nothing at inf, nan or the edge of the range: nothing overflowed
    tally = OutOfRange()
    with source.batch([ref], None) as (before,):  # float8_e4m3fn: 448 in newer torch, nan in older
        tally.check("", before, cast.dtype)
    found = tally.found.get("")
    return None if found is None else found[1:]


# Worker processes (``workers > 1``): each opens the source once and writes whole files.
_worker_source: TensorSource | None = None


def _worker_init(spec: SourceSpec) -> None:
    global _worker_source
    torch.set_num_threads(1)
    _worker_source = open_spec(spec)


def _worker_write(
    directory: str, job: _FileJob, dtype: torch.dtype | None, durable: bool
) -> tuple[dict[tuple[str, str], int], list[tuple[str, int, float]]]:
    assert _worker_source is not None
    overflowed: list[tuple[str, int, float]] = []
    crcs = _write_job(_worker_source, directory, job, dtype, durable=durable, advance=None, overflowed=overflowed)
    return crcs, overflowed


class _StreamingWrite:
    """The producer convert gives the writer: it writes the planned files (their tensors
    ``meta`` descriptors) with the tensors read from the source."""

    def __init__(
        self, source: TensorSource, refs: dict[int, Ref], dtype: torch.dtype | None, workers: int
    ) -> None:
        self.source = source
        self.refs = refs
        self.dtype = dtype
        self.workers = workers
        self.overflowed: list[tuple[str, int, float]] = []
        """(key, values made infinite, largest magnitude) of each tensor the cast overflowed."""

    def __call__(
        self,
        directory: str,
        files: Sequence[FileWrite],
        *,
        durable: bool,
        advance: Callable[[int], None] | None = None,
        **_: Any,
    ) -> dict[tuple[str, str], int]:
        jobs = [
            _FileJob(
                f.name,
                f.header,
                f.size,
                tuple(
                    _Entry(k, self.refs[id(t)], off, t.dtype, tuple(t.shape))
                    for k, t, off in f.tensors
                ),
            )
            for f in files
        ]
        crcs: dict[tuple[str, str], int] = {}
        if self.workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                crcs.update(
                    _write_job(
                        self.source, directory, job, self.dtype, durable=durable, advance=advance,
                        overflowed=self.overflowed,
                    )
                )
            return crcs
        context = multiprocessing.get_context("spawn")
        workers = min(self.workers, len(jobs))
        with ProcessPoolExecutor(
            workers, mp_context=context, initializer=_worker_init, initargs=(self.source.spec,)
        ) as pool:
            futures = [
                (job, pool.submit(_worker_write, directory, job, self.dtype, durable))
                for job in jobs
            ]
            for job, fut in futures:
                written, overflowed = fut.result()
                crcs.update(written)
                self.overflowed.extend(overflowed)
                if advance is not None:
                    advance(job.tensor_bytes)
        return crcs


def kept_in_fp32(config: bytes | None, dtype: torch.dtype | None) -> re.Pattern[str] | None:
    """The keys ``from_pretrained(dtype=dtype)`` keeps in float32 for the model class the
    ``config.json`` names (its ``architectures``; ``transformers`` installed), as
    :func:`~shardpoint._module_fit.keep_fp32_pattern` finds them on a model; else None."""
    if config is None or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        names = json.loads(config).get("architectures") or []
        import transformers
    except (ValueError, AttributeError, ImportError):
        return None
    for name in names if isinstance(names, list) else []:
        cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        if isinstance(cls, type):
            return keep_fp32_pattern(cls, dtype)
    return None


def output_state(
    source: TensorSource, dtype: torch.dtype | None, keep_fp32: re.Pattern[str] | None = None
) -> tuple[PreparedState, dict[int, Ref]]:
    """The output as meta tensors of the output dtype (float32 kept for the keys
    ``keep_fp32`` finds, as ``from_pretrained`` keeps them), and id(descriptor) -> source ref."""
    refs: dict[int, Ref] = {}
    components = []
    for comp in source.components:
        out: dict[str, torch.Tensor] = {}
        for name in comp.stored:
            src = comp.tensors[name]
            want = dtype if (dtype is not None and src.is_floating_point()) else src.dtype
            if keep_fp32 is not None and src.dtype == torch.float32 and keep_fp32.search(name):
                want = torch.float32
            out[name] = meta_like(want, src.shape)
            refs[id(out[name])] = (comp.name, name)
        for alias, stored in comp.aliases.items():
            out[alias] = out[stored]
        components.append(
            Component(comp.name, comp.tree, out, list(comp.stored), dict(comp.aliases))
        )
    return PreparedState(components, source.flat), refs


def _flat_tree(tree: dict[str, Any]) -> bool:
    """A component tree that is a plain ``{name: tensor}`` dict (a model state dict)."""
    return tree.get("type") == "dict" and all(
        kind == "str" and node.get("type") == "tensor" and node.get("name") == key
        for kind, key, node in tree.get("items", [])
    )


def select_components(source: TensorSource, names: Sequence[str] | None) -> None:
    """Keep only the components ``names`` of ``source`` (all when None), in that order.

    Selecting only ``model``, a plain state dict, gives a flat checkpoint (``sp.load``
    returns the state dict itself), as publishing a model wants.

    Raises:
        CheckpointError: a name is not a component of the source (the message lists the
            components there are).
    """
    if names is None:
        return
    have = {c.name: c for c in source.components}
    missing = [n for n in names if n not in have]
    if missing or not names:
        raise InvalidArgumentError(
            f"{source.spec.path} has no component named "
            f"{', '.join(repr(n) for n in missing) if missing else '(no name given)'}; it has "
            f"{', '.join(repr(n) for n in have)}: name one or more of these "
            "(CLI: --component NAME, repeatable)"
        )
    chosen = [have[n] for n in dict.fromkeys(names)]
    source.components = chosen
    source.flat = [c.name for c in chosen] == ["model"] and (
        source.flat or _flat_tree(chosen[0].tree)
    )


_opened: ContextVar[list[TensorSource] | None] = ContextVar("shardpoint_convert_opened", default=None)
"""Inside :func:`run_convert`: where :func:`convert` leaves the source it opened."""


def run_convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], **kwargs: Any) -> tuple[SaveInfo, TensorSource]:
    """:func:`convert`, also returning the (closed) source: its kind and notes, for the CLI."""
    opened: list[TensorSource] = []
    token = _opened.set(opened)
    try:
        info = convert(src, dst, **kwargs)
    finally:
        _opened.reset(token)
    return info, opened[0]


COMPANION_LIMIT = 256 << 20
"""Largest file :func:`companion_files` copies (a big tokenizer is tens of MB)."""


def companion_files(src: str, dtype: torch.dtype | None, notes: list[str], dst: str | None = None) -> dict[str, bytes]:
    """The files of the model folder ``src`` that belong beside its converted weights
    (``companions.travels_with_weights``: config, tokenizer, processor files, model card),
    by name, so the output loads with ``from_pretrained`` as the source did; a note in
    ``notes`` lists them. Empty for a file or a folder without them.

    With ``dtype``, the ``dtype`` / ``torch_dtype`` entries of ``config.json`` (and of the
    sub-configs in it) name the new dtype: ``from_pretrained(dtype="auto")`` then loads the
    weights in the dtype they are stored in. Each file is read as the checkpoint's own
    files are (:func:`member_path`: links into an HF cache's blobs followed, others out of
    the folder refused; a regular file, at most :data:`COMPANION_LIMIT` bytes).

    ``dst``: an existing folder being overwritten (not ``src`` itself). Its own files of
    those names stay: the user's ``config.json``, notes and tokenizer are never replaced by
    the source's (its ``config.json`` names the new dtype, the one edit it gets).
    """
    if not os.path.isdir(src):
        return {}
    out: dict[str, bytes] = {}
    skipped = []
    kept = []
    for name in sorted(list_directory(src, "convert")):
        if not travels_with_weights(name) or not os.path.isfile(os.path.join(src, name)):
            continue
        if dst is not None and os.path.lexists(os.path.join(dst, name)):
            kept.append(name)
            if name != "config.json":
                continue
            own, theirs = _companion(dst, name), _companion(src, name)
            if own is not None and theirs is not None and not _same_config(theirs, own):
                warnings.warn(
                    f"convert: kept {dst}'s own config.json, which describes another model than {src}'s (they "
                    f"differ in more than the dtype); if {dst} held another model, its config no longer fits the "
                    "new weights: copy the source's config.json there", UserWarning, stacklevel=3)
            if own is not None and dtype is not None and (updated := _config_in_dtype(own, dtype)) != own:
                out[name] = updated
            continue
        try:
            data = _read_companion(src, name)
        except CheckpointError as exc:
            skipped.append(f"{name} ({exc})")
            continue
        if name == "config.json" and dtype is not None:
            data = _config_in_dtype(data, dtype)
        out[name] = data
    copied = [name for name in out if name not in kept]
    if copied:
        notes.append(f"copied from {src} beside the weights: {', '.join(copied)}")
    if kept:
        notes.append(f"kept {dst}'s own {', '.join(kept)} (the source's were not copied over them"
                     + ("; its config.json now names the new dtype)" if "config.json" in out else ")"))
    if skipped:
        notes.append(f"not copied: {'; '.join(skipped)}")
    return out


def _read_companion(folder: str, name: str) -> bytes:
    """A companion file, read as the checkpoint's own files are (:func:`member_path`)."""
    path = member_path(folder, name, where=folder)
    return read_small_file(path, where=path, limit=COMPANION_LIMIT)


def _companion(folder: str, name: str) -> bytes | None:
    """:func:`_read_companion`, or None where it cannot be read (a link out of the folder)."""
    try:
        return _read_companion(folder, name)
    except CheckpointError:
        return None


def _same_config(a: bytes, b: bytes) -> bool:
    """Whether two ``config.json`` files describe the same model (dtype entries aside);
    unparseable ones count as the same (nothing to warn about that is known)."""
    try:
        docs = [json.loads(a), json.loads(b)]
    except ValueError:
        return True

    def plain(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: plain(v) for k, v in node.items() if k not in ("dtype", "torch_dtype")}
        return node

    return bool(plain(docs[0]) == plain(docs[1]))


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _config_in_dtype(data: bytes, dtype: torch.dtype) -> bytes:
    """``config.json`` with its ``dtype`` / ``torch_dtype`` entries naming ``dtype`` (its
    sub-configs' too); unchanged where it is not a JSON object or names none."""
    try:
        config = json.loads(data)
    except ValueError:
        return data
    changed = False
    name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))

    def rename(node: Any, depth: int) -> None:
        nonlocal changed
        if not isinstance(node, dict) or depth > 8:
            return
        for key, value in node.items():
            if key in ("dtype", "torch_dtype") and isinstance(value, str) and value != name:
                node[key] = name
                changed = True
            else:
                rename(value, depth + 1)

    rename(config, 0)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode() if changed else data


def _overwritten_folder(src: str | os.PathLike[str], dst: str | os.PathLike[str], overwrite: bool) -> str | None:
    """``dst`` when the convert replaces a local folder other than ``src`` (whose own
    companion files then stay), else None."""
    if not overwrite or not isinstance(dst, (str, os.PathLike)) or "://" in os.fspath(dst):
        return None
    where = os.fspath(dst)
    if not os.path.isdir(where) or os.path.islink(where):
        return None
    try:
        if os.path.samefile(where, os.fspath(src)):
            return None  # in place: its config.json takes the new dtype like any other convert
    except OSError:
        pass
    return where


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    trust_pickle: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    workers: int = 1,
    cache_dir: str | os.PathLike[str] | None = None,
    components: Sequence[str] | None = None,
) -> SaveInfo:
    """Convert a checkpoint to an HF-layout shardpoint checkpoint, tensor by tensor.

    Reads, without ever holding the whole source in memory (peak about one 64 MB batch of
    tensors, or the largest tensor):

    - a ``torch.save`` file (``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt``), memory-mapped with
      ``torch.load(weights_only=True, mmap=True)``. A nested training state (model,
      optimizer state dict, epoch, ...) converts whole: each top-level key becomes a
      component, as with ``sp.save``. If ``model.pt`` has a ``model.safetensors`` sibling,
      the sibling is read instead (same tensors, no unpickling).
    - a Hugging Face ``.bin`` sharded directory (``pytorch_model.bin.index.json``), one
      shard mapped at a time.
    - a safetensors checkpoint: ours (any layout: ``chunked`` distributed saves are
      consolidated into whole tensors here) or a Hugging Face directory / file, to reshard
      (``max_shard_size``) or cast (``dtype``).
    - a ``torch.distributed.checkpoint`` (DCP) directory, only with ``trust_pickle=True``
      (its ``.metadata`` is a pickle); read a batch of tensors per ``dcp.load``. In
      torchtitan's layout (model keys at the top level beside ``optimizer``,
      ``train_state``, ...) the top-level tensors are the component ``model`` (HF files
      and index) and each nested entry a component of its own.

    The output is written through the normal atomic commit (temporary directory, fsync,
    indexes, manifest, rename): the ``model`` component is exactly what
    ``transformers.from_pretrained`` reads. From a model folder, the files that describe
    the model (``config.json``, generation config, tokenizer and processor files, custom
    code, README, license; not a ``Trainer``'s training state) are copied beside the
    weights in the same commit, ``config.json`` naming the new ``dtype`` where one is given.

    Args:
        src: file or directory to read, or ``hf://org/name[@revision][/subfolder]``: a
            repository in the local Hugging Face cache (never downloaded).
        dst: the checkpoint directory to create.
        max_shard_size: largest output file, e.g. ``"5GB"`` or ``"500MiB"``.
        dtype: cast every floating-point tensor (all components) to ``"bf16"``,
            ``"fp16"`` or ``"fp32"``; integer and bool tensors are kept, and so are the
            float32 tensors ``from_pretrained(dtype=...)`` keeps in float32 for the model
            class ``config.json`` names (its ``_keep_in_fp32_modules`` for float16, and
            ``_keep_in_fp32_modules_strict``; ``transformers`` installed).
        trust_pickle: allow a full unpickle (torch.save files that ``weights_only``
            refuses, DCP). Unpickling runs code from the file: only for trusted files.
            Values that are not tensors, containers or JSON are then stored pickled
            (loading them needs ``allow_pickle=True``).
        overwrite: replace an existing checkpoint at ``dst`` (atomically).
        progress: show a progress bar (default: when stderr is a terminal).
        workers: processes writing output files in parallel (each opens the source and
            holds one batch; worth it for many output files on fast storage). They are
            started with ``spawn``, which imports the calling script again in each: call
            ``convert`` from under ``if __name__ == "__main__":`` in a script, as
            ``multiprocessing`` requires, or the script's top level runs again in each worker.
        cache_dir: the Hugging Face cache an ``hf://`` source is looked up in (default:
            ``huggingface_hub``'s, from ``HF_HUB_CACHE`` / ``HF_HOME``).
        components: convert only these components (e.g. ``["model"]`` to publish the
            weights without the optimizer); default all. Only ``model``, a plain state
            dict, gives a flat checkpoint.

    Returns:
        The :class:`SaveInfo` of the written checkpoint.

    Raises:
        UnsafePickleError: the source needs a full unpickle and ``trust_pickle`` is False
            (the message names the file).
        CheckpointNotFoundError: nothing convert can read at ``src``.
        CheckpointError: a name in ``components`` is not a component of ``src``.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> torch.save({"w": torch.ones(2, 2)}, os.path.join(d, "model.pt"))
        >>> info = sp.convert(os.path.join(d, "model.pt"), os.path.join(d, "out"), dtype="bf16")
        >>> sp.load(os.path.join(d, "out"))["w"].dtype
        torch.bfloat16
    """
    check_flags("convert", trust_pickle=trust_pickle, overwrite=overwrite, progress=progress, optional=("progress",))
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise InvalidArgumentTypeError(f"convert(workers={workers!r}): pass a whole number of processes (1 or more)")
    src, dst = local_path(src, cache_dir), home_expanded(dst)
    max_bytes = parse_size(max_shard_size)
    want = parse_dtype(dtype)
    if workers < 1:
        raise InvalidArgumentError(f"convert: workers must be at least 1, not {workers}")
    if isinstance(components, str):
        components = [components]
    source = open_source(src, trust_pickle=trust_pickle)
    opened = _opened.get()
    if opened is not None:
        opened.append(source)
    try:
        select_components(source, components)
        companions = companion_files(os.fspath(src), want, source.notes, _overwritten_folder(src, dst, overwrite))
        prepared, refs = output_state(source, want, kept_in_fp32(companions.get("config.json"), want))
        producer = _StreamingWrite(source, refs, want, workers)
        info = write_checkpoint(
            prepared,
            dst,
            max_shard_bytes=max_bytes,
            overwrite=overwrite,
            metadata=json_metadata(source.metadata),
            durable=True,
            progress=progress,
            produce=producer,
            extra_files=companions,
        )
        if producer.overflowed and want is not None:
            tally = OutOfRange()
            for key, count, largest in producer.overflowed:
                tally.add(key, want, count, largest)
            warnings.warn(str(tally.message("convert to", f"in {os.fspath(dst)}")), UserWarning, stacklevel=2)
    finally:
        source.close()
    return info
