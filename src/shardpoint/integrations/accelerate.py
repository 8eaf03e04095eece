"""``save_state`` / ``load_state``: Accelerate's training state as one shardpoint checkpoint.

>>> from accelerate import Accelerator  # doctest: +SKIP
>>> from shardpoint.integrations.accelerate import save_state, load_state  # doctest: +SKIP
>>> accelerator = Accelerator(project_config=ProjectConfiguration(  # doctest: +SKIP
...     project_dir="run", automatic_checkpoint_naming=True, total_limit=3))
>>> model, opt, sched, dl = accelerator.prepare(model, opt, sched, dl)  # doctest: +SKIP
>>> save_state(accelerator)  # run/checkpoints/checkpoint_<i>  # doctest: +SKIP
>>> load_state(accelerator)  # the newest committed one  # doctest: +SKIP

What one checkpoint holds, one top-level component each (the names Accelerate gives its
files, without the suffix): every prepared model, unwrapped (``model``, ``model_1``, …:
the plain module's ``state_dict``, so ``model.safetensors`` opens with ``transformers``
tooling as-is); every prepared optimizer (``optimizer``, ``optimizer_1``, …; its state
keyed by parameter name through the models); every prepared scheduler (``scheduler``, …);
the ``GradScaler`` (``scaler``) when there is one; every ``register_for_checkpointing``
object's ``state_dict`` (``custom_checkpoint_0``, …); ``accelerate`` (``step`` and the
``iteration`` of automatic naming); and ``per_rank``: for every process, in rank order,
its RNG states (:class:`shardpoint.RNGState`: Python, NumPy, torch, CUDA) and the state of
each prepared dataloader as that process holds it (epoch counter, ``SeedableRandomSampler``
epoch and seed, the sampler's ``torch.Generator`` state, a ``StatefulDataLoader``'s
``state_dict``).

With several processes every rank calls ``save_state`` / ``load_state``: the ranks'
``per_rank`` parts are gathered first (one ``all_gather_object``), and the save is one
collective shardpoint save over the default process group (layout ``chunked``: the
replicated DDP model and optimizer bytes are written once, split between the ranks; rank 0
commits). Loading, each rank takes its own ``per_rank`` entry; a run resumed on more
processes than it was saved with leaves the new ranks' generators as they are, with a
warning naming them.

Naming and retention follow Accelerate: with ``automatic_checkpoint_naming`` a checkpoint
is ``<project_dir>/checkpoints/checkpoint_<iteration>``, ``iteration`` goes up by one per
save, and after each commit the oldest shardpoint checkpoints beyond ``total_limit`` are
deleted (never before the new one is committed, so a crash never leaves fewer; folders that
are not shardpoint checkpoints, e.g. Accelerate's own, are never counted nor deleted).
``load_state`` without a path loads the newest committed ``checkpoint_<i>`` and, unlike
Accelerate's, sets ``iteration`` to ``i + 1`` so the next save does not collide.

A resume mid-epoch replays the same batches and random draws as the uninterrupted run
when the order of the batches does not depend on generator draws made before the save
(``DataLoaderConfiguration(use_seedable_sampler=True)``, the loop's ``set_epoch`` and
skipping the batches already trained on) and the ``DataLoader`` has a ``generator`` of its
own: PyTorch draws one number from it (from the global generator without one) whenever an
iterator starts, which the resumed run does mid-epoch and the uninterrupted run did not.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import threading
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import _api
from .._api import save
from .._async import AsyncSave
from .._format.manifest import MANIFEST_NAME
from .._load.into import load_into
from .._load.result import LoadResult
from .._stateful import RNGState
from .._storage.local import TMP_MARKER, recover_all
from .._write import SaveInfo
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    LoadMismatchError,
    UnsupportedFormatError,
)

__all__ = ["checkpoint_dirs", "load_state", "save_state"]

_CHECKPOINT_NAME = re.compile(r"checkpoint_(\d+)")


def _is_distributed(accelerator: Any) -> bool:
    return bool(accelerator.num_processes > 1 and torch.distributed.is_available()
                and torch.distributed.is_initialized())


def _process_group(accelerator: Any) -> Any:
    return torch.distributed.group.WORLD if _is_distributed(accelerator) else None


def _checkpoints_root(accelerator: Any) -> Path:
    """``<project_dir>/checkpoints``, where automatic naming puts every checkpoint."""
    if accelerator.project_dir is None:
        raise InvalidArgumentError(
            "this Accelerator has no project_dir, so there is no <project_dir>/checkpoints to "
            "look in: create it with project_config=ProjectConfiguration(project_dir=..., "
            "automatic_checkpoint_naming=True), or pass the checkpoint directory itself"
        )
    return Path(accelerator.project_dir) / "checkpoints"


def checkpoint_dirs(accelerator: Any) -> list[Path]:
    """The committed shardpoint checkpoints of automatic naming, oldest first.

    ``<project_dir>/checkpoints/checkpoint_<i>`` folders holding a shardpoint manifest,
    sorted by ``i``; anything else there (Accelerate's own checkpoints, saves in progress)
    is left out.

    Args:
        accelerator: an ``accelerate.Accelerator``.

    Returns:
        The paths, oldest first (empty when there are none).

    Example:
        >>> from shardpoint.integrations.accelerate import checkpoint_dirs
        >>> checkpoint_dirs(accelerator)  # doctest: +SKIP
        [PosixPath('run/checkpoints/checkpoint_3'), PosixPath('run/checkpoints/checkpoint_4')]
    """
    root = _checkpoints_root(accelerator)
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = _CHECKPOINT_NAME.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(entry.path, MANIFEST_NAME)):
            found.append((int(match.group(1)), Path(entry.path)))
    return [path for _, path in sorted(found)]


class _DataLoaderState:
    """What one process must restore of a prepared dataloader to replay the same batches."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def _sampler(self) -> Any:
        get = getattr(self.dataloader, "get_sampler", None)
        return get() if callable(get) else getattr(self.dataloader, "sampler", None)

    def state_dict(self) -> dict[str, Any]:
        dl = self.dataloader
        sd: dict[str, Any] = {}
        if isinstance(getattr(dl, "iteration", None), int):
            sd["iteration"] = dl.iteration  # the epoch counter DataLoaderShard keeps
        sampler = self._sampler()
        if sampler is not None:
            if isinstance(getattr(sampler, "epoch", None), int):
                sd["sampler_epoch"] = sampler.epoch
            if isinstance(getattr(sampler, "initial_seed", None), int):
                sd["sampler_seed"] = sampler.initial_seed
            generator = getattr(sampler, "generator", None)
            if isinstance(generator, torch.Generator):
                sd["sampler_generator"] = generator.get_state()
        if getattr(dl, "use_stateful_dataloader", False):
            sd["stateful"] = dl.state_dict()
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        dl = self.dataloader
        if "iteration" in sd:
            dl.iteration = sd["iteration"]
        sampler = self._sampler()
        if sampler is not None:
            if "sampler_epoch" in sd:
                sampler.epoch = sd["sampler_epoch"]
            if "sampler_seed" in sd:
                sampler.initial_seed = sd["sampler_seed"]
            generator = getattr(sampler, "generator", None)
            if "sampler_generator" in sd and isinstance(generator, torch.Generator):
                generator.set_state(sd["sampler_generator"].to(torch.uint8).cpu())
        if "stateful" in sd:
            dl.load_state_dict(sd["stateful"])


def _local_state(accelerator: Any) -> dict[str, Any]:
    return {
        "rng": RNGState().state_dict(),
        "dataloaders": [_DataLoaderState(dl).state_dict() for dl in accelerator._dataloaders],
    }


class _PerRank:
    """Every process's RNG and dataloader states (gathered), as one ``Stateful``."""

    def __init__(self, accelerator: Any, ranks: list[dict[str, Any]] | None = None) -> None:
        self.accelerator = accelerator
        self.ranks = ranks

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks if self.ranks is not None else [_local_state(self.accelerator)]}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        ranks = sd["ranks"]
        rank = self.accelerator.process_index
        if rank >= len(ranks):
            warnings.warn(
                f"this checkpoint holds the RNG and dataloader states of {len(ranks)} process(es); "
                f"process {rank} keeps its own (resumed on more processes than it was saved with, "
                "its batches and random draws are not those of the saved run)",
                stacklevel=3,
            )
            return
        mine = ranks[rank]
        dataloaders = list(self.accelerator._dataloaders)
        if len(mine["dataloaders"]) != len(dataloaders):
            raise LoadMismatchError(
                f"the checkpoint holds the states of {len(mine['dataloaders'])} prepared dataloader(s), "
                f"the Accelerator has {len(dataloaders)}; prepare the same dataloaders, in the same "
                "order, before load_state"
            )
        for dl, dl_sd in zip(dataloaders, mine["dataloaders"], strict=True):
            _DataLoaderState(dl).load_state_dict(dl_sd)
        RNGState().load_state_dict(mine["rng"])


