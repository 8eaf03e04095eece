"""Is a checkpoint whole? Check it without loading it.

``verify_checkpoint`` reads the manifest (or the HF index), then every data file: it exists,
has the recorded size, its safetensors header validates, and every tensor the manifest lists
sits in it with the recorded dtype and shape. With ``checksums=True`` it also streams the
stored bytes of every tensor through crc32c in bounded buffers (a few MiB per thread, never
a whole file) and compares with the crc recorded at save time.

It does not stop at the first bad file: every problem is collected, per file, each as one
line that names the file (and the tensor). Files in the directory that the checkpoint does
not account for are warnings, not problems. Foreign HF checkpoints record no crc32c, so only
their structure is verified, and the report says so.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ._checksum import crc32c
from ._format.companions import role
from ._format.detect import (
    HF_BIN,
    HF_FILE,
    HF_INDEX,
    SHARDPOINT,
    TORCH_SAVE,
    UNCOMMITTED,
    Detected,
    detect,
)
from ._format.dtypes import NAME_TO_DTYPE, itemsize
from ._format.index import index_name, parse_index
from ._format.manifest import MANIFEST_NAME, PENDING_NAME, ChunkRef, Manifest
from ._format.names import is_tmp_name
from ._format.safetensors import SafetensorsHeader
from ._hub import resolve_hub
from ._io.transfer import reader_threads
from ._knobs import knobs
from ._pickled_source import torch_load
from ._progress import byte_progress
from ._source import Checkpoint, detect_local, not_readable, open_checkpoint, read_json_file
from ._storage.local import hidden_sibling_message, missing_path_message
from ._storage.paths import member_path, open_regular
from ._storage.remote import RemoteStore, resolve
from ._tensor_source import components_from_object
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    UnsafePickleError,
    UnsupportedFormatError,
)

__all__ = ["VerifyReport", "verify_checkpoint"]

_MAX_NAMED = 5
"""How many tensor names a problem line lists before saying "and N more"."""


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_checkpoint`` found."""

    path: str
    """The path that was checked, as given."""
    kind: str
    """``shardpoint``, ``hf-index`` or ``hf-file``."""
    problems: list[str]
    """Everything that makes the checkpoint unusable, one line each, naming the file (and tensor).
    Grouped by file, in the checkpoint's file order."""
    warnings: list[str]
    """What is worth knowing but does not stop a load: extra files, tensors without a crc."""
    files_checked: int
    """Data files examined (those the manifest or index lists, present or not)."""
    tensors_checked: int
    """Stored tensors (chunks) whose header entry was found and matched the manifest/index."""
    bytes_checked: int
    """Bytes of tensor data read and compared against their crc32c."""
    checksums: bool
    """True when stored bytes were compared against their crc32c (every tensor that could be
    read; for ``.bin`` / ``.pt`` files the CRC-32 of every record of their zip archive);
    False with ``checksums=False``, for foreign safetensors checkpoints (they record none),
    or when some tensor has no recorded crc."""
    unchecked: list[str] = field(default_factory=list)
    """Files in the directory that are not checkpoint data and were not checked (config,
    tokenizer, README, training state...), sorted. Stray files that look like this
    checkpoint's data are not listed here: they are warnings."""
    notes: list[str] = field(default_factory=list)
    """How the checkpoint was read, where a person should know (a file read instead of the
    one named, pickles read with ``weights_only=True``)."""

    @property
    def ok(self) -> bool:
        """True when no problem was found: the checkpoint is whole."""
        return not self.problems


@dataclass(frozen=True)
class _CrcItem:
    """One stored tensor to checksum: a byte range of a data file and its expected crc."""

    file: str
    start: int
    nbytes: int
    crc32c: int
    label: str


