"""``ckpt-slurm flush``: copy this node's checkpoints that are not yet on the PFS, now.

* **As root** it flushes the node's whole backlog (or one job's) exactly as the epilog
  and the stager do: :class:`~slurm_ckpt.hooks.epilog.NodeWork` scans the local tier and
  copies each checkpoint *as its owner*; checkpoints of jobs still running on the node are
  left to those jobs unless ``--job`` names them.
* **As a user** it flushes the caller's own checkpoints from the local tier with
  :func:`~slurm_ckpt.tiers.copy.copy_checkpoint`: those the node's ledger says are owed
  to the PFS, or (no ledger) every local step without an identical committed PFS copy.

A checkpoint another process is copying right now (the job's own flusher, the stager) is
skipped as ``busy`` unless ``--wait``, which waits for that copy and then makes sure.
Exit status 1 when anything failed.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import click

from slurm_ckpt.cli.output import CliState, pass_state
from slurm_ckpt.cli.params import JOB_ID, NODE
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.table import (
    Column,
    Listing,
    OutputFormat,
    output_options,
    plural,
    print_json_doc,
)
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError

__all__ = ["FlushSummary", "flush_cmd", "flush_node", "flush_own"]

Ident = Tuple[str, str, int]


@dataclass
class FlushSummary:
    """What one ``flush`` did (``flushed``: ident, bytes copied, seconds)."""

    flushed: List[Tuple[Ident, int, float]] = field(default_factory=list)
    failed: List[Tuple[Ident, str]] = field(default_factory=list)
    busy: List[Ident] = field(default_factory=list)
    left_to_jobs: int = 0

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
        )


def _node_name(node: Optional[str]) -> str:
    from slurm_ckpt.core.names import validate_node

    return validate_node(
        node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    )


def _is_busy(cfg: Config, user: str, key: str, step: int) -> bool:
    """Another process holds the copy lock of this local checkpoint (runs as its owner)."""
    from slurm_ckpt.tiers.registry import tiers_from_config

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
    from slurm_ckpt.hooks.epilog import FlushOutcome, NodeWork
    from slurm_ckpt.node.asuser import run_as

    work = NodeWork(cfg, node, client)
    work.reconcile()
    summary = FlushSummary()
    if job is not None:
        todo = [
            r for r in work.ledger.pending_flush() if r.user in work.users and work.job_of(r) == job
        ]
    else:
        running = work.running_jobs()
        todo = work.candidates(running)
        summary.left_to_jobs = len(
            [r for r in work.ledger.pending_flush() if r.user in work.users]
        ) - len(todo)
    if not wait:
        free = []
        for rec in todo:
            ids = work.users[rec.user]
            try:
                busy = run_as(
                    ids.uid,
                    ids.gid,
                    _is_busy,
                    cfg,
                    *rec.ident,
                    user=ids.name,
                    timeout=30,
                    what="lock probe",
                )
            except CkptError:
                busy = False  # let the flush itself report what is wrong
            if busy:
                summary.busy.append(rec.ident)
            else:
                free.append(rec)
        todo = free
    out = FlushOutcome()
    for rec in todo:  # one at a time, so that progress moves (NodeWork.flush is sequential)
        one = work.flush([rec])
        out.flushed += one.flushed
        out.failed += one.failed
        out.handed += one.handed
        out.dropped += one.dropped
        report(progress, rec.nbytes)
    failed = dict(out.failed)
    by_ident = {r.ident: r for r in todo}
    for ident in out.flushed:
        rec = work.ledger.get(*ident)
        secs = rec.durations.get("flush_s", 0.0) if rec is not None else 0.0
        summary.flushed.append((ident, by_ident[ident].nbytes, float(secs)))
    summary.failed = list(failed.items())
    for ident in out.handed:  # only with a deadline; none is given
        summary.failed.append((ident, "not finished"))
    work.publish({"hook": "flush", "job": job})
    return summary


# --------------------------------------------------------------------------- user


def flush_own(
    cfg: Config,
    user: str,
    node: str,
    job: Optional[str] = None,
    wait: bool = False,
    progress: Optional[ProgressFn] = None,
) -> FlushSummary:
    """A user's own checkpoints on this node's local tier -> the PFS (copy_checkpoint);
    ``progress(nbytes)`` hears of every byte copied."""
    from slurm_ckpt.ledger import State
    from slurm_ckpt.ledger.ledger import LEDGER_NAME, Ledger
    from slurm_ckpt.tiers.copy import copy_checkpoint
    from slurm_ckpt.tiers.registry import tiers_from_config

    tiers = tiers_from_config(cfg)
    local, pfs = tiers["local"], tiers["pfs"]
    ledger: Optional[Ledger] = None
    todo: List[Tuple[Ident, int]] = []
    if os.path.exists(os.path.join(str(cfg.ledger.dir), LEDGER_NAME)):
        try:
            ledger = Ledger(cfg.ledger.dir, node)
            recs = ledger.pending_flush(user=user, job=job)
            todo = [(r.ident, r.nbytes) for r in recs]
        except (CkptError, OSError):
            ledger = None
    if ledger is None:
        for key in local.keys(user):
            for info in local.steps(user, key):
                if job is not None and str(info.manifest.job) != str(job):
                    continue
                todo.append(((user, key, info.step), info.nbytes))
    summary = FlushSummary()
    for ident, _nbytes in todo:
        if not wait and _is_busy(cfg, *ident):
            summary.busy.append(ident)
            continue
        try:
            res = copy_checkpoint(local, pfs, *ident, progress=progress)
        except CkptError as exc:
            summary.failed.append((ident, str(exc)))
            continue
        if ledger is None and res.already_present:
            continue  # no ledger: a scan, and this one was there already
        summary.flushed.append((ident, res.copied_bytes, res.seconds))
        if ledger is not None:
            # The ledger is a cache (maybe not writable by us); the next scan fixes it.
            with contextlib.suppress(CkptError, OSError):
                ledger.mark(*ident, "pfs", State.VERIFIED, error=None)
    return summary


# --------------------------------------------------------------------------- command


FLUSH_COLUMNS = [
    Column("series", "series", parsable=False),
    Column("user", "user", human=False),
    Column("key", "key", human=False),
    Column("step", "step", right=True),
    Column("state", "result"),
    Column("bytes", "size", fmt=format_bytes, right=True),
    Column("seconds", "time", fmt=format_duration, right=True),
    Column("error", "detail", wrap=True),
]


def _rows(summary: FlushSummary) -> List[Dict[str, Any]]:
    def row(ident: Ident, state: str, **kw: Any) -> Dict[str, Any]:
        u, k, s = ident
        return dict({"series": f"{u}/{k}", "user": u, "key": k, "step": s, "state": state}, **kw)

    rows = [row(i, "flushed", bytes=n, seconds=round(t, 3)) for i, n, t in summary.flushed]
    rows += [row(i, "FAILED", error=e) for i, e in summary.failed]
    rows += [
        row(i, "busy", error="another process is flushing it (use --wait)") for i in summary.busy
    ]
    return rows


def _print(summary: FlushSummary, out: OutputFormat) -> None:
    rows = _rows(summary)
    if rows or not out.decorated:
        Listing(FLUSH_COLUMNS, rows, "flush").print(out)
    if not out.decorated:
        return
    total = sum(n for _i, n, _t in summary.flushed)
    line = (
        f"flushed {plural(len(summary.flushed), 'checkpoint')} ({format_bytes(total)}), "
        f"{len(summary.failed)} failed, {len(summary.busy)} busy"
    )
    if summary.left_to_jobs:
        line += f", {summary.left_to_jobs} left to jobs still running here"
    click.echo(line)


@click.command("flush")
@click.option("-j", "--job", type=JOB_ID, default=None, help="Only checkpoints of this job.")
@click.option("--wait", is_flag=True, help="Wait for copies other processes are running.")
@click.option(
    "-w",
    "--node",
    type=NODE,
    default=None,
    help="This node's name (default: $SLURMD_NODENAME, else the host name).",
)
@output_options
@pass_state
def flush_cmd(
    state: CliState, job: Optional[str], wait: bool, node: Optional[str], out: OutputFormat
) -> int:
    """Flush this node's checkpoints to the PFS now (root: every user's, as that user;
    otherwise your own).

    Exit status 1 when anything failed.
    """
    from slurm_ckpt.core.names import current_user

    cfg = state.config
    name = _node_name(node)
    with ByteProgress("flush") as bar:
        if os.geteuid() == 0:
            client = None
            try:
                from slurm_ckpt.slurm.client import SlurmClient

                client = SlurmClient(backend="cli", timeout=15.0)
            except CkptError:
                client = None
            summary = flush_node(cfg, name, job, wait, client, progress=bar.advance)
        else:
            summary = flush_own(cfg, current_user(), name, job, wait, progress=bar.advance)
    if out.json:
        print_json_doc(summary.to_dict())
    else:
        _print(summary, out)
    return 1 if summary.failed else 0
