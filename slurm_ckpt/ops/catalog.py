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
import logging
import os
import re
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.layout import step_dirname, step_numbers
from slurm_ckpt.core.manifest import MANIFEST_NAME, manifest_facts
from slurm_ckpt.core.names import base_key, validate_key, validate_user
from slurm_ckpt.core.replicas import suspect_text
from slurm_ckpt.errors import CkptError, NotFound, TierError
from slurm_ckpt.ops.damage import COMMIT_GRACE_S, COMMITTED, Damaged, scan_series
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.registry import ORDER

log = logging.getLogger(__name__)

__all__ = [
    "Series",
    "SeriesHead",
    "scan_catalog",
    "series_rows",
    "step_rows",
    "verify_targets",
]

Series = Tuple[str, str]


def under_key(series_key: str, key: str) -> bool:
    """Whether a series belongs to the user's ``key``: the key itself, or one of its
    rank series or DCP parts."""
    return series_key == key or base_key(series_key) == key


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
    #: Step directories newer than that one which are damaged (no manifest after the
    #: commit grace time, a manifest that does not check, or of another series); older
    #: steps are not read here (``list KEY``/``verify KEY`` report those).
    damaged: int = 0
    #: What the newest checkpoint was trained on (``save(..., data_version=...)``).
    data_version: Optional[str] = None
    #: The newest checkpoint is suspect: its replicas did not agree (why), else None.
    suspect: Optional[str] = None


def _read_head(kfd: int, user: str, key: str, names: Iterable[str]) -> Optional[SeriesHead]:
    steps = step_numbers(names)  # names from os.listdir: never a NUL in one
    damaged = 0
    for i, step in enumerate(steps):
        try:
            sfd = os.open(step_dirname(step), fsio.O_DIR, dir_fd=kfd)
        except OSError:
            damaged += 1  # unreadable, or not a directory
            continue
        try:
            data, st = fsio.read_regular(sfd, MANIFEST_NAME)
            f = manifest_facts(data)
            mtime = st.st_mtime
        except FileNotFoundError:
            # No manifest: a commit in progress (young), or one that never finished.
            with contextlib.suppress(OSError):
                if time.time() - os.fstat(sfd).st_mtime >= COMMIT_GRACE_S:
                    damaged += 1
            continue
        except (OSError, CkptError):
            damaged += 1  # damaged: the next older one may be the newest
            continue
        finally:
            os.close(sfd)
        if (f.user, f.key, f.step) != (user, key, step):
            damaged += 1
            continue
        return SeriesHead(
            user,
            key,
            step,
            f.wall_time,
            f.nbytes,
            f.job,
            f.node,
            mtime,
            len(steps) - i,
            damaged,
            data_version=f.data_version,
            suspect=f.suspect,
        )
    return None


def _scan_user(
    root_fd: int, user: str, key: Optional[str], squatted: Optional[List[Dict[str, Any]]] = None
) -> List[Tuple[Series, SeriesHead]]:
    """One user's series heads; a user directory that another user owns (squatted) is
    not read - it is reported in ``squatted`` - and any error stays this user's."""
    try:
        return _scan_user_dir(root_fd, user, key, squatted)
    except (OSError, CkptError, ValueError, TypeError) as exc:
        log.warning("status: %s skipped: %s", user, exc)
        return []


def _scan_user_dir(
    root_fd: int, user: str, key: Optional[str], squatted: Optional[List[Dict[str, Any]]]
) -> List[Tuple[Series, SeriesHead]]:
    out: List[Tuple[Series, SeriesHead]] = []
    try:
        ufd = os.open(user, fsio.O_DIR, dir_fd=root_fd)
    except OSError:
        return out
    try:
        owner = trust.squatter(os.fstat(ufd), user)
        if owner is not None:
            if squatted is not None:
                squatted.append(
                    {
                        "user": user,
                        "owner_uid": owner,
                        "path": os.path.join(fsio.fd_path(root_fd), user),
                    }
                )
            return out
        try:
            keys = sorted(n for n in os.listdir(ufd) if not n.startswith("."))
        except OSError:
            return out
        if key is not None:  # the key and its ranks' series
            keys = [k for k in keys if under_key(k, key)]
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


