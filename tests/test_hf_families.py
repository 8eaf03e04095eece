"""``load_into`` gives the model ``from_pretrained`` gives, on fourteen ``transformers`` families.

Each family is built from a tiny config (no download), saved three ways (``sp.save`` of the
state dict, ``shardpoint.integrations.transformers.save_pretrained``, ``model.save_pretrained``)
and loaded into models built three empty ways (``sp.empty_model``, ``torch.device("meta")``,
``accelerate.init_empty_weights``) and into a model built whole, in float32 and with ``dtype=torch.bfloat16``: the
logits must equal ``from_pretrained(..., dtype=...)``'s exactly, and no tensor may be left
on ``meta``. Also: base-model prefixes mapped in both directions, a load that matches no
key refused, and a meta tensor nothing can rebuild reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from shardpoint.integrations.transformers import save_pretrained  # noqa: E402

V = 64


def _families() -> dict[str, tuple[Any, Any]]:
    tf = transformers
    small = {"vocab_size": V}
    decoder = {**small, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    return {
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(**small, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                                   bos_token_id=0, eos_token_id=0)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(**small, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_heads=2, decoder_start_token_id=0)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(**small, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=64, max_position_embeddings=64)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**decoder)),
        "llama-tied": (tf.LlamaForCausalLM, tf.LlamaConfig(**decoder, tie_word_embeddings=True)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**decoder)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**decoder)),
        "opt": (tf.OPTForCausalLM, tf.OPTConfig(**small, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=2, max_position_embeddings=64,
                                                word_embed_proj_dim=32)),
        "bart": (tf.BartForConditionalGeneration, tf.BartConfig(**small, d_model=32, encoder_layers=1, decoder_layers=1,
                                                                encoder_attention_heads=2, decoder_attention_heads=2,
                                                                encoder_ffn_dim=64, decoder_ffn_dim=64,
                                                                max_position_embeddings=64)),
        # Sinusoidal position tables: Marian's are parameters its files leave out
        # (_keys_to_ignore_on_save), rebuilt through _init_weights; M2M100's and XGLM's are
        # non-persistent buffers built in the default dtype, so bf16 under dtype=bf16.
        "marian": (tf.MarianMTModel, tf.MarianConfig(**small, d_model=32, encoder_layers=1, decoder_layers=1,
                                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                                     encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                                                     pad_token_id=V - 1, decoder_start_token_id=V - 1)),
        "m2m100": (tf.M2M100ForConditionalGeneration, tf.M2M100Config(**small, d_model=32, encoder_layers=1,
                                                                      decoder_layers=1, encoder_attention_heads=2,
                                                                      decoder_attention_heads=2, encoder_ffn_dim=64,
                                                                      decoder_ffn_dim=64, max_position_embeddings=64)),
        "xglm": (tf.XGLMForCausalLM, tf.XGLMConfig(**small, d_model=32, num_layers=2, attention_heads=2, ffn_dim=64,
                                                   max_position_embeddings=64)),
        # embed_scale: a non-persistent float buffer, bf16 under dtype=bf16 as from_pretrained makes it.
        "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig(**decoder, head_dim=16)),
        "resnet": (tf.ResNetForImageClassification, tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                                    depths=[1, 1], num_labels=3)),
    }


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield


def _inputs(name: str) -> dict[str, torch.Tensor]:
    if name == "resnet":
        return {"pixel_values": torch.linspace(-2, 2, 3 * 16 * 16).reshape(1, 3, 16, 16)}
    ids = torch.tensor([[1, 7, 42, 3, 63, 0, 17, 9]])
    if name in ("t5", "bart", "marian", "m2m100"):
        return {"input_ids": ids, "decoder_input_ids": torch.tensor([[0, 5, 11, 2]])}
    return {"input_ids": ids}


def _logits(model: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _inputs(name).items()}
    with torch.no_grad():
        return model(**inputs).logits


def _trained(cls: Any, config: Any) -> torch.nn.Module:
    """A model whose buffers differ from a fresh one's (BatchNorm statistics moved)."""
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if value.is_floating_point() and key.endswith(("running_mean", "running_var", "final_logits_bias")):
                value.add_(torch.rand_like(value))
    return model.eval()


