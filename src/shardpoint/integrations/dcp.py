"""``torch.distributed.checkpoint`` storage for shardpoint checkpoints: a reader and a writer.

>>> import torch.distributed.checkpoint as dcp  # doctest: +SKIP
>>> from shardpoint.integrations.dcp import ShardpointStorageReader  # doctest: +SKIP
>>> state = {"model": model.state_dict(), "optim": opt.state_dict()}  # doctest: +SKIP
>>> dcp.load(state, storage_reader=ShardpointStorageReader("ckpt/step-100"))  # doctest: +SKIP

Any checkpoint ``sp.load`` reads (written by ``sp.save`` in one process or by every rank,
flat or nested, local or on an object store; a Hugging Face safetensors directory too) is
presented to DCP as its ``Metadata``: each tensor is one global tensor of its stored dtype
and shape, under the name DCP's own planner gives it (``flatten_state_dict`` of the state
as ``sp.load`` returns it: ``model.layers.0.weight``, ``optim.state.0.exp_avg``; a flat
checkpoint's names are the tensor names). DCP's planner then asks each rank for the regions
its state holds (its shards of a DTensor / FSDP2 state, whole tensors otherwise), and each
region is read with shardpoint's reader: only the bytes of stored chunks that overlap it,
crc32c checked wherever a whole stored chunk is read. JSON leaves (``lr``, ``step`` ints,
...) are handed to the planner as DCP expects them.

``ShardpointStorageWriter``: ``dcp.save`` / ``dcp.async_save`` into a shardpoint checkpoint
(safetensors files, manifest with crc32c, atomic commit), readable by ``sp.load``, the CLI
and ``ShardpointStorageReader``:

>>> dcp.save(state, storage_writer=ShardpointStorageWriter("ckpt/step-100"))  # doctest: +SKIP

In one process the state is rebuilt from the items DCP's planner hands over and saved with
``sp.save``; on several ranks every rank saves its own shards through ``sp.save``'s
collective commit (layout ``chunked``), inside ``write_data``, where all ranks are.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from typing import Any

import torch

from .._format.dtypes import dtype_from_name
from .._read import ReadBatch
from .._source import Checkpoint, open_checkpoint
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidStateError,
    MissingDependencyError,
    UnsafePickleError,
)


def _dcp() -> Any:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:  # pragma: no cover - torch builds without distributed
        raise MissingDependencyError(
            "shardpoint.integrations.dcp needs torch.distributed.checkpoint, which this torch "
            f"build lacks ({exc}); install a torch build with distributed support"
        ) from None
    return dcp


def _base() -> type:
    return _dcp().StorageReader


class _Leaf:
    """Where a DCP name is stored: a tensor record, or a JSON value."""

    __slots__ = ("label", "record", "value")

    def __init__(self, record: Any = None, label: str = "", value: Any = None) -> None:
        self.record = record
        self.label = label
        self.value = value


class _Entries(dict[str, Any]):
    """The metadata's ``state_dict_metadata``: asked whether it holds a name it refuses (an
    optimizer's state by position where it was stored by name), it raises that refusal, so
    DCP's planner stops there with what to do, not at its bare "Missing key". Listing it
    (a planner loading everything) shows the stored names only."""

    def __init__(self, entries: dict[str, Any], refused: dict[str, str]) -> None:
        super().__init__(entries)
        self.refused = refused

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        message = self.refused.get(key) if isinstance(key, str) else None
        if message is not None:
            raise InvalidStateError(message)
        return False

    def __reduce__(self) -> Any:  # sent to other ranks with the metadata
        return (_Entries, (dict(self), self.refused))


def _by_position(value: Any) -> dict[str, Any] | None:
    """An optimizer state stored by parameter name (``{"state": {name: ...}, "param_groups":
    [{"params": [names]}]}``) seen by position, as ``optimizer.state_dict()`` numbers them:
    ``{"state": {"0": ...}, "param_groups": [{"params": ...}]}``; None for anything else, or
    where a name is itself a number."""
    if not isinstance(value, dict) or not isinstance(value.get("state"), dict):
        return None
    groups = value.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        return None
    names = [n for g in groups for n in g["params"]]
    if not names or not all(isinstance(n, str) and not n.isdigit() for n in names):
        return None
    return {"state": {str(i): value["state"][n] for i, n in enumerate(names) if n in value["state"]},
            "param_groups": [{"params": list(range(len(g["params"])))} for g in groups]}


class _Pickled:
    """Stands for a value pickled at save time (its bytes are the stored tensor ``name``)."""

    __slots__ = ("cls", "component", "name")

    def __init__(self, component: str, name: str, cls: str) -> None:
        self.component = component
        self.name = name
        self.cls = cls


def _mark_pickles(node: Any, component: str) -> Any:
    """The tree with each ``pickle`` node replaced by a JSON leaf holding a :class:`_Pickled`
    (so the metadata never unpickles; a pickled value is read only when DCP asks for it)."""
    if isinstance(node, dict):
        if node.get("type") == "pickle":
            return {"type": "json", "value": _Pickled(component, str(node.get("name")), str(node.get("class")))}
        return {k: _mark_pickles(v, component) for k, v in node.items()}
    if isinstance(node, list):
        return [_mark_pickles(v, component) for v in node]
    return node


def _metadata(ckpt: Checkpoint) -> tuple[Any, dict[str, _Leaf]]:
    """DCP ``Metadata`` for ``ckpt`` and, for each DCP name, where its value is."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from .._flatten import unflatten_state

    state: dict[str, Any] = {}
    leaf_of: dict[int, _Leaf] = {}
    for cname, rec in ckpt.components.items():
        placeholders: dict[str, torch.Tensor] = {}
        for name, trec in rec.tensors.items():
            where = f"{ckpt.location}, tensor {name!r}"
            meta = torch.empty(trec.shape, dtype=dtype_from_name(trec.dtype, where=where), device="meta")
            placeholders[name] = meta
            leaf_of[id(meta)] = _Leaf(trec, name if ckpt.flat else f"{cname}/{name}")
        for alias, stored in rec.aliases.items():
            if stored not in placeholders:
                raise CorruptCheckpointError(f"{ckpt.location}: alias {alias!r} names tensor {stored!r}, which is not stored")
            placeholders[alias] = placeholders[stored]
        tree = _mark_pickles(rec.tree, cname)
        state[cname] = unflatten_state(tree, placeholders, where=f"{ckpt.location}, component {cname!r}")
    positional: dict[str, Any] = {}
    if not ckpt.flat:
        for cname, value in state.items():
            seen = _by_position(value)
            if seen is not None:
                positional[cname] = seen
    if ckpt.flat:
        state = state["model"]
    flat, _ = flatten_state_dict(state)
    entries: dict[str, Any] = {}
    leaves: dict[str, _Leaf] = {}
    # An optimizer stored by parameter name, asked for by position (a target of
    # optimizer.state_dict()): refused naming the way that loads it right (see _Entries).
    refused: dict[str, str] = {}
    for fqn in flatten_state_dict(positional)[0]:
        if fqn not in flat:
            component = fqn.split(".", 1)[0]
            refused[fqn] = (
                f"{ckpt.location}: DCP asks for {fqn!r}, optimizer state by position (a target built with "
                f"optimizer.state_dict()), but component {component!r} holds its optimizer's state by parameter "
                "name (sp.save of the model and its optimizer): load it with get_optimizer_state_dict / "
                "set_optimizer_state_dict of torch.distributed.checkpoint.state_dict (keyed by parameter name), "
                f"or with sp.load_into({{'{component}': optimizer, ...}}, path) beside its model; nothing was loaded"
            )
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            leaf = leaf_of[id(value)]
            entries[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=value.dtype),
                size=torch.Size(value.shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=torch.Size(value.shape))],
            )
            leaves[fqn] = leaf
        else:
            entries[fqn] = BytesStorageMetadata()
            leaves[fqn] = _Leaf(value=value)
    return Metadata(state_dict_metadata=_Entries(entries, refused)), leaves


