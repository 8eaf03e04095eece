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
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidStateError",
    "InvalidSizeError",
    "InsufficientMemoryError",
    "LoadMismatchError",
    "MissingDependencyError",
    "MissingShardError",
    "PreviousSaveFailedError",
    "StateChangedError",
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
    A local read that fails (EIO from a failing disk) is one too, naming the file; so is a
    checkpoint that keeps being replaced while it is being opened.
    """


class UnsupportedFormatError(CheckpointError, ValueError):
    """A format version, dtype or layout this version of shardpoint cannot read."""


class InvalidStateError(CheckpointError, TypeError):
    """The state passed to ``save`` holds a value shardpoint cannot store."""


class InsufficientMemoryError(CheckpointError, MemoryError):
    """A load needs more memory for its tensors than this machine has (RAM + swap); refused
    before anything is allocated. The message says how to load less (``mmap=True``, ``keys=``)."""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument (or an option, or the environment variable seeding one) has a value
    shardpoint cannot use: an unknown ``layout`` or ``mode``, a negative count, a
    ``storage_options`` given with a local path, an ``mmap=True`` a source cannot serve.
    The message names the argument, the value given and the values accepted."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument or option of the wrong type (a str where an int is needed). Both an
    :class:`InvalidArgumentError` (so a ``ValueError``) and a ``TypeError``: ``except
    TypeError`` and ``except ValueError`` both catch it."""


class InvalidSizeError(InvalidArgumentError):
    """A size such as ``max_shard_size`` could not be parsed."""


class LoadMismatchError(CheckpointError, ValueError):
    """``load_into(strict=True)`` found missing, unexpected or mis-shaped keys.

    The full report is on ``.result`` (a :class:`shardpoint.LoadResult`).
    """

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class MissingDependencyError(CheckpointError, ImportError):
    """An optional dependency this call needs is not installed (fsspec / s3fs for a URL,
    ``torch.distributed.checkpoint`` for the DCP integration); the message names the package
    to install."""


class PreviousSaveFailedError(CheckpointError, RuntimeError):
    """An async save failed in the background and nobody looked at its handle; raised by
    the next save (``sp.save``, ``sp.async_save``, ``CheckpointManager.save``), which then
    saves nothing. The original error is the ``__cause__``."""


class StateChangedError(CheckpointError, RuntimeError):
    """The state was changed while it was being saved (a tensor resized or replaced by
    another thread); nothing was committed. Save when the state is not being changed, or
    with ``async_save``, which copies it first."""


class UnsafePickleError(CheckpointError, ValueError):
    """Reading this input needs a full unpickle, which was not allowed."""


class DistributedCheckpointError(CheckpointError, RuntimeError):
    """One or more ranks failed during a collective save or load.

    ``failed_ranks`` maps each failed rank to the error text it reported.
    """

    def __init__(self, message: str, failed_ranks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = dict(failed_ranks or {})


def _extended(exc: BaseException, sentence: str) -> BaseException:
    """``exc`` itself, its message followed by ``sentence`` (its class, errno and cause kept);
    an exception whose arguments are not one message is returned as it is.

    >>> str(_extended(CorruptCheckpointError("f.safetensors is damaged"), "Load step 1 instead."))
    'f.safetensors is damaged. Load step 1 instead.'
    """
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0].rstrip('. ')}. {sentence}",)
    return exc
