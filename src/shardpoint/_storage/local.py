"""Atomic checkpoint directories on a POSIX filesystem.

A save writes into a hidden sibling ``.<name>.tmp-<uuid>/``, fsyncs every file, writes the
indexes and then the manifest, fsyncs the directory and renames it into place, then fsyncs
the parent. On Linux the rename is ``renameat2``: ``RENAME_NOREPLACE`` so two saves of one
name cannot both win, and ``RENAME_EXCHANGE`` for ``overwrite=True`` so at every instant
either the old or the new checkpoint sits at the path.

An overwrite replaces only what the old checkpoint *owns*: the user's files beside the
weights (``config.json``, tokenizer files, notes) are carried into the new directory, so
they survive, and a load sees the old weights or the new, never a mix. Where ``renameat2``
is missing the old directory is moved aside to ``.<name>.tmp-old-<uuid>`` before the new
one moves in; a crash in between leaves the path missing, and the next save of that name
(or a ``CheckpointManager`` on the parent) puts it back. The hidden siblings, their
markers and that recovery are :mod:`~shardpoint._storage.local_recovery`'s; the POSIX
primitives (``renameat2``, fsync, ``flock``, error reports) :mod:`~shardpoint._storage.posix`'s.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .._format.names import TMP_MARKER
from .._io.writes import FileWrite, write_files
from ..errors import CheckpointExistsError, InvalidArgumentError, StorageError
from .local_recovery import (
    _OLD,
    SAVE_MARKER,
    carry_over,
    finish_replaced,
    make_locked_temp,
    manifest_components,
    manifest_doc,
    marker_name,
    moved_aside,
    owned_names,
    recover,
    recover_all,
    remove_temp,
    temp_prefix,
    temp_stem,
)
from .posix import (
    _RENAME_EXCHANGE,
    _RENAME_NOREPLACE,
    NOTHING_LEFT,
    _rename2,
    fsync_dir,
    lock_nowait,
    reported,
    write_small_file,
)
from .transaction import Advance, Crcs, Transaction, Writer

__all__ = [
    "TMP_MARKER",
    "LocalTransaction",
    "fsync_dir",
    "marker_name",
    "moved_aside",
    "recover",
    "recover_all",
    "reported",
    "temp_stem",
    "write_small_file",
]

# ------------------------------------------------------------------ the transaction

_REPLACING_A_FILE: contextvars.ContextVar[bool] = contextvars.ContextVar("shardpoint_replacing_a_file", default=False)


@contextlib.contextmanager
def replacing_a_file() -> Iterator[None]:
    """Saves in this block may replace a file or symlink at their path (Lightning's
    ``last.ckpt`` of an earlier ``torch.save``, a ``save_last="link"`` link): the new
    checkpoint takes its place at the commit, in one step where the kernel can exchange
    the two, so a save that fails leaves it as it was. Elsewhere a save refuses one."""
    token = _REPLACING_A_FILE.set(True)
    try:
        yield
    finally:
        _REPLACING_A_FILE.reset(token)



def _empty_directory(path: Path) -> bool:
    """Whether ``path`` is a directory (not a link to one) with nothing in it."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


_COMMIT_WAIT_S = 60.0
"""How long an overwrite waits for another save that is still committing the directory it
replaces (that save holds its lock from before its swap until its old directory is dealt
with: a few milliseconds, or its fsyncs)."""


def _open_locked(path: str) -> int:
    """The directory at ``path``, opened and (where it is free) locked by this save. One
    another save just swapped in is still that save's (locked, its marker inside) until it
    has dealt with the one it replaced: taken over before, that save's recovery and this
    one's raced over the same old directory (1 save in 30 of two overwriting one path
    failed), so this waits for it. A committed one locked by another overwrite about to
    swap is not waited for (that save may be waiting on this one's outcome)."""
    deadline = time.monotonic() + _COMMIT_WAIT_S
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            locked = lock_nowait(fd)
            if locked is False and not any(n.startswith(SAVE_MARKER) for n in os.listdir(fd)):
                return fd  # a committed directory: as before, carried over without its lock
            if locked is not False and os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                return fd  # ours (or no locks on this filesystem), and still the one at the path
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if time.monotonic() > deadline:
            raise StorageError(
                f"{path} is being committed by another save that has held it for over {_COMMIT_WAIT_S:.0f} s; "
                "this save was not committed. Save again once the other one finished, or to another path"
            )
        time.sleep(0.005)


