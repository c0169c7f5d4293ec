"""``ckpt-slurm plan``: size checkpoints, time the tiers, choose the save interval.

The arithmetic lives in :mod:`slurm_ckpt.core.planner`; this module only parses options,
prints a table (:mod:`slurm_ckpt.cli.table`) or JSON, and optionally draws a plot
(matplotlib, if installed). Warnings go to stderr.
Bad input is reported as one line ``ckpt-slurm: error: ...`` on stderr with exit code 2,
also when the command is invoked on its own (tests, other groups).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import click

from slurm_ckpt.cli.output import print_error, print_json
from slurm_ckpt.cli.plan_cluster import run_cluster_plan
from slurm_ckpt.cli.plan_strategies import StrategyOptions, checkpoint_bytes, run_strategy_plan
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.table import Column, Listing, OutputFormat, output_options, warn
from slurm_ckpt.core.planner import (
    Plan,
    PlanInputError,
    make_plan,
    parse_count,
)
from slurm_ckpt.core.units import format_bytes, format_duration, format_rate
from slurm_ckpt.errors import CkptError

_MATPLOTLIB_MISSING = "plot needs matplotlib: pip install matplotlib"


def _dur(seconds: Optional[float]) -> str:
    return "-" if seconds is None else format_duration(seconds)


def _rows(plan: Plan) -> List[Tuple[str, str, Any, str, str]]:
    """``(field, figure, raw value, value for people, note)`` per line of the plan;
    ``field`` is the plan's JSON name, ``raw`` its number (bytes, seconds, bytes/s)."""
    layout = "sharded" if plan.sharded else "replicated"
    bd = plan.size_breakdown
    size_note = (
        f"weights {format_bytes(bd.weights)} + master {format_bytes(bd.master_weights)} + "
        f"optimizer {format_bytes(bd.optimizer)} + rest {format_bytes(bd.extra)}"
        if bd
        else "given with --size"
    )
    writers = plan.nodes if plan.sharded else 1
    return [
        (
            "checkpoint_bytes",
            "checkpoint size",
            plan.checkpoint_bytes,
            format_bytes(plan.checkpoint_bytes),
            size_note,
        ),
        (
            "bytes_per_node",
            "bytes per node",
            plan.bytes_per_node,
            format_bytes(plan.bytes_per_node),
            f"{layout}: {plan.nodes} node(s), {writers} writing",
        ),
        (
            "local_write_s",
            "local write",
            plan.local_write_s,
            _dur(plan.local_write_s),
            "no local tier"
            if plan.local_bw is None
            else f"per node at {format_rate(plan.local_bw)}",
        ),
        (
            "pfs_write_s",
            "PFS write",
            plan.pfs_write_s,
            _dur(plan.pfs_write_s),
            f"all of it at {format_rate(plan.pfs_bw)}",
        ),
        (
            "save_cost_s",
            "save cost C",
            plan.save_cost_s,
            _dur(plan.save_cost_s),
            f"blocks training: {plan.save_cost_basis}",
        ),
        ("mtbi_s", "MTBI M", plan.mtbi_s, _dur(plan.mtbi_s), "mean time between interrupts"),
        (
            "young_interval_s",
            "Young interval",
            plan.young_interval_s,
            _dur(plan.young_interval_s),
            "sqrt(2CM)",
        ),
        (
            "daly_interval_s",
            "Daly interval",
            plan.daly_interval_s,
            _dur(plan.daly_interval_s),
            "Daly 2006, higher order",
        ),
        (
            "interval_s",
            "interval",
            plan.interval_s,
            _dur(plan.interval_s),
            "capped by max-loss" if plan.interval_basis == "max_loss" else "Daly",
        ),
        (
            "interval_tokens",
            "interval tokens",
            plan.interval_tokens,
            "-" if plan.interval_tokens is None else str(plan.interval_tokens),
            "-" if plan.tokens_per_s is None else f"at {plan.tokens_per_s:.0f} tokens/s",
        ),
        (
            "expected_loss_s",
            "expected loss / failure",
            plan.expected_loss_s,
            _dur(plan.expected_loss_s),
            "T/2 + restore from local",
        ),
        (
            "expected_loss_pfs_s",
            "expected loss, node lost",
            plan.expected_loss_pfs_s,
            _dur(plan.expected_loss_pfs_s),
            "N*T/2 + PFS lag + restore",
        ),
        (
            "overhead_fraction",
            "I/O overhead",
            plan.overhead_fraction,
            f"{plan.overhead_fraction:.1%}",
            f"C/T ({plan.wall_overhead_fraction:.1%} of wall time)",
        ),
        (
            "pfs_keeps_up",
            "PFS keeps up",
            plan.pfs_keeps_up,
            "yes" if plan.pfs_keeps_up else "no",
            "PFS write <= interval",
        ),
        (
            "flush_every",
            "flush_every",
            plan.flush_every,
            str(plan.flush_every),
            f"1 local checkpoint in {plan.flush_every} to the PFS, "
            f"every {format_duration(plan.pfs_interval_s)}",
        ),
    ]


