"""``ShardpointCheckpointIO``: Lightning checkpoints as atomic, sharded safetensors directories.

>>> from lightning.pytorch import Trainer  # doctest: +SKIP
>>> from lightning.pytorch.callbacks import ModelCheckpoint  # doctest: +SKIP
>>> from shardpoint.integrations.lightning import ShardpointCheckpointIO  # doctest: +SKIP
>>> trainer = Trainer(plugins=[ShardpointCheckpointIO()],  # doctest: +SKIP
...                   callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss", save_last=True)])
>>> trainer.fit(model, ckpt_path="last")  # doctest: +SKIP

Each ``.ckpt`` path Lightning asks for becomes a shardpoint checkpoint *directory*: the
LightningModule's ``state_dict`` is the component ``model`` (``model.safetensors``, which
``safetensors`` and ``transformers`` tooling open as-is), ``optimizer_states`` the
component ``optim``, every other top-level key its own component (or, if its name cannot
name files, an entry of the component ``lightning_extra``). ``load_checkpoint`` gives back
the dict Lightning saved: same keys, lists stay lists, integer keys (optimizer parameter
ids) stay integers, tuples stay tuples, ``nan``/``inf`` survive.

Values that are neither tensors, containers nor JSON: mappings (``AttributeDict``) are
stored as dicts; ``pathlib`` paths, ``Enum`` members, ``argparse.Namespace``, dataclasses and
``datetime`` / ``date`` / ``time`` / ``timedelta`` values (what ``save_hyperparameters()``
often holds) are stored without pickle as typed nodes of the manifest and come back equal,
with their types. An Enum or dataclass is rebuilt only from a class whose module is already
imported (shardpoint never imports a module a checkpoint names; import it first). Anything
else (a custom object, a ``ZoneInfo`` datetime, a local class) is refused with the key and
the reason named, unless the plugin is built with ``allow_pickle=True``: then such values
are pickled into the checkpoint and unpickled on load (only load checkpoints you trust;
Lightning's ``weights_only=True`` still refuses).

``last.ckpt`` without a second write: Lightning saves ``last`` right after the top-k
checkpoint of the same step, through a second ``save_checkpoint`` call. When a save has
the same ``epoch`` and ``global_step`` as this plugin's previous save and every tensor is
byte-identical to what that checkpoint stores (crc32c of the bytes against the manifest),
the new directory hard-links the previous one's data files and gets a manifest of its own
(the JSON parts, e.g. ``ModelCheckpoint.last_model_path``, may differ), committed through
the same temporary directory and rename as any save. Otherwise, or when linking is not
possible (another filesystem, the previous checkpoint removed meanwhile), it is written.

Works wrapped in Lightning's ``AsyncCheckpointIO`` (the write runs in its thread). Lightning
calls ``CheckpointIO`` on global rank 0 with full state dicts; strategies that write
sharded checkpoints themselves (FSDP ``state_dict_type="sharded"``, ``ModelParallelStrategy``,
DeepSpeed) never call it. For FSDP and ``ModelParallelStrategy`` use
``ShardpointFSDPStrategy`` / ``ShardpointModelParallelStrategy`` (exported here, imported on
first use): every rank saves its own shards through shardpoint, and a checkpoint resumes on
any number of ranks (see ``_lightning_strategies``). Handed a folder Lightning's own sharded
strategies wrote, ``load_checkpoint`` says so.

``LightningModule.load_from_checkpoint`` and a ``Trainer`` without this plugin read with
``torch.load`` through fsspec, which fails on these directories with ``IsADirectoryError``
before any code of Lightning or of shardpoint could tell the user more (Lightning has no
hook between the path and the open; patching Lightning on import would be worse). Use
:func:`load_from_checkpoint` (``load_from_checkpoint(MyModel, path, map_location=...,
strict=...)``) in place of ``MyModel.load_from_checkpoint(path)``, and resume with the
plugin and ``trainer.fit(..., ckpt_path=...)`` (or ``validate`` / ``test``).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._flags import check_flags
from .._format.manifest import MANIFEST_NAME
from .._load.new import load
from .._prepare import prepare_state
from .._reuse import link_unchanged
from .._sizes import parse_size
from .._source import open_checkpoint
from .._storage.fsspec_store import FsspecStore
from .._storage.local import replacing_a_file
from .._storage.store import is_url, open_store
from .._write import json_metadata, write_checkpoint
from ..errors import (
    IncompleteCheckpointError,
    InvalidArgumentTypeError,
    InvalidStateError,
    UnsupportedFormatError,
)
from ._lightning_paths import (
    is_lightning_distributed_checkpoint,
    path_key,
    remove_path,
)
from ._lightning_state import (
    COMPONENT_OF_KEY,
    EXTRA_COMPONENT,
    METADATA_KEY,
    from_shardpoint_state,
    to_shardpoint_state,
)

if TYPE_CHECKING:  # imported on first use by __getattr__ (they import lightning.pytorch)
    from ._lightning_strategies import (
        ShardpointFSDPStrategy,
        ShardpointModelParallelStrategy,
        ShardpointStrategyMixin,
    )


def _checkpoint_io_bases() -> tuple[type, ...]:
    """``CheckpointIO`` of every Lightning flavour installed (``lightning``, ``pytorch_lightning``).

    The plugin subclasses each, so both ``lightning.pytorch.Trainer`` and
    ``pytorch_lightning.Trainer`` accept it.
    """
    bases: list[type] = []
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    except ImportError:
        pass
    else:
        bases.append(CheckpointIO)
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as StandaloneCheckpointIO
    except ImportError:
        pass
    else:
        if StandaloneCheckpointIO not in bases:
            bases.append(StandaloneCheckpointIO)
    if not bases:
        raise ImportError(
            "shardpoint.integrations.lightning needs Lightning: pip install 'shardpoint[lightning]' "
            "(or `lightning` / `pytorch_lightning`)"
        )
    return tuple(bases)


@dataclass(frozen=True)
class _Saved:
    path: str
    save_id: str
    step: tuple[int, int] | None


def _step_of(checkpoint: Mapping[str, Any]) -> tuple[int, int] | None:
    epoch, step = checkpoint.get("epoch"), checkpoint.get("global_step")
    if isinstance(epoch, int) and isinstance(step, int):
        return epoch, step
    return None


class ShardpointCheckpointIO(*_checkpoint_io_bases()):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` that saves each checkpoint as a shardpoint directory.

    Args:
        max_shard_size: largest data file, e.g. ``"5GB"`` (10^9 bytes) or ``"5GiB"``.
        allow_pickle: store values that shardpoint cannot store as tensors, containers, JSON
            or typed nodes (paths, Enum members, Namespaces, dataclasses, datetime values),
            e.g. a custom object in ``hyper_parameters``, by pickling them, and unpickle them
            on load. Off by default: such values are refused with the key named.
        link_unchanged: save a checkpoint whose tensors equal those of the previous save at
            the same epoch and step (``last.ckpt``) by hard-linking that save's files.
        durable: fsync files and directories before a save returns.

    Example:
        >>> import lightning.pytorch as pl  # doctest: +SKIP
        >>> trainer = pl.Trainer(plugins=[ShardpointCheckpointIO(max_shard_size="2GB")])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        max_shard_size: int | str = "5GB",
        allow_pickle: bool = False,
        link_unchanged: bool = True,
        durable: bool = True,
    ) -> None:
        super().__init__()
        check_flags("ShardpointCheckpointIO", allow_pickle=allow_pickle, link_unchanged=link_unchanged,
                    durable=durable)
        self.max_shard_bytes = parse_size(max_shard_size)
        self.allow_pickle = allow_pickle
        self.link_unchanged = link_unchanged
        self.durable = durable
        self.last_save_linked = False
        """Whether the latest ``save_checkpoint`` linked the previous save's files."""
        self._previous: _Saved | None = None
        self._lock = threading.Lock()
        self._saving = 0
        """Saves running now (under ``AsyncCheckpointIO``, on its thread)."""
        self._removal_pending: set[str] = set()
        """Paths Lightning removed while a save ran and they did not exist yet (their save
        may be queued behind it): removed when their save commits, if it is the next to start."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` (Lightning's dict) as a shardpoint checkpoint directory at ``path``.

        An existing checkpoint at ``path`` is replaced atomically; so is a file or symlink
        there (an old ``torch.save`` checkpoint, a ``save_last="link"`` link), when the new
        checkpoint commits: a save that fails leaves it as it was.

        Raises:
            InvalidArgumentTypeError: ``storage_options`` was given (not supported; also a TypeError).
            InvalidStateError: a value cannot be stored (see ``allow_pickle``).
        """
        if storage_options is not None:
            raise InvalidArgumentTypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                f"{type(self).__name__}; leave storage_options unset"
            )
        location = os.fspath(path)
        with self._lock:
            self._saving += 1
            # A removal waits only for the save queued next: once another path's save starts,
            # the one removed was not queued (Lightning removed a path that never came).
            self._removal_pending &= {path_key(location)}
        saved: tuple[bool, str] | None = None
        try:
            state, metadata = to_shardpoint_state(checkpoint)
            try:
                prepared = prepare_state(state, allow_pickle=self.allow_pickle)
            except InvalidStateError as exc:
                if self.allow_pickle:
                    raise
                raise InvalidStateError(
                    f"{exc}. With Lightning, build the plugin as ShardpointCheckpointIO(allow_pickle=True) "
                    "to pickle such values, or keep hyperparameters to JSON values"
                ) from None
            meta = json_metadata(metadata)
            step = _step_of(checkpoint)
            with self._lock:
                previous = self._previous
            saved = self._write(prepared, location, meta, step, previous)
        finally:
            with self._lock:
                self._saving -= 1
                remove_now = path_key(location) in self._removal_pending
                self._removal_pending.discard(path_key(location))
                if saved is not None:
                    self.last_save_linked, save_id = saved
                    self._previous = _Saved(location, save_id, step)
        if remove_now and saved is not None:
            remove_path(location)  # Lightning removed it while the save was queued or running

    def _write(
        self,
        prepared: Any,
        location: str,
        meta: dict[str, Any],
        step: tuple[int, int] | None,
        previous: _Saved | None,
    ) -> tuple[bool, str]:
        """Link the previous save's files if nothing changed, else write; (linked, save_id).
        A file or link at ``location`` (a ``torch.save`` checkpoint, a ``save_last="link"``
        link) is replaced when the new checkpoint commits, never before."""
        with replacing_a_file():
            info = None
            if (
                self.link_unchanged
                and previous is not None
                and step is not None
                and previous.step == step
            ):
                info = link_unchanged(
                    prepared,
                    previous.path,
                    location,
                    save_id=previous.save_id,
                    overwrite=True,
                    metadata=meta,
                    durable=self.durable,
                )
            if info is not None:
                return True, info.save_id
            info = write_checkpoint(
                prepared,
                location,
                max_shard_bytes=self.max_shard_bytes,
                overwrite=True,
                metadata=meta,
                durable=self.durable,
                progress=False,
            )
            return False, info.save_id

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint dict Lightning saved at ``path``.

        Args:
            path: the checkpoint directory (``….ckpt``).
            map_location: a device (``"cpu"``, ``torch.device``) to load tensors onto; other
                forms (functions, dicts) load to CPU and Lightning moves the states later.
            weights_only: ``True`` refuses pickled values even with ``allow_pickle=True``.

        Raises:
            CheckpointNotFoundError: there is no checkpoint at ``path`` (a ``FileNotFoundError``).
            UnsupportedFormatError: ``path`` is a file (a ``torch.save`` checkpoint), not a
                directory this plugin wrote.
        """
        device: str | torch.device = "cpu"
        if isinstance(map_location, (str, torch.device)):
            device = map_location
        location = os.fspath(path)
        if os.path.isfile(location) and not location.endswith(".safetensors"):
            raise UnsupportedFormatError(
                f"{location} is a file, not a checkpoint directory written by ShardpointCheckpointIO "
                "(a torch.save checkpoint, written without the plugin?): load it with Lightning's own "
                "`MyModel.load_from_checkpoint(path)`, or resume from it with a Trainer without "
                "ShardpointCheckpointIO"
            )
        if is_lightning_distributed_checkpoint(location):
            raise UnsupportedFormatError(
                f"{location} is a Lightning distributed checkpoint (torch.distributed.checkpoint files and "
                "meta.pt), written by FSDPStrategy(state_dict_type='sharded') or ModelParallelStrategy, "
                "which never call ShardpointCheckpointIO: resume from it with that strategy, or with "
                "ShardpointFSDPStrategy / ShardpointModelParallelStrategy (they read it, and save through "
                "shardpoint on every rank)"
            )
        allow = self.allow_pickle and weights_only is not True
        ckpt = open_checkpoint(location)
        if ckpt.manifest is None:
            raise IncompleteCheckpointError(
                f"{location} has no shardpoint.json, which every checkpoint ShardpointCheckpointIO "
                "writes holds (it is committed last): this folder is not a whole Lightning checkpoint "
                "of this plugin (its manifest was lost, or it holds only plain weights). Resume from "
                "another checkpoint; `shardpoint verify` says what is there"
            )
        metadata = ckpt.manifest.metadata
        loaded = load(location, device=device, allow_pickle=allow, progress=False)
        return from_shardpoint_state(loaded, metadata, flat=ckpt.flat)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path``: renamed aside first (loaders ignore ``.tmp-``
        names, so it disappears in one step), then deleted; a file or link is unlinked. A
        directory that holds no shardpoint manifest (and is no Lightning distributed
        checkpoint) was not written by this plugin: it is left alone, with a warning.

        Under ``AsyncCheckpointIO`` Lightning may ask to remove a checkpoint whose save is
        still queued or running: when ``path`` does not exist yet while a save runs, the
        removal is carried out when that path's save commits, if it is the next save to
        start. Otherwise removing a path that does not exist does nothing.
        """
        location = os.fspath(path)
        if is_url(location):  # an object store: its prefix, deleted through the store
            store = open_store(location)
            if not isinstance(store, FsspecStore):
                location = os.fspath(store.location)
            else:
                names = store.list()
                if MANIFEST_NAME in names:
                    store.delete_tree()
                elif names:
                    warnings.warn(
                        f"{location} holds no shardpoint.json, so this plugin did not write it: it is not removed; "
                        "remove it yourself if it is a checkpoint you no longer need", UserWarning, stacklevel=2)
                return
        with self._lock:
            if not os.path.lexists(location):
                if self._saving:
                    self._removal_pending.add(path_key(location))
                return
        if (
            os.path.isdir(location) and not os.path.islink(location)
            and not os.path.isfile(os.path.join(location, MANIFEST_NAME))
            and not is_lightning_distributed_checkpoint(location)
        ):
            warnings.warn(
                f"{location} is a directory this plugin did not write (no shardpoint.json), so it is "
                "not removed: remove it yourself if it is a checkpoint you no longer need",
                UserWarning, stacklevel=2,
            )
            return
        remove_path(location)


