"""The ``hf`` layout is the one ``transformers`` 5 and ``huggingface_hub`` write: same file
names, same key-to-file grouping, same index (byte for byte against ``save_pretrained``).

Every comparison is against the real libraries' output for the same tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards
from safetensors import safe_open

import shardpoint as sp
from shardpoint._planning.shards import plan_shards
from shardpoint.integrations.transformers import save_pretrained

transformers = pytest.importorskip("transformers")

INDEX = "model.safetensors.index.json"
LIMIT = 10_000
"""Bytes: the tiny models' embeddings (100 x 32 x 4 = 12800 B) are larger, layers smaller."""


def _layout(directory: Path) -> dict[str, list[str]]:
    """Weight file -> the tensor names it holds (every ``*.safetensors`` file)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(str(directory / name), "pt") as f:
                out[name] = sorted(f.keys())
    return out


def _hub_save(state: dict[str, torch.Tensor], directory: Path, limit: int, discard: list[str] | None = None) -> None:
    directory.mkdir()
    # (on a copy: it removes tied names from the dict it is given)
    save_torch_state_dict(dict(state), directory, max_shard_size=limit, shared_tensors_to_discard=discard)


def _index(directory: Path) -> dict[str, Any] | None:
    path = directory / INDEX
    return json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------- model families

COMMON = {"vocab_size": 100, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LLAMA_LIKE = {
    **COMMON,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}

FAMILIES: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, **COMMON)
    ),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                              decoder_start_token_id=0, **COMMON)
    ),
    "bert": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=32, **COMMON)
    ),
    "llama-tied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(tie_word_embeddings=True, **LLAMA_LIKE)
    ),
    "llama-untied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(tie_word_embeddings=False, **LLAMA_LIKE)
    ),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**LLAMA_LIKE)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(tie_word_embeddings=True, **LLAMA_LIKE)
    ),
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                               max_position_embeddings=32, word_embed_proj_dim=32, **COMMON)
    ),
    "bart": lambda: transformers.BartForConditionalGeneration(
        transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                max_position_embeddings=32, decoder_start_token_id=0, **COMMON)
    ),
}


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    torch.manual_seed(0)
    return {name: build() for name, build in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_writes_the_files_and_index_transformers_writes(
    family: str, models: dict[str, Any], tmp_path: Path
) -> None:
    model = models[family]
    model.save_pretrained(tmp_path / "ref", max_shard_size=LIMIT)
    save_pretrained(model, tmp_path / "ours", max_shard_size=LIMIT)
    sp.save(model, tmp_path / "module", max_shard_size=LIMIT)
    ref = _layout(tmp_path / "ref")
    assert len(ref) > 2  # several files, one of them for an oversized embedding
    assert any(len(keys) == 1 for keys in ref.values())
    for ours in ("ours", "module"):
        assert _layout(tmp_path / ours) == ref, ours
        # The index byte for byte: total_parameters, total_size, sorted keys, final newline.
        assert (tmp_path / ours / INDEX).read_bytes() == (tmp_path / "ref" / INDEX).read_bytes(), ours
    index = _index(tmp_path / "ours")
    assert index is not None
    assert index["metadata"]["total_parameters"] == model.num_parameters()
    # A plain state dict: the same files; the same index unless the model has persistent
    # buffers (BART's final_logits_bias counts as parameters there).
    sp.save(model.state_dict(), tmp_path / "state", max_shard_size=LIMIT)
    assert _layout(tmp_path / "state") == ref
    same_index = (tmp_path / "state" / INDEX).read_bytes() == (tmp_path / "ref" / INDEX).read_bytes()
    assert same_index == (family != "bart")


@pytest.mark.parametrize("family", ["gpt2", "t5", "llama-untied"])
def test_one_file_when_everything_fits(family: str, models: dict[str, Any], tmp_path: Path) -> None:
    model = models[family]
    model.save_pretrained(tmp_path / "ref")
    save_pretrained(model, tmp_path / "ours")
    assert list(_layout(tmp_path / "ours")) == ["model.safetensors"]
    assert _layout(tmp_path / "ours") == _layout(tmp_path / "ref")
    assert _index(tmp_path / "ours") is None and _index(tmp_path / "ref") is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_dict_save_matches_huggingface_hub(family: str, models: dict[str, Any], tmp_path: Path) -> None:
    """``save_torch_state_dict`` given the model's tied keys to discard, as its docs ask for
    ``transformers`` models, against ``sp.save(model.state_dict())``."""
    model = models[family]
    state = model.state_dict()
    discard = list(transformers.modeling_utils._get_tied_weight_keys(model))
    _hub_save(state, tmp_path / "ref", LIMIT, discard)
    sp.save(state, tmp_path / "ours", max_shard_size=LIMIT)
    assert _layout(tmp_path / "ours") == _layout(tmp_path / "ref")
    ours, ref = _index(tmp_path / "ours"), _index(tmp_path / "ref")
    assert ours is not None and ref is not None
    assert ours["weight_map"] == ref["weight_map"]
    assert ours["metadata"]["total_size"] == ref["metadata"]["total_size"]
    # A state dict does not tell parameters from buffers: every stored element counts
    # (BART's persistent final_logits_bias, 1 x 100, is the one buffer of these models).
    buffers = 100 if family == "bart" else 0
    assert ours["metadata"]["total_parameters"] == model.num_parameters() + buffers


def test_issue_example_oversized_tensor_goes_before_the_file_being_filled(tmp_path: Path) -> None:
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(10)}
    sp.save(state, tmp_path / "ours", max_shard_size=100)
    assert _layout(tmp_path / "ours") == {
        "model-00001-of-00003.safetensors": ["big"],
        "model-00002-of-00003.safetensors": ["a", "b"],
        "model-00003-of-00003.safetensors": ["c"],
    }
    assert (tmp_path / "ours" / INDEX).read_text() == (
        "{\n"
        '  "metadata": {\n'
        '    "total_parameters": 130,\n'
        '    "total_size": 520\n'
        "  },\n"
        '  "weight_map": {\n'
        '    "a": "model-00002-of-00003.safetensors",\n'
        '    "b": "model-00002-of-00003.safetensors",\n'
        '    "big": "model-00001-of-00003.safetensors",\n'
        '    "c": "model-00003-of-00003.safetensors"\n'
        "  }\n"
        "}\n"
    )
    _hub_save(state, tmp_path / "ref", 100)
    assert _layout(tmp_path / "ref") == _layout(tmp_path / "ours")


# ------------------------------------------------------------------ hand-built edge cases


def _f32(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + start


def _views_disjoint() -> dict[str, torch.Tensor]:
    base = _f32(30)
    return {"x": _f32(5), "q": base[:10], "y": _f32(20), "k": base[10:20], "v": base[20:], "z": _f32(3)}


def _non_contiguous() -> dict[str, torch.Tensor]:
    return {"a": _f32(6), "t": _f32(40).reshape(5, 8).t(), "b": _f32(7), "s": _f32(60)[::3]}


EDGE_CASES: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "oversized first": lambda: {"big": _f32(50), "a": _f32(10), "b": _f32(10), "c": _f32(10)},
    "oversized middle": lambda: {"a": _f32(10), "b": _f32(10), "big": _f32(100), "c": _f32(10)},
    "oversized last": lambda: {"a": _f32(10), "b": _f32(10), "big": _f32(30)},
    "two oversized in a row": lambda: {"a": _f32(5), "big1": _f32(30), "big2": _f32(40), "b": _f32(5)},
    "exactly at the limit": lambda: {"a": _f32(25), "b": _f32(12), "c": _f32(13), "d": _f32(25), "e": _f32(1)},
    "zero-size tensors": lambda: {
        "e0": torch.empty(0), "a": _f32(20), "e1": torch.zeros(0, 3), "b": _f32(10), "c": _f32(20),
    },
    "many small tensors": lambda: {f"t{i:03d}": _f32(1 + i % 7, i) for i in range(150)},
    "mixed dtypes": lambda: {
        "h": _f32(40).half(), "i": torch.arange(9), "f": _f32(20), "u": torch.ones(70, dtype=torch.uint8),
    },
    "transposed whole tensor": lambda: {"a": _f32(6), "t": _f32(20).reshape(4, 5).t(), "b": _f32(7)},
    "tied": lambda: (lambda e: {"a.emb": e, "x": _f32(10), "z.head": e})(_f32(20)),
    "tied, first name sorts last": lambda: (lambda e: {"z.emb": e, "x": _f32(10), "a.head": e})(_f32(20)),
    "tied three ways": lambda: (lambda e: {"x": _f32(24), "m.emb": e, "b.head": e, "y": _f32(5), "a.out": e})(
        _f32(20)
    ),
}
DISCARD = {"tied": ["z.head"], "tied, first name sorts last": ["a.head"], "tied three ways": ["b.head", "a.out"]}
"""Of a tie, shardpoint stores the first name of the state (``transformers`` keeps the
embedding, which comes first); ``save_torch_state_dict`` keeps the alphabetically first
unless told which names to discard."""

def _views_with_an_empty_one() -> dict[str, torch.Tensor]:
    base = _f32(40)
    return {"a": base[:10], "e": base[10:10], "b": base[10:], "c": _f32(15), "z": torch.empty(0)}


VIEW_CASES: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "views of one storage, disjoint": _views_disjoint,
    "disjoint views with an empty one": _views_with_an_empty_one,
    "strided and transposed views": _non_contiguous,
    "a slice of a larger storage": lambda: {"a": _f32(10), "s": _f32(40)[:5], "b": _f32(10)},
    "zero-size view of a storage": lambda: {"a": _f32(10), "e": _f32(5)[2:2], "b": _f32(20)},
}
"""States ``save_torch_state_dict`` refuses (a view that does not cover its storage) and
``transformers``' ``save_pretrained`` saves: views of one storage that overlap no other are
saved as copies of their own (each its own bytes); a view alone on its storage counts the
whole storage's bytes."""


