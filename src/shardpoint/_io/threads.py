"""How many threads an I/O engine runs, and the one runner they all use: the caller's thread
and as many more, each taking the next item when done with one, under the call's options;
on the first error no further item starts and that error is raised."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from .._options import adopt, current_options

_T = TypeVar("_T")


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_share(processes_here: int) -> int:
    """CPUs of this machine for one of ``processes_here`` processes (0 when they outnumber
    the CPUs), or this process's own CPUs when it is pinned to fewer than the machine has."""
    mine, machine = cpu_count(), os.cpu_count() or 1
    return mine if mine < machine else machine // max(1, processes_here)


MAX_WRITER_THREADS = 4


def writer_threads(processes_here: int = 1) -> int:
    """Writer threads for one process: ``SHARDPOINT_WRITE_THREADS`` when set, otherwise up
    to 4 but no more than this process's share of the CPUs.

    Writing to the page cache is CPU work (the kernel's copy, crc32c); more writers than
    cores only contend. On 2 cores a 2.14 GB save took 0.41 s with 2 threads and 0.47 s with
    4 (median of 5), and with 2 or 4 ranks on those cores, 1 thread per rank beat 4 by
    10-65 %. ``processes_here`` is the number of ranks on this machine, whose share is the
    CPUs divided among them, unless the process is pinned to fewer CPUs than the machine
    has (a launcher that binds each rank to its own cores): then its own CPUs are its share.

        >>> writer_threads() >= 1
        True
    """
    configured = current_options().io.write_threads
    if configured > 0:
        return configured
    return max(1, min(MAX_WRITER_THREADS, _cpu_share(processes_here)))


MAX_READER_THREADS = 8


def reader_threads(processes_here: int = 1, *, cached: bool = False) -> int:
    """Reader threads for one process: ``SHARDPOINT_READ_THREADS`` when set; otherwise, for
    bytes that must come from the disk, four times this process's share of the CPUs, at most
    8 (but never fewer than the share, nor than 2), and for bytes already in the page cache
    (``cached``) the share itself, at least 2.

    A cold read waits on the disk: more requests in flight keep it busier, so a process
    runs more readers than it has cores (a 2.14 GB cold load on this 2-core VM: 0.85-0.93 s
    with 8 threads against 0.92-1.05 s with 4, three runs). Copying from the page cache is
    CPU work: there readers beyond the cores only contend (the same load warm, read by the
    engine alone: 0.307 s on 2 threads, 0.350 s on 4; median of 7), but a rank reading on
    one thread cannot overlap its reads with its own Python work (warm collective loads of
    1 GB on 2 cores, 2 threads per rank against 1: 1.55x against 1.69x the plain read with
    2 ranks, 1.56x against 2.15x with 4). Ranks sharing a machine share its cores: with 4
    ranks on 2 cores, a cold collective load of 1.94 GB took 1.08-1.10 s with 4 threads per
    rank and 0.99-1.00 s with 2 (median of 5, two runs).
    ``processes_here`` and the share: as for :func:`writer_threads`.

        >>> 2 <= reader_threads() <= 8
        True
        >>> 2 <= reader_threads(cached=True) <= reader_threads()
        True
    """
    configured = current_options().io.read_threads
    if configured > 0:
        return configured
    share = _cpu_share(processes_here)
    if cached:
        return max(2, share)
    return max(2, share, min(MAX_READER_THREADS, 4 * share))


def run_all(
    fn: Callable[[_T], object], items: Sequence[_T], threads: int, *, cancelled: threading.Event | None = None
) -> None:
    """``fn(item)`` for every item on up to ``threads`` threads, the caller's among them (only
    the caller's when one will do); the first error sets ``cancelled`` (items not yet
    started are skipped) and is raised once the running ones have finished.

    ``fn`` may watch ``cancelled`` to stop early (an upload in the middle of an object). The
    other threads run under the caller's options and its ``torch.inference_mode``. Each
    thread takes the next item when it is done with one, so a few large items and many
    small ones share the threads evenly.

        >>> done = []
        >>> run_all(done.append, [1, 2, 3], threads=2)
        >>> sorted(done)
        [1, 2, 3]
    """
    if not items:
        return
    if threads <= 1 or len(items) == 1:
        for item in items:
            fn(item)
        return
    stop = cancelled if cancelled is not None else threading.Event()
    errors: list[BaseException] = []
    queue = iter(items)
    lock = threading.Lock()
    options = current_options()
    inference = torch.is_inference_mode_enabled()  # thread-local: a target made under it is changed under it

    def work() -> None:
        while not stop.is_set():
            with lock:
                item = next(queue, _DONE)
            if item is _DONE:
                return
            try:
                fn(item)  # type: ignore[arg-type]
            except BaseException as exc:  # Ctrl-C in the caller's thread too: the others finish first
                if not stop.is_set():
                    errors.append(exc)
                stop.set()

    def helper() -> None:
        adopt(options)
        with torch.inference_mode(inference):
            work()

    # Threads started one by one (each start waits for the thread to run), not a pool fed
    # from a queue: a pool's threads wait for the interpreter lock while the caller submits,
    # and started 2-4 ms late in a 70 ms warm load.
    helpers = [
        threading.Thread(target=helper, name=f"shardpoint-io-{k}") for k in range(min(threads, len(items)) - 1)
    ]
    try:
        for t in helpers:
            t.start()
        work()
    except BaseException:  # an interrupt between items: the other threads take no further item
        stop.set()
        raise
    finally:
        for t in helpers:
            if t.ident is not None:
                try:
                    t.join()
                except BaseException:  # interrupted again while waiting: no further item starts
                    stop.set()
                    raise
    if errors:
        raise errors[0]


_DONE = object()
