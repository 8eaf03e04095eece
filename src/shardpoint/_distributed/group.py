"""One wrapper over a process group that also works with none (a single process).

Every collective phase runs through :meth:`Group.phase`: each rank runs its part, the
outcomes are exchanged, and if any rank failed, every rank raises the same
:class:`DistributedCheckpointError` naming each failed rank and its error.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import CheckpointError, DistributedCheckpointError, InvalidStateError

T = TypeVar("T")


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def has_dtensor(tensors: Any) -> bool:
    return any(type(t).__name__ == "DTensor" for t in tensors)


def resolve_group(process_group: Any, tensors: Any) -> Group:
    """The group a save/load runs over.

    Collective when ``process_group`` is given, or when the default group is initialized
    with more than one rank and the state holds DTensors (every rank must take part then).
    A state of plain tensors without ``process_group`` is saved by the calling process
    alone, so ``if rank == 0: sp.save(...)`` keeps working.
    """
    if process_group is not None:
        return Group(process_group)
    if has_dtensor(tensors):
        dist = _dist()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return Group(dist.group.WORLD)
    return Group(None)


class Group:
    """Process-group operations, or their single-process equivalents when ``pg`` is None."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        if pg is None:
            self.rank, self.world_size = 0, 1
        else:
            dist = _dist()
            self.rank = dist.get_rank(pg)
            self.world_size = dist.get_world_size(pg)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.pg is not None and self.world_size > 1

    def all_gather(self, obj: T) -> list[T]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        _dist().all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: T) -> T:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.is_coordinator else None]
        dist = _dist()
        _dist().broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return box[0]  # type: ignore[return-value]

    def phase(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if any rank fails, all raise one error naming them."""
        result: Any = None
        error: str | None = None
        exc: BaseException | None = None
        try:
            result = fn()
        except Exception as caught:  # reported to every rank below
            exc = caught
            error = f"{type(caught).__name__}: {caught}"
        if not self.distributed:
            if exc is not None:
                raise exc
            return result
        errors = self.all_gather(error)
        failed = {rank: text for rank, text in enumerate(errors) if text is not None}
        if failed:
            lines = "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items()))
            ranks = ", ".join(map(str, sorted(failed)))
            message = f"{name} failed on rank{'s' if len(failed) > 1 else ''} {ranks} ({lines})"
            if exc is not None and not isinstance(exc, CheckpointError):
                message += "\n" + "".join(traceback.format_exception_only(type(exc), exc)).strip()
            raise DistributedCheckpointError(message, failed) from exc
        return result


def local_chunk(
    tensor: torch.Tensor, name: str | None = None
) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global shape, offsets of the local chunk, local tensor) of a DTensor or a plain tensor.

    A DTensor with a ``Partial`` placement is refused: its local values are addends of a
    pending reduction, not a piece of the tensor, so saving (or filling) them as one would
    silently store (or load) wrong values. ``name`` labels the error.
    """
    if type(tensor).__name__ != "DTensor":
        return tuple(tensor.shape), (0,) * tensor.dim(), tensor
    dtensor: Any = tensor
    placements = tuple(dtensor.placements)
    if any(getattr(p, "is_partial", lambda: False)() for p in placements):
        what = f"tensor {name!r}" if name is not None else "a DTensor"
        raise InvalidStateError(
            f"{what} has placements {placements}: a Partial placement holds a pending "
            "reduction, so the local values are not the tensor's. Reduce it first, e.g. "
            "`t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in "
            "t.placements])`, or pass `t.full_tensor()`"
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    global_shape = tuple(tensor.shape)
    _, offsets = compute_local_shape_and_global_offset(global_shape, dtensor.device_mesh, placements)
    local: torch.Tensor = dtensor.to_local()
    return global_shape, tuple(int(o) for o in offsets), local
