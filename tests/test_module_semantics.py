"""Modules and tensors that load their own way: load_into must load them as
``load_state_dict`` does, or refuse before changing anything, never report ok=True over
values it did not set (the fifth red-team round's findings, each with its sibling cases)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

import shardpoint as sp


class _Packed(torch.nn.Module):
    """Keeps a bfloat16 weight, exports it as float32 (a packed / mixed-precision layer)."""

    def __init__(self, columns: int = 3) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, columns, dtype=torch.bfloat16))

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        destination[prefix + "weight"] = self.weight.detach().float()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # type: ignore[no-untyped-def]
        key = prefix + "weight"
        if key in state_dict:
            with torch.no_grad():
                self.weight.copy_(state_dict[key].to(torch.bfloat16))
        elif strict:
            missing.append(key)


def test_a_module_whose_state_dict_is_computed_loads_through_its_own_code(tmp_path: Path) -> None:
    """Its state dict's tensor is a copy: filling it in place loaded nothing, with ok=True."""
    src = torch.nn.Sequential(torch.nn.Linear(3, 3), _Packed())
    with torch.no_grad():
        src[1].weight.copy_(torch.arange(6.0).reshape(2, 3))
    sp.save(src, tmp_path / "ck")
    dst = torch.nn.Sequential(torch.nn.Linear(3, 3), _Packed())
    result = sp.load_into(dst, tmp_path / "ck")
    assert result.ok and result.bytes_read == (9 + 3 + 6) * 4
    assert dst[1].weight.dtype == torch.bfloat16 and dst[1].weight.float().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(dst[0].weight, src[0].weight)


def _qat() -> torch.nn.Module:
    import torch.ao.quantization as tq

    model = torch.nn.Sequential(tq.QuantStub(), torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2),
                                tq.DeQuantStub())
    model.train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tq.prepare_qat(model)


