"""The shared state of admission control: who holds a slot, who waits, and the stores
that keep it (in memory here; on the shared tier in :mod:`slurm_ckpt.admission.store`).

The decisions made on this state are :mod:`slurm_ckpt.admission.decisions`.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, TypeVar

from slurm_ckpt.admission.policy import AdmissionPolicy

__all__ = [
    "MAX_ENTRIES",
    "NODE_RE",
    "STATE_FORMAT",
    "Entry",
    "MemoryStore",
    "SimClock",
    "SlotState",
    "SlotStore",
]

T = TypeVar("T")

#: Format tag of a serialised :class:`SlotState`.
STATE_FORMAT = "slurm_ckpt.admission/1"
#: Entries kept at most (a store that grew past this is refused, not loaded).
MAX_ENTRIES = 1_000_000
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,80}$")


# --------------------------------------------------------------------------- state


@dataclass
class Entry:
    """One holder or waiter. ``since``: when it queued (the order within a priority);
    ``until``: when it lapses (a holder: last renewal + lease; a waiter: its deadline)."""

    id: str
    node: str
    priority: int
    rate: float
    since: float
    until: float
    granted: Optional[float] = None

    def order(self) -> Tuple[int, float, str]:
        """Queue order: priority first (higher first), then arrival, then id."""
        return (-int(self.priority), float(self.since), self.id)

    def to_list(self) -> List[Any]:
        return [self.id, self.node, int(self.priority), self.rate, self.since, self.until]

    @classmethod
    def from_list(cls, raw: Any) -> Entry:
        """Validated: a store file that fails this is refused as a whole."""
        if not isinstance(raw, list) or len(raw) != 6:
            raise ValueError("entry: expected a list of 6")
        eid, node, prio, rate, since, until = raw
        if not isinstance(eid, str) or not _ID_RE.match(eid):
            raise ValueError("entry: bad id")
        if not isinstance(node, str) or not NODE_RE.match(node):
            raise ValueError("entry: bad node")
        if isinstance(prio, bool) or not isinstance(prio, int) or abs(prio) > 10**6:
            raise ValueError("entry: bad priority")
        nums = []
        for v in (rate, since, until):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError("entry: bad number")
            nums.append(float(v))
        if nums[0] < 0:
            raise ValueError("entry: negative rate")
        return cls(eid, node, prio, nums[0], nums[1], nums[2])


@dataclass
class SlotState:
    """Holders and the ordered queue of waiters; every decision is a method here.

    ``examined`` counts the entries that decisions looked at (the work per node that the
    fleet simulation reports); ``dirty`` tells a store whether to write the state back.
    """

    holders: Dict[str, Entry] = field(default_factory=dict)
    waiters: Dict[str, Entry] = field(default_factory=dict)
    _queue: List[Tuple[Tuple[int, float, str], str]] = field(default_factory=list)
    examined: int = 0
    dirty: bool = False
    #: No holder's lease ends before this (a lower bound: renewals only push leases out,
    #: releases only remove them), so most decisions need not look at the holders at all.
    _next_expiry: float = -math.inf
    _rate: float = 0.0

    # -- reading ----------------------------------------------------------------------
    def used(self) -> Tuple[int, float]:
        """``(holders, summed rate)``, kept up to date: no walk over the holders."""
        return len(self.holders), max(0.0, self._rate)

    def queue_depth(self) -> int:
        return len(self.waiters)

    def position(self, eid: str) -> Optional[int]:
        """0-based place of a waiter in the queue (None when not queued)."""
        w = self.waiters.get(eid)
        if w is None:
            return None
        return bisect.bisect_left(self._queue, (w.order(), eid))

    def live_ahead(self, eid: str, limit: int, now: float) -> int:
        """Live waiters ahead of ``eid`` in the queue, counted up to ``limit`` (so the walk
        is as short as the free capacity, plus any lapsed entries at the head). A waiter
        that is not queued at all gets ``0``: the caller must ask the store."""
        if eid not in self.waiters:
            return 0
        n = 0
        for _, other in self._queue:
            if n >= limit or other == eid:
                break
            if self.waiters[other].until > now:
                n += 1
        return n

    # -- changes ----------------------------------------------------------------------
    def expire(self, now: float) -> List[Entry]:
        """Drop holders whose lease lapsed; returns them.

        The holders are looked at only once the earliest lease may have ended (about once
        per lease period when flushes are shorter than the lease), so a decision costs the
        same whatever the cap.
        """
        self.examined += 1
        if now < self._next_expiry:
            return []
        gone = [h for h in self.holders.values() if h.until <= now]
        self.examined += len(self.holders)
        for h in gone:
            del self.holders[h.id]
            self.dirty = True
        self._next_expiry = min((h.until for h in self.holders.values()), default=math.inf)
        self._rate = sum(h.rate for h in self.holders.values())  # no drift
        return gone

    def enqueue(self, entry: Entry) -> None:
        if entry.id in self.waiters or entry.id in self.holders:
            raise ValueError(f"entry {entry.id} is already in the store")
        self.waiters[entry.id] = entry
        bisect.insort(self._queue, (entry.order(), entry.id))
        self.examined += 1
        self.dirty = True

    def leave(self, eid: str) -> bool:
        """Remove a waiter (given up, or admitted elsewhere). True if it was queued."""
        w = self.waiters.pop(eid, None)
        if w is None:
            return False
        i = bisect.bisect_left(self._queue, (w.order(), eid))
        if i < len(self._queue) and self._queue[i][1] == eid:
            del self._queue[i]
        self.examined += 1
        self.dirty = True
        return True

    def admissible(self, policy: AdmissionPolicy, now: float) -> List[Entry]:
        """The waiters that the free capacity admits now, in queue order.

        Walks the queue from its head: a waiter past its deadline is dropped; the next
        live one is admissible if it fits in what is left (count and bandwidth). The walk
        stops at the first one that does not fit: nobody overtakes the head.
        """
        count, rate = self.used()
        out: List[Entry] = []
        i = 0
        while i < len(self._queue):
            self.examined += 1
            eid = self._queue[i][1]
            w = self.waiters[eid]
            if w.until <= now:
                del self._queue[i]
                del self.waiters[eid]
                self.dirty = True
                continue
            if policy.max_nodes is not None and count + 1 > policy.max_nodes:
                break
            if (
                policy.max_bandwidth is not None
                and rate + w.rate > policy.max_bandwidth * (1 + 1e-9)
                and count > 0
            ):
                break
            out.append(w)
            count += 1
            rate += w.rate
            i += 1
        return out

    def admit(self, eid: str, now: float, lease: float) -> Entry:
        """Move a waiter to the holders, its lease starting now."""
        w = self.waiters[eid]
        self.leave(eid)
        w.until = now + lease
        w.granted = now
        self.holders[eid] = w
        self._next_expiry = min(self._next_expiry, w.until)
        self._rate += w.rate
        self.dirty = True
        return w

    def renew(self, eid: str, now: float, lease: float) -> bool:
        """Extend a holder's lease. False when its slot lapsed (or was never held)."""
        h = self.holders.get(eid)
        self.examined += 1
        if h is None or h.until <= now:
            return False
        h.until = now + lease
        self.dirty = True
        return True

    def release(self, eid: str) -> bool:
        """Give a slot back (or leave the queue). True if it was there."""
        h = self.holders.pop(eid, None)
        if h is not None:
            self._rate -= h.rate
            self.dirty = True
            self.examined += 1
            return True
        return self.leave(eid)

    # -- (de)serialisation --------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "holders": [h.to_list() for h in self.holders.values()],
            "waiters": [self.waiters[eid].to_list() for _, eid in self._queue],
        }

    @classmethod
    def from_dict(cls, doc: Any) -> SlotState:
        """Validated; raises ValueError for anything that is not a state we wrote."""
        if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
            raise ValueError("not a slot state")
        holders, waiters = doc.get("holders"), doc.get("waiters")
        if not isinstance(holders, list) or not isinstance(waiters, list):
            raise ValueError("slot state: holders/waiters must be lists")
        if len(holders) + len(waiters) > MAX_ENTRIES:
            raise ValueError("slot state: too many entries")
        held: Dict[str, Entry] = {}
        rate = 0.0
        for raw in holders:
            e = Entry.from_list(raw)
            held[e.id] = e
            rate += e.rate
        waiting: Dict[str, Entry] = {}
        queue: List[Tuple[Tuple[int, float, str], str]] = []
        for raw in waiters:
            e = Entry.from_list(raw)
            if e.id in held or e.id in waiting:
                raise ValueError("slot state: duplicate id")
            waiting[e.id] = e
            queue.append((e.order(), e.id))
        queue.sort()
        return cls(holders=held, waiters=waiting, _queue=queue, _rate=rate)


