"""The join behind ``ckpt-slurm status``: node statuses, catalog heads and SLURM into
one :class:`~slurm_ckpt.ops.status_records.StatusReport`.

Why a module of its own: the join is pure (no I/O, no clock; everything is passed in),
so it is tested and timed apart from the reading (:mod:`slurm_ckpt.ops.status`, which
walks the catalogs, reads the node statuses and asks SLURM). It is linear in the number
of nodes, jobs and series: every lookup is a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Dict, List, Optional, Sequence, Set, Tuple, Union

from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.ledger.record import shown_tier
from slurm_ckpt.ops.catalog import Series, SeriesHead, base_key
from slurm_ckpt.ops.partner_status import PartnerSeen
from slurm_ckpt.ops.status_records import (
    Filters,
    Flight,
    JobStatus,
    LocalHead,
    NodeStatus,
    Problem,
    Squat,
    StatusReport,
    TierHead,
    Totals,
    key_groups,
)
from slurm_ckpt.ops.status_slurm import SlurmSnapshot

__all__ = ["build_status"]

_NO_JOB = ("", "None", "null")

#: A job's group in the join: ``(job id, owner)``, or ``("", series)`` without a job id.
GroupId = Tuple[Any, Any]


# --------------------------------------------------------------------------- the join


@dataclass
class _Job:
    """One job's figures while the join gathers them (its row is built at the end)."""

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


@dataclass(frozen=True)
class _NodeSeen:
    """A node's own figures, from its status file (SLURM's view is added at the end)."""

    age_s: Optional[float] = None
    pending_checkpoints: int = 0
    pending_bytes: int = 0
    in_flight: int = 0
    flights: Tuple[Flight, ...] = ()
    failed: int = 0


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


def _series_of(text: Any) -> Optional[Series]:
    user, sep, key = str(text).partition("/")
    return (user, key) if sep and user and key else None


def _newest(heads: List[TierHead]) -> TierHead:
    """The head with the highest step (the first of equals, hot to cold)."""
    return heads[0] if len(heads) == 1 else max(heads, key=lambda h: h.step)


def _dict(value: Any) -> Dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _flight(entry: Dict[str, Any], now: float, warm: str = PFS) -> Flight:
    since = _num(entry.get("since"))
    return Flight(
        entry.get("user"),
        entry.get("key"),
        entry.get("step"),
        shown_tier(entry.get("tier"), warm),  # the ledger's slot, named truly
        _int(entry.get("nbytes")),
        None if since is None else round(now - since, 3),
    )


