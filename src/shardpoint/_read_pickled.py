"""``sp.load`` / ``sp.load_into`` of Hugging Face ``.bin`` weights (``torch.save`` files).

A model directory with ``pytorch_model.bin`` or ``pytorch_model.bin.index.json`` (and no
safetensors files), or a ``.bin`` / ``.pt`` file itself, is read with
``torch.load(weights_only=True, mmap=True)`` one batch of tensors at a time (the streaming
sources of ``convert``): each tensor is copied to its destination and the mapped pages are
dropped again, so memory stays the target plus about one batch. Nothing is unpickled beyond
what ``weights_only`` allows, and only zip-format files are read (their pickle is small
and goes through ``weights_only``'s restricted unpickler; a legacy pre-1.6 file is one
big pickle): anything else is refused (``sp.convert(..., trust_pickle=True)`` is the way
for trusted files). There is no crc32c in these files, so nothing is verified beyond their
structure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import CheckpointError, CheckpointNotFoundError, InvalidStateError, LoadMismatchError

if TYPE_CHECKING:
    from ._stream_source import SourceSpec

Placement = Callable[[str, torch.Tensor], tuple[torch.device, torch.dtype]]


def route(path: str | os.PathLike[str]) -> tuple[str | os.PathLike[str], SourceSpec | None]:
    """What a load of local ``path`` reads, resolved once (the rules of ``convert``):
    ``(path, None)`` for safetensors, ours or an HF directory, where a ``model.pt`` with a
    ``model.safetensors`` beside it becomes the sibling (same weights, no unpickling); or
    ``(path, spec)`` for ``.bin`` / ``.pt`` weights, read zip-format only."""
    from ._stream_source import SourceSpec, resolve_source

    location = os.fspath(path)
    if "://" in location or not os.path.exists(location):
        return path, None
    try:
        real, kind, _notes = resolve_source(location)
    except CheckpointNotFoundError:
        return path, None  # not ours to explain: the safetensors reader says what is wrong
    if kind in ("torch-save", "hf-bin"):
        return path, SourceSpec(real, kind, trust_pickle=False, zip_only=True)
    return (real if kind == "safetensors" else path), None


def _open_flat(path: str | os.PathLike[str], spec: SourceSpec) -> tuple[Any, Any]:
    from ._stream_source import open_spec

    source = open_spec(spec)
    if not source.flat:
        source.close()
        raise InvalidStateError(
            f"{os.fspath(path)} holds a nested torch.save state (not a flat state dict); "
            "convert it first: `shardpoint convert SRC DST`, then load DST"
        )
    return source, source.components[0]


def _batches(source: Any, comp: Any, names: Sequence[str]) -> list[list[str]]:
    from ._stream_source import batches

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
            raise CheckpointError(
                f"{os.fspath(path)} has no tensor named {', '.join(map(repr, unknown[:10]))}; "
                "`shardpoint inspect` lists the names"
            )
        stored = list(dict.fromkeys(comp.aliases.get(k, k) for k in wanted))
        out: dict[str, torch.Tensor] = {}
        for group in _batches(source, comp, stored):
            with source.batch([(comp.name, n) for n in group], dtype) as tensors:
                for name, value in zip(group, tensors, strict=True):
                    out[name] = value.to(device=device, copy=True)
        return {k: out[comp.aliases.get(k, k)] for k in wanted}
    finally:
        source.close()


def load_pickled_into(
    target: Any,
    path: str | os.PathLike[str],
    spec: SourceSpec,
    *,
    strict: bool,
    placement: Placement,
    assign: Callable[[torch.nn.Module, str, torch.Tensor], None],
    mismatch_message: Callable[[str, Any], str],
) -> Any:
    """``sp.load_into`` of ``.bin`` weights into a module or a flat dict of tensors."""
    from ._read import LoadResult, identities

    if isinstance(target, torch.nn.Module):
        module: torch.nn.Module | None = target
        targets = target.state_dict(keep_vars=True)
    elif isinstance(target, Mapping) and all(isinstance(v, torch.Tensor) for v in target.values()):
        module, targets = None, dict(target)
    else:
        raise InvalidStateError(
            f"{os.fspath(path)} holds a flat state dict; load it into a module or a dict of tensors"
        )
    source, comp = _open_flat(path, spec)
    try:
        location = os.fspath(path)
        saved = comp.tensors
        mismatched = [
            (k, tuple(saved[k].shape), tuple(t.shape))
            for k, t in targets.items()
            if k in saved and tuple(saved[k].shape) != tuple(t.shape)
        ]
        first_with: dict[Any, str] = {}
        for key in targets:
            if key in saved:
                for ident in identities(targets[key]):
                    first_with.setdefault(ident, key)
        tied: dict[str, str] = {}  # a target key absent from the file but tied to one present
        for key in targets:
            twin = None if key in saved else next(
                (first_with[i] for i in identities(targets[key]) if i in first_with), None
            )
            if twin is not None:
                tied[key] = twin
        result = LoadResult(
            missing_keys=[k for k in targets if k not in saved and k not in tied],
            unexpected_keys=[k for k in saved if k not in targets],
            mismatched_keys=mismatched,
        )
        if strict and not result.ok:
            raise LoadMismatchError(mismatch_message(location, result))
        skip = {m[0] for m in mismatched}
        matched = [k for k in targets if k in saved and k not in skip]
        by_stored: dict[str, list[str]] = {}
        for key in matched:
            by_stored.setdefault(comp.aliases.get(key, key), []).append(key)
        for key, twin in tied.items():
            if twin in matched:
                by_stored[comp.aliases.get(twin, twin)].append(key)
        read = 0
        with torch.no_grad():
            for group in _batches(source, comp, list(by_stored)):
                with source.batch([(comp.name, n) for n in group], None) as tensors:
                    for name, value in zip(group, tensors, strict=True):
                        read += value.numel() * value.element_size()
                        made: torch.Tensor | None = None
                        for key in by_stored[name]:
                            dest = targets[key]
                            if dest.device.type != "meta":
                                if key not in tied:  # a tied twin shares the memory just filled
                                    dest.copy_(value)
                                continue
                            if module is None:
                                raise InvalidStateError(
                                    f"target tensor {key!r} is on the meta device; pass the module itself"
                                )
                            device, want = placement(key, dest)
                            if device.type == "meta":
                                continue
                            if made is None:  # tied keys get the same new tensor
                                made = value.to(device=device, dtype=want, copy=True)
                                if isinstance(dest, torch.nn.Parameter):
                                    made = torch.nn.Parameter(made, requires_grad=dest.requires_grad)
                            assign(module, key, made)
        return LoadResult(result.missing_keys, result.unexpected_keys, result.mismatched_keys, bytes_read=read)
    finally:
        source.close()
