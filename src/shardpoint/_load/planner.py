"""The planner of ``load_into``: walks a target beside the saved tree and plans every read.

A planning pass that touches no data: each target tensor is matched to its saved tensor (a
base-model prefix renamed where that matches more, ties kept), meta tensors get their new
memory, and every read goes into one batch; the fix-ups that change the target (new
parameters, ``load_state_dict`` of rebuilt values) run only after the batch has run, so
``strict=True`` can refuse a mismatch before a byte of the target changes.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _hf_conversions, _module_fit
from .._distributed.group import local_chunk
from .._flatten import WRAPPER_TYPES, tree_tensor_names, unflatten_state
from .._format.manifest import ComponentRecord
from .._io.memory import storage_less
from .._prepare import storage_key
from .._read import ReadBatch
from .._stateful import (
    Stateful,
    fields_of,
    optimizer_state_for,
    renamed_parameter_names,
    state_objects,
)
from ..errors import CheckpointError, InvalidStateError, LoadMismatchError
from . import fusions
from .memory import allocate
from .pickled import PickledBatch
from .result import no_match_message


def identities(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Keys under which two tensors are the same memory: the same object, or the same view
    of the same storage (looked up in sets and dicts: a model of thousands of tensors must
    not compare every pair)."""
    key = None if storage_less(tensor) else storage_key(tensor)
    return (id(tensor),) if key is None else (id(tensor), key)


