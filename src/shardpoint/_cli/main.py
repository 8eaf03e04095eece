"""The ``shardpoint`` command: ``shardpoint inspect PATH``, ``shardpoint verify PATH``, ...

Subcommands are registered in :data:`SUBCOMMANDS` (name -> module), not in an if/elif chain.
A subcommand module defines three names:

- ``HELP``: one line, shown by ``shardpoint --help``;
- ``add_arguments(parser)``: adds its arguments to its ``argparse`` sub-parser;
- ``run(args) -> int``: does the work and returns the exit code.

To add ``shardpoint demo``, write ``_cli/demo.py`` with those names and add one line below.
Modules are imported only when their subcommand runs (``--help`` imports them all).

Exit codes: 0 success; 1 the checkpoint is damaged (``verify``); 2 usage errors and errors
that stop a command before it can judge the checkpoint (path not found, unreadable input).
Errors are printed as one line, ``shardpoint: error: <message>``, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from .. import __version__
from ..errors import CheckpointError

SUBCOMMANDS: dict[str, str] = {
    "inspect": "shardpoint._cli.inspect",
    "verify": "shardpoint._cli.verify",
    "demo": "shardpoint._cli.demo",
    "convert": "shardpoint._cli.convert",
    "diff": "shardpoint._cli.diff",
}
"""Subcommand name -> module implementing it (``HELP``, ``add_arguments``, ``run``)."""

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2


def error(message: object) -> None:
    """Print ``shardpoint: error: <message>`` as one line on stderr."""
    text = " ".join(str(message).split("\n"))
    print(f"shardpoint: error: {text}", file=sys.stderr)


def storage_options_arg(text: str) -> dict[str, object]:
    """``--storage-options '{"key": ..., "client_kwargs": {"endpoint_url": ...}}'`` (JSON)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of fsspec filesystem options")
    return value


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-options",
        type=storage_options_arg,
        metavar="JSON",
        help="fsspec filesystem options for a URL path (s3://...), as a JSON object, e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}\'; S3 credentials '
        "also come from the usual AWS environment variables",
    )


def add_cache_dir(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir DIR``: the Hugging Face cache that ``hf://`` paths are looked up in."""
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="Hugging Face cache holding hf://org/name[@revision] paths (default: HF_HUB_CACHE, "
        "else $HF_HOME/hub); they are read from the cache only, never downloaded",
    )


def hub_storage_options(
    path: str, storage_options: dict[str, object] | None, cache_dir: str | None
) -> dict[str, object] | None:
    """``storage_options`` with ``cache_dir`` added for an ``hf://`` path (else unchanged)."""
    if cache_dir is None or not path.startswith("hf://"):
        return storage_options
    return {**(storage_options or {}), "cache_dir": cache_dir}


def _command_module(name: str) -> ModuleType:
    return importlib.import_module(SUBCOMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="shardpoint",
        description="Inspect and verify sharded safetensors checkpoints (shardpoint or Hugging Face).",
    )
    parser.add_argument("--version", action="version", version=f"shardpoint {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = _command_module(name)
        doc = (module.__doc__ or "").strip()
        command = sub.add_parser(
            name,
            help=module.HELP,
            description=doc or module.HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardpoint`` command; return its exit code (see the module docstring).

    >>> main(["--version"])  # doctest: +SKIP
    shardpoint 0.1.0
    0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        code: int = args._run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `shardpoint inspect ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except CheckpointError as exc:
        error(exc)
        return EXIT_USAGE
    except OSError as exc:
        error(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("shardpoint: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
