"""Write the on-disk format fixtures: small checkpoints saved by THIS shardpoint, kept in git.

    PYTHONPATH=src OMP_NUM_THREADS=1 python tools/make_format_fixtures.py [--out DIR] [--force]

writes ``tests/fixtures/format_v<N>/<name>/ckpt/`` (the checkpoint) and ``expected.json``
beside it, where ``N`` is the ``format_version`` this shardpoint writes. ``tests/
test_format_fixtures.py`` loads every fixture and compares it bit for bit with its
``expected.json``, so a later shardpoint keeps reading what this one wrote.

A version's fixtures are frozen once committed: run this script only to create the fixtures
of a NEW format version (it refuses an existing directory unless ``--force``).

Every value comes from a deterministic recipe (``torch.arange`` reshaped and cast, fixed
gradients, no randomness). ``expected.json`` is computed from that recipe in memory, never
read back from the saved files:

* ``containers``: path -> ``dict`` / ``list`` / ``tuple`` for every container of the state
  that ``sp.load`` returns (the root is ``""``);
* ``tensors``: path -> ``{dtype, shape, sha256}``, the sha256 of the full tensor's raw bytes
  (row-major, little-endian);
* ``leaves``: path -> the value: JSON literals for ``None`` / bool / int / str / finite float,
  else tagged: ``{"float": "nan"}``, ``{"path": [class, str]}``, ``{"timedelta": [d, s, us]}``,
  ``{"datetime": iso}``, ``{"date": iso}``, ``{"enum": ["module:qualname", member]}``,
  ``{"namespace": {...}}``;
* ``aliases`` (tied names, as the manifest records them), ``placements`` (chunked fixtures:
  how each tensor was sharded on the 2-rank mesh) and ``files`` (name -> size and sha256 of
  every file of the checkpoint, to tell a frozen fixture was not edited).

A path joins the keys from the root with ``/``: a str key as is, an int dict key as ``{i}``,
a list / tuple index as ``[i]``.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import hashlib
import http
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardpoint as sp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # _dist_utils.run_ranks: spawned gloo ranks

WORLD = 2  # the ranks of the collective fixtures
CHUNKED_MAX_SHARD = 256  # bytes: several files per rank (chunked) and an index (hf)
HF_MAX_SHARD = 512


# ----------------------------------------------------------------------------- recipes


def ramp(shape: tuple[int, ...], dtype: torch.dtype, *, start: float = 0, step: float = 1) -> torch.Tensor:
    """``start, start + step, ...`` in row-major order, cast to ``dtype`` (computed in float64)."""
    n = math.prod(shape)
    values = torch.arange(n, dtype=torch.float64) * step + start
    return values.reshape(shape).to(dtype)


def hf_single_state() -> dict[str, torch.Tensor]:
    """One file: every dtype the format names (but F8_E8M0 and the FNUZ ones), a 0-d tensor,
    empty tensors, non-finite floats and integers past 2^32."""
    return {
        "f32": ramp((3, 4), torch.float32, start=-1, step=0.25),
        "f32_special": torch.tensor(
            [math.nan, math.inf, -math.inf, -0.0, 1e-45, 3.4e38, -1.5, 2**-20], dtype=torch.float32
        ),
        "bf16": ramp((2, 5), torch.bfloat16, start=-0.5, step=0.1),
        "f16": ramp((2, 3), torch.float16, step=1 / 3),
        "f64": ramp((4,), torch.float64, start=1, step=1 / 7),
        "i64": ramp((8,), torch.int64, start=-3, step=1_000_000_007),
        "i32": ramp((2, 2), torch.int32, start=-2**31, step=2**30),
        "i16": ramp((3,), torch.int16, start=-300, step=250),
        "i8": ramp((5,), torch.int8, start=-128, step=60),
        "u8": ramp((2, 4), torch.uint8, step=33),
        "u16": ramp((3,), torch.uint16, step=30000),
        "u32": ramp((2,), torch.uint32, start=7, step=4_000_000_000),
        "u64": ramp((2,), torch.uint64, start=1, step=2**62),
        "bool": torch.tensor([[True, False, False], [False, True, True]]),
        "f8_e4m3": ramp((4,), torch.float8_e4m3fn, start=-2, step=1.25),
        "f8_e5m2": ramp((4,), torch.float8_e5m2, start=-2, step=1.25),
        "c64": torch.complex(ramp((3,), torch.float32, step=0.5), ramp((3,), torch.float32, start=-1)),
        "scalar": torch.tensor(2.5),
        "scalar_i64": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "empty_bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
    }


def hf_sharded_state() -> dict[str, torch.Tensor]:
    """Several files + index at HF_MAX_SHARD: a tensor over the limit in the middle (written
    first, in a file of its own), tied weights (stored once + an alias), two views of one
    storage that do not overlap (stored as two tensors), a transposed (non-contiguous) view."""
    embed = ramp((16, 8), torch.float32, start=-4, step=1 / 16)  # 512 B
    qkv = ramp((8, 8), torch.float32, start=1, step=0.5)
    return {
        "embed.weight": embed,
        "layers.0.attn.q.weight": qkv[:4],  # views of one storage, no overlap
        "layers.0.attn.k.weight": qkv[4:],
        "layers.0.mlp.weight": ramp((8, 8), torch.bfloat16, start=-1, step=1 / 32),
        "layers.0.mlp.bias": ramp((8,), torch.float32, step=-0.125),
        "big.weight": ramp((24, 8), torch.float32, start=100, step=0.75),  # 768 B > 512
        "layers.1.proj.weight": ramp((6, 4), torch.float16, start=2, step=-0.25).t(),
        "layers.1.norm.weight": torch.ones(8),
        "position_ids": ramp((1, 12), torch.int64),
        "lm_head.weight": embed,  # tied to embed.weight
    }


def nested_objects() -> dict[str, Any]:
    """A real Linear + AdamW after one step (fixed weights and gradients), a StepLR, JSON,
    typed leaves (Path, timedelta, datetime, date, enum, Namespace) and nested containers."""
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(ramp((3, 4), torch.float32, start=-0.6, step=0.1))
        model.bias.copy_(ramp((3,), torch.float32, start=0.2, step=-0.2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    model.weight.grad = ramp((3, 4), torch.float32, start=-0.05, step=0.01)
    model.bias.grad = ramp((3,), torch.float32, start=1, step=0.5)
    optim.step()
    sched.step()
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "step": 7,
        "lr": 1e-3,
        "run_name": "fixture-run é",
        "parent": None,
        "done": False,
        "loss": math.nan,
        "best": math.inf,
        "worst": -math.inf,
        "neg_zero": -0.0,
        "extra": {
            "ema": ramp((2, 2), torch.float32, start=0.5, step=0.25),
            "history": [0.5, 0.25, ramp((3,), torch.int64, start=10)],
            "shape": (3, 4),
            "by_epoch": {1: "one", 2: "two"},
            "nested": {"deep": {"x": ramp((2,), torch.bfloat16, start=1.5)}, "empty": {}, "none": []},
        },
        "cfg_path": pathlib.PurePosixPath("data/train"),
        "elapsed": datetime.timedelta(days=1, seconds=90, microseconds=5),
        "started": datetime.datetime(2024, 1, 2, 3, 4, 5, 6000, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2024, 2, 29),
        "status": http.HTTPStatus.NOT_FOUND,
        "args": argparse.Namespace(lr=0.1, name="x", layers=3),
    }


def nested_loaded_form(objects: Mapping[str, Any]) -> dict[str, Any]:
    """What ``sp.load`` is to return for :func:`nested_objects`: the module's state dict, the
    optimizer's keyed by parameter name, the scheduler's state dict; everything else as is."""
    out = dict(objects)
    model, optim, sched = objects["model"], objects["optim"], objects["sched"]
    out["model"] = dict(model.state_dict())
    names = {id(p): n for n, p in model.named_parameters()}
    index_to_name = {}
    for group in optim.param_groups:
        for p in group["params"]:
            index_to_name[len(index_to_name)] = names[id(p)]
    raw = optim.state_dict()
    out["optim"] = {
        "state": {index_to_name[i]: dict(s) for i, s in raw["state"].items()},
        "param_groups": [
            {**g, "params": [index_to_name[i] for i in g["params"]]} for g in raw["param_groups"]
        ],
    }
    out["sched"] = sched.state_dict()
    return out


CHUNKED = {  # name -> (global shape, dtype, placement on the 1-D mesh of 2: S0 / S1 / S2 / R / plain)
    "rows": ((7, 5), torch.float32, "S0"),  # 4 + 3 rows
    "one": ((1, 6), torch.float32, "S0"),  # rank 1's shard is empty
    "cols": ((5, 7), torch.bfloat16, "S1"),  # 2-D, sharded on dim 1: 4 + 3 columns
    "ints": ((9,), torch.int64, "S0"),  # 5 + 4
    "cube": ((3, 2, 5), torch.float32, "S2"),  # 3 + 2
    "empty": ((0, 4), torch.float32, "S0"),
    "rep_dt": ((3, 4), torch.float16, "R"),  # a Replicate() DTensor
    "rep": ((4, 4), torch.float32, "plain"),  # a plain tensor every rank holds (replicated)
    "scalar": ((), torch.int64, "plain"),
}


def chunked_full() -> dict[str, torch.Tensor]:
    return {
        name: ramp(shape, dtype, start=10 * i - 3, step=0.5 if dtype.is_floating_point else 3)
        for i, (name, (shape, dtype, _)) in enumerate(CHUNKED.items())
    }


def placement(code: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


def chunked_worker(rank: int, world: int, out: str) -> None:
    """On each of the 2 ranks: the DTensors of :data:`CHUNKED`, saved in both layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    for name, value in chunked_full().items():
        code = CHUNKED[name][2]
        state[name] = value.clone() if code == "plain" else distribute_tensor(value, mesh, [placement(code)])
    for fixture, layout in (("chunked_2ranks", "chunked"), ("chunked_2ranks_hf", "hf")):
        sp.save(state, Path(out) / fixture / "ckpt", layout=layout, max_shard_size=CHUNKED_MAX_SHARD)


