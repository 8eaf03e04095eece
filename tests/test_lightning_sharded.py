"""Lightning's sharded strategies saving and loading through shardpoint on gloo ranks (CPU).

``ShardpointModelParallelStrategy`` (FSDP2 ``fully_shard`` and tensor-parallel DTensors) and
``ShardpointFSDPStrategy`` (FSDP1 over a device mesh): the strategy hooks called as Lightning
calls them, saved on 2 ranks and loaded on 1 and on 3 ranks, every parameter and Adam moment
compared exactly with the gathered originals; a real ``Trainer.fit`` on 2 gloo ranks whose
``ModelCheckpoint`` saves go through shardpoint, resumed with ``fit(ckpt_path=...)`` on 3
ranks. Each rank's files hold only its own shards; ``sp.load`` and ``shardpoint
verify`` read the result in one process.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

import shardpoint as sp  # noqa: E402
from _dist_utils import run_ranks  # noqa: E402
from shardpoint._cli.main import main as cli_main  # noqa: E402
from shardpoint.integrations.lightning import (  # noqa: E402
    ShardpointCheckpointIO,
    ShardpointFSDPStrategy,
    ShardpointModelParallelStrategy,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

PARAMS = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


class Net(pl.LightningModule):
    """Linear(4, 6) -> ReLU -> Linear(6, 3): dims that split unevenly over 3 ranks."""

    def __init__(self, parallel: str = "fsdp2", hidden: int = 6, data: pathlib.Path = pathlib.Path("data")) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def configure_model(self) -> None:
        if self.device_mesh is None:  # built outside a strategy (load_from_checkpoint): unsharded
            return
        if self.hparams.parallel == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        elif self.hparams.parallel == "tp":
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _gathered(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment, gathered whole on every rank (collective), by name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    full = {k: _full(v).clone() for k, v in get_model_state_dict(model, options=options).items()}
    for name, state in get_optimizer_state_dict(model, opt, options=options)["state"].items():
        for key, value in state.items():
            full[f"{name}/{key}"] = _full(value).clone()
    return full


def _strategy(strategy: Any, module: Net, rank: int, world: int) -> Any:
    """The strategy set up as Lightning's Trainer sets it up (devices, ranks, mesh, model)."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.environments import LightningEnvironment

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    env = LightningEnvironment()
    strategy.accelerator = CPUAccelerator()
    strategy.parallel_devices = [torch.device("cpu")] * world
    strategy.cluster_environment = env
    strategy.connect(module)
    strategy.setup_environment()  # the process group exists: Lightning keeps it
    assert (strategy.global_rank, strategy.world_size) == (rank, world)
    if isinstance(strategy, ShardpointFSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        try:
            strategy.model = strategy._setup_model(module)
        except RuntimeError as exc:
            # Lightning wraps with device_id=root_device.index, which FSDP1 refuses without an
            # accelerator: wrap as on a GPU, over the mesh the strategy chose, and hand it over.
            assert "non-CPU accelerator" in str(exc), exc
            wrapped = FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True,
                                               device_mesh=strategy.kwargs["device_mesh"])
            strategy.model = strategy._setup_model(wrapped)
        mesh = strategy.kwargs["device_mesh"]  # the strategy's default: 1-D over every rank
        assert (mesh.device_type, mesh.mesh.tolist()) == ("cpu", list(range(world)))
    else:
        module.configure_model()
    strategy.optimizers = [torch.optim.Adam(strategy.model.parameters(), lr=0.01)]
    return strategy


def _kinds(world: int) -> dict[str, Any]:
    return {
        "fsdp2": lambda: ShardpointModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        "tp": lambda: ShardpointModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world),
        "fsdp1": lambda: ShardpointFSDPStrategy(),
        "full": lambda: ShardpointModelParallelStrategy(
            data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=False),
        # Saved by Lightning's own strategy (torch.distributed.checkpoint), read by ours.
        "lightning-dcp": lambda: ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
    }


def _module(kind: str, seed: int, hidden: int = 6) -> Net:
    torch.manual_seed(seed)
    return Net(parallel={"fsdp1": "none", "full": "fsdp2", "lightning-dcp": "fsdp2"}.get(kind, kind), hidden=hidden)


def _checkpoint(strategy: Any) -> dict[str, Any]:
    """What Lightning's ``_CheckpointConnector.dump_checkpoint`` hands the strategy."""
    return {
        "epoch": 3,
        "global_step": 17,
        "pytorch-lightning_version": pl.__version__,
        "state_dict": strategy.lightning_module_state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 4, "completed": 3}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.25),
                                                          "best_model_path": "/runs/epoch=3.ckpt"}},
        "optimizer_states": [strategy.optimizer_state(o) for o in strategy.optimizers],
        "lr_schedulers": [],
        "hyper_parameters": strategy.lightning_module.hparams,
    }


