"""shardpoint: fast, atomic, sharded safetensors checkpoints for PyTorch.

>>> import torch, shardpoint as sp
>>> model = torch.nn.Linear(4, 4)
>>> info = sp.save(model.state_dict(), "ckpt/step-100", max_shard_size="5GB")
>>> sp.load_into(model, "ckpt/step-100").ok
True
"""

from __future__ import annotations

from ._api import LoadResult, SaveInfo, async_save, load, load_into, save
from ._async import AsyncSave
from ._convert import convert
from ._diff import DiffReport, StorageNote, TensorDiff, diff
from ._manager import CheckpointManager
from ._options import CollectiveOptions, IOOptions, Options, RemoteOptions, current_options, using
from ._stateful import RNGState, Stateful, empty_model
from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    IncompleteCheckpointError,
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidSizeError,
    InvalidStateError,
    LoadMismatchError,
    MissingDependencyError,
    MissingShardError,
    PreviousSaveFailedError,
    StateChangedError,
    StorageError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedFormatError,
)

__all__ = [
    "AsyncSave",
    "CheckpointManager",
    "CollectiveOptions",
    "IOOptions",
    "Options",
    "RemoteOptions",
    "current_options",
    "using",
    "RNGState",
    "async_save",
    "empty_model",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DiffReport",
    "DistributedCheckpointError",
    "IncompleteCheckpointError",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidSizeError",
    "InvalidStateError",
    "LoadMismatchError",
    "LoadResult",
    "MissingDependencyError",
    "MissingShardError",
    "PreviousSaveFailedError",
    "SaveInfo",
    "StateChangedError",
    "Stateful",
    "StorageError",
    "StorageNote",
    "TensorDiff",
    "UnsafePathError",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "__version__",
    "convert",
    "diff",
    "load",
    "load_into",
    "save",
]


def __getattr__(name: str) -> object:
    # `sp.integrations` (and `sp.integrations.transformers` / `.lightning`) are imported on
    # first use, so `import shardpoint` imports neither framework.
    if name == "integrations":
        import importlib

        return importlib.import_module(f"{__name__}.integrations")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
