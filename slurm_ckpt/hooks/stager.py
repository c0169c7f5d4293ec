"""``ckpt-slurm stager``: the per-node daemon that finishes what the epilog could not.

The epilog has a hard time budget (SLURM kills it at PrologEpilogTimeout and drains the
node); a big checkpoint over a busy PFS may need longer. So the epilog hands the rest to
this daemon and drains the node with a ``slurm_ckpt:`` reason. Each pass of the stager:

1. reconciles the ledger with the local tier (as each user) - it also picks up anything
   left behind by a crashed job, epilog or stager;
2. reads back the PFS copies of what the node holds (each at most once an hour, within a
   budget; :mod:`slurm_ckpt.node.scrub`): one that rotted is uncommitted there and owed
   again; then flushes every checkpoint still owed to the PFS - but partner copies whose
   owner's node is alive (that node flushes them, as the epilog decides; one it flushed
   already is recorded verified here) (as its owner; jobs still running on
   the node are left to flush their own), without an overall time limit - resumable
   copies make a killed pass cheap to redo - but every child has one (``[hooks]
   child_timeout`` without progress, and a size-based cap): a child its user stopped is
   killed, that checkpoint retried after a backoff, and the pass goes on with everyone
   else's;
3. applies local retention and publishes the node status;
4. returns the node to service (``scontrol update nodename=X state=resume``) when nothing
   is owed any more, the node passes its local-tier checks (mount, free space), and the
   node is still drained *with a reason starting with* ``slurm_ckpt:`` - a node an admin
   drained is never undrained. While work remains, the drain reason is kept current
   (``slurm_ckpt: flushing 2 checkpoints (1.1 GiB)``).

Run it from systemd (``etc/slurm-ckpt-stager.service``), or ``--once`` from cron/tests.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError, SlurmError
from slurm_ckpt.node.flush_engine import FlushOutcome
from slurm_ckpt.node.guard import check_local_tier
from slurm_ckpt.node.hook_record import note_hook
from slurm_ckpt.node.scrub import SCRUB_BUDGET_S, SCRUB_EVERY_S
from slurm_ckpt.node.work import NodeWork, drain_reason
from slurm_ckpt.slurm.client import SlurmClient

log = logging.getLogger(__name__)

__all__ = ["StagerReport", "run_stager", "stager_pass"]


@dataclass
class StagerReport:
    """One pass."""

    node: str
    flush: FlushOutcome = field(default_factory=FlushOutcome)
    deleted: int = 0
    backlog: int = 0
    backlog_bytes: int = 0
    resumed: bool = False
    drain: Optional[str] = None
    note: Optional[str] = None
    healthy: bool = True
    seconds: float = 0.0

    def line(self) -> str:
        f = self.flush
        parts = [f.summary()]
        if f.failed:
            parts.append(f"{len(f.failed)} failed ({f.failed[0][1]})")
        if self.deleted:
            parts.append(f"deleted {self.deleted} by retention")
        parts.append(f"{self.backlog} still owed ({format_bytes(self.backlog_bytes)})")
        if self.resumed:
            parts.append("node resumed")
        elif self.drain:
            parts.append(f"node drained: {self.drain}")
        if self.note:
            parts.append(self.note)
        parts.append(f"in {format_duration(self.seconds)}")
        return f"stager on {self.node}: " + "; ".join(parts)


def stager_pass(
    cfg: Config,
    node: str,
    client: Optional[SlurmClient] = None,
    deadline: Optional[float] = None,
) -> StagerReport:
    """One pass of the stager (see the module docstring)."""
    clock = time.monotonic
    t0 = clock()
    report = StagerReport(node)
    try:
        check_local_tier(cfg, check_space=False)
        work = NodeWork(cfg, node, client, clock)
    except CkptError as exc:
        # Nothing to flush from a tier that is not there; keep the node out of service.
        report.healthy = False
        report.note = f"local tier unusable: {exc}"
        if client is not None:
            _return_to_service(cfg, node, client, report)
        report.seconds = clock() - t0
        return report
    work.reconcile(deadline)
    running = work.running_jobs()
    # Warm copies of what the node holds, each read back at most once per SCRUB_EVERY_S:
    # one that rotted is uncommitted there and flushed again in this pass (node.scrub).
    scrub_end = clock() + SCRUB_BUDGET_S
    work.scrub(scrub_end if deadline is None else min(deadline, scrub_end), SCRUB_EVERY_S)
    # Partner copies whose owner's node is alive are that node's to flush (no two nodes
    # copy one step at once for nothing); those it flushed already are recorded here.
    todo, deferred = work.defer_partner_copies(work.candidates(running), deadline)
    report.flush = work.flush(todo, deadline)
    report.deleted = work.retention(running, deadline)
    left = {r.ident for r in deferred}
    report.backlog, report.backlog_bytes = work.backlog(running, skip=left)
    work.publish({"hook": "stager"})
    if client is not None:
        _return_to_service(cfg, node, client, report)
    report.seconds = clock() - t0
    return report


def _return_to_service(cfg: Config, node: str, client: SlurmClient, report: StagerReport) -> None:
    try:
        info = client.node(node)
    except SlurmError as exc:
        report.note = f"node state unknown ({exc})"
        return
    if not info.drained:
        return
    if not info.reason_is_ours:
        report.note = f"drained by someone else ({info.reason!r}); left alone"
        return
    if report.backlog:
        reason = drain_reason(report.backlog, report.backlog_bytes, report.flush.failing)
        report.drain = reason
        if reason != info.reason:
            try:
                # Still ours (checked just above): keep the reason current for admins.
                client.drain(node, reason)
            except SlurmError as exc:
                report.note = f"cannot update drain reason ({exc})"
        return
    try:
        check_local_tier(cfg, check_space=True)
    except CkptError as exc:
        report.drain = info.reason
        report.healthy = False
        report.note = f"not resumed: {exc}"
        return
    try:
        report.resumed = client.resume_if_ours(node)
    except SlurmError as exc:
        report.note = f"resume failed ({exc})"


def run_stager(
    cfg_loader: Callable[[], Config],
    node: str,
    client: Optional[SlurmClient],
    interval: float = 30.0,
    once: bool = False,
    emit: Callable[[str], Any] = print,
) -> int:
    """The daemon loop: a pass every ``interval`` seconds until SIGTERM/SIGINT.

    The configuration is re-read every pass (an admin's change takes effect without a
    restart); a failing pass is logged and retried, never fatal. With ``once``, one pass
    and the exit status says whether anything is still owed or the local tier is unusable
    (0: all done, 1: not).
    """
    stop = {"now": False}

    def _stop(signum: int, _frame: Any) -> None:
        stop["now"] = True

    if not once:
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    while True:
        started = time.monotonic()
        cfg: Optional[Config] = None
        try:
            cfg = cfg_loader()
            report = stager_pass(cfg, node, client)
            emit(report.line())
            status = 1 if report.backlog or not report.healthy else 0
            note_hook(cfg, node, "stager", time.monotonic() - started, report.healthy)
        except CkptError as exc:
            if cfg is not None:
                note_hook(cfg, node, "stager", time.monotonic() - started, False)
            if once:
                raise
            log.error("stager pass failed: %s", exc)
            status = 1
        if once:
            return status
        while not stop["now"] and time.monotonic() - started < interval:
            time.sleep(min(1.0, interval))
        if stop["now"]:
            return 0
