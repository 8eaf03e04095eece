"""Every Hugging Face ``Trainer`` checkpoint a shardpoint save.

>>> from shardpoint.integrations.hf_trainer import ShardpointTrainer
>>> trainer = ShardpointTrainer(model=model, args=args, train_dataset=data)  # doctest: +SKIP
>>> trainer.train()  # doctest: +SKIP
>>> trainer.train(resume_from_checkpoint=True)  # doctest: +SKIP

``ShardpointTrainer`` is ``transformers.Trainer`` with :class:`ShardpointTrainerMixin`
first in its bases; put the mixin first in your own ``Trainer`` subclass the same way
(``class MyTrainer(ShardpointTrainerMixin, Seq2SeqTrainer)``). Each ``checkpoint-<step>``
folder is then one atomic shardpoint commit holding

- ``model-*.safetensors`` (+ index) that ``from_pretrained`` reads, ``config.json`` and
  ``generation_config.json``;
- the components ``optim`` (by parameter name), ``sched``, ``scaler`` (when mixed
  precision uses one) and ``rng`` (Python, NumPy, torch CPU and CUDA generators), left
  out with ``save_only_model=True`` as the ``Trainer`` leaves them out;
- ``trainer_state.json``, ``training_args.json`` (the arguments as JSON: no pickle, so no
  ``training_args.bin``) and the files of ``processing_class.save_pretrained``.

The folder appears under its ``checkpoint-<step>`` name only when every file is on disk,
so ``resume_from_checkpoint=True`` (``get_last_checkpoint``) never picks a half-written
one, and ``shardpoint verify`` checks every byte of it. With ``shardpoint_async=True`` the
tensors are copied to a host buffer and written on a background thread while training
goes on; the ``Trainer``'s rotation (``save_total_limit``) runs only once the new
checkpoint is committed, and training ends (and ``load_best_model_at_end`` loads) only
once the last one is. Resuming reads shardpoint checkpoints and folders written by the
plain ``Trainer`` alike.

Tested with ``transformers`` 5.x (5.24.0), on one process; distributed (DDP, FSDP,
DeepSpeed) ``Trainer`` runs are not handled here and are refused.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from typing import Any

import transformers
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .._async import AsyncQueue, AsyncSave
from .._format.manifest import MANIFEST_NAME
from .._load.into import load_into
from .._prepare import PreparedState, prepare_state
from .._sizes import parse_size
from .._source import holds_checkpoint
from .._stateful import RNGState
from .._write import SaveInfo, write_checkpoint
from ..errors import (
    CheckpointError,
    InvalidArgumentError,
    LoadMismatchError,
    PreviousSaveFailedError,
)
from .transformers import _config_files, _default_shard_size

__all__ = ["TESTED_TRANSFORMERS", "ShardpointTrainer", "ShardpointTrainerMixin", "is_shardpoint_checkpoint"]

TESTED_TRANSFORMERS = "5.24.0"
"""The ``transformers`` version this integration is tested on (a test pins it)."""
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_JSON = "training_args.json"


def _whole_checkpoint(path: str) -> bool:
    """A ``checkpoint-<step>`` folder to resume from: a committed shardpoint checkpoint, or
    the plain ``Trainer``'s (weights a loader reads, and ``trainer_state.json``)."""
    if is_shardpoint_checkpoint(path):
        return True
    return os.path.isfile(os.path.join(path, "trainer_state.json")) and holds_checkpoint(path)


