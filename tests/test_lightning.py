"""ShardpointCheckpointIO with a real Lightning Trainer: top-k + last, resume, async, verify."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import math
import os
import pathlib
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from lightning.pytorch.utilities.parsing import AttributeDict  # noqa: E402

import shardpoint as sp  # noqa: E402
from shardpoint._cli.main import main as cli_main  # noqa: E402
from shardpoint.integrations.lightning import ShardpointCheckpointIO, load_from_checkpoint  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore:.*LeafSpec:FutureWarning"
)


class TinyModule(pl.LightningModule):
    def __init__(self, lr: float = 0.01, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class LossRecorder(Callback):
    """The training loss of every optimizer step, by global step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses[trainer.global_step] = outputs["loss"].item()


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)  # 4 steps per epoch


def _fit(io, dirpath, *, max_epochs: int, ckpt_path=None, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = TinyModule()
    recorder = LossRecorder()
    checkpoint = ModelCheckpoint(dirpath=dirpath, save_top_k=2, monitor="val_loss", save_last=True)
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        plugins=[io],
        callbacks=[checkpoint, recorder],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, _data(), _data(), ckpt_path=ckpt_path)
    return model, recorder.losses, checkpoint


def _step(name: str) -> int:
    return int(re.search(r"step=(\d+)", name).group(1))  # type: ignore[union-attr]


def _check_run(dirpath, checkpoint: ModelCheckpoint) -> list[str]:  # type: ignore[no-untyped-def]
    names = sorted(os.listdir(dirpath))
    topk = sorted((n for n in names if n.startswith("epoch=")), key=_step)
    # top-2 of three epochs plus last; the displaced one removed; no temporary leftovers.
    assert len(topk) == 2 and "last.ckpt" in names and len(names) == 3, names
    assert {os.path.basename(p) for p in checkpoint.best_k_models} == set(topk)
    for name in names:
        path = os.path.join(dirpath, name)
        assert os.path.isdir(path) and os.path.isfile(os.path.join(path, "shardpoint.json"))
        assert cli_main(["verify", path]) == 0
    return topk


def _assert_linked(last, same_step) -> None:  # type: ignore[no-untyped-def]
    """last.ckpt shares the data files of the top-k checkpoint of its step: linked, not rewritten."""
    for fname in ("model.safetensors", "optim.safetensors", "callbacks.safetensors"):
        a, b = os.stat(last / fname), os.stat(same_step / fname)
        assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev) and a.st_nlink == 2


def test_trainer_topk_last_resume_identical(tmp_path) -> None:
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    model, losses, checkpoint = _fit(ShardpointCheckpointIO(), full_dir, max_epochs=3)
    assert sorted(losses) == list(range(1, 13))
    topk = _check_run(full_dir, checkpoint)

    io = ShardpointCheckpointIO()
    last = io.load_checkpoint(full_dir / "last.ckpt")
    assert last["global_step"] == 12 and last["epoch"] == 2
    assert "epoch=2-step=12.ckpt" in topk
    _assert_linked(full_dir / "last.ckpt", full_dir / "epoch=2-step=12.ckpt")
    for key, value in model.state_dict().items():
        assert torch.equal(last["state_dict"][key], value)
    (cb_state,) = (v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert cb_state["last_model_path"] == str(full_dir / "last.ckpt")
    assert isinstance(last["optimizer_states"], list) and sorted(
        last["optimizer_states"][0]["state"]
    ) == [0, 1, 2, 3]
    assert last["hyper_parameters"] == {"lr": 0.01, "width": 16}

    # Resume from the earliest remaining top-k checkpoint, with other initial weights:
    # every later step's loss and the final weights are bit-identical.
    start = topk[0]
    resumed_model, resumed_losses, _ = _fit(
        ShardpointCheckpointIO(),
        resumed_dir,
        max_epochs=3,
        ckpt_path=str(full_dir / start),
        seed=123,
    )
    assert sorted(resumed_losses) == list(range(_step(start) + 1, 13))
    assert resumed_losses == {s: losses[s] for s in resumed_losses}
    for key, value in model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[key], value)


