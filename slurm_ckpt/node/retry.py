"""When a failed flush is tried again, and when it stops keeping its node drained.

A checkpoint owed to the PFS keeps its node drained (the epilog drains, the stager
re-drains every pass) so that nobody reimages a node that still holds the only copy.
That must not let one user keep a node out of service, so a failure is sorted by whose
doing it is:

* **the owner's** (its exception class declares ``user_caused``, :mod:`slurm_ckpt.errors`):
  an unsafe checkpoint (symlinks, special files, hard links, a manifest that lies about
  its files, too many files), a PFS directory of theirs that is world-writable, a
  symlink, or squatted by someone else, a flush child they stopped. The checkpoint is
  *held* (``hold`` = the reason code): still retried after its backoff - the user may
  fix it - but it never keeps the node drained;
* **anything else** (the PFS full or failing, a hung copy): retried after a backoff that
  doubles each time (``retry_backoff``, at most :data:`RETRY_MAX_S`), and after
  ``max_retries`` failures in a row it is *given up* (``gave_up``): still retried, still
  reported by ``status``, still counted by ``maint``/``guard`` (a node holding it must
  not be rebooted), but no longer a reason to keep the node drained.

The state lives in the ledger record's extra fields (``failures``, ``retry_at``,
``hold``, ``gave_up``); a success clears it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from slurm_ckpt.ledger.record import Record, is_held

__all__ = [
    "RETRY_FIELDS",
    "RETRY_MAX_S",
    "RetryPolicy",
    "clear_failures",
    "held",
    "retry_due",
]

RETRY_MAX_S = 3600.0
RETRY_FIELDS = ("failures", "retry_at", "hold", "gave_up")


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff and retry limit (``[hooks] retry_backoff``, ``max_retries``)."""

    backoff_s: float = 60.0
    max_failures: int = 5

    @classmethod
    def from_config(cls, cfg: Any) -> RetryPolicy:
        return cls(cfg.hooks.retry_backoff, cfg.hooks.max_retries)

    def delay(self, failures: int) -> float:
        return min(RETRY_MAX_S, self.backoff_s * 2 ** max(0, failures - 1))

    def note_failure(self, rec: Record, now: float, hold: Optional[str] = None) -> None:
        """Count one failure of ``rec``'s flush: next try after the backoff; ``hold``
        (a reason code) when it was its owner's doing."""
        failures = int(rec.extra.get("failures", 0) or 0) + 1
        rec.extra["failures"] = failures
        rec.extra["retry_at"] = now + self.delay(failures)
        if hold:
            rec.extra["hold"] = hold
        if failures >= self.max_failures:
            rec.extra["gave_up"] = True

    def defer(self, rec: Record, now: float, hold: Optional[str]) -> None:
        """Put ``rec`` off like a failed sibling (same owner), without counting a failure
        of its own."""
        failures = max(1, int(rec.extra.get("failures", 0) or 0))
        rec.extra["retry_at"] = max(
            float(rec.extra.get("retry_at", 0) or 0), now + self.delay(failures)
        )
        if hold:
            rec.extra["hold"] = hold


def clear_failures(rec: Record) -> None:
    for name in RETRY_FIELDS:
        rec.extra.pop(name, None)


def held(fields: Mapping[str, Any]) -> bool:
    """Owed, but no reason to keep a node drained (the owner's doing, or given up).
    ``fields``: a raw ledger record or a record's ``extra``."""
    return is_held(fields)


def retry_due(fields: Mapping[str, Any], now: float) -> bool:
    """May a flush of this record be tried at ``now`` (wall clock)?"""
    at = fields.get("retry_at")
    return not isinstance(at, (int, float)) or at <= now
