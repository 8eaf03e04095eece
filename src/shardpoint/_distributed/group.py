"""One wrapper over a process group that also works with none (a single process).

Every collective phase runs through :meth:`Group.phase`: each rank runs its part, the
outcomes are exchanged, and if any rank failed, every rank raises the same
:class:`DistributedCheckpointError` naming each failed rank and its error.

On a gloo group the outcomes travel point to point through the coordinator (rank 0), so a
rank that dies is noticed at once by the coordinator (its connection closes), which tells
every other rank; no rank waits on a collective that a dead peer can never complete. A rank
that hangs is given up on after ``SHARDPOINT_COLLECTIVE_TIMEOUT`` seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .._knobs import knobs
from ..errors import CheckpointError, DistributedCheckpointError, InvalidStateError

T = TypeVar("T")

REPORT_TAG = 0x53500001
"""Tag of the phase reports exchanged point to point (``SP`` + 1), apart from user traffic."""
REPLY_MARGIN_S = 60.0
"""Ranks wait this much longer than the coordinator does, so its verdict can reach them."""


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
        with _lost_peers("gathering the ranks' plans and reports"):
            _dist().all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: T) -> T:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.is_coordinator else None]
        dist = _dist()
        with _lost_peers("receiving the coordinator's decision"):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return box[0]  # type: ignore[return-value]

    # ------------------------------------------------------------- phase reports

    def _reports_point_to_point(self) -> bool:
        """Whether the group carries CPU tensors point to point (gloo, or a gloo part)."""
        try:
            return "gloo" in str(_dist().get_backend(self.pg)).lower()
        except Exception:
            return False

    def _send_text(self, rank: int, text: str, timeout: datetime.timedelta) -> None:
        dist = _dist()
        payload = text.encode("utf-8")
        dst = dist.get_global_rank(self.pg, rank)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for tensor in (size, body):
            work = dist.isend(tensor, dst=dst, group=self.pg, tag=REPORT_TAG)
            work.wait(timeout)

    def _recv_text(self, rank: int, size_work: Any, size: torch.Tensor, timeout: datetime.timedelta) -> str:
        dist = _dist()
        size_work.wait(timeout)
        body = torch.empty(int(size.item()), dtype=torch.uint8)
        src = dist.get_global_rank(self.pg, rank)
        dist.irecv(body, src=src, group=self.pg, tag=REPORT_TAG).wait(timeout)
        return bytes(body.numpy()).decode("utf-8")

    def _post_size_recv(self, rank: int) -> tuple[Any, torch.Tensor]:
        dist = _dist()
        size = torch.zeros(1, dtype=torch.int64)
        work = dist.irecv(size, src=dist.get_global_rank(self.pg, rank), group=self.pg, tag=REPORT_TAG)
        return work, size

    def _exchange_reports(self, error: str | None) -> dict[int, str]:
        """Every rank's outcome, through the coordinator: failed rank -> what went wrong.

        Each rank sends its outcome to rank 0; rank 0 waits for each (a dead rank's closed
        connection fails that wait at once), then sends the verdict to every rank it heard
        from. A rank that cannot reach rank 0 reports rank 0 as failed.
        """
        limit = knobs().collective_timeout_s
        if not self.is_coordinator:
            try:
                self._send_text(0, json.dumps(error), datetime.timedelta(seconds=limit))
                work, size = self._post_size_recv(0)
                verdict = self._recv_text(0, work, size, datetime.timedelta(seconds=limit + REPLY_MARGIN_S))
                return {int(rank): text for rank, text in json.loads(verdict).items()}
            except Exception:
                failed = {
                    0: "the coordinator stopped responding: its process died, or it gave up "
                    "waiting for another rank (its own error names that rank)"
                }
                if error is not None:
                    failed[self.rank] = error
                return failed
        dead = "stopped responding: its process died or dropped the connection"
        failed = {} if error is None else {0: error}
        posted = {}
        for rank in range(1, self.world_size):
            try:  # posting fails at once when the rank's connection is already closed
                posted[rank] = self._post_size_recv(rank)
            except Exception:
                failed[rank] = dead
        deadline = time.monotonic() + limit
        reachable = []
        for rank, (work, size) in posted.items():
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                report = json.loads(self._recv_text(rank, work, size, left))
            except Exception as exc:
                if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                    failed[rank] = (
                        f"sent no report within {limit} s: it hangs, or is slower than "
                        "SHARDPOINT_COLLECTIVE_TIMEOUT allows"
                    )
                    break  # gloo closes every connection of this rank on a timeout
                failed[rank] = dead
                continue
            reachable.append(rank)
            if report is not None:
                failed[rank] = str(report)
        verdict = json.dumps({str(rank): text for rank, text in sorted(failed.items())})
        for rank in reachable:
            # A rank that cannot be told will see that the coordinator is gone and say so.
            with contextlib.suppress(Exception):
                self._send_text(rank, verdict, datetime.timedelta(seconds=limit))
        return failed

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
        if self._reports_point_to_point():
            failed = self._exchange_reports(error)
        else:
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


@contextlib.contextmanager
def _lost_peers(what: str) -> Iterator[None]:
    """Turn a failed collective (a peer died, a connection broke) into a CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise DistributedCheckpointError(
            f"{what} failed: another rank died or its connection broke ({_first_line(exc)}); "
            "the errors of the other ranks name the one that failed"
        ) from exc


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
    with torch.no_grad():  # the local tensor itself, not an autograd node (~70 us each)
        local: torch.Tensor = dtensor.to_local()
    return global_shape, tuple(int(o) for o in offsets), local
