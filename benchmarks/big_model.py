"""Big models on small machines: load a >= 4 GB checkpoint into a meta-built model, and convert
a >= 4 GB torch.save file, measuring time and peak RSS against the usual ways of doing it.

Every call runs in a fresh spawned process (so its peak RSS is its own), interleaved with its
peers for one discarded warm-up round plus ``--rounds`` timed rounds, caches dropped before
each cold call; medians. The model is a real ``transformers`` ``LlamaForCausalLM`` (random
fp32 weights) so that ``from_pretrained`` is one of the peers.

LOAD (into a model built on ``meta``, every parameter materialized on the CPU):

| key | how |
|---|---|
| ``sp`` | ``sp.load_into(sp.empty_model(build), ckpt)`` (crc32c verified) |
| ``hf`` | ``LlamaForCausalLM.from_pretrained(ckpt)`` (transformers' meta-device loading) |
| ``st`` | ``safetensors.torch.load_file`` of each shard + ``load_state_dict(assign=True)`` |
| ``torch`` | ``torch.load(mmap=True, weights_only=True)`` + ``load_state_dict(assign=True)`` |

Each loader then touches one element per page of every parameter (lazy, mmap-backed peers
really read the file there) and checks a fingerprint against the saved weights.

CONVERT a ``torch.save`` file to HF-layout safetensors shards:

| key | how |
|---|---|
| ``sp`` | ``sp.convert(model.pt, out)`` (streaming, one batch at a time) |
| ``hub`` | ``torch.load(model.pt)`` whole, then ``huggingface_hub.save_torch_state_dict`` |

    .venv/bin/python benchmarks/big_model.py              # ~4.2 GB, 3 rounds (~10 min)
    .venv/bin/python benchmarks/big_model.py --quick      # ~0.5 GB, 1 round: smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    TargetCheck,
    can_drop_caches,
    current_rss,
    drop_caches,
    files_under,
    log_err,
    peak_rss,
    read_into_cache,
    remove,
    reset_peak_rss,
    sync,
)

import shardpoint as sp

warnings.filterwarnings("ignore")

SHARD_SIZE = "2GB"
PAGE_FLOATS = 1024  # one fp32 element per 4 KiB page


def llama_config(gb: float) -> Any:
    """A Llama config whose fp32 weights take about ``gb`` GB (untied embeddings)."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 2048, 5504, 32000
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
    fixed = (2 * vocab * hidden + hidden) * 4
    layers = max(1, round((gb * 1e9 - fixed) / per_layer))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build_meta_model(config: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return sp.empty_model(lambda: LlamaForCausalLM(config))


def fingerprint(model: torch.nn.Module) -> float:
    """Touches one element of every page of every parameter; a sum that any lost byte moves."""
    total = 0.0
    with torch.no_grad():
        for p in model.parameters():
            total += float(p.detach().reshape(-1)[::PAGE_FLOATS].double().sum())
    return total


# ------------------------------------------------------------------------------ loaders


def load_sp(config: Any, ckpt: str, pt: str) -> torch.nn.Module:
    model = build_meta_model(config)
    sp.load_into(model, ckpt)
    return model


def load_hf(config: Any, ckpt: str, pt: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)


def load_st(config: Any, ckpt: str, pt: str) -> torch.nn.Module:
    import safetensors.torch

    model = build_meta_model(config)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors"):
            state.update(safetensors.torch.load_file(os.path.join(ckpt, name)))
    model.load_state_dict(state, strict=False, assign=True)
    return model


def load_torch_mmap(config: Any, ckpt: str, pt: str) -> torch.nn.Module:
    model = build_meta_model(config)
    state = torch.load(pt, mmap=True, weights_only=True)
    model.load_state_dict(state, strict=False, assign=True)
    return model


LOADERS: dict[str, tuple[str, Callable[[Any, str, str], torch.nn.Module]]] = {
    "sp": ("sp.load_into(meta model)", load_sp),
    "hf": ("transformers from_pretrained", load_hf),
    "st": ("safetensors load_file + assign", load_st),
    "torch": ("torch.load(mmap) + assign", load_torch_mmap),
}


def convert_sp(pt: str, out: str) -> None:
    sp.convert(pt, out, max_shard_size=SHARD_SIZE)


def convert_hub(pt: str, out: str) -> None:
    from huggingface_hub import save_torch_state_dict

    state = torch.load(pt, weights_only=True)
    os.makedirs(out)
    save_torch_state_dict(state, out, max_shard_size=SHARD_SIZE)


CONVERTERS: dict[str, tuple[str, Callable[[str, str], None]]] = {
    "sp": ("sp.convert (streaming)", convert_sp),
    "hub": ("torch.load whole + hub save", convert_hub),
}


# ------------------------------------------------------------------------ child processes


def _child(job: str, key: str, args: tuple[Any, ...], conn: Any) -> None:
    """In a fresh process: one load or one convert, its time and its peak RSS."""
    try:
        torch.set_num_threads(2)
        if job == "load":
            import transformers  # noqa: F401  (import cost is not part of the load)

            config, ckpt, pt = args
            build_meta_model(config)  # warm the model class's code paths
            before = current_rss()
            reset = reset_peak_rss()
            started = time.perf_counter()
            model = LOADERS[key][1](config, ckpt, pt)
            touched = fingerprint(model)
            seconds = time.perf_counter() - started
            peak = peak_rss()
            meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
            conn.send({"seconds": seconds, "before": before, "peak": peak, "reset": reset,
                       "fingerprint": touched, "meta_left": meta[:5]})
        else:
            pt, out = args
            before = current_rss()
            reset = reset_peak_rss()
            started = time.perf_counter()
            CONVERTERS[key][1](pt, out)
            sync()
            seconds = time.perf_counter() - started
            conn.send({"seconds": seconds, "before": before, "peak": peak_rss(), "reset": reset})
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        conn.close()


def run_child(job: str, key: str, args: tuple[Any, ...]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(job, key, args, child))
    proc.start()
    child.close()
    try:
        got = parent.recv()
    except EOFError:
        got = {"error": f"the child process died (exit code {proc.exitcode})"}
    proc.join()
    if "error" in got:
        raise RuntimeError(f"{job} {key} failed: {got['error']}")
    return got


# ------------------------------------------------------------------------------- sections


def load_rounds(
    config: Any, ckpt: str, pt: str, expected: float, rounds: int, cold: bool
) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    files = [*files_under(ckpt), pt]
    for round_no in range(rounds + 1):
        parts = []
        for key in LOADERS:
            if cold:
                drop_caches(files)
            else:
                read_into_cache(files)
            sync()
            got = run_child("load", key, (config, ckpt, pt))
            if got["meta_left"]:
                raise RuntimeError(f"{key} left parameters on meta: {got['meta_left']}")
            if abs(got["fingerprint"] - expected) > 1e-6 * max(1.0, abs(expected)):
                raise RuntimeError(f"{key} loaded different weights: {got['fingerprint']} != {expected}")
            if round_no:
                results.setdefault(key, []).append(got)
            parts.append(f"{key} {got['seconds']:.2f}s")
        tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
        log_err(f"  [load {'cold' if cold else 'warm'}] {tag}: " + "  ".join(parts))
    return results


def convert_rounds(pt: str, root: str, rounds: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    for round_no in range(rounds + 1):
        parts = []
        for key in CONVERTERS:
            out = os.path.join(root, f"convert-{key}")
            remove(out)
            drop_caches([pt])
            sync()
            got = run_child("convert", key, (pt, out))
            if round_no:
                results.setdefault(key, []).append(got)
            parts.append(f"{key} {got['seconds']:.2f}s")
        tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
        log_err(f"  [convert] {tag}: " + "  ".join(parts))
    return results


def median(runs: list[dict[str, Any]], field: str) -> float:
    return statistics.median(r[field] for r in runs)


def table(title: str, labels: dict[str, str], runs: dict[str, list[dict[str, Any]]],
          model_bytes: int, baseline: str) -> str:
    width = max(len(v) for v in labels.values())
    head = (f"{'':{width}}  {'median s':>9} {'GB/s':>6} {'vs sp':>7}  {'peak RSS MB':>11} "
            f"{'added MB':>9} {'added-model MB':>14}")
    lines = [title, head, "-" * len(head)]
    base = median(runs[baseline], "seconds")
    for key, label in labels.items():
        sec = median(runs[key], "seconds")
        peak = median(runs[key], "peak")
        added = statistics.median(r["peak"] - r["before"] for r in runs[key])
        lines.append(
            f"{label:{width}}  {sec:9.2f} {model_bytes / sec / 1e9:6.2f} {sec / base:6.2f}x  "
            f"{peak / 1e6:11.0f} {added / 1e6:9.0f} {(added - model_bytes) / 1e6:14.0f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main


def make_checkpoint(config: Any, root: str, seed: int) -> tuple[str, str, int, float]:
    """Random weights saved twice: as HF-layout safetensors (ours) and as one torch.save file."""
    from transformers import LlamaForCausalLM

    model = sp.empty_model(lambda: LlamaForCausalLM(config))
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(p.shape, generator=gen) * 0.02 for name, p in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ckpt = os.path.join(root, "llama")
    sp.save(state, ckpt, max_shard_size=SHARD_SIZE)
    config.save_pretrained(ckpt)
    pt = os.path.join(root, "llama.pt")
    torch.save(state, pt)
    model.load_state_dict(state, assign=True)
    expected = fingerprint(model)
    return ckpt, pt, nbytes, expected


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.2, help="fp32 weights to load (GB, 10^9)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--dir", default=None, help="scratch directory parent (default /tmp)")
    parser.add_argument("--quick", action="store_true", help="0.5 GB, 1 round: a smoke run")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.gb, args.rounds = 0.5, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="shardpoint-bigmodel-", dir=args.dir)
    try:
        config = llama_config(args.gb)
        log_err("building the checkpoint ...")
        ckpt, pt, nbytes, expected = make_checkpoint(config, root, args.seed)
        print(f"shardpoint {sp.__version__}, torch {torch.__version__}; {os.cpu_count()} CPUs; "
              f"drop_caches {'yes' if can_drop_caches() else 'no (fadvise fallback)'}")
        print(f"model: LlamaForCausalLM, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
              f"fp32: {nbytes / 1e9:.3f} GB in {SHARD_SIZE} shards; 1 warm-up + {args.rounds} rounds, "
              "interleaved, a fresh process per call; medians")
        cold = load_rounds(config, ckpt, pt, expected, args.rounds, cold=True)
        warm = load_rounds(config, ckpt, pt, expected, args.rounds, cold=False)
        conv = convert_rounds(pt, root, args.rounds)

        labels = {k: v[0] for k, v in LOADERS.items()}
        print()
        print(table(f"LOAD into a meta-built model, cold (caches dropped), {nbytes / 1e9:.2f} GB",
                    labels, cold, nbytes, "sp"))
        print()
        print(table(f"LOAD into a meta-built model, warm (files in page cache), {nbytes / 1e9:.2f} GB",
                    labels, warm, nbytes, "sp"))
        print()
        print(table(f"CONVERT torch.save -> HF safetensors, {nbytes / 1e9:.2f} GB (added-model: RSS "
                    "added minus the model's bytes)", {k: v[0] for k, v in CONVERTERS.items()},
                    conv, nbytes, "sp"))
        print("  peak RSS includes the interpreter and libraries; added = peak - RSS just before the call")

        sp_added = max(max(r["peak"] - r["before"] for r in runs["sp"]) for runs in (cold, warm))
        checks = [
            TargetCheck("meta load: peak RSS added - model bytes (worst run)",
                        (sp_added - nbytes) / 2**20, "<=", 256, " MiB"),
            TargetCheck("convert: peak RSS of the whole process (worst run)",
                        max(r["peak"] for r in conv["sp"]) / 2**30, "<=", 1, " GiB"),
        ]
        print("\nTARGETS")
        for check in checks:
            print(check.line())
        for name, runs in (("cold", cold), ("warm", warm)):
            ratios = ", ".join(f"{k} {median(runs[k], 'seconds') / median(runs['sp'], 'seconds'):.2f}x"
                               for k in LOADERS if k != "sp")
            print(f"  {name} load time vs sp (no target): {ratios}")
        failed = sum(not c.passed for c in checks)
        print(f"\n{len(checks) - failed}/{len(checks)} targets met; run took "
              f"{time.perf_counter() - started:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "load_cold": cold, "load_warm": warm, "convert": conv,
                           "targets": [c.to_json() for c in checks]}, f, indent=2)
    finally:
        if args.keep:
            log_err(f"kept {root}")
        else:
            remove(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
