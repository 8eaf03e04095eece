"""From what the user passes to ``save`` to components of named tensors plus JSON trees."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._flatten import flatten_state
from ._format.dtypes import dtype_name
from ._format.names import check_tensor_name, validate_component_key
from ._io.memory import local_tensor, storage_less
from ._module_fit import offloaded, unwrapped
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
    hf_storage: dict[str, tuple[tuple[Any, ...] | None, int]] = field(default_factory=dict)
    """Stored name -> (storage identity, bytes) as ``transformers`` plans files (see
    :func:`hf_storages`), taken from the caller's tensors at prepare time (staged copies
    share one buffer); empty: computed from ``tensors`` when the files are planned."""
    parameters: int | None = None
    """Parameter count of the module this component was taken from (``num_parameters()``
    in ``transformers``); None for a state dict, where every stored element counts."""
    buffers: frozenset[str] = frozenset()
    """Names of the tensors that are a module's buffers (``BatchNorm``'s running statistics:
    under DDP each rank holds its own batch's until the next forward broadcasts rank 0's, so
    a collective save does not compare them across ranks)."""
    layouts: dict[str, Any] = field(default_factory=dict)
    """For staged shards of DTensors: name -> the DTensor's mesh layout
    (``_distributed.regular.MeshLayout``), so a staged save can still be planned by rules."""

    def stored_bytes(self) -> int:
        return sum(self.tensors[n].numel() * self.tensors[n].element_size() for n in self.stored)

    def parameter_count(self) -> int:
        """The index's ``total_parameters``: the module's parameters, else stored elements."""
        if self.parameters is not None:
            return self.parameters
        return sum(_global_numel(self.tensors[n]) for n in self.stored)


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
    components = {validate_component_key(k): v for k, v in state.items()}
    folded: dict[str, str] = {}
    for name in components:
        other = folded.setdefault(name.casefold(), name)
        if other != name:
            raise InvalidStateError(
                f"top-level keys {other!r} and {name!r} of the state differ only in case: their files would be "
                "one file on a case-insensitive filesystem (macOS, Windows), each overwriting the other's; "
                "rename one of them"
            )
    return components, False


def check_tensor(name: str, component: str, tensor: torch.Tensor) -> None:
    """Refuse what safetensors cannot hold, naming the tensor and what to do."""
    where = f"tensor {name!r}" + (f" of component {component!r}" if component != "model" else "")
    check_tensor_name(name, where="the state to save")
    if torch.nn.parameter.is_lazy(tensor):
        raise InvalidStateError(
            f"{where} is a parameter of a lazy module (nn.LazyLinear, ...) that has no shape yet; "
            "run the model once on an input (or call its initialize_parameters) before saving"
        )
    if tensor.is_nested:
        raise InvalidStateError(
            f"{where} is a nested (ragged) tensor; safetensors stores dense tensors only. "
            "Save its components instead (`list(t.unbind())`) or pad it (`t.to_padded_tensor(0.0)`)"
        )
    if _functorch_wrapped(tensor):
        raise InvalidStateError(
            f"{where} is a functorch-wrapped tensor (a value from inside vmap/grad/functionalize "
            "that escaped it); it has no storage of its own. Save the tensors outside the transform"
        )
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
    if storage_less(tensor):
        raise InvalidStateError(
            f"{where} is a {type(tensor).__name__}, a tensor subclass with no memory of its own (as "
            "torchao's quantized and float8 tensors are); safetensors stores plain tensors. Save plain "
            "values (its dequantized form, or the plain tensors it is made of), or torch.save it"
        )
    dtype_name(tensor.dtype, key=name)


def _functorch_wrapped(tensor: torch.Tensor) -> bool:
    probe = getattr(torch._C, "_functorch", None)
    check = getattr(probe, "is_functorch_wrapped_tensor", None)
    try:
        return bool(check(tensor)) if check is not None else False
    except (RuntimeError, TypeError):
        return False


def _global_numel(tensor: torch.Tensor) -> int:
    return tensor.numel()  # a DTensor's numel() is its global element count


def module_parameters(module: torch.nn.Module) -> int:
    """Parameters of ``module``, each shared one once (``transformers``' ``num_parameters()``)."""
    return sum(p.numel() for p in module.parameters())


def hf_storage(tensor: torch.Tensor) -> tuple[tuple[Any, ...] | None, int]:
    """(storage identity, bytes) as ``huggingface_hub``'s ``split_torch_state_dict_into_shards``
    (which ``transformers``' ``save_pretrained`` uses) sizes a tensor when it plans files.

    A tensor counts the bytes of its whole storage, and views of one storage share the
    identity (so they go to one file, counted once), contiguous or not, as there;
    ``meta`` descriptors and DTensors count their (global) bytes and share nothing.
    """
    if type(tensor).__name__ == "DTensor" or tensor.is_meta:
        return None, tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    return (tensor.device, storage.data_ptr(), nbytes), nbytes


def _end_ptr(tensor: torch.Tensor) -> int:
    """One past the last byte of ``tensor``'s last element (its first byte when empty)."""
    if tensor.numel() == 0:
        return int(tensor.data_ptr())
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return int(tensor.data_ptr()) + (last + 1) * tensor.element_size()


def hf_storages(
    tensors: Mapping[str, torch.Tensor], stored: list[str]
) -> dict[str, tuple[tuple[Any, ...] | None, int]]:
    """Stored name -> (storage identity, bytes) as ``transformers``' ``save_pretrained``
    plans its files (see :func:`hf_storage`).

    As there (``remove_tied_weights_from_state_dict``), of several names viewing one
    storage (aliases included) those that overlap no other are saved as copies of their
    own: each counts its own bytes and shares nothing (an empty copy, like every empty
    tensor without memory, shares the null storage). Views that overlap stay together.
    """
    out = {name: hf_storage(tensors[name]) for name in stored}
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in tensors.items():
        sid = out[name][0] if name in out else hf_storage(tensor)[0]
        if sid is not None:
            groups.setdefault(sid, []).append(name)
    for members in groups.values():
        if len(members) < 2:
            continue
        areas = sorted((int(tensors[n].data_ptr()), _end_ptr(tensors[n]), n) for n in members)
        sets: list[list[str]] = [[areas[0][2]]]
        last_stop = areas[0][1]
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                sets.append([name])
            else:
                sets[-1].append(name)
            last_stop = max(last_stop, stop)
        for names in sets:
            if len(names) == 1 and names[0] in out:
                tensor = tensors[names[0]]
                nbytes = tensor.numel() * tensor.element_size()
                out[names[0]] = ((tensor.device, 0, 0) if nbytes == 0 else ("copy", names[0]), nbytes)
    return out


def hf_sizes(comp: Component) -> tuple[list[tuple[str, int]], dict[str, tuple[Any, ...] | None]]:
    """The sizes and storage identities :func:`~shardpoint._planning.shards.plan_shards`
    takes to lay ``comp``'s stored tensors out as ``transformers`` would (see
    :func:`hf_storages`); taken at prepare time where the component was prepared."""
    planned = comp.hf_storage or hf_storages(comp.tensors, comp.stored)
    sizes = []
    storage = {}
    for name in comp.stored:
        sid, nbytes = planned[name]
        storage[name] = sid
        sizes.append((name, nbytes))
    return sizes, storage


def storage_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a tensor's memory view: equal keys mean the very same bytes."""
    if type(tensor).__name__ == "DTensor":
        tensor = local_tensor(tensor)
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


def dedup(comp: Component, keep: Collection[str] = ()) -> None:
    """Store tensors that are the same view of the same memory once (tied weights).

    Of each group of such names the one stored is the name listed in ``keep`` (the names
    ``transformers``' ``save_pretrained`` keeps of a model's ties), else the first in order
    (for the models of ``transformers`` that is the name it keeps too: the embedding comes
    before the head that reuses it). It keeps its own place in the order; the others
    become aliases of it. (``huggingface_hub.save_torch_state_dict`` keeps the
    alphabetically first name unless given ``shared_tensors_to_discard``.)
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in comp.tensors.items():
        key = storage_key(tensor)
        if key is not None:
            groups.setdefault(key, []).append(name)
    alias_of: dict[str, str] = {}
    for names in groups.values():
        if len(names) > 1:
            preferred = [n for n in names if n in keep] or names
            kept = preferred[0]
            alias_of.update((n, kept) for n in names if n != kept)
    for name in comp.tensors:
        if name in alias_of:
            comp.aliases[name] = alias_of[name]
        else:
            comp.stored.append(name)
    comp.hf_storage = hf_storages(comp.tensors, comp.stored)


def transformers_kept_names(module: torch.nn.Module) -> set[str]:
    """The names ``transformers``' ``save_pretrained`` keeps of a model's tied weights
    (empty for other modules: the plain state-dict rule applies)."""
    if getattr(module, "config", None) is None or not hasattr(module, "_tied_weights_keys"):
        return set()
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # pragma: no cover - transformers not installed
        return set()
    state = module.state_dict()
    for key in getattr(module, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    try:
        model: Any = module  # a PreTrainedModel (it has a config and _tied_weights_keys)
        return set(remove_tied_weights_from_state_dict(dict(state), model))
    except (RuntimeError, ValueError, TypeError, AttributeError, KeyError):
        return set()  # ties transformers itself refuses to save, or cannot read: shardpoint's rule


def _without_wrappers(state: Any) -> Any:
    """``state`` with each module (the state itself, or a top-level component) saved from
    inside its wrappers (``torch.compile``'s ``_orig_mod.``, DDP's ``module.``), as
    accelerate's ``save_model`` and the Trainer save one: its files are the model's own,
    which ``from_pretrained`` reads (``load_into`` matches either way)."""
    if isinstance(state, torch.nn.Module):
        return unwrapped(state)[0]
    if isinstance(state, Mapping) and any(isinstance(v, torch.nn.Module) for v in state.values()):
        return {k: unwrapped(v)[0] if isinstance(v, torch.nn.Module) else v for k, v in state.items()}
    return state


def _where(tensor: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's memory, as a key (a state dict's ``detach()`` of a buffer is another object)."""
    if tensor.device.type == "meta" or type(tensor).__name__ == "DTensor":
        return (id(tensor),)
    return tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def prepare_state(state: Any, *, allow_pickle: bool = False, keep: Collection[str] = ()) -> PreparedState:
    """Flatten, check and dedup ``state`` into components.

    ``keep``: tensor names to store rather than record as aliases where names are tied
    (see :func:`dedup`); a ``transformers`` model passed as ``state`` brings its own.
    """
    state = _without_wrappers(state)
    modules = find_modules(state)
    for _path, module in modules:
        where = offloaded(module)
        if where is not None:
            raise InvalidStateError(
                f"module {where or type(module).__name__!r} is offloaded by accelerate: its state dict holds meta "
                "tensors, its weights are in a hook's weights_map. Put them back before saving "
                "(accelerate.hooks.remove_hook_from_module(model, recurse=True)), or save the model with "
                "its own save_pretrained; do not materialize it with to_empty (that would lose the weights)"
            )
    raw, flat = split_components(state)
    to_state = make_to_state(parameter_names(modules))
    buffers = {_where(b) for _, m in modules for b in m.buffers()}
    components = []
    for cname, value in raw.items():
        tree, tensors = flatten_state(value, path=cname, to_state=to_state, allow_pickle=allow_pickle)
        comp = Component(cname, tree, tensors)
        comp.buffers = frozenset(n for n, t in tensors.items() if buffers and _where(t) in buffers)
        module = state if flat and isinstance(state, torch.nn.Module) else value
        comp_keep: Collection[str] = keep if flat else ()
        for name, tensor in tensors.items():
            check_tensor(name, cname, tensor)
        if isinstance(module, torch.nn.Module):
            comp.parameters = module_parameters(module)
            comp_keep = comp_keep or transformers_kept_names(module)
        dedup(comp, comp_keep)
        components.append(comp)
    return PreparedState(components, flat)
