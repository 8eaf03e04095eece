"""The file plan of a save: file names, headers, sizes, placements and index bytes. Pure.

Both layouts are planned here, from what the tensors are (:class:`TensorSpec`: name,
dtype, shape, bytes) and nothing else; the writer (``_distributed/save.py``) executes the
plan, and any number of ranks (one included) take part in it.

- ``hf``: every tensor whole, grouped by size as ``transformers`` groups them
  (:func:`~shardpoint._planning.shards.plan_shards`), in ``model-0000i-of-0000n`` files
  plus an index when there are several (:func:`plan_hf_files`, :func:`hf_index`).
- ``chunked``: each rank's chunks in files of its own, ``model-r00003-00001.safetensors``
  (:func:`plan_rank_files`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from .._format.index import render_index
from .._format.safetensors import TensorSpec, plan_file
from .shards import plan_shards, shard_file_names


@dataclass(frozen=True)
class PlannedFile:
    """One data file of the plan."""

    name: str
    """File name inside the checkpoint."""
    header: bytes
    """The safetensors header (its 8-byte length included)."""
    size: int
    """Bytes of the whole file."""
    offsets: dict[str, int]
    """Tensor name -> its first byte in the file, in file order."""


def _planned(name: str, specs: Sequence[TensorSpec], file_meta: dict[str, str]) -> PlannedFile:
    layout = plan_file(specs, file_meta)
    return PlannedFile(name, layout.header, layout.size, {k: r[0] for k, r in layout.ranges.items()})


def plan_hf_files(
    component: str,
    specs: Mapping[str, TensorSpec],
    max_shard_bytes: int,
    file_meta: dict[str, str],
    *,
    sizes: Sequence[tuple[str, int]] | None = None,
    storage: Mapping[str, Hashable] | None = None,
) -> list[PlannedFile]:
    """The HF files of one component: whole tensors, grouped as ``transformers`` does.

    Args:
        component: names the files (``model.safetensors``, ``optim-00001-of-00002…``).
        specs: each tensor, in the order it is saved.
        max_shard_bytes: the limit of one file.
        file_meta: every header's ``__metadata__``.
        sizes: the bytes the grouping counts per tensor (``transformers`` counts a view's
            whole storage); default each tensor's own bytes.
        storage: name -> storage identity; views of one storage go to one file.

    >>> spec = lambda k, n: TensorSpec(k, "F32", (n,), 4 * n)
    >>> files = plan_hf_files("model", {k: spec(k, n) for k, n in [("a", 2), ("b", 4)]}, 8, {})  # b: oversized
    >>> [(f.name, f.size, f.offsets) for f in files]
    [('model-00001-of-00002.safetensors', 104, {'b': 88}), ('model-00002-of-00002.safetensors', 88, {'a': 80})]
    """
    if sizes is None:
        sizes = [(name, spec.nbytes) for name, spec in specs.items()]
    groups = plan_shards(sizes, max_shard_bytes, storage=storage)
    names = shard_file_names(component, len(groups))
    return [_planned(fname, [specs[k] for k in group], file_meta) for fname, group in zip(names, groups, strict=True)]


def hf_index(files: Sequence[PlannedFile], total_size: int, total_parameters: int) -> bytes | None:
    """The index of a component's HF files (``model.safetensors.index.json``), or None for a
    single file (``transformers`` writes none then).

    >>> one = PlannedFile("m-1", b"", 0, {"a": 8}); two = PlannedFile("m-2", b"", 0, {"b": 8})
    >>> hf_index([one], 4, 1) is None, b'"b": "m-2"' in hf_index([one, two], 8, 2)
    (True, True)
    """
    if len(files) < 2:
        return None
    weight_map = {name: f.name for f in files for name in f.offsets}
    return render_index(weight_map, total_size, total_parameters)


def plan_rank_files(
    component: str, rank: int, specs: Sequence[TensorSpec], file_bytes: int, file_meta: dict[str, str]
) -> list[PlannedFile]:
    """The ``chunked`` files one rank writes for one component: its chunks, in files of at
    most ``file_bytes`` (oversized chunks alone), named by rank and number.

    >>> files = plan_rank_files("optim", 3, [TensorSpec("s", "I64", (), 8)], 1 << 30, {})
    >>> [(f.name, f.size, f.offsets) for f in files]
    [('optim-r00003-00001.safetensors', 88, {'s': 80})]
    """
    by_name = {spec.key: spec for spec in specs}
    groups = plan_shards([(spec.key, spec.nbytes) for spec in specs], file_bytes)
    return [
        _planned(f"{component}-r{rank:05d}-{i:05d}.safetensors", [by_name[n] for n in names], file_meta)
        for i, names in enumerate(groups, start=1)
    ]
