"""Progress bars on long work, shown only where a person is watching (a terminal)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def byte_progress(total: int, desc: str, enabled: bool | None) -> Iterator[Callable[[int], None] | None]:
    """Yield an ``advance(nbytes)`` callback driving a tqdm bar, or None when disabled.

    ``enabled=None`` shows the bar only when stderr is a terminal and the work is large.
    """
    if enabled is None:
        enabled = sys.stderr.isatty() and total >= 64 << 20
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm

    from ._printable import printable

    desc = printable(desc)  # names a checkpoint chose: no terminal controls

    lock = threading.Lock()
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, leave=False,
              dynamic_ncols=True) as bar:  # follows the terminal when it is resized

        def advance(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        yield advance


def loading_label(location: str) -> str:
    """A load's bar label: the checkpoint's last path component."""
    return f"loading {os.path.basename(os.path.normpath(location))}"
