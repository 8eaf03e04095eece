"""Paths, Enum members, Namespaces, dataclasses and datetime values stored without pickle."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import pathlib
import re
import sys
import types
import zoneinfo
from importlib import resources
from typing import Any

import jsonschema
import pytest
import torch

import shardpoint as sp


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1


class Mode(str, enum.Enum):
    FAST = "fast"


class Perm(enum.Flag):
    R = 1
    W = 2


@dataclasses.dataclass(frozen=True)
class Optim:
    name: str
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    root: pathlib.Path = pathlib.Path("/data")
    steps: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass
class WithInitVar:
    a: int
    scale: dataclasses.InitVar[int] = 1

    def __post_init__(self, scale: int) -> None:
        self.a *= scale


def _values() -> dict[str, Any]:
    trained = Optim("adam", 0.1, root=pathlib.Path("runs/a"))
    object.__setattr__(trained, "steps", 7)  # an init=False field with a value of its own
    return {
        "path": pathlib.Path("/ckpt/run 1"),
        "pure_win": pathlib.PureWindowsPath(r"C:\data\x.txt"),
        "pure_posix": pathlib.PurePosixPath("a/b"),
        "color": Color.BLUE,
        "level": Level.LOW,
        "mode": Mode.FAST,
        "ns": argparse.Namespace(depth=2, act="relu", colors=[Color.RED], nested=argparse.Namespace(x=1.5)),
        "dc": trained,
        "when": datetime.datetime(2024, 3, 1, 12, 30, 5, 123456),
        "utc": datetime.datetime(2024, 3, 1, 12, 30, tzinfo=datetime.timezone.utc),
        "ist": datetime.datetime(2024, 3, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=5, minutes=30))),
        "folded": datetime.datetime(2024, 11, 3, 1, 30, fold=1),
        "day": datetime.date(1999, 12, 31),
        "clock": datetime.time(23, 59, 59, 999999),
        "span": datetime.timedelta(days=-2, seconds=5, microseconds=7),
        # What torch.load(weights_only=True) rebuilds too (a Lightning module's hyperparameters).
        "dtype": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,
        "device": torch.device("cuda", 1),
        "cpu": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "layout": torch.strided,
        "memory_format": torch.channels_last,
        "bytes": b"\x00\xffab",
        "bytearray": bytearray(b"x"),
        "complex": complex(float("inf"), -0.1),
    }


def test_typed_values_round_trip_equal_with_their_types(tmp_path) -> None:
    values = _values()
    sp.save({"hp": values, "w": torch.ones(2)}, tmp_path / "ck", progress=False)
    doc = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    assert all(item[2]["type"] != "pickle" for item in doc["components"]["hp"]["tree"]["items"])
    items = {item[1]: item[2] for item in doc["components"]["hp"]["tree"]["items"]}
    assert items["color"] == {"type": "enum", "class": f"{__name__}:Color", "member": "BLUE"}
    assert items["path"] == {"type": "path", "class": "Path", "value": "/ckpt/run 1"}
    assert items["span"] == {"type": "datetime", "class": "timedelta", "value": [-2, 5, 7]}
    assert items["ist"]["value"] == "2024-03-01T00:00:00+05:30"
    assert items["dc"]["class"] == f"{__name__}:Optim"
    assert items["dtype"] == {"type": "torch", "class": "dtype", "value": "bfloat16"}
    assert items["device"] == {"type": "torch", "class": "device", "value": "cuda:1"}
    assert items["size"] == {"type": "torch", "class": "Size", "value": [2, 3]}
    assert items["bytes"] == {"type": "bytes", "class": "bytes", "value": "AP9hYg=="}
    assert items["complex"] == {"type": "complex", "value": ["inf", "-0x1.999999999999ap-4"]}
    jsonschema.validate(doc, json.loads(resources.files("shardpoint._format").joinpath("manifest.schema.json").read_text()))

    got = sp.load(tmp_path / "ck")["hp"]
    assert list(got) == list(values)
    for key, value in values.items():
        assert got[key] == value, key
        assert type(got[key]) is type(value), key
    assert got["dc"].steps == 7 and got["dc"].root == pathlib.Path("runs/a")
    assert got["ns"].nested == argparse.Namespace(x=1.5) and got["folded"].fold == 1
    assert got["ist"].utcoffset() == datetime.timedelta(hours=5, minutes=30)


def test_load_into_replaces_typed_values(tmp_path) -> None:
    sp.save({"hp": {"color": Color.RED, "root": pathlib.Path("x")}}, tmp_path / "ck", progress=False)
    target: dict[str, Any] = {"hp": {"color": Color.BLUE, "root": pathlib.Path("y")}}
    sp.load_into(target, tmp_path / "ck")
    assert target == {"hp": {"color": Color.RED, "root": pathlib.Path("x")}}


@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param(Perm.R | Perm.W, r"is not a single named member of its class", id="composite-flag"),
        pytest.param(enum.Enum("Local", "A").A, r"its class Local cannot be found again by module and name", id="local-enum"),
        pytest.param(WithInitVar(2, 3), r"it has InitVar pseudo-fields", id="initvar-dataclass"),
        pytest.param(datetime.datetime(2024, 1, 1, tzinfo=zoneinfo.ZoneInfo("UTC")),
                     r"its tzinfo zoneinfo.ZoneInfo\(key='UTC'\) is not a fixed datetime.timezone", id="zoneinfo"),
        pytest.param(datetime.timezone.utc, r"shardpoint cannot store: use tensors", id="plain-object"),
    ],
)
def test_values_that_need_pickle_are_refused_naming_key_and_option(tmp_path, value: Any, why: str) -> None:
    with pytest.raises(sp.InvalidStateError, match=rf"state at hp\['k'\] is a .*{why}.*allow_pickle=True"):
        sp.save({"hp": {"k": value}}, tmp_path / "ck", progress=False)
    assert not (tmp_path / "ck").exists()
    if not isinstance(value, datetime.tzinfo) and "Local" not in repr(type(value)):
        sp.save({"hp": {"k": value}}, tmp_path / "p", allow_pickle=True, progress=False)
        assert sp.load(tmp_path / "p", allow_pickle=True)["hp"]["k"] == value


def test_classes_are_found_only_in_imported_modules(tmp_path) -> None:
    """A checkpoint never makes shardpoint import a module: the error says what to import."""
    module = types.ModuleType("sp_typed_tmp_module")

    class Shade(enum.Enum):
        DARK = 1

    Shade.__module__ = module.__name__
    Shade.__qualname__ = "Shade"
    module.Shade = Shade  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        sp.save({"hp": {"shade": Shade.DARK}}, tmp_path / "ck", progress=False)
        assert sp.load(tmp_path / "ck")["hp"]["shade"] is Shade.DARK
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(
        sp.LoadMismatchError,
        match=r"cannot rebuild a enum of class sp_typed_tmp_module:Shade: module 'sp_typed_tmp_module' "
        r"is not imported\. shardpoint never imports a module named by a checkpoint: "
        r"`import sp_typed_tmp_module` before loading",
    ):
        sp.load(tmp_path / "ck")


def _forge(tmp_path, node: dict[str, Any]) -> pathlib.Path:
    sp.save({"hp": {"k": 1}}, tmp_path / "ck", overwrite=True, progress=False)
    path = tmp_path / "ck" / "shardpoint.json"
    doc = json.loads(path.read_text())
    doc["components"]["hp"]["tree"]["items"][0][2] = node
    path.write_text(json.dumps(doc))
    return tmp_path / "ck"


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"type": "path", "class": "os:system", "value": "x"}, "path node needs a 'class'"),
        # JSON lists / objects where a class name belongs: refused, never a TypeError
        # ("unhashable type") from looking them up.
        ({"type": "path", "class": ["Path"], "value": "out"}, "path node needs a 'class'"),
        ({"type": "datetime", "class": {"datetime": 1}, "value": "2024-01-01"}, "datetime node's class \"{'datetime': 1}\" is not one of"),
        ({"type": "enum", "class": ["os", "x"], "member": "x"}, "enum node needs a 'class' ('module:qualname')"),
        ({"type": "enum", "class": "os", "member": "x"}, "enum node needs a 'class' ('module:qualname')"),
        ({"type": "datetime", "class": "datetime", "value": "2024-13-01"}, "datetime node's value '2024-13-01' is not a valid datetime"),
        ({"type": "datetime", "class": "timedelta", "value": [10**12, 0, 0]}, "is not a valid timedelta"),
        ({"type": "datetime", "class": "date", "value": "2024-01-01", "fold": 2}, "'fold' is not 0 or 1"),
        ({"type": "namespace", "value": {"type": "list", "items": []}}, "namespace node's 'value' is not a dict with str keys"),
        ({"type": "torch", "class": "dtype", "value": "system"}, "torch has no dtype named 'system'"),
        ({"type": "torch", "class": "dtype", "value": "device"}, "torch has no dtype named 'device'"),
        ({"type": "torch", "class": "Tensor", "value": "ones"}, "torch node's class 'Tensor' is not one of Size, dtype"),
        ({"type": "torch", "class": "device", "value": "gpu0"}, "torch device node's value 'gpu0' is not a device"),
        ({"type": "torch", "class": "Size", "value": [-1]}, "torch Size node's 'value' is not a list of sizes"),
        ({"type": "torch", "class": "Size", "value": [2**64]}, "torch Size node's 'value' is not a list of sizes"),
        ({"type": "bytes", "class": "bytes", "value": "not base64!"}, "bytes node's 'value' is not base64"),
        ({"type": "complex", "value": ["1.0", "x"]}, "complex node's 'value' is not [real, imaginary]"),
        ({"type": "dataclass", "class": "x:Y", "value": {"type": "dict", "items": [["int", 0, {"type": "json", "value": 1}]]}},
         "dataclass node's 'value' is not a dict with str keys"),
    ],
)
def test_forged_typed_nodes_are_refused(tmp_path, node: dict[str, Any], message: str) -> None:
    with pytest.raises(sp.CorruptCheckpointError, match=re.escape(message) + ".*damaged or forged"):
        sp.load(_forge(tmp_path, node))


def test_a_forged_class_name_is_not_a_way_to_run_code(tmp_path) -> None:
    """A class named by a forged manifest must be the right kind: an Enum, a dataclass."""
    path = _forge(tmp_path, {"type": "enum", "class": "os:_wrap_close", "member": "x"})
    with pytest.raises(sp.LoadMismatchError, match="os:_wrap_close has no enum member 'x'"):
        sp.load(path)
    path = _forge(tmp_path, {"type": "dataclass", "class": "subprocess:Popen", "value": {"type": "dict", "items": [
        ["str", "args", {"type": "json", "value": "true"}]]}})
    with pytest.raises(sp.LoadMismatchError, match="subprocess:Popen was a dataclass at save time and is not now"):
        sp.load(path)
    path = _forge(tmp_path, {"type": "dataclass", "class": f"{__name__}:Optim", "value": {"type": "dict", "items": [
        ["str", "name", {"type": "json", "value": "x"}]]}})
    with pytest.raises(sp.LoadMismatchError, match=r"dataclass .*:Optim has fields \['betas', 'lr', 'name', 'root', 'steps'\] but the checkpoint stores \['name'\]"):
        sp.load(path)



def test_a_forged_class_name_never_runs_a_modules_lazy_getattr(tmp_path) -> None:
    """torch and transformers import submodules from a module-level ``__getattr__``: a class
    name such as ``torch:onnx.Foo`` must not make a load import ``torch.onnx``."""
    module = types.ModuleType("sp_lazy_tmp_module")
    asked: list[str] = []

    def lazy(name: str) -> Any:
        asked.append(name)
        raise AttributeError(name)

    module.__getattr__ = lazy  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        path = _forge(tmp_path, {"type": "enum", "class": "sp_lazy_tmp_module:sub.Foo", "member": "A"})
        with pytest.raises(sp.LoadMismatchError, match=r"module 'sp_lazy_tmp_module' has no class 'sub\.Foo'"):
            sp.load(path)
    finally:
        del sys.modules[module.__name__]
    assert asked == []


def test_diff_compares_the_typed_values(tmp_path) -> None:
    """diff skipped the torch / bytes / complex nodes: two checkpoints differing only there
    were reported equal."""
    sp.save({"hp": {"dtype": torch.bfloat16, "b": b"a", "c": 1 + 2j}, "w": torch.ones(2)}, tmp_path / "a")
    sp.save({"hp": {"dtype": torch.float16, "b": b"a", "c": 1 + 2j}, "w": torch.ones(2)}, tmp_path / "b")
    report = sp.diff(tmp_path / "a", tmp_path / "b")
    assert not report.equal
    assert [d for d in report.values if "dtype" in str(d)], report.values
