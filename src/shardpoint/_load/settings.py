"""The read settings of one ``load`` / ``load_into`` call, resolved from its arguments and
the options in effect."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._options import current_options
from .._sizes import parse_size
from ..errors import InvalidArgumentError, InvalidArgumentTypeError, InvalidSizeError


def staging_size(value: int | str | None) -> int | None:
    """``max_buffer_bytes`` in bytes (None: the options' default); at least 4 KiB."""
    if value is None:
        return None
    size = parse_size(value)
    if size < 4096:
        raise InvalidSizeError(f"max_buffer_bytes={value!r} is too small; use at least 4 KiB, e.g. '16MiB'")
    return size


def device_arg(device: object) -> torch.device:
    """A ``device=`` argument as a ``torch.device`` (refused clearly where torch knows none)."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise InvalidArgumentTypeError(
            f"device must be a torch.device or a string such as 'cpu' or 'cuda:0', not {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(
            f"device {str(device)[:40]!r} is not a device torch knows; use e.g. 'cpu', 'cuda', 'cuda:0'"
        ) from None


def keys_arg(keys: object) -> list[str] | None:
    """A ``keys=`` argument: None, one name, or names (each a string)."""
    if keys is None:
        return None
    if isinstance(keys, str):
        return [keys]
    try:
        wanted = list(keys)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentTypeError(f"keys must be a list of names, not {type(keys).__name__}") from None
    wrong = [k for k in wanted if not isinstance(k, str)]
    if wrong:
        raise InvalidArgumentTypeError(
            f"keys must be names (strings); got {type(wrong[0]).__name__} {str(wrong[0])[:40]!r}"
        )
    return wanted


def resolve_verify(verify: bool | None) -> bool:
    """``verify=`` as given, else ``IOOptions.verify_checksums``."""
    return current_options().io.verify_checksums if verify is None else verify


@dataclass(frozen=True)
class IntoSettings:
    """How one ``load_into`` call reads (its arguments beyond the target and the path)."""

    strict: bool
    """Refuse a mismatch (:class:`LoadMismatchError`) before reading."""
    progress: bool | None
    """Show a progress bar (None: when stderr is a terminal)."""
    verify: bool
    """Check crc32c (``verify=``, else ``IOOptions.verify_checksums``)."""
    allow_pickle: bool
    """Unpickle values saved with ``allow_pickle=True``."""
    device: torch.device
    """Where ``meta`` tensors are materialized."""
    dtype: torch.dtype | None
    """The floating-point dtype of loaded parameters and persistent buffers."""
    device_map: Mapping[str, Any]
    """Module-name prefix -> device for ``meta`` tensors."""
    staging_bytes: int | None = None
    """Each reader thread's staging buffer (None: ``IOOptions.staging_buffer_bytes``)."""
    ranks_here: int = 1
    """Processes sharing this machine's CPUs (a collective load's ranks on it), whose share
    sets the reader threads (``reader_threads``)."""
