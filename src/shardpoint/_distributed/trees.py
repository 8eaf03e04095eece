"""The state trees of a collective save: one for the manifest, from every rank's.

Each rank of a collective save passes the same structure, each its own shards of its
tensors; what is not a tensor (a step, a config, a data loader's position) is usually the
same on every rank, and the coordinator's tree is the manifest's. Where some ranks hold
entries of their own (torchtitan keys its data loader state ``dp_rank_<r>``;
:class:`~shardpoint.RNGState` keys each rank's generators by rank), the trees are merged:
an entry some ranks have and others not is kept, with the tensors under it (written by
the ranks that hold them). An entry that two ranks hold with different values is refused:
one of them would be lost without a word.

Every rank sends a digest of each component's tree with its plan; only when the digests
differ are the trees themselves sent, in a second round.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .._flatten import tree_tensor_names
from .._prepare import PreparedState
from ..errors import InvalidStateError
from .plan_cache import fingerprint


def digests(prepared: PreparedState) -> dict[str, str]:
    """Component -> a digest of its tree (its structure and every value that is not a tensor)."""
    return {c.name: fingerprint(json.dumps(c.tree, sort_keys=True, separators=(",", ":"))) for c in prepared.components}


def differing(all_digests: Sequence[Mapping[str, str]]) -> list[str]:
    """The components whose trees are not the same on every rank (rank 0's order first)."""
    first = all_digests[0]
    names = dict.fromkeys([*first, *(n for d in all_digests[1:] for n in d)])
    return [n for n in names if any(d.get(n) != first.get(n) for d in all_digests[1:])]


def trees_of(prepared: PreparedState, names: Sequence[str]) -> dict[str, Any]:
    """This rank's (tree, aliases) of the components ``names`` (those it has): an entry of
    its own may hold a tensor twice (tied weights of a pipeline stage)."""
    return {c.name: (c.tree, dict(c.aliases)) for c in prepared.components if c.name in names}


def merged(sent_by_rank: Sequence[Mapping[str, Any]],
           names: Sequence[str]) -> dict[str, tuple[Any, dict[str, str]]]:
    """Component -> (the union of every rank's tree of it, of their aliases); refused where
    two ranks hold one entry with different values, or where a component is missing on
    rank 0."""
    trees_by_rank = [{n: tree for n, (tree, _) in sent.items()} for sent in sent_by_rank]
    out = {}
    for name in names:
        if name not in trees_by_rank[0]:
            holder = next(r for r, trees in enumerate(trees_by_rank) if name in trees)
            raise InvalidStateError(
                f"component {name!r} is in the state of rank {holder} but not in rank 0's: in a collective save "
                "every rank passes the same components (keys that only some ranks have can sit inside one). "
                "Nothing was saved"
            )
        tree = trees_by_rank[0][name]
        for rank, trees in enumerate(trees_by_rank[1:], start=1):
            if name not in trees:
                raise InvalidStateError(
                    f"component {name!r} is in rank 0's state but not in rank {rank}'s: in a collective save every "
                    "rank passes the same components. Nothing was saved"
                )
            tree = _merge(tree, trees[name], name, rank)
        aliases: dict[str, str] = {}
        for sent in sent_by_rank:
            aliases.update(sent[name][1])
        out[name] = (tree, aliases)
    return out


def _merge(ours: Any, theirs: Any, where: str, rank: int) -> Any:
    if ours == theirs:
        return ours
    if isinstance(ours, dict) and isinstance(theirs, dict) and ours.get("type") == theirs.get("type"):
        if ours.get("type") == "dict" and _rest(ours, "items") == _rest(theirs, "items"):
            items = {(kind, key): child for kind, key, child in ours["items"]}
            for kind, key, child in theirs["items"]:
                at = (kind, key)
                items[at] = _merge(items[at], child, f"{where}[{key!r}]", rank) if at in items else child
            return {**ours, "items": [[kind, key, child] for (kind, key), child in items.items()]}
        if "value" in ours and _rest(ours, "value") == _rest(theirs, "value"):
            return {**ours, "value": _merge(ours["value"], theirs.get("value"), where, rank)}
    raise InvalidStateError(
        f"{where} is not the same on rank 0 and rank {rank}: a collective save stores one copy of what is not a "
        "tensor, so one rank's value would be lost. Make it the same on every rank, or put what differs under a "
        "key of each rank's own (e.g. state['loader'] = {f'rank{rank}': loader.state_dict()}): entries that only "
        "some ranks have are all kept. Nothing was saved"
    )


def _rest(node: Mapping[str, Any], skip: str) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k != skip}


def tensor_names(merged_trees: Mapping[str, tuple[Any, dict[str, str]]]) -> set[tuple[str, str]]:
    """(component, name) of every tensor (and pickled value) the merged trees refer to."""
    return {(c, n) for c, (tree, _) in merged_trees.items() for n in tree_tensor_names(tree)}


def with_trees(prepared: PreparedState, trees: Mapping[str, tuple[Any, dict[str, str]]]) -> PreparedState:
    """``prepared`` with the trees and aliases of some components replaced (for the manifest)."""
    if not trees:
        return prepared
    components = [dataclasses.replace(c, tree=trees[c.name][0], aliases=trees[c.name][1]) if c.name in trees else c
                  for c in prepared.components]
    return dataclasses.replace(prepared, components=components)