def identity_table(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, ...]]:
    """:func:`identities` of every tensor of ``tensors``, by key. A plain tensor whose
    first element's address no other tensor of ``tensors`` shares cannot be the same memory
    as any of them: it is known by its ``id`` alone, without :func:`identities`' per-tensor
    work (a flat state of 10^5 small tensors is 10^5 such)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    address = {k: t.data_ptr() if type(t) in plain else 0 for k, t in tensors.items()}
    shared = Counter(address.values())
    return {
        k: (id(t),) if (a := address[k]) and shared[a] == 1 else identities(t)
        for k, t in tensors.items()
    }


def _partial_overlap(targets: Mapping[str, torch.Tensor], keys: list[str],
                     ids: Mapping[str, tuple[Any, ...]]) -> tuple[str, str] | None:
    """Two keys of ``targets`` whose tensors share some memory without being one tensor
    (``x[0:10]`` and ``x[5:15]``), or None. Spans are sorted by address (a model's tensors
    rarely meet: a pass over them); views whose spans chain together (the column halves
    ``W[:, :8]`` and ``W[:, 8:]`` of a fused weight) are checked element by element, each
    group in one pass over its memory."""
    spans = []
    for key in keys:
        t = targets[key]
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta or t.numel() == 0:
            continue
        spans.append((*_byte_span(t), key))
    spans.sort()
    group: list[str] = []
    reach = 0
    for start, end, key in spans:
        if group and start >= reach:
            if len(group) > 1 and (found := _overlap_within(targets, group, ids)):
                return found
            group = []
        reach = max(reach, end) if group else end
        group.append(key)
    return _overlap_within(targets, group, ids) if len(group) > 1 else None


def _overlap_within(targets: Mapping[str, torch.Tensor], group: list[str],
                    ids: Mapping[str, tuple[Any, ...]]) -> tuple[str, str] | None:
    """Two keys of ``group`` (views whose spans chain together, in address order) that share
    an element and are not one tensor, or None: the views mark the elements they cover in
    one bitmap of the group's span, each checking first that none is marked yet."""
    views = list({ids[key]: key for key in reversed(group)}.values())[::-1]  # ties are one tensor
    if len(views) < 2:
        return None
    first = targets[views[0]]
    item, base = first.element_size(), _byte_span(first)[0]
    if any(targets[k].dtype != first.dtype or targets[k].device.type != "cpu"
           or (targets[k].data_ptr() - base) % item for k in views):
        return views[0], views[1]  # not told apart here (the first two meet): taken as sharing
    top = max(_byte_span(targets[k])[1] for k in views)
    marked = torch.zeros((top - base) // item, dtype=torch.bool)
    for i, key in enumerate(views):
        t = targets[key]
        region = marked.as_strided(tuple(t.shape), tuple(t.stride()), (t.data_ptr() - base) // item)
        if bool(region.any()):
            return next((o for o in views[:i] if _share_an_element(targets[o], t)), views[0]), key
        region.fill_(True)
    return None


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses of a view's first byte and one past its last (strides are not negative)."""
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _share_an_element(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one dtype on the CPU share an element (the error's pair)."""
    item = a.element_size()
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    base = min(a_start, b_start)
    counts = torch.zeros((max(a_end, b_end) - base) // item, dtype=torch.int16)
    try:
        for x in (a, b):
            counts.as_strided(tuple(x.shape), tuple(x.stride()), (x.data_ptr() - base) // item).add_(1)
    except RuntimeError:  # a view that overlaps itself (expand): refused elsewhere
        return True
    return bool((counts > 1).any())


def _assign(module: torch.nn.Module, name: str, value: torch.Tensor) -> bool:
    """Replace parameter/buffer ``name`` of ``module`` by ``value``; False if not found."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        return False
    if leaf in owner._parameters:
        owner._parameters[leaf] = value  # type: ignore[assignment]
        return True
    if leaf in owner._buffers:
        owner._buffers[leaf] = value
        return True
    return False


def _writable(tensor: torch.Tensor, key: str) -> torch.Tensor:
    """``tensor``, refused where several of its elements are one memory location (an
    ``expand()``-ed view): no load can give each element its own value there."""
    overlap = torch._debug_has_internal_overlap(tensor)
    if overlap == 2:  # torch cannot tell: strides that nest without overlap are fine
        dims = sorted((st, n) for n, st in zip(tensor.shape, tensor.stride(), strict=True) if n > 1)
        reach = 0
        overlap = 0
        for stride, size in dims:
            if stride <= reach:
                overlap = 1
                break
            reach += (size - 1) * stride
    if overlap == 1:
        raise InvalidStateError(
            f"target tensor {key!r} has elements that share one memory location (an expand()-ed "
            "or overlapping view); load into a tensor of its own (.clone() it first)"
        )
    return tensor


_EXTRA_STATE = "_extra_state"
"""The state-dict key suffix of a module's ``get_extra_state`` value."""


def _parameter_like(meta: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """A parameter holding ``data`` in place of the meta parameter ``meta``: of its class (a
    ``Parameter`` subclass), with its attributes, as accelerate's
    ``set_module_tensor_to_device`` gives it; a plain ``Parameter`` where the class cannot
    be built that way."""
    made: Any = None
    for extra in ({**vars(meta)}, {}):  # a constructor taking its attributes (scale=...), then one that does not
        try:
            made = type(meta)(data, requires_grad=meta.requires_grad, **extra)
            break
        except (TypeError, RuntimeError):
            continue
    if not isinstance(made, torch.nn.Parameter):
        made = torch.nn.Parameter(data, requires_grad=meta.requires_grad)
    if type(made) is not type(meta):
        warnings.warn(
            f"a parameter of class {type(meta).__name__} (on the meta device) could not be rebuilt as one from its "
            "values and attributes; it is now a torch.nn.Parameter holding them", UserWarning, stacklevel=2)
    made.__dict__.update(vars(meta))
    return made


def _like(meta: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` in place of the meta buffer ``meta``: of its tensor subclass, with its attributes."""
    if type(meta) is torch.Tensor or isinstance(meta, torch.nn.Parameter):
        return data
    made = data.as_subclass(type(meta))
    made.__dict__.update(vars(meta))
    return made


def _copy_into(tensor: torch.Tensor, value: torch.Tensor, key: str) -> None:
    """Give a tensor with no memory of its own (a wrapper subclass) its values through its
    own ``copy_``, as ``load_state_dict`` does."""
    try:
        with torch.no_grad():
            tensor.copy_(value)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise InvalidStateError(
            f"target tensor {key!r} is a {type(tensor).__name__} (a tensor subclass with no memory of its own), and "
            f"its copy_ refused the checkpoint's values: {' '.join(str(exc).split())[:300]}. The target may now "
            "hold part of this checkpoint's values: load into plain tensors (sp.load) and convert them yourself"
        ) from exc




def _holds_live(value: Any) -> bool:
    """Whether ``value`` (a container, a Namespace, a dataclass) holds something a load fills
    in place: a module, an optimizer or a tensor (a few levels down)."""
    live = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)
    return any(isinstance(v, live) for _, v in state_objects(value, depth=5))


def _item_setter(
    container: MutableMapping[Any, Any] | MutableSequence[Any], key: Any
) -> Callable[[Any], None]:
    """A callback that stores its argument as ``container[key]``."""

    def store(value: Any) -> None:
        container.__setitem__(key, value)

    return store


def _placement(
    key: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None,
    device_map: Mapping[str, Any], float_dtype: Callable[[str], torch.dtype] | None = None,
) -> tuple[torch.device, torch.dtype]:
    """Device and dtype for materializing meta tensor ``key``: the longest matching
    ``device_map`` prefix (module names, as Accelerate's), else ``device``; ``dtype`` for a
    floating-point tensor (``float_dtype(key)`` where the model says otherwise, e.g. its
    fp32-kept modules), else its own."""
    best = -1
    for prefix, target in device_map.items():
        if (prefix == "" or key == prefix or key.startswith(prefix + ".")) and len(prefix) > best:
            best, device = len(prefix), torch.device(target)
    want = tensor.dtype
    if dtype is not None and tensor.dtype.is_floating_point:
        want = dtype if float_dtype is None else float_dtype(key)
    return device, want


_FRACTIONAL = ("F", "BF", "C")
"""Safetensors dtype codes of floating-point (F16, F32, BF16, F8_E4M3, ...) and complex values."""


def _drops_values(stored: str | torch.dtype, target: torch.dtype) -> bool:
    """Whether copying values stored as ``stored`` (a safetensors dtype code, or the dtype
    of a ``.bin`` file's tensor) into a tensor of dtype ``target`` drops part of each value:
    a fraction into an integer or bool, an imaginary part into a real dtype.

    >>> _drops_values("F32", torch.int64), _drops_values("BF16", torch.bool), _drops_values("C64", torch.float32)
    (True, True, True)
    >>> _drops_values("I64", torch.float32), _drops_values("F32", torch.bfloat16), _drops_values("BOOL", torch.int8)
    (False, False, False)
    """
    if isinstance(stored, torch.dtype):
        complex_, fractional = stored.is_complex, stored.is_floating_point or stored.is_complex
    else:
        complex_, fractional = stored.startswith("C"), stored.startswith(_FRACTIONAL)
    if complex_:
        return not target.is_complex
    return fractional and not (target.is_floating_point or target.is_complex)


@dataclass
class _ModuleLoad:
    """What the planner knows about the module it is filling."""

    module: torch.nn.Module
    empty: bool
    """Some parameter or buffer was on ``meta``: its buffers go where ``device=`` /
    ``device_map`` say, like its parameters (an empty model has no other placement)."""
    float_dtype: Callable[[str], torch.dtype] | None = None
    """The dtype ``dtype=`` gives each floating-point key of this model (see
    :func:`_module_fit.float_dtypes`); None: ``dtype`` itself."""
    buffer_dtypes: dict[str, torch.dtype] | None = None
    """The dtype ``dtype=`` gives each floating-point non-persistent buffer (the one the
    model's class builds it in under that default dtype, as ``from_pretrained`` builds it);
    None: each keeps the dtype it was built in."""
    declared_ties: dict[str, str] = field(default_factory=dict)
    """Target key -> the key it is tied to, as the model declares (``transformers``'
    ``all_tied_weights_keys``): one absent from the checkpoint gets its twin's tensor."""
    materialized: set[str] = field(default_factory=set)
    """Keys given a new tensor by this load (meta ones among them)."""
    rebuild: set[str] = field(default_factory=set)
    """Keys the checkpoint lacks that the model lets be (``_keys_to_ignore_on_load_missing``):
    a buffer of them on ``meta`` is rebuilt through the model's init, like a non-persistent one."""
    fused: set[str] = field(default_factory=set)
    """Keys a ``transformers`` conversion makes from other checkpoint tensors (filled after
    the batch, by :meth:`Planner.run_fusions`)."""


class Planner:
    """Walks a target beside the saved trees; records reads, report entries and fix-ups."""

    def __init__(self, location: str, batch: ReadBatch | PickledBatch, *, allow_pickle: bool,
                 device: torch.device, dtype: torch.dtype | None, device_map: Mapping[str, Any]) -> None:
        self.location = location
        self.batch = batch
        self.allow_pickle = allow_pickle
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.meta_left: list[str] = []
        self.kept_off: list[str] = []  # on meta because the device map sends them there
        self.prefix_mapping: dict[str, tuple[str, str]] = {}
        self.post: list[Callable[[], None]] = []
        self.in_place: list[torch.Tensor] = []
        """Target tensors the batch fills in place: their autograd version is bumped after,
        as ``copy_`` bumps it (a graph built before the load refuses to backward)."""
        self.checks: list[Callable[[], None]] = []
        """Run once planning is done, before anything is read: refusals that need the whole plan."""
        self.param_names: dict[int, str] = {}
        self.modules: list[tuple[str, torch.nn.Module]] = []
        """The target's modules (key, module), whose parameters ``param_names`` names."""
        self.device = device
        self.dtype = dtype
        self.device_map = dict(device_map)
        self.extras: dict[str, dict[str, Any]] = {}
        """Saved non-tensor entries of the module being planned (key -> tree node): the
        extra states its self-loading submodules take (the rest is reported unexpected)."""
        self.fusions: list[fusions.PlannedFusion] = []
        """Groups of checkpoint tensors a ``transformers`` conversion fuses: each read and
        combined after the batch, on its own (:mod:`.fusions`)."""

    def placement(self, key: str, tensor: torch.Tensor, float_dtype: Callable[[str], torch.dtype] | None = None
                  ) -> tuple[torch.device, torch.dtype]:
        return _placement(key, tensor, self.device, self.dtype, self.device_map, float_dtype)

    # A subtree read into new tensors, turned into a value after the batch ran.
    def build(self, comp: ComponentRecord, node: dict[str, Any], apply: Callable[[Any], None], path: str) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for name in tree_tensor_names(node):
            stored = comp.aliases.get(name, name)
            if stored not in tensors:
                tensors[stored] = self.batch.new(comp.tensors[stored], stored, device=torch.device("cpu"), dtype=None)
            tensors[name] = tensors[stored]
        where = f"{self.location}, {path}"
        allow = self.allow_pickle
        self.post.append(lambda: _apply_saved(apply, unflatten_state(node, tensors, where=where, allow_pickle=allow), where))

    def _new_home(self, key: str, tensor: torch.Tensor, fit: _ModuleLoad | None
                  ) -> tuple[torch.device, torch.dtype] | None:
        """Where a target tensor must be replaced by a new one (device, dtype), or None to
        fill it in place: a meta tensor; a floating-point one of another dtype than
        ``dtype=`` asks; a buffer of an empty model away from its placement."""
        if fit is None and not tensor.is_meta:
            return None  # a plain dict's tensor: filled where it is (asked per tensor: no placement)
        device, want = self.placement(key, tensor, fit.float_dtype if fit else None)
        if tensor.is_meta:
            return device, want
        if fit is None:
            return None  # a plain dict's tensor: filled where it is
        if type(tensor).__name__ == "DTensor" or storage_less(tensor):  # sharded, or a wrapper subclass
            # Refused where the dtype asked for is not the DTensor's (a key transformers keeps in
            # float32 in a model converted whole before sharding is the model's choice: cast into it).
            if want != tensor.dtype and self.dtype is not None and want == self.dtype:
                raise InvalidStateError(
                    f"dtype= asks for {want} but target tensor {key!r} is a {type(tensor).__name__} of "
                    f"{tensor.dtype}, which is filled where it is and keeps its dtype (FSDP2 and tensor parallelism "
                    "hold their parameters so): convert the model before sharding it (model.to(dtype) before "
                    "fully_shard), or load without dtype= (the checkpoint's values are cast to the target's dtype)"
                )
            return None
        if not (fit.empty and not isinstance(tensor, torch.nn.Parameter)) or device.type == "meta":
            device = tensor.device
        if device == tensor.device and want == tensor.dtype:
            return None
        return device, want

    def tensors_into(self, targets: Mapping[str, torch.Tensor], names: Mapping[str, str],
                     comp: ComponentRecord, prefix: str, module: torch.nn.Module | None,
                     fit: _ModuleLoad | None = None, saved_names: Mapping[str, str] | None = None,
                     also: Mapping[str, list[tuple[str, str]]] | None = None) -> None:
        """Fill target tensors in place; ``names`` maps a target key to its saved tensor name.

        ``saved_names`` (saved tensor name -> the key it has in the checkpoint's tree) names
        the unexpected keys when ``names`` was renamed; by default they are ``names``' keys.
        ``also``: target key -> (checkpoint key, stored name) of the other stored tensors the
        conversions load into it, read aside and compared with what it gets.
        """
        matched = []
        lossy: list[tuple[str, str | torch.dtype, torch.dtype]] = []
        inference = not torch.is_inference_mode_enabled()
        for key, tensor in targets.items():
            saved = names.get(key)
            if saved is None:
                continue
            if inference and tensor.is_inference() and not tensor.is_meta and self._new_home(key, tensor, fit) is None:
                raise InvalidStateError(  # filled in place (a new tensor in its place is any tensor)
                    f"target tensor {prefix + key!r} was made under torch.inference_mode(), and torch lets such "
                    "a tensor change only inside it: call load_into inside `with torch.inference_mode():`, or "
                    "build the target outside it; nothing was loaded"
                )
            record = comp.tensors[comp.aliases.get(saved, saved)]
            if tensor.shape != record.shape:
                self.mismatched.append((prefix + key, record.shape, tuple(tensor.shape)))
                continue
            matched.append(key)
            # A module's buffers are left to torch's copy rules: a mask saved as float32 loads
            # into a bool buffer, as load_state_dict and from_pretrained load it.
            if (module is None or isinstance(tensor, torch.nn.Parameter)) and _drops_values(record.dtype, tensor.dtype):
                lossy.append((key, record.dtype, tensor.dtype))
        if lossy:
            shown = ", ".join(f"{prefix + k!r} ({str(stored).removeprefix('torch.')} -> {str(want).removeprefix('torch.')})"
                              for k, stored, want in lossy[:5])
            more = f" and {len(lossy) - 5} more" if len(lossy) > 5 else ""
            raise LoadMismatchError(
                f"{self.location}: {shown}{more}: stored as floating-point or complex values, and the "
                "target tensor is of an integer, bool or real dtype; copying would drop the fraction "
                "or the imaginary part. Make the target that dtype, or read the values with sp.load "
                "and convert them yourself; nothing was loaded"
            )
        ids = identity_table(targets)  # asked again below: once each
        overlap = _partial_overlap(targets, matched, ids)
        if overlap is not None:
            raise LoadMismatchError(
                f"{self.location}: {prefix + overlap[0]!r} and {prefix + overlap[1]!r} share part of their memory in "
                "the target (overlapping views of one storage, not one tensor): loading both would leave one "
                "holding part of the other's values. Give each memory of its own (.clone()), or read the "
                "checkpoint with sp.load and copy what you need; nothing was loaded"
            )
        first_with: dict[Any, str] = {}
        for m in matched:
            for ident in ids[m]:
                first_with.setdefault(ident, m)
        tied: dict[str, str] = {}  # target key absent from the checkpoint -> matched key it is tied to
        to_tie: list[str] = []  # tied by the model's declaration only: made to share the twin's tensor
        is_matched = set(matched)
        for key in targets:
            if key in names:
                continue
            twin = next((first_with[i] for i in ids[key] if i in first_with), None)
            declared = (fit.declared_ties if fit is not None else {}).get(key)
            if twin is None and declared in is_matched and targets[key].shape == targets[declared].shape:
                twin = declared  # e.g. built by accelerate.init_empty_weights, which unties them
                to_tie.append(key)
            if twin is None:
                self.missing.append(prefix + key)
            else:
                tied[key] = twin
        for key in to_tie:
            if fit is not None and self._new_home(tied[key], targets[tied[key]], fit) is None:
                self._assign_later(fit.module, key, targets[tied[key]])
                fit.materialized.add(key)
        if saved_names is None:
            self.unexpected.extend(prefix + k for k in names if k not in targets)
        else:
            used = set(names.values())
            self.unexpected.extend(prefix + tree_key for saved, tree_key in saved_names.items() if saved not in used)

        filled: dict[Any, tuple[str, str]] = {}  # storage identity -> (key, stored name) filling it
        materialized: dict[int, tuple[torch.Tensor, str, str, torch.Tensor]] = {}  # + key, stored, buffer filled
        for key in matched:
            tensor = targets[key]
            saved = names[key]
            stored = comp.aliases.get(saved, saved)
            record = comp.tensors[stored]
            home = self._new_home(key, tensor, fit)
            if home is not None and type(tensor).__name__ == "DTensor":
                raise InvalidStateError(
                    f"target tensor {prefix + key!r} is a DTensor on the meta device (a model sharded before its "
                    "weights had memory): a new tensor in its place would not be the shard FSDP or tensor "
                    "parallelism manages. Give the sharded model its memory first, model.to_empty(device=...) "
                    "(as torch's FSDP2 docs do), then load_into fills each rank's shard; nothing was loaded"
                )
            if home is not None:
                if module is None:
                    raise InvalidStateError(
                        f"target tensor {prefix + key!r} is on the meta device; pass the module itself"
                    )
                earlier = materialized.get(id(tensor))
                value = None if earlier is None else earlier[0]
                if earlier is not None and earlier[2] != stored:
                    self._same_values(earlier[3], record, stored, prefix, earlier[1], key)
                if value is None:
                    device, dtype = home
                    if device.type == "meta":
                        continue  # the device map keeps it off this process
                    if isinstance(self.batch, ReadBatch):
                        self.batch.check(record, stored)  # every chunk against its file, before allocating
                    new = allocate(tuple(tensor.shape), dtype, device, self.location, stored)
                    self.batch.fill(record, new, stored)
                    if isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
                        # A real parameter keeps its identity (optimizers, hooks): new data only.
                        self.post.append(functools.partial(setattr, tensor, "data", new))
                        value = tensor
                    elif isinstance(tensor, torch.nn.Parameter):
                        value = _parameter_like(tensor, new)
                    else:
                        value = _like(tensor, new)
                    materialized[id(tensor)] = (value, key, stored, new)
                for k in [key, *(t for t, twin in tied.items() if twin == key)]:
                    if fit is not None:
                        fit.materialized.add(k)
                    if targets[k] is value:
                        continue  # the same object, given its new data above
                    self.post.append(functools.partial(self.assign_now, module, k, value))
                continue
            idents = ids[key]
            first = None
            for ident in idents:  # one, but for views of a storage
                first = filled.get(ident)
                if first is not None:
                    break
            if first is not None:  # tied to a tensor already being filled
                if first[1] != stored and type(tensor).__name__ == "DTensor":  # another stored tensor: same values?
                    _global_shape, region, local = local_chunk(tensor)  # (each rank its own region)
                    self._same_values(local.detach(), record, stored, prefix, first[0], key, offsets=region)
                elif first[1] != stored:
                    self._same_values(tensor.detach(), record, stored, prefix, first[0], key)
                continue
            for ident in idents:
                filled[ident] = (key, stored)
            if storage_less(tensor) or tensor.is_conj() or tensor.is_neg():
                # A wrapper subclass, or a view whose conjugate / negative bit is lazy (its
                # memory holds other values than it shows): read aside, given by its copy_.
                value = self.batch.new(record, stored, device=torch.device("cpu"), dtype=None)
                self.post.append(functools.partial(_copy_into, tensor, value, prefix + key))
            elif type(tensor).__name__ == "DTensor":
                _global_shape, offsets, local = local_chunk(tensor)
                self.batch.fill(record, _writable(local.detach(), prefix + key), stored, offsets)
                self.in_place.append(local)
            else:
                self.batch.fill(record, _writable(tensor.detach(), prefix + key), stored)
                self.in_place.append(tensor)
        for key, others in (also or {}).items():
            if key not in is_matched:
                continue
            tensor = targets[key]
            earlier = materialized.get(id(tensor))
            at: tuple[int, ...] | None = None
            holds: torch.Tensor | None
            if earlier is not None:
                holds = earlier[3]
            elif self._new_home(key, tensor, fit) is not None:
                holds = None  # kept off this process by the device map
            elif type(tensor).__name__ == "DTensor":
                _global_shape, at, local = local_chunk(tensor)
                holds = local.detach()
            else:
                holds = tensor.detach()
            for checkpoint_key, stored in others:
                if holds is not None:
                    record = comp.tensors[comp.aliases.get(stored, stored)]
                    self._same_values(holds, record, stored, prefix, names[key], key, offsets=at,
                                      twice=checkpoint_key)

    def _same_values(self, filled: torch.Tensor, record: Any, stored: str, prefix: str, first: str,
                     key: str, *, offsets: tuple[int, ...] | None = None, twice: str | None = None) -> None:
        """``key`` and ``first`` name one tensor of the target (tied) but two stored tensors:
        read ``stored`` aside and, once the load has run, refuse the load if its values are not
        those ``first`` read into ``filled`` (one of the two would be dropped without a word).
        ``twice``: instead, ``key`` is one target tensor that the checkpoint holds twice, as
        ``first`` (a stored name) and as checkpoint key ``twice``, both of which the model's
        conversions load into it. ``offsets``: where ``filled`` (a DTensor's shard) begins."""
        aside = allocate(tuple(filled.shape), filled.dtype, filled.device, self.location, stored)
        self.batch.fill(record, aside, stored, offsets)

        def compare() -> None:
            same = torch.equal(aside, filled) or (
                filled.is_floating_point() and bool(((aside == filled) | (aside.isnan() & filled.isnan())).all()))
            if not same and twice is not None:
                raise LoadMismatchError(
                    f"{self.location}: the checkpoint holds {prefix + key!r} twice, as {first!r} and as {twice!r} "
                    "(the model's weight conversions load both into it, as from_pretrained renames them), with "
                    "different values; loading both into one tensor would drop one. Keep one of the two in the "
                    "files (sp.load, delete one key, sp.save). The target may now hold part of this checkpoint's "
                    "values"
                )
            if not same:  # bit-identical copies holding NaN are the same values
                raise LoadMismatchError(
                    f"{self.location}: {prefix + first!r} and {prefix + key!r} share one tensor in the target "
                    f"(tied weights), but the checkpoint stores different values for them; loading both into one "
                    "tensor would drop one. Untie them in the target (for transformers: tie_word_embeddings=False "
                    "in the config), or load a checkpoint saved from a tied model. The target may now hold part "
                    "of this checkpoint's values"
                )

        self.post.insert(0, compare)

    def dict_into(self, targets: Mapping[str, torch.Tensor], names: Mapping[str, str], comp: ComponentRecord) -> None:
        """Fill a flat dict of tensors in place from a flat checkpoint (``names``: its keys ->
        saved tensor names); a dict of which no key at all matches is refused."""
        same = len(targets) == len(names) and all(k in names for k in targets)  # the usual case, at once
        rename = _module_fit.match_prefix(targets, names, wrappers_only=True) if targets and names and not same else None
        if rename is None:
            if targets and names and not any(k in names for k in targets):
                raise LoadMismatchError(no_match_message(self.location, "", list(targets), list(names)))
            self.tensors_into(targets, names, comp, "", None)
            return
        by_target = _module_fit.rename_keys(targets, names, rename)
        self.prefix_mapping[""] = rename  # saved under a wrapper (module., _orig_mod.), loaded into a plain dict
        self.tensors_into(targets, {k: names[s] for k, s in by_target.items()}, comp, "", None, None,
                          {v: k for k, v in names.items()})

    def module_into(self, target: torch.nn.Module, saved: Mapping[str, str], comp: ComponentRecord, path: str) -> None:
        """Fill a module from a saved state dict (its keys -> saved tensor names): keys
        renamed by a base-model prefix where that matches more, meta tensors materialized,
        non-persistent buffers rebuilt, and whatever stays on ``meta`` reported."""
        where = _module_fit.offloaded(target)
        if where is not None:
            raise InvalidStateError(
                f"{self.location}: module {where or type(target).__name__!r} of the target is offloaded by accelerate "
                "(its weights live in a hook's weights_map and are put back at every forward), so values loaded "
                "into its parameters would be undone by the next forward. Load into the model before offloading "
                "it (load_into, then accelerate's dispatch_model / cpu_offload), or remove the hooks first "
                "(accelerate.hooks.remove_hook_from_module(model, recurse=True)); nothing was loaded"
            )
        inner, wrapper = _module_fit.unwrapped(target)
        if inner is not target:
            targets = inner.state_dict(keep_vars=True)
            conversions = _hf_conversions.plan(inner, saved, targets, fusions.stored_shapes(saved, comp), self.location)
            if conversions is not None:
                self._wrapped_module_into(inner, wrapper, saved, comp, path, targets, conversions)
                return
        targets = target.state_dict(keep_vars=True)
        conversions = _hf_conversions.plan(target, saved, targets, fusions.stored_shapes(saved, comp), self.location)
        self._module_into(target, saved, comp, path, targets, conversions)

    def _module_into(self, target: torch.nn.Module, saved: Mapping[str, str], comp: ComponentRecord, path: str,
                     targets: dict[str, torch.Tensor], conversions: _hf_conversions.Conversions | None) -> None:
        """:meth:`module_into` of ``target`` itself, its state dict ``targets`` and the
        conversions its files need already known."""
        prefix = f"{path}/" if path else ""
        twice: dict[str, list[tuple[str, str]]] = {}
        everything = _module_fit.module_tensors(target)
        float_dtype, buffer_dtypes = _module_fit.float_dtypes(target, self.dtype)
        fit = _ModuleLoad(
            target,
            empty=any(t.device.type == "meta" for t in everything.values()),
            float_dtype=float_dtype,
            buffer_dtypes=buffer_dtypes,
            declared_ties=_module_fit.declared_ties(target),
        )
        if conversions is not None:  # a transformers 5 model, files in the Hub's names
            planned, wrong = fusions.plan(self.batch, conversions.fusions, saved, comp, target, targets,
                                          functools.partial(self._put_fused, fit, targets))
            fit.fused.update(k for f in conversions.fusions for k in f.outputs)
            self.fusions.extend(planned)
            self.mismatched.extend((prefix + k, made, have) for k, made, have in wrong)
            saved, twice = conversions.remaining(saved)
            targets = {k: t for k, t in targets.items() if k not in fit.fused}
        base = getattr(target, "base_model_prefix", None)
        rename = _module_fit.match_prefix(targets, saved, base if isinstance(base, str) else None)
        by_target = _module_fit.rename_keys(targets, saved, rename)
        if targets and saved and not by_target:
            raise LoadMismatchError(no_match_message(self.location, path, list(targets), list(saved)))
        if rename is not None:
            self.prefix_mapping[path] = rename
        names = {k: saved[s] for k, s in by_target.items()}
        also = {k: twice[s] for k, s in by_target.items() if s in twice}
        missing_from, unexpected_from = len(self.missing), len(self.unexpected)
        own = _module_fit.self_loading(target, targets, everything)
        claimed: set[str] = set()
        if own:
            targets, names = self._own_loads(own, targets, names, comp, prefix, fit)
            claimed = {prefix + by_target[k] for k in by_target if k not in targets}
        self.tensors_into(targets, names, comp, prefix, target, fit, {v: k for k, v in saved.items()}, also)
        if claimed:  # read for the modules that load themselves
            self.unexpected[unexpected_from:] = [k for k in self.unexpected[unexpected_from:] if k not in claimed]
        ignore_missing, ignore_unexpected = _module_fit.ignored_on_load(target)
        if ignore_unexpected is not None:  # never read; from_pretrained does not report them either
            self.unexpected[unexpected_from:] = [
                k for k in self.unexpected[unexpected_from:] if not ignore_unexpected.search(k[len(prefix):])]
        if ignore_missing is not None:  # kept as they are (on meta: rebuilt by the model's init, else reported)
            ignored = {k for k in self.missing[missing_from:] if ignore_missing.search(k[len(prefix):])}
            self.missing[missing_from:] = [k for k in self.missing[missing_from:] if k not in ignored]
            fit.rebuild.update(k[len(prefix):] for k in ignored)
        self._finish_module(fit, targets, prefix)

    def _own_loads(self, own: Mapping[str, torch.nn.Module], targets: dict[str, torch.Tensor],
                   names: dict[str, str], comp: ComponentRecord, prefix: str, fit: _ModuleLoad
                   ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Plan the submodules of ``own`` (key prefix -> module) that load themselves: their
        keys are read into new tensors and given to their own ``load_state_dict`` after the
        batch (QAT observers, packed and lazy layers). Returns the targets and names left to
        fill in place."""
        rest: dict[str, torch.Tensor] = {}
        values: dict[str, dict[str, torch.Tensor]] = {p: {} for p in own}
        read: dict[str, torch.Tensor] = {}
        missing: dict[str, set[str]] = {p: set() for p in own}
        wanted: dict[str, dict[str, str]] = {p: {} for p in own}  # target key -> stored name, by owner
        for key, tensor in targets.items():
            owner = next((p for p in own if key.startswith(p)), None)
            if owner is None:
                rest[key] = tensor
                continue
            fit.materialized.add(key)
            node = self.extras.pop(key, None) if key.endswith(_EXTRA_STATE) else None
            if node is not None:  # get_extra_state's value: built after the batch, then given with the rest
                self.build(comp, node, functools.partial(values[owner].__setitem__, key[len(owner):]),
                           prefix + key)
                continue
            if key not in names:
                self.missing.append(prefix + key)
                missing[owner].add(key[len(owner):])
                continue
            wanted[owner][key] = comp.aliases.get(names[key], names[key])
        for owner, module in own.items():
            for key in _module_fit.refused_shapes(module, owner, wanted[owner], comp, targets):
                stored = wanted[owner].pop(key)
                self.mismatched.append((prefix + key, comp.tensors[stored].shape, tuple(targets[key].shape)))
                missing[owner].add(key[len(owner):])  # left as it is: not for its loader to report
            for key, stored in wanted[owner].items():
                if stored not in read:
                    read[stored] = self.batch.new(comp.tensors[stored], stored, device=torch.device("cpu"), dtype=None)
                values[owner][key[len(owner):]] = read[stored]
        for owner, module in own.items():
            under = [k for k in targets if k.startswith(owner)]  # its own state dict's keys
            empty = any(isinstance(targets[k], torch.Tensor) and targets[k].is_meta for k in under)
            home = self.placement(under[0], targets[under[0]], fit.float_dtype)[0] if empty else None
            if home is not None and home.type == "meta":  # the device map keeps it off this process
                self.kept_off.extend(prefix + k for k in under if k[len(owner):] not in missing[owner])
                continue
            self.post.append(functools.partial(self._load_own, module, prefix + owner, values[owner],
                                               missing[owner], home))
        return rest, {k: v for k, v in names.items() if k in rest}

    def _load_own(self, module: torch.nn.Module, where: str, values: dict[str, torch.Tensor],
                  planned_missing: set[str], home: torch.device | None) -> None:
        """Give a self-loading module its values (:meth:`_own_loads`); ``home``: where a
        module that was on ``meta`` goes (its tensors are assigned, not copied)."""
        name = where.rstrip(".")
        what = f"module {name!r} ({type(module).__name__})" if name else f"the target ({type(module).__name__})"
        try:
            report = module.load_state_dict(values, strict=False, assign=home is not None)
        except (RuntimeError, ValueError, TypeError) as exc:
            lines = " ".join(str(exc).split())[:600]
            raise LoadMismatchError(
                f"{self.location}: {what} loads its own state, and its load_state_dict refused the "
                f"checkpoint's values: {lines}. The target may now hold part of this checkpoint's values: "
                "load a whole checkpoint into it before using it"
            ) from exc
        left = sorted(set(report.missing_keys) - planned_missing) + sorted(report.unexpected_keys)
        if left:
            raise LoadMismatchError(
                f"{self.location}: {what} loads its own state, and its load_state_dict did not take "
                f"{', '.join(repr(where + k) for k in left[:10])}: those tensors are not loaded. The target may "
                "now hold part of this checkpoint's values: load a whole checkpoint into it before using it"
            )
        if home is not None:
            module.to(home)
        if self.dtype is not None:  # floating tensors only, as dtype= gives every module
            module.to(self.dtype)

    def _wrapped_module_into(self, inner: torch.nn.Module, wrapper: str, saved: Mapping[str, str],
                             comp: ComponentRecord, path: str, targets: dict[str, torch.Tensor],
                             conversions: _hf_conversions.Conversions) -> None:
        """Load files in the Hub's names into a ``transformers`` model under ``torch.compile`` or
        DDP: into the model itself (its weight conversions need it: GPT-NeoX's ``embed_out``,
        Mixtral's fused experts), then report its keys under the wrapper's prefix."""
        marks = (len(self.missing), len(self.mismatched), len(self.meta_left), len(self.kept_off))
        self._module_into(inner, saved, comp, path, targets, conversions)
        prefix = f"{path}/" if path else ""

        def wrapped(key: str) -> str:
            return prefix + wrapper + key[len(prefix):]

        self.missing[marks[0]:] = [wrapped(k) for k in self.missing[marks[0]:]]
        self.mismatched[marks[1]:] = [(wrapped(k), a, b) for k, a, b in self.mismatched[marks[1]:]]
        self.meta_left[marks[2]:] = [wrapped(k) for k in self.meta_left[marks[2]:]]
        self.kept_off[marks[3]:] = [wrapped(k) for k in self.kept_off[marks[3]:]]
        old, new = self.prefix_mapping.get(path, ("", ""))
        self.prefix_mapping[path] = (old, wrapper + new)

    def _finish_module(self, fit: _ModuleLoad, targets: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Non-persistent buffers placed and given the dtype ``dtype=`` gives them (rebuilt
        where on ``meta``, as are the meta tensors the model leaves out of its files), and
        every tensor that will still be on ``meta`` after the load listed."""
        found = {full: (owner, name, b) for full, owner, name, b in _module_fit.non_persistent_buffers(fit.module)}
        for key, tensor in targets.items():
            off = isinstance(tensor, torch.Tensor) and tensor.device.type == "meta" and key not in fit.materialized
            if key in fit.rebuild and key not in fit.materialized and (there := _module_fit.tensor_of(fit.module, key)):
                found[key] = there  # rebuilt below (or reported there), or given the dtype dtype= asks
            elif off:
                (self.meta_left if self.placement(key, tensor)[0].type != "meta" else self.kept_off).append(prefix + key)
        rebuild: dict[str, tuple[torch.nn.Module, list[str]]] = {}
        for full, (owner, name, tensor) in found.items():
            device, want = self._finish_home(fit, full, owner, name, tensor)
            if tensor.device.type == "meta":
                if device.type != "meta":
                    owner_path = full.rpartition(".")[0]
                    rebuild.setdefault(owner_path, (owner, []))[1].append(name)
                elif prefix + full not in self.kept_off:
                    self.kept_off.append(prefix + full)
            elif device.type != "meta" and (device != tensor.device or want != tensor.dtype):
                self._assign_later(fit.module, full, tensor.to(device=device, dtype=want))
        for owner_path, (owner, names) in rebuild.items():
            values = _module_fit.rebuild_buffers(fit.module, owner_path, owner, names)
            rest = [n for n in names if n not in values and n in owner._buffers]
            if rest:
                values.update(_module_fit.rebuild_by_constructor(owner, rest))
            for name in names:
                full = f"{owner_path}.{name}" if owner_path else name
                if name not in values:
                    self.meta_left.append(prefix + full)
                    continue
                device, want = self._finish_home(fit, full, owner, name, values[name])
                value = values[name].to(device=device, dtype=want)
                meta = owner._parameters.get(name)
                if meta is not None:
                    value = torch.nn.Parameter(value, requires_grad=meta.requires_grad)
                self._assign_later(fit.module, full, value)

    def _finish_home(self, fit: _ModuleLoad, full: str, owner: torch.nn.Module, name: str, tensor: torch.Tensor
                     ) -> tuple[torch.device, torch.dtype]:
        """(device, dtype) of a tensor :meth:`_finish_module` places: an empty model's go
        where ``device`` / ``device_map`` say, a built model's stay where they are; a
        non-persistent buffer takes the dtype of :attr:`_ModuleLoad.buffer_dtypes` (else
        keeps its own), any other tensor the dtype ``dtype=`` gives its key."""
        device, want = self.placement(full, tensor, fit.float_dtype)
        if not fit.empty:
            device = tensor.device
        if name in owner._non_persistent_buffers_set:
            known = fit.buffer_dtypes is not None and tensor.dtype.is_floating_point
            want = fit.buffer_dtypes.get(full, tensor.dtype) if known else tensor.dtype  # type: ignore[union-attr]
        return device, want

    def _assign_later(self, module: torch.nn.Module, key: str, value: torch.Tensor) -> None:
        self.post.append(functools.partial(self.assign_now, module, key, value))

    @staticmethod
    def assign_now(module: torch.nn.Module, key: str, value: torch.Tensor) -> None:
        """Make ``value`` the module's parameter or buffer ``key``."""
        if not _assign(module, key, value):
            module.load_state_dict({key: value}, strict=False, assign=True)

    @property
    def fusion_bytes(self) -> int:
        return sum(f.nbytes for f in self.fusions)

    def run_fusions(self, advance: Callable[[int], None] | None) -> None:
        """Read and combine the planned fusions, one group at a time (after the batch)."""
        for planned in self.fusions:
            fusions.run(self.batch, planned, self.location, advance)
        self.batch.warn_out_of_range()

    def _put_fused(self, fit: _ModuleLoad, targets: Mapping[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
        """Give model tensor ``key`` its fused ``value``: copied in place (a DTensor its own
        region) where it already has its home, else a new tensor where ``device`` /
        ``device_map`` / ``dtype`` put it (a real parameter keeps its identity)."""
        tensor = targets[key]
        home = self._new_home(key, tensor, fit)
        self.batch.out_of_range.check(key, value, tensor.dtype if home is None else home[1])
        if home is None:
            if type(tensor).__name__ == "DTensor":
                _global_shape, offsets, local = local_chunk(tensor)
                for dim, (start, size) in enumerate(zip(offsets, local.shape, strict=True)):
                    value = value.narrow(dim, start, size)
                local.copy_(value)
            else:
                tensor.detach().copy_(value)
            return
        device, dtype = home
        if device.type == "meta":
            return  # the device map keeps it off this process
        new = value.to(device=device, dtype=dtype)
        fit.materialized.add(key)
        if isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
            tensor.data = new
        elif isinstance(tensor, torch.nn.Parameter):
            self.assign_now(fit.module, key, torch.nn.Parameter(new, requires_grad=tensor.requires_grad))
        else:
            self.assign_now(fit.module, key, new)

    def node(self, target: Any, node: dict[str, Any], comp: ComponentRecord, path: str,
             setter: Callable[[Any], None] | None) -> None:
        kind = node.get("type")
        inner = node["value"] if kind in WRAPPER_TYPES else node
        if isinstance(target, torch.nn.Module):
            if inner.get("type") != "dict":  # a value, not a state dict: nothing of it loads
                self.missing.append(path)
                self.unexpected.append(path)
                return
            names = {str(k): child["name"] for _, k, child in inner["items"] if child.get("type") == "tensor"}
            self.extras = {str(k): child for _, k, child in inner["items"] if child.get("type") != "tensor"}
            self.module_into(target, names, comp, path)
            # A module takes tensors, and the extra state (get_extra_state) of modules that keep one.
            self.unexpected.extend(f"{path}/{k}" if path else k for k in self.extras)
            self.extras = {}
            return
        if isinstance(target, torch.optim.Optimizer):
            if kind != "optimizer":
                raise LoadMismatchError(
                    f"{self.location}: {path!r} was saved as a plain dict (e.g. an optimizer's state_dict() "
                    "or written through torch.distributed.checkpoint), not from an optimizer object; read it "
                    f"with sp.load(...)[{path!r}] and pass it to the optimizer's load_state_dict (DCP: "
                    "set_optimizer_state_dict), or save the optimizer object itself")
            by_name = node.get("by_name", False)
            param_names = self.param_names
            where = f"{self.location}, {path}"

            def load_optimizer(value: Any, opt: torch.optim.Optimizer = target) -> None:
                renamed = renamed_parameter_names(self.modules, self.prefix_mapping)  # known once planned
                sd = optimizer_state_for(opt, value, param_names, where=where, renamed=renamed,
                                         fresh=self._skipped_parameters()) if by_name else value
                opt.load_state_dict(_sharded_like_params(opt, sd))

            def check_optimizer(opt: torch.optim.Optimizer = target) -> None:
                """The same pairing on the saved structure alone, before anything is read: a
                refusal must not come after the model was loaded."""
                try:
                    skeleton = unflatten_state(node, defaultdict(type(None)), where=where)
                except CheckpointError:
                    return  # raised by the load itself, at its turn
                renamed = renamed_parameter_names(self.modules, self.prefix_mapping)
                optimizer_state_for(opt, skeleton, param_names, where=where, renamed=renamed)

            if by_name:
                self.checks.append(check_optimizer)

            self.build(comp, node, load_optimizer, path)
            return
        if isinstance(target, torch.Tensor):
            if kind != "tensor":  # the checkpoint holds a value there (an int, a list): neither loads
                self.missing.append(path)
                self.unexpected.append(path)
                return
            self.tensors_into({"": target}, {"": node["name"]}, comp, path, None)
            return
        if isinstance(target, Stateful) and not isinstance(target, Mapping):
            saved_class = node.get("class") if kind == "stateful" else None
            if (isinstance(target, torch.optim.lr_scheduler.LRScheduler) and isinstance(saved_class, str)
                    and saved_class != type(target).__qualname__
                    and isinstance(getattr(torch.optim.lr_scheduler, saved_class, None), type)):
                raise LoadMismatchError(  # torch takes any scheduler's attributes without a word
                    f"{self.location}: {path!r} was saved from a {saved_class} but the target is a "
                    f"{type(target).__name__}: loading one scheduler's state into another class gives it "
                    "attributes it does not use and keeps its own schedule. Build the scheduler class it was "
                    "saved from (or leave the scheduler out of the target to load the rest); nothing was loaded"
                )
            self.build(comp, node, target.load_state_dict, path)
            return
        if isinstance(target, MutableMapping) and inner.get("type") == "dict":
            saved_keys = set()
            # A state dict (tensors only) takes no new tensor: the checkpoint's extra ones are
            # unexpected, as they are for a module (other containers take what was saved).
            state_dict = bool(target) and all(isinstance(v, torch.Tensor) for v in target.values())
            for _, key, child in inner["items"]:
                saved_keys.add(key)
                child_path = f"{path}.{key}" if path else str(key)
                if key in target:
                    self.node(target[key], child, comp, child_path, _item_setter(target, key))
                elif state_dict and child.get("type") == "tensor":
                    self.unexpected.append(child_path)
                else:
                    self.build(comp, child, _item_setter(target, key), child_path)
            self.missing.extend(f"{path}.{k}" if path else str(k) for k in target if k not in saved_keys)
            return
        if isinstance(target, MutableSequence) and inner.get("type") in ("list", "tuple") and len(target) == len(inner["items"]):
            for i, child in enumerate(inner["items"]):
                self.node(target[i], child, comp, f"{path}.{i}", _item_setter(target, i))
            return
        if _holds_live(target):
            # Modules, optimizers, tensors are loaded in place, never replaced by a rebuilt value:
            # a tuple of them, a Namespace or dataclass holding them is walked; a list of another
            # length is refused (a rebuilt container of state dicts took their place, ok=True).
            if isinstance(target, tuple) and inner.get("type") in ("list", "tuple") and len(target) == len(inner["items"]):
                for i, child in enumerate(inner["items"]):
                    self.node(target[i], child, comp, f"{path}.{i}", None)
                return
            fields = fields_of(target)
            if fields is not None and kind in ("namespace", "dataclass") and node["value"].get("type") == "dict":
                for _, key, child in node["value"]["items"]:
                    child_path = f"{path}.{key}" if path else str(key)
                    if key in fields:
                        self.node(fields[key], child, comp, child_path, functools.partial(setattr, target, key))
                    else:
                        self.unexpected.append(child_path)
                saved = {key for _, key, _ in node["value"]["items"]}
                self.missing.extend(f"{path}.{k}" if path else k for k in fields if k not in saved)
                return
            held = f"{len(inner['items'])} items" if inner.get("type") in ("list", "tuple") else f"a {kind} node"
            raise LoadMismatchError(
                f"{self.location}: the target's {path!r} is a {type(target).__name__} holding modules, optimizers or "
                f"tensors (loaded in place), but the checkpoint holds {held} there: it does not fit (an entry added "
                "or dropped since the save?). Make the target's structure the saved one, or load that part with "
                f"sp.load(...)[{path!r}]; nothing was loaded"
            )
        if setter is None:
            raise InvalidStateError(
                f"cannot load {path!r} into a {type(target).__name__}: it is neither a module, "
                "optimizer, Stateful, tensor nor a mutable container"
            )
        self.build(comp, node, setter, path)


    def _skipped_parameters(self) -> set[int]:
        """Ids of the target's parameters the model load left as they are for a shape
        mismatch (``strict=False``): their saved optimizer state, of the saved shape, is
        not loaded either."""
        skipped = {key for key, _saved, _target in self.mismatched}
        if not skipped:
            return set()
        return {id(param) for key, module in self.modules for name, param in module.named_parameters(
            remove_duplicate=False) if f"{key}/{name}" in skipped or name in skipped}


def _sharded_like_params(opt: torch.optim.Optimizer, sd: Any) -> Any:
    """``sd`` (an optimizer state dict read whole) with each state tensor of a DTensor
    parameter's shape made a DTensor like it, holding this rank's region: an FSDP2 or
    tensor-parallel optimizer loaded whole tensors, ``ok``, and its next ``step()`` failed
    mixing them with the DTensor parameters."""
    state = sd.get("state") if isinstance(sd, Mapping) else None
    if not isinstance(state, Mapping):
        return sd
    params = [p for group in opt.param_groups for p in group["params"]]
    if not any(type(p).__name__ == "DTensor" for p in params):
        return sd
    from torch.distributed.tensor import DTensor

    out = {}
    for index, entry in state.items():
        param = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if param is None or type(param).__name__ != "DTensor" or not isinstance(entry, Mapping):
            out[index] = entry
            continue
        _global_shape, offsets, local = local_chunk(param)
        region = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
        entry = dict(entry)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.shape == param.shape:
                mine = value[region].to(device=local.device).contiguous()
                entry[key] = DTensor.from_local(mine, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
        out[index] = entry
    return {**sd, "state": out}


def _apply_saved(apply: Callable[[Any], None], value: Any, where: str) -> None:
    """Hand a rebuilt value to its target (``load_state_dict``, a container slot); a target
    that refuses it (an optimizer given groups of another size, ...) raises LoadMismatchError."""
    try:
        apply(value)
    except CheckpointError:
        raise
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise LoadMismatchError(
            f"{where}: the target refused the saved state ({type(exc).__name__}: {str(exc)[:200]}); "
            "the checkpoint was saved from a different object, or it is damaged"
        ) from exc
