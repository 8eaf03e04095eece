"""One wrapper over a process group that also works with none (a single process).

Every collective phase runs through :meth:`Group.phase`: each rank runs its part, the
outcomes are exchanged, and if any rank failed, every rank raises the same
:class:`DistributedCheckpointError` naming each failed rank and its error.

On a gloo group the outcomes travel point to point through the coordinator (rank 0), so a
rank that dies is noticed at once by the coordinator (its connection closes), which tells
every other rank; no rank waits on a collective that a dead peer can never complete. A rank
that hangs is given up on after ``CollectiveOptions.timeout_s`` seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from .._io.memory import local_tensor
from .._options import current_options
from ..errors import (
    CheckpointError,
    DistributedCheckpointError,
    InvalidArgumentError,
    InvalidStateError,
)

T = TypeVar("T")

REPORT_TAG = 0x53500001
"""Tag of the phase reports exchanged point to point (``SP`` + 1), apart from user traffic."""
REPLY_MARGIN_S = 60.0
"""Ranks wait this much longer than the coordinator does, so its verdict can reach them."""


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def holds_dtensor(obj: Any) -> bool:
    """Whether ``obj`` (a state given to ``save``, a target given to ``load_into``) holds a
    DTensor: a tensor, a module's parameters and buffers, an optimizer's state, the values
    of mappings, lists and tuples, and what another object's ``state_dict()`` returns (a
    scheduler, a ``Stateful``), as :func:`~shardpoint._prepare.prepare_state` walks them."""
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, (str, bytes, int, float, bool)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if type(item).__name__ == "DTensor":
                return True
        elif isinstance(item, torch.nn.Module):
            stack.extend(item.parameters())
            stack.extend(item.buffers())
        elif isinstance(item, torch.optim.Optimizer):
            stack.extend(item.state.values())
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset, Iterator)):
            stack.extend(item)
        elif callable(getattr(item, "state_dict", None)):
            try:
                stack.append(item.state_dict())
            except Exception:  # raised again, where it belongs, when the state is collected
                continue
    return False


def _world_group() -> Any:
    """The default process group when it is initialized with more than one rank, else None."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def resolve_group(process_group: Any, state: Any) -> Group:
    """The group a call runs over: THE process-group rule of shardpoint.

    Every collective entry point resolves its group here, once, at its start: ``save``,
    ``async_save``, ``load_into``, and ``CheckpointManager.save`` / ``restore`` (whose group
    also decides who manages the root). ``state`` is what the call is given: the state to
    save, the target to load into, or the flat tensors of a prepared state.

    1. ``process_group`` given: that group; every rank of it must make the same call.
    2. Else, when the default group is initialized with more than one rank and ``state``
       holds a DTensor (FSDP2, tensor parallel): the default group. A DTensor is one piece
       of a tensor the other ranks hold the rest of, so every rank must take part.
    3. Else the calling process alone (a group of one): ``if rank == 0: sp.save(...)`` of
       plain tensors keeps working.
    """
    if process_group is not None:
        return Group(process_group)
    world = _world_group()
    if world is not None and holds_dtensor(state):
        return Group(world, implicit=True)
    return Group(None)


_UNRESPONSIVE = "stopped responding"
"""How a rank that never answered an exchange is described (it died, hangs, or never joined)."""

OUT_OF_STEP = "the ranks are out of step"
"""How :meth:`Group.exchange` begins the error of ranks that sent different identities."""


