"""Checkpoints in the Hugging Face cache: snapshot folders of symlinks into ``blobs/``, and
``hf://org/name@revision`` references resolved offline.

The cache is built with ``huggingface_hub``'s own conventions (``repo_folder_name``, blobs
named by their sha256, ``snapshots/<commit>/<file>`` -> ``../../blobs/<hash>``,
``refs/main``), and each test first checks that ``scan_cache_dir`` and
``try_to_load_from_cache`` see it, so the layout is provably theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import scan_cache_dir, try_to_load_from_cache
from huggingface_hub.file_download import repo_folder_name
from safetensors.torch import save_file

import shardpoint as sp
from shardpoint._cli.main import main
from shardpoint._hub import parse_hub_ref, resolve_hub_ref
from shardpoint._verify import verify_checkpoint

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LAYOUTS = ["single", "sharded", "bin", "shardpoint"]


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def _write_layout(layout: str, model: LlamaForCausalLM, directory: Path) -> None:
    """The files of one checkpoint layout, written by the library that makes them."""
    sd = model.state_dict()
    if layout == "single":
        model.save_pretrained(directory)  # model.safetensors + config.json
        assert (directory / "model.safetensors").is_file()
    elif layout == "sharded":
        model.save_pretrained(directory, max_shard_size="20KB")
        assert (directory / "model.safetensors.index.json").is_file()
    elif layout == "bin":
        directory.mkdir(parents=True)
        weight_map = {}
        names = list(sd)
        for i in range(3):
            fname = f"pytorch_model-{i + 1:05d}-of-00003.bin"
            part = {k: sd[k].clone() for k in names[i::3]}
            torch.save(part, directory / fname)
            weight_map.update(dict.fromkeys(part, fname))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    else:
        sp.save(sd, directory, max_shard_size="20KB")


def _add_to_cache(cache: Path, repo_id: str, source: Path, *, repo_type: str = "model",
                  commit: str = COMMIT, subfolder: str = "") -> Path:
    """Put every file of ``source`` in the cache as ``huggingface_hub`` does; the snapshot."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for path in sorted(source.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / subfolder / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snapshot / subfolder if subfolder else snapshot


