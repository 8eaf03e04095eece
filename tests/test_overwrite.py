"""Overwrites that never lose the user's files, and local save errors that name the path.

An overwrite replaces only what the old checkpoint owns (its manifest's files and indexes,
or the Hugging Face weight files of the components being written); every other file or
directory of the folder — ``config.json``, tokenizer files, notes, files created while the
save ran — is in the new folder afterwards. Saving into a folder ``transformers`` wrote
replaces its weights (stale shards removed) and keeps the tokenizer. Under ``SIGKILL`` the
folder loads as the old weights or the new, never a mix. Where ``renameat2`` is missing
(an ``LD_PRELOAD`` shim makes it fail with ``EINVAL``), a kill between moving the old copy
aside and moving the new one in is recovered: the whole old copy is put back.

The process tests run this file as a helper (``<file> helper``): it imports torch,
transformers and shardpoint once and forks a child per job; the test kills children with
``SIGKILL``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import shardpoint as sp
from shardpoint._storage import local as sp_local
from shardpoint._storage import posix as sp_posix
from shardpoint._verify import verify_checkpoint

HERE = Path(__file__).resolve()
TOKENIZER_FILES = {
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": b'{"model_max_length": 128}',
    "special_tokens_map.json": b'{"bos_token": "<s>"}',
}


def hidden(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".") and ".tmp-" in n)


# --------------------------------------------------------------------- plain sp.save


def test_overwrite_keeps_the_users_files_and_subdirectories(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    sp.save({"w": torch.zeros(300), "v": torch.arange(200)}, path, max_shard_size="1KB")
    old_shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert old_shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert (path / "model.safetensors.index.json").exists()
    for name, text in {"config.json": "{}", "tokenizer.json": "tok", "NOTES.md": "my notes"}.items():
        (path / name).write_text(text)
    (path / "eval").mkdir()
    (path / "eval" / "results.csv").write_text("acc,0.9")
    (path / "link.md").symlink_to("NOTES.md")

    sp.save({"w": torch.ones(300)}, path, overwrite=True)

    assert sorted(os.listdir(path)) == [
        "NOTES.md", "config.json", "eval", "link.md", "model.safetensors", "shardpoint.json", "tokenizer.json",
    ]
    assert (path / "config.json").read_text() == "{}"
    assert (path / "tokenizer.json").read_text() == "tok"
    assert (path / "NOTES.md").read_text() == "my notes"
    assert (path / "eval" / "results.csv").read_text() == "acc,0.9"
    assert os.readlink(path / "link.md") == "NOTES.md"
    loaded = sp.load(path)
    assert list(loaded) == ["w"] and torch.equal(loaded["w"], torch.ones(300))
    assert os.listdir(tmp_path) == ["ck"]  # the old directory is gone, nothing hidden left


def test_overwrite_never_takes_what_a_damaged_or_forged_manifest_lists(tmp_path: Path) -> None:
    """The old manifest's 'files' naming the user's config.json, a folder of theirs and a
    safetensors file of theirs (no save_id of this save in it): each is kept. Only what
    the save wrote (its files carry its save_id) is replaced."""
    from safetensors.torch import save_file

    path = tmp_path / "ck"
    sp.save({"w": torch.zeros(3)}, path)
    (path / "config.json").write_text('{"hidden_size": 2}')
    (path / "runs").mkdir()
    (path / "runs" / "train.log").write_text("precious log")
    save_file({"lora": torch.ones(2)}, str(path / "adapter.safetensors"))
    doc = json.loads((path / "shardpoint.json").read_text())
    for name in ("config.json", "runs", "adapter.safetensors", "../elsewhere.safetensors"):
        doc["files"][name] = {"size": 18}
    doc["components"]["adapter"] = doc["components"]["model"]
    (path / "shardpoint.json").write_text(json.dumps(doc))

    sp.save({"w": torch.ones(3)}, path, overwrite=True)

    assert sorted(os.listdir(path)) == [
        "adapter.safetensors", "config.json", "model.safetensors", "runs", "shardpoint.json"]
    assert (path / "config.json").read_text() == '{"hidden_size": 2}'
    assert (path / "runs" / "train.log").read_text() == "precious log"
    assert torch.equal(sp.load(path / "adapter.safetensors")["lora"], torch.ones(2))
    assert torch.equal(sp.load(path)["w"], torch.ones(3))


def test_files_created_or_replaced_during_the_save_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the new checkpoint is written, the user adds a file and a directory to the
    folder and replaces ``config.json``: all three are in the folder afterwards, newest
    versions."""
    path = tmp_path / "ck"
    sp.save({"w": torch.zeros(4)}, path)
    (path / "config.json").write_text("first")
    real = sp_local.write_files

    def user_meanwhile(*args: Any, **kwargs: Any) -> Any:
        (path / "late.txt").write_text("written during the save")
        (path / "late-dir").mkdir()
        (path / "late-dir" / "x").write_text("x")
        new = path / "config.json.new"
        new.write_text("second")
        os.replace(new, path / "config.json")
        return real(*args, **kwargs)

    monkeypatch.setattr(sp_local, "write_files", user_meanwhile)
    sp.save({"w": torch.ones(4)}, path, overwrite=True)
    assert sorted(os.listdir(path)) == ["config.json", "late-dir", "late.txt", "model.safetensors", "shardpoint.json"]
    assert (path / "config.json").read_text() == "second"
    assert (path / "late.txt").read_text() == "written during the save"
    assert (path / "late-dir" / "x").read_text() == "x"
    assert torch.equal(sp.load(path)["w"], torch.ones(4))
    assert os.listdir(tmp_path) == ["ck"]


