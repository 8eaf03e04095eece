"""Nested training state: exact round trips, optimizer by name, bit-exact resume, async."""

from __future__ import annotations

import collections
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardpoint as sp


def _assert_same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(x for x in b if x == k and type(x) is type(k)))
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


ADVERSARIAL = {
    "model": {"w": torch.arange(6.0).reshape(2, 3)},
    "weird": {
        "x/y": torch.ones(1),
        "%a": 1,
        "": "empty key",
        "a.b": torch.zeros(2),
        "a": {"b": torch.full((2,), 7.0)},  # joins to the same name as "a.b"
        0: "int zero",
        "0": "str zero",
        -3: [None, True, False],
        "floats": [0.1, float("nan"), float("inf"), float("-inf"), -0.0, 1e308],
        "tuple": (1, (2, torch.tensor(3)), []),
        "list_of_dicts": [{"k": torch.tensor([1, 2], dtype=torch.int8)}, {}],
        "big_int": 2**62,
        "unicode": "héllo ✓",
    },
    "step": 1234,
    "done": False,
    "note": None,
}


def test_adversarial_nested_state_round_trips_exactly(tmp_path):
    sp.save(ADVERSARIAL, tmp_path / "ck")
    _assert_same(ADVERSARIAL, sp.load(tmp_path / "ck"))
    manifest = json.loads((tmp_path / "ck" / "shardpoint.json").read_text())
    assert manifest["flat"] is False and set(manifest["components"]) == {"model", "weird", "step", "done", "note"}


def test_adversarial_state_loads_into_a_fresh_target(tmp_path):
    sp.save(ADVERSARIAL, tmp_path / "ck")
    target = {"model": {"w": torch.zeros(2, 3)}, "weird": {}, "step": 0, "done": True, "note": "x"}
    ptr = target["model"]["w"].data_ptr()
    sp.load_into(target, tmp_path / "ck")
    _assert_same(ADVERSARIAL, target)
    assert target["model"]["w"].data_ptr() == ptr  # tensors are filled in place


def test_objects_are_refused_unless_pickling_is_opted_in(tmp_path):
    class Thing:
        def __init__(self):
            self.value = 42

    state = {"model": {"w": torch.ones(1)}, "extra": {"thing": Thing()}}
    with pytest.raises(sp.InvalidStateError, match=r"state at extra\['thing'\] is a .*Thing"):
        sp.save(state, tmp_path / "ck")
    state["extra"]["thing"] = {"answer": 42}  # a picklable, importable stand-in below
    state["extra"]["obj"] = Fraction(3, 4)
    sp.save(state, tmp_path / "ck", allow_pickle=True)
    with pytest.raises(sp.UnsafePickleError, match=r"component 'extra': value 'obj' \(a fractions.Fraction\) was pickled"):
        sp.load(tmp_path / "ck")
    assert sp.load(tmp_path / "ck", allow_pickle=True)["extra"]["obj"] == Fraction(3, 4)


from fractions import Fraction  # noqa: E402


def _build(seed: int, opt_name: str, reverse: bool = False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    model = torch.nn.Sequential(*layers)
    params = list(model.named_parameters())
    if reverse:
        params = params[::-1]
    groups = [{"params": [p for _, p in params]}]
    if opt_name == "sgd":
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    elif opt_name == "adam":
        opt = torch.optim.Adam(groups, lr=1e-2)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randn(8, 6)
        y = torch.randn(8, 3) + random.random() + float(np.random.rand())
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_resume_is_bit_exact(tmp_path, opt_name):
    model, opt, sched = _build(0, opt_name)
    random.seed(1)
    np.random.seed(1)
    _train(model, opt, sched, 5)
    state = {"model": model, "optim": opt, "sched": sched, "rng": sp.RNGState(), "step": 5}
    sp.save(state, tmp_path / "ck", max_shard_size="1kB")
    _train(model, opt, sched, 4)
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = opt.state_dict()

    model2, opt2, sched2 = _build(99, opt_name)  # different init, fresh optimizer
    target = {"model": model2, "optim": opt2, "sched": sched2, "rng": sp.RNGState(), "step": 0}
    assert sp.load_into(target, tmp_path / "ck").ok
    assert target["step"] == 5
    _train(model2, opt2, sched2, 4)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_params[k]), k
    got = opt2.state_dict()
    assert got["param_groups"] == expected_opt["param_groups"]
    for pid, st in expected_opt["state"].items():
        for name, value in st.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)
    assert sched2.state_dict() == sched.state_dict()