def _saving_module_for(cls: type) -> Any:
    """Lightning's ``core.saving`` module of the flavour ``cls`` belongs to."""
    import importlib

    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            pl = importlib.import_module(package)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule)):
            return importlib.import_module(f"{package}.core.saving"), pl
    raise InvalidArgumentTypeError(
        f"load_from_checkpoint needs a LightningModule or LightningDataModule class, got {cls!r}"
    )


def load_from_checkpoint(
    cls: type,
    checkpoint_path: Any,
    map_location: Any | None = None,
    strict: bool | None = None,
    *,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path)`` for a checkpoint saved by ``ShardpointCheckpointIO``.

    Builds ``cls`` from the saved hyperparameters (``kwargs`` override them, as in Lightning),
    calls its ``on_load_checkpoint`` and loads the weights, all through Lightning's own
    loading code; only reading the checkpoint differs.

    Args:
        cls: the ``LightningModule`` (or ``LightningDataModule``) class.
        checkpoint_path: the checkpoint directory (``….ckpt``) written through the plugin.
        map_location: ``"cpu"``, ``"cuda:0"`` or a ``torch.device`` to put the weights (and so
            the module) on; other forms (a dict, a function) load to CPU.
        strict: as in Lightning: keys of the checkpoint and the module must match
            (``None``: the module's ``strict_loading``, by default ``True``).
        allow_pickle: unpickle values saved with ``ShardpointCheckpointIO(allow_pickle=True)``
            (only for checkpoints you trust).
        **kwargs: hyperparameters overriding the saved ones.

    Returns:
        The module (or data module), its weights on ``map_location``'s device.

    Raises:
        CheckpointNotFoundError: there is no checkpoint at ``checkpoint_path``.
        UnsupportedFormatError: ``checkpoint_path`` is a ``torch.save`` file (use Lightning's own).
        LoadMismatchError: a saved Enum or dataclass class is not imported (import its module).
        RuntimeError: ``strict`` and keys that do not match (Lightning's own error).

    Example:
        >>> from shardpoint.integrations.lightning import load_from_checkpoint  # doctest: +SKIP
        >>> model = load_from_checkpoint(MyModel, "ckpts/last.ckpt", map_location="cpu")  # doctest: +SKIP
    """
    saving, pl = _saving_module_for(cls)
    io = ShardpointCheckpointIO(allow_pickle=allow_pickle)
    checkpoint = io.load_checkpoint(checkpoint_path, map_location=map_location)
    hparams_key = cls.CHECKPOINT_HYPER_PARAMS_KEY  # type: ignore[attr-defined]
    checkpoint.setdefault(hparams_key, {})
    checkpoint[hparams_key].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model if device is None else model.to(device)


_STRATEGIES = ("ShardpointFSDPStrategy", "ShardpointModelParallelStrategy", "ShardpointStrategyMixin")


def __getattr__(name: str) -> Any:
    """The sharded strategies, imported on first use (they import ``lightning.pytorch``)."""
    if name in _STRATEGIES:
        from . import _lightning_strategies

        return getattr(_lightning_strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "COMPONENT_OF_KEY",
    "EXTRA_COMPONENT",
    "METADATA_KEY",
    "ShardpointCheckpointIO",
    "ShardpointFSDPStrategy",
    "ShardpointModelParallelStrategy",
    "ShardpointStrategyMixin",
    "from_shardpoint_state",
    "is_lightning_distributed_checkpoint",
    "load_from_checkpoint",
    "to_shardpoint_state",
]