def test_a_file_created_after_the_carry_over_is_moved_after_the_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Created between the carry-over and the swap: moved in from the old directory."""
    path = tmp_path / "ck"
    sp.save({"w": torch.zeros(4)}, path)
    real = sp_local._rename2

    def late_then_rename(src: str, dst: str, flags: int) -> bool:
        if flags == sp_local._RENAME_EXCHANGE:
            (path / "very-late.txt").write_text("late")
        return real(src, dst, flags)

    monkeypatch.setattr(sp_local, "_rename2", late_then_rename)
    sp.save({"w": torch.ones(4)}, path, overwrite=True)
    assert (path / "very-late.txt").read_text() == "late"
    assert os.listdir(tmp_path) == ["ck"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "no-renameat2"])
def test_overwrite_without_renameat2_keeps_the_users_files_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(sp_posix, "_renameat2", None)
    path = tmp_path / "ck"
    sp.save({"w": torch.zeros(4)}, path)
    (path / "NOTES.md").write_text("notes")
    (path / "sub").mkdir()
    sp.save({"w": torch.ones(4)}, path, overwrite=True)
    assert sorted(os.listdir(path)) == ["NOTES.md", "model.safetensors", "shardpoint.json", "sub"]
    assert torch.equal(sp.load(path)["w"], torch.ones(4))
    assert os.listdir(tmp_path) == ["ck"]


def test_copies_where_hard_links_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ck"
    sp.save({"w": torch.zeros(4)}, path)
    (path / "NOTES.md").write_text("notes")

    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    sp.save({"w": torch.ones(4)}, path, overwrite=True)
    assert (path / "NOTES.md").read_text() == "notes"
    assert os.listdir(tmp_path) == ["ck"]


def test_a_replaced_directory_left_by_a_crash_is_finished_not_deleted(tmp_path: Path) -> None:
    """A kill after the swap, before the user's entries were moved back: the old directory
    sits at a temp name without its marker. It is never removed as a dead save's: the next
    save moves the user's entries back and then removes it."""
    path = tmp_path / "ck"
    sp.save({"w": torch.ones(4)}, path)
    replaced = tmp_path / f".ck.tmp-{'a' * 32}"
    sp.save({"w": torch.zeros(4)}, replaced)
    (replaced / "eval").mkdir()
    (replaced / "eval" / "results.csv").write_text("acc,0.9")
    with pytest.raises(sp.IncompleteCheckpointError, match=r"Do not delete it: it may hold your files"):
        sp.load(replaced)
    sp.save({"w": torch.full((4,), 2.0)}, path, overwrite=True)
    assert (path / "eval" / "results.csv").read_text() == "acc,0.9"
    assert torch.equal(sp.load(path)["w"], torch.full((4,), 2.0))
    assert os.listdir(tmp_path) == ["ck"]


def test_a_file_at_the_path_is_still_refused(tmp_path: Path) -> None:
    target = tmp_path / "data"
    target.write_text("precious")
    with pytest.raises(sp.CheckpointExistsError, match=r"data exists and is not a shardpoint checkpoint, nor a directory"):
        sp.save({"w": torch.zeros(1)}, target, overwrite=True)
    assert target.read_text() == "precious"
    assert os.listdir(tmp_path) == ["data"]


# --------------------------------------------------------------------- Hugging Face folders


def tiny_llama(version: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 64 + 1000 * version + i)
    return model