def _reference_state(layout: str, model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One cache holding each layout as its own repository, plus the states they hold."""
    root = tmp_path_factory.mktemp("hfcache")
    cache = root / "hub"
    model = _model(0)
    snapshots = {}
    for layout in LAYOUTS:
        _write_layout(layout, model, root / "src" / layout)
        snapshots[layout] = _add_to_cache(cache, f"{REPO}-{layout}", root / "src" / layout)
    return {"root": root, "cache": cache, "snapshots": snapshots,
            "state": _reference_state("single", model), "sources": root / "src"}


def test_the_cache_layout_is_huggingface_hubs(built: dict[str, object]) -> None:
    cache = built["cache"]
    info = scan_cache_dir(cache)
    assert info.warnings == []
    repos = {r.repo_id: r for r in info.repos}
    assert sorted(repos) == sorted(f"{REPO}-{layout}" for layout in LAYOUTS)
    for layout in LAYOUTS:
        repo = repos[f"{REPO}-{layout}"]
        (revision,) = repo.revisions
        assert revision.commit_hash == COMMIT and revision.refs == frozenset({"main"})
        assert all(f.blob_path.parent.name == "blobs" for f in revision.files)
    found = try_to_load_from_cache(f"{REPO}-single", "model.safetensors", cache_dir=cache)
    assert found == str(built["snapshots"]["single"] / "model.safetensors")
    assert os.path.islink(found)
    index = try_to_load_from_cache(f"{REPO}-bin", "pytorch_model.bin.index.json", cache_dir=cache)
    assert index == str(built["snapshots"]["bin"] / "pytorch_model.bin.index.json")


def _assert_state(loaded: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("named", ["snapshot", "hf"])
def test_every_read_path_works_on_a_cached_snapshot(
    built: dict[str, object], tmp_path: Path, layout: str, named: str
) -> None:
    state = built["state"]
    cache = built["cache"]
    snapshot = built["snapshots"][layout]
    ref = f"hf://{REPO}-{layout}"
    where = str(snapshot) if named == "snapshot" else ref
    opts = None if named == "snapshot" else {"cache_dir": str(cache)}

    _assert_state(sp.load(where, storage_options=opts), state)
    key = "model.layers.1.mlp.down_proj.weight"
    if layout == "bin":
        with pytest.raises(sp.CheckpointError, match=r"holds \.bin \(torch\.save\) weights; mmap=True needs safetensors"):
            sp.load(where, keys=[key], mmap=True, storage_options=opts)
        assert torch.equal(sp.load(where, keys=[key], storage_options=opts)[key], state[key])
    else:
        assert torch.equal(sp.load(where, keys=[key], mmap=True, storage_options=opts)[key], state[key])

    target = _model(1)
    result = sp.load_into(target, where, storage_options=opts)
    assert result.ok
    _assert_state(target.state_dict(), state)

    cache_dir = None if named == "snapshot" else cache
    report = sp.diff(where, built["sources"] / layout, cache_dir=cache_dir)
    assert report.equal and len(report.tensors) == len(state)
    out = tmp_path / "out"
    sp.convert(where, out, dtype="bf16", cache_dir=cache_dir)
    converted = sp.load(out)
    assert converted[key].dtype == torch.bfloat16
    assert torch.equal(converted[key], state[key].to(torch.bfloat16))

    if layout != "bin":  # verify reads safetensors checkpoints only
        vreport = verify_checkpoint(where, storage_options=opts)
        assert vreport.ok, vreport.problems
        assert vreport.tensors_checked == len(state)
        assert vreport.kind == {"single": "hf-file", "sharded": "hf-index",
                                "shardpoint": "shardpoint"}[layout]
        assert vreport.checksums is (layout == "shardpoint")


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cli_commands_on_a_cached_repository(
    built: dict[str, object], tmp_path: Path, layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = built["cache"]
    ref = f"hf://{REPO}-{layout}@main"
    n = len(built["state"])
    snapshot = built["snapshots"][layout]
    if layout != "bin":  # inspect and verify read safetensors checkpoints
        for where in (ref, snapshot):
            extra = ["--cache-dir", cache] if where == ref else []
            code, out, err = _cli(capsys, "inspect", where, *extra)
            assert code == 0, err
            assert f"{n} tensors" in out
            code, out, err = _cli(capsys, "inspect", where, "--json", *extra)
            assert code == 0, err
            doc = json.loads(out)  # "path" is what was given; "resolved" where an hf:// reference was found
            assert doc["tensor_count"] == n and doc["path"] == str(where)
            assert doc.get("resolved") == (str(snapshot) if where == ref else None)
            code, out, err = _cli(capsys, "verify", where, *extra)
            assert code == 0, (out, err)
            assert "OK:" in out
            code, out, err = _cli(capsys, "verify", where, "--json", *extra)
            assert code == 0, (out, err)
            doc = json.loads(out)
            assert doc["ok"] is True and doc["tensors_checked"] == n and doc["path"] == str(where)
            assert doc.get("resolved") == (str(snapshot) if where == ref else None)
    code, out, err = _cli(capsys, "diff", ref, built["sources"] / layout, "--cache-dir", cache)
    assert code == 0, err
    code, out, err = _cli(capsys, "diff", snapshot, ref, "--json", "--cache-dir", cache)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["equal"] is True and doc["a"] == str(snapshot) and doc["b"] == ref
    code, out, err = _cli(capsys, "convert", ref, tmp_path / "c1", "--cache-dir", cache,
                          "--no-progress")
    assert code == 0, err
    assert f"converted {snapshot} (" in out
    _assert_state(sp.load(tmp_path / "c1"), built["state"])


def test_subfolder_of_a_snapshot_and_datasets_repository(tmp_path: Path) -> None:
    """``snapshots/<rev>/sub/`` links go three levels up to blobs; datasets-- repos work too."""
    cache = tmp_path / "hub"
    src = tmp_path / "src"
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    sp.save(state, src / "ckpt", max_shard_size=16)
    (src / "README.md").write_text("readme")
    sub = _add_to_cache(cache, "org/data", src, repo_type="dataset")
    assert os.readlink(sub / "ckpt" / "shardpoint.json").startswith("../../../blobs/")
    info = scan_cache_dir(cache)
    assert [(r.repo_type, r.repo_id) for r in info.repos] == [("dataset", "org/data")]
    for where in (sub / "ckpt", "hf://datasets/org/data/ckpt", f"hf://datasets/org/data@{COMMIT}/ckpt"):
        opts = None if isinstance(where, Path) else {"cache_dir": str(cache)}
        _assert_state(sp.load(where, storage_options=opts), state)
        assert verify_checkpoint(where, storage_options=opts).ok


def test_a_file_of_a_snapshot_named_in_the_reference(tmp_path: Path) -> None:
    """``hf://org/name/model.safetensors``: every cached file is a link into blobs/, which is
    followed for a named file as for a folder's files; a blob linking out is still refused."""
    cache = tmp_path / "hub"
    src = tmp_path / "src"
    state = {"w": torch.arange(4.0)}
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    snapshot = _add_to_cache(cache, REPO, src)
    assert os.path.islink(snapshot / "model.safetensors")
    opts = {"cache_dir": str(cache)}
    _assert_state(sp.load(f"hf://{REPO}/model.safetensors", storage_options=opts), state)
    _assert_state(sp.load(f"hf://{REPO}@{COMMIT}/model.safetensors", storage_options=opts), state)
    outside = tmp_path / "outside.safetensors"
    blob = Path(os.path.realpath(snapshot / "model.safetensors"))
    os.replace(blob, outside)
    os.symlink(outside, blob)
    with pytest.raises(sp.UnsafePathError, match="is a link that leaves the cached snapshot"):
        sp.load(f"hf://{REPO}/model.safetensors", storage_options=opts)


@pytest.mark.parametrize("cache_dir", [5, ["hub"], b"hub"])
def test_cache_dir_that_is_not_a_path_is_refused_by_type(cache_dir: object) -> None:
    with pytest.raises(sp.InvalidArgumentTypeError) as exc:
        sp.load(f"hf://{REPO}", storage_options={"cache_dir": cache_dir})
    assert str(exc.value) == (
        "cache_dir must be a path (str or os.PathLike) naming a Hugging Face cache folder, "
        f"not {type(cache_dir).__name__}"
    )


def test_cache_reached_through_symlinked_hf_home_and_symlinked_blobs(tmp_path: Path) -> None:
    """HF_HOME is a link to another disk, and blobs/ is itself a link to a third one."""
    real = tmp_path / "disk1"
    src = tmp_path / "src"
    sp.save({"w": torch.arange(4.0)}, src)
    _add_to_cache(real / "hub", REPO, src)
    repo = real / "hub" / repo_folder_name(repo_id=REPO, repo_type="model")
    moved = tmp_path / "disk2" / "blobs"
    moved.parent.mkdir()
    os.replace(repo / "blobs", moved)
    os.symlink(moved, repo / "blobs")
    home = tmp_path / "home-link"
    os.symlink(real, home)
    snapshot = home / "hub" / repo.name / "snapshots" / COMMIT
    assert sp.load(snapshot)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sp.load(f"hf://{REPO}", storage_options={"cache_dir": str(home / "hub")})["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("layout", ["single", "bin", "shardpoint"])
def test_link_leaving_the_cached_repository_is_refused_by_name(tmp_path: Path, layout: str) -> None:
    """A snapshot link into another repository's blobs, or out of the cache, is refused."""
    cache = tmp_path / "hub"
    model = _model(0)
    _write_layout(layout, model, tmp_path / "src")
    snapshot = _add_to_cache(cache, REPO, tmp_path / "src")
    other = _add_to_cache(cache, "someone/else", tmp_path / "src")
    name = {"single": "model.safetensors", "bin": "pytorch_model-00002-of-00003.bin",
            "shardpoint": "shardpoint.json"}[layout]
    foreign = os.path.realpath(other / name)
    (snapshot / name).unlink()
    os.symlink(os.path.relpath(foreign, snapshot), snapshot / name)
    expected = f"{snapshot}: {name!r} is a symlink that leaves the checkpoint directory (to {foreign})"
    with pytest.raises(sp.UnsafePathError) as exc:
        sp.load(f"hf://{REPO}", storage_options={"cache_dir": str(cache)})
    assert str(exc.value).startswith(expected)
    with pytest.raises(sp.UnsafePathError) as exc:
        sp.load_into(_model(1), snapshot)
    assert str(exc.value).startswith(expected)
    with pytest.raises(sp.UnsafePathError) as exc:
        sp.convert(snapshot, tmp_path / "out")
    assert str(exc.value).startswith(expected)
    with pytest.raises(sp.UnsafePathError) as exc:
        sp.diff(snapshot, tmp_path / "src")
    assert str(exc.value).startswith(expected)
    assert not (tmp_path / "out").exists()


def test_blob_that_is_a_link_out_of_the_cache_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    src = tmp_path / "src"
    sp.save({"w": torch.arange(4.0)}, src)
    snapshot = _add_to_cache(cache, REPO, src)
    outside = tmp_path / "outside.safetensors"
    blob = Path(os.path.realpath(snapshot / "model.safetensors"))
    os.replace(blob, outside)
    os.symlink(outside, blob)
    with pytest.raises(sp.UnsafePathError) as exc:
        sp.load(snapshot)
    assert str(exc.value).startswith(
        f"{snapshot}: 'model.safetensors' is a symlink that leaves the checkpoint directory (to {outside})"
    )


def test_uncached_repository_revision_and_subfolder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    src = tmp_path / "src"
    sp.save({"w": torch.arange(4.0)}, src)
    _add_to_cache(cache, REPO, src)
    opts = {"cache_dir": str(cache)}
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        sp.load("hf://nobody/nothing", storage_options=opts)
    assert str(exc.value) == (
        f"hf://nobody/nothing: the model repository nobody/nothing is not in the local Hugging "
        f"Face cache ({cache}); shardpoint never downloads; fetch it first with `hf download "
        "nobody/nothing` (or huggingface_hub.snapshot_download('nobody/nothing')), or name the "
        "cache folder that holds it (cache_dir / --cache-dir)"
    )
    with pytest.raises(sp.CheckpointNotFoundError, match=r"revision 'v2' of the model repository "
                       rf"{REPO} is not in the local Hugging Face cache .* `hf download {REPO} --revision v2`"):
        sp.load(f"hf://{REPO}@v2", storage_options=opts)
    missing_commit = "f" * 40
    with pytest.raises(sp.CheckpointNotFoundError, match=f"commit {missing_commit} of the model repository"):
        sp.load(f"hf://{REPO}@{missing_commit}", storage_options=opts)
    with pytest.raises(sp.CheckpointNotFoundError, match=r"'sub' is not in the cached snapshot"):
        sp.diff(f"hf://{REPO}@main/sub", src, cache_dir=cache)
    with pytest.raises(sp.CheckpointError, match=r"storage_options \['token'\] do not apply to hf://"):
        sp.load(f"hf://{REPO}", storage_options={"cache_dir": str(cache), "token": "x"})
    # A relative path reading like a cached repository id is never looked up in the cache:
    # the error says how to name it.
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        sp.diff(REPO, src, cache_dir=cache)
    assert str(exc.value) == (
        f"{REPO} does not exist as a local path; the repository {REPO} is in the local Hugging "
        f"Face cache ({cache}): name it as hf://{REPO} to read it from there"
    )
    # A local directory named like a repository is a local directory, never a cache lookup.
    sp.save({"w": torch.zeros(2)}, work / REPO)
    assert sp.load(REPO)["w"].tolist() == [0.0, 0.0]
    assert sp.diff(REPO, work / REPO, cache_dir=cache).equal


def test_uncached_repository_cli_error_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _cli(capsys, "inspect", "hf://nobody/nothing", "--cache-dir", tmp_path)
    assert code == 2 and out == ""
    assert err == (
        f"shardpoint: error: hf://nobody/nothing: the model repository nobody/nothing is not in "
        f"the local Hugging Face cache ({tmp_path}); shardpoint never downloads; fetch it first "
        "with `hf download nobody/nothing` (or huggingface_hub.snapshot_download('nobody/nothing')), "
        "or name the cache folder that holds it (cache_dir / --cache-dir)\n"
    )


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("hf://", "'' is not a repository id"),
        ("hf://a/b/../c", "the subfolder '../c' is not a plain relative path"),
        ("hf://org/name@", "an empty revision after '@'"),
        ("hf://org/name@..%2F..%2Fx", "the revision '../../x' is not a branch, tag or commit"),
        ("hf://org/na--me", "'org/na--me' is not a repository id"),
        # What the Hub refuses, refused here too (was a bare HFValidationError from
        # huggingface_hub, a traceback in the CLI): non-ASCII letters, a part that starts or
        # ends with '-' or '.', an id over 96 characters.
        ("hf://org/na\u00e9me", "'org/na\u00e9me' is not a repository id"),
        ("hf://org-/name", "'org-/name' is not a repository id"),
        ("hf://.org/name", "'.org/name' is not a repository id"),
        ("hf://org/name.", "'org/name.' is not a repository id"),
        ("hf://org/a..b", "'org/a..b' is not a repository id"),
        ("hf://" + "a" * 60 + "/" + "b" * 60, f"'{'a' * 60}/{'b' * 60}' is not a repository id"),
    ],
)
def test_malformed_references(ref: str, why: str) -> None:
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        parse_hub_ref(ref)
    assert str(exc.value).startswith(f"{ref} is not a Hugging Face cache reference shardpoint understands ({why})")


