"""Interop with the real ``transformers`` / ``safetensors`` / ``huggingface_hub`` clients.

What shardpoint writes must load with ``from_pretrained`` and the trainer's
``load_sharded_checkpoint``; what those libraries write must load with shardpoint, bit for
bit, tied weights included. Models are built from configs (no network).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import shardpoint as sp

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
huggingface_hub = pytest.importorskip("huggingface_hub")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

try:  # transformers 4.x
    from transformers.modeling_utils import load_sharded_checkpoint
except ImportError:  # transformers 5.x moved it next to the Trainer
    from transformers.trainer_utils import load_sharded_checkpoint

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
INPUT_IDS = torch.tensor([[1, 7, 42, 3, 127, 0, 64, 99, 5, 18, 77, 2]])


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config()).eval()


@pytest.fixture
def model() -> LlamaForCausalLM:
    m = _model(0)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def _logits(m: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m(INPUT_IDS).logits


def _tied(m: LlamaForCausalLM) -> bool:
    a, b = m.lm_head.weight, m.model.embed_tokens.weight
    return a is b or (a.device == b.device and a.data_ptr() == b.data_ptr())


def _assert_same_state(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    exp, act = expected.state_dict(), actual.state_dict()
    assert list(act) == list(exp)
    for key, tensor in exp.items():
        assert act[key].device.type == "cpu", key
        assert act[key].dtype == tensor.dtype, key
        assert torch.equal(act[key], tensor), key


def _keys_per_file(directory: Path) -> dict[str, list[str]]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out[f.name] = list(sf.keys())
    return out


def _sp_save(model: LlamaForCausalLM, d: Path) -> sp.SaveInfo:
    info = sp.save(model.state_dict(), d, max_shard_size="20kB")
    model.config.save_pretrained(d)
    return info


# ------------------------------------------------------- shardpoint -> transformers


def test_from_pretrained_loads_shardpoint_checkpoint(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    d = tmp_path / "ckpt"
    info = _sp_save(model, d)
    assert len(info.files) > 3, "max_shard_size=20kB should give several shards"

    loaded, loading_info = LlamaForCausalLM.from_pretrained(d, output_loading_info=True)
    loaded.eval()
    assert not loading_info["missing_keys"]
    assert not loading_info["unexpected_keys"]
    assert not loading_info["mismatched_keys"]
    assert _tied(loaded)
    _assert_same_state(model, loaded)
    assert torch.equal(_logits(loaded), _logits(model))


def test_index_and_shards_are_hf_format(model: LlamaForCausalLM, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    info = _sp_save(model, d)
    sd = model.state_dict()

    index = json.loads((d / INDEX).read_text())
    weight_map = index["weight_map"]
    unique = {k: v for k, v in sd.items() if k != LM_HEAD}
    # The tied head is stored once, under the name transformers keeps (the embedding).
    assert set(weight_map) == set(unique)
    assert LM_HEAD not in weight_map
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in unique.values()
    )
    assert info.tensor_bytes == index["metadata"]["total_size"]

    files = sorted(set(weight_map.values()))
    assert files == sorted(info.files)
    n = len(files)
    for i, name in enumerate(files, start=1):
        m = SHARD_RE.match(name)
        assert m is not None, name
        assert (int(m.group(1)), int(m.group(2))) == (i, n)

    per_file = _keys_per_file(d)
    assert sorted(per_file) == files
    stored = [k for keys in per_file.values() for k in keys]
    assert sorted(stored) == sorted(unique), "every tensor exactly once, the tied head not at all"
    for fname, keys in per_file.items():
        for k in keys:
            assert weight_map[k] == fname
        with safe_open(str(d / fname), framework="pt") as sf:
            assert sf.metadata()["format"] == "pt"
            for k in keys:
                assert torch.equal(sf.get_tensor(k), sd[k]), k
        assert os.path.getsize(d / fname) == info.files[fname]
    # Sharding follows transformers: no file (with more than one tensor) passes the limit.
    for fname, keys in per_file.items():
        data = sum(sd[k].numel() * sd[k].element_size() for k in keys)
        assert len(keys) == 1 or data <= 20_000, (fname, data)


def test_trainer_load_sharded_checkpoint(model: LlamaForCausalLM, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _sp_save(model, d)
    fresh = _model(1)
    assert not torch.equal(_logits(fresh), _logits(model))
    # The tied head is not in the index, so the trainer's strict mode would call it missing;
    # it is filled through the embedding it shares.
    result = load_sharded_checkpoint(fresh, str(d), strict=False)
    assert list(result.missing_keys) == [LM_HEAD]
    assert list(result.unexpected_keys) == []
    assert _tied(fresh)
    _assert_same_state(model, fresh)
    assert torch.equal(_logits(fresh), _logits(model))


def test_shardpoint_roundtrip_through_load_into(model: LlamaForCausalLM, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _sp_save(model, d)
    fresh = _model(1)
    result = sp.load_into(fresh, d)
    assert result.ok
    assert _tied(fresh)
    _assert_same_state(model, fresh)
    loaded = sp.load(d)
    assert set(loaded) == set(model.state_dict())
    assert loaded[LM_HEAD] is loaded[EMBED] or torch.equal(loaded[LM_HEAD], loaded[EMBED])


# ------------------------------------------------------- transformers -> shardpoint


def test_load_into_reads_sharded_save_pretrained(model: LlamaForCausalLM, tmp_path: Path) -> None:
    d = tmp_path / "hf"
    model.save_pretrained(d, max_shard_size="20kB")
    assert (d / INDEX).is_file()
    per_file = _keys_per_file(d)
    assert len(per_file) > 3
    stored = {k for keys in per_file.values() for k in keys}
    assert LM_HEAD not in stored, "transformers drops the tied head; the test relies on it"

    fresh = _model(1)
    result = sp.load_into(fresh, d)  # strict: the tied head counts as covered
    assert result.ok, result
    assert _tied(fresh)
    _assert_same_state(model, fresh)
    assert torch.equal(_logits(fresh), _logits(model))

    loaded = sp.load(d)
    sd = model.state_dict()
    assert set(loaded) == stored == set(sd) - {LM_HEAD}
    for k, t in loaded.items():
        assert t.dtype == sd[k].dtype
        assert torch.equal(t, sd[k]), k


def test_load_into_reads_single_file_save_pretrained(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    d = tmp_path / "hf"
    model.save_pretrained(d, max_shard_size="1GB")
    assert sorted(p.name for p in d.glob("*.safetensors")) == ["model.safetensors"]
    assert not (d / INDEX).exists()

    for source in (d, d / "model.safetensors", str(d / "model.safetensors")):
        fresh = _model(1)
        assert sp.load_into(fresh, source).ok
        assert _tied(fresh)
        _assert_same_state(model, fresh)
        assert torch.equal(_logits(fresh), _logits(model))

    sd = model.state_dict()
    loaded = sp.load(d / "model.safetensors")
    assert set(loaded) == set(sd) - {LM_HEAD}
    for k, t in loaded.items():
        assert torch.equal(t, sd[k]), k


def test_load_into_reads_huggingface_hub_save_torch_state_dict(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    d = tmp_path / "hub"
    d.mkdir()
    huggingface_hub.save_torch_state_dict(model.state_dict(), d, max_shard_size="20kB")
    per_file = _keys_per_file(d)
    assert len(per_file) > 3
    stored = {k for keys in per_file.values() for k in keys}
    # huggingface_hub keeps one name of the tied pair (which one is its choice).
    assert len({LM_HEAD, EMBED} & stored) == 1

    fresh = _model(1)
    result = sp.load_into(fresh, d)
    assert result.ok, result
    assert _tied(fresh)
    _assert_same_state(model, fresh)
    assert torch.equal(_logits(fresh), _logits(model))

    sd = model.state_dict()
    loaded = sp.load(d)
    assert set(loaded) == stored
    for k, t in loaded.items():
        assert torch.equal(t, sd[k]), k


def test_strict_load_into_still_reports_untied_missing_keys(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    """Tie-aware coverage must not hide a key that is really absent."""
    d = tmp_path / "partial"
    sd = {k: v for k, v in model.state_dict().items() if k not in (LM_HEAD, "model.norm.weight")}
    sp.save(sd, d)
    fresh = _model(1)
    with pytest.raises(sp.LoadMismatchError, match=r"model\.norm\.weight") as info:
        sp.load_into(fresh, d)
    assert info.value.result.missing_keys == ["model.norm.weight"]
    result = sp.load_into(fresh, d, strict=False)
    assert result.missing_keys == ["model.norm.weight"]
    assert result.unexpected_keys == [] and result.mismatched_keys == []


# ------------------------------------------------------------------- meta device


def _meta_model() -> LlamaForCausalLM:
    with torch.device("meta"):
        m = LlamaForCausalLM(_config())
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.lm_head.weight.device.type == "meta"
    return m.eval()


def _finish_meta_model(m: LlamaForCausalLM) -> None:
    """Rebuild the non-persistent rotary buffers (not in any state dict, as in from_pretrained)."""
    persistent = set(m.state_dict())
    left_on_meta = [
        n for n, t in [*m.named_parameters(), *m.named_buffers()] if t.device.type == "meta"
    ]
    assert all(n not in persistent for n in left_on_meta), left_on_meta
    m.model.rotary_emb = LlamaRotaryEmbedding(config=m.config)


def test_load_into_materializes_meta_model(model: LlamaForCausalLM, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _sp_save(model, d)
    meta = _meta_model()
    result = sp.load_into(meta, d)
    assert result.ok
    assert all(p.device.type == "cpu" for p in meta.parameters())
    assert all(p.requires_grad for p in meta.parameters())
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert len(list(meta.parameters())) == len(list(model.parameters()))
    _finish_meta_model(meta)
    _assert_same_state(model, meta)
    assert torch.equal(_logits(meta), _logits(model))


@pytest.mark.parametrize("writer", ["save_pretrained", "save_torch_state_dict"])
def test_load_into_materializes_meta_model_from_hf_files(
    model: LlamaForCausalLM, tmp_path: Path, writer: str
) -> None:
    """Only one name of the tied pair is in the files; the other must follow it off meta."""
    d = tmp_path / "hf"
    if writer == "save_pretrained":
        model.save_pretrained(d, max_shard_size="20kB")
    else:
        d.mkdir()
        huggingface_hub.save_torch_state_dict(model.state_dict(), d, max_shard_size="20kB")
    meta = _meta_model()
    assert sp.load_into(meta, d).ok
    still_meta = [n for n, p in meta.named_parameters(remove_duplicate=False) if p.is_meta]
    assert still_meta == []
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    _finish_meta_model(meta)
    _assert_same_state(model, meta)
    assert torch.equal(_logits(meta), _logits(model))


class _DDPLike(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize("wrap", ["compile", "ddp"])
def test_a_wrapped_model_saves_the_model_s_own_keys(tmp_path: Path, wrap: str) -> None:
    """sp.save(torch.compile(model)) wrote _orig_mod.-prefixed keys, which from_pretrained
    took for an unrelated checkpoint (a randomly initialized model, no error)."""
    model = _model(0).eval()
    wrapped = torch.compile(model) if wrap == "compile" else _DDPLike(model)
    sp.save(wrapped, tmp_path / "ck")
    model.config.save_pretrained(tmp_path / "ck")
    sp.save(model, tmp_path / "plain")
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f, \
            safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as plain:
        assert sorted(f.keys()) == sorted(plain.keys()) and "model.norm.weight" in list(f.keys())
    again, info = LlamaForCausalLM.from_pretrained(tmp_path / "ck", output_loading_info=True)
    assert not any(info.values())
    ids = torch.arange(8).reshape(1, 8)
    assert torch.equal(again.eval()(ids).logits, model(ids).logits)
    assert sp.load_into(torch.compile(_model(1)) if wrap == "compile" else _DDPLike(_model(1)), tmp_path / "ck").ok


def test_a_folder_saved_over_by_save_pretrained_says_the_manifest_is_stale(tmp_path: Path) -> None:
    """save_pretrained into a shardpoint folder leaves shardpoint.json behind: the refusal
    is right (the manifest describes the old files), but it said 'truncated, padded or from
    another save' and 'the index is damaged', though nothing was."""
    from shardpoint._verify import verify_checkpoint

    sp.save(_model(0), tmp_path / "one")
    _model(1).save_pretrained(tmp_path / "one")
    with pytest.raises(sp.CorruptCheckpointError) as caught:
        sp.load(tmp_path / "one")
    assert str(caught.value).startswith(
        f"{tmp_path / 'one' / 'model.safetensors'} carries no shardpoint save_id (the manifest's save is ")
    assert str(caught.value).endswith(
        "): another program wrote it over this save's file after shardpoint.json, which now describes what was "
        "there before (transformers' save_pretrained into the same folder leaves it so). If the folder was saved "
        "over on purpose, remove shardpoint.json to read what it now holds; else restore the checkpoint from a copy")
    (tmp_path / "one" / "shardpoint.json").unlink()  # the way out it gives
    assert torch.equal(sp.load(tmp_path / "one")["model.embed_tokens.weight"], _model(1).model.embed_tokens.weight)

    sp.save(_model(0), tmp_path / "sharded")
    _model(1).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    report = verify_checkpoint(tmp_path / "sharded")
    assert not report.ok
    assert any("it names files the manifest does not list ('model-00001-of-" in p and "another program saved into "
               "this folder after shardpoint.json" in p for p in report.problems), report.problems
    # Sharded by shardpoint, then one file by save_pretrained (which removed the shards): the
    # missing shard is said to be another program's doing, not "copy the file back".
    sp.save(_model(0), tmp_path / "shards", max_shard_size="20KB")
    _model(1).save_pretrained(tmp_path / "shards")
    with pytest.raises(sp.MissingShardError) as caught:
        sp.load(tmp_path / "shards")
    assert str(caught.value).startswith(f"{tmp_path / 'shards' / 'model-00001-of-000'}")
    assert str(caught.value).endswith(
        ".safetensors is missing, and the folder holds 'model.safetensors', which this save did not write: another "
        "program wrote into the folder after shardpoint.json, which describes what was there before (transformers' "
        "save_pretrained into the same folder removes the shards it does not write and leaves it so). If the folder "
        "was saved over on purpose, remove shardpoint.json to read what it now holds; else restore the checkpoint "
        "from a copy")
    # An adapter's file beside the shards is no sign of that: a shard removed is one to copy back.
    sp.save(_model(0), tmp_path / "adapted", max_shard_size="20KB")
    save_file({"lora": torch.zeros(2)}, tmp_path / "adapted" / "adapter_model.safetensors")
    (tmp_path / "adapted" / "model-00002-of-00013.safetensors").unlink()
    with pytest.raises(sp.MissingShardError, match=r"model-00002-of-00013\.safetensors is missing: the checkpoint lists "
                                                   r"it but it is not there; the checkpoint is incomplete \(copy the file "
                                                   r"back or load another checkpoint\)"):
        sp.load(tmp_path / "adapted")
