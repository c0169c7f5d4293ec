"""``ckpt-slurm maint`` and ``ckpt-slurm guard``: take nodes out of service without losing a
checkpoint.

``maint NODELIST --reason TEXT (--reboot | --reservation NAME | -- CMD ...)``:

1. drains the nodes with reason ``slurm_ckpt: maint: TEXT`` (a node an admin drained
   already keeps the admin's reason);
2. with ``--signal-jobs``, asks the running jobs to checkpoint now
   (``scancel --signal=USR1 --full``);
3. waits until no job is left on the nodes **and** every node's status (on the PFS, or
   signed in the object store on a site without one: :mod:`slurm_ckpt.ledger.status_store`),
   published *after* the drain began, reports no checkpoint waiting for a flush (an older
   status says nothing about what the last job left behind: keep waiting; the stager
   daemon republishes it every pass);
4. runs the action: ``scontrol reboot ASAP nextstate=resume NODES``, a MAINT reservation,
   or the given command (no shell; ``$SLURM_CKPT_MAINT_NODES`` holds the node list).

When that does not happen within ``--timeout`` it refuses (exit 4) and leaves the nodes
drained with the maint reason. While it waits, it re-asserts the maint reason whenever a
hook (the epilog's ``flushing ...`` drain) replaced it or the stager resumed the node after
its flush: both only touch ``slurm_ckpt:`` reasons, as ours is.

``guard [--node N] [--wait DURATION]`` is for SLURM's ``RebootProgram`` (or a wrapper
around it): exit 0 when the node has no checkpoint waiting for the PFS (the node's ledger,
else its status file on the PFS), else wait up to ``--wait`` and exit 4 with one line.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from slurm_ckpt.core import trust
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError, NotReady, SlurmError
from slurm_ckpt.ledger import LEDGER_NAME, Ledger
from slurm_ckpt.ledger.node_status import status_seq
from slurm_ckpt.ledger.status_store import read_statuses, status_store
from slurm_ckpt.slurm import hostlist
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.records import MAINT_PREFIX

__all__ = [
    "ENV_NODES",
    "NodeWait",
    "StatusWatch",
    "action_argv",
    "guard",
    "local_backlog",
    "maint_reason",
    "node_readiness",
    "run_maint",
    "wait_ready",
]

Say = Callable[[str], None]

ENV_NODES = "SLURM_CKPT_MAINT_NODES"


def maint_reason(text: str) -> str:
    return f"{MAINT_PREFIX} {' '.join(text.split())}"


#: Builds the SLURM client (tests replace it).
def _default_client() -> Any:
    return SlurmClient(backend="cli", timeout=30.0)


client_factory: Callable[[], Any] = _default_client


# --------------------------------------------------------------------------- readiness


@dataclass
class NodeWait:
    """Why one node is (not yet) ready."""

    node: str
    jobs: List[str] = field(default_factory=list)
    status_time: Optional[float] = None
    pending: int = 0
    pending_bytes: int = 0
    fresh: bool = False
    note: Optional[str] = None

    @property
    def ready(self) -> bool:
        return not self.jobs and self.fresh and self.pending == 0

    def line(self) -> str:
        if self.ready:
            return f"{self.node}: ready"
        parts = []
        if self.jobs:
            noun = "job" if len(self.jobs) == 1 else "jobs"
            parts.append(f"{len(self.jobs)} {noun} running ({','.join(self.jobs)})")
        if self.status_time is None:
            parts.append("no node status on the PFS yet")
        elif not self.fresh:
            parts.append("waiting for a node status newer than the drain and the end of its jobs")
        if self.pending:
            noun = "checkpoint" if self.pending == 1 else "checkpoints"
            parts.append(
                f"{self.pending} {noun} ({format_bytes(self.pending_bytes)}) waiting for a flush"
            )
        if self.note:
            parts.append(self.note)
        return f"{self.node}: " + "; ".join(parts)


class StatusWatch:
    """What one reader (a ``maint`` run, a ``guard``) has seen of each node's statuses,
    so that a replayed one cannot decide (see :mod:`slurm_ckpt.ledger.status_store`).

    A status counts (``fresh``) only when it was published after the moment this reader
    saw the node's jobs gone, and its sequence number is above every one seen up to
    that moment and not below any seen since. Whatever a user puts back - a status root
    signed before the node's last job ended, or before a newer one this reader read -
    is stale, however it is signed.
    """

    def __init__(self) -> None:
        self.gone_at: Dict[str, float] = {}
        self.baseline: Dict[str, int] = {}
        self.highest: Dict[str, int] = {}

    def jobs_seen(self, node: str, running: bool, at: float) -> None:
        """This round's SLURM view of ``node`` (queried at ``at``)."""
        if running:
            self.gone_at.pop(node, None)
        elif node not in self.gone_at:
            self.gone_at[node] = at
            self.baseline[node] = self.highest.get(node, 0)

    def fresh(self, node: str, doc: Dict[str, Any]) -> Tuple[bool, Optional[str]]:
        """Whether ``doc`` (the node's status read this round) may decide, and why not."""
        seq = status_seq(doc)
        try:
            published = float(doc.get("time"))
        except (TypeError, ValueError):
            return False, "its node status has no time"
        if seq is None:
            return False, "its node status has no sequence number (an old or forged one)"
        highest = self.highest.get(node, 0)
        self.highest[node] = max(highest, seq)
        if seq < highest:
            return False, "ignored a node status older than one already seen (a replay?)"
        gone = self.gone_at.get(node)
        if gone is None:
            return False, None
        if published <= gone or seq <= self.baseline.get(node, 0):
            return False, None
        return True, None


