"""A prefix of an fsspec filesystem as a :class:`~shardpoint._storage.store.Store`.

:class:`FsspecStore` is a :class:`~shardpoint._storage.remote_store.RemoteStore` (the
object operations, every request retried) with the checkpoint-level ones: children are
sub-prefixes (committed when they hold ``shardpoint.json``), a small file is one PUT
(whole or absent), a deletion takes the manifest first, and a save is a
:class:`~shardpoint._storage.remote_transaction.RemoteTransaction` (the manifest last).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext

from .._format.manifest import MANIFEST_NAME, PENDING_NAME
from .._io.writes import FileWrite, upload_files
from .remote_store import RemoteStore, check_part_size
from .remote_transaction import _OURS_AFTER_A_KILL, RemoteTransaction
from .retry import retrying
from .transaction import Advance, Crcs

_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"}
"""Object stores whose first path component is a bucket the store must already hold."""


class FsspecStore(RemoteStore):
    """A prefix on an fsspec filesystem (``s3://bucket/run``, ``memory://x``)."""

    tracks_versions = False
    small_reads_are_cheap = False
    shared_files = False
    """An object is written whole by one writer: ranks cannot write parts of one file."""
    local_path = None
    """No object here is a file on this machine."""

    @property
    def location(self) -> str:
        return self.url

    def children(self) -> dict[str, bool]:
        """One listing of everything below: sub-prefix -> whether it holds a manifest."""
        return {top: MANIFEST_NAME in inside for top, inside in self._by_child().items()}

    def _by_child(self) -> dict[str, set[str]]:
        """One listing of everything below: sub-prefix -> the names under it."""
        names: dict[str, set[str]] = {}
        for name in self.find():
            top, sep, rest = name.partition("/")
            if sep:
                names.setdefault(top, set()).add(rest)
        return names

    def read_small(self, name: str, *, limit: int) -> bytes:
        return self.get(name, limit=limit)

    def replace_small(self, name: str, data: bytes) -> None:
        self.put(name, data)  # one PUT: whole or absent

    def version(self, name: str) -> tuple[int, ...] | None:
        return None

    def make(self) -> None:
        return None

    def missing_bucket(self) -> str | None:
        """The bucket of this prefix when the store says it does not exist (a typo in the
        URL reads as an empty prefix: a resume would silently start over), else None. Asked
        only when the prefix lists empty; one request, and only where the listing itself said
        "not found" (a prefix-scoped policy denies the bucket probe while listing fine)."""
        protocol = self.url.split("://", 1)[0]
        bucket = self.root.split("/", 1)[0]
        if protocol not in _BUCKET_PROTOCOLS or not bucket or not self.listing_not_found:
            return None  # the listing answered (an empty prefix of a bucket there): a new run
        exists = retrying("looking up the bucket of", self.url, lambda: self.fs.exists(bucket))
        return None if exists else bucket

    def locked(self, wait_s: float) -> AbstractContextManager[None]:
        return nullcontext()  # no locks on an object store: one manager per root

    def put_back_moved_aside(self) -> None:
        return None  # nothing is ever moved aside here

    def tidy(self, children: re.Pattern[str], small_files: Collection[str] = ()) -> None:
        """Remove what shardpoint left under the child prefixes matching ``children`` that hold
        no manifest but its pending marker (a save cut short, or a deletion by retention cut
        short: each writes the marker first), and nothing else: the marker and the objects
        only a save names (data objects, indexes), the save's unfinished uploads aborted.
        A prefix without the marker is the user's, whatever it holds: a step copied in
        (``aws s3 cp`` writes ``shardpoint.json`` last), an export of safetensors files
        shardpoint wrote; it keeps every object. Small files are written in one request:
        none is ever torn."""
        for top, names in sorted(self._by_child().items()):
            if MANIFEST_NAME in names or PENDING_NAME not in names or not children.match(top):
                continue
            child = self.child(top)
            mine = sorted(n for n in names if "/" not in n and n.endswith(_OURS_AFTER_A_KILL))
            child.delete(mine)
            child.abort_uploads()
            child.delete([PENDING_NAME])  # last: until then the prefix reads as an interrupted save
            if not names - set(mine) - {PENDING_NAME}:
                child.delete_tree()  # nothing of the user's: the prefix goes (a store's directory entry)

    def write_data_files(self, files: Sequence[FileWrite], *, durable: bool, advance: Advance,
                         local: Callable[..., Crcs]) -> Crcs:
        """Upload planned files under this prefix (``local`` is the local writer: unused)."""
        return upload_files(self, files, advance=advance)

    def open_transaction(self, *, overwrite: bool) -> RemoteTransaction:
        check_part_size(self.url)
        return RemoteTransaction(self, overwrite=overwrite)

    def writing_into(self, directory: str) -> FsspecStore:
        """The same filesystem at ``directory`` (a remote transaction's is its final prefix:
        this store itself)."""
        if directory == self.url:
            return self
        return FsspecStore(self.fs, self.fs._strip_protocol(directory), directory)
