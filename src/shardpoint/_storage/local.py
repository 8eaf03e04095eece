"""Atomic checkpoint directories on a POSIX filesystem.

A save writes into a hidden sibling ``.<name>.tmp-<uuid>/``, fsyncs every file, writes the
indexes and then the manifest, fsyncs the directory and renames it into place, then fsyncs
the parent. On Linux the rename is ``renameat2``: ``RENAME_NOREPLACE`` so two saves of one
name cannot both win, and ``RENAME_EXCHANGE`` for ``overwrite=True`` so at every instant
either the old or the new checkpoint sits at the path.

An overwrite replaces only what the old checkpoint *owns* (:func:`owned_names`): before the
swap every other regular file and symlink of the old directory is hard-linked (or copied)
into the new one, after it every other entry left in the old directory (subdirectories,
files created meanwhile) is moved into the new one, and the old directory is removed only
when nothing of the user's is left in it. So a ``config.json``, tokenizer files or notes
beside the weights survive, and a load sees the old weights or the new, never a mix.

A save holds an exclusive ``flock`` on its temporary directory until it commits or aborts,
and creates its marker (:func:`marker_name`, naming the directory) in it first. The next
save of the same name tells the leftovers of saves that died (no lock, marker naming the
directory: removed) from saves still running (locked: left alone) and from a replaced
directory whose move-out was cut short (no lock, no such marker: finished, never removed
while it holds anything of the user's). Where ``renameat2`` is missing the old directory is
moved aside to ``.<name>.tmp-old-<uuid>`` before the new one moves in; a crash in between
leaves the path missing, and the next save of that name (or a ``CheckpointManager`` on the
parent) puts the old directory back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from .._format.index import index_name
from .._format.manifest import MANIFEST_NAME
from .._format.names import TMP_MARKER, is_tmp_name
from .._io.files import naming
from .._io.writes import FileWrite, write_files
from .._options import current_options
from ..errors import CheckpointError, CheckpointExistsError, StorageError
from .paths import read_small_file

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2 = getattr(_libc, "renameat2", None)
except OSError:  # pragma: no cover - non-glibc platforms
    _renameat2 = None


def _rename2(src: str, dst: str, flags: int) -> bool:
    """renameat2; False when the kernel or filesystem does not support the flag."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with naming(os.fspath(path)):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_small_file(path: str, data: bytes, *, durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with naming(path):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
    finally:
        os.close(fd)


SAVE_MARKER = ".shardpoint-save"
"""Prefix of a save's marker file, :func:`marker_name`."""

_NAME_MAX = 255
_HEX = 32
_OLD = "old-"
_SAVE_TMP = re.compile(r"[0-9a-f]{32}")
"""What follows ``.<stem>.tmp-`` in the temporary directory of a save (its uuid)."""
_OLD_TMP = re.compile(r"old-[0-9a-f]{32}")
"""What follows ``.<stem>.tmp-`` in a directory moved aside by an overwrite without
``renameat2`` (a whole previous version of the path)."""
_WEIGHT_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}\.safetensors")


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


def _temp_prefix(final: Path) -> str:
    return f".{temp_stem(final.name)}{TMP_MARKER}"


def _lock(fd: int) -> bool | None:
    """flock ``fd`` without waiting: True, False when another process holds it, None where
    the filesystem has no locks (then nothing is ever removed as stale)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        return None
    return True


def _make_locked_temp(final: Path, *, durable: bool = False) -> tuple[str, int | None]:
    """Create ``.<stem>.tmp-<uuid>``, lock it and write its :data:`SAVE_MARKER`; the fd is
    None where locks do not work."""
    for _ in range(5):
        directory = str(final.parent / f"{_temp_prefix(final)}{uuid.uuid4().hex}")
        os.mkdir(directory)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # removed between mkdir and open, taken for a dead save's: start over
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(directory)
            raise
        locked = _lock(fd)
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


def remove_temp(directory: str) -> None:
    """Remove a save's own temporary directory, its marker last: cut short (a kill), what
    is left is still recognised as a dead save's and removed by the next save."""
    marker = marker_name(directory)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if entry.name != marker:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
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