def _check_save(state: dict[str, torch.Tensor], tmp_path: Path, expected: dict[str, list[str]]) -> None:
    sp.save(state, tmp_path / "ours", max_shard_size=100)
    assert _layout(tmp_path / "ours") == expected
    out = sp.load(tmp_path / "ours")
    assert list(out) == list(state)
    for key, tensor in state.items():
        assert torch.equal(out[key], tensor), key


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases_match_huggingface_hub(case: str, tmp_path: Path) -> None:
    state = EDGE_CASES[case]()
    _hub_save(state, tmp_path / "ref", 100, DISCARD.get(case))
    _check_save(state, tmp_path, _layout(tmp_path / "ref"))
    ours_index, ref_index = _index(tmp_path / "ours"), _index(tmp_path / "ref")
    assert (ours_index is None) == (ref_index is None)
    if ours_index is not None and ref_index is not None:
        assert ours_index["weight_map"] == ref_index["weight_map"]
        assert ours_index["metadata"]["total_size"] == ref_index["metadata"]["total_size"]


@pytest.mark.parametrize("case", list(VIEW_CASES))
def test_views_are_laid_out_as_transformers_saves_them(case: str, models: dict[str, Any], tmp_path: Path) -> None:
    state = VIEW_CASES[case]()
    (tmp_path / "hub").mkdir()
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        save_torch_state_dict(dict(state), tmp_path / "hub", max_shard_size=100)
    models["llama-untied"].save_pretrained(tmp_path / "ref", state_dict=dict(state), max_shard_size=100)
    _check_save(state, tmp_path, _layout(tmp_path / "ref"))
    ours_index, ref_index = _index(tmp_path / "ours"), _index(tmp_path / "ref")
    assert (ours_index is None) == (ref_index is None)
    if ours_index is not None and ref_index is not None:
        assert ours_index["weight_map"] == ref_index["weight_map"]


