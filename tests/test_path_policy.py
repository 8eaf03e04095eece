"""One path policy for every format and every reader (issue 23, items 7 and 8).

Each file a checkpoint directory holds (safetensors index, data file and manifest; ``.bin``
index, shard and single file; DCP ``.metadata`` and ``__0_0.distcp``) is replaced by a
FIFO, a symlink to ``/dev/zero``, a directory, a symlink to a valid file outside the
directory, or (control files) a 2 GiB sparse file; a data file an index names is also
removed or made a dangling link. Every reader that opens that format
(``load``, ``load_into``, ``convert``, ``diff``, ``verify``, ``inspect``) must stop at once
with a CheckpointError naming the file: no hang, no unbounded read, no foreign tensor.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint._cli.main import main
from shardpoint._verify import verify_checkpoint

STATE = {"w": torch.arange(4.0), "b": torch.ones(2)}

# format -> (the file attacked, is it a small control file)
TARGETS = {
    "st-index": ("model.safetensors.index.json", True),
    "st-shard": ("model-00001-of-00002.safetensors", False),
    "st-single": ("model.safetensors", False),
    "manifest": ("shardpoint.json", True),
    "bin-index": ("pytorch_model.bin.index.json", True),
    "bin-shard": ("pytorch_model-00001-of-00002.bin", False),
    "bin-single": ("pytorch_model.bin", False),
    "dcp-metadata": (".metadata", True),
    "dcp-data": ("__0_0.distcp", False),
}
SAFETENSORS = {"st-index", "st-shard", "st-single", "manifest"}
DCP = {"dcp-metadata", "dcp-data"}
LISTED = {"st-shard", "bin-shard", "dcp-data"}
"""Data files named by an index or metadata: absent (or a dangling link), they are missing."""


def _write(fmt: str, directory: Path) -> None:
    if fmt in SAFETENSORS:
        sp.save(STATE, directory, max_shard_size=1 if fmt != "st-single" else "5GB")
        if fmt != "manifest":
            (directory / "shardpoint.json").unlink()  # a plain Hugging Face directory
    elif fmt == "bin-single":
        directory.mkdir()
        torch.save(STATE, directory / "pytorch_model.bin")
    elif fmt in ("bin-index", "bin-shard"):
        directory.mkdir()
        torch.save({"w": STATE["w"]}, directory / "pytorch_model-00001-of-00002.bin")
        torch.save({"b": STATE["b"]}, directory / "pytorch_model-00002-of-00002.bin")
        (directory / "pytorch_model.bin.index.json").write_text(
            '{"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00002.bin", '
            '"b": "pytorch_model-00002-of-00002.bin"}}'
        )
    else:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({k: v.clone() for k, v in STATE.items()}, checkpoint_id=str(directory),
                     no_dist=True)
        assert (directory / "__0_0.distcp").is_file()


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("originals")
    for fmt in TARGETS:
        _write(fmt, root / fmt)
    return root


def _readers(fmt: str) -> list[str]:
    if fmt in DCP:
        return ["convert", "diff"]
    if fmt in SAFETENSORS:
        return ["load", "load_into", "convert", "diff", "verify", "inspect"]
    return ["load", "load_into", "convert", "diff"]


def _read(reader: str, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``reader`` on ``ckpt``; the error message it gives (it must give one)."""
    trust = ckpt.name in DCP
    actions: dict[str, Callable[[], object]] = {
        "load": lambda: sp.load(ckpt),
        "load_into": lambda: sp.load_into({k: torch.zeros_like(v) for k, v in STATE.items()}, ckpt),
        "convert": lambda: sp.convert(ckpt, tmp_path / "out", trust_pickle=trust),
        "diff": lambda: sp.diff(ckpt, ckpt, trust_pickle=trust),
    }
    if reader == "verify":
        try:
            report = verify_checkpoint(ckpt)
        except sp.CheckpointError as exc:
            return str(exc)
        assert not report.ok, "verify accepted a damaged checkpoint"
        return " | ".join(report.problems)
    if reader == "inspect":
        code = main(["inspect", str(ckpt)])
        out, err = capsys.readouterr()
        assert code == 2 and out == "", (code, out)
        assert err.startswith("shardpoint: error: ")
        return err
    with pytest.raises(sp.CheckpointError) as exc:
        actions[reader]()
    assert not (tmp_path / "out").exists()
    return str(exc.value)


