"""Integrations with the frameworks people already train and serve with.

- :mod:`shardpoint.integrations.accelerate`: ``save_state`` / ``load_state`` of an
  ``accelerate.Accelerator``'s prepared objects (takes the ``Accelerator``; imports nothing
  of ``accelerate`` itself).
- :mod:`shardpoint.integrations.dcp`: ``ShardpointStorageWriter`` / ``ShardpointStorageReader``
  for ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.async_save`` / ``dcp.load``
  writing and reading shardpoint checkpoints, DCP's planner resharding).
- :mod:`shardpoint.integrations.lightning`: ``ShardpointCheckpointIO``, a ``CheckpointIO``
  plugin for Lightning's ``Trainer`` (needs ``lightning`` or ``pytorch_lightning``), and
  ``ShardpointFSDPStrategy`` / ``ShardpointModelParallelStrategy``, Lightning's sharded
  strategies saving each rank's shards through shardpoint (need ``lightning``).
- :mod:`shardpoint.integrations.hf_trainer`: ``ShardpointTrainer`` /
  ``ShardpointTrainerMixin``, every ``transformers`` ``Trainer`` checkpoint a shardpoint
  save (needs ``transformers``).
- :mod:`shardpoint.integrations.transformers`: ``save_pretrained`` / ``from_pretrained``
  for ``transformers`` models (needs ``transformers``).

Each submodule is imported on first use, so ``import shardpoint`` imports neither framework:

>>> import shardpoint as sp
>>> sp.integrations.transformers.save_pretrained  # doctest: +ELLIPSIS
<function save_pretrained at 0x...>
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["accelerate", "dcp", "hf_trainer", "lightning", "transformers"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