def test_trainer_under_async_checkpoint_io(tmp_path) -> None:
    model, losses, checkpoint = _fit(
        AsyncCheckpointIO(ShardpointCheckpointIO()), tmp_path / "a", max_epochs=3
    )
    topk = _check_run(tmp_path / "a", checkpoint)
    assert "epoch=2-step=12.ckpt" in topk
    _assert_linked(tmp_path / "a" / "last.ckpt", tmp_path / "a" / "epoch=2-step=12.ckpt")
    resumed_model, resumed_losses, _ = _fit(
        AsyncCheckpointIO(ShardpointCheckpointIO()),
        tmp_path / "b",
        max_epochs=3,
        ckpt_path=str(tmp_path / "a" / topk[0]),
        seed=7,
    )
    assert resumed_losses and resumed_losses == {s: losses[s] for s in resumed_losses}
    for key, value in model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[key], value)


def _checkpoint_dict() -> dict:
    return {
        "epoch": 3,
        "global_step": 40,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.weight": torch.arange(6.0).reshape(2, 3), "net.bias": torch.zeros(2)},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(40.0), "exp_avg": torch.ones(2, 3)}, 1: {}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "lr_schedulers": [{"base_lrs": [0.1], "last_epoch": 3, "best": math.inf}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss'}": {"best_model_score": torch.tensor(0.25)}
        },
        "hparams_name": "kwargs",
        "hyper_parameters": AttributeDict(lr=0.1, args=argparse.Namespace(depth=2, act="relu")),
        "my key/with slash": {"x": 1},
        "shardpoint": "a key named like a reserved component",
        "model-00001-of-00002": {"x": 2},  # named like a data file of the model: kept apart
        "Callbacks": {"x": 3},  # differs from "callbacks" only in case: one file on macOS
    }