class _Join:
    """One join of node statuses, catalogs and SLURM: jobs by group, who owns each
    series, each node's figures and the failures the nodes report.

    The steps run in order (:func:`build_status`): :meth:`read_nodes`, :meth:`attach`
    per shared tier, :meth:`attach_local`, :meth:`add_slurm`; then :meth:`job_row` and
    :meth:`node_rows` build the records.
    """

    def __init__(self, now: float, slurm: SlurmSnapshot, warm: str) -> None:
        self.now, self.slurm, self.warm = now, slurm, warm
        self.jobs: Dict[GroupId, _Job] = {}
        self.owner: Dict[Series, Tuple[float, GroupId]] = {}  # series -> (last commit, group)
        self.nodes: Dict[str, _NodeSeen] = {}
        self.problems: Dict[Series, List[Dict[str, Any]]] = {}
        self.by_tier: Dict[str, Dict[GroupId, List[SeriesHead]]] = {}

    def group(self, job_id: Optional[str], series: Any, owner: str = "") -> GroupId:
        # Jobs group by (id, user): a job id comes from manifests its user writes, so a
        # user claiming another's job id gets a row of their own, never a share of the
        # other's (and none at all when SLURM says the job is someone else's). Records
        # without a job id stay one group per node status entry (they cannot be split),
        # and catalog series without one get a group each.
        if job_id is not None and owner:
            sj = self.slurm.jobs.get(job_id)
            if sj is not None and sj.user and sj.user != owner:
                job_id = None  # a forged claim
        return (job_id, owner) if job_id is not None else ("", series)

    def read_nodes(
        self, node_statuses: List[Dict[str, Any]], user_statuses: List[Dict[str, Any]]
    ) -> None:
        """The node status files: what each node holds locally and owes the warm tier.

        The jobs' own status files (their users', ``user_statuses``) replace the hooks'
        entry for the same node and job when newer; they never set node-level facts.
        """
        # node -> job -> (time, entry): looked up per node, so that the join stays
        # linear in the number of nodes and jobs.
        newer: Dict[str, Dict[Any, Tuple[float, Dict[str, Any]]]] = {}
        for doc in user_statuses:
            t = _num(doc.get("time"))
            for job_key, js in (doc.get("jobs") or {}).items():
                if isinstance(js, dict) and t is not None:
                    newer.setdefault(str(doc.get("node")), {})[job_key] = (t, js)
        for doc in node_statuses:
            name = str(doc.get("node"))
            pending = _dict(doc.get("pending"))
            flights = [f for f in doc.get("in_flight") or [] if isinstance(f, dict)]
            node_rate = _num(_dict(doc.get("extra")).get("flush_rate_bps"))
            t = _num(doc.get("time"))
            self.nodes[name] = _NodeSeen(
                None if t is None else round(self.now - t, 3),
                _int(pending.get("count")),
                _int(pending.get("bytes")),
                _int(doc.get("in_flight_count", len(flights))),
                tuple(_flight(f, self.now, self.warm) for f in flights),
                _int(doc.get("failed_count")),
            )
            for f in doc.get("failed") or []:
                if isinstance(f, dict) and isinstance(f.get("user"), str):
                    self.problems.setdefault((f["user"], str(f.get("key"))), []).append(f)
            own = dict(doc.get("jobs") or {})
            for job_key, (t_user, js_user) in newer.get(name, {}).items():
                if t is None or t_user > t:
                    own[job_key] = js_user
            for job_key, js in own.items():
                if isinstance(js, dict):
                    self._node_job(name, str(job_key), js, node_rate)

    def _node_job(
        self, name: str, job_key: str, js: Dict[str, Any], node_rate: Optional[float]
    ) -> None:
        """One job entry of node ``name``'s status."""
        job_id = _job_id(job_key.split("#", 1)[0])
        series = [s for s in map(_series_of, js.get("keys") or []) if s is not None]
        owner_user = series[0][0] if series else str(js.get("user") or "")
        gid = self.group(job_id, (name, *series[:1]), owner_user)
        j = self.jobs.setdefault(gid, _Job(gid[0] or None))
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
            seen = self.owner.get(s)
            if seen is None or (commit or 0.0) >= seen[0]:
                self.owner[s] = (commit or 0.0, gid)

    def _job_of(self, series: Series, head: SeriesHead) -> Tuple[GroupId, _Job]:
        """The job a catalog series belongs to: the one that last wrote it, else its
        manifest's job (a job's ranks: one group)."""
        seen = self.owner.get(series)
        mine = (series[0], base_key(series[1]))
        gid = seen[1] if seen is not None else self.group(_job_id(head.job), mine, series[0])
        if seen is None:
            self.owner[series] = (0.0, gid)
        j = self.jobs.setdefault(gid, _Job(gid[0] or None))
        j.series.add(series)
        j.user = j.user or series[0]
        return gid, j

    def attach(self, tier: str, heads: Dict[Series, SeriesHead]) -> None:
        """One shared tier's catalog."""
        into = self.by_tier.setdefault(tier, {})
        for series, head in heads.items():
            gid, _j = self._job_of(series, head)
            into.setdefault(gid, []).append(head)

    def attach_local(self, heads: Dict[Series, SeriesHead]) -> None:
        """The local tier read directly (no node status on a laptop)."""
        for series, head in heads.items():
            _gid, j = self._job_of(series, head)
            if j.local_head is None or head.step > j.local_head.step:
                j.local_head = head

    def add_slurm(self) -> None:
        """The nodes and owners SLURM lists for the jobs."""
        for j in self.jobs.values():
            sj = self.slurm.jobs.get(j.job) if j.job is not None else None
            if sj is not None:
                j.nodes.update(sj.nodes)
                if not j.user and sj.user:
                    j.user = sj.user

    def node_rows(self) -> Dict[str, NodeStatus]:
        """Every node with a status file, and every node drained by us without one (so
        that an operator sees why it is drained), with SLURM's state."""
        seen = dict(self.nodes)
        for name, sn in self.slurm.nodes.items():
            if sn.drained_by_us and name not in seen:
                seen[name] = _NodeSeen()
        out: Dict[str, NodeStatus] = {}
        for name, n in seen.items():
            sn = self.slurm.nodes.get(name)
            ours = sn is not None and sn.drained_by_us
            out[name] = NodeStatus(
                name,
                n.age_s,
                n.pending_checkpoints,
                n.pending_bytes,
                n.in_flight,
                n.flights,
                n.failed,
                sn.state if sn is not None else "unknown",
                ours,
                sn.reason if sn is not None and ours else None,
            )
        return out

    def job_row(self, gid: GroupId, j: _Job, keys: Tuple[str, ...]) -> JobStatus:
        """The record of one job (:class:`~slurm_ckpt.ops.status_records.JobStatus`)."""
        now = self.now
        if not self.slurm.available or j.job is None:
            state = "unknown"
        else:
            sj = self.slurm.jobs.get(j.job)
            state = sj.state if sj is not None else "gone"
        if j.latest_step is None and j.local_head is not None:
            j.latest_step = j.local_head.step
            j.last_commit_at = j.local_head.committed_at
        local = None
        if j.latest_step is not None:
            age = None if j.last_commit_at is None else round(now - j.last_commit_at, 3)
            local = LocalHead(j.latest_step, age)
        shared = tuple(
            (name, TierHead.newest(groups.get(gid, ()), now))
            for name, groups in self.by_tier.items()
        )
        heads = [h for _n, h in shared if h is not None]
        steps_at_risk: Optional[int] = None
        if j.latest_step is not None:
            # The node statuses' warm fields are the ledger's WARM_SLOT (whatever the
            # warm tier is: slurm_ckpt.ledger.record).
            safe = j.latest_warm_verified if j.latest_warm_verified is not None else 0
            warm = next((h for n, h in shared if n == self.warm and h is not None), None)
            if warm is not None:
                safe = max(safe, warm.step)
            steps_at_risk = max(0, j.latest_step - safe)
        rate = j.rate
        warm_heads = self.by_tier.get(self.warm, {}).get(gid, [])
        if rate is None and warm_heads:
            newest = max(warm_heads, key=lambda h: (h.step, h.wall_time))
            took = newest.committed_at - newest.wall_time
            if took > 0 and newest.nbytes > 0:
                rate = newest.nbytes / took
        eta: Optional[float] = None
        if j.pending_bytes == 0:
            eta = 0.0
        elif rate:
            eta = round(j.pending_bytes / rate, 3)
        found = (  # most jobs have none: no sort of their series then
            [p for sr in sorted(j.series) for p in self.problems.get(sr, [])]
            if self.problems and not self.problems.keys().isdisjoint(j.series)
            else []
        )
        return JobStatus(
            job=j.job,
            user=j.user,
            problems=tuple(
                Problem(p.get("key"), p.get("step"), p.get("state"), p.get("hold"), p.get("reason"))
                for p in found[:5]
            ),
            keys=keys,
            key_groups=key_groups(keys),
            suspect=next((h.suspect for h in heads if h.suspect), None),
            slurm_state=state,
            nodes=tuple(sorted(j.nodes)),
            local=local,
            shared=shared,
            data_version=_newest(heads).data_version if heads else None,
            steps_at_risk=steps_at_risk,
            checkpoints_at_risk=j.pending,
            bytes_at_risk=j.pending_bytes,
            in_flight=j.in_flight,
            failed=j.failed,
            flush_rate_bps=None if rate is None else round(rate, 3),
            flush_eta_s=eta,
            partner=j.partner.entry(),
        )


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
    squatted: Sequence[Squat] = (),
    notes: Sequence[str] = (),
    local: Optional[Dict[Series, SeriesHead]] = None,
) -> StatusReport:
    """Join catalog heads, node status files and SLURM into the status report.

    Pure: everything it needs is passed in. ``node`` is one node name or several
    (``status -w 'n[1-3]'``): jobs on any of them. ``shared`` is the catalog of each
    shared tier by name; ``warm`` names the tier flushes go to. ``local``: the local
    tier's own catalog, where this machine has it (a laptop, ``status --local DIR``): a
    job no node status reports gets its local step from there.
    """
    wanted_nodes = None if node is None else ({node} if isinstance(node, str) else set(node))
    join = _Join(now, slurm, warm)
    join.read_nodes(node_statuses, user_statuses or [])
    for name, heads in shared.items():
        join.attach(name, heads)
    join.attach_local(local or {})
    join.add_slurm()
    node_rows = join.node_rows()

    rows: List[JobStatus] = []
    for gid, j in join.jobs.items():
        keys = tuple(sorted({k for _, k in j.series}))
        if user is not None and j.user != user:
            continue
        if job is not None and j.job != job:
            continue
        if key is not None and key not in keys and key not in {base_key(k) for k in keys}:
            continue
        if wanted_nodes is not None and not wanted_nodes & j.nodes:
            continue
        rows.append(join.job_row(gid, j, keys))
    rows.sort(key=lambda r: (r.user, r.keys, r.job or ""))

    nodes_out = [
        node_rows[n] for n in sorted(node_rows) if wanted_nodes is None or n in wanted_nodes
    ]
    if user is not None or job is not None or key is not None:
        wanted = {n for r in rows for n in r.nodes}
        nodes_out = [r for r in nodes_out if r.node in wanted]
    shown_node = node if node is None or isinstance(node, str) else tuple(sorted(node))
    return StatusReport(
        time=now,
        pfs_root=pfs_root,
        warm_tier=warm,
        node_statuses=statuses_at,
        slurm_available=slurm.available,
        slurm_note=slurm.note,
        filters=Filters(user, job, key, shown_node),
        totals=Totals.of(rows, nodes_out),
        jobs=tuple(rows),
        nodes=tuple(nodes_out),
        squatted=tuple(squatted),
        notes=tuple(notes),
    )
