"""shardpoint.integrations.accelerate: Accelerate's training state through shardpoint.

The kill-and-resume tests run ``tests/_accelerate_worker.py``'s training loop in fresh
processes (one process, and 2 gloo ranks): a run killed with SIGKILL mid-run and resumed
from its newest committed checkpoint ends with the weights, optimizer and scheduler state
of an uninterrupted run, bit for bit. The other tests build an ``Accelerator`` in this
process (one process, CPU).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration

import shardpoint as sp
from _accelerate_worker import train_rank
from _dist_utils import free_port, run_ranks
from shardpoint.integrations.accelerate import checkpoint_dirs, load_state, save_state
from test_readme import python_block

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_accelerate_worker.py")


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in class attributes; each test starts from none."""
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


# ------------------------------------------------------------------ kill and resume


def _run(run_dir: Path, *, die_at: int | None = None, async_save: bool = False, out: Path | None = None) -> int:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(WORKER), str(run_dir), "30", "5", "-" if die_at is None else str(die_at),
            "1" if async_save else "0", "-" if out is None else str(out)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode


def _assert_same_run(expected: Path, got: Path) -> None:
    a, b = torch.load(expected), torch.load(got)
    assert a["step"] == b["step"] == 30
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for pid, state in a["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optim"]["state"][pid][key]), (pid, key)
    assert a["sched"] == b["sched"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("accelerate-reference")
    _run(d / "run", out=d / "final.pt")
    return d / "final.pt"


@pytest.mark.slow
def test_kill_and_resume_one_process_is_bit_exact(uninterrupted: Path, tmp_path: Path) -> None:
    # Saves every 5 steps (12 batches an epoch, so the resume lands mid-epoch); killed at
    # step 17, resumed from the step-15 save (async saves: the 2-rank test below).
    assert _run(tmp_path / "run", die_at=17) == -signal.SIGKILL
    assert [p.name for p in checkpoint_dirs_of(tmp_path / "run")] == ["checkpoint_1", "checkpoint_2"]
    assert _run(tmp_path / "run", out=tmp_path / "final.pt") == 0
    _assert_same_run(uninterrupted, tmp_path / "final.pt")
    # 6 saves in all (steps 5..30), total_limit=2: the two newest, nothing else left.
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["checkpoint_4", "checkpoint_5"]


def checkpoint_dirs_of(run_dir: Path) -> list[Path]:
    names = [n for n in os.listdir(run_dir / "checkpoints") if re.fullmatch(r"checkpoint_\d+", n)]
    return [run_dir / "checkpoints" / n for n in sorted(names, key=lambda n: int(n.split("_")[1]))
            if (run_dir / "checkpoints" / n / "shardpoint.json").exists()]


@pytest.mark.slow
def test_kill_and_resume_two_gloo_processes_is_bit_exact(tmp_path: Path) -> None:
    # Async saves, both ranks SIGKILLed at step 17 while the step-15 save may be in flight.
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_ranks(train_rank, 2, free_port(), str(ref), 30, 5, None, True, str(tmp_path / "ref.pt"))
    run_ranks(train_rank, 2, free_port(), str(run), 30, 5, 17, True, None, may_be_killed=(0, 1))
    assert checkpoint_dirs_of(run)  # the step-10 save at least
    run_ranks(train_rank, 2, free_port(), str(run), 30, 5, None, True, str(tmp_path / "final.pt"))
    _assert_same_run(tmp_path / "ref.pt", tmp_path / "final.pt")
    assert sorted(os.listdir(run / "checkpoints")) == ["checkpoint_4", "checkpoint_5"]
    manifest = sp.load(run / "checkpoints" / "checkpoint_5", keys=["per_rank", "accelerate"])
    assert len(manifest["per_rank"]["ranks"]) == 2  # each rank's RNG and dataloader states
    assert manifest["accelerate"] == {"step": 0, "iteration": 5}


# ------------------------------------------------------------------ in this process


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def _prepared(project_dir: Path, *, total_limit: int | None = 2, automatic: bool = True) -> tuple[Any, ...]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=automatic, total_limit=total_limit))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched, counter