def node_readiness(
    nodes: Sequence[str],
    since: float,
    statuses: Sequence[Dict[str, Any]],
    jobs: Dict[str, List[str]],
    watch: Optional[StatusWatch] = None,
    at: Optional[float] = None,
) -> List[NodeWait]:
    """Combine SLURM's jobs per node with the node status files: ``pending`` counts only
    from a status published after ``since`` (the drain) and fresh to ``watch`` (newer
    than the moment the node's jobs were seen gone, a sequence number never seen
    before); ``at`` is when ``jobs`` was asked for."""
    watch = watch if watch is not None else StatusWatch()
    at = time.time() if at is None else at
    by_node = {d.get("node"): d for d in statuses}
    out = []
    for node in nodes:
        w = NodeWait(node, jobs=list(jobs.get(node, [])))
        watch.jobs_seen(node, bool(w.jobs), at)
        doc = by_node.get(node)
        if doc is not None:
            try:
                w.status_time = float(doc.get("time"))
            except (TypeError, ValueError):
                w.status_time = None
            pend = doc.get("pending") or {}
            w.pending = int(pend.get("count", 0) or 0)
            w.pending_bytes = int(pend.get("bytes", 0) or 0)
            fresh, why = watch.fresh(node, doc)
            w.fresh = fresh and w.status_time is not None and w.status_time >= since
            w.note = why
        out.append(w)
    return out


def _jobs(client: Any, nodes: Sequence[str]) -> Dict[str, List[str]]:
    return {n: [job for job, _user, _state in client.jobs_on_node(n)] for n in nodes}


def _keep_drained(client: Any, node: str, reason: str) -> Optional[str]:
    """Re-assert the maint drain if a slurm_ckpt hook replaced it or the stager resumed
    the node; an admin's own drain is left alone. Returns a note for the display."""
    try:
        info = client.node(node)
    except SlurmError as exc:
        return f"node state unknown ({exc})"
    if info.drained and (info.reason == reason or not info.reason_is_ours):
        return None
    client.drain(node, reason)
    return None


# --------------------------------------------------------------------------- actions


def action_argv(
    nodes: Sequence[str], reboot: bool, reservation: Optional[str], command: Sequence[str]
) -> Tuple[str, List[str]]:
    names = hostlist.compress(nodes)
    if reboot:
        return "slurm", ["scontrol", "reboot", "ASAP", "nextstate=resume", names]
    if reservation is not None:
        return "slurm", [
            "scontrol",
            "create",
            "reservation",
            f"ReservationName={reservation}",
            f"Nodes={names}",
            "StartTime=now",
            "Duration=infinite",
            "Users=root",
            "Flags=MAINT,IGNORE_JOBS",
        ]
    return "command", list(command)


