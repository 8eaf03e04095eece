"""The ``shardpoint`` command line: ``inspect`` and ``verify`` (and ``verify_checkpoint``)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

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
        f"format      shardpoint (format version 2, saved by shardpoint {sp.__version__})",
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
    assert doc["format_version"] == 2
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
        capsys, "inspect", tmp_path / "nested", "--json", "--filter", "optim/*exp_avg"
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
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 24-byte reads: every tensor spans several reads, and the crc must carry across them.
    monkeypatch.setenv("SHARDPOINT_IO_SEGMENT_BYTES", "24")
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


def test_verify_extra_files_are_warnings(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / "notes.txt").write_text("hello")
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 0
    assert out.splitlines()[1] == (
        f"warning: {ckpt / 'notes.txt'} is not part of the checkpoint (the manifest does not list it); "
        "load ignores it"
    )


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
