"""``ckpt-slurm epilog``: after a job, get its checkpoints off the node before anyone else
gets the node.

A node-local checkpoint that has not reached the PFS is lost with the node (reimage,
failure, the next job filling the disk). So the epilog, run by slurmd as root on every node
of an ending job:

1. scans the local tier (as each owning user) and reconciles the node's ledger with it -
   the tiers are the truth, the ledger a cache;
2. flushes every checkpoint not yet verified on the PFS - the job's first, then this
   node's backlog - *as the owning user*, within ``hooks.budget`` (which must stay below
   SLURM's PrologEpilogTimeout, or SLURM itself drains the node);
3. hands whatever cannot finish in time to the stager daemon (ledger ``FLUSH_PENDING``,
   reason ``"handed to stager"``) and drains the node with a ``slurm_ckpt:`` reason, so
   SLURM gives it to no one until the stager is done and resumes it;
4. applies local retention (never deleting a checkpoint whose PFS copy is not verified);
5. publishes the node's status file on the PFS.

This module also holds the machinery the prolog and the stager share (:class:`NodeWork`):
the scan, the flush loop, retention, and the checks that keep root-run code safe -
user directories must be real directories owned by the user they are named after, every
file copied or deleted must be a regular file with one link owned by that user, and all
of it happens in a child process running as that user (:mod:`slurm_ckpt.node.asuser`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pwd
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import slurm_ckpt.core.faults  # noqa: F401 - preloaded, see _PRELOADED
from slurm_ckpt.core import fsio
from slurm_ckpt.core.admission import Priority
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.manifest import MANIFEST_NAME
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.core.retention import RetentionPolicy, plan_local_deletions
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError, InvalidName, NotFound, SlurmError, TierError
from slurm_ckpt.ledger import Ledger, Record, State, publish_status
from slurm_ckpt.ledger.events import EventLog
from slurm_ckpt.node.asuser import AsUserTimeout, run_as
from slurm_ckpt.node.slots import SlotGate
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.env import HookEnv
from slurm_ckpt.tiers.copy import SourceCorrupt, copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.registry import tiers_from_config

log = logging.getLogger("slurm_ckpt.hooks")

# Children running as the job user may be unable to read this interpreter's files (a
# Python below /root, a root-only checkout): import here, before any fork, what the code
# they run would otherwise import lazily.
_PRELOADED = (mmap, slurm_ckpt.core.faults)

__all__ = [
    "HANDED_TO_STAGER",
    "EpilogReport",
    "FlushOutcome",
    "NodeWork",
    "UnsafeCheckpoint",
    "UserIds",
    "check_step_files",
    "check_user_dir",
    "drain_reason",
    "ensure_ledger_dir",
    "run_epilog",
]

HANDED_TO_STAGER = "handed to stager"
#: Part of the budget kept back for hand-off, drain, retention and the status file.
RESERVE_FRACTION = 0.2
RESERVE_MAX_S = 15.0
#: Do not start a copy with less time than this left; hand it off instead.
MIN_SLICE_S = 0.5
#: A scan (listing and reading manifests) of one user's local directory.
SCAN_TIMEOUT_S = 60.0

Ident = Tuple[str, str, int]
_NO_GATE = object()


class _NotAdmitted(Exception):
    """No PFS slot within the flush's budget: the checkpoint is handed off."""


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
# Everything below until "root side" runs in a child process as the owning user.


class UnsafeCheckpoint(TierError):
    """A checkpoint holds something root-run code must not touch (a symlink, a special
    file, a hard link, a file of another owner). It is the owner's own doing, so it is
    marked ``BAD`` on its tier and left alone - it must not keep a node drained."""


def check_step_files(tier: PosixTier, user: str, key: str, step: int, uid: int) -> None:
    """Refuse a checkpoint that root-run code must not touch: anything but regular files,
    a file with more than one hard link (it may be someone else's file linked in), or a
    file not owned by ``uid``. Directories are walked with O_NOFOLLOW."""
    where = tier.where(user, key, step)
    with tier.step_fd(user, key, step) as sfd:
        try:
            files, problems = fsio.walk_files(sfd)
        except OSError as exc:
            raise fsio.tier_error(exc, where) from None
    if problems:
        raise UnsafeCheckpoint(f"{where}: {problems[0]}; refusing to touch it")
    for rel, st in files:
        if st.st_nlink != 1:
            raise UnsafeCheckpoint(
                f"{where}/{rel}: has {st.st_nlink} hard links; refusing to touch it"
            )
        if st.st_uid != uid:
            raise UnsafeCheckpoint(
                f"{where}/{rel}: owned by uid {st.st_uid}, not by {user} ({uid}); "
                "refusing to touch it"
            )