def test_optimizer_state_is_stored_by_parameter_name(tmp_path):
    model, opt, sched = _build(0, "adam")
    _train(model, opt, sched, 2)
    sp.save({"model": model, "optim": opt}, tmp_path / "ck")
    saved = sp.load(tmp_path / "ck")["optim"]
    assert list(saved["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert saved["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert torch.equal(saved["state"]["2.bias"]["exp_avg"], opt.state[model[2].bias]["exp_avg"])


def test_optimizer_state_loads_into_another_parameter_order(tmp_path):
    model, opt, sched = _build(0, "adamw")
    _train(model, opt, sched, 3)
    sp.save({"model": model, "optim": opt}, tmp_path / "ck")
    model2, opt2, _ = _build(5, "adamw", reverse=True)
    sp.load_into({"model": model2, "optim": opt2}, tmp_path / "ck")
    for name, param in model.named_parameters():
        twin = dict(model2.named_parameters())[name]
        assert torch.equal(opt.state[param]["exp_avg"], opt2.state[twin]["exp_avg"]), name
        assert torch.equal(opt.state[param]["exp_avg_sq"], opt2.state[twin]["exp_avg_sq"]), name


def test_rng_state_round_trip(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    sp.save({"rng": sp.RNGState(), "step": 1}, tmp_path / "ck")
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    sp.load_into({"rng": sp.RNGState(), "step": 0}, tmp_path / "ck")
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_async_save_holds_pre_mutation_values(tmp_path):
    model = torch.nn.Linear(256, 256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = sp.async_save({"model": model, "step": 1}, tmp_path / "ck")
    # async_save returned after staging the copy, and measured how long that blocked the
    # caller (``staged()`` is always True by construction, so it proves nothing).
    assert 0.0 < handle.stall_seconds < 60.0, handle.stall_seconds
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # mutate right after staging
    info = handle.result()
    assert handle.done() and info.path.endswith("ck")
    loaded = sp.load(tmp_path / "ck")["model"]
    for k, v in before.items():
        assert torch.equal(loaded[k], v), k


def test_async_staging_buffer_is_reused(tmp_path):
    from shardpoint._async import staging_bytes

    state = {"w": torch.randn(1000)}
    sp.async_save(state, tmp_path / "a").result()
    size = staging_bytes()
    for i in range(3):
        sp.async_save(state, tmp_path / f"b{i}").result()
        assert staging_bytes() == size


def test_an_optimizer_state_dict_saved_as_a_dict_says_how_to_load_it(tmp_path: Path) -> None:
    """``{"optim": opt.state_dict()}`` (a plain dict, as DCP writes one too) loaded into
    ``{"optim": opt}``: refused, saying how to restore it instead."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sp.save({"optim": opt.state_dict()}, tmp_path / "ck")
    with pytest.raises(sp.LoadMismatchError) as info:
        sp.load_into({"optim": torch.optim.AdamW(model.parameters())}, tmp_path / "ck")
    assert str(info.value) == (
        f"{tmp_path / 'ck'}: 'optim' was saved as a plain dict (e.g. an optimizer's state_dict() or written "
        "through torch.distributed.checkpoint), not from an optimizer object; read it with "
        "sp.load(...)['optim'] and pass it to the optimizer's load_state_dict (DCP: set_optimizer_state_dict), "
        "or save the optimizer object itself")
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(sp.load(tmp_path / "ck")["optim"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


class _DDPLike(torch.nn.Module):
    """What DDP (and FSDP1's ``module.``) does to names: the model under ``module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def _wrapped(net: torch.nn.Module, how: str) -> torch.nn.Module:
    return {"plain": lambda: net, "compile": lambda: torch.compile(net), "ddp": lambda: _DDPLike(net)}[how]()


@pytest.mark.parametrize("saved_as", ["plain", "compile", "ddp"])
@pytest.mark.parametrize("loaded_as", ["plain", "compile", "ddp"])
def test_a_run_resumes_with_or_without_compile_and_ddp_wrappers(tmp_path: Path, saved_as: str, loaded_as: str) -> None:
    """Trained under torch.compile (``_orig_mod.``) or DDP (``module.``) and resumed without
    it, or the other way: the model's keys are matched by the prefix rule, and the
    optimizer's state, stored by parameter name, follows the same rename (it was refused:
    "no optimizer state for parameter(s) '0.weight', ..."). Also with a second module."""
    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    torch.manual_seed(0)
    inner, ema = net(), net()
    model = _wrapped(inner, saved_as)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    inner(torch.randn(3, 4)).sum().backward()  # through the plain module: the same parameters
    opt.step()
    sp.save({"model": model, "ema": ema, "optim": opt}, tmp_path / "ck")

    torch.manual_seed(1)
    inner2, ema2 = net(), net()
    model2 = _wrapped(inner2, loaded_as)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    result = sp.load_into({"model": model2, "ema": ema2, "optim": opt2}, tmp_path / "ck")
    assert result.ok, result
    prefix = {"plain": "", "compile": "_orig_mod.", "ddp": "module."}
    # Saved from inside its wrappers (the files are the model's own): only the target's wrapper is renamed.
    assert sp.load(tmp_path / "ck", keys=["model"])["model"].keys() == inner.state_dict().keys()
    assert result.prefix_mapping == ({} if loaded_as == "plain" else {"model": ("", prefix[loaded_as])})
    for a, b in zip(inner2.parameters(), inner.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt2.state[a]["exp_avg"], opt.state[b]["exp_avg"])
        assert torch.equal(opt2.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])
    assert opt2.param_groups[0]["lr"] == 0.1


def _two_part_net() -> torch.nn.Module:
    net = torch.nn.Sequential()
    net.add_module("backbone", torch.nn.Linear(4, 4))
    net.add_module("head", torch.nn.Linear(4, 2))
    net.add_module("aux", torch.nn.Linear(4, 1))  # never used in forward: no gradient, no state
    return net


def test_parameters_without_optimizer_state_restore_as_torch_restores_them(tmp_path: Path) -> None:
    """A frozen backbone passed to the optimizer anyway, or a layer without a gradient yet,
    has no state: restoring such a checkpoint was refused ("the checkpoint has no optimizer
    state for parameter(s) 'aux.weight', ..."), so a job could not resume from its own
    checkpoints. They load without state, exactly as torch's load_state_dict does."""
    torch.manual_seed(0)
    net = _two_part_net()
    net.backbone.requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net.head(net.backbone(torch.randn(3, 4))).sum().backward()
    opt.step()
    assert set(opt.state) == {net.head.weight, net.head.bias}
    mgr = sp.CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(1, {"model": net, "optim": opt})

    torch.manual_seed(1)
    net2 = _two_part_net()
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.5)
    assert mgr.restore({"model": net2, "optim": opt2}) == 1
    expected = torch.optim.AdamW(_two_part_net().parameters(), lr=0.5)
    expected.load_state_dict(opt.state_dict())
    assert opt2.state_dict()["param_groups"] == expected.state_dict()["param_groups"]
    assert set(opt2.state) == {net2.head.weight, net2.head.bias}
    for name in ("weight", "bias"):
        mine, theirs = opt2.state[getattr(net2.head, name)], opt.state[getattr(net.head, name)]
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_parameter_groups_pair_by_their_parameters_names_not_their_order(tmp_path: Path) -> None:
    """The same two groups built in the other order on resume: the hyperparameters were
    paired by position (the head trained at the backbone's lr) while the state followed
    the names. Each group now takes the saved group holding its parameters."""
    torch.manual_seed(0)
    net = _two_part_net()
    opt = torch.optim.SGD([
        {"params": net.backbone.parameters(), "lr": 1e-5, "weight_decay": 0.0},
        {"params": list(net.head.parameters()) + list(net.aux.parameters()), "lr": 1e-2, "weight_decay": 0.1},
    ], momentum=0.9)
    x = torch.randn(3, 4)
    (net.head(net.backbone(x)).sum() + net.aux(x).sum()).backward()
    opt.step()
    sp.save({"model": net, "optim": opt}, tmp_path / "ck")

    net2 = _two_part_net()
    opt2 = torch.optim.SGD([
        {"params": list(net2.head.parameters()) + list(net2.aux.parameters()), "lr": 0.5},
        {"params": net2.backbone.parameters(), "lr": 0.5},
    ], momentum=0.5)
    assert sp.load_into({"model": net2, "optim": opt2}, tmp_path / "ck").ok
    head, backbone = opt2.param_groups
    assert (head["lr"], head["weight_decay"], backbone["lr"], backbone["weight_decay"]) == (1e-2, 0.1, 1e-5, 0.0)
    assert head["momentum"] == backbone["momentum"] == 0.9
    assert torch.equal(opt2.state[net2.backbone.weight]["momentum_buffer"], opt.state[net.backbone.weight]["momentum_buffer"])

    mixed = torch.optim.SGD([{"params": [net2.backbone.weight, net2.head.weight]},
                             {"params": [net2.backbone.bias, net2.head.bias, *net2.aux.parameters()]}], lr=0.1)
    with pytest.raises(sp.LoadMismatchError) as exc:
        sp.load_into({"model": net2, "optim": mixed}, tmp_path / "ck")
    assert str(exc.value) == (
        f"{tmp_path / 'ck'}, optim: the target optimizer's parameter group 0 ('backbone.weight', 'head.weight') "
        "holds parameters of the checkpoint's groups [0, 1]; build the parameter groups with the parameters "
        "they were saved with"
    )


def test_another_optimizer_class_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    """Adam's state restored into SGD was ok=True with SGD running at Adam's lr, without
    momentum, and a refusal of the optimizer came after the model had been overwritten."""
    torch.manual_seed(0)
    net = _two_part_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(3, 4)
    (net.head(net.backbone(x)).sum() + net.aux(x).sum()).backward()
    opt.step()
    sp.save({"model": net, "optim": opt}, tmp_path / "ck")

    net2 = _two_part_net()
    before = {k: v.clone() for k, v in net2.state_dict().items()}
    sgd = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(sp.LoadMismatchError) as exc:
        sp.load_into({"model": net2, "optim": sgd}, tmp_path / "ck", strict=False)
    assert str(exc.value) == (
        f"{tmp_path / 'ck'}, optim: the checkpoint's optimizer state was saved from another optimizer class than "
        "the target's SGD: its parameter groups lack dampening, momentum, nesterov, which every SGD group holds; "
        "build the optimizer class it was saved from (or leave the optimizer out of the target to load the rest)"
    )
    assert all(torch.equal(before[k], v) for k, v in net2.state_dict().items()), "the model was changed"
    assert not sgd.state and sgd.param_groups[0]["lr"] == 0.1
    assert sp.load_into({"model": net2}, tmp_path / "ck", strict=False).unexpected_keys == ["optim"]
    adamw = torch.optim.AdamW(net2.parameters(), lr=0.1)  # Adam's own hyperparameters: loads
    assert sp.load_into({"model": net2, "optim": adamw}, tmp_path / "ck").ok


def test_scheduler_and_user_group_keys_and_empty_groups_are_not_a_mismatch(tmp_path: Path) -> None:
    """A scheduler's initial_lr in the saved groups, a user's group name in the target's,
    and an empty group on both sides: the same optimizer, which loads (the first version of
    the class check refused the first two, and the group pairing the empty group)."""
    torch.manual_seed(0)
    net = _two_part_net()
    opt = torch.optim.AdamW([{"params": net.parameters(), "lr": 0.01}])
    opt.add_param_group({"params": [], "lr": 0.5})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    x = torch.randn(3, 4)
    (net.head(net.backbone(x)).sum() + net.aux(x).sum()).backward()
    opt.step()
    sched.step()
    sp.save({"model": net, "optim": opt}, tmp_path / "ck")
    assert "initial_lr" in sp.load(tmp_path / "ck")["optim"]["param_groups"][0]

    net2 = _two_part_net()
    opt2 = torch.optim.AdamW([{"params": net2.parameters(), "lr": 0.1, "name": "all"}])
    opt2.add_param_group({"params": [], "lr": 0.7})
    assert sp.load_into({"model": net2, "optim": opt2}, tmp_path / "ck").ok
    assert [(len(g["params"]), g["lr"]) for g in opt2.param_groups] == [(6, 0.005), (0, 0.25)]
    assert torch.equal(opt2.state[net2.head.weight]["exp_avg"], opt.state[net.head.weight]["exp_avg"])


@pytest.mark.parametrize("saved_with_wrapper", [True, False])
def test_an_optimizer_resumes_with_or_without_activation_checkpointing(tmp_path: Path, saved_with_wrapper: bool) -> None:
    """checkpoint_wrapper puts '_checkpoint_wrapped_module.' in named_parameters but not in
    state_dict keys: the optimizer (named by parameter) did not find its state in the same
    model without the wrapper, even with strict=False."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build(wrapped: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)]
        if wrapped:
            layers[0], layers[2] = checkpoint_wrapper(layers[0]), checkpoint_wrapper(layers[2])
        return torch.nn.Sequential(*layers)

    net = build(saved_with_wrapper)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    sp.save({"model": net, "optim": opt}, tmp_path / "ck")
    net2 = build(not saved_with_wrapper)
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    assert sp.load_into({"model": net2, "optim": opt2}, tmp_path / "ck").ok
    for a, b in zip(net2.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(opt2.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def test_stacked_wrappers_and_plain_dict_targets_are_matched_by_prefix(tmp_path: Path) -> None:
    """torch.compile of DDP (the order PyTorch recommends) saves '_orig_mod.module.*': it
    did not load into the plain model, and a DDP checkpoint did not load into a plain dict
    of tensors, though each wrapper alone loaded into a module."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    sp.save(torch.compile(_DDPLike(net)).state_dict(), tmp_path / "compiled-ddp")
    assert sorted(sp.load(tmp_path / "compiled-ddp"))[0] == "_orig_mod.module.0.bias"
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    result = sp.load_into(plain, tmp_path / "compiled-ddp")
    assert result.ok and result.prefix_mapping == {"": ("_orig_mod.module.", "")}
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), net.parameters(), strict=True))

    sp.save(_DDPLike(net).state_dict(), tmp_path / "ddp")
    flat = {k: torch.zeros_like(v) for k, v in net.state_dict().items()}
    result = sp.load_into(flat, tmp_path / "ddp")
    assert result.ok and result.prefix_mapping == {"": ("module.", "")}
    assert all(torch.equal(flat[k], v) for k, v in net.state_dict().items())
    with pytest.raises(sp.LoadMismatchError) as exc:
        sp.load_into({"other": torch.zeros(2)}, tmp_path / "ddp")
    assert str(exc.value).endswith(
        "If the names differ by a prefix, rename them (sd = {new + k.removeprefix(old): v for k, v in "
        "sp.load(path).items()}) and load that dict (module.load_state_dict(sd), or copy its values into the dict)"
    )


