"""What a ``CheckpointManager`` decides from plain data: step names, metrics, the step to restore.

No I/O here: the manager reads the store and hands the bytes and listings over.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError

STEP_RE = re.compile(r"^step-([0-9]{6,})$")
"""A step's directory (prefix) name; the group is the step (ASCII digits only)."""


def step_dir_name(step: int) -> str:
    """The directory (prefix) name of ``step``.

    >>> step_dir_name(100)
    'step-000100'
    """
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    """The step whose directory is named ``name``, or None: only the name
    :func:`step_dir_name` gives counts (a copy named ``step-500``, or with Unicode digits,
    is someone else's folder: the manager would look for that step elsewhere).

    >>> step_of("step-000500"), step_of("step-500"), step_of("step-1234567"), step_of("step-0001234567")
    (500, None, 1234567, None)
    """
    match = STEP_RE.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == name else None


_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def metrics_json(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as JSON values: one-element tensors and numpy scalars become floats, and the
    non-finite floats (a diverged loss) the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    out: dict[str, Any] = {}
    for name, value in (metrics or {}).items():
        if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):
            # torch / numpy scalars; anything that is not one number is refused as not JSON
            with contextlib.suppress(ValueError, RuntimeError):
                value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(name, str):
            raise InvalidStateError(
                f"metrics[{name!r}] = {str(value)[:40]!r}: metrics are JSON numbers by name (floats, ints, "
                "one-element tensors), what keep_best ranks steps by; put other values in the state"
            )
        if isinstance(value, float) and not math.isfinite(value):
            value = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        out[name] = value
    return out


def metrics_of_manifest(raw: bytes, *, where: str) -> dict[str, Any]:
    """The metrics a step's manifest (``raw``, at ``where``) records, non-finite ones restored.

    Raises:
        CorruptCheckpointError: ``raw`` is not a manifest's JSON.
    """
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != "shardpoint" or not isinstance(doc.get("components"), dict):
            raise ValueError("it is not a shardpoint manifest (no 'format': 'shardpoint' and 'components')")
        stored = dict(doc.get("metadata", {}).get("metrics", {}))
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CorruptCheckpointError(
            f"{where}: cannot read the step's metrics ({reason}); the step's manifest is "
            "damaged: restore another step, or check it with `shardpoint verify`"
        ) from None
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in stored.items()}


def agreed_step(root: str, views: list[list[int]], step: int | None) -> tuple[int | None, str | None]:
    """The step to restore given each rank's committed steps (one view in one process), and
    a warning when a newer step is committed in some views only. Raises CheckpointNotFoundError when
    ``step`` is not committed in every view, or the views share no step while some have one."""
    common = set(views[0]).intersection(*views[1:])
    seen = "; ".join(f"rank {rank} sees steps {view}" for rank, view in enumerate(views))
    if step is not None:
        if step in common:
            return step, None
        if len(views) == 1:
            raise CheckpointNotFoundError(f"{root} has no committed step {step}; it has {views[0]}")
        lacking = ", ".join(str(rank) for rank, view in enumerate(views) if step not in view)
        raise CheckpointNotFoundError(
            f"{root} has no committed step {step} in the view of rank {lacking} ({seen}); "
            "every rank must see the step it restores: restore a step all of them list, or "
            "wait for the file system to show the step on every rank"
        )
    if common:
        chosen = max(common)
        newer = sorted({s for view in views for s in view if s > chosen})
        if not newer:
            return chosen, None
        return chosen, (
            f"restoring step {chosen} from {root}, the newest step every rank sees: step "
            f"{newer} is committed in the view of some ranks only ({seen})"
        )
    if any(views):
        raise CheckpointNotFoundError(
            f"the ranks see no committed step in common under {root} ({seen}); every rank must "
            "see the step it restores: check that the root is the same shared directory on "
            "every rank"
        )
    return None, None