def test_round_trip_structure_and_types(tmp_path) -> None:
    io = ShardpointCheckpointIO()
    path = tmp_path / "epoch=3-step=40.ckpt"
    io.save_checkpoint(_checkpoint_dict(), path)
    assert sorted(os.listdir(path)) == [
        "callbacks.safetensors",
        "model.safetensors",
        "optim.safetensors",
        "shardpoint.json",
    ]
    got = io.load_checkpoint(path)
    assert list(got) == list(_checkpoint_dict())
    assert got["epoch"] == 3 and got["global_step"] == 40
    assert torch.equal(got["state_dict"]["net.weight"], torch.arange(6.0).reshape(2, 3))
    opt = got["optimizer_states"]
    assert isinstance(opt, list) and list(opt[0]["state"]) == [0, 1] and opt[0]["state"][1] == {}
    assert torch.equal(opt[0]["state"][0]["exp_avg"], torch.ones(2, 3))
    assert opt[0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert got["lr_schedulers"][0]["best"] == math.inf
    assert got["hyper_parameters"] == {"lr": 0.1, "args": argparse.Namespace(depth=2, act="relu")}
    assert type(got["hyper_parameters"]["args"]) is argparse.Namespace
    assert got["my key/with slash"] == {"x": 1}
    assert got["shardpoint"] == "a key named like a reserved component"
    assert got["model-00001-of-00002"] == {"x": 2} and got["Callbacks"] == {"x": 3}
    # The model component is a plain safetensors file of the LightningModule's weights.
    assert sorted(sp.load(path, keys=["model"])["model"]) == ["net.bias", "net.weight"]
    assert cli_main(["verify", str(path)]) == 0
    # Its manifest lost (committed last: a copy cut short), the folder is not a whole
    # checkpoint; plain sp.load would read model.safetensors alone (was a bare KeyError in
    # Lightning's restore).
    (path / "shardpoint.json").unlink()
    with pytest.raises(sp.IncompleteCheckpointError) as exc:
        io.load_checkpoint(path)
    assert str(exc.value).startswith(
        f"{path} has no shardpoint.json, which every checkpoint ShardpointCheckpointIO writes holds")


class Color(enum.Enum):
    RED = "red"


class Unstorable:
    """An object the default IO pickles and shardpoint cannot store without pickle."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unstorable) and other.n == self.n


def test_objects_need_allow_pickle(tmp_path) -> None:
    ckpt = {
        "epoch": 0,
        "global_step": 1,
        "state_dict": {"w": torch.ones(1)},
        "hyper_parameters": {"color": Color.RED, "thing": Unstorable(3)},
    }
    with pytest.raises(
        sp.InvalidStateError,
        match=r"state at hyper_parameters\['thing'\] is a .*Unstorable, which shardpoint cannot store.*"
        r"ShardpointCheckpointIO\(allow_pickle=True\)",
    ):
        ShardpointCheckpointIO().save_checkpoint(ckpt, tmp_path / "a.ckpt")
    assert not os.path.exists(tmp_path / "a.ckpt")

    io = ShardpointCheckpointIO(allow_pickle=True)
    io.save_checkpoint(ckpt, tmp_path / "b.ckpt")
    assert io.load_checkpoint(tmp_path / "b.ckpt")["hyper_parameters"] == {"color": Color.RED, "thing": Unstorable(3)}
    with pytest.raises(sp.UnsafePickleError, match="allow_pickle=True"):
        ShardpointCheckpointIO().load_checkpoint(tmp_path / "b.ckpt")
    with pytest.raises(sp.UnsafePickleError):
        io.load_checkpoint(tmp_path / "b.ckpt", weights_only=True)


class Activation(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


@dataclasses.dataclass
class OptimConfig:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)


class TypedHparamsModule(pl.LightningModule):
    """Hyperparameters holding a Path, an Enum, a Namespace, a dataclass and a datetime."""

    def __init__(
        self,
        data_dir: pathlib.Path = pathlib.Path("/data/train"),
        act: Activation = Activation.TANH,
        args: argparse.Namespace | None = None,
        optim: OptimConfig | None = None,
        started: datetime.datetime = datetime.datetime(2024, 1, 1),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh() if act is Activation.TANH else nn.ReLU(), nn.Linear(16, 1))

    training_step = TinyModule.training_step
    validation_step = TinyModule.validation_step

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=self.hparams.optim.lr, betas=self.hparams.optim.betas)


TYPED_HPARAMS = {
    "data_dir": pathlib.Path("/runs/exp 1/data"),
    "act": Activation.RELU,
    "args": argparse.Namespace(seed=7, tags=["a", "b"], out=pathlib.Path("out")),
    "optim": OptimConfig(lr=0.02, betas=(0.8, 0.99)),
    "started": datetime.datetime(2025, 6, 1, 9, 30, tzinfo=datetime.timezone.utc),
}


def _typed_fit(dirpath, *, max_epochs: int, ckpt_path=None):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TypedHparamsModule(**TYPED_HPARAMS)
    checkpoint = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(
        max_epochs=max_epochs, plugins=[ShardpointCheckpointIO()], callbacks=[checkpoint], accelerator="cpu",
        devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, _data(), _data(), ckpt_path=ckpt_path)
    return model, trainer


def test_typed_hyperparameters_train_resume_and_load_without_pickle(tmp_path) -> None:
    """Path, Enum, Namespace, dataclass and datetime hyperparameters: stored as typed nodes,
    resumed from, and rebuilt by the one-call loader with equal values."""
    full, _ = _typed_fit(tmp_path / "a", max_epochs=3)
    manifest = (tmp_path / "a" / "last.ckpt" / "shardpoint.json").read_text()
    assert '"type": "pickle"' not in manifest and '"type":"pickle"' not in manifest
    assert f'"class":"{__name__}:OptimConfig"' in manifest.replace(" ", "")
    saved = ShardpointCheckpointIO().load_checkpoint(tmp_path / "a" / "epoch=0-step=4.ckpt")["hyper_parameters"]
    assert saved == TYPED_HPARAMS and [type(v) for v in saved.values()] == [type(v) for v in TYPED_HPARAMS.values()]

    # Resumed from epoch 0: the same weights as the uninterrupted run, bit for bit.
    resumed, trainer = _typed_fit(tmp_path / "b", max_epochs=3, ckpt_path=str(tmp_path / "a" / "epoch=0-step=4.ckpt"))
    assert trainer.global_step == 12
    for key, value in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key

    loaded = load_from_checkpoint(TypedHparamsModule, tmp_path / "b" / "last.ckpt", map_location="cpu")
    assert type(loaded) is TypedHparamsModule
    assert dict(loaded.hparams) == TYPED_HPARAMS
    for key, value in TYPED_HPARAMS.items():
        assert type(loaded.hparams[key]) is type(value), key
    assert isinstance(loaded.net[1], nn.ReLU)
    for key, value in resumed.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    # Overrides and strict, as Lightning's own load_from_checkpoint.
    other = load_from_checkpoint(TypedHparamsModule, tmp_path / "b" / "last.ckpt", act=Activation.TANH)
    assert isinstance(other.net[1], nn.Tanh) and other.hparams.act is Activation.TANH
    assert other.hparams.optim == OptimConfig(lr=0.02, betas=(0.8, 0.99))

    class Wider(TypedHparamsModule):
        def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(**kwargs)
            self.extra = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "extra.weight", "extra.bias"'):
        load_from_checkpoint(Wider, tmp_path / "b" / "last.ckpt")
    loose = load_from_checkpoint(Wider, tmp_path / "b" / "last.ckpt", strict=False)
    assert torch.equal(loose.net[0].weight, loaded.net[0].weight)


def test_load_from_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(sp.CheckpointNotFoundError, match=r"nothing\.ckpt does not exist"):
        load_from_checkpoint(TinyModule, tmp_path / "nothing.ckpt")
    with pytest.raises(sp.errors.InvalidArgumentTypeError, match=r"load_from_checkpoint needs a LightningModule or LightningDataModule class, got <class 'int'>"):
        load_from_checkpoint(int, tmp_path / "nothing.ckpt")
    # A torch.save checkpoint (written without the plugin) is named as such, with what to use.
    torch.save({"state_dict": TinyModule().state_dict(), "epoch": 0, "global_step": 1}, tmp_path / "plain.ckpt")
    message = r"plain\.ckpt is a file, not a checkpoint directory written by ShardpointCheckpointIO .*MyModel\.load_from_checkpoint\(path\)"
    with pytest.raises(sp.UnsupportedFormatError, match=message):
        load_from_checkpoint(TinyModule, tmp_path / "plain.ckpt")
    with pytest.raises(sp.UnsupportedFormatError, match=message):
        _fit(ShardpointCheckpointIO(), tmp_path / "run", max_epochs=1, ckpt_path=str(tmp_path / "plain.ckpt"))


def test_lightning_without_the_plugin_cannot_open_the_directory(tmp_path) -> None:
    """No hook of Lightning sees the path before fsspec opens it as a file: the failure is
    Lightning's IsADirectoryError (documented: use load_from_checkpoint / the plugin). Pinned
    so that a Lightning release that changes this is noticed."""
    io = ShardpointCheckpointIO()
    io.save_checkpoint({"epoch": 0, "global_step": 1, "state_dict": TinyModule().state_dict(),
                        "hyper_parameters": {"lr": 0.01, "width": 16}}, tmp_path / "x.ckpt")
    with pytest.raises(IsADirectoryError):
        TinyModule.load_from_checkpoint(tmp_path / "x.ckpt")
    assert load_from_checkpoint(TinyModule, tmp_path / "x.ckpt").hparams == {"lr": 0.01, "width": 16}


def test_same_step_links_only_identical_tensors(tmp_path) -> None:
    io = ShardpointCheckpointIO()
    ckpt = _checkpoint_dict()
    io.save_checkpoint(ckpt, tmp_path / "epoch=3-step=40.ckpt")
    assert not io.last_save_linked

    ckpt["callbacks"]["ModelCheckpoint{'monitor': 'val_loss'}"]["last_model_path"] = "last.ckpt"
    io.save_checkpoint(ckpt, tmp_path / "last.ckpt")
    assert io.last_save_linked
    a, b = (
        os.stat(tmp_path / n / "model.safetensors") for n in ("epoch=3-step=40.ckpt", "last.ckpt")
    )
    assert a.st_ino == b.st_ino
    got = io.load_checkpoint(tmp_path / "last.ckpt")
    assert (
        got["callbacks"]["ModelCheckpoint{'monitor': 'val_loss'}"]["last_model_path"] == "last.ckpt"
    )
    assert cli_main(["verify", str(tmp_path / "last.ckpt")]) == 0

    # Same step, but a tensor changed in place (no version bump): written, not linked.
    ckpt["state_dict"]["net.weight"].data[0, 0] = 100.0
    io.save_checkpoint(ckpt, tmp_path / "last.ckpt")
    assert not io.last_save_linked
    assert (
        io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]["net.weight"][0, 0].item() == 100.0
    )
    # The earlier checkpoint still holds its own bytes.
    assert (
        io.load_checkpoint(tmp_path / "epoch=3-step=40.ckpt")["state_dict"]["net.weight"][
            0, 0
        ].item()
        == 0.0
    )

    # Another step: always written.
    ckpt["global_step"] = 41
    io.save_checkpoint(ckpt, tmp_path / "epoch=3-step=41.ckpt")
    assert not io.last_save_linked

    # The previous checkpoint removed before the copy: written in full.
    io.remove_checkpoint(tmp_path / "epoch=3-step=41.ckpt")
    io.save_checkpoint(ckpt, tmp_path / "last.ckpt")
    assert not io.last_save_linked
    assert cli_main(["verify", str(tmp_path / "last.ckpt")]) == 0


def test_remove_and_replace_files_and_links(tmp_path) -> None:
    io = ShardpointCheckpointIO()
    ckpt = {"epoch": 0, "global_step": 1, "state_dict": {"w": torch.ones(2)}}
    io.save_checkpoint(ckpt, tmp_path / "epoch=0-step=1.ckpt")
    # save_last="link" leaves a symlink; a torch.save checkpoint is a file: both replaced.
    os.symlink("epoch=0-step=1.ckpt", tmp_path / "last.ckpt")
    io.save_checkpoint(ckpt, tmp_path / "last.ckpt")
    assert os.path.isdir(tmp_path / "last.ckpt") and not os.path.islink(tmp_path / "last.ckpt")
    (tmp_path / "old.ckpt").write_bytes(b"torch.save bytes")
    io.save_checkpoint(ckpt, tmp_path / "old.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "old.ckpt")["state_dict"]["w"], torch.ones(2))

    os.symlink("epoch=0-step=1.ckpt", tmp_path / "link.ckpt")
    io.remove_checkpoint(tmp_path / "link.ckpt")
    assert os.path.isdir(tmp_path / "epoch=0-step=1.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-step=1.ckpt")
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "old.ckpt"]
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "epoch=0-step=1.ckpt")
    # A directory this plugin did not write is the user's: left alone, with a warning.
    (tmp_path / "mine.ckpt").mkdir()
    (tmp_path / "mine.ckpt" / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"mine\.ckpt is a directory this plugin did not write"):
        io.remove_checkpoint(tmp_path / "mine.ckpt")
    assert (tmp_path / "mine.ckpt" / "notes.txt").read_text() == "mine"


def test_storage_options_refused(tmp_path) -> None:
    from shardpoint.errors import InvalidArgumentTypeError

    with pytest.raises(InvalidArgumentTypeError, match="storage_options"):
        ShardpointCheckpointIO().save_checkpoint(
            {"state_dict": {}}, tmp_path / "x.ckpt", storage_options={"a": 1}
        )


def test_removal_of_a_queued_save_happens_when_it_commits(tmp_path) -> None:
    """Under AsyncCheckpointIO Lightning may remove a path whose save is queued behind the one
    running: removed when it commits. A removal of a path that never comes expires, where it
    deleted a later save of that path (OnExceptionCheckpoint's teardown, then a crash)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    ckpt = {"epoch": 0, "global_step": 1, "state_dict": {"w": torch.ones(2)}}
    io = ShardpointCheckpointIO()
    write, running, go = io._write, threading.Event(), threading.Event()

    def held(*args, **kwargs):  # the save running while Lightning removes the queued one
        running.set()
        go.wait(60)
        return write(*args, **kwargs)

    with ThreadPoolExecutor(max_workers=1) as pool:  # as AsyncCheckpointIO runs saves
        io._write = held
        first = pool.submit(io.save_checkpoint, ckpt, tmp_path / "a.ckpt")
        assert running.wait(60)
        io._write = write
        io.remove_checkpoint(tmp_path / "b.ckpt")  # its save is queued behind a.ckpt's
        queued = pool.submit(io.save_checkpoint, ckpt, tmp_path / "b.ckpt")
        go.set()
        first.result(), queued.result()
        assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]
        pool.submit(io.save_checkpoint, ckpt, tmp_path / "b.ckpt").result()  # a later save stays
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt"]

    # Removing a path that does not exist while no save runs is a no-op, after async saves too.
    io.remove_checkpoint(tmp_path / "on_exception.ckpt")
    io.save_checkpoint(ckpt, tmp_path / "on_exception.ckpt")
    assert os.path.isdir(tmp_path / "on_exception.ckpt")
    sync = ShardpointCheckpointIO()
    sync.remove_checkpoint(tmp_path / "c.ckpt")
    sync.save_checkpoint(ckpt, tmp_path / "c.ckpt")
    assert os.path.isdir(tmp_path / "c.ckpt")


def test_a_checkpoint_that_cannot_be_removed_is_a_storage_error_naming_it(tmp_path) -> None:
    """remove_checkpoint where the folder refuses the rename (an immutable parent: EPERM even
    for root): a StorageError with errno, naming the checkpoint and saying it was left."""
    import subprocess

    from shardpoint.errors import StorageError

    io = ShardpointCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "p" / "a.ckpt")
    if subprocess.run(["chattr", "+i", str(tmp_path / "p")], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        with pytest.raises(StorageError) as info:
            io.remove_checkpoint(tmp_path / "p" / "a.ckpt")
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "p")], check=True)
    assert info.value.errno == 1
    assert str(info.value) == (
        f"cannot remove checkpoint {tmp_path / 'p' / 'a.ckpt'}: [Errno 1] Operation not permitted; it was "
        "left in place. Check the directory's permissions, or remove it yourself"
    )
    assert os.path.isdir(tmp_path / "p" / "a.ckpt")


