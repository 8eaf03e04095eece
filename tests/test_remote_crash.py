"""SIGKILL during saves to S3, and two processes saving one prefix, against the real S3
server (SeaweedFS on loopback, the session fixture of ``conftest.py``).

The kills are real. A helper process (this file run as a script) imports torch, s3fs and
shardpoint once and forks one child per round, so a round costs a fork, not an interpreter
start. The helper never talks to S3 itself, so no child inherits a connection; for rounds
run one after another, the next child is forked ahead and connects while the test checks
the previous round. A child wraps its own s3fs filesystem with ``S3Faults``
(``test_remote_faults.py``: the calls that write or delete objects under the prefix),
writes each step's label to a trace file as the step begins, and sends itself ``SIGKILL``
before or after step *n*; or the helper kills it (``os.kill(pid, SIGKILL)``) after a
random delay. Nothing of S3 is mocked. The checks run in the test process:

- at every step of a first save and of an overwrite, before and after each write or
  delete: the objects left are exactly those of the steps that ran; the prefix loads the
  previous checkpoint bit-exactly until its manifest is deleted, refuses to load (naming
  the prefix) from then until the new manifest is stored, and loads the new checkpoint
  from then on (a marker left beside it is ignored); the next save removes every leftover;
- at every step of a ``CheckpointManager`` save (upload, manifest, ``latest``, retention);
- at random moments of a multi-object save: one of those three outcomes, as the trace
  says, never another;
- a training loop saving asynchronously with ``CheckpointManager``, killed and resumed:
  it always resumes from a whole step;
- two processes saving one prefix (paused at the commit, or unsynchronized): the prefix
  loads one whole version bit-exactly or refuses to load naming the prefix, never a mix.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

import shardpoint as sp
from _helper_process import HelperProcess
from shardpoint._storage.store import open_store
from test_manager_crash import SMALL, build, mismatch
from test_remote import keys_under, tensors_equal
from test_remote_faults import A, B, S3Faults, _weights, keys_of, no_open_multipart_uploads

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'shardpoint[s3]')")

# ------------------------------------------------------------------------------ states


def values(version: int, i: int, numel: int) -> torch.Tensor:
    """Exact float32 integers below 2**24, distinct per tensor and per version."""
    v = torch.arange(numel, dtype=torch.int64).mul_(2 * i + 1).add_(version * 7919 + i * 104729)
    return v.bitwise_and_((1 << 24) - 1).to(torch.float32)


def versioned(version: int, tensors: int = 2, numel: int = 100) -> dict[str, torch.Tensor]:
    return {f"t{i}": values(version, i, numel) for i in range(tensors)}


def make_state(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    if "name" in spec:
        return {"A": A, "B": B}[spec["name"]]
    return versioned(spec["version"], spec.get("tensors", 2), spec.get("numel", 100))


# ------------------------------------------------------------------------ the helper


class Helper(HelperProcess):
    """The fork server (this file as a script): one JSON command per line, one reply per line."""

    def __init__(self, workdir: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one upload thread: see _helper_main
        super().__init__(__file__, workdir, env=env)
        assert self.call({"op": "ping"}) == {"pong": True}

    def run(self, cmd: dict[str, Any], *, kill_after: float | None = None) -> dict[str, Any]:
        """One child running ``cmd``; killed ``kill_after`` seconds after it is connected."""
        reply = self.call({"op": "run", "cmd": cmd, "kill_after": kill_after})
        if not reply["ready"]:
            raise AssertionError(f"the child died before it was ready:\n{self.log.read_text()[-4000:]}")
        return reply


@pytest.fixture(scope="module")
def helper(s3: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helper]:
    h = Helper(tmp_path_factory.mktemp("remote-crash-helper"))
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def one_thread(use_options: Any) -> None:
    """Steps in the same order here (dry runs) as in the helper's children."""
    use_options(remote=sp.RemoteOptions(threads=1))


def save_job(url: str, opts: dict[str, Any], state: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"job": "save", "url": url, "options": opts, "state": state, "max_shard_size": 500,
            "overwrite": False, **extra}


def dry_steps(url: str, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, save: Any) -> list[str]:
    """The steps of a fault-free ``save()`` under ``url``, run in this process."""
    with monkeypatch.context() as m:
        dry = S3Faults(url, opts)
        dry.install(m)
        save()
    return dry.steps


def after_steps(keys: list[str], steps: list[str]) -> list[str]:
    """The objects under a prefix that held ``keys``, once ``steps`` ran."""
    held = set(keys)
    for label in steps:
        verb, name = label.split(" ", 1)
        if verb == "delete":
            held.discard(name)
        else:
            held.add(name)
    return sorted(held)


def refused(prefix: str, opts: dict[str, Any], where: str) -> str:
    """The prefix refuses to load, naming itself: a save that never committed, or nothing."""
    with pytest.raises(sp.CheckpointError) as info:
        sp.load(prefix, storage_options=opts)
    text = str(info.value)
    assert isinstance(info.value, (sp.IncompleteCheckpointError, sp.CheckpointNotFoundError)), (where, repr(info.value))
    assert f"{prefix} is a save that never committed" in text or f"{prefix} holds no objects" in text, (where, text)
    return "refused"


