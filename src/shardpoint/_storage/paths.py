"""The one rule for which files a checkpoint directory may name, whatever the format.

A file named by an index, a manifest or a directory listing must be a plain basename
(``_format.names.check_file_name``) and must resolve, after following symlinks, to a file
directly inside the checkpoint directory. The single exception is the Hugging Face cache:
in ``…/models--org--name/snapshots/<revision>/`` every file is a symlink to
``../../blobs/<hash>``, and such a link is followed when it lands directly in the ``blobs``
folder of the same cached repository. Anything else that leaves the directory is refused
by name with :class:`~shardpoint.errors.UnsafePathError`.

Safetensors, ``.bin`` shards and their indexes, DCP folders and the manager's control
files all go through :func:`member_path`.
"""

from __future__ import annotations

import os
import stat

from .._format.names import check_file_name
from ..errors import CorruptCheckpointError, UnsafePathError

_CACHE_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def cache_blobs_dir(real_directory: str) -> str | None:
    """The ``blobs`` folder of the cached repository holding this snapshot directory.

    ``real_directory`` is already resolved (``os.path.realpath``). Returns None unless it is
    ``<repo>/snapshots/<revision>`` or a folder below it (``…/<revision>/subfolder``), with
    ``<repo>`` named ``models--…``, ``datasets--…`` or ``spaces--…``, as ``huggingface_hub``
    lays out its cache.

    >>> cache_blobs_dir("/home/u/.cache/huggingface/hub/models--gpt2/snapshots/abc123")
    '/home/u/.cache/huggingface/hub/models--gpt2/blobs'
    >>> cache_blobs_dir("/hub/datasets--org--data/snapshots/abc123/part/a")
    '/hub/datasets--org--data/blobs'
    >>> cache_blobs_dir("/data/ckpt/step-100") is None
    True
    """
    parts = real_directory.split(os.sep)
    # The innermost "snapshots" with a revision below it and a cached repository above it.
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i + 1] and parts[i - 1].startswith(_CACHE_REPO_PREFIXES):
            return os.path.join(os.sep.join(parts[:i]) or os.sep, "blobs")
    return None


def hf_download_command(repo_id: str, repo_type: str = "model", revision: str = "main") -> str:
    """The ``hf download`` command that fetches a repository (a revision other than ``main``).

    >>> hf_download_command("org/data", "dataset", "v2")
    'hf download org/data --repo-type dataset --revision v2'
    """
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    rev = "" if revision == "main" else f" --revision {revision}"
    return f"hf download {repo_id}{kind}{rev}"


def missing_file_advice(directory: str) -> str:
    """What to do about a file a checkpoint lists that is not there: in a Hugging Face cache
    snapshot, download it again (an interrupted download leaves part of a snapshot); else
    copy it back.

    >>> missing_file_advice("/data/ckpt/step-100")
    'copy the file back or load another checkpoint'
    >>> missing_file_advice("/hub/models--org--name/snapshots/0123abc")
    'the Hugging Face cache holds only part of this snapshot (an interrupted download?): fetch it again with `hf download org/name --revision 0123abc`'
    """
    real = os.path.realpath(directory)
    blobs = cache_blobs_dir(real)
    if blobs is None:
        return "copy the file back or load another checkpoint"
    repo = os.path.basename(os.path.dirname(blobs))
    kind, _, name = repo.partition("--")  # models--org--name, datasets--, spaces--
    revision = real[len(os.path.dirname(blobs)) :].split(os.sep)[2]
    command = hf_download_command(name.replace("--", "/"), kind[:-1], revision)
    return (
        "the Hugging Face cache holds only part of this snapshot (an interrupted download?): fetch "
        f"it again with `{command}`"
    )


def member_path(directory: str, name: str, *, where: str) -> str:
    """The path to open for file ``name`` of the checkpoint in ``directory``.

    Args:
        directory: the checkpoint directory as the user named it.
        name: a file name read from an index, a manifest or a listing (untrusted).
        where: how errors name the checkpoint (the path the user gave).

    Returns:
        ``os.path.join(directory, name)``, once the name and its symlink target are
        known to stay inside the directory (or inside the cached repository's ``blobs``).
        The directory itself may be reached through links (a symlinked ``HF_HOME``), and
        the ``blobs`` folder may be a link to another disk: both are compared resolved.

    Raises:
        UnsafePathError: the name is not a plain basename, or it is a symlink whose
            target leaves the directory (and is not a blob of the same cached repository;
            a blob that is itself a link to elsewhere is refused too).
    """
    check_file_name(name, where=where)
    path = os.path.join(directory, name)
    real_dir = os.path.realpath(directory)
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    if parent == real_dir:
        return path
    blobs = cache_blobs_dir(real_dir)
    if blobs is not None and parent in (blobs, os.path.realpath(blobs)):
        return path
    raise UnsafePathError(
        f"{where}: {name!r} is a symlink that leaves the checkpoint directory (to {real}); "
        "refusing to read it. Only links inside the directory, or into the same Hugging Face "
        "cache repository's blobs/, are followed; copy the file into the directory instead"
    )


def open_regular(path: str, *, where: str) -> int:
    """Open ``path`` read-only, refusing anything but a regular file once links are followed.

    FIFOs, sockets, devices (``/dev/zero``) and directories are refused with
    :class:`~shardpoint.errors.CorruptCheckpointError`; the open never blocks (a FIFO with no
    writer would wait forever without ``O_NONBLOCK``).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(
            f"{where} is not a regular file (a FIFO, device, socket or directory); "
            "the checkpoint is damaged or forged"
        )
    return fd


def read_small_file(path: str, *, where: str, limit: int) -> bytes:
    """The bytes of a small control file (JSON, ``latest``), at most ``limit`` of them.

    Checked with :func:`open_regular` first; a file larger than ``limit`` is refused before
    anything is read, so a huge or sparse file costs no memory.
    """
    fd = open_regular(path, where=where)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpointError(
                f"{where} is {size} bytes, over the {limit}-byte limit for this kind of file; "
                "refusing to read it (the file is damaged or forged)"
            )
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{where} grew past the {limit}-byte limit while being read")
    return data
