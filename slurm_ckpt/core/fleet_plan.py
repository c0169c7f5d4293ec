"""Cluster planner: do the site's checkpoint flushes fit the PFS, and at which cap?

``ckpt-slurm plan --cluster`` (parsing and printing in :mod:`slurm_ckpt.cli.plan`) runs
:func:`plan_cluster`. Pure arithmetic, no SLURM, no I/O; the input file is parsed by
:func:`jobs_from_doc`. ``benchmarks/fleet_sim.py`` simulates the same inputs event by
event with the real admission code, and a test holds the two within 10 % of each other.

Model
-----
Each job ``j`` has ``n`` nodes that each flush ``b`` bytes every ``T`` seconds, all at the
same step. A node flushes at up to ``r`` bytes/s (``--node-bw``); the PFS moves ``C``
bytes/s in all and other tenants ask for ``D`` of it (``--tenants``). When the demand
passes ``C`` everyone is slowed in proportion (a saturated PFS serves what it is asked in
proportion to the asking).

* **Utilisation** ``U = sum(n b / T) / C``: the share of the PFS that checkpoints take on
  average. The flushes *fit* when ``U`` is within the target share ``s`` and every job's
  flush ends before its next checkpoint.
* **The cap** that keeps checkpoints within ``s`` of the PFS: ``k = floor(s C / r)`` nodes
  at once (or ``max_bandwidth = s C``). The peak checkpoint demand is then ``k r``
  instead of the biggest job's ``n r`` (plus whatever overlaps it).
* **The jitter**: with the cap in force, one node flush of the biggest job, ``b / r'``
  (the slots keep the share; the jitter only spreads a job's requests over the time one
  of its nodes flushes, at little added time at risk). Without a cap it would have to
  keep the biggest burst within ``s C`` on its own: ``n b / (s C)`` for the biggest
  ``n b`` (reported as ``jitter_without_cap_s``).
* **Flush time of a node** (save committed -> on the PFS) is the jitter (``J/2`` on
  average), the wait for a slot, and the copy. Under the cap a holder flushes at
  ``r' = r min(1, C/(D + k r))`` (the pool is full during bursts), taking
  ``tau = b / r'``. It waits first:

  - behind its own job (``n > k``): its ``n`` requests come spread over ``J`` (rate
    ``a = n/J``), the slots serve ``mu = k/tau`` a second once the first ``k`` are taken,
    so a queue grows until ``J`` and drains after it (a fluid queue, :func:`burst`),
    plus half a flush for the waves in which slots free up (exact at ``J = 0``);
  - behind other jobs' queues: jobs start at independent phases (rate ``1/T`` each); a
    request arriving at a random moment waits for the queue it finds, the time-average
    of every job's queue over its period, inflated by ``1/(1 - rho)`` for queues that
    meet (``rho``: the share of time some queue exists; Pollaczek-Khinchine).
* **Job flush time** ``F`` (its save until its last node is on the PFS): until its queue
  has drained (or its last request came, ``J n/(n+1)``), plus one flush, plus the wait
  behind other jobs.
* **Data at risk, worst case per job**: its checkpoint (``n b`` bytes) exists on node-local
  disks only for ``F`` seconds; a node lost just before its flush ends costs the work
  since the previous checkpoint, ``T + F``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from slurm_ckpt.core.planner import PlanInputError, as_bandwidth, as_duration, as_size

__all__ = [
    "ClusterPlan",
    "FleetJob",
    "JobFigures",
    "jobs_from_doc",
    "plan_cluster",
    "self_wait",
]

#: Target share of the PFS for checkpoints when none is given.
DEFAULT_SHARE = 0.7


@dataclass(frozen=True)
class FleetJob:
    """One job (or a class of identical jobs, ``count`` of them)."""

    name: str
    nodes: int
    bytes_per_node: float
    interval_s: float
    count: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or int(self.nodes) != self.nodes or self.nodes < 1:
            raise PlanInputError(f"job {self.name}: nodes must be a whole number >= 1")
        if isinstance(self.count, bool) or int(self.count) != self.count or self.count < 1:
            raise PlanInputError(f"job {self.name}: count must be a whole number >= 1")
        for what, v in (("size", self.bytes_per_node), ("interval", self.interval_s)):
            if not (math.isfinite(v) and v > 0):
                raise PlanInputError(f"job {self.name}: {what} must be positive")


@dataclass
class JobFigures:
    """What the plan says about one job."""

    name: str
    nodes: int
    count: int
    bytes_per_node: float
    interval_s: float
    checkpoint_bytes: float
    flush_s: float
    wait_s: float
    job_flush_s: float
    burst_demand: float
    at_risk_bytes: float
    at_risk_work_s: float
    fits: bool


@dataclass
class ClusterPlan:
    """Every figure of ``plan --cluster``; bandwidths in bytes/s, times in seconds."""

    pfs_bw: float
    node_bw: float
    tenant_demand: float
    share: float
    nodes: int
    jobs: int
    bytes_per_hour: float
    utilisation: float
    fits: bool
    cap: int
    cap_basis: str
    max_bandwidth: float
    jitter_s: float
    jitter_basis: str
    jitter_without_cap_s: float
    peak_demand_uncapped: float
    peak_demand_capped: float
    flow_rate: float
    mean_wait_s: float
    mean_flush_s: float
    mean_job_flush_s: float
    worst_job_flush_s: float
    pool_load: float
    per_job: List[JobFigures] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["per_job"] = [asdict(j) for j in self.per_job]
        return d


@dataclass(frozen=True)
class _Burst:
    """One job's checkpoint as a fluid queue at the slots (see the module docstring)."""

    peak: float  # most of its nodes queued at once
    start: float  # when its queue starts to build (after its first k got slots)
    drain: float  # when its queue is empty again
    mean_wait: float  # mean wait of its own nodes

    @property
    def area(self) -> float:
        """Integral of the queue, in seconds of full pool x seconds (others wait behind
        it): the triangle from ``start`` to ``drain`` with height ``peak / mu``."""
        return 0.0 if self.peak <= 0 else (self.drain - self.start) * self._height / 2.0

    _height: float = 0.0


