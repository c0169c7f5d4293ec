"""Fleet simulation: 10,000 nodes in 500 jobs checkpointing to a 1 TB/s PFS, with and
without admission control, event by event, with the real admission code.

    /opt/slurm-ckpt/venv/bin/python benchmarks/fleet_sim.py            # 1k, 5k, 10k nodes
    /opt/slurm-ckpt/venv/bin/python benchmarks/fleet_sim.py --nodes 10000 --png out.png

What is simulated
-----------------
* **Jobs**: ``nodes / 20`` jobs whose node counts follow a heavy-tailed (log-normal) mix
  summing to ``nodes``; each saves 1-50 GB per node (uniform, per job) every 15, 30 or 60
  minutes (+-10 % from one checkpoint to the next: steps vary), from a random phase; all
  nodes of a job save at the same step.
* **PFS**: 100 MB/s per node of the cluster (1 TB/s at 10,000 nodes: the same PFS per
  node at every size, so that per-node figures compare); other tenants ask for 40 % of
  it all the time. A node flushes at up to 5 GB/s. When demand passes the PFS's
  bandwidth, every stream is slowed in proportion (flows share a saturated PFS in
  proportion to what they ask), so all checkpoint flows move at one rate and the
  simulation tracks them in "virtual bytes" (processor sharing: O(log n) per event).
* **Without admission** (today): every node flushes the moment its save is committed.
* **With admission**: :class:`slurm_ckpt.admission.decisions.Admission` over a
  :class:`~slurm_ckpt.admission.state.MemoryStore` on a
  :class:`~slurm_ckpt.admission.state.SimClock`: the same decision code as on the PFS, with
  the cap and jitter that ``ckpt-slurm plan --cluster`` recommends for a 70 % share. A
  waiter is woken when a slot frees up (the real one polls every ``admission.poll``).

Reported (a table, ``--json``, and a PNG): peak checkpoint demand on the PFS, p50/p99 of
the flush time of a node (save committed -> on the PFS) and of a job (save -> its last
node on the PFS), the mean wait for a slot, data at risk (bytes only on node-local
disks: mean and peak), other tenants' bandwidth (the least they got, and the mean over
the time checkpoints were flushing), and the admission work per flush (store
transactions and queue entries examined): constant as the cluster grows. Beside it, the
planner's figures for the same inputs. Seeded: the same seed gives the same figures.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from slurm_ckpt.admission.decisions import Admission, Ticket  # noqa: E402
from slurm_ckpt.admission.policy import AdmissionPolicy, Priority  # noqa: E402
from slurm_ckpt.admission.state import MemoryStore, SimClock  # noqa: E402
from slurm_ckpt.core.fleet_plan import ClusterPlan, FleetJob, plan_cluster  # noqa: E402

GB = 1e9
PFS_PER_NODE = 0.1 * GB  # 1 TB/s at 10,000 nodes
NODE_BW = 5 * GB
TENANT_SHARE = 0.4
SHARE = 0.7
INTERVALS = (900.0, 1800.0, 3600.0)
NODES_PER_JOB = 20
SPREAD = 0.1


def make_jobs(nodes: int, seed: int, jobs: Optional[int] = None) -> List[FleetJob]:
    """The job mix: ``jobs`` (default nodes/20) jobs, log-normal sizes summing to nodes."""
    rng = random.Random(seed)
    count = jobs or max(1, nodes // NODES_PER_JOB)
    weights = [rng.lognormvariate(0.0, 1.2) for _ in range(count)]
    total = sum(weights)
    sizes = [max(1, round(nodes * w / total)) for w in weights]
    diff = nodes - sum(sizes)
    order = sorted(range(count), key=lambda i: -sizes[i])
    i = 0
    while diff != 0:  # hand the rounding error to the biggest jobs
        j = order[i % count]
        step = 1 if diff > 0 else -1
        if sizes[j] + step >= 1:
            sizes[j] += step
            diff -= step
        i += 1
    return [
        FleetJob(
            name=f"job{i}",
            nodes=n,
            bytes_per_node=rng.uniform(1.0, 50.0) * GB,
            interval_s=rng.choice(INTERVALS),
        )
        for i, n in enumerate(sizes)
    ]


@dataclass
class SimResult:
    """One run's figures (times in seconds, bandwidths in bytes/s)."""

    mode: str
    nodes: int
    jobs: int
    pfs_bw: float
    flushes: int
    refused: int
    utilisation: float
    peak_demand: float
    peak_throughput: float
    node_flush_p50: float
    node_flush_p99: float
    node_flush_mean: float
    job_flush_p50: float
    job_flush_p99: float
    job_flush_mean: float
    wait_mean: float
    wait_p99: float
    at_risk_mean: float
    at_risk_peak: float
    tenant_min_share: float
    tenant_busy_share: float
    ops_per_flush: float
    examined_per_flush: float
    wall_s: float
    cap: Optional[int] = None
    jitter_s: Optional[float] = None
    series: List[Tuple[float, float, float]] = field(default_factory=list, repr=False)
    #: Mean wait for a slot and mean flush time per job (index into the jobs).
    job_wait: Dict[int, float] = field(default_factory=dict, repr=False)
    job_flush: Dict[int, float] = field(default_factory=dict, repr=False)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    i = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[i]


