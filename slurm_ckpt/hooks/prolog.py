"""``ckpt-slurm prolog``: make the node ready for a job's checkpoints, or refuse it.

Run by slurmd as root on every node of a job before it starts (``PrologFlags=Alloc``). A
job that starts on a node whose local tier is missing, full or broken would train for
hours and fail at its first checkpoint; failing here instead costs nothing: the prolog
exits non-zero with one reason line, and SLURM drains the node (the CLI drains it first
with a ``slurm_ckpt: prolog: <reason>`` reason so that admins see why) and requeues the
job, held.

Steps (all idempotent, so a retried prolog is harmless):

1. the local tier root exists and - unless ``tiers.local.require_mount = false`` - is
   not on the root filesystem (filling ``/`` takes the node down);
2. the ledger directory is root's alone (see :func:`~slurm_ckpt.node.guard.ensure_ledger_dir`);
3. ``<local root>/<user>/`` exists as a real directory owned by the job's uid/gid, mode
   0700. Something else at that name - a symlink, a file, a directory of another owner -
   is moved aside (renamed, never followed or deleted) and logged;
4. free space: ``tiers.local.min_free`` plus ``hooks.expected_checkpoint_size`` x
   (``retention.keep_local`` + 1) (keep_local old ones plus the one being written);
   when short, space of users who have left the node is reclaimed first (their junk,
   then their checkpoints safe on the PFS: :mod:`slurm_ckpt.node.reclaim`);
5. a write/fsync/read-back probe in the user's directory, as the user;
6. rescue: checkpoints earlier jobs left unflushed on this node are flushed (as their
   owners) within half the budget, the rest is left to the stager - never wiped;
7. on a requeue (``SLURM_JOB_RESTART_COUNT`` > 0) with ``hooks.stage_on_requeue``, the
   job's newest checkpoint on the warm tier (the PFS, or the object store on a site
   without one) is copied (as the user) to this node, so the restart reads locally.
   Staging is an optimisation: when it fails the job still starts (it reads the warm
   tier).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from slurm_ckpt.core import fsio
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import UserIds, validate_key
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError, InvalidName, SlurmError, TierError
from slurm_ckpt.node.asuser import alive, run_as
from slurm_ckpt.node.flush_engine import FlushOutcome
from slurm_ckpt.node.guard import (
    NodeCheckFailed,
    check_local_tier,
    required_free,
)
from slurm_ckpt.node.reclaim import reclaim_departed
from slurm_ckpt.node.warm import owner_tiers
from slurm_ckpt.node.work import NodeWork
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.env import HookEnv
from slurm_ckpt.tiers.copy import SourceCorrupt, copy_checkpoint
from slurm_ckpt.tiers.registry import warm_tier

log = logging.getLogger(__name__)

__all__ = [
    "PrologFailed",
    "PrologReport",
    "ensure_user_dir",
    "run_prolog",
]

PROBE_BYTES = 1 << 20
QUARANTINE_PREFIX = ".slurm_ckpt-quarantine-"
#: Share of the budget the prolog may spend rescuing backlog (the rest: staging).
RESCUE_SHARE = 0.5


#: A failed prolog check (the job must not start here).
PrologFailed = NodeCheckFailed


# --------------------------------------------------------------------------- checks


def ensure_user_dir(root: str, ids: UserIds) -> str:
    """``<root>/<user>/``: a real directory, owned by the user, mode 0700.

    Returns what was done (``"ok"``, ``"created"``, ``"fixed mode"``, ``"replaced ..."``).
    The root is trusted (the admin's); the entry below it may have been planted by anyone
    who could write the root, so it is examined with lstat and opened with O_NOFOLLOW, and
    a wrong one is renamed aside - root never follows it, writes into it or deletes it.
    """
    done: List[str] = []
    try:
        rfd = fsio.open_dir(root)
    except OSError as exc:
        raise PrologFailed(str(fsio.tier_error(exc, f"local tier root {root}"))) from None
    try:
        for _attempt in range(3):
            try:
                st = os.stat(ids.name, dir_fd=rfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None:
                bad = None
                if stat.S_ISLNK(st.st_mode):
                    bad = "a symbolic link"
                elif not stat.S_ISDIR(st.st_mode):
                    bad = "not a directory"
                elif st.st_uid not in (ids.uid, os.geteuid()):
                    # Root's own directory is another prolog's mkdir not yet chowned
                    # (two jobs of one user starting on the node at once): only root
                    # can create one, so it is taken over, never moved aside under it.
                    bad = f"owned by uid {st.st_uid}"
                if bad is not None:
                    aside = (
                        f"{QUARANTINE_PREFIX}{ids.name}-{int(time.time())}-{secrets.token_hex(3)}"
                    )
                    os.rename(ids.name, aside, src_dir_fd=rfd, dst_dir_fd=rfd)
                    log.warning("%s/%s was %s; moved it aside to %s", root, ids.name, bad, aside)
                    done.append(f"replaced {bad} (moved to {aside})")
                    continue
            else:
                try:
                    os.mkdir(ids.name, 0o700, dir_fd=rfd)
                    done.append("created")
                except FileExistsError:
                    continue  # someone raced us: look again
            try:
                fd = os.open(ids.name, fsio.O_DIR, dir_fd=rfd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    continue  # swapped or moved aside meanwhile: look again
                raise
            try:
                fst = os.fstat(fd)
                if fst.st_uid not in (ids.uid, os.geteuid()):
                    continue  # swapped for someone else's directory: look again
                if (fst.st_uid, fst.st_gid) != (ids.uid, ids.gid):
                    os.fchown(fd, ids.uid, ids.gid)
                if stat.S_IMODE(fst.st_mode) != 0o700:
                    os.fchmod(fd, 0o700)
                    if "created" not in done:
                        done.append("fixed mode")
                os.fsync(rfd)
                return "; ".join(done) or "ok"
            finally:
                os.close(fd)
        raise PrologFailed(f"{root}/{ids.name}: keeps changing under us; refusing")
    except OSError as exc:
        raise PrologFailed(str(fsio.tier_error(exc, f"{root}/{ids.name}"))) from None
    finally:
        os.close(rfd)


def _probe_as_user(root: str, user: str, size: int) -> float:
    """Write, fsync, drop from cache, read back and compare ``size`` bytes; seconds."""
    t0 = time.monotonic()
    data = os.urandom(size)
    name = f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    where = f"write probe in {root}/{user}"
    try:
        rfd = fsio.open_dir(root)
        try:
            dfd = fsio.open_beneath(rfd, [user])
        finally:
            os.close(rfd)
    except OSError as exc:
        raise fsio.tier_error(exc, where) from None
    try:
        try:
            fd = os.open(name, fsio.O_NEWFILE, 0o600, dir_fd=dfd)
        except OSError as exc:
            raise fsio.tier_error(exc, where) from None
        try:
            try:
                fsio.write_all(fd, data)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            fd = os.open(name, fsio.O_READ, dir_fd=dfd)
            try:
                got = bytearray()
                while len(got) < size + 1:
                    b = os.read(fd, 1 << 20)
                    if not b:
                        break
                    got += b
            finally:
                os.close(fd)
            if bytes(got) != data:
                raise TierError(f"{where}: read back different bytes than were written")
        except OSError as exc:
            raise fsio.tier_error(exc, where) from None
        finally:
            fsio.unlink_quiet(dfd, name)
    finally:
        os.close(dfd)
    return time.monotonic() - t0


# --------------------------------------------------------------------------- staging


def _stage_candidates(
    cfg: Config, user: str, job_id: str, job_name: Optional[str]
) -> List[List[Any]]:
    """Warm-tier checkpoints (PFS, or object store) of this job, newest first:
    ``[[key, step], ...]``.

    The key is whichever series holds checkpoints whose manifest names this job id (a
    requeued job keeps its id), else the series named like the job.
    """
    pfs = warm_tier(cfg, owner_tiers(cfg))  # the PFS, or the object store without one
    found = []
    for key in pfs.keys(user):
        try:
            validate_key(key)
        except InvalidName:
            continue
        steps = pfs.steps(user, key)
        mine = [s for s in steps if s.manifest.job == job_id]
        if not mine and key == job_name:
            mine = steps
        found.extend((s.manifest.wall_time, key, s.step) for s in mine)
    found.sort(reverse=True)
    return [[key, step] for _, key, step in found]


def _stage_as_user(cfg: Config, user: str, key: str, step: int, uid: int) -> dict:
    tiers = owner_tiers(cfg)
    warm = warm_tier(cfg, tiers)
    warm.guard_user(user, uid)
    tiers["local"].guard_user(user, uid)
    warm.guard_step(user, key, step, uid)
    res = copy_checkpoint(warm, tiers["local"], user, key, step, progress=lambda _n: alive())
    return {"nbytes": res.nbytes, "seconds": res.seconds, "already": res.already_present}


# --------------------------------------------------------------------------- prolog


@dataclass
class PrologReport:
    job_id: str
    node: str
    user_dir: str = "ok"
    free: int = 0
    probe_s: float = 0.0
    rescue: FlushOutcome = field(default_factory=FlushOutcome)
    staged: Optional[str] = None
    reclaimed: Optional[str] = None
    seconds: float = 0.0

    def line(self) -> str:
        parts = [
            f"user dir {self.user_dir}",
            f"{format_bytes(self.free)} free",
            f"probe {format_duration(self.probe_s)}",
        ]
        if self.rescue.flushed or self.rescue.handed or self.rescue.failed:
            parts.append(
                f"rescued {len(self.rescue.flushed)}, handed {len(self.rescue.handed)} to "
                f"the stager, {len(self.rescue.failed)} failed"
            )
        if self.reclaimed:
            parts.append(self.reclaimed)
        if self.staged:
            parts.append(f"staged {self.staged}")
        parts.append(f"in {format_duration(self.seconds)}")
        return f"prolog job {self.job_id} on {self.node}: ok; " + "; ".join(parts)


def run_prolog(
    cfg: Config,
    env: HookEnv,
    client: Optional[SlurmClient] = None,
    budget: Optional[float] = None,
) -> PrologReport:
    """The prolog (see the module docstring). Raises :class:`PrologFailed`."""
    clock = time.monotonic
    t0 = clock()
    total = cfg.hooks.budget if budget is None else float(budget)
    report = PrologReport(env.job_id, env.node)
    root = str(cfg.tiers.local.root)
    ids = UserIds(env.user, env.uid, env.gid)

    check_local_tier(cfg, check_space=False)
    try:
        work = NodeWork(cfg, env.node, client, clock)
    except CkptError as exc:
        raise PrologFailed(f"ledger: {exc}") from None
    report.user_dir = ensure_user_dir(root, ids)
    try:
        report.free = check_local_tier(cfg, check_space=True)
    except NodeCheckFailed:
        if not cfg.hooks.reclaim_departed:
            raise
        # Too full: free what users who left this node no longer need, then look again.
        try:
            work.reconcile(t0 + total * 0.2)
            got = reclaim_departed(work, env.user, required_free(cfg), t0 + total * 0.4)
        except CkptError as exc:
            log.warning("prolog: reclaim failed: %s", exc)
            got = None
        if got is None:
            raise
        report.reclaimed = got.line()
        report.free = check_local_tier(cfg, check_space=True)
    try:
        report.probe_s = run_as(
            ids.uid,
            ids.gid,
            _probe_as_user,
            root,
            ids.name,
            PROBE_BYTES,
            user=ids.name,
            timeout=max(1.0, min(30.0, total / 4)),
            what="write probe",
        )
    except CkptError as exc:
        raise PrologFailed(str(exc)) from None

    # Rescue what earlier jobs left here; never fail the job for it.
    try:
        work.reconcile(t0 + total * RESCUE_SHARE)
        running = work.running_jobs(exclude=env.job_id)
        todo = work.candidates(running, first_job=env.job_id)
        report.rescue = work.flush(todo, t0 + total * RESCUE_SHARE)
    except CkptError as exc:
        log.warning("prolog: rescue of earlier checkpoints skipped: %s", exc)

    if env.is_requeue and cfg.hooks.stage_on_requeue:
        deadline = t0 + total * (1 - min(0.2, 15.0 / max(total, 1.0)))
        report.staged = _stage(cfg, env, ids, client, work, deadline, clock)
    report.seconds = clock() - t0
    work.publish({"hook": "prolog", "job": env.job_id})
    return report


def _stage(
    cfg: Config,
    env: HookEnv,
    ids: UserIds,
    client: Optional[SlurmClient],
    work: NodeWork,
    deadline: float,
    clock: Any,
) -> Optional[str]:
    job_name = None
    if client is not None:
        try:
            job_name = client.job(env.job_id).name
        except SlurmError:
            job_name = None
    try:
        cands = run_as(
            ids.uid,
            ids.gid,
            _stage_candidates,
            cfg,
            ids.name,
            env.job_id,
            job_name,
            stall_timeout=cfg.hooks.child_timeout,
            user=ids.name,
            timeout=max(0.5, deadline - clock()),
            what="find checkpoint to stage",
        )
    except CkptError as exc:
        log.warning("prolog: staging skipped: %s", exc)
        return None
    for key, step in cands[:3]:
        left = deadline - clock()
        if left < 0.5:
            log.warning("prolog: no time left to stage %s/%s step %d", ids.name, key, step)
            return None
        try:
            res = run_as(
                ids.uid,
                ids.gid,
                _stage_as_user,
                cfg,
                ids.name,
                key,
                step,
                ids.uid,
                stall_timeout=cfg.hooks.child_timeout,
                user=ids.name,
                timeout=left,
                what="stage",
            )
        except SourceCorrupt as exc:
            log.warning("prolog: warm copy does not verify, trying an older one: %s", exc)
            continue
        except CkptError as exc:
            log.warning("prolog: staging %s/%s step %d failed: %s", ids.name, key, step, exc)
            return None
        ident = (ids.name, key, int(step))
        nbytes = int(res.get("nbytes", 0))
        work.ledger.reconcile([(*ident, nbytes)], [(*ident, nbytes)], prune=False)
        return f"{key} step {step}" + (" (already here)" if res.get("already") else "")
    return None