class _Counters:
    """Accelerate's ``step`` (gradient accumulation) and automatic naming's ``iteration``."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step),
                "iteration": int(self.accelerator.project_configuration.iteration)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.accelerator.step = sd["step"]


def _suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


def _check_no_hooks(accelerator: Any, call: str) -> None:
    """Refuse an Accelerator with model state hooks: they save and load what they choose
    (diffusers' EMA model, LoRA weights) through files of their own in the folder, and
    drop models from Accelerate's lists; run without them, an EMA was lost without a word."""
    hooks = getattr(accelerator, "_save_model_state_pre_hook" if call == "save_state" else
                    "_load_model_state_pre_hook", None)
    if hooks:
        register = "register_save_state_pre_hook" if call == "save_state" else "register_load_state_pre_hook"
        raise InvalidArgumentError(
            f"{call}: this Accelerator has {len(hooks)} hook(s) registered with {register} (diffusers' scripts "
            "save an EMA model or adapter weights that way), which shardpoint's integration does not run: what "
            "they save would be lost. Use accelerator.save_state / load_state for this run, or remove the hooks "
            "and save those objects with register_for_checkpointing"
        )


def _state(accelerator: Any, per_rank: _PerRank) -> dict[str, Any]:
    """The objects to save / load into, keyed like Accelerate's files."""
    unsupported = str(getattr(accelerator, "distributed_type", "NO"))
    if any(kind in unsupported for kind in ("FSDP", "DEEPSPEED", "MEGATRON", "XLA")):
        raise InvalidArgumentError(
            f"shardpoint's Accelerate integration saves replicated (DDP or single-process) "
            f"training, not {unsupported}: its sharded states are written by that engine. Use "
            "accelerator.save_state for it"
        )
    state: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        state[f"model{_suffix(i)}"] = accelerator.unwrap_model(model)
    for i, opt in enumerate(accelerator._optimizers):
        state[f"optimizer{_suffix(i)}"] = getattr(opt, "optimizer", opt)
    for i, sched in enumerate(accelerator._schedulers):
        state[f"scheduler{_suffix(i)}"] = getattr(sched, "scheduler", sched)
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_checkpoint_{i}"] = obj
    state["accelerate"] = _Counters(accelerator)
    state["per_rank"] = per_rank
    return state


def _gathered(accelerator: Any) -> list[dict[str, Any]]:
    local = _local_state(accelerator)
    if not _is_distributed(accelerator):
        return [local]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, local)
    return out