def simulate(
    jobs: Sequence[FleetJob],
    pfs_bw: float,
    node_bw: float,
    tenants: float,
    horizon: float,
    seed: int,
    policy: Optional[AdmissionPolicy] = None,
    series_window: Optional[Tuple[float, float]] = None,
) -> SimResult:
    """Run one simulation; see the module docstring. ``series_window`` records
    ``(t, checkpoint demand, tenant throughput)`` at every change inside it."""
    t_wall = time.perf_counter()
    rng = random.Random(seed)
    clock = SimClock(0.0)
    store = MemoryStore()
    adms: Dict[int, Admission] = {}

    def adm_of(node: int) -> Admission:
        a = adms.get(node)
        if a is None:
            a = Admission(
                policy,  # type: ignore[arg-type]
                store,
                f"n{node}",
                clock=clock.now,
                sleep=clock.sleep,
                rng=random.Random(seed * 1_000_003 + node),
            )
            adms[node] = a
        return a

    # Node ids per job, and the first checkpoint of every job at a random phase.
    first_node, nid = [], 0
    for j in jobs:
        first_node.append(nid)
        nid += j.nodes
    events: List[Tuple[float, int, int, int]] = []  # (t, seq, kind, arg)
    seq = 0
    CKPT, ASK, EXPIRE = 0, 1, 2
    for ji, j in enumerate(jobs):
        heapq.heappush(events, (rng.uniform(0.0, j.interval_s), seq, CKPT, ji))
        seq += 1

    # Flush records (parallel lists: fast), job-checkpoint records.
    f_job: List[int] = []
    f_round: List[int] = []
    f_bytes: List[float] = []
    f_save: List[float] = []
    f_ask: List[float] = []
    f_grant: List[float] = []
    f_done: List[float] = []
    tickets: Dict[int, Ticket] = {}
    waiting: Dict[str, int] = {}
    rounds: Dict[Tuple[int, int], List[int]] = {}  # (job, round) -> [left, ...]
    round_start: Dict[Tuple[int, int], float] = {}
    round_end: Dict[Tuple[int, int], float] = {}
    round_no = [0] * len(jobs)

    active: List[Tuple[float, int]] = []  # (finish in virtual bytes, flush id)
    V = 0.0
    t = 0.0
    at_risk = 0.0
    at_risk_area = peak_risk = 0.0
    peak_demand = peak_thr = 0.0
    tenant_min = math.inf
    busy_time = busy_tenant = 0.0
    moved = 0.0
    refused = 0
    series: List[Tuple[float, float, float]] = []

    def rate(n: int) -> float:
        return node_bw * min(1.0, pfs_bw / (tenants + n * node_bw)) if n else 0.0

    def start(fid: int) -> None:
        f_grant[fid] = t
        heapq.heappush(active, (V + f_bytes[fid], fid))

    def wake() -> None:
        if not waiting:
            return
        for eid in next(iter(adms.values())).admissible():
            fid = waiting.pop(eid)
            d = adm_of(fid).poll(tickets[fid])
            assert d.admitted, d
            start(fid)

    while events or active:
        n = len(active)
        rho = rate(n)
        t_ev = events[0][0] if events else math.inf
        t_fin = t + (active[0][0] - V) / rho if active else math.inf
        t_next = min(t_ev, t_fin)
        dt = t_next - t
        if dt > 0:
            demand = n * node_bw
            tenant = tenants * min(1.0, pfs_bw / (tenants + demand)) if tenants else 0.0
            at_risk_area += at_risk * dt
            moved += n * rho * dt
            if n:
                busy_time += dt
                busy_tenant += tenant * dt
                tenant_min = min(tenant_min, tenant)
            if series_window and series_window[0] <= t <= series_window[1]:
                series.append((t, demand, tenant))
        V += rho * dt
        t = t_next
        clock.advance_to(t)
        if t_fin <= t_ev:
            limit = V + 1.0  # a byte of slack for rounding
            released = False
            while active and active[0][0] <= limit:
                _, fid = heapq.heappop(active)
                f_done[fid] = t
                at_risk -= f_bytes[fid]
                key = (f_job[fid], f_round[fid])
                rounds[key][0] -= 1
                if rounds[key][0] == 0:
                    round_end[key] = t
                if policy is not None:
                    adm_of(fid).release(tickets.pop(fid))
                    released = True
            if released:
                wake()
        else:
            _, _, kind, arg = heapq.heappop(events)
            if kind == CKPT:
                j = jobs[arg]
                key = (arg, round_no[arg])
                round_no[arg] += 1
                rounds[key] = [j.nodes]
                round_start[key] = t
                for k in range(j.nodes):
                    fid = len(f_job)
                    f_job.append(arg)
                    f_round.append(key[1])
                    f_bytes.append(j.bytes_per_node)
                    f_save.append(t)
                    f_ask.append(t)
                    f_grant.append(math.nan)
                    f_done.append(math.nan)
                    at_risk += j.bytes_per_node
                    if policy is None:
                        start(fid)
                    else:
                        # Flush id == node id of this job's k-th node for the admission
                        # object: one Admission (and one jitter rng) per node.
                        node = first_node[arg] + k
                        adm = adm_of(node)
                        adms[fid] = adm
                        heapq.heappush(events, (t + adm.start_delay(), seq, ASK, fid))
                        seq += 1
                peak_risk = max(peak_risk, at_risk)
                # Steps vary in length, so the period does too (+-10 %, mean T): jobs
                # drift against each other instead of colliding at the same phase forever.
                nxt = t + j.interval_s * rng.uniform(1.0 - SPREAD, 1.0 + SPREAD)
                if nxt < horizon:
                    heapq.heappush(events, (nxt, seq, CKPT, arg))
                    seq += 1
            elif kind == ASK:
                fid = arg
                f_ask[fid] = t
                j = jobs[f_job[fid]]
                tk = adm_of(fid).request(Priority.ROUTINE, rate=node_bw, budget=j.interval_s)
                tickets[fid] = tk
                waiting[tk.id] = fid
                heapq.heappush(events, (tk.deadline, seq, EXPIRE, fid))
                seq += 1
                wake()
            else:  # EXPIRE: the budget ran out before a slot came
                fid = arg
                tk = tickets.get(fid)
                if tk is not None and tk.id in waiting:
                    d = adm_of(fid).poll(tk)
                    if d.expired:
                        del waiting[tk.id]
                        del tickets[fid]
                        refused += 1
                        at_risk -= f_bytes[fid]
                    elif d.admitted:
                        del waiting[tk.id]
                        start(fid)
        peak_demand = max(peak_demand, len(active) * node_bw)
        peak_thr = max(peak_thr, len(active) * rate(len(active)))

    done = [i for i in range(len(f_job)) if not math.isnan(f_done[i])]
    node_flush = [f_done[i] - f_save[i] for i in done]
    waits = [f_grant[i] - f_ask[i] for i in done]
    job_flush = [round_end[k] - round_start[k] for k in round_end]
    flushes = len(f_job)
    per_wait: Dict[int, List[float]] = {}
    for i in done:
        per_wait.setdefault(f_job[i], []).append(f_grant[i] - f_ask[i])
    per_flush: Dict[int, List[float]] = {}
    for key, end in round_end.items():
        per_flush.setdefault(key[0], []).append(end - round_start[key])
    return SimResult(
        mode="admission" if policy is not None else "none",
        nodes=sum(j.nodes for j in jobs),
        jobs=len(jobs),
        pfs_bw=pfs_bw,
        flushes=flushes,
        refused=refused,
        utilisation=sum(f_bytes) / (horizon * pfs_bw),
        peak_demand=peak_demand,
        peak_throughput=peak_thr,
        node_flush_p50=_pct(node_flush, 0.5),
        node_flush_p99=_pct(node_flush, 0.99),
        node_flush_mean=sum(node_flush) / max(1, len(node_flush)),
        job_flush_p50=_pct(job_flush, 0.5),
        job_flush_p99=_pct(job_flush, 0.99),
        job_flush_mean=sum(job_flush) / max(1, len(job_flush)),
        wait_mean=sum(waits) / max(1, len(waits)),
        wait_p99=_pct(waits, 0.99),
        at_risk_mean=at_risk_area / t if t > 0 else 0.0,
        at_risk_peak=peak_risk,
        tenant_min_share=(tenant_min if tenant_min < math.inf else tenants) / pfs_bw,
        tenant_busy_share=(busy_tenant / busy_time if busy_time else tenants) / pfs_bw,
        ops_per_flush=(store.ops / flushes) if policy is not None and flushes else 0.0,
        examined_per_flush=(store.state.examined / flushes) if policy is not None else 0.0,
        wall_s=time.perf_counter() - t_wall,
        cap=None if policy is None else policy.max_nodes,
        jitter_s=None if policy is None else policy.jitter,
        series=series,
        job_wait={j: sum(v) / len(v) for j, v in per_wait.items()},
        job_flush={j: sum(v) / len(v) for j, v in per_flush.items()},
    )