def burst(n: int, k: int, tau: float, jitter: float) -> _Burst:
    """The queue one job's ``n`` node flushes make at ``k`` slots when they ask spread
    uniformly over ``jitter`` seconds and each holds a slot for ``tau`` seconds.

    Fluid: arrivals at ``a = n/J``, service at ``mu = k/tau`` once the ``k`` free slots
    are taken (``k' = k (1 - mu/a)`` arrivals in); the queue grows at ``a - mu`` until
    ``J``, then drains at ``mu``. ``J -> 0`` is the burst of a job without jitter.
    """
    if n <= k:
        return _Burst(0.0, 0.0, 0.0, 0.0)
    mu = k / tau
    j = max(jitter, 1e-9 * tau)
    a = n / j
    if a <= mu:
        return _Burst(0.0, 0.0, 0.0, 0.0)
    k_in = k * (1.0 - mu / a)
    t0 = k_in / (a - mu)
    if t0 >= j:
        return _Burst(0.0, 0.0, 0.0, 0.0)
    peak = (a - mu) * (j - t0)
    mean = (a - mu) * (j - t0) ** 2 / (2.0 * mu * j)
    # The slots free up in waves, not smoothly: the first k started within k/a seconds of
    # each other, so they (and the waves after them) end within that spread of each
    # other, and a waiter waits on average half of the rest of a flush more than the
    # fluid says. (Exact for J = 0: k at a time, tau apart.)
    mean += (tau - min(tau, k / a)) / 2.0 * (j - t0) / j
    return _Burst(peak, t0, j + peak / mu, mean, peak / mu)


def self_wait(n: int, k: int, tau: float, jitter: float) -> float:
    """Mean wait of a job's node behind its own job's other nodes (fluid queue)."""
    return burst(n, k, tau, jitter).mean_wait


