"""Bounded-memory loading: meta models, device maps, dtype on the fly, provable coverage."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import shardpoint as sp


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8), torch.nn.LayerNorm(8))


def test_nan_filled_model_has_no_nan_left(tmp_path):
    torch.manual_seed(0)
    src = _mlp()
    sp.save(src.state_dict(), tmp_path / "ck", max_shard_size=2000)
    dst = _mlp()
    with torch.no_grad():
        for p in dst.state_dict().values():
            p.fill_(float("nan"))
    sp.load_into(dst, tmp_path / "ck")
    for name, value in dst.state_dict().items():
        assert not torch.isnan(value).any(), name
        assert torch.equal(value, src.state_dict()[name])


def test_checkpoint_missing_a_tensor_raises_naming_it(tmp_path):
    sd = _mlp().state_dict()
    del sd["2.bias"]
    sp.save(sd, tmp_path / "ck")
    with pytest.raises(sp.LoadMismatchError, match=r"missing from the checkpoint: '2.bias'"):
        sp.load_into(_mlp(), tmp_path / "ck")


def test_meta_model_materialized_with_dtype_and_device_map(tmp_path):
    torch.manual_seed(0)
    src = _mlp()
    sp.save(src.state_dict(), tmp_path / "ck")
    model = sp.empty_model(_mlp)
    assert model[0].weight.device.type == "meta"
    result = sp.load_into(model, tmp_path / "ck", dtype=torch.bfloat16, device_map={"": "cpu", "3": "meta"})
    assert result.ok
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.device.type == "cpu"
    assert torch.equal(model[0].weight, src[0].weight.bfloat16())
    assert model[3].weight.device.type == "meta"  # kept off this process by the device map
    assert result.bytes_read == sum(
        v.numel() * v.element_size() for k, v in src.state_dict().items() if not k.startswith("3.")
    )


_CHILD = textwrap.dedent(
    """
    import json, resource, sys, torch, shardpoint as sp
    path = sys.argv[1]
    dim = int(sys.argv[2])
    def build():
        return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(8)])
    model = sp.empty_model(build)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sp.load_into(model, path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak}))
    """
)


def test_meta_load_peak_rss_is_model_plus_bounded_buffers(tmp_path):
    dim = 2048  # 8 x 16 MiB = 128 MiB of fp32 weights
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(8)])
    sp.save(model.state_dict(), tmp_path / "ck", max_shard_size="40MB")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "ck"), str(dim)],
        capture_output=True, text=True, check=True,
    )
    stats = json.loads(out.stdout)
    growth = stats["peak"] - stats["base"]
    # One copy of the model plus bounded buffers: never two copies, never a whole shard mapped.
    assert growth <= model_bytes + 64 * 2**20, (growth, model_bytes)
