"""A load that casts to a narrower float (float32 to float16) turns values past its range into
inf, as ``from_pretrained(dtype=torch.float16)`` does; it says so, naming the tensors, on
every read path that casts (never a model computing inf / nan without a word)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from shardpoint._format.dtypes import NAME_TO_DTYPE

WIDE = torch.tensor([1.0, 7e4, -1e6, float("inf"), float("nan")])
"""Two values past float16's range (7e4, -1e6); inf and nan stay what they are."""


def _state() -> dict[str, torch.Tensor]:
    return {"a": WIDE.clone(), "b": torch.ones(3), "i": torch.arange(3)}


def _warned(fn: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if "range" in str(w.message)]


def _expected(location: Path) -> str:
    return (f"load as float16: 2 value(s) of 'a' are past float16's range (largest magnitude 1e+06; float16 holds "
            f"up to 65504) and became inf as read from {location}; a model computes inf / nan there. "
            "Load as bfloat16 (float32's range) instead")


def _saved(tmp_path: Path, kind: str) -> Path:
    if kind == "safetensors":
        sp.save(_state(), tmp_path / "ckpt")
        return tmp_path / "ckpt"
    torch.save(_state(), tmp_path / "model.pt")
    return tmp_path / "model.pt"


@pytest.mark.parametrize(("kind", "mmap"), [("safetensors", False), ("safetensors", True), ("pt", False)])
def test_load_as_float16_names_the_values_past_its_range(kind: str, mmap: bool, tmp_path: Path) -> None:
    path = _saved(tmp_path, kind)
    out, messages = _warned(lambda: sp.load(path, dtype=torch.float16, mmap=mmap))
    assert messages == [_expected(path)]
    assert out["a"].dtype == torch.float16 and out["i"].dtype == torch.int64
    assert out["a"][:4].tolist() == [1.0, float("inf"), float("-inf"), float("inf")]


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_load_into_float16_tensors_names_them_too(kind: str, tmp_path: Path) -> None:
    path = _saved(tmp_path, kind)
    target = {"a": torch.zeros(5, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.float16),
              "i": torch.zeros(3, dtype=torch.int64)}
    result, messages = _warned(lambda: sp.load_into(target, path))
    assert result.ok and messages == [_expected(path)]


def test_a_strided_destination_cast_after_the_reads_is_counted(tmp_path: Path) -> None:
    """A destination that is not contiguous is read into a buffer, then cast into it."""
    sp.save({"m": torch.tensor([[1.0, 2.0], [3e5, 4.0]])}, tmp_path / "ckpt")
    target = {"m": torch.zeros(2, 2, dtype=torch.float16).t()}
    result, messages = _warned(lambda: sp.load_into(target, tmp_path / "ckpt"))
    assert result.ok and len(messages) == 1 and "1 value(s) of 'm'" in messages[0], messages
    assert target["m"].tolist() == [[1.0, 2.0], [float("inf"), 4.0]]


