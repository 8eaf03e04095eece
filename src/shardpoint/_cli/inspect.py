"""Show what a checkpoint holds, without reading any tensor data.

Works on shardpoint checkpoints (reads the manifest only), Hugging Face sharded directories
(index + headers), single .safetensors files (header), and torch.save weights as sp.load
reads them: Hugging Face .bin shards (pytorch_model.bin.index.json), pytorch_model.bin or
a .bin/.pt file, through torch.load(weights_only=True), memory-mapped (never a full
unpickle; no tensor data is read).

The --json object has these keys:

  path             the path given
  resolved         for an hf:// reference only: the snapshot folder it names in the cache
  format           "shardpoint", "hf-index", "hf-file", "hf-bin" or "torch-save"
  format_version   manifest format version (null for foreign checkpoints)
  library_version  shardpoint version that saved it (null for foreign checkpoints)
  created          save time, ISO 8601 UTC (null for foreign checkpoints)
  save_id          id of the save (null for foreign checkpoints)
  layout           "hf" or "chunked" ("hf" for foreign checkpoints)
  world_size       ranks that saved it (null for foreign checkpoints)
  flat             true when it holds one flat state dict (component "model")
  metadata         the user's metadata saved in the manifest ({} for foreign)
  components       {name: {"tensors": int, "aliases": int, "bytes": int, "files": [str]}}
  files            [{"name": str, "size": int}] data files, in order
  unchecked        [str] other files of the directory, not read (config.json, tokenizer
                   files, training_args.bin, ...; also stray files that look like data)
  notes            [str] how the checkpoint was read, where it matters (model.pt named,
                   model.safetensors beside it shown instead, as sp.load reads it)
  total_size       bytes of all data files
  tensor_count     stored tensors (tied aliases not counted)
  alias_count      tied names stored once under another name
  tensor_bytes     bytes of tensor data (aliases counted once)
  dtypes           {dtype: {"tensors": int, "bytes": int}}, largest first
  tensors_matched  tensors (and aliases) whose name matches --filter (all without it)
  tensors          the first --limit of them (all by default):
                   [{"name", "component", "dtype", "shape", "bytes", "files", "chunks",
                     "alias_of"}]; "files" are the data files holding its chunks, in order;
                   "alias_of" names the stored tensor a tied name shares (else null)

--filter PATTERN keeps the tensors whose name contains PATTERN anywhere. In PATTERN, *
matches any run of characters (dots included), ? any one character, [abc] one of a set;
a leading ^ anchors it to the start of the name, a trailing $ to the end. So
'layers.*.weight' matches model.layers.0.mlp.up_proj.weight, 'layers.1.' everything of
layer 1, and '.weight$' only names ending in .weight. Names are matched as
"component/name" in nested checkpoints, "name" in flat ones.

With --json a failure prints {"error", "message", "path"} instead (same exit status, 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from .._checkpoint import Checkpoint
from .._format.detect import HF_BIN, TORCH_SAVE, detect
from .._format.dtypes import NAME_TO_DTYPE, dtype_name, itemsize
from .._format.index import index_name
from .._format.manifest import MANIFEST_NAME
from .._format.names import is_tmp_name
from .._hub import resolve_hub
from .._sizes import human_size
from .._source import detect_local, list_directory, open_checkpoint
from .._sources.contract import SourceSpec
from .._sources.pickled import BinShardsSource, TorchSaveSource
from .._storage.store import open_store
from ..errors import InvalidArgumentError
from .main import (
    add_cache_dir,
    add_checkpoint_path,
    add_storage_options,
    hub_storage_options,
    with_reference,
)
from .output import emit, emit_json, printable, table_rows

HELP = "show format, files, dtypes and tensors of a checkpoint"

DEFAULT_LIMIT = 50
"""Rows of the tensor table printed without --limit (--json prints all)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_path(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys above)")
    add_storage_options(parser)
    add_cache_dir(parser)
    parser.add_argument(
        "--filter",
        metavar="PATTERN",
        help="list only tensors whose name contains PATTERN anywhere; * matches any characters "
        "(dots too), ? one, [abc] one of a set, a leading ^ / trailing $ anchor it to the start / "
        "end of the name: 'layers.*.weight' matches model.layers.0.mlp.up_proj.weight",
    )
    parser.add_argument(
        "--limit",
        type=_count_arg,
        metavar="N",
        help=f"list at most N tensors (default {DEFAULT_LIMIT}, all with --json; 0 = all)",
    )


