"""Objects that are not plain containers: modules, optimizers, anything ``Stateful``.

Optimizer state is stored keyed by parameter *name* (found through the modules saved in
the same state), not by the integer ids of ``optimizer.state_dict()``, so it loads into a
freshly built optimizer whose parameters are filtered or ordered differently.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, Protocol, cast, runtime_checkable

import torch

from ._flatten import Tagged
from .errors import InvalidArgumentTypeError, InvalidStateError, LoadMismatchError


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(sd)`` can be saved and restored.

    Example:
        >>> class Counter:
        ...     def __init__(self): self.n = 0
        ...     def state_dict(self): return {"n": self.n}
        ...     def load_state_dict(self, sd): self.n = sd["n"]
        >>> isinstance(Counter(), Stateful)
        True
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def parameter_names(modules: Iterable[tuple[str, torch.nn.Module]]) -> dict[int, str]:
    """id(parameter) -> name over the modules of a state (prefixed when there are several)."""
    modules = list(modules)
    names: dict[int, str] = {}
    for prefix, module in modules:
        for name, param in module.named_parameters(remove_duplicate=False):
            full = f"{prefix}.{name}" if len(modules) > 1 else name
            names.setdefault(id(param), full)
    return names


def renamed_parameter_names(
    modules: Iterable[tuple[str, torch.nn.Module]], renames: Mapping[str, tuple[str, str]]
) -> dict[int, str]:
    """id(parameter) -> its name as the checkpoint knows it, where a module's keys were
    renamed to match it (``renames``: module key -> (checkpoint prefix, target prefix), as
    ``LoadResult.prefix_mapping``; a flat checkpoint's one module under ``""``): a model
    trained under ``torch.compile`` (``_orig_mod.``) or DDP (``module.``) and resumed
    without it, or the other way, finds its optimizer state too. Only renamed ones listed.
    """
    modules = list(modules)
    out: dict[int, str] = {}
    for key, module in modules:
        rename = renames.get(key) or (renames.get("") if len(modules) == 1 else None)
        if rename is None:
            continue
        saved_prefix, target_prefix = rename
        for name, param in module.named_parameters(remove_duplicate=False):
            if name.startswith(target_prefix):
                local = saved_prefix + name[len(target_prefix):]
                out.setdefault(id(param), f"{key}.{local}" if len(modules) > 1 else local)
    return out


_STATE_DEPTH = 8
"""How deep in a state's containers its modules, optimizers and tensors are looked for."""
_STATE_ITEMS = 10_000
"""Items of each container looked at (a sampler's list of two million indices holds no module)."""
_SCALARS = (int, float, complex, str, bytes, bool, type(None))
"""Values a walk passes over without a word: no module, optimizer or tensor is one."""


def find_modules(state: Any) -> list[tuple[str, torch.nn.Module]]:
    """The modules of a state (path, module): its top-level values, and those inside its
    dicts, lists, tuples, Namespaces and dataclasses (``{"models": {"gen": G, "disc": D},
    "optims": ...}``, a path of ``models.gen``), each once; an optimizer over their
    parameters is stored by name.

    >>> g, d = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    >>> [p for p, _ in find_modules({"models": {"gen": g, "disc": d}, "ema": [g], "step": 3})]
    ['models.gen', 'models.disc']
    """
    if isinstance(state, torch.nn.Module):
        return [("model", state)]
    if not isinstance(state, Mapping):
        return []
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for path, value in state_objects(state):
        if isinstance(value, torch.nn.Module) and id(value) not in found:
            found[id(value)] = (path, value)
    return list(found.values())


def state_objects(state: Any, *, depth: int = _STATE_DEPTH) -> Iterator[tuple[str, Any]]:
    """(path, value) of what a state holds inside its dicts, lists, tuples, Namespaces and
    dataclass instances (a module, a tensor, any other object is a value, not looked into;
    numbers, strings and None are passed over), ``depth`` levels down, the first
    :data:`_STATE_ITEMS` items of each, each container once (at its first path): the one
    walk by which saves and loads find the modules, optimizers and tensors of a state. A
    state holding one list many times (``[row] * 2000``), or millions of indices, costs
    little.

    >>> [p for p, _ in state_objects({"a": [1, {"b": torch.ones(1)}], "c": torch.zeros(1), "n": 3})]
    ['a.1.b', 'c']
    """
    seen: set[int] = set()

    def walk(value: Any, path: str, level: int) -> Iterator[tuple[str, Any]]:
        children = _children(value) if level < depth else None
        if children is None:
            yield path, value
            return
        if id(value) in seen:
            return
        seen.add(id(value))
        for key, child in children:
            if type(child) not in _SCALARS:
                yield from walk(child, f"{path}.{key}" if path else str(key), level + 1)

    if type(state) not in _SCALARS:
        yield from walk(state, "", 0)


def _children(value: Any) -> Iterable[tuple[Any, Any]] | None:
    """A container's (key, child) pairs (the first :data:`_STATE_ITEMS`), or None for a value."""
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return None
    if isinstance(value, Mapping):
        return itertools.islice(value.items(), _STATE_ITEMS)
    if isinstance(value, (list, tuple)):
        return itertools.islice(enumerate(value), _STATE_ITEMS)
    fields = fields_of(value)
    return None if fields is None else fields.items()


def fields_of(value: Any) -> dict[str, Any] | None:
    """A Namespace's or a dataclass instance's fields (name -> value), else None."""
    if type(value) is argparse.Namespace:
        return dict(vars(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return None


def _optimizer_state_dict(optimizer: torch.optim.Optimizer, where: str) -> dict[str, Any]:
    """``optimizer.state_dict()``; a ``ZeroRedundancyOptimizer`` whose shards were not gathered
    first is refused with what to do (its own error names neither the state nor a way out)."""
    if type(optimizer).__name__ != "ZeroRedundancyOptimizer":
        return optimizer.state_dict()
    try:
        return optimizer.state_dict()
    except RuntimeError:
        raise InvalidStateError(
            f"{where}: a ZeroRedundancyOptimizer holds only this rank's shard of its state, and its shards were "
            "not gathered. Call optimizer.consolidate_state_dict(to=0) on every rank of its group first, then save "
            "from rank 0 alone (if dist.get_rank() == 0: sp.save(...)), as with DDP. At load, give every rank the "
            "optimizer: each keeps its own shard of what was saved"
        ) from None


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: Mapping[int, str], *,
                            where: str = "the optimizer") -> Tagged:
    """The optimizer's state with parameters named; positional when names are unknown (a
    warning says so where some are known: a parameter outside the state's modules)."""
    sd = _optimizer_state_dict(optimizer, where)
    group_names: list[list[str]] = []
    for group in optimizer.param_groups:
        group_names.append([names.get(id(p), "") for p in group["params"]])
    unnamed = sum(not n for g in group_names for n in g)
    if unnamed:
        if unnamed < sum(len(g) for g in group_names):
            warnings.warn(
                f"{where}: {unnamed} of the optimizer's parameters belong to no module of the saved state (a "
                "parameter of its own, such as a free logit_scale, or a module saved elsewhere), so its state is "
                "stored by position, not by parameter name: it loads right only into an optimizer built over the "
                "same parameters in the same order. Put such parameters in a module of the state (an "
                "nn.ParameterDict) to have them stored by name",
                UserWarning, stacklevel=2,
            )
        return Tagged("optimizer", sd, {"by_name": False})
    id_to_name = {}
    for saved_group, gnames in zip(sd["param_groups"], group_names, strict=False):
        for pid, name in zip(saved_group["params"], gnames, strict=False):
            id_to_name[pid] = name
    state = {id_to_name[pid]: value for pid, value in sd["state"].items()}
    groups = []
    for saved_group, gnames in zip(sd["param_groups"], group_names, strict=False):
        groups.append({**saved_group, "params": list(gnames)})
    return Tagged("optimizer", {"state": state, "param_groups": groups}, {"by_name": True})


class ParamIds(list[int]):
    """A parameter group's ``params`` (a list of ints) whose ``in`` is a set lookup.

    ``torch.optim.Optimizer.load_state_dict`` asks, for every state tensor it casts, which
    group holds its parameter, by ``param_id in group["params"]`` over each group's list:
    quadratic in the parameters (an AdamW over 15 000 parameters spent 4.4 s there). The
    set is rebuilt whenever the length changed (a deep copy, an append).

    >>> ids = ParamIds([0, 1, 2])
    >>> 2 in ids, 5 in ids, ids == [0, 1, 2]
    (True, False, True)
    >>> import copy; 1 in copy.deepcopy(ids)
    True
    """

    def __contains__(self, item: object) -> bool:
        members = self.__dict__.get("_members")
        if members is None or len(members) != len(self):
            members = self.__dict__["_members"] = frozenset(self)
        return item in members


def optimizer_state_for(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], names: Mapping[int, str], *, where: str,
    renamed: Mapping[int, str] | None = None, fresh: Collection[int] = (),
) -> dict[str, Any]:
    """Turn a saved name-keyed optimizer state into what ``optimizer.load_state_dict`` takes
    (``renamed``: a parameter's name in the checkpoint where its module's keys were renamed
    to match, tried when its own name is not there; ``fresh``: ids of parameters whose
    saved state is left out, parameters the model load skipped for a shape mismatch, which
    keep their new values and start their optimizer state afresh).

    Each target group is paired with the saved group holding its parameters' names (not by
    position: groups built in another order keep their own learning rates); a parameter
    listed in its saved group without state (it had no gradient yet: a frozen or unused
    layer) loads without state, as ``torch`` does.

    Raises:
        LoadMismatchError: a target parameter is in none of the saved groups, the groups
            cannot be paired one to one, or the saved groups hold another optimizer's
            hyperparameters (saved from Adam, loaded into SGD).
    """
    saved_groups = saved["param_groups"]
    saved_state = saved["state"]
    group_of: dict[str, int] = {}
    for i, saved_group in enumerate(saved_groups):
        for name in saved_group["params"]:
            group_of[str(name)] = i
    by_plain_name: dict[str, str] | None = None  # made when a name is not found as it is
    by_component: dict[str, str | None] | None = None
    target_names: list[list[str]] = []
    unknown: list[str] = []
    for group in optimizer.param_groups:
        group_names = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise LoadMismatchError(
                    f"{where}: a parameter of the target optimizer belongs to none of the modules "
                    "in the target state, so its saved state cannot be found by name; pass the "
                    "model in the same load_into call"
                )
            other = (renamed or {}).get(id(param))
            if name not in group_of and other is not None and other in group_of:
                name = other
            if name not in group_of:
                if by_plain_name is None:
                    by_plain_name = {_plain_name(n): n for n in group_of}
                name = by_plain_name.get(_plain_name(name), name)
            if name not in group_of:
                if by_component is None:
                    by_component = _without_component(group_of)
                name = _component_match(name, group_of, by_component)
            if name not in group_of:
                unknown.append(name)
            group_names.append(name)
        target_names.append(group_names)
    taken = Counter(n for names_ in target_names for n in names_)
    twice = sorted(n for n, count in taken.items() if count > 1)
    if twice:  # two target parameters found under one saved name
        raise LoadMismatchError(
            f"{where}: several parameters of the target optimizer match the checkpoint's parameter(s) "
            f"{', '.join(map(repr, twice[:5]))} (the state holds other modules than the saved one, named alike); "
            f"build the state with the modules it was saved with{_LEAVE_OUT}"
        )
    if unknown:
        raise LoadMismatchError(
            f"{where}: the checkpoint's optimizer has no parameter(s) {', '.join(map(repr, unknown[:10]))}"
            f"{' and more' if len(unknown) > 10 else ''} in any of its {len(saved_groups)} parameter group(s); "
            f"the optimizer was built over other parameters than the saved one (a layer added or renamed?){_LEAVE_OUT}"
        )
    if len(saved_groups) != len(optimizer.param_groups):
        raise LoadMismatchError(
            f"{where}: the checkpoint's optimizer has {len(saved_groups)} parameter groups, the "
            f"target optimizer has {len(optimizer.param_groups)}; build the optimizer with the "
            "same groups"
        )
    pairing: list[int | None] = []
    for i, group_names in enumerate(target_names):
        found = sorted({group_of[name] for name in group_names})
        if not found:
            pairing.append(None)  # an empty group: paired below with an empty saved one
            continue
        if len(found) != 1 or found[0] in pairing:
            raise LoadMismatchError(
                f"{where}: the target optimizer's parameter group {i} ({_names_shown(group_names)}) "
                + (f"holds parameters of the checkpoint's groups {found}" if len(found) > 1 else
                   f"pairs with the checkpoint's group {found[0]}, as does another")
                + "; build the parameter groups with the parameters they were saved with"
            )
        pairing.append(found[0])
    empty_saved = [j for j, g in enumerate(saved_groups) if not g["params"] and j not in pairing]
    for i, index in enumerate(pairing):
        if index is None:
            if not empty_saved:
                raise LoadMismatchError(
                    f"{where}: the target optimizer's parameter group {i} is empty, and the checkpoint's "
                    "groups all hold parameters; build the parameter groups as they were saved"
                )
            pairing[i] = empty_saved.pop(0)
    left_out = [str(n) for j in pairing if j is not None for n in saved_groups[j]["params"] if str(n) not in taken]
    if left_out:
        raise LoadMismatchError(
            f"{where}: the checkpoint's optimizer holds parameter(s) {', '.join(map(repr, left_out[:10]))}"
            f"{' and more' if len(left_out) > 10 else ''} that the target optimizer does not (a layer removed, "
            "or frozen since); their state would be dropped. Build the optimizer over the parameters it was "
            f"saved with{_LEAVE_OUT}"
        )
    state: dict[int, Any] = {}
    groups = []
    pid = 0
    for group, group_names, index in zip(optimizer.param_groups, target_names, pairing, strict=True):
        assert index is not None
        saved_group = saved_groups[index]
        _check_same_kind(optimizer, group, saved_group, where)
        ids = []
        for param, name in zip(group["params"], group_names, strict=True):
            if name in saved_state and id(param) not in (fresh or ()):
                state[pid] = saved_state[name]
            ids.append(pid)
            pid += 1
        made = {**{k: v for k, v in saved_group.items() if k != "params"}, "params": ParamIds(ids)}
        if "param_names" in made:  # named groups: the target's own order of names, as its params are
            made["param_names"] = list(group.get("param_names", made["param_names"]))
        groups.append(made)
    return {"state": state, "param_groups": groups}


_LEAVE_OUT = (
    "; or leave the optimizer out of load_into's target to load the rest (its state then starts afresh)"
)

INNER_WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Attribute names of wrappers that may sit anywhere in a model (FSDP1, activation
checkpointing); ``_module_fit`` strips them, and ``torch.compile``'s and DDP's, as prefixes."""
_WRAPPER_SEGMENTS = tuple(f"{name}." for name in INNER_WRAPPERS)
"""Segments wrappers insert in ``named_parameters`` but not in the ``state_dict`` keys, so an
optimizer saved with the wrapper names its parameters differently from the same model
without it."""


def _without_component(saved: Mapping[str, int]) -> dict[str, str | None]:
    """Saved parameter name without its module's path -> the name (None where two saved
    names share it): a state saved with one module names its parameters ``0.weight``, with
    several ``model.0.weight``, or ``models.net.0.weight`` for a module inside a dict (an
    EMA or teacher added to the state, or dropped from it). Each leading path is tried."""
    out: dict[str, str | None] = {}
    for name in saved:
        rest = name
        while "." in rest:
            rest = rest.partition(".")[2]
            out[rest] = None if out.get(rest, name) != name else name
    return out


def _component_match(name: str, saved: Mapping[str, int], by_component: Mapping[str, str | None]) -> str:
    """The saved name ``name`` stands for across a change in the number of modules of the
    state (a module path added or dropped, one saved name only), else ``name``."""
    match = by_component.get(name)
    if match is not None:
        return match  # saved prefixed (several modules), loaded unprefixed
    rest = name
    while "." in rest:
        rest = rest.partition(".")[2]
        if rest in saved:
            return rest  # saved unprefixed (one module), loaded prefixed
    return name


def _plain_name(name: str) -> str:
    """``name`` without wrapper segments: ``0._checkpoint_wrapped_module.weight`` -> ``0.weight``."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _names_shown(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