_root_lock = threading.Lock()
"""Retention runs on the training thread (before a save) and an async save's thread."""


def _tidy(root: Path, accelerator: Any) -> None:
    """Before a save (rank 0): remove what dead saves and cut-short deletions left under
    ``root`` (a save still running holds its lock and is left alone), and finish the
    retention a crash may have cut short."""
    with _root_lock:
        recover_all(root)
        for entry in os.scandir(root):
            if (entry.name.startswith(".checkpoint_") and f"{TMP_MARKER}del-" in entry.name
                    and entry.is_dir(follow_symlinks=False)):
                shutil.rmtree(entry.path, ignore_errors=True)
    _rotate(root, accelerator.project_configuration.total_limit, accelerator)


def _rotate(root: Path, total_limit: int | None, accelerator: Any, saved: Path | None = None) -> None:
    """Delete the oldest committed checkpoints beyond ``total_limit`` (rank 0), never
    ``saved``, the checkpoint just committed."""
    if total_limit is None:
        return
    with _root_lock:
        _delete_oldest(root, total_limit, accelerator, saved)


def _newest_index(accelerator: Any) -> int | None:
    found = checkpoint_dirs(accelerator)
    return int(found[-1].name.rsplit("_", 1)[1]) if found else None


def _delete_oldest(root: Path, total_limit: int, accelerator: Any, saved: Path | None = None) -> None:
    keep = max(total_limit, 1)  # Accelerate's total_limit=0 still keeps the newest save
    doomed = [p for p in checkpoint_dirs(accelerator)[:-keep] if saved is None or p.name != saved.name]
    for path in doomed:
        hidden = root / f".{path.name}{TMP_MARKER}del-{uuid.uuid4().hex}"
        try:
            os.rename(path, hidden)  # never seen half deleted as a checkpoint
        except FileNotFoundError:
            continue
        shutil.rmtree(hidden, ignore_errors=True)