def check_user_dir(tier: PosixTier, user: str, uid: int) -> None:
    """``<tier root>/<user>`` must be the user's own: a real directory owned by ``uid`` that
    no one else can write. On a shared root that every user may write (mode 1777, as a
    PFS checkpoint root often is) another user could have created it first; writing a
    checkpoint into their directory would let them replace it (and a restore would load
    their bytes). A missing directory is fine: it is created by the user, mode 0700."""
    try:
        st = os.lstat(os.path.join(tier.root, user))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise fsio.tier_error(exc, f"{tier.name}:{tier.root}/{user}") from None
    where = f"{tier.name}:{tier.root}/{user}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise TierError(f"{where}: not a directory (symlink?); refusing to use it")
    if st.st_uid != uid:
        raise TierError(f"{where}: owned by uid {st.st_uid}, not by {user}; refusing to use it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(st.st_mode)
        raise TierError(f"{where}: writable by others (mode {mode:o}); refusing to use it")


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
    tiers = tiers_from_config(cfg)
    check_user_dir(tiers["local"], user, uid)
    check_user_dir(tiers["pfs"], user, uid)
    check_step_files(tiers["local"], user, key, step, uid)
    res = copy_checkpoint(tiers["local"], tiers["pfs"], user, key, step)
    return {
        "nbytes": res.nbytes,
        "copied": res.copied_bytes,
        "seconds": res.seconds,
        "already": res.already_present,
    }


def _manifest_bytes(tier: PosixTier, user: str, key: str, step: int) -> Optional[bytes]:
    try:
        with tier.step_fd(user, key, step) as sfd:
            return fsio.read_small(sfd, MANIFEST_NAME)
    except (NotFound, TierError, OSError):
        return None


def _delete_as_user(cfg: Config, user: str, key: str, step: int, uid: int, need_pfs: bool) -> bool:
    """Delete a local checkpoint; with ``need_pfs`` only if the PFS holds the very same
    committed checkpoint (identical manifest bytes) - the ledger is a cache, this is the
    last word before bytes disappear."""
    tiers = tiers_from_config(cfg)
    local, pfs = tiers["local"], tiers["pfs"]
    check_step_files(local, user, key, step, uid)
    if need_pfs:
        mine = _manifest_bytes(local, user, key, step)
        theirs = _manifest_bytes(pfs, user, key, step)
        if mine is None or mine != theirs:
            raise CkptError(
                f"{local.where(user, key, step)}: no identical committed copy on the PFS; kept"
            )
    local.delete(user, key, step)
    return True


# --------------------------------------------------------------------------- root side


def ensure_ledger_dir(path: Path) -> None:
    """Make sure the ledger directory is root's alone.

    Root opens the ledger and its lock file by path; in a directory a user can write,
    a planted symlink would turn that into a write anywhere. So the directory must be a
    real directory owned by root and writable by no one else. Anything else sitting at
    that name (a user's directory, a symlink, a file) is moved aside, never followed or
    deleted, and a fresh directory is made.
    """
    parent = path.parent
    try:
        pfd = fsio.open_dir(str(parent))
    except OSError as exc:
        raise fsio.tier_error(exc, f"ledger parent directory {parent}") from None
    try:
        try:
            st = os.stat(path.name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            ok = (
                stat.S_ISDIR(st.st_mode)
                and st.st_uid == os.geteuid()
                and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            )
            if ok:
                return
            aside = f".{path.name.lstrip('.')}.untrusted-{int(time.time())}-{os.getpid()}"
            os.rename(path.name, aside, src_dir_fd=pfd, dst_dir_fd=pfd)
            log.warning("ledger directory %s was not root's own; moved it to %s", path, aside)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path.name, 0o755, dir_fd=pfd)
        fd = os.open(path.name, fsio.O_DIR, dir_fd=pfd)
        try:
            st2 = os.fstat(fd)
            if st2.st_uid != os.geteuid():
                raise TierError(f"ledger directory {path}: taken over while being created")
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
    except OSError as exc:
        raise fsio.tier_error(exc, f"ledger directory {path}") from None
    finally:
        os.close(pfd)


def drain_reason(count: int, nbytes: int, failed: int = 0, error: Optional[str] = None) -> str:
    """``slurm_ckpt: flushing 3 checkpoints (1.2 GiB)`` (+ the last error if any failed)."""
    noun = "checkpoint" if count == 1 else "checkpoints"
    text = f"slurm_ckpt: flushing {count} {noun} ({format_bytes(nbytes)})"
    if failed and error:
        text += f"; {failed} failing: {error}"
    return text


@dataclass
class FlushOutcome:
    """What one flush round did."""

    flushed: List[Ident] = field(default_factory=list)
    flushed_bytes: int = 0
    handed: List[Ident] = field(default_factory=list)
    failed: List[Tuple[Ident, str]] = field(default_factory=list)
    dropped: List[Ident] = field(default_factory=list)
    seconds: float = 0.0


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
    def flush(self, records: List[Record], deadline: Optional[float] = None) -> FlushOutcome:
        """Copy each record's checkpoint to the PFS as its owner; hand the rest off when
        ``deadline`` (a :attr:`clock` value) comes."""
        out = FlushOutcome()
        t0 = self.clock()
        for rec in records:
            ident = rec.ident
            ids = self.users.get(rec.user)
            if ids is None:
                continue
            left = None if deadline is None else deadline - self.clock()
            if left is not None and left < MIN_SLICE_S:
                out.handed.append(ident)
                continue
            self.ledger.mark(*ident, "pfs", State.FLUSHING)
            try:
                # Admission control (fleet): a cluster-wide PFS slot around the copy,
                # waited for no longer than the deadline leaves; none -> hand off.
                with self._pfs_slot(left) as admitted:
                    if not admitted:
                        raise _NotAdmitted()
                    left = None if deadline is None else deadline - self.clock()
                    res = run_as(
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
            except (AsUserTimeout, _NotAdmitted):
                out.handed.append(ident)
                continue
            except NotFound as exc:
                self.ledger.mark(*ident, "local", State.DELETED, reason=str(exc))
                out.dropped.append(ident)
                continue
            except (SourceCorrupt, UnsafeCheckpoint) as exc:
                # Can never be flushed as it is: BAD, so that it does not block the node.
                code = "unsafe" if isinstance(exc, UnsafeCheckpoint) else "source_bad"
                self.ledger.mark(*ident, "local", State.BAD, reason=str(exc), code=code)
                out.failed.append((ident, str(exc)))
                continue
            except CkptError as exc:
                self.ledger.mark(*ident, "pfs", State.FAILED, reason=str(exc), code="flush")
                out.failed.append((ident, str(exc)))
                continue
            self.ledger.mark(
                *ident,
                "pfs",
                State.VERIFIED,
                error=None,
                durations={"flush_s": float(res.get("seconds", 0.0))},
            )
            out.flushed.append(ident)
            out.flushed_bytes += int(res.get("copied", 0))
        self.hand_off(out.handed)
        out.seconds = self.clock() - t0
        return out

    @contextlib.contextmanager
    def _pfs_slot(self, left: Optional[float]) -> Iterator[bool]:
        """Hold a PFS slot (``[admission]``) for the block: yields False when none came
        within ``left`` less :data:`MIN_SLICE_S`; True at once without a cap."""
        if self._gate is _NO_GATE:
            prio = Priority.ROUTINE
            if self.client is not None:
                with contextlib.suppress(SlurmError):
                    if self.client.node(self.node).held_for_maint:
                        prio = Priority.MAINTENANCE  # an admin waits on this node
            # Decisions go to the node's event log: the admission metrics and panels.
            emit = EventLog.from_config(self.cfg, self.node).emit
            self._gate = SlotGate.from_config(self.cfg, self.node, priority=prio, emit=emit)
        if self._gate is None:
            yield True
            return
        budget = None if left is None else max(0.0, left - MIN_SLICE_S)
        with self._gate.slot(budget) as admitted:
            yield admitted

    def hand_off(self, idents: List[Ident]) -> None:
        """Leave these to the stager: ``FLUSH_PENDING`` with reason "handed to stager"."""
        for ident in idents:
            with contextlib.suppress(NotFound):
                self.ledger.mark(*ident, "pfs", State.FLUSH_PENDING, reason=HANDED_TO_STAGER)

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
        """Node status on the PFS; a failure here is logged, never fatal."""
        try:
            publish_status(self.ledger, self.cfg.tiers.pfs.root, extra)
        except CkptError as exc:
            log.warning("node status not published: %s", exc)


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

    def line(self) -> str:
        f = self.flush
        parts = [
            f"epilog job {self.job_id} on {self.node}:",
            f"flushed {len(f.flushed)} ({format_bytes(f.flushed_bytes)})",
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
    deadline = t0 + total - reserve
    work = NodeWork(cfg, env.node, client, clock)
    work.reconcile(deadline)
    running = work.running_jobs(exclude=env.job_id)
    todo = work.candidates(running, first_job=env.job_id)
    outcome = work.flush(todo, deadline)
    report = EpilogReport(env.job_id, env.node, outcome)
    count, nbytes = work.backlog(running)
    report.backlog = (count, nbytes)
    if count and client is not None:
        err = outcome.failed[-1][1] if outcome.failed else None
        reason = drain_reason(count, nbytes, len(outcome.failed), err)
        try:
            report.drained = client.drain(env.node, reason)
        except SlurmError as exc:
            log.error("could not drain %s (%s); the stager will still flush", env.node, exc)
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