_ADDED_BY_TORCH_VERSIONS = {"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
"""Hyperparameters later torch versions added to existing optimizers: a group saved by an
older torch lacks them, and ``load_state_dict`` fills them in."""


def _check_same_kind(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], saved_group: Mapping[str, Any],
                     where: str) -> None:
    """Refuse groups of another optimizer class: the saved group lacks hyperparameters the
    target's class defines for every group (SGD's ``momentum`` in a group saved from Adam).
    Keys a scheduler or the user adds to groups (``initial_lr``, a group ``name``) are not
    the class's, and count for nothing."""
    defined = set(getattr(optimizer, "defaults", {})) - _ADDED_BY_TORCH_VERSIONS - {"params", "param_names"}
    lacking = sorted(k for k in defined if k in group and k not in saved_group)
    if lacking:
        raise LoadMismatchError(
            f"{where}: the checkpoint's optimizer state was saved from another optimizer class than the target's "
            f"{type(optimizer).__name__}: its parameter groups lack {', '.join(lacking)}, which every "
            f"{type(optimizer).__name__} group holds; build the optimizer class it was saved from (or leave the "
            "optimizer out of the target to load the rest)"
        )


def make_to_state(names: Mapping[int, str]) -> Callable[[Any, str], Any]:
    """The ``to_state`` hook for flattening, knowing the state's parameter names."""

    def to_state(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.nn.Module):
            return Tagged("module", obj.state_dict(), {})
        if isinstance(obj, torch.optim.Optimizer):
            return optimizer_state_by_name(obj, names, where=where)
        if isinstance(obj, Stateful):
            return Tagged("stateful", obj.state_dict(), {"class": type(obj).__qualname__})
        return NotImplemented

    return to_state


