"""``ckpt-slurm plan --cluster``: parsing the site's jobs and printing the cluster plan.

The model is :mod:`slurm_ckpt.core.fleet_plan`; this module reads the jobs file (TOML or
JSON) and the ``--job`` flags, and prints a table (or ``--json``). The click options live
on the ``plan`` command in :mod:`slurm_ckpt.cli.plan`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from slurm_ckpt.cli.output import console, print_json
from slurm_ckpt.core.fleet_plan import (
    ClusterPlan,
    FleetJob,
    job_from_flag,
    jobs_from_doc,
    plan_cluster,
)
from slurm_ckpt.core.planner import PlanInputError
from slurm_ckpt.core.units import format_bytes, format_duration

if sys.version_info >= (3, 11):  # pragma: no cover - depends on the interpreter
    import tomllib as _toml
else:  # pragma: no cover
    import tomli as _toml

__all__ = ["load_jobs", "parse_share", "run_cluster_plan"]


def parse_share(text: Optional[str]) -> float:
    """``"70%"``, ``"0.7"`` or ``"70"`` -> 0.7."""
    if text is None:
        return 0.7
    raw = str(text).strip()
    try:
        value = float(raw.rstrip("%"))
    except ValueError:
        raise PlanInputError(f"--share: expected a percentage such as 70%, got {text!r}") from None
    if raw.endswith("%") or value > 1:
        value /= 100.0
    if not 0 < value <= 1:
        raise PlanInputError(f"--share: must be between 0% and 100%, got {text!r}")
    return value


def load_jobs(path: Optional[str], flags: Sequence[str]) -> List[FleetJob]:
    """The jobs of ``--jobs FILE`` (TOML ``[[jobs]]`` tables or JSON) and ``--job`` flags."""
    jobs: List[FleetJob] = []
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise PlanInputError(f"--jobs {path}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PlanInputError(f"--jobs {path}: not UTF-8 text") from None
        if path.endswith(".json"):
            try:
                doc = json.loads(text)
            except ValueError as exc:
                raise PlanInputError(f"--jobs {path}: JSON syntax error: {exc}") from None
        else:  # TOML, or JSON in a file not named .json
            try:
                doc = _toml.loads(text)
            except _toml.TOMLDecodeError as exc:
                try:
                    doc = json.loads(text)
                except ValueError:
                    raise PlanInputError(f"--jobs {path}: TOML syntax error: {exc}") from None
        jobs.extend(jobs_from_doc(doc, f"--jobs {path}"))
    jobs.extend(job_from_flag(f) for f in flags)
    if not jobs:
        raise PlanInputError(
            "plan --cluster: give the jobs with --jobs FILE or --job "
            "nodes=64,size=20GB,interval=30min (repeatable)"
        )
    return jobs


def _bw(bps: float) -> str:
    return f"{bps / 1e12:g} TB/s" if bps >= 1e12 else f"{bps / 1e9:g} GB/s"


def _print(plan: ClusterPlan) -> None:
    from rich.markup import escape
    from rich.table import Table

    out = console()
    verdict = "[green]fit[/green]" if plan.fits else "[red]do NOT fit[/red]"
    out.print(
        f"[bold]{plan.jobs} jobs on {plan.nodes:,} nodes, PFS {_bw(plan.pfs_bw)}:[/bold] "
        f"the checkpoint flushes {verdict} within {plan.share:.0%} of the PFS"
    )
    t = Table(title="cluster plan", show_lines=False)
    t.add_column("figure", style="bold")
    t.add_column("value", justify="right")
    t.add_column("note", style="dim")
    rows = [
        ("checkpoint traffic", f"{format_bytes(plan.bytes_per_hour)}/h", "all jobs together"),
        ("PFS utilisation", f"{plan.utilisation:.1%}", f"target share {plan.share:.0%}"),
        (
            "peak demand, no admission",
            f"{plan.peak_demand_uncapped / plan.pfs_bw:.0%}",
            f"biggest job at {_bw(plan.node_bw)} per node",
        ),
        ("[admission] max_nodes", str(plan.cap), plan.cap_basis),
        ("  or max_bandwidth", _bw(plan.max_bandwidth), f"{plan.share:.0%} of the PFS"),
        (
            "peak demand, with the cap",
            f"{plan.peak_demand_capped / plan.pfs_bw:.0%}",
            f"{plan.cap} x {_bw(plan.node_bw)}",
        ),
        ("[admission] jitter", format_duration(plan.jitter_s), plan.jitter_basis),
        (
            "  jitter without a cap",
            format_duration(plan.jitter_without_cap_s),
            "to keep the biggest burst under the share alone",
        ),
        ("wait for a slot", format_duration(plan.mean_wait_s), "mean over node flushes"),
        ("node flush", format_duration(plan.mean_flush_s), "mean: save -> on the PFS"),
        ("job flush", format_duration(plan.mean_job_flush_s), "mean: save -> last node done"),
        ("worst job flush", format_duration(plan.worst_job_flush_s), "the slowest job"),
    ]
    for name, value, note in rows:
        t.add_row(escape(name), escape(value), escape(note))
    out.print(t)
    jt = Table(title="per job: worst-case data at risk", show_lines=False)
    for col in ("job", "nodes", "per node", "interval", "job flush", "at risk", "work at risk"):
        jt.add_column(col, justify="left" if col == "job" else "right")
    for f in sorted(plan.per_job, key=lambda f: -f.checkpoint_bytes)[:20]:
        name = f.name if f.count == 1 else f"{f.name} (x{f.count})"
        jt.add_row(
            escape(name),
            str(f.nodes),
            format_bytes(f.bytes_per_node),
            format_duration(f.interval_s),
            format_duration(f.job_flush_s) + ("" if f.fits else " !"),
            format_bytes(f.at_risk_bytes),
            format_duration(f.at_risk_work_s),
        )
    out.print(jt)
    if len(plan.per_job) > 20:
        out.print(f"[dim]({len(plan.per_job) - 20} smaller jobs not shown; --json has all)[/dim]")
    for w in plan.warnings:
        out.print(f"[yellow]warning:[/yellow] {escape(w)}")


def run_cluster_plan(
    *,
    jobs_file: Optional[str],
    job_flags: Sequence[str],
    pfs_bw: Optional[str],
    node_bw: Optional[str],
    share: Optional[str],
    tenants: Optional[str],
    cap: Optional[str],
    jitter: Optional[str],
    as_json: bool,
) -> None:
    """Parse, plan, print. Raises :class:`PlanInputError` for bad input (exit code 2)."""
    if pfs_bw is None:
        raise PlanInputError("--pfs-bw is required (the PFS's total bandwidth, e.g. 1TB/s)")
    if node_bw is None:
        raise PlanInputError("--node-bw is required (one node's flush rate, e.g. 5GB/s)")
    cap_n: Optional[int] = None
    if cap is not None:
        try:
            cap_n = int(cap)
        except ValueError:
            raise PlanInputError(f"--cap: expected a whole number >= 1, got {cap!r}") from None
    jobs = load_jobs(jobs_file, job_flags)
    plan = plan_cluster(
        jobs,
        pfs_bw,
        node_bw,
        share=parse_share(share),
        tenants=tenants,
        cap=cap_n,
        jitter=jitter,
    )
    if as_json:
        print_json(plan.to_dict())
    else:
        _print(plan)
