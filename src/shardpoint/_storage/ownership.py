"""Which entries of a checkpoint's folder (or prefix) a save that replaces it may remove.

One rule for both stores: the manifest, a save's marker, the rank tables, the Hugging Face
weight files and indexes of the components being written, and what the old checkpoint
wrote. The old manifest is not trusted to say what that is: a name it lists counts only
where it is a safetensors file whose header carries the manifest's ``save_id`` (every save
writes its id into each of its files), and an old component's index only where such a file
of that component is there. Everything else is the user's (``config.json``, tokenizer
files, notes, folders) and is kept, whatever a damaged or forged manifest lists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

from .._format.index import index_name
from .._format.manifest import MANIFEST_NAME

SAVE_MARKER = ".shardpoint-save"
"""Prefix of a save's marker file (``local_recovery.marker_name``)."""
_WEIGHT_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}\.safetensors")
_TABLE = re.compile(r"shardpoint-r\d{5}\.json")
"""A rank's chunk table (``_format.tables.table_name``): a name only shardpoint writes."""


def manifest_components(doc: dict[str, object] | None) -> set[str]:
    comps = doc.get("components") if doc else None
    return {c for c in comps if isinstance(c, str)} if isinstance(comps, dict) else set()


def is_weight_file_of(name: str, components: set[str]) -> bool:
    """Whether ``name`` is a Hugging Face weight file or index of one of ``components``:
    ``{c}.safetensors``, ``{c}-NNNNN-of-NNNNN.safetensors``, ``{c}.safetensors.index.json``.

    >>> is_weight_file_of("model-00002-of-00003.safetensors", {"model"})
    True
    >>> is_weight_file_of("tokenizer.json", {"model"}), is_weight_file_of("adapter.safetensors", {"model"})
    (False, False)
    """
    if name.endswith(".safetensors.index.json"):
        return name[: -len(".safetensors.index.json")] in components
    shard = _WEIGHT_SHARD.fullmatch(name)
    if shard:
        return shard.group(1) in components
    return name.endswith(".safetensors") and name[: -len(".safetensors")] in components


def owned_names(names: Collection[str], doc: dict[str, object] | None, components: set[str],
                save_id_of: Callable[[str], str | None]) -> set[str]:
    """The entries ``names`` that a save of ``components`` replacing the checkpoint owns.

    ``doc``: the old manifest as plain JSON (None if absent or damaged); ``save_id_of``:
    the save id in a listed file's header (None where it has none, or is no regular file).

    >>> doc = {"save_id": "a1", "files": {"model.safetensors": {}, "config.json": {}}, "components": {"model": {}}}
    >>> sorted(owned_names(["model.safetensors", "config.json", "shardpoint.json", "notes"], doc, set(),
    ...                    lambda name: "a1"))
    ['model.safetensors', 'shardpoint.json']
    >>> sorted(owned_names(["model.safetensors", "shardpoint.json"], doc, set(), lambda name: None))
    ['shardpoint.json']
    """
    owned = {MANIFEST_NAME} | {n for n in names if n.startswith(SAVE_MARKER) or _TABLE.fullmatch(n)}
    files = doc.get("files") if doc else None
    save_id = doc.get("save_id") if doc else None
    if isinstance(files, dict) and isinstance(save_id, str):
        present = set(names)
        owned |= {f for f in files if isinstance(f, str) and f in present and "/" not in f
                  and f.endswith(".safetensors") and save_id_of(f) == save_id}
    own = {c for c in manifest_components(doc) if any(_of_component(f, c) for f in owned)}
    owned |= {index_name(c) for c in own}
    every = components | own
    owned |= {n for n in names if is_weight_file_of(n, every)}
    return owned & set(names) | {MANIFEST_NAME}


def _of_component(name: str, component: str) -> bool:
    return name.startswith((f"{component}.", f"{component}-")) and name.endswith(".safetensors")
