"""Admission control for flushes to a shared tier: the decision code, and a store in memory.

Why: the write burst of a checkpoint is the cluster's problem, not the job's. Every node
caps its own flush bandwidth, but nothing stops 2,000 nodes from flushing in the same
second, and while they do every other job's reads stall. So a node asks for a *slot*
before it flushes to the PFS:

* **cap**: at most ``max_nodes`` holders at once, and/or at most ``max_bandwidth`` bytes/s
  summed over the holders' rates;
* **lease**: a holder renews its slot while it flushes; a holder that died (node crash,
  SIGKILL) stops renewing, and its slot is free again ``lease`` seconds after its last
  renewal, by itself, with no one to clean up;
* **jitter**: a flush starts after a random delay in ``[0, jitter)``, so that the nodes of
  a job that all saved at the same step do not all ask in the same second;
* **priority**: the queue is ordered by priority, then arrival: a node draining for
  maintenance (an admin waits on it) or a preempted job's flush (its last chance) goes
  before a routine one. Within a priority, first come first served, and no one overtakes
  the head of the queue (a big request is never starved by small ones);
* **budget**: every waiter has a deadline. When it passes, the answer is "not admitted"
  and the waiter leaves the queue: the caller hands the flush off (to the stager) instead
  of waiting past its own time limit.

The shared state (:class:`SlotState`: the holders and the queue of waiters) lives in a
*store*. All decisions are made here, on that state, inside one store transaction:
:class:`MemoryStore` keeps it in memory with an injectable clock (tests, the fleet
simulation in ``benchmarks/fleet_sim.py``), ``slurm_ckpt.tiers.admission.PosixSlotStore``
keeps it as a root-owned file on the PFS under a lock. The same :class:`Admission` runs
against either, so what the simulation shows at 10,000 nodes is what this code does.

Costs stay constant per node as the cluster grows: a waiter's entry carries its own
deadline (no renewals while waiting), the queue is kept sorted, and a decision walks only
the head of the queue (as many entries as there are free slots, plus any that expired
there), never the whole of it. :attr:`SlotState.examined` counts those steps.

No SLURM, no torch, no I/O here.
"""

from __future__ import annotations

import bisect
import enum
import math
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, TypeVar

from slurm_ckpt.errors import CkptError

__all__ = [
    "Admission",
    "AdmissionError",
    "AdmissionPolicy",
    "Decision",
    "Entry",
    "Heartbeat",
    "decision_event",
    "MemoryStore",
    "Priority",
    "SimClock",
    "SlotState",
    "SlotStore",
    "Ticket",
]

T = TypeVar("T")

#: Format tag of a serialised :class:`SlotState`.
STATE_FORMAT = "slurm_ckpt.admission/1"
#: Entries kept at most (a store that grew past this is refused, not loaded).
MAX_ENTRIES = 1_000_000
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,80}$")


class AdmissionError(CkptError):
    """The slot store cannot be used (missing, unsafe, unreadable, or locked too long)."""

    exit_code = 1