def _build_empty(how: str, cls: Any, config: Any) -> torch.nn.Module:
    if how == "built":  # an ordinary model, weights and all, loaded over
        torch.manual_seed(1)
        return cls(config)
    if how == "empty_model":
        return sp.empty_model(cls, config)
    if how == "meta_device":
        with torch.device("meta"):
            return cls(config)
    with accelerate.init_empty_weights():
        return cls(config)


WRITERS: dict[str, Callable[[torch.nn.Module, Path], None]] = {
    "sp.save": lambda m, d: sp.save(m.state_dict(), d),
    "sp.save_pretrained": lambda m, d: save_pretrained(m, d),
    "save_pretrained": lambda m, d: m.save_pretrained(d),
}


@pytest.mark.parametrize("family", list(_families()))
def test_empty_model_loads_give_from_pretrained_logits(family: str, tmp_path: Path) -> None:
    cls, config = _families()[family]
    source = _trained(cls, config)
    folders = {}
    for writer, write in WRITERS.items():
        folders[writer] = tmp_path / writer
        write(source, folders[writer])
    for dtype in (torch.float32, torch.bfloat16):
        reference = cls.from_pretrained(folders["save_pretrained"], dtype=dtype).eval()
        expected = _logits(reference, family, dtype)
        ref_dtypes = {k: v.dtype for k, v in reference.state_dict().items()}
        ref_buffers = {k: v.dtype for k, v in reference.named_buffers()}  # non-persistent ones too
        for how in ("empty_model", "meta_device", "init_empty_weights", "built"):
            for writer, folder in folders.items():
                case = f"{family}: {how} + load_into({writer}, dtype={dtype})"
                model = _build_empty(how, cls, config).eval()
                result = sp.load_into(model, folder, dtype=dtype)
                assert result.ok, (case, result)
                assert result.meta_keys == [] and result.prefix_mapping == {}, case
                left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
                assert left == [], (case, left)
                assert {k: v.dtype for k, v in model.state_dict().items()} == ref_dtypes, case
                assert {k: v.dtype for k, v in model.named_buffers()} == ref_buffers, case
                got = _logits(model, family, dtype)
                assert got.dtype == expected.dtype and torch.equal(got, expected), case


# ------------------------------------------------------------------------ prefixes