def run_pair(
    nodes: int, seed: int, hours: float, window: Optional[Tuple[float, float]] = None
) -> Tuple[SimResult, SimResult, ClusterPlan]:
    """Without and with admission on one site of ``nodes``, plus the planner's view."""
    jobs = make_jobs(nodes, seed)
    pfs = nodes * PFS_PER_NODE
    tenants = TENANT_SHARE * pfs
    plan = plan_cluster(jobs, pfs, NODE_BW, share=SHARE, tenants=tenants)
    policy = AdmissionPolicy(max_nodes=plan.cap, jitter=plan.jitter_s, lease=60.0, poll=1.0)
    horizon = hours * 3600.0
    base = simulate(jobs, pfs, NODE_BW, tenants, horizon, seed, None, window)
    adm = simulate(jobs, pfs, NODE_BW, tenants, horizon, seed, policy, window)
    return base, adm, plan


def _table(rows: List[Tuple[SimResult, ClusterPlan]]) -> str:
    head = (
        f"{'nodes':>6} {'admission':>14} {'peak demand':>12} {'node p50/p99 s':>15} "
        f"{'job p50/p99 s':>15} {'wait s':>7} {'at risk TB':>11} {'tenants min/busy':>17} "
        f"{'ops/flush':>9} {'examined/flush':>14}"
    )
    out = [head, "-" * len(head)]
    for r, _plan in rows:
        mode = "none" if r.cap is None else f"cap {r.cap}, J {r.jitter_s:.0f}s"
        out.append(
            f"{r.nodes:>6} {mode:>14} {r.peak_demand / r.pfs_bw:>11.0%} "
            f"{r.node_flush_p50:>7.1f}/{r.node_flush_p99:<7.1f} "
            f"{r.job_flush_p50:>7.1f}/{r.job_flush_p99:<7.1f} {r.wait_mean:>7.2f} "
            f"{r.at_risk_mean / 1e12:>5.1f}/{r.at_risk_peak / 1e12:<5.1f} "
            f"{r.tenant_min_share:>8.0%}/{r.tenant_busy_share:<8.0%} "
            f"{r.ops_per_flush:>9.2f} {r.examined_per_flush:>14.2f}"
        )
    return "\n".join(out)


