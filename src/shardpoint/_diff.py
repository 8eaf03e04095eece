"""diff: compare two checkpoints of any readable format, one batch of tensor pairs at a time.

Keys are the tensor names ``sp.load`` would return (aliases of tied weights included); in
a nested checkpoint they are ``component/name``. Values are compared like
``torch.allclose``: ``|a - b| <= atol + rtol * |b|`` element-wise (B is the reference), NaN
equal to NaN at the same position. Non-tensor values of nested states (epoch, learning
rates, ...) are compared too.

Ties are compared by value: a name that one side records as an alias of a stored tensor
(tied weights stored once) and the other stores separately is compared under its own
name; one that the other side lacks while it holds a name of the same tie (as
``transformers``' ``save_pretrained`` drops ``lm_head.weight`` of a tied GPT-2) is equal
when that name is. Either way the difference in storage is reported as a
:class:`StorageNote`, not as a difference.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ._flags import check_flags
from ._flatten import WRAPPER_TYPES
from ._format.dtypes import DTYPE_TO_NAME
from ._hub import local_path
from ._progress import byte_progress
from ._sources.contract import BATCH_BYTES, Ref, TensorSource, batches
from ._sources.open import open_source
from ._typed_nodes import TYPED_LEAVES, TYPED_VALUE_NODES, typed_leaf_text
from .errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
)

_ELEMENTS_PER_STEP = 1 << 20
"""Elements compared at once (each float64 temporary is 8 MB)."""


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor present in both checkpoints compares."""

    key: str
    status: str
    """``equal`` (identical values), ``close`` (within tolerance), ``changed`` (values outside
    tolerance), ``dtype`` (dtypes differ; values compared after upcasting) or ``shape``
    (shapes differ; values not compared)."""
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    max_abs: float | None = None
    """Largest ``|a - b|`` (nan when a NaN meets a number); None when not compared."""
    max_rel: float | None = None
    """Largest ``|a - b| / |b|`` (inf where b is 0 and a is not)."""
    mismatched: int = 0
    """Elements outside the tolerance."""

    @property
    def differs(self) -> bool:
        return self.status not in ("equal", "close")


@dataclass(frozen=True)
class ValueDiff:
    """A non-tensor value (JSON leaf of a nested state) that differs or is on one side only."""

    key: str
    a: Any
    """The value in A, or ``MISSING``."""
    b: Any


class _Absent:
    """The side a non-tensor value is not on (never equal to any value, a string included)."""

    def __repr__(self) -> str:
        return "<absent>"


MISSING: Any = _Absent()


class _Typed(str):
    """A typed leaf (a Path, a complex, a dtype, bytes) as its text: equal only to the same
    typed value, never to a string that reads the same."""

    def __repr__(self) -> str:
        return str(self)


class _Shape(tuple):
    """What a container is (its kind, whether it is empty, the types of its keys): a dict
    keyed by int where the other side keys by str, a tuple against a list, or an empty
    container on one side only, is a difference though no leaf under it differs. (Its
    entries are compared one by one: their number is not part of it.)"""

    def __repr__(self) -> str:
        kind, empty, keys = self
        return ("empty " if empty else "") + kind + (f" ({'/'.join(keys)} keys)" if keys else "")


@dataclass(frozen=True)
class StorageNote:
    """A tensor name stored differently on the two sides while its values compare."""

    key: str
    a: str
    """How A holds it: ``stored``, ``alias`` (of ``alias_of_a``) or ``absent``."""
    b: str
    alias_of_a: str | None = None
    """The stored name it is an alias of in A (load-style key), when ``a`` is ``alias``."""
    alias_of_b: str | None = None
    compared_as: str | None = None
    """When the name is absent on one side: the key of the same tie whose values were
    compared in its place."""

    @property
    def message(self) -> str:
        def side(how: str, target: str | None, label: str) -> str:
            if how == "alias":
                return f"an alias of {target} in {label} (tied, stored once)"
            if how == "absent":
                return f"absent from {label} (tied weight not saved)"
            return f"stored in {label}"

        text = f"{self.key}: {side(self.a, self.alias_of_a, 'A')}, {side(self.b, self.alias_of_b, 'B')}"
        if self.compared_as is not None:
            return f"{text}; compared as {self.compared_as}"
        return f"{text}; values compared"


