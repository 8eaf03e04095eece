"""A Lightning checkpoint dict <-> shardpoint components (and back), with its manifest metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._flatten import counting_kind, counting_mapping
from .._format.names import is_component_key

COMPONENT_OF_KEY = {"state_dict": "model", "optimizer_states": "optim"}
"""Lightning's top-level keys stored under another component name."""

EXTRA_COMPONENT = "lightning_extra"
"""Component holding top-level keys that cannot name a component (``{key: value}``)."""

METADATA_KEY = "lightning"
"""Manifest metadata entry: ``{"format": 1, "keys": [[key, component], ...]}``."""

_RESERVED_COMPONENTS = {*COMPONENT_OF_KEY.values(), EXTRA_COMPONENT, "shardpoint", "latest"}


def _component_for(key: Any) -> str:
    """The component a top-level key of a Lightning checkpoint is stored as."""
    if key in COMPONENT_OF_KEY:
        return COMPONENT_OF_KEY[key]
    if is_component_key(key) and key not in _RESERVED_COMPONENTS:
        return str(key)
    return EXTRA_COMPONENT


def _plain(value: Any) -> Any:
    """``value`` with every mapping (Lightning's ``AttributeDict``) replaced by a dict, but
    for the ones the state tree keeps (a ``Counter``: ``MultiStepLR.milestones``; a
    ``defaultdict`` of a builtin).

    Everything else is left to shardpoint's state tree, which keeps ``argparse.Namespace``,
    paths, Enum members, dataclasses and datetime values as typed nodes (no pickle).
    """
    if isinstance(value, Mapping) and not isinstance(value, torch.nn.Module):
        plain = {k: _plain(v) for k, v in value.items()}
        return counting_mapping(counting_kind(value), plain) if counting_kind(value) else plain
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def to_shardpoint_state(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a Lightning checkpoint dict into shardpoint components, plus manifest metadata.

    >>> state, meta = to_shardpoint_state({"state_dict": {}, "epoch": 1, "my key": 2})
    >>> sorted(state), meta["lightning"]["keys"]
    (['epoch', 'lightning_extra', 'model'], [['state_dict', 'model'], ['epoch', 'epoch'], ['my key', 'lightning_extra']])
    """
    state: dict[str, Any] = {}
    keys: list[list[Any]] = []
    extra: dict[Any, Any] = {}
    folded = {EXTRA_COMPONENT}
    for key, value in checkpoint.items():
        component = _component_for(key)
        if component != EXTRA_COMPONENT and component.casefold() in folded:
            component = EXTRA_COMPONENT  # differs from another's name only in case: one file on macOS
        folded.add(component.casefold())
        if component == EXTRA_COMPONENT:
            extra[key] = _plain(value)
        else:
            state[component] = _plain(value)
        keys.append([key, component])
    if extra:
        state[EXTRA_COMPONENT] = extra
    return state, {METADATA_KEY: {"format": 1, "keys": keys}}


def from_shardpoint_state(
    loaded: Any, metadata: Mapping[str, Any], *, flat: bool = False
) -> dict[str, Any]:
    """The Lightning checkpoint dict back from what ``sp.load`` returned.

    What this plugin wrote comes back with the keys it was given (a dict of tensors alone,
    ``fabric.save(path, model.state_dict())``, is stored flat, each key a tensor). A flat
    checkpoint written otherwise (a model's state dict, a Hugging Face directory) comes back
    as ``{"state_dict": ...}``; a nested one as its components.

    >>> t = torch.zeros(1)
    >>> state, meta = to_shardpoint_state({"step": t, "ema": t})
    >>> list(from_shardpoint_state(state, meta, flat=True)), list(from_shardpoint_state(state, {}, flat=True))
    (['step', 'ema'], ['state_dict'])
    """
    info = metadata.get(METADATA_KEY)
    keys = info.get("keys") if isinstance(info, Mapping) else None
    if flat and not (isinstance(keys, list) and all(component in loaded for _, component in keys)):
        return {"state_dict": loaded}
    if not isinstance(keys, list):
        # Saved by plain `sp.save`, not by this plugin: the components are the keys.
        return {("state_dict" if k == "model" else k): v for k, v in loaded.items()}
    checkpoint: dict[str, Any] = {}
    for key, component in keys:
        checkpoint[key] = (
            loaded[EXTRA_COMPONENT][key] if component == EXTRA_COMPONENT else loaded[component]
        )
    return checkpoint
