"""Every step directory of a series, good or damaged, with the reason (issue 11, item 1).

:meth:`Tier.steps` lists what a restart may use and skips the rest without a word;
an operator asking "are my checkpoints safe?" must hear about the rest. :func:`scan_series`
looks at every ``step-N`` entry of a series on a tier and sorts it into:

``committed``
    a manifest that parses, checks and names this user, key and step (its payload is
    not re-hashed here: ``verify`` does that and reports ``CORRUPT``);
``CORRUPT``
    the manifest is truncated, tampered with or not JSON, or ``step-N`` is not a
    directory (a regular file, a symlink: never followed);
``INCOMPLETE``
    a step directory without a manifest, older than :data:`COMMIT_GRACE_S` (debris of a
    crashed commit of an older version, which renamed the directory into place before
    its manifest; a younger one may be such a commit in progress and is left out); one
    whose manifest was moved aside because the copy was found damaged
    (``manifest.json.damaged``) is ``CORRUPT``;
``UNREADABLE``
    permission denied on the step directory or its manifest (or on the series
    directory itself: then one entry with ``step`` None stands for the series);
``FOREIGN``
    a valid manifest of another user, key or step (a directory copied or renamed into
    the wrong place).

Nothing here changes anything. Root-run safe: directories are opened with
``O_NOFOLLOW`` below the tier root, the manifest non-blocking with its type checked
before it is read.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.layout import parse_step_dirname, step_dirname
from slurm_ckpt.core.manifest import DAMAGED_MANIFEST_NAME, MANIFEST_NAME, Manifest
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.errors import NotFound, TierError, VerifyError
from slurm_ckpt.tiers.base import KeyDirs, StepInfo, Tier

__all__ = [
    "COMMIT_GRACE_S",
    "COMMITTED",
    "CORRUPT",
    "DAMAGE_STATES",
    "FOREIGN",
    "INCOMPLETE",
    "UNREADABLE",
    "Damaged",
    "scan_series",
]

COMMITTED = "committed"
CORRUPT = "CORRUPT"
INCOMPLETE = "INCOMPLETE"
UNREADABLE = "UNREADABLE"
FOREIGN = "FOREIGN"
DAMAGE_STATES = (CORRUPT, INCOMPLETE, UNREADABLE, FOREIGN)

#: A step directory without a manifest younger than this is a commit in progress.
COMMIT_GRACE_S = 120.0


@dataclass(frozen=True)
class Damaged:
    """One step directory (or, ``step`` None, a whole series) that is not a usable
    checkpoint, and why."""

    tier: str
    user: str
    key: str
    step: Optional[int]
    path: str
    state: str
    reason: str

    def to_dict(self) -> dict:
        return {
            "tier": self.tier,
            "user": self.user,
            "key": self.key,
            "step": self.step,
            "path": self.path,
            "state": self.state,
            "reason": self.reason,
        }


def read_manifest(sfd: int) -> bytes:
    """The manifest's bytes: opened non-blocking without following a symlink, its type
    checked before reading (a FIFO named manifest.json must not hang a root-run scan)."""
    return fsio.read_regular(sfd, MANIFEST_NAME)[0]


def _exists(dfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _why(exc: OSError) -> str:
    return exc.strerror.lower() if exc.strerror else type(exc).__name__


def _classify(
    tier: KeyDirs, kfd: int, user: str, key: str, name: str, step: int, now: float
) -> Tuple[Optional[StepInfo], Optional[Damaged]]:
    path = os.path.join(tier.root, user, key, name)

    def bad(state: str, reason: str) -> Tuple[None, Damaged]:
        return None, Damaged(tier.name, user, key, step, path, state, reason)

    try:
        sfd = os.open(name, fsio.O_DIR, dir_fd=kfd)
    except PermissionError:
        return bad(UNREADABLE, "permission denied on the step directory")
    except FileNotFoundError:
        return None, None  # deleted while we looked
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                link = stat.S_ISLNK(os.lstat(name, dir_fd=kfd).st_mode)
            except OSError:
                link = exc.errno == errno.ELOOP
            return bad(CORRUPT, f"{name} is {'a symlink' if link else 'not a directory'}")
        return bad(UNREADABLE, _why(exc))
    try:
        try:
            data = read_manifest(sfd)
        except FileNotFoundError:
            if _exists(sfd, DAMAGED_MANIFEST_NAME):
                return bad(CORRUPT, "found damaged and uncommitted (manifest.json.damaged)")
            try:
                age = now - os.fstat(sfd).st_mtime
            except OSError:
                age = COMMIT_GRACE_S
            if age < COMMIT_GRACE_S:
                return None, None  # a commit in progress: the manifest comes last
            return bad(INCOMPLETE, "no manifest: the commit never finished")
        except PermissionError:
            return bad(UNREADABLE, "permission denied on the manifest")
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EINVAL, errno.EFBIG):
                what = "a symlink" if exc.errno == errno.ELOOP else _why(exc)
                return bad(CORRUPT, f"manifest: {what}")
            return bad(UNREADABLE, f"manifest: {_why(exc)}")
    finally:
        os.close(sfd)
    where = tier.where(user, key, step)
    try:
        m = Manifest.from_bytes(data, where)
    except VerifyError as exc:
        text = str(exc)
        text = text[len(where) + 2 :] if text.startswith(where + ": ") else text
        return bad(CORRUPT, text if text.startswith("manifest") else f"manifest: {text}")
    if (m.user, m.key, m.step) != (user, key, step):
        return bad(FOREIGN, f"manifest belongs to {m.user}/{m.key} step {m.step}")
    return StepInfo(tier.name, user, key, step, m), None


def scan_series(
    tier: Tier, user: str, key: str, now: Optional[float] = None
) -> Tuple[List[StepInfo], List[Damaged]]:
    """``(committed steps, damaged entries)`` of ``user/key`` on ``tier``, by step.

    A series that does not exist gives two empty lists; one that cannot be opened gives
    one UNREADABLE entry with ``step`` None.
    """
    validate_user(user)
    validate_key(key)
    now = time.time() if now is None else now
    dirs = tier.directory()
    if dirs is None:  # an object store: its listing shows committed steps only
        return tier.steps(user, key), []
    series_path = os.path.join(dirs.root, user, key)
    try:
        os.lstat(series_path)
    except (FileNotFoundError, NotADirectoryError):
        return [], []  # no such series (or no such tier root here: config check says so)
    except PermissionError:
        why = "permission denied on the way to the series directory"
        return [], [Damaged(tier.name, user, key, None, series_path, UNREADABLE, why)]
    except OSError:
        pass  # key_fd says what it is
    try:
        ctx = dirs.key_fd(user, key)
        kfd = ctx.__enter__()
    except NotFound:
        return [], []
    except TierError as exc:
        return [], [Damaged(tier.name, user, key, None, series_path, UNREADABLE, str(exc))]
    good: List[StepInfo] = []
    damaged: List[Damaged] = []
    try:
        try:
            names = os.listdir(kfd)
        except OSError as exc:
            return [], [Damaged(tier.name, user, key, None, series_path, UNREADABLE, _why(exc))]
        for name in names:
            step = parse_step_dirname(name)
            if step is None or name != step_dirname(step):
                continue
            info, bad = _classify(dirs, kfd, user, key, name, step, now)
            if info is not None:
                good.append(info)
            if bad is not None:
                damaged.append(bad)
    finally:
        ctx.__exit__(None, None, None)
    good.sort(key=lambda s: s.step)
    damaged.sort(key=lambda d: d.step or 0)
    return good, damaged


def reclaimable(d: Damaged, newest_verified: Optional[int], pinned: bool = False) -> bool:
    """May ``gc`` delete this damaged step directory?

    Only a step directory (not a symlink or file in its place) that is CORRUPT in its
    manifest or INCOMPLETE, not pinned, and older than a checkpoint of the same series
    that verified *in this run* on the same tier: retention would not keep it anyway, and
    the series keeps a good copy. UNREADABLE and FOREIGN directories are never deleted
    (they may be someone else's data, or ours to fix by hand); they are reported.
    """
    if pinned or d.step is None or newest_verified is None or d.step >= newest_verified:
        return False
    if d.state == INCOMPLETE:
        return True
    return d.state == CORRUPT and d.reason.startswith("manifest")
