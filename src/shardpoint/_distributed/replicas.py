"""Plain tensors of a collective save (and DTensors placed ``Replicate()`` on their whole mesh)
hold the same values on every rank, or nothing is saved.

A plain tensor (not a DTensor) that several ranks of a collective save hold under one name
is taken as replicated (DDP's parameters and buffers): it is written once, by one rank, or
cut into row pieces that several ranks write (``split_replicated``). Ranks that drifted
apart (a model built from another seed on one rank, gradients not reduced, a rank's own
counter saved under a shared name) would be committed as one rank's copy, or as rows of
several: a mix no rank ever held.

Each rank samples every plain tensor (up to :data:`SAMPLES` elements, evenly spaced, the
first and last included) and sends one digest per component with its plan; only where the
digests differ are the tensors' own digests sent, in another round, to name the first
tensor that differs. A component whose trees differ between ranks (entries of each rank's
own, :class:`~shardpoint.RNGState`'s generators) has digests that differ anyway: its
tensors' digests come with its trees, and every name two ranks hold is compared. The check
is a sample, not a proof: two copies that differ only between sampled elements pass.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import NamedTuple

import torch

from .._checksum import crc32c
from .._prepare import Component, PreparedState
from ..errors import InvalidStateError
from .plan_cache import fingerprint

SAMPLES = 4096
"""Elements sampled of each plain tensor (all of a smaller one)."""
MAX_TENSORS = 4096
"""Plain tensors of a component sampled for its digest (every k-th of more: 100 000 small
tensors cost 1.3 s a save), all of them when the coordinator asks for their samples."""


def _sample(tensor: torch.Tensor) -> int:
    """crc32c of up to :data:`SAMPLES` evenly spaced elements' bytes (any strides, any device).

    >>> a = torch.arange(10_000, dtype=torch.float32)
    >>> b = a.clone(); b[-1] = 0
    >>> _sample(a) == _sample(a.clone()), _sample(a) == _sample(b)
    (True, False)
    """
    count = tensor.numel()
    if count == 0:
        return 0
    picked = tensor.detach()
    if count > SAMPLES:
        step = -(-count // (SAMPLES - 1))
        if picked.is_contiguous():  # a strided view: nothing is gathered until the copy below
            flat = picked.view(-1)
            picked = torch.cat([flat[::step], flat[-1:]])
        else:
            at = torch.cat([torch.arange(0, count, step), torch.tensor([count - 1])]).to(tensor.device)
            picked = picked[torch.unravel_index(at, tuple(tensor.shape))]
    values = picked.reshape(-1).resolve_conj().resolve_neg().cpu().contiguous()
    return crc32c(values.view(torch.uint8).numpy())


def _replicated(tensor: torch.Tensor) -> bool:
    """A DTensor placed ``Replicate()`` on every dimension of its mesh: every rank of the mesh
    holds all of it, and the save writes it once (in row pieces cut between the ranks, when
    large), as it writes a plain tensor: its copies are compared as a plain tensor's are."""
    return all(p.is_replicate() for p in tensor.placements)  # type: ignore[attr-defined]


def _whole_on_each(comp: Component, name: str) -> bool:
    """Whether every rank holding ``name`` holds all of it: a plain tensor, a DTensor placed
    ``Replicate()`` on its whole mesh, or such a DTensor as an async save staged it (its
    chunk is the whole tensor)."""
    tensor = comp.tensors[name]
    if name in comp.placements:
        global_shape, offsets = comp.placements[name]
        return tuple(tensor.shape) == tuple(global_shape) and not any(offsets)
    return type(tensor).__name__ != "DTensor" or _replicated(tensor)


class Samples(NamedTuple):
    """What a rank sends with its plan."""

    components: dict[str, str]
    """Component -> one digest of its plain tensors' samples."""
    tensors: dict[str, dict[str, int]]
    """Component -> plain tensor name -> its sample's digest (the components asked for)."""


def _plain(prepared: PreparedState, cache: dict[tuple[str, str], int],
           names: Set[str] | None = None) -> dict[str, dict[str, int]]:
    """Component -> plain tensor name (aliases of tied tensors too) -> its sample's digest
    (of the components ``names``, or all); ``cache`` keeps each tensor's sample across the
    rounds of one save."""
    out: dict[str, dict[str, int]] = {}
    for comp in prepared.components:
        if names is not None and comp.name not in names:
            continue
        done: dict[str, int] = {}
        plain = [name for name in comp.stored if name not in comp.buffers and _whole_on_each(comp, name)]
        every = 1 if names is not None else max(1, -(-len(plain) // MAX_TENSORS))  # asked by name: each one
        for name in plain[::every]:
            key = (comp.name, name)
            if key not in cache:
                tensor = comp.tensors[name]
                cache[key] = _sample(tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor)  # type: ignore[attr-defined]
            done[name] = cache[key]
        out[comp.name] = {name: done[comp.aliases.get(name, name)] for name in comp.tensors
                          if comp.aliases.get(name, name) in done}
    return out


def digests(prepared: PreparedState, cache: dict[tuple[str, str], int]) -> dict[str, str]:
    """Component -> one digest of its plain tensors' samples."""
    return {comp: fingerprint(sorted(tensors.items())) for comp, tensors in _plain(prepared, cache).items()}


def tensor_digests(prepared: PreparedState, components: Sequence[str],
                   cache: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """Component -> plain tensor name -> its sample's digest, for the components asked about."""
    return _plain(prepared, cache, set(components)) if components else {}


def differing(all_samples: Sequence[Samples], skip: Set[str]) -> list[str]:
    """Components (not in ``skip``: their trees differ, and their tensors are compared one by
    one) whose plain tensors' samples are not the same on every rank."""
    first = all_samples[0].components
    return [c for c in first
            if c not in skip and any(s.components.get(c, first[c]) != first[c] for s in all_samples[1:])]


def refuse(all_samples: Sequence[Samples], *, asked: bool) -> None:
    """Raise naming the first tensor whose sample differs between the first rank holding it
    and another rank (``asked``: the components' digests differed, so one must)."""
    first: dict[tuple[str, str], tuple[int, int]] = {}
    for rank, samples in enumerate(all_samples):
        for comp, tensors in samples.tensors.items():
            for name, value in tensors.items():
                holder, seen = first.setdefault((comp, name), (rank, value))
                if seen != value:
                    raise InvalidStateError(
                        f"tensor {name!r} of component {comp!r} holds different values on rank {holder} and rank "
                        f"{rank}: in a collective save a plain tensor (or a DTensor placed Replicate()) is taken as "
                        "the same on every rank (replicated, as DDP keeps it) and written once, so one rank's values "
                        "(or a mix of rows of several) would be committed. Make the ranks agree (the same seed, "
                        "gradients reduced), shard it, or put what differs under a key of each rank's own. Nothing "
                        "was saved"
                    )
    if asked:
        raise InvalidStateError(  # the components' digests differed: a tensor must have
            "the ranks' plain tensors held different values, but no single differing tensor was found when they were "
            "compared again (a tensor changed while it was being saved?); nothing was saved"
        )
