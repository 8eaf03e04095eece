"""Size-based shard planning, as ``transformers`` shards: walk in order, start a new file
when the next tensor would pass the limit; a tensor larger than the limit gets its own."""

from __future__ import annotations

from collections.abc import Sequence


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into files of at most ``max_shard_bytes`` (oversized ones alone).

    >>> plan_shards([("a", 4), ("b", 4), ("c", 10), ("d", 1)], 8)
    [['a', 'b'], ['c'], ['d']]
    >>> plan_shards([], 8)
    [[]]
    """
    shards: list[list[str]] = [[]]
    current = 0
    for key, nbytes in sizes:
        if shards[-1] and current + nbytes > max_shard_bytes:
            shards.append([])
            current = 0
        shards[-1].append(key)
        current += nbytes
    return shards


def shard_file_names(component: str, count: int) -> list[str]:
    """HF file names: ``model.safetensors`` alone, else ``model-00001-of-00003.safetensors``.

    >>> shard_file_names("model", 1), shard_file_names("optim", 2)
    (['model.safetensors'], ['optim-00001-of-00002.safetensors', 'optim-00002-of-00002.safetensors'])
    """
    if count == 1:
        return [f"{component}.safetensors"]
    return [f"{component}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
