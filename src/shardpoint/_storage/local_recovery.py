"""Local saves' hidden siblings: names, markers, what a checkpoint owns, and recovery.

An overwrite replaces only what the old checkpoint *owns* (:func:`owned_names`): before the
swap every other regular file and symlink of the old directory is hard-linked (or copied)
into the new one (:func:`carry_over`), after it every other entry left in the old
directory is moved into the new one (:func:`finish_replaced`), and the old directory is
removed only when nothing of the user's is left in it.

A save holds an exclusive ``flock`` on its temporary directory until it commits or aborts,
and creates its marker (:func:`marker_name`, naming the directory) in it first. The next
save of the same name (:func:`recover`) tells the leftovers of saves that died (no lock,
marker naming the directory: removed) from saves still running (locked: left alone) and
from a replaced directory whose move-out was cut short (no lock, no such marker: finished,
never removed while it holds anything of the user's). A whole previous version moved aside
to ``.<name>.tmp-old-<uuid>`` by an overwrite without ``renameat2`` is put back when the
path is missing. The transaction making these siblings is
:class:`~shardpoint._storage.local.LocalTransaction`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

from .._format.manifest import MANIFEST_NAME
from .._format.names import TMP_MARKER, is_tmp_name
from .._format.safetensors import read_header
from .._options import current_options
from ..errors import CheckpointError, CorruptCheckpointError
from . import ownership
from .ownership import SAVE_MARKER, manifest_components
from .paths import read_small_file
from .posix import _RENAME_NOREPLACE, _rename2, lock_nowait, write_small_file

_NAME_MAX = 255
_HEX = 32
_OLD = "old-"
_SAVE_TMP = re.compile(r"[0-9a-f]{32}")
"""What follows ``.<stem>.tmp-`` in the temporary directory of a save (its uuid)."""
_OLD_TMP = re.compile(r"old-[0-9a-f]{32}")
"""What follows ``.<stem>.tmp-`` in a directory moved aside by an overwrite without
``renameat2`` (a whole previous version of the path)."""


def temp_stem(name: str) -> str:
    """The part of ``name`` used in its hidden siblings' names, short enough that
    ``.<stem>.tmp-old-<32 hex>`` fits in NAME_MAX (255 bytes).

    Names that fit are used as they are; longer ones are cut and given a digest of the
    whole name, so every save of one name finds the same siblings.

    >>> temp_stem("step-000100")
    'step-000100'
    >>> len(os.fsencode(f".{temp_stem('x' * 250)}.tmp-old-{'0' * 32}"))
    255
    """
    room = _NAME_MAX - len(f".{TMP_MARKER}{_OLD}") - _HEX
    encoded = os.fsencode(name)
    if len(encoded) <= room:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    cut = encoded[: room - len(digest) - 1].decode("utf-8", "ignore")
    return f"{cut}~{digest}"


def temp_prefix(final: Path) -> str:
    return f".{temp_stem(final.name)}{TMP_MARKER}"



def make_locked_temp(final: Path, *, durable: bool = False) -> tuple[str, int | None]:
    """Create ``.<stem>.tmp-<uuid>``, lock it and write its :data:`SAVE_MARKER`; the fd is
    None where locks do not work."""
    for _ in range(5):
        directory = str(final.parent / f"{temp_prefix(final)}{uuid.uuid4().hex}")
        os.mkdir(directory)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # removed between mkdir and open, taken for a dead save's: start over
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(directory)
            raise
        locked = lock_nowait(fd)
        # Between mkdir and flock another save may have taken it for a dead save's (it
        # holds the lock, or has removed it): start over under a new name.
        if locked is None or (
            locked and os.path.exists(directory) and os.path.samestat(os.fstat(fd), os.stat(directory))
        ):
            try:
                write_small_file(os.path.join(directory, marker_name(directory)), b"", durable=durable)
            except BaseException:
                os.close(fd)
                shutil.rmtree(directory, ignore_errors=True)
                raise
            if locked is None:
                os.close(fd)
                return directory, None
            return directory, fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "could not create and lock a temporary directory", str(final.parent))


def marker_name(directory: str) -> str:
    """The marker a save creates first in its temporary directory ``.<stem>.tmp-<uuid>``:
    ``.shardpoint-save-<uuid>``, naming the directory. It is empty (no disk block: a full
    disk still takes it), so a dead directory holding the marker of its own name is a
    save's (removable), and one without is a directory a commit replaced (it may hold the
    user's files: finished, never removed blindly). Before an overwrite's swap it records
    the names the new checkpoint replaces and the user's files carried over, so the
    move-out can be finished after a crash; it leaves the committed checkpoint once that
    is done.

    >>> marker_name("/data/.ckpt.tmp-0123456789abcdef0123456789abcdef")
    '.shardpoint-save-0123456789abcdef0123456789abcdef'
    """
    return f"{SAVE_MARKER}-{os.path.basename(directory).rpartition(TMP_MARKER)[2][-_HEX:]}"


def remove_tree(path: str) -> bool:
    """Remove a directory tree of ours (a save's temporary directory, a replaced checkpoint);
    directories in it that were made read-only (``chmod 555`` of a checkpoint folder) are
    made writable first, as ``rm -rf`` by their owner would need. True when it is gone."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return True
    _writable_dirs(path)
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def _writable_dirs(path: str) -> None:
    """Give the owner write and search permission on ``path`` and every directory under it."""
    def own(directory: str) -> None:
        with contextlib.suppress(OSError):
            mode = os.lstat(directory).st_mode
            if stat.S_ISDIR(mode) and mode & stat.S_IRWXU != stat.S_IRWXU:
                os.chmod(directory, stat.S_IMODE(mode) | stat.S_IRWXU)

    own(path)
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            own(os.path.join(root, name))


def remove_temp(directory: str) -> None:
    """Remove a save's own temporary directory, its marker last: cut short (a kill), what
    is left is still recognised as a dead save's and removed by the next save."""
    marker = marker_name(directory)
    _writable_dirs(directory)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if entry.name != marker:
            if entry.is_dir(follow_symlinks=False):
                remove_tree(entry.path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, marker))
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def _is_own_temp(directory: str) -> bool:
    """Whether ``directory`` holds the marker naming it: a save's own temporary directory."""
    return os.path.lexists(os.path.join(directory, marker_name(directory)))


