"""Where checkpoints live: one :class:`~shardpoint._storage.store.Store` per path.

``store.open_store`` resolves a path once, at the API edge, to a ``LocalStore`` (a
directory; ``local_store.py``, ``local.py``, ``local_recovery.py``, ``posix.py``) or an
``FsspecStore`` (an fsspec URL; ``fsspec_store.py``, ``remote_store.py``,
``remote_transaction.py``, ``retry.py``). A save goes through the store's
:class:`~shardpoint._storage.transaction.Transaction`; the bytes of both kinds of store move
through the engines of ``_io/`` (which reach a store only through protocols of their own,
so they never import this package).
"""

from __future__ import annotations

from .store import Store, open_store
from .transaction import Transaction

__all__ = ["Store", "Transaction", "open_store"]
