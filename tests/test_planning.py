"""Pure planning: replicated chunks cut into row pieces and balanced over the ranks."""

from __future__ import annotations

import math
import re

import pytest

import shardpoint as sp
from shardpoint._planning.chunks import ChunkPlan, assign_writers, split_replicated


def _plan(name: str, shape: tuple[int, ...], itemsize: int = 4) -> ChunkPlan:
    return ChunkPlan("model", name, "F32", shape, (0,) * len(shape), shape, math.prod(shape) * itemsize)


def _writer_bytes(plans: list[list[ChunkPlan]]) -> list[int]:
    owner = assign_writers(plans)
    load = [0] * len(plans)
    sizes = {p.ident: p.nbytes for ranks in plans for p in ranks}
    for ident, rank in owner.items():
        load[rank] += sizes[ident]
    return load


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_dominant_replicated_tensor_is_shared_by_every_rank(world):
    # A DDP-replicated Llama-ish state: the embedding alone is ~half of it.
    state = [_plan("embed", (32000, 512)), *(_plan(f"layer{i}", (512, 512)) for i in range(40)), _plan("norm", (512,))]
    whole = _writer_bytes([list(state) for _ in range(world)])
    assert max(whole) > 1.5 * min(whole)  # whole tensors cannot balance this state
    split = split_replicated([list(state) for _ in range(world)], min_piece_bytes=1 << 20)
    load = _writer_bytes(split)
    assert sum(load) == sum(p.nbytes for p in state)
    assert max(load) <= 1.10 * min(load), load


def test_pieces_tile_each_tensor_exactly_once():
    embed = _plan("embed", (10, 3))
    split = split_replicated([[embed], [embed], [embed], [embed]], min_piece_bytes=1)
    rows = sorted((p.offsets[0], p.shape[0]) for ranks in split for p in ranks)
    assert rows == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert all(len(ranks) == 1 for ranks in split)  # piece j lives only with holder j
    assert [p.nbytes for ranks in split for p in ranks] == [36, 36, 24, 24]


def test_sharded_small_and_one_row_chunks_stay_whole():
    shard0 = ChunkPlan("model", "w", "F32", (4, 4), (0, 0), (2, 4), 32)
    shard1 = ChunkPlan("model", "w", "F32", (4, 4), (2, 0), (2, 4), 32)
    row = _plan("bias", (1, 4096))
    split = split_replicated([[shard0, row], [shard1, row]], min_piece_bytes=1)
    assert split == [[shard0, row], [shard1, row]]


def test_no_piece_below_the_minimum_size():
    big = _plan("e", (1000, 1024))  # 4 MB
    assert split_replicated([[big], [big]], min_piece_bytes=4 << 20) == [[big], [big]]  # tiny: whole
    pieces = split_replicated([[big] for _ in range(4)], min_piece_bytes=1 << 20)
    assert [len(r) for r in pieces] == [1, 1, 1, 0]  # 3 pieces of >= 1 MiB, not 4 smaller ones
    assert sum(p.nbytes for r in pieces for p in r) == big.nbytes


def test_more_holders_than_rows():
    tiny = _plan("t", (2, 1000))
    split = split_replicated([[tiny] for _ in range(4)], min_piece_bytes=1)
    assert [[(p.offsets, p.shape) for p in ranks] for ranks in split] == [
        [((0, 0), (1, 1000))], [((1, 0), (1, 1000))], [], []
    ]


@pytest.mark.parametrize(
    ("pool", "machine", "pinned_to", "ranks_here", "expected", "expected_cached"),
    [
        ("writer", 8, 8, 1, 4, None),  # one process: up to 4
        ("writer", 2, 2, 1, 2, None),  # no more writers than cores
        ("writer", 8, 8, 4, 2, None),  # 4 ranks share 8 cores
        ("writer", 8, 8, 16, 1, None),  # never fewer than 1
        ("writer", 64, 3, 8, 3, None),  # a rank pinned to 3 cores: those are its share
        ("reader", 8, 8, 1, 8, 8),  # one process: up to 8 from the disk, the cores from the cache
        ("reader", 2, 2, 1, 8, 2),  # four times the cores: cold reads wait on the disk
        ("reader", 2, 2, 2, 4, 2),  # 2 ranks on 2 cores: 4 each, 2 each from the cache
        ("reader", 2, 2, 4, 2, 2),  # 4 ranks on 2 cores: never fewer than 2
        ("reader", 64, 1, 8, 4, 2),  # a rank pinned to 1 core: four times that (at least 2 cached)
        ("reader", 16, 16, 1, 16, 16),  # 16 cores: never fewer than the cores
        ("reader", 4, 4, 1, 8, 4),  # 4 cores: at most 8 waiting on a disk, 4 copying
    ],
)
def test_io_threads_follow_this_process_share_of_the_cpus(
    monkeypatch, use_options, pool, machine, pinned_to, ranks_here, expected, expected_cached
):
    import shardpoint as sp
    from shardpoint._io import threads as io_threads

    threads = io_threads.writer_threads if pool == "writer" else io_threads.reader_threads
    option = "write_threads" if pool == "writer" else "read_threads"
    use_options(io=sp.IOOptions(**{option: 0}))  # 0: follow the CPUs, whatever the environment seeds
    monkeypatch.setattr(io_threads.os, "cpu_count", lambda: machine)
    monkeypatch.setattr(io_threads, "cpu_count", lambda: pinned_to)
    assert threads(ranks_here) == expected
    if expected_cached is not None:
        assert io_threads.reader_threads(ranks_here, cached=True) == expected_cached
    use_options(io=sp.IOOptions(**{option: 7}))  # the option, when set, wins
    assert threads(ranks_here) == 7
    if expected_cached is not None:
        assert io_threads.reader_threads(ranks_here, cached=True) == 7