def test_a_qat_model_resumes(tmp_path: Path) -> None:
    """Per-channel fake-quant observers resize their buffers in their own loader: refused
    as a shape mismatch before, though load_state_dict loads it."""
    torch.manual_seed(0)
    model = _qat()
    for _ in range(3):
        model(torch.randn(8, 4))
    sp.save(model, tmp_path / "ck")
    fresh = _qat()
    assert fresh[1].weight_fake_quant.scale.shape == (1,)
    assert sp.load_into(fresh, tmp_path / "ck").ok
    assert fresh[1].weight_fake_quant.scale.shape == (4,)
    model.eval(), fresh.eval()
    x = torch.randn(2, 4)
    assert torch.equal(model(x), fresh(x))
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_lazy_modules_load_and_refuse_to_save_before_they_have_a_shape(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    x = torch.randn(2, 5)
    model(x)
    sp.save(model, tmp_path / "ck")
    fresh = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    assert sp.load_into(fresh, tmp_path / "ck").ok
    assert fresh[0].weight.shape == (3, 5) and torch.equal(fresh(x), model(x))
    with pytest.raises(sp.InvalidStateError) as exc:
        sp.save(torch.nn.Sequential(torch.nn.LazyLinear(3)), tmp_path / "lazy")
    assert str(exc.value) == (
        "tensor '0.weight' is a parameter of a lazy module (nn.LazyLinear, ...) that has no shape yet; run the "
        "model once on an input (or call its initialize_parameters) before saving"
    )


def test_a_mismatch_a_self_loading_module_finds_is_an_error_not_ok(tmp_path: Path) -> None:
    sp.save(torch.nn.Sequential(_Packed(), torch.nn.Linear(3, 3)), tmp_path / "ck")
    # Its loader is tried on a meta copy first: refused before anything is read, as any shape mismatch.
    target = torch.nn.Sequential(_Packed(columns=4), torch.nn.Linear(3, 3))
    before = target[1].weight.clone()
    with pytest.raises(sp.LoadMismatchError, match=r"shape mismatch: '0.weight' \(saved \[2, 3\], target \[2, 4\]\)\n"
                                                    r"  nothing was loaded"):
        sp.load_into(target, tmp_path / "ck")
    result = sp.load_into(target, tmp_path / "ck", strict=False)
    assert result.mismatched_keys == [("0.weight", (2, 3), (2, 4))] and not torch.equal(target[1].weight, before)
    sp.save({"0.weight": torch.ones(2, 3), "0.scale": torch.ones(1)}, tmp_path / "extra")
    result = sp.load_into(torch.nn.Sequential(_Packed()), tmp_path / "extra", strict=False)
    assert result.unexpected_keys == ["0.scale"] and not result.ok


class _Wrapped(torch.Tensor):
    """A wrapper subclass with no storage of its own (as torchao's tensors are)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)  # type: ignore[attr-defined]

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self):  # type: ignore[no-untyped-def]
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):  # type: ignore[no-untyped-def]
        return _Wrapped(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*tree_map(lambda t: t.inner if isinstance(t, _Wrapped) else t, args),
                   **tree_map(lambda t: t.inner if isinstance(t, _Wrapped) else t, kwargs or {}))
        return tree_map(lambda t: _Wrapped(t) if isinstance(t, torch.Tensor) and not isinstance(t, _Wrapped) else t,
                        out)


def test_wrapper_subclass_targets_are_filled_through_their_copy_and_refused_on_save(tmp_path: Path) -> None:
    sp.save({"weight": torch.arange(6.0).reshape(2, 3)}, tmp_path / "ck")
    target = {"weight": _Wrapped(torch.zeros(2, 3))}
    assert sp.load_into(target, tmp_path / "ck").ok
    assert target["weight"].inner.tolist() == [[0, 1, 2], [3, 4, 5]]
    linear = torch.nn.Linear(3, 2, bias=False)
    linear.weight = torch.nn.Parameter(_Wrapped(torch.zeros(2, 3)), requires_grad=False)
    assert sp.load_into(linear, tmp_path / "ck").ok
    assert linear.weight.inner.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(sp.InvalidStateError, match=r"^tensor 'w' is a _Wrapped, a tensor subclass with no memory"):
        sp.save({"w": _Wrapped(torch.ones(2))}, tmp_path / "w")


def test_a_load_bumps_the_autograd_version_of_what_it_fills(tmp_path: Path) -> None:
    """A graph built before the load must not back-propagate through the new values."""
    sp.save({"weight": torch.full((2, 2), 10.0), "bias": torch.zeros(2)}, tmp_path / "ck")
    model = torch.nn.Linear(2, 2)
    loss = (model(torch.randn(3, 2, requires_grad=True)) ** 2).sum()
    before = model.weight._version
    sp.load_into(model, tmp_path / "ck")
    assert model.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inference_tensors_load_inside_inference_mode_and_are_refused_outside(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((512, 512), float(i)) for i in range(8)}  # several reader threads
    sp.save(state, tmp_path / "ck")
    with torch.inference_mode():
        same = {k: torch.zeros(512, 512) for k in state}
        cast = {k: torch.zeros(512, 512, dtype=torch.bfloat16) for k in state}
    with pytest.raises(sp.InvalidStateError) as exc:
        sp.load_into(same, tmp_path / "ck")
    assert str(exc.value) == (
        "target tensor 't0' was made under torch.inference_mode(), and torch lets such a tensor change only "
        "inside it: call load_into inside `with torch.inference_mode():`, or build the target outside it; "
        "nothing was loaded"
    )
    assert not any(t.any() for t in same.values())
    with torch.inference_mode():
        assert sp.load_into(same, tmp_path / "ck").ok and sp.load_into(cast, tmp_path / "ck").ok
    assert all(torch.equal(same[k], v) and torch.equal(cast[k].float(), v) for k, v in state.items())


def test_a_model_offloaded_by_accelerate_is_refused_both_ways(tmp_path: Path) -> None:
    """cpu_offload keeps the weights in its hooks and puts them back at every forward: a load
    into the parameters was undone by the next forward; a save saw meta tensors."""
    from accelerate import cpu_offload

    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    sp.save(trained, tmp_path / "ck")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(sp.InvalidStateError, match=r"module '0' of the target is offloaded by accelerate .*"
                                                    r"remove_hook_from_module\(model, recurse=True\)\); nothing was loaded"):
        sp.load_into(model, tmp_path / "ck")
    with pytest.raises(sp.InvalidStateError, match=r"^module '0' is offloaded by accelerate: .* do not materialize "
                                                    r"it with to_empty \(that would lose the weights\)$"):
        sp.save(model, tmp_path / "offloaded")
    assert not (tmp_path / "offloaded").exists()


def test_values_a_target_cannot_take_are_reported_never_dropped_or_added(tmp_path: Path) -> None:
    """A state dict target gained the checkpoint's extra tensors (ok=True, then its own
    load_state_dict failed); a module dropped a saved int without a word; an int where the
    target holds a tensor read as a shape mismatch with saved shape []."""
    big = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    sp.save({"model": big, "step": 3}, tmp_path / "big")
    state = torch.nn.Sequential(torch.nn.Linear(2, 2)).state_dict()
    result = sp.load_into({"model": state, "step": 0}, tmp_path / "big", strict=False)
    assert result.unexpected_keys == ["model.1.weight", "model.1.bias"] and sorted(state) == ["0.bias", "0.weight"]
    assert torch.equal(state["0.weight"], big[0].weight)
    holder: dict[str, object] = {"model": {}, "step": 0}  # an empty dict takes what was saved
    assert sp.load_into(holder, tmp_path / "big").ok and sorted(holder["model"]) == sorted(big.state_dict())

    sp.save({"model": {"weight": torch.ones(1, 1), "bias": torch.ones(1), "step": 7}}, tmp_path / "a")
    result = sp.load_into({"model": torch.nn.Linear(1, 1)}, tmp_path / "a", strict=False)
    assert result.unexpected_keys == ["model/step"] and not result.ok
    sp.save({"model": torch.nn.Linear(1, 1), "x": 3}, tmp_path / "b")
    result = sp.load_into({"model": torch.nn.Linear(1, 1), "x": torch.zeros(3)}, tmp_path / "b", strict=False)
    assert (result.missing_keys, result.unexpected_keys, result.mismatched_keys) == (["x"], ["x"], [])


def test_self_loading_modules_follow_device_map_and_dtype(tmp_path: Path) -> None:
    """A self-loading module the device map sends to meta was left there with ok=True; a
    real one ignored dtype= (float32 beside bfloat16: the forward failed)."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 3), _Packed())
    sp.save(src, tmp_path / "ck")
    empty = sp.empty_model(lambda: torch.nn.Sequential(torch.nn.Linear(3, 3), _Packed()))
    result = sp.load_into(empty, tmp_path / "ck", device_map={"0": "cpu", "1": "meta"})
    assert result.kept_off_keys == ["1.weight"] and result.matched and not result.ok
    packed_real = torch.nn.Sequential(torch.nn.Linear(3, 3), _Packed())
    with torch.no_grad():
        packed_real[1].weight.data = torch.zeros(2, 3)  # float32 now: dtype= must make it bfloat16
    assert sp.load_into(packed_real, tmp_path / "ck", dtype=torch.bfloat16).ok
    assert {p.dtype for p in packed_real.parameters()} == {torch.bfloat16}


