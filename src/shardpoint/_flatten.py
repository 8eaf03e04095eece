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
import collections
import dataclasses
import enum
import math
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._typed_nodes import (
    TYPED_LEAVES,
    TYPED_VALUE_NODES,
    build_typed,
    dataclass_fields,
    enum_node,
    leaf_node,
)
from .errors import CheckpointError, CorruptCheckpointError, InvalidStateError, UnsafePickleError

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

MAX_DEPTH = 200
_MAX_INT_BITS = 14_000
MAX_REPEATED_NODES = 1 << 17
"""Values walked (each time met; a long text counts by size) past which a state that walks
64 times more than its distinct containers hold references is refused as unfolding."""


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


DEFAULT_FACTORIES: dict[str, type] = {t.__name__: t for t in (int, float, bool, str, list, dict, set, tuple)}
"""The ``default_factory`` a ``defaultdict`` is stored with (builtins only: nothing is imported)."""


def counting_kind(obj: Mapping[Any, Any]) -> dict[str, str]:
    """A dict node's ``class`` (and ``default``) for the mappings that behave otherwise than
    a dict (as torch.load gives them back): a ``Counter`` (``MultiStepLR.milestones``: its
    ``elements()`` is called at every milestone) and a ``defaultdict`` of a builtin factory."""
    if type(obj) is collections.Counter:
        return {"class": "Counter"}
    if type(obj) is collections.defaultdict and obj.default_factory in DEFAULT_FACTORIES.values():
        return {"class": "defaultdict", "default": obj.default_factory.__name__}  # type: ignore[union-attr]
    return {}


def counting_mapping(node: Tree, built: dict[Any, Any]) -> dict[Any, Any]:
    """The mapping a dict node with a ``class`` stands for (see :func:`counting_kind`).

    >>> counting_mapping({"class": "Counter"}, {3: 1, 5: 2})
    Counter({5: 2, 3: 1})
    """
    if node["class"] == "Counter":
        return collections.Counter(built)
    made: collections.defaultdict[Any, Any] = collections.defaultdict(DEFAULT_FACTORIES[node["default"]])
    made.update(built)
    return made


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

    # Every container met, held so that its id is not reused by a later temporary one (a
    # dataclass's fields, a Stateful's state_dict()); the references they hold in all.
    containers: dict[int, Any] = {}
    references = 0
    walked = 0  # values walked, each time met (a long text weighs by its size)

    def repeated(obj: Any) -> None:
        """Refuse a state that walks far more containers than its distinct ones hold
        references: a pickle of a few kilobytes (``x = [x, x]`` forty times) unfolds into
        2^40 nodes ("billion laughs"); a list of one tuple 140 000 times walks 140 001."""
        nonlocal walked, references
        if id(obj) not in containers:
            containers[id(obj)] = obj
            references += len(obj)
        growing()

    def growing() -> None:
        if walked > MAX_REPEATED_NODES and walked > 64 * (references + len(containers)):
            raise InvalidStateError(
                f"state at {path} refers to the same {len(containers)} dicts, lists and tuples over and over: "
                f"walked as a tree it has more than {walked} values and keeps growing (a pickle built to unfold "
                "exponentially?); store each value once"
            )

    texts: set[int] = set()  # ids of the long strings met (held by their containers)

    def walk(obj: Any, parts: list[str], depth: int) -> Tree:
        nonlocal walked, references
        if depth > MAX_DEPTH:
            raise InvalidStateError(f"state at {where_of(parts)} nests deeper than {MAX_DEPTH} levels")
        walked += 1  # every node: leaves under shared containers unfold too ([[0] * F] * F)
        if isinstance(obj, (str, bytes)) and len(obj) > 4096:  # a long text met again is written again
            weight = len(obj) // 4096
            walked += weight
            if id(obj) not in texts:
                texts.add(id(obj))
                references += weight
            growing()
        if _is_tensor(obj):
            name = name_for(parts)
            tensors[name] = obj
            return {"type": "tensor", "name": name}
        if isinstance(obj, enum.Enum):  # before str/int: a StrEnum/IntEnum keeps its type
            member = enum_node(obj)
            if isinstance(member, str):
                return fallback(obj, parts, member)
            return member
        if obj is None or isinstance(obj, (bool, str)):
            return {"type": "json", "value": obj}
        if isinstance(obj, int):
            if obj.bit_length() > _MAX_INT_BITS:  # JSON (and Python's int to str) stops at 4300 digits
                raise InvalidStateError(
                    f"state at {where_of(parts)} is an int of {obj.bit_length()} bits, more than the manifest's "
                    f"JSON holds ({_MAX_INT_BITS} bits, about 4300 digits): store it as bytes "
                    "(n.to_bytes(...)) or a string"
                )
            return {"type": "json", "value": int(obj)}
        if isinstance(obj, float):
            if math.isfinite(obj):
                return {"type": "float", "value": float(obj)}
            return {"type": "float", "value": repr(obj)}  # 'nan', 'inf', '-inf'
        if isinstance(obj, Mapping):
            repeated(obj)
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
            return {"type": "dict", **counting_kind(obj), "items": items}
        if type(obj) is torch.Size:  # a tuple, kept a Size (as torch.load gives it back)
            return leaf_node(obj)  # type: ignore[return-value]
        if isinstance(obj, (list, tuple)):
            repeated(obj)
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
            described = dataclass_fields(obj)
            if isinstance(described, str):
                return fallback(obj, parts, described)
            cls_name, fields = described
            return {"type": "dataclass", "class": cls_name, "value": walk(fields, parts, depth + 1)}
        leaf = leaf_node(obj)
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
            "int/float/bool/str/None, bytes, complex, torch dtypes and devices, pathlib paths, Enum "
            "members, argparse.Namespace, dataclasses or datetime values (or pass allow_pickle=True to pickle such values, trusting whoever "
            "loads them)"
        )

    tree = walk(value, [], 0)
    return tree, tensors


def unflatten_state(tree: Tree, tensors: Mapping[str, Any], *, where: str, allow_pickle: bool = False) -> Any:
    """Rebuild the nested value from its tree and loaded tensors (``tensors[name]``).

    Wrapper nodes (modules, optimizers, ``Stateful``) come back as their plain state.
    Pickled leaves are refused unless ``allow_pickle``.
    """

    def build(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(node, dict):
            raise CorruptCheckpointError(f"{where}: malformed state tree node {str(node)[:80]!r}")
        kind = node.get("type")
        if kind == "tensor":
            return tensors[node["name"]]
        if kind == "json":
            return node.get("value")
        if kind == "float":
            return float(node["value"])
        if kind == "dict":
            built = {key: build(child, depth + 1) for _, key, child in node["items"]}
            return built if "class" not in node else counting_mapping(node, built)
        if kind == "list":
            return [build(child, depth + 1) for child in node["items"]]
        if kind == "tuple":
            return tuple(build(child, depth + 1) for child in node["items"])
        if kind in WRAPPER_TYPES:
            return build(node["value"], depth + 1)
        if kind in TYPED_LEAVES:
            return build_typed(kind, node, None, where)
        if kind in TYPED_VALUE_NODES:
            return build_typed(kind, node, build(node["value"], depth + 1), where)
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
