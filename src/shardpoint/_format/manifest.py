"""The manifest ``shardpoint.json``: written last, its presence means the save committed.

JSON only, never pickle. ``parse_manifest`` validates every field before anything is read
from the data files; the JSON Schema in ``manifest.schema.json`` documents the same shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._planning.chunks import overlapping_pair
from .._planning.rules import Rule, describe_checks
from .._tree_validation import validate_tree
from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedFormatError
from .dtypes import dtype_from_name, itemsize
from .names import check_component_name, check_file_name
from .safetensors import addressable, colons, parse_json_object, quick_shape, require_unique_keys
from .tables import table_name

MANIFEST_NAME = "shardpoint.json"
PENDING_NAME = "shardpoint.pending"
"""On an object store: written before anything else of a save and deleted after its
manifest; a prefix holding it and no manifest is a save that never committed."""
FORMAT_NAME = "shardpoint"
FORMAT_VERSION = 3
"""Written by this shardpoint. Version 2 lets a chunk that is its whole tensor leave out
``offsets`` and ``shape``, and any chunk leave out a ``key`` equal to the tensor's name.
Version 3 lets a regularly sharded tensor give a rule (``grid`` and ``writer``) in place of
its chunks, whose files and crc32c are then in the writers' tables (``tables``)."""
READ_VERSIONS = (1, 2, 3)
"""Versions this shardpoint reads (version 1 chunks give every field)."""
LAYOUTS = ("hf", "chunked")


class ChunkRef(NamedTuple):
    """Where one stored piece of a tensor lives. (Named tuples, this and ``TensorRecord``:
    a manifest holds one per tensor, and a state may hold 10^5 small ones.)"""

    file: str
    """Data file (a plain basename inside the checkpoint)."""
    key: str
    """Tensor name inside that file's safetensors header."""
    offsets: tuple[int, ...]
    """Position of the chunk's first element in the global tensor, per dimension."""
    shape: tuple[int, ...]
    """Shape of the chunk."""
    crc32c: int | None
    """crc32c of the chunk's stored bytes (None for foreign checkpoints)."""

    def numel(self) -> int:
        return math.prod(self.shape)


class TensorRecord(NamedTuple):
    """A tensor of the saved state: global dtype and shape, and the chunks that hold it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]
    """Empty for a tensor described by ``rule`` until its tables are read
    (:meth:`~shardpoint._checkpoint.Checkpoint.resolved`)."""
    rule: Rule | None = None
    """Format 3: where a regularly sharded tensor's cells are (the chunks are in tables)."""
    slot: int = -1
    """The tensor's number among the manifest's rule-described tensors (tables name it so)."""


@dataclass(frozen=True)
class ComponentRecord:
    """One top-level component (``model``, ``optim``, ...)."""

    tree: dict[str, Any]
    """The JSON tree of the component's state (see ``shardpoint._flatten``; checked by ``shardpoint._tree_validation``)."""
    tensors: dict[str, TensorRecord]
    aliases: dict[str, str] = field(default_factory=dict)
    """Tensor names stored once under another name (tied weights): alias -> stored name."""


