"""Every value of a real manifest replaced by a value of another JSON type: refused with a
CheckpointError, never a TypeError / KeyError / ValueError from deep inside the parser.

The class of bug: a JSON list or object where the parser expected a string, looked up in a
dict or set ("unhashable type"), or a number where it expected a container. Hypothesis found
one (a typed node's ``class`` as a list); this walks every position of two real manifests.
"""

from __future__ import annotations

import copy
import datetime
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._format.manifest import parse_manifest

REPLACEMENTS: list[Any] = [[], {}, [1], {"a": 1}, None, 1.5, -1, "x", True, 2**70]


def _positions(node: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if at:
        yield at
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _positions(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _positions(value, (*at, i))


def _manifests(tmp_path: pathlib.Path) -> dict[str, dict[str, Any]]:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    hp = {"path": pathlib.Path("out"), "when": datetime.datetime(2024, 1, 1), "f": float("nan"), "l": [1, "a", None]}
    sp.save({"model": model, "optim": optim, "hp": hp}, tmp_path / "nested", progress=False)
    sp.save({"w": torch.ones(4, 4)}, tmp_path / "chunked", layout="chunked", progress=False)
    return {name: json.loads((tmp_path / name / "shardpoint.json").read_text()) for name in ("nested", "chunked")}


def test_every_manifest_value_of_another_type_is_a_checkpoint_error(tmp_path: pathlib.Path) -> None:
    tried = 0
    escaped: list[str] = []
    for name, doc in _manifests(tmp_path).items():
        for at in list(_positions(doc)):
            for value in REPLACEMENTS:
                forged = copy.deepcopy(doc)
                parent = forged
                for key in at[:-1]:
                    parent = parent[key]
                parent[at[-1]] = value
                tried += 1
                try:
                    parse_manifest(json.dumps(forged).encode(), where=f"{name}/shardpoint.json")
                except sp.CheckpointError:
                    pass
                except Exception as exc:
                    escaped.append(f"{name} {list(at)} = {value!r}: {type(exc).__name__}: {exc}")
    assert tried > 1000  # both manifests walked, every position
    assert escaped == []


@pytest.mark.parametrize("value", [["Path"], {"Path": 1}])
def test_a_typed_node_class_that_is_not_a_string_names_the_node(tmp_path: pathlib.Path, value: Any) -> None:
    sp.save({"hp": {"p": pathlib.Path("out")}}, tmp_path / "ck", progress=False)
    path = tmp_path / "ck" / "shardpoint.json"
    doc = json.loads(path.read_text())
    doc["components"]["hp"]["tree"]["items"][0][2]["class"] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(sp.CorruptCheckpointError, match=r"path node needs a 'class' \(Path, PurePosixPath, PureWindowsPath\)"):
        sp.load(tmp_path / "ck")