class RNGState:
    """The random number generators of this process, as one ``Stateful``.

    Captures Python's ``random``, NumPy's global generator (if NumPy is installed), torch's
    CPU generator and, when CUDA is available, every CUDA device's generator. Put it in the
    state to save, and in the target to restore.

    Under ``torch.distributed`` (more than one rank) each rank's generators are kept under
    its rank (``{"ranks": {"3": ...}}``): a collective save keeps every rank's, and each
    rank restores its own. A rank the checkpoint holds none for (saved by rank 0 alone, or
    by fewer ranks) keeps its generators as they are, with a warning.

    Example:
        >>> import torch, shardpoint as sp
        >>> rng = sp.RNGState()
        >>> sd = rng.state_dict(); a = torch.rand(1)
        >>> rng.load_state_dict(sd); bool(torch.rand(1) == a)
        True
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        sd: dict[str, Any] = {
            # A tensor, not 625 JSON numbers: a collective save holds one per rank.
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        else:
            # The legacy global generator is always MT19937, so ``legacy=True`` (the default)
            # always returns the tuple; numpy's stubs type the call without ``legacy`` as the
            # dict form and the call with it as either form.
            kind, keys, pos, has_gauss, cached = cast(
                "tuple[str, np.ndarray[Any, Any], int, int, float]", np.random.get_state(legacy=True)
            )
            sd["numpy"] = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if torch.cuda.is_available():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        rank = _distributed_rank()
        return sd if rank is None else {"ranks": {str(rank): sd}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        own: Mapping[str, Any] = state_dict
        if "ranks" in state_dict:
            ranks = state_dict["ranks"]
            rank = _distributed_rank() or 0
            if str(rank) not in ranks:
                held = ", ".join(sorted(ranks, key=lambda r: int(r) if str(r).isdigit() else -1))
                warnings.warn(
                    f"RNGState: the checkpoint holds the random generators of rank(s) {held} only, not rank {rank}'s "
                    "(it was saved by rank 0 alone, or by fewer ranks); this rank's generators are left as they are",
                    stacklevel=2,
                )
                return
            own = ranks[str(rank)]
        py = own["python"]
        internal = py["state"]
        internal = internal.tolist() if isinstance(internal, torch.Tensor) else internal
        random.setstate((py["version"], tuple(int(v) for v in internal), py["gauss"]))
        torch.set_rng_state(own["torch"].to(torch.uint8).cpu())
        if "numpy" in own:
            import numpy as np

            npst = own["numpy"]
            np.random.set_state(
                (npst["kind"], npst["keys"].numpy().astype("uint32"), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
            )
        if "cuda" in own and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in own["cuda"]])


def _distributed_rank() -> int | None:
    """This process's rank when ``torch.distributed`` runs more than one, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return None


