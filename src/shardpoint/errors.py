"""Every error shardpoint raises.

All of them derive from :class:`CheckpointError`, and each also derives from the builtin
exception it refines (``FileNotFoundError``, ``ValueError``, ...), so existing ``except``
clauses keep working. Messages name the file, tensor or rank involved and say what to do.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "IncompleteCheckpointError",
    "InvalidStateError",
    "InvalidSizeError",
    "LoadMismatchError",
    "MissingShardError",
    "StorageError",
    "UnsafePathError",
    "UnsafePickleError",
    "UnsupportedFormatError",
]


class CheckpointError(Exception):
    """Base class of every error raised by shardpoint."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no checkpoint (no manifest, no safetensors index or file)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save would replace an existing checkpoint and ``overwrite`` was not set."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A file of the checkpoint is malformed, truncated, or disagrees with the manifest."""


class ChecksumMismatchError(CorruptCheckpointError):
    """The crc32c of stored bytes differs from the one recorded when they were written."""


class MissingShardError(CorruptCheckpointError, FileNotFoundError):
    """A file named by the index or manifest is absent."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """The directory is a save that never committed (a ``.tmp-`` directory, no manifest)."""


class UnsafePathError(CorruptCheckpointError):
    """A file name in an index or manifest would leave the checkpoint directory."""


class StorageError(CheckpointError, OSError):
    """The storage refused or failed a save or a load.

    On a remote store (an fsspec URL such as ``s3://``): after the bounded retries of a
    transient error, or at once for a permanent one (access denied, no such bucket); the
    message names the object and the operation. On a local filesystem (a full disk, a
    read-only mount, no permission, a name too long): ``errno`` is the system's, and the
    message names the checkpoint path, what the errno means and what to do.
    """


class UnsupportedFormatError(CheckpointError, ValueError):
    """A format version, dtype or layout this version of shardpoint cannot read."""


class InvalidStateError(CheckpointError, TypeError):
    """The state passed to ``save`` holds a value shardpoint cannot store."""


class InvalidSizeError(CheckpointError, ValueError):
    """A size such as ``max_shard_size`` could not be parsed."""


class LoadMismatchError(CheckpointError, ValueError):
    """``load_into(strict=True)`` found missing, unexpected or mis-shaped keys.

    The full report is on ``.result`` (a :class:`shardpoint.LoadResult`).
    """

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class UnsafePickleError(CheckpointError, ValueError):
    """Reading this input needs a full unpickle, which was not allowed."""


class DistributedCheckpointError(CheckpointError, RuntimeError):
    """One or more ranks failed during a collective save or load.

    ``failed_ranks`` maps each failed rank to the error text it reported.
    """

    def __init__(self, message: str, failed_ranks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = dict(failed_ranks or {})
