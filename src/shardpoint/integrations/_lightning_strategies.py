"""Lightning's sharded strategies saving and loading through shardpoint on every rank.

``ShardpointFSDPStrategy`` and ``ShardpointModelParallelStrategy`` are Lightning's
``FSDPStrategy`` and ``ModelParallelStrategy`` with :class:`ShardpointStrategyMixin` in
front, which takes over ``save_checkpoint``, ``load_checkpoint`` and the checkpoint IO:

- **sharded** (``FSDPStrategy(state_dict_type="sharded")``, ``ModelParallelStrategy(
  save_distributed_checkpoint=True)``, both defaults here): every rank passes its own
  shards of the model and of every optimizer's state (DTensors, from
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
  ``get_optimizer_state_dict``, keyed by parameter name) and the Lightning metadata to one
  collective ``sp.save`` over the default process group: each rank writes only the bytes
  it holds (layout ``chunked``), the coordinator commits the directory atomically once
  every rank has written; a failure on any rank fails the save on every rank.
- **full** (``state_dict_type="full"``, ``save_distributed_checkpoint=False``): Lightning
  gathers the full state on rank 0, which saves it through the strategy's
  :class:`ShardpointCheckpointIO` (the same directory format).
- **load**: a shardpoint checkpoint, sharded or full, written on any number of ranks, is
  read collectively into this run's own shards (``sp.load_into`` with DTensor targets: each
  rank reads only the byte ranges it holds) and handed to the model and optimizers with
  ``set_model_state_dict`` / ``set_optimizer_state_dict``. Optimizer states keyed by
  parameter index (full saves, single-device ``ShardpointCheckpointIO`` saves) are matched
  through the optimizer's parameter order. Any other path (a Lightning DCP folder, a
  ``torch.save`` file) is left to Lightning's own ``load_checkpoint``.

The strategy's checkpoint IO is a :class:`ShardpointCheckpointIO` (``ShardpointCheckpointIO()``
by default; one passed as ``checkpoint_io=`` or in ``Trainer(plugins=[...])`` sets the options
of every save, sharded ones included: ``max_shard_size``, ``allow_pickle``, ``durable``).
Another ``CheckpointIO`` is refused: these strategies only write shardpoint checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from .._format.manifest import MANIFEST_NAME
from .._load.into import load_into
from .._load.result import report_lines
from .._source import open_checkpoint
from .._storage.local import replacing_a_file
from ..errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidStateError,
    LoadMismatchError,
)
from ._lightning_state import (
    COMPONENT_OF_KEY,
    METADATA_KEY,
    from_shardpoint_state,
    to_shardpoint_state,
)
from .lightning import ShardpointCheckpointIO

MODEL = COMPONENT_OF_KEY["state_dict"]
OPTIM = COMPONENT_OF_KEY["optimizer_states"]


def is_shardpoint_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed shardpoint checkpoint directory."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_NAME))


def _walk_tensors(value: Any) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _walk_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk_tensors(v)


def _refuse_sharded_tensors(checkpoint: Mapping[str, Any], strategy: str) -> None:
    """``ShardedTensor`` (FSDP1 without a device mesh) cannot be saved: say what to do."""
    for key in ("state_dict", "optimizer_states"):
        for tensor in _walk_tensors(checkpoint.get(key)):
            if type(tensor).__name__ == "ShardedTensor":
                raise InvalidStateError(
                    f"{strategy}: the {key!r} of this checkpoint holds a ShardedTensor (FSDP wrapped "
                    "without a device mesh); shardpoint saves DTensor shards. Build the strategy "
                    "without a `device_mesh` argument (it then wraps over a 1-D mesh of all ranks) "
                    "or pass a DeviceMesh as `device_mesh`"
                )


def _saved_optimizer_keys_are_indices(tree: Mapping[str, Any]) -> list[bool]:
    """For each optimizer of a saved ``optim`` component's tree: are its states keyed by index?"""
    result: list[bool] = []
    for node in tree.get("items", []) if tree.get("type") == "list" else []:
        indices = False
        if isinstance(node, Mapping) and node.get("type") == "dict":
            for key_type, key, value in node.get("items", []):
                if key_type == "str" and key == "param_groups" and isinstance(value, Mapping):
                    for group in value.get("items", []):
                        for gk_type, gk, gv in group.get("items", []) if isinstance(group, Mapping) else []:
                            if gk_type == "str" and gk == "params" and isinstance(gv, Mapping):
                                leaves = [p.get("value") for p in gv.get("items", []) if isinstance(p, Mapping)]
                                indices = indices or any(isinstance(v, int) for v in leaves)
        result.append(indices)
    return result


