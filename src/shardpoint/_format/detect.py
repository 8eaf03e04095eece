"""Which checkpoint format a path holds, decided from names alone (and a file's first bytes).

:func:`detect` is the one format detector: every entry point (``load``, ``load_into``,
``verify``, ``convert``, ``diff``, ``inspect``, the streaming sources, local or remote) lists
the directory (or names the file and its directory's listing), reads at most the first
:data:`HEAD_BYTES` bytes of a file the user named, and asks it what to read. It does no I/O.

The rules, in order, for a directory listing:

1. ``shardpoint.json``: a shardpoint checkpoint (whatever else is there).
2. ``shardpoint.pending`` and no manifest: a save that never committed (refused).
3. ``.safetensors`` data files (a Hugging Face safetensors checkpoint, as ``transformers``
   chooses): ``model.safetensors``; else the one ``*.safetensors.index.json``
   (``model.safetensors.index.json`` among several); else the one ``.safetensors`` file.
   ``.bin`` / ``.pt`` weights beside them are skipped (listed in :attr:`Detected.skipped`).
4. DCP's ``.metadata``: a ``torch.distributed.checkpoint`` directory. (torchtitan's layout
   is a DCP directory too; it is told apart only from the ``.metadata`` pickle, by the
   DCP reader, never from the listing.)
5. ``*.bin.index.json`` (``pytorch_model.bin.index.json`` among several): HF ``.bin`` shards.
6. One ``torch.save`` weights file: ``pytorch_model.bin``, else the only ``.bin`` / ``.pt``
   / ``.pth`` / ``.ckpt`` that is not training state (``training_args.bin``, ``optimizer.pt``).
7. A ``*.safetensors.index.json`` whose data files are all gone: that index (the reader
   reports the missing shards).
8. Anything else: ``unknown``, with the reason.

For a file the user named: a ``.safetensors`` name is a safetensors file (when its first
bytes are a zip archive or a pickle, the header reader says so: :func:`sniff`); a ``.bin`` / ``.pt`` / ``.pth`` / ``.ckpt`` name, or any name whose
first bytes are a zip archive or a pickle, is a ``torch.save`` file, read from its
same-stem ``.safetensors`` sibling when one sits beside it (same tensors, no unpickling).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from .companions import PICKLE_WEIGHTS, torch_weights_file
from .manifest import MANIFEST_NAME, PENDING_NAME
from .names import is_tmp_name
from .safetensors import sniff

HEAD_BYTES = 16
"""How many leading bytes of a named file :func:`detect` looks at."""

SHARDPOINT = "shardpoint"
UNCOMMITTED = "uncommitted"
HF_INDEX = "hf-index"
HF_FILE = "hf-file"
DCP = "dcp"
HF_BIN = "hf-bin"
TORCH_SAVE = "torch-save"
UNKNOWN = "unknown"

KINDS = (SHARDPOINT, UNCOMMITTED, HF_INDEX, HF_FILE, DCP, HF_BIN, TORCH_SAVE, UNKNOWN)
"""Every kind :func:`detect` names."""

SAFETENSORS_INDEX = ".safetensors.index.json"
BIN_INDEX = ".bin.index.json"
DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class Detected:
    """What :func:`detect` found: the kind and the files that matter."""

    kind: str
    """One of :data:`KINDS`: ``shardpoint``, ``uncommitted`` (``shardpoint.pending``, no
    manifest), ``hf-index``, ``hf-file`` (one safetensors file), ``dcp``, ``hf-bin`` (``.bin``
    shards and their index), ``torch-save`` (one ``torch.save`` file) or ``unknown``."""
    index: str | None = None
    """The control file to read first: ``shardpoint.json``, the chosen
    ``*.safetensors.index.json`` or ``*.bin.index.json``, DCP's ``.metadata``; else None."""
    file: str | None = None
    """The one data file to read (``hf-file``, ``torch-save``); else None (the index names them)."""
    instead_of: str | None = None
    """The named ``torch.save`` file that ``file``, its same-stem ``.safetensors`` sibling,
    is read instead of."""
    skipped: tuple[str, ...] = ()
    """``.bin`` / ``.pt`` weights beside the safetensors ones, not read."""
    reason: str = ""
    """For ``unknown`` and ``uncommitted``: what was found, to follow the location in a message."""
    named_file: bool = False
    """The user named a file (not a directory)."""


def detect(names: Collection[str], *, file: str | None = None, head: bytes | None = None) -> Detected:
    """What to read at a path, from the names there; pure (no I/O).

    Args:
        names: the directory's listing: the checkpoint directory's, or, when ``file`` is
            given, the listing of the directory holding that file (for the sibling rule; a
            listing that does not hold ``file`` is fine).
        file: the basename of the file the user named; None for a directory.
        head: the first :data:`HEAD_BYTES` bytes of ``file`` when known (None for an object
            on a store, where it is not fetched).

    Returns:
        A :class:`Detected` (see the module docstring for the rules).

    >>> detect(["shardpoint.json", "model.safetensors"]).kind
    'shardpoint'
    >>> detect(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    ...         "model.safetensors.index.json"]).index
    'model.safetensors.index.json'
    >>> found = detect(["model.pt", "model.safetensors"], file="model.pt")
    >>> found.kind, found.file, found.instead_of
    ('hf-file', 'model.safetensors', 'model.pt')
    """
    listing = set(names)
    if file is not None:
        return _detect_file(file, listing, head)
    return _detect_dir(listing)


