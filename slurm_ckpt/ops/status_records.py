"""The typed records of ``ckpt-slurm status``, and their one way out: ``to_json()``.

Why records and not a nested dict: :mod:`slurm_ckpt.ops.status` builds the report, the
CLI draws tables from it and the ``--json`` edge encodes it. With a dict each of them
spelled the field names again and a typo was a ``KeyError`` at run time; with frozen
records a misspelt field is caught by the type checker, and the JSON field names live
in one place, the ``to_json`` methods below (tests/test_status.py and scripts rely on
them: they are stable, and emitted in the order shown).

Values a node published (a flush's user, key and step, a refused step's reason) are kept
as they came (:data:`Published`): status reports what the node said, it does not
reinterpret it. Everything status computes is typed.

JSON (``ckpt-slurm status --json``), stable field names
-------------------------------------------------------
Top level (:class:`StatusReport`)::

    format        "slurm_ckpt.status"
    version       1
    time          epoch seconds of the report
    pfs_root      the PFS root that was read (null on a site without a PFS)
    warm_tier     the tier flushes go to: "pfs", or the object tier on a site without a
                  PFS; "at risk" means not yet safe there
    node_statuses where the node statuses were read (a path or an s3:// URL)
    slurm         {"available": bool, "note": str}
    filters       {"user", "job", "key", "node"}: null when not given
    totals        {"jobs", "nodes", "steps_at_risk", "checkpoints_at_risk",
                   "bytes_at_risk", "in_flight", "drained_by_us", "damaged"}
    jobs          list of job entries (below), sorted by user, key, job
    nodes         list of node entries (below), sorted by name
    squatted      user directories another user owns: [{"user", "owner_uid", "path"}]
                  (``"partner": true`` for the partner rendezvous)
    notes         what could not be read, one line each

A **job entry** (:class:`JobStatus`) is one SLURM job with the checkpoint series (keys)
it writes. A series is attributed to the job that last committed to it according to the
node status files, else to the job recorded in its newest PFS manifest; a series with
neither has ``job: null``::

    job                  SLURM job id (string) or null
    user                 owner
    problems             up to 5 checkpoints whose copy failed or was refused:
                         [{"key", "step", "state", "hold", "reason"}]
    keys                 series (key names) of this job
    key_groups           the same grouped by the user's key: [{"key", "ranks", "series"}]
                         (``KEY.rankNNNNN`` and ``KEY.dcp.rankNNNNN`` under ``KEY``;
                         ``ranks`` counts them, 0 for a one-rank series)
    suspect              why the newest step on a shared tier is suspect (its replicas
                         did not agree, ``Checkpointer(replicas=...)``), else null
    slurm_state          "RUNNING", "PENDING", ... as SLURM says; "gone" when SLURM
                         answered but no longer lists the job; "unknown" without SLURM
    nodes                nodes that report the job (status files) or that SLURM lists
    tiers                {"local": T|null, and for each configured shared tier (pfs,
                         object, cold) T|null} where T is {"step", "age_s"} for local
                         (from the node status files) and {"step", "age_s", "bytes",
                         "checkpoints", "damaged", "data_version", "suspect"} for a
                         shared tier: the newest committed step, its age (now minus the
                         checkpoint's commit time), its size, the number of steps up to
                         it, the damaged steps newer than it, what it was trained on,
                         and why it is suspect
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
    flush_rate_bps       bytes/s: a node-published ``flush_rate_bps`` if present, else the
                         newest warm-tier checkpoint's size over the time from its local
                         commit to its commit there (includes queueing: a pessimistic
                         rate); null when unknown
    flush_eta_s          bytes_at_risk / flush_rate_bps; 0 when nothing is at risk; null
                         when the rate is unknown
    partner              the newest step with a partner copy on a neighbour node and
                         where: {"copies", "step", "nodes"}, or null
                         (:mod:`slurm_ckpt.ops.partner_status`; not counted in
                         steps_at_risk)

A **node entry** (:class:`NodeStatus`)::

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

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from slurm_ckpt.ops.catalog import SeriesHead, base_key
from slurm_ckpt.ops.partner_status import PartnerCopies

__all__ = [
    "STATUS_FORMAT",
    "STATUS_VERSION",
    "Filters",
    "Flight",
    "JobStatus",
    "KeyGroup",
    "LocalHead",
    "NodeStatus",
    "Problem",
    "Published",
    "Squat",
    "StatusReport",
    "TierHead",
    "Totals",
    "key_groups",
]

STATUS_FORMAT = "slurm_ckpt.status"
STATUS_VERSION = 1

#: A value as a node (or a job) published it in its status file: shown as it came.
Published = Any

#: The ``node`` filter: none, one node, or several (``status -w 'n[1-3]'``, sorted).
NodeFilter = Union[None, str, Tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class LocalHead:
    """The newest step on a job's local tier, from the node statuses (or the local
    tier itself on a laptop), and its age."""

    step: int
    age_s: Optional[float]

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "age_s": self.age_s}


@dataclass(frozen=True, slots=True)
class TierHead:
    """A job's newest committed step on one shared tier (module docstring, ``tiers``)."""

    step: int
    age_s: float
    bytes: int
    checkpoints: int
    damaged: int
    data_version: Optional[str]
    suspect: Optional[str]

    @classmethod
    def newest(cls, heads: Sequence[SeriesHead], now: float) -> Optional[TierHead]:
        """The newest of a job's series heads on one tier, steps and damage summed."""
        if not heads:
            return None
        if len(heads) == 1:  # most jobs: one series on the tier (no max, no sums)
            top = heads[0]
            checkpoints, damaged = top.checkpoints, top.damaged
        else:
            top = max(heads, key=lambda h: (h.step, h.wall_time))
            checkpoints = sum(h.checkpoints for h in heads)
            damaged = sum(h.damaged for h in heads)
        return cls(
            top.step,
            round(now - top.wall_time, 3),
            top.nbytes,
            checkpoints,
            damaged,
            top.data_version,
            top.suspect,
        )

    def to_json(self) -> Dict[str, Any]:
        return {
            "step": self.step,
            "age_s": self.age_s,
            "bytes": self.bytes,
            "checkpoints": self.checkpoints,
            "damaged": self.damaged,
            "data_version": self.data_version,
            "suspect": self.suspect,
        }