# --------------------------------------------------------------- SIGKILL at every step


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("scenario", ["first-save", "overwrite"])
def test_sigkill_at_every_step_of_an_s3_save(
    scenario: str, when: str, helper: Helper, url: str, opts: dict[str, Any], fs: Any,
    monkeypatch: pytest.MonkeyPatch, one_thread: None, tmp_path: Path,
) -> None:
    """``before``: killed as step *n* begins (the call is never made); ``after``: killed as it
    returns (an upload: once its object is committed). Overwrite is not atomic on a store:
    between the deletion of the old manifest and the new manifest the prefix holds no
    checkpoint (documented), and refuses to load naming itself, never loading as a mix."""
    overwrite = scenario == "overwrite"
    old_keys = keys_of(3) if overwrite else []

    def prepare(prefix: str) -> None:
        if overwrite:
            sp.save(A, prefix, storage_options=opts, max_shard_size=500)

    prefix = f"{url}/dry"
    prepare(prefix)
    steps = dry_steps(prefix, opts, monkeypatch, lambda: sp.save(
        B, prefix, storage_options=opts, max_shard_size=500, overwrite=overwrite))
    assert len(steps) == (11 if overwrite else 6), steps
    commit = steps.index("put shardpoint.json") + 1
    # one child per step, all at once, each on its own prefix
    jobs = []
    for at in range(1, len(steps) + 1):
        prepare(f"{url}/at{at}")
        jobs.append(save_job(f"{url}/at{at}", opts, {"name": "B"}, overwrite=overwrite, at=at,
                             action=f"kill-{when}", trace=str(tmp_path / f"trace{at}")))
    statuses = helper.call({"op": "batch", "cmds": jobs})["statuses"]
    outcomes = []
    for at, label in enumerate(steps, start=1):
        where = f"SIGKILL {when} step {at}/{len(steps)} ({label})"
        prefix = f"{url}/at{at}"
        assert statuses[at - 1]["killed"], (where, statuses[at - 1], helper.log.read_text()[-3000:])
        assert (tmp_path / f"trace{at}").read_text().splitlines() == steps[:at], where  # same steps
        ran = steps[:at] if when == "after" else steps[: at - 1]
        keys = keys_under(fs, prefix)
        assert keys == after_steps(old_keys, ran), (where, keys)  # exactly what the steps left
        assert no_open_multipart_uploads(fs, prefix), where
        if "put shardpoint.json" in ran:  # committed: the new one (a marker beside it is ignored)
            assert tensors_equal(sp.load(prefix, storage_options=opts), B), where
            outcomes.append("new")
        elif "shardpoint.json" in keys:  # the old manifest is not deleted yet: the old one, whole
            assert tensors_equal(sp.load(prefix, storage_options=opts), A), where
            outcomes.append("old")
        else:
            outcomes.append(refused(prefix, opts, where))
        # the next save replaces what is left (a dead save's prefix needs no overwrite=True)
        again = versioned(9)
        sp.save(again, prefix, storage_options=opts, max_shard_size=500, overwrite="shardpoint.json" in keys)
        assert keys_under(fs, prefix) == keys_of(2), where
        assert tensors_equal(sp.load(prefix, storage_options=opts), again), where
    # the documented order: the old checkpoint while its manifest is there (overwrite: the
    # marker is put, then the old manifest deleted first), nothing loadable until the new
    # manifest is stored, the new checkpoint from then on
    ran_counts = [at if when == "after" else at - 1 for at in range(1, len(steps) + 1)]
    expected = ["new" if r >= commit else "old" if overwrite and r <= 1 else "refused" for r in ran_counts]
    assert outcomes == expected, outcomes


def test_sigkill_at_every_step_of_a_manager_save_on_s3(
    helper: Helper, url: str, opts: dict[str, Any], fs: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None,
    tmp_path: Path,
) -> None:
    """``CheckpointManager(keep_last=2)`` holds steps 1 and 2; step 3's save is killed before
    and after each of its steps: marker, upload, manifest, marker deletion, ``latest``,
    retention's deletion of step 1 (manifest first). The objects left are exactly those of
    the steps that ran; ``restore`` gives step 3 once its manifest is stored, else step 2,
    bit-exactly; an uncommitted step 3 refuses to load naming its prefix, a half-deleted
    step 1 is no step; the next save removes every leftover and leaves the two newest steps
    and ``latest`` (a marker left beside step 3's manifest stays, ignored, until retention
    deletes step 3, as documented)."""
    root = f"{url}/dry"
    mgr = sp.CheckpointManager(root, keep_last=2, storage_options=opts)
    for step in (1, 2):
        mgr.save(step, {"model": _weights(step), "step": step})
    before = keys_under(fs, root)
    steps = dry_steps(root, opts, monkeypatch, lambda: mgr.save(3, {"model": _weights(3), "step": 3}))
    assert steps[:5] == ["put step-000003/shardpoint.pending", "upload step-000003/model.safetensors",
                         "put step-000003/shardpoint.json", "delete step-000003/shardpoint.pending", "put latest"], steps
    assert steps[5:] == ["put step-000001/shardpoint.pending", "delete step-000001/shardpoint.json",
                         "delete step-000001/model.safetensors", "delete step-000001/shardpoint.pending"], steps
    rounds = [(at, when) for when in ("before", "after") for at in range(1, len(steps) + 1)]
    jobs = [{"job": "manager", "url": f"{url}/{when}{at}", "options": opts, "prepare": [1, 2], "step": 3, "at": at,
             "action": f"kill-{when}", "trace": str(tmp_path / f"{when}{at}")} for at, when in rounds]
    statuses = helper.call({"op": "batch", "cmds": jobs})["statuses"]
    for (at, when), status in zip(rounds, statuses, strict=True):
        where = f"SIGKILL {when} step {at}/{len(steps)} ({steps[at - 1]})"
        root = f"{url}/{when}{at}"
        assert status["killed"], (where, status, helper.log.read_text()[-3000:])
        assert (tmp_path / f"{when}{at}").read_text().splitlines() == steps[:at], where
        ran = steps[:at] if when == "after" else steps[: at - 1]
        keys = keys_under(fs, root)
        assert keys == after_steps(before, ran), (where, keys)
        assert no_open_multipart_uploads(fs, root), where
        newest = 3 if "put step-000003/shardpoint.json" in ran else 2
        fresh = sp.CheckpointManager(root, keep_last=2, storage_options=opts)
        assert fresh.latest_step() == newest, where
        target = {"model": {k: torch.zeros_like(v) for k, v in _weights(0).items()}, "step": 0}
        assert fresh.restore(target) == newest, where
        assert target["step"] == newest and tensors_equal(target["model"], _weights(newest)), where
        assert fresh.steps() == ([2, 3] if "delete step-000001/shardpoint.json" in ran else [1, 2, 3][: newest]), where
        if newest == 2 and any(k.startswith("step-000003/") for k in keys):
            refused(f"{root}/step-000003", opts, where)
        if "delete step-000001/shardpoint.json" in ran and any(k.startswith("step-000001/") for k in keys):
            refused(f"{root}/step-000001", opts, where)  # retention cut short: never read as HF
        fresh.save(4, {"model": _weights(4), "step": 4})
        keys = keys_under(fs, root)
        assert {k.split("/")[0] for k in keys} == {f"step-00000{newest}", "step-000004", "latest"}, (where, keys)
        stray = ["step-000003/shardpoint.pending"] if newest == 3 and "delete step-000003/shardpoint.pending" not in ran else []
        assert [k for k in keys if k.endswith("shardpoint.pending")] == stray, (where, keys)
        assert fs.cat_file(f"{root.removeprefix('s3://')}/latest") == b"step-000004\n", where