def hf_view(folder: Path) -> dict[str, torch.Tensor]:
    """The weights as ``transformers`` finds them: the index's shards, else ``model.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


def version_of(weights: dict[str, torch.Tensor], versions: dict[int, dict[str, torch.Tensor]]) -> int | None:
    for v, expected in versions.items():
        if weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected):
            return v
    return None


def hf_folder(path: Path, model: Any, max_shard_size: str) -> None:
    """A model folder as ``transformers`` writes it, with tokenizer files beside it."""
    model.save_pretrained(path, max_shard_size=max_shard_size)
    for name, data in TOKENIZER_FILES.items():
        (path / name).write_bytes(data)


def test_save_pretrained_into_a_transformers_folder_replaces_weights_and_keeps_the_tokenizer(
    tmp_path: Path,
) -> None:
    from transformers import LlamaForCausalLM

    path = tmp_path / "llama"
    hf_folder(path, tiny_llama(1), "20KB")
    old_shards = sorted(n for n in os.listdir(path) if n.startswith("model-"))
    assert len(old_shards) >= 3 and (path / "model.safetensors.index.json").exists()
    (path / "README.md").write_text("model card")
    new = tiny_llama(2)
    # Neither checkpoint nor weights of ours there: save_pretrained writes in, as transformers does.
    sp.integrations.transformers.save_pretrained(new, path, overwrite=True, max_shard_size="5GB")
    names = sorted(os.listdir(path))
    assert names == sorted(
        ["README.md", "config.json", "generation_config.json", "model.safetensors", "shardpoint.json", *TOKENIZER_FILES]
    )  # stale shards and the old index are gone
    for name, data in TOKENIZER_FILES.items():
        assert (path / name).read_bytes() == data
    assert (path / "README.md").read_text() == "model card"
    loaded = LlamaForCausalLM.from_pretrained(path)
    for k, v in new.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert os.listdir(tmp_path) == ["llama"]


def test_save_pretrained_into_a_folder_with_only_a_tokenizer_needs_no_overwrite(tmp_path: Path) -> None:
    """A folder holding a tokenizer (no weights, no checkpoint): written into as
    ``transformers`` does; one holding weights still needs ``overwrite=True``."""
    path = tmp_path / "llama"
    path.mkdir()
    for name, data in TOKENIZER_FILES.items():
        (path / name).write_bytes(data)
    model = tiny_llama(1)
    sp.integrations.transformers.save_pretrained(model, path)
    assert {"tokenizer.json", "model.safetensors", "config.json"} <= set(os.listdir(path))
    assert (path / "tokenizer.json").read_bytes() == TOKENIZER_FILES["tokenizer.json"]
    with pytest.raises(sp.CheckpointExistsError, match=r"llama already exists; pass overwrite=True"):
        sp.integrations.transformers.save_pretrained(tiny_llama(2), path)
    assert version_of(hf_view(path), {1: model.state_dict()}) == 1


def test_sp_save_into_a_transformers_folder_with_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "llama"
    hf_folder(path, tiny_llama(1), "20KB")
    config = (path / "config.json").read_bytes()
    state = {k: torch.ones(2) for k in ("a", "b")}
    with pytest.raises(sp.CheckpointExistsError, match=r"llama already exists; pass overwrite=True"):
        sp.save(state, path)
    sp.save(state, path, overwrite=True)
    assert sorted(os.listdir(path)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "shardpoint.json", *TOKENIZER_FILES]
    )
    assert (path / "config.json").read_bytes() == config
    assert sorted(load_file(path / "model.safetensors")) == ["a", "b"]


# --------------------------------------------------------------------- local save errors


def test_enospc_is_a_storage_error_naming_the_path(tmpfs_1m: Path) -> None:
    path = tmpfs_1m / "ck"
    with pytest.raises(sp.StorageError) as info:
        sp.save({"w": torch.zeros(1 << 19)}, path)  # 2 MiB on a 1 MiB tmpfs
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    text = str(info.value)
    assert text.startswith(f"[Errno 28] saving {path} failed while writing its data files: No space left on device")
    assert "free space on that filesystem or save somewhere else" in text
    assert os.listdir(tmpfs_1m) == []  # nothing half-written left


def test_erofs_is_a_storage_error_naming_the_path(tmpfs_1m: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_1m)], check=True)
    path = tmpfs_1m / "ck"
    with pytest.raises(sp.StorageError) as info:
        sp.save({"w": torch.zeros(4)}, path)
    assert info.value.errno == errno.EROFS
    assert str(info.value).startswith(
        f"[Errno 30] saving {path} failed while creating its temporary directory: Read-only file system"
    )
    assert "mounted read-only: save to a writable location" in str(info.value)


def test_eperm_is_a_storage_error_naming_the_path(tmp_path: Path) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    done = subprocess.run(["chattr", "+i", str(parent)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make a directory immutable here ({(done.stderr or done.stdout).strip()})")
    try:
        path = parent / "ck"
        with pytest.raises(sp.StorageError) as info:
            sp.save({"w": torch.zeros(4)}, path)
        assert info.value.errno == errno.EPERM
        assert str(info.value).startswith(
            f"[Errno 1] saving {path} failed while creating its temporary directory: Operation not permitted"
        )
        assert "fix the permissions or save somewhere else" in str(info.value)
        assert os.listdir(parent) == []
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=False)


def test_a_long_legal_name_saves_overwrites_and_its_dead_temps_are_removed(tmp_path: Path) -> None:
    name = "c" * 230  # under NAME_MAX (255), too long for `.<name>.tmp-<uuid>` whole
    path = tmp_path / name
    sp.save({"w": torch.zeros(4)}, path)
    (path / "NOTES.md").write_text("notes")
    sp.save({"w": torch.ones(4)}, path, overwrite=True, metadata={"v": 2})
    assert torch.equal(sp.load(path)["w"], torch.ones(4))
    assert (path / "NOTES.md").read_text() == "notes"
    # A dead save's temp dir of this name (marker naming it) is removed by the next save.
    stem = sp_local.temp_stem(name)
    assert len(stem.encode()) < 230 and stem != name
    dead = tmp_path / f".{stem}.tmp-{'b' * 32}"
    dead.mkdir()
    (dead / sp_local.marker_name(str(dead))).write_bytes(b"")
    (dead / "model.safetensors").write_bytes(b"partial")
    sp.save({"w": torch.full((4,), 3.0)}, path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == [name]


# --------------------------------------------------------------------- SIGKILL, in processes


def _shim(tmp_path: Path) -> Path:
    """A shared library whose ``renameat2`` fails with EINVAL, as on NFS or some FUSE."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the renameat2 shim")
    src = tmp_path / "no_renameat2.c"
    src.write_text(
        "#include <errno.h>\n"
        "int renameat2(int a, const char *b, int c, const char *d, unsigned int f)\n"
        "{ (void)a; (void)b; (void)c; (void)d; (void)f; errno = EINVAL; return -1; }\n"
    )
    lib = tmp_path / "no_renameat2.so"
    done = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot build the renameat2 shim: {done.stderr.strip()}")
    return lib