def is_shardpoint_checkpoint(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a local directory committed by shardpoint."""
    return path is not None and os.path.isfile(os.path.join(os.fspath(path), MANIFEST_NAME))


class ShardpointTrainerMixin:
    """Mix into a ``transformers.Trainer`` (first base) to save every checkpoint with shardpoint.

    Keyword arguments taken by ``__init__`` besides the ``Trainer``'s own:

    Args:
        shardpoint_async: write checkpoints on a background thread (default False).
        shardpoint_max_shard_size: largest weight file (default: the model's own
            ``save_pretrained`` default).

    Example:
        >>> from transformers import Seq2SeqTrainer
        >>> class MyTrainer(ShardpointTrainerMixin, Seq2SeqTrainer):
        ...     pass
    """

    args: Any
    state: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    processing_class: Any
    control: Any
    callback_handler: Any
    hp_search_backend: Any
    _get_output_dir: Any
    store_flos: Any

    def __init__(
        self, *args: Any, shardpoint_async: bool = False, shardpoint_max_shard_size: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "push_to_hub", False):
            raise InvalidArgumentError(
                "ShardpointTrainer does not push checkpoints to the Hub during training "
                "(push_to_hub=True in TrainingArguments); train with push_to_hub=False and call "
                "trainer.push_to_hub() afterwards, or use the plain transformers Trainer"
            )
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1:
            raise InvalidArgumentError(
                f"ShardpointTrainer saves from one process; this run has world_size={self.args.world_size}. "
                "Use the plain transformers Trainer for distributed (DDP, FSDP, DeepSpeed) runs"
            )
        self.shardpoint_async = bool(shardpoint_async)
        self.shardpoint_max_shard_size = shardpoint_max_shard_size
        self._shardpoint_pending: AsyncSave | None = None
        self._shardpoint_queue = AsyncQueue()  # this trainer's own: never waits on other saves

    # ---- saving ----

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        output_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        if self.state.best_global_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            # this save may be the best one itself: it exists once committed
            if os.path.exists(best_dir) or self.state.best_global_step == self.state.global_step:
                self.state.best_model_checkpoint = best_dir
        self._wait_for_checkpoint()  # the previous one is committed before this one starts
        started = time.perf_counter()
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        state: dict[str, Any] = {"model": unwrapped}
        if not self.args.save_only_model:
            state["optim"] = self.optimizer
            state["sched"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = RNGState()
        prepared = prepare_state(state)
        extras = self._extra_files(unwrapped)
        max_bytes = parse_size(
            _default_shard_size(unwrapped) if self.shardpoint_max_shard_size is None else self.shardpoint_max_shard_size
        )
        best = self.state.best_model_checkpoint
        limit = self.args.save_total_limit

        def persist(staged: PreparedState) -> SaveInfo:
            info = write_checkpoint(
                staged, output_dir, max_shard_bytes=max_bytes, overwrite=True, metadata={}, durable=True,
                progress=False, extra_files=extras,
            )
            # only now that the new checkpoint is committed may older ones go
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)
            return info

        if self.shardpoint_async:
            self._shardpoint_pending = self._shardpoint_queue.submit(prepared, output_dir, persist, started=started)
            if self.state.global_step >= self.state.max_steps or self.control.should_training_stop:
                self._wait_for_checkpoint()  # the last checkpoint of the run
        else:
            persist(prepared)

    def _extra_files(self, model: Any) -> dict[str, bytes]:
        """Everything besides tensors that goes in the same commit."""
        files: dict[str, bytes] = {}
        if getattr(model, "config", None) is not None and hasattr(model.config, "to_json_string"):
            files.update(_config_files(model))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            with tempfile.TemporaryDirectory(prefix="shardpoint-processor-") as tmp:
                self.processing_class.save_pretrained(tmp)
                for name in sorted(os.listdir(tmp)):
                    full = os.path.join(tmp, name)
                    if os.path.isfile(full):
                        with open(full, "rb") as fh:
                            files[name] = fh.read()
        # stateful callbacks, as the Trainer records them before writing its state
        from transformers.trainer_callback import ExportableState

        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        with tempfile.TemporaryDirectory(prefix="shardpoint-state-") as tmp:
            self.state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
            with open(os.path.join(tmp, TRAINER_STATE_NAME), "rb") as fh:
                files[TRAINER_STATE_NAME] = fh.read()
        files[TRAINING_ARGS_JSON] = (self.args.to_json_string() + "\n").encode("utf-8")
        return files

    def _wait_for_checkpoint(self) -> None:
        """Block until the pending async checkpoint is committed; raise its error."""
        pending, self._shardpoint_pending = self._shardpoint_pending, None
        if pending is not None:
            try:
                pending.result()
            except CheckpointError:
                raise
            except Exception as exc:
                raise PreviousSaveFailedError(
                    f"the async Trainer checkpoint {pending.path} failed and was not committed: {exc}"
                ) from exc

    def train(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("resume_from_checkpoint") is True:
            kwargs["resume_from_checkpoint"] = self._newest_whole_checkpoint()
        elif args and args[0] is True:
            args = (self._newest_whole_checkpoint(), *args[1:])
        try:
            output = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            # training failed: still let a pending checkpoint commit, but raise the training error
            pending, self._shardpoint_pending = self._shardpoint_pending, None
            if pending is not None:
                pending.wait()  # its own failure, if any, is reported at exit
            raise
        self._wait_for_checkpoint()
        return output

    # ---- loading ----

    def _newest_whole_checkpoint(self) -> Any:
        """For ``resume_from_checkpoint=True``: the newest ``checkpoint-<step>`` of
        ``output_dir`` that holds a whole checkpoint (a shardpoint manifest, or the plain
        ``Trainer``'s weights and ``trainer_state.json``), skipping newer folders a save
        that did not finish left behind, with a warning naming them; ``True`` (the
        ``Trainer``'s own choice and error) when there is none."""
        root = self.args.output_dir
        try:
            names = os.listdir(root)
        except OSError:
            return True
        steps = sorted(
            (int(n[len(PREFIX_CHECKPOINT_DIR) + 1:]), n) for n in names
            if n.startswith(PREFIX_CHECKPOINT_DIR + "-") and n[len(PREFIX_CHECKPOINT_DIR) + 1:].isdigit()
            and os.path.isdir(os.path.join(root, n))
        )
        skipped: list[str] = []
        for _, name in reversed(steps):
            path = os.path.join(root, name)
            if _whole_checkpoint(path):
                if skipped:
                    warnings.warn(
                        f"resume_from_checkpoint=True: skipping {', '.join(skipped)} (no whole "
                        f"checkpoint: a save that did not finish?); resuming from {path}",
                        UserWarning, stacklevel=3,
                    )
                return path
            skipped.append(path)
        return True

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not is_shardpoint_checkpoint(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        _load_components({"model": self.model if model is None else model}, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not is_shardpoint_checkpoint(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        assert checkpoint is not None
        target: dict[str, Any] = {"model": self.accelerator.unwrap_model(self.model, keep_torch_compile=False)}
        components = _components(checkpoint)
        if "optim" in components:
            target["optim"] = self.optimizer
        if "sched" in components:
            target["sched"] = self.lr_scheduler
        if len(target) > 1:
            _load_components(target, checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not is_shardpoint_checkpoint(checkpoint):
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        assert checkpoint is not None
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in _components(checkpoint):
            _load_components({"scaler": scaler}, checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not is_shardpoint_checkpoint(checkpoint):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        assert checkpoint is not None
        if "rng" in _components(checkpoint):
            _load_components({"rng": RNGState()}, checkpoint)

    def _load_best_model(self) -> None:
        self._wait_for_checkpoint()
        best = self.state.best_model_checkpoint
        if not is_shardpoint_checkpoint(best):
            super()._load_best_model()  # type: ignore[misc]
            return
        _load_components({"model": self.model}, best)


def _load_components(target: dict[str, Any], path: str) -> None:
    """Load the named components of the checkpoint at ``path`` into ``target``; the
    checkpoint's other components are left alone, anything else amiss raises."""
    others = _components(path) - set(target)
    result = load_into(target, path, strict=False)
    unexpected = [k for k in result.unexpected_keys if k not in others]
    if result.missing_keys or unexpected or result.mismatched_keys or result.meta_keys:
        raise LoadMismatchError(
            f"resuming the Trainer from {path}: the checkpoint does not match this run's "
            f"{', '.join(sorted(target))} (missing {result.missing_keys[:10]}, unexpected {unexpected[:10]}, "
            f"mismatched {[k for k, *_ in result.mismatched_keys[:10]]}); resume with the model and "
            "optimizer the checkpoint was saved from",
            result,
        )


def _components(path: str) -> set[str]:
    """Names of the components a shardpoint checkpoint holds (from its manifest)."""
    with open(os.path.join(path, MANIFEST_NAME), "rb") as fh:
        return set(json.load(fh).get("components", {}))


class ShardpointTrainer(ShardpointTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are shardpoint saves (see the module doc)."""


if transformers.__version__.split(".")[0] != TESTED_TRANSFORMERS.split(".")[0]:  # pragma: no cover
    import warnings

    warnings.warn(
        f"shardpoint's Trainer integration is tested on transformers {TESTED_TRANSFORMERS}; "
        f"transformers {transformers.__version__} is installed",
        stacklevel=2,
    )