class Group:
    """Process-group operations, or their single-process equivalents when ``pg`` is None."""

    def __init__(self, pg: Any, *, implicit: bool = False) -> None:
        self.pg = pg
        self.implicit = implicit
        """Whether the default group was taken for a state holding DTensors (rule 2 of
        :func:`resolve_group`), not given: a rank that never joins then most likely holds
        no part of those DTensors, and the error says how to give the group."""
        if pg is None:
            self.rank, self.world_size = 0, 1
        else:
            dist = _dist()
            self.rank = dist.get_rank(pg)
            if self.rank < 0:  # torch's answer for a process outside the group
                raise InvalidArgumentError(
                    f"process_group: this process (global rank {dist.get_rank()}) is not one of its ranks "
                    f"({list(dist.get_process_group_ranks(pg))[:16]}); only the group's ranks make the call"
                )
            self.world_size = dist.get_world_size(pg)

    @property
    def ranks(self) -> list[int]:
        """The global rank of each rank of the group, in group order."""
        if self.pg is None:
            return [0]
        return list(_dist().get_process_group_ranks(self.pg))

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

    def _send_bytes(self, rank: int, payload: bytes, timeout: datetime.timedelta) -> None:
        dist = _dist()
        dst = dist.get_global_rank(self.pg, rank)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for tensor in (size, body):
            work = dist.isend(tensor, dst=dst, group=self.pg, tag=REPORT_TAG)
            work.wait(timeout)

    def _recv_bytes(self, rank: int, size_work: Any, size: torch.Tensor, timeout: datetime.timedelta) -> bytes:
        dist = _dist()
        size_work.wait(timeout)
        body = torch.empty(int(size.item()), dtype=torch.uint8)
        src = dist.get_global_rank(self.pg, rank)
        dist.irecv(body, src=src, group=self.pg, tag=REPORT_TAG).wait(timeout)
        return bytes(body.numpy())

    def _post_size_recv(self, rank: int) -> tuple[Any, torch.Tensor]:
        dist = _dist()
        size = torch.zeros(1, dtype=torch.int64)
        work = dist.irecv(size, src=dist.get_global_rank(self.pg, rank), group=self.pg, tag=REPORT_TAG)
        return work, size

    def _exchange_reports(self, error: str | None, report: Any, decide: _Decide | None) -> _Verdict:
        """Every rank's outcome, through the coordinator.

        Each rank sends (error, report) to rank 0; rank 0 waits for each (a dead rank's
        closed connection fails that wait at once), runs ``decide`` on the reports when
        every rank succeeded, then sends each rank it heard from the verdict and that
        rank's answer. A rank that cannot reach rank 0 reports rank 0 as failed.

        Messages are pickled: they only travel between the ranks of one job, as in
        torch's own object collectives.
        """
        limit = current_options().collective.timeout_s
        if not self.is_coordinator:
            try:
                message = pickle.dumps((error, report))
            except Exception as caught:  # a bug of ours: say so rather than leave rank 0 waiting
                error = error or f"its report could not be pickled ({_first_line(caught)})"
                message = pickle.dumps((error, None))
            try:
                self._send_bytes(0, message, datetime.timedelta(seconds=limit))
                work, size = self._post_size_recv(0)
                verdict = self._recv_bytes(0, work, size, datetime.timedelta(seconds=limit + REPLY_MARGIN_S))
                failed, answer, deciding = pickle.loads(verdict)
                return _Verdict(failed, answer, deciding)
            except Exception:
                failed = {
                    0: f"the coordinator {_UNRESPONSIVE}: its process died, or it gave up "
                    "waiting for another rank (its own error names that rank)"
                }
                if error is not None:
                    failed[self.rank] = error
                return _Verdict(failed)
        dead = f"{_UNRESPONSIVE}: its process died or dropped the connection"
        failed = {} if error is None else {0: error}
        reports: list[Any] = [report] + [None] * (self.world_size - 1)
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
                rank_error, reports[rank] = pickle.loads(self._recv_bytes(rank, work, size, left))
            except Exception as exc:
                if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                    failed[rank] = (
                        f"{_UNRESPONSIVE}: it sent no report within {limit} s; it hangs, never made this "
                        "call, or is slower than its timeout allows (CollectiveOptions(timeout_s=...))"
                    )
                    break  # gloo closes every connection of this rank on a timeout
                failed[rank] = dead
                continue
            reachable.append(rank)
            if rank_error is not None:
                failed[rank] = str(rank_error)
        answers: list[Any] = [None] * self.world_size
        deciding = False
        if not failed and decide is not None:
            answers, decide_error = decide(reports)
            if decide_error is not None:
                failed, deciding = {0: decide_error}, True
        failed = dict(sorted(failed.items()))
        try:
            messages = {rank: pickle.dumps((failed, answers[rank], deciding)) for rank in reachable}
        except Exception as caught:  # a bug of ours: fail every rank rather than leave them waiting
            failed, deciding = {0: f"its answers could not be pickled ({_first_line(caught)})"}, True
            messages = {rank: pickle.dumps((failed, None, deciding)) for rank in reachable}
        for rank, message in messages.items():
            # A rank that cannot be told will see that the coordinator is gone and say so.
            with contextlib.suppress(Exception):
                self._send_bytes(rank, message, datetime.timedelta(seconds=limit))
        return _Verdict(failed, answers[0], deciding)

    def phase(self, name: str, fn: Callable[[], T], identity: str | None = None) -> T:
        """Run ``fn`` on every rank; if any rank fails, all raise one error naming them
        (``identity``: see :meth:`exchange`)."""
        return self.exchange(name, lambda: (fn(), None), identity=identity)[0]

    def exchange(
        self,
        name: str,
        fn: Callable[[], tuple[T, Any]],
        decide: Callable[[list[Any]], list[Any]] | None = None,
        deciding: str = "",
        identity: str | None = None,
    ) -> tuple[T, Any]:
        """A phase whose outcomes the coordinator acts on, in one round trip.

        ``fn`` returns (kept, report) on every rank. The reports reach the coordinator;
        when every rank succeeded it runs ``decide(reports)``, which returns one answer per
        rank, and each rank gets back (kept, its answer). If ``fn`` fails on any rank, or
        ``decide`` fails, every rank raises one :class:`DistributedCheckpointError`; it
        names the phase ``name``, or ``deciding`` for a failed ``decide``. Without a
        process group ``decide`` runs in the calling process.

        With ``identity`` (the same on every rank for the same call: the path being saved,
        a step; not a local path that may differ between hosts), every report carries it
        and the coordinator checks that every rank sent the same one: ranks out of step
        (one rank's call failed before the ranks met, so its next call meets the others'
        earlier one) all fail, naming what each rank was doing, instead of mixing two
        calls' work.
        """
        key = identity
        inner_decide = decide

        def decide_in_step(tagged: list[Any]) -> list[Any]:
            keys = [t[0] if isinstance(t, tuple) and len(t) == 2 else None for t in tagged]
            odd = [r for r, k in enumerate(keys) if k != keys[0]]
            if odd:
                shown = "; ".join(f"rank {r}: {keys[r]!r}" for r in [0, *odd[:3]])
                raise DistributedCheckpointError(
                    f"{OUT_OF_STEP} ({shown}{' ...' if len(odd) > 3 else ''}): every rank "
                    "must make the same call (the same path and arguments) in the same order, and an earlier call "
                    "that failed on some ranks before they met leaves the others waiting in it. "
                    "Nothing was saved by this call"
                )
            reports = [t[1] for t in tagged]
            return inner_decide(reports) if inner_decide is not None else [None] * len(reports)

        result: Any = None
        report: Any = None
        error: str | None = None
        exc: BaseException | None = None
        try:
            result, report = fn()
        except Exception as caught:  # reported to every rank below
            exc = caught
            error = _describe(caught)
        if not self.distributed:
            if exc is not None:
                raise exc
            return result, None if decide is None else decide([report])[0]
        if key is not None:
            report, decide = (key, report), decide_in_step

        decide_exc: list[BaseException] = []

        def run_decide(reports: list[Any]) -> tuple[list[Any], str | None]:
            assert decide is not None
            try:
                return decide(reports), None
            except Exception as caught:  # the coordinator's failure, told to every rank
                decide_exc.append(caught)
                return [None] * self.world_size, _describe(caught)

        if self._reports_point_to_point():
            verdict = self._exchange_reports(error, report, None if decide is None else run_decide)
        else:
            verdict = self._exchange_collectively(error, report, None if decide is None else run_decide)
        if verdict.failed:
            failed = verdict.failed
            lines = "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items()))
            ranks = ", ".join(map(str, sorted(failed)))
            out_of_step = any(OUT_OF_STEP in str(text) for text in failed.values())
            stage = deciding if verdict.deciding and deciding and not out_of_step else name
            message = f"{stage} failed on rank{'s' if len(failed) > 1 else ''} {ranks} ({lines})"
            if self.implicit and any(_UNRESPONSIVE in str(text) for text in failed.values()):
                message += (
                    f". This call runs over the default group ({self.world_size} ranks) because the state holds "
                    "DTensors and no process_group was given, so every rank of the default group must make it; "
                    "for DTensors on a mesh of fewer ranks, pass process_group= the group of the mesh's ranks"
                )
            cause = exc if exc is not None else decide_exc[0] if decide_exc else None
            if cause is not None and not isinstance(cause, CheckpointError):
                message += "\n" + "".join(traceback.format_exception_only(type(cause), cause)).strip()
            raise DistributedCheckpointError(message, failed) from cause
        return result, verdict.answer

    def _exchange_collectively(self, error: str | None, report: Any, decide: _Decide | None) -> _Verdict:
        """:meth:`_exchange_reports` over collectives (groups without point to point): the
        reports gathered on the coordinator, each rank's verdict scattered back (not every
        report to every rank: that would grow with the square of the ranks)."""
        dist = _dist()
        coordinator = dist.get_global_rank(self.pg, 0)
        gathered: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        with _lost_peers("gathering the ranks' plans and reports"):
            dist.gather_object((error, report), gathered, dst=coordinator, group=self.pg)
        verdicts: list[_Verdict] | None = None
        if gathered is not None:
            failed = {rank: text for rank, (text, _) in enumerate(gathered) if text is not None}
            if failed or decide is None:
                verdicts = [_Verdict(failed)] * self.world_size
            else:
                answers, decide_error = decide([r for _, r in gathered])
                if decide_error is not None:
                    verdicts = [_Verdict({0: decide_error}, None, True)] * self.world_size
                else:
                    verdicts = [_Verdict({}, answer) for answer in answers]
        box: list[Any] = [None]
        with _lost_peers("receiving the coordinator's decision"):
            dist.scatter_object_list(box, verdicts, src=coordinator, group=self.pg)
        return box[0]