@dataclass(frozen=True, slots=True)
class KeyGroup:
    """A user's key and its series: the key itself, or its ranks' (``KEY.rankNNNNN``)."""

    key: str
    ranks: int
    series: Tuple[str, ...]

    def to_json(self) -> Dict[str, Any]:
        return {"key": self.key, "ranks": self.ranks, "series": list(self.series)}


def key_groups(keys: Sequence[str]) -> Tuple[KeyGroup, ...]:
    """A job's series grouped by the user's key (``ranks``: how many rank series; 0 for
    a plain one-rank series)."""
    if len(keys) == 1:  # most jobs: one series
        k = keys[0]
        base = base_key(k)
        return (KeyGroup(base, 0 if k == base else 1, (k,)),)
    groups: Dict[str, List[str]] = {}
    for k in keys:
        groups.setdefault(base_key(k), []).append(k)
    return tuple(
        KeyGroup(base, sum(1 for k in ks if k != base), tuple(sorted(ks)))
        for base, ks in sorted(groups.items())
    )


@dataclass(frozen=True, slots=True)
class Problem:
    """A checkpoint whose last copy failed or was refused, as its node reported it."""

    key: Published
    step: Published
    state: Published
    hold: Published
    reason: Published

    def to_json(self) -> Dict[str, Any]:
        return {
            "key": self.key,
            "step": self.step,
            "state": self.state,
            "hold": self.hold,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class Flight:
    """A copy running on a node now, as the node published it."""

    user: Published
    key: Published
    step: Published
    tier: str
    bytes: int
    running_s: Optional[float]

    def to_json(self) -> Dict[str, Any]:
        return {
            "user": self.user,
            "key": self.key,
            "step": self.step,
            "tier": self.tier,
            "bytes": self.bytes,
            "running_s": self.running_s,
        }


@dataclass(frozen=True, slots=True)
class JobStatus:
    """One job row (module docstring, "job entry")."""

    job: Optional[str]
    user: str
    problems: Tuple[Problem, ...]
    keys: Tuple[str, ...]
    key_groups: Tuple[KeyGroup, ...]
    suspect: Optional[str]
    slurm_state: str
    nodes: Tuple[str, ...]
    local: Optional[LocalHead]
    #: Each configured shared tier, hot to cold, and the job's newest step there.
    shared: Tuple[Tuple[str, Optional[TierHead]], ...]
    data_version: Optional[str]
    steps_at_risk: Optional[int]
    checkpoints_at_risk: int
    bytes_at_risk: int
    in_flight: int
    failed: int
    flush_rate_bps: Optional[float]
    flush_eta_s: Optional[float]
    partner: Optional[PartnerCopies]

    def tier(self, name: str) -> Optional[TierHead]:
        """The job's newest step on the shared tier ``name`` (None: none there)."""
        for n, head in self.shared:
            if n == name:
                return head
        return None

    @property
    def damaged(self) -> int:
        """Damaged step directories on the shared tiers, newer than the newest good one."""
        return sum(head.damaged for _n, head in self.shared if head is not None)

    def to_json(self) -> Dict[str, Any]:
        tiers: Dict[str, Any] = {"local": None if self.local is None else self.local.to_json()}
        for name, head in self.shared:
            tiers[name] = None if head is None else head.to_json()
        return {
            "job": self.job,
            "user": self.user,
            "problems": [p.to_json() for p in self.problems],
            "keys": list(self.keys),
            "key_groups": [g.to_json() for g in self.key_groups],
            "suspect": self.suspect,
            "slurm_state": self.slurm_state,
            "nodes": list(self.nodes),
            "tiers": tiers,
            "data_version": self.data_version,
            "steps_at_risk": self.steps_at_risk,
            "checkpoints_at_risk": self.checkpoints_at_risk,
            "bytes_at_risk": self.bytes_at_risk,
            "in_flight": self.in_flight,
            "failed": self.failed,
            "flush_rate_bps": self.flush_rate_bps,
            "flush_eta_s": self.flush_eta_s,
            "partner": None if self.partner is None else self.partner.to_json(),
        }


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """One node row (module docstring, "node entry")."""

    node: str
    status_age_s: Optional[float]
    pending_checkpoints: int
    pending_bytes: int
    in_flight: int
    in_flight_flushes: Tuple[Flight, ...]
    failed: int
    slurm_state: str
    drained_by_us: bool
    drain_reason: Optional[str]

    def to_json(self) -> Dict[str, Any]:
        return {
            "node": self.node,
            "status_age_s": self.status_age_s,
            "pending_checkpoints": self.pending_checkpoints,
            "pending_bytes": self.pending_bytes,
            "in_flight": self.in_flight,
            "in_flight_flushes": [f.to_json() for f in self.in_flight_flushes],
            "failed": self.failed,
            "slurm_state": self.slurm_state,
            "drained_by_us": self.drained_by_us,
            "drain_reason": self.drain_reason,
        }


@dataclass(frozen=True, slots=True)
class Totals:
    """The sums over the rows shown (after the filters)."""

    jobs: int
    nodes: int
    steps_at_risk: int
    checkpoints_at_risk: int
    bytes_at_risk: int
    in_flight: int
    drained_by_us: int
    damaged: int

    @classmethod
    def of(cls, jobs: Sequence[JobStatus], nodes: Sequence[NodeStatus]) -> Totals:
        return cls(
            len(jobs),
            len(nodes),
            sum(j.steps_at_risk or 0 for j in jobs),
            sum(j.checkpoints_at_risk for j in jobs),
            sum(j.bytes_at_risk for j in jobs),
            sum(n.in_flight for n in nodes),
            sum(1 for n in nodes if n.drained_by_us),
            sum(j.damaged for j in jobs),
        )

    def to_json(self) -> Dict[str, Any]:
        return {
            "jobs": self.jobs,
            "nodes": self.nodes,
            "steps_at_risk": self.steps_at_risk,
            "checkpoints_at_risk": self.checkpoints_at_risk,
            "bytes_at_risk": self.bytes_at_risk,
            "in_flight": self.in_flight,
            "drained_by_us": self.drained_by_us,
            "damaged": self.damaged,
        }


@dataclass(frozen=True, slots=True)
class Filters:
    """What the report was narrowed to (None: not given)."""

    user: Optional[str] = None
    job: Optional[str] = None
    key: Optional[str] = None
    node: NodeFilter = None

    def to_json(self) -> Dict[str, Any]:
        node = list(self.node) if isinstance(self.node, tuple) else self.node
        return {"user": self.user, "job": self.job, "key": self.key, "node": node}


@dataclass(frozen=True, slots=True)
class Squat:
    """A user directory another user owns: not read (or, for the partner rendezvous,
    that user's partner copies turned off)."""

    user: str
    owner_uid: int
    path: str
    partner: bool = False

    @classmethod
    def from_scan(cls, found: Dict[str, Any]) -> Squat:
        """One entry as the catalog walk reports it (:mod:`slurm_ckpt.ops.catalog`)."""
        return cls(found["user"], found["owner_uid"], found["path"], bool(found.get("partner")))

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"user": self.user, "owner_uid": self.owner_uid, "path": self.path}
        if self.partner:
            out["partner"] = True
        return out