def test_inference_mode_targets_replaced_rather_than_filled_load_outside_it(tmp_path: Path) -> None:
    sp.save(torch.nn.Linear(2, 2), tmp_path / "ck")
    with torch.inference_mode():
        empty = sp.empty_model(torch.nn.Linear, 2, 2)
        real = torch.nn.Linear(2, 2)
    assert sp.load_into(empty, tmp_path / "ck").ok  # meta tensors get new ones
    assert sp.load_into(real, tmp_path / "ck", dtype=torch.bfloat16).ok  # replaced in the new dtype


def test_unsigned_narrowing_that_fits_loads_and_mixed_kinds_get_a_sentence_each(tmp_path: Path) -> None:
    sp.save({"x": torch.tensor([1, 2, 3], dtype=torch.uint32), "y": torch.tensor([7], dtype=torch.uint16)},
            tmp_path / "u")
    target = {"x": torch.zeros(3, dtype=torch.int16), "y": torch.zeros(1, dtype=torch.uint8)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sp.load_into(target, tmp_path / "u").ok  # "aminmax_cpu" not implemented for 'UInt32' before
    assert target["x"].tolist() == [1, 2, 3] and target["y"].tolist() == [7]
    sp.save({"a": torch.tensor([300, 1]), "b": torch.tensor([1e5, 1.0])}, tmp_path / "mixed")
    with pytest.warns(UserWarning) as caught:
        sp.load_into({"a": torch.zeros(2, dtype=torch.int8), "b": torch.zeros(2, dtype=torch.float16)},
                     tmp_path / "mixed")
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "'b' are past float16's range" in said[0] and "'a' are outside int8's range" in said[0]


def test_a_wrapper_saved_base_loads_into_a_model_with_a_head_and_ties_are_not_guessed(tmp_path: Path) -> None:
    """A base model saved under DDP (module.*) into a model with the base under model.: the
    rename module. -> model. was lost with the rule that stopped swapping non-wrapper
    prefixes; where two such renames match alike, none is guessed."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    sp.save({f"module.{k}": v for k, v in base.state_dict().items()}, tmp_path / "ddp")
    with_head = torch.nn.ModuleDict({"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                                     "head": torch.nn.Linear(4, 2)})
    result = sp.load_into(with_head, tmp_path / "ddp", strict=False)
    assert result.prefix_mapping == {"": ("module.", "model.")} and result.missing_keys == ["head.weight", "head.bias"]
    assert torch.equal(with_head["model"][1].weight, base[1].weight)
    twins = torch.nn.ModuleDict({"a": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                                 "b": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))})
    with pytest.raises(sp.LoadMismatchError, match="not one of its 4 keys matches"):
        sp.load_into(twins, tmp_path / "ddp", strict=False)  # module. -> a. or -> b.: no guess


class _WithExtra(torch.nn.Linear):
    """Keeps a non-tensor state through get_extra_state / set_extra_state (torch's hook)."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.calls = 0

    def get_extra_state(self) -> Any:
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def test_a_modules_extra_state_is_restored(tmp_path: Path) -> None:
    """get_extra_state's value was listed as both missing and unexpected, and never given
    back (torch's load_state_dict gives it to set_extra_state)."""
    src = torch.nn.ModuleDict({"a": _WithExtra(), "b": torch.nn.Linear(2, 2)})
    src["a"].calls = 7
    sp.save(src, tmp_path / "flat")
    sp.save({"model": src, "step": 3}, tmp_path / "nested")
    fresh = torch.nn.ModuleDict({"a": _WithExtra(), "b": torch.nn.Linear(2, 2)})
    assert sp.load_into(fresh, tmp_path / "flat").ok and fresh["a"].calls == 7
    assert torch.equal(fresh["a"].weight, src["a"].weight) and torch.equal(fresh["b"].bias, src["b"].bias)
    again = {"model": torch.nn.ModuleDict({"a": _WithExtra(), "b": torch.nn.Linear(2, 2)}), "step": 0}
    assert sp.load_into(again, tmp_path / "nested").ok and again["model"]["a"].calls == 7 and again["step"] == 3
    sp.save({"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2), "b.weight": torch.ones(2, 2),
             "b.bias": torch.ones(2)}, tmp_path / "without")
    result = sp.load_into(torch.nn.ModuleDict({"a": _WithExtra(), "b": torch.nn.Linear(2, 2)}), tmp_path / "without",
                          strict=False)
    assert result.missing_keys == ["a._extra_state"] and not result.ok


class _TaggedParam(torch.nn.Parameter):
    """A Parameter subclass of the user's own (dense memory, an attribute)."""

    def __new__(cls, data: Any = None, requires_grad: bool = True) -> _TaggedParam:
        made = super().__new__(cls, data, requires_grad)
        made.tag = "keep-me"
        return made


class _ScaledParam(torch.nn.Parameter):
    """One whose constructor takes an attribute (as quantization libraries' do)."""

    def __new__(cls, data: Any = None, requires_grad: bool = True, *, scale: float) -> _ScaledParam:
        made = super().__new__(cls, data, requires_grad)
        made.scale = scale
        return made


class _TaggedBuffer(torch.Tensor):
    pass


class _Tagged(torch.nn.Module):
    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.w = _TaggedParam(torch.randn(3, 3, device=device))
        self.s = _ScaledParam(torch.randn(2, device=device), scale=0.5)
        buffer = torch.randn(2, device=device).as_subclass(_TaggedBuffer)
        buffer.tag = "buffer"
        self.register_buffer("b", buffer)


def test_a_parameter_subclass_is_cast_by_dtype_and_keeps_its_class_when_built_on_meta(tmp_path: Path) -> None:
    """dtype= refused it as if it were FSDP2's DTensor ("convert the model before sharding
    it"); built on meta it came back a plain Parameter, its class and attributes gone."""
    torch.manual_seed(0)
    saved = _Tagged()
    sp.save(saved, tmp_path / "ck")
    model = _Tagged()
    assert sp.load_into(model, tmp_path / "ck", dtype=torch.bfloat16).ok
    assert type(model.w) is _TaggedParam and model.w.dtype == torch.bfloat16
    assert torch.equal(model.w, saved.w.to(torch.bfloat16))
    empty = _Tagged(device="meta")
    assert sp.load_into(empty, tmp_path / "ck").ok
    assert type(empty.w) is _TaggedParam and empty.w.tag == "keep-me" and torch.equal(empty.w, saved.w)
    assert type(empty.s) is _ScaledParam and empty.s.scale == 0.5 and torch.equal(empty.s, saved.s)
    assert type(empty.b) is _TaggedBuffer and empty.b.tag == "buffer" and torch.equal(empty.b, saved.b)
