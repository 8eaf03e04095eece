"""Plans agreed by earlier saves, so that a save with the same structure plans nothing.

In training every save has the same chunk structure as the one before. Each rank sends
only a fingerprint of its structure (and its chunk list only when the fingerprint is new to
it); when every fingerprint matches the plan the coordinator agreed last time, and every
rank still holds its part of that plan, the coordinator answers "reuse plan P" and nobody
plans: the coordinator's work is comparing one short string per rank.

A plan is a pure function of the fingerprints (they cover every input of the planning:
each rank's chunks, host, the layout and world size), so a plan found under the same
fingerprints is the plan that planning would make again.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections import OrderedDict
from typing import Any, NamedTuple

_KEEP = 8
"""Plans kept per process (a job saving two states in turn, e.g. a model and its EMA,
reuses both)."""


class Offer(NamedTuple):
    """What a rank sends to plan a save."""

    fingerprint: str
    payload: Any
    """The rank's chunk list, or None when the coordinator is expected to know it (a rule
    description, or a fingerprint this rank already planned with)."""
    host: str
    known_plan: str | None
    """The plan this rank holds for its fingerprint, if any."""


def fingerprint(*parts: Any) -> str:
    """A short digest of ``parts`` (their ``repr``)."""
    h = hashlib.blake2b(digest_size=20)
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


class PlanCache:
    """The plans this process agreed (as coordinator) and its parts of them (as a rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agreed: OrderedDict[tuple[tuple[str, str], ...], tuple[str, Any]] = OrderedDict()
        """The coordinator's: every rank's fingerprint -> (plan id, the plan)."""
        self._lists: OrderedDict[tuple[tuple[str, str], ...], list[Any]] = OrderedDict()
        """The coordinator's: every rank's fingerprint -> the chunk lists they planned from."""
        self._mine: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        """A rank's: its fingerprint -> (plan id, its part of the plan)."""
        self.resends = 0
        """Saves whose coordinator had to ask every rank for its chunk list again."""

    def offer(self, fp: str, payload: Any, host: str, *, rules: bool, full: bool = False) -> Offer:
        """This rank's offer: the payload left out when it planned with ``fp`` before (unless
        ``full``: the coordinator asked for it) or when the state is described by rules."""
        with self._lock:
            known = self._mine.get(fp)
        plan_id = known[0] if known is not None else None
        if rules or (known is not None and not full):
            return Offer(fp, None, host, plan_id)
        return Offer(fp, payload, host, plan_id)

    def agreed(self, offers: list[Offer]) -> tuple[str, Any] | None:
        """The plan agreed for exactly these offers, when every rank still holds its part."""
        key = tuple((o.fingerprint, o.host) for o in offers)
        with self._lock:
            found = self._agreed.get(key)
            if found is not None:
                self._agreed.move_to_end(key)
        if found is None or any(o.known_plan != found[0] for o in offers):
            return None
        return found

    def agree(self, offers: list[Offer], plan: Any, lists: list[Any] | None = None) -> str:
        """Remember ``plan`` as the one agreed for ``offers`` (planned from ``lists``, each
        rank's chunk list); its new id."""
        plan_id = uuid.uuid4().hex
        key = tuple((o.fingerprint, o.host) for o in offers)
        with self._lock:
            self._agreed[key] = (plan_id, plan)
            if lists is not None:
                self._lists[key] = lists
            for table in (self._agreed, self._lists):
                while len(table) > _KEEP:
                    table.popitem(last=False)
        return plan_id

    def lists(self, offers: list[Offer]) -> list[Any] | None:
        """Every rank's chunk list: sent with its offer, or the one it planned with last
        (a save where some ranks changed gets only theirs); None if one is not known."""
        with self._lock:
            recent = list(reversed(self._lists.items()))
        out = []
        for rank, o in enumerate(offers):
            payload = o.payload
            if payload is None:
                payload = next((lists[rank] for key, lists in recent
                                if len(key) == len(offers) and key[rank] == (o.fingerprint, o.host)), None)
                if payload is None:
                    return None
            out.append(payload)
        return out

    def resend(self) -> None:
        with self._lock:
            self.resends += 1

    def mine(self, fp: str, plan_id: str) -> Any:
        """This rank's part of plan ``plan_id`` (None if it does not hold it)."""
        with self._lock:
            found = self._mine.get(fp)
        return found[1] if found is not None and found[0] == plan_id else None

    def clear(self) -> None:
        """Forget every plan (the next save plans afresh)."""
        with self._lock:
            self._agreed.clear()
            self._lists.clear()
            self._mine.clear()

    def keep_mine(self, fp: str, plan_id: str, part: Any) -> None:
        with self._lock:
            self._mine[fp] = (plan_id, part)
            self._mine.move_to_end(fp)
            while len(self._mine) > _KEEP:
                self._mine.popitem(last=False)


PLANS = PlanCache()
"""The process's plans. One per process is right: a plan is looked up by every rank's
fingerprint, which includes the group's world size and this rank's place in it."""