def _detect_file(name: str, siblings: set[str], head: bytes | None) -> Detected:
    looks = sniff(head)
    if name.endswith(".safetensors") or looks == "safetensors":  # the first bytes decide, as for pickles
        return Detected(HF_FILE, file=name, named_file=True)
    if name.endswith(PICKLE_WEIGHTS) or looks in ("zip", "pickle"):
        sibling = name.rpartition(".")[0] + ".safetensors" if "." in name else name + ".safetensors"
        if sibling in siblings:
            return Detected(HF_FILE, file=sibling, instead_of=name, named_file=True)
        return Detected(TORCH_SAVE, file=name, named_file=True)
    return Detected(
        UNKNOWN,
        named_file=True,
        reason="is a file but neither a .safetensors file nor a torch.save file (.bin, .pt, .pth, "
        ".ckpt, or a zip archive / pickle); shardpoint reads checkpoint directories and files of those kinds",
    )


def _detect_dir(names: set[str]) -> Detected:
    if MANIFEST_NAME in names:
        return Detected(SHARDPOINT, index=MANIFEST_NAME)
    if PENDING_NAME in names:
        return Detected(
            UNCOMMITTED,
            reason=f"is a save that never committed ({PENDING_NAME} is there, {MANIFEST_NAME} is "
            "not): it was interrupted or is still running",
        )
    singles = sorted(n for n in names if n.endswith(".safetensors"))
    indexes = sorted(n for n in names if n.endswith(SAFETENSORS_INDEX))
    bin_indexes = sorted(n for n in names if n.endswith(BIN_INDEX))
    weights, candidates = torch_weights_file(sorted(names))
    if singles:
        skipped = tuple(sorted({*bin_indexes, *candidates}))
        if "model.safetensors" in singles:
            return Detected(HF_FILE, file="model.safetensors", skipped=skipped)
        if len(indexes) > 1 and "model.safetensors.index.json" in indexes:
            indexes = ["model.safetensors.index.json"]
        if len(indexes) == 1:
            return Detected(HF_INDEX, index=indexes[0], skipped=skipped)
        if len(singles) == 1:
            return Detected(HF_FILE, file=singles[0], skipped=skipped)
        return Detected(UNKNOWN, reason=_not_a_checkpoint(singles, indexes, candidates, names))
    if DCP_METADATA in names:
        return Detected(DCP, index=DCP_METADATA)
    if bin_indexes:
        chosen = "pytorch_model.bin.index.json" if "pytorch_model.bin.index.json" in bin_indexes else bin_indexes[0]
        return Detected(HF_BIN, index=chosen)
    if weights is not None:
        return Detected(TORCH_SAVE, file=weights)
    if len(indexes) > 1 and "model.safetensors.index.json" in indexes:
        indexes = ["model.safetensors.index.json"]
    if len(indexes) == 1:
        return Detected(HF_INDEX, index=indexes[0])
    if any(is_tmp_name(n) for n in names):
        return Detected(
            UNKNOWN,
            reason="holds no committed checkpoint, only the temporary directory of a save that did not finish",
        )
    return Detected(UNKNOWN, reason=_not_a_checkpoint(singles, indexes, candidates, names))


def _not_a_checkpoint(singles: list[str], indexes: list[str], candidates: list[str],
                      names: set[str] | frozenset[str] = frozenset()) -> str:
    variants = sorted(n for n in names if _VARIANT_INDEX.fullmatch(n))
    variant = (
        f"; it holds {', '.join(variants[:3])}, the index of a save_pretrained(variant=...) save: "
        "from_pretrained(path, variant=...) reads it, and so does shardpoint once it is named "
        "model.safetensors.index.json"
        if variants else ""
    )
    several = (
        f"; of its weights files ({', '.join(repr(n) for n in sorted(singles)[:4])}"
        + (", ..." if len(singles) > 4 else "") + "), give the path of the one to read"
        if len(singles) > 1 and not indexes and not variants
        and not any(re.search(r"-\d{5}-of-\d{5}\.", n) for n in singles) else ""
    )
    return (
        f"is not a checkpoint: no shardpoint.json, no *.safetensors.index.json and no single "
        f".safetensors file (found {len(singles)} .safetensors files, {len(indexes)} indexes), "
        f"no pytorch_model.bin.index.json, no single .bin/.pt weights file (found "
        f"{len(candidates)}) and no DCP .metadata{variant}{several}"
    )


_VARIANT_INDEX = re.compile(r"[^/]*\.safetensors\.index\.[A-Za-z0-9_-]+\.json")
"""``model.safetensors.index.fp16.json``: the index ``save_pretrained(variant="fp16")`` writes."""