def test_views_literal_layout(tmp_path: Path) -> None:
    # q, k, v view one 120 B storage without overlapping: each is saved as its own 40 B
    # copy. x 20 + q 40 = 60; y 80 starts a file; k starts the next, v and z join it.
    _check_save(_views_disjoint(), tmp_path, {
        "model-00001-of-00003.safetensors": ["q", "x"],
        "model-00002-of-00003.safetensors": ["y"],
        "model-00003-of-00003.safetensors": ["k", "v", "z"],
    })


def test_planner_matches_split_torch_state_dict_into_shards() -> None:
    """The pure planner against huggingface_hub's own planner (states without ties, which
    ``split_torch_state_dict_into_shards`` does not remove, and without views, which
    ``transformers`` copies first)."""
    for case, build in EDGE_CASES.items():
        if case.startswith("tied"):
            continue
        state = build()
        for limit in (1, 40, 100, 1000):
            split = split_torch_state_dict_into_shards(state, max_shard_size=limit)
            prepared = sp._prepare.prepare_state(state)
            sizes, storage = sp._prepare.hf_sizes(prepared.components[0])
            groups = plan_shards(sizes, limit, storage=storage)
            assert groups == list(split.filename_to_tensors.values()), (case, limit)
    groups = plan_shards([("q", 120), ("x", 20), ("k", 120), ("y", 80)], 100, storage={"q": 1, "k": 1})
    assert groups == [["q", "k"], ["x", "y"]]  # one storage: sized once, in its first file


