"""README.md's examples run, against tiny real objects.

Every ```python block of the README runs in order; the names a snippet takes for granted
(a ``model`` with a ``config``, ``MyModel``, an ``optimizer``...) are defined here, small: a
two-layer Llama from a tiny config, never downloaded weights. The ``shardpoint ...`` lines
of the ```bash blocks run through the command's ``main`` against the folder the first
snippet saved. The object-storage block runs against the test S3 server (SeaweedFS on
loopback): its placeholder credentials and ``s3://bucket/`` are replaced by the server's.
Blocks the suite cannot run are listed in ``NOT_RUN`` with the reason.
"""

from __future__ import annotations

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
    """The ``shardpoint ...`` command lines of a shell block (comments stripped)."""
    return [
        shlex.split(line, comments=True)
        for line in block.splitlines()
        if line.strip().startswith("shardpoint ")
    ]


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    python = blocks("python")
    assert len(python) == 3
    assert "sp.save(model.state_dict(), \"out/my-model\"" in python[0]
    assert "s3://" in python[2]
    bash = blocks("bash")
    commands = [c[1] for b in bash for c in shell_commands(b)]
    assert commands == ["inspect", "inspect", "verify", "convert", "diff"]
    first_words = {line.split("#")[0].strip() for b in bash for line in b.splitlines()}
    others = {w for w in first_words if w and not w.startswith("shardpoint ")}
    assert others == {"make demo", "make test", "make bench", "make lint"}, others


@pytest.mark.slow
def test_readme_python_and_cli_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    python = blocks("python")
    first = tmp_path / "first"
    first.mkdir()
    monkeypatch.chdir(first)
    names = _names()
    exec(compile(python[0], "README.md:python[0]", "exec"), names)
    # What the snippet promised: transformers reads the folder; the manager kept its steps.
    from transformers import LlamaForCausalLM

    reloaded = LlamaForCausalLM.from_pretrained("out/my-model")
    assert torch.equal(reloaded.lm_head.weight, names["model"].lm_head.weight)
    assert names["sd"]["lm_head.weight"].dtype == torch.bfloat16
    assert names["mgr"].steps() == [500, 1000]
    assert names["start"] == 1

    # The shell lines, against what the first snippet saved (+ the files they name).
    torch.save(names["model"].state_dict(), "model.pt")
    sp.save(names["model"].state_dict(), "ckpt/step-100")
    capsys.readouterr()
    commands = [c for b in blocks("bash") for c in shell_commands(b)]
    for argv in commands:
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, (argv, out, err)
        assert "warning" not in out, (argv, out)
    assert sp.load("out/my-model-bf16")["lm_head.weight"].dtype == torch.bfloat16

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
    exec(compile(python[1], "README.md:python[1]", "exec"), scope)
    assert sorted(sp.load("ckpt/step-100")) == ["model", "optim"]
    assert scope["save_pretrained"] is sp.integrations.transformers.save_pretrained


def test_readme_object_storage_example_runs(opts: dict[str, Any], url: str) -> None:
    block = blocks("python")[2]
    placeholder = re.search(r"^opts = \{.*\}$", block, flags=re.M)
    assert placeholder is not None, block
    code = block.replace(placeholder.group(), "opts = server_opts").replace("s3://bucket/", f"{url}/")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.lm_head = torch.nn.Linear(4, 2)
    scope = {"sp": sp, "model": model, "server_opts": opts}
    exec(compile(code, "README.md:python[2]", "exec"), scope)
    assert torch.equal(scope["sd"]["lm_head.weight"], model.lm_head.weight)
    assert isinstance(scope["mgr"], sp.CheckpointManager)
