"""Size-based shard planning, exactly as ``transformers`` 5 and ``huggingface_hub`` shard
(``split_state_dict_into_shards_factory``), so the ``hf`` layout has the same files, the
same key-to-file grouping and the same index as ``model.save_pretrained`` writes.

The rule, in the state's order:

- a tensor larger than the limit gets a file of its own, placed *before* the file that is
  still being filled (so ``[a, b] big [c]`` becomes ``[big] [a, b] [c]``);
- otherwise a new file starts when the tensor would push the current one past the limit;
- tensors that share one storage (same ``storage`` key: views of one buffer) are sized once,
  by the first of them, and all go into that first one's file.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence


def plan_shards(
    sizes: Sequence[tuple[str, int]],
    max_shard_bytes: int,
    *,
    storage: Mapping[str, Hashable] | None = None,
) -> list[list[str]]:
    """Group tensor names into files of at most ``max_shard_bytes`` (oversized ones alone).

    Args:
        sizes: (name, bytes the planner counts for it), in the order they are saved.
        max_shard_bytes: the limit of one file.
        storage: name -> identity of the storage it views; names missing or mapped to
            ``None`` share no storage.

    Returns:
        The names of each file, in file order; ``[]`` when there is nothing to save.

    >>> plan_shards([("a", 40), ("b", 40), ("big", 400), ("c", 40)], 100)
    [['big'], ['a', 'b'], ['c']]
    >>> plan_shards([("a", 4), ("b", 4), ("c", 10), ("d", 1)], 8)
    [['c'], ['a', 'b'], ['d']]
    >>> plan_shards([("q", 8), ("x", 4), ("k", 8)], 10, storage={"q": 1, "k": 1})
    [['q', 'k'], ['x']]
    >>> plan_shards([], 8)
    []
    """
    storage = storage or {}
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    first_of: dict[Hashable, str] = {}
    followers: dict[str, list[str]] = {}
    for key, nbytes in sizes:
        sid = storage.get(key)
        if sid is not None:
            if sid in first_of:
                followers[first_of[sid]].append(key)
                continue
            first_of[sid] = key
            followers[key] = []
        if nbytes > max_shard_bytes:
            shards.append([key])
            continue
        if current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(key)
        current_bytes += nbytes
    if current:
        shards.append(current)
    if followers:
        for shard in shards:
            shard.extend([f for key in list(shard) for f in followers.get(key, ())])
    return shards


def shard_file_names(component: str, count: int) -> list[str]:
    """HF file names: ``model.safetensors`` alone, else ``model-00001-of-00003.safetensors``.

    >>> shard_file_names("model", 1), shard_file_names("optim", 2)
    (['model.safetensors'], ['optim-00001-of-00002.safetensors', 'optim-00002-of-00002.safetensors'])
    """
    if count == 1:
        return [f"{component}.safetensors"]
    return [f"{component}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
