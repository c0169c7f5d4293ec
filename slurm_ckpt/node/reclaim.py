"""The prolog's last resort when the local tier is too full for a job: reclaim space of
users who have left the node.

Anything on the local tier that is not a flushable checkpoint - stray files, debris of
killed writers, checkpoints found unsafe or corrupt (never flushable as they are) - is
never cleaned by retention, so one user could fill a node's disk and every later prolog
would fail its free-space check: a node lost to everyone. So, when the check fails and
``[hooks] reclaim_departed`` is on, the prolog frees space of every user who has **no
job on this node** (SLURM must say so: without SLURM nobody counts as departed), in
their own child process (as that user, like every touch of user data):

1. their junk: everything in ``<local>/<user>`` that is not a committed checkpoint, and
   their checkpoints the ledger has found ``BAD``;
2. then, while still short, their checkpoints that are verified on the PFS, oldest
   first - each only if the PFS holds the very same committed checkpoint.

A checkpoint not safe on the PFS is never touched: a user whose checkpoints are still
owed keeps them (the rescue flushes them, or the stager). The job's own user, and users
with a job here, are never reclaimed from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

from slurm_ckpt.errors import CkptError, SlurmError
from slurm_ckpt.ledger import WARM_SLOT, State
from slurm_ckpt.node.asuser import run_as
from slurm_ckpt.node.owner_tasks import reclaim_as_user
from slurm_ckpt.node.work import NodeWork

log = logging.getLogger(__name__)

__all__ = ["Reclaimed", "departed_users", "reclaim_departed"]


@dataclass
class Reclaimed:
    """What a reclaim did: entries (junk) and checkpoints removed, per user."""

    users: List[str]
    entries: int = 0
    checkpoints: int = 0

    def line(self) -> str:
        return (
            f"reclaimed {self.entries} stray entries and {self.checkpoints} checkpoints "
            f"of {len(self.users)} departed users"
        )


def departed_users(work: NodeWork, keep: str) -> Optional[Set[str]]:
    """Users with a directory on the local tier and no job on this node (``keep``, the
    job's own user, never counts); None when SLURM cannot say who has a job here."""
    if work.client is None:
        return None
    try:
        rows = work.client.jobs_on_node(work.node)
    except SlurmError as exc:
        log.warning("reclaim: cannot list the jobs on %s: %s", work.node, exc)
        return None
    present = {user for _job, user, _state in rows} | {keep}
    return {u for u in work.users if u not in present}


def reclaim_departed(
    work: NodeWork, keep: str, need: int, deadline: Optional[float] = None
) -> Optional[Reclaimed]:
    """Free space of departed users until ``need`` bytes are free (see the module
    docstring). ``work`` must have reconciled (its ``users`` and ledger). None when
    nobody counts as departed."""
    gone = departed_users(work, keep)
    if not gone:
        return None
    out = Reclaimed(sorted(gone))
    by_user: Dict[str, Dict[str, List[Any]]] = {u: {"junk": [], "safe": []} for u in gone}
    recs = sorted(work.ledger.records(), key=lambda r: r.committed_at.get("local", 0.0))
    for rec in recs:
        lists = by_user.get(rec.user)
        if lists is None:
            continue
        local = rec.state("local")
        if local is State.BAD:
            lists["junk"].append([rec.key, rec.step])
        elif local in (State.COMMITTED, State.VERIFIED) and rec.state(WARM_SLOT) is State.VERIFIED:
            lists["safe"].append([rec.key, rec.step])
    hooks = work.cfg.hooks
    for user in out.users:
        left = None if deadline is None else deadline - work.clock()
        if left is not None and left < 0.5:
            break
        ids = work.users[user]
        try:
            got = run_as(
                ids.uid,
                ids.gid,
                reclaim_as_user,
                work.cfg,
                user,
                ids.uid,
                by_user[user]["junk"],
                by_user[user]["safe"],
                need,
                user=user,
                timeout=hooks.child_timeout * 4 if left is None else left,
                stall_timeout=hooks.child_timeout,
                what="reclaim",
            )
        except CkptError as exc:
            log.warning("reclaim: %s skipped: %s", user, exc)
            continue
        out.entries += int(got.get("entries", 0))
        out.checkpoints += int(got.get("checkpoints", 0))
        work.emit("reclaim", user=user, **{k: int(v) for k, v in got.items()})
    return out