# ------------------------------------------------------------- SIGKILL at random moments

RANDOM_KILLS = 6
BIG = {"tensors": 6, "numel": 32768}  # 6 tensors of 128 KiB: one object each
BIG_SHARD = 150_000


def allowed_outcomes(ran: list[str], killed: bool, overwrite: bool) -> set[str]:
    """What the prefix may hold after a kill, from the steps that began (the last one may
    or may not have happened)."""
    if not killed or ("put shardpoint.json" in ran and ran[-1] != "put shardpoint.json"):
        return {"new"}
    maybe_new = {"new"} if ran[-1:] == ["put shardpoint.json"] else set()
    if not overwrite or ("delete shardpoint.json" in ran and ran[-1] != "delete shardpoint.json"):
        return maybe_new | {"refused"}
    if ran[-1:] == ["delete shardpoint.json"]:
        return {"old", "refused"}
    return {"old"}


@pytest.mark.parametrize("scenario", ["overwrite", "first-save"])
def test_sigkill_at_random_moments_of_an_s3_save(
    scenario: str, helper: Helper, url: str, opts: dict[str, Any], fs: Any, tmp_path: Path
) -> None:
    """A 768 KiB save in 6 objects (3 uploads at a time), killed by the helper after a seeded
    random delay, one in each sixth of 1.5 times a save's duration (measured, and shortened
    when a save outruns it). The trace says which steps began; the prefix holds what they
    allow: the old checkpoint (overwrite, old manifest not deleted yet), nothing loadable
    (refused, naming the prefix), or the new checkpoint once its manifest is stored. Bit for
    bit, never another state; the next save replaces every leftover object. (An upload cut
    between its start and its commit can leave an incomplete multipart upload: invisible to
    listings and loads, and not removed by the next save; counted in the summary.)"""
    overwrite = scenario == "overwrite"
    old, new = versioned(1, **BIG), versioned(2, **BIG)

    def prepare(prefix: str) -> None:
        if overwrite:
            sp.save(old, prefix, storage_options=opts, max_shard_size=BIG_SHARD)

    def job(prefix: str, trace: Path) -> dict[str, Any]:
        return save_job(prefix, opts, {"version": 2, **BIG}, max_shard_size=BIG_SHARD, overwrite=overwrite,
                        remote_threads=3, trace=str(trace))

    spans = []  # how long a save takes, from the child's start (connected) to its exit
    for d in range(2):
        prepare(f"{url}/dry{d}")
        dry = helper.run(job(f"{url}/dry{d}", tmp_path / f"dry{d}"))
        assert dry["exit"] == 0 and not dry["killed"], dry
        spans.append(dry["seconds"])
    span = min(spans)  # a slow outlier would put the later kills after the commit
    rng = random.Random(20250214 + overwrite)
    outcomes: Counter[str] = Counter()
    log, mid_save, orphans, left = [], 0, 0, 0
    for k in range(RANDOM_KILLS):
        # a random delay in the k-th of RANDOM_KILLS equal slices of 1.5 times the span
        after = 1.5 * span * (k + rng.random()) / RANDOM_KILLS
        prefix = f"{url}/k{k}"
        prepare(prefix)
        where = f"kill {k + 1}/{RANDOM_KILLS} after {after * 1e3:.0f} ms"
        trace = tmp_path / f"trace{k}"
        reply = helper.run(job(prefix, trace), kill_after=after)
        assert reply["killed"] or reply["exit"] == 0, (where, reply)
        ran = trace.read_text().splitlines() if trace.exists() else []
        keys = keys_under(fs, prefix)
        try:
            loaded = sp.load(prefix, storage_options=opts)
        except sp.CheckpointError:
            outcome = refused(prefix, opts, where)
            assert not keys or "shardpoint.pending" in keys, (where, keys)  # recognizably partial
            mid_save += bool(keys)
        else:
            outcome = "new" if tensors_equal(loaded, new) else "old" if tensors_equal(loaded, old) else "a mix"
        assert outcome in allowed_outcomes(ran, reply["killed"], overwrite), (where, outcome, ran)
        assert set(keys) <= {*keys_of(6), "shardpoint.pending"}, (where, keys)
        outcomes[outcome] += 1
        orphans += not no_open_multipart_uploads(fs, prefix)  # an upload cut between its start and commit
        log.append(f"{where}: {len(ran)} steps began, last {ran[-1:]}; {outcome}, {len(keys)} objects")
        if not reply["killed"] or ran[-1:] == ["delete shardpoint.pending"]:
            span *= 0.75  # the save ran faster than measured (a busy machine): aim earlier
        again = versioned(3, **BIG)
        sp.save(again, prefix, storage_options=opts, max_shard_size=BIG_SHARD, overwrite=True)
        assert keys_under(fs, prefix) == keys_of(6), where
        assert tensors_equal(sp.load(prefix, storage_options=opts), again), where
        left += not no_open_multipart_uploads(fs, prefix)
    summary = "\n".join([*log, f"save span {span * 1e3:.0f} ms; {dict(outcomes)}, {mid_save} mid-save; {orphans} kills left an "
                                f"incomplete multipart upload (invisible to listings and loads), {left} of "
                                "them still there after the next save"])
    print(summary)  # shown with -rP or on failure
    assert mid_save >= 2, f"too few kills landed in the middle of a save:\n{summary}"


