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
With ``--json`` (``inspect``, ``verify``, ``diff``) a failure also prints one JSON object on
stdout, ``{"error": <exception class name>, "message": <text>, "path": <the path it is
about, or null>}``, with the same exit code; usage errors too (``"error": "UsageError"``).

Everything printed for people goes through :mod:`shardpoint._cli.output`, which escapes
control and format characters coming from the checkpoint (see there).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from .._version import __version__
from ..errors import CheckpointError, InsufficientMemoryError
from . import output
from .output import printable

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


error = output.error
"""Print ``shardpoint: error: <message>`` as one escaped line on stderr."""


class UsageError(Exception):
    """A command line argparse refused: its message, the usage and the (sub)command's name."""

    def __init__(self, message: str, usage: str, prog: str) -> None:
        super().__init__(message)
        self.usage = usage
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse with its messages escaped, and usage errors raised instead of printed.
    Options are taken whole only: ``--js`` for ``--json`` would leave a script's usage
    error without its JSON object (``--json`` is looked for before parsing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            stream = file if file is not None else sys.stdout
            stream.write("\n".join(output.printable(line) for line in message.split("\n")))

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage(), self.prog)


def json_error(exc: BaseException, path: str | None) -> dict[str, object]:
    """The ``--json`` object of a failure (see the module docstring)."""
    message = str(exc)
    if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
        if exc.filename and exc.strerror:
            message = f"{exc.filename}: {exc.strerror}"
        path = os.fspath(exc.filename) if exc.filename else path
    return {"error": type(exc).__name__, "message": message, "path": path}


def _error_path(args: argparse.Namespace, message: str) -> str | None:
    """The path argument a failure is about: the command's only one, or the one it names."""
    paths = [p for p in (getattr(args, name, None) for name in ("path", "a", "b", "src", "dst")) if p is not None]
    if len(paths) == 1:
        return str(paths[0])
    named = [str(p) for p in paths if str(p) and str(p) in message]
    if "'' is empty" in message and "" in (str(p) for p in paths):
        return ""  # the empty one, not the other argument
    return max(named, key=len) if named else None


def storage_options_arg(text: str) -> dict[str, object]:
    """``--storage-options '{"key": ..., "client_kwargs": {"endpoint_url": ...}}'`` (JSON)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of fsspec filesystem options")
    return value


def add_checkpoint_path(parser: argparse.ArgumentParser) -> None:
    """The positional ``path`` of a command that reads one checkpoint (``inspect``, ``verify``)."""
    what = "checkpoint directory (shardpoint or Hugging Face) or .safetensors file"
    where = "an fsspec URL of either (s3://bucket/run/step-100)"
    parser.add_argument("path", help=f"{what}, or {where}, or hf://org/name[@revision]: a repository in "
                        "the local Hugging Face cache")


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
    parser = _Parser(
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


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a job scheduler's stop) while a command runs: unwound as Ctrl-C is,
    so a ``convert`` removes its unfinished destination instead of leaving it hidden."""


def _terminate_as_interrupt() -> Any:
    """Make SIGTERM raise :class:`Terminated` in the main thread; the previous handler (to put
    back), or None where none can be set (not the main thread)."""
    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        return signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardpoint`` command; return its exit code (see the module docstring).

    >>> main(["--version"])  # doctest: +ELLIPSIS
    shardpoint ...
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.stderr is None:  # started with stderr closed (`2>&-`): print(file=None) would write to stdout
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    wants_json = "--json" in argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        if wants_json:
            print(json.dumps({"error": "UsageError", "message": str(exc), "path": None}, indent=2))
        output.emit(exc.usage.rstrip("\n").split("\n"), sys.stderr)
        output.emit([f"{exc.prog}: error: {exc}"], sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version: argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    terminate = _terminate_as_interrupt()
    if sys.stdout is None:  # started with stdout closed (`shardpoint inspect X >&-`): output goes nowhere
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    stdout = sys.stdout
    sys.stdout = output.GuardedStream(stdout)
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning
    try:
        code: int = args._run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `shardpoint inspect ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout.fileno())
        return EXIT_OK
    except (CheckpointError, OSError) as exc:
        return fail(args, exc, EXIT_USAGE)
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise  # a bug of ours: its traceback is what a report needs
        return fail(args, InsufficientMemoryError(
            f"this machine ran out of memory: {_first_line(exc)}; free memory, or work on a machine with more"), EXIT_USAGE)
    except Terminated:
        _stopped(args, "Terminated", "terminated (SIGTERM) before it finished")
        print("shardpoint: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        _stopped(args, "KeyboardInterrupt", "interrupted (Ctrl-C) before it finished")
        print("shardpoint: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout
        warnings.showwarning = shown
        if terminate is not None:
            signal.signal(signal.SIGTERM, terminate)


def _stopped(args: argparse.Namespace, kind: str, message: str) -> None:
    """With --json, the error object of a command stopped by a signal (stdout held nothing)."""
    if getattr(args, "json", False):
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.write(json.dumps({"error": kind, "message": message, "path": _error_path(args, message)},
                                        indent=2) + "\n")
            sys.stdout.flush()


def _out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: Python's MemoryError, or torch's (a RuntimeError from its allocator)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "DefaultCPUAllocator" in text or "tried to allocate" in text


def _first_line(exc: BaseException) -> str:
    return printable((str(exc).strip().splitlines() or [type(exc).__name__])[0])


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: Any = None, line: str | None = None) -> None:
    """A warning of the library (a sibling file read instead, values past a dtype's range)
    as one escaped ``shardpoint: warning:`` line, not Python's two lines naming our source."""
    output.emit([f"shardpoint: warning: {' '.join(str(message).split())}"], sys.stderr)


def with_reference(doc: dict[str, Any], given: str) -> dict[str, Any]:
    """``doc`` (``inspect`` / ``verify --json``) with ``path`` the ``hf://`` reference given and
    ``resolved`` the snapshot folder it named; other paths as they are."""
    if not str(given).startswith("hf://") or doc["path"] == given:
        return doc
    return {"path": given, "resolved": doc["path"], **{k: v for k, v in doc.items() if k != "path"}}


def fail(args: argparse.Namespace, exc: BaseException, code: int) -> int:
    """Report a failure that stopped a command: one line on stderr, and with ``--json`` the
    JSON object on stdout (see the module docstring); return ``code``."""
    doc = json_error(exc, None)
    if hasattr(args, "overwrite"):  # the message of the Python API, told in the command's terms
        doc["message"] = str(doc["message"]).replace("overwrite=True", "--overwrite")
    if doc["path"] is None:
        doc["path"] = _error_path(args, str(doc["message"]))
    if getattr(args, "json", False):
        print(json.dumps(doc, indent=2))
    error(doc["message"])
    return code


if __name__ == "__main__":
    sys.exit(main())
