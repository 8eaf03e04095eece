"""The storage seam: a path is resolved to its :class:`Store` once, at the API edge.

:func:`open_store` turns what the user passed (a directory, a ``file://`` URL, or any other
fsspec URL with its ``storage_options``) into a :class:`Store`: a
:class:`~shardpoint._storage.local_store.LocalStore` (a directory: pwrite/preadv, the C
loops, ``O_DIRECT``, ``renameat2``) or an :class:`~shardpoint._storage.fsspec_store.FsspecStore`
(a prefix of an object store). Callers above ``_storage/`` ask the store, never whether a
path is a URL; the differences that remain (an atomic rename vs the manifest last) are in
the store's transaction, and the few capabilities that differ are named properties.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from .._io.writes import FileWrite
from .._options import current_options
from ..errors import InvalidArgumentError, InvalidArgumentTypeError, MissingDependencyError
from .fsspec_store import FsspecStore
from .local_store import LocalStore
from .transaction import Advance, Crcs, Transaction

LOCAL_PROTOCOLS = ("file", "local")


class Store(Protocol):
    """Where checkpoints live: a local directory or a prefix of an object store.

    A store stands for one directory (prefix); :meth:`child` is the one below it by name.
    """

    @property
    def location(self) -> Path | str:
        """The directory (a ``Path``) or URL this store stands for, as errors name it."""

    @property
    def tracks_versions(self) -> bool:
        """Whether :meth:`version` tells a file from its replacement (a local inode; an
        object store: no), so that a step retired while it was read can be told apart."""

    @property
    def shared_files(self) -> bool:
        """Whether ranks of a collective save may write parts of one file here (a shared
        POSIX filesystem; an object is written whole by one writer), as layout ``hf`` needs."""

    @property
    def small_reads_are_cheap(self) -> bool:
        """Whether reading a small file costs no request (a local disk): retention then
        reads every step's manifest and never counts or deletes a damaged one."""

    @property
    def local_path(self) -> str | None:
        """The path on this machine's filesystem (files readable by path: ``mmap``,
        ``torch.load``), None on an object store."""

    def child(self, name: str) -> Store:
        """The directory (prefix) ``name`` directly below this one."""

    def children(self) -> dict[str, bool]:
        """Directories directly below: name -> whether it holds a committed checkpoint."""

    def read_small(self, name: str, *, limit: int) -> bytes:
        """A small file (a pointer, a manifest), refused when over ``limit`` or not a regular
        file (``CorruptCheckpointError``); ``FileNotFoundError`` when absent."""

    def replace_small(self, name: str, data: bytes) -> None:
        """Write a small file whole, atomically (temp + fsync + rename; one PUT)."""

    def version(self, name: str) -> tuple[int, ...] | None:
        """What tells file ``name`` from a replacement (None: absent, or not tracked)."""

    def make(self) -> None:
        """Create the directory if it is missing (an object store has nothing to create)."""

    def missing_bucket(self) -> str | None:
        """The bucket of an object store's prefix when the store says it does not exist, after
        the prefix listed empty (None: it exists, or a local directory, which has none)."""

    def locked(self, wait_s: float) -> AbstractContextManager[None]:
        """Hold the store's lock (other managers of this root wait), up to ``wait_s`` for it."""

    def put_back_moved_aside(self) -> None:
        """Put back a child that an interrupted overwrite moved aside (local only)."""

    def tidy(self, children: re.Pattern[str], small_files: Collection[str] = ()) -> None:
        """Remove what crashed saves and deletions left here: dead temporary directories,
        half-deleted children, torn temporaries of the ``small_files`` (see
        :meth:`replace_small`), and child prefixes whose names match ``children`` holding
        objects but no manifest (interrupted remote saves)."""

    def delete_tree(self) -> None:
        """Delete this checkpoint so that no half-deleted one ever loads (local: renamed to a
        hidden name first; an object store: the manifest first)."""

    def write_data_files(
        self, files: Sequence[FileWrite], *, durable: bool, advance: Advance, local: Callable[..., Crcs]
    ) -> Crcs:
        """Write planned files straight here (a local directory with ``local``; uploads)."""

    def open_transaction(self, *, overwrite: bool) -> Transaction:
        """Start a save here; its commit makes it visible (see the transaction modules)."""

    def writing_into(self, directory: str) -> Store:
        """The store a collective save's rank writes its files into: ``directory`` is the
        coordinator's transaction's (a local temporary directory; an object store's final
        prefix, where the manifest goes last)."""


