"""Root records the suspect steps its scan of the local tier finds: the node's metric.

Why here: on a SLURM node the job runs as its user and writes its ``replicas_suspect``
events to the user's own event log, which root's hooks do not read; the node's metrics
(:mod:`slurm_ckpt.ledger.metrics`, written by the hooks) count root's log only. Root
already reads every committed manifest of every user at each scan (prolog, epilog,
stager, root's flush: :meth:`NodeWork.reconcile <slurm_ckpt.node.work.NodeWork.reconcile>`),
and each rank's manifest of a suspect step records the verdict (``meta.replicas``), so
the scan carries that flag and root records one event per ``(user, key, step)``.

The manifest is the user's text: the flag is only a counted fact - nothing is drained,
resumed, kept or deleted on its strength. The key is a validated key (the scan's), the
step a non-negative int; which steps were counted lives in root's event summary, bounded
per series and per user (:mod:`slurm_ckpt.ledger.suspect_steps`), and each scan records
at most :data:`PER_USER` new ones per user, newest first, so a user who forges thousands
of flagged manifests costs root a bounded amount of work and state.
"""

from __future__ import annotations

from typing import Dict, Iterable, Tuple

from slurm_ckpt.core.names import base_key
from slurm_ckpt.ledger.events import EventLog, read_summary
from slurm_ckpt.ledger.suspect_steps import seen

__all__ = ["PER_USER", "record_suspects"]

#: New suspect steps recorded per user and scan at most.
PER_USER = 32


def record_suspects(events: EventLog, found: Iterable[Tuple[str, str, int]]) -> int:
    """One ``replicas_suspect`` event (``source="manifest"``) per suspect step of
    ``found`` (``(user, key, step)`` of flagged manifests, a rank's series folded into
    its key) that the node's log has not counted yet; returns how many were recorded."""
    steps = sorted({(u, base_key(k), s) for u, k, s in found}, key=lambda t: (t[0], t[1], -t[2]))
    # Every scan finds the same steps again: one read of the summary, without its lock,
    # sets the ones already counted aside (the locked check below has the last word).
    doc = read_summary(events.path)
    done: Dict[str, int] = {}
    for user, key, step in steps:
        fields = {"user": user, "key": key, "step": step}
        if done.get(user, 0) >= PER_USER or seen(doc, fields):
            continue
        if events.emit_suspect_once(**fields, source="manifest"):
            done[user] = done.get(user, 0) + 1
    return sum(done.values())
