"""sp.integrations.transformers: save_pretrained through shardpoint, from_pretrained as-is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint._cli.main import main as cli_main

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

INPUT_IDS = torch.tensor([[1, 7, 42, 3, 127, 0, 64, 99, 5, 18, 77, 2]])


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    m = LlamaForCausalLM(config).eval()
    m.generation_config.max_new_tokens = 7
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def _logits(m: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m(INPUT_IDS).logits


def test_save_pretrained_loads_with_from_pretrained(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    d = tmp_path / "llama"
    info = sp.integrations.transformers.save_pretrained(model, d, max_shard_size="50kB")
    shards = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    assert len(shards) > 1 and shards == sorted(info.files)
    assert sorted(set(os.listdir(d)) - set(shards)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "shardpoint.json",
    ]
    # Tied weights stored once, under the name transformers keeps.
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert (
        "model.embed_tokens.weight" in index["weight_map"]
        and "lm_head.weight" not in index["weight_map"]
    )
    stored = set()
    for name in shards:
        with safe_open(str(d / name), framework="pt") as f:
            assert f.metadata()["format"] == "pt"
            stored |= set(f.keys())
    assert stored == set(index["weight_map"])

    expected = _logits(model)
    for cls in (LlamaForCausalLM, AutoModelForCausalLM):
        loaded = sp.integrations.transformers.from_pretrained(cls, d).eval()
        assert type(loaded) is LlamaForCausalLM
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert torch.equal(_logits(loaded), expected)
        assert loaded.generation_config.max_new_tokens == 7
    assert cli_main(["verify", str(d)]) == 0

    # shardpoint reads it too, tied weights included.
    fresh = LlamaForCausalLM(model.config).eval()
    assert sp.load_into(fresh, d).ok
    assert torch.equal(_logits(fresh), expected)


def test_config_files_match_transformers(model: LlamaForCausalLM, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    sp.integrations.transformers.save_pretrained(model, ours)
    model.save_pretrained(theirs)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text()), (
            name
        )
    assert json.loads((ours / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    with (
        safe_open(str(ours / "model.safetensors"), framework="pt") as a,
        safe_open(str(theirs / "model.safetensors"), framework="pt") as b,
    ):
        keys = sorted(a.keys())  # safe_open objects are not iterable
        assert keys == sorted(b.keys())
        for key in keys:
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_no_generation_config_for_models_that_do_not_generate(tmp_path: Path) -> None:
    from transformers import LlamaModel

    torch.manual_seed(0)
    base = LlamaModel(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
    )
    sp.integrations.transformers.save_pretrained(base, tmp_path / "base")
    assert "generation_config.json" not in os.listdir(tmp_path / "base")
    loaded = LlamaModel.from_pretrained(tmp_path / "base")
    for key, value in base.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_commit_is_atomic_and_refuses_existing(model: LlamaForCausalLM, tmp_path: Path) -> None:
    d = tmp_path / "llama"
    sp.integrations.transformers.save_pretrained(model, d)
    with pytest.raises(sp.CheckpointExistsError, match="overwrite=True"):
        sp.integrations.transformers.save_pretrained(model, d)
    sp.integrations.transformers.save_pretrained(model, d, overwrite=True, metadata={"run": "a"})
    assert json.loads((d / "shardpoint.json").read_text())["metadata"] == {"run": "a"}
    assert sorted(os.listdir(tmp_path)) == ["llama"]  # no temporary directory left behind
    with pytest.raises(sp.CheckpointError, match=r"unsupported argument.*layout"):
        sp.integrations.transformers.save_pretrained(model, tmp_path / "x", layout="chunked")
    with pytest.raises(sp.InvalidStateError, match="PreTrainedModel"):
        sp.integrations.transformers.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "y")


def test_import_shardpoint_imports_no_framework() -> None:
    code = (
        "import sys, shardpoint as sp\n"
        "sp.integrations.transformers.save_pretrained\n"
        "import shardpoint.integrations.accelerate\n"
        "assert 'transformers' not in sys.modules and 'lightning' not in sys.modules, sorted(sys.modules)\n"
        "assert 'accelerate' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("wrap", ["compile", "dataparallel", "compile-dataparallel"])
def test_save_pretrained_of_a_wrapped_model_writes_the_models_own_names(
    model: LlamaForCausalLM, tmp_path: Path, wrap: str
) -> None:
    """torch.compile passes `config` through, so its wrapper was taken for the model and its
    weights written as `_orig_mod.*`: from_pretrained did not know them and built a randomly
    initialized model. The wrappers are unwrapped, as transformers' save_pretrained does."""
    wrapped: torch.nn.Module = model
    if "dataparallel" in wrap:
        wrapped = torch.nn.DataParallel(wrapped)
    if "compile" in wrap:
        wrapped = torch.compile(wrapped)
    sp.integrations.transformers.save_pretrained(wrapped, tmp_path / "sp")
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "sp" / "model.safetensors"), "pt") as mine, \
            safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as theirs:
        assert sorted(mine.keys()) == sorted(theirs.keys())
        assert not any(k.startswith(("_orig_mod.", "module.")) for k in mine.keys())  # noqa: SIM118
    back = LlamaForCausalLM.from_pretrained(tmp_path / "sp")
    for (name, a), (_, b) in zip(back.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_model_holding_another_model_as_module_is_saved_whole(tmp_path: Path) -> None:
    """A transformers model whose one child is named `module` is no wrapper: it was taken
    for one, and the inner model's config and names were written."""
    from transformers import PretrainedConfig, PreTrainedModel

    class InnerConfig(PretrainedConfig):
        model_type = "sp_test_inner"

    class Inner(PreTrainedModel):
        config_class = InnerConfig

        def __init__(self, config: InnerConfig) -> None:
            super().__init__(config)
            self.lin = torch.nn.Linear(3, 2)
            self.post_init()

    class OuterConfig(PretrainedConfig):
        model_type = "sp_test_outer"

    class Outer(PreTrainedModel):
        config_class = OuterConfig

        def __init__(self, config: OuterConfig) -> None:
            super().__init__(config)
            self.module = Inner(InnerConfig())
            self.post_init()

    model = Outer(OuterConfig())
    sp.integrations.transformers.save_pretrained(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "sp_test_outer"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["module.lin.bias", "module.lin.weight"]
    assert torch.equal(Outer.from_pretrained(tmp_path / "out").module.lin.weight, model.module.lin.weight)


def test_save_pretrained_writes_into_a_trainer_output_dir_holding_no_weights(model: LlamaForCausalLM,
                                                                            tmp_path: Path) -> None:
    """training_args.bin is the Trainer's arguments, not weights: the folder was refused as
    an existing checkpoint, though transformers' own save_pretrained writes into it."""
    out = tmp_path / "trainer-out"
    out.mkdir()
    (out / "training_args.bin").write_bytes(b"args")
    (out / "trainer_state.json").write_text("{}")
    sp.integrations.transformers.save_pretrained(model, out)
    assert {"training_args.bin", "trainer_state.json", "config.json", "model.safetensors"} <= set(os.listdir(out))
    assert (out / "training_args.bin").read_bytes() == b"args"
    weights = tmp_path / "bin-weights"  # a folder with .bin weights is a checkpoint: kept unless overwrite=True
    weights.mkdir()
    (weights / "pytorch_model.bin").write_bytes(b"weights")
    with pytest.raises(sp.CheckpointExistsError):
        sp.integrations.transformers.save_pretrained(model, weights)
    assert os.listdir(weights) == ["pytorch_model.bin"]


def test_a_peft_model_is_refused_by_save_pretrained_and_round_trips_through_sp_save(
        model: LlamaForCausalLM, tmp_path: Path) -> None:
    """save_pretrained(PeftModel) wrote peft's names (base_layer, lora_A.default) under a
    config.json naming PeftModel: from_pretrained started every weight from random values."""
    peft = pytest.importorskip("peft")
    from shardpoint.integrations.transformers import save_pretrained

    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    tuned = peft.get_peft_model(model, lora).eval()
    want = _logits(tuned)
    with pytest.raises(sp.InvalidStateError) as caught:
        save_pretrained(tuned, tmp_path / "out")
    assert str(caught.value) == (
        "save_pretrained() writes a transformers model, and this PeftModel holds PEFT adapters (default): save the "
        "adapters with the model's own save_pretrained(path) (adapter_model.safetensors, which "
        "PeftModel.from_pretrained reads), or merge them first (model = model.merge_and_unload()) and save the "
        "merged model here"
    )
    assert not (tmp_path / "out").exists()
    # The whole adapted model through sp.save / load_into: exact.
    sp.save(tuned, tmp_path / "whole")
    torch.manual_seed(2)
    again = peft.get_peft_model(LlamaForCausalLM(model.config), lora).eval()
    assert sp.load_into(again, tmp_path / "whole").ok and torch.equal(_logits(again), want)
    # Merged, it is a transformers model again.
    save_pretrained(tuned.merge_and_unload(), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.allclose(_logits(merged), want, atol=1e-5)