@dataclass(frozen=True)
class DiffReport:
    """The result of :func:`diff`."""

    a: str
    b: str
    atol: float
    rtol: float
    only_in_a: list[str] = field(default_factory=list)
    """Tensor keys present in A only."""
    only_in_b: list[str] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    """Every tensor key present in both, in A's order."""
    values: list[ValueDiff] = field(default_factory=list)
    """Non-tensor values that differ."""
    compared_bytes: int = 0
    """Bytes of tensor data read and compared (A's side)."""
    notes: list[StorageNote] = field(default_factory=list)
    """Names whose storage differs (alias on one side, stored or absent on the other)
    while their values are compared; not differences."""
    read_notes: list[str] = field(default_factory=list)
    """What was read of A and B where it is not all the path holds (``A: ...``, ``B: ...``:
    a folder with both safetensors and ``.bin`` files is read from the safetensors)."""

    @property
    def equal(self) -> bool:
        """Same keys, shapes and dtypes, all values within tolerance."""
        return not (self.only_in_a or self.only_in_b or self.values or self.differences)

    @property
    def differences(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.differs]


def _dtype_str(dtype: torch.dtype) -> str:
    return DTYPE_TO_NAME.get(dtype, str(dtype).replace("torch.", ""))


def _view(source: TensorSource, component: str | None, where: str) -> dict[str, str]:
    """Component -> the prefix its keys take, for the components compared: every one
    (``name/``; none in a flat checkpoint), or only ``component``, its keys bare (so one
    component of a training checkpoint compares with a flat model's files)."""
    names = [c.name for c in source.components]
    if source.flat:
        return dict.fromkeys(names, "")
    if component is None:
        return {n: f"{n}/" for n in names}
    if component not in names:
        raise InvalidArgumentError(
            f"diff: {where} has no component {component!r}; it has {', '.join(map(repr, names[:20]))}")
    return {component: ""}


def _key(prefix: str, name: str) -> str:
    """The load-style key of stored tensor ``name`` under a component's ``prefix``: a
    component that is one tensor (its name ``""``) is keyed by the component's name alone,
    as ``sp.load`` returns it (``{"w": tensor, "step": 3}`` -> ``w``, not ``w/``)."""
    return prefix + name if name or not prefix.endswith("/") else prefix[:-1]


def _keys(source: TensorSource, view: dict[str, str]) -> dict[str, Ref]:
    """Load-style key -> (component, stored name), aliases included, in stored order."""
    out: dict[str, Ref] = {}
    for comp in source.components:
        if comp.name not in view:
            continue
        prefix = view[comp.name]
        for name in comp.tensors:
            out[_key(prefix, name)] = (comp.name, comp.aliases.get(name, name))
    return out


def _ties(source: TensorSource, view: dict[str, str]) -> dict[str, list[str]]:
    """Load-style key -> every key of its tie (stored name first), for tied names only."""
    out: dict[str, list[str]] = {}
    for comp in source.components:
        if comp.name not in view:
            continue
        prefix = view[comp.name]
        groups: dict[str, list[str]] = {}
        for alias, stored in comp.aliases.items():
            groups.setdefault(stored, [_key(prefix, stored)]).append(_key(prefix, alias))
        for members in groups.values():
            for key in members:
                out[key] = members
    return out


def _how(key: str, refs: dict[str, Ref], view: dict[str, str]) -> tuple[str, str | None]:
    """("stored" | "alias" | "absent", the stored key it aliases) of ``key`` in a source."""
    ref = refs.get(key)
    if ref is None:
        return "absent", None
    comp, stored = ref
    stored_key = _key(view[comp], stored)
    if stored_key == key:
        return "stored", None
    return "alias", stored_key


