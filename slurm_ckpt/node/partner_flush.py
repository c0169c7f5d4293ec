"""Which node's hooks flush a partner copy (:mod:`slurm_ckpt.job.partner`).

A partner copy is the owner's checkpoint, byte for byte, on another node's local tier:
two nodes then hold the same ``user/key/step``. Two copy engines writing one step to the
PFS at once is safe (each writes in its own work area and the second finds the step
committed: :mod:`slurm_ckpt.tiers.copy`) but copies it twice, so the two are kept
apart - by the epilog, the stager, root's ``ckpt-slurm flush`` and ckpt-srun alike:

* while the **owner's node is alive** (SLURM does not say it is DOWN or not
  responding), its own hooks flush the step; the partner's epilog leaves the copy alone
  - it does not keep the node drained either - and a later pass (the stager, the next
  hook) finds it verified on the PFS (``already``), after which local retention may
  delete it;
* when the **owner's node is lost**, the partner's epilog flushes the copy: the one
  node that still holds it, so no race;
* after ``[partner] owner_grace`` (counted from when this node's ledger first recorded
  the copy) it is flushed here whatever the owner's state: the owner may have lost its
  own copy, or never had one (a name a user made up), and a copy nobody flushes is
  lost with this node.

What it costs is bounded whatever users write into manifests: the owners' liveness
comes from **one** SLURM query per hook (:meth:`SlurmClient.node_table
<slurm_ckpt.slurm.client.SlurmClient.node_table>`, waited on for at most the time it is
given), never one query per name. A name SLURM does not list is not a live node. A
record held for its owner's doing and not yet due for a retry is not looked at (it is
neither flushed nor a reason to drain), and without a single candidate nothing is
asked at all.

Without SLURM to ask (no client, or it fails or is too slow) the copy is flushed:
losing the only copy is worse than a retried flush.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from slurm_ckpt.errors import SlurmError
from slurm_ckpt.ledger import Ledger, Record
from slurm_ckpt.node.retry import held, retry_due
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.records import NodeInfo

log = logging.getLogger(__name__)

__all__ = ["LOST_STATES", "OwnerCheck", "defer_live_owners", "mark_partner_copies"]

#: Node states (base state or flag) in which a node's own hooks cannot flush.
LOST_STATES = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "FAILING", "POWERED_DOWN", "UNKNOWN"})


@dataclass
class OwnerCheck:
    """What one owner check did (for the hook's log line and tests): ``queries`` made
    (0 or 1), ``names`` distinct owner nodes looked at, how many of them SLURM does not
    know (``unknown``) or lists as lost, copies ``deferred`` to live owners, copies past
    their grace (``overdue``), held copies ``skipped``."""

    queries: int = 0
    names: int = 0
    unknown: int = 0
    lost: int = 0
    deferred: int = 0
    overdue: int = 0
    skipped: int = 0
    seconds: float = 0.0
    error: Optional[str] = None


def _is_live(info: Optional[NodeInfo]) -> bool:
    return info is not None and not ({info.state, *info.flags} & LOST_STATES)


def defer_live_owners(
    records: List[Record],
    owners: Dict[Tuple[str, str, int], Optional[str]],
    this_node: str,
    client: Optional[SlurmClient],
    *,
    now: float,
    grace_s: float,
    timeout: Optional[float] = None,
    clock: Optional[Callable[[], float]] = None,
) -> Tuple[List[Record], List[Record], OwnerCheck]:
    """Split ``records`` into those to flush now and the partner copies left to their
    owner's node, alive (see the module docstring). ``now`` is the ledger's clock (a
    record's ``created_at`` and ``retry_at`` are in it), ``grace_s`` the
    ``[partner] owner_grace``; the one SLURM query waits at most ``timeout`` seconds."""
    check = OwnerCheck()
    ask: List[Record] = []
    keep: List[Record] = []
    for rec in records:
        owner = owners.get(rec.ident)
        if not owner or owner == this_node:
            keep.append(rec)
        elif held(rec.extra) and not retry_due(rec.extra, now):
            check.skipped += 1  # its owner's doing, not tried now: nothing to ask
            keep.append(rec)
        elif now - rec.created_at >= grace_s:
            check.overdue += 1  # past the grace: this node flushes it too
            keep.append(rec)
        else:
            ask.append(rec)
    if check.overdue:
        log.info("%d copies naming other nodes past owner_grace: flushed here", check.overdue)
    if not ask or client is None:
        return keep + ask, [], check
    names = {owners[rec.ident] for rec in ask}
    check.names = len(names)
    tick = clock or (lambda: 0.0)
    t0 = tick()
    check.queries = 1
    try:
        table = client.node_table(timeout)
    except SlurmError as exc:
        check.error = str(exc)
        log.warning("cannot ask SLURM about the nodes that wrote partner copies here: %s", exc)
        return keep + ask, [], check
    finally:
        check.seconds = tick() - t0
    check.unknown = sum(1 for n in names if n not in table)
    check.lost = sum(1 for n in names if n in table and not _is_live(table[n]))
    deferred = [rec for rec in ask if _is_live(table.get(owners[rec.ident] or ""))]
    gone = {id(r) for r in deferred}
    keep += [rec for rec in ask if id(rec) not in gone]
    check.deferred = len(deferred)
    if deferred:
        log.info(
            "%d partner copies left to their owners' nodes (alive; %d names asked in one "
            "query, %d unknown to SLURM)",
            len(deferred),
            check.names,
            check.unknown,
        )
    return keep, deferred, check


def mark_partner_copies(
    ledger: Ledger, owners: Dict[Tuple[str, str, int], Optional[str]], this_node: str
) -> int:
    """Record in the node's ledger which local checkpoints are partner copies
    (``partner_of``: the node that wrote them, from their manifest), so that the node's
    status shows them. One transaction, only when there is something new to mark."""
    snap = ledger.snapshot()
    todo = []
    for ident, owner in owners.items():
        if not owner or owner == this_node:
            continue
        raw = snap.get(ident)
        if raw is None or raw.get("partner_of") == owner:
            continue
        todo.append((ident, owner))

    def setter(owner: str) -> Callable[[Optional[Record], float], Optional[Record]]:
        def fn(rec: Optional[Record], _now: float) -> Optional[Record]:
            if rec is None:
                return None
            rec.extra["partner_of"] = owner
            return rec

        return fn

    if not todo:
        return 0
    return ledger.update_many([(ident, setter(owner)) for ident, owner in todo])
