"""What ``ckpt-slurm status`` shows, computed without click, rich or any node's NVMe.

A login node sees three things: the **catalog** on each shared tier (PFS, object store,
cold: ``<user>/<key>/step-*``, :func:`~slurm_ckpt.ops.catalog_tiers.shared_heads`), the
**node statuses** every node publishes (``<pfs>/.slurm_ckpt/nodes/<node>.json``, or on a
site without a PFS signed objects in the bucket, see
:mod:`slurm_ckpt.ledger.status_store`), and
**SLURM** (one bulk ``squeue`` and one ``sinfo``, through an injectable function so that
this works, and is tested, where SLURM is absent). :func:`build_status`
(:mod:`slurm_ckpt.ops.status_join`) joins them; it is
pure (no I/O, no clock) and takes the scans as arguments.

Cost
----
The catalog scan is linear in the number of series and reads one manifest per series:
step directories are listed by name, and only the newest one whose manifest is present and
valid is opened and parsed (a newer one without a valid manifest is skipped: a commit in
progress or debris). Older steps are counted by name, not validated (``ckpt-slurm list``
and ``verify`` do that per key). SLURM is asked once for all jobs and once for all nodes,
never once per job.

Records
-------
The report is typed (:mod:`slurm_ckpt.ops.status_records`: one frozen record per job,
node, tier head, ...; the ``--json`` field names are documented there). It becomes JSON
only at the edge, by :meth:`~slurm_ckpt.ops.status_records.StatusReport.to_json`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional, Union

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import validate_key, validate_node, validate_user
from slurm_ckpt.ledger.status_store import status_store
from slurm_ckpt.ledger.user_status import read_user_statuses
from slurm_ckpt.ops.catalog import scan_catalog
from slurm_ckpt.ops.catalog_tiers import shared_heads
from slurm_ckpt.ops.security_checks import squatted_dirs
from slurm_ckpt.ops.status_join import build_status
from slurm_ckpt.ops.status_records import STATUS_FORMAT, Squat, StatusReport, key_groups
from slurm_ckpt.ops.status_slurm import (
    SLURM_ABSENT,
    SLURM_UNCONFIGURED,
    SlurmJob,
    SlurmNode,
    SlurmQuery,
    SlurmSnapshot,
    no_slurm,
    query_slurm,
    slurm_absent,
)

__all__ = [
    "SLURM_ABSENT",
    "SLURM_UNCONFIGURED",
    "STATUS_FORMAT",
    "SlurmJob",
    "SlurmNode",
    "SlurmQuery",
    "SlurmSnapshot",
    "StatusReport",
    "build_status",
    "collect_status",
    "key_groups",
    "no_slurm",
    "query_slurm",
    "slurm_absent",
    "slurm_query",
]

#: The SLURM view ``status`` uses; replace it to run without (or with another) SLURM.
slurm_query: SlurmQuery = query_slurm


def collect_status(
    cfg: Config,
    *,
    user: Optional[str] = None,
    job: Optional[str] = None,
    key: Optional[str] = None,
    node: Union[None, str, Collection[str]] = None,
    query: Optional[SlurmQuery] = None,
    now: Optional[float] = None,
    local_tier: bool = False,
) -> StatusReport:
    """Read the catalog(s), the node status files and SLURM; return the status report
    (``.to_json()``: the ``--json`` document).

    ``local_tier``: also read the local tier's own catalog (a user's own tiers, as on a
    laptop: no node publishes a status there).

    ``query`` defaults to :data:`slurm_query`. ``--user``/``--key`` narrow the catalog
    walk itself; ``--job``/``--node`` filter the joined rows (``node``: one name or several).
    """
    if user is not None:
        validate_user(user)
    if key is not None:
        validate_key(key)
    for name in [node] if isinstance(node, str) else node or ():
        validate_node(name)
    pfs_root = None if cfg.tiers.pfs is None else str(cfg.tiers.pfs.root)
    found: List[Dict[str, Any]] = []
    # Every shared tier: pfs, object, cold (squatted user directories on the POSIX ones).
    shared = shared_heads(cfg, user=user, key=key, squatted=found)
    squatted = [Squat.from_scan(s) for s in found]
    if cfg.partner.dir is not None:  # a squatted rendezvous turns a user's partner copies off
        for path, name, owner in squatted_dirs(Path(cfg.partner.dir)):
            if user is None or name == user:
                squatted.append(Squat(name, owner, str(path), partner=True))
    notes: List[str] = []
    statuses: List[Dict[str, Any]] = []
    statuses_at: Optional[str] = None
    if cfg.tiers.pfs is not None or cfg.tiers.object is not None:  # else a laptop's dirs
        store = status_store(cfg)  # the PFS, or signed objects in the bucket without one
        statuses, statuses_at = store.read(notes), store.where
    owners = sorted(
        {u for heads in shared.values() for u, _k in heads} | ({user} if user else set())
    )
    # Jobs publish their own status in their user's directory on the PFS (none without).
    user_docs = [] if pfs_root is None else read_user_statuses(cfg.tiers.pfs.root, owners)
    local_heads = None
    if local_tier and os.path.isdir(cfg.tiers.local.root):
        local_heads = scan_catalog(str(cfg.tiers.local.root), user=user, key=key)
    snapshot = (query or slurm_query)()
    return build_status(
        now=time.time() if now is None else now,
        pfs_root=pfs_root,
        shared=shared,
        warm=cfg.tiers.warm,
        statuses_at=statuses_at,
        node_statuses=statuses,
        slurm=snapshot,
        user=user,
        job=job,
        key=key,
        node=node,
        user_statuses=user_docs,
        squatted=squatted,
        notes=notes,
        local=local_heads,
    )