def test_fused_hub_weights_cast_to_float16_are_counted(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        num_experts_per_tok=1)
    model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(tmp_path)
    files = sp.load(tmp_path)
    key = "model.layers.0.block_sparse_moe.experts.1.w2.weight"  # the Hub's name: fused when loaded
    assert key in files
    files[key][0, 0] = 1e7
    sp.save(files, tmp_path / "hub")
    empty = sp.empty_model(type(model), config)
    result, messages = _warned(lambda: sp.load_into(empty, tmp_path / "hub", dtype=torch.float16))
    assert result.ok, result
    assert len(messages) == 1 and "1 value(s) of 'model.layers.0.mlp.experts.down_proj'" in messages[0], messages
    assert "largest magnitude 1e+07" in messages[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casts_that_keep_every_value_say_nothing(dtype: torch.dtype, tmp_path: Path) -> None:
    """bfloat16 has float32's range; values within float16's range stay finite."""
    sp.save({"a": torch.tensor([1.0, -6e4, float("inf"), float("nan")]) * (1e30 if dtype == torch.bfloat16 else 1)},
            tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sp.load(tmp_path / "ckpt", dtype=dtype)
    assert out["a"].dtype == dtype


@pytest.mark.parametrize("stored", sorted({t for t in NAME_TO_DTYPE.values() if t.is_floating_point}, key=str))
@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_every_stored_float_dtype_loads_cast_to_float16(stored: torch.dtype, kind: str, tmp_path: Path) -> None:
    """float8_e8m0fnu (a power of two up to 2^127) has no min / max kernel in torch: the count
    made the load fail with torch's NotImplementedError."""
    values = torch.tensor([1.0, 2.0, 4.0, 2.0**20 if torch.finfo(stored).max > 2.0**20 else 8.0]).to(stored)
    if kind == "safetensors":
        sp.save({"w": values}, tmp_path / "ckpt")
        path = tmp_path / "ckpt"
    else:
        torch.save({"w": values}, tmp_path / "model.pt")
        path = tmp_path / "model.pt"
    out, messages = _warned(lambda: sp.load(path, dtype=torch.float16))
    want = values.to(torch.float16)
    assert out["w"].dtype == torch.float16 and torch.equal(out["w"], want)
    assert len(messages) == (1 if torch.isinf(want).any() else 0), messages


def test_float16_into_float8_e5m2_counts_values_past_its_range(tmp_path: Path) -> None:
    """float8_e5m2 has float16's exponents but tops out at 57344: 61440-65504 become inf.
    The rule (half the source's range) let it through without a word."""
    sp.save({"w": torch.tensor([1.0, 65000.0, -60000.0], dtype=torch.float16)}, tmp_path / "ckpt")
    out, messages = _warned(lambda: sp.load(tmp_path / "ckpt", dtype=torch.float8_e5m2))
    assert out["w"].float().tolist() == [1.0, float("inf"), -57344.0]
    assert len(messages) == 1 and "2 value(s) of 'w' are past float8_e5m2's range" in messages[0], messages


def test_integers_a_load_wraps_around_are_named(tmp_path: Path) -> None:
    """int64 [300, -200, 2**40] into an int8 buffer became [44, 56, 0], and uint64 2**63 + 5
    into int64 a negative number, both ok=True without a word; int64 100000 into float16 inf."""
    class Counts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("counts", torch.zeros(4, dtype=torch.int8))

    sp.save({"counts": torch.tensor([1, 300, -200, 2**40])}, tmp_path / "i64")
    module = Counts()
    result, said = _warned(lambda: sp.load_into(module, tmp_path / "i64"))
    assert result.ok and module.counts.tolist() == [1, 44, 56, 0]  # torch's wrap-around, as copy_ gives
    assert said == [f"load as int8: 3 value(s) of 'counts' are outside int8's range (-128 to 127) and wrapped "
                    f"around to other values as read from {tmp_path / 'i64'}. Load them into a wider integer "
                    "dtype instead"]
    sp.save({"x": torch.tensor([2**63 + 5], dtype=torch.uint64), "y": torch.tensor([7], dtype=torch.uint64)},
            tmp_path / "u64")
    target = {"x": torch.zeros(1, dtype=torch.int64), "y": torch.zeros(1, dtype=torch.int64)}
    _, said = _warned(lambda: sp.load_into(target, tmp_path / "u64"))
    assert len(said) == 1 and said[0].startswith("load as int64: 1 value(s) of 'x' are outside int64's range")
    assert target["y"].tolist() == [7]
    sp.save({"x": torch.tensor([100000, 7])}, tmp_path / "big")
    half = {"x": torch.zeros(2, dtype=torch.float16)}
    _, said = _warned(lambda: sp.load_into(half, tmp_path / "big"))
    assert len(said) == 1 and said[0].startswith("load as float16: 1 value(s) of 'x' are past float16's range")
    within = {"x": torch.zeros(2, dtype=torch.int32)}
    assert _warned(lambda: sp.load_into(within, tmp_path / "big"))[1] == [] and within["x"].tolist() == [100000, 7]


def test_dcp_load_through_the_storage_reader_names_them_too(tmp_path: Path) -> None:
    """dcp.load(storage_reader=ShardpointStorageReader) cast with copy_ and said nothing."""
    import torch.distributed.checkpoint as dcp

    from shardpoint.integrations.dcp import ShardpointStorageReader

    path = _saved(tmp_path, "safetensors")
    target = {"a": torch.zeros(5, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.float16)}
    _, messages = _warned(lambda: dcp.load(target, storage_reader=ShardpointStorageReader(path), no_dist=True))
    assert messages == [_expected(path)]
    same = {"a": torch.zeros(5, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.float16)}
    _warned(lambda: sp.load_into(same, path, strict=False))
    assert all(torch.equal(target[k].nan_to_num(), same[k].nan_to_num()) for k in "ab")  # nan != nan