def _recorded_move_out(final: str, old_name: str) -> tuple[set[str], dict[str, tuple[int, ...]]] | None:
    """What the save that replaced ``old_name`` (at a temp or ``tmp-old-`` name of the same
    uuid) by ``final`` recorded in its marker, now in ``final``: the names it replaced and
    the files it carried over. None if there is no such record."""
    where = os.path.join(final, marker_name(old_name))
    try:
        info = json.loads(read_small_file(where, where=where, limit=current_options().io.max_json_bytes))
    except (OSError, CheckpointError, ValueError, RecursionError):
        return None
    if not isinstance(info, dict):
        return None
    replaced = info.get("replaced")
    carried = info.get("carried")
    if not isinstance(replaced, list) or not isinstance(carried, dict):
        return None
    return (
        {n for n in replaced if isinstance(n, str)},
        {n: tuple(v) for n, v in carried.items() if isinstance(v, list)},
    )


# ------------------------------------------------------------------ what a checkpoint owns


def manifest_doc(directory: str) -> dict[str, object] | None:
    """The manifest of ``directory`` as plain JSON, None if absent or damaged (not a
    regular file, too large, not JSON). A disk error reading it is raised."""
    where = os.path.join(directory, MANIFEST_NAME)
    try:
        doc = json.loads(read_small_file(where, where=where, limit=current_options().io.max_json_bytes))
    except (FileNotFoundError, CheckpointError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def owned_names(directory: str, names: Sequence[str], components: set[str]) -> set[str]:
    """The entries of ``directory`` (listed as ``names``) that its checkpoint owns when a
    save of ``components`` replaces it (the rule: :func:`.ownership.owned_names`), each
    data file the manifest lists read from the directory for its save id."""
    doc = manifest_doc(directory) if MANIFEST_NAME in names else None
    return ownership.owned_names(names, doc, components, lambda name: _local_save_id(directory, name))


def _local_save_id(directory: str, name: str) -> str | None:
    """The ``shardpoint.save_id`` in the header of regular file ``name`` of ``directory``
    (None for anything else, or where it cannot be read)."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO):
            return None  # gone, a symlink, or not ours to read: not the save's (kept)
        raise  # a disk error is the save's to report, not a reason to guess
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        header = read_header(fd, st.st_size, name=name, max_header_bytes=current_options().io.max_header_bytes)
    except CorruptCheckpointError:
        return None  # not a safetensors file the save wrote
    finally:
        os.close(fd)
    save_id = header.metadata.get("shardpoint.save_id")
    return save_id if isinstance(save_id, str) else None


def _version(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, stat.S_IFMT(st.st_mode))


def carry_over(old: str, new: str, replaced: set[str], *, durable: bool) -> dict[str, tuple[int, ...]]:
    """Hard-link (or copy, keeping metadata) into ``new`` each regular file of ``old`` not in
    ``replaced`` and not already in ``new``, and recreate its symlinks; directories and
    other entries are moved after the swap. Returns name -> the version carried."""
    carried: dict[str, tuple[int, ...]] = {}
    for entry in os.scandir(old):
        name = entry.name
        if name in replaced or os.path.lexists(os.path.join(new, name)):
            continue
        src, dst = entry.path, os.path.join(new, name)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile (another save finishing the directory it replaced)
        if stat.S_ISREG(st.st_mode):
            try:
                os.link(src, dst, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError:
                shutil.copy2(src, dst, follow_symlinks=False)  # no hard links here
                if durable:
                    fd = os.open(dst, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        elif stat.S_ISLNK(st.st_mode):
            try:
                os.symlink(os.readlink(src), dst)
            except FileNotFoundError:
                continue
        else:
            continue
        carried[name] = _version(st)
    return carried


def _move_into(src: str, dst: str) -> bool:
    """Rename ``src`` to ``dst`` unless ``dst`` exists; False if it does."""
    try:
        if _rename2(src, dst, _RENAME_NOREPLACE):
            return True
    except FileExistsError:
        return False
    if os.path.lexists(dst):
        return False
    os.rename(src, dst)
    return True


def _move_out(
    old: str, final: str, replaced: set[str], carried: dict[str, tuple[int, ...]]
) -> tuple[list[str], int]:
    """After the swap: bring into ``final`` what of ``old`` is the user's and not there yet.

    ``replaced`` entries (the old checkpoint's, and names the new one wrote itself) stay, to
    be removed with ``old``; a carried file still the same version as its link is a
    duplicate; one changed since (replaced or rewritten during the save) replaces its
    carried copy; any other entry is renamed into ``final``. Returns the names that could
    not be placed (a name taken in ``final`` by something else): they stay in ``old``;
    and how many entries were moved.
    """
    kept: list[str] = []
    moved = 0
    try:
        entries = list(os.scandir(old))
    except FileNotFoundError:
        return kept, moved  # another save's recovery finished it (from the record in final's marker)
    for entry in entries:
        name = entry.name
        if name in replaced:
            continue
        dst = os.path.join(final, name)
        try:
            st = entry.stat(follow_symlinks=False)
            if name in carried:
                if _version(st) == carried[name]:
                    continue
                if not stat.S_ISDIR(st.st_mode) and not os.path.isdir(dst):
                    os.replace(entry.path, dst)  # the user's newer version wins
                    moved += 1
                    continue
            elif os.path.lexists(dst) and os.path.samestat(st, os.stat(dst, follow_symlinks=False)):
                continue
            if _move_into(entry.path, dst):
                moved += 1
            else:
                kept.append(name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            kept.append(f"{name} ({_why_not_moved(exc)})")
    return kept, moved


def _why_not_moved(exc: OSError) -> str:
    """Why an entry of a replaced folder could not be renamed into the new one."""
    if exc.errno in (errno.EBUSY, errno.EXDEV):
        return "a mount point, which cannot be moved: unmount it, move its mount, or keep it out of checkpoint folders"
    return os.strerror(exc.errno) if exc.errno else str(exc)


def finish_replaced(old: str, final: str, *, replaced: set[str] | None = None,
                     carried: dict[str, tuple[int, ...]] | None = None,
                     components: set[str] | None = None) -> bool:
    """Move the user's entries out of the replaced directory ``old`` into ``final``, then
    remove ``old`` if nothing but what the old checkpoint owned is left; otherwise keep it
    and warn, naming it and what it holds. Returns whether anything was moved."""
    try:
        names = os.listdir(old)
    except OSError:
        return False
    # What ``old`` owns is read again from ``old`` itself: a concurrent overwrite may have
    # swapped in another save's checkpoint since the carry-over looked at the path.
    try:
        if components is None:
            components = manifest_components(manifest_doc(final))
        owned = owned_names(old, names, components)
    except OSError:
        if replaced is None:
            return False  # cannot tell what is the user's: leave it for the next save
        owned = set()
    if replaced is None:
        replaced = set()
        recorded = _recorded_move_out(final, os.path.basename(old))
        if recorded is not None:
            replaced, carried = recorded
    replaced = replaced | owned
    kept, moved = _move_out(old, final, replaced, carried or {})
    if kept:
        warnings.warn(
            f"{final} was replaced, but {old} still holds {sorted(kept)[:5]} "
            f"({len(kept)} entries) that could not be moved into it (a name taken there by other files, "
            "unless said otherwise); it is kept: move what you need out of it, then delete it",
            stacklevel=3,
        )
        return moved > 0
    if remove_tree(old):  # the record is needed until the old directory is gone
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(final, marker_name(old)))
    else:
        warnings.warn(
            f"{final} was replaced, but the previous checkpoint could not be removed from {old} (its files "
            "or folders may not be ours to delete); delete it yourself to free its space",
            stacklevel=3,
        )
    return moved > 0


def recover(final: str | os.PathLike[str], *, no_locks_means_dead: bool = False) -> None:
    """Tidy the hidden siblings that saves of ``final`` left when they died (their lock is
    free), and put ``final`` back if a replacement was cut short.

    * ``.<stem>.tmp-old-<uuid>``, a whole previous version moved aside by an overwrite
      without ``renameat2``: renamed back to ``final`` if ``final`` is missing (the
      interrupted save is abandoned), else finished as below.
    * a directory a commit replaced (a temp name without its marker): the user's entries
      are moved into ``final``, then it is removed once nothing of the user's is left.
    * a save's own temporary directory (marker naming it), or an empty one: removed.

    Where the filesystem has no locks nothing is touched, unless ``no_locks_means_dead``
    (a ``CheckpointManager``, the only writer of its root, says so).
    """
    final = Path(final).absolute()
    prefix = temp_prefix(final)
    try:
        entries = sorted(
            (e for e in os.scandir(final.parent) if e.name.startswith(prefix)),
            key=lambda e: not _OLD_TMP.fullmatch(e.name[len(prefix):]),  # moved-aside first
        )
    except OSError:
        return
    for entry in entries:
        suffix = entry.name[len(prefix) :]
        aside = _OLD_TMP.fullmatch(suffix)
        if not aside and not _SAVE_TMP.fullmatch(suffix):
            continue  # another kind of hidden sibling (a manager's `del-`, `latest`)
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            if aside and not os.path.lexists(final):  # a file a save replaced (replacing_a_file)
                with contextlib.suppress(OSError):
                    os.rename(entry.path, final)
            continue
        try:
            locked = lock_nowait(fd)
            if locked is False or (locked is None and not no_locks_means_dead):
                continue  # a save still running (or a filesystem without locks)
            if aside and not os.path.lexists(final):
                with contextlib.suppress(OSError):
                    _move_into(entry.path, str(final))
                continue
            if not aside and _is_own_temp(entry.path):
                remove_temp(entry.path)
            elif not aside and not os.listdir(entry.path):
                os.rmdir(entry.path)  # died before writing its marker
            elif os.path.isdir(final) and not os.path.islink(final):
                finish_replaced(entry.path, str(final))
        except OSError:
            continue
        finally:
            os.close(fd)


def recover_all(parent: str | os.PathLike[str], *, no_locks_means_dead: bool = False) -> None:
    """:func:`recover` for every path of ``parent`` with leftovers beside it (names short
    enough to be used whole in their siblings' names, as a manager's steps are)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    finals = set()
    for name in names:
        if not is_tmp_name(name):
            continue
        stem, _, suffix = name[1:].rpartition(TMP_MARKER)
        if stem and (_SAVE_TMP.fullmatch(suffix) or _OLD_TMP.fullmatch(suffix)) and temp_stem(stem) == stem:
            finals.add(stem)
    for stem in sorted(finals):
        recover(os.path.join(parent, stem), no_locks_means_dead=no_locks_means_dead)


def moved_aside(final: str | os.PathLike[str]) -> list[str]:
    """Whole previous versions of ``final`` moved aside by an interrupted overwrite."""
    final = Path(final).absolute()
    prefix = temp_prefix(final)
    try:
        return sorted(
            e.path for e in os.scandir(final.parent)
            if e.name.startswith(prefix) and _OLD_TMP.fullmatch(e.name[len(prefix):])
        )
    except OSError:
        return []


def hidden_sibling_message(location: str) -> str:
    """Why a load refuses the hidden sibling ``location`` and what to do, by its kind."""
    base = os.path.basename(os.path.normpath(location))
    stem, _, suffix = base[1:].rpartition(TMP_MARKER)
    target = os.path.join(os.path.dirname(os.path.normpath(location)), stem)
    if _OLD_TMP.fullmatch(suffix):
        return (
            f"{location} is a whole previous version of {target}, moved aside by an overwrite "
            "that never committed (a filesystem without renameat2); it is not loaded from here. "
            f"Do not delete it: if {target} is missing, rename it back (mv {location} {target}); "
            f"the next save of {target}, or a CheckpointManager on its folder, does that for you"
        )
    if _SAVE_TMP.fullmatch(suffix) and os.path.isdir(location) and not _is_own_temp(location):
        return (
            f"{location} is a directory that a save to {target} replaced, left while its files "
            "were being moved back (the save never committed this cleanup); it is not loaded "
            f"from here. Do not delete it: it may hold your files; the next save of {target} "
            "moves them back, or move them yourself"
        )
    return (
        f"{location} is the temporary directory of a save that never committed; "
        "it is not a checkpoint. Load the committed one beside it, or delete it"
    )


def missing_path_message(location: str) -> str:
    """What to tell a load of a missing ``location``: where a moved-aside version lies."""
    aside = moved_aside(location)
    if not aside:
        return f"{location} does not exist; nothing to load"
    return (
        f"{location} does not exist, but {aside[-1]} beside it holds its whole previous "
        "version, moved aside by an overwrite that was interrupted (a filesystem without "
        f"renameat2). Rename it back (mv {aside[-1]} {location}), or save to {location} "
        "again or open a CheckpointManager on its folder, which puts it back; do not delete it"
    )

