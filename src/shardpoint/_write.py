"""The one writer: every save, of one process or of a process group, runs plan -> write -> commit.

The steps of each rank and the coordinator's plan are in ``_distributed/save.py`` (the
file plan itself is pure: ``_planning/files.py``); this module sequences them over a
:class:`~shardpoint._distributed.group.Group` (a group of one in a single process) and
holds the one place that opens, writes into and commits the storage transaction.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ._checksum import crc32c
from ._distributed import regular, replicas, trees
from ._distributed import save as steps
from ._distributed.group import Group
from ._distributed.plan_cache import PLANS, Offer, fingerprint
from ._format.manifest import MANIFEST_NAME, ComponentRecord
from ._format.names import check_file_name
from ._format.tables import render_table, table_name
from ._io.writes import FileWrite
from ._planning.chunks import ChunkPlan
from ._planning.rules import Rule, plan_rules
from ._prepare import PreparedState
from ._progress import byte_progress
from ._storage import Transaction, open_store
from ._storage.posix import reported
from .errors import InvalidArgumentError, InvalidStateError

_log = logging.getLogger("shardpoint")


@dataclass(frozen=True)
class SaveInfo:
    """What a save wrote."""

    path: str
    save_id: str
    files: dict[str, int]
    """Data file name -> bytes."""
    tensor_bytes: int
    """Bytes of tensor data stored (aliases counted once)."""
    seconds: float
    plan_reused: bool = False
    """A collective save whose structure was the previous save's: it reused that save's
    agreed plan (each rank sent a fingerprint, nobody planned)."""


def json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user's metadata as plain JSON, refused early if it is not."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidStateError(f"metadata must be a dict of JSON values, not {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except RecursionError:
        raise InvalidStateError("metadata nests too deeply to store as JSON; flatten it") from None
    except (TypeError, ValueError) as exc:
        raise InvalidStateError(f"metadata must hold only JSON values (no nan/inf): {exc}") from None


def file_metadata(save_id: str) -> dict[str, str]:
    """The ``__metadata__`` of every data file of a save: ``format`` as transformers
    expects, and the save id that ties the file to its manifest."""
    return {"format": "pt", "shardpoint.save_id": save_id}


class _Assignment(NamedTuple):
    """What the coordinator tells a rank after planning."""

    save_id: str
    directory: str
    to_write: list[ChunkPlan] | None
    """The chunks (or row pieces of replicated ones) this rank writes; None when the rank
    works them out itself (a save by rules) or holds them from the plan it reuses."""
    hf_part: steps.HfPart | None
    """Layout ``hf``: which files this rank writes whole, where its chunks go in shared ones."""
    total: int
    """Bytes of every distinct chunk, all ranks together."""
    ranks_here: int
    """Ranks on this rank's machine (same host name): they share its CPUs for writing."""
    plan_id: str
    reused: bool
    """The plan is the previous save's (the rank holds its part of it)."""
    by_rules: bool
    """Every rank described the state by the same rules (``_distributed/regular.py``)."""


RESEND = "resend"
"""The coordinator's answer when a rank left out a chunk list the coordinator does not hold."""
RESEND_TREES = "resend-trees"
"""The coordinator's answer when the ranks' trees differ: (it, the components whose trees it needs)."""
RESEND_VALUES = "resend-values"
"""The coordinator's answer when the ranks' plain tensors differ (``_distributed/replicas.py``):
(it, the components whose tensors' samples it needs, to name the one that differs)."""


_RankReport = tuple[Any, Any]
"""A rank's report after writing: ``chunked``, (chunk refs, its files and sizes); ``hf``,
(crc32c of each (file, tensor) of the files it wrote whole, the runs it wrote in shared ones)."""


class Written(NamedTuple):
    """What a save put in its transaction, for the manifest."""

    save_id: str
    layout: str
    world_size: int
    records: dict[str, ComponentRecord]
    files: dict[str, int]
    """Data file name -> bytes."""
    indexes: dict[str, bytes]
    """Index file name -> bytes."""
    tables: tuple[tuple[int, int] | None, ...] = ()
    """(size, crc32c) of each rank's table (a save by rules; None: the rank wrote none)."""


