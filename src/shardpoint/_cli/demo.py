"""Show what shardpoint does, end to end, in about a minute on a laptop CPU.

1. Checkpoint a generated transformer-shaped state dict: save (sharded, atomic,
   checksummed), inspect, verify, and load it back into preallocated tensors, with timings.
2. Train a small GPT-style model with a CheckpointManager (async saves, keep_last=2) in a
   child process, SIGKILL it mid-run, resume from the newest committed step, and check
   that the resumed loss curve is bit-identical to an uninterrupted run.
3. Train with FSDP2 on 2 ranks (gloo), checkpoint, and resume from that checkpoint on 1 and
   on 3 ranks: the state is restored bit for bit and the loss curve carries on.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import output

_OUTPUTS = ("generated", "run", "sync-save", "fsdp")
"""What the demo writes in its folder."""

HELP = "run the end-to-end demo (save/inspect/verify/load; train, kill, resume; 2 ranks -> 1 and 3)"

SAVE_EVERY = 4
MIN_STEPS = 4 * SAVE_EVERY
"""The run is killed in its middle third: after at least one committed step."""


def _steps(text: str) -> int:
    """``--steps``: an int of at least :data:`MIN_STEPS`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < MIN_STEPS:
        raise argparse.ArgumentTypeError(
            f"{value} is fewer than {MIN_STEPS}: the demo saves every {SAVE_EVERY} steps and kills the run in its "
            "middle third, after a committed step"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", help="where to write (default: a temporary directory, removed after)")
    parser.add_argument("--size-mb", type=int, default=256, help="size of the generated state dict (MB)")
    parser.add_argument("--steps", type=_steps, default=40,
                        help=f"training steps (at least {MIN_STEPS}; default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the kill moment")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- model


def _build_model(seed: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: Any, mask: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self, vocab: int = 128, dim: int = 96, layers: int = 2, ctx: int = 32) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(ctx, dim)
            self.blocks = nn.ModuleList(Block(dim, 4) for _ in range(layers))
            self.ln = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.tok.weight  # tied, as in GPT-2

        def forward(self, idx: Any) -> Any:
            n = idx.shape[1]
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
            x = self.tok(idx) + self.pos(torch.arange(n))
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln(x))

    torch.manual_seed(seed)
    return TinyGPT()


