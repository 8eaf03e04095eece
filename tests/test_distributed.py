"""Collective saves and resharding loads on 2-4 gloo ranks (CPU processes).

The matrix: checkpoints saved by real FSDP2 (``fully_shard``), TP (``parallelize_module``,
colwise/rowwise), 2-D FSDPxTP on a 2x2 mesh, DDP-style replicated plain tensors
(``process_group=WORLD``), an async FSDP2 save and hand-made uneven DTensor shards (dims not
divisible by the world size, empty shards, bf16 and int64, a 3-D tensor, 1-D and 2-D
meshes), each in both layouts (``chunked`` per-rank files, ``hf`` shared files), are loaded

* into every parallelization at the same world size (the same one, and other meshes),
* into every parallelization at the other world size (2 <-> 4 ranks),
* in one plain process (``sp.load`` and ``sp.load_into`` an unsharded module / dict).

Every target is filled with NaN (integers: a sentinel) first; afterwards each rank compares
its own shard with the matching slice of reference tensors rebuilt from the seed, and checks
it read no more than 1.1x the bytes its shards need.

To stay fast on two cores, the matrix runs in three spawned groups that share one directory
(2 ranks: save + load at 2; 4 ranks: save at 4, load everything at 4; 2 ranks: load the
4-rank checkpoints). Each rank records the outcome of every cell; the parametrized tests
report them one cell at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpoint as sp
from _dist_utils import run_ranks
from shardpoint._distributed.group import local_chunk

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the first matrix test also runs the three spawned groups
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]

# ----------------------------------------------------------------------------- the states

DIM, HIDDEN, VOCAB, BLOCKS = 12, 19, 11, 3  # 19 and 11 divide by neither 2 nor 4
MAX_SHARD = 2000  # bytes: several files per rank (chunked) and an index (hf)
INT_SENTINEL = -7777


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))


def reference_net(seed: int) -> dict[str, torch.Tensor]:
    """The full tensors of the ``Net`` saved with ``seed``: every value drawn from the seed."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) for name, p in Net().state_dict().items()}


def seeded_net(seed: int) -> Net:
    net = Net()
    with torch.no_grad():
        for name, value in reference_net(seed).items():
            net.get_parameter(name).copy_(value)
    return net


UNEVEN = {  # name -> (global shape, dtype)
    "rows": ((7, 5), torch.float32),
    "cols": ((5, 7), torch.float32),
    "tiny": ((3,), torch.bfloat16),  # at 4 ranks: 1, 1, 1, 0
    "one": ((1, 6), torch.float32),  # one row: every other rank's Shard(0) is empty
    "ints": ((9,), torch.int64),
    "rep": ((4, 4), torch.float32),
    "cube": ((5, 3, 7), torch.float32),
    "empty": ((0, 4), torch.float32),
    "scalar": ((), torch.int64),
}


def _placements(kind: str) -> dict[str, list[Any]]:
    """Placements of the uneven tensors: on a 1-D mesh (two ways) or on the 2x2 mesh."""
    from torch.distributed.tensor import Replicate, Shard

    s0, s1, s2, r = Shard(0), Shard(1), Shard(2), Replicate()
    table = {  # name: (1d-a, 1d-b, 2d)
        "rows": ([s0], [s1], [s0, s1]),
        "cols": ([s1], [s0], [s1, s0]),
        "tiny": ([s0], [r], [s0, r]),
        "one": ([s0], [s1], [r, s1]),
        "ints": ([s0], [r], [s0, s0]),
        "rep": ([r], [s1], [r, r]),
        "cube": ([s2], [s0], [s2, s1]),
        "empty": ([s0], [s1], [s0, s1]),
        "scalar": ([r], [r], [r, r]),
    }
    column = ("1d-a", "1d-b", "2d").index(kind)
    return {name: places[column] for name, places in table.items()}


def reference_uneven(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in UNEVEN.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            out[name] = torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)
    return out


def reference(source: str, seed: int) -> dict[str, torch.Tensor]:
    return reference_uneven(seed) if source.startswith("uneven") else reference_net(seed)


# ----------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Saved:
    """One checkpoint of the matrix."""

    name: str
    source: str
    """How the saving ranks hold the state: fsdp2, fsdp2-async, tp, ddp, 2d, uneven-<mesh>."""
    world: int
    seed: int