class Helper:
    """This file as a helper process: ``start`` forks a job, the test kills it."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        full["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), full.get("PYTHONPATH", "")])
        self.log = open(workdir / "helper.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "helper"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, bufsize=1, env=full,
        )
        self.workdir = workdir
        assert self.call({"op": "ping"}) == {"ok": True}

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"helper died: {(self.workdir / 'helper.log').read_text()[-3000:]}")
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


@pytest.mark.slow
def test_sigkill_while_saving_into_a_transformers_folder_never_mixes_or_loses_files(tmp_path: Path) -> None:
    """A child re-saves a tiny Llama into a folder ``transformers`` wrote (sharded, with a
    tokenizer and a README), alternating versions 1 (5 shards) and 2 (one file), and is
    killed at random moments, 6 times. After each kill the folder's weights, as
    ``transformers`` finds them and as ``sp.load`` reads them, are exactly version 1 or 2,
    the weight files are exactly those of that version, and the other files are untouched."""
    path = tmp_path / "llama"
    hf_folder(path, tiny_llama(1), "20KB")
    (path / "README.md").write_text("model card")
    others = {n: (path / n).read_bytes() for n in [*TOKENIZER_FILES, "README.md"]}
    versions = {v: tiny_llama(v).state_dict() for v in (1, 2)}
    helper = Helper(tmp_path)
    rng = random.Random(19)
    seen = set()
    try:
        for round_ in range(6):
            started = tmp_path / f"started-{round_}"
            pid = helper.call({"op": "hf_resave", "path": str(path), "started": str(started)})["pid"]
            _wait_for(started)
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(pid, signal.SIGKILL)
            helper.call({"op": "reap", "pid": pid})
            where = f"kill {round_}"
            weights = hf_view(path)
            v = version_of(weights, versions)
            assert v is not None, f"{where}: the folder's weights are neither version: a mix"
            seen.add(v)
            shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            assert shards == (["model.safetensors"] if v == 2 else sorted(n for n in shards if n.startswith("model-"))), where
            if (path / "shardpoint.json").exists():
                ours = sp.load(path)
                assert version_of(dict(ours), versions) == v, f"{where}: sp.load disagrees"
            for name, data in others.items():
                assert (path / name).read_bytes() == data, f"{where}: {name} changed"
    finally:
        helper.close()
    # The next save tidies whatever the kills left; nothing of the user's is lost.
    sp.integrations.transformers.save_pretrained(tiny_llama(1), path, overwrite=True, max_shard_size="20KB")
    assert hidden(tmp_path) == []
    assert version_of(hf_view(path), versions) == 1
    for name, data in others.items():
        assert (path / name).read_bytes() == data
    assert seen, "no kill was checked"


@pytest.mark.slow
def test_sigkill_after_moving_a_step_aside_without_renameat2_is_recovered(tmp_path: Path) -> None:
    """``renameat2`` fails with EINVAL (``LD_PRELOAD`` shim). A manager re-saving step 1 is
    killed just after the old copy was moved aside, before the new one moved in: the step's
    path is missing, its whole old copy is at ``.step-000001.tmp-old-…`` and the finished
    new one in a temp dir. ``load`` says where the old copy is (never "delete it"); a fresh
    manager puts it back and restores it; the next save deletes no whole copy."""
    lib = _shim(tmp_path)
    root = tmp_path / "run"
    helper = Helper(tmp_path, env={"LD_PRELOAD": str(lib)})
    try:
        assert helper.call({"op": "has_renameat2"}) == {"works": False}
        done = tmp_path / "saved"
        pid = helper.call({"op": "manager_save", "root": str(root), "step": 1, "version": 1, "done": str(done)})["pid"]
        assert helper.call({"op": "reap", "pid": pid})["status"] == 0
        pause = tmp_path / "moved-aside"
        pid = helper.call({"op": "manager_save", "root": str(root), "step": 1, "version": 2, "pause": str(pause)})["pid"]
        _wait_for(pause)
        os.kill(pid, signal.SIGKILL)
        helper.call({"op": "reap", "pid": pid})
    finally:
        helper.close()
    step = root / "step-000001"
    left = hidden(root)
    assert not step.exists()
    assert len(left) == 2 and any(n.startswith(".step-000001.tmp-old-") for n in left), left
    aside = root / next(n for n in left if "tmp-old-" in n)
    with pytest.raises(sp.CheckpointNotFoundError) as info:
        sp.load(step)
    assert f"{aside} beside it holds its whole previous version" in str(info.value)
    assert "do not delete it" in str(info.value) and "or delete it" not in str(info.value)
    with pytest.raises(sp.IncompleteCheckpointError, match=r"Do not delete it: if .*step-000001 is missing, rename it back"):
        sp.load(aside)

    mgr = sp.CheckpointManager(root, keep_last=1)
    assert mgr.steps() == [1]
    target = {"w": torch.zeros(64)}
    assert mgr.restore(target) == 1
    assert torch.equal(target["w"], torch.full((64,), 1.0))
    mgr.save(2, {"w": torch.full((64,), 2.0)})
    assert mgr.steps() == [2] and hidden(root) == []


@pytest.mark.slow
def test_restores_racing_retention_and_two_managers_on_one_root(tmp_path: Path) -> None:
    """Two processes save steps into one root (``keep_last=1``), interleaved, while three
    readers restore the newest step in a loop, for about 3 seconds. No save fails; every
    restore returns a whole step (its values match its number) or, when steps kept being
    retired under it, raises a CheckpointError saying so: never a bare FileNotFoundError."""
    root = tmp_path / "run"
    helper = Helper(tmp_path)
    stop = tmp_path / "stop"
    try:
        writers = [
            helper.call({"op": "writer", "root": str(root), "first": first, "stop": str(stop),
                         "out": str(tmp_path / f"writer{first}.json")})["pid"]
            for first in (0, 1)
        ]
        _wait_for(root / "latest")
        readers = [
            helper.call({"op": "reader", "root": str(root), "stop": str(stop), "out": str(tmp_path / f"reader{i}.json")})["pid"]
            for i in range(3)
        ]
        time.sleep(3.0)
        stop.write_text("stop")
        statuses = [helper.call({"op": "reap", "pid": pid})["status"] for pid in writers + readers]
    finally:
        helper.close()
    assert statuses == [0] * 5
    saves = [json.loads((tmp_path / f"writer{f}.json").read_text()) for f in (0, 1)]
    reads = [json.loads((tmp_path / f"reader{i}.json").read_text()) for i in range(3)]
    for report in saves:
        assert report["errors"] == [] and report["saved"] >= 2, report
    restored = sum(r["ok"] for r in reads)
    assert restored >= 3, reads
    for report in reads:
        assert report["wrong"] == 0, report
        for error in report["errors"]:
            assert error.startswith("CheckpointError: restore() from") or "was retired by retention" in error, error
    assert sp.CheckpointManager(root, keep_last=1).steps() == [max(s["last"] for s in saves)]


# --------------------------------------------------------------------- the helper


_MODELS: dict[int, Any] = {}
"""The helper's two tiny models, built once before the first fork."""


