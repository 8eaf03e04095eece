"""Text from a checkpoint made safe to show on a terminal (see ``_cli/output.py``).

Used by everything that prints: the CLI's output and the progress bars' descriptions.
"""

from __future__ import annotations

import re
import unicodedata

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Controls, format characters (bidi, zero-width), surrogates, line/paragraph separators."""

_SUSPECT = re.compile(r"[^\x20-\x7e]")
"""Every character that may need escaping (all but printable ASCII), judged one by one."""


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def needs_escape(ch: str) -> bool:
    """True for a character :func:`printable` escapes (rules: ``shardpoint._cli.output``)."""
    return unicodedata.category(ch) in _ESCAPED_CATEGORIES


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if not needs_escape(ch):
        return ch
    code = ord(ch)
    if ch in _SHORT:
        return _SHORT[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` with every character that could drive or spoof a terminal escaped.

    >>> printable("ok\\rFAKE \\x1b[2J\\u202eevil")
    'ok\\\\rFAKE \\\\x1b[2J\\\\u202eevil'
    >>> printable("model.layers.0.mlp.up_proj.weight \u00e9\u6a21")
    'model.layers.0.mlp.up_proj.weight \u00e9\u6a21'
    """
    text = str(text)
    if text.isascii() and text.isprintable():
        return text
    return _SUSPECT.sub(_escape_char, text)


def has_control(text: str, *, allow: str = "") -> bool:
    """True when ``text`` holds a character :func:`printable` would escape (other than ``allow``).

    >>> has_control("a\\nb", allow="\\n"), has_control("a\\x1bb")
    (False, True)
    """
    return any(ch not in allow and needs_escape(ch) for ch in text)
