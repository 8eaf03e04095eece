"""Manifests we write validate against the JSON Schema shipped in the package."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import torch

import shardpoint as sp


def _schema() -> dict:
    return json.loads(resources.files("shardpoint._format").joinpath("manifest.schema.json").read_text())


def test_flat_and_nested_manifests_validate(tmp_path):
    schema = _schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sp.save(model.state_dict(), tmp_path / "flat", metadata={"run": "a", "n": 1})
    sp.save({"model": model, "optim": opt, "rng": sp.RNGState(), "step": 3,
             "x": {0: (1.5, float("nan"), None, "s")}}, tmp_path / "nested")
    for name in ("flat", "nested"):
        doc = json.loads((tmp_path / name / "shardpoint.json").read_text())
        jsonschema.validate(doc, schema)


def test_schema_rejects_a_forged_manifest(tmp_path):
    sp.save({"w": torch.ones(2)}, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    doc["components"]["model"]["tensors"]["w"]["chunks"][0]["file"] = "../../etc/passwd"
    validator = jsonschema.Draft202012Validator(_schema())
    errors = list(validator.iter_errors(doc))
    assert errors and "does not match" in errors[0].message