# --------------------------------------------------------------------------- stores


class SlotStore(Protocol):
    """Where the :class:`SlotState` lives. ``transact`` runs ``fn`` on the state under
    the store's mutual exclusion and writes it back if ``fn`` changed it; it raises
    :class:`~slurm_ckpt.admission.policy.AdmissionError` when it cannot get the state
    before ``deadline`` (a ``clock()`` value; None = no limit). ``peek`` is a lock-free
    read of the last state written (may be stale, never torn), for deciding whether a
    transaction is worth it. ``ops`` counts transactions, ``peeks`` reads."""

    ops: int
    peeks: int

    def transact(self, fn: Callable[[SlotState], T], deadline: Optional[float] = None) -> T: ...

    def peek(self) -> SlotState: ...


class MemoryStore:
    """The state in this process's memory: for tests and the fleet simulation. Threads of
    one process may share it (a lock serialises the transactions)."""

    def __init__(self) -> None:
        self.state = SlotState()
        self.ops = 0
        self.peeks = 0
        self._lock = threading.Lock()

    def transact(self, fn: Callable[[SlotState], T], deadline: Optional[float] = None) -> T:
        with self._lock:
            self.ops += 1
            result = fn(self.state)
            self.state.dirty = False
            return result

    def peek(self) -> SlotState:
        self.peeks += 1
        return self.state


class SimClock:
    """A clock that moves only when told: ``now()`` and ``sleep()`` for simulations."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, float(seconds))

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, float(t))