def test_damaged_refs_file_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    src = tmp_path / "src"
    sp.save({"w": torch.arange(4.0)}, src)
    snapshot = _add_to_cache(cache, REPO, src)
    ref_file = snapshot.parent.parent / "refs" / "main"
    ref_file.unlink()
    os.mkfifo(ref_file)  # a FIFO would block a plain open() forever
    with pytest.raises(sp.CorruptCheckpointError, match=f"{ref_file} is not a regular file"):
        resolve_hub_ref(f"hf://{REPO}", cache)
    ref_file.unlink()
    ref_file.write_text("not a hash")
    with pytest.raises(sp.CheckpointNotFoundError, match=f"{ref_file} does not hold a commit hash"):
        resolve_hub_ref(f"hf://{REPO}", cache)


@pytest.mark.slow
def test_hf_home_is_honoured_by_the_cli(tmp_path: Path) -> None:
    """No --cache-dir: the cache comes from HF_HOME, as huggingface_hub reads it."""
    src = tmp_path / "src"
    sp.save({"w": torch.arange(4.0)}, src)
    _add_to_cache(tmp_path / "home" / "hub", REPO, src)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(sys.path))
    code = ("import sys; from shardpoint._cli.main import main; "
            f"sys.exit(main(['verify', 'hf://{REPO}', '--json']))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    expected = tmp_path / "home" / "hub" / repo_folder_name(repo_id=REPO, repo_type="model") / "snapshots" / COMMIT
    assert doc["resolved"] == str(expected) and doc["ok"] is True and doc["bytes_checked"] == 16


def test_docstring_examples() -> None:
    import doctest

    import shardpoint._hub
    import shardpoint._storage.paths

    for module in (shardpoint._hub, shardpoint._storage.paths):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted >= 3, module.__name__


def test_a_snapshot_missing_a_shard_says_to_download_it_again(tmp_path: Path) -> None:
    """An interrupted download leaves part of a snapshot: the error says how to fetch it."""
    cache = tmp_path / "hub"
    src = tmp_path / "src"
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    sp.save(state, src, max_shard_size=300)
    snapshot = _add_to_cache(cache, REPO, src)
    shards = sorted(p.name for p in snapshot.iterdir() if p.name.endswith(".safetensors"))
    assert len(shards) > 1
    (snapshot / shards[-1]).unlink()
    with pytest.raises(sp.MissingShardError) as exc:
        sp.load(f"hf://{REPO}", storage_options={"cache_dir": str(cache)})
    assert str(exc.value).endswith(
        "the checkpoint is incomplete (the Hugging Face cache holds only part of this snapshot (an "
        f"interrupted download?): fetch it again with `hf download {REPO} --revision {COMMIT}`)"
    )


@pytest.mark.parametrize("layout", ["shardpoint", "safetensors-index"])
def test_a_snapshot_whose_manifest_or_index_blob_is_gone_says_to_download_it_again(tmp_path: Path,
                                                                                 layout: str) -> None:
    """A dangling link to the control file read as "replaced 5 times while being opened",
    after five retries."""
    cache, src = tmp_path / "hub", tmp_path / "src"
    model = _model(0)
    if layout == "shardpoint":
        sp.save(model, src)
        control = "shardpoint.json"
    else:
        model.save_pretrained(src, max_shard_size="20KB")
        control = "model.safetensors.index.json"
    snapshot = _add_to_cache(cache, REPO, src)
    (snapshot / control).resolve().unlink()
    with pytest.raises(sp.MissingShardError) as exc:
        sp.load(f"hf://{REPO}", storage_options={"cache_dir": str(cache)})
    assert str(exc.value) == (
        f"{snapshot / control} is a symbolic link to a file that does not exist ({os.readlink(snapshot / control)}); "
        "the Hugging Face cache holds only part of this snapshot (an interrupted download?): fetch it again "
        f"with `hf download {REPO} --revision {COMMIT}`"
    )


def test_writes_to_an_hf_reference_are_refused_at_once(tmp_path: Path) -> None:
    """hf:// is the local cache, read only: a save went to fsspec's Hub filesystem (a network
    error from deep inside, or five retries offline)."""
    sp.save({"w": torch.ones(2)}, tmp_path / "src")
    message = (
        "hf://org/run names a repository in the local Hugging Face cache, which shardpoint only reads (never "
        "downloads, never writes); save to a local folder and upload that with huggingface_hub "
        "(HfApi().upload_folder(folder_path=..., repo_id=...))"
    )
    for write in (lambda: sp.save({"w": torch.ones(2)}, "hf://org/run"),
                  lambda: sp.async_save({"w": torch.ones(2)}, "hf://org/run").result(),
                  lambda: sp.CheckpointManager("hf://org/run"),
                  lambda: sp.convert(tmp_path / "src", "hf://org/run")):
        with pytest.raises(sp.InvalidArgumentError) as exc:
            write()
        assert str(exc.value) == message
