"""README.md's examples run, against tiny real objects.

Every ```python block of the README runs in order; the names a snippet takes for granted
(a ``model`` with a ``config``, ``MyModel``, an ``optimizer``...) are defined here, small: a
two-layer Llama from a tiny config, never downloaded weights. The ``shardpoint ...`` lines
of the ```bash blocks run through the command's ``main`` against the folder the first
snippet saved. The Hugging Face cache block runs against a cache this test lays out as
``huggingface_hub`` does (``HF_HUB_CACHE``; the snippet's ``/data/hf/hub`` is replaced by
it). The object-storage block runs against the test S3 server (SeaweedFS on loopback): its
placeholder credentials and ``s3://bucket/`` are replaced by the server's. Blocks the
suite cannot run are listed in ``NOT_RUN`` with the reason.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"

NOT_RUN = {
    "make demo": "runs the whole demo (tests/test_demo.py runs it)",
    "make test": "runs the whole suite",
}
"""Shell blocks, by their first command, that are not run here, and why."""


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def python_block(marker: str) -> str:
    """The one python block of the README holding ``marker``."""
    found = [b for b in blocks("python") if marker in b]
    assert len(found) == 1, (marker, len(found))
    return found[0]


PYTHON_BLOCKS = {
    "five things": 'sp.save(model.state_dict(), "out/my-model"',
    "distributed": "get_optimizer_state_dict",
    "hf trainer": "ShardpointTrainer(model=gpt2",
    "hf cache": "hf://org/name",
    "object storage": "sp.CheckpointManager(\"s3://bucket/run\"",
    "lightning": "load_from_checkpoint(Net, best",
    "lightning sharded": "ShardpointModelParallelStrategy()",  # run by tests/test_lightning_sharded.py
    "accelerate": "shardpoint.integrations.accelerate",  # run by tests/test_accelerate.py
    "dcp reader": "ShardpointStorageReader",
    "tuning": "sp.using(io=sp.IOOptions(verify_checksums=False))",
}
"""Every python block of the README, by a line it holds; each is run by a test below."""


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
        )
    )


def _names() -> dict[str, Any]:
    """What the snippets assume exists."""
    from transformers import LlamaForCausalLM

    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {
        "model": model,
        "MyModel": LlamaForCausalLM,
        "config": model.config,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=10),
        "total_steps": 1000,
        "val_loss": 0.25,
    }


def shell_commands(block: str) -> list[list[str]]:
    """The ``shardpoint ...`` (or ``python -m shardpoint ...``) command lines of a shell block
    (comments stripped), each as ``["shardpoint", ...]``."""
    return [
        shlex.split(line.strip().removeprefix("python -m "), comments=True)
        for line in block.splitlines()
        if line.strip().startswith(("shardpoint ", "python -m shardpoint "))
    ]


def _torchtitan_dcp(model: Any, path: str) -> None:
    """A DCP checkpoint in torchtitan's layout (model keys at the top level)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {**model.state_dict(), "train_state": {"step": torch.tensor(1000)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path)


def test_readme_tuning_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    before = sp.current_options()
    exec(python_block(PYTHON_BLOCKS["tuning"]), {})
    assert capsys.readouterr().out == f"{before.io.write_threads}\n"
    assert sp.load(tmp_path / "out/tuned")["w"].tolist() == [1.0] * 4
    assert sp.current_options() == before


def test_readme_dcp_reader_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    monkeypatch.chdir(tmp_path)
    saved = _names()
    sp.save({"model": saved["model"].state_dict(), "optim": saved["optimizer"].state_dict()}, "ckpt/step-100")
    model = _tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=5.0)
    scope = {"model": model, "opt": opt}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is ... uninitialized"
        exec(compile(python_block(PYTHON_BLOCKS["dcp reader"]), "README.md: dcp reader", "exec"), scope)
    for name, want in saved["model"].state_dict().items():
        assert torch.equal(scope["state"]["model"][name], want), name
    assert torch.equal(model.lm_head.weight, saved["model"].lm_head.weight)  # in place
    assert scope["state"]["optim"]["param_groups"][0]["lr"] == 1e-3
    written = sp.load("ckpt/step-200")  # dcp.save through ShardpointStorageWriter
    assert torch.equal(written["model"]["lm_head.weight"], saved["model"].lm_head.weight)


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    """A new block in the README needs a test here: this fails until it has one."""
    python = blocks("python")
    assert len(python) == len(PYTHON_BLOCKS)
    assert {m: python_block(m) for m in PYTHON_BLOCKS.values()}
    bash = blocks("bash")
    commands = [(c[1], c[2].startswith("hf://")) for b in bash for c in shell_commands(b)]
    assert commands == [
        ("inspect", False), ("inspect", False), ("verify", False), ("convert", False),
        ("convert", False), ("diff", False), ("verify", False), ("inspect", True),
    ]
    first_words = {line.split("#")[0].strip() for b in bash for line in b.splitlines()}
    others = {w for w in first_words if w and not w.startswith(("shardpoint ", "python -m shardpoint "))}
    assert others == {"make demo", "make test", "make bench", "make lint"}, others