def _manifest_doc(directory: str) -> dict[str, object] | None:
    """The manifest of ``directory`` as plain JSON, None if absent or damaged (not a
    regular file, too large, not JSON). A disk error reading it is raised."""
    where = os.path.join(directory, MANIFEST_NAME)
    try:
        doc = json.loads(read_small_file(where, where=where, limit=current_options().io.max_json_bytes))
    except (FileNotFoundError, CheckpointError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _components(doc: dict[str, object] | None) -> set[str]:
    comps = doc.get("components") if doc else None
    return {c for c in comps if isinstance(c, str)} if isinstance(comps, dict) else set()


def is_weight_file_of(name: str, components: set[str]) -> bool:
    """Whether ``name`` is a Hugging Face weight file or index of one of ``components``:
    ``{c}.safetensors``, ``{c}-NNNNN-of-NNNNN.safetensors``, ``{c}.safetensors.index.json``.

    >>> is_weight_file_of("model-00002-of-00003.safetensors", {"model"})
    True
    >>> is_weight_file_of("tokenizer.json", {"model"}), is_weight_file_of("adapter.safetensors", {"model"})
    (False, False)
    """
    if name.endswith(".safetensors.index.json"):
        return name[: -len(".safetensors.index.json")] in components
    shard = _WEIGHT_SHARD.fullmatch(name)
    if shard:
        return shard.group(1) in components
    return name.endswith(".safetensors") and name[: -len(".safetensors")] in components


def owned_names(directory: str, names: Sequence[str], components: set[str]) -> set[str]:
    """The entries of ``directory`` (listed as ``names``) that its checkpoint owns, when a
    save of ``components`` replaces it: everything its manifest lists (data files, the
    components' indexes, the manifest), a save's marker, and the Hugging Face weight files
    and indexes of the components being written or of its own. Everything else is the
    user's (``config.json``, tokenizer files, notes, subdirectories) and is kept."""
    owned = {MANIFEST_NAME} | {n for n in names if n.startswith(SAVE_MARKER)}
    doc = _manifest_doc(directory) if MANIFEST_NAME in names else None
    own = _components(doc)
    files = doc.get("files") if doc else None
    if isinstance(files, dict):
        owned |= {f for f in files if isinstance(f, str)}
    owned |= {index_name(c) for c in own}
    every = components | own
    owned |= {n for n in names if is_weight_file_of(n, every)}
    return owned & set(names) | {MANIFEST_NAME}


def _version(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, stat.S_IFMT(st.st_mode))


def _carry_over(old: str, new: str, replaced: set[str], *, durable: bool) -> dict[str, tuple[int, ...]]:
    """Hard-link (or copy, keeping metadata) into ``new`` each regular file of ``old`` not in
    ``replaced`` and not already in ``new``, and recreate its symlinks; directories and
    other entries are moved after the swap. Returns name -> the version carried."""
    carried: dict[str, tuple[int, ...]] = {}
    for entry in os.scandir(old):
        name = entry.name
        if name in replaced or os.path.lexists(os.path.join(new, name)):
            continue
        src, dst = entry.path, os.path.join(new, name)
        st = entry.stat(follow_symlinks=False)
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
            os.symlink(os.readlink(src), dst)
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
    kept = []
    moved = 0
    for entry in list(os.scandir(old)):
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
        except OSError:
            kept.append(name)
    return kept, moved


def _finish_replaced(old: str, final: str, *, replaced: set[str] | None = None,
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
            components = _components(_manifest_doc(final))
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
            f"({len(kept)} entries) whose names are taken in {final} by other files; "
            "it is kept: move what you need out of it, then delete it",
            stacklevel=3,
        )
        return moved > 0
    shutil.rmtree(old, ignore_errors=True)
    if not os.path.lexists(old):  # the record is needed until the old directory is gone
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(final, marker_name(old)))
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
    prefix = _temp_prefix(final)
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
            continue
        try:
            locked = _lock(fd)
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
                _finish_replaced(entry.path, str(final))
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
    prefix = _temp_prefix(final)
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