def _chart(path: Path, pairs: List[Tuple[SimResult, SimResult, ClusterPlan]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    big_base, big_adm, _ = max(pairs, key=lambda p: p[0].nodes)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    for r, label, color in (
        (big_base, "no admission", "tab:red"),
        (big_adm, "admission", "tab:blue"),
    ):
        if r.series:
            ts = [s[0] / 60 for s in r.series]
            ax.step(
                ts,
                [s[1] / r.pfs_bw * 100 for s in r.series],
                where="post",
                color=color,
                label=f"checkpoint demand, {label}",
                linewidth=0.8,
            )
    ax.axhline(100, color="black", linewidth=0.8, linestyle=":")
    ax.axhline(SHARE * 100, color="tab:blue", linewidth=0.8, linestyle="--", label="70 % share")
    ax.set_xlabel("time (min)")
    ax.set_ylabel("% of PFS bandwidth asked for")
    ax.set_title(f"{big_base.nodes:,} nodes: checkpoint demand on the PFS")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for r, label, color in (
        (big_base, "no admission", "tab:red"),
        (big_adm, "admission", "tab:blue"),
    ):
        if r.series:
            ts = [s[0] / 60 for s in r.series]
            ax.step(
                ts,
                [s[2] / r.pfs_bw * 100 for s in r.series],
                where="post",
                color=color,
                label=label,
                linewidth=0.8,
            )
    ax.set_ylim(0, TENANT_SHARE * 100 * 1.1)
    ax.set_xlabel("time (min)")
    ax.set_ylabel("% of PFS bandwidth")
    ax.set_title("other tenants' bandwidth (they ask for 40 %)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    xs = [p[0].nodes for p in pairs]
    ax.plot(
        xs,
        [p[0].node_flush_p99 for p in pairs],
        "o-",
        color="tab:red",
        label="p99 node flush, no admission",
    )
    ax.plot(
        xs,
        [p[1].node_flush_p99 for p in pairs],
        "o-",
        color="tab:blue",
        label="p99 node flush, admission",
    )
    ax.plot(
        xs,
        [p[1].job_flush_p99 for p in pairs],
        "s--",
        color="tab:blue",
        label="p99 job flush, admission",
    )
    ax.plot(
        xs,
        [p[0].job_flush_p99 for p in pairs],
        "s--",
        color="tab:red",
        label="p99 job flush, no admission",
    )
    ax.set_xlabel("nodes")
    ax.set_ylabel("seconds")
    ax.set_title("flush completion (save -> on the PFS)")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(xs, [p[1].ops_per_flush for p in pairs], "o-", label="store transactions / flush")
    ax.plot(
        xs, [p[1].examined_per_flush for p in pairs], "s-", label="queue entries examined / flush"
    )
    ax.set_ylim(0, max(p[1].examined_per_flush for p in pairs) * 1.5)
    ax.set_xlabel("nodes")
    ax.set_title("admission work per node flush")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1000,5000,10000", help="comma-separated sizes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hours", type=float, default=2.0, help="simulated time")
    ap.add_argument("--png", default=str(REPO / "benchmarks" / "fleet_sim.png"))
    ap.add_argument("--json", dest="json_path", default=None, help="also write the figures")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    pairs = []
    for n in sizes:
        window = (1800.0, 3000.0) if n == max(sizes) else None
        base, adm, plan = run_pair(n, args.seed, args.hours, window)
        pairs.append((base, adm, plan))
        print(
            f"simulated {n:,} nodes ({base.flushes:,} flushes each way) in "
            f"{base.wall_s + adm.wall_s:.1f}s",
            file=sys.stderr,
        )
    rows = [(r, p[2]) for p in pairs for r in p[:2]]
    print(_table(rows))
    print()
    print(
        "planner (ckpt-slurm plan --cluster) on the same inputs vs the simulation with admission:"
    )
    for _base, adm, plan in pairs:
        print(
            f"  {adm.nodes:>6} nodes: utilisation {plan.utilisation:.1%} "
            f"(sim {adm.utilisation:.1%}), "
            f"mean node flush {plan.mean_flush_s:.1f}s (sim {adm.node_flush_mean:.1f}s), "
            f"mean job flush {plan.mean_job_flush_s:.1f}s (sim {adm.job_flush_mean:.1f}s), "
            f"peak demand {plan.peak_demand_capped / plan.pfs_bw:.0%} "
            f"(sim {adm.peak_demand / adm.pfs_bw:.0%})"
        )
    if args.png:
        _chart(Path(args.png), pairs)
        print(f"chart written to {args.png}")
    if args.json_path:
        doc = [
            {"sim": {k: v for k, v in asdict(r).items() if k != "series"}, "plan": p.to_dict()}
            for r, p in rows
        ]
        for d in doc:
            d["plan"].pop("per_job", None)
        Path(args.json_path).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