def _adamw(out: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, out))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()


def test_a_non_strict_restore_reports_and_starts_skipped_parameters_afresh(tmp_path) -> None:
    """A head rebuilt wider, restored with strict=False: the optimizer got the old head's
    state at the old shape (the next step failed inside torch), and restore said nothing."""
    model, optimizer = _adamw(4)
    _train_step(model, optimizer)
    manager = sp.CheckpointManager(tmp_path / "run")
    manager.save(100, {"model": model, "optim": optimizer})
    wider, wider_optimizer = _adamw(5)
    with pytest.warns(UserWarning) as caught:
        assert manager.restore({"model": wider, "optim": wider_optimizer}, strict=False) == 100
    assert [str(w.message) for w in caught] == [
        f"restored step 100 from {tmp_path / 'run'} in part; shape mismatch: 'model/2.weight' "
        "(saved [4, 16], target [5, 16]), 'model/2.bias' (saved [4], target [5]). The whole report: manager.last_load"
    ]
    assert manager.last_load is not None and [k for k, _, _ in manager.last_load.mismatched_keys] == [
        "model/2.weight", "model/2.bias"]
    assert wider[2].weight not in wider_optimizer.state  # afresh: no state of the old shape
    for kept in (wider[0].weight, wider[0].bias):
        saved = optimizer.state[model[0].weight if kept is wider[0].weight else model[0].bias]
        assert torch.equal(wider_optimizer.state[kept]["exp_avg"], saved["exp_avg"])
    _train_step(wider, wider_optimizer)


