"""The chunks of rule-described tensors (format 3), read from their writers' tables on demand.

A loader asks for the chunks of a tensor that overlap the region it fills
(:meth:`RuleChunks.chunks`): the rule says which cells those are and which rank wrote each,
and only those ranks' tables are read (once each, checked against the manifest's size and
crc32c). :meth:`RuleChunks.expand` reads every table, for the tools that look at everything
(``verify``, ``inspect``, ``convert``, ``diff``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

from ._format.dtypes import NAME_TO_DTYPE
from ._format.manifest import ChunkRef, ComponentRecord, Manifest, TensorRecord
from ._format.tables import Table, parse_table, table_name
from ._io.files import read_error
from ._planning.rules import cell_box, cells_overlapping, linear
from .errors import CheckpointError, CorruptCheckpointError, MissingShardError


class RuleChunks:
    """The tables of one opened checkpoint, read as they are needed."""

    def __init__(self, manifest: Manifest, location: str, read: Callable[[str, str], bytes]) -> None:
        self.manifest = manifest
        self.location = location
        self._read = read
        """(name, how errors name it) -> the bytes of a small file of the checkpoint."""
        slots = manifest.rule_slots()
        self.names = [name for _, name, _ in slots]
        self._rules = [
            (f"{c}/{n}", r.shape, NAME_TO_DTYPE[r.dtype].itemsize if r.dtype in NAME_TO_DTYPE else 1, r.rule)
            for c, n, r in slots
            if r.rule is not None
        ]
        self._tables: dict[int, Table] = {}
        self._lock = threading.Lock()
        self.files: dict[str, int] = {}
        """Data files of the tables read so far -> size."""

    def table(self, rank: int) -> Table:
        """Rank ``rank``'s table (read and checked once)."""
        found = self._tables.get(rank)
        if found is not None:
            return found
        with self._lock:
            found = self._tables.get(rank)
            if found is None:
                name = table_name(rank)
                where = f"{self.location}/{name}"
                expected = self.manifest.tables[rank]
                if expected is None:  # the rank wrote nothing: no cell can be its
                    found = Table({}, {})
                    self._tables[rank] = found
                    return found
                try:
                    raw = self._read(name, where)
                except FileNotFoundError:
                    raise MissingShardError(
                        f"{where} is missing: the manifest lists the chunk table of rank {rank}, but it "
                        "is not there; the checkpoint is incomplete (copy the file back or load another checkpoint)"
                    ) from None
                except CheckpointError:
                    raise
                except OSError as exc:
                    raise read_error(exc, where, "reading") from None
                found = parse_table(raw, where=where, save_id=self.manifest.save_id, rank=rank,
                                    expected=expected, rules=self._rules)
                for fname, size in found.files.items():
                    if self.files.setdefault(fname, size) != size or fname in self.manifest.files:
                        raise CorruptCheckpointError(
                            f"{where} lists {fname!r}, which another table or the manifest lists too; "
                            "the checkpoint is damaged or forged"
                        )
                self._tables[rank] = found
        return found

    @property
    def tables_read(self) -> int:
        return len(self._tables)

    def chunks(
        self, record: TensorRecord, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> tuple[ChunkRef, ...]:
        """The stored chunks of ``record`` that overlap the box (default: all of them)."""
        rule = record.rule
        assert rule is not None
        name = self.names[record.slot]
        full = record.shape
        numel = math.prod(full)
        if numel == 0:  # an empty tensor: stored once, by the writer of cell 0
            cells: Iterable[tuple[int, ...]] = [(0,) * len(full)]
        elif offsets is None or shape is None:  # every non-empty cell (never a loop over empty ones)
            cells = cells_overlapping(full, rule.grid, (0,) * len(full), full)
        else:
            cells = cells_overlapping(full, rule.grid, offsets, shape)
        out = []
        for cell in cells:
            box_offsets, box_shape = cell_box(full, rule.grid, cell)
            empty = math.prod(box_shape) == 0
            if empty and numel:
                continue
            rank = rule.writer(cell)
            fact = self.table(rank).chunks.get((record.slot, linear(rule.grid, cell)))
            if fact is None:
                raise CorruptCheckpointError(
                    f"{self.location}: tensor {name!r}: its chunk at {list(box_offsets)} (shape "
                    f"{list(box_shape)}) is missing from {table_name(rank)}, the table of the rank "
                    "that wrote it; the checkpoint is incomplete"
                )
            out.append(ChunkRef(fact.file, name, box_offsets, full if empty else box_shape, fact.crc32c))
        return tuple(out)

    def expand(self) -> tuple[dict[str, ComponentRecord], dict[str, int]]:
        """Every table read: the components with every chunk listed, and every data file."""
        for rank in range(len(self.manifest.tables)):
            self.table(rank)
        components = {}
        for cname, comp in self.manifest.components.items():
            tensors = {
                n: r._replace(chunks=self.chunks(r)) if r.rule is not None else r for n, r in comp.tensors.items()
            }
            components[cname] = ComponentRecord(comp.tree, tensors, dict(comp.aliases))
        # Every chunk a table lists is a cell its rank writes (parse_table checks), so the
        # chunks placed here are exactly the tables' chunks: none is left unaccounted for.
        return components, {**self.manifest.files, **self.files}