#: Users walked one at a time before the walk decides whether threads would pay.
PROBE_USERS = 8


def _thread_waits() -> int:
    """This thread's voluntary context switches so far: each is a system call that
    blocked (a metadata round trip to a parallel filesystem, a disk read). Preemption by
    other processes is counted apart (involuntary), so a busy machine does not read as a
    slow filesystem. 0 where the platform cannot tell (then the walk stays in one
    thread)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return 0 if who is None else resource.getrusage(who).ru_nvcsw


def threads_pay(blocked: int, users: int) -> bool:
    """Whether walking the remaining users in threads is worth it, given how often the
    walk of the first ``users`` users ``blocked``. Threads overlap waits: on a parallel
    filesystem every open is a round trip and they pay. When nothing blocks (a local or
    cached tree), they only add cost: the walk is CPU-bound Python under one GIL, and
    threads contending for it cost CPU time for no gain in wall time, the more so on a
    busy login node (benchmarks/status.py, in-process CPU per job)."""
    return users > 0 and blocked >= users


def scan_catalog(
    root: str,
    user: Optional[str] = None,
    key: Optional[str] = None,
    workers: int = 8,
    squatted: Optional[List[Dict[str, Any]]] = None,
) -> Dict[Series, SeriesHead]:
    """The newest committed checkpoint of every series under a shared tier ``root``.

    Symlinks below the root are never followed. Unreadable users or keys are skipped
    (a login-node user may not read everyone's directories). The first
    :data:`PROBE_USERS` users are walked in this thread; if those walks blocked on the
    filesystem (:func:`threads_pay`), up to ``workers`` threads walk the rest in
    parallel: on a parallel filesystem each open is a metadata round trip, and those
    overlap (the GIL is released during the system calls). Otherwise the rest is walked
    here too.
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
        probe, rest = valid[:PROBE_USERS], valid[PROBE_USERS:]
        before = _thread_waits()
        parts = [_scan_user(root_fd, u, key, squatted) for u in probe]
        if rest and workers > 1 and threads_pay(_thread_waits() - before, len(probe)):
            with ThreadPoolExecutor(max_workers=min(workers, len(rest))) as pool:
                parts += pool.map(lambda u: _scan_user(root_fd, u, key, squatted), rest)
        else:
            parts += [_scan_user(root_fd, u, key, squatted) for u in rest]
        out: Dict[Series, SeriesHead] = {}
        for part in parts:
            out.update(part)
        return out
    finally:
        os.close(root_fd)


def series_rows(tiers: Dict[str, Tier], users: Optional[List[str]]) -> List[Dict[str, Any]]:
    """One row per series per tier: step count, newest step, bytes, age of the newest,
    and the number of damaged step directories (:mod:`slurm_ckpt.ops.damage`)."""
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
                    steps, damaged = scan_series(t, u, validate_key(k), now)  # type: ignore[arg-type]
                except (CkptError, OSError):
                    continue
                if not steps and not damaged:
                    continue
                newest = steps[-1] if steps else None
                rows.append(
                    {
                        "tier": name,
                        "user": u,
                        "key": k,
                        "steps": len(steps),
                        "step": None if newest is None else newest.step,
                        "bytes": sum(s.manifest.total_bytes for s in steps),
                        "age_s": None
                        if newest is None
                        else round(now - newest.manifest.wall_time, 3),
                        "damaged": len(damaged),
                        "path": t.location(u, k),
                    }
                )
    rows.sort(key=lambda r: (r["user"], r["key"], ORDER.index(r["tier"])))
    return rows


#: The series a user's KEY stands for besides itself: one per rank of a multi-rank job
#: (``KEY.rank00001``) and one per rank's DCP parts (``KEY.dcp.rank00001``).
_UNDER = re.compile(r"\.(?:dcp\.)?rank[0-9]{5}")


def series_under(tiers: Dict[str, Tier], user: str, key: str) -> List[str]:
    """``key`` and every series of its ranks and DCP parts found on any tier, sorted: what
    ``list KEY`` and ``verify KEY`` look at, grouped under the user's own key."""
    found = {key}
    for t in tiers.values():
        try:
            names = t.keys(user)
        except (TierError, NotFound, OSError):
            continue
        found.update(k for k in names if k.startswith(key) and _UNDER.fullmatch(k[len(key) :]))
    return sorted(found)


def step_rows(tiers: Dict[str, Tier], user: str, key: str) -> List[Dict[str, Any]]:
    """One row per step directory of ``user/key`` (and of its ranks' and DCP parts'
    series, :func:`series_under`) per tier: committed checkpoints (``state``
    "committed") and damaged ones (their state and ``reason``). Each committed one names
    its ``lineage`` and whether it is ``retired`` (a rollback abandoned it:
    :mod:`slurm_ckpt.core.lineage`, judged per series over the tiers listed together)."""
    rows: List[Dict[str, Any]] = []
    now = time.time()
    for series in series_under(tiers, user, key):
        rows += _series_rows(tiers, user, series, now)
    rows.sort(
        key=lambda r: (
            ORDER.index(r["tier"]) if r["tier"] in ORDER else 99,
            r["key"],
            r["step"] or 0,
        )
    )
    return rows


def _series_rows(tiers: Dict[str, Tier], user: str, key: str, now: float) -> List[Dict[str, Any]]:
    # Imported here, not at the top: ``status`` imports this module for scan_catalog
    # alone, and every ckpt-slurm status would pay for lineage's (and lease's) imports.
    from slurm_ckpt.core.lineage import SeriesView, lineage_of

    rows: List[Dict[str, Any]] = []
    scanned = {name: scan_series(t, user, key, now) for name, t in tiers.items()}  # type: ignore[arg-type]
    view = SeriesView.of(
        (s.step, s.manifest.meta, s.manifest.wall_time)
        for steps, _ in scanned.values()
        for s in steps
    )
    for name, t in tiers.items():
        steps, damaged = scanned[name]
        for s in steps:
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
                    "data_version": m.meta.get("data_version"),
                    "lineage": lineage_of(m.meta).name,
                    "retired": not view.active(s.step, m.meta),
                    "suspect": suspect_text(m.meta),
                    "state": COMMITTED,
                    "reason": None,
                    "path": t.location(user, key, s.step),
                }
            )
        rows += [dict(d.to_dict(), tier=name) for d in damaged]
    return rows


def verify_targets(
    tiers: Dict[str, Tier], target: str, user: str, step: Optional[int]
) -> Tuple[List[Tuple[Tier, str, str, int, int]], List[Tuple[str, Damaged]]]:
    """What to verify for KEY ``target`` of ``user``: ``(tier, user, key, step, bytes)``
    of every committed step, and the damaged step directories (reported as they are).
    A checkpoint directory given by path is :func:`slurm_ckpt.ops.verify_path.verify_path`'s.
    """
    checks: List[Tuple[Tier, str, str, int, int]] = []
    broken: List[Tuple[str, Damaged]] = []
    validate_key(target)
    for name, t in tiers.items():
        for series in series_under({name: t}, user, target):
            good, damaged = scan_series(t, user, series)  # type: ignore[arg-type]
            for info in good:
                if step is None or info.step == step:
                    checks.append((t, user, series, info.step, info.manifest.total_bytes))
            broken += [(name, d) for d in damaged if step is None or d.step in (None, step)]
    if not checks and not broken:
        raise NotFound(
            f"no committed checkpoint for {user}/{target}"
            + (f" at step {step}" if step is not None else "")
        )
    return checks, broken
