"""``verify_checkpoint`` of ``torch.save`` weights (HF ``.bin`` shards or one ``.bin`` /
``.pt`` file), read as ``sp.load`` reads them: each zip record's CRC-32, then the structure
through ``torch.load(weights_only=True)``; never a full unpickle."""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Callable, Mapping, Sequence

import torch

from ._checkpoint import read_json_file
from ._format.index import parse_index
from ._progress import byte_progress
from ._sources.contract import components_from_object
from ._sources.pickled import torch_load
from ._storage.paths import member_path, open_regular
from ._verify_report import MAX_NAMED, Findings, VerifyReport, name_list, unreferenced
from .errors import (
    CheckpointError,
    UnsafePickleError,
    UnsupportedFormatError,
)


def _pickled_note(checksums: bool) -> str:
    crc = "each one's zip records checked against their CRC-32, " if checksums else ""
    return (
        f"torch.save files: {crc}tensors read with torch.load(weights_only=True) (structure "
        "only, never a full unpickle)"
    )


def verify_pickled(
    location: str,
    directory: str,
    index: str | None,
    files: list[str],
    *,
    checksums: bool,
    listing: Sequence[str] | None = None,
    progress: bool | None = None,
) -> VerifyReport:
    """``verify_checkpoint`` of ``torch.save`` weights, read as ``sp.load`` reads them: HF
    ``.bin`` shards through their index (``index``), or one file (``files``)."""
    kind = "hf-bin" if index is not None else "torch-save"
    single = location != directory
    found = Findings()
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
    with byte_progress(_total_size(location, directory, files, single) if checksums else 0,
                       f"verifying {location}", progress) as advance:
        return _verify_files(location, directory, index, files, weight_map, found, kind, single,
                             checksums=checksums, listing=listing, advance=advance)


def _total_size(location: str, directory: str, files: list[str], single: bool) -> int:
    total = 0
    for fname in files:
        with contextlib.suppress(OSError):  # reported when it is read
            total += os.path.getsize(location if single else os.path.join(directory, fname))
    return total


def _verify_files(
    location: str, directory: str, index: str | None, files: list[str], weight_map: dict[str, str] | None,
    found: Findings, kind: str, single: bool, *, checksums: bool, listing: Sequence[str] | None,
    advance: Callable[[int], None] | None,
) -> VerifyReport:
    tensors_checked = bytes_checked = 0
    without_crc: list[str] = []
    for fname in files:
        where = location if single else os.path.join(location, fname)
        listed = [k for k, f in (weight_map or {}).items() if f == fname]
        held = f"; it holds {name_list(listed)}" if listed else ""
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
                got, has_crc, problems = _zip_crc(path, where, advance)
                bytes_checked += got
                for message in problems:
                    found.problem(fname, message)
                if not has_crc:
                    without_crc.append(where)
                if problems:
                    continue  # loading it would only say the same again
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
            except UnsupportedFormatError:
                raise  # a whole file that holds no checkpoint's state: nothing to judge
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
        elsewhere = [str(k) for k in obj if weight_map.get(str(k)) not in (None, fname)]
        for key in elsewhere[:MAX_NAMED]:
            found.problem(
                fname,
                f"{location}: tensor {key!r} is stored in both {weight_map[key]!r} (where the index maps it) "
                f"and {fname!r}; the checkpoint is ambiguous (transformers loads whichever copy it reads last)",
            )
        unlisted = [str(k) for k in obj if str(k) not in weight_map]
        if unlisted:
            found.warnings.append(
                f"{where} holds {name_list(unlisted)} that the index does not list; shardpoint does not "
                "load them, transformers' from_pretrained does (it loads every tensor of a shard)"
            )
        del obj
    if without_crc:
        found.warnings.append(
            f"{', '.join(without_crc[:MAX_NAMED])}: no CRC-32 recorded in the zip archive "
            "(saved with torch.serialization's compute_crc32 off); their bytes were not checked"
        )
    unchecked: list[str] = []
    if not single and listing is not None:
        accounted = set(files) | ({index} if index else set())
        why = "the index does not list it" if index else "pytorch_model.bin was chosen"
        unchecked = unreferenced(found, location, listing, accounted, "pickle", why)
    return found.report(
        location, kind, files, tensors_checked=tensors_checked, bytes_checked=bytes_checked,
        checksums=checksums and not without_crc, unchecked=unchecked, notes=[_pickled_note(checksums)],
    )


def _zip_crc(path: str, where: str, advance: Callable[[int], None] | None = None) -> tuple[int, bool, list[str]]:
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
                        if advance is not None:
                            advance(len(piece))
            except Exception as exc:  # BadZipFile("Bad CRC-32 ..."), EOFError on a truncated file
                problems.append(
                    f"{where}: record {record.filename!r} of the zip archive does not match its "
                    f"CRC-32 or cannot be read ({type(exc).__name__}: {exc}); the file is damaged. "
                    "Restore it from a copy"
                )
        return read, True, problems
