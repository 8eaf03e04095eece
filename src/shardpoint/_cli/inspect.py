"""Show what a checkpoint holds, without reading any tensor data.

Works on shardpoint checkpoints (reads the manifest only), Hugging Face sharded directories
(index + headers) and single .safetensors files (header).

The --json object has these keys:

  path             the path given
  format           "shardpoint", "hf-index" or "hf-file"
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

Names are matched by --filter as "component/name" in nested checkpoints, "name" in flat ones.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
from typing import Any

from .._format.dtypes import NAME_TO_DTYPE, itemsize
from .._sizes import human_size
from .._source import Checkpoint, open_checkpoint
from .main import add_storage_options

HELP = "show format, files, dtypes and tensors of a checkpoint"

DEFAULT_LIMIT = 50
"""Rows of the tensor table printed without --limit (--json prints all)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        help="checkpoint directory (shardpoint or Hugging Face) or .safetensors file, or an "
        "fsspec URL of either (s3://bucket/run/step-100)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys above)")
    add_storage_options(parser)
    parser.add_argument(
        "--filter",
        metavar="PATTERN",
        help="list only tensors whose name contains PATTERN, or matches it as a glob if it "
        "has * ? or [ (e.g. 'layers.*.weight')",
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
    ckpt = open_checkpoint(args.path, args.storage_options)
    limit = args.limit if args.limit is not None else (0 if args.json else DEFAULT_LIMIT)
    doc = describe(ckpt, pattern=args.filter, limit=limit)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render(doc, pattern=args.filter))
    return 0


def name_matches(name: str, pattern: str | None) -> bool:
    """Substring match, or a glob (``fnmatchcase``) when ``pattern`` has ``* ? [``."""
    if not pattern:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


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
        for alias, target in comp.aliases.items():
            rows[alias] = {**rows[target], "name": alias, "alias_of": target}
        for tname, row in rows.items():
            if name_matches(tname if ckpt.flat else f"{cname}/{tname}", pattern):
                matched.append(row)
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
        "total_size": sum(files.values()),
        "tensor_count": sum(c["tensors"] for c in components.values()),
        "alias_count": sum(c["aliases"] for c in components.values()),
        "tensor_bytes": sum(c["bytes"] for c in components.values()),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: (-kv[1]["bytes"], kv[0]))),
        "tensors_matched": len(matched),
        "tensors": matched[:limit] if limit else matched,
    }


# ---------------------------------------------------------------------------- text


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('s') else 's'}"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        (indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))).rstrip()
        for row in rows
    ]


_FORMATS = {
    "shardpoint": "shardpoint",
    "hf-index": "hf-index (Hugging Face shards + index; no shardpoint manifest)",
    "hf-file": "hf-file (one safetensors file; no shardpoint manifest)",
}


def render(doc: dict[str, Any], *, pattern: str | None = None) -> str:
    """The human-readable report of ``describe``'s object."""
    out: list[str] = []
    fmt = _FORMATS.get(doc["format"], doc["format"])
    if doc["format_version"] is not None:
        fmt += f" (format version {doc['format_version']}, saved by shardpoint {doc['library_version']})"
    head = [
        ["path", doc["path"]],
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
    out += _table(head, indent="")

    out.append("")
    out.append(f"files: {_plural(len(doc['files']), 'file')}, {human_size(doc['total_size'])}")
    if doc["files"]:
        out += _table([[f["name"], human_size(f["size"])] for f in doc["files"]])

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
            name = t["name"] if doc["flat"] else f"{t['component']}/{t['name']}"
            if t["alias_of"] is not None:
                where = f"= {t['alias_of']} (tied)"
            elif t["chunks"] > 1:
                where = f"{t['chunks']} chunks in {_plural(len(t['files']), 'file')}"
            else:
                where = t["files"][0]
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            rows.append([name, t["dtype"], shape, human_size(t["bytes"]), where])
        out += _table(rows)
    if shown < matched:
        out.append(f"  ... {matched - shown} more (--limit 0 lists all)")
    elif not matched and pattern:
        out.append(f"  no tensor name matches {pattern!r}")
    return "\n".join(out)
