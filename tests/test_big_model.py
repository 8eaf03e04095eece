"""Bounded-memory loading: meta models, device maps, dtype on the fly, provable coverage."""

from __future__ import annotations

import json
import os
import signal
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
    # Asked for, so strict=True loads; but the model cannot run, so not ok.
    assert result.kept_off_keys == ["3.weight", "3.bias"] and result.matched and not result.ok
    assert "left on the meta device as device_map asked" in result.summary()
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


def test_cast_load_goes_through_a_bounded_buffer(tmp_path):
    """A dtype cast on load is staged through max_buffer_bytes pieces and lands exactly."""
    torch.manual_seed(1)
    sd = {"big": torch.randn(1000, 257), "small": torch.randn(3)}
    sp.save(sd, tmp_path / "ck")
    out = sp.load(tmp_path / "ck", dtype=torch.bfloat16, max_buffer_bytes="4KiB")
    assert out["big"].dtype == torch.bfloat16
    assert torch.equal(out["big"], sd["big"].bfloat16())
    model = sp.empty_model(lambda: torch.nn.Linear(257, 1000))
    sd2 = {"weight": sd["big"], "bias": torch.randn(1000)}
    sp.save(sd2, tmp_path / "ck2")
    sp.load_into(model, tmp_path / "ck2", dtype=torch.float16, max_buffer_bytes=8192)
    assert torch.equal(model.weight, sd2["weight"].half())
    with pytest.raises(sp.InvalidSizeError, match="max_buffer_bytes=100 is too small"):
        sp.load(tmp_path / "ck", max_buffer_bytes=100)


_CGROUP_ROOT = "/sys/fs/cgroup/memory"

_LIMITED_CHILD = textwrap.dedent(
    """
    import os, sys, torch, shardpoint as sp
    path, cgroup, how = sys.argv[1], sys.argv[2], sys.argv[3]
    def build():
        return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(10)])
    model = sp.empty_model(build)
    # From here on every page this process allocates is charged to the limited group (v1
    # cgroups do not move earlier charges): the limit bounds exactly what the load adds.
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    if how == "shardpoint":
        sp.load_into(model, path)
    else:  # the classic two-copy load: allocate the model, torch.load a second copy, copy it in
        model.to_empty(device="cpu")
        model.load_state_dict(torch.load(os.path.join(path, "..", "model.pt"), weights_only=True))
    assert not any(p.isnan().any() for p in model.parameters())
    print("loaded")
    """
)


@pytest.fixture
def memory_cgroup(tmp_path):
    """A real memory-limited cgroup (v1 controller, as root); skipped where none can be made."""
    if not os.access(_CGROUP_ROOT, os.W_OK):
        pytest.skip(f"{_CGROUP_ROOT} is not writable here (needs root and the v1 memory controller)")
    group = os.path.join(_CGROUP_ROOT, f"shardpoint-test-{os.getpid()}-{tmp_path.name}")
    try:
        os.mkdir(group)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    yield group
    os.rmdir(group)


def test_load_under_a_real_memory_limit_never_needs_two_copies(tmp_path, memory_cgroup):
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(10)])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # 160 MiB
    sp.save(model.state_dict(), tmp_path / "ck")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    del model
    for name in ("ck/model.safetensors", "model.pt"):  # warm: the page cache is charged to us
        with open(tmp_path / name, "rb") as f:
            while f.read(16 << 20):
                pass
    limit = model_bytes + 96 * 2**20
    with open(os.path.join(memory_cgroup, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))

    def run(how: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _LIMITED_CHILD, str(tmp_path / "ck"), memory_cgroup, how],
            capture_output=True, text=True, timeout=120,
        )

    ours = run("shardpoint")
    assert ours.returncode == 0 and ours.stdout.strip() == "loaded", ours.stderr[-2000:]
    # The same limit kills a load that holds two copies: the limit really bites.
    naive = run("two copies")
    assert naive.returncode == -signal.SIGKILL, (naive.returncode, naive.stderr[-2000:])
