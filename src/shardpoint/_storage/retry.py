"""Retries of object-store requests: which errors are transient, and the one retry loop.

Every request of :class:`~shardpoint._storage.fsspec_store.FsspecStore` runs through
:func:`retrying`: transient errors (connection reset, timeouts, HTTP 5xx, throttling) are
retried ``RemoteOptions.retries`` times with exponential backoff (``backoff_ms``), then
raised as :class:`~shardpoint.errors.StorageError` naming the object.
"""

from __future__ import annotations

import errno
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

from .._options import current_options
from ..errors import CheckpointError, StorageError

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
            silent = _timed_out(exc)
            if attempt >= cfg.remote.retries:
                waited = f" (no answer within {cfg.remote.timeout_s} s each time: RemoteOptions.timeout_s)" if silent else ""
                raise StorageError(
                    f"{what} {url} failed after {attempt + 1} attempts: {_describe(exc)}{waited}; the store "
                    "is unreachable or overloaded. Nothing was committed by a failed save; retry "
                    "later, or allow more retries (options=sp.RemoteOptions(retries=...))"
                ) from exc
            if silent and attempt == 0:
                left = cfg.remote.retries * cfg.remote.timeout_s
                warnings.warn(
                    f"{what} {url}: the store gave no answer within {cfg.remote.timeout_s} s; retrying "
                    f"{cfg.remote.retries} more time(s), so the call may wait up to about {left} s more "
                    "(sp.RemoteOptions(timeout_s=..., retries=...) set this)",
                    stacklevel=2,
                )
            time.sleep(cfg.remote.backoff_ms / 1000 * (2**attempt))
            attempt += 1


_STORAGE_MODULES = {"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs", "adlfs", "google", "azure",
                    "huggingface_hub", "httpx", "httpx2", "httpcore", "requests", "urllib3"}


def _from_storage(exc: BaseException) -> bool:
    """Whether ``exc`` came from the filesystem or its client library (not from our code):
    an ``OSError``, an error class of such a library, or any error raised inside one (a
    ``TypeError`` from the client refusing a ``storage_options`` entry it was given)."""
    if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _STORAGE_MODULES:
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    deepest = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return str(deepest).split(".")[0] in _STORAGE_MODULES


def _timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a request that waited for the store past its timeout."""
    return isinstance(exc, TimeoutError) or any("Timeout" in cls.__name__ for cls in type(exc).__mro__)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

