"""``ckpt-slurm plan --strategies``: goodput of five checkpoint strategies side by side.

The model is :mod:`slurm_ckpt.core.goodput`; this module turns the ``plan`` command's
options into its inputs and prints one row per strategy (or ``--json``/``--parsable``).
The click options live on the ``plan`` command in :mod:`slurm_ckpt.cli.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slurm_ckpt.cli.output import print_json
from slurm_ckpt.cli.plan_cluster import parse_share
from slurm_ckpt.cli.table import Column, Listing, OutputFormat
from slurm_ckpt.core.goodput import GoodputInputs, compare_strategies, lost_gpu_hours
from slurm_ckpt.core.planner import PlanInputError, checkpoint_size, parse_count
from slurm_ckpt.core.units import format_duration, parse_bandwidth, parse_duration, parse_size
from slurm_ckpt.errors import CkptError

__all__ = ["StrategyOptions", "checkpoint_bytes", "run_strategy_plan"]


@dataclass
class StrategyOptions:
    """The ``plan`` options that only ``--strategies`` reads (strings as typed)."""

    node_mtbf: Optional[str] = None
    node_loss_share: Optional[str] = None
    queue_wait: Optional[str] = None
    relaunch: Optional[str] = None
    init: Optional[str] = None
    partner_bw: Optional[str] = None
    pfs_node_bw: Optional[str] = None
    gpus_per_node: Optional[str] = None
    days: Optional[str] = None
    gpu_hour_cost: Optional[str] = None
    ram_interval: Optional[str] = None
    detect: Optional[str] = None
    reform: Optional[str] = None
    ram_cost: Optional[str] = None


def _pct(text: Optional[str], default: float, what: str) -> float:
    if text is None:
        return default
    try:
        return parse_share(text)
    except PlanInputError:
        raise PlanInputError(f"{what}: expected a share such as 50%, got {text!r}") from None


def _count(text: Optional[str], default: float, what: str) -> float:
    return default if text is None else parse_count(text, what)


def checkpoint_bytes(
    params: Optional[str],
    size: Optional[str],
    precision: str,
    optimizer: str,
    master_weights: Optional[bool],
) -> int:
    """The checkpoint's bytes from ``--params`` (sized as the planner does) or ``--size``."""
    if (params is None) == (size is None):
        raise PlanInputError("give either the parameter count (--params) or the size (--size)")
    if params is not None:
        return checkpoint_size(
            parse_count(params, "--params"), precision, optimizer, master_weights
        ).total
    try:
        n = parse_size(size, "--size")
    except CkptError as exc:
        raise PlanInputError(str(exc)) from None
    if n <= 0:
        raise PlanInputError(f"--size: must be positive, got {size!r}")
    return n


def _as_bandwidth(text: str, what: str) -> float:
    try:
        return parse_bandwidth(text, what)
    except CkptError as exc:  # a usage error here (exit 2), as everywhere in plan
        raise PlanInputError(str(exc)) from None


def _as_duration(text: str, what: str, positive: bool = True) -> float:
    try:
        s = parse_duration(text, what)
    except CkptError as exc:
        raise PlanInputError(str(exc)) from None
    if positive and s <= 0:
        raise PlanInputError(f"{what}: must be positive, got {text!r}")
    return s


def _dur(seconds: float) -> str:
    return format_duration(seconds)


COLUMNS = [
    Column("strategy", "strategy", human=False),
    Column("description", "strategy", parsable=False, wrap=True),
    Column("stall_s", "stall/save", fmt=_dur, right=True),
    Column("interval_s", "interval", fmt=_dur, right=True),
    Column("loss_per_failure_s", "loss/failure", fmt=_dur, right=True),
    Column("resume_s", "resume", fmt=_dur, right=True),
    Column("goodput", "goodput", fmt=lambda g: f"{100 * g:.1f}%", right=True),
    Column("lost_gpu_hours", "lost GPU-h", fmt=lambda h: f"{h:,.0f}", right=True, drop=1),
    Column(
        "lost_cost",
        "lost cost",
        fmt=lambda c: "-" if c is None else f"{c:,.0f}",
        drop=2,
        right=True,
    ),
]


