"""A collective ``hf`` save run on gloo ranks by ``test_hf_layout.py`` (kept apart from it so
the spawned ranks do not import ``transformers``)."""

from __future__ import annotations

from pathlib import Path

import torch

import shardpoint as sp


def collective_state() -> dict[str, torch.Tensor]:
    """Oversized tensors first, in the middle and last, a file exactly at the limit, a zero-size one."""
    def f32(n: int, start: float) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) + start

    return {
        "big0": f32(30, 0), "a": f32(10, 1), "b": f32(15, 2), "empty": torch.zeros(0, 4),
        "big1": f32(40, 3), "c": f32(25, 4), "d": f32(20, 5), "e": f32(5, 6), "big2": f32(26, 7),
    }


def collective_hf_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    sp.save(collective_state(), Path(root) / "collective", layout="hf", max_shard_size=100,
            process_group=dist.group.WORLD)