@dataclass(frozen=True)
class Manifest:
    save_id: str
    created: str
    library_version: str
    world_size: int
    layout: str
    flat: bool
    """The state was a flat ``dict[str, Tensor]``; ``load`` returns it flat again."""
    components: dict[str, ComponentRecord]
    files: dict[str, int]
    """Data file name -> size in bytes."""
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    """The version the manifest was read as (``to_json`` always writes ``FORMAT_VERSION``)."""
    tables: tuple[tuple[int, int] | None, ...] = ()
    """Format 3: (size, crc32c) of each rank's table (``_format/tables.py``), by rank (None: the
    rank wrote no chunk, and no table: a DDP state leaves most ranks so); empty
    when every tensor lists its chunks."""

    def table_files(self) -> list[str]:
        """The names of the tables (format 3)."""
        return [table_name(rank) for rank, t in enumerate(self.tables) if t is not None]

    def rule_slots(self) -> list[tuple[str, str, TensorRecord]]:
        """(component, name, record) of each rule-described tensor, by slot."""
        return [(c, n, r) for c, comp in self.components.items() for n, r in comp.tensors.items() if r.rule is not None]

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "library_version": self.library_version,
            "created": self.created,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "layout": self.layout,
            "flat": self.flat,
            "metadata": self.metadata,
            "components": {
                name: {
                    "tree": tree_json(comp.tree),
                    "aliases": comp.aliases,
                    "tensors": {
                        tname: tensor_json(rec, tname) for tname, rec in comp.tensors.items()
                    },
                }
                for name, comp in self.components.items()
            },
            "files": {name: {"size": size} for name, size in self.files.items()},
        }
        if self.tables:
            doc["tables"] = [list(t) if t is not None else None for t in self.tables]
        # Compact: the C encoder (``indent`` forces the pure-Python one, ~100x slower on the
        # manifest of a large sharded model). ``shardpoint inspect`` is the readable view.
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def tree_json(tree: dict[str, Any]) -> dict[str, Any]:
    """A component's tree as format 2 writes it: a str-keyed dict whose every value is the
    tensor named as its key (what a flat state dict is) becomes ``{"type": "dict",
    "tensors": [names in order]}``, naming each tensor once instead of three times; any
    other tree is written as it is. :func:`parse_manifest` expands it back."""
    items = tree.get("items") if tree.get("type") == "dict" and len(tree) == 2 else None
    if type(items) is not list:
        return tree
    names = []
    for item in items:
        kind, key, child = item
        if kind != "str" or child != {"type": "tensor", "name": key}:
            return tree
        names.append(key)
    return {"type": "dict", "tensors": names}


def _tensor_dict(tree: dict[str, Any], known: Any, where: str) -> tuple[dict[str, Any], int] | None:
    """The full tree of a ``{"type": "dict", "tensors": [...]}`` shorthand, once its names
    are checked as ``validate_tree`` checks the full form (strings, none twice, each a
    tensor or alias of the component), and the keys and in-string colons it held; None
    for any other tree."""
    if tree.get("type") != "dict" or "tensors" not in tree:
        return None
    names = tree["tensors"]
    _need(len(tree) == 2 and type(names) is list, where, "the tree's 'tensors' form must be only a list of names")
    _need(all(type(n) is str for n in names), where, "the tree's 'tensors' list holds a name that is not a string")
    unique = set(names)
    if len(unique) != len(names):
        seen: set[str] = set()
        twice = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        _need(False, where, f"the tree's 'tensors' list names {twice[:80]!r} twice")
    missing = unique - known
    _need(not missing, where, f"the tree names {str(min(missing, default=''))[:80]!r}, which is not a tensor of this component")
    full = {"type": "dict", "items": [["str", n, {"type": "tensor", "name": n}] for n in names]}
    return full, 2 + colons(tree) + colons(names)


def tensor_json(rec: TensorRecord, name: str) -> dict[str, Any]:
    """A tensor's manifest entry: its chunks, or its rule (format 3)."""
    doc: dict[str, Any] = {"dtype": rec.dtype, "shape": list(rec.shape)}
    if rec.rule is not None:
        doc["grid"] = list(rec.rule.grid)
        doc["writer"] = [rec.rule.base, list(rec.rule.strides)]
    else:
        doc["chunks"] = [chunk_json(c, name, rec.shape) for c in rec.chunks]
    return doc


def chunk_json(chunk: ChunkRef, name: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """A chunk's manifest entry, leaving out what version 2 lets a reader infer: the
    ``key`` when it is the tensor's ``name``, ``offsets`` and ``shape`` when the chunk is
    the whole tensor (a state of many small tensors would otherwise spend most of its
    manifest repeating them)."""
    doc: dict[str, Any] = {"file": chunk.file}
    if chunk.key != name:
        doc["key"] = chunk.key
    if chunk.shape != shape or any(chunk.offsets):
        doc["offsets"] = list(chunk.offsets)
        doc["shape"] = list(chunk.shape)
    doc["crc32c"] = chunk.crc32c
    return doc


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"{where}: {what}; the manifest is damaged or forged")


def _int_list(value: Any, where: str, what: str) -> tuple[int, ...]:
    _need(
        isinstance(value, list) and len(value) <= 64 and all(type(v) is int and v >= 0 for v in value),
        where,
        f"{what} {str(value)[:80]} is not a list of non-negative integers",
    )
    return tuple(value)