def _batch(step: int) -> tuple[Any, Any]:
    """Generated data: noisy arithmetic sequences, a function of the step alone."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 128, (16, 1), generator=g)
    stride = torch.randint(1, 5, (16, 1), generator=g)
    seq = (start + stride * torch.arange(33)) % 128
    return seq[:, :-1], seq[:, 1:]


def _train_state(model: Any) -> dict[str, Any]:
    import torch

    import shardpoint as sp

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    return {"model": model, "optim": opt, "sched": sched, "rng": sp.RNGState(), "step": 0}


def _step(state: dict[str, Any], step: int) -> float:
    import torch

    model, opt, sched = state["model"], state["optim"], state["sched"]
    x, y = _batch(step)
    logits = model(x)
    # A little dropout-like noise from the RNG, so restoring RNG state matters.
    noise = 1e-3 * torch.randn(())
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) + noise
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _child(root: str, steps: int) -> int:
    """Train with a CheckpointManager, resuming from the newest committed step."""
    import torch

    import shardpoint as sp

    torch.set_num_threads(1)
    state = _train_state(_build_model(seed=0))
    random.seed(0)
    torch.manual_seed(0)
    mgr = sp.CheckpointManager(root, keep_last=2, async_save=True, max_shard_size="200kB")
    restored = mgr.restore(state)
    first = 1 if restored is None else state["step"] + 1
    print(f"resumed {restored}", flush=True)
    for step in range(first, steps + 1):
        loss = _step(state, step)
        state["step"] = step
        print(f"loss {step} {loss.hex()}", flush=True)
        if step % SAVE_EVERY == 0:
            handle = mgr.save(step, state)
            print(f"stall {step} {handle.stall_seconds:.6f}", flush=True)  # type: ignore[union-attr]
    mgr.wait()
    print("done", flush=True)
    return 0


def _reference(steps: int) -> list[float]:
    import torch

    torch.set_num_threads(1)
    state = _train_state(_build_model(seed=0))
    random.seed(0)
    torch.manual_seed(0)
    return [_step(state, s) for s in range(1, steps + 1)]


def _spawn(root: str, steps: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "shardpoint._cli.main", "demo", "--child", "--dir", root, "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


# ------------------------------------------------------------------------------ parts


def _generated_state(size_mb: int) -> dict[str, Any]:
    import torch

    dim = 1024
    per_layer = 12 * dim * dim * 4
    layers = max(1, (size_mb * 10**6 - 2 * 8192 * dim * 4) // per_layer)
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {"model.embed_tokens.weight": torch.randn(8192, dim, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = torch.randn(dim, dim, generator=g)
        for name, shape in (("gate_proj", (4 * dim, dim)), ("up_proj", (4 * dim, dim)), ("down_proj", (dim, 4 * dim))):
            sd[p + f"mlp.{name}.weight"] = torch.randn(*shape, generator=g)
        sd[p + "input_layernorm.weight"] = torch.ones(dim)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(dim)
    sd["model.norm.weight"] = torch.ones(dim)
    sd["lm_head.weight"] = torch.randn(8192, dim, generator=g)
    return sd


def _part_one(workdir: str, size_mb: int) -> bool:
    import torch

    import shardpoint as sp

    from .._sizes import human_size
    from .main import main as cli

    print("== 1. save, inspect, verify, load ==")
    sd = _generated_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    path = os.path.join(workdir, "generated")
    t0 = time.perf_counter()
    info = sp.save(sd, path, max_shard_size="64MB", progress=False)
    save_s = time.perf_counter() - t0
    print(f"saved {len(sd)} tensors, {human_size(nbytes)} in {len(info.files)} files "
          f"in {save_s:.2f} s ({human_size(nbytes / save_s)}/s, durable, crc32c on)")
    print()
    cli(["inspect", path, "--limit", "5"])
    print()
    t0 = time.perf_counter()
    rc = cli(["verify", path])
    print(f"(verify took {time.perf_counter() - t0:.2f} s)")
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    t0 = time.perf_counter()
    result = sp.load_into(target, path, progress=False)
    load_s = time.perf_counter() - t0
    same = result.ok and all(torch.equal(target[k], v) for k, v in sd.items())
    print(f"load_into preallocated tensors: {load_s:.2f} s ({human_size(nbytes / load_s)}/s, "
          f"crc32c verified); bit-exact: {same}")
    return rc == 0 and same


def _part_two(workdir: str, steps: int, seed: int) -> bool:
    import shardpoint as sp

    from .main import main as cli

    print("\n== 2. train, SIGKILL, resume ==")
    root = os.path.join(workdir, "run")
    reference = _reference(steps)
    kill_at = random.Random(seed).randint(steps // 3, 2 * steps // 3)
    losses: dict[int, float] = {}
    stalls = []
    child = _spawn(root, steps)
    assert child.stdout is not None
    for line in child.stdout:
        kind, *rest = line.split()
        if kind == "loss":
            losses[int(rest[0])] = float.fromhex(rest[1])
            if int(rest[0]) == kill_at:
                os.kill(child.pid, signal.SIGKILL)
                break
        elif kind == "stall":
            stalls.append(float(rest[1]))
    child.wait()
    mgr = sp.CheckpointManager(root)
    print(f"training process killed with SIGKILL at step {kill_at}; committed steps on disk: {mgr.steps()}")
    restored = mgr.latest_step()
    resumed: dict[int, float] = {}
    child = _spawn(root, steps)
    assert child.stdout is not None
    for line in child.stdout:
        kind, *rest = line.split()
        if kind == "resumed":
            print(f"resumed from step {rest[0]}")
        elif kind == "loss":
            resumed[int(rest[0])] = float.fromhex(rest[1])
        elif kind == "stall":
            stalls.append(float(rest[1]))
    if child.wait() != 0:
        print("resumed run failed")
        return False
    curve = {s: v for s, v in losses.items() if restored is None or s <= restored}
    curve.update(resumed)
    exact = [curve.get(s) for s in range(1, steps + 1)] == reference
    print(f"loss at steps 1, {steps // 2}, {steps}: "
          f"{reference[0]:.4f}, {reference[steps // 2 - 1]:.4f}, {reference[-1]:.4f}")
    print(f"resumed loss curve equals the uninterrupted run bit for bit: {exact}")
    latest = mgr.latest_step()
    assert latest is not None
    print()
    cli(["inspect", str(mgr.step_path(latest)), "--limit", "8"])
    stall = sorted(stalls)[len(stalls) // 2] if stalls else math.nan
    state = _train_state(_build_model(seed=0))
    t0 = time.perf_counter()
    sp.save(state, os.path.join(workdir, "sync-save"), max_shard_size="200kB")
    full = time.perf_counter() - t0
    print(f"\nasync save stall (median of {len(stalls)}): {stall * 1000:.1f} ms; "
          f"a full synchronous save of the same state: {full * 1000:.1f} ms")
    return exact


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(args.dir, args.steps)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardpoint-demo-") as tmp:
        workdir = os.path.expanduser(args.dir) if args.dir else tmp  # --dir=~/x: the shell left ~ as it is
        taken = [n for n in _OUTPUTS if os.path.lexists(os.path.join(workdir, n))]
        if taken:
            output.error(f"{workdir} already holds {', '.join(taken)} (an earlier demo's, or yours): the demo "
                         "would resume from them or refuse to replace them. Give an empty or new --dir, or remove "
                         "those first")
            return 2
        os.makedirs(workdir, exist_ok=True)
        ok = _part_one(workdir, args.size_mb)
        ok = _part_two(workdir, args.steps, args.seed) and ok
        from .demo_ranks import part_three

        try:
            ok = part_three(workdir) and ok
        except RuntimeError as exc:  # a rank process failed: what it said, not a traceback of ours
            print(f"  FAILED: {exc}")
            ok = False
    print(f"\ndemo {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1
