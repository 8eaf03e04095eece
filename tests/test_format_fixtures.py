"""Checkpoints written by an older shardpoint still load bit for bit.

``tests/fixtures/format_v2/<name>/ckpt`` are checkpoints saved by shardpoint 0.1.0 (format
version 2) with ``tools/make_format_fixtures.py``; ``expected.json`` beside each holds what
loading it must give, computed from the script's recipe (not from the files): every tensor's
dtype, shape and sha256 of its raw bytes, every JSON / typed leaf, every container's type
(see the script's docstring for the paths). They are frozen: a failure here means the
current code reads an old checkpoint differently, not that the fixture needs regenerating.

Each fixture is loaded with ``sp.load`` and ``sp.load_into`` (freshly built targets; the
collective ones into plain full tensors, resharding 2 -> 1, and on 2 gloo ranks into
DTensors placed as saved and placed otherwise), verified (``verify_checkpoint`` and the
``shardpoint verify`` command), and its data files read with ``safetensors`` itself. The
fixture directory is checked to be left exactly as it was.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import http  # the enum class of the nested fixture: looked up only in modules already imported
import importlib.util
import json
import math
import pathlib
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpoint as sp
from _dist_utils import run_ranks
from shardpoint._cli.main import main as cli_main
from shardpoint._verify import verify_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "format_v2"
_spec = importlib.util.spec_from_file_location(
    "make_format_fixtures", Path(__file__).resolve().parent.parent / "tools" / "make_format_fixtures.py"
)
assert _spec is not None and _spec.loader is not None
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)
NAMES = ["hf_single", "hf_sharded", "nested", "chunked_2ranks", "chunked_2ranks_hf"]
FLAT = [n for n in NAMES if n != "nested"]
CHUNKED = ["chunked_2ranks", "chunked_2ranks_hf"]
assert http.HTTPStatus  # keep the import: `nested` holds an http.HTTPStatus member


def expected(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def ckpt(name: str) -> Path:
    return FIXTURES / name / "ckpt"


def _snapshot() -> dict[str, tuple[int, int, str]]:
    return {
        str(p.relative_to(FIXTURES)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(FIXTURES.rglob("*"))
        if p.is_file()
    } | {str(p.relative_to(FIXTURES)) + "/": (0, 0, "") for p in FIXTURES.rglob("*") if p.is_dir()}


@pytest.fixture(scope="module", autouse=True)
def fixtures_untouched() -> Iterator[None]:
    """Nothing in this file may write into the fixtures (no temp dirs, locks, caches)."""
    before = _snapshot()
    yield
    after = _snapshot()
    assert after == before, sorted(set(after.items()) ^ set(before.items()))


# ----------------------------------------------------------------------------- the comparison


def flatten(state: Any) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """(containers, tensors, leaves) of a loaded state, by path: the script's own
    ``flatten`` (the form ``expected.json`` was written in), each leaf with its type."""
    return _script.flatten(state, typed=True)


def same_literal(got: Any, want: Any) -> bool:
    """Equal and of the same JSON type; floats bit for bit (-0.0 is not 0.0)."""
    if isinstance(want, float):
        return type(got) is float and struct.pack("<d", got) == struct.pack("<d", want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same_literal(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same_literal, got, want))
    return type(got) is type(want) and got == want


def assert_matches(state: Any, want: Mapping[str, Any], where: str, *, typed_leaves: bool = True) -> None:
    containers, tensors, leaves = flatten(state)
    assert containers == want["containers"], f"{where}: containers differ"
    assert tensors.keys() == want["tensors"].keys(), (
        f"{where}: missing {sorted(want['tensors'].keys() - tensors.keys())}, "
        f"unexpected {sorted(tensors.keys() - want['tensors'].keys())}"
    )
    for path, desc in want["tensors"].items():
        assert tensors[path] == desc, f"{where}: tensor {path}: {tensors[path]} != {desc}"
    assert leaves.keys() == want["leaves"].keys(), f"{where}: leaves {sorted(leaves)} != {sorted(want['leaves'])}"
    for path, value in want["leaves"].items():
        kind, got = leaves[path]
        assert same_literal(got, value), f"{where}: leaf {path}: {got!r} ({kind.__name__}) != {value!r}"
        if typed_leaves and isinstance(value, dict) and "enum" in value:
            assert kind is http.HTTPStatus, f"{where}: leaf {path} came back as {kind}"


# ----------------------------------------------------------------------------- the files


def test_fixtures_are_frozen_format_v2_and_small() -> None:
    total = 0
    for name in NAMES:
        want = expected(name)
        manifest = json.loads((ckpt(name) / "shardpoint.json").read_text())
        assert manifest["format_version"] == 2 == want["format_version"], name
        files = {p.name: p for p in ckpt(name).iterdir()}
        assert sorted(files) == sorted(want["files"]), f"{name}: files added or removed"
        for fname, desc in want["files"].items():
            data = files[fname].read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (desc["size"], desc["sha256"]), (
                f"{name}/ckpt/{fname} was changed: the v2 fixtures are frozen"
            )
            total += len(data)
    assert total < 300_000


@pytest.mark.parametrize("name", NAMES)
def test_verify_and_inspect(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = verify_checkpoint(ckpt(name))
    assert report.ok, report.problems
    assert report.problems == [] and report.warnings == [], (report.problems, report.warnings)
    assert report.kind == "shardpoint" and report.checksums
    assert report.files_checked == sum(1 for f in expected(name)["files"] if f.endswith(".safetensors"))
    capsys.readouterr()
    assert cli_main(["verify", str(ckpt(name))]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert cli_main(["inspect", str(ckpt(name)), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["format_version"] == 2  # the version it read, whatever version it writes
    assert shown["layout"] == expected(name)["layout"]


def _manifest_tensors(name: str) -> dict[str, torch.Tensor]:
    """The flat fixtures' tensors assembled from the safetensors files alone, by the v2 rules:
    a chunk's ``key`` defaults to the tensor's name, ``offsets`` + ``shape`` to the whole."""
    from safetensors.torch import load_file

    manifest = json.loads((ckpt(name) / "shardpoint.json").read_text())
    files = {f: load_file(ckpt(name) / f) for f in manifest["files"]}
    (component,) = manifest["components"].values()
    out = {}
    for tname, desc in component["tensors"].items():
        chunks = desc["chunks"]
        first = files[chunks[0]["file"]][chunks[0].get("key", tname)]
        full = torch.empty(desc["shape"], dtype=first.dtype)
        for chunk in chunks:
            piece = files[chunk["file"]][chunk.get("key", tname)]
            offsets = chunk.get("offsets", [0] * full.dim())
            shape = chunk.get("shape", list(full.shape))
            assert list(piece.shape) == shape, (name, tname, chunk)
            full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))] = piece
        out[tname] = full
    for alias, target in component["aliases"].items():
        out[alias] = out[target]
    return out


@pytest.mark.parametrize("name", NAMES)
def test_safetensors_reads_the_data_files(name: str) -> None:
    from safetensors.torch import load_file

    files = sorted(ckpt(name).glob("*.safetensors"))
    assert files
    for path in files:
        assert load_file(path), path  # plain safetensors files, each with tensors
    if name in FLAT:
        # the tensors rebuilt from the files with the manifest's chunks match (hf layouts:
        # the files alone, each tensor whole in one of them, as transformers reads them)
        assert_matches(_manifest_tensors(name), expected(name), name)
    if expected(name)["layout"] == "hf" and name in FLAT:
        whole: dict[str, torch.Tensor] = {}
        for path in files:
            whole.update(load_file(path))
        aliases = expected(name)["aliases"].get("model", {})
        for alias, target in aliases.items():
            whole[alias] = whole[target]
        assert_matches(whole, expected(name), f"{name} via safetensors")
        index = ckpt(name) / "model.safetensors.index.json"
        if len(files) > 1:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert {k for k in whole if k not in aliases} == set(weight_map)
        else:
            assert not index.exists()


# ----------------------------------------------------------------------------- sp.load


@pytest.mark.parametrize("name", NAMES)
def test_load(name: str) -> None:
    state = sp.load(ckpt(name))
    assert_matches(state, expected(name), name)


@pytest.mark.parametrize("name", ["hf_sharded", "nested"])
def test_load_some_keys(name: str) -> None:
    keys = ["layers.0.attn.k.weight", "lm_head.weight"] if name == "hf_sharded" else ["model", "extra", "step"]
    want = expected(name)
    state = sp.load(ckpt(name), keys=keys)
    assert sorted(state) == sorted(keys)
    _, tensors, leaves = flatten(state)
    for path, desc in tensors.items():
        assert desc == want["tensors"][path], path
    for path, (_, value) in leaves.items():
        assert same_literal(value, want["leaves"][path]), path


@pytest.mark.parametrize("name", [n for n in FLAT if expected(n)["layout"] == "hf"])
def test_load_mmap(name: str) -> None:
    # (mmap=True refuses tensors saved in pieces, as chunked_2ranks's are: documented)
    state = sp.load(ckpt(name), mmap=True)
    assert_matches(state, expected(name), f"{name} (mmap)")


# ----------------------------------------------------------------------------- sp.load_into



def blank(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A target tensor holding no value of the fixture (NaN, or the dtype's max)."""
    if dtype.is_floating_point or dtype.is_complex:
        try:
            return torch.full(shape, math.nan, dtype=dtype)
        except RuntimeError:  # no NaN in this dtype
            pass
    if dtype == torch.bool:
        return torch.full(shape, True)
    raw = torch.full([*shape, dtype.itemsize], 0x7B, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def flat_target(want: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    target = {p: blank(d["shape"], getattr(torch, d["dtype"])) for p, d in want["tensors"].items()}
    for alias, stored in want["aliases"].get("model", {}).items():
        target[alias] = target[stored]  # tied in the target too, as in a model
    return target


@pytest.mark.parametrize("name", FLAT)
def test_load_into_plain_tensors(name: str) -> None:
    """Into freshly built full tensors; for the collective fixtures, 2 ranks -> 1."""
    want = expected(name)
    target = flat_target(want)
    result = sp.load_into(target, ckpt(name))
    assert result.ok and not result.missing_keys and not result.unexpected_keys and not result.mismatched_keys
    assert_matches(target, want, name)
    aliases = want["aliases"].get("model", {})
    for alias, stored in aliases.items():
        assert target[alias] is target[stored]


def nested_target() -> dict[str, Any]:
    """A fresh state as a training script builds it before resuming (other values everywhere)."""
    model = nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10, gamma=0.1)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "step": 0,
        "lr": 0.0,
        "run_name": "",
        "parent": "x",
        "done": True,
        "loss": 0.0,
        "best": 0.0,
        "worst": 0.0,
        "neg_zero": 0.0,
        "extra": {
            "ema": torch.full((2, 2), math.nan),
            "history": [0.0, 0.0, torch.zeros(3, dtype=torch.int64)],
            "shape": (0, 0),
            "by_epoch": {1: "", 2: ""},
            "nested": {"deep": {"x": torch.zeros(2, dtype=torch.bfloat16)}, "empty": {}, "none": []},
        },
        "cfg_path": pathlib.PurePosixPath("elsewhere"),
        "elapsed": datetime.timedelta(0),
        "started": datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2000, 1, 1),
        "status": http.HTTPStatus.OK,
        "args": argparse.Namespace(),
    }


