"""Pausing Python's cyclic garbage collector while a call builds many objects.

Parsing a manifest and header of 10^5 tensors and creating their records and tensors
allocates millions of container objects, none of them in a reference cycle. Each
allocation counts towards the collector's next pass, and a full pass walks every object
the process holds (a model's 10^5 parameters among them): in a load of 10^5 small tensors
the collector's passes took a third of the time (``benchmarks/small_tensors.py``). The
objects are freed by reference counting whether the collector runs or not.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with the cyclic collector off, if it was on; on again after.

    Cycles created meanwhile (by this thread or another) are collected at the next pass
    after the block. A collector the caller turned off stays off.

    Example:
        >>> import gc
        >>> with collector_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
