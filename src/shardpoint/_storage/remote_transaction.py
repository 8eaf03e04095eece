"""One save into a prefix of an object store: data objects, then indexes, then the manifest last.

Object stores have no atomic rename, so a save commits by order (:class:`RemoteTransaction`):

1. ``shardpoint.pending`` is written first: the prefix now holds a save in progress.
2. With ``overwrite=True`` the old manifest is deleted, then the old checkpoint's objects
   (:mod:`.ownership`: the user's objects beside it stay): from the first deletion on, the
   prefix no longer loads (the old checkpoint is gone even if this save then fails:
   overwriting an object store is not atomic).
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

import json
import uuid
from collections.abc import Sequence
from contextlib import suppress

from .._format.manifest import MANIFEST_NAME, PENDING_NAME
from .._io.writes import FileWrite, UploadAbortedError, upload_files
from .._options import current_options
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    InvalidArgumentError,
    StorageError,
)
from . import ownership
from .remote_store import PENDING_TEXT, RemoteStore
from .transaction import Advance, Crcs, Transaction, Writer


class RemoteTransaction(Transaction):
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
        self._kept: set[str] = set()
        """The user's objects under the prefix, which neither this save nor its abort removes."""
        if existing:
            # Only what the old checkpoint (or an interrupted save) owns goes; the user's
            # objects beside it (config.json, tokenizer files) stay, as in a local folder.
            ours = _owned(store, existing)
            self._kept = set(existing) - ours
            # The manifest goes first: from here on the prefix never loads as the old checkpoint.
            store.delete([n for n in existing if n == MANIFEST_NAME])
            store.delete([n for n in existing if n in ours and n not in (MANIFEST_NAME, PENDING_NAME)])
        if PENDING_NAME in existing:
            store.abort_uploads()  # a killed save's unfinished multipart uploads

    def _write_files(self, files: Sequence[FileWrite], durable: bool, advance: Advance, write: Writer) -> Crcs:
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
            names = [n for n in self.store.list() if n not in self._kept]
            self.store.delete([n for n in names if n == MANIFEST_NAME])
            self.store.delete([n for n in names if n not in (MANIFEST_NAME, PENDING_NAME)])
            self.store.delete([PENDING_NAME])


_OURS_AFTER_A_KILL = (".safetensors", ".safetensors.index.json")


def _owned(store: RemoteStore, existing: dict[str, int]) -> set[str]:
    """The objects of ``existing`` a save replacing the prefix may delete. With a manifest:
    :func:`.ownership.owned_names` (each listed data object's header read for its save id).
    After a killed save (a marker, no manifest): its data objects and indexes, named as
    only a save names them; a killed save may have written any of them."""
    after_a_kill = {PENDING_NAME} | {n for n in existing if n.endswith(_OURS_AFTER_A_KILL)}
    if MANIFEST_NAME not in existing:
        return after_a_kill
    try:
        doc = json.loads(store.get(MANIFEST_NAME, limit=current_options().io.max_json_bytes))
    except FileNotFoundError:
        # Deleted since the listing: another save is replacing this prefix (it was a bare
        # FileNotFoundError). As after a killed save; that save finds its marker replaced by
        # this one before its index and manifest, and stops.
        return after_a_kill
    except (CheckpointError, ValueError, RecursionError):
        doc = None  # damaged: it names nothing, so only the components' weight files go

    return ownership.owned_names(list(existing), doc if isinstance(doc, dict) else None, set(),
                                 lambda name: store.save_id_of(name, existing[name])) | {PENDING_NAME}
