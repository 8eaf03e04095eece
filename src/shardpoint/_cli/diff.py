"""Compare two checkpoints tensor by tensor: keys, shapes, dtypes and values.

A and B may be any format convert reads (shardpoint, Hugging Face safetensors or .bin
shards, a torch.save file read with weights_only=True, DCP with --trust-pickle), in any
combination. Tensors are read one batch of pairs at a time, never whole checkpoints.
Values are equal within tolerance when |a - b| <= atol + rtol * |b| element-wise (B is
the reference); NaN equals NaN at the same position. Keys are the names sp.load returns
(component/name in nested checkpoints; with --component NAME only that component of a
nested side, its keys bare, so a trainer checkpoint's model compares with the model's
own files). Non-tensor values (epoch, ...) are compared too.

Tied weights compare by value: a name stored once and recorded as an alias on one side,
and stored separately or absent (a tie transformers' save_pretrained does not save) on the
other, is not a difference; each such name is listed as a note.

The table lists the tensors that differ (--all: every tensor), then the notes, and ends
with a summary.

Exit status: 0 equal within tolerance, 1 different, 2 error (unreadable or refused input).

The --json object has the keys: a, b, equal, atol, rtol, only_in_a [key], only_in_b [key],
tensors [{key, status, dtype_a, dtype_b, shape_a, shape_b, max_abs, max_rel, mismatched}]
(every tensor in both; status is equal, close, changed, dtype or shape; non-finite numbers
are the strings "nan" / "inf"), values [{key, a, b}] (non-tensor values that differ; a side
holding none has no a or b; a container that differs in kind, emptiness or key types is
described in words),
compared_bytes, notes [{key, a, b, alias_of_a, alias_of_b, compared_as, message}] (names
stored differently: a and b are stored, alias or absent), read_notes [text] (what was read
of A and B where it is not all the path holds).

The files named are compared as they are: model.pt beside model.safetensors is read from
model.pt (load and convert read the safetensors sibling instead).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from .._diff import MISSING, DiffReport, TensorDiff, diff
from .._sizes import human_size
from .main import EXIT_DAMAGED, EXIT_OK, add_cache_dir
from .output import emit, printable, table_rows

HELP = "compare two checkpoints (any format): keys, shapes, dtypes, max abs / rel difference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "a", help="first checkpoint (file or directory, or hf://org/name[@revision] in the "
        "local Hugging Face cache)"
    )
    parser.add_argument("b", help="second checkpoint, the reference for --rtol")
    add_cache_dir(parser)
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    parser.add_argument(
        "--component", metavar="NAME", help="compare only this component of a nested side (e.g. a trainer "
        "checkpoint's model), its keys without the NAME/ prefix; a flat side is compared whole"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys above)")
    parser.add_argument(
        "--all", action="store_true", help="list every tensor, not only those that differ"
    )
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="show a progress bar"
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow a full unpickle of either side (runs code from the file): only for files you trust",
    )


def run(args: argparse.Namespace) -> int:
    report = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, trust_pickle=args.trust_pickle,
                  cache_dir=args.cache_dir, component=args.component, progress=args.progress)
    if args.json:
        print(json.dumps(to_json(report), indent=2, allow_nan=False))
    else:
        emit(render(report, show_all=args.all).split("\n"))
    return EXIT_OK if report.equal else EXIT_DAMAGED


def _number(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, tuple):  # a container's kind (_Shape)
        return repr(value)
    if isinstance(value, str):
        return str(value)  # a typed leaf's text
    return value


def to_json(report: DiffReport) -> dict[str, object]:
    return {
        "a": report.a,
        "b": report.b,
        "equal": report.equal,
        "atol": _number(report.atol),
        "rtol": _number(report.rtol),
        "only_in_a": report.only_in_a,
        "only_in_b": report.only_in_b,
        "tensors": [
            {
                "key": t.key,
                "status": t.status,
                "dtype_a": t.dtype_a,
                "dtype_b": t.dtype_b,
                "shape_a": list(t.shape_a),
                "shape_b": list(t.shape_b),
                "max_abs": _number(t.max_abs),
                "max_rel": _number(t.max_rel),
                "mismatched": t.mismatched,
            }
            for t in report.tensors
        ],
        "values": [{"key": v.key, **{side: _plain(value) for side, value in (("a", v.a), ("b", v.b))
                                      if value is not MISSING}} for v in report.values],
        "compared_bytes": report.compared_bytes,
        "notes": [
            {
                "key": n.key,
                "a": n.a,
                "b": n.b,
                "alias_of_a": n.alias_of_a,
                "alias_of_b": n.alias_of_b,
                "compared_as": n.compared_as,
                "message": n.message,
            }
            for n in report.notes
        ],
        "read_notes": list(report.read_notes),
    }


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.3e}" if math.isfinite(x) else str(x)


def _pair(a: object, b: object) -> str:
    return str(a) if a == b else f"{a} -> {b}"


def _row(t: TensorDiff) -> list[str]:
    return [
        t.key,
        t.status,
        _pair(t.dtype_a, t.dtype_b),
        _pair(list(t.shape_a), list(t.shape_b)),
        _fmt(t.max_abs),
        _fmt(t.max_rel),
    ]


def render(report: DiffReport, *, show_all: bool = False) -> str:
    rows = [_row(t) for t in report.tensors if show_all or t.differs]
    rows += [[k, "only in A", "", "", "", ""] for k in report.only_in_a]
    rows += [[k, "only in B", "", "", "", ""] for k in report.only_in_b]
    rows += [[v.key, "value", "", "", f"{v.a!r} -> {v.b!r}", ""] for v in report.values]
    rows = [[printable(cell) for cell in row] for row in rows]  # names may hold controls
    lines = [f"A: {printable(report.a)}", f"B: {printable(report.b)}"]
    if rows:
        header = ["KEY", "STATUS", "DTYPE", "SHAPE", "MAX ABS", "MAX REL"]
        lines += table_rows([header, *([r[0] or "''", *r[1:]] for r in rows)])
    lines += [f"note: {n.message}" for n in report.notes]
    lines += [f"note: {printable(n)}" for n in report.read_notes]
    tol = f"atol={report.atol:g}, rtol={report.rtol:g}"
    n = len(report.tensors)
    if report.equal:
        close = sum(1 for t in report.tensors if t.status == "close")
        extra = f", {close} within tolerance but not identical" if close else ""
        if report.notes:
            count = len(report.notes)
            extra += f", {count} tied name{'s' if count != 1 else ''} stored differently (notes above)"
        lines.append(
            f"equal: {n} tensor{'s' if n != 1 else ''} ({human_size(report.compared_bytes)}) "
            f"match{extra} ({tol})"
        )
        return "\n".join(lines)
    counts: dict[str, int] = {}
    for t in report.differences:
        counts[t.status] = counts.get(t.status, 0) + 1
    detail = ", ".join(f"{c} {s}" for s, c in counts.items())
    parts = [
        f"{len(report.differences)} of {n} tensors differ" + (f" ({detail})" if detail else "")
    ]
    if report.only_in_a:
        parts.append(f"{len(report.only_in_a)} only in A")
    if report.only_in_b:
        parts.append(f"{len(report.only_in_b)} only in B")
    if report.values:
        parts.append(
            f"{len(report.values)} non-tensor value{'s' if len(report.values) != 1 else ''} differ"
        )
    lines.append(f"DIFFERENT: {', '.join(parts)} ({tol})")
    if not report.tensors and report.only_in_a and report.only_in_b:
        nested = {k.partition("/")[0] for k in [*report.only_in_a, *report.only_in_b] if "/" in k}
        if nested:  # one side's keys are component/name, the other's bare: no name in common
            lines.append(f"(no key in common: to compare one component of a nested side with a flat one, "
                         f"pass --component, e.g. --component {sorted(nested)[0]})")
    return "\n".join(lines)
