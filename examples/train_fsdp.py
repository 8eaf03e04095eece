"""Train a small model with FSDP2 on CPU (gloo; FSDP2 on CPU needs torch 2.7+), checkpointing with shardpoint; re-run to resume.

    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 6     # saves steps 2, 4, 6
    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 12    # resumes from step 6

``fully_shard`` leaves each rank 1/N of every parameter and of the optimizer state (DTensor
``Shard(0)``). Every rank calls ``CheckpointManager.save``: each writes only its own shards
(layout ``chunked``, one set of files per rank) and rank 0 commits the step once all of
them succeeded. On start the newest committed step is loaded in place, resharding if the
world size changed (``--nproc-per-node 4`` resumes a 2-rank run). Batches are drawn from a
per-(step, rank) seed, so a resumed run prints the same losses as an uninterrupted one.

The manager is given the process group, so every rank restores the same step (the newest
one every rank sees) or every rank raises the same error; it runs on CPU with gloo, and
``main(argv)`` can be called on ranks whose gloo group is already up (the tests do).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardpoint as sp

VOCAB, DIM, SEQ, BATCH = 96, 48, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy next-token task (t -> 5t + 3 mod V); data parallel: each rank its own batch."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, (5 * tokens + 3) % VOCAB


def main(argv: list[str] | None = None) -> int:
    """Train until ``--steps``; return the step the run resumed from (0: from scratch)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12, help="train until this step")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--async-save", action="store_true", help="save in the background")
    parser.add_argument(
        "--root", default=os.path.join(tempfile.gettempdir(), "shardpoint-examples", "train_fsdp")
    )
    args = parser.parse_args(argv)

    launched = not dist.is_initialized()  # under torchrun; else the caller's group is used
    if launched:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(
        0
    )  # the same initial weights on every rank; fully_shard keeps each rank's part
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    # Every rank saves and restores together over the group: rank 0 manages the root, and
    # restore() loads the same step on every rank (or raises the same error on every rank).
    manager = sp.CheckpointManager(
        args.root, keep_last=args.keep_last, async_save=args.async_save, process_group=dist.group.WORLD
    )

    def state(step: int) -> dict[str, object]:
        # The module gives its DTensor state dict. The optimizer goes in as DCP's
        # `get_optimizer_state_dict` (DTensors keyed by parameter name), which loads in place.
        return {
            "model": model,
            "optim": get_optimizer_state_dict(model, optimizer),
            "progress": {"step": step, "world_size": world},
        }

    # restore() is collective: every rank calls it, whatever its own listing of the root
    # shows, and all get the same answer (None on every rank when nothing is committed).
    target = state(0)
    restored = manager.restore(target)
    start = restored or 0
    if restored is not None:
        set_optimizer_state_dict(model, optimizer, target["optim"])  # type: ignore[arg-type]
        saved_world = target["progress"]["world_size"]  # type: ignore[index]
        if rank == 0:
            print(
                f"resumed from step {start} of {args.root} (saved by {saved_world} ranks, now {world})",
                flush=True,
            )
    elif rank == 0:
        print(f"no checkpoint in {args.root}: training from scratch", flush=True)

    for step in range(start, args.steps):
        tokens, labels = batch(step, rank)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {mean.item() / world:.6f}", flush=True)
        if (step + 1) % args.save_every == 0:
            manager.save(step + 1, state(step + 1))
    manager.wait()
    dist.barrier()
    if rank == 0:
        print(f"committed steps in {args.root}: {manager.steps()}", flush=True)
    if launched:
        gc.collect()  # drop reference cycles holding gloo work first (else a rare SIGABRT at exit)
        dist.destroy_process_group()
    return start


if __name__ == "__main__":
    main()