class Resumed(pl.Callback):
    """At the start of a resumed fit: the restored state equals the saved run's, exactly."""

    def __init__(self, reference: str) -> None:
        self.reference = reference

    def on_train_start(self, trainer: Any, module: Any) -> None:
        ref = torch.load(self.reference)
        got = _gathered(trainer.strategy.model, trainer.optimizers[0])
        assert sorted(got) == sorted(ref)
        for key, want in ref.items():
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
        assert (trainer.global_step, trainer.current_epoch) == (2, 1), (trainer.global_step, trainer.current_epoch)


class Saved(pl.Callback):
    def __init__(self, reference: str) -> None:
        self.reference = reference

    def on_train_end(self, trainer: Any, module: Any) -> None:
        got = _gathered(trainer.strategy.model, trainer.optimizers[0])
        if trainer.global_rank == 0:
            torch.save(got, self.reference)


def _trainer(root: str, world: int, max_steps: int, callbacks: list[Any], run: str) -> Any:
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ.update(LOCAL_RANK=str(torch.distributed.get_rank()), NODE_RANK="0")
    return pl.Trainer(
        accelerator="cpu", devices=world, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, use_distributed_sampler=False,
        strategy=ShardpointModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, run), save_last=True, every_n_train_steps=2),
                   *callbacks],
    )


def _data() -> Any:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g)), batch_size=4)


def save_worker(rank: int, world: int, root: str) -> None:
    warnings.simplefilter("ignore")
    for kind, make in _kinds(world).items():
        strategy = _strategy(make(), _module(kind, 0), rank, world)
        (opt,) = strategy.optimizers
        strategy.model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
        opt.step()
        strategy.save_checkpoint(_checkpoint(strategy), os.path.join(root, f"{kind}.ckpt"))
        full = _gathered(strategy.model, opt)
        if rank == 0:
            torch.save(full, os.path.join(root, f"{kind}_ref.pt"))
        torch.distributed.barrier()
    # A real Trainer on the gloo ranks: ModelCheckpoint's saves go through the strategy.
    _trainer(root, world, 2, [Saved(os.path.join(root, "run_ref.pt"))], "run").fit(_module("fsdp2", 0), _data())
    # README's example, as every rank runs it: fit, then resume from ckpts/last.ckpt.
    from test_readme import PYTHON_BLOCKS, python_block

    readme = Path(root) / "readme"
    readme.mkdir(exist_ok=True)
    os.chdir(readme)
    block = python_block(PYTHON_BLOCKS["lightning sharded"])
    exec(compile(block, "README.md: lightning sharded", "exec"), {"__name__": "readme"})


