"""Checkpoints on object stores and other fsspec filesystems (``s3://``, ``gs://``, ``memory://``).

A path with a ``scheme://`` that fsspec knows goes through here; local paths (and
``file://`` URLs, mapped to them) never do, so the local code path stays exactly as it is.

The storage contract is small: :meth:`RemoteStore.upload` streams one object from byte
chunks (discarded on any failure, so no partial object is ever published),
:meth:`RemoteStore.read_range` reads a byte range, and ``list`` / ``put`` / ``delete`` do
the rest. Every call is retried on transient errors (connection reset, timeouts, HTTP 5xx,
throttling) a bounded number of times with exponential backoff, then raised as a
:class:`StorageError` naming the object.

Object stores have no atomic rename, so a save commits by order (:class:`RemoteTransaction`):

1. ``shardpoint.pending`` is written first: the prefix now holds a save in progress.
2. With ``overwrite=True`` the old manifest is deleted, then the old objects: from the
   first deletion on, the prefix no longer loads (the old checkpoint is gone even if this
   save then fails: overwriting an object store is not atomic).
3. Data objects are uploaded concurrently under the final prefix, then the indexes, then
   ``shardpoint.json`` last: its presence is the commit.
4. ``shardpoint.pending`` is deleted.

A prefix with ``shardpoint.pending`` and no ``shardpoint.json`` is a save that never
committed: loads refuse it (it is never read as a Hugging Face checkpoint, even though its
data objects are plain safetensors), ``CheckpointManager`` ignores it and its next save
removes it. A failed save deletes what it uploaded (the marker last); a killed one leaves
the marker, which is what makes it recognizable.
"""

from __future__ import annotations

import errno
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any, TypeVar

from .._format.manifest import MANIFEST_NAME, PENDING_NAME
from .._io.writes import FileWrite, UploadAbortedError, upload_files
from .._options import current_options
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MissingDependencyError,
    StorageError,
)

PENDING_TEXT = b"a shardpoint save or deletion is in progress or was interrupted\n"
"""Written before anything else of a save and deleted after its manifest."""

LOCAL_PROTOCOLS = ("file", "local")

_T = TypeVar("_T")

# Errors worth retrying, by class name anywhere in the exception's MRO (botocore and aiohttp
# are optional, so their classes are not imported).
_TRANSIENT_NAMES = {
    "ConnectionError",
    "TimeoutError",
    "HTTPClientError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "ClientPayloadError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ClientOSError",
    "IncompleteRead",
    "ResponseParserError",
    "FSTimeoutError",
}
_TRANSIENT_ERRNOS = {
    errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EAGAIN,
    errno.EPIPE,
}
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed (network trouble, 5xx, throttling)."""
    if isinstance(exc, (CheckpointError, *_PERMANENT)) or not isinstance(exc, Exception):
        return False
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(exc)
    return any(s in text for s in ("SlowDown", "ServiceUnavailable", "Throttl", "RequestTimeout", "InternalError"))


def retrying(what: str, url: str, action: Callable[[], _T]) -> _T:
    """Run ``action``; retry transient errors with exponential backoff, then raise
    :class:`StorageError` naming ``url``. ``FileNotFoundError`` passes through unchanged
    (callers say what a missing object means)."""
    cfg = current_options()
    attempt = 0
    while True:
        try:
            return action()
        except FileNotFoundError:
            raise
        except CheckpointError:
            raise
        except Exception as exc:
            if not is_transient(exc):
                if not _from_storage(exc):
                    raise  # not the store's error (e.g. raised while producing the bytes)
                hint = (
                    "check the credentials and permissions in storage_options"
                    if isinstance(exc, PermissionError)
                    else "check the URL, the bucket and storage_options"
                )
                raise StorageError(f"{what} {url} failed: {_describe(exc)}; {hint}") from exc
            if attempt >= cfg.remote.retries:
                raise StorageError(
                    f"{what} {url} failed after {attempt + 1} attempts: {_describe(exc)}; the store "
                    "is unreachable or overloaded. Nothing was committed by a failed save; retry "
                    "later, or allow more retries (options=sp.RemoteOptions(retries=...))"
                ) from exc
            time.sleep(cfg.remote.backoff_ms / 1000 * (2**attempt))
            attempt += 1


_STORAGE_MODULES = {"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs", "adlfs", "google", "azure"}


def _from_storage(exc: BaseException) -> bool:
    """Whether ``exc`` came from the filesystem or its client library (not from our code)."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _STORAGE_MODULES


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---------------------------------------------------------------------------- locations


