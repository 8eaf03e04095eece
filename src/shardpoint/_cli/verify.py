"""Check that a checkpoint is whole, without loading it.

Checks that the manifest (or HF index) parses; every data file it lists exists with the
recorded size and a valid safetensors header; every tensor sits in its file with the
recorded dtype and shape; and, unless --quick, that the crc32c of every stored tensor
matches the one recorded at save time (read in bounded buffers, never a whole file).
Problems are collected for every file, not only the first. Files the checkpoint does not
account for are reported as warnings. Foreign Hugging Face checkpoints record no crc32c:
only their structure is verified, and the output says so.

Exit status: 0 whole, 1 damaged (every problem is listed), 2 usage error or no checkpoint
at the path.

The --json object has the keys: path, format ("shardpoint", "hf-index", "hf-file"), ok,
problems [str], warnings [str], files_checked, tensors_checked, bytes_checked (bytes
compared against crc32c), checksums (true when stored bytes were checked against crc32c).
"""

from __future__ import annotations

import argparse
import json

from .._sizes import human_size
from .._verify import VerifyReport, verify_checkpoint
from ..errors import CheckpointError, CheckpointNotFoundError
from .main import (
    EXIT_DAMAGED,
    EXIT_OK,
    add_cache_dir,
    add_storage_options,
    error,
    hub_storage_options,
)

HELP = "check that a checkpoint is whole: files, sizes, headers and crc32c of every tensor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        help="checkpoint directory (shardpoint or Hugging Face) or .safetensors file, or an "
        "fsspec URL of either (s3://bucket/run/step-100), or hf://org/name[@revision]: a "
        "repository in the local Hugging Face cache",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys above)")
    parser.add_argument("--quick", action="store_true", help="check structure only; skip crc32c")
    add_storage_options(parser)
    add_cache_dir(parser)


def run(args: argparse.Namespace) -> int:
    try:
        options = hub_storage_options(args.path, args.storage_options, args.cache_dir)
        report = verify_checkpoint(args.path, checksums=not args.quick, storage_options=options)
    except CheckpointNotFoundError:
        raise  # exit 2: nothing to verify at that path
    except CheckpointError as exc:
        error(exc)
        return EXIT_DAMAGED
    if args.json:
        print(json.dumps(to_json(report), indent=2))
    else:
        print(render(report, quick=args.quick))
    return EXIT_OK if report.ok else EXIT_DAMAGED


def to_json(report: VerifyReport) -> dict[str, object]:
    return {
        "path": report.path,
        "format": report.kind,
        "ok": report.ok,
        "problems": report.problems,
        "warnings": report.warnings,
        "files_checked": report.files_checked,
        "tensors_checked": report.tensors_checked,
        "bytes_checked": report.bytes_checked,
        "checksums": report.checksums,
    }


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def render(report: VerifyReport, *, quick: bool) -> str:
    lines = [
        f"{report.path}: {report.kind} checkpoint, {_plural(report.files_checked, 'data file')}"
    ]
    if report.kind != "shardpoint":
        lines[0] += " (foreign: no crc32c recorded, structure checked only)"
    lines += [f"warning: {w}" for w in report.warnings]
    lines += [f"problem: {p}" for p in report.problems]
    if not report.ok:
        lines.append(
            f"FAILED: {_plural(len(report.problems), 'problem')}; the checkpoint is not whole"
        )
        return "\n".join(lines)
    checked = f"{_plural(report.files_checked, 'file')}, {_plural(report.tensors_checked, 'stored tensor')}"
    if report.kind != "shardpoint":
        lines.append(f"OK: structure is whole ({checked}); stored bytes not checked (no crc32c)")
    elif quick:
        lines.append(f"OK: structure is whole ({checked}); crc32c skipped (--quick)")
    elif not report.checksums:
        lines.append(
            f"OK: structure is whole ({checked}); some tensors have no crc32c (see warnings)"
        )
    else:
        lines.append(
            f"OK: whole ({checked}); crc32c matched for {human_size(report.bytes_checked)}"
        )
    return "\n".join(lines)