def _shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    shape = _int_list(value, where, what)
    _need(addressable(shape), where, f"{what} {str(value)[:80]} is too large for any tensor")
    return shape


_ZEROS = [(0,) * n for n in range(65)]


def json_keys(value: Any) -> int:
    """Keys of every object in the decoded JSON ``value`` plus the colons inside its
    strings: the count :func:`~shardpoint._format.safetensors.require_unique_keys` checks."""
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            count += len(item) + colons(item)
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        elif kind is str:
            count += item.count(":")
    return count


def _whole_tensor(
    rec: Any, name: str, files: dict[str, int], used: set[tuple[str, str]], item_of: dict[str, int]
) -> TensorRecord | None:
    """The record of a tensor stored whole under its own name, as format 2 writes it
    (``{"dtype", "shape", "chunks": [{"file", "crc32c"}]}``) when every check passes
    plainly; None sends it through the full checks, which say what is wrong. A state of
    10^5 small tensors is 10^5 of these."""
    if type(rec) is not dict or len(rec) != 3:
        return None
    dtype, chunks = rec.get("dtype"), rec.get("chunks")
    if type(dtype) is not str:
        return None
    item = item_of.get(dtype)
    shape = quick_shape(rec.get("shape"))
    if item is None or shape is None or type(chunks) is not list or len(chunks) != 1:
        return None
    chunk = chunks[0]
    if type(chunk) is not dict or len(chunk) != 2 or "file" not in chunk or "crc32c" not in chunk:
        return None
    file, crc = chunk["file"], chunk["crc32c"]
    if type(file) is not str or file not in files or (file, name) in used:
        return None
    if crc is not None and not (type(crc) is int and 0 <= crc < 2**32):
        return None
    if math.prod(shape) * item > files[file]:
        return None
    used.add((file, name))
    return TensorRecord(dtype, shape, (ChunkRef(file, name, _ZEROS[len(shape)], shape, crc),))


def _tables(value: Any, version: int, world_size: int, where: str) -> tuple[tuple[int, int] | None, ...]:
    """The (size, crc32c) of each rank's table (None: no table), checked."""
    if value == []:
        return ()
    _need(version >= 3 and type(value) is list and len(value) == world_size, where,
          "'tables' must list one [size, crc32c] per rank of the save")
    out: list[tuple[int, int] | None] = []
    for item in value:
        if item is None:
            out.append(None)
            continue
        _need(
            type(item) is list and len(item) == 2 and all(type(v) is int for v in item)
            and 2 <= item[0] < 2**40 and 0 <= item[1] < 2**32,
            where, f"table entry {str(item)[:80]} is not [size, crc32c]",
        )
        out.append((item[0], item[1]))
    return tuple(out)


def _rule_tensor(rec: dict[str, Any], slot: int, world_size: int, has_tables: bool, where: str) -> TensorRecord:
    """A tensor given by a rule (format 3): ``{"dtype", "shape", "grid", "writer": [base, strides]}``."""
    _need(set(rec) == {"dtype", "shape", "grid", "writer"}, where, "a rule entry has exactly dtype, shape, grid, writer")
    _need(has_tables, where, "it is described by a rule but the manifest lists no tables")
    dtype = rec["dtype"]
    itemsize(dtype_from_name(dtype, where=where))
    shape = _shape(rec["shape"], where, "shape")
    grid = _int_list(rec["grid"], where, "grid")
    writer = rec["writer"]
    _need(type(writer) is list and len(writer) == 2 and type(writer[0]) is int, where, "'writer' is not [base, strides]")
    rule = Rule(grid, writer[0], _int_list(writer[1], where, "writer strides"))
    problem = describe_checks(rule, shape, world_size)
    _need(problem is None, where, str(problem))
    return TensorRecord(dtype, shape, (), rule, slot)


def parse_manifest(raw: bytes, *, where: str) -> Manifest:
    """Validate and decode a manifest; ``where`` names the file in errors."""
    try:
        return _parse_manifest(raw, where=where)
    except CheckpointError:
        # A key given twice is what is wrong with a forged manifest, whatever its
        # deduplicated value then failed: the full parse names it (and raises nothing
        # without one, so the error found stands).
        parse_json_object(raw, where=where)
        raise


