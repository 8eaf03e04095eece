"""The Lightning integration's files on disk: what a path holds, and removing a checkpoint."""

from __future__ import annotations

import os
import shutil
import uuid

from .._storage.local import TMP_MARKER
from ..errors import StorageError


def is_lightning_distributed_checkpoint(path: str) -> bool:
    """A folder Lightning's sharded strategies wrote with ``torch.distributed.checkpoint``."""
    return (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, "shardpoint.json"))
        and os.path.isfile(os.path.join(path, "meta.pt"))
        and os.path.isfile(os.path.join(path, ".metadata"))
    )


def path_key(path: str) -> str:
    """How pending removals know a path (absolute)."""
    return os.path.abspath(path)


def remove_path(location: str) -> None:
    """Remove a checkpoint: a file or link unlinked; a directory renamed aside (loaders ignore
    ``.tmp-`` names, so it disappears in one step), then deleted."""
    if not os.path.lexists(location):
        return
    if os.path.islink(location) or not os.path.isdir(location):
        os.unlink(location)
        return
    head, name = os.path.split(os.path.abspath(location))
    aside = os.path.join(head, f".{name}{TMP_MARKER}removed-{uuid.uuid4().hex}")
    try:
        os.rename(location, aside)
    except FileNotFoundError:
        return  # removed meanwhile
    except OSError as exc:
        err = StorageError(
            f"cannot remove checkpoint {location}: [Errno {exc.errno}] {exc.strerror or exc}; it was left "
            "in place. Check the directory's permissions, or remove it yourself"
        )
        err.errno = exc.errno
        raise err from exc
    shutil.rmtree(aside, ignore_errors=True)
