"""The read settings of one ``load`` / ``load_into`` call, resolved from its arguments and
the options in effect."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._format.dtypes import as_dtype
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
        found = torch.device(f"cuda:{device}" if isinstance(device, int) else device)  # an index: a GPU's
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(
            f"device {str(device)[:40]!r} is not a device torch knows; use e.g. 'cpu', 'cuda', 'cuda:0'"
        ) from None
    return _available(found, device)


def _available(found: torch.device, given: object) -> torch.device:
    """``found``, refused where this machine has no such accelerator (a bare index is CUDA's)."""
    if found.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"device {str(given)[:40]!r} is a CUDA device, and torch sees none on this machine; "
            "load to 'cpu' (or check CUDA_VISIBLE_DEVICES and the torch build)"
        )
    if found.type not in ("cpu", "cuda", "meta"):
        backend = getattr(torch, found.type, None)  # torch.xpu, torch.mps, torch.mtia, ...
        is_available = getattr(backend, "is_available", None)
        try:
            available = bool(is_available()) if callable(is_available) else False
        except Exception:  # a backend that cannot even say
            available = False
        if not available:
            raise InvalidArgumentError(
                f"device {str(given)[:40]!r}: torch has no {found.type} device on this machine; load to "
                "'cpu' (or check the torch build)"
            )
    return found


_PLANNED_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def device_map_arg(device_map: object, target: object, dtype: torch.dtype | None) -> dict[str, torch.device]:
    """A ``device_map=`` argument as module-name prefix -> device.

    As ``from_pretrained`` takes it: a mapping (devices as strings, indexes or
    ``torch.device``; ``"meta"`` leaves those tensors unmaterialized), one device for
    everything (``"cpu"``, ``0``), or ``"auto"`` (and accelerate's other planned maps): the
    map ``accelerate.infer_auto_device_map`` makes for the target module. Offloading to
    ``"disk"`` is not supported.
    """
    if device_map is None:
        return {}
    if isinstance(device_map, str) and device_map in _PLANNED_MAPS:
        return _planned(device_map, target, dtype)
    if not isinstance(device_map, Mapping):
        return {"": device_arg(device_map)}
    out: dict[str, torch.device] = {}
    for prefix, device in device_map.items():
        if not isinstance(prefix, str):
            raise InvalidArgumentTypeError(
                f"device_map keys must be module names (strings, '' for all), not {type(prefix).__name__}")
        if device == "disk":
            raise InvalidArgumentError(
                f"device_map[{prefix[:60]!r}] = 'disk': offloading to disk is not supported by load_into; "
                "map those modules to 'cpu' (or to 'meta' to leave them unloaded)")
        out[prefix] = torch.device("meta") if device == "meta" else device_arg(device)
    if isinstance(target, torch.nn.Module):
        _check_map_names(out, target)
    return out


def _check_map_names(device_map: Mapping[str, torch.device], module: torch.nn.Module) -> None:
    """Refuse a ``device_map`` key that names no module, parameter or buffer of ``module``
    (a typo or a trailing dot would otherwise place nothing, without a word)."""
    names = {n for n, _ in module.named_modules()}
    names.update(n for n, _ in module.named_parameters(remove_duplicate=False))
    names.update(n for n, _ in module.named_buffers(remove_duplicate=False))
    for prefix in device_map:
        if prefix and prefix not in names:
            close = difflib.get_close_matches(prefix, sorted(names), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise InvalidArgumentError(
                f"device_map[{prefix[:80]!r}] names no module, parameter or buffer of the "
                f"{type(module).__name__} being loaded (keys are module names as in "
                f"named_modules(), '' for the whole model){hint}")


def _planned(kind: str, target: object, dtype: torch.dtype | None) -> dict[str, torch.device]:
    if not isinstance(target, torch.nn.Module):
        raise InvalidArgumentError(
            f"device_map={kind!r} plans the placement of a module; pass the module as the target, "
            "or a mapping of module names to devices")
    try:
        from accelerate.utils import get_balanced_memory, infer_auto_device_map
    except ImportError:
        from ..errors import MissingDependencyError

        raise MissingDependencyError(
            f"device_map={kind!r} is planned by accelerate: pip install accelerate, or pass a mapping "
            "of module names to devices") from None
    no_split = getattr(target, "_no_split_modules", None)
    no_split = list(no_split) if isinstance(no_split, (list, tuple, set)) else None
    max_memory = None
    if kind != "sequential":
        max_memory = get_balanced_memory(target, dtype=dtype, low_zero=kind == "balanced_low_0",
                                         no_split_module_classes=no_split)
    planned = infer_auto_device_map(target, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    out: dict[str, torch.device] = {}
    for prefix, device in planned.items():
        if device == "disk":
            raise InvalidArgumentError(
                f"device_map={kind!r}: the model does not fit this machine's memory (accelerate would put "
                f"{prefix[:60]!r} on disk, which load_into does not support); load with a smaller dtype or "
                "give more devices")
        out[prefix] = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return out


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
    auto_dtype: bool = False
    """``dtype="auto"``: ``dtype`` becomes the checkpoint's own, once it is open."""

    def settled(self, records: Iterable[tuple[str | torch.dtype, Sequence[int]]],
                config: Callable[[], bytes | None] = lambda: None) -> IntoSettings:
        """These settings for the opened checkpoint whose tensors are ``records`` ((stored
        dtype, shape) pairs) and whose ``config.json`` is ``config()`` (None: it has none),
        both consulted only for ``dtype="auto"``: as ``from_pretrained`` takes it, the dtype
        the config names, else its weights' dtype."""
        if not self.auto_dtype:
            return self
        return dataclasses.replace(self, dtype=config_dtype(config()) or weights_dtype(records), auto_dtype=False)


def is_auto(dtype: object) -> bool:
    """``dtype="auto"``, as ``from_pretrained`` takes it (transformers 5's default)."""
    return isinstance(dtype, str) and dtype.strip().lower() == "auto"


def config_dtype(config: bytes | None) -> torch.dtype | None:
    """The floating-point dtype a ``config.json`` names (``dtype``, or ``torch_dtype`` as
    transformers 4 wrote it), or None.

    >>> config_dtype(b'{"model_type": "llama", "torch_dtype": "bfloat16"}'), config_dtype(b'{"dtype": null}')
    (torch.bfloat16, None)
    """
    try:
        parsed = json.loads(config) if config else None
    except ValueError:
        return None  # not ours to judge here: the weights decide
    if not isinstance(parsed, dict):
        return None
    named = parsed.get("dtype") or parsed.get("torch_dtype")
    dtype = getattr(torch, named, None) if isinstance(named, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def weights_dtype(records: Iterable[tuple[str | torch.dtype, Sequence[int]]]) -> torch.dtype | None:
    """The floating-point dtype holding most of a checkpoint's elements (``dtype="auto"``:
    its weights' dtype), from (dtype or safetensors code, shape) pairs; None if none is.

    >>> weights_dtype([("BF16", (4, 4)), ("F32", (4,)), ("I64", (100,))])
    torch.bfloat16
    """
    counts: Counter[torch.dtype] = Counter()
    for stored, shape in records:
        dtype = as_dtype(stored)
        if dtype is not None and dtype.is_floating_point:
            counts[dtype] += math.prod(shape)
    return counts.most_common(1)[0][0] if counts else None

