"""Typed JSON nodes: values the default ``torch.save`` keeps that are neither containers nor
JSON, stored without pickle (``path``, ``enum``, ``datetime``, ``namespace``, ``dataclass``,
and what ``torch.load(weights_only=True)`` rebuilds: ``torch`` for a ``torch.dtype``,
``device``, ``layout``, ``memory_format`` or ``Size``, ``bytes``, ``complex``).

An Enum or a dataclass is rebuilt only from a class whose module is already imported
(``sys.modules``): a checkpoint never makes shardpoint import a module, so loading one runs
no code that the process had not already loaded (a dataclass's ``__init__`` /
``__post_init__`` do run).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import enum
import pathlib
import sys
import types
from typing import Any

import torch

from .errors import LoadMismatchError

Tree = dict[str, Any]

PATH_CLASSES: dict[str, type[pathlib.PurePath]] = {
    "Path": pathlib.Path,
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
TIME_CLASSES = ("datetime", "date", "time", "timedelta")
TYPED_VALUE_NODES = ("namespace", "dataclass")
"""Typed nodes with a ``value`` child (a dict node with str keys) that holds their content."""
TORCH_CLASSES: dict[str, type] = {
    "dtype": torch.dtype,
    "device": torch.device,
    "layout": torch.layout,
    "memory_format": torch.memory_format,
}
"""torch's plain value types a ``torch`` node holds by name (``Size`` too, as a list)."""
TYPED_LEAVES = ("path", "enum", "datetime", "torch", "bytes", "complex")
"""Typed nodes made of JSON only (no tensors, no children)."""


def _class_name(cls: type) -> str | None:
    """``module:qualname`` if that name finds ``cls`` again, else None (a local class, ...)."""
    module, qual = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qual, str) or "<" in qual:
        return None
    try:
        found = _resolve_class(f"{module}:{qual}")
    except LookupError:
        return None
    return f"{module}:{qual}" if found is cls else None


def _resolve_class(name: str) -> type:
    """The class named ``module:qualname``, from an already imported module (never imports).

    Raises:
        LookupError: the module is not imported, or has no such class.
    """
    module_name, _, qual = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise LookupError(f"module {module_name!r} is not imported")
    obj: Any = module
    for part in qual.split("."):
        # What the module or class itself defines: getattr would run a module's
        # ``__getattr__`` (torch's and transformers' lazy imports) or a descriptor.
        obj = vars(obj).get(part) if isinstance(obj, (type, types.ModuleType)) else None
        if obj is None:
            raise LookupError(f"module {module_name!r} has no class {qual!r}")
    if not isinstance(obj, type):
        raise LookupError(f"{name!r} is not a class")
    return obj


def enum_node(obj: enum.Enum) -> Tree | str:
    """An ``enum`` node for a member, or why it cannot be one."""
    cls = type(obj)
    name = _class_name(cls)
    if name is None:
        return f"its class {cls.__qualname__} cannot be found again by module and name"
    member = obj.name
    if not isinstance(member, str) or cls.__members__.get(member) is not obj:
        return f"{obj!r} is not a single named member of its class"
    return {"type": "enum", "class": name, "member": member}


def _plain_timezone(tz: Any) -> bool:
    """A ``datetime.timezone`` with no name of its own (what ``isoformat`` keeps exactly)."""
    if tz is None:
        return True
    if type(tz) is not datetime.timezone:
        return False
    offset = tz.utcoffset(None)
    return tz.tzname(None) == datetime.timezone(offset).tzname(None)


