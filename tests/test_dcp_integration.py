"""``shardpoint.integrations.dcp``: ``dcp.load`` of checkpoints written by ``sp.save``.

Real ``torch.distributed.checkpoint`` with its default planner: one process (``no_dist``)
and gloo ranks with DTensor (FSDP2-style ``Shard``) targets, resharded from a checkpoint
written by a different number of ranks. Every loaded value is compared exactly.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _dist_utils import run_ranks
from shardpoint._verify import verify_checkpoint
from shardpoint.integrations.dcp import ShardpointStorageReader, ShardpointStorageWriter

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _dcp_load(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
        dcp.load(state, storage_reader=ShardpointStorageReader(path), **kwargs)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    model[1](model[0](torch.randn(2, 4)).to(torch.bfloat16)).float().sum().backward()
    opt.step()
    return model, opt


def test_sp_save_nested_state_loads_with_dcp_load_exactly(tmp_path: Path) -> None:
    model, opt = _trained(0)
    sp.save(
        {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": 3, "ids": torch.arange(5)}},
        tmp_path / "ckpt",
    )
    other, other_opt = _trained(1)  # different values everywhere, same structure
    state = {"model": other.state_dict(), "optim": other_opt.state_dict(), "extra": {"epoch": 0, "ids": torch.zeros(5, dtype=torch.int64)}}
    _dcp_load(state, tmp_path / "ckpt", no_dist=True)

    for name, want in model.state_dict().items():
        got = other.state_dict()[name]  # loaded in place into the module's own tensors
        assert got.dtype == want.dtype and torch.equal(got, want), name
    want_opt = opt.state_dict()
    for i in range(4):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optim"]["state"][i][key], want_opt["state"][i][key]), (i, key)
    assert state["optim"]["param_groups"][0]["lr"] == 0.01
    assert state["extra"]["epoch"] == 3
    assert torch.equal(state["extra"]["ids"], torch.arange(5))


def test_an_optimizer_stored_by_name_loads_by_name_and_is_refused_by_position(tmp_path: Path) -> None:
    """sp.save of a model and its optimizer stores the optimizer's state by parameter name.
    DCP's FQN-keyed get/set_optimizer_state_dict loads it; a target of optimizer.state_dict()
    (by position) stopped at DCP's bare "Missing key in checkpoint state_dict"."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained(0)
    sp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
    other, other_opt = _trained(1)
    model_sd, optim_sd = get_state_dict(other, other_opt)
    state = {"model": model_sd, "optim": optim_sd}
    _dcp_load(state, tmp_path / "ckpt", no_dist=True)
    set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    want, got = opt.state_dict(), other_opt.state_dict()
    assert all(torch.equal(got["state"][i][k], want["state"][i][k]) for i in range(4) for k in ("exp_avg", "step"))
    assert got["param_groups"][0]["lr"] == 0.01
    positional = {"model": other.state_dict(), "optim": _trained(2)[1].state_dict()}
    with pytest.raises((CheckpointException, sp.InvalidStateError)) as caught:
        _dcp_load(positional, tmp_path / "ckpt", no_dist=True)
    assert re.search(r"DCP asks for 'optim\.state\.\d\.\w+', optimizer state by position \(a target built with "
                     r"optimizer\.state_dict\(\)\), but component 'optim' holds its optimizer's state by parameter "
                     r"name", str(caught.value)), str(caught.value)
    assert "set_optimizer_state_dict of torch.distributed.checkpoint.state_dict" in str(caught.value)