SAVES = [
    Saved("fsdp2-ws2", "fsdp2", 2, 11),
    Saved("fsdp2-async-ws2", "fsdp2-async", 2, 12),
    Saved("tp-ws2", "tp", 2, 13),
    Saved("ddp-ws2", "ddp", 2, 14),
    Saved("uneven-ws2", "uneven-1d-a", 2, 15),
    Saved("fsdp2-ws4", "fsdp2", 4, 16),
    Saved("2d-ws4", "2d", 4, 17),
    Saved("uneven-ws4", "uneven-2d", 4, 18),
]
LAYOUTS = ("chunked", "hf")
TARGETS = {  # world size -> parallelizations loaded into
    2: ("fsdp2", "tp", "ddp", "uneven-1d-a", "uneven-1d-b"),
    4: ("fsdp2", "2d", "uneven-1d-a", "uneven-1d-b", "uneven-2d"),
}


def _family(source: str) -> str:
    return "uneven" if source.startswith("uneven") else "net"


@dataclass(frozen=True)
class Cell:
    saved: Saved
    layout: str
    target: str
    world: int

    @property
    def ckpt(self) -> str:
        return f"{self.saved.name}-{self.layout}"

    @property
    def id(self) -> str:
        if self.world != self.saved.world:
            relation = "other-world"
        elif self.target == self.saved.source.replace("-async", ""):
            relation = "same"
        else:
            relation = "other-mesh"
        return f"{self.ckpt}/to/{self.target}-ws{self.world}/{relation}"


CELLS = [
    Cell(saved, layout, target, world)
    for saved in SAVES
    for layout in LAYOUTS
    for world in (2, 4)
    for target in TARGETS[world]
    if _family(target) == _family(saved.source)
]
CKPTS = [(saved, layout) for saved in SAVES for layout in LAYOUTS]

# The three spawned groups: (world size, save the checkpoints of this world size?,
# which cells to load).
PHASES: dict[str, tuple[int, bool, Callable[[Cell], bool]]] = {
    "save2": (2, True, lambda c: c.world == 2 and c.saved.world == 2),
    "save4": (4, True, lambda c: c.world == 4),
    "load2": (2, False, lambda c: c.world == 2 and c.saved.world == 4),
}
BALANCE_CKPT = "ddp-balance-ws2"

# ----------------------------------------------------------------------------- on the ranks

_meshes: dict[tuple[int, ...], Any] = {}


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _meshes:
        names = ("dp", "tp") if len(shape) == 2 else None
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape]


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"embed": ColwiseParallel()}
    for i in range(BLOCKS):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return plan