def _check_kwargs(call: str, given: Mapping[str, Any], passed_to: Any, taken: frozenset[str]) -> dict[str, Any]:
    """``given`` less Accelerate's own arguments this integration takes as Accelerate means
    them (``taken``); any other that ``passed_to`` does not accept is refused by name (it was
    a ``TypeError`` naming shardpoint's inner function)."""
    accepted = set(inspect.signature(passed_to).parameters) - {"state", "path", "target", "process_group", "strict"}
    unknown = [k for k in given if k not in accepted and k not in taken]
    if unknown:
        accelerate_own = {
            "load_kwargs": "Accelerate's options of torch.load: shardpoint unpickles nothing, it loads in place",
            "save_on_each_node": "Accelerate's: a collective save writes one checkpoint, committed once, to a "
                                 "filesystem every node sees",
        }
        why = [f"{k} is {accelerate_own[k]}" if k in accelerate_own else f"{k} is not an argument of it"
               for k in unknown]
        raise InvalidArgumentTypeError(
            f"{call}: {'; '.join(why)}. It takes {', '.join(sorted(accepted))} (passed to shardpoint."
            f"{passed_to.__name__})"
        )
    return {k: v for k, v in given.items() if k not in taken}


def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    async_save: bool = False,
    **save_kwargs: Any,
) -> SaveInfo | AsyncSave:
    """Save everything ``accelerator.save_state`` saves, as one atomic shardpoint checkpoint.

    Every process calls it. With ``automatic_checkpoint_naming`` the checkpoint goes to
    ``<project_dir>/checkpoints/checkpoint_<iteration>`` (an ``output_dir`` is refused:
    Accelerate silently ignores it), ``iteration`` goes up by one, and once the new
    checkpoint is committed the oldest beyond ``total_limit`` are deleted.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared the objects.
        output_dir: the checkpoint directory, without automatic naming.
        async_save: return once the state is copied (training may go on); the files are
            written and committed in the background. The next save waits for it; call
            ``.result()`` on the returned handle to wait and see its errors.
        **save_kwargs: passed to :func:`shardpoint.save` (``max_shard_size``, ``layout``,
            ``overwrite``, ``allow_pickle``, ``storage_options``, …).

    Returns:
        The :class:`shardpoint.SaveInfo`, or an :class:`shardpoint.AsyncSave` handle.

    Raises:
        CheckpointExistsError: the checkpoint directory exists (and ``overwrite`` is not set).
        CheckpointError: no ``output_dir`` without automatic naming, or one with it; an FSDP / DeepSpeed /
            Megatron / XLA accelerator (their sharded states are not handled here).

    Example:
        >>> save_state(accelerator, "run/step-100")  # doctest: +SKIP
    """
    if save_kwargs.get("safe_serialization", True) is False:
        raise InvalidArgumentError(
            "save_state(safe_serialization=False): shardpoint writes safetensors only; drop the argument "
            "(or use accelerator.save_state for pickled files)"
        )
    save_kwargs = _check_kwargs("save_state", save_kwargs, save, frozenset({"safe_serialization"}))
    _check_no_hooks(accelerator, "save_state")
    config = accelerator.project_configuration
    automatic = bool(config.automatic_checkpoint_naming)
    root = _checkpoints_root(accelerator) if automatic else None
    if root is not None and output_dir is not None:
        raise InvalidArgumentError(
            f"save_state(output_dir={os.fspath(output_dir)!r}): with automatic_checkpoint_naming "
            f"every checkpoint goes to {root}/checkpoint_<iteration>; call save_state without "
            "output_dir, or turn automatic_checkpoint_naming off to choose the directory"
        )
    if root is not None:
        newest = _newest_index(accelerator)
        taken = os.path.lexists(root / f"checkpoint_{config.iteration}")
        if newest is not None and config.iteration <= newest and not taken and not save_kwargs.get("overwrite"):
            warnings.warn(
                f"save_state: checkpoint_{config.iteration} would be older than checkpoint_{newest}, already in "
                f"{root} (a run resumed from a folder it named?), and total_limit would delete it first; saving "
                f"as checkpoint_{newest + 1}",
                UserWarning, stacklevel=2,
            )
            config.iteration = newest + 1
        path: str | os.PathLike[str] = root / f"checkpoint_{config.iteration}"
        if os.path.lexists(path) and not save_kwargs.get("overwrite"):
            raise CheckpointExistsError(
                f"{path}: checkpoint {config.iteration} exists already; set "
                "accelerator.project_configuration.iteration to the next free number (load_state "
                "of this integration does that), or pass overwrite=True to replace it"
            )
    elif output_dir is None:
        raise InvalidArgumentError(
            "save_state needs output_dir when the Accelerator's ProjectConfiguration has no "
            "automatic_checkpoint_naming; pass the checkpoint directory"
        )
    else:
        path = output_dir
    state = _state(accelerator, _PerRank(accelerator, _gathered(accelerator)))
    group = _process_group(accelerator)
    main = accelerator.is_main_process
    if root is not None and main:
        root.mkdir(parents=True, exist_ok=True)
        _tidy(root, accelerator)
    kwargs = {"process_group": group, **save_kwargs}

    def after_commit(info: SaveInfo) -> None:
        if root is not None and main:
            _rotate(root, config.total_limit, accelerator, Path(path))

    result: SaveInfo | AsyncSave
    if async_save:
        result = _api.async_save(state, path, on_commit=after_commit, **kwargs)
    else:
        result = save(state, path, **kwargs)
        after_commit(result)
    if automatic:
        config.iteration += 1
    return result