def _llama_config() -> Any:
    return transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def test_base_checkpoint_loads_into_head_model_with_prefix_reported(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = transformers.LlamaModel(_llama_config())
    sp.save(base.state_dict(), tmp_path / "base")
    head = sp.empty_model(transformers.LlamaForCausalLM, _llama_config())
    with pytest.raises(sp.LoadMismatchError) as info:
        sp.load_into(head, tmp_path / "base")
    message = str(info.value)
    assert "keys renamed to match: checkpoint '<name>' -> target 'model.<name>'" in message
    assert "missing from the checkpoint: 'lm_head.weight'\n" in message
    result = sp.load_into(head, tmp_path / "base", strict=False)
    assert result.prefix_mapping == {"": ("", "model.")}
    assert result.missing_keys == ["lm_head.weight"]
    assert result.unexpected_keys == [] and result.mismatched_keys == []
    assert result.meta_keys == ["lm_head.weight"]
    assert not result.ok
    assert "left on the meta device (the model cannot run): 'lm_head.weight'" in result.summary()
    for key, value in base.state_dict().items():
        assert torch.equal(head.state_dict()[f"model.{key}"], value), key


def test_a_module_is_never_renamed_into_another_of_the_same_shape(tmp_path: Path) -> None:
    """A pretrained encoder + decoder into an encoder + new head: the decoder's weights
    landed in the head with ok=True (the rename decoder. -> head. matched more keys). Only
    wrappers stand for one another; a causal LM's lm_head is not a classifier's score."""
    torch.manual_seed(0)
    pretrained = torch.nn.ModuleDict({"encoder": torch.nn.Linear(4, 4), "decoder": torch.nn.Linear(4, 4)})
    sp.save(pretrained, tmp_path / "ae")
    tuned = torch.nn.ModuleDict({"encoder": torch.nn.Linear(4, 4), "head": torch.nn.Linear(4, 4)})
    before = tuned.head.weight.clone()
    result = sp.load_into(tuned, tmp_path / "ae", strict=False)
    assert result.prefix_mapping == {}
    assert result.missing_keys == ["head.weight", "head.bias"]
    assert result.unexpected_keys == ["decoder.weight", "decoder.bias"]
    assert torch.equal(tuned.head.weight, before) and torch.equal(tuned.encoder.weight, pretrained.encoder.weight)

    config = _llama_config()
    config.num_labels, config.pad_token_id = config.vocab_size, 0  # score shaped like lm_head
    sp.save(transformers.LlamaForCausalLM(config), tmp_path / "lm")
    with pytest.raises(sp.LoadMismatchError) as info:
        sp.load_into(transformers.LlamaForSequenceClassification(config), tmp_path / "lm")
    assert "missing from the checkpoint: 'score.weight'\n" in str(info.value)
    assert "unexpected (in the checkpoint, not the target): 'lm_head.weight'\n" in str(info.value)


def test_head_checkpoint_loads_into_base_model_with_prefix_reported(tmp_path: Path) -> None:
    torch.manual_seed(0)
    head = transformers.LlamaForCausalLM(_llama_config())
    head.save_pretrained(tmp_path / "head")
    base = transformers.LlamaModel(_llama_config())
    result = sp.load_into(base, tmp_path / "head", strict=False)
    assert result.prefix_mapping == {"": ("model.", "")}
    assert result.unexpected_keys == ["lm_head.weight"]
    assert result.missing_keys == [] and result.meta_keys == []
    assert result.summary().splitlines() == [
        "keys renamed to match: checkpoint 'model.<name>' -> target '<name>'",
        "unexpected (in the checkpoint, not the target): 'lm_head.weight'",
    ]
    for key, value in base.state_dict().items():
        assert torch.equal(value, head.state_dict()[f"model.{key}"]), key


def test_prefix_of_a_plain_module_is_found_from_the_keys(tmp_path: Path) -> None:
    """No base_model_prefix: a leading component of the keys is the candidate."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    outer = torch.nn.ModuleDict({"backbone": torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)),
                                 "head": torch.nn.Linear(2, 1)})
    sp.save(inner.state_dict(), tmp_path / "inner")
    result = sp.load_into(outer, tmp_path / "inner", strict=False)
    assert result.prefix_mapping == {"": ("", "backbone.")}
    assert result.missing_keys == ["head.weight", "head.bias"]
    assert torch.equal(outer["backbone"][1].weight, inner[1].weight)


def test_load_that_matches_no_key_raises_even_when_not_strict(tmp_path: Path) -> None:
    sp.save({"encoder.w": torch.ones(2), "encoder.b": torch.zeros(2)}, tmp_path / "ck")
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(sp.LoadMismatchError) as info:
        sp.load_into(model, tmp_path / "ck", strict=False)
    assert isinstance(info.value, sp.CheckpointError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith(
        f"loading {tmp_path / 'ck'}: not one of its 2 keys matches the 2 keys of the target"
    )
    assert "checkpoint keys: 'encoder.b', 'encoder.w'" in str(info.value)
    assert "target keys: 'bias', 'weight'" in str(info.value)
    assert "rename them" in str(info.value)
    assert torch.equal(model.weight, before)
    with pytest.raises(sp.LoadMismatchError, match="not one of its 2 keys matches the 1 keys of the target"):
        sp.load_into({"other": torch.zeros(2)}, tmp_path / "ck", strict=False)


# ------------------------------------------------------------------------ meta left


class _Scaled(torch.nn.Module):
    """A non-persistent buffer only its constructor knows how to build."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.register_buffer("scale", torch.full((2,), factor), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_meta_buffer_that_cannot_be_rebuilt_is_reported_and_strict_raises(tmp_path: Path) -> None:
    sp.save(_Scaled(3.0).state_dict(), tmp_path / "ck")
    with torch.device("meta"):
        model = _Scaled(3.0)
    with pytest.raises(sp.LoadMismatchError) as info:
        sp.load_into(model, tmp_path / "ck")
    assert "left on the meta device (the model cannot run): 'scale'" in str(info.value)
    assert "build the model with sp.empty_model" in str(info.value)
    assert model.linear.weight.is_meta  # refused before anything was loaded
    result = sp.load_into(model, tmp_path / "ck", strict=False)
    assert result.meta_keys == ["scale"] and not result.ok
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert model.scale.is_meta and not model.linear.weight.is_meta


class _Rotary(torch.nn.Module):
    """A non-persistent buffer computed from constructor arguments the module keeps."""

    def __init__(self, dim: int, base: float = 10000.0, device: str | None = None) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.proj = torch.nn.Linear(dim, dim)
        inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        self.register_buffer("inv_freq", inv, persistent=False)


class _Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = _Rotary(8, base=500.0)
        self.llama_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(_llama_config())


def test_meta_buffer_rebuilt_by_its_module_constructor(tmp_path: Path) -> None:
    """Outside a transformers model (no _init_weights), the owner's constructor runs again
    with its own attributes as arguments: the non-default base=500 is kept."""
    torch.manual_seed(0)
    source = _Wrapper()
    sp.save(source.state_dict(), tmp_path / "ck")
    with torch.device("meta"):
        model = _Wrapper()
    result = sp.load_into(model, tmp_path / "ck")
    assert result.ok and result.meta_keys == []
    assert torch.equal(model.rotary.inv_freq, source.rotary.inv_freq)
    assert model.rotary.inv_freq[1].item() == pytest.approx(500.0 ** -0.25)
    assert torch.equal(model.llama_rotary.inv_freq, source.llama_rotary.inv_freq)
    assert torch.equal(model.llama_rotary.original_inv_freq, source.llama_rotary.original_inv_freq)
    assert torch.equal(model.rotary.proj.weight, source.rotary.proj.weight)


def test_empty_model_keeps_non_persistent_buffers_real(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = _Scaled(3.0)
    sp.save(source.state_dict(), tmp_path / "ck")
    model = sp.empty_model(_Scaled, 3.0)
    assert model.linear.weight.is_meta and model.scale.tolist() == [3.0, 3.0]
    result = sp.load_into(model, tmp_path / "ck", dtype=torch.bfloat16)
    assert result.ok and result.meta_keys == []
    assert model.linear.weight.dtype == torch.bfloat16
    assert model.scale.dtype == torch.float32  # non-persistent: the dtype its module built
    x = torch.ones(1, 2)
    assert torch.equal(model(x.bfloat16()), source.linear.bfloat16()(x.bfloat16()) * source.scale)


def test_dtype_casts_real_floating_buffers_not_integer_ones(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).eval()
    source[1].running_mean.add_(1.5)
    source[1].num_batches_tracked.fill_(7)
    sp.save(source.state_dict(), tmp_path / "ck")
    with accelerate.init_empty_weights():
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).eval()
    assert model[1].running_mean.device.type == "cpu"  # accelerate keeps buffers real
    assert sp.load_into(model, tmp_path / "ck", dtype=torch.bfloat16).ok
    assert model[1].running_mean.dtype == torch.bfloat16
    assert model[1].running_mean.tolist() == [1.5, 1.5, 1.5]
    assert model[1].num_batches_tracked.dtype == torch.int64 and int(model[1].num_batches_tracked) == 7
    assert model(torch.ones(4, 2, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_keep_in_fp32_modules_follow_from_pretrained(tmp_path: Path) -> None:
    """T5 keeps its ``wo`` projections in float32 under float16, as from_pretrained does."""
    cls, config = _families()["t5"]
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "t5")
    reference = cls.from_pretrained(tmp_path / "t5", dtype=torch.float16)
    model = sp.empty_model(cls, config)
    assert sp.load_into(model, tmp_path / "t5", dtype=torch.float16).ok
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    assert dtypes == {k: v.dtype for k, v in reference.state_dict().items()}
    assert dtypes["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == torch.float32
    assert dtypes["encoder.block.0.layer.1.DenseReluDense.wi.weight"] == torch.float16



@pytest.mark.parametrize("family", ["bert", "llama-tied", "resnet"])
def test_meta_model_from_bin_weights_gives_from_pretrained_logits(family: str, tmp_path: Path) -> None:
    """``pytorch_model.bin`` folders go through the same planning: buffers rebuilt, dtype applied."""
    cls, config = _families()[family]
    source = _trained(cls, config)
    (tmp_path / "bin").mkdir()
    torch.save(source.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    source.save_pretrained(tmp_path / "st")
    reference = cls.from_pretrained(tmp_path / "st", dtype=torch.bfloat16).eval()
    with torch.device("meta"):
        model = cls(config).eval()
    result = sp.load_into(model, tmp_path / "bin", dtype=torch.bfloat16)
    assert result.ok and result.meta_keys == []
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in reference.state_dict().items()}
    assert torch.equal(_logits(model, family, torch.bfloat16), _logits(reference, family, torch.bfloat16))


def test_bin_weights_of_a_base_model_load_into_a_head_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = transformers.LlamaModel(_llama_config())
    torch.save(base.state_dict(), tmp_path / "base.bin")
    head = transformers.LlamaForCausalLM(_llama_config())
    result = sp.load_into(head, tmp_path / "base.bin", strict=False)
    assert result.prefix_mapping == {"": ("", "model.")}
    assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
    assert torch.equal(head.model.norm.weight, base.norm.weight)
    with pytest.raises(sp.LoadMismatchError, match="not one of its 1 keys matches the 2 keys of the target"):
        torch.save({"x": torch.ones(2)}, tmp_path / "x.bin")
        sp.load_into(torch.nn.Linear(2, 2), tmp_path / "x.bin", strict=False)


def test_dtype_on_a_real_model_swaps_data_and_keeps_parameters(tmp_path: Path) -> None:
    """A built model loaded with dtype= ends in that dtype; its Parameter objects (what an
    optimizer holds) and its ties stay; non-persistent buffers keep the dtype they were built in."""
    cls, config = _families()["llama-tied"]
    source = _trained(cls, config)
    source.save_pretrained(tmp_path / "st")
    model = cls(config).eval()
    params = dict(model.named_parameters())
    assert sp.load_into(model, tmp_path / "st", dtype=torch.bfloat16).ok
    assert [n for n, p in model.named_parameters() if p is not params[n] or p.dtype != torch.bfloat16] == []
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    reference = cls.from_pretrained(tmp_path / "st", dtype=torch.bfloat16).eval()
    assert torch.equal(_logits(model, "llama-tied", torch.bfloat16), _logits(reference, "llama-tied", torch.bfloat16))


# ---------------------------------------------------------- what from_pretrained lets be


def _rewrite(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Edit the single model.safetensors that save_pretrained wrote (an older Hub layout)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _same_as_from_pretrained(cls: Any, config: Any, folder: Path, **kwargs: Any) -> sp.LoadResult:
    reference = cls.from_pretrained(folder, **kwargs)
    model = sp.empty_model(cls, config)
    result = sp.load_into(model, folder, **kwargs)  # strict
    want, got = reference.state_dict(), model.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    return result


def test_buffers_old_hub_files_hold_are_not_unexpected(tmp_path: Path) -> None:
    """GPT-2's Hub files hold every layer's causal-mask ``attn.bias`` and Llama-era files
    each layer's ``rotary_emb.inv_freq``: buffers the models no longer save, which
    ``from_pretrained`` lets be (``_keys_to_ignore_on_load_unexpected`` and its two extra
    rules). A strict load reads the rest and reports nothing."""
    tf = transformers
    gpt2 = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")

    def mask(tensors: dict[str, torch.Tensor]) -> None:
        for i in range(2):
            tensors[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))

    _rewrite(tmp_path / "gpt2", mask)
    result = _same_as_from_pretrained(tf.GPT2LMHeadModel, gpt2, tmp_path / "gpt2")
    assert result.ok and result.unexpected_keys == []

    llama = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1)
    tf.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    _rewrite(tmp_path / "llama", lambda t: t.update(
        {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)}))
    result = _same_as_from_pretrained(tf.LlamaForCausalLM, llama, tmp_path / "llama")
    assert result.ok and result.unexpected_keys == []

    # Not every unexpected key is let be: one the model does not name still stops a strict load.
    _rewrite(tmp_path / "llama", lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.ones(2)}))
    with pytest.raises(sp.LoadMismatchError, match=r"unexpected \(in the checkpoint, not the target\): "
                                                   r"'model\.layers\.0\.self_attn\.extra\.weight'\n"):
        sp.load_into(sp.empty_model(tf.LlamaForCausalLM, llama), tmp_path / "llama")


