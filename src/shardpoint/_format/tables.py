"""Per-rank chunk tables of a save described by rules (format version 3).

A tensor described by a :class:`~shardpoint._planning.rules.Rule` has no chunk list in the
manifest; the rank that wrote its cells records, in a small JSON table of its own
(``shardpoint-r00003.json``), the facts only the writer knows: the file each cell went to
and its crc32c. The manifest holds each table's size and crc32c, so a table is checked
before it is parsed and cannot be swapped in from another save, and a loader reads only
the tables of the ranks whose cells it needs.

A table::

    {"format": "shardpoint-table", "save_id": "...", "rank": 3,
     "files": [["model-r00003-00001.safetensors", 1048712], ...],
     "chunks": [[slot, cell, file, crc32c], ...]}

``slot`` numbers the manifest's rule-described tensors in manifest order, ``cell`` is the
row-major number of the cell in its tensor's grid, ``file`` an index into ``files``; inside
the file the chunk's key is the tensor's name.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._checksum import crc32c
from .._planning.rules import Rule, cell_box, unravel
from ..errors import CorruptCheckpointError
from .names import check_file_name
from .safetensors import parse_json_object

TABLE_FORMAT = "shardpoint-table"


def table_name(rank: int) -> str:
    """The name of rank ``rank``'s table.

    >>> table_name(3)
    'shardpoint-r00003.json'
    """
    return f"shardpoint-r{rank:05d}.json"


class ChunkFact(NamedTuple):
    """A cell as its writer recorded it."""

    file: str
    crc32c: int


class Table(NamedTuple):
    """A rank's table, checked."""

    files: dict[str, int]
    """Data file -> size in bytes."""
    chunks: dict[tuple[int, int], ChunkFact]
    """(slot, cell number) -> where it is stored."""


def render_table(
    save_id: str, rank: int, files: dict[str, int], chunks: Sequence[tuple[int, int, str, int]]
) -> bytes:
    """A rank's table: its files and, per cell it wrote, (slot, cell number, file, crc32c)."""
    index = {name: i for i, name in enumerate(files)}
    doc = {
        "format": TABLE_FORMAT,
        "save_id": save_id,
        "rank": rank,
        "files": [[name, size] for name, size in files.items()],
        "chunks": [[slot, cell, index[file], crc] for slot, cell, file, crc in chunks],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the table is damaged or forged (run `shardpoint verify`)")


def parse_table(
    raw: bytes,
    *,
    where: str,
    save_id: str,
    rank: int,
    expected: tuple[int, int],
    rules: Sequence[tuple[str, tuple[int, ...], int, Rule]],
) -> Table:
    """Check and decode rank ``rank``'s table.

    Args:
        expected: (size, crc32c) the manifest recorded for it: checked before parsing.
        rules: per slot, (label, shape, itemsize, rule) of the tensor.
    """
    size, crc = expected
    if len(raw) != size or crc32c(raw) != crc:
        raise CorruptCheckpointError(
            f"{where} is {len(raw)} bytes with crc32c {crc32c(raw):08x}, but the manifest recorded "
            f"{size} bytes with crc32c {crc:08x}; the table is damaged or from another save"
        )
    try:
        doc: Any = parse_json_object(raw, where=where)  # depth-limited, keys unique
    except CorruptCheckpointError as exc:
        raise _bad(where, f"not a JSON object ({str(exc).removeprefix(where).lstrip(': ')})") from None
    if type(doc) is not dict or doc.get("format") != TABLE_FORMAT:
        raise _bad(where, "not a shardpoint table")
    if doc.get("save_id") != save_id or doc.get("rank") != rank:
        raise _bad(where, f"it names save {str(doc.get('save_id'))[:40]!r}, rank {str(doc.get('rank'))[:12]}, "
                          f"not save {save_id!r}, rank {rank}")
    files_raw, chunks_raw = doc.get("files"), doc.get("chunks")
    if type(files_raw) is not list or type(chunks_raw) is not list:
        raise _bad(where, "'files' and 'chunks' must be lists")
    files: dict[str, int] = {}
    names: list[str] = []
    for item in files_raw:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str or type(item[1]) is not int:
            raise _bad(where, f"file entry {str(item)[:80]} is not [name, size]")
        check_file_name(item[0], where=where)
        if not re.fullmatch(rf".+-r{rank:05d}-[0-9]{{5,}}\.safetensors", item[0]):
            raise _bad(where, f"file {item[0]!r} is not one of rank {rank}'s files (<component>-r{rank:05d}-NNNNN.safetensors)")
        if item[0] in files or item[1] < 8:
            raise _bad(where, f"file {item[0]!r} is listed twice or has size {item[1]}")
        files[item[0]] = item[1]
        names.append(item[0])
    chunks: dict[tuple[int, int], ChunkFact] = {}
    used: set[tuple[int, int]] = set()
    keys: set[tuple[int, str]] = set()
    """(file, key in it) of every chunk: one stored tensor backs one chunk, never several
    (else a table could make a load allocate far more than its files hold)."""
    for item in chunks_raw:
        if type(item) is not list or len(item) != 4 or not all(type(v) is int for v in item):
            raise _bad(where, f"chunk entry {str(item)[:80]} is not [slot, cell, file, crc32c]")
        slot, cell, fidx, ccrc = item
        if not 0 <= slot < len(rules) or not 0 <= fidx < len(names) or not 0 <= ccrc < 2**32:
            raise _bad(where, f"chunk entry {item} is out of range")
        label, shape, itemsize, rule = rules[slot]
        if not 0 <= cell < rule.cells:
            raise _bad(where, f"tensor {label!r}: cell {cell} is out of range (its grid has {rule.cells})")
        index = unravel(rule.grid, cell)
        box = cell_box(shape, rule.grid, index)[1]
        whole = math.prod(shape) == 0 and cell == 0
        if rule.writer(index) != rank or not (whole or math.prod(box)):
            raise _bad(where, f"tensor {label!r}: cell {cell} is not one rank {rank} writes")
        key = (fidx, label.partition("/")[2])  # a file's key is the tensor's name in its component
        if (slot, cell) in chunks or (slot, fidx) in used or key in keys:
            raise _bad(where, f"tensor {label!r}: cell {cell} is listed twice, or a second chunk of it in one "
                              f"file, or its key in {names[fidx]!r} backs another chunk")
        if math.prod(box) * itemsize > files[names[fidx]]:
            raise _bad(where, f"tensor {label!r}: cell {cell} is larger than its file {names[fidx]!r}")
        used.add((slot, fidx))
        keys.add(key)
        chunks[(slot, cell)] = ChunkFact(names[fidx], ccrc)
    return Table(files, chunks)