class Priority(enum.IntEnum):
    """Queue order: higher goes first. Values leave room for site-defined levels."""

    ROUTINE = 0
    #: The job was preempted or is at its end: this flush is its last chance.
    PREEMPTED = 10
    #: The node is draining for maintenance: an admin (``ckpt-slurm maint``) waits on it.
    MAINTENANCE = 20


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class AdmissionPolicy:
    """The caps, the jitter and the timings; see the module docstring.

    ``max_nodes``/``max_bandwidth`` None = no such cap (both None: no slots at all, only
    jitter). ``lease`` is how long a holder's slot outlives its last renewal; ``poll`` how
    often a waiter looks again; ``max_wait`` the budget of a caller that has none.
    """

    max_nodes: Optional[int] = None
    max_bandwidth: Optional[float] = None
    jitter: float = 0.0
    lease: float = 60.0
    poll: float = 1.0
    max_wait: float = 300.0

    def __post_init__(self) -> None:
        if self.max_nodes is not None and (
            isinstance(self.max_nodes, bool) or int(self.max_nodes) != self.max_nodes
        ):
            raise ValueError(f"max_nodes must be a whole number, got {self.max_nodes!r}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be at least 1, got {self.max_nodes!r}")
        for name in ("max_bandwidth",):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be positive, got {v!r}")
        for name in ("jitter",):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must not be negative, got {v!r}")
        for name in ("lease", "poll", "max_wait"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be positive, got {v!r}")

    @property
    def enabled(self) -> bool:
        """True when a cap is set, i.e. slots are taken at all."""
        return self.max_nodes is not None or self.max_bandwidth is not None

    @classmethod
    def from_config(cls, cfg: Any) -> AdmissionPolicy:
        """From a :class:`~slurm_ckpt.core.config.Config` (its ``[admission]`` section)."""
        a = cfg.admission
        return cls(
            max_nodes=a.max_nodes,
            max_bandwidth=a.max_bandwidth,
            jitter=a.jitter,
            lease=a.lease,
            poll=a.poll,
            max_wait=a.max_wait,
        )

    def rate_of(self, requested: Optional[float]) -> float:
        """The rate a request counts with against ``max_bandwidth``.

        A flusher that knows its own cap (``tiers.pfs.bandwidth_limit``) asks with it; one
        that does not is counted as an equal share of the bandwidth cap
        (``max_bandwidth / max_nodes``, or all of it when there is no node cap: such a
        flusher then flushes alone), and is told to keep to that rate.
        """
        if requested is not None and requested > 0:
            if self.max_bandwidth is not None:
                return min(float(requested), self.max_bandwidth)
            return float(requested)
        if self.max_bandwidth is None:
            return 0.0
        return self.max_bandwidth / (self.max_nodes or 1)


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
        if not isinstance(node, str) or not _NODE_RE.match(node):
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
        st = cls()
        for raw in holders:
            e = Entry.from_list(raw)
            st.holders[e.id] = e
            st._rate += e.rate
        for raw in waiters:
            e = Entry.from_list(raw)
            if e.id in st.holders or e.id in st.waiters:
                raise ValueError("slot state: duplicate id")
            st.waiters[e.id] = e
            st._queue.append((e.order(), e.id))
        st._queue.sort()
        return st


# --------------------------------------------------------------------------- stores


class SlotStore(Protocol):
    """Where the :class:`SlotState` lives. ``transact`` runs ``fn`` on the state under
    the store's mutual exclusion and writes it back if ``fn`` changed it; it raises
    :class:`AdmissionError` when it cannot get the state before ``deadline`` (a
    ``clock()`` value; None = no limit). ``peek`` is a lock-free read of the last state
    written (may be stale, never torn), for deciding whether a transaction is worth it.
    ``ops`` counts transactions, ``peeks`` reads."""

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


# --------------------------------------------------------------------------- decisions


@dataclass
class Ticket:
    """A request in the queue (and, once admitted, the slot it holds)."""

    id: str
    node: str
    priority: int
    rate: float
    asked_at: float
    deadline: float
    granted_at: Optional[float] = None

    @property
    def held(self) -> bool:
        return self.granted_at is not None


@dataclass
class Decision:
    """The answer to one poll or one :meth:`Admission.acquire`.

    ``admitted``: a slot is held (``ticket`` names it; release it when the flush is
    done). ``expired``: the budget ran out, the request left the queue ("not admitted").
    Neither: still waiting. ``queue_depth``/``holders`` are what the store held at that
    moment (for the metrics), ``waited_s`` the time since the request was made,
    ``rate`` the bandwidth the holder must keep to (0 = its own cap).
    """

    admitted: bool
    expired: bool
    ticket: Optional[Ticket]
    waited_s: float
    queue_depth: int
    holders: int
    position: Optional[int] = None
    rate: float = 0.0
    reason: str = ""

    @property
    def state(self) -> str:
        return "admitted" if self.admitted else "not_admitted" if self.expired else "waiting"


class Admission:
    """Ask for, hold, renew and give back slots; see the module docstring.

    ``store`` is a :class:`SlotStore`; ``clock`` returns seconds (wall-clock epoch seconds
    for a store shared by nodes: leases are compared across nodes, so node clocks must
    agree to well within a lease, as NTP keeps them); ``sleep`` waits on that clock;
    ``rng`` draws the jitter.
    """

    def __init__(
        self,
        policy: AdmissionPolicy,
        store: SlotStore,
        node: str,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        rng: Optional[random.Random] = None,
    ) -> None:
        if not _NODE_RE.match(node):
            raise AdmissionError(f"admission: invalid node name {node!r}")
        self.policy = policy
        self.store = store
        self.node = node
        self.clock = clock
        self.sleep = sleep
        self.rng = rng or random.Random()

    # -- the steps (each one store transaction at most) -------------------------------
    def start_delay(self) -> float:
        """The jitter: a random delay in ``[0, jitter)`` before the first request."""
        j = self.policy.jitter
        return self.rng.uniform(0.0, j) if j > 0 else 0.0

    def request(
        self,
        priority: int = Priority.ROUTINE,
        rate: Optional[float] = None,
        budget: Optional[float] = None,
    ) -> Ticket:
        """Join the queue; the request lapses ``budget`` seconds from now (default
        ``max_wait``). Call :meth:`poll` to learn whether it was admitted."""
        now = self.clock()
        b = self.policy.max_wait if budget is None else max(0.0, float(budget))
        t = Ticket(
            # From the seeded rng (reproducible simulations); 80 bits: no collisions.
            id=f"{self.rng.getrandbits(80):020x}",
            node=self.node,
            priority=int(priority),
            rate=self.policy.rate_of(rate),
            asked_at=now,
            deadline=now + b,
        )
        entry = Entry(t.id, t.node, t.priority, t.rate, now, t.deadline)
        self.store.transact(lambda st: st.enqueue(entry), deadline=t.deadline)
        return t

    def poll(self, ticket: Ticket) -> Decision:
        """Admit the ticket if its turn has come; "not admitted" once its deadline passed.

        First a lock-free look (:meth:`SlotStore.peek`): while the ticket is plainly not
        at the head of the queue, no transaction is made (a big queue costs the store
        one read per waiter per poll, not one write).
        """
        now = self.clock()
        if ticket.held:
            return self._decision(ticket, True, False, now, None)
        if now < ticket.deadline:
            peeked = self.store.peek()
            free = self._free_slots(peeked, now)
            if free is not None and _live_ahead(peeked, ticket.id, free, now) >= free:
                return self._decision(ticket, False, False, now, peeked, peeked.position(ticket.id))

        def step(st: SlotState) -> Decision:
            st.expire(now)
            if ticket.id not in st.waiters:
                # Gone: dropped at its deadline, or lost with a reset store.
                if now >= ticket.deadline:
                    return self._decision(ticket, False, True, now, st, reason="budget")
                st.enqueue(
                    Entry(
                        ticket.id,
                        ticket.node,
                        ticket.priority,
                        ticket.rate,
                        ticket.asked_at,
                        ticket.deadline,
                    )
                )
            if now >= ticket.deadline:
                st.leave(ticket.id)
                return self._decision(ticket, False, True, now, st, reason="budget")
            ok = st.admissible(self.policy, now)
            if any(w.id == ticket.id for w in ok):
                st.admit(ticket.id, now, self.policy.lease)
                ticket.granted_at = now
                return self._decision(ticket, True, False, now, st)
            return self._decision(ticket, False, False, now, st, st.position(ticket.id))

        return self.store.transact(step, deadline=max(ticket.deadline, now) + self.policy.poll)

    def renew(self, ticket: Ticket) -> bool:
        """Keep a held slot (call well within every ``lease``; :class:`Heartbeat` does).
        False when the slot lapsed: the caller no longer counts against the cap."""
        now = self.clock()
        return bool(self.store.transact(lambda st: st.renew(ticket.id, now, self.policy.lease)))

    def release(self, ticket: Ticket) -> None:
        """Give the slot back, or leave the queue (idempotent)."""
        self.store.transact(lambda st: st.release(ticket.id))

    def admissible(self) -> List[str]:
        """Ids of the waiters the free capacity admits now (one transaction): the
        simulation uses it to wake exactly those waiters when a slot frees up."""
        now = self.clock()

        def step(st: SlotState) -> List[str]:
            st.expire(now)
            return [w.id for w in st.admissible(self.policy, now)]

        return self.store.transact(step)

    # -- the blocking form ------------------------------------------------------------
    def acquire(
        self,
        priority: int = Priority.ROUTINE,
        rate: Optional[float] = None,
        budget: Optional[float] = None,
        jitter: bool = True,
    ) -> Decision:
        """Jitter, join the queue, wait for a slot; never longer than ``budget`` seconds
        (default ``max_wait``) in all. The Decision says whether a slot is held."""
        t0 = self.clock()
        b = self.policy.max_wait if budget is None else max(0.0, float(budget))
        if jitter:
            # Never spend the whole budget sleeping: the jitter takes at most half of it.
            self.sleep(min(self.start_delay(), b / 2.0))
        ticket = self.request(priority, rate, budget=max(0.0, b - (self.clock() - t0)))
        ticket.asked_at = t0
        while True:
            d = self.poll(ticket)
            if d.admitted or d.expired:
                return d
            left = ticket.deadline - self.clock()
            # Look again a little sooner or later than the poll period: waiters that
            # started together do not all read the store in the same instant.
            pause = self.policy.poll * self.rng.uniform(0.5, 1.5)
            self.sleep(max(0.0, min(pause, left)))

    # -- helpers ----------------------------------------------------------------------
    def _free_slots(self, st: SlotState, now: float) -> Optional[int]:
        """How many of the queue's head could be admitted now, at most (None: unknown,
        i.e. a bandwidth cap with unequal rates: ask the store). Lapsed holders count as
        free: a transaction would drop them."""
        if self.policy.max_bandwidth is not None or self.policy.max_nodes is None:
            return None
        live = sum(1 for h in st.holders.values() if h.until > now)
        return max(0, self.policy.max_nodes - live)

    def _decision(
        self,
        ticket: Ticket,
        admitted: bool,
        expired: bool,
        now: float,
        st: Optional[SlotState],
        position: Optional[int] = None,
        reason: str = "",
    ) -> Decision:
        return Decision(
            admitted=admitted,
            expired=expired,
            ticket=ticket,
            waited_s=max(0.0, now - ticket.asked_at)
            if ticket.granted_at is None
            else ticket.granted_at - ticket.asked_at,
            queue_depth=0 if st is None else st.queue_depth(),
            holders=0 if st is None else len(st.holders),
            position=position,
            rate=ticket.rate,
            reason=reason,
        )


def _live_ahead(st: SlotState, eid: str, limit: int, now: float) -> int:
    """Live waiters ahead of ``eid`` in the queue, counted up to ``limit`` (so the walk
    is as short as the free capacity, plus any lapsed entries at the head). A ticket that
    is not queued at all gets ``0``: the caller must ask the store."""
    if eid not in st.waiters:
        return 0
    n = 0
    for _, other in st._queue:
        if n >= limit or other == eid:
            break
        if st.waiters[other].until > now:
            n += 1
    return n


def decision_event(decision: Decision, priority: int) -> Tuple[str, Dict[str, Any]]:
    """``(event type, fields)`` for the event log (``slurm_ckpt.ledger.events``): type
    ``admission`` for a slot granted, ``admission_refused`` for "not admitted". The
    metrics export the last queue depth and wait, and counters of both.
    """
    etype = "admission" if decision.admitted else "admission_refused"
    return etype, {
        "wait_s": round(decision.waited_s, 6),
        "queue_depth": decision.queue_depth,
        "holders": decision.holders,
        "priority": int(priority),
    }


class Heartbeat:
    """Renews a held slot every ``lease / 3`` from a thread, until :meth:`stop`.

    For flushers that copy in a child process while the parent waits: the parent's
    thread keeps the slot alive; a parent that dies stops renewing, and the slot lapses.
    ``lost`` is set when a renewal found the slot gone (it lapsed: the flusher is over
    its lease, e.g. the machine was suspended) or the store failed.
    """

    def __init__(self, admission: Admission, ticket: Ticket) -> None:
        self.admission = admission
        self.ticket = ticket
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slot-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        period = max(0.01, self.admission.policy.lease / 3.0)
        while not self._stop.wait(period):
            try:
                if not self.admission.renew(self.ticket):
                    self.lost = True
            except CkptError:
                self.lost = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