def test_lightning_checkpoint_dicts_keep_a_schedulers_counter(tmp_path: pathlib.Path) -> None:
    """Mappings become dicts on the way in (Lightning's AttributeDict), but MultiStepLR's
    milestones stay a Counter: a resumed run called .elements() on them and failed."""
    import collections

    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    checkpoint = {"lr_schedulers": [{"milestones": collections.Counter({2: 1, 4: 1}), "gamma": 0.5}], "epoch": 1}
    io = ShardpointCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    back = io.load_checkpoint(tmp_path / "last.ckpt")
    assert back == checkpoint and type(back["lr_schedulers"][0]["milestones"]) is collections.Counter


# --------------------------------------------------------------------- a file at the path


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "moved-aside"])
def test_a_file_or_link_at_the_path_is_replaced_at_the_commit_and_kept_when_the_save_fails(
        tmpfs_1m: pathlib.Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    """last.ckpt left by Lightning's own CheckpointIO (a torch.save file) or save_last="link"
    was removed before the new save was written: a save that then failed (a full disk, a
    kill) lost the run's resume point, and the error said it was unchanged."""
    from shardpoint._storage import local

    if not exchange:  # a filesystem without RENAME_EXCHANGE: moved aside, put back on failure
        real = local._rename2
        monkeypatch.setattr(local, "_rename2", lambda a, b, flags: False if flags == local._RENAME_EXCHANGE
                            else real(a, b, flags))
    mnt = tmpfs_1m
    last = mnt / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1000)}, "epoch": 3, "global_step": 300}, last)
    before = last.read_bytes()
    io = ShardpointCheckpointIO()
    with pytest.raises(sp.StorageError, match=r"No space left on device.*the checkpoint that was there before, if "
                                               r"any, is unchanged"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(400_000)}, "epoch": 4, "global_step": 400}, last)
    assert last.is_file() and last.read_bytes() == before
    assert sorted(os.listdir(mnt)) == ["last.ckpt"]
    io.save_checkpoint({"state_dict": {"w": torch.full((1000,), 2.0)}, "epoch": 4, "global_step": 400}, last)
    assert last.is_dir() and io.load_checkpoint(last)["state_dict"]["w"].tolist() == [2.0] * 1000
    assert sorted(os.listdir(mnt)) == ["last.ckpt"]
    # save_last="link": the link is replaced, what it pointed to is left as it was.
    best = mnt / "epoch=4-step=400.ckpt"
    last.rename(best)
    last.symlink_to(best.name)
    io.save_checkpoint({"state_dict": {"w": torch.full((1000,), 5.0)}, "epoch": 5, "global_step": 500}, last)
    assert not last.is_symlink() and io.load_checkpoint(last)["state_dict"]["w"].tolist() == [5.0] * 1000
    assert io.load_checkpoint(best)["state_dict"]["w"].tolist() == [2.0] * 1000
    assert sorted(os.listdir(mnt)) == ["epoch=4-step=400.ckpt", "last.ckpt"]


