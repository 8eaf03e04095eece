"""Entries of their own on some ranks in a collective save (torchtitan's ``dp_rank_<r>``
data loader state, each rank's random generators): every rank's are kept, where only rank
0's tree was (the others' were dropped without a word, and ``dcp.load`` on rank 1 then
failed). An entry two ranks hold with different values is refused on every rank."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import shardpoint as sp
from _dist_utils import run_ranks
from shardpoint._cli.main import main as cli_main

WORLD = 2


def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _state(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    mine = torch.full((3,), float(rank))
    return {
        "model": {"w": distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])},
        "loader": {f"dp_rank_{rank}": {"sample_idx": 40 + rank}},
        "extra": {f"r{rank}": mine, f"r{rank}.same": mine},  # a tensor only this rank has, held twice
        "rng": sp.RNGState(),
        "step": 7,
    }


def worker(rank: int, world: int, root_str: str) -> None:
    import torch.distributed as dist

    root = Path(root_str)
    report: dict[str, Any] = {}
    for layout in ("chunked", "hf"):
        _seed(100 + rank)  # each rank draws its own numbers
        torch.rand(5)
        state = _state(rank)
        sp.save(state, root / layout, layout=layout, process_group=dist.group.WORLD)
        expected = _draws()  # what a resumed rank must draw next
        _seed(999)
        target = _state(rank)
        target["loader"], target["extra"], target["step"] = {}, {}, 0
        result = sp.load_into(target, root / layout, process_group=dist.group.WORLD)
        report[layout] = {
            "ok": result.ok,
            "draws_match": _draws() == expected,
            "loader": target["loader"],
            "extra": {k: v.tolist() for k, v in target["extra"].items()},
            "step": target["step"],
        }
    # The same entry with other values on each rank: refused on every rank, nothing written.
    try:
        sp.save({"model": {"w": torch.zeros(2)}, "cfg": {"lr": 0.1 * (rank + 1)}}, root / "conflict",
                process_group=dist.group.WORLD)
        report["conflict"] = "saved"
    except sp.CheckpointError as exc:
        report["conflict"] = f"{type(exc).__name__}: {exc}"
    # A DDP-style save by rank 0 alone (plain tensors: a group of one).
    _seed(300 + rank)
    if rank == 0:
        sp.save({"rng": sp.RNGState()}, root / "rank0-only")
    expected = _draws()
    dist.barrier()
    _seed(999)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sp.load_into({"rng": sp.RNGState()}, root / "rank0-only")
    report["rank0-only"] = {"warnings": [str(w.message) for w in caught if "RNGState" in str(w.message)]}
    if rank == 0:
        report["rank0-only"]["draws_match"] = _draws() == expected
    (root / f"rank{rank}.json").write_text(json.dumps(report))


def test_entries_of_each_rank_are_kept_and_each_rank_restores_its_own(tmp_path: Path) -> None:
    run_ranks(worker, WORLD, str(tmp_path), timeout=240)
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for layout in ("chunked", "hf"):
            got = report[layout]
            assert got["ok"] and got["step"] == 7, (rank, layout, got)
            assert got["draws_match"], f"rank {rank} ({layout}) did not restore its own random generators"
            assert got["loader"] == {"dp_rank_0": {"sample_idx": 40}, "dp_rank_1": {"sample_idx": 41}}, got
            assert got["extra"] == {"r0": [0.0] * 3, "r0.same": [0.0] * 3, "r1": [1.0] * 3, "r1.same": [1.0] * 3}, got
        assert "InvalidStateError: cfg['lr'] is not the same on rank 0 and rank 1: a collective save stores one " \
               "copy of what is not a tensor, so one rank's value would be lost" in report["conflict"], report
    assert not (tmp_path / "conflict").exists()
    # One process reads every rank's entries; its RNGState takes rank 0's generators.
    for layout in ("chunked", "hf"):
        loaded = sp.load(tmp_path / layout)
        assert loaded["loader"] == {"dp_rank_0": {"sample_idx": 40}, "dp_rank_1": {"sample_idx": 41}}
        assert sorted(loaded["rng"]["ranks"]) == ["0", "1"]
        assert torch.equal(loaded["model"]["w"], torch.arange(8.0).reshape(4, 2))
        assert cli_main(["verify", str(tmp_path / layout)]) == 0
    # Saved by rank 0 alone: rank 0 restores its generators, rank 1 keeps its own and says so.
    for rank in range(WORLD):
        alone = json.loads((tmp_path / f"rank{rank}.json").read_text())["rank0-only"]
        if rank == 0:
            assert alone == {"draws_match": True, "warnings": []}, alone
        else:
            assert alone["warnings"] == [
                "RNGState: the checkpoint holds the random generators of rank(s) 0 only, not rank 1's (it was saved "
                "by rank 0 alone, or by fewer ranks); this rank's generators are left as they are"], alone




def zero_worker(rank: int, world: int, root: str) -> None:
    """A ``ZeroRedundancyOptimizer``: saved before its shards are gathered, refused with what to
    do; done as told (gathered on rank 0, saved from rank 0 only), every rank gets its shard back."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build(seed: int, lr: float) -> tuple[torch.nn.Module, ZeroRedundancyOptimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)

    model, opt = build(0, 0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    path = Path(root) / "zero"
    report: dict[str, Any] = {}
    try:
        sp.save({"model": model, "optim": opt}, path)
    except sp.CheckpointError as exc:
        report["refused"] = [type(exc).__name__, str(exc)]
    opt.consolidate_state_dict(to=0)
    expected = opt.state_dict() if rank == 0 else None
    import torch.distributed as dist

    if rank == 0:
        sp.save({"model": model, "optim": opt}, path)
    dist.barrier()
    model2, opt2 = build(1, 0.5)
    report["ok"] = sp.load_into({"model": model2, "optim": opt2}, path).ok
    opt2.consolidate_state_dict(to=0)
    if rank == 0:
        got = opt2.state_dict()
        report["lr"] = got["param_groups"][0]["lr"]
        report["same_state"] = sorted(got["state"]) == sorted(expected["state"]) and all(
            torch.equal(got["state"][i][k], v) for i, s in expected["state"].items() for k, v in s.items()
        )
    (Path(root) / f"zero{rank}.json").write_text(json.dumps(report))


def test_zero_redundancy_optimizer_is_refused_until_gathered_then_round_trips(tmp_path: Path) -> None:
    run_ranks(zero_worker, WORLD, str(tmp_path), timeout=240)
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"zero{rank}.json").read_text())
        kind, message = report["refused"]
        assert kind == "InvalidStateError", report
        assert message.startswith("optim: a ZeroRedundancyOptimizer holds only this rank's shard"), message
        assert "consolidate_state_dict(to=0) on every rank" in message, message
        assert report["ok"] is True, report
    rank0 = json.loads((tmp_path / "zero0.json").read_text())
    assert rank0["lr"] == 0.1 and rank0["same_state"] is True, rank0