def _count_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def run(args: argparse.Namespace) -> int:
    options = hub_storage_options(args.path, args.storage_options, args.cache_dir)
    path, resolved = resolve_hub(args.path, options)
    limit = args.limit if args.limit is not None else (0 if args.json else DEFAULT_LIMIT)
    doc = describe_path(path, resolved, pattern=args.filter, limit=limit)
    doc = with_reference(doc, args.path)
    if args.json:
        emit_json(doc)
    else:
        emit(render(doc, pattern=args.filter))
    return 0


def describe_path(
    path: str, storage_options: Mapping[str, Any] | None, *, pattern: str | None, limit: int
) -> dict[str, Any]:
    """``describe`` of whatever ``sp.load`` would read at ``path`` (``.bin`` weights too)."""
    location = os.fspath(path)
    notes = []
    pickled: tuple[str, str, str | None] | None = None
    local = open_store(location, storage_options).local_path
    found = detect_local(local) if local is not None and os.path.exists(local) else None
    if found is not None and found.instead_of is not None and found.file is not None:
        sibling = os.path.join(os.path.dirname(location), found.file)
        notes.append(
            f"showing {sibling} instead of {location}: load reads the .safetensors file of the "
            "same stem beside it (same tensors, no unpickling)"
        )
        path = location = sibling
    elif found is not None and found.kind == HF_BIN:
        pickled = (HF_BIN, location, found.index)
    elif found is not None and found.kind == TORCH_SAVE and found.file is not None:
        pickled = (TORCH_SAVE, location if found.named_file else os.path.join(location, found.file), None)
    if pickled is not None:
        doc = describe_pickled(location, *pickled, pattern=pattern, limit=limit)
    else:
        doc = describe(open_checkpoint(path, storage_options), pattern=pattern, limit=limit)
    index = doc.pop("_index", None)
    tables = doc.pop("_tables", [])
    doc["unchecked"] = _unchecked(location, doc, index, tables) if os.path.isdir(location) else []
    doc["notes"] = notes
    return doc


def _unchecked(location: str, doc: dict[str, Any], index: str | None, tables: list[str]) -> list[str]:
    """The directory's files that are not the checkpoint's data, manifest or index."""
    names = list_directory(location, "inspect")
    used = {f["name"] for f in doc["files"]} | {MANIFEST_NAME, index or ""}
    used |= {index_name(c) for c in doc["components"]} | set(tables)
    if doc["format"] == "hf-index":
        used.add(detect(names).index or "")
    return sorted(n for n in names if n not in used and not is_tmp_name(n))


def describe_pickled(
    location: str, kind: str, real: str, index: str | None, *, pattern: str | None, limit: int
) -> dict[str, Any]:
    """The --json object of torch.save weights, read as ``sp.load`` reads them (zip format,
    ``weights_only=True``, mapped: shapes and dtypes only, no tensor data)."""
    spec = SourceSpec(real, kind, trust_pickle=False, zip_only=True, index=index)
    source = BinShardsSource(spec, []) if kind == "hf-bin" else TorchSaveSource(spec, [])
    try:
        file_of: dict[str, str] = getattr(source, "_file_of", {})
        directory = real if kind == "hf-bin" else os.path.dirname(real)
        files = sorted(set(file_of.values())) if kind == "hf-bin" else [os.path.basename(real)]
        components: dict[str, Any] = {}
        dtypes: dict[str, dict[str, int]] = {}
        matched: list[dict[str, Any]] = []
        for comp in source.components:
            comp_bytes = 0
            rows: dict[str, dict[str, Any]] = {}
            for tname in comp.stored:
                meta = comp.tensors[tname]
                dtype = dtype_name(meta.dtype, key=tname)
                nbytes = meta.numel() * meta.element_size()
                comp_bytes += nbytes
                stat = dtypes.setdefault(dtype, {"tensors": 0, "bytes": 0})
                stat["tensors"] += 1
                stat["bytes"] += nbytes
                rows[tname] = {
                    "name": tname,
                    "component": comp.name,
                    "dtype": dtype,
                    "shape": list(meta.shape),
                    "bytes": nbytes,
                    "files": [file_of.get(tname, files[0])],
                    "chunks": 1,
                    "alias_of": None,
                }
            matched += _matching_rows(rows, comp.aliases, None if source.flat else comp.name, pattern)
            components[comp.name] = {
                "tensors": len(comp.stored),
                "aliases": len(comp.aliases),
                "bytes": comp_bytes,
                "files": sorted({r["files"][0] for r in rows.values()}),
            }
    finally:
        source.close()
    sizes = {f: os.path.getsize(os.path.join(directory, f)) for f in files}
    return {
        "path": location,
        "format": kind,
        "format_version": None,
        "library_version": None,
        "created": None,
        "save_id": None,
        "layout": "hf",
        "world_size": None,
        "flat": source.flat,
        "metadata": {},
        "components": components,
        "files": [{"name": f, "size": size} for f, size in sizes.items()],
        "_index": index,
        **_totals(sizes, components, dtypes, matched, limit),
    }


