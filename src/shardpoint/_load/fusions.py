"""Checkpoint tensors that a ``transformers`` conversion fuses into model tensors.

``load_into`` of a ``transformers`` 5 model from files in the Hub's layout (say Mixtral's
per-expert ``w1`` / ``w2`` / ``w3``, which the model holds stacked as
``experts.gate_up_proj`` / ``down_proj``): the planner hands each such group here. Its
sources are checked against their files and its results' shapes worked out while
planning (so ``strict`` refuses a misfit before a byte of the target changes); after the
main batch, one group at a time, the sources are read into temporary tensors (crc32c
checked as every read is), combined by the conversion's own operations, put in the
model, and freed: memory stays bounded by one group (one layer's experts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._format.dtypes import NAME_TO_DTYPE
from .._format.manifest import ComponentRecord
from .._hf_conversions import Fusion
from .._read import ReadBatch
from .memory import allocate
from .pickled import PickledBatch

Advance = Callable[[int], None] | None


def _shape_dtype(record: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of a stored tensor: a manifest's record names its dtype, a ``.bin``
    file's placeholder tensor holds one."""
    dtype = record.dtype
    return tuple(record.shape), dtype if isinstance(dtype, torch.dtype) else NAME_TO_DTYPE[dtype]


def stored_shapes(saved: Mapping[str, str], comp: ComponentRecord) -> Callable[[str], tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint key -> (shape, dtype) of the tensor stored for it."""

    def stored(key: str) -> tuple[tuple[int, ...], torch.dtype]:
        name = saved[key]
        return _shape_dtype(comp.tensors[comp.aliases.get(name, name)])

    return stored


@dataclass
class PlannedFusion:
    """One fusion of one load: what to read, and where its results go."""

    fusion: Fusion
    comp: ComponentRecord
    sources: dict[str, str]
    """Checkpoint key -> stored tensor name."""
    module: torch.nn.Module
    put: Callable[[str, torch.Tensor], None]
    """Gives model tensor ``key`` its fused value."""
    nbytes: int


def plan(batch: ReadBatch | PickledBatch, fusions: list[Fusion], saved: Mapping[str, str], comp: ComponentRecord,
         module: torch.nn.Module, targets: Mapping[str, torch.Tensor], put: Callable[[str, torch.Tensor], None],
         ) -> tuple[list[PlannedFusion], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """The fusions to run, and (key, made shape, model shape) of each output that does not
    fit the model (reported as mis-shaped, like any other; its fusion is not run). Each
    source is checked against its file here, before anything is read."""
    planned: list[PlannedFusion] = []
    wrong: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for fusion in fusions:
        misfits = [(k, shape, tuple(targets[k].shape)) for k, shape in fusion.outputs.items()
                   if tuple(targets[k].shape) != shape]
        if misfits:
            wrong.extend(misfits)
            continue
        sources = {k: comp.aliases.get(saved[k], saved[k]) for k, _ in fusion.sources}
        nbytes = 0
        for name in sources.values():
            if isinstance(batch, ReadBatch):
                nbytes += batch.check(comp.tensors[name], name)  # every chunk against its file
            else:
                shape, dtype = _shape_dtype(comp.tensors[name])
                nbytes += torch.Size(shape).numel() * dtype.itemsize
        planned.append(PlannedFusion(fusion, comp, sources, module, put, nbytes))
    return planned, wrong


def run(batch: ReadBatch | PickledBatch, planned: PlannedFusion, location: str, advance: Advance) -> None:
    """Read one fusion's sources, combine them and put the results in the model."""
    comp = planned.comp
    sub = batch.sub()
    read: dict[str, torch.Tensor] = {}
    for key, name in planned.sources.items():
        shape, dtype = _shape_dtype(comp.tensors[name])
        read[key] = allocate(shape, dtype, torch.device("cpu"), location, name)
        sub.fill(comp.tensors[name], read[key], name)
    sub.run(False, advance)
    made = planned.fusion.run(planned.module, read)
    read.clear()
    for key, value in made.items():
        planned.put(key, value)