def load_worker(rank: int, world: int, root: str) -> None:
    warnings.simplefilter("ignore")
    for kind, make in _kinds(world).items():
        if kind == "lightning-dcp":
            make = _kinds(world)["fsdp2"]
        strategy = _strategy(make(), _module(kind, 1), rank, world)  # other values everywhere
        # Lightning's meta.pt pickles the Path hyperparameter: torch.load needs weights_only=False.
        rest = strategy.load_checkpoint(os.path.join(root, f"{kind}.ckpt"),
                                        weights_only=False if kind == "lightning-dcp" else None)
        ref = torch.load(os.path.join(root, f"{kind}_ref.pt"))
        got = _gathered(strategy.model, strategy.optimizers[0])
        assert sorted(got) == sorted(ref), kind
        for key, want in ref.items():
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), (kind, key)
        assert "state_dict" not in rest and "optimizer_states" not in rest
        assert rest["epoch"] == 3 and rest["global_step"] == 17
        assert rest["loops"] == {"fit_loop": {"epoch_progress": {"total": {"ready": 4, "completed": 3}}}}
        (cb,) = rest["callbacks"].values()
        assert torch.equal(cb["best_model_score"], torch.tensor(0.25))
        assert rest["hyper_parameters"]["data"] == pathlib.Path("data")
    if world == 1:
        # Another model: every rank raises the mismatch, naming the checkpoint and the keys.
        strategy = _strategy(_kinds(1)["fsdp2"](), _module("fsdp2", 1, hidden=5), rank, world)
        path = os.path.join(root, "fsdp2.ckpt")
        try:
            strategy.load_checkpoint(path)
        except sp.CheckpointError as exc:
            message = str(exc)
        else:
            raise AssertionError("a model of another shape loaded")
        assert message.startswith(
            f"loading {path} into the target does not match (strict=True):\n"
            "  shape mismatch: 'model.net.0.weight' (saved [6, 4], target [5, 4]), "
            "'model.net.0.bias' (saved [6], target [5]), 'model.net.2.weight' (saved [3, 6], target [3, 5]), "
            "'optim.0.state.net.0.weight.exp_avg' (saved [6, 4], target [5, 4])"
        ), message
        assert message.endswith("nothing was loaded; pass strict=False to load the matching tensors and get this report")
        # Not fitting (no optimizers, as in validate / test): the model alone is loaded.
        strategy = _strategy(_kinds(1)["fsdp2"](), _module("fsdp2", 1), rank, world)
        strategy.optimizers = []
        strategy.load_checkpoint(path)
        ref = torch.load(os.path.join(root, "fsdp2_ref.pt"))
        for name, value in strategy.model.state_dict().items():
            assert torch.equal(_full(value), ref[name]), name
        strategy = _strategy(_kinds(1)["fsdp2"](), _module("fsdp2", 1, hidden=5), rank, world)
        strategy.optimizers = []
        try:
            strategy.load_checkpoint(path)
        except sp.LoadMismatchError as exc:
            assert str(exc).startswith(
                f"loading {path} into this run's model does not match (the LightningModule's "
                "strict_loading is True):\n  shape mismatch: 'model.net.0.weight' (saved [6, 4], target [5, 4])"
            ), str(exc)
            assert "optim" not in str(exc) and str(exc).endswith("strict_loading = False on it to load the matching tensors")
        else:
            raise AssertionError("a model of another shape loaded")
        # A weights-only checkpoint cannot resume a fit's optimizer: said, naming the cause.
        strategy = _strategy(_kinds(1)["fsdp2"](), _module("fsdp2", 1), rank, world)
        weights_only = _checkpoint(strategy)
        del weights_only["optimizer_states"]
        path = os.path.join(root, "weights-only.ckpt")
        strategy.save_checkpoint(weights_only, path)
        try:
            strategy.load_checkpoint(path)
        except sp.LoadMismatchError as exc:
            assert str(exc) == (
                f"{path} holds the model only (saved with ModelCheckpoint(save_weights_only=True)?), so a "
                "fit cannot resume its optimizer state from it: resume from a full checkpoint, or load "
                "the weights with load_from_checkpoint and start a new fit"
            ), str(exc)
        else:
            raise AssertionError("a weights-only checkpoint resumed a fit")
    if world == 1:
        return  # the Trainer's routing is shown on 3 ranks; 1 rank adds only time
    # Trainer.fit(ckpt_path=...) on another world size resumes from the 2-rank run exactly.
    last = os.path.join(root, "run", "last.ckpt")
    _trainer(root, world, 3, [Resumed(os.path.join(root, "run_ref.pt"))], f"resumed{world}").fit(_module("fsdp2", 1), _data(),
                                                                              ckpt_path=last)


def _chunks(path: Path, component: str) -> dict[str, dict[str, list[list[int]]]]:
    """file -> tensor -> [offsets, shape] of the chunk it holds, as the checkpoint records it
    (format 3: the manifest's rules and the ranks' tables)."""
    from shardpoint._source import open_checkpoint

    out: dict[str, dict[str, list[list[int]]]] = {}
    with open_checkpoint(path) as ckpt:
        for name, record in ckpt.components[component].tensors.items():
            for chunk in record.chunks:
                out.setdefault(chunk.file, {})[name] = [list(chunk.offsets), list(chunk.shape)]
    return out


