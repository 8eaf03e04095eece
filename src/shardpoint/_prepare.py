"""From what the user passes to ``save`` to components of named tensors plus JSON trees."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._flatten import flatten_state
from ._format.dtypes import dtype_name
from ._format.names import validate_component_key
from ._stateful import find_modules, make_to_state, parameter_names
from .errors import InvalidStateError


@dataclass
class Component:
    """One top-level component ready to be written."""

    name: str
    tree: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    """Every tensor leaf by name, aliases included."""
    stored: list[str] = field(default_factory=list)
    """Names actually written (each distinct memory once), in order."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Name -> stored name, for tensors that are the same memory as a stored one."""
    placements: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """For staged shards: name -> (global shape, offsets) of the local chunk in ``tensors``."""

    def stored_bytes(self) -> int:
        return sum(self.tensors[n].numel() * self.tensors[n].element_size() for n in self.stored)


@dataclass
class PreparedState:
    components: list[Component]
    flat: bool
    """A flat state dict / module, saved as the component ``model``; loads back flat."""

    def total_bytes(self) -> int:
        return sum(c.stored_bytes() for c in self.components)

    def all_tensors(self) -> list[torch.Tensor]:
        return [c.tensors[n] for c in self.components for n in c.stored]


def split_components(state: Any) -> tuple[dict[str, Any], bool]:
    """Top-level components of ``state``, and whether it is a flat model state dict."""
    if isinstance(state, torch.nn.Module):
        return {"model": state.state_dict()}, True
    if not isinstance(state, Mapping):
        raise InvalidStateError(
            f"save() takes a state dict or a mapping of components, not {type(state).__name__}"
        )
    if not state:
        raise InvalidStateError("the state is empty; there is nothing to save")
    if all(isinstance(v, torch.Tensor) for v in state.values()):
        for key in state:
            if not isinstance(key, str):
                raise InvalidStateError(
                    f"key {key!r} of the state dict is a {type(key).__name__}; tensor names must be str"
                )
        return {"model": state}, True
    return {validate_component_key(k): v for k, v in state.items()}, False


def check_tensor(name: str, component: str, tensor: torch.Tensor) -> None:
    """Refuse what safetensors cannot hold, naming the tensor and what to do."""
    where = f"tensor {name!r}" + (f" of component {component!r}" if component != "model" else "")
    if tensor.layout != torch.strided:
        raise InvalidStateError(
            f"{where} is a {tensor.layout} tensor; safetensors stores dense tensors only. "
            "Call `.to_dense()` on it before saving"
        )
    if tensor.is_meta:
        raise InvalidStateError(
            f"{where} is on the meta device and holds no data; materialize the module "
            "(e.g. `module.to_empty(device='cpu')` and initialize it) before saving"
        )
    dtype_name(tensor.dtype, key=name)


def storage_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a tensor's memory view: equal keys mean the very same bytes."""
    if type(tensor).__name__ == "DTensor":
        with torch.no_grad():  # the local tensor itself, not an autograd node (~70 us each)
            tensor = tensor.to_local()  # type: ignore[attr-defined]
    if tensor.numel() == 0 or tensor.is_meta:
        return None
    # The first element's address stands for (storage, offset): the same address, shape,
    # strides and dtype are the same bytes, and it costs no storage object per tensor. A
    # lazily conjugated or negated view of those bytes holds other values.
    return (
        tensor.device,
        tensor.data_ptr(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.is_conj(),
        tensor.is_neg(),
    )


def dedup(comp: Component) -> None:
    """Store tensors that are the same view of the same memory once (tied weights)."""
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in comp.tensors.items():
        key = storage_key(tensor)
        if key is not None and key in seen:
            comp.aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        comp.stored.append(name)


def prepare_state(state: Any, *, allow_pickle: bool = False) -> PreparedState:
    """Flatten, check and dedup ``state`` into components."""
    raw, flat = split_components(state)
    to_state = make_to_state(parameter_names(find_modules(state)))
    components = []
    for cname, value in raw.items():
        tree, tensors = flatten_state(value, path=cname, to_state=to_state, allow_pickle=allow_pickle)
        comp = Component(cname, tree, tensors)
        for name, tensor in tensors.items():
            check_tensor(name, cname, tensor)
        dedup(comp)
        components.append(comp)
    return PreparedState(components, flat)