def is_url(path: object) -> bool:
    return isinstance(path, str) and "://" in path


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise MissingDependencyError(
            "fsspec URLs need the optional dependencies: pip install 'shardpoint[s3]' "
            "(fsspec and s3fs; other stores need their fsspec package, e.g. gcsfs)"
        ) from None
    return fsspec


def local_path(path: str) -> str:
    """``file:///x/y`` -> ``/x/y``."""
    return str(_fsspec().core.strip_protocol(path))


def resolve(
    path: Any, storage_options: Mapping[str, Any] | None
) -> tuple[Any, RemoteStore | None]:
    """(local path, None) for a local path or ``file://`` URL; (url, store) for any other URL.

    Raises:
        CheckpointError: ``storage_options`` given with a local path, fsspec missing, or an
            unknown protocol.
    """
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise InvalidArgumentTypeError(
            f"storage_options must be a dict (e.g. {{'key': ..., 'secret': ...}}), not "
            f"{type(storage_options).__name__}"
        )
    if not is_url(path):
        if storage_options:
            raise InvalidArgumentError(
                f"storage_options were given but {path!s} is a local path; they apply to fsspec "
                "URLs only (s3://bucket/prefix, gs://..., memory://...)"
            )
        return path, None
    protocol = path.split("://", 1)[0].split("::")[-1]
    if protocol in LOCAL_PROTOCOLS and "::" not in path:
        if storage_options:
            raise InvalidArgumentError(
                f"storage_options do not apply to the local URL {path}; drop them, or use a remote URL"
            )
        return local_path(path), None
    fsspec = _fsspec()
    try:
        fs, root = fsspec.core.url_to_fs(path, **dict(storage_options or {}))
    except ImportError as exc:
        raise MissingDependencyError(
            f"{path}: the fsspec backend for {protocol}:// is not installed ({exc}); for S3: "
            "pip install 'shardpoint[s3]'"
        ) from None
    except ValueError as exc:
        raise InvalidArgumentError(f"{path}: fsspec cannot open this URL ({exc}); check its spelling") from None
    except TypeError as exc:
        raise InvalidArgumentError(
            f"{path}: storage_options were not accepted by the {protocol}:// backend ({exc})"
        ) from None
    return path, RemoteStore(fs, root, path)


def store_for(path: Any, storage_options: Mapping[str, Any] | None) -> RemoteStore | None:
    """The store of a URL, None for a local path."""
    return resolve(path, storage_options)[1]


# -------------------------------------------------------------------------------- store