def test_an_optimizer_over_fewer_parameters_than_saved_is_refused(tmp_path) -> None:
    """Its saved state for the others would be dropped with ok=True (torch refuses too)."""
    model, optimizer = _adamw(4)
    _train_step(model, optimizer)
    sp.save({"model": model, "optim": optimizer}, tmp_path / "ck")
    fresh, _ = _adamw(4)
    head_only = torch.optim.AdamW(fresh[2].parameters(), lr=1e-3)
    with pytest.raises(sp.LoadMismatchError) as exc:
        sp.load_into({"model": fresh, "optim": head_only}, tmp_path / "ck")
    assert str(exc.value) == (
        f"{tmp_path / 'ck'}, optim: the checkpoint's optimizer holds parameter(s) '0.weight', '0.bias' that the "
        "target optimizer does not (a layer removed, or frozen since); their state would be dropped. Build the "
        "optimizer over the parameters it was saved with; or leave the optimizer out of load_into's target to "
        "load the rest (its state then starts afresh)"
    )
    assert not head_only.state


def test_optimizer_state_is_found_when_a_module_joins_or_leaves_the_state(tmp_path) -> None:
    """Parameter names carry the component (model.0.weight) only when the state holds
    several modules: an EMA added at resume (or dropped) left the optimizer state unfound,
    blamed on "a layer added or renamed"."""
    model, optimizer = _adamw(4)
    _train_step(model, optimizer)
    sp.save({"model": model, "optim": optimizer}, tmp_path / "one")
    sp.save({"model": model, "ema": _adamw(4)[0], "optim": optimizer}, tmp_path / "two")
    for saved, with_ema in (("one", True), ("two", False)):
        fresh, fresh_optimizer = _adamw(4)
        target = {"model": fresh, "optim": fresh_optimizer} | ({"ema": _adamw(4)[0]} if with_ema else {})
        result = sp.load_into(target, tmp_path / saved, strict=False)
        assert (result.missing_keys, result.unexpected_keys) == ((["ema"], []) if with_ema else ([], ["ema"]))
        for mine, theirs in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(fresh_optimizer.state[mine]["exp_avg"], optimizer.state[theirs]["exp_avg"])
    twins = {"model": _adamw(4)[0], "ema": _adamw(4)[0]}  # both modules' parameters in one optimizer
    both = torch.optim.AdamW([*twins["model"].parameters(), *twins["ema"].parameters()])
    with pytest.raises(sp.LoadMismatchError, match=r"several parameters of the target optimizer match the "
                                                    r"checkpoint's parameter\(s\) '0.bias', '0.weight'"):
        sp.load_into({**twins, "optim": both}, tmp_path / "one", strict=False)


