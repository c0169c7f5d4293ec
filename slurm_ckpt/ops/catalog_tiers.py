"""The newest committed checkpoint of every series on *each* shared tier (PFS, object
store, cold), for ``ckpt-slurm status``: :func:`shared_heads`.

A POSIX tier is read by :func:`~slurm_ckpt.ops.catalog.scan_catalog` (directory names,
one manifest per series). The object store is read by :func:`scan_object_catalog`: one
listing of the keys below the prefix (a page per thousand objects) gives every series'
step names and which of them have their manifest (the commit), then only the newest
committed manifest of each series is fetched and checked, in parallel. A step with
objects but no manifest is a commit in progress while its newest object is younger than
the commit grace time, and damaged after it, as on a POSIX tier.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.layout import parse_step_dirname
from slurm_ckpt.core.manifest import MANIFEST_NAME, manifest_facts
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ops.catalog import Series, SeriesHead, scan_catalog, under_key
from slurm_ckpt.ops.damage import COMMIT_GRACE_S
from slurm_ckpt.tiers.registry import shared_tiers, tiers_from_config

__all__ = ["scan_object_catalog", "shared_heads"]

Heads = Dict[Series, SeriesHead]


def _valid(user: str, key: str) -> bool:
    try:
        validate_user(user)
        validate_key(key)
    except CkptError:
        return False
    return True


def scan_object_catalog(
    tier: Any,
    user: Optional[str] = None,
    key: Optional[str] = None,
    now: Optional[float] = None,
    workers: int = 8,
) -> Heads:
    """The newest committed checkpoint of every series in an object tier (an
    :class:`~slurm_ckpt.tiers.s3.S3Tier`), see the module docstring. A store that cannot
    be listed gives an empty catalog (status is most needed when something is broken)."""
    now = time.time() if now is None else now
    if user is None:
        prefix = tier.base
    elif key is None:
        prefix = f"{tier.base}{validate_user(user)}/"
    else:
        prefix = tier.series_prefix(user, key)[:-1]  # the key and its ranks' series
    # series -> step -> [manifest committed at, newest object at]
    seen: Dict[Series, Dict[int, List[Optional[float]]]] = {}
    try:
        for obj in tier.list_objects(prefix):
            parts = obj["Key"][len(tier.base) :].split("/", 3)
            if len(parts) < 4 or not _valid(parts[0], parts[1]):
                continue
            if key is not None and not under_key(parts[1], key):
                continue
            step = parse_step_dirname(parts[2])
            if step is None:
                continue
            mod = obj.get("LastModified")
            at = mod.timestamp() if mod is not None else now
            ent = seen.setdefault((parts[0], parts[1]), {}).setdefault(step, [None, 0.0])
            if parts[3] == MANIFEST_NAME:
                ent[0] = at
            ent[1] = max(ent[1] or 0.0, at)
    except CkptError:
        return {}

    def head(item: Tuple[Series, Dict[int, List[Optional[float]]]]) -> Optional[SeriesHead]:
        (u, k), steps = item
        order = sorted(steps, reverse=True)
        damaged = 0
        for i, step in enumerate(order):
            committed, newest = steps[step]
            if committed is None:
                if now - (newest or now) >= COMMIT_GRACE_S:
                    damaged += 1
                continue
            try:
                f = manifest_facts(tier.manifest_bytes(u, k, step))
            except CkptError:
                damaged += 1
                continue
            if (f.user, f.key, f.step) != (u, k, step):
                damaged += 1
                continue
            return SeriesHead(
                u,
                k,
                step,
                f.wall_time,
                f.nbytes,
                f.job,
                f.node,
                committed,
                len(order) - i,
                damaged,
                data_version=f.data_version,
                suspect=f.suspect,
            )
        return None

    items = sorted(seen.items())
    if not items:
        return {}
    with ThreadPoolExecutor(min(workers, len(items)), "ckpt-status-s3") as pool:
        heads = list(pool.map(head, items))
    return {(h.user, h.key): h for h in heads if h is not None}


def shared_heads(
    cfg: Config,
    user: Optional[str] = None,
    key: Optional[str] = None,
    squatted: Optional[List[Dict[str, Any]]] = None,
) -> Dict[str, Heads]:
    """``{tier name: catalog}`` for every configured shared tier (pfs, object, cold), hot
    to cold; user directories another user owns on a POSIX tier go to ``squatted``."""
    out: Dict[str, Heads] = {}
    tiers = tiers_from_config(cfg)
    for name in shared_tiers(cfg):
        t = tiers[name]
        dirs = t.directory()
        if dirs is not None:  # a tree of directories: read without following a link
            out[name] = scan_catalog(str(dirs.root), user=user, key=key, squatted=squatted)
        else:
            out[name] = scan_object_catalog(t, user=user, key=key)
    return out
