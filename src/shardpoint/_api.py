"""save / async_save: orchestration only (prepare -> [stage] -> write -> commit)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ._prepare import prepare_state
from ._read import LoadResult, load, load_into
from ._sizes import parse_size
from ._write import SaveInfo, json_metadata, write_checkpoint
from .errors import CheckpointError

__all__ = ["LoadResult", "SaveInfo", "load", "load_into", "save"]


def check_unsupported(layout: str | None, process_group: Any, storage_options: Any) -> None:
    if layout not in (None, "hf"):
        raise CheckpointError(f"layout {layout!r} is not available in this version; use layout='hf'")
    if process_group is not None or storage_options is not None:
        raise CheckpointError("process_group and storage_options are not available in this version of shardpoint")


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
        path: the checkpoint directory to create.
        max_shard_size: largest data file, e.g. ``"5GB"`` (10^9) or ``"5GiB"`` (2^30), or an int.
        layout: ``"hf"`` (default: every tensor whole in one file).
        process_group: for collective saves (not in this version; must be None).
        overwrite: replace an existing checkpoint at ``path`` (atomically).
        metadata: JSON values stored in the manifest.
        storage_options: for fsspec URLs (not in this version; must be None).
        progress: show a progress bar (default: when stderr is a terminal).
        durable: fsync files and directories before returning (default True).
        allow_pickle: pickle values that are not tensors, containers or JSON (loading them
            then needs ``allow_pickle=True`` too).

    Returns:
        A :class:`SaveInfo` with the files written and their sizes.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False.
        InvalidStateError: a value cannot be stored (sparse, meta, unsupported dtype, object).
        InvalidSizeError: ``max_shard_size`` cannot be parsed.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> info = sp.save({"w": torch.ones(2, 2)}, os.path.join(d, "ckpt"))
        >>> sorted(info.files)
        ['model.safetensors']
    """
    max_bytes = parse_size(max_shard_size)
    check_unsupported(layout, process_group, storage_options)
    from ._async import raise_unobserved_failure

    raise_unobserved_failure()
    prepared = prepare_state(state, allow_pickle=allow_pickle)
    return write_checkpoint(
        prepared,
        path,
        max_shard_bytes=max_bytes,
        overwrite=overwrite,
        metadata=json_metadata(metadata),
        durable=durable,
        progress=progress,
    )