def _job_hf_resave(cmd: dict[str, Any]) -> None:
    from shardpoint.integrations.transformers import save_pretrained

    models = _MODELS
    Path(cmd["started"]).write_text("go")
    v = 2
    while True:
        save_pretrained(models[v], cmd["path"], overwrite=True, max_shard_size="20KB" if v == 1 else "5GB",
                        progress=False)
        v = 3 - v


def _job_manager_save(cmd: dict[str, Any]) -> None:
    if cmd.get("pause"):
        real = os.rename

        def rename_then_pause(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real(src, dst, *args, **kwargs)
            if ".tmp-old-" in os.fspath(dst):
                Path(cmd["pause"]).write_text("aside")
                time.sleep(600)

        os.rename = rename_then_pause  # type: ignore[assignment]
    mgr = sp.CheckpointManager(cmd["root"], keep_last=1, durable=False, progress=False)
    mgr.save(cmd["step"], {"w": torch.full((64,), float(cmd["version"]))})


def _job_writer(cmd: dict[str, Any]) -> None:
    mgr = sp.CheckpointManager(cmd["root"], keep_last=1, durable=False, progress=False)
    step, saved, errors = cmd["first"], 0, []
    while not os.path.exists(cmd["stop"]):
        try:
            mgr.save(step, {"w": torch.full((4096,), float(step)), "b": torch.full((512,), float(step))},
                     )
            saved += 1
        except Exception as exc:  # reported, never hidden
            errors.append(f"{type(exc).__name__}: {exc}")
        step += 2
    Path(cmd["out"]).write_text(json.dumps({"saved": saved, "errors": errors[:10], "last": step - 2}))


def _job_reader(cmd: dict[str, Any]) -> None:
    mgr = sp.CheckpointManager(cmd["root"], keep_last=1)
    ok = wrong = 0
    errors: list[str] = []
    while not os.path.exists(cmd["stop"]):
        target = {"w": torch.zeros(4096), "b": torch.zeros(512)}
        try:
            step = mgr.restore(target)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if step is None:
            continue
        good = torch.equal(target["w"], torch.full((4096,), float(step))) and torch.equal(
            target["b"], torch.full((512,), float(step))
        )
        ok += good
        wrong += not good
    Path(cmd["out"]).write_text(json.dumps({"ok": ok, "wrong": wrong, "errors": errors[:20]}))


def _helper_main() -> None:
    warnings.simplefilter("ignore")
    jobs = {"hf_resave": _job_hf_resave, "manager_save": _job_manager_save, "writer": _job_writer,
            "reader": _job_reader}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "ping":
            reply: dict[str, Any] = {"ok": True}
        elif op == "has_renameat2":
            probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"probe-{os.getpid()}"
            probe.mkdir(exist_ok=True)
            try:
                reply = {"works": sp_local._rename2(str(probe), str(probe) + "-x", sp_local._RENAME_NOREPLACE)}
            finally:
                for p in (probe, Path(str(probe) + "-x")):
                    if p.exists():
                        p.rmdir()
        elif op == "reap":
            _, status = os.waitpid(cmd["pid"], 0)
            reply = {"status": os.waitstatus_to_exitcode(status)}
        else:
            if op == "hf_resave" and not _MODELS:  # once, before the forks: models, imports
                from shardpoint.integrations.transformers import save_pretrained

                _MODELS.update({v: tiny_llama(v) for v in (1, 2)})
                save_pretrained(_MODELS[1], Path(cmd["path"]).parent / "warm-up", progress=False)
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    jobs[op](cmd)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            reply = {"pid": pid}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["helper"]:
    _helper_main()


def test_verify_of_a_moved_aside_copy_or_a_missing_path_never_advises_deleting_it(tmp_path: Path) -> None:
    sp.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    aside = tmp_path / f".ckpt.tmp-old-{'a' * 32}"
    os.rename(tmp_path / "ckpt", aside)  # as an overwrite without renameat2 leaves it
    report = verify_checkpoint(aside)
    assert not report.ok
    (problem,) = report.problems
    assert "is a whole previous version of" in problem and "Do not delete it" in problem
    with pytest.raises(sp.CheckpointNotFoundError) as err:
        verify_checkpoint(tmp_path / "ckpt")
    message = str(err.value)
    assert f"{aside} beside it holds its whole previous version" in message
    assert "nothing to verify" not in message and "do not delete it" in message


def test_overwrite_keeps_the_folders_permission_bits(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    sp.save({"w": torch.ones(2)}, folder)
    os.chmod(folder, 0o2750)
    sp.save({"w": torch.zeros(2)}, folder, overwrite=True)
    assert oct(os.stat(folder).st_mode & 0o7777) == oct(0o2750)
    assert sp.load(folder)["w"].tolist() == [0.0, 0.0]


def test_a_link_or_file_named_like_a_step_is_the_users_never_a_step(tmp_path: Path) -> None:
    """A symlink ``step-000001`` to the user's own checkpoint elsewhere is not a step this
    manager wrote: it is not listed, not restored, never renamed away by retention; saving
    that step is refused naming it, as a file of that name is."""
    users = tmp_path / "elsewhere" / "ckpt"
    sp.save({"w": torch.ones(2)}, users)
    root = tmp_path / "run"
    root.mkdir()
    (root / "step-000001").symlink_to(users)
    (root / "step-000003").write_text("notes")
    mgr = sp.CheckpointManager(root, keep_last=1)
    assert mgr.steps() == [] and mgr.latest_step() is None and mgr.restore({"w": torch.zeros(2)}) is None
    mgr.save(2, {"w": torch.zeros(2)})
    mgr.save(4, {"w": torch.zeros(2)})
    assert mgr.steps() == [4]
    assert sorted(p.name for p in root.iterdir()) == [".shardpoint-writer.lock", "latest", "step-000001", "step-000003",
                                                      "step-000004"]
    assert os.readlink(root / "step-000001") == str(users)
    assert (root / "step-000003").read_text() == "notes"
    for step in (1, 3):
        with pytest.raises(sp.CheckpointExistsError) as exc:
            mgr.save(step, {"w": torch.zeros(2)})
        assert str(exc.value).startswith({
            1: f"{root / 'step-000001'} is a symlink (to {users}); a save never follows one, as it would replace the "
               "link or what it points to: save to the path it points to, or remove the link",
            3: f"{root / 'step-000003'} exists and is not a shardpoint checkpoint"}[step]), exc.value
    assert torch.equal(sp.load(users)["w"], torch.ones(2))


def test_a_users_folder_named_like_a_step_is_never_taken_over_by_the_manager(tmp_path: Path) -> None:
    """The manager saves steps with overwrite=True: a folder of the user's named like a step
    took the step's files beside the user's, and retention then deleted it whole (notes and
    all). Refused now; an empty folder holds nothing to lose, and a committed step is replaced."""
    root = tmp_path / "run"
    (root / "step-000010").mkdir(parents=True)
    (root / "step-000010" / "notes.txt").write_text("mine")
    (root / "step-000020").mkdir()
    mgr = sp.CheckpointManager(root, keep_last=1)
    with pytest.raises(sp.CheckpointExistsError) as caught:
        mgr.save(10, {"w": torch.zeros(2)})
    assert str(caught.value) == (
        f"{root / 'step-000010'} exists and is not a committed step (it has no shardpoint.json): saving step 10 there "
        "would make the folder the step's, and retention would delete it with the step, with all it holds. Move it "
        f"out of {root} (or remove it), then save again. Step 10 was not saved")
    assert os.listdir(root / "step-000010") == ["notes.txt"]
    mgr.save(20, {"w": torch.ones(2)})
    mgr.save(20, {"w": torch.full((2,), 2.0)})  # a committed step saved again: replaced
    mgr.save(30, {"w": torch.zeros(2)})
    assert mgr.steps() == [30]
    assert (root / "step-000010" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give files away")
def test_an_overwrite_keeps_the_folders_owner_and_group(tmp_path: Path) -> None:
    """The replacement is made beside the folder, so it took the parent's group (and the
    saving user): a team's 2770 folder was left to root:root, its members locked out."""
    target = tmp_path / "ckpt"
    sp.save({"w": torch.zeros(2)}, target)
    for path in (target, *target.iterdir()):
        os.chown(path, 65534, 100)
    os.chmod(target, 0o2770)
    (target / "notes.txt").write_text("team notes")
    os.chown(target / "notes.txt", 1000, 100)
    sp.save({"w": torch.ones(2)}, target, overwrite=True)
    owners = {p.name: (p.stat().st_uid, p.stat().st_gid) for p in (target, *target.iterdir())}
    assert owners == {"ckpt": (65534, 100), "model.safetensors": (65534, 100), "shardpoint.json": (65534, 100),
                      "notes.txt": (1000, 100)}, owners
    assert oct(target.stat().st_mode & 0o7777) == "0o2770"
    assert torch.equal(sp.load(target)["w"], torch.ones(2))


def test_an_existing_empty_directory_is_written_into_without_overwrite(tmp_path: Path) -> None:
    """A folder made ahead (mkdtemp, makedirs) holds nothing to lose: save writes into it,
    as save_pretrained does; a folder holding anything still needs overwrite=True."""
    target = tmp_path / "made-ahead"
    target.mkdir()
    sp.save({"w": torch.ones(2)}, target)
    assert sorted(os.listdir(target)) == ["model.safetensors", "shardpoint.json"]
    assert torch.equal(sp.load(target)["w"], torch.ones(2))
    with pytest.raises(sp.CheckpointExistsError, match="already exists; pass overwrite=True"):
        sp.save({"w": torch.zeros(2)}, target)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(sp.CheckpointExistsError, match="already exists; pass overwrite=True"):
        sp.save({"w": torch.zeros(2)}, notes)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(sp.CheckpointExistsError):
        sp.save({"w": torch.zeros(2)}, link)
    assert os.listdir(tmp_path / "elsewhere") == []


def _overwrite_read_only(root: Path, notes: bool) -> str:
    d = root / "ck"
    sp.save({"w": torch.ones(1 << 16)}, d)
    if notes:
        (d / "notes.txt").write_text("mine")
    os.chmod(d, 0o555)  # the owner protects the finished checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sp.save({"w": torch.full((1 << 16,), 2.0)}, d, overwrite=True)
    return f"{sp.load(d)['w'][0].item()} {oct(os.stat(d).st_mode & 0o777)} {sorted(os.listdir(root))} " \
           f"{sorted(os.listdir(d))}"


@pytest.mark.parametrize("notes", [True, False])
def test_overwriting_a_folder_its_owner_made_read_only_leaves_nothing_behind(notes: bool, tmp_path: Path) -> None:
    """chmod 555 on a checkpoint, then an overwrite by its (unprivileged) owner: the new
    folder took the mode before the files were carried in (a StorageError that said the
    temporary directory was removed, with a whole checkpoint left hidden), and the old one
    could not be removed (kept hidden, without a word, through every later save)."""
    if os.geteuid() != 0:
        root = tmp_path / "run"
        root.mkdir()
        got = _overwrite_read_only(root, notes)
    else:  # root writes anywhere: the owner is the unprivileged "nobody", in a child process
        import pwd
        import tempfile

        nobody = pwd.getpwnam("nobody")
        root = Path(tempfile.mkdtemp(prefix="sp-read-only-"))  # under /tmp, which nobody may reach
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's outcome comes back through the pipe
            text = "the child failed"
            try:
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                text = _overwrite_read_only(root, notes)
            except BaseException as exc:
                text = f"{type(exc).__name__}: {exc}"
            finally:
                os.write(write_end, text.encode())
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            got = pipe.read()
        os.waitpid(pid, 0)
    try:
        files = ["model.safetensors", "shardpoint.json"] + (["notes.txt"] if notes else [])
        assert got == f"2.0 0o555 ['ck'] {sorted(files)}", got
    finally:
        if (root / "ck").exists():
            os.chmod(root / "ck", 0o755)
        shutil.rmtree(root, ignore_errors=True)


def _mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_a_mount_point_as_the_destination_or_inside_it_is_refused_before_writing(tmp_path: Path) -> None:
    """A volume as the destination (a container's /output): the whole checkpoint was written
    beside it, then the commit's rename failed with EBUSY ('check the filesystem'). A volume
    mounted inside a checkpoint folder ended up inside a hidden leftover on overwrite."""
    volume, inner = tmp_path / "volume", tmp_path / "ck" / "data"
    if not _mount_tmpfs(volume):
        pytest.skip("mounting a tmpfs needs root")
    try:
        with pytest.raises(sp.InvalidArgumentError, match=re.escape(
                f"cannot save to {volume}: it is a mount point (a volume), and a save is committed by renaming its "
                f"finished folder into place, which a mount point refuses; save into a folder inside it, e.g. "
                f"{volume / 'checkpoint'}. Nothing was written")):
            sp.save({"w": torch.ones(4)}, volume, overwrite=True)
        assert os.listdir(volume) == [] and sorted(os.listdir(tmp_path)) == ["volume"]
        sp.save({"w": torch.ones(4)}, volume / "checkpoint")
        assert sp.load(volume / "checkpoint")["w"].tolist() == [1.0] * 4

        sp.save({"w": torch.ones(4)}, tmp_path / "ck")
        assert _mount_tmpfs(inner)
        (inner / "mine.txt").write_text("the user's")
        with pytest.raises(sp.InvalidArgumentError, match=re.escape(
                f"cannot overwrite {tmp_path / 'ck'}: 'data' in it is a mount point, which the overwrite (the folder "
                "renamed into place) cannot carry over")):
            sp.save({"w": torch.zeros(4)}, tmp_path / "ck", overwrite=True)
        assert os.path.ismount(inner) and (inner / "mine.txt").read_text() == "the user's"
        assert sp.load(tmp_path / "ck")["w"].tolist() == [1.0] * 4
        assert sorted(os.listdir(tmp_path)) == ["ck", "volume"]
    finally:
        for where in (inner, volume):
            subprocess.run(["umount", str(where)], capture_output=True)


def test_saving_over_the_working_directory_leaves_the_process_in_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sp.save(sd, ".", overwrite=True) from inside the model folder left the process in the
    replaced folder, deleted: relative writes failed and sp.load(".") said it was replaced
    5 times while being opened."""
    proj = tmp_path / "my-model"
    sp.save({"w": torch.zeros(2)}, proj)
    (proj / "config.json").write_text("{}")
    monkeypatch.chdir(proj)
    sp.save({"w": torch.ones(2)}, ".", overwrite=True)
    Path("notes.txt").write_text("after the save")
    assert sorted(os.listdir(proj)) == ["config.json", "model.safetensors", "notes.txt", "shardpoint.json"]
    assert sp.load(".")["w"].tolist() == [1.0, 1.0]