def plan_cluster(
    jobs: Sequence[FleetJob],
    pfs_bw: object,
    node_bw: object,
    *,
    share: float = DEFAULT_SHARE,
    tenants: object = None,
    cap: Optional[int] = None,
    jitter: object = None,
) -> ClusterPlan:
    """Work out a :class:`ClusterPlan` (see the module docstring).

    ``cap``/``jitter`` None: the recommended ones. ``tenants``: other tenants' demand on
    the PFS (bytes/s or ``"400GB/s"``; default none).
    """
    if not jobs:
        raise PlanInputError("plan --cluster: no jobs given")
    c = as_bandwidth(pfs_bw, "--pfs-bw")
    r = as_bandwidth(node_bw, "--node-bw")
    d = 0.0 if tenants is None else as_bandwidth(tenants, "--tenants")
    if not (math.isfinite(share) and 0 < share <= 1):
        raise PlanInputError(f"--share: must be a fraction in (0, 1], got {share!r}")
    warnings: List[str] = []

    rec_cap = max(1, int(math.floor(share * c / r + 1e-9)))
    if cap is None:
        k, cap_basis = rec_cap, f"floor({share:g} x PFS / node rate)"
    else:
        if isinstance(cap, bool) or int(cap) != cap or cap < 1:
            raise PlanInputError(f"--cap: must be a whole number >= 1, got {cap!r}")
        k, cap_basis = int(cap), "given"
        if k > rec_cap:
            warnings.append(
                f"a cap of {k} lets checkpoints ask for {k * r / c:.0%} of the PFS, above "
                f"the {share:.0%} share: use --cap {rec_cap}"
            )
    flow = r * min(1.0, c / (d + k * r))
    biggest = max(jobs, key=lambda j: j.nodes * j.bytes_per_node)
    alone = biggest.nodes * biggest.bytes_per_node / (share * c)
    if jitter is None:
        # With the cap in force the jitter only has to spread a job's requests over the
        # time one of its nodes flushes (the slots do the rest): a short delay, little
        # added time at risk. Without a cap it alone has to spread the biggest burst.
        jit = biggest.bytes_per_node / flow
        jitter_basis = f"one flush of the biggest job ({biggest.name})"
    else:
        jit, jitter_basis = as_duration(jitter, "--jitter", positive=False), "given"
    nodes = sum(j.nodes * j.count for j in jobs)
    load = sum(j.count * j.nodes * j.bytes_per_node / j.interval_s for j in jobs)
    util = load / c
    # Waits behind other jobs' backlogs: a node arriving at a random moment waits for the
    # queue it finds (the time-average of each job's queue, over its period), inflated by
    # 1/(1 - rho) for backlogs that meet (Pollaczek-Khinchine).
    rho = 0.0
    area = 0.0
    for j in jobs:
        tau = j.bytes_per_node / flow
        b = burst(j.nodes, k, tau, jit)
        full = b.drain - b.start  # its queue exists
        extra = 0.0
        if b.peak > 0:
            # Its last wave still holds every slot for up to one flush after the queue
            # drained, and frees them in a clump: who comes then waits half of that.
            clump = tau - min(tau, k * max(jit, 1e-12) / j.nodes)
            full += clump
            extra = clump * clump / 2.0
        rho += j.count * full / j.interval_s
        area += j.count * (b.area + extra) / j.interval_s
    if rho >= 1.0:
        other = math.inf
        warnings.append("the slots are busy with backlogs all the time: the queue grows")
    else:
        other = area / (1.0 - rho)

    # Slots that other jobs' flushes hold on average (slot-seconds per second): a job's
    # own burst goes through the rest.
    busy = sum(j.count * j.nodes * j.bytes_per_node / flow / j.interval_s for j in jobs)

    figs: List[JobFigures] = []
    wsum = fsum = jsum = weight = jweight = 0.0
    for j in jobs:
        tau = j.bytes_per_node / flow
        mine = j.nodes * tau / j.interval_s
        b = burst(j.nodes, max(1.0, k - (busy - mine)), tau, jit)
        w = b.mean_wait + other
        spread = jit * j.nodes / (j.nodes + 1)
        f = max(spread, b.drain) + tau + other
        ok = f < j.interval_s
        figs.append(
            JobFigures(
                name=j.name,
                nodes=j.nodes,
                count=j.count,
                bytes_per_node=j.bytes_per_node,
                interval_s=j.interval_s,
                checkpoint_bytes=j.nodes * j.bytes_per_node,
                flush_s=tau,
                wait_s=w,
                job_flush_s=f,
                burst_demand=j.nodes * r,
                at_risk_bytes=j.nodes * j.bytes_per_node,
                at_risk_work_s=j.interval_s + f,
                fits=ok,
            )
        )
        rate = j.count * j.nodes / j.interval_s  # node flushes per second
        wsum += rate * w
        fsum += rate * (jit / 2.0 + w + tau)  # save -> on the PFS: jitter, wait, copy
        weight += rate
        jsum += (j.count / j.interval_s) * f
        jweight += j.count / j.interval_s
        if not ok:
            warnings.append(
                f"job {j.name}: its flush takes {f:.0f}s, longer than its interval "
                f"({j.interval_s:.0f}s): flush every other checkpoint, or raise the cap"
            )
    if util > share:
        warnings.append(
            f"checkpoints need {util:.0%} of the PFS on average, more than the {share:.0%} "
            "share: flush less often (retention.flush_every) or get more PFS bandwidth"
        )
    fits = util <= share and all(f.fits for f in figs)
    uncapped = max(j.nodes * r for j in jobs)
    return ClusterPlan(
        pfs_bw=c,
        node_bw=r,
        tenant_demand=d,
        share=share,
        nodes=nodes,
        jobs=sum(j.count for j in jobs),
        bytes_per_hour=load * 3600.0,
        utilisation=util,
        fits=fits,
        cap=k,
        cap_basis=cap_basis,
        max_bandwidth=share * c,
        jitter_s=jit,
        jitter_basis=jitter_basis,
        jitter_without_cap_s=alone,
        peak_demand_uncapped=uncapped,
        peak_demand_capped=min(uncapped, k * r),
        flow_rate=flow,
        mean_wait_s=wsum / weight,
        mean_flush_s=fsum / weight,
        mean_job_flush_s=jsum / jweight,
        worst_job_flush_s=max(f.job_flush_s for f in figs),
        pool_load=rho,
        per_job=figs,
        warnings=warnings,
    )