def _alone_among_ranks() -> str:
    """A hint where ``torch.distributed`` runs several ranks and a save ran in one process
    (a DDP state of plain tensors, saved with no ``process_group``): another rank's save of
    the same path is what is there."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ""
    return (f". torch.distributed runs {dist.get_world_size()} ranks and this save was this process's alone (a state "
            "of plain tensors, no process_group=): if every rank saves this path, another rank's save is what is "
            "there; save from one rank (if dist.get_rank() == 0), or collectively with "
            "process_group=dist.group.WORLD")


def _is_cwd(path: Path) -> bool:
    """Whether ``path`` is this process's working directory (``sp.save(sd, ".")``)."""
    try:
        return os.path.samestat(os.stat("."), os.stat(path))
    except OSError:
        return False


def _same_owners(directory: str, names: set[str], old: os.stat_result) -> None:
    """Give the replacement ``directory`` and the files this save wrote in it the replaced
    folder's group (a team's shared folder, made in a parent of another group, stays
    readable to its members), and its owner when run as root (a root job overwriting a
    user's folder leaves it theirs). Where the system refuses, they stay as made."""
    now = os.stat(directory)
    uid = old.st_uid if os.geteuid() == 0 else -1
    if now.st_gid == old.st_gid and uid in (-1, now.st_uid):
        return
    for path in (directory, *(os.path.join(directory, n) for n in names)):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if path != directory and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1):
                continue  # a link to another checkpoint's file (link_unchanged): that one's, not ours
            os.chown(path, uid, old.st_gid, follow_symlinks=False)