# ------------------------------------------------------ a training loop killed and resumed

TRAIN_KILLS = 6
TRAIN_MAX_KILLS = 12
"""Kills go on past TRAIN_KILLS (up to this) until two of them landed mid-save and a child
cleaned up after one: where a kill lands is chance (1 of 6 did in one suite run)."""
TRAIN_DELAYS = (0.3, 1.8)  # seconds after the child is connected: restore, then a few steps


def objects(fs: Any, url: str) -> dict[str, str]:
    """Every object under ``url``: relative name -> ETag (a new upload has a new one)."""
    root = url.removeprefix("s3://")
    fs.invalidate_cache()
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    return {p[len(root) + 1 :]: str(i.get("ETag")) for p, i in found.items() if i["type"] == "file"}


def _parse(stdout: str) -> dict[str, Any]:
    out: dict[str, Any] = {"restored": "unreported", "saving": [], "committed": []}
    for line in stdout.splitlines():
        word, value = line.split(" ", 1)
        if word == "restored":
            out["restored"] = None if value == "None" else int(value)
        else:
            out[word].append(int(value))
    return out


def check_run(
    url: str, opts: dict[str, Any], fs: Any, *, at_least: int | None, at_most: int | None, where: str
) -> tuple[int | None, dict[str, str]]:
    """What a fresh manager sees under ``url`` is whole. Returns the step ``restore`` gives,
    and the objects (name -> ETag) of step prefixes without a manifest (leftovers)."""
    mgr = sp.CheckpointManager(url, storage_options=opts)
    steps = mgr.steps()
    found = objects(fs, url)
    tops: dict[str, set[str]] = {}
    for name in found:
        top, _, rest = name.partition("/")
        tops.setdefault(top, set()).add(rest)
    leftovers: dict[str, str] = {}
    for top, names in sorted(tops.items()):
        if top == "latest" or top in {f"step-{s:06d}" for s in steps}:
            continue
        assert re.fullmatch(r"step-\d{6}", top), (where, top)
        n = int(top[5:])
        if "shardpoint.pending" in names:  # a save cut short (the step in flight; or a step
            # whose marker outlived its commit, deleted by retention, marker last): never loads
            refused(f"{url}/{top}", opts, f"{where}: {top}")
        else:  # retention cut short (the manifest is deleted first): an older step
            assert steps and n < steps[-1], (where, top, steps)
        leftovers.update({k: e for k, e in found.items() if k.startswith(top + "/")})
    assert len(steps) <= 3, (where, steps)  # keep_last=2, 3 only between commit and retention
    model, opt, state = build(SMALL)
    got = mgr.restore(state)
    assert got == (steps[-1] if steps else None), (where, got, steps)
    assert mgr.latest_step() == got, where
    if at_least is not None:
        assert got is not None and got >= at_least, f"{where}: restored {got}, but {at_least} was reported committed"
    if got is not None:
        assert at_most is not None and got <= at_most, f"{where}: restored {got}, the newest step begun is {at_most}"
        assert (problem := mismatch(model, opt, state, got)) is None, f"{where}: step {got}: {problem}"
    for s in steps[:-1]:
        model, opt, state = build(SMALL)
        assert mgr.restore(state, step=s) == s
        assert (problem := mismatch(model, opt, state, s)) is None, f"{where}: step {s}: {problem}"
    return got, leftovers


