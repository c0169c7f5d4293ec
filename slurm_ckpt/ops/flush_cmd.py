"""``ckpt-slurm flush`` and ckpt-srun's after-step flush: copy this node's checkpoints that
are not yet on the warm tier (the PFS, or the object store on a site without one), now,
through the one flush engine (:mod:`slurm_ckpt.node.flush_engine`).

* **As root** (:func:`flush_node`) it flushes the node's whole backlog (or one job's)
  exactly as the epilog and the stager do: :class:`~slurm_ckpt.node.work.NodeWork` scans
  the local tier and copies each checkpoint *as its owner*; checkpoints of jobs still
  running on the node are left to those jobs unless ``job`` names them.
* **As a user** (:func:`flush_own`) it flushes the caller's own checkpoints in this
  process: those the node's ledger says are owed to the PFS, or (no ledger) every local
  step without an identical committed PFS copy.
* **ckpt-srun** (:func:`flush_series`) flushes one series, newest first, within a timeout.

A checkpoint another process is copying right now (the job's own flusher, the stager) is
skipped as ``busy`` unless ``wait``, which waits for that copy and then makes sure.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ledger import LEDGER_NAME, Ident, Ledger, Record
from slurm_ckpt.node.asuser import run_as
from slurm_ckpt.node.flush_engine import (
    LEFT_TO_EPILOG,
    Flusher,
    FlushResult,
    FlushStatus,
    copy_in_process,
)
from slurm_ckpt.node.work import NodeWork
from slurm_ckpt.slurm.env import job_env
from slurm_ckpt.tiers.registry import tiers_from_config, warm_tier

__all__ = ["FlushSummary", "flush_node", "flush_own", "flush_series"]


@dataclass
class FlushSummary:
    """What one ``flush`` did (``flushed``: ident, bytes copied, seconds)."""

    flushed: List[Tuple[Ident, int, float]] = field(default_factory=list)
    failed: List[Tuple[Ident, str]] = field(default_factory=list)
    busy: List[Ident] = field(default_factory=list)
    left_to_jobs: int = 0
    #: Partner copies left to their owner's node (alive: it flushes them itself).
    left_to_owners: int = 0

    def add(self, res: FlushResult) -> None:
        if res.ok:
            self.flushed.append((res.ident, res.copied, res.seconds))
        elif res.status in (FlushStatus.FAILED, FlushStatus.BAD, FlushStatus.HANDED):
            self.failed.append((res.ident, res.error or "not finished"))

    def to_dict(self) -> Dict[str, Any]:
        return {
            "flushed": [
                {"user": u, "key": k, "step": s, "bytes": n, "seconds": round(t, 3)}
                for (u, k, s), n, t in self.flushed
            ],
            "failed": [
                {"user": u, "key": k, "step": s, "error": e} for (u, k, s), e in self.failed
            ],
            "busy": [{"user": u, "key": k, "step": s} for u, k, s in self.busy],
            "left_to_running_jobs": self.left_to_jobs,
            "left_to_owner_nodes": self.left_to_owners,
            "ok": not self.failed,
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> FlushSummary:
        return cls(
            flushed=[
                ((f["user"], f["key"], f["step"]), f["bytes"], f["seconds"]) for f in d["flushed"]
            ],
            failed=[((f["user"], f["key"], f["step"]), f["error"]) for f in d["failed"]],
            busy=[(b["user"], b["key"], b["step"]) for b in d["busy"]],
            left_to_jobs=d["left_to_running_jobs"],
            left_to_owners=int(d.get("left_to_owner_nodes", 0)),
        )


def _is_busy(cfg: Config, user: str, key: str, step: int) -> bool:
    """Another process holds the copy lock of this local checkpoint (run as its owner)."""
    local = tiers_from_config(cfg)["local"]
    with local.lock(user, key, step, wait=False) as got:
        return not got


# --------------------------------------------------------------------------- root


def flush_node(
    cfg: Config,
    node: str,
    job: Optional[str] = None,
    wait: bool = False,
    client: Any = None,
    progress: Optional[ProgressFn] = None,
) -> FlushSummary:
    """Root: the node's backlog (or ``job``'s checkpoints), as each owner, via NodeWork.
    ``progress(nbytes)`` hears of each checkpoint's bytes once it is done (the copies
    run in children as the owner: per checkpoint, not per chunk)."""
    work = NodeWork(cfg, node, client)
    work.reconcile()
    summary = FlushSummary()
    if job is not None:
        todo = [
            r for r in work.ledger.pending_flush() if r.user in work.users and work.job_of(r) == job
        ]
    else:
        running = work.running_jobs()
        todo = work.candidates(running, retry_now=True)  # an admin asks: no backoff
        summary.left_to_jobs = len(
            [r for r in work.ledger.pending_flush() if r.user in work.users]
        ) - len(todo)
    # Partner copies whose owner's node is alive are that node's to flush (as the
    # epilog decides); one it flushed already is recorded verified here.
    todo, deferred = work.defer_partner_copies(todo)
    summary.left_to_owners = len(deferred)
    if not wait:
        todo = _not_busy(cfg, work, todo, summary)

    def done(res: FlushResult) -> None:
        summary.add(res)
        report(progress, res.nbytes)

    work.flush(todo, on_result=done)
    work.publish({"hook": "flush", "job": job})
    return summary


def _not_busy(
    cfg: Config, work: NodeWork, todo: List[Record], summary: FlushSummary
) -> List[Record]:
    """``todo`` but the checkpoints another process is copying now; one child per owner
    probes all of theirs (a stopped or hung probe only costs that owner's probe)."""
    by_user: Dict[str, List[Record]] = {}
    for rec in todo:
        by_user.setdefault(rec.user, []).append(rec)
    busy: set = set()
    for user, recs in by_user.items():
        ids = work.users[user]
        try:
            got = run_as(
                ids.uid,
                ids.gid,
                _busy_of,
                cfg,
                user,
                [[r.key, r.step] for r in recs],
                user=ids.name,
                timeout=cfg.hooks.child_timeout,
                what="lock probe",
            )
        except CkptError:
            continue  # let the flush itself report what is wrong
        busy |= {(user, str(k), int(s)) for k, s in got if isinstance(got, list)}
    summary.busy.extend(r.ident for r in todo if r.ident in busy)
    return [r for r in todo if r.ident not in busy]


def _busy_of(cfg: Config, user: str, items: List[List[Any]]) -> List[List[Any]]:
    """As the owner: which of ``items`` (``[key, step]``) another process has locked."""
    return [[k, s] for k, s in items if _is_busy(cfg, user, str(k), int(s))]


# --------------------------------------------------------------------------- user


def _own_ledger(
    cfg: Config, node: str, user: Optional[str] = None
) -> Tuple[Optional[Ledger], bool]:
    """The node's ledger if there is one (and whether this process may write it); with
    ``user``, that user's own ledger instead (``<local root>/<user>/.slurm_ckpt``, where
    a Checkpointer keeps it when it may not write the node's: a laptop)."""
    where = str(cfg.ledger.dir)
    if user is not None:
        where = os.path.join(str(cfg.tiers.local.root), user, ".slurm_ckpt")
    path = os.path.join(where, LEDGER_NAME)
    if not os.path.exists(path):
        return None, False
    try:
        return Ledger(where, node), os.access(where, os.W_OK | os.X_OK)
    except (CkptError, OSError):
        return None, False


def flush_own(
    cfg: Config,
    user: str,
    node: str,
    job: Optional[str] = None,
    wait: bool = False,
    progress: Optional[ProgressFn] = None,
) -> FlushSummary:
    """A user's own checkpoints on this node's local tier -> the PFS, in this process;
    ``progress(nbytes)`` hears of every byte copied."""
    tiers = tiers_from_config(cfg)
    local, pfs = tiers["local"], warm_tier(cfg, tiers)  # the warm tier: PFS or object store
    ledger, writable = _own_ledger(cfg, node)
    if ledger is None:  # no node ledger (a laptop): the user's own, as a Checkpointer keeps
        ledger, writable = _own_ledger(cfg, node, user)
    todo: List[Tuple[Ident, int]] = []
    if ledger is not None:
        try:
            todo = [(r.ident, r.nbytes) for r in ledger.pending_flush(user=user, job=job)]
        except (CkptError, OSError):
            ledger = None
    if ledger is None:
        for key in local.keys(user):
            for info in local.steps(user, key):
                if job is not None and str(info.manifest.job) != str(job):
                    continue
                todo.append(((user, key, info.step), info.nbytes))
    summary = FlushSummary()
    if not wait:
        busy = [it for it in todo if _is_busy(cfg, *it[0])]
        summary.busy = [ident for ident, _n in busy]
        todo = [it for it in todo if it not in busy]
    # The node ledger is a cache (root's on a secure node): the next scan fixes it.
    flusher = Flusher(copy_in_process(local, pfs, progress), ledger if writable else None)
    for ident, nbytes in todo:
        res = flusher.flush_one(ident, nbytes=nbytes)
        if res.status is FlushStatus.ALREADY and ledger is None:
            continue  # no ledger: a scan, and this one was there already
        summary.add(res)
    return summary


# --------------------------------------------------------------------------- ckpt-srun


def flush_series(cfg: Config, user: str, key: str, timeout: Optional[float] = None) -> List[str]:
    """Copy every committed local checkpoint of ``user/key`` - and of its per-rank series
    ``key.rankNNNNN`` (a multi-rank job) - not yet on the PFS; returns one line per
    checkpoint (copied, already there, or why not). Newest first: if time runs out, the
    newest is what a restart wants; the epilog flushes the rest. Partner copies of the
    checkpoints of another node of this job (their manifest names it) are left to it:
    two nodes flushing one step at once would only copy it twice."""
    tiers = tiers_from_config(cfg)
    local, pfs = tiers["local"], warm_tier(cfg, tiers)  # the warm tier: PFS or object store
    pfs.guard_user(user, os.getuid())
    flusher = Flusher(copy_in_process(local, pfs), hand_off_note=LEFT_TO_EPILOG)
    deadline = None if timeout is None else time.monotonic() + timeout
    lines = []
    try:
        jenv = job_env(required=False)
        here, peers = jenv.node, set(jenv.nodes or ())
    except CkptError:
        here, peers = None, set()
    # A multi-rank job saves one series per rank (<key>.rankNNNNN, see job.restore): the
    # rank(s) on this node are flushed too.
    shard = re.compile(re.escape(key) + r"\.rank[0-9]{5}")
    for series in sorted(k for k in local.keys(user) if k == key or shard.fullmatch(k)):
        name = "" if series == key else f"{series[len(key) + 1 :]} "
        for info in reversed(local.steps(user, series)):
            ident = (user, series, info.step)
            what = f"{name}step {info.step}"
            owner = info.manifest.node
            if here is not None and owner and owner != here and owner in peers:
                # A partner copy: its owner's node (in this job, flushing now) flushes it;
                # if that node is lost, the epilog here does (it asks SLURM).
                lines.append(f"{what}: partner copy, left to its owner's node")
                continue
            res = flusher.flush_one(ident, deadline=deadline, nbytes=info.nbytes)
            if res.status is FlushStatus.HANDED:
                lines.append(f"{what}: not flushed (flush timeout; the epilog will)")
            elif res.ok:
                there = "the PFS" if pfs.name == PFS else f"the {pfs.name} tier"
                state = (
                    f"already on {there}"
                    if res.status is FlushStatus.ALREADY
                    else f"flushed in {res.seconds:.1f}s"
                )
                lines.append(f"{what}: {state}")
            else:
                lines.append(f"{what}: flush failed: {res.error}")
    return lines
