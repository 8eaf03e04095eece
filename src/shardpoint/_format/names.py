"""File and component names that may appear in untrusted indexes and manifests."""

from __future__ import annotations

import re

from ..errors import InvalidStateError, UnsafePathError

_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
_RESERVED = {"shardpoint", "latest"}


def check_file_name(name: object, *, where: str) -> str:
    """Accept only a plain basename: no separators, no ``..``, no URL, no NUL, not absolute."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or ":" in name
        or name.startswith("~")
        or len(name) > 255
    ):
        raise UnsafePathError(
            f"{where}: file name {str(name)[:100]!r} is not a plain file name inside the "
            "checkpoint directory; refusing to follow it (the index or manifest is damaged or forged)"
        )
    return name


def check_component_name(name: object, *, where: str) -> str:
    """Component names become file prefixes: letters, digits, ``_ . -``, not reserved."""
    if not isinstance(name, str) or not _COMPONENT_RE.match(name) or name in _RESERVED:
        raise UnsafePathError(f"{where}: component name {str(name)[:100]!r} is not allowed")
    return name


def validate_component_key(name: object) -> str:
    """Check a top-level key of the state passed to ``save``."""
    if not isinstance(name, str) or not _COMPONENT_RE.match(name) or name in _RESERVED:
        raise InvalidStateError(
            f"top-level key {name!r} of the state cannot name a component: components become "
            "file prefixes, so use letters, digits, '_', '.' or '-' (not 'shardpoint' or 'latest')"
        )
    return name
