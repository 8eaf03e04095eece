"""The check of a state tree read from a manifest, so that every reader can walk it blindly."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ._flatten import DEFAULT_FACTORIES, MAX_DEPTH, WRAPPER_TYPES
from ._typed_nodes import TYPED_LEAVES, TYPED_VALUE_NODES, is_class_name, typed_leaf_problem
from .errors import CorruptCheckpointError

_NODE_TYPES = ("tensor", "pickle", "json", "float", "dict", "list", "tuple", *WRAPPER_TYPES,
               *TYPED_LEAVES, *TYPED_VALUE_NODES)
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
    ``MAX_DEPTH`` is refused. Walks iteratively (no RecursionError on forged depth).

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

        if depth > MAX_DEPTH:
            raise bad(f"the tree nests deeper than {MAX_DEPTH} levels")
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
            if "class" in node and not (node["class"] == "Counter" or (
                    node["class"] == "defaultdict" and node.get("default") in DEFAULT_FACTORIES)):
                raise bad(f"dict node's class {str(node['class'])[:40]!r} (default {str(node.get('default'))[:40]!r}) "
                          "is not Counter or a defaultdict of a builtin")
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
        elif kind in TYPED_LEAVES:
            problem = typed_leaf_problem(kind, node)
            if problem:
                raise bad(problem)
        elif kind in TYPED_VALUE_NODES:
            value = node.get("value")
            if kind == "dataclass" and not is_class_name(node.get("class")):
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
