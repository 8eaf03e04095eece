"""Format 3: tensors described by rules, their chunks in the writing ranks' tables.

One 4-rank gloo save (module fixture) of a regular state: ``Shard(0)`` over 4 ranks, a 2x2
mesh ``(Shard(0), Shard(1))``, a ``Replicate()`` DTensor, an empty sharded tensor and a plain
tensor. Then, in this process: what the manifest and tables say, that a load reads only the
tables it needs, and that every forged or damaged table or rule is refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _dist_utils import run_ranks
from shardpoint._checksum import crc32c
from shardpoint._rule_chunks import RuleChunks
from shardpoint._source import open_checkpoint
from shardpoint._verify import verify_checkpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def expected() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3),
        "v": torch.arange(4 * 6, dtype=torch.bfloat16).reshape(4, 6),
        "r": torch.arange(6, dtype=torch.float64) / 7,
        "e": torch.zeros(0, 2),
        "b": torch.arange(5, dtype=torch.int64) * 1000,
    }


def save_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    full = expected()
    state = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "v": distribute_tensor(full["v"], mesh2, [Shard(0), Shard(1)]),
        "r": distribute_tensor(full["r"], mesh, [Replicate()]),
        "e": distribute_tensor(full["e"], mesh, [Shard(0)]),
        "b": full["b"],
    }
    first = sp.save(state, Path(root) / "first", layout="chunked")
    info = sp.save(state, Path(root) / "ckpt", layout="chunked")
    assert (first.plan_reused, info.plan_reused) == (False, True), (first, info)
    # An async save stages the shards (plain tensors then) but keeps their mesh layout: the
    # same rules, so the same plan again.
    staged = sp.async_save(state, Path(root) / "async", layout="chunked").result()
    assert staged.plan_reused, staged


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rules")
    run_ranks(save_worker, 4, str(root), timeout=180)
    return root / "ckpt"


def test_manifest_gives_rules_and_tables_not_chunks(saved: Path) -> None:
    doc = json.loads((saved / "shardpoint.json").read_text())
    assert doc["format_version"] == 3
    tensors = doc["components"]["model"]["tensors"]
    assert {n: (t["grid"], t["writer"]) for n, t in tensors.items()} == {
        "w": ([4, 1], [0, [1, 0]]),  # rows 3, 3, 3, 1: rank r writes cell r
        "v": ([2, 2], [0, [2, 1]]),  # the 2x2 mesh row-major: cell (i, j) by rank 2i + j
        # Whole tensors every rank holds, largest first, to the least loaded rank: after the
        # shards (48, 48, 48, 24 bytes) r (48 bytes) goes to rank 3, then b (40) to rank 0.
        "r": ([1], [3, [0]]),
        "e": ([4, 1], [0, [1, 0]]),
        "b": ([1], [0, [0]]),
    }
    assert "chunks" not in json.dumps(tensors)
    assert doc["files"] == {}
    assert [len(t) for t in doc["tables"]] == [2, 2, 2, 2]
    for rank, (size, crc) in enumerate(doc["tables"]):
        raw = (saved / f"shardpoint-r{rank:05d}.json").read_bytes()
        assert (len(raw), crc32c(raw)) == (size, crc)
        table = json.loads(raw)
        assert table["rank"] == rank and table["save_id"] == doc["save_id"]
        assert table["files"] == [[f"model-r{rank:05d}-00001.safetensors",
                                   (saved / f"model-r{rank:05d}-00001.safetensors").stat().st_size]]


def test_loads_are_exact_and_read_only_the_tables_they_need(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[int] = []
    real = RuleChunks.table

    def counted(self: RuleChunks, rank: int) -> Any:
        if rank not in self._tables:
            read.append(rank)
        return real(self, rank)

    monkeypatch.setattr(RuleChunks, "table", counted)
    full = expected()
    assert torch.equal(sp.load(saved, keys=["b"])["b"], full["b"])
    assert read == [0]  # b's writer's table alone
    read.clear()
    assert torch.equal(sp.load(saved, keys=["w"])["w"], full["w"])
    assert sorted(read) == [0, 1, 2, 3]
    read.clear()
    # A rank filling rows 4..6 of w (a 3-rank reshard: its shard) needs cells 1 and 2 only.
    with open_checkpoint(saved, lazy=True) as ckpt:
        record = ckpt.components["model"].tensors["w"]
        chunks = ckpt.resolved(record, (4, 0), (3, 3)).chunks
        assert [(c.file, c.offsets, c.shape) for c in chunks] == [
            ("model-r00001-00001.safetensors", (3, 0), (3, 3)),
            ("model-r00002-00001.safetensors", (6, 0), (3, 3)),
        ]
        assert ckpt.rules is not None and ckpt.rules.tables_read == 2
    read.clear()
    loaded = sp.load(saved)
    assert sorted(read) == [0, 1, 2, 3]
    for name, tensor in full.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    target = {name: torch.full_like(t, 7) for name, t in full.items()}
    assert sp.load_into(target, saved).ok  # 4 -> 1 rank
    assert all(torch.equal(target[n], full[n]) for n in full)
    report = verify_checkpoint(saved)
    assert report.ok and report.problems == [] and report.warnings == [], report


def _copy(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(saved, out)
    return out


def _rewrite_table(ckpt: Path, rank: int, edit: Any) -> None:
    """Change rank ``rank``'s table and record its new size and crc32c in the manifest, as a
    forger who knows the format would."""
    path = ckpt / f"shardpoint-r{rank:05d}.json"
    table = json.loads(path.read_text())
    edit(table)
    raw = json.dumps(table).encode()
    path.write_bytes(raw)
    manifest = json.loads((ckpt / "shardpoint.json").read_text())
    manifest["tables"][rank] = [len(raw), crc32c(raw)]
    (ckpt / "shardpoint.json").write_text(json.dumps(manifest))


def _rewrite_manifest(ckpt: Path, edit: Any) -> None:
    manifest = json.loads((ckpt / "shardpoint.json").read_text())
    edit(manifest)
    (ckpt / "shardpoint.json").write_text(json.dumps(manifest))


def _flip_byte(ckpt: Path) -> None:
    path = ckpt / "shardpoint-r00002.json"
    raw = bytearray(path.read_bytes())
    raw[10] ^= 1
    path.write_bytes(bytes(raw))


def _set_tensor(name: str, key: str, value: Any) -> Any:
    return lambda m: m["components"]["model"]["tensors"][name].__setitem__(key, value)


def _second_component_on_the_same_bytes(ckpt: Path) -> None:
    """A component ``copy`` with the model's rule-described tensors, every table pointing its
    cells at the model's own (file, key): 1x the files' bytes would back 2x the tensors."""
    manifest = json.loads((ckpt / "shardpoint.json").read_text())
    model = manifest["components"]["model"]
    ruled = sum(1 for t in model["tensors"].values() if "grid" in t)
    manifest["components"]["copy"] = json.loads(json.dumps(model))
    manifest["flat"] = False
    (ckpt / "shardpoint.json").write_text(json.dumps(manifest))
    for rank in range(len(manifest["tables"])):
        _rewrite_table(ckpt, rank, lambda t: t["chunks"].extend([[s + ruled, c, f, crc] for s, c, f, crc in t["chunks"]]))


def _deep_table(ckpt: Path) -> None:
    raw = b"[" * 100_000
    (ckpt / "shardpoint-r00001.json").write_bytes(raw)
    _rewrite_manifest(ckpt, lambda m: m["tables"].__setitem__(1, [len(raw), crc32c(raw)]))


FORGERIES = [
    pytest.param(_second_component_on_the_same_bytes, "shardpoint-r0000", "backs another chunk",
                 id="one-stored-tensor-backs-two-chunks"),
    pytest.param(lambda c: _rewrite_table(c, 1, lambda t: t["files"][0].__setitem__(0, "model-r00000-00009.safetensors")),
                 "file 'model-r00000-00009.safetensors' is not one of rank 1's files", "forged",
                 id="table-lists-another-ranks-file"),
    pytest.param(_deep_table, "shardpoint-r00001.json: not a JSON object", "nests JSON too deeply", id="deep-table"),
    pytest.param(_flip_byte, "shardpoint-r00002.json is", "the table is damaged or from another save", id="damaged-table"),
    pytest.param(lambda c: (c / "shardpoint-r00003.json").unlink(), "shardpoint-r00003.json", "", id="missing-table"),
    pytest.param(lambda c: _rewrite_table(c, 1, lambda t: t.__setitem__("save_id", "0" * 32)),
                 "shardpoint-r00001.json", "not save", id="table-of-another-save"),
    pytest.param(lambda c: _rewrite_table(c, 2, lambda t: t.__setitem__("chunks", [])),
                 "is missing from shardpoint-r00002.json", "incomplete", id="table-missing-a-chunk"),
    pytest.param(lambda c: _rewrite_table(c, 1, lambda t: t["files"][0].__setitem__(0, "../escape.safetensors")),
                 "../escape.safetensors", "", id="table-file-leaves-directory"),
    pytest.param(lambda c: _rewrite_table(c, 1, lambda t: t["chunks"].append([0, 2, 0, 5])),
                 "tensor 'model/w': cell 2 is not one rank 1 writes", "forged", id="table-claims-another-ranks-cell"),
    pytest.param(lambda c: _rewrite_table(c, 0, lambda t: t.__setitem__("chunks", [[99, 0, 0, 0]])),
                 "is out of range", "forged", id="table-slot-out-of-range"),
    pytest.param(lambda c: _rewrite_manifest(c, _set_tensor("w", "grid", [1_000_000, 1])),
                 "has more cells than the 4 ranks", "forged", id="grid-larger-than-world"),
    pytest.param(lambda c: _rewrite_manifest(c, _set_tensor("b", "writer", [4, [0]])),
                 "written by rank 4, but only 4 ranks saved it", "forged", id="writer-outside-world"),
    pytest.param(lambda c: _rewrite_manifest(c, lambda m: m.__setitem__("tables", m["tables"][:3])),
                 "'tables' must list one [size, crc32c] per rank", "forged", id="tables-short"),
    pytest.param(lambda c: _rewrite_manifest(c, _set_tensor("w", "chunks", [])),
                 "exactly dtype, shape, grid, writer", "forged", id="rule-and-chunks"),
]


@pytest.mark.parametrize(("forge", "names", "says"), FORGERIES)
def test_forged_rules_and_tables_are_refused_by_name(
    saved: Path, tmp_path: Path, forge: Any, names: str, says: str
) -> None:
    ckpt = _copy(saved, tmp_path)
    forge(ckpt)
    with pytest.raises(sp.CheckpointError) as exc:
        sp.load(ckpt)
    assert names in str(exc.value) and says in str(exc.value), str(exc.value)
    assert isinstance(exc.value, (sp.CorruptCheckpointError, sp.MissingShardError)), type(exc.value)
    report = verify_checkpoint(ckpt)
    assert not report.ok and any(names in p for p in report.problems), report.problems


def test_a_table_file_from_another_save_is_refused(saved: Path, tmp_path: Path) -> None:
    """Two saves of the same structure: swapping in the other's table (its bytes are a valid
    table) fails on the manifest's crc32c before the table is parsed."""
    ckpt = _copy(saved, tmp_path)
    other = saved.parent / "first"
    shutil.copy(other / "shardpoint-r00001.json", ckpt / "shardpoint-r00001.json")
    with pytest.raises(sp.CorruptCheckpointError, match=r"shardpoint-r00001\.json is \d+ bytes with crc32c"):
        sp.load(ckpt)


