"""Fixtures, seed inputs and structure-aware mutations for the fuzz targets.

Byte-level mutation alone rarely gets past ``json.loads``; ``mutate_json`` edits the
decoded document instead (replace a value by an edge case of another type, drop or rename
a key, duplicate or drop a list item, nest deeper) so the validation behind the JSON
parser is reached. Both drivers use it: Hypothesis through a seeded ``random.Random``,
atheris as its custom mutator.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import enum
import json
import random
import struct
from pathlib import Path, PureWindowsPath
from typing import Any

import torch

import shardpoint as sp

# ------------------------------------------------------------------------------ fixtures


class SeedColor(enum.Enum):
    """An Enum stored as a typed ``enum`` node in the fixtures."""

    RED = "red"


@dataclasses.dataclass
class SeedConfig:
    """A dataclass (with a tensor field) stored as a typed ``dataclass`` node."""

    lr: float
    root: Path
    scale: torch.Tensor


def typed_values() -> dict[str, Any]:
    """One value of every typed JSON node (path, enum, namespace, dataclass, datetime)."""
    return {
        "dir": Path("/data/run 1"),
        "win": PureWindowsPath("C:/x"),
        "color": SeedColor.RED,
        "args": argparse.Namespace(seed=3, tags=["a"]),
        "cfg": SeedConfig(0.5, Path("out"), torch.ones(2)),
        "when": datetime.datetime(2024, 5, 6, 7, 8, 9, 10, tzinfo=datetime.timezone.utc),
        "span": datetime.timedelta(days=1, seconds=2),
    }


def fixture_tensors(kind: str) -> dict[str, torch.Tensor]:
    """The flat state saved as fixture ``kind`` (``hf``, ``chunked``)."""
    return {
        "embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "layer.bias": torch.arange(5, dtype=torch.int64) - 2,
        "layer.half": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "scalar": torch.tensor(7, dtype=torch.int32),
        "empty": torch.zeros(0, 3),
    }


def nested_state() -> dict[str, Any]:
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {
        "model": {"w": weight, "tied": weight, "b": torch.ones(3, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 3)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "nan": float("nan")}]},
        "extra": {"step": 12, "names": ["a", "b"], "flag": True, "none": None, "pair": (1, "x"),
                  "typed": typed_values()},
    }


def trained_target() -> dict[str, Any]:
    """A real small nested state: a module, its optimizer (after one step), JSON leaves.
    Built the same way each time (the ``load_into`` target loads into a fresh one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return {"model": model, "optim": optim, "extra": {"step": 5, "names": ["a", "b"], "lr": 0.5,
                                                      "best": float("inf"), "pair": (1, "x"),
                                                      "typed": typed_values()}}


def write_trained(root: Path) -> None:
    state = trained_target()
    state["model"](torch.ones(4, 3)).sum().backward()
    state["optim"].step()
    sp.save(state, root / "trained", max_shard_size=256, progress=False)
    mgr = sp.CheckpointManager(root / "ranked", metric="loss", keep_best=2, progress=False)
    for step, loss in ((1, 0.5), (2, 0.25), (3, float("nan"))):
        mgr.save(step, {"x": torch.tensor([step])}, metrics={"loss": loss})


def write_fixtures(root: Path) -> None:
    """Checkpoints the index, manifest and ``latest`` targets load through."""
    flat = fixture_tensors("hf")
    sp.save(flat, root / "hf", max_shard_size=64, progress=False)
    (root / "hf" / "shardpoint.json").unlink()
    sp.save(flat, root / "chunked", layout="chunked", max_shard_size=64, progress=False)
    sp.save(nested_state(), root / "nested", max_shard_size=64, progress=False)
    mgr = sp.CheckpointManager(root / "steps", progress=False)
    for step in (2, 7):
        mgr.save(step, {"x": torch.tensor([step])})


# --------------------------------------------------------------------------------- seeds


def _st(header: dict[str, Any] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def seeds(parser: str, fixtures: Path) -> list[bytes]:
    """Valid and near-valid inputs to start from."""
    if parser == "header":
        out = [p.read_bytes() for d in ("hf", "chunked", "nested") for p in sorted((fixtures / d).glob("*.safetensors"))]
        out += [
            _st({}),
            _st({"__metadata__": {"format": "pt"}}),
            _st({"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, bytes(4)),
            _st({"w": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [0, 0]}}),
            _st({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                 "b": {"dtype": "I16", "shape": [1], "data_offsets": [2, 4]}}, bytes(4)),
            _st(b'{"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}   ', bytes(8)),
            _st(b"{}", length=3),
        ]
        return out
    if parser == "index":
        raw = (fixtures / "hf" / "model.safetensors.index.json").read_bytes()
        doc = json.loads(raw)
        first = next(iter(doc["weight_map"].values()))
        return [
            raw,
            json.dumps({"weight_map": {}}).encode(),
            json.dumps({"metadata": {}, "weight_map": {"embed.weight": first}}).encode(),
            json.dumps({"weight_map": {"embed.weight": "../hf/" + first}}).encode(),
        ]
    if parser == "manifest":
        return [(fixtures / d / "shardpoint.json").read_bytes() for d in ("nested", "chunked")]
    if parser == "latest":
        return [b"step-000007\n", b"step-000002\n", b"step-", b"", b"step-000099\n", b"\xff\xfe"]
    if parser == "load_into":
        return [(fixtures / "trained" / "shardpoint.json").read_bytes()]
    if parser == "load_keys":
        return [(fixtures / d / "shardpoint.json").read_bytes() for d in ("chunked", "nested")]
    if parser == "manager":
        return [(fixtures / "ranked" / f"step-{s:06d}" / "shardpoint.json").read_bytes() for s in (2, 3, 1)]
    if parser == "cli":
        return cli_seeds()
    raise ValueError(parser)


def cli_seeds() -> list[bytes]:
    """``cli`` inputs: a mode byte (0 manifest, 1 first data file, 2 HF index) + the file,
    from the fixtures whose names hold control characters (``targets._cli_fixtures``)."""
    import targets

    root = targets._cli_fixtures()
    first = sorted((root / "cli-hf").glob("*.safetensors"))[0]
    return [
        b"\x00" + (root / "cli" / "shardpoint.json").read_bytes(),
        b"\x01" + first.read_bytes(),
        b"\x02" + (root / "cli-hf" / "model.safetensors.index.json").read_bytes(),
    ]


# ------------------------------------------------------------------------------ mutation

EDGE_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 7, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30,
    0.5, float("inf"), "", "F32", "BF16", "F8_E4M3", "C64", "X", "../x.safetensors", "/etc/passwd",
    "model.safetensors", "a\x00b", "s3://b/k", "step-000007", "shardpoint", [], [0], [0, 0],
    [2, 3], [0, 8], [2**40], [1] * 65, {}, {"type": "json", "value": 1}, {"type": "pickle", "name": "w"},
    {"type": "tensor", "name": "w"}, {"type": "dict", "items": []},
]


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every node of a JSON document."""
    out = [path]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.extend(_nodes(value, (*path, key)))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out.extend(_nodes(value, (*path, i)))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.6 or depth > 2:
        return copy.deepcopy(rng.choice(EDGE_VALUES))  # later edits must not change the table
    if roll < 0.8:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["dtype", "shape", "data_offsets", "file", "key", "x", "type", "name"]):
            random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutate_json(doc: Any, rng: random.Random, rounds: int = 1) -> Any:
    """``doc`` (decoded JSON) with ``rounds`` random structural edits."""
    for _ in range(rounds):
        paths = _nodes(doc)
        path = rng.choice(paths)
        op = rng.randrange(7)
        if not path:
            if op == 0:
                doc = random_value(rng)
            continue
        parent, last = _get(doc, path[:-1]), path[-1]
        if op <= 1:  # replace by an edge value of any type
            parent[last] = random_value(rng)
        elif op == 2 and isinstance(parent, dict):  # drop a key
            del parent[last]
        elif op == 3 and isinstance(parent, dict):  # rename a key
            parent[rng.choice([f"{last}x", "", "__metadata__", "w", "../x"])] = parent.pop(last)
        elif op == 4 and isinstance(parent, list):  # duplicate / drop a list item
            if rng.random() < 0.5:
                parent.insert(last, parent[last])
            else:
                parent.pop(last)
        elif op == 5:  # nest deeper
            parent[last] = [parent[last]] if rng.random() < 0.5 else {"x": parent[last]}
        elif isinstance(parent[last], int) and not isinstance(parent[last], bool):  # nudge a number
            parent[last] = parent[last] + rng.choice([-1, 1, 8, -8, 2**32])
    return doc


CONTROL_STRINGS = ["\x1b[2J", "\x1b]0;x\x07", "\r", "\n", "\u202e", "\u2066", "\x9b", "\x7f", "\ud800", "\u200b"]
"""Strings the ``cli`` mutations put into keys and values: terminal controls and spoofers."""


def mutate_input(parser: str, data: bytes, rng: random.Random) -> bytes:
    """A structure-aware mutation of ``data``; bytes unchanged if it is not JSON-shaped."""
    if parser == "cli":
        if not data:
            return data
        inner = ("manifest", "header", "index")[data[0] % 3]
        body = mutate_input(inner, data[1:], rng)
        if rng.random() < 0.5:  # put a control sequence into some string of the JSON
            at = body.find(b'"', rng.randrange(max(1, min(len(body), 4096))))
            if at >= 0:
                evil = json.dumps(rng.choice(CONTROL_STRINGS))[1:-1].encode()
                body = body[: at + 1] + evil + body[at + 1 :]
                if inner == "header" and len(body) >= 8:  # keep the header length right
                    (length,) = struct.unpack("<Q", body[:8])
                    body = struct.pack("<Q", length + len(evil)) + body[8:]
        return data[:1] + body
    if parser == "latest":
        return rng.choice([b"step-%06d\n" % rng.randrange(10), b"step-" + bytes(rng.randrange(256) for _ in range(3)),
                           data[: rng.randrange(len(data) + 1)], data + b"\n" * rng.randrange(3)])
    if parser == "header":
        if len(data) < 8:
            return data
        (length,) = struct.unpack("<Q", data[:8])
        raw, rest = data[8 : 8 + length], data[8 + length :]
        try:
            doc = mutate_json(json.loads(raw), rng, rounds=rng.randrange(1, 3))
        except (ValueError, RecursionError):
            return data
        text = json.dumps(doc, allow_nan=True).encode()
        if rng.random() < 0.3:
            rest = rest[: rng.randrange(len(rest) + 1)] if rng.random() < 0.5 else rest + bytes(rng.randrange(1, 9))
        return struct.pack("<Q", len(text)) + text + rest
    try:
        doc = mutate_json(json.loads(data), rng, rounds=rng.randrange(1, 4))
        return json.dumps(doc, allow_nan=True).encode()
    except (ValueError, RecursionError):
        return data


# ---------------------------------------------------------------------- hypothesis strategies


def header_strategy() -> Any:
    """Whole safetensors files built field by field: mostly well-formed, often subtly not,
    so the cross-check against the ``safetensors`` library compares accepted files."""
    from hypothesis import strategies as st

    dtypes = st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "U16", "U32",
                              "U64", "BOOL", "F8_E4M3", "F8_E5M2", "C64", "F4", "X32", "f32", ""])
    dims = st.one_of(st.integers(0, 4), st.integers(-2, 2**65), st.sampled_from([2**31, 2**32, 2**63 - 1]))

    @st.composite
    def files(draw: Any) -> bytes:
        n = draw(st.integers(0, 4))
        names = draw(st.lists(st.text(min_size=0, max_size=6), min_size=n, max_size=n, unique=True))
        header: dict[str, Any] = {}
        if draw(st.booleans()):
            header["__metadata__"] = draw(st.one_of(
                st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
                st.just({"format": "pt"}), st.none(), st.just({"a": 1})))
        offset = 0
        for name in names:
            dtype = draw(dtypes)
            shape = draw(st.lists(dims, max_size=3))
            item = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4,
                    "F16": 2, "BF16": 2, "I16": 2, "U16": 2}.get(dtype, 1)
            size = item
            for d in shape:
                size *= d
            if draw(st.integers(0, 9)) == 0 or not 0 <= size <= 256:
                size = draw(st.integers(-1, 64))
            begin = offset + draw(st.sampled_from([0, 0, 0, 1, -1]))
            entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + size]}
            if draw(st.integers(0, 19)) == 0:
                entry[draw(st.sampled_from(["extra", "dtype", "shape"]))] = draw(st.sampled_from([1, None, "F32", [1]]))
            header[name] = entry
            offset = max(offset, begin + size)
        raw = json.dumps(header).encode()
        raw += b" " * draw(st.sampled_from([0, 0, (-(8 + len(raw))) % 8, 3]))
        data = bytes(draw(st.integers(0, 255)) for _ in range(max(0, min(offset, 256)) + draw(st.sampled_from([0, 0, 0, 1, -1]))))
        length = len(raw) + draw(st.sampled_from([0, 0, 0, 0, 1, -1, 2**40]))
        return struct.pack("<Q", max(0, length) % 2**64) + raw + data

    return files()


def input_strategy(parser: str, corpus: list[bytes]) -> Any:
    """Inputs for ``parser``: seeds, structural and byte-level mutations of them, raw bytes."""
    from hypothesis import strategies as st

    options = [
        st.sampled_from(corpus),
        st.builds(lambda base, r: mutate_input(parser, base, r), st.sampled_from(corpus),
                  st.randoms(use_true_random=False)),
        st.builds(lambda base, cut, junk: base[:cut] + junk, st.sampled_from(corpus), st.integers(0, 4096),
                  st.binary(max_size=64)),
        st.builds(lambda base, i, b: base[:i] + bytes([b]) + base[i + 1 :], st.sampled_from(corpus),
                  st.integers(0, 4096), st.integers(0, 255)),
        st.binary(max_size=512),
    ]
    if parser == "header":
        options.append(header_strategy())
    if parser == "latest":
        options.append(st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")))
    return st.one_of(options)
