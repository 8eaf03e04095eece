"""save / async_save: orchestration only (prepare -> [stage] -> write -> commit)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ._async import raise_unobserved_failure
from ._distributed.group import resolve_group
from ._gc import collector_paused
from ._prepare import prepare_state
from ._read import LoadResult, load, load_into
from ._save import check_options, write_prepared
from ._sizes import parse_size
from ._write import SaveInfo, json_metadata

__all__ = ["LoadResult", "SaveInfo", "load", "load_into", "save"]


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    layout: str | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    durable: bool = True,
    allow_pickle: bool = False,
) -> SaveInfo:
    """Save a state dict (or nested training state) as an atomic, sharded checkpoint.

    A flat ``dict[str, Tensor]`` (or an ``nn.Module``) becomes the component ``model``:
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, exactly what
    ``transformers`` reads. In a nested state each top-level key is a component with its
    own files (``optim-…``); modules, optimizers (keyed by parameter name), LR schedulers,
    ``Stateful`` objects, containers and JSON values are all stored. ``shardpoint.json`` is
    written last; the directory appears at ``path`` only once everything is on disk.

    Args:
        state: ``model.state_dict()``, a module, or a mapping of components.
        path: the checkpoint directory to create, or an fsspec URL (``s3://bucket/run/step-100``,
            ``gs://…``, ``memory://…``; needs ``pip install 'shardpoint[s3]'`` for S3). On an
            object store the data objects are uploaded concurrently (multipart, discarded on
            failure), then the indexes, then ``shardpoint.json`` last: a prefix without it
            never loads.
        max_shard_size: largest data file, e.g. ``"5GB"`` (10^9) or ``"5GiB"`` (2^30), or an int.
        layout: ``"hf"`` (every tensor whole, HF files; the default in one process) or
            ``"chunked"`` (each rank writes the chunks it holds to its own files; the
            default for collective saves).
        process_group: save collectively: every rank of the group calls ``save`` with its
            own shards. Without it, a state holding DTensors is saved over the default group.
        overwrite: replace an existing checkpoint at ``path`` (atomically).
        metadata: JSON values stored in the manifest.
        storage_options: options of the URL's fsspec filesystem, e.g. for S3 ``{"key": …,
            "secret": …, "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}``.
        progress: show a progress bar (default: when stderr is a terminal).
        durable: fsync files and directories before returning (default True).
        allow_pickle: pickle values that are not tensors, containers or JSON (loading them
            then needs ``allow_pickle=True`` too).

    Returns:
        A :class:`SaveInfo` with the files written and their sizes.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False.
        StorageError: the object store failed (after bounded retries of transient errors).
        InvalidStateError: a value cannot be stored (sparse, meta, unsupported dtype, object).
        InvalidSizeError: ``max_shard_size`` cannot be parsed.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> info = sp.save({"w": torch.ones(2, 2)}, os.path.join(d, "ckpt"))
        >>> sorted(info.files)
        ['model.safetensors']
        >>> info = sp.save({"w": torch.ones(2)}, "memory://doc/ckpt")  # any fsspec URL
        >>> sp.load("memory://doc/ckpt")["w"].tolist()
        [1.0, 1.0]
    """
    max_bytes = parse_size(max_shard_size)
    check_options(layout, storage_options)
    raise_unobserved_failure()
    with collector_paused():
        prepared = prepare_state(state, allow_pickle=allow_pickle)
        group = resolve_group(process_group, prepared.all_tensors())
        return write_prepared(
            prepared,
            path,
            group=group,
            layout=layout,
            max_shard_bytes=max_bytes,
            overwrite=overwrite,
            metadata=json_metadata(metadata),
            durable=durable,
            progress=progress,
            storage_options=storage_options,
        )
