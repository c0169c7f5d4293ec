"""The node work that prolog, epilog, stager and root ``ckpt-slurm flush`` share.

Runs as root over every user's local checkpoints: scan the local tier and reconcile the
node's ledger with it (the tiers are the truth, the ledger a cache), pick what is owed to
the warm tier, flush it with the one flush engine (:mod:`slurm_ckpt.node.flush_engine`) *as the
checkpoint's owner*, apply local retention, and publish the node's status. Every touch of
user data happens in a child process running as that user
(:mod:`slurm_ckpt.node.asuser`), behind the guards of :mod:`slurm_ckpt.node.guard`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from slurm_ckpt.admission.gate import SlotGate
from slurm_ckpt.admission.policy import Priority
from slurm_ckpt.core import fsio
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import UserIds, user_ids, validate_key
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError, InvalidName, SlurmError
from slurm_ckpt.ledger import WARM_SLOT, Ident, Ledger, Record, State
from slurm_ckpt.ledger.events import EventLog
from slurm_ckpt.ledger.status_store import status_store
from slurm_ckpt.node.asuser import (
    AsUserError,
    AsUserTimeout,
    ChildResult,
    decode_list,
    decode_value,
    run_as,
)
from slurm_ckpt.node.flush_batches import BATCH_MAX, batch_from, fair_order
from slurm_ckpt.node.flush_engine import (
    HANDED_TO_STAGER,
    Flusher,
    FlushOutcome,
    FlushResult,
    FlushStatus,
)
from slurm_ckpt.node.guard import ensure_ledger_dir
from slurm_ckpt.node.local_retention import run_retention
from slurm_ckpt.node.owner_tasks import (
    flush_as_user,
    flush_many_as_user,
    scan_local,
)
from slurm_ckpt.node.partner_flush import defer_live_owners, mark_partner_copies
from slurm_ckpt.node.retry import RetryPolicy, held, retry_due
from slurm_ckpt.node.scrub import learn_present, scrub
from slurm_ckpt.node.suspects import record_suspects
from slurm_ckpt.node.warm import lend_credentials
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.tiers.copy import CopyResult

log = logging.getLogger(__name__)

#: The stager's and root flush's one SLURM query about partner copies' owners waits at
#: most this long (the epilog's own bound is a share of its budget).
OWNER_QUERY_TIMEOUT_S = 10.0

__all__ = [
    "BATCH_MAX",
    "HANDED_TO_STAGER",
    "RESERVE_FRACTION",
    "RESERVE_MAX_S",
    "SCAN_TIMEOUT_S",
    "NodeWork",
    "drain_reason",
    "fair_order",
]

#: Part of a hook's budget kept back for hand-off, drain, retention and the status file.
RESERVE_FRACTION = 0.2
RESERVE_MAX_S = 15.0
#: A scan (listing and reading manifests) of one user's local directory.
SCAN_TIMEOUT_S = 60.0
#: A child's total time limit, in ``child_timeout``s (plus its bytes at min_flush_rate).
CHILD_LIMIT_FACTOR = 10
_NO_GATE = object()


# --------------------------------------------------------------------------- users


def _warm_verified(raw: Dict[str, Any]) -> bool:
    return (raw.get("tiers") or {}).get(WARM_SLOT) == State.VERIFIED.value


# --------------------------------------------------------------------------- root side


def drain_reason(count: int, nbytes: int, failed: int = 0) -> str:
    """``slurm_ckpt: flushing 3 checkpoints (1.2 GiB)`` (+ how many are failing).

    Counts and sizes only, and where to look: a drain reason is shown to every admin
    and user (``sinfo -R``), and error texts carry names users chose: none goes in."""
    noun = "checkpoint" if count == 1 else "checkpoints"
    text = f"slurm_ckpt: flushing {count} {noun} ({format_bytes(nbytes)})"
    if failed:
        text += f"; {failed} failing"
    return text + "; see ckpt-slurm status"


class NodeWork:
    """The node-side work shared by prolog, epilog and stager (see module docstring).

    Runs as root; every touch of user data goes through :func:`run_as`, with a deadline
    and a stall limit (``[hooks] child_timeout``): a child its user stops is killed and
    the loop goes on with other users. Not thread-safe and meant for a single-threaded
    process (it forks).
    """

    def __init__(
        self,
        cfg: Config,
        node: str,
        client: Optional[SlurmClient] = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.client = client
        self.clock = clock
        self.local_root = str(cfg.tiers.local.root)
        self.users: Dict[str, UserIds] = {}
        self.scan_jobs: Dict[Ident, Optional[str]] = {}
        #: The node each scanned checkpoint was written on (its manifest): another node
        #: for a partner copy (:mod:`slurm_ckpt.node.partner_flush`).
        self.scan_nodes: Dict[Ident, Optional[str]] = {}
        self.skipped_dirs: List[str] = []
        #: Problems found with users' directories this run (for the node status).
        self.refused: List[Dict[str, Any]] = []
        self.retry = RetryPolicy.from_config(cfg)
        self._sizes: Dict[Ident, int] = {}  # bytes of what flush() copies (child limits)
        self._queue: List[Ident] = []  # flush()'s order, for batches of small ones
        self._queue_pos: Dict[Ident, int] = {}
        self._prefetched: Dict[Ident, ChildResult[CopyResult]] = {}  # of batch children
        self._gate: Any = _NO_GATE  # the PFS slot gate, made at the first flush
        self._events: Optional[EventLog] = None
        ensure_ledger_dir(cfg.ledger.dir)
        self.ledger = Ledger(cfg.ledger.dir, node)
        lend_credentials(cfg)  # object tier: root's credentials for the owner children

    # -- events -----------------------------------------------------------------------
    def emit(self, event_type: str, **fields: Any) -> None:
        """An event in the node's event log (never fatal)."""
        try:
            self.event_log().emit(event_type, **fields)
        except (CkptError, OSError, ValueError) as exc:
            log.warning("event %s not logged: %s", event_type, exc)

    def event_log(self) -> EventLog:
        """The node's event log (root's: the one its metrics count)."""
        if self._events is None:
            self._events = EventLog.from_config(self.cfg, self.node)
        return self._events

    def _refuse(self, tier: str, user: str, why: str, code: str) -> None:
        """Remember (status) and report (event, log) a user directory refused."""
        if any(r["tier"] == tier and r["user"] == user for r in self.refused):
            return
        self.refused.append({"tier": tier, "user": user, "code": code, "reason": why})
        log.warning("%s", why)
        self.emit("refused", tier=tier, user=user, reason=code, error=why)

    # -- scan -------------------------------------------------------------------------
    def local_users(self) -> List[UserIds]:
        """User directories on the local tier that are safe to act on: a real directory
        (not a symlink), named after a known user, owned by that user."""
        try:
            names = sorted(os.listdir(self.local_root))
        except OSError as exc:
            raise fsio.tier_error(exc, f"local tier root {self.local_root}") from None
        out = []
        self.skipped_dirs = []
        for name in names:
            if name.startswith("."):
                continue
            try:
                ids = user_ids(name)
            except CkptError as exc:
                # lost+found, an admin's directory...: not ours to look into.
                log.debug("local tier: skipping %r: %s", name, exc)
                continue
            try:
                st = os.lstat(os.path.join(self.local_root, name))
            except OSError as exc:
                log.warning("local tier: skipping %r: %s", name, exc)
                self.skipped_dirs.append(name)
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and ids.uid != 0:
                # Root's own: a prolog's mkdir before its chown (another job of this user
                # starting now). Nothing of the user's is in it yet, and no one but root
                # made it: not a squat to report.
                log.debug("local tier: skipping %r: root's, being prepared", name)
                self.skipped_dirs.append(name)
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != ids.uid:
                what = "not a directory" if not stat.S_ISDIR(st.st_mode) else "wrong owner"
                self.skipped_dirs.append(name)
                code = "squatted" if stat.S_ISDIR(st.st_mode) else "unsafe_dir"
                self._refuse(
                    "local",
                    name,
                    f"local tier: skipping {self.local_root}/{name}: {what} (uid "
                    f"{st.st_uid}, {name} is {ids.uid}); the next prolog of {name} moves "
                    "it aside",
                    code,
                )
                continue
            out.append(ids)
        return out

    def _left(self, deadline: Optional[float]) -> Optional[float]:
        return None if deadline is None else deadline - self.clock()

    def reconcile(self, deadline: Optional[float] = None) -> Dict[str, int]:
        """Scan every user's local checkpoints (as that user) and bring the ledger in line.

        Records are pruned (local copy gone -> ``DELETED``) only when every scan
        succeeded and was complete (a user directory skipped as unsafe counts as empty:
        nothing in it may be touched until it is fixed, and the next scan brings its
        records back); PFS states the ledger already has are kept as they are. Each scan
        stops at its share of what is left before ``deadline`` (shared evenly by the
        users not scanned yet) with what it has (then nothing is pruned), and a scan
        whose child is stopped or hangs is killed: that user is skipped this time.
        """
        local: List[Tuple[str, str, int, int]] = []
        suspects: List[Tuple[str, str, int]] = []  # flagged manifests: counted, nothing else
        # What changes in the ledger from here on (another hook's flush or retention) is
        # newer than these scans: the ledger leaves it as it is.
        since = self.ledger.clock()
        complete = True
        self.users = {}
        self.scan_jobs = {}
        self.scan_nodes = {}
        stall = self.cfg.hooks.child_timeout
        users = self.local_users()
        for turn, ids in enumerate(users):
            left = self._left(deadline)
            if left is not None and left <= 0:
                complete = False  # no time to look: this user's records stay as they are
                self.users[ids.name] = ids
                continue
            # Each user's scan gets at most a fair share of what is left (a user with
            # 100,000 checkpoints cannot spend the others' time), whatever it leaves
            # unused going to those after it.
            share = None if left is None else left / (len(users) - turn)
            timeout = SCAN_TIMEOUT_S if share is None else max(0.1, min(SCAN_TIMEOUT_S, share))
            try:
                got = run_as(
                    ids.uid,
                    ids.gid,
                    scan_local,
                    self.local_root,
                    ids.name,
                    max(0.05, timeout * 0.9 - 0.05),
                    user=ids.name,
                    timeout=timeout,
                    stall_timeout=stall,
                    what="scan",
                )
            except CkptError as exc:
                log.warning("scan of %s/%s failed: %s", self.local_root, ids.name, exc)
                complete = False
                continue
            self.users[ids.name] = ids
            if not isinstance(got, dict) or got.get("partial") is not False:
                complete = False
            rows = got.get("rows") if isinstance(got, dict) else None
            for row in rows if isinstance(rows, list) else []:
                if not isinstance(row, list) or len(row) not in (4, 5, 6):
                    continue
                key, step, nbytes, job = row[:4]
                owner = row[4] if len(row) >= 5 and isinstance(row[4], str) else None
                try:
                    validate_key(key)
                except InvalidName:
                    continue
                if type(step) is not int or type(nbytes) is not int or step < 0 or nbytes < 0:
                    continue
                local.append((ids.name, key, step, nbytes))
                if len(row) == 6 and row[5] is True:
                    suspects.append((ids.name, key, step))
                self.scan_jobs[(ids.name, key, step)] = None if job is None else str(job)
                self.scan_nodes[(ids.name, key, step)] = owner
        verified = [
            (raw["user"], raw["key"], raw["step"], int(raw.get("nbytes", 0)))
            for raw in Ledger.select(self.ledger.snapshot(), None, None, None, _warm_verified)
        ]
        counts = self.ledger.reconcile(
            local, verified, prune=complete, jobs=self.scan_jobs, since=since
        )
        try:
            mark_partner_copies(self.ledger, self.scan_nodes, self.node)
        except (CkptError, OSError) as exc:
            log.warning("partner copies not marked in the ledger: %s", exc)
        if suspects:
            try:
                record_suspects(self.event_log(), suspects)
            except (CkptError, OSError, ValueError) as exc:
                log.warning("suspect steps not recorded: %s", exc)
        return counts

    def job_of(self, rec: Record) -> Optional[str]:
        return rec.job or self.scan_jobs.get(rec.ident)

    # -- SLURM ------------------------------------------------------------------------
    def running_jobs(self, exclude: Optional[str] = None) -> Optional[Set[str]]:
        """Ids of the jobs on this node (but ``exclude``); None if SLURM cannot say."""
        if self.client is None:
            return None
        try:
            rows = self.client.jobs_on_node(self.node)
        except SlurmError as exc:
            log.warning("cannot list the jobs on %s: %s", self.node, exc)
            return None
        return {job for job, _user, _state in rows if job != exclude}

    def owed(self, running: Optional[Set[str]]) -> List[Record]:
        """Checkpoints owed to the PFS of users whose directory was scanned, jobs still
        running here excluded (their own job flushes them). One pass over the ledger:
        a hook computes it once and derives :meth:`candidates` and :meth:`backlog`
        from it."""
        out = []
        for rec in self.ledger.pending_flush():
            if rec.user not in self.users:
                continue
            job = self.job_of(rec)
            if running and job is not None and job in running:
                continue
            out.append(rec)
        return out

    def candidates(
        self,
        running: Optional[Set[str]],
        first_job: Optional[str] = None,
        *,
        retry_now: bool = False,
        owed: Optional[List[Record]] = None,
    ) -> List[Record]:
        """Checkpoints owed to the PFS that this process should flush: all of them but
        those of jobs still running here (their own job flushes them) and those waiting
        out a retry backoff - except ``first_job``'s (its epilog is the moment to try
        them) and with ``retry_now`` (an admin asked). ``first_job``'s come first, then
        the oldest."""
        now = self.ledger.clock()
        out = [
            rec
            for rec in (self.owed(running) if owed is None else owed)
            if retry_now
            or retry_due(rec.extra, now)
            or (first_job is not None and self.job_of(rec) == first_job)
        ]
        if first_job is not None:
            out.sort(key=lambda r: self.job_of(r) != first_job)
        return fair_order(out)

    # -- flush ------------------------------------------------------------------------
    def flusher(self) -> Flusher:
        """The flush engine over this node's ledger, copying as each checkpoint's owner,
        under the cluster-wide PFS admission control (``[admission]``) when configured."""
        return Flusher(
            self._copy_as_owner,
            self.ledger,
            hand_off_note=HANDED_TO_STAGER,
            clock=self.clock,
            slots=self._slot_gate(),
            retry=self.retry,
            allowance=self._allowance,
        )

    def _allowance(self, nbytes: int) -> float:
        """The time a copy of ``nbytes`` is always allowed when others wait (its fair
        share may be more): one stall limit plus its size at ``min_flush_rate``."""
        h = self.cfg.hooks
        return h.child_timeout + max(0, nbytes) / h.min_flush_rate

    def _slot_gate(self) -> Optional[SlotGate]:
        """The PFS slot gate, made once: maintenance priority when an admin holds this
        node for maintenance (someone waits on it); decisions go to the node's event log
        (the admission metrics and panels). None without an admission cap."""
        if self._gate is _NO_GATE:
            prio = Priority.ROUTINE
            if self.client is not None:
                with contextlib.suppress(SlurmError):
                    if self.client.node(self.node).held_for_maint:
                        prio = Priority.MAINTENANCE
            emit = EventLog.from_config(self.cfg, self.node).emit
            self._gate = SlotGate.from_config(self.cfg, self.node, priority=prio, emit=emit)
        return self._gate  # type: ignore[return-value]

    def child_limit(self, nbytes: int) -> float:
        """The most a child copying ``nbytes`` may take in all (10 x ``child_timeout`` +
        size / ``min_flush_rate``; a checkpoint of many small files costs per file, not
        per byte): a user who keeps their child alive but slows it to a trickle still
        cannot hold root's loop for longer. A stopped child is caught much sooner, by
        its silence (``child_timeout``)."""
        h = self.cfg.hooks
        return CHILD_LIMIT_FACTOR * h.child_timeout + max(0, nbytes) / h.min_flush_rate

    def _copy_as_owner(self, ident: Ident, left: Optional[float]) -> CopyResult:
        """A :data:`~slurm_ckpt.node.flush_engine.CopyFn`: the copy runs in a child that
        has become the owner; what it sends back is checked before the engine sees it
        (:meth:`CopyResult.from_json`, and it must be about the step asked for)."""
        where = f"flush as {ident[0]}"
        done = self._prefetched.pop(ident, None)
        if done is not None:  # copied by the child of an earlier checkpoint of its owner
            return _of_step(done.unwrap(where), ident, where)
        ids = self.users[ident[0]]
        batch = self._batch_from(ident)
        cap = self.child_limit(sum(self._sizes.get(i, 0) for i in batch))
        timeout = cap if left is None else min(left, cap)
        if len(batch) == 1:
            got = run_as(
                ids.uid,
                ids.gid,
                flush_as_user,
                self.cfg,
                *ident,
                ids.uid,
                user=ids.name,
                timeout=timeout,
                stall_timeout=self.cfg.hooks.child_timeout,
                what="flush",
            )
            return _of_step(decode_value(CopyResult.from_json, got, where), ident, where)
        got = run_as(
            ids.uid,
            ids.gid,
            flush_many_as_user,
            self.cfg,
            ids.name,
            ids.uid,
            [[k, s] for _u, k, s in batch],
            max(0.05, timeout * 0.8 - 0.1),
            user=ids.name,
            timeout=timeout,
            stall_timeout=self.cfg.hooks.child_timeout,
            what="flush",
        )
        results = decode_list(CopyResult.from_json, got, where)
        if len(results) > len(batch):
            raise AsUserError(f"{where}: garbled result from the child")
        self._prefetched.update(zip(batch, results))
        if ident not in self._prefetched:
            raise AsUserTimeout(f"flush as {ids.name}: no time left for {ident[1]}/{ident[2]}")
        return self._copy_as_owner(ident, left)

    def _batch_from(self, ident: Ident) -> List[Ident]:
        return batch_from(self._queue, self._queue_pos, self._sizes, ident)

    def flush(
        self,
        records: List[Record],
        deadline: Optional[float] = None,
        on_result: Optional[Callable[[FlushResult], None]] = None,
    ) -> FlushOutcome:
        """Copy each record's checkpoint to the PFS as its owner (users whose directory
        the scan refused are skipped); what ``deadline`` (a :attr:`clock` value) leaves no
        time for is handed to the stager. Failures the owner caused are reported (event,
        node status) and held: they never keep the node drained."""
        todo = [r for r in records if r.user in self.users]
        self._sizes = {r.ident: r.nbytes for r in todo}
        self._queue = [r.ident for r in todo]
        self._queue_pos = {ident: i for i, ident in enumerate(self._queue)}
        self._prefetched = {}

        def seen(res: FlushResult) -> None:
            if res.hold and (res.status != FlushStatus.HANDED or res.stuck):
                self._report_hold(res)
            if on_result is not None:
                on_result(res)

        items = [(r.ident, r.nbytes) for r in todo]
        try:
            return self.flusher().flush_all(items, deadline, seen)
        finally:
            self._prefetched = {}

    def _report_hold(self, res: FlushResult) -> None:
        user, key, step = res.ident
        if res.hold in ("squatted", "unsafe_dir"):
            self._refuse(self.cfg.tiers.warm, user, res.error or res.hold, res.hold)
            return
        self.emit("refused", user=user, key=key, step=step, reason=res.hold, error=res.error or "")

    def hand_off(self, idents: List[Ident]) -> None:
        """Leave these to the stager: ``FLUSH_PENDING`` with reason "handed to stager"."""
        self.flusher().hand_off(idents)

    def backlog(
        self,
        running: Optional[Set[str]],
        owed: Optional[List[Record]] = None,
        outcome: Optional[FlushOutcome] = None,
        skip: Optional[Set[Ident]] = None,
    ) -> Tuple[int, int]:
        """``(count, bytes)`` owed to the PFS that keep this node drained: jobs running
        here excluded, and so are checkpoints held because of their owner's doing or
        given up after ``max_retries`` (still owed, still reported, no longer a reason
        to keep the node out of service). With ``owed`` (:meth:`owed` before a flush)
        and that flush's ``outcome`` it is derived without another pass over the
        ledger (a hook near the end of its budget). ``skip``: checkpoints left to
        others (partner copies whose owner's node is alive)."""
        if owed is None or outcome is None:
            recs = [
                r for r in self.owed(running) if not held(r.extra) and r.ident not in (skip or ())
            ]
            return len(recs), sum(r.nbytes for r in recs)
        done = (FlushStatus.FLUSHED, FlushStatus.ALREADY, FlushStatus.GONE)
        gone = {r.ident for r in outcome.results if r.status in done}
        held_now = {r.ident for r in outcome.results if r.hold}
        recs = [
            r for r in owed if r.ident not in gone and r.ident not in held_now and not held(r.extra)
        ]
        return len(recs), sum(r.nbytes for r in recs)

    def defer_partner_copies(
        self, records: List[Record], deadline: Optional[float] = None
    ) -> Tuple[List[Record], List[Record]]:
        """``(to flush here, left to their owners)``: partner copies whose owner's node is
        alive are that node's to flush, as the epilog decides
        (:func:`~slurm_ckpt.node.partner_flush.defer_live_owners`); of those, the ones
        the owner has flushed already (the warm tier holds the identical checkpoint) are
        recorded verified here and are neither flushed nor left over."""
        keep, deferred, _check = defer_live_owners(
            records,
            self.scan_nodes,
            self.node,
            self.client,
            now=self.ledger.clock(),
            grace_s=self.cfg.partner.owner_grace,
            timeout=OWNER_QUERY_TIMEOUT_S,
        )
        if deferred:
            there = learn_present(self, deferred, deadline)
            deferred = [r for r in deferred if r.ident not in there]
        return keep, deferred

    # -- scrub ------------------------------------------------------------------------
    def scrub(self, deadline: Optional[float], max_age_s: float) -> List[Record]:
        """Read back the warm copies of what this node holds (those last checked more than
        ``max_age_s`` ago, until ``deadline``); a damaged one is uncommitted there and
        owed again (:mod:`slurm_ckpt.node.scrub`). Returns the records owed again."""
        return scrub(self, deadline, max_age_s)

    # -- retention --------------------------------------------------------------------
    def retention(self, running: Optional[Set[str]], deadline: Optional[float] = None) -> int:
        """Delete local checkpoints retention allows (never one whose PFS copy is not
        verified; :mod:`slurm_ckpt.node.local_retention`). Returns the count."""
        return run_retention(self, running, deadline)

    # -- status -----------------------------------------------------------------------
    def publish(self, extra: Optional[Dict[str, Any]] = None) -> None:
        """Node status on the PFS (or in the object store on a site without one); a
        failure here is logged, never fatal."""
        more = dict(extra or {})
        if self.refused:
            more["refused"] = self.refused[:50]
        try:
            status_store(self.cfg).publish(self.ledger, more)
        except CkptError as exc:
            log.warning("node status not published: %s", exc)


def _of_step(res: CopyResult, ident: Ident, where: str) -> CopyResult:
    """``res``, when it is about ``ident``'s step (a child's result is untrusted data)."""
    if res.step != ident[2]:
        raise AsUserError(f"{where}: garbled result from the child")
    return res