@dataclass
class _Findings:
    """Problems collected per file (``""`` for the checkpoint as a whole), and warnings."""

    by_file: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def problem(self, file: str, message: str) -> None:
        self.by_file.setdefault(file, []).append(message)

    def flat(self, file_order: Sequence[str]) -> list[str]:
        ordered = ["", *file_order, *sorted(f for f in self.by_file if f not in file_order and f)]
        return [msg for name in dict.fromkeys(ordered) for msg in self.by_file.get(name, [])]


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    checksums: bool = True,
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check that a checkpoint is whole, without loading it; collect every problem.

    Args:
        path: checkpoint directory (shardpoint or HF) or a single ``.safetensors`` file,
            or an fsspec URL of either (``s3://bucket/run/step-100``; checksumming then
            streams every object through ranged reads), or ``hf://org/name[@revision]``
            (a repository in the local Hugging Face cache; ``storage_options`` may name its
            ``cache_dir``).
        storage_options: options of the URL's fsspec filesystem (see ``shardpoint.save``).
        checksums: also read every stored tensor and compare its crc32c (the slow part;
            ``False`` checks structure only: manifest, file sizes, headers, entries).
        progress: show a progress bar while checksumming (default: when stderr is a terminal).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when the checkpoint is whole.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no checkpoint at all.
        UnsafePickleError: a ``.bin`` / ``.pt`` file needs more than ``weights_only`` to be
            read (verify never unpickles it; ``sp.load`` would refuse it too).
        UnsupportedFormatError: a ``.bin`` / ``.pt`` file is not a zip-format ``torch.save``
            file (a legacy pickle, which ``sp.load`` refuses too).
        OSError: the directory itself cannot be listed.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = sp.save({"w": torch.ones(4)}, d)
        >>> report = verify_checkpoint(d)
        >>> report.ok, report.files_checked, report.bytes_checked
        (True, 1, 16)
    """
    path, storage_options = resolve_hub(path, storage_options)
    path, store = resolve(path, storage_options)
    if store is not None:
        return _verify_remote(store, storage_options, checksums=checksums, progress=progress)
    location = os.fspath(path)
    if not os.path.lexists(location):
        raise CheckpointNotFoundError(
            missing_path_message(location).replace("nothing to load", "nothing to verify")
        )
    base = os.path.basename(os.path.normpath(location))
    if os.path.isdir(location) and is_tmp_name(base):
        message = hidden_sibling_message(location)
        return VerifyReport(location, "shardpoint", [message], [], 0, 0, 0, False)
    if os.path.isfile(location):
        found = detect_local(location)
        if found.instead_of is not None and found.file is not None:
            sibling = os.path.join(os.path.dirname(location), found.file)
            note = (
                f"verified {sibling} instead of {location}: load reads the .safetensors file of "
                "the same stem beside it (same tensors, no unpickling)"
            )
            report = verify_checkpoint(sibling, checksums=checksums, progress=progress)
            return dataclasses.replace(report, notes=[note, *report.notes])
        if found.kind == TORCH_SAVE:
            return _verify_pickled(
                location, os.path.dirname(location) or ".", None,
                [os.path.basename(location)], checksums=checksums,
            )
        if found.kind != HF_FILE:
            raise not_readable(location, found)
        # The user named this file: follow it if it is a link (as in a Hugging Face cache).
        directory, name = os.path.split(os.path.realpath(location))
        return _verify_foreign(location, directory, "hf-file", None, [name], checksums=checksums)
    if not os.path.isdir(location):
        raise CheckpointNotFoundError(f"{location} is neither a directory nor a checkpoint file")
    names = os.listdir(location)
    found = detect(names)
    if found.kind == SHARDPOINT:
        return _verify_shardpoint(location, names, checksums=checksums, progress=progress)
    if found.kind == HF_BIN:
        return _verify_pickled(location, location, found.index, [], checksums=checksums, listing=names)
    if found.kind == TORCH_SAVE and found.file is not None:
        return _verify_pickled(location, location, None, [found.file], checksums=checksums, listing=names)
    if found.kind == UNCOMMITTED:
        return _uncommitted_report(location)
    kind, found_index, files = _foreign(location, found)
    return _verify_foreign(location, location, kind, found_index, files, checksums=checksums)


# ------------------------------------------------------------------------ shardpoint


def _verify_remote(
    store: RemoteStore,
    storage_options: Mapping[str, Any] | None,
    *,
    checksums: bool,
    progress: bool | None,
) -> VerifyReport:
    """``verify_checkpoint`` for a prefix (or single ``.safetensors`` object) on a store."""
    location = store.url
    if location.endswith(".safetensors"):
        info = store.info()
        if info is not None and info.get("type") == "file":
            parent, name = store.parent_and_name()
            sizes = {name: int(info.get("size") or 0)}
            return _verify_foreign(location, parent.url, "hf-file", None, [name], checksums=checksums,
                                   store=parent, sizes=sizes)
    sizes = store.list()
    if not sizes:
        raise CheckpointNotFoundError(f"{location} holds no objects; nothing to verify")
    if MANIFEST_NAME in sizes:
        return _verify_shardpoint(location, list(sizes), checksums=checksums, progress=progress,
                                  storage_options=storage_options)
    found = detect(sizes)
    if found.kind == UNCOMMITTED:
        return _uncommitted_report(location)
    kind, index, files = _foreign(location, found, remote=True)
    return _verify_foreign(location, location, kind, index, files, checksums=checksums,
                           store=store, sizes=sizes)


def _read_json(ckpt: Checkpoint, name: str, where: str) -> bytes:
    """An index of ``ckpt``, local or remote, size-capped."""
    if ckpt.store is not None:
        return ckpt.store.get(name, limit=knobs().max_json_bytes)
    member_path(ckpt.directory, name, where=ckpt.location)
    return ckpt.read_member(name, where=where)  # through the directory held open: one version


def _verify_shardpoint(
    location: str,
    names: list[str],
    *,
    checksums: bool,
    progress: bool | None,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    try:
        ckpt = open_checkpoint(location, storage_options)
    except CheckpointNotFoundError:
        raise
    except CheckpointError as exc:
        return VerifyReport(location, "shardpoint", [str(exc)], [], 0, 0, 0, False)
    except OSError as exc:
        where = os.path.join(location, MANIFEST_NAME)
        return VerifyReport(
            location, "shardpoint", [f"{where} cannot be read: {exc}"], [], 0, 0, 0, False
        )
    manifest = ckpt.manifest
    assert manifest is not None
    if ckpt.names is not None:
        names = ckpt.names  # the listing of the version that was opened
    found = _Findings()

    # Which stored tensors each file must hold, in manifest order.
    chunks_in: dict[str, list[tuple[str, str, ChunkRef]]] = {f: [] for f in manifest.files}
    for cname, comp in manifest.components.items():
        for tname, record in comp.tensors.items():
            label = tname if ckpt.flat else f"{cname}/{tname}"
            for chunk in record.chunks:
                chunks_in[chunk.file].append((label, record.dtype, chunk))

    headers = _read_headers(ckpt, list(manifest.files), chunks_in, found)
    tensors_checked = 0
    crc_items: list[_CrcItem] = []
    no_crc = 0
    for fname, header in headers.items():
        claimed: set[str] = set()
        for label, dtype, chunk in chunks_in[fname]:
            claimed.add(chunk.key)
            try:
                entry = ckpt.entry(chunk, dtype, label)
            except CheckpointError as exc:
                found.problem(fname, str(exc))
                continue
            tensors_checked += 1
            if chunk.crc32c is None:
                no_crc += 1
            else:
                crc_items.append(_CrcItem(fname, entry.start, entry.nbytes, chunk.crc32c, label))
        where = os.path.join(location, fname)
        extra = [key for key in header.entries if key not in claimed]
        if extra:
            found.warnings.append(
                f"{where} holds {_name_list(extra)} that the manifest does not list; load ignores them"
            )
        if header.metadata.get("format") != "pt":
            found.warnings.append(
                f'{where}: __metadata__ has no "format": "pt"; transformers refuses such files'
            )

    expected_indexes = _check_indexes(ckpt, manifest, names, found)
    accounted = {MANIFEST_NAME, *manifest.files, *expected_indexes}
    unchecked = _unreferenced(
        found, location, names, accounted, "safetensors", "the manifest does not list it"
    )
    if no_crc:
        found.warnings.append(
            f"{location}: {no_crc} stored tensor(s) have no recorded crc32c; their bytes were not checked"
        )

    bytes_checked = 0
    if checksums and crc_items:
        bytes_checked = _check_crcs(ckpt, crc_items, found, progress=progress)
    return VerifyReport(
        path=location,
        kind="shardpoint",
        problems=found.flat(list(manifest.files)),
        warnings=found.warnings,
        files_checked=len(manifest.files),
        tensors_checked=tensors_checked,
        bytes_checked=bytes_checked,
        checksums=checksums and not no_crc,
        unchecked=unchecked,
    )


def _check_indexes(
    ckpt: Checkpoint, manifest: Manifest, names: list[str], found: _Findings
) -> set[str]:
    """Check each component's HF index against the manifest; return the index names expected."""
    location = ckpt.location
    expected: set[str] = set()
    if manifest.layout != "hf":
        return expected
    for cname, comp in manifest.components.items():
        weight_map = {t: rec.chunks[0].file for t, rec in comp.tensors.items()}
        total = sum(_nbytes(rec.dtype, rec.shape) for rec in comp.tensors.values())
        iname = index_name(cname)
        where = os.path.join(location, iname)
        if len(set(weight_map.values())) <= 1 and iname not in names:
            continue
        expected.add(iname)
        if iname not in names:
            found.problem(
                "",
                f"{where} is missing; component {cname!r} is split over "
                f"{len(set(weight_map.values()))} files and transformers needs the index to find them",
            )
            continue
        try:
            raw = _read_json(ckpt, iname, where)
            index = parse_index(raw, where=where)
        except CheckpointError as exc:
            found.problem("", str(exc))
            continue
        except OSError as exc:
            found.problem("", f"{where} cannot be read: {exc}")
            continue
        if index.weight_map != weight_map:
            wrong = sorted(set(index.weight_map.items()) ^ set(weight_map.items()))
            found.problem(
                "",
                f"{where}: weight_map disagrees with the manifest on "
                f"{_name_list(list(dict.fromkeys(k for k, _ in wrong)))}; the index is damaged",
            )
        recorded = index.metadata.get("total_size")
        if recorded != total:
            found.problem(
                "",
                f"{where}: metadata.total_size is {recorded!r} but the manifest's tensors of "
                f"component {cname!r} hold {total} bytes; the index is damaged",
            )
    return expected