class LocalTransaction(Transaction):
    """One save into ``final``: write files into ``.directory``, then ``commit()``."""

    def __init__(self, final: str | os.PathLike[str], *, overwrite: bool) -> None:
        self.final = Path(final).absolute()
        self.overwrite = overwrite
        self._file_target = _REPLACING_A_FILE.get()
        """Whether a file or symlink at ``final`` is replaced at the commit (:func:`replacing_a_file`)."""
        with reported(self.final, "creating its temporary directory"):
            recover(self.final)
            self._check_target()
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self.directory, self._lock_fd = make_locked_temp(self.final)
        self._done = False
        self._components: set[str] = set()
        """The components of the new checkpoint (read from its manifest before the swap)."""
        self._mode_after: int | None = None
        """The permission bits a replaced folder had that its owner could not write: the
        new one gets them once the replacement is done."""

    def _check_target(self) -> None:
        if self.final.name in ("", ".."):  # "x/..", "/": a folder named by its child, or the root
            real = os.path.realpath(self.final)
            raise InvalidArgumentError(
                f"cannot save to {self.final}: "
                + ("the root folder cannot be a checkpoint; save into a folder under it" if real == os.sep else
                   f"a path ending in '..' names a folder by way of another; give the folder's own path ({real})")
                + ". Nothing was written"
            )
        if not os.path.lexists(self.final):
            parent = self.final.parent
            while not os.path.lexists(parent) and parent != parent.parent:
                parent = parent.parent
            if os.path.lexists(parent) and not parent.is_dir():
                raise InvalidArgumentError(
                    f"cannot save to {self.final}: {parent} is a file, not a directory, so nothing can go "
                    "under it; pick another path"
                )
            return
        if self._file_target and (self.final.is_symlink() or not self.final.is_dir()):
            return  # replaced at the commit, never followed
        if not self.overwrite and _empty_directory(self.final):
            # Made ahead (mkdtemp, makedirs): nothing to lose, as save_pretrained writes
            # into it. Replaced as an overwrite, which keeps whatever appears meanwhile.
            self.overwrite = True
        if self.final.is_symlink():  # said first: overwrite=True would not help
            raise CheckpointExistsError(
                f"{self.final} is a symlink (to {os.readlink(self.final)}); a save never follows one, as it would "
                "replace the link or what it points to: save to the path it points to, or remove the link"
            )
        if self.final.is_dir() and os.path.ismount(self.final):
            raise InvalidArgumentError(
                f"cannot save to {self.final}: it is a mount point (a volume), and a save is committed by renaming "
                f"its finished folder into place, which a mount point refuses; save into a folder inside it, e.g. "
                f"{self.final / 'checkpoint'}. Nothing was written"
            )
        if not self.final.is_dir():
            raise CheckpointExistsError(
                f"{self.final} exists and is not a shardpoint checkpoint, nor a directory "
                "(a file or a symlink); refusing to replace it even with overwrite=True. "
                "Remove it yourself or pick another path"
            )
        if not self.overwrite:
            raise CheckpointExistsError(
                f"{self.final} already exists; pass overwrite=True to replace it, "
                f"or save to a new path{_alone_among_ranks()}"
            )

    def _write_files(self, files: Sequence[FileWrite], durable: bool, advance: Advance, write: Writer) -> Crcs:
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
        if self._file_target and os.path.lexists(self.final) and (self.final.is_symlink() or not self.final.is_dir()):
            self._replace_file(durable=durable)
            return
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
                here = _is_cwd(self.final)
                old = self._swap()
                self._done = True  # from here on self.directory may be the old one: never abort it
                if here:  # the process stood in the replaced folder: it now stands in the new one
                    with contextlib.suppress(OSError):
                        os.chdir(self.final)
                try:
                    if durable:
                        fsync_dir(self.final.parent)
                finally:
                    moved = finish_replaced(
                        old, str(self.final), replaced=replaced, carried=carried, components=self._components
                    )
                    if self._mode_after is not None:
                        with contextlib.suppress(OSError):
                            os.chmod(self.final, self._mode_after)
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
        self._components = components = manifest_components(manifest_doc(self.directory))
        old = str(self.final)
        fd = _open_locked(old)
        try:
            # The folder keeps its permission bits (a group-shared 2775 model folder stays so);
            # one its owner may not write (chmod 555) gets them once the replacement is done.
            held = os.fstat(fd)
            mode = stat.S_IMODE(held.st_mode)
            self._mode_after = None if mode & stat.S_IRWXU == stat.S_IRWXU else mode
            _same_owners(self.directory, new_names, held)
            with contextlib.suppress(OSError):
                os.chmod(self.directory, mode | stat.S_IRWXU)
            names = os.listdir(old)
            mounted = [n for n in names if os.path.ismount(os.path.join(old, n))]
            if mounted:
                raise InvalidArgumentError(
                    f"cannot overwrite {self.final}: {mounted[0]!r} in it is a mount point, which the overwrite (the "
                    "folder renamed into place) cannot carry over; unmount it, or keep mounts out of checkpoint "
                    "folders. Nothing was replaced"
                )
            replaced = owned_names(old, names, components) | new_names
            carried = carry_over(old, self.directory, replaced, durable=durable)
            record = {"replaced": sorted(replaced), "carried": {n: list(v) for n, v in carried.items()}}
            marker = os.path.join(self.directory, marker_name(self.directory))
            write_small_file(marker, json.dumps(record).encode(), durable=durable)
            if durable:
                fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        return replaced, carried, fd

    def _replace_file(self, *, durable: bool) -> None:
        """Commit over a file or symlink at ``final``: exchanged with the new directory in
        one step, then removed (a crash in between leaves it at the temporary name, where
        nothing reads it). Without the exchange it moves aside first and is put back if
        the rename fails (a crash in between: :func:`recover` puts it back)."""
        if durable:
            fsync_dir(self.directory)
        old = self._swap()
        self._done = True
        with contextlib.suppress(OSError):
            os.unlink(self.final / marker_name(self.directory))
        with contextlib.suppress(OSError):
            os.unlink(old)
        if durable:
            fsync_dir(self.final.parent)
        self._unlock()

    def _swap(self) -> str:
        """Put the new directory at ``final``; return where the old one now is."""
        if _rename2(self.directory, str(self.final), _RENAME_EXCHANGE):
            return self.directory  # no marker of its own there: never taken for a dead save's
        # No atomic exchange here: move the old one aside first. A crash in between leaves
        # the path missing and the old directory whole at `.tmp-old-`: the next save of
        # this name (or a CheckpointManager) puts it back.
        prefix = temp_prefix(self.final)
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