def test_flat_checkpoint_and_partial_regions(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    saved = {"embed.weight": torch.randn(6, 4, generator=g), "head.bias": torch.arange(3, dtype=torch.int32)}
    sp.save(saved, tmp_path / "flat", max_shard_size=100)  # several files
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    _dcp_load(target, tmp_path / "flat", no_dist=True)
    assert torch.equal(target["embed.weight"], saved["embed.weight"])
    assert torch.equal(target["head.bias"], torch.tensor([0, 1, 2], dtype=torch.int32))
    # Tied tensors (stored once, the other name an alias) load under both names.
    tied = {"embed.weight": saved["embed.weight"], "lm_head.weight": saved["embed.weight"]}
    sp.save(tied, tmp_path / "tied")
    manifest = json.loads((tmp_path / "tied" / "shardpoint.json").read_text())
    assert manifest["components"]["model"]["aliases"] == {"lm_head.weight": "embed.weight"}
    both = {k: torch.zeros(6, 4) for k in tied}
    _dcp_load(both, tmp_path / "tied", no_dist=True)
    assert torch.equal(both["embed.weight"], saved["embed.weight"])
    assert torch.equal(both["lm_head.weight"], saved["embed.weight"])
    # A target of another dtype gets the stored values cast, as DCP's own reader does.
    wide = {"embed.weight": torch.zeros(6, 4, dtype=torch.float64)}
    _dcp_load(wide, tmp_path / "flat", no_dist=True)
    assert torch.equal(wide["embed.weight"], saved["embed.weight"].double())


def test_damaged_file_is_reported_naming_it(tmp_path: Path) -> None:
    sp.save({"w": torch.arange(64, dtype=torch.float32)}, tmp_path / "c")
    data = tmp_path / "c" / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-8] ^= 0xFF  # a byte of the tensor's data
    data.write_bytes(bytes(raw))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info:
        _dcp_load({"w": torch.zeros(64)}, tmp_path / "c", no_dist=True)
    # DCP wraps what a rank raised (rank -> (exception, traceback)); ours names file and tensor.
    (exc, _), = info.value.failures.values()
    assert isinstance(exc, sp.ChecksumMismatchError)
    assert str(exc).startswith(f"{data}, tensor 'w': crc32c of the stored bytes is ")


def test_pickled_values_are_read_only_when_asked_for_and_allowed(tmp_path: Path) -> None:
    import fractions

    from torch.distributed.checkpoint.api import CheckpointException

    sp.save(
        {"model": {"w": torch.ones(2)}, "extra": {"f": fractions.Fraction(1, 3)}},
        tmp_path / "c",
        allow_pickle=True,
    )
    state: dict[str, Any] = {"model": {"w": torch.zeros(2)}}
    _dcp_load(state, tmp_path / "c", no_dist=True)  # the pickled value is not needed: fine
    assert torch.equal(state["model"]["w"], torch.ones(2))

    state = {"model": {"w": torch.zeros(2)}, "extra": {"f": None}}
    with pytest.raises(CheckpointException) as info:
        _dcp_load(state, tmp_path / "c", no_dist=True)
    (exc, _), = info.value.failures.values()
    assert isinstance(exc, sp.UnsafePickleError)
    assert str(exc) == (
        f"{tmp_path / 'c'}: 'extra.f' (a fractions.Fraction) was pickled at save time; unpickling "
        "runs arbitrary code, so it is refused. Pass ShardpointStorageReader(path, "
        "allow_pickle=True) only if you trust whoever wrote this checkpoint, or leave that key "
        "out of the state you load"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = ShardpointStorageReader(tmp_path / "c", allow_pickle=True)
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert state["extra"]["f"] == fractions.Fraction(1, 3)


def test_dcp_save_and_async_save_with_the_writer_in_one_process(tmp_path: Path) -> None:
    model, opt = _trained(0)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": 3, "ids": [1, 2]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=ShardpointStorageWriter(tmp_path / "c"), no_dist=True)
        dcp.async_save(state, storage_writer=ShardpointStorageWriter(tmp_path / "a"), no_dist=True).result()
    for path in (tmp_path / "c", tmp_path / "a"):
        back = sp.load(path)  # a shardpoint checkpoint: manifest, crc32c, safetensors files
        assert list(back) == ["model", "optim", "extra"]
        assert back["extra"] == {"epoch": 3, "ids": [1, 2]}
        for name, want in model.state_dict().items():
            assert back["model"][name].dtype == want.dtype and torch.equal(back["model"][name], want)
        want_opt = opt.state_dict()
        assert sorted(back["optim"]["state"]) == ["0", "1", "2", "3"]  # DCP's keys are strings
        for i in range(4):
            assert torch.equal(back["optim"]["state"][str(i)]["exp_avg"], want_opt["state"][i]["exp_avg"])
        assert back["optim"]["param_groups"][0]["lr"] == 0.01
        assert verify_checkpoint(path).ok and not verify_checkpoint(path).warnings
    # And back through dcp.load with the reader, into a fresh state of the same structure.
    other, other_opt = _trained(1)
    target = {"model": other.state_dict(), "optim": other_opt.state_dict(), "extra": {"epoch": 0, "ids": [0, 0]}}
    _dcp_load(target, tmp_path / "c", no_dist=True)
    for name, want in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], want), name
    assert target["extra"] == {"epoch": 3, "ids": [1, 2]}

    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=ShardpointStorageWriter(tmp_path / "c"), no_dist=True)
    (exc, _), = info.value.failures.values()
    assert isinstance(exc, sp.CheckpointExistsError)
    assert str(exc) == f"{tmp_path / 'c'} already exists; pass overwrite=True to replace it, or save to a new path"