@dataclass(frozen=True, slots=True)
class StatusReport:
    """The whole status (module docstring, "top level")."""

    time: float
    pfs_root: Optional[str]
    warm_tier: str
    node_statuses: Optional[str]
    slurm_available: bool
    slurm_note: str
    filters: Filters
    totals: Totals
    jobs: Tuple[JobStatus, ...]
    nodes: Tuple[NodeStatus, ...]
    squatted: Tuple[Squat, ...] = ()
    notes: Tuple[str, ...] = ()

    def shared_names(self) -> List[str]:
        """The shared tiers the jobs have, the warm tier first."""
        names = [self.warm_tier]
        for j in self.jobs:
            names += [n for n, _head in j.shared if n not in names]
        return names

    def to_json(self) -> Dict[str, Any]:
        """The ``--json`` document (module docstring): the one place records become JSON."""
        return {
            "format": STATUS_FORMAT,
            "version": STATUS_VERSION,
            "time": self.time,
            "pfs_root": self.pfs_root,
            "warm_tier": self.warm_tier,
            "node_statuses": self.node_statuses,
            "slurm": {"available": self.slurm_available, "note": self.slurm_note},
            "filters": self.filters.to_json(),
            "totals": self.totals.to_json(),
            "jobs": [j.to_json() for j in self.jobs],
            "nodes": [n.to_json() for n in self.nodes],
            "squatted": [s.to_json() for s in self.squatted],
            "notes": list(self.notes),
        }