# ----------------------------------------------------------------------------- expected.json


def sha256(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def describe(value: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape), "sha256": sha256(value)}


def leaf(value: Any) -> Any:
    if value is None or (isinstance(value, (bool, int, str)) and not isinstance(value, enum.Enum)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": str(value)}
    if isinstance(value, pathlib.PurePath):
        return {"path": [type(value).__name__, str(value)]}
    if isinstance(value, datetime.timedelta):
        return {"timedelta": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, datetime.datetime):
        return {"datetime": value.isoformat()}
    if isinstance(value, datetime.date):
        return {"date": value.isoformat()}
    if isinstance(value, enum.Enum):
        cls = type(value)
        return {"enum": [f"{cls.__module__}:{cls.__qualname__}", value.name]}
    if isinstance(value, argparse.Namespace):
        return {"namespace": {k: leaf(v) for k, v in vars(value).items()}}
    raise TypeError(f"no expected.json form for {type(value).__name__}")


def flatten(state: Any, *, typed: bool = False) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """(containers, tensors, leaves) of a state, by path (see the module docstring); each
    leaf as ``expected.json`` holds it, or with ``typed`` (the test's view of a loaded
    state) a pair (its Python type, that form)."""
    containers: dict[str, str] = {}
    tensors: dict[str, Any] = {}
    leaves: dict[str, Any] = {}

    def join(prefix: str, part: str) -> str:
        return part if not prefix else f"{prefix}/{part}"

    def walk(path: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors[path] = describe(value)
        elif isinstance(value, Mapping):
            containers[path] = "dict"
            for k, v in value.items():
                if isinstance(k, str):
                    assert k and not set(k) & set("/[{"), k
                    walk(join(path, k), v)
                else:
                    assert type(k) is int, k
                    walk(join(path, f"{{{k}}}"), v)
        elif isinstance(value, (list, tuple)):
            containers[path] = "tuple" if isinstance(value, tuple) else "list"
            for i, v in enumerate(value):
                walk(join(path, f"[{i}]"), v)
        else:
            leaves[path] = (type(value), leaf(value)) if typed else leaf(value)

    walk("", state)
    return containers, tensors, leaves


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def file_digests(ckpt: Path) -> dict[str, Any]:
    return {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(ckpt.iterdir())
    }


def write_expected(fixture: Path, loaded_form: Any, *, description: str, extra: Mapping[str, Any] = ()) -> None:
    ckpt = fixture / "ckpt"
    manifest = json.loads((ckpt / "shardpoint.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION, (fixture, manifest["format_version"])
    containers, tensors, leaves = flatten(loaded_form)
    expected = {
        "fixture": fixture.name,
        "description": description,
        "format_version": manifest["format_version"],
        "written_by": {"shardpoint": sp.__version__, "commit": git_commit(), "torch": torch.__version__},
        "layout": manifest["layout"],
        "world_size": manifest["world_size"],
        "flat": manifest["flat"],
        "aliases": {c: dict(v.get("aliases", {})) for c, v in manifest["components"].items() if v.get("aliases")},
        **dict(extra),
        "containers": containers,
        "tensors": tensors,
        "leaves": leaves,
        "files": file_digests(ckpt),
    }
    (fixture / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- main

FORMAT_VERSION = 0  # set in main from what this shardpoint writes


def written_version() -> int:
    from shardpoint._format import manifest

    return int(manifest.FORMAT_VERSION)


def make_all(out: Path) -> None:
    single = hf_single_state()
    sp.save(single, out / "hf_single" / "ckpt", layout="hf")
    write_expected(out / "hf_single", single,
                   description="flat state dict, layout hf, one file: every common dtype, 0-d, empty, non-finite")

    sharded = hf_sharded_state()
    sp.save(sharded, out / "hf_sharded" / "ckpt", layout="hf", max_shard_size=HF_MAX_SHARD)
    write_expected(out / "hf_sharded", sharded,
                   description=f"flat state dict, layout hf, max_shard_size={HF_MAX_SHARD}: several files + index, "
                   "tied weights (alias), views of one storage, a transposed view")

    objects = nested_objects()
    sp.save(objects, out / "nested" / "ckpt", metadata={"note": "format fixture", "step": 7})
    write_expected(out / "nested", nested_loaded_form(objects),
                   description="nested training state in one process: Linear + AdamW (one step) + StepLR, "
                   "JSON and typed leaves, nested containers")

    from _dist_utils import run_ranks

    run_ranks(chunked_worker, WORLD, str(out), timeout=300)
    placements = {name: code for name, (_, _, code) in CHUNKED.items()}
    for name, layout in (("chunked_2ranks", "chunked"), ("chunked_2ranks_hf", "hf")):
        write_expected(out / name, chunked_full(), extra={"placements": placements, "mesh": [WORLD]},
                       description=f"collective save from {WORLD} gloo ranks, layout {layout}, "
                       f"max_shard_size={CHUNKED_MAX_SHARD}: DTensors on a 1-D mesh (Shard(0) uneven and "
                       "empty, Shard(1), Shard(2), Replicate) and plain replicated tensors")


def main(argv: list[str] | None = None) -> int:
    global FORMAT_VERSION
    FORMAT_VERSION = written_version()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / f"format_v{FORMAT_VERSION}")
    parser.add_argument("--force", action="store_true", help="replace the fixtures of this format version")
    args = parser.parse_args(argv)
    out: Path = args.out
    names = ("hf_single", "hf_sharded", "nested", "chunked_2ranks", "chunked_2ranks_hf")
    if any((out / n).exists() for n in names):
        if not args.force:
            print(f"{out} already holds fixtures (frozen once committed); --force replaces them", file=sys.stderr)
            return 1
        for n in names:
            shutil.rmtree(out / n, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    make_all(out)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    for n in names:
        size = sum(p.stat().st_size for p in (out / n).rglob("*") if p.is_file())
        print(f"{n}: {size} bytes")
    print(f"{out}: {total} bytes in all, format_version {FORMAT_VERSION}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