def _parse_manifest(raw: bytes, *, where: str) -> Manifest:
    doc = parse_json_object(raw, where=where, count_keys=True)
    # Keys (and colons inside strings) of what is validated below, checked against the
    # text at the end (see ``require_unique_keys``): the parts whose count is known from
    # their validation are counted as such, the free-form ones (tree, metadata) walked.
    counted = len(doc) + colons(doc) + json_keys([doc.get(k) for k in doc if k not in ("components", "files")])
    if doc.get("format") != FORMAT_NAME:
        raise UnsupportedFormatError(f"{where}: 'format' is {repr(doc.get('format'))[:80]}, not 'shardpoint'")
    version = doc.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise UnsupportedFormatError(
            f"{where}: format_version {repr(version)[:80]} is not supported by this shardpoint "
            f"(reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade shardpoint to read it"
        )
    compact = version >= 2
    layout = doc.get("layout")
    if layout not in LAYOUTS:
        raise UnsupportedFormatError(f"{where}: unknown layout {repr(layout)[:80]}; known: {', '.join(LAYOUTS)}")
    world_size: Any = doc.get("world_size")
    _need(type(world_size) is int and world_size >= 1, where, f"world_size {repr(world_size)[:80]} is invalid")
    for key in ("save_id", "created", "library_version"):
        _need(isinstance(doc.get(key), str), where, f"{key!r} is missing or not a string")
    _need(isinstance(doc.get("flat"), bool), where, "'flat' is missing or not a bool")
    metadata = doc.get("metadata", {})
    _need(isinstance(metadata, dict), where, "'metadata' is not an object")

    files_raw: Any = doc.get("files")
    _need(isinstance(files_raw, dict), where, "'files' is missing or not an object")
    files: dict[str, int] = {}
    for fname, info in files_raw.items():
        check_file_name(fname, where=where)
        size: Any = info.get("size") if isinstance(info, dict) else None
        _need(type(size) is int and size >= 8, where, f"file {fname!r} has invalid size {size!r}")
        files[fname] = size
    counted += len(files) + colons(files) + sum(map(len, files_raw.values()))
    tables = _tables(doc.get("tables", []), version, world_size, where)

    comps_raw: Any = doc.get("components")
    _need(isinstance(comps_raw, dict) and bool(comps_raw), where, "'components' is missing or empty")
    _need(
        not doc["flat"] or list(comps_raw) == ["model"],
        where,
        "a flat checkpoint must have exactly the component 'model'",
    )
    counted += len(comps_raw) + colons(comps_raw)
    components: dict[str, ComponentRecord] = {}
    # Each stored (file, key) backs one chunk of one tensor (tied weights are aliases), so
    # the tensors of a manifest can never need more memory than its files hold.
    used: set[tuple[str, str]] = set()
    slots: list[str] = []
    """The rule-described tensors so far (format 3)."""
    item_of: dict[str, int] = {}
    """Bytes per element of each dtype string already checked."""
    for cname, craw in comps_raw.items():
        check_component_name(cname, where=where)
        cwhere = f"{where}, component {cname!r}"
        _need(isinstance(craw, dict), cwhere, "entry is not an object")
        tree = craw.get("tree")
        _need(isinstance(tree, dict), cwhere, "'tree' is missing")
        aliases = craw.get("aliases", {})
        _need(
            isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values()),
            cwhere,
            "'aliases' must map names to names",
        )
        traw = craw.get("tensors")
        _need(isinstance(traw, dict), cwhere, "'tensors' is missing")
        counted += len(craw) + colons(craw) + json_keys(aliases) + len(traw) + colons(traw)
        tensors: dict[str, TensorRecord] = {}
        for tname, rec in traw.items():
            if version >= 3 and type(rec) is dict and "grid" in rec:
                counted += json_keys(rec)
                tensors[tname] = _rule_tensor(rec, len(slots), world_size, bool(tables), f"{cwhere}, tensor {tname!r}")
                slots.append(tname)
                continue
            whole = _whole_tensor(rec, tname, files, used, item_of) if compact else None
            if whole is not None:
                tensors[tname] = whole
                # The record's three keys, its chunk's two, the file name's colons.
                counted += 5 + whole.chunks[0].file.count(":")
                continue
            counted += json_keys(rec)
            twhere = f"{cwhere}, tensor {tname!r}"
            _need(isinstance(rec, dict), twhere, "entry is not an object")
            dtype = rec.get("dtype")
            item = item_of.get(dtype) if type(dtype) is str else None
            if item is None:
                item = item_of[dtype] = itemsize(dtype_from_name(dtype, where=twhere))
            shape = quick_shape(rec.get("shape")) or _shape(rec.get("shape"), twhere, "shape")
            chunks_raw: Any = rec.get("chunks")
            _need(isinstance(chunks_raw, list) and bool(chunks_raw), twhere, "'chunks' is missing or empty")
            chunks = []
            covered = 0
            for ch in chunks_raw:
                _need(isinstance(ch, dict), twhere, "a chunk is not an object")
                cfile, ckey = ch.get("file"), ch.get("key", tname) if compact else ch.get("key")
                _need(isinstance(cfile, str) and cfile in files, twhere, f"chunk file {cfile!r} is not in 'files'")
                _need(isinstance(ckey, str), twhere, "chunk key is not a string")
                _need(
                    (cfile, ckey) not in used,
                    twhere,
                    f"chunk {ckey!r} of {cfile!r} is already used by another tensor",
                )
                used.add((cfile, ckey))
                if compact and "offsets" not in ch and "shape" not in ch:
                    offs, cshape = (0,) * len(shape), shape  # the whole tensor
                else:
                    offs = _int_list(ch.get("offsets"), twhere, "chunk offsets")
                    cshape = _shape(ch.get("shape"), twhere, "chunk shape")
                    _need(
                        len(offs) == len(shape) == len(cshape)
                        and all(o + s <= d for o, s, d in zip(offs, cshape, shape, strict=False)),
                        twhere,
                        f"chunk at {list(offs)} of shape {list(cshape)} does not fit shape {list(shape)}",
                    )
                crc = ch.get("crc32c")
                _need(crc is None or (type(crc) is int and 0 <= crc < 2**32), twhere, "bad crc32c")
                _need(
                    math.prod(cshape) * item <= files[cfile],
                    twhere,
                    f"chunk of shape {list(cshape)} is larger than its file {cfile!r}",
                )
                covered += math.prod(cshape)
                chunks.append(ChunkRef(cfile, ckey, offs, cshape, crc))
            _need(
                covered == math.prod(shape),
                twhere,
                f"chunks hold {covered} elements, the tensor has {math.prod(shape)}",
            )
            clash = overlapping_pair([(c.offsets, c.shape) for c in chunks]) if len(chunks) > 1 else None
            _need(
                clash is None,
                twhere,
                "chunks overlap ({}; a tensor's chunks must each hold a different part of it)".format(
                    " and ".join(f"{chunks[i].key!r} of {chunks[i].file!r} at {list(chunks[i].offsets)} "
                                 f"shape {list(chunks[i].shape)}" for i in clash or ())),
            )
            if layout == "hf" and not (len(chunks) == 1 and chunks[0].key == tname and chunks[0].shape == shape):
                _need(False, twhere, "in the 'hf' layout a tensor is stored whole under its own name (what "
                      f"every other reader of the files loads), but the manifest reads it from {chunks[0].key!r}"
                      + (f" and {len(chunks) - 1} more chunk(s)" if len(chunks) > 1 else ""))
            tensors[tname] = TensorRecord(dtype, shape, tuple(chunks))
        for alias, target in aliases.items():
            _need(alias not in tensors, cwhere, f"alias {alias!r} is also a stored tensor")
            _need(target in tensors, cwhere, f"alias {alias!r} points to unknown tensor {target!r}")
        known = tensors.keys() | aliases.keys()
        shorthand = _tensor_dict(tree, known, cwhere) if compact else None
        if shorthand is not None:
            tree, tree_keys = shorthand
            counted += tree_keys
        else:
            counted += json_keys(tree)
            # The one check of the tree that load, load_into, convert and diff all rely on.
            validate_tree(tree, known, where=cwhere)
        components[cname] = ComponentRecord(tree, tensors, dict(aliases))
    require_unique_keys(raw, counted, where=where)
    return Manifest(
        save_id=doc["save_id"],
        created=doc["created"],
        library_version=doc["library_version"],
        world_size=world_size,
        layout=layout,
        flat=doc["flat"],
        components=components,
        files=files,
        metadata=metadata,
        format_version=version,
        tables=tables,
    )