@pytest.mark.parametrize(
    ("total_mib", "limit_mib", "threads", "expected_mib"),
    [
        (2048, 5120, 2, 1024),  # 1 rank, 2 writer threads: two files of ~1 GiB
        (2048, 5120, 1, 5120),  # one thread: the shard limit as it is
        (2048, 512, 2, 512),  # the shard limit is already smaller
        (200, 5120, 2, 5120),  # small: never split below the floor
        (600, 5120, 4, 256),  # 4 threads' shares are under the floor: the floor
    ],
)
def test_a_rank_splits_its_bytes_so_each_writer_thread_has_a_file(total_mib, limit_mib, threads, expected_mib):
    from shardpoint._distributed.save import _rank_file_bytes

    assert _rank_file_bytes(total_mib << 20, limit_mib << 20, threads) == expected_mib << 20


def test_chunked_rank_files_follow_the_writer_threads(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from shardpoint._distributed import save

    monkeypatch.setattr(save, "SPLIT_FLOOR_BYTES", 1 << 10)
    tensors = {f"w{i}": torch.arange(i * 1000, i * 1000 + 512, dtype=torch.float32) for i in range(4)}
    plans = [
        ChunkPlan("model", n, "F32", (512,), (0,), (512,), 2048) for n in tensors
    ]
    local = {("model", n): t for n, t in tensors.items()}
    from shardpoint._io.writes import write_files

    def write(planned):
        return write_files(str(tmp_path), planned, durable=False, threads=2, segment=256 << 10)

    refs, files = save._write_chunked(plans, local, 3, 5 << 30, {}, 2, write)
    assert sorted(files) == ["model-r00003-00001.safetensors", "model-r00003-00002.safetensors"]
    read = {}
    for name in files:
        read.update(load_file(tmp_path / name))
    assert sorted(read) == ["w0", "w1", "w2", "w3"]
    for n, t in tensors.items():
        assert torch.equal(read[n], t)
    assert {ref.file for _c, _n, ref in refs} == set(files)


# ------------------------------------------------------------------ the file plan (pure)


def _specs() -> dict:
    from shardpoint._format.safetensors import TensorSpec

    return {
        "a": TensorSpec("a", "F32", (2,), 8),
        "b": TensorSpec("b", "BF16", (2, 3), 12),
        "big": TensorSpec("big", "F32", (10,), 40),
    }


def test_the_hf_file_plan_of_a_small_state_is_exactly_this():
    from shardpoint._planning.files import hf_index, plan_hf_files

    files = plan_hf_files("model", _specs(), 24, {"format": "pt"})
    assert [(f.name, f.size, f.offsets) for f in files] == [
        ("model-00001-of-00002.safetensors", 144, {"big": 104}),  # oversized: alone, first
        ("model-00002-of-00002.safetensors", 172, {"a": 152, "b": 160}),
    ]
    assert files[0].header == (
        b"`\x00\x00\x00\x00\x00\x00\x00"
        b'{"__metadata__":{"format":"pt"},"big":{"dtype":"F32","shape":[10],"data_offsets":[0,40]}}       '
    )
    assert files[1].header == (
        b"\x90\x00\x00\x00\x00\x00\x00\x00"
        b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[8,20]}}  '
    )
    assert hf_index(files, 60, 15) == (
        b'{\n  "metadata": {\n    "total_parameters": 15,\n    "total_size": 60\n  },\n  "weight_map": {\n'
        b'    "a": "model-00002-of-00002.safetensors",\n    "b": "model-00002-of-00002.safetensors",\n'
        b'    "big": "model-00001-of-00002.safetensors"\n  }\n}\n'
    )
    one = plan_hf_files("optim", _specs(), 1 << 30, {})
    assert [(f.name, f.size, f.offsets) for f in one] == [
        ("optim.safetensors", 260, {"a": 200, "b": 208, "big": 220})
    ]
    assert hf_index(one, 60, 15) is None


def test_the_hf_file_plan_counts_the_sizes_and_storages_it_is_given():
    from shardpoint._planning.files import plan_hf_files

    # 'a' counted as its whole storage (36 bytes) and shared with 'b': both in one file.
    files = plan_hf_files("model", _specs(), 40, {}, sizes=[("a", 36), ("b", 12), ("big", 40)],
                          storage={"a": 1, "b": 1})
    assert [(f.name, list(f.offsets)) for f in files] == [
        ("model-00001-of-00002.safetensors", ["a", "b"]),
        ("model-00002-of-00002.safetensors", ["big"]),
    ]


