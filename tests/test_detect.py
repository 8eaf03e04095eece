"""The one format detector (``_format.detect``) and every entry point agreeing with it.

The table tests feed ``detect`` plain listings (no files); the entry-point tests build the
cases where the four detectors that came before it disagreed, and check that ``load``,
``load_into``, ``verify``, ``inspect`` and ``convert`` now answer the same.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._cli.inspect import describe_path
from shardpoint._format.detect import KINDS, Detected, detect
from shardpoint._verify import verify_checkpoint

ROOT = Path(__file__).resolve().parent.parent

NOT_A_CHECKPOINT = (
    "is not a checkpoint: no shardpoint.json, no *.safetensors.index.json and no single "
    ".safetensors file (found {st} .safetensors files, {ix} indexes), no "
    "pytorch_model.bin.index.json, no single .bin/.pt weights file (found {pt}) and no DCP .metadata"
)

HF_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]

# (listing, expected Detected)
DIRECTORY_CASES = [
    pytest.param(["shardpoint.json", "model.safetensors"], Detected("shardpoint", index="shardpoint.json"),
                 id="shardpoint"),
    pytest.param(
        # a shardpoint checkpoint with an HF index (its own, or a stray one) beside the manifest
        ["shardpoint.json", *HF_SHARDS, "model.safetensors.index.json", "pytorch_model.bin"],
        Detected("shardpoint", index="shardpoint.json"),
        id="shardpoint-beside-hf-index",
    ),
    pytest.param(["shardpoint.pending", "model.safetensors"],
                 Detected("uncommitted", reason="is a save that never committed (shardpoint.pending is "
                          "there, shardpoint.json is not): it was interrupted or is still running"),
                 id="pending-without-manifest"),
    pytest.param(["shardpoint.pending", "shardpoint.json", "model.safetensors"],
                 Detected("shardpoint", index="shardpoint.json"), id="pending-beside-manifest"),
    pytest.param([*HF_SHARDS, "model.safetensors.index.json", "config.json"],
                 Detected("hf-index", index="model.safetensors.index.json"), id="hf-index"),
    pytest.param(
        # an HF cache snapshot: every name is a symlink into blobs/; the listing is all that counts
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", ".gitattributes"],
        Detected("hf-file", file="model.safetensors"),
        id="hf-cache-snapshot",
    ),
    pytest.param(["model.safetensors", *HF_SHARDS, "model.safetensors.index.json"],
                 Detected("hf-file", file="model.safetensors"), id="model-safetensors-beats-index"),
    pytest.param(["adapter.safetensors.index.json", "model.safetensors.index.json", *HF_SHARDS],
                 Detected("hf-index", index="model.safetensors.index.json"), id="model-index-among-several"),
    pytest.param(["a.safetensors.index.json", "b.safetensors.index.json", "weights.safetensors"],
                 Detected("hf-file", file="weights.safetensors"), id="several-indexes-one-file"),
    pytest.param(["weights.safetensors", "config.json"], Detected("hf-file", file="weights.safetensors"),
                 id="one-safetensors-file"),
    pytest.param(
        ["model.safetensors", "pytorch_model.bin", "training_args.bin", "pytorch_model.bin.index.json"],
        Detected("hf-file", file="model.safetensors",
                 skipped=("pytorch_model.bin", "pytorch_model.bin.index.json")),
        id="bin-and-safetensors",
    ),
    pytest.param(["a.safetensors", "b.safetensors", "pytorch_model.bin"],
                 Detected("unknown", reason=NOT_A_CHECKPOINT.format(st=2, ix=0, pt=1)
                          + "; of its weights files ('a.safetensors', 'b.safetensors'), give the path of the one to read"),
                 id="two-safetensors-no-index"),
    pytest.param([".metadata", "__0_0.distcp", "__1_0.distcp"], Detected("dcp", index=".metadata"), id="dcp"),
    pytest.param(["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                  "pytorch_model.bin.index.json", "other.bin.index.json"],
                 Detected("hf-bin", index="pytorch_model.bin.index.json"), id="bin-index"),
    pytest.param(["b.bin.index.json", "a.bin.index.json"], Detected("hf-bin", index="a.bin.index.json"),
                 id="bin-index-first-sorted"),
    pytest.param(["pytorch_model.bin", "training_args.bin", "optimizer.pt", "rng_state.pth"],
                 Detected("torch-save", file="pytorch_model.bin"), id="bin-file-beside-training-state"),
    pytest.param(["weights.pt", "config.json"], Detected("torch-save", file="weights.pt"), id="one-pt-file"),
    pytest.param(["optimizer.pt", "config.json"],
                 Detected("unknown", reason=NOT_A_CHECKPOINT.format(st=0, ix=0, pt=0)),
                 id="only-training-state"),
    pytest.param(["a.pt", "b.pt"], Detected("unknown", reason=NOT_A_CHECKPOINT.format(st=0, ix=0, pt=2)),
                 id="two-pt-files"),
    pytest.param(["model.safetensors.index.json", "config.json"],
                 Detected("hf-index", index="model.safetensors.index.json"), id="index-whose-shards-are-gone"),
    pytest.param(["model.safetensors.index.json", "pytorch_model.bin"],
                 Detected("torch-save", file="pytorch_model.bin"), id="safetensors-index-without-files-and-a-bin"),
    pytest.param([], Detected("unknown", reason=NOT_A_CHECKPOINT.format(st=0, ix=0, pt=0)), id="empty"),
    pytest.param([".ckpt.tmp-0123abcd", "config.json"],
                 Detected("unknown", reason="holds no committed checkpoint, only the temporary directory "
                          "of a save that did not finish"),
                 id="only-a-temporary-directory"),
]


@pytest.mark.parametrize(("names", "expected"), DIRECTORY_CASES)
def test_detect_directory(names: list[str], expected: Detected) -> None:
    assert detect(names) == expected
    assert detect(list(reversed(names))) == expected  # the listing's order never matters
    assert expected.kind in KINDS


ZIP = b"PK\x03\x04\x00\x00\x00\x00\x08\x00"
PICKLE = b"\x80\x04\x95\x1e\x00\x00\x00\x00"
SAFETENSORS = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"

NOT_A_FILE_WE_READ = (
    "is a file but neither a .safetensors file nor a torch.save file (.bin, .pt, .pth, .ckpt, or a "
    "zip archive / pickle); shardpoint reads checkpoint directories and files of those kinds"
)

# (file named, its directory's listing, first bytes, expected Detected)
FILE_CASES = [
    pytest.param("model.safetensors", ["model.safetensors"], SAFETENSORS,
                 Detected("hf-file", file="model.safetensors", named_file=True), id="safetensors"),
    pytest.param("model.safetensors", [], None, Detected("hf-file", file="model.safetensors", named_file=True),
                 id="safetensors-on-a-store-no-head"),
    pytest.param(
        # a file with a .safetensors suffix that is not one: still read as safetensors, and the
        # header reader says what it is (test_misnamed_pickle_is_named_by_every_reader)
        "model.safetensors", ["model.safetensors"], PICKLE,
        Detected("hf-file", file="model.safetensors", named_file=True), id="pickle-named-safetensors",
    ),
    pytest.param("model.pt", ["model.pt", "model.safetensors"], ZIP,
                 Detected("hf-file", file="model.safetensors", instead_of="model.pt", named_file=True),
                 id="pt-with-safetensors-sibling"),
    pytest.param("model.pt", ["model.pt", "other.safetensors"], ZIP,
                 Detected("torch-save", file="model.pt", named_file=True), id="pt"),
    pytest.param("pytorch_model.bin", ["pytorch_model.bin"], None,
                 Detected("torch-save", file="pytorch_model.bin", named_file=True), id="bin-by-suffix"),
    pytest.param("weights.model", ["weights.model"], ZIP,
                 Detected("torch-save", file="weights.model", named_file=True), id="zip-under-odd-suffix"),
    pytest.param("weights.model", ["weights.model", "weights.safetensors"], PICKLE,
                 Detected("hf-file", file="weights.safetensors", instead_of="weights.model", named_file=True),
                 id="pickle-under-odd-suffix-with-sibling"),
    pytest.param("notes.txt", ["notes.txt"], b"hello world, t",
                 Detected("unknown", named_file=True, reason=NOT_A_FILE_WE_READ), id="text-file"),
    pytest.param("weights.model", [], None, Detected("unknown", named_file=True, reason=NOT_A_FILE_WE_READ),
                 id="odd-suffix-no-head"),
]


@pytest.mark.parametrize(("name", "siblings", "head", "expected"), FILE_CASES)
def test_detect_file(name: str, siblings: list[str], head: bytes | None, expected: Detected) -> None:
    assert detect(siblings, file=name, head=head) == expected


# ------------------------------------------------------ every entry point, the same answer


def _load_into(path: Path) -> Any:
    return sp.load_into({"w": torch.zeros(2)}, path)


def _convert(path: Path) -> Any:
    return sp.convert(path, path.parent / "converted")


def _verify(path: Path) -> Any:
    return verify_checkpoint(path)


def _inspect(path: Path) -> Any:
    return describe_path(str(path), None, pattern=None, limit=0)


READERS = [sp.load, _load_into, _convert, _verify, _inspect]
READER_IDS = ["load", "load_into", "convert", "verify", "inspect"]


@pytest.mark.parametrize("read", READERS, ids=READER_IDS)
def test_a_folder_holding_only_training_state_is_not_a_checkpoint(tmp_path: Path, read: Any) -> None:
    """Before: load and convert read a lone ``optimizer.pt`` as the model's weights (and
    refused it as a pickle), verify and inspect said "not a checkpoint". Now all say so."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"state": {}, "param_groups": []}, run / "optimizer.pt")
    (run / "config.json").write_text("{}")
    expected = f"{run} " + NOT_A_CHECKPOINT.format(st=0, ix=0, pt=0)
    with pytest.raises(sp.CheckpointNotFoundError, match=re.escape(expected)):
        read(run)