def _step(accelerator: Any, model: Any, opt: Any, sched: Any) -> None:
    accelerator.backward(model(torch.ones(3, 4)).sum())
    opt.step()
    sched.step()
    opt.zero_grad()


def test_saves_every_prepared_object_and_restores_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    accelerator, model, opt, sched, counter = _prepared(tmp_path, automatic=False)
    _step(accelerator, model, opt, sched)
    counter.n = 7
    info = save_state(accelerator, tmp_path / "ckpt")
    assert isinstance(info, sp.SaveInfo)
    saved = sp.load(tmp_path / "ckpt")
    assert sorted(saved) == ["accelerate", "custom_checkpoint_0", "model", "optimizer", "per_rank", "scheduler"]
    assert saved["custom_checkpoint_0"] == {"n": 7}
    assert saved["scheduler"]["last_epoch"] == 1
    assert sorted(saved["optimizer"]["state"]) == ["bias", "weight"]  # keyed by parameter name
    from shardpoint._cli.main import main

    assert main(["verify", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "OK: whole" in out and "warning" not in out.lower(), out
    weights, state = model.weight.detach().clone(), opt.state_dict()
    # The weights file is the plain module's: safetensors opens it as-is.
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "ckpt" / "model.safetensors")["weight"], weights)
    after = torch.rand(1)

    AcceleratorState._reset_state(True)
    accelerator, model, opt, sched, counter = _prepared(tmp_path, automatic=False)
    assert not torch.equal(model.weight, weights - 1)  # built afresh
    result = load_state(accelerator, tmp_path / "ckpt")
    assert result.ok
    assert torch.equal(model.weight, weights)
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], state["state"][0]["momentum_buffer"])
    assert sched.scheduler.last_epoch == 1 and counter.n == 7
    assert torch.equal(torch.rand(1), after)  # the RNG state at the save


def test_automatic_naming_retention_and_resume_numbering(tmp_path: Path) -> None:
    accelerator, model, opt, sched, _ = _prepared(tmp_path, total_limit=2)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "notes").mkdir()  # the user's: never counted, never deleted
    for _ in range(4):
        _step(accelerator, model, opt, sched)
        save_state(accelerator)
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3", "notes"]
    assert [p.name for p in checkpoint_dirs(accelerator)] == ["checkpoint_2", "checkpoint_3"]
    assert accelerator.project_configuration.iteration == 4

    AcceleratorState._reset_state(True)
    accelerator, model, opt, sched, _ = _prepared(tmp_path, total_limit=2)
    load_state(accelerator)  # the newest: checkpoint_3, and the next save is checkpoint_4
    assert accelerator.project_configuration.iteration == 4
    handle = save_state(accelerator, async_save=True)
    assert isinstance(handle, sp.AsyncSave)
    handle.result()
    assert sorted(os.listdir(root)) == ["checkpoint_3", "checkpoint_4", "notes"]

    accelerator.project_configuration.iteration = 3
    with pytest.raises(sp.CheckpointExistsError, match=r"checkpoint_3: checkpoint 3 exists already; set "
                       r"accelerator.project_configuration.iteration to the next free number"):
        save_state(accelerator)


