"""``ckpt-slurm epilog``: after a job, get its checkpoints off the node before anyone else
gets the node.

A node-local checkpoint that has not reached the PFS is lost with the node (reimage,
failure, the next job filling the disk). So the epilog, run by slurmd as root on every node
of an ending job, with the node work of :class:`~slurm_ckpt.node.work.NodeWork`:

1. scans the local tier (as each owning user) and reconciles the node's ledger with it -
   the tiers are the truth, the ledger a cache;
2. flushes every checkpoint not yet verified on the PFS - the job's first, then this
   node's backlog, the owners taking turns (:func:`~slurm_ckpt.node.work.fair_order`)
   - *as the owning user*, within ``hooks.budget`` (which must stay below SLURM's
   PrologEpilogTimeout, or SLURM itself drains the node). Partner copies whose
   writer's node is alive are left to it (:mod:`slurm_ckpt.node.partner_flush`: one
   SLURM query, whatever the manifests name);
3. hands whatever cannot finish in time to the stager daemon (ledger ``FLUSH_PENDING``,
   reason ``"handed to stager"``) and drains the node with a ``slurm_ckpt:`` reason
   (counts and sizes only), so SLURM gives it to no one until the stager is done and
   resumes it. Checkpoints whose failure was their owner's doing (unsafe files, a
   squatted or world-writable PFS directory, a flush child they stopped) are held and
   reported instead: they never keep a node drained (:mod:`slurm_ckpt.node.retry`);
4. applies local retention (never deleting a checkpoint whose PFS copy is not verified);
5. publishes the node's status file on the PFS.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.units import format_duration
from slurm_ckpt.errors import SlurmError
from slurm_ckpt.node.flush_engine import FlushOutcome
from slurm_ckpt.node.partner_flush import OwnerCheck, defer_live_owners
from slurm_ckpt.node.scrub import SCRUB_SHARE
from slurm_ckpt.node.work import RESERVE_FRACTION, RESERVE_MAX_S, NodeWork, drain_reason
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.env import HookEnv

log = logging.getLogger(__name__)

#: Share of the budget the scan of the local tier may take at most.
SCAN_SHARE = 0.5
#: Share of the budget (and most seconds) the one SLURM query about the owners of
#: partner copies is waited on (:mod:`slurm_ckpt.node.partner_flush`).
OWNER_QUERY_SHARE = 0.1
OWNER_QUERY_MAX_S = 10.0

__all__ = ["EpilogReport", "run_epilog"]


# --------------------------------------------------------------------------- epilog


@dataclass
class EpilogReport:
    """What the epilog did (printed as one line, and used by tests)."""

    job_id: str
    node: str
    flush: FlushOutcome
    deleted: int = 0
    drained: Optional[str] = None
    backlog: Tuple[int, int] = (0, 0)
    seconds: float = 0.0
    #: The owner check of the partner copies (at most one SLURM query).
    owners: Optional[OwnerCheck] = None

    def line(self) -> str:
        f = self.flush
        parts = [
            f"epilog job {self.job_id} on {self.node}:",
            f.summary(),
        ]
        if f.handed:
            parts.append(f"handed {len(f.handed)} to the stager")
        if f.failed:
            parts.append(f"{len(f.failed)} failed ({f.failed[0][1]})")
        if self.deleted:
            parts.append(f"deleted {self.deleted} by retention")
        parts.append(f"drained: {self.drained}" if self.drained else "node not drained")
        parts.append(f"in {format_duration(self.seconds)}")
        return " ".join(parts[:1]) + " " + "; ".join(parts[1:])


def run_epilog(
    cfg: Config,
    env: HookEnv,
    client: Optional[SlurmClient] = None,
    budget: Optional[float] = None,
) -> EpilogReport:
    """The epilog (see the module docstring). ``budget`` defaults to ``hooks.budget``."""
    clock = time.monotonic
    t0 = clock()
    total = cfg.hooks.budget if budget is None else float(budget)
    reserve = min(RESERVE_MAX_S, total * RESERVE_FRACTION)
    work = NodeWork(cfg, env.node, client, clock)
    # The scan gets at most half the budget (it stops with what it has).
    work.reconcile(t0 + min(total - reserve, total * SCAN_SHARE))
    running = work.running_jobs(exclude=env.job_id)
    t1 = clock()
    owed = work.owed(running)
    t2 = clock()
    # Partner copies whose owner's node lives are that node's to flush (no two nodes
    # write one step to the PFS at once); a lost owner's, or one past its grace, are
    # flushed here. One SLURM query at most, whatever the manifests name, waited on
    # for a bounded share of the budget (it is spent inside the deadline).
    owed, _deferred, owners = defer_live_owners(
        owed,
        work.scan_nodes,
        env.node,
        client,
        now=work.ledger.clock(),
        grace_s=cfg.partner.owner_grace,
        timeout=min(OWNER_QUERY_MAX_S, total * OWNER_QUERY_SHARE),
        clock=clock,
    )
    t3 = clock()
    todo = work.candidates(running, first_job=env.job_id, owed=owed)
    # What is left after the flushes (drain, status) costs about one more pass over the
    # ledger, as long as the one just made: keep that back too, at any backlog size.
    ledger_s = (t2 - t1) + (clock() - t3)
    deadline = t0 + total - reserve - 2 * ledger_s
    outcome = work.flush(todo, deadline)
    # Warm copies of what the node holds, read back (not those flushed just now): one
    # that rotted is uncommitted on the warm tier and flushed again (node.scrub).
    redo = work.scrub(min(deadline, clock() + total * SCRUB_SHARE), clock() - t0)
    if redo:
        owed = owed + redo
        outcome.results += work.flush(redo, deadline).results
    report = EpilogReport(env.job_id, env.node, outcome, owners=owners)
    count, nbytes = work.backlog(running, owed, outcome)
    report.backlog = (count, nbytes)
    if count and client is not None:
        reason = drain_reason(count, nbytes, outcome.failing)
        try:
            report.drained = client.drain(env.node, reason)
        except SlurmError as exc:
            log.error("could not drain %s (%s); the stager will still flush", env.node, exc)
    if not outcome.handed:  # out of time already: retention is the stager's
        report.deleted = work.retention(running, t0 + total - min(2.0, reserve / 2))
    report.seconds = clock() - t0
    work.publish(
        {
            "hook": "epilog",
            "job": env.job_id,
            "drained": report.drained,
            "handed": len(outcome.handed),
        }
    )
    return report