def commit_written(
    txn: Transaction,
    prepared: PreparedState,
    written: Written,
    *,
    metadata: dict[str, Any],
    durable: bool,
    extras: Mapping[str, bytes] | None = None,
) -> None:
    """The last step of every save (``_reuse``'s linked ones too): the extra files, the
    indexes, the manifest (the commit marker), then the transaction's commit."""
    for name, data in (extras or {}).items():
        txn.write_bytes(name, data, durable=durable)
    steps.write_manifest(txn, prepared, written.records, written.files, written.indexes, save_id=written.save_id,
                         layout=written.layout, world_size=written.world_size, metadata=metadata, durable=durable,
                         tables=written.tables)
    txn.commit(durable=durable)


def write_checkpoint(
    prepared: PreparedState,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int,
    overwrite: bool,
    metadata: dict[str, Any],
    durable: bool,
    progress: bool | None,
    group: Group | None = None,
    layout: str = "hf",
    extra_files: Mapping[str, bytes] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    produce: Callable[..., dict[tuple[str, str], int]] | None = None,
) -> SaveInfo:
    """Save ``prepared`` at ``path`` over ``group`` (default: this process alone), atomically;
    every rank of the group calls this with its own shards.

    Args:
        layout: ``"hf"`` (whole tensors, HF files) or ``"chunked"`` (each rank's chunks in
            files of its own).
        extra_files: name -> bytes (e.g. ``config.json``) the coordinator writes into the
            same transaction before the manifest, so they appear in the same commit.
        storage_options: ``path`` may be an fsspec URL (``storage_options`` go to its
            filesystem): the files are uploaded under the final prefix, the manifest last.
        produce: writes the planned files in place of :func:`write_files`, taking the
            directory and the files (``convert``: each file's tensors come from its source a
            batch at a time; the planned ones are ``meta`` descriptors).
    """
    started = time.perf_counter()
    group = group if group is not None else Group(None)
    store = open_store(path, storage_options)  # the path resolved once, here
    if layout == "hf" and group.distributed and not store.shared_files:
        raise InvalidArgumentError(
            f"{os.fspath(path)}: layout='hf' in a collective save needs a shared POSIX "
            "filesystem (ranks write parts of the same files), which an object store is not. "
            "Save with layout='chunked' (each rank uploads its own files), then "
            "`shardpoint convert` it to HF files where you need them"
        )
    chunked = layout == "chunked"
    extras = dict(extra_files or {})
    txn: Transaction | None = None
    all_plans: list[list[ChunkPlan]] = []  # the coordinator's, for the manifest
    hf_files: steps.HfFiles | None = None
    by_rules = chunked and group.distributed  # a regular state is then planned by rules
    resend = False
    trees_wanted: list[str] | None = None  # components whose trees the coordinator asked for
    values_wanted: list[str] | None = None  # components whose plain tensors' samples it asked for
    sampled: dict[tuple[str, str], int] = {}  # each plain tensor's sample, taken once for every round
    merged_trees: dict[str, Any] = {}  # the coordinator's: component -> every rank's (tree, aliases) merged

    # Messages travel as plain tuples (``Offer``, ``_Assignment`` rebuilt on arrival): a
    # coordinator of 16 384 ranks pickles and unpickles one per rank, every save.
    def plan() -> tuple[_Local, tuple[Any, ...]]:
        host = socket.gethostname()
        # Each component's tree as a digest; the trees themselves when the coordinator asks.
        # Likewise one digest per component of its plain tensors' samples, and each tensor's
        # where the coordinator asks (their digests differed, or the trees did: ranks of their own).
        asked = [*(values_wanted or ()), *(trees_wanted or ())]
        shape = ((trees.digests(prepared), None if trees_wanted is None else trees.trees_of(prepared, trees_wanted),
                  tuple(replicas.Samples(replicas.digests(prepared, sampled),
                                         replicas.tensor_digests(prepared, asked, sampled))))
                 if group.distributed else ({}, None, None))
        if by_rules:
            desc = regular.describe(prepared, group.ranks)
            if desc is not None:
                fp = "rules:" + regular.digest(desc.entries, group.world_size)
                return _Local(desc, [], {}, fp), (tuple(PLANS.offer(fp, None, host, rules=True)), *shape)
        mine, local_tensors = steps._plan_local(prepared)
        fp = fingerprint(layout, group.world_size, group.rank, mine)
        return _Local(None, mine, local_tensors, fp), (tuple(PLANS.offer(fp, mine, host, rules=False, full=resend)),
                                                       *shape)

    def assign(sent: list[tuple[Any, ...]]) -> list[tuple[Any, ...] | str]:
        """The coordinator: who writes what (or the plan agreed before), then the transaction."""
        nonlocal txn, all_plans, hf_files, merged_trees
        offers = [Offer._make(o[0]) for o in sent]
        differ = trees.differing([o[1] for o in sent]) if group.distributed else []
        if differ and sent[0][2] is None:
            return [(RESEND_TREES, differ)] * len(offers)  # some ranks hold entries of their own
        merged_trees = trees.merged([o[2] for o in sent], differ) if differ else {}
        agreed = PLANS.agreed(offers)
        rules = all(o.fingerprint == offers[0].fingerprint for o in offers) and offers[0].fingerprint.startswith("rules:")
        total = 0
        writes: list[list[ChunkPlan]] = [[] for _ in offers]
        if rules:
            plan_id = agreed[0] if agreed is not None else PLANS.agree(offers, None)
        elif agreed is not None:
            plan_id, (all_plans, writes, total) = agreed
        else:
            lists = PLANS.lists(offers)  # the ranks that changed sent theirs; the others' are known
            if lists is None:
                PLANS.resend()
                return [RESEND] * len(offers)  # a rank left out a list this coordinator does not hold
            steps.check_names(prepared, lists, trees.tensor_names(merged_trees))
            steps.check_agreement(lists)
            all_plans, writes, total = steps.assign(lists, chunked=chunked)
            plan_id = PLANS.agree(offers, (all_plans, writes, total), lists)
        if group.distributed:
            samples = [replicas.Samples._make(o[3]) for o in sent]
            replicas.refuse(samples, asked=values_wanted is not None)  # a tensor's samples differ: name it
            drifted = replicas.differing(samples, skip=set(differ))  # trees that differ: compared by tensor
            if drifted:
                return [(RESEND_VALUES, drifted)] * len(offers)  # some plain tensor differs between ranks
        save_id = uuid.uuid4().hex
        if not chunked:
            hf_files = steps.plan_hf(prepared, all_plans, max_shard_bytes, file_metadata(save_id))
        _check_extras(extras, hf_files, path)
        parts: Sequence[steps.HfPart | None] = [None] * len(offers) if hf_files is None else hf_files.parts(writes)
        txn = store.open_transaction(overwrite=overwrite)
        per_host = Counter(o.host for o in offers)  # not hosts.count per rank: quadratic over thousands
        reused = agreed is not None
        return [(save_id, txn.directory, None if reused or rules else w, part, total, per_host[o.host],
                 plan_id, reused, rules)
                for w, part, o in zip(writes, parts, offers, strict=True)]

    try:
        for _attempt in range(4):
            local_state, answer = group.exchange(
                "planning the save", plan, assign, deciding="creating the checkpoint directory",
                # The call's arguments too: a rank asking not to overwrite, or for another layout or
                # shard size, must not be settled in rank 0's favour without a word.
                identity=(f"saving to {store.location} (overwrite={overwrite}, layout={layout}, "
                          f"max_shard_size={max_shard_bytes})"),
            )
            if isinstance(answer, tuple) and answer[0] == RESEND_TREES:
                by_rules, trees_wanted = False, list(answer[1])  # merged from every rank's: planned from lists
                continue
            if isinstance(answer, tuple) and answer[0] == RESEND_VALUES:
                values_wanted = list(answer[1])  # each tensor's sample, to name the one that differs
                continue
            if answer != RESEND:
                break
            by_rules, resend = False, True  # someone's chunk list is needed: every rank sends its own
        job = _Assignment._make(answer)
        file_meta = file_metadata(job.save_id)
        threads, segment = steps.io_share(job.ranks_here)
        local = produce or steps.local_writer(threads, segment)
        rules_held: list[Rule] = []
        if job.by_rules:
            desc = local_state.desc
            assert desc is not None
            rules_held = (PLANS.mine(local_state.fp, job.plan_id) if job.reused else None) or []
            if not rules_held:
                rules_held = plan_rules(desc.entries, group.world_size)
                PLANS.keep_mine(local_state.fp, job.plan_id, rules_held)
            to_write, local_tensors = regular.my_writes(desc, rules_held, group.rank, group.world_size)
            total = regular.total_bytes(desc.entries)
        else:
            local_tensors = local_state.local_tensors
            to_write = job.to_write if job.to_write is not None else PLANS.mine(local_state.fp, job.plan_id)
            PLANS.keep_mine(local_state.fp, job.plan_id, to_write)
            total = job.total

        def write() -> tuple[dict[str, int] | None, _RankReport]:
            target = store.writing_into(job.directory)  # where the coordinator's transaction writes
            nbytes = sum(p.nbytes for p in to_write)
            what = f"saving rank {group.rank}" if group.distributed else f"saving {os.path.basename(os.fspath(path))}"
            with reported(path, "writing its data files"), byte_progress(nbytes, what, progress) as advance:

                def write_whole(files: Sequence[FileWrite]) -> dict[tuple[str, str], int]:
                    if txn is not None and not group.distributed:  # the process alone: its transaction
                        return txn.write_files(files, durable=durable, advance=advance, write=produce)
                    return target.write_data_files(files, durable=durable, advance=advance, local=local)

                if job.by_rules:
                    assert local_state.desc is not None
                    refs, files = steps._write_chunked(to_write, local_tensors, group.rank, max_shard_bytes,
                                                       file_meta, threads, write_whole)
                    rows = regular.table_rows(local_state.desc, rules_held, refs)
                    if not rows:  # nothing written here (most ranks of a DDP state): no table
                        return files, (files, None)
                    table = render_table(job.save_id, group.rank, files, rows)
                    write_whole([FileWrite(table_name(group.rank), table, len(table), ())])
                    return files, (files, (len(table), crc32c(table)))
                if job.hf_part is None:
                    pieces = steps.pieces(to_write, local_state.mine, local_tensors)
                    refs, files = steps._write_chunked(to_write, pieces, group.rank, max_shard_bytes,
                                                       file_meta, threads, write_whole)
                    return None, (refs, files)
                return None, steps.write_hf_part(to_write, local_tensors, job.hf_part, job.directory,
                                           durable=durable, advance=advance, threads=threads, segment=segment,
                                           write=write_whole)

        def commit(reports: list[_RankReport]) -> list[dict[str, int] | None]:
            """The coordinator, once every rank has written: extras, indexes, the manifest, commit."""
            assert txn is not None
            whole = trees.with_trees(prepared, merged_trees)  # every rank's entries in the manifest's trees
            if job.by_rules:
                assert local_state.desc is not None
                comps = regular.records(whole, local_state.desc, rules_held)
                everything = {name: size for files, _ in reports for name, size in files.items()}
                written = Written(job.save_id, layout, group.world_size, comps, {}, {},
                                  tuple(table for _, table in reports))
                commit_written(txn, whole, written, metadata=metadata, durable=durable, extras=extras)
                return [everything] + [None] * (group.world_size - 1)  # the others know their own
            if hf_files is None:
                records = steps.chunked_records(whole, all_plans, reports)
            else:
                records = steps.hf_records(whole, reports, hf_files)
            written = Written(job.save_id, layout, group.world_size, *records)
            commit_written(txn, whole, written, metadata=metadata, durable=durable, extras=extras)
            return [written.files] * group.world_size

        own_files, data_files = group.exchange(
            "writing the checkpoint files", write, commit, deciding="committing the checkpoint"
        )
        if data_files is None:  # a save by rules: each rank's SaveInfo names the files it wrote
            data_files = own_files
    except BaseException:
        if txn is not None:
            txn.abort()
        raise
    info = SaveInfo(os.fspath(path), job.save_id, data_files, total, time.perf_counter() - started, job.reused)
    if job.reused:
        _log.debug("%s: reused the plan of the previous save (%s)", os.fspath(path), job.plan_id)
    return info


class _Local(NamedTuple):
    """What a rank found about its own state when planning."""

    desc: regular.Description | None
    mine: list[ChunkPlan]
    local_tensors: dict[tuple[str, str], torch.Tensor]
    fp: str


def _check_extras(extras: Mapping[str, bytes], hf_files: steps.HfFiles | None, path: str | os.PathLike[str]) -> None:
    """Refuse extra files that are not plain names or would replace the checkpoint's own."""
    if not extras:
        return
    own = {MANIFEST_NAME} | set(hf_files.indexes if hf_files is not None else ())
    own |= {f.name for _, f in (hf_files.files if hf_files is not None else ())}
    for name in extras:
        check_file_name(name, where=os.fspath(path))
        if name in own:
            raise InvalidStateError(f"extra file {name!r} would replace a file of the checkpoint itself")