def reuse_worker(rank: int, world: int, root: str) -> None:
    """Plan reuse on the path of explicit chunk lists (layout hf, and a state that is not
    regular), and the coordinator asking again when it no longer holds a rank's list."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardpoint._distributed import plan_cache

    mesh = init_device_mesh("cpu", (world,))
    full = expected()

    def state(k: int) -> dict[str, Any]:
        return {"w": distribute_tensor(full["w"] * k, mesh, [Shard(0)]), "b": full["b"] * k}

    got = []
    for k, layout in ((1, "hf"), (2, "hf"), (3, "hf")):
        if k == 3 and rank == 0:
            plan_cache.PLANS.clear()  # the coordinator forgot (a restarted process): ranks must resend
        got.append(sp.save(state(k), Path(root) / f"{layout}-{k}", layout=layout).plan_reused)
    assert got == [False, True, False], (rank, got)
    assert plan_cache.PLANS.resends == (1 if rank == 0 else 0)  # the save after forgetting
    # Rank 0 alone changes (one more tensor, written by it): only its list travels, the
    # coordinator plans with rank 1's list from the last plan; no resend.
    changed = sp.save({**state(4), "extra": full["r"]}, Path(root) / "hf-4", layout="hf")
    assert not changed.plan_reused and plan_cache.PLANS.resends == (1 if rank == 0 else 0)
    # A DDP state of one small tensor: one rank writes it, the other writes no table at all.
    import torch.distributed as dist

    sp.save({"b": full["b"]}, Path(root) / "ddp", layout="chunked", process_group=dist.group.WORLD)
    # Ranks holding different tensors (pipeline stages): descriptions that differ, so the
    # coordinator asks every rank for its chunk list and its tree, and plans from the lists:
    # each rank's own tensors are kept (they were refused; before that, dropped).
    stage = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), f"stage{rank}.b": full["b"] + rank}
    sp.save(stage, Path(root) / "stages-own", layout="chunked")
    stages = sp.load(Path(root) / "stages-own")
    assert sorted(stages) == ["stage0.b", "stage1.b", "w"], sorted(stages)
    assert all(torch.equal(stages[f"stage{r}.b"], full["b"] + r) for r in range(world))
    # Every rank passing the whole structure: saved, every tensor loadable.
    stage = {"shared": {"w": distribute_tensor(full["w"], mesh, [Shard(0)])}}
    stage.update({f"stage{r}": {"b": full["b"] + r} for r in range(world)})
    sp.save(stage, Path(root) / "stages", layout="chunked")


def test_plan_reuse_with_explicit_chunk_lists(tmp_path: Path) -> None:
    run_ranks(reuse_worker, 2, str(tmp_path), timeout=180)
    full = expected()
    for k in (1, 2, 3):
        loaded = sp.load(tmp_path / f"hf-{k}")
        assert torch.equal(loaded["w"], full["w"] * k) and torch.equal(loaded["b"], full["b"] * k), k
        assert json.loads((tmp_path / f"hf-{k}" / "shardpoint.json").read_text())["layout"] == "hf"
    ddp = tmp_path / "ddp"
    assert json.loads((ddp / "shardpoint.json").read_text())["tables"][1] is None
    assert sorted(p.name for p in ddp.iterdir()) == [
        "model-r00000-00001.safetensors", "shardpoint-r00000.json", "shardpoint.json"]
    assert torch.equal(sp.load(ddp)["b"], full["b"]) and verify_checkpoint(ddp).ok
    four = sp.load(tmp_path / "hf-4")
    assert torch.equal(four["w"], full["w"] * 4) and torch.equal(four["extra"], full["r"])
    stages = sp.load(tmp_path / "stages")
    assert torch.equal(stages["shared"]["w"], full["w"])
    assert torch.equal(stages["stage0"]["b"], full["b"]) and torch.equal(stages["stage1"]["b"], full["b"] + 1)


def test_manifest_and_tables_validate_against_the_shipped_schemas(saved: Path) -> None:
    from importlib import resources

    import jsonschema

    schemas = resources.files("shardpoint._format")
    manifest_schema = json.loads(schemas.joinpath("manifest.schema.json").read_text())
    table_schema = json.loads(schemas.joinpath("table.schema.json").read_text())
    for schema in (manifest_schema, table_schema):
        jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads((saved / "shardpoint.json").read_text()), manifest_schema)
    for rank in range(4):
        jsonschema.validate(json.loads((saved / f"shardpoint-r{rank:05d}.json").read_text()), table_schema)
    # A rule entry that also lists chunks is not a valid manifest.
    doc = json.loads((saved / "shardpoint.json").read_text())
    doc["components"]["model"]["tensors"]["w"]["chunks"] = [{"file": "x", "crc32c": 0}]
    assert list(jsonschema.Draft202012Validator(manifest_schema).iter_errors(doc))


def test_an_async_save_is_planned_by_the_same_rules(saved: Path) -> None:
    staged = saved.parent / "async"
    doc = json.loads((staged / "shardpoint.json").read_text())
    sync = json.loads((saved / "shardpoint.json").read_text())
    assert doc["components"] == sync["components"] and len(doc["tables"]) == 4
    loaded = sp.load(staged)
    assert all(torch.equal(loaded[n], t) for n, t in expected().items())


def test_inspect_counts_the_tables_as_the_checkpoints_own(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardpoint._cli.main import main

    assert main(["inspect", "--json", str(saved)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == 3 and doc["layout"] == "chunked" and doc["world_size"] == 4
    assert doc["unchecked"] == []  # the four tables are the checkpoint's, not "other files"
    assert sorted(f["name"] for f in doc["files"]) == [f"model-r{r:05d}-00001.safetensors" for r in range(4)]


def test_a_tensor_added_to_a_rank_file_fails_verify(saved: Path, tmp_path: Path) -> None:
    """A tensor added to a rank's data file (the table's size and the manifest's crc of the
    table forged to match): verify warned and said OK. A save writes none: a problem."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardpoint._verify import verify_checkpoint

    ckpt = _copy(saved, tmp_path)
    name = json.loads((ckpt / "shardpoint-r00000.json").read_text())["files"][0][0]
    with safe_open(str(ckpt / name), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file({**tensors, "evil": torch.ones(2)}, str(ckpt / name), metadata=metadata)
    _rewrite_table(ckpt, 0, lambda t: t["files"][0].__setitem__(1, (ckpt / name).stat().st_size))
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert report.problems == [
        f"{ckpt / name} holds 1 tensor(s) the manifest does not list in it ('evil'); a save writes none, and other "
        "readers (transformers loads every tensor of every file) would load them where shardpoint does not: the "
        "file was changed after its save. Restore it from a copy"
    ], report.problems
