"""Nested state <-> flat tensors plus a JSON tree, exactly reversible.

The tree records container types (dict / list / tuple), key types (``0`` vs ``"0"``) and
order, and JSON leaves (floats incl. nan / +-inf). Tensor leaves are replaced by
``{"type": "tensor", "name": ...}`` where ``name`` is the tensor's key in the files: the
path joined by ``.``, so a flat ``state_dict`` keeps its own keys (what ``transformers``
expects). When two paths would join to the same name, the later one gets a ``#n`` suffix;
the tree, not the name, is the source of truth, so this is still reversible.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import math
import pathlib
import pickle
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidStateError,
    LoadMismatchError,
    UnsafePickleError,
)

Tree = dict[str, Any]

WRAPPER_TYPES = ("module", "optimizer", "stateful")
"""Tree nodes that wrap the plain state of an object; ``value`` holds that state's tree."""


@dataclass(frozen=True)
class Tagged:
    """What ``to_state`` returns for an object: its plain state and how to restore it."""

    kind: str
    """One of ``WRAPPER_TYPES``."""
    value: Any
    attrs: dict[str, Any]
    """JSON attributes recorded on the node (e.g. ``{"by_name": True}``)."""

_MAX_DEPTH = 200


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def flatten_state(
    value: Any,
    *,
    path: str,
    to_state: Callable[[Any, str], Any] | None = None,
    allow_pickle: bool = False,
) -> tuple[Tree, dict[str, torch.Tensor]]:
    """Flatten ``value`` into (tree, {name: tensor}).

    ``path`` names the value in errors (the component). ``to_state`` converts objects that
    are not containers or leaves (modules, optimizers, ``Stateful``) into plain state; it
    returns ``NotImplemented`` when it does not know the object, else the plain state or a
    :class:`Tagged`. With ``allow_pickle`` any other object is pickled into a uint8 tensor
    (recorded as such; loading it needs the same opt-in).

    >>> tree, tensors = flatten_state({"w": torch.zeros(2), "n": 3}, path="model")
    >>> list(tensors), tree["items"][1]
    (['w'], ['str', 'n', {'type': 'json', 'value': 3}])
    """
    tensors: dict[str, torch.Tensor] = {}

    def name_for(parts: list[str]) -> str:
        base = ".".join(parts)
        if base not in tensors:
            return base
        name, n = base, 1
        while name in tensors:
            n += 1
            name = f"{base}#{n}"
        return name

    def where_of(parts: list[str]) -> str:
        # Built only when needed (errors, objects to convert): a state of 10^5 tensors
        # would otherwise spend more on naming paths than on everything else here.
        return f"{path}" + "".join(f"[{p!r}]" for p in parts)

    def walk(obj: Any, parts: list[str], depth: int) -> Tree:
        if depth > _MAX_DEPTH:
            raise InvalidStateError(f"state at {where_of(parts)} nests deeper than {_MAX_DEPTH} levels")
        if _is_tensor(obj):
            name = name_for(parts)
            tensors[name] = obj
            return {"type": "tensor", "name": name}
        if isinstance(obj, enum.Enum):  # before str/int: a StrEnum/IntEnum keeps its type
            member = _enum_node(obj)
            if isinstance(member, str):
                return fallback(obj, parts, member)
            return member
        if obj is None or isinstance(obj, (bool, str)):
            return {"type": "json", "value": obj}
        if isinstance(obj, int):
            return {"type": "json", "value": int(obj)}
        if isinstance(obj, float):
            if math.isfinite(obj):
                return {"type": "float", "value": float(obj)}
            return {"type": "float", "value": repr(obj)}  # 'nan', 'inf', '-inf'
        if isinstance(obj, Mapping):
            items = []
            for key, child in obj.items():
                stored: str | int
                if type(key) is str:
                    kind, stored, part = "str", key, key
                elif isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise InvalidStateError(
                        f"state at {where_of(parts)} has key {key!r} of type {type(key).__name__}; "
                        "only str and int keys can be stored"
                    )
                else:
                    kind = "int" if isinstance(key, int) else "str"
                    stored, part = (int(key) if kind == "int" else key), str(key)
                if _is_tensor(child):  # the common leaf, without a call of its own
                    name = name_for([*parts, part])
                    tensors[name] = child
                    items.append([kind, stored, {"type": "tensor", "name": name}])
                    continue
                items.append([kind, stored, walk(child, [*parts, part], depth + 1)])
            return {"type": "dict", "items": items}
        if isinstance(obj, (list, tuple)):
            kind = "tuple" if isinstance(obj, tuple) else "list"
            return {
                "type": kind,
                "items": [walk(child, [*parts, str(i)], depth + 1) for i, child in enumerate(obj)],
            }
        where = where_of(parts)
        if to_state is not None:
            converted = to_state(obj, where)
            if isinstance(converted, Tagged):
                return {"type": converted.kind, **converted.attrs, "value": walk(converted.value, parts, depth + 1)}
            if converted is not NotImplemented:
                return walk(converted, parts, depth + 1)
        if type(obj) is argparse.Namespace:
            return {"type": "namespace", "value": walk(dict(vars(obj)), parts, depth + 1)}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            described = _dataclass_fields(obj)
            if isinstance(described, str):
                return fallback(obj, parts, described)
            cls_name, fields = described
            return {"type": "dataclass", "class": cls_name, "value": walk(fields, parts, depth + 1)}
        leaf = _leaf_node(obj)
        if not isinstance(leaf, str):
            return leaf
        return fallback(obj, parts, leaf)

    def fallback(obj: Any, parts: list[str], reason: str) -> Tree:
        """Pickle ``obj`` (with ``allow_pickle``) or refuse it, naming its path and why."""
        where = where_of(parts)
        if allow_pickle:
            name = name_for(parts)
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            tensors[name] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            return {"type": "pickle", "name": name, "class": f"{type(obj).__module__}.{type(obj).__qualname__}"}
        raise InvalidStateError(
            f"state at {where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
            f"shardpoint cannot store{f' without pickle ({reason})' if reason else ''}: use tensors, "
            "nn.Modules, optimizers, objects with state_dict()/load_state_dict(), dict/list/tuple, "
            "int/float/bool/str/None, pathlib paths, Enum members, argparse.Namespace, dataclasses "
            "or datetime values (or pass allow_pickle=True to pickle such values, trusting whoever "
            "loads them)"
        )

    tree = walk(value, [], 0)
    return tree, tensors