def test_sigkill_of_an_async_training_loop_on_s3_always_resumes_from_a_whole_step(
    helper: Helper, url: str, opts: dict[str, Any], fs: Any
) -> None:
    """``test_manager_crash.py``'s crash test on S3, smaller: a child resumes with
    ``restore`` and saves a model and its Adam state (12 objects a step) with
    ``CheckpointManager(keep_last=2, async_save=True)`` at every step, until the helper
    kills it after a seeded random delay; 6 kills, more (up to 12) until two landed mid-save
    and a child cleaned up after one. After each: ``restore`` gives the newest
    committed step, no older than the last one reported committed, exactly; every listed
    step loads exactly; a step prefix without a manifest is either the save in flight
    (marker there: refuses to load) or an older step whose retention was cut short. Once
    the next child's first save returned, such leftovers are gone: a prefix of a step that
    child did not save again is absent, and no data object of theirs survives (a new upload
    of the same step has a new ETag: its header carries a new save id)."""
    rng = random.Random(20250215)
    reported: int | None = None  # the newest step any child reported committed
    begun: int | None = None  # the newest step any child began to save
    newest: int | None = None  # what the root held after the previous kill
    leftovers: dict[str, str] = {}
    mid_save_kills = cleaned = 0
    log = []
    for k in range(TRAIN_MAX_KILLS):
        if k >= TRAIN_KILLS and mid_save_kills >= 2 and cleaned >= 1:
            break
        where = f"kill {k + 1}"
        after = rng.uniform(*TRAIN_DELAYS)
        reply = helper.run({"job": "train", "url": url, "options": opts, "remote_threads": 4},
                           kill_after=after)
        assert reply["killed"], (where, reply, helper.log.read_text()[-3000:])
        seen = _parse(reply["stdout"])
        if seen["restored"] != "unreported":  # resumed exactly where the last child stopped
            assert seen["restored"] == newest, f"{where}: the child restored {seen['restored']}, the root held {newest}"
        if seen["committed"]:
            reported = max(seen["committed"])
        if seen["saving"]:
            begun = max(seen["saving"]) if begun is None else max(begun, *seen["saving"])
        if len(seen["saving"]) >= 2 and leftovers:  # its first save returned: leftovers removed
            now = objects(fs, url)
            resaved = {f"step-{s:06d}" for s in seen["saving"]}
            survivors = sorted(n for n, e in leftovers.items()
                               if n in now and (n.split("/")[0] not in resaved or (now[n] == e and n.endswith(".safetensors"))))
            assert not survivors, f"{where}: leftovers survived a save: {survivors}"
            cleaned += 1
        before = {n.split("/")[0] for n in leftovers}
        newest, leftovers = check_run(url, opts, fs, at_least=reported, at_most=begun, where=where)
        prefixes = sorted({n.split("/")[0] for n in leftovers})
        # a kill that left a step half-written: the save of a step this child began (its
        # first save removed any older prefix of that name), or a new half-deleted step
        mid_save_kills += bool({f"step-{s:06d}" for s in seen["saving"]} & set(prefixes) or set(prefixes) - before)
        last = reply["stdout"].splitlines()[-1:] or ["(nothing)"]
        log.append(f"{where}: after {after * 1e3:4.0f} ms, last said {last[0]!r}; root holds {newest}, "
                   f"leftovers {prefixes}")
    summary = "\n".join([*log, f"{mid_save_kills} kills left a half-written step; the next child removed "
                                f"leftovers {cleaned} times"])
    print(summary)  # shown with -rP or on failure
    assert newest is not None and newest >= 3, summary  # the run made progress across the kills
    assert mid_save_kills >= 2, summary
    assert cleaned >= 1, summary


# ------------------------------------------------------- two processes saving one prefix


def race_result(prefix: str, opts: dict[str, Any], versions: dict[str, dict[str, torch.Tensor]], where: str) -> str:
    """The version that loads bit-exactly, or the error that refuses the prefix (naming it
    and the object). A load that returns anything else is a mix: the test fails."""
    try:
        loaded = sp.load(prefix, storage_options=opts)
    except sp.CheckpointError as exc:
        text = str(exc)
        assert f"{prefix}/" in text or f"{prefix} " in text, (where, text)
        assert isinstance(exc, (sp.CorruptCheckpointError, sp.MissingShardError)), (where, repr(exc))
        return type(exc).__name__
    matches = [name for name, state in versions.items() if tensors_equal(loaded, state)]
    assert len(matches) == 1, f"{where}: the prefix loads as a mix of two saves"
    return matches[0]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_that_commits_while_another_runs_on_s3(
    overwrite: bool, helper: Helper, url: str, opts: dict[str, Any], fs: Any,
    monkeypatch: pytest.MonkeyPatch, one_thread: None, tmp_path: Path,
) -> None:
    """A stops right before its manifest (its objects are uploaded); B saves the prefix start
    to end; then A goes on. B finds a pending marker and no manifest (to B, an interrupted
    save, which it replaces with or without ``overwrite``): it deletes A's objects, uploads
    its own and commits. A then stores its manifest over B's. Both saves return without an
    error (a writer cannot tell that another took its prefix: no conditional writes), and
    the prefix refuses to load: A's manifest lists objects that are B's, which the save id
    tells apart (same names, same sizes). Never B's or A's values as a mix. The next save
    replaces it all."""
    prefix = f"{url}/race"
    steps = dry_steps(f"{url}/dry", opts, monkeypatch, lambda: sp.save(
        versioned(4), f"{url}/dry", storage_options=opts, max_shard_size=500))
    a_state, b_state = versioned(5), versioned(6)
    outcomes = [tmp_path / "a.json", tmp_path / "b.json"]
    a = save_job(prefix, opts, {"version": 5}, overwrite=overwrite, at=steps.index("put shardpoint.json") + 1,
                 action="pause", outcome=str(outcomes[0]))
    b = save_job(prefix, opts, {"version": 6}, overwrite=overwrite, outcome=str(outcomes[1]))
    reply = helper.call({"op": "race", "a": a, "b": b})
    assert reply["paused"] and reply["a"]["exit"] == 0 and reply["b"]["exit"] == 0, reply
    a_out, b_out = (json.loads(o.read_text()) for o in outcomes)
    assert a_out == {"ok": True} and b_out == {"ok": True}, (a_out, b_out)
    assert keys_under(fs, prefix) == keys_of(2)  # A's manifest; B's data objects and index
    assert no_open_multipart_uploads(fs, prefix)
    victim = "model-00001-of-00002.safetensors"
    for attempt in (
        lambda: sp.load(prefix, storage_options=opts),
        lambda: sp.load_into({k: torch.zeros_like(v) for k, v in a_state.items()}, prefix, storage_options=opts),
    ):
        with pytest.raises(sp.CorruptCheckpointError) as info:
            attempt()
        assert f"{prefix}/{victim} belongs to another save" in str(info.value), str(info.value)
    assert race_result(prefix, opts, {"a": a_state, "b": b_state}, "after the race") == "CorruptCheckpointError"
    again = versioned(9)
    sp.save(again, prefix, storage_options=opts, max_shard_size=500, overwrite=True)
    assert keys_under(fs, prefix) == keys_of(2)
    assert tensors_equal(sp.load(prefix, storage_options=opts), again)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_whose_prefix_is_taken_over_stops_before_its_manifest(
    overwrite: bool, helper: Helper, url: str, opts: dict[str, Any], fs: Any,
    monkeypatch: pytest.MonkeyPatch, one_thread: None, tmp_path: Path,
) -> None:
    """A stops right before its index (its data objects are uploaded); B saves the prefix
    start to end; then A goes on. Before its manifest A reads its pending marker back, finds
    it gone (B took the prefix over and committed), raises ``CheckpointExistsError`` naming
    the prefix, and leaves B's objects alone: B's checkpoint loads bit-exactly. (Paused in
    the one request between that check and the manifest, as in the test above, A still
    wins the last write: a store without conditional writes cannot close that window.)"""
    prefix = f"{url}/takeover"
    steps = dry_steps(f"{url}/dry", opts, monkeypatch, lambda: sp.save(
        versioned(4), f"{url}/dry", storage_options=opts, max_shard_size=500))
    a_state, b_state = versioned(5), versioned(6)
    outcomes = [tmp_path / "a.json", tmp_path / "b.json"]
    a = save_job(prefix, opts, {"version": 5}, overwrite=overwrite,
                 at=steps.index("put model.safetensors.index.json") + 1, action="pause", outcome=str(outcomes[0]))
    b = save_job(prefix, opts, {"version": 6}, overwrite=overwrite, outcome=str(outcomes[1]))
    reply = helper.call({"op": "race", "a": a, "b": b})
    assert reply["paused"] and reply["b"]["exit"] == 0, reply
    a_out, b_out = (json.loads(o.read_text()) for o in outcomes)
    assert b_out == {"ok": True}, b_out
    assert a_out["ok"] is False and a_out["type"] == "CheckpointExistsError", a_out
    assert f"{prefix}: another save took this prefix over" in a_out["message"], a_out
    assert "stopped before writing shardpoint.json" in a_out["message"], a_out
    assert keys_under(fs, prefix) == keys_of(2)
    assert no_open_multipart_uploads(fs, prefix)
    assert tensors_equal(sp.load(prefix, storage_options=opts), b_state)
    assert race_result(prefix, opts, {"a": a_state, "b": b_state}, "after the takeover") == "b"