# ------------------------------------------------------------------------ foreign (HF)


def _uncommitted_report(location: str) -> VerifyReport:
    message = (
        f"{location} is a save that never committed ({PENDING_NAME} is there, {MANIFEST_NAME} "
        "is not); it is not a checkpoint. Verify the previous one, or save again"
    )
    return VerifyReport(location, "shardpoint", [message], [], 0, 0, 0, False)


def _foreign(location: str, found: Detected, *, remote: bool = False) -> tuple[str, str | None, list[str]]:
    """The HF safetensors checkpoint ``found`` names: (kind, index file or None, data files
    when there is no index); any other kind is refused, as load refuses it."""
    if found.kind == HF_INDEX and found.index is not None:
        return "hf-index", found.index, []
    if found.kind == HF_FILE and found.file is not None:
        return "hf-file", None, [found.file]
    raise not_readable(location, found, remote=remote)


def _verify_foreign(
    location: str,
    directory: str,
    kind: str,
    index: str | None,
    files: list[str],
    *,
    checksums: bool,
    store: RemoteStore | None = None,
    sizes: dict[str, int] | None = None,
) -> VerifyReport:
    found = _Findings()
    ckpt = Checkpoint(location, directory, kind, {}, flat=True, store=store, sizes=dict(sizes or {}))
    # ``location`` is the data file itself: errors name it, not ``location/name``.
    ckpt.single_file = location != directory
    try:
        ckpt.pin_directory()  # the index and every file through one directory: one version
    except OSError as exc:
        return VerifyReport(location, kind, [f"{directory} cannot be opened: {exc}"], [], 0, 0, 0, False)
    weight_map: dict[str, str] | None = None
    if index is not None:
        where = os.path.join(location, index)
        try:
            raw = _read_json(ckpt, index, where)
            weight_map = parse_index(raw, where=where).weight_map
        except CheckpointError as exc:
            return VerifyReport(location, kind, [str(exc)], [], 0, 0, 0, False)
        except OSError as exc:
            return VerifyReport(
                location, kind, [f"{where} cannot be read: {exc}"], [], 0, 0, 0, False
            )
        files = list(dict.fromkeys(weight_map.values()))

    listed: dict[str, list[tuple[str, str, ChunkRef]]] = {f: [] for f in files}
    if weight_map is not None:
        for key, fname in weight_map.items():
            listed[fname].append((key, "", ChunkRef(fname, key, (), (), None)))
    headers = _read_headers(ckpt, files, listed, found)

    tensors_checked = 0
    seen_in: dict[str, str] = {}
    for fname, header in headers.items():
        where = os.path.join(location, fname) if location == directory else location
        for key in header.entries:
            if key in seen_in:
                found.problem(
                    fname,
                    f"{location}: tensor {key!r} is stored in both {seen_in[key]!r} and {fname!r}; "
                    "the checkpoint is ambiguous",
                )
            seen_in.setdefault(key, fname)
        if weight_map is None:
            tensors_checked += len(header.entries)
        else:
            unlisted = [k for k in header.entries if weight_map.get(k) != fname]
            if unlisted:
                found.warnings.append(
                    f"{where} holds {_name_list(unlisted)} that the index does not map to it; "
                    "loaders ignore them"
                )
            for key, _, _ in listed[fname]:
                if key in header.entries:
                    tensors_checked += 1
                else:
                    found.problem(
                        fname,
                        f"{where}: tensor {key!r} is listed in the index but absent from this "
                        "file; the checkpoint is damaged",
                    )
        if header.metadata.get("format") not in ("pt", "tf", "flax", "mlx"):
            found.warnings.append(
                f'{where}: __metadata__ has no "format" (e.g. "pt"); transformers refuses such files'
            )

    unchecked: list[str] = []
    if location == directory:
        accounted = set(files) | ({index} if index else set())
        listing = sorted(ckpt.sizes) if store is not None else sorted(os.listdir(ckpt.dir_fd or directory))
        why = "the index does not list it" if index else "another file was chosen"
        unchecked = _unreferenced(found, location, listing, accounted, "safetensors", why)
    return VerifyReport(
        path=location,
        kind=kind,
        problems=found.flat(files),
        warnings=found.warnings,
        files_checked=len(files),
        tensors_checked=tensors_checked,
        bytes_checked=0,
        checksums=False,
        unchecked=unchecked,
    )


