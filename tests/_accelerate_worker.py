"""A small Accelerate training run that checkpoints through shardpoint (for test_accelerate).

``train`` runs in a fresh process (a subprocess, or a gloo rank of ``run_ranks``): it builds
the same model, data and optimizer from fixed seeds, resumes from the newest shardpoint
checkpoint under ``run_dir`` if there is one, trains to ``total_steps`` saving every
``save_every`` steps, and writes the final weights and optimizer state to ``out`` (rank 0).
``die_at`` SIGKILLs the process(es) right after that step's save call returns (an async save
may still be writing).
"""

from __future__ import annotations

import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch


class Progress:
    """A ``register_for_checkpointing`` object: the global step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def train(run_dir: str, total_steps: int, save_every: int, die_at: int | None = None,
          async_save: bool = False, out: str | None = None, total_limit: int = 2) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration

    from shardpoint.integrations.accelerate import checkpoint_dirs, load_state, save_state

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=run_dir, automatic_checkpoint_naming=True,
                                            total_limit=total_limit),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    # The loader's own generator: PyTorch draws a number from the loader's generator (the
    # global one without it) whenever an iterator starts, which a run resumed mid-epoch does
    # where the uninterrupted run did not.
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                     generator=torch.Generator().manual_seed(1))
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    if checkpoint_dirs(accelerator):
        load_state(accelerator)
    step = progress.step
    pending = None
    while step < total_steps:
        epoch, skip = divmod(step, len(dl))  # resumed mid-epoch: skip the batches trained on
        dl.set_epoch(epoch)
        for i, (x, y) in enumerate(dl):
            if i < skip:
                continue
            # Noise from the global generator: the RNG states must be restored exactly.
            loss = torch.nn.functional.mse_loss(model(x) + 0.01 * torch.randn_like(y), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            progress.step = step
            if step % save_every == 0:
                pending = save_state(accelerator, async_save=async_save)
            if step == die_at:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= total_steps:
                break
    if async_save and pending is not None:
        pending.result()  # the last save committed (and old ones rotated) before the end
    accelerator.wait_for_everyone()
    if out is not None and accelerator.is_main_process:
        inner = getattr(opt, "optimizer", opt)
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optim": inner.state_dict(),
                    "sched": sched.state_dict(), "step": step}, out)


def train_rank(rank: int, world_size: int, port: int, *args: Any) -> None:
    """``run_ranks`` entry: Accelerate reads the torchrun environment."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    train(*args)


if __name__ == "__main__":
    run_dir, total, every, die, asy, out = sys.argv[1:7]
    train(run_dir, int(total), int(every), int(die) if die != "-" else None, asy == "1",
          out if out != "-" else None)
