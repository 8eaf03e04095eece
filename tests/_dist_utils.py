"""Run a function on N gloo ranks (spawned CPU processes) and surface what they raise.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, joins them into
one gloo process group on a free loopback port, and calls ``fn(rank, world_size, *args)``
in each. Every rank's traceback, a rank that dies without one (a crash, a signal) and a
rank that hangs past ``timeout`` become one ``AssertionError`` in the calling test, naming
the ranks. ``fn`` must be importable by name (a module-level function). Ranks listed in
``may_be_killed`` are expected to die of SIGKILL (a fault test kills them): not a failure.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

GRACE_SECONDS = 15.0
"""How long the other ranks may keep running after one rank failed, before they are killed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    report_dir: str,
    args: tuple[Any, ...],
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    faulthandler.enable()  # a rank that crashes (SIGSEGV, SIGABRT) shows its Python stacks
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    report = Path(report_dir) / f"rank{rank}.txt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            fn(rank, world_size, *args)
        finally:
            # Collect reference cycles that still hold gloo work and tensors first: left to
            # the interpreter's finalization, they abort the process now and then
            # ("terminate called without an active exception", SIGABRT) after DTensor use.
            gc.collect()
            dist.destroy_process_group()
    except BaseException:
        report.write_text(traceback.format_exc())
        os._exit(1)  # skip atexit handlers that may block on a broken process group


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    may_be_killed: Collection[int] = (),
) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise what they raise."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sp-ranks-") as report_dir:
        procs = [
            ctx.Process(
                target=_entry, args=(fn, rank, world_size, port, report_dir, args), daemon=True
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        timed_out = False
        killed: set[int] = set()
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None and any(
                p.exitcode not in (None, 0) and not (r in may_be_killed and p.exitcode == -signal.SIGKILL)
                for r, p in enumerate(procs)
            ):
                first_failure = now
            if now > deadline or (
                first_failure is not None and now > first_failure + GRACE_SECONDS
            ):
                timed_out = first_failure is None
                for rank, p in enumerate(procs):
                    if p.is_alive():
                        p.kill()
                        killed.add(rank)
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        problems = []
        for rank, p in enumerate(procs):
            report = Path(report_dir) / f"rank{rank}.txt"
            if report.exists():
                problems.append(f"--- rank {rank} raised:\n{report.read_text()}")
            elif rank in killed:
                why = "timed out" if timed_out else "was stopped after another rank failed"
                problems.append(f"--- rank {rank} {why} (killed)")
            elif rank in may_be_killed:
                if p.exitcode != -signal.SIGKILL:
                    problems.append(f"--- rank {rank} was to be killed but exited with {p.exitcode}")
            elif p.exitcode != 0:
                problems.append(
                    f"--- rank {rank} died with exit code {p.exitcode} (see its stderr)"
                )
        if timed_out:
            problems.insert(0, f"the ranks did not finish within {timeout:.0f} s")
        if problems:
            raise AssertionError(
                f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(problems)
            )