def empty_model(factory: Callable[..., torch.nn.Module], *args: Any, **kwargs: Any) -> torch.nn.Module:
    """Build a module with its parameters and persistent buffers on the ``meta`` device:
    shapes and dtypes, no memory.

    Non-persistent buffers (rotary ``inv_freq``, ``position_ids``, causal masks: in no
    state dict, so in no checkpoint) are built for real on the CPU by the module's own
    code, as ``accelerate.init_empty_weights()`` keeps buffers. Construction runs with the
    default device (each parameter is moved to ``meta`` as it is registered, before the
    module initializes it, so no weight memory is written); then persistent buffers go to
    ``meta`` too. Fill the model with ``sp.load_into(model, path, device=..., dtype=...)``,
    which materializes each tensor straight from the checkpoint, one at a time.

    Example:
        >>> import torch, shardpoint as sp
        >>> model = sp.empty_model(torch.nn.Linear, 4096, 4096)
        >>> model.weight.device.type
        'meta'
    """
    if isinstance(factory, torch.nn.Module):
        raise InvalidArgumentTypeError(
            f"empty_model takes a class or a function that builds the model (e.g. sp.empty_model(LlamaForCausalLM, "
            f"config)), not a model already built (a {type(factory).__name__}): calling it would run its forward"
        )
    builder = threading.get_ident()

    def to_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> Any:
        if param is None or param.device.type == "meta" or threading.get_ident() != builder:
            return None  # tied (already meta), or another thread's module: as it is
        meta = param.detach().to("meta")
        if type(param) is torch.nn.Parameter:
            out = torch.nn.Parameter(meta, requires_grad=param.requires_grad)
            out.__dict__.update(param.__dict__)
            return out
        return type(param)(meta, **{**param.__dict__, "requires_grad": param.requires_grad})

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        model = factory(*args, **kwargs)
    finally:
        handle.remove()
    moved: dict[int, torch.Tensor] = {}  # a buffer shared by modules stays one tensor
    for owner in model.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set and buffer.device.type != "meta":
                owner._buffers[name] = moved.setdefault(id(buffer), buffer.to("meta"))
    return model
