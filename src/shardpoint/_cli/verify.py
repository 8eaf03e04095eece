"""Check that a checkpoint is whole, without loading it.

Checks that the manifest (or HF index) parses; every data file it lists exists with the
recorded size and a valid safetensors header; every tensor sits in its file with the
recorded dtype and shape; and, unless --quick, that the crc32c of every stored tensor
matches the one recorded at save time (read in bounded buffers, never a whole file).
Problems are collected for every file, not only the first. Foreign Hugging Face
safetensors checkpoints record no crc32c: only their structure is verified, and the
output says so.

Hugging Face .bin weights (pytorch_model.bin, or shards with pytorch_model.bin.index.json)
and single .bin/.pt files are checked as sp.load reads them: the CRC-32 of every record of
their zip archive (torch.save writes one), then the tensors' structure through
torch.load(weights_only=True), memory-mapped; never a full unpickle.

Files that are not checkpoint data (config.json, tokenizer files, README.md,
training_args.bin, optimizer.pt, ...) are listed as not checked. A file that looks like
data of the checkpoint but that it does not reference (a model-00003-of-00003.safetensors
missing from the index) is a warning.

Exit status: 0 whole, 1 damaged (every problem is listed; a read error of the disk too), 2
usage error, no checkpoint at the path, a store that cannot be reached or refuses access
(nothing was judged), or a .bin/.pt file that cannot be read without a full unpickle
(refused). With --json a failure prints {"error", "message", "path"} instead.

The --json object has the keys: path (as given), resolved (only for an hf:// reference:
the snapshot folder it names in the cache), format ("shardpoint", "hf-index", "hf-file",
"hf-bin", "torch-save"), ok, problems [str], warnings [str], notes [str], unchecked [file
name], files_checked, tensors_checked, bytes_checked (bytes compared against a crc32c or
CRC-32), checksums (true when stored bytes were checked against their checksums).
"""

from __future__ import annotations

import argparse
import errno

from .._format.companions import role
from .._sizes import human_size
from .._verify import VerifyReport, verify_checkpoint
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .main import (
    EXIT_DAMAGED,
    EXIT_OK,
    add_cache_dir,
    add_checkpoint_path,
    add_storage_options,
    fail,
    hub_storage_options,
    with_reference,
)
from .output import emit, emit_json

HELP = "check that a checkpoint is whole: files, sizes, headers and crc32c of every tensor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_path(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys above)")
    parser.add_argument("--quick", action="store_true", help="check structure only; skip crc32c")
    add_storage_options(parser)
    add_cache_dir(parser)


def run(args: argparse.Namespace) -> int:
    try:
        options = hub_storage_options(args.path, args.storage_options, args.cache_dir)
        report = verify_checkpoint(args.path, checksums=not args.quick, storage_options=options)
    except (CheckpointNotFoundError, UnsafePickleError, UnsupportedFormatError):
        raise  # exit 2: nothing to verify at that path, or a pickle it will not unpickle
    except (CorruptCheckpointError, StorageError) as exc:
        if isinstance(exc, StorageError) and exc.errno != errno.EIO:
            raise  # exit 2: the store could not be reached or refused (credentials, no bucket): nothing judged
        return fail(args, exc, EXIT_DAMAGED)
    # Any other CheckpointError (a bad argument, a missing dependency) is a usage error: exit 2.
    if args.json:
        emit_json(with_reference(to_json(report), args.path))
    else:
        emit(render(report, quick=args.quick))
    return EXIT_OK if report.ok else EXIT_DAMAGED


_JSON_FIELDS = ("ok", "problems", "warnings", "notes", "unchecked", "files_checked", "tensors_checked",
                "bytes_checked", "checksums")
"""The report's fields in ``--json``, under their own names (after ``path`` and ``format``)."""


def to_json(report: VerifyReport) -> dict[str, object]:
    return {"path": report.path, "format": report.kind, **{name: getattr(report, name) for name in _JSON_FIELDS}}


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


_PICKLED = ("hf-bin", "torch-save")


def render(report: VerifyReport, *, quick: bool) -> list[str]:
    """The human report, one item per line (``emit`` escapes them)."""
    lines = [
        f"{report.path}: {report.kind} checkpoint, {_plural(report.files_checked, 'data file')}"
    ]
    if report.kind in _PICKLED:
        lines[0] += " (torch.save files)"
    elif report.kind != "shardpoint":
        lines[0] += " (foreign: no crc32c recorded, structure checked only)"
    lines += [f"note: {n}" for n in report.notes]
    lines += [f"warning: {w}" for w in report.warnings]
    lines += [f"problem: {p}" for p in report.problems]
    if report.unchecked:
        names = [
            f"{n} (weights in another format; load does not read it)"
            if role(n, "pickle" if report.kind in _PICKLED else "safetensors") == "other-weights"
            else n
            for n in report.unchecked
        ]
        lines.append(f"not checked (not checkpoint data): {', '.join(names)}")
    if not report.ok:
        lines.append(
            f"FAILED: {_plural(len(report.problems), 'problem')}; the checkpoint is not whole"
        )
        return lines
    checked = f"{_plural(report.files_checked, 'file')}, {_plural(report.tensors_checked, 'stored tensor')}"
    if report.kind in _PICKLED:
        check, missing, matched = "CRC-32", "some files have no CRC-32", "the zip archives' CRC-32 matched"
    elif report.kind != "shardpoint":
        lines.append(f"OK: structure is whole ({checked}); stored bytes not checked (no crc32c)")
        return lines
    else:
        check, missing, matched = "crc32c", "some tensors have no crc32c", "crc32c matched"
    if quick:
        lines.append(f"OK: structure is whole ({checked}); {check} skipped (--quick)")
    elif not report.checksums:
        lines.append(f"OK: structure is whole ({checked}); {missing} (see warnings)")
    else:
        lines.append(f"OK: whole ({checked}); {matched} for {human_size(report.bytes_checked)}")
    return lines