class RemoteStore:
    """A prefix on an fsspec filesystem: the objects directly under it are the files."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")

    def child(self, name: str) -> RemoteStore:
        return RemoteStore(self.fs, f"{self.root}/{name}", f"{self.url}/{name}")

    def parent_and_name(self) -> tuple[RemoteStore, str]:
        root, _, name = self.root.rpartition("/")
        url, _, _ = self.url.rpartition("/")
        return RemoteStore(self.fs, root, url), name

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
                return {}, []
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
                return {}
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
        retrying("writing", self.url_of(name), lambda: self.fs.pipe_file(path, bytes(data)))

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
        with suppress(Exception):  # a store that keeps directory entries (SeaweedFS)
            self.fs.rm(self.root, recursive=True)
        self._refresh(self.root)


def _discard(f: Any) -> None:
    """Throw away an uncommitted upload, leaving no object (and no error on garbage collection)."""
    with suppress(Exception):
        f.discard()
    try:
        f.closed = True  # fsspec buffered files: nothing left to flush
    except AttributeError:
        with suppress(Exception):
            f.close()


# --------------------------------------------------------------------------- transaction


class RemoteTransaction:
    """One save into a prefix of an object store (see the module docstring for the order).

    Same methods as :class:`~shardpoint._storage.local.LocalTransaction`; ``directory`` is
    the final URL (every rank of a collective save uploads there directly).
    """

    def __init__(self, store: RemoteStore, *, overwrite: bool) -> None:
        self.store = store
        self.directory = store.url
        self.final = store.url
        self._done = False
        existing, subdirs = store.entries()
        if existing or subdirs:
            committed = MANIFEST_NAME in existing
            if committed and not overwrite:
                raise CheckpointExistsError(
                    f"{store.url} already holds a checkpoint; pass overwrite=True to replace it, "
                    "or save to a new prefix"
                )
            if not committed and PENDING_NAME not in existing:
                raise CheckpointExistsError(
                    f"{store.url} is not empty and holds no shardpoint checkpoint (no "
                    f"{MANIFEST_NAME}); refusing to write into it even with overwrite=True. "
                    "Remove those objects yourself or pick another prefix"
                )
        # The marker names this save, so that before each index and the manifest it can
        # check that no other save has taken the prefix over meanwhile (see write_bytes).
        self._marker = PENDING_TEXT + f"save {uuid.uuid4().hex}\n".encode()
        self._taken_over = False
        store.put(PENDING_NAME, self._marker)
        if existing:
            # The manifest goes first: from here on the prefix never loads as the old checkpoint.
            store.delete([n for n in existing if n == MANIFEST_NAME])
            store.delete([n for n in existing if n not in (MANIFEST_NAME, PENDING_NAME)])
        if PENDING_NAME in existing:
            store.abort_uploads()  # a killed save's unfinished multipart uploads

    def write_files(
        self,
        files: Sequence[FileWrite],
        *,
        durable: bool,
        advance: Callable[[int], None] | None = None,
        write: Callable[..., dict[tuple[str, str], int]] | None = None,
    ) -> dict[tuple[str, str], int]:
        """Upload the data files (``durable`` is implied: an upload is stored once committed)."""
        if write is not None:
            raise InvalidArgumentError(
                f"{self.store.url}: this writer needs a local directory; write the checkpoint "
                "locally, then save it to the store with shardpoint.save(shardpoint.load(...), url)"
            )
        try:
            return upload_files(self.store, files, advance=advance)
        except UploadAbortedError as exc:
            # Most likely another save took the prefix over and aborted our uploads: say so.
            try:
                self._check_still_ours("its data files")
            except StorageError:
                raise exc from None  # the marker cannot be read either: the first error stands
            raise

    def write_bytes(self, name: str, data: bytes, *, durable: bool) -> None:
        """Upload an index or the manifest, once sure the prefix is still this save's."""
        self._check_still_ours(name)
        self.store.put(name, data)

    def _check_still_ours(self, name: str) -> None:
        """Raise if another save replaced our pending marker (or removed it) meanwhile.

        Without conditional writes two saves to one prefix cannot exclude each other; this
        narrows the window to one request: the save that finds its marker gone stops before
        its manifest and leaves the other save's objects alone, so the other one stays whole.
        """
        try:
            current: bytes | None = self.store.get(PENDING_NAME, limit=1 << 16)
        except FileNotFoundError:
            current = None
        if current != self._marker:
            self._taken_over = True
            raise CheckpointExistsError(
                f"{self.store.url}: another save took this prefix over while this one was running "
                f"(its pending marker is no longer this save's); stopped before writing {name}, "
                "leaving the other save's objects in place. Save each run to its own prefix"
            )

    def commit(self, *, durable: bool) -> None:
        """The manifest is uploaded: the save is committed. Drop the pending marker."""
        self._done = True
        with suppress(Exception):  # the manifest wins over a marker left behind
            self.store.delete([PENDING_NAME])

    def abort(self) -> None:
        """Delete what this save uploaded, the pending marker last (best effort: a store
        that is unreachable now keeps the marker, so the prefix still reads as incomplete)."""
        if self._done:
            return
        self._done = True
        if self._taken_over:
            return  # what is under the prefix now belongs to the save that took it over
        with suppress(Exception):
            names = self.store.list()
            self.store.delete([n for n in names if n == MANIFEST_NAME])
            self.store.delete([n for n in names if n not in (MANIFEST_NAME, PENDING_NAME)])
            self.store.delete([PENDING_NAME])

def write_files_at(
    directory: str,
    files: Sequence[FileWrite],
    *,
    durable: bool,
    advance: Callable[[int], None] | None,
    storage_options: Mapping[str, Any] | None,
    local: Callable[..., dict[tuple[str, str], int]],
) -> dict[tuple[str, str], int]:
    """Write ``files`` into a local directory (with ``local``) or upload them under a URL."""
    store = store_for(directory, storage_options)
    if store is None:
        return local(directory, files, durable=durable, advance=advance)
    return upload_files(store, files, advance=advance)