RACES = 3


@pytest.mark.parametrize(
    ("existing", "overwrite"),
    [(False, False), (False, True), (True, True)],
    ids=["same-moment", "same-moment-overwrite", "two-overwriting"],
)
def test_two_processes_saving_one_s3_prefix_at_the_same_moment(
    existing: bool, overwrite: bool, helper: Helper, url: str, opts: dict[str, Any], fs: Any, tmp_path: Path
) -> None:
    """Two children, connected, let go at the same moment, save one prefix (empty, or
    holding a checkpoint both overwrite); 3 prefixes at once. Each save either returns, or
    raises ``CheckpointExistsError`` naming the prefix: without ``overwrite`` having found
    the other's manifest (then the other's checkpoint loads bit-exactly), or, with or
    without it, having found its pending marker replaced by the other save before its
    index or manifest (it stops there, touching nothing of the other's). Otherwise
    the prefix loads one of the two versions bit-exactly, or refuses to load naming the
    prefix and the object whose save id (or absence) gives the mix away. Never a mix."""
    versions = {"a": versioned(7), "b": versioned(8)}
    cmds, prefixes = [], []
    for r in range(RACES):
        prefix = f"{url}/race{r}"
        prefixes.append(prefix)
        if existing:
            sp.save(versioned(1), prefix, storage_options=opts, max_shard_size=500)
        for name, version in (("a", 7), ("b", 8)):
            cmds.append(save_job(prefix, opts, {"version": version}, overwrite=overwrite,
                                 outcome=str(tmp_path / f"{name}{r}.json")))
    statuses = helper.call({"op": "together", "cmds": cmds})["statuses"]
    assert all(st["exit"] == 0 for st in statuses), (statuses, helper.log.read_text()[-3000:])
    results = []
    for r, prefix in enumerate(prefixes):
        where = f"race {r + 1}/{RACES}"
        out = {name: json.loads((tmp_path / f"{name}{r}.json").read_text()) for name in ("a", "b")}
        taken_over = []
        for name, o in out.items():
            if not o["ok"]:
                assert o["type"] == "CheckpointExistsError", (where, name, o)
                if f"{prefix}: another save took this prefix over" in o["message"]:
                    taken_over.append(name)  # found its marker replaced before its index/manifest
                else:
                    assert not overwrite and f"{prefix} already holds a checkpoint" in o["message"], (where, o)
        assert any(o["ok"] for o in out.values()), (where, out)
        result = race_result(prefix, opts, versions, where)
        failed = [name for name, o in out.items() if not o["ok"]]
        winner = "b" if failed == ["a"] else "a"
        if failed and not taken_over:  # the loser saw the winner's manifest and wrote nothing
            assert result == winner, (where, result, out)
        elif failed:  # the loser stopped before its manifest; its uploads may have landed last
            assert result in (winner, "CorruptCheckpointError", "MissingShardError"), (where, result, out)
        assert no_open_multipart_uploads(fs, prefix), where
        results.append(f"{result} ({'both returned' if not failed else f'{failed[0]} refused'})")
        again = versioned(9)
        sp.save(again, prefix, storage_options=opts, max_shard_size=500, overwrite=True)
        assert keys_under(fs, prefix) == keys_of(2), where
        assert tensors_equal(sp.load(prefix, storage_options=opts), again), where
    print(f"after the races the prefixes held: {results}")  # shown with -rP


# ------------------------------------------------------------------------ the helper's side