# ------------------------------------------------------------------------ .bin / .pt

def _pickled_note(checksums: bool) -> str:
    crc = "each one's zip records checked against their CRC-32, " if checksums else ""
    return (
        f"torch.save files: {crc}tensors read with torch.load(weights_only=True) (structure "
        "only, never a full unpickle)"
    )


def _verify_pickled(
    location: str,
    directory: str,
    index: str | None,
    files: list[str],
    *,
    checksums: bool,
    listing: Sequence[str] | None = None,
) -> VerifyReport:
    """``verify_checkpoint`` of ``torch.save`` weights, read as ``sp.load`` reads them: HF
    ``.bin`` shards through their index (``index``), or one file (``files``)."""
    kind = "hf-bin" if index is not None else "torch-save"
    single = location != directory
    found = _Findings()
    weight_map: dict[str, str] | None = None
    if index is not None:
        where = os.path.join(location, index)
        try:
            weight_map = parse_index(read_json_file(where, where=where), where=where).weight_map
        except CheckpointError as exc:
            return VerifyReport(location, kind, [str(exc)], [], 0, 0, 0, False)
        except OSError as exc:
            return VerifyReport(location, kind, [f"{where} cannot be read: {exc}"], [], 0, 0, 0, False)
        files = list(dict.fromkeys(weight_map.values()))
    tensors_checked = bytes_checked = 0
    without_crc: list[str] = []
    for fname in files:
        where = location if single else os.path.join(location, fname)
        listed = [k for k, f in (weight_map or {}).items() if f == fname]
        held = f"; it holds {_name_list(listed)}" if listed else ""
        try:
            path = location if single else member_path(directory, fname, where=location)
            if not os.path.lexists(path):
                found.problem(
                    fname,
                    f"{where} is missing: the index lists it but it is not there; the checkpoint "
                    f"is incomplete (copy the file back or load another checkpoint){held}",
                )
                continue
            if checksums:
                got, has_crc, problems = _zip_crc(path, where)
                bytes_checked += got
                for message in problems:
                    found.problem(fname, message)
                if not has_crc:
                    without_crc.append(where)
            obj, _ = torch_load(path, trust_pickle=False, zip_only=True)
        except (UnsafePickleError, UnsupportedFormatError):
            raise  # not damage: verify cannot judge the file without unpickling it
        except CheckpointError as exc:
            found.problem(fname, f"{exc}{held}")
            continue
        except OSError as exc:
            found.problem(fname, f"{where} cannot be read: {exc.strerror or exc}{held}")
            continue
        if weight_map is None:
            try:
                components, flat = components_from_object(obj, where=where, allow_pickle=False)
            except CheckpointError as exc:
                found.problem(fname, str(exc))
                continue
            finally:
                del obj
            tensors_checked += sum(len(c.stored) for c in components)
            if not flat:
                found.warnings.append(
                    f"{where} holds a nested training state (components "
                    f"{', '.join(repr(c.name) for c in components)}), not a flat state dict: "
                    "sp.load and load_into refuse it; `shardpoint convert` converts it whole"
                )
            continue
        if not isinstance(obj, Mapping):
            found.problem(fname, f"{where} holds a {type(obj).__name__}, not a state dict shard")
            continue
        for key in listed:
            if key not in obj:
                found.problem(
                    fname,
                    f"{where}: tensor {key!r} is listed in the index but absent from this file; "
                    "the checkpoint is damaged",
                )
            elif not isinstance(obj[key], torch.Tensor):
                found.problem(
                    fname, f"{where}: {key!r} is a {type(obj[key]).__name__}, not a tensor"
                )
            else:
                tensors_checked += 1
        unlisted = [str(k) for k in obj if weight_map.get(str(k)) != fname]
        if unlisted:
            found.warnings.append(
                f"{where} holds {_name_list(unlisted)} that the index does not map to it; "
                "loaders ignore them"
            )
        del obj
    if without_crc:
        found.warnings.append(
            f"{', '.join(without_crc[:_MAX_NAMED])}: no CRC-32 recorded in the zip archive "
            "(saved with torch.serialization's compute_crc32 off); their bytes were not checked"
        )
    unchecked: list[str] = []
    if not single and listing is not None:
        accounted = set(files) | ({index} if index else set())
        why = "the index does not list it" if index else "pytorch_model.bin was chosen"
        unchecked = _unreferenced(found, location, listing, accounted, "pickle", why)
    return VerifyReport(
        path=location,
        kind=kind,
        problems=found.flat(files),
        warnings=found.warnings,
        files_checked=len(files),
        tensors_checked=tensors_checked,
        bytes_checked=bytes_checked,
        checksums=checksums and not without_crc,
        unchecked=unchecked,
        notes=[_pickled_note(checksums)],
    )


