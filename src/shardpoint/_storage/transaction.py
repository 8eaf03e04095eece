"""What every save writes through: a transaction of one store (local or fsspec).

A transaction has four steps: ``write_files`` (the planned data files, returning their
crc32c), ``write_bytes`` (indexes, the manifest), ``commit`` and ``abort``; ``directory``
is where every rank of a collective save writes. How the commit makes the save visible is
the store's: a local directory is renamed into place in one step
(:class:`~shardpoint._storage.local.LocalTransaction`), an object store's manifest is
uploaded last (:class:`~shardpoint._storage.remote_transaction.RemoteTransaction`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._io.writes import FileWrite

Crcs = dict[tuple[str, str], int]
"""(file, key) -> crc32c of the stored bytes."""
Advance = Callable[[int], None] | None
"""Called with each number of bytes written (a progress bar), or None."""
Writer = Callable[..., Crcs] | None
"""A replacement for the local data-file writer (``convert`` streams with its own), or None."""


class Transaction:
    """One save into one store: ``write_files``, ``write_bytes``, then ``commit`` or ``abort``."""

    directory: str
    """Where the data files go (a temporary directory, or the final URL of an object store)."""

    def write_files(
        self,
        files: Sequence[FileWrite],
        *,
        durable: bool,
        advance: Advance = None,
        write: Writer = None,
    ) -> Crcs:
        """Write the planned data files; return (file, key) -> crc32c."""
        return self._write_files(files, durable, advance, write)

    def _write_files(self, files: Sequence[FileWrite], durable: bool, advance: Advance, write: Writer) -> Crcs:
        raise NotImplementedError

    def write_bytes(self, name: str, data: bytes, *, durable: bool) -> None:
        """Write a small file (an index, the manifest) whole."""
        raise NotImplementedError

    def commit(self, *, durable: bool) -> None:
        """Make the save visible (the store decides how)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Remove what this save wrote (best effort); the previous checkpoint is untouched."""
        raise NotImplementedError
