"""``ckpt-slurm plan``: size checkpoints, time the tiers, choose the save interval.

The arithmetic lives in :mod:`slurm_ckpt.core.planner`; this module only parses options,
prints a rich table or JSON, and optionally draws a plot (matplotlib, if installed).
Bad input is reported as one line ``ckpt-slurm: error: ...`` on stderr with exit code 2,
also when the command is invoked on its own (tests, other groups).
"""

from __future__ import annotations

from typing import Optional, Tuple

import click

from slurm_ckpt.cli.output import console, print_error, print_json
from slurm_ckpt.cli.plan_cluster import run_cluster_plan
from slurm_ckpt.core.planner import (
    Plan,
    PlanInputError,
    make_plan,
    parse_count,
)
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError

_MATPLOTLIB_MISSING = "plot needs matplotlib: pip install matplotlib"


def _si(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def _bw(bps: float) -> str:
    if bps >= 1e9:
        return f"{bps / 1e9:g} GB/s"
    return f"{bps / 1e6:g} MB/s"


def _dur(seconds: Optional[float]) -> str:
    return "-" if seconds is None else format_duration(seconds)


def _rows(plan: Plan) -> list[tuple[str, str, str]]:
    layout = "sharded" if plan.sharded else "replicated"
    bd = plan.size_breakdown
    size_note = (
        f"weights {bd.weights / 1e9:,.0f} + master {bd.master_weights / 1e9:,.0f} + "
        f"optimizer {bd.optimizer / 1e9:,.0f} GB + rest {format_bytes(bd.extra)}"
        if bd
        else "given with --size"
    )
    writers = plan.nodes if plan.sharded else 1
    rows = [
        (
            "checkpoint size",
            f"{_si(plan.checkpoint_bytes)} ({format_bytes(plan.checkpoint_bytes)})",
            size_note,
        ),
        (
            "bytes per node",
            _si(plan.bytes_per_node),
            f"{layout}: {plan.nodes} node(s), {writers} writing",
        ),
        (
            "local write",
            _dur(plan.local_write_s),
            "no local tier" if plan.local_bw is None else f"per node at {_bw(plan.local_bw)}",
        ),
        ("PFS write", _dur(plan.pfs_write_s), f"all of it at {_bw(plan.pfs_bw)}"),
        ("save cost C", _dur(plan.save_cost_s), f"blocks training: {plan.save_cost_basis}"),
        ("MTBI M", _dur(plan.mtbi_s), "mean time between interrupts"),
        ("Young interval", _dur(plan.young_interval_s), "sqrt(2CM)"),
        ("Daly interval", _dur(plan.daly_interval_s), "Daly 2006, higher order"),
        (
            "interval",
            _dur(plan.interval_s),
            "capped by max-loss" if plan.interval_basis == "max_loss" else "Daly",
        ),
        (
            "interval tokens",
            "-" if plan.interval_tokens is None else f"{plan.interval_tokens:,}",
            "-" if plan.tokens_per_s is None else f"at {plan.tokens_per_s:,.0f} tokens/s",
        ),
        (
            "expected loss / failure",
            _dur(plan.expected_loss_s),
            "T/2 + restore from local",
        ),
        (
            "expected loss, node lost",
            _dur(plan.expected_loss_pfs_s),
            "N*T/2 + PFS lag + restore",
        ),
        (
            "I/O overhead",
            f"{plan.overhead_fraction:.1%}",
            f"C/T ({plan.wall_overhead_fraction:.1%} of wall time)",
        ),
        ("PFS keeps up", "yes" if plan.pfs_keeps_up else "no", "PFS write <= interval"),
        (
            "flush_every",
            str(plan.flush_every),
            f"1 local checkpoint in {plan.flush_every} to the PFS, "
            f"every {format_duration(plan.pfs_interval_s)}",
        ),
    ]
    return rows


def _print_table(plan: Plan) -> None:
    from rich.markup import escape
    from rich.table import Table

    out = console()
    table = Table(title="checkpoint plan", show_lines=False)
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note", style="dim")
    for name, value, note in _rows(plan):
        table.add_row(escape(name), escape(value), escape(note))
    out.print(table)
    for w in plan.warnings:
        out.print(f"[yellow]warning:[/yellow] {escape(w)}")


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


def _nodes(value: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise PlanInputError(f"--nodes: expected a whole number >= 1, got {value!r}") from None
    if n < 1:
        raise PlanInputError(f"--nodes: expected a whole number >= 1, got {value!r}")
    return n


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
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
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
    as_json: bool,
    plot_path: Optional[str],
    cluster: bool,
    jobs_file: Optional[str],
    job_flags: Tuple[str, ...],
    node_bw: Optional[str],
    share: Optional[str],
    tenants: Optional[str],
    cap: Optional[str],
    jitter: Optional[str],
) -> None:
    """Size the checkpoint, time each tier and choose how often to save.

    Example: ckpt-slurm plan --params 70e9 --local-bw 3GB/s --pfs-bw 500MB/s
    --mtbi 6h --max-loss 30min

    With --cluster: do all the site's checkpoint flushes fit the PFS, and which
    [admission] cap and jitter keep them within a share of it. Example:
    ckpt-slurm plan --cluster --jobs site.toml --pfs-bw 1TB/s --node-bw 5GB/s --share 70%
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
                as_json=as_json,
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
    if as_json:
        print_json(result.to_dict())
    else:
        _print_table(result)
        if plot_path:
            click.echo(f"plot written to {plot_path}")