def run_strategy_plan(
    *,
    size_bytes: int,
    nodes: int,
    sharded: bool,
    mtbi: Optional[str],
    pfs_bw: str,
    local_bw: Optional[str],
    stall: Optional[str],
    max_loss: Optional[str],
    opts: StrategyOptions,
    out: OutputFormat,
) -> None:
    """Compare the strategies and print them. ``--node-mtbf`` (one node's mean time
    between failures) or ``--mtbi`` (the whole job's) sets the failure rate."""
    if local_bw is None:
        raise PlanInputError("plan --strategies: --local-bw is required (NVMe per node)")
    if opts.node_mtbf is not None and mtbi is not None:
        raise PlanInputError("plan --strategies: give --node-mtbf or --mtbi, not both")
    if opts.node_mtbf is not None:
        node_mtbf = _as_duration(opts.node_mtbf, "--node-mtbf")
    elif mtbi is not None:
        node_mtbf = _as_duration(mtbi, "--mtbi") * nodes
    else:
        raise PlanInputError(
            "plan --strategies: give --node-mtbf (one node's MTBF, e.g. 150d) or --mtbi"
        )
    inp = GoodputInputs(
        checkpoint_bytes=size_bytes,
        nodes=nodes,
        node_mtbf_s=node_mtbf,
        pfs_bw=_as_bandwidth(pfs_bw, "--pfs-bw"),
        local_bw=_as_bandwidth(local_bw, "--local-bw"),
        partner_bw=None
        if opts.partner_bw is None
        else _as_bandwidth(opts.partner_bw, "--partner-bw"),
        pfs_node_bw=None
        if opts.pfs_node_bw is None
        else _as_bandwidth(opts.pfs_node_bw, "--pfs-node-bw"),
        sharded=sharded,
        stall_s=None if stall is None else _as_duration(stall, "--stall"),
        node_loss_share=_pct(opts.node_loss_share, 0.5, "--node-loss-share"),
        queue_wait_s=600.0
        if opts.queue_wait is None
        else _as_duration(opts.queue_wait, "--queue-wait", positive=False),
        relaunch_s=60.0
        if opts.relaunch is None
        else _as_duration(opts.relaunch, "--relaunch", positive=False),
        init_s=120.0 if opts.init is None else _as_duration(opts.init, "--init", positive=False),
        max_loss_s=None if max_loss is None else _as_duration(max_loss, "--max-loss"),
        ram_interval_s=30.0
        if opts.ram_interval is None
        else _as_duration(opts.ram_interval, "--ram-interval"),
        detect_s=10.0
        if opts.detect is None
        else _as_duration(opts.detect, "--detect", positive=False),
        reform_s=30.0
        if opts.reform is None
        else _as_duration(opts.reform, "--reform", positive=False),
        ram_cost=_pct(opts.ram_cost, 0.02, "--ram-cost"),
    )
    gpus = int(_count(opts.gpus_per_node, 8, "--gpus-per-node")) * nodes
    days = _count(opts.days, 30, "--days")
    price = None if opts.gpu_hour_cost is None else _count(opts.gpu_hour_cost, 0, "--gpu-hour-cost")
    rows = []
    for r in compare_strategies(inp):
        d = r.to_dict()
        d["lost_gpu_hours"] = lost_gpu_hours(r, gpus, days)
        d["lost_cost"] = None if price is None else d["lost_gpu_hours"] * price
        rows.append(d)
    if out.json:
        print_json(
            {
                "nodes": nodes,
                "gpus": gpus,
                "days": days,
                "mtbi_s": inp.mtbi_s,
                "node_mtbf_s": node_mtbf,
                "node_loss_share": inp.node_loss_share,
                "strategies": rows,
            }
        )
        return
    title = (
        f"goodput of {gpus:,} GPUs on {nodes:,} nodes over {days:g} days "
        f"(a failure every {format_duration(inp.mtbi_s)})"
    )
    Listing(COLUMNS, rows, title).print(out)