def test_the_chunked_file_plan_of_a_rank_is_exactly_this():
    from shardpoint._planning.files import plan_rank_files

    files = plan_rank_files("model", 2, list(_specs().values()), 24, {})
    assert [(f.name, f.size, f.offsets) for f in files] == [
        ("model-r00002-00001.safetensors", 128, {"big": 88}),
        ("model-r00002-00002.safetensors", 164, {"a": 144, "b": 152}),
    ]
    assert files[0].header == (
        b"P\x00\x00\x00\x00\x00\x00\x00"
        b'{"__metadata__":{},"big":{"dtype":"F32","shape":[10],"data_offsets":[0,40]}}    '
    )


def test_a_file_one_rank_holds_whole_is_its_own_and_the_rest_are_shared():
    from shardpoint._distributed.save import HfFiles, _tensor_order
    from shardpoint._planning.files import PlannedFile

    whole = ChunkPlan("model", "a", "F32", (4,), (0,), (4,), 16)
    top = ChunkPlan("model", "b", "F32", (4,), (0,), (2,), 8)
    bottom = ChunkPlan("model", "b", "F32", (4,), (2,), (2,), 8)
    f1 = PlannedFile("model-00001-of-00002.safetensors", b"h1", 100, {"a": 84})
    f2 = PlannedFile("model-00002-of-00002.safetensors", b"h2", 90, {"b": 74})
    plan = HfFiles([("model", f1), ("model", f2)], {("model", "a"): (f1.name, 84), ("model", "b"): (f2.name, 74)},
                   {}, _tensor_order([[whole, top], [bottom]]))
    rank0, rank1 = plan.parts([[top], [whole, bottom]])
    assert rank0.whole == [] and rank0.placement == {("model", "b"): (f2.name, 74)}
    assert rank0.shared == {f2.name: (b"h2", 90)}  # the coordinator writes the shared header
    assert rank1.whole == [("model", f1)]  # header and all
    assert rank1.placement == {("model", "b"): (f2.name, 74)}
    assert rank1.shared == {f2.name: (b"", 90)}
    # One process holding whole tensors writes every file itself.
    (alone,) = plan.parts([[whole, ChunkPlan("model", "b", "F32", (4,), (0,), (4,), 16)]])
    assert alone.whole == [("model", f1), ("model", f2)] and alone.placement == {} and alone.shared == {}


def test_shard_offsets_agree_with_torch_for_every_shard_and_replicate_layout():
    """Our offsets of a DTensor's local chunk equal torch's own (its private
    ``_compute_local_shape_and_global_offset``, which takes the coordinate as an argument) on
    every coordinate of 1-D to 3-D meshes, even and uneven extents, empty chunks included;
    a placement we do not compute (``_StridedShard``) is left to torch (None)."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardpoint._distributed.group import shard_offsets

    checked = 0
    for mesh_shape in [(1,), (2,), (3,), (5,), (2, 2), (2, 3), (3, 2), (2, 2, 2)]:
        kinds = [Replicate(), Shard(0), Shard(1)]
        for placements in itertools.product(kinds, repeat=len(mesh_shape)):
            for global_shape in [(0, 3), (1, 7), (5, 4), (7, 3), (10, 1), (16, 9)]:
                for coord in itertools.product(*(range(k) for k in mesh_shape)):
                    _, expected = _compute_local_shape_and_global_offset(
                        global_shape, mesh_shape, list(coord), list(placements))
                    got = shard_offsets(global_shape, mesh_shape, coord, placements)
                    assert got == tuple(expected), (global_shape, mesh_shape, coord, placements)
                    checked += 1
    assert checked == 2358  # 3^d placements x 6 shapes x every coordinate, summed over the meshes
    assert shard_offsets((8, 2), (2, 2), (0, 1), [Shard(0), _StridedShard(0, split_factor=2)]) is None
    assert shard_offsets((8, 2), (2,), None, [Shard(0)]) is None


def test_chunks_that_overlap_and_leave_a_gap_are_refused() -> None:
    """Two ranks' chunks of 3 and 2 elements of a 5-element tensor, at 0 and 2: the count is
    whole, the tensor is not (element 4 is in no chunk); the save committed it."""
    from shardpoint._distributed.save import check_agreement
    from shardpoint._planning.chunks import ChunkPlan

    def chunk(at: int, n: int) -> ChunkPlan:
        return ChunkPlan("model", "w", "F32", (5,), (at,), (n,), 4 * n)

    check_agreement([[chunk(0, 3)], [chunk(3, 2)]])  # a tiling
    with pytest.raises(sp.InvalidStateError, match=re.escape(
            "tensor 'w' of component 'model': two ranks' chunks overlap (at [0] of shape [3] and at [2] of shape "
            "[2]) and leave a gap elsewhere")):
        check_agreement([[chunk(0, 3)], [chunk(2, 2)]])