CASES = [
    (fmt, attack, reader)
    for fmt, (_, control) in TARGETS.items()
    for attack in ["fifo", "dev-zero", "directory", "outside"] + (["sparse"] if control else [])
    + (["missing", "dangling"] if fmt in LISTED else [])
    for reader in _readers(fmt)
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fmt", "attack", "reader"), CASES)
def test_every_reader_refuses_every_non_member_file(
    originals: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    fmt: str, attack: str, reader: str,
) -> None:
    ckpt = tmp_path / fmt
    shutil.copytree(originals / fmt, ckpt)
    name, _ = TARGETS[fmt]
    victim = ckpt / name
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    os.replace(victim, outside)  # a valid file, only outside the directory
    if attack == "fifo":
        os.mkfifo(victim)
        expected = f"{victim} is not a regular file"
    elif attack == "directory":
        victim.mkdir()
        expected = f"{victim} is not a regular file"
    elif attack == "dev-zero":
        os.symlink("/dev/zero", victim)
        expected = f"{name!r} is a symlink that leaves the checkpoint directory (to /dev/zero)"
    elif attack == "outside":
        os.symlink(outside, victim)
        expected = f"{name!r} is a symlink that leaves the checkpoint directory (to {outside})"
    elif attack == "missing":
        expected = f"{victim} is missing"
    elif attack == "dangling":
        os.symlink("gone.bin", victim)
        expected = f"{victim} is missing"
    else:
        with open(victim, "wb") as f:
            f.truncate(2 << 30)  # sparse: no disk, but a read of it would take 2 GiB
        expected = f"{victim} is 2147483648 bytes, over the 268435456-byte limit"
    message = _read(reader, ckpt, tmp_path, capsys)
    assert expected in message, message


@pytest.mark.parametrize("name", ["fifo.safetensors", "fifo"])
def test_a_fifo_named_as_the_checkpoint_is_refused_as_such_not_as_missing(tmp_path, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    with pytest.raises(sp.CorruptCheckpointError) as err:
        sp.load(fifo)
    # Named as a data file or as a directory, it is refused by name, never called missing.
    assert str(err.value) in (
        f"{fifo} is neither a directory nor a regular file (a FIFO, device or socket); "
        "shardpoint loads checkpoint directories and .safetensors files",
        f"{fifo} is not a regular file (a FIFO, device, socket or directory); "
        "the checkpoint is damaged or forged",
    )


def test_a_leading_tilde_is_the_home_directory_for_every_entry_point(tmp_path, monkeypatch) -> None:
    """``sp.save(model, "~/ckpt")`` writes under $HOME, as a shell would: a directory named
    ``~`` in the working directory is a trap (``rm -rf ~`` is how it gets cleaned up)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    model = torch.nn.Linear(2, 2)
    sp.save(model, "~/a")
    sp.save(model, Path("~/a"), overwrite=True)
    sp.async_save(model, "~/b").result()
    manager = sp.CheckpointManager("~/run")
    manager.save(1, {"model": model})
    manager.wait()
    sp.convert("~/a", "~/c")
    sp.convert("~/a", "~/c", overwrite=True)
    assert torch.equal(sp.load("~/c")["weight"], model.weight)
    assert sp.load_into(torch.nn.Linear(2, 2), "~/b").ok
    assert sp.diff("~/a", "~/b").equal
    assert verify_checkpoint("~/a").ok
    assert manager.step_path(1) == home / "run" / "step-000001"
    assert sorted(os.listdir(home)) == ["a", "b", "c", "run"] and os.listdir(work) == []
    assert main(["verify", "~/c"]) == 0


def test_a_path_ending_in_dot_dot_or_the_root_is_refused_naming_the_folder(tmp_path: Path) -> None:
    """sp.save(sd, "x/..", overwrite=True) failed with "Device or resource busy ... check the
    filesystem"; without overwrite it advised overwrite=True, which led to that error."""
    (tmp_path / "x").mkdir()
    for given in (f"{tmp_path}/x/..", f"{tmp_path}/x/../"):
        with pytest.raises(sp.InvalidArgumentError) as caught:
            sp.save({"a": torch.zeros(1)}, given, overwrite=True)
        assert str(caught.value) == (
            f"cannot save to {tmp_path}/x/..: a path ending in '..' names a folder by way of another; give the "
            f"folder's own path ({tmp_path}). Nothing was written"
        )
    with pytest.raises(sp.InvalidArgumentError, match=r"^cannot save to /: the root folder cannot be a checkpoint"):
        sp.save({"a": torch.zeros(1)}, "/", overwrite=True)
    sp.save({"a": torch.zeros(1)}, f"{tmp_path}/x/../y")  # '..' inside a path is fine
    assert sorted(os.listdir(tmp_path)) == ["x", "y"]
