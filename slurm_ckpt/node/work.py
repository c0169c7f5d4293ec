"""The node work that prolog, epilog, stager and root ``ckpt-slurm flush`` share.

Runs as root over every user's local checkpoints: scan the local tier and reconcile the
node's ledger with it (the tiers are the truth, the ledger a cache), pick what is owed to
the warm tier, flush it with the one flush engine (:mod:`slurm_ckpt.node.flush`) *as the
checkpoint's owner*, apply local retention, and publish the node's status. Every touch of
user data happens in a child process running as that user
(:mod:`slurm_ckpt.node.asuser`), behind the guards of :mod:`slurm_ckpt.node.guard`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.admission import Priority
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.core.retention import RetentionPolicy, plan_local_deletions
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError, InvalidName, NotFound, SlurmError
from slurm_ckpt.ledger import Ident, Ledger, Record, State
from slurm_ckpt.ledger.events import EventLog
from slurm_ckpt.ledger.status_store import status_store
from slurm_ckpt.node.asuser import run_as
from slurm_ckpt.node.flush import (
    HANDED_TO_STAGER,
    MIN_SLICE_S,
    Flusher,
    FlushOutcome,
    FlushResult,
)
from slurm_ckpt.node.guard import check_step_files, check_user_dir, ensure_ledger_dir
from slurm_ckpt.node.slots import SlotGate
from slurm_ckpt.node.warm import (
    committed_manifest,
    guard_user_dir,
    lend_credentials,
    owner_tiers,
    warm_of,
)
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

log = logging.getLogger("slurm_ckpt.hooks")

__all__ = [
    "HANDED_TO_STAGER",
    "RESERVE_FRACTION",
    "RESERVE_MAX_S",
    "SCAN_TIMEOUT_S",
    "NodeWork",
    "UserIds",
    "drain_reason",
    "user_ids",
]

#: Part of a hook's budget kept back for hand-off, drain, retention and the status file.
RESERVE_FRACTION = 0.2
RESERVE_MAX_S = 15.0
#: A scan (listing and reading manifests) of one user's local directory.
SCAN_TIMEOUT_S = 60.0
_NO_GATE = object()


# --------------------------------------------------------------------------- users


@dataclass(frozen=True)
class UserIds:
    """A local user: name, uid, primary gid."""

    name: str
    uid: int
    gid: int


def user_ids(name: str) -> UserIds:
    """Look up a (validated) user name in the passwd database."""
    validate_user(name)
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise InvalidName(f"user {name!r} is not known on this node") from None
    return UserIds(pw.pw_name, pw.pw_uid, pw.pw_gid)


# --------------------------------------------------------------------------- as the user
# These run in a child process as the owning user (run_as).


def _scan_local(root: str, user: str) -> List[List[Any]]:
    """``[[key, step, nbytes, job], ...]`` of the committed checkpoints of ``user``."""
    tier = PosixTier("local", root)
    out: List[List[Any]] = []
    for key in tier.keys(user):
        try:
            validate_key(key)
        except InvalidName:
            continue
        for info in tier.steps(user, key):
            out.append([key, info.step, info.nbytes, info.manifest.job])
    return out


def _flush_as_user(cfg: Config, user: str, key: str, step: int, uid: int) -> Dict[str, Any]:
    tiers = owner_tiers(cfg)
    warm = warm_of(cfg, tiers)  # the PFS, or the object store on a site without one
    check_user_dir(tiers["local"], user, uid)
    guard_user_dir(warm, user, uid)
    check_step_files(tiers["local"], user, key, step, uid)
    res = copy_checkpoint(tiers["local"], warm, user, key, step, replace_older=True)
    return {
        "nbytes": res.nbytes,
        "copied": res.copied_bytes,
        "seconds": res.seconds,
        "already": res.already_present,
    }


def _delete_as_user(cfg: Config, user: str, key: str, step: int, uid: int, need_pfs: bool) -> bool:
    """Delete a local checkpoint; with ``need_pfs`` only if the PFS holds the very same
    committed checkpoint (identical manifest bytes) - the ledger is a cache, this is the
    last word before bytes disappear."""
    tiers = owner_tiers(cfg)
    local, warm = tiers["local"], warm_of(cfg, tiers)
    check_step_files(local, user, key, step, uid)
    if need_pfs:
        mine = committed_manifest(local, user, key, step)
        theirs = committed_manifest(warm, user, key, step)
        if mine is None or mine != theirs:
            raise CkptError(
                f"{local.where(user, key, step)}: no identical committed copy on the "
                f"{warm.name} tier; kept"
            )
    local.delete(user, key, step)
    return True


# --------------------------------------------------------------------------- root side


def drain_reason(count: int, nbytes: int, failed: int = 0, error: Optional[str] = None) -> str:
    """``slurm_ckpt: flushing 3 checkpoints (1.2 GiB)`` (+ the last error if any failed)."""
    noun = "checkpoint" if count == 1 else "checkpoints"
    text = f"slurm_ckpt: flushing {count} {noun} ({format_bytes(nbytes)})"
    if failed and error:
        text += f"; {failed} failing: {error}"
    return text


class NodeWork:
    """The node-side work shared by prolog, epilog and stager (see module docstring).

    Runs as root; every touch of user data goes through :func:`run_as`. Not thread-safe
    and meant for a single-threaded process (it forks).
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
        self.skipped_dirs: List[str] = []
        self._gate: Any = _NO_GATE  # the PFS slot gate, made at the first flush
        ensure_ledger_dir(cfg.ledger.dir)
        self.ledger = Ledger(cfg.ledger.dir, node)
        lend_credentials(cfg)  # object tier: root's credentials for the owner children

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
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != ids.uid:
                what = "not a directory" if not stat.S_ISDIR(st.st_mode) else "wrong owner"
                log.warning(
                    "local tier: skipping %s/%s: %s (uid %d, %s is %d)",
                    self.local_root,
                    name,
                    what,
                    st.st_uid,
                    name,
                    ids.uid,
                )
                self.skipped_dirs.append(name)
                continue
            out.append(ids)
        return out

    def reconcile(self, deadline: Optional[float] = None) -> Dict[str, int]:
        """Scan every user's local checkpoints (as that user) and bring the ledger in line.

        Records are pruned (local copy gone -> ``DELETED``) only when every scan
        succeeded (a user directory skipped as unsafe counts as empty: nothing in it may
        be touched until it is fixed, and the next scan brings its records back); PFS
        states the ledger already has are kept as they are.
        """
        local: List[Tuple[str, str, int, int]] = []
        complete = True
        self.users = {}
        self.scan_jobs = {}
        for ids in self.local_users():
            timeout = SCAN_TIMEOUT_S
            if deadline is not None:
                timeout = max(0.1, min(timeout, deadline - self.clock()))
            try:
                rows = run_as(
                    ids.uid,
                    ids.gid,
                    _scan_local,
                    self.local_root,
                    ids.name,
                    user=ids.name,
                    timeout=timeout,
                    what="scan",
                )
            except CkptError as exc:
                log.warning("scan of %s/%s failed: %s", self.local_root, ids.name, exc)
                complete = False
                continue
            self.users[ids.name] = ids
            for key, step, nbytes, job in rows:
                try:
                    validate_key(key)
                except InvalidName:
                    continue
                if not isinstance(step, int) or not isinstance(nbytes, int):
                    continue
                local.append((ids.name, key, step, nbytes))
                self.scan_jobs[(ids.name, key, step)] = None if job is None else str(job)
        verified = [
            (r.user, r.key, r.step, r.nbytes)
            for r in self.ledger.records()
            if r.state("pfs") is State.VERIFIED
        ]
        return self.ledger.reconcile(local, verified, prune=complete, jobs=self.scan_jobs)

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

    def candidates(
        self, running: Optional[Set[str]], first_job: Optional[str] = None
    ) -> List[Record]:
        """Checkpoints owed to the PFS that this process should flush: all of them but
        those of jobs still running here (their own job flushes them). ``first_job``'s
        come first, then the oldest."""
        out = []
        for rec in self.ledger.pending_flush():
            if rec.user not in self.users:
                continue
            job = self.job_of(rec)
            if running and job is not None and job in running:
                continue
            out.append(rec)
        if first_job is not None:
            out.sort(key=lambda r: self.job_of(r) != first_job)
        return out

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
        )

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

    def _copy_as_owner(self, ident: Ident, left: Optional[float]) -> Dict[str, Any]:
        ids = self.users[ident[0]]
        return run_as(
            ids.uid,
            ids.gid,
            _flush_as_user,
            self.cfg,
            *ident,
            ids.uid,
            user=ids.name,
            timeout=left,
            what="flush",
        )

    def flush(
        self,
        records: List[Record],
        deadline: Optional[float] = None,
        on_result: Optional[Callable[[FlushResult], None]] = None,
    ) -> FlushOutcome:
        """Copy each record's checkpoint to the PFS as its owner (users whose directory
        the scan refused are skipped); what ``deadline`` (a :attr:`clock` value) leaves no
        time for is handed to the stager."""
        items = [(r.ident, r.nbytes) for r in records if r.user in self.users]
        return self.flusher().flush_all(items, deadline, on_result)

    def hand_off(self, idents: List[Ident]) -> None:
        """Leave these to the stager: ``FLUSH_PENDING`` with reason "handed to stager"."""
        self.flusher().hand_off(idents)

    def backlog(self, running: Optional[Set[str]]) -> Tuple[int, int]:
        """``(count, bytes)`` still owed to the PFS, jobs running here excluded."""
        recs = self.candidates(running)
        return len(recs), sum(r.nbytes for r in recs)

    # -- retention --------------------------------------------------------------------
    def retention(self, running: Optional[Set[str]], deadline: Optional[float] = None) -> int:
        """Delete local checkpoints retention allows (never one whose PFS copy is not
        verified); series of jobs still running here are left to those jobs."""
        r = self.cfg.retention
        policy = RetentionPolicy(
            keep_local=r.keep_local,
            flush_every=r.flush_every,
            keep_pfs=r.keep_pfs,
            keep_pfs_every_s=r.keep_pfs_every,
        )
        series: Dict[Tuple[str, str], List[Record]] = {}
        for rec in self.ledger.records():
            if rec.user in self.users and rec.state("local") in (State.COMMITTED, State.VERIFIED):
                series.setdefault((rec.user, rec.key), []).append(rec)
        deleted = 0
        for (user, key), recs in sorted(series.items()):
            if running and any(self.job_of(rec) in running for rec in recs):
                continue
            by_step = {rec.step: rec for rec in recs}
            for step in plan_local_deletions([rec.to_local_info() for rec in recs], policy):
                left = None if deadline is None else deadline - self.clock()
                if left is not None and left < MIN_SLICE_S:
                    return deleted
                rec = by_step[step]
                ids = self.users[user]
                try:
                    run_as(
                        ids.uid,
                        ids.gid,
                        _delete_as_user,
                        self.cfg,
                        user,
                        key,
                        step,
                        ids.uid,
                        rec.needs_flush,
                        user=ids.name,
                        timeout=left,
                        what="delete",
                    )
                except NotFound:
                    pass  # gone already (the job's own retention): record it
                except CkptError as exc:
                    log.warning("retention: kept %s/%s step %d: %s", user, key, step, exc)
                    continue
                self.ledger.mark(user, key, step, "local", State.DELETED, reason="retention")
                deleted += 1
        return deleted

    # -- status -----------------------------------------------------------------------
    def publish(self, extra: Optional[Dict[str, Any]] = None) -> None:
        """Node status on the PFS (or in the object store on a site without one); a
        failure here is logged, never fatal."""
        try:
            status_store(self.cfg).publish(self.ledger, extra)
        except CkptError as exc:
            log.warning("node status not published: %s", exc)