def _run_action(client: Any, kind: str, argv: List[str], nodes: Sequence[str]) -> None:
    if kind == "slurm":
        client.cli.run(argv)
        return
    env = dict(os.environ)
    env[ENV_NODES] = hostlist.compress(nodes)
    try:
        proc = subprocess.run(argv, env=env, check=False)
    except OSError as exc:
        raise CkptError(f"maint command {argv[0]!r}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        raise CkptError(f"maint command {argv[0]!r} failed with exit status {proc.returncode}")


def wait_ready(
    client: Any,
    pfs_root: Any,
    nodes: Sequence[str],
    reason: str,
    since: float,
    timeout: float,
    poll: float,
    on_poll: Optional[Callable[[List[NodeWait]], None]] = None,
) -> List[NodeWait]:
    """Poll until every node is ready (returned) or ``timeout`` (NotReady raised);
    ``on_poll(waits)`` sees every round (for a progress display)."""
    deadline = time.monotonic() + timeout
    watch = StatusWatch()
    while True:
        for n in nodes:
            _keep_drained(client, n, reason)
        notes: List[str] = []
        statuses = read_statuses(pfs_root, notes)  # the PFS, or signed objects in the bucket
        jobs = _jobs(client, nodes)
        # SLURM's answer came by now: a node without jobs has had none since at least
        # this moment, and only a status published after it can speak for it.
        at = time.time()
        waits = node_readiness(nodes, since, statuses, jobs, watch, at)
        for w in waits:
            if w.status_time is None and notes:
                w.note = f"ignored: {notes[0]}"  # untrusted statuses never count
        if on_poll is not None:
            on_poll(waits)
        if all(w.ready for w in waits):
            return waits
        left = deadline - time.monotonic()
        if left <= 0:
            busy = "; ".join(w.line() for w in waits if not w.ready)
            raise NotReady(
                f"maint: not safe after {format_duration(timeout)} ({busy}); "
                f"nothing done, nodes left drained ({reason})"
            )
        time.sleep(min(poll, max(left, 0.05)))


def run_maint(
    cfg: Any,
    nodes: Sequence[str],
    reason: str,
    action: Tuple[str, List[str]],
    *,
    signal_jobs: bool,
    timeout: float,
    poll: float,
    say: Say,
    on_poll: Optional[Callable[[List[NodeWait]], None]] = None,
) -> None:
    """Drain, optionally signal the jobs, wait until nothing is left to flush, then run
    ``action`` (from :func:`action_argv`); see the module docstring."""
    kind, argv = action
    client = client_factory()
    text = maint_reason(reason)
    since = time.time()
    for n in nodes:
        if client.drain(n, text) is None:
            info = client.node(n)
            say(f"{n}: already drained by someone else ({info.reason}); kept")
    say(f"drained {','.join(nodes)}: {text}")
    if signal_jobs:
        seen = set()
        for jobs in _jobs(client, nodes).values():
            for job in jobs:
                if job in seen:
                    continue
                seen.add(job)
                try:
                    client.signal(job, "USR1", full=True)
                    say(f"asked job {job} to checkpoint (USR1)")
                except SlurmError as exc:
                    say(f"job {job}: signal failed: {exc}")
    t0 = time.monotonic()
    wait_ready(client, status_store(cfg), nodes, text, since, timeout, poll, on_poll)
    say(
        f"{','.join(nodes)}: no jobs, nothing left to flush "
        f"(after {format_duration(time.monotonic() - t0)}); running: {' '.join(argv)}"
    )
    _run_action(client, kind, argv, nodes)
    if kind != "reboot":
        say(
            f"done; nodes stay drained - return them with: scontrol update "
            f"nodename={','.join(nodes)} state=resume"
        )


# --------------------------------------------------------------------------- guard


def local_backlog(cfg: Any, node: str) -> Optional[Tuple[int, int]]:
    """``(count, bytes)`` owed to the PFS per the node's ledger; None without a ledger
    root can trust (the directory and the file root's, writable by no one else: a
    ledger a user could write must not decide a reboot)."""
    directory = str(cfg.ledger.dir)
    try:
        dst = os.lstat(directory)
        fst = os.lstat(os.path.join(directory, LEDGER_NAME))
    except OSError:
        return None
    if trust.unsafe_dir(dst, trust.ROOT_UID) is not None:
        return None
    if not stat.S_ISREG(fst.st_mode) or fst.st_uid != trust.ROOT_UID or fst.st_mode & 0o022:
        return None
    recs = Ledger(Path(directory), node).pending_flush()
    return len(recs), sum(r.nbytes for r in recs)


#: ``_pfs_backlog``: a status is there, but none fresh enough to decide yet.
_STALE = (-1, 0)


def _pfs_backlog(cfg: Any, node: str, watch: StatusWatch) -> Optional[Tuple[int, int]]:
    for doc in status_store(cfg).read():
        if doc.get("node") == node:
            if not watch.fresh(node, doc)[0]:
                return _STALE
            pend = doc.get("pending") or {}
            return int(pend.get("count", 0) or 0), int(pend.get("bytes", 0) or 0)
    return None


def _backlog(cfg: Any, node: str, watch: StatusWatch) -> Tuple[Optional[Tuple[int, int]], str]:
    got = local_backlog(cfg, node)
    if got is not None:
        return got, "ledger"
    return _pfs_backlog(cfg, node, watch), "PFS status"


def guard(cfg: Any, node: str, wait_s: float, poll: float, since: Optional[float] = None) -> str:
    """Wait up to ``wait_s`` until ``node`` owes nothing to the PFS: the one-line answer,
    or NotReady (exit 4) when it still does.

    The node's own ledger decides when root can trust it. Else its published status
    does, but only one published after ``since`` (default: now, when guard is asked:
    the node's jobs are gone then; see :class:`StatusWatch`): an older one, even root's,
    may be a replay and waits for the next publication (the stager's next pass)."""
    deadline = time.monotonic() + wait_s
    watch = StatusWatch()
    watch.jobs_seen(node, False, time.time() if since is None else since)
    while True:
        got, source = _backlog(cfg, node, watch)
        if got is None:
            return f"guard {node}: no ledger and no node status: nothing known to flush"
        if got == _STALE:
            if time.monotonic() >= deadline:
                raise NotReady(
                    f"guard {node}: no node status newer than the guard's start yet "
                    f"({source}: an older one may be a replay); refusing"
                )
            time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))
            continue
        count, nbytes = got
        if count == 0:
            return f"guard {node}: nothing waiting for a flush ({source})"
        left = deadline - time.monotonic()
        if left <= 0:
            noun = "checkpoint" if count == 1 else "checkpoints"
            raise NotReady(
                f"guard {node}: {count} {noun} ({format_bytes(nbytes)}) not yet flushed to "
                f"the {'PFS' if cfg.tiers.pfs is not None else 'object store'} ({source}); "
                "refusing"
            )
        time.sleep(min(poll, left))
