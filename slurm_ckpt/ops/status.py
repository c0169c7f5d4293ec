"""What ``ckpt-slurm status`` shows, computed without click, rich or any node's NVMe.

A login node sees three things: the **catalog** on each shared tier (PFS, object store,
cold: ``<user>/<key>/step-*``, :func:`~slurm_ckpt.ops.catalog_tiers.shared_heads`), the
**node statuses** every node publishes (``<pfs>/.slurm_ckpt/nodes/<node>.json``, or on a
site without a PFS signed objects in the bucket, see
:mod:`slurm_ckpt.ledger.status_store`), and
**SLURM** (one bulk ``squeue`` and one ``sinfo``, through an injectable function so that
this works, and is tested, where SLURM is absent). :func:`build_status` joins them; it is
pure (no I/O, no clock) and takes the scans as arguments.

Cost
----
The catalog scan is linear in the number of series and reads one manifest per series:
step directories are listed by name, and only the newest one whose manifest is present and
valid is opened and parsed (a newer one without a valid manifest is skipped: a commit in
progress or debris). Older steps are counted by name, not validated (``ckpt-slurm list``
and ``verify`` do that per key). SLURM is asked once for all jobs and once for all nodes,
never once per job.

JSON (``ckpt-slurm status --json``), stable field names
-------------------------------------------------------
Top level::

    format        "slurm_ckpt.status"
    version       1
    time          epoch seconds of the report
    pfs_root      the PFS root that was read (null on a site without a PFS)
    warm_tier     the tier flushes go to: "pfs", or "object" on a site without a PFS;
                  "at risk" means not yet safe there
    node_statuses where the node statuses were read (a path or an s3:// URL)
    slurm         {"available": bool, "note": str}
    filters       {"user", "job", "key", "node"}: null when not given
    totals        {"jobs", "nodes", "steps_at_risk", "checkpoints_at_risk",
                   "bytes_at_risk", "in_flight", "drained_by_us", "damaged"}
    jobs          list of job entries (below), sorted by user, key, job
    nodes         list of node entries (below), sorted by name

A **job entry** is one SLURM job with the checkpoint series (keys) it writes. A series is
attributed to the job that last committed to it according to the node status files, else
to the job recorded in its newest PFS manifest; a series with neither has ``job: null``::

    job                  SLURM job id (string) or null
    user                 owner
    keys                 series (key names) of this job
    key_groups           the same grouped by the user's key: [{"key", "ranks", "series"}]
                         (``KEY.rankNNNNN`` and ``KEY.dcp.rankNNNNN`` under ``KEY``;
                         ``ranks`` counts them, 0 for a one-rank series)
    suspect              why the newest step on a shared tier is suspect (its replicas
                         did not agree, ``Checkpointer(replicas=...)``), else null
    slurm_state          "RUNNING", "PENDING", ... as SLURM says; "gone" when SLURM
                         answered but no longer lists the job; "unknown" without SLURM
    nodes                nodes that report the job (status files) or that SLURM lists
    tiers                {"local": T|null, and for each configured shared tier "pfs",
                         "object", "cold": T|null} where T is {"step", "age_s"} for local
                         (from the node status files) and {"step", "age_s", "bytes",
                         "checkpoints", "damaged", "data_version"} for a shared tier: the
                         newest committed step, its age (now minus the checkpoint's
                         commit time), its size, the number of steps up to it, the
                         damaged steps newer than it, and what it was trained on
    data_version         the data version of the newest checkpoint on any shared tier
                         (``save(..., data_version=...)``); null when not recorded
    steps_at_risk        newest local step minus the newest step safe on the warm tier
                         (committed there, or verified per the node status); null when no
                         node reports the job
    checkpoints_at_risk  checkpoints committed locally and not yet verified on the warm
                         tier
    bytes_at_risk        their bytes
    in_flight            copies of this job running now
    failed               checkpoints whose last copy or verification failed
    partner              the newest step with a partner copy on a neighbour node and
                         where: {"copies", "step", "nodes"}, or null
                         (:mod:`slurm_ckpt.ops.partner_status`; not counted in
                         steps_at_risk)
    flush_rate_bps       bytes/s: a node-published ``flush_rate_bps`` if present, else the
                         newest warm-tier checkpoint's size over the time from its local
                         commit to its commit there (includes queueing: a pessimistic rate); null
                         when unknown
    flush_eta_s          bytes_at_risk / flush_rate_bps; 0 when nothing is at risk; null
                         when the rate is unknown

A **node entry**::

    node                 SLURM node name
    status_age_s         age of its status file (null: no status file)
    pending_checkpoints  checkpoints owed to the warm tier
    pending_bytes        their bytes
    in_flight            copies running now
    in_flight_flushes    [{"user", "key", "step", "tier", "bytes", "running_s"}] (the
                         node publishes up to 50)
    failed               checkpoints whose last copy or verification failed
    slurm_state          e.g. "IDLE+DRAIN"; "unknown" without SLURM
    drained_by_us        drained (or draining) with a ``slurm_ckpt:`` reason
    drain_reason         that reason when it is ours, else null
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional, Set, Tuple, Union

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.core.names import validate_key, validate_node, validate_user
from slurm_ckpt.ledger.record import shown_tier
from slurm_ckpt.ledger.status_store import status_store
from slurm_ckpt.ledger.user_status import read_user_statuses
from slurm_ckpt.ops.catalog import Series, SeriesHead, base_key, scan_catalog
from slurm_ckpt.ops.catalog_tiers import shared_heads
from slurm_ckpt.ops.partner_status import PartnerSeen
from slurm_ckpt.ops.security_checks import squatted_dirs
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
    "build_status",
    "collect_status",
    "no_slurm",
    "query_slurm",
    "slurm_absent",
    "slurm_query",
]

STATUS_FORMAT = "slurm_ckpt.status"
STATUS_VERSION = 1
_NO_JOB = ("", "None", "null")


# --------------------------------------------------------------------------- the join


@dataclass
class _Job:
    job: Optional[str]
    user: str = ""
    series: Set[Series] = field(default_factory=set)
    nodes: Set[str] = field(default_factory=set)
    latest_step: Optional[int] = None
    latest_warm_verified: Optional[int] = None
    last_commit_at: Optional[float] = None
    pending: int = 0
    pending_bytes: int = 0
    in_flight: int = 0
    failed: int = 0
    rate: Optional[float] = None
    #: Partner copies of this job's checkpoints held on other nodes (docs/partner.md).
    partner: PartnerSeen = field(default_factory=PartnerSeen)
    #: The newest step read on the local tier itself (a laptop: no node status).
    local_head: Optional[SeriesHead] = None


def _job_id(value: Any) -> Optional[str]:
    text = None if value is None else str(value)
    return None if text is None or text in _NO_JOB else text


def _num(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(value: Any) -> int:
    n = _num(value)
    return int(n) if n is not None else 0


def _max(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def key_groups(keys: List[str]) -> List[Dict[str, Any]]:
    """A job's series grouped by the user's key: ``[{"key", "ranks", "series"}]``
    (``ranks``: how many rank series; 0 for a plain one-rank series)."""
    groups: Dict[str, List[str]] = {}
    for k in keys:
        groups.setdefault(base_key(k), []).append(k)
    return [
        {"key": base, "ranks": sum(1 for k in ks if k != base), "series": sorted(ks)}
        for base, ks in sorted(groups.items())
    ]


def _series_of(text: Any) -> Optional[Series]:
    user, sep, key = str(text).partition("/")
    return (user, key) if sep and user and key else None


def _tier_entry(heads: List[SeriesHead], now: float) -> Optional[Dict[str, Any]]:
    if not heads:
        return None
    newest = max(heads, key=lambda h: (h.step, h.wall_time))
    return {
        "step": newest.step,
        "age_s": round(now - newest.wall_time, 3),
        "bytes": newest.nbytes,
        "checkpoints": sum(h.checkpoints for h in heads),
        "damaged": sum(h.damaged for h in heads),
        "data_version": newest.data_version,
        "suspect": newest.suspect,
    }


def _flight(entry: Dict[str, Any], now: float, warm: str = PFS) -> Dict[str, Any]:
    since = _num(entry.get("since"))
    return {
        "user": entry.get("user"),
        "key": entry.get("key"),
        "step": entry.get("step"),
        "tier": shown_tier(entry.get("tier"), warm),  # the ledger's slot, named truly
        "bytes": _int(entry.get("nbytes")),
        "running_s": None if since is None else round(now - since, 3),
    }


def build_status(
    *,
    now: float,
    pfs_root: Optional[str],
    node_statuses: List[Dict[str, Any]],
    slurm: SlurmSnapshot,
    shared: Dict[str, Dict[Series, SeriesHead]],
    warm: str = PFS,
    statuses_at: Optional[str] = None,
    user: Optional[str] = None,
    job: Optional[str] = None,
    key: Optional[str] = None,
    node: Union[None, str, Collection[str]] = None,
    user_statuses: Optional[List[Dict[str, Any]]] = None,
    squatted: Optional[List[Dict[str, Any]]] = None,
    notes: Optional[List[str]] = None,
    local: Optional[Dict[Series, SeriesHead]] = None,
) -> Dict[str, Any]:
    """Join catalog heads, node status files and SLURM into the status document.

    Pure: everything it needs is passed in. See the module docstring for the fields.
    ``node`` is one node name or several (``status -w 'n[1-3]'``): jobs on any of them.
    ``shared`` is the catalog of each shared tier by name; ``warm`` names the tier
    flushes go to. ``local``: the local tier's own catalog, where this machine has it
    (a laptop, ``status --local DIR``): a job no node status reports gets its local
    step from there.
    """
    wanted_nodes = None if node is None else ({node} if isinstance(node, str) else set(node))
    jobs: Dict[Any, _Job] = {}
    owner: Dict[Series, Tuple[float, Any]] = {}  # series -> (last commit, job group)

    def group(job_id: Optional[str], series: Optional[Series], owner: str = "") -> Any:
        # Jobs group by (id, user): a job id comes from manifests its user writes, so a
        # user claiming another's job id gets a row of their own, never a share of the
        # other's (and none at all when SLURM says the job is someone else's). Records
        # without a job id stay one group per node status entry (they cannot be split),
        # and catalog series without one get a group each.
        if job_id is not None and owner:
            sj = slurm.jobs.get(job_id)
            if sj is not None and sj.user and sj.user != owner:
                job_id = None  # a forged claim
        return (job_id, owner) if job_id is not None else ("", series)

    # 0. what the jobs themselves published (their users' own status files): newer
    #    entries replace the hooks' for the same node and job; never node-level facts.
    # node -> job -> (time, entry): looked up per node below, so that the join stays
    # linear in the number of nodes and jobs.
    newer: Dict[str, Dict[Any, Tuple[float, Dict[str, Any]]]] = {}
    for doc in user_statuses or []:
        t = _num(doc.get("time"))
        for job_key, js in (doc.get("jobs") or {}).items():
            if isinstance(js, dict) and t is not None:
                newer.setdefault(str(doc.get("node")), {})[job_key] = (t, js)
    problems: Dict[Series, List[Dict[str, Any]]] = {}

    # 1. node status files: what each node holds locally and owes the PFS.
    node_rows: Dict[str, Dict[str, Any]] = {}
    for doc in node_statuses:
        name = str(doc.get("node"))
        pending = doc.get("pending") if isinstance(doc.get("pending"), dict) else {}
        flights = [f for f in doc.get("in_flight") or [] if isinstance(f, dict)]
        extra = doc.get("extra") if isinstance(doc.get("extra"), dict) else {}
        node_rate = _num(extra.get("flush_rate_bps"))
        t = _num(doc.get("time"))
        node_rows[name] = {
            "node": name,
            "status_age_s": None if t is None else round(now - t, 3),
            "pending_checkpoints": _int(pending.get("count")),
            "pending_bytes": _int(pending.get("bytes")),
            "in_flight": _int(doc.get("in_flight_count", len(flights))),
            "in_flight_flushes": [_flight(f, now, warm) for f in flights],
            "failed": _int(doc.get("failed_count")),
        }
        for f in doc.get("failed") or []:
            if isinstance(f, dict) and isinstance(f.get("user"), str):
                problems.setdefault((f["user"], str(f.get("key"))), []).append(f)
        own = dict(doc.get("jobs") or {})
        for job_key, (t_user, js_user) in newer.get(name, {}).items():
            if t is None or t_user > t:
                own[job_key] = js_user
        for job_key, js in own.items():
            if not isinstance(js, dict):
                continue
            job_id = _job_id(str(job_key).split("#", 1)[0])
            series = [s for s in map(_series_of, js.get("keys") or []) if s is not None]
            owner_user = series[0][0] if series else str(js.get("user") or "")
            gid = group(job_id, (name, *series[:1]), owner_user)
            job_id = gid[0] or None
            j = jobs.setdefault(gid, _Job(job_id))
            j.series.update(series)
            if series and not j.user:
                j.user = series[0][0]
            j.nodes.add(name)
            latest = _num(js.get("latest_step"))
            if latest is not None:
                j.latest_step = int(_max(j.latest_step, latest))  # type: ignore[arg-type]
            # A node of an older version says only latest_pfs_verified_step (one release).
            verified = _num(js.get("latest_warm_verified_step", js.get("latest_pfs_verified_step")))
            if verified is not None:
                j.latest_warm_verified = int(_max(j.latest_warm_verified, verified))  # type: ignore[arg-type]
            commit = _num(js.get("last_commit_at"))
            j.last_commit_at = _max(j.last_commit_at, commit)
            j.pending += _int(js.get("pending"))
            j.pending_bytes += _int(js.get("pending_bytes"))
            j.in_flight += _int(js.get("in_flight"))
            j.failed += _int(js.get("failed"))
            j.partner.add(name, js)
            if node_rate is not None and node_rate > 0:
                j.rate = _max(j.rate, node_rate)
            for s in series:
                seen = owner.get(s)
                if seen is None or (commit or 0.0) >= seen[0]:
                    owner[s] = (commit or 0.0, gid)

    # 2. catalog series: attach to the job that last wrote them, else their manifest's job.
    by_tier: Dict[str, Dict[Any, List[SeriesHead]]] = {name: {} for name in shared}
    for name, heads in shared.items():
        into = by_tier[name]
        for series, head in heads.items():
            seen = owner.get(series)
            mine = (series[0], base_key(series[1]))  # a job's ranks: one group
            gid = seen[1] if seen is not None else group(_job_id(head.job), mine, series[0])
            if seen is None:
                owner[series] = (0.0, gid)
            j = jobs.setdefault(gid, _Job(gid[0] or None))
            j.series.add(series)
            if not j.user:
                j.user = series[0]
            into.setdefault(gid, []).append(head)

    # 2b. the local tier read directly (no node status on a laptop).
    for series, head in (local or {}).items():
        seen = owner.get(series)
        mine = (series[0], base_key(series[1]))
        gid = seen[1] if seen is not None else group(_job_id(head.job), mine, series[0])
        if seen is None:
            owner[series] = (0.0, gid)
        j = jobs.setdefault(gid, _Job(gid[0] or None))
        j.series.add(series)
        j.user = j.user or series[0]
        if j.local_head is None or head.step > j.local_head.step:
            j.local_head = head

    # 3. SLURM: job states and nodes, drains.
    for j in jobs.values():
        sj = slurm.jobs.get(j.job) if j.job is not None else None
        if sj is not None:
            j.nodes.update(sj.nodes)
            if not j.user and sj.user:
                j.user = sj.user
    for name, sn in slurm.nodes.items():
        if sn.drained_by_us and name not in node_rows:
            node_rows[name] = {
                "node": name,
                "status_age_s": None,
                "pending_checkpoints": 0,
                "pending_bytes": 0,
                "in_flight": 0,
                "in_flight_flushes": [],
                "failed": 0,
            }
    for name, row in node_rows.items():
        sn = slurm.nodes.get(name)
        row["slurm_state"] = sn.state if sn is not None else "unknown"
        row["drained_by_us"] = bool(sn is not None and sn.drained_by_us)
        row["drain_reason"] = sn.reason if sn is not None and sn.drained_by_us else None

    # 4. rows.
    rows: List[Dict[str, Any]] = []
    for gid, j in jobs.items():
        keys = sorted({k for _, k in j.series})
        if user is not None and j.user != user:
            continue
        if job is not None and j.job != job:
            continue
        if key is not None and key not in keys and key not in {base_key(k) for k in keys}:
            continue
        if wanted_nodes is not None and not wanted_nodes & j.nodes:
            continue
        if not slurm.available or j.job is None:
            state = "unknown"
        else:
            sj = slurm.jobs.get(j.job)
            state = sj.state if sj is not None else "gone"
        warm_heads = by_tier.get(warm, {}).get(gid, [])
        if j.latest_step is None and j.local_head is not None:
            j.latest_step = j.local_head.step
            j.last_commit_at = j.local_head.committed_at
        tiers: Dict[str, Any] = {
            "local": None
            if j.latest_step is None
            else {
                "step": j.latest_step,
                "age_s": None if j.last_commit_at is None else round(now - j.last_commit_at, 3),
            },
        }
        for name, groups in by_tier.items():
            tiers[name] = _tier_entry(groups.get(gid, []), now)
        steps_at_risk: Optional[int] = None
        if j.latest_step is not None:
            # The node statuses' warm fields are the ledger's WARM_SLOT (whatever the
            # warm tier is: slurm_ckpt.ledger.record).
            safe = j.latest_warm_verified if j.latest_warm_verified is not None else 0
            if tiers.get(warm) is not None:
                safe = max(safe, tiers[warm]["step"])
            steps_at_risk = max(0, j.latest_step - safe)
        newest_any = [t for n, t in tiers.items() if n != "local" and t is not None]
        data_version = (
            max(newest_any, key=lambda t: t["step"])["data_version"] if newest_any else None
        )
        rate = j.rate
        if rate is None and warm_heads:
            newest = max(warm_heads, key=lambda h: (h.step, h.wall_time))
            took = newest.committed_at - newest.wall_time
            if took > 0 and newest.nbytes > 0:
                rate = newest.nbytes / took
        if j.pending_bytes == 0:
            eta: Optional[float] = 0.0
        elif rate:
            eta = round(j.pending_bytes / rate, 3)
        else:
            eta = None
        found = [p for sr in sorted(j.series) for p in problems.get(sr, [])]
        rows.append(
            {
                "job": j.job,
                "user": j.user,
                "problems": [
                    {
                        "key": p.get("key"),
                        "step": p.get("step"),
                        "state": p.get("state"),
                        "hold": p.get("hold"),
                        "reason": p.get("reason"),
                    }
                    for p in found[:5]
                ],
                "keys": keys,
                "key_groups": key_groups(keys),
                "suspect": next(
                    (
                        t.get("suspect")
                        for n, t in tiers.items()
                        if n != "local" and t and t.get("suspect")
                    ),
                    None,
                ),
                "slurm_state": state,
                "nodes": sorted(j.nodes),
                "tiers": tiers,
                "data_version": data_version,
                "steps_at_risk": steps_at_risk,
                "checkpoints_at_risk": j.pending,
                "bytes_at_risk": j.pending_bytes,
                "in_flight": j.in_flight,
                "failed": j.failed,
                "flush_rate_bps": None if rate is None else round(rate, 3),
                "flush_eta_s": eta,
                "partner": j.partner.entry(),
            }
        )
    rows.sort(key=lambda r: (r["user"], r["keys"], r["job"] or ""))

    nodes_out = [node_rows[n] for n in sorted(node_rows) if node is None or n in wanted_nodes]
    if user is not None or job is not None or key is not None:
        wanted = {n for r in rows for n in r["nodes"]}
        nodes_out = [r for r in nodes_out if r["node"] in wanted]
    return {
        "format": STATUS_FORMAT,
        "version": STATUS_VERSION,
        "time": now,
        "pfs_root": pfs_root,
        "warm_tier": warm,
        "node_statuses": statuses_at,
        "slurm": {"available": slurm.available, "note": slurm.note},
        "filters": {
            "user": user,
            "job": job,
            "key": key,
            "node": node if node is None or isinstance(node, str) else sorted(node),
        },
        "totals": {
            "jobs": len(rows),
            "nodes": len(nodes_out),
            "steps_at_risk": sum(r["steps_at_risk"] or 0 for r in rows),
            "checkpoints_at_risk": sum(r["checkpoints_at_risk"] for r in rows),
            "bytes_at_risk": sum(r["bytes_at_risk"] for r in rows),
            "in_flight": sum(r["in_flight"] for r in nodes_out),
            "drained_by_us": sum(1 for r in nodes_out if r["drained_by_us"]),
            "damaged": sum(
                (t or {}).get("damaged", 0)
                for r in rows
                for n, t in r["tiers"].items()
                if n != "local"
            ),
        },
        "jobs": rows,
        "nodes": nodes_out,
        "squatted": list(squatted or []),
        "notes": list(notes or []),
    }


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
) -> Dict[str, Any]:
    """Read the catalog(s), the node status files and SLURM; return the status document.

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
    squatted: List[Dict[str, Any]] = []
    # Every shared tier: pfs, object, cold (squatted user directories on the POSIX ones).
    shared = shared_heads(cfg, user=user, key=key, squatted=squatted)
    if cfg.partner.dir is not None:  # a squatted rendezvous turns a user's partner copies off
        for path, name, owner in squatted_dirs(Path(cfg.partner.dir)):
            if user is None or name == user:
                squatted.append(
                    {"user": name, "owner_uid": owner, "path": str(path), "partner": True}
                )
    notes: List[str] = []
    store = status_store(cfg)  # the PFS, or signed objects in the bucket without one
    statuses = store.read(notes)
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
        statuses_at=store.where,
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
