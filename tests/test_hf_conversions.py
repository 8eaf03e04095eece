"""``transformers`` 5's weight conversions: files in the Hub's names, models in their own.

``transformers`` 5 holds some weights differently from the files on the Hub (Mixtral's
per-expert ``w1`` / ``w2`` / ``w3`` stacked into ``experts.gate_up_proj`` / ``down_proj``,
GPT-NeoX's ``embed_out`` named ``lm_head``, ViT's ``attention.attention.query`` named
``attention.q_proj``) and its ``save_pretrained`` writes the Hub's names back. Here:
``sp.load_into`` of such files gives exactly what ``from_pretrained`` gives (the oracle),
from safetensors and from ``.bin`` weights, into an empty model, a real one and with a
``dtype``; a misfit is refused before the model changes; damage in a fused tensor is
caught; and ``integrations.transformers.save_pretrained`` writes the files ``transformers``
writes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint as sp
from _dist_utils import run_ranks
from shardpoint.errors import ChecksumMismatchError, LoadMismatchError

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")  # transformers 5: the conversions exist
from safetensors import safe_open  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)


def _families() -> dict[str, tuple[Any, Any, dict[str, str]]]:
    """Family -> (model class, config, one Hub name in its files -> the model's name for it)."""
    tf = transformers
    return {
        "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig(**TINY, num_key_value_heads=1, num_local_experts=4,
                                                            num_experts_per_tok=2),
                    {"model.layers.1.block_sparse_moe.experts.3.w3.weight": "model.layers.1.mlp.experts.gate_up_proj"}),
        "qwen2_moe": (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(**TINY, num_key_value_heads=1, num_experts=4,
                                                                num_experts_per_tok=2, moe_intermediate_size=8,
                                                                shared_expert_intermediate_size=16),
                      {"model.layers.0.mlp.experts.2.down_proj.weight": "model.layers.0.mlp.experts.down_proj"}),
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**TINY), {"embed_out.weight": "lm_head.weight"}),
        "vit": (tf.ViTForImageClassification,
                tf.ViTConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                             image_size=8, patch_size=4, num_labels=3),
                {"vit.encoder.layer.0.attention.attention.query.weight": "vit.layers.0.attention.q_proj.weight"}),
    }


FAMILIES = list(_families())


@pytest.fixture(autouse=True)
def _quiet() -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, read by ``safetensors`` itself."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(str(folder / name), "pt") as f:
                out.update((key, f.get_tensor(key)) for key in f.keys())  # noqa: SIM118 (a safe_open is no dict)
    return out


def _file_tensors_of(file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with safe_open(str(file), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118


def _file_tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(t.shape), t.dtype) for k, t in _stored_tensors(folder).items()}


