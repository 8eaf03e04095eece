"""File and component names that may appear in untrusted indexes and manifests."""

from __future__ import annotations

import re

from ..errors import InvalidStateError, UnsafePathError

_COMPONENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
"""A component name, whole (``fullmatch``: ``$`` would let a trailing newline through)."""
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


TMP_MARKER = ".tmp-"
"""In the name of a hidden directory or file a local save writes before its commit renames
it into place (``.<name>.tmp-<hex>``)."""


def is_tmp_name(name: str) -> bool:
    """Whether ``name`` is a save's temporary (hidden, uncommitted) directory or file.

    >>> is_tmp_name(".ckpt.tmp-0a1b"), is_tmp_name("ckpt")
    (True, False)
    """
    return name.startswith(".") and TMP_MARKER in name


RESERVED_TENSOR_NAME = "__metadata__"
"""The safetensors header's key for the file's metadata: no tensor may be named so."""


def check_tensor_name(name: object, *, where: str) -> str:
    """Refuse a tensor name that a safetensors file cannot hold, naming it.

    The format stores names as keys of the JSON header: ``__metadata__`` is that header's
    metadata entry (a tensor under it makes the whole file unreadable, to us and to the
    ``safetensors`` library), and a name must encode as UTF-8 (a lone surrogate does not).
    Anything else is a valid JSON key that ``safetensors`` reads back as written: the
    empty name, control characters, quotes, non-ASCII text.

    >>> check_tensor_name("model.embed.weight", where="state")
    'model.embed.weight'
    """
    if not isinstance(name, str):
        raise InvalidStateError(
            f"{where}: tensor name {name!r} is a {type(name).__name__}; tensor names must be str"
        )
    if name == RESERVED_TENSOR_NAME:
        raise InvalidStateError(
            f"{where}: a tensor cannot be named {name!r}: the safetensors format reserves that key "
            "for the file's metadata, and a tensor under it would make the file unreadable. "
            "Rename the key (e.g. 'metadata') before saving"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidStateError(
            f"{where}: tensor name {name!r} cannot be stored: it holds {exc.object[exc.start:exc.end]!r}, "
            "which is not valid Unicode text (a lone surrogate, often from a mis-decoded byte "
            "string) and cannot be written as UTF-8. Rename the key before saving"
        ) from None
    return name


def check_component_name(name: object, *, where: str) -> str:
    """Component names become file prefixes: letters, digits, ``_ . -``, not reserved."""
    if not isinstance(name, str) or not _COMPONENT_RE.fullmatch(name) or name in _RESERVED:
        raise UnsafePathError(f"{where}: component name {str(name)[:100]!r} is not allowed")
    return name


_FILE_STEM = re.compile(r".+-(?:[0-9]+-of-[0-9]+|r[0-9]+-[0-9]+)")
"""The stem of one of a component's data files (``model-00001-of-00002``, chunked
``model-r00000-00001``): a component named so would write its file over that one."""


def is_component_key(name: object) -> bool:
    """Whether a top-level key of a saved state can name a component (its files' prefix).

    >>> is_component_key("optim"), is_component_key("model-00001-of-00002"), is_component_key("a/b")
    (True, False, False)
    """
    return (isinstance(name, str) and bool(_COMPONENT_RE.fullmatch(name)) and name not in _RESERVED
            and not _FILE_STEM.fullmatch(name))


def validate_component_key(name: object) -> str:
    """Check a top-level key of the state passed to ``save``."""
    if isinstance(name, str) and _FILE_STEM.fullmatch(name):
        raise InvalidStateError(
            f"top-level key {name!r} of the state cannot name a component: {name}.safetensors is the name of "
            "one of another component's data files, which it would overwrite; rename the key "
            f"(e.g. {name.replace('-', '_')!r})"
        )
    if not is_component_key(name):
        raise InvalidStateError(
            f"top-level key {name!r} of the state cannot name a component: components become "
            "file prefixes, so use letters, digits, '_', '.' or '-' (not 'shardpoint' or 'latest')"
        )
    assert isinstance(name, str)
    return name