def test_a_key_the_model_lets_be_missing_is_rebuilt_as_from_pretrained_does(tmp_path: Path) -> None:
    """A BART base model's files into the model with a head: ``final_logits_bias`` is in no
    base checkpoint, and ``from_pretrained`` lets it be missing
    (``_keys_to_ignore_on_load_missing``) and initializes it (zeros). Built empty, it is
    rebuilt through the model's own init; nothing is reported missing or left on meta."""
    tf = transformers
    config = tf.BartConfig(vocab_size=V, max_position_embeddings=64, d_model=16, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32)
    torch.manual_seed(3)
    tf.BartModel(config).save_pretrained(tmp_path)
    result = _same_as_from_pretrained(tf.BartForConditionalGeneration, config, tmp_path)
    assert result.ok and result.missing_keys == [] and result.meta_keys == []
    assert result.prefix_mapping == {"": ("", "model.")}


def test_a_tensor_the_model_builds_in_float32_stays_float32_under_a_dtype(tmp_path: Path) -> None:
    """HunYuan-MoE builds its router ``nn.Linear(..., dtype=torch.float32)``:
    ``from_pretrained(dtype=torch.bfloat16)`` builds the model under bfloat16 as the default,
    so that one stays float32. ``load_into(dtype=...)`` gives every tensor the dtype it
    gives."""
    tf = transformers
    config = tf.HunYuanMoEV1Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, num_experts=4, moe_topk=2,
                                   head_dim=8)
    torch.manual_seed(0)
    tf.HunYuanMoEV1ForCausalLM(config).save_pretrained(tmp_path)
    _same_as_from_pretrained(tf.HunYuanMoEV1ForCausalLM, config, tmp_path, dtype=torch.bfloat16)
    model = sp.empty_model(tf.HunYuanMoEV1ForCausalLM, config)
    assert sp.load_into(model, tmp_path, dtype=torch.bfloat16).ok
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    assert dtypes["model.layers.0.mlp.gate.wg.weight"] == torch.float32
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    assert model.config.dtype == config.dtype  # the model's own config is not changed by the load


