"""The ``shardpoint`` command's entry point, outside the package on purpose.

Importing anything under ``shardpoint`` imports torch first (a second or two). A Ctrl-C in
that time printed a traceback from deep inside torch's import, or was swallowed by it and
the command ran on; here it is held until the import is done, then the command exits 130
with one line, as it does when interrupted later.
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    interrupted: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    except ValueError:  # not the main thread: nothing to hold
        previous = None
    try:
        from shardpoint._cli.main import main as run
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if interrupted:
        sys.stderr.write("shardpoint: interrupted\n")
        raise SystemExit(130)
    raise SystemExit(run())
