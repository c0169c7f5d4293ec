"""What root's children do *as the checkpoint's owner* (:func:`~slurm_ckpt.node.asuser.run_as`).

Every function here runs in a child process that has become the user whose data it
touches, so the kernel applies that user's permissions and a planted link can reach
nothing the user could not. Each calls :func:`~slurm_ckpt.node.asuser.alive` as it makes
progress: the parent kills a child that stops showing signs of life (its user may have
stopped it) and goes on with other users. Results go back as JSON: typed ones
(:class:`~slurm_ckpt.tiers.copy.CopyResult`, :class:`~slurm_ckpt.node.asuser.ChildResult`)
encode themselves, and root decodes and checks them (:mod:`slurm_ckpt.node.work`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from typing import Any, Dict, List

from slurm_ckpt.core import fsio
from slurm_ckpt.core.config import LEDGER_SUBDIR, Config
from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.core.layout import LOCK_PREFIX, parse_step_dirname
from slurm_ckpt.core.manifest import MANIFEST_NAME, manifest_facts
from slurm_ckpt.core.names import validate_key
from slurm_ckpt.errors import CkptError, InvalidName, NotFound, StepConflict, TierError
from slurm_ckpt.node.asuser import ChildResult, alive
from slurm_ckpt.node.guard import OwnPermissionDenied, UnsafeCheckpoint
from slurm_ckpt.node.warm import owner_tiers
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.copy import CopyResult, copy_checkpoint
from slurm_ckpt.tiers.registry import directory_tier, tiers_from_config, warm_tier

__all__ = [
    "delete_as_user",
    "delete_many_as_user",
    "flush_as_user",
    "flush_many_as_user",
    "reclaim_as_user",
    "scan_local",
    "scrub_as_user",
]


def scan_local(root: str, user: str, budget_s: float) -> Dict[str, Any]:
    """``{"rows": [[key, step, nbytes, job, node, suspect], ...], "partial": bool}``: the
    committed checkpoints of ``user``, as many as ``budget_s`` allows (``partial`` then:
    what was not read is not known to be gone); ``suspect``: the manifest records that
    the step's replicas did not agree (the node's metric counts it). Manifests are read
    with the fast fact reader (checksum checked; the flush validates each one fully
    before any byte moves)."""
    end = time.monotonic() + budget_s
    tier = directory_tier("local", root)
    dirs = tier.directory()
    out: List[List[Any]] = []
    if dirs is None:
        return {"rows": out, "partial": False}
    for key in tier.keys(user):
        try:
            validate_key(key)
        except InvalidName:
            continue
        try:
            ctx = dirs.key_fd(user, key)
            kfd = ctx.__enter__()
        except (NotFound, TierError):
            continue
        try:
            for name in os.listdir(kfd):
                alive()
                if time.monotonic() >= end:
                    return {"rows": out, "partial": True}
                step = parse_step_dirname(name)
                if step is None:
                    continue
                try:
                    sfd = os.open(name, fsio.O_DIR, dir_fd=kfd)
                except OSError:
                    continue
                try:
                    facts = manifest_facts(fsio.read_small(sfd, MANIFEST_NAME))
                except (OSError, CkptError):
                    continue
                finally:
                    os.close(sfd)
                if (facts.user, facts.key, facts.step) == (user, key, step):
                    suspect = facts.suspect is not None
                    out.append([key, step, facts.nbytes, facts.job, facts.node, suspect])
        finally:
            ctx.__exit__(None, None, None)
    return {"rows": out, "partial": False}


#: Part of ``[hooks] child_timeout`` a child waits for a step's lock (the owner's
#: processes may hold it): it gives up (:class:`~slurm_ckpt.errors.StepLocked`, held)
#: well before root would kill it for showing no progress.
LOCK_WAIT_SHARE = 0.5
#: What :func:`~slurm_ckpt.tiers.copy.copy_checkpoint` says when the destination has a
#: different committed checkpoint of the step (a :class:`StepConflict`, the owner's).
_CONFLICT = "a different checkpoint with this step is already committed"


def _bounded_locks(cfg: Config, tiers: Dict[str, Any]) -> Dict[str, Any]:
    """The owner's tiers with a bounded wait for step locks (:data:`LOCK_WAIT_SHARE`)."""
    for tier in tiers.values():
        tier.lock_wait = cfg.hooks.child_timeout * LOCK_WAIT_SHARE
    return tiers


def flush_as_user(cfg: Config, user: str, key: str, step: int, uid: int) -> CopyResult:
    """Copy one checkpoint of ``user`` from the local tier to the warm tier, as ``user``;
    a failure that is the owner's doing comes back as an error class that says so
    (``user_caused``: the checkpoint is held, the node not drained)."""
    try:
        return _flush_as_user(cfg, user, key, step, uid)
    except StepConflict:
        raise
    except CkptError as exc:
        if type(exc) is CkptError and str(exc).endswith(_CONFLICT):
            raise StepConflict(str(exc)) from None
        raise