def test_overlapping_views_are_all_kept_in_one_file(tmp_path: Path) -> None:
    """A deliberate difference: ``huggingface_hub`` drops a partial view of a stored tensor
    (recording its name in the metadata); shardpoint stores it too, in the same file."""
    base = _f32(30)
    state = {"a": _f32(10), "full": base, "part": base[5:15], "b": _f32(20)}
    _hub_save(state, tmp_path / "ref", 100)
    assert _layout(tmp_path / "ref") == {
        "model-00001-of-00003.safetensors": ["full"],
        "model-00002-of-00003.safetensors": ["a"],
        "model-00003-of-00003.safetensors": ["b"],
    }
    _check_save(state, tmp_path, {
        "model-00001-of-00003.safetensors": ["full", "part"],
        "model-00002-of-00003.safetensors": ["a"],
        "model-00003-of-00003.safetensors": ["b"],
    })


def test_async_save_lays_out_like_save(tmp_path: Path) -> None:
    """Staged copies share one buffer: the layout still follows the caller's tensors."""
    state = {**_views_disjoint(), "big": _f32(40)}
    sp.save(state, tmp_path / "sync", max_shard_size=100)
    sp.async_save(state, tmp_path / "async", max_shard_size=100).result()
    assert _layout(tmp_path / "async") == _layout(tmp_path / "sync")
    assert list(_layout(tmp_path / "sync").values()) == [["q", "x"], ["y"], ["big"], ["k", "v", "z"]]


def test_tied_names_kept_as_transformers_keeps_them(models: dict[str, Any], tmp_path: Path) -> None:
    model = models["gpt2"]
    save_pretrained(model, tmp_path / "helper")
    sp.save(model, tmp_path / "module")
    sp.save(model.state_dict(), tmp_path / "state")
    for name, aliases in [
        ("helper", {"lm_head.weight": "transformer.wte.weight"}),
        ("module", {"lm_head.weight": "transformer.wte.weight"}),
        ("state", {"lm_head.weight": "transformer.wte.weight"}),  # the first name of the tie
    ]:
        manifest = json.loads((tmp_path / name / "shardpoint.json").read_text())
        assert manifest["components"]["model"]["aliases"] == aliases, name


@pytest.mark.slow
def test_collective_hf_save_lays_out_like_one_process(tmp_path: Path) -> None:
    from _dist_utils import run_ranks
    from _hf_layout_worker import collective_hf_worker, collective_state

    run_ranks(collective_hf_worker, 2, str(tmp_path), timeout=120)
    state = collective_state()
    sp.save(state, tmp_path / "single", max_shard_size=100)
    _hub_save(state, tmp_path / "ref", 100)
    # a + b fill a file to exactly 100 B (the zero-size tensor joins it); "c" alone is
    # 100 B; each oversized tensor's file comes before the one being filled.
    expected = {
        "model-00001-of-00006.safetensors": ["big0"],
        "model-00002-of-00006.safetensors": ["big1"],
        "model-00003-of-00006.safetensors": ["a", "b", "empty"],
        "model-00004-of-00006.safetensors": ["c"],
        "model-00005-of-00006.safetensors": ["big2"],
        "model-00006-of-00006.safetensors": ["d", "e"],
    }
    assert _layout(tmp_path / "ref") == _layout(tmp_path / "single")
    assert _layout(tmp_path / "collective") == _layout(tmp_path / "single") == expected
    single = (tmp_path / "single" / INDEX).read_bytes()
    assert (tmp_path / "collective" / INDEX).read_bytes() == single
    assert json.loads(single)["metadata"] == {"total_parameters": 171, "total_size": 684}


def test_dedup_stores_the_kept_name_in_its_own_place() -> None:
    from shardpoint._prepare import Component, dedup

    emb, x = torch.ones(3), torch.zeros(2)
    plain = Component("model", {}, {"a.head": emb, "x": x, "b.emb": emb})
    dedup(plain)
    assert (plain.stored, plain.aliases) == (["a.head", "x"], {"b.emb": "a.head"})
    chosen = Component("model", {}, {"a.head": emb, "x": x, "b.emb": emb})
    dedup(chosen, keep={"b.emb", "x"})
    assert (chosen.stored, chosen.aliases) == (["x", "b.emb"], {"a.head": "b.emb"})


