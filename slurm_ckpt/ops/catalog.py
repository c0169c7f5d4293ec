"""What is committed where: the listings behind ``ckpt-slurm list``, ``verify`` and
``status``.

The catalog of a shared tier is read fast (:func:`scan_catalog`): the newest committed
checkpoint of every series.

Used by ``ckpt-slurm status`` on login nodes, where a tier may hold thousands of series:
step directories are listed by name, and only the newest one whose manifest is present
and valid is opened (:func:`~slurm_ckpt.core.manifest.manifest_facts`, the fast fact
reader); older steps are counted by name. Symlinks are never followed and every open is
non-blocking with a type check, so a planted FIFO cannot hang root's ``status``.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.layout import parse_step_dirname, step_dirname
from slurm_ckpt.core.manifest import MANIFEST_NAME, manifest_facts
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.errors import CkptError, NotFound, TierError
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.registry import ORDER

__all__ = [
    "Series",
    "SeriesHead",
    "scan_catalog",
    "series_rows",
    "step_rows",
    "verify_targets",
]

Series = Tuple[str, str]


@dataclass(frozen=True)
class SeriesHead:
    """The newest committed checkpoint of one series on one tier, plus a step count."""

    user: str
    key: str
    step: int
    wall_time: float
    nbytes: int
    job: Optional[str]
    node: Optional[str]
    #: When the manifest was committed on this tier (its mtime).
    committed_at: float
    #: Step directories up to and including the newest committed one (counted by name).
    checkpoints: int


def _read_head(kfd: int, user: str, key: str, names: Iterable[str]) -> Optional[SeriesHead]:
    steps = sorted((s for s in map(parse_step_dirname, names) if s is not None), reverse=True)
    for i, step in enumerate(steps):
        try:
            sfd = os.open(step_dirname(step), fsio.O_DIR, dir_fd=kfd)
        except OSError:
            continue
        try:
            data, st = fsio.read_regular(sfd, MANIFEST_NAME)
            f = manifest_facts(data)
            mtime = st.st_mtime
        except (OSError, CkptError):
            continue  # not committed (yet), or damaged: the next older one may be newest
        finally:
            os.close(sfd)
        if (f.user, f.key, f.step) != (user, key, step):
            continue
        return SeriesHead(
            user, key, step, f.wall_time, f.nbytes, f.job, f.node, mtime, len(steps) - i
        )
    return None


def _scan_user(root_fd: int, user: str, key: Optional[str]) -> List[Tuple[Series, SeriesHead]]:
    out: List[Tuple[Series, SeriesHead]] = []
    try:
        ufd = os.open(user, fsio.O_DIR, dir_fd=root_fd)
    except OSError:
        return out
    try:
        if key is not None:
            keys = [key]
        else:
            try:
                keys = sorted(n for n in os.listdir(ufd) if not n.startswith("."))
            except OSError:
                return out
        for k in keys:
            try:
                validate_key(k)
                kfd = os.open(k, fsio.O_DIR, dir_fd=ufd)
            except (OSError, CkptError):
                continue
            try:
                head = _read_head(kfd, user, k, os.listdir(kfd))
            except OSError:
                head = None
            finally:
                os.close(kfd)
            if head is not None:
                out.append(((user, k), head))
    finally:
        os.close(ufd)
    return out


def scan_catalog(
    root: str, user: Optional[str] = None, key: Optional[str] = None, workers: int = 8
) -> Dict[Series, SeriesHead]:
    """The newest committed checkpoint of every series under a shared tier ``root``.

    Symlinks below the root are never followed. Unreadable users or keys are skipped
    (a login-node user may not read everyone's directories). ``workers`` threads walk
    users in parallel: on a parallel filesystem each open is a metadata round trip, and
    those overlap; the GIL is released during the system calls.
    """
    try:
        root_fd = fsio.open_dir(root)
    except OSError:
        return {}
    try:
        if user is not None:
            users = [user]
        else:
            users = sorted(n for n in os.listdir(root_fd) if not n.startswith("."))
        valid = []
        for u in users:
            try:
                valid.append(validate_user(u))
            except CkptError:
                continue
        out: Dict[Series, SeriesHead] = {}
        if workers > 1 and len(valid) > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(valid))) as pool:
                parts = list(pool.map(lambda u: _scan_user(root_fd, u, key), valid))
        else:
            parts = [_scan_user(root_fd, u, key) for u in valid]
        for part in parts:
            out.update(part)
        return out
    finally:
        os.close(root_fd)


def series_rows(tiers: Dict[str, Tier], users: Optional[List[str]]) -> List[Dict[str, Any]]:
    """One row per series per tier: step count, newest step, bytes, age of the newest."""
    now = time.time()
    rows: List[Dict[str, Any]] = []
    for name, t in tiers.items():
        try:
            names = users if users is not None else t.users()
        except (TierError, OSError):
            continue
        for u in names:
            try:
                keys = t.keys(validate_user(u))
            except (CkptError, OSError):
                continue  # another user's private directory, or not a user directory
            for k in keys:
                try:
                    steps = t.steps(u, validate_key(k))
                except (CkptError, OSError):
                    continue
                if not steps:
                    continue
                newest = steps[-1]
                rows.append(
                    {
                        "tier": name,
                        "user": u,
                        "key": k,
                        "steps": len(steps),
                        "step": newest.step,
                        "bytes": sum(s.manifest.total_bytes for s in steps),
                        "age_s": round(now - newest.manifest.wall_time, 3),
                        "path": t.location(u, k),
                    }
                )
    rows.sort(key=lambda r: (r["user"], r["key"], ORDER.index(r["tier"])))
    return rows


def step_rows(tiers: Dict[str, Tier], user: str, key: str) -> List[Dict[str, Any]]:
    """One row per committed checkpoint of ``user/key`` per tier."""
    rows = []
    now = time.time()
    for name, t in tiers.items():
        for s in t.steps(user, key):
            m = s.manifest
            rows.append(
                {
                    "tier": name,
                    "user": user,
                    "key": key,
                    "step": s.step,
                    "tokens": m.tokens,
                    "bytes": m.total_bytes,
                    "files": len(m.files),
                    "age_s": round(now - m.wall_time, 3),
                    "job": m.job,
                    "node": m.node,
                    "path": t.location(user, key, s.step),
                }
            )
    return rows


def verify_targets(
    tiers: Dict[str, Tier], target: str, user: str, step: Optional[int]
) -> List[Tuple[Tier, str, str, int, int]]:
    """What to verify: ``(tier, user, key, step, bytes)`` for a step directory or a KEY
    of ``user`` on ``tiers``."""
    checks: List[Tuple[Tier, str, str, int, int]] = []
    if os.sep in target or target.startswith("."):
        path = Path(target).absolute()
        s = parse_step_dirname(path.name)
        if s is None or not path.is_dir():
            raise CkptError(f"{target}: not a checkpoint directory (expected .../step-NNNNNNNNNN)")
        key_dir = path.parent
        t = PosixTier("path", str(key_dir.parent.parent))
        size = 0
        with contextlib.suppress(CkptError):  # verify reports it
            size = t.manifest(key_dir.parent.name, key_dir.name, s).total_bytes
        checks.append((t, key_dir.parent.name, key_dir.name, s, size))
        return checks
    validate_key(target)
    for t in tiers.values():
        for info in t.steps(user, target):
            if step is None or info.step == step:
                checks.append((t, user, target, info.step, info.manifest.total_bytes))
    if not checks:
        raise NotFound(
            f"no committed checkpoint for {user}/{target}"
            + (f" at step {step}" if step is not None else "")
        )
    return checks