def _flush_as_user(cfg: Config, user: str, key: str, step: int, uid: int) -> CopyResult:
    tiers = _bounded_locks(cfg, owner_tiers(cfg))  # object: root's lent keys (node.warm)
    warm = warm_tier(cfg, tiers)  # the PFS, or the object store on a site without one
    alive()
    tiers["local"].guard_user(user, uid)
    warm.guard_user(user, uid)  # POSIX: the user's own dir; object: we are the user
    tiers["local"].guard_step(user, key, step, uid)
    alive()
    try:
        return copy_checkpoint(
            tiers["local"],
            warm,
            user,
            key,
            step,
            replace_older=True,
            progress=lambda _n: alive(),
        )
    except fsio.RefusedPath as exc:
        # A symlink at its PFS step directory (or anything else refused): the owner's doing.
        raise UnsafeCheckpoint(str(exc)) from None
    except fsio.PermissionDenied as exc:
        if _all_own(tiers["local"], warm, user, uid):
            raise OwnPermissionDenied(str(exc)) from None
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EINVAL, errno.EMFILE):
            # A symlink (or FIFO...) at the step's lock file, too many files: theirs too.
            where = tiers["local"].where(user, key, step)
            raise UnsafeCheckpoint(str(fsio.tier_error(exc, where))) from None
        if exc.errno in (errno.EACCES, errno.EPERM) and _all_own(tiers["local"], warm, user, uid):
            where = tiers["local"].where(user, key, step)
            raise OwnPermissionDenied(str(fsio.tier_error(exc, where))) from None
        if exc.errno == errno.EDQUOT:
            raise fsio.tier_error(exc, warm.where(user, key, step)) from None  # QuotaExceeded
        raise


def _all_own(local: Any, warm: Any, user: str, uid: int) -> bool:
    """Whether ``<root>/<user>`` on the local tier and on the warm tier (when POSIX) are
    directories of ``uid``: then everything a permission error can be about is below
    them, and only their owner (or root, which does not chmod users' files) set its
    mode. A missing or foreign one (the PFS root not letting users make their
    directory) is the site's problem instead."""
    for tier in (local, warm):
        root = getattr(tier, "root", None)
        if root is None:
            continue  # the object store: no modes a user sets on root's requests
        try:
            st = os.lstat(os.path.join(str(root), user))
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            return False
    return True


def flush_many_as_user(
    cfg: Config, user: str, uid: int, items: List[List[Any]], budget_s: float
) -> List[ChildResult[CopyResult]]:
    """:func:`flush_as_user` for several checkpoints of one user in one child (a fork
    of a large root process costs more than copying a tiny checkpoint): one result per
    item done, in order - its :class:`CopyResult` or its error - stopping when
    ``budget_s`` is spent (the rest are not in the list)."""
    end = time.monotonic() + budget_s
    out: List[ChildResult[CopyResult]] = []
    for key, step in items:
        if out and time.monotonic() >= end:
            break
        try:
            out.append(ChildResult(flush_as_user(cfg, user, str(key), int(step), uid)))
        except Exception as exc:  # noqa: BLE001 - each item's own outcome, to the parent
            out.append(ChildResult.failed(exc))
    return out


def scrub_as_user(
    cfg: Config, user: str, uid: int, items: List[List[Any]], budget_s: float
) -> List[List[Any]]:
    """Check the warm copies of checkpoints this node holds (``[key, step, full]``):
    ``[key, step, state, reason]`` per item checked, in order, until ``budget_s`` is spent.

    Every item: is the warm tier's committed manifest the local one, byte for byte?
    ``missing`` when the warm copy was uncommitted as damaged (by another node), ``deleted``
    when it is gone (the warm tier's retention), ``other`` when another checkpoint of the
    step is committed there. With ``full``
    its every byte is re-read and hashed too (``verify``); a copy that fails is
    *uncommitted* there (:meth:`PosixTier.uncommit`: it stops counting for every node and
    every restore) and reported ``damaged`` - the local copy, still good, is flushed
    again. ``ok`` after a full check, ``present`` after the manifest alone, ``gone``
    when the local copy is gone itself."""
    tiers = owner_tiers(cfg)
    local, warm = tiers["local"], warm_tier(cfg, tiers)
    alive()
    local.guard_user(user, uid)
    warm.guard_user(user, uid)
    end = time.monotonic() + budget_s
    out: List[List[Any]] = []
    for key, step, full in items:
        key, step = str(key), int(step)
        if out and time.monotonic() >= end:
            break
        alive()
        mine = local.committed_manifest(user, key, step)
        if mine is None:
            out.append([key, step, "gone", ""])
            continue
        theirs = warm.committed_manifest(user, key, step)
        if theirs is None and warm.uncommitted(user, key, step):  # type: ignore[attr-defined]
            why = "warm copy found damaged and uncommitted there (by another node's check)"
            out.append([key, step, "missing", why])
            continue
        if theirs != mine:
            # Deleted there (the warm tier's retention) or another checkpoint of the step:
            # nothing to flush again on that ground - the ledger learns it is not there.
            out.append([key, step, "deleted" if theirs is None else "other", ""])
            continue
        if not full or time.monotonic() >= end:
            out.append([key, step, "present", ""])
            continue
        rep = warm.verify(user, key, step, progress=lambda _n: alive())
        if rep.ok:
            out.append([key, step, "ok", ""])
            continue
        why = rep.problems[0] if rep.problems else "verify failed"
        warm.uncommit(user, key, step, theirs)  # type: ignore[attr-defined]
        out.append([key, step, "damaged", f"warm copy damaged, uncommitted there: {why}"])
    return out


