"""Admission control's decisions: ask for, hold, renew and give back a slot, each step
one transaction on the store's :class:`~slurm_ckpt.admission.state.SlotState`. Why and
how the slots work: :mod:`slurm_ckpt.admission`. No I/O here but the store's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from slurm_ckpt.admission.policy import AdmissionError, AdmissionPolicy, Priority
from slurm_ckpt.admission.state import NODE_RE, Entry, SlotState, SlotStore

__all__ = ["Admission", "Decision", "Ticket", "decision_event"]

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
    """Ask for, hold, renew and give back slots; see :mod:`slurm_ckpt.admission`.

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
        if not NODE_RE.match(node):
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
            if free is not None and peeked.live_ahead(ticket.id, free, now) >= free:
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
        """Keep a held slot (call well within every ``lease``;
        :func:`slurm_ckpt.admission.gate.renewer` does). False when the slot lapsed: the
        caller no longer counts against the cap."""
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