class ShardpointStorageReader(_base()):  # type: ignore[misc]
    """A ``torch.distributed.checkpoint`` ``StorageReader`` for shardpoint checkpoints.

    Args:
        path: the checkpoint (as for ``sp.load``); ``dcp.load(checkpoint_id=...)`` may name
            another one instead.
        storage_options: fsspec options for an object-store URL (as for ``sp.load``).
        verify: check crc32c of every stored chunk read whole (default True).
        allow_pickle: unpickle values that ``sp.save(allow_pickle=True)`` pickled, when the
            state being loaded asks for them (default: refused, naming the key; the rest of
            the checkpoint still loads when those keys are left out of the state).

    Raises (from ``dcp.load``):
        CheckpointNotFoundError: nothing at ``path``.
        CorruptCheckpointError / ChecksumMismatchError: damaged files, naming them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.storage_options = storage_options
        self.verify = verify
        self.allow_pickle = allow_pickle
        self._ckpt: Checkpoint | None = None
        self._leaves: dict[str, _Leaf] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.close()

    def close(self) -> None:
        """Release the open checkpoint's files (``dcp.load`` does not say when it is done)."""
        if self._ckpt is not None:
            self._ckpt.close()
        self._ckpt = None
        self._leaves = {}

    def _open(self) -> Checkpoint:
        if self._ckpt is None:
            if self.path is None:
                raise InvalidArgumentError(
                    "ShardpointStorageReader has no checkpoint to read: pass its path, "
                    "ShardpointStorageReader(path), or dcp.load(..., checkpoint_id=path)"
                )
            self._ckpt = open_checkpoint(self.path, self.storage_options)
        return self._ckpt

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata, self._leaves = _metadata(self._open())
        return metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._leaves:
            self.read_metadata()

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
        from torch.distributed.checkpoint.planner import LoadItemType

        ckpt = self._open()
        batch = ReadBatch(ckpt, verify=self.verify)
        pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        for item in plan.items:
            leaf = self._leaves.get(item.storage_index.fqn)
            if leaf is None:
                raise CorruptCheckpointError(
                    f"{ckpt.location}: DCP asked for {item.storage_index.fqn!r}, which this "
                    "checkpoint does not hold"
                )
            if item.type == LoadItemType.BYTE_IO:
                value = leaf.value
                if isinstance(value, _Pickled):
                    value = self._unpickle(ckpt, value, item.storage_index.fqn)
                buffer = io.BytesIO()
                torch.save(value, buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != tuple(item.lengths):
                raise CorruptCheckpointError(
                    f"{ckpt.location}: tensor {item.storage_index.fqn!r}: DCP asked for a region "
                    f"of shape {list(item.lengths)} into one of shape {list(target.shape)}"
                )
            stored = dtype_from_name(leaf.record.dtype, where=leaf.label)
            # Straight into the target where the dtype matches (no copy of the state);
            # else into a region of the stored dtype, cast by the copy below.
            region = target if target.dtype == stored else torch.empty(tuple(item.lengths), dtype=stored)
            batch.fill(leaf.record, region, leaf.label, tuple(item.storage_offsets))
            pending.append((item, target, region))
        batch.run(False)
        for item, target, region in pending:
            if region is not target:
                batch.out_of_range.check(item.storage_index.fqn, region, target.dtype)
                target.copy_(region)
            planner.commit_tensor(item, target)
        batch.warn_out_of_range()  # a narrowing cast says what it did, as load_into does
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _unpickle(self, ckpt: Checkpoint, value: _Pickled, fqn: str) -> Any:
        """A value pickled at save time, only with ``allow_pickle``."""
        if not self.allow_pickle:
            raise UnsafePickleError(
                f"{ckpt.location}: {fqn!r} (a {value.cls}) was pickled at save time; unpickling "
                "runs arbitrary code, so it is refused. Pass "
                "ShardpointStorageReader(path, allow_pickle=True) only if you trust whoever wrote "
                "this checkpoint, or leave that key out of the state you load"
            )
        record = ckpt.components[value.component].tensors[value.name]
        data = torch.empty(record.shape, dtype=torch.uint8)
        batch = ReadBatch(ckpt, verify=self.verify)
        batch.fill(record, data, value.name)
        batch.run(False)
        return pickle.loads(data.numpy().tobytes())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            open_checkpoint(os.fspath(checkpoint_id)).close()
        except (CheckpointError, OSError):
            return False
        return True


def _writer_base() -> type:
    return _dcp().StorageWriter


_RANKS_KEY = "shardpoint_ranks"
"""What ``prepare_global_plan`` puts in each rank's plan: the ranks of the ``dcp.save``."""


class ShardpointStorageWriter(_writer_base()):  # type: ignore[misc]
    """A ``torch.distributed.checkpoint`` ``StorageWriter`` writing a shardpoint checkpoint.

    One process (``no_dist=True`` or no process group): ``write_data`` keeps what DCP's
    planner resolves and ``finish`` rebuilds the state from the metadata's ``planner_data``
    and saves it with ``sp.save``. Several ranks: ``write_data`` rebuilds each rank's local
    state from the planner (``DefaultSavePlanner``'s flattened ``state_dict`` and
    ``mappings``) and every rank calls ``sp.save`` together over the default group (each
    writes only its shards, replicated tensors split between the ranks; a failure on any
    rank fails all, nothing committed). A ``dcp.save`` over a subgroup is refused on its
    ranks before anything is written. Either way ``sp.load`` returns the state that was
    saved, DCP's int keys as strings (as DCP stores them).

    Args:
        path: the checkpoint directory to create (``dcp.save(checkpoint_id=...)`` may name
            another one instead).
        overwrite: replace an existing checkpoint there (atomically), as ``sp.save``.
        max_shard_size: largest data file, as ``sp.save``.
        storage_options: fsspec options when ``path`` is an object-store URL
            (``s3://bucket/run/step-100``), as ``sp.save``: data objects uploaded
            concurrently, ``shardpoint.json`` last.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        overwrite: bool = False,
        max_shard_size: int | str = "5GB",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._values: dict[str, Any] = {}
        """Fully qualified name -> the value ``write_data`` gathered, saved by ``finish``."""
        self._ranks = 1
        self.path = None if path is None else os.fspath(path)
        self.overwrite = overwrite
        self.max_shard_size = max_shard_size
        self.storage_options = storage_options

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._values = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        self._ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        # The coordinator sees one plan per rank of this dcp.save: 1 with no_dist=True (one
        # process saving alone, whatever the world), else the ranks of its group. Each rank
        # learns it from its plan, so that none starts a collective save the others skip.
        return [dataclasses.replace(p, storage_data={_RANKS_KEY: len(plans)}) for p in plans]

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[list[Any]]:
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

        told = plan.storage_data.get(_RANKS_KEY) if isinstance(plan.storage_data, dict) else None
        if isinstance(told, int):
            self._ranks = told
        if self._ranks > 1:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if self._ranks != world:
                raise InvalidArgumentError(
                    f"ShardpointStorageWriter({self.path!r}): this dcp.save runs over {self._ranks} of the "
                    f"{world} ranks (process_group=): a collective shardpoint save runs over every rank. Save over "
                    "the default group, or with sp.save(state, path, process_group=group) on the ranks of the "
                    "group. Nothing was written"
                )
            return self._write_collectively(plan, planner)
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data.seek(0)
                # The bytes DCP's planner just pickled from the state in this process.
                value: Any = torch.load(data, weights_only=False)
                size = data.getbuffer().nbytes
            else:
                value = data.detach()
                chunk = item.tensor_data.chunk
                if tuple(chunk.sizes) != tuple(item.tensor_data.size):
                    raise InvalidStateError(
                        f"ShardpointStorageWriter: tensor {fqn!r} is a shard (offsets "
                        f"{list(chunk.offsets)} of {list(item.tensor_data.size)}); one process "
                        "must hold whole tensors. Save sharded states with sp.save on every rank"
                    )
                size = value.numel() * value.element_size()
            self._values[fqn] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
        done: torch.futures.Future[list[Any]] = torch.futures.Future()
        done.set_result(results)
        return done

    def _write_collectively(self, plan: Any, planner: Any) -> torch.futures.Future[list[Any]]:
        """Several ranks: every rank saves its whole local state (DTensor shards, replicated
        tensors, values) with ``sp.save``'s collective commit, here, where all ranks are."""
        from torch.distributed.checkpoint.storage import WriteResult

        from .. import _api
        from .._sources.open import _set_path

        flat = getattr(planner, "state_dict", None)
        if not isinstance(flat, dict):
            raise InvalidArgumentTypeError(
                f"ShardpointStorageWriter({self.path!r}) on several ranks needs DCP's "
                f"DefaultSavePlanner (or a subclass), not {type(planner).__name__}"
            )
        paths = getattr(planner, "mappings", None) or {}
        state: dict[str, Any] = {}
        for fqn, value in flat.items():
            _set_path(state, paths.get(fqn, (fqn,)), value)
        import torch.distributed as dist

        # Over the default group, which DCP saves over: a state of plain (replicated) tensors
        # would otherwise be saved by each rank alone, racing for the one path.
        _api.save(state, self._require_path(), overwrite=self.overwrite, max_shard_size=self.max_shard_size,
                  storage_options=self.storage_options, process_group=dist.group.WORLD)
        results = [WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items]
        done: torch.futures.Future[list[Any]] = torch.futures.Future()
        done.set_result(results)
        return done

    def _require_path(self) -> str:
        if self.path is None:
            raise InvalidArgumentError(
                "ShardpointStorageWriter has no checkpoint to write: pass its path, "
                "ShardpointStorageWriter(path), or dcp.save(..., checkpoint_id=path)"
            )
        return self.path

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        from .. import _api
        from .._sources.open import _set_path

        if self._ranks > 1:
            return  # committed by every rank together in write_data
        if self.path is None:
            raise InvalidArgumentError(
                "ShardpointStorageWriter has no checkpoint to write: pass its path, "
                "ShardpointStorageWriter(path), or dcp.save(..., checkpoint_id=path)"
            )
        paths = getattr(metadata, "planner_data", None) or {}
        state: dict[str, Any] = {}
        for fqn, value in self._values.items():
            _set_path(state, paths.get(fqn, (fqn,)), value)
        self._values = {}
        _api.save(state, self.path, overwrite=self.overwrite, max_shard_size=self.max_shard_size,
                  storage_options=self.storage_options)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen only when named: DCP's own writer stays the default
