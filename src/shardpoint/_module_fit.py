"""How a checkpoint fits a module beyond matching names one to one.

Three things ``from_pretrained`` does that ``load_into`` does the same way:

* **Key prefixes.** A base model's checkpoint (``norm.weight``) loads into a model with a
  head (``model.norm.weight``) and the other way round: :func:`match_prefix` finds the
  prefix (the module's ``base_model_prefix``, or a leading component many keys share)
  that makes more keys match than the names as they are.
* **fp32-kept modules.** With ``dtype=torch.float16`` the keys matching a ``transformers``
  model's ``_keep_in_fp32_modules`` stay float32 (and, for float16 or bfloat16, those of
  ``_keep_in_fp32_modules_strict``): :func:`keep_fp32_pattern`.
* **Non-persistent buffers.** They are in no state dict, so a module built on ``meta``
  gets them from nowhere: :func:`rebuild_buffers` recomputes them through the model's own
  initialization (``_init_weights`` of the nearest ancestor that has one, as
  ``from_pretrained`` does after its own meta-device load) and proves every element was
  written; a module with no such initializer, by running its constructor again where
  every argument is one of its attributes (:func:`rebuild_by_constructor`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch

from ._format.dtypes import as_dtype
from ._stateful import INNER_WRAPPERS


def match_prefix(
    target_keys: Collection[str], saved_keys: Collection[str], base_prefix: str | None = None,
    *, wrappers_only: bool = False,
) -> tuple[str, str] | None:
    """The ``(saved prefix, target prefix)`` rename that matches the most keys, if it
    matches more than the names as they are; else None.

    Candidates are ``base_prefix`` and, on each side, the three leading components most
    keys have, added or removed (the rest of each key's path must then match whole); one
    side's prefix replaced by the other's only where both are wrapper components (DDP's
    ``module.`` for ``torch.compile``'s ``_orig_mod.``): ``decoder.weight`` is no evidence
    that a checkpoint's ``decoder`` is the target's ``head``. The rename must
    match strictly more keys than no rename. ``wrappers_only`` (a plain dict target, which
    has no model structure to vouch for a rename): only prefixes of wrapper components
    (``module.``, ``_orig_mod.``, ...) are tried. A saved key that matches as it is keeps its name
    (see :func:`rename_keys`).

    Example:
        >>> match_prefix(["model.norm.weight", "lm_head.weight"], ["norm.weight"], "model")
        ('', 'model.')
        >>> match_prefix(["norm.weight"], ["model.norm.weight", "lm_head.weight"])
        ('model.', '')
        >>> match_prefix(["a.w"], ["a.w"]) is None
        True
        >>> match_prefix(["_orig_mod.0.weight"], ["module.0.weight"])
        ('module.', '_orig_mod.')
        >>> match_prefix(["0.weight", "0.bias"], ["_orig_mod.module.0.weight", "_orig_mod.module.0.bias"])
        ('_orig_mod.module.', '')
    """
    targets = set(target_keys)
    saved = list(saved_keys)
    best = sum(1 for k in saved if k in targets)
    if best == min(len(saved), len(targets)):
        return None  # every key that can match does, as it is
    candidates: set[str] = set()
    if base_prefix:
        candidates.add(base_prefix.rstrip(".") + ".")
    sides = []
    for keys in (targets, saved):
        heads = Counter(k.split(".", 1)[0] for k in keys if "." in k)
        wrapped = Counter(_wrapper_run(k) for k in keys)
        wrapped.pop("", None)
        sides.append({head + "." for head, _count in heads.most_common(3)}
                     | {run for run, _count in wrapped.most_common(2)})
        candidates.update(sides[-1])
    if wrappers_only:
        candidates = {c for c in candidates if _is_wrapper_run(c)}
        sides = [{c for c in side if c in candidates} for side in sides]
    renames = [r for prefix in sorted(candidates) for r in (("", prefix), (prefix, ""))]
    # One wrapper for another (saved under DDP's module., loaded under torch.compile's _orig_mod.).
    renames += [(old, new) for old in sorted(sides[1]) for new in sorted(sides[0])
                if old != new and _is_wrapper_run(old) and _is_wrapper_run(new)]
    # A wrapper dropped and one of the target's leading components added (a base model saved
    # under DDP, loaded into a model with a head): taken only when no other rename does as well.
    if not wrappers_only:
        renames += [(old, new) for old in sorted(sides[1]) for new in sorted(sides[0])
                    if _is_wrapper_run(old) and not _is_wrapper_run(new)]
    choice: tuple[str, str] | None = None
    chosen: dict[str, str] = {}
    tied = False
    for rename in dict.fromkeys(renames):
        mapped = rename_keys(targets, saved, rename)
        if len(mapped) > best:
            best, choice, chosen, tied = len(mapped), rename, mapped, False
        elif len(mapped) == best and choice is not None and mapped != chosen:
            tied = True  # two renames match as many keys, differently: no guess
    return None if tied else choice


_WRAPPERS = ("_orig_mod", "module", *INNER_WRAPPERS)
"""Attribute names wrappers put in front of a model's keys: ``torch.compile``, DDP /
DataParallel, and the inner ones."""


def _is_wrapper_run(prefix: str) -> bool:
    return all(part in _WRAPPERS for part in prefix.rstrip(".").split("."))


def _wrapper_run(key: str) -> str:
    """The leading run of wrapper components of ``key``, when there are two or more:
    ``_orig_mod.module.0.weight`` -> ``_orig_mod.module.`` (``torch.compile`` of DDP, the
    order PyTorch recommends); one alone is a leading component already."""
    parts = key.split(".")
    n = 0
    while n < len(parts) - 1 and parts[n] in _WRAPPERS:
        n += 1
    return ".".join(parts[:n]) + "." if n >= 2 else ""


def unwrapped(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The model inside wrappers, and the key prefix they add (``""`` for a module that is no
    wrapper): a module whose one child is named as ``torch.compile`` (``_orig_mod``), DDP /
    DataParallel (``module``), FSDP1 or activation checkpointing name theirs, and that holds
    no parameter or buffer of its own.

    >>> net = torch.nn.Linear(2, 2)
    >>> inner, prefix = unwrapped(torch.nn.DataParallel(net))
    >>> inner is net, prefix
    (True, 'module.')
    """
    prefix = ""
    for _ in range(8):  # wrappers of wrappers (compile of DDP), never a cycle
        children = list(module.named_children())
        if len(children) != 1 or children[0][0] not in _WRAPPERS:
            break
        if type(module).__name__ not in _WRAPPER_CLASSES and (
                "config" in vars(module) or is_transformers_model(module)
                or next(module.named_parameters(recurse=False), None) is not None
                or next(module.named_buffers(recurse=False), None) is not None):
            break  # a model of its own (a transformers model holding another as `module`)
        name, module = children[0]
        prefix += name + "."
    return module, prefix


_WRAPPER_CLASSES = {"OptimizedModule", "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel",
                    "CheckpointWrapper", "OffloadWrapper"}
"""torch's wrapper classes: always unwrapped (``torch.compile``'s passes ``config`` through)."""


def rename_keys(
    target_keys: Collection[str], saved_keys: Collection[str], rename: tuple[str, str] | None
) -> dict[str, str]:
    """target key -> saved key for every saved key that matches a target key, as it is or
    renamed by ``rename`` = (saved prefix, target prefix); a target key is taken once."""
    targets = set(target_keys)
    out: dict[str, str] = {k: k for k in saved_keys if k in targets}
    if rename is None:
        return out
    old, new = rename
    for key in saved_keys:
        if key in targets or not key.startswith(old):
            continue
        renamed = new + key[len(old):]
        if renamed in targets and renamed not in out:
            out[renamed] = key
    return out


def keep_fp32_pattern(module: torch.nn.Module | type, dtype: torch.dtype | None) -> re.Pattern[str] | None:
    """The keys ``from_pretrained(dtype=dtype)`` keeps in float32, as one pattern (searched
    in each key, ``*`` as any text), or None; of a model, or of its class (``convert``).

    ``_keep_in_fp32_modules`` applies to float16 only, ``_keep_in_fp32_modules_strict`` to
    float16 and bfloat16, exactly as ``transformers`` reads them.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    names: list[str] = []
    attrs = ["_keep_in_fp32_modules_strict"] + (["_keep_in_fp32_modules"] if dtype == torch.float16 else [])
    for attr in attrs:
        value = getattr(module, attr, None)
        if isinstance(value, (list, tuple, set, frozenset)):
            names.extend(str(v) for v in value)
    if not names:
        return None
    return re.compile("|".join(f"(?:{n.replace('*', '.*')})" for n in sorted(set(names))))


def ignored_on_load(module: torch.nn.Module) -> tuple[re.Pattern[str] | None, re.Pattern[str] | None]:
    r"""The keys ``from_pretrained`` does not report (missing, unexpected), as patterns
    searched in each key: the model's ``_keys_to_ignore_on_load_missing`` /
    ``_keys_to_ignore_on_load_unexpected`` (a composite model's sub-models' too), and the
    buffers old checkpoints hold that models no longer save (a layer's
    ``rotary_emb.inv_freq``, ``position_ids``), as ``transformers`` adds them: GPT-2's Hub
    files hold every layer's ``attn.bias``, Llama-era ones each layer's ``inv_freq``.

    >>> import torch
    >>> class Old(torch.nn.Linear):
    ...     _keys_to_ignore_on_load_unexpected = [r"attn\.bias"]
    >>> missing, unexpected = ignored_on_load(Old(1, 1))
    >>> missing, bool(unexpected.search("h.0.attn.bias")), bool(unexpected.search("h.0.mlp.c_fc.bias"))
    (None, True, False)
    """
    missing: set[str] = set()
    unexpected: set[str] = set()
    for _, sub in module.named_modules():
        for attr, into in (("_keys_to_ignore_on_load_missing", missing), ("_keys_to_ignore_on_load_unexpected", unexpected)):
            value = getattr(sub, attr, None)
            if isinstance(value, (list, tuple, set, frozenset)):
                into.update(str(v) for v in value)
    buffers = [name for name, _ in module.named_buffers()]
    if missing or unexpected or is_transformers_model(module):  # transformers' two extra rules
        if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
            unexpected.add(r"rotary_emb\.inv_freq")
        if any(b.endswith("position_ids") for b in buffers):
            unexpected.add(r"(^|\.)position_ids$")

    def pattern(found: set[str]) -> re.Pattern[str] | None:
        return re.compile("|".join(f"(?:{p})" for p in sorted(found))) if found else None

    return pattern(missing), pattern(unexpected)


def is_transformers_model(module: object) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (never importing
    ``transformers``: where it is not imported, no model of it exists)."""
    base = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(module, base)


def float_dtypes(
    module: torch.nn.Module, dtype: torch.dtype | None
) -> tuple[Callable[[str], torch.dtype] | None, dict[str, torch.dtype] | None]:
    """The dtype ``from_pretrained(dtype=dtype)`` gives each floating-point key, as a function
    of the key (None where that is ``dtype`` for every key); and the dtype it gives each
    floating-point non-persistent buffer (None where that is not known: the buffers then
    keep the dtype the module built them in).

    ``from_pretrained`` builds the model under ``dtype`` as the default dtype, so a tensor
    the model builds in a dtype of its own (a router kept in float32 with
    ``nn.Linear(..., dtype=torch.float32)``, rotary ``inv_freq`` computed in float32) keeps
    it, and one built in the default dtype (a sinusoidal position table) takes ``dtype``;
    and it keeps the keys of :func:`keep_fp32_pattern` in float32. Both are found by
    building the model's class again on ``meta`` (no memory, no init) under that default;
    where that cannot be done (not a ``transformers`` model, or its class cannot be built
    from its config alone), every key takes ``dtype``.
    """
    if dtype is None:
        return None, None
    keep = keep_fp32_pattern(module, dtype)
    twin = _built_dtypes(module, dtype)
    built, buffers = twin if twin is not None else ({}, None)
    if keep is None and not built:
        return None, buffers

    def float_dtype(key: str) -> torch.dtype:
        if keep is not None and keep.search(key):
            return torch.float32
        return built.get(key, dtype)

    return float_dtype, buffers


def _built_dtypes(
    module: torch.nn.Module, dtype: torch.dtype
) -> tuple[dict[str, torch.dtype], dict[str, torch.dtype]] | None:
    """(key -> the floating-point dtype other than ``dtype`` the model's class builds it in
    under ``dtype`` as the default; non-persistent buffer -> the dtype it is built in, for
    every floating-point one), or None where the class cannot be built so."""
    from_config = getattr(type(module), "_from_config", None)
    config = getattr(module, "config", None)
    if not is_transformers_model(module) or not callable(from_config) or config is None:
        return None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin = from_config(copy.deepcopy(config), dtype=dtype)  # it sets the config's dtype
        tensors = dict(twin.state_dict())
        buffers = {full: b.dtype for full, _, _, b in non_persistent_buffers(twin) if b.dtype.is_floating_point}
    except Exception:  # a class that needs more than its config: every key takes dtype
        return None
    return {k: t.dtype for k, t in tensors.items() if t.dtype.is_floating_point and t.dtype != dtype}, buffers


def declared_ties(module: torch.nn.Module) -> dict[str, str]:
    """Tied key -> source key as the module declares them (``transformers``'
    ``all_tied_weights_keys``, which ``from_pretrained`` ties after loading); else empty."""
    ties = getattr(module, "all_tied_weights_keys", None)
    if not isinstance(ties, Mapping):
        return {}
    return {k: v for k, v in ties.items() if isinstance(k, str) and isinstance(v, str)}


def tensor_of(module: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str, torch.Tensor] | None:
    """(owner, name in it, tensor) of parameter or buffer ``key`` of ``module``; None where
    there is no such tensor."""
    owner_path, _, name = key.rpartition(".")
    try:
        owner = module.get_submodule(owner_path) if owner_path else module
    except AttributeError:
        return None
    tensor: torch.Tensor | None = _slot(owner, name).get(name)
    return None if tensor is None else (owner, name, tensor)


def _slot(owner: torch.nn.Module, name: str) -> dict[str, Any]:
    """The dict of ``owner`` that holds its tensor ``name``: its parameters or its buffers."""
    return owner._parameters if name in owner._parameters else owner._buffers


def non_persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """(full name, owning module, name in the owner, buffer) of every non-persistent buffer,
    each owner once."""
    for path, owner in module.named_modules():
        for name in sorted(owner._non_persistent_buffers_set):
            buffer = owner._buffers.get(name)
            if buffer is not None:
                yield (f"{path}.{name}" if path else name), owner, name, buffer


def _initializer(root: torch.nn.Module, owner_path: str) -> Callable[[torch.nn.Module], Any] | None:
    """``_init_weights`` of the nearest module on the path from ``root`` to the owner that
    has one (a ``transformers`` model, a composite model's sub-model), or None."""
    chain = [root]
    node = root
    for part in owner_path.split(".") if owner_path else []:
        node = getattr(node, part)
        chain.append(node)
    for module in reversed(chain):
        init = getattr(module, "_init_weights", None)
        if callable(init):
            return init
    return None


def _init_guard() -> contextlib.AbstractContextManager[Any]:
    """``transformers``' guard that makes ``torch.nn.init`` skip tensors marked as
    initialized (only when ``transformers`` is already imported: a model of it is here)."""
    init_module = sys.modules.get("transformers.initialization")
    guard = getattr(init_module, "guard_torch_init_functions", None)
    return guard() if callable(guard) else contextlib.nullcontext()


def rebuild_buffers(
    root: torch.nn.Module, owner_path: str, owner: torch.nn.Module, names: list[str]
) -> dict[str, torch.Tensor]:
    """Recompute the meta non-persistent buffers ``names`` of ``owner`` on the CPU, through
    the model's own ``_init_weights(owner)``; the ones it rebuilt, by name. Parameters the
    model leaves out of its files (``_keys_to_ignore_on_save``: Marian's sinusoidal
    position tables) are rebuilt the same way.

    Every other tensor of ``owner`` is marked ``_is_hf_initialized`` for the call (so the
    initializer leaves loaded weights alone, as in ``from_pretrained``), and the call runs
    twice, the buffers filled first with 0 then with 1: a buffer counts as rebuilt only if
    both runs give the same values (every element written, deterministically). The owner
    is left as it was; the caller assigns the values.
    """
    init = _initializer(root, owner_path)
    if init is None:
        return {}
    originals: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = _slot(owner, name)[name]
        assert tensor is not None
        originals[name] = tensor
    marked: list[torch.Tensor] = []
    others = [t for n, t in [*owner._parameters.items(), *owner._buffers.items()] if n not in originals]
    for tensor in others:
        if tensor is not None and not getattr(tensor, "_is_hf_initialized", False):
            tensor._is_hf_initialized = True  # type: ignore[attr-defined]
            marked.append(tensor)
    runs: list[dict[str, torch.Tensor]] = []
    try:
        for fill in (0, 1):
            for name, meta in originals.items():
                value = torch.full(meta.shape, fill, dtype=meta.dtype)
                is_param = isinstance(meta, torch.nn.Parameter)
                _slot(owner, name)[name] = torch.nn.Parameter(value, requires_grad=False) if is_param else value
            with torch.no_grad(), _init_guard():
                init(owner)
            runs.append({n: t.detach() for n in names if (t := _slot(owner, n)[n]) is not None})
    except Exception:  # an initializer that cannot run on this module rebuilds nothing
        runs = []
    finally:
        for name, meta in originals.items():
            _slot(owner, name)[name] = meta
        for tensor in marked:
            del tensor._is_hf_initialized  # type: ignore[attr-defined]
    if len(runs) != 2:
        return {}
    first, second = runs
    return {
        name: second[name]
        for name, meta in originals.items()
        if isinstance(first.get(name), torch.Tensor)
        and isinstance(second.get(name), torch.Tensor)
        and not first[name].is_meta
        and first[name].shape == meta.shape
        and first[name].dtype == second[name].dtype
        and torch.equal(first[name], second[name])
    }


_PLACEMENT_ARGS = frozenset({"device", "dtype"})


def rebuild_by_constructor(owner: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Recompute the meta non-persistent buffers ``names`` of ``owner`` by running its
    class's constructor again on the CPU (parameters straight to ``meta``), with each
    constructor argument taken from the owner's attribute of the same name; the ones it
    rebuilt, by name.

    Only where every argument (but ``device`` / ``dtype``, left to their defaults) is such
    an attribute: a default cannot be trusted, since the owner may have been built with
    another value. The constructor runs twice, and a buffer counts only if both runs give
    it the same values, shape and dtype as the meta one, non-persistent.
    """
    from ._stateful import empty_model

    cls = type(owner)
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return {}
    kwargs: dict[str, Any] = {}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name in _PLACEMENT_ARGS:
            continue
        if param.kind == param.POSITIONAL_ONLY or name not in vars(owner):
            return {}
        kwargs[name] = vars(owner)[name]
    runs = []
    try:
        for _ in range(2):
            with torch.device("cpu"):
                runs.append(empty_model(cls, **kwargs))
    except Exception:  # a constructor that cannot run again rebuilds nothing
        return {}
    out = {}
    for name in names:
        meta = owner._buffers[name]
        values = [run._buffers.get(name) for run in runs]
        first, second = values
        if (
            meta is not None and first is not None and second is not None
            and all(name in run._non_persistent_buffers_set for run in runs)
            and not first.is_meta
            and first.shape == second.shape == meta.shape
            and first.dtype == second.dtype == meta.dtype
            and torch.equal(first, second)
        ):
            out[name] = first
    return out


def module_tensors(module: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name (tied ones under each name)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        out[name] = param
    for name, buffer in module.named_buffers(remove_duplicate=False):
        out[name] = buffer
    return out


def self_loading(module: torch.nn.Module, targets: Mapping[str, torch.Tensor],
                 everything: Mapping[str, torch.Tensor]) -> dict[str, torch.nn.Module]:
    """Submodules whose own ``load_state_dict`` must load them (key prefix, ``"sub.sub."``
    or ``""`` for ``module`` itself -> submodule; outermost ones only): filling their state
    dict's tensors in place would not load them, or not the way they load.

    That is a module whose class writes its own ``_save_to_state_dict`` (its state dict may
    hold values it computes: packed or quantized layers) or ``_load_from_state_dict``
    (QAT observers resize their buffers there; a lazy module materializes), except the
    batch norms, whose own code only supplies a default; one holding a parameter not yet
    materialized (``nn.LazyLinear``); one keeping an extra state (``get_extra_state``,
    as Transformer Engine's FP8 layers do); and the owner of a state-dict tensor that is no
    parameter or buffer of ``module`` (a state-dict hook's computed value).

    >>> class Packed(torch.nn.Linear):
    ...     def _save_to_state_dict(self, destination, prefix, keep_vars):
    ...         destination[prefix + "weight"] = self.weight.detach().half()
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), Packed(2, 2))
    >>> sorted(self_loading(net, net.state_dict(keep_vars=True), module_tensors(net)))
    ['1.']
    """
    base = torch.nn.Module
    modules = dict(module.named_modules(remove_duplicate=False))
    found: set[str] = set()
    for path, sub in modules.items():
        cls = type(sub)
        own_load = cls._load_from_state_dict is not base._load_from_state_dict and not isinstance(sub, _IN_PLACE_LOADERS)
        lazy = any(torch.nn.parameter.is_lazy(t) for t in [*sub._parameters.values(), *sub._buffers.values()]
                   if t is not None)
        extra = cls.get_extra_state is not base.get_extra_state  # a non-tensor state only its own code sets
        if own_load or cls._save_to_state_dict is not base._save_to_state_dict or lazy or extra:
            found.add(path)
    real = {id(t) for t in everything.values()}
    for key, tensor in targets.items():
        if id(tensor) not in real:  # a value the state dict computes: its module's own code loads it
            owner = key.rpartition(".")[0]
            while owner and owner not in modules:
                owner = owner.rpartition(".")[0]
            found.add(owner)
    outermost = {p for p in found if not any(q == "" or p.startswith(q + ".") for q in found if q != p)}
    return {f"{p}." if p else "": modules[p] for p in sorted(outermost)}


_IN_PLACE_LOADERS = (torch.nn.modules.batchnorm._NormBase,)
"""torch classes whose own ``_load_from_state_dict`` only fills in a missing default
(``num_batches_tracked`` of an old checkpoint): their tensors load in place like any."""


def offloaded(module: torch.nn.Module) -> str | None:
    """The name of the first submodule of ``module`` that accelerate has offloaded (its
    weights held in a hook's ``weights_map`` and put back at every forward: ``cpu_offload``,
    ``disk_offload``, ``from_pretrained`` with a ``device_map`` sending modules to ``"cpu"``
    or ``"disk"`` beside a GPU), or None."""
    for path, sub in module.named_modules():
        hook = getattr(sub, "_hf_hook", None)
        for one in [hook, *getattr(hook, "hooks", ())]:
            if getattr(one, "offload", False) and getattr(one, "weights_map", None) is not None:
                return path
    return None


def refused_shapes(module: torch.nn.Module, owner: str, wanted: Mapping[str, str], comp: Any,
                   targets: Mapping[str, Any]) -> list[str]:
    """Keys (under ``owner``) whose saved shape a self-loading module's own loader refuses,
    found before anything is read: its ``load_state_dict`` is tried on a copy of it on the
    ``meta`` device, given ``meta`` tensors of the saved shapes (a QAT observer resizes its
    buffers there and takes them; a weight of another shape is refused). Where the copy
    cannot be made or its error names no key, the keys whose saved shape differs from the
    target's are the refused ones when the loader refuses at all."""
    if not wanted or any(torch.nn.parameter.is_lazy(t) for t in module_tensors(module).values()):
        return []  # a lazy module takes any shape once (and moved to meta it would have one: [0])
    probes: dict[str, torch.Tensor] = {}
    for key, stored in wanted.items():
        record = comp.tensors[stored]
        dtype = as_dtype(record.dtype)
        if dtype is None:
            return []
        probes[key[len(owner):]] = torch.empty(tuple(record.shape), dtype=dtype, device="meta")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            copy.deepcopy(module).to("meta").load_state_dict(probes, strict=False)
    except (RuntimeError, ValueError) as exc:
        named = [owner + m for m in re.findall(r"size mismatch for (\S+?):", str(exc)) if owner + m in wanted]
        if named:
            return named
        return [k for k, stored in wanted.items()
                if isinstance(targets.get(k), torch.Tensor) and not torch.nn.parameter.is_lazy(targets[k])
                and tuple(targets[k].shape) != tuple(comp.tensors[stored].shape)]
    except Exception:  # the copy itself (a module deepcopy cannot take): its own loader decides later
        return []
    return []

