"""Ledger changes of a flush round, written in batches.

The ledger is one file, rewritten whole (and fsynced) by every transaction. Marking each
checkpoint of a backlog twice (``FLUSHING``, then ``VERIFIED``) in a transaction of its
own costs two rewrites of an N-record file per checkpoint: quadratic, and with 12,000
tiny checkpoints it took an epilog minutes past its budget. A :class:`MarkBuffer` keeps
the changes in memory and writes them in *one* transaction at most every ``interval``
seconds, and whenever its owner says so (the end of a round). Losing a buffered change
(a crash) costs nothing but a re-check: the ledger is a cache of the tiers, and a flush
of a checkpoint already on the PFS finds it there and is done.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from slurm_ckpt.errors import CkptError
from slurm_ckpt.ledger import Ident, Ledger, Record, State
from slurm_ckpt.ledger.codec import MUTABLE_FIELDS
from slurm_ckpt.ledger.record import apply_fields

log = logging.getLogger(__name__)

__all__ = ["Change", "MarkBuffer", "set_state"]

#: ``fn(record or None, now) -> record to store, or None``.
Change = Callable[[Optional[Record], float], Optional[Record]]


def set_state(
    ident: Ident,
    tier: str,
    state: State,
    reason: Optional[str] = None,
    then: Optional[Callable[[Record, float], None]] = None,
    **fields: Any,
) -> Change:
    """The change :meth:`Ledger.mark` makes (creating the record when missing), plus
    ``then(record, now)`` for anything more."""
    unknown = set(fields) - MUTABLE_FIELDS
    if unknown:
        raise TypeError(f"set_state(): unknown record field(s): {', '.join(sorted(unknown))}")

    def change(rec: Optional[Record], now: float) -> Record:
        if rec is None:
            rec = Record(*ident, created_at=now)
        rec.set_state(tier, state, now, reason)
        apply_fields(rec, fields)
        if then is not None:
            then(rec, now)
        return rec

    return change


class MarkBuffer:
    """Buffered ledger changes (see the module docstring). ``ledger`` may be None (then
    nothing is recorded). Thread-safe (the in-job flusher hands off from two threads)."""

    def __init__(
        self,
        ledger: Optional[Ledger],
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.interval = float(interval)
        self.clock = clock
        self._changes: List[Tuple[Ident, Change]] = []
        self._bump: Dict[str, int] = {}
        self._last = clock()
        self._lock = threading.Lock()
        self.writes = 0

    def add(self, ident: Ident, change: Change, code: Optional[str] = None) -> None:
        if self.ledger is None:
            return
        with self._lock:
            self._changes.append((ident, change))
            if code:
                self._bump[code] = self._bump.get(code, 0) + 1

    def __len__(self) -> int:
        return len(self._changes)

    def due(self) -> bool:
        return bool(self._changes) and self.clock() - self._last >= self.interval

    def write_if_due(self) -> None:
        if self.due():
            self.write()

    def write(self) -> None:
        """Write everything buffered in one transaction. A ledger that cannot be written
        (full disk, lock held) is logged, never fatal: the flush itself stands."""
        with self._lock:
            self._last = self.clock()
            changes, bump = self._changes, self._bump
            self._changes, self._bump = [], {}
        if self.ledger is None or not changes:
            return
        try:
            self.ledger.update_many(changes, bump)
            self.writes += 1
        except (CkptError, OSError) as exc:
            log.warning("ledger not updated (%d changes): %s", len(changes), exc)