@pytest.mark.parametrize("read", READERS, ids=READER_IDS)
def test_a_copied_uncommitted_save_is_refused_locally_too(tmp_path: Path, read: Any) -> None:
    """A prefix copied down from a store while its save ran (``shardpoint.pending``, data,
    no manifest): the store was refused, the local copy was read as a Hugging Face checkpoint.
    Now both are a save that never committed."""
    copy = tmp_path / "copy"
    sp.save({"w": torch.ones(2)}, copy)
    (copy / "shardpoint.json").unlink()
    (copy / "shardpoint.pending").write_bytes(b"a shardpoint save is in progress\n")
    message = (
        f"{copy} is a save that never committed (shardpoint.pending is there, shardpoint.json is not)"
    )
    if read is _verify:
        report = read(copy)
        assert not report.ok
        assert report.problems == [f"{message}; it is not a checkpoint. Verify the previous one, or save again"]
        return
    with pytest.raises(sp.IncompleteCheckpointError, match=re.escape(message + ": it was interrupted")):
        read(copy)


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    return tmp_path / "dcp"


@pytest.mark.parametrize("read", [sp.load, _load_into, _verify, _inspect], ids=READER_IDS[:2] + READER_IDS[3:])
def test_a_dcp_directory_is_named_by_every_reader(dcp_dir: Path, read: Any) -> None:
    """Before: "not a checkpoint: no shardpoint.json ..." (a DCP directory is one, of a
    format only convert reads). Now each reader names it and says how to convert it."""
    expected = (
        f"{dcp_dir} is a torch.distributed.checkpoint (DCP) directory, which shardpoint reads only "
        "through convert and diff with --trust-pickle (its .metadata is a pickle): `shardpoint "
        "convert SRC DST --trust-pickle`"
    )
    with pytest.raises(sp.UnsupportedFormatError, match=re.escape(expected)):
        read(dcp_dir)
    with pytest.raises(sp.UnsafePickleError, match=re.escape(f"{dcp_dir / '.metadata'} is a pickle")):
        _convert(dcp_dir)


