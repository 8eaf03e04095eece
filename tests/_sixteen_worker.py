"""One rank of ``test_sixteen_ranks.py``, started as a script (kept lean: torch + shardpoint).

``python _sixteen_worker.py PHASE RANK WORLD PORT ROOT HOST``

* ``save`` (16 ranks): builds the FSDP2-like state below, saves it three times under ROOT
  (``step-1``; ``step-2``, same structure, new values; ``step-3``, one more tensor) and
  writes ``ROOT/results/save-rank<R>.json`` with what each ``sp.save`` returned.
* ``load`` (any world size): ``sp.load_into`` ``ROOT/step-2`` into DTensors on a 1-D mesh of
  WORLD ranks and compares every local shard bit-exactly with its slice of the expected
  global tensor; writes ``ROOT/results/load-rank<R>.json``.

HOST, when not ``-``, is the host name the rank was given (its own UTS namespace): the rank
checks ``socket.gethostname()`` is it. A failure writes the traceback to
``ROOT/results/<phase>-rank<R>.err`` (the test prints it) and exits 1.

The values are a function of the global index and the save number only, so any process
can rebuild the expected global tensors (:func:`expected_state`).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import math
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

# name -> (global shape, dtype, scale k, placement kind). Kinds: "s0" Shard(0) on the 1-D
# mesh, "2d" (Shard(0), Shard(1)) on the 4x4 mesh, "rep" Replicate() on the 1-D mesh,
# "plain" a plain tensor (the same on every rank).
MODEL: dict[str, tuple[tuple[int, ...], torch.dtype, float, str]] = {
    "embed.weight": ((1024, 64), torch.float32, 0.5, "s0"),  # even over 16; 205/204 rows over 5
    "uneven.weight": ((37, 48), torch.bfloat16, 0.25, "s0"),  # 3 rows x 12 ranks, 1, then 3 empty
    "proj.weight": ((64, 96), torch.float32, 0.125, "2d"),
    "norm.weight": ((256,), torch.float32, 2.0, "rep"),
    "buf.ids": ((10,), torch.int64, 3.0, "plain"),
}
OPTIM: dict[str, tuple[tuple[int, ...], torch.dtype, float, str]] = {
    "embed.weight": ((1024, 64), torch.float32, 0.75, "s0"),
    "uneven.weight": ((37, 48), torch.float32, 1.5, "s0"),
    "proj.weight": ((64, 96), torch.float32, 0.0625, "2d"),
}
EXTRA = ("extra.weight", ((21, 8), torch.float32, 4.0, "s0"))  # save 3's one more tensor
STEP = 3
SAVE_WORLD = 16
MESH_2D = (4, 4)
INT_SENTINEL = -7777


def expected_global(
    shape: tuple[int, ...], dtype: torch.dtype, k: float, save_number: int
) -> torch.Tensor:
    """``arange(numel).reshape(shape) * k + save_number`` (index mod 101, so that bf16 holds
    it exactly), computed in float64 and cast."""
    numel = math.prod(shape)
    base = torch.arange(numel, dtype=torch.float64).remainder(101).reshape(shape)
    return (base * k + save_number).to(dtype)


def specs(extra: bool = False) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype, float, str]]]:
    model = dict(MODEL)
    if extra:
        model[EXTRA[0]] = EXTRA[1]
    return {"model": model, "exp_avg": dict(OPTIM)}


def expected_state(save_number: int, extra: bool = False) -> dict[str, Any]:
    """The full (unsharded) state of save ``save_number``, as ``sp.load`` returns it."""
    tables = specs(extra)

    def full(table: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {
            name: expected_global(shape, dtype, k, save_number)
            for name, (shape, dtype, k, _) in table.items()
        }

    return {"model": full(tables["model"]), "optim": {"step": STEP, "exp_avg": full(tables["exp_avg"])}}


def _placements(kind: str, world: int, meshes: dict[str, Any]) -> tuple[Any, list[Any]] | None:
    from torch.distributed.tensor import Replicate, Shard

    if kind == "plain":
        return None
    if kind == "2d" and world == SAVE_WORLD:
        return meshes["2d"], [Shard(0), Shard(1)]
    if kind == "2d":  # any other world: the 2-D tensor goes Shard(1) on the 1-D mesh
        return meshes["1d"], [Shard(1)]
    if kind == "rep":
        return meshes["1d"], [Replicate()]
    return meshes["1d"], [Shard(0)]


def build_state(
    world: int, meshes: dict[str, Any], save_number: int | None, extra: bool = False
) -> dict[str, Any]:
    """This rank's state: DTensors holding save ``save_number``'s values, or blanks (NaN /
    a sentinel, step 0) to load into when ``save_number`` is None."""
    from torch.distributed.tensor import distribute_tensor

    tables = specs(extra)

    def make(table: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (shape, dtype, k, kind) in table.items():
            if save_number is None:
                blank = math.nan if dtype.is_floating_point else INT_SENTINEL
                full = torch.full(shape, blank, dtype=dtype)
            else:
                full = expected_global(shape, dtype, k, save_number)
            where = _placements(kind, world, meshes)
            out[name] = full if where is None else distribute_tensor(full, where[0], where[1])
        return out

    step = 0 if save_number is None else STEP
    return {"model": make(tables["model"]), "optim": {"step": step, "exp_avg": make(tables["exp_avg"])}}


def check_local(state: dict[str, Any], save_number: int, where: str) -> int:
    """Every local shard equals its slice of the expected global tensor, bit for bit;
    returns how many tensors were compared."""
    from shardpoint._distributed.group import local_chunk

    assert state["optim"]["step"] == STEP, f"{where}: optim.step is {state['optim']['step']!r}"
    expected = expected_state(save_number)
    compared = 0
    for part, table in (("model", state["model"]), ("exp_avg", state["optim"]["exp_avg"])):
        want_table = expected["model"] if part == "model" else expected["optim"]["exp_avg"]
        assert set(table) == set(want_table), f"{where}: {part} keys {sorted(table)}"
        for name, value in table.items():
            global_shape, offsets, local = local_chunk(value)
            want_full = want_table[name]
            what = f"{where}: {part}.{name}"
            assert global_shape == tuple(want_full.shape), f"{what}: global shape {global_shape}"
            want = want_full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))]
            assert local.dtype == want.dtype, f"{what}: dtype {local.dtype}"
            # bit-exact: compare the raw bytes, not values (NaN != NaN, -0.0 == 0.0)
            same = torch.equal(local.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
            assert same, f"{what}: the shard at offsets {offsets}, shape {tuple(local.shape)}, differs"
            compared += 1
    return compared


def _meshes(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == SAVE_WORLD:
        meshes["2d"] = init_device_mesh("cpu", MESH_2D, mesh_dim_names=("dp", "tp"))
    return meshes


def save_phase(rank: int, world: int, root: Path) -> dict[str, Any]:
    import shardpoint as sp

    assert world == SAVE_WORLD, world
    meshes = _meshes(world)
    out: dict[str, Any] = {"saves": {}}
    for save_number, extra in ((1, False), (2, False), (3, True)):
        state = build_state(world, meshes, save_number, extra)
        if save_number == 1:  # what this rank holds of the uneven and the 2-D tensor
            out["local_rows_uneven"] = state["model"]["uneven.weight"].to_local().shape[0]
            out["local_shape_2d"] = list(state["model"]["proj.weight"].to_local().shape)
        info = sp.save(state, root / f"step-{save_number}", layout="chunked")
        assert isinstance(info, sp.SaveInfo), f"rank {rank}: save {save_number} returned {info!r}"
        # the feature under construction: absent today, reported as "missing"
        out["saves"][str(save_number)] = {
            "plan_reused": getattr(info, "plan_reused", "missing"),
            "path": info.path,
            "tensor_bytes": info.tensor_bytes,
        }
    return out


def load_phase(rank: int, world: int, root: Path) -> dict[str, Any]:
    import shardpoint as sp

    meshes = _meshes(world)
    state = build_state(world, meshes, None)
    result = sp.load_into(state, root / "step-2")
    assert result.ok and not result.missing_keys and not result.unexpected_keys, f"rank {rank}: {result}"
    compared = check_local(state, 2, f"rank {rank} of {world}, step-2")
    return {"compared": compared, "bytes_read": result.bytes_read}


def main(argv: list[str]) -> None:
    phase, rank_s, world_s, port_s, root_s, host = argv
    rank, world, root = int(rank_s), int(world_s), Path(root_s)
    results = root / "results"
    try:
        faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) shows its Python stacks in the log
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's "where are you stuck"
        torch.set_num_threads(1)
        actual = socket.gethostname()
        if host != "-":
            assert actual == host, f"rank {rank}: socket.gethostname() is {actual!r}, expected {host!r}"
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port_s}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            out = (save_phase if phase == "save" else load_phase)(rank, world, root)
            out.update(rank=rank, host=actual)
            (results / f"{phase}-rank{rank}.json").write_text(json.dumps(out))
        finally:
            import gc

            gc.collect()  # gloo work held by reference cycles aborts at exit now and then
            dist.destroy_process_group()
    except BaseException:
        text = traceback.format_exc()
        (results / f"{phase}-rank{rank}.err").write_text(text)
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(1)  # skip atexit handlers that may block on a broken process group


if __name__ == "__main__":
    main(sys.argv[1:])