# ------------------------------------------------------------------ typed JSON nodes
#
# Values the default ``torch.save`` keeps that are not containers or JSON, stored without
# pickle: ``path``, ``enum``, ``datetime``, ``namespace``, ``dataclass``. An Enum or a
# dataclass is rebuilt only from a class whose module is already imported (``sys.modules``):
# a checkpoint never makes shardpoint import a module, so loading one runs no code that the
# process had not already loaded (a dataclass's ``__init__``/``__post_init__`` do run).

_PATH_CLASSES: dict[str, type[pathlib.PurePath]] = {
    "Path": pathlib.Path,
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
_TIME_CLASSES = ("datetime", "date", "time", "timedelta")
TYPED_VALUE_NODES = ("namespace", "dataclass")
"""Typed nodes with a ``value`` child (a dict node with str keys) that holds their content."""
_TYPED_LEAVES = ("path", "enum", "datetime")
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
        obj = getattr(obj, part, None)
        if obj is None:
            raise LookupError(f"module {module_name!r} has no class {qual!r}")
    if not isinstance(obj, type):
        raise LookupError(f"{name!r} is not a class")
    return obj


def _enum_node(obj: enum.Enum) -> Tree | str:
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


def _leaf_node(obj: Any) -> Tree | str:
    """A ``path`` or ``datetime`` node, or why ``obj`` cannot be one ('' if not such a type)."""
    kind = type(obj)
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


def _dataclass_fields(obj: Any) -> tuple[str, dict[str, Any]] | str:
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


def _build_typed(kind: str, node: Tree, value: Any, where: str) -> Any:
    """The value of a typed node (``value``: the built child of a namespace/dataclass)."""
    if kind == "path":
        return _PATH_CLASSES[node["class"]](node["value"])
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


_NODE_TYPES = ("tensor", "pickle", "json", "float", "dict", "list", "tuple", *WRAPPER_TYPES,
               *_TYPED_LEAVES, *TYPED_VALUE_NODES)
_FLOAT_WORDS = ("nan", "inf", "-inf")


def validate_tree(tree: Any, names: Any, *, where: str) -> None:
    """Check a state tree read from a manifest, so that every reader can walk it blindly.

    ``names`` holds the tensor names the tree may refer to (stored tensors and aliases).
    Every node must be an object of a known type with well-formed fields: a ``tensor`` or
    ``pickle`` leaf names a known tensor; a ``float`` is a finite JSON number or one of
    ``'nan'``, ``'inf'``, ``'-inf'`` (a number too large for a float is refused); a ``json``
    leaf is null, a bool, an int or a str; a ``dict`` holds ``[kind, key, child]`` items with
    ``kind`` ``'str'`` or ``'int'`` matching the key and no key twice; a ``list`` or
    ``tuple`` holds child nodes; a wrapper (``module``, ``optimizer``, ``stateful``) holds a
    ``value`` node, and an optimizer saved by parameter name holds ``state`` (a dict) and
    ``param_groups`` (a list of dicts, each with ``params``). Nesting deeper than
    ``_MAX_DEPTH`` is refused. Walks iteratively (no RecursionError on forged depth).

    Raises:
        CorruptCheckpointError: naming the node's path and what is wrong.
    """
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, at, depth = stack.pop()
        shown = at if len(at) <= 80 else "..." + at[-77:]
        here = f"{where}: malformed state tree node at {shown or '<root>'}"

        def bad(what: str, here: str = here) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{here}: {what}; the manifest is damaged or forged")

        if depth > _MAX_DEPTH:
            raise bad(f"the tree nests deeper than {_MAX_DEPTH} levels")
        if not isinstance(node, dict):
            raise bad(f"node {str(node)[:80]!r} is not an object")
        kind = node.get("type")
        if kind not in _NODE_TYPES:
            raise bad(f"unknown node type {str(kind)[:80]!r}")
        if kind in ("tensor", "pickle"):
            name = node.get("name")
            if not isinstance(name, str) or name not in names:
                raise bad(f"{kind} leaf names {str(name)[:80]!r}, which is not a tensor of this component")
        elif kind == "json":
            value = node.get("value")
            if value is not None and not isinstance(value, (bool, int, str)):
                raise bad(f"json leaf {str(value)[:80]!r} is not null, a bool, an int or a string")
        elif kind == "float":
            value = node.get("value")
            if isinstance(value, str):
                if value not in _FLOAT_WORDS:
                    raise bad(f"float leaf {value[:80]!r} is not a number, 'nan', 'inf' or '-inf'")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(f"float leaf {str(value)[:80]!r} is not a number")
            else:
                try:
                    ok = math.isfinite(float(value))
                except OverflowError:
                    ok = False
                if not ok:
                    raise bad(f"float leaf {str(value)[:80]} is out of a float's range")
        elif kind == "dict":
            items = node.get("items")
            if not isinstance(items, list):
                raise bad("dict node has no 'items' list")
            seen: set[Any] = set()
            for item in items:
                if not (isinstance(item, list) and len(item) == 3):
                    raise bad(f"dict item {str(item)[:80]!r} is not [kind, key, node]")
                key_kind, key, child = item
                if not ((key_kind == "str" and isinstance(key, str))
                        or (key_kind == "int" and type(key) is int)):
                    raise bad(f"dict key {str(key)[:80]!r} does not match its kind {str(key_kind)[:20]!r}")
                if key in seen:
                    raise bad(f"dict key {str(key)[:80]!r} appears twice")
                seen.add(key)
                stack.append((child, f"{at}.{key}" if at else str(key), depth + 1))
        elif kind in ("list", "tuple"):
            items = node.get("items")
            if not isinstance(items, list):
                raise bad(f"{kind} node has no 'items' list")
            stack.extend((child, f"{at}.{i}" if at else str(i), depth + 1) for i, child in enumerate(items))
        elif kind in _TYPED_LEAVES:
            problem = _typed_leaf_problem(kind, node)
            if problem:
                raise bad(problem)
        elif kind in TYPED_VALUE_NODES:
            value = node.get("value")
            if kind == "dataclass" and not _is_class_name(node.get("class")):
                raise bad(f"dataclass node's class {str(node.get('class'))[:80]!r} is not 'module:qualname'")
            if not (isinstance(value, dict) and value.get("type") == "dict" and isinstance(value.get("items"), list)
                    and all(isinstance(i, list) and len(i) == 3 and i[0] == "str" for i in value["items"])):
                raise bad(f"{kind} node's 'value' is not a dict with str keys")
            stack.append((value, at, depth + 1))
        else:  # a wrapper
            if "value" not in node:
                raise bad(f"{kind} node has no 'value'")
            if kind == "optimizer":
                by_name = node.get("by_name", False)
                if not isinstance(by_name, bool):
                    raise bad("optimizer node's 'by_name' is not a bool")
                if by_name:
                    _check_optimizer_value(node["value"], bad)
            stack.append((node["value"], at, depth + 1))


def _is_class_name(name: Any) -> bool:
    if not isinstance(name, str) or len(name) > 1000:
        return False
    module, sep, qual = name.partition(":")
    return bool(sep and module and qual)


def _typed_leaf_problem(kind: str, node: Tree) -> str:
    """What is wrong with a ``path``, ``enum`` or ``datetime`` node ('' if nothing)."""
    value = node.get("value")
    if kind == "path":
        if node.get("class") not in _PATH_CLASSES or not isinstance(value, str):
            return "path node needs a 'class' (Path, PurePosixPath, PureWindowsPath) and a str 'value'"
        return ""
    if kind == "enum":
        if not _is_class_name(node.get("class")) or not isinstance(node.get("member"), str):
            return "enum node needs a 'class' ('module:qualname') and a str 'member'"
        return ""
    cls_name = node.get("class")
    if cls_name not in _TIME_CLASSES:
        return f"datetime node's class {str(cls_name)[:40]!r} is not one of {', '.join(_TIME_CLASSES)}"
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


def _check_optimizer_value(value: Any, bad: Callable[[str], CorruptCheckpointError]) -> None:
    """An optimizer saved by name: {"state": dict, "param_groups": [dict with "params", ...]}."""
    if not isinstance(value, dict) or value.get("type") != "dict" or not isinstance(value.get("items"), list):
        raise bad("optimizer state is not a dict")
    fields = {
        item[1]: item[2] for item in value["items"]
        if isinstance(item, list) and len(item) == 3 and isinstance(item[1], str)
    }
    state, groups = fields.get("state"), fields.get("param_groups")
    if not isinstance(state, dict) or state.get("type") != "dict":
        raise bad("optimizer state has no 'state' dict")
    if not isinstance(groups, dict) or groups.get("type") != "list" or not isinstance(groups.get("items"), list):
        raise bad("optimizer state has no 'param_groups' list")
    for group in groups["items"]:
        if not isinstance(group, dict) or group.get("type") != "dict" or not isinstance(group.get("items"), list):
            raise bad("an optimizer parameter group is not a dict")
        keys = [item[1] for item in group["items"]
                if isinstance(item, list) and len(item) == 3 and isinstance(item[1], str)]
        if "params" not in keys:
            raise bad("an optimizer parameter group has no 'params'")


def unflatten_state(tree: Tree, tensors: Mapping[str, Any], *, where: str, allow_pickle: bool = False) -> Any:
    """Rebuild the nested value from its tree and loaded tensors (``tensors[name]``).

    Wrapper nodes (modules, optimizers, ``Stateful``) come back as their plain state.
    Pickled leaves are refused unless ``allow_pickle``.
    """

    def build(node: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH or not isinstance(node, dict):
            raise CorruptCheckpointError(f"{where}: malformed state tree node {str(node)[:80]!r}")
        kind = node.get("type")
        if kind == "tensor":
            return tensors[node["name"]]
        if kind == "json":
            return node.get("value")
        if kind == "float":
            return float(node["value"])
        if kind == "dict":
            return {key: build(child, depth + 1) for _, key, child in node["items"]}
        if kind == "list":
            return [build(child, depth + 1) for child in node["items"]]
        if kind == "tuple":
            return tuple(build(child, depth + 1) for child in node["items"])
        if kind in WRAPPER_TYPES:
            return build(node["value"], depth + 1)
        if kind in _TYPED_LEAVES:
            return _build_typed(kind, node, None, where)
        if kind in TYPED_VALUE_NODES:
            return _build_typed(kind, node, build(node["value"], depth + 1), where)
        if kind == "pickle":
            if not allow_pickle:
                raise UnsafePickleError(
                    f"{where}: value {node['name']!r} (a {node.get('class')}) was pickled at save time; "
                    "unpickling runs arbitrary code, so it is refused. Pass allow_pickle=True "
                    "only if you trust whoever wrote this checkpoint"
                )
            data = tensors[node["name"]]
            return pickle.loads(data.numpy().tobytes())
        raise CorruptCheckpointError(f"{where}: unknown state tree node type {kind!r}")

    try:
        return build(tree, 0)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: malformed state tree ({exc!r})") from None


def tree_tensor_names(tree: Tree) -> list[str]:
    """Names of the tensor leaves of a tree, in order."""
    names: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = node.get("type")
        if kind in ("tensor", "pickle"):
            names.append(node["name"])
        elif kind == "dict":
            stack.extend(child for _, _, child in reversed(node["items"]))
        elif kind in ("list", "tuple"):
            stack.extend(reversed(node["items"]))
        elif kind in WRAPPER_TYPES or kind in TYPED_VALUE_NODES:
            stack.append(node["value"])
    return names
