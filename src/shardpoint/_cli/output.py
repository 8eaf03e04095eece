"""Everything the ``shardpoint`` command prints goes through here, escaped.

Tensor names, file names, manifest strings and error messages quoting them come from the
checkpoint, i.e. from whoever wrote it. Printed raw, ``"\\x1b]0;pwned\\x07"`` retitles the
terminal, ``"\\x1b[2J"`` clears it, ``"ok\\rFAKE"`` overwrites a line and ``"\\u202e"``
reverses the text after it. So human output is written one line at a time through
:func:`emit`, and every line is passed through :func:`printable`: each C0 control
character (newline and tab included: a line we print never holds one), DEL, each C1
control, each Unicode format character (bidi overrides and isolates, zero-width
characters, ...), line and paragraph separators and lone surrogates is replaced by its
Python escape (``\\x1b``, ``\\u202e``, ``\\n``). Other characters (accents, CJK, emoji) are kept.
A backslash is not escaped, so the text stays readable; ``--json`` output is the exact
value (``json.dumps`` escapes every non-ASCII character).

While a subcommand runs, ``main`` also puts a guard around ``sys.stdout`` that escapes the
same characters in anything printed directly (except the newline ending a line), so a
command that forgets :func:`emit` still cannot send an escape sequence to the terminal.
"""

from __future__ import annotations

import json
import math
import os
import sys
import unicodedata
from collections.abc import Iterable
from typing import IO, Any

from .._printable import has_control, needs_escape, printable

__all__ = ["GuardedStream", "emit", "emit_json", "error", "has_control", "needs_escape", "note", "printable"]

def cell_width(text: str) -> int:
    """Columns ``text`` takes on a terminal: two for a wide (CJK) character, none for a
    combining mark.

    >>> cell_width("embed"), cell_width("模型.weight"), cell_width("e\u0301")
    (5, 11, 1)
    """
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def table_rows(rows: list[list[str]]) -> list[str]:
    """``rows`` of cells (escaped already) in columns aligned by :func:`cell_width`, two
    spaces apart, trailing blanks cut; an empty cell of a first column shows as ''."""
    widths = [max(cell_width(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c + " " * (w - cell_width(c)) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def emit(lines: Iterable[str], stream: IO[str] | None = None) -> None:
    """Print human output, one escaped line per item (an item never spans two lines)."""
    out = stream if stream is not None else sys.stdout
    out.write("".join(printable(line) + "\n" for line in lines))


def emit_json(doc: Any) -> None:
    """Print ``doc`` as indented, strictly valid JSON (``json.dumps`` escapes what needs it;
    a float that is not finite, which JSON cannot hold, is written as the string ``"nan"``,
    ``"inf"`` or ``"-inf"``, as ``diff --json`` writes them).

    >>> emit_json({"loss": float("nan"), "best": [float("-inf"), 1.5]})
    {
      "loss": "nan",
      "best": [
        "-inf",
        1.5
      ]
    }
    """
    print(json.dumps(_finite(doc), indent=2, allow_nan=False))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def error(message: object) -> None:
    """Print ``shardpoint: error: <message>`` as one escaped line on stderr."""
    text = " ".join(str(message).split("\n"))
    print(f"shardpoint: error: {printable(text)}", file=sys.stderr)


def note(message: object) -> None:
    """Print ``shardpoint: note: <message>`` as one escaped line on stderr."""
    text = " ".join(str(message).split("\n"))
    print(f"shardpoint: note: {printable(text)}", file=sys.stderr)


class GuardedStream:
    """A text stream that escapes what :func:`printable` escapes, keeping newlines.

    Installed over ``sys.stdout`` while a subcommand runs (see the module docstring).
    """

    def __init__(self, inner: IO[str]) -> None:
        self.inner = inner
        self.reader_left = False
        """The reader of the pipe left (``shardpoint verify ... --json | head -2``): the rest of
        the output goes nowhere, and the command runs on to its own exit code (a damaged
        checkpoint must not exit 0 because the reader stopped reading)."""

    def write(self, text: str) -> int:
        if not self.reader_left:
            try:
                self.inner.write("\n".join(printable(part) for part in text.split("\n")))
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self.reader_left:
            try:
                self.inner.flush()
            except BrokenPipeError:
                self._reader_left()

    def _reader_left(self) -> None:
        self.reader_left = True
        try:  # what is still buffered, and Python's flush at exit, go to /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.inner.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