# --------------------------------------------------------------------------- input


def _job_from(raw: Mapping[str, Any], where: str) -> FleetJob:
    allowed = {"name", "nodes", "size", "interval", "count"}
    unknown = set(raw) - allowed
    if unknown:
        raise PlanInputError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    for need in ("nodes", "size", "interval"):
        if need not in raw:
            raise PlanInputError(f"{where}: '{need}' is missing (nodes, size per node, interval)")
    nodes, count = raw["nodes"], raw.get("count", 1)
    for what, v in (("nodes", nodes), ("count", count)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanInputError(f"{where}: {what} must be a whole number >= 1, got {v!r}")
    return FleetJob(
        name=str(raw.get("name", where)),
        nodes=nodes,
        bytes_per_node=float(as_size(raw["size"], f"{where}: size")),
        interval_s=as_duration(raw["interval"], f"{where}: interval"),
        count=count,
    )


def jobs_from_doc(doc: Any, source: str = "jobs") -> List[FleetJob]:
    """Jobs from a parsed TOML/JSON document: ``{"jobs": [{"name", "nodes", "size",
    "interval", "count"}, ...]}`` or the list itself. ``size`` is per node."""
    items = doc.get("jobs") if isinstance(doc, Mapping) else doc
    if not isinstance(items, list) or not items:
        raise PlanInputError(f"{source}: expected a non-empty list of jobs ([[jobs]] tables)")
    out = []
    for i, raw in enumerate(items):
        if not isinstance(raw, Mapping):
            raise PlanInputError(f"{source}: job {i + 1}: expected a table")
        out.append(_job_from(raw, f"{source}: job {raw.get('name', i + 1)}"))
    return out


def job_from_flag(text: str) -> FleetJob:
    """``"nodes=64,size=20GB,interval=30min[,count=10][,name=llm]"`` (``--job``)."""
    raw: Dict[str, Any] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise PlanInputError(
                f"--job {text!r}: expected key=value pairs such as nodes=64,size=20GB,"
                "interval=30min"
            )
        key, value = key.strip(), value.strip()
        if key in ("nodes", "count"):
            try:
                raw[key] = int(value)
            except ValueError:
                raise PlanInputError(f"--job {text!r}: {key} must be a whole number") from None
        else:
            raw[key] = value
    return _job_from(raw, f"--job {text!r}")
