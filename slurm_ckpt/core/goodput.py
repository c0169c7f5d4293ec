"""Goodput of a checkpoint strategy: what failures cost a job, per strategy, at scale.

Pure arithmetic, beside :mod:`slurm_ckpt.core.planner` (whose size, write-time and
Young/Daly functions it uses). Why a second model: the planner sizes *one* strategy
(local + PFS). Whether partner copies or a restart inside the allocation pay off is a
question of how the *cost of a failure* grows with the node count, so here four
strategies are set side by side from the same stated inputs:

``pfs_only``
    every save goes synchronously to the PFS (the stall is the whole PFS write);
``local_pfs``
    save to node-local NVMe (the stall is the snapshot, or the local write), copy every
    ``flush_every``-th checkpoint to the PFS in the background;
``local_partner_pfs``
    the same, plus a copy of each node's part on a partner node's NVMe (background,
    at ``partner_bw``): a lost node's part comes back from its partner;
``in_allocation``
    partner copies, and the job relaunches its step on a spare node inside its own
    allocation instead of going back through the queue;
``in_job``
    recovery inside the job, from memory: the newest state stays in host memory and is
    copied to the partner's memory every ``ram_interval_s`` (the RAM tier); the job
    finds a lost node itself in ``detect_s`` (heartbeats, not SLURM's timeout), the
    survivors keep their processes (no start-up), a hot spare takes the lost rank's
    place, the group re-forms in ``reform_s``, and the spare reads the lost node's part
    from its partner's memory. Every failure, disk lost or not, loses at most the RAM
    copy's interval and lag; the RAM tier itself costs ``ram_cost`` of the step time.
    The NVMe -> PFS path keeps its own interval (what covers a lost partner pair).

The failure model (stated once):

* interrupts are Poisson with mean ``M = node_mtbf / nodes`` (the job fails when any
  node does); a share ``node_loss_share`` of them takes a node's local data with it
  (a dead node, a dead disk), the rest leave every local tier intact (software crash,
  a GPU that stops answering, preemption);
* a failure lands uniformly inside a checkpoint period ``T`` and throws away ``T/2`` of
  progress when the newest checkpoint survives; when only every ``k``-th survives,
  ``k*T/2`` plus the lag ``L`` until that copy is committed (the planner's rule);
* all ranks resume at one step, so a lost node's part decides the step for everyone;
* resuming costs the queue wait (a requeue; ``relaunch_s`` inside the allocation), the
  job's start-up ``init_s``, and reading one node's part from the tier it comes from:
  ``bytes_per_node / min(bandwidth)`` (every node reads its own part in parallel);
* losing a node *and* its partner before the partner copy reached the PFS is ignored:
  its probability is of second order in ``T/M``;
* goodput is the share of wall time that is useful training:
  ``(1 - W/M) * T/(T + C)``, with ``W`` the expected waste per failure (lost progress
  plus time to resume) and ``C`` the stall per save; it is 0 when ``W >= M``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, List, Optional

from slurm_ckpt.core.planner import PlanInputError, daly_interval, flush_every

__all__ = [
    "STRATEGIES",
    "GoodputInputs",
    "StrategyResult",
    "compare_strategies",
    "lost_gpu_hours",
]

#: The strategies, in the order they are shown.
STRATEGIES = ("pfs_only", "local_pfs", "local_partner_pfs", "in_allocation", "in_job")
DESCRIPTIONS = {
    "pfs_only": "PFS only (synchronous save)",
    "local_pfs": "local + PFS",
    "local_partner_pfs": "local + partner + PFS",
    "in_allocation": "local + partner + PFS, restart in the allocation",
    "in_job": "RAM tier + partner memory, in-job recovery with a hot spare",
}


@dataclass(frozen=True)
class GoodputInputs:
    """Everything the comparison needs; sizes in bytes, rates in bytes/s, times in s."""

    checkpoint_bytes: int
    nodes: int
    node_mtbf_s: float
    pfs_bw: float  # the job's aggregate PFS bandwidth
    local_bw: float  # one node's NVMe
    partner_bw: Optional[float] = None  # one node's share of the network; default local_bw
    pfs_node_bw: Optional[float] = None  # one node's PFS read rate; default pfs_bw
    sharded: bool = True
    stall_s: Optional[float] = None  # async snapshot stall; default: the local write
    node_loss_share: float = 0.5
    queue_wait_s: float = 600.0
    relaunch_s: float = 60.0
    init_s: float = 120.0
    max_loss_s: Optional[float] = None
    ram_interval_s: float = 30.0  # in_job: time between two RAM snapshots
    detect_s: float = 10.0  # in_job: heartbeat timeout
    reform_s: float = 30.0  # in_job: the process group re-formed with the spare
    ram_cost: float = 0.02  # in_job: share of step time the RAM tier costs

    def __post_init__(self) -> None:
        for name in ("checkpoint_bytes", "nodes", "node_mtbf_s", "pfs_bw", "local_bw"):
            v = float(getattr(self, name))
            if not math.isfinite(v) or v <= 0:
                raise PlanInputError(f"{name}: must be positive, got {getattr(self, name)!r}")
        for name in ("queue_wait_s", "relaunch_s", "init_s", "detect_s", "reform_s"):
            v = float(getattr(self, name))
            if not math.isfinite(v) or v < 0:
                raise PlanInputError(f"{name}: must not be negative, got {v!r}")
        v = float(self.ram_interval_s)
        if not math.isfinite(v) or v <= 0:
            raise PlanInputError(f"ram interval: must be positive, got {self.ram_interval_s!r}")
        if not 0.0 <= self.ram_cost < 1.0:
            raise PlanInputError(f"ram cost: must be a share below 100%, got {self.ram_cost!r}")
        if not 0.0 <= self.node_loss_share <= 1.0:
            raise PlanInputError(
                f"node loss share: must be between 0 and 1, got {self.node_loss_share!r}"
            )

    @property
    def mtbi_s(self) -> float:
        return self.node_mtbf_s / self.nodes

    @property
    def bytes_per_node(self) -> float:
        return self.checkpoint_bytes / self.nodes if self.sharded else self.checkpoint_bytes


@dataclass(frozen=True)
class StrategyResult:
    """One strategy's figures (times in seconds)."""

    strategy: str
    description: str
    stall_s: float
    interval_s: float
    flush_every: int
    loss_per_failure_s: float  # expected progress lost per failure
    resume_s: float  # expected time from the failure to training again
    waste_per_failure_s: float
    failures_per_day: float
    goodput: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _interval(cost: float, inp: GoodputInputs) -> float:
    t = daly_interval(cost, inp.mtbi_s)
    if inp.max_loss_s is not None:
        t = min(t, inp.max_loss_s)
    return t