def test_save_pretrained_defaults_to_transformers_shard_size(models: dict[str, Any]) -> None:
    from shardpoint.integrations.transformers import _default_shard_size

    assert _default_shard_size(models["gpt2"]) == "50GB"  # transformers 5's save_pretrained default
    assert _default_shard_size(torch.nn.Linear(2, 2)) == "50GB"  # no save_pretrained: the same


CONVERTED: dict[str, Callable[[], Any]] = {
    # transformers 5 renames these on load (embed_out -> lm_head) ...
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   max_position_embeddings=32, **COMMON)
    ),
    # ... fuses per-expert weights into experts.gate_up_proj / down_proj ...
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=32, **LLAMA_LIKE)
    ),
    # ... and leaves _keys_to_ignore_on_save out of its files (sinusoidal position tables).
    "marian": lambda: transformers.MarianMTModel(
        transformers.MarianConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                  max_position_embeddings=32, decoder_start_token_id=0, **COMMON)
    ),
}


@pytest.mark.parametrize("family", list(CONVERTED))
def test_save_pretrained_writes_the_hubs_names_where_transformers_converts(family: str, tmp_path: Path) -> None:
    """Where transformers' save_pretrained stores other names than the model holds (or
    leaves tensors out), the integration's save_pretrained writes what it writes, byte for
    byte; sp.save(model) stores the model's own state dict, which load_into and
    from_pretrained read back the same."""
    torch.manual_seed(0)
    model = CONVERTED[family]().eval()
    model.save_pretrained(tmp_path / "ref", max_shard_size=LIMIT)
    save_pretrained(model, tmp_path / "ours", max_shard_size=LIMIT)
    assert _layout(tmp_path / "ours") == _layout(tmp_path / "ref")
    assert (tmp_path / "ours" / INDEX).read_bytes() == (tmp_path / "ref" / INDEX).read_bytes()
    sp.save(model, tmp_path / "module", max_shard_size=LIMIT)
    own = model.state_dict()
    stored = sp.load(tmp_path / "module")  # tied names included, as aliases
    assert set(stored) == set(own)
    assert _layout(tmp_path / "module") != _layout(tmp_path / "ref")  # renamed, fused or left out there
    for key, value in type(model).from_pretrained(tmp_path / "ours").state_dict().items():
        assert torch.equal(value, own[key]), key
    torch.manual_seed(1)
    again = CONVERTED[family]().eval()
    assert sp.load_into(again, tmp_path / "module").ok
    for key, value in again.state_dict().items():
        assert torch.equal(value, own[key]), key


def test_a_variant_save_is_named_in_the_refusal_and_loads_under_the_plain_index_name(tmp_path: Path) -> None:
    """save_pretrained(variant="fp16") sharded: "found 12 .safetensors files, 0 indexes" named
    neither the variant index nor what to do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "v", variant="fp16", max_shard_size="4KB")
    with pytest.raises(sp.CheckpointNotFoundError, match=r"it holds model\.safetensors\.index\.fp16\.json, the index "
                                                          r"of a save_pretrained\(variant=\.\.\.\) save"):
        sp.load(tmp_path / "v")
    os.rename(tmp_path / "v" / "model.safetensors.index.fp16.json", tmp_path / "v" / "model.safetensors.index.json")
    loaded = sp.load(tmp_path / "v")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items() if k in loaded)
    assert set(model.state_dict()) - set(loaded) <= {"lm_head.weight"}  # tied: stored once


def test_a_folder_of_two_single_weights_files_names_them(tmp_path: Path) -> None:
    """diffusers' diffusion_pytorch_model.safetensors beside its .fp16 variant: the refusal
    named neither file nor that giving one file's path reads it."""
    from safetensors.torch import save_file

    (tmp_path / "unet").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    save_file({"w": torch.ones(2, dtype=torch.float16)}, tmp_path / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    with pytest.raises(sp.CheckpointNotFoundError) as caught:
        sp.load(tmp_path / "unet")
    assert str(caught.value).endswith(
        "; of its weights files ('diffusion_pytorch_model.fp16.safetensors', 'diffusion_pytorch_model.safetensors'), "
        "give the path of the one to read")
    assert sp.load(tmp_path / "unet" / "diffusion_pytorch_model.safetensors")["w"].tolist() == [1.0, 1.0]
