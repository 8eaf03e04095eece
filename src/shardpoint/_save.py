"""The steps ``save`` and ``async_save`` share: check their options, write a prepared state.

Written once here so that both entry points (``_api`` and ``_async``) import them and
neither imports the other's module for them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ._distributed.group import Group
from ._distributed.save import write_distributed
from ._prepare import PreparedState
from ._write import SaveInfo, write_checkpoint
from .errors import CheckpointError


def check_options(layout: str | None, storage_options: Any) -> None:
    if layout not in (None, "hf", "chunked"):
        raise CheckpointError(f"unknown layout {layout!r}; use 'hf' (whole tensors) or 'chunked' (per-rank files)")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise CheckpointError(
            f"storage_options must be a dict of fsspec filesystem options, not {type(storage_options).__name__}"
        )


def write_prepared(
    prepared: PreparedState,
    path: str | os.PathLike[str],
    *,
    group: Group,
    layout: str | None,
    max_shard_bytes: int,
    overwrite: bool,
    metadata: dict[str, Any],
    durable: bool,
    progress: bool | None,
    storage_options: Mapping[str, Any] | None = None,
) -> SaveInfo:
    """Write in one process (layout hf) or collectively (default layout chunked)."""
    if group.distributed or layout == "chunked":
        return write_distributed(
            prepared,
            path,
            group=group,
            layout=layout or "chunked",
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            metadata=metadata,
            durable=durable,
            progress=progress,
            storage_options=storage_options,
        )
    return write_checkpoint(
        prepared,
        path,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        metadata=metadata,
        durable=durable,
        progress=progress,
        storage_options=storage_options,
    )