def _zip_crc(path: str, where: str) -> tuple[int, bool, list[str]]:
    """Check every record of a zip-format ``torch.save`` file against its CRC-32, reading
    in bounded pieces: (bytes read, whether CRCs are recorded, problems). A legacy
    (non-zip) file has none: ``torch_load`` says what is wrong with it."""
    with os.fdopen(open_regular(path, where=where), "rb") as f:  # a FIFO would hang
        if f.read(4) != b"PK\x03\x04":
            return 0, True, []
        f.seek(0)
        try:
            archive = zipfile.ZipFile(f)
            records = archive.infolist()
        except Exception as exc:  # zipfile raises many kinds on a damaged archive
            return 0, True, [
                f"{where} is not a readable zip archive ({type(exc).__name__}: {exc}); the file is "
                "truncated or damaged"
            ]
        if not any(r.CRC for r in records if r.file_size):
            return 0, not any(r.file_size for r in records), []
        read, problems = 0, []
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED:
                problems.append(
                    f"{where}: record {record.filename!r} is compressed, which torch.save never "
                    "does; the file is damaged or forged"
                )
                continue
            try:
                with archive.open(record) as member:
                    while piece := member.read(1 << 20):
                        read += len(piece)
            except Exception as exc:  # BadZipFile("Bad CRC-32 ..."), EOFError on a truncated file
                problems.append(
                    f"{where}: record {record.filename!r} of the zip archive does not match its "
                    f"CRC-32 or cannot be read ({type(exc).__name__}: {exc}); the file is damaged. "
                    "Restore it from a copy"
                )
        return read, True, problems


