"""``transformers`` 5's weight conversions: the Hub's names in the files, the model's in memory.

``transformers`` 5 renames some checkpoint tensors as it loads them (GPT-NeoX's
``embed_out`` becomes ``lm_head``, ViT's ``attention.attention.query`` ``q_proj``) and fuses
others (Mixtral's per-expert ``w1`` / ``w3`` become one ``experts.gate_up_proj``), and its
``save_pretrained`` reverts that, so files keep the names the Hub and vLLM know. Both
directions are the model's own table (``get_model_conversion_mapping``), applied here with
``transformers``' own functions:

- :func:`weights_to_save`: the state dict as ``save_pretrained`` stores it
  (``integrations.transformers.save_pretrained``). ``sp.save(model)`` stores the model's
  own names, which ``from_pretrained`` and ``load_into`` read as they are.
- :func:`plan`: for ``load_into`` of a ``transformers`` model, which checkpoint names a
  conversion renames (read into place under the new name) and which it fuses (read into
  temporary tensors, one group at a time, and turned into the model's tensors by the
  conversion's own operations: ``_load/fusions.py``), with the shapes the fusions make
  worked out on ``meta`` before anything is read.

Where the installed ``transformers`` has no such table (4.x), or its internals differ from
what this module calls, nothing is converted: files in the model's own names still load,
and others are reported as missing / unexpected keys, never guessed at.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._module_fit import is_transformers_model
from ._prepare import storage_key
from ._printable import printable
from .errors import LoadMismatchError


def weights_to_save(model: Any) -> tuple[dict[str, torch.Tensor], set[str], set[str]]:
    """The model's state dict as ``transformers``' ``save_pretrained`` stores it, the names
    it keeps, and the names the reverted conversions made.

    The last are planned into files by their real storage, as ``save_pretrained`` plans
    them (its tie rule, which gives views of one storage that do not overlap storages of
    their own, runs before the revert): a layer's per-expert weights, views of its stacked
    experts, go to one file and count the stack's bytes once.

    As there: keys listed in ``_keys_to_ignore_on_save`` are dropped; of tied weights the
    name ``remove_tied_weights_from_state_dict`` keeps is stored (views that share a
    storage without overlapping become copies of their own); weight conversions applied
    at load time are reverted. Unlike there, the dropped names of ties follow as aliases of
    the kept one (absent from the files and the index, as in ``transformers``' output;
    recorded in shardpoint's manifest, so ``sp.load`` returns them). A dropped name whose
    twin a conversion changed is left out, as there.
    """
    state = dict(model.state_dict())
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # pragma: no cover - older transformers: shardpoint's own tie rule
        return state, set(), set()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers 4 converts no weights
        converted = dict(kept)
    else:
        converted = dict(revert_weight_conversion(model, kept))
    stored = {storage_key(t) for t in converted.values()} - {None}
    out = dict(converted)
    for name, tensor in state.items():
        if name not in kept and name not in out and storage_key(tensor) in stored:
            out[name] = tensor
    before = {id(t) for t in kept.values()}
    made = {name for name, tensor in converted.items() if id(tensor) not in before}
    return out, set(converted), made


@dataclass
class Fusion:
    """Checkpoint tensors that one conversion turns into model tensors (say a layer's
    experts stacked and concatenated into ``gate_up_proj``)."""

    first: str
    """The model key ``transformers`` names the group by (its first target)."""
    sources: list[tuple[str, str]]
    """(checkpoint key, the conversion's source pattern it matched), in ``transformers``'
    order (``dot_natural_key``: expert 2 before expert 10)."""
    outputs: dict[str, tuple[int, ...]]
    """Model key -> shape of each tensor the conversion makes (worked out on ``meta``)."""
    template: Any
    """The conversion (a ``WeightConverter``), copied afresh for each run."""
    location: str

    def run(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model tensors made from ``tensors`` (checkpoint key -> tensor)."""
        return _convert(self, module, tensors)


@dataclass
class Conversions:
    """How a model's conversions map the checkpoint keys of one load."""

    renamed: dict[str, str] = field(default_factory=dict)
    """Checkpoint key -> model key, for each key a rename changes."""
    fusions: list[Fusion] = field(default_factory=list)

    def remaining(self, saved: Mapping[str, str]) -> tuple[dict[str, str], dict[str, list[tuple[str, str]]]]:
        """``saved`` (checkpoint key -> stored name) less the fusions' sources, renamed as
        the conversions rename: what is left to match by name; and, for each renamed key
        that two or more checkpoint keys become (files holding a tensor under the Hub's name
        and the model's, ``embed_out.weight`` and ``lm_head.weight``), the (checkpoint key,
        stored name) of each one after the first, whose values must be the first's."""
        consumed = {k for fusion in self.fusions for k, _ in fusion.sources}
        out: dict[str, str] = {}
        first: dict[str, str] = {}
        also: dict[str, list[tuple[str, str]]] = {}
        for k, name in saved.items():
            if k in consumed:
                continue
            key = self.renamed.get(k, k)
            if key in out:
                also.setdefault(key, []).append((k, name))
                continue
            out[key] = name
            first[key] = k
        return out, also


def _transforms(module: Any) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # pragma: no cover - transformers 4 converts no weights
        return []
    try:
        return list(get_model_conversion_mapping(module))
    except Exception:  # a model whose table cannot be built converts nothing (as saved, it loads)
        return []


def plan(
    module: torch.nn.Module,
    saved_keys: Iterable[str],
    targets: Mapping[str, torch.Tensor],
    stored: Callable[[str], tuple[tuple[int, ...], torch.dtype]],
    location: str,
) -> Conversions | None:
    """How ``module``'s conversions map ``saved_keys`` onto ``targets`` (its state dict),
    as ``from_pretrained`` maps them; None where no conversion changes any key.

    ``stored(key)`` gives a checkpoint tensor's (shape, dtype): each fusion is run once on
    ``meta`` tensors of those, so the shapes it makes are known before a byte is read.
    """
    if not is_transformers_model(module):
        return None
    transforms = _transforms(module)
    if not transforms:
        return None
    try:
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # pragma: no cover - a transformers whose internals moved: nothing converted
        return None

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = module.base_model_prefix if isinstance(module.base_model_prefix, str) else ""
    out = Conversions()
    groups: dict[str, list[tuple[str, str]]] = {}
    meta = dict(targets)
    for key in sorted(saved_keys, key=dot_natural_key):
        try:
            plain, pattern = rename_source_key(key, renamings, converters)  # the conversion alone
            if plain == key and pattern is None:
                continue  # nothing converts it (a base-model prefix is matched later, and reported)
            new, _ = rename_source_key(key, renamings, converters, prefix, meta)  # its model key
        except Exception:  # a pattern that cannot handle this key leaves it as saved
            continue
        if new not in targets:
            continue  # not this model's (or already in the model's form): matched by name, as saved
        if pattern is None:
            out.renamed[key] = plain
        else:
            groups.setdefault(new, []).append((key, pattern))
    for first, sources in groups.items():
        template = by_pattern[sources[0][1]]
        _refuse_uneven(first, sources, template, location)
        fusion = Fusion(first, sources, {}, template, location)
        metas = {}
        for key, _ in sources:
            shape, dtype = stored(key)
            metas[key] = torch.empty(shape, dtype=dtype, device="meta")
        fusion.outputs = {k: tuple(v.shape) for k, v in _convert(fusion, module, metas).items()}
        out.fusions.append(fusion)
    if not out.renamed and not out.fusions:
        return None
    return out


def _refuse_uneven(first: str, sources: Sequence[tuple[str, str]], template: Any, location: str) -> None:
    """Refuse a fusion whose source patterns the checkpoint matches unevenly (4 experts'
    ``w3`` but 3 experts' ``w1``: a key is missing), naming the counts, before the model's
    converter fails on it with an error about tensor sizes."""
    patterns = [p for p in getattr(template, "source_patterns", ()) if isinstance(p, str)]
    counts = {p: sum(1 for _, q in sources if q == p) for p in patterns}
    if len(patterns) < 2 or len(set(counts.values())) == 1:
        return
    most = max(counts.values())
    short = [p for p in patterns if counts[p] < most]
    raise LoadMismatchError(
        f"{location}: the model's weight conversion to {first!r} combines keys matching "
        + ", ".join(f"{printable(p)!r} ({counts[p]})" for p in patterns)
        + f", and the checkpoint holds fewer of {', '.join(repr(printable(p)) for p in short)} than of the others: "
        "a tensor is missing from the checkpoint (an incomplete download or copy?); check it with "
        "`shardpoint verify`, and fetch the missing file or tensor"
    )


def _convert(fusion: Fusion, module: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        converter = copy.deepcopy(fusion.template)
        for key, pattern in fusion.sources:
            converter.add_tensor(fusion.first, key, pattern, tensors[key])
        with torch.no_grad():
            made = converter.convert(fusion.first, model=module, config=module.config)
    except Exception as exc:
        names = ", ".join(repr(k) for k, _ in fusion.sources[:4]) + (", ..." if len(fusion.sources) > 4 else "")
        raise LoadMismatchError(
            f"{fusion.location}: the model's weight conversion ({type(fusion.template).__name__} to "
            f"{fusion.first!r}) cannot combine the checkpoint's {names} ({type(exc).__name__}: "
            f"{printable(str(exc)[:200])}); the checkpoint does not fit this model (load it into the "
            "model class and config it was saved from)"
        ) from None
    return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}