def by_name(state: dict[str, Any]) -> dict[str, Any]:
    """The state as ``sp.load`` returns it: modules, optimizers (by parameter name) and
    schedulers as their state dicts."""
    out = dict(state)
    model, optim, sched = state["model"], state["optim"], state["sched"]
    out["model"] = dict(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    raw = optim.state_dict()
    out["optim"] = {
        "state": {names[i]: dict(s) for i, s in raw["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in raw["param_groups"]],
    }
    out["sched"] = sched.state_dict()
    return out


def test_load_into_nested_fresh_training_state() -> None:
    target = nested_target()
    result = sp.load_into(target, ckpt("nested"))
    assert result.ok, result
    assert_matches(by_name(target), expected("nested"), "nested (load_into)")
    # the loaded objects work: the optimizer steps the model it was loaded into
    model, optim = target["model"], target["optim"]
    assert optim.param_groups[0]["params"] == [model.weight, model.bias]
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    assert optim.state[model.weight]["step"].item() == 2


# ----------------------------------------------------------------------------- 2 gloo ranks


ALTERNATE = {"S0": "S1", "S1": "S0", "S2": "S0", "R": "S1", "plain": "plain"}
"""Another placement per saved one; a tensor with no such dim (1-D, empty rows) is replicated."""


def _place(code: str, shape: list[int]) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if code == "R":
        return Replicate()
    dim = int(code[1:])
    return Shard(dim) if dim < len(shape) else Replicate()


def ranks_worker(rank: int, world: int, fixtures: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for name in CHUNKED:
        want = json.loads((Path(fixtures) / name / "expected.json").read_text())
        assert want["mesh"] == [world]
        for how in ("as saved", "placed otherwise"):
            target: dict[str, Any] = {}
            for tname, code in want["placements"].items():
                desc = want["tensors"][tname]
                full = blank(desc["shape"], getattr(torch, desc["dtype"]))
                if how != "as saved":
                    code = ALTERNATE[code]
                target[tname] = full if code == "plain" else distribute_tensor(full, mesh, [_place(code, desc["shape"])])
            result = sp.load_into(target, Path(fixtures) / name / "ckpt", process_group=dist.group.WORLD)
            assert result.ok, result
            full_state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in target.items()}
            assert_matches(full_state, want, f"rank {rank}: {name} {how}")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_load_into_dtensors_on_2_ranks() -> None:
    run_ranks(ranks_worker, 2, str(FIXTURES), timeout=120)