def _write_outcome(path: str, error: BaseException | None) -> None:
    doc = {"ok": True} if error is None else {"ok": False, "type": type(error).__name__, "message": str(error)}
    with open(path, "w") as f:
        json.dump(doc, f)


def _report(line: str) -> None:
    os.write(1, (line + "\n").encode())  # unbuffered: every line is in the pipe before a kill


def _child(
    cmd: dict[str, Any],
    *,
    ready: int | None = None,
    go: int | None = None,
    pause: tuple[int, int] | None = None,
    close: tuple[int, ...] = (),
) -> NoReturn:
    """In a forked child: connect, say ready, wait for go, run the job, record the outcome."""
    code = 1
    try:
        for fd in close:
            os.close(fd)
        if "remote_threads" in cmd:  # for the rest of this child's life (held by this frame)
            held = sp.using(remote=sp.RemoteOptions(threads=cmd["remote_threads"]))
            held.__enter__()
        trace = os.open(cmd["trace"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if cmd.get("trace") else None

        def log(label: str) -> None:
            if trace is not None:
                os.write(trace, (label + "\n").encode())  # on disk before a kill

        def on_pause(label: str) -> None:
            assert pause is not None
            os.write(pause[0], b"p")
            os.read(pause[1], 1)

        _connect(cmd["url"], cmd["options"])  # the client of a standby child is ready already
        if cmd["job"] == "manager":  # the steps before the one the fault is for, unwatched
            mgr = sp.CheckpointManager(cmd["url"], keep_last=2, storage_options=cmd["options"])
            for step in cmd.get("prepare", []):
                mgr.save(step, {"model": _weights(step), "step": step})
        S3Faults(cmd["url"], cmd["options"], at=cmd.get("at"), action=cmd.get("action", "none"),
                 log=log, on_pause=on_pause).install(pytest.MonkeyPatch())
        if ready is not None:
            os.write(ready, b"r")
        if go is not None:
            os.read(go, 1)
        error: BaseException | None = None
        try:
            if cmd["job"] == "train":
                _train(cmd)
            elif cmd["job"] == "manager":
                mgr.save(cmd["step"], {"model": _weights(cmd["step"]), "step": cmd["step"]})
            else:
                sp.save(make_state(cmd["state"]), cmd["url"], storage_options=cmd["options"],
                        max_shard_size=cmd["max_shard_size"], overwrite=cmd["overwrite"],
                        layout=cmd.get("layout"), progress=False)
        except Exception as exc:
            error = exc
        if cmd.get("outcome"):
            _write_outcome(cmd["outcome"], error)
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


TRAIN_SHARD = "20KB"  # test_manager_crash's small layout: model in 4 objects, optimizer in 8


def _train(cmd: dict[str, Any]) -> None:
    """Resume from the newest committed step, then save every step (async) until killed."""
    from test_manager_crash import fill

    model, opt, state = build(SMALL)
    mgr = sp.CheckpointManager(cmd["url"], keep_last=2, async_save=True, max_shard_size=TRAIN_SHARD,
                               storage_options=cmd["options"])
    restored = mgr.restore(state)
    if restored is not None and (problem := mismatch(model, opt, state, restored)):
        raise AssertionError(f"restored step {restored}: {problem}")
    _report(f"restored {restored}")
    step = 0 if restored is None else restored + 1
    previous = None
    deadline = time.monotonic() + 60  # a guard only: the helper kills us long before
    while time.monotonic() < deadline:
        fill(model, opt, state, step)  # the previous step may still be being uploaded
        _report(f"saving {step}")
        mgr.save(step, state)  # returns once `step` is staged; `previous` is committed
        if previous is not None:
            _report(f"committed {previous}")
        previous, step = step, step + 1
    mgr.wait()


def _status(pid: int, status: int | None = None) -> dict[str, Any]:
    if status is None:
        status = os.waitpid(pid, 0)[1]
    return {
        "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
    }


def _read_until(fd: int, deadline: float, chunks: list[bytes]) -> bool:
    """Collect what ``fd`` gives until ``deadline``; True if it reached end of file."""
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                return True
            chunks.append(data)
    return False


def _connect(url: str, options: dict[str, Any]) -> None:
    """Start the client (the cached s3fs instance shardpoint gets) before the clock starts:
    a listing, and a first PUT (a client's first waits ~0.2 s here) of an object beside the
    prefix (not under it: no step of the save), deleted again."""
    fs = open_store(url, options).fs
    root = url.removeprefix("s3://").rstrip("/")
    with suppress(FileNotFoundError):
        fs.ls(root, refresh=True)
    warm = f"{root}.warm-{os.getpid()}"
    fs.pipe_file(warm, b"")
    fs.rm_file(warm)


class _Standby:
    """A child forked ahead of its round, its client connected while the test checks the
    previous round; it waits for its command on a pipe (end of file: it exits)."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.key = json.dumps(options, sort_keys=True)
        cmd_r, self.cmd_w = os.pipe()
        self.ready_r, ready_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.dup2(out_w, 1)
                for fd in (self.cmd_w, self.ready_r, self.out_r, out_w):
                    os.close(fd)
                _connect(url, options)
                with os.fdopen(cmd_r) as commands:
                    line = commands.readline()
                if line:
                    _child(json.loads(line), ready=ready_w)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        for fd in (cmd_r, ready_w, out_w):
            os.close(fd)

    def close(self) -> None:
        """Let it go unused: it reads end of file and exits."""
        os.close(self.cmd_w)
        os.waitpid(self.pid, 0)
        for fd in (self.ready_r, self.out_r):
            os.close(fd)


_standby: _Standby | None = None


def _run(cmd: dict[str, Any], kill_after: float | None) -> dict[str, Any]:
    """Hand ``cmd`` to the standby child; SIGKILL it ``kill_after`` seconds after it said
    ready (if it still runs). Then fork the next standby, which connects meanwhile."""
    global _standby
    child = _standby
    if child is None or child.key != json.dumps(cmd["options"], sort_keys=True):
        if child is not None:
            child.close()
        child = _Standby(cmd["url"], cmd["options"])
    _standby = None
    os.write(child.cmd_w, (json.dumps(cmd) + "\n").encode())
    os.close(child.cmd_w)
    pid, ready_r, out_r = child.pid, child.ready_r, child.out_r
    is_ready = False
    if select.select([ready_r], [], [], 120)[0]:
        is_ready = os.read(ready_r, 1) == b"r"
    started = time.monotonic()
    chunks: list[bytes] = []
    limit = kill_after if kill_after is not None else 120.0  # a guard: a round is a few seconds
    _read_until(out_r, started + limit, chunks)
    done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        os.kill(pid, signal.SIGKILL)  # not reaped yet, so the pid is still this child
        status = os.waitpid(pid, 0)[1]
    seconds = time.monotonic() - started
    while data := os.read(out_r, 65536):
        chunks.append(data)
    for fd in (ready_r, out_r):
        os.close(fd)
    return {**_status(pid, status), "ready": is_ready, "seconds": seconds, "stdout": b"".join(chunks).decode()}


def _race(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """A runs up to its pause step and waits there; B runs start to end; then A goes on."""
    paused_r, paused_w = os.pipe()
    go_r, go_w = os.pipe()
    pid_a = os.fork()
    if pid_a == 0:
        _child(a, pause=(paused_w, go_r), close=(paused_r, go_w))
    os.close(paused_w)
    os.close(go_r)
    paused = bool(select.select([paused_r], [], [], 120)[0]) and os.read(paused_r, 1) == b"p"
    pid_b = os.fork()
    if pid_b == 0:
        _child(b, close=(paused_r, go_w))
    b_status = _status(pid_b)
    os.write(go_w, b"g")
    a_status = _status(pid_a)
    os.close(paused_r)
    os.close(go_w)
    return {"paused": paused, "a": a_status, "b": b_status}


def _together(cmds: list[dict[str, Any]]) -> dict[str, Any]:
    """Fork one child per command; once all are connected, let them go at the same moment."""
    go_r, go_w = os.pipe()
    pids, readies = [], []
    for cmd in cmds:
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(cmd, ready=ready_w, go=go_r, close=(go_w, ready_r, *readies))
        os.close(ready_w)
        pids.append(pid)
        readies.append(ready_r)
    for fd in readies:
        if select.select([fd], [], [], 120)[0]:
            os.read(fd, 1)
        os.close(fd)
    os.write(go_w, b"g" * len(cmds))
    statuses = [_status(pid) for pid in pids]
    os.close(go_r)
    os.close(go_w)
    return {"statuses": statuses}


def _batch(cmds: list[dict[str, Any]]) -> dict[str, Any]:
    """Fork one child per command (each on its own prefix), all at once; wait for them all."""
    pids = []
    for cmd in cmds:
        pid = os.fork()
        if pid == 0:
            _child(cmd)
        pids.append(pid)
    return {"statuses": [_status(pid) for pid in pids]}


def _share_botocore_data() -> None:
    """Speed only: the children's S3 clients share botocore's parsed data files (service
    model, endpoint rules, partitions), which the helper loads once by creating a client on a
    throwaway event loop, sending no request (so no child inherits a connection or a
    thread). Requests and responses are untouched. Without it, a child spends ~0.25 s
    starting its client; rounds fork ~60 children."""
    import asyncio

    import aiobotocore.session
    import botocore.loaders

    real = getattr(botocore.loaders.JSONFileLoader, "load_file", None)
    if real is None:  # another botocore: only slower
        return
    parsed: dict[Any, Any] = {}

    def load_file(self: Any, file_path: str, *args: Any, **kwargs: Any) -> Any:
        key = (file_path, args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = real(self, file_path, *args, **kwargs)
        return parsed[key]

    botocore.loaders.JSONFileLoader.load_file = load_file  # type: ignore[method-assign]

    async def start_a_client() -> None:
        session = aiobotocore.session.AioSession()
        async with session.create_client("s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
                                         aws_access_key_id="x", aws_secret_access_key="y"):
            pass

    asyncio.run(start_a_client())


def _helper_main() -> None:
    global _standby
    torch.set_num_threads(1)  # no intra-op thread pool, so fork() is safe
    # One upload at a time, so a save's steps come in the same order in every child (forked
    # children inherit this thread's options; a job may ask for more threads). Held by this
    # frame, which serves until the process exits.
    held = sp.using(remote=sp.RemoteOptions(threads=1))
    held.__enter__()
    build(SMALL)  # the first optimizer step imports a lot lazily: do it once, here
    _share_botocore_data()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "ping":
            reply: dict[str, Any] = {"pong": True}
        elif cmd["op"] == "run":
            reply = _run(cmd["cmd"], cmd.get("kill_after"))
            replies.write(json.dumps(reply) + "\n")
            _standby = _Standby(cmd["cmd"]["url"], cmd["cmd"]["options"])  # for the next round
            continue
        elif cmd["op"] == "race":
            reply = _race(cmd["a"], cmd["b"])
        elif cmd["op"] == "together":
            reply = _together(cmd["cmds"])
        elif cmd["op"] == "batch":
            reply = _batch(cmd["cmds"])
        else:
            raise AssertionError(cmd)
        replies.write(json.dumps(reply) + "\n")
    if _standby is not None:
        _standby.close()
    replies.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torch


if __name__ == "__main__" and sys.argv[1:] == ["helper"]:
    _helper_main()
