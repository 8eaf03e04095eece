"""Checks of the switches public calls take (``overwrite``, ``allow_pickle``, ...).

A switch is a ``bool``: ``"no"`` or ``0`` would read as what they are not (``"no"`` is
true), and two of these switches let a file run code (``allow_pickle``, ``trust_pickle``)
or replace a checkpoint (``overwrite``).
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidArgumentTypeError


def check_flags(call: str, optional: tuple[str, ...] = (), **flags: Any) -> None:
    """Raise :class:`InvalidArgumentTypeError` naming ``call`` and the argument for a flag
    that is not a ``bool`` (``None`` allowed for the names in ``optional``).

    >>> check_flags("save", overwrite=True, progress=None, optional=("progress",))
    >>> check_flags("convert", trust_pickle="no")
    Traceback (most recent call last):
    ...
    shardpoint.errors.InvalidArgumentTypeError: convert(trust_pickle='no'): pass True or False, not a str
    """
    for name, value in flags.items():
        if isinstance(value, bool) or (value is None and name in optional):
            continue
        shown = repr(value) if len(repr(value)) <= 40 else f"<{type(value).__name__}>"
        extra = " or None" if name in optional else ""
        raise InvalidArgumentTypeError(
            f"{call}({name}={shown}): pass True or False{extra}, not a {type(value).__name__}"
        )