class ShardpointStrategyMixin:
    """Sharded and full saves and loads of a Lightning FSDP / ModelParallel strategy through shardpoint.

    Put it first in the bases of a subclass of ``FSDPStrategy`` or ``ModelParallelStrategy``
    (or of a strategy of your own built on either); :class:`ShardpointFSDPStrategy` and
    :class:`ShardpointModelParallelStrategy` are exactly that. The strategy must have
    ``model``, ``optimizers``, ``lightning_module``, ``broadcast``, ``global_rank`` and
    ``is_global_zero`` as Lightning's parallel strategies do.

    Example:
        >>> import lightning.pytorch as pl  # doctest: +SKIP
        >>> from shardpoint.integrations.lightning import ShardpointModelParallelStrategy  # doctest: +SKIP
        >>> trainer = pl.Trainer(accelerator="cuda", devices=4,  # doctest: +SKIP
        ...                      strategy=ShardpointModelParallelStrategy())
    """

    # Provided by the Lightning strategy this mixin is combined with.
    model: Any
    optimizers: Any
    lightning_module: Any
    global_rank: int
    is_global_zero: bool
    _checkpoint_io: Any
    broadcast: Any

    def _shardpoint_sharded(self) -> bool:
        """Whether this strategy saves sharded (each rank its shards) rather than full."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoint IO

    @property
    def checkpoint_io(self) -> Any:
        """The :class:`ShardpointCheckpointIO` whose options every save uses (full saves go
        through it; ``AsyncCheckpointIO`` around it runs full saves in its thread)."""
        io = self._checkpoint_io
        if io is None:
            io = self._checkpoint_io = ShardpointCheckpointIO()
        inner = _unwrapped(io)
        if inner is None:
            io.checkpoint_io = ShardpointCheckpointIO()  # an AsyncCheckpointIO() without a plugin
            return io
        if not isinstance(inner, ShardpointCheckpointIO):
            raise InvalidArgumentError(
                f"{type(self).__name__} saves shardpoint checkpoints only, but its checkpoint IO is a "
                f"{type(inner).__name__}: pass a ShardpointCheckpointIO (or none) as its checkpoint_io "
                f"or in Trainer(plugins=[...]), or use Lightning's own {_lightning_base(self)} for "
                f"{type(inner).__name__} checkpoints"
            )
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    def _shardpoint_options(self) -> ShardpointCheckpointIO:
        inner = _unwrapped(self.checkpoint_io)
        assert isinstance(inner, ShardpointCheckpointIO)
        return inner

    # ------------------------------------------------------------------ save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Save Lightning's checkpoint dict at ``filepath`` (called on every rank).

        Sharded: every rank writes its shards of ``state_dict`` and ``optimizer_states``
        into one shardpoint checkpoint, committed atomically. Full: rank 0 saves the
        gathered state through the checkpoint IO. An existing checkpoint there is replaced
        atomically; a file there (a ``torch.save`` checkpoint) is removed first.

        Raises:
            InvalidArgumentTypeError: ``storage_options`` was given (not supported; also a TypeError).
            InvalidStateError: a value cannot be stored (see ``ShardpointCheckpointIO(allow_pickle=...)``).
            DistributedCheckpointError: a rank failed; raised on every rank, naming it.
        """
        if storage_options is not None:
            raise InvalidArgumentTypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported; "
                "leave storage_options unset"
            )
        path = os.fspath(self.broadcast(os.fspath(filepath)))
        if not self._shardpoint_sharded():
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, path)
            return
        _refuse_sharded_tensors(checkpoint, type(self).__name__)
        options = self._shardpoint_options()
        state, metadata = to_shardpoint_state(checkpoint)
        metadata[METADATA_KEY]["sharded"] = True
        import torch.distributed as dist

        from .._api import save

        try:
            with replacing_a_file():  # a file or link at the path: replaced at the commit
                save(
                    state,
                    path,
                    process_group=dist.group.WORLD,
                    layout="chunked",
                    max_shard_size=options.max_shard_bytes,
                    overwrite=True,
                    metadata=metadata,
                    durable=options.durable,
                    allow_pickle=options.allow_pickle,
                    progress=False,
                )
        except InvalidStateError as exc:
            if options.allow_pickle:
                raise
            raise InvalidStateError(
                f"{exc}. With Lightning, build the plugin as ShardpointCheckpointIO(allow_pickle=True) "
                "and pass it to the strategy to pickle such values, or keep hyperparameters to JSON values"
            ) from None

    # ------------------------------------------------------------------ load

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a shardpoint checkpoint into this run's model and optimizers, resharding.

        Every rank reads only its own shards (written by any number of ranks, sharded or
        full); the model and, when fitting, each optimizer are set from them. Returns the
        rest of the checkpoint dict (epoch, loops, callbacks, hyperparameters, ...), as
        Lightning's sharded strategies do. A path that is not a shardpoint checkpoint
        goes to Lightning's own ``load_checkpoint``.

        Raises:
            LoadMismatchError: the checkpoint's keys or shapes do not match the model or its
                optimizers (with the module's ``strict_loading``), or it holds no optimizer
                state while a fit resumes from it.
            DistributedCheckpointError: a rank failed; raised on every rank, naming it.
        """
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        if not is_shardpoint_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = self._shardpoint_options()
        allow_pickle = options.allow_pickle and weights_only is not True
        strict = bool(getattr(self.lightning_module, "strict_loading", True))
        with open_checkpoint(path) as ckpt:
            manifest = ckpt.manifest
            assert manifest is not None  # is_shardpoint_checkpoint
            components = list(manifest.components)
            meta = manifest.metadata
            optim_tree = manifest.components[OPTIM].tree if OPTIM in manifest.components else None
        if MODEL not in components:
            raise LoadMismatchError(
                f"{path} holds no model state (components: {', '.join(components)}); it was not "
                "written by a Lightning strategy or ShardpointCheckpointIO: load it with sp.load_into"
            )
        sd_options = StateDictOptions(full_state_dict=False, strict=strict)
        model_state = get_model_state_dict(self.model, options=sd_options)
        target: dict[str, Any] = {MODEL: model_state}
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if self._fitting() else []
        orders: list[list[str] | None] = []
        if optimizers:
            if optim_tree is None:
                raise LoadMismatchError(
                    f"{path} holds the model only (saved with ModelCheckpoint(save_weights_only=True)?), "
                    "so a fit cannot resume its optimizer state from it: resume from a full checkpoint, "
                    "or load the weights with load_from_checkpoint and start a new fit"
                )
            by_index = _saved_optimizer_keys_are_indices(optim_tree)
            if len(by_index) != len(optimizers):
                raise LoadMismatchError(
                    f"{path} holds the state of {len(by_index)} optimizer(s), this run has "
                    f"{len(optimizers)}: configure_optimizers must return the optimizers it was saved with"
                )
            states = []
            for optimizer, indices in zip(optimizers, by_index, strict=True):
                state: Any = get_optimizer_state_dict(self.model, optimizer, options=sd_options)
                order: list[str] = [name for group in state["param_groups"] for name in group["params"]]
                if indices:
                    position = {name: i for i, name in enumerate(order)}
                    state = {
                        "state": {position[name]: value for name, value in state["state"].items()},
                        "param_groups": state["param_groups"],
                    }
                orders.append(order if indices else None)
                states.append(state)
            target[OPTIM] = states
        rest = [c for c in components if c not in (MODEL, OPTIM)]
        target.update(dict.fromkeys(rest))  # plain values: filled in by the same collective load
        # Not fitting (validate / test / predict): the optimizer states stay unread, so they
        # would be "unexpected"; the strict check then leaves them out (after the load).
        skipped = [] if optimizers or OPTIM not in components else [OPTIM]
        result = load_into(target, path, strict=strict and not skipped, process_group=dist.group.WORLD,
                           allow_pickle=allow_pickle, progress=False)
        if strict and skipped:
            result = dataclasses.replace(
                result, unexpected_keys=[k for k in result.unexpected_keys if k not in skipped])
            if not result.matched:
                raise LoadMismatchError(
                    "\n  ".join([f"loading {path} into this run's model does not match "
                                  "(the LightningModule's strict_loading is True):", *report_lines(result),
                                  "build the module the checkpoint was saved from, or set "
                                  "strict_loading = False on it to load the matching tensors"]),
                    result,
                )
        set_model_state_dict(self.model, target[MODEL], options=sd_options)
        for optimizer, loaded_state, names in zip(optimizers, target.get(OPTIM, []), orders, strict=True):
            if names is not None:
                loaded_state = _by_name(loaded_state, names, path)
            set_optimizer_state_dict(self.model, optimizer, loaded_state, options=sd_options)
        loaded = {c: target[c] for c in rest}
        info = meta.get(METADATA_KEY)
        if isinstance(info, Mapping) and isinstance(info.get("keys"), list):
            meta = {**meta, METADATA_KEY: {**info, "keys": [
                [k, c] for k, c in info["keys"] if c not in (MODEL, OPTIM)]}}
        return from_shardpoint_state(loaded, meta)

    def _fitting(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:
            return bool(self.optimizers)
        return bool(trainer.state.fn == "fit" and self.optimizers)


def _by_name(state: Mapping[str, Any], order: list[str], path: str) -> dict[str, Any]:
    """An index-keyed optimizer state (as loaded) keyed by parameter name, through ``order``."""

    def name(i: Any) -> str:
        if not isinstance(i, int) or not 0 <= i < len(order):
            raise LoadMismatchError(
                f"{path}: optimizer parameter index {i!r} is out of range for this run's "
                f"{len(order)} parameters; the optimizer was built over other parameters"
            )
        return order[i]

    groups = [{**g, "params": [name(i) for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {name(i): v for i, v in state["state"].items()}, "param_groups": groups}


def _unwrapped(io: Any) -> Any:
    """The ``CheckpointIO`` inside Lightning's wrappers (``AsyncCheckpointIO``)."""
    while any(c.__name__ == "_WrappingCheckpointIO" for c in type(io).__mro__):
        io = io.checkpoint_io
        if io is None:
            return None
    return io


def _lightning_base(strategy: Any) -> str:
    for cls in type(strategy).__mro__:
        if cls.__module__.startswith(("lightning.", "pytorch_lightning.")):
            return cls.__name__
    return "strategy"


class ShardpointFSDPStrategy(ShardpointStrategyMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` saving and loading shardpoint checkpoints on every rank.

    Takes ``FSDPStrategy``'s arguments; ``state_dict_type`` defaults to ``"sharded"``
    (each rank writes its shards; ``"full"``: rank 0 writes the gathered state). Without
    a ``device_mesh`` the model is wrapped over a 1-D mesh of all ranks, so its sharded
    state is DTensors (resharded on load to any world size).

    Example:
        >>> trainer = pl.Trainer(accelerator="cuda", devices=8,  # doctest: +SKIP
        ...                      strategy=ShardpointFSDPStrategy(auto_wrap_policy={Block}))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("state_dict_type", "sharded")
        super().__init__(*args, **kwargs)

    def _shardpoint_sharded(self) -> bool:
        return bool(self._state_dict_type == "sharded")

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.kwargs.get("device_mesh") is None and self._shardpoint_sharded():
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, (self.world_size,))
        return super()._setup_model(model)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._shardpoint_sharded():
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._shardpoint_sharded():
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer), options=options)

class ShardpointModelParallelStrategy(ShardpointStrategyMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel DTensors) saving and
    loading shardpoint checkpoints on every rank.

    Takes ``ModelParallelStrategy``'s arguments, plus ``checkpoint_io`` (a
    :class:`ShardpointCheckpointIO` setting the save options). With
    ``save_distributed_checkpoint=True`` (the default) each rank writes its shards;
    ``False``: rank 0 writes the gathered state.

    Example:
        >>> trainer = pl.Trainer(accelerator="cuda", devices=4,  # doctest: +SKIP
        ...                      strategy=ShardpointModelParallelStrategy(tensor_parallel_size=2))
    """

    def __init__(self, *args: Any, checkpoint_io: ShardpointCheckpointIO | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoint_io = checkpoint_io

    def _shardpoint_sharded(self) -> bool:
        return bool(self._save_distributed_checkpoint)


__all__ = ["ShardpointFSDPStrategy", "ShardpointModelParallelStrategy", "ShardpointStrategyMixin"]