def _lagged_loss(interval: float, copy_s: float) -> float:
    """Expected progress lost when the newest surviving copy is one made in the
    background at ``copy_s`` per checkpoint: every ``k``-th one, ``L = copy_s`` late."""
    k = flush_every(copy_s, interval)
    return k * interval / 2.0 + copy_s


def compare_strategies(inp: GoodputInputs) -> List[StrategyResult]:
    """The strategies of the module docstring, from the same inputs."""
    per_node = inp.bytes_per_node
    pfs_write = inp.checkpoint_bytes / inp.pfs_bw
    local_write = per_node / inp.local_bw
    partner_bw = inp.partner_bw or inp.local_bw
    partner_write = per_node / partner_bw
    read_local = per_node / inp.local_bw
    read_pfs = max(per_node / (inp.pfs_node_bw or inp.pfs_bw), pfs_write / inp.nodes)
    read_partner = per_node / min(partner_bw, inp.local_bw)
    p = inp.node_loss_share
    async_stall = local_write if inp.stall_s is None else inp.stall_s
    out = []
    for name in STRATEGIES:
        cost = 0.0  # share of step time lost besides the saves' stalls
        if name == "in_job":
            cost = inp.ram_cost
            stall = async_stall
            t = _interval(stall, inp)
            n_flush = flush_every(pfs_write, t)
            # A RAM copy is taken every ram_interval_s (no sooner than the last one is
            # across: the RAM tier waits for it) and counts once it is in the partner's
            # memory; survivors read theirs from their own memory, the spare its part
            # over the network.
            ram_copy = per_node / partner_bw
            loss = _lagged_loss(max(inp.ram_interval_s, ram_copy), ram_copy)
            resume = inp.detect_s + inp.reform_s + per_node / partner_bw
        elif name == "pfs_only":
            stall = pfs_write
            t = _interval(stall, inp)
            n_flush = 1
            loss = t / 2.0
            resume = inp.queue_wait_s + inp.init_s + read_pfs
        else:
            stall = async_stall
            t = _interval(stall, inp)
            n_flush = flush_every(pfs_write, t)
            survive_loss = t / 2.0
            if name == "local_pfs":
                lost_loss = _lagged_loss(t, pfs_write)
                lost_read = read_pfs
            else:
                lost_loss = min(_lagged_loss(t, partner_write), _lagged_loss(t, pfs_write))
                lost_read = read_partner
            loss = (1 - p) * survive_loss + p * lost_loss
            start = inp.relaunch_s if name == "in_allocation" else inp.queue_wait_s
            resume = start + inp.init_s + (1 - p) * read_local + p * lost_read
        waste = loss + resume
        good = max(0.0, 1.0 - waste / inp.mtbi_s) * t / (t + stall) * (1.0 - cost)
        out.append(
            StrategyResult(
                strategy=name,
                description=DESCRIPTIONS[name],
                stall_s=stall,
                interval_s=t,
                flush_every=n_flush,
                loss_per_failure_s=loss,
                resume_s=resume,
                waste_per_failure_s=waste,
                failures_per_day=86400.0 / inp.mtbi_s,
                goodput=good,
            )
        )
    return out


def lost_gpu_hours(result: StrategyResult, gpus: int, days: float) -> float:
    """GPU-hours a run of ``days`` on ``gpus`` GPUs spends on anything but training."""
    return (1.0 - result.goodput) * gpus * days * 24.0