def parallelize(net: Net, how: str, world: int) -> Net:
    """Shard ``net`` in place the way ``how`` says: fsdp2, tp, 2d (FSDP x TP) or ddp (as is)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if how == "ddp":
        return net
    if how == "tp":
        parallelize_module(net, _mesh((world,)), _tp_plan())
        return net
    if how == "fsdp2":
        dp = _mesh((world,))
    elif how == "2d":
        mesh = _mesh((2, world // 2))
        parallelize_module(net, mesh["tp"], _tp_plan())
        dp = mesh["dp"]
    else:
        raise ValueError(how)
    for block in net.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(net, mesh=dp)
    return net


def uneven_state(kind: str, world: int, values: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """The uneven DTensors on a 1-D mesh or the 2x2 mesh; NaN / sentinel when no values."""
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh((2, world // 2) if kind == "2d" else (world,))
    out = {}
    for name, placements in _placements(kind).items():
        shape, dtype = UNEVEN[name]
        full = values[name] if values is not None else torch.full(shape, _blank(dtype), dtype=dtype)
        out[name] = distribute_tensor(full, mesh, placements)
    return out


def _blank(dtype: torch.dtype) -> float:
    return math.nan if dtype.is_floating_point else INT_SENTINEL


def blank_(tensors: dict[str, Any]) -> None:
    """Fill every local shard with NaN (integers: a sentinel)."""
    with torch.no_grad():
        for value in tensors.values():
            local = local_chunk(value)[2]
            local.fill_(_blank(local.dtype))


def check_filled(tensors: dict[str, Any], expected: dict[str, torch.Tensor], where: str) -> int:
    """Each local shard equals its slice of the reference, with no NaN left; returns its bytes."""
    assert set(tensors) == set(expected), f"{where}: keys {sorted(tensors)} != {sorted(expected)}"
    needed = 0
    for name, value in tensors.items():
        global_shape, offsets, local = local_chunk(value)
        assert global_shape == tuple(expected[name].shape), (
            f"{where}: {name} has global shape {global_shape}"
        )
        want = expected[name][
            tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
        ]
        if local.dtype.is_floating_point:
            assert not torch.isnan(local).any(), (
                f"{where}: {name} still holds NaN at offsets {offsets}"
            )
        else:
            assert not (local == INT_SENTINEL).any(), (
                f"{where}: {name} was not filled at offsets {offsets}"
            )
        assert torch.equal(local, want), (
            f"{where}: {name} at offsets {offsets} differs from the reference"
        )
        needed += local.numel() * local.element_size()
    return needed


def _save(saved: Saved, layout: str, world: int, root: Path) -> None:
    import torch.distributed as dist

    path = root / f"{saved.name}-{layout}"
    if saved.source.startswith("uneven"):
        state = uneven_state(saved.source.removeprefix("uneven-"), world, reference_uneven(saved.seed))
        sp.save(state, path, layout=layout, max_shard_size=MAX_SHARD)
        return
    net = parallelize(seeded_net(saved.seed), saved.source.replace("-async", ""), world)
    # what the saving ranks hold must be the reference, or the matrix proves nothing
    check_filled(net.state_dict(), reference_net(saved.seed), f"{saved.name} before saving")
    if saved.source == "ddp":
        sp.save(
            net.state_dict(),
            path,
            layout=layout,
            max_shard_size=MAX_SHARD,
            process_group=dist.group.WORLD,
        )
    elif saved.source == "fsdp2-async":
        sp.async_save(net.state_dict(), path, layout=layout, max_shard_size=MAX_SHARD).result()
    else:
        sp.save(net.state_dict(), path, layout=layout, max_shard_size=MAX_SHARD)


def _load(cell: Cell, root: Path) -> dict[str, int]:
    import torch.distributed as dist

    expected = reference(cell.saved.source, cell.saved.seed)
    where = f"rank {dist.get_rank()}, {cell.id}"
    if cell.target.startswith("uneven"):
        target: Any = uneven_state(cell.target.removeprefix("uneven-"), cell.world, None)
        tensors = target
    else:
        target = parallelize(Net(), cell.target, cell.world)
        tensors = target.state_dict()
    blank_(tensors)
    result = sp.load_into(target, root / cell.ckpt, process_group=dist.group.WORLD)
    if not cell.target.startswith("uneven"):
        tensors = target.state_dict()
    needed = check_filled(tensors, expected, where)
    return {"bytes_read": result.bytes_read, "bytes_needed": needed}


def _attempt(fn: Callable[[], dict[str, int] | None]) -> dict[str, Any]:
    try:
        return {"ok": True, **(fn() or {})}
    except Exception:
        return {"ok": False, "error": traceback.format_exc()}


def balance_state() -> dict[str, torch.Tensor]:
    """A replicated state of many tensors of uneven sizes (16-240 kB)."""
    gen = torch.Generator().manual_seed(99)
    return {f"layer{i}.weight": torch.randn(64, 64 + 16 * i, generator=gen) for i in range(40)}


def matrix_worker(rank: int, world: int, root: str, phase: str) -> None:
    import torch.distributed as dist

    base = Path(root)
    expected_world, saves, wanted = PHASES[phase]
    assert world == expected_world
    outcomes: dict[str, dict[str, Any]] = {}
    if saves:
        for saved in SAVES:
            if saved.world == world:
                for layout in LAYOUTS:
                    outcomes[f"save:{saved.name}-{layout}"] = _attempt(
                        lambda s=saved, lay=layout: _save(s, lay, world, base)
                    )
    if phase == "save2":

        def save_replicated() -> None:
            sp.save(
                balance_state(),
                base / BALANCE_CKPT,
                layout="chunked",
                process_group=dist.group.WORLD,
            )

        outcomes[f"save:{BALANCE_CKPT}"] = _attempt(save_replicated)
    for cell in CELLS:
        if wanted(cell):
            outcomes[cell.id] = _attempt(lambda c=cell: _load(c, base))
    results = base / "results"
    results.mkdir(exist_ok=True)
    (results / f"{phase}-rank{rank}.json").write_text(json.dumps(outcomes))


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def matrix(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, dict[int, dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("matrix")
    for phase, (world, _, _) in PHASES.items():
        run_ranks(matrix_worker, world, str(root), phase, timeout=600)
    outcomes: dict[str, dict[int, dict[str, Any]]] = {}
    for report in sorted((root / "results").glob("*.json")):
        rank = int(re.search(r"rank(\d+)", report.name).group(1))  # type: ignore[union-attr]
        for cell, outcome in json.loads(report.read_text()).items():
            outcomes.setdefault(cell, {})[rank] = outcome
    return root, outcomes


def _assert_ok(
    outcomes: dict[str, dict[int, dict[str, Any]]], key: str, world: int
) -> dict[int, dict[str, Any]]:
    per_rank = outcomes.get(key)
    assert per_rank is not None, f"{key} was never run"
    assert sorted(per_rank) == list(range(world)), f"{key}: outcomes from ranks {sorted(per_rank)}"
    failed = {r: o["error"] for r, o in per_rank.items() if not o["ok"]}
    assert not failed, "\n".join(f"--- rank {r}:\n{e}" for r, e in sorted(failed.items()))
    return per_rank


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_resharded_load(matrix, cell: Cell) -> None:
    _, outcomes = matrix
    _assert_ok(outcomes, f"save:{cell.ckpt}", cell.saved.world)
    per_rank = _assert_ok(outcomes, cell.id, cell.world)
    for rank, o in per_rank.items():
        assert o["bytes_needed"] > 0
        assert o["bytes_needed"] <= o["bytes_read"] <= 1.1 * o["bytes_needed"], (rank, o)


def _layout_files(path: Path, saved: Saved, layout: str) -> None:
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    manifest = json.loads((path / "shardpoint.json").read_text())
    assert manifest["world_size"] == saved.world
    assert manifest["layout"] == layout
    if layout == "hf":
        if len(names) == 1:
            assert names == ["model.safetensors"]
        else:
            assert names == [
                f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)
            ]
            index = json.loads((path / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"]) == set(reference(saved.source, saved.seed))
    else:
        matches = [re.match(r"^model-r(\d{5})-\d{5}\.safetensors$", n) for n in names]
        assert all(matches), names
        writers = {int(m.group(1)) for m in matches if m}
        assert writers <= set(range(saved.world)) and len(writers) > 1, names


@pytest.mark.parametrize(("saved", "layout"), CKPTS, ids=[f"{s.name}-{lay}" for s, lay in CKPTS])
def test_load_in_one_plain_process(matrix, saved: Saved, layout: str) -> None:
    root, outcomes = matrix
    _assert_ok(outcomes, f"save:{saved.name}-{layout}", saved.world)
    path = root / f"{saved.name}-{layout}"
    _layout_files(path, saved, layout)
    expected = reference(saved.source, saved.seed)

    loaded = sp.load(path)
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype
        assert torch.equal(loaded[name], value), name

    if _family(saved.source) == "net":
        target: Any = Net()
        tensors = target.state_dict()
    else:
        target = {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in UNEVEN.items()}
        tensors = target
    blank_(tensors)
    result = sp.load_into(target, path)
    assert result.ok
    needed = check_filled(
        target.state_dict() if isinstance(target, nn.Module) else target, expected, "one process"
    )
    assert result.bytes_read == needed


def test_replicated_state_is_written_once_balanced_across_ranks(matrix) -> None:
    root, outcomes = matrix
    _assert_ok(outcomes, f"save:{BALANCE_CKPT}", 2)
    path = root / BALANCE_CKPT
    per_rank = [0, 0]
    for name in os.listdir(path):
        m = re.match(r"^model-r(\d{5})-\d{5}\.safetensors$", name)
        if m:
            per_rank[int(m.group(1))] += os.path.getsize(path / name)
    state_bytes = sum(t.numel() * t.element_size() for t in balance_state().values())
    assert min(per_rank) > 0
    assert max(per_rank) <= 1.10 * min(per_rank), per_rank
    # each tensor once: the files hold the state plus headers, not twice the state
    assert state_bytes <= sum(per_rank) <= 1.02 * state_bytes, (per_rank, state_bytes)
    loaded = sp.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in balance_state().items())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshard_4_to_2_reads_only_needed_bytes(matrix, layout: str) -> None:
    _, outcomes = matrix
    full = sum(t.numel() * t.element_size() for t in reference_net(0).values())
    for target in ("fsdp2", "tp"):
        cell = next(
            c
            for c in CELLS
            if c.ckpt == f"fsdp2-ws4-{layout}" and c.target == target and c.world == 2
        )
        for rank, o in _assert_ok(outcomes, cell.id, 2).items():
            assert o["bytes_needed"] < 0.75 * full  # a real shard, not the whole model
            assert o["bytes_read"] <= 1.1 * o["bytes_needed"], (cell.id, rank, o)


# ----------------------------------------------------------------------------- failures


class InjectedWriteError(OSError):
    pass


def failure_worker(rank: int, world: int, root: str) -> None:
    import shardpoint._distributed.save as collective

    base = Path(root)
    good = parallelize(seeded_net(21), "fsdp2", world).state_dict()
    sp.save(good, base / "previous")
    sp.save(good, base / "same", layout="hf")
    newer = parallelize(seeded_net(22), "fsdp2", world).state_dict()

    real_write = collective.write_files

    def failing_write(*args: Any, **kwargs: Any) -> Any:
        raise InjectedWriteError(28, "No space left on device (injected on rank 1)")

    if rank == 1:
        collective.write_files = failing_write  # type: ignore[assignment]
    try:
        attempts: list[tuple[str, Callable[[], Any]]] = [
            ("chunked", lambda: sp.save(newer, base / "new-chunked")),
            ("hf", lambda: sp.save(newer, base / "new-hf", layout="hf")),
            ("hf overwrite", lambda: sp.save(newer, base / "same", layout="hf", overwrite=True)),
            ("chunked overwrite", lambda: sp.save(newer, base / "previous", overwrite=True)),
            ("async", lambda: sp.async_save(newer, base / "new-async").result()),
        ]
        for what, attempt in attempts:
            with pytest.raises(sp.DistributedCheckpointError) as caught:
                attempt()
            message = str(caught.value)
            assert re.search(r"\bon rank 1\b", message), (what, message)
            assert "injected on rank 1" in message, (what, message)
            assert "rank 0" not in message, (what, message)
            assert sorted(caught.value.failed_ranks) == [1], (what, caught.value.failed_ranks)
            assert isinstance(caught.value, sp.CheckpointError)
    finally:
        collective.write_files = real_write  # type: ignore[assignment]
    import torch.distributed as dist

    dist.barrier()  # the coordinator has cleaned up its temporary directory
    for name in ("new-chunked", "new-hf", "new-async"):
        assert not (base / name).exists(), name
    leftovers = [n for n in os.listdir(base) if ".tmp-" in n]
    assert not leftovers, leftovers
    # the earlier checkpoints are intact and still load, sharded, on every rank
    for name in ("previous", "same"):
        target = parallelize(Net(), "fsdp2", world)
        blank_(target.state_dict())
        sp.load_into(target, base / name, process_group=dist.group.WORLD)
        check_filled(target.state_dict(), reference_net(21), f"rank {rank}, {name}")
    # and the very next save works
    sp.save(newer, base / "after")

    # a Partial DTensor (a pending reduction) is refused, not saved as if its addends were it
    from torch.distributed.tensor import DTensor, Partial

    pending = DTensor.from_local(torch.full((2, 3), float(rank + 1)), _mesh((world,)), [Partial()])
    with pytest.raises(sp.DistributedCheckpointError, match=r"tensor 'pending' has placements \(Partial"):
        sp.save({"pending": pending}, base / "partial")


def test_a_rank_failing_its_write_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    run_ranks(failure_worker, 2, str(tmp_path), timeout=180)
    assert sorted(os.listdir(tmp_path)) == ["after", "previous", "same"]
    for name, seed in (("previous", 21), ("same", 21), ("after", 22)):
        loaded = sp.load(tmp_path / name)
        expected = reference_net(seed)
        assert set(loaded) == set(expected)
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()), name


@contextlib.contextmanager
def _recorded(module: Any, name: str, log: list[Any], what: Callable[..., Any]) -> Iterator[None]:
    """Replace ``module.name`` by a wrapper that appends ``what(*args, **kwargs)`` to ``log``
    and calls the real one."""
    real = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        log.append(what(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, real)


def threads_worker(rank: int, world: int, root: str) -> None:
    """Each rank writes and reads with its share of this machine's CPUs: every rank here is
    on one host."""
    import torch.distributed as dist

    import shardpoint._io.files as local_files
    import shardpoint._read as reading
    from shardpoint._distributed import save as collective

    asked: list[int] = []
    segments: list[int | None] = []
    with (
        _recorded(collective, "writer_threads", asked, lambda ranks_here=1: ranks_here),
        _recorded(collective, "write_files", segments, lambda *a, **kw: kw.get("segment")),
    ):
        model = parallelize(Net(), "fsdp2", world)
        for layout in ("chunked", "hf"):
            sp.save(model.state_dict(), Path(root) / layout, layout=layout)
    assert asked == [world, world], f"rank {rank}: writer_threads asked for {asked}"
    # and write in the collective save's segments (256 KiB), not the single-process 2 MiB:
    # chunked, its data files, then its chunk table (a save by rules); hf, its part
    assert segments == [256 << 10] * 3, f"rank {rank}: segments {segments}"

    # A collective load reads with this machine's share too.
    asked_read: list[int] = []
    ran_with: list[int | None] = []
    with (
        _recorded(local_files, "reader_threads", asked_read, lambda processes_here=1, **kw: processes_here),
        # the reads' thread count: none named by the call, so the byte source's (the
        # checkpoint's local files, given the load's share of the machine)
        _recorded(reading, "run_reads", ran_with, lambda tasks, source, **kw: kw.get("threads")),
    ):
        target = parallelize(Net(), "fsdp2", world)
        assert sp.load_into(target, Path(root) / "chunked", process_group=dist.group.WORLD).ok
    assert ran_with == [None], f"rank {rank}: reads named a thread count: {ran_with}"
    assert asked_read == [world], f"rank {rank}: reader_threads asked for {asked_read}"


def test_ranks_sharing_a_machine_split_its_reader_and_writer_threads_and_write_small_segments(tmp_path: Path) -> None:
    from shardpoint._verify import verify_checkpoint

    run_ranks(threads_worker, 3, str(tmp_path), timeout=120)
    for layout in ("chunked", "hf"):
        assert verify_checkpoint(tmp_path / layout).ok, layout


# ----------------------------------------------------------------------------- transformers


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def _llama(seed: int) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config()).eval()


def llama_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = _llama(5)
    mesh = _mesh((world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    assert type(state["model.embed_tokens.weight"]).__name__ == "DTensor"
    assert (
        local_chunk(state["lm_head.weight"])[2].data_ptr()
        == local_chunk(state["model.embed_tokens.weight"])[2].data_ptr()
    )
    sp.save(state, Path(root) / "llama", layout="hf", max_shard_size="100kB")
    from shardpoint.integrations.transformers import save_pretrained

    try:  # one process's writer: refused, naming the collective way (it raised deep inside transformers)
        save_pretrained(model, Path(root) / f"one-process-{rank}")
        raise AssertionError("save_pretrained of an FSDP2 model was not refused")
    except sp.InvalidStateError as exc:
        assert "this one is sharded across ranks ('model.embed_tokens.weight' is a DTensor: FSDP2 or tensor " \
               "parallel). Save it from every rank with sp.save(model.state_dict(), path, layout='hf')" in str(exc)

    # and back into a fresh FSDP2 model: every shard filled, the tied pair still one tensor
    fresh = _llama(6)
    for layer in fresh.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    blank_(fresh.state_dict())
    result = sp.load_into(fresh, Path(root) / "llama", process_group=torch.distributed.group.WORLD)
    assert result.ok, result
    full = {name: value.detach().clone() for name, value in _llama(5).state_dict().items()}
    check_filled(fresh.state_dict(), full, f"rank {rank}, FSDP2 llama")
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def test_fsdp2_hf_save_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    run_ranks(llama_worker, 2, str(tmp_path), timeout=240)
    path = tmp_path / "llama"
    names = sorted(os.listdir(path))
    assert "model.safetensors.index.json" in names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"

    transformers.logging.set_verbosity_error()
    _llama_config().save_pretrained(path)  # as a training script would, next to the weights
    original = _llama(5)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    loaded.eval()
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 7, 42, 3, 127, 0, 64, 99, 5, 18]])
    with torch.no_grad():
        want = original(ids).logits
        got = loaded(ids).logits
    assert torch.equal(got, want)
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
