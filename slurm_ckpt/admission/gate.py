"""The flush engine's side of admission control: a PFS slot around each copy.

:class:`SlotGate` is what :class:`slurm_ckpt.node.flush_engine.Flusher` asks before it copies a
checkpoint to the shared tier (``Flusher(..., slots=SlotGate.from_config(cfg, node))``):

* it waits for a slot (jitter first) for at most the time the caller has left, minus the
  time the copy needs; not admitted by then, the checkpoint is handed off as the engine
  hands off anything it has no time for (the epilog's go to the stager, which asks again
  with its own, longer budget);
* while the copy runs, the slot's lease is renewed by a small forked *renewer* process,
  not a thread: root's flushers fork the copy child as the user, and a process that forks
  must stay single-threaded (:mod:`slurm_ckpt.node.asuser`). The renewer dies with its
  parent (``PR_SET_PDEATHSIG``), so a flusher that is killed stops renewing and its slot
  lapses after one lease;
* each decision becomes an ``admission``/``admission_refused`` event (queue depth, wait):
  the metrics and the "PFS queue watermark" panels.

A store that cannot be used (unsafe, unreadable, the PFS without flock) does not stop a
flush: losing a checkpoint is worse than one uncounted flush. The gate logs it once and
lets the copy go; ``ckpt-slurm doctor`` reports the store. Processes that cannot open the
root-owned store (a job's own flush, as the user) get no gate at all (``from_config``
returns None) and keep to jitter and their per-node bandwidth cap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any, Callable, Iterator, Optional

from slurm_ckpt.admission.decisions import Admission, Ticket, decision_event
from slurm_ckpt.admission.policy import AdmissionError, AdmissionPolicy, Priority
from slurm_ckpt.admission.state import SlotStore
from slurm_ckpt.admission.store import PosixSlotStore
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.procs import set_pdeathsig
from slurm_ckpt.ledger import events

log = logging.getLogger(__name__)

__all__ = ["SlotGate", "renewer"]


@contextlib.contextmanager
def renewer(admission: Admission, ticket: Ticket) -> Iterator[None]:
    """Renew ``ticket``'s lease every ``lease/3`` from a forked child until the block
    ends (or this process dies). Forks: call it from a single-threaded process."""
    period = max(0.05, admission.policy.lease / 3.0)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the renewer
        code = 0
        try:
            set_pdeathsig()
            while os.getppid() == parent:
                time.sleep(period)
                if os.getppid() != parent or not admission.renew(ticket):
                    break
        except BaseException:  # noqa: BLE001 - a renewer never raises into anything
            code = 1
        os._exit(code)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


class SlotGate:
    """Ask for a slot, hold it around one copy, give it back; see the module docstring.

    ``emit(event_type, **fields)`` records decisions (default: the process's event log).
    """

    def __init__(
        self,
        admission: Admission,
        *,
        priority: int = Priority.ROUTINE,
        rate: Optional[float] = None,
        emit: Optional[Callable[..., Any]] = None,
    ) -> None:
        self.admission = admission
        self.priority = int(priority)
        self.rate = rate
        self.emit = events.emit if emit is None else emit
        self._warned = False

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        node: str,
        *,
        priority: int = Priority.ROUTINE,
        store: Optional[SlotStore] = None,
        **kw: Any,
    ) -> Optional[SlotGate]:
        """The gate for this site, or None when there is no cap, or this process cannot
        use the store (not its owner: a job's own flush)."""
        policy = AdmissionPolicy.from_config(cfg)
        if not policy.enabled:
            return None
        if store is None:
            try:
                store = PosixSlotStore.from_config(cfg)
            except AdmissionError as exc:
                log.warning("flushing without PFS slots: %s", exc)
                return None
        warm = cfg.tiers.pfs if cfg.tiers.pfs is not None else cfg.tiers.object
        rate = warm.bandwidth_limit if warm is not None else None  # the warm tier's cap
        return cls(Admission(policy, store, node), priority=priority, rate=rate, **kw)

    @contextlib.contextmanager
    def slot(self, budget: Optional[float]) -> Iterator[bool]:
        """Hold a slot for the block: yields True, or False when none came within
        ``budget`` seconds (the block should then hand the copy off). A store failure
        yields True without a slot (see the module docstring)."""
        try:
            d = self.admission.acquire(self.priority, self.rate, budget)
        except AdmissionError as exc:
            if not self._warned:
                self._warned = True
                log.warning("PFS slots not usable, flushing without one: %s", exc)
            self._emit("failure", reason="admission_store", error=str(exc))
            yield True
            return
        etype, fields = decision_event(d, self.priority)
        self._emit(etype, **fields)
        if not d.admitted or d.ticket is None:
            yield False
            return
        try:
            with renewer(self.admission, d.ticket):
                yield True
        finally:
            try:
                self.admission.release(d.ticket)
            except AdmissionError as exc:  # it lapses by itself after its lease
                log.warning("PFS slot not given back (it lapses after its lease): %s", exc)

    def _emit(self, etype: str, **fields: Any) -> None:
        try:
            self.emit(etype, **fields)
        except Exception as exc:  # noqa: BLE001 - events must never stop a flush
            log.debug("event %s not recorded: %s", etype, exc)