def _tie_notes(
    a: TensorSource, b: TensorSource, views: tuple[dict[str, str], dict[str, str]],
    keys_a: dict[str, Ref], keys_b: dict[str, Ref],
) -> tuple[list[StorageNote], set[str]]:
    """Notes on names stored differently, and the one-sided keys a tie covers."""
    view_a, view_b = views
    ties_a, ties_b = _ties(a, view_a), _ties(b, view_b)
    notes: list[StorageNote] = []
    covered: set[str] = set()
    for key in [*keys_a, *(k for k in keys_b if k not in keys_a)]:
        how_a, of_a = _how(key, keys_a, view_a)
        how_b, of_b = _how(key, keys_b, view_b)
        if (how_a, of_a) == (how_b, of_b):
            continue
        compared_as = None
        if how_a == "absent" or how_b == "absent":
            present, other = (keys_b, keys_a) if how_a == "absent" else (keys_a, keys_b)
            tie = (ties_b if how_a == "absent" else ties_a).get(key, [])
            twins = [k for k in tie if k != key and k in present and k in other]
            if not twins:
                continue  # not a tie the other side holds: only in A / only in B
            compared_as = twins[0]
            covered.add(key)
        notes.append(StorageNote(key, how_a, how_b, of_a, of_b, compared_as))
    return notes, covered


def _json_leaves(source: TensorSource, view: dict[str, str]) -> dict[str, Any]:
    """Path -> value of every non-tensor leaf of every component's tree, and path -> its
    :class:`_Shape` of every container (named as tensors are: ``component/key.sub``)."""
    out: dict[str, Any] = {}

    def under(path: str, key: object) -> str:
        return f"{path}{key}" if not path or path.endswith("/") else f"{path}.{key}"

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        at = path.rstrip("/")
        if kind in ("json", "float"):
            value = node.get("value")
            out[at] = float(value) if kind == "float" and value is not None else value
        elif kind == "dict":
            items = node.get("items", [])
            if at:
                out[at] = _Shape((node.get("class") or "dict", not items, tuple(sorted({str(k) for k, _, _ in items}))))
            for _, key, child in items:
                walk(child, under(path, key))
        elif kind in ("list", "tuple"):
            items = node.get("items", [])
            if at:
                out[at] = _Shape((kind, not items, ()))
            for i, child in enumerate(items):
                walk(child, under(path, i))
        elif kind in WRAPPER_TYPES or kind in TYPED_VALUE_NODES:
            walk(node.get("value"), path)
        elif kind in TYPED_LEAVES:
            out[at] = _Typed(typed_leaf_text(node))

    for comp in source.components:
        if comp.name in view:
            walk(comp.tree, view[comp.name])
    return out


def _said_below(a: Any, b: Any) -> bool:
    """A container on one side only that holds something: what it holds is reported."""
    one = a if b is MISSING else b if a is MISSING else None
    return isinstance(one, _Shape) and not one[1]