def open_store(path: Any, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store of ``path``: a local directory (or ``file://`` URL), or any fsspec URL.

    Raises:
        InvalidArgumentTypeError: ``storage_options`` is not a mapping.
        InvalidArgumentError: ``storage_options`` given with a local path, or an URL fsspec
            cannot open.
        MissingDependencyError: fsspec, or the backend of the URL's protocol, is missing.
    """
    where, store = resolve(path, storage_options)
    return LocalStore(where) if store is None else store


def path_arg(path: object) -> str | os.PathLike[str]:
    """A local path argument, refused clearly where it cannot name a file; a leading ``~``
    is the user's home, as a shell would read it (a directory literally named ``~`` in the
    working directory is a trap: ``rm -rf ~`` is how users would clean it up)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentTypeError(
            f"the path must be a str or os.PathLike (a directory, a file or a URL), not {type(path).__name__}"
        )
    text = os.fspath(path)
    if not isinstance(text, str):
        raise InvalidArgumentTypeError(f"the path must be text, not {type(text).__name__}")
    if "\x00" in text or not text:
        raise InvalidArgumentError(f"the path {text[:80]!r} is empty or holds a NUL character; no file has that name")
    return home_expanded(path)


def home_expanded(path: Any) -> Any:
    """``path`` with a leading ``~`` read as the user's home; anything else as it is."""
    if isinstance(path, (str, os.PathLike)) and not isinstance(text := os.fspath(path), bytes) and text[:1] == "~":
        return os.path.expanduser(text)
    return path


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


def resolve(path: Any, storage_options: Mapping[str, Any] | None) -> tuple[Any, FsspecStore | None]:
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
    if isinstance(path, str) and path[:5].lower() == "hf://":  # reads resolved it to the cache before this
        raise InvalidArgumentError(
            f"{path[:200]} names a repository in the local Hugging Face cache, which shardpoint only reads "
            "(never downloads, never writes); save to a local folder and upload that with huggingface_hub "
            "(HfApi().upload_folder(folder_path=..., repo_id=...))"
        )
    if not is_url(path):
        path = path_arg(path)
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
    bounded = protocol in _BOTOCORE_PROTOCOLS and "::" not in path
    kwargs, own_retries = _bounded_requests(storage_options) if bounded else (dict(storage_options or {}), False)
    try:
        fs, root = fsspec.core.url_to_fs(path, **kwargs)
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
    if not str(root).strip("/") and "::" not in path:
        raise InvalidArgumentError(
            f"{path} names no bucket or prefix: give the place of the checkpoint, e.g. {protocol}://bucket/run/step-100"
        )
    if own_retries and isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1  # s3fs's own loop; fsspec caches this instance for these very options only
    return path, FsspecStore(fs, root, path)


_BOTOCORE_PROTOCOLS = ("s3", "s3a")


def _bounded_requests(storage_options: Mapping[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """``storage_options`` with botocore's connect and read timeouts set to
    ``RemoteOptions.timeout_s`` where the user set none, and the client's own retries off
    where the user set none, so that an endpoint that never answers fails in about
    ``(retries + 1) * timeout_s``: botocore's 5 attempts inside s3fs's 5, inside each of
    ours, at botocore's 60 s read timeout, blocked a load for hours. Also whether the
    client's retries were switched off here (s3fs's own loop is then set to one attempt)."""
    options = dict(storage_options or {})
    config = options.get("config_kwargs")
    if config is not None and not isinstance(config, Mapping):
        return options, False  # the backend names the mistake
    config = dict(config or {})
    timeout = current_options().remote.timeout_s
    config.setdefault("connect_timeout", timeout)
    config.setdefault("read_timeout", timeout)
    own_retries = "retries" not in config
    if own_retries:
        config["retries"] = {"total_max_attempts": 1}
    options["config_kwargs"] = config
    return options, own_retries