PLAN_COLUMNS = [
    Column("figure", "figure", parsable=False),
    Column("field", "field", human=False),
    Column("shown", "value", right=True, parsable=False),
    Column("value", "value", human=False),
    Column("note", "note", wrap=True, drop=1, parsable=False),
]


def _print_table(plan: Plan, out: Optional[OutputFormat] = None) -> None:
    """The plan for people (or ``--parsable``: ``field|value`` with raw numbers: bytes,
    seconds); the warnings go to stderr either way."""
    rows = [
        {"field": f, "figure": name, "value": raw, "shown": shown, "note": note}
        for f, name, raw, shown, note in _rows(plan)
    ]
    Listing(PLAN_COLUMNS, rows, "checkpoint plan").print(out or OutputFormat())
    for w in plan.warnings:
        warn(w)


def _check_plot_path(plt: Any, path: str) -> None:
    """Refuse a file type matplotlib cannot write (``--plot x.txt``) before any work."""
    fig = plt.figure()
    try:
        types = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in types:
        raise PlanInputError(
            f"--plot {path}: cannot draw a {'.' + ext if ext else 'file without extension'}; "
            f"use one of {', '.join('.' + t for t in sorted(types))}"
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PlanInputError(f"--plot {path}: directory {parent} does not exist")


def _load_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanInputError(_MATPLOTLIB_MISSING) from None
    return plt


def _plot(plt, plan: Plan, path: str) -> None:
    """Expected loss per failure and I/O overhead against the interval."""
    c, m = plan.save_cost_s, plan.mtbi_s
    restore = plan.restore_local_s if plan.restore_local_s is not None else plan.restore_pfs_s
    hi = max(3.0 * plan.daly_interval_s, 2.0 * plan.interval_s, 4.0 * c)
    lo = min(c, plan.interval_s / 4.0)
    steps = 400
    xs = [lo + (hi - lo) * i / steps for i in range(steps + 1)]
    loss_min = [(t / 2.0 + restore) / 60.0 for t in xs]
    overhead = [100.0 * c / t for t in xs]
    waste = [100.0 * (c / t + (t / 2.0 + restore) / m) for t in xs]
    xm = [t / 60.0 for t in xs]

    fig, ax1 = plt.subplots(figsize=(8, 5))
    ax1.plot(xm, loss_min, color="tab:blue", label="expected loss per failure (min)")
    ax1.set_xlabel("checkpoint interval (min)")
    ax1.set_ylabel("expected loss per failure (min)", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(xm, overhead, color="tab:red", label="I/O overhead C/T (%)")
    ax2.plot(xm, waste, color="tab:gray", linestyle="--", label="C/T + (T/2+R)/M (%)")
    ax2.set_ylabel("overhead (%)", color="tab:red")
    ax2.set_ylim(0, min(100.0, 4.0 * min(waste)))
    for x, label, style in (
        (plan.young_interval_s, "Young", ":"),
        (plan.daly_interval_s, "Daly", "-."),
        (plan.interval_s, "chosen", "-"),
    ):
        ax1.axvline(x / 60.0, color="black", linestyle=style, linewidth=1, label=label)
    lines = ax1.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax1.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="center right", fontsize=8)
    ax1.set_title(
        f"checkpoint {plan.checkpoint_bytes / 1e9:,.0f} GB, C={format_duration(c)}, "
        f"M={format_duration(m)}"
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise CkptError(f"plot: cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


#: The largest --nodes a plan takes: beyond any cluster (a typo, not a plan).
MAX_NODES = 1_000_000


def _nodes(value: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise PlanInputError(f"--nodes: expected a whole number >= 1, got {value!r}") from None
    if n < 1:
        raise PlanInputError(f"--nodes: expected a whole number >= 1, got {value!r}")
    if n > MAX_NODES:
        raise PlanInputError(f"--nodes: at most {MAX_NODES:_} (no cluster is larger), got {value}")
    return n


@register(
    "plan",
    examples=(
        "ckpt-slurm plan --params 70e9 --local-bw 3GB/s --pfs-bw 500MB/s --mtbi 6h --max-loss "
        "30min",
        "ckpt-slurm plan --size 350GB --pfs-bw 2GB/s --mtbi 1-00:00:00 --parsable",
    ),
)
@click.command("plan")
@click.option("--params", metavar="COUNT", help="Model parameters: 70e9 or 70B.")
@click.option("--size", metavar="SIZE", help="Checkpoint size instead of --params: 350GB, 1.2TB.")
@click.option(
    "--precision",
    default="bf16",
    show_default=True,
    metavar="bf16|fp16|fp32",
    help="Precision of the trained weights.",
)
@click.option(
    "--optimizer",
    default="adamw",
    show_default=True,
    metavar="adam|adamw|sgd|none",
    help="Optimizer whose state is saved.",
)
@click.option(
    "--master-weights/--no-master-weights",
    default=None,
    help="fp32 master copy saved [default: yes below fp32].",
)
@click.option("--nodes", metavar="N", default="1", show_default=True, help="Nodes of the job.")
@click.option(
    "--sharded/--replicated",
    default=True,
    show_default=True,
    help="ZeRO/FSDP shards (every node writes 1/N) or DDP replicas (one writes all).",
)
@click.option(
    "--local-bw",
    metavar="RATE",
    help="Local NVMe write bandwidth per node: 3GB/s. Omit: no local tier.",
)
@click.option("--pfs-bw", metavar="RATE", help="PFS bandwidth for the job: 500MB/s.")
@click.option("--mtbi", metavar="DURATION", help="Mean time between interrupts: 6h.")
@click.option("--max-loss", metavar="DURATION", help="Most progress you can afford to lose: 30min.")
@click.option(
    "--tokens-per-s",
    metavar="COUNT",
    help="Training throughput, to express the interval in tokens.",
)
@click.option(
    "--restart-cost",
    metavar="DURATION",
    help="Restart/restore time per failure [default: tier read].",
)
@click.option(
    "--stall", metavar="DURATION", help="Training stall per save when saving asynchronously: 20s."
)
@click.option("--plot", "plot_path", metavar="FILE.png", help="Draw loss and overhead vs interval.")
@click.option(
    "--cluster",
    is_flag=True,
    help="Plan the whole site's flushes against the PFS (--jobs/--job, --pfs-bw, --node-bw).",
)
@click.option("--jobs", "jobs_file", metavar="FILE", help="--cluster: the jobs, TOML or JSON.")
@click.option(
    "--job",
    "job_flags",
    multiple=True,
    metavar="SPEC",
    help="--cluster: one job, nodes=64,size=20GB,interval=30min[,count=N] (repeatable).",
)
@click.option("--node-bw", metavar="RATE", help="--cluster: one node's flush rate: 5GB/s.")
@click.option("--share", metavar="PCT", help="--cluster: PFS share for checkpoints [70%].")
@click.option("--tenants", metavar="RATE", help="--cluster: other tenants' PFS demand.")
@click.option("--cap", metavar="N", help="--cluster: evaluate this max_nodes cap.")
@click.option("--jitter", metavar="DURATION", help="--cluster: evaluate this jitter.")
@click.option(
    "--strategies",
    is_flag=True,
    help="Goodput of PFS only, local + PFS, + partner copies, + restart in the allocation, "
    "+ in-job recovery from memory.",
)
@click.option("--node-mtbf", metavar="DURATION", help="--strategies: one node's MTBF: 150d.")
@click.option(
    "--node-loss-share", metavar="PCT", help="--strategies: failures that lose a node's disk [50%]."
)
@click.option("--queue-wait", metavar="DURATION", help="--strategies: requeue wait [10min].")
@click.option("--relaunch", metavar="DURATION", help="--strategies: relaunch on a spare [1min].")
@click.option("--init", metavar="DURATION", help="--strategies: job start-up per restart [2min].")
@click.option("--partner-bw", metavar="RATE", help="--strategies: node-to-node rate [--local-bw].")
@click.option("--pfs-node-bw", metavar="RATE", help="--strategies: one node's PFS read [--pfs-bw].")
@click.option("--gpus-per-node", metavar="N", help="--strategies: for GPU-hours [8].")
@click.option("--days", metavar="N", help="--strategies: run length for GPU-hours [30].")
@click.option("--gpu-hour-cost", metavar="PRICE", help="--strategies: price of a GPU-hour.")
@click.option("--ram-interval", metavar="DURATION", help="--strategies: RAM snapshot period [30s].")
@click.option("--detect", metavar="DURATION", help="--strategies: node loss found in [10s].")
@click.option("--reform", metavar="DURATION", help="--strategies: group re-formed in [30s].")
@click.option("--ram-cost", metavar="PCT", help="--strategies: RAM tier's share of step time [2%].")
@output_options
@click.pass_context
def plan(
    ctx: click.Context,
    params: Optional[str],
    size: Optional[str],
    precision: str,
    optimizer: str,
    master_weights: Optional[bool],
    nodes: str,
    sharded: bool,
    local_bw: Optional[str],
    pfs_bw: Optional[str],
    mtbi: Optional[str],
    max_loss: Optional[str],
    tokens_per_s: Optional[str],
    restart_cost: Optional[str],
    stall: Optional[str],
    plot_path: Optional[str],
    cluster: bool,
    jobs_file: Optional[str],
    job_flags: Tuple[str, ...],
    node_bw: Optional[str],
    share: Optional[str],
    tenants: Optional[str],
    cap: Optional[str],
    jitter: Optional[str],
    strategies: bool,
    node_mtbf: Optional[str],
    node_loss_share: Optional[str],
    queue_wait: Optional[str],
    relaunch: Optional[str],
    init: Optional[str],
    partner_bw: Optional[str],
    pfs_node_bw: Optional[str],
    gpus_per_node: Optional[str],
    days: Optional[str],
    gpu_hour_cost: Optional[str],
    ram_interval: Optional[str],
    detect: Optional[str],
    reform: Optional[str],
    ram_cost: Optional[str],
    out: OutputFormat,
) -> None:
    """Size the checkpoint, time each tier and choose how often to save.

    Sizes take a unit (350GB, 1.2TiB), rates too (500MB/s), durations as well (6h,
    1h30m, 1-00:00:00): a bare number is refused. Warnings go to stderr.

    With --cluster: do all the site's checkpoint flushes fit the PFS, and which
    [admission] cap and jitter keep them within a share of it. Example:
    ckpt-slurm plan --cluster --jobs site.toml --pfs-bw 1TB/s --node-bw 5GB/s --share 70%

    With --strategies: expected loss per failure, time to resume and goodput of PFS
    only, local + PFS, local + partner + PFS, a restart inside the allocation and
    recovery inside the job from the partner's memory (RAM tier, hot spare).
    Example: ckpt-slurm plan --strategies --params 70e9 --nodes 1024 --node-mtbf 150d
    --local-bw 3GB/s --pfs-bw 100GB/s --pfs-node-bw 500MB/s --partner-bw 12.5GB/s
    """
    if cluster:
        try:
            run_cluster_plan(
                jobs_file=jobs_file,
                job_flags=job_flags,
                pfs_bw=pfs_bw,
                node_bw=node_bw,
                share=share,
                tenants=tenants,
                cap=cap,
                jitter=jitter,
                out=out,
            )
        except CkptError as e:
            print_error(e)
            ctx.exit(e.exit_code)
        return
    if strategies:
        try:
            if pfs_bw is None:
                raise PlanInputError("--pfs-bw is required (PFS bandwidth, e.g. 500MB/s)")
            run_strategy_plan(
                size_bytes=checkpoint_bytes(params, size, precision, optimizer, master_weights),
                nodes=_nodes(nodes),
                sharded=sharded,
                mtbi=mtbi,
                pfs_bw=pfs_bw,
                local_bw=local_bw,
                stall=stall,
                max_loss=max_loss,
                opts=StrategyOptions(
                    node_mtbf=node_mtbf,
                    node_loss_share=node_loss_share,
                    queue_wait=queue_wait,
                    relaunch=relaunch,
                    init=init,
                    partner_bw=partner_bw,
                    pfs_node_bw=pfs_node_bw,
                    gpus_per_node=gpus_per_node,
                    days=days,
                    gpu_hour_cost=gpu_hour_cost,
                    ram_interval=ram_interval,
                    detect=detect,
                    reform=reform,
                    ram_cost=ram_cost,
                ),
                out=out,
            )
        except CkptError as e:
            print_error(e)
            ctx.exit(e.exit_code)
        return
    try:
        if pfs_bw is None:
            raise PlanInputError("--pfs-bw is required (PFS bandwidth, e.g. 500MB/s)")
        if mtbi is None:
            raise PlanInputError("--mtbi is required (mean time between interrupts, e.g. 6h)")
        if params is not None and size is not None:
            raise PlanInputError("give --params or --size, not both")
        plt = _load_pyplot() if plot_path else None
        if plt is not None:
            _check_plot_path(plt, plot_path)
        result = make_plan(
            params=None if params is None else parse_count(params, "--params"),
            size=size,
            precision=precision,
            optimizer=optimizer,
            master_weights=master_weights,
            local_bw=local_bw,
            pfs_bw=pfs_bw,
            nodes=_nodes(nodes),
            sharded=sharded,
            mtbi=mtbi,
            max_loss=max_loss,
            tokens_per_s=tokens_per_s,
            restart_cost=restart_cost,
            stall=stall,
        )
        if plt is not None:
            _plot(plt, result, plot_path)
    except CkptError as e:
        print_error(e)
        ctx.exit(e.exit_code)
        return
    if out.json:
        print_json(result.to_dict())
        for w in result.warnings:
            warn(w)
    else:
        _print_table(result, out)
    if plot_path and out.decorated:
        click.echo(f"plot written to {plot_path}")