def delete_as_user(cfg: Config, user: str, key: str, step: int, uid: int, need_warm: bool) -> bool:
    """Delete a local checkpoint; with ``need_warm`` only if the warm tier holds the very same
    committed checkpoint (identical manifest bytes) - the ledger is a cache, this is the
    last word before bytes disappear."""
    tiers = _bounded_locks(cfg, owner_tiers(cfg))
    local, warm = tiers["local"], warm_tier(cfg, tiers)  # warm: the PFS or the object store
    alive()
    local.guard_step(user, key, step, uid)
    if need_warm:
        mine = local.committed_manifest(user, key, step)
        theirs = warm.committed_manifest(user, key, step)
        if mine is None or mine != theirs:
            raise CkptError(
                f"{local.where(user, key, step)}: no identical committed copy on the "
                f"{'PFS' if warm.name == PFS else warm.name + ' tier'}; kept"
            )
    local.delete(user, key, step)
    return True


def delete_many_as_user(
    cfg: Config, user: str, uid: int, items: List[List[Any]], budget_s: float
) -> List[ChildResult[bool]]:
    """:func:`delete_as_user` for several checkpoints (``[key, step, need_warm]``): one
    result per item done, in order (True, or its error), stopping when ``budget_s`` is
    spent."""
    end = time.monotonic() + budget_s
    out: List[ChildResult[bool]] = []
    for key, step, need_warm in items:
        if out and time.monotonic() >= end:
            break
        try:
            out.append(
                ChildResult(delete_as_user(cfg, user, str(key), int(step), uid, bool(need_warm)))
            )
        except Exception as exc:  # noqa: BLE001 - each item's own outcome, to the parent
            out.append(ChildResult.failed(exc))
    return out


def _free(root: str) -> int:
    sv = os.statvfs(root)
    return sv.f_bavail * sv.f_frsize


def _remove(dfd: int, name: str) -> None:
    """Remove ``name`` below ``dfd`` whatever it is (never following a symlink)."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        fsio.remove_tree(dfd, name)
    else:
        os.unlink(name, dir_fd=dfd)


def reclaim_as_user(
    cfg: Config, user: str, uid: int, junk: List[List[Any]], safe: List[List[Any]], need: int
) -> Dict[str, int]:
    """Free local space of a user who has left this node (see
    :mod:`slurm_ckpt.node.reclaim`). Removes everything in ``<local>/<user>`` that is
    not a committed checkpoint - debris, stray files - plus the committed checkpoints
    root listed in ``junk`` (found unflushable); then, while less than ``need`` bytes are
    free, the checkpoints in ``safe`` (oldest first), each only if the PFS holds the very
    same committed checkpoint. A committed checkpoint in neither list is never touched.
    Returns counts: ``entries`` and ``checkpoints`` removed."""
    tiers = tiers_from_config(cfg)
    local = tiers["local"]
    drop = {(str(k), int(s_)) for k, s_ in junk}
    out = {"entries": 0, "checkpoints": 0}
    rfd = fsio.open_dir(local.root)
    try:
        ufd = fsio.open_beneath(rfd, [user])
    finally:
        os.close(rfd)
    try:
        for name in sorted(os.listdir(ufd)):
            alive()
            if name == LEDGER_SUBDIR:
                continue  # the user's own ledger: small, and theirs
            try:
                validate_key(name)
                kfd = os.open(name, fsio.O_DIR, dir_fd=ufd)
            except (InvalidName, OSError):
                _remove(ufd, name)  # not a series: junk
                out["entries"] += 1
                continue
            try:
                for entry in sorted(os.listdir(kfd)):
                    alive()
                    step = parse_step_dirname(entry)
                    if step is None:
                        if not entry.startswith(LOCK_PREFIX):
                            _remove(kfd, entry)  # debris of writers and copies, strays
                            out["entries"] += 1
                        continue
                    if (name, step) in drop or not _committed(local, user, name, step):
                        _remove(kfd, entry)
                        fsio.unlink_quiet(kfd, LOCK_PREFIX + entry)
                        out["checkpoints" if (name, step) in drop else "entries"] += 1
                left = os.listdir(kfd)
            finally:
                os.close(kfd)
            if not left:
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=ufd)  # a series with nothing left
    finally:
        os.close(ufd)
    for key, step in safe:
        if _free(local.root) >= need:
            break
        alive()
        try:
            delete_as_user(cfg, user, str(key), int(step), uid, True)
            out["checkpoints"] += 1
        except CkptError:
            continue  # not identical on the PFS after all (or unsafe): kept
    return out


def _committed(tier: Tier, user: str, key: str, step: int) -> bool:
    try:
        tier.manifest(user, key, step)
        return True
    except (CkptError, OSError):
        return False
