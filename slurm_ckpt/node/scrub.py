"""Scrubbing: the warm copies of the checkpoints a node still holds are read back, so that
one that rots on the PFS after it was verified is flushed again (issue 28).

A warm copy is verified once, by the copy that made it. Bytes that change afterwards (a
bit flip, a truncation, a lost object) would go unnoticed until a restore needed them -
and by then the node's good local copy may be gone. So the hooks check the warm copies
of what the node holds locally (the only copies that can still be flushed again), in a
child running as each owner (:func:`~slurm_ckpt.node.owner_tasks.scrub_as_user`):

* every such copy, every time: is its committed manifest on the warm tier still the
  local one (cheap: one small read)? Uncommitted there as damaged (by another node) - it
  is owed again; deleted there (the warm tier's retention) - the ledger learns it is
  gone (``DELETED``), and it is not flushed again (that would undo gc);
* least recently checked first, within a time budget: every byte re-read and hashed. A
  copy that fails is **uncommitted** on the warm tier (its manifest moved aside: it
  stops counting for every node, every restore and ``status``) and owed again here.

The epilog scrubs after its flushes, with at most :data:`SCRUB_SHARE` of its budget (the
copies not checked during this epilog: a node is handed to the next job only with the
warm copies of what it holds read back); the stager every pass, a copy at most once per
:data:`SCRUB_EVERY_S`, within :data:`SCRUB_BUDGET_S`. A copy owed again is marked in
the ledger (warm ``BAD``, with why) and flushed like any other; until then ``status``
counts it owed.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Set, Tuple

from slurm_ckpt.errors import CkptError
from slurm_ckpt.ledger import WARM_SLOT, Ident, Record, State
from slurm_ckpt.ledger.record import one_line
from slurm_ckpt.node.flush_engine import MIN_SLICE_S
from slurm_ckpt.node.marks import set_state
from slurm_ckpt.node.owner_tasks import scrub_as_user
from slurm_ckpt.node.retry import clear_failures
from slurm_ckpt.node.work_view import WorkView, run_owner_task

log = logging.getLogger(__name__)

__all__ = ["SCRUB_BUDGET_S", "SCRUB_EVERY_S", "SCRUB_SHARE", "learn_present", "scrub"]

#: The stager re-reads one warm copy at most this often (seconds).
SCRUB_EVERY_S = 3600.0
#: What one stager pass spends on re-reading warm copies at most (seconds).
SCRUB_BUDGET_S = 120.0
#: The share of its budget an epilog may spend re-reading warm copies (after its flushes).
SCRUB_SHARE = 0.25
#: Owed again: the states a scrub reports for a warm copy that no longer counts.
_OWED = ("missing", "damaged")
_STATES = ("ok", "present", "gone", "deleted", "other", *_OWED)


def _last_check(rec: Record) -> float:
    at = rec.extra.get("scrubbed_at")
    if isinstance(at, (int, float)) and not isinstance(at, bool):
        return float(at)
    return float(rec.verified_at.get(WARM_SLOT, 0.0) or 0.0)


def scrub(work: WorkView, deadline: Optional[float], max_age_s: float) -> List[Record]:
    """Check the warm copies of what this node holds (see the module docstring): a full
    re-read of those last checked more than ``max_age_s`` ago, until ``deadline`` (a
    :attr:`NodeWork.clock` value). Returns the records owed again (their ledger marked)."""
    now = work.ledger.clock()
    by_user: Dict[str, List[Record]] = {}
    for rec in work.ledger.records():
        if rec.user not in work.users:
            continue
        if rec.state("local") not in (State.COMMITTED, State.VERIFIED):
            continue
        if rec.state(WARM_SLOT) != State.VERIFIED:
            continue
        by_user.setdefault(rec.user, []).append(rec)
    owed: List[Record] = []
    for user, recs in sorted(by_user.items()):
        left = None if deadline is None else deadline - work.clock()
        if left is not None and left < MIN_SLICE_S:
            break
        recs.sort(key=_last_check)
        items = [[r.key, r.step, now - _last_check(r) > max_age_s] for r in recs]
        rows = _run(work, user, items, left, sum(r.nbytes for r in recs))
        owed += _record(work, user, {r.ident: r for r in recs}, rows)
    return owed


def _run(
    work: WorkView, user: str, items: List[List[Any]], left: Optional[float], nbytes: int
) -> List[Tuple[str, int, str, str]]:
    try:
        got = run_owner_task(work, user, scrub_as_user, items, nbytes, left, "scrub")
    except CkptError as exc:
        log.warning("scrub of %s's warm copies skipped: %s", user, exc)
        return []
    return _rows(got, len(items))


def _rows(got: Any, most: int) -> List[Tuple[str, int, str, str]]:
    """What the child (running as the user) sent, checked row by row."""
    out: List[Tuple[str, int, str, str]] = []
    if not isinstance(got, list):
        return out
    for row in got[:most]:
        if not isinstance(row, list) or len(row) != 4:
            continue
        key, step, state, why = row
        if not isinstance(key, str) or type(step) is not int or state not in _STATES:
            continue
        out.append((key, step, state, one_line(why) if isinstance(why, str) else ""))
    return out


def _record(
    work: WorkView, user: str, recs: Dict[Ident, Record], rows: List[Tuple[str, int, str, str]]
) -> List[Record]:
    """The ledger learns what the scrub found; returns the records owed again."""
    changes = []
    owed: List[Record] = []
    for key, step, state, why in rows:
        rec = recs.get((user, key, step))
        if rec is None:
            continue
        if state == "ok":
            changes.append((rec.ident, _stamp))
        elif state == "deleted":
            # Gone from the warm tier by its retention (gc): not flushed again - the node
            # holding it must not undo gc - but no longer believed to be there.
            gone = set_state(rec.ident, WARM_SLOT, State.DELETED, "not on the warm tier")
            changes.append((rec.ident, gone))
        elif state in _OWED:
            log.warning("%s/%s step %d: %s: flushed again", rec.user, key, step, why)
            work.emit("failure", user=rec.user, key=key, step=step, reason="warm_" + state)
            changes.append(
                (
                    rec.ident,
                    set_state(rec.ident, WARM_SLOT, State.BAD, why, selected_for_flush=True),
                )
            )
            owed.append(rec)
    if changes:
        try:
            work.ledger.update_many(changes)
        except (CkptError, OSError) as exc:
            log.warning("scrub results not recorded in the ledger: %s", exc)
            return []
    return owed


def _stamp(rec: Optional[Record], now: float) -> Optional[Record]:
    if rec is not None:
        rec.extra["scrubbed_at"] = now
    return rec


def learn_present(work: WorkView, recs: List[Record], deadline: Optional[float]) -> Set[Ident]:
    """Of ``recs`` (owed, not flushed here: partner copies left to their live owner's
    node), those the warm tier now holds identically - their owner flushed them - marked
    ``VERIFIED`` in the ledger (the owner's copy verified every byte as it went), so that
    they stop counting as owed here and local retention may drop them. One manifest read
    each, in a child as the owner."""
    by_user: Dict[str, List[Record]] = {}
    for rec in recs:
        if rec.user in work.users:
            by_user.setdefault(rec.user, []).append(rec)
    done: Set[Ident] = set()
    for user, mine in sorted(by_user.items()):
        left = None if deadline is None else deadline - work.clock()
        if left is not None and left < MIN_SLICE_S:
            break
        items = [[r.key, r.step, False] for r in mine]
        rows = _run(work, user, items, left, 0)
        done |= {(user, k, st) for k, st, state, _why in rows if state == "present"}
    if done:

        def verified(rec: Record, _now: float) -> None:
            clear_failures(rec)

        changes = [(i, set_state(i, WARM_SLOT, State.VERIFIED, None, verified)) for i in done]
        try:
            work.ledger.update_many(changes)
        except (CkptError, OSError) as exc:
            log.warning("partner copies found on the warm tier not recorded: %s", exc)
            return set()
    return done