@pytest.mark.parametrize("device_map", ["auto", "sequential", "cpu", {"": "cpu"}])
def test_device_map_as_from_pretrained_takes_it(device_map: Any, tmp_path: Path) -> None:
    """``device_map="auto"`` (accelerate's plan for the module; on this machine every module
    on the CPU), one device for all, or a mapping: as ``from_pretrained`` takes them."""
    torch.manual_seed(0)
    config = _llama_config()
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    model = sp.empty_model(transformers.LlamaForCausalLM, config)
    assert sp.load_into(model, tmp_path, device_map=device_map).ok
    for key, value in reference.state_dict().items():
        got = model.state_dict()[key]
        assert got.device.type == "cpu" and torch.equal(got, value), key


def test_dtype_auto_loads_in_the_checkpoint_s_own_dtype(tmp_path: Path) -> None:
    """transformers 5's default, dtype="auto", was refused as an unknown dtype."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    _auto_loads_as_from_pretrained(tmp_path / "bf16", torch.bfloat16)
    torch.save(model.state_dict(), tmp_path / "model.pt")  # a .bin / .pt source too
    from_pt = sp.empty_model(transformers.LlamaForCausalLM, _llama_config())
    assert sp.load_into(from_pt, tmp_path / "model.pt", dtype="AUTO").ok
    assert {p.dtype for p in from_pt.parameters()} == {torch.bfloat16}


def test_dtype_auto_takes_the_dtype_config_json_names_first(tmp_path: Path) -> None:
    """As from_pretrained(dtype="auto"): config.json's dtype, else the weights'. A config
    written from a float32 model beside weights saved after a cast to bfloat16 loaded in
    bfloat16 here and in float32 there (logits differed)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config())
    model.config.dtype = torch.float32
    sp.save(model.to(torch.bfloat16).state_dict(), tmp_path / "ckpt")
    model.config.save_pretrained(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "float32"
    _auto_loads_as_from_pretrained(tmp_path / "ckpt", torch.float32)


def _auto_loads_as_from_pretrained(folder: Path, dtype: torch.dtype) -> None:
    """load_into(dtype="auto") of a Llama gives from_pretrained(dtype="auto")'s dtype and logits."""
    empty = sp.empty_model(transformers.LlamaForCausalLM, _llama_config())
    assert sp.load_into(empty, folder, dtype="auto").ok
    reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype="auto")
    assert {p.dtype for p in empty.parameters()} == {p.dtype for p in reference.parameters()} == {dtype}
    ids = torch.arange(6).reshape(1, 6)
    assert torch.equal(empty(ids).logits, reference(ids).logits)