@pytest.mark.slow
def test_readme_python_and_cli_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    first.mkdir()
    monkeypatch.chdir(first)
    names = _names()
    original = names["model"]  # the snippet rebinds `model` (built on meta, loaded in bf16)
    block = python_block(PYTHON_BLOCKS["five things"])
    exec(compile(block, "README.md: the five things", "exec"), names)
    # What the snippet promised: transformers reads the folder; the manager kept its steps.
    from transformers import LlamaForCausalLM

    reloaded = LlamaForCausalLM.from_pretrained("out/my-model")
    assert torch.equal(reloaded.lm_head.weight, original.lm_head.weight)
    assert names["model"].lm_head.weight.dtype == torch.bfloat16
    assert names["sd"]["lm_head.weight"].dtype == torch.bfloat16
    assert names["mgr"].steps() == [500, 1000]
    assert names["start"] == 1

    # The shell lines, against what the first snippet saved (+ the files they name).
    torch.save(names["model"].state_dict(), "model.pt")
    sp.save(names["model"].state_dict(), "ckpt/step-100")
    _torchtitan_dcp(names["model"], "titan/step-1000")
    capsys.readouterr()
    commands = [c for b in blocks("bash") for c in shell_commands(b) if "hf://" not in c[2]]
    assert len(commands) == 7
    for argv in commands:
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, (argv, out, err)
        assert "warning" not in out, (argv, out)
    assert sp.load("out/my-model-bf16")["lm_head.weight"].dtype == torch.bfloat16
    published = sp.load("out/publish")  # the torchtitan model alone, flat
    assert sorted(published) == sorted(names["model"].state_dict())
    assert torch.equal(published["lm_head.weight"], names["model"].lm_head.weight)

    # The distributed block, in one process (no process group: the same calls).
    second = tmp_path / "second"
    second.mkdir()
    monkeypatch.chdir(second)
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = _tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    scope = {"sp": sp, "torch": torch, "model": model, "opt": opt,  # imported by the first block
             "get_optimizer_state_dict": get_optimizer_state_dict,
             "set_optimizer_state_dict": set_optimizer_state_dict}
    block = python_block(PYTHON_BLOCKS["distributed"])
    exec(compile(block, "README.md: distributed", "exec"), scope)
    assert sorted(sp.load("ckpt/step-100")) == ["model", "optim"]
    assert scope["save_pretrained"] is sp.integrations.transformers.save_pretrained


def test_readme_hf_trainer_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {"sp": sp}
    exec(compile(python_block(PYTHON_BLOCKS["hf trainer"]), "README.md: hf trainer", "exec"), scope)
    assert sorted(os.listdir("runs/gpt2")) == ["checkpoint-2", "checkpoint-4"]
    assert scope["trainer"].state.global_step == 4
    assert sorted(sp.load("runs/gpt2/checkpoint-4")) == ["model", "optim", "rng", "sched"]
    loaded, trained = scope["model"].state_dict(), scope["gpt2"].state_dict()
    assert [k for k in trained if not torch.equal(loaded[k], trained[k])] == []


def test_readme_object_storage_example_runs(opts: dict[str, Any], url: str) -> None:
    block = python_block(PYTHON_BLOCKS["object storage"])
    placeholder = re.search(r"^opts = \{.*\}$", block, flags=re.M)
    assert placeholder is not None, block
    code = block.replace(placeholder.group(), "opts = server_opts").replace("s3://bucket/", f"{url}/")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.lm_head = torch.nn.Linear(4, 2)
    scope = {"sp": sp, "model": model, "server_opts": opts}
    exec(compile(code, "README.md: object storage", "exec"), scope)
    assert torch.equal(scope["sd"]["lm_head.weight"], model.lm_head.weight)
    assert isinstance(scope["mgr"], sp.CheckpointManager)


def _cache_repo(cache: Path, repo_id: str, source: Path, revisions: list[str]) -> None:
    """Lay ``source`` out in ``cache`` as ``huggingface_hub`` does (blobs, a snapshot of
    links, refs naming its commit)."""
    import hashlib

    from huggingface_hub.file_download import repo_folder_name

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    for revision in revisions:
        (repo / "refs" / revision).write_text(commit)
    for path in sorted(source.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))


def test_readme_hugging_face_cache_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _tiny_llama()
    model.save_pretrained(tmp_path / "source")
    cache = tmp_path / "hub"
    _cache_repo(cache, "org/name", tmp_path / "source", ["main", "v1.0"])
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read once at import from the env
    monkeypatch.chdir(tmp_path)
    block = python_block(PYTHON_BLOCKS["hf cache"])
    assert '"/data/hf/hub"' in block
    target = _tiny_llama()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    scope = {"sp": sp, "model": target}
    exec(compile(block.replace('"/data/hf/hub"', repr(str(cache))), "README.md: hf cache", "exec"), scope)
    assert torch.equal(scope["sd"]["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(target.lm_head.weight, model.lm_head.weight)
    assert sp.load("out/name-bf16")["lm_head.weight"].dtype == torch.bfloat16
    capsys.readouterr()
    commands = [c for b in blocks("bash") for c in shell_commands(b) if "hf://" in c[2]]
    assert len(commands) == 1
    for argv in commands:
        assert main(argv[1:]) == 0, capsys.readouterr()
        assert "model.safetensors" in capsys.readouterr().out


@pytest.mark.slow  # importing Lightning takes most of it
def test_readme_lightning_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as a user's script is: a module of its own (its Enum found again by name)."""
    pytest.importorskip("lightning.pytorch")
    import sys
    import types
    import warnings

    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("readme_lightning_script")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(python_block(PYTHON_BLOCKS["lightning"]), "README.md: lightning", "exec"), module.__dict__)
    best = module.best
    assert os.path.isfile(os.path.join(best, "shardpoint.json"))
    manifest = Path(best, "shardpoint.json").read_text()
    assert '"type":"enum","class":"readme_lightning_script:Act"' in manifest
    assert module.model.hparams.args == argparse.Namespace(lr=0.1)
