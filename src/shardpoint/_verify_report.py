"""What ``verify_checkpoint`` reports, and the bookkeeping its checks share: problems
collected per file, files the checkpoint does not account for, how files and tensors are
named in a problem line."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._checkpoint import Checkpoint
from ._format.companions import role
from ._format.dtypes import NAME_TO_DTYPE, itemsize
from ._format.names import is_tmp_name

MAX_NAMED = 5
"""How many tensor names a problem line lists before saying "and N more"."""


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_checkpoint`` found."""

    path: str
    """The path that was checked, as given."""
    kind: str
    """``shardpoint``, ``hf-index``, ``hf-file``, ``hf-bin`` (``.bin`` shards and their index)
    or ``torch-save`` (one ``.bin`` / ``.pt`` file): the kinds of ``_format.detect``."""
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
class CrcItem:
    """One stored tensor to checksum: a byte range of a data file and its expected crc."""

    file: str
    start: int
    nbytes: int
    crc32c: int
    label: str


@dataclass
class Findings:
    """Problems collected per file (``""`` for the checkpoint as a whole), and warnings."""

    by_file: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def problem(self, file: str, message: str) -> None:
        self.by_file.setdefault(file, []).append(message)

    def flat(self, file_order: Sequence[str]) -> list[str]:
        ordered = ["", *file_order, *sorted(f for f in self.by_file if f not in file_order and f)]
        return [msg for name in dict.fromkeys(ordered) for msg in self.by_file.get(name, [])]

    def report(
        self,
        path: str,
        kind: str,
        files: Sequence[str],
        *,
        tensors_checked: int,
        bytes_checked: int,
        checksums: bool,
        unchecked: list[str],
        notes: Sequence[str] = (),
    ) -> VerifyReport:
        """The report of a check of ``files`` (every one examined), with what was found."""
        return VerifyReport(
            path=path,
            kind=kind,
            problems=self.flat(files),
            warnings=self.warnings,
            files_checked=len(files),
            tensors_checked=tensors_checked,
            bytes_checked=bytes_checked,
            checksums=checksums,
            unchecked=unchecked,
            notes=list(notes),
        )


def unreferenced(
    found: Findings,
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


def file_label(ckpt: Checkpoint, fname: str) -> str:
    """How problems name data file ``fname``: the path the user gave, joined with the name."""
    return ckpt.location if ckpt.location != ckpt.directory else os.path.join(ckpt.location, fname)


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * itemsize(NAME_TO_DTYPE[dtype])


def name_list(names: list[str]) -> str:
    """``tensor 'a'`` / ``tensors 'a', 'b' and 3 more``."""
    shown = ", ".join(repr(n) for n in names[:MAX_NAMED])
    more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    return f"tensor{'s' if len(names) > 1 else ''} {shown}{more}"