def _totals(sizes: Mapping[str, int], components: Mapping[str, dict[str, Any]], dtypes: Mapping[str, Any],
            matched: list[dict[str, Any]], limit: int | None) -> dict[str, Any]:
    """The description's sums over files, components and dtypes, and its tensor table."""
    return {
        "total_size": sum(sizes.values()),
        "tensor_count": sum(c["tensors"] for c in components.values()),
        "alias_count": sum(c["aliases"] for c in components.values()),
        "tensor_bytes": sum(c["bytes"] for c in components.values()),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: (-kv[1]["bytes"], kv[0]))),
        "tensors_matched": len(matched),
        "tensors": matched[:limit] if limit else matched,
    }


def _matching_rows(
    rows: dict[str, dict[str, Any]], aliases: Mapping[str, str], component: str | None, pattern: str | None
) -> list[dict[str, Any]]:
    """The table rows of one component, its aliases added as rows of their own (``alias_of``
    their target), that ``pattern`` matches; names are ``component/name`` unless flat."""
    for alias, target in aliases.items():
        rows[alias] = {**rows[target], "name": alias, "alias_of": target}
    return [row for tname, row in rows.items()
            if name_matches(tname if component is None else key_name(component, tname), pattern)]


def key_name(component: str, name: str) -> str:
    """How a tensor is named across components: ``component/name``, or the component's
    name alone for a component that is one tensor (stored name ``""``), as ``sp.load``
    keys it.

    >>> key_name("optimizer", "state.0.exp_avg"), key_name("w", "")
    ('optimizer/state.0.exp_avg', 'w')
    """
    return f"{component}/{name}" if name else component


def name_matches(name: str, pattern: str | None) -> bool:
    """True when ``pattern`` occurs anywhere in ``name`` (see the module docstring).

    >>> name_matches("model.layers.0.mlp.up_proj.weight", "layers.*.weight")
    True
    >>> name_matches("model.layers.0.mlp.up_proj.weight_scale", ".weight$")
    False
    >>> name_matches("model.embed_tokens.weight", "^embed")
    False
    """
    if not pattern:
        return True
    return _glob_match(_pattern_tokens(pattern), name)


_STAR = ("*",)