def test_a_file_moved_aside_by_a_save_cut_short_is_put_back(tmp_path: pathlib.Path) -> None:
    """Without RENAME_EXCHANGE the file moves aside before the new folder moves in; a kill
    in between leaves the path missing: the next save (or load's recovery) puts it back."""
    from shardpoint._storage.local import recover
    from shardpoint._storage.local_recovery import temp_prefix

    last = tmp_path / "last.ckpt"
    aside = tmp_path / f"{temp_prefix(last)}old-{'a' * 32}"
    torch.save({"epoch": 3}, aside)
    recover(last)
    assert last.is_file() and torch.load(last)["epoch"] == 3 and os.listdir(tmp_path) == ["last.ckpt"]


# --------------------------------------------------------------------- Fabric


def test_fabric_save_and_load_give_back_the_keys_saved_also_for_a_dict_of_tensors_alone(
        tmp_path: pathlib.Path) -> None:
    """A dict of tensors alone (an EMA's step and decay, fabric.save(p, model.state_dict()))
    is stored flat; it came back as {"state_dict": ...}: fabric.load(strict=False) restored
    nothing without a word, and load_raw raised torch's unexpected-key error."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[ShardpointCheckpointIO()])
    fabric.save(tmp_path / "ema.ckpt", {"ema_decay": torch.tensor(0.999), "step": torch.tensor(1234)})
    state = {"ema_decay": torch.tensor(0.0), "step": torch.tensor(0)}
    assert fabric.load(tmp_path / "ema.ckpt", state, strict=False) == {}
    assert (state["step"].item(), state["ema_decay"].item()) == (1234, pytest.approx(0.999))
    assert list(fabric.load(tmp_path / "ema.ckpt")) == ["ema_decay", "step"]
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    fabric.save(tmp_path / "w.ckpt", model.state_dict())
    fabric.load_raw(tmp_path / "w.ckpt", other)
    assert torch.equal(model.weight, other.weight) and torch.equal(model.bias, other.bias)
    # A flat checkpoint not written by the plugin (a plain sp.save of a state dict) is the model's.
    sp.save(model.state_dict(), tmp_path / "plain")
    assert list(ShardpointCheckpointIO().load_checkpoint(tmp_path / "plain")) == ["state_dict"]
