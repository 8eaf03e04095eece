"""Where checkpoints live: one :class:`~shardpoint._storage.store.Store` per path.

``store.open_store`` resolves a path once, at the API edge, to a ``LocalStore`` (a
directory; ``local.py``, ``local_recovery.py``, ``posix.py``) or an ``FsspecStore`` (an
fsspec URL; ``remote_store.py``, ``remote_transaction.py``, ``retry.py``, and the I/O loops
in ``remote.py``). A save goes through the store's :class:`Transaction`.
"""

from __future__ import annotations

from .store import Store, open_store, open_transaction
from .transaction import Transaction

__all__ = ["Store", "Transaction", "open_store", "open_transaction"]
