"""Where a save's files go: a local directory (``local.py``) or an fsspec URL (``remote.py``).

Both transactions have the same few methods: ``write_files`` (the planned data files,
returning their crc32c), ``write_bytes`` (indexes, the manifest), ``commit`` and ``abort``;
``directory`` is where every rank of a collective save writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .._io.writes import FileWrite
from .local import LocalTransaction
from .remote import RemoteTransaction, resolve


class Transaction(Protocol):
    directory: str

    def write_files(
        self,
        files: Sequence[FileWrite],
        *,
        durable: bool,
        advance: Callable[[int], None] | None = None,
        write: Callable[..., dict[tuple[str, str], int]] | None = None,
    ) -> dict[tuple[str, str], int]: ...

    def write_bytes(self, name: str, data: bytes, *, durable: bool) -> None: ...

    def commit(self, *, durable: bool) -> None: ...

    def abort(self) -> None: ...


def open_transaction(
    path: str | os.PathLike[str], *, overwrite: bool, storage_options: Mapping[str, Any] | None
) -> Transaction:
    """A transaction saving to ``path``: local (temp dir + atomic rename) or remote (ordered)."""
    where, store = resolve(path, storage_options)
    if store is None:
        return LocalTransaction(where, overwrite=overwrite)
    return RemoteTransaction(store, overwrite=overwrite)