def test_reader_without_path_says_what_to_pass() -> None:
    with pytest.raises(sp.CheckpointError) as info:
        ShardpointStorageReader().read_metadata()
    assert str(info.value) == (
        "ShardpointStorageReader has no checkpoint to read: pass its path, "
        "ShardpointStorageReader(path), or dcp.load(..., checkpoint_id=path)"
    )


# ------------------------------------------------------------------------ gloo ranks


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    shape = {"a": (7, 5), "b": (6,), "c": (3, 8)}[name]
    return torch.randn(shape, generator=g)


def ranks_worker(rank: int, world: int, root: str) -> None:
    """sp.save of Shard(0) DTensors, then dcp.load into other shardings (cross-chunk reads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    saved = {
        "model": {n: distribute_tensor(_full(n), mesh, [Shard(0)]) for n in ("a", "b")},
        "extra": {"c": _full("c"), "step": 11},
    }
    sp.save(saved, Path(root) / "ckpt")
    state = {
        "model": {
            "a": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)]),  # another sharding
            "b": distribute_tensor(torch.zeros(6), mesh, [Shard(0)]),
        },
        "extra": {"c": torch.zeros(3, 8), "step": 0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=ShardpointStorageReader(Path(root) / "ckpt"))
    for n in ("a", "b"):
        assert torch.equal(state["model"][n].full_tensor(), _full(n)), n
    assert torch.equal(state["extra"]["c"], _full("c"))
    assert state["extra"]["step"] == 11
    # dcp.save with the shardpoint writer on 2 ranks: one collective sp.save of each rank's shards.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, storage_writer=ShardpointStorageWriter(Path(root) / "w"))
        # dcp.async_save too: staged, then written by every rank in the background.
        dcp.async_save(saved, storage_writer=ShardpointStorageWriter(Path(root) / "aw")).result()

    # A replicated (DDP-style) state, no DTensor: one collective save, not one per rank
    # racing for the path (each rank committed its own, and without overwrite all raised).
    torch.manual_seed(0)
    replicated = {"model": torch.nn.Linear(3, 2).state_dict(), "note": "replicated"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(replicated, storage_writer=ShardpointStorageWriter(Path(root) / "ddp"))
    if rank == 0:
        torch.save(replicated["model"], Path(root) / "ddp_ref.pt")

    # A real FSDP2 (fully_shard) model and its AdamW state, as get_state_dict gives them.
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, storage_writer=ShardpointStorageWriter(Path(root) / "fsdp"))
    full = {f"model/{k}": v.full_tensor() for k, v in msd.items()}
    full.update({f"optim/{k}/exp_avg": v["exp_avg"].full_tensor() for k, v in osd["state"].items()})
    if rank == 0:
        torch.save(full, Path(root) / "fsdp_ref.pt")


def three_ranks_worker(rank: int, world: int, root: str) -> None:
    """dcp.load on 3 ranks of what dcp.save wrote through the shardpoint writer on 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "model": {n: distribute_tensor(torch.zeros(_full(n).shape), mesh, [Shard(0)]) for n in ("a", "b")},
        "extra": {"c": torch.zeros(3, 8), "step": 0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=ShardpointStorageReader(Path(root) / "w"))
    for n in ("a", "b"):
        assert torch.equal(state["model"][n].full_tensor(), _full(n)), n
    assert torch.equal(state["extra"]["c"], _full("c")) and state["extra"]["step"] == 11

    # dcp.save(no_dist=True) on one rank of three saves alone, as with DCP's own writer; the
    # shardpoint writer started a collective save there (the others never came: a hang).
    import torch.distributed as dist

    plain = {"model": {"w": _full("c")}}
    if rank == 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(plain, storage_writer=ShardpointStorageWriter(Path(root) / "alone"), no_dist=True)
        assert torch.equal(sp.load(Path(root) / "alone")["model"]["w"], _full("c"))
    # Over a subgroup: refused on its ranks before anything is written, where it hung (DCP
    # gathers the ranks' errors into its CheckpointException).
    from torch.distributed.checkpoint.api import CheckpointException

    pair = dist.new_group([0, 2])
    if rank in (0, 2):
        with warnings.catch_warnings(), pytest.raises(CheckpointException) as caught:
            warnings.simplefilter("ignore")
            dcp.save(plain, storage_writer=ShardpointStorageWriter(Path(root) / "pair"), process_group=pair)
        text = str(caught.value)
        assert text.count("InvalidArgumentError: ShardpointStorageWriter(") == 2, text
        assert "this dcp.save runs over 2 of the 3 ranks (process_group=)" in text, text
        assert not (Path(root) / "pair").exists()
    dist.barrier()


