"""Part 3 of ``shardpoint demo``: save from 2 FSDP2 ranks, resume on 1 and on 3 ranks.

Each rank is a process of its own (gloo on the CPU, as ``torchrun`` would start them). The
2-rank run trains, checkpoints step ``SAVE_AT`` with a :class:`CheckpointManager` (every rank
writes only its own shards, layout ``chunked``) and trains on. Then the same checkpoint is
restored by 1 rank and by 3 ranks: the gathered parameters and optimizer state must equal
what the 2 ranks saved, bit for bit, and training must continue on the same loss curve. The
global batch is split evenly over the ranks, so every world size computes the same step
(up to the order of floating-point reductions).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

VOCAB, DIM, SEQ, GLOBAL_BATCH = 96, 48, 16, 12
SAVE_AT, STEPS = 4, 8
TIMEOUT_S = 120


def _model() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.up = nn.Linear(DIM, 4 * DIM)
            self.down = nn.Linear(4 * DIM, DIM)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return TinyLM()


def _batch(step: int, rank: int, world: int) -> tuple[Any, Any]:
    """This rank's slice of the step's global batch (t -> 5t + 3 mod V)."""
    import torch

    gen = torch.Generator().manual_seed(7919 * step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    per = GLOBAL_BATCH // world
    mine = tokens[rank * per : (rank + 1) * per]
    return mine, (5 * mine + 3) % VOCAB


def _fingerprint(model: Any, optim_state: Any) -> str:
    """crc32c of every gathered parameter and optimizer tensor, in name order (collective)."""
    from torch.distributed.tensor import DTensor

    from .._checksum import crc32c
    from .._io.memory import byte_view, contiguous_cpu

    def full(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    crc = 0
    for name, p in sorted(model.state_dict().items()):
        crc = crc32c(name.encode(), crc)
        crc = crc32c(byte_view(contiguous_cpu(full(p))), crc)
    for pname, slots in sorted(optim_state["state"].items()):
        for slot, value in sorted(slots.items()):
            crc = crc32c(f"{pname}/{slot}".encode(), crc)
            crc = crc32c(byte_view(contiguous_cpu(full(value))), crc)
    return f"{crc:08x}"


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardpoint as sp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    rank, world = args.rank, args.world
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    manager = sp.CheckpointManager(args.root)

    def report(**fields: Any) -> None:
        if rank == 0:
            print(json.dumps(fields), flush=True)

    start = 1
    if args.resume:
        target = {"model": model, "optim": get_optimizer_state_dict(model, optim), "step": 0}
        restored = manager.restore(target)
        set_optimizer_state_dict(model, optim, target["optim"])
        start = int(target["step"]) + 1
        report(restored=restored, fingerprint=_fingerprint(model, get_optimizer_state_dict(model, optim)))
    for step in range(start, STEPS + 1):
        tokens, labels = _batch(step, rank, world)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()  # FSDP2 averages the gradients over the ranks: the global batch's mean
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        report(step=step, loss=total.item() / world)
        if step == SAVE_AT and not args.resume:
            state = {"model": model, "optim": get_optimizer_state_dict(model, optim), "step": step}
            started = time.perf_counter()
            manager.save(step, state)
            report(saved=step, seconds=time.perf_counter() - started,
                   fingerprint=_fingerprint(model, state["optim"]))
    dist.barrier()
    # Reference cycles still holding gloo work and DTensors, left to the interpreter's
    # finalization, abort a rank now and then ("terminate called without an active
    # exception", SIGABRT) once its work is done: collect them first.
    del model, optim, manager
    gc.collect()
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(root: str, world: int, *, resume: bool) -> list[dict[str, Any]]:
    """Start ``world`` rank processes; return rank 0's reports (raises if any rank fails)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(world):
        cmd = [sys.executable, "-m", "shardpoint._cli.demo_ranks", "--root", root, "--rank", str(rank),
               "--world", str(world), "--port", str(port)] + (["--resume"] if resume else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(r, rc, err) for r, (rc, _, err) in enumerate(outputs) if rc != 0]
    if failed:
        rank, rc, err = failed[0]
        raise RuntimeError(f"rank {rank} of {world} exited with {rc}:\n{err[-3000:]}")
    return [json.loads(line) for line in outputs[0][1].splitlines() if line.startswith("{")]


def part_three(workdir: str) -> bool:
    """The multi-rank part of the demo; True when every check held."""
    import torch

    import shardpoint as sp

    from .main import main as cli

    print("\n== 3. save on 2 ranks (FSDP2), resume on 1 and on 3 ranks ==")
    if not hasattr(torch.cpu.Stream, "record_event"):  # FSDP2 on CPU calls it (torch >= 2.7)
        print(f"skipped: FSDP2 training on CPU needs torch 2.7 or newer (this is {torch.__version__}); "
              "shardpoint's own sharded saves and loads work from 2.6")
        return True
    root = os.path.join(workdir, "fsdp")
    started = time.perf_counter()
    trained = run_world(root, 2, resume=False)
    losses = {r["step"]: r["loss"] for r in trained if "step" in r}
    saved = next(r for r in trained if "saved" in r)
    print(f"2 ranks trained {STEPS} steps ({time.perf_counter() - started:.1f} s with start-up); "
          f"step {SAVE_AT} saved in {saved['seconds'] * 1000:.0f} ms, each rank writing its own shards")
    step_dir = str(sp.CheckpointManager(root).step_path(SAVE_AT))
    cli(["inspect", step_dir, "--limit", "4"])
    ok = True
    for world in (1, 3):
        started = time.perf_counter()
        resumed = run_world(root, world, resume=True)
        head = resumed[0]
        same_state = head["restored"] == SAVE_AT and head["fingerprint"] == saved["fingerprint"]
        after = {r["step"]: r["loss"] for r in resumed if "step" in r}
        worst = max(abs(after[s] - losses[s]) / abs(losses[s]) for s in after)
        curve_ok = sorted(after) == list(range(SAVE_AT + 1, STEPS + 1)) and worst < 1e-4
        print(f"{world} rank{'s' if world > 1 else ''}: restored step {head['restored']} "
              f"({time.perf_counter() - started:.1f} s with start-up); parameters and optimizer state "
              f"equal the 2-rank save bit for bit: {same_state}; losses of steps {SAVE_AT + 1}-{STEPS} "
              f"match the 2-rank run (worst relative difference {worst:.1e}): {curve_ok}")
        ok = ok and same_state and curve_ok
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    return rank_main(parser.parse_args())


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the work is reported: no finalization of torch's threads left to abort it