def _torch_name(obj: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, ``torch.channels_last`` -> ``"channels_last"``."""
    return str(obj).removeprefix("torch.")


def leaf_node(obj: Any) -> Tree | str:
    """A ``path``, ``datetime``, ``torch``, ``bytes`` or ``complex`` node, or why ``obj``
    cannot be one ('' if not such a type)."""
    kind = type(obj)
    if kind is torch.device:
        return {"type": "torch", "class": "device", "value": str(obj)}
    if kind is torch.Size:
        return {"type": "torch", "class": "Size", "value": [int(n) for n in obj]}
    for name, cls in TORCH_CLASSES.items():
        if kind is cls and getattr(torch, _torch_name(obj), None) is obj:
            return {"type": "torch", "class": name, "value": _torch_name(obj)}
    if kind in (bytes, bytearray):
        return {"type": "bytes", "class": kind.__name__, "value": base64.b64encode(obj).decode("ascii")}
    if kind is complex:
        return {"type": "complex", "value": [obj.real.hex(), obj.imag.hex()]}  # exact, inf and nan too
    if kind in (pathlib.PosixPath, pathlib.WindowsPath):
        return {"type": "path", "class": "Path", "value": str(obj)}
    if kind in (pathlib.PurePosixPath, pathlib.PureWindowsPath):
        return {"type": "path", "class": kind.__name__, "value": str(obj)}
    if kind is datetime.timedelta:
        return {"type": "datetime", "class": "timedelta", "value": [obj.days, obj.seconds, obj.microseconds]}
    if kind is datetime.date:
        return {"type": "datetime", "class": "date", "value": obj.isoformat()}
    if kind in (datetime.datetime, datetime.time):
        if not _plain_timezone(obj.tzinfo):
            return (f"its tzinfo {obj.tzinfo!r} is not a fixed datetime.timezone; convert it, e.g. "
                    "with .astimezone(datetime.timezone.utc)")
        return {"type": "datetime", "class": kind.__name__, "value": obj.isoformat(), "fold": obj.fold}
    if isinstance(obj, (pathlib.PurePath, datetime.date, datetime.time, datetime.timedelta)):
        return f"it subclasses {kind.__mro__[1].__qualname__}; only the standard classes are stored"
    return ""


def dataclass_fields(obj: Any) -> tuple[str, dict[str, Any]] | str:
    """(class name, {field: value}) of a dataclass instance, or why it cannot be stored."""
    cls = type(obj)
    name = _class_name(cls)
    if name is None:
        return f"its class {cls.__qualname__} cannot be found again by module and name"
    declared = getattr(cls, "__dataclass_fields__", {})
    initvar = getattr(dataclasses, "_FIELD_INITVAR", None)
    if any(getattr(f, "_field_type", None) is initvar for f in declared.values()):
        return "it has InitVar pseudo-fields, which its constructor needs but the instance does not keep"
    return name, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def build_typed(kind: str, node: Tree, value: Any, where: str) -> Any:
    """The value of a typed node (``value``: the built child of a namespace/dataclass)."""
    if kind == "torch":
        raw = node["value"]
        if node["class"] == "device":
            return torch.device(raw)
        if node["class"] == "Size":
            return torch.Size(raw)
        return getattr(torch, raw)
    if kind == "bytes":
        data = base64.b64decode(node["value"], validate=True)
        return bytearray(data) if node["class"] == "bytearray" else data
    if kind == "complex":
        return complex(float.fromhex(node["value"][0]), float.fromhex(node["value"][1]))
    if kind == "path":
        return PATH_CLASSES[node["class"]](node["value"])
    if kind == "datetime":
        cls_name, raw = node["class"], node["value"]
        if cls_name == "timedelta":
            return datetime.timedelta(days=raw[0], seconds=raw[1], microseconds=raw[2])
        made = getattr(datetime, cls_name).fromisoformat(raw)
        return made.replace(fold=node.get("fold", 0)) if cls_name != "date" else made
    if kind == "namespace":
        return argparse.Namespace(**value)
    cls = _class_for(node, where)
    if kind == "enum":
        if not issubclass(cls, enum.Enum) or node["member"] not in cls.__members__:
            raise LoadMismatchError(
                f"{where}: {node['class']} has no enum member {node['member']!r} (the class changed "
                "since the save?); restore that class or load with a version that has it"
            )
        return cls.__members__[node["member"]]
    if not dataclasses.is_dataclass(cls):
        raise LoadMismatchError(f"{where}: {node['class']} was a dataclass at save time and is not now")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if set(fields) != set(value):
        raise LoadMismatchError(
            f"{where}: dataclass {node['class']} has fields {sorted(fields)} but the checkpoint "
            f"stores {sorted(value)} (the class changed since the save?)"
        )
    try:
        made = cls(**{k: v for k, v in value.items() if fields[k].init})
        for key, field in fields.items():
            if not field.init:
                object.__setattr__(made, key, value[key])
    except Exception as exc:
        raise LoadMismatchError(
            f"{where}: rebuilding dataclass {node['class']} from its stored fields failed: {exc!r}"
        ) from exc
    return made


def typed_leaf_text(node: Tree) -> str:
    """A ``path``, ``enum`` or ``datetime`` node as text (for diff), without importing anything.

    >>> typed_leaf_text({"type": "enum", "class": "app.cfg:Color", "member": "RED"})
    'app.cfg:Color.RED'
    """
    kind = node.get("type")
    if kind == "enum":
        return f"{node.get('class')}.{node.get('member')}"
    if kind == "complex":
        value = node.get("value")
        try:
            return repr(complex(float.fromhex(value[0]), float.fromhex(value[1])))  # type: ignore[index]
        except (TypeError, ValueError, IndexError):
            return f"complex({value})"
    value = node.get("value")
    if isinstance(value, list):
        value = ", ".join(map(str, value))
    return f"{node.get('class')}({value})"


def _class_for(node: Tree, where: str) -> type:
    try:
        return _resolve_class(node["class"])
    except LookupError as exc:
        module = node["class"].partition(":")[0]
        raise LoadMismatchError(
            f"{where}: cannot rebuild a {node['type']} of class {node['class']}: {exc}. shardpoint "
            f"never imports a module named by a checkpoint: `import {module}` before loading"
        ) from None


def is_class_name(name: Any) -> bool:
    if not isinstance(name, str) or len(name) > 1000:
        return False
    module, sep, qual = name.partition(":")
    return bool(sep and module and qual)


def typed_leaf_problem(kind: str, node: Tree) -> str:
    """What is wrong with a typed leaf node ('' if nothing)."""
    value = node.get("value")
    if kind == "torch":
        cls = node.get("class")
        if cls == "Size":
            ok = isinstance(value, list) and len(value) <= 64 and all(type(v) is int and 0 <= v < 2**63 for v in value)
            return "" if ok else "torch Size node's 'value' is not a list of sizes"
        if cls == "device":
            try:
                if not isinstance(value, str):
                    raise TypeError
                torch.device(value)
            except (TypeError, RuntimeError, ValueError):
                return f"torch device node's value {str(value)[:40]!r} is not a device"
            return ""
        if cls not in TORCH_CLASSES or not isinstance(value, str) or not value.isidentifier():
            return f"torch node's class {str(cls)[:40]!r} is not one of Size, {', '.join(TORCH_CLASSES)}"
        if not isinstance(vars(torch).get(value), TORCH_CLASSES[cls]):
            return (f"torch has no {cls} named {value[:40]!r} (a newer torch than this one, {torch.__version__}, "
                    "may have it)")
        return ""
    if kind == "bytes":
        if node.get("class") not in ("bytes", "bytearray") or not isinstance(value, str):
            return "bytes node needs a 'class' (bytes, bytearray) and a base64 str 'value'"
        try:
            base64.b64decode(value, validate=True)
        except ValueError:
            return "bytes node's 'value' is not base64"
        return ""
    if kind == "complex":
        try:
            if not (isinstance(value, list) and len(value) == 2):
                raise ValueError
            float.fromhex(value[0]), float.fromhex(value[1])
        except (TypeError, ValueError):
            return "complex node's 'value' is not [real, imaginary] as float.hex strings"
        return ""
    if kind == "path":
        cls = node.get("class")
        if not isinstance(cls, str) or cls not in PATH_CLASSES or not isinstance(value, str):
            return "path node needs a 'class' (Path, PurePosixPath, PureWindowsPath) and a str 'value'"
        return ""
    if kind == "enum":
        if not is_class_name(node.get("class")) or not isinstance(node.get("member"), str):
            return "enum node needs a 'class' ('module:qualname') and a str 'member'"
        return ""
    cls_name = node.get("class")
    if not isinstance(cls_name, str) or cls_name not in TIME_CLASSES:
        return f"datetime node's class {str(cls_name)[:40]!r} is not one of {', '.join(TIME_CLASSES)}"
    if node.get("fold", 0) not in (0, 1) or isinstance(node.get("fold", 0), bool):
        return "datetime node's 'fold' is not 0 or 1"
    try:
        if cls_name == "timedelta":
            if not (isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value)):
                return "timedelta node's 'value' is not [days, seconds, microseconds]"
            datetime.timedelta(days=value[0], seconds=value[1], microseconds=value[2])
        elif not isinstance(value, str) or len(value) > 100:
            return f"{cls_name} node's 'value' is not an ISO 8601 string"
        else:
            getattr(datetime, cls_name).fromisoformat(value)
    except (ValueError, OverflowError, TypeError):
        return f"{cls_name} node's value {str(value)[:80]!r} is not a valid {cls_name}"
    return ""
