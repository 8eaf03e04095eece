"""The ``shardpoint`` command line: ``inspect`` and ``verify`` (and ``verify_checkpoint``)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._cli.main import main
from shardpoint._sizes import human_size
from shardpoint._verify import verify_checkpoint

FILES = [
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
]


def _state() -> dict[str, torch.Tensor]:
    # With max_shard_size=300: [embed 160 B] [layer.0.weight 256 B + bias 16 B] [head 80 B].
    return {
        "embed.weight": torch.arange(40, dtype=torch.float32).reshape(10, 4),
        "layer.0.weight": torch.ones(8, 8),
        "layer.0.bias": torch.zeros(8, dtype=torch.bfloat16),
        "head.weight": torch.full((4, 10), 0.5, dtype=torch.float16),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    state = _state()
    state["lm_head.weight"] = state["embed.weight"]  # tied: stored once, listed as an alias
    path = tmp_path / "ckpt"
    sp.save(state, path, max_shard_size=300, metadata={"step": 7})
    assert sorted(os.listdir(path)) == [*FILES, "model.safetensors.index.json", "shardpoint.json"]
    return path


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    from huggingface_hub import save_torch_state_dict

    path = tmp_path / "hf"
    path.mkdir()
    save_torch_state_dict(_state(), path, max_shard_size=300)
    assert sorted(os.listdir(path)) == [*FILES, "model.safetensors.index.json"]
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tensor_start(path: Path, key: str) -> int:
    """Absolute offset of ``key``'s first data byte in a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return 8 + length + int(header[key]["data_offsets"][0])


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# ---------------------------------------------------------------------------- inspect


def test_inspect_shows_format_files_dtypes_and_tensors(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "inspect", ckpt)
    assert (code, err) == (0, "")
    sizes = [os.path.getsize(ckpt / f) for f in FILES]
    lines = out.splitlines()
    assert lines[:7] == [
        f"path        {ckpt}",
        f"format      shardpoint (format version 3, saved by shardpoint {sp.__version__})",
        "layout      hf",
        "world size  1",
        lines[4],  # the save time, checked below
        "components  model: 4 tensors (+1 alias), 512 B in 3 files",
        'metadata    {"step": 7}',
    ]
    assert lines[4].startswith("saved       20") and lines[4].endswith("+00:00")
    assert lines[7:] == [
        "",
        f"files: 3 files, {human_size(sum(sizes))}",
        f"  {FILES[0]}  {human_size(sizes[0])}",
        f"  {FILES[1]}  {human_size(sizes[1])}",
        f"  {FILES[2]}  {human_size(sizes[2])}",
        "",
        "dtypes: 4 tensors, 512 B",
        "  F32   2 tensors  416 B",
        "  F16   1 tensor   80 B",
        "  BF16  1 tensor   16 B",
        "",
        "tensors: 5 of 5",
        "  NAME            DTYPE  SHAPE    SIZE   FILE",
        "  embed.weight    F32    [10, 4]  160 B  model-00001-of-00003.safetensors",
        "  layer.0.weight  F32    [8, 8]   256 B  model-00002-of-00003.safetensors",
        "  layer.0.bias    BF16   [8]      16 B   model-00002-of-00003.safetensors",
        "  head.weight     F16    [4, 10]  80 B   model-00003-of-00003.safetensors",
        "  lm_head.weight  F32    [10, 4]  160 B  = embed.weight (tied)",
    ]


