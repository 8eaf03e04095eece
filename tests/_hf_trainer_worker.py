"""A small GPT-2 trained by the transformers Trainer, for tests/test_hf_trainer.py.

Run as a script (``python _hf_trainer_worker.py OUT MAX_STEPS KILL_AT ASYNC``) it trains
through ``ShardpointTrainer`` and SIGKILLs itself at step ``KILL_AT`` (see ``KillAt``).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from shardpoint.integrations.hf_trainer import ShardpointTrainer

VOCAB = 64


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def dataset(n: int = 24) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, VOCAB, (8,), generator=gen)), "labels": ids} for _ in range(n)]


def training_args(out: str, max_steps: int, **kwargs: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        max_steps=max_steps, save_steps=2, per_device_train_batch_size=2, report_to=[], logging_steps=1000,
        use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2, warmup_steps=2,
    )
    base.update(kwargs)
    return TrainingArguments(out, **base)


def trainer(out: str, max_steps: int, *, plain: bool = False, stop_at: int | None = None, **kwargs: Any) -> Trainer:
    sp_kwargs = {"shardpoint_async": kwargs.pop("shardpoint_async")} if "shardpoint_async" in kwargs else {}
    eval_data = kwargs.pop("eval_dataset", None)
    cls = Trainer if plain else ShardpointTrainer
    t = cls(model=tiny_gpt2(), args=training_args(out, max_steps, **kwargs), train_dataset=dataset(),
            eval_dataset=eval_data, **sp_kwargs)
    if stop_at is not None:
        t.add_callback(StopAt(stop_at))
    return t


class StopAt(TrainerCallback):
    """End training (as an interruption would) at step ``step``; the run's schedule stays
    that of its ``max_steps``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


class KillAt(TrainerCallback):
    """SIGKILL this process at the end of step ``step``: right after its checkpoint was
    handed over when it is a save step, else between two saves."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and self.step % args.save_steps:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    out, max_steps, kill_at, use_async = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    t = trainer(out, max_steps, shardpoint_async=use_async)
    t.add_callback(KillAt(kill_at))
    t.train()
    sys.exit(3)  # never reached: the callback kills the process