def _hub_files(family: str, folder: Path, **kwargs: Any) -> tuple[Any, Any, torch.nn.Module]:
    cls, config, renamed = _families()[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(folder, **kwargs)
    stored = _file_tensors(folder) if not kwargs else {}
    for hub_name, model_name in renamed.items():  # the files hold the Hub's names, not the model's
        assert not stored or (hub_name in stored and model_name not in stored)
        assert model_name in model.state_dict()
    return cls, config, model


def _assert_same(got: torch.nn.Module, want: torch.nn.Module) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for key, value in want_sd.items():
        assert got_sd[key].dtype == value.dtype, key
        assert not got_sd[key].is_meta, key
        assert torch.equal(got_sd[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_files_load_into_an_empty_model_as_from_pretrained_does(family: str, tmp_path: Path) -> None:
    cls, config, model = _hub_files(family, tmp_path)
    empty = sp.empty_model(cls, config)
    result = sp.load_into(empty, tmp_path)
    assert result.ok, result
    assert result.bytes_read == sum(t.numel() * t.element_size() for t in _stored_tensors(tmp_path).values())
    _assert_same(empty, cls.from_pretrained(tmp_path))
    _assert_same(empty, model)


def test_hub_files_load_in_place_into_a_real_model_keeping_its_parameters(tmp_path: Path) -> None:
    cls, config, model = _hub_files("mixtral", tmp_path)
    torch.manual_seed(1)
    other = cls(config).eval()
    fused = other.model.layers[0].mlp.experts.gate_up_proj
    before = fused.data_ptr()
    result = sp.load_into(other, tmp_path)
    assert result.ok, result
    _assert_same(other, model)
    # Filled where it is: the same Parameter object and memory (an optimizer built on it still holds it).
    assert other.model.layers[0].mlp.experts.gate_up_proj is fused
    assert fused.data_ptr() == before
    ids = torch.randint(0, 64, (1, 7))
    assert torch.equal(other(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", ["mixtral", "vit"])
def test_hub_files_with_a_dtype_give_from_pretrained_s_tensors(family: str, tmp_path: Path) -> None:
    cls, config, _ = _hub_files(family, tmp_path)
    empty = sp.empty_model(cls, config)
    assert sp.load_into(empty, tmp_path, dtype=torch.bfloat16).ok
    _assert_same(empty, cls.from_pretrained(tmp_path, dtype=torch.bfloat16))


def test_bin_weights_in_hub_names_load_as_from_pretrained_does(tmp_path: Path) -> None:
    cls, config, model = _hub_files("mixtral", tmp_path / "st")
    hub = {k: v for k, v in sp.load(tmp_path / "st").items()}
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in hub
    (tmp_path / "bin").mkdir()
    torch.save(hub, tmp_path / "bin" / "pytorch_model.bin")
    config.save_pretrained(tmp_path / "bin")
    empty = sp.empty_model(cls, config)
    result = sp.load_into(empty, tmp_path / "bin")
    assert result.ok, result
    _assert_same(empty, model)
    _assert_same(empty, cls.from_pretrained(tmp_path / "bin"))


def test_files_in_the_model_s_own_names_still_load(tmp_path: Path) -> None:
    cls, config, model = _hub_files("mixtral", tmp_path / "hub")
    sp.save(model.state_dict(), tmp_path / "own")
    assert "model.layers.0.mlp.experts.gate_up_proj" in sp.load(tmp_path / "own")
    empty = sp.empty_model(cls, config)
    assert sp.load_into(empty, tmp_path / "own").ok
    _assert_same(empty, model)


def test_a_checkpoint_of_another_expert_count_is_refused_before_the_model_changes(tmp_path: Path) -> None:
    cls, _, _ = _hub_files("mixtral", tmp_path)
    other_config = transformers.MixtralConfig(**TINY, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=2)
    torch.manual_seed(3)
    target = cls(other_config)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(LoadMismatchError) as err:
        sp.load_into(target, tmp_path)
    message = str(err.value)
    assert message.startswith(f"loading {tmp_path} into the target does not match (strict=True):")
    # The experts' shapes are those the conversion makes of the files' per-expert tensors.
    assert "'model.layers.0.mlp.experts.gate_up_proj' (saved [4, 64, 16], target [2, 64, 16])" in message
    assert "'model.layers.1.mlp.experts.down_proj' (saved [4, 16, 32], target [2, 16, 32])" in message
    assert "'model.layers.0.mlp.gate.weight' (saved [4, 16], target [2, 16])" in message
    assert message.endswith("nothing was loaded; pass strict=False to load the matching tensors and get this report")
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), key
    # Not strict: everything else loads, the misfits are reported and left as they were.
    result = sp.load_into(target, tmp_path, strict=False)
    assert not result.ok
    assert ("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 16), (2, 64, 16)) in result.mismatched_keys
    assert torch.equal(target.state_dict()["model.layers.0.mlp.experts.gate_up_proj"],
                       before["model.layers.0.mlp.experts.gate_up_proj"])
    assert not torch.equal(target.state_dict()["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


def test_a_missing_expert_weight_is_named_as_missing(tmp_path: Path) -> None:
    """One expert's w1 gone from Hub-format files: the model's converter failed on tensor
    sizes, and the refusal advised loading into the class the files were saved from."""
    from safetensors.torch import load_file, save_file

    cls, config, _ = _hub_files("mixtral", tmp_path / "hub")
    tensors = load_file(str(tmp_path / "hub" / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    (tmp_path / "cut").mkdir()
    save_file(tensors, str(tmp_path / "cut" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadMismatchError) as err:
        sp.load_into(cls(config), tmp_path / "cut", strict=False)
    assert str(err.value) == (
        f"{tmp_path / 'cut'}: the model's weight conversion to 'model.layers.0.mlp.experts.gate_up_proj' combines "
        "keys matching '.experts.*.w1.weight' (3), '.experts.*.w3.weight' (4), and the checkpoint holds fewer of "
        "'.experts.*.w1.weight' than of the others: a tensor is missing from the checkpoint (an incomplete download "
        "or copy?); check it with `shardpoint verify`, and fetch the missing file or tensor")


def test_a_damaged_expert_weight_is_caught_naming_it(tmp_path: Path) -> None:
    cls, config, _ = _hub_files("mixtral", tmp_path / "hub")
    # shardpoint's own copy of the Hub's files (a manifest with every tensor's crc32c).
    sp.save(sp.load(tmp_path / "hub"), tmp_path / "sp")
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    data = tmp_path / "sp" / "model.safetensors"
    raw = bytearray(data.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    start = 8 + header_len + json.loads(raw[8:8 + header_len])[name]["data_offsets"][0]
    raw[start + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=name.replace(".", r"\.")):
        sp.load_into(sp.empty_model(cls, config), tmp_path / "sp")


@pytest.mark.parametrize("shard", [None, "4KB"])
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_writes_the_files_transformers_writes(family: str, shard: str | None, tmp_path: Path) -> None:
    """The same files, each with the same tensors, and the same index byte for byte; with
    small shards too, where the reverted per-expert weights (views of the stacked experts)
    must land where save_pretrained puts them: with their stack, counted once."""
    sizes = {} if shard is None else {"max_shard_size": shard}
    cls, config, model = _hub_files(family, tmp_path / "theirs", **sizes)
    from shardpoint.integrations.transformers import save_pretrained

    save_pretrained(model, tmp_path / "ours", **sizes)
    listing = sorted(n for n in os.listdir(tmp_path / "theirs") if n.endswith((".safetensors", ".json")))
    ours_listing = sorted(n for n in os.listdir(tmp_path / "ours") if n.endswith((".safetensors", ".json")))
    assert ours_listing == sorted([*listing, "shardpoint.json"])
    for name in listing:
        if name.endswith(".safetensors"):
            assert _file_tensors_of(tmp_path / "ours" / name) == _file_tensors_of(tmp_path / "theirs" / name), name
    if shard is not None:
        assert len(listing) > 4  # several shards
        index = "model.safetensors.index.json"
        assert (tmp_path / "ours" / index).read_bytes() == (tmp_path / "theirs" / index).read_bytes()
    theirs, ours = _file_tensors(tmp_path / "theirs"), _file_tensors(tmp_path / "ours")
    assert ours == theirs
    _assert_same(cls.from_pretrained(tmp_path / "ours"), model)
    empty = sp.empty_model(cls, config)
    assert sp.load_into(empty, tmp_path / "ours").ok
    _assert_same(empty, model)


def _fsdp_rank(rank: int, world_size: int, folder: str, want: str) -> None:
    """An FSDP2-sharded Mixtral (its experts' stacked weights sharded on dim 0) loads the
    Hub's per-expert files: each rank ends with its own shard of what ``from_pretrained``
    gives, and the full model's logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    transformers.logging.set_verbosity_error()
    cls, config, _ = _families()["mixtral"]
    torch.manual_seed(100 + rank)  # every rank's own random start: the load must replace it all
    model = cls(config).eval()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert type(experts).__name__ == "DTensor" and experts.to_local().shape[0] == 4 // world_size
    result = sp.load_into(model, folder)
    assert result.ok, result
    reference = torch.load(want, weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), reference["state"][key]), key
    assert torch.equal(model(reference["ids"]).logits, reference["logits"])


def test_an_fsdp2_sharded_model_loads_hub_files_on_every_rank(tmp_path: Path) -> None:
    cls, _, _ = _hub_files("mixtral", tmp_path / "hub")
    reference = cls.from_pretrained(tmp_path / "hub").eval()
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        logits = reference(ids).logits
    torch.save({"state": reference.state_dict(), "ids": ids, "logits": logits}, tmp_path / "want.pt")
    run_ranks(_fsdp_rank, 2, str(tmp_path / "hub"), str(tmp_path / "want.pt"))


class _ModuleWrapper(torch.nn.Module):
    """What DDP does to names (the model under ``module``), without a process group."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize("wrap", ["compile", "ddp", "compile-ddp"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_neox"])
def test_hub_files_load_into_a_wrapped_model_through_its_conversions(family: str, wrap: str, tmp_path: Path) -> None:
    """Hub-named files into a model under torch.compile or DDP: the prefix was mapped but the
    model's conversions (GPT-NeoX's embed_out, Mixtral's fused experts) were skipped, and
    those weights stayed on meta (ok=False; forward then failed deep inside torch)."""
    cls, config, model = _hub_files(family, tmp_path)
    inner = sp.empty_model(cls, config)
    wrapped: torch.nn.Module = _ModuleWrapper(inner) if "ddp" in wrap else inner
    if "compile" in wrap:
        wrapped = torch.compile(wrapped)
    result = sp.load_into(wrapped, tmp_path)
    prefix = {"compile": "_orig_mod.", "ddp": "module.", "compile-ddp": "_orig_mod.module."}[wrap]
    assert result.ok and result.prefix_mapping == {"": ("", prefix)}, result
    _assert_same(inner, model)
    ids = torch.randint(0, 64, (1, 7))
    assert torch.equal(inner.eval()(ids).logits, model(ids).logits)


@pytest.mark.parametrize("empty", [False, True])
def test_a_tensor_stored_under_the_hub_s_name_and_the_model_s_is_compared(empty: bool, tmp_path: Path) -> None:
    """Files holding ``embed_out.weight`` and ``lm_head.weight``: the conversions load both
    into ``lm_head.weight``. The last one in the files won, with ok=True and nothing
    unexpected; now equal copies load and different ones are refused, naming both."""
    cls, config, model = _hub_files("gpt_neox", tmp_path / "hub")
    files = sp.load(tmp_path / "hub")
    sp.save({**files, "lm_head.weight": files["embed_out.weight"].clone()}, tmp_path / "same")
    sp.save({**files, "lm_head.weight": files["embed_out.weight"] + 1}, tmp_path / "other")

    def target() -> torch.nn.Module:
        torch.manual_seed(1)
        return sp.empty_model(cls, config) if empty else cls(config).eval()

    same = target()
    result = sp.load_into(same, tmp_path / "same")
    assert result.ok and result.unexpected_keys == [], result
    _assert_same(same, model)
    with pytest.raises(sp.LoadMismatchError, match=re.escape(
            "the checkpoint holds 'lm_head.weight' twice, as 'embed_out.weight' and as 'lm_head.weight' (the "
            "model's weight conversions load both into it, as from_pretrained renames them), with different "
            "values; loading both into one tensor would drop one")):
        sp.load_into(target(), tmp_path / "other")