# ------------------------------------------------------------------ errors


_ADVICE = {
    errno.ENOSPC: "free space on that filesystem or save somewhere else",
    errno.EDQUOT: "free space within your quota or save somewhere else",
    errno.EROFS: "the filesystem is mounted read-only: save to a writable location",
    errno.EACCES: "you may not write there: fix the directory's permissions or save somewhere else",
    errno.EPERM: "the filesystem refused the operation: fix the permissions or save somewhere else",
    errno.ENAMETOOLONG: "use a shorter checkpoint name or path",
    errno.EIO: "the disk reported an I/O error: check it and try again",
}


NOTHING_LEFT = (
    "Nothing was committed there by this save: the checkpoint that was there before, if any, "
    "is unchanged, and this save's temporary directory is removed"
)


@contextlib.contextmanager
def reported(
    final: str | os.PathLike[str], doing: str, left: Callable[[], str] = lambda: NOTHING_LEFT
) -> Iterator[None]:
    """Turn an OSError of a local save into :class:`~shardpoint.errors.StorageError` naming
    the checkpoint path, the file (where the OSError names one), the errno's meaning, what
    to do and what the failure left behind (``left()``); ``errno`` is kept. An OSError
    without an errno (a write that stored nothing) is reported as ``EIO``."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        code = exc.errno if exc.errno is not None else errno.EIO
        meaning = os.strerror(code)
        advice = _ADVICE.get(code, "check the filesystem and try again")
        raise StorageError(
            code,
            f"saving {os.fspath(final)} failed while {doing}: {meaning} ({exc}); {advice}. {left()}",
        ) from exc


# ------------------------------------------------------------------ the transaction


class LocalTransaction:
    """One save into ``final``: write files into ``.directory``, then ``commit()``."""

    def __init__(self, final: str | os.PathLike[str], *, overwrite: bool) -> None:
        self.final = Path(final).absolute()
        self.overwrite = overwrite
        with reported(self.final, "creating its temporary directory"):
            recover(self.final)
            self._check_target()
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self.directory, self._lock_fd = _make_locked_temp(self.final)
        self._done = False
        self._components: set[str] = set()
        """The components of the new checkpoint (read from its manifest before the swap)."""

    def _check_target(self) -> None:
        if not os.path.lexists(self.final):
            return
        if not self.overwrite:
            raise CheckpointExistsError(
                f"{self.final} already exists; pass overwrite=True to replace it, "
                "or save to a new path"
            )
        if not self.final.is_dir() or self.final.is_symlink():
            raise CheckpointExistsError(
                f"{self.final} exists and is not a shardpoint checkpoint, nor a directory "
                "(a file or a symlink); refusing to replace it even with overwrite=True. "
                "Remove it yourself or pick another path"
            )

    def write_files(
        self,
        files: Sequence[FileWrite],
        *,
        durable: bool,
        advance: Callable[[int], None] | None = None,
        write: Callable[..., dict[tuple[str, str], int]] | None = None,
    ) -> dict[tuple[str, str], int]:
        """Write the planned data files into the temporary directory (``write`` replaces
        :func:`~shardpoint._io.writes.write_files`, as ``convert`` does)."""
        with reported(self.final, "writing its data files"):
            return (write or write_files)(self.directory, files, durable=durable, advance=advance)

    def write_bytes(self, name: str, data: bytes, *, durable: bool) -> None:
        with reported(self.final, f"writing {name}"):
            write_small_file(os.path.join(self.directory, name), data, durable=durable)

    def commit(self, *, durable: bool) -> None:
        """Make the checkpoint visible at ``final`` in one step (see the module docstring)."""
        with reported(self.final, "committing", self._left):
            self._commit(durable=durable)

    def _left(self) -> str:
        """What a failed commit left behind."""
        if not self._done:
            return NOTHING_LEFT
        return (
            f"The new checkpoint is in place at {self.final}, but the filesystem failed after the "
            "rename (it may not survive a power loss); load it to check it, and save again if "
            "it is not whole"
        )

    def _commit(self, *, durable: bool) -> None:
        self._check_target()
        replaced: set[str] = set()
        carried: dict[str, tuple[int, ...]] = {}
        old_fd: int | None = None
        # Without overwrite, never the replacing branch, even if the path appeared since the
        # check: only the no-replace rename, which fails if another save committed meanwhile.
        replace = self.overwrite and os.path.lexists(self.final)
        try:
            if replace:
                replaced, carried, old_fd = self._carry(durable=durable)
            elif durable:
                fsync_dir(self.directory)
            if not replace:
                try:
                    renamed = _rename2(self.directory, str(self.final), _RENAME_NOREPLACE)
                except FileExistsError:
                    if not self.overwrite:
                        raise CheckpointExistsError(
                            f"{self.final} was created by someone else while this save ran; "
                            "this save was discarded"
                        ) from None
                    self._check_target()  # another save committed meanwhile: replace it, as asked
                    replace = True
                    replaced, carried, old_fd = self._carry(durable=durable)
                else:
                    if not renamed:
                        os.rename(self.directory, self.final)
                    self._done = True
                    with contextlib.suppress(OSError):
                        os.unlink(self.final / marker_name(self.directory))
                    if durable:
                        fsync_dir(self.final.parent)
            if replace:
                old = self._swap()
                self._done = True  # from here on self.directory may be the old one: never abort it
                try:
                    if durable:
                        fsync_dir(self.final.parent)
                finally:
                    moved = _finish_replaced(
                        old, str(self.final), replaced=replaced, carried=carried, components=self._components
                    )
                if durable and moved:
                    fsync_dir(self.final)
        finally:
            if old_fd is not None:
                os.close(old_fd)
        self._unlock()

    def _carry(self, *, durable: bool) -> tuple[set[str], dict[str, tuple[int, ...]], int | None]:
        """Before an overwrite's swap: lock the old directory (so no other save takes it
        for a dead one's once it sits at a hidden name) and carry the user's files over."""
        new_names = {n for n in os.listdir(self.directory) if not n.startswith(SAVE_MARKER)}
        self._components = components = _components(_manifest_doc(self.directory))
        old = str(self.final)
        fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _lock(fd)
            # The folder keeps its permission bits (a group-shared 2775 model folder stays so).
            with contextlib.suppress(OSError):
                os.chmod(self.directory, stat.S_IMODE(os.fstat(fd).st_mode))
            names = os.listdir(old)
            replaced = owned_names(old, names, components) | new_names
            carried = _carry_over(old, self.directory, replaced, durable=durable)
            record = {"replaced": sorted(replaced), "carried": {n: list(v) for n, v in carried.items()}}
            marker = os.path.join(self.directory, marker_name(self.directory))
            write_small_file(marker, json.dumps(record).encode(), durable=durable)
            if durable:
                fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        return replaced, carried, fd

    def _swap(self) -> str:
        """Put the new directory at ``final``; return where the old one now is."""
        if _rename2(self.directory, str(self.final), _RENAME_EXCHANGE):
            return self.directory  # no marker of its own there: never taken for a dead save's
        # No atomic exchange here: move the old one aside first. A crash in between leaves
        # the path missing and the old directory whole at `.tmp-old-`: the next save of
        # this name (or a CheckpointManager) puts it back.
        prefix = _temp_prefix(self.final)
        aside = str(self.final.parent / f"{prefix}{_OLD}{os.path.basename(self.directory)[len(prefix):]}")
        os.rename(self.final, aside)
        try:
            os.rename(self.directory, self.final)
        except BaseException:
            os.rename(aside, self.final)  # put the previous checkpoint back
            raise
        return aside

    def abort(self) -> None:
        if not self._done:
            remove_temp(self.directory)
            self._done = True
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
