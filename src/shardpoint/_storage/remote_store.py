"""A prefix on an fsspec filesystem (``s3://``, ``gs://``, ``memory://``): its objects, with retries.

:class:`RemoteStore` is the small object contract the remote I/O loops use:
:meth:`RemoteStore.upload` streams one object from byte chunks (discarded on any failure,
so no partial object is ever published), :meth:`RemoteStore.read_range` reads a byte range,
and ``list`` / ``get`` / ``put`` / ``delete`` do the rest. Every call goes through
:func:`~shardpoint._storage.retry.retrying`. The checkpoint-level operations (steps,
transactions, tidying) are :class:`~shardpoint._storage.fsspec_store.FsspecStore`'s.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, TypeVar

from .._format.manifest import MANIFEST_NAME, PENDING_NAME
from .._options import current_options
from ..errors import CorruptCheckpointError, InvalidArgumentError, StorageError
from .retry import retrying

_T = TypeVar("_T")
_S = TypeVar("_S", bound="RemoteStore")

PENDING_TEXT = b"a shardpoint save or deletion is in progress or was interrupted\n"
"""Written before anything else of a save and deleted after its manifest."""


class RemoteStore:
    """A prefix on an fsspec filesystem: the objects directly under it are the files."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.listing_not_found = False
        """The last listing of the whole prefix (:meth:`find`) was answered "not found"."""
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")

    def child(self: _S, name: str) -> _S:
        return type(self)(self.fs, f"{self.root}/{name}", f"{self.url}/{name}")

    def parent_and_name(self: _S) -> tuple[_S, str]:
        root, _, name = self.root.rpartition("/")
        url, _, _ = self.url.rpartition("/")
        return type(self)(self.fs, root, url), name

    def path_of(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    # ------------------------------------------------------------------ listing

    def _refresh(self, path: str) -> None:
        with suppress(Exception):
            self.fs.invalidate_cache(path)

    def entries(self) -> tuple[dict[str, int], list[str]]:
        """What sits directly under the prefix: (object name -> size, sub-prefix names)."""

        def run() -> tuple[dict[str, int], list[str]]:
            self._refresh(self.root)
            try:
                found = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                self.listing_not_found = True  # as find() says it
                return {}, []
            self.listing_not_found = False
            files: dict[str, int] = {}
            dirs: list[str] = []
            for e in found:
                full = str(e["name"]).rstrip("/")
                name = full.rpartition("/")[2]
                if not name or (full == self.root and str(e["name"]).endswith("/")):
                    continue  # the prefix's own directory marker (SeaweedFS keeps one)
                if e.get("type") == "directory":
                    if full != self.root:  # an empty prefix listed as itself (SeaweedFS)
                        dirs.append(name)
                else:
                    files[name] = int(e.get("size") or 0)
            return files, dirs

        return retrying("listing", self.url, run)

    def list(self) -> dict[str, int]:
        """Objects directly under the prefix: name -> size ({} when there is none)."""
        return self.entries()[0]

    def find(self) -> dict[str, int]:
        """Every object below the prefix, at any depth: relative name -> size."""

        def run() -> dict[str, int]:
            self._refresh(self.root)
            try:
                found = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                self.listing_not_found = True  # a missing prefix lists empty: this is the bucket (or the like)
                return {}
            self.listing_not_found = False
            cut = len(self.root) + 1
            return {
                str(name)[cut:]: int(info.get("size") or 0)
                for name, info in found.items()
                if info.get("type", "file") == "file" and str(name).startswith(self.root + "/")
            }

        return retrying("listing", self.url, run)

    def info(self) -> dict[str, Any] | None:
        """fsspec info of the prefix itself (an object or a directory), None when absent."""

        def run() -> dict[str, Any] | None:
            self._refresh(self.root)
            try:
                return dict(self.fs.info(self.root))
            except FileNotFoundError:
                return None

        return retrying("looking up", self.url, run)

    # ------------------------------------------------------------------ reading

    def read_range(self, name: str, start: int, nbytes: int) -> bytes:
        """``nbytes`` bytes of object ``name`` from ``start`` (FileNotFoundError if absent)."""
        path = self.path_of(name)

        def run() -> bytes:
            data = self.fs.cat_file(path, start=start, end=start + nbytes)
            if len(data) != nbytes:
                raise CorruptCheckpointError(
                    f"{self.url_of(name)}: read {len(data)} bytes at offset {start} where "
                    f"{nbytes} were expected; the object is truncated or changed while reading"
                )
            return bytes(data)

        return retrying("reading", self.url_of(name), run)

    def get(self, name: str, *, limit: int) -> bytes:
        """A whole small object (index, manifest, pointer), refused when over ``limit``."""
        path = self.path_of(name)

        def run() -> bytes:
            size = self.fs.size(path)
            if size is not None and size > limit:
                raise CorruptCheckpointError(
                    f"{self.url_of(name)} is {size} bytes, over the {limit}-byte limit for JSON "
                    "files; refusing to parse it"
                )
            return bytes(self.fs.cat_file(path))

        return retrying("reading", self.url_of(name), run)

    # ------------------------------------------------------------------ writing

    def put(self, name: str, data: bytes) -> None:
        """Write a small object in one request (it appears whole or not at all)."""
        path = self.path_of(name)
        try:
            retrying("writing", self.url_of(name), lambda: self.fs.pipe_file(path, bytes(data)))
        except FileNotFoundError as exc:  # on a write: the place to write it is not there
            err = StorageError(f"writing {self.url_of(name)} failed: {exc}; its parent does not exist "
                               "(a local or chained URL needs its parent directory): create it, or check the URL")
            err.errno = errno.ENOENT
            raise err from None

    def upload(self, name: str, produce: Callable[[Callable[[Any], object]], _T]) -> _T:
        """Stream object ``name``: ``produce(write)`` calls ``write`` with each chunk in order.

        The object is opened uncommitted (``autocommit=False``: s3fs uploads one multipart
        part per block) and committed only after the last chunk; on any failure the upload
        is discarded (s3fs aborts the multipart upload), so no partial object is published.
        A transient failure restarts the whole object (``produce`` is called again).
        """
        path = self.path_of(name)
        block = current_options().remote.block_bytes

        def run() -> _T:
            f = self.fs.open(path, "wb", block_size=block, autocommit=False)
            try:
                result = produce(f.write)
                f.close()
                f.commit()
            except BaseException:
                _discard(f)
                raise
            return result

        return retrying("uploading", self.url_of(name), run)

    def delete(self, names: Sequence[str]) -> None:
        """Delete objects (absent ones are fine)."""
        for name in names:
            path = self.path_of(name)

            def run(path: str = path) -> None:
                with suppress(FileNotFoundError):
                    self.fs.rm_file(path)

            retrying("deleting", self.url_of(name), run)
        self._refresh(self.root)

    def save_id_of(self, name: str, size: int) -> str | None:
        """The shardpoint save id in the header of object ``name`` (of ``size`` bytes); None
        for an object no save wrote (not safetensors, or without an id) or one gone meanwhile.
        A store error is raised."""
        from .._format.safetensors import read_header_with

        try:
            header = read_header_with(lambda n, offset: self.read_range(name, offset, n), size, name=self.url_of(name),
                                      max_header_bytes=current_options().io.max_header_bytes)
        except (CorruptCheckpointError, FileNotFoundError):
            return None
        found = header.metadata.get("shardpoint.save_id")
        return found if isinstance(found, str) else None

    def abort_uploads(self) -> None:
        """Abort the unfinished multipart uploads below the prefix (S3 only; best effort).

        A save killed in the middle of an upload leaves one behind: not an object, so no
        listing shows it, but its parts take space until it is aborted. Called when a save
        takes over a prefix that an interrupted save left (its pending marker is there), so
        it never aborts the upload of a save that is still alive, unless two saves write one
        prefix at once, which is not supported on a store.
        """
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return
        bucket, _, key = self.root.partition("/")
        with suppress(Exception):  # a store without multipart listing, or no permission to list
            listed = call("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/")
            for upload in listed.get("Uploads", []) or []:
                name = upload.get("Key", "")
                if name.startswith(f"{key}/"):
                    with suppress(Exception):
                        call("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload["UploadId"])

    def delete_tree(self) -> None:
        """Delete every object below the prefix: the manifest first (so no half-deleted
        checkpoint ever loads as ours), the pending marker last.

        The marker is written before anything is deleted: a deletion cut short (a crash in
        retention) leaves a prefix that reads as an interrupted save and refuses to load,
        instead of its remaining data objects reading as a Hugging Face checkpoint.
        """
        names = sorted(self.find())
        if not names:
            return
        if PENDING_NAME not in names:
            self.put(PENDING_NAME, PENDING_TEXT)
            names.append(PENDING_NAME)
        first = [n for n in names if n == MANIFEST_NAME]
        self.delete(first + [n for n in names if n not in (MANIFEST_NAME, PENDING_NAME)])
        self.abort_uploads()  # a dead save's unfinished uploads go with its prefix
        self.delete([PENDING_NAME])
        # A store that keeps directory entries (SeaweedFS): remove the prefix's own. fsspec's
        # rm reads its path as a glob, so a prefix holding * ? [ (`sweep/lr[1]`) would match
        # other runs' (`sweep/lr1`): only the entry itself, then.
        with suppress(Exception):
            if any(c in self.root for c in "*?["):
                self.fs.rm_file(self.root)
            else:
                self.fs.rm(self.root, recursive=True)
        self._refresh(self.root)


S3_SMALLEST_PART = 5 << 20
"""S3 refuses a multipart upload part smaller than this (all but the last)."""


def check_part_size(url: str) -> None:
    """Refuse, before a save to S3 writes anything, an upload part size S3 refuses (every
    upload failed, the error blaming the URL or the bucket)."""
    block = current_options().remote.block_bytes
    if block < S3_SMALLEST_PART and url.split("://", 1)[0] in ("s3", "s3a"):
        raise InvalidArgumentError(
            f"RemoteOptions.block_bytes is {block}, under S3's smallest upload part ({S3_SMALLEST_PART}, 5 MiB): "
            f"raise it (or SHARDPOINT_REMOTE_BLOCK_BYTES) to save to {url}. Nothing was written"
        )


def _discard(f: Any) -> None:
    """Throw away an uncommitted upload, leaving no object (and no error on garbage collection)."""
    with suppress(Exception):
        f.discard()
    try:
        f.closed = True  # fsspec buffered files: nothing left to flush
    except AttributeError:
        with suppress(Exception):
            f.close()