_ACCELERATE_FILES = re.compile(r"(optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|random_states_\d+\.pkl|"
                               r"custom_checkpoint_\d+\.pkl|scaler\.pt)")
"""Files accelerate's own ``save_state`` writes beside the model's weights."""


def _refuse_accelerates_own(input_dir: Any) -> None:
    """Refuse a folder written by accelerate's own ``save_state``: read as a checkpoint of
    this module's, only its weights matched (the optimizer, schedulers and RNG stayed as
    they were), and strict loads advised ``strict=False``, which loads just the weights."""
    path = os.fspath(input_dir)
    if "://" in path or not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return
    theirs = sorted(n for n in os.listdir(path) if _ACCELERATE_FILES.fullmatch(n))
    if theirs:
        raise UnsupportedFormatError(
            f"{path} was written by accelerate's own save_state ({', '.join(theirs[:3])}), not by shardpoint's: "
            "load it with accelerator.load_state(input_dir), then save with shardpoint from there on"
        )


def load_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    strict: bool = True,
    **load_kwargs: Any,
) -> LoadResult:
    """Restore what :func:`save_state` saved into the accelerator's prepared objects.

    Every process calls it, after ``accelerator.prepare`` of the same models, optimizers,
    schedulers and dataloaders and the same ``register_for_checkpointing`` calls as in the
    saved run. Models and optimizer states are loaded in place (optimizers matched by
    parameter name), then schedulers, scaler, custom objects, ``accelerator.step``, and
    this process's RNG and dataloader states.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        input_dir: the checkpoint directory; without it, the newest committed
            ``checkpoint_<i>`` of automatic naming, and ``iteration`` becomes ``i + 1``
            (given one, with automatic naming, ``iteration`` follows it and every
            checkpoint already there, so the next save is the newest).
        strict: raise :class:`shardpoint.LoadMismatchError` when the checkpoint and the
            accelerator's objects do not match (another model, a missing optimizer).
        **load_kwargs: passed to :func:`shardpoint.load_into` (``verify``,
            ``allow_pickle``, ``storage_options``, …).

    Returns:
        The :class:`shardpoint.LoadResult`.

    Raises:
        CheckpointNotFoundError: no path given and no committed checkpoint under
            ``<project_dir>/checkpoints``, or nothing at ``input_dir``.
        LoadMismatchError: ``strict`` and the objects differ from the saved ones.

    Example:
        >>> load_state(accelerator)  # doctest: +SKIP
    """
    if load_kwargs.get("map_location", "cpu") not in ("cpu", "on_device"):
        raise InvalidArgumentError(
            f"load_state(map_location={load_kwargs['map_location']!r}): shardpoint loads in place into the prepared "
            "objects, on their devices (Accelerate's 'cpu' and 'on_device' both mean that here); drop the argument"
        )
    load_kwargs = _check_kwargs("load_state", load_kwargs, load_into, frozenset({"map_location"}))
    _check_no_hooks(accelerator, "load_state")
    config = accelerator.project_configuration
    resumed_from: int | None = None
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise InvalidArgumentError(
                "load_state needs input_dir when the Accelerator's ProjectConfiguration has no "
                "automatic_checkpoint_naming; pass the checkpoint directory"
            )
        resumed_from = _newest_index(accelerator)
        if resumed_from is None:
            raise CheckpointNotFoundError(
                f"{_checkpoints_root(accelerator)}: no committed shardpoint checkpoint_<i> here "
                "to resume from; start the run from scratch or pass input_dir"
            )
        input_dir = _checkpoints_root(accelerator) / f"checkpoint_{resumed_from}"
    elif config.automatic_checkpoint_naming:
        named = re.fullmatch(r"checkpoint_(\d+)", Path(input_dir).name)
        newest = _newest_index(accelerator)
        # Resumed from a folder named by hand: the next save follows every checkpoint there
        # (iteration 0 would be saved, then deleted first by total_limit).
        candidates = [i for i in (int(named.group(1)) if named else None, newest) if i is not None]
        resumed_from = max(candidates) if candidates else None
    _refuse_accelerates_own(input_dir)
    target = _state(accelerator, _PerRank(accelerator))
    result = load_into(target, input_dir, strict=strict, process_group=_process_group(accelerator), **load_kwargs)
    if resumed_from is not None:
        config.iteration = max(config.iteration, resumed_from + 1)
    return result