def test_inspect_json_has_exact_values(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", ckpt, "--json")
    assert code == 0
    doc = json.loads(out)
    manifest = json.loads((ckpt / "shardpoint.json").read_text())
    assert doc["path"] == str(ckpt)
    assert doc["format"] == "shardpoint"
    assert doc["format_version"] == 3
    assert doc["library_version"] == sp.__version__
    assert doc["created"] == manifest["created"]
    assert doc["save_id"] == manifest["save_id"]
    assert (doc["layout"], doc["world_size"], doc["flat"]) == ("hf", 1, True)
    assert doc["metadata"] == {"step": 7}
    assert doc["files"] == [{"name": f, "size": os.path.getsize(ckpt / f)} for f in FILES]
    assert doc["total_size"] == sum(os.path.getsize(ckpt / f) for f in FILES)
    assert doc["components"] == {
        "model": {"tensors": 4, "aliases": 1, "bytes": 512, "files": FILES}
    }
    assert (doc["tensor_count"], doc["alias_count"], doc["tensor_bytes"]) == (4, 1, 512)
    assert doc["dtypes"] == {
        "F32": {"tensors": 2, "bytes": 416},
        "F16": {"tensors": 1, "bytes": 80},
        "BF16": {"tensors": 1, "bytes": 16},
    }
    assert list(doc["dtypes"]) == ["F32", "F16", "BF16"]  # largest first
    assert doc["tensors_matched"] == 5
    assert [t["name"] for t in doc["tensors"]] == [
        "embed.weight",
        "layer.0.weight",
        "layer.0.bias",
        "head.weight",
        "lm_head.weight",
    ]
    assert doc["tensors"][2] == {
        "name": "layer.0.bias",
        "component": "model",
        "dtype": "BF16",
        "shape": [8],
        "bytes": 16,
        "files": [FILES[1]],
        "chunks": 1,
        "alias_of": None,
    }
    assert doc["tensors"][4]["alias_of"] == "embed.weight"


@pytest.mark.parametrize(
    ("pattern", "names"),
    [
        ("layer", ["layer.0.weight", "layer.0.bias"]),  # substring
        ("*.weight", ["embed.weight", "layer.0.weight", "head.weight", "lm_head.weight"]),  # glob
        ("layer.?.bias", ["layer.0.bias"]),
        ("nothing-like-this", []),
        ("^[e-l]*[!s].weight$", ["embed.weight", "layer.0.weight", "head.weight", "lm_head.weight"]),
        ("^[!e]*.weight", ["layer.0.weight", "head.weight", "lm_head.weight"]),
        ("**********Z", []),  # a regular expression of ten .* backtracked for minutes
    ],
)
def test_inspect_filter(
    ckpt: Path, capsys: pytest.CaptureFixture[str], pattern: str, names: list[str]
) -> None:
    code, out, _ = run(capsys, "inspect", ckpt, "--json", "--filter", pattern)
    assert code == 0
    doc = json.loads(out)
    assert [t["name"] for t in doc["tensors"]] == names
    assert doc["tensors_matched"] == len(names)
    assert doc["tensor_count"] == 4  # the summary is of the whole checkpoint


def test_inspect_filter_with_a_range_that_runs_backwards_is_a_usage_error(
        ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'[z-a]' ended in a raw re.error traceback, exit 1, nothing on stdout with --json."""
    code, out, _ = run(capsys, "inspect", ckpt, "--json", "--filter", "[z-a]")
    assert code == 2
    assert json.loads(out)["message"] == "--filter '[z-a]': the range z-a runs backwards; write a-z"


def test_inspect_limit_and_filter_text(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", ckpt, "--filter", "*.weight", "--limit", "1")
    assert code == 0
    tail = out.splitlines()[-4:]
    assert tail == [
        "tensors: 1 of 4 matching '*.weight' (5 in all)",
        "  NAME          DTYPE  SHAPE    SIZE   FILE",
        "  embed.weight  F32    [10, 4]  160 B  model-00001-of-00003.safetensors",
        "  ... 3 more (--limit 0 lists all)",
    ]
    code, out, _ = run(capsys, "inspect", ckpt, "--filter", "zzz")
    assert out.splitlines()[-2:] == [
        "tensors: 0 of 0 matching 'zzz' (5 in all)",
        "  no tensor name matches 'zzz'",
    ]


def test_inspect_nested_state_names_components(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sp.save({"model": model, "optim": opt}, tmp_path / "nested")
    code, out, _ = run(capsys, "inspect", tmp_path / "nested")
    assert code == 0
    assert "components  model: 2 tensors, 60 B in 1 file" in out.splitlines()
    assert "            optim: 6 tensors, 128 B in 1 file" in out.splitlines()
    assert (
        "  model/weight                   F32    [3, 4]  48 B  model.safetensors"
        in out.splitlines()
    )
    code, out, _ = run(
        capsys, "inspect", tmp_path / "nested", "--json", "--filter", "optim/*exp_avg$"
    )
    doc = json.loads(out)
    assert doc["flat"] is False
    assert [(t["component"], t["name"]) for t in doc["tensors"]] == [
        ("optim", "state.weight.exp_avg"),
        ("optim", "state.bias.exp_avg"),
    ]


def test_inspect_hf_dir(hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", hf_dir)
    assert code == 0
    lines = out.splitlines()
    assert lines[1:6] == [
        "format      hf-index (Hugging Face shards + index; no shardpoint manifest)",
        "layout      hf",
        "world size  -",
        "saved       -",
        "components  model: 4 tensors, 512 B in 3 files",
    ]
    assert "  F32   2 tensors  416 B" in lines
    doc = json.loads(run(capsys, "inspect", hf_dir, "--json")[1])
    assert doc["format"] == "hf-index"
    assert doc["files"] == [{"name": f, "size": os.path.getsize(hf_dir / f)} for f in FILES]
    assert (doc["world_size"], doc["created"], doc["library_version"]) == (None, None, None)


def test_inspect_errors_are_one_line_exit_2(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    assert run(capsys, "inspect", missing) == (
        2,
        "",
        f"shardpoint: error: {missing} does not exist; nothing to load\n",
    )
    (ckpt / "shardpoint.json").write_text("{not json")
    code, out, err = run(capsys, "inspect", ckpt)
    assert (code, out) == (2, "")
    assert err.startswith(f"shardpoint: error: {ckpt / 'shardpoint.json'} is not valid JSON")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "--version") == (0, f"shardpoint {sp.__version__}\n", "")
    code, _, err = run(capsys)
    assert code == 2 and "shardpoint: error: the following arguments are required: COMMAND" in err
    code, _, err = run(capsys, "inspect", "x", "--limit", "-1")
    assert code == 2 and "argument --limit: '-1' is negative" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "inspect" in out and "verify" in out


# ---------------------------------------------------------------------------- verify


def test_verify_whole_checkpoint(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "verify", ckpt) == (
        0,
        f"{ckpt}: shardpoint checkpoint, 3 data files\n"
        "OK: whole (3 files, 4 stored tensors); crc32c matched for 512 B\n",
        "",
    )
    assert run(capsys, "verify", ckpt, "--quick") == (
        0,
        f"{ckpt}: shardpoint checkpoint, 3 data files\n"
        "OK: structure is whole (3 files, 4 stored tensors); crc32c skipped (--quick)\n",
        "",
    )
    code, out, _ = run(capsys, "verify", ckpt, "--json")
    assert code == 0
    assert json.loads(out) == {
        "path": str(ckpt),
        "format": "shardpoint",
        "ok": True,
        "problems": [],
        "warnings": [],
        "notes": [],
        "unchecked": [],
        "files_checked": 3,
        "tensors_checked": 4,
        "bytes_checked": 512,
        "checksums": True,
    }


def test_verify_checkpoint_api(ckpt: Path) -> None:
    report = verify_checkpoint(ckpt)
    assert report.ok
    assert (report.kind, report.files_checked, report.tensors_checked) == ("shardpoint", 3, 4)
    assert (report.bytes_checked, report.checksums, report.problems, report.warnings) == (
        512,
        True,
        [],
        [],
    )
    quick = verify_checkpoint(ckpt, checksums=False)
    assert (quick.ok, quick.bytes_checked, quick.checksums) == (True, 0, False)


def test_verify_flipped_data_byte(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = ckpt / FILES[1]
    flip_byte(shard, tensor_start(shard, "layer.0.bias") + 3)
    code, out, err = run(capsys, "verify", ckpt)
    assert (code, err) == (1, "")
    lines = out.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith(
        f"problem: {shard}, tensor 'layer.0.bias': crc32c of the stored bytes is 0x"
    )
    assert "the file is damaged" in lines[1]
    assert lines[2] == "FAILED: 1 problem; the checkpoint is not whole"
    # Structure is intact: --quick does not read the bytes.
    assert run(capsys, "verify", ckpt, "--quick")[0] == 0


def test_verify_streams_in_small_segments(
    ckpt: Path, use_options: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # 24-byte reads: every tensor spans several reads, and the crc must carry across them.
    use_options(io=sp.IOOptions(segment_bytes=24))
    assert verify_checkpoint(ckpt).ok
    shard = ckpt / FILES[1]
    flip_byte(shard, tensor_start(shard, "layer.0.weight") + 200)
    report = verify_checkpoint(ckpt)
    assert report.bytes_checked == 512
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"{shard}, tensor 'layer.0.weight': crc32c")


def test_verify_truncated_and_deleted_lists_every_problem(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, last = ckpt / FILES[0], ckpt / FILES[2]
    size = os.path.getsize(first)
    os.truncate(first, size - 10)
    last.unlink()
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1
    assert out.splitlines() == [
        f"{ckpt}: shardpoint checkpoint, 3 data files",
        f"problem: {first} is {size - 10} bytes but the manifest recorded {size}; the file is "
        "truncated, padded or from another save; it holds tensor 'embed.weight'",
        f"problem: {last} is missing: the checkpoint lists it but it is not there; the checkpoint "
        "is incomplete (copy the file back or load another checkpoint); it holds tensor 'head.weight'",
        "FAILED: 2 problems; the checkpoint is not whole",
    ]
    doc = json.loads(run(capsys, "verify", ckpt, "--json")[1])
    assert doc["ok"] is False
    assert len(doc["problems"]) == 2
    assert (doc["files_checked"], doc["tensors_checked"], doc["bytes_checked"]) == (3, 2, 272)


def test_verify_damaged_index_and_manifest(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = ckpt / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["head.weight"] = FILES[0]
    index.write_text(json.dumps(doc))
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1
    assert (
        f"problem: {index}: weight_map disagrees with the manifest on tensor 'head.weight'; the index is damaged"
        in out.splitlines()
    )
    index.unlink()
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1
    assert f"problem: {index} is missing; component 'model' is split over 3 files" in out
    (ckpt / "shardpoint.json").write_text("[]")
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1
    assert (
        f"problem: {ckpt / 'shardpoint.json'} must be a JSON object, found list; the file is damaged"
        in out.splitlines()
    )


def test_verify_lists_other_files_and_warns_on_stray_data(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ckpt / "notes.txt").write_text("hello")
    (ckpt / "model-00004-of-00004.safetensors").write_bytes(b"stale")
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 0
    assert out.splitlines()[1:3] == [
        f"warning: {ckpt / 'model-00004-of-00004.safetensors'} looks like checkpoint data but is "
        "not part of the checkpoint (the manifest does not list it); load ignores it. If it is "
        "left from another save, move it away",
        "not checked (not checkpoint data): notes.txt",
    ]
    doc = json.loads(run(capsys, "verify", ckpt, "--json")[1])
    assert (doc["ok"], doc["unchecked"], len(doc["warnings"])) == (True, ["notes.txt"], 1)


def test_verify_uncommitted_tmp_dir(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = tmp_path / ".ckpt.tmp-0123"
    shutil.copytree(ckpt, tmp)
    code, out, _ = run(capsys, "verify", tmp)
    assert code == 1
    assert "is the temporary directory of a save that never committed" in out


def test_verify_missing_path_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert run(capsys, "verify", missing) == (
        2,
        "",
        f"shardpoint: error: {missing} does not exist; nothing to verify\n",
    )
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, "verify", tmp_path / "empty")
    assert (code, out) == (2, "")
    assert err.startswith(f"shardpoint: error: {tmp_path / 'empty'} is not a checkpoint")


def test_verify_exits_2_where_it_judged_nothing(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad argument and a store that cannot be reached exited 1, "damaged": a script that
    re-downloads or deletes on 1 would act on a checkpoint that was never read."""
    code, out, err = run(capsys, "verify", ckpt, "--storage-options", '{"a": 1}')
    assert (code, out) == (2, "") and err.startswith(
        f"shardpoint: error: storage_options were given but {ckpt} is a local path"), err
    code, out, err = run(capsys, "verify", "s3://no-such-bucket/x", "--storage-options",
                         '{"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}')
    assert (code, out) == (2, "") and err.startswith("shardpoint: error: listing s3://no-such-bucket/x failed"), err


def test_verify_hf_dir_structure_only(hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "verify", hf_dir) == (
        0,
        f"{hf_dir}: hf-index checkpoint, 3 data files (foreign: no crc32c recorded, structure checked only)\n"
        "OK: structure is whole (3 files, 4 stored tensors); stored bytes not checked (no crc32c)\n",
        "",
    )
    report = verify_checkpoint(hf_dir)
    assert (report.ok, report.kind, report.checksums, report.bytes_checked) == (
        True,
        "hf-index",
        False,
        0,
    )
    assert (report.files_checked, report.tensors_checked) == (3, 4)


def test_verify_hf_dir_damaged(hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (hf_dir / FILES[1]).unlink()
    os.truncate(hf_dir / FILES[0], os.path.getsize(hf_dir / FILES[0]) - 1)
    code, out, _ = run(capsys, "verify", hf_dir)
    assert code == 1
    lines = out.splitlines()
    assert lines[1].startswith(
        f"problem: {hf_dir / FILES[0]}, tensor 'embed.weight': data_offsets [0, 160] run past the end"
    )
    assert lines[2].startswith(f"problem: {hf_dir / FILES[1]} is missing")
    assert lines[2].endswith("it holds tensors 'layer.0.weight', 'layer.0.bias'")
    assert lines[3] == "FAILED: 2 problems; the checkpoint is not whole"


def test_verify_single_safetensors_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file(_state(), str(path), metadata={"format": "pt"})
    code, out, _ = run(capsys, "verify", path)
    assert code == 0
    assert (
        out.splitlines()[-1]
        == "OK: structure is whole (1 file, 4 stored tensors); stored bytes not checked (no crc32c)"
    )
    os.truncate(path, os.path.getsize(path) - 2)
    code, out, _ = run(capsys, "verify", path)
    assert code == 1
    assert out.splitlines()[1] == (
        f"problem: {path}, tensor 'head.weight': data_offsets [432, 512] run past the end of "
        "the data (510 bytes); the file is truncated or damaged"
    )


_RANK_SCRIPT = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def work(rank, path, init):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import shardpoint as sp
    mesh = init_device_mesh("cpu", (2,))
    w = distribute_tensor(torch.arange(64, dtype=torch.float32).reshape(8, 8), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(8), mesh, [Replicate()])
    sp.save({"w": w, "b": b}, path, process_group=dist.group.WORLD)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(work, args=(sys.argv[1], sys.argv[2]), nprocs=2, start_method="fork")
"""


@pytest.mark.slow
def test_chunked_checkpoint_from_two_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "save_two_ranks.py"
    script.write_text(_RANK_SCRIPT)
    path = tmp_path / "dist"
    subprocess.run(
        [sys.executable, str(script), str(path), f"file://{tmp_path / 'rendezvous'}"],
        env=_script_env(),
        check=True,
        timeout=240,
    )
    rank1 = path / "model-r00001-00001.safetensors"
    assert rank1.exists()
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0
    assert "layout      chunked" in out.splitlines()
    assert "world size  2" in out.splitlines()
    assert "  w     F32    [8, 8]  256 B  2 chunks in 2 files" in out.splitlines()
    assert run(capsys, "verify", path)[:2] == (
        0,
        f"{path}: shardpoint checkpoint, 2 data files\n"
        "OK: whole (2 files, 3 stored tensors); crc32c matched for 288 B\n",
    )
    flip_byte(rank1, tensor_start(rank1, "w") + 5)
    code, out, _ = run(capsys, "verify", path)
    assert code == 1
    assert out.splitlines()[1].startswith(
        f"problem: {rank1}, tensor 'w': crc32c of the stored bytes"
    )


# ---------------------------------------------------------------------------- as a process


def _script_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(sp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def _run_process(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*argv], capture_output=True, text=True, env=_script_env(), check=False, timeout=240
    )


def test_python_dash_m_shardpoint_runs_the_command(ckpt: Path) -> None:
    """For an environment whose scripts directory is not on PATH."""
    result = _run_process(sys.executable, "-m", "shardpoint", "--version")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"shardpoint {sp.__version__}\n", "")
    result = _run_process(sys.executable, "-m", "shardpoint", "verify", str(ckpt))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (f"{ckpt}: shardpoint checkpoint, 3 data files\n"
                             "OK: whole (3 files, 4 stored tensors); crc32c matched for 512 B\n"), result.stdout


def test_command_runs_as_a_process(ckpt: Path) -> None:
    flip_byte(ckpt / FILES[0], tensor_start(ckpt / FILES[0], "embed.weight"))
    result = _run_process(sys.executable, "-m", "shardpoint._cli", "verify", str(ckpt))
    assert (result.returncode, result.stderr) == (1, "")
    assert f"problem: {ckpt / FILES[0]}, tensor 'embed.weight': crc32c" in result.stdout

    result = _run_process(
        sys.executable, "-m", "shardpoint._cli.main", "inspect", str(ckpt / "nope")
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"shardpoint: error: {ckpt / 'nope'} does not exist; nothing to load\n"


def test_console_script(ckpt: Path) -> None:
    script = Path(sys.executable).with_name("shardpoint")
    if not script.exists():
        pytest.skip("the shardpoint console script is not installed (pip install -e .)")
    result = _run_process(str(script), "verify", str(ckpt))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"{ckpt}: shardpoint checkpoint, 3 data files\n"
        "OK: whole (3 files, 4 stored tensors); crc32c matched for 512 B\n"
    )


# ------------------------------------------------- folders people actually have (issue 19)

TRAINER_FILES = {
    "training_args.bin": None,
    "optimizer.pt": None,
    "scheduler.pt": None,
    "rng_state.pth": None,
    "trainer_state.json": "{}",
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "special_tokens_map.json": "{}",
    "README.md": "# model",
    ".gitattributes": "*.safetensors filter=lfs",
}


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def _add_companions(path: Path) -> None:
    for name, text in TRAINER_FILES.items():
        if text is None:
            torch.save({"lr": torch.tensor(0.1)}, path / name)
        else:
            (path / name).write_text(text)


@pytest.mark.parametrize("maker", ["sp.save+config", "integrations.save_pretrained", "model.save_pretrained"])
def test_verify_of_model_folders_warns_about_nothing_and_lists_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], maker: str
) -> None:
    model = _tiny_llama()
    path = tmp_path / "out"
    if maker == "sp.save+config":
        sp.save(model.state_dict(), path, max_shard_size="20kB")
        model.config.save_pretrained(path)
    elif maker == "integrations.save_pretrained":
        from shardpoint.integrations.transformers import save_pretrained

        save_pretrained(model, path, max_shard_size="20kB")
    else:
        model.save_pretrained(path, max_shard_size="20kB")
    _add_companions(path)
    capsys.readouterr()  # transformers' own progress bar
    code, out, err = run(capsys, "verify", path)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith(("warning", "problem"))], out
    generation = ["generation_config.json"] if maker != "sp.save+config" else []
    unchecked = sorted([*TRAINER_FILES, "config.json", *generation])
    assert lines[-2] == f"not checked (not checkpoint data): {', '.join(unchecked)}"
    assert lines[-1].startswith("OK: ")
    doc = json.loads(run(capsys, "verify", path, "--json")[1])
    assert (doc["ok"], doc["warnings"], doc["unchecked"]) == (True, [], unchecked)
    inspected = json.loads(run(capsys, "inspect", path, "--json")[1])
    assert inspected["unchecked"] == unchecked


def test_verify_stale_shard_missing_from_hf_index_warns(
    hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(hf_dir / FILES[2], hf_dir / "model-00004-of-00004.safetensors")
    (hf_dir / "config.json").write_text("{}")
    code, out, _ = run(capsys, "verify", hf_dir)
    assert code == 0
    assert out.splitlines()[1:3] == [
        f"warning: {hf_dir / 'model-00004-of-00004.safetensors'} looks like checkpoint data but "
        "is not part of the checkpoint (the index does not list it); load ignores it. If it is "
        "left from another save, move it away",
        "not checked (not checkpoint data): config.json",
    ]


def _bin_shards(path: Path) -> dict[str, torch.Tensor]:
    """A Hugging Face .bin sharded folder (as transformers 4 wrote them) + trainer files."""
    state = _state()
    path.mkdir()
    shards = {"pytorch_model-00001-of-00002.bin": ["embed.weight", "layer.0.weight"],
              "pytorch_model-00002-of-00002.bin": ["layer.0.bias", "head.weight"]}
    for fname, keys in shards.items():
        torch.save({k: state[k] for k in keys}, path / fname)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": 512}, "weight_map": weight_map})
    )
    (path / "config.json").write_text("{}")
    torch.save({"lr": 0.1}, path / "training_args.bin")
    return state


def _record_offset(path: Path, suffix: str) -> int:
    """Where the bytes of the zip record whose name ends with ``suffix`` start."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    start = info.header_offset
    name_len, extra_len = struct.unpack("<HH", raw[start + 26 : start + 30])
    return start + 30 + name_len + extra_len


def test_verify_and_inspect_bin_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bin"
    _bin_shards(path)
    sizes = [os.path.getsize(path / f"pytorch_model-0000{i}-of-00002.bin") for i in (1, 2)]
    code, out, err = run(capsys, "verify", path)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{path}: hf-bin checkpoint, 2 data files (torch.save files)"
    assert lines[1].startswith("note: torch.save files: each one's zip records checked against their CRC-32")
    assert lines[2] == "not checked (not checkpoint data): config.json, training_args.bin"
    assert lines[3].startswith("OK: whole (2 files, 4 stored tensors); the zip archives' CRC-32 matched for ")
    assert len(lines) == 4
    report = verify_checkpoint(path)
    assert (report.kind, report.checksums, report.tensors_checked) == ("hf-bin", True, 4)
    assert 512 < report.bytes_checked < sum(sizes)  # tensor data + the pickles, not headers

    doc = json.loads(run(capsys, "inspect", path, "--json")[1])
    assert (doc["format"], doc["tensor_count"], doc["tensor_bytes"]) == ("hf-bin", 4, 512)
    assert doc["unchecked"] == ["config.json", "training_args.bin"]
    assert [(t["name"], t["dtype"], t["shape"], t["files"]) for t in doc["tensors"]][:2] == [
        ("embed.weight", "F32", [10, 4], ["pytorch_model-00001-of-00002.bin"]),
        ("layer.0.weight", "F32", [8, 8], ["pytorch_model-00001-of-00002.bin"]),
    ]
    assert doc["files"] == [
        {"name": f"pytorch_model-0000{i}-of-00002.bin", "size": sizes[i - 1]} for i in (1, 2)
    ]

    # A flipped byte of tensor data fails its record's CRC-32; --quick reads structure only.
    shard = path / "pytorch_model-00001-of-00002.bin"
    flip_byte(shard, _record_offset(shard, "data/0") + 5)
    code, out, _ = run(capsys, "verify", path)
    assert code == 1
    problem = next(line for line in out.splitlines() if line.startswith("problem:"))
    assert problem.startswith(f"problem: {shard}: record ") and "does not match its CRC-32" in problem
    code, out, _ = run(capsys, "verify", path, "--quick")
    assert code == 0
    assert out.splitlines()[1] == (
        "note: torch.save files: tensors read with torch.load(weights_only=True) (structure "
        "only, never a full unpickle)"
    )
    assert out.splitlines()[-1] == "OK: structure is whole (2 files, 4 stored tensors); CRC-32 skipped (--quick)"
    (path / "pytorch_model-00002-of-00002.bin").unlink()
    code, out, _ = run(capsys, "verify", path, "--quick")
    assert code == 1
    assert (
        f"problem: {path / 'pytorch_model-00002-of-00002.bin'} is missing: the index lists it but "
        "it is not there; the checkpoint is incomplete (copy the file back or load another "
        "checkpoint); it holds tensors 'layer.0.bias', 'head.weight'"
    ) in out.splitlines()


def test_verify_and_inspect_single_pytorch_model_bin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trainer-out"
    path.mkdir()
    torch.save(_state(), path / "pytorch_model.bin")
    _add_companions(path)
    code, out, _ = run(capsys, "verify", path)
    assert code == 0
    assert out.splitlines()[0] == f"{path}: torch-save checkpoint, 1 data file (torch.save files)"
    assert out.splitlines()[-1].startswith("OK: whole (1 file, 4 stored tensors)")
    assert run(capsys, "verify", path / "pytorch_model.bin")[0] == 0
    doc = json.loads(run(capsys, "inspect", path, "--json")[1])
    assert (doc["format"], doc["tensor_count"]) == ("torch-save", 4)
    assert doc["unchecked"] == sorted(TRAINER_FILES)
    # sp.load reads the same folder (pytorch_model.bin, not training_args.bin).
    assert torch.equal(sp.load(path)["layer.0.weight"], torch.ones(8, 8))


def test_verify_bin_never_unpickles_beyond_weights_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "obj": _Custom()}, path)
    code, out, err = run(capsys, "verify", path)
    assert (code, out) == (2, "")
    # torch's reason (the global it refused), not its preamble advising weights_only=False
    assert err.startswith(f"shardpoint: error: {path} cannot be loaded with weights_only=True (Unsupported global: "
                          f"GLOBAL {_Custom.__module__}._Custom was not an allowed global by default): reading it")
    assert "it is refused" in err and "weights_only` set to `False`" not in err
    assert _Custom.unpickled == 0
    code, out, _ = run(capsys, "verify", path, "--json")
    assert (code, json.loads(out)["error"]) == (2, "UnsafePickleError")


class _Custom:
    unpickled = 0

    def __setstate__(self, state: object) -> None:
        type(self).unpickled += 1


# ------------------------------------------------------------------------ --json failures


def test_json_failures_print_an_error_object(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    for argv, code, error, message, path in [
        (["inspect", missing], 2, "CheckpointNotFoundError", f"{missing} does not exist; nothing to load", str(missing)),
        (["verify", missing], 2, "CheckpointNotFoundError", f"{missing} does not exist; nothing to verify", str(missing)),
        (["diff", ckpt, missing], 2, "CheckpointNotFoundError", f"{missing} does not exist; nothing to read", str(missing)),
    ]:
        got, out, err = run(capsys, *argv, "--json")
        assert got == code
        assert json.loads(out) == {"error": error, "message": message, "path": path}
        assert err == f"shardpoint: error: {message}\n"
    (ckpt / "shardpoint.json").write_text("{not json")
    got, out, _ = run(capsys, "inspect", ckpt, "--json")
    doc = json.loads(out)
    assert got == 2
    assert sorted(doc) == ["error", "message", "path"]
    assert (doc["error"], doc["path"]) == ("CorruptCheckpointError", str(ckpt))
    assert doc["message"].startswith(f"{ckpt / 'shardpoint.json'} is not valid JSON")
    got, out, _ = run(capsys, "verify", ckpt, "--json")  # verify judges it: a damaged checkpoint
    assert (got, json.loads(out)["ok"]) == (1, False)
    got, out, err = run(capsys, "inspect", "--json", "--limit", "x", ckpt)
    assert got == 2
    assert json.loads(out) == {
        "error": "UsageError",
        "message": "argument --limit: 'x' is not a whole number",
        "path": None,
    }
    assert err.endswith("shardpoint inspect: error: argument --limit: 'x' is not a whole number\n")
    got, out, _ = run(capsys, "inspect", ckpt)  # no --json: nothing on stdout
    assert (got, out) == (2, "")


# ------------------------------------------------------------------------------- --filter


def test_filter_matches_anywhere_in_transformers_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _tiny_llama()
    sp.save(model.state_dict(), tmp_path / "llama")

    def names(pattern: str) -> list[str]:
        code, out, _ = run(capsys, "inspect", tmp_path / "llama", "--json", "--filter", pattern)
        assert code == 0
        return [t["name"] for t in json.loads(out)["tensors"]]

    assert "model.layers.0.mlp.up_proj.weight" in names("layers.*.weight")
    assert len(names("layers.*.weight")) == 18  # 9 weights per layer, 2 layers
    assert names("layers.1.*up_proj") == ["model.layers.1.mlp.up_proj.weight"]
    assert names("^lm_head") == ["lm_head.weight"]
    assert names("^head") == []
    assert names("norm.weight$") == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    assert names("layers.[!0].self_attn.q") == ["model.layers.1.self_attn.q_proj.weight"]
    code, help_text, _ = run(capsys, "inspect", "--help")
    assert code == 0
    assert "'layers.*.weight' matches model.layers.0.mlp.up_proj.weight" in " ".join(help_text.split())


# ------------------------------------------------------------ terminal escapes (issue 23)

EVIL = ["\x1b]0;pwned\x07", "\x1b[2J", "ok\rFAKE", "\u202e", "x\nOK: whole", "\x9b31m", "a\u2066b"]


def test_no_control_character_reaches_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardpoint._cli.output import has_control

    root = tmp_path / "dir\x1b[31m"
    root.mkdir()
    a, b = root / "a\x1b]0;t\x07", root / "b"
    sp.save({n: torch.ones(2) for n in EVIL}, a, metadata={"note": "\x1b[32mall good\x1b[0m"})
    sp.save({n: torch.zeros(2) for n in EVIL}, b)
    (a / "stray\x1b[2J.safetensors").write_bytes(b"x")
    (a / "cfg\x07.json").write_text("{}")
    runs = [
        ("inspect", a), ("verify", a), ("diff", a, b), ("convert", a, root / "c\x1b[2J"),
        ("verify", root / "missing\x1b]0;x\x07"), ("inspect", root / "\u202emissing"),
        ("diff", a, root / "gone\rFAKE"), ("convert", root / "gone\x1b[2J", root / "d"),
        ("inspect", a, "--limit", "\x1b[2J"),
    ]
    for argv in runs:
        code, out, err = run(capsys, *argv)
        assert code in (0, 1, 2) and (out or err), argv
        assert not has_control(out, allow="\n"), (argv, out)
        assert not has_control(err, allow="\n"), (argv, err)
        assert "\x1b" not in out + err and "\r" not in out + err
    out = run(capsys, "inspect", a)[1]
    assert "  x\\nOK: whole  " in out and "  ok\\rFAKE  " in out and "  \\u202e  " in out
    assert "  \\x1b]0;pwned\\x07  " in out
    assert run(capsys, "verify", a)[1].splitlines()[-1] == (
        "OK: whole (1 file, 7 stored tensors); crc32c matched for 56 B"
    )
    # --json stays exact: the names come back as they are.
    doc = json.loads(run(capsys, "inspect", a, "--json")[1])
    assert [t["name"] for t in doc["tensors"]] == EVIL
    assert doc["metadata"] == {"note": "\x1b[32mall good\x1b[0m"}
    diff_doc = json.loads(run(capsys, "diff", a, b, "--json")[1])
    assert [t["key"] for t in diff_doc["tensors"]] == EVIL


def test_printable_escapes_every_kind_of_control() -> None:
    from shardpoint._cli.output import printable

    assert printable("\x00\x1f\x7f\x85\x9f") == "\\x00\\x1f\\x7f\\x85\\x9f"
    assert printable("a\u200bb\u2028c\u2029d\ufeff") == "a\\u200bb\\u2028c\\u2029d\\ufeff"
    assert printable("\ud800") == "\\ud800"  # a lone surrogate (JSON "\ud800")
    assert printable("\U000e0001") == "\\U000e0001"  # a tag character (format)
    assert printable("caf\u00e9 \u6a21\u578b \U0001f600 \u00a0") == "caf\u00e9 \u6a21\u578b \U0001f600 \u00a0"


def test_progress_bar_descriptions_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    from shardpoint._progress import byte_progress

    with byte_progress(10, "verifying evil\x1b[2J\u202e", True) as advance:
        assert advance is not None
        advance(10)
    err = capsys.readouterr().err
    assert "verifying evil\\x1b[2J\\u202e" in err
    assert "\x1b[2J" not in err and "\u202e" not in err


def test_pt_beside_safetensors_is_read_from_the_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    save_file(_state(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "model.pt").write_bytes(b"\x80 not read: a pickle that would fail")
    note = (
        f"{tmp_path / 'model.safetensors'} instead of {tmp_path / 'model.pt'}: load reads the "
        ".safetensors file of the same stem beside it (same tensors, no unpickling)"
    )
    code, out, _ = run(capsys, "verify", tmp_path / "model.pt")
    assert code == 0
    assert out.splitlines()[1] == f"note: verified {note}"
    assert out.splitlines()[-1].startswith("OK: structure is whole (1 file, 4 stored tensors)")
    code, out, _ = run(capsys, "inspect", tmp_path / "model.pt")
    assert code == 0
    assert out.splitlines()[0] == f"note: showing {note}"
    doc = json.loads(run(capsys, "inspect", tmp_path / "model.pt", "--json")[1])
    assert (doc["format"], doc["tensor_count"], doc["notes"]) == ("hf-file", 4, [f"showing {note}"])


def test_ctrl_c_while_the_command_starts_exits_130_with_one_line(tmp_path: Path) -> None:
    """Importing torch takes a second or two: a Ctrl-C then printed a traceback from inside
    torch's import, or was swallowed by it and the command ran on."""
    import signal
    import time

    sp.save({"w": torch.ones(2)}, tmp_path / "ck")
    # The child says when the interpreter is up (a Ctrl-C before Python runs any code of ours
    # is Python's own); the command's entry point is what it imports next.
    entry = ("import sys; sys.stderr.write('>'); sys.stderr.flush(); from _shardpoint_cli import main; "
             "sys.argv[0] = 'shardpoint'; main()")
    for delay in (0.05, 0.3):
        proc = subprocess.Popen([sys.executable, "-c", entry, "verify", str(tmp_path / "ck")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None and proc.stderr.read(1) == ">"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out, err) == (130, "", "shardpoint: interrupted\n"), delay


def test_a_reader_that_leaves_early_does_not_turn_a_verdict_into_0(ckpt: Path) -> None:
    """`verify DAMAGED --json | head -2` exited 0 ("whole") once head had left: a script
    with pipefail read the damage as none."""
    shard = ckpt / FILES[1]
    flip_byte(shard, tensor_start(shard, "layer.0.bias") + 3)
    entry = "import sys; from _shardpoint_cli import main; sys.argv[0] = 'shardpoint'; main()"
    for extra in ([], ["--json"]):
        proc = subprocess.Popen([sys.executable, "-c", entry, "verify", str(ckpt), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.close()  # the reader is gone before the first line
        _, err = proc.communicate(timeout=120)
        assert (proc.returncode, err) == (1, ""), extra


def test_options_are_never_abbreviated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--js` worked as --json, but a usage error then printed no JSON (--json is looked
    for before parsing)."""
    code, out, err = run(capsys, "inspect", tmp_path, "--js")
    assert code == 2 and out == "" and err.endswith("shardpoint: error: unrecognized arguments: --js\n")


_UNREADABLE_CHILD = """
import os, sys
from shardpoint._cli.main import main
if os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)  # nobody: the file is root's, mode 600
sys.exit(main(["verify", sys.argv[1]]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user cannot read")
def test_verify_of_a_file_this_user_may_not_read_judges_nothing() -> None:
    """Permission denied on a data file was a problem: exit 1, "the checkpoint is not whole",
    with advice to check the disk and restore the file from a copy."""
    import tempfile

    base = tempfile.mkdtemp(prefix="sp-unreadable-")
    try:
        os.chmod(base, 0o755)
        ckpt = os.path.join(base, "ck")
        sp.save({"w": torch.ones(2)}, ckpt)
        os.chmod(ckpt, 0o755)
        for name in os.listdir(ckpt):
            os.chmod(os.path.join(ckpt, name), 0o644)
        os.chmod(os.path.join(ckpt, "model.safetensors"), 0o600)
        src = str(Path(sp.__file__).resolve().parents[1])
        done = subprocess.run([sys.executable, "-c", _UNREADABLE_CHILD, ckpt], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"})
        assert (done.returncode, done.stdout) == (2, ""), done
        assert done.stderr == (
            f"shardpoint: error: {ckpt}/model.safetensors: this user may not read it (permission denied); make it "
            "readable (chmod, chown) or verify as a user who may. Nothing was judged\n"
        )
    finally:
        shutil.rmtree(base)


def test_unreadable_sources_get_exit_2_and_advice_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole torch.save file whose keys cannot be components was "damaged" (exit 1); an
    empty path was blamed on the other argument; a legacy pickle was sent to
    --trust-pickle though convert reads it safely; --cache-dir=~/hub kept its ~."""
    torch.save({"best model": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "train.pt")
    code, out, err = run(capsys, "verify", tmp_path / "train.pt")
    assert (code, out) == (2, "")
    assert err == (
        f"shardpoint: error: {tmp_path / 'train.pt'} is read by torch.load(weights_only=True), but what it holds "
        "cannot be a checkpoint's state (top-level key 'best model' of the state cannot name a component: components "
        "become file prefixes, so use letters, digits, '_', '.' or '-' (not 'shardpoint' or 'latest')); read it "
        "with torch.load and save the parts you need with sp.save\n"
    )
    sp.save({"w": torch.ones(2)}, tmp_path / "ck")
    for argv in (("diff", tmp_path / "ck", ""), ("convert", "", tmp_path / "new")):
        code, out, _ = run(capsys, *argv, "--json")
        assert code == 2 and json.loads(out)["path"] == "", argv
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    code, _, err = run(capsys, "verify", tmp_path / "legacy.pt")
    assert code == 2 and "--trust-pickle`" not in err and "`shardpoint convert SRC DST` (it reads" in err
    assert run(capsys, "convert", tmp_path / "legacy.pt", tmp_path / "from-legacy")[0] == 0
    monkeypatch.setenv("HOME", str(tmp_path))
    code, _, err = run(capsys, "verify", "hf://org/name", "--cache-dir=~/hub")
    assert code == 2 and f"({tmp_path / 'hub'})" in err and "(~/hub)" not in err


def test_sigterm_unwinds_a_command_as_ctrl_c_does(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`kill` (or a scheduler's stop) mid-convert left the hidden temporary destination; now
    SIGTERM unwinds the command (its cleanup runs) and exits 143 with one line."""
    import signal
    import threading

    import shardpoint._cli.verify as verify_command

    sp.save({"w": torch.ones(2)}, tmp_path / "ck")

    def killed(*args: Any, **kwargs: Any) -> None:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # to this thread: handled before the next line
        raise AssertionError("SIGTERM did not stop the command")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(verify_command, "verify_checkpoint", killed)
    code, out, err = run(capsys, "verify", tmp_path / "ck")
    assert (code, out, err) == (143, "", "shardpoint: terminated\n")
    assert signal.getsignal(signal.SIGTERM) is before
    # With --json, stdout holds the error object (it was empty: jq read nothing, exit 0).
    code, out, err = run(capsys, "verify", tmp_path / "ck", "--json")
    assert (code, err) == (143, "shardpoint: terminated\n")
    assert json.loads(out) == {"error": "Terminated", "message": "terminated (SIGTERM) before it finished",
                               "path": str(tmp_path / "ck")}


def test_with_stderr_closed_stdout_holds_only_the_json_object(tmp_path: Path) -> None:
    """`2>&-`: print(file=sys.stderr) with sys.stderr None wrote the error line to stdout,
    after the --json object."""
    done = subprocess.run(f"{sys.executable} -m shardpoint inspect {tmp_path / 'missing'} --json 2>&-", shell=True,
                          capture_output=False, stdout=subprocess.PIPE, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"] == "CheckpointNotFoundError"


def test_running_out_of_memory_is_one_line_not_a_traceback(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's allocator fails with a RuntimeError (a 512 GiB tensor on a small machine)."""
    import shardpoint._cli.inspect as inspect_command

    def allocate(args: Any) -> int:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: not enough memory: "
                           "you tried to allocate 549755813888 bytes.")

    monkeypatch.setattr(inspect_command, "run", allocate)
    assert run(capsys, "inspect", ckpt) == (
        2, "", "shardpoint: error: this machine ran out of memory: [enforce fail at alloc_cpu.cpp:127] data. "
               "DefaultCPUAllocator: not enough memory: you tried to allocate 549755813888 bytes.; free memory, or "
               "work on a machine with more\n")

    def bug(args: Any) -> int:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(inspect_command, "run", bug)
    with pytest.raises(RuntimeError, match="a bug of ours"):  # its traceback is what a report needs
        run(capsys, "inspect", ckpt)


def test_convert_takes_the_dtype_names_the_api_takes(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype bfloat16 was 'invalid choice' while sp.convert(dtype='bfloat16') worked."""
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "bf16", "--dtype", "bfloat16")
    assert (code, err) == (0, "")
    assert {t.dtype for t in sp.load(tmp_path / "bf16").values() if t.is_floating_point()} == {torch.bfloat16}
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "int8", "--dtype", "int8")
    assert code == 2 and err.endswith(
        "shardpoint convert: error: argument --dtype: unknown dtype 'int8'; use bf16, fp16, fp32 or fp64\n"), err


@pytest.mark.parametrize("steps", ["3", "0", "-5"])
def test_demo_with_too_few_steps_is_a_usage_error(capsys: pytest.CaptureFixture[str], steps: str) -> None:
    """--steps 3 ended in an AssertionError, --steps 0 in an IndexError."""
    code, out, err = run(capsys, "demo", "--steps", steps)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (
        f"shardpoint demo: error: argument --steps: {steps} is fewer than 16: the demo saves every 4 steps and kills "
        "the run in its middle third, after a committed step")


def test_inspect_aligns_wide_names_and_shows_an_empty_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Columns were aligned by code points: a CJK name (two columns a character) pushed the
    rest of its row right; a tensor named '' was a blank cell."""
    from shardpoint._cli.output import cell_width

    sp.save({"模型权重": torch.zeros(2), "w": torch.zeros(2), "": torch.zeros(2)}, tmp_path / "wide")
    code, out, _ = run(capsys, "inspect", str(tmp_path / "wide"))
    assert code == 0
    rows = [line for line in out.splitlines() if line.endswith("model.safetensors")]
    assert len(rows) == 3 and any(row.startswith("  ''  ") for row in rows), rows
    assert len({cell_width(row[: row.index("F32")]) for row in rows}) == 1, rows
