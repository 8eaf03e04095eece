"""``hf://org/name@revision``: a repository in the local Hugging Face cache, never downloaded.

The syntax follows ``huggingface_hub``'s ``HfFileSystem`` URLs, but shardpoint resolves them
*offline*, in the cache that ``huggingface_hub`` fills (``HF_HUB_CACHE``, by default
``$HF_HOME/hub``, or a ``cache_dir`` given to the call)::

    hf://org/name                       the revision "main" of model repository org/name
    hf://org/name@v1.0                  a branch or tag (looked up in refs/), or
    hf://org/name@<40-hex commit>       a commit (snapshots/<commit>)
    hf://org/name@main/subfolder        a folder inside the snapshot
    hf://datasets/org/name, hf://spaces/org/name
                                        dataset and Space repositories
    hf://gpt2, hf://gpt2@main/sub       a repository id without an organisation

Without ``@``, the first two path segments are the repository id (``org/name``) and the
rest is a subfolder; with ``@``, the repository id is what comes before it. A revision
holding ``/`` (``refs/pr/1``) is written URL-encoded (``refs%2Fpr%2F1``), as in
``HfFileSystem``.

A plain path is never taken for a repository id: ``org/name`` is a local directory, and
only ``hf://`` names the cache. Nothing here touches the network: the cache folder name
comes from ``huggingface_hub.file_download.repo_folder_name``, the revision from the
``refs/`` file (read size-capped, regular files only) and the snapshot folder is the one
``huggingface_hub`` created. A repository or revision that is not cached gives a
:class:`~shardpoint.errors.CheckpointNotFoundError` saying how to fetch it.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from ._storage.paths import cache_blobs_dir, hf_download_command, read_small_file
from ._storage.store import path_arg
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    UnsafePathError,
)

SCHEME = "hf://"

_REPO_TYPES = {"datasets": "dataset", "spaces": "space", "models": "model"}
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_LIKE = re.compile(r"[\w.\-]+/[\w.\-]+")
_REPO_PART = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.\-]*[A-Za-z0-9_])?", re.ASCII)
"""One part of a repository id as the Hub allows it: ASCII letters, digits, ``_ . -``,
starting and ending with a letter, digit or ``_`` (the whole id at most 96 characters)."""
_REF_LIMIT = 4096
"""A refs/ file holds one commit hash; anything larger is not huggingface_hub's."""


@dataclass(frozen=True)
class HubRef:
    """A parsed ``hf://`` reference."""

    repo_type: str
    """``model``, ``dataset`` or ``space``."""
    repo_id: str
    """``org/name`` (or ``name``)."""
    revision: str
    """Branch, tag or commit hash; ``main`` when the reference names none."""
    subfolder: str
    """Folder inside the snapshot (``""`` for the snapshot itself)."""


def is_hub_ref(path: object) -> TypeGuard[str]:
    """True for a string starting with ``hf://``."""
    return isinstance(path, str) and path.startswith(SCHEME)


def _bad(ref: str, why: str) -> CheckpointError:
    return CheckpointNotFoundError(
        f"{ref} is not a Hugging Face cache reference shardpoint understands ({why}); write "
        "hf://org/name, hf://org/name@revision or hf://org/name@revision/subfolder "
        "(hf://datasets/org/name for a dataset)"
    )


def parse_hub_ref(ref: str) -> HubRef:
    """Split ``hf://[datasets/|spaces/]org/name[@revision][/subfolder]``.

    >>> parse_hub_ref("hf://org/name")
    HubRef(repo_type='model', repo_id='org/name', revision='main', subfolder='')
    >>> parse_hub_ref("hf://datasets/org/data@v2/part/a")
    HubRef(repo_type='dataset', repo_id='org/data', revision='v2', subfolder='part/a')
    >>> parse_hub_ref("hf://gpt2@refs%2Fpr%2F1")
    HubRef(repo_type='model', repo_id='gpt2', revision='refs/pr/1', subfolder='')
    """
    rest = ref[len(SCHEME):]
    repo_type = "model"
    first, _, tail = rest.partition("/")
    if first in _REPO_TYPES and tail:
        repo_type, rest = _REPO_TYPES[first], tail
    if "@" in rest:
        repo_id, _, after = rest.partition("@")
        revision, _, subfolder = after.partition("/")
        revision = urllib.parse.unquote(revision)
        if not revision:
            raise _bad(ref, "an empty revision after '@'")
    else:
        segments = rest.split("/")
        repo_id, subfolder, revision = "/".join(segments[:2]), "/".join(segments[2:]), "main"
    parts = repo_id.split("/")
    if not 1 <= len(parts) <= 2 or len(repo_id) > 96 or not all(_REPO_PART.fullmatch(p) for p in parts) or any(
        "--" in p or ".." in p for p in parts
    ):
        raise _bad(ref, f"{repo_id!r} is not a repository id")
    subfolder = subfolder.strip("/")
    for part in subfolder.split("/") if subfolder else []:
        if part in ("", ".", ".."):
            raise _bad(ref, f"the subfolder {subfolder!r} is not a plain relative path")
    for part in revision.split("/"):
        if part in ("", ".", ".."):
            raise _bad(ref, f"the revision {revision!r} is not a branch, tag or commit")
    return HubRef(repo_type, repo_id, revision, subfolder)


