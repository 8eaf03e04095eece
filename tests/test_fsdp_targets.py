"""FSDP2 (DTensor) targets of ``load_into`` on 2 gloo ranks: an optimizer saved as an object
comes back sharded like its parameters; a model sharded on ``meta`` is refused with the way
out; tied DTensor weights stored apart are compared, as plain tied weights are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardpoint as sp
from _dist_utils import run_ranks

WORLD = 2


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def _net(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3))  # 7 rows: uneven shards
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)


def _step(net: nn.Module, opt: torch.optim.Optimizer) -> None:
    net(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _full(net: nn.Module) -> list[list[float]]:
    return [p.full_tensor().flatten().tolist() for p in net.parameters()]


def worker(rank: int, world: int, root_str: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = Path(root_str)
    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, Any] = {}

    # An optimizer saved as an object: restored as DTensor shards; the next step matches.
    net, opt = _net(mesh)
    _step(net, opt)
    sp.save({"model": net, "optim": opt}, root / "train")
    _step(net, opt)  # the uninterrupted run's next step
    net2, opt2 = _net(mesh)
    result = sp.load_into({"model": net2, "optim": opt2}, root / "train")
    _step(net2, opt2)
    state = opt2.state[opt2.param_groups[0]["params"][0]]
    report["optim"] = {"ok": result.ok, "kind": type(state["exp_avg"]).__name__, "same": _full(net2) == _full(net)}

    # A model sharded on meta: refused, naming the way out; after to_empty it loads.
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3))
    fully_shard(meta, mesh=mesh)
    try:
        sp.load_into(meta, root / "model-only")
        report["meta"] = "loaded"
    except sp.CheckpointError as exc:
        report["meta"] = str(exc)
    meta.to_empty(device="cpu")
    report["to_empty"] = sp.load_into(meta, root / "model-only").ok and _full(meta) == json.loads(
        (root / "model-only.json").read_text())
    # dtype= another than the DTensors' (they are filled where they are): refused before reading.
    before = _full(meta)
    try:
        sp.load_into(meta, root / "model-only", dtype=torch.bfloat16)
        report["dtype"] = "loaded"
    except sp.CheckpointError as exc:
        report["dtype"] = str(exc)
    report["dtype_same"] = sp.load_into(meta, root / "model-only", dtype="auto").ok and _full(meta) == before

    # Tied DTensor weights from a checkpoint storing them apart: equal loads, different refused.
    for name in ("tied-same", "tied-other"):
        tied = Tied()
        fully_shard(tied, mesh=mesh)
        try:
            report[name] = sp.load_into(tied, root / name).ok
        except sp.CheckpointError as exc:
            report[name] = str(exc)
    (root / f"rank{rank}.json").write_text(json.dumps(report))


def test_fsdp2_targets(tmp_path: Path) -> None:
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3))
    sp.save(plain.state_dict(), tmp_path / "model-only")
    (tmp_path / "model-only.json").write_text(json.dumps([p.flatten().tolist() for p in plain.parameters()]))
    weight = torch.randn(8, 4)
    sp.save({"embed.weight": weight, "head.weight": weight.clone()}, tmp_path / "tied-same")
    sp.save({"embed.weight": weight, "head.weight": weight + 1}, tmp_path / "tied-other")
    run_ranks(worker, WORLD, str(tmp_path), timeout=240)
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["optim"] == {"ok": True, "kind": "DTensor", "same": True}, report
        assert "target tensor '0.weight' is a DTensor on the meta device" in report["meta"], report
        assert "model.to_empty(device=...)" in report["meta"] and "nothing was loaded" in report["meta"]
        assert report["to_empty"] is True
        assert "failed on ranks 0, 1 (rank 0: InvalidStateError: dtype= asks for torch.bfloat16" in report["dtype"]
        assert report["dtype"].endswith(
            "dtype= asks for torch.bfloat16 but target tensor '0.weight' is a DTensor of torch.float32, which is "
            "filled where it is and keeps its dtype (FSDP2 and tensor parallelism hold their parameters so): "
            "convert the model before sharding it (model.to(dtype) before fully_shard), or load without dtype= "
            "(the checkpoint's values are cast to the target's dtype))"), report
        assert report["dtype_same"] is True
        assert report["tied-same"] is True
        assert "'embed.weight' and 'head.weight' share one tensor in the target (tied weights), but the " \
               "checkpoint stores different values for them" in report["tied-other"], report


def _mismatch_worker(rank: int, world: int, root_str: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = Path(root_str)
    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, str] = {}
    for kind in ("sp", "hf"):  # each rank handed another folder: a shardpoint save, save_pretrained-like files
        target = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])}
        try:
            sp.load_into(target, root / f"{kind}{rank}")
            report[kind] = "loaded"
        except sp.CheckpointError as exc:
            report[kind] = str(exc)
    # A strict load refused on one rank only (its target has a key the checkpoint lacks): no
    # rank reads a byte (rank 0 had loaded while rank 1 refused, and both said nothing was loaded).
    target = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])}
    if rank == 1:
        target["extra"] = torch.zeros(1)
    try:
        sp.load_into(target, root / "sp0")
        report["strict"] = "loaded"
    except sp.CheckpointError as exc:
        report["strict"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    report["untouched"] = bool((target["w"].to_local() == 0).all())
    # One rank loads while the other saves: both fail, named, and nothing is written.
    target = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])}
    try:
        if rank == 0:
            sp.load_into(target, root / "sp0")
        else:
            sp.save(target, root / "new")
        report["cross"] = "returned"
    except sp.CheckpointError as exc:
        report["cross"] = f"{type(exc).__name__}: {exc}"
    (root / f"mismatch{rank}.json").write_text(json.dumps(report))


def test_ranks_handed_different_checkpoints_or_calls_are_refused(tmp_path: Path) -> None:
    """Two save_pretrained folders loaded a mix of both (ok=True); two shardpoint saves were
    called 'being overwritten'; a rank loading while another saved raised TypeError; a strict
    refusal on one rank came after the other ranks had read."""
    from safetensors.torch import save_file

    for rank in range(WORLD):
        sp.save({"w": torch.full((4, 2), float(rank))}, tmp_path / f"sp{rank}")
        (tmp_path / f"hf{rank}").mkdir()
        save_file({"w": torch.full((4, 2), float(rank))}, str(tmp_path / f"hf{rank}" / "model.safetensors"))
    run_ranks(_mismatch_worker, WORLD, str(tmp_path), timeout=240)
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"mismatch{rank}.json").read_text())
        for kind in ("sp", "hf"):
            assert (f"the ranks opened different checkpoints (rank 0: {tmp_path / (kind + '0')}; rank 1: "
                    f"{tmp_path / (kind + '1')}): every rank must load the same one") in report[kind], report
        assert report["strict"].startswith(f"DistributedCheckpointError: planning the load of {tmp_path / 'sp0'} "
                                           "failed on rank 1"), report
        assert report["untouched"] is True, f"rank {rank} read part of the checkpoint"
        assert report["cross"].startswith("DistributedCheckpointError"), report
        assert "the ranks are out of step" in report["cross"] and "'loading a checkpoint'" in report["cross"]
    assert not (tmp_path / "new").exists()