@pytest.mark.parametrize("read", READERS, ids=READER_IDS)
def test_a_file_of_no_format_we_read_is_refused_alike(tmp_path: Path, read: Any) -> None:
    """Before: load/convert tried it as a torch.save file, verify and open_checkpoint said
    "not a .safetensors file" with two different lists. Now one message, one class."""
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(sp.UnsupportedFormatError, match=re.escape(f"{path} {NOT_A_FILE_WE_READ}")):
        read(path)


def test_a_torch_save_file_under_an_odd_suffix_is_read_by_every_reader(tmp_path: Path) -> None:
    """Before: load and convert read it (by content), verify and inspect refused it (by name)."""
    path = tmp_path / "weights.model"
    torch.save({"w": torch.arange(3.0)}, path)
    assert sp.load(path)["w"].tolist() == [0.0, 1.0, 2.0]
    report = verify_checkpoint(path)
    assert (report.ok, report.kind, report.tensors_checked) == (True, "torch-save", 1)
    doc = _inspect(path)
    assert (doc["format"], [t["name"] for t in doc["tensors"]]) == ("torch-save", ["w"])
    sp.convert(path, tmp_path / "out")
    assert sp.load(tmp_path / "out")["w"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("as_member", [False, True], ids=["named-file", "hf-directory-member"])
def test_misnamed_pickle_is_named_by_every_reader(tmp_path: Path, as_member: bool) -> None:
    """A torch.save file under a ``.safetensors`` name: the header error says what it starts as,
    whether the file is named or found in a directory."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "model.safetensors")
    path = folder if as_member else folder / "model.safetensors"
    hint = (
        "the file is damaged or not safetensors (it starts as a zip archive: a torch.save file "
        "under a .safetensors name? Rename it to .pt to read it as one)"
    )
    for read in (sp.load, _load_into, _inspect):
        with pytest.raises(sp.CorruptCheckpointError, match=re.escape(hint)):
            read(path)
    report = verify_checkpoint(path)
    assert not report.ok and hint in report.problems[0], report.problems


# ---------------------------------------------------------------------- import graph


def test_the_import_graph_has_no_cycle() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(ROOT / "src" / "shardpoint")],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    *lazy, last = out.stdout.splitlines()
    assert re.fullmatch(r"\d+ modules, \d+ imports, 0 cycles", last), out.stdout
    assert all(line.startswith("lazy re-export (module __getattr__, not counted): ") for line in lazy), out.stdout


def test_import_cycles_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    # a lazy re-export (PEP 562) and its TYPE_CHECKING declaration: printed, not a cycle
    (pkg / "e.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .f import g\n"
        "def __getattr__(name):\n    from . import f\n    return getattr(f, name)\n"
    )
    (pkg / "f.py").write_text("from .e import h\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(pkg)],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 1
    assert out.stdout == (
        "lazy re-export (module __getattr__, not counted): pkg.e -> pkg.f\n"
        "pkg.a -> pkg.sub.b -> pkg.a (component of 2 modules)\n"
        "pkg.c -> pkg.d -> pkg.c (component of 2 modules)\n"
        "8 modules, 5 imports, 2 cycles\n"
    )


def test_a_safetensors_file_named_otherwise_is_read_by_its_first_bytes(tmp_path: Path) -> None:
    """safetensors.load_file reads weights.st; we refused it as 'neither a .safetensors file
    nor a torch.save file', while a pickle under the same suffix was read (by its bytes)."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "weights.st"), metadata={"format": "pt"})
    assert torch.equal(sp.load(tmp_path / "weights.st")["w"], torch.ones(2))
    target = {"w": torch.zeros(2)}
    assert sp.load_into(target, tmp_path / "weights.st").ok and torch.equal(target["w"], torch.ones(2))
    done = subprocess.run([sys.executable, "-m", "shardpoint", "verify", str(tmp_path / "weights.st")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{tmp_path / 'weights.st'}: hf-file checkpoint, 1 data file"), done.stdout