# ------------------------------------------------------------------------ shared


def _unreferenced(
    found: _Findings,
    location: str,
    listing: Sequence[str],
    accounted: set[str],
    family: str,
    why: str,
) -> list[str]:
    """Files of the directory the checkpoint does not reference: a warning for each that
    looks like this checkpoint's data (see ``_format.companions``); the others, returned,
    are listed as not checked."""
    unchecked = []
    for name in sorted(listing):
        if name in accounted or is_tmp_name(name):
            continue
        if role(name, family) == "weights":
            found.warnings.append(
                f"{os.path.join(location, name)} looks like checkpoint data but is not part of "
                f"the checkpoint ({why}); load ignores it. If it is left from another save, "
                "move it away"
            )
        else:
            unchecked.append(name)
    return unchecked


def _read_headers(
    ckpt: Checkpoint,
    files: list[str],
    chunks_in: dict[str, list[tuple[str, str, ChunkRef]]],
    found: _Findings,
) -> dict[str, SafetensorsHeader]:
    """Validate every file's size and header; a file that fails is reported with what it held."""
    headers: dict[str, SafetensorsHeader] = {}
    for fname in files:
        try:
            headers[fname] = ckpt.header(fname)
            continue
        except CheckpointError as exc:
            message = str(exc)
        except OSError as exc:
            where = _file_label(ckpt, fname)
            message = f"{where} cannot be read: {exc.strerror or exc}"
        held = list(dict.fromkeys(label for label, _, _ in chunks_in.get(fname, [])))
        unnamed = [label for label in held if repr(label) not in message]
        if unnamed:
            message += f"; it holds {_name_list(held)}"
        found.problem(fname, message)
    return headers


