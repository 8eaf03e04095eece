"""Where checkpoints live: one :class:`~shardpoint._storage.store.Store` per path.

``store.open_store`` resolves a path once, at the API edge, to a ``LocalStore`` (a
directory; ``local_store.py``, ``local.py``, ``local_recovery.py``, ``posix.py``) or an
``FsspecStore`` (an fsspec URL; ``fsspec_store.py``, ``remote_store.py``,
``remote_transaction.py``, ``retry.py``, and the I/O loops in ``remote.py``). A save goes
through the store's :class:`~shardpoint._storage.transaction.Transaction`.

The names below are served lazily, so that importing one module of this package (as the
I/O layer does for ``RemoteStore``) does not import every store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the static declaration of the lazy re-exports below
    from .store import Store as Store
    from .store import open_store as open_store
    from .store import open_transaction as open_transaction
    from .transaction import Transaction as Transaction

__all__ = ["Store", "Transaction", "open_store", "open_transaction"]


def __getattr__(name: str) -> Any:
    if name in ("Store", "open_store", "open_transaction"):
        from . import store

        return getattr(store, name)
    if name == "Transaction":
        from . import transaction

        return transaction.Transaction
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
