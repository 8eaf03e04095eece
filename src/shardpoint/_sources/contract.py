"""A checkpoint of any format, read one batch of tensors at a time: the common part.

A :class:`TensorSource` describes a checkpoint as components (name, JSON tree, stored
tensor names, aliases) whose tensors are ``meta`` descriptors (dtype and shape, no data),
and reads the tensors themselves only when asked, a few at a time, so nothing ever holds
the whole checkpoint in memory. The formats are implemented beside it:
``pickled`` (``torch.save`` files, HF ``.bin`` shards) and ``open``
(safetensors through :class:`~shardpoint._read.ReadBatch`, DCP), which also opens any
path as the right one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._flatten import flatten_state
from .._format.dtypes import dtype_name
from .._io.memory import contiguous_cpu
from .._prepare import Component, check_tensor, dedup, split_components
from .._sizes import human_size
from .._stateful import find_modules, make_to_state, parameter_names
from ..errors import InvalidStateError, UnsupportedFormatError

BATCH_BYTES = 64 << 20
"""Tensors are read (and written, compared) in batches of about this many bytes; a larger
tensor is a batch of its own. Peak memory of convert / diff is about one batch."""

Ref = tuple[str, str]
"""(component, stored tensor name): how a tensor is asked for."""


@dataclass(frozen=True)
class SourceSpec:
    """Enough to open a source again (in a worker process): picklable."""

    path: str
    """The file or directory actually read."""
    kind: str
    """``torch-save``, ``hf-bin``, ``safetensors`` or ``dcp``."""
    trust_pickle: bool
    zip_only: bool = False
    """Read for ``sp.load`` / ``load_into``: only zip-format ``torch.save`` files (a legacy
    file is one big pickle), and refusals point at ``convert --trust-pickle``."""
    index: str | None = None
    """For ``hf-bin``: the ``*.bin.index.json`` that ``_format.detect`` chose (None: detect it
    again from the directory's listing)."""


@dataclass
class TensorSource:
    """An opened checkpoint of any supported format, read a batch at a time."""

    spec: SourceSpec
    components: list[Component]
    """Tensors are ``meta`` descriptors (stored dtype and shape); aliases included."""
    flat: bool
    """A flat state dict (the component ``model``), as ``sp.load`` would return it."""
    notes: list[str] = field(default_factory=list)
    """What a person should know about how the source was read (printed by the CLI)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """User metadata of a shardpoint checkpoint (carried over by convert)."""

    def describe(self) -> str:
        return {
            "torch-save": "torch.save file",
            "hf-bin": "Hugging Face .bin shards",
            "safetensors": "safetensors checkpoint",
            "dcp": "torch.distributed.checkpoint (DCP) directory",
        }[self.spec.kind]

    def read(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Contiguous CPU tensors for ``refs``, floating-point ones cast to ``dtype``.

        They stay valid until :meth:`release` (which a mapped source uses to drop pages).
        """
        raise NotImplementedError

    def release(self) -> None:
        """The tensors of the last :meth:`read` are no longer needed."""

    def close(self) -> None:
        """Drop every mapping and handle."""

    @contextlib.contextmanager
    def batch(self, refs: Sequence[Ref], dtype: torch.dtype | None) -> Iterator[list[torch.Tensor]]:
        """``read`` as a context: the tensors are released when the block ends."""
        tensors = self.read(refs, dtype)
        try:
            yield tensors
        finally:
            del tensors
            self.release()

    def descriptor(self, ref: Ref) -> torch.Tensor:
        """The meta tensor (stored dtype and shape) of ``ref``."""
        for comp in self.components:
            if comp.name == ref[0]:
                return comp.tensors[ref[1]]
        raise KeyError(ref)


def cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as a contiguous CPU tensor, floating point cast to ``dtype``."""
    tensor = contiguous_cpu(tensor)
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def batches(sizes: Sequence[int], budget: int = BATCH_BYTES) -> list[list[int]]:
    """Split indexes of consecutive items into runs of at most ``budget`` bytes.

    >>> batches([10, 10, 30, 5], budget=20)
    [[0, 1], [2], [3]]
    """
    out: list[list[int]] = []
    total = 0
    for i, nbytes in enumerate(sizes):
        if out and out[-1] and total + nbytes <= budget:
            out[-1].append(i)
            total += nbytes
        else:
            out.append([i])
            total = nbytes
    return out


# ------------------------------------------------------------------------- components


def meta_like(dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


UNFOLD_LIMIT = 256 << 20
"""Bytes by which a file's tensors may exceed the data they are views of (stride 0, or
overlapping strides), all together: past it a file of kilobytes would make gigabytes."""


def refuse_unfolding(named: Iterable[tuple[str, torch.Tensor]], *, where: str, spent: int = 0) -> int:
    """Refuse a pickle whose tensors are views unfolding far past their data: one view
    (``torch.zeros(1).expand(2**37)`` is 4 bytes in the file and 512 GiB as safetensors,
    which stores every element), or many views of one storage (2000 overlapping 1 MiB views
    of 2 MiB): converting, loading or checking it would allocate it all. ``spent``: the
    excess already counted in other files of the same checkpoint (shards); returns the total.

    >>> refuse_unfolding([("w", torch.zeros(1).expand(2**37))], where="model.pt")
    Traceback (most recent call last):
    ...
    shardpoint.errors.UnsupportedFormatError: model.pt: tensor 'w' is a view of 4 B of data that unfolds into 549.76 GB (a stride-0 or overlapping view): reading it as a checkpoint would allocate and write every element. If the file is yours and this is meant, torch.load it and save .contiguous() copies of what you need
    """
    by_storage: dict[tuple[Any, int], list[int]] = {}  # storage -> [its bytes, bytes its views read]
    worst: tuple[int, str, int, int] | None = None
    views: set[tuple[Any, ...]] = set()  # one view under several names (tied weights) counts once
    for name, tensor in named:
        if tensor.is_meta:
            continue
        view = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if view in views:
            continue
        views.add(view)
        storage = tensor.untyped_storage()
        logical, held = tensor.numel() * tensor.element_size(), storage.nbytes()
        totals = by_storage.setdefault((tensor.device, storage.data_ptr()), [held, 0])
        totals[1] += logical
        worst = max(worst or (0, "", 0, 0), (totals[1] - held, name, held, totals[1]))
    excess = spent + sum(max(0, read - held) for held, read in by_storage.values())
    if excess > UNFOLD_LIMIT and worst is not None:
        _, name, held, logical = worst
        raise UnsupportedFormatError(
            f"{where}: tensor {name!r} is a view of {human_size(held)} of data that unfolds into {human_size(logical)} "
            "(a stride-0 or overlapping view): reading it as a checkpoint would allocate and write every element. "
            "If the file is yours and this is meant, torch.load it and save .contiguous() copies of what you need"
        )
    return excess


def components_from_object(
    obj: Any, *, where: str, allow_pickle: bool
) -> tuple[list[Component], bool]:
    """Components of a loaded object, as ``save`` would store it (meta tensors allowed).

    Same flattening, checks and tied-weight dedup as ``save``; tensors keep their identity
    (real ones for mapped files, ``meta`` placeholders for DCP and shards).
    """
    if isinstance(obj, torch.Tensor) or not isinstance(obj, (Mapping, torch.nn.Module)):
        raise InvalidStateError(
            f"{where} holds a {type(obj).__name__}, not a state dict or a mapping of components; "
            "there is nothing to convert"
        )
    try:
        raw, flat = split_components(obj)
        to_state = make_to_state(parameter_names(find_modules(obj)))
        components = []
        for cname, value in raw.items():
            tree, tensors = flatten_state(
                value, path=cname, to_state=to_state, allow_pickle=allow_pickle
            )
            comp = Component(cname, tree, tensors)
            for name, tensor in tensors.items():
                if tensor.device.type == "meta":
                    dtype_name(tensor.dtype, key=name)
                else:
                    check_tensor(name, cname, tensor)
            dedup(comp)
            components.append(comp)
        refuse_unfolding(((n, c.tensors[n]) for c in components for n in c.stored), where=where)
    except InvalidStateError as exc:  # the file is whole: what it holds is not a checkpoint's state
        raise UnsupportedFormatError(
            f"{where} is read by torch.load(weights_only=True), but what it holds cannot be a checkpoint's state "
            f"({exc}); read it with torch.load and save the parts you need with sp.save"
        ) from None
    return components, flat


def as_descriptors(components: list[Component]) -> list[Component]:
    """The same components with every tensor replaced by a meta descriptor."""
    out = []
    for comp in components:
        metas = {n: meta_like(comp.tensors[n].dtype, comp.tensors[n].shape) for n in comp.stored}
        tensors = {n: metas[comp.aliases.get(n, n)] for n in comp.tensors}
        out.append(Component(comp.name, comp.tree, tensors, list(comp.stored), dict(comp.aliases)))
    return out