@lru_cache(maxsize=64)
def _pattern_tokens(pattern: str) -> tuple[tuple[Any, ...], ...]:
    """A --filter pattern as tokens: ``("*",)``, ``("?",)``, ``("set", negated, ranges)``,
    ``("char", c)``; unanchored ends become ``*`` (an unclosed ``[`` is a plain character)."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and len(pattern) > int(start)
    body = pattern[int(start) : len(pattern) - int(end)]
    out: list[tuple[Any, ...]] = [] if start else [_STAR]
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "*":
            if not out or out[-1] != _STAR:  # a run of * is one *
                out.append(_STAR)
        elif ch == "?":
            out.append(("?",))
        elif ch == "[" and body.find("]", i + 2 + (body[i + 1 : i + 2] == "!")) >= 0:
            j = i + 1 + (body[i + 1 : i + 2] == "!")
            close = body.find("]", j + 1)  # a "]" right after "[" or "[!" is a member
            members, ranges, k = body[j:close], [], 0
            while k < len(members):
                if k + 2 < len(members) and members[k + 1] == "-":
                    low, high = members[k], members[k + 2]
                    if low > high:
                        raise InvalidArgumentError(
                            f"--filter {printable(pattern)!r}: the range {printable(low)}-{printable(high)} runs "
                            f"backwards; write {printable(high)}-{printable(low)}"
                        )
                    ranges.append((low, high))
                    k += 3
                else:
                    ranges.append((members[k], members[k]))
                    k += 1
            out.append(("set", j > i + 1, tuple(ranges)))
            i = close
        else:
            out.append(("char", ch))
        i += 1
    if not end and (not out or out[-1] != _STAR):
        out.append(_STAR)
    return tuple(out)


def _one(token: tuple[Any, ...], ch: str) -> bool:
    if token[0] == "char":
        return bool(token[1] == ch)
    if token[0] == "?":
        return True
    inside = any(low <= ch <= high for low, high in token[2])
    return inside != token[1]


def _glob_match(tokens: tuple[tuple[Any, ...], ...], text: str) -> bool:
    """Whether ``tokens`` match all of ``text``: one pass that goes back only to the last
    ``*`` (time proportional to their lengths' product; a regular expression of many ``*``
    backtracked for minutes on a 64-character name)."""
    t = p = 0
    star, mark = -1, 0
    while t < len(text):
        if p < len(tokens) and tokens[p] == _STAR:
            star, mark = p, t
            p += 1
        elif p < len(tokens) and _one(tokens[p], text[t]):
            t += 1
            p += 1
        elif star >= 0:
            p, mark = star + 1, mark + 1
            t = mark
        else:
            return False
    while p < len(tokens) and tokens[p] == _STAR:
        p += 1
    return p == len(tokens)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * itemsize(NAME_TO_DTYPE[dtype])


def describe(ckpt: Checkpoint, *, pattern: str | None = None, limit: int = 0) -> dict[str, Any]:
    """The --json object (see the module docstring); ``limit=0`` lists every tensor."""
    manifest = ckpt.manifest
    if manifest is not None:
        files = dict(manifest.files)
    else:
        names = [
            c.file
            for comp in ckpt.components.values()
            for r in comp.tensors.values()
            for c in r.chunks
        ]
        files = {f: ckpt.header(f).file_size for f in dict.fromkeys(names)}

    components: dict[str, Any] = {}
    dtypes: dict[str, dict[str, int]] = {}
    matched: list[dict[str, Any]] = []
    for cname, comp in ckpt.components.items():
        comp_bytes = 0
        comp_files: list[str] = []
        rows: dict[str, dict[str, Any]] = {}
        for tname, rec in comp.tensors.items():
            nbytes = _nbytes(rec.dtype, rec.shape)
            comp_bytes += nbytes
            stat = dtypes.setdefault(rec.dtype, {"tensors": 0, "bytes": 0})
            stat["tensors"] += 1
            stat["bytes"] += nbytes
            tfiles = list(dict.fromkeys(c.file for c in rec.chunks))
            comp_files.extend(f for f in tfiles if f not in comp_files)
            rows[tname] = {
                "name": tname,
                "component": cname,
                "dtype": rec.dtype,
                "shape": list(rec.shape),
                "bytes": nbytes,
                "files": tfiles,
                "chunks": len(rec.chunks),
                "alias_of": None,
            }
        matched += _matching_rows(rows, comp.aliases, None if ckpt.flat else cname, pattern)
        components[cname] = {
            "tensors": len(comp.tensors),
            "aliases": len(comp.aliases),
            "bytes": comp_bytes,
            "files": comp_files,
        }

    return {
        "path": ckpt.location,
        "format": ckpt.kind,
        "format_version": manifest.format_version if manifest is not None else None,
        "library_version": manifest.library_version if manifest is not None else None,
        "created": manifest.created if manifest is not None else None,
        "save_id": manifest.save_id if manifest is not None else None,
        "layout": manifest.layout if manifest is not None else "hf",
        "world_size": manifest.world_size if manifest is not None else None,
        "flat": ckpt.flat,
        "metadata": manifest.metadata if manifest is not None else {},
        "components": components,
        "files": [{"name": f, "size": size} for f, size in files.items()],
        "_tables": manifest.table_files() if manifest is not None else [],
        **_totals(files, components, dtypes, matched, limit),
    }


# ---------------------------------------------------------------------------- text


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('s') else 's'}"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    rows = [[printable(cell) for cell in row] for row in rows]
    return [indent + line for line in table_rows(rows)]


_FORMATS = {
    "shardpoint": "shardpoint",
    "hf-index": "hf-index (Hugging Face shards + index; no shardpoint manifest)",
    "hf-file": "hf-file (one safetensors file; no shardpoint manifest)",
    "hf-bin": "hf-bin (Hugging Face .bin shards + index, read with torch.load(weights_only=True))",
    "torch-save": "torch-save (one torch.save file, read with torch.load(weights_only=True))",
}


def render(doc: dict[str, Any], *, pattern: str | None = None) -> list[str]:
    """The human-readable report of ``describe``'s object, one item per line (``emit``
    escapes them; table cells are escaped first so the columns stay aligned)."""
    out: list[str] = []
    fmt = _FORMATS.get(doc["format"], doc["format"])
    if doc["format_version"] is not None:
        fmt += f" (format version {doc['format_version']}, saved by shardpoint {doc['library_version']})"
    head = [
        ["path", doc["path"]],
        *([["resolved", doc["resolved"]]] if "resolved" in doc else []),
        ["format", fmt],
        ["layout", doc["layout"]],
        ["world size", "-" if doc["world_size"] is None else str(doc["world_size"])],
        ["saved", doc["created"] or "-"],
    ]
    comps = []
    for cname, comp in doc["components"].items():
        if not comp["tensors"]:
            comps.append(f"{cname}: no tensors (plain values only)")
            continue
        tensors = _plural(comp["tensors"], "tensor")
        if comp["aliases"]:
            tensors += f" (+{_plural(comp['aliases'], 'alias')})"
        comps.append(
            f"{cname}: {tensors}, {human_size(comp['bytes'])} in {_plural(len(comp['files']), 'file')}"
        )
    for i, line in enumerate(comps):
        head.append(["components" if i == 0 else "", line])
    if doc["metadata"]:
        head.append(["metadata", json.dumps(doc["metadata"])])
    out += [f"note: {n}" for n in doc.get("notes", [])]
    out += _table(head, indent="")

    out.append("")
    out.append(f"files: {_plural(len(doc['files']), 'file')}, {human_size(doc['total_size'])}")
    if doc["files"]:
        out += _table([[f["name"], human_size(f["size"])] for f in doc["files"]])
    if doc.get("unchecked"):
        out.append(f"other files (not read): {', '.join(doc['unchecked'])}")

    out.append("")
    out.append(
        f"dtypes: {_plural(doc['tensor_count'], 'tensor')}, {human_size(doc['tensor_bytes'])}"
    )
    if doc["dtypes"]:
        out += _table(
            [
                [d, _plural(s["tensors"], "tensor"), human_size(s["bytes"])]
                for d, s in doc["dtypes"].items()
            ]
        )

    out.append("")
    shown, matched = len(doc["tensors"]), doc["tensors_matched"]
    total = doc["tensor_count"] + doc["alias_count"]
    title = f"tensors: {shown} of {matched}"
    if pattern:
        title += f" matching {pattern!r} ({total} in all)"
    out.append(title)
    if doc["tensors"]:
        rows = [["NAME", "DTYPE", "SHAPE", "SIZE", "FILE"]]
        for t in doc["tensors"]:
            name = t["name"] if doc["flat"] else key_name(t["component"], t["name"])
            if t["alias_of"] is not None:
                where = f"= {t['alias_of']} (tied)"
            elif t["chunks"] > 1:
                where = f"{t['chunks']} chunks in {_plural(len(t['files']), 'file')}"
            else:
                where = t["files"][0]
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            rows.append([name or "''", t["dtype"], shape, human_size(t["bytes"]), where])  # '' named so
        out += _table(rows)
    if shown < matched:
        out.append(f"  ... {matched - shown} more (--limit 0 lists all)")
    elif not matched and pattern:
        out.append(f"  no tensor name matches {pattern!r}")
    return out