@pytest.mark.slow
def test_two_rank_saves_load_with_dcp_resharded_and_in_one_process(tmp_path: Path) -> None:
    run_ranks(ranks_worker, 2, str(tmp_path), timeout=120)
    back = sp.load(tmp_path / "ckpt")
    assert torch.equal(back["model"]["a"], _full("a")) and back["extra"]["step"] == 11
    # The same chunked checkpoint in one process, the DTensor targets as plain tensors.
    state: dict[str, Any] = {
        "model": {"a": torch.zeros(7, 5), "b": torch.zeros(6)},
        "extra": {"c": torch.zeros(3, 8), "step": 0},
    }
    _dcp_load(state, tmp_path / "ckpt", no_dist=True)
    assert torch.equal(state["model"]["a"], _full("a"))
    assert torch.equal(state["model"]["b"], _full("b"))
    assert state["extra"]["step"] == 11
    # What dcp.save wrote through ShardpointStorageWriter on 2 ranks: sp.load and dcp.load.
    back = sp.load(tmp_path / "w")
    assert torch.equal(back["model"]["a"], _full("a")) and torch.equal(back["model"]["b"], _full("b"))
    assert torch.equal(back["extra"]["c"], _full("c")) and back["extra"]["step"] == 11
    assert verify_checkpoint(tmp_path / "w").ok
    back = sp.load(tmp_path / "aw")  # written by dcp.async_save on 2 ranks
    assert torch.equal(back["model"]["a"], _full("a")) and torch.equal(back["model"]["b"], _full("b"))
    assert torch.equal(back["extra"]["c"], _full("c")) and back["extra"]["step"] == 11
    assert verify_checkpoint(tmp_path / "aw").ok
    state = {"model": {"a": torch.zeros(7, 5), "b": torch.zeros(6)}, "extra": {"c": torch.zeros(3, 8), "step": 0}}
    _dcp_load(state, tmp_path / "w", no_dist=True)
    assert torch.equal(state["model"]["a"], _full("a")) and state["extra"]["step"] == 11
    run_ranks(three_ranks_worker, 3, str(tmp_path), timeout=120)
    manifest = json.loads((tmp_path / "ddp" / "shardpoint.json").read_text())
    assert (manifest["world_size"], manifest["layout"]) == (2, "chunked")
    ddp = sp.load(tmp_path / "ddp")
    assert ddp["note"] == "replicated" and set(ddp["model"]) == {"weight", "bias"}
    assert all(torch.equal(ddp["model"][k], v) for k, v in torch.load(tmp_path / "ddp_ref.pt").items())
    # The FSDP2 state written through the shardpoint writer: exact in sp.load.
    ref = torch.load(tmp_path / "fsdp_ref.pt")
    assert len(ref) == 8  # 4 parameters, 4 exp_avg
    fsdp = sp.load(tmp_path / "fsdp")
    assert sorted(fsdp["model"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    for key, want in ref.items():
        comp, name, *rest = key.split("/")
        got = fsdp[comp]["state"][name]["exp_avg"] if rest else fsdp[comp][name]
        assert got.dtype == want.dtype and torch.equal(got, want), key


def test_dcp_save_and_load_through_an_object_store(url: str, opts: dict[str, Any]) -> None:
    """dcp.save with the shardpoint writer to an s3:// URL (the real S3 server on loopback)
    goes through the same fsspec path as sp.save: sp.load and dcp.load with the reader
    read it back exactly."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'shardpoint[s3]')")
    model, opt = _trained(0)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=ShardpointStorageWriter(url, storage_options=opts), no_dist=True)
    back = sp.load(url, storage_options=opts)
    assert back["extra"] == {"epoch": 3}
    for name, want in model.state_dict().items():
        assert torch.equal(back["model"][name], want), name
    other, other_opt = _trained(1)
    target = {"model": other.state_dict(), "optim": other_opt.state_dict(), "extra": {"epoch": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=ShardpointStorageReader(url, storage_options=opts), no_dist=True)
    for name, want in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], want), name
    assert torch.equal(target["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert target["extra"] == {"epoch": 3}