def default_cache_dir() -> str:
    """``huggingface_hub``'s cache folder (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _cache_root(cache_dir: object) -> str:
    """The cache folder to look in: ``cache_dir`` (a path), else the default."""
    if cache_dir is None:
        return default_cache_dir()
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise InvalidArgumentTypeError(
            f"cache_dir must be a path (str or os.PathLike) naming a Hugging Face cache folder, "
            f"not {type(cache_dir).__name__}"
        )
    return os.path.expanduser(os.fspath(cache_dir))  # --cache-dir=~/hub: no shell expands that ~


def _fetch_hint(hub: HubRef) -> str:
    return (
        f"shardpoint never downloads; fetch it first with `{hf_download_command(hub.repo_id, hub.repo_type, hub.revision)}` "
        f"(or huggingface_hub.snapshot_download({hub.repo_id!r})), or name the cache folder that "
        "holds it (cache_dir / --cache-dir)"
    )


def resolve_hub_ref(ref: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The local snapshot folder (or its subfolder) that ``ref`` names, found offline.

    Raises:
        CheckpointNotFoundError: the repository, revision or subfolder is not in the cache.
    """
    from huggingface_hub.file_download import repo_folder_name

    hub = parse_hub_ref(ref)
    cache = _cache_root(cache_dir)
    try:
        folder = repo_folder_name(repo_id=hub.repo_id, repo_type=hub.repo_type)
    except ValueError as exc:  # huggingface_hub's HFValidationError: its rules may grow
        raise _bad(ref, f"{hub.repo_id!r} is not a repository id: {str(exc).splitlines()[0][:200]}") from None
    repo = os.path.join(cache, folder)
    label = f"{hub.repo_type} repository {hub.repo_id}"
    if not os.path.isdir(repo):
        raise CheckpointNotFoundError(
            f"{ref}: the {label} is not in the local Hugging Face cache ({cache}); {_fetch_hint(hub)}"
        )
    if _COMMIT.fullmatch(hub.revision):
        commit = hub.revision
    else:
        ref_file = os.path.join(repo, "refs", *hub.revision.split("/"))
        if not os.path.lexists(ref_file):
            raise CheckpointNotFoundError(
                f"{ref}: revision {hub.revision!r} of the {label} is not in the local Hugging Face "
                f"cache ({repo} has no refs/{hub.revision}); {_fetch_hint(hub)}"
            )
        raw = read_small_file(ref_file, where=ref_file, limit=_REF_LIMIT)
        commit = raw.decode("ascii", "replace").strip()
        if not _COMMIT.fullmatch(commit):
            raise CheckpointNotFoundError(
                f"{ref_file} does not hold a commit hash ({raw[:60]!r}); the cache entry is "
                "damaged: fetch the repository again"
            )
    snapshot = os.path.join(repo, "snapshots", commit)
    if not os.path.isdir(snapshot):
        raise CheckpointNotFoundError(
            f"{ref}: commit {commit} of the {label} is not in the local Hugging Face cache "
            f"({snapshot} does not exist); {_fetch_hint(hub)}"
        )
    if not hub.subfolder:
        return snapshot
    target = os.path.join(snapshot, *hub.subfolder.split("/"))
    inside = os.path.realpath(snapshot) + os.sep
    real = os.path.realpath(target)
    # A file of the snapshot is a link into the repository's blobs/, as every cached file is.
    blobs = cache_blobs_dir(os.path.realpath(snapshot))
    blob = os.path.isfile(target) and blobs is not None and os.path.dirname(real) in (blobs, os.path.realpath(blobs))
    if os.path.lexists(target) and not real.startswith(inside) and not blob:
        raise UnsafePathError(
            f"{ref}: {target} is a link that leaves the cached snapshot (to "
            f"{os.path.realpath(target)}); refusing to follow it: the cache entry is damaged or forged"
        )
    if not os.path.isdir(target) and not os.path.isfile(target):
        raise CheckpointNotFoundError(
            f"{ref}: {hub.subfolder!r} is not in the cached snapshot {snapshot}; {_fetch_hint(hub)}"
        )
    return target


def local_path(path: Any, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """``path`` itself, or for an ``hf://`` reference its cached snapshot folder.

    A relative path that does not exist but reads like a repository id that *is* cached
    (``org/name``) is not looked up (a local path never silently becomes a cached model):
    the error says to write ``hf://org/name``.
    """
    if is_hub_ref(path):
        return resolve_hub_ref(path, cache_dir)
    path = path_arg(path) if isinstance(path, (str, os.PathLike)) else path  # '' and NUL refused, ~ expanded
    if isinstance(path, str) and _REPO_LIKE.fullmatch(path) and not os.path.lexists(path):
        try:
            from huggingface_hub.file_download import repo_folder_name

            cache = _cache_root(cache_dir)
            cached = os.path.isdir(os.path.join(cache, repo_folder_name(repo_id=path, repo_type="model")))
        except (ImportError, ValueError):
            cached = False
        if cached:
            raise CheckpointNotFoundError(
                f"{path} does not exist as a local path; the repository {path} is in the local "
                f"Hugging Face cache ({cache}): name it as hf://{path} to read it from there"
            )
    return path


def resolve_hub(
    path: Any, storage_options: Mapping[str, Any] | None = None
) -> tuple[Any, Mapping[str, Any] | None]:
    """At the API edge: an ``hf://`` reference becomes its local snapshot folder.

    ``storage_options`` may hold ``cache_dir`` for an ``hf://`` reference (nothing else
    applies: nothing is downloaded). Any other path and its options pass through unchanged.

    >>> resolve_hub("/data/ckpt", None)
    ('/data/ckpt', None)
    """
    if not is_hub_ref(path):
        return local_path(path), storage_options
    options = dict(storage_options or {})
    cache_dir = options.pop("cache_dir", None)
    if options:
        raise InvalidArgumentError(
            f"storage_options {sorted(options)} do not apply to {path}: an hf:// reference is read "
            "from the local Hugging Face cache, never downloaded; only 'cache_dir' is accepted"
        )
    return resolve_hub_ref(path, cache_dir), None
