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
  node that still holds it, so no race.

Without SLURM to ask (no client, or it fails) the copy is flushed: losing the only copy
is worse than a retried flush.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

from slurm_ckpt.errors import SlurmError
from slurm_ckpt.ledger import Ledger, Record
from slurm_ckpt.slurm.client import SlurmClient

log = logging.getLogger(__name__)

__all__ = ["LOST_STATES", "defer_live_owners", "mark_partner_copies"]

#: Node states (base state or flag) in which a node's own hooks cannot flush.
LOST_STATES = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "FAILING", "POWERED_DOWN", "UNKNOWN"})


def _alive(client: Optional[SlurmClient], node: str, cache: Dict[str, bool]) -> bool:
    if node not in cache:
        alive = False
        if client is not None:
            try:
                info = client.node(node)
                alive = not ({info.state, *info.flags} & LOST_STATES)
            except SlurmError as exc:
                log.warning("cannot ask SLURM about %s (a partner copy's owner): %s", node, exc)
        cache[node] = alive
    return cache[node]


def defer_live_owners(
    records: List[Record],
    owners: Dict[Tuple[str, str, int], Optional[str]],
    this_node: str,
    client: Optional[SlurmClient],
) -> Tuple[List[Record], List[Record]]:
    """Split ``records`` into those to flush now and the partner copies whose owner's
    node is alive (its own hooks flush them; see the module docstring)."""
    keep: List[Record] = []
    deferred: List[Record] = []
    cache: Dict[str, bool] = {}
    for rec in records:
        owner = owners.get(rec.ident)
        if owner and owner != this_node and _alive(client, owner, cache):
            deferred.append(rec)
        else:
            keep.append(rec)
    if deferred:
        log.info(
            "%d partner copies left to their owners' nodes (alive): %s",
            len(deferred),
            sorted(cache),
        )
    return keep, deferred


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