def _check_crcs(
    ckpt: Checkpoint, items: list[_CrcItem], found: _Findings, *, progress: bool | None
) -> int:
    """Stream every item's bytes through crc32c, several files at once; return bytes read."""
    cfg = knobs()
    per_file: dict[str, list[_CrcItem]] = {}
    for item in items:
        per_file.setdefault(item.file, []).append(item)
    total = sum(item.nbytes for item in items)
    name = os.path.basename(os.path.normpath(ckpt.location))
    lock = threading.Lock()
    read = [0]

    with byte_progress(total, f"verifying {name}", progress) as advance:

        def run(fname: str) -> None:
            got, problems = _crc_file(
                ckpt, fname, per_file[fname], segment=cfg.io_segment_bytes, advance=advance
            )
            with lock:
                read[0] += got
                for message in problems:
                    found.problem(fname, message)

        threads = max(1, min(reader_threads(), len(per_file)))
        if threads == 1:
            for fname in per_file:
                run(fname)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="shardpoint-verify") as pool:
                for fut in [pool.submit(run, f) for f in per_file]:
                    fut.result()
    return read[0]


def _crc_file(
    ckpt: Checkpoint,
    fname: str,
    items: list[_CrcItem],
    *,
    segment: int,
    advance: Callable[[int], None] | None,
) -> tuple[int, list[str]]:
    """crc32c of each item of one file, read in ``segment``-byte pieces into one reused buffer."""
    where = _file_label(ckpt, fname)
    problems: list[str] = []
    read = 0
    if ckpt.store is not None:
        return _crc_object(ckpt.store, fname, where, items, advance=advance)
    try:
        # The checkpoint's held descriptor (the version that was opened), duplicated.
        fd = os.dup(ckpt.fd(fname))
    except (OSError, CheckpointError) as exc:
        return 0, [f"{where} cannot be read: {exc}"]
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buffer = memoryview(bytearray(max(1, min(segment, max(i.nbytes for i in items)))))
        for item in sorted(items, key=lambda i: i.start):
            crc, pos, end = 0, item.start, item.start + item.nbytes
            try:
                while pos < end:
                    n = os.preadv(fd, [buffer[: min(len(buffer), end - pos)]], pos)
                    if n <= 0:
                        raise EOFError(pos)
                    crc = crc32c(buffer[:n], crc)
                    pos += n
                    read += n
                    if advance is not None:
                        advance(n)
            except EOFError:
                problems.append(
                    f"{where}, tensor {item.label!r}: unexpected end of file at byte {pos}; "
                    "the file is truncated"
                )
                continue
            except OSError as exc:
                problems.append(f"{where}, tensor {item.label!r}: read failed at byte {pos}: {exc}")
                continue
            if crc != item.crc32c:
                problems.append(
                    f"{where}, tensor {item.label!r}: crc32c of the stored bytes is {crc:#010x}, "
                    f"the manifest recorded {item.crc32c:#010x}; the file is damaged. Restore it "
                    "from a copy, or use an earlier checkpoint"
                )
    finally:
        os.close(fd)
    return read, problems