def test_errors_name_what_to_do(tmp_path: Path) -> None:
    accelerator, *_ = _prepared(tmp_path, automatic=False)
    with pytest.raises(sp.CheckpointError, match="save_state needs output_dir when the Accelerator's "
                       "ProjectConfiguration has no automatic_checkpoint_naming"):
        save_state(accelerator)
    with pytest.raises(sp.CheckpointError, match="load_state needs input_dir"):
        load_state(accelerator)
    AcceleratorState._reset_state(True)
    accelerator, *_ = _prepared(tmp_path / "empty")
    with pytest.raises(sp.CheckpointNotFoundError, match=r"empty/checkpoints: no committed shardpoint "
                       r"checkpoint_<i> here to resume from"):
        load_state(accelerator)
    with pytest.raises(sp.CheckpointError, match=r"save_state\(output_dir='.*one'\): with automatic_"
                       r"checkpoint_naming every checkpoint goes to .*empty/checkpoints/checkpoint_<iteration>"):
        save_state(accelerator, tmp_path / "one")
    AcceleratorState._reset_state(True)
    accelerator, *_ = _prepared(tmp_path, automatic=False)
    save_state(accelerator, tmp_path / "one")
    # A checkpoint of a run with other dataloaders or registered objects does not load silently.
    AcceleratorState._reset_state(True)
    accelerator, *_ = _prepared(tmp_path, automatic=False)
    accelerator.prepare(torch.utils.data.DataLoader(torch.zeros(4, 1)))
    with pytest.raises(sp.CheckpointError, match=r"the checkpoint holds the states of 0 prepared "
                       r"dataloader\(s\), the Accelerator has 1; prepare the same dataloaders"):
        load_state(accelerator, tmp_path / "one")
    AcceleratorState._reset_state(True)
    accelerator, *_ = _prepared(tmp_path, automatic=False)
    accelerator.register_for_checkpointing(Counter())
    with pytest.raises(sp.LoadMismatchError, match="custom_checkpoint_1"):
        load_state(accelerator, tmp_path / "one")
    # A folder of accelerate's own save_state: named, where only its weights matched and the
    # strict refusal advised strict=False (the optimizer and schedulers then stayed as built).
    AcceleratorState._reset_state(True)
    accelerator, *_ = _prepared(tmp_path, automatic=False)
    accelerator.save_state(tmp_path / "theirs")
    with pytest.raises(sp.UnsupportedFormatError) as own:
        load_state(accelerator, tmp_path / "theirs", strict=False)
    assert str(own.value).startswith(f"{tmp_path / 'theirs'} was written by accelerate's own save_state (custom_")
    assert str(own.value).endswith(
        "not by shardpoint's: load it with accelerator.load_state(input_dir), then save with shardpoint from there on")
    # No project_dir at all: nowhere to list checkpoints (was a bare TypeError).
    AcceleratorState._reset_state(True)
    bare = Accelerator(cpu=True)
    with pytest.raises(sp.InvalidArgumentError) as exc:
        checkpoint_dirs(bare)
    assert str(exc.value) == (
        "this Accelerator has no project_dir, so there is no <project_dir>/checkpoints to look in: "
        "create it with project_config=ProjectConfiguration(project_dir=..., "
        "automatic_checkpoint_naming=True), or pass the checkpoint directory itself"
    )