@pytest.mark.slow
def test_sharded_strategies_save_on_2_ranks_load_on_1_and_3_exactly(tmp_path: Path, capsys: Any) -> None:
    run_ranks(save_worker, 2, str(tmp_path), timeout=200)
    # Each rank wrote its own files, holding exactly its Shard(0) rows of each parameter.
    fsdp2 = tmp_path / "fsdp2.ckpt"
    assert _chunks(fsdp2, "model") == {
        "model-r00000-00001.safetensors": {
            "net.0.weight": [[0, 0], [3, 4]], "net.0.bias": [[0], [3]],
            "net.2.weight": [[0, 0], [2, 6]], "net.2.bias": [[0], [2]],
        },
        "model-r00001-00001.safetensors": {
            "net.0.weight": [[3, 0], [3, 4]], "net.0.bias": [[3], [3]],
            "net.2.weight": [[2, 0], [1, 6]], "net.2.bias": [[2], [1]],
        },
    }
    # Tensor parallel: column-wise rows of net.0, row-wise columns of net.2, bias of net.2 whole once.
    assert _chunks(tmp_path / "tp.ckpt", "model") == {
        "model-r00000-00001.safetensors": {
            "net.0.weight": [[0, 0], [3, 4]], "net.0.bias": [[0], [3]],
            "net.2.weight": [[0, 0], [3, 3]], "net.2.bias": [[0], [3]],
        },
        "model-r00001-00001.safetensors": {
            "net.0.weight": [[3, 0], [3, 4]], "net.0.bias": [[3], [3]], "net.2.weight": [[0, 3], [3, 3]],
        },
    }
    optim = _chunks(fsdp2, "optim")
    assert sorted(optim) == ["optim-r00000-00001.safetensors", "optim-r00001-00001.safetensors"]
    for rank in (0, 1):
        mine = _chunks(fsdp2, "model")[f"model-r0000{rank}-00001.safetensors"]
        for name, (offsets, shape) in optim[f"optim-r0000{rank}-00001.safetensors"].items():
            if name.endswith((".exp_avg", ".exp_avg_sq")):
                param = name.split(".state.")[1].rsplit(".", 1)[0]
                assert [offsets, shape] == mine[param], (rank, name)
    # The full run's state in one process, and the CLI's verify.
    for kind in ("fsdp2", "tp", "fsdp1", "full"):  # (not lightning-dcp: Lightning's format)
        ref = torch.load(tmp_path / f"{kind}_ref.pt")
        back = sp.load(tmp_path / f"{kind}.ckpt")
        for name in PARAMS:
            assert torch.equal(back["model"][name], ref[name]), (kind, name)
        assert back["epoch"] == 3 and back["hyper_parameters"]["data"] == pathlib.Path("data")
        capsys.readouterr()
        assert cli_main(["verify", str(tmp_path / f"{kind}.ckpt")]) == 0, capsys.readouterr()
    # The full save: rank 0 alone wrote whole tensors, keyed as Lightning keys full optimizer states.
    full = json.loads((tmp_path / "full.ckpt" / "shardpoint.json").read_text())
    assert full["world_size"] == 1 and full["layout"] == "hf"
    assert torch.equal(sp.load(tmp_path / "full.ckpt")["optim"][0]["state"][0]["exp_avg"],
                       torch.load(tmp_path / "full_ref.pt")["net.0.weight/exp_avg"])
    assert cli_main(["verify", str(tmp_path / "run" / "last.ckpt")]) == 0
    # The one-call loader reads a sharded checkpoint into an unsharded module, hyperparameters too.
    from shardpoint.integrations.lightning import load_from_checkpoint

    model = load_from_checkpoint(Net, tmp_path / "fsdp2.ckpt")
    assert model.hparams.data == pathlib.Path("data") and model.hparams.parallel == "fsdp2"
    ref = torch.load(tmp_path / "fsdp2_ref.pt")
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref[name]), name
    # README's example wrote on 2 ranks and resumed to step 4.
    last = tmp_path / "readme" / "ckpts" / "last.ckpt"
    assert json.loads((last / "shardpoint.json").read_text())["world_size"] == 2
    assert sp.load(last)["global_step"] == 4 and cli_main(["verify", str(last)]) == 0
    # Lightning's own sharded folder handed to the plugin: what wrote it, and what reads it.
    dcp_folder = tmp_path / "lightning-dcp.ckpt"
    with pytest.raises(sp.UnsupportedFormatError) as info:
        ShardpointCheckpointIO().load_checkpoint(dcp_folder)
    assert str(info.value) == (
        f"{dcp_folder} is a Lightning distributed checkpoint (torch.distributed.checkpoint files and "
        "meta.pt), written by FSDPStrategy(state_dict_type='sharded') or ModelParallelStrategy, which "
        "never call ShardpointCheckpointIO: resume from it with that strategy, or with "
        "ShardpointFSDPStrategy / ShardpointModelParallelStrategy (they read it, and save through "
        "shardpoint on every rank)"
    )
    run_ranks(load_worker, 3, str(tmp_path), timeout=200)
    run_ranks(load_worker, 1, str(tmp_path), timeout=200)


def test_another_checkpoint_io_is_refused_naming_it() -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    strategy = ShardpointModelParallelStrategy()
    assert isinstance(strategy.checkpoint_io, ShardpointCheckpointIO)
    strategy.checkpoint_io = TorchCheckpointIO()  # what Trainer(plugins=[...]) does
    with pytest.raises(sp.CheckpointError) as info:
        strategy.checkpoint_io  # noqa: B018
    assert str(info.value) == (
        "ShardpointModelParallelStrategy saves shardpoint checkpoints only, but its checkpoint IO is a "
        "TorchCheckpointIO: pass a ShardpointCheckpointIO (or none) as its checkpoint_io or in "
        "Trainer(plugins=[...]), or use Lightning's own ModelParallelStrategy for TorchCheckpointIO checkpoints"
    )
    # A ShardpointCheckpointIO given sets the options of every save; inside AsyncCheckpointIO too.
    io = ShardpointCheckpointIO(max_shard_size="1MB", allow_pickle=True)
    fsdp = ShardpointFSDPStrategy(checkpoint_io=io)
    assert fsdp.checkpoint_io is io and fsdp._state_dict_type == "sharded"
    wrapped = ShardpointFSDPStrategy(checkpoint_io=AsyncCheckpointIO())
    assert isinstance(wrapped.checkpoint_io.checkpoint_io, ShardpointCheckpointIO)
