"""``sp.load`` / ``sp.load_into`` of Hugging Face ``.bin`` weights (``torch.save`` files).

A model directory with ``pytorch_model.bin`` or ``pytorch_model.bin.index.json`` (and no
safetensors files), or a ``.bin`` / ``.pt`` file itself, is read with
``torch.load(weights_only=True, mmap=True)`` one batch of tensors at a time (the streaming
sources of ``convert``): each tensor is copied to its destination and the mapped pages are
dropped again, so memory stays the target plus about one batch. Nothing is unpickled beyond
what ``weights_only`` allows, and only zip-format files are read (their pickle is small
and goes through ``weights_only``'s restricted unpickler; a legacy pre-1.6 file is one
big pickle): anything else is refused (``sp.convert(..., trust_pickle=True)`` is the way
for trusted files). There is no crc32c in these files; each tensor's bytes are checked
against the CRC-32 that the zip archive records for them as they are read
(``_sources.pickled.ZipRecords``), and a record stored compressed is refused.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._format.detect import HF_BIN, TORCH_SAVE
from .._format.dtypes import OutOfRange
from .._printable import printable
from .._progress import byte_progress, loading_label
from .._source import detect_local
from .._sources.contract import SourceSpec, TensorSource, batches
from .._sources.pickled import BinShardsSource, TorchSaveSource
from .._storage.local_store import LocalStore
from .._storage.paths import member_path
from .._storage.store import Store
from ..errors import InvalidArgumentError, InvalidStateError

_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "shared.weight")


def tied_head_hint(unknown: list[str], names: list[str]) -> str:
    """Where an output head is asked for that the files do not store (``save_pretrained``
    stores tied weights once, under the input embedding's name), that name.

    >>> tied_head_hint(["lm_head.weight"], ["model.embed_tokens.weight", "model.norm.weight"])
    " (a model with tied word embeddings stores 'lm_head.weight' once, as 'model.embed_tokens.weight': load that)"
    """
    heads = [k for k in unknown if k.endswith("lm_head.weight")]
    embedding = next((n for n in names if n.endswith(_EMBEDDINGS)), None)
    if not heads or embedding is None:
        return ""
    return f" (a model with tied word embeddings stores {heads[0]!r} once, as {embedding!r}: load that)"



def route(store: Store) -> tuple[Store, SourceSpec | None]:
    """What a load of ``store`` reads, as ``_format.detect`` decides: ``(store, None)`` for
    safetensors, ours or an HF directory, where a local ``model.pt`` with a
    ``model.safetensors`` beside it becomes the sibling (same weights, no unpickling); or
    ``(store, spec)`` for local ``.bin`` / ``.pt`` weights, read zip-format only. Anything
    else (an object store too: pickled weights are read from local files only) is
    ``(store, None)``: the safetensors reader says what is wrong."""
    location = store.local_path
    if location is None or not os.path.exists(location):
        return store, None
    found = detect_local(location)
    if found.instead_of is not None and found.file is not None:
        parent = os.path.dirname(location) or "."
        sibling = member_path(parent, found.file, where=parent)
        warnings.warn(  # never a silent swap: the two files may hold different weights
            printable(f"reading {sibling} instead of {location}: a .safetensors file of the same stem sits "
                      "beside it and is read in its place (no unpickling); move it away to read the pickle"),
            UserWarning, stacklevel=4)
        return LocalStore(sibling), None
    if found.kind == HF_BIN:
        return store, SourceSpec(location, HF_BIN, trust_pickle=False, zip_only=True, index=found.index)
    if found.kind == TORCH_SAVE and found.file is not None:
        real = location if found.named_file else member_path(location, found.file, where=location)
        return store, SourceSpec(real, TORCH_SAVE, trust_pickle=False, zip_only=True)
    return store, None


def _open_flat(path: str | os.PathLike[str], spec: SourceSpec) -> tuple[TensorSource, Any]:
    source: TensorSource = BinShardsSource(spec, []) if spec.kind == HF_BIN else TorchSaveSource(spec, [])
    if not source.flat:
        source.close()
        raise InvalidStateError(
            f"{os.fspath(path)} holds a nested torch.save state (not a flat state dict); "
            "convert it first: `shardpoint convert SRC DST`, then load DST"
        )
    return source, source.components[0]


def _batches(source: Any, comp: Any, names: Sequence[str]) -> list[list[str]]:
    sizes = [comp.tensors[n].numel() * comp.tensors[n].element_size() for n in names]
    return [[names[i] for i in group] for group in batches(sizes)]


def load_pickled(
    path: str | os.PathLike[str],
    spec: SourceSpec,
    *,
    keys: Sequence[str] | None,
    device: torch.device,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """``sp.load`` of ``.bin`` weights: a flat state dict of fresh tensors."""
    source, comp = _open_flat(path, spec)
    try:
        wanted = list(comp.stored) + list(comp.aliases) if keys is None else [keys] if isinstance(keys, str) else list(keys)
        unknown = [k for k in wanted if k not in comp.tensors]
        if unknown:
            raise InvalidArgumentError(
                f"{os.fspath(path)} has no tensor named {', '.join(map(repr, unknown[:10]))}; "
                "`shardpoint inspect` lists the names" + tied_head_hint(unknown, list(comp.tensors))
            )
        stored = list(dict.fromkeys(comp.aliases.get(k, k) for k in wanted))
        out: dict[str, torch.Tensor] = {}
        tally = OutOfRange()
        for group in _batches(source, comp, stored):
            with source.batch([(comp.name, n) for n in group], None) as tensors:
                for name, value in zip(group, tensors, strict=True):
                    want = dtype if dtype is not None and value.is_floating_point() else value.dtype
                    tally.check(name, value, want)
                    out[name] = value.to(device=device, dtype=want, copy=True)
        tally.warn("load as", f"as read from {os.fspath(path)}")
        return {k: out[comp.aliases.get(k, k)] for k in wanted}
    finally:
        source.close()


class PickledBatch:
    """The reads of a ``load_into`` of ``.bin`` weights, collected as ``ReadBatch`` collects
    them (same planner), then run a batch of tensors at a time: each tensor is copied (and
    cast) into every destination planned for it and its pages dropped again."""

    def __init__(self, path: str | os.PathLike[str], spec: SourceSpec,
                 opened: tuple[TensorSource, Any] | None = None) -> None:
        self.location = os.fspath(path)
        self.spec = spec
        self.source, self.comp = opened or _open_flat(path, spec)
        self.dests: dict[str, list[tuple[torch.Tensor, tuple[int, ...] | None]]] = {}
        self.bytes_read = 0
        self.out_of_range = OutOfRange()

    def fill(self, record: Any, dest: torch.Tensor, label: str,
             offsets: tuple[int, ...] | None = None) -> None:
        """Copy tensor ``label`` (the region at ``offsets``, default all) into ``dest`` once read."""
        self.dests.setdefault(label, []).append((dest, offsets))

    def sub(self) -> PickledBatch:
        """A new, empty batch reading the same opened files (closed with this one)."""
        return PickledBatch(self.location, self.spec, (self.source, self.comp))

    def new(self, record: Any, label: str, *, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        raise InvalidStateError(f"{self.location} holds a flat state dict; load it into a module or a dict of tensors")

    @property
    def planned_bytes(self) -> int:
        return sum(self.comp.tensors[n].numel() * self.comp.tensors[n].element_size() for n in self.dests)

    def run(self, progress: bool | None, advance: Callable[[int], None] | None = None) -> None:
        """Read every planned tensor, a group at a time; ``advance`` (a bar the caller
        holds) is told of each tensor's bytes, else a bar of its own per ``progress``."""
        if advance is None:
            with byte_progress(self.planned_bytes, loading_label(self.location), progress) as bar:
                self._run(bar)
        else:
            self._run(advance)

    def _run(self, advance: Callable[[int], None] | None) -> None:
        with torch.no_grad():
            for group in _batches(self.source, self.comp, list(self.dests)):
                with self.source.batch([(self.comp.name, n) for n in group], None) as tensors:
                    for name, value in zip(group, tensors, strict=True):
                        nbytes = value.numel() * value.element_size()
                        self.bytes_read += nbytes
                        if advance is not None:
                            advance(nbytes)
                        for dest, offsets in self.dests[name]:
                            part = value
                            if tuple(dest.shape) != tuple(value.shape) or (offsets is not None and any(offsets)):
                                starts = offsets or (0,) * dest.dim()
                                part = value[tuple(slice(o, o + n) for o, n in zip(starts, dest.shape, strict=True))]
                            if dest.dtype != part.dtype:
                                self.out_of_range.check(name, part, dest.dtype)
                            dest.copy_(part)
        self.warn_out_of_range()

    def warn_out_of_range(self) -> None:
        """As :meth:`ReadBatch.warn_out_of_range`."""
        self.out_of_range.warn("load as", f"as read from {self.location}")

    def close(self) -> None:
        self.source.close()
