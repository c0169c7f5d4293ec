"""Local retention on a node, as each checkpoint's owner: what root deletes from the
local tier after a flush.

Retention's plan (:func:`~slurm_ckpt.core.retention.plan_local_deletions`) never deletes
a checkpoint whose PFS copy is not verified; the child that deletes, running as the
owner, checks once more that the PFS holds the very same committed checkpoint
(:func:`~slurm_ckpt.node.owner_tasks.delete_as_user`). Deletions of one owner go to one
child in batches (a fork of root's process costs more than deleting a tiny checkpoint),
every child has its deadline and stall limit, and an owner whose child is stopped or
hangs is skipped for the rest of the pass - the others' deletions go on. The ledger is
updated in batches too (:class:`~slurm_ckpt.node.marks.MarkBuffer`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Set, Tuple

from slurm_ckpt.core.retention import RetentionPolicy, plan_local_deletions
from slurm_ckpt.errors import CkptError, NotFound, TimedOut
from slurm_ckpt.ledger import Record, State
from slurm_ckpt.node.asuser import ChildResult, decode_list
from slurm_ckpt.node.flush_engine import MIN_SLICE_S
from slurm_ckpt.node.marks import MarkBuffer, set_state
from slurm_ckpt.node.owner_tasks import delete_many_as_user
from slurm_ckpt.node.work_view import WorkView, run_owner_task

log = logging.getLogger(__name__)

__all__ = ["BATCH_MAX", "plan", "run_retention"]

#: Deletions per child.
BATCH_MAX = 256


def plan(work: WorkView, running: Optional[Set[str]]) -> List[Record]:
    """The records retention deletes now, by owner and series; series of jobs still
    running here are left to those jobs."""
    r = work.cfg.retention
    policy = RetentionPolicy(
        keep_local=r.keep_local,
        flush_every=r.flush_every,
        keep_warm=r.keep_warm,
        keep_warm_every_s=r.keep_warm_every,
    )
    series: Dict[Tuple[str, str], List[Record]] = {}
    for rec in work.ledger.records():
        if rec.user in work.users and rec.state("local") in (State.COMMITTED, State.VERIFIED):
            series.setdefault((rec.user, rec.key), []).append(rec)
    out: List[Record] = []
    for (_user, _key), recs in sorted(series.items()):
        if running and any(work.job_of(rec) in running for rec in recs):
            continue
        by_step = {rec.step: rec for rec in recs}
        out += [by_step[s] for s in plan_local_deletions([x.to_local_info() for x in recs], policy)]
    return out


def run_retention(
    work: WorkView, running: Optional[Set[str]], deadline: Optional[float] = None
) -> int:
    """Apply local retention (see the module docstring); the number deleted."""
    todo = plan(work, running)
    deleted = 0
    stuck: Set[str] = set()
    marks = MarkBuffer(work.ledger, 1.0, work.clock)
    try:
        i = 0
        while i < len(todo):
            user = todo[i].user
            batch = [todo[i]]
            while (
                i + len(batch) < len(todo)
                and todo[i + len(batch)].user == user
                and len(batch) < BATCH_MAX
            ):
                batch.append(todo[i + len(batch)])
            i += len(batch)
            if user in stuck:
                continue
            left = None if deadline is None else deadline - work.clock()
            if left is not None and left < MIN_SLICE_S:
                break
            results = _delete(work, user, batch, left)
            if results is None:
                stuck.add(user)
                continue
            for rec, res in zip(batch, results):
                if not _done(rec, res):
                    continue
                marks.add(rec.ident, set_state(rec.ident, "local", State.DELETED, "retention"))
                deleted += 1
            marks.write_if_due()
    finally:
        marks.write()
    return deleted


def _delete(
    work: WorkView, user: str, batch: List[Record], left: Optional[float]
) -> Optional[List[ChildResult[bool]]]:
    """One child deletes ``batch``; its per-item results (checked: the child runs as the
    user), or None when it was stopped or hung (the owner is skipped for the rest of the
    pass)."""
    items = [[r.key, r.step, r.needs_flush] for r in batch]
    nbytes = sum(r.nbytes for r in batch)
    try:
        got = run_owner_task(work, user, delete_many_as_user, items, nbytes, left, "delete")
        return decode_list(_deleted, got, f"delete as {user}")
    except TimedOut as exc:
        log.warning("retention: %s skipped for now: %s", user, exc)
        return None
    except CkptError as exc:
        log.warning("retention: %s: %s", user, exc)
        return []


def _deleted(value: Any) -> bool:
    """A deletion's value from the child: only ``true`` (see :func:`delete_as_user`)."""
    if value is not True:
        raise ValueError("not a deletion result")
    return True


def _done(rec: Record, res: ChildResult[bool]) -> bool:
    """Did the child delete it (or find it gone already)?"""
    if res.error is None:
        return True
    exc = res.error.exception(f"delete as {rec.user}")
    if isinstance(exc, NotFound):
        return True  # gone already (the job's own retention): record it
    log.warning("retention: kept %s/%s step %d: %s", rec.user, rec.key, rec.step, exc)
    return False