_Decide = Callable[[list[Any]], tuple[list[Any], str | None]]
"""The coordinator's step of an exchange: reports -> (one answer per rank, error or None)."""


class _Verdict(NamedTuple):
    failed: dict[int, str]
    """Failed rank -> what went wrong (empty: every rank succeeded)."""
    answer: Any = None
    """This rank's answer from the coordinator's decision."""
    deciding: bool = False
    """Whether it was the coordinator's decision that failed."""


def _describe(exc: BaseException) -> str:
    """How a rank's failure reads in the error every rank raises."""
    return f"{type(exc).__name__}: {exc}"


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


def shard_offsets(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: Sequence[int] | None,
    placements: Sequence[Any],
) -> tuple[int, ...] | None:
    """Where the local chunk of a DTensor begins in the global tensor, for placements that
    are each exactly ``Shard`` or ``Replicate``; None for any other (left to torch).

    The same offsets as torch's ``compute_local_shape_and_global_offset`` (tested against it),
    at a twentieth of its cost (~4 us against ~80 us a tensor): each ``Shard(d)`` splits the
    local extent of ``d`` as ``torch.chunk`` does, mesh dimension by mesh dimension, and a
    dimension left empty begins at its global size.

        >>> from torch.distributed.tensor import Replicate, Shard
        >>> shard_offsets((10, 4), (2, 2), (1, 1), [Shard(0), Shard(0)])  # rows 5-9, then 3 + 2
        (8, 0)
        >>> shard_offsets((10, 4), (2, 3), (1, 2), [Replicate(), Shard(1)])  # 4 columns in 2, 2, 0
        (0, 4)
    """
    if coordinate is None:
        return None
    size = list(global_shape)
    first = [0] * len(size)
    for mesh_dim, placement in enumerate(placements):
        kind = type(placement).__name__
        if kind == "Replicate":
            continue
        dim = getattr(placement, "dim", -1)
        if kind != "Shard" or not 0 <= dim < len(size):
            return None
        extent, chunks, index = size[dim], mesh_shape[mesh_dim], coordinate[mesh_dim]
        step = -(-extent // chunks)
        start = min(extent, step * index)
        size[dim] = max(0, min(extent, start + step) - start)
        first[dim] = global_shape[dim] if size[dim] == 0 else first[dim] + start
    return tuple(first)


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
    global_shape = tuple(tensor.shape)
    mesh = dtensor.device_mesh
    offsets = shard_offsets(global_shape, tuple(mesh.shape), mesh.get_coordinate(), placements)
    if offsets is None:  # a placement DTensor shards in its own ways (_StridedShard)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return global_shape, tuple(int(o) for o in offsets), local_tensor(dtensor)