def _same_value(a: Any, b: Any) -> bool:
    """Same type and value (NaN equals NaN; 1 and 1.0 and True differ)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and bool(a == b)


def compare_values(
    a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float
) -> tuple[float, float, int]:
    """(max |a-b|, max |a-b|/|b|, elements outside tolerance) of two same-shape tensors."""
    if a.dtype == b.dtype and torch.equal(a, b):
        return 0.0, 0.0, 0
    complex_ = a.is_complex() or b.is_complex()
    exact = a.dtype == b.dtype and not (a.is_floating_point() or complex_)
    wide = torch.complex128 if complex_ else torch.float64
    fa, fb = a.reshape(-1), b.reshape(-1)
    max_abs = max_rel = 0.0
    bad = 0
    for start in range(0, fa.numel(), _ELEMENTS_PER_STEP):
        xs, ys = fa[start : start + _ELEMENTS_PER_STEP], fb[start : start + _ELEMENTS_PER_STEP]
        x, y = xs.to(wide), ys.to(wide)
        d = (x - y).abs()
        if d.is_complex():
            d = d.real
        if exact:
            # Integers above 2**53 differ by less than float64 can tell (2**62 + 256 is 2**62
            # there): compared as they are, and their difference taken in int64 (exact, even
            # wrapped, wherever it is under 2**62; larger ones float64 gives closely enough).
            same = xs == ys
            near = (xs.to(torch.int64) - ys.to(torch.int64)).abs().to(wide)
            d = torch.where(d < 2.0**62, near, d)
        else:
            same = (x == y) | (x.isnan() & y.isnan())
        d = torch.where(same, torch.zeros((), dtype=d.dtype), d)
        ref = y.abs().real if y.is_complex() else y.abs()
        # As torch.isclose: an infinity is close only to the same infinity (inf <= atol +
        # rtol * inf held for -inf against +inf, and for a finite value against inf).
        ok = same | (d.isfinite() & (d <= atol + rtol * ref))
        bad += int((~ok).sum())
        if d.isnan().any():
            max_abs = max_rel = math.nan
        elif not math.isnan(max_abs):
            max_abs = max(max_abs, float(d.max()))
            rel = float(torch.where(d == 0, torch.zeros((), dtype=d.dtype), d / ref).max())
            max_rel = math.nan if math.isnan(rel) or math.isnan(max_rel) else max(max_rel, rel)
    return max_abs, max_rel, bad


def _compared(key: str, x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> TensorDiff:
    max_abs, max_rel, bad = compare_values(x, y, atol, rtol)
    if x.dtype != y.dtype:
        status = "dtype"
    elif bad:
        status = "changed"
    else:
        status = "equal" if max_abs == 0 else "close"
    return TensorDiff(key, status, _dtype_str(x.dtype), _dtype_str(y.dtype), tuple(x.shape), tuple(y.shape),
                      max_abs, max_rel, bad)


def _pairs(
    a: TensorSource, b: TensorSource, common: list[tuple[str, Ref, Ref]]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(key, tensor from A, tensor from B) for ``common``, reading a batch at a time."""
    sizes = [max(a.descriptor(ra).nbytes, b.descriptor(rb).nbytes) for _, ra, rb in common]
    for run in batches(sizes, BATCH_BYTES // 2):
        part = [common[i] for i in run]
        with (
            a.batch([ra for _, ra, _ in part], None) as xs,
            b.batch([rb for _, _, rb in part], None) as ys,
        ):
            for (key, _, _), x, y in zip(part, xs, ys, strict=True):
                yield key, x, y


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    trust_pickle: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    component: str | None = None,
    progress: bool | None = None,
) -> DiffReport:
    """Compare two checkpoints tensor by tensor, streaming (about one batch in memory).

    Reads every format ``convert`` reads (shardpoint, Hugging Face safetensors or ``.bin``
    shards, ``torch.save`` files via ``torch.load(weights_only=True, mmap=True)``, DCP with
    ``trust_pickle``). Reports keys only in A / only in B, shape and dtype changes, and per
    tensor the largest absolute and relative difference.

    Args:
        a, b: the checkpoints (B is the reference for ``rtol``).
        atol, rtol: tolerance, element-wise ``|a - b| <= atol + rtol * |b|``.
        trust_pickle: allow a full unpickle of either side (see ``convert``).
        cache_dir: the Hugging Face cache ``hf://org/name[@revision]`` sides are looked up
            in (default: ``huggingface_hub``'s); such a side is never downloaded.
        component: compare only this component of a nested side (a training checkpoint's
            ``model``), its keys without the ``model/`` prefix; a flat side is compared
            whole. So a Trainer checkpoint compares with the model's own files.
        progress: show a progress bar of the bytes compared (default: when stderr is a
            terminal and there is much to compare).

    Returns:
        A :class:`DiffReport`; ``report.equal`` is True when the keys, shapes and dtypes
        match and every value is within tolerance.

    Raises:
        UnsafePickleError, CheckpointNotFoundError, CorruptCheckpointError.

    Example:
        >>> import torch, shardpoint as sp, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> _ = sp.save({"w": torch.zeros(3)}, os.path.join(d, "a"))
        >>> _ = sp.save({"w": torch.tensor([0.0, 0.5, 0.0])}, os.path.join(d, "b"))
        >>> report = sp.diff(os.path.join(d, "a"), os.path.join(d, "b"))
        >>> report.equal, report.tensors[0].max_abs
        (False, 0.5)
    """
    check_flags("diff", trust_pickle=trust_pickle, progress=progress, optional=("progress",))
    for name, value in (("atol", atol), ("rtol", rtol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentTypeError(f"diff: {name} must be a number, not {type(value).__name__}")
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise InvalidArgumentError(f"diff: atol and rtol must be >= 0 (got atol={atol}, rtol={rtol})")
    local_a, local_b = local_path(a, cache_dir), local_path(b, cache_dir)
    src_a = open_source(local_a, trust_pickle=trust_pickle, as_named=True)  # the files named, never a sibling
    try:
        src_b = open_source(local_b, trust_pickle=trust_pickle, as_named=True)
        try:
            views = _view(src_a, component, os.fspath(a)), _view(src_b, component, os.fspath(b))
            report = _diff_sources(src_a, src_b, views, os.fspath(a), os.fspath(b), atol, rtol, progress)
            read = [f"A: {n}" for n in src_a.notes] + [f"B: {n}" for n in src_b.notes]
            return dataclasses.replace(report, read_notes=read) if read else report
        finally:
            src_b.close()
    finally:
        src_a.close()


def _diff_sources(
    a: TensorSource, b: TensorSource, views: tuple[dict[str, str], dict[str, str]], name_a: str, name_b: str,
    atol: float, rtol: float, progress: bool | None = None
) -> DiffReport:
    keys_a, keys_b = _keys(a, views[0]), _keys(b, views[1])
    notes, covered = _tie_notes(a, b, views, keys_a, keys_b)
    only_a = [k for k in keys_a if k not in keys_b and k not in covered]
    only_b = [k for k in keys_b if k not in keys_a and k not in covered]
    results: dict[str, TensorDiff] = {}
    common: list[tuple[str, Ref, Ref]] = []
    for key, ra in keys_a.items():
        rb = keys_b.get(key)
        if rb is None:
            continue
        da, db = a.descriptor(ra), b.descriptor(rb)
        if tuple(da.shape) != tuple(db.shape):
            results[key] = TensorDiff(
                key,
                "shape",
                _dtype_str(da.dtype),
                _dtype_str(db.dtype),
                tuple(da.shape),
                tuple(db.shape),
            )
        else:
            common.append((key, ra, rb))
    compared = 0
    total = sum(a.descriptor(ra).nbytes for _, ra, _ in common)
    with byte_progress(total, f"comparing {name_a} with {name_b}", progress) as advance:
        for key, x, y in _pairs(a, b, common):
            results[key] = _compared(key, x, y, atol, rtol)
            compared += x.nbytes
            if advance is not None:
                advance(x.nbytes)
    leaves_a, leaves_b = _json_leaves(a, views[0]), _json_leaves(b, views[1])

    values = [
        ValueDiff(k, leaves_a.get(k, MISSING), leaves_b.get(k, MISSING))
        for k in [*leaves_a, *(k for k in leaves_b if k not in leaves_a)]
        if (k not in leaves_a or k not in leaves_b or not _same_value(leaves_a[k], leaves_b[k]))
        and not _said_below(leaves_a.get(k, MISSING), leaves_b.get(k, MISSING))
    ]
    ordered = [results[k] for k in keys_a if k in results]
    return DiffReport(name_a, name_b, atol, rtol, only_a, only_b, ordered, values, compared, notes)