def _crc_object(
    store: RemoteStore,
    fname: str,
    where: str,
    items: list[_CrcItem],
    *,
    advance: Callable[[int], None] | None,
) -> tuple[int, list[str]]:
    """crc32c of each item of one remote object, one ranged read per piece."""
    piece = knobs().remote_read_bytes
    problems: list[str] = []
    read = 0
    for item in sorted(items, key=lambda i: i.start):
        crc, pos, end = 0, item.start, item.start + item.nbytes
        try:
            while pos < end:
                data = store.read_range(fname, pos, min(piece, end - pos))
                crc = crc32c(data, crc)
                pos += len(data)
                read += len(data)
                if advance is not None:
                    advance(len(data))
        except (OSError, CheckpointError) as exc:
            problems.append(f"{where}, tensor {item.label!r}: read failed at byte {pos}: {exc}")
            continue
        if crc != item.crc32c:
            problems.append(
                f"{where}, tensor {item.label!r}: crc32c of the stored bytes is {crc:#010x}, "
                f"the manifest recorded {item.crc32c:#010x}; the object is damaged. Restore it "
                "from a copy, or use an earlier checkpoint"
            )
    return read, problems


def _file_label(ckpt: Checkpoint, fname: str) -> str:
    """How problems name data file ``fname``: the path the user gave, joined with the name."""
    return ckpt.location if ckpt.location != ckpt.directory else os.path.join(ckpt.location, fname)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * itemsize(NAME_TO_DTYPE[dtype])


def _name_list(names: list[str]) -> str:
    """``tensor 'a'`` / ``tensors 'a', 'b' and 3 more``."""
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMED])
    more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return f"tensor{'s' if len(names) > 1 else ''} {shown}{more}"