def test_multisteplr_milestones_stay_a_counter_and_the_run_resumes(tmp_path: Path) -> None:
    """MultiStepLR keeps its milestones in a collections.Counter and calls .elements() on
    it when stepped to an epoch (SequentialLR does at its milestone): restored as a dict,
    the resumed run raised AttributeError after an ok load."""
    from torch.optim import lr_scheduler as lr

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = lr.SequentialLR(opt, [lr.LinearLR(opt, 0.1, total_iters=3), lr.MultiStepLR(opt, [2, 4], gamma=0.5)],
                                milestones=[3])
        return model, opt, sched

    def run(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> list[float]:
        rates = []
        for _ in range(steps):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            rates.append(opt.param_groups[0]["lr"])
        return rates

    model, opt, sched = build()
    run(model, opt, sched, 2)
    sp.save({"model": model, "optim": opt, "sched": sched}, tmp_path / "ckpt")
    expected = run(model, opt, sched, 5)
    model2, opt2, sched2 = build()
    assert sp.load_into({"model": model2, "optim": opt2, "sched": sched2}, tmp_path / "ckpt").ok
    assert type(sched2._schedulers[1].milestones) is collections.Counter
    assert run(model2, opt2, sched2, 5) == expected
    assert expected[-1] == pytest.approx(0.025)  # both milestones of MultiStepLR passed


def test_counters_and_defaultdicts_come_back_as_they_were(tmp_path: Path) -> None:
    state = {"seen": collections.Counter({"a": 2, 3: 1}), "by_word": collections.defaultdict(list, {"x": [1]}),
             "counts": collections.defaultdict(int, {"y": 4}), "plain": {"z": 1},
             "odd": collections.defaultdict(lambda: 7, {"w": 1})}  # a factory of its own: a dict, as before
    sp.save(state, tmp_path / "ckpt")
    loaded = sp.load(tmp_path / "ckpt")
    assert type(loaded["seen"]) is collections.Counter and loaded["seen"] == collections.Counter({"a": 2, 3: 1})
    assert type(loaded["by_word"]) is collections.defaultdict and loaded["by_word"].default_factory is list
    assert loaded["by_word"]["new"] == [] and loaded["counts"]["new"] == 0 and loaded["counts"]["y"] == 4
    assert type(loaded["plain"]) is dict and type(loaded["odd"]) is dict and loaded["odd"] == {"w": 1}


def test_an_optimizer_over_meta_parameters_is_refused_before_reading(tmp_path: Path) -> None:
    """A model built on meta gets new parameters from the load; an optimizer built over the
    meta ones kept them (its state cast to meta): ok=True, and training never moved the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    sp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
    with torch.device("meta"):
        empty = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    stale = torch.optim.AdamW(empty.parameters(), lr=0.1)
    with pytest.raises(sp.InvalidStateError) as caught:
        sp.load_into({"model": empty, "optim": stale}, tmp_path / "ckpt")
    assert str(caught.value) == (
        "the optimizer at 'optim' holds parameters on the meta device (built over a model made with sp.empty_model "
        "or under torch.device('meta')): a load gives such a model new parameters, and the optimizer would keep the "
        "old, empty ones, so training would never update the model. Call model.to_empty(device=...) before building "
        "the optimizer (the load then fills the parameters in place), or build it after loading the model; nothing "
        "was loaded")
    assert all(p.is_meta for p in empty.parameters())
    empty.to_empty(device="cpu")  # the way out the message gives
    fresh = torch.optim.AdamW(empty.parameters(), lr=0.1)
    assert sp.load_into({"model": empty, "optim": fresh}, tmp_path / "ckpt").ok
    for m, o in ((model, opt), (empty, fresh)):
        m(torch.ones(3, 4)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), empty.parameters(), strict=True))


def test_an_optimizer_over_modules_nested_in_the_state_is_stored_by_name(tmp_path: Path) -> None:
    """{"models": {"gen": G}, "optims": {"gen": opt}} (GANs, several models): the modules
    were looked for among top-level values only, so the optimizer was stored by position
    and loaded, ok=True, into an optimizer listing its parameters in another order: each
    parameter got another's moments (of the same shape)."""
    def build(order: list[int]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        gen = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        params = list(gen.parameters())
        return gen, torch.optim.Adam([params[i] for i in order], lr=0.1)

    def step(gen: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        gen(torch.arange(4.0)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    gen, opt = build([0, 1, 2, 3])
    step(gen, opt)
    sp.save({"models": {"gen": gen}, "optims": {"gen": opt}}, tmp_path / "ckpt")
    assert sp.load(tmp_path / "ckpt")["optims"]["gen"]["param_groups"][0]["params"] == [
        "0.weight", "0.bias", "1.weight", "1.bias"]  # one module: its own names
    step(gen, opt)
    gen2, opt2 = build([2, 3, 0, 1])
    assert sp.load_into({"models": {"gen": gen2}, "optims": {"gen": opt2}}, tmp_path / "ckpt").ok
    step(gen2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(gen.parameters(), gen2.parameters(), strict=True))


def test_an_optimizer_holding_a_parameter_of_no_module_warns_it_is_stored_by_position(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    scale = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.1)
    with pytest.warns(UserWarning) as caught:
        sp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
    assert [str(w.message) for w in caught] == [
        "optim: 1 of the optimizer's parameters belong to no module of the saved state (a parameter of its own, "
        "such as a free logit_scale, or a module saved elsewhere), so its state is stored by position, not by "
        "parameter name: it loads right only into an optimizer built over the same parameters in the same order. "
        "Put such parameters in a module of the state (an nn.ParameterDict) to have them stored by name"]


def test_a_scheduler_of_another_class_is_refused(tmp_path: Path) -> None:
    """torch's load_state_dict takes any scheduler's attributes: a CosineAnnealingLR took a
    StepLR's step_size and gamma (ok=True) and kept its own schedule."""
    from torch.optim import lr_scheduler as lr

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    sp.save({"sched": lr.StepLR(opt, step_size=3, gamma=0.5)}, tmp_path / "ckpt")
    with pytest.raises(sp.LoadMismatchError) as caught:
        sp.load_into({"sched": lr.CosineAnnealingLR(opt, T_max=10)}, tmp_path / "ckpt")
    assert str(caught.value) == (
        f"{tmp_path / 'ckpt'}: 'sched' was saved from a StepLR but the target is a CosineAnnealingLR: loading one "
        "scheduler's state into another class gives it attributes it does not use and keeps its own schedule. "
        "Build the scheduler class it was saved from (or leave the scheduler out of the target to load the rest); "
        "nothing was loaded")
    assert sp.load_into({"sched": lr.StepLR(opt, step_size=1)}, tmp_path / "ckpt").ok


def test_an_ema_nested_in_the_state_added_or_dropped_still_finds_the_optimizer_state(tmp_path: Path) -> None:
    """{"models": {"net": M, "ema": E}}: parameter names carry the module's path
    (models.net.0.weight); dropping the EMA at resume leaves one module (0.weight)."""
    def build(with_ema: bool) -> tuple[dict[str, Any], torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 3))
        models = {"net": net, **({"ema": torch.nn.Sequential(torch.nn.Linear(3, 3))} if with_ema else {})}
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
        return {"models": models, "optim": opt}, opt

    for saved_with, loaded_with in ((True, False), (False, True)):
        state, opt = build(saved_with)
        sp.save(state, tmp_path / f"ckpt-{saved_with}", overwrite=True)
        target, fresh = build(loaded_with)
        for group in fresh.state.values():
            group["exp_avg"].zero_()
        sp.load_into(target, tmp_path / f"ckpt-{saved_with}", strict=False)
        assert all(torch.equal(fresh.state[p]["exp_avg"], opt.state[q]["exp_avg"])
                   for p, q in zip(target["models"]["net"].parameters(), state["models"]["net"].parameters(),
                                   strict=True)), (saved_with, loaded_with)


def test_modules_held_in_tuples_namespaces_or_lists_are_loaded_in_place_or_refused(tmp_path: Path) -> None:
    """A tuple of modules, a Namespace holding a model: the container was replaced by one of
    state dicts (ok=True, the modules never loaded); a list of another length likewise."""
    import argparse

    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    sp.save({"models": (gen, disc), "ns": argparse.Namespace(net=gen, lr=0.5)}, tmp_path / "ckpt")
    torch.manual_seed(1)
    gen2, disc2, net2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3), torch.nn.Linear(2, 2)
    target = {"models": (gen2, disc2), "ns": argparse.Namespace(net=net2, lr=0.1)}
    assert sp.load_into(target, tmp_path / "ckpt").ok
    assert target["models"][0] is gen2 and target["ns"].net is net2 and target["ns"].lr == 0.5
    assert torch.equal(gen2.weight, gen.weight) and torch.equal(disc2.weight, disc.weight)
    assert torch.equal(net2.weight, gen.weight)
    more = {"models": [torch.nn.Linear(2, 2), torch.nn.Linear(2, 3), torch.nn.Linear(2, 2)],
            "ns": argparse.Namespace(net=net2, lr=0.1)}
    with pytest.raises(sp.LoadMismatchError) as caught:
        sp.load_into(more, tmp_path / "ckpt")
    assert str(caught.value) == (
        f"{tmp_path / 'ckpt'}: the target's 'models' is a list holding modules, optimizers or tensors (loaded in "
        "place), but the checkpoint holds 2 items there: it does not fit (an entry added or dropped since the save?). "
        "Make the target's structure the saved one, or load that part with sp.load(...)['models']; nothing was loaded")


def test_named_parameter_groups_keep_the_targets_names(tmp_path: Path) -> None:
    """An optimizer built from named_parameters() keeps param_names: loaded into one that
    lists its parameters in another order, the names were the saved order's (each
    parameter's state then shown under another's name by state_dict())."""
    def build(order: list[str]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        named = dict(model.named_parameters())
        return model, torch.optim.Adam([(n, named[n]) for n in order], lr=0.1)

    model, opt = build(["a.weight", "a.bias", "b.weight", "b.bias"])
    model["a"](torch.ones(2)).sum().backward()
    model["b"](torch.ones(2)).pow(2).sum().backward()
    opt.step()
    sp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
    model2, opt2 = build(["b.weight", "b.bias", "a.weight", "a.bias"])
    assert sp.load_into({"model": model2, "optim": opt2}, tmp_path / "ckpt").ok
    saved, loaded = opt.state_dict(), opt2.state_dict()
    by_name = {n: saved["state"][i]["exp_avg"] for i, n in enumerate(saved["param_groups"][0]["param_names"])}
    for i, name in enumerate(loaded["param_groups"][0]["param_names"]):
        assert torch.equal(loaded["state"][i]["exp_avg"], by_name[name]), name