def test_accelerate_s_own_arguments_are_answered_by_name(tmp_path: Path) -> None:
    """Accelerator.save_state / load_state arguments passed through: a bare TypeError naming
    shardpoint's save() / load_into(). The ones that mean what shardpoint does are taken."""
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    save_state(accelerator, tmp_path / "a", safe_serialization=True)
    assert load_state(accelerator, tmp_path / "a", map_location="on_device").ok
    refused = {
        "save_state(safe_serialization=False): shardpoint writes safetensors only; drop the argument":
            lambda: save_state(accelerator, tmp_path / "b", safe_serialization=False),
        "save_state: save_on_each_node is Accelerate's: a collective save writes one checkpoint, committed once, "
        "to a filesystem every node sees. It takes allow_pickle, durable, layout, max_shard_size":
            lambda: save_state(accelerator, tmp_path / "b", save_on_each_node=True),
        "load_state: load_kwargs is Accelerate's options of torch.load: shardpoint unpickles nothing, it loads in "
        "place. It takes allow_pickle, device, device_map, dtype":
            lambda: load_state(accelerator, tmp_path / "a", load_kwargs={"weights_only": True}),
        "load_state(map_location='cuda:1'): shardpoint loads in place into the prepared objects":
            lambda: load_state(accelerator, tmp_path / "a", map_location="cuda:1"),
    }
    for message, call in refused.items():
        with pytest.raises(sp.CheckpointError, match=re.escape(message)):
            call()
    assert not (tmp_path / "b").exists()
    # Model state hooks (diffusers' EMA): not run by this integration, so refused, not skipped.
    handle = accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    with pytest.raises(sp.InvalidArgumentError, match=re.escape(
            "save_state: this Accelerator has 1 hook(s) registered with register_save_state_pre_hook (diffusers' "
            "scripts save an EMA model or adapter weights that way), which shardpoint's integration does not run")):
        save_state(accelerator, tmp_path / "b")
    handle.remove()
    accelerator.register_load_state_pre_hook(lambda models, input_dir: None)
    with pytest.raises(sp.InvalidArgumentError, match="load_state: this Accelerator has 1 hook"):
        load_state(accelerator, tmp_path / "a")
    assert not (tmp_path / "b").exists()


def test_readme_accelerate_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(python_block("shardpoint.integrations.accelerate"), "README.md: accelerate", "exec"), scope)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    assert scope["accelerator"].project_configuration.iteration == 3


def test_a_process_the_checkpoint_has_no_state_for_keeps_its_generators() -> None:
    from types import SimpleNamespace

    from shardpoint.integrations.accelerate import _PerRank

    saved = {"ranks": [{"rng": sp.RNGState().state_dict(), "dataloaders": []}]}
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match=r"this checkpoint holds the RNG and dataloader states of 1 "
                      r"process\(es\); process 1 keeps its own"):
        _PerRank(SimpleNamespace(process_index=1, _dataloaders=[])).load_state_dict(saved)
    assert torch.equal(torch.rand(1), expected)


def test_a_run_resumed_from_a_named_folder_saves_after_it_and_keeps_its_saves(tmp_path: Path) -> None:
    """load_state(accelerator, ".../checkpoint_3") left iteration at 0: the next save
    wrote checkpoint_0 (rotated out before, so free) and total_limit deleted it at once as
    the oldest, every save of the resumed run lost without a word."""
    accelerator, model, opt, sched, _ = _prepared(tmp_path, total_limit=2)
    for _ in range(4):
        _step(accelerator, model, opt, sched)
        save_state(accelerator)
    root = tmp_path / "checkpoints"

    AcceleratorState._reset_state(True)
    accelerator, model, opt, sched, _ = _prepared(tmp_path, total_limit=2)
    load_state(accelerator, root / "checkpoint_2")  # an older one, named by hand
    assert accelerator.project_configuration.iteration == 4  # after every checkpoint there
    _step(accelerator, model, opt, sched)
    info = save_state(accelerator)
    assert info.path == root / "checkpoint_4" or os.fspath(info.path) == os.fspath(root / "checkpoint_4")
    assert [p.name for p in checkpoint_dirs(accelerator)] == ["checkpoint_3", "checkpoint_4"]
    trained = model.weight.detach().clone()

    accelerator.project_configuration.iteration = 0  # set back by hand: warned, saved as the newest
    _step(accelerator, model, opt, sched)
    with pytest.warns(UserWarning, match=r"^save_state: checkpoint_0 would be older than checkpoint_4, already in .*; "
                      r"saving as checkpoint_5$"):
        save_state(accelerator)
    assert [p.name for p in checkpoint_dirs(accelerator)] == ["checkpoint_4", "checkpoint_5"]
    AcceleratorState._reset_state(True)
    accelerator, model, opt, sched, _ = _prepared(tmp_path, total_limit=2)
    load_state(accelerator, root / "checkpoint_4")
    assert torch.equal(model.weight, trained)
