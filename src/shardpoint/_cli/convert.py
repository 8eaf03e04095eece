"""Convert a checkpoint to Hugging Face-layout safetensors (a shardpoint checkpoint).

Sources: a torch.save file (.pt/.pth/.bin/.ckpt; a nested training state converts whole,
one component per top-level key), a Hugging Face .bin sharded directory
(pytorch_model.bin.index.json), a safetensors checkpoint (shardpoint in any layout, or
Hugging Face) to reshard or cast, and a torch.distributed.checkpoint (DCP) directory (in
torchtitan's layout, model keys at the top level beside nested entries, the top-level
tensors are the component model: HF files and index). --component NAME (repeatable)
converts only the components named, e.g. --component model to publish the weights.
A chunked shardpoint checkpoint (a distributed save) is consolidated into whole tensors.

From a model folder, config.json, generation config, tokenizer and processor files, custom
code, README and license are copied beside the converted weights (the dtype config.json
names, where it names one, becomes --dtype's), so DST loads with from_pretrained as SRC did;
a Trainer's training state is not.

Tensors are streamed a batch at a time: memory stays about 64 MB (or the largest tensor),
whatever the size of the model. The output appears at DST only once it is complete.

Pickles are never unpickled without --trust-pickle: torch.save files are read with
torch.load(weights_only=True), and a file that needs more (custom classes) is refused, as
is DCP (its .metadata is a pickle). A torch.save file with a .safetensors sibling of the
same stem (model.pt beside model.safetensors) is read from the sibling; a note says so.

Exit status: 0 converted, 2 usage error or unreadable / refused input. With --json a
failure prints {"error", "message", "path"} instead.

The --json object has the keys: source (the file or directory read), source_format (as the
human line describes it), destination, components [name], tensors, tensor_bytes, files
{name: bytes}, seconds, notes [str].
"""

from __future__ import annotations

import argparse
import os

from .._convert import run_convert
from .._format.dtypes import parse_dtype
from .._sizes import human_size
from ..errors import InvalidArgumentError
from .main import EXIT_OK, add_cache_dir
from .output import emit, emit_json, note

HELP = "convert torch.save / HF .bin / DCP / safetensors checkpoints to sharded safetensors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src",
        help="file or directory to convert, or hf://org/name[@revision][/subfolder]: a "
        "repository in the local Hugging Face cache",
    )
    add_cache_dir(parser)
    parser.add_argument("dst", help="checkpoint directory to create")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest output file, e.g. 5GB or 500MiB (default 5GB)",
    )
    parser.add_argument(
        "--dtype",
        type=_dtype_name,
        metavar="{bf16,fp16,fp32,fp64}",
        help="cast every floating-point tensor to this dtype (integer tensors are kept; bfloat16, float16, "
        "half, ... as the Python API takes them)",
    )
    parser.add_argument(
        "--layout",
        choices=["hf"],
        default="hf",
        help="output layout (hf: whole tensors, HF file names)",
    )
    parser.add_argument(
        "--component",
        action="append",
        dest="components",
        metavar="NAME",
        help="convert only this component (repeatable), e.g. --component model to publish "
        "the weights alone; default all. A torchtitan-layout DCP checkpoint's top-level "
        "tensors are the component model, each nested entry (optimizer, train_state, ...) "
        "a component of its own",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow a full unpickle (runs code from the file): only for files you trust",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing checkpoint at DST"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes writing output files in parallel (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys above)")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="show a progress bar"
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.dst == "-" or args.src == "-":
        raise InvalidArgumentError(
            "'-' names no checkpoint here (a checkpoint is a folder of files, not a stream): give a path"
        )
    info, source = run_convert(
        args.src,
        args.dst,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        trust_pickle=args.trust_pickle,
        overwrite=args.overwrite,
        progress=args.progress,
        workers=args.workers,
        cache_dir=args.cache_dir,
        components=args.components,
    )
    tensors = sum(len(c.stored) for c in source.components)
    files = len(info.files)
    if args.json:
        emit_json({
            "source": source.spec.path,
            "source_format": source.describe(),
            "destination": os.fspath(args.dst),
            "components": [c.name for c in source.components],
            "tensors": tensors,
            "tensor_bytes": info.tensor_bytes,
            "files": dict(info.files),
            "seconds": round(info.seconds, 3),
            "notes": list(source.notes),
        })
        return EXIT_OK
    for message in source.notes:
        note(message)
    emit([
        f"converted {source.spec.path} ({source.describe()}) -> {os.fspath(args.dst)}: "
        f"{tensors} tensor{'s' if tensors != 1 else ''}, {human_size(info.tensor_bytes)} in "
        f"{files} file{'s' if files != 1 else ''} ({info.seconds:.1f} s)"
    ])
    return EXIT_OK


def _dtype_name(text: str) -> str:
    """``--dtype``: a floating-point dtype's name as ``sp.convert(dtype=)`` takes it."""
    try:
        parse_dtype(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
